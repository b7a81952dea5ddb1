//! The sampling race of the Hopper epilogues, written once: estimate every score of a lane's
//! quads (`flashsample_core::estimate`), find each column's best estimate over the lanes that
//! share the column, and give exact scores only to the entries that may still win. Three
//! steps, composed by both epilogues over their own lane layouts:
//! - [`estimate_quads`]: the estimates of a lane's quads, branch-free so that the scheduler
//!   interleaves their Philox chains and logarithms;
//! - [`column_best`] (shared with the `mma.sync` tiles' race): a column's best estimate over
//!   the lanes that hold its rows;
//! - `flashsample_core::estimate::offer_contenders`: a quad's contenders, exactly scored,
//!   offered in index order (the core's own test of the filter runs the same function).
//!
//! [`race_round`] is the consumers' race (`K` quads of `K` columns per lane; lanes `l ^ 8`,
//! `l ^ 16`, `l ^ 24` share a column: [`FIRST_COLUMN_LANE_MASK`]), [`estimate_column`] and
//! [`LaneRace`] the handoff warps' ([`LANE_QUADS`] quads of one column per lane;
//! [`COLUMN_LANES`] lanes share a column; a lane's sole contender waits as a [`Deferred`]).
//! Both lane layouts are defined here, with the race they serve: the epilogues import them,
//! and this module imports neither epilogue.

use flashsample_core::abi::HANDOFF_ROWS;
use flashsample_core::candidate::maximum;
use flashsample_core::estimate::{
    BlockEstimate, block_estimate, contenders, may_contend, offer_contenders, pick_of_four, race_threshold,
};
use flashsample_core::{Candidate, RowParams};

use crate::sample::column_best;
use crate::{arch, each_index};

/// The smallest lane mask between lanes that hold the same column after
/// [`transpose_quad`](super::fragments::transpose_quad): lanes `l`, `l ^ 8`, `l ^ 16` and
/// `l ^ 24` hold the column's 16 rows in a warp, so after the merge over those lanes the lanes
/// below this mask hold one result per column.
pub(super) const FIRST_COLUMN_LANE_MASK: u32 = 8;

/// Lanes that race one batch column together in the handoff tile's epilogue warps: lane `l`
/// races column `l / 8` of the warp's current group of four columns, quads `l % 8 + 8i` of it.
/// Four quads per lane give four independent Philox chains that share one key schedule
/// (sixteen lanes with two quads each ran 1.5–2.6 % slower at B = 256, docs/PERF.md).
pub(super) const COLUMN_LANES: u32 = 8;
/// Quads (four consecutive rows) of one column each lane races in the handoff tile's epilogue
/// warps: together the [`COLUMN_LANES`] lanes hold the item's `HANDOFF_ROWS` rows.
pub(super) const LANE_QUADS: usize = (HANDOFF_ROWS / 4 / COLUMN_LANES) as usize;

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
    // No early exit (as `any` would have): a loop with one keeps `row` out of registers.
    let mut sampling = false;
    each_index!(k < K, {
        sampling |= in_batch[k] & (row[k].greedy == 0);
    });
    let estimates = estimate_quads::<K>(|k| &row[k], sampling, draw, |_| philox_block, logits, |_| rows_valid);
    let mut pending = 0u32;
    each_index!(k < K, {
        // SAFETY: per this function's contract all 32 lanes are here together, and the lanes
        // `l ^ 8`, `l ^ 16`, `l ^ 24` hold column `k`'s other rows.
        let best = unsafe { column_best(estimates[k].best(), FIRST_COLUMN_LANE_MASK, 16) };
        if in_batch[k] {
            // `K ≤ 8` quads of four bits fill `pending`; the wrapping shift keeps the arms that
            // `each_index!` drops for larger `k` free of an overflow in constant evaluation.
            pending |= contenders(&estimates[k], race_threshold(&row[k], best)).wrapping_shl(4 * k as u32);
        }
    });
    let mut winners = [Candidate::NONE; K];
    each_index!(k < K, {
        let bits = pending.wrapping_shr(4 * k as u32) & 0xf;
        offer_contenders(&mut winners[k], &row[k], &estimates[k], logits[k], bits, 4 * philox_block);
    });
    winners
}

/// A lane's contender whose exact score is deferred ([`LaneRace::first_contender`]): noise
/// word, logit and global index, padded to 16 bytes so that the handoff tile parks it in the
/// four floats of padding that end a column in its logits buffer (rows `HANDOFF_ROWS ..`).
#[repr(C, align(16))]
#[derive(Clone, Copy)]
pub(super) struct Deferred {
    pub(super) word: u32,
    pub(super) logit: f32,
    pub(super) index: u32,
    pub(super) unused: u32,
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
        each_index!(q < LANE_QUADS, {
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
        each_index!(i < LANE_QUADS, {
            let bits = (self.contenders >> (4 * i)) & 0xf;
            let first_index = 4 * (first_philox_block + COLUMN_LANES * i as u32);
            offer_contenders(&mut winner, row, &self.estimates[i], logits[i], bits, first_index);
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
    vocab_end: u32,
) -> LaneRace {
    let philox_block = |i: usize| first_philox_block + COLUMN_LANES * i as u32;
    // Global indices: rows at or past `vocab_end` (the shard's end) race with nothing.
    let valid = |i: usize| vocab_end.saturating_sub(4 * philox_block(i)).min(4);
    let estimates = estimate_quads::<LANE_QUADS>(|_| row, row.greedy == 0, draw, philox_block, logits, valid);
    let mut lane_best = estimates[0].best();
    each_index!(i < LANE_QUADS, {
        lane_best = maximum(lane_best, estimates[i].best());
    });
    // SAFETY: per this function's contract all 32 lanes are here together, and the lanes
    // `l ^ m` (`m < COLUMN_LANES`) hold the column.
    let best = unsafe { column_best(lane_best, 1, COLUMN_LANES / 2) };
    let threshold = race_threshold(row, best);
    let mut bits = 0;
    // Usually only the lane holding the best estimate has contenders.
    if may_contend(lane_best, threshold) {
        each_index!(i < LANE_QUADS, {
            bits |= contenders(&estimates[i], threshold) << (4 * i);
        });
    }
    LaneRace { estimates, contenders: bits }
}

/// The estimates of `Q` quads: quad `q` holds four consecutive entries (`valid(q)` of them in
/// the vocabulary, Philox block `philox_block(q)`) of the row `row(q)`. Without `sampling`
/// (every row greedy) they are the plain logits.
#[inline(always)]
fn estimate_quads<'a, const Q: usize>(
    row: impl Fn(usize) -> &'a RowParams,
    sampling: bool,
    draw: u32,
    philox_block: impl Fn(usize) -> u32,
    logits: &[[f32; 4]; Q],
    valid: impl Fn(usize) -> u32,
) -> [BlockEstimate; Q] {
    let mut estimates = [BlockEstimate::plain([0.0; 4], 0); Q];
    if sampling {
        each_index!(q < Q, {
            estimates[q] = block_estimate(row(q), draw, philox_block(q), logits[q], valid(q), arch::log2_approx);
        });
    } else {
        each_index!(q < Q, {
            estimates[q] = BlockEstimate::plain(logits[q], valid(q));
        });
    }
    estimates
}
