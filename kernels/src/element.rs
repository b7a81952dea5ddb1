//! The element types a kernel can read: how to load one value and which mma shape takes it.

use crate::arch;

/// A storage type of `W` and `H`.
pub trait Element {
    /// Bytes per element.
    const BYTES: u64;

    /// Loads the element at `address` as f32 (exact for every type here).
    ///
    /// # Safety
    /// `address` must be a readable global address aligned to `BYTES`.
    unsafe fn load(address: u64) -> f32;
}

/// A 16-bit type the tensor cores multiply exactly into f32 accumulators.
pub trait MmaElement: Element {
    /// `acc += A·B` for one m16n8k16 tile.
    ///
    /// # Safety
    /// As [`arch::mma_bf16`].
    unsafe fn mma(acc: &mut [f32; 4], a: [u32; 4], b: [u32; 2]);
}

pub struct F32;
pub struct Bf16;
pub struct F16;

impl Element for F32 {
    const BYTES: u64 = 4;
    #[inline(always)]
    unsafe fn load(address: u64) -> f32 {
        // SAFETY: per this function's contract: `address` is an aligned f32 of the matrix.
        unsafe { *(address as *const f32) }
    }
}

impl Element for Bf16 {
    const BYTES: u64 = 2;
    #[inline(always)]
    unsafe fn load(address: u64) -> f32 {
        // SAFETY: per this function's contract: `address` is an aligned 16-bit element of the
        // matrix.
        f32::from_bits((unsafe { *(address as *const u16) } as u32) << 16)
    }
}

impl Element for F16 {
    const BYTES: u64 = 2;
    #[inline(always)]
    unsafe fn load(address: u64) -> f32 {
        // SAFETY: per this function's contract: `address` is an aligned 16-bit element of the
        // matrix.
        arch::f16_to_f32(unsafe { *(address as *const u16) })
    }
}

impl MmaElement for Bf16 {
    #[inline(always)]
    unsafe fn mma(acc: &mut [f32; 4], a: [u32; 4], b: [u32; 2]) {
        // SAFETY: as this trait method's contract (all lanes together).
        unsafe { arch::mma_bf16(acc, a, b) }
    }
}

impl MmaElement for F16 {
    #[inline(always)]
    unsafe fn mma(acc: &mut [f32; 4], a: [u32; 4], b: [u32; 2]) {
        // SAFETY: as this trait method's contract (all lanes together).
        unsafe { arch::mma_f16(acc, a, b) }
    }
}
