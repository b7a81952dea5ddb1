//! The fused tile kernels' sampling epilogue and their log-sum-exp terms per (row, tile), the
//! unfused logits sampler, the merge kernel, and the winners' logits of a fused call.

use flashsample_core::abi::{
    FusedArgs, LOGITS_SAMPLER_QUADS, LOGITS_SAMPLER_TILE, LogitsSamplerArgs, N_TILE, REDUCE_THREADS, ReduceArgs,
    RowSums, SAMPLES_PER_MERGE, ShardWinner, TILE_KERNEL_WARPS, TopLogprob, WINNER_LOGITS_THREADS, WinnerLogitsArgs,
    candidate_pair, candidate_slot, fused_mma_shared_bytes,
};
use flashsample_core::candidate::maximum;
use flashsample_core::chain::{CHAIN_LINKS, Chain, Link, searched};
use flashsample_core::estimate::{
    BlockEstimate, block_estimate, contenders, exact_entry, may_contend, offer_contenders, race_threshold,
};
use flashsample_core::process::{KeepRule, LogSumExp, MAX_TOP_LOGPROBS, min_p_threshold};
use flashsample_core::truncation::{TILE_TOP, TileTop, order_entry, order_word};
use flashsample_core::{Candidate, NON_FINITE_TOKEN, RowParams};

use crate::element::Element;
use crate::process::TokenOutputs;
use crate::tile::ThreadLogits;
use crate::{arch, each_index, process};

// The tiles' column sums stage in their candidate staging.
const _: () = assert!(SumsStaging::bytes(TILE_KERNEL_WARPS, 32) <= fused_mma_shared_bytes(32));
const _: () = assert!(SumsStaging::bytes(TILE_KERNEL_WARPS, N_TILE) <= fused_mma_shared_bytes(N_TILE));

/// `logits[slot / 2][slot % 2]` through a chain of selects, so the array stays in registers.
// Indexing by the loop variables gives constant indices once unrolled, which keeps the
// arrays in registers.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
fn pick<const NT: usize>(logits: &ThreadLogits<NT>, slot: usize) -> [f32; 4] {
    let mut picked = logits[0][0];
    // Unrolled by hand: constant indices keep the arrays in registers.
    each_index!(nt < NT, {
        for c in 0..2 {
            if slot == 2 * nt + c {
                picked = logits[nt][c];
            }
        }
    });
    picked
}

/// Quad `slot` of the `count` quads `quad(0) .. quad(count − 1)` (`count` ≤ 16, a constant once
/// inlined), gathered with bit masks in straight-line code. A chain of selects here became an
/// indexed load from local memory (LLVM moved the whole array there, and a `wgmma`
/// accumulator array with it, which serialised the multiplies), and so did a loop that LLVM
/// left rolled; masks in unrolled code keep the quads in registers.
#[inline(always)]
pub fn masked_quad(count: usize, slot: usize, quad: impl Fn(usize) -> [f32; 4]) -> [f32; 4] {
    let mut picked = [0u32; 4];
    each_index!(i < count, {
        let mask = 0u32.wrapping_sub((slot == i) as u32);
        let [q0, q1, q2, q3] = quad(i).map(f32::to_bits);
        picked = [picked[0] | (q0 & mask), picked[1] | (q1 & mask), picked[2] | (q2 & mask), picked[3] | (q3 & mask)];
    });
    picked.map(f32::from_bits)
}

/// The race's estimate of a four-entry block of `row`: [`block_estimate`] for a sampling row,
/// the logits themselves ([`BlockEstimate::plain`], its exact scores) for a greedy one, whose
/// race needs no noise and so skips the Philox block. A branch, where the TMA race keeps
/// `block_estimate`'s branch-free form to interleave four blocks.
#[inline(always)]
fn row_estimate(row: &RowParams, draw: u32, philox_block: u32, quad: [f32; 4], valid: u32) -> BlockEstimate {
    if row.greedy != 0 {
        BlockEstimate::plain(quad, valid)
    } else {
        block_estimate(row, draw, philox_block, quad, valid, arch::log2_approx)
    }
}

/// Merges a candidate over the lanes that differ in the bits `mask ..= last_mask` (a butterfly).
///
/// # Safety
/// All 32 lanes call it together.
#[inline(always)]
pub unsafe fn merge_over_lanes(mut best: Candidate, mut mask: u32, last_mask: u32) -> Candidate {
    while mask <= last_mask {
        // SAFETY: per this function's contract all 32 lanes are here together (the loop bounds are
        // uniform).
        best = unsafe { merge_with_lane(best, mask) };
        mask <<= 1;
    }
    best
}

/// Exchanges a candidate with lane `lane ^ mask` and keeps the better one.
///
/// # Safety
/// All 32 lanes call it together.
#[inline(always)]
unsafe fn merge_with_lane(best: Candidate, mask: u32) -> Candidate {
    // SAFETY: per this function's contract all 32 lanes are here together.
    let score = f32::from_bits(unsafe { arch::shuffle_xor(best.score.to_bits(), mask) });
    // SAFETY: as above.
    let word = unsafe { arch::shuffle_xor(best.word, mask) };
    // SAFETY: as above.
    let index = unsafe { arch::shuffle_xor(best.index, mask) };
    best.merge(Candidate { score, word, index })
}

/// The largest `value` over this lane and the lanes `l ^ m` for `m = first_mask, 2·first_mask,
/// …, last_mask`; NaN if any is NaN, as in [`BlockEstimate::best`]: the best estimate of a
/// column whose rows those lanes hold, which the race's filter compares against.
///
/// # Safety
/// All 32 lanes call it together.
#[inline(always)]
pub(crate) unsafe fn column_best(value: f32, first_mask: u32, last_mask: u32) -> f32 {
    let mut best = value;
    let mut mask = first_mask;
    while mask <= last_mask {
        // SAFETY: per this function's contract all 32 lanes are here together.
        best = maximum(best, f32::from_bits(unsafe { arch::shuffle_xor(best.to_bits(), mask) }));
        mask <<= 1;
    }
    best
}

