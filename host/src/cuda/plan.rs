//! Where every check of a GPU call happens, once: a [`Request`] and its [`Target`] become a
//! [`Plan`], which says which path the call takes, how its workspace is laid out and in how
//! many segments it runs. Enqueueing a plan (`super::enqueue`) only launches.
//!
//! A call takes one of three paths, with the same tokens for the same logits:
//! - fused: rows with per-entry steps only (soft-cap, bias, mask, penalties) go through the
//!   tile kernels of plain sampling, which apply the steps to each logits quad; with
//!   log-probabilities the tiles also write each (row, tile)'s log-sum-exp terms;
//! - listed, for one shard's rows that all have top-k, or whose truncation is min-p alone,
//!   without log-probabilities, on the `mma.sync` and SIMT tiles: the tiles write each (row,
//!   tile)'s first entries, or each (row, draw, tile)'s chain, and the listed or chained
//!   sampler decides and draws from them ([`ListedPlan`]), with a gated fallback behind it
//!   (the tile's GEMM and a sampler of whole rows) for the rows those do not settle;
//! - materialised, for rows that need their whole row (min-p, top-k, top-p, top entries): the
//!   unfused GEMM writes the logits into the workspace (`[B, V]` f32, twice with
//!   log-probabilities: raw and processed), the processing pipeline processes them, and the
//!   logits sampler draws from them with the plain path's noise.
//!
//! A sharded call's stage 1 ends in its part of the gathered parts; after the gather its last
//! segment merges the parts into tokens. A verification's last segment ends in its verdicts. The truncations of rows split over shards are decided
//! by the shards together: stage 1 then runs in segments, between which the shards reduce
//! what their processing kernels merged into their exchange buffers (each row's largest logit,
//! then per digit of each selection the row's histogram).

use flashsample_core::Candidate;
use flashsample_core::abi::{
    LOGITS_SAMPLER_TILE, MEMBER_CAPACITY, ProcessRowState, RowSums, ShardExchangeLayout, ShardPartLayout,
    TENSOR_MAP_BYTES, maxima_per_row,
};
use flashsample_core::chain::Chain;
use flashsample_core::registry::Kernel;
use flashsample_core::truncation::TileTop;

use super::batch::{ProcessingRef, VerifiedRef};
use super::dispatch::{Variant, handoff_tile, mma_sync_tile};
use super::memory::{MatrixRef, ResidentMaps, check_address};
use super::modules::Kernels;
use super::passes::{CANDIDATE_BUDGET_BYTES, Passes};
use super::request::{DeviceWorkspace, Request, Shard, Target, part_layout};
use crate::error::{Result, invalid};
use crate::params::{Draws, HeadShape, VocabShard, check_head_shape, check_request_shape};
use crate::tensor::MatrixShape;

/// Bytes at the start of a call's workspace that hold its two tensor maps.
pub(crate) const WORKSPACE_MAPS_BYTES: usize = 2 * TENSOR_MAP_BYTES;

/// Offsets in a workspace are 64-byte aligned.
fn align(bytes: usize) -> usize {
    bytes.next_multiple_of(64)
}

/// One call's stage 1 as the kernels see it: addresses and shapes, every rule checked.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Call {
    /// `W[V, D]` (a shard's rows with [`CallTarget::Shard`]).
    pub lm_head: MatrixRef,
    /// `H[B, D]`.
    pub hidden: MatrixRef,
    /// `[B]` row parameters.
    pub row_params: u64,
    pub draws: Draws,
    pub variant: Variant,
    /// The rows' processing for the whole vocabulary.
    pub processing: ProcessingRef,
    pub target: CallTarget,
}

/// Where stage 1 writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum CallTarget {
    /// `[B, N]` tokens and, unless 0, the log-probabilities and top log-probabilities.
    Tokens { tokens: u64, logprobs: u64, top_logprobs: u64 },
    /// A shard's part for the shard merge at `part`, with the terms of log-probabilities if
    /// `logprobs`; `exchange` (0 for none) is the buffer the shards decide truncations in.
    Shard { vocab_offset: usize, vocab: usize, part: u64, logprobs: bool, exchange: u64 },
}

/// The fused tiles' call: plain sampling with the per-entry steps (if any) applied in the
/// tiles, into tokens or a shard's winners.
#[derive(Clone, Copy, Debug)]
pub(crate) struct FusedCall {
    pub lm_head: MatrixRef,
    pub hidden: MatrixRef,
    pub row_params: u64,
    /// `[B, draws.count]` tokens (unread with `shard`).
    pub tokens: u64,
    pub draws: Draws,
    pub variant: Variant,
    /// `[B]` processing blocks the tiles apply, or none.
    pub processing: Option<u64>,
    /// `Some`: `W` is a vocabulary shard and the call writes its winners.
    pub shard: Option<ShardWinners>,
}

/// A fused call over a vocabulary shard: `[B, draws.count]` winners at `winners`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ShardWinners {
    pub vocab_offset: usize,
    pub vocab: usize,
    pub winners: u64,
}

impl Call {
    pub fn logprobs(&self) -> bool {
        match self.target {
            CallTarget::Tokens { logprobs, .. } => logprobs != 0,
            CallTarget::Shard { logprobs, .. } => logprobs,
        }
    }

    /// The vocabulary the processing and the noise are keyed over.
    fn vocab(&self) -> usize {
        match self.target {
            CallTarget::Tokens { .. } => self.lm_head.rows,
            CallTarget::Shard { vocab, .. } => vocab,
        }
    }

    /// `W`'s row 0 as a global index.
    pub fn vocab_offset(&self) -> u32 {
        match self.target {
            CallTarget::Tokens { .. } => 0,
            CallTarget::Shard { vocab_offset, .. } => vocab_offset as u32,
        }
    }

    /// Where the call's part lies (the shard's, or `own_part` in the workspace for an
    /// unsharded call) and its layout.
    pub fn part(&self, own_part: u64) -> (u64, ShardPartLayout) {
        let layout = ShardPartLayout::of(self.hidden.rows as u32, self.draws.count, self.logprobs());
        match self.target {
            CallTarget::Tokens { .. } => (own_part, layout),
            CallTarget::Shard { part, .. } => (part, layout),
        }
    }

