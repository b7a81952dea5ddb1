//! A batch in device memory: each row's kernel parameters and its processing image (with a
//! verification's sequences and drafts), uploaded once and read by every call of a decode
//! loop, and the view a request takes of it.

use std::marker::PhantomData;
use std::sync::Arc;

use cudarc::driver::{CudaStream, DevicePtr as CudaDevicePtr, DevicePtrMut as _, SyncOnDrop, sys};
use flashsample_core::RowParams;
use flashsample_core::abi::{DevicePtr, RowProcessing, Selection, VerifiedSequence};
use flashsample_core::process::{SPARSE_BLOCK, SparseEntry};

use super::driver;
use super::memory::{Allocation, check_address};
use crate::batch::{Batch, Verified};
use crate::error::{Result, invalid};
use crate::params::SamplingParams;
use crate::processing::Processing;

/// A [`Batch`] in device memory for a vocabulary of `vocab` tokens: per row its kernel
/// parameters ([`RowParams`]) and a processing block, then the rows' sparse entries (bias and
/// penalties), their per-row index of [`SPARSE_BLOCK`]-entry blocks and the mask words, and
/// for a verification ([`Batch::verify`]) its sequences and their drafted tokens. A
/// decode loop uploads it once, moves the rows' decode step on the device
/// ([`crate::StreamSampler::advance_steps`]), and uploads again when the processing changes
/// (histories change every step).
///
/// ```no_run
/// use flashsample::cudarc::driver::CudaContext;
/// use flashsample::{Batch, DeviceBatch, SamplingParams};
/// let stream = CudaContext::new(0)?.default_stream();
/// let batch = Batch::new((0..8).map(|r| SamplingParams::new(0.7, 1, r, 0)).collect());
/// let on_device = DeviceBatch::upload(&stream, &batch, 151_936)?;
/// assert_eq!(on_device.rows(), 8);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct DeviceBatch {
    rows: Allocation<RowParams>,
    image: Allocation<u8>,
    summary: ProcessingRef,
    logprobs: bool,
    verified: Option<VerifiedRef>,
    /// Each verified sequence's first row, for the verdicts read back.
    first_rows: Vec<usize>,
    /// Whether a verified sequence's penalties count its drafts in their history.
    drafts_in_history: bool,
}

/// Where a verification batch's sequences and drafts lie in device memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct VerifiedRef {
    /// `[count]` [`VerifiedSequence`].
    pub sequences: u64,
    /// Every sequence's drafted tokens, sequence after sequence.
    pub drafts: u64,
    /// How many sequences.
    pub count: usize,
    /// How many drafted tokens, all sequences together.
    pub drafted: usize,
}

/// What a request needs to know of a batch's processing image in device memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ProcessingRef {
    /// `[rows]` [`RowProcessing`] blocks, then what they point to; 0 for none (plain rows).
    pub address: u64,
    pub rows: usize,
    pub vocab: usize,
    /// The first row that needs its whole row (min-p, top-k, top-p or top log-probabilities).
    pub whole_row: Option<usize>,
    /// The first row with min-p, top-k or top-p.
    pub truncating: Option<usize>,
    /// Whether a row has a per-entry step (soft-cap, bias, mask, penalties).
    pub per_entry: bool,
    /// [`Selection::bit`]s of the selections some row needs.
    pub selections: u32,
    /// Whether every row has top-k, so that its truncations can be decided from the tiles'
    /// lists ([`flashsample_core::truncation`]): top-k bounds what a row keeps, while min-p and
    /// top-p alone can keep most of a flat row, whose lists never settle.
    pub listable: bool,
    /// Whether no row has top-k or top-p, so that min-p's truncations can be decided and
    /// drawn from the tiles' chains ([`flashsample_core::chain`]).
    pub chainable: bool,
}

impl ProcessingRef {
    /// `rows` rows of plain sampling over `vocab` tokens, with no image.
    pub fn plain(rows: usize, vocab: usize) -> ProcessingRef {
        ProcessingRef {
            address: 0,
            rows,
            vocab,
            whole_row: None,
            truncating: None,
            per_entry: false,
            selections: 0,
            listable: false,
            chainable: false,
        }
    }

