//! The handoff tile: the cooperative TMA + `wgmma` mainloop of [`super::cooperative`] on items of
//! [`HANDOFF_ROWS`] × `N`, with the sampling epilogue moved to warps of its own, so the
//! tensor cores do not wait for it.
//!
//! Warps 0–7 (two consumer warpgroups) multiply each item (64 rows each), store the f32
//! accumulators into a column-major logits buffer in shared memory and go on to the next
//! item at once. Warp 8 holds the producer thread. Warps 9–15 ([`HANDOFF_EPILOGUE_WARPS`])
//! score the buffer, [`GROUP_COLUMNS`] columns at a time per warp: [`COLUMN_LANES`] lanes per
//! column, each holding [`LANE_QUADS`] quads (four consecutive rows, one Philox block each),
//! so a column's race over the item's 128 rows ends in a merge over those lanes. A column's
//! estimates usually leave one contender: it waits in the column's padding in the buffer and
//! the warp scores such winners exactly one lane per column, once per item and draw. A
//! listing launch (the listed path's, no draws) writes each column's list of its first
//! entries instead ([`list_columns`]): a column's eight lanes hold all its rows. Two
//! barriers pass the buffer back and forth: `logits_full` (the consumers' 256 arrivals) and
//! `logits_empty` (the epilogue warps' arrivals); the epilogue of item `i` overlaps the
//! mainloop of item `i + 1`.
//!
//! The block has 512 threads, so ptxas gives each at most 128 registers: enough for the
//! consumers' 64 accumulators and for the epilogue.
//!
//! Architecture Invariant: the buffer holds the exact f32 accumulators (no narrowing), and
//! the epilogue scores them with the estimate-then-exact race keyed by vocabulary row, so
//! the tokens are those of every other tile.

use flashsample_core::Candidate;
use flashsample_core::abi::{
    HANDOFF_COLUMN_STRIDE, HANDOFF_COLUMNS, HANDOFF_EPILOGUE_WARPS, HANDOFF_ROWS, TMA_CONSUMER_WARPS, TMA_K_BLOCK,
    TmaArgs, WARPGROUP_ROWS, handoff_logits_bytes, tma_handoff_stages,
};
use flashsample_core::candidate::maximum;
use flashsample_core::estimate::exact_entry;

use super::WARPGROUP_THREADS;
use super::epilogue::{PAD_ROW, write_candidate};
use super::fragments::for_each_quad;
use super::pipeline::Ring;
use super::race::{COLUMN_LANES, Deferred, LANE_QUADS, estimate_column};
use super::scheduler::Items;
use crate::hopper::WgmmaElement;
use crate::sample::ColumnQuad;
use crate::{arch, each_index, hopper, process, sample};

/// Four consecutive logits of one column, read from the buffer with one 16-byte load.
#[repr(C, align(16))]
#[derive(Clone, Copy)]
struct Quad([f32; 4]);

/// Where the block's shared memory holds what: the ring's boxes (1024-aligned), the logits
/// buffer, the ring's barriers, then the buffer's two barriers.
struct HandoffLayout {
    ring: Ring,
    /// `N` columns of [`HANDOFF_COLUMN_STRIDE`] floats: row `r` of column `c` at
    /// `c · stride + r`.
    logits: *mut f32,
    /// Completes when the consumers have stored an item's logits.
    logits_full: u32,
    /// Completes when the epilogue warps are done reading them.
    logits_empty: u32,
}

impl HandoffLayout {
    #[inline(always)]
    fn new(base: *mut u8, columns: u32) -> HandoffLayout {
        let shared = arch::shared_address(base);
        let start = shared.next_multiple_of(1024);
        let stages = tma_handoff_stages(columns);
        let logits_address = Ring::new(start, stages, HANDOFF_ROWS, columns, 0).boxes_end();
        let ring = Ring::new(start, stages, HANDOFF_ROWS, columns, logits_address + handoff_logits_bytes(columns));
        let logits_full = ring.barriers_end();
        let logits = base.wrapping_add((logits_address - shared) as usize).cast::<f32>();
        HandoffLayout { ring, logits, logits_full, logits_empty: logits_full + 8 }
    }
}

