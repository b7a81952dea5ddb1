//! Test bodies shared by every backend (cubecl style): each takes a [`Backend`] and asserts a
//! property of the sampler. [`suite!`] generates one list of tests from them for a backend:
//! `tests/cpu.rs` runs it on the CPU in CI, `tests/gpu.rs` on the owned GPU sampler and
//! `tests/borrowed.rs` in borrowed mode (both ignored without a GPU), so the suites cannot
//! drift apart; the GPU files add what only the GPU has (every kernel variant, CUDA graphs).

use flashsample::internals::{
    HANDOFF_COLUMNS, MMA_COLUMNS, STAGED_COLUMNS, TMA_COLUMNS, TMA_ITEM_ROWS, Variant, logits_row,
};
use flashsample::{
    Batch, CpuSampler, CudaSampler, DType, Draws, Elements, Error, Matrix, Module, Processing, Result, RowStatus,
    Sampled, Sampler, SamplingParams,
};
use flashsample_core::{RowParams, block_scores};
use half::{bf16, f16};
use rand::{Rng, SeedableRng};

pub mod borrowed;
pub mod processing;
pub mod speculative;
pub mod suite;

pub use borrowed::Borrowed;

// The statistics live in the CLI crate's library (its demo prints a χ² p-value, and a crate
// installed from crates.io cannot depend on this unpublished one); the test bodies use them
// from here as before.
pub use flashsample_cli::stats::{chi_square, exact_probabilities};

/// A sampler under test: one call over a head split into shards (one shard: the whole head),
/// and the forms the bodies use.
pub trait Backend {
    /// The backend in test output.
    fn name(&self) -> String;

    /// `draws` of each row of `hidden` with `batch`, over the LM head split by vocabulary into
    /// `shards` (in order; one shard is the whole head).
    fn sample_shards(&self, shards: &[Matrix], hidden: &Matrix, batch: &Batch, draws: Draws) -> Result<Sampled>;

    /// The draws `draws` of each row, plain: `tokens[b · draws.count + (j − draws.first)]`.
    fn sample_draws(
        &self,
        lm_head: &Matrix,
        hidden: &Matrix,
        params: &[SamplingParams],
        draws: Draws,
    ) -> Result<Vec<u32>> {
        let batch = Batch::new(params.to_vec());
        self.sample_shards(std::slice::from_ref(lm_head), hidden, &batch, draws).map(|sampled| sampled.tokens)
    }

    /// `tokens[b · samples + j]`.
    fn sample(&self, lm_head: &Matrix, hidden: &Matrix, params: &[SamplingParams], samples: u32) -> Result<Vec<u32>> {
        self.sample_draws(lm_head, hidden, params, Draws::first(samples))
    }

    /// `samples` draws of each row with its processing and every row's log-probabilities;
    /// rows without a token keep their sentinels ([`Sampled::rows_without_token`]).
    fn sample_processed(
        &self,
        lm_head: &Matrix,
        hidden: &Matrix,
        params: &[SamplingParams],
        processing: &[Processing],
        samples: u32,
    ) -> Result<Sampled> {
        self.sample_sharded(std::slice::from_ref(lm_head), hidden, params, processing, samples)
    }

    /// As [`Backend::sample_processed`] over `shards`, the LM head's rows split by vocabulary
    /// in order.
    fn sample_sharded(
        &self,
        shards: &[Matrix],
        hidden: &Matrix,
        params: &[SamplingParams],
        processing: &[Processing],
        samples: u32,
    ) -> Result<Sampled> {
        let processing = processing.iter().map(|p| Processing { logprobs: true, ..p.clone() }).collect();
        let batch = Batch::with_processing(params.to_vec(), processing);
        match self.sample_shards(shards, hidden, &batch, Draws::first(samples)) {
            Err(Error::RowsWithoutToken { sampled, .. }) => Ok(*sampled),
            other => other,
        }
    }
}

