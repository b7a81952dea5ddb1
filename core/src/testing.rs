//! Inputs of the unit tests.

use crate::philox::philox4x32_10;
use std::vec::Vec;

/// `n` uniform floats in `[0, 1)` from Philox under `seed`.
pub fn uniforms(n: usize, seed: u32) -> Vec<f32> {
    (0..n as u32)
        .flat_map(|block| philox4x32_10([block, 0, 0, 0], [seed, 0x5eed]))
        .take(n)
        .map(|word| (word >> 8) as f32 / (1u32 << 24) as f32)
        .collect()
}

/// Standard normal values (Box–Muller over [`uniforms`]).
pub fn normals(n: usize, seed: u32) -> Vec<f32> {
    let u = uniforms(2 * n, seed);
    (0..n)
        .map(|i| {
            let (a, b) = ((u[2 * i] as f64).max(1e-12), u[2 * i + 1] as f64);
            ((-2.0 * a.ln()).sqrt() * (2.0 * std::f64::consts::PI * b).cos()) as f32
        })
        .collect()
}

/// A base-2 logarithm as bad as `lg2.approx` is documented to be, pushed to the edge of its
/// error in the direction `sign`: 2⁻²² absolute on [½, 2], 2 ulp elsewhere.
pub fn worst_log2(sign: f64) -> impl Fn(f32) -> f32 + Copy {
    move |x: f32| {
        let exact = (x as f64).log2();
        let error = if (0.5..=2.0).contains(&x) { 2f64.powi(-22) } else { 2.0 * ulp(exact as f32) as f64 };
        (exact + sign * error) as f32
    }
}

/// The distance from `|x|` to the next float up.
fn ulp(x: f32) -> f32 {
    let a = x.abs();
    f32::from_bits(a.to_bits() + 1) - a
}
