//! What an item's accumulators become: the consumers' sampling epilogue (one candidate per
//! column, draw and tile) and the unfused GEMM's logits epilogue; the row parameters they read.

use flashsample_core::abi::{CANDIDATE_BYTES, RowSums, TMA_CONSUMER_WARPS, TmaArgs, candidate_pair, candidate_slot};
use flashsample_core::{Candidate, RowParams};

use super::fragments::{Placement, for_each_quad, pick_quad, transpose_quad};
use super::race::{FIRST_COLUMN_LANE_MASK, race_round};
use crate::sample::{ColumnQuad, SumsPlace, SumsStaging, masked_quad, tile_column_sums};
use crate::{arch, each_index, maxima, process, sample};

// A team's sums staging fits its candidate staging: teams of 4 or 8 warps, up to 128 columns.
const _: () = assert!(SumsStaging::bytes(4, 128) <= 4 * 128 * CANDIDATE_BYTES);
const _: () = assert!(SumsStaging::bytes(TMA_CONSUMER_WARPS, 128) <= TMA_CONSUMER_WARPS * 128 * CANDIDATE_BYTES);

/// Stands in for the row parameters of columns past the batch: greedy, so it draws no noise.
pub(super) const PAD_ROW: RowParams = RowParams { seed: 0, sequence: 0, step: 0, temperature: 0.0, greedy: 1 };

/// A [`RowParams`] as 8-byte words: copied word by word, it stays in registers (a struct copy
/// across the mainloop went through local memory).
pub(super) const ROW_WORDS: usize = core::mem::size_of::<RowParams>() / 8;

/// [`PAD_ROW`] as words: seed; stream and step; `temperature` = 0.0 and `greedy` = 1.
pub(super) const PAD_ROW_WORDS: [u64; ROW_WORDS] = [0, 0, 1 << 32];

/// The words of row `b` of the `[batch]` array of [`RowParams`] at `row_params`.
///
/// # Safety
/// `row_params` holds at least `b + 1` row parameters.
#[inline(always)]
pub(super) unsafe fn load_row_words(row_params: *const u64, b: u32) -> [u64; ROW_WORDS] {
    let at = ROW_WORDS * b as usize;
    // SAFETY: per this function's contract `row_params` holds row `b`'s three words.
    unsafe { [*row_params.add(at), *row_params.add(at + 1), *row_params.add(at + 2)] }
}