/// The CPU backend.
pub struct Cpu;

impl Backend for Cpu {
    fn name(&self) -> String {
        "cpu".into()
    }

    fn sample_shards(&self, shards: &[Matrix], hidden: &Matrix, batch: &Batch, draws: Draws) -> Result<Sampled> {
        let sampler = CpuSampler::new();
        sampler.sample(&sampler.upload_lm_head_shards(shards)?, hidden, batch, draws)
    }
}

/// The owned GPU sampler with one tile variant forced; the workspace and the outputs are
/// poisoned before every call so a slot a kernel fails to write shows up as a wrong token or a
/// NaN log-probability. The sampler runs the module for the device, or the one
/// `FLASHSAMPLE_MODULE` forces (the GPU suite runs once with each).
pub struct Cuda {
    pub sampler: CudaSampler,
    pub variant: Variant,
}

impl Cuda {
    pub fn new(variant: Variant) -> Cuda {
        let sampler = CudaSampler::new().expect("these tests need a CUDA GPU");
        sampler.set_variant(variant);
        Cuda { sampler, variant }
    }
}

impl Backend for Cuda {
    fn name(&self) -> String {
        format!("cuda {} {:?}", self.sampler.module().name(), self.variant)
    }

    fn sample_shards(&self, shards: &[Matrix], hidden: &Matrix, batch: &Batch, draws: Draws) -> Result<Sampled> {
        let sampler = &self.sampler;
        let head = sampler.upload_lm_head_shards(shards)?;
        let vocab = head.shape().vocab;
        let on_device = sampler.upload_batch(batch, vocab)?;
        let device_hidden = sampler.upload_hidden(hidden)?;
        let mut outputs = sampler.outputs(&on_device, draws.count)?;
        // Grow the workspace to this problem, then poison it and the outputs, then sample.
        sampler.sample_into(&head, &device_hidden, &on_device, draws, &mut outputs)?;
        sampler.poison_workspace()?;
        sampler.fill_outputs(&mut outputs, UNWRITTEN)?;
        sampler.sample_into(&head, &device_hidden, &on_device, draws, &mut outputs)?;
        let out = sampler.read(&outputs);
        if let Some(sampled) = written(&out) {
            check_written(&self.name(), sampled, vocab);
        }
        out
    }
}

/// What the GPU backends write into every output word before sampling: neither a token nor a
/// row status, and as a log-probability a NaN, so a slot the kernels leave unwritten shows.
pub const UNWRITTEN: u32 = 0xffff_fff0;

/// The results a call wrote, with or without rows lacking a token.
pub fn written(result: &Result<Sampled>) -> Option<&Sampled> {
    match result {
        Ok(sampled) => Some(sampled),
        Err(Error::RowsWithoutToken { sampled, .. }) => Some(sampled),
        Err(_) => None,
    }
}

/// Panics on a slot that holds neither a token below `vocab` nor a row status.
pub fn check_written(name: &str, got: &Sampled, vocab: usize) {
    if let Some(bad) = got.tokens.iter().position(|&t| t as usize >= vocab && RowStatus::of_token(t).is_none()) {
        panic!("{name}: slot {bad} holds {:#x}, not a token (unwritten or poisoned)", got.tokens[bad]);
    }
}

/// `result` as it would be with its rows without a token reported: an error carrying the
/// results when a row has one.
pub fn with_row_statuses(sampled: Sampled) -> Result<Sampled> {
    let rows = sampled.rows_without_token();
    if rows.is_empty() { Ok(sampled) } else { Err(Error::RowsWithoutToken { rows, sampled: Box::new(sampled) }) }
}

