//! Logit processing before the race, and the log-sum-exp terms behind log-probabilities.
//!
//! A row's logits go through one order on every backend:
//!
//! ```text
//! soft-cap → logit bias → token mask → penalties → temperature → min-p → top-k → top-p → draw
//! ```
//!
//! (vLLM's sampler order: bias and masks, then penalties, then temperature, then the
//! truncations; soft-capping is part of the model's head, Gemma 2's, so it comes first.) The
//! per-entry steps are pure functions of one logit and live here: [`softcap`], the bias (an
//! addition), [`mask_allows`] and [`penalized`]. Temperature enters only the score
//! ([`perturbed_score`](crate::candidate::perturbed_score)). The truncations need the row's
//! largest processed logit: min-p keeps the entries at or above [`min_p_threshold`], and
//! top-k/top-p are order statistics of the whole row, selected by the host.
//!
//! Like the rest of the crate this module uses only IEEE `+ − × ÷` on `f32` (its [`exp`]
//! and `tanh` are written out), so every backend processes a logit to the same bits.

use crate::gumbel::ln;

/// `ln 2` split so that `k · LN2_HI` is exact for `|k| < 2⁸` (Cody and Waite's reduction;
/// the high part has 16 significant bits).
const LN2_HI: f32 = 0.693_145_75;
const LN2_LO: f32 = 1.428_606_8e-6;
const LOG2_E: f32 = core::f32::consts::LOG2_E;

/// `2ᵉ` for a normal exponent, `−126 ≤ e ≤ 127` (other `e` give some float, no panic).
#[inline(always)]
const fn power_of_two(e: i32) -> f32 {
    f32::from_bits((e.wrapping_add(127) as u32) << 23)
}

/// `1.5 · 2²³`: a sum with it has unit spacing, so adding it rounds an `|x| < 2²²` to the
/// nearest integer (ties to even), which lands in the sum's low mantissa bits.
const ROUNDING_SHIFT: f32 = 12_582_912.0;

/// The integer `k` nearest `x / ln 2`, as a float and as an integer, for `|x| < 2²⁰`: by
/// [`ROUNDING_SHIFT`], with no conversion instruction (NVIDIA's throughput tables give a
/// multiprocessor 16 conversions per clock against 128 additions) and no saturation check
/// (which `as i32` adds). Any other `x` gives some pair, never a panic.
#[inline(always)]
const fn nearest_multiple_of_ln2(x: f32) -> (f32, i32) {
    let shifted = x * LOG2_E + ROUNDING_SHIFT;
    (shifted - ROUNDING_SHIFT, shifted.to_bits().wrapping_sub(ROUNDING_SHIFT.to_bits()) as i32)
}

/// `r = x − k·ln 2`, `|r| ≤ ½ln 2` (plus rounding) for `k` ([`nearest_multiple_of_ln2`],
/// `|k| < 2⁸`): Cody and Waite's reduction, exact in its first step.
#[inline(always)]
const fn reduced(x: f32, k: f32) -> f32 {
    (x - k * LN2_HI) - k * LN2_LO
}

/// `x · 2ᵏ` for `−300 < k < 300`, in two exact steps where `2ᵏ` alone is not a normal float
/// (the last step rounds once, also into the subnormals).
#[inline(always)]
fn scale_by_power_of_two(x: f32, k: i32) -> f32 {
    if k > 127 {
        x * power_of_two(127) * power_of_two(k - 127)
    } else if k < -126 {
        x * power_of_two(-126) * power_of_two(k + 126)
    } else {
        x * power_of_two(k)
    }
}

/// `eʳ − 1` for `|r| ≤ 0.35`: its Taylor series through `r⁹/9!`, whose first dropped term is
/// below `2·10⁻¹⁰` of the result.
#[inline(always)]
fn expm1_small(r: f32) -> f32 {
    let series = 1.0
        + r * (1.0 / 2.0
            + r * (1.0 / 6.0
                + r * (1.0 / 24.0
                    + r * (1.0 / 120.0
                        + r * (1.0 / 720.0 + r * (1.0 / 5040.0 + r * (1.0 / 40320.0 + r * (1.0 / 362_880.0))))))));
    r * series
}

/// `eʳ` for `|r| ≤ 0.35` to within an ulp and a quarter: its Taylor series through `r⁷/7!`,
/// whose first dropped term is below `5.3·10⁻⁹` (a tenth of an ulp of `eʳ ≥ 0.7`); two terms
/// fewer than [`expm1_small`], which keeps relative precision near `r = 0` for `expm1`.
#[inline(always)]
const fn exp_small(r: f32) -> f32 {
    1.0 + r
        * (1.0
            + r * (1.0 / 2.0
                + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0 + r * (1.0 / 5040.0)))))))
}

/// `eˣ` within a few ulp over the whole range: `+∞` above `ln f32::MAX`, 0 below the
/// subnormals, NaN for NaN.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    if x > 88.722_84 {
        return f32::INFINITY;
    }
    if x < -103.972_08 {
        return 0.0;
    }
    // x = k·ln 2 + r with |r| ≤ ½ln 2 (plus rounding); eˣ = 2ᵏ·(1 + expm1(r)).
    let (kf, k) = nearest_multiple_of_ln2(x);
    scale_by_power_of_two(1.0 + expm1_small(reduced(x, kf)), k)
}

