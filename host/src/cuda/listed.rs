//! The listed path's launches ([`ListedPlan`]): the tile kernel writes each row's summaries
//! and no candidates (each (row, tile)'s list of first processed entries, or each (row, draw,
//! tile)'s chain), the listed or chained sampler decides each row's truncations from them and
//! writes one candidate per (row, draw), the GEMM of the same tile and the fallback sampler
//! (both gated on the count of rows whose summaries did not settle) decide and draw those
//! rows from their logits, and the merge kernel turns the candidates into tokens.

use cudarc::driver::sys;
use flashsample_core::abi::{DevicePtr, FusedArgs, ReduceArgs, RowProcessing, SampleListedArgs, TmaArgs};
use flashsample_core::chain::Chain;
use flashsample_core::registry::Kernel;
use flashsample_core::truncation::TileTop;
use flashsample_core::{Candidate, RowParams};

use super::dispatch::Variant;
use super::driver;
use super::modules::Kernels;
use super::plan::{Call, CallTarget, FusedCall, ListedPlan, Summaries, TensorMaps};
use super::request::DeviceWorkspace;
use super::tiles::{MapPair, reduce_args, tma_args};
use crate::error::{Result, invalid};

impl Kernels {
    /// Queues a listed call.
    ///
    /// # Safety
    /// The context is current; the call's buffers hold its extents and the workspace the
    /// plan's, only this stream's; the maps as [`Kernels::tensor_maps`] states.
    pub(crate) unsafe fn enqueue_listed(
        &self,
        stream: sys::CUstream,
        call: &Call,
        plan: &ListedPlan,
        maps: TensorMaps,
        workspace: DeviceWorkspace,
    ) -> Result<()> {
        let CallTarget::Tokens { tokens, .. } = call.target else {
            return Err(invalid("target", "a listed call writes tokens, not a shard's part"));
        };
        let base = DevicePtr::<u8>::new(workspace.address);
        let logits = base.byte_add(plan.logits_at as u64).cast::<f32>();
        let summaries = base.byte_add(plan.summaries_at as u64);
        let (tops, chains) = match plan.summaries {
            Summaries::Lists => (summaries.cast::<TileTop>(), DevicePtr::NULL),
            Summaries::Chains => (DevicePtr::NULL, summaries.cast::<Chain>()),
        };
        let candidates = base.byte_add(plan.candidates_at as u64).cast::<Candidate>();
        let unsettled = base.byte_add(plan.unsettled_at as u64).cast::<u32>();
        let (lm_head, hidden) = (&call.lm_head, &call.hidden);
        let batch = hidden.rows as u32;
        let args = SampleListedArgs {
            tile_tops: tops,
            tile_chains: chains,
            logits,
            row_params: DevicePtr::<RowParams>::new(call.row_params),
            processing: call.processing.blocks(),
            entry_processing: call.processing.per_entry_blocks(),
            candidates,
            row_unsettled: base.byte_add(plan.flags_at as u64).cast::<u32>(),
            unsettled,
            batch,
            tiles: plan.tiles as u32,
            // The noise is keyed by the draw's index, after `draws.first`.
            draw_offset: call.draws.first,
            samples: plan.samples,
            vocab: lm_head.rows as u32,
            logits_stride: plan.stride as u32,
        };
        let reduce = ReduceArgs {
            tokens: DevicePtr::new(tokens),
            ..reduce_args(candidates, args.row_params, batch, plan.samples, 1, 0, plan.samples)
        };
        // SAFETY: the workspace holds the plan's regions, the call's buffers their extents
        // (this function's contract); on `stream`, the count is cleared before the listed or
        // chained sampler adds to it, the summaries written before it reads them, its flags
        // and count before the gated GEMM and fallback read them, and every candidate before
        // the merge; the handoff tile's maps (at the workspace's start) serve its GEMM too,
        // whose boxes are the same.
        unsafe {
            let maps = self.tensor_maps(stream, plan.variant, lm_head, hidden, maps, workspace)?;
            driver::fill_words_async("unsettled rows", unsettled, 0, 1, stream)?;
            match plan.summaries {
                Summaries::Lists => {
                    self.queue_tile_lists(stream, &plan.tiles_call, plan.tiles, tops, maps)?;
                    self.launch(stream, Kernel::SampleListed, batch as u64, &args)?;
                }
                Summaries::Chains => {
                    self.queue_tile_chains(stream, &plan.tiles_call, plan.tiles, args.processing, chains)?;
                    self.launch(stream, Kernel::SampleChained, batch as u64, &args)?;
                }
            }
            let maxima = DevicePtr::NULL;
            self.queue_logits(stream, plan.variant, lm_head, hidden, maps, logits, plan.stride, maxima, unsettled)?;
            self.launch(stream, Kernel::SampleUnsettled, batch as u64, &args)?;
            self.launch(stream, Kernel::ReduceCandidates, batch as u64 * plan.samples as u64, &reduce)
        }
    }

