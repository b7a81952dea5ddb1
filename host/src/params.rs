//! Per-row sampling parameters, which draws a call makes, vocabulary shards, and the shape
//! rules every backend applies before any work.

use flashsample_core::RowParams;
use flashsample_core::abi::SHARD_ALIGNMENT;
use flashsample_core::noise::MAX_TEMPERATURE;

use crate::error::{Error, Result, invalid};
use crate::tensor::{DType, Matrix, MatrixShape};

/// How one batch row is sampled.
///
/// The noise of a draw is a pure function of `(seed, sequence, step, draw index, vocabulary
/// index)` (see `flashsample_core::noise`), so a row's tokens do not depend on the batch it
/// is in, its position there, or the kernel's tiling.
///
/// ```
/// use flashsample::SamplingParams;
/// // Request 7 of a server, at decode position 12, with temperature 0.8.
/// let params = SamplingParams::new(0.8, 2024, 7, 12);
/// assert_eq!(params.sequence, 7);
/// ```
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SamplingParams {
    /// `0 ≤ T ≤ 10³⁶`; `T = 0` is greedy argmax (no noise, ties to the lowest index). Any
    /// `T > 0` samples `softmax(logits / T)`, ties broken by the noise however small `T` is.
    pub temperature: f32,
    /// The seed of the noise.
    pub seed: u64,
    /// Which independent sequence of the seed's noise the row draws from, e.g. a request id.
    pub sequence: u32,
    /// Decode step or position; successive steps get fresh noise.
    pub step: u32,
}

impl SamplingParams {
    /// A row's parameters.
    pub fn new(temperature: f32, seed: u64, sequence: u32, step: u32) -> SamplingParams {
        SamplingParams { temperature, seed, sequence, step }
    }

    /// The kernels' form of row `index`'s parameters, or the temperature rule it breaks.
    fn to_row(self, index: usize) -> Result<RowParams> {
        let t = self.temperature;
        if !(0.0..=MAX_TEMPERATURE).contains(&t) {
            return Err(invalid(
                format!("params[{index}].temperature"),
                format!("T = {t:e}: must be 0 (greedy) or in (0, {MAX_TEMPERATURE:e}]"),
            ));
        }
        let greedy = t == 0.0;
        Ok(RowParams {
            seed: self.seed,
            sequence: self.sequence,
            step: self.step,
            temperature: t,
            greedy: greedy as u32,
        })
    }
}

/// Which draws of each row a call makes: `first .. first + count`. Draw `j` is keyed by its
/// index, so calls that together cover `0 .. N` give the tokens one call for `N` draws gives
/// (and a caller can write millions of draws in calls of bounded memory). A plain count
/// converts: `Draws::from(4)` is draws `0 .. 4`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Draws {
    /// The first draw's index.
    pub first: u32,
    /// How many draws of each row.
    pub count: u32,
}

impl Draws {
    /// Draws `0 .. count`.
    pub fn first(count: u32) -> Draws {
        Draws { first: 0, count }
    }

    /// Checks that the draws exist: at least one, every index below 2³².
    pub(crate) fn check(self) -> Result<Draws> {
        if self.count == 0 {
            return Err(invalid("draws", "0: at least one draw per row"));
        }
        if self.first.checked_add(self.count - 1).is_none() {
            return Err(invalid(
                "draws",
                format!("{} .. {} + {}: every draw index must be below 2^32", self.first, self.first, self.count),
            ));
        }
        Ok(self)
    }
}

impl From<u32> for Draws {
    fn from(count: u32) -> Draws {
        Draws::first(count)
    }
}

/// Where a vocabulary shard lies: `W`'s row `r` is the token `offset + r` of a vocabulary
/// of `vocab` tokens. Noise and processing are keyed by the global index, so the shards'
/// winners merge into the unsharded tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VocabShard {
    /// The global index of the shard's first token: a multiple of 4 (one Philox block).
    pub offset: usize,
    /// The whole vocabulary's size.
    pub vocab: usize,
}

