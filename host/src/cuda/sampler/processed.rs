//! Processed sampling on the GPU, by one of two paths with the same tokens for the same logits:
//! - fused: rows with per-entry steps only (soft-cap, bias, mask, penalties) and no
//!   log-probabilities go through the tile kernels of plain sampling, which apply the steps to
//!   each logits quad (`SampleRequest::processing`);
//! - materialised: the unfused GEMM writes the logits (`[B, V]` f32, twice with
//!   log-probabilities: raw and processed), one block per row processes them
//!   (`process_rows`), the logits sampler and the merge kernel draw from them with the plain
//!   path's noise, and with log-probabilities a last kernel gives the drawn tokens' ones.

use std::sync::Arc;

use cudarc::driver::CudaStream;
use flashsample_core::NO_TOKEN;
use flashsample_core::abi::{DevicePtr, LogprobArgs, ProcessArgs, RowProcessing, RowSums, TopLogprob};
use flashsample_core::process::{MAX_TOP_LOGPROBS, SPARSE_BLOCK, SparseEntry};
use flashsample_core::registry::Kernel;

use super::{CudaSampler, ensure};
use crate::cpu::Sampled;
use crate::cuda::buffers::{CudaHidden, CudaLmHead, DeviceBuffer, DeviceRows, DeviceTokens};
use crate::cuda::dispatch::Variant;
use crate::cuda::driver;
use crate::cuda::stream::FusedProcessing;
use crate::error::{Result, invalid};
use crate::params::{Draws, SamplingParams, check_request};
use crate::process::Processing;
use crate::tensor::Matrix;

/// Blocks of the log-probability kernel for `slots` tokens, one thread each.
fn logprob_blocks(slots: usize) -> u64 {
    slots.div_ceil(Kernel::TokenLogprobs.threads() as usize) as u64
}

/// A batch's [`Processing`] in device memory: per row a [`RowProcessing`] block, then the
/// rows' sparse entries, their per-row index of [`SPARSE_BLOCK`]-entry blocks and the mask
/// words, uploaded once. A decode loop keeps it while the
/// processing stays (histories change every step: upload again then).
pub struct DeviceProcessing {
    buffer: DeviceBuffer<u8>,
    rows: usize,
    vocab: usize,
    /// Whether a row asks for its top raw log-probabilities.
    top_logprobs: bool,
    /// The first row that needs its whole row (min-p, top-k, top-p or top log-probabilities),
    /// if any: the fused tiles cannot process it.
    whole_row: Option<usize>,
}

/// What a processed call writes on the device: `[B, N]` tokens and, when asked for, their raw
/// and processed log-probabilities with each row's log-sum-exp terms.
pub struct ProcessedOutputs {
    pub tokens: DeviceTokens,
    /// `[B, N]` raw log-probabilities, then `[B, N]` processed ones, then `[B]` [`RowSums`],
    /// then `[B, MAX_TOP_LOGPROBS]` [`TopLogprob`].
    logprobs: Option<DeviceBuffer<f32>>,
}

impl ProcessedOutputs {
    fn slots(&self) -> usize {
        self.tokens.rows * self.tokens.samples
    }

    fn sums(&self) -> DevicePtr<RowSums> {
        self.logprobs.as_ref().map_or(DevicePtr::NULL, |values| values.ptr().add(2 * self.slots() as u64).cast())
    }

    fn top(&self) -> DevicePtr<TopLogprob> {
        let sums = self.sums();
        if sums.address() == 0 { DevicePtr::NULL } else { sums.add(self.tokens.rows as u64).cast() }
    }
}

/// Where the parts of a batch's device image lie, in bytes from its start: `[B]` row blocks,
/// the rows' sparse entries, their block offsets, the mask words.
struct ImageLayout {
    sparse: usize,
    offsets: usize,
    masks: usize,
    len: usize,
}

