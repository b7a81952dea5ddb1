//! Uniform 32-bit word → standard Gumbel noise, in plain IEEE `f32` arithmetic.
//!
//! A word `x` stands for the uniform `u = (x + ½) / 2³²`, the midpoint of its cell, so `u` lies
//! in the open interval (0, 1) and never reaches either end. The noise is
//! `g = −ln(−ln u) = −ln(e)` with `e = −ln u` an Exp(1) variate.
//!
//! Precision: `u` is never formed where it would round to 1. For `x < 2³¹` we use
//! `t = u ≤ ½` and `e = −ln t`; for `x ≥ 2³¹` we use `t = 1 − u = (!x + ½) / 2³² ≤ ½` and
//! `e = −ln(1 − t) = 2·atanh(t / (2 − t))`, which keeps full relative precision as `t → 0`.
//! `t` is the single rounding of the odd integer `2y + 1 < 2³²` times `2⁻³³` (exact scaling).
//! Both cases go through one branch-free evaluation of `k·ln 2 + 2·atanh(s)`.
//!
//! Range: `e ∈ [≈2⁻³³, 33·ln 2]`, so every `g` is finite and
//! [`GUMBEL_MIN`] ≤ g ≤ [`GUMBEL_MAX`] ≈ 22.87. What that means for the tail: a token whose
//! logit (over temperature) is more than `GUMBEL_MAX − GUMBEL_MIN ≈ 26.0` below the row's
//! best can never be drawn; its true probability is below `e^−26 ≈ 5.1·10⁻¹²`. More generally
//! the 2³² cells give each token's noise a resolution of 2⁻³² in probability: events rarer than
//! that per token and draw are not represented (FlashSampling's 24-bit uniforms cap the noise
//! at ≈16.6; see `ARCHITECTURE.md`).

/// `ln 2` split so that `k · LN2_HI` is exact for every exponent `k` that occurs
/// (fdlibm's `e_logf.c` constants `ln2_hi = 0x3f317180`, `ln2_lo = 0x3717f7d1`).
const LN2_HI: f32 = f32::from_bits(0x3f31_7180);
const LN2_LO: f32 = f32::from_bits(0x3717_f7d1);
const SQRT_2: f32 = core::f32::consts::SQRT_2;
/// 2⁻³³, exact.
pub(crate) const TWO_POW_NEG_33: f32 = f32::from_bits((127 - 33) << 23);

/// The largest noise any word gives: `gumbel(u32::MAX)`, `−ln(−ln(1 − 2⁻³³)) ≈ 33·ln 2`.
pub const GUMBEL_MAX: f32 = 22.873_857;
/// The smallest noise any word gives: `gumbel(0)`, `−ln(33·ln 2) ≈ −3.1300`.
pub const GUMBEL_MIN: f32 = -3.129_994_6;

/// `2·atanh(s)` for `|s| ≤ ⅓` by its odd Taylor series through `s¹³/13`; the first dropped
/// term is below `s¹⁵/15 < 10⁻⁸` relative, under a quarter of an ulp.
#[inline(always)]
fn two_atanh(s: f32) -> f32 {
    let z = s * s;
    let series = 1.0
        + z * (1.0 / 3.0 + z * (1.0 / 5.0 + z * (1.0 / 7.0 + z * (1.0 / 9.0 + z * (1.0 / 11.0 + z * (1.0 / 13.0))))));
    (s + s) * series
}

/// `k·ln 2 + 2·atanh(numerator / denominator)`, the shared tail of both logarithms.
#[inline(always)]
fn log_from_parts(k: i32, numerator: f32, denominator: f32) -> f32 {
    let kf = k as f32;
    kf * LN2_HI + (kf * LN2_LO + two_atanh(numerator / denominator))
}

/// Splits a positive normal `x` into `(k, m)` with `x = 2ᵏ·m`, `m ∈ [√½, √2)`.
#[inline(always)]
fn exponent_and_mantissa(x: f32) -> (i32, f32) {
    let bits = x.to_bits();
    let k = ((bits >> 23) as i32) - 127;
    let m = f32::from_bits((bits & 0x007f_ffff) | 0x3f80_0000);
    let high = m > SQRT_2;
    (if high { k + 1 } else { k }, if high { m * 0.5 } else { m })
}

