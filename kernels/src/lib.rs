//! GPU kernels of flashsample, compiled to PTX by `cargo xtask build-kernels`.
//!
//! The tile kernel (`fused_*`) computes a tile of `H·Wᵀ` on chip and keeps, per batch row and draw,
//! the best Gumbel-perturbed (score, index) of the tile; the merge kernel (`reduce_candidates`) merges
//! the tiles into tokens. The logits never reach device memory; for log-probabilities the tile
//! kernel also writes each (row, tile)'s log-sum-exp terms, the merge kernel merges them, and
//! `winner_logits_*` recomputes the winners' logits (one dot product each). `logits_gemm_*` and
//! `sample_logits` form the unfused pipeline the benchmarks compare against, and with
//! `process_rows` (logit processing of materialised rows) the path of processed sampling that
//! needs whole rows; `merge_shards` merges vocabulary shards' winners and log-sum-exp terms
//! into tokens and log-probabilities; `fill_uniform_*` makes benchmark inputs, `read_probe`
//! and `mma_peak` measure the read floor and the `mma.sync` peak.
//!
//! Every entry point takes one argument block from [`flashsample_core::abi`] by value.
//!
//! # Safety (all kernels)
//! The launcher must pass device addresses that are valid for the extents in the argument
//! block, launch `TILE_KERNEL_WARPS · 32` threads per block for tile kernels
//! (`REDUCE_THREADS` for `reduce_candidates`, any multiple of 32 for `fill_uniform_*`, `mma_peak`,
//! `read_probe` and `winner_logits_*`) and the dynamic shared memory the host's launcher computes for the kernel.
//! The mma kernels further need `dim % 8 == 0` and 16-byte aligned matrices.
#![no_std]
#![feature(
    abi_ptx,
    stdarch_nvptx,
    asm_experimental_arch,
    link_llvm_intrinsics,
    core_intrinsics,
    gpu_intrinsics,
    gpu_launch_sized_workgroup_mem,
    stmt_expr_attributes
)]
#![allow(internal_features)]

mod arch;
mod element;
mod fill;
#[cfg(flashsample_module = "hopper")]
mod hopper;
mod listed;
mod maxima;
mod process;
mod sample;
mod speculative;
mod staged;
mod state;
mod tile;
#[cfg(flashsample_module = "hopper")]
mod tma;

use flashsample_core::Candidate;
use flashsample_core::abi::{
    AcceptDraftsArgs, AdvanceStepsArgs, AdvanceVerifiedArgs, DevicePtr, EstimateErrorArgs, FillArgs, FusedArgs,
    LogitsArgs, LogitsSamplerArgs, MmaPeakArgs, N_TILE, ProcessArgs, ReadProbeArgs, ReduceArgs,
    SIMT_WARP_SCRATCH_FLOATS, SampleListedArgs, ShardMergeArgs, TILE_ROWS, WARP_ROWS, WinnerLogitsArgs,
    epilogue_staging_bytes,
};

use element::{Element, MmaElement};
use tile::TileInput;

#[panic_handler]
fn panic(_: &core::panic::PanicInfo) -> ! {
    // SAFETY: aborting the kernel is the only thing a panic can do on the device.
    unsafe { core::arch::nvptx::trap() }
}

/// Runs `$body` with `$i` = 0, 1, …, 15 for those below `$count` (a constant once
/// monomorphised, at most 16: no index past 15 runs), as straight-line code: LLVM leaves a
/// loop over a long body rolled, and a rolled loop that indexes a register array moves the
/// array to local memory.
macro_rules! each_index {
    ($i:ident < $count:expr, $body:block) => {
        each_index!(@one 0, $i, $count, $body);
        each_index!(@one 1, $i, $count, $body);
        each_index!(@one 2, $i, $count, $body);
        each_index!(@one 3, $i, $count, $body);
        each_index!(@one 4, $i, $count, $body);
        each_index!(@one 5, $i, $count, $body);
        each_index!(@one 6, $i, $count, $body);
        each_index!(@one 7, $i, $count, $body);
        each_index!(@one 8, $i, $count, $body);
        each_index!(@one 9, $i, $count, $body);
        each_index!(@one 10, $i, $count, $body);
        each_index!(@one 11, $i, $count, $body);
        each_index!(@one 12, $i, $count, $body);
        each_index!(@one 13, $i, $count, $body);
        each_index!(@one 14, $i, $count, $body);
        each_index!(@one 15, $i, $count, $body);
    };
    (@one $n:literal, $i:ident, $count:expr, $body:block) => {
        if $n < $count {
            let $i: usize = $n;
            $body
        }
    };
}
use each_index;

