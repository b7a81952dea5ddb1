//! The cooperative and ping-pong TMA kernels: the consumers multiply an item and run its
//! epilogue themselves.
//!
//! Work item = (`ROWS` vocabulary rows, `N` batch columns). Two schedules:
//! - `ROWS = 64`, ping-pong: the block's items alternate between the two warpgroups, which
//!   take turns on the mainloop (`turn` barriers), so one multiplies while the other runs the
//!   epilogue of its previous item;
//! - `ROWS = 128`, cooperative: both warpgroups multiply every item (64 rows each), then both
//!   run the epilogue; each byte of `H` staged serves twice the rows of `W`.

use flashsample_core::Candidate;
use flashsample_core::RowParams;
use flashsample_core::abi::{TMA_CONSUMER_WARPS, TMA_K_BLOCK, TmaArgs, WARPGROUP_ROWS, tma_stages};

use super::epilogue::{PAD_ROW_WORDS, ROW_WORDS, load_row_words, logits_epilogue, sample_epilogue};
use super::fragments::Placement;
use super::pipeline::Ring;
use super::scheduler::Items;
use super::{CONSUMER_WARPGROUPS, WARPGROUP_THREADS};
use crate::hopper::WgmmaElement;
use crate::{arch, hopper};

/// Named barrier of team `k` (the warps sharing an item) is `FIRST_TEAM_BARRIER + k` (0 is
/// `__syncthreads`).
const FIRST_TEAM_BARRIER: u32 = 1;

/// Where the block's shared memory holds what (shared-window addresses, stages 1024-aligned).
struct Layout {
    ring: Ring,
    /// `turn + 8·w`: consumer warpgroup `w` may start its next mainloop.
    turn: u32,
    staging: *mut Candidate,
    /// Row parameters of each team's current item: `N` per team.
    row_params: *mut RowParams,
}

impl Layout {
    #[inline(always)]
    fn new(base: *mut u8, item_rows: u32, columns: u32) -> Layout {
        let shared = arch::shared_address(base);
        let start = shared.next_multiple_of(1024);
        let stages = tma_stages(item_rows, columns);
        let boxes = Ring::new(start, stages, item_rows, columns, 0).boxes_end();
        let ring = Ring::new(start, stages, item_rows, columns, boxes);
        let turn = ring.barriers_end();
        let staging = base.wrapping_add((turn + CONSUMER_WARPGROUPS * 8 - shared) as usize).cast::<Candidate>();
        let row_params = staging.wrapping_add((TMA_CONSUMER_WARPS * columns) as usize).cast::<RowParams>();
        Layout { ring, turn, staging, row_params }
    }
}

/// How the consumer warps share the work items of height `item_rows`.
#[derive(Clone, Copy)]
struct Teams {
    /// Warps that multiply one item together (4 or 8).
    warps: u32,
    /// Teams in the block (2 or 1); the block's items alternate between them.
    count: u32,
}

impl Teams {
    #[inline(always)]
    fn new(item_rows: u32) -> Teams {
        let warps = 4 * (item_rows / WARPGROUP_ROWS);
        Teams { warps, count: TMA_CONSUMER_WARPS / warps }
    }
}

/// Both kinds of TMA kernel: `FUSED` samples (candidates out), otherwise f32 logits out.
/// Items of `ROWS` (64 or 128) × `N` batch columns, `R = N / 2` accumulators per consumer
/// thread. `PROCESSING`: the sampling epilogue applies the rows' per-entry processing.
///
/// # Safety
/// Launched with `TMA_THREADS` threads and `tma_shared_bytes(ROWS, N)` bytes of dynamic
/// shared memory at `shared`; `args` holds tensor maps of `W` and `H` with boxes of
/// 64 × `ROWS` and 64 × `N` elements and 128-byte swizzle, and valid output buffers.
#[inline(always)]
pub unsafe fn tma_kernel<
    T: WgmmaElement,
    const ROWS: u32,
    const N: usize,
    const R: usize,
    const FUSED: bool,
    const PROCESSING: bool,
>(
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
        unsafe { consume::<T, N, R, FUSED, PROCESSING>(args, &layout, ROWS, teams) };
    }
}

/// A consumer warpgroup: multiply each of its team's items' stages (its 64 rows of them),
/// then run the epilogue with its team.
///
/// # Safety
/// As [`tma_kernel`]; called by all consumer threads.
#[inline(always)]
unsafe fn consume<T: WgmmaElement, const N: usize, const R: usize, const FUSED: bool, const PROCESSING: bool>(
    args: &TmaArgs,
    layout: &Layout,
    item_rows: u32,
    teams: Teams,
) {
    let thread = arch::thread_index();
    let warpgroup = thread / WARPGROUP_THREADS;
    let team = (thread / 32) / teams.warps;
    let team_thread = thread % (32 * teams.warps);
    // This warpgroup's 64 rows within the item's `W` box.
    let rows_offset = (warpgroup % (item_rows / WARPGROUP_ROWS)) * WARPGROUP_ROWS;
    // SAFETY: every consumer thread calls `consume`, so whole warps reach the shuffle.
    let w_offset = unsafe { arch::broadcast_lane0(rows_offset * 2 * TMA_K_BLOCK) };
    let k_blocks = args.dim.div_ceil(TMA_K_BLOCK);
    let staging = layout.staging.wrapping_add((team * teams.warps * N as u32) as usize);
    let team_row_params = layout.row_params.wrapping_add((team * N as u32) as usize);
    let mut acc = [0.0f32; R];
    let mut turns = 0u32;
    for (position, tile, col0) in Items::new(args, N as u32, team, teams.count) {
        // The item's row parameters (one column per thread, N ≤ team threads) are loaded
        // now and stored to shared memory after the mainloop, so the load's latency hides
        // under it and the epilogue reads them from shared memory.
        let b = col0 + team_thread;
        let staged_row = if FUSED && team_thread < N as u32 && b < args.batch {
            // SAFETY: `b < batch`: a row of the `[batch]` row parameters, 8-byte aligned.
            unsafe { load_row_words(args.row_params.cast::<u64>().as_ptr(), b) }
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
        let place = Placement::new(team_thread, tile * item_rows + rows_offset, tile, col0);
        if FUSED {
            // The team's previous epilogue ended at a team barrier: no thread still reads
            // the previous item's rows.
            if team_thread < N as u32 {
                let words = team_row_params.cast::<u64>().wrapping_add(ROW_WORDS * team_thread as usize);
                for (w, &word) in staged_row.iter().enumerate() {
                    // SAFETY: `team_thread < N`: inside the team's `N` row slots of the layout.
                    unsafe { *words.add(w) = word };
                }
            }
            let team_barrier = (FIRST_TEAM_BARRIER + team, 32 * teams.warps);
            let epilogue = match N / 8 {
                1 => sample_epilogue::<N, R, 1, PROCESSING>,
                2 => sample_epilogue::<N, R, 2, PROCESSING>,
                _ => sample_epilogue::<N, R, 4, PROCESSING>,
            };
            // SAFETY: every thread of the team calls the epilogue; its row parameters were stored
            // above, `staging` is the team's.
            unsafe { epilogue(&acc, args, &place, team_row_params, staging, team_barrier) };
        } else {
            // SAFETY: every consumer thread calls the epilogue together; `args.out` holds the
            // logits.
            unsafe { logits_epilogue::<N, R>(&acc, args, &place) };
        }
    }
}