/// Per draw: each thread scores its quads `K` at a time ([`race_round`]), lanes of one column
/// merge, the team's warps merge through `staging`, and one candidate per (column, draw) is
/// written for this tile. With `PROCESSING` (the registry's
/// `tma_tile_applies_processing`) each quad first takes its row's per-entry processing, if
/// the launch has any, and before the draws the tile's log-sum-exp terms of each column are
/// written, if the launch asks for them ([`tile_column_sums`]).
///
/// # Safety
/// All threads of one team call it together; `row_params` holds the `N` row parameters of the item
/// (written by the team before the call), `staging` `warps · N` candidates of this team;
/// `barrier` is the team's named barrier and its thread count.
#[inline(always)]
pub(super) unsafe fn sample_epilogue<const N: usize, const R: usize, const K: usize, const PROCESSING: bool>(
    acc: &[f32; R],
    args: &TmaArgs,
    place: &Placement,
    row_params: *const RowParams,
    staging: *mut Candidate,
    barrier: (u32, u32),
) {
    let (barrier, threads) = barrier;
    // SAFETY: the team's named barrier, reached by all of its threads (this function's contract).
    unsafe { arch::sync_named(barrier, threads) };
    let rows_valid = args.vocab.saturating_sub(place.row0).min(4);
    let index0 = args.vocab_offset + place.row0;
    let philox_block = index0 / 4;
    let vocab_end = args.vocab_offset + args.vocab;
    if PROCESSING && args.tile_sums.address() != 0 {
        let quad = |slot: usize| {
            let quad = masked_quad(R / 4, slot, |i| [acc[4 * i], acc[4 * i + 1], acc[4 * i + 2], acc[4 * i + 3]]);
            // SAFETY: all 32 lanes run the slots together (`tile_column_sums` runs them in uniform
            // loops).
            let raw = unsafe { transpose_quad(quad, place.lane) };
            let column = 8 * slot as u32 + place.column;
            // SAFETY: `column < N`: one of the team's row slots, stored before the barrier above.
            let row = unsafe { *row_params.add(column as usize) };
            let b = place.col0 + column;
            let mut processed = raw;
            if args.processing.address() != 0 && b < args.batch {
                // SAFETY: a column of the batch: the launch's processing holds its row.
                processed = unsafe { process::fused_quad(args.processing, b, index0, vocab_end, raw) };
            }
            let sampling = b < args.batch && row.greedy == 0;
            (column, ColumnQuad { raw, processed, rows_valid, sampling, inverse_temperature: 1.0 / row.temperature })
        };
        let write = |column: u32, sums: RowSums| {
            let b = place.col0 + column;
            if b < args.batch {
                // SAFETY: `b < batch`, `tile < tiles`: inside the `[batch, tiles]` terms.
                unsafe { *args.tile_sums.as_mut_ptr().add((b * args.tiles + place.tile) as usize) = sums };
            }
        };
        let sums_place =
            SumsPlace { thread: place.thread, warp: place.warp, lane: place.lane, first_mask: FIRST_COLUMN_LANE_MASK };
        let sums_staging = SumsStaging { base: staging.cast(), warps: threads / 32, columns: N as u32 };
        // SAFETY: `tile_column_sums` has every thread of the team reach it together.
        let sync = || unsafe { arch::sync_named(barrier, threads) };
        // SAFETY: every thread of the team runs it together with `N / 8` slots, `sync` is the
        // team's barrier; `staging` is the team's `warps · N` candidates, which hold the sums'
        // staging (the assertions above).
        unsafe { tile_column_sums(N / 8, quad, sums_place, sums_staging, sync, write) };
    }
    for j in 0..args.samples {
        // A run-time loop over rounds keeps one copy of the Philox and log code.
        let mut round = 0;
        while round < N / 8 / K {
            let mut logits = [[0.0f32; 4]; K];
            let mut row = [PAD_ROW; K];
            let mut column = [0u32; K];
            let mut in_batch = [false; K];
            each_index!(k < K, {
                // SAFETY: all 32 lanes run the rounds together (uniform loop bounds).
                logits[k] = unsafe { transpose_quad(pick_quad::<R, K>(acc, round, k), place.lane) };
                column[k] = 8 * (round * K + k) as u32 + place.column;
                // SAFETY: `column < N`: one of the team's `N` row slots, stored before the team
                // barrier above.
                row[k] = unsafe { *row_params.add(column[k] as usize) };
                in_batch[k] = place.col0 + column[k] < args.batch;
                if PROCESSING && args.processing.address() != 0 && in_batch[k] {
                    // SAFETY: a column of the batch: the launch's processing holds its row.
                    logits[k] = unsafe {
                        process::fused_quad(args.processing, place.col0 + column[k], index0, vocab_end, logits[k])
                    };
                }
            });
            let winners =
                // SAFETY: all 32 lanes together, and lanes `l ^ 8`, `l ^ 16`, `l ^ 24` hold the
                // same columns (`transpose_quad`'s layout).
                unsafe { race_round::<K>(&row, args.draw_offset + j, philox_block, &logits, rows_valid, in_batch) };
            each_index!(k < K, {
                // SAFETY: all 32 lanes together (uniform loops).
                let best = unsafe { sample::merge_over_lanes(winners[k], FIRST_COLUMN_LANE_MASK, 16) };
                if place.lane < FIRST_COLUMN_LANE_MASK {
                    // SAFETY: `warp < threads / 32`, `column < N`: inside the team's staging.
                    unsafe { *staging.add((place.warp * N as u32 + column[k]) as usize) = best };
                }
            });
            round += 1;
        }
        // SAFETY: the team's named barrier, reached by all of its threads.
        unsafe { arch::sync_named(barrier, threads) };
        let mut column = place.thread;
        while column < N as u32 {
            let b = place.col0 + column;
            if b < args.batch {
                let mut best = Candidate::NONE;
                for w in 0..threads / 32 {
                    // SAFETY: inside the team's staging, written before the barrier above.
                    best = best.merge(unsafe { *staging.add((w * N as u32 + column) as usize) });
                }
                let at = candidate_slot(candidate_pair(b, args.samples, j), args.tiles, place.tile);
                // SAFETY: `b < batch`, `j < samples`, `tile < tiles`: inside the `[batch · samples
                // · tiles]` candidates.
                unsafe { *args.out.cast::<Candidate>().as_mut_ptr().add(at as usize) = best };
            }
            column += threads;
        }
        // SAFETY: the team's named barrier, reached by all of its threads.
        unsafe { arch::sync_named(barrier, threads) };
    }
}

