//! The argument blocks and launch constants shared by the kernels and the host launcher.
//!
//! Kernels take one `#[repr(C)]` block by value; device addresses travel as [`DevicePtr`]s,
//! a `u64` typed by what it points to, so the host can fill them from any allocation (its own,
//! a caller's, another library's). On the host every block is `bytemuck::Pod`: no padding, no
//! references, so the driver may copy its bytes. Architecture Invariant: a kernel and its
//! launcher agree on these types and constants because both import them from here; nothing is
//! duplicated. Which kernel takes which block, and its launch shape, is in [`crate::registry`].

use core::marker::PhantomData;

use crate::process::{LogSumExp, Penalties, SparseEntry};
use crate::{Candidate, RowParams};

/// A device address of a `T` (or of the first of an array of them), as a kernel argument block
/// carries it: 8 bytes, the address itself.
#[repr(transparent)]
pub struct DevicePtr<T> {
    address: u64,
    points_to: PhantomData<*const T>,
}

impl<T> DevicePtr<T> {
    /// The null address: an argument a kernel does not read.
    pub const NULL: DevicePtr<T> = DevicePtr::new(0);

    /// The device address `address` as a pointer to `T` (0 is [`DevicePtr::NULL`]). Nothing
    /// is checked: the launcher vouches for what the address holds.
    pub const fn new(address: u64) -> DevicePtr<T> {
        DevicePtr { address, points_to: PhantomData }
    }

    /// The address itself, as the driver and the kernels take it.
    pub const fn address(self) -> u64 {
        self.address
    }

    /// The address `count` elements further on (`T` must have a size: for [`Element`] use
    /// [`DevicePtr::byte_add`]).
    pub const fn add(self, count: u64) -> DevicePtr<T> {
        assert!(core::mem::size_of::<T>() != 0, "DevicePtr::add on a zero-sized type; use byte_add");
        DevicePtr::new(self.address + count * core::mem::size_of::<T>() as u64)
    }

    /// [`DevicePtr::add`], keeping the null address null (an optional argument stays absent).
    pub const fn add_unless_null(self, count: u64) -> DevicePtr<T> {
        if self.address == 0 { self } else { self.add(count) }
    }

    /// The address `bytes` further on.
    pub const fn byte_add(self, bytes: u64) -> DevicePtr<T> {
        DevicePtr::new(self.address + bytes)
    }

    /// The same address, read as another type.
    pub const fn cast<U>(self) -> DevicePtr<U> {
        DevicePtr::new(self.address)
    }

    /// The address as a raw pointer for a kernel to read through (on the host it points into
    /// device memory and must not be dereferenced).
    pub fn as_ptr(self) -> *const T {
        self.address as *const T
    }

    /// The address as a raw pointer for a kernel to write through (on the host it points into
    /// device memory and must not be dereferenced).
    pub fn as_mut_ptr(self) -> *mut T {
        self.address as *mut T
    }
}

// SAFETY: a `DevicePtr` is an address, not an access: sending or sharing it between threads
// reads or writes nothing (whoever dereferences it on the device keeps the aliasing rules).
unsafe impl<T> Send for DevicePtr<T> {}
// SAFETY: as above.
unsafe impl<T> Sync for DevicePtr<T> {}

impl<T> Clone for DevicePtr<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for DevicePtr<T> {}

impl<T> PartialEq for DevicePtr<T> {
    fn eq(&self, other: &Self) -> bool {
        self.address == other.address
    }
}

impl<T> Eq for DevicePtr<T> {}

impl<T> core::fmt::Debug for DevicePtr<T> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "{:#x}", self.address)
    }
}

// SAFETY: one u64 and a zero-sized marker: no padding, every bit pattern valid, and the all-zero
// value is the null address.
#[cfg(not(target_arch = "nvptx64"))]
unsafe impl<T: 'static> bytemuck::Zeroable for DevicePtr<T> {}
// SAFETY: as above; the type holds no reference, only an address.
#[cfg(not(target_arch = "nvptx64"))]
unsafe impl<T: 'static> bytemuck::Pod for DevicePtr<T> {}

/// An element of the kernel's own element type (bf16, f16 or f32): what `W` and `H` hold.
/// The kernel's name says which (see [`crate::registry`]).
#[derive(Clone, Copy, Debug)]
pub enum Element {}