/// Consumer threads, which arrive on `logits_full` and on the ring's `empty` barriers.
const CONSUMER_THREADS: u32 = TMA_CONSUMER_WARPS * 32;
/// The warp whose lane 0 is the producer.
const PRODUCER_WARP: u32 = TMA_CONSUMER_WARPS;

/// The handoff sampling kernel on items of [`HANDOFF_ROWS`] × `N`, `R = N / 2` accumulators
/// per consumer thread.
///
/// # Safety
/// Launched with `TMA_HANDOFF_THREADS` threads and `tma_handoff_shared_bytes(N)` bytes of
/// dynamic shared memory at `shared`; `args` holds tensor maps of `W` and `H` with boxes of
/// 64 × [`HANDOFF_ROWS`] and 64 × `N` elements and 128-byte swizzle, and valid row
/// parameters and candidate buffers.
#[inline(always)]
pub unsafe fn tma_handoff_kernel<T: WgmmaElement, const N: usize, const R: usize>(args: &TmaArgs, shared: *mut u8) {
    let thread = arch::thread_index();
    let warp = thread / 32;
    let layout = HandoffLayout::new(shared, N as u32);
    if thread == 0 {
        // SAFETY: thread 0 alone initialises every barrier before the block barrier publishes them.
        unsafe {
            layout.ring.init(CONSUMER_THREADS);
            hopper::barrier_init(layout.logits_full, CONSUMER_THREADS);
            hopper::barrier_init(layout.logits_empty, HANDOFF_EPILOGUE_WARPS * 32);
            hopper::fence_barrier_init();
        }
    }
    // SAFETY: every thread of the block reaches it.
    unsafe { arch::sync_threads() };
    if warp < TMA_CONSUMER_WARPS {
        // SAFETY: every consumer thread calls it, after the barriers are published.
        unsafe { consume::<T, N, R>(args, &layout, thread) };
    } else if warp == PRODUCER_WARP {
        if thread == PRODUCER_WARP * 32 {
            // SAFETY: one thread (the producer), after the barriers are published; `args` holds the
            // maps this kernel's contract requires.
            unsafe { layout.ring.produce(args, HANDOFF_ROWS, N as u32) };
        }
    } else {
        // SAFETY: all 32 lanes of every epilogue warp call it, after the barriers are published.
        unsafe { score::<N>(args, &layout, warp - PRODUCER_WARP - 1, thread % 32) };
    }
}

/// A consumer thread: multiplies every item of the block with the other consumers (its
/// warpgroup's 64 rows), waits until the epilogue has read the previous item's logits, and
/// stores its accumulators into the buffer.
///
/// # Safety
/// As [`tma_handoff_kernel`]; called by all consumer threads.
#[inline(always)]
unsafe fn consume<T: WgmmaElement, const N: usize, const R: usize>(
    args: &TmaArgs,
    layout: &HandoffLayout,
    thread: u32,
) {
    let warpgroup = thread / WARPGROUP_THREADS;
    // SAFETY: every consumer thread calls `consume`, so whole warps reach the shuffle.
    let w_offset = unsafe { arch::broadcast_lane0(warpgroup * WARPGROUP_ROWS * 2 * TMA_K_BLOCK) };
    let k_blocks = args.dim.div_ceil(TMA_K_BLOCK);
    let lane = thread % 32;
    // `wgmma` m64nN: lane `4g + t` of warp `w` holds rows `16w + g` and `16w + g + 8`,
    // columns `8j + 2t` and `8j + 2t + 1` of n8-tile `j`.
    let row = warpgroup * WARPGROUP_ROWS + 16 * ((thread / 32) % 4) + lane / 4;
    let column = 2 * (lane % 4);
    let mut acc = [0.0f32; R];
    let mut handoffs = 0u32;
    // A u32 phase count, as the barrier parity wants it (`enumerate` would count in usize).
    #[allow(clippy::explicit_counter_loop)]
    for (position, _, _) in Items::new(args, N as u32, 0, 1) {
        let first = position * k_blocks;
        // SAFETY: all consumer threads multiply every item together; `logits_empty` is initialised.
        unsafe {
            // `wait_group 0` after each stage: the stage is freed as soon as its multiplies
            // end, so one more stage of the short ring is in flight.
            layout.ring.multiply::<T, R, 0>(first, k_blocks, w_offset, &mut acc);
            // A fresh barrier counts its (never run) previous phase as complete: the first
            // item does not wait.
            hopper::barrier_wait(layout.logits_empty, (handoffs & 1) ^ 1);
        }
        let store = |j: usize, quad: [f32; 4]| {
            let at = |c: u32, r: u32| {
                layout.logits.wrapping_add(((8 * j as u32 + column + c) * HANDOFF_COLUMN_STRIDE + row + r) as usize)
            };
            // SAFETY: inside the buffer (column < N, row < HANDOFF_ROWS); the epilogue does not
            // read it until `logits_full`.
            unsafe {
                *at(0, 0) = quad[0];
                *at(1, 0) = quad[1];
                *at(0, 8) = quad[2];
                *at(1, 8) = quad[3];
            }
        };
        for_each_quad!(&acc, store);
        // SAFETY: `logits_full` is initialised; every consumer thread arrives once per item.
        unsafe { hopper::barrier_arrive(layout.logits_full) };
        handoffs += 1;
    }
}

