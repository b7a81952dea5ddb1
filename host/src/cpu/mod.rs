//! The CPU backend: the same noise, processing and merge as the GPU, logits in f32, on all
//! cores.
//!
//! It is the reference the GPU tests compare against and the fallback without a GPU. Logits
//! are summed in order `k = 0, 1, …` in f32; the GPU sums in another order, so the two agree
//! on every token except rare near-ties (measured in `docs/EXACTNESS.md`).

mod pipeline;

use flashsample_core::process::{LogSumExp, token_log_probabilities};
use flashsample_core::{Candidate, RowParams, block_candidate};
use rayon::prelude::*;

use crate::batch::Batch;
use crate::error::{Result, sampled_or_row_status};
use crate::params::{Draws, check_hidden_values, check_lm_head, check_request_shape};
use crate::sampled::Sampled;
use crate::sampler::{HeadStorage, LmHead, Owner, Sampler};
use crate::tensor::{Elements, Matrix};
use pipeline::{ProcessedRow, process_sharded_row, top_raw_log_probabilities};

/// Samples on the CPU with rayon's thread pool. Every `CpuSampler` shares the heads any of
/// them uploads.
///
/// ```
/// use flashsample::{Batch, CpuSampler, Draws, Elements, Matrix, Processing, Sampler, SamplingParams};
/// let w = Matrix::new("lm_head", 4, 2, Elements::F32(vec![1.0, 0.0, 0.0, 1.0, 0.5, 0.5, -1.0, 0.0]))?;
/// let h = Matrix::new("hidden", 1, 2, Elements::F32(vec![2.0, -1.0]))?;
/// let sampler = CpuSampler::new();
/// let head = sampler.upload_lm_head(&w)?;
/// // The two most likely tokens only, with each draw's log-probabilities.
/// let row = Processing { top_k: Some(2), logprobs: true, ..Processing::default() };
/// let batch = Batch::with_processing(vec![SamplingParams::new(1.0, 7, 0, 0)], vec![row]);
/// let sampled = sampler.sample(&head, &h, &batch, Draws::first(8))?;
/// assert!(sampled.tokens.iter().all(|&t| t == 0 || t == 2));
/// assert_eq!(sampled.logprobs.len(), 8);
/// # Ok::<(), flashsample::Error>(())
/// ```
#[derive(Clone, Copy, Debug, Default)]
pub struct CpuSampler;

fn row_as_f32(elements: &Elements, start: usize, len: usize, out: &mut Vec<f32>) {
    out.clear();
    match elements {
        Elements::F32(v) => out.extend_from_slice(&v[start..start + len]),
        Elements::F16(v) => out.extend(v[start..start + len].iter().map(|x| x.to_f32())),
        Elements::BF16(v) => out.extend(v[start..start + len].iter().map(|x| x.to_f32())),
    }
}

/// `logits[i] = Σ_k W[i, k] · H[row, k]`, summed in f32 in increasing `k`.
pub(crate) fn logits_row(lm_head: &Matrix, hidden: &Matrix, row: usize) -> Vec<f32> {
    let dim = lm_head.cols();
    let mut h = Vec::with_capacity(dim);
    row_as_f32(hidden.elements(), row * dim, dim, &mut h);
    (0..lm_head.rows())
        .into_par_iter()
        .map_init(Vec::new, |w, i| {
            row_as_f32(lm_head.elements(), i * dim, dim, w);
            let mut sum = 0.0f32;
            for (a, b) in w.iter().zip(&h) {
                sum += a * b;
            }
            sum
        })
        .collect()
}

/// The winner of draw number `draw_index` over the vocabulary entries `offset ..
/// offset + logits.len()` (all of it for offset 0): each entry keeps the noise of its global
/// index, so the shards' winners merge into the unsharded one.
pub(crate) fn draw_range(logits: &[f32], offset: u32, row: &RowParams, draw_index: u32) -> Candidate {
    let Some(last) = (logits.len() as u32).checked_sub(1).map(|n| offset + n) else { return Candidate::NONE };
    let mut best = Candidate::NONE;
    for philox_block in offset / 4..=last / 4 {
        // Entries of the block outside the shard race with −∞, which never wins.
        let four = std::array::from_fn(|r| {
            let i = 4 * philox_block + r as u32;
            if (offset..=last).contains(&i) { logits[(i - offset) as usize] } else { f32::NEG_INFINITY }
        });
        best = best.merge(block_candidate(row, draw_index, philox_block, four, 4));
    }
    best
}