/// The driver's TMA descriptor (`CUtensorMap`): 128 opaque bytes, 64-byte aligned, in global
/// memory.
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(not(target_arch = "nvptx64"), derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct TensorMap(pub [u64; 16]);

/// What a TMA kernel writes: candidates (fused sampling) or f32 logits (the unfused GEMM).
#[derive(Clone, Copy, Debug)]
pub enum TmaOutput {}

/// Threads per block of every tile kernel (fused, logits GEMM, logits sampler): four warps.
pub const TILE_KERNEL_WARPS: u32 = 4;
/// Vocabulary rows one warp of a fused or GEMM kernel owns: 2 mma m-tiles of 16; each thread
/// owns four consecutive rows, one Philox block.
pub const WARP_ROWS: u32 = 32;
/// Vocabulary rows per work item (block tile) of a fused kernel; one candidate per tile.
pub const TILE_ROWS: u32 = TILE_KERNEL_WARPS * WARP_ROWS;
/// Batch columns per mma n-tile.
pub const N_TILE: u32 = 8;
/// Draws whose per-warp winners are staged in shared memory before one cross-warp merge.
pub const SAMPLES_PER_MERGE: u32 = 8;
/// Quads (four consecutive entries) each thread of the unfused logits sampler races per item.
/// Several per thread let a warp filter its entries against one best estimate and amortise
/// the item's merge over lanes and warps; the block's loads stay contiguous, quad `k` of every
/// thread lying `k` block-widths (`TILE_KERNEL_WARPS · 32 · 4` entries) into the item.
pub const LOGITS_SAMPLER_QUADS: u32 = 8;
/// Vocabulary entries per item (block tile) of the unfused logits sampler; one candidate per
/// (row, draw, item).
pub const LOGITS_SAMPLER_TILE: u32 = TILE_KERNEL_WARPS * 32 * 4 * LOGITS_SAMPLER_QUADS;
/// f32 scratch per warp of the SIMT fused kernel (32 rows × 8 columns of logits), placed in
/// shared memory after the candidate staging.
pub const SIMT_WARP_SCRATCH_FLOATS: u32 = 32 * 8;
/// Threads per block of the merge kernel.
pub const REDUCE_THREADS: u32 = 128;
/// Threads per block of `winner_logits`: a block per winner's dot product.
pub const WINNER_LOGITS_THREADS: u32 = 256;
/// Dynamic shared memory of `winner_logits`: an f64 partial sum per warp.
pub const WINNER_LOGITS_SHARED_BYTES: u32 = WINNER_LOGITS_THREADS / 32 * 8;

/// Bytes of one [`Candidate`] in shared and global memory.
pub const CANDIDATE_BYTES: u32 = core::mem::size_of::<Candidate>() as u32;

/// Dynamic shared memory of a fused mma tile kernel with `columns` batch columns.
pub const fn fused_mma_shared_bytes(columns: u32) -> u32 {
    SAMPLES_PER_MERGE * TILE_KERNEL_WARPS * columns * CANDIDATE_BYTES
}

/// [`Chain`](crate::chain::Chain)s a chain kernel stages per column: one per warp, then the
/// merges of warps 0 and 1 and of warps 2 and 3.
pub const CHAIN_STAGING_SLOTS: u32 = TILE_KERNEL_WARPS + TILE_KERNEL_WARPS / 2;

/// A tile kernel's epilogue staging with `columns` batch columns: a sampling kernel's
/// candidates ([`fused_mma_shared_bytes`]), or a chain kernel's [`CHAIN_STAGING_SLOTS`]
/// chains per column.
pub const fn epilogue_staging_bytes(columns: u32, chains: bool) -> u32 {
    if chains {
        CHAIN_STAGING_SLOTS * columns * core::mem::size_of::<crate::chain::Chain>() as u32
    } else {
        fused_mma_shared_bytes(columns)
    }
}

/// Batch-tile widths of the staged `mma.sync` tile.
pub const STAGED_COLUMNS: [u32; 2] = [64, 128];
/// Elements of `dim` per stage of the staged `mma.sync` tile: 128 bytes of each row.
pub const STAGED_CHUNK: u32 = 64;
/// Stages in the staged tile's ring: two chunks in flight while the warps multiply a third.
pub const STAGED_STAGES: u32 = 3;

/// Bytes of one stage of the staged tile with `columns` batch columns: a chunk of the item's
/// [`TILE_ROWS`] rows of `W` and `columns` rows of `H`.
pub const fn staged_stage_bytes(columns: u32) -> u32 {
    (TILE_ROWS + columns) * STAGED_CHUNK * 2
}

/// Dynamic shared memory of the staged tile's GEMM: the ring of stages.
pub const fn logits_staged_shared_bytes(columns: u32) -> u32 {
    STAGED_STAGES * staged_stage_bytes(columns)
}

/// Dynamic shared memory of the staged tile's fused or chain kernel: the ring, which the
/// epilogue's staging reuses once an item's products are done.
pub const fn fused_staged_shared_bytes(columns: u32, chains: bool) -> u32 {
    let ring = logits_staged_shared_bytes(columns);
    let staging = epilogue_staging_bytes(columns, chains);
    if ring > staging { ring } else { staging }
}

// A tile's lists of its warps (one `TileTop` per warp and column) fit the block's candidate
// staging, which they reuse.
const _: () = assert!(SAMPLES_PER_MERGE * CANDIDATE_BYTES >= core::mem::size_of::<crate::truncation::TileTop>() as u32);

/// Dynamic shared memory of the SIMT fused or chain kernel: the epilogue's staging for 8
/// columns, then the scratch.
pub const fn fused_simt_shared_bytes(chains: bool) -> u32 {
    epilogue_staging_bytes(N_TILE, chains) + TILE_KERNEL_WARPS * SIMT_WARP_SCRATCH_FLOATS * 4
}

/// Dynamic shared memory of the unfused pipeline's SIMT GEMM: the SIMT tile's scratch, one
/// area per warp.
pub const fn logits_simt_shared_bytes() -> u32 {
    TILE_KERNEL_WARPS * SIMT_WARP_SCRATCH_FLOATS * 4
}

/// Bytes of one row's pair of log-sum-exp terms ([`RowSums`]).
const ROW_SUMS_BYTES: u32 = core::mem::size_of::<RowSums>() as u32;
/// Dynamic shared memory of the unfused logits sampler: its candidate staging.
pub const LOGITS_SAMPLER_SHARED_BYTES: u32 = SAMPLES_PER_MERGE * TILE_KERNEL_WARPS * CANDIDATE_BYTES;
/// Dynamic shared memory of the merge kernel: a candidate, then a pair of log-sum-exp terms,
/// per warp.
pub const REDUCE_SHARED_BYTES: u32 = REDUCE_THREADS / 32 * (CANDIDATE_BYTES + ROW_SUMS_BYTES);

/// Warps of a TMA + `wgmma` kernel that compute: two warpgroups. A third warpgroup issues
/// the TMA loads (one thread of it).
pub const TMA_CONSUMER_WARPS: u32 = 8;
/// Rows of `W` one warpgroup's `wgmma` multiplies (its M).
pub const WARPGROUP_ROWS: u32 = 64;
/// Vocabulary rows per work item of a TMA kernel, its "item height" (one candidate per row,
/// draw and such tile):
/// - 64, ping-pong: each consumer warpgroup works on its own items, and one multiplies while
///   the other runs its sampling epilogue;
/// - 128, cooperative: both warpgroups multiply one item (64 rows each), then both run the
///   epilogue; half the `H` traffic per row of `W`.
pub const TMA_ITEM_ROWS: [u32; 2] = [64, 128];
/// Threads per block of a TMA + `wgmma` kernel: three warpgroups.
pub const TMA_THREADS: u32 = (TMA_CONSUMER_WARPS + 4) * 32;
/// Elements of `dim` per pipeline stage: one 128-byte row of the 128-byte swizzle.
pub const TMA_K_BLOCK: u32 = 64;
/// Shared memory the pipeline stages of a TMA kernel may fill.
pub const TMA_STAGE_BUDGET_BYTES: u32 = 192 << 10;
/// Most pipeline stages of a TMA kernel.
pub const TMA_MAX_STAGES: u32 = 16;

/// Bytes of `W` one stage holds: `rows` (the item height) × [`TMA_K_BLOCK`] 16-bit elements.
pub const fn tma_lm_head_stage_bytes(rows: u32) -> u32 {
    rows * TMA_K_BLOCK * 2
}

/// Bytes of `H` one stage holds for a batch tile of `columns`.
pub const fn tma_hidden_stage_bytes(columns: u32) -> u32 {
    columns * TMA_K_BLOCK * 2
}

/// Pipeline stages of a TMA kernel with items of `rows` × `columns`: as many as the budget
/// holds.
pub const fn tma_stages(rows: u32, columns: u32) -> u32 {
    let stages = TMA_STAGE_BUDGET_BYTES / (tma_lm_head_stage_bytes(rows) + tma_hidden_stage_bytes(columns));
    if stages < TMA_MAX_STAGES { stages } else { TMA_MAX_STAGES }
}

/// Dynamic shared memory of a TMA kernel: 1 KiB of slack to align the stages to the 1024-byte
/// swizzle atom, the `W` stages, the `H` stages, a full and an empty barrier per stage, a turn
/// barrier per consumer warpgroup, one candidate per (consumer warp, column) for the
/// cross-warp merge, and each consumer warpgroup's copy of its item's row parameters.
pub const fn tma_shared_bytes(rows: u32, columns: u32) -> u32 {
    let stages = tma_stages(rows, columns);
    1024 + stages * (tma_lm_head_stage_bytes(rows) + tma_hidden_stage_bytes(columns))
        + 2 * stages * 8
        + (TMA_CONSUMER_WARPS / 4) * 8
        + TMA_CONSUMER_WARPS * columns * CANDIDATE_BYTES
        + (TMA_CONSUMER_WARPS / 4) * columns * core::mem::size_of::<RowParams>() as u32
}

/// Dynamic shared memory one block of a multiprocessor may have on sm_90 (227 KiB).
pub const SM90_SHARED_LIMIT_BYTES: u32 = 227 << 10;
/// Vocabulary rows per work item of the handoff kernels: both consumer warpgroups multiply
/// one item (64 rows each), as in the cooperative schedule.
pub const HANDOFF_ROWS: u32 = 128;
/// Batch-tile widths of the handoff kernels.
pub const HANDOFF_COLUMNS: [u32; 2] = [64, 128];
/// Warps of a handoff kernel that run the sampling epilogue: warps 9..16 (warp 8 holds the
/// producer thread).
pub const HANDOFF_EPILOGUE_WARPS: u32 = 7;
/// Threads per block of a handoff kernel: two consumer warpgroups, the producer's warp and
/// the epilogue warps, four warpgroups in all.
pub const TMA_HANDOFF_THREADS: u32 = (TMA_CONSUMER_WARPS + 1 + HANDOFF_EPILOGUE_WARPS) * 32;
/// Floats per batch column of the handed-off logits in shared memory: the item's rows plus
/// 4, so the consumers' stores of one `wgmma` register hit 32 different banks.
pub const HANDOFF_COLUMN_STRIDE: u32 = HANDOFF_ROWS + 4;

/// Bytes of the handed-off f32 logits of one item (column-major, [`HANDOFF_COLUMN_STRIDE`]).
pub const fn handoff_logits_bytes(columns: u32) -> u32 {
    columns * HANDOFF_COLUMN_STRIDE * 4
}

/// Bytes of a handoff kernel's shared memory besides the stages and the logits: the
/// 1024-byte alignment slack and the barriers (a full and an empty barrier per stage, and
/// the logits buffer's full and empty barriers).
const HANDOFF_OTHER_BYTES: u32 = 1024 + 2 * TMA_MAX_STAGES * 8 + 2 * 8;

/// Pipeline stages of a handoff kernel with `columns`: as many as fit beside the logits.
pub const fn tma_handoff_stages(columns: u32) -> u32 {
    let room = SM90_SHARED_LIMIT_BYTES - HANDOFF_OTHER_BYTES - handoff_logits_bytes(columns);
    let stages = room / (tma_lm_head_stage_bytes(HANDOFF_ROWS) + tma_hidden_stage_bytes(columns));
    if stages < TMA_MAX_STAGES { stages } else { TMA_MAX_STAGES }
}

/// Dynamic shared memory of a handoff kernel: the stages, then the logits buffer, then the
/// barriers (see [`tma_handoff_stages`]).
pub const fn tma_handoff_shared_bytes(columns: u32) -> u32 {
    let stages = tma_handoff_stages(columns);
    1024 + stages * (tma_lm_head_stage_bytes(HANDOFF_ROWS) + tma_hidden_stage_bytes(columns))
        + handoff_logits_bytes(columns)
        + 2 * stages * 8
        + 2 * 8
}

/// Size of a [`TensorMap`].
pub const TENSOR_MAP_BYTES: usize = core::mem::size_of::<TensorMap>();

/// A TMA + `wgmma` kernel: the fused sampler (writes candidates as [`FusedArgs`] does) or the
/// unfused GEMM (writes f32 logits as [`LogitsArgs`] does). `W` and `H` are read through
/// tensor maps with boxes of [`TMA_K_BLOCK`] × item height and [`TMA_K_BLOCK`] × columns;
/// `tiles = ⌈vocab / item height⌉`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
#[cfg_attr(not(target_arch = "nvptx64"), derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct TmaArgs {
    /// The tensor map of `W[vocab, dim]`.
    pub lm_head_map: DevicePtr<TensorMap>,
    /// The tensor map of the whole `H`, box rows = the kernel's columns.
    pub hidden_map: DevicePtr<TensorMap>,
    /// `[batch]` row parameters (fused kernels).
    pub row_params: DevicePtr<RowParams>,
    /// Candidates (fused kernels) or f32 logits (GEMM).
    pub out: DevicePtr<TmaOutput>,
    /// `[batch]` rows' per-entry processing (fused kernels), or null for none.
    pub processing: DevicePtr<RowProcessing>,
    /// `[batch, tiles]` log-sum-exp terms of each (row, tile) (fused kernels that
    /// [write them](crate::registry::Kernel::writes_tile_sums); see [`FusedArgs::tile_sums`]), or null.
    pub tile_sums: DevicePtr<RowSums>,
    /// The GEMM's maxima ([`LogitsArgs::maxima`]), or null.
    pub maxima: DevicePtr<u32>,
    /// `[batch, tiles]` lists of each (row, tile)'s first processed entries
    /// ([`FusedArgs::tile_tops`]), written by the handoff tile (the other TMA tiles write
    /// none); null for none. A listing launch has no draws.
    pub tile_tops: DevicePtr<crate::truncation::TileTop>,
    /// Null, or the word that gates the launch (GEMM): it does nothing when the word is 0
    /// ([`LogitsArgs::gate`]).
    pub gate: DevicePtr<u32>,
    /// Rows of `W`: the vocabulary entries of the shard (of the whole vocabulary when
    /// unsharded). Entries at or past it take no part in the race or the terms, and the GEMM
    /// writes no quad that starts past it.
    pub vocab: u32,
    /// Columns of `W` and `H` (the hidden size): every item runs `⌈dim / TMA_K_BLOCK⌉`
    /// pipeline stages.
    pub dim: u32,
    /// Rows of `H` this launch covers, starting at `hidden_row0`.
    pub batch: u32,
    /// The row of `H` (in `hidden_map`, which spans all of `H`) that is this launch's batch
    /// row 0: a pass over some of a call's rows starts at its first row, while `row_params`,
    /// `processing` and `tile_sums` already point at that row.
    pub hidden_row0: u32,
    /// The global draw index of the launch's draw 0 (fused kernels): draw `j` races with the
    /// noise of draw `draw_offset + j` ([`crate::noise`]), so a call split into passes draws
    /// the noise of one launch over all its draws.
    pub draw_offset: u32,
    /// Draws per row in this launch (fused kernels): the candidates' middle dimension.
    pub samples: u32,
    /// Vocabulary tiles, `⌈vocab / item height⌉`: the work items are `tiles × ⌈batch /
    /// columns⌉`, and `tiles` is the last dimension of the candidates and of `tile_sums`.
    pub tiles: u32,
    /// Row stride of the logits in elements (GEMM), a multiple of 4 and at least `vocab`.
    pub logits_stride: u32,
    /// The global vocabulary index of `W`'s row 0 (fused kernels; see [`FusedArgs`]).
    pub vocab_offset: u32,
    /// Explicit tail padding (the block is 8-aligned), so that the block has no padding bytes.
    pub padding: u32,
}

