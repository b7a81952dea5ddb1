//! [`StreamSampler`]: the kernels loaded in a caller's context, and the one path every GPU
//! call takes: a [`Request`] and a [`Target`] are planned once ([`StreamSampler::plan`]) and
//! queued on a stream the caller gives, over memory the caller gives.
//!
//! Two layers: the raw one takes a stream as a driver handle and a workspace by address
//! ([`StreamSampler::enqueue`], `unsafe`), for callers with foreign memory (C/C++ engines,
//! any cudarc version); the safe one takes cudarc's `CudaStream` and a [`StreamWorkspace`]
//! ([`StreamSampler::enqueue_on`]) and covers every mode, CUDA graphs included. The owned
//! [`super::CudaSampler`], the tensor-parallel rank and the candle adapter queue through the
//! same plans.
//!
//! Architecture Invariant: a call queues work on the stream it is given and nowhere else; it
//! creates no context and no stream, allocates nothing but the growth of a safe workspace,
//! never waits for the device, and leaves the thread's current context as it found it. A
//! workspace serves one stream at a time: two streams sampling at once use two workspaces.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr as _, sys};
use flashsample_core::RowParams;
use flashsample_core::abi::{AdvanceStepsArgs, AdvanceVerifiedArgs, DevicePtr};
use flashsample_core::registry::{Kernel, Module};

use super::batch::DeviceBatch;
use super::dispatch::Variant;
use super::driver;
use super::enqueue::{Planned, drive};
use super::memory::{MatrixRef, check_address};
use super::modules::{Kernels, ModuleChoice};
use super::plan::{Plan, TensorMaps};
use super::request::{DeviceWorkspace, Exchange, Request, Target};
use crate::error::{Result, invalid};

/// The GPU sampling kernels loaded in one context; calls queue them on any stream of it.
///
/// `Send` and `Sync`: several threads and streams may sample with one `StreamSampler` at once,
/// each call with its own workspace.
///
/// ```no_run
/// use flashsample::cudarc::driver::CudaContext;
/// use flashsample::{
///     Batch, DeviceBatch, DeviceMatrix, Draws, ModuleChoice, OutputSlice, Request, SamplingParams, StreamSampler,
///     StreamWorkspace, Target,
/// };
/// let context = CudaContext::new(0)?;
/// let stream = context.new_stream()?;
/// let sampler = StreamSampler::on_context(&context, ModuleChoice::Auto)?;
/// let (vocab, dim, rows) = (32_000, 1024, 4);
/// // The model's buffers: W, H, and room for the tokens.
/// let w = stream.clone_htod(&vec![flashsample::half::bf16::from_f32(0.01); vocab * dim])?;
/// let h = stream.clone_htod(&vec![flashsample::half::bf16::from_f32(1.0); rows * dim])?;
/// let mut tokens = stream.alloc_zeros::<u32>(rows)?;
/// let batch = Batch::new((0..rows as u32).map(|r| SamplingParams::new(0.8, 7, r, 0)).collect());
/// let batch = DeviceBatch::upload(&stream, &batch, vocab)?;
/// let mut workspace = StreamWorkspace::new();
/// let request = Request {
///     lm_head: DeviceMatrix::of_slice(&w, &stream, vocab, dim)?,
///     hidden: DeviceMatrix::of_slice(&h, &stream, rows, dim)?,
///     batch: batch.view(&stream),
///     draws: Draws::first(1),
///     shard: None,
/// };
/// let target = Target::tokens(OutputSlice::of_slice(&mut tokens, &stream));
/// sampler.enqueue_on(&stream, &request, &target, &mut workspace)?; // queued, not waited for
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct StreamSampler {
    kernels: Kernels,
    /// Keeps a cudarc context alive for samplers made by [`StreamSampler::on_context`].
    _context_owner: Option<Arc<CudaContext>>,
}