    /// Queues the tile kernel of `call.variant` over every row with no draws: each (row, tile)'s
    /// list into `tops` (`[B, tiles]`). The cooperative TMA tiles write no lists (an error
    /// naming the variant); the handoff tile reads `maps`.
    ///
    /// # Safety
    /// The context is current; the call's matrices, row parameters and processing hold their
    /// extents, `tops` `B · tiles` lists; `maps` are the maps of `W` and `H` for the variant's
    /// boxes when it is a TMA tile ([`Kernels::tensor_maps`]).
    pub(crate) unsafe fn queue_tile_lists(
        &self,
        stream: sys::CUstream,
        call: &FusedCall,
        tiles: usize,
        tops: DevicePtr<TileTop>,
        maps: Option<MapPair>,
    ) -> Result<()> {
        let variant = call.variant;
        let kernel = variant.fused_kernel(call.lm_head.dtype);
        let items = summaries_items(call, tiles);
        match variant {
            Variant::Tma { .. } => {
                Err(invalid("variant", format!("{variant:?}: the cooperative TMA tiles do not write tile lists")))
            }
            Variant::TmaHandoff { .. } => {
                let Some(maps) = maps else {
                    return Err(invalid("maps", format!("{variant:?} reads tensor maps; none were given")));
                };
                let args = TmaArgs {
                    row_params: DevicePtr::new(call.row_params),
                    processing: DevicePtr::new(call.processing.unwrap_or(0)),
                    tile_tops: tops,
                    ..tma_args(maps, &call.lm_head, &call.hidden, tiles)
                };
                // SAFETY: per this function's contract.
                unsafe { self.launch(stream, kernel, items, &args) }
            }
            _ => {
                let args = FusedArgs { tile_tops: tops, ..summaries_args(call, tiles) };
                // SAFETY: per this function's contract.
                unsafe { self.launch(stream, kernel, items, &args) }
            }
        }
    }

    /// Queues the chain kernel of `call.variant` over every row and each of `call.draws`: each
    /// (row, draw, tile)'s chain into `chains` (`[B, N, tiles]`), each warp's floor from the
    /// rows' min-p in `truncation`.
    ///
    /// # Safety
    /// The context is current; the call's matrices, row parameters and processing hold their
    /// extents, `truncation` `B` blocks, `chains` `B · N · tiles` chains.
    pub(crate) unsafe fn queue_tile_chains(
        &self,
        stream: sys::CUstream,
        call: &FusedCall,
        tiles: usize,
        truncation: DevicePtr<RowProcessing>,
        chains: DevicePtr<Chain>,
    ) -> Result<()> {
        let variant = call.variant;
        let Some(kernel) = variant.chains_kernel(call.lm_head.dtype) else {
            return Err(invalid("variant", format!("{variant:?}: the TMA tiles do not write chains")));
        };
        let args = FusedArgs {
            tile_chains: chains,
            truncation,
            // The noise is keyed by the draw's index, after `draws.first`.
            draw_offset: call.draws.first,
            samples: call.draws.count,
            ..summaries_args(call, tiles)
        };
        // SAFETY: per this function's contract.
        unsafe { self.launch(stream, kernel, summaries_items(call, tiles), &args) }
    }
}

/// The argument block of a tile kernel over `call`'s rows that writes summaries in place of
/// candidates: no candidates, terms or draws; the caller sets its summaries.
fn summaries_args(call: &FusedCall, tiles: usize) -> FusedArgs {
    let (lm_head, hidden) = (&call.lm_head, &call.hidden);
    FusedArgs {
        lm_head: DevicePtr::new(lm_head.address),
        hidden: DevicePtr::new(hidden.address),
        row_params: DevicePtr::new(call.row_params),
        candidates: DevicePtr::NULL,
        processing: DevicePtr::new(call.processing.unwrap_or(0)),
        tile_sums: DevicePtr::NULL,
        tile_tops: DevicePtr::NULL,
        tile_chains: DevicePtr::NULL,
        truncation: DevicePtr::NULL,
        vocab: lm_head.rows as u32,
        dim: lm_head.cols as u32,
        batch: hidden.rows as u32,
        draw_offset: 0,
        samples: 0,
        tiles: tiles as u32,
        lm_head_stride: lm_head.row_stride as u32,
        hidden_stride: hidden.row_stride as u32,
        vocab_offset: 0,
        padding: 0,
    }
}

/// The work items of a summaries launch: every (tile, batch tile).
fn summaries_items(call: &FusedCall, tiles: usize) -> u64 {
    tiles as u64 * call.hidden.rows.div_ceil(call.variant.columns() as usize) as u64
}