/// The tile kernel's candidates are `[batch, samples, tiles]`: the candidates of one (row, draw) pair
/// lie together, so the merge kernel reads them contiguously. The pair of row `b` and draw `j` of a
/// launch of `samples` draws.
#[inline(always)]
pub const fn candidate_pair(b: u32, samples: u32, j: u32) -> u64 {
    b as u64 * samples as u64 + j as u64
}

/// The slot of `tile`'s candidate for a (row, draw) `pair` ([`candidate_pair`]).
#[inline(always)]
pub const fn candidate_slot(pair: u64, tiles: u32, tile: u32) -> u64 {
    pair * tiles as u64 + tile as u64
}

/// The tile kernel: `candidates[candidate_slot(candidate_pair(b, samples, j), tiles, tile)]`
/// for each batch row `b < batch`, draw `j < samples` (global draw index `draw_offset + j`)
/// and vocabulary tile.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
#[cfg_attr(not(target_arch = "nvptx64"), derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct FusedArgs {
    /// `W[vocab, dim]`, rows `lm_head_stride` elements apart, the element type of the kernel.
    pub lm_head: DevicePtr<Element>,
    /// `H[batch, dim]`, rows `hidden_stride` elements apart, same element type.
    pub hidden: DevicePtr<Element>,
    /// `[batch]` row parameters.
    pub row_params: DevicePtr<RowParams>,
    /// `[batch · samples · tiles]` candidates.
    pub candidates: DevicePtr<Candidate>,
    /// `[batch]` rows' per-entry processing, or null for none.
    pub processing: DevicePtr<RowProcessing>,
    /// `[batch, tiles]` log-sum-exp terms of each (row, tile): over the tile's raw logits at
    /// T = 1 and over its processed ones at the row's temperature (empty for a greedy row); null
    /// for none. A call asks for them in the launch of its first draws only.
    pub tile_sums: DevicePtr<RowSums>,
    /// `[batch, tiles]` lists of each (row, tile)'s first processed entries
    /// ([`crate::truncation::TileTop`]), from which the truncations can be decided without the
    /// row's logits; null for none. Written in the launch of a call's first draws only.
    pub tile_tops: DevicePtr<crate::truncation::TileTop>,
    /// The chain kernels' output: `[batch, samples, tiles]` chains of each (row, draw, tile)
    /// ([`crate::chain::Chain`], at [`candidate_slot`]), from which min-p rows are decided and
    /// drawn without their logits; null in every other kernel's launch.
    pub tile_chains: DevicePtr<crate::chain::Chain>,
    /// `[batch]` rows' processing whose min-p the chain kernels read for each warp's floor
    /// (whether or not the row has a per-entry step); null in every other kernel's launch.
    pub truncation: DevicePtr<RowProcessing>,
    /// Rows of `W`: the vocabulary entries of the shard (of the whole vocabulary when
    /// unsharded). Entries at or past it take no part in the race or the terms.
    pub vocab: u32,
    /// Columns of `W` and `H` (the hidden size): a multiple of 8 for the `mma.sync` tiles, any
    /// for the SIMT tile.
    pub dim: u32,
    /// Rows of `H` in this launch (a pass's rows: `hidden`, `row_params`, `processing` and
    /// `tile_sums` point at its first).
    pub batch: u32,
    /// The global draw index of the launch's draw 0: draw `j` races with the noise of draw
    /// `draw_offset + j` ([`crate::noise`]), so a call split into passes draws the noise of
    /// one launch over all its draws.
    pub draw_offset: u32,
    /// Draws per row in this launch: the candidates' middle dimension.
    pub samples: u32,
    /// Vocabulary tiles of [`TILE_ROWS`] rows, `⌈vocab / TILE_ROWS⌉`: the work items are
    /// `tiles × ⌈batch / columns⌉`, and `tiles` is the last dimension of the candidates and of
    /// `tile_sums`.
    pub tiles: u32,
    /// Elements from one row of `W` to the next (at least `dim`).
    pub lm_head_stride: u32,
    /// Elements from one row of `H` to the next (at least `dim`).
    pub hidden_stride: u32,
    /// The global vocabulary index of `W`'s row 0: 0 for a whole LM head, a vocabulary
    /// shard's offset (a multiple of [`SHARD_ALIGNMENT`]) otherwise. Noise, candidate indices
    /// and processing use global indices, so a shard's winners merge into the unsharded ones.
    pub vocab_offset: u32,
    /// Explicit tail padding (the block is 8-aligned), so that the block has no padding bytes.
    pub padding: u32,
}

/// A vocabulary shard's offset is a multiple of this: a thread's four consecutive rows then
/// stay one Philox block of the global vocabulary.
pub const SHARD_ALIGNMENT: u32 = crate::noise::ENTRIES_PER_BLOCK;

/// The unfused GEMM: `logits[b · logits_stride + i] = H[b]·W[i]` in f32.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
#[cfg_attr(not(target_arch = "nvptx64"), derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct LogitsArgs {
    /// Null, or the word that gates the launch: it does nothing when the word is 0 (the
    /// listed path's fallback, [`SampleListedArgs::unsettled`]).
    pub gate: DevicePtr<u32>,
    /// `W[vocab, dim]`, rows `lm_head_stride` elements apart, bf16 or f16 as the kernel's name
    /// says; 16-byte aligned, as are its rows (the tile loads 16 bytes at a time).
    pub lm_head: DevicePtr<Element>,
    /// `H[batch, dim]`, rows `hidden_stride` elements apart, same element type and alignment.
    pub hidden: DevicePtr<Element>,
    /// `[batch, logits_stride]` f32 logits, written in whole quads (16-byte stores), so a
    /// row's entries from `vocab` up to the next multiple of 4 may be overwritten too.
    pub logits: DevicePtr<f32>,
    /// Null, or `[batch, ⌈vocab / MAXIMA_ROWS⌉]`, written: each (row, run of
    /// [`MAXIMA_ROWS`] entries)'s largest [`extremum_key`](crate::process::extremum_key)
    /// among its entries below `vocab`.
    pub maxima: DevicePtr<u32>,
    /// Rows of `W`: the columns of `logits` computed.
    pub vocab: u32,
    /// Columns of `W` and `H` (the hidden size), a multiple of 8.
    pub dim: u32,
    /// Rows of `H`: the rows of `logits` written.
    pub batch: u32,
    /// Row stride of `logits` in elements, a multiple of 4 and at least `vocab`.
    pub logits_stride: u32,
    /// Row stride of `W` in elements, as in [`FusedArgs`].
    pub lm_head_stride: u32,
    /// Row stride of `H` in elements, as in [`FusedArgs`].
    pub hidden_stride: u32,
}

/// The unfused sampler over materialised logits; writes candidates like [`FusedArgs`].
#[repr(C)]
#[derive(Clone, Copy, Debug)]
#[cfg_attr(not(target_arch = "nvptx64"), derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct LogitsSamplerArgs {
    /// `[batch, logits_stride]` f32 logits the rows race with (on the processed path the
    /// processing pipeline's `processed`, −∞ for every dropped token), read in 16-byte quads.
    pub logits: DevicePtr<f32>,
    /// `[batch]` row parameters.
    pub row_params: DevicePtr<RowParams>,
    /// `[batch]` the rows' processing, with [`LogitsSamplerArgs::row_states`]; or null.
    pub processing: DevicePtr<RowProcessing>,
    /// `[batch]` the processing pipeline's row states after the rows' selections (one shard,
    /// no exchange), or null. When set, each row races only the entries its keep rule keeps,
    /// the rest as −∞: what the pipeline's `Apply` step would have written, which a call
    /// without log-probabilities then skips (one read and one write of every logit fewer).
    pub row_states: DevicePtr<ProcessRowState>,
    /// `[batch · samples · tiles]` candidates, written in [`FusedArgs::candidates`]' layout
    /// ([`candidate_slot`]).
    pub candidates: DevicePtr<Candidate>,
    /// Logits per row that race (a shard's vocabulary entries); entries past it do not.
    pub vocab: u32,
    /// Floats from one row of `logits` to the next: a multiple of 4 (so every quad is 16-byte
    /// aligned) and at least `vocab`.
    pub logits_stride: u32,
    /// Rows in this launch (a pass's rows: `logits` and `row_params` point at its first).
    pub batch: u32,
    /// The global draw index of the launch's draw 0, as [`FusedArgs::draw_offset`].
    pub draw_offset: u32,
    /// Draws per row in this launch: the candidates' middle dimension.
    pub samples: u32,
    /// Tiles of [`LOGITS_SAMPLER_TILE`] entries per row, `⌈vocab / LOGITS_SAMPLER_TILE⌉`: one
    /// block per (row, tile) item, one candidate per (row, draw, tile).
    pub tiles: u32,
    /// The global vocabulary index of the logits' column 0 (see [`FusedArgs`]).
    pub vocab_offset: u32,
    /// Explicit tail padding (the block is 8-aligned), so that the block has no padding bytes.
    pub padding: u32,
}

