//! A cheap first pass over the race that leaves the winner exactly as [`block_candidate`]
//! picks it.
//!
//! The exact noise ([`gumbel`]) costs two software logarithms with a division each. A kernel
//! first scores every entry with [`score_estimate`], which takes the hardware's approximate
//! base-2 logarithm and fused multiply-adds, and whose noise part ([`gumbel_estimate`]) is off
//! by at most [`GUMBEL_ESTIMATE_ERROR`]. Among entries whose estimated scores top out at `m`,
//! only those estimated at or above [`race_threshold`]`(m)` can hold the exact maximum, so only
//! they get the exact noise ([`contenders`], [`exact_entry`]); the rest lose to the exact
//! winner whatever their exact scores are.
//!
//! Why the threshold is safe. Let `s = fl(l + fl(T·g))` be an exact score and
//! `s' = fl(T·g' + l)` its estimate (a fused multiply-add, with `g' = fl(c − ln 2 · L)` the
//! [`gumbel_estimate`], `c = −ln ln 2`), and `δ` the bound on `|g' − g|`. Each rounding is
//! within 2⁻²⁴ relative or 2⁻¹⁵⁰ absolute (subnormal results, which tiny `T` gives), and
//! `|g| < 23`, so `|s − s'| ≤ T·δ + 2⁻²⁴(23·T + |s| + |s'|) + 3·2⁻¹⁵⁰`, which for entries near
//! the largest estimate `m` is at most `E = T·(δ + 2⁻¹⁹) + 2⁻²³·|m| + 2⁻¹⁴⁸`. If `k` holds
//! `m` and `j` the exact maximum, `s'_j ≥ s_j − E ≥ s_k − E ≥ m − 2E`, and the margin
//! `3δ·T + 2⁻²⁰·|m| + 2⁻¹⁴⁰` covers `2E` (`δ = 2⁻¹⁴ > 2⁻¹⁸`) with room for the roundings of
//! the margin and of `m − margin` itself. Entries tied with the exact maximum pass too, so
//! [`Candidate`]'s tie rules still pick the winner.
//!
//! Non-finite entries: an estimate is NaN exactly when the logit is NaN, and a NaN reaches
//! the row's best estimate ([`maximum`]), whose threshold is then NaN and lets every entry
//! contend; the exact scores then make the row [`Candidate::NON_FINITE`]. An entry whose exact
//! score is +∞ (a +∞ logit, or an overflow within `T·23` of `f32::MAX`) is estimated at or
//! near `f32::MAX`, which is why an infinite best estimate of a sampling row counts as
//! `f32::MAX`: every such entry then contends.
//!
//! Architecture Invariant: the estimate only decides which entries get the exact score; every
//! score a candidate carries is an exact one, so tokens are bit-identical with and without the
//! filter, on every backend. That is why this module alone may use a hardware logarithm and
//! `mul_add`: its results never reach a token, only the bound does.
//!
//! Architecture Invariant: [`GUMBEL_ESTIMATE_ERROR`] bounds the estimate for the `log2` a
//! kernel passes; for `lg2.approx.ftz.f32` on sm_90 the GPU test
//! `gumbel_estimate_is_within_its_bound_for_every_word` checks all 2³² words.
//!
//! [`block_candidate`]: crate::noise::block_candidate
//! [`gumbel`]: crate::gumbel::gumbel

use core::f32::consts::{LN_2, LOG2_E};

/// `a · b + c` rounded once (IEEE `fma`), the same function on the GPU and the host.
#[inline(always)]
fn mul_add(a: f32, b: f32, c: f32) -> f32 {
    #[cfg(target_arch = "nvptx64")]
    {
        core::f32::math::mul_add(a, b, c)
    }
    #[cfg(not(target_arch = "nvptx64"))]
    {
        std::primitive::f32::mul_add(a, b, c)
    }
}

use crate::candidate::{Candidate, maximum, perturbed_score};
use crate::gumbel::{TWO_POW_NEG_33, gumbel};
use crate::noise::{RowParams, counter, key};
use crate::philox::philox4x32_10;

