//! The Hopper tile: TMA loads `W` and `H` into a ring of shared-memory stages, two warpgroups
//! multiply them with `wgmma`, and a sampling (or logits-writing) epilogue finishes each work
//! item. The sampling epilogue reads the item's row parameters from shared memory (loaded
//! during the mainloop), estimates every score with [`flashsample_core::estimate`] in
//! straight-line code over 1, 2 or 4 quads at a time, and computes the exact noise only for
//! the contenders ([`race_round`]).
//!
//! A block has [`TMA_CONSUMER_WARPS`] consumer warps (two warpgroups) and a producer
//! warpgroup, one thread of which issues the loads. Every thread gets the 168 registers a
//! 384-thread block allows; the consumers' code fits in those. (`setmaxnreg` could move the
//! producer's registers to the consumers, but ptxas honours it only in a kernel that also
//! declares `.minnctapersm`; without it ptxas ignored it: docs/PERF.md, tried and dropped.)
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
//! (`wgmma.*`): every consumer thread arrives on the barriers itself instead of
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
    TMA_CONSUMER_WARPS, TMA_K_BLOCK, TmaArgs, WARPGROUP_ROWS, candidate_pair, candidate_slot, tma_hidden_stage_bytes,
    tma_lm_head_stage_bytes, tma_stages,
};
use flashsample_core::estimate::{BlockEstimate, block_estimate, contenders, exact_score, race_threshold};
use flashsample_core::{Candidate, RowParams};

use crate::hopper;
use crate::hopper::WgmmaElement;
use crate::{arch, sample};

/// Named barrier of team `k` (the warps sharing an item) is `FIRST_TEAM_BARRIER + k` (0 is
/// `__syncthreads`).
const FIRST_TEAM_BARRIER: u32 = 1;
/// Threads of a warpgroup.
pub(crate) const WARPGROUP_THREADS: u32 = 128;
/// Consumer warpgroups.
pub(crate) const CONSUMER_WARPGROUPS: u32 = TMA_CONSUMER_WARPS / 4;

/// Runs `$body` with `$k` = 0, 1, 2, 3 for those below `$count` (a constant), as straight-line
/// code: LLVM leaves a loop with a long body rolled, and a rolled loop over an array moves the
/// array to local memory and keeps the iterations from interleaving.
macro_rules! unrolled {
    ($k:ident < $count:expr, $body:block) => {{
        unrolled!(@one 0, $k, $count, $body);
        unrolled!(@one 1, $k, $count, $body);
        unrolled!(@one 2, $k, $count, $body);
        unrolled!(@one 3, $k, $count, $body);
    }};
    (@one $i:literal, $k:ident, $count:expr, $body:block) => {
        if $i < $count {
            let $k: usize = $i;
            $body
        }
    };
}
pub(crate) use unrolled;

/// The ring of pipeline stages in shared memory and its barriers: stage `s` holds a
/// `rows` × 64 box of `W` and a `columns` × 64 box of `H`; `full + 8·s` completes when its
/// TMA bytes land, `empty + 8·s` when every consumer thread is done reading it.
#[derive(Clone, Copy)]
pub(crate) struct Ring {
    stages: u32,
    lm_head: u32,
    lm_head_stage_bytes: u32,
    hidden: u32,
    hidden_stage_bytes: u32,
    full: u32,
    empty: u32,
}

impl Ring {
    /// `stages` stages from the 1024-aligned shared address `start`, the `W` boxes first,
    /// then the `H` boxes, then `barriers` (the barriers' own shared address).
    #[inline(always)]
    pub(crate) fn new(start: u32, stages: u32, rows: u32, columns: u32, barriers: u32) -> Ring {
        let lm_head_stage_bytes = tma_lm_head_stage_bytes(rows);
        let hidden = start + stages * lm_head_stage_bytes;
        let hidden_stage_bytes = tma_hidden_stage_bytes(columns);
        Ring {
            stages,
            lm_head: start,
            lm_head_stage_bytes,
            hidden,
            hidden_stage_bytes,
            full: barriers,
            empty: barriers + stages * 8,
        }
    }

