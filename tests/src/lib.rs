//! Test bodies shared by every backend (cubecl style): each takes a [`Backend`] and asserts a
//! property of the sampler; `tests/cpu.rs` runs them on the CPU in CI and `tests/gpu.rs` runs
//! them on the GPU (ignored without one) for every kernel variant.

use flashsample::cpu::logits_row;
use flashsample::params::Draws;
use flashsample::params::{HeadShape, check_request};
use flashsample::{CpuSampler, CudaSampler, DType, Elements, Matrix, Result, SamplingParams, Variant};
use flashsample_core::{RowParams, block_scores};
use half::{bf16, f16};
use rand::{Rng, SeedableRng};
use statrs::distribution::{ChiSquared, ContinuousCDF};

/// A sampler under test.
pub trait Backend {
    fn name(&self) -> String;
    /// The draws `draws` of each row: `tokens[b · draws.count + (j − draws.first)]`.
    fn sample_draws(
        &self,
        lm_head: &Matrix,
        hidden: &Matrix,
        params: &[SamplingParams],
        draws: Draws,
    ) -> Result<Vec<u32>>;
    /// `tokens[b · samples + j]`.
    fn sample(&self, lm_head: &Matrix, hidden: &Matrix, params: &[SamplingParams], samples: u32) -> Result<Vec<u32>> {
        self.sample_draws(lm_head, hidden, params, Draws::first(samples))
    }
}

pub struct Cpu;

impl Backend for Cpu {
    fn name(&self) -> String {
        "cpu".into()
    }

    fn sample_draws(
        &self,
        lm_head: &Matrix,
        hidden: &Matrix,
        params: &[SamplingParams],
        draws: Draws,
    ) -> Result<Vec<u32>> {
        let sampler = CpuSampler::new();
        sampler.sample_draws(&sampler.upload_lm_head(lm_head)?, hidden, params, draws)
    }
}

/// The GPU with one tile variant forced; the workspace is poisoned before every call so a
/// candidate slot that the tile kernel fails to write shows up as a wrong token. The sampler runs the
/// module for the device, or the one `FLASHSAMPLE_MODULE` forces (the GPU suite runs once
/// with each).
pub struct Cuda {
    pub sampler: CudaSampler,
    pub variant: Variant,
}

impl Cuda {
    pub fn new(variant: Variant) -> Cuda {
        Cuda { sampler: CudaSampler::new().expect("these tests need a CUDA GPU"), variant }
    }
}

impl Backend for Cuda {
    fn name(&self) -> String {
        format!("cuda {} {:?}", self.sampler.module().name(), self.variant)
    }

    fn sample_draws(
        &self,
        lm_head: &Matrix,
        hidden: &Matrix,
        params: &[SamplingParams],
        draws: Draws,
    ) -> Result<Vec<u32>> {
        let head = self.sampler.upload_lm_head(lm_head)?;
        let device_hidden = self.sampler.upload_hidden(hidden)?;
        let mut tokens = self.sampler.tokens(hidden.rows(), draws.count as usize)?;
        // Grow the workspace to this problem, then poison it and the output, then sample.
        self.sampler.sample_draws_into(&head, &device_hidden, params, draws, self.variant, &mut tokens)?;
        self.sampler.poison_workspace()?;
        self.sampler.fill_tokens(&mut tokens, 0xffff_fffe)?;
        self.sampler.sample_draws_into(&head, &device_hidden, params, draws, self.variant, &mut tokens)?;
        let out = self.sampler.tokens_to_host(&tokens)?;
        let vocab = lm_head.rows() as u32;
        if let Some(bad) = out.iter().position(|&t| t >= vocab) {
            panic!("{}: slot {bad} holds {:#x}, not a token (unwritten or poisoned)", self.name(), out[bad]);
        }
        Ok(out)
    }
}

