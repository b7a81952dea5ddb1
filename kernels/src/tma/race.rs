//! The sampling race of the Hopper epilogues: estimate every score of a column's rows
//! (`flashsample_core::estimate`), find the best estimate over the lanes that hold the column,
//! and give exact scores only to the entries that may still win. Both epilogues run it over
//! their own lane layout: [`race_round`] for the consumers' quads (four lanes per column, `K`
//! quads at a time), [`estimate_column`] for the handoff warps' columns (eight lanes per column,
//! four quads per lane).

use flashsample_core::estimate::{BlockEstimate, block_estimate, contenders, exact_score, race_threshold};
use flashsample_core::{Candidate, RowParams};

use super::fragments::pick_of_four;
use super::handoff::{COLUMN_LANES, Deferred, LANE_QUADS};
use super::unrolled;
use crate::arch;

/// The smallest lane mask between lanes that hold the same column after [`transpose_quad`]:
/// lanes `l`, `l ^ 8`, `l ^ 16` and `l ^ 24` hold the column's 16 rows in a warp, so after
/// the merge over those lanes the lanes below this mask hold one result per column.
pub(super) const FIRST_COLUMN_LANE_MASK: u32 = 8;

/// The winners of `K` quads (four consecutive rows each, one column each) of draw `draw`
/// among the rows their column has in this warp: lanes `l ^ m` for the masks `m` = 8 and 16
/// hold the same column (the 16 rows of lanes `l`, `l ^ 8`, `l ^ 16`, `l ^ 24`, see
/// [`FIRST_COLUMN_LANE_MASK`]). Each lane returns its own best contender, exactly
/// scored, so merging those lanes gives what [`flashsample_core::block_candidate`] merged
/// over the rows gives.
///
/// Estimates first ([`flashsample_core::estimate`]): branch-free over the `K` quads, so the
/// scheduler interleaves their Philox chains and logarithms. Then only the contenders get
/// exact scores, one per loop trip and lane, usually a single trip per quad for the warp.
///
/// # Safety
/// All 32 lanes call it together; lanes `l ^ 8`, `l ^ 16` and `l ^ 24` hold the same
/// columns as lane `l`.
#[inline(always)]
pub(super) unsafe fn race_round<const K: usize>(
    row: &[RowParams; K],
    draw: u32,
    philox_block: u32,
    logits: &[[f32; 4]; K],
    rows_valid: u32,
    in_batch: [bool; K],
) -> [Candidate; K] {
    let mut estimates = [BlockEstimate::plain([0.0; 4], 0); K];
    // No early exit (as `any` would have): a loop with one keeps `row` out of registers.
    let mut sampling = false;
    unrolled!(k < K, {
        sampling |= in_batch[k] & (row[k].greedy == 0);
    });
    if sampling {
        unrolled!(k < K, {
            estimates[k] = block_estimate(&row[k], draw, philox_block, logits[k], rows_valid, arch::log2_approx);
        });
    } else {
        unrolled!(k < K, {
            estimates[k] = BlockEstimate::plain(logits[k], rows_valid);
        });
    }
    let mut pending = 0u32;
    unrolled!(k < K, {
        let mut best = estimates[k].best();
        let mut mask = FIRST_COLUMN_LANE_MASK;
        while mask <= 16 {
            // SAFETY: per this function's contract all 32 lanes are here together.
            let other = f32::from_bits(unsafe { arch::shuffle_xor(best.to_bits(), mask) });
            if other > best {
                best = other;
            }
            mask <<= 1;
        }
        if in_batch[k] {
            pending |= contenders(&estimates[k], race_threshold(&row[k], best)) << (4 * k);
        }
    });
    let mut winners = [Candidate::NONE; K];
    unrolled!(k < K, {
        let mut mask = (pending >> (4 * k)) & 0xf;
        // Lowest bit first: the entries are offered in increasing index order.
        while mask != 0 {
            let r = mask.trailing_zeros();
            mask &= mask - 1;
            let word = pick_of_four(estimates[k].words, r);
            let score = exact_score(&row[k], word, pick_of_four(logits[k], r));
            winners[k].offer_in_order(score, 4 * philox_block + r);
        }
    });
    winners
}

