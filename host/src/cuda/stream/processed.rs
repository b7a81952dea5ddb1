//! Processed sampling through [`StreamSampler`]: every processing mode, log-probabilities and
//! vocabulary shards on a stream and workspace the caller gives, by one of two paths with the
//! same tokens for the same logits:
//! - fused: rows with per-entry steps only (soft-cap, bias, mask, penalties) go through the
//!   tile kernels of plain sampling, which apply the steps to each logits quad; with
//!   log-probabilities the tiles also write each (row, tile)'s log-sum-exp terms, the merge
//!   kernel merges them per row beside the winners, and `winner_logits` recomputes the winners'
//!   logits (the tiles keep none): stage 1 of a shard ends there; for an unsharded call it
//!   also writes the tokens and log-probabilities, as the shard merge of its one part would;
//! - materialised, for rows that need their whole row (min-p, top-k, top-p, top entries): the
//!   unfused GEMM writes the logits into the workspace (`[B, V]` f32, twice with
//!   log-probabilities: raw and processed), the processing pipeline (`process_rows` launches
//!   over slices of the rows) processes them, and the logits sampler and the merge kernel draw
//!   from them with the plain path's noise; stage 1 of a shard ends
//!   there (its winners, log-sum-exp terms and top raw entries in its part), the unsharded call
//!   goes on to the shard merge of its one part.
//!
//! The truncations of a row split over vocabulary shards are decided by the shards together:
//! such a call runs in segments ([`StreamSampler::sample_processed_segment`]), between which
//! the shards reduce what their processing kernels merged into their exchange buffers (each
//! row's largest logit, then per digit of each selection the row's histogram). Every shard
//! then picks the same digits, and applies the same keep rule as the unsharded row.

use std::ffi::c_void;

use cudarc::driver::sys;
use flashsample_core::abi::{
    DevicePtr, LOGITS_SAMPLER_TILE, LogitsArgs, LogitsSamplerArgs, PROCESS_THREADS, ProcessArgs, ProcessRowState,
    ProcessStep, RawTop, RowProcessing, RowSums, SELECT_BUCKETS, SELECT_DIGITS, Selection, ShardExchangeLayout,
    ShardMergeArgs, ShardPartLayout, ShardWinner, TmaArgs, TopLogprob, WinnerLogitsArgs,
};
use flashsample_core::process::MAX_TOP_LOGPROBS;
use flashsample_core::registry::Kernel;
use flashsample_core::{Candidate, NO_TOKEN, RowParams};

use super::{
    CallPlan, DeviceMatrix, DeviceWorkspace, ReduceTarget, SampleRequest, ShardTarget, StreamSampler, TensorMaps,
    WORKSPACE_MAPS_BYTES, WinnerTarget, check_address, check_request, check_shard,
};
use crate::cpu::Sampled;
use crate::cuda::dispatch::{Variant, element_type};
use crate::cuda::driver;
use crate::cuda::passes::{CANDIDATE_BUDGET_BYTES, Plan};
use crate::error::{Result, invalid};
use crate::params::Draws;

/// A batch's processing in device memory as a request names it (every mode): made by
/// [`crate::DeviceProcessing::on_device`], whose memory it names; keep that alive until the
/// stream has run the call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProcessingRef {
    /// `[rows]` [`RowProcessing`] blocks, then what they point to.
    pub(crate) address: u64,
    pub(crate) rows: usize,
    pub(crate) vocab: usize,
    /// The first row that needs its whole row (min-p, top-k, top-p or top log-probabilities).
    pub(crate) whole_row: Option<usize>,
    /// The first row with min-p, top-k or top-p.
    pub(crate) truncating: Option<usize>,
    /// Whether a row has a per-entry step (soft-cap, bias, mask, penalties).
    pub(crate) per_entry: bool,
    /// [`Selection::bit`]s of the selections some row needs.
    pub(crate) selections: u32,
}

impl ProcessingRef {
    /// Whether a row has min-p, top-k or top-p.
    pub(crate) fn truncates(&self) -> bool {
        self.truncating.is_some()
    }

    /// Whether a row asks for its top raw log-probabilities.
    fn top_logprobs(&self) -> bool {
        self.selections & Selection::TopRaw.bit() != 0
    }

    fn blocks(&self) -> DevicePtr<RowProcessing> {
        DevicePtr::new(self.address)
    }

    /// The per-entry processing the fused tiles apply; refused when a row needs its whole row.
    pub(crate) fn fused(&self) -> Result<super::FusedProcessing> {
        if let Some(row) = self.whole_row {
            return Err(invalid(
                format!("processing[{row}]"),
                "min-p, top-k, top-p and top log-probabilities need the whole row: the fused tiles apply soft-cap, bias, mask and penalties only",
            ));
        }
        Ok(super::FusedProcessing { address: self.address, rows: self.rows, vocab: self.vocab })
    }

    /// The blocks the fused tiles and the winners' logits apply, or null when no row has a
    /// per-entry step.
    fn per_entry_blocks(&self) -> DevicePtr<RowProcessing> {
        if self.per_entry { self.blocks() } else { DevicePtr::NULL }
    }
}

/// Where a processed call writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProcessedTarget {
    /// `[B, draws.count]` u32 tokens (rows without a token hold their status's sentinel, as
    /// [`SampleRequest::tokens`]) and, unless `logprobs` is 0, the tokens' log-probabilities
    /// at `logprobs` (4-byte aligned, [`ProcessedRequest::logprobs_bytes`]): `[B, N]` f32 under
    /// the raw logits, then `[B, N]` f32 under the distribution drawn from; and, unless
    /// `top_logprobs` is 0 (it may be only when no row asks for top entries), `[B,
    /// MAX_TOP_LOGPROBS]` [`TopLogprob`] at `top_logprobs` (4-byte aligned,
    /// [`ProcessedRequest::top_logprobs_bytes`]): each row's top raw entries by decreasing
    /// log-probability, as many as its processing asks for, the rest `NO_TOKEN`. Top entries
    /// need `logprobs`.
    Tokens { tokens: u64, logprobs: u64, top_logprobs: u64 },
    /// `W` is a vocabulary shard, its row `r` the token `vocab_offset + r` of a vocabulary of
    /// `vocab`: the call writes the shard's part for the shard merge at `part` (16-byte
    /// aligned, `ShardPartLayout::of(B, N, logprobs).bytes`). A shard that is not the whole
    /// vocabulary takes rows with min-p, top-k or top-p only with an `exchange` buffer (16-byte
    /// aligned, [`StreamSampler::shard_exchange_bytes`], zeroed before the call; 0 for none):
    /// the call then runs in segments ([`StreamSampler::sample_processed_segment`]).
    Shard { vocab_offset: usize, vocab: usize, part: u64, logprobs: bool, exchange: u64 },
}

/// What the vocabulary shards of a call reduce between two of its segments, each shard over
/// the same words of its own exchange buffer, in place, every shard receiving the result (an
/// all-reduce). Shards on one device may share one exchange buffer: their kernels merge into
/// it atomically, and there is nothing left to reduce.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShardReduction {
    /// The maximum over the shards of `count` `u32` words at `address`.
    MaxU32 { address: u64, count: usize },
    /// The sum over the shards of `count` `u64` words at `address` (no sum overflows).
    SumU64 { address: u64, count: usize },
}

/// One processed sampling call in device memory: `draws` of each row of `H` from the row's
/// processed distribution (soft-cap → bias → mask → penalties → temperature → min-p → top-k
/// → top-p), with log-probabilities when the target has room for them.
#[derive(Clone, Copy, Debug)]
pub struct ProcessedRequest {
    /// `W[V, D]` (a shard's rows with [`ProcessedTarget::Shard`]).
    pub lm_head: DeviceMatrix,
    /// `H[B, D]`, the same dtype as `W`.
    pub hidden: DeviceMatrix,
    /// `[B]` row parameters ([`RowParams`], 8-byte aligned).
    pub row_params: u64,
    pub draws: Draws,
    pub variant: Variant,
    /// `[B]` rows' processing for the whole vocabulary.
    pub processing: ProcessingRef,
    pub target: ProcessedTarget,
}

