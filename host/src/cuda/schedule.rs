//! The processing pipeline's schedule: which `process_rows` launches each segment of a
//! materialised call makes, and which reduction between the shards ends it.

use flashsample_core::abi::{SELECT_DIGITS, Selection};

/// One launch of the processing kernel in a pipeline's schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ProcessLaunch {
    /// After clearing the row states.
    Entries,
    /// In place of `Entries` where the GEMM wrote its maxima: after clearing the row states,
    /// the rows' largest logits from them (one block per row).
    Extrema,
    /// Adds a digit's histograms: to the row states (deciding there), or to the `k`-th
    /// histogram of the exchange (`histogram: Some(k)`).
    Select {
        selection: Selection,
        digit: u32,
        histogram: Option<usize>,
    },
    /// Decides a digit from the `k`-th histogram of the exchange (one block per row).
    Decide {
        selection: Selection,
        digit: u32,
        histogram: usize,
    },
    /// Lists a [`Selection::listed`] selection's members after its leading digits.
    Gather {
        selection: Selection,
    },
    /// Finishes a listed selection and its tie selection from the members (one block per row).
    Resolve {
        selection: Selection,
    },
    Apply,
}

/// What a segment of the processing pipeline ends with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SegmentEnd {
    /// The reduction of the exchange's extrema.
    Extrema,
    /// The reduction of the exchange's `k`-th histogram.
    Histogram(usize),
    /// Nothing: the pipeline is done.
    Last,
}

/// The launches of segment `segment` of the processing pipeline of rows that need
/// `selections` ([`Selection::bit`]s) and what ends it. Without an exchange, one segment: the
/// per-entry steps, each selection's [`Selection::leading_digits`] (each deciding in its last
/// slice), its gathering and its resolution (which makes its tie selection too), the
/// keep rule. With one: the per-entry steps, ended by the extrema's reduction; per exchanged
/// digit a segment that decides the digit before (from its reduced histograms) and adds this
/// one's, ended by its reduction; last, the last decision, the other selections (listed as
/// without an exchange) and the keep rule. Past the last segment: nothing. Without `apply` the
/// pipeline ends before the keep rule's launch, which the logits sampler then applies itself
/// (calls without log-probabilities and without an exchange). With `maxima` (rows without
/// per-entry steps, terms or an exchange, whose GEMM wrote its maxima) the rows' extrema come
/// from the maxima in place of the per-entry steps.
pub(crate) fn process_segment(
    selections: u32,
    exchange: bool,
    segment: usize,
    apply: bool,
    maxima: bool,
) -> (Vec<ProcessLaunch>, SegmentEnd) {
    // The digits of the exchanged selections the rows need, in order.
    let shared: Vec<(Selection, u32)> = Selection::ALL
        .into_iter()
        .filter(|s| selections & s.bit() != 0 && exchange && s.exchanged())
        .flat_map(|s| (0..SELECT_DIGITS).map(move |digit| (s, digit)))
        .collect();
    let last = if exchange { shared.len() + 1 } else { 0 };
    let mut launches = Vec::new();
    if segment > last {
        return (launches, SegmentEnd::Last);
    }
    if segment == 0 {
        launches.push(if maxima { ProcessLaunch::Extrema } else { ProcessLaunch::Entries });
        if exchange {
            return (launches, SegmentEnd::Extrema);
        }
    }
    if segment >= 2 {
        let (selection, digit) = shared[segment - 2];
        launches.push(ProcessLaunch::Decide { selection, digit, histogram: segment - 2 });
    }
    if segment >= 1
        && let Some(&(selection, digit)) = shared.get(segment - 1)
    {
        launches.push(ProcessLaunch::Select { selection, digit, histogram: Some(segment - 1) });
        return (launches, SegmentEnd::Histogram(segment - 1));
    }
    for selection in Selection::ALL {
        // The others: each listed one, its tie selection with it.
        if selections & selection.bit() == 0 || !selection.listed(exchange) {
            continue;
        }
        for digit in selection.leading_digits(exchange).0 {
            launches.push(ProcessLaunch::Select { selection, digit, histogram: None });
        }
        launches.push(ProcessLaunch::Gather { selection });
        launches.push(ProcessLaunch::Resolve { selection });
    }
    if apply {
        launches.push(ProcessLaunch::Apply);
    }
    (launches, SegmentEnd::Last)
}

