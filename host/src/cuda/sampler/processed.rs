//! Processed sampling on the GPU, by one of two paths with the same tokens for the same logits:
//! - fused: rows with per-entry steps only (soft-cap, bias, mask, penalties) go through the
//!   tile kernels of plain sampling, which apply the steps to each logits quad
//!   (`SampleRequest::processing`) and, with log-probabilities, sum each tile's log-sum-exp
//!   terms; the winners' logits are recomputed, one dot product each;
//! - materialised, when a row needs its whole row (min-p, top-k, top-p, top entries): the
//!   unfused GEMM writes the logits (`[B, V]` f32, twice with log-probabilities: raw and
//!   processed), the processing pipeline (`process_rows` launches over slices of each row)
//!   processes them, and the logits sampler and the merge kernel draw from them with the plain
//!   path's noise.
//!
//! Either path can run over a vocabulary shard of the LM head (its rows with their global
//! offset): stage 1 writes the shard's winners per (row, draw) with the tokens' logits and,
//! with log-probabilities, the shard's log-sum-exp terms and top raw entries into the shard's
//! part of a [`ShardParts`]; stage 2, the shard merge, turns all parts into tokens and
//! log-probabilities. The unsharded call is the one-shard case; the parts are
//! laid out so that a collective can gather them across devices.

use std::sync::Arc;

use cudarc::driver::CudaStream;
use flashsample_core::abi::{DevicePtr, RowProcessing, Selection, ShardPartLayout};
use flashsample_core::process::{SPARSE_BLOCK, SparseEntry};

use super::{CudaSampler, resident_maps};
use crate::cpu::Sampled;
use crate::cuda::buffers::{CudaHidden, CudaLmHead, DeviceBuffer, DeviceRows, DeviceTokens, ensure};
use crate::cuda::dispatch::Variant;
use crate::cuda::driver;
use crate::cuda::stream::{
    DeviceWorkspace, FusedProcessing, ProcessedPlan, ProcessedRequest, ProcessedTarget, ProcessingRef,
    ShardMergeRequest, ShardReduction, StreamSampler, TensorMaps,
};
use crate::error::{Result, invalid};
use crate::params::{Draws, SamplingParams, check_sharded_request};
use crate::process::Processing;
use crate::tensor::Matrix;

/// A batch's [`Processing`] in device memory: per row a [`RowProcessing`] block, then the
/// rows' sparse entries, their per-row index of [`SPARSE_BLOCK`]-entry blocks and the mask
/// words, uploaded once. A decode loop keeps it while the
/// processing stays (histories change every step: upload again then).
pub struct DeviceProcessing {
    buffer: DeviceBuffer<u8>,
    rows: usize,
    vocab: usize,
    /// The first row that needs its whole row (min-p, top-k, top-p or top log-probabilities),
    /// if any: the fused tiles cannot process it.
    whole_row: Option<usize>,
    /// The first row with min-p, top-k or top-p, if any: its keep rule needs the whole
    /// vocabulary in one shard, or shards that decide it together.
    truncating: Option<usize>,
    /// Whether any row has a per-entry step (soft-cap, bias, mask, penalties): without one the
    /// fused tiles are launched without processing.
    per_entry: bool,
    /// [`Selection::bit`]s of the selections some row needs.
    selections: u32,
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

/// What a processed call writes on the device: `[B, N]` tokens and, when asked for, their raw
/// and processed log-probabilities and each row's top raw log-probabilities.
pub struct ProcessedOutputs {
    pub tokens: DeviceTokens,
    /// The log-probabilities, then the top log-probabilities, in the layouts of
    /// [`ProcessedTarget::Tokens`](crate::ProcessedTarget::Tokens).
    logprobs: Option<DeviceBuffer<f32>>,
}

impl ProcessedOutputs {
    /// The device addresses of the log-probabilities and the top log-probabilities (0 for
    /// none).
    fn logprobs_addresses(&self) -> (u64, u64) {
        let Some(values) = &self.logprobs else { return (0, 0) };
        let at = values.ptr().address();
        (at, at + ProcessedRequest::logprobs_bytes(self.tokens.rows, self.tokens.samples) as u64)
    }
}

/// A vocabulary shard: the LM head's rows are the tokens `vocab_offset ..` of a vocabulary of
/// `vocab` tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VocabShard {
    /// A multiple of 4 (a Philox block of the global vocabulary).
    pub vocab_offset: usize,
    pub vocab: usize,
}