/// The epilogue of the fused tile kernels: with `tile_sums`, first the tile's log-sum-exp terms
/// of each batch column ([`tile_column_sums`]); then for every draw, the best candidate of this
/// block's tile for each batch column, written to `candidates`.
///
/// Each thread estimates the scores of its four rows per column ([`row_estimate`]); the
/// lanes with the same `t` (same columns) find the column's best estimate, each scores exactly
/// only its entries that pass the race's filter against it (`flashsample_core::estimate`:
/// what [`block_candidate`](flashsample_core::block_candidate) merged over the rows would
/// give), and they merge over `g`; warps merge through `staging` in batches of
/// [`SAMPLES_PER_MERGE`] draws.
///
/// # Safety
/// Every thread of the block calls it together with its own logits; `staging` holds
/// `SAMPLES_PER_MERGE · TILE_KERNEL_WARPS · 8·NT` candidates of shared memory; `args` describes
/// valid device buffers.
#[inline(always)]
pub unsafe fn sample_tile<const NT: usize>(
    logits: &ThreadLogits<NT>,
    args: &FusedArgs,
    tile: u32,
    row0: u32,
    col0: u32,
    staging: *mut Candidate,
) {
    let thread = arch::thread_index();
    let lane = thread % 32;
    let warp = thread / 32;
    let g = lane / 4;
    let t = lane % 4;
    let columns = N_TILE * NT as u32;
    let index0 = args.vocab_offset + row0;
    let philox_block = index0 / 4;
    let rows_valid = args.vocab.saturating_sub(row0).min(4);
    let vocab_end = args.vocab_offset + args.vocab;
    if args.tile_sums.address() != 0 {
        let quad = |column_slot: usize| {
            let column = N_TILE * (column_slot / 2) as u32 + 2 * t + (column_slot % 2) as u32;
            let b = col0 + column;
            // Two levels of masks: `masked_quad` gathers at most 16 quads, and the tile has
            // 2·NT (up to 32).
            let odd = 0u32.wrapping_sub((column_slot % 2) as u32);
            let raw = masked_quad(NT, column_slot / 2, |nt| {
                let [even_quad, odd_quad] = logits[nt];
                core::array::from_fn(|r| {
                    f32::from_bits((odd_quad[r].to_bits() & odd) | (even_quad[r].to_bits() & !odd))
                })
            });
            let mut quad = ColumnQuad { raw, processed: raw, rows_valid, sampling: false, inverse_temperature: 1.0 };
            if b < args.batch {
                // SAFETY: `b < batch`: a row of the `[batch]` row parameters.
                let row = unsafe { *args.row_params.as_ptr().add(b as usize) };
                (quad.sampling, quad.inverse_temperature) = (row.greedy == 0, 1.0 / row.temperature);
                if args.processing.address() != 0 {
                    // SAFETY: `b < batch`: the launch's processing holds the row.
                    quad.processed = unsafe { process::fused_quad(args.processing, b, index0, vocab_end, raw) };
                }
            }
            (column, quad)
        };
        let write = |column: u32, sums: RowSums| {
            let b = col0 + column;
            if b < args.batch {
                // SAFETY: `b < batch`, `tile < tiles`: inside the `[batch, tiles]` terms.
                unsafe { *args.tile_sums.as_mut_ptr().add((b * args.tiles + tile) as usize) = sums };
            }
        };
        let place = SumsPlace { thread, warp, lane, first_mask: 4 };
        let sums_staging = SumsStaging { base: staging.cast(), warps: TILE_KERNEL_WARPS, columns };
        // SAFETY: `tile_column_sums` has every thread of the block reach it together.
        let sync = || unsafe { arch::sync_threads() };
        // SAFETY: every thread of the block runs it together (the item loop is per block), with
        // `2·NT` slots each; the staging (`fused_mma_shared_bytes`) holds the sums' staging.
        unsafe { tile_column_sums(2 * NT, quad, place, sums_staging, sync, write) };
    }
    if args.tile_tops.address() != 0 {
        // SAFETY: every thread of the block runs it together (the item loop is per block); the
        // staging holds a list per warp and column (checked in `flashsample_core::abi`).
        unsafe { write_tile_tops::<NT>(logits, args, tile, row0, col0, staging.cast()) };
    }
    let mut first = 0;
    while first < args.samples {
        for slot in 0..SAMPLES_PER_MERGE {
            let j = first + slot;
            if j >= args.samples {
                break;
            }
            // A run-time loop over the 2·NT columns keeps one copy of the Philox and log code;
            // `pick` reads the register arrays with constant indices only.
            let mut column_slot = 0;
            while column_slot < 2 * NT {
                let column = N_TILE * (column_slot / 2) as u32 + 2 * t + (column_slot % 2) as u32;
                // Columns past the batch (a batch tile wider than B) draw no noise; their lanes
                // still join the shuffles below.
                let in_batch = col0 + column < args.batch;
                // A column past the batch races nothing: its placeholders are never offered.
                // Placeholders, not an `Option` of the three: that form took the staged tile
                // from 168 to 189 registers (ptxas), below three blocks per multiprocessor.
                let mut row = RowParams { seed: 0, sequence: 0, step: 0, temperature: 1.0, greedy: 1 };
                let mut quad = [f32::NEG_INFINITY; 4];
                let mut estimate = BlockEstimate::plain(quad, 0);
                if in_batch {
                    // SAFETY: `col0 + column < batch`: a row of the `[batch]` row parameters.
                    row = unsafe { *args.row_params.as_ptr().add((col0 + column) as usize) };
                    quad = pick(logits, column_slot);
                    if args.processing.address() != 0 {
                        // SAFETY: `col0 + column < batch`: the launch's processing holds the row.
                        quad = unsafe { process::fused_quad(args.processing, col0 + column, index0, vocab_end, quad) };
                    }
                    estimate = row_estimate(&row, args.draw_offset + j, philox_block, quad, rows_valid);
                }
                // Only the entries the race's filter passes against the column's best estimate
                // get exact scores (two software logarithms each): the winner is among them.
                // SAFETY: every lane of the warp reaches it: the column loop's bounds are the same
                // for all lanes.
                let column_best = unsafe { column_best(estimate.best(), 4, 16) };
                let mut best = Candidate::NONE;
                if in_batch {
                    let bits = contenders(&estimate, race_threshold(&row, column_best));
                    offer_contenders(&mut best, &row, &estimate, quad, bits, 4 * philox_block);
                }
                // SAFETY: as above.
                best = unsafe { merge_over_lanes(best, 4, 16) };
                if g == 0 {
                    // SAFETY: slot < SAMPLES_PER_MERGE, warp < TILE_KERNEL_WARPS and column < columns:
                    // inside the staging area the registry sizes (`fused_mma_shared_bytes`).
                    unsafe { *staging.add(((slot * TILE_KERNEL_WARPS + warp) * columns + column) as usize) = best };
                }
                column_slot += 1;
            }
        }
        // SAFETY: every thread of the block reaches it: the item and draw loops are uniform over
        // the block.
        unsafe { arch::sync_threads() };
        let mut item = thread;
        while item < SAMPLES_PER_MERGE * columns {
            let slot = item / columns;
            let column = item % columns;
            let j = first + slot;
            let b = col0 + column;
            if j < args.samples && b < args.batch {
                let mut best = Candidate::NONE;
                for w in 0..TILE_KERNEL_WARPS {
                    // SAFETY: inside the staging area, written by every warp before the barrier
                    // above.
                    best = best
                        .merge(unsafe { *staging.add(((slot * TILE_KERNEL_WARPS + w) * columns + column) as usize) });
                }
                let at = candidate_slot(candidate_pair(b, args.samples, j), args.tiles, tile);
                // SAFETY: `b < batch`, `j < samples`, `tile < tiles`: inside the `[batch · samples
                // · tiles]` candidates.
                unsafe { *args.candidates.as_mut_ptr().add(at as usize) = best };
            }
            item += TILE_KERNEL_WARPS * 32;
        }
        // SAFETY: every thread of the block reaches it (uniform loops).
        unsafe { arch::sync_threads() };
        first += SAMPLES_PER_MERGE;
    }
}

