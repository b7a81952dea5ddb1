//! The per-tile winner of the Gumbel-max race, its merge rule, and the racing score.

/// The token slot of a draw that no token can win: every logit of the row is −∞ (excluded).
pub const NO_TOKEN: u32 = u32::MAX;
/// The token slot of a draw from a row with a NaN or +∞ logit (or a score that overflows):
/// the row's distribution is undefined, so no token is drawn.
pub const NON_FINITE_TOKEN: u32 = u32::MAX - 1;

/// A race entry: its exact perturbed score, the Philox word its noise came from, and its
/// vocabulary index. The best candidate has the highest score; among equal scores the higher
/// word (the larger noise: [`gumbel`] increases with the word) wins, then the lower index. So
/// merging in any order or grouping gives one answer, and where the temperature is so small
/// that `T · g` rounds away, rows with tied logits still pick among them by their noise, as
/// the distribution does.
///
/// [`gumbel`]: crate::gumbel::gumbel
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
#[cfg_attr(not(target_arch = "nvptx64"), derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct Candidate {
    /// The exact score the entry races with ([`perturbed_score`]; the plain logit for a
    /// greedy row): −∞ in [`Candidate::NONE`], +∞ in [`Candidate::NON_FINITE`].
    pub score: f32,
    /// The Philox word the entry's noise came from. 0 for greedy rows (no noise): their ties go
    /// to the lower index.
    pub word: u32,
    /// The entry's global vocabulary index, or [`NO_TOKEN`] or [`NON_FINITE_TOKEN`].
    pub index: u32,
}

impl Candidate {
    /// "No token": loses to every real candidate. A row whose logits are all −∞ ends with it,
    /// and its token slot holds [`NO_TOKEN`]. Its word is the largest, so an offered −∞ entry
    /// never takes its place.
    pub const NONE: Candidate = Candidate { score: f32::NEG_INFINITY, word: u32::MAX, index: NO_TOKEN };

    /// "Non-finite row": beats every candidate, so one NaN or +∞ score anywhere in a row makes
    /// the row's token [`NON_FINITE_TOKEN`] whichever tiles are merged first.
    pub const NON_FINITE: Candidate = Candidate { score: f32::INFINITY, word: u32::MAX, index: NON_FINITE_TOKEN };

    /// The candidate of one entry: [`Candidate::NON_FINITE`] for a NaN or +∞ score.
    #[inline(always)]
    pub fn scored(score: f32, word: u32, index: u32) -> Candidate {
        // One unordered-or-equal comparison on the GPU.
        if score.is_nan() || score == f32::INFINITY { Candidate::NON_FINITE } else { Candidate { score, word, index } }
    }

    /// Offers the entry `index`, where indices are offered in increasing order: the strict
    /// comparisons then keep the lowest index among full ties; −∞ scores are never taken, and
    /// NaN or +∞ makes the candidate [`Candidate::NON_FINITE`].
    #[inline(always)]
    pub fn offer_in_order(&mut self, score: f32, word: u32, index: u32) {
        let entry = Candidate::scored(score, word, index);
        if entry.score > self.score || (entry.score == self.score && entry.word > self.word) {
            *self = entry;
        }
    }

    /// The better of two candidates: higher score, then higher word, then lower index.
    /// Associative and commutative, so tiles, warps and blocks may be merged in any tree.
    #[inline(always)]
    pub fn merge(self, other: Candidate) -> Candidate {
        if other.beats(&self) { other } else { self }
    }

    /// Whether `self` wins over `other` in [`Candidate::merge`]'s order: higher score, then
    /// higher word, then lower index (strict: a candidate does not beat itself).
    #[inline(always)]
    pub fn beats(&self, other: &Candidate) -> bool {
        self.score > other.score
            || (self.score == other.score
                && (self.word > other.word || (self.word == other.word && self.index < other.index)))
    }
}

/// The score a token races with: `logit + T · g`, which orders tokens as `logit / T + g` does
/// for every `T > 0` and cannot overflow for a finite logit and `T ≤`
/// [`MAX_TEMPERATURE`](crate::noise::MAX_TEMPERATURE) short of `|logit|` within `T·23` of
/// `f32::MAX`. Greedy rows race with the plain logit. Both backends call this one function.
#[inline(always)]
pub fn perturbed_score(logit: f32, temperature: f32, noise: f32) -> f32 {
    logit + temperature * noise
}

