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
    /// Whether this changes anything: otherwise the plain path samples the row.
    pub fn is_plain(&self) -> bool {
        *self == Processing::default()
    }

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

/// A row after processing: the logits it races with (−∞ for every dropped token) and the
/// log-sum-exp terms of its log-probabilities. A row with a NaN or +∞ processed logit, or
/// with none above −∞, is left untruncated: its race ends in the row's status sentinel.
#[derive(Clone, Debug)]
pub struct ProcessedRow {
    /// The processed logits of kept tokens, −∞ elsewhere.
    pub logits: Vec<f32>,
    /// Over the raw logits at T = 1 (vLLM's default log-probabilities).
    pub raw: LogSumExp,
    /// Over the kept processed logits at the row's temperature (empty for a greedy row).
    pub kept: LogSumExp,
}

/// The logits after soft-cap, bias, mask and penalties (the steps before temperature).
pub fn processed_logits(raw: &[f32], processing: &Processing) -> Vec<f32> {
    let mut logits: Vec<f32> = match processing.softcap {
        Some(cap) => raw.iter().map(|&l| softcap(l, cap)).collect(),
        None => raw.to_vec(),
    };
    for &(token, value) in &processing.bias {
        logits[token as usize] += value;
    }
    if let Some(mask) = &processing.mask {
        for (i, l) in logits.iter_mut().enumerate() {
            if !mask_allows(mask, i as u32) {
                *l = f32::NEG_INFINITY;
            }
        }
    }
    if processing.penalties != Penalties::NONE {
        let mut counts: HashMap<u32, u32> = HashMap::new();
        processing.history.iter().for_each(|&t| *counts.entry(t).or_default() += 1);
        for (&token, &count) in &counts {
            let l = &mut logits[token as usize];
            *l = penalized(*l, count, &processing.penalties);
        }
    }
    logits
}

/// Runs the whole pipeline on one row's raw logits.
pub fn process_row(raw: &[f32], row: &RowParams, processing: &Processing) -> ProcessedRow {
    let mut raw_lse = LogSumExp::EMPTY;
    raw.iter().for_each(|&l| raw_lse.add(l, 1.0));
    let mut logits = processed_logits(raw, processing);
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if logits.iter().any(|&l| l.is_nan() || l == f32::INFINITY) || max == f32::NEG_INFINITY {
        return ProcessedRow { logits, raw: raw_lse, kept: LogSumExp::EMPTY };
    }
    let t = row.temperature;
    if row.greedy == 0 {
        truncate(&mut logits, max, t, processing);
    }
    let mut kept = LogSumExp::EMPTY;
    if row.greedy == 0 {
        logits.iter().for_each(|&l| kept.add(l, t));
    }
    ProcessedRow { logits, raw: raw_lse, kept }
}

/// min-p, then top-k, then top-p, each on what the previous kept.
fn truncate(logits: &mut [f32], max: f32, temperature: f32, processing: &Processing) {
    let cut = min_p_threshold(max, temperature, processing.min_p);
    logits.iter_mut().filter(|l| **l < cut).for_each(|l| *l = f32::NEG_INFINITY);
    let needs_order = processing.top_k.is_some() || processing.top_p < 1.0;
    if !needs_order {
        return;
    }
    // Kept tokens by decreasing logit, then increasing index.
    let mut order: Vec<u32> = (0..logits.len() as u32).filter(|&i| logits[i as usize] > f32::NEG_INFINITY).collect();
    order.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]).then(a.cmp(&b)));
    if let Some(k) = processing.top_k
        && (k as usize) < order.len()
    {
        let kth = logits[order[k as usize - 1] as usize];
        let keep = order.partition_point(|&i| logits[i as usize] >= kth);
        order[keep..].iter().for_each(|&i| logits[i as usize] = f32::NEG_INFINITY);
        order.truncate(keep);
    }
    if processing.top_p < 1.0 {
        let weights: Vec<f64> = order.iter().map(|&i| exp((logits[i as usize] - max) / temperature) as f64).collect();
        let target = processing.top_p as f64 * weights.iter().sum::<f64>();
        let mut mass = 0.0;
        let keep = weights
            .iter()
            .position(|&w| {
                mass += w;
                mass >= target
            })
            .map_or(order.len(), |last| last + 1);
        order[keep..].iter().for_each(|&i| logits[i as usize] = f32::NEG_INFINITY);
    }
}

/// A drawn token with its raw log-probability and its log-probability under the
/// distribution it was drawn from (0 for a greedy row's argmax). A slot holding a row's
/// status sentinel gets NaN for non-finite logits and −∞ where nothing is allowed.
pub fn log_probabilities(row: &ProcessedRow, params: &RowParams, token: u32, raw: &[f32]) -> (f32, f32) {
    match RowStatus::of_token(token) {
        Some(RowStatus::NonFiniteLogits) => (f32::NAN, f32::NAN),
        Some(RowStatus::NoAllowedToken) => (f32::NEG_INFINITY, f32::NEG_INFINITY),
        None => {
            let i = token as usize;
            let raw_lp = row.raw.log_probability(raw[i], 1.0);
            let processed_lp =
                if params.greedy != 0 { 0.0 } else { row.kept.log_probability(row.logits[i], params.temperature) };
            (raw_lp, processed_lp)
        }
    }
}