impl ProcessedRequest {
    /// Bytes of the log-probabilities of `rows × samples` draws ([`ProcessedTarget::Tokens`]).
    pub fn logprobs_bytes(rows: usize, samples: usize) -> usize {
        2 * rows * samples * size_of::<f32>()
    }

    /// Bytes of the top log-probabilities of `rows` rows ([`ProcessedTarget::Tokens`]).
    pub fn top_logprobs_bytes(rows: usize) -> usize {
        rows * MAX_TOP_LOGPROBS as usize * size_of::<TopLogprob>()
    }

    fn logprobs(&self) -> bool {
        match self.target {
            ProcessedTarget::Tokens { logprobs, .. } => logprobs != 0,
            ProcessedTarget::Shard { logprobs, .. } => logprobs,
        }
    }

    /// `W`'s row 0 as a global index, where the call's part lies (the shard's, or `own_part`
    /// in the workspace for an unsharded call) and its layout.
    fn part(&self, own_part: DevicePtr<u8>) -> (u32, DevicePtr<u8>, ShardPartLayout) {
        let layout = ShardPartLayout::of(self.hidden.rows as u32, self.draws.count, self.logprobs());
        match self.target {
            ProcessedTarget::Tokens { .. } => (0, own_part, layout),
            ProcessedTarget::Shard { vocab_offset, part, .. } => (vocab_offset as u32, DevicePtr::new(part), layout),
        }
    }

    /// The vocabulary the processing and the noise are keyed over.
    fn vocab(&self) -> usize {
        match self.target {
            ProcessedTarget::Tokens { .. } => self.lm_head.rows,
            ProcessedTarget::Shard { vocab, .. } => vocab,
        }
    }

    /// The request without processing, writing tokens to `tokens`.
    fn plain(&self, tokens: u64) -> SampleRequest {
        SampleRequest {
            lm_head: self.lm_head,
            hidden: self.hidden,
            row_params: self.row_params,
            tokens,
            draws: self.draws,
            variant: self.variant,
            processing: None,
            shard: None,
        }
    }

    /// The request's fused form, when no row needs its whole row: the tile kernels apply the
    /// per-entry steps (and, with log-probabilities, sum each tile's terms).
    fn fused(&self) -> Option<SampleRequest> {
        if self.processing.whole_row.is_some() {
            return None;
        }
        let processing = match self.processing.per_entry {
            true => Some(self.processing.fused().ok()?),
            false => None,
        };
        let (tokens, shard) = match self.target {
            ProcessedTarget::Tokens { tokens, .. } => (tokens, None),
            ProcessedTarget::Shard { vocab_offset, vocab, part, .. } => {
                (0, Some(ShardTarget { vocab_offset, vocab, winners: part }))
            }
        };
        Some(SampleRequest { processing, shard, ..self.plain(tokens) })
    }
}