/// The larger of two floats, NaN if either is NaN (IEEE 754-2019 `maximum`, up to the sign of
/// a zero): where a race only needs the largest estimate, a NaN must still reach the row's
/// status. One instruction on sm_80 and later (`max.NaN.f32`).
#[inline(always)]
pub fn maximum(a: f32, b: f32) -> f32 {
    #[cfg(target_arch = "nvptx64")]
    {
        // LLVM's generic `maximum` is expanded into compares and selects here; NVVM's own
        // intrinsic is the one instruction.
        unsafe extern "C" {
            #[link_name = "llvm.nvvm.fmax.nan.f"]
            fn nvvm_fmax_nan_f(a: f32, b: f32) -> f32;
        }
        // SAFETY: a pure arithmetic intrinsic.
        unsafe { nvvm_fmax_nan_f(a, b) }
    }
    #[cfg(not(target_arch = "nvptx64"))]
    {
        if a.is_nan() || b.is_nan() { f32::NAN } else { a.max(b) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merge_prefers_score_then_higher_word_then_lower_index() {
        let a = Candidate { score: 1.0, word: 5, index: 7 };
        let b = Candidate { score: 1.0, word: 5, index: 3 };
        let c = Candidate { score: 2.0, word: 0, index: 9 };
        let d = Candidate { score: 1.0, word: 6, index: 8 };
        assert_eq!(a.merge(b), b);
        assert_eq!(b.merge(a), b);
        assert_eq!(a.merge(c), c);
        assert_eq!(c.merge(a), c);
        assert_eq!(b.merge(d), d);
        assert_eq!(d.merge(b), d);
        assert_eq!(Candidate::NONE.merge(a), a);
        assert_eq!(a.merge(Candidate::NONE), a);
    }

    #[test]
    fn non_finite_beats_everything_and_none_loses_to_everything() {
        let top = Candidate { score: f32::MAX, word: u32::MAX, index: 0 };
        for other in [top, Candidate::NONE, Candidate::NON_FINITE, Candidate { score: -1.0, word: 3, index: 2 }] {
            assert_eq!(Candidate::NON_FINITE.merge(other), Candidate::NON_FINITE);
            assert_eq!(other.merge(Candidate::NON_FINITE), Candidate::NON_FINITE);
            assert_eq!(Candidate::NONE.merge(other), other);
        }
    }

    #[test]
    fn offer_skips_negative_infinity_flags_nan_and_infinity_and_breaks_ties_by_word() {
        let mut best = Candidate::NONE;
        best.offer_in_order(f32::NEG_INFINITY, 9, 0);
        assert_eq!(best, Candidate::NONE);
        best.offer_in_order(0.5, 4, 2);
        best.offer_in_order(0.5, 4, 3);
        assert_eq!(best, Candidate { score: 0.5, word: 4, index: 2 });
        best.offer_in_order(0.5, 8, 4);
        assert_eq!(best, Candidate { score: 0.5, word: 8, index: 4 });
        for bad in [f32::NAN, f32::INFINITY] {
            let mut flagged = best;
            flagged.offer_in_order(bad, 0, 5);
            assert_eq!(flagged, Candidate::NON_FINITE);
            flagged.offer_in_order(f32::MAX, u32::MAX, 6);
            assert_eq!(flagged, Candidate::NON_FINITE);
        }
    }

    #[test]
    fn maximum_propagates_nan() {
        assert!(maximum(f32::NAN, 1.0).is_nan());
        assert!(maximum(1.0, f32::NAN).is_nan());
        assert_eq!(maximum(f32::NEG_INFINITY, -3.0), -3.0);
        assert_eq!(maximum(2.0, f32::INFINITY), f32::INFINITY);
    }

    #[test]
    fn the_score_orders_as_logit_over_temperature_plus_noise() {
        // `logit / T` overflows at T = 1e-38; `logit + T·g` keeps 10 above 5.
        assert!(perturbed_score(10.0, 1e-38, -3.0) > perturbed_score(5.0, 1e-38, 22.0));
        assert_eq!(perturbed_score(2.0, 1.0, 0.25), 2.25);
    }
}