    /// The first shared address after the stages' boxes.
    #[inline(always)]
    pub(crate) fn boxes_end(&self) -> u32 {
        self.hidden + self.stages * self.hidden_stage_bytes
    }

    /// The first shared address after the ring's barriers.
    #[inline(always)]
    pub(crate) fn barriers_end(&self) -> u32 {
        self.empty + self.stages * 8
    }

    /// Initialises the barriers: one arrival (plus bytes) fills a stage, `readers` free it.
    ///
    /// # Safety
    /// One thread calls it before the block barrier that publishes the barriers.
    #[inline(always)]
    pub(crate) unsafe fn init(&self, readers: u32) {
        for s in 0..self.stages {
            // SAFETY: per this function's contract one thread initialises the ring's barriers
            // before the block barrier publishes them.
            unsafe {
                hopper::barrier_init(self.full + 8 * s, 1);
                hopper::barrier_init(self.empty + 8 * s, readers);
            }
        }
    }

    /// The producer (one thread): fills stages in ring order as the consumers free them,
    /// every k-block of every item of the block in [`Items`] order.
    ///
    /// # Safety
    /// As [`tma_kernel`]; called by one thread, after the barriers are published.
    #[inline(always)]
    pub(crate) unsafe fn produce(&self, args: &TmaArgs, rows: u32, columns: u32) {
        let k_blocks = args.dim.div_ceil(TMA_K_BLOCK);
        let stage_bytes = self.lm_head_stage_bytes + self.hidden_stage_bytes;
        // SAFETY: per this function's contract both maps are 128-byte tensor maps in global memory.
        unsafe {
            hopper::fence_tensor_map(args.lm_head_map.address());
            hopper::fence_tensor_map(args.hidden_map.address());
        }
        let mut iteration = 0u32;
        for (_, tile, col0) in Items::new(args, columns, 0, 1) {
            for k_block in 0..k_blocks {
                let stage = iteration % self.stages;
                let phase = (iteration / self.stages) & 1;
                let full = self.full + 8 * stage;
                let k = (k_block * TMA_K_BLOCK) as i32;
                // SAFETY: the producer waits for the stage to be free before refilling it; the box
                // destinations lie in the stage (the layout sizes them from the registry's shared
                // memory), and `full` expects exactly these bytes.
                unsafe {
                    // A fresh barrier counts its (never run) previous phase as complete, so the
                    // first lap through the ring does not wait.
                    hopper::barrier_wait(self.empty + 8 * stage, phase ^ 1);
                    hopper::barrier_arrive_expect_bytes(full, stage_bytes);
                    let w = self.lm_head + stage * self.lm_head_stage_bytes;
                    hopper::tma_load_2d(w, args.lm_head_map.address(), k, (tile * rows) as i32, full);
                    let h = self.hidden + stage * self.hidden_stage_bytes;
                    hopper::tma_load_2d(h, args.hidden_map.address(), k, (args.hidden_row0 + col0) as i32, full);
                }
                iteration += 1;
            }
        }
    }