/// The merge kernel: the winner over tiles of each (row `b`, draw `j`), written at slot
/// `b · token_stride + draw_offset + j` of `tokens` (its index: a token,
/// [`NO_TOKEN`](crate::NO_TOKEN) or [`NON_FINITE_TOKEN`](crate::NON_FINITE_TOKEN)) or, when
/// `winners` is not null, of `winners` (a vocabulary shard's [`ShardWinner`]; `tokens` unread).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
#[cfg_attr(not(target_arch = "nvptx64"), derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct ReduceArgs {
    /// `[batch · samples · tiles]` candidates (the pass's tile kernel's or logits sampler's),
    /// the tiles of one (row, draw) side by side ([`candidate_slot`]).
    pub candidates: DevicePtr<Candidate>,
    /// `[batch, token_stride]` token slots, written when `winners` is null.
    pub tokens: DevicePtr<u32>,
    /// `[batch, token_stride]` shard winners, written instead of `tokens` when not null.
    pub winners: DevicePtr<ShardWinner>,
    /// `[batch, logits_stride]` raw and processed logits of the shard (its column 0 at global
    /// index `vocab_offset`), from which the winners take their logits; null: NaN logits.
    pub raw: DevicePtr<f32>,
    /// Null with `raw` not null: the processed logit is the raw one.
    pub processed: DevicePtr<f32>,
    /// `[batch]` row parameters (their temperatures merge the per-tile terms).
    pub row_params: DevicePtr<RowParams>,
    /// `[batch, sum_parts]` log-sum-exp terms of the parts of each row (the fused tiles'
    /// tiles, [`FusedArgs::tile_sums`] and [`TmaArgs::tile_sums`], or the processing
    /// pipeline's slices, [`ProcessArgs::slice_sums`]), merged in part order into `sums[b]` by
    /// the block of each row's draw 0; null: none.
    pub part_sums: DevicePtr<RowSums>,
    /// `[batch]` rows' merged log-sum-exp terms, written when `part_sums` is not null.
    pub sums: DevicePtr<RowSums>,
    /// Rows in this launch (a pass's rows: every per-row pointer points at its first).
    pub batch: u32,
    /// Draws per row in this launch: one block per (row, draw) item, `batch · samples` in all.
    pub samples: u32,
    /// Candidates per (row, draw): the `tiles` of the kernel that wrote them.
    pub tiles: u32,
    /// The slot of the launch's draw 0 in a row of `tokens` or `winners`: the pass's first
    /// draw within the call. A slot, not a noise index (this kernel draws no noise).
    pub draw_offset: u32,
    /// Slots per row of `tokens` and `winners`: the call's draws per row.
    pub token_stride: u32,
    /// Floats from one row of `raw` and `processed` to the next; a winner whose column is not
    /// below it gets NaN logits.
    pub logits_stride: u32,
    /// The global index of column 0 of `raw` and `processed`: a winner's column is its index
    /// minus this.
    pub vocab_offset: u32,
    /// Parts per row in `part_sums` (the fused call's tiles or the pipeline's slices).
    pub sum_parts: u32,
}

/// A vocabulary shard's winner of one (row, draw) with the token's raw and processed logits
/// (NaN where the shard materialised none, or when the winner is not a token): all the shard
/// merge needs of it besides the row's log-sum-exp terms.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
#[cfg_attr(not(target_arch = "nvptx64"), derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct ShardWinner {
    /// The shard's best candidate of the (row, draw): its index is a global token index,
    /// [`NO_TOKEN`](crate::NO_TOKEN) or [`NON_FINITE_TOKEN`](crate::NON_FINITE_TOKEN).
    pub candidate: Candidate,
    /// The token's raw logit, or NaN.
    pub raw: f32,
    /// The token's processed logit (after the row's processing, before the temperature), or
    /// NaN.
    pub processed: f32,
}

impl ShardWinner {
    /// "No token", with no logits.
    pub const NONE: ShardWinner = ShardWinner { candidate: Candidate::NONE, raw: f32::NAN, processed: f32::NAN };

    /// The winner of two shards by [`Candidate::merge`]'s rule, with its own logits.
    #[inline(always)]
    pub fn merge(self, other: ShardWinner) -> ShardWinner {
        if self.candidate.merge(other.candidate) == self.candidate { self } else { other }
    }
}

/// The winners' logits of a fused call with log-probabilities: for each of `[batch · samples]`
/// [`ShardWinner`]s whose index is a token of the shard, `raw = H[b]·W[index − vocab_offset]`
/// (one dot product per winner, in f64) and `processed` = that logit after the row's
/// per-entry steps (`processing`, or the raw one when null). The fused tiles keep no logits:
/// a shard's winners take theirs here for the shard merge, and an unsharded call (`tokens`
/// not null) ends here, writing what the shard merge of its one part would.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
#[cfg_attr(not(target_arch = "nvptx64"), derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct WinnerLogitsArgs {
    /// The shard's `W[vocab, dim]`, rows `lm_head_stride` elements apart.
    pub lm_head: DevicePtr<Element>,
    /// `H[batch, dim]`, rows `hidden_stride` elements apart, same element type.
    pub hidden: DevicePtr<Element>,
    /// `[batch · samples]` winners the merge kernel wrote; a shard's get their `raw` and
    /// `processed` logits written here.
    pub winners: DevicePtr<ShardWinner>,
    /// `[batch]` rows' per-entry processing, which turns the raw logit into the processed one;
    /// null: the processed logit is the raw one.
    pub processing: DevicePtr<RowProcessing>,
    /// Null for a shard (the winners get their logits). Otherwise the unsharded call's `[batch,
    /// samples]` tokens and log-probabilities (raw, processed) from each row's merged terms
    /// `sums` (`[batch]`) and `row_params`, and, unless `top` is null, its `[batch,
    /// MAX_TOP_LOGPROBS]` top entries, all empty (a fused call has none).
    pub tokens: DevicePtr<u32>,
    /// With `tokens`: `[batch, samples]` raw log-probabilities (T = 1), written unless null.
    pub logprobs: DevicePtr<f32>,
    /// With `tokens` and `logprobs`: `[batch, samples]` log-probabilities under the
    /// distribution each token was drawn from (0 for a greedy row), written.
    pub processed_logprobs: DevicePtr<f32>,
    /// With `tokens`: `[batch, MAX_TOP_LOGPROBS]` top entries, each written as
    /// [`TopLogprob::NONE`]; null: none.
    pub top: DevicePtr<TopLogprob>,
    /// With `tokens`: `[batch]` rows' merged log-sum-exp terms (the merge kernel's), read.
    pub sums: DevicePtr<RowSums>,
    /// `[batch]` row parameters: with `tokens`, the temperatures and greedy flags of the
    /// log-probabilities.
    pub row_params: DevicePtr<RowParams>,
    /// Rows of `W` (the shard's tokens): a winner whose index is not in `vocab_offset ..
    /// vocab_offset + vocab` gets no logits.
    pub vocab: u32,
    /// Columns of `W` and `H`: the length of each dot product.
    pub dim: u32,
    /// Rows of `H`.
    pub batch: u32,
    /// Draws per row: the winners are `[batch, samples]`, one block each.
    pub samples: u32,
    /// Elements from one row of `W` to the next (at least `dim`).
    pub lm_head_stride: u32,
    /// Elements from one row of `H` to the next (at least `dim`).
    pub hidden_stride: u32,
    /// The global index of `W`'s row 0 (see [`FusedArgs`]).
    pub vocab_offset: u32,
    /// Explicit tail padding (the block is 8-aligned), so that the block has no padding bytes.
    pub padding: u32,
}

/// One of a shard's top raw entries: a global token index and its raw logit (`token =
/// NO_TOKEN` in unused slots). The shard merge turns the best of all shards' into
/// [`TopLogprob`]s with the row's merged log-sum-exp.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
#[cfg_attr(not(target_arch = "nvptx64"), derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct RawTop {
    /// The global token index, or `NO_TOKEN` in an unused slot.
    pub token: u32,
    /// The token's raw logit; −∞ in an unused slot.
    pub logit: f32,
}

/// What one vocabulary shard hands to the merge, in one block of bytes per shard (so that a
/// collective can gather the shards' blocks side by side): `[batch · samples]`
/// [`ShardWinner`]s, then, with log-probabilities, `[batch]` [`RowSums`] and `[batch,
/// MAX_TOP_LOGPROBS]` [`RawTop`]s.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShardPartLayout {
    /// Byte offset of the row sums (equal to `bytes` without log-probabilities).
    pub sums: u64,
    /// Byte offset of the top entries.
    pub top: u64,
    /// Bytes of one shard's part, a multiple of 16.
    pub bytes: u64,
}

