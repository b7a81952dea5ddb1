//! Thin wrappers over the PTX instructions that `core::arch::nvptx` does not expose.
//!
//! Every function here is `unsafe` only because it is inline assembly; the `# Safety` line of
//! each says what the caller must guarantee.

use core::arch::asm;
use core::arch::nvptx;

#[inline(always)]
pub fn thread_index() -> u32 {
    // SAFETY: reads a special register.
    unsafe { nvptx::_thread_idx_x() as u32 }
}

#[inline(always)]
pub fn block_index() -> u32 {
    // SAFETY: reads a special register.
    unsafe { nvptx::_block_idx_x() as u32 }
}

#[inline(always)]
pub fn grid_size() -> u32 {
    // SAFETY: reads a special register.
    unsafe { nvptx::_grid_dim_x() as u32 }
}

/// This thread's index in the grid and the grid's thread count (a grid-stride loop's start and
/// step).
#[inline(always)]
pub fn global_thread() -> (u64, u64) {
    // SAFETY: reads a special register.
    let block_dim = unsafe { nvptx::_block_dim_x() } as u64;
    (block_index() as u64 * block_dim + thread_index() as u64, grid_size() as u64 * block_dim)
}

/// Orders this thread's memory accesses before and after it for every thread of the device
/// (`__threadfence`): what a block writes before a fence and an atomic count, a block that
/// sees the count sees too.
///
/// # Safety
/// None beyond inline assembly's; `unsafe` as every PTX wrapper here.
#[inline(always)]
pub unsafe fn fence_device() {
    // SAFETY: a fence; it reads and writes no register.
    unsafe { asm!("fence.sc.gpu;", options(nostack)) }
}

/// Block-wide barrier.
///
/// # Safety
/// Every thread of the block must reach the same barrier.
#[inline(always)]
pub unsafe fn sync_threads() {
    // SAFETY: per this function's contract: every thread of the block reaches the barrier.
    unsafe { nvptx::_syncthreads() }
}

// Warp-collective operations go through LLVM's NVPTX intrinsics, which LLVM knows to be
// `convergent`: it never moves them into control flow that only some lanes take. Inline asm
// carries no such mark; a `pure` asm shuffle whose result only lane 0 used was sunk into
// `if lane == 0` and deadlocked the warp.
unsafe extern "C" {
    #[link_name = "llvm.nvvm.shfl.sync.bfly.i32"]
    fn nvvm_shfl_sync_bfly_i32(member_mask: u32, value: u32, lane_mask: u32, clamp: u32) -> u32;
    #[link_name = "llvm.nvvm.shfl.sync.idx.i32"]
    fn nvvm_shfl_sync_idx_i32(member_mask: u32, value: u32, lane: u32, clamp: u32) -> u32;
    #[link_name = "llvm.nvvm.vote.ballot.sync"]
    fn nvvm_vote_ballot_sync(member_mask: u32, predicate: bool) -> u32;
    #[link_name = "llvm.nvvm.bar.warp.sync"]
    fn nvvm_bar_warp_sync(member_mask: u32);
    #[cfg(flashsample_module = "hopper")]
    #[link_name = "llvm.nvvm.barrier.sync.cnt"]
    fn nvvm_barrier_sync_cnt(id: u32, threads: u32);
    #[link_name = "llvm.nvvm.lg2.approx.ftz.f"]
    fn nvvm_lg2_approx_ftz_f(x: f32) -> f32;
}

/// The hardware's approximate base-2 logarithm (`lg2.approx.ftz.f32`, one MUFU op). Not
/// bit-reproducible on the CPU: only the filter of `flashsample_core::estimate` may use it.
#[inline(always)]
pub fn log2_approx(x: f32) -> f32 {
    // SAFETY: a pure arithmetic intrinsic.
    unsafe { nvvm_lg2_approx_ftz_f(x) }
}

/// Named barrier `id` (`bar.sync id, threads`) for a subset of the block's warps.
///
/// # Safety
/// Exactly `threads` threads (whole warps) reach this barrier with the same `id`.
#[cfg(flashsample_module = "hopper")]
#[inline(always)]
pub unsafe fn sync_named(id: u32, threads: u32) {
    // SAFETY: per this function's contract.
    unsafe { nvvm_barrier_sync_cnt(id, threads) }
}

