//! The staged `mma.sync` tile (sm_80 and later): a block's four warps share each chunk of `W`
//! and `H` through shared memory, so one read of a `W` chunk from device memory serves all
//! `8·NT` batch columns of the item. Split by role:
//! - the producer ([`Producer`]): every thread copies its share of a chunk's 16-byte
//!   pieces with `cp.async`, into a ring of [`STAGED_STAGES`] stages;
//! - the pipeline ([`staged_tile`]'s main loop): up to `STAGED_STAGES − 1` chunks in flight,
//!   one block barrier per chunk;
//! - the consumer ([`multiply_stage`]): `ldmatrix` gives the fragments, `mma.sync` m16n8k16
//!   multiplies them.
//!
//! The result has the layout of [`crate::tile::ThreadLogits`] (thread `(g, t)` of warp `w`
//! holds rows `32w + 4g .. + 4`, columns `8·nt + 2t + c`), so the epilogues of the
//! register-direct tile run unchanged on it.
//!
//! A stage holds [`TILE_ROWS`] rows of `W` and `8·NT` rows of `H`, 64 elements (128 bytes)
//! each. Piece `c` (16 bytes) of row `r` lies at piece `c ^ key(r)` of the row, keys chosen
//! so that the eight rows one `ldmatrix` matrix reads lie in eight different bank groups:
//! [`w_key`] for `W` (a matrix's rows are `4g + const`), [`h_key`] for `H` (rows `8n + g`).
//!
//! Architecture Invariant: no lane-dependent branch sits next to `ldmatrix` or `mma.sync`
//! (both `.sync.aligned`); the producer's per-thread choices are data (a copy of 0 or 16
//! bytes, a clamped row), never control flow around them.

use flashsample_core::abi::{
    N_TILE, STAGED_CHUNK, STAGED_COLUMNS, STAGED_STAGES, TILE_ROWS, WARP_ROWS, staged_stage_bytes,
};

use crate::element::MmaElement;
use crate::tile::{ThreadLogits, TileInput};
use crate::{arch, each_index};

// `each_index!` unrolls at most 16 n-tiles (here and in the shared epilogue).
const _: () = assert!(STAGED_COLUMNS[0] / N_TILE <= 16 && STAGED_COLUMNS[1] / N_TILE <= 16);

/// Bytes of one row of a stage: [`STAGED_CHUNK`] 16-bit elements.
const ROW_BYTES: u32 = STAGED_CHUNK * 2;
/// 16-byte pieces per row of a stage.
const PIECES: u32 = ROW_BYTES / 16;
/// Threads of the block: the producer's copies are spread over all of them.
const THREADS: u32 = TILE_ROWS / WARP_ROWS * 32;

/// The swizzle key of row `row` of a stage's `W` rows.
#[inline(always)]
const fn w_key(row: u32) -> u32 {
    (row >> 2) & 7
}

/// The swizzle key of row `column` of a stage's `H` rows.
#[inline(always)]
const fn h_key(column: u32) -> u32 {
    column & 7
}

/// Shared-window address of piece `piece` of row `row` in the rows at `base`.
#[inline(always)]
fn piece_address(base: u32, row: u32, piece: u32, key: u32) -> u32 {
    base + row * ROW_BYTES + ((piece ^ key) << 4)
}

/// Copies of `W` pieces per thread and stage: every thread copies the same piece
/// (`thread % PIECES`) of rows `thread / PIECES + ROW_STEP·j`.
const W_COPIES: usize = (TILE_ROWS * PIECES / THREADS) as usize;
/// Rows between one of a thread's copies and its next.
const ROW_STEP: u32 = THREADS / PIECES;
const _: () = assert!(THREADS.is_multiple_of(PIECES) && (TILE_ROWS * PIECES).is_multiple_of(THREADS));
const _: () = assert!(W_COPIES <= 16 && STAGED_COLUMNS[1] * PIECES / THREADS <= 16);
const _: () = assert!((STAGED_COLUMNS[0] * PIECES).is_multiple_of(THREADS));
// A `W` row's swizzle key (bits 2–4 of the row) repeats every 32 rows and an `H` row's (bits
// 0–2) every 8, so a thread's copies, `ROW_STEP` rows apart, need two places in a stage for `W`
// (even and odd `j`) and one for `H`.
const _: () = assert!((2 * ROW_STEP).is_multiple_of(32) && ROW_STEP.is_multiple_of(8));

/// The producer of one item: this thread's copies of each chunk of the item's `W` rows and `H`
/// columns into a stage (its `W` rows, then its `H` rows). Every thread copies one piece
/// (`thread % PIECES`) of every `ROW_STEP`-th row, so the piece, its bound check against `dim`
/// and the copies' places in a stage are fixed for the item, and each source address moves on
/// by a chunk: a copy costs an add and a select, where recomputing each row's clamp, product
/// and swizzle in a loop took more instructions per chunk than the multiplies.
struct Producer<const NT: usize> {
    /// Where this thread's next `W` and `H` pieces are read from (rows past `vocab` and columns
    /// past `batch` read the last one; their results are never used). `h` has room for the
    /// most copies `each_index!` makes; those past `H_COPIES` are unused.
    w: [u64; W_COPIES],
    h: [u64; 16],
    /// The element of `dim` at which the next chunk's piece starts.
    k: u32,
    dim: u32,
    /// A readable 16-byte aligned address in each matrix, for pieces past `dim` (zeros).
    w_any: u64,
    h_any: u64,
    /// Offsets in a stage of this thread's `W` pieces of even and odd `j`, and of its first `H`
    /// piece.
    w_at: [u32; 2],
    h_at: u32,
}

