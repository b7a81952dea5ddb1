//! The CPU backend: the same API and the same noise as the GPU, logits in f32, on all cores.
//!
//! It is the reference the GPU tests compare against and the fallback without a GPU. Logits
//! are summed in order `k = 0, 1, …` in f32; the GPU sums in another order, so the two agree
//! on every token except rare near-ties (measured in `docs/EXACTNESS.md`).

use flashsample_core::process::{LogSumExp, token_log_probabilities};
use flashsample_core::{Candidate, RowParams, block_candidate};
use rayon::prelude::*;

use crate::error::{Result, RowStatus, tokens_or_row_status};
use crate::params::{
    Draws, HeadShape, SamplingParams, check_hidden_values, check_lm_head, check_request, check_sharded_request,
};
use crate::process::{ProcessedRow, Processing, process_sharded_row, top_raw_log_probabilities};
use crate::tensor::{Elements, Matrix};

/// An LM head held for the CPU backend.
#[derive(Clone, Debug)]
pub struct CpuLmHead {
    matrix: Matrix,
    shape: HeadShape,
}

impl CpuLmHead {
    /// Takes `lm_head` (checked: non-empty, `V < 2³¹`, finite) without copying it.
    pub fn new(lm_head: Matrix) -> Result<CpuLmHead> {
        let shape = check_lm_head(&lm_head)?;
        Ok(CpuLmHead { matrix: lm_head, shape })
    }

    pub fn shape(&self) -> HeadShape {
        self.shape
    }
}