    /// The call's fused form with no processing, writing tokens to `tokens`.
    fn plain(&self, tokens: u64) -> FusedCall {
        FusedCall {
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

    /// The call's fused form, when no row needs its whole row: the tile kernels apply the
    /// per-entry steps (and, with log-probabilities, sum each tile's terms).
    fn fused(&self) -> Option<FusedCall> {
        if self.processing.whole_row.is_some() {
            return None;
        }
        let processing = self.processing.per_entry.then_some(self.processing.address);
        let (tokens, shard) = match self.target {
            CallTarget::Tokens { tokens, .. } => (tokens, None),
            CallTarget::Shard { vocab_offset, vocab, part, .. } => {
                (0, Some(ShardWinners { vocab_offset, vocab, winners: part }))
            }
        };
        Some(FusedCall { processing, shard, ..self.plain(tokens) })
    }
}

/// A checked fused call's launch plan.
#[derive(Clone, Copy, Debug)]
pub(crate) struct FusedPlan {
    /// The resolved tile variant.
    pub variant: Variant,
    /// Vocabulary tiles of that variant.
    pub tiles: usize,
    pub passes: Passes,
    /// Draws per row.
    pub samples: u32,
    /// The workspace the call needs: its tensor maps and the largest pass's candidates.
    pub workspace_bytes: usize,
}

/// What a fused call with log-probabilities adds to its tiles' workspace (byte offsets after
/// the candidates): each (row, tile)'s log-sum-exp terms, and the unsharded call's one part,
/// which `winner_logits` turns into tokens and log-probabilities.
#[derive(Clone, Copy, Debug)]
pub(crate) struct FusedSums {
    pub tile_sums_at: usize,
    pub part_at: usize,
    pub workspace_bytes: usize,
}

impl FusedSums {
    fn new(plan: &FusedPlan, batch: usize, samples: u32, own_part: bool) -> FusedSums {
        let tile_sums_at = align(plan.workspace_bytes);
        let part_at = align(tile_sums_at + batch * plan.tiles * size_of::<RowSums>());
        let part = match own_part {
            true => ShardPartLayout::of(batch as u32, samples, true).bytes as usize,
            false => 0,
        };
        FusedSums { tile_sums_at, part_at, workspace_bytes: part_at + part }
    }
}

/// A materialised call's launch plan and where its scratch lies in the workspace (byte
/// offsets; the tensor maps first).
#[derive(Clone, Copy, Debug)]
pub(crate) struct MaterialisedPlan {
    pub variant: Variant,
    /// Row stride of the logits (V rounded up to a quad).
    pub stride: usize,
    /// The logits sampler's tiles and passes.
    pub tiles: usize,
    pub passes: Passes,
    /// Copies of the logits: 2 when the processing pipeline writes processed logits beside raw
    /// ones that log-probabilities still need.
    pub copies: usize,
    /// The processing pipeline's slices per row, when it runs (a row needs its whole row).
    pub process_slices: Option<usize>,
    /// Log-sum-exp terms per row with log-probabilities: the processing pipeline's slices.
    pub sum_parts: usize,
    pub logits_at: usize,
    pub part_sums_at: usize,
    /// The processing pipeline's `[B]` row states.
    pub states_at: usize,
    /// The processing pipeline's `[B, MEMBER_CAPACITY]` member lists.
    pub members_at: usize,
    /// The GEMM's `[B, ⌈V / MAXIMA_ROWS⌉]` maxima, from which a pipeline without log-probabilities
    /// takes its rows' largest logits (`ProcessStep::Extrema`).
    pub maxima_at: usize,
    /// A shard's exchange with the other shards (in the target's buffer), when its rows
    /// truncate.
    pub exchange: Option<ShardExchangeLayout>,
    /// The unsharded call's one part.
    pub part_at: usize,
    pub workspace_bytes: usize,
}

/// What a listed call's tiles write for each row, and so which sampler decides it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Summaries {
    /// `[B, tiles]` lists of each (row, tile)'s first processed entries
    /// ([`flashsample_core::truncation::TileTop`]), for rows that all have top-k; the listed
    /// sampler decides them.
    Lists,
    /// `[B, N, tiles]` chains of each (row, draw, tile) ([`Chain`]), for rows whose truncation
    /// is min-p alone; the chained sampler decides them.
    Chains,
}

impl Summaries {
    /// Bytes of a call's summaries.
    fn bytes(self, batch: usize, samples: u32, tiles: usize) -> usize {
        match self {
            Summaries::Lists => batch * tiles * size_of::<TileTop>(),
            Summaries::Chains => batch * samples as usize * tiles * size_of::<Chain>(),
        }
    }
}

/// A listed call's plan (one shard, no log-probabilities, every row with top-k or every row's
/// truncation min-p alone): the tile kernel of `variant` writes each row's summaries (lists
/// of first processed entries, or each draw's chains), the listed or chained sampler decides
/// each row's truncations from them and draws its candidates, and the merge kernel turns
/// them into tokens. Between the two, for the rows whose summaries did not settle (rare on
/// real logits), the GEMM of the same tile writes the call's logits (the summaries' own bits)
/// and the fallback sampler decides and draws those rows from their whole rows; both are
/// gated on the count of such rows, so they do nothing when it is 0.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ListedPlan {
    /// The tiles' call: the per-entry steps applied, the summaries written, no candidates.
    pub tiles_call: FusedCall,
    /// An `mma.sync` or SIMT tile, or the handoff tile for lists (the cooperative TMA tiles
    /// write no summaries); its tensor maps, if TMA, start the workspace.
    pub variant: Variant,
    pub summaries: Summaries,
    pub tiles: usize,
    pub samples: u32,
    /// Row stride of the fallback's logits (V rounded up to a quad).
    pub stride: usize,
    /// `[B, stride]` f32 logits of the fallback's GEMM.
    pub logits_at: usize,
    /// The summaries ([`Summaries::bytes`]).
    pub summaries_at: usize,
    /// `[B · N]` candidates, one per (row, draw).
    pub candidates_at: usize,
    /// `[B]` flags of the rows whose lists did not settle.
    pub flags_at: usize,
    /// The count of those rows: the fallback's gate.
    pub unsettled_at: usize,
    pub workspace_bytes: usize,
}

/// A call's path: the fused tiles' (with their terms when the call has log-probabilities), the
/// listed sampler's, or the materialised pipeline's.
#[derive(Clone, Copy, Debug)]
pub(crate) enum PathPlan {
    Fused(FusedCall, FusedPlan, Option<FusedSums>),
    Listed(ListedPlan),
    Materialised(MaterialisedPlan),
}

