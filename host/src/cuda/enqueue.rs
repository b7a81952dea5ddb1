//! Running a [`Plan`]: one segment of one call ([`Kernels::enqueue_segment`]) and the one
//! driver that runs every segment of one or more calls in order, handing what each segment
//! ends with (an exchange between vocabulary shards) to the caller's collective
//! ([`drive`]).

use cudarc::driver::sys;
use flashsample_core::abi::DevicePtr;

use super::driver;
use super::modules::Kernels;
use super::plan::{ExchangeAt, PathPlan, Plan};
use super::request::{DeviceWorkspace, Exchange, part_layout};
use crate::error::{Result, invalid};

impl Kernels {
    /// Queues segment `segment` of `plan` on `stream` and returns the exchange every shard of
    /// the call makes before its next segment (`None` when there is none); the context is
    /// current.
    ///
    /// # Safety
    /// The plan's memory holds its extents and stays allocated, unchanged, and touched by no
    /// other stream, until `stream` has run past the call; `stream` is a stream of this
    /// context; the workspace is only this stream's, untouched by others between the
    /// segments; an exchange is completed on `stream` before the next segment; stored maps
    /// (`Plan::with_stored_maps`) are the last ones written to this workspace, for the same
    /// matrices and boxes.
    pub(crate) unsafe fn enqueue_segment(
        &self,
        stream: sys::CUstream,
        plan: &Plan,
        workspace: DeviceWorkspace,
        segment: usize,
    ) -> Result<Option<Exchange>> {
        if segment >= plan.segments() {
            return Err(invalid("segment", format!("{segment}: the call has {} segments", plan.segments())));
        }
        let (call, stage) = plan.placed(workspace)?;
        if segment == 0
            && let Some(ExchangeAt::Workspace { bytes }) = plan.exchange
        {
            // SAFETY: the workspace starts with the exchange's bytes (the plan), only this
            // stream's.
            unsafe {
                driver::fill_words_async("shard exchange", DevicePtr::new(workspace.address), 0, bytes / 4, stream)?
            };
        }
        let stages = plan.path.segments();
        let exchange = if segment < stages {
            // SAFETY: per this function's contract; `stage` is the call's own scratch.
            let exchange = unsafe {
                match &plan.path {
                    PathPlan::Fused(fused, fused_plan, None) => {
                        self.enqueue_fused(stream, fused, fused_plan, plan.maps, stage).map(|_| None)?
                    }
                    PathPlan::Fused(fused, fused_plan, Some(sums)) => self
                        .enqueue_fused_logprobs(stream, &call, fused, fused_plan, sums, plan.maps, stage)
                        .map(|_| None)?,
                    PathPlan::Listed(listed) => {
                        self.enqueue_listed(stream, &call, listed, plan.maps, stage).map(|_| None)?
                    }
                    PathPlan::Materialised(materialised) => {
                        self.enqueue_materialised(stream, &call, materialised, plan.maps, stage, segment)?
                    }
                }
            };
            // Stage 1 over: the shards' parts are gathered.
            let gathered = match plan.gather {
                Some(gather) if segment + 1 == stages && gather.count > 1 => Some(Exchange::AllGather {
                    parts: gather.parts,
                    part_bytes: gather.part_bytes,
                    index: gather.index,
                    count: gather.count,
                }),
                _ => None,
            };
            exchange.or(gathered)
        } else {
            let merge = plan.merge.expect("a call's segment past stage 1 is its merge");
            let layout = part_layout(merge.rows, merge.samples, merge.logprobs)?;
            // SAFETY: every shard's part was written (stage 1) and gathered before this segment
            // on `stream`; the outputs hold their extents (this function's contract).
            unsafe { self.queue_merge(stream, &layout, &merge)? };
            None
        };
        if segment + 1 == plan.segments()
            && let Some(verdicts) = &plan.verdicts
        {
            // SAFETY: the call's tokens were written before on `stream` (its last segment); the
            // sequences, drafts and verdicts hold their extents (this function's contract).
            unsafe { self.queue_verdicts(stream, verdicts)? };
        }
        Ok(exchange)
    }
}

/// One call of [`drive`]: its kernels, the stream it runs on, its plan and workspace.
pub(crate) struct Planned<'a> {
    pub kernels: &'a Kernels,
    pub stream: sys::CUstream,
    pub plan: Plan,
    pub workspace: DeviceWorkspace,
}

/// Queues every segment of `calls` (segment `k` of each call before segment `k + 1` of any,
/// each in its kernels' context, which is restored after), handing after each segment the
/// exchanges its calls ended with (call index and exchange) to `exchange`, which completes
/// them on the calls' streams.
///
/// # Safety
/// As [`Kernels::enqueue_segment`] for every call; `exchange` queues each exchange on its
/// call's stream.
pub(crate) unsafe fn drive(
    calls: &[Planned<'_>],
    mut exchange: impl FnMut(&[(usize, Exchange)]) -> Result<()>,
) -> Result<()> {
    let segments = calls.iter().map(|call| call.plan.segments()).max().unwrap_or(0);
    for segment in 0..segments {
        let mut ended = Vec::new();
        for (c, call) in calls.iter().enumerate().filter(|(_, call)| segment < call.plan.segments()) {
            // SAFETY: per this function's contract.
            let queued = unsafe {
                driver::in_context(call.kernels.context, || {
                    call.kernels.enqueue_segment(call.stream, &call.plan, call.workspace, segment)
                })?
            };
            ended.extend(queued.map(|x| (c, x)));
        }
        if !ended.is_empty() {
            exchange(&ended)?;
        }
    }
    Ok(())
}