impl Sampled {
    /// A processed call's outputs read back to the host: `[B, draws]` `tokens` and, if the
    /// call had them, its log-probabilities (`[B, draws]` raw, then `[B, draws]` processed) and
    /// top log-probabilities as words (`[B, MAX_TOP_LOGPROBS]` pairs of a token and its
    /// log-probability's bits): the layouts of [`ProcessedTarget::Tokens`]. Rows without a
    /// token keep their sentinels ([`Sampled::rows_without_token`]).
    pub fn from_processed_outputs(
        draws: usize,
        tokens: Vec<u32>,
        logprobs: Option<&[f32]>,
        top_logprobs: Option<&[u32]>,
    ) -> Result<Sampled> {
        let (slots, rows) = (tokens.len(), tokens.len().checked_div(draws).unwrap_or(0));
        let mut sampled = Sampled {
            draws,
            tokens,
            logprobs: Vec::new(),
            processed_logprobs: Vec::new(),
            top_logprobs: vec![Vec::new(); rows],
        };
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

/// The shard merge in device memory: the parts of `shards` vocabulary shards, side by side
/// from `parts` (each `ShardPartLayout::of(B, N, logprobs).bytes`, written by stage 1 or
/// gathered from other devices), become tokens and, unless `out_logprobs` is 0, their
/// log-probabilities, with top log-probabilities unless `out_top_logprobs` is 0 (the layouts
/// of [`ProcessedTarget::Tokens`]).
#[derive(Clone, Copy, Debug)]
pub struct ShardMergeRequest {
    pub parts: u64,
    pub shards: usize,
    /// B.
    pub rows: usize,
    /// N, the draws per row.
    pub samples: u32,
    /// Whether the parts hold log-sum-exp terms and top entries.
    pub logprobs: bool,
    /// `[B]` row parameters, as in stage 1.
    pub row_params: u64,
    pub processing: ProcessingRef,
    /// `tokens`, `logprobs` and `top_logprobs` of [`ProcessedTarget::Tokens`].
    pub tokens: u64,
    pub out_logprobs: u64,
    pub out_top_logprobs: u64,
}

/// A materialised call's launch plan and where its scratch lies in the workspace (byte
/// offsets; the tensor maps first).
#[derive(Clone, Copy, Debug)]
pub(crate) struct MaterialisedPlan {
    pub variant: Variant,
    /// Row stride of the logits (V rounded up to a quad).
    stride: usize,
    /// The logits sampler's tiles and passes.
    tiles: usize,
    passes: Plan,
    /// Copies of the logits: 2 when the processing pipeline writes processed logits beside raw
    /// ones that log-probabilities still need.
    copies: usize,
    /// The processing pipeline's slices per row, when it runs (a row needs its whole row).
    process_slices: Option<usize>,
    /// Log-sum-exp terms per row with log-probabilities: the processing pipeline's slices.
    sum_parts: usize,
    logits_at: usize,
    part_sums_at: usize,
    /// The processing pipeline's `[B]` row states.
    states_at: usize,
    /// A shard's exchange with the other shards (in the target's buffer), when its rows
    /// truncate.
    exchange: Option<ShardExchangeLayout>,
    /// The unsharded call's one part.
    part_at: usize,
    pub workspace_bytes: usize,
}

/// What a fused call with log-probabilities adds to its tiles' workspace (byte offsets after
/// the candidates): each (row, tile)'s log-sum-exp terms, and the unsharded call's one part,
/// which the shard merge turns into tokens and log-probabilities.
#[derive(Clone, Copy, Debug)]
pub(crate) struct FusedSums {
    tile_sums_at: usize,
    part_at: usize,
    workspace_bytes: usize,
}

impl FusedSums {
    fn new(plan: &CallPlan, batch: usize, samples: u32, own_part: bool) -> FusedSums {
        let tile_sums_at = align(plan.workspace_bytes);
        let part_at = align(tile_sums_at + batch * plan.tiles * size_of::<RowSums>());
        let part = match own_part {
            true => ShardPartLayout::of(batch as u32, samples, true).bytes as usize,
            false => 0,
        };
        FusedSums { tile_sums_at, part_at, workspace_bytes: part_at + part }
    }
}

/// A processed request's plan: the fused tiles' (with their terms when the call has
/// log-probabilities) or the materialised pipeline's.
#[derive(Clone, Copy, Debug)]
pub(crate) enum ProcessedPlan {
    Fused(SampleRequest, CallPlan, Option<FusedSums>),
    Materialised(MaterialisedPlan),
}

impl ProcessedPlan {
    pub fn workspace_bytes(&self) -> usize {
        match self {
            ProcessedPlan::Fused(_, plan, sums) => sums.map_or(plan.workspace_bytes, |sums| sums.workspace_bytes),
            ProcessedPlan::Materialised(plan) => plan.workspace_bytes,
        }
    }

    /// The tile variant whose tensor maps the call reads (if TMA).
    pub fn variant(&self) -> Variant {
        match self {
            ProcessedPlan::Fused(_, plan, _) => plan.variant,
            ProcessedPlan::Materialised(plan) => plan.variant,
        }
    }

    /// The call's segments: 1, or with an exchange 2 plus its exchanged digits (the logits
    /// and per-entry steps; then each digit's histograms; then the rest).
    pub fn segments(&self) -> usize {
        match self {
            ProcessedPlan::Materialised(MaterialisedPlan { exchange: Some(exchange), .. }) => {
                2 + exchange.digits as usize
            }
            _ => 1,
        }
    }
}

/// Offsets in a workspace are 64-byte aligned.
fn align(bytes: usize) -> usize {
    bytes.next_multiple_of(64)
}

impl StreamSampler {
    /// Workspace bytes `request` needs (the materialised path: its logits, `B · V` floats or
    /// twice that, plus candidates and terms).
    pub fn processed_workspace_bytes(&self, request: &ProcessedRequest) -> Result<usize> {
        Ok(self.plan_processed(request)?.workspace_bytes())
    }

    /// Bytes of a shard's exchange buffer ([`ProcessedTarget::Shard`]) for `processing`
    /// (`B` rows): the rows' largest logits, and a `[B, 256]` histogram of 8-byte counts per
    /// digit of each truncation some row needs (4 per top-k, 8 for top-p).
    pub fn shard_exchange_bytes(processing: &ProcessingRef) -> usize {
        ShardExchangeLayout::of(processing.rows as u32, processing.selections).bytes as usize
    }

    /// How many segments `request` runs in ([`StreamSampler::sample_processed_segment`]): 1
    /// unless it is a shard with an exchange and a row truncates.
    pub fn processed_segments(&self, request: &ProcessedRequest) -> Result<usize> {
        Ok(self.plan_processed(request)?.segments())
    }

    /// Checks `request` and plans it.
    pub(crate) fn plan_processed(&self, request: &ProcessedRequest) -> Result<ProcessedPlan> {
        let vocab = request.vocab();
        let processing = &request.processing;
        let batch = request.hidden.rows;
        if processing.rows != batch || processing.vocab != vocab {
            return Err(invalid(
                "processing",
                format!(
                    "uploaded for B = {}, V = {}; the request has B = {batch}, V = {vocab}",
                    processing.rows, processing.vocab
                ),
            ));
        }
        let exchange_at = match request.target {
            ProcessedTarget::Shard { exchange, .. } => exchange,
            ProcessedTarget::Tokens { .. } => 0,
        };
        if let Some(row) = processing.truncating
            && request.lm_head.rows != vocab
            && exchange_at == 0
        {
            return Err(invalid(
                format!("processing[{row}]"),
                format!(
                    "min-p, top-k and top-p need the whole vocabulary in one shard (this one holds {} of V = {vocab}) or an exchange with the other shards",
                    request.lm_head.rows
                ),
            ));
        }
        match request.target {
            ProcessedTarget::Tokens { tokens, logprobs, top_logprobs } => {
                check_outputs(tokens, logprobs, top_logprobs, processing.top_logprobs())?
            }
            ProcessedTarget::Shard { part, exchange, .. } => {
                check_address("part", part, 16)?;
                if exchange != 0 {
                    check_address("exchange", exchange, 16)?;
                }
            }
        }
        if let Some(fused) = request.fused() {
            let plan = self.plan_call(&fused)?;
            if !request.logprobs() {
                return Ok(ProcessedPlan::Fused(fused, plan, None));
            }
            if !plan.variant.fused_kernel(fused.lm_head.dtype).writes_tile_sums() {
                return Err(invalid(
                    "variant",
                    format!("{:?} does not sum log-sum-exp terms for log-probabilities; use another", plan.variant),
                ));
            }
            let own_part = matches!(request.target, ProcessedTarget::Tokens { .. });
            let sums = FusedSums::new(&plan, batch, plan.samples, own_part);
            return Ok(ProcessedPlan::Fused(fused, plan, Some(sums)));
        }
        // The materialised path: the shape rules of plain sampling, then its own.
        let output = match request.target {
            ProcessedTarget::Tokens { tokens, .. } => tokens,
            ProcessedTarget::Shard { part, .. } => part,
        };
        let samples = check_request(&request.plain(output))?;
        if let ProcessedTarget::Shard { vocab_offset, vocab, .. } = request.target {
            check_shard(vocab_offset, request.lm_head.rows, vocab)?;
        }
        let (lm_head, hidden) = (&request.lm_head, &request.hidden);
        let variant = self.resolve(lm_head, hidden, request.variant)?;
        if variant.logits_kernel(lm_head.dtype).is_none() {
            return Err(invalid(
                "lm_head",
                format!(
                    "{}, D = {}: min-p, top-k, top-p and top log-probabilities on the GPU need BF16 or F16 with D % 8 == 0",
                    lm_head.dtype, lm_head.cols
                ),
            ));
        }
        let process_slices = match processing.whole_row {
            Some(_) => {
                let kernel = self.loaded().kernel(Kernel::ProcessRows)?;
                let resident = kernel.blocks_per_multiprocessor as usize * self.multiprocessors() as usize;
                Some(process_slices(resident, batch, lm_head.rows))
            }
            None => None,
        };
        let mut plan = materialised_plan(
            variant,
            lm_head.rows,
            batch,
            samples,
            process_slices,
            request.logprobs(),
            matches!(request.target, ProcessedTarget::Tokens { .. }),
        );
        if exchange_at != 0 && processing.truncating.is_some() {
            plan.exchange = Some(ShardExchangeLayout::of(batch as u32, processing.selections));
        }
        Ok(ProcessedPlan::Materialised(plan))
    }

    /// Queues one processed sampling call on the caller's `stream` (see [`ProcessedRequest`]
    /// and [`ProcessedTarget`]); as [`StreamSampler::sample`], nothing is allocated and
    /// nothing waits, so CUDA graphs capture it.
    ///
    /// # Safety
    /// As [`StreamSampler::sample`], with the workspace of
    /// [`StreamSampler::processed_workspace_bytes`]; the processing (the `DeviceProcessing`
    /// behind `request.processing`) and the target's memory hold their extents and stay
    /// allocated until `stream` has run the call.
    pub unsafe fn sample_processed(
        &self,
        stream: *mut c_void,
        request: &ProcessedRequest,
        workspace: DeviceWorkspace,
    ) -> Result<()> {
        let plan = self.plan_processed(request)?;
        // SAFETY: per this function's contract.
        unsafe { self.sample_processed_planned(stream.cast(), request, &plan, workspace) }
    }

    /// Queues segment `segment` of `request` on `stream`, a shard with an exchange (see
    /// [`ProcessedTarget::Shard`]); returns the reduction every shard of the call makes
    /// before its next segment, or `None` after the last ([`StreamSampler::processed_segments`]).
    /// Every shard runs the same segments in order with the same row parameters and
    /// processing; segment `k + 1` of any shard is queued after the reduction of every
    /// shard's segment `k` (on one device sharing one exchange buffer: after every shard's
    /// segment `k`). A request without an exchange has one segment, which is
    /// [`StreamSampler::sample_processed`].
    ///
    /// # Safety
    /// As [`StreamSampler::sample_processed`], the workspace untouched by others between the
    /// segments; the exchange buffer holds [`StreamSampler::shard_exchange_bytes`], zeroed on
    /// `stream` before any shard's segment 0, and stays allocated until the last segment has
    /// run; each reduction completes on `stream` before the next segment runs.
    pub unsafe fn sample_processed_segment(
        &self,
        stream: *mut c_void,
        request: &ProcessedRequest,
        workspace: DeviceWorkspace,
        segment: usize,
    ) -> Result<Option<ShardReduction>> {
        let plan = self.plan_processed(request)?;
        // SAFETY: per this function's contract.
        unsafe {
            driver::in_context(self.context, || {
                self.enqueue_processed_segment(stream.cast(), request, &plan, TensorMaps::Store, workspace, segment)
            })
        }
    }

    /// [`StreamSampler::sample_processed`] of a request already planned by
    /// [`StreamSampler::plan_processed`].
    ///
    /// # Safety
    /// As [`StreamSampler::sample_processed`]; `plan` is `request`'s.
    pub(crate) unsafe fn sample_processed_planned(
        &self,
        stream: sys::CUstream,
        request: &ProcessedRequest,
        plan: &ProcessedPlan,
        workspace: DeviceWorkspace,
    ) -> Result<()> {
        // SAFETY: per this function's contract.
        unsafe {
            driver::in_context(self.context, || {
                self.enqueue_processed(stream, request, plan, TensorMaps::Store, workspace)
            })
        }
    }

    /// Queues the shard merge of `request` on `stream`.
    ///
    /// # Safety
    /// As [`StreamSampler::sample`]: `parts` holds `shards` parts whose writes (stage 1, or a
    /// collective) are ordered before this call on `stream`; the row parameters and processing
    /// are stage 1's; the outputs hold their extents; all live until `stream` has run the call.
    pub unsafe fn merge_shards(&self, stream: *mut c_void, request: &ShardMergeRequest) -> Result<()> {
        if request.shards == 0 || request.shards > u32::MAX as usize {
            return Err(invalid("shards", format!("{}: must be at least 1 and below 2^32", request.shards)));
        }
        let (Ok(batch), slots) = (u32::try_from(request.rows), request.rows.checked_mul(request.samples as usize))
        else {
            return Err(invalid("rows", format!("B = {}: must be < 2^32", request.rows)));
        };
        if slots.is_none_or(|n| n > u32::MAX as usize) || request.samples == 0 {
            return Err(invalid(
                "samples",
                format!("B x samples = {} x {}: must be 1 to 2^32 - 1 tokens", request.rows, request.samples),
            ));
        }
        if request.processing.rows != request.rows {
            return Err(invalid(
                "processing",
                format!("uploaded for B = {}; the parts hold B = {}", request.processing.rows, request.rows),
            ));
        }
        check_address("parts", request.parts, 16)?;
        check_address("row_params", request.row_params, align_of::<RowParams>())?;
        check_outputs(
            request.tokens,
            request.out_logprobs,
            request.out_top_logprobs,
            request.processing.top_logprobs(),
        )?;
        if request.out_logprobs != 0 && !request.logprobs {
            return Err(invalid("out_logprobs", "has room for log-probabilities; the parts were made without them"));
        }
        let layout = ShardPartLayout::of(batch, request.samples, request.logprobs);
        // SAFETY: per this function's contract.
        unsafe { driver::in_context(self.context, || self.queue_merge(stream.cast(), &layout, request)) }
    }

    /// Queues a planned processed request of one segment; the context is current.
    ///
    /// # Safety
    /// As [`StreamSampler::sample_processed`]; `plan` is `request`'s; resident `maps` describe
    /// `W` and `H` for the plan's variant.
    pub(crate) unsafe fn enqueue_processed(
        &self,
        stream: sys::CUstream,
        request: &ProcessedRequest,
        plan: &ProcessedPlan,
        maps: TensorMaps,
        workspace: DeviceWorkspace,
    ) -> Result<()> {
        if plan.segments() > 1 {
            return Err(invalid(
                "target",
                "a shard with an exchange whose rows truncate runs segment by segment, between the shards' reductions (sample_processed_segment)",
            ));
        }
        // SAFETY: per this function's contract.
        unsafe { self.enqueue_processed_segment(stream, request, plan, maps, workspace, 0) }.map(|_| ())
    }

    /// Queues segment `segment` of a planned processed request (see
    /// [`StreamSampler::sample_processed_segment`]); the context is current.
    ///
    /// # Safety
    /// As [`StreamSampler::sample_processed_segment`]; `plan` is `request`'s; resident `maps`
    /// describe `W` and `H` for the plan's variant.
    pub(crate) unsafe fn enqueue_processed_segment(
        &self,
        stream: sys::CUstream,
        request: &ProcessedRequest,
        plan: &ProcessedPlan,
        maps: TensorMaps,
        workspace: DeviceWorkspace,
        segment: usize,
    ) -> Result<Option<ShardReduction>> {
        if segment >= plan.segments() {
            return Err(invalid("segment", format!("{segment}: the call has {} segments", plan.segments())));
        }
        let plan = match plan {
            // SAFETY: per this function's contract.
            ProcessedPlan::Fused(fused, plan, None) => {
                return unsafe { self.enqueue(stream, fused, plan, maps, workspace) }.map(|_| None);
            }
            // SAFETY: per this function's contract.
            ProcessedPlan::Fused(fused, plan, Some(sums)) => {
                return unsafe { self.enqueue_fused_logprobs(stream, request, fused, plan, sums, maps, workspace) }
                    .map(|_| None);
            }
            ProcessedPlan::Materialised(plan) => plan,
        };
        self.check_workspace(workspace, plan.workspace_bytes)?;
        let base = DevicePtr::<u8>::new(workspace.address);
        let batch = request.hidden.rows;
        let vocab = request.lm_head.rows as u32;
        let (vocab_offset, part, part_layout) = request.part(base.byte_add(plan.part_at as u64));
        let logits = base.byte_add(plan.logits_at as u64).cast::<f32>();
        let logits_len = (batch * plan.stride) as u64;
        let (raw, processed) = (logits, logits.add((plan.copies as u64 - 1) * logits_len));
        if segment == 0 {
            // SAFETY: the workspace holds the plan's extents (checked above); the request's
            // buffers hold theirs (this function's contract).
            unsafe {
                let maps =
                    self.tensor_maps(stream, plan.variant, &request.lm_head, &request.hidden, maps, workspace)?;
                self.queue_logits(stream, plan.variant, &request.lm_head, &request.hidden, maps, raw, plan.stride)?;
            }
        }
        let (sums, top) = match request.logprobs() {
            true => {
                (part.byte_add(part_layout.sums).cast::<RowSums>(), part.byte_add(part_layout.top).cast::<RawTop>())
            }
            false => (DevicePtr::NULL, DevicePtr::NULL),
        };
        let row_params = DevicePtr::<RowParams>::new(request.row_params);
        let mut target = WinnerTarget::bare(part.cast::<ShardWinner>(), vocab_offset);
        target.logits_stride = plan.stride as u32;
        let part_sums = match request.logprobs() {
            true => base.byte_add(plan.part_sums_at as u64).cast::<RowSums>(),
            false => DevicePtr::NULL,
        };
        (target.part_sums, target.sum_parts, target.sums) = (part_sums, plan.sum_parts as u32, sums);
        let slices = plan.process_slices.expect("a processed call's materialised plan runs the processing pipeline");
        let states = base.byte_add(plan.states_at as u64).cast::<ProcessRowState>();
        let exchange = match (plan.exchange, request.target) {
            (Some(layout), ProcessedTarget::Shard { exchange, .. }) => Some((layout, DevicePtr::<u8>::new(exchange))),
            _ => None,
        };
        let args = ProcessArgs {
            raw,
            processed,
            row_params,
            processing: request.processing.blocks(),
            state: states,
            slice_sums: part_sums,
            top,
            vocab,
            logits_stride: plan.stride as u32,
            batch: batch as u32,
            vocab_offset,
            slices: slices as u32,
            step: ProcessStep::Entries as u32,
            selection: 0,
            digit: 0,
            exchange_extrema: exchange.map_or(DevicePtr::NULL, |(_, at)| at.cast()),
            exchange_histogram: DevicePtr::NULL,
        };
        // Without log-probabilities no row gathers top entries: their selections would only
        // launch to return.
        let selections = match request.logprobs() {
            true => request.processing.selections,
            false => request.processing.selections & !(Selection::TopRaw.bit() | Selection::TopRawTie.bit()),
        };
        // SAFETY: both logits hold `B × stride` floats, the workspace `B` states and
        // `B × slices` terms (the plan); the processing holds `B` row blocks for the whole
        // vocabulary (checked against the request), and only whole-vocabulary shards or
        // shards with an exchange (reduced between the segments) reach here with
        // truncations; the part holds `B` sums and top slots.
        let reduction = unsafe { self.queue_process_segment(stream, args, selections, exchange, segment)? };
        if reduction.is_some() {
            return Ok(reduction);
        }
        // Without log-probabilities the winners need no logits.
        if request.logprobs() {
            (target.raw, target.processed) = (raw, processed);
        }
        let candidates = base.byte_add(WORKSPACE_MAPS_BYTES as u64).cast::<Candidate>();
        let sampling = LogitsSampling { logits: processed, stride: plan.stride, vocab, vocab_offset };
        // SAFETY: as above; the candidates of the largest pass fit the workspace.
        unsafe {
            self.queue_logits_sampling(
                stream,
                &sampling,
                plan,
                row_params,
                request.draws,
                candidates,
                ReduceTarget::Winners(target),
            )?
        };
        let ProcessedTarget::Tokens { tokens, logprobs, top_logprobs } = request.target else { return Ok(None) };
        let merge = ShardMergeRequest {
            parts: part.address(),
            shards: 1,
            rows: batch,
            samples: request.draws.count,
            logprobs: request.logprobs(),
            row_params: request.row_params,
            processing: request.processing,
            tokens,
            out_logprobs: logprobs,
            out_top_logprobs: top_logprobs,
        };
        // SAFETY: stage 1 just wrote the one part on this stream.
        unsafe { self.queue_merge(stream, &part_layout, &merge) }.map(|_| None)
    }

    /// A fused call with log-probabilities: the tiles write each (row, tile)'s terms beside
    /// their candidates, the merge kernel merges the terms per row into the part and writes the
    /// winners there, and `winner_logits` gives the winners their raw and processed logits (one
    /// dot product each: the tiles keep no logits) or, for an unsharded call, writes its tokens
    /// and log-probabilities (what the shard merge of its one part would).
    ///
    /// # Safety
    /// As [`StreamSampler::enqueue_processed_segment`], with `fused` and `plan` the request's
    /// fused form and its plan, `sums` their terms' plan.
    #[allow(clippy::too_many_arguments)]
    unsafe fn enqueue_fused_logprobs(
        &self,
        stream: sys::CUstream,
        request: &ProcessedRequest,
        fused: &SampleRequest,
        plan: &CallPlan,
        sums: &FusedSums,
        maps: TensorMaps,
        workspace: DeviceWorkspace,
    ) -> Result<()> {
        self.check_workspace(workspace, sums.workspace_bytes)?;
        let base = DevicePtr::<u8>::new(workspace.address);
        let batch = request.hidden.rows;
        let (vocab_offset, part, layout) = request.part(base.byte_add(sums.part_at as u64));
        let tile_sums = base.byte_add(sums.tile_sums_at as u64).cast::<RowSums>();
        let mut target = WinnerTarget::bare(part.cast::<ShardWinner>(), vocab_offset);
        (target.part_sums, target.sum_parts) = (tile_sums, plan.tiles as u32);
        target.sums = part.byte_add(layout.sums).cast::<RowSums>();
        let (lm_head, hidden) = (&request.lm_head, &request.hidden);
        let mut args = WinnerLogitsArgs {
            lm_head: DevicePtr::new(lm_head.address),
            hidden: DevicePtr::new(hidden.address),
            winners: target.winners,
            processing: request.processing.per_entry_blocks(),
            tokens: DevicePtr::NULL,
            logprobs: DevicePtr::NULL,
            processed_logprobs: DevicePtr::NULL,
            top: DevicePtr::NULL,
            sums: target.sums,
            row_params: DevicePtr::new(request.row_params),
            vocab: lm_head.rows as u32,
            dim: lm_head.cols as u32,
            batch: batch as u32,
            samples: request.draws.count,
            lm_head_stride: lm_head.row_stride as u32,
            hidden_stride: hidden.row_stride as u32,
            vocab_offset,
            padding: 0,
        };
        if let ProcessedTarget::Tokens { tokens, logprobs, top_logprobs } = request.target {
            let slots = (batch * request.draws.count as usize) as u64;
            let raw = DevicePtr::<f32>::new(logprobs);
            (args.tokens, args.logprobs, args.processed_logprobs) = (DevicePtr::new(tokens), raw, raw.add(slots));
            args.top = DevicePtr::new(top_logprobs);
        }
        let kernel = Kernel::WinnerLogits { element: element_type(lm_head.dtype) };
        // A block per winner.
        let winners = batch as u64 * request.draws.count as u64;
        // SAFETY: the workspace holds the terms and the part past the candidates (checked
        // above), the fused variant writes the terms (the plan); then the winners are in the
        // part, and `W`, `H`, the processing and the outputs hold their extents (this
        // function's contract).
        unsafe {
            self.enqueue_tiles(stream, fused, plan, maps, workspace, ReduceTarget::Winners(target), tile_sums)?;
            self.launch(stream, kernel, winners, &args)
        }
    }

    /// Queues segment `segment` of the processing pipeline of `args` (its `Entries` step), as
    /// [`process_segment`] schedules it, and returns the reduction that ends it (`None` for
    /// the last).
    ///
    /// # Safety
    /// The context is current; `args` describes valid buffers as `process_rows` needs them,
    /// its states `B` [`ProcessRowState`]s; the exchange buffer holds its layout's bytes,
    /// zeroed before any shard's segment 0 and reduced between the segments.
    unsafe fn queue_process_segment(
        &self,
        stream: sys::CUstream,
        mut args: ProcessArgs,
        selections: u32,
        exchange: Option<(ShardExchangeLayout, DevicePtr<u8>)>,
        segment: usize,
    ) -> Result<Option<ShardReduction>> {
        let histogram = |k: usize| match exchange {
            Some((layout, at)) => at.byte_add(layout.histogram(k as u32)).cast::<u64>(),
            None => DevicePtr::NULL,
        };
        let (launches, end) = process_segment(selections, exchange.is_some(), segment);
        for launch in launches {
            let mut items = args.batch as u64 * args.slices as u64;
            match launch {
                ProcessLaunch::Entries => {
                    let state_words = args.batch as usize * size_of::<ProcessRowState>() / 4;
                    // SAFETY: the states hold `B` rows (this function's contract).
                    unsafe { driver::fill_words_async("process states", args.state.cast(), 0, state_words, stream)? };
                    args.step = ProcessStep::Entries as u32;
                }
                ProcessLaunch::Select { selection, digit, histogram: k } => {
                    (args.step, args.selection, args.digit) = (ProcessStep::Select as u32, selection as u32, digit);
                    args.exchange_histogram = k.map_or(DevicePtr::NULL, histogram);
                }
                ProcessLaunch::Decide { selection, digit, histogram: k } => {
                    (args.step, args.selection, args.digit) = (ProcessStep::Decide as u32, selection as u32, digit);
                    args.exchange_histogram = histogram(k);
                    items = args.batch as u64;
                }
                ProcessLaunch::Apply => {
                    (args.step, args.exchange_histogram) = (ProcessStep::Apply as u32, DevicePtr::NULL);
                }
            }
            // SAFETY: `args` and the exchange per this function's contract; the steps run in
            // order on `stream`, each segment after the reductions before it.
            unsafe { self.launch(stream, Kernel::ProcessRows, items, &args)? };
        }
        let histogram_words = args.batch as usize * SELECT_BUCKETS as usize;
        Ok(match (end, exchange) {
            (SegmentEnd::Extrema, Some((_, at))) => {
                Some(ShardReduction::MaxU32 { address: at.address(), count: 2 * args.batch as usize })
            }
            (SegmentEnd::Histogram(k), Some(_)) => {
                Some(ShardReduction::SumU64 { address: histogram(k).address(), count: histogram_words })
            }
            _ => None,
        })
    }

    /// The unfused pipeline on a request without processing: the GEMM of `variant` (an mma
    /// or TMA one) writes f32 logits `[B, V]` into the workspace, the logits sampler reads them
    /// back into `request.tokens`. The logits are bit-identical to the fused kernel's of the same
    /// variant, so are the tokens.
    ///
    /// # Safety
    /// As [`StreamSampler::enqueue_processed`], with the workspace of [`StreamSampler::plan_unfused`].
    pub(crate) unsafe fn enqueue_unfused(
        &self,
        stream: sys::CUstream,
        request: &SampleRequest,
        plan: &MaterialisedPlan,
        maps: TensorMaps,
        workspace: DeviceWorkspace,
    ) -> Result<()> {
        self.check_workspace(workspace, plan.workspace_bytes)?;
        let base = DevicePtr::<u8>::new(workspace.address);
        let logits = base.byte_add(plan.logits_at as u64).cast::<f32>();
        let candidates = base.byte_add(WORKSPACE_MAPS_BYTES as u64).cast::<Candidate>();
        let vocab = request.lm_head.rows as u32;
        let sampling = LogitsSampling { logits, stride: plan.stride, vocab, vocab_offset: 0 };
        // SAFETY: per this function's contract.
        unsafe {
            let maps = self.tensor_maps(stream, plan.variant, &request.lm_head, &request.hidden, maps, workspace)?;
            self.queue_logits(stream, plan.variant, &request.lm_head, &request.hidden, maps, logits, plan.stride)?;
            self.queue_logits_sampling(
                stream,
                &sampling,
                plan,
                DevicePtr::new(request.row_params),
                request.draws,
                candidates,
                ReduceTarget::Tokens(DevicePtr::new(request.tokens)),
            )
        }
    }

    /// The plan of [`StreamSampler::enqueue_unfused`].
    pub(crate) fn plan_unfused(&self, request: &SampleRequest) -> Result<MaterialisedPlan> {
        let samples = check_request(request)?;
        let variant = self.resolve(&request.lm_head, &request.hidden, request.variant)?;
        if variant.logits_kernel(request.lm_head.dtype).is_none() {
            return Err(invalid("variant", "the unfused pipeline has mma and TMA GEMMs only (BF16/F16, D % 8 == 0)"));
        }
        Ok(materialised_plan(variant, request.lm_head.rows, request.hidden.rows, samples, None, false, false))
    }

    /// Queues the unfused GEMM of `variant`: `H·Wᵀ` in f32 into `logits` (`[B, stride]`).
    ///
    /// # Safety
    /// The context is current; `logits` holds `B × stride` floats; `maps` (TMA variants)
    /// describe `W` and `H` and are written before on `stream`.
    #[allow(clippy::too_many_arguments)]
    unsafe fn queue_logits(
        &self,
        stream: sys::CUstream,
        variant: Variant,
        lm_head: &DeviceMatrix,
        hidden: &DeviceMatrix,
        maps: Option<MapPair>,
        logits: DevicePtr<f32>,
        stride: usize,
    ) -> Result<()> {
        let gemm = variant.logits_kernel(lm_head.dtype).expect("planned with a logits kernel");
        let gemm_tiles = lm_head.rows.div_ceil(variant.tile_rows() as usize);
        let items = gemm_tiles as u64 * hidden.rows.div_ceil(variant.columns() as usize) as u64;
        if let Some((lm_head_map, hidden_map)) = maps {
            let args = TmaArgs {
                lm_head_map,
                hidden_map,
                row_params: DevicePtr::NULL,
                out: logits.cast(),
                processing: DevicePtr::NULL,
                tile_sums: DevicePtr::NULL,
                vocab: lm_head.rows as u32,
                dim: lm_head.cols as u32,
                batch: hidden.rows as u32,
                hidden_row0: 0,
                draw_offset: 0,
                samples: 0,
                tiles: gemm_tiles as u32,
                logits_stride: stride as u32,
                vocab_offset: 0,
                padding: 0,
            };
            // SAFETY: per this function's contract.
            return unsafe { self.launch(stream, gemm, items, &args) };
        }
        let args = LogitsArgs {
            lm_head: DevicePtr::new(lm_head.address),
            hidden: DevicePtr::new(hidden.address),
            logits,
            vocab: lm_head.rows as u32,
            dim: lm_head.cols as u32,
            batch: hidden.rows as u32,
            logits_stride: stride as u32,
            lm_head_stride: lm_head.row_stride as u32,
            hidden_stride: hidden.row_stride as u32,
        };
        // SAFETY: per this function's contract.
        unsafe { self.launch(stream, gemm, items, &args) }
    }

    /// Queues the draws `draws` over materialised logits (written before on `stream`):
    /// candidates per pass of the plan, merged into `target` (`[batch, draws.count]`).
    ///
    /// # Safety
    /// The context is current; the logits hold `B × stride` floats, `candidates` the plan's
    /// largest pass, `target` its `B × draws.count` slots, the terms (if any) `B × tiles`
    /// entries.
    #[allow(clippy::too_many_arguments)]
    unsafe fn queue_logits_sampling(
        &self,
        stream: sys::CUstream,
        sampling: &LogitsSampling,
        plan: &MaterialisedPlan,
        row_params: DevicePtr<RowParams>,
        draws: Draws,
        candidates: DevicePtr<Candidate>,
        target: ReduceTarget,
    ) -> Result<()> {
        let (tiles, stride) = (plan.tiles, sampling.stride as u64);
        // SAFETY: per this function's contract.
        unsafe {
            self.queue_passes(
                stream,
                &plan.passes,
                tiles,
                row_params,
                candidates,
                target,
                draws.count,
                |pass, launch| {
                    let first_row = pass.first_row as u64;
                    let args = LogitsSamplerArgs {
                        logits: sampling.logits.add(first_row * stride),
                        row_params: launch.row_params,
                        candidates,
                        vocab: sampling.vocab,
                        logits_stride: stride as u32,
                        batch: launch.batch,
                        // The noise is keyed by the draw's index: the pass's first draw, after
                        // `draws.first`.
                        draw_offset: draws.first + pass.first_sample as u32,
                        samples: pass.samples as u32,
                        tiles: tiles as u32,
                        vocab_offset: sampling.vocab_offset,
                        padding: 0,
                    };
                    // SAFETY: the logits hold the pass's rows.
                    self.launch(stream, Kernel::SampleLogits, tiles as u64 * launch.batch as u64, &args)
                },
            )
        }
    }

    /// Queues the merge kernel over `request`'s parts (of `layout`) into its outputs.
    ///
    /// # Safety
    /// The context is current; as [`StreamSampler::merge_shards`].
    unsafe fn queue_merge(
        &self,
        stream: sys::CUstream,
        layout: &ShardPartLayout,
        request: &ShardMergeRequest,
    ) -> Result<()> {
        let slots = (request.rows * request.samples as usize) as u64;
        let raw = DevicePtr::<f32>::new(request.out_logprobs);
        let processed = raw.add_unless_null(slots);
        let args = ShardMergeArgs {
            parts: DevicePtr::new(request.parts),
            row_params: DevicePtr::new(request.row_params),
            processing: request.processing.blocks(),
            tokens: DevicePtr::new(request.tokens),
            logprobs: raw,
            processed_logprobs: processed,
            top: DevicePtr::new(request.out_top_logprobs),
            part_sums: layout.sums,
            part_top: layout.top,
            part_bytes: layout.bytes,
            shards: request.shards as u32,
            batch: request.rows as u32,
            samples: request.samples,
            padding: 0,
        };
        let blocks = slots.div_ceil(Kernel::MergeShards.threads() as u64);
        // SAFETY: per this function's contract.
        unsafe { self.launch(stream, Kernel::MergeShards, blocks, &args) }
    }
}

/// The tensor maps' pair (`W`'s, `H`'s).
pub(crate) type MapPair = (DevicePtr<flashsample_core::abi::TensorMap>, DevicePtr<flashsample_core::abi::TensorMap>);

/// Materialised logits the logits sampler draws from.
struct LogitsSampling {
    logits: DevicePtr<f32>,
    stride: usize,
    vocab: u32,
    vocab_offset: u32,
}

/// One launch of the processing kernel in a pipeline's schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ProcessLaunch {
    /// After clearing the row states.
    Entries,
    /// Adds a digit's histograms: to the row states (deciding there), or to the `k`-th
    /// histogram of the exchange (`histogram: Some(k)`).
    Select {
        selection: Selection,
        digit: u32,
        histogram: Option<usize>,
    },
    /// Decides a digit from the `k`-th histogram of the exchange (one block per row).
    Decide {
        selection: Selection,
        digit: u32,
        histogram: usize,
    },
    Apply,
}

/// What a segment of the processing pipeline ends with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SegmentEnd {
    /// The reduction of the exchange's extrema.
    Extrema,
    /// The reduction of the exchange's `k`-th histogram.
    Histogram(usize),
    /// Nothing: the pipeline is done.
    Last,
}

