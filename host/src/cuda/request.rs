//! What a GPU call samples and where its results go, in device memory: one [`Request`] and
//! one [`Target`] for every way in (the owned sampler's buffers, cudarc's slices, candle's
//! tensors, raw addresses), made of views that remember the memory they borrow.

use std::marker::PhantomData;

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, SyncOnDrop, sys};
use flashsample_core::NO_TOKEN;
use flashsample_core::abi::ShardPartLayout;
use flashsample_core::process::MAX_TOP_LOGPROBS;

use super::batch::BatchRef;
use super::memory::{MatrixRef, ResidentMaps};
use crate::error::{Result, invalid};
use crate::params::{Draws, VocabShard};
use crate::sampled::Sampled;
use crate::tensor::DType;

/// An element type the kernels read from cudarc buffers.
pub trait DeviceElement: DeviceRepr {
    /// The library's name for it.
    const DTYPE: DType;
}

impl DeviceElement for half::bf16 {
    const DTYPE: DType = DType::BF16;
}

impl DeviceElement for half::f16 {
    const DTYPE: DType = DType::F16;
}

impl DeviceElement for f32 {
    const DTYPE: DType = DType::F32;
}

/// A matrix in device memory as a request reads it: `rows × cols` elements, row `r` starting
/// `r · row_stride` elements after the first. Made from a cudarc slice (borrowed for `'a`), from
/// the owned sampler's buffers, or from a raw address.
pub struct DeviceMatrix<'a> {
    pub(crate) matrix: MatrixRef,
    /// Tensor maps kept with the buffer, so that calls write none.
    pub(crate) maps: Option<ResidentMaps>,
    /// The stream the use below was recorded for (none for raw or owned memory).
    pub(crate) stream: Option<sys::CUstream>,
    _use: Option<SyncOnDrop<'a>>,
    _borrow: PhantomData<&'a ()>,
}

impl<'a> DeviceMatrix<'a> {
    /// `slice` (a cudarc `CudaSlice` or `CudaView`) as a contiguous `[rows, cols]` matrix read
    /// on `stream` (under cudarc's event tracking, where the context has it, `stream` first
    /// waits for the slice's last write, and the slice's free waits for this read, recorded
    /// when the view is dropped).
    pub fn of_slice<T: DeviceElement>(
        slice: &'a impl DevicePtr<T>,
        stream: &'a CudaStream,
        rows: usize,
        cols: usize,
    ) -> Result<DeviceMatrix<'a>> {
        DeviceMatrix::of_rows(slice, stream, 0, rows, cols, cols)
    }

    /// `slice`'s elements from `first` as `[rows, cols]`, rows `row_stride` elements apart (a
    /// strided view, as a framework's tensor layout gives it), read on `stream` as
    /// [`DeviceMatrix::of_slice`] is.
    pub fn of_rows<T: DeviceElement>(
        slice: &'a impl DevicePtr<T>,
        stream: &'a CudaStream,
        first: usize,
        rows: usize,
        cols: usize,
        row_stride: usize,
    ) -> Result<DeviceMatrix<'a>> {
        let end = rows.checked_sub(1).and_then(|last| last.checked_mul(row_stride)?.checked_add(first + cols));
        if end.is_none_or(|end| end > slice.len()) || row_stride < cols {
            return Err(invalid(
                "matrix",
                format!(
                    "[{rows}, {cols}] from element {first} with row stride {row_stride}: outside the slice of {} elements",
                    slice.len()
                ),
            ));
        }
        let (base, use_) = slice.device_ptr(stream);
        let address = base + (first * size_of::<T>()) as u64;
        Ok(DeviceMatrix {
            matrix: MatrixRef { address, rows, cols, row_stride, dtype: T::DTYPE },
            maps: None,
            stream: Some(stream.cu_stream()),
            _use: Some(use_),
            _borrow: PhantomData,
        })
    }

    /// A matrix of memory the library did not allocate: `rows × cols` elements of `dtype` at
    /// device address `address`, rows `row_stride` elements apart.
    ///
    /// # Safety
    /// The memory holds the matrix (the last row `cols` elements) in the context the request
    /// runs in, and stays allocated and unchanged, written by no other stream, until every
    /// stream that sampled from it has run past those calls.
    pub unsafe fn from_raw(
        address: u64,
        rows: usize,
        cols: usize,
        row_stride: usize,
        dtype: DType,
    ) -> DeviceMatrix<'static> {
        DeviceMatrix::resident(MatrixRef { address, rows, cols, row_stride, dtype }, None)
    }

    /// The matrix of a buffer the library keeps (with its tensor maps, if any).
    pub(crate) fn resident(matrix: MatrixRef, maps: Option<ResidentMaps>) -> DeviceMatrix<'a> {
        DeviceMatrix { matrix, maps, stream: None, _use: None, _borrow: PhantomData }
    }

    /// Rows.
    pub fn rows(&self) -> usize {
        self.matrix.rows
    }

    /// Columns.
    pub fn cols(&self) -> usize {
        self.matrix.cols
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.matrix.dtype
    }
}