/// A `rows × cols` matrix of uniform values in `[-scale, scale)`, in `dtype`.
pub fn random_matrix(rows: usize, cols: usize, dtype: DType, scale: f32, seed: u64) -> Matrix {
    let values = uniform_values(rows * cols, scale, seed);
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
pub fn row_params(params: &[SamplingParams], row: usize) -> RowParams {
    flashsample::internals::row_params(&params[row..row + 1]).expect("valid params")[0]
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
    let probabilities = exact_probabilities(&logits_row(lm_head, hidden, 0), &row_params(&params, 0));
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
        let rp = row_params(params, row);
        for j in 0..samples as usize {
            let (g, c) = (got[row * samples as usize + j] as usize, want[row * samples as usize + j] as usize);
            if g == c {
                continue;
            }
            disagreements += 1;
            let score = |i: usize| {
                let block = i / 4;
                let four = std::array::from_fn(|r| logits.get(4 * block + r).copied().unwrap_or(f32::NEG_INFINITY));
                block_scores(&rp, j as u32, block as u32, four).0[i % 4]
            };
            // A score is `logit + T·g`: a logit's rounding moves it by as much.
            let gap = (score(c) - score(g)).abs();
            let bound = logit_tolerance(lm_head, hidden, row, g) + logit_tolerance(lm_head, hidden, row, c);
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
    let p = exact_probabilities(&logits_row(lm_head, &hidden, 0), &row_params(&params, 0));
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

/// `len` uniform values in `[-scale, scale)` (the values of [`random_matrix`] in f32).
pub fn uniform_values(len: usize, scale: f32, seed: u64) -> Vec<f32> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..len).map(|_| rng.random_range(-scale..scale)).collect()
}

/// `values` (row-major, exactly representable in `dtype`) as a `rows × cols` matrix.
pub fn matrix_of(rows: usize, cols: usize, dtype: DType, values: Vec<f32>) -> Matrix {
    Matrix::new("test matrix", rows, cols, Elements::F32(values)).expect("sizes agree").to_dtype(dtype)
}

/// The tied largest logits of [`check_extreme_temperatures`]'s head.
pub const TIED_TOKENS: [usize; 4] = [3, 250, 611, 999];

/// Every temperature a row may have, at its extremes: `T = 1.4·10⁻⁴⁵` (the smallest f32),
/// `10⁻³⁸`, `10⁻³⁰` and `10⁻⁶`, where `softmax(l / T)` puts all its mass on the largest logits,
/// and `10⁶`, `10³⁰` and the largest accepted, where it is uniform to f32 precision; a greedy row
/// beside them.
///
/// The head's logits for the hidden row `[1, 0, …, 0]` are exactly its first column: 10 at the
/// four [`TIED_TOKENS`], and 9, 5, −2 or 0 elsewhere (V = 1000). Each cold row's draws must all
/// land on the tied tokens, evenly (χ² at `alpha` over 4,000 draws: a sampler that broke the
/// tie by index, as `logit · (1/T)` overflowing to +∞ did, puts them all on token 3); each hot
/// row's draws must follow `softmax(l / T)` (χ² over 20,000 draws in 1000 bins); the greedy row
/// takes token 3, the lowest of the tied argmax, every time.
pub fn check_extreme_temperatures(backend: &dyn Backend, dtype: DType, dim: usize, alpha: f64) {
    let vocab = 1000;
    let mut rng = rand::rngs::StdRng::seed_from_u64(606);
    let mut w = Vec::with_capacity(vocab * dim);
    for i in 0..vocab {
        let logit = if TIED_TOKENS.contains(&i) { 10.0 } else { [9.0, 5.0, -2.0, 0.0][i % 4] };
        w.push(logit);
        w.extend((1..dim).map(|_| rng.random_range(-0.5f32..0.5)));
    }
    let lm_head = matrix_of(vocab, dim, dtype, w);
    let cold = [1e-45, 1e-38, 1e-30, 1e-6];
    let hot = [1e6, 1e30, flashsample_core::noise::MAX_TEMPERATURE];
    let temperatures: Vec<f32> = cold.iter().chain(&hot).copied().chain([0.0]).collect();
    let rows = temperatures.len();
    let hidden = matrix_of(rows, dim, dtype, (0..rows * dim).map(|k| if k % dim == 0 { 1.0 } else { 0.0 }).collect());
    let params: Vec<SamplingParams> =
        temperatures.iter().enumerate().map(|(r, &t)| SamplingParams::new(t, 808, r as u32, 0)).collect();
    let draws = 20_000u32;
    let tokens = backend.sample(&lm_head, &hidden, &params, draws).expect("sampling succeeds");
    let n = draws as usize;
    for (row, &t) in temperatures.iter().enumerate() {
        let slots = &tokens[row * n..(row + 1) * n];
        if t == 0.0 {
            assert!(slots.iter().all(|&token| token == 3), "{}: greedy row drew {slots:?}", backend.name());
            continue;
        }
        let (counts, probabilities) = if cold.contains(&t) {
            // The first 4,000 draws, binned by tied token.
            let mut counts = vec![0u64; TIED_TOKENS.len()];
            for &token in &slots[..4000] {
                let bin = TIED_TOKENS.iter().position(|&tied| tied == token as usize);
                let bin = bin.unwrap_or_else(|| panic!("{}: T = {t:e} drew token {token}", backend.name()));
                counts[bin] += 1;
            }
            (counts, vec![0.25; 4])
        } else {
            let mut counts = vec![0u64; vocab];
            slots.iter().for_each(|&token| counts[token as usize] += 1);
            (counts, exact_probabilities(&logits_row(&lm_head, &hidden, row), &row_params(&params, row)))
        };
        let (statistic, dof, p) = chi_square(&counts, &probabilities);
        println!("{}: T = {t:e}: chi2 = {statistic:.1}, dof = {dof}, p = {p:.3}", backend.name());
        assert!(p > alpha, "{}: T = {t:e}: chi2 = {statistic:.1}, p = {p:.2e}", backend.name());
    }
}

/// Non-finite logits from finite inputs (products that overflow f32), one policy on every
/// backend: a row with a +∞ or NaN logit gets [`RowStatus::NonFiniteLogits`] and a row whose
/// logits are all −∞ gets [`RowStatus::NoAllowedToken`], in every slot and whatever the
/// temperature (greedy too); the other rows draw the tokens they draw alone.
///
/// `W` holds 10³⁰ in column 0 of every row and in column 1 of row 17; the hidden rows hold
/// (0, 0), (0, 10³⁰) (+∞ at token 17), (10³⁰, −10³⁰) (NaN or +∞ at 17, +∞ elsewhere),
/// (−10³⁰, 0) (−∞ everywhere), then small values, in those columns. `dtype` is BF16 or F32
/// (F16 cannot hold 10³⁰). With `processing`, every row has it (the truncations find a row's
/// largest logit and non-finite flag on their own path) and a finite row draws what it draws
/// alone with it.
pub fn check_non_finite_logits(backend: &dyn Backend, dtype: DType, dim: usize, processing: Option<&Processing>) {
    let (vocab, big) = (777, 1e30f32);
    let mut w = uniform_values(vocab * dim, 0.3, 909);
    for i in 0..vocab {
        w[i * dim] = big;
    }
    w[17 * dim + 1] = big;
    let lm_head = matrix_of(vocab, dim, dtype, w);
    let heads: [(f32, f32, f32, Option<RowStatus>); 6] = [
        (0.0, 0.0, 1.0, None),
        (0.0, big, 1.0, Some(RowStatus::NonFiniteLogits)),
        (big, -big, 0.5, Some(RowStatus::NonFiniteLogits)),
        (-big, 0.0, 0.7, Some(RowStatus::NoAllowedToken)),
        (0.0, 0.0, 0.0, None),
        (0.0, big, 0.0, Some(RowStatus::NonFiniteLogits)),
    ];
    let rows = heads.len();
    let mut h = uniform_values(rows * dim, 1.0, 910);
    for (r, &(c0, c1, _, _)) in heads.iter().enumerate() {
        h[r * dim] = c0;
        h[r * dim + 1] = c1;
    }
    let hidden = matrix_of(rows, dim, dtype, h);
    let params: Vec<SamplingParams> =
        heads.iter().enumerate().map(|(r, &(_, _, t, _))| SamplingParams::new(t, 4, r as u32, 0)).collect();
    let samples = 5;
    // The rows without a token and every slot: `sample` reports them as an error, processed
    // sampling in its slots' statuses.
    let sample = |hidden: &Matrix, params: &[SamplingParams]| match processing {
        None => match backend.sample(&lm_head, hidden, params, samples) {
            Ok(tokens) => Ok((Vec::new(), tokens)),
            Err(Error::RowsWithoutToken { rows, sampled }) => Ok((rows, sampled.tokens)),
            Err(e) => Err(e),
        },
        Some(p) => backend
            .sample_processed(&lm_head, hidden, params, &vec![p.clone(); params.len()], samples)
            .map(|sampled| (sampled.rows_without_token(), sampled.tokens)),
    };
    let (reported, tokens) = sample(&hidden, &params).expect("a batch with non-finite rows samples");
    let expected: Vec<(usize, RowStatus)> = heads.iter().enumerate().filter_map(|(r, h)| h.3.map(|s| (r, s))).collect();
    assert_eq!(reported, expected, "{}", backend.name());
    let s = samples as usize;
    for (r, &(_, _, _, status)) in heads.iter().enumerate() {
        let slots = &tokens[r * s..(r + 1) * s];
        match status {
            Some(status) => {
                assert!(slots.iter().all(|&t| t == status.token()), "{}: row {r}: {slots:?}", backend.name())
            }
            None => {
                let (none, alone) =
                    sample(&hidden.row_range(r, r + 1), &params[r..r + 1]).expect("a finite row alone samples");
                assert!(none.is_empty(), "{}: row {r} alone: {none:?}", backend.name());
                assert_eq!(slots, &alone[..], "{}: row {r} beside non-finite rows vs alone", backend.name());
            }
        }
    }
}

/// (variant, dtype, D) the GPU tests run for `module`: the tensor-core variants need 16-bit types
/// and D % 8 == 0; D = 200 leaves a partial 64-column chunk (mma) and a partial 64-element TMA
/// box and a partial stage of the staged tile. Every width of the register-direct and staged
/// mma tiles runs in BF16 and F16 (which changes only the multiply instruction); with the
/// Hopper module every width of the three TMA schedules runs in BF16
/// and three TMA tiles in F16. The SIMT variant runs every dtype at an odd D.
pub fn gpu_cases(module: Module) -> Vec<(Variant, DType, usize)> {
    let mut cases = Vec::new();
    for columns in MMA_COLUMNS {
        cases.push((Variant::Mma { columns }, DType::BF16, 200));
        cases.push((Variant::Mma { columns }, DType::F16, 200));
    }
    for columns in STAGED_COLUMNS {
        cases.push((Variant::Staged { columns }, DType::BF16, 200));
        cases.push((Variant::Staged { columns }, DType::F16, 200));
    }
    if module == Module::Hopper {
        for rows in TMA_ITEM_ROWS {
            for columns in TMA_COLUMNS {
                cases.push((Variant::Tma { rows, columns }, DType::BF16, 200));
            }
        }
        for columns in HANDOFF_COLUMNS {
            cases.push((Variant::TmaHandoff { columns }, DType::BF16, 200));
        }
        for (rows, columns) in [(64, 8), (128, 128)] {
            cases.push((Variant::Tma { rows, columns }, DType::F16, 200));
        }
        cases.push((Variant::TmaHandoff { columns: 128 }, DType::F16, 200));
    }
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        cases.push((Variant::Simt, dtype, 199));
    }
    cases
}