/// `eˣ` for `x ≤ 0` (or NaN) in straight-line code, the terms of a log-sum-exp against its
/// maximum, once per entry: within 1.25 ulp of `eˣ` where it is a normal float, within one
/// subnormal step below (`2ᵏ⁺⁶⁴` is normal, and the factor `2⁻⁶⁴` rounds once), 0 below
/// `ln 2⁻¹⁵⁰`, NaN for NaN (it passes through every step).
#[inline(always)]
const fn exp_non_positive(x: f32) -> f32 {
    let (kf, k) = nearest_multiple_of_ln2(x);
    let e = exp_small(reduced(x, kf)) * power_of_two(k.wrapping_add(64)) * power_of_two(-64);
    if x < -103.972_08 { 0.0 } else { e }
}

/// `eˣ − 1` for `0 ≤ x < 18.5`, with full relative precision near 0 and no branch:
/// `x = k·ln 2 + r` with `|r| ≤ ½ln 2`, `eˣ − 1 = 2ᵏ·expm1(r) + (2ᵏ − 1)` (`k = 0` is
/// `expm1(r)` itself). One path for every lane of a warp: a branch on `|x|` had the soft-cap's
/// lanes run both halves.
#[inline(always)]
fn expm1_non_negative(x: f32) -> f32 {
    let (kf, k) = nearest_multiple_of_ln2(x);
    let power = power_of_two(k);
    expm1_small(reduced(x, kf)) * power + (power - 1.0)
}

/// `tanh x` within a few ulp: `expm1(2|x|) / (expm1(2|x|) + 2)` with the sign of `x`; ±1 for
/// `|x| ≥ 9.1` (where `1 − tanh` is below half an ulp of 1), ±1 for ±∞, NaN for NaN.
#[inline(always)]
fn tanh(x: f32) -> f32 {
    let a = x.abs();
    let magnitude = if a >= 9.1 {
        1.0
    } else {
        let m = expm1_non_negative(a + a);
        m / (m + 2.0)
    };
    if x.is_nan() {
        x
    } else if x < 0.0 {
        -magnitude
    } else {
        magnitude
    }
}

/// Gemma 2's soft-capping, `cap · tanh(logit / cap)`, for `cap > 0`: it maps ±∞ to ±cap and
/// keeps NaN.
#[inline(always)]
pub fn softcap(logit: f32, cap: f32) -> f32 {
    cap * tanh(logit / cap)
}

/// Whether bit `index % 32` of word `index / 32` of a row's token mask is set (xgrammar's
/// layout: bit `j` of word `w` allows token `32w + j`).
#[inline(always)]
pub fn mask_allows(mask: &[u32], index: u32) -> bool {
    (mask[(index / 32) as usize] >> (index % 32)) & 1 == 1
}

/// The three history penalties of a row. `Penalties::NONE` changes no logit.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
#[cfg_attr(not(target_arch = "nvptx64"), derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct Penalties {
    /// `r > 0`: a seen token's logit `l` becomes `l / r` if `l > 0`, else `l · r`.
    pub repetition: f32,
    /// `f`: a token seen `c` times loses `f · c`.
    pub frequency: f32,
    /// `p`: a seen token loses `p`.
    pub presence: f32,
}

impl Penalties {
    /// No penalty: repetition 1, frequency and presence 0.
    pub const NONE: Penalties = Penalties { repetition: 1.0, frequency: 0.0, presence: 0.0 };
}

/// A logit after the penalties of a token seen `count` times in the row's history (prompt and
/// output so far): repetition first, then frequency and presence. `count = 0` leaves it as
/// it is; −∞ (a masked token) stays −∞.
#[inline(always)]
pub fn penalized(logit: f32, count: u32, penalties: &Penalties) -> f32 {
    if count == 0 {
        return logit;
    }
    let repeated = if logit > 0.0 { logit / penalties.repetition } else { logit * penalties.repetition };
    repeated - penalties.frequency * count as f32 - penalties.presence
}

/// min-p's cut for a row whose largest processed logit is `max_logit`: a token is kept when
/// its processed logit is at least `max_logit + T · ln(min_p)`, i.e. when its probability
/// after temperature is at least `min_p` times the largest (evaluated once per row in f32, so
/// every backend cuts at the same value). `min_p = 0` keeps everything.
#[inline(always)]
pub fn min_p_threshold(max_logit: f32, temperature: f32, min_p: f32) -> f32 {
    if min_p <= 0.0 { f32::NEG_INFINITY } else { max_logit + temperature * ln(min_p) }
}

/// The log-sum-exp of a set of logits over a temperature, as a running maximum `max` (in
/// logit units) and `sum = Σ exp((logit − max) / T)`. Terms can be added in any order and
/// partial sums merged (per tile, per shard), and no term overflows at any `T`. −∞ terms add
/// nothing; a NaN term makes the sum NaN.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
#[cfg_attr(not(target_arch = "nvptx64"), derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct LogSumExp {
    /// The largest logit added, in logit units; −∞ for the empty sum.
    pub max: f32,
    /// `Σ exp((logit − max) / T)` over the logits added; 0 for the empty sum.
    pub sum: f32,
}