impl PathPlan {
    pub fn workspace_bytes(&self) -> usize {
        match self {
            PathPlan::Fused(_, plan, sums) => sums.map_or(plan.workspace_bytes, |sums| sums.workspace_bytes),
            PathPlan::Listed(plan) => plan.workspace_bytes,
            PathPlan::Materialised(plan) => plan.workspace_bytes,
        }
    }

    /// The tile variant whose tensor maps the call reads (if TMA).
    pub fn variant(&self) -> Variant {
        match self {
            PathPlan::Fused(_, plan, _) => plan.variant,
            PathPlan::Listed(plan) => plan.variant,
            PathPlan::Materialised(plan) => plan.variant,
        }
    }

    /// Stage 1's segments: 1, or with an exchange 2 plus its exchanged digits (the logits
    /// and per-entry steps; then each digit's histograms; then the rest).
    pub fn segments(&self) -> usize {
        match self {
            PathPlan::Materialised(MaterialisedPlan { exchange: Some(exchange), .. }) => 2 + exchange.digits as usize,
            _ => 1,
        }
    }
}

/// The shard merge: the parts of `shards` vocabulary shards, side by side from `parts`,
/// become tokens and, unless `out_logprobs` is 0, their log-probabilities, with top
/// log-probabilities unless `out_top_logprobs` is 0 (the layouts of [`Target`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct MergeCall {
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
    pub tokens: u64,
    pub out_logprobs: u64,
    pub out_top_logprobs: u64,
}

impl MergeCall {
    /// The merge's rules: shards, B and N in 32-bit range, aligned addresses, outputs that the
    /// parts can fill.
    pub fn check(&self) -> Result<ShardPartLayout> {
        if self.shards == 0 || self.shards > u32::MAX as usize {
            return Err(invalid("shards", format!("{}: must be at least 1 and below 2^32", self.shards)));
        }
        let layout = part_layout(self.rows, self.samples, self.logprobs)?;
        if self.processing.rows != self.rows {
            return Err(invalid(
                "processing",
                format!("uploaded for B = {}; the parts hold B = {}", self.processing.rows, self.rows),
            ));
        }
        check_address("parts", self.parts, 16)?;
        check_address("row_params", self.row_params, align_of::<flashsample_core::RowParams>())?;
        check_outputs(self.tokens, self.out_logprobs, self.out_top_logprobs, self.processing.top_logprobs())?;
        if self.out_logprobs != 0 && !self.logprobs {
            return Err(invalid("logprobs", "has room for log-probabilities; the parts were made without them"));
        }
        Ok(layout)
    }
}

/// Where a TMA call's tensor maps come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum TensorMaps {
    /// Encoded on the host for this call and written to the start of the call's workspace by
    /// a kernel on the stream (the matrices may change from call to call).
    Store,
    /// Already at the start of the call's workspace, written by an earlier call there for the
    /// same matrices and boxes.
    Stored,
    /// Kept with the matrices' buffers for the lifetime of the call.
    Resident { lm_head: ResidentMaps, hidden: ResidentMaps },
}

/// Where a sharded call's exchange buffer lies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ExchangeAt {
    /// At the start of the workspace, `bytes` of it (a multiple of 256, so that the call's
    /// own scratch after it stays aligned); the call clears it in its first segment.
    Workspace { bytes: usize },
    /// Shared with other shards of one device at this address, cleared by their driver.
    Shared(u64),
}

/// A checked call: what [`crate::StreamSampler::enqueue`] runs, segment by segment, and the
/// workspace it needs. It holds the addresses of the request's memory, not the memory: the
/// memory must outlive every enqueue of the plan.
#[derive(Clone, Copy, Debug)]
pub struct Plan {
    pub(crate) call: Call,
    pub(crate) path: PathPlan,
    pub(crate) maps: TensorMaps,
    /// With a sharded request: the merge after the gather, and the gather.
    pub(crate) merge: Option<MergeCall>,
    pub(crate) gather: Option<GatherPlan>,
    pub(crate) exchange: Option<ExchangeAt>,
    /// With a verification batch: the verdicts after the tokens.
    pub(crate) verdicts: Option<VerdictCall>,
}

/// A verification's verdicts: over the call's `[B]` tokens, each of `sequences`' count of kept
/// drafts into `accepted`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct VerdictCall {
    pub tokens: u64,
    pub sequences: VerifiedRef,
    pub accepted: u64,
}

/// A sharded call's gather: `count` parts of `part_bytes` at `parts`, this shard's the
/// `index`-th.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct GatherPlan {
    pub parts: u64,
    pub part_bytes: usize,
    pub index: usize,
    pub count: usize,
}

