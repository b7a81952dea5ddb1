//! Per-row sampling parameters and the checks every backend applies before any work.

use flashsample_core::RowParams;
use flashsample_core::noise::MAX_TEMPERATURE;

use crate::error::{Error, Result, invalid};
use crate::tensor::{DType, Matrix, MatrixShape};

/// How one batch row is sampled.
///
/// The noise of a draw is a pure function of `(seed, stream, step, draw index, vocabulary
/// index)` (see `flashsample_core::noise`), so a row's tokens do not depend on the batch it
/// is in, its position there, or the kernel's tiling.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SamplingParams {
    /// `0 ≤ T ≤ 10³⁶`; `T = 0` is greedy argmax (no noise, ties to the lowest index). Any
    /// `T > 0` samples `softmax(logits / T)`, ties broken by the noise however small `T` is.
    pub temperature: f32,
    pub seed: u64,
    /// Independent stream of the seed, e.g. a request id.
    pub stream: u32,
    /// Decode step or position; successive steps get fresh noise.
    pub step: u32,
}

impl SamplingParams {
    pub fn new(temperature: f32, seed: u64, stream: u32, step: u32) -> Self {
        SamplingParams { temperature, seed, stream, step }
    }

    fn to_row(self, index: usize) -> Result<RowParams> {
        let t = self.temperature;
        if !(0.0..=MAX_TEMPERATURE).contains(&t) {
            return Err(invalid(
                format!("params[{index}].temperature"),
                format!("T = {t:e}: must be 0 (greedy) or in (0, {MAX_TEMPERATURE:e}]"),
            ));
        }
        let greedy = t == 0.0;
        Ok(RowParams { seed: self.seed, stream: self.stream, step: self.step, temperature: t, greedy: greedy as u32 })
    }
}

/// Which draws of each row a call makes: `first .. first + count`. Draw `j` is keyed by its
/// index, so calls that together cover `0 .. N` give the tokens one call for `N` draws gives
/// (and a caller can write millions of draws in passes of bounded memory).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Draws {
    pub first: u32,
    pub count: u32,
}

impl Draws {
    /// Draws `0 .. count`.
    pub fn first(count: u32) -> Draws {
        Draws { first: 0, count }
    }

    /// Checks that the draws exist: at least one, every index below 2³².
    pub fn check(self) -> Result<Draws> {
        if self.count == 0 {
            return Err(invalid("samples", "0: at least one draw per row"));
        }
        if self.first.checked_add(self.count - 1).is_none() {
            return Err(invalid(
                "samples",
                format!("draws {} .. {} + {}: every draw index must be below 2^32", self.first, self.first, self.count),
            ));
        }
        Ok(self)
    }
}

/// The LM head's shape as the backends keep it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeadShape {
    pub vocab: usize,
    pub dim: usize,
    pub dtype: DType,
}

/// Largest vocabulary: indices are u32 with `u32::MAX` reserved, and Philox blocks are
/// `index / 4 < 2²⁹`.
pub const MAX_VOCAB: usize = (1 << 31) - 1;

/// Checks an LM head `W[V, D]`: non-empty, `V < 2³¹`, every element finite.
pub fn check_lm_head(lm_head: &Matrix) -> Result<HeadShape> {
    let (vocab, dim) = (lm_head.rows(), lm_head.cols());
    check_head_shape(vocab, dim)?;
    if let Some((r, c)) = lm_head.first_non_finite() {
        return Err(invalid(
            "lm_head",
            format!("element [{r}, {c}] = {}: every weight must be finite", lm_head.get(r, c)),
        ));
    }
    Ok(HeadShape { vocab, dim, dtype: lm_head.dtype() })
}

/// The shape rules of an LM head `W[V, D]`: `1 ≤ V < 2³¹`, `1 ≤ D < 2³²`.
/// The shape of an LM head split by vocabulary into shards of the given shapes (shard `s`
/// holds the rows after those of shards `0 .. s`) and each shard's first row: every shard has
/// shard 0's D and dtype, and the whole V is below 2³¹.
pub fn sharded_head(shards: impl IntoIterator<Item = HeadShape>) -> Result<(HeadShape, Vec<usize>)> {
    let mut shards = shards.into_iter();
    let first = shards.next().ok_or_else(|| invalid("shards", "none: at least one LM-head shard is needed"))?;
    let (mut offsets, mut vocab) = (vec![0], first.vocab);
    for (s, shard) in shards.enumerate().map(|(s, shard)| (s + 1, shard)) {
        if (shard.dim, shard.dtype) != (first.dim, first.dtype) {
            return Err(invalid(
                format!("shards[{s}]"),
                format!(
                    "D = {}, {}: every shard must match shard 0's D = {}, {}",
                    shard.dim, shard.dtype, first.dim, first.dtype
                ),
            ));
        }
        offsets.push(vocab);
        vocab += shard.vocab;
        if vocab > MAX_VOCAB {
            return Err(invalid("shards", format!("V = {vocab} in all: must be < 2^31")));
        }
    }
    Ok((HeadShape { vocab, ..first }, offsets))
}

