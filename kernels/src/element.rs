//! The element types a kernel can read: how to load one value and which mma shape takes it.

use crate::{arch, hopper};

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
        unsafe { *(address as *const f32) }
    }
}

impl Element for Bf16 {
    const BYTES: u64 = 2;
    #[inline(always)]
    unsafe fn load(address: u64) -> f32 {
        f32::from_bits((unsafe { *(address as *const u16) } as u32) << 16)
    }
}

impl Element for F16 {
    const BYTES: u64 = 2;
    #[inline(always)]
    unsafe fn load(address: u64) -> f32 {
        arch::f16_to_f32(unsafe { *(address as *const u16) })
    }
}

impl MmaElement for Bf16 {
    #[inline(always)]
    unsafe fn mma(acc: &mut [f32; 4], a: [u32; 4], b: [u32; 2]) {
        unsafe { arch::mma_bf16(acc, a, b) }
    }
}

impl MmaElement for F16 {
    #[inline(always)]
    unsafe fn mma(acc: &mut [f32; 4], a: [u32; 4], b: [u32; 2]) {
        unsafe { arch::mma_f16(acc, a, b) }
    }
}

/// A 16-bit type the warpgroup tensor cores (`wgmma`) take, for every tile width in use.
pub trait WgmmaElement: MmaElement {
    /// `acc (+)= A·B` over one k16 step for a tile of `2·R` columns (`R` accumulators per
    /// thread); see [`hopper::m64n8_bf16`].
    ///
    /// # Safety
    /// As [`hopper::m64n8_bf16`]; `R` is one of 4, 8, 16, 32, 64.
    unsafe fn wgmma<const R: usize>(acc: &mut [f32; R], a: u64, b: u64, accumulate: u32);
}

/// Reinterprets `[f32; R]` as `[f32; S]`; only called where `R == S`.
#[inline(always)]
fn same_array<const R: usize, const S: usize>(acc: &mut [f32; R]) -> &mut [f32; S] {
    debug_assert!(R == S);
    // SAFETY: the callers below match on `R`, so both arrays have the same length.
    unsafe { &mut *(acc as *mut [f32; R] as *mut [f32; S]) }
}

macro_rules! wgmma_element {
    ($element:ty, $n8:ident, $n16:ident, $n32:ident, $n64:ident, $n128:ident) => {
        impl WgmmaElement for $element {
            #[inline(always)]
            unsafe fn wgmma<const R: usize>(acc: &mut [f32; R], a: u64, b: u64, accumulate: u32) {
                unsafe {
                    match R {
                        4 => hopper::$n8(same_array(acc), a, b, accumulate),
                        8 => hopper::$n16(same_array(acc), a, b, accumulate),
                        16 => hopper::$n32(same_array(acc), a, b, accumulate),
                        32 => hopper::$n64(same_array(acc), a, b, accumulate),
                        64 => hopper::$n128(same_array(acc), a, b, accumulate),
                        _ => core::arch::nvptx::trap(),
                    }
                }
            }
        }
    };
}

wgmma_element!(Bf16, m64n8_bf16, m64n16_bf16, m64n32_bf16, m64n64_bf16, m64n128_bf16);
wgmma_element!(F16, m64n8_f16, m64n16_f16, m64n32_f16, m64n64_f16, m64n128_f16);