impl ImageLayout {
    fn of(sparse: &[Vec<SparseEntry>], processing: &[Processing], vocab: usize) -> ImageLayout {
        let listed: usize = sparse.iter().map(Vec::len).sum();
        let indexed = sparse.iter().filter(|entries| !entries.is_empty()).count();
        let masked = processing.iter().filter(|p| p.mask.is_some()).count();
        let sparse_at = processing.len() * size_of::<RowProcessing>();
        let offsets = sparse_at + listed * size_of::<SparseEntry>();
        let masks = offsets + indexed * (vocab.div_ceil(SPARSE_BLOCK as usize) + 1) * 4;
        ImageLayout { sparse: sparse_at, offsets, masks, len: masks + masked * vocab.div_ceil(32) * 4 }
    }
}

/// The device image of a batch's processing (see [`DeviceProcessing`]) laid out as `layout`
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
    debug_assert_eq!(bytes.len(), layout.len);
    bytes
}

impl DeviceProcessing {
    /// Checks a batch's processing for a vocabulary of `vocab` tokens (errors name
    /// `processing[row].<field>`) and copies it to the device on `stream` (any cudarc stream;
    /// the buffer is allocated and freed on it).
    pub fn upload(stream: &Arc<CudaStream>, processing: &[Processing], vocab: usize) -> Result<DeviceProcessing> {
        for (b, p) in processing.iter().enumerate() {
            p.check(b, vocab)?;
        }
        let sparse: Vec<Vec<SparseEntry>> = processing.iter().map(Processing::sparse_entries).collect();
        let layout = ImageLayout::of(&sparse, processing, vocab);
        // SAFETY: every byte is copied from the host below, before any kernel reads it.
        let buffer = unsafe { DeviceBuffer::<u8>::uninitialized(stream, layout.len.max(1), "processing")? };
        let image = processing_image(processing, &sparse, &layout, vocab, buffer.ptr().address());
        // SAFETY: the buffer holds the image's bytes; the copy is ordered on `stream`.
        unsafe { driver::copy_to_device_async("processing", buffer.ptr(), &image, stream.cu_stream())? };
        let whole_row = processing.iter().position(Processing::needs_whole_row);
        let top_logprobs = processing.iter().any(|p| p.top_logprobs > 0);
        Ok(DeviceProcessing { buffer, rows: processing.len(), vocab, whole_row, top_logprobs })
    }

    /// The per-entry processing the fused tiles apply
    /// ([`SampleRequest::processing`](crate::SampleRequest::processing) in borrowed mode, CUDA
    /// graphs included); refused when a row has min-p, top-k, top-p or top log-probabilities,
    /// which need the whole row first.
    pub fn fused(&self) -> Result<FusedProcessing> {
        if let Some(row) = self.whole_row {
            return Err(invalid(
                format!("processing[{row}]"),
                "min-p, top-k, top-p and top log-probabilities need the whole row: the fused tiles apply soft-cap, bias, mask and penalties only",
            ));
        }
        Ok(FusedProcessing { address: self.buffer.ptr().address(), rows: self.rows, vocab: self.vocab })
    }
}

impl CudaSampler {
    /// Checks a batch's processing for a vocabulary of `vocab` tokens (errors name
    /// `processing[row].<field>`) and copies it to the device on the sampler's stream.
    pub fn upload_processing(&self, processing: &[Processing], vocab: usize) -> Result<DeviceProcessing> {
        self.make_current()?;
        DeviceProcessing::upload(&self.stream, processing, vocab)
    }

    /// Room for a processed call's outputs of `rows × samples` draws, with their
    /// log-probabilities if `logprobs`. Without them no log-sum-exp is summed and the logits
    /// are processed in place: half the workspace and less work.
    pub fn processed_outputs(&self, rows: usize, samples: usize, logprobs: bool) -> Result<ProcessedOutputs> {
        let tokens = self.tokens(rows, samples)?;
        let len = 2 * rows * samples
            + rows * (size_of::<RowSums>() + MAX_TOP_LOGPROBS as usize * size_of::<TopLogprob>()) / 4;
        let logprobs = match logprobs {
            // SAFETY: the kernels write every value before it is read.
            true => Some(unsafe { DeviceBuffer::<f32>::uninitialized(&self.stream, len, "log-probabilities")? }),
            false => None,
        };
        Ok(ProcessedOutputs { tokens, logprobs })
    }

