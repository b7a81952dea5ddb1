//! Every kernel of the project, declared once: its entry-point name, what it computes, which
//! PTX modules hold it, and its launch shape (threads, dynamic shared memory, launch bounds).
//!
//! The list lives in [`for_each_kernel!`](crate::for_each_kernel). The kernel crate expands it
//! into its `#[unsafe(no_mangle)]` entry points, this module into [`KERNELS`], which the host
//! (module loading, launches) and `xtask` (launch bounds, PTX checks) read. A kernel is always
//! found by its [`Kernel`] value; no name is parsed or assembled from pieces anywhere.
//!
//! Architecture Invariant: the entry point `name` of an entry computes what its `Kernel` says,
//! with the launch shape `Kernel` gives, in every module that [`Module::holds`] it.

use crate::abi::{
    LISTED_SHARED_BYTES, LISTED_THREADS, LOGITS_SAMPLER_SHARED_BYTES, PROCESS_SHARED_BYTES, PROCESS_THREADS,
    REDUCE_SHARED_BYTES, REDUCE_THREADS, TILE_KERNEL_WARPS, TMA_HANDOFF_THREADS, TMA_THREADS,
    WINNER_LOGITS_SHARED_BYTES, WINNER_LOGITS_THREADS, epilogue_staging_bytes, fused_simt_shared_bytes,
    fused_staged_shared_bytes, logits_simt_shared_bytes, logits_staged_shared_bytes, tma_handoff_shared_bytes,
    tma_shared_bytes,
};

/// The element type of `W` and `H` a kernel reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ElementType {
    /// bfloat16, 2 bytes.
    Bf16,
    /// IEEE half precision, 2 bytes.
    F16,
    /// IEEE single precision, 4 bytes: the SIMT tile, `winner_logits` and the fill only (the
    /// `mma.sync` and `wgmma` tiles take 16-bit elements).
    F32,
}