/// One lane's part of a column's race for one draw, after the estimates.
pub(super) struct LaneRace {
    pub(super) estimates: [BlockEstimate; LANE_QUADS],
    /// Bit `4i + r` set where entry `r` of quad `i` may hold the column's exact maximum.
    pub(super) contenders: u32,
}

impl LaneRace {
    /// The lowest contender of this lane (meaningless when it has none).
    #[inline(always)]
    pub(super) fn first_contender(&self, first_philox_block: u32, logits: &[[f32; 4]; LANE_QUADS]) -> Deferred {
        let bit = self.contenders.trailing_zeros();
        let (i, r) = (bit / 4, bit % 4);
        let (mut words, mut quad) = (self.estimates[0].words, logits[0]);
        unrolled!(q < LANE_QUADS, {
            if q as u32 == i {
                (words, quad) = (self.estimates[q].words, logits[q]);
            }
        });
        Deferred {
            word: pick_of_four(words, r),
            logit: pick_of_four(quad, r),
            index: 4 * (first_philox_block + COLUMN_LANES * i) + r,
            unused: 0,
        }
    }

    /// This lane's best exactly scored contender, offered in increasing index order.
    #[inline(always)]
    pub(super) fn exact_winner(
        &self,
        row: &RowParams,
        first_philox_block: u32,
        logits: &[[f32; 4]; LANE_QUADS],
    ) -> Candidate {
        let mut winner = Candidate::NONE;
        unrolled!(i < LANE_QUADS, {
            let mut pending = (self.contenders >> (4 * i)) & 0xf;
            while pending != 0 {
                let r = pending.trailing_zeros();
                pending &= pending - 1;
                let score = exact_score(row, pick_of_four(self.estimates[i].words, r), pick_of_four(logits[i], r));
                winner.offer_in_order(score, 4 * (first_philox_block + COLUMN_LANES * i as u32) + r);
            }
        });
        winner
    }
}

/// Estimates this lane's [`LANE_QUADS`] quads of one column for draw `draw` (Philox blocks
/// `first_block + COLUMN_LANES · i`), finds the best estimate of the [`COLUMN_LANES`] lanes
/// that hold the column's rows, and marks this lane's entries that may hold the column's exact maximum.
/// Exactly scoring those contenders and merging over the lanes gives what
/// [`flashsample_core::block_candidate`] merged over the column's rows gives.
///
/// The quads' estimates ([`flashsample_core::estimate`]) are independent chains the scheduler
/// interleaves.
///
/// # Safety
/// All 32 lanes call it together; the [`COLUMN_LANES`] lanes `l ^ m` (`m < COLUMN_LANES`)
/// hold one column.
#[inline(always)]
pub(super) unsafe fn estimate_column(
    row: &RowParams,
    draw: u32,
    first_philox_block: u32,
    logits: &[[f32; 4]; LANE_QUADS],
    vocab: u32,
) -> LaneRace {
    let mut estimates = [BlockEstimate::plain([0.0; 4], 0); LANE_QUADS];
    let philox_block = |i: usize| first_philox_block + COLUMN_LANES * i as u32;
    let valid = |i: usize| vocab.saturating_sub(4 * philox_block(i)).min(4);
    if row.greedy == 0 {
        unrolled!(i < LANE_QUADS, {
            estimates[i] = block_estimate(row, draw, philox_block(i), logits[i], valid(i), arch::log2_approx);
        });
    } else {
        unrolled!(i < LANE_QUADS, {
            estimates[i] = BlockEstimate::plain(logits[i], valid(i));
        });
    }
    let mut lane_best = estimates[0].best();
    unrolled!(i < LANE_QUADS, {
        lane_best = lane_best.max(estimates[i].best());
    });
    let mut best = lane_best;
    let mut mask = 1;
    while mask < COLUMN_LANES {
        // SAFETY: per this function's contract all 32 lanes are here together.
        best = best.max(f32::from_bits(unsafe { arch::shuffle_xor(best.to_bits(), mask) }));
        mask <<= 1;
    }
    let threshold = race_threshold(row, best);
    let mut bits = 0;
    // Usually only the lane holding the best estimate has contenders.
    if lane_best >= threshold {
        unrolled!(i < LANE_QUADS, {
            bits |= contenders(&estimates[i], threshold) << (4 * i);
        });
    }
    LaneRace { estimates, contenders: bits }
}
