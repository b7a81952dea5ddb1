//! The fused path's launches: the tile kernel of each pass (which computes every logits tile
//! on chip and writes one candidate per row, draw and tile) and the merge kernel that turns a
//! pass's candidates into tokens or a shard's winners; with log-probabilities the tiles'
//! log-sum-exp terms and `winner_logits`. The materialised path's logits sampler reuses the
//! passes.

use cudarc::driver::sys;
use flashsample_core::abi::{
    DevicePtr, FusedArgs, ReduceArgs, RowProcessing, RowSums, ShardWinner, StoreTensorMapsArgs, TensorMap, TmaArgs,
    WinnerLogitsArgs,
};
use flashsample_core::registry::Kernel;
use flashsample_core::{Candidate, RowParams};

use super::dispatch::{Variant, element_type};
use super::memory::{MatrixRef, l2_promotion, tensor_map};
use super::modules::Kernels;
use super::passes::{Pass, Passes};
use super::plan::{Call, CallTarget, FusedCall, FusedPlan, FusedSums, TensorMaps, WORKSPACE_MAPS_BYTES};
use super::request::DeviceWorkspace;
use crate::error::Result;

/// The tensor maps' pair (`W`'s, `H`'s).
pub(crate) type MapPair = (DevicePtr<TensorMap>, DevicePtr<TensorMap>);

/// Where the merge kernel writes a pass's winners.
#[derive(Clone, Copy, Debug)]
pub(crate) enum ReduceTarget {
    /// `[B, samples]` tokens.
    Tokens(DevicePtr<u32>),
    /// `[B, samples]` winners of a shard.
    Winners(WinnerTarget),
}

/// A shard's winners and what the merge kernel adds to them: the tokens' logits from `[B,
/// logits_stride]` raw logits (column 0 the global token `vocab_offset`; null: none) and
/// processed ones (null: the raw ones), and each row's log-sum-exp terms merged from `[B,
/// sum_parts]` per-part ones into `sums` (null: none).
#[derive(Clone, Copy, Debug)]
pub(crate) struct WinnerTarget {
    pub winners: DevicePtr<ShardWinner>,
    pub raw: DevicePtr<f32>,
    pub processed: DevicePtr<f32>,
    /// `[B, sum_parts]` log-sum-exp terms the merge kernel merges per row into `sums`.
    pub part_sums: DevicePtr<RowSums>,
    pub sum_parts: u32,
    pub sums: DevicePtr<RowSums>,
    pub logits_stride: u32,
    pub vocab_offset: u32,
}

impl WinnerTarget {
    /// Winners alone, without logits or terms.
    pub fn bare(winners: DevicePtr<ShardWinner>, vocab_offset: u32) -> WinnerTarget {
        WinnerTarget {
            winners,
            raw: DevicePtr::NULL,
            processed: DevicePtr::NULL,
            part_sums: DevicePtr::NULL,
            sum_parts: 0,
            sums: DevicePtr::NULL,
            logits_stride: 0,
            vocab_offset,
        }
    }
}

impl ReduceTarget {
    /// The target of a fused call: its tokens, or its shard's winners without logits.
    pub(crate) fn of(call: &FusedCall) -> ReduceTarget {
        match call.shard {
            None => ReduceTarget::Tokens(DevicePtr::new(call.tokens)),
            Some(shard) => {
                ReduceTarget::Winners(WinnerTarget::bare(DevicePtr::new(shard.winners), shard.vocab_offset as u32))
            }
        }
    }
}

/// What the tile kernel of one pass reads besides the call's own buffers.
pub(crate) struct TileLaunch {
    /// Row parameters of the pass's first row.
    pub row_params: DevicePtr<RowParams>,
    /// Rows in the pass.
    pub batch: u32,
}

/// The argument block of a TMA kernel over all of `hidden` and `W`'s `tiles` tiles with
/// `maps`: no outputs, processing, gate or draws; the caller sets what its launch has.
pub(crate) fn tma_args(maps: MapPair, lm_head: &MatrixRef, hidden: &MatrixRef, tiles: usize) -> TmaArgs {
    let (lm_head_map, hidden_map) = maps;
    TmaArgs {
        lm_head_map,
        hidden_map,
        row_params: DevicePtr::NULL,
        out: DevicePtr::NULL,
        processing: DevicePtr::NULL,
        tile_sums: DevicePtr::NULL,
        maxima: DevicePtr::NULL,
        tile_tops: DevicePtr::NULL,
        gate: DevicePtr::NULL,
        vocab: lm_head.rows as u32,
        dim: lm_head.cols as u32,
        batch: hidden.rows as u32,
        hidden_row0: 0,
        draw_offset: 0,
        samples: 0,
        tiles: tiles as u32,
        logits_stride: 0,
        vocab_offset: 0,
        padding: 0,
    }
}