/// Samples on the CPU with rayon's thread pool.
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
pub fn logits_row(lm_head: &Matrix, hidden: &Matrix, row: usize) -> Vec<f32> {
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

/// The winner of draw number `draw_index` over all of `logits` with the shared scoring and merge
/// rule.
pub fn draw(logits: &[f32], row: &RowParams, draw_index: u32) -> Candidate {
    draw_range(logits, 0, row, draw_index)
}

/// The winner of draw number `draw_index` over the vocabulary entries `offset ..
/// offset + logits.len()` (a shard): each entry keeps the noise of its global index, so the
/// shards' winners merge into the unsharded one.
pub fn draw_range(logits: &[f32], offset: u32, row: &RowParams, draw_index: u32) -> Candidate {
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

/// Processed draws: `[B, N]` tokens with their log-probabilities, row-major.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampled {
    pub draws: usize,
    /// Drawn tokens; every slot of a row without a token holds its status's sentinel.
    pub tokens: Vec<u32>,
    /// Each token's log-probability under the raw logits (`log_softmax(H·Wᵀ)`, before any
    /// processing and temperature); NaN or −∞ in a row without a token.
    pub logprobs: Vec<f32>,
    /// Each token's log-probability under the distribution it was drawn from (processed,
    /// over temperature, truncated); 0 for a greedy row.
    pub processed_logprobs: Vec<f32>,
    /// Per row, its `top_logprobs` most likely tokens under the raw logits with their raw
    /// log-probabilities, by decreasing logit, then increasing index (empty where not asked).
    pub top_logprobs: Vec<Vec<(u32, f32)>>,
}

impl Sampled {
    /// The rows without a token and why.
    pub fn rows_without_token(&self) -> Vec<(usize, RowStatus)> {
        self.tokens
            .chunks(self.draws.max(1))
            .enumerate()
            .filter_map(|(row, slots)| RowStatus::of_token(slots[0]).map(|status| (row, status)))
            .collect()
    }
}

impl CpuSampler {
    pub fn new() -> Self {
        CpuSampler
    }

    /// A copy of `lm_head` for this backend ([`CpuLmHead::new`] takes one without copying).
    pub fn upload_lm_head(&self, lm_head: &Matrix) -> Result<CpuLmHead> {
        CpuLmHead::new(lm_head.clone())
    }

    /// `samples` draws for each row of `hidden`: `tokens[b · samples + j]`.
    pub fn sample(
        &self,
        lm_head: &CpuLmHead,
        hidden: &Matrix,
        params: &[SamplingParams],
        samples: u32,
    ) -> Result<Vec<u32>> {
        self.sample_draws(lm_head, hidden, params, Draws::first(samples))
    }

    /// The draws `draws` of each row: `tokens[b · draws.count + (j − draws.first)]`.
    pub fn sample_draws(
        &self,
        lm_head: &CpuLmHead,
        hidden: &Matrix,
        params: &[SamplingParams],
        draws: Draws,
    ) -> Result<Vec<u32>> {
        let draws = draws.check()?;
        let rows = check_request(lm_head.shape, hidden.shape(), params, draws.count)?;
        check_hidden_values(hidden)?;
        let logits: Vec<Vec<f32>> = (0..hidden.rows()).map(|b| logits_row(&lm_head.matrix, hidden, b)).collect();
        let n = draws.count as usize;
        let tokens = (0..rows.len() * n)
            .into_par_iter()
            .map(|k| draw(&logits[k / n], &rows[k / n], draws.first + (k % n) as u32).index)
            .collect();
        tokens_or_row_status(tokens, n)
    }

    /// The draws `draws` of each row of `hidden` with the row's [`Processing`]
    /// (`processing[b]` for row `b`) and log-probabilities. Rows without a token hold their
    /// status sentinels (see [`Sampled::rows_without_token`]); this returns them rather than an
    /// error so that the other rows' log-probabilities are kept.
    pub fn sample_processed(
        &self,
        lm_head: &CpuLmHead,
        hidden: &Matrix,
        params: &[SamplingParams],
        processing: &[Processing],
        draws: Draws,
    ) -> Result<Sampled> {
        self.sample_sharded(std::slice::from_ref(lm_head), hidden, params, processing, draws)
    }

    /// As [`CpuSampler::sample_processed`] over an LM head split by vocabulary into `shards`
    /// (shard `s` holds the rows after those of shards `0 .. s`): each shard is processed and
    /// raced on its own with its tokens' global indices and noise, the truncations are decided
    /// from the shards' summaries, and the per-shard winners and log-sum-exp terms merge into
    /// the unsharded tokens (identical) and log-probabilities (equal up to the order of the
    /// log-sum-exp sums).
    pub fn sample_sharded(
        &self,
        shards: &[CpuLmHead],
        hidden: &Matrix,
        params: &[SamplingParams],
        processing: &[Processing],
        draws: Draws,
    ) -> Result<Sampled> {
        let (head, offsets, draws, rows) = check_sharded_request(
            shards.iter().map(|shard| shard.shape),
            hidden.shape(),
            params,
            processing.len(),
            draws,
        )?;
        let offsets: Vec<u32> = offsets.into_iter().map(|o| o as u32).collect();
        let vocab = head.vocab;
        for (b, p) in processing.iter().enumerate() {
            p.check(b, vocab)?;
        }
        check_hidden_values(hidden)?;
        let raw: Vec<Vec<Vec<f32>>> = (0..rows.len())
            .map(|b| shards.iter().map(|shard| logits_row(&shard.matrix, hidden, b)).collect())
            .collect();
        let processed: Vec<Vec<ProcessedRow>> = (0..rows.len())
            .map(|b| {
                let slices: Vec<&[f32]> = raw[b].iter().map(Vec::as_slice).collect();
                process_sharded_row(&slices, &offsets, &rows[b], &processing[b])
            })
            .collect();
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
        let n = draws.count as usize;
        let slots: Vec<(u32, f32, f32)> = (0..rows.len() * n)
            .into_par_iter()
            .map(|k| {
                let (b, j) = (k / n, draws.first + (k % n) as u32);
                let winner = processed[b]
                    .iter()
                    .map(|part| draw_range(&part.logits, part.offset, &rows[b], j))
                    .fold(Candidate::NONE, Candidate::merge);
                let token = winner.index;
                let logits = processed[b].iter().zip(&raw[b]).find_map(|(part, raw)| {
                    let i = token.checked_sub(part.offset)? as usize;
                    Some((*raw.get(i)?, part.logits[i]))
                });
                let (raw, kept, row) = (&merged[b].0, &merged[b].1, &rows[b]);
                let (raw_lp, processed_lp) =
                    token_log_probabilities(token, logits, raw, kept, row.greedy != 0, row.temperature);
                (token, raw_lp, processed_lp)
            })
            .collect();
        let top_logprobs = (0..rows.len())
            .map(|b| {
                let slices: Vec<&[f32]> = raw[b].iter().map(Vec::as_slice).collect();
                top_raw_log_probabilities(&slices, &offsets, &merged[b].0, processing[b].top_logprobs)
            })
            .collect();
        Ok(Sampled {
            draws: n,
            tokens: slots.iter().map(|s| s.0).collect(),
            logprobs: slots.iter().map(|s| s.1).collect(),
            processed_logprobs: slots.iter().map(|s| s.2).collect(),
            top_logprobs,
        })
    }
}