impl VocabShard {
    /// The bounds of `shards` shards of a vocabulary of `vocab` tokens: shard `s` holds the
    /// tokens `bounds[s] .. bounds[s + 1]`, whole blocks of 4 (the Philox block) but for the
    /// last, as even as blocks allow; at most `⌈vocab / 4⌉` shards.
    ///
    /// ```
    /// assert_eq!(flashsample::VocabShard::bounds(10, 2)?, [0, 4, 10]);
    /// # Ok::<(), flashsample::Error>(())
    /// ```
    pub fn bounds(vocab: usize, shards: usize) -> Result<Vec<usize>> {
        let blocks = vocab.div_ceil(4);
        if shards == 0 || shards > blocks {
            return Err(invalid(
                "shards",
                format!("{shards}: shards are whole blocks of 4 tokens, 1 to ⌈V/4⌉ = {blocks}"),
            ));
        }
        Ok((0..=shards).map(|s| (4 * (s * blocks / shards)).min(vocab)).collect())
    }

    /// The rules of a shard of `rows` tokens here: its offset a multiple of 4, inside the
    /// vocabulary, and the vocabulary below 2³¹.
    pub(crate) fn check(self, rows: usize) -> Result<()> {
        if !self.offset.is_multiple_of(SHARD_ALIGNMENT as usize) {
            return Err(invalid(
                "shard.offset",
                format!("{}: must be a multiple of {SHARD_ALIGNMENT} (one Philox block of 4 tokens)", self.offset),
            ));
        }
        if self.offset.checked_add(rows).is_none_or(|end| end > self.vocab) {
            return Err(invalid(
                "shard.offset",
                format!(
                    "{} + {rows} rows: the shard must lie inside the vocabulary of V = {}",
                    self.offset, self.vocab
                ),
            ));
        }
        if self.vocab > MAX_VOCAB {
            return Err(invalid("shard.vocab", format!("V = {}: must be < 2^31", self.vocab)));
        }
        Ok(())
    }
}

/// The LM head's shape as the backends keep it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeadShape {
    /// V, the vocabulary (of all shards together).
    pub vocab: usize,
    /// D, the hidden size.
    pub dim: usize,
    /// The element type.
    pub dtype: DType,
}

/// Largest vocabulary: indices are u32 with `u32::MAX` reserved, and Philox blocks are
/// `index / 4 < 2²⁹`.
pub(crate) const MAX_VOCAB: usize = (1 << 31) - 1;