impl Plan {
    /// Checks `request` and `target` for `kernels` and plans the call with the tile
    /// `variant` (`Auto`: the dispatcher's).
    pub(crate) fn new(kernels: &Kernels, request: &Request, target: &Target, variant: Variant) -> Result<Plan> {
        let (lm_head, hidden) = (request.lm_head.matrix, request.hidden.matrix);
        let batch = &request.batch;
        if batch.rows != hidden.rows {
            return Err(invalid(
                "batch",
                format!("{} rows for B = {} hidden rows: one per row", batch.rows, hidden.rows),
            ));
        }
        let draws = request.draws.check()?;
        let (rows, count) = (hidden.rows, draws.count);
        let slots = rows * count as usize;
        let logprobs = target.logprobs.is_some();
        if batch.logprobs && !logprobs {
            return Err(invalid("target.logprobs", "none, but a row of the batch reports log-probabilities"));
        }
        check_len("target.tokens", target.tokens.len, slots)?;
        if let Some(values) = &target.logprobs {
            check_len("target.logprobs", values.len, Target::logprobs_len(rows, count))?;
        }
        if let Some(words) = &target.top_logprobs {
            check_len("target.top_logprobs", words.len, Target::top_logprobs_len(rows))?;
        }
        let (tokens, out_logprobs, out_top) = (
            target.tokens.address,
            target.logprobs.as_ref().map_or(0, |s| s.address),
            target.top_logprobs.as_ref().map_or(0, |s| s.address),
        );
        let vocab = request.shard.map_or(lm_head.rows, |shard| shard.tokens.vocab);
        let processing = batch.processing(vocab);
        let (call_target, merge, gather, exchange) = match request.shard {
            None => {
                if target.parts.is_some() {
                    return Err(invalid("target.parts", "given, but the request is not sharded"));
                }
                let call_target = CallTarget::Tokens { tokens, logprobs: out_logprobs, top_logprobs: out_top };
                (call_target, None, None, None)
            }
            Some(shard) => {
                let Shard { tokens: VocabShard { offset, vocab }, index, count: shards } = shard;
                if index >= shards {
                    return Err(invalid("shard.index", format!("{index}: must be below the count of {shards} shards")));
                }
                let parts = target.parts.as_ref().ok_or_else(|| {
                    invalid("target.parts", "none: a sharded request gathers every shard's part there")
                })?;
                let part_bytes = part_layout(rows, count, logprobs)?.bytes as usize;
                check_len("target.parts", parts.len, shards * part_bytes)?;
                let merge = MergeCall {
                    parts: parts.address,
                    shards,
                    rows,
                    samples: count,
                    logprobs,
                    row_params: batch.row_params,
                    processing,
                    tokens,
                    out_logprobs,
                    out_top_logprobs: out_top,
                };
                merge.check()?;
                let gather = GatherPlan { parts: parts.address, part_bytes, index, count: shards };
                // Shards decide the truncations together only when there are others.
                let exchange_bytes = ShardExchangeLayout::of(rows as u32, processing.selections).bytes as usize;
                let exchange = (shards > 1 && processing.truncates())
                    .then(|| ExchangeAt::Workspace { bytes: exchange_bytes.next_multiple_of(256) });
                // The address is planned below, after the workspace's size is known; here only
                // whether there is one.
                let part = parts.address + (index * part_bytes) as u64;
                let exchange_address = exchange.map_or(0, |_| EXCHANGE_PLANNED);
                let call_target =
                    CallTarget::Shard { vocab_offset: offset, vocab, part, logprobs, exchange: exchange_address };
                (call_target, Some(merge), Some(gather), exchange)
            }
        };
        let verdicts = match (batch.verified, &target.accepted) {
            (None, None) => None,
            (None, Some(_)) => return Err(invalid("target.accepted", "given, but the batch verifies no drafts")),
            (Some(_), None) => {
                return Err(invalid("target.accepted", "none: a verification writes each sequence's verdict there"));
            }
            (Some(sequences), Some(accepted)) => {
                if count != 1 {
                    return Err(invalid(
                        "request.draws",
                        format!("{count} draws: a verification draws one token per position"),
                    ));
                }
                check_len("target.accepted", accepted.len, sequences.count)?;
                Some(VerdictCall { tokens, sequences, accepted: accepted.address })
            }
        };
        let call =
            Call { lm_head, hidden, row_params: batch.row_params, draws, variant, processing, target: call_target };
        let path = plan_path(kernels, &call)?;
        let maps = match (path.variant().tma_boxes(), request.lm_head.maps, request.hidden.maps) {
            (Some(_), Some(lm_head), Some(hidden)) => TensorMaps::Resident { lm_head, hidden },
            _ => TensorMaps::Store,
        };
        Ok(Plan { call, path, maps, merge, gather, exchange, verdicts })
    }

    /// Bytes of workspace the call needs (64-byte aligned): the exchange with the other
    /// shards, if any, then the tensor maps and candidates, and on the materialised path the
    /// logits (`B · V` floats, or twice that with log-probabilities) and terms.
    pub fn workspace_bytes(&self) -> usize {
        self.stage_offset() + self.path.workspace_bytes()
    }

    /// How many segments the call runs in ([`crate::StreamSampler::enqueue`]): 1 for an
    /// unsharded call; stage 1's (more than one when a row truncates over several shards),
    /// then the merge, for a sharded one.
    pub fn segments(&self) -> usize {
        self.path.segments() + usize::from(self.merge.is_some())
    }

    /// Whether the call's segments end in exchanges with other shards (a sharded request over
    /// several shards): only a collective can queue it.
    pub fn exchanges(&self) -> bool {
        self.gather.is_some_and(|gather| gather.count > 1)
    }

    /// Whether the call reads the tensor maps an earlier call left at the start of its
    /// workspace (the Hopper module's TMA tiles; elsewhere no call has maps).
    pub(crate) fn reads_maps(&self) -> bool {
        self.path.variant().tma_boxes().is_some()
    }

    /// The plan reading the tensor maps an earlier call on the same workspace left there
    /// instead of writing them: one launch fewer on the Hopper module's TMA tiles. Only for
    /// calls that read the same `W` and `H` (same memory, shapes and strides) with the same
    /// plan as that call; [`crate::StreamSampler::enqueue`] states the rule.
    pub fn with_stored_maps(mut self) -> Plan {
        if self.maps == TensorMaps::Store {
            self.maps = TensorMaps::Stored;
        }
        self
    }

    /// The plan with its exchange in a buffer shared by the shards of one device at
    /// `address` (their kernels merge into it, so nothing is left to reduce), which their
    /// driver clears before the first segment.
    pub(crate) fn share_exchange(mut self, address: u64) -> Plan {
        if let Some(ExchangeAt::Workspace { .. }) = self.exchange {
            self.exchange = Some(ExchangeAt::Shared(address));
        }
        self
    }

    /// Bytes of the workspace before the call's own scratch: its exchange's, if it keeps it
    /// there.
    pub(crate) fn stage_offset(&self) -> usize {
        match self.exchange {
            Some(ExchangeAt::Workspace { bytes }) => bytes,
            _ => 0,
        }
    }

    /// The stage-1 call with its exchange placed for `workspace`, and the workspace left for
    /// its own scratch.
    pub(crate) fn placed(&self, workspace: DeviceWorkspace) -> Result<(Call, DeviceWorkspace)> {
        check_address("workspace", workspace.address, 64)?;
        if workspace.bytes < self.workspace_bytes() {
            return Err(invalid(
                "workspace",
                format!(
                    "{} bytes: this call needs {} (Plan::workspace_bytes)",
                    workspace.bytes,
                    self.workspace_bytes()
                ),
            ));
        }
        let offset = self.stage_offset();
        let mut call = self.call;
        if let CallTarget::Shard { exchange, .. } = &mut call.target {
            *exchange = match self.exchange {
                Some(ExchangeAt::Workspace { .. }) => workspace.address,
                Some(ExchangeAt::Shared(address)) => address,
                None => 0,
            };
        }
        let stage = DeviceWorkspace { address: workspace.address + offset as u64, bytes: workspace.bytes - offset };
        Ok((call, stage))
    }
}

