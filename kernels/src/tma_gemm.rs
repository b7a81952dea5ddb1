//! The Hopper tile: TMA loads `W` and `H` into a ring of shared-memory stages, two warpgroups
//! multiply them with `wgmma`, and the same sampling (or logits-writing) epilogue as the
//! register-direct tile finishes each work item.
//!
//! A block has [`TMA_CONSUMER_WARPS`] consumer warps (two warpgroups) and a producer
//! warpgroup, one thread of which issues the loads; `setmaxnreg` moves the producer's
//! registers to the consumers, whose accumulators and sampling epilogue need them.
//! Work item = (`ROWS` vocabulary rows, `N` batch columns), visited in grid-stride order. The
//! producer streams every item's `⌈dim / 64⌉` stages in that order, each a `ROWS` × 64 box of
//! `W` and an `N` × 64 box of `H` in the 128-byte swizzled layout `wgmma` reads. A stage is
//! full when its TMA bytes land (`full` barrier, one arrival + bytes) and free again when all
//! the threads that read it are done (`empty` barrier, one arrival per thread). Two schedules:
//! - `ROWS = 64`, ping-pong: the block's items alternate between the two warpgroups, which
//!   take turns on the mainloop (`turn` barriers), so one multiplies while the other runs the
//!   epilogue of its previous item;
//! - `ROWS = 128`, cooperative: both warpgroups multiply every item (64 rows each), then both
//!   run the epilogue; each byte of `H` staged serves twice the rows of `W`.
//!
//! Architecture Invariant: no lane-dependent branch sits next to a `.sync.aligned` op
//! (`wgmma.*`, `setmaxnreg`): every consumer thread arrives on the barriers itself instead of
//! one lane per warp. LLVM does not know inline asm is convergent; given `if lane == 0
//! { arrive }` around `wgmma.wait_group` it duplicated the wait into both branches, so lane 0
//! and the other lanes ran different instances of an aligned op and the warp hung (seen on
//! the H200). `cargo xtask build-kernels` checks that each such op appears once per kernel.
//!
//! Architecture Invariant: the accumulator layout of `wgmma` m64nN (thread `4g + t` of warp
//! `w` holds rows `16w + g` and `16w + g + 8`, columns `8j + 2t` and `8j + 2t + 1`) is turned
//! into the four-consecutive-rows-per-thread layout of [`flashsample_core::block_candidate`]
//! by [`transpose_quad`], so noise stays keyed by vocabulary index, never by tile position.

use flashsample_core::abi::{
    TMA_CONSUMER_REGISTERS, TMA_CONSUMER_WARPS, TMA_K_BLOCK, TMA_PRODUCER_REGISTERS, TmaArgs, WARPGROUP_ROWS,
    tma_hidden_stage_bytes, tma_lm_head_stage_bytes, tma_stages,
};
use flashsample_core::{Candidate, RowParams, block_candidate};

use crate::element::WgmmaElement;
use crate::hopper;
use crate::{arch, sample};

/// Named barrier of team `k` (the warps sharing an item) is `FIRST_TEAM_BARRIER + k` (0 is
/// `__syncthreads`).
const FIRST_TEAM_BARRIER: u32 = 1;
/// Threads of a warpgroup.
const WARPGROUP_THREADS: u32 = 128;
/// Consumer warpgroups.
const CONSUMER_WARPGROUPS: u32 = TMA_CONSUMER_WARPS / 4;

/// Where the block's shared memory holds what (shared-window addresses, stages 1024-aligned).
struct Layout {
    stages: u32,
    lm_head: u32,
    lm_head_stage_bytes: u32,
    hidden: u32,
    hidden_stage_bytes: u32,
    full: u32,
    empty: u32,
    /// `turn + 8·w`: consumer warpgroup `w` may start its next mainloop.
    turn: u32,
    staging: *mut Candidate,
}

