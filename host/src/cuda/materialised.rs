//! The materialised path's launches: the unfused GEMM writes a call's logits into its
//! workspace, the processing pipeline (`process_rows` over (row, slice) items, one launch per
//! step of [`super::schedule`]) processes them, and the logits sampler and the merge kernel
//! draw from them with the plain path's noise; the unsharded call then merges its one part
//! into tokens. The unfused comparison pipeline is its GEMM and sampler alone.

use cudarc::driver::sys;
use flashsample_core::abi::{
    DevicePtr, LogitsArgs, LogitsSamplerArgs, ProcessArgs, ProcessRowState, ProcessStep, RawTop, RowProcessing,
    RowSums, SELECT_BUCKETS, Selection, ShardExchangeLayout, ShardWinner, TmaArgs,
};
use flashsample_core::registry::Kernel;
use flashsample_core::{Candidate, RowParams};

use super::dispatch::Variant;
use super::driver;
use super::memory::MatrixRef;
use super::modules::Kernels;
#[cfg(feature = "internals")]
use super::plan::FusedCall;
use super::plan::{Call, CallTarget, MaterialisedPlan, MergeCall, TensorMaps, WORKSPACE_MAPS_BYTES};
use super::request::{DeviceWorkspace, Exchange};
use super::schedule::{ProcessLaunch, SegmentEnd, process_segment};
use super::tiles::{MapPair, ReduceTarget, WinnerTarget, tma_args};
use crate::error::Result;
use crate::params::Draws;

/// Materialised logits the logits sampler draws from.
struct LogitsSampling {
    logits: DevicePtr<f32>,
    stride: usize,
    vocab: u32,
    vocab_offset: u32,
    /// The rows' processing and pipeline states whose keep rules the sampler applies (see
    /// `LogitsSamplerArgs::row_states`), or null.
    processing: DevicePtr<RowProcessing>,
    row_states: DevicePtr<ProcessRowState>,
}

impl Kernels {
    /// Queues segment `segment` of a materialised call (see [`super::schedule`]) and returns
    /// the exchange that ends it (`None` after the last).
    ///
    /// # Safety
    /// The context is current; the call's buffers hold its extents and the workspace the
    /// plan's; an exchange buffer is cleared before segment 0 and reduced between the
    /// segments; the maps as [`Kernels::tensor_maps`] states.
    pub(crate) unsafe fn enqueue_materialised(
        &self,
        stream: sys::CUstream,
        call: &Call,
        plan: &MaterialisedPlan,
        maps: TensorMaps,
        workspace: DeviceWorkspace,
        segment: usize,
    ) -> Result<Option<Exchange>> {
        let base = DevicePtr::<u8>::new(workspace.address);
        let batch = call.hidden.rows;
        let vocab = call.lm_head.rows as u32;
        let vocab_offset = call.vocab_offset();
        let (part, part_layout) = call.part(base.byte_add(plan.part_at as u64).address());
        let part = DevicePtr::<u8>::new(part);
        let logits = base.byte_add(plan.logits_at as u64).cast::<f32>();
        let logits_len = (batch * plan.stride) as u64;
        let (raw, processed) = (logits, logits.add((plan.copies as u64 - 1) * logits_len));
        let exchange = match (plan.exchange, call.target) {
            (Some(layout), CallTarget::Shard { exchange, .. }) => Some((layout, DevicePtr::<u8>::new(exchange))),
            _ => None,
        };
        // Rows without per-entry steps, terms or an exchange race with the GEMM's logits as
        // they are: the pipeline takes their largest logits from the GEMM's maxima instead of
        // reading them (`ProcessStep::Extrema`).
        let maxima = match !call.logprobs() && exchange.is_none() && !call.processing.per_entry {
            true => base.byte_add(plan.maxima_at as u64).cast::<u32>(),
            false => DevicePtr::NULL,
        };
        if segment == 0 {
            // SAFETY: the workspace holds the plan's extents (the maxima too without
            // log-probabilities) and the call's buffers hold theirs (this function's contract).
            unsafe {
                let maps = self.tensor_maps(stream, plan.variant, &call.lm_head, &call.hidden, maps, workspace)?;
                let (variant, gate) = (plan.variant, DevicePtr::NULL);
                self.queue_logits(stream, variant, &call.lm_head, &call.hidden, maps, raw, plan.stride, maxima, gate)?;
            }
        }
        let (sums, top) = match call.logprobs() {
            true => {
                (part.byte_add(part_layout.sums).cast::<RowSums>(), part.byte_add(part_layout.top).cast::<RawTop>())
            }
            false => (DevicePtr::NULL, DevicePtr::NULL),
        };
        let row_params = DevicePtr::<RowParams>::new(call.row_params);
        let mut target = WinnerTarget::bare(part.cast::<ShardWinner>(), vocab_offset);
        target.logits_stride = plan.stride as u32;
        let part_sums = match call.logprobs() {
            true => base.byte_add(plan.part_sums_at as u64).cast::<RowSums>(),
            false => DevicePtr::NULL,
        };
        (target.part_sums, target.sum_parts, target.sums) = (part_sums, plan.sum_parts as u32, sums);
        let slices = plan.process_slices.expect("a processed call's materialised plan runs the processing pipeline");
        let states = base.byte_add(plan.states_at as u64).cast::<ProcessRowState>();
        let args = ProcessArgs {
            raw,
            processed,
            row_params,
            processing: call.processing.blocks(),
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
            members: base.byte_add(plan.members_at as u64).cast::<u32>(),
            maxima,
        };
        // Without log-probabilities no row gathers top entries: their selections would only
        // launch to return.
        let selections = match call.logprobs() {
            true => call.processing.selections,
            false => call.processing.selections & !(Selection::TopRaw.bit() | Selection::TopRawTie.bit()),
        };
        // SAFETY: both logits hold `B × stride` floats, the workspace `B` states and
        // `B × slices` terms (the plan); the processing holds `B` row blocks for the whole
        // vocabulary (the plan checked it against the call), and only whole-vocabulary shards or
        // shards with an exchange (reduced between the segments) reach here with
        // truncations; the part holds `B` sums and top slots.
        // Without log-probabilities and with the rows' selections in their states (no
        // exchange), the logits sampler applies each row's keep rule itself and the pipeline
        // ends before its `Apply` step: the step's only other work is the kept terms and the
        // top raw entries.
        let sampler_keeps = !call.logprobs() && exchange.is_none();
        let reduction =
            unsafe { self.queue_process_segment(stream, args, selections, exchange, segment, !sampler_keeps)? };
        if reduction.is_some() {
            return Ok(reduction);
        }
        // Without log-probabilities the winners need no logits.
        if call.logprobs() {
            (target.raw, target.processed) = (raw, processed);
        }
        let candidates = base.byte_add(WORKSPACE_MAPS_BYTES as u64).cast::<Candidate>();
        let (keep_processing, keep_states) = match sampler_keeps {
            true => (call.processing.blocks(), states),
            false => (DevicePtr::NULL, DevicePtr::NULL),
        };
        let sampling = LogitsSampling {
            logits: processed,
            stride: plan.stride,
            vocab,
            vocab_offset,
            processing: keep_processing,
            row_states: keep_states,
        };
        // SAFETY: as above; the candidates of the largest pass fit the workspace.
        unsafe {
            self.queue_logits_sampling(
                stream,
                &sampling,
                plan,
                row_params,
                call.draws,
                candidates,
                ReduceTarget::Winners(target),
            )?
        };
        let CallTarget::Tokens { tokens, logprobs, top_logprobs } = call.target else { return Ok(None) };
        let merge = MergeCall {
            parts: part.address(),
            shards: 1,
            rows: batch,
            samples: call.draws.count,
            logprobs: call.logprobs(),
            row_params: call.row_params,
            processing: call.processing,
            tokens,
            out_logprobs: logprobs,
            out_top_logprobs: top_logprobs,
        };
        // SAFETY: stage 1 just wrote the one part on this stream.
        unsafe { self.queue_merge(stream, &part_layout, &merge) }.map(|_| None)
    }