/// Writes the tile's list of each batch column's first processed entries
/// ([`TileTop`]) to `args.tile_tops`: the eight lanes of a column find its warp's first
/// entries one at a time (each round the largest [`order_word`] of their four rows by
/// shuffles, which its lane then drops), the warps' lists meet in `staging`, and one thread
/// per column merges them.
///
/// # Safety
/// Every thread of the block calls it together; `staging` holds `TILE_KERNEL_WARPS · 8·NT`
/// lists; `args.tile_tops` holds `[batch, tiles]` lists; the caller's item is `tile`.
#[inline(always)]
unsafe fn write_tile_tops<const NT: usize>(
    logits: &ThreadLogits<NT>,
    args: &FusedArgs,
    tile: u32,
    row0: u32,
    col0: u32,
    staging: *mut TileTop,
) {
    let thread = arch::thread_index();
    let (lane, warp) = (thread % 32, thread / 32);
    let (g, t) = (lane / 4, lane % 4);
    let columns = N_TILE * NT as u32;
    let index0 = args.vocab_offset + row0;
    let rows_valid = args.vocab.saturating_sub(row0).min(4);
    let vocab_end = args.vocab_offset + args.vocab;
    // A run-time loop over the columns, as the race's, keeps one copy of the rounds' code.
    let mut column_slot = 0;
    while column_slot < 2 * NT {
        let column = N_TILE * (column_slot / 2) as u32 + 2 * t + (column_slot % 2) as u32;
        // This lane's four entries as order words, 0 where none: −∞ (dropped by the
        // processing), past the vocabulary or past the batch. NaN and +∞ mark the column.
        let mut words = [0u64; 4];
        let mut non_finite = false;
        if col0 + column < args.batch {
            let mut quad = pick(logits, column_slot);
            if args.processing.address() != 0 {
                // SAFETY: `col0 + column < batch`: the launch's processing holds the row.
                quad = unsafe { process::fused_quad(args.processing, col0 + column, index0, vocab_end, quad) };
            }
            (words, non_finite) = quad_words(quad, index0, rows_valid);
        }
        // SAFETY: every lane of the warp reaches it (uniform loops); the lanes of one column
        // differ in `g`, lane bits 2 to 4.
        let top = unsafe { column_top(words, non_finite, 4, 16) };
        if g == 0 {
            // SAFETY: warp < TILE_KERNEL_WARPS, column < columns: inside the staging.
            unsafe { *staging.add((warp * columns + column) as usize) = top };
        }
        column_slot += 1;
    }
    // SAFETY: every thread of the block reaches it (uniform loops).
    unsafe { arch::sync_threads() };
    let b = col0 + thread;
    if thread < columns && b < args.batch {
        let mut top = TileTop::EMPTY;
        for w in 0..TILE_KERNEL_WARPS {
            // SAFETY: inside the staging, written by every warp before the barrier above.
            top = top.merge(unsafe { *staging.add((w * columns + thread) as usize) });
        }
        // SAFETY: `b < batch`, `tile < tiles`: inside the `[batch, tiles]` lists.
        unsafe { *args.tile_tops.as_mut_ptr().add((b * args.tiles + tile) as usize) = top };
    }
    // SAFETY: every thread of the block reaches it; the staging is reused after it.
    unsafe { arch::sync_threads() };
}

/// A quad of processed logits (vocabulary indices from `index0`, the first `rows_valid` in
/// the vocabulary) as the [`order_word`]s a column's list is found from, 0 where no entry can
/// be listed (−∞, dropped by the processing, or past the vocabulary), and whether one of them
/// is NaN or +∞.
#[inline(always)]
pub(crate) fn quad_words(quad: [f32; 4], index0: u32, rows_valid: u32) -> ([u64; 4], bool) {
    let mut words = [0u64; 4];
    let mut non_finite = false;
    for (r, (&logit, word)) in quad.iter().zip(&mut words).enumerate() {
        if (r as u32) < rows_valid && logit > f32::NEG_INFINITY && logit < f32::INFINITY {
            *word = order_word(logit, index0 + r as u32);
        }
        non_finite |= (r as u32) < rows_valid && (logit.is_nan() || logit == f32::INFINITY);
    }
    (words, non_finite)
}

/// A column's list of its first [`TILE_TOP`] entries ([`TileTop`]) from the [`order_word`]s
/// its lanes hold (0 for none), the lanes that share the column differing in the lane bits
/// from `first_mask` to `last_mask`: each round takes the largest word over those lanes by
/// shuffles, and the lane that holds it drops it (the words are distinct: each holds its
/// index). `non_finite`: this lane holds a NaN or +∞ entry, which marks the column's list
/// as [`TileTop::offer`] does.
///
/// # Safety
/// All 32 lanes call it together.
#[inline(always)]
pub(crate) unsafe fn column_top<const W: usize>(
    mut words: [u64; W],
    non_finite: bool,
    first_mask: u32,
    last_mask: u32,
) -> TileTop {
    let mut top = TileTop::EMPTY;
    for slot in 0..TILE_TOP {
        let mut first = 0;
        for &word in &words {
            first = first.max(word);
        }
        let mut mask = first_mask;
        while mask <= last_mask {
            // SAFETY: per this function's contract all 32 lanes are here together.
            first = first.max(unsafe { arch::shuffle_xor_u64(first, mask) });
            mask <<= 1;
        }
        for word in &mut words {
            if *word == first {
                *word = 0;
            }
        }
        if first != 0 {
            (top.logits[slot], top.indices[slot]) = order_entry(first);
        }
    }
    let mut marked = u32::from(non_finite);
    let mut mask = first_mask;
    while mask <= last_mask {
        // SAFETY: per this function's contract all 32 lanes are here together.
        marked |= unsafe { arch::shuffle_xor(marked, mask) };
        mask <<= 1;
    }
    if marked != 0 {
        top.logits[0] = f32::NAN;
    }
    top
}