/// Warp-wide barrier and memory ordering among its lanes (`bar.warp.sync`).
///
/// # Safety
/// All 32 lanes of the warp must execute this call together.
#[inline(always)]
pub unsafe fn sync_warp() {
    // SAFETY: per this function's contract: all 32 lanes execute it.
    unsafe { nvvm_bar_warp_sync(0xffff_ffff) }
}

/// `shfl.sync.bfly`: the value of lane `lane ^ mask`.
///
/// # Safety
/// All 32 lanes of the warp must execute this call together (full mask).
#[inline(always)]
pub unsafe fn shuffle_xor(value: u32, mask: u32) -> u32 {
    // SAFETY: per this function's contract: all 32 lanes execute it (full mask).
    unsafe { nvvm_shfl_sync_bfly_i32(0xffff_ffff, value, mask, 0x1f) }
}

/// [`shuffle_xor`] of a 64-bit value, as two 32-bit shuffles.
///
/// # Safety
/// All 32 lanes of the warp must execute this call together (full mask).
#[inline(always)]
pub unsafe fn shuffle_xor_u64(value: u64, mask: u32) -> u64 {
    // SAFETY: per this function's contract: all 32 lanes execute both shuffles.
    unsafe { (shuffle_xor(value as u32, mask) as u64) | (shuffle_xor((value >> 32) as u32, mask) as u64) << 32 }
}

/// `shfl.sync.idx`: the value of lane `source` (taken modulo 32).
///
/// # Safety
/// All 32 lanes of the warp must execute this call together (full mask).
#[inline(always)]
pub unsafe fn shuffle_idx(value: u32, source: u32) -> u32 {
    // SAFETY: per this function's contract: all 32 lanes execute it (full mask).
    unsafe { nvvm_shfl_sync_idx_i32(0xffff_ffff, value, source, 0x1f) }
}

/// `shfl.sync.idx` from lane 0: lane 0's `value` in every lane. For a value that is already
/// the same in every lane (a warp or warpgroup index) this tells ptxas so, and it can then
/// keep what is computed from it in uniform registers (the `wgmma` descriptors).
///
/// # Safety
/// All 32 lanes of the warp must execute this call together (full mask).
#[cfg(flashsample_module = "hopper")]
#[inline(always)]
pub unsafe fn broadcast_lane0(value: u32) -> u32 {
    // SAFETY: per this function's contract: all 32 lanes execute it (full mask).
    unsafe { shuffle_idx(value, 0) }
}

/// `vote.sync.ballot`: bit `l` set where lane `l`'s `predicate` holds.
///
/// # Safety
/// All 32 lanes of the warp must execute this call together (full mask).
#[inline(always)]
pub unsafe fn ballot(predicate: bool) -> u32 {
    // SAFETY: per this function's contract: all 32 lanes execute it (full mask).
    unsafe { nvvm_vote_ballot_sync(0xffff_ffff, predicate) }
}

/// A 16-byte read-only global load with the PTX `instruction` (a `ld.global.nc….v4.u32`).
macro_rules! load_global_v4 {
    ($instruction:literal, $address:expr) => {{
        let (a, b, c, d): (u32, u32, u32, u32);
        // SAFETY: the caller's contract: the address is 16-byte aligned, readable, and not written
        // during the kernel; the asm only loads.
        unsafe {
            asm!(concat!($instruction, " {{{a}, {b}, {c}, {d}}}, [{p}];"),
                a = out(reg32) a, b = out(reg32) b, c = out(reg32) c, d = out(reg32) d,
                p = in(reg64) $address, options(pure, readonly, nostack));
        }
        [a, b, c, d]
    }};
}

/// 16-byte read-only global load (`ld.global.nc.v4.u32`).
///
/// # Safety
/// `address` must be a 16-byte aligned global address of 16 readable bytes that no thread
/// writes during the kernel.
#[inline(always)]
pub unsafe fn load_global_nc_v4(address: u64) -> [u32; 4] {
    load_global_v4!("ld.global.nc.v4.u32", address)
}