impl ShardPartLayout {
    /// The layout of a part of `batch` rows of `samples` draws each, with or without
    /// log-probabilities.
    pub const fn of(batch: u32, samples: u32, logprobs: bool) -> ShardPartLayout {
        let winners = batch as u64 * samples as u64 * core::mem::size_of::<ShardWinner>() as u64;
        if !logprobs {
            let bytes = winners.next_multiple_of(16);
            return ShardPartLayout { sums: bytes, top: bytes, bytes };
        }
        let top = winners + batch as u64 * core::mem::size_of::<RowSums>() as u64;
        let end = top + batch as u64 * crate::process::MAX_TOP_LOGPROBS as u64 * core::mem::size_of::<RawTop>() as u64;
        ShardPartLayout { sums: winners, top, bytes: end.next_multiple_of(16) }
    }
}

/// The shard merge: `shards` parts of `layout` bytes each, side by side from `parts`, become
/// the `[batch, samples]` tokens and, when the parts have log-probabilities (and
/// `logprobs` is not null), the tokens' raw and processed log-probabilities (same layout),
/// and per row its top raw log-probabilities (`[batch, MAX_TOP_LOGPROBS]`, as many as the
/// row's processing asks for).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
#[cfg_attr(not(target_arch = "nvptx64"), derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct ShardMergeArgs {
    /// The `shards` parts, each `part_bytes` long (and 16-byte aligned), side by side.
    pub parts: DevicePtr<u8>,
    /// `[batch]` row parameters: the temperatures and greedy flags of the log-probabilities.
    pub row_params: DevicePtr<RowParams>,
    /// `[batch]` processing blocks (for the top counts), or null for none.
    pub processing: DevicePtr<RowProcessing>,
    /// `[batch, samples]` tokens, written.
    pub tokens: DevicePtr<u32>,
    /// `[batch, samples]` raw log-probabilities (T = 1), written; null: the parts have no
    /// log-probabilities, and no log-probability is written.
    pub logprobs: DevicePtr<f32>,
    /// `[batch, samples]` log-probabilities under the distribution each token was drawn from
    /// (0 for a greedy row), written with `logprobs`.
    pub processed_logprobs: DevicePtr<f32>,
    /// `[batch, MAX_TOP_LOGPROBS]` top raw log-probabilities, written with `logprobs` unless
    /// null: the row's `top_logprobs` best of every shard's entries, then
    /// [`TopLogprob::NONE`]s.
    pub top: DevicePtr<TopLogprob>,
    /// Byte offset of the row sums within a part ([`ShardPartLayout::sums`]).
    pub part_sums: u64,
    /// Byte offset of the top entries within a part ([`ShardPartLayout::top`]).
    pub part_top: u64,
    /// Bytes of one part ([`ShardPartLayout::bytes`]): shard `s`'s part starts
    /// `s · part_bytes` after `parts`.
    pub part_bytes: u64,
    /// Parts in `parts`; their log-sum-exp terms merge in shard order.
    pub shards: u32,
    /// Rows.
    pub batch: u32,
    /// Draws per row: one thread per (row, draw), `batch · samples` in all.
    pub samples: u32,
    /// Explicit tail padding (the block is 8-aligned), so that the block has no padding bytes.
    pub padding: u32,
}

/// One row's processing as the processing kernel and the fused tiles read it (see
/// [`crate::process`]); null pointers, `top_k = 0`, `top_p = 1`, `min_p = 0` and
/// `softcap = 0` change nothing. The fused tiles apply only the per-entry steps: the host
/// hands them rows whose truncations are off.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
#[cfg_attr(not(target_arch = "nvptx64"), derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct RowProcessing {
    /// `⌈vocab / 32⌉` mask words (xgrammar's layout), or null for no mask.
    pub mask: DevicePtr<u32>,
    /// `sparse_len` entries, one per listed token (each token at most once), by increasing
    /// token.
    pub sparse: DevicePtr<SparseEntry>,
    /// `⌈vocab / SPARSE_BLOCK⌉ + 1` offsets into `sparse`: block `k`'s entries are
    /// `sparse[blocks[k] .. blocks[k + 1]]` (see [`crate::process::SPARSE_BLOCK`]).
    pub sparse_blocks: DevicePtr<u32>,
    /// Entries in `sparse`; 0: no listed token (`sparse` and `sparse_blocks` are then not
    /// read).
    pub sparse_len: u32,
    /// The soft-cap, 0 for none.
    pub softcap: f32,
    /// min-p, in `[0, 1]`, 0 for none: a sampling row keeps the entries at or above
    /// [`crate::process::min_p_threshold`] of its largest processed logit.
    pub min_p: f32,
    /// top-p, in `(0, 1]`, 1 for none: of the entries min-p and top-k keep, a sampling row
    /// keeps the shortest prefix by decreasing processed logit, then increasing index, whose
    /// integer mass reaches [`crate::process::top_p_target`] of their total.
    pub top_p: f32,
    /// top-k, 0 for none: of the entries min-p keeps, a sampling row keeps those at or above
    /// the k-th largest processed logit (ties kept).
    pub top_k: u32,
    /// The history penalties, applied to the listed tokens whose count is not 0
    /// ([`crate::process::sparse_step`]).
    pub penalties: Penalties,
    /// How many of the row's top raw log-probabilities to write (at most
    /// [`crate::process::MAX_TOP_LOGPROBS`]).
    pub top_logprobs: u32,
    /// Explicit tail padding (the block is 8-aligned), so that the block has no padding bytes.
    pub padding: u32,
}

/// One of a row's top raw log-probabilities: a token and its log-probability under the raw
/// logits at T = 1; `token = NO_TOKEN` in the slots past the row's count.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
#[cfg_attr(not(target_arch = "nvptx64"), derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct TopLogprob {
    /// The global token index, or `NO_TOKEN` past the row's count.
    pub token: u32,
    /// The token's log-probability under the raw logits at T = 1; −∞ past the row's count.
    pub logprob: f32,
}

impl TopLogprob {
    /// An unused slot.
    pub const NONE: TopLogprob = TopLogprob { token: crate::NO_TOKEN, logprob: f32::NEG_INFINITY };
}

/// The log-sum-exp terms of one processed row: over the raw logits at T = 1 and over the kept
/// processed logits at the row's temperature (empty for a greedy row).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
#[cfg_attr(not(target_arch = "nvptx64"), derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct RowSums {
    /// Over the raw logits at T = 1: the raw log-probabilities and the top entries'.
    pub raw: LogSumExp,
    /// Over the kept processed logits at the row's temperature: the processed
    /// log-probabilities (empty for a greedy row).
    pub kept: LogSumExp,
}

/// The processing pipeline over materialised rows: launches of the processing kernel, one
/// [`ProcessStep`] each, over a grid of (row, slice) items (`slices` slices of every row, in
/// whole quads), turn `raw[b]` into `processed[b]` (the logits the row races with, −∞ for
/// every dropped token), write each slice's log-sum-exp terms and each row's top raw entries.
/// Without log-probabilities `slice_sums` is null and `processed` may be `raw` (processed in
/// place).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
#[cfg_attr(not(target_arch = "nvptx64"), derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct ProcessArgs {
    /// `[batch, logits_stride]` raw logits.
    pub raw: DevicePtr<f32>,
    /// `[batch, logits_stride]`, written.
    pub processed: DevicePtr<f32>,
    /// `[batch]` row parameters: the temperatures and greedy flags behind min-p's cut, top-p's
    /// masses and the kept terms.
    pub row_params: DevicePtr<RowParams>,
    /// `[batch]` rows' processing blocks, read for every row (never null).
    pub processing: DevicePtr<RowProcessing>,
    /// `[batch]` rows' selection state, zeroed before the pipeline's first step.
    pub state: DevicePtr<ProcessRowState>,
    /// `[batch, slices]` log-sum-exp terms of each (row, slice), written (raw terms by
    /// [`ProcessStep::Entries`], kept ones by [`ProcessStep::Apply`]); the merge kernel merges
    /// them in slice order. Null: no terms.
    pub slice_sums: DevicePtr<RowSums>,
    /// `[batch, MAX_TOP_LOGPROBS]`, each row's top raw entries by decreasing logit, then
    /// increasing index, as many as the row asks for (needs `slice_sums`); null: none.
    pub top: DevicePtr<RawTop>,
    /// Logits per row (a shard's vocabulary entries); the rest of a row, up to
    /// `logits_stride`, is padding, which [`ProcessStep::Entries`] sets to −∞ in `processed`
    /// (the logits sampler loads whole quads).
    pub vocab: u32,
    /// Floats from one row of `raw` and `processed` to the next: a multiple of 4 (16-byte
    /// quads) and at least `vocab`.
    pub logits_stride: u32,
    /// Rows: a launch's items are the `batch · slices` (row, slice) pairs, or the `batch` rows
    /// for [`ProcessStep::Decide`].
    pub batch: u32,
    /// The global vocabulary index of the logits' column 0 (a shard's offset): mask bits,
    /// sparse entries and the written indices are global.
    pub vocab_offset: u32,
    /// Slices per row, `1 ≤ slices ≤ ⌈vocab / 4⌉`: a row's quads split into runs of
    /// `⌈quads / slices⌉` (the last ones may be short or empty), one block per (row, slice).
    pub slices: u32,
    /// The launch's [`ProcessStep`].
    pub step: u32,
    /// With [`ProcessStep::Select`] and [`ProcessStep::Decide`]: the [`Selection`] and its
    /// digit (0 = most significant).
    pub selection: u32,
    /// With those steps: the digit of `selection`, 0 to `SELECT_DIGITS − 1`, most significant
    /// first (bits `24 − 8·digit .. 32 − 8·digit` of the key), or [`COARSE_DIGIT`].
    pub digit: u32,
    /// A vocabulary shard's exchange with the other shards ([`ShardExchangeLayout`]): its
    /// `[2, batch]` extrema (each row's largest `order_key`, then its non-finite flag), which
    /// [`ProcessStep::Entries`] merges in and every later step reads instead of the row
    /// state's; null when the logits are the whole row (the selections decide alone).
    pub exchange_extrema: DevicePtr<u32>,
    /// With an exchange and a [`Selection::exchanged`] selection: the `[batch,
    /// SELECT_BUCKETS]` histograms of this launch's digit, which [`ProcessStep::Select`] adds
    /// to and [`ProcessStep::Decide`] reads once every shard's adds are in.
    pub exchange_histogram: DevicePtr<u64>,
    /// `[batch, MEMBER_CAPACITY]` column indices: the members a selection's
    /// [`ProcessStep::Gather`] lists for its [`ProcessStep::Resolve`].
    pub members: DevicePtr<u32>,
    /// The GEMM's `[batch, ⌈vocab / MAXIMA_ROWS⌉]` maxima ([`LogitsArgs::maxima`]), which
    /// [`ProcessStep::Extrema`] reads; null without that step.
    pub maxima: DevicePtr<u32>,
}