/// What a kernel computes, with the parameters its code is specialised for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kernel {
    /// Tile kernel, register-direct `mma.sync` tile of 128 rows × `columns` (`FusedArgs`).
    FusedMma {
        /// The element type of `W` and `H`: bf16 or f16.
        element: ElementType,
        /// Batch columns per work item: 8, 16 or 32 (`columns / 8` mma n-tiles).
        columns: u32,
        /// Whether it writes each (row, draw)'s chain ([`Chain`](crate::chain::Chain), for
        /// min-p rows without logits) in place of candidates: the chain kernels, kept apart so
        /// that the sampling kernels keep their registers.
        chains: bool,
    },
    /// Tile kernel, staged `mma.sync` tile of 128 rows × `columns`: `W` and `H` through
    /// shared memory by `cp.async`, fragments by `ldmatrix` (`FusedArgs`).
    FusedStaged {
        /// The element type of `W` and `H`: bf16 or f16.
        element: ElementType,
        /// Batch columns per work item: 64 or 128
        /// ([`STAGED_COLUMNS`](crate::abi::STAGED_COLUMNS)).
        columns: u32,
        /// Whether it writes each (row, draw)'s chain ([`Chain`](crate::chain::Chain), for
        /// min-p rows without logits) in place of candidates: the chain kernels, kept apart so
        /// that the sampling kernels keep their registers.
        chains: bool,
    },
    /// Tile kernel, CUDA-core tile (`FusedArgs`).
    FusedSimt {
        /// The element type of `W` and `H`: any.
        element: ElementType,
        /// Whether it writes each (row, draw)'s chain ([`Chain`](crate::chain::Chain), for
        /// min-p rows without logits) in place of candidates: the chain kernels, kept apart so
        /// that the sampling kernels keep their registers.
        chains: bool,
    },
    /// The unfused pipeline's GEMM on the `mma.sync` tile (`LogitsArgs`).
    LogitsMma {
        /// The element type of `W` and `H`: bf16 or f16.
        element: ElementType,
        /// Batch columns per work item: 8, 16 or 32.
        columns: u32,
    },
    /// The unfused pipeline's GEMM on the staged `mma.sync` tile (`LogitsArgs`).
    LogitsStaged {
        /// The element type of `W` and `H`: bf16 or f16.
        element: ElementType,
        /// Batch columns per work item: 64 or 128.
        columns: u32,
    },
    /// The unfused pipeline's GEMM on the CUDA-core tile, for any element type, `dim` and
    /// alignment (`LogitsArgs`).
    LogitsSimt {
        /// The element type of `W` and `H`: any.
        element: ElementType,
    },
    /// Tile kernel, TMA + `wgmma` tile of `rows` × `columns` (`TmaArgs`).
    FusedTma {
        /// The element type of `W` and `H`: bf16 or f16.
        element: ElementType,
        /// Vocabulary rows per work item, the item height: 64 (ping-pong) or 128 (cooperative);
        /// see [`TMA_ITEM_ROWS`](crate::abi::TMA_ITEM_ROWS).
        rows: u32,
        /// Batch columns per work item (the `wgmma` N): 8, 16, 32, 64 or 128.
        columns: u32,
    },
    /// The unfused pipeline's GEMM on the TMA + `wgmma` tile (`TmaArgs`).
    LogitsTma {
        /// The element type of `W` and `H`: bf16 or f16.
        element: ElementType,
        /// Vocabulary rows per work item: 64 or 128, as for [`Kernel::FusedTma`].
        rows: u32,
        /// Batch columns per work item: 8, 16, 32, 64 or 128.
        columns: u32,
    },
    /// Tile kernel, TMA + `wgmma` handoff tile: 128 rows × `columns`, epilogue in warps of its own
    /// (`TmaArgs`).
    FusedHandoff {
        /// The element type of `W` and `H`: bf16 or f16.
        element: ElementType,
        /// Batch columns per work item: 64 or 128
        /// ([`HANDOFF_COLUMNS`](crate::abi::HANDOFF_COLUMNS)).
        columns: u32,
    },
    /// The unfused pipeline's sampler over materialised logits (`LogitsSamplerArgs`).
    SampleLogits,
    /// The merge kernel: candidates → tokens, or a shard's winners (`ReduceArgs`).
    ReduceCandidates,
    /// Each row's truncations decided from its tiles' lists and its draws raced among the
    /// entries they keep, one block per row (`SampleListedArgs`).
    SampleListed,
    /// Each min-p row's cut found from its largest logit and its draws' winners from its
    /// tiles' chains, one block per row (`SampleListedArgs`).
    SampleChained,
    /// The listed path's fallback: each row whose lists did not settle decided and raced from
    /// its whole row of logits, one block per row (`SampleListedArgs`).
    SampleUnsettled,
    /// The logits of a fused call's winners, one dot product each (`WinnerLogitsArgs`).
    WinnerLogits {
        /// The element type of `W` and `H`: any.
        element: ElementType,
    },
    /// Logit processing of materialised rows, one step of the processing pipeline per launch
    /// over (row, slice) items (`ProcessArgs`).
    ProcessRows,
    /// The shard merge: shards' winners and log-sum-exp terms → tokens and their
    /// log-probabilities (`ShardMergeArgs`).
    MergeShards,
    /// Uniform benchmark inputs (`FillArgs`).
    FillUniform {
        /// The element type written.
        element: ElementType,
    },
    /// The read-bandwidth floor (`ReadProbeArgs`).
    ReadProbe,
    /// The `mma.sync` peak (`MmaPeakArgs`).
    MmaPeak,
    /// The exhaustive check of the noise estimate's bound (`EstimateErrorArgs`).
    GumbelEstimateError,
    /// Adds to the decode step of every row parameter (`AdvanceStepsArgs`): how a loop, or a
    /// replayed CUDA graph, draws fresh noise without a host copy.
    AdvanceSteps,
    /// Each verified sequence's count of kept drafts over the call's tokens
    /// (`AcceptDraftsArgs`).
    AcceptDrafts,
    /// Moves each verified sequence's decode steps past the tokens it emitted
    /// (`AdvanceVerifiedArgs`).
    AdvanceVerified,
    /// Writes a call's two tensor maps into device memory (`StoreTensorMapsArgs`), ordered on
    /// the stream before the TMA kernel that reads them.
    StoreTensorMaps,
}