/// A `rows × cols` matrix of uniform values in `[-scale, scale)`, in `dtype`.
pub fn random_matrix(rows: usize, cols: usize, dtype: DType, scale: f32, seed: u64) -> Matrix {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let values: Vec<f32> = (0..rows * cols).map(|_| rng.random_range(-scale..scale)).collect();
    let elements = match dtype {
        DType::F32 => Elements::F32(values),
        DType::F16 => Elements::F16(values.into_iter().map(f16::from_f32).collect()),
        DType::BF16 => Elements::BF16(values.into_iter().map(bf16::from_f32).collect()),
    };
    Matrix::new("test matrix", rows, cols, elements).expect("sizes agree")
}

pub fn params_for(rows: usize, temperature: f32, seed: u64) -> Vec<SamplingParams> {
    (0..rows).map(|r| SamplingParams::new(temperature, seed, r as u32, 0)).collect()
}

/// The kernels' row parameters for `params[row]` (validated as a backend would).
pub fn row_params(lm_head: &Matrix, hidden: &Matrix, params: &[SamplingParams], row: usize) -> RowParams {
    let head = HeadShape { vocab: lm_head.rows(), dim: lm_head.cols(), dtype: lm_head.dtype() };
    check_request(head, hidden.row_range(row, row + 1).shape(), &params[row..row + 1], 1).expect("valid params")[0]
}

/// `softmax(logits · (1/T))` in f64 from the CPU's f32 logits: the distribution being sampled.
pub fn exact_probabilities(logits: &[f32], row: &RowParams) -> Vec<f64> {
    let scaled: Vec<f64> = logits.iter().map(|&l| (l * row.inv_temperature) as f64).collect();
    let max = scaled.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let weights: Vec<f64> = scaled.iter().map(|s| (s - max).exp()).collect();
    let total: f64 = weights.iter().sum();
    weights.iter().map(|w| w / total).collect()
}

/// Pearson's χ² of `counts` against `probabilities`, pooling adjacent bins (in decreasing
/// probability) until each pooled bin expects at least 5 draws. Returns `(χ², dof, p)`.
pub fn chi_square(counts: &[u64], probabilities: &[f64]) -> (f64, usize, f64) {
    let draws: u64 = counts.iter().sum();
    let mut order: Vec<usize> = (0..counts.len()).collect();
    order.sort_by(|&a, &b| probabilities[b].total_cmp(&probabilities[a]));
    let mut bins: Vec<(f64, u64)> = Vec::new();
    let (mut expected, mut observed) = (0.0, 0);
    for i in order {
        expected += probabilities[i] * draws as f64;
        observed += counts[i];
        if expected >= 5.0 {
            bins.push((expected, observed));
            (expected, observed) = (0.0, 0);
        }
    }
    if let Some(last) = bins.last_mut() {
        last.0 += expected;
        last.1 += observed;
    }
    let statistic: f64 = bins.iter().map(|&(e, o)| (o as f64 - e).powi(2) / e).sum();
    let dof = bins.len().saturating_sub(1).max(1);
    let p = 1.0 - ChiSquared::new(dof as f64).expect("dof > 0").cdf(statistic);
    (statistic, dof, p)
}

/// Draws `draws` tokens from one row and tests them against the exact softmax at level `alpha`.
/// Returns the p-value.
pub fn check_distribution(
    backend: &dyn Backend,
    lm_head: &Matrix,
    hidden: &Matrix,
    temperature: f32,
    draws: u32,
    seed: u64,
    alpha: f64,
) -> f64 {
    let params = params_for(1, temperature, seed);
    let tokens = backend.sample(lm_head, hidden, &params, draws).expect("sampling succeeds");
    let mut counts = vec![0u64; lm_head.rows()];
    for &t in &tokens {
        counts[t as usize] += 1;
    }
    let probabilities = exact_probabilities(&logits_row(lm_head, hidden, 0), &row_params(lm_head, hidden, &params, 0));
    let (statistic, dof, p) = chi_square(&counts, &probabilities);
    println!(
        "{}: {:?} V={} D={} T={temperature} draws={draws}: chi2={statistic:.1} dof={dof} p={p:.4}",
        backend.name(),
        lm_head.dtype(),
        lm_head.rows(),
        lm_head.cols()
    );
    assert!(p > alpha, "{}: chi2 = {statistic:.1} with {dof} dof, p = {p:.2e} <= alpha = {alpha}", backend.name());
    p
}

