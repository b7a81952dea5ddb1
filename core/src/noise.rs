//! Which Philox bits a draw uses: the mapping from a draw's identity to key and counter.
//!
//! The noise added to vocabulary entry `i` in draw number `draw` of a row is
//!
//! ```text
//! key     = [seed as u32, (seed >> 32) as u32]
//! counter = [i / 4, draw, step, sequence]
//! g       = gumbel(philox4x32_10(counter, key)[i % 4])
//! ```
//!
//! so one Philox call serves four consecutive vocabulary entries and all four output words are
//! used. Nothing else enters: not the tile shape, the launch configuration, the batch size nor
//! the row's position in the batch. Two rows get independent noise when their
//! `(seed, sequence, step)` differ in any field; `draw` tells apart the draws of one row in one
//! call. `i / 4 < 2²⁹` because the vocabulary is below 2³¹.
//!
//! Architecture Invariant: changing this mapping changes every sampled token; it is versioned
//! with the crate and documented in `ARCHITECTURE.md`.

use crate::candidate::{Candidate, perturbed_score};
use crate::gumbel::gumbel;
use crate::philox::{Counter, Key, philox4x32_10};

/// One row's sampling parameters as the kernels read them (C layout, 24 bytes, 8-aligned).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
#[cfg_attr(not(target_arch = "nvptx64"), derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct RowParams {
    /// The row's seed: its low and high 32 bits are Philox's key ([`key`]).
    pub seed: u64,
    /// Which independent sequence of the seed's noise this row draws from, e.g. a request id.
    pub sequence: u32,
    /// The decode step or position, so successive steps draw fresh noise.
    pub step: u32,
    /// `T`, in `(0, MAX_TEMPERATURE]`; read only when `greedy == 0`.
    pub temperature: f32,
    /// 1 for a greedy row (`T = 0`): the plain argmax, no noise.
    pub greedy: u32,
}

/// The largest temperature a row may have: `T · g` stays below `f32::MAX / 10` for every
/// noise `g`, so a score overflows only for a logit within `T · 23` of `f32::MAX`. (At
/// `T = 10³⁶` every logit below about 10²⁹ in size is lost in `T · g` anyway: the draw is
/// uniform over the allowed tokens, as `softmax(l / T)` is to f32 precision.)
pub const MAX_TEMPERATURE: f32 = 1e36;

/// Vocabulary entries served by one Philox call.
pub const ENTRIES_PER_BLOCK: u32 = 4;

/// Philox's key for a row's `seed`: its low 32 bits, then its high 32 bits.
#[inline(always)]
pub fn key(seed: u64) -> Key {
    [seed as u32, (seed >> 32) as u32]
}

/// Philox's counter for the vocabulary entries `4·philox_block .. 4·philox_block + 4` of
/// draw number `draw` of a row at decode step `step` in sequence `sequence` (see the module
/// docs).
#[inline(always)]
pub fn counter(philox_block: u32, draw: u32, step: u32, sequence: u32) -> Counter {
    [philox_block, draw, step, sequence]
}

/// Gumbel noise for the vocabulary entries `4·philox_block .. 4·philox_block + 4` of draw number `draw` of `row`.
#[inline(always)]
pub fn noise_block(row: &RowParams, draw: u32, philox_block: u32) -> [f32; 4] {
    let words = philox4x32_10(counter(philox_block, draw, row.step, row.sequence), key(row.seed));
    [gumbel(words[0]), gumbel(words[1]), gumbel(words[2]), gumbel(words[3])]
}

/// The racing scores of the vocabulary entries `4·philox_block .. 4·philox_block + 4` of draw
/// number `draw`, with their Philox words: `logit + T · g` for a sampling row; the plain logit
/// and word 0 for a greedy row (no noise drawn).
#[inline(always)]
pub fn block_scores(row: &RowParams, draw: u32, philox_block: u32, logits: [f32; 4]) -> ([f32; 4], [u32; 4]) {
    if row.greedy != 0 {
        return (logits, [0; 4]);
    }
    let words = philox4x32_10(counter(philox_block, draw, row.step, row.sequence), key(row.seed));
    let t = row.temperature;
    let scores = [
        perturbed_score(logits[0], t, gumbel(words[0])),
        perturbed_score(logits[1], t, gumbel(words[1])),
        perturbed_score(logits[2], t, gumbel(words[2])),
        perturbed_score(logits[3], t, gumbel(words[3])),
    ];
    (scores, words)
}

