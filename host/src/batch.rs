//! A batch as the host describes it: each row's sampling parameters and processing, and for
//! speculative verification the drafts its rows check.

use std::borrow::Cow;

use flashsample_core::RowParams;

use crate::error::{Result, invalid};
use crate::params::{Draws, SamplingParams, row_params};
use crate::processing::Processing;

/// What to draw for each row of `H`: its [`SamplingParams`] and, unless every row is plain
/// sampling, its [`Processing`]; or, made by [`Batch::verify`], the positions of sequences
/// whose drafted tokens the call verifies.
///
/// ```
/// use flashsample::{Batch, Processing, SamplingParams};
/// let params: Vec<_> = (0..4).map(|r| SamplingParams::new(0.7, 42, r, 0)).collect();
/// let plain = Batch::new(params.clone());
/// let nucleus = Batch::with_processing(params, vec![Processing { top_p: 0.9, ..Processing::default() }; 4]);
/// assert!(plain.processing.is_empty() && nucleus.processing.len() == 4);
/// ```
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Batch {
    /// One per row of `H`.
    pub params: Vec<SamplingParams>,
    /// One per row of `H`, or empty: plain sampling for every row.
    pub processing: Vec<Processing>,
    /// The verified sequences of a batch from [`Batch::verify`], in row order; empty for
    /// sampling.
    pub(crate) verified: Vec<Verified>,
}

/// A sequence whose drafted tokens a verification checks ([`Batch::verify`]).
#[derive(Clone, Debug, PartialEq)]
pub struct Drafted {
    /// The sequence's parameters at its first drafted position: its temperature, seed and
    /// noise sequence, and the decode step plain decoding samples next.
    pub params: SamplingParams,
    /// Its processing there; `history` holds the tokens before the drafts.
    pub processing: Processing,
    /// The drafted tokens, in order; none is allowed (the call then samples the next token).
    pub drafts: Vec<u32>,
}

/// A verified sequence's place in a verification batch: its rows are `first_row ..=
/// first_row + drafts.len()`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Verified {
    pub first_row: usize,
    pub drafts: Vec<u32>,
    /// Whether its rows' penalties count the drafts in their history (then only the host can
    /// change the drafts, by building a new batch).
    pub drafts_in_history: bool,
}

impl Batch {
    /// Plain sampling of each row with its parameters.
    pub fn new(params: Vec<SamplingParams>) -> Batch {
        Batch { params, processing: Vec::new(), verified: Vec::new() }
    }

    /// Each row with its parameters and processing.
    pub fn with_processing(params: Vec<SamplingParams>, processing: Vec<Processing>) -> Batch {
        Batch { params, processing, verified: Vec::new() }
    }

