//! Test bodies of logit processing and log-probabilities, for every backend: each mode
//! against the exact target distribution computed here in f64 (independently of the library's
//! pipeline), the boundary cases, the log-probabilities and the mixed batch.

use std::collections::HashMap;

use flashsample::internals::logits_row;
use flashsample::{
    Batch, CudaHidden, CudaSampler, DeviceBatch, Draws, LmHead, Matrix, Penalties, Processing, Result, RowStatus,
    Sampled, Sampler, SamplingParams,
};

use crate::{Backend, chi_square};

/// A batch's inputs on one GPU (LM head, hidden states, the batch), uploaded once for several
/// calls of the owned sampler.
pub struct OnDevice {
    pub head: LmHead,
    pub hidden: CudaHidden,
    pub batch: DeviceBatch,
    /// The batch on the host, from which [`OnDevice::sample`] makes its variants.
    host: Batch,
}

impl OnDevice {
    pub fn new(
        sampler: &CudaSampler,
        lm_head: &Matrix,
        hidden: &Matrix,
        params: &[SamplingParams],
        processing: &[Processing],
    ) -> OnDevice {
        let batch = Batch::with_processing(params.to_vec(), processing.to_vec());
        OnDevice {
            head: sampler.upload_lm_head(lm_head).unwrap(),
            hidden: sampler.upload_hidden(hidden).unwrap(),
            batch: sampler.upload_batch(&batch, lm_head.rows()).unwrap(),
            host: batch,
        }
    }

    /// The batch with every row reporting its drawn tokens' log-probabilities, or none but
    /// those asking for top entries.
    pub fn batch_reporting(&self, sampler: &CudaSampler, logprobs: bool) -> Result<DeviceBatch> {
        let mut host = self.host.clone();
        if host.processing.is_empty() {
            host.processing = vec![Processing::default(); host.rows()];
        }
        host.processing.iter_mut().for_each(|p| p.logprobs = logprobs);
        sampler.upload_batch(&host, self.head.shape().vocab)
    }

    /// `n` draws per row with the sampler's tile, with the batch
    /// [`OnDevice::batch_reporting`] `logprobs`; rows without a token keep their sentinels.
    pub fn sample(&self, sampler: &CudaSampler, n: u32, logprobs: bool) -> Result<Sampled> {
        let batch = self.batch_reporting(sampler, logprobs)?;
        let mut out = sampler.outputs(&batch, n)?;
        sampler.sample_into(&self.head, &self.hidden, &batch, Draws::first(n), &mut out)?;
        match sampler.read(&out) {
            Err(flashsample::Error::RowsWithoutToken { sampled, .. }) => Ok(*sampled),
            other => other,
        }
    }
}

/// The processed logits in f64 (soft-cap, bias, mask, penalties), written from the
/// definitions.
pub fn reference_logits(raw: &[f32], p: &Processing) -> Vec<f64> {
    let mut l: Vec<f64> = raw.iter().map(|&x| x as f64).collect();
    if let Some(cap) = p.softcap {
        let cap = cap as f64;
        l.iter_mut().for_each(|x| *x = cap * (*x / cap).tanh());
    }
    for &(token, value) in &p.bias {
        l[token as usize] += value as f64;
    }
    if let Some(mask) = &p.mask {
        for (i, x) in l.iter_mut().enumerate() {
            if mask[i / 32] >> (i % 32) & 1 == 0 {
                *x = f64::NEG_INFINITY;
            }
        }
    }
    let mut counts: HashMap<u32, u32> = HashMap::new();
    p.history.iter().for_each(|&t| *counts.entry(t).or_default() += 1);
    let pen = p.penalties;
    for (&token, &count) in &counts {
        let x = &mut l[token as usize];
        *x = if *x > 0.0 { *x / pen.repetition as f64 } else { *x * pen.repetition as f64 };
        *x -= pen.frequency as f64 * count as f64 + pen.presence as f64;
    }
    l
}

