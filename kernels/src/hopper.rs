//! Hopper (sm_90a) primitives: shared-memory barriers (`mbarrier`), TMA tensor loads and the
//! warpgroup tensor-core op `wgmma.mma_async`, as thin inline-PTX wrappers.
//!
//! Shared-memory operands are 32-bit addresses in the shared window ([`crate::arch::shared_address`]).
//! Only the address conversion is `pure`; every other asm here has an effect the compiler
//! cannot see (barrier phase, asynchronous copy, asynchronous register writes), so LLVM keeps
//! it in order, but it may still duplicate it into both arms of a branch: see the invariant in
//! `tma_gemm.rs` on aligned ops.

use core::arch::asm;

use crate::element::{Bf16, F16, MmaElement};

/// `mbarrier.init`: a barrier at `bar` expecting `count` arrivals per phase.
///
/// # Safety
/// `bar` is an 8-byte aligned shared address no other thread uses until a block barrier.
#[inline(always)]
pub unsafe fn barrier_init(bar: u32, count: u32) {
    // SAFETY: per this function's contract: `bar` is this thread's alone until the block barrier.
    unsafe {
        asm!("mbarrier.init.shared::cta.b64 [{b}], {c};", b = in(reg32) bar, c = in(reg32) count, options(nostack))
    }
}

/// Makes initialised barriers visible to the asynchronous (TMA) proxy.
///
/// # Safety
/// Call after [`barrier_init`] and before the block barrier that publishes the barriers.
#[inline(always)]
pub unsafe fn fence_barrier_init() {
    // SAFETY: per this function's contract: after the barriers' init, before the block barrier.
    unsafe { asm!("fence.mbarrier_init.release.cluster;", options(nostack)) }
}

/// One arrival that also announces `bytes` of TMA traffic the phase must wait for.
///
/// # Safety
/// `bar` is an initialised barrier.
#[inline(always)]
pub unsafe fn barrier_arrive_expect_bytes(bar: u32, bytes: u32) {
    // SAFETY: per this function's contract: `bar` is initialised.
    unsafe {
        asm!("mbarrier.arrive.expect_tx.shared::cta.b64 _, [{b}], {n};", b = in(reg32) bar, n = in(reg32) bytes,
            options(nostack))
    }
}

/// One arrival.
///
/// # Safety
/// `bar` is an initialised barrier.
#[inline(always)]
pub unsafe fn barrier_arrive(bar: u32) {
    // SAFETY: per this function's contract: `bar` is initialised.
    unsafe { asm!("mbarrier.arrive.shared::cta.b64 _, [{b}];", b = in(reg32) bar, options(nostack)) }
}

/// Whether the phase of parity `parity` of `bar` has completed (`mbarrier.try_wait.parity`,
/// which may suspend the thread for a while before answering false).
///
/// # Safety
/// `bar` is an initialised barrier.
#[inline(always)]
pub unsafe fn barrier_try_wait(bar: u32, parity: u32) -> bool {
    let done: u32;
    // SAFETY: per this function's contract: `bar` is initialised; the asm only reads it.
    unsafe {
        asm!("{{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [{b}], {q}; selp.u32 {d}, 1, 0, p; }}",
            d = out(reg32) done, b = in(reg32) bar, q = in(reg32) parity, options(nostack));
    }
    done != 0
}

/// Spins until the phase of parity `parity` of `bar` has completed.
///
/// # Safety
/// `bar` is an initialised barrier.
#[inline(always)]
pub unsafe fn barrier_wait(bar: u32, parity: u32) {
    // SAFETY: per this function's contract: `bar` is initialised.
    while !unsafe { barrier_try_wait(bar, parity) } {}
}

/// Acquires the tensor map at global address `map` for this thread's TMA operations: the host
/// wrote it with a copy, or the tensor-map writer with stores, before the launch, and the CUDA
/// programming guide requires this fence before a tensor map in global memory is used.
///
/// # Safety
/// `map` is the global address of a 128-byte tensor map.
#[inline(always)]
pub unsafe fn fence_tensor_map(map: u64) {
    // SAFETY: per this function's contract: `map` is a 128-byte tensor map in global memory.
    unsafe { asm!("fence.proxy.tensormap::generic.acquire.sys [{m}], 128;", m = in(reg64) map, options(nostack)) }
}

/// Releases this thread's earlier stores of a tensor map to the tensor-map proxy, for a later
/// kernel's [`fence_tensor_map`].
///
/// # Safety
/// None beyond inline assembly: a fence.
#[inline(always)]
pub unsafe fn release_tensor_map() {
    // SAFETY: a fence has no operands.
    unsafe { asm!("fence.proxy.tensormap::generic.release.gpu;", options(nostack)) }
}