/// An aligned, non-null exchange address for planning only: a path's plan reads whether
/// there is an exchange, never its memory.
const EXCHANGE_PLANNED: u64 = 256;

/// The rule of an output of `len` values named `what` that must hold `needed`.
fn check_len(what: &str, len: usize, needed: usize) -> Result<()> {
    if len < needed {
        return Err(invalid(what, format!("room for {len} values; the call writes {needed}")));
    }
    Ok(())
}

/// Checks `call` and plans its path.
pub(crate) fn plan_path(kernels: &Kernels, call: &Call) -> Result<PathPlan> {
    let vocab = call.vocab();
    let processing = &call.processing;
    let batch = call.hidden.rows;
    if processing.rows != batch || processing.vocab != vocab {
        return Err(invalid(
            "processing",
            format!(
                "uploaded for B = {}, V = {}; the request has B = {batch}, V = {vocab}",
                processing.rows, processing.vocab
            ),
        ));
    }
    let exchange_at = match call.target {
        CallTarget::Shard { exchange, .. } => exchange,
        CallTarget::Tokens { .. } => 0,
    };
    if let Some(row) = processing.truncating
        && call.lm_head.rows != vocab
        && exchange_at == 0
    {
        return Err(invalid(
            format!("processing[{row}]"),
            format!(
                "min-p, top-k and top-p need the whole vocabulary in one shard (this one holds {} of V = {vocab}) or an exchange with the other shards",
                call.lm_head.rows
            ),
        ));
    }
    match call.target {
        CallTarget::Tokens { tokens, logprobs, top_logprobs } => {
            check_outputs(tokens, logprobs, top_logprobs, processing.top_logprobs())?
        }
        CallTarget::Shard { part, exchange, .. } => {
            check_address("part", part, 16)?;
            if exchange != 0 {
                check_address("exchange", exchange, 16)?;
            }
        }
    }
    if let Some(fused) = call.fused() {
        let plan = plan_fused(kernels, &fused)?;
        if !call.logprobs() {
            return Ok(PathPlan::Fused(fused, plan, None));
        }
        if !plan.variant.fused_kernel(fused.lm_head.dtype).writes_tile_sums() {
            return Err(invalid(
                "variant",
                format!("{:?} does not sum log-sum-exp terms for log-probabilities; use another", plan.variant),
            ));
        }
        let own_part = matches!(call.target, CallTarget::Tokens { .. });
        let sums = FusedSums::new(&plan, batch, plan.samples, own_part);
        return Ok(PathPlan::Fused(fused, plan, Some(sums)));
    }
    // The materialised path: the shape rules of plain sampling, then its own.
    let output = match call.target {
        CallTarget::Tokens { tokens, .. } => tokens,
        CallTarget::Shard { part, .. } => part,
    };
    let samples = check_fused(&call.plain(output))?;
    if let CallTarget::Shard { vocab_offset, vocab, .. } = call.target {
        VocabShard { offset: vocab_offset, vocab }.check(call.lm_head.rows)?;
    }
    let (lm_head, hidden) = (&call.lm_head, &call.hidden);
    let resolved = resolve(kernels, lm_head, hidden, call.variant)?;
    if let Some((variant, summaries)) = listed_variant(call, resolved) {
        return Ok(PathPlan::Listed(listed_plan(call, variant, summaries, samples)));
    }
    let process_slices = match processing.whole_row {
        Some(_) => Some(process_slices(kernels.resident_blocks(Kernel::ProcessRows)?, batch, lm_head.rows)),
        None => None,
    };
    let mut plan = materialised_plan(
        resolved,
        lm_head.rows,
        batch,
        samples,
        process_slices,
        call.logprobs(),
        matches!(call.target, CallTarget::Tokens { .. }),
    );
    if exchange_at != 0 && processing.truncates() {
        plan.exchange = Some(ShardExchangeLayout::of(batch as u32, processing.selections));
    }
    Ok(PathPlan::Materialised(plan))
}

/// The largest B at which the dispatcher's tile chains min-p rows. Up to it the chained step
/// took as long as the materialised one (within 1 % at B = 1 on the portable module), past
/// it longer (1.01–1.07× at B = 16, 1.23–1.59× at B = 64): the chain epilogue's search costs
/// more per batch column than the materialised selection (docs/PERF.md). A tile the caller
/// names chains at any B.
const CHAINED_MAX_BATCH: usize = 8;

/// The largest B at which the Hopper module lists on the `mma.sync` tile of B
/// ([`mma_sync_tile`]) in place of its cooperative TMA tile; past it on the handoff tile.
/// Measured in one call (docs/PERF.md): the `mma.sync` tile's lists 1–3 % faster at B = 1
/// and 16, the handoff tile's 2–4 % faster at B = 64 and 18–44 % past it.
const LISTED_ON_MMA_SYNC_MAX_BATCH: usize = 16;

/// The tile and summaries of a listed call ([`ListedPlan`]), or `None` for the materialised
/// path: one shard, no log-probabilities or top entries, one candidate per (row, draw) within
/// [`CANDIDATE_BUDGET_BYTES`]; lists where every row has top-k, chains where every row's
/// truncation is min-p alone and the chains take no more memory than the logits they stand
/// for; and a tile that writes them: the resolved `mma.sync` (register-direct or staged) or
/// SIMT tile, or for lists the handoff tile (resolved, or in place of the dispatcher's
/// cooperative TMA tile the `mma.sync` tile of B up to [`LISTED_ON_MMA_SYNC_MAX_BATCH`] rows
/// and the handoff tile of B past it, [`handoff_tile`]); chains only on the `mma.sync` and
/// SIMT tiles as resolved, and with the dispatcher's tile up to [`CHAINED_MAX_BATCH`] rows.
/// A cooperative TMA tile the caller names keeps the materialised path (it writes no
/// summaries), and so does a tile without a chain kernel ([`Variant::chains_kernel`]) for
/// chains.
fn listed_variant(call: &Call, resolved: Variant) -> Option<(Variant, Summaries)> {
    let processing = &call.processing;
    let (batch, samples) = (call.hidden.rows, call.draws.count);
    let eligible = matches!(call.target, CallTarget::Tokens { .. })
        && !call.logprobs()
        && processing.truncates()
        && !processing.top_logprobs()
        && batch * samples as usize * size_of::<Candidate>() <= CANDIDATE_BUDGET_BYTES;
    let chains_allowed = call.variant != Variant::Auto || batch <= CHAINED_MAX_BATCH;
    let summaries = match (eligible, processing.listable, processing.chainable) {
        (true, true, _) => Summaries::Lists,
        (true, false, true) if chains_allowed => Summaries::Chains,
        _ => return None,
    };
    let variant = match resolved {
        Variant::Mma { .. } | Variant::Staged { .. } | Variant::Simt => resolved,
        // In place of the TMA tile the chained step measured slower than the materialised one
        // at every B (docs/PERF.md): chains only where the tile writes them as resolved.
        _ if summaries == Summaries::Chains => return None,
        Variant::TmaHandoff { .. } => resolved,
        _ if call.variant == Variant::Auto && batch <= LISTED_ON_MMA_SYNC_MAX_BATCH => mma_sync_tile(batch),
        _ if call.variant == Variant::Auto => handoff_tile(batch),
        _ => return None,
    };
    let vocab = call.lm_head.rows;
    let tiles = vocab.div_ceil(variant.tile_rows() as usize);
    let fits = summaries.bytes(batch, samples, tiles) <= batch * vocab.next_multiple_of(4) * 4
        && variant.chains_kernel(call.lm_head.dtype).is_some();
    (summaries == Summaries::Lists || fits).then_some((variant, summaries))
}

