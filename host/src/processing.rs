//! Per-row logit processing (soft-cap, bias, mask, penalties, min-p, top-k, top-p) and
//! log-probabilities: the parameters and their checks.
//!
//! The order is `flashsample_core::process`'s: soft-cap → logit bias → token mask → penalties
//! → temperature → min-p → top-k → top-p → draw. Each row draws from
//! `softmax(l / T)` over the tokens its truncations keep, `l` the processed logits, by the
//! same Gumbel-max race and noise keys as plain sampling (dropped tokens race with −∞).
//! Greedy rows (`T = 0`) take the argmax of the processed logits; no truncation can remove it.

use std::collections::BTreeMap;

use flashsample_core::process::{MAX_TOP_LOGPROBS, Penalties, SparseEntry};

use crate::error::{Result, invalid};

/// How one row's logits are processed before its draw, and which log-probabilities it
/// reports. `Processing::default()` changes nothing: plain sampling.
///
/// ```
/// use flashsample::Processing;
/// // vLLM's `top_k = 50, top_p = 0.9` with the drawn tokens' log-probabilities.
/// let row = Processing { top_k: Some(50), top_p: 0.9, logprobs: true, ..Processing::default() };
/// assert!(row.truncates());
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct Processing {
    /// Gemma 2's `cap · tanh(logit / cap)`, `cap > 0` and finite; first of all steps.
    pub softcap: Option<f32>,
    /// Sparse logit bias: `(token, value)`, added after the soft-cap; a value of −∞ bans the
    /// token. A token listed more than once gets the sum of its values (summed in list order
    /// first).
    pub bias: Vec<(u32, f32)>,
    /// Allowed tokens, `⌈V/32⌉` words: bit `j` of word `w` allows token `32w + j` (xgrammar's
    /// layout); bits past `V` are ignored. A disallowed token's logit is −∞.
    pub mask: Option<Vec<u32>>,
    /// The row's token history (prompt and output so far) that the penalties count.
    pub history: Vec<u32>,
    /// vLLM's repetition, frequency and presence penalties on the tokens of `history`.
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
    /// Whether to report each drawn token's raw and processed log-probability
    /// ([`crate::Sampled::logprobs`]).
    pub logprobs: bool,
    /// How many of the row's most likely tokens under the raw logits to return with their raw
    /// log-probabilities ([`crate::Sampled::top_logprobs`]), at most 20; 0 is none. Any
    /// number above 0 also reports the drawn tokens' log-probabilities.
    pub top_logprobs: u32,
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
            logprobs: false,
            top_logprobs: 0,
        }
    }
}

impl Processing {
    /// Checks the parameters of row `row` against a vocabulary of `vocab` tokens (every call
    /// checks them; this checks them ahead); errors name `processing[row].<field>`.
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
        if self.top_logprobs > MAX_TOP_LOGPROBS {
            return Err(invalid(
                field("top_logprobs"),
                format!("{}: must be at most {MAX_TOP_LOGPROBS}", self.top_logprobs),
            ));
        }
        Ok(())
    }

    /// The row's sparse list, one entry per token the bias or the penalties touch, by
    /// increasing token: what every backend applies after the soft-cap and the mask.
    pub(crate) fn sparse_entries(&self) -> Vec<SparseEntry> {
        let mut entries: BTreeMap<u32, SparseEntry> = BTreeMap::new();
        let blank = |token: u32| SparseEntry { token, bias: 0.0, count: 0 };
        for &(token, value) in &self.bias {
            entries.entry(token).or_insert_with(|| blank(token)).bias += value;
        }
        if self.penalties != Penalties::NONE {
            for &token in &self.history {
                entries.entry(token).or_insert_with(|| blank(token)).count += 1;
            }
        }
        entries.into_values().collect()
    }

    /// Whether min-p, top-k or top-p may drop a token.
    pub fn truncates(&self) -> bool {
        self.min_p > 0.0 || self.orders()
    }

    /// Whether the row needs all its logits at once: it truncates or asks for its top raw
    /// log-probabilities (the fused tiles see a tile at a time).
    pub fn needs_whole_row(&self) -> bool {
        self.truncates() || self.top_logprobs > 0
    }

    /// Whether the row reports log-probabilities: its drawn tokens' or its top raw ones.
    pub fn reports_logprobs(&self) -> bool {
        self.logprobs || self.top_logprobs > 0
    }

    /// Whether the row orders its logits: top-k or top-p.
    pub(crate) fn orders(&self) -> bool {
        self.top_k.is_some() || self.top_p < 1.0
    }
}