    /// The draws `draws` of each row of `hidden` with the row's [`Processing`] and
    /// log-probabilities, returned to the host: what
    /// [`CpuSampler::sample_processed`](crate::CpuSampler::sample_processed) draws, with the
    /// same processing order, keep rule, noise and statuses (see
    /// [`CudaSampler::sample_processed_into`]).
    pub fn sample_processed(
        &self,
        lm_head: &CudaLmHead,
        hidden: &Matrix,
        params: &[SamplingParams],
        processing: &[Processing],
        draws: Draws,
    ) -> Result<Sampled> {
        let draws = draws.check()?;
        check_request(lm_head.shape, hidden.shape(), params, draws.count)?;
        if processing.len() != params.len() {
            return Err(invalid(
                "processing",
                format!("{} entries for B = {} hidden rows: one per row", processing.len(), params.len()),
            ));
        }
        let device_processing = self.upload_processing(processing, lm_head.shape.vocab)?;
        let hidden = self.upload_hidden(hidden)?;
        let rows = self.upload_rows(params)?;
        let mut out = self.processed_outputs(params.len(), draws.count as usize, true)?;
        self.sample_processed_into(lm_head, &hidden, &rows, &device_processing, draws, Variant::Auto, &mut out)?;
        self.processed_to_host(&out)
    }