/// The listed plan of `call` on `variant` with `summaries`: room for the tensor maps, the
/// fallback's logits, then the summaries, the candidates, the row flags and the count.
fn listed_plan(call: &Call, variant: Variant, summaries: Summaries, samples: u32) -> ListedPlan {
    let batch = call.hidden.rows;
    let vocab = call.lm_head.rows;
    let tiles = vocab.div_ceil(variant.tile_rows() as usize);
    let stride = vocab.next_multiple_of(4);
    let logits_at = WORKSPACE_MAPS_BYTES;
    let summaries_at = align(logits_at + batch * stride * 4);
    let candidates_at = align(summaries_at + summaries.bytes(batch, samples, tiles));
    let flags_at = align(candidates_at + batch * samples as usize * size_of::<Candidate>());
    let unsettled_at = align(flags_at + batch * 4);
    let processing = call.processing.per_entry.then_some(call.processing.address);
    let tiles_call = FusedCall { variant, processing, ..call.plain(0) };
    ListedPlan {
        tiles_call,
        variant,
        summaries,
        tiles,
        samples,
        stride,
        logits_at,
        summaries_at,
        candidates_at,
        flags_at,
        unsettled_at,
        workspace_bytes: unsettled_at + 64,
    }
}

/// Checks a fused call and plans it.
pub(crate) fn plan_fused(kernels: &Kernels, call: &FusedCall) -> Result<FusedPlan> {
    let samples = check_fused(call)?;
    let plan = plan_shape(kernels, &call.lm_head, &call.hidden, samples, call.variant)?;
    if call.processing.is_some() && !plan.variant.fused_kernel(call.lm_head.dtype).applies_processing() {
        return Err(invalid(
            "variant",
            format!("{:?} does not apply per-row processing (no registers to spare); use another", plan.variant),
        ));
    }
    Ok(plan)
}

/// The fused plan of `samples` draws of each row of `hidden` from `lm_head` with `variant`.
pub(crate) fn plan_shape(
    kernels: &Kernels,
    lm_head: &MatrixRef,
    hidden: &MatrixRef,
    samples: u32,
    variant: Variant,
) -> Result<FusedPlan> {
    let variant = resolve(kernels, lm_head, hidden, variant)?;
    let tiles = lm_head.rows.div_ceil(variant.tile_rows() as usize);
    let passes = Passes::new(hidden.rows, samples as usize, tiles, CANDIDATE_BUDGET_BYTES);
    let workspace_bytes = WORKSPACE_MAPS_BYTES + passes.candidate_pairs() * tiles * size_of::<Candidate>();
    Ok(FusedPlan { variant, tiles, passes, samples, workspace_bytes })
}

/// The tile `variant` resolves to for these matrices in `kernels`' module.
pub(crate) fn resolve(kernels: &Kernels, lm_head: &MatrixRef, hidden: &MatrixRef, variant: Variant) -> Result<Variant> {
    let aligned = lm_head.rows_16_byte_aligned() && hidden.rows_16_byte_aligned();
    variant.resolve_aligned(kernels.module(), lm_head.dtype, lm_head.cols, hidden.rows, aligned)
}

/// The rules of a fused call that do not depend on the module: shapes, strides, dtypes,
/// alignments, and draws. Returns the draws per row.
pub(crate) fn check_fused(call: &FusedCall) -> Result<u32> {
    let (lm_head, hidden) = (&call.lm_head, &call.hidden);
    check_head_shape(lm_head.rows, lm_head.cols)?;
    lm_head.check("lm_head")?;
    hidden.check("hidden")?;
    let samples = call.draws.check()?.count;
    // The shape rules every backend applies (B, D, dtypes); one row of parameters per row of H.
    let head = HeadShape { vocab: lm_head.rows, dim: lm_head.cols, dtype: lm_head.dtype };
    let hidden_shape = MatrixShape { rows: hidden.rows, cols: hidden.cols, dtype: hidden.dtype };
    check_request_shape(head, hidden_shape, hidden.rows, "row_params", samples)?;
    check_address("row_params", call.row_params, align_of::<flashsample_core::RowParams>())?;
    if call.shard.is_none() {
        check_address("tokens", call.tokens, align_of::<u32>())?;
    }
    if let Some(shard) = call.shard {
        VocabShard { offset: shard.vocab_offset, vocab: shard.vocab }.check(lm_head.rows)?;
        check_address("shard.winners", shard.winners, align_of::<flashsample_core::abi::ShardWinner>())?;
    }
    Ok(samples)
}