/// The epilogue of the chain kernels (`chains_*`): for every draw, each batch column's chain of
/// this block's tile ([`Chain`]) written to `args.tile_chains` (`[batch, samples, tiles]`),
/// from which a min-p row's winner is found for any cut its row's largest logit sets.
///
/// Per column and draw, the eight lanes of a column in each warp find the warp's largest
/// processed logit and its min-p floor, estimate the noise of their entries at or above it and
/// score exactly those the race's filter passes against the best estimate at that largest
/// logit (`core::chain`: no other entry is a link), and search the warp's chain one link per
/// round (the column's largest logit among the entries that follow the last link, and its
/// lane's candidate; the rounds stop when no column of the warp has another); the end is the
/// last link unless the chain outgrows its stored links. The warps' chains meet in `staging`,
/// where they merge in pairs and the pairs into the tile's chain ([`Chain::merge_into`]).
///
/// # Safety
/// Every thread of the block calls it together; `staging` holds `CHAIN_STAGING_SLOTS · 8·NT`
/// chains (the chain kernels' staging, `epilogue_staging_bytes`); `args.tile_chains` holds
/// `[batch, samples, tiles]` chains and `args.truncation` the rows' processing; the caller's
/// item is `tile`.
#[inline(always)]
pub unsafe fn write_tile_chains<const NT: usize>(
    logits: &ThreadLogits<NT>,
    args: &FusedArgs,
    tile: u32,
    row0: u32,
    col0: u32,
    staging: *mut Chain,
) {
    let thread = arch::thread_index();
    let (lane, warp) = (thread % 32, thread / 32);
    let (g, t) = (lane / 4, lane % 4);
    let columns = N_TILE * NT as u32;
    let index0 = args.vocab_offset + row0;
    let philox_block = index0 / 4;
    let rows_valid = args.vocab.saturating_sub(row0).min(4);
    let vocab_end = args.vocab_offset + args.vocab;
    for j in 0..args.samples {
        // A run-time loop over the columns, as the race's, keeps one copy of the rounds' code.
        let mut column_slot = 0;
        while column_slot < 2 * NT {
            let column = N_TILE * (column_slot / 2) as u32 + 2 * t + (column_slot % 2) as u32;
            let b = col0 + column;
            // This lane's entries (−∞ past the vocabulary and the batch), their largest finite
            // one, and whether one is NaN or +∞.
            let mut quad = [f32::NEG_INFINITY; 4];
            let mut row = None;
            if b < args.batch {
                // SAFETY: `b < batch`: a row of the `[batch]` row parameters and processing.
                let (params, min_p) = unsafe {
                    (*args.row_params.as_ptr().add(b as usize), (*args.truncation.as_ptr().add(b as usize)).min_p)
                };
                row = Some((params, min_p));
                let mut processed = pick(logits, column_slot);
                if args.processing.address() != 0 {
                    // SAFETY: `b < batch`: the launch's processing holds the row.
                    processed = unsafe { process::fused_quad(args.processing, b, index0, vocab_end, processed) };
                }
                for r in 0..4 {
                    if (r as u32) < rows_valid {
                        quad[r] = processed[r];
                    }
                }
            }
            let mut most = f32::NEG_INFINITY;
            let mut non_finite = false;
            for &logit in &quad {
                if logit.is_nan() || logit == f32::INFINITY {
                    non_finite = true;
                } else if logit > most {
                    most = logit;
                }
            }
            let lanes = COLUMN_LANES << t;
            // SAFETY: every lane of the warp reaches these: the loops' bounds are the same for all.
            let (most, non_finite) = unsafe { (column_max(most), arch::ballot(non_finite) & lanes != 0) };
            // The warp's floor: no cut its row's largest logit sets is lower.
            let floor = match row {
                Some((params, min_p)) => min_p_threshold(most, params.temperature, min_p),
                None => f32::INFINITY,
            };
            // Estimated scores of the entries at or above the floor, and the best estimate among
            // those with the warp's largest logit, where the chain's first link lies: only the
            // entries the race's filter passes against it get exact scores (`core::chain`).
            let mut estimate = BlockEstimate::plain(quad, 0);
            let mut best_at_most = f32::NEG_INFINITY;
            if let Some((params, _)) = row
                && quad.iter().any(|&logit| searched(logit, floor))
            {
                let draw = args.draw_offset + j;
                estimate = row_estimate(&params, draw, philox_block, quad, rows_valid);
                for (&logit, &score) in quad.iter().zip(&estimate.scores) {
                    if logit == most {
                        best_at_most = best_at_most.max(score);
                    }
                }
            }
            // SAFETY: every lane of the warp reaches it (uniform loops).
            let best_at_most = unsafe { column_max(best_at_most) };
            let mut entries = [Link::NONE; 4];
            if let Some((params, _)) = row {
                let threshold = race_threshold(&params, best_at_most);
                for r in 0..4 {
                    if searched(quad[r], floor) && may_contend(estimate.scores[r], threshold) {
                        let (score, word) = exact_entry(&params, estimate.words[r], quad[r]);
                        entries[r] =
                            Link { logit: quad[r], candidate: Candidate::scored(score, word, index0 + r as u32) };
                    }
                }
            }
            let at = (warp * columns + column) as usize;
            let mut last = Link::NONE;
            let mut open = f32::NEG_INFINITY;
            let mut done = false;
            for round in 0..=CHAIN_LINKS {
                let mut next = Link::NONE;
                if !done {
                    let mut mine = Link::NONE;
                    for entry in &entries {
                        if Chain::follows(entry, &last, floor) {
                            mine = mine.first(*entry);
                        }
                    }
                    // The next link has the column's largest logit among the entries that follow;
                    // its lane, when it is the only one with that logit, sends its candidate, and a
                    // tie between lanes (rare) compares the candidates.
                    // SAFETY: every lane of the warp reaches these: `done` is the same for all.
                    unsafe {
                        let top = column_max(mine.logit);
                        let holders = arch::ballot(mine.is_entry() && mine.logit == top);
                        let ours = holders & lanes;
                        let tied = arch::ballot(ours.count_ones() > 1) != 0;
                        next = if tied {
                            column_link(mine, Link::first)
                        } else {
                            lane_link(top, mine.candidate, ours.trailing_zeros())
                        };
                        if ours == 0 {
                            next = Link::NONE;
                        }
                        done = holders == 0;
                    }
                }
                if round < CHAIN_LINKS {
                    if g == 0 {
                        // SAFETY: warp < TILE_KERNEL_WARPS, column < columns: inside the staging.
                        unsafe { (*staging.add(at)).links[round] = next };
                    }
                    if next.is_entry() {
                        last = next;
                    }
                } else if next.is_entry() {
                    open = next.logit;
                }
            }
            // A chain whose links are all stored ends at its last; a longer one's end is the best
            // candidate searched.
            // SAFETY: every lane of the warp reaches it (uniform loops).
            let end = if unsafe { arch::ballot(open > f32::NEG_INFINITY) } != 0 {
                let mut best = Link::NONE;
                for entry in &entries {
                    if entry.candidate.beats(&best.candidate) {
                        best = *entry;
                    }
                }
                // SAFETY: as above: the condition is the same for every lane.
                unsafe { column_link(best, |a, b| if b.candidate.beats(&a.candidate) { b } else { a }) }
            } else {
                last
            };
            if g == 0 {
                // SAFETY: as above.
                unsafe {
                    let chain = &mut *staging.add(at);
                    (chain.end, chain.open, chain.floor) = (end, open, floor);
                    if non_finite {
                        chain.links[0].logit = f32::NAN;
                    }
                }
            }
            column_slot += 1;
        }
        // SAFETY: every thread of the block reaches it (uniform loops).
        unsafe { arch::sync_threads() };
        // Warps 0 and 1, and 2 and 3, merge into slots 4 and 5, a thread per (pair, column).
        let slot = |s: u32, column: u32| staging.wrapping_add((s * columns + column) as usize);
        let mut item = thread;
        while item < 2 * columns {
            let (pair, column) = (item / columns, item % columns);
            if col0 + column < args.batch {
                // SAFETY: slots 0 to 3 were written by every warp before the barrier above;
                // slot `4 + pair` is this thread's alone, inside the staging
                // (`CHAIN_STAGING_SLOTS` per column).
                unsafe {
                    let merged = &mut *slot(TILE_KERNEL_WARPS + pair, column);
                    Chain::merge_into(&*slot(2 * pair, column), &*slot(2 * pair + 1, column), merged);
                }
            }
            item += TILE_KERNEL_WARPS * 32;
        }
        // SAFETY: every thread of the block reaches it (uniform loops).
        unsafe { arch::sync_threads() };
        let b = col0 + thread;
        if thread < columns && b < args.batch {
            let at = candidate_slot(candidate_pair(b, args.samples, j), args.tiles, tile) as usize;
            // SAFETY: slots 4 and 5 were written before the barrier above; `b < batch`,
            // `j < samples`, `tile < tiles`: the output lies inside the `[batch, samples,
            // tiles]` chains.
            unsafe {
                let pairs = (&*slot(TILE_KERNEL_WARPS, thread), &*slot(TILE_KERNEL_WARPS + 1, thread));
                Chain::merge_into(pairs.0, pairs.1, &mut *args.tile_chains.as_mut_ptr().add(at));
            }
        }
        // SAFETY: every thread of the block reaches it; the staging is reused after it.
        unsafe { arch::sync_threads() };
    }
}

/// Reduces a link over the eight lanes of its batch column (lane bits 2 to 4) with `keep`,
/// which picks one of two links (commutative and associative, so every lane ends with the
/// same).
///
/// # Safety
/// All 32 lanes call it together.
#[inline(always)]
unsafe fn column_link(mut link: Link, keep: impl Fn(Link, Link) -> Link) -> Link {
    let mut mask = 4;
    while mask <= 16 {
        // SAFETY: per this function's contract all 32 lanes are here together.
        let other = unsafe {
            Link {
                logit: f32::from_bits(arch::shuffle_xor(link.logit.to_bits(), mask)),
                candidate: Candidate {
                    score: f32::from_bits(arch::shuffle_xor(link.candidate.score.to_bits(), mask)),
                    word: arch::shuffle_xor(link.candidate.word, mask),
                    index: arch::shuffle_xor(link.candidate.index, mask),
                },
            }
        };
        link = keep(link, other);
        mask <<= 1;
    }
    link
}