/// Device memory a call writes: `len` values of `T`, from a cudarc slice (borrowed mutably
/// for `'a`), from the owned sampler's buffers, or from a raw address.
pub struct OutputSlice<'a, T> {
    pub(crate) address: u64,
    pub(crate) len: usize,
    pub(crate) stream: Option<sys::CUstream>,
    _use: Option<SyncOnDrop<'a>>,
    _borrow: PhantomData<&'a mut T>,
}

impl<'a, T: DeviceRepr> OutputSlice<'a, T> {
    /// `slice` (a cudarc `CudaSlice` or `CudaViewMut`), written on `stream` (under cudarc's
    /// event tracking, where the context has it, `stream` first waits for the slice's other
    /// uses, and later uses wait for this write, recorded when the view is dropped).
    pub fn of_slice(slice: &'a mut impl DevicePtrMut<T>, stream: &'a CudaStream) -> OutputSlice<'a, T> {
        let len = slice.len();
        let (address, use_) = slice.device_ptr_mut(stream);
        OutputSlice { address, len, stream: Some(stream.cu_stream()), _use: Some(use_), _borrow: PhantomData }
    }

    /// `len` values of memory the library did not allocate, at device address `address`.
    ///
    /// # Safety
    /// The memory holds `len` values of `T` in the context the request runs in, and stays
    /// allocated, touched by no other stream, until every stream that wrote it has run past
    /// those calls.
    pub unsafe fn from_raw(address: u64, len: usize) -> OutputSlice<'static, T> {
        OutputSlice::resident(address, len)
    }

    /// A buffer the library keeps.
    pub(crate) fn resident(address: u64, len: usize) -> OutputSlice<'a, T> {
        OutputSlice { address, len, stream: None, _use: None, _borrow: PhantomData }
    }

    /// How many values it holds.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Which vocabulary shard a request's `W` is: shard `index` of `count`, whose rows are the
/// tokens `tokens.offset ..` of the whole vocabulary. Stage 1 writes the shard's part; every
/// shard's part is gathered into every shard's [`Target::parts`] ([`Exchange::AllGather`]);
/// the merge then writes the tokens of the whole vocabulary. Rows with min-p, top-k or top-p
/// also exchange each row's largest logit and histograms between the segments of stage 1.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shard {
    /// Where the shard's tokens lie.
    pub tokens: VocabShard,
    /// This shard's place among the shards (its part in the gathered parts).
    pub index: usize,
    /// How many shards the vocabulary is split into.
    pub count: usize,
}

/// One GPU call: `draws` of each row of `H` from the row's processed `softmax(H·Wᵀ / T)`.
pub struct Request<'a> {
    /// `W[V, D]` (a shard's rows with [`Request::shard`]).
    pub lm_head: DeviceMatrix<'a>,
    /// `H[B, D]`, `W`'s dtype.
    pub hidden: DeviceMatrix<'a>,
    /// The rows' parameters and processing.
    pub batch: BatchRef<'a>,
    /// Which draws of each row.
    pub draws: Draws,
    /// `Some` when `W` is one shard of the vocabulary.
    pub shard: Option<Shard>,
}

