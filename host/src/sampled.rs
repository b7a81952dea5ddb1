//! What a call returns on the host: the tokens, their log-probabilities when a row asked for
//! them, why a row has no token, and what a verification decided.

use flashsample_core::speculative::accepted_drafts;
use flashsample_core::{NO_TOKEN, NON_FINITE_TOKEN};

use crate::batch::Batch;

/// `[B, N]` drawn tokens, row-major, with their log-probabilities when a row of the batch
/// asked for them ([`crate::Processing::reports_logprobs`]).
#[derive(Clone, Debug, PartialEq)]
pub struct Sampled {
    /// N, the draws per row.
    pub draws: usize,
    /// Drawn tokens, `tokens[b · draws + j]`; every slot of a row without a token holds its
    /// status's sentinel ([`RowStatus::of_token`]).
    pub tokens: Vec<u32>,
    /// Each token's log-probability under the raw logits (`log_softmax(H·Wᵀ)`, before any
    /// processing and temperature); NaN or −∞ in a row without a token. Empty when no row
    /// asked for log-probabilities.
    pub logprobs: Vec<f32>,
    /// Each token's log-probability under the distribution it was drawn from (processed,
    /// over temperature, truncated); 0 for a greedy row. Empty as `logprobs`.
    pub processed_logprobs: Vec<f32>,
    /// Per row, its `top_logprobs` most likely tokens under the raw logits with their raw
    /// log-probabilities, by decreasing logit, then increasing index (empty where not asked).
    pub top_logprobs: Vec<Vec<(u32, f32)>>,
    /// Per verified sequence of a batch from [`Batch::verify`], what the verification decided;
    /// empty for sampling.
    pub verdicts: Vec<Verdict>,
}

/// What a verification decided for one sequence: its tokens are those of rows `first_row ..=
/// first_row + accepted` ([`Sampled::emitted`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Verdict {
    /// The row of the sequence's first drafted position.
    pub first_row: usize,
    /// How many of its drafts equal the target's tokens at their positions, from the first.
    pub accepted: u32,
}

impl Sampled {
    /// Tokens without log-probabilities, `draws` per row.
    pub(crate) fn tokens_only(tokens: Vec<u32>, draws: usize) -> Sampled {
        let rows = tokens.len().checked_div(draws).unwrap_or(0);
        Sampled {
            draws,
            tokens,
            logprobs: Vec::new(),
            processed_logprobs: Vec::new(),
            top_logprobs: vec![Vec::new(); rows],
            verdicts: Vec::new(),
        }
    }

    /// The verdicts of `batch`'s verified sequences over these tokens (one draw per row), by
    /// `flashsample_core::speculative`'s rule.
    pub(crate) fn judge(&mut self, batch: &Batch) {
        self.verdicts = batch
            .verified
            .iter()
            .map(|sequence| {
                let positions = &self.tokens[sequence.first_row..=sequence.first_row + sequence.drafts.len()];
                Verdict { first_row: sequence.first_row, accepted: accepted_drafts(&sequence.drafts, positions) }
            })
            .collect();
    }

    /// The tokens verified sequence `sequence` emits: its accepted drafts, then the target's
    /// token at the next position (the tokens plain decoding draws there).
    pub fn emitted(&self, sequence: usize) -> &[u32] {
        let verdict = self.verdicts[sequence];
        &self.tokens[verdict.first_row..=verdict.first_row + verdict.accepted as usize]
    }

    /// B, the rows.
    pub fn rows(&self) -> usize {
        self.tokens.len().checked_div(self.draws).unwrap_or(0)
    }

    /// Row `row`'s tokens.
    pub fn row(&self, row: usize) -> &[u32] {
        &self.tokens[row * self.draws..(row + 1) * self.draws]
    }

    /// The rows without a token and why.
    pub fn rows_without_token(&self) -> Vec<(usize, RowStatus)> {
        self.tokens
            .chunks(self.draws.max(1))
            .enumerate()
            .filter_map(|(row, slots)| RowStatus::of_token(slots[0]).map(|status| (row, status)))
            .collect()
    }
}

/// Why a row has no token. Every draw of the row gets it, and its slots in the tokens hold the
/// sentinel [`RowStatus::token`] (in device memory that is the status the device reports).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RowStatus {
    /// Every logit of the row is −∞: no token is allowed. Slot: [`NO_TOKEN`].
    NoAllowedToken,
    /// A logit of the row is NaN or +∞, or a score overflowed `f32` (a logit within `23·T` of
    /// `f32::MAX`): the distribution is undefined. Slot: [`NON_FINITE_TOKEN`].
    NonFiniteLogits,
}

impl RowStatus {
    /// The status a token slot holds: `None` for a drawn token.
    pub fn of_token(token: u32) -> Option<RowStatus> {
        match token {
            NO_TOKEN => Some(RowStatus::NoAllowedToken),
            NON_FINITE_TOKEN => Some(RowStatus::NonFiniteLogits),
            _ => None,
        }
    }

    /// The sentinel a slot of such a row holds.
    pub fn token(self) -> u32 {
        match self {
            RowStatus::NoAllowedToken => NO_TOKEN,
            RowStatus::NonFiniteLogits => NON_FINITE_TOKEN,
        }
    }

    /// The status in words.
    pub(crate) fn describe(self) -> &'static str {
        match self {
            RowStatus::NoAllowedToken => "every logit is -inf",
            RowStatus::NonFiniteLogits => "a logit is NaN or +inf",
        }
    }
}