impl StreamSampler {
    /// Loads the kernels into the caller's CUDA context: the module for its device, or the one
    /// `choice` names (`ModuleChoice::from_environment()` reads `FLASHSAMPLE_MODULE`). The
    /// thread's current context is restored before returning.
    ///
    /// # Safety
    /// `context` is a live `CUcontext` that outlives the sampler (for a primary context: keep
    /// it retained). The sampler unloads its module from it on [`StreamSampler::close`] or drop.
    pub unsafe fn new(context: *mut c_void, choice: ModuleChoice) -> Result<StreamSampler> {
        // SAFETY: per this function's contract.
        let kernels = unsafe { Kernels::load(context.cast(), choice)? };
        Ok(StreamSampler { kernels, _context_owner: None })
    }

    /// As [`StreamSampler::new`] on a cudarc context, which the sampler keeps alive.
    pub fn on_context(context: &Arc<CudaContext>, choice: ModuleChoice) -> Result<StreamSampler> {
        // SAFETY: the sampler holds a reference to the context, so it outlives the sampler.
        let mut sampler = unsafe { StreamSampler::new(context.cu_ctx().cast(), choice)? };
        sampler._context_owner = Some(context.clone());
        Ok(sampler)
    }

    /// The kernels of `module` with no context, for tests that record launches instead of
    /// making them.
    #[cfg(test)]
    pub(crate) fn recording(module: Module) -> StreamSampler {
        StreamSampler { kernels: Kernels::recording(module), _context_owner: None }
    }

    /// The raw context the kernels are loaded in.
    pub fn context(&self) -> *mut c_void {
        self.kernels.context.cast()
    }

    /// The device's name.
    pub fn device_name(&self) -> &str {
        &self.kernels.device_name
    }

    /// The device's multiprocessors.
    pub fn multiprocessors(&self) -> u32 {
        self.kernels.multiprocessors
    }

    /// The device's compute capability (major, minor).
    pub fn compute_capability(&self) -> (u32, u32) {
        self.kernels.compute_capability
    }

    /// The PTX module the kernels come from.
    pub fn module(&self) -> Module {
        self.kernels.module()
    }

    pub(crate) fn kernels(&self) -> &Kernels {
        &self.kernels
    }

    /// Checks `request` and `target` and plans the call: the path it takes, its workspace and
    /// its segments. Every rule is checked here, before anything is queued, as a typed error
    /// that names the argument.
    pub fn plan(&self, request: &Request, target: &Target) -> Result<Plan> {
        Plan::new(&self.kernels, request, target, Variant::Auto)
    }

    /// [`StreamSampler::plan`] with the tile `variant` forced (tests and benchmarks compare
    /// the tiles).
    #[cfg(feature = "internals")]
    pub fn plan_with_variant(&self, request: &Request, target: &Target, variant: Variant) -> Result<Plan> {
        Plan::new(&self.kernels, request, target, variant)
    }

    /// Queues segment `segment` of `plan` on the caller's `stream` and returns the exchange
    /// every shard of the call makes before its next segment ([`Exchange`]; `None` when there
    /// is none). An unsharded call has one segment; a sharded one runs stage 1 (in several
    /// segments when rows truncate over several shards), the gather of the parts, then the
    /// merge ([`Plan::segments`]). The caller's context is made current and the thread's
    /// previous context restored; nothing is allocated and nothing waits, so a CUDA graph can
    /// capture it.
    ///
    /// # Safety
    /// - `stream` is a live stream of this sampler's context, or `CU_STREAM_PER_THREAD` (the
    ///   calling thread's per-thread default stream: the work then orders with what this
    ///   thread queued there, so call from the thread that queues the model's work), or null
    ///   (the legacy default stream).
    /// - Lifetimes: the memory the planned request and target named (the raw views'
    ///   contracts), the [`DeviceBatch`] behind the request, and `workspace` (its `bytes`)
    ///   stay allocated, and `W`, `H` and the batch stay unchanged, until `stream` has run
    ///   past the call's last segment.
    /// - Streams: no other stream writes `W`, `H` or the batch, or touches the outputs or the
    ///   workspace, until `stream` has run past the call, unless the caller orders it after
    ///   with an event. A workspace serves one stream at a time, and no other call touches it
    ///   between two segments of a call.
    /// - Segments run in order, each after the exchanges before it have completed on
    ///   `stream`.
    /// - A plan that reads stored maps ([`Plan::with_stored_maps`]) follows, on the same
    ///   workspace, a call that wrote them for the same `W` and `H` (same memory, shapes and
    ///   strides) and the same plan, with nothing else written there between.
    pub unsafe fn enqueue(
        &self,
        stream: *mut c_void,
        plan: &Plan,
        workspace: DeviceWorkspace,
        segment: usize,
    ) -> Result<Option<Exchange>> {
        // SAFETY: per this function's contract.
        unsafe {
            driver::in_context(self.kernels.context, || {
                self.kernels.enqueue_segment(stream.cast(), plan, workspace, segment)
            })
        }
    }