impl Kernels {
    /// The tensor maps a call of `variant` reads (`None` unless TMA): resident ones, the ones
    /// an earlier call left at the workspace's start, or `W`'s and `H`'s encoded here and
    /// written there on `stream`.
    ///
    /// # Safety
    /// The context is current; the workspace holds at least [`WORKSPACE_MAPS_BYTES`] and is
    /// only this stream's; resident `maps` describe `W` and `H`, stored ones are the maps of
    /// `W` and `H` for the variant's boxes.
    pub(crate) unsafe fn tensor_maps(
        &self,
        stream: sys::CUstream,
        variant: Variant,
        lm_head: &MatrixRef,
        hidden: &MatrixRef,
        maps: TensorMaps,
        workspace: DeviceWorkspace,
    ) -> Result<Option<MapPair>> {
        let destination = DevicePtr::<TensorMap>::new(workspace.address);
        Ok(match (variant.tma_boxes(), maps) {
            (None, _) => None,
            (Some((rows, columns)), TensorMaps::Resident { lm_head, hidden }) => {
                Some((lm_head.map(rows, columns), hidden.map(rows, columns)))
            }
            (Some(_), TensorMaps::Stored) => Some((destination, destination.add(1))),
            (Some((rows, columns)), TensorMaps::Store) => {
                let args = StoreTensorMapsArgs {
                    destination,
                    lm_head: tensor_map("lm_head", lm_head, rows, l2_promotion(columns))?.0,
                    hidden: tensor_map("hidden", hidden, columns, l2_promotion(columns))?.0,
                };
                // SAFETY: the workspace starts with room for two 64-byte aligned maps, and only
                // this stream's work touches it.
                unsafe { self.launch(stream, Kernel::StoreTensorMaps, 1, &args)? };
                Some((destination, destination.add(1)))
            }
        })
    }

    /// Queues the tile kernel and the merge kernel of a planned fused call, the merge kernel
    /// writing into its tokens or winners.
    ///
    /// # Safety
    /// The context is current; the call's buffers hold its extents and the workspace the
    /// plan's; the maps as [`Kernels::tensor_maps`] states.
    pub(crate) unsafe fn enqueue_fused(
        &self,
        stream: sys::CUstream,
        call: &FusedCall,
        plan: &FusedPlan,
        maps: TensorMaps,
        workspace: DeviceWorkspace,
    ) -> Result<()> {
        // SAFETY: per this function's contract.
        unsafe { self.enqueue_tiles(stream, call, plan, maps, workspace, ReduceTarget::of(call), DevicePtr::NULL) }
    }

