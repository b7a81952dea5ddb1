//! Benchmark and check helpers: random inputs made on the device, the read-bandwidth probe,
//! and the exhaustive check of the noise estimate's error bound.

use core::sync::atomic::{AtomicU32, Ordering};

use flashsample_core::abi::{
    EstimateErrorArgs, FillArgs, MMA_PEAK_UNIT_MMAS, MMA_PEAK_UNITS, MmaPeakArgs, ReadProbeArgs,
};
use flashsample_core::estimate::gumbel_estimate;
use flashsample_core::gumbel::gumbel;
use flashsample_core::noise::key;
use flashsample_core::philox::philox4x32_10;

use crate::arch;
use crate::element::{Bf16, F16, F32};

/// Storing an f32 in an element type, rounding to nearest even.
pub trait Store {
    /// # Safety
    /// `index` must be in bounds of the buffer at `base`.
    unsafe fn store(base: u64, index: u64, value: f32);
}

impl Store for F32 {
    #[inline(always)]
    unsafe fn store(base: u64, index: u64, value: f32) {
        // SAFETY: as the trait's contract: `base` holds more than `index` f32 elements.
        unsafe { *(base as *mut f32).add(index as usize) = value };
    }
}

impl Store for Bf16 {
    #[inline(always)]
    unsafe fn store(base: u64, index: u64, value: f32) {
        let bits = value.to_bits();
        let rounded = (bits + 0x7fff + ((bits >> 16) & 1)) >> 16;
        // SAFETY: as the trait's contract: `base` holds more than `index` 16-bit elements.
        unsafe { *(base as *mut u16).add(index as usize) = rounded as u16 };
    }
}

impl Store for F16 {
    #[inline(always)]
    unsafe fn store(base: u64, index: u64, value: f32) {
        // SAFETY: as the trait's contract: `base` holds more than `index` 16-bit elements.
        unsafe { *(base as *mut u16).add(index as usize) = arch::f32_to_f16(value) };
    }
}

/// # Safety
/// `args.out` holds `args.count` elements of `T`.
#[inline(always)]
pub unsafe fn fill_uniform<T: Store>(args: &FillArgs) {
    let (mut group, stride) = arch::global_thread();
    let groups = args.count.div_ceil(4);
    while group < groups {
        let words = philox4x32_10([group as u32, (group >> 32) as u32, 0, 0], key(args.seed));
        for (r, word) in words.iter().enumerate() {
            let index = 4 * group + r as u64;
            if index < args.count {
                let unit = (word >> 8) as f32 * (1.0 / 8_388_608.0) - 1.0;
                // SAFETY: `index < count`, and `out` holds `count` elements of `T` (per this
                // function's contract).
                unsafe { T::store(args.out.address(), index, unit * args.scale) };
            }
        }
        group += stride;
    }
}

/// # Safety
/// `args.source` holds `args.bytes` readable bytes (a multiple of 64); `args.sink` one u32.
#[inline(always)]
pub unsafe fn read_probe(args: &ReadProbeArgs) {
    let (thread, stride) = arch::global_thread();
    let vectors = args.bytes / 16;
    let source = args.source.address();
    let mut checksum = 0u32;
    let mut v = thread;
    while v + 3 * stride < vectors {
        // SAFETY: `v + 3·stride < vectors`: all four 16-byte loads lie within `bytes`, which per
        // this function's contract are readable and 64-byte aligned in count.
        let [a, b, c, d] = unsafe {
            [
                arch::load_global_nc_v4(source + 16 * v),
                arch::load_global_nc_v4(source + 16 * (v + stride)),
                arch::load_global_nc_v4(source + 16 * (v + 2 * stride)),
                arch::load_global_nc_v4(source + 16 * (v + 3 * stride)),
            ]
        };
        checksum ^= a[0] ^ a[1] ^ a[2] ^ a[3] ^ b[0] ^ b[1] ^ b[2] ^ b[3];
        checksum ^= c[0] ^ c[1] ^ c[2] ^ c[3] ^ d[0] ^ d[1] ^ d[2] ^ d[3];
        v += 4 * stride;
    }
    while v < vectors {
        // SAFETY: `v < vectors`: within `bytes` (per this function's contract).
        let a = unsafe { arch::load_global_nc_v4(source + 16 * v) };
        checksum ^= a[0] ^ a[1] ^ a[2] ^ a[3];
        v += stride;
    }
    // A data-dependent store the compiler cannot drop; it almost never happens.
    if checksum == 0x9e37_79b9 {
        // SAFETY: `sink` is one writable u32 (per this function's contract).
        unsafe { *args.sink.as_mut_ptr() = checksum };
    }
}