/// What an item's logits take before its draws, for the quads epilogue warp `warp`'s lane
/// `lane` races (column `8 · group + lane / 8` of each of the warp's groups, quads
/// `lane % 8 + 8i`; a loop apart from the race's, which keeps its registers free): the
/// per-entry processing, in place in the buffer, if the launch has any, and the tile's
/// log-sum-exp terms of each column, if the launch asks for them (a column's eight lanes hold
/// all its rows).
///
/// # Safety
/// As [`score`], after `logits_full`; the processing holds the batch's rows.
#[inline(always)]
unsafe fn prepare_columns<const N: usize>(
    args: &TmaArgs,
    layout: &HandoffLayout,
    warp: u32,
    lane: u32,
    tile: u32,
    col0: u32,
) {
    let (slot, part) = (lane % COLUMN_LANES, lane / COLUMN_LANES);
    let (processing, sums) = (args.processing.address() != 0, args.tile_sums.address() != 0);
    let vocab_end = args.vocab_offset + args.vocab;
    let mut group = warp;
    while group * GROUP_COLUMNS < N as u32 && col0 + group * GROUP_COLUMNS < args.batch {
        let column = group * GROUP_COLUMNS + part;
        let b = col0 + column;
        let in_batch = b < args.batch;
        // SAFETY: `b < batch`: a row of the `[batch]` row parameters.
        let row = if in_batch && sums { unsafe { *args.row_params.as_ptr().add(b as usize) } } else { PAD_ROW };
        let mut quads = [ColumnQuad {
            raw: [0.0; 4],
            processed: [0.0; 4],
            rows_valid: 0,
            sampling: in_batch && row.greedy == 0,
            inverse_temperature: 1.0 / row.temperature,
        }; LANE_QUADS];
        each_index!(i < LANE_QUADS, {
            let quad = slot + COLUMN_LANES * i as u32;
            let at = layout.logits.wrapping_add((column * HANDOFF_COLUMN_STRIDE + 4 * quad) as usize).cast::<Quad>();
            // SAFETY: column < N and quad < HANDOFF_ROWS / 4 lie in the buffer, 16-byte aligned;
            // only this lane touches the quad until the race reads it.
            let raw = unsafe { (*at).0 };
            let mut processed = raw;
            if processing && in_batch {
                let index0 = args.vocab_offset + tile * HANDOFF_ROWS + 4 * quad;
                // SAFETY: `b < batch`: the launch's processing holds the row; the quad as above.
                unsafe {
                    processed = process::fused_quad(args.processing, b, index0, vocab_end, raw);
                    *at = Quad(processed);
                }
            }
            let rows_valid = args.vocab.saturating_sub(tile * HANDOFF_ROWS + 4 * quad).min(4);
            quads[i] = ColumnQuad { raw, processed, rows_valid, ..quads[i] };
        });
        if sums {
            let mut maxima = [f32::NEG_INFINITY; 2];
            each_index!(i < LANE_QUADS, {
                let [raw, kept] = quads[i].maxima();
                maxima = [maximum(maxima[0], raw), maximum(maxima[1], kept)];
            });
            // SAFETY: all 32 lanes (`sums` and the group loop are uniform over the warp); a
            // column's lanes differ in the bits below `COLUMN_LANES`.
            maxima = unsafe { sample::combine_over_lanes(maxima, 1, COLUMN_LANES / 2, maximum) };
            let mut terms = [0.0f32; 2];
            each_index!(i < LANE_QUADS, {
                let [raw, kept] = quads[i].terms(maxima);
                terms = [terms[0] + raw, terms[1] + kept];
            });
            // SAFETY: as above.
            terms = unsafe { sample::combine_over_lanes(terms, 1, COLUMN_LANES / 2, |x, y| x + y) };
            if slot == 0 && in_batch {
                // SAFETY: `b < batch`, `tile < tiles`: inside the `[batch, tiles]` terms.
                unsafe {
                    *args.tile_sums.as_mut_ptr().add((b * args.tiles + tile) as usize) =
                        sample::column_sums(maxima, terms)
                };
            }
        }
        group += HANDOFF_EPILOGUE_WARPS;
    }
    // SAFETY: all 32 lanes of the warp reach it (uniform loop bounds).
    unsafe { arch::sync_warp() };
}