    /// Queues the tile kernel and the merge kernel of a planned fused call, the merge kernel
    /// writing into `target`; with `tile_sums` (`[B, tiles]` terms) not null, the tile kernel
    /// writes each (row, tile)'s log-sum-exp terms there in the pass of the row's first draws.
    ///
    /// # Safety
    /// As [`Kernels::enqueue_fused`]; `target` holds `B · draws.count` slots (and its terms `B`
    /// rows), `tile_sums` (if not null) `B · tiles` terms and the plan's variant writes them
    /// (`Kernel::writes_tile_sums`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn enqueue_tiles(
        &self,
        stream: sys::CUstream,
        call: &FusedCall,
        plan: &FusedPlan,
        maps: TensorMaps,
        workspace: DeviceWorkspace,
        target: ReduceTarget,
        tile_sums: DevicePtr<RowSums>,
    ) -> Result<()> {
        let vocab_offset = call.shard.map_or(0, |shard| shard.vocab_offset as u32);
        let FusedPlan { variant, tiles, samples, .. } = *plan;
        let (lm_head, hidden) = (&call.lm_head, &call.hidden);
        let kernel = variant.fused_kernel(lm_head.dtype);
        // SAFETY: the workspace holds the plan's bytes; the maps per this function's contract.
        let maps = unsafe { self.tensor_maps(stream, variant, lm_head, hidden, maps, workspace)? };
        let candidates = DevicePtr::<Candidate>::new(workspace.address + WORKSPACE_MAPS_BYTES as u64);
        let element_bytes = lm_head.dtype.bytes() as u64;
        let row_params = DevicePtr::<RowParams>::new(call.row_params);
        let processing = DevicePtr::<RowProcessing>::new(call.processing.unwrap_or(0));
        // SAFETY: the candidates of the largest pass fit the workspace (the plan); the row
        // parameters and tokens hold the call's extents (this function's contract).
        unsafe {
            self.queue_passes(stream, &plan.passes, tiles, row_params, candidates, target, samples, |pass, launch| {
                // The noise is keyed by the draw's index: the pass's first draw, after `draws.first`.
                let draw_offset = call.draws.first + pass.first_sample as u32;
                let items = tiles as u64 * launch.batch.div_ceil(variant.columns()) as u64;
                // The terms are written once per row, in the pass of its first draws.
                let tile_sums = match pass.first_sample {
                    0 => tile_sums.add_unless_null(pass.first_row as u64 * tiles as u64),
                    _ => DevicePtr::NULL,
                };
                if let Some(maps) = maps {
                    let args = TmaArgs {
                        row_params: launch.row_params,
                        out: candidates.cast(),
                        // A pass's rows start at its first row, in the processing blocks as in
                        // the row parameters.
                        processing: processing.add_unless_null(pass.first_row as u64),
                        tile_sums,
                        batch: launch.batch,
                        hidden_row0: pass.first_row as u32,
                        draw_offset,
                        samples: pass.samples as u32,
                        vocab_offset,
                        ..tma_args(maps, lm_head, hidden, tiles)
                    };
                    // SAFETY: the maps describe the call's matrices.
                    return self.launch(stream, kernel, items, &args);
                }
                let first_row_bytes = pass.first_row as u64 * hidden.row_stride as u64 * element_bytes;
                let args = FusedArgs {
                    lm_head: DevicePtr::new(lm_head.address),
                    hidden: DevicePtr::new(hidden.address + first_row_bytes),
                    row_params: launch.row_params,
                    candidates,
                    processing: processing.add_unless_null(pass.first_row as u64),
                    tile_sums,
                    tile_tops: DevicePtr::NULL,
                    tile_chains: DevicePtr::NULL,
                    truncation: DevicePtr::NULL,
                    vocab: lm_head.rows as u32,
                    dim: lm_head.cols as u32,
                    batch: launch.batch,
                    draw_offset,
                    samples: pass.samples as u32,
                    tiles: tiles as u32,
                    lm_head_stride: lm_head.row_stride as u32,
                    hidden_stride: hidden.row_stride as u32,
                    vocab_offset,
                    padding: 0,
                };
                // SAFETY: the matrices hold their extents (this function's contract).
                self.launch(stream, kernel, items, &args)
            })
        }
    }

    /// A fused call with log-probabilities: the tiles write each (row, tile)'s terms beside
    /// their candidates, the merge kernel merges the terms per row into the part and writes the
    /// winners there, and `winner_logits` gives the winners their raw and processed logits (one
    /// dot product each: the tiles keep no logits) or, for an unsharded call, writes its tokens
    /// and log-probabilities (what the shard merge of its one part would).
    ///
    /// # Safety
    /// As [`Kernels::enqueue_fused`], with `fused` and `plan` the call's fused form and its
    /// plan, `sums` their terms' plan.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn enqueue_fused_logprobs(
        &self,
        stream: sys::CUstream,
        call: &Call,
        fused: &FusedCall,
        plan: &FusedPlan,
        sums: &FusedSums,
        maps: TensorMaps,
        workspace: DeviceWorkspace,
    ) -> Result<()> {
        let base = DevicePtr::<u8>::new(workspace.address);
        let batch = call.hidden.rows;
        let vocab_offset = call.vocab_offset();
        let (part, layout) = call.part(base.byte_add(sums.part_at as u64).address());
        let part = DevicePtr::<u8>::new(part);
        let tile_sums = base.byte_add(sums.tile_sums_at as u64).cast::<RowSums>();
        let mut target = WinnerTarget::bare(part.cast::<ShardWinner>(), vocab_offset);
        (target.part_sums, target.sum_parts) = (tile_sums, plan.tiles as u32);
        target.sums = part.byte_add(layout.sums).cast::<RowSums>();
        let (lm_head, hidden) = (&call.lm_head, &call.hidden);
        let mut args = WinnerLogitsArgs {
            lm_head: DevicePtr::new(lm_head.address),
            hidden: DevicePtr::new(hidden.address),
            winners: target.winners,
            processing: call.processing.per_entry_blocks(),
            tokens: DevicePtr::NULL,
            logprobs: DevicePtr::NULL,
            processed_logprobs: DevicePtr::NULL,
            top: DevicePtr::NULL,
            sums: target.sums,
            row_params: DevicePtr::new(call.row_params),
            vocab: lm_head.rows as u32,
            dim: lm_head.cols as u32,
            batch: batch as u32,
            samples: call.draws.count,
            lm_head_stride: lm_head.row_stride as u32,
            hidden_stride: hidden.row_stride as u32,
            vocab_offset,
            padding: 0,
        };
        if let CallTarget::Tokens { tokens, logprobs, top_logprobs } = call.target {
            let slots = (batch * call.draws.count as usize) as u64;
            let raw = DevicePtr::<f32>::new(logprobs);
            (args.tokens, args.logprobs, args.processed_logprobs) = (DevicePtr::new(tokens), raw, raw.add(slots));
            args.top = DevicePtr::new(top_logprobs);
        }
        let kernel = Kernel::WinnerLogits { element: element_type(lm_head.dtype) };
        // A block per winner.
        let winners = batch as u64 * call.draws.count as u64;
        // SAFETY: the workspace holds the terms and the part past the candidates (the plan),
        // the fused variant writes the terms (the plan); then the winners are in the part, and
        // `W`, `H`, the processing and the outputs hold their extents (this function's
        // contract).
        unsafe {
            self.enqueue_tiles(stream, fused, plan, maps, workspace, ReduceTarget::Winners(target), tile_sums)?;
            self.launch(stream, kernel, winners, &args)
        }
    }

    /// Queues, for each pass of `passes`, `tile_kernel` (which writes the pass's candidates)
    /// and the merge kernel into the pass's slots of the `[B, samples]` tokens or winners,
    /// gated on `gate` unless null.
    ///
    /// # Safety
    /// The context is current; `candidates` holds the largest pass's `rows × samples × tiles`
    /// candidates, `row_params` `B` entries, `target` `B × samples` slots (and its logits, if
    /// any, `B` rows); `tile_kernel` queues a kernel that writes every candidate of its pass on
    /// `stream`; `gate`, if not null, is a word written before on `stream`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn queue_passes(
        &self,
        stream: sys::CUstream,
        passes: &Passes,
        tiles: usize,
        row_params: DevicePtr<RowParams>,
        candidates: DevicePtr<Candidate>,
        target: ReduceTarget,
        samples: u32,
        mut tile_kernel: impl FnMut(&Pass, &TileLaunch) -> Result<()>,
    ) -> Result<()> {
        for pass in passes.passes() {
            let launch = TileLaunch { row_params: row_params.add(pass.first_row as u64), batch: pass.rows as u32 };
            tile_kernel(&pass, &launch)?;
            let first_slot = (pass.first_row * samples as usize) as u64;
            let mut reduce = reduce_args(
                candidates,
                launch.row_params,
                launch.batch,
                pass.samples as u32,
                tiles as u32,
                pass.first_sample as u32,
                samples,
            );
            match target {
                ReduceTarget::Tokens(tokens) => reduce.tokens = tokens.add(first_slot),
                ReduceTarget::Winners(target) => {
                    let first_logit = pass.first_row as u64 * target.logits_stride as u64;
                    let first_row = pass.first_row as u64;
                    reduce.winners = target.winners.add(first_slot);
                    reduce.raw = target.raw.add_unless_null(first_logit);
                    reduce.processed = target.processed.add_unless_null(first_logit);
                    // The terms are merged once per row, in the pass of its first draws.
                    if pass.first_sample == 0 {
                        reduce.part_sums = target.part_sums.add_unless_null(first_row * target.sum_parts as u64);
                        reduce.sum_parts = target.sum_parts;
                        reduce.sums = target.sums.add_unless_null(first_row);
                    }
                    (reduce.logits_stride, reduce.vocab_offset) = (target.logits_stride, target.vocab_offset);
                }
            }
            // SAFETY: the tile kernel just wrote `rows × samples × tiles` candidates; the tokens
            // hold `B × samples` slots (this function's contract).
            unsafe { self.launch(stream, Kernel::ReduceCandidates, (pass.rows * pass.samples) as u64, &reduce)? };
        }
        Ok(())
    }
}

/// The merge kernel's arguments over `candidates` (`[batch · samples · tiles]`) with no output
/// set: draws `draw_offset ..` of rows `token_stride` slots apart; the caller sets the tokens
/// or a shard's winners.
pub(crate) fn reduce_args(
    candidates: DevicePtr<Candidate>,
    row_params: DevicePtr<RowParams>,
    batch: u32,
    samples: u32,
    tiles: u32,
    draw_offset: u32,
    token_stride: u32,
) -> ReduceArgs {
    ReduceArgs {
        candidates,
        tokens: DevicePtr::NULL,
        winners: DevicePtr::NULL,
        raw: DevicePtr::NULL,
        processed: DevicePtr::NULL,
        row_params,
        part_sums: DevicePtr::NULL,
        sums: DevicePtr::NULL,
        batch,
        samples,
        tiles,
        draw_offset,
        token_stride,
        logits_stride: 0,
        vocab_offset: 0,
        sum_parts: 0,
    }
}
