//! Logits tiles: each thread ends with the logits of four consecutive vocabulary rows for two
//! batch columns per n-tile, the layout the sampling epilogue and the logits writer read.
//!
//! Thread `(g, t) = (lane / 4, lane % 4)` of warp `w` owns vocabulary rows
//! `row0 = tile_base + 32·w + 4·g .. row0 + 4` (one Philox block) and batch columns
//! `col0 + 8·nt + 2·t + c` for `c ∈ {0, 1}`. `ThreadLogits[nt][c][r]` is the logit of row
//! `row0 + r` for that column.

use crate::arch;
use crate::element::{Element, MmaElement};

pub type ThreadLogits<const NT: usize> = [[[f32; 4]; 2]; NT];

/// Where a warp's tile lies and what it reads.
#[derive(Clone, Copy)]
pub struct TileInput {
    pub lm_head: u64,
    pub hidden: u64,
    pub vocab: u32,
    pub dim: u32,
    pub batch: u32,
    /// Elements from one row of `W` to the next.
    pub lm_head_stride: u32,
    /// Elements from one row of `H` to the next.
    pub hidden_stride: u32,
    /// First vocabulary row of this thread (a multiple of 4).
    pub row0: u32,
    /// First batch column of the work item.
    pub col0: u32,
}

/// Columns of `dim` per main-loop step of the mma tile: 4 mma k-steps of 16.
const CHUNK: u32 = 64;

/// One chunk of the operands in registers, already in mma fragment order.
///
/// The dot product does not care in which order `k` is summed, so each thread loads 16
/// contiguous bytes at columns `8t..8t+8` and `32+8t..32+8t+8` of a 64-column chunk, and the
/// mma's logical `k` positions are permuted to match; `W` and `H` use the same permutation.
/// This keeps every global load 16 bytes wide and coalesced without shared memory.
struct Chunk<const NT: usize> {
    /// `w[r]` = eight bf16/f16 pairs of row `row0 + r`.
    w: [[u32; 8]; 4],
    /// `h[nt]` = eight pairs of batch column `col0 + 8·nt + g`.
    h: [[u32; 8]; NT],
}

struct Addresses<const NT: usize> {
    w: [u64; 4],
    h: [u64; NT],
}

#[inline(always)]
fn addresses<const NT: usize>(input: &TileInput, lane: u32, element_bytes: u64) -> Addresses<NT> {
    let g = lane / 4;
    let t = lane % 4;
    let lm_head_row_bytes = input.lm_head_stride as u64 * element_bytes;
    let hidden_row_bytes = input.hidden_stride as u64 * element_bytes;
    let thread_offset = 8 * t as u64 * element_bytes;
    let w = core::array::from_fn(|r| {
        let row = (input.row0 + r as u32).min(input.vocab - 1);
        input.lm_head + row as u64 * lm_head_row_bytes + thread_offset
    });
    let h = core::array::from_fn(|nt| {
        let col = (input.col0 + 8 * nt as u32 + g).min(input.batch - 1);
        input.hidden + col as u64 * hidden_row_bytes + thread_offset
    });
    Addresses { w, h }
}

/// Loads chunk `k0` (a column index); when `masked`, 8-column groups at or past `dim` read
/// as zeros (`dim` is a multiple of 8, so a group is wholly in or out).
///
/// # Safety
/// `at` holds 16-byte aligned addresses of rows of `W` and `H` with at least `k0 + 64`
/// columns, or `dim` when `masked`.
#[inline(always)]
unsafe fn load_chunk<const NT: usize>(at: &Addresses<NT>, k0: u32, masked: bool, dim: u32, t: u32) -> Chunk<NT> {
    let byte = k0 as u64 * 2;
    let first_in = !masked || k0 + 8 * t < dim;
    let second_in = !masked || k0 + 32 + 8 * t < dim;
    let load_pair = |base: u64| -> [u32; 8] {
        // SAFETY: per this function's contract the addresses lie in the matrices; `first_in` keeps
        // the load inside `dim` (the tail chunk), and every address is 16-byte aligned (16-byte
        // aligned rows, offsets of 8 elements).
        let lo = if first_in { unsafe { arch::load_global_nc_v4_l2_256(base + byte) } } else { [0; 4] };
        // SAFETY: as above, for the second 8-element group.
        let hi = if second_in { unsafe { arch::load_global_nc_v4_l2_256(base + byte + 64) } } else { [0; 4] };
        [lo[0], lo[1], lo[2], lo[3], hi[0], hi[1], hi[2], hi[3]]
    };
    Chunk { w: core::array::from_fn(|r| load_pair(at.w[r])), h: core::array::from_fn(|nt| load_pair(at.h[nt])) }
}