impl LogSumExp {
    /// The empty sum.
    pub const EMPTY: LogSumExp = LogSumExp { max: f32::NEG_INFINITY, sum: 0.0 };

    /// Adds the term of `logit` at `temperature` (> 0).
    #[inline(always)]
    pub fn add(&mut self, logit: f32, temperature: f32) {
        self.merge_with(LogSumExp { max: logit, sum: 1.0 }, temperature);
    }

    /// Merges another partial sum taken at the same temperature.
    #[inline(always)]
    pub fn merge_with(&mut self, other: LogSumExp, temperature: f32) {
        if other.max == f32::NEG_INFINITY {
            return;
        }
        if self.max == f32::NEG_INFINITY {
            *self = other;
            return;
        }
        if other.max > self.max {
            self.sum = self.sum * exp((self.max - other.max) / temperature) + other.sum;
            self.max = other.max;
        } else {
            // NaN in either part lands here and spreads through the sum.
            self.sum += other.sum * exp((other.max - self.max) / temperature);
            if other.max.is_nan() {
                self.sum = f32::NAN;
            }
        }
    }

    /// An entry's term `exp((logit − max) · (1 / T))` in a sum whose maximum `max ≥ logit` is
    /// known first (a tile's two-pass sum: maximum, then terms), given `inverse_temperature =
    /// 1 / T` (a product per entry, not a division; within an ulp of `(logit − max) / T` where
    /// `1 / T` is finite); 1 for the maximum itself, also where `1 / T` overflowed to ∞
    /// (`T < 2⁻¹²⁸`, whose product with 0 is NaN); 0 for a −∞ logit, NaN for NaN. Where `1 / T`
    /// is ∞, every other entry's term is 0, which the division also gives unless the entry lies
    /// within `104·T` (below 2⁻¹²¹) of the maximum, a gap that f32 holds only between logits
    /// under 2⁻⁹⁸ (about 3·10⁻³⁰) in magnitude.
    #[inline(always)]
    pub fn term(logit: f32, max: f32, inverse_temperature: f32) -> f32 {
        // Selects, not branches: the lanes of a warp take one path.
        let distance = if logit == max { 0.0 } else { (logit - max) * inverse_temperature };
        let term = exp_non_positive(distance);
        if logit == f32::NEG_INFINITY { 0.0 } else { term }
    }

    /// `logit / T − ln Σ exp(logitⱼ / T)`: the log-probability of an entry of the set.
    /// −∞ for an empty set.
    #[inline(always)]
    pub fn log_probability(&self, logit: f32, temperature: f32) -> f32 {
        if self.max == f32::NEG_INFINITY {
            return f32::NEG_INFINITY;
        }
        (logit - self.max) / temperature - ln(self.sum)
    }
}

/// One token of a row's sparse list: the steps between the soft-cap and the temperature that
/// touch only listed tokens. `bias` is the sum of the token's bias values (in the order given),
/// `count` its number of occurrences in the row's history.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
#[cfg_attr(not(target_arch = "nvptx64"), derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct SparseEntry {
    /// The token's global vocabulary index.
    pub token: u32,
    /// The sum of the token's bias values, added to its logit after the soft-cap (0 for a
    /// token listed for its history only).
    pub bias: f32,
    /// The token's occurrences in the row's history; 0 (a token listed for its bias only)
    /// leaves it unpenalised.
    pub count: u32,
}

/// The steps every entry of a row takes: the soft-cap (`cap = 0` is off) and the mask (a
/// disallowed entry becomes −∞).
#[inline(always)]
pub fn dense_step(raw: f32, cap: f32, allowed: bool) -> f32 {
    if !allowed {
        f32::NEG_INFINITY
    } else if cap > 0.0 {
        softcap(raw, cap)
    } else {
        raw
    }
}

/// The steps of a listed token after [`dense_step`]: its bias, then its penalties. Bias and
/// penalties keep −∞ (a masked token) at −∞, so applying them after the mask gives the
/// order soft-cap → bias → mask → penalties.
#[inline(always)]
pub fn sparse_step(logit: f32, entry: &SparseEntry, penalties: &Penalties) -> f32 {
    penalized(logit + entry.bias, entry.count, penalties)
}

/// The most top raw log-probabilities a row may ask for.
pub const MAX_TOP_LOGPROBS: u32 = 20;

/// Entries per block of a row's sparse index: a fused tile finds the listed tokens of a quad
/// among those of the quad's block.
pub const SPARSE_BLOCK: u32 = 64;

/// The per-entry steps ([`dense_step`], then [`sparse_step`] for listed tokens) on four
/// consecutive entries `index0 .. index0 + 4` of one row, `index0 % 4 == 0`: `mask_word` is
/// the row's mask word that holds their bits (all ones without a mask) and `entry(k)` for
/// `k` in `listed` the row's sparse entries that may fall in the quad (in the fused tiles:
/// those of its [`SPARSE_BLOCK`]). The same operations, in the same order, as a row processed
/// whole.
#[inline(always)]
pub fn process_quad(
    quad: [f32; 4],
    index0: u32,
    cap: f32,
    mask_word: u32,
    penalties: &Penalties,
    listed: core::ops::Range<u32>,
    entry: impl Fn(u32) -> SparseEntry,
) -> [f32; 4] {
    let allowed = |r: u32| (mask_word >> ((index0 + r) % 32)) & 1 == 1;
    // Four scalars, not an indexed array: a kernel keeps them in registers.
    let mut l0 = dense_step(quad[0], cap, allowed(0));
    let mut l1 = dense_step(quad[1], cap, allowed(1));
    let mut l2 = dense_step(quad[2], cap, allowed(2));
    let mut l3 = dense_step(quad[3], cap, allowed(3));
    for k in listed {
        let e = entry(k);
        match e.token.wrapping_sub(index0) {
            0 => l0 = sparse_step(l0, &e, penalties),
            1 => l1 = sparse_step(l1, &e, penalties),
            2 => l2 = sparse_step(l2, &e, penalties),
            3 => l3 = sparse_step(l3, &e, penalties),
            _ => {}
        }
    }
    [l0, l1, l2, l3]
}