/// 16-byte read-only global load that asks L2 to fetch the whole 256-byte span around it
/// (`ld.global.nc.L2::256B.v4.u32`, PTX 7.4). The `mma.sync` tile's threads each load 16 bytes
/// of a row, so a row's 128-byte line is split over two instructions and the lines of a chunk
/// over many warps; with the hint the first miss of a span brings the rest. On the H200 the
/// tile went from 84.5–89.0 % to 90.9–94.2 % of the read floor at B ≤ 16 (docs/PERF.md); a
/// 128-byte hint gave +0.4 %.
///
/// # Safety
/// As [`load_global_nc_v4`].
#[inline(always)]
pub unsafe fn load_global_nc_v4_l2_256(address: u64) -> [u32; 4] {
    load_global_v4!("ld.global.nc.L2::256B.v4.u32", address)
}

/// 16-byte global store (`st.global.v4.f32`).
///
/// # Safety
/// `address` must be a 16-byte aligned global address of 16 writable bytes.
#[inline(always)]
pub unsafe fn store_global_v4(address: u64, value: [f32; 4]) {
    // SAFETY: per this function's contract: the address is 16-byte aligned and writable; the asm
    // only stores.
    unsafe {
        asm!("st.global.v4.f32 [{p}], {{{a}, {b}, {c}, {d}}};",
            p = in(reg64) address,
            a = in(reg32) value[0], b = in(reg32) value[1], c = in(reg32) value[2], d = in(reg32) value[3],
            options(nostack));
    }
}

/// Converts an IEEE half to f32 exactly (`cvt.f32.f16`).
#[inline(always)]
pub fn f16_to_f32(bits: u16) -> f32 {
    let out: f32;
    // SAFETY: a pure register conversion.
    unsafe {
        asm!("cvt.f32.f16 {o}, {h};", o = out(reg32) out, h = in(reg16) bits,
            options(pure, nomem, nostack));
    }
    out
}

/// Converts an f32 to IEEE half, rounding to nearest even (`cvt.rn.f16.f32`).
#[inline(always)]
pub fn f32_to_f16(value: f32) -> u16 {
    let out: u16;
    // SAFETY: a pure register conversion.
    unsafe {
        asm!("cvt.rn.f16.f32 {h}, {v};", h = out(reg16) out, v = in(reg32) value,
            options(pure, nomem, nostack));
    }
    out
}

/// `D += A·B` for one m16n8k16 tile with bf16 inputs and f32 accumulators. Not `pure`: the
/// mma is warp-collective and must stay where every lane executes it.
///
/// # Safety
/// All 32 lanes must execute it together with their fragments in the mma layout.
#[inline(always)]
pub unsafe fn mma_bf16(acc: &mut [f32; 4], a: [u32; 4], b: [u32; 2]) {
    // SAFETY: register-only asm; the caller's contract puts all 32 lanes here together, as
    // mma.sync.aligned needs.
    unsafe {
        asm!("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {{{d0}, {d1}, {d2}, {d3}}}, {{{a0}, {a1}, {a2}, {a3}}}, {{{b0}, {b1}}}, {{{d0}, {d1}, {d2}, {d3}}};",
            d0 = inout(reg32) acc[0], d1 = inout(reg32) acc[1], d2 = inout(reg32) acc[2], d3 = inout(reg32) acc[3],
            a0 = in(reg32) a[0], a1 = in(reg32) a[1], a2 = in(reg32) a[2], a3 = in(reg32) a[3],
            b0 = in(reg32) b[0], b1 = in(reg32) b[1],
            options(nomem, nostack));
    }
}

/// `D += A·B` for one m16n8k16 tile with f16 inputs and f32 accumulators.
///
/// # Safety
/// As [`mma_bf16`].
#[inline(always)]
pub unsafe fn mma_f16(acc: &mut [f32; 4], a: [u32; 4], b: [u32; 2]) {
    // SAFETY: register-only asm; the caller's contract puts all 32 lanes here together, as
    // mma.sync.aligned needs.
    unsafe {
        asm!("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {{{d0}, {d1}, {d2}, {d3}}}, {{{a0}, {a1}, {a2}, {a3}}}, {{{b0}, {b1}}}, {{{d0}, {d1}, {d2}, {d3}}};",
            d0 = inout(reg32) acc[0], d1 = inout(reg32) acc[1], d2 = inout(reg32) acc[2], d3 = inout(reg32) acc[3],
            a0 = in(reg32) a[0], a1 = in(reg32) a[1], a2 = in(reg32) a[2], a3 = in(reg32) a[3],
            b0 = in(reg32) b[0], b1 = in(reg32) b[1],
            options(nomem, nostack));
    }
}