/// The fewest quads of a row one slice of the processing pipeline takes (one per thread).
const MIN_SLICE_QUADS: usize = flashsample_core::abi::PROCESS_THREADS as usize;

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
/// of the processing pipeline with log-probabilities, the pipeline's row states and member
/// lists, and the unsharded call's one part (`own_part`). Without `process_slices` (the
/// unfused comparison) there are neither terms nor states nor lists.
pub(crate) fn materialised_plan(
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
    let passes = Passes::new(batch, samples as usize, tiles, CANDIDATE_BUDGET_BYTES);
    let copies = if process_slices.is_some() && logprobs { 2 } else { 1 };
    let sum_parts = process_slices.unwrap_or(0);
    let logits_at = align(WORKSPACE_MAPS_BYTES + passes.candidate_pairs() * tiles * size_of::<Candidate>());
    let part_sums_at = align(logits_at + copies * batch * stride * 4);
    let part_sums = if logprobs { batch * sum_parts * size_of::<RowSums>() } else { 0 };
    let states_at = align(part_sums_at + part_sums);
    let states = if process_slices.is_some() { batch * size_of::<ProcessRowState>() } else { 0 };
    let members_at = align(states_at + states);
    let members = if process_slices.is_some() { batch * MEMBER_CAPACITY as usize * 4 } else { 0 };
    let maxima_at = align(members_at + members);
    let maxima = match process_slices.is_some() && !logprobs {
        true => batch * maxima_per_row(vocab as u32) as usize * 4,
        false => 0,
    };
    let part_at = align(maxima_at + maxima);
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
        members_at,
        maxima_at,
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
        0 if top_asked => Err(invalid("top_logprobs", "none, but a row asks for its top log-probabilities")),
        0 => Ok(()),
        _ if logprobs == 0 => Err(invalid("top_logprobs", "top entries need log-probabilities: logprobs is none")),
        at => check_address("top_logprobs", at, 4),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::DType;
    use flashsample_core::abi::LOGITS_SAMPLER_TILE;

    /// The materialised plan's regions (maps, candidates, logits, terms, row states, member
    /// lists, the GEMM's maxima, the one part) follow each other without overlap, each 64-byte
    /// aligned, and hold what the kernels write: two logits copies only with the processing
    /// pipeline and log-probabilities, terms per slice only with log-probabilities (which take
    /// the pipeline), row states and member lists only with the pipeline, maxima only with the
    /// pipeline and without log-probabilities, a part only for an unsharded call.
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
                let members = if process_slices.is_some() { batch * MEMBER_CAPACITY as usize * 4 } else { 0 };
                let maxima = match process_slices.is_some() && !logprobs {
                    true => batch * maxima_per_row(vocab as u32) as usize * 4,
                    false => 0,
                };
                let part =
                    if own_part { ShardPartLayout::of(batch as u32, samples, logprobs).bytes as usize } else { 0 };
                assert_eq!((plan.stride % 4, plan.stride >= vocab, plan.copies), (0, true, copies));
                assert_eq!(plan.sum_parts, parts);
                for at in
                    [plan.logits_at, plan.part_sums_at, plan.states_at, plan.members_at, plan.maxima_at, plan.part_at]
                {
                    assert_eq!(at % 64, 0);
                }
                assert!(WORKSPACE_MAPS_BYTES + candidates <= plan.logits_at);
                assert!(plan.logits_at + copies * batch * plan.stride * 4 <= plan.part_sums_at);
                assert!(plan.part_sums_at + terms <= plan.states_at);
                assert!(plan.states_at + states <= plan.members_at);
                assert!(plan.members_at + members <= plan.maxima_at);
                assert!(plan.maxima_at + maxima <= plan.part_at);
                assert_eq!(plan.workspace_bytes, plan.part_at + part);
            }
        }
    }

    /// A call of `batch` rows over V = 151,936 whose processing is `listable` (every row has
    /// top-k; otherwise every row's truncation is min-p alone) and truncating, into tokens (with log-probabilities if `logprobs`) or a shard's
    /// part, with `variant` asked for.
    fn truncating_call(batch: usize, listable: bool, logprobs: bool, shard: bool, variant: Variant) -> Call {
        let vocab = 151_936;
        let processing = ProcessingRef {
            address: 1 << 20,
            rows: batch,
            vocab,
            whole_row: Some(0),
            truncating: Some(0),
            per_entry: false,
            selections: 0,
            listable,
            chainable: !listable,
        };
        let target = match shard {
            false => CallTarget::Tokens { tokens: 256, logprobs: if logprobs { 512 } else { 0 }, top_logprobs: 0 },
            true => CallTarget::Shard { vocab_offset: 0, vocab, part: 1024, logprobs, exchange: 0 },
        };
        Call {
            lm_head: MatrixRef::contiguous(1 << 30, vocab, 4096, DType::BF16),
            hidden: MatrixRef::contiguous(1 << 29, batch, 4096, DType::BF16),
            row_params: 2048,
            draws: Draws::first(2),
            variant,
            processing,
            target,
        }
    }

    /// The listed path takes one shard's rows that all have top-k, without log-probabilities,
    /// on a tile that lists (`mma.sync`, staged, SIMT, handoff), or the dispatcher's
    /// cooperative TMA tile swapped for the `mma.sync` tile of B up to B = 16 and for the
    /// handoff tile of B past it; a cooperative TMA tile named by
    /// the caller, log-probabilities, a shard, top entries or a row without top-k keep the
    /// materialised path, as do more draws than one candidate each fits the budget.
    #[test]
    fn a_call_is_listed_only_where_its_lists_can_decide_it() {
        let lists = |call: &Call, resolved| {
            listed_variant(call, resolved).map(|(variant, summaries)| {
                assert_eq!(summaries, Summaries::Lists);
                variant
            })
        };
        let tma = Variant::Tma { rows: 128, columns: 16 };
        let call = truncating_call;
        let mma = Variant::Mma { columns: 16 };
        let (handoff, wide_handoff) = (Variant::TmaHandoff { columns: 64 }, Variant::TmaHandoff { columns: 128 });
        assert_eq!(lists(&call(16, true, false, false, Variant::Auto), mma), Some(mma));
        assert_eq!(lists(&call(16, true, false, false, Variant::Auto), Variant::Simt), Some(Variant::Simt));
        assert_eq!(lists(&call(16, true, false, false, Variant::Auto), tma), Some(mma));
        assert_eq!(lists(&call(1, true, false, false, Variant::Auto), tma), Some(Variant::Mma { columns: 8 }));
        assert_eq!(lists(&call(17, true, false, false, Variant::Auto), tma), Some(handoff));
        assert_eq!(lists(&call(64, true, false, false, Variant::Auto), handoff), Some(handoff));
        assert_eq!(lists(&call(256, true, false, false, Variant::Auto), wide_handoff), Some(wide_handoff));
        assert_eq!(lists(&call(16, true, false, false, wide_handoff), wide_handoff), Some(wide_handoff));
        assert_eq!(
            lists(&call(200, true, false, false, Variant::Auto), Variant::Staged { columns: 64 }),
            Some(Variant::Staged { columns: 64 })
        );
        let staged = Variant::Staged { columns: 128 };
        assert_eq!(lists(&call(16, true, false, false, staged), staged), Some(staged));
        assert_eq!(lists(&call(16, true, false, false, tma), tma), None);
        assert_eq!(lists(&call(16, true, true, false, Variant::Auto), mma), None);
        assert_eq!(lists(&call(16, true, false, true, Variant::Auto), mma), None);
        let mut top = call(16, true, false, false, Variant::Auto);
        top.processing.selections = flashsample_core::abi::Selection::TopRaw.bit();
        assert_eq!(lists(&top, mma), None);
        let pairs = (CANDIDATE_BUDGET_BYTES / size_of::<Candidate>()) as u32;
        let fits = Call { draws: Draws::first(pairs / 16), ..call(16, true, false, false, Variant::Auto) };
        assert_eq!(lists(&fits, mma), Some(mma));
        let beyond = Call { draws: Draws::first(pairs / 16 + 1), ..call(16, true, false, false, Variant::Auto) };
        assert_eq!(lists(&beyond, mma), None);
    }

    /// Rows whose truncation is min-p alone take the chained path on the tile as resolved (not
    /// in place of a TMA tile), up to CHAINED_MAX_BATCH rows unless the caller names the
    /// tile, while their chains take no more memory than the logits; rows
    /// with top-p alone (neither listable nor chainable) stay materialised.
    #[test]
    fn a_call_is_chained_only_where_its_chains_fit() {
        let chained = |call: &Call, resolved| listed_variant(call, resolved);
        let min_p = |batch, draws: u32| Call {
            draws: Draws::first(draws),
            ..truncating_call(batch, false, false, false, Variant::Auto)
        };
        let named = |batch, variant| Call { variant, ..min_p(batch, 1) };
        let mma = Variant::Mma { columns: 8 };
        assert_eq!(chained(&min_p(8, 2), mma), Some((mma, Summaries::Chains)));
        assert_eq!(chained(&min_p(8, 2), Variant::Simt), Some((Variant::Simt, Summaries::Chains)));
        // Past CHAINED_MAX_BATCH rows only a tile the caller names chains.
        let (wider, staged) = (Variant::Mma { columns: 16 }, Variant::Staged { columns: 64 });
        assert_eq!(chained(&min_p(16, 1), wider), None);
        assert_eq!(chained(&named(16, wider), wider), Some((wider, Summaries::Chains)));
        assert_eq!(chained(&min_p(200, 1), staged), None);
        assert_eq!(chained(&named(200, staged), staged), Some((staged, Summaries::Chains)));
        let widest = Variant::Staged { columns: 128 };
        assert_eq!(chained(&named(200, widest), widest), None);
        let handoff = Variant::TmaHandoff { columns: 64 };
        assert_eq!(chained(&min_p(1, 1), Variant::Tma { rows: 128, columns: 8 }), None);
        assert_eq!(chained(&named(64, handoff), handoff), None);
        // 160-byte chains per draw of a 128-entry tile against its 512 bytes of logits.
        assert_eq!(chained(&min_p(8, 3), mma), Some((mma, Summaries::Chains)));
        assert_eq!(chained(&min_p(8, 4), mma), None);
        let mut top_p = min_p(8, 1);
        top_p.processing.chainable = false;
        assert_eq!(chained(&top_p, mma), None);
        let mut logprobs = min_p(8, 1);
        logprobs.target = CallTarget::Tokens { tokens: 256, logprobs: 512, top_logprobs: 0 };
        assert_eq!(chained(&logprobs, mma), None);
    }

    /// A listed plan's tensor maps, logits, summaries, candidates, flags and count follow one
    /// another without overlap, 64-byte aligned.
    #[test]
    fn listed_regions_follow_one_another() {
        let cases = [
            (1usize, 1u32, Variant::Mma { columns: 8 }, Summaries::Lists),
            (37, 3, Variant::Simt, Summaries::Lists),
            (5, 4, Variant::Staged { columns: 64 }, Summaries::Chains),
            (256, 1, Variant::TmaHandoff { columns: 128 }, Summaries::Lists),
        ];
        for (batch, samples, variant, summaries) in cases {
            let listable = summaries == Summaries::Lists;
            let call = Call { draws: Draws::first(samples), ..truncating_call(batch, listable, false, false, variant) };
            let plan = listed_plan(&call, variant, summaries, samples);
            let tiles = 151_936usize.div_ceil(128);
            assert_eq!((plan.tiles, plan.stride), (tiles, 151_936));
            let regions = [plan.logits_at, plan.summaries_at, plan.candidates_at, plan.flags_at, plan.unsettled_at];
            assert!(regions.iter().all(|at| at % 64 == 0));
            assert!(WORKSPACE_MAPS_BYTES <= plan.logits_at);
            assert!(plan.logits_at + batch * plan.stride * 4 <= plan.summaries_at);
            assert!(plan.summaries_at + summaries.bytes(batch, samples, tiles) <= plan.candidates_at);
            assert!(plan.candidates_at + batch * samples as usize * size_of::<Candidate>() <= plan.flags_at);
            assert!(plan.flags_at + batch * 4 <= plan.unsettled_at);
            assert!(plan.unsettled_at + 4 <= plan.workspace_bytes);
            assert_eq!(plan.tiles_call.variant, variant);
        }
    }

    /// A fused call's terms and part follow its candidates without overlap, 64-byte aligned:
    /// `[B, tiles]` terms, then the one part of an unsharded call.
    #[test]
    fn fused_sums_follow_the_candidates() {
        for (vocab, batch, samples) in [(1usize, 1usize, 1u32), (5003, 9, 3), (151_936, 64, 1), (128_257, 256, 2)] {
            let tiles = vocab.div_ceil(128);
            let passes = Passes::new(batch, samples as usize, tiles, CANDIDATE_BUDGET_BYTES);
            let workspace_bytes = WORKSPACE_MAPS_BYTES + passes.candidate_pairs() * tiles * size_of::<Candidate>();
            let variant = Variant::Tma { rows: 128, columns: 8 };
            let plan = FusedPlan { variant, tiles, passes, samples, workspace_bytes };
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
}