    /// Queues segment `segment` of the processing pipeline of `args` (its first step), as
    /// [`process_segment`] schedules it (with its `Apply` step if `apply`, and `Extrema` in
    /// place of `Entries` where `args.maxima` is set), and returns the reduction that ends it
    /// (`None` for the last).
    ///
    /// # Safety
    /// The context is current; `args` describes valid buffers as `process_rows` needs them,
    /// its states `B` [`ProcessRowState`]s, its maxima (if set) the GEMM's of rows without
    /// per-entry steps, terms or an exchange; the exchange buffer holds its layout's bytes,
    /// zeroed before any shard's segment 0 and reduced between the segments.
    unsafe fn queue_process_segment(
        &self,
        stream: sys::CUstream,
        mut args: ProcessArgs,
        selections: u32,
        exchange: Option<(ShardExchangeLayout, DevicePtr<u8>)>,
        segment: usize,
        apply: bool,
    ) -> Result<Option<Exchange>> {
        let histogram = |k: usize| match exchange {
            Some((layout, at)) => at.byte_add(layout.histogram(k as u32)).cast::<u64>(),
            None => DevicePtr::NULL,
        };
        let maxima = args.maxima.address() != 0;
        let (launches, end) = process_segment(selections, exchange.is_some(), segment, apply, maxima);
        for launch in launches {
            let mut items = args.batch as u64 * args.slices as u64;
            match launch {
                ProcessLaunch::Entries | ProcessLaunch::Extrema => {
                    let state_words = args.batch as usize * size_of::<ProcessRowState>() / 4;
                    // SAFETY: the states hold `B` rows (this function's contract).
                    unsafe { driver::fill_words_async("process states", args.state.cast(), 0, state_words, stream)? };
                    args.step = match launch {
                        ProcessLaunch::Entries => ProcessStep::Entries as u32,
                        _ => {
                            items = args.batch as u64;
                            ProcessStep::Extrema as u32
                        }
                    };
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
                ProcessLaunch::Gather { selection } => {
                    (args.step, args.selection) = (ProcessStep::Gather as u32, selection as u32);
                    args.exchange_histogram = DevicePtr::NULL;
                }
                ProcessLaunch::Resolve { selection } => {
                    (args.step, args.selection) = (ProcessStep::Resolve as u32, selection as u32);
                    args.exchange_histogram = DevicePtr::NULL;
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
                Some(Exchange::MaxU32 { address: at.address(), count: 2 * args.batch as usize })
            }
            (SegmentEnd::Histogram(k), Some(_)) => {
                Some(Exchange::SumU64 { address: histogram(k).address(), count: histogram_words })
            }
            _ => None,
        })
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
                        processing: sampling.processing.add_unless_null(first_row),
                        row_states: sampling.row_states.add_unless_null(first_row),
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

    /// The unfused pipeline on a request without processing: the GEMM of `variant` (an mma
    /// or TMA one) writes f32 logits `[B, V]` into the workspace, the logits sampler reads them
    /// back into `call.tokens`. The logits are bit-identical to the fused kernel's of the same
    /// variant, so are the tokens.
    ///
    /// # Safety
    /// As [`Kernels::enqueue_fused`](super::tiles), with the workspace of
    /// [`Kernels::plan_unfused`].
    #[cfg(feature = "internals")]
    pub(crate) unsafe fn enqueue_unfused(
        &self,
        stream: sys::CUstream,
        call: &FusedCall,
        plan: &MaterialisedPlan,
        maps: TensorMaps,
        workspace: DeviceWorkspace,
    ) -> Result<()> {
        let base = DevicePtr::<u8>::new(workspace.address);
        let logits = base.byte_add(plan.logits_at as u64).cast::<f32>();
        let candidates = base.byte_add(WORKSPACE_MAPS_BYTES as u64).cast::<Candidate>();
        let vocab = call.lm_head.rows as u32;
        let sampling = LogitsSampling {
            logits,
            stride: plan.stride,
            vocab,
            vocab_offset: 0,
            processing: DevicePtr::NULL,
            row_states: DevicePtr::NULL,
        };
        // SAFETY: per this function's contract.
        unsafe {
            let maps = self.tensor_maps(stream, plan.variant, &call.lm_head, &call.hidden, maps, workspace)?;
            self.queue_logits(
                stream,
                plan.variant,
                &call.lm_head,
                &call.hidden,
                maps,
                logits,
                plan.stride,
                DevicePtr::NULL,
                DevicePtr::NULL,
            )?;
            self.queue_logits_sampling(
                stream,
                &sampling,
                plan,
                DevicePtr::new(call.row_params),
                call.draws,
                candidates,
                ReduceTarget::Tokens(DevicePtr::new(call.tokens)),
            )
        }
    }

    /// The plan of [`Kernels::enqueue_unfused`].
    #[cfg(feature = "internals")]
    pub(crate) fn plan_unfused(&self, call: &FusedCall) -> Result<MaterialisedPlan> {
        let samples = super::plan::check_fused(call)?;
        let variant = super::plan::resolve(self, &call.lm_head, &call.hidden, call.variant)?;
        Ok(super::plan::materialised_plan(variant, call.lm_head.rows, call.hidden.rows, samples, None, false, false))
    }

    /// Queues the unfused GEMM of `variant`: `H·Wᵀ` in f32 into `logits` (`[B, stride]`),
    /// and each (row, run of `MAXIMA_ROWS` entries)'s maximum into `maxima` unless null
    /// (`LogitsArgs::maxima`), gated on `gate` unless null.
    ///
    /// # Safety
    /// The context is current; `logits` holds `B × stride` floats, `maxima` (if not null)
    /// `B × ⌈V / MAXIMA_ROWS⌉` words; `maps` (TMA variants)
    /// describe `W` and `H` and are written before on `stream`; `gate`, if not null, is a word
    /// written before on `stream`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn queue_logits(
        &self,
        stream: sys::CUstream,
        variant: Variant,
        lm_head: &MatrixRef,
        hidden: &MatrixRef,
        maps: Option<MapPair>,
        logits: DevicePtr<f32>,
        stride: usize,
        maxima: DevicePtr<u32>,
        gate: DevicePtr<u32>,
    ) -> Result<()> {
        let gemm = variant.logits_kernel(lm_head.dtype);
        let gemm_tiles = lm_head.rows.div_ceil(variant.tile_rows() as usize);
        let items = gemm_tiles as u64 * hidden.rows.div_ceil(variant.columns() as usize) as u64;
        if let Some(maps) = maps {
            let args = TmaArgs {
                out: logits.cast(),
                maxima,
                gate,
                logits_stride: stride as u32,
                ..tma_args(maps, lm_head, hidden, gemm_tiles)
            };
            // SAFETY: per this function's contract.
            return unsafe { self.launch(stream, gemm, items, &args) };
        }
        let args = LogitsArgs {
            gate,
            lm_head: DevicePtr::new(lm_head.address),
            hidden: DevicePtr::new(hidden.address),
            logits,
            maxima,
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
}
