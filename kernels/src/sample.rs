//! The fused tile kernels' sampling epilogue, the unfused logits sampler, and the merge kernel.

use flashsample_core::abi::{
    FusedArgs, LogitsSamplerArgs, N_TILE, REDUCE_THREADS, ReduceArgs, RowSums, SAMPLES_PER_MERGE, ShardWinner,
    TILE_KERNEL_WARPS, candidate_pair, candidate_slot,
};
use flashsample_core::candidate::maximum;
use flashsample_core::process::LogSumExp;
use flashsample_core::{Candidate, NON_FINITE_TOKEN, block_candidate};

use crate::tile::ThreadLogits;
use crate::{arch, process};

/// `logits[slot / 2][slot % 2]` through a chain of selects, so the array stays in registers.
// Indexing by the loop variables gives constant indices once unrolled, which keeps the
// arrays in registers.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
fn pick<const NT: usize>(logits: &ThreadLogits<NT>, slot: usize) -> [f32; 4] {
    let mut picked = logits[0][0];
    for nt in 0..NT {
        for c in 0..2 {
            if slot == 2 * nt + c {
                picked = logits[nt][c];
            }
        }
    }
    picked
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

/// The epilogue of the fused tile kernels: for every draw, the best candidate of this block's
/// tile for each batch column, written to `candidates`.
///
/// Each thread scores its four rows per column with [`block_scores`]; lanes with the same
/// `t` (same columns) merge over `g`; warps merge through `staging` in batches of
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
                let mut best = Candidate::NONE;
                // Columns past the batch (a batch tile wider than B) draw no noise; their lanes
                // still join the shuffles below.
                if col0 + column < args.batch {
                    // SAFETY: `col0 + column < batch`: a row of the `[batch]` row parameters.
                    let row = unsafe { *args.row_params.as_ptr().add((col0 + column) as usize) };
                    let mut quad = pick(logits, column_slot);
                    if args.processing.address() != 0 {
                        // SAFETY: `col0 + column < batch`: the launch's processing holds the row.
                        quad = unsafe {
                            process::fused_quad(
                                args.processing,
                                col0 + column,
                                index0,
                                args.vocab_offset + args.vocab,
                                quad,
                            )
                        };
                    }
                    best = block_candidate(&row, args.draw_offset + j, philox_block, quad, rows_valid);
                }
                // SAFETY: every lane of the warp reaches it: the column loop's bounds are the same
                // for all lanes.
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

/// The block's log-sum-exp terms of its `rows_valid`-masked quads, raw at T = 1 and processed
/// at `temperature` (empty unless `sampling`), in two passes: the block's maxima, then the sums
/// of `LogSumExp::term`, which add no rescaling per entry. Every thread returns the terms.
///
/// # Safety
/// Every thread of the block calls it together; `staging` holds a `RowSums` per warp of shared
/// memory, which the threads may rewrite once every thread has passed the block's next
/// barrier after this call.
#[inline(always)]
unsafe fn block_sums(
    raw: [f32; 4],
    processed: [f32; 4],
    rows_valid: u32,
    sampling: bool,
    temperature: f32,
    staging: *mut RowSums,
) -> RowSums {
    let thread = arch::thread_index();
    let (lane, warp) = (thread % 32, (thread / 32) as usize);
    // Scalars, not indexed arrays: an array indexed in a loop goes to the stack.
    let ([r0, r1, r2, r3], [p0, p1, p2, p3]) = (raw, processed);
    let valid = |r: u32, x: f32| if r < rows_valid { x } else { f32::NEG_INFINITY };
    let (r0, r1, r2, r3) = (valid(0, r0), valid(1, r1), valid(2, r2), valid(3, r3));
    let kept = |r: u32, x: f32| if sampling { valid(r, x) } else { f32::NEG_INFINITY };
    let (p0, p1, p2, p3) = (kept(0, p0), kept(1, p1), kept(2, p2), kept(3, p3));
    let mut raw_max = maximum(maximum(r0, r1), maximum(r2, r3));
    let mut kept_max = maximum(maximum(p0, p1), maximum(p2, p3));
    let mut mask = 1;
    while mask < 32 {
        // SAFETY: all lanes together (this function's contract).
        unsafe {
            raw_max = maximum(raw_max, f32::from_bits(arch::shuffle_xor(raw_max.to_bits(), mask)));
            kept_max = maximum(kept_max, f32::from_bits(arch::shuffle_xor(kept_max.to_bits(), mask)));
        }
        mask <<= 1;
    }
    if lane == 0 {
        // SAFETY: warp `warp`'s slot.
        unsafe { ((*staging.add(warp)).raw.max, (*staging.add(warp)).kept.max) = (raw_max, kept_max) };
    }
    // SAFETY: every thread of the block (this function's contract).
    unsafe { arch::sync_threads() };
    for w in 0..TILE_KERNEL_WARPS as usize {
        // SAFETY: written before the barrier above.
        let slot = unsafe { *staging.add(w) };
        (raw_max, kept_max) = (maximum(raw_max, slot.raw.max), maximum(kept_max, slot.kept.max));
    }
    let t = |l: f32, max: f32, temperature: f32| LogSumExp::term(l, max, temperature);
    let mut raw_sum = t(r0, raw_max, 1.0) + t(r1, raw_max, 1.0) + t(r2, raw_max, 1.0) + t(r3, raw_max, 1.0);
    let mut kept_sum = t(p0, kept_max, temperature)
        + t(p1, kept_max, temperature)
        + t(p2, kept_max, temperature)
        + t(p3, kept_max, temperature);
    let mut mask = 1;
    while mask < 32 {
        // SAFETY: all lanes together; `a + b` and `b + a` are the same float, so both lanes of
        // a pair hold the same sum.
        unsafe {
            raw_sum += f32::from_bits(arch::shuffle_xor(raw_sum.to_bits(), mask));
            kept_sum += f32::from_bits(arch::shuffle_xor(kept_sum.to_bits(), mask));
        }
        mask <<= 1;
    }
    if lane == 0 {
        // SAFETY: warp `warp`'s slot; the maxima read above are other fields.
        unsafe { ((*staging.add(warp)).raw.sum, (*staging.add(warp)).kept.sum) = (raw_sum, kept_sum) };
    }
    // SAFETY: every thread of the block.
    unsafe { arch::sync_threads() };
    let (mut raw_total, mut kept_total) = (0.0, 0.0);
    for w in 0..TILE_KERNEL_WARPS as usize {
        // SAFETY: written before the barrier above.
        let slot = unsafe { *staging.add(w) };
        (raw_total, kept_total) = (raw_total + slot.raw.sum, kept_total + slot.kept.sum);
    }
    let lse = |max: f32, sum: f32| if max == f32::NEG_INFINITY { LogSumExp::EMPTY } else { LogSumExp { max, sum } };
    RowSums { raw: lse(raw_max, raw_total), kept: lse(kept_max, kept_total) }
}

/// The unfused sampler: reads materialised logits, four per thread, applies the row's
/// per-entry processing if asked, and writes one candidate per (row, draw, 512-entry tile)
/// exactly as the fused epilogue would; with `tile_sums`, also the tile's log-sum-exp terms.
///
/// # Safety
/// Launched with `TILE_KERNEL_WARPS · 32` threads and `LOGITS_SAMPLER_SHARED_BYTES` of shared
/// memory; `args` describes valid device buffers, `logits_stride % 4 == 0`.
#[inline(always)]
pub unsafe fn sample_logits(args: &LogitsSamplerArgs, staging: *mut Candidate) {
    let thread = arch::thread_index();
    let lane = thread % 32;
    let warp = thread / 32;
    let sums_staging = staging.wrapping_add((SAMPLES_PER_MERGE * TILE_KERNEL_WARPS) as usize).cast::<RowSums>();
    let mut item = arch::block_index();
    let items = args.tiles * args.batch;
    while item < items {
        let tile = item % args.tiles;
        let b = item / args.tiles;
        let row0 = (tile * TILE_KERNEL_WARPS * 32 + thread) * 4;
        let index0 = args.vocab_offset + row0;
        let rows_valid = args.vocab.saturating_sub(row0).min(4);
        let raw = if rows_valid > 0 {
            let address = args.logits.add(b as u64 * args.logits_stride as u64 + row0 as u64).address();
            // SAFETY: `rows_valid > 0`: `row0 < vocab`, so the four floats lie in row `b` of the
            // logits (stride a multiple of 4, so 16-byte aligned).
            unsafe { arch::load_global_nc_v4(address) }.map(f32::from_bits)
        } else {
            [f32::NEG_INFINITY; 4]
        };
        // SAFETY: `b < batch`: a row of the `[batch]` row parameters.
        let row = unsafe { *args.row_params.as_ptr().add(b as usize) };
        let mut logits = raw;
        if args.processing.address() != 0 {
            // SAFETY: `b < batch`: the launch's processing holds the row.
            logits = unsafe { process::fused_quad(args.processing, b, index0, args.vocab_offset + args.vocab, raw) };
        }
        if args.tile_sums.address() != 0 {
            let sampling = row.greedy == 0;
            // SAFETY: every thread of the block together (uniform loops); `b < batch`, `tile <
            // tiles`.
            let sums = unsafe { block_sums(raw, logits, rows_valid, sampling, row.temperature, sums_staging) };
            if thread == 0 {
                // SAFETY: row `b`'s term of tile `tile`.
                unsafe { *args.tile_sums.as_mut_ptr().add((b * args.tiles + tile) as usize) = sums };
            }
        }
        let mut first = 0;
        while first < args.samples {
            for slot in 0..SAMPLES_PER_MERGE {
                let j = first + slot;
                if j >= args.samples {
                    break;
                }
                let best = block_candidate(&row, args.draw_offset + j, index0 / 4, logits, rows_valid);
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
/// processed one from `processed` or, without it, the raw quad after `processing`'s steps (as
/// the logits sampler applied them).
///
/// # Safety
/// `args.raw` and `args.processed` are null or hold `batch` rows of `logits_stride` floats whose
/// column `i` is the global token `vocab_offset + i`; `args.processing`, if not null, holds
/// `batch` rows; `best` is a winner of row `b` of this shard.
#[inline(always)]
unsafe fn shard_winner(args: &ReduceArgs, b: u32, best: Candidate) -> ShardWinner {
    let column = best.index.wrapping_sub(args.vocab_offset);
    let mut winner = ShardWinner { candidate: best, ..ShardWinner::NONE };
    if args.raw.address() != 0 && best.index < NON_FINITE_TOKEN && column < args.logits_stride {
        let row = b as usize * args.logits_stride as usize;
        // SAFETY: `column < logits_stride`: inside row `b` of the logits (this function's contract).
        winner.raw = unsafe { *args.raw.as_ptr().add(row + column as usize) };
        winner.processed = if args.processed.address() != 0 {
            // SAFETY: as above.
            unsafe { *args.processed.as_ptr().add(row + column as usize) }
        } else if args.processing.address() != 0 {
            let first = column & !3;
            // SAFETY: the quad `first .. first + 4` lies in row `b` (the stride is a multiple of 4).
            let quad: [f32; 4] = core::array::from_fn(|r| unsafe { *args.raw.as_ptr().add(row + first as usize + r) });
            let vocab_end = args.vocab_offset + args.vocab;
            // SAFETY: row `b` of the processing (this function's contract).
            let [q0, q1, q2, q3] =
                unsafe { process::fused_quad(args.processing, b, args.vocab_offset + first, vocab_end, quad) };
            // Selects, not an index: an array indexed at run time goes to the stack.
            match column & 3 {
                0 => q0,
                1 => q1,
                2 => q2,
                _ => q3,
            }
        } else {
            winner.raw
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