    /// Queues the call `request` → `target` on `stream`, every segment of it: the safe layer
    /// over cudarc's handles. The views of the request and target must have been made for
    /// `stream` (or from raw or owned memory). The workspace grows on `stream` to what the
    /// call needs; under CUDA graph capture it must already have (reserve it first with
    /// [`StreamWorkspace::reserve`]), since an allocation made during capture would belong to
    /// the graph. A workspace remembers the tensor maps it holds, so a decode loop over the
    /// same `W` and `H` writes them once. Requests sharded over several shards exchange
    /// between their segments: `TensorParallelRank` (feature `nccl`) queues those.
    pub fn enqueue_on(
        &self,
        stream: &Arc<CudaStream>,
        request: &Request,
        target: &Target,
        workspace: &mut StreamWorkspace,
    ) -> Result<()> {
        // SAFETY: the views' memory is borrowed (or promised by their raw contracts) for as
        // long as they live, which covers this call; a plan that exchanges is refused.
        unsafe { self.enqueue_with(stream, request, target, workspace, Variant::Auto, None) }
    }

    /// [`StreamSampler::enqueue_on`] with the tile `variant` forced.
    #[cfg(feature = "internals")]
    pub fn enqueue_on_with_variant(
        &self,
        stream: &Arc<CudaStream>,
        request: &Request,
        target: &Target,
        workspace: &mut StreamWorkspace,
        variant: Variant,
    ) -> Result<()> {
        // SAFETY: as `enqueue_on`.
        unsafe { self.enqueue_with(stream, request, target, workspace, variant, None) }
    }

    /// Plans `request` → `target` with `variant` and queues every segment on `stream`,
    /// handing each exchange to `exchange`; without one, a plan that exchanges is refused
    /// before anything is queued.
    ///
    /// # Safety
    /// `exchange` completes each exchange on `stream`.
    pub(crate) unsafe fn enqueue_with(
        &self,
        stream: &Arc<CudaStream>,
        request: &Request,
        target: &Target,
        workspace: &mut StreamWorkspace,
        variant: Variant,
        mut exchange: Option<&mut dyn FnMut(Exchange) -> Result<()>>,
    ) -> Result<()> {
        if stream.context().cu_ctx() != self.kernels.context {
            return Err(invalid("stream", "belongs to another context than the sampler's"));
        }
        let ours = Some(stream.cu_stream());
        let views = [
            ("request.lm_head", request.lm_head.stream),
            ("request.hidden", request.hidden.stream),
            ("request.batch", request.batch.stream),
            ("target.tokens", target.tokens.stream),
            ("target.logprobs", target.logprobs.as_ref().and_then(|s| s.stream)),
            ("target.top_logprobs", target.top_logprobs.as_ref().and_then(|s| s.stream)),
            ("target.parts", target.parts.as_ref().and_then(|s| s.stream)),
        ];
        if let Some((what, _)) = views.iter().find(|(_, made_for)| made_for.is_some() && *made_for != ours) {
            return Err(invalid(*what, "a view made for another stream: make it for the stream the call runs on"));
        }
        let plan = Plan::new(&self.kernels, request, target, variant)?;
        if exchange.is_none() && plan.exchanges() {
            return Err(invalid(
                "request.shard",
                "a request sharded over several shards exchanges between its segments: queue it with TensorParallelRank",
            ));
        }
        let capturing = driver::check("cuStreamGetCaptureInfo", stream.capture_status())?
            != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // cudarc's own calls bind its context; the scope returns the caller's afterwards.
        // SAFETY: the sampler's context lives as long as the sampler.
        let scope = unsafe { driver::ContextScope::enter(self.kernels.context)? };
        let (space, plan) = workspace.prepare(stream, plan, capturing)?;
        let call = Planned { kernels: &self.kernels, stream: stream.cu_stream(), plan, workspace: space };
        // SAFETY: the views' memory lives through the call (this function's contract and the
        // views' own); the workspace is this stream's, sized by the plan, and its stored maps
        // are the ones `prepare` vouched for.
        let queued = unsafe {
            drive(std::slice::from_ref(&call), |ended| match exchange.as_mut() {
                Some(exchange) => ended.iter().try_for_each(|&(_, x)| exchange(x)),
                None => Err(invalid("request.shard", "exchanges with no collective to make them")),
            })
        };
        if queued.is_err() {
            workspace.forget_maps();
        }
        queued.and(scope.leave())
    }