impl VocabShard {
    /// The bounds of `shards` shards of a vocabulary of `vocab` tokens: shard `s` holds the
    /// tokens `bounds[s] .. bounds[s + 1]`, whole blocks of 4 (the Philox block) but for the
    /// last, as even as blocks allow; at most `⌈vocab / 4⌉` shards.
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
}

/// The stage-1 outputs of `shards` vocabulary shards side by side in one device buffer, one
/// part of [`ShardParts::part_bytes`] per shard: `[B, N]` winners with their tokens' logits,
/// then, with log-probabilities, `[B]` log-sum-exp terms and `[B, MAX_TOP_LOGPROBS]` top raw
/// entries (`flashsample_core::abi::ShardPartLayout`). A collective that gathers every
/// device's part into this layout hands the merge what it needs: a few bytes per row, never
/// logits.
pub struct ShardParts {
    buffer: DeviceBuffer<u8>,
    shards: usize,
    rows: usize,
    samples: usize,
    logprobs: bool,
    layout: ShardPartLayout,
}

impl ShardParts {
    pub fn shards(&self) -> usize {
        self.shards
    }

    /// Refuses parts without room for `[rows, samples]` draws, naming `parts`.
    fn check_room(&self, rows: usize, samples: u32) -> Result<()> {
        if (self.rows, self.samples) != (rows, samples as usize) {
            return Err(invalid(
                "parts",
                format!("room for [{}, {}] draws, the request makes [{rows}, {samples}]", self.rows, self.samples),
            ));
        }
        Ok(())
    }

    /// Bytes of one shard's part.
    pub fn part_bytes(&self) -> usize {
        self.layout.bytes as usize
    }

    /// The device address of part 0 (part `s` starts `s · part_bytes` after it).
    pub fn address(&self) -> u64 {
        self.buffer.ptr().address()
    }

    /// The device address of shard `s`'s part.
    pub fn part_address(&self, s: usize) -> Result<u64> {
        if s >= self.shards {
            return Err(invalid("part", format!("{s}: the parts hold {} shards", self.shards)));
        }
        Ok(self.address() + (s * self.part_bytes()) as u64)
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

/// What a request needs to know of a batch's processing (whose sparse lists are `sparse`) in
/// device memory at `address`.
pub(crate) fn summarize(
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
    }
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
        let summary = summarize(processing, &sparse, vocab, 0);
        let ProcessingRef { rows, whole_row, truncating, per_entry, selections, .. } = summary;
        Ok(DeviceProcessing { buffer, rows, vocab, whole_row, truncating, per_entry, selections })
    }

    /// The per-entry processing the fused tiles apply
    /// ([`SampleRequest::processing`](crate::SampleRequest::processing) in borrowed mode, CUDA
    /// graphs included); refused when a row has min-p, top-k, top-p or top log-probabilities,
    /// which need the whole row first.
    pub fn fused(&self) -> Result<FusedProcessing> {
        self.on_device().fused()
    }