/// Which entries of a row min-p, top-k and top-p keep: `(l, i)` is kept when `l ≥ min_cut`
/// and `(l, −i) ≥ (order_cut.0, −order_cut.1)` (top-k cuts at a value, keeping ties; top-p
/// may cut inside a tie, by index).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KeepRule {
    /// min-p's cut ([`min_p_threshold`]): entries whose logit is below it are dropped; −∞
    /// keeps every entry.
    pub min_cut: f32,
    /// top-k's or top-p's cut as (logit, global index): an entry is kept when it comes no
    /// later in the order of decreasing logit, then increasing index. top-k cuts at the k-th
    /// largest logit with index `u32::MAX` (keeping its whole tie), top-p at its prefix's last
    /// entry; `(−∞, u32::MAX)` keeps every entry.
    pub order_cut: (f32, u32),
}

impl KeepRule {
    /// Keeps every entry.
    pub const ALL: KeepRule = KeepRule { min_cut: f32::NEG_INFINITY, order_cut: (f32::NEG_INFINITY, u32::MAX) };

    /// Whether the entry of processed logit `logit` at global vocabulary index `index` is
    /// kept.
    #[inline(always)]
    pub fn keeps(&self, logit: f32, index: u32) -> bool {
        logit >= self.min_cut && (logit > self.order_cut.0 || (logit == self.order_cut.0 && index <= self.order_cut.1))
    }
}

/// A finite logit as a key whose unsigned order is the logits' order (−0 and +0 one key):
/// what top-k and top-p rank by, before the index.
#[inline(always)]
pub fn order_key(logit: f32) -> u32 {
    let bits = (logit + 0.0).to_bits();
    if bits >> 31 == 1 { !bits } else { bits | 1 << 31 }
}

/// A logit as a word whose largest over some entries gives their largest logit and whether
/// any is NaN or +∞ ([`extremum`]): its [`order_key`], `u32::MAX` for NaN.
#[inline(always)]
pub fn extremum_key(logit: f32) -> u32 {
    if logit.is_nan() { u32::MAX } else { order_key(logit) }
}

/// The largest logit and the non-finite flag (a NaN or +∞ among the entries) of the largest
/// [`extremum_key`] of some entries (`order_key(−∞)` or less for none, as an
/// entry of −∞ gives): the maximum is only meaningful without the flag.
#[inline(always)]
pub fn extremum(key: u32) -> (f32, bool) {
    let non_finite = key >= order_key(f32::INFINITY);
    (key_logit(key.max(order_key(f32::NEG_INFINITY))), non_finite)
}

/// The logit of an [`order_key`].
#[inline(always)]
pub fn key_logit(key: u32) -> f32 {
    f32::from_bits(if key >> 31 == 1 { key & !(1 << 31) } else { !key })
}

/// Buckets of a truncation's coarse key per unit of `(max − logit) / T`: its 256 buckets
/// span `(max − logit) / T` up to 22.26, past `ln 2³² ≈ 22.18`, where an entry's top-p mass
/// is 0 units.
pub const COARSE_BUCKETS_PER_UNIT: f32 = 11.5;

/// The factor of [`coarse_key`] for a row at temperature `temperature`.
#[inline(always)]
pub fn coarse_scale(temperature: f32) -> f32 {
    COARSE_BUCKETS_PER_UNIT / temperature
}

/// A truncation's coarse key of an entry of a row whose largest processed logit is `max`:
/// `255 − ⌊(max − logit) · scale⌋`, at least 0, where `scale` is the row's [`coarse_scale`]:
/// 256 buckets of equal width in logit below the largest, where the entries of a row spread
/// out (the leading byte of [`order_key`] holds a few of a row's octaves of logits).
/// Non-decreasing in the logit, as each step rounds monotonically and the conversion
/// saturates: the entries of one coarse key are a run of the truncations' order, and every
/// entry before the run has a larger one. Any `max` and `scale > 0` keep that property;
/// theirs spread the entries a truncation's cut lies among.
#[inline(always)]
pub fn coarse_key(logit: f32, max: f32, scale: f32) -> u32 {
    255 - (coarse_position(logit, max, scale) as u32).min(255)
}

/// Units of probability mass per unit of the largest entry's weight, in top-p's sums.
pub const TOP_P_UNIT_SCALE: f32 = 4_294_967_296.0;