/// The exact distribution a row draws from, in f64: `softmax(l / T)` over the tokens that
/// min-p, top-k and top-p keep, in that order (ties at the k-th value kept; top-p's smallest
/// prefix by decreasing probability, then increasing index, whose mass reaches p).
pub fn reference_distribution(raw: &[f32], temperature: f32, p: &Processing) -> Vec<f64> {
    let l = reference_logits(raw, p);
    let t = temperature as f64;
    let max = l.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let mut w: Vec<f64> = l.iter().map(|&x| ((x - max) / t).exp()).collect();
    if p.min_p > 0.0 {
        w.iter_mut().filter(|x| **x < p.min_p as f64).for_each(|x| *x = 0.0);
    }
    let mut order: Vec<usize> = (0..w.len()).filter(|&i| w[i] > 0.0).collect();
    order.sort_by(|&a, &b| w[b].total_cmp(&w[a]).then(a.cmp(&b)));
    if let Some(k) = p.top_k
        && (k as usize) < order.len()
    {
        let kth = w[order[k as usize - 1]];
        for &i in &order {
            if w[i] < kth {
                w[i] = 0.0;
            }
        }
        order.retain(|&i| w[i] > 0.0);
    }
    if p.top_p < 1.0 {
        let total: f64 = order.iter().map(|&i| w[i]).sum();
        let mut mass = 0.0;
        let mut keep = order.len();
        for (n, &i) in order.iter().enumerate() {
            mass += w[i];
            if mass >= p.top_p as f64 * total {
                keep = n + 1;
                break;
            }
        }
        order[keep..].iter().for_each(|&i| w[i] = 0.0);
    }
    let total: f64 = w.iter().sum();
    w.iter().map(|x| x / total).collect()
}

/// `draws` tokens of row 0 under `processing` against [`reference_distribution`] at level
/// `alpha`; a draw of a token the reference gives probability 0 fails at once. Returns p.
pub fn check_processed_distribution(
    backend: &dyn Backend,
    lm_head: &Matrix,
    hidden: &Matrix,
    temperature: f32,
    processing: &Processing,
    draws: u32,
    alpha: f64,
) -> f64 {
    let params = [SamplingParams::new(temperature, 1234, 0, 0)];
    let got = backend
        .sample_processed(lm_head, hidden, &params, std::slice::from_ref(processing), draws)
        .expect("processed sampling succeeds");
    let raw = logits_row(lm_head, hidden, 0);
    check_processed_tokens(&backend.name(), &got.tokens, &raw, temperature, processing, alpha)
}

/// `tokens` drawn from the row of raw logits `raw` under `processing` against
/// [`reference_distribution`] at level `alpha` (a token the reference gives probability 0
/// fails at once), as `name` drew them. Returns p.
pub fn check_processed_tokens(
    name: &str,
    tokens: &[u32],
    raw: &[f32],
    temperature: f32,
    processing: &Processing,
    alpha: f64,
) -> f64 {
    let probabilities = reference_distribution(raw, temperature, processing);
    let mut counts = vec![0u64; raw.len()];
    for &token in tokens {
        assert!(
            probabilities[token as usize] > 0.0,
            "{name}: drew token {token}, which the target excludes ({processing:?})"
        );
        counts[token as usize] += 1;
    }
    let kept = probabilities.iter().filter(|&&q| q > 0.0).count();
    let (statistic, dof, p) = chi_square(&counts, &probabilities);
    println!(
        "{name}: V={} T={temperature} kept={kept} draws={}: chi2={statistic:.1} dof={dof} p={p:.4}",
        raw.len(),
        tokens.len()
    );
    assert!(p > alpha, "{name}: chi2 = {statistic:.1}, dof = {dof}, p = {p:.2e} ({processing:?})");
    p
}