/// The launches of segment `segment` of the processing pipeline of rows that need
/// `selections` ([`Selection::bit`]s) and what ends it. Without an exchange, one segment: the
/// per-entry steps, each selection digit by digit (each deciding in its last slice), the
/// keep rule. With one: the per-entry steps, ended by the extrema's reduction; per exchanged
/// digit a segment that decides the digit before (from its reduced histograms) and adds this
/// one's, ended by its reduction; last, the last decision, the other selections' digits and
/// the keep rule. Past the last segment: nothing.
fn process_segment(selections: u32, exchange: bool, segment: usize) -> (Vec<ProcessLaunch>, SegmentEnd) {
    let exchanged = |s: &Selection| exchange && s.exchanged();
    // The digits of the selections the rows need, exchanged ones or the others, in order.
    let digits = |of_exchanged: bool| -> Vec<(Selection, u32)> {
        Selection::ALL
            .into_iter()
            .filter(|s| selections & s.bit() != 0 && exchanged(s) == of_exchanged)
            .flat_map(|s| (0..SELECT_DIGITS).map(move |digit| (s, digit)))
            .collect()
    };
    let shared = digits(true);
    let last = if exchange { shared.len() + 1 } else { 0 };
    let mut launches = Vec::new();
    if segment > last {
        return (launches, SegmentEnd::Last);
    }
    if segment == 0 {
        launches.push(ProcessLaunch::Entries);
        if exchange {
            return (launches, SegmentEnd::Extrema);
        }
    }
    if segment >= 2 {
        let (selection, digit) = shared[segment - 2];
        launches.push(ProcessLaunch::Decide { selection, digit, histogram: segment - 2 });
    }
    if segment >= 1
        && let Some(&(selection, digit)) = shared.get(segment - 1)
    {
        launches.push(ProcessLaunch::Select { selection, digit, histogram: Some(segment - 1) });
        return (launches, SegmentEnd::Histogram(segment - 1));
    }
    for (selection, digit) in digits(false) {
        launches.push(ProcessLaunch::Select { selection, digit, histogram: None });
    }
    launches.push(ProcessLaunch::Apply);
    (launches, SegmentEnd::Last)
}

