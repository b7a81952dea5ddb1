//! Per-row logit processing (soft-cap, bias, mask, penalties, min-p, top-k, top-p) and
//! log-probabilities: the parameters, their checks, and the reference pipeline the CPU backend
//! runs.
//!
//! The order is `flashsample_core::process`'s: soft-cap → logit bias → token mask → penalties
//! → temperature → min-p → top-k → top-p → draw. Each row draws from
//! `softmax(l / T)` over the tokens its truncations keep, `l` the processed logits, by the
//! same Gumbel-max race and noise keys as plain sampling (dropped tokens race with −∞).
//! Greedy rows (`T = 0`) take the argmax of the processed logits; no truncation can remove it.

use std::collections::HashMap;

use flashsample_core::RowParams;
use flashsample_core::process::{LogSumExp, Penalties, exp, mask_allows, min_p_threshold, penalized, softcap};

use crate::error::{Result, RowStatus, invalid};

/// How one row's logits are processed before its draw. `Processing::default()` changes
/// nothing: plain sampling.
#[derive(Clone, Debug, PartialEq)]
pub struct Processing {
    /// Gemma 2's `cap · tanh(logit / cap)`, `cap > 0` and finite; first of all steps.
    pub softcap: Option<f32>,
    /// Sparse logit bias: `(token, value)`, added after the soft-cap; a value of −∞ bans the
    /// token. A token listed twice gets both values.
    pub bias: Vec<(u32, f32)>,
    /// Allowed tokens, `⌈V/32⌉` words: bit `j` of word `w` allows token `32w + j` (xgrammar's
    /// layout); bits past `V` are ignored. A disallowed token's logit is −∞.
    pub mask: Option<Vec<u32>>,
    /// The row's token history (prompt and output so far) that the penalties count.
    pub history: Vec<u32>,
    pub penalties: Penalties,
    /// Keep tokens whose probability after temperature is at least `min_p` times the largest;
    /// `0 ≤ min_p ≤ 1`, 0 is off.
    pub min_p: f32,
    /// Keep tokens whose processed logit is at least the k-th largest (ties at the k-th value
    /// kept); `1 ≤ k ≤ V`, `None` is off.
    pub top_k: Option<u32>,
    /// Keep the smallest set of most likely tokens whose mass reaches `top_p` (after top-k);
    /// `0 < top_p ≤ 1`, 1 is off.
    pub top_p: f32,
}

impl Default for Processing {
    fn default() -> Processing {
        Processing {
            softcap: None,
            bias: Vec::new(),
            mask: None,
            history: Vec::new(),
            penalties: Penalties::NONE,
            min_p: 0.0,
            top_k: None,
            top_p: 1.0,
        }
    }
}

impl Processing {
    /// Checks the parameters of row `row` against a vocabulary of `vocab` tokens; errors name
    /// `processing[row].<field>`.
    pub fn check(&self, row: usize, vocab: usize) -> Result<()> {
        let field = |name: &str| format!("processing[{row}].{name}");
        if let Some(cap) = self.softcap
            && !(cap.is_finite() && cap > 0.0)
        {
            return Err(invalid(field("softcap"), format!("{cap}: must be finite and > 0")));
        }
        for &(token, value) in &self.bias {
            if token as usize >= vocab {
                return Err(invalid(field("bias"), format!("token {token}: must be < V = {vocab}")));
            }
            if value.is_nan() || value == f32::INFINITY {
                return Err(invalid(field("bias"), format!("token {token}: {value}: must be finite or -inf")));
            }
        }
        if let Some(mask) = &self.mask
            && mask.len() != vocab.div_ceil(32)
        {
            return Err(invalid(
                field("mask"),
                format!("{} words: must be ceil(V / 32) = {} for V = {vocab}", mask.len(), vocab.div_ceil(32)),
            ));
        }
        if let Some(&token) = self.history.iter().find(|&&t| t as usize >= vocab) {
            return Err(invalid(field("history"), format!("token {token}: must be < V = {vocab}")));
        }
        let p = self.penalties;
        if !(p.repetition.is_finite() && p.repetition > 0.0) {
            return Err(invalid(field("repetition_penalty"), format!("{}: must be finite and > 0", p.repetition)));
        }
        for (name, value) in [("frequency_penalty", p.frequency), ("presence_penalty", p.presence)] {
            if !value.is_finite() {
                return Err(invalid(field(name), format!("{value}: must be finite")));
            }
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(invalid(field("min_p"), format!("{}: must be in [0, 1]", self.min_p)));
        }
        if let Some(k) = self.top_k
            && (k == 0 || k as usize > vocab)
        {
            return Err(invalid(field("top_k"), format!("{k}: must be in [1, V = {vocab}]")));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(invalid(field("top_p"), format!("{}: must be in (0, 1]", self.top_p)));
        }
        Ok(())
    }
}