/// The unfused GEMM's epilogue: each transposed quad is four consecutive logits of one
/// column, stored with one 16-byte write, and with `args.maxima` each (column, run of
/// `MAXIMA_ROWS` rows)'s maximum: a warp's 16 rows of a column lie with the lanes `l`,
/// `l ^ 8`, `l ^ 16`, `l ^ 24` ([`Placement`]), of which the lane below 8 writes it.
///
/// # Safety
/// All consumer threads call it together; `args.out` holds `batch × logits_stride` floats;
/// `args.maxima` is null or holds `batch × ⌈vocab / MAXIMA_ROWS⌉` words.
#[inline(always)]
pub(super) unsafe fn logits_epilogue<const N: usize, const R: usize>(
    acc: &[f32; R],
    args: &TmaArgs,
    place: &Placement,
) {
    let store_quad = |tile_column: usize, quad: [f32; 4]| {
        // SAFETY: every consumer thread runs the quads together (this function's contract).
        let logits = unsafe { transpose_quad(quad, place.lane) };
        let b = place.col0 + 8 * tile_column as u32 + place.column;
        if args.maxima.address() != 0 {
            let key = maxima::quad_key(logits, place.row0, args.vocab);
            // SAFETY: as above (a uniform condition).
            let key = unsafe { maxima::max_over_lanes(key, 8, 16) };
            if place.lane < 8 {
                // SAFETY: the run of this column's rows from `row0` (lanes below 8 hold the
                // warp's first four rows, a multiple of 16).
                unsafe { maxima::write(args.maxima, args.vocab, args.batch, b, place.row0, key) };
            }
        }
        if b < args.batch && place.row0 < args.vocab {
            let address =
                args.out.cast::<f32>().add(b as u64 * args.logits_stride as u64 + place.row0 as u64).address();
            // SAFETY: `b < batch` and `row0 < vocab`: inside the `[batch, logits_stride]` logits,
            // 16-byte aligned (`row0` and the stride are multiples of 4).
            unsafe { arch::store_global_v4(address, logits) };
        }
    };
    for_each_quad!(acc, store_quad);
}

/// Writes the candidate of (batch column `b`, draw `j`) for `tile`.
///
/// # Safety
/// `b < args.batch`, `j < args.samples`, `tile < args.tiles`; `args.out` holds
/// `batch × samples × tiles` candidates.
#[inline(always)]
pub(super) unsafe fn write_candidate(args: &TmaArgs, tile: u32, b: u32, j: u32, candidate: Candidate) {
    let at = candidate_slot(candidate_pair(b, args.samples, j), args.tiles, tile);
    // SAFETY: per this function's contract the index lies inside the `[batch · samples · tiles]`
    // candidates.
    unsafe { *args.out.cast::<Candidate>().as_mut_ptr().add(at as usize) = candidate };
}