/// The lanes that hold batch column 0's entries in a warp of the tile's epilogue (lanes `4g`);
/// shifted by `t`, column `t`'s.
const COLUMN_LANES: u32 = 0x1111_1111;

/// The largest of a value over the eight lanes of its batch column (lane bits 2 to 4); NaN
/// only where every one is.
///
/// # Safety
/// All 32 lanes call it together.
#[inline(always)]
unsafe fn column_max(mut value: f32) -> f32 {
    let mut mask = 4;
    while mask <= 16 {
        // SAFETY: per this function's contract all 32 lanes are here together.
        value = value.max(f32::from_bits(unsafe { arch::shuffle_xor(value.to_bits(), mask) }));
        mask <<= 1;
    }
    value
}

/// The link of logit `logit` whose candidate lane `source` holds (any lane for `source` ≥ 32).
///
/// # Safety
/// All 32 lanes call it together.
#[inline(always)]
unsafe fn lane_link(logit: f32, candidate: Candidate, source: u32) -> Link {
    // SAFETY: per this function's contract all 32 lanes are here together.
    unsafe {
        Link {
            logit,
            candidate: Candidate {
                score: f32::from_bits(arch::shuffle_idx(candidate.score.to_bits(), source)),
                word: arch::shuffle_idx(candidate.word, source),
                index: arch::shuffle_idx(candidate.index, source),
            },
        }
    }
}

/// A thread's share of one batch column's log-sum-exp terms: four consecutive vocabulary rows,
/// raw and processed, of which the first `rows_valid` lie in the vocabulary.
#[derive(Clone, Copy)]
pub struct ColumnQuad {
    pub raw: [f32; 4],
    pub processed: [f32; 4],
    pub rows_valid: u32,
    /// Whether the column's row samples (the processed terms are empty for a greedy row or a
    /// column past the batch).
    pub sampling: bool,
    /// `1 / T` of the column's row, for its processed terms.
    pub inverse_temperature: f32,
}

impl ColumnQuad {
    /// The quad's entries that add terms, `[raw, processed]`, the rest −∞. Scalars through
    /// selects, not indexed arrays: an array indexed in a loop goes to the stack.
    #[inline(always)]
    fn entries(&self) -> [[f32; 4]; 2] {
        let valid = |r: u32, x: f32| if r < self.rows_valid { x } else { f32::NEG_INFINITY };
        let kept = |r: u32, x: f32| if self.sampling { valid(r, x) } else { f32::NEG_INFINITY };
        let ([r0, r1, r2, r3], [p0, p1, p2, p3]) = (self.raw, self.processed);
        [[valid(0, r0), valid(1, r1), valid(2, r2), valid(3, r3)], [kept(0, p0), kept(1, p1), kept(2, p2), kept(3, p3)]]
    }

    /// The largest raw and processed entries (−∞ for none).
    #[inline(always)]
    pub fn maxima(&self) -> [f32; 2] {
        let [[r0, r1, r2, r3], [p0, p1, p2, p3]] = self.entries();
        [maximum(maximum(r0, r1), maximum(r2, r3)), maximum(maximum(p0, p1), maximum(p2, p3))]
    }

    /// The sums of the entries' terms against the column's maxima (`LogSumExp::term`: raw at
    /// T = 1, processed at the row's temperature), which add no rescaling per entry.
    #[inline(always)]
    pub fn terms(&self, maxima: [f32; 2]) -> [f32; 2] {
        let [[r0, r1, r2, r3], [p0, p1, p2, p3]] = self.entries();
        let [raw_max, kept_max] = maxima;
        let raw = |l: f32| LogSumExp::term(l, raw_max, 1.0);
        let kept = |l: f32| LogSumExp::term(l, kept_max, self.inverse_temperature);
        [raw(r0) + raw(r1) + raw(r2) + raw(r3), kept(p0) + kept(p1) + kept(p2) + kept(p3)]
    }
}

/// A column's terms from its maxima and its sums of terms: empty where the maximum is −∞.
#[inline(always)]
pub fn column_sums(maxima: [f32; 2], sums: [f32; 2]) -> RowSums {
    let lse = |max: f32, sum: f32| if max == f32::NEG_INFINITY { LogSumExp::EMPTY } else { LogSumExp { max, sum } };
    RowSums { raw: lse(maxima[0], sums[0]), kept: lse(maxima[1], sums[1]) }
}

/// `[raw, processed]` pairs combined by `combine` over the lanes that differ in the bits
/// `mask ..= last_mask` (a butterfly; `combine` commutes, so every lane ends with the same
/// values).
///
/// # Safety
/// All 32 lanes call it together.
#[inline(always)]
pub unsafe fn combine_over_lanes(
    mut pair: [f32; 2],
    mut mask: u32,
    last_mask: u32,
    combine: impl Fn(f32, f32) -> f32,
) -> [f32; 2] {
    while mask <= last_mask {
        // SAFETY: per this function's contract all 32 lanes are here together (the loop bounds are
        // uniform).
        let other = unsafe {
            [
                f32::from_bits(arch::shuffle_xor(pair[0].to_bits(), mask)),
                f32::from_bits(arch::shuffle_xor(pair[1].to_bits(), mask)),
            ]
        };
        pair = [combine(pair[0], other[0]), combine(pair[1], other[1])];
        mask <<= 1;
    }
    pair
}

/// Shared memory of [`tile_column_sums`] inside a tile's candidate staging: a `[raw, processed]`
/// pair per (warp, column), then one per column.
#[derive(Clone, Copy)]
pub struct SumsStaging {
    pub base: *mut [f32; 2],
    pub warps: u32,
    pub columns: u32,
}

impl SumsStaging {
    /// Bytes of the staging for `warps × columns`.
    pub const fn bytes(warps: u32, columns: u32) -> u32 {
        (warps + 1) * columns * 8
    }

    #[inline(always)]
    fn warp_pair(&self, warp: u32, column: u32) -> *mut [f32; 2] {
        self.base.wrapping_add((warp * self.columns + column) as usize)
    }

    #[inline(always)]
    fn column_pair(&self, column: u32) -> *mut [f32; 2] {
        self.base.wrapping_add((self.warps * self.columns + column) as usize)
    }
}

/// Where a thread of a tile spread over warps sits for [`tile_column_sums`].
#[derive(Clone, Copy)]
pub struct SumsPlace {
    /// Thread index in the block or team; threads `0 .. columns` write one column each.
    pub thread: u32,
    pub warp: u32,
    pub lane: u32,
    /// Lanes that differ in the bits `first_mask ..= 16` hold other rows of the same columns;
    /// lanes below `first_mask` hold distinct columns.
    pub first_mask: u32,
}