/// [`check_processed_distribution`] for each of [`each_mode`] on row 0 of `hidden`.
pub fn check_every_mode(
    backend: &dyn Backend,
    lm_head: &Matrix,
    hidden: &Matrix,
    temperature: f32,
    draws: u32,
    alpha: f64,
) {
    for (name, processing) in each_mode(lm_head.rows()) {
        println!("{name}:");
        check_processed_distribution(backend, lm_head, hidden, temperature, &processing, draws, alpha);
    }
}

/// One processing of each kind on a head of `vocab` tokens, as the χ² tests run them.
pub fn each_mode(vocab: usize) -> Vec<(&'static str, Processing)> {
    let v = vocab as u32;
    let mut mask = vec![0u32; vocab.div_ceil(32)];
    for i in (0..v).filter(|i| i % 3 != 1) {
        mask[(i / 32) as usize] |= 1 << (i % 32);
    }
    let history: Vec<u32> = (0..200).map(|i| (i * 7919) % v).collect();
    let base = Processing::default;
    vec![
        ("softcap", Processing { softcap: Some(1.5), ..base() }),
        ("bias", Processing { bias: (0..v).step_by(5).map(|i| (i, 1.25)).collect(), ..base() }),
        ("mask", Processing { mask: Some(mask), ..base() }),
        (
            "penalties",
            Processing { history, penalties: Penalties { repetition: 1.3, frequency: 0.2, presence: 0.4 }, ..base() },
        ),
        ("min-p", Processing { min_p: 0.2, ..base() }),
        ("top-k", Processing { top_k: Some(40), ..base() }),
        ("top-p", Processing { top_p: 0.6, ..base() }),
        ("top-k + top-p + min-p", Processing { top_k: Some(200), top_p: 0.8, min_p: 0.05, ..base() }),
    ]
}

/// The boundary cases, each on one head: k = 1 is the argmax; k = V, top-p = 1 and min-p = 0
/// give plain sampling's tokens; top-k keeps every token tied at the k-th value; a mask of one
/// token always draws it; a bias of −∞ bans its token, and banning all leaves the row
/// [`RowStatus::NoAllowedToken`]; greedy rows honour bias and mask; k > V, p outside (0, 1]
/// and a mask of the wrong width are refused, naming the field.
pub fn check_processing_edges(backend: &dyn Backend, lm_head: &Matrix, hidden: &Matrix) {
    let (vocab, n) = (lm_head.rows(), 64u32);
    let v = vocab as u32;
    let params = [SamplingParams::new(0.9, 77, 0, 0)];
    let run = |p: Processing| backend.sample_processed(lm_head, &hidden.row_range(0, 1), &params, &[p], n);
    let raw = logits_row(lm_head, hidden, 0);
    let argmax = (0..vocab).fold(0, |best, i| if raw[i] > raw[best] { i } else { best }) as u32;
    let plain = run(Processing::default()).expect("plain").tokens;
    for p in [
        Processing { top_k: Some(v), ..Default::default() },
        Processing { top_p: 1.0, min_p: 0.0, ..Default::default() },
    ] {
        assert_eq!(run(p).expect("no-op truncation").tokens, plain, "{}", backend.name());
    }
    let k1 = run(Processing { top_k: Some(1), ..Default::default() }).expect("k = 1");
    assert!(k1.tokens.iter().all(|&t| t == argmax), "{}: k = 1 drew {:?}", backend.name(), k1.tokens);
    assert!(k1.processed_logprobs.iter().all(|&lp| lp == 0.0), "{}: k = 1 log-probabilities", backend.name());

    let mut one = vec![0u32; vocab.div_ceil(32)];
    one[(v / 2 / 32) as usize] |= 1 << ((v / 2) % 32);
    let masked = run(Processing { mask: Some(one.clone()), ..Default::default() }).expect("one allowed");
    assert!(masked.tokens.iter().all(|&t| t == v / 2), "{}: {:?}", backend.name(), masked.tokens);

    let banned = run(Processing { bias: vec![(argmax, f32::NEG_INFINITY)], ..Default::default() }).expect("ban");
    assert!(banned.tokens.iter().all(|&t| t != argmax), "{}: banned token drawn", backend.name());
    let all: Vec<(u32, f32)> = (0..v).map(|i| (i, f32::NEG_INFINITY)).collect();
    let none = run(Processing { bias: all, ..Default::default() }).expect("all banned");
    assert_eq!(none.rows_without_token(), [(0, RowStatus::NoAllowedToken)], "{}", backend.name());

    let greedy = [SamplingParams::new(0.0, 77, 0, 0)];
    let g = backend
        .sample_processed(
            lm_head,
            &hidden.row_range(0, 1),
            &greedy,
            &[Processing { mask: Some(one), ..Default::default() }],
            2,
        )
        .expect("greedy with a mask");
    assert_eq!(g.tokens, [v / 2, v / 2], "{}: greedy ignores the mask", backend.name());

    for (p, field) in [
        (Processing { top_k: Some(v + 1), ..Default::default() }, "top_k"),
        (Processing { top_k: Some(0), ..Default::default() }, "top_k"),
        (Processing { top_p: 0.0, ..Default::default() }, "top_p"),
        (Processing { top_p: 1.5, ..Default::default() }, "top_p"),
        (Processing { min_p: -0.1, ..Default::default() }, "min_p"),
        (Processing { mask: Some(vec![0; vocab.div_ceil(32) + 1]), ..Default::default() }, "mask"),
        (Processing { history: vec![v], ..Default::default() }, "history"),
        (Processing { softcap: Some(0.0), ..Default::default() }, "softcap"),
        (Processing { bias: vec![(0, f32::NAN)], ..Default::default() }, "bias"),
        (Processing { top_logprobs: 21, ..Default::default() }, "top_logprobs"),
    ] {
        let message = run(p).expect_err("refused").to_string();
        assert!(message.contains(&format!("processing[0].{field}")), "{}: {message}", backend.name());
    }
}