impl CpuSampler {
    /// The CPU backend.
    pub fn new() -> CpuSampler {
        CpuSampler
    }
}

impl Sampler for CpuSampler {
    fn device(&self) -> String {
        "cpu".into()
    }

    fn upload_lm_head(&self, lm_head: &Matrix) -> Result<LmHead> {
        self.upload_lm_head_shards(std::slice::from_ref(lm_head))
    }

    fn upload_lm_head_shards(&self, shards: &[Matrix]) -> Result<LmHead> {
        let shapes = shards.iter().map(check_lm_head).collect::<Result<Vec<_>>>()?;
        LmHead::new(Owner::CPU, &shapes, HeadStorage::Cpu(shards.to_vec()))
    }

    /// Each shard is processed and raced on its own with its tokens' global indices and
    /// noise, the truncations are decided from the shards' summaries, and the per-shard
    /// winners and log-sum-exp terms merge into the unsharded tokens (identical) and
    /// log-probabilities (equal up to the order of the log-sum-exp sums).
    fn sample(&self, lm_head: &LmHead, hidden: &Matrix, batch: &Batch, draws: Draws) -> Result<Sampled> {
        lm_head.check_owner(Owner::CPU)?;
        let HeadStorage::Cpu(shards) = &lm_head.storage else {
            return Err(crate::error::invalid("lm_head", "uploaded by a GPU sampler: upload it with this one"));
        };
        let draws = draws.check()?;
        check_request_shape(lm_head.shape, hidden.shape(), batch.rows(), "params", draws.count)?;
        let (rows, processing) = batch.check(lm_head.shape.vocab)?;
        batch.check_draws(draws)?;
        check_hidden_values(hidden)?;
        let offsets: Vec<u32> = lm_head.offsets.iter().map(|&o| o as u32).collect();
        let raw: Vec<Vec<Vec<f32>>> =
            (0..rows.len()).map(|b| shards.iter().map(|shard| logits_row(shard, hidden, b)).collect()).collect();
        let processed: Vec<Vec<ProcessedRow>> = (0..rows.len())
            .map(|b| {
                let slices: Vec<&[f32]> = raw[b].iter().map(Vec::as_slice).collect();
                process_sharded_row(&slices, &offsets, &rows[b], &processing[b])
            })
            .collect();
        let n = draws.count as usize;
        let tokens: Vec<u32> = (0..rows.len() * n)
            .into_par_iter()
            .map(|k| {
                let (b, j) = (k / n, draws.first + (k % n) as u32);
                processed[b]
                    .iter()
                    .map(|part| draw_range(&part.logits, part.offset, &rows[b], j))
                    .fold(Candidate::NONE, Candidate::merge)
                    .index
            })
            .collect();
        let mut sampled = Sampled::tokens_only(tokens, n);
        sampled.judge(batch);
        if !batch.reports_logprobs() {
            return sampled_or_row_status(sampled);
        }
        let merged: Vec<(LogSumExp, LogSumExp)> = processed
            .iter()
            .zip(&rows)
            .map(|(parts, row)| {
                let (mut raw_lse, mut kept) = (LogSumExp::EMPTY, LogSumExp::EMPTY);
                for part in parts {
                    raw_lse.merge_with(part.raw, 1.0);
                    kept.merge_with(part.kept, row.temperature);
                }
                (raw_lse, kept)
            })
            .collect();
        let (logprobs, processed_logprobs): (Vec<f32>, Vec<f32>) = (0..rows.len() * n)
            .into_par_iter()
            .map(|k| {
                let (b, token) = (k / n, sampled.tokens[k]);
                let logits = processed[b].iter().zip(&raw[b]).find_map(|(part, raw)| {
                    let i = token.checked_sub(part.offset)? as usize;
                    Some((*raw.get(i)?, part.logits[i]))
                });
                let (raw, kept, row) = (&merged[b].0, &merged[b].1, &rows[b]);
                token_log_probabilities(token, logits, raw, kept, row.greedy != 0, row.temperature)
            })
            .unzip();
        sampled.logprobs = logprobs;
        sampled.processed_logprobs = processed_logprobs;
        sampled.top_logprobs = (0..rows.len())
            .map(|b| {
                let slices: Vec<&[f32]> = raw[b].iter().map(Vec::as_slice).collect();
                top_raw_log_probabilities(&slices, &offsets, &merged[b].0, processing[b].top_logprobs)
            })
            .collect();
        sampled_or_row_status(sampled)
    }
}