/// Bound on `|gumbel_estimate(x) − gumbel(x)|` over every word `x` (2⁻¹⁴). The analysis of
/// the estimate with `log2` within 2⁻²² absolute on [½, 2] and 2 ulp elsewhere gives about
/// 1.3·10⁻⁵; the margin is for hardware that is a little worse than documented.
pub const GUMBEL_ESTIMATE_ERROR: f32 = 1.0 / 16384.0;

/// Where `1 − t` would round away too many of `t`'s digits, `−ln(1 − t)` comes from its series.
const SERIES_BELOW: f32 = 1.0 / 32.0;

/// `−ln ln 2`: the noise is `−ln e = c − ln 2 · log₂(e · log₂ e)`.
const NOISE_OFFSET: f32 = 0.366_512_92;

/// `log₂(e · log₂ e)` for the word's Exp(1) variate `e`, from an approximate base-2
/// logarithm, with no division.
///
/// Same uniform as [`gumbel`]: `t = (2y + 1)·2⁻³³ ≤ ½` with `y = x` in the lower half, where
/// `e · log₂ e = −log₂ t`, and `y = !x` in the upper one, where `e · log₂ e = −log₂(1 − t)`:
/// for `t < 1/32` that is `log₂ e · (t + t²/2 + t³/3 + t⁴/4)` (relative error below 2⁻²²),
/// otherwise `log2` of `1 − t`, whose rounding costs at most 2⁻²⁴ absolute on `e ≥ 0.031`.
/// Folding `log₂ e` into the series spares the multiplication by `−ln 2` between the two
/// logarithms.
#[inline(always)]
fn log2_scaled_exponential(x: u32, log2: impl Fn(f32) -> f32) -> f32 {
    let upper = x >= 0x8000_0000;
    let y = if upper { !x } else { x };
    let t = (y.wrapping_mul(2) | 1) as f32 * TWO_POW_NEG_33;
    let series = t * mul_add(t, mul_add(t, mul_add(t, LOG2_E / 4.0, LOG2_E / 3.0), LOG2_E / 2.0), LOG2_E);
    let from_log = -log2(if upper { 1.0 - t } else { t });
    log2(if upper && t < SERIES_BELOW { series } else { from_log })
}

/// An estimate of [`gumbel`]`(x)`, within [`GUMBEL_ESTIMATE_ERROR`] (what the bound and the
/// GPU test measure; the race itself uses [`score_estimate`]).
#[inline(always)]
pub fn gumbel_estimate(x: u32, log2: impl Fn(f32) -> f32) -> f32 {
    mul_add(log2_scaled_exponential(x, log2), -LN_2, NOISE_OFFSET)
}

/// The estimated racing score of a sampling row's entry with logit `logit` and Philox word
/// `x`: `logit + T · gumbel_estimate(x)` in two fused multiply-adds (the module docs bound its
/// distance to the exact score).
#[inline(always)]
pub fn score_estimate(logit: f32, temperature: f32, x: u32, log2: impl Fn(f32) -> f32) -> f32 {
    mul_add(temperature, gumbel_estimate(x, log2), logit)
}

/// The Philox words of a four-entry block and the estimated racing scores of its entries.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockEstimate {
    /// The block's Philox words: entry `r`'s noise comes from `words[r]` (all 0 in
    /// [`BlockEstimate::plain`]), which [`exact_entry`] turns into its exact score.
    pub words: [u32; 4],
    /// [`score_estimate`]; the plain logit for a greedy row (exact);
    /// −∞ for entries past the vocabulary.
    pub scores: [f32; 4],
}