    /// What a request needs to know of `processing` (whose sparse lists are `sparse`) in an
    /// image at `address`.
    pub fn summarize(
        processing: &[Processing],
        sparse: &[Vec<SparseEntry>],
        vocab: usize,
        address: u64,
    ) -> ProcessingRef {
        ProcessingRef {
            address,
            rows: processing.len(),
            vocab,
            whole_row: processing.iter().position(Processing::needs_whole_row),
            truncating: processing.iter().position(Processing::truncates),
            per_entry: processing
                .iter()
                .zip(sparse)
                .any(|(p, listed)| p.softcap.is_some() || p.mask.is_some() || !listed.is_empty()),
            selections: processing.iter().fold(0, |bits, p| bits | selections(p)),
            listable: processing.iter().all(|p| p.top_k.is_some()),
            chainable: processing.iter().all(|p| p.top_k.is_none() && p.top_p >= 1.0),
        }
    }

    /// Whether a row has min-p, top-k or top-p.
    pub fn truncates(&self) -> bool {
        self.truncating.is_some()
    }

    /// Whether a row asks for its top raw log-probabilities.
    pub fn top_logprobs(&self) -> bool {
        self.selections & Selection::TopRaw.bit() != 0
    }

    /// The rows' processing blocks (null for plain rows).
    pub fn blocks(&self) -> DevicePtr<RowProcessing> {
        DevicePtr::new(self.address)
    }

    /// The blocks the fused tiles and the winners' logits apply, or null when no row has a
    /// per-entry step.
    pub fn per_entry_blocks(&self) -> DevicePtr<RowProcessing> {
        if self.per_entry { self.blocks() } else { DevicePtr::NULL }
    }
}

/// The [`Selection::bit`]s of the order statistics the processing pipeline finds for a row
/// with `processing`.
fn selections(processing: &Processing) -> u32 {
    let mut bits = 0;
    if processing.top_k.is_some() {
        bits |= Selection::TopK.bit();
    }
    if processing.top_p < 1.0 {
        bits |= Selection::TopP.bit() | Selection::TopPTie.bit();
    }
    if processing.top_logprobs > 0 {
        bits |= Selection::TopRaw.bit() | Selection::TopRawTie.bit();
    }
    bits
}

/// Where the parts of a batch's device image lie, in bytes from its start: `[B]` row blocks,
/// the rows' sparse entries, their block offsets, the mask words, the verified sequences and
/// their drafts.
struct ImageLayout {
    sparse: usize,
    offsets: usize,
    masks: usize,
    verified: usize,
    drafts: usize,
    len: usize,
}

impl ImageLayout {
    fn of(sparse: &[Vec<SparseEntry>], processing: &[Processing], verified: &[Verified], vocab: usize) -> ImageLayout {
        let listed: usize = sparse.iter().map(Vec::len).sum();
        let indexed = sparse.iter().filter(|entries| !entries.is_empty()).count();
        let masked = processing.iter().filter(|p| p.mask.is_some()).count();
        let drafted: usize = verified.iter().map(|sequence| sequence.drafts.len()).sum();
        let sparse_at = processing.len() * size_of::<RowProcessing>();
        let offsets = sparse_at + listed * size_of::<SparseEntry>();
        let masks = offsets + indexed * (vocab.div_ceil(SPARSE_BLOCK as usize) + 1) * 4;
        let verified_at = masks + masked * vocab.div_ceil(32) * 4;
        let drafts = verified_at + verified.len() * size_of::<VerifiedSequence>();
        ImageLayout { sparse: sparse_at, offsets, masks, verified: verified_at, drafts, len: drafts + drafted * 4 }
    }
}

/// The image's verification part: each sequence's rows and drafts, then the drafts.
fn verified_image(verified: &[Verified]) -> Vec<u8> {
    let mut sequences = Vec::with_capacity(verified.len());
    let mut drafts = Vec::new();
    for sequence in verified {
        sequences.push(VerifiedSequence {
            first_row: sequence.first_row as u32,
            drafts: sequence.drafts.len() as u32,
            draft_offset: drafts.len() as u32,
            padding: 0,
        });
        drafts.extend_from_slice(&sequence.drafts);
    }
    let mut bytes = bytemuck::cast_slice(&sequences).to_vec();
    bytes.extend_from_slice(bytemuck::cast_slice(&drafts));
    bytes
}