/// `acc (+)=` the products of one chunk, 4 k-steps of 16.
///
/// # Safety
/// All 32 lanes of the warp call it together (`mma.sync.aligned`).
// Indexing by the loop variables gives constant indices once unrolled, which keeps the
// arrays in registers.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
unsafe fn multiply_chunk<T: MmaElement, const NT: usize>(acc: &mut [[[f32; 4]; NT]; 2], chunk: &Chunk<NT>) {
    for s in 0..4 {
        for mt in 0..2 {
            // Fragment rows g and g+8 of m-tile mt are vocabulary rows row0+2mt and row0+2mt+1.
            let a = [
                chunk.w[2 * mt][2 * s],
                chunk.w[2 * mt + 1][2 * s],
                chunk.w[2 * mt][2 * s + 1],
                chunk.w[2 * mt + 1][2 * s + 1],
            ];
            for nt in 0..NT {
                let b = [chunk.h[nt][2 * s], chunk.h[nt][2 * s + 1]];
                // SAFETY: the lanes of the warp run `mma_tile` together (its contract).
                unsafe { T::mma(&mut acc[mt][nt], a, b) };
            }
        }
    }
}

/// The logits tile through the tensor cores: `dim` must be a multiple of 8 and both
/// matrices 16-byte aligned. Each thread streams its own four rows of `W` straight into
/// registers, one chunk ahead of the mma.
///
/// # Safety
/// All 32 lanes of the warp call it together; `input` describes valid device matrices with
/// `vocab, dim, batch ≥ 1`.
#[inline(always)]
pub unsafe fn mma_tile<T: MmaElement, const NT: usize>(input: &TileInput, lane: u32) -> ThreadLogits<NT> {
    let t = lane % 4;
    let at = addresses::<NT>(input, lane, T::BYTES);
    let mut acc = [[[0.0f32; 4]; NT]; 2];
    let full_chunks = input.dim / CHUNK;
    if full_chunks > 0 {
        // SAFETY: all lanes together; the addresses come from `addresses` over this tile's valid
        // rows and columns (clamped to the last row and column).
        let mut current = unsafe { load_chunk(&at, 0, false, input.dim, t) };
        for c in 1..full_chunks {
            // SAFETY: as above; chunk `c` lies within the first `full_chunks · CHUNK` columns.
            let next = unsafe { load_chunk(&at, c * CHUNK, false, input.dim, t) };
            // SAFETY: all lanes together (this function's contract).
            unsafe { multiply_chunk::<T, NT>(&mut acc, &current) };
            current = next;
        }
        // SAFETY: all lanes together (this function's contract).
        unsafe { multiply_chunk::<T, NT>(&mut acc, &current) };
    }
    if !input.dim.is_multiple_of(CHUNK) {
        // SAFETY: as above; the masked load reads only the 8-column groups below `dim`.
        let tail = unsafe { load_chunk(&at, full_chunks * CHUNK, true, input.dim, t) };
        // SAFETY: all lanes together (this function's contract).
        unsafe { multiply_chunk::<T, NT>(&mut acc, &tail) };
    }
    // acc[mt][nt] = [(row0+2mt, 2t), (row0+2mt, 2t+1), (row0+2mt+1, 2t), (row0+2mt+1, 2t+1)].
    core::array::from_fn(|nt| {
        core::array::from_fn(|c| [acc[0][nt][c], acc[0][nt][2 + c], acc[1][nt][c], acc[1][nt][2 + c]])
    })
}

/// Halves a lane's vector of partial sums: lanes with `mask` set keep the upper half, the
/// others the lower half, each adding its partner's copy of the half it keeps.
///
/// # Safety
/// All 32 lanes of the warp call it together.
#[inline(always)]
unsafe fn halve<const N: usize, const HALF: usize>(v: [f32; N], lane: u32, mask: u32) -> [f32; HALF] {
    let upper = lane & mask != 0;
    core::array::from_fn(|i| {
        let keep = if upper { v[i + HALF] } else { v[i] };
        let send = if upper { v[i] } else { v[i + HALF] };
        // SAFETY: per this function's contract all 32 lanes are here together.
        keep + f32::from_bits(unsafe { arch::shuffle_xor(send.to_bits(), mask) })
    })
}

