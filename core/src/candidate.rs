//! The per-tile winner of the Gumbel-max race and its merge rule.

/// A (perturbed score, vocabulary index) pair. The best candidate has the highest score; among
/// equal scores the lower index wins, so merging in any order or grouping gives one answer.
#[repr(C, align(8))]
#[derive(Clone, Copy, Debug, PartialEq)]
#[cfg_attr(not(target_arch = "nvptx64"), derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct Candidate {
    pub score: f32,
    pub index: u32,
}

impl Candidate {
    /// "No token": loses to every real candidate. A row whose scores are all −∞ or NaN ends
    /// with this, and the host reports it instead of inventing a token.
    pub const NONE: Candidate = Candidate { score: f32::NEG_INFINITY, index: u32::MAX };

    /// Offers `index` with `score`, where indices are offered in increasing order. A strict `>`
    /// then keeps the lowest index among ties; −∞ and NaN scores are never taken.
    #[inline(always)]
    pub fn offer_in_order(&mut self, score: f32, index: u32) {
        if score > self.score {
            *self = Candidate { score, index };
        }
    }

    /// The better of two candidates: higher score, then lower index. Associative and
    /// commutative, so tiles, warps and blocks may be merged in any tree.
    #[inline(always)]
    pub fn merge(self, other: Candidate) -> Candidate {
        if other.score > self.score || (other.score == self.score && other.index < self.index) { other } else { self }
    }
}

/// The score a token races with: `logit / T + g`, as `logit · (1/T) + g`; greedy rows
/// (`T = 0`) race with the plain logit. Both backends call this one function.
#[inline(always)]
pub fn perturbed_score(logit: f32, inv_temperature: f32, noise: f32) -> f32 {
    logit * inv_temperature + noise
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merge_prefers_score_then_lower_index() {
        let a = Candidate { score: 1.0, index: 7 };
        let b = Candidate { score: 1.0, index: 3 };
        let c = Candidate { score: 2.0, index: 9 };
        assert_eq!(a.merge(b), b);
        assert_eq!(b.merge(a), b);
        assert_eq!(a.merge(c), c);
        assert_eq!(c.merge(a), c);
        assert_eq!(Candidate::NONE.merge(a), a);
        assert_eq!(a.merge(Candidate::NONE), a);
    }

    #[test]
    fn offer_skips_nan_and_negative_infinity_and_keeps_first_tie() {
        let mut best = Candidate::NONE;
        best.offer_in_order(f32::NEG_INFINITY, 0);
        best.offer_in_order(f32::NAN, 1);
        assert_eq!(best, Candidate::NONE);
        best.offer_in_order(0.5, 2);
        best.offer_in_order(0.5, 3);
        best.offer_in_order(f32::NAN, 4);
        assert_eq!(best, Candidate { score: 0.5, index: 2 });
    }
}