    /// Queues processed sampling into `out` (`[B, draws.count]`) with the tile of `variant`.
    /// Without log-probabilities and truncations (soft-cap, bias, mask and penalties only) the
    /// fused tile applies the steps to each logits tile on chip: no logits in memory. Otherwise
    /// the logits are materialised: the unfused GEMM writes them (`B · V` floats of workspace,
    /// twice that with log-probabilities, which keep the raw logits beside the processed
    /// ones), one block per row processes them, the logits sampler and the merge kernel draw
    /// with the plain path's noise keys, and with log-probabilities a last kernel writes them;
    /// that GEMM needs a BF16 or F16 head with `D % 8 == 0`. Both give the same tokens for
    /// the same logits. Never waits for the device.
    #[allow(clippy::too_many_arguments)]
    pub fn sample_processed_into(
        &self,
        lm_head: &CudaLmHead,
        hidden: &CudaHidden,
        rows: &DeviceRows,
        processing: &DeviceProcessing,
        draws: Draws,
        variant: Variant,
        out: &mut ProcessedOutputs,
    ) -> Result<()> {
        let draws = draws.check()?;
        self.check_device_rows(lm_head, hidden, rows, draws.count)?;
        let shape = lm_head.shape;
        let batch = hidden.rows();
        if processing.rows != batch || processing.vocab != shape.vocab {
            return Err(invalid(
                "processing",
                format!(
                    "uploaded for B = {}, V = {}; the request has B = {batch}, V = {}",
                    processing.rows, processing.vocab, shape.vocab
                ),
            ));
        }
        if out.tokens.rows != batch || out.tokens.samples != draws.count as usize {
            return Err(invalid(
                "out",
                format!(
                    "room for [{}, {}] draws, the request makes [{batch}, {}]",
                    out.tokens.rows, out.tokens.samples, draws.count
                ),
            ));
        }
        if processing.top_logprobs && out.logprobs.is_none() {
            return Err(invalid(
                "out",
                "top log-probabilities need outputs with log-probabilities (processed_outputs(.., true))",
            ));
        }
        if out.logprobs.is_none() && processing.whole_row.is_none() {
            let fused = Some(processing.fused()?);
            return self.sample_at(lm_head, hidden, rows.buffer.ptr(), draws, variant, fused, &mut out.tokens);
        }
        let variant = variant.resolve(self.module(), shape.dtype, shape.dim, batch)?;
        if variant.logits_kernel(shape.dtype).is_none() {
            return Err(invalid(
                "lm_head",
                format!("{}, D = {}: processing on the GPU needs BF16 or F16 with D % 8 == 0", shape.dtype, shape.dim),
            ));
        }
        let stride = shape.vocab.next_multiple_of(4);
        let copies = if out.logprobs.is_some() { 2 } else { 1 };
        let logits = ensure(&self.stream, &mut self.workspace.borrow_mut().logits, copies * batch * stride, "logits")?;
        let (raw, processed) = (logits, logits.add(((copies - 1) * batch * stride) as u64));
        let row_params = rows.buffer.ptr();
        self.queue_logits(lm_head, hidden, variant, raw, stride)?;
        let args = ProcessArgs {
            raw,
            processed,
            row_params,
            processing: processing.buffer.ptr().cast(),
            sums: out.sums(),
            top: out.top(),
            vocab: shape.vocab as u32,
            logits_stride: stride as u32,
            batch: batch as u32,
            padding: 0,
        };
        // SAFETY: both logits hold `B × stride` floats; the processing image holds `B` row
        // blocks whose sparse entries are distinct tokens below V (`sparse_entries` of checked
        // rows) and whose masks hold ⌈V/32⌉ words (checked); `out` holds `B` sums.
        unsafe { self.launch(Kernel::ProcessRows, batch as u64, &args)? };
        self.queue_logits_sampling(processed, stride, shape.vocab, row_params, batch, draws, out.tokens.buffer.ptr())?;
        let Some(values) = &out.logprobs else {
            return Ok(());
        };
        let slots = out.slots();
        let args = LogprobArgs {
            raw,
            processed,
            row_params,
            sums: out.sums(),
            tokens: out.tokens.buffer.ptr(),
            logprobs: values.ptr(),
            processed_logprobs: values.ptr().add(slots as u64),
            vocab: shape.vocab as u32,
            logits_stride: stride as u32,
            batch: batch as u32,
            samples: draws.count,
        };
        // SAFETY: `B × samples` tokens and twice as many log-probability slots; the rest as above.
        unsafe { self.launch(Kernel::TokenLogprobs, logprob_blocks(slots), &args) }
    }

    /// Waits for a processed call and copies its tokens and log-probabilities (empty if `out`
    /// has none) to the host; rows without a token keep their sentinels
    /// ([`Sampled::rows_without_token`]).
    pub fn processed_to_host(&self, out: &ProcessedOutputs) -> Result<Sampled> {
        self.make_current()?;
        self.synchronize("processed sampling")?;
        let tokens = out.tokens.buffer.to_host(&self.stream, "tokens")?;
        let (mut logprobs, mut processed_logprobs) = (Vec::new(), Vec::new());
        let mut top_logprobs = vec![Vec::new(); out.tokens.rows];
        if let Some(values) = &out.logprobs {
            logprobs = values.to_host(&self.stream, "log-probabilities")?;
            let top_at = 2 * out.slots() + out.tokens.rows * size_of::<RowSums>() / 4;
            let top: &[TopLogprob] = bytemuck::cast_slice(&logprobs[top_at..]);
            for (row, slots) in top_logprobs.iter_mut().zip(top.chunks(MAX_TOP_LOGPROBS as usize)) {
                *row = slots.iter().take_while(|t| t.token != NO_TOKEN).map(|t| (t.token, t.logprob)).collect();
            }
            logprobs.truncate(2 * out.slots());
            processed_logprobs = logprobs.split_off(out.slots());
        }
        Ok(Sampled { draws: out.tokens.samples, tokens, logprobs, processed_logprobs, top_logprobs })
    }
}