/// The log-sum-exp terms of every batch column of a tile whose rows are spread over the lanes
/// and warps of a block or team: `quad(slot)` gives this thread's column and quad of each of
/// its `slots`, and thread `c < columns` hands column `c`'s terms to `write`. Two passes: the
/// columns' maxima (per warp, then over warps), then the sums of terms (per warp, then over
/// warps in warp order, so the terms do not depend on timing).
///
/// # Safety
/// Every thread of the block or team calls it together, with the same `slots`; `sync` is
/// their barrier; `staging` is theirs, with room for [`SumsStaging::bytes`], and no thread
/// reads or writes it until every thread has returned from this call and passed `sync` once.
#[inline(always)]
pub unsafe fn tile_column_sums(
    slots: usize,
    quad: impl Fn(usize) -> (u32, ColumnQuad),
    place: SumsPlace,
    staging: SumsStaging,
    sync: impl Fn(),
    write: impl Fn(u32, RowSums),
) {
    let writes_pair = place.lane < place.first_mask;
    // Pass 0 stages the columns' maxima, pass 1 their sums of terms against them: one loop, so
    // that `quad` (the per-entry steps among it) is written once.
    let mut pass = 0;
    while pass < 2 {
        let mut slot = 0;
        while slot < slots {
            let (column, q) = quad(slot);
            // SAFETY: every lane of the warp reaches the shuffles (uniform loop bounds and
            // pass); pass 1 reads the column's maxima, written before the barriers of pass 0.
            let pair = unsafe {
                match pass {
                    0 => combine_over_lanes(q.maxima(), place.first_mask, 16, maximum),
                    _ => combine_over_lanes(q.terms(*staging.column_pair(column)), place.first_mask, 16, |a, b| a + b),
                }
            };
            if writes_pair {
                // SAFETY: `warp < warps`, `column < columns`: inside the staging (this function's
                // contract); in pass 1 every thread read pass 0's pairs before its last barrier.
                unsafe { *staging.warp_pair(place.warp, column) = pair };
            }
            slot += 1;
        }
        sync();
        if place.thread < staging.columns {
            // The column's maxima over the warps, or its sums in warp order.
            let mut merged = if pass == 0 { [f32::NEG_INFINITY; 2] } else { [0.0; 2] };
            for w in 0..staging.warps {
                // SAFETY: written by warp `w` before the barrier above.
                let [raw, kept] = unsafe { *staging.warp_pair(w, place.thread) };
                merged = match pass {
                    0 => [maximum(merged[0], raw), maximum(merged[1], kept)],
                    _ => [merged[0] + raw, merged[1] + kept],
                };
            }
            let at = staging.column_pair(place.thread);
            match pass {
                // SAFETY: column `thread < columns`'s pair, read by no thread before the barrier
                // below.
                0 => unsafe { *at = merged },
                // SAFETY: written in pass 0.
                _ => write(place.thread, column_sums(unsafe { *at }, merged)),
            }
        }
        sync();
        pass += 1;
    }
}

/// The unfused sampler: reads materialised logits, [`LOGITS_SAMPLER_QUADS`] quads per thread,
/// and writes one candidate per (row, draw, [`LOGITS_SAMPLER_TILE`]-entry item): the best of
/// the item's entries, as [`block_candidate`](flashsample_core::block_candidate) over them
/// would pick it.
///
/// The race is filtered as the tiles' epilogues filter theirs (`flashsample_core::estimate`):
/// each thread estimates the scores of its quads, the warp (one row, one draw) finds their
/// best, and only the entries that pass the filter against it get exact scores; a quad with
/// one runs its Philox block again for the words, which costs less than holding them.
///
/// # Safety
/// Launched with `TILE_KERNEL_WARPS · 32` threads and `LOGITS_SAMPLER_SHARED_BYTES` of shared
/// memory; `args` describes valid device buffers, `logits_stride % 4 == 0`.
// The quads' arrays are indexed by the unrolled loop variable, which keeps them in registers.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
pub unsafe fn sample_logits(args: &LogitsSamplerArgs, staging: *mut Candidate) {
    const QUADS: usize = LOGITS_SAMPLER_QUADS as usize;
    // Quad `k` of a thread lies `k` block-widths into the item, so each load of the block
    // reads one contiguous run.
    const BLOCK_ENTRIES: u32 = TILE_KERNEL_WARPS * 32 * 4;
    let thread = arch::thread_index();
    let lane = thread % 32;
    let warp = thread / 32;
    let mut item = arch::block_index();
    let items = args.tiles * args.batch;
    while item < items {
        let tile = item % args.tiles;
        let b = item / args.tiles;
        let first_row0 = tile * LOGITS_SAMPLER_TILE + 4 * thread;
        let row_logits = args.logits.add(b as u64 * args.logits_stride as u64);
        let mut quads = [[f32::NEG_INFINITY; 4]; QUADS];
        for k in 0..QUADS {
            let row0 = first_row0 + k as u32 * BLOCK_ENTRIES;
            if row0 < args.vocab {
                // SAFETY: `row0 < vocab`: the four floats lie in row `b` of the logits (stride a
                // multiple of 4, so 16-byte aligned).
                quads[k] =
                    unsafe { arch::load_global_nc_v4(row_logits.add(row0 as u64).address()) }.map(f32::from_bits);
            }
        }
        // The Philox block and the count of entries inside the vocabulary of quad `k`.
        let block_of = |k: usize| {
            let row0 = first_row0 + k as u32 * BLOCK_ENTRIES;
            ((args.vocab_offset + row0) / 4, args.vocab.saturating_sub(row0).min(4))
        };
        // SAFETY: `b < batch`: a row of the `[batch]` row parameters.
        let row = unsafe { *args.row_params.as_ptr().add(b as usize) };
        if args.row_states.address() != 0 {
            // SAFETY: `b < batch`: row `b` of the `[batch]` processing and states, the states
            // written by the pipeline's earlier launches only.
            let rule = unsafe {
                let state = args.row_states.as_mut_ptr().add(b as usize);
                process::kept_by_state(&row, &*args.processing.as_ptr().add(b as usize), state)
            };
            if rule != KeepRule::ALL {
                each_index!(k < QUADS, {
                    let row0 = first_row0 + k as u32 * BLOCK_ENTRIES;
                    for r in 0..4 {
                        if !rule.keeps(quads[k][r], args.vocab_offset + row0 + r as u32) {
                            quads[k][r] = f32::NEG_INFINITY;
                        }
                    }
                });
            }
        }
        let mut first = 0;
        while first < args.samples {
            for slot in 0..SAMPLES_PER_MERGE {
                let j = first + slot;
                if j >= args.samples {
                    break;
                }
                let draw = args.draw_offset + j;
                let mut scores = [[f32::NEG_INFINITY; 4]; QUADS];
                let mut best_estimate = f32::NEG_INFINITY;
                // Unrolled by hand: constant indices keep the arrays in registers. A quad whose
                // every entry is −∞ (dropped by the keep rule, or past the vocabulary) would
                // estimate −∞ for each: it keeps those scores without its Philox block, which a
                // warp skips when every lane does (most quads under min-p or top-k).
                each_index!(k < QUADS, {
                    if quads[k] != [f32::NEG_INFINITY; 4] {
                        let (philox_block, valid) = block_of(k);
                        let estimate = row_estimate(&row, draw, philox_block, quads[k], valid);
                        best_estimate = maximum(best_estimate, estimate.best());
                        scores[k] = estimate.scores;
                    }
                });
                // SAFETY: every lane of the warp reaches it (uniform loops); the warp's lanes
                // all race row `b`'s draw `j`.
                let threshold = race_threshold(&row, unsafe { column_best(best_estimate, 1, 16) });
                // Bits `4k .. 4k + 4`: quad `k`'s contenders, which the scores alone decide.
                let mut pending = 0u32;
                each_index!(k < QUADS, {
                    pending |= contenders(&BlockEstimate { words: [0; 4], scores: scores[k] }, threshold) << (4 * k);
                });
                // A run-time loop over the few quads with contenders keeps one copy of the exact
                // scores' code.
                let mut best = Candidate::NONE;
                while pending != 0 {
                    let k = (pending.trailing_zeros() / 4) as usize;
                    let (philox_block, valid) = block_of(k);
                    let quad = masked_quad(QUADS, k, |i| quads[i]);
                    let estimate = row_estimate(&row, draw, philox_block, quad, valid);
                    offer_contenders(&mut best, &row, &estimate, quad, (pending >> (4 * k)) & 0xf, 4 * philox_block);
                    pending &= !(0xf << (4 * k));
                }
                // SAFETY: every lane of the warp reaches it (uniform loops).
                let best = unsafe { merge_over_lanes(best, 1, 16) };
                if lane == 0 {
                    // SAFETY: `slot < SAMPLES_PER_MERGE`, `warp < TILE_KERNEL_WARPS`: inside the staging
                    // area (`LOGITS_SAMPLER_SHARED_BYTES`).
                    unsafe { *staging.add((slot * TILE_KERNEL_WARPS + warp) as usize) = best };
                }
            }
            // SAFETY: every thread of the block reaches it (uniform loops).
            unsafe { arch::sync_threads() };
            if thread < SAMPLES_PER_MERGE && first + thread < args.samples {
                let mut best = Candidate::NONE;
                for w in 0..TILE_KERNEL_WARPS {
                    // SAFETY: inside the staging area, written before the barrier above.
                    best = best.merge(unsafe { *staging.add((thread * TILE_KERNEL_WARPS + w) as usize) });
                }
                let j = first + thread;
                let at = candidate_slot(candidate_pair(b, args.samples, j), args.tiles, tile);
                // SAFETY: `b < batch`, `j < samples`, `tile < tiles`: inside the candidates.
                unsafe { *args.candidates.as_mut_ptr().add(at as usize) = best };
            }
            // SAFETY: every thread of the block reaches it (uniform loops).
            unsafe { arch::sync_threads() };
            first += SAMPLES_PER_MERGE;
        }
        item += arch::grid_size();
    }
}