/// TMA: copies the box at element coordinates `(inner, outer)` of the tensor described by the
/// `CUtensorMap` at global address `map` into shared memory at `destination`, and signals its
/// bytes on `bar`. Coordinates outside the tensor read as zeros.
///
/// # Safety
/// `map` is a valid tensor map in global memory that no one writes during the kernel;
/// `destination` has room for the box and the alignment its swizzle needs; `bar` is an
/// initialised barrier whose phase expects these bytes.
#[inline(always)]
pub unsafe fn tma_load_2d(destination: u32, map: u64, inner: i32, outer: i32, bar: u32) {
    // SAFETY: per this function's contract: the map, destination and barrier are as the op needs.
    unsafe {
        asm!("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [{d}], [{m}, {{{x}, {y}}}], [{b}];",
            d = in(reg32) destination, m = in(reg64) map, x = in(reg32) inner, y = in(reg32) outer, b = in(reg32) bar,
            options(nostack));
    }
}

/// Orders register accesses before the next `wgmma.mma_async` of the warpgroup.
///
/// # Safety
/// All 128 threads of the warpgroup execute it together.
#[inline(always)]
pub unsafe fn wgmma_fence() {
    // SAFETY: per this function's contract: the whole warpgroup executes it.
    unsafe { asm!("wgmma.fence.sync.aligned;", options(nostack)) }
}

/// Closes the group of `wgmma.mma_async` issued since the last commit.
///
/// # Safety
/// All 128 threads of the warpgroup execute it together.
#[inline(always)]
pub unsafe fn wgmma_commit() {
    // SAFETY: per this function's contract: the whole warpgroup executes it.
    unsafe { asm!("wgmma.commit_group.sync.aligned;", options(nostack)) }
}

/// Waits until at most `PENDING` committed groups are still running.
///
/// # Safety
/// All 128 threads of the warpgroup execute it together.
#[inline(always)]
pub unsafe fn wgmma_wait<const PENDING: u32>() {
    // SAFETY: per this function's contract: the whole warpgroup executes it.
    unsafe { asm!("wgmma.wait_group.sync.aligned {n};", n = const PENDING, options(nostack)) }
}

/// Bytes per row of a swizzled tile: 64 16-bit elements, the span of the 128-byte swizzle.
pub const SWIZZLE_ROW_BYTES: u32 = 128;

/// The `wgmma` descriptor of a K-major operand in shared memory, laid out by a TMA load with
/// 128-byte swizzle: rows of 128 bytes, 8-row atoms of 1024 bytes (the stride between 8-row
/// groups, SBO). The leading offset is unused for this layout (set to 1).
///
/// Only the low word depends on the address (its bits 0–13 hold `address / 16`); the high
/// word is a constant. Kept as the low word, so that stepping through a stage is a 32-bit add
/// that ptxas does in uniform registers, not a 64-bit add or a re-encoding per `wgmma`.
#[derive(Clone, Copy)]
pub struct SwizzledDescriptor {
    low: u32,
}

impl SwizzledDescriptor {
    /// The high word: SBO 1024 bytes (in 16-byte units) and the 128-byte swizzle mode.
    const HIGH: u32 = ((8 * SWIZZLE_ROW_BYTES) >> 4) | (1 << 30);
    /// The low word's leading byte offset field (bits 16–29): 1.
    const LEADING_OFFSET: u32 = 1 << 16;

    /// The descriptor of the operand at shared address `address` (16-byte aligned). Shared
    /// addresses on sm_90 are below 2¹⁸ (at most 228 KiB per block), so `address / 16` fits
    /// the 14-bit field without a mask.
    #[inline(always)]
    pub fn at(address: u32) -> SwizzledDescriptor {
        SwizzledDescriptor { low: (address >> 4) + Self::LEADING_OFFSET }
    }

    /// The descriptor of the operand `bytes` (a multiple of 16) further on, in the same
    /// block's shared memory. Stepping 16 elements of K inside a row is 32 bytes.
    #[inline(always)]
    pub fn advanced(self, bytes: u32) -> SwizzledDescriptor {
        SwizzledDescriptor { low: self.low + (bytes >> 4) }
    }

    /// The 64-bit descriptor `wgmma` takes.
    #[inline(always)]
    pub fn bits(self) -> u64 {
        ((Self::HIGH as u64) << 32) | self.low as u64
    }
}