/// Ties at the k-th value are kept: logits 2, 2, 2, 1, … with k = 2 keep all three 2s, evenly.
pub fn check_top_k_keeps_ties(backend: &dyn Backend, lm_head: &Matrix, hidden: &Matrix, alpha: f64) {
    let p = Processing { top_k: Some(2), ..Default::default() };
    check_processed_distribution(backend, lm_head, hidden, 1.0, &p, 6000, alpha);
    let params = [SamplingParams::new(1.0, 5, 0, 0)];
    let got = backend.sample_processed(lm_head, hidden, &params, &[p], 3000).expect("ties");
    let mut seen = got.tokens.clone();
    seen.sort_unstable();
    seen.dedup();
    assert_eq!(seen, [0, 1, 2], "{}: top-k = 2 over three tied logits", backend.name());
}

/// Log-probabilities against f64: the raw one is `log_softmax(raw logits)` of the token, the
/// processed one `log` of the reference distribution's probability, and each row's top raw
/// log-probabilities (20, 5, 1 or none) the largest raw logits in order; within `tolerance`.
/// The temperatures include 10⁻⁴⁵ (whose `1 / T` overflows) and 10³⁰.
pub fn check_log_probabilities(backend: &dyn Backend, lm_head: &Matrix, hidden: &Matrix, tolerance: f64) {
    let modes = each_mode(lm_head.rows());
    let rows = hidden.rows().min(modes.len());
    let params: Vec<SamplingParams> =
        (0..rows).map(|r| SamplingParams::new([0.7, 1.0, 1.6, 1e-45, 1e30][r % 5], 31, r as u32, 0)).collect();
    // Rows also ask for their top 20, 5, 1 or no raw log-probabilities.
    let processing: Vec<Processing> = modes[..rows]
        .iter()
        .enumerate()
        .map(|(r, m)| Processing { top_logprobs: [20, 5, 1, 0][r % 4], ..m.1.clone() })
        .collect();
    let hidden = hidden.row_range(0, rows);
    let n = 16u32;
    let got = backend.sample_processed(lm_head, &hidden, &params, &processing, n).expect("log-probabilities");
    let names: Vec<&str> = modes[..rows].iter().map(|m| m.0).collect();
    let worst =
        assert_log_probabilities(&backend.name(), lm_head, &hidden, &params, &processing, &names, &got, tolerance);
    println!("{}: log-probabilities within {worst:.2e} of f64", backend.name());
}