impl Layout {
    #[inline(always)]
    fn new(base: *mut u8, rows: u32, columns: u32) -> Layout {
        let shared = hopper::shared_address(base);
        let pad = shared.next_multiple_of(1024) - shared;
        let stages = tma_stages(rows, columns);
        let lm_head_stage_bytes = tma_lm_head_stage_bytes(rows);
        let hidden_stage_bytes = tma_hidden_stage_bytes(columns);
        let lm_head = shared + pad;
        let hidden = lm_head + stages * lm_head_stage_bytes;
        let full = hidden + stages * hidden_stage_bytes;
        let empty = full + stages * 8;
        let turn = empty + stages * 8;
        let staging = base.wrapping_add((turn + CONSUMER_WARPGROUPS * 8 - shared) as usize).cast::<Candidate>();
        Layout { stages, lm_head, lm_head_stage_bytes, hidden, hidden_stage_bytes, full, empty, turn, staging }
    }
}

/// How the consumer warps share the work items of height `rows`.
#[derive(Clone, Copy)]
struct Teams {
    /// Warps that multiply one item together (4 or 8).
    warps: u32,
    /// Teams in the block (2 or 1); the block's items alternate between them.
    count: u32,
}

impl Teams {
    #[inline(always)]
    fn new(rows: u32) -> Teams {
        let warps = 4 * (rows / WARPGROUP_ROWS);
        Teams { warps, count: TMA_CONSUMER_WARPS / warps }
    }
}

/// Both kinds of TMA kernel: `FUSED` samples (candidates out), otherwise f32 logits out.
/// Items of `ROWS` (64 or 128) × `N` batch columns, `R = N / 2` accumulators per consumer
/// thread.
///
/// # Safety
/// Launched with `TMA_THREADS` threads and `tma_shared_bytes(ROWS, N)` bytes of dynamic
/// shared memory at `shared`; `args` holds tensor maps of `W` and `H` with boxes of
/// 64 × `ROWS` and 64 × `N` elements and 128-byte swizzle, and valid output buffers.
#[inline(always)]
pub unsafe fn tma_kernel<T: WgmmaElement, const ROWS: u32, const N: usize, const R: usize, const FUSED: bool>(
    args: &TmaArgs,
    shared: *mut u8,
) {
    let thread = arch::thread_index();
    let warp = thread / 32;
    let layout = Layout::new(shared, ROWS, N as u32);
    let teams = Teams::new(ROWS);
    if thread == 0 {
        for s in 0..layout.stages {
            unsafe {
                hopper::barrier_init(layout.full + 8 * s, 1);
                hopper::barrier_init(layout.empty + 8 * s, 32 * teams.warps);
            }
        }
        for w in 0..CONSUMER_WARPGROUPS {
            unsafe { hopper::barrier_init(layout.turn + 8 * w, WARPGROUP_THREADS) };
        }
        unsafe { hopper::fence_barrier_init() };
    }
    unsafe { arch::sync_threads() };
    if warp >= TMA_CONSUMER_WARPS {
        unsafe { hopper::release_registers::<TMA_PRODUCER_REGISTERS>() };
        if thread == TMA_CONSUMER_WARPS * 32 {
            unsafe { produce(args, &layout, ROWS, N as u32) };
        }
    } else {
        unsafe { hopper::claim_registers::<TMA_CONSUMER_REGISTERS>() };
        unsafe { consume::<T, N, R, FUSED>(args, &layout, ROWS, teams) };
    }
}

/// The work items of this block in grid-stride order, with their position in the block's
/// sequence: the producer takes every one, consumer team `k` of `n` those at positions `k`,
/// `k + n`, ….
struct Items {
    position: u32,
    step: u32,
    count: u32,
    column_tiles: u32,
    columns: u32,
}

impl Items {
    #[inline(always)]
    fn new(args: &TmaArgs, columns: u32, first: u32, step: u32) -> Items {
        let column_tiles = args.batch.div_ceil(columns);
        Items { position: first, step, count: args.tiles * column_tiles, column_tiles, columns }
    }
}

impl Iterator for Items {
    /// `(position, tile, col0)`: batch tiles vary fastest, so blocks reading the same `W` rows
    /// run together.
    type Item = (u32, u32, u32);

    #[inline(always)]
    fn next(&mut self) -> Option<(u32, u32, u32)> {
        let item = arch::block_index() + self.position * arch::grid_size();
        if item >= self.count {
            return None;
        }
        let position = self.position;
        self.position += self.step;
        Some((position, item / self.column_tiles, (item % self.column_tiles) * self.columns))
    }
}