impl ProcessArgs {
    /// Whether the launch's shard exchanges its rows' extrema and histograms with the other
    /// shards ([`ProcessArgs::exchange_extrema`] set).
    #[inline(always)]
    pub fn exchanges(&self) -> bool {
        self.exchange_extrema.address() != 0
    }
}

/// What one launch of the processing kernel does ([`ProcessArgs::step`]). A pipeline runs
/// `Entries`, then the digits of the selections any row needs (in [`Selection`] order), then
/// `Apply`. A selection its shard decides alone ([`Selection::listed`]) runs its
/// [`Selection::leading_digits`], then `Gather` and `Resolve`, which also make its tie
/// selection.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProcessStep {
    /// The per-entry steps, the raw log-sum-exp terms, the row's largest processed logit.
    Entries = 0,
    /// One 8-bit digit of one selection (or its coarse key, [`COARSE_DIGIT`]): a histogram of
    /// the slice's members added to the row's, and the last slice to finish picks the digit
    /// (with an exchange, a truncation's digit is picked by [`ProcessStep::Decide`]
    /// instead).
    Select = 1,
    /// The keep rule: dropped entries set to −∞, the kept terms, the top raw entries.
    Apply = 2,
    /// With an exchange: one block per row picks a digit of a [`Selection::exchanged`]
    /// selection from the histograms every shard added to.
    Decide = 3,
    /// After a selection's [`Selection::leading_digits`]: each slice lists the column indices
    /// of its entries still in play (the decided coarse key, or the key's decided prefix) in
    /// the row's [`ProcessArgs::members`], the first [`MEMBER_CAPACITY`] of them, counting
    /// all.
    Gather = 4,
    /// One block per row finishes a selection from its gathered members, or from the whole row
    /// where they were more than [`MEMBER_CAPACITY`]: its remaining digits, then its tie
    /// selection's, each as [`ProcessStep::Select`] would pick them.
    Resolve = 5,
    /// In place of [`ProcessStep::Entries`] for rows without per-entry steps, terms or an
    /// exchange (the logits are the processed ones, in place): one block per row takes the
    /// row's largest logit and non-finite flag from the GEMM's [`ProcessArgs::maxima`], a read
    /// of a sixteenth of a word per entry where `Entries` reads the row, and sets the row's
    /// padding to −∞ as `Entries` does.
    Extrema = 6,
}

/// Entries per word of the GEMM's maxima ([`LogitsArgs::maxima`]): the rows a warp's lanes
/// that hold one column share in every logits tile.
pub const MAXIMA_ROWS: u32 = 16;

/// Words of the GEMM's maxima per row of `vocab` entries ([`LogitsArgs::maxima`]).
#[inline(always)]
pub const fn maxima_per_row(vocab: u32) -> u32 {
    vocab.div_ceil(MAXIMA_ROWS)
}

/// Digits of its key a [`Selection::listed`] selection without a coarse key decides over the
/// row before its members are gathered: after two, the members share 16 bits of their key,
/// and the later digits and the tie selection read them instead of the row.
pub const LISTED_AFTER_DIGITS: u32 = 2;

/// The [`ProcessArgs::digit`] of a selection's coarse key
/// ([`coarse_key`](crate::process::coarse_key)): one histogram of 256 buckets of equal width
/// in logit below the row's largest, where a truncation's cut lies among few entries of the
/// row (for top-p 0.9 over the benchmark's rows at V = 151,936 and D = 4096, about 1,700), so
/// that its members can be gathered after one pass over the row where the key's digits take
/// two (its leading byte holds a few octaves of logits).
pub const COARSE_DIGIT: u32 = SELECT_DIGITS;

/// The bit shift of a digit's bucket in its member keys: the coarse key's and digit 0's in
/// the leading byte.
pub const fn digit_shift(digit: u32) -> u32 {
    if digit == COARSE_DIGIT { 24 } else { 24 - 8 * digit }
}

/// Members a row's list holds ([`ProcessStep::Gather`]); a row with more resolves over its
/// whole row.
pub const MEMBER_CAPACITY: u32 = 4096;

/// The order statistics a row may need, each found by a radix selection over
/// `crate::process::order_key`, four 8-bit digits, in this order (each may use the ones
/// before it).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Selection {
    /// The k-th largest kept processed logit.
    TopK = 0,
    /// The last key of top-p's prefix, by top-p's integer masses.
    TopP = 1,
    /// Among the entries tied at top-p's last key, the index where its prefix ends.
    TopPTie = 2,
    /// The n-th largest raw logit (the top log-probabilities).
    TopRaw = 3,
    /// Among the raw entries tied at that logit, the index of the n-th.
    TopRawTie = 4,
}

impl Selection {
    /// Every selection, in the order a pipeline runs them.
    pub const ALL: [Selection; 5] =
        [Selection::TopK, Selection::TopP, Selection::TopPTie, Selection::TopRaw, Selection::TopRawTie];

    /// The selection of a [`ProcessArgs::selection`] value.
    pub const fn from_u32(value: u32) -> Option<Selection> {
        match value {
            0 => Some(Selection::TopK),
            1 => Some(Selection::TopP),
            2 => Some(Selection::TopPTie),
            3 => Some(Selection::TopRaw),
            4 => Some(Selection::TopRawTie),
            _ => None,
        }
    }

    /// The selection's bit in [`ProcessRowState::found`] and [`ProcessRowState::ended`].
    pub const fn bit(self) -> u32 {
        1 << self as u32
    }

    /// Whether a pipeline (with an exchange or without) decides the selection by listing its
    /// members after [`LISTED_AFTER_DIGITS`] digits: every selection its shard decides alone
    /// but the tie selections, which the parent's [`ProcessStep::Resolve`] makes.
    pub const fn listed(self, exchange: bool) -> bool {
        let tie = matches!(self, Selection::TopPTie | Selection::TopRawTie);
        !(tie || exchange && self.exchanged())
    }

    /// Whether a pipeline (with an exchange or without) decides the selection's leading digit
    /// by its [`COARSE_DIGIT`]: the listed truncations, whose rows have a largest processed
    /// logit to measure from (the top raw entries need not).
    pub const fn coarse(self, exchange: bool) -> bool {
        self.listed(exchange) && matches!(self, Selection::TopK | Selection::TopP)
    }

    /// The digits a [`Selection::listed`] selection decides over the whole row before its
    /// [`ProcessStep::Gather`], and the first of its key's digits its [`ProcessStep::Resolve`]
    /// decides: its coarse key and then every digit, or its first
    /// [`LISTED_AFTER_DIGITS`] and then the rest.
    pub const fn leading_digits(self, exchange: bool) -> (core::ops::Range<u32>, u32) {
        match self.coarse(exchange) {
            true => (COARSE_DIGIT..COARSE_DIGIT + 1, 0),
            false => (0..LISTED_AFTER_DIGITS, LISTED_AFTER_DIGITS),
        }
    }

    /// The tie selection a selection's [`ProcessStep::Resolve`] makes after it.
    pub const fn tie(self) -> Option<Selection> {
        match self {
            Selection::TopP => Some(Selection::TopPTie),
            Selection::TopRaw => Some(Selection::TopRawTie),
            Selection::TopK | Selection::TopPTie | Selection::TopRawTie => None,
        }
    }

    /// Whether vocabulary shards decide the selection together (a truncation: its cut is a
    /// property of the whole row) rather than each over its own entries (the top raw entries,
    /// which the shard merge merges).
    pub const fn exchanged(self) -> bool {
        matches!(self, Selection::TopK | Selection::TopP | Selection::TopPTie)
    }
}

/// Where a vocabulary shard's exchange buffer holds what the shards of a row share before
/// they can apply its truncations (byte offsets): the `[2, batch]` `u32` extrema (largest
/// `order_key`, non-finite flag) at 0, then one `[batch, SELECT_BUCKETS]` `u64` histogram per
/// exchanged digit, each reduced once (so that the buffer is cleared once per call). Shards
/// reduce the extrema by maximum and the histograms by sum; integer sums make the decisions
/// independent of the order of the shards.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShardExchangeLayout {
    /// Rows.
    pub batch: u32,
    /// Exchanged digits: [`SELECT_DIGITS`] per exchanged selection some row needs.
    pub digits: u32,
    /// Byte offset of the first histogram (the extrema rounded up to 16 bytes).
    pub histograms: u64,
    /// Bytes of the whole buffer.
    pub bytes: u64,
}