/// `best` of row `b` with the token's logits, where the shard has them: the raw logit, and the
/// processed one from `processed` (the raw one without it).
///
/// # Safety
/// `args.raw` and `args.processed` are null or hold `batch` rows of `logits_stride` floats whose
/// column `i` is the global token `vocab_offset + i`; `best` is a winner of row `b` of this
/// shard.
#[inline(always)]
unsafe fn shard_winner(args: &ReduceArgs, b: u32, best: Candidate) -> ShardWinner {
    let column = best.index.wrapping_sub(args.vocab_offset);
    let mut winner = ShardWinner { candidate: best, ..ShardWinner::NONE };
    if args.raw.address() != 0 && best.index < NON_FINITE_TOKEN && column < args.logits_stride {
        let at = b as usize * args.logits_stride as usize + column as usize;
        // SAFETY: `column < logits_stride`: inside row `b` of the logits (this function's contract).
        winner.raw = unsafe { *args.raw.as_ptr().add(at) };
        winner.processed = match args.processed.address() {
            0 => winner.raw,
            // SAFETY: as above.
            _ => unsafe { *args.processed.as_ptr().add(at) },
        };
    }
    winner
}

/// Merges row `b`'s per-tile log-sum-exp terms in tile order into `args.sums[b]`.
///
/// # Safety
/// Every thread of the block calls it together; `args.part_sums` holds row `b`'s `sum_parts`
/// terms, `args.sums` and `args.row_params` row `b`; `staging` is the block's shared terms.
#[inline(always)]
unsafe fn merge_part_sums(args: &ReduceArgs, b: u32, staging: *mut RowSums) {
    let thread = arch::thread_index();
    // SAFETY: `b < batch` (this function's contract).
    let temperature = unsafe { (*args.row_params.as_ptr().add(b as usize)).temperature };
    let terms = args.part_sums.as_ptr().wrapping_add((b * args.sum_parts) as usize);
    // Each thread merges a contiguous run of parts, so that lane order, then warp order, is part
    // order.
    let per_thread = args.sum_parts.div_ceil(REDUCE_THREADS);
    let mut sums = RowSums { raw: LogSumExp::EMPTY, kept: LogSumExp::EMPTY };
    let mut k = thread * per_thread;
    while k < ((thread + 1) * per_thread).min(args.sum_parts) {
        // SAFETY: `k < sum_parts`: one of row `b`'s terms.
        let part = unsafe { *terms.add(k as usize) };
        sums.raw.merge_with(part.raw, 1.0);
        sums.kept.merge_with(part.kept, temperature);
        k += 1;
    }
    // The staging's `RowSums` per warp: a slot per warp for either sum.
    let (warps, slots) = ((REDUCE_THREADS / 32) as usize, staging.cast::<LogSumExp>());
    // SAFETY: every thread of the block together (this function's contract), each merge with
    // its own slots.
    let row = unsafe {
        RowSums {
            raw: process::merge_lse_over_block(sums.raw, 1.0, slots, warps),
            kept: process::merge_lse_over_block(sums.kept, temperature, slots.add(warps), warps),
        }
    };
    if thread == 0 {
        // SAFETY: `b < batch`: row `b` of the sums.
        unsafe { *args.sums.as_mut_ptr().add(b as usize) = row };
    }
}

/// The merge kernel: one block per (row, draw) merges that draw's candidates over all tiles and
/// writes the winning index, which is [`NO_TOKEN`](flashsample_core::NO_TOKEN) or
/// [`NON_FINITE_TOKEN`](flashsample_core::NON_FINITE_TOKEN) for a row without a token, or a
/// vocabulary shard's [`ShardWinner`] with the token's logits.
///
/// # Safety
/// Launched with [`REDUCE_THREADS`] threads and `REDUCE_THREADS / 32` candidates of shared
/// memory; `args` describes valid device buffers.
#[inline(always)]
pub unsafe fn reduce_candidates(args: &ReduceArgs, staging: *mut Candidate) {
    let thread = arch::thread_index();
    let lane = thread % 32;
    let warp = thread / 32;
    let mut item = arch::block_index();
    while item < args.batch * args.samples {
        let b = item / args.samples;
        let j = item % args.samples;
        if j == 0 && args.part_sums.address() != 0 {
            let sums_staging = staging.wrapping_add((REDUCE_THREADS / 32) as usize).cast::<RowSums>();
            // SAFETY: every thread of the block together (`j` is the block's); the terms and sums
            // hold row `b` (the launcher's contract).
            unsafe { merge_part_sums(args, b, sums_staging) };
        }
        let base = args.candidates.as_ptr().wrapping_add(candidate_slot(item as u64, args.tiles, 0) as usize);
        let mut best = Candidate::NONE;
        let mut tile = thread;
        while tile < args.tiles {
            // SAFETY: `tile < tiles`: inside this (row, draw)'s candidates.
            best = best.merge(unsafe { *base.add(tile as usize) });
            tile += REDUCE_THREADS;
        }
        // SAFETY: every lane reaches it (uniform loops).
        best = unsafe { merge_over_lanes(best, 1, 16) };
        if lane == 0 {
            // SAFETY: `warp < REDUCE_THREADS / 32`: inside the staging area
            // (`REDUCE_SHARED_BYTES`).
            unsafe { *staging.add(warp as usize) = best };
        }
        // SAFETY: every thread of the block reaches it (uniform loops).
        unsafe { arch::sync_threads() };
        if thread == 0 {
            for w in 1..REDUCE_THREADS / 32 {
                // SAFETY: inside the staging area, written before the barrier above.
                best = best.merge(unsafe { *staging.add(w as usize) });
            }
            let at = b as u64 * args.token_stride as u64 + args.draw_offset as u64 + j as u64;
            if args.winners.address() == 0 {
                // SAFETY: `b < batch` and `draw_offset + j < token_stride`: inside the `[batch,
                // token_stride]` tokens.
                unsafe { *args.tokens.as_mut_ptr().add(at as usize) = best.index };
            } else {
                // SAFETY: as above, for the `[batch, token_stride]` winners and logits of `batch`
                // rows.
                unsafe { *args.winners.as_mut_ptr().add(at as usize) = shard_winner(args, b, best) };
            }
        }
        // SAFETY: every thread of the block reaches it (uniform loops).
        unsafe { arch::sync_threads() };
        item += arch::grid_size();
    }
}