    /// Every mode of the batch's processing as a processed request names it
    /// ([`ProcessedRequest::processing`](crate::ProcessedRequest::processing), borrowed mode and
    /// CUDA graphs included).
    pub fn on_device(&self) -> ProcessingRef {
        ProcessingRef {
            address: self.buffer.ptr().address(),
            rows: self.rows,
            vocab: self.vocab,
            whole_row: self.whole_row,
            truncating: self.truncating,
            per_entry: self.per_entry,
            selections: self.selections,
        }
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
        let len = (ProcessedRequest::logprobs_bytes(rows, samples) + ProcessedRequest::top_logprobs_bytes(rows)) / 4;
        let logprobs = match logprobs {
            // SAFETY: the kernels write every value before it is read.
            true => Some(unsafe { DeviceBuffer::<f32>::uninitialized(&self.stream, len, "log-probabilities")? }),
            false => None,
        };
        Ok(ProcessedOutputs { tokens, logprobs })
    }

    /// Room for the stage-1 outputs of `shards` vocabulary shards of `rows × samples` draws,
    /// with the log-sum-exp terms and top entries of log-probabilities if `logprobs`.
    pub fn shard_parts(&self, shards: usize, rows: usize, samples: usize, logprobs: bool) -> Result<ShardParts> {
        let layout = shard_layout(shards, rows, samples, logprobs)?;
        self.make_current()?;
        // SAFETY: stage 1 writes every part's winners (and terms) before the merge reads them.
        let buffer =
            unsafe { DeviceBuffer::<u8>::uninitialized(&self.stream, shards * layout.bytes as usize, "shard parts")? };
        Ok(ShardParts { buffer, shards, rows, samples, logprobs, layout })
    }

    /// Fills `parts` with +∞ words, so that a part stage 1 leaves unwritten shows in the tokens
    /// (a winner whose index is no token) and log-probabilities: tests call this first.
    pub fn poison_parts(&self, parts: &ShardParts) -> Result<()> {
        self.make_current()?;
        // SAFETY: the buffer holds `shards · part_bytes` bytes (a multiple of 16) on our stream.
        unsafe { self.poison_words("poison shard parts", parts.buffer.ptr().cast(), parts.buffer.len() / 4) }
    }

    /// The draws `draws` of each row of `hidden` with the row's [`Processing`] and
    /// log-probabilities, returned to the host: what
    /// [`CpuSampler::sample_processed`](crate::CpuSampler::sample_processed) draws, with the
    /// same processing order, keep rule, noise and statuses (see
    /// [`CudaSampler::sample_processed_into`], which it runs: the whole vocabulary in one call,
    /// so truncating rows decide their cuts without the shards' exchange).
    pub fn sample_processed(
        &self,
        lm_head: &CudaLmHead,
        hidden: &Matrix,
        params: &[SamplingParams],
        processing: &[Processing],
        draws: Draws,
    ) -> Result<Sampled> {
        let shapes = std::iter::once(lm_head.shape);
        let (head, _, draws, _) = check_sharded_request(shapes, hidden.shape(), params, processing.len(), draws)?;
        let device_processing = self.upload_processing(processing, head.vocab)?;
        let hidden = self.upload_hidden(hidden)?;
        let rows = self.upload_rows(params)?;
        let mut out = self.processed_outputs(params.len(), draws.count as usize, true)?;
        self.sample_processed_into(lm_head, &hidden, &rows, &device_processing, draws, Variant::Auto, &mut out)?;
        self.processed_to_host(&out)
    }