/// Asserts `got`'s log-probabilities (of `hidden`'s rows with `params` and `processing`,
/// named `names`) against f64 within `tolerance`, as [`check_log_probabilities`] states them
/// (a greedy row's processed one is 0), and returns the largest error.
#[allow(clippy::too_many_arguments)]
pub fn assert_log_probabilities(
    backend: &str,
    lm_head: &Matrix,
    hidden: &Matrix,
    params: &[SamplingParams],
    processing: &[Processing],
    names: &[&str],
    got: &Sampled,
    tolerance: f64,
) -> f64 {
    let n = got.draws;
    let mut worst: f64 = 0.0;
    for r in 0..hidden.rows() {
        let raw = logits_row(lm_head, hidden, r);
        let max = raw.iter().map(|&x| x as f64).fold(f64::NEG_INFINITY, f64::max);
        let log_z = max + raw.iter().map(|&x| (x as f64 - max).exp()).sum::<f64>().ln();
        let mut order: Vec<usize> = (0..raw.len()).collect();
        order.sort_by(|&i, &j| raw[j].total_cmp(&raw[i]).then(i.cmp(&j)));
        let top = &got.top_logprobs[r];
        assert_eq!(top.len(), processing[r].top_logprobs as usize, "{backend}: row {r}");
        for (k, &(token, lp)) in top.iter().enumerate() {
            assert_eq!(token as usize, order[k], "{backend}: row {r}, top {k}");
            let error = (lp as f64 - (raw[order[k]] as f64 - log_z)).abs();
            worst = worst.max(error);
            assert!(error <= tolerance, "{backend}: row {r} top {k}: {lp} vs f64");
        }
        // A greedy row's token has all of its distribution's mass.
        let greedy = params[r].temperature == 0.0;
        let q = if greedy { Vec::new() } else { reference_distribution(&raw, params[r].temperature, &processing[r]) };
        for j in 0..n {
            let k = r * n + j;
            let token = got.tokens[k] as usize;
            let raw_lp = raw[token] as f64 - log_z;
            let processed_lp = if greedy { 0.0 } else { q[token].ln() };
            for (name, got, want) in
                [("raw", got.logprobs[k] as f64, raw_lp), ("processed", got.processed_logprobs[k] as f64, processed_lp)]
            {
                let error = (got - want).abs();
                worst = worst.max(error);
                assert!(
                    error <= tolerance,
                    "{backend}: row {r} ({}) token {token}: {name} log-probability {got} vs f64 {want}",
                    names[r]
                );
            }
        }
    }
    worst
}