/// Natural logarithm of a positive normal `f32`, about 1 ulp, with `+ - * /` only.
#[inline(always)]
pub fn ln(x: f32) -> f32 {
    let (k, m) = exponent_and_mantissa(x);
    log_from_parts(k, m - 1.0, m + 1.0)
}

/// The Exp(1) variate `−ln((x + ½) / 2³²)`, with relative precision near 1e-7 over the whole
/// range (see the module docs for the two cases).
#[inline(always)]
pub fn exponential(x: u32) -> f32 {
    let upper = x >= 0x8000_0000;
    let y = if upper { !x } else { x };
    let t = (y.wrapping_mul(2) | 1) as f32 * TWO_POW_NEG_33;
    let (k, m) = exponent_and_mantissa(t);
    // Lower half: ln u = k·ln2 + 2atanh((m−1)/(m+1)). Upper half: ln(1 − t) = 2atanh(−t/(2 − t)).
    let (k, numerator, denominator) = if upper { (0, -t, 2.0 - t) } else { (k, m - 1.0, m + 1.0) };
    -log_from_parts(k, numerator, denominator)
}

/// Standard Gumbel noise `−ln(−ln u)` for the uniform word `x`; finite for every `x`, within
/// [`GUMBEL_MIN`, `GUMBEL_MAX`], and increasing in `x`.
#[inline(always)]
pub fn gumbel(x: u32) -> f32 {
    -ln(exponential(x))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::vec::Vec;

    fn reference_gumbel(x: u32) -> f64 {
        let t = (2.0 * (if x >= 1 << 31 { !x } else { x }) as f64 + 1.0) / 8_589_934_592.0;
        let e = if x >= 1 << 31 { -(-t).ln_1p() } else { -t.ln() };
        -e.ln()
    }

    fn words() -> Vec<u32> {
        let mut w: Vec<u32> = (0..4096).chain(u32::MAX - 4095..=u32::MAX).collect();
        w.extend((0..=u16::MAX as u32).map(|i| i.wrapping_mul(65_537).wrapping_add(0x9e37_79b9)));
        w.extend([(1 << 31) - 2, (1 << 31) - 1, 1 << 31, (1 << 31) + 1]);
        w
    }

    #[test]
    fn ln_is_within_two_ulp_of_f64() {
        let mut x = f32::MIN_POSITIVE;
        while x < 1e30 {
            for scale in [1.0f32, 1.1, 1.37, core::f32::consts::SQRT_2, 1.4143, 1.9999] {
                let v = x * scale;
                let exact = (v as f64).ln();
                let got = ln(v) as f64;
                let ulp = (exact.abs() as f32).max(f32::MIN_POSITIVE);
                let ulp = (f32::from_bits(ulp.to_bits() + 1) - ulp) as f64;
                assert!((got - exact).abs() <= 2.0 * ulp.max(1e-45), "ln({v}) = {got}, f64 {exact}");
            }
            x *= 1.7;
        }
        assert_eq!(ln(1.0), 0.0);
    }

    #[test]
    fn gumbel_matches_f64_reference() {
        for x in words() {
            let got = gumbel(x) as f64;
            let exact = reference_gumbel(x);
            // e carries ~1e-7 relative error, which becomes ~1e-7 absolute in g = -ln e.
            let tolerance = 4.0 * f32::EPSILON as f64 * exact.abs().max(1.0);
            assert!((got - exact).abs() <= tolerance, "x = {x:#x}: {got} vs {exact}");
        }
    }

    #[test]
    fn gumbel_is_finite_bounded_and_monotone() {
        let mut previous = f32::NEG_INFINITY;
        let mut sorted = words();
        sorted.sort_unstable();
        sorted.dedup();
        for x in sorted {
            let g = gumbel(x);
            assert!(g.is_finite(), "x = {x:#x}");
            assert!((GUMBEL_MIN..=GUMBEL_MAX).contains(&g), "x = {x:#x}: {g}");
            assert!(g >= previous, "not monotone at {x:#x}: {g} < {previous}");
            previous = g;
        }
        assert_eq!(gumbel(0), GUMBEL_MIN);
        assert_eq!(gumbel(u32::MAX), GUMBEL_MAX);
    }

    #[test]
    fn exponential_never_reaches_zero() {
        for x in words() {
            let e = exponential(x);
            assert!(e > 0.0 && e.is_normal(), "x = {x:#x}: {e}");
        }
    }
}