/// Whether a launch's gate holds it back: set, and its word 0 (see the `gate` of its
/// arguments).
///
/// # Safety
/// A set gate points at a readable word.
#[inline(always)]
unsafe fn held_back(gate: DevicePtr<u32>) -> bool {
    // SAFETY: per this function's contract.
    gate.address() != 0 && unsafe { *gate.as_ptr() } == 0
}

/// The block's dynamic shared memory.
#[inline(always)]
fn shared<T>() -> *mut T {
    core::intrinsics::gpu::gpu_launch_sized_workgroup_mem::<T>()
}

/// Where thread `lane` of warp `warp` starts in work item `item` of a tile kernel whose
/// batch tiles have `columns` columns: `(tile, row0, col0)`. Batch tiles vary fastest, so the
/// blocks that read the same rows of `W` run side by side and share them through L2.
#[inline(always)]
fn work_item(item: u32, columns: u32, batch: u32) -> (u32, u32, u32) {
    let column_tiles = batch.div_ceil(columns);
    let tile = item / column_tiles;
    let col0 = (item % column_tiles) * columns;
    let thread = arch::thread_index();
    let row0 = tile * TILE_ROWS + (thread / 32) * WARP_ROWS + 4 * ((thread % 32) / 4);
    (tile, row0, col0)
}

/// The tile input of a launch's work item (`FusedArgs` and `LogitsArgs` describe `W` and `H`
/// with the same fields).
macro_rules! tile_input {
    ($args:expr, $row0:expr, $col0:expr) => {
        TileInput {
            lm_head: $args.lm_head.address(),
            hidden: $args.hidden.address(),
            vocab: $args.vocab,
            dim: $args.dim,
            batch: $args.batch,
            lm_head_stride: $args.lm_head_stride,
            hidden_stride: $args.hidden_stride,
            row0: $row0,
            col0: $col0,
        }
    };
}

/// The tile kernels' epilogue: the chains of every (row, draw) in a chain kernel, the race
/// (and what else the call asks) in a sampling kernel.
///
/// # Safety
/// As [`sample::sample_tile`] and [`sample::write_tile_chains`]: every thread of the block calls
/// it together with its own logits; `staging` is the block's candidate staging.
#[inline(always)]
unsafe fn epilogue<const NT: usize, const CHAINS: bool>(
    logits: &tile::ThreadLogits<NT>,
    args: &FusedArgs,
    tile: u32,
    row0: u32,
    col0: u32,
    staging: *mut Candidate,
) {
    if CHAINS {
        // SAFETY: per this function's contract; a chain kernel's staging holds a chain per warp
        // and column (`epilogue_staging_bytes`).
        unsafe { sample::write_tile_chains::<NT>(logits, args, tile, row0, col0, staging.cast()) }
    } else {
        // SAFETY: per this function's contract.
        unsafe { sample::sample_tile::<NT>(logits, args, tile, row0, col0, staging) }
    }
}

/// The tile kernel on the `mma.sync` tile of `8·NT` columns.
///
/// # Safety
/// As the crate-level safety section (a tile-kernel launch of a `fused_{bf16,f16}_n*` kernel).
#[inline(always)]
unsafe fn fused_mma<T: MmaElement, const NT: usize, const CHAINS: bool>(args: FusedArgs) {
    let columns = N_TILE * NT as u32;
    let items = args.tiles * args.batch.div_ceil(columns);
    let staging = shared::<Candidate>();
    let mut item = arch::block_index();
    while item < items {
        let (tile, row0, col0) = work_item(item, columns, args.batch);
        let input = tile_input!(args, row0, col0);
        // SAFETY: all 32 lanes of every warp run the item loop together (items are per block), and
        // `input` describes the launch's valid matrices.
        let logits = unsafe { tile::mma_tile::<T, NT>(&input, arch::thread_index() % 32) };
        // SAFETY: all threads of the block run it together; `args` and `staging` (the block's
        // shared memory, sized by the registry) are valid.
        unsafe { epilogue::<NT, CHAINS>(&logits, &args, tile, row0, col0, staging) };
        item += arch::grid_size();
    }
}

