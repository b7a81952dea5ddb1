//! The `wgmma` accumulators in registers: where a thread's values lie in the tile, and the
//! lane transposes that turn them into four consecutive vocabulary rows per thread.

use crate::arch;

/// Where a consumer thread's transposed quads lie in the tile.
pub(super) struct Placement {
    /// Thread index within the team.
    pub(super) thread: u32,
    /// Warp index within the team.
    pub(super) warp: u32,
    pub(super) lane: u32,
    pub(super) tile: u32,
    pub(super) col0: u32,
    /// First of the four vocabulary rows of this thread's quads.
    pub(super) row0: u32,
    /// Column of this thread's quad in n8-tile 0 (add `8·j` for tile `j`).
    pub(super) column: u32,
}

impl Placement {
    #[inline(always)]
    /// `thread` within the team; `first_row` = the first of this warpgroup's 64 rows.
    pub(super) fn new(thread: u32, first_row: u32, tile: u32, col0: u32) -> Placement {
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
pub(super) fn pick_quad<const R: usize, const K: usize>(acc: &[f32; R], round: usize, k: usize) -> [f32; 4] {
    let mut quad = [acc[4 * k], acc[4 * k + 1], acc[4 * k + 2], acc[4 * k + 3]];
    for other in 1..R / 4 / K {
        if round == other {
            let j = 4 * (other * K + k);
            quad = [acc[j], acc[j + 1], acc[j + 2], acc[j + 3]];
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
pub(super) use for_each_quad;

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
pub(super) unsafe fn transpose_quad(quad: [f32; 4], lane: u32) -> [f32; 4] {
    let mut v = quad;
    // SAFETY: per this function's contract all 32 lanes are here together.
    unsafe {
        transpose_step(&mut v, lane, 4, 1);
        transpose_step(&mut v, lane, 8, 2);
    }
    v
}