impl<const NT: usize> Producer<NT> {
    /// Copies of `H` rows per thread and stage.
    const H_COPIES: usize = 8 * NT * PIECES as usize / THREADS as usize;

    /// The producer of the item whose first `W` row is `tile_row0`, at chunk 0.
    #[inline(always)]
    fn new(input: &TileInput, tile_row0: u32, thread: u32) -> Self {
        let (first, piece) = (thread / PIECES, thread % PIECES);
        let (w_row_bytes, h_row_bytes) = (input.lm_head_stride as u64 * 2, input.hidden_stride as u64 * 2);
        let mut w = [0u64; W_COPIES];
        each_index!(j < W_COPIES, {
            let row = (tile_row0 + first + ROW_STEP * j as u32).min(input.vocab - 1);
            w[j] = input.lm_head + row as u64 * w_row_bytes + 16 * piece as u64;
        });
        let mut h = [0u64; 16];
        each_index!(j < Self::H_COPIES, {
            let column = (input.col0 + first + ROW_STEP * j as u32).min(input.batch - 1);
            h[j] = input.hidden + column as u64 * h_row_bytes + 16 * piece as u64;
        });
        let w_at = [0, 1].map(|odd| piece_address(0, first + ROW_STEP * odd, piece, w_key(first + ROW_STEP * odd)));
        let h_at = TILE_ROWS * ROW_BYTES + piece_address(0, first, piece, h_key(first));
        Producer { w, h, k: 8 * piece, dim: input.dim, w_any: input.lm_head, h_any: input.hidden, w_at, h_at }
    }

    /// Copies the next chunk into the stage at `stage` and moves on to the chunk after it.
    ///
    /// # Safety
    /// Every thread of the block calls it for the same chunk; `stage` is a shared-window address
    /// of `staged_stage_bytes(8·NT)` bytes that no thread reads until the copies' group is
    /// waited for and a block barrier passed; the matrices are valid, 16-byte aligned, with
    /// `dim % 8 == 0`.
    #[inline(always)]
    unsafe fn copy_next(&mut self, stage: u32) {
        let inside = self.k < self.dim;
        let bytes = if inside { 16 } else { 0 };
        // `W` is streamed once, so its copies ask L2 for the span that holds the next stage's
        // bytes of the row; `H` stays in L2 between items.
        each_index!(j < W_COPIES, {
            let at = stage + self.w_at[j % 2] + (j / 2) as u32 * 2 * ROW_STEP * ROW_BYTES;
            // SAFETY: per this function's contract the stage is this block's and unread until
            // the wait; the source is the piece of a row inside the matrix, inside `dim`, or a
            // readable address whose 0 bytes are not read; 16-byte aligned.
            unsafe { arch::cp_async_16_l2_256(at, if inside { self.w[j] } else { self.w_any }, bytes) };
            self.w[j] += ROW_BYTES as u64;
        });
        each_index!(j < Self::H_COPIES, {
            let at = stage + self.h_at + j as u32 * ROW_STEP * ROW_BYTES;
            // SAFETY: as above, for a row of `H`.
            unsafe { arch::cp_async_16(at, if inside { self.h[j] } else { self.h_any }, bytes) };
            self.h[j] += ROW_BYTES as u64;
        });
        self.k += STAGED_CHUNK;
    }
}

/// The consumer: `acc += ` the products of the chunk in the stage at `stage`, four k-steps of
/// 16. Fragment row `i` of m-tile `mt` is the warp's row `4·(i % 8) + 2·mt + i / 8`, so each
/// thread's accumulators hold four consecutive vocabulary rows (the register-direct tile's
/// layout).
///
/// # Safety
/// All 32 lanes of the warp call it together, after the stage's copies are waited for and a
/// block barrier passed.
#[inline(always)]
unsafe fn multiply_stage<T: MmaElement, const NT: usize>(
    acc: &mut [[[f32; 4]; NT]; 2],
    stage: u32,
    warp: u32,
    lane: u32,
) {
    let (matrix, r) = (lane / 8, lane % 8);
    let h_base = stage + TILE_ROWS * ROW_BYTES;
    // Straight-line code over the k-steps and the pairs of n-tiles: every index into `acc`
    // is a constant (a rolled loop moved `acc` to local memory), and the next step's
    // `ldmatrix` can issue while this step's products run.
    each_index!(step < 4, {
        let s = step as u32;
        let a: [[u32; 4]; 2] = core::array::from_fn(|mt| {
            let row = WARP_ROWS * warp + 4 * r + 2 * mt as u32 + (matrix & 1);
            let piece = 2 * s + (matrix >> 1);
            // SAFETY: all 32 lanes together (this function's contract); the address is one of the
            // stage's `W` pieces, filled and published before the call.
            unsafe { arch::load_matrix_x4(piece_address(stage, row, piece, w_key(row))) }
        });
        each_index!(pair < NT / 2, {
            let column = 8 * (2 * pair as u32 + (matrix >> 1)) + r;
            let piece = 2 * s + (matrix & 1);
            // SAFETY: as above, for one of the stage's `H` pieces.
            let b = unsafe { arch::load_matrix_x4(piece_address(h_base, column, piece, h_key(column))) };
            // SAFETY: all 32 lanes together (this function's contract).
            unsafe {
                T::mma(&mut acc[0][2 * pair], a[0], [b[0], b[1]]);
                T::mma(&mut acc[0][2 * pair + 1], a[0], [b[2], b[3]]);
                T::mma(&mut acc[1][2 * pair], a[1], [b[0], b[1]]);
                T::mma(&mut acc[1][2 * pair + 1], a[1], [b[2], b[3]]);
            }
        });
    });
}