/// The tile kernel on the staged `mma.sync` tile of `8·NT` columns. The ring of stages and
/// the epilogue's candidate staging share the block's shared memory: the tile ends with a
/// block barrier after its last read of the ring, and the item ends with one after the
/// epilogue's last read of the staging.
///
/// # Safety
/// As the crate-level safety section (a tile-kernel launch of a `fused_staged_*` kernel).
#[inline(always)]
unsafe fn fused_staged<T: MmaElement, const NT: usize, const CHAINS: bool>(args: FusedArgs) {
    let columns = N_TILE * NT as u32;
    let items = args.tiles * args.batch.div_ceil(columns);
    let staging = shared::<Candidate>();
    let ring = arch::shared_address(staging);
    let mut item = arch::block_index();
    while item < items {
        let (tile, row0, col0) = work_item(item, columns, args.batch);
        let input = tile_input!(args, row0, col0);
        // SAFETY: every thread of the block runs the item loop together; the ring is the block's
        // shared memory (sized by the registry), unused since the barrier that ended the last
        // item; `input` describes the launch's valid matrices.
        let logits = unsafe { staged::staged_tile::<T, NT>(&input, ring) };
        // SAFETY: all threads of the block run it together; `args` and `staging` are valid, and
        // the tile's last barrier ended its reads of the shared memory the staging reuses.
        unsafe { epilogue::<NT, CHAINS>(&logits, &args, tile, row0, col0, staging) };
        // SAFETY: every thread of the block reaches it (uniform item loop).
        unsafe { arch::sync_threads() };
        item += arch::grid_size();
    }
}

/// The tile kernel on the SIMT tile.
///
/// # Safety
/// As the crate-level safety section (a tile-kernel launch of a `fused_simt_*` kernel).
#[inline(always)]
unsafe fn fused_simt<T: Element, const CHAINS: bool>(args: FusedArgs) {
    let items = args.tiles * args.batch.div_ceil(N_TILE);
    let staging = shared::<Candidate>();
    let thread = arch::thread_index();
    // SAFETY: the block's shared memory holds the staging, then one scratch area per warp
    // (`fused_simt_shared_bytes`).
    let scratch = unsafe {
        (staging as *mut u8)
            .add(epilogue_staging_bytes(N_TILE, CHAINS) as usize)
            .cast::<f32>()
            .add(((thread / 32) * SIMT_WARP_SCRATCH_FLOATS) as usize)
    };
    let mut item = arch::block_index();
    while item < items {
        let (tile, row0, col0) = work_item(item, N_TILE, args.batch);
        let input = tile_input!(args, row0, col0);
        // SAFETY: as for the mma tile; `scratch` is this warp's area.
        let logits = unsafe { tile::simt_tile::<T>(&input, thread % 32, scratch) };
        // SAFETY: all threads of the block run it together; `args` and `staging` are valid.
        unsafe { epilogue::<1, CHAINS>(&logits, &args, tile, row0, col0, staging) };
        item += arch::grid_size();
    }
}

/// The unfused pipeline's GEMM on the `mma.sync` tile of `8·NT` columns.
///
/// # Safety
/// As the crate-level safety section (a launch of a `logits_gemm_*` kernel).
#[inline(always)]
unsafe fn logits_gemm<T: MmaElement, const NT: usize>(args: LogitsArgs) {
    let columns = N_TILE * NT as u32;
    let items = args.vocab.div_ceil(TILE_ROWS) * args.batch.div_ceil(columns);
    let mut item = arch::block_index();
    while item < items {
        let (_, row0, col0) = work_item(item, columns, args.batch);
        let input = tile_input!(args, row0, col0);
        // SAFETY: all 32 lanes of every warp run the item loop together, and `input` describes the
        // launch's valid matrices.
        let logits = unsafe { tile::mma_tile::<T, NT>(&input, arch::thread_index() % 32) };
        // SAFETY: `args.logits` holds `batch × logits_stride` floats (the crate-level contract).
        unsafe { store_logits::<NT>(&logits, &args, row0, col0) };
        item += arch::grid_size();
    }
}