/// Whether the fused TMA tile of `rows` × `columns` applies per-row processing: every one but
/// the ping-pong 64 × 128 tile, whose epilogue has no registers to spare for it (ptxas
/// spilled).
pub const fn tma_tile_applies_processing(rows: u32, columns: u32) -> bool {
    !(rows == 64 && columns == 128)
}

/// Threads of the kernels that do not depend on a block shape (any multiple of 32 works).
const UTILITY_THREADS: u32 = 256;
/// Threads of the tensor-map writer: one warp, of which one thread writes.
const STORE_TENSOR_MAPS_THREADS: u32 = 32;

impl Kernel {
    /// Threads per block.
    pub const fn threads(self) -> u32 {
        match self {
            Kernel::FusedMma { .. }
            | Kernel::FusedStaged { .. }
            | Kernel::FusedSimt { .. }
            | Kernel::LogitsMma { .. }
            | Kernel::LogitsStaged { .. }
            | Kernel::LogitsSimt { .. }
            | Kernel::SampleLogits => TILE_KERNEL_WARPS * 32,
            Kernel::FusedTma { .. } | Kernel::LogitsTma { .. } => TMA_THREADS,
            Kernel::FusedHandoff { .. } => TMA_HANDOFF_THREADS,
            Kernel::ReduceCandidates => REDUCE_THREADS,
            Kernel::SampleListed | Kernel::SampleChained | Kernel::SampleUnsettled => LISTED_THREADS,
            Kernel::ProcessRows => PROCESS_THREADS,
            Kernel::FillUniform { .. }
            | Kernel::ReadProbe
            | Kernel::MmaPeak
            | Kernel::GumbelEstimateError
            | Kernel::AdvanceSteps
            | Kernel::AcceptDrafts
            | Kernel::AdvanceVerified
            | Kernel::MergeShards => UTILITY_THREADS,
            Kernel::WinnerLogits { .. } => WINNER_LOGITS_THREADS,
            Kernel::StoreTensorMaps => STORE_TENSOR_MAPS_THREADS,
        }
    }

    /// Dynamic shared memory per block, in bytes.
    pub const fn shared_bytes(self) -> u32 {
        match self {
            Kernel::FusedMma { columns, chains, .. } => epilogue_staging_bytes(columns, chains),
            Kernel::FusedStaged { columns, chains, .. } => fused_staged_shared_bytes(columns, chains),
            Kernel::LogitsStaged { columns, .. } => logits_staged_shared_bytes(columns),
            Kernel::FusedSimt { chains, .. } => fused_simt_shared_bytes(chains),
            Kernel::LogitsSimt { .. } => logits_simt_shared_bytes(),
            Kernel::FusedTma { rows, columns, .. } | Kernel::LogitsTma { rows, columns, .. } => {
                tma_shared_bytes(rows, columns)
            }
            Kernel::FusedHandoff { columns, .. } => tma_handoff_shared_bytes(columns),
            Kernel::SampleLogits => LOGITS_SAMPLER_SHARED_BYTES,
            Kernel::ReduceCandidates => REDUCE_SHARED_BYTES,
            Kernel::SampleListed | Kernel::SampleChained | Kernel::SampleUnsettled => LISTED_SHARED_BYTES,
            Kernel::ProcessRows => PROCESS_SHARED_BYTES,
            Kernel::WinnerLogits { .. } => WINNER_LOGITS_SHARED_BYTES,
            Kernel::LogitsMma { .. }
            | Kernel::MergeShards
            | Kernel::FillUniform { .. }
            | Kernel::ReadProbe
            | Kernel::MmaPeak
            | Kernel::GumbelEstimateError
            | Kernel::AdvanceSteps
            | Kernel::AcceptDrafts
            | Kernel::AdvanceVerified
            | Kernel::StoreTensorMaps => 0,
        }
    }