macro_rules! wgmma_shape {
    ($bf16:ident, $f16:ident, $n:literal, $regs:literal, [$first:literal $(, $rest:literal)*]) => {
        wgmma_shape!(@one $bf16, "bf16", $n, $regs, [$first $(, $rest)*]);
        wgmma_shape!(@one $f16, "f16", $n, $regs, [$first $(, $rest)*]);
    };
    (@one $name:ident, $ty:literal, $n:literal, $regs:literal, [$first:literal $(, $rest:literal)*]) => {
        /// `acc (+)= A·B` for a 64-row slice of `A` and all columns of `B`, both K-major in
        /// shared memory (descriptors), f32 accumulators; `accumulate == 0` overwrites `acc`.
        ///
        /// # Safety
        /// All 128 threads of the warpgroup issue it together after [`wgmma_fence`]; `acc` is
        /// not read or written until a [`wgmma_wait`] covers the op's group.
        #[inline(always)]
        pub unsafe fn $name(acc: &mut [f32; $regs], a: u64, b: u64, accumulate: u32) {
            // SAFETY: per this function's contract: the whole warpgroup issues it after a fence,
            // and `acc` stays untouched until a wait covers it.
            unsafe {
                asm!(
                    concat!(
                        "{{ .reg .pred p; setp.ne.b32 p, {flag}, 0; wgmma.mma_async.sync.aligned.m64n", $n,
                        "k16.f32.", $ty, ".", $ty, " {{{", $first, "}" $(, ",{", $rest, "}")*,
                        "}}, {da}, {db}, p, 1, 1, 0, 0; }}"
                    ),
                    inout(reg32) acc[$first], $(inout(reg32) acc[$rest],)*
                    da = in(reg64) a, db = in(reg64) b, flag = in(reg32) accumulate,
                    options(nostack)
                );
            }
        }
    };
}

wgmma_shape!(m64n8_bf16, m64n8_f16, "8", 4, [0, 1, 2, 3]);
wgmma_shape!(m64n16_bf16, m64n16_f16, "16", 8, [0, 1, 2, 3, 4, 5, 6, 7]);
wgmma_shape!(m64n32_bf16, m64n32_f16, "32", 16, [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]);
wgmma_shape!(
    m64n64_bf16,
    m64n64_f16,
    "64",
    32,
    [
        0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29,
        30, 31
    ]
);
wgmma_shape!(
    m64n128_bf16,
    m64n128_f16,
    "128",
    64,
    [
        0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29,
        30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57,
        58, 59, 60, 61, 62, 63
    ]
);

/// A 16-bit type the warpgroup tensor cores (`wgmma`) take, for every tile width in use.
pub trait WgmmaElement: MmaElement {
    /// `acc (+)= A·B` over one k16 step for a tile of `2·R` columns (`R` accumulators per
    /// thread); see [`m64n8_bf16`].
    ///
    /// # Safety
    /// As [`m64n8_bf16`]; `R` is one of 4, 8, 16, 32, 64.
    unsafe fn wgmma<const R: usize>(acc: &mut [f32; R], a: u64, b: u64, accumulate: u32);
}

/// Reinterprets `[f32; R]` as `[f32; S]`; only called where `R == S`.
#[inline(always)]
fn same_array<const R: usize, const S: usize>(acc: &mut [f32; R]) -> &mut [f32; S] {
    // Folded at compile time (both are constants): no code in the kernels.
    assert!(R == S);
    // SAFETY: `R == S` (asserted), so both arrays have the same length and layout.
    unsafe { &mut *(acc as *mut [f32; R] as *mut [f32; S]) }
}

macro_rules! wgmma_element {
    ($element:ty, $n8:ident, $n16:ident, $n32:ident, $n64:ident, $n128:ident) => {
        impl WgmmaElement for $element {
            #[inline(always)]
            unsafe fn wgmma<const R: usize>(acc: &mut [f32; R], a: u64, b: u64, accumulate: u32) {
                // SAFETY: as the trait method's contract; each arm is the wrapper for `R`
                // accumulators, and `same_array` reinterprets `acc` only when `R` matches.
                unsafe {
                    match R {
                        4 => $n8(same_array(acc), a, b, accumulate),
                        8 => $n16(same_array(acc), a, b, accumulate),
                        16 => $n32(same_array(acc), a, b, accumulate),
                        32 => $n64(same_array(acc), a, b, accumulate),
                        64 => $n128(same_array(acc), a, b, accumulate),
                        _ => core::arch::nvptx::trap(),
                    }
                }
            }
        }
    };
}

wgmma_element!(Bf16, m64n8_bf16, m64n16_bf16, m64n32_bf16, m64n64_bf16, m64n128_bf16);
wgmma_element!(F16, m64n8_f16, m64n16_f16, m64n32_f16, m64n64_f16, m64n128_f16);