/// How far the GPU's logits may be from the CPU's for one (row, token): both sum the same
/// `D` products in f32 in different orders, so each is within `D·2⁻²⁴·Σ|w·h|` of the exact sum.
pub fn logit_tolerance(lm_head: &Matrix, hidden: &Matrix, row: usize, token: usize) -> f32 {
    let magnitude: f32 = (0..lm_head.cols()).map(|k| (lm_head.get(token, k) * hidden.get(row, k)).abs()).sum();
    2.0 * lm_head.cols() as f32 * f32::EPSILON / 2.0 * magnitude + f32::MIN_POSITIVE
}

/// Compares `backend` with the CPU token by token. Every disagreement must be a near-tie:
/// the CPU's scores of the two tokens differ by less than their logits' rounding bound.
/// Returns the number of disagreements.
pub fn check_matches_cpu(
    backend: &dyn Backend,
    lm_head: &Matrix,
    hidden: &Matrix,
    params: &[SamplingParams],
    samples: u32,
) -> usize {
    let got = backend.sample(lm_head, hidden, params, samples).expect("sampling succeeds");
    let want = Cpu.sample(lm_head, hidden, params, samples).expect("CPU sampling succeeds");
    let mut disagreements = 0;
    for row in 0..hidden.rows() {
        let logits = logits_row(lm_head, hidden, row);
        let rp = row_params(lm_head, hidden, params, row);
        for j in 0..samples as usize {
            let (g, c) = (got[row * samples as usize + j] as usize, want[row * samples as usize + j] as usize);
            if g == c {
                continue;
            }
            disagreements += 1;
            let score = |i: usize| {
                let block = i / 4;
                let four = std::array::from_fn(|r| logits.get(4 * block + r).copied().unwrap_or(f32::NEG_INFINITY));
                block_scores(&rp, j as u32, block as u32, four)[i % 4]
            };
            let gap = (score(c) - score(g)).abs();
            let scale = if rp.greedy != 0 { 1.0 } else { rp.inv_temperature };
            let bound = (logit_tolerance(lm_head, hidden, row, g) + logit_tolerance(lm_head, hidden, row, c)) * scale;
            assert!(
                gap <= bound,
                "{}: row {row} draw {j}: token {g} vs CPU {c}, score gap {gap:e} > rounding bound {bound:e}",
                backend.name()
            );
        }
    }
    println!(
        "{}: {:?} V={} D={} B={} samples={samples}: {disagreements} near-tie disagreements in {} tokens",
        backend.name(),
        lm_head.dtype(),
        lm_head.rows(),
        lm_head.cols(),
        hidden.rows(),
        got.len()
    );
    disagreements
}

/// T = 0 rows return the argmax (lowest index among exact ties) for every draw; sampling
/// rows in the same batch are unaffected.
pub fn check_greedy_is_argmax(backend: &dyn Backend, lm_head: &Matrix, hidden: &Matrix) {
    let params: Vec<SamplingParams> =
        (0..hidden.rows()).map(|r| SamplingParams::new(if r % 2 == 0 { 0.0 } else { 1.0 }, 5, r as u32, 0)).collect();
    let samples = 3;
    let tokens = backend.sample(lm_head, hidden, &params, samples).expect("sampling succeeds");
    for row in (0..hidden.rows()).step_by(2) {
        let logits = logits_row(lm_head, hidden, row);
        let best = (0..logits.len()).fold(0, |b, i| if logits[i] > logits[b] { i } else { b });
        for j in 0..samples as usize {
            let got = tokens[row * samples as usize + j] as usize;
            let bound = logit_tolerance(lm_head, hidden, row, got) + logit_tolerance(lm_head, hidden, row, best);
            assert!(
                got == best || logits[best] - logits[got] <= bound,
                "{}: greedy row {row}: token {got}, argmax {best}",
                backend.name()
            );
        }
    }
}