/// One row's part of a vocabulary shard after processing: the logits it races with (−∞ for
/// every dropped token, indices `offset ..`) and the log-sum-exp terms of its
/// log-probabilities. The unsharded row is the shard at offset 0.
#[derive(Clone, Debug)]
pub struct ProcessedRow {
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
pub fn processed_logits(raw: &[f32], offset: u32, processing: &Processing) -> Vec<f32> {
    let mut logits: Vec<f32> = match processing.softcap {
        Some(cap) => raw.iter().map(|&l| softcap(l, cap)).collect(),
        None => raw.to_vec(),
    };
    let local = |token: u32| token.checked_sub(offset).map(|i| i as usize).filter(|&i| i < raw.len());
    for &(token, value) in &processing.bias {
        if let Some(i) = local(token) {
            logits[i] += value;
        }
    }
    if let Some(mask) = &processing.mask {
        for (i, l) in logits.iter_mut().enumerate() {
            if !mask_allows(mask, offset + i as u32) {
                *l = f32::NEG_INFINITY;
            }
        }
    }
    if processing.penalties != Penalties::NONE {
        let mut counts: HashMap<u32, u32> = HashMap::new();
        processing.history.iter().for_each(|&t| *counts.entry(t).or_default() += 1);
        for (&token, &count) in &counts {
            if let Some(i) = local(token) {
                logits[i] = penalized(logits[i], count, &processing.penalties);
            }
        }
    }
    logits
}

/// What one shard tells the others before the truncations can be decided: its largest
/// processed logit, whether it holds a NaN or +∞, and (for top-k or top-p) its kept entries
/// by decreasing logit, then increasing index (under top-k only its own top k, with ties).
#[derive(Clone, Debug)]
pub struct ShardSummary {
    pub max: f32,
    pub non_finite: bool,
    pub ordered: Vec<(f32, u32)>,
}

/// The rule every shard applies once the summaries are merged: keep an entry `(l, i)` when
/// `l ≥ min_cut` and `(l, −i) ≥ (order_cut.0, −order_cut.1)` (top-k cuts at a value, keeping
/// ties; top-p may cut inside a tie, by index).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KeepRule {
    pub min_cut: f32,
    pub order_cut: (f32, u32),
}

impl KeepRule {
    /// Keeps every entry.
    pub const ALL: KeepRule = KeepRule { min_cut: f32::NEG_INFINITY, order_cut: (f32::NEG_INFINITY, u32::MAX) };

    fn keeps(&self, logit: f32, index: u32) -> bool {
        logit >= self.min_cut && (logit > self.order_cut.0 || (logit == self.order_cut.0 && index <= self.order_cut.1))
    }
}

fn orders(processing: &Processing) -> bool {
    processing.top_k.is_some() || processing.top_p < 1.0
}

/// Sorts entries by decreasing logit, then increasing index: the order top-k and top-p read.
fn rank(entries: &mut [(f32, u32)]) {
    entries.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
}

/// Keeps the first `k` of ranked entries and every entry tied with the k-th.
fn truncate_to_top_k(ranked: &mut Vec<(f32, u32)>, k: u32) {
    if let Some(&(kth, _)) = ranked.get(k as usize - 1) {
        let keep = ranked.partition_point(|e| e.0 >= kth);
        ranked.truncate(keep);
    }
}