/// Elements of a winner's dot product each thread loads before it multiplies any: enough
/// loads in flight that a block finishes a dot product of 4096 elements in two trips to
/// memory (one load at a time made it one trip per 32 elements, about 35 µs).
const DOT_BATCH: u32 = 8;

/// The winners' logits of a fused call (see [`WinnerLogitsArgs`]): one block per winner, its
/// threads taking every [`WINNER_LOGITS_THREADS`]-th element of the dot product, then a
/// butterfly sum per warp and the warps' sums in warp order; thread 0 applies the row's
/// per-entry steps and writes both logits into the winner, or, for an unsharded call, the token
/// and its log-probabilities (and the row's empty top entries). The product of two elements
/// (bf16, f16 or f32) is exact in f64, and their f64 sum rounds 29 bits below f32's: the raw
/// logit is the dot product rounded once to f32 unless its terms cancel by more than that (the
/// tiles' own f32 sums round at every step).
///
/// # Safety
/// Launched with [`WINNER_LOGITS_THREADS`] threads per block and `staging` holding an f64 per
/// warp (`WINNER_LOGITS_SHARED_BYTES`); `args` describes valid device buffers: `winners` holds
/// `batch · samples` winners of this shard, `W` `vocab` rows and `H` `batch` rows of `dim`
/// elements at their strides, the processing (if not null) `batch` rows for the global
/// vocabulary up to `vocab_offset + vocab`; with `tokens`, the outputs hold `batch · samples`
/// slots (and `top` `batch` rows), `sums` and `row_params` `batch` rows.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // constant indices once unrolled keep the pairs in registers
pub unsafe fn winner_logits<T: Element>(args: &WinnerLogitsArgs, staging: *mut f64) {
    let thread = arch::thread_index();
    let (lane, warp) = (thread % 32, thread / 32);
    let slots = args.batch as u64 * args.samples as u64;
    let mut k = arch::block_index() as u64;
    // `k` is the block's: the loop and the branches on the winner below are uniform over it.
    while k < slots {
        let b = (k / args.samples as u64) as u32;
        // SAFETY: `k < batch · samples`: one of the winners.
        let winner = unsafe { *args.winners.as_ptr().add(k as usize) };
        let token = winner.candidate.index;
        let column = token.wrapping_sub(args.vocab_offset);
        let mut logits = None;
        if token < NON_FINITE_TOKEN && column < args.vocab {
            let lm_head_row = args.lm_head.address() + column as u64 * args.lm_head_stride as u64 * T::BYTES;
            let hidden_row = args.hidden.address() + b as u64 * args.hidden_stride as u64 * T::BYTES;
            // Past `dim` a thread loads the last element and drops it: a select, where a branch
            // would have each load wait for the one before.
            let load = |i: u32| {
                let at = i.min(args.dim - 1) as u64 * T::BYTES;
                // SAFETY: `column < vocab`, `b < batch` and `at` is an element `< dim` (`dim ≥ 1`:
                // a winner exists): elements of the matrices, aligned to their type.
                let (w, h) = unsafe { (T::load(lm_head_row + at), T::load(hidden_row + at)) };
                if i < args.dim { (w, h) } else { (0.0, 0.0) }
            };
            let mut sum = 0.0f64;
            let mut first = thread;
            while first < args.dim {
                let mut pairs = [(0.0f32, 0.0f32); DOT_BATCH as usize];
                for u in 0..DOT_BATCH as usize {
                    pairs[u] = load(first + u as u32 * WINNER_LOGITS_THREADS);
                }
                for u in 0..DOT_BATCH as usize {
                    sum += pairs[u].0 as f64 * pairs[u].1 as f64;
                }
                first += DOT_BATCH * WINNER_LOGITS_THREADS;
            }
            let mut mask = 1;
            while mask < 32 {
                // SAFETY: all 32 lanes of the warp (uniform over the block, see above); `a + b`
                // and `b + a` are the same float, so both lanes of a pair hold the same sum.
                sum += f64::from_bits(unsafe { arch::shuffle_xor_u64(sum.to_bits(), mask) });
                mask <<= 1;
            }
            if lane == 0 {
                // SAFETY: `warp < WINNER_LOGITS_THREADS / 32`: the warp's slot of the staging.
                unsafe { *staging.add(warp as usize) = sum };
            }
            // SAFETY: every thread of the block reaches it (uniform branch).
            unsafe { arch::sync_threads() };
            if thread == 0 {
                let mut total = 0.0f64;
                for w in 0..WINNER_LOGITS_THREADS / 32 {
                    // SAFETY: written before the barrier above.
                    total += unsafe { *staging.add(w as usize) };
                }
                let raw = total as f32;
                // Thread 0 alone writes, so it alone processes.
                let processed = if args.processing.address() == 0 {
                    raw
                } else {
                    let first = args.vocab_offset + (column & !3);
                    let vocab_end = args.vocab_offset + args.vocab;
                    // SAFETY: `b < batch`: row `b` of the processing (this function's contract).
                    let [q0, q1, q2, q3] =
                        unsafe { process::fused_quad(args.processing, b, first, vocab_end, [raw; 4]) };
                    // Selects, not an index: an array indexed at run time goes to the stack.
                    match column & 3 {
                        0 => q0,
                        1 => q1,
                        2 => q2,
                        _ => q3,
                    }
                };
                logits = Some((raw, processed));
            }
            // SAFETY: as above; the staging is read before the next winner's writes.
            unsafe { arch::sync_threads() };
        }
        if thread == 0 {
            if args.tokens.address() == 0 {
                if let Some((raw, processed)) = logits {
                    // SAFETY: as above, one winner per block.
                    unsafe { *args.winners.as_mut_ptr().add(k as usize) = ShardWinner { raw, processed, ..winner } };
                }
            } else {
                let outputs =
                    TokenOutputs { tokens: args.tokens, logprobs: args.logprobs, processed: args.processed_logprobs };
                // SAFETY: `b < batch`: row `b` of the terms and row parameters; `k` a slot of the
                // outputs (this function's contract).
                unsafe {
                    let (sums, row) = (*args.sums.as_ptr().add(b as usize), *args.row_params.as_ptr().add(b as usize));
                    outputs.write(k as usize, token, logits, &sums, &row);
                }
                if k.is_multiple_of(args.samples as u64) && args.top.address() != 0 {
                    let top = args.top.as_mut_ptr().wrapping_add(b as usize * MAX_TOP_LOGPROBS as usize);
                    for slot in 0..MAX_TOP_LOGPROBS as usize {
                        // SAFETY: row `b`'s top slots (this function's contract).
                        unsafe { *top.add(slot) = TopLogprob::NONE };
                    }
                }
            }
        }
        k += arch::grid_size() as u64;
    }
}