    /// As [`CudaSampler::sample_processed`] over an LM head split by vocabulary into `shards`
    /// on this device (shard `s` holds the rows after those of shards `0 .. s`; every shard but
    /// the last a multiple of 4 rows): each shard runs stage 1 with its global offset (the
    /// shards decide min-p, top-k and top-p together, [`CudaSampler::sample_shards_into`]),
    /// the shard merge gives the unsharded tokens (identical) and log-probabilities (equal up
    /// to the order of the log-sum-exp sums).
    pub fn sample_sharded(
        &self,
        shards: &[CudaLmHead],
        hidden: &Matrix,
        params: &[SamplingParams],
        processing: &[Processing],
        draws: Draws,
    ) -> Result<Sampled> {
        let (head, offsets, draws, _) = check_sharded_request(
            shards.iter().map(|shard| shard.shape),
            hidden.shape(),
            params,
            processing.len(),
            draws,
        )?;
        let vocab = head.vocab;
        let device_processing = self.upload_processing(processing, vocab)?;
        let hidden = self.upload_hidden(hidden)?;
        let rows = self.upload_rows(params)?;
        let mut parts = self.shard_parts(shards.len(), params.len(), draws.count as usize, true)?;
        let heads: Vec<(&CudaLmHead, VocabShard)> = shards
            .iter()
            .zip(&offsets)
            .map(|(shard, &vocab_offset)| (shard, VocabShard { vocab_offset, vocab }))
            .collect();
        let processing = &device_processing;
        self.sample_shards_into(&heads, &hidden, &rows, processing, draws, Variant::Auto, &mut parts)?;
        let mut out = self.processed_outputs(params.len(), draws.count as usize, true)?;
        self.merge_shards_into(&parts, &rows, &device_processing, &mut out)?;
        self.processed_to_host(&out)
    }