/// Where a call's results go.
pub struct Target<'a> {
    /// `[B, N]` u32 tokens; every slot of a row without a token holds its status's sentinel
    /// ([`crate::RowStatus::of_token`]).
    pub tokens: OutputSlice<'a, u32>,
    /// `[2, B, N]` f32: each token's log-probability under the raw logits, then under the
    /// distribution drawn from ([`Target::logprobs_len`]). Needed when a row reports
    /// log-probabilities; given, they are computed for every row.
    pub logprobs: Option<OutputSlice<'a, f32>>,
    /// `[B, 20, 2]` u32: each row's top raw entries as (token, bits of the f32
    /// log-probability), by decreasing log-probability, as many as the row asks for, then
    /// [`NO_TOKEN`] ([`Target::top_logprobs_len`]). Needed when a row asks for top entries;
    /// needs `logprobs`.
    pub top_logprobs: Option<OutputSlice<'a, u32>>,
    /// With a sharded request: room for every shard's part side by side
    /// ([`Target::parts_bytes`]); stage 1 writes this shard's, the gather fills the others.
    pub parts: Option<OutputSlice<'a, u8>>,
    /// `[S]` u32: with a verification batch ([`crate::Batch::verify`]), how many drafts each
    /// of its `S` sequences keeps ([`crate::Verdict::accepted`]); the sequence's tokens are
    /// those of its first `accepted + 1` rows. Needed exactly when the batch verifies.
    pub accepted: Option<OutputSlice<'a, u32>>,
}

impl<'a> Target<'a> {
    /// Tokens only.
    pub fn tokens(tokens: OutputSlice<'a, u32>) -> Target<'a> {
        Target { tokens, logprobs: None, top_logprobs: None, parts: None, accepted: None }
    }

    /// Floats of the log-probabilities of `rows × draws` draws.
    pub fn logprobs_len(rows: usize, draws: u32) -> usize {
        2 * rows * draws as usize
    }

    /// Words of the top log-probabilities of `rows` rows.
    pub fn top_logprobs_len(rows: usize) -> usize {
        2 * rows * MAX_TOP_LOGPROBS as usize
    }

    /// Bytes of the gathered parts of `shards` shards of `rows × draws` draws, with the
    /// log-sum-exp terms and top entries of log-probabilities if `logprobs`.
    pub fn parts_bytes(shards: usize, rows: usize, draws: u32, logprobs: bool) -> Result<usize> {
        Ok(shards * part_layout(rows, draws, logprobs)?.bytes as usize)
    }
}

/// One shard's part of `rows × draws` draws, checked against 32-bit extents.
pub(crate) fn part_layout(rows: usize, draws: u32, logprobs: bool) -> Result<ShardPartLayout> {
    let batch = u32::try_from(rows).map_err(|_| invalid("rows", format!("B = {rows}: must be < 2^32")))?;
    crate::params::check_token_count(rows, draws)?;
    Ok(ShardPartLayout::of(batch, draws, logprobs))
}

/// Device memory a call may use for its scratch.
#[derive(Clone, Copy, Debug)]
pub struct DeviceWorkspace {
    /// 64-byte aligned.
    pub address: u64,
    /// At least the plan's [`crate::Plan::workspace_bytes`].
    pub bytes: usize,
}

/// What the shards of a call exchange between two of its segments, each shard over the same
/// words of its own memory, in place, every shard receiving the result: NCCL's collectives
/// (`TensorParallelRank`, feature `nccl`, makes them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Exchange {
    /// The maximum over the shards of `count` `u32` words at `address`.
    MaxU32 {
        /// The words' device address.
        address: u64,
        /// How many words.
        count: usize,
    },
    /// The sum over the shards of `count` `u64` words at `address` (no sum overflows).
    SumU64 {
        /// The words' device address.
        address: u64,
        /// How many words.
        count: usize,
    },
    /// Every shard's part into every shard's parts: `count` parts of `part_bytes` from
    /// `parts`, this shard's the `index`-th (an in-place all-gather).
    AllGather {
        /// The parts' device address.
        parts: u64,
        /// Bytes of one part.
        part_bytes: usize,
        /// This shard's part.
        index: usize,
        /// How many parts.
        count: usize,
    },
}