/// The device image of a batch's processing (see [`DeviceBatch`]) laid out as `layout`
/// for a buffer at `base`.
fn processing_image(
    processing: &[Processing],
    sparse: &[Vec<SparseEntry>],
    layout: &ImageLayout,
    vocab: usize,
    base: u64,
) -> Vec<u8> {
    let blocks_per_row = vocab.div_ceil(SPARSE_BLOCK as usize);
    let mut rows = Vec::with_capacity(processing.len());
    let (mut entries, mut offsets, mut words) = (Vec::new(), Vec::<u32>::new(), Vec::new());
    for (p, listed) in processing.iter().zip(sparse) {
        let sparse_at = base + (layout.sparse + entries.len() * size_of::<SparseEntry>()) as u64;
        let mut sparse_blocks = DevicePtr::NULL;
        if !listed.is_empty() {
            sparse_blocks = DevicePtr::new(base + (layout.offsets + offsets.len() * 4) as u64);
            // Block k's entries start at the first entry of a token at or past its start.
            offsets.extend(
                (0..=blocks_per_row)
                    .map(|k| listed.partition_point(|e| (e.token as usize) < k * SPARSE_BLOCK as usize) as u32),
            );
        }
        let mask = match &p.mask {
            Some(mask) => {
                let at = base + (layout.masks + words.len() * 4) as u64;
                words.extend_from_slice(&mask[..vocab.div_ceil(32)]);
                DevicePtr::new(at)
            }
            None => DevicePtr::NULL,
        };
        entries.extend_from_slice(listed);
        rows.push(RowProcessing {
            mask,
            sparse: DevicePtr::new(sparse_at),
            sparse_blocks,
            sparse_len: listed.len() as u32,
            softcap: p.softcap.unwrap_or(0.0),
            min_p: p.min_p,
            top_p: p.top_p,
            top_k: p.top_k.unwrap_or(0),
            penalties: p.penalties,
            top_logprobs: p.top_logprobs,
            padding: 0,
        });
    }
    let mut bytes = Vec::with_capacity(layout.len);
    bytes.extend_from_slice(bytemuck::cast_slice(&rows));
    bytes.extend_from_slice(bytemuck::cast_slice(&entries));
    bytes.extend_from_slice(bytemuck::cast_slice(&offsets));
    bytes.extend_from_slice(bytemuck::cast_slice(&words));
    debug_assert_eq!(bytes.len(), layout.verified);
    bytes
}

impl DeviceBatch {
    /// Checks `batch` for a vocabulary of `vocab` tokens (errors name `params[r]` or
    /// `processing[r].<field>`) and copies it to the device on `stream` (any cudarc stream;
    /// the memory is allocated and freed on it).
    pub fn upload(stream: &Arc<CudaStream>, batch: &Batch, vocab: usize) -> Result<DeviceBatch> {
        let (row_params, processing) = batch.check(vocab)?;
        let rows = Allocation::from_host(stream, &row_params, "row parameters")?;
        let sparse: Vec<Vec<SparseEntry>> = processing.iter().map(Processing::sparse_entries).collect();
        let layout = ImageLayout::of(&sparse, &processing, &batch.verified, vocab);
        // SAFETY: every byte is copied from the host below, before any kernel reads it.
        let mut image = unsafe { Allocation::<u8>::uninitialized(stream, layout.len.max(1), "processing")? };
        let address = image.ptr().address();
        let mut bytes = processing_image(&processing, &sparse, &layout, vocab, address);
        bytes.extend_from_slice(&verified_image(&batch.verified));
        debug_assert_eq!(bytes.len(), layout.len);
        image.write(stream, &bytes, "processing")?;
        let summary = ProcessingRef::summarize(&processing, &sparse, vocab, address);
        let verified = (!batch.verified.is_empty()).then(|| VerifiedRef {
            sequences: address + layout.verified as u64,
            drafts: address + layout.drafts as u64,
            count: batch.verified.len(),
            drafted: batch.verified.iter().map(|sequence| sequence.drafts.len()).sum(),
        });
        let first_rows = batch.verified.iter().map(|sequence| sequence.first_row).collect();
        let drafts_in_history = batch.verified.iter().any(|sequence| sequence.drafts_in_history);
        Ok(DeviceBatch {
            rows,
            image,
            summary,
            logprobs: batch.reports_logprobs(),
            verified,
            first_rows,
            drafts_in_history,
        })
    }