/// The unfused pipeline's GEMM on the staged `mma.sync` tile of `8·NT` columns.
///
/// # Safety
/// As the crate-level safety section (a launch of a `logits_staged_*` kernel).
#[inline(always)]
unsafe fn logits_staged<T: MmaElement, const NT: usize>(args: LogitsArgs) {
    let columns = N_TILE * NT as u32;
    let items = args.vocab.div_ceil(TILE_ROWS) * args.batch.div_ceil(columns);
    let ring = arch::shared_address(shared::<u8>());
    let mut item = arch::block_index();
    while item < items {
        let (_, row0, col0) = work_item(item, columns, args.batch);
        let input = tile_input!(args, row0, col0);
        // SAFETY: every thread of the block runs the item loop together; the ring is the block's
        // shared memory, and the tile ends with a barrier after its last read of it.
        let logits = unsafe { staged::staged_tile::<T, NT>(&input, ring) };
        // SAFETY: `args.logits` holds `batch × logits_stride` floats (the crate-level contract).
        unsafe { store_logits::<NT>(&logits, &args, row0, col0) };
        item += arch::grid_size();
    }
}

/// The unfused pipeline's GEMM on the SIMT tile: any element type, `dim` and alignment.
///
/// # Safety
/// As the crate-level safety section (a launch of a `logits_simt_*` kernel).
#[inline(always)]
unsafe fn logits_simt<T: Element>(args: LogitsArgs) {
    let items = args.vocab.div_ceil(TILE_ROWS) * args.batch.div_ceil(N_TILE);
    let thread = arch::thread_index();
    // SAFETY: the block's shared memory holds one scratch area per warp
    // (`logits_simt_shared_bytes`).
    let scratch = unsafe { shared::<f32>().add(((thread / 32) * SIMT_WARP_SCRATCH_FLOATS) as usize) };
    let mut item = arch::block_index();
    while item < items {
        let (_, row0, col0) = work_item(item, N_TILE, args.batch);
        let input = tile_input!(args, row0, col0);
        // SAFETY: all 32 lanes of every warp run the item loop together; `scratch` is this
        // warp's area and `input` describes the launch's valid matrices.
        let logits = unsafe { tile::simt_tile::<T>(&input, thread % 32, scratch) };
        // SAFETY: `args.logits` holds `batch × logits_stride` floats (the crate-level contract).
        unsafe { store_logits::<1>(&logits, &args, row0, col0) };
        item += arch::grid_size();
    }
}

/// The unfused pipeline's epilogue: a thread's logits tile (rows `row0 .. row0 + 4` of its
/// batch columns from `col0`) stored to `args.logits`, 16 bytes at a time, and with
/// `args.maxima` each (column, run of `MAXIMA_ROWS` rows)'s maximum: the 16 rows of a column
/// lie with the lanes `4g + t` of one `t` and `g` in `0..4` or `4..8`.
///
/// # Safety
/// All 32 lanes of the warp call it together; `args.logits` holds `batch × logits_stride`
/// floats, 16-byte aligned, with `logits_stride` a multiple of 4; `args.maxima` is null or
/// holds `batch × ⌈vocab / MAXIMA_ROWS⌉` words.
#[allow(clippy::needless_range_loop)] // constant indices once unrolled keep `logits` in registers
#[inline(always)]
unsafe fn store_logits<const NT: usize>(logits: &tile::ThreadLogits<NT>, args: &LogitsArgs, row0: u32, col0: u32) {
    let lane = arch::thread_index() % 32;
    let t = lane % 4;
    each_index!(nt < NT, {
        for c in 0..2 {
            let b = col0 + N_TILE * nt as u32 + 2 * t + c as u32;
            if args.maxima.address() != 0 {
                let key = maxima::quad_key(logits[nt][c], row0, args.vocab);
                // SAFETY: every lane reaches it (uniform condition and loops, this function's
                // contract); lanes `l ^ 4`, `l ^ 8` hold the same column's other rows of the run.
                let key = unsafe { maxima::max_over_lanes(key, 4, 8) };
                if (lane / 4).is_multiple_of(4) {
                    // SAFETY: the run of this column's rows from `row0`, a multiple of 16.
                    unsafe { maxima::write(args.maxima, args.vocab, args.batch, b, row0, key) };
                }
            }
            if b < args.batch && row0 < args.vocab {
                let address = args.logits.add(b as u64 * args.logits_stride as u64 + row0 as u64).address();
                // SAFETY: `b < batch` and `row0 < vocab`: inside the logits buffer of `batch ×
                // logits_stride` floats, 16-byte aligned (the stride and `row0` are multiples
                // of 4).
                unsafe { arch::store_global_v4(address, logits[nt][c]) };
            }
        }
    });
}