    /// Queues `row_params[b].step += by` (wrapping) for the `rows` rows at `row_params` on
    /// `stream`: a decode loop (or a replayed CUDA graph) that reads its step from device
    /// memory draws fresh noise.
    ///
    /// # Safety
    /// As [`StreamSampler::enqueue`], for `row_params` holding `rows` [`RowParams`].
    pub unsafe fn advance_steps(&self, stream: *mut c_void, row_params: u64, rows: usize, by: u32) -> Result<()> {
        check_address("row_params", row_params, align_of::<RowParams>())?;
        let rows = u32::try_from(rows).map_err(|_| invalid("rows", format!("{rows}: must be < 2^32")))?;
        let args = AdvanceStepsArgs { row_params: DevicePtr::new(row_params), batch: rows, by };
        // SAFETY: per this function's contract.
        unsafe {
            driver::in_context(self.kernels.context, || {
                self.kernels.launch(stream.cast(), Kernel::AdvanceSteps, (rows as u64).div_ceil(256), &args)
            })
        }
    }

    /// Queues `batch`'s steps `+= by` on `stream` (see [`StreamSampler::advance_steps`]): the
    /// safe form, for a batch of this context.
    pub fn advance_steps_on(&self, stream: &Arc<CudaStream>, batch: &mut DeviceBatch, by: u32) -> Result<()> {
        if stream.context().cu_ctx() != self.kernels.context {
            return Err(invalid("stream", "belongs to another context than the sampler's"));
        }
        let rows = batch.rows();
        let address = batch.row_params().address();
        // SAFETY: the sampler's context is live. Inside it, cudarc's tracking of the write
        // (which makes the context current) leaves the caller's context as it was.
        unsafe {
            driver::in_context(self.kernels.context, || {
                let _write = batch.row_params_written_on(stream);
                // SAFETY: the batch holds `rows` row parameters of this context, borrowed
                // mutably here, and its memory is freed on its stream after the work queued
                // before.
                self.advance_steps(stream.cu_stream().cast(), address, rows, by)
            })
        }
    }

    /// Queues, for every sequence of the verification `batch`, its rows' steps `+=` its
    /// count of kept drafts in `accepted` (a cudarc slice or view of the call's
    /// [`Target::accepted`]) plus one, on `stream`: the batch then verifies the positions after
    /// the tokens each sequence emitted, with no host copy (a CUDA graph captures it). Errors
    /// name `batch` (it verifies no sequence), `accepted` (not one verdict per sequence) or
    /// `stream` (another context).
    pub fn advance_verified_on(
        &self,
        stream: &Arc<CudaStream>,
        batch: &mut DeviceBatch,
        accepted: &impl cudarc::driver::DevicePtr<u32>,
    ) -> Result<()> {
        // SAFETY: the sampler's context is live; cudarc's tracking of the read makes it
        // current, and leaving restores the caller's.
        unsafe {
            driver::in_context(self.kernels.context, || {
                let (address, _read) = accepted.device_ptr(stream);
                self.queue_advance_verified(stream, batch, address, accepted.len())
            })
        }
    }