/// Estimates the racing scores of the entries `4·philox_block ..` of draw number `draw`, of which the first
/// `valid` exist. Branch-free: Philox runs for greedy rows too, so a kernel can interleave
/// several blocks; a caller with only greedy rows can skip it (see [`BlockEstimate::plain`]).
#[inline(always)]
pub fn block_estimate(
    row: &RowParams,
    draw: u32,
    philox_block: u32,
    logits: [f32; 4],
    valid: u32,
    log2: impl Fn(f32) -> f32 + Copy,
) -> BlockEstimate {
    let words = philox4x32_10(counter(philox_block, draw, row.step, row.sequence), key(row.seed));
    let mut scores = [f32::NEG_INFINITY; 4];
    for r in 0..4 {
        let noisy = score_estimate(logits[r], row.temperature, words[r], log2);
        let score = if row.greedy != 0 { logits[r] } else { noisy };
        scores[r] = if (r as u32) < valid { score } else { f32::NEG_INFINITY };
    }
    BlockEstimate { words, scores }
}

impl BlockEstimate {
    /// The estimate of a greedy row's block: its logits, which are its exact scores.
    #[inline(always)]
    pub fn plain(logits: [f32; 4], valid: u32) -> BlockEstimate {
        let mut scores = [f32::NEG_INFINITY; 4];
        for r in 0..4 {
            scores[r] = if (r as u32) < valid { logits[r] } else { f32::NEG_INFINITY };
        }
        BlockEstimate { words: [0; 4], scores }
    }

    /// The largest estimated score: NaN if any is NaN (a NaN logit), −∞ when none is above it.
    #[inline(always)]
    pub fn best(&self) -> f32 {
        // The sign of a zero maximum does not matter here.
        let mut best = f32::NEG_INFINITY;
        for r in 0..4 {
            best = maximum(best, self.scores[r]);
        }
        best
    }
}

/// The smallest margin below the best estimate, 2⁻¹⁴⁰ (subnormal; see the module docs).
const MARGIN_FLOOR: f32 = f32::from_bits(1 << 9);

/// The lowest estimate an entry may have and still hold the exact maximum, given the largest
/// estimate `best` ([`BlockEstimate::best`]) among the entries that race together. A greedy
/// row's estimates are exact. NaN when `best` is (every entry contends); +∞ when every entry
/// is −∞ (none does, past the NaN and +∞ ones).
#[inline(always)]
pub fn race_threshold(row: &RowParams, best: f32) -> f32 {
    if best == f32::NEG_INFINITY {
        // Every entry is −∞: none can win.
        return f32::INFINITY;
    }
    if row.greedy != 0 {
        return best;
    }
    // An estimate of +∞ may belong to an exact score just below it (module docs).
    let best = if best == f32::INFINITY { f32::MAX } else { best };
    let magnitude = if best < 0.0 { -best } else { best };
    best - (3.0 * GUMBEL_ESTIMATE_ERROR * row.temperature + magnitude * (1.0 / 1_048_576.0) + MARGIN_FLOOR)
}

/// Bit `r` set for each entry of the block that may hold the exact maximum: estimated at or
/// above `threshold` (from [`race_threshold`]), or unordered with it (a NaN estimate or
/// threshold), so that NaN logits always reach the exact scores.
#[inline(always)]
pub fn contenders(estimate: &BlockEstimate, threshold: f32) -> u32 {
    let mut mask = 0;
    for r in 0..4 {
        if may_contend(estimate.scores[r], threshold) {
            mask |= 1 << r;
        }
    }
    mask
}

/// `estimate ≥ threshold`, or either is NaN (one unordered-or-greater-equal comparison on the
/// GPU): the rule of [`contenders`], for a single estimate.
#[inline(always)]
pub fn may_contend(estimate: f32, threshold: f32) -> bool {
    estimate >= threshold || estimate.is_nan() || threshold.is_nan()
}

/// The exact racing score and tie-break word of one entry from its Philox word: what
/// [`block_candidate`] gives it (a greedy row's word is 0).
///
/// [`block_candidate`]: crate::noise::block_candidate
#[inline(always)]
pub fn exact_entry(row: &RowParams, word: u32, logit: f32) -> (f32, u32) {
    if row.greedy != 0 { (logit, 0) } else { (perturbed_score(logit, row.temperature, gumbel(word)), word) }
}