pub fn check_head_shape(vocab: usize, dim: usize) -> Result<()> {
    if vocab == 0 {
        return Err(invalid("lm_head", "V = 0 rows: the vocabulary must not be empty"));
    }
    if dim == 0 {
        return Err(invalid("lm_head", "D = 0 columns: the hidden size must be at least 1"));
    }
    if vocab > MAX_VOCAB {
        return Err(invalid("lm_head", format!("V = {vocab}: must be < 2^31")));
    }
    if dim > u32::MAX as usize {
        return Err(invalid("lm_head", format!("D = {dim}: must be < 2^32")));
    }
    Ok(())
}

/// Checks that every hidden state is finite.
pub fn check_hidden_values(hidden: &Matrix) -> Result<()> {
    match hidden.first_non_finite() {
        Some((r, c)) => Err(invalid(
            "hidden",
            format!("element [{r}, {c}] = {}: every hidden state must be finite", hidden.get(r, c)),
        )),
        None => Ok(()),
    }
}

/// Checks one sampling request against the head and returns the kernels' row parameters.
pub fn check_request(
    head: HeadShape,
    hidden: MatrixShape,
    params: &[SamplingParams],
    samples: u32,
) -> Result<Vec<RowParams>> {
    check_request_shape(head, hidden, params.len(), "params", samples)?;
    row_params(params)
}

/// The rules of processed sampling over vocabulary shards, for every backend: the shards make
/// one head ([`sharded_head`]), the draws, the request's shapes and one processing entry per
/// row. Returns the whole head, each shard's offset, the checked draws and the rows'
/// parameters.
pub fn check_sharded_request(
    shards: impl IntoIterator<Item = HeadShape>,
    hidden: MatrixShape,
    params: &[SamplingParams],
    processing_rows: usize,
    draws: Draws,
) -> Result<(HeadShape, Vec<usize>, Draws, Vec<RowParams>)> {
    let (head, offsets) = sharded_head(shards)?;
    let draws = draws.check()?;
    let rows = check_request(head, hidden, params, draws.count)?;
    check_processing_rows(processing_rows, rows.len())?;
    Ok((head, offsets, draws, rows))
}

/// A processed request's rule that its processing has one entry per row (`rows` of them).
pub fn check_processing_rows(processing: usize, rows: usize) -> Result<()> {
    if processing != rows {
        return Err(invalid("processing", format!("{processing} entries for B = {rows} hidden rows: one per row")));
    }
    Ok(())
}

/// The shape rules of a request whose `rows` per-row parameters come from `rows_argument`.
pub fn check_request_shape(
    head: HeadShape,
    hidden: MatrixShape,
    rows: usize,
    rows_argument: &str,
    samples: u32,
) -> Result<()> {
    if hidden.rows == 0 {
        return Err(invalid("hidden", "B = 0 rows: at least one row is needed"));
    }
    if hidden.rows > u32::MAX as usize {
        return Err(invalid("hidden", format!("B = {}: must be < 2^32", hidden.rows)));
    }
    if hidden.cols != head.dim {
        return Err(invalid(
            "hidden",
            format!("{} columns, but the LM head has D = {}: they must match", hidden.cols, head.dim),
        ));
    }
    if hidden.dtype != head.dtype {
        return Err(Error::DTypeMismatch { lm_head: head.dtype, hidden: hidden.dtype });
    }
    if rows != hidden.rows {
        return Err(invalid(rows_argument, format!("{rows} entries for B = {} hidden rows: one per row", hidden.rows)));
    }
    if samples == 0 {
        return Err(invalid("samples", "0: at least one draw per row"));
    }
    Ok(())
}

/// Checks each row's parameters and converts them to the kernels' form.
pub fn row_params(params: &[SamplingParams]) -> Result<Vec<RowParams>> {
    params.iter().enumerate().map(|(i, p)| p.to_row(i)).collect()
}

/// [`row_params`] of a batch kept apart from its hidden states (on the device, in an
/// adapter): at least one row.
pub fn batch_row_params(params: &[SamplingParams]) -> Result<Vec<RowParams>> {
    if params.is_empty() {
        return Err(invalid("params", "no entries: one per batch row is needed"));
    }
    row_params(params)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::DType;

    /// Shards of one D and dtype add up, each starting where the last ended; a mismatch names
    /// the shard, an empty list and a V past 2³¹ are refused.
    #[test]
    fn sharded_heads_add_up_or_name_the_bad_shard() {
        let shape = |vocab| HeadShape { vocab, dim: 8, dtype: DType::BF16 };
        let (head, offsets) = sharded_head([shape(10), shape(3), shape(7)]).unwrap();
        assert_eq!((head.vocab, offsets), (20, vec![0, 10, 13]));
        let odd = HeadShape { dim: 9, ..shape(4) };
        let error = sharded_head([shape(10), odd]).unwrap_err().to_string();
        assert!(error.contains("shards[1]") && error.contains("D = 9"), "{error}");
        assert!(sharded_head([]).unwrap_err().to_string().contains("invalid shards: none"));
        assert!(sharded_head([shape(MAX_VOCAB), shape(1)]).unwrap_err().to_string().contains("must be < 2^31"));
    }
}