/// top-p's units at the top of each bucket `j` of the coarse key's position
/// ([`coarse_position`]): `exp(−j / COARSE_BUCKETS_PER_UNIT) · 2³²`, computed at compile
/// time by the same `exp` as every other term, so every backend reads the same constants.
pub const TOP_P_BUCKET_UNITS: [f32; 256] = {
    let mut units = [0.0f32; 256];
    let mut j = 0;
    while j < 256 {
        units[j] = exp_non_positive(-(j as f32) / COARSE_BUCKETS_PER_UNIT) * TOP_P_UNIT_SCALE;
        j += 1;
    }
    units
};

/// An entry's position below the largest processed logit `max` in buckets of the coarse key:
/// `(max − logit) · scale`, where `scale` is the row's [`coarse_scale`].
#[inline(always)]
pub fn coarse_position(logit: f32, max: f32, scale: f32) -> f32 {
    (max - logit) * scale
}

/// top-p's mass of an entry: `exp((l − max) / T)`, the entry's probability relative to the
/// largest, in whole units of 2⁻³² (truncated), computed from the entry's coarse position `x`
/// ([`coarse_position`]) as the units at the top of its bucket `j = ⌊x⌋` (`bucket_units(j)`,
/// called with `j < 256`: [`TOP_P_BUCKET_UNITS`] wherever the caller keeps it) times
/// `exp(−(x − j) / COARSE_BUCKETS_PER_UNIT)` by its series: a table read and ten additions
/// and multiplications per entry, and no division by `T` (the row's `scale` holds it).
/// Within `5·10⁻⁶` (relative) and one unit of the exact mass, the error of the rounded `x`
/// (the test below). 0 past the 256 buckets (`(max − l) / T ≥ 22.26`,
/// where the exact mass is below one unit) and for NaN. Integer sums are exact in any order,
/// so every backend, tile order and shard split finds the same cut; the cut is vLLM's on
/// these masses (it differs from the real-number one only where the cumulative mass is within
/// the masses' error of `p` times the total).
#[inline(always)]
pub fn top_p_units(position: f32, bucket_units: impl Fn(u32) -> f32) -> u64 {
    if position.is_nan() || position >= 256.0 {
        return 0;
    }
    // `position ≥ 0` for every entry at or below `max`; a negative one (none is asked for)
    // takes bucket 0.
    let j = position as u32;
    let x = (j as f32 - position) * (1.0 / COARSE_BUCKETS_PER_UNIT);
    let fraction = 1.0 + x * (1.0 + x * (1.0 / 2.0 + x * (1.0 / 6.0 + x * (1.0 / 24.0 + x * (1.0 / 120.0)))));
    (bucket_units(j) * fraction) as u64
}

/// [`top_p_units`] with the compiled table.
#[inline(always)]
pub fn top_p_units_of(logit: f32, max: f32, scale: f32) -> u64 {
    // `j < 256` (`top_p_units`'s contract): the byte is the index, with no bounds check.
    top_p_units(coarse_position(logit, max, scale), |j| TOP_P_BUCKET_UNITS[j as u8 as usize])
}

/// The mass top-p's prefix must reach: `⌈p · total⌉` units, computed exactly for
/// `0 < p ≤ 1` (`p = m · 2ᵉ` with an integer `m`), and at least 1.
#[inline(always)]
pub fn top_p_target(total: u64, p: f32) -> u64 {
    let bits = p.to_bits();
    let exponent = ((bits >> 23) & 0xff) as i32;
    let (mantissa, shift) = if exponent == 0 {
        ((bits & 0x7f_ffff) as u128, 149)
    } else {
        (((bits & 0x7f_ffff) | 1 << 23) as u128, 150 - exponent)
    };
    let product = mantissa * total as u128;
    let target = if shift <= 0 {
        product << -shift
    } else if shift >= 128 {
        (product > 0) as u128
    } else {
        (product + (1u128 << shift) - 1) >> shift
    };
    target.max(1) as u64
}