    /// The block size the PTX declares with `.maxntid`, if any. The TMA kernels declare it:
    /// without it ptxas assumes any block size and may give each thread more registers than
    /// a block of [`Kernel::threads`] can have. (rustc has no attribute for NVVM launch
    /// bounds; `xtask` adds the directive.) So does a kernel with
    /// [`Kernel::min_blocks_per_multiprocessor`].
    pub const fn launch_bounds(self) -> Option<u32> {
        match self {
            Kernel::FusedTma { .. } | Kernel::LogitsTma { .. } | Kernel::FusedHandoff { .. } | Kernel::ProcessRows => {
                Some(self.threads())
            }
            _ => None,
        }
    }

    /// The blocks a multiprocessor must hold at once, which the PTX declares with
    /// `.minnctapersm` (with [`Kernel::launch_bounds`]), if any: the processing kernel's
    /// steps stream rows and hide their loads' latency behind other blocks' work, and ptxas
    /// gave it a few registers more than two blocks of 256 threads leave (one block per
    /// multiprocessor) as its code grew.
    pub const fn min_blocks_per_multiprocessor(self) -> Option<u32> {
        match self {
            Kernel::ProcessRows => Some(2),
            _ => None,
        }
    }

    /// Whether the kernel is a tile kernel that applies the rows' per-entry processing
    /// (`processing` in `FusedArgs` and `TmaArgs`); see [`tma_tile_applies_processing`].
    pub const fn applies_processing(self) -> bool {
        match self {
            Kernel::FusedMma { .. }
            | Kernel::FusedStaged { .. }
            | Kernel::FusedSimt { .. }
            | Kernel::FusedHandoff { .. } => true,
            Kernel::FusedTma { rows, columns, .. } => tma_tile_applies_processing(rows, columns),
            _ => false,
        }
    }

    /// Whether the kernel is a tile kernel that writes each (row, tile)'s log-sum-exp terms
    /// when asked (`tile_sums` in `FusedArgs` and `TmaArgs`): every tile kernel that applies
    /// the per-entry processing, whose processed logits the terms sum.
    pub const fn writes_tile_sums(self) -> bool {
        self.applies_processing()
    }

    /// Whether the kernel is a TMA + `wgmma` tile kernel.
    pub const fn is_tma_tile(self) -> bool {
        matches!(self, Kernel::FusedTma { .. } | Kernel::LogitsTma { .. } | Kernel::FusedHandoff { .. })
    }

    /// Whether the kernel uses sm_90 instructions (TMA, `wgmma`, the tensor-map proxy fence), so
    /// that only the Hopper module holds it.
    pub const fn needs_hopper(self) -> bool {
        self.is_tma_tile() || matches!(self, Kernel::StoreTensorMaps)
    }

    /// The warpgroup-collective `.sync.aligned` ops the kernel's PTX holds exactly once each
    /// (see `xtask`'s check): `(op, fewest, most)`. LLVM treats inline asm as ordinary code
    /// and may duplicate it into both arms of a branch (it did, around `if lane == 0`), which
    /// compiles but hangs on the GPU; a second copy in one kernel is that bug. The commit and
    /// `wait_group 0` appear exactly once, `wait_group 1` at most once (the handoff kernels
    /// wait with `wait_group 0` only).
    pub const fn aligned_ops_written_once(self) -> &'static [(&'static str, usize, usize)] {
        if self.is_tma_tile() {
            &[
                ("wgmma.commit_group.sync.aligned", 1, 1),
                ("wgmma.wait_group.sync.aligned 0", 1, 1),
                ("wgmma.wait_group.sync.aligned 1", 0, 1),
            ]
        } else {
            &[]
        }
    }

    /// The kernel's entry-point name.
    pub fn name(self) -> &'static str {
        KERNELS
            .iter()
            .find(|entry| entry.kernel == self)
            .map(|entry| entry.name)
            .unwrap_or_else(|| panic!("{self:?} is not a kernel of the registry"))
    }

    /// The kernel whose entry point is `name`.
    pub fn named(name: &str) -> Option<Kernel> {
        KERNELS.iter().find(|entry| entry.name == name).map(|entry| entry.kernel)
    }
}