impl Sampled {
    /// A call's outputs read back to the host: `[B, draws]` `tokens` and, if the call had
    /// them, its log-probabilities (`[2, B, draws]`) and top log-probabilities as words
    /// (`[B, MAX_TOP_LOGPROBS, 2]`): the layouts of [`Target`]. Rows without a token keep their
    /// sentinels ([`Sampled::rows_without_token`]).
    pub fn from_outputs(
        draws: usize,
        tokens: Vec<u32>,
        logprobs: Option<&[f32]>,
        top_logprobs: Option<&[u32]>,
    ) -> Result<Sampled> {
        let (slots, rows) = (tokens.len(), tokens.len().checked_div(draws).unwrap_or(0));
        let mut sampled = Sampled::tokens_only(tokens, draws);
        if let Some(values) = logprobs {
            if values.len() != 2 * slots {
                return Err(invalid(
                    "logprobs",
                    format!("{} values for [{rows}, {draws}] draws: 2 per draw", values.len()),
                ));
            }
            sampled.logprobs = values[..slots].to_vec();
            sampled.processed_logprobs = values[slots..].to_vec();
        }
        if let Some(words) = top_logprobs {
            let per_row = 2 * MAX_TOP_LOGPROBS as usize;
            if words.len() != rows * per_row {
                return Err(invalid(
                    "top_logprobs",
                    format!("{} words for {rows} rows: {per_row} per row", words.len()),
                ));
            }
            for (top, row) in sampled.top_logprobs.iter_mut().zip(words.chunks(per_row)) {
                *top = row
                    .chunks(2)
                    .map(|pair| (pair[0], f32::from_bits(pair[1])))
                    .take_while(|&(token, _)| token != NO_TOKEN)
                    .collect();
            }
        }
        Ok(sampled)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Outputs read back: the tokens as written, `[B, N]` raw then processed log-probabilities,
    /// each row's top entries up to the first `NO_TOKEN`; wrong lengths are typed errors.
    #[test]
    fn outputs_read_back_in_their_layout() {
        let (rows, draws) = (2usize, 3usize);
        let tokens = vec![1, 2, 3, 4, 5, 6];
        let values: Vec<f32> = (0..2 * rows * draws).map(|k| -(k as f32)).collect();
        let mut top = vec![0u32; rows * 2 * MAX_TOP_LOGPROBS as usize];
        let per_row = 2 * MAX_TOP_LOGPROBS as usize;
        for (row, count) in [(0usize, 2usize), (1, 0)] {
            for k in 0..MAX_TOP_LOGPROBS as usize {
                let (token, logprob) =
                    if k < count { (10 * row as u32 + k as u32, -(k as f32)) } else { (NO_TOKEN, f32::NEG_INFINITY) };
                top[row * per_row + 2 * k] = token;
                top[row * per_row + 2 * k + 1] = logprob.to_bits();
            }
        }
        let got = Sampled::from_outputs(draws, tokens.clone(), Some(&values), Some(&top)).unwrap();
        assert_eq!((got.tokens, got.draws), (tokens.clone(), draws));
        assert_eq!(got.logprobs, values[..6]);
        assert_eq!(got.processed_logprobs, values[6..]);
        assert_eq!(got.top_logprobs, vec![vec![(0, 0.0), (1, -1.0)], vec![]]);
        let plain = Sampled::from_outputs(draws, tokens.clone(), None, None).unwrap();
        assert!(plain.logprobs.is_empty() && plain.top_logprobs.iter().all(Vec::is_empty));
        assert!(Sampled::from_outputs(draws, tokens.clone(), Some(&values[1..]), None).is_err());
        assert!(Sampled::from_outputs(draws, tokens, None, Some(&top[2..])).is_err());
    }
}
