//! A batch as the host describes it: each row's sampling parameters and processing.

use std::borrow::Cow;

use flashsample_core::RowParams;

use crate::error::{Result, invalid};
use crate::params::{SamplingParams, row_params};
use crate::processing::Processing;

/// What to draw for each row of `H`: its [`SamplingParams`] and, unless every row is plain
/// sampling, its [`Processing`].
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
}

impl Batch {
    /// Plain sampling of each row with its parameters.
    pub fn new(params: Vec<SamplingParams>) -> Batch {
        Batch { params, processing: Vec::new() }
    }

    /// Each row with its parameters and processing.
    pub fn with_processing(params: Vec<SamplingParams>, processing: Vec<Processing>) -> Batch {
        Batch { params, processing }
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
        Ok((rows, processing))
    }
}