/// A PTX module the host embeds; each is built from the kernel crate for one target.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Module {
    /// sm_80 PTX (ISA 7.4): the `mma.sync` and SIMT tiles and everything but the TMA
    /// kernels. Drivers (CUDA 11.4 and newer) compile it for the device at load time, so it
    /// runs on every NVIDIA GPU from Ampere on (sm_80, sm_86, sm_89, sm_90, sm_100, sm_120).
    Portable,
    /// sm_90a PTX: every kernel, the TMA + `wgmma` tiles included. Arch-specific PTX, so it
    /// loads on compute capability 9.0 only (H100, H200, GH200).
    Hopper,
}

impl Module {
    /// Every module, the portable one first.
    pub const ALL: [Module; 2] = [Module::Portable, Module::Hopper];

    /// Whether this module holds `kernel`.
    pub const fn holds(self, kernel: Kernel) -> bool {
        match self {
            Module::Portable => !kernel.needs_hopper(),
            Module::Hopper => true,
        }
    }

    /// The value of the kernel crate's `flashsample_module` cfg when it is built for this
    /// module.
    pub const fn name(self) -> &'static str {
        match self {
            Module::Portable => "portable",
            Module::Hopper => "hopper",
        }
    }

    /// The architecture of the machine code (`ptxas -arch`) the host embeds for the module
    /// instead of its PTX, where every device that loads the module runs it: the Hopper module,
    /// whose only compute capability (9.0) runs `sm_90a` code, so no device JIT-compiles its
    /// PTX (about 20 s on an H200 with the driver's cache cold). `None`: the portable module
    /// ships PTX, which every GPU from Ampere on compiles for itself.
    pub const fn cubin_arch(self) -> Option<&'static str> {
        match self {
            Module::Portable => None,
            Module::Hopper => Some("sm_90a"),
        }
    }

    /// The oldest compute capability (major, minor) that loads the module, and whether the
    /// module loads only on exactly that one (arch-specific PTX).
    pub const fn compute_capability(self) -> ((u32, u32), bool) {
        match self {
            Module::Portable => ((8, 0), false),
            Module::Hopper => ((9, 0), true),
        }
    }

    /// Whether a device of compute capability `(major, minor)` loads the module.
    pub const fn loads_on(self, major: u32, minor: u32) -> bool {
        let ((oldest_major, oldest_minor), exact) = self.compute_capability();
        if exact {
            major == oldest_major && minor == oldest_minor
        } else {
            major > oldest_major || (major == oldest_major && minor >= oldest_minor)
        }
    }

    /// The kernels this module holds.
    pub fn kernels(self) -> impl Iterator<Item = &'static KernelEntry> {
        KERNELS.iter().filter(move |entry| self.holds(entry.kernel))
    }
}

/// One entry point of the kernel crate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelEntry {
    /// The entry point's name in the PTX, as [`for_each_kernel!`](crate::for_each_kernel)
    /// lists it.
    pub name: &'static str,
    /// What the entry point computes.
    pub kernel: Kernel,
}