#[cfg(test)]
mod tests {
    use super::*;
    use flashsample_core::abi::{COARSE_DIGIT, ShardExchangeLayout};

    /// The processing pipeline's schedule: without an exchange one segment of the per-entry
    /// steps (the extrema from the GEMM's maxima where it wrote them), for every selection but
    /// the tie selections in order its coarse key (top-k, top-p) or first two digits (the top
    /// raw entries), its gathering and its resolution, and the keep rule; with one the same
    /// launches but for the
    /// exchanged selections, whose every digit is added in the segment the reduction of its
    /// histogram ends and decided at the start of the next, the extrema reduced before any
    /// digit, as many segments as the plan counts, and nothing past them.
    #[test]
    fn the_pipeline_runs_in_segments_around_the_reductions() {
        let all = Selection::ALL.iter().fold(0, |bits, s| bits | s.bit());
        for selections in [0, Selection::TopK.bit(), Selection::TopP.bit() | Selection::TopPTie.bit(), all] {
            let listed = |keep: &dyn Fn(Selection) -> bool| -> Vec<ProcessLaunch> {
                let parents = [
                    (Selection::TopK, &[COARSE_DIGIT][..]),
                    (Selection::TopP, &[COARSE_DIGIT]),
                    (Selection::TopRaw, &[0, 1]),
                ];
                parents
                    .into_iter()
                    .filter(|&(s, _)| selections & s.bit() != 0 && keep(s))
                    .flat_map(|(selection, digits)| {
                        let digits = digits.iter().map(move |&digit| ProcessLaunch::Select {
                            selection,
                            digit,
                            histogram: None,
                        });
                        digits.chain([ProcessLaunch::Gather { selection }, ProcessLaunch::Resolve { selection }])
                    })
                    .collect()
            };
            let (alone, end) = process_segment(selections, false, 0, true, false);
            let mut want = vec![ProcessLaunch::Entries];
            want.extend(listed(&|_| true));
            assert_eq!(process_segment(selections, false, 0, false, false), (want.clone(), SegmentEnd::Last));
            want[0] = ProcessLaunch::Extrema;
            assert_eq!(process_segment(selections, false, 0, false, true), (want.clone(), SegmentEnd::Last));
            want[0] = ProcessLaunch::Entries;
            want.push(ProcessLaunch::Apply);
            assert_eq!((alone, end), (want, SegmentEnd::Last), "{selections:#b}");
            assert_eq!(process_segment(selections, false, 1, true, false), (Vec::new(), SegmentEnd::Last));

            let shared: Vec<(Selection, u32)> = Selection::ALL
                .into_iter()
                .filter(|&s| selections & s.bit() != 0 && s.exchanged())
                .flat_map(|s| (0..SELECT_DIGITS).map(move |d| (s, d)))
                .collect();
            let layout = ShardExchangeLayout::of(3, selections);
            assert_eq!(layout.digits as usize, shared.len(), "{selections:#b}");
            let segments = 2 + shared.len();
            let mut ends = Vec::new();
            let mut launches = Vec::new();
            for segment in 0..segments {
                let (mut some, end) = process_segment(selections, true, segment, true, false);
                launches.append(&mut some);
                ends.push(end);
            }
            let mut want_ends = vec![SegmentEnd::Extrema];
            want_ends.extend((0..shared.len()).map(SegmentEnd::Histogram));
            want_ends.push(SegmentEnd::Last);
            assert_eq!(ends, want_ends, "{selections:#b}");
            let mut want = vec![ProcessLaunch::Entries];
            for (k, &(selection, digit)) in shared.iter().enumerate() {
                want.push(ProcessLaunch::Select { selection, digit, histogram: Some(k) });
                want.push(ProcessLaunch::Decide { selection, digit, histogram: k });
            }
            want.extend(listed(&|s| !s.exchanged()));
            want.push(ProcessLaunch::Apply);
            assert_eq!(launches, want, "{selections:#b}");
            assert_eq!(process_segment(selections, true, segments, true, false), (Vec::new(), SegmentEnd::Last));
        }
    }
}