    /// B, the rows.
    pub fn rows(&self) -> usize {
        self.rows.len()
    }

    /// The vocabulary the processing was checked against.
    pub fn vocab(&self) -> usize {
        self.summary.vocab
    }

    /// Whether a row reports log-probabilities (a call's target must then have room for them).
    pub fn reports_logprobs(&self) -> bool {
        self.logprobs
    }

    /// The sequences a verification batch checks (0 for sampling): a call's target then needs
    /// [`crate::Target::accepted`].
    pub fn verified_sequences(&self) -> usize {
        self.first_rows.len()
    }

    /// Each verified sequence's first row.
    pub(crate) fn first_rows(&self) -> &[usize] {
        &self.first_rows
    }

    /// Copies a verification's drafted tokens from `drafts` (a cudarc `CudaSlice` or
    /// `CudaView`: every sequence's drafts one after another, as many as the batch was built
    /// with) into the batch, queued on `stream`: a decode loop whose drafter leaves its tokens
    /// in device memory verifies them with no host copy, and a CUDA graph captures the copy
    /// (pair it with [`crate::CudaSampler::advance_verified`]; under capture, turn off the
    /// context's event tracking, `CudaContext::disable_event_tracking`, since cudarc would
    /// otherwise wait inside the capture on events recorded before it). Each sequence keeps the number of
    /// drafts the batch was built with. Errors name `drafts`: the batch verifies no sequence,
    /// `drafts` holds another number of tokens, or a sequence's penalties count the drafts in
    /// their history (which only a batch built on the host holds). A draft `≥ V` equals no
    /// target token, so it is refused by the verdict.
    pub fn write_drafts(&mut self, stream: &Arc<CudaStream>, drafts: &impl CudaDevicePtr<u32>) -> Result<()> {
        let Some(verified) = self.verified else {
            return Err(invalid("drafts", "the batch verifies no sequence (build it with Batch::verify)"));
        };
        if drafts.len() != verified.drafted {
            return Err(invalid(
                "drafts",
                format!("{} tokens: the batch's sequences drafted {}", drafts.len(), verified.drafted),
            ));
        }
        if self.drafts_in_history {
            return Err(invalid(
                "drafts",
                "a sequence's penalties count its drafts in their history: build a new batch with Batch::verify",
            ));
        }
        if verified.drafted == 0 {
            return Ok(());
        }
        let image = &mut self.image;
        // SAFETY: the stream's context is live; cudarc's tracking makes it current, and leaving
        // restores the caller's. The image holds `drafted` drafts at `verified.drafts` and
        // `drafts` as many tokens, both live on `stream` until the copy has run (cudarc's
        // tracking, where the context has it, orders their other uses); a slice and the
        // batch's own image are distinct allocations.
        unsafe {
            driver::in_context(stream.context().cu_ctx(), || {
                let (source, _read) = drafts.device_ptr(stream);
                let (_, _write) = image.slice_mut().device_ptr_mut(stream);
                driver::copy_on_device_async(
                    "drafts",
                    DevicePtr::<u32>::new(verified.drafts),
                    DevicePtr::new(source),
                    verified.drafted,
                    stream.cu_stream(),
                )
            })
        }
    }

    /// Replaces the rows' sampling parameters (one per row, checked), queued on `stream`; the
    /// processing stays.
    pub fn set_params(&mut self, stream: &Arc<CudaStream>, params: &[SamplingParams]) -> Result<()> {
        if params.len() != self.rows() {
            return Err(invalid("params", format!("{} entries for a batch of {} rows", params.len(), self.rows())));
        }
        let rows = crate::params::row_params(params)?;
        self.rows.write(stream, &rows, "row parameters")
    }