/// The shared-window address of a generic pointer into shared memory.
#[inline(always)]
pub fn shared_address<T>(pointer: *const T) -> u32 {
    let address: u64;
    // SAFETY: an address conversion; nothing is read.
    unsafe {
        asm!("cvta.to.shared.u64 {a}, {p};", a = out(reg64) address, p = in(reg64) pointer as u64,
            options(pure, nomem, nostack));
    }
    address as u32
}

/// Copies 16 bytes from global memory into shared memory without passing through registers,
/// caching them in L2 only (`cp.async.cg`); bytes past `source_bytes` (0 or 16) are written as
/// zeros. The copy joins this thread's current group ([`cp_async_commit`]).
///
/// # Safety
/// `destination` is a 16-byte aligned shared-window address of this block's shared memory
/// that no thread reads or writes until the group is waited for; `source` a 16-byte aligned
/// global address of 16 readable bytes (read only when `source_bytes` is 16).
#[inline(always)]
pub unsafe fn cp_async_16(destination: u32, source: u64, source_bytes: u32) {
    // SAFETY: per this function's contract.
    unsafe {
        asm!("cp.async.cg.shared.global [{d}], [{s}], 16, {n};",
            d = in(reg32) destination, s = in(reg64) source, n = in(reg32) source_bytes, options(nostack));
    }
}

/// As [`cp_async_16`], asking L2 to fetch the whole 256-byte span around the source
/// (`.L2::256B`): the staged tile copies 128 bytes of each row of `W` per stage, and the
/// span brings the next stage's bytes of the row with them.
///
/// # Safety
/// As [`cp_async_16`].
#[inline(always)]
pub unsafe fn cp_async_16_l2_256(destination: u32, source: u64, source_bytes: u32) {
    // SAFETY: per this function's contract.
    unsafe {
        asm!("cp.async.cg.shared.global.L2::256B [{d}], [{s}], 16, {n};",
            d = in(reg32) destination, s = in(reg64) source, n = in(reg32) source_bytes, options(nostack));
    }
}

/// Closes this thread's current group of [`cp_async_16`] copies.
///
/// # Safety
/// None beyond inline assembly's.
#[inline(always)]
pub unsafe fn cp_async_commit() {
    // SAFETY: bookkeeping of this thread's copies.
    unsafe { asm!("cp.async.commit_group;", options(nostack)) }
}

/// Waits until at most `PENDING` of this thread's committed groups of copies are in flight;
/// the others' bytes are then in shared memory for this thread (a block barrier after it
/// makes them visible to the block).
///
/// # Safety
/// None beyond inline assembly's.
#[inline(always)]
pub unsafe fn cp_async_wait<const PENDING: u32>() {
    // SAFETY: waits on this thread's copies; the memory clobber keeps shared reads after it.
    unsafe { asm!("cp.async.wait_group {n};", n = const PENDING, options(nostack)) }
}

/// Four 8 × 8 matrices of 16-bit elements from shared memory in the `mma` fragment layout
/// (`ldmatrix.sync.aligned.m8n8.x4`): lanes `8m .. 8m + 8` give the addresses of matrix
/// `m`'s eight rows (16 bytes each), and lane `4g + t` gets elements `2t`, `2t + 1` of row
/// `g` of matrix `m` in word `m`.
///
/// # Safety
/// All 32 lanes execute it together, each with a 16-byte aligned shared-window address of
/// 16 bytes of this block's shared memory that no thread writes meanwhile.
#[inline(always)]
pub unsafe fn load_matrix_x4(address: u32) -> [u32; 4] {
    let (a, b, c, d): (u32, u32, u32, u32);
    // SAFETY: per this function's contract; not `pure`: warp-collective, it must stay where every
    // lane executes it.
    unsafe {
        asm!("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {{{a}, {b}, {c}, {d}}}, [{p}];",
            a = out(reg32) a, b = out(reg32) b, c = out(reg32) c, d = out(reg32) d,
            p = in(reg32) address, options(readonly, nostack));
    }
    [a, b, c, d]
}