    /// A consumer warpgroup issues the multiplies of one item, whose first stage is ring
    /// iteration `first`, on its 64 rows (`w_offset` bytes into each `W` box), freeing each
    /// stage but the last once its group is done. The last group may still be running.
    ///
    /// Pass a `w_offset` that ptxas knows to be warp-uniform ([`arch::broadcast_lane0`]):
    /// the tokens do not depend on it, but otherwise every descriptor is built in vector
    /// registers and moved to uniform ones before each `wgmma` (19 more instructions per
    /// warp and stage; docs/PERF.md, "warp-uniform mainloop bookkeeping").
    ///
    /// # Safety
    /// All 128 threads of the warpgroup call it together; `acc` is not touched until
    /// [`Ring::finish`].
    #[inline(always)]
    pub(crate) unsafe fn multiply<T: WgmmaElement, const R: usize, const PENDING: u32>(
        &self,
        first: u32,
        k_blocks: u32,
        w_offset: u32,
        acc: &mut [f32; R],
    ) {
        // Stage and phase advance with the loop, and the descriptors are the stage-0 ones
        // plus the stage's offset: all warp-uniform 32-bit arithmetic (ptxas keeps it in
        // uniform registers when `w_offset` is known to be warp-uniform).
        let lm_head = hopper::SwizzledDescriptor::at(self.lm_head + w_offset);
        let hidden = hopper::SwizzledDescriptor::at(self.hidden);
        let mut stage = first % self.stages;
        let mut phase = (first / self.stages) & 1;
        let mut previous = stage;
        for k_block in 0..k_blocks {
            let a = lm_head.advanced(stage * self.lm_head_stage_bytes);
            let b = hidden.advanced(stage * self.hidden_stage_bytes);
            // SAFETY: per this function's contract the whole warpgroup is here; the stage is full
            // (waited on) and its descriptors address its boxes.
            unsafe {
                hopper::barrier_wait(self.full + 8 * stage, phase);
                hopper::wgmma_fence();
                for step in 0..TMA_K_BLOCK / 16 {
                    // 16 elements of K are 32 bytes along the swizzled row.
                    let (a, b) = (a.advanced(32 * step), b.advanced(32 * step));
                    T::wgmma::<R>(acc, a.bits(), b.bits(), (k_block > 0 || step > 0) as u32);
                }
                hopper::wgmma_commit();
                // The previous stage's group is done once at most this one is pending.
                hopper::wgmma_wait::<PENDING>();
                if PENDING == 0 {
                    hopper::barrier_arrive(self.empty + 8 * stage);
                } else if k_block > 0 {
                    hopper::barrier_arrive(self.empty + 8 * previous);
                }
            }
            previous = stage;
            stage += 1;
            if stage == self.stages {
                stage = 0;
                phase ^= 1;
            }
        }
    }

    /// Waits for the item's last group (its accumulators are final) and frees its stage.
    ///
    /// # Safety
    /// As [`Ring::multiply`], right after it (or after work that does not touch `acc`).
    #[inline(always)]
    pub(crate) unsafe fn finish(&self, first: u32, k_blocks: u32) {
        // SAFETY: per this function's contract the whole warpgroup is here, right after its
        // multiplies.
        unsafe {
            hopper::wgmma_wait::<0>();
            hopper::barrier_arrive(self.empty + 8 * ((first + k_blocks - 1) % self.stages));
        }
    }
}

/// Where the block's shared memory holds what (shared-window addresses, stages 1024-aligned).
struct Layout {
    ring: Ring,
    /// `turn + 8·w`: consumer warpgroup `w` may start its next mainloop.
    turn: u32,
    staging: *mut Candidate,
    /// Row parameters of each team's current item: `N` per team.
    rows: *mut RowParams,
}

impl Layout {
    #[inline(always)]
    fn new(base: *mut u8, rows: u32, columns: u32) -> Layout {
        let shared = hopper::shared_address(base);
        let start = shared.next_multiple_of(1024);
        let stages = tma_stages(rows, columns);
        let boxes = Ring::new(start, stages, rows, columns, 0).boxes_end();
        let ring = Ring::new(start, stages, rows, columns, boxes);
        let turn = ring.barriers_end();
        let staging = base.wrapping_add((turn + CONSUMER_WARPGROUPS * 8 - shared) as usize).cast::<Candidate>();
        let rows = staging.wrapping_add((TMA_CONSUMER_WARPS * columns) as usize).cast::<RowParams>();
        Layout { ring, turn, staging, rows }
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
        // SAFETY: thread 0 alone, before the block barrier below.
        unsafe { layout.ring.init(32 * teams.warps) };
        for w in 0..CONSUMER_WARPGROUPS {
            // SAFETY: thread 0 alone: the turn barriers lie in the layout's shared memory, unused
            // until the block barrier.
            unsafe { hopper::barrier_init(layout.turn + 8 * w, WARPGROUP_THREADS) };
        }
        // SAFETY: thread 0 alone, after initialising every barrier, before the block barrier.
        unsafe { hopper::fence_barrier_init() };
    }
    // SAFETY: every thread of the block reaches it.
    unsafe { arch::sync_threads() };
    if warp >= TMA_CONSUMER_WARPS {
        if thread == TMA_CONSUMER_WARPS * 32 {
            // SAFETY: one thread (the producer), after the barriers are published; `args` holds the
            // maps this kernel's contract requires.
            unsafe { layout.ring.produce(args, ROWS, N as u32) };
        }
    } else {
        // SAFETY: every consumer thread calls it, after the barriers are published.
        unsafe { consume::<T, N, R, FUSED>(args, &layout, ROWS, teams) };
    }
}