/// Permuting the batch rows together with their parameters permutes the tokens exactly, and a
/// row sampled alone gets the same tokens as inside the batch.
pub fn check_batch_independence(backend: &dyn Backend, lm_head: &Matrix, hidden: &Matrix) {
    let rows = hidden.rows();
    let params = params_for(rows, 0.8, 99);
    let samples = 4;
    let tokens = backend.sample(lm_head, hidden, &params, samples).expect("sampling succeeds");
    let permutation: Vec<usize> = (0..rows).map(|i| (i * 7 + 3) % rows).collect();
    let mut permuted_values = Vec::new();
    for &p in &permutation {
        permuted_values.extend((0..hidden.cols()).map(|k| hidden.get(p, k)));
    }
    let permuted =
        Matrix::new("permuted", rows, hidden.cols(), Elements::F32(permuted_values)).unwrap().to_dtype(hidden.dtype());
    let permuted_params: Vec<SamplingParams> = permutation.iter().map(|&p| params[p]).collect();
    let permuted_tokens = backend.sample(lm_head, &permuted, &permuted_params, samples).expect("sampling succeeds");
    let s = samples as usize;
    for (i, &p) in permutation.iter().enumerate() {
        assert_eq!(
            permuted_tokens[i * s..(i + 1) * s],
            tokens[p * s..(p + 1) * s],
            "{}: row {p} moved to {i}",
            backend.name()
        );
    }
    let last = rows - 1;
    let alone =
        backend.sample(lm_head, &hidden.row_range(last, rows), &params[last..], samples).expect("sampling succeeds");
    assert_eq!(alone[..], tokens[last * s..], "{}: row {last} alone vs in a batch of {rows}", backend.name());
}

/// Two rows with identical hidden states but different streams draw independently: the
/// fraction of draws where they agree matches `Σ p²` (binomial test, 5 standard deviations).
pub fn check_identical_rows_independent(backend: &dyn Backend, lm_head: &Matrix, hidden_row: &Matrix, draws: u32) {
    let values: Vec<f32> = (0..2).flat_map(|_| (0..hidden_row.cols()).map(|k| hidden_row.get(0, k))).collect();
    let hidden =
        Matrix::new("twins", 2, hidden_row.cols(), Elements::F32(values)).unwrap().to_dtype(hidden_row.dtype());
    let params = params_for(2, 1.0, 2024);
    let tokens = backend.sample(lm_head, &hidden, &params, draws).expect("sampling succeeds");
    let n = draws as usize;
    let agree = (0..n).filter(|&j| tokens[j] == tokens[n + j]).count() as f64;
    let p = exact_probabilities(&logits_row(lm_head, &hidden, 0), &row_params(lm_head, &hidden, &params, 0));
    let collision: f64 = p.iter().map(|q| q * q).sum();
    let expected = collision * n as f64;
    let sd = (n as f64 * collision * (1.0 - collision)).sqrt();
    println!(
        "{}: identical rows agree in {agree} of {n} draws, independence predicts {expected:.1} +- {sd:.1}",
        backend.name()
    );
    assert!(
        (agree - expected).abs() <= 5.0 * sd + 1.0,
        "{}: rows agree {agree} times, expected {expected:.1}",
        backend.name()
    );
}

/// Draws made in several calls (`draws.first > 0`) are the draws of one call: for every row,
/// the calls for `0 .. a` and `a .. n` concatenate to the call for `0 .. n`.
pub fn check_draws_split_across_calls(backend: &dyn Backend, lm_head: &Matrix, hidden: &Matrix, n: u32, a: u32) {
    let params = params_for(hidden.rows(), 1.0, 314);
    let whole = backend.sample_draws(lm_head, hidden, &params, Draws::first(n)).expect("sampling succeeds");
    let head = backend.sample_draws(lm_head, hidden, &params, Draws { first: 0, count: a }).expect("sampling succeeds");
    let tail =
        backend.sample_draws(lm_head, hidden, &params, Draws { first: a, count: n - a }).expect("sampling succeeds");
    let (a, n) = (a as usize, n as usize);
    for row in 0..hidden.rows() {
        let joined: Vec<u32> =
            head[row * a..(row + 1) * a].iter().chain(&tail[row * (n - a)..(row + 1) * (n - a)]).copied().collect();
        assert_eq!(joined, whole[row * n..(row + 1) * n], "{}: row {row}", backend.name());
    }
}
