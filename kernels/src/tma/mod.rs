//! The Hopper tiles (TMA + `wgmma`, sm_90a), split by role as CUTLASS 3 and ThunderKittens
//! name them:
//! - [`pipeline`]: the ring of shared-memory stages and its full/empty barriers;
//! - [`producer`]: the thread that streams `W` and `H` boxes into the ring with TMA;
//! - [`mainloop`]: a consumer warpgroup's `wgmma` multiplies over an item's stages;
//! - [`scheduler`]: the order of a block's work items;
//! - [`fragments`]: the `wgmma` accumulator layout and the lane transposes that give each
//!   thread four consecutive vocabulary rows;
//! - [`race`]: the estimate-then-exact sampling race over the lanes that share a column;
//! - [`epilogue`]: what an item's accumulators become (candidates or f32 logits);
//! - the kernels that compose them: [`cooperative`] (the cooperative and ping-pong schedules,
//!   whose consumers run the epilogue themselves) and [`handoff`] (the epilogue in warps of its
//!   own).
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
//! the threads that read it are done (`empty` barrier, one arrival per thread). The
//! schedules that share the ring are in [`cooperative`] and [`handoff`].
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
//! by [`fragments::transpose_quad`], so noise stays keyed by vocabulary index, never by tile position.

pub(crate) mod cooperative;
mod epilogue;
mod fragments;
pub(crate) mod handoff;
mod mainloop;
mod pipeline;
mod producer;
mod race;
mod scheduler;

use flashsample_core::abi::TMA_CONSUMER_WARPS;

/// Threads of a warpgroup.
const WARPGROUP_THREADS: u32 = 128;
/// Consumer warpgroups.
const CONSUMER_WARPGROUPS: u32 = TMA_CONSUMER_WARPS / 4;