    /// [`StreamSampler::advance_verified_on`] with the verdicts at device address `accepted`,
    /// `len` of them, whose use on `stream` the caller has recorded.
    pub(crate) fn queue_advance_verified(
        &self,
        stream: &Arc<CudaStream>,
        batch: &mut DeviceBatch,
        accepted: u64,
        len: usize,
    ) -> Result<()> {
        if stream.context().cu_ctx() != self.kernels.context {
            return Err(invalid("stream", "belongs to another context than the sampler's"));
        }
        let Some(verified) = batch.verified() else {
            return Err(invalid("batch", "verifies no sequence (build it with Batch::verify)"));
        };
        if len != verified.count {
            return Err(invalid(
                "accepted",
                format!("{len} verdicts for a batch of {} verified sequences", verified.count),
            ));
        }
        let args = AdvanceVerifiedArgs {
            row_params: batch.row_params(),
            verified: DevicePtr::new(verified.sequences),
            accepted: DevicePtr::new(accepted),
            sequences: verified.count as u32,
            padding: 0,
        };
        // SAFETY: the batch's sequences lie inside its row parameters (checked when it was
        // built), `accepted` holds one verdict per sequence; both live on `stream` until the
        // kernel has run, and the batch is borrowed mutably here. cudarc's tracking of the
        // write runs inside the sampler's context, which is then left as the caller had it.
        unsafe {
            driver::in_context(self.kernels.context, || {
                let _write = batch.row_params_written_on(stream);
                self.kernels.launch(
                    stream.cu_stream().cast(),
                    Kernel::AdvanceVerified,
                    (verified.count as u64).div_ceil(Kernel::AdvanceVerified.threads() as u64),
                    &args,
                )
            })
        }
    }

    /// Queues `count` values of `dtype`, uniform in `[-scale, scale)` and drawn from Philox
    /// under `seed`, into device memory at `address` on `stream`: inputs made on the device
    /// for benchmarks, tests and examples (the same seed gives the same values).
    ///
    /// # Safety
    /// As [`StreamSampler::enqueue`], for `address` holding `count` elements of `dtype` that no
    /// other stream touches until `stream` has run the fill.
    #[cfg(any(test, feature = "internals"))]
    pub unsafe fn fill_uniform(
        &self,
        stream: *mut c_void,
        address: u64,
        count: usize,
        dtype: crate::DType,
        seed: u64,
        scale: f32,
    ) -> Result<()> {
        use flashsample_core::abi::FillArgs;
        check_address("fill", address, dtype.bytes())?;
        let args = FillArgs { out: DevicePtr::new(address), count: count as u64, seed, scale, padding: 0 };
        let kernel = Kernel::FillUniform { element: super::dispatch::element_type(dtype) };
        // SAFETY: per this function's contract.
        unsafe {
            driver::in_context(self.kernels.context, || {
                self.kernels.launch(stream.cast(), kernel, count.div_ceil(4 * 256) as u64, &args)
            })
        }
    }

    /// Unloads the kernels from the context and reports the driver's error, if any. Work
    /// already queued must have finished first (the caller synchronises its streams).
    pub fn close(self) -> Result<()> {
        self.kernels.close()
    }
}

impl std::fmt::Debug for StreamSampler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamSampler")
            .field("device", &self.device_name())
            .field("module", &self.module())
            .field("multiprocessors", &self.multiprocessors())
            .finish()
    }
}

impl std::fmt::Debug for StreamWorkspace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamWorkspace")
            .field("space", &self.space)
            .field("maps_stored", &self.maps.is_some())
            .finish()
    }
}

/// A grow-only workspace for the calls on one stream ([`StreamSampler::enqueue_on`]); it is
/// allocated and freed on that stream, and asked for on another it is made anew there. It
/// remembers which tensor maps its last call left at the start of its scratch, so that the
/// next call over the same matrices reads them instead of writing them again.
#[derive(Default)]
pub struct StreamWorkspace {
    bytes: Option<CudaSlice<u8>>,
    /// The allocation's address and size, read once when it is made (so that a call under
    /// CUDA graph capture makes no cudarc call that waits on events).
    space: Option<DeviceWorkspace>,
    stream: Option<sys::CUstream>,
    /// The maps the last call wrote, for which matrices and where.
    maps: Option<StoredMaps>,
    /// Set once a call was captured in a graph: a replay may write its maps at any time, so
    /// none are trusted again.
    captured: bool,
}