/// The producer (one thread): fills stages in ring order as the consumers free them.
///
/// # Safety
/// As [`tma_kernel`]; called by one thread of the producer warp.
#[inline(always)]
unsafe fn produce(args: &TmaArgs, layout: &Layout, rows: u32, columns: u32) {
    let k_blocks = args.dim.div_ceil(TMA_K_BLOCK);
    let stage_bytes = layout.lm_head_stage_bytes + layout.hidden_stage_bytes;
    unsafe {
        hopper::fence_tensor_map(args.lm_head_map);
        hopper::fence_tensor_map(args.hidden_map);
    }
    let mut iteration = 0u32;
    for (_, tile, col0) in Items::new(args, columns, 0, 1) {
        for k_block in 0..k_blocks {
            let stage = iteration % layout.stages;
            let phase = (iteration / layout.stages) & 1;
            let full = layout.full + 8 * stage;
            let k = (k_block * TMA_K_BLOCK) as i32;
            unsafe {
                // A fresh barrier counts its (never run) previous phase as complete, so the
                // first lap through the ring does not wait.
                hopper::barrier_wait(layout.empty + 8 * stage, phase ^ 1);
                hopper::barrier_arrive_expect_bytes(full, stage_bytes);
                let w = layout.lm_head + stage * layout.lm_head_stage_bytes;
                hopper::tma_load_2d(w, args.lm_head_map, k, (tile * rows) as i32, full);
                let h = layout.hidden + stage * layout.hidden_stage_bytes;
                hopper::tma_load_2d(h, args.hidden_map, k, (args.hidden_row0 + col0) as i32, full);
            }
            iteration += 1;
        }
    }
}

/// A consumer warpgroup: multiply each of its team's items' stages (its 64 rows of them),
/// then run the epilogue with its team.
///
/// # Safety
/// As [`tma_kernel`]; called by all consumer threads.
#[inline(always)]
unsafe fn consume<T: WgmmaElement, const N: usize, const R: usize, const FUSED: bool>(
    args: &TmaArgs,
    layout: &Layout,
    rows: u32,
    teams: Teams,
) {
    let thread = arch::thread_index();
    let warpgroup = thread / WARPGROUP_THREADS;
    let team = (thread / 32) / teams.warps;
    let team_thread = thread % (32 * teams.warps);
    // This warpgroup's 64 rows within the item's `W` box.
    let rows_offset = (warpgroup % (rows / WARPGROUP_ROWS)) * WARPGROUP_ROWS;
    let w_offset = rows_offset * 2 * TMA_K_BLOCK;
    let k_blocks = args.dim.div_ceil(TMA_K_BLOCK);
    let staging = layout.staging.wrapping_add((team * teams.warps * N as u32) as usize);
    let mut acc = [0.0f32; R];
    let mut turns = 0u32;
    for (position, tile, col0) in Items::new(args, N as u32, team, teams.count) {
        // With two teams the mainloops take turns in item order: a team starts only once the
        // other has issued all of the previous item's multiplies. Besides keeping one team on
        // the tensor cores at a time, this keeps every stage wait within one lap of the ring
        // (a parity wait cannot tell laps further apart). Team 0's first turn is free: a fresh
        // barrier counts its (never run) previous phase as complete.
        if teams.count > 1 {
            let parity = (turns & 1) ^ (team == 0) as u32;
            unsafe { hopper::barrier_wait(layout.turn + 8 * team, parity) };
            turns += 1;
        }
        // The producer fills stages in the block's item order, k-blocks within an item.
        let first = position * k_blocks;
        for k_block in 0..k_blocks {
            let iteration = first + k_block;
            let stage = iteration % layout.stages;
            let phase = (iteration / layout.stages) & 1;
            let w = layout.lm_head + stage * layout.lm_head_stage_bytes + w_offset;
            let h = layout.hidden + stage * layout.hidden_stage_bytes;
            unsafe {
                hopper::barrier_wait(layout.full + 8 * stage, phase);
                hopper::wgmma_fence();
                for step in 0..TMA_K_BLOCK / 16 {
                    // 16 elements of K are 32 bytes along the swizzled row.
                    let a = hopper::swizzled_descriptor(w + 32 * step);
                    let b = hopper::swizzled_descriptor(h + 32 * step);
                    T::wgmma::<R>(&mut acc, a, b, (k_block > 0 || step > 0) as u32);
                }
                hopper::wgmma_commit();
                // The previous stage's group is done once at most this one is pending.
                hopper::wgmma_wait::<1>();
                if k_block > 0 {
                    hopper::barrier_arrive(layout.empty + 8 * ((iteration - 1) % layout.stages));
                }
            }
        }
        unsafe {
            if teams.count > 1 {
                hopper::barrier_arrive(layout.turn + 8 * (teams.count - 1 - team));
            }
            hopper::wgmma_wait::<0>();
            hopper::barrier_arrive(layout.empty + 8 * ((first + k_blocks - 1) % layout.stages));
        }
        let place = Placement::new(team_thread, tile * rows + rows_offset, tile, col0);
        if FUSED {
            let team_barrier = (FIRST_TEAM_BARRIER + team, 32 * teams.warps);
            unsafe { sample_epilogue::<N, R>(&acc, args, &place, staging, team_barrier) };
        } else {
            unsafe { logits_epilogue::<N, R>(&acc, args, &place) };
        }
    }
}