    /// Queues processed sampling into `out` (`[B, draws.count]`) with the tile of `variant`:
    /// the owned form of [`StreamSampler::sample_processed`](crate::StreamSampler::sample_processed).
    /// Unless a row needs its whole row (soft-cap, bias, mask and penalties only, with or
    /// without log-probabilities) the fused tile applies the steps to each logits tile on chip:
    /// no logits in memory. Otherwise the logits are materialised in the workspace (`B · V`
    /// floats; twice that when log-probabilities keep the raw logits beside the processed
    /// ones), which needs a BF16 or F16 head with `D % 8 == 0`. Both give the same tokens for
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
        check_outputs(out, hidden.rows(), draws.count)?;
        let (logprobs, top_logprobs) = out.logprobs_addresses();
        let target = ProcessedTarget::Tokens { tokens: out.tokens.address(), logprobs, top_logprobs };
        let request = ProcessedRequest {
            variant,
            ..ProcessedRequest::on_buffers(lm_head, hidden, rows, processing, draws, target)
        };
        // SAFETY: every address comes from a live buffer of this sampler holding the request's
        // extents (checked above and by the plan).
        unsafe { self.enqueue_processed(lm_head, hidden, &request) }
    }

    /// Stage 1 over a vocabulary shard `lm_head` at `shard`: queues the draws `draws` of each
    /// row of `hidden` with the rows' processing (made for the whole vocabulary) into part
    /// `part` of `parts`. Fused (soft-cap, bias, mask, penalties in the tile) when no row needs
    /// its whole row; materialised otherwise (BF16 or F16 with `D % 8 == 0`). min-p, top-k and top-p need the whole vocabulary in the shard (their
    /// keep rule is a property of the whole row): shards of one device decide them together in
    /// [`CudaSampler::sample_shards_into`]. Never waits for the device.
    #[allow(clippy::too_many_arguments)]
    pub fn sample_shard_into(
        &self,
        lm_head: &CudaLmHead,
        shard: VocabShard,
        hidden: &CudaHidden,
        rows: &DeviceRows,
        processing: &DeviceProcessing,
        draws: Draws,
        variant: Variant,
        parts: &mut ShardParts,
        part: usize,
    ) -> Result<()> {
        let draws = draws.check()?;
        self.check_device_rows(lm_head, hidden, rows, draws.count)?;
        parts.check_room(hidden.rows(), draws.count)?;
        let target = ProcessedTarget::Shard {
            vocab_offset: shard.vocab_offset,
            vocab: shard.vocab,
            part: parts.part_address(part)?,
            logprobs: parts.logprobs,
            exchange: 0,
        };
        let request = ProcessedRequest {
            variant,
            ..ProcessedRequest::on_buffers(lm_head, hidden, rows, processing, draws, target)
        };
        // SAFETY: every address comes from a live buffer of this sampler holding the request's
        // extents (the part checked above, the rest by the plan).
        unsafe { self.enqueue_processed(lm_head, hidden, &request) }
    }

    /// Stage 1 over the vocabulary shards `heads` of one LM head on this device, shard `s`
    /// into part `s` of `parts`, as [`CudaSampler::sample_shard_into`] for each, but for the
    /// truncations: the shards run segment by segment and share one exchange buffer, into
    /// which their processing kernels merge each row's largest logit and histograms, so that
    /// every shard decides min-p, top-k and top-p over the whole row, as the unsharded call
    /// does. The shards together need not cover the vocabulary, but rows that truncate draw
    /// from the shards given only. Never waits for the device.
    #[allow(clippy::too_many_arguments)]
    pub fn sample_shards_into(
        &self,
        heads: &[(&CudaLmHead, VocabShard)],
        hidden: &CudaHidden,
        rows: &DeviceRows,
        processing: &DeviceProcessing,
        draws: Draws,
        variant: Variant,
        parts: &mut ShardParts,
    ) -> Result<()> {
        let heads: Vec<ShardHead> =
            heads.iter().enumerate().map(|(part, &(head, shard))| ShardHead { head, shard, part }).collect();
        let stage = ShardsStage { heads: &heads, hidden, rows, processing, draws, variant, parts };
        let planned = self.plan_shards(&stage)?;
        // One device, one exchange buffer: nothing is left to reduce between the segments.
        for segment in 0..planned.segments {
            self.queue_shards_segment(&planned, segment)?;
        }
        Ok(())
    }

    /// Checks and plans `stage`: each shard's request and its part of the scratch (grown here,
    /// so that the segments only queue), the exchange buffer they share when a row truncates.
    pub(crate) fn plan_shards<'a>(&self, stage: &ShardsStage<'a>) -> Result<PlannedShards<'a>> {
        let ShardsStage { heads, hidden, rows, processing, variant, parts, .. } = *stage;
        let draws = stage.draws.check()?;
        if heads.is_empty() {
            return Err(invalid("heads", "no shard: give at least one"));
        }
        parts.check_room(hidden.rows(), draws.count)?;
        let on_device = processing.on_device();
        let exchange_bytes = StreamSampler::shard_exchange_bytes(&on_device);
        let exchange = match on_device.truncates() {
            true => ensure(&self.stream, &mut self.workspace.borrow_mut().exchange, exchange_bytes, "shard exchange")?
                .address(),
            false => 0,
        };
        let mut shards = Vec::with_capacity(heads.len());
        let mut workspace_bytes = 0;
        for &ShardHead { head, shard, part } in heads {
            self.check_device_rows(head, hidden, rows, draws.count)?;
            let target = ProcessedTarget::Shard {
                vocab_offset: shard.vocab_offset,
                vocab: shard.vocab,
                part: parts.part_address(part)?,
                logprobs: parts.logprobs,
                exchange,
            };
            let request = ProcessedRequest {
                variant,
                ..ProcessedRequest::on_buffers(head, hidden, rows, processing, draws, target)
            };
            let plan = self.kernels().plan_processed(&request)?;
            let maps = resident_maps(head, hidden, plan.variant())?;
            // Each shard's scratch starts on a 256-byte boundary, as an allocation does.
            let at = workspace_bytes;
            workspace_bytes = (at + plan.workspace_bytes()).next_multiple_of(256);
            let workspace = DeviceWorkspace { address: at as u64, bytes: plan.workspace_bytes() };
            shards.push(PlannedShard { request, plan, maps, workspace });
        }
        let segments = shards[0].plan.segments();
        if let Some(s) = shards.iter().position(|shard| shard.plan.segments() != segments) {
            return Err(invalid(
                format!("heads[{s}]"),
                "its stage 1 runs in other segments than shard 0's: the shards must share B, draws and processing",
            ));
        }
        let scratch = self.scratch(workspace_bytes)?;
        for shard in &mut shards {
            shard.workspace.address += scratch.address;
        }
        Ok(PlannedShards { shards, exchange, exchange_bytes, segments, _buffers: std::marker::PhantomData })
    }

    /// Queues segment `segment` of `planned` (every shard's, in order) and returns the
    /// reduction that ends it, over this sampler's exchange buffer, or `None` after the last
    /// segment (see [`StreamSampler::sample_processed_segment`]). Segment 0 clears the
    /// exchange buffer first. Nothing else may use this sampler's scratch between the plan
    /// and the last segment.
    pub(crate) fn queue_shards_segment(
        &self,
        planned: &PlannedShards,
        segment: usize,
    ) -> Result<Option<ShardReduction>> {
        self.make_current()?;
        if segment == 0 && planned.exchange != 0 {
            // SAFETY: the exchange buffer holds `exchange_bytes` (a multiple of 16) on our stream.
            unsafe {
                driver::fill_words_async(
                    "shard exchange",
                    DevicePtr::new(planned.exchange),
                    0,
                    planned.exchange_bytes / 4,
                    self.stream.cu_stream(),
                )?
            };
        }
        let mut reduction = None;
        for PlannedShard { request, plan, maps, workspace } in &planned.shards {
            // SAFETY: every address comes from a live buffer of this sampler holding the
            // request's extents (checked by the plan); each shard has its own part of the
            // scratch, untouched by other calls until the last segment; the shards share the
            // exchange buffer, cleared above before segment 0; the resident maps live as long
            // as the buffers.
            reduction = unsafe {
                self.kernels().enqueue_processed_segment(
                    self.stream.cu_stream(),
                    request,
                    plan,
                    *maps,
                    *workspace,
                    segment,
                )?
            };
        }
        Ok(reduction)
    }

    /// Stage 2, the shard merge: queues the tokens of every (row, draw) from all parts of
    /// `parts` into `out`, with their log-probabilities when both have them (`processing` gives
    /// each row's count of top log-probabilities). Never waits for the device.
    pub fn merge_shards_into(
        &self,
        parts: &ShardParts,
        rows: &DeviceRows,
        processing: &DeviceProcessing,
        out: &mut ProcessedOutputs,
    ) -> Result<()> {
        self.make_current()?;
        check_outputs(out, parts.rows, parts.samples as u32)?;
        if rows.rows() != parts.rows {
            return Err(invalid("rows", format!("{} row parameters for parts of B = {}", rows.rows(), parts.rows)));
        }
        let request = ShardMergeRequest {
            parts: parts.address(),
            shards: parts.shards,
            rows: parts.rows,
            samples: parts.samples as u32,
            logprobs: parts.logprobs,
            row_params: rows.address(),
            processing: processing.on_device(),
            tokens: out.tokens.address(),
            out_logprobs: out.logprobs_addresses().0,
            out_top_logprobs: out.logprobs_addresses().1,
        };
        // SAFETY: the parts, rows, processing and outputs are live buffers of this sampler on
        // its stream, with the extents the request names (checked by the merge).
        unsafe { self.kernels().merge_shards(self.stream.cu_stream().cast(), &request) }
    }

    /// Waits for a processed call and copies its tokens and log-probabilities (empty if `out`
    /// has none) to the host; rows without a token keep their sentinels
    /// ([`Sampled::rows_without_token`]).
    pub fn processed_to_host(&self, out: &ProcessedOutputs) -> Result<Sampled> {
        self.make_current()?;
        self.synchronize("processed sampling")?;
        let tokens = out.tokens.buffer.to_host(&self.stream, "tokens")?;
        let values = match &out.logprobs {
            Some(values) => values.to_host(&self.stream, "log-probabilities")?,
            None => return Sampled::from_processed_outputs(out.tokens.samples, tokens, None, None),
        };
        let (logprobs, top) =
            values.split_at(ProcessedRequest::logprobs_bytes(out.tokens.rows, out.tokens.samples) / 4);
        let top: Vec<u32> = top.iter().map(|v| v.to_bits()).collect();
        Sampled::from_processed_outputs(out.tokens.samples, tokens, Some(logprobs), Some(&top))
    }
}