impl ShardExchangeLayout {
    /// The layout for `batch` rows and the selections of `selections` ([`Selection::bit`]s).
    pub const fn of(batch: u32, selections: u32) -> ShardExchangeLayout {
        let mut digits = 0;
        let mut k = 0;
        while k < Selection::ALL.len() {
            let s = Selection::ALL[k];
            if s.exchanged() && selections & s.bit() != 0 {
                digits += SELECT_DIGITS;
            }
            k += 1;
        }
        let histograms = (2 * batch as u64 * 4).next_multiple_of(16);
        let histogram_bytes = batch as u64 * SELECT_BUCKETS as u64 * 8;
        ShardExchangeLayout { batch, digits, histograms, bytes: histograms + digits as u64 * histogram_bytes }
    }

    /// Byte offset of the histogram of the `k`-th exchanged digit (in [`Selection`] order,
    /// then digit order).
    pub const fn histogram(&self, k: u32) -> u64 {
        self.histograms + k as u64 * self.batch as u64 * SELECT_BUCKETS as u64 * 8
    }
}

/// Digits of a selection: four 8-bit digits of a 32-bit key.
pub const SELECT_DIGITS: u32 = 4;

/// One row's state between the launches of the processing pipeline (zeroed before the first).
/// The slices of a row add into `histogram`; the last slice of a launch to finish (counted by
/// `arrivals`) decides the digit, records the selection's outcome and clears both for the next
/// launch. A whole multiple of 128 bytes, so that no two rows share a cache line.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ProcessRowState {
    /// The running digit's histogram: per bucket the weight (a count, or top-p's integer
    /// mass) of the row's members in it. With an exchange, an exchanged selection adds to the
    /// exchange's histogram instead.
    pub histogram: [u64; SELECT_BUCKETS as usize],
    /// The running selection: the weight above its key prefix, and its target.
    pub above: u64,
    /// The weight the running selection's members at or above its key must reach, set at its
    /// digit 0: top-k's k, top-p's target mass, a tie selection's `tie_goal` or the number
    /// of top raw entries.
    pub target: u64,
    /// The target of the next tie selection, set when its parent finds its key.
    pub tie_goal: u64,
    /// The running selection's key prefix (its decided digits).
    pub prefix: u32,
    /// The row's slices that have finished this launch's step; the last to arrive sets it back
    /// to 0.
    pub arrivals: u32,
    /// `order_key` of the row's largest processed logit (rows with truncations).
    pub max_key: u32,
    /// Non-zero when a processed logit is NaN or +∞ (rows with truncations).
    pub non_finite: u32,
    /// [`Selection::bit`]s of the selections that found their key.
    pub found: u32,
    /// [`Selection::bit`]s of the selections that do not run: their members weigh less than
    /// the target, or (a tie selection) its parent's tied entries are all kept.
    pub ended: u32,
    /// Per [`Selection`], what it found: a key, or for the tie selections an index.
    pub keys: [u32; 5],
    /// The row's top raw entries as the slices gather them: their count, then the entries.
    pub top_count: u32,
    /// The gathered entries in arrival order (at most `MAX_TOP_LOGPROBS`), which the row's
    /// last slice sorts into [`ProcessArgs::top`].
    pub top: [RawTop; crate::process::MAX_TOP_LOGPROBS as usize],
    /// The running selection's members [`ProcessStep::Gather`] found (all of them, listed or
    /// not); its [`ProcessStep::Resolve`] sets it back to 0.
    pub members: u32,
    /// The running selection's decided coarse key ([`COARSE_DIGIT`]).
    pub coarse: u32,
    /// Padding to a whole multiple of 128 bytes.
    pub padding: [u32; 4],
}

const _: () = assert!(core::mem::size_of::<ProcessRowState>().is_multiple_of(128));

/// Threads per block of the processing kernel: a thread per bucket of a digit's histogram.
pub const PROCESS_THREADS: u32 = 256;
/// Buckets of one radix digit in the processing kernel's selections (8 bits).
pub const SELECT_BUCKETS: u32 = 256;
/// Dynamic shared memory of the processing kernel: per warp a `u64` per bucket, then a
/// log-sum-exp pair, a maximum and a flag word per warp for the block's reductions, then the
/// last-to-arrive flag and a count, then a digit's decision (five words), then a row's
/// histogram of one digit (`u64` per bucket) for the steps with one block per row, then
/// top-p's table of units per coarse bucket (`f32` per bucket).
pub const PROCESS_SHARED_BYTES: u32 =
    (PROCESS_THREADS / 32) * (SELECT_BUCKETS * 8 + 16) + 8 + 5 * 8 + SELECT_BUCKETS * 8 + 256 * 4;

const _: () = assert!(PROCESS_THREADS >= SELECT_BUCKETS);

/// Fills `count` elements at `out` with values uniform in `[-scale, scale)` drawn from Philox
/// under `seed` (benchmark and demo inputs; never zeros).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
#[cfg_attr(not(target_arch = "nvptx64"), derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct FillArgs {
    /// The `count` elements written, of the kernel's element type.
    pub out: DevicePtr<Element>,
    /// Elements to write.
    pub count: u64,
    /// The Philox key of the values ([`crate::noise::key`]): the same seed gives the same
    /// values.
    pub seed: u64,
    /// Half the range's width: values are uniform in `[-scale, scale)` before rounding to the
    /// element type.
    pub scale: f32,
    /// Explicit tail padding (the block is 8-aligned), so that the block has no padding bytes.
    pub padding: u32,
}

/// Reads `bytes` (a multiple of 64) from `source` with 16-byte loads; a checksum that is never
/// written in practice keeps the loads alive.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
#[cfg_attr(not(target_arch = "nvptx64"), derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct ReadProbeArgs {
    /// The bytes read, 16-byte aligned.
    pub source: DevicePtr<u8>,
    /// Bytes to read, a multiple of 64.
    pub bytes: u64,
    /// One `u32`, where the checksum would be written.
    pub sink: DevicePtr<u32>,
}

/// Multiplies register fragments with `mma.sync` m16n8k16 (bf16 inputs, f32 accumulators)
/// and nothing else: the tensor cores' `mma.sync` peak, beside which the tiles' rates are
/// read. [`MMA_PEAK_UNITS`] units of work, [`MMA_PEAK_UNIT_MMAS`] multiplies each, spread
/// over the grid's warps; a checksum that is never written in practice keeps them alive.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
#[cfg_attr(not(target_arch = "nvptx64"), derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct MmaPeakArgs {
    /// One `u32`, where the checksum would be written.
    pub sink: DevicePtr<u32>,
}

/// Units of work of the `mma.sync` peak probe ([`MmaPeakArgs`]): enough that every warp of a
/// full grid of resident blocks gets about the same number (tens per warp).
pub const MMA_PEAK_UNITS: u64 = 1 << 18;
/// `mma.sync` m16n8k16 per unit of the peak probe: eight rounds over eight independent
/// accumulators (enough in flight to cover the multiply's latency).
pub const MMA_PEAK_UNIT_MMAS: u64 = 64;
/// Floating-point operations of one probe launch (2 · 16 · 8 · 16 per multiply).
pub const MMA_PEAK_FLOPS: u64 = MMA_PEAK_UNITS * MMA_PEAK_UNIT_MMAS * 2 * 16 * 8 * 16;

/// Writes to the `u32` at `out` (zeroed by the host) the bits of the largest
/// `|gumbel_estimate(x) − gumbel(x)|` over all 2³² words `x`, with the device's `lg2.approx`
/// (+∞ if any difference is NaN): the check of [`crate::estimate::GUMBEL_ESTIMATE_ERROR`].
#[repr(C)]
#[derive(Clone, Copy, Debug)]
#[cfg_attr(not(target_arch = "nvptx64"), derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct EstimateErrorArgs {
    /// The zeroed `u32` into which every warp merges its largest error's bits (an atomic
    /// maximum: non-negative floats order as their bits do).
    pub out: DevicePtr<u32>,
}

/// Adds `by` (wrapping) to the `step` of row parameters `row_params[0 .. batch]`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
#[cfg_attr(not(target_arch = "nvptx64"), derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct AdvanceStepsArgs {
    /// `[batch]` row parameters, updated in place.
    pub row_params: DevicePtr<RowParams>,
    /// Rows to advance.
    pub batch: u32,
    /// What each row's `step` grows by (wrapping).
    pub by: u32,
}

/// One verified sequence of a verification batch: its positions are the rows `first_row ..=
/// first_row + drafts` of the call, its drafted tokens `drafts[draft_offset ..][.. drafts]` of
/// [`AcceptDraftsArgs::drafts`].
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(not(target_arch = "nvptx64"), derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct VerifiedSequence {
    /// The row of the sequence's first drafted position.
    pub first_row: u32,
    /// How many tokens it drafted.
    pub drafts: u32,
    /// Where its drafted tokens start in the batch's drafts.
    pub draft_offset: u32,
    /// Keeps the size a multiple of 8.
    pub padding: u32,
}

/// The verdict of each verified sequence ([`crate::speculative::accepted_drafts`]) over the
/// call's tokens (one draw per row): `accepted[s]` drafts of sequence `s` kept.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
#[cfg_attr(not(target_arch = "nvptx64"), derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct AcceptDraftsArgs {
    /// `[rows]` the call's tokens, written before on the stream.
    pub tokens: DevicePtr<u32>,
    /// `[sequences]` the verified sequences.
    pub verified: DevicePtr<VerifiedSequence>,
    /// Every sequence's drafted tokens, sequence after sequence.
    pub drafts: DevicePtr<u32>,
    /// `[sequences]` the verdicts written.
    pub accepted: DevicePtr<u32>,
    /// How many sequences.
    pub sequences: u32,
    /// Keeps the size a multiple of 8.
    pub padding: u32,
}