/// The fewest quads of a row one slice of the processing pipeline takes (one per thread).
const MIN_SLICE_QUADS: usize = PROCESS_THREADS as usize;

/// A block's fixed cost per (row, slice) item (clearing and adding its histograms, the
/// arrival), as a share of one pass over a whole row: an estimate, `1 / ITEM_COST_SHARE`.
const ITEM_COST_SHARE: usize = 16;

/// Slices per row of the processing pipeline: the count whose (row, slice) items take the
/// least time in waves of `resident` blocks, each item costing its share of a row plus the
/// fixed [`ITEM_COST_SHARE`] (the fewer slices at equal time), none shorter than
/// [`MIN_SLICE_QUADS`]: one wave of many slices when the batch is small, a row per item when
/// it fills the waves.
fn process_slices(resident: usize, batch: usize, vocab: usize) -> usize {
    let (resident, batch) = (resident.max(1), batch.max(1));
    let longest = vocab.div_ceil(4).div_ceil(MIN_SLICE_QUADS).max(1);
    // `waves × (1 / slices + 1 / ITEM_COST_SHARE)`, scaled by `ITEM_COST_SHARE · slices`.
    let cost = |slices: usize| (batch * slices).div_ceil(resident) * (ITEM_COST_SHARE + slices);
    (1..=longest.min(resident)).fold(1, |best, slices| match cost(slices) * best < cost(best) * slices {
        true => slices,
        false => best,
    })
}