/// One vocabulary shard of a stage 1 on one device: its head, its place in the vocabulary and
/// its part of the call's [`ShardParts`].
#[derive(Clone, Copy)]
pub(crate) struct ShardHead<'a> {
    pub head: &'a CudaLmHead,
    pub shard: VocabShard,
    pub part: usize,
}

/// A stage 1 of one or more vocabulary shards on one device that runs segment by segment
/// ([`CudaSampler::plan_shards`]): the shards and what they share.
#[derive(Clone, Copy)]
pub(crate) struct ShardsStage<'a> {
    pub heads: &'a [ShardHead<'a>],
    pub hidden: &'a CudaHidden,
    pub rows: &'a DeviceRows,
    pub processing: &'a DeviceProcessing,
    pub draws: Draws,
    pub variant: Variant,
    pub parts: &'a ShardParts,
}

/// One shard of [`PlannedShards`]: its request, plan, tensor maps and part of the scratch.
pub(crate) struct PlannedShard {
    request: ProcessedRequest,
    plan: ProcessedPlan,
    maps: TensorMaps,
    workspace: DeviceWorkspace,
}

/// A [`ShardsStage`] checked and planned once for all its segments
/// ([`CudaSampler::queue_shards_segment`]).
pub(crate) struct PlannedShards<'a> {
    shards: Vec<PlannedShard>,
    /// The shared exchange buffer (0 when no row truncates) and its bytes.
    exchange: u64,
    exchange_bytes: usize,
    pub segments: usize,
    /// The requests name the stage's buffers: the plan may not outlive them.
    _buffers: std::marker::PhantomData<&'a CudaLmHead>,
}