/// Moves every verified sequence past the tokens its verification emitted: the `step` of each
/// of its rows grows by [`crate::speculative::steps_emitted`] of its verdict (wrapping), so the
/// same batch, with the next drafts written into it, verifies the positions that follow.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
#[cfg_attr(not(target_arch = "nvptx64"), derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct AdvanceVerifiedArgs {
    /// The batch's row parameters, updated in place.
    pub row_params: DevicePtr<RowParams>,
    /// `[sequences]` the verified sequences.
    pub verified: DevicePtr<VerifiedSequence>,
    /// `[sequences]` each sequence's count of kept drafts.
    pub accepted: DevicePtr<u32>,
    /// How many sequences.
    pub sequences: u32,
    /// Keeps the size a multiple of 8.
    pub padding: u32,
}

/// Threads of the listed sampler ([`SampleListedArgs`]): one block per row.
pub const LISTED_THREADS: u32 = 256;

/// The tiles whose lists the listed sampler keeps in shared memory for a row (each thread
/// its own tiles, read once from L2 and then by every step): 2,048 tiles of 128 entries, a
/// vocabulary of 262,144. Tiles past them are read from L2 at every step.
pub const LISTED_CACHED_TILES: u32 = 2048;

/// Buckets of one digit of the listed sampler's radix selections (8-bit digits).
pub const LISTED_DIGIT_BUCKETS: u32 = 256;

/// Dynamic shared memory of the listed sampler and of its fallback: the cached lists, a
/// digit's histograms of 64-bit weights and of 32-bit counts, per-warp slots for the block's
/// reductions and the selections' decisions (see the kernels' `ListedShared`).
pub const LISTED_SHARED_BYTES: u32 = LISTED_CACHED_TILES * core::mem::size_of::<crate::truncation::TileTop>() as u32
    + LISTED_DIGIT_BUCKETS * (8 + 4)
    + LISTED_THREADS / 32 * (8 + 4 + CANDIDATE_BYTES)
    + 16
    + 16;

/// The listed sampler (`sample_listed`), the chained sampler (`sample_chained`) and their
/// fallback (`sample_unsettled`), one block per row. The listed sampler decides each row's
/// min-p, top-k and top-p from its tiles' lists ([`crate::truncation`]) and races its draws
/// among the entries they keep; the chained sampler finds each min-p row's cut from its
/// largest logit and each draw's winner from its tiles' chains ([`crate::chain`]): one
/// candidate per (row, draw) in [`FusedArgs::candidates`]' layout with one tile. A row whose
/// lists or chains do not settle gets [`Candidate::NONE`] for every draw, its flag in `row_unsettled` and 1 added to
/// `unsettled`. The fallback, after the GEMM of the same tile wrote `logits` (both gated on
/// `unsettled`), decides and races each flagged row from its whole row of logits.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
#[cfg_attr(not(target_arch = "nvptx64"), derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct SampleListedArgs {
    /// `[batch, tiles]` the tiles' lists ([`FusedArgs::tile_tops`]); read by the listed
    /// sampler only.
    pub tile_tops: DevicePtr<crate::truncation::TileTop>,
    /// `[batch, samples, tiles]` the tiles' chains ([`FusedArgs::tile_chains`]); read by the
    /// chained sampler only.
    pub tile_chains: DevicePtr<crate::chain::Chain>,
    /// `[batch, logits_stride]` raw f32 logits from the listing tile's own GEMM (bit for bit
    /// the logits the lists were made from); read by the fallback only.
    pub logits: DevicePtr<f32>,
    /// `[batch]` row parameters.
    pub row_params: DevicePtr<RowParams>,
    /// `[batch]` rows' processing: min-p, top-k and top-p are read (not null).
    pub processing: DevicePtr<RowProcessing>,
    /// The same blocks when a row has a per-entry step (which the fallback applies to the raw
    /// logits as the tiles did), null otherwise.
    pub entry_processing: DevicePtr<RowProcessing>,
    /// `[batch · samples]` candidates, one per (row, draw) ([`candidate_pair`]).
    pub candidates: DevicePtr<Candidate>,
    /// `[batch]` flags: 1 where the row's lists did not settle, else 0.
    pub row_unsettled: DevicePtr<u32>,
    /// How many rows did not settle, added to (zeroed before the listed sampler).
    pub unsettled: DevicePtr<u32>,
    /// Rows.
    pub batch: u32,
    /// Lists per row.
    pub tiles: u32,
    /// The global draw index of draw 0, as [`FusedArgs::draw_offset`].
    pub draw_offset: u32,
    /// Draws per row.
    pub samples: u32,
    /// Entries per row (the call is one whole vocabulary).
    pub vocab: u32,
    /// Row stride of `logits` in elements, a multiple of 4 and at least `vocab`.
    pub logits_stride: u32,
}

/// Writes `lm_head` to `destination[0]` and `hidden` to `destination[1]`, then releases them to
/// the tensor-map proxy, which the TMA kernels acquire before their first load. The maps travel
/// by value in the argument block, which the driver copies at launch, so a call may be queued
/// (or captured in a CUDA graph) while the host reuses its copy.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
#[cfg_attr(not(target_arch = "nvptx64"), derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct StoreTensorMapsArgs {
    /// Two 64-byte aligned tensor maps in global memory.
    pub destination: DevicePtr<TensorMap>,
    /// The words of `W`'s [`TensorMap`], with boxes of [`TMA_K_BLOCK`] × the kernel's item
    /// height.
    pub lm_head: [u64; 16],
    /// The words of `H`'s [`TensorMap`], with boxes of [`TMA_K_BLOCK`] × the kernel's
    /// columns.
    pub hidden: [u64; 16],
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A shard's winner keeps its own logits through the merge, in any order, and "no token"
    /// loses to every shard's winner.
    #[test]
    fn shard_winners_merge_with_their_logits() {
        let winner = |score: f32, index: u32, raw: f32| ShardWinner {
            candidate: Candidate { score, word: 7, index },
            raw,
            processed: raw - 1.0,
        };
        let shards = [winner(1.0, 10, 0.5), winner(3.0, 900, 2.5), winner(3.0, 40, 1.5), ShardWinner::NONE];
        let best = winner(3.0, 40, 1.5);
        for first in 0..shards.len() {
            let merged = (0..shards.len())
                .map(|k| shards[(first + k) % shards.len()])
                .fold(ShardWinner::NONE, ShardWinner::merge);
            assert_eq!(merged, best, "starting at shard {first}");
        }
    }

    /// A selection its shard decides alone runs a coarse key over the row where it truncates
    /// (top-k, top-p), two key digits where it does not (the top raw entries), and its
    /// resolution the key's digits after those; tie selections and, with an exchange, the
    /// exchanged ones are not listed. Each digit's bucket is a byte of its key, the coarse
    /// key's the leading one.
    #[test]
    fn listed_selections_lead_with_a_coarse_key_where_they_truncate() {
        for exchange in [false, true] {
            for s in Selection::ALL {
                let (leading, resolved_from) = s.leading_digits(exchange);
                match (s, exchange) {
                    (Selection::TopK | Selection::TopP, false) => {
                        assert!(s.listed(exchange) && s.coarse(exchange));
                        assert_eq!((leading, resolved_from), (COARSE_DIGIT..COARSE_DIGIT + 1, 0));
                    }
                    (Selection::TopRaw, _) => {
                        assert!(s.listed(exchange) && !s.coarse(exchange));
                        assert_eq!((leading, resolved_from), (0..2, 2));
                    }
                    _ => assert!(!s.listed(exchange) && !s.coarse(exchange), "{s:?} {exchange}"),
                }
            }
        }
        let shifts: [u32; 4] = core::array::from_fn(|d| digit_shift(d as u32));
        assert_eq!((shifts, digit_shift(COARSE_DIGIT)), ([24, 16, 8, 0], 24));
    }

    /// A shard exchange holds the `[2, B]` extrema, then one `[B, 256]` `u64` histogram per
    /// digit of each exchanged selection asked for (top-k, top-p and its tie; never the top
    /// raw entries), 16-byte aligned and side by side.
    #[test]
    fn shard_exchanges_hold_a_histogram_per_exchanged_digit() {
        let bits = |s: &[Selection]| s.iter().fold(0, |b, s| b | s.bit());
        for batch in [1u32, 3, 256] {
            for (selections, digits) in [
                (0, 0),
                (bits(&[Selection::TopK]), 4),
                (bits(&[Selection::TopP, Selection::TopPTie]), 8),
                (bits(&[Selection::TopRaw, Selection::TopRawTie]), 0),
                (bits(&Selection::ALL), 12),
            ] {
                let layout = ShardExchangeLayout::of(batch, selections);
                assert_eq!(layout.digits, digits);
                assert!(layout.histograms >= 8 * batch as u64 && layout.histograms.is_multiple_of(16));
                let histogram = batch as u64 * 256 * 8;
                for k in 0..digits {
                    assert_eq!(layout.histogram(k), layout.histograms + k as u64 * histogram);
                }
                assert_eq!(layout.bytes, layout.histograms + digits as u64 * histogram);
            }
        }
    }

    /// The parts are whole multiples of 16 bytes, with the sums after the winners and the top
    /// entries after the sums; without log-probabilities only the winners.
    #[test]
    fn shard_parts_are_laid_out_in_order() {
        for (batch, samples) in [(1, 1), (3, 7), (37, 5), (256, 1)] {
            let with = ShardPartLayout::of(batch, samples, true);
            let winners = (batch * samples) as u64 * 20;
            assert_eq!(with.sums, winners);
            assert_eq!(with.top, winners + batch as u64 * 16);
            assert!(with.bytes >= with.top + batch as u64 * 20 * 8 && with.bytes.is_multiple_of(16));
            let without = ShardPartLayout::of(batch, samples, false);
            assert!(without.bytes >= winners && without.bytes.is_multiple_of(16) && without.sums == without.bytes);
        }
    }
}