/// The winner among the first `valid` (≤ 4) entries of the block `4·philox_block .. 4·philox_block + 4` of
/// draw number `draw` by [`Candidate`]'s order: [`Candidate::NONE`] when every score is −∞,
/// [`Candidate::NON_FINITE`] when one is NaN or +∞. Every backend and kernel scores
/// vocabulary entries through this function or its filtered twin
/// ([`estimate`](crate::estimate)), which gives the same candidate.
#[inline(always)]
pub fn block_candidate(row: &RowParams, draw: u32, philox_block: u32, logits: [f32; 4], valid: u32) -> Candidate {
    let (scores, words) = block_scores(row, draw, philox_block, logits);
    let mut best = Candidate::NONE;
    for r in 0..4 {
        if (r as u32) < valid {
            best.offer_in_order(scores[r], words[r], ENTRIES_PER_BLOCK * philox_block + r as u32);
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(seed: u64, sequence: u32, step: u32) -> RowParams {
        RowParams { seed, sequence, step, temperature: 1.0, greedy: 0 }
    }

    #[test]
    fn every_field_of_the_identity_changes_the_noise() {
        let base = noise_block(&row(7, 3, 11), 5, 1000);
        assert_ne!(base, noise_block(&row(8, 3, 11), 5, 1000));
        assert_ne!(base, noise_block(&row(7 | 1 << 40, 3, 11), 5, 1000));
        assert_ne!(base, noise_block(&row(7, 4, 11), 5, 1000));
        assert_ne!(base, noise_block(&row(7, 3, 12), 5, 1000));
        assert_ne!(base, noise_block(&row(7, 3, 11), 6, 1000));
        assert_ne!(base, noise_block(&row(7, 3, 11), 5, 1001));
    }

    #[test]
    fn temperature_does_not_enter_the_noise() {
        let mut hot = row(1, 2, 3);
        hot.temperature = 4.0;
        assert_eq!(noise_block(&hot, 0, 9), noise_block(&row(1, 2, 3), 0, 9));
    }

    #[test]
    fn greedy_rows_race_with_plain_logits() {
        let mut greedy = row(1, 2, 3);
        greedy.greedy = 1;
        let logits = [0.5, -1.0, f32::NEG_INFINITY, 3.0];
        assert_eq!(block_scores(&greedy, 0, 0, logits), (logits, [0; 4]));
        let mut cold = row(1, 2, 3);
        cold.temperature = 0.5;
        let (sampled, words) = block_scores(&cold, 0, 0, logits);
        let noise = noise_block(&cold, 0, 0);
        assert_eq!(sampled[0], 0.5 + 0.5 * noise[0]);
        assert_eq!(noise, words.map(gumbel));
    }

    #[test]
    fn block_candidate_takes_only_valid_entries_and_the_first_of_ties() {
        let mut greedy = row(1, 2, 3);
        greedy.greedy = 1;
        let best = block_candidate(&greedy, 0, 10, [1.0, 3.0, 3.0, 9.0], 3);
        assert_eq!(best, Candidate { score: 3.0, word: 0, index: 41 });
        assert_eq!(block_candidate(&greedy, 0, 10, [1.0, 3.0, 3.0, 9.0], 0), Candidate::NONE);
        let sampled = block_candidate(&row(1, 2, 3), 4, 10, [0.0; 4], 4);
        let (noise, words) = (noise_block(&row(1, 2, 3), 4, 10), block_scores(&row(1, 2, 3), 4, 10, [0.0; 4]).1);
        let top = (0..4).fold(0, |b, r| if noise[r] > noise[b] { r } else { b });
        assert_eq!(sampled, Candidate { score: noise[top], word: words[top], index: 40 + top as u32 });
    }

    #[test]
    fn tied_logits_at_a_vanishing_temperature_go_to_the_largest_noise() {
        // At T = 1e-38, `T · g` is lost in a logit of 10: the scores tie, and the word decides.
        let mut cold = row(5, 6, 7);
        cold.temperature = 1e-38;
        let words = block_scores(&cold, 0, 3, [0.0; 4]).1;
        let best = block_candidate(&cold, 0, 3, [10.0, 10.0, 10.0, 4.0], 4);
        let top = (0..3).fold(0, |b, r| if words[r] > words[b] { r } else { b });
        assert_eq!(best, Candidate { score: 10.0, word: words[top], index: 12 + top as u32 });
    }

    #[test]
    fn nan_and_infinite_logits_make_the_block_non_finite() {
        for greedy in [0, 1] {
            let mut r = row(1, 2, 3);
            r.greedy = greedy;
            for bad in [f32::NAN, f32::INFINITY] {
                assert_eq!(block_candidate(&r, 0, 0, [1.0, bad, 2.0, 3.0], 4), Candidate::NON_FINITE);
                // Entries past the vocabulary are not read.
                assert_ne!(block_candidate(&r, 0, 0, [1.0, 2.0, 3.0, bad], 3), Candidate::NON_FINITE);
            }
            let excluded = [f32::NEG_INFINITY; 4];
            assert_eq!(block_candidate(&r, 0, 0, excluded, 4), Candidate::NONE);
        }
    }

    #[test]
    fn row_params_layout_is_the_one_the_kernels_read() {
        assert_eq!(core::mem::size_of::<RowParams>(), 24);
        assert_eq!(core::mem::align_of::<RowParams>(), 8);
    }
}