/// A drawn token's raw log-probability (at T = 1) and its log-probability under the
/// distribution it was drawn from (0 for a greedy row), from the row's merged log-sum-exp
/// terms and the token's raw and processed logits (`None` when the slot holds no token). A
/// slot holding [`NON_FINITE_TOKEN`](crate::NON_FINITE_TOKEN) gets NaN; any other slot without
/// a token −∞.
#[inline(always)]
pub fn token_log_probabilities(
    token: u32,
    logits: Option<(f32, f32)>,
    raw: &LogSumExp,
    kept: &LogSumExp,
    greedy: bool,
    temperature: f32,
) -> (f32, f32) {
    match logits {
        _ if token == crate::NON_FINITE_TOKEN => (f32::NAN, f32::NAN),
        None => (f32::NEG_INFINITY, f32::NEG_INFINITY),
        Some((raw_logit, processed_logit)) => {
            let processed = if greedy { 0.0 } else { kept.log_probability(processed_logit, temperature) };
            (raw.log_probability(raw_logit, 1.0), processed)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::vec::Vec;

    fn ulps(got: f32, exact: f64) -> f64 {
        let e = exact as f32;
        let ulp = (f32::from_bits(e.abs().to_bits() + 1) - e.abs()) as f64;
        (got as f64 - exact).abs() / ulp.max(f32::from_bits(1) as f64)
    }

    fn samples() -> Vec<f32> {
        let mut xs = Vec::new();
        let mut x = 1e-30f32;
        while x < 120.0 {
            xs.extend([x, -x, x * 1.37, -x * 1.37]);
            x *= 1.11;
        }
        xs
    }

    #[test]
    fn exp_is_within_two_ulp_of_f64() {
        for x in samples().into_iter().chain([0.0, 88.7, -87.3, -100.0, 0.3465, 0.3466]) {
            let exact = (x as f64).exp();
            let got = exp(x);
            if exact > f32::MAX as f64 {
                assert_eq!(got, f32::INFINITY, "exp({x})");
            } else if exact >= f32::MIN_POSITIVE as f64 {
                assert!(ulps(got, exact) <= 2.0, "exp({x}) = {got}, f64 {exact}");
            } else {
                // Subnormal results: within one subnormal step.
                assert!((got as f64 - exact).abs() <= f32::from_bits(1) as f64, "exp({x}) = {got}, f64 {exact}");
            }
        }
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(f32::INFINITY), f32::INFINITY);
        assert!(exp(f32::NAN).is_nan());
    }

    #[test]
    fn exp_of_non_positive_arguments_is_within_an_ulp_and_a_quarter() {
        // Every 37th float from −0 down to below the underflow bound, 3·10⁷ arguments, and
        // both ends of every binade (where the reduction's `k` steps).
        let last = (-104.0f32).to_bits();
        let dense = (0x8000_0000u32..=last).step_by(37).map(f32::from_bits);
        let edges = (0..=last - 0x8000_0000).step_by(1 << 23).flat_map(|b| [0x8000_0000 + b, 0x807f_ffff + b]);
        for y in dense.chain(edges.map(f32::from_bits)) {
            let (got, exact) = (exp_non_positive(y), (y as f64).exp());
            if exact >= f32::MIN_POSITIVE as f64 {
                assert!(ulps(got, exact) <= 1.25, "exp_non_positive({y}) = {got}, f64 {exact}");
            } else {
                assert!((got as f64 - exact).abs() <= f32::from_bits(1) as f64, "exp_non_positive({y}) = {got}");
            }
        }
        assert_eq!(exp_non_positive(0.0), 1.0);
        assert_eq!(exp_non_positive(-0.0), 1.0);
        assert_eq!(exp_non_positive(-103.972_09), 0.0);
        assert_eq!(exp_non_positive(f32::NEG_INFINITY), 0.0);
        assert!(exp_non_positive(f32::NAN).is_nan());
    }

    /// A term at any temperature is the division's for logits an f32 ulp of 3 or more apart:
    /// with `1 / T = ∞` (T = 10⁻⁴⁵) the maximum's term is 1 and every other entry's 0, as
    /// `exp((logit − max) / T)` gives them.
    #[test]
    fn terms_follow_the_division_at_every_temperature() {
        let logits = [3.0f32, 2.999_999_8, -1.0, 0.0, f32::NEG_INFINITY];
        for t in [1e-45f32, 1e-38, 1e-6, 0.7, 1.0, 1e30, 1e36] {
            let inverse = 1.0 / t;
            for &max in &[3.0f32, 7.5] {
                for &l in &logits {
                    let (got, by_division) = (LogSumExp::term(l, max, inverse), exp((l - max) / t));
                    assert!(
                        ulps(got, by_division as f64) <= 2.5,
                        "term({l}, {max}) at T = {t:e}: {got} vs {by_division}"
                    );
                }
            }
        }
        assert!(LogSumExp::term(f32::NAN, 3.0, 1.0).is_nan());
        assert!(LogSumExp::term(1.0, f32::NAN, f32::INFINITY).is_nan());
    }

    #[test]
    fn softcap_is_within_six_ulp_of_f64_and_keeps_the_edges() {
        for cap in [30.0f32, 50.0, 1.0, 0.01, 7.3] {
            // Dense near 0 (where the quotient's and the series' roundings dominate) and out to
            // 12 caps, both signs: 4 · 10⁵ logits per cap.
            for i in 0..200_000 {
                let magnitude = cap * 12.0 * 2f32.powf(-40.0 * i as f32 / 200_000.0);
                for x in [magnitude, -magnitude * 1.0007] {
                    let exact = cap as f64 * ((x as f64) / cap as f64).tanh();
                    let got = softcap(x, cap);
                    assert!(ulps(got, exact) <= 6.0, "softcap({x}, {cap}) = {got}, f64 {exact}");
                }
            }
            assert_eq!(softcap(f32::INFINITY, cap), cap);
            assert_eq!(softcap(f32::NEG_INFINITY, cap), -cap);
            assert_eq!(softcap(0.0, cap), 0.0);
            assert!(softcap(f32::NAN, cap).is_nan());
        }
    }

    #[test]
    fn penalties_follow_their_definitions() {
        let p = Penalties { repetition: 2.0, frequency: 0.5, presence: 0.25 };
        assert_eq!(penalized(3.0, 0, &p), 3.0);
        assert_eq!(penalized(3.0, 2, &p), 1.5 - 1.0 - 0.25);
        assert_eq!(penalized(-3.0, 1, &p), -6.0 - 0.5 - 0.25);
        assert_eq!(penalized(f32::NEG_INFINITY, 4, &p), f32::NEG_INFINITY);
        assert_eq!(penalized(7.0, 9, &Penalties::NONE), 7.0);
    }

    #[test]
    fn mask_bits_follow_the_xgrammar_layout() {
        let mask = [0b101u32, 1 << 31];
        let allowed: Vec<u32> = (0..64).filter(|&i| mask_allows(&mask, i)).collect();
        assert_eq!(allowed, [0, 2, 63]);
    }

    /// Coarse keys never decrease along increasing logits (every adjacent pair of floats in
    /// the range tried, at several temperatures and maxima), give the largest logit 255,
    /// put a step of `1 / COARSE_BUCKETS_PER_UNIT` of `(max − logit) / T` in each bucket, and
    /// give 0 to everything past the last.
    #[test]
    fn coarse_keys_are_monotone_buckets_below_the_largest_logit() {
        for (max, temperature) in [(9.4f32, 1.0f32), (-3.0, 0.7), (0.0, 1e-3), (1e4, 2.0), (30.0, 1e30)] {
            let scale = coarse_scale(temperature);
            assert_eq!(coarse_key(max, max, scale), 255);
            let mut key = order_key(max);
            let mut previous = coarse_key(key_logit(key), max, scale);
            // Every float from `max` down over 2²⁰ steps, then in strides down to the lowest
            // finite one.
            let mut steps = 0u32;
            while key > order_key(f32::MIN) {
                key = (key - if steps < 1 << 20 { 1 } else { 4093 }).max(order_key(f32::MIN));
                steps += 1;
                let c = coarse_key(key_logit(key), max, scale);
                assert!(c <= previous, "{max} {temperature}: key {key:#x}");
                previous = c;
            }
            assert_eq!(previous, 0);
        }
        let scale = coarse_scale(1.0);
        assert_eq!(coarse_key(9.4 - 1.0, 9.4, scale), 255 - 11);
        assert_eq!(coarse_key(9.4 - 22.0, 9.4, scale), 255 - 253);
        assert_eq!(coarse_key(9.4 - 23.0, 9.4, scale), 0);
    }

    /// top-p's units from the bucket table and the series stay within `5·10⁻⁶` (relative) and
    /// one unit of `exp((l − max) / T) · 2³²` in f64, over every float from the maximum down
    /// through the first 2¹⁸ and then in strides to past the last bucket, at several
    /// temperatures and maxima; the largest entry weighs exactly 2³² units, entries past the
    /// buckets 0.
    #[test]
    fn top_p_units_follow_the_exponential() {
        for (max, temperature) in [(9.4f32, 1.0f32), (-3.0, 0.7), (0.5, 1e-3), (1e4, 2.0), (30.0, 1e3)] {
            let scale = coarse_scale(temperature);
            assert_eq!(top_p_units_of(max, max, scale), 1 << 32);
            let mut key = order_key(max);
            let mut steps = 0u32;
            loop {
                let logit = key_logit(key);
                let exact = ((logit as f64 - max as f64) / temperature as f64).exp() * 4_294_967_296.0;
                let got = top_p_units_of(logit, max, scale) as f64;
                assert!((got - exact).abs() <= 5e-6 * exact + 1.0, "{max} {temperature} {logit}: {got} vs {exact}");
                if coarse_position(logit, max, scale) >= 256.0 {
                    assert_eq!(got, 0.0);
                    break;
                }
                key -= if steps < 1 << 18 { 1 } else { 97 };
                steps += 1;
            }
        }
        assert_eq!(top_p_units_of(f32::NAN, 1.0, 1.0), 0);
        assert_eq!(top_p_units_of(f32::NEG_INFINITY, 1.0, 1.0), 0);
    }

    /// The largest extremum key of some entries gives their largest logit and, exactly when
    /// one is NaN or +∞, the non-finite flag; no entries (key 0) or only −∞ give −∞.
    #[test]
    fn extremum_keys_give_the_largest_logit_and_the_non_finite_flag() {
        let largest = |entries: &[f32]| extremum(entries.iter().map(|&l| extremum_key(l)).fold(0, u32::max));
        assert_eq!(largest(&[]), (f32::NEG_INFINITY, false));
        assert_eq!(largest(&[f32::NEG_INFINITY]), (f32::NEG_INFINITY, false));
        assert_eq!(largest(&[-3.0, 2.5, -0.0, f32::MIN]), (2.5, false));
        assert_eq!(largest(&[-7.0, -2.0]), (-2.0, false));
        assert_eq!(largest(&[f32::MAX, 1.0]), (f32::MAX, false));
        assert!(largest(&[1.0, f32::INFINITY]).1);
        assert!(largest(&[1.0, f32::NAN]).1);
        assert!(largest(&[-f32::NAN, -1.0]).1);
        assert_eq!(largest(&[0.0, -0.0]).0, 0.0);
    }

    #[test]
    fn min_p_threshold_keeps_tokens_at_least_min_p_times_the_largest() {
        assert_eq!(min_p_threshold(5.0, 1.0, 0.0), f32::NEG_INFINITY);
        assert_eq!(min_p_threshold(5.0, 0.7, 1.0), 5.0);
        let cut = min_p_threshold(5.0, 2.0, 0.1);
        assert!((cut as f64 - (5.0 + 2.0 * 0.1f64.ln())).abs() < 1e-6);
    }

    #[test]
    fn a_quad_is_processed_as_its_entries_are() {
        let p = Penalties { repetition: 1.5, frequency: 0.5, presence: 0.25 };
        let entries = [SparseEntry { token: 9, bias: 1.0, count: 0 }, SparseEntry { token: 10, bias: 0.5, count: 3 }];
        let raw = [3.0f32, -2.0, 40.0, 0.5];
        let got = process_quad(raw, 8, 30.0, 0b1011 << 8, &p, 0..2, |k| entries[k as usize]);
        let allowed = [true, true, false, true];
        for r in 0..4 {
            let mut want = dense_step(raw[r], 30.0, allowed[r]);
            if let Some(e) = entries.iter().find(|e| e.token == 8 + r as u32) {
                want = sparse_step(want, e, &p);
            }
            assert_eq!(got[r].to_bits(), want.to_bits(), "entry {r}");
        }
    }

    #[test]
    fn order_keys_order_finite_logits_and_round_trip() {
        let logits = [-1e30f32, -3.5, -1e-40, -0.0, 0.0, 1e-40, 2.0, 7e20, f32::NEG_INFINITY];
        for w in logits[..8].windows(2) {
            assert!(order_key(w[0]) <= order_key(w[1]), "{} {}", w[0], w[1]);
        }
        assert_eq!(order_key(-0.0), order_key(0.0));
        assert!(order_key(f32::NEG_INFINITY) < order_key(-1e30));
        for l in logits {
            assert_eq!(key_logit(order_key(l)), l + 0.0);
        }
    }

    #[test]
    fn top_p_target_is_the_ceiling_of_p_times_the_total() {
        for (total, p) in [(10u64, 0.5f32), (7, 0.3), (1 << 40, 0.9), (u64::MAX >> 1, 1.0), (3, 1e-40), (12345, 0.999)]
        {
            let exact = (p as f64 * total as f64).ceil().max(1.0);
            let got = top_p_target(total, p) as f64;
            assert!((got - exact).abs() <= exact * 1e-15, "{total} · {p}: {got} vs {exact}");
        }
        assert_eq!(top_p_target(10, 0.5), 5);
        assert_eq!(top_p_target(10, 0.51), 6);
        assert_eq!(top_p_target(1 << 32, 1.0), 1 << 32);
        assert_eq!(top_p_units_of(2.0, 2.0, coarse_scale(0.7)), 1 << 32);
    }

    #[test]
    fn sparse_steps_after_the_mask_keep_it() {
        let p = Penalties { repetition: 1.5, frequency: 0.5, presence: 0.25 };
        let entry = SparseEntry { token: 3, bias: 2.0, count: 2 };
        assert_eq!(sparse_step(dense_step(1.0, 0.0, false), &entry, &p), f32::NEG_INFINITY);
        assert_eq!(sparse_step(dense_step(1.0, 0.0, true), &entry, &p), 3.0 / 1.5 - 1.0 - 0.25);
        assert_eq!(dense_step(100.0, 30.0, true), softcap(100.0, 30.0));
        let raw = LogSumExp { max: 0.0, sum: 1.0 };
        assert!(token_log_probabilities(crate::NON_FINITE_TOKEN, None, &raw, &raw, false, 1.0).0.is_nan());
        assert_eq!(token_log_probabilities(crate::NO_TOKEN, None, &raw, &raw, false, 1.0).1, f32::NEG_INFINITY);
        assert_eq!(token_log_probabilities(5, Some((0.0, 0.0)), &raw, &raw, true, 1.0), (0.0, 0.0));
    }

    #[test]
    fn log_sum_exp_merges_in_any_order_and_matches_f64() {
        let logits: Vec<f32> = (0..5000).map(|i| ((i * 7919) % 1000) as f32 * 0.013 - 4.0).collect();
        for t in [1e-3f32, 0.7, 1.0, 30.0] {
            let exact = {
                let m = logits.iter().fold(f64::NEG_INFINITY, |a, &l| a.max(l as f64));
                m / t as f64 + logits.iter().map(|&l| ((l as f64 - m) / t as f64).exp()).sum::<f64>().ln()
            };
            let mut sequential = LogSumExp::EMPTY;
            logits.iter().for_each(|&l| sequential.add(l, t));
            let mut tiles = LogSumExp::EMPTY;
            for chunk in logits.chunks(97).rev() {
                let mut tile = LogSumExp::EMPTY;
                chunk.iter().for_each(|&l| tile.add(l, t));
                tiles.merge_with(tile, t);
            }
            for lse in [sequential, tiles] {
                let got = lse.max as f64 / t as f64 + (lse.sum as f64).ln();
                assert!((got - exact).abs() <= 1e-4 * exact.abs().max(1.0), "T = {t}: {got} vs {exact}");
                let lp = lse.log_probability(logits[3], t) as f64;
                assert!((lp - (logits[3] as f64 / t as f64 - exact)).abs() < 1e-3 * exact.abs().max(1.0));
            }
        }
        let mut empty = LogSumExp::EMPTY;
        empty.add(f32::NEG_INFINITY, 1.0);
        assert_eq!(empty, LogSumExp::EMPTY);
        assert_eq!(empty.log_probability(0.0, 1.0), f32::NEG_INFINITY);
        empty.add(1.0, 1.0);
        empty.add(f32::NAN, 1.0);
        assert!(empty.sum.is_nan());
    }
}