/// Defines one entry point of the registry's list (see `flashsample_core::registry`): its
/// `Kernel` kind picks the body and the argument block.
macro_rules! entry_point {
    ($name:ident, FusedMma { element: $element:ident, columns: $columns:tt, chains: $chains:tt }) => {
        /// The tile kernel of fused sampling on the `mma.sync` tile (see the crate docs).
        ///
        /// # Safety
        /// As the crate-level safety section.
        #[unsafe(no_mangle)]
        pub unsafe extern "ptx-kernel" fn $name(args: FusedArgs) {
            // SAFETY: the launcher keeps the crate-level contract: the registry's launch shape and
            // an argument block of valid device buffers.
            unsafe { fused_mma::<element::$element, { $columns / 8 }, $chains>(args) }
        }
    };
    ($name:ident, FusedStaged { element: $element:ident, columns: $columns:tt, chains: $chains:tt }) => {
        /// The tile kernel of fused sampling on the staged `mma.sync` tile (see the crate docs).
        ///
        /// # Safety
        /// As the crate-level safety section.
        #[unsafe(no_mangle)]
        pub unsafe extern "ptx-kernel" fn $name(args: FusedArgs) {
            // SAFETY: the launcher keeps the crate-level contract: the registry's launch shape and
            // an argument block of valid device buffers.
            unsafe { fused_staged::<element::$element, { $columns / 8 }, $chains>(args) }
        }
    };
    ($name:ident, LogitsStaged { element: $element:ident, columns: $columns:tt }) => {
        /// The unfused pipeline's GEMM on the staged `mma.sync` tile: writes f32 logits.
        ///
        /// # Safety
        /// As the crate-level safety section.
        #[unsafe(no_mangle)]
        pub unsafe extern "ptx-kernel" fn $name(args: LogitsArgs) {
            // SAFETY: the launcher keeps the crate-level contract: a set gate is a readable word.
            if unsafe { held_back(args.gate) } {
                return;
            }
            // SAFETY: the launcher keeps the crate-level contract: the registry's launch shape and
            // an argument block of valid device buffers.
            unsafe { logits_staged::<element::$element, { $columns / 8 }>(args) }
        }
    };
    ($name:ident, FusedSimt { element: $element:ident, chains: $chains:tt }) => {
        /// The tile kernel of fused sampling on the CUDA-core tile (any dtype, any D).
        ///
        /// # Safety
        /// As the crate-level safety section.
        #[unsafe(no_mangle)]
        pub unsafe extern "ptx-kernel" fn $name(args: FusedArgs) {
            // SAFETY: the launcher keeps the crate-level contract: the registry's launch shape and
            // an argument block of valid device buffers.
            unsafe { fused_simt::<element::$element, $chains>(args) }
        }
    };
    ($name:ident, LogitsMma { element: $element:ident, columns: $columns:tt }) => {
        /// The unfused pipeline's GEMM on the `mma.sync` tile: writes f32 logits.
        ///
        /// # Safety
        /// As the crate-level safety section.
        #[unsafe(no_mangle)]
        pub unsafe extern "ptx-kernel" fn $name(args: LogitsArgs) {
            // SAFETY: the launcher keeps the crate-level contract: a set gate is a readable word.
            if unsafe { held_back(args.gate) } {
                return;
            }
            // SAFETY: the launcher keeps the crate-level contract: the registry's launch shape and
            // an argument block of valid device buffers.
            unsafe { logits_gemm::<element::$element, { $columns / 8 }>(args) }
        }
    };
    ($name:ident, LogitsSimt { element: $element:ident }) => {
        /// The unfused pipeline's GEMM on the CUDA-core tile: writes f32 logits.
        ///
        /// # Safety
        /// As the crate-level safety section.
        #[unsafe(no_mangle)]
        pub unsafe extern "ptx-kernel" fn $name(args: LogitsArgs) {
            // SAFETY: the launcher keeps the crate-level contract: a set gate is a readable word.
            if unsafe { held_back(args.gate) } {
                return;
            }
            // SAFETY: the launcher keeps the crate-level contract: the registry's launch shape and
            // an argument block of valid device buffers.
            unsafe { logits_simt::<element::$element>(args) }
        }
    };
    ($name:ident, FusedTma { element: $element:ident, rows: $rows:tt, columns: $columns:tt }) => {
        entry_point!(@tma $name, $element, $rows, $columns, true);
    };
    ($name:ident, LogitsTma { element: $element:ident, rows: $rows:tt, columns: $columns:tt }) => {
        entry_point!(@tma $name, $element, $rows, $columns, false);
    };
    (@tma $name:ident, $element:ident, $rows:tt, $columns:tt, $fused:tt) => {
        /// A TMA + `wgmma` kernel (sm_90a): fused sampling, or the unfused pipeline's GEMM.
        ///
        /// # Safety
        /// As the crate-level safety section, with `TMA_THREADS` threads, `tma_shared_bytes`
        /// of dynamic shared memory and tensor maps made for this kernel's box shapes.
        #[cfg(flashsample_module = "hopper")]
        #[unsafe(no_mangle)]
        pub unsafe extern "ptx-kernel" fn $name(args: flashsample_core::abi::TmaArgs) {
            // SAFETY: the launcher keeps the crate-level contract: a set gate is a readable word.
            if unsafe { held_back(args.gate) } {
                return;
            }
            // SAFETY: the launcher keeps the crate-level contract: the registry's launch shape and
            // an argument block of valid device buffers.
            unsafe {
                tma::cooperative::tma_kernel::<
                    element::$element,
                    $rows,
                    $columns,
                    { $columns / 2 },
                    $fused,
                    { flashsample_core::registry::tma_tile_applies_processing($rows, $columns) },
                >(
                    &args,
                    shared::<u8>(),
                )
            }
        }
    };
    ($name:ident, FusedHandoff { element: $element:ident, columns: $columns:tt }) => {
        /// A TMA + `wgmma` fused sampling kernel (sm_90a) whose epilogue runs in warps of its
        /// own.
        ///
        /// # Safety
        /// As the crate-level safety section, with `TMA_HANDOFF_THREADS` threads,
        /// `tma_handoff_shared_bytes` of dynamic shared memory and tensor maps made for this
        /// kernel's box shapes.
        #[cfg(flashsample_module = "hopper")]
        #[unsafe(no_mangle)]
        pub unsafe extern "ptx-kernel" fn $name(args: flashsample_core::abi::TmaArgs) {
            // SAFETY: the launcher keeps the crate-level contract: the registry's launch shape and
            // an argument block of valid device buffers.
            unsafe {
                tma::handoff::tma_handoff_kernel::<element::$element, $columns, { $columns / 2 }>(
                    &args,
                    shared::<u8>(),
                )
            }
        }
    };
    ($name:ident, SampleLogits {}) => {
        /// The unfused pipeline's sampler over materialised logits.
        ///
        /// # Safety
        /// As the crate-level safety section.
        #[unsafe(no_mangle)]
        pub unsafe extern "ptx-kernel" fn $name(args: LogitsSamplerArgs) {
            // SAFETY: the launcher keeps the crate-level contract: the registry's launch shape and
            // an argument block of valid device buffers.
            unsafe { sample::sample_logits(&args, shared::<Candidate>()) }
        }
    };
    ($name:ident, ReduceCandidates {}) => {
        /// The merge kernel: candidates → tokens.
        ///
        /// # Safety
        /// As the crate-level safety section.
        #[unsafe(no_mangle)]
        pub unsafe extern "ptx-kernel" fn $name(args: ReduceArgs) {
            // SAFETY: the launcher keeps the crate-level contract: the registry's launch shape and
            // an argument block of valid device buffers.
            unsafe { sample::reduce_candidates(&args, shared::<Candidate>()) }
        }
    };
    ($name:ident, SampleChained {}) => {
        /// The chained sampler: each min-p row's cut from its largest logit, its draws'
        /// winners from its tiles' chains.
        ///
        /// # Safety
        /// As the crate-level safety section.
        #[unsafe(no_mangle)]
        pub unsafe extern "ptx-kernel" fn $name(args: SampleListedArgs) {
            // SAFETY: the launcher keeps the crate-level contract: the registry's launch shape and
            // an argument block of valid device buffers.
            unsafe { listed::sample_chained(&args, shared::<listed::ListedShared>()) }
        }
    };
    ($name:ident, SampleListed {}) => {
        /// The listed sampler: each row's truncations from its tiles' lists, its draws among
        /// the entries they keep.
        ///
        /// # Safety
        /// As the crate-level safety section.
        #[unsafe(no_mangle)]
        pub unsafe extern "ptx-kernel" fn $name(args: SampleListedArgs) {
            // SAFETY: the launcher keeps the crate-level contract: the registry's launch shape and
            // an argument block of valid device buffers.
            unsafe { listed::sample_listed(&args, shared::<listed::ListedShared>()) }
        }
    };
    ($name:ident, SampleUnsettled {}) => {
        /// The listed path's fallback: the rows whose lists did not settle, from their logits.
        ///
        /// # Safety
        /// As the crate-level safety section.
        #[unsafe(no_mangle)]
        pub unsafe extern "ptx-kernel" fn $name(args: SampleListedArgs) {
            // SAFETY: the launcher keeps the crate-level contract: the registry's launch shape and
            // an argument block of valid device buffers, queued after the listed sampler and the
            // gated GEMM.
            unsafe { listed::sample_unsettled(&args, shared::<listed::ListedShared>()) }
        }
    };
    ($name:ident, WinnerLogits { element: $element:ident }) => {
        /// The logits of a fused call's winners: one dot product each.
        ///
        /// # Safety
        /// As the crate-level safety section.
        #[unsafe(no_mangle)]
        pub unsafe extern "ptx-kernel" fn $name(args: WinnerLogitsArgs) {
            // SAFETY: the launcher keeps the crate-level contract: the registry's launch shape and
            // an argument block of valid device buffers.
            unsafe { sample::winner_logits::<element::$element>(&args, shared::<f64>()) }
        }
    };
    ($name:ident, ProcessRows {}) => {
        /// Logit processing of materialised rows: the logits each row races with.
        ///
        /// # Safety
        /// As the crate-level safety section.
        #[unsafe(no_mangle)]
        pub unsafe extern "ptx-kernel" fn $name(args: ProcessArgs) {
            // SAFETY: the launcher keeps the crate-level contract: the registry's launch shape and
            // an argument block of valid device buffers whose sparse lists it checked.
            unsafe { process::process_rows(&args, shared::<process::ProcessShared>()) }
        }
    };
    ($name:ident, MergeShards {}) => {
        /// The shard merge: shards' winners and log-sum-exp terms → tokens and their
        /// log-probabilities.
        ///
        /// # Safety
        /// As the crate-level safety section.
        #[unsafe(no_mangle)]
        pub unsafe extern "ptx-kernel" fn $name(args: ShardMergeArgs) {
            // SAFETY: the launcher keeps the crate-level contract: an argument block of valid
            // device buffers.
            unsafe { process::merge_shards(&args) }
        }
    };
    ($name:ident, FillUniform { element: $element:ident }) => {
        /// Fills a buffer with uniform values in `[-scale, scale)`.
        ///
        /// # Safety
        /// As the crate-level safety section.
        #[unsafe(no_mangle)]
        pub unsafe extern "ptx-kernel" fn $name(args: FillArgs) {
            // SAFETY: the launcher keeps the crate-level contract: the registry's launch shape and
            // an argument block of valid device buffers.
            unsafe { fill::fill_uniform::<element::$element>(&args) }
        }
    };
    ($name:ident, ReadProbe {}) => {
        /// Streams a buffer with 16-byte loads: the read-bandwidth floor.
        ///
        /// # Safety
        /// As the crate-level safety section.
        #[unsafe(no_mangle)]
        pub unsafe extern "ptx-kernel" fn $name(args: ReadProbeArgs) {
            // SAFETY: the launcher keeps the crate-level contract: the registry's launch shape and
            // an argument block of valid device buffers.
            unsafe { fill::read_probe(&args) }
        }
    };
    ($name:ident, MmaPeak {}) => {
        /// Multiplies register fragments with `mma.sync` only: the tensor cores' peak.
        ///
        /// # Safety
        /// As the crate-level safety section.
        #[unsafe(no_mangle)]
        pub unsafe extern "ptx-kernel" fn $name(args: MmaPeakArgs) {
            // SAFETY: the launcher keeps the crate-level contract: whole warps, a valid sink.
            unsafe { fill::mma_peak(&args) }
        }
    };
    ($name:ident, GumbelEstimateError {}) => {
        /// The exhaustive check of the noise estimate's error bound (see
        /// [`fill::gumbel_estimate_error`]).
        ///
        /// # Safety
        /// As the crate-level safety section; `args.out` is a zeroed `u32`.
        #[unsafe(no_mangle)]
        pub unsafe extern "ptx-kernel" fn $name(args: EstimateErrorArgs) {
            // SAFETY: the launcher keeps the crate-level contract: the registry's launch shape and
            // an argument block of valid device buffers.
            unsafe { fill::gumbel_estimate_error(&args) }
        }
    };
    ($name:ident, AdvanceSteps {}) => {
        /// Adds to the decode step of a batch's row parameters.
        ///
        /// # Safety
        /// As the crate-level safety section.
        #[unsafe(no_mangle)]
        pub unsafe extern "ptx-kernel" fn $name(args: AdvanceStepsArgs) {
            // SAFETY: the launcher keeps the crate-level contract: `row_params` holds `batch`
            // entries.
            unsafe { state::advance_steps(&args) }
        }
    };
    ($name:ident, AcceptDrafts {}) => {
        /// Each verified sequence's count of kept drafts over the call's tokens.
        ///
        /// # Safety
        /// As the crate-level safety section.
        #[unsafe(no_mangle)]
        pub unsafe extern "ptx-kernel" fn $name(args: AcceptDraftsArgs) {
            // SAFETY: the launcher keeps the crate-level contract: the sequences' rows and
            // drafts lie inside the tokens and drafts, `accepted` holds `sequences` slots.
            unsafe { speculative::accept_drafts(&args) }
        }
    };
    ($name:ident, AdvanceVerified {}) => {
        /// Moves each verified sequence's decode steps past the tokens it emitted.
        ///
        /// # Safety
        /// As the crate-level safety section.
        #[unsafe(no_mangle)]
        pub unsafe extern "ptx-kernel" fn $name(args: AdvanceVerifiedArgs) {
            // SAFETY: the launcher keeps the crate-level contract: the sequences' rows lie
            // inside the row parameters, `accepted` holds `sequences` verdicts.
            unsafe { speculative::advance_verified(&args) }
        }
    };
    ($name:ident, StoreTensorMaps {}) => {
        /// Writes a call's two tensor maps to device memory for the TMA kernel after it.
        ///
        /// # Safety
        /// As the crate-level safety section; `destination` holds two 64-byte aligned maps.
        #[cfg(flashsample_module = "hopper")]
        #[unsafe(no_mangle)]
        pub unsafe extern "ptx-kernel" fn $name(args: flashsample_core::abi::StoreTensorMapsArgs) {
            // SAFETY: the launcher keeps the crate-level contract.
            unsafe { state::store_tensor_maps(&args) }
        }
    };
}

macro_rules! entry_points {
    ($($name:ident => $kind:ident { $($field:ident : $value:tt),* };)*) => {
        $(entry_point!($name, $kind { $($field: $value),* });)*
    };
}

flashsample_core::for_each_kernel!(entry_points);