/// The materialised path's plan for `batch × samples` draws over `vocab` rows: logits
/// (`copies` of them), candidates of the logits sampler's passes, log-sum-exp terms per slice
/// of the processing pipeline with log-probabilities, the pipeline's row states, and the
/// unsharded call's one part (`own_part`). Without `process_slices` (the unfused comparison)
/// there are neither terms nor states.
fn materialised_plan(
    variant: Variant,
    vocab: usize,
    batch: usize,
    samples: u32,
    process_slices: Option<usize>,
    logprobs: bool,
    own_part: bool,
) -> MaterialisedPlan {
    let stride = vocab.next_multiple_of(4);
    let tiles = vocab.div_ceil(LOGITS_SAMPLER_TILE as usize);
    let passes = Plan::new(batch, samples as usize, tiles, CANDIDATE_BUDGET_BYTES);
    let copies = if process_slices.is_some() && logprobs { 2 } else { 1 };
    let sum_parts = process_slices.unwrap_or(0);
    let logits_at = align(WORKSPACE_MAPS_BYTES + passes.candidate_pairs() * tiles * size_of::<Candidate>());
    let part_sums_at = align(logits_at + copies * batch * stride * 4);
    let part_sums = if logprobs { batch * sum_parts * size_of::<RowSums>() } else { 0 };
    let states_at = align(part_sums_at + part_sums);
    let states = if process_slices.is_some() { batch * size_of::<ProcessRowState>() } else { 0 };
    let part_at = align(states_at + states);
    let part = match own_part {
        true => ShardPartLayout::of(batch as u32, samples, logprobs).bytes as usize,
        false => 0,
    };
    MaterialisedPlan {
        exchange: None,
        variant,
        stride,
        tiles,
        passes,
        copies,
        process_slices,
        sum_parts,
        logits_at,
        part_sums_at,
        states_at,
        part_at,
        workspace_bytes: part_at + part,
    }
}