/// # Safety
/// `args.out` is a zeroed, writable `u32`; every thread of the grid calls it.
#[inline(always)]
pub unsafe fn gumbel_estimate_error(args: &EstimateErrorArgs) {
    let (thread, stride) = arch::global_thread();
    let mut worst = 0.0f32;
    let mut x = thread;
    while x < 1 << 32 {
        let word = x as u32;
        let difference = gumbel_estimate(word, arch::log2_approx) - gumbel(word);
        let error = if difference < 0.0 { -difference } else { difference };
        // NaN fails every comparison; it counts as an infinite error.
        worst =
            if error > worst || error.is_nan() { if error.is_nan() { f32::INFINITY } else { error } } else { worst };
        x += stride;
    }
    // Non-negative floats order as their bits do, so an integer max merges them.
    let mut bits = worst.to_bits();
    for mask in [16, 8, 4, 2, 1] {
        // SAFETY: every thread of the grid runs this loop the same number of times, so all 32 lanes
        // shuffle together.
        let other = unsafe { arch::shuffle_xor(bits, mask) };
        bits = if other > bits { other } else { bits };
    }
    if arch::thread_index().is_multiple_of(32) {
        // SAFETY: `out` is a valid, aligned u32 per this function's contract.
        unsafe { AtomicU32::from_ptr(args.out.as_mut_ptr()) }.fetch_max(bits, Ordering::Relaxed);
    }
}

/// Independent accumulators of the `mma.sync` peak probe.
const PEAK_CHAINS: usize = 8;

/// The `mma.sync` peak probe: the grid's warps share [`MMA_PEAK_UNITS`] units of
/// [`MMA_PEAK_UNIT_MMAS`] multiplies of fixed fragments, over [`PEAK_CHAINS`] independent
/// accumulators.
///
/// # Safety
/// Launched in whole warps; `args.sink` holds one u32.
#[inline(always)]
pub unsafe fn mma_peak(args: &MmaPeakArgs) {
    let (thread, threads) = arch::global_thread();
    let (warp, warps) = (thread / 32, threads / 32);
    let lane = arch::thread_index() % 32;
    // bf16 pairs of small values (2⁻⁸ and 2⁻⁹ scaled by the lane), so that no sum overflows.
    let a = [0x3b80_3b00 ^ lane, 0x3b00_3b80 ^ lane, 0x3b80_3b80, 0x3b00_3b00];
    let b = [0x3b80_3b00 ^ (lane << 16), 0x3b00_3b80];
    let mut acc = [[0.0f32; 4]; PEAK_CHAINS];
    let mut unit = warp;
    // Uniform per warp (every lane has the same `warp`), so all 32 lanes run the same trips.
    while unit < MMA_PEAK_UNITS {
        for _ in 0..MMA_PEAK_UNIT_MMAS as usize / PEAK_CHAINS {
            for chain in &mut acc {
                // SAFETY: all 32 lanes of the warp run the same trips (the loop bounds depend on the
                // warp only).
                unsafe { arch::mma_bf16(chain, a, b) };
            }
        }
        unit += warps;
    }
    let mut checksum = 0u32;
    for chain in &acc {
        for value in chain {
            checksum ^= value.to_bits();
        }
    }
    // A data-dependent store the compiler cannot drop; it almost never happens.
    if checksum == 0x9e37_79b9 {
        // SAFETY: per this function's contract `sink` holds one u32.
        unsafe { *args.sink.as_mut_ptr() = checksum };
    }
}