/// Every mode in one batch: each row gets the tokens it gets alone, and its log-probabilities
/// to within 10⁻⁶ (relative above 1): on the GPU a batch with a row that needs its whole row
/// sums every row's log-sum-exp terms in the processing kernel, a row alone without one in
/// the fused tiles (whose winners' logits are dot products rounded once), and the two may
/// differ in the last bits.
pub fn check_mixed_batch(backend: &dyn Backend, lm_head: &Matrix, hidden: &Matrix) {
    let modes = each_mode(lm_head.rows());
    let rows = hidden.rows().min(modes.len());
    let params: Vec<SamplingParams> =
        (0..rows).map(|r| SamplingParams::new(if r == 3 { 0.0 } else { 0.8 }, 9, r as u32, 2)).collect();
    let processing: Vec<Processing> = modes[..rows].iter().map(|m| m.1.clone()).collect();
    let n = 32u32;
    let batch = backend.sample_processed(lm_head, &hidden.row_range(0, rows), &params, &processing, n).expect("batch");
    for r in 0..rows {
        let alone = backend
            .sample_processed(lm_head, &hidden.row_range(r, r + 1), &params[r..r + 1], &processing[r..r + 1], n)
            .expect("alone");
        let slots = r * n as usize..(r + 1) * n as usize;
        assert_eq!(batch.tokens[slots.clone()], alone.tokens[..], "{}: row {r} ({})", backend.name(), modes[r].0);
        let in_batch = Sampled {
            draws: n as usize,
            tokens: batch.tokens[slots.clone()].to_vec(),
            logprobs: batch.logprobs[slots.clone()].to_vec(),
            processed_logprobs: batch.processed_logprobs[slots].to_vec(),
            top_logprobs: Vec::new(),
            verdicts: Vec::new(),
        };
        let worst = largest_log_probability_difference(&in_batch, &alone, true);
        assert!(worst <= 1e-6, "{}: row {r} ({}): log-probabilities differ by {worst}", backend.name(), modes[r].0);
    }
}

/// The LM head `w` split into shards at `bounds` (row indices, from 0 to V).
pub fn split_rows(w: &Matrix, bounds: &[usize]) -> Vec<Matrix> {
    bounds.windows(2).map(|b| w.row_range(b[0], b[1])).collect()
}

/// Shard bounds of V into `shards` uneven parts: a part of every other shard moves to its
/// neighbour, and every bound is a multiple of `align`.
pub fn uneven_bounds(vocab: usize, shards: usize, align: usize) -> Vec<usize> {
    (0..=shards)
        .map(|s| match s {
            0 => 0,
            s if s == shards => vocab,
            s => (s * vocab / shards + (s % 2) * align).next_multiple_of(align),
        })
        .collect()
}