/// The rules of a call's outputs: tokens, and log-probabilities and top entries where asked
/// (`top_asked`: a row asks for top entries), 4-byte aligned; top entries need
/// log-probabilities.
fn check_outputs(tokens: u64, logprobs: u64, top_logprobs: u64, top_asked: bool) -> Result<()> {
    check_address("tokens", tokens, 4)?;
    if logprobs != 0 {
        check_address("logprobs", logprobs, 4)?;
    }
    match top_logprobs {
        0 if top_asked => Err(invalid("top_logprobs", "null, but a row asks for its top log-probabilities")),
        0 => Ok(()),
        _ if logprobs == 0 => Err(invalid("top_logprobs", "top entries need log-probabilities: logprobs is null")),
        at => check_address("top_logprobs", at, 4),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The materialised plan's regions (maps, candidates, logits, terms, row states, the one
    /// part) follow each other without overlap, each 64-byte aligned, and hold what the
    /// kernels write: two logits copies only with the processing pipeline and
    /// log-probabilities, terms per slice only with log-probabilities (which take the pipeline),
    /// row states only with the pipeline, a part only for an unsharded call.
    #[test]
    fn materialised_regions_are_aligned_and_disjoint() {
        let variant = Variant::Mma { columns: 8 };
        for (vocab, batch, samples) in [(1usize, 1usize, 1u32), (5003, 9, 3), (151_936, 64, 1), (128_257, 256, 2)] {
            let slices = process_slices(132, batch, vocab);
            for (process_slices, logprobs, own_part) in [
                (None, false, false),
                (Some(slices), false, true),
                (Some(slices), true, true),
                (Some(slices), true, false),
            ] {
                let plan = materialised_plan(variant, vocab, batch, samples, process_slices, logprobs, own_part);
                let tiles = vocab.div_ceil(LOGITS_SAMPLER_TILE as usize);
                let candidates = plan.passes.candidate_pairs() * tiles * size_of::<Candidate>();
                let copies = if process_slices.is_some() && logprobs { 2 } else { 1 };
                let parts = process_slices.unwrap_or(0);
                let terms = if logprobs { batch * parts * size_of::<RowSums>() } else { 0 };
                let states = if process_slices.is_some() { batch * size_of::<ProcessRowState>() } else { 0 };
                let part =
                    if own_part { ShardPartLayout::of(batch as u32, samples, logprobs).bytes as usize } else { 0 };
                assert_eq!((plan.stride % 4, plan.stride >= vocab, plan.copies), (0, true, copies));
                assert_eq!(plan.sum_parts, parts);
                for at in [plan.logits_at, plan.part_sums_at, plan.states_at, plan.part_at] {
                    assert_eq!(at % 64, 0);
                }
                assert!(WORKSPACE_MAPS_BYTES + candidates <= plan.logits_at);
                assert!(plan.logits_at + copies * batch * plan.stride * 4 <= plan.part_sums_at);
                assert!(plan.part_sums_at + terms <= plan.states_at);
                assert!(plan.states_at + states <= plan.part_at);
                assert_eq!(plan.workspace_bytes, plan.part_at + part);
            }
        }
    }

    /// A fused call's terms and part follow its candidates without overlap, 64-byte aligned:
    /// `[B, tiles]` terms, then the one part of an unsharded call.
    #[test]
    fn fused_sums_follow_the_candidates() {
        for (vocab, batch, samples) in [(1usize, 1usize, 1u32), (5003, 9, 3), (151_936, 64, 1), (128_257, 256, 2)] {
            let tiles = vocab.div_ceil(128);
            let passes = Plan::new(batch, samples as usize, tiles, CANDIDATE_BUDGET_BYTES);
            let workspace_bytes = WORKSPACE_MAPS_BYTES + passes.candidate_pairs() * tiles * size_of::<Candidate>();
            let variant = Variant::Tma { rows: 128, columns: 8 };
            let plan = CallPlan { variant, tiles, passes, samples, workspace_bytes };
            for own_part in [false, true] {
                let sums = FusedSums::new(&plan, batch, samples, own_part);
                let part = if own_part { ShardPartLayout::of(batch as u32, samples, true).bytes as usize } else { 0 };
                assert_eq!((sums.tile_sums_at % 64, sums.part_at % 64), (0, 0));
                assert!(plan.workspace_bytes <= sums.tile_sums_at);
                assert!(sums.tile_sums_at + batch * tiles * size_of::<RowSums>() <= sums.part_at);
                assert_eq!(sums.workspace_bytes, sums.part_at + part);
            }
        }
    }

    /// The processing pipeline's slicing: a small batch splits its rows until the items fill
    /// a wave, a large one takes the count that wastes least of its last wave, never a slice
    /// shorter than `MIN_SLICE_QUADS` quads (beyond the one a short row has), never more
    /// slices than quads or resident blocks.
    #[test]
    fn process_slices_fill_the_waves_with_whole_slices() {
        assert_eq!(process_slices(396, 1, 151_936), 149);
        assert_eq!(process_slices(396, 16, 151_936), 24);
        assert_eq!(process_slices(396, 64, 151_936), 6);
        assert_eq!(process_slices(396, 256, 151_936), 3);
        assert_eq!(process_slices(396, 396, 151_936), 1);
        assert_eq!(process_slices(396, 1, 1), 1);
        assert_eq!(process_slices(396, 1, 5000), 5);
        for (batch, vocab) in [(1usize, 7usize), (3, 4096), (1, 262_144), (100, 151_936), (1000, 128_256)] {
            let slices = process_slices(396, batch, vocab);
            assert!(slices >= 1 && slices <= vocab.div_ceil(4) && slices <= 396);
            assert!(slices == 1 || vocab.div_ceil(4).div_ceil(slices) >= MIN_SLICE_QUADS / 2);
            let cost = |s: usize| (batch * s).div_ceil(396) as f64 * (1.0 / s as f64 + 1.0 / 16.0);
            assert!(cost(slices) <= cost(1), "{batch} x {vocab}: {slices}");
        }
    }

    /// The processing pipeline's schedule: without an exchange one segment of the per-entry
    /// steps, every digit of every selection in order and the keep rule; with one the same
    /// launches but for the exchanged digits, each added in the segment the reduction of its
    /// histogram ends and decided at the start of the next, the extrema reduced before any
    /// digit, as many segments as the plan counts, and nothing past them.
    #[test]
    fn the_pipeline_runs_in_segments_around_the_reductions() {
        let all = Selection::ALL.iter().fold(0, |bits, s| bits | s.bit());
        for selections in [0, Selection::TopK.bit(), Selection::TopP.bit() | Selection::TopPTie.bit(), all] {
            let digits = |keep: &dyn Fn(Selection) -> bool| -> Vec<(Selection, u32)> {
                Selection::ALL
                    .into_iter()
                    .filter(|&s| selections & s.bit() != 0 && keep(s))
                    .flat_map(|s| (0..SELECT_DIGITS).map(move |d| (s, d)))
                    .collect()
            };
            let (alone, end) = process_segment(selections, false, 0);
            let mut want = vec![ProcessLaunch::Entries];
            want.extend(digits(&|_| true).into_iter().map(|(selection, digit)| ProcessLaunch::Select {
                selection,
                digit,
                histogram: None,
            }));
            want.push(ProcessLaunch::Apply);
            assert_eq!((alone, end), (want, SegmentEnd::Last), "{selections:#b}");
            assert_eq!(process_segment(selections, false, 1), (Vec::new(), SegmentEnd::Last));

            let shared = digits(&|s| s.exchanged());
            let layout = ShardExchangeLayout::of(3, selections);
            assert_eq!(layout.digits as usize, shared.len(), "{selections:#b}");
            let segments = 2 + shared.len();
            let mut ends = Vec::new();
            let mut launches = Vec::new();
            for segment in 0..segments {
                let (mut some, end) = process_segment(selections, true, segment);
                launches.append(&mut some);
                ends.push(end);
            }
            let mut want_ends = vec![SegmentEnd::Extrema];
            want_ends.extend((0..shared.len()).map(SegmentEnd::Histogram));
            want_ends.push(SegmentEnd::Last);
            assert_eq!(ends, want_ends, "{selections:#b}");
            let mut want = vec![ProcessLaunch::Entries];
            for (k, &(selection, digit)) in shared.iter().enumerate() {
                want.push(ProcessLaunch::Select { selection, digit, histogram: Some(k) });
                want.push(ProcessLaunch::Decide { selection, digit, histogram: k });
            }
            want.extend(digits(&|s| !s.exchanged()).into_iter().map(|(selection, digit)| ProcessLaunch::Select {
                selection,
                digit,
                histogram: None,
            }));
            want.push(ProcessLaunch::Apply);
            assert_eq!(launches, want, "{selections:#b}");
            assert_eq!(process_segment(selections, true, segments), (Vec::new(), SegmentEnd::Last));
        }
    }

    /// The outputs' rules: tokens always, log-probabilities where given, top entries need
    /// log-probabilities and must be given when a row asks for them; each 4-byte aligned.
    #[test]
    fn output_rules_name_the_buffer() {
        assert!(check_outputs(256, 0, 0, false).is_ok());
        assert!(check_outputs(256, 512, 1024, true).is_ok());
        let named = |result: Result<()>, name: &str| {
            let message = result.unwrap_err().to_string();
            assert!(message.contains(name), "{message}");
        };
        named(check_outputs(0, 0, 0, false), "tokens");
        named(check_outputs(258, 0, 0, false), "tokens");
        named(check_outputs(256, 514, 0, false), "logprobs");
        named(check_outputs(256, 512, 0, true), "top_logprobs");
        named(check_outputs(256, 0, 1024, false), "top_logprobs");
        named(check_outputs(256, 512, 1026, true), "top_logprobs");
    }

    /// Outputs read back: the tokens as written, `[B, N]` raw then processed log-probabilities,
    /// each row's top entries up to the first `NO_TOKEN`; wrong lengths are typed errors.
    #[test]
    fn processed_outputs_read_back_in_their_layout() {
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
        let got = Sampled::from_processed_outputs(draws, tokens.clone(), Some(&values), Some(&top)).unwrap();
        assert_eq!((got.tokens, got.draws), (tokens.clone(), draws));
        assert_eq!(got.logprobs, values[..6]);
        assert_eq!(got.processed_logprobs, values[6..]);
        assert_eq!(got.top_logprobs, vec![vec![(0, 0.0), (1, -1.0)], vec![]]);
        let plain = Sampled::from_processed_outputs(draws, tokens.clone(), None, None).unwrap();
        assert!(plain.logprobs.is_empty() && plain.top_logprobs.iter().all(Vec::is_empty));
        assert!(Sampled::from_processed_outputs(draws, tokens.clone(), Some(&values[1..]), None).is_err());
        assert!(Sampled::from_processed_outputs(draws, tokens, None, Some(&top[2..])).is_err());
    }
}