/// Offers the entries `bits` (bit `r`: entry `r`) of a four-entry block to `winner` with their
/// exact scores, lowest index first; entry `r` is vocabulary index `first_index + r`. The last
/// step of the race every filtered epilogue runs: its contenders, exactly scored.
#[inline(always)]
pub fn offer_contenders(
    winner: &mut Candidate,
    row: &RowParams,
    estimate: &BlockEstimate,
    logits: [f32; 4],
    bits: u32,
    first_index: u32,
) {
    let mut pending = bits;
    while pending != 0 {
        let r = pending.trailing_zeros();
        pending &= pending - 1;
        let (score, word) = exact_entry(row, pick_of_four(estimate.words, r), pick_of_four(logits, r));
        winner.offer_in_order(score, word, first_index + r);
    }
}

/// `values[r]` through selects with constant indices (on the GPU an indexed load would move
/// the array to local memory).
#[inline(always)]
pub fn pick_of_four<T: Copy>(values: [T; 4], r: u32) -> T {
    let [v0, v1, v2, v3] = values;
    let low = if r & 1 != 0 { v1 } else { v0 };
    let high = if r & 1 != 0 { v3 } else { v2 };
    if r & 2 != 0 { high } else { low }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::noise::{MAX_TEMPERATURE, block_candidate};
    use crate::philox::philox4x32_10;
    use crate::testing::worst_log2;
    use std::vec::Vec;

    fn words() -> Vec<u32> {
        let mut w: Vec<u32> = (0..4096).chain(u32::MAX - 4095..=u32::MAX).collect();
        w.extend((0..=u16::MAX as u32).map(|i| i.wrapping_mul(65_537).wrapping_add(0x9e37_79b9)));
        for edge in [1u32 << 31, ((1u64 << 32) as f64 * (1.0 - SERIES_BELOW as f64)) as u32] {
            w.extend(edge - 64..edge + 64);
        }
        w
    }

    #[test]
    fn estimate_is_within_the_bound_with_a_worst_case_log2() {
        for sign in [-1.0, 1.0] {
            let log2 = worst_log2(sign);
            let worst = words().into_iter().map(|x| (gumbel_estimate(x, log2) - gumbel(x)).abs()).fold(0.0, f32::max);
            assert!(worst <= GUMBEL_ESTIMATE_ERROR / 2.0, "error {worst} with log2 off by {sign}");
        }
    }

    /// Entries race in groups of four blocks (as four lanes do on the GPU): the filtered
    /// winner of each group equals the exact one, score and index, for near-ties too.
    fn filtered_matches_exact(row: RowParams, logit_of: impl Fn(u32) -> f32) {
        for sign in [-1.0, 1.0] {
            let log2 = worst_log2(sign);
            for group in 0..2000u32 {
                let blocks: Vec<u32> = (0..4).map(|b| 4 * group + b).collect();
                let logits: Vec<[f32; 4]> =
                    blocks.iter().map(|&b| core::array::from_fn(|r| logit_of(4 * b + r as u32))).collect();
                let valid = |b: u32| if b == 4 * 1999 + 3 { 2 } else { 4 };
                let mut exact = Candidate::NONE;
                let estimates: Vec<BlockEstimate> =
                    blocks.iter().zip(&logits).map(|(&b, &l)| block_estimate(&row, 3, b, l, valid(b), log2)).collect();
                let best = estimates.iter().map(BlockEstimate::best).fold(f32::NEG_INFINITY, maximum);
                let threshold = race_threshold(&row, best);
                let mut filtered = Candidate::NONE;
                for ((&b, l), estimate) in blocks.iter().zip(&logits).zip(&estimates) {
                    exact = exact.merge(block_candidate(&row, 3, b, *l, valid(b)));
                    let mut own = Candidate::NONE;
                    offer_contenders(&mut own, &row, estimate, *l, contenders(estimate, threshold), 4 * b);
                    filtered = filtered.merge(own);
                }
                assert_eq!(filtered, exact, "group {group}");
            }
        }
    }

    fn sampling_row(temperature: f32) -> RowParams {
        RowParams { seed: 99, sequence: 4, step: 7, temperature, greedy: 0 }
    }

    #[test]
    fn filter_keeps_the_exact_winner_for_spread_logits() {
        filtered_matches_exact(sampling_row(1.0), |i| (i.wrapping_mul(2_654_435_761) % 1000) as f32 * 0.01);
        filtered_matches_exact(sampling_row(20.0), |i| (i.wrapping_mul(2_654_435_761) % 1000) as f32 * -3.7 - 4000.0);
    }

    #[test]
    fn filter_keeps_the_exact_winner_among_near_ties() {
        // Equal logits: the race is decided by the noise alone, often by a few ulps.
        filtered_matches_exact(sampling_row(1.0), |_| 2.5);
        filtered_matches_exact(sampling_row(1.0), |i| if i % 3 == 0 { f32::NEG_INFINITY } else { 1e6 });
    }

    #[test]
    fn filter_keeps_the_exact_winner_when_scores_differ_by_less_than_the_estimate_error() {
        // Logits that cancel each entry's exact noise, plus offsets of the order of the
        // estimate's error: the estimates often rank the entries wrongly, and only the
        // threshold's margin keeps the exact winner among the contenders.
        let row = sampling_row(1.0);
        let noise = move |i: u32| {
            gumbel(philox4x32_10(counter(i / 4, 3, row.step, row.sequence), key(row.seed))[i as usize % 4])
        };
        let offset = |i: u32| ((i.wrapping_mul(2_654_435_761) >> 16) % 64) as f32 * (GUMBEL_ESTIMATE_ERROR / 16.0);
        filtered_matches_exact(row, move |i| 8.0 - noise(i) + offset(i));
        filtered_matches_exact(row, move |i| -300.0 - noise(i) + 4.0 * offset(i));
    }

    #[test]
    fn filter_handles_greedy_and_infinite_rows() {
        let greedy = RowParams { greedy: 1, ..sampling_row(1.0) };
        filtered_matches_exact(greedy, |i| (i % 7) as f32);
        filtered_matches_exact(sampling_row(1.0), |i| if i % 5 == 2 { f32::INFINITY } else { 0.0 });
        filtered_matches_exact(sampling_row(1.0), |_| f32::NEG_INFINITY);
        filtered_matches_exact(sampling_row(1.0), |i| if i % 2 == 0 { f32::NAN } else { -1.0 });
    }

    #[test]
    fn filter_keeps_the_exact_winner_at_extreme_temperatures() {
        let spread = |i: u32| (i.wrapping_mul(2_654_435_761) % 1000) as f32 * 0.01;
        let few_values = |i: u32| (i.wrapping_mul(2_654_435_761) % 3) as f32;
        for t in [1e-45, 1e-38, 1e-30, 1e-6, 1e6, 1e30, MAX_TEMPERATURE] {
            filtered_matches_exact(sampling_row(t), spread);
            // Many exact ties in the logits: the noise decides among them however small T is.
            filtered_matches_exact(sampling_row(t), few_values);
            filtered_matches_exact(sampling_row(t), |_| 0.0);
            filtered_matches_exact(sampling_row(t), |i| if i % 9 == 4 { f32::MAX } else { -f32::MAX });
        }
    }

    #[test]
    fn filter_finds_every_non_finite_logit() {
        for t in [1e-38, 1.0, 1e30] {
            filtered_matches_exact(sampling_row(t), |i| if i == 4321 { f32::NAN } else { (i % 13) as f32 });
            filtered_matches_exact(sampling_row(t), |i| if i == 77 { f32::INFINITY } else { (i % 13) as f32 });
            filtered_matches_exact(sampling_row(t), |i| if i % 2 == 0 { f32::NEG_INFINITY } else { f32::NAN });
        }
    }

    #[test]
    fn estimate_words_are_the_noise_words() {
        let row = sampling_row(1.0);
        let estimate = block_estimate(&row, 5, 77, [0.0; 4], 4, worst_log2(1.0));
        assert_eq!(estimate.words, philox4x32_10(counter(77, 5, row.step, row.sequence), key(row.seed)));
    }
}