/// The part layout of `shards` parts of `rows × samples` draws, checked against 32-bit extents.
fn shard_layout(shards: usize, rows: usize, samples: usize, logprobs: bool) -> Result<ShardPartLayout> {
    if shards == 0 || shards > u32::MAX as usize {
        return Err(invalid("shards", format!("{shards}: must be at least 1 and below 2^32")));
    }
    let (Ok(batch), Ok(draws)) = (u32::try_from(rows), u32::try_from(samples)) else {
        return Err(invalid("samples", format!("B x samples = {rows} x {samples}: must be < 2^32 each")));
    };
    if rows.checked_mul(samples).is_none_or(|n| n > u32::MAX as usize) {
        return Err(invalid("samples", format!("B x samples = {rows} x {samples} tokens: must be < 2^32")));
    }
    Ok(ShardPartLayout::of(batch, draws, logprobs))
}

fn check_outputs(out: &ProcessedOutputs, batch: usize, samples: u32) -> Result<()> {
    if out.tokens.rows != batch || out.tokens.samples != samples as usize {
        return Err(invalid(
            "out",
            format!(
                "room for [{}, {}] draws, the request makes [{batch}, {samples}]",
                out.tokens.rows, out.tokens.samples
            ),
        ));
    }
    Ok(())
}

impl ProcessedRequest {
    /// The request of `draws` of every row of `hidden` from `lm_head` with the rows' parameters
    /// and processing in device buffers of this library, with the dispatcher's tile, into
    /// `target` (a borrowed-mode call may take buffers the owned sampler made).
    pub fn on_buffers(
        lm_head: &CudaLmHead,
        hidden: &CudaHidden,
        rows: &DeviceRows,
        processing: &DeviceProcessing,
        draws: Draws,
        target: ProcessedTarget,
    ) -> ProcessedRequest {
        ProcessedRequest {
            lm_head: lm_head.matrix(),
            hidden: hidden.matrix(),
            row_params: rows.address(),
            draws,
            variant: Variant::Auto,
            processing: processing.on_device(),
            target,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