/// The list of every kernel, handed to `$callback` as `name => Kind { field: value, … };`
/// entries (`Kind` a [`Kernel`] variant, element types as bare [`ElementType`] variants). The
/// kernel crate passes a macro that defines each entry point; this module one that builds
/// [`KERNELS`].
#[macro_export]
macro_rules! for_each_kernel {
    ($callback:ident) => {
        $callback! {
            fused_bf16_n8 => FusedMma { element: Bf16, columns: 8, chains: false };
            fused_bf16_n16 => FusedMma { element: Bf16, columns: 16, chains: false };
            fused_bf16_n32 => FusedMma { element: Bf16, columns: 32, chains: false };
            fused_f16_n8 => FusedMma { element: F16, columns: 8, chains: false };
            fused_f16_n16 => FusedMma { element: F16, columns: 16, chains: false };
            fused_f16_n32 => FusedMma { element: F16, columns: 32, chains: false };
            fused_staged_bf16_n64 => FusedStaged { element: Bf16, columns: 64, chains: false };
            fused_staged_bf16_n128 => FusedStaged { element: Bf16, columns: 128, chains: false };
            fused_staged_f16_n64 => FusedStaged { element: F16, columns: 64, chains: false };
            fused_staged_f16_n128 => FusedStaged { element: F16, columns: 128, chains: false };
            fused_simt_f32 => FusedSimt { element: F32, chains: false };
            fused_simt_bf16 => FusedSimt { element: Bf16, chains: false };
            fused_simt_f16 => FusedSimt { element: F16, chains: false };
            chains_bf16_n8 => FusedMma { element: Bf16, columns: 8, chains: true };
            chains_bf16_n16 => FusedMma { element: Bf16, columns: 16, chains: true };
            chains_bf16_n32 => FusedMma { element: Bf16, columns: 32, chains: true };
            chains_f16_n8 => FusedMma { element: F16, columns: 8, chains: true };
            chains_f16_n16 => FusedMma { element: F16, columns: 16, chains: true };
            chains_f16_n32 => FusedMma { element: F16, columns: 32, chains: true };
            chains_staged_bf16_n64 => FusedStaged { element: Bf16, columns: 64, chains: true };
            chains_staged_f16_n64 => FusedStaged { element: F16, columns: 64, chains: true };
            chains_simt_f32 => FusedSimt { element: F32, chains: true };
            chains_simt_bf16 => FusedSimt { element: Bf16, chains: true };
            chains_simt_f16 => FusedSimt { element: F16, chains: true };
            logits_gemm_bf16_n8 => LogitsMma { element: Bf16, columns: 8 };
            logits_gemm_bf16_n16 => LogitsMma { element: Bf16, columns: 16 };
            logits_gemm_bf16_n32 => LogitsMma { element: Bf16, columns: 32 };
            logits_gemm_f16_n8 => LogitsMma { element: F16, columns: 8 };
            logits_gemm_f16_n16 => LogitsMma { element: F16, columns: 16 };
            logits_gemm_f16_n32 => LogitsMma { element: F16, columns: 32 };
            logits_staged_bf16_n64 => LogitsStaged { element: Bf16, columns: 64 };
            logits_staged_bf16_n128 => LogitsStaged { element: Bf16, columns: 128 };
            logits_staged_f16_n64 => LogitsStaged { element: F16, columns: 64 };
            logits_staged_f16_n128 => LogitsStaged { element: F16, columns: 128 };
            logits_simt_f32 => LogitsSimt { element: F32 };
            logits_simt_bf16 => LogitsSimt { element: Bf16 };
            logits_simt_f16 => LogitsSimt { element: F16 };
            fused_tma_bf16_m64_n8 => FusedTma { element: Bf16, rows: 64, columns: 8 };
            fused_tma_bf16_m64_n16 => FusedTma { element: Bf16, rows: 64, columns: 16 };
            fused_tma_bf16_m64_n32 => FusedTma { element: Bf16, rows: 64, columns: 32 };
            fused_tma_bf16_m64_n64 => FusedTma { element: Bf16, rows: 64, columns: 64 };
            fused_tma_bf16_m64_n128 => FusedTma { element: Bf16, rows: 64, columns: 128 };
            fused_tma_bf16_m128_n8 => FusedTma { element: Bf16, rows: 128, columns: 8 };
            fused_tma_bf16_m128_n16 => FusedTma { element: Bf16, rows: 128, columns: 16 };
            fused_tma_bf16_m128_n32 => FusedTma { element: Bf16, rows: 128, columns: 32 };
            fused_tma_bf16_m128_n64 => FusedTma { element: Bf16, rows: 128, columns: 64 };
            fused_tma_bf16_m128_n128 => FusedTma { element: Bf16, rows: 128, columns: 128 };
            fused_tma_f16_m64_n8 => FusedTma { element: F16, rows: 64, columns: 8 };
            fused_tma_f16_m64_n16 => FusedTma { element: F16, rows: 64, columns: 16 };
            fused_tma_f16_m64_n32 => FusedTma { element: F16, rows: 64, columns: 32 };
            fused_tma_f16_m64_n64 => FusedTma { element: F16, rows: 64, columns: 64 };
            fused_tma_f16_m64_n128 => FusedTma { element: F16, rows: 64, columns: 128 };
            fused_tma_f16_m128_n8 => FusedTma { element: F16, rows: 128, columns: 8 };
            fused_tma_f16_m128_n16 => FusedTma { element: F16, rows: 128, columns: 16 };
            fused_tma_f16_m128_n32 => FusedTma { element: F16, rows: 128, columns: 32 };
            fused_tma_f16_m128_n64 => FusedTma { element: F16, rows: 128, columns: 64 };
            fused_tma_f16_m128_n128 => FusedTma { element: F16, rows: 128, columns: 128 };
            fused_tma_bf16_h128_n64 => FusedHandoff { element: Bf16, columns: 64 };
            fused_tma_bf16_h128_n128 => FusedHandoff { element: Bf16, columns: 128 };
            fused_tma_f16_h128_n64 => FusedHandoff { element: F16, columns: 64 };
            fused_tma_f16_h128_n128 => FusedHandoff { element: F16, columns: 128 };
            logits_tma_bf16_m64_n8 => LogitsTma { element: Bf16, rows: 64, columns: 8 };
            logits_tma_bf16_m64_n16 => LogitsTma { element: Bf16, rows: 64, columns: 16 };
            logits_tma_bf16_m64_n32 => LogitsTma { element: Bf16, rows: 64, columns: 32 };
            logits_tma_bf16_m64_n64 => LogitsTma { element: Bf16, rows: 64, columns: 64 };
            logits_tma_bf16_m64_n128 => LogitsTma { element: Bf16, rows: 64, columns: 128 };
            logits_tma_bf16_m128_n8 => LogitsTma { element: Bf16, rows: 128, columns: 8 };
            logits_tma_bf16_m128_n16 => LogitsTma { element: Bf16, rows: 128, columns: 16 };
            logits_tma_bf16_m128_n32 => LogitsTma { element: Bf16, rows: 128, columns: 32 };
            logits_tma_bf16_m128_n64 => LogitsTma { element: Bf16, rows: 128, columns: 64 };
            logits_tma_bf16_m128_n128 => LogitsTma { element: Bf16, rows: 128, columns: 128 };
            logits_tma_f16_m64_n8 => LogitsTma { element: F16, rows: 64, columns: 8 };
            logits_tma_f16_m64_n16 => LogitsTma { element: F16, rows: 64, columns: 16 };
            logits_tma_f16_m64_n32 => LogitsTma { element: F16, rows: 64, columns: 32 };
            logits_tma_f16_m64_n64 => LogitsTma { element: F16, rows: 64, columns: 64 };
            logits_tma_f16_m64_n128 => LogitsTma { element: F16, rows: 64, columns: 128 };
            logits_tma_f16_m128_n8 => LogitsTma { element: F16, rows: 128, columns: 8 };
            logits_tma_f16_m128_n16 => LogitsTma { element: F16, rows: 128, columns: 16 };
            logits_tma_f16_m128_n32 => LogitsTma { element: F16, rows: 128, columns: 32 };
            logits_tma_f16_m128_n64 => LogitsTma { element: F16, rows: 128, columns: 64 };
            logits_tma_f16_m128_n128 => LogitsTma { element: F16, rows: 128, columns: 128 };
            sample_logits => SampleLogits {};
            reduce_candidates => ReduceCandidates {};
            sample_listed => SampleListed {};
            sample_chained => SampleChained {};
            sample_unsettled => SampleUnsettled {};
            winner_logits_bf16 => WinnerLogits { element: Bf16 };
            winner_logits_f16 => WinnerLogits { element: F16 };
            winner_logits_f32 => WinnerLogits { element: F32 };
            process_rows => ProcessRows {};
            merge_shards => MergeShards {};
            fill_uniform_bf16 => FillUniform { element: Bf16 };
            fill_uniform_f16 => FillUniform { element: F16 };
            fill_uniform_f32 => FillUniform { element: F32 };
            read_probe => ReadProbe {};
            mma_peak => MmaPeak {};
            gumbel_estimate_error => GumbelEstimateError {};
            advance_steps => AdvanceSteps {};
            accept_drafts => AcceptDrafts {};
            advance_verified => AdvanceVerified {};
            store_tensor_maps => StoreTensorMaps {};
        }
    };
}