/// W split by vocabulary into 2, 3 and 8 uneven shards (bounds multiples of `align`): every
/// mode of `modes` in one batch (with top raw log-probabilities on two rows in three if
/// `top`) gives exactly the unsharded tokens and top raw tokens, and log-probabilities within
/// 10⁻⁵, relative above 1 (their log-sum-exp terms are summed in another order).
pub fn check_shards(
    backend: &dyn Backend,
    w: &Matrix,
    h: &Matrix,
    modes: &[(&'static str, Processing)],
    align: usize,
    top: bool,
) {
    let vocab = w.rows();
    let params: Vec<SamplingParams> =
        (0..modes.len()).map(|r| SamplingParams::new(if r == 2 { 0.0 } else { 0.9 }, 8, r as u32, 1)).collect();
    let top_count = |r: usize| if top { r as u32 % 3 * 7 } else { 0 };
    let processing: Vec<Processing> =
        modes.iter().enumerate().map(|(r, m)| Processing { top_logprobs: top_count(r), ..m.1.clone() }).collect();
    let whole = backend.sample_processed(w, h, &params, &processing, 64).unwrap();
    for shards in [2usize, 3, 8] {
        let bounds = uneven_bounds(vocab, shards, align);
        let got = backend.sample_sharded(&split_rows(w, &bounds), h, &params, &processing, 64).unwrap();
        assert_eq!(got.tokens, whole.tokens, "{}: {shards} shards at {bounds:?}", backend.name());
        let worst = largest_log_probability_difference(&got, &whole, true);
        for (row, (a, b)) in got.top_logprobs.iter().zip(&whole.top_logprobs).enumerate() {
            assert_eq!(a.len(), b.len(), "{shards} shards, row {row}");
            for (x, y) in a.iter().zip(b) {
                let close = x.1 == y.1 || (x.1 - y.1).abs() <= 1e-5 * y.1.abs().max(1.0);
                assert!(x.0 == y.0 && close, "{shards} shards, row {row}: {x:?} vs {y:?}");
            }
        }
        println!("{}: {shards} shards: tokens equal, log-probabilities within {worst:.2e}", backend.name());
        assert!(worst <= 1e-5, "{}: {shards} shards: log-probabilities differ by {worst}", backend.name());
    }
}

/// `rows × cols` integers in [−4, 4] (F32; exact in BF16 and F16), a fixed pattern per `seed`:
/// every logit of two such matrices is an integer each backend computes exactly.
pub fn integer_matrix(rows: usize, cols: usize, seed: u64) -> Matrix {
    let values = (0..rows * cols).map(|k| ((k as u64 * 2_654_435_761 + seed) % 9) as f32 - 4.0).collect();
    crate::matrix_of(rows, cols, flashsample::DType::F32, values)
}

/// The largest difference between two results' raw and processed log-probabilities (equal
/// values, infinities included, differ by 0), relative to the reference `b` above 1 if
/// `relative`. Any NaN on one side only, or a different number of values, is an infinite
/// difference: a missing or unwritten log-probability never passes.
pub fn largest_log_probability_difference(a: &Sampled, b: &Sampled, relative: bool) -> f32 {
    if a.logprobs.len() != b.logprobs.len() || a.processed_logprobs.len() != b.processed_logprobs.len() {
        return f32::INFINITY;
    }
    let difference = |x: f32, y: f32| -> f32 {
        match (x.is_nan(), y.is_nan()) {
            (true, true) => 0.0,
            (true, false) | (false, true) => f32::INFINITY,
            _ if x == y => 0.0,
            _ if relative => (x - y).abs() / y.abs().max(1.0),
            _ => (x - y).abs(),
        }
    };
    let pairs = a.logprobs.iter().zip(&b.logprobs).chain(a.processed_logprobs.iter().zip(&b.processed_logprobs));
    pairs.map(|(&x, &y)| difference(x, y)).fold(0.0, |worst, d| if d > worst || d.is_nan() { d } else { worst })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sampled(logprobs: Vec<f32>) -> Sampled {
        let n = logprobs.len();
        Sampled {
            draws: n,
            tokens: vec![0; n],
            processed_logprobs: logprobs.clone(),
            logprobs,
            top_logprobs: vec![Vec::new()],
            verdicts: Vec::new(),
        }
    }

    /// A NaN on one side, a length mismatch or a missing side never pass; equal values,
    /// infinities and NaNs on both sides differ by 0.
    #[test]
    fn log_probability_differences_see_nan_and_missing_values() {
        let reference = sampled(vec![-1.0, f32::NEG_INFINITY, -0.5]);
        assert_eq!(largest_log_probability_difference(&reference, &reference, true), 0.0);
        let nan = sampled(vec![-1.0, f32::NEG_INFINITY, f32::NAN]);
        assert_eq!(largest_log_probability_difference(&nan, &reference, true), f32::INFINITY);
        assert_eq!(largest_log_probability_difference(&reference, &nan, false), f32::INFINITY);
        assert_eq!(largest_log_probability_difference(&nan, &nan, false), 0.0);
        let short = sampled(vec![-1.0, f32::NEG_INFINITY]);
        assert_eq!(largest_log_probability_difference(&short, &reference, true), f32::INFINITY);
        let none = Sampled { logprobs: Vec::new(), processed_logprobs: Vec::new(), ..reference.clone() };
        assert_eq!(largest_log_probability_difference(&none, &reference, true), f32::INFINITY);
        let close = sampled(vec![-1.0, f32::NEG_INFINITY, -0.5 + 1e-6]);
        assert!(largest_log_probability_difference(&close, &reference, false) <= 2e-6);
    }
}