/// Checks an LM head `W[V, D]`: non-empty, `V < 2³¹`, every element finite.
pub(crate) fn check_lm_head(lm_head: &Matrix) -> Result<HeadShape> {
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

/// The shape of an LM head split by vocabulary into shards of the given shapes (shard `s`
/// holds the rows after those of shards `0 .. s`) and each shard's first row: every shard has
/// shard 0's D and dtype, and the whole V is below 2³¹.
pub(crate) fn sharded_head(shards: impl IntoIterator<Item = HeadShape>) -> Result<(HeadShape, Vec<usize>)> {
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

/// The shape rules of an LM head `W[V, D]`: `1 ≤ V < 2³¹`, `1 ≤ D < 2³²`.
pub(crate) fn check_head_shape(vocab: usize, dim: usize) -> Result<()> {
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
pub(crate) fn check_hidden_values(hidden: &Matrix) -> Result<()> {
    match hidden.first_non_finite() {
        Some((r, c)) => Err(invalid(
            "hidden",
            format!("element [{r}, {c}] = {}: every hidden state must be finite", hidden.get(r, c)),
        )),
        None => Ok(()),
    }
}

/// The shape rules of a request: `B ≥ 1` rows of `H` with `W`'s D and dtype, one entry of
/// per-row parameters (named `rows_argument`) per row, and `B · draws` tokens below 2³².
pub(crate) fn check_request_shape(
    head: HeadShape,
    hidden: MatrixShape,
    rows: usize,
    rows_argument: &str,
    draws: u32,
) -> Result<()> {
    if hidden.rows == 0 {
        return Err(invalid("hidden", "B = 0 rows: at least one row is needed"));
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
    check_token_count(hidden.rows, draws)
}

/// `B · draws` tokens must be at least one and below 2³² (the kernels index them in u32).
pub(crate) fn check_token_count(rows: usize, draws: u32) -> Result<()> {
    if draws == 0 {
        return Err(invalid("draws", "0: at least one draw per row"));
    }
    if rows.checked_mul(draws as usize).is_none_or(|n| n > u32::MAX as usize) {
        return Err(invalid("draws", format!("B x draws = {rows} x {draws} tokens: must be < 2^32")));
    }
    Ok(())
}

/// Checks each row's parameters and converts them to the kernels' form; at least one row.
pub(crate) fn row_params(params: &[SamplingParams]) -> Result<Vec<RowParams>> {
    if params.is_empty() {
        return Err(invalid("params", "no entries: one per batch row is needed"));
    }
    params.iter().enumerate().map(|(i, p)| p.to_row(i)).collect()
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

    /// Bounds are whole blocks of 4 but the last, cover the vocabulary, leave no shard empty,
    /// and differ in size by at most a block; more shards than blocks are refused.
    #[test]
    fn shard_bounds_are_whole_blocks_and_even() {
        for vocab in [1usize, 4, 5, 70, 1009, 151_936, 128_257] {
            let blocks = vocab.div_ceil(4);
            for shards in [1, 2, 3, 7, 8, blocks] {
                if shards > blocks {
                    continue;
                }
                let bounds = VocabShard::bounds(vocab, shards).unwrap();
                assert_eq!((bounds.len(), bounds[0], bounds[shards]), (shards + 1, 0, vocab));
                assert!(bounds[..shards].iter().all(|b| b % 4 == 0), "V = {vocab}, {shards}: {bounds:?}");
                let sizes: Vec<usize> = bounds.windows(2).map(|b| b[1] - b[0]).collect();
                assert!(sizes.iter().all(|&n| n > 0), "V = {vocab}, {shards}: {bounds:?}");
                let blocks_of = |n: usize| n.div_ceil(4);
                let (low, high) =
                    (sizes.iter().map(|&n| blocks_of(n)).min(), sizes.iter().map(|&n| blocks_of(n)).max());
                assert!(high.unwrap() - low.unwrap() <= 1, "V = {vocab}, {shards}: {sizes:?}");
            }
            assert!(VocabShard::bounds(vocab, blocks + 1).is_err() && VocabShard::bounds(vocab, 0).is_err());
        }
    }

    /// V is at most 2³¹ − 1 (indices are u32 with `u32::MAX` reserved), D at least 1.
    #[test]
    fn head_shapes_keep_indices_in_range() {
        assert!(check_head_shape((1 << 31) - 1, 8).is_ok());
        for (vocab, dim) in [(1 << 31, 8), (0, 8), (8, 0)] {
            match check_head_shape(vocab, dim) {
                Err(Error::InvalidArgument { argument, .. }) => assert_eq!(argument, "lm_head"),
                other => panic!("V = {vocab}, D = {dim}: {other:?}"),
            }
        }
    }

    /// A shard's offset is a multiple of 4 and it lies inside its vocabulary.
    #[test]
    fn shards_lie_inside_the_vocabulary_on_a_block() {
        let shard = |offset, vocab| VocabShard { offset, vocab };
        assert!(shard(8, 20).check(12).is_ok());
        for (s, rows, argument) in [(shard(6, 20), 4, "shard.offset"), (shard(8, 20), 13, "shard.offset")] {
            match s.check(rows) {
                Err(Error::InvalidArgument { argument: a, .. }) => assert_eq!(a, argument),
                other => panic!("{other:?}"),
            }
        }
    }
}