/// Each batch column's list of its first processed entries in the item's tile
/// ([`TileTop`](flashsample_core::truncation::TileTop), into `args.tile_tops`), from the
/// buffer after [`prepare_columns`]: the [`COLUMN_LANES`] lanes of a column hold all its rows
/// (lane `lane` the quads `lane % 8 + 8i` of column `8 · group + lane / 8`), so the list's
/// rounds stay within the warp.
///
/// # Safety
/// As [`score`], after `logits_full` and the processing; `args.tile_tops` holds `[batch,
/// tiles]` lists.
#[inline(always)]
unsafe fn list_columns<const N: usize>(
    args: &TmaArgs,
    layout: &HandoffLayout,
    warp: u32,
    lane: u32,
    tile: u32,
    col0: u32,
) {
    let (slot, part) = (lane % COLUMN_LANES, lane / COLUMN_LANES);
    let mut group = warp;
    while group * GROUP_COLUMNS < N as u32 && col0 + group * GROUP_COLUMNS < args.batch {
        let column = group * GROUP_COLUMNS + part;
        let b = col0 + column;
        let mut words = [0u64; 4 * LANE_QUADS];
        let mut non_finite = false;
        if b < args.batch {
            each_index!(i < LANE_QUADS, {
                let quad = slot + COLUMN_LANES * i as u32;
                let at = layout.logits.wrapping_add((column * HANDOFF_COLUMN_STRIDE + 4 * quad) as usize);
                // SAFETY: column < N and quad < HANDOFF_ROWS / 4 lie in the buffer, 16-byte
                // aligned; processed in place by this lane before.
                let processed = unsafe { (*at.cast::<Quad>()).0 };
                let row0 = tile * HANDOFF_ROWS + 4 * quad;
                let rows_valid = args.vocab.saturating_sub(row0).min(4);
                let (quad_words, quad_non_finite) = sample::quad_words(processed, args.vocab_offset + row0, rows_valid);
                each_index!(r < 4, {
                    words[4 * i + r] = quad_words[r];
                });
                non_finite |= quad_non_finite;
            });
        }
        // SAFETY: all 32 lanes (the group loop is uniform over the warp); a column's lanes
        // differ in the bits below `COLUMN_LANES`.
        let top = unsafe { sample::column_top(words, non_finite, 1, COLUMN_LANES / 2) };
        if slot == 0 && b < args.batch {
            // SAFETY: `b < batch`, `tile < tiles`: inside the `[batch, tiles]` lists.
            unsafe { *args.tile_tops.as_mut_ptr().add((b * args.tiles + tile) as usize) = top };
        }
        group += HANDOFF_EPILOGUE_WARPS;
    }
}