/// Where a consumer thread's transposed quads lie in the tile.
struct Placement {
    /// Thread index within the team.
    thread: u32,
    /// Warp index within the team.
    warp: u32,
    lane: u32,
    tile: u32,
    col0: u32,
    /// First of the four vocabulary rows of this thread's quads.
    row0: u32,
    /// Column of this thread's quad in n8-tile 0 (add `8·j` for tile `j`).
    column: u32,
}

impl Placement {
    #[inline(always)]
    /// `thread` within the team; `first_row` = the first of this warpgroup's 64 rows.
    fn new(thread: u32, first_row: u32, tile: u32, col0: u32) -> Placement {
        let warp = thread / 32;
        let lane = thread % 32;
        let quad = (lane / 4) % 4;
        let row0 = first_row + (warp % 4) * 16 + 4 * (lane / 16) + 8 * (quad / 2);
        Placement { thread, warp, lane, tile, col0, row0, column: 2 * (lane % 4) + quad % 2 }
    }
}

/// The four accumulators of n8-tile `j` (a run-time index), through a chain of selects so
/// `acc` stays in registers.
#[inline(always)]
fn pick_quad<const R: usize>(acc: &[f32; R], j: usize) -> [f32; 4] {
    let mut quad = [acc[0], acc[1], acc[2], acc[3]];
    for k in 1..R / 4 {
        if j == k {
            quad = [acc[4 * k], acc[4 * k + 1], acc[4 * k + 2], acc[4 * k + 3]];
        }
    }
    quad
}

/// Calls `$body(j, quad)` for every n8-tile `j < R / 4` of the accumulators `$acc: [f32; R]`
/// with its four values: constant indices only, so `acc` stays in registers.
macro_rules! for_each_quad {
    ($acc:expr, $body:expr) => {
        for_each_quad!(@tiles $acc, $body, [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20,
            21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31])
    };
    (@tiles $acc:expr, $body:expr, [$($j:literal),*]) => {{
        let acc = $acc;
        $(
            if 4 * $j + 3 < acc.len() {
                $body($j, [acc[4 * $j], acc[4 * $j + 1], acc[4 * $j + 2], acc[4 * $j + 3]]);
            }
        )*
    }};
}

/// Exchanges `v[k]` and `v[k | bit]` with lane `lane ^ mask`, where `mask` is the lane bit
/// that plays the role of `bit`: one step of a 4 × 4 transpose over four lanes.
#[inline(always)]
unsafe fn transpose_step(v: &mut [f32; 4], lane: u32, mask: u32, bit: usize) {
    let upper = lane & mask != 0;
    for k in 0..4 {
        if k & bit == 0 {
            let send = if upper { v[k] } else { v[k | bit] };
            let received = f32::from_bits(unsafe { arch::shuffle_xor(send.to_bits(), mask) });
            if upper {
                v[k] = received;
            } else {
                v[k | bit] = received;
            }
        }
    }
}