/// The logits tile of a block's item (rows `tile_row0 .. + TILE_ROWS`, columns `col0 .. +
/// 8·NT` of `input`) through the ring of stages at `ring` (shared memory of
/// `STAGED_STAGES · staged_stage_bytes(8·NT)` bytes). `input.row0` is this thread's first row,
/// as for [`crate::tile::mma_tile`].
///
/// # Safety
/// Every thread of the block calls it together; `ring` is the block's shared memory, not in use
/// (the previous item's epilogue has passed a block barrier since it last used it); `input`
/// describes valid 16-byte aligned matrices with `dim % 8 == 0` and `vocab, dim, batch ≥ 1`.
#[inline(always)]
pub unsafe fn staged_tile<T: MmaElement, const NT: usize>(input: &TileInput, ring: u32) -> ThreadLogits<NT> {
    let thread = arch::thread_index();
    let (warp, lane) = (thread / 32, thread % 32);
    let tile_row0 = input.row0 - WARP_ROWS * warp - 4 * (lane / 4);
    let stage_bytes = staged_stage_bytes(8 * NT as u32);
    // The stages of the chunks being copied and multiplied, stepped round the ring one stage
    // per chunk. Not `ring + (chunk % STAGED_STAGES)·stage_bytes`: LLVM strength-reduces that
    // into an induction variable for every copy's and `ldmatrix`'s address, about 70 registers.
    let ring_end = ring + STAGED_STAGES * stage_bytes;
    let step = |at: u32| if at + stage_bytes == ring_end { ring } else { at + stage_bytes };
    let chunks = input.dim.div_ceil(STAGED_CHUNK);
    let mut producer = Producer::<NT>::new(input, tile_row0, thread);
    let mut copied_at = ring;
    for chunk in 0..STAGED_STAGES - 1 {
        if chunk < chunks {
            // SAFETY: every thread together (uniform bound); the ring is unused (this function's
            // contract).
            unsafe { producer.copy_next(copied_at) };
        }
        // SAFETY: bookkeeping of this thread's copies; an empty group keeps the count uniform.
        unsafe { arch::cp_async_commit() };
        copied_at = step(copied_at);
    }
    let mut acc = [[[0.0f32; 4]; NT]; 2];
    let mut multiplied_at = ring;
    for chunk in 0..chunks {
        // SAFETY: waits for this thread's copies of `chunk` (groups are committed one per chunk);
        // the barrier publishes every thread's and ends every warp's reads of chunk `chunk − 1`,
        // whose stage the next copy reuses.
        unsafe {
            arch::cp_async_wait::<{ STAGED_STAGES - 2 }>();
            arch::sync_threads();
        }
        if chunk + STAGED_STAGES - 1 < chunks {
            // SAFETY: every thread together; the stage of chunk `chunk + STAGED_STAGES − 1` held
            // chunk `chunk − 1`, which no warp reads after the barrier above.
            unsafe { producer.copy_next(copied_at) };
        }
        // SAFETY: as above.
        unsafe { arch::cp_async_commit() };
        copied_at = step(copied_at);
        // SAFETY: all lanes together after the wait and barrier above.
        unsafe { multiply_stage::<T, NT>(&mut acc, multiplied_at, warp, lane) };
        multiplied_at = step(multiplied_at);
    }
    // SAFETY: only empty groups remain; the barrier ends every warp's reads of the ring before
    // the caller's epilogue reuses it.
    unsafe {
        arch::cp_async_wait::<0>();
        arch::sync_threads();
    }
    // acc[mt][nt] = [(row0+2mt, 2t), (row0+2mt, 2t+1), (row0+2mt+1, 2t), (row0+2mt+1, 2t+1)].
    let mut logits = [[[0.0f32; 4]; 2]; NT];
    each_index!(nt < NT, {
        logits[nt] = [0, 1].map(|c| [acc[0][nt][c], acc[0][nt][2 + c], acc[1][nt][c], acc[1][nt][2 + c]]);
    });
    logits
}
