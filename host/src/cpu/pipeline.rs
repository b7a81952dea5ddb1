//! The CPU backend's row pipeline: a row's logits processed in the documented order over
//! vocabulary shards (per-shard steps, the shards' summaries merged into one keep rule,
//! per-shard log-sum-exp terms); the unsharded row is the one-shard case.

use flashsample_core::RowParams;
use flashsample_core::process::{KeepRule, LogSumExp, dense_step, mask_allows, order_key, sparse_step};
use flashsample_core::truncation::{rank, select, top_k_kept};

use crate::processing::Processing;

/// One row's part of a vocabulary shard after processing: the logits it races with (−∞ for
/// every dropped token, indices `offset ..`) and the log-sum-exp terms of its
/// log-probabilities. The unsharded row is the shard at offset 0.
#[derive(Clone, Debug)]
pub(crate) struct ProcessedRow {
    /// Global index of `logits[0]`.
    pub offset: u32,
    /// The processed logits of kept tokens, −∞ elsewhere.
    pub logits: Vec<f32>,
    /// Over the raw logits at T = 1 (vLLM's default log-probabilities).
    pub raw: LogSumExp,
    /// Over the kept processed logits at the row's temperature (empty for a greedy row).
    pub kept: LogSumExp,
}

/// The logits after soft-cap, bias, mask and penalties (the steps before temperature) of the
/// vocabulary entries `offset .. offset + raw.len()`.
fn processed_logits(raw: &[f32], offset: u32, processing: &Processing) -> Vec<f32> {
    let cap = processing.softcap.unwrap_or(0.0);
    let allowed = |index: u32| processing.mask.as_ref().is_none_or(|mask| mask_allows(mask, index));
    let mut logits: Vec<f32> = raw.iter().zip(offset..).map(|(&l, index)| dense_step(l, cap, allowed(index))).collect();
    for entry in processing.sparse_entries() {
        if let Some(i) = entry.token.checked_sub(offset).map(|i| i as usize).filter(|&i| i < raw.len()) {
            logits[i] = sparse_step(logits[i], &entry, &processing.penalties);
        }
    }
    logits
}

/// What one shard tells the others before the truncations can be decided: its largest
/// processed logit, whether it holds a NaN or +∞, and (for top-k or top-p) its kept entries
/// by decreasing logit, then increasing index (under top-k only its own top k, with ties).
#[derive(Clone, Debug)]
struct ShardSummary {
    max: f32,
    non_finite: bool,
    ordered: Vec<(f32, u32)>,
}

/// A shard's summary of its processed logits (indices `offset ..`).
fn summarize(logits: &[f32], offset: u32, processing: &Processing) -> ShardSummary {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let non_finite = logits.iter().any(|&l| l.is_nan() || l == f32::INFINITY);
    let mut ordered = Vec::new();
    if processing.orders() && !non_finite {
        ordered = (0..logits.len())
            .filter(|&i| logits[i] > f32::NEG_INFINITY)
            .map(|i| (logits[i], offset + i as u32))
            .collect();
        rank(&mut ordered);
        // The row's top k after min-p are among the shards' own top k (top-p acts after top-k).
        if let Some(k) = processing.top_k {
            ordered.truncate(top_k_kept(&ordered, k));
        }
    }
    ShardSummary { max, non_finite, ordered }
}

/// min-p, then top-k, then top-p over the merged summaries of every shard of a row
/// (`flashsample_core::truncation::select`). A greedy row, a row with a NaN or +∞ logit and a
/// row with nothing allowed keep everything: their race ends in the argmax or the row's status.
fn keep_rule(summaries: &[ShardSummary], row: &RowParams, processing: &Processing) -> KeepRule {
    let max = summaries.iter().map(|s| s.max).fold(f32::NEG_INFINITY, f32::max);
    if row.greedy != 0 || summaries.iter().any(|s| s.non_finite) || max == f32::NEG_INFINITY {
        return KeepRule::ALL;
    }
    let mut entries: Vec<(f32, u32)> = summaries.iter().flat_map(|s| s.ordered.iter().copied()).collect();
    select(&mut entries, max, row.temperature, processing.min_p, processing.top_k, processing.top_p).rule
}

/// Drops (sets to −∞) every entry of a shard the rule does not keep.
fn apply_keep_rule(logits: &mut [f32], offset: u32, rule: &KeepRule) {
    for (i, l) in logits.iter_mut().enumerate() {
        if !rule.keeps(*l, offset + i as u32) {
            *l = f32::NEG_INFINITY;
        }
    }
}

/// The whole pipeline on a row split into vocabulary shards (`shards[s]` the raw logits of
/// entries `offsets[s] ..`): processed per shard, the truncations decided from the merged
/// summaries, each shard's kept logits and log-sum-exp terms. One shard at offset 0 is the
/// unsharded row.
pub(crate) fn process_sharded_row(
    shards: &[&[f32]],
    offsets: &[u32],
    row: &RowParams,
    processing: &Processing,
) -> Vec<ProcessedRow> {
    let mut logits: Vec<Vec<f32>> =
        shards.iter().zip(offsets).map(|(raw, &offset)| processed_logits(raw, offset, processing)).collect();
    let summaries: Vec<ShardSummary> =
        logits.iter().zip(offsets).map(|(l, &offset)| summarize(l, offset, processing)).collect();
    let rule = keep_rule(&summaries, row, processing);
    shards
        .iter()
        .zip(offsets)
        .zip(logits.iter_mut())
        .map(|((raw, &offset), logits)| {
            apply_keep_rule(logits, offset, &rule);
            let mut raw_lse = LogSumExp::EMPTY;
            raw.iter().for_each(|&l| raw_lse.add(l, 1.0));
            let mut kept = LogSumExp::EMPTY;
            if row.greedy == 0 {
                logits.iter().for_each(|&l| kept.add(l, row.temperature));
            }
            ProcessedRow { offset, logits: std::mem::take(logits), raw: raw_lse, kept }
        })
        .collect()
}

/// A row's `n` most likely tokens under its raw logits (`shards[s]` the entries from
/// `offsets[s]`), by decreasing logit (`order_key`), then increasing index, with their raw
/// log-probabilities from the row's merged terms `raw`.
pub(crate) fn top_raw_log_probabilities(
    shards: &[&[f32]],
    offsets: &[u32],
    raw: &LogSumExp,
    n: u32,
) -> Vec<(u32, f32)> {
    let mut entries: Vec<(u32, u32, f32)> = shards
        .iter()
        .zip(offsets)
        .flat_map(|(logits, &offset)| logits.iter().zip(offset..).map(|(&l, i)| (order_key(l), i, l)))
        .collect();
    let order = |a: &(u32, u32, f32), b: &(u32, u32, f32)| b.0.cmp(&a.0).then(a.1.cmp(&b.1));
    let n = (n as usize).min(entries.len());
    if n == 0 {
        return Vec::new();
    }
    entries.select_nth_unstable_by(n - 1, order);
    entries.truncate(n);
    entries.sort_by(order);
    entries.iter().map(|&(_, i, l)| (i, raw.log_probability(l, 1.0))).collect()
}