/// The tensor maps a call left in a workspace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct StoredMaps {
    lm_head: MatrixRef,
    hidden: MatrixRef,
    variant: Variant,
    /// Their offset in the workspace.
    at: usize,
}

// SAFETY: the stream handle is only compared, never used to queue work.
unsafe impl Send for StreamWorkspace {}

impl StreamWorkspace {
    /// An empty workspace; the first call allocates it.
    pub fn new() -> StreamWorkspace {
        StreamWorkspace::default()
    }

    /// At least `bytes` of workspace on `stream` (contents not kept when it grows), for the
    /// raw layer ([`StreamSampler::enqueue`]). The workspace then forgets its maps: the
    /// caller may write anything there.
    pub fn ensure(&mut self, stream: &Arc<CudaStream>, bytes: usize) -> Result<DeviceWorkspace> {
        self.maps = None;
        self.grow(stream, bytes)
    }

    /// Grows the workspace on `stream` to what `plan` needs, so that a call captured in a CUDA
    /// graph allocates nothing.
    pub fn reserve(&mut self, stream: &Arc<CudaStream>, plan: &Plan) -> Result<()> {
        self.grow(stream, plan.workspace_bytes()).map(|_| ())
    }

    fn grow(&mut self, stream: &Arc<CudaStream>, bytes: usize) -> Result<DeviceWorkspace> {
        match self.space {
            Some(space) if self.stream == Some(stream.cu_stream()) && space.bytes >= bytes => return Ok(space),
            _ => {}
        }
        // Freed on the stream that used it, after that stream's work.
        (self.bytes, self.space, self.maps) = (None, None, None);
        self.stream = Some(stream.cu_stream());
        // SAFETY: the tile kernels write every candidate the merge reads, and the map writer
        // writes the maps before the TMA kernel reads them.
        let slice = unsafe { stream.alloc::<u8>(bytes.max(1)) };
        let slice = driver::check(&format!("cuMemAllocAsync(workspace, {bytes} bytes)"), slice)?;
        let (address, _) = slice.device_ptr(stream);
        let space = DeviceWorkspace { address, bytes: slice.len() };
        (self.bytes, self.space) = (Some(slice), Some(space));
        Ok(space)
    }

    /// The workspace for `plan` on `stream` (grown unless `capturing`) and the plan reading
    /// the maps a call left there when they are this call's; the workspace then records the
    /// maps this call leaves.
    fn prepare(&mut self, stream: &Arc<CudaStream>, plan: Plan, capturing: bool) -> Result<(DeviceWorkspace, Plan)> {
        let fits =
            self.stream == Some(stream.cu_stream()) && self.space.is_some_and(|s| s.bytes >= plan.workspace_bytes());
        if capturing && !fits {
            return Err(invalid(
                "workspace",
                "too small for this call under CUDA graph capture: reserve it first (StreamWorkspace::reserve)",
            ));
        }
        let space = self.grow(stream, plan.workspace_bytes())?;
        let stored = StoredMaps {
            lm_head: plan.call.lm_head,
            hidden: plan.call.hidden,
            variant: plan.path.variant(),
            at: plan.stage_offset(),
        };
        self.captured |= capturing;
        let writes_maps = plan.maps == TensorMaps::Store && plan.reads_maps();
        let plan = match (writes_maps, self.maps) {
            (true, Some(maps)) if maps == stored && !self.captured => plan.with_stored_maps(),
            _ => plan,
        };
        self.maps = (writes_maps && !self.captured).then_some(stored);
        Ok((space, plan))
    }

    /// Forgets the stored maps (after a call that may not have written them).
    fn forget_maps(&mut self) {
        self.maps = None;
    }
}