    /// Speculative verification of each sequence's drafts: its `k + 1` positions (the `k`
    /// drafted tokens and the one after them) are consecutive rows of `H`, in order, sequence
    /// after sequence, and `H` holds the target model's hidden states there. Position `j`
    /// samples with the keys plain decoding uses there (step `params.step + j`), its penalties
    /// counting the history and the drafts before it. A sequence keeps its drafts while each
    /// equals the target's token at its position ([`crate::Verdict::accepted`]) and emits the
    /// target's tokens up to the first that differs, or all `k + 1`
    /// ([`crate::Sampled::emitted`]): exactly the tokens plain decoding with the same keys
    /// draws, whatever the drafter proposed. A call draws one token per position
    /// (`Draws::first(1)`, or the draw plain decoding uses). Errors name
    /// `sequences[s].drafts` when a position's step would pass `u32::MAX`.
    ///
    /// ```
    /// use flashsample::{Batch, Drafted, Processing, SamplingParams};
    /// let sequence = Drafted {
    ///     params: SamplingParams::new(0.8, 7, 0, 12),
    ///     processing: Processing::default(),
    ///     drafts: vec![464, 3290],
    /// };
    /// let batch = Batch::verify(vec![sequence])?;
    /// assert_eq!(batch.rows(), 3);
    /// assert_eq!(batch.params[2].step, 14);
    /// # Ok::<(), flashsample::Error>(())
    /// ```
    pub fn verify(sequences: Vec<Drafted>) -> Result<Batch> {
        let counts_history = |p: &Processing| p.penalties != flashsample_core::process::Penalties::NONE;
        let processed = sequences.iter().any(|s| s.processing != Processing::default());
        let mut batch = Batch::default();
        for (s, sequence) in sequences.into_iter().enumerate() {
            let positions = sequence.drafts.len() as u64 + 1;
            if u64::from(sequence.params.step) + positions - 1 > u64::from(u32::MAX) {
                return Err(invalid(
                    format!("sequences[{s}].drafts"),
                    format!(
                        "{} drafts from step {}: a position's step would pass 2^32 - 1",
                        sequence.drafts.len(),
                        sequence.params.step
                    ),
                ));
            }
            let first_row = batch.params.len();
            for j in 0..positions as usize {
                batch.params.push(SamplingParams { step: sequence.params.step + j as u32, ..sequence.params });
                if processed {
                    let mut processing = sequence.processing.clone();
                    if counts_history(&processing) {
                        processing.history.extend_from_slice(&sequence.drafts[..j]);
                    }
                    batch.processing.push(processing);
                }
            }
            let drafts_in_history = processed && counts_history(&sequence.processing);
            batch.verified.push(Verified { first_row, drafts: sequence.drafts, drafts_in_history });
        }
        Ok(batch)
    }

    /// Each verified sequence's first row (none for sampling): sequence `s` emits the tokens of
    /// rows `first_rows[s] ..= first_rows[s] + accepted[s]`.
    pub fn first_rows(&self) -> Vec<usize> {
        self.verified.iter().map(|sequence| sequence.first_row).collect()
    }

    /// B, the rows.
    pub fn rows(&self) -> usize {
        self.params.len()
    }

    /// Whether a row reports log-probabilities.
    pub fn reports_logprobs(&self) -> bool {
        self.processing.iter().any(Processing::reports_logprobs)
    }

    /// Checks every row for a vocabulary of `vocab` tokens (errors name `params[r]` or
    /// `processing[r]`) and returns the kernels' row parameters and each row's processing.
    pub(crate) fn check(&self, vocab: usize) -> Result<(Vec<RowParams>, Cow<'_, [Processing]>)> {
        let rows = row_params(&self.params)?;
        let processing = match self.processing.len() {
            0 => Cow::Owned(vec![Processing::default(); rows.len()]),
            n if n == rows.len() => Cow::Borrowed(self.processing.as_slice()),
            n => {
                return Err(invalid(
                    "processing",
                    format!("{n} entries for {} rows of parameters: one per row, or none", rows.len()),
                ));
            }
        };
        for (r, p) in processing.iter().enumerate() {
            p.check(r, vocab)?;
        }
        self.check_verified(vocab)?;
        Ok((rows, processing))
    }

    /// A verification batch's drafts are tokens and its sequences' rows are still its rows.
    fn check_verified(&self, vocab: usize) -> Result<()> {
        let mut next_row = 0;
        for (s, sequence) in self.verified.iter().enumerate() {
            if let Some(&token) = sequence.drafts.iter().find(|&&t| t as usize >= vocab) {
                return Err(invalid(format!("sequences[{s}].drafts"), format!("token {token}: must be < V = {vocab}")));
            }
            next_row = sequence.first_row + sequence.drafts.len() + 1;
        }
        if next_row > self.rows() {
            return Err(invalid(
                "params",
                format!("{} rows: the verified sequences need {next_row} (one per position)", self.rows()),
            ));
        }
        Ok(())
    }

    /// A verification draws one token per position: `draws` must be a single draw.
    pub(crate) fn check_draws(&self, draws: Draws) -> Result<()> {
        if !self.verified.is_empty() && draws.count != 1 {
            return Err(invalid(
                "draws",
                format!("{} draws: a verification draws one token per position", draws.count),
            ));
        }
        Ok(())
    }
}