/// Transposes the `wgmma` quads of the four lanes `16a + 4q + t` (`q = 0..4`): lane `q` holds
/// `[(row q, c), (row q, c+1), (row q+8, c), (row q+8, c+1)]` and ends with item `q` of that
/// list for rows `0..4` (rows relative to `4a`), i.e. four consecutive rows of one column.
///
/// # Safety
/// All 32 lanes call it together.
#[inline(always)]
unsafe fn transpose_quad(quad: [f32; 4], lane: u32) -> [f32; 4] {
    let mut v = quad;
    unsafe {
        transpose_step(&mut v, lane, 4, 1);
        transpose_step(&mut v, lane, 8, 2);
    }
    v
}

/// Per draw: each thread scores its quads, lanes of one column merge, the team's warps merge
/// through `staging`, and one candidate per (column, draw) is written for this tile.
///
/// # Safety
/// All threads of one team call it together; `staging` holds `warps · N` candidates of this
/// team; `barrier` is the team's named barrier and its thread count.
#[inline(always)]
unsafe fn sample_epilogue<const N: usize, const R: usize>(
    acc: &[f32; R],
    args: &TmaArgs,
    place: &Placement,
    staging: *mut Candidate,
    barrier: (u32, u32),
) {
    let (barrier, threads) = barrier;
    let rows_valid = args.vocab.saturating_sub(place.row0).min(4);
    let block = place.row0 / 4;
    for j in 0..args.samples {
        // A run-time loop over the n8-tiles keeps one copy of the Philox and log code; the
        // epilogue of the GEMM, with no such code, unrolls instead.
        let mut tile_column = 0;
        while tile_column < N / 8 {
            let logits = unsafe { transpose_quad(pick_quad(acc, tile_column), place.lane) };
            let column = 8 * tile_column as u32 + place.column;
            let mut best = Candidate::NONE;
            // Columns past the batch draw no noise; their lanes still join the shuffles.
            if place.col0 + column < args.batch {
                let row = unsafe { *(args.rows as *const RowParams).add((place.col0 + column) as usize) };
                best = block_candidate(&row, args.sample_offset + j, block, logits, rows_valid);
            }
            best = unsafe { sample::merge_over_lanes(best, 8, 16) };
            if place.lane < 8 {
                unsafe { *staging.add((place.warp * N as u32 + column) as usize) = best };
            }
            tile_column += 1;
        }
        unsafe { arch::sync_named(barrier, threads) };
        let mut column = place.thread;
        while column < N as u32 {
            let b = place.col0 + column;
            if b < args.batch {
                let mut best = Candidate::NONE;
                for w in 0..threads / 32 {
                    best = best.merge(unsafe { *staging.add((w * N as u32 + column) as usize) });
                }
                let at = (b as u64 * args.samples as u64 + j as u64) * args.tiles as u64 + place.tile as u64;
                unsafe { *(args.out as *mut Candidate).add(at as usize) = best };
            }
            column += threads;
        }
        unsafe { arch::sync_named(barrier, threads) };
    }
}

/// The unfused GEMM's epilogue: each transposed quad is four consecutive logits of one
/// column, stored with one 16-byte write.
///
/// # Safety
/// All consumer threads call it together; `args.out` holds `batch × logits_stride` floats.
#[inline(always)]
unsafe fn logits_epilogue<const N: usize, const R: usize>(acc: &[f32; R], args: &TmaArgs, place: &Placement) {
    let store_quad = |tile_column: usize, quad: [f32; 4]| {
        let logits = unsafe { transpose_quad(quad, place.lane) };
        let b = place.col0 + 8 * tile_column as u32 + place.column;
        if b < args.batch && place.row0 < args.vocab {
            let address = args.out + (b as u64 * args.logits_stride as u64 + place.row0 as u64) * 4;
            unsafe { arch::store_global_v4(address, logits) };
        }
    };
    for_each_quad!(acc, store_quad);
}