/// A shard's summary of its processed logits (indices `offset ..`).
pub fn summarize(logits: &[f32], offset: u32, processing: &Processing) -> ShardSummary {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let non_finite = logits.iter().any(|&l| l.is_nan() || l == f32::INFINITY);
    let mut ordered = Vec::new();
    if orders(processing) && !non_finite {
        ordered = (0..logits.len())
            .filter(|&i| logits[i] > f32::NEG_INFINITY)
            .map(|i| (logits[i], offset + i as u32))
            .collect();
        rank(&mut ordered);
        // The row's top k after min-p are among the shards' own top k (top-p acts after top-k).
        if let Some(k) = processing.top_k {
            truncate_to_top_k(&mut ordered, k);
        }
    }
    ShardSummary { max, non_finite, ordered }
}

/// min-p, then top-k, then top-p over the merged summaries of every shard of a row, as one
/// [`KeepRule`]. A greedy row, a row with a NaN or +∞ logit and a row with nothing allowed
/// keep everything: their race ends in the argmax or the row's status.
pub fn keep_rule(summaries: &[ShardSummary], row: &RowParams, processing: &Processing) -> KeepRule {
    let max = summaries.iter().map(|s| s.max).fold(f32::NEG_INFINITY, f32::max);
    if row.greedy != 0 || summaries.iter().any(|s| s.non_finite) || max == f32::NEG_INFINITY {
        return KeepRule::ALL;
    }
    let t = row.temperature;
    let min_cut = min_p_threshold(max, t, processing.min_p);
    if !orders(processing) {
        return KeepRule { min_cut, ..KeepRule::ALL };
    }
    let mut order: Vec<(f32, u32)> =
        summaries.iter().flat_map(|s| s.ordered.iter().copied()).filter(|e| e.0 >= min_cut).collect();
    rank(&mut order);
    if let Some(k) = processing.top_k {
        truncate_to_top_k(&mut order, k);
    }
    let mut order_cut = match order.last() {
        Some(&(last, _)) if processing.top_k.is_some() => (last, u32::MAX),
        _ => KeepRule::ALL.order_cut,
    };
    if processing.top_p < 1.0 {
        let weights: Vec<f64> = order.iter().map(|e| exp((e.0 - max) / t) as f64).collect();
        let target = processing.top_p as f64 * weights.iter().sum::<f64>();
        let mut mass = 0.0;
        if let Some(last) = weights.iter().position(|&w| {
            mass += w;
            mass >= target
        }) {
            order_cut = order[last];
        }
    }
    KeepRule { min_cut, order_cut }
}

/// Drops (sets to −∞) every entry of a shard the rule does not keep.
pub fn apply_keep_rule(logits: &mut [f32], offset: u32, rule: &KeepRule) {
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
pub fn process_sharded_row(
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

/// A drawn token's raw log-probability and its log-probability under the distribution it was
/// drawn from (0 for a greedy row's argmax), from the row's merged log-sum-exp terms and the
/// token's raw and processed logits. A slot holding a row's status sentinel gets NaN for
/// non-finite logits and −∞ where nothing is allowed.
pub fn log_probabilities(
    token: u32,
    logits: Option<(f32, f32)>,
    raw: &LogSumExp,
    kept: &LogSumExp,
    params: &RowParams,
) -> (f32, f32) {
    match (RowStatus::of_token(token), logits) {
        (Some(RowStatus::NonFiniteLogits), _) => (f32::NAN, f32::NAN),
        (Some(RowStatus::NoAllowedToken), _) | (None, None) => (f32::NEG_INFINITY, f32::NEG_INFINITY),
        (None, Some((raw_logit, processed_logit))) => {
            let raw_lp = raw.log_probability(raw_logit, 1.0);
            let processed_lp =
                if params.greedy != 0 { 0.0 } else { kept.log_probability(processed_logit, params.temperature) };
            (raw_lp, processed_lp)
        }
    }
}