macro_rules! kernel_table {
    ($($name:ident => $kind:ident { $($field:ident : $value:tt),* };)*) => {
        /// Every kernel, in the order of [`for_each_kernel!`](crate::for_each_kernel).
        pub const KERNELS: &[KernelEntry] = &[$(
            KernelEntry {
                name: stringify!($name),
                kernel: {
                    #[allow(unused_imports)]
                    use ElementType::*;
                    Kernel::$kind { $($field: $value),* }
                },
            }
        ),*];
    };
}

for_each_kernel!(kernel_table);

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;
    use std::vec::Vec;

    #[test]
    fn names_and_kernels_are_unique() {
        let names: HashSet<_> = KERNELS.iter().map(|e| e.name).collect();
        let kernels: HashSet<_> = KERNELS.iter().map(|e| e.kernel).collect();
        assert_eq!(names.len(), KERNELS.len());
        assert_eq!(kernels.len(), KERNELS.len());
        for entry in KERNELS {
            assert_eq!(entry.kernel.name(), entry.name);
            assert_eq!(Kernel::named(entry.name), Some(entry.kernel));
        }
    }

    #[test]
    fn the_portable_module_holds_everything_but_the_tma_kernels() {
        let portable: Vec<_> = Module::Portable.kernels().map(|e| e.kernel).collect();
        assert!(portable.iter().all(|k| !k.needs_hopper() && !k.is_tma_tile()));
        assert!(portable.contains(&Kernel::AdvanceSteps) && !portable.contains(&Kernel::StoreTensorMaps));
        assert_eq!(Module::Hopper.kernels().count(), KERNELS.len());
        assert_eq!(portable.len(), KERNELS.iter().filter(|e| !e.kernel.needs_hopper()).count());
        assert!(portable.contains(&Kernel::FusedMma { element: ElementType::Bf16, columns: 32, chains: false }));
        assert!(portable.contains(&Kernel::FusedSimt { element: ElementType::F32, chains: false }));
    }

    #[test]
    fn modules_load_on_the_compute_capabilities_they_name() {
        for (major, minor) in [(8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0)] {
            assert!(Module::Portable.loads_on(major, minor), "{major}.{minor}");
        }
        assert!(!Module::Portable.loads_on(7, 5));
        assert!(Module::Hopper.loads_on(9, 0));
        for (major, minor) in [(8, 0), (8, 9), (10, 0), (12, 0)] {
            assert!(!Module::Hopper.loads_on(major, minor), "{major}.{minor}");
        }
    }
}