/// Batch columns an epilogue warp scores at a time: lane `l` scores column `l / 8` of the
/// warp's current group ([`COLUMN_LANES`] lanes per column).
const GROUP_COLUMNS: u32 = 32 / COLUMN_LANES;
/// The ballot bits of one column's lanes, shifted down.
const COLUMN_MASK: u32 = (1 << COLUMN_LANES) - 1;
/// Columns one epilogue warp scores per item, at most: one per lane when it scores their
/// deferred winners.
const fn warp_columns(columns: u32) -> u32 {
    (columns / GROUP_COLUMNS).div_ceil(HANDOFF_EPILOGUE_WARPS) * GROUP_COLUMNS
}
const _: () = assert!(warp_columns(HANDOFF_COLUMNS[0]) <= 32 && warp_columns(HANDOFF_COLUMNS[1]) <= 32);

/// The index a column's slot holds when its candidate is already written.
const RESOLVED: u32 = u32::MAX;

/// Epilogue warp `warp` (of [`HANDOFF_EPILOGUE_WARPS`]): for every item of the block, once its
/// logits are in the buffer, scores the groups of [`GROUP_COLUMNS`] columns `warp`,
/// `warp + 7`, … for every draw and writes one candidate per (column, draw) for the item's
/// tile.
///
/// Usually the estimates leave a column a single contender, which then wins: the lane holding
/// it parks it in the column's padding ([`Deferred`]), and once the warp has raced all its
/// columns, one lane per column gives the parked winners their exact scores together, instead
/// of running the exact transform on one or two lanes per group. Columns with several
/// contenders (or none) are resolved at once.
///
/// # Safety
/// As [`tma_handoff_kernel`]; all 32 lanes of each epilogue warp call it.
#[inline(always)]
unsafe fn score<const N: usize>(args: &TmaArgs, layout: &HandoffLayout, warp: u32, lane: u32) {
    let row_params = args.row_params.as_ptr();
    let slot = lane % COLUMN_LANES;
    let part = lane / COLUMN_LANES;
    let parked = |column: u32| {
        layout.logits.wrapping_add((column * HANDOFF_COLUMN_STRIDE + HANDOFF_ROWS) as usize).cast::<Deferred>()
    };
    let mut handoffs = 0u32;
    // A u32 phase count, as the barrier parity wants it (`enumerate` would count in usize).
    #[allow(clippy::explicit_counter_loop)]
    for (_, tile, col0) in Items::new(args, N as u32, 0, 1) {
        // This lane's quad `i` is the Philox block `first_block + 8i` (4 rows per block) of the
        // global vocabulary.
        let first_philox_block = (args.vocab_offset + tile * HANDOFF_ROWS) / 4 + slot;
        let vocab_end = args.vocab_offset + args.vocab;
        // SAFETY: `logits_full` is initialised; the whole warp waits on the same phase.
        unsafe { hopper::barrier_wait(layout.logits_full, handoffs & 1) };
        if args.processing.address() != 0 || args.tile_sums.address() != 0 {
            // SAFETY: as the draw loop below: the lanes process in place the quads of the columns
            // they race and sum their columns, once per item.
            unsafe { prepare_columns::<N>(args, layout, warp, lane, tile, col0) };
        }
        if args.tile_tops.address() != 0 {
            // SAFETY: as above; the lists are written once per item.
            unsafe { list_columns::<N>(args, layout, warp, lane, tile, col0) };
        }
        for j in 0..args.samples {
            let draw = args.draw_offset + j;
            let mut group = warp;
            while group * GROUP_COLUMNS < N as u32 && col0 + group * GROUP_COLUMNS < args.batch {
                let first_column = col0 + group * GROUP_COLUMNS;
                let column = group * GROUP_COLUMNS + part;
                let b = col0 + column;
                // Lanes of a column past the batch still take part in the shuffles, as greedy
                // rows (no noise), and write nothing.
                let in_batch = |p: u32| first_column + p < args.batch;
                // SAFETY: b < batch rows exist.
                let row = if b < args.batch { unsafe { *row_params.add(b as usize) } } else { PAD_ROW };
                let mut logits = [[0.0f32; 4]; LANE_QUADS];
                each_index!(i < LANE_QUADS, {
                    let quad = slot + COLUMN_LANES * i as u32;
                    let at = layout.logits.wrapping_add((column * HANDOFF_COLUMN_STRIDE + 4 * quad) as usize);
                    // SAFETY: column < N and quad < HANDOFF_ROWS / 4 lie in the buffer, 16-byte
                    // aligned (the stride is a multiple of 4 floats).
                    logits[i] = unsafe { (*at.cast::<Quad>()).0 };
                });
                // SAFETY: all 32 lanes together (the group loop is uniform over the warp), and the
                // 8 lanes `l ^ m` (`m < 8`) hold one column.
                let race = unsafe { estimate_column(&row, draw, first_philox_block, &logits, vocab_end) };
                // SAFETY: all 32 lanes together.
                let holders = unsafe { arch::ballot(race.contenders != 0) };
                // SAFETY: all 32 lanes together.
                let crowded = unsafe { arch::ballot(race.contenders & race.contenders.wrapping_sub(1) != 0) };
                let lanes_of = |bits: u32, p: u32| (bits >> (COLUMN_LANES * p)) & COLUMN_MASK;
                // A column is decided by one entry when one lane holds exactly one contender.
                let sole = |p: u32| lanes_of(holders, p).count_ones() == 1 && lanes_of(crowded, p) == 0;
                let resolve = |p: u32| !sole(p) && in_batch(p);
                let mut any_resolve = false;
                for p in 0..GROUP_COLUMNS {
                    any_resolve |= resolve(p);
                }
                if sole(part) && race.contenders != 0 && b < args.batch {
                    // SAFETY: the column's padding, read by this warp only, after `sync_warp`.
                    unsafe { *parked(column) = race.first_contender(first_philox_block, &logits) };
                }
                if any_resolve {
                    let own = resolve(part);
                    let winner =
                        if own { race.exact_winner(&row, first_philox_block, &logits) } else { Candidate::NONE };
                    // SAFETY: all 32 lanes together: `any_resolve` comes from ballots and the
                    // warp's columns, so it is warp-uniform.
                    let best = unsafe { sample::merge_over_lanes(winner, 1, COLUMN_LANES / 2) };
                    if slot == 0 && own {
                        // SAFETY: `b < batch` (`own` holds only for columns in the batch), `j <
                        // samples`, `tile < tiles`.
                        unsafe { write_candidate(args, tile, b, j, best) };
                        let resolved = Deferred { word: 0, logit: 0.0, index: RESOLVED, unused: 0 };
                        // SAFETY: as above.
                        unsafe { *parked(column) = resolved };
                    }
                }
                group += HANDOFF_EPILOGUE_WARPS;
            }
            // SAFETY: all 32 lanes of the warp reach it.
            unsafe { arch::sync_warp() };
            // Lane `l` scores the parked winner of the warp's column `l`: group `warp + 7(l / 2)`.
            let column =
                (warp + HANDOFF_EPILOGUE_WARPS * (lane / GROUP_COLUMNS)) * GROUP_COLUMNS + lane % GROUP_COLUMNS;
            let b = col0 + column;
            if column < N as u32 && b < args.batch {
                // SAFETY: written for every column of the batch above, before `sync_warp`.
                let deferred = unsafe { *parked(column) };
                if deferred.index != RESOLVED {
                    // SAFETY: b < batch rows exist.
                    let row = unsafe { *row_params.add(b as usize) };
                    let (score, word) = exact_entry(&row, deferred.word, deferred.logit);
                    let candidate = Candidate::scored(score, word, deferred.index);
                    // SAFETY: `b < batch`, `j < samples`, `tile < tiles`.
                    unsafe { write_candidate(args, tile, b, j, candidate) };
                }
            }
            // SAFETY: all 32 lanes of the warp reach it.
            unsafe { arch::sync_warp() };
        }
        // SAFETY: `logits_empty` is initialised; every epilogue thread arrives once per item.
        unsafe { hopper::barrier_arrive(layout.logits_empty) };
        handoffs += 1;
    }
}