/// The work items of this block in grid-stride order, with their position in the block's
/// sequence: the producer takes every one, consumer team `k` of `n` those at positions `k`,
/// `k + n`, ….
pub(crate) struct Items {
    position: u32,
    step: u32,
    count: u32,
    column_tiles: u32,
    columns: u32,
}

impl Items {
    #[inline(always)]
    pub(crate) fn new(args: &TmaArgs, columns: u32, first: u32, step: u32) -> Items {
        // At least one, so the divisions below need no zero check (the host never launches
        // an empty batch).
        let column_tiles = args.batch.div_ceil(columns).max(1);
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
    // SAFETY: every consumer thread calls `consume`, so whole warps reach the shuffle.
    let w_offset = unsafe { arch::broadcast_lane0(rows_offset * 2 * TMA_K_BLOCK) };
    let k_blocks = args.dim.div_ceil(TMA_K_BLOCK);
    let staging = layout.staging.wrapping_add((team * teams.warps * N as u32) as usize);
    let team_rows = layout.rows.wrapping_add((team * N as u32) as usize);
    let mut acc = [0.0f32; R];
    let mut turns = 0u32;
    for (position, tile, col0) in Items::new(args, N as u32, team, teams.count) {
        // The item's row parameters (one column per thread, N ≤ team threads) are loaded
        // now and stored to shared memory after the mainloop, so the load's latency hides
        // under it and the epilogue reads them from shared memory.
        let b = col0 + team_thread;
        let staged_row = if FUSED && team_thread < N as u32 && b < args.batch {
            // SAFETY: `b < batch`: a row of the `[batch]` row parameters, 8-byte aligned.
            unsafe { load_row_words(args.rows.cast::<u64>().as_ptr(), b) }
        } else {
            PAD_ROW_WORDS
        };
        // With two teams the mainloops take turns in item order: a team starts only once the
        // other has issued all of the previous item's multiplies. Besides keeping one team on
        // the tensor cores at a time, this keeps every stage wait within one lap of the ring
        // (a parity wait cannot tell laps further apart). Team 0's first turn is free: a fresh
        // barrier counts its (never run) previous phase as complete.
        if teams.count > 1 {
            let parity = (turns & 1) ^ (team == 0) as u32;
            // SAFETY: the turn barriers are initialised; the whole team waits on the same phase.
            unsafe { hopper::barrier_wait(layout.turn + 8 * team, parity) };
            turns += 1;
        }
        // The producer fills stages in the block's item order, k-blocks within an item.
        let first = position * k_blocks;
        // SAFETY: the whole warpgroup multiplies each item together (the items loop is uniform over
        // the team).
        unsafe {
            layout.ring.multiply::<T, R, 1>(first, k_blocks, w_offset, &mut acc);
            if teams.count > 1 {
                hopper::barrier_arrive(layout.turn + 8 * (teams.count - 1 - team));
            }
            layout.ring.finish(first, k_blocks);
        }
        let place = Placement::new(team_thread, tile * rows + rows_offset, tile, col0);
        if FUSED {
            // The team's previous epilogue ended at a team barrier: no thread still reads
            // the previous item's rows.
            if team_thread < N as u32 {
                let words = team_rows.cast::<u64>().wrapping_add(ROW_WORDS * team_thread as usize);
                for (w, &word) in staged_row.iter().enumerate() {
                    // SAFETY: `team_thread < N`: inside the team's `N` row slots of the layout.
                    unsafe { *words.add(w) = word };
                }
            }
            let team_barrier = (FIRST_TEAM_BARRIER + team, 32 * teams.warps);
            let epilogue = match N / 8 {
                1 => sample_epilogue::<N, R, 1>,
                2 => sample_epilogue::<N, R, 2>,
                _ => sample_epilogue::<N, R, 4>,
            };
            // SAFETY: every thread of the team calls the epilogue; its row parameters were stored
            // above, `staging` is the team's.
            unsafe { epilogue(&acc, args, &place, team_rows, staging, team_barrier) };
        } else {
            // SAFETY: every consumer thread calls the epilogue together; `args.out` holds the
            // logits.
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

/// The four accumulators of n8-tile `round · K + k` (`round` a run-time index), through a
/// chain of selects over the rounds so `acc` stays in registers.
#[inline(always)]
fn pick_quad<const R: usize, const K: usize>(acc: &[f32; R], round: usize, k: usize) -> [f32; 4] {
    let mut quad = [acc[4 * k], acc[4 * k + 1], acc[4 * k + 2], acc[4 * k + 3]];
    for other in 1..R / 4 / K {
        if round == other {
            let j = 4 * (other * K + k);
            quad = [acc[j], acc[j + 1], acc[j + 2], acc[j + 3]];
        }
    }
    quad
}

/// Stands in for the row parameters of columns past the batch: greedy, so it draws no noise.
pub(crate) const PAD_ROW: RowParams = RowParams { seed: 0, stream: 0, step: 0, inv_temperature: 0.0, greedy: 1 };

/// A [`RowParams`] as 8-byte words: copied word by word, it stays in registers (a struct copy
/// across the mainloop went through local memory).
const ROW_WORDS: usize = core::mem::size_of::<RowParams>() / 8;

/// [`PAD_ROW`] as words: seed; stream and step; `inv_temperature` = 0.0 and `greedy` = 1.
const PAD_ROW_WORDS: [u64; ROW_WORDS] = [0, 0, 1 << 32];

/// The words of row `b` of the `[batch]` array of [`RowParams`] at `rows`.
///
/// # Safety
/// `rows` holds at least `b + 1` row parameters.
#[inline(always)]
unsafe fn load_row_words(rows: *const u64, b: u32) -> [u64; ROW_WORDS] {
    let at = ROW_WORDS * b as usize;
    // SAFETY: per this function's contract `rows` holds row `b`'s three words.
    unsafe { [*rows.add(at), *rows.add(at + 1), *rows.add(at + 2)] }
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
pub(crate) use for_each_quad;

/// Exchanges `v[k]` and `v[k | bit]` with lane `lane ^ mask`, where `mask` is the lane bit
/// that plays the role of `bit`: one step of a 4 × 4 transpose over four lanes.
///
/// # Safety
/// All 32 lanes of the warp call it together.
#[inline(always)]
unsafe fn transpose_step(v: &mut [f32; 4], lane: u32, mask: u32, bit: usize) {
    let upper = lane & mask != 0;
    for k in 0..4 {
        if k & bit == 0 {
            let send = if upper { v[k] } else { v[k | bit] };
            // SAFETY: per this function's contract all 32 lanes are here together.
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
    // SAFETY: per this function's contract all 32 lanes are here together.
    unsafe {
        transpose_step(&mut v, lane, 4, 1);
        transpose_step(&mut v, lane, 8, 2);
    }
    v
}

/// Per draw: each thread scores its quads `K` at a time ([`race_round`]), lanes of one column
/// merge, the team's warps merge through `staging`, and one candidate per (column, draw) is
/// written for this tile.
///
/// # Safety
/// All threads of one team call it together; `rows` holds the `N` row parameters of the item
/// (written by the team before the call), `staging` `warps · N` candidates of this team;
/// `barrier` is the team's named barrier and its thread count.
#[inline(always)]
unsafe fn sample_epilogue<const N: usize, const R: usize, const K: usize>(
    acc: &[f32; R],
    args: &TmaArgs,
    place: &Placement,
    rows: *const RowParams,
    staging: *mut Candidate,
    barrier: (u32, u32),
) {
    let (barrier, threads) = barrier;
    // SAFETY: the team's named barrier, reached by all of its threads (this function's contract).
    unsafe { arch::sync_named(barrier, threads) };
    let rows_valid = args.vocab.saturating_sub(place.row0).min(4);
    let block = place.row0 / 4;
    for j in 0..args.samples {
        // A run-time loop over rounds keeps one copy of the Philox and log code.
        let mut round = 0;
        while round < N / 8 / K {
            let mut logits = [[0.0f32; 4]; K];
            let mut row = [PAD_ROW; K];
            let mut column = [0u32; K];
            let mut in_batch = [false; K];
            unrolled!(k < K, {
                // SAFETY: all 32 lanes run the rounds together (uniform loop bounds).
                logits[k] = unsafe { transpose_quad(pick_quad::<R, K>(acc, round, k), place.lane) };
                column[k] = 8 * (round * K + k) as u32 + place.column;
                // SAFETY: `column < N`: one of the team's `N` row slots, stored before the team
                // barrier above.
                row[k] = unsafe { *rows.add(column[k] as usize) };
                in_batch[k] = place.col0 + column[k] < args.batch;
            });
            let winners =
                // SAFETY: all 32 lanes together, and lanes `l ^ 8`, `l ^ 16`, `l ^ 24` hold the
                // same columns (`transpose_quad`'s layout).
                unsafe { race_round::<K>(&row, args.sample_offset + j, block, &logits, rows_valid, in_batch) };
            unrolled!(k < K, {
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

/// `values[r]` through selects with constant indices (an indexed load would move the array to
/// local memory).
#[inline(always)]
pub(crate) fn pick_of_four<T: Copy>(values: [T; 4], r: u32) -> T {
    let [v0, v1, v2, v3] = values;
    let low = if r & 1 != 0 { v1 } else { v0 };
    let high = if r & 1 != 0 { v3 } else { v2 };
    if r & 2 != 0 { high } else { low }
}

/// The smallest lane mask between lanes that hold the same column after [`transpose_quad`]:
/// lanes `l`, `l ^ 8`, `l ^ 16` and `l ^ 24` hold the column's 16 rows in a warp, so after
/// the merge over those lanes the lanes below this mask hold one result per column.
const FIRST_COLUMN_LANE_MASK: u32 = 8;

/// The winners of `K` quads (four consecutive rows each, one column each) of draw `sample`
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
unsafe fn race_round<const K: usize>(
    row: &[RowParams; K],
    sample: u32,
    block: u32,
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
            estimates[k] = block_estimate(&row[k], sample, block, logits[k], rows_valid, arch::log2_approx);
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
            winners[k].offer_in_order(score, 4 * block + r);
        }
    });
    winners
}

/// The unfused GEMM's epilogue: each transposed quad is four consecutive logits of one
/// column, stored with one 16-byte write.
///
/// # Safety
/// All consumer threads call it together; `args.out` holds `batch × logits_stride` floats.
#[inline(always)]
unsafe fn logits_epilogue<const N: usize, const R: usize>(acc: &[f32; R], args: &TmaArgs, place: &Placement) {
    let store_quad = |tile_column: usize, quad: [f32; 4]| {
        // SAFETY: every consumer thread runs the quads together (this function's contract).
        let logits = unsafe { transpose_quad(quad, place.lane) };
        let b = place.col0 + 8 * tile_column as u32 + place.column;
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