/// Sums 32 per-lane vectors of 32 partial sums so that lane `l` ends with the total of
/// entry `l`: five halving steps, 31 shuffles instead of 32 × 5.
///
/// # Safety
/// All 32 lanes of the warp call it together.
#[inline(always)]
unsafe fn transpose_reduce(v: [f32; 32], lane: u32) -> f32 {
    // SAFETY: per this function's contract all 32 lanes are here together.
    unsafe {
        let v: [f32; 16] = halve(v, lane, 16);
        let v: [f32; 8] = halve(v, lane, 8);
        let v: [f32; 4] = halve(v, lane, 4);
        let v: [f32; 2] = halve(v, lane, 2);
        let v: [f32; 1] = halve(v, lane, 1);
        v[0]
    }
}

/// The logits tile on the CUDA cores, for any element type, any `dim` and any alignment: the
/// fallback and the f32 path. Eight groups of four rows; in each, lanes stride over `dim`
/// and [`transpose_reduce`] gathers the 4 × 8 sums; `scratch` then regroups them into the
/// layout of [`mma_tile`] with one n-tile.
///
/// # Safety
/// All 32 lanes call it together; `scratch` points to this warp's
/// `SIMT_WARP_SCRATCH_FLOATS` floats of shared memory; `input` as in [`mma_tile`].
#[inline(always)]
pub unsafe fn simt_tile<T: Element>(input: &TileInput, lane: u32, scratch: *mut f32) -> ThreadLogits<1> {
    let g = lane / 4;
    let t = lane % 4;
    let element = T::BYTES;
    let lm_head_row_bytes = input.lm_head_stride as u64 * element;
    let hidden_row_bytes = input.hidden_stride as u64 * element;
    let warp_row0 = input.row0 - 4 * g;
    let cols: [u64; 8] =
        core::array::from_fn(|c| input.hidden + (input.col0 + c as u32).min(input.batch - 1) as u64 * hidden_row_bytes);
    for q in 0..8u32 {
        let rows: [u64; 4] = core::array::from_fn(|r| {
            input.lm_head + (warp_row0 + 4 * q + r as u32).min(input.vocab - 1) as u64 * lm_head_row_bytes
        });
        let mut partial = [0.0f32; 32];
        let mut k = lane;
        while k < input.dim {
            let offset = k as u64 * element;
            // SAFETY: `k < dim` and every row index is clamped below `vocab`: inside `W`; element
            // loads need only the element's alignment.
            let w: [f32; 4] = core::array::from_fn(|r| unsafe { T::load(rows[r] + offset) });
            // SAFETY: `k < dim` and every column index is clamped below `batch`: inside `H`.
            let h: [f32; 8] = core::array::from_fn(|c| unsafe { T::load(cols[c] + offset) });
            for r in 0..4 {
                for c in 0..8 {
                    partial[r * 8 + c] += w[r] * h[c];
                }
            }
            k += 32;
        }
        // SAFETY: all 32 lanes run the `q` loop together (the `k` loop's trip count differs by
        // lane, but it ends before this).
        let sum = unsafe { transpose_reduce(partial, lane) };
        // SAFETY: `32q + lane < 256` floats: inside this warp's scratch
        // (`SIMT_WARP_SCRATCH_FLOATS`).
        unsafe { *scratch.add((32 * q + lane) as usize) = sum };
    }
    // SAFETY: all 32 lanes together (this function's contract).
    unsafe { arch::sync_warp() };
    // scratch[32q + 8r + c] holds row 4q + r, column c; this thread wants rows 4g.., cols 2t+c.
    let logits = core::array::from_fn(|c| {
        // SAFETY: inside this warp's 256 scratch floats, written by the lanes before `sync_warp`.
        core::array::from_fn(|r| unsafe { *scratch.add((32 * g + 8 * r as u32 + 2 * t + c as u32) as usize) })
    });
    // SAFETY: all 32 lanes together (this function's contract).
    unsafe { arch::sync_warp() };
    [logits]
}