    /// The batch as a request on `stream` reads it; under cudarc's event tracking (where the
    /// context has it) `stream` first waits for the upload, and the memory is freed only after
    /// the reads the view records when it is dropped.
    pub fn view<'a>(&'a self, stream: &'a CudaStream) -> BatchRef<'a> {
        let (_, rows_use) = self.rows.slice().device_ptr(stream);
        let (_, image_use) = self.image.slice().device_ptr(stream);
        BatchRef {
            row_params: self.rows.ptr().address(),
            rows: self.rows(),
            processing: Some(self.summary),
            logprobs: self.logprobs,
            verified: self.verified,
            stream: Some(stream.cu_stream()),
            _uses: [Some(rows_use), Some(image_use)],
            _batch: PhantomData,
        }
    }

    /// Keeps the batch's truncations on materialised logits: no call plans lists or chains for
    /// it (the reference the benchmark times the summaries' paths against, on every module).
    #[cfg(feature = "internals")]
    pub fn materialise_truncations(&mut self) {
        (self.summary.listable, self.summary.chainable) = (false, false);
    }

    /// What a request needs to know of the batch's processing.
    pub(crate) fn summary(&self) -> ProcessingRef {
        self.summary
    }

    /// The row parameters' device address (`[rows]` [`RowParams`]).
    pub(crate) fn row_params(&self) -> DevicePtr<RowParams> {
        self.rows.ptr()
    }

    /// Where the verified sequences lie (none for sampling).
    pub(crate) fn verified(&self) -> Option<VerifiedRef> {
        self.verified
    }

    /// Records a write of the row parameters on `stream` for cudarc's event tracking (where
    /// the context has it); keep the guard until the write is queued.
    pub(crate) fn row_params_written_on<'a>(&'a mut self, stream: &'a CudaStream) -> SyncOnDrop<'a> {
        self.rows.slice_mut().device_ptr_mut(stream).1
    }
}

impl std::fmt::Debug for DeviceBatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceBatch")
            .field("rows", &self.rows())
            .field("vocab", &self.vocab())
            .field("logprobs", &self.logprobs)
            .finish()
    }
}

/// A request's rows: each row's kernel parameters in device memory and, from a
/// [`DeviceBatch`], its processing.
pub struct BatchRef<'a> {
    pub(crate) row_params: u64,
    pub(crate) rows: usize,
    pub(crate) processing: Option<ProcessingRef>,
    pub(crate) logprobs: bool,
    /// A verification's sequences and drafts.
    pub(crate) verified: Option<VerifiedRef>,
    /// The stream the uses below were recorded for (none for raw memory).
    pub(crate) stream: Option<sys::CUstream>,
    _uses: [Option<SyncOnDrop<'a>>; 2],
    _batch: PhantomData<&'a DeviceBatch>,
}

impl BatchRef<'static> {
    /// `rows` rows of plain sampling whose [`RowParams`] (8-byte aligned) the caller keeps at
    /// device address `row_params` (for memory the library did not allocate).
    ///
    /// # Safety
    /// `row_params` holds `rows` [`RowParams`] of the context the request runs in, which stay
    /// allocated and unchanged, and which no other stream writes, until every stream that
    /// sampled with them has run past those calls.
    pub unsafe fn from_raw(row_params: u64, rows: usize) -> Result<BatchRef<'static>> {
        check_address("row_params", row_params, align_of::<RowParams>())?;
        Ok(BatchRef {
            row_params,
            rows,
            processing: None,
            logprobs: false,
            verified: None,
            stream: None,
            _uses: [None, None],
            _batch: PhantomData,
        })
    }
}

impl BatchRef<'_> {
    /// `rows` rows at `row_params` with `processing`, for tests that record launches.
    #[cfg(test)]
    pub(crate) fn recording(row_params: u64, processing: ProcessingRef) -> BatchRef<'static> {
        BatchRef {
            row_params,
            rows: processing.rows,
            processing: Some(processing),
            logprobs: false,
            verified: None,
            stream: None,
            _uses: [None, None],
            _batch: PhantomData,
        }
    }

    /// B, the rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// The processing over `vocab` tokens (plain rows without an image).
    pub(crate) fn processing(&self, vocab: usize) -> ProcessingRef {
        self.processing.unwrap_or(ProcessingRef::plain(self.rows, vocab))
    }
}
