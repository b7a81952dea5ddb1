//! The staged `mma.sync` tile (sm_80 and later): a block's four warps share each chunk of `W`
//! and `H` through shared memory, so one read of a `W` chunk from device memory serves all
//! `8·NT` batch columns of the item. Split by role:
//! - the producer ([`load_stage`]): every thread copies its share of a chunk's 16-byte
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
fn w_key(row: u32) -> u32 {
    (row >> 2) & 7
}

/// The swizzle key of row `column` of a stage's `H` rows.
#[inline(always)]
fn h_key(column: u32) -> u32 {
    column & 7
}

/// Shared-window address of piece `piece` of row `row` in the rows at `base`.
#[inline(always)]
fn piece_address(base: u32, row: u32, piece: u32, key: u32) -> u32 {
    base + row * ROW_BYTES + ((piece ^ key) << 4)
}

/// The producer: copies chunk `chunk` (elements `64·chunk ..`) of the item's `W` rows and `H`
/// columns into the stage at `stage` (its `W` rows, then its `H` rows). Rows past `vocab` and
/// columns past `batch` read the last row or column (their results are never used); pieces
/// past `dim` are zeros.
///
/// # Safety
/// Every thread of the block calls it for the same chunk; `stage` is a shared-window address of
/// `staged_stage_bytes(8·NT)` bytes that no thread reads until the copies' group is waited for
/// and a block barrier passed; `input` describes valid 16-byte aligned matrices.
#[inline(always)]
unsafe fn load_stage<const NT: usize>(input: &TileInput, tile_row0: u32, stage: u32, chunk: u32, thread: u32) {
    let k0 = chunk * STAGED_CHUNK;
    let w_row_bytes = input.lm_head_stride as u64 * 2;
    let h_row_bytes = input.hidden_stride as u64 * 2;
    // `W` is streamed once, so its copies ask L2 for the span that holds the next stage's bytes
    // of the row; `H` stays in L2 between items.
    let copy = |base: u64, row_bytes: u64, source_row: u32, row: u32, piece: u32, key: u32, at: u32, is_w: bool| {
        let k = k0 + 8 * piece;
        let inside = k < input.dim;
        let source = base + source_row as u64 * row_bytes + if inside { 2 * k as u64 } else { 0 };
        let (destination, bytes) = (piece_address(at, row, piece, key), if inside { 16 } else { 0 });
        if is_w {
            // SAFETY: per this function's contract the stage is this block's and unread until the
            // wait; the source row is clamped inside the matrix and the piece inside `dim` (or not
            // read), 16-byte aligned (aligned rows, `dim % 8 == 0`).
            unsafe { arch::cp_async_16_l2_256(destination, source, bytes) };
        } else {
            // SAFETY: per this function's contract the stage is this block's and unread until the
            // wait; the source row is clamped inside the matrix and the piece inside `dim` (or not
            // read), 16-byte aligned (aligned rows, `dim % 8 == 0`).
            unsafe { arch::cp_async_16(destination, source, bytes) };
        }
    };
    let mut q = thread;
    while q < TILE_ROWS * PIECES {
        let (row, piece) = (q / PIECES, q % PIECES);
        let source_row = (tile_row0 + row).min(input.vocab - 1);
        copy(input.lm_head, w_row_bytes, source_row, row, piece, w_key(row), stage, true);
        q += THREADS;
    }
    let h_base = stage + TILE_ROWS * ROW_BYTES;
    let mut q = thread;
    while q < 8 * NT as u32 * PIECES {
        let (column, piece) = (q / PIECES, q % PIECES);
        let source_column = (input.col0 + column).min(input.batch - 1);
        copy(input.hidden, h_row_bytes, source_column, column, piece, h_key(column), h_base, false);
        q += THREADS;
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
    let stage_at = |chunk: u32| ring + (chunk % STAGED_STAGES) * stage_bytes;
    let chunks = input.dim.div_ceil(STAGED_CHUNK);
    for chunk in 0..STAGED_STAGES - 1 {
        if chunk < chunks {
            // SAFETY: every thread together (uniform bound); the ring is unused (this function's
            // contract).
            unsafe { load_stage::<NT>(input, tile_row0, stage_at(chunk), chunk, thread) };
        }
        // SAFETY: bookkeeping of this thread's copies; an empty group keeps the count uniform.
        unsafe { arch::cp_async_commit() };
    }
    let mut acc = [[[0.0f32; 4]; NT]; 2];
    for chunk in 0..chunks {
        // SAFETY: waits for this thread's copies of `chunk` (groups are committed one per chunk);
        // the barrier publishes every thread's and ends every warp's reads of chunk `chunk − 1`,
        // whose stage the next copy reuses.
        unsafe {
            arch::cp_async_wait::<{ STAGED_STAGES - 2 }>();
            arch::sync_threads();
        }
        let next = chunk + STAGED_STAGES - 1;
        if next < chunks {
            // SAFETY: every thread together; the stage of chunk `next` held chunk `chunk − 1`, which
            // no warp reads after the barrier above.
            unsafe { load_stage::<NT>(input, tile_row0, stage_at(next), next, thread) };
        }
        // SAFETY: as above.
        unsafe { arch::cp_async_commit() };
        // SAFETY: all lanes together after the wait and barrier above.
        unsafe { multiply_stage::<T, NT>(&mut acc, stage_at(chunk), warp, lane) };
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
