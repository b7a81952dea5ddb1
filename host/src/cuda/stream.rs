//! [`StreamSampler`]: the one path every GPU sampling call takes. It queues work on a stream it
//! is given, reads and writes device memory it is given, and owns only the loaded module.
//!
//! Borrowed mode is this path with the caller's handles: a context and a stream as raw driver
//! values, `W`, `H`, the row parameters, the tokens and a workspace as device addresses
//! ([`StreamSampler::sample`]), so it works with any cudarc version, candle, or C/C++ code. Thin
//! safe wrappers over cudarc's `CudaStream` and `CudaSlice` sit on top
//! ([`StreamSampler::on_context`], [`StreamSampler::sample_slices`]), and the owned
//! [`super::CudaSampler`] calls the same enqueue with its own stream and buffers.
//!
//! Architecture Invariant: a call queues work on the stream it is given and nowhere else; it
//! creates no context and no stream, allocates nothing (the workspace is the caller's), never
//! waits for the device, and leaves the thread's current context as it found it. A workspace
//! serves one stream at a time: two streams sampling at once use two workspaces. (The safe
//! wrappers' own cudarc calls, an allocation in [`StreamWorkspace::ensure`] or
//! `DeviceRows::upload`, bind cudarc's context as every cudarc call does.)

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr as _, DevicePtrMut as _, sys};
use flashsample_core::abi::{
    AdvanceStepsArgs, DevicePtr, FillArgs, FusedArgs, ReduceArgs, RowProcessing, RowSums, SHARD_ALIGNMENT, ShardWinner,
    StoreTensorMapsArgs, TENSOR_MAP_BYTES, TensorMap, TmaArgs,
};
use flashsample_core::registry::{Kernel, Module};
use flashsample_core::{Candidate, RowParams};

use super::buffers::{DeviceRows, l2_promotion};
use super::dispatch::{Variant, element_type};
use super::driver::{self, L2Promotion, TensorMapElement};
use super::modules::{LoadedModule, ModuleChoice};
use super::passes::{CANDIDATE_BUDGET_BYTES, Pass, Plan};
use crate::error::{Result, invalid};
use crate::params::{Draws, HeadShape, MAX_VOCAB, check_head_shape, check_request_shape};
use crate::tensor::{DType, MatrixShape};

mod processed;

pub(crate) use processed::ProcessedPlan;
pub use processed::{ProcessedRequest, ProcessedTarget, ProcessingRef, ShardMergeRequest, ShardReduction};

/// A matrix in device memory: `rows × cols` elements of `dtype` at `address`, row `r` starting
/// `r · row_stride` elements after it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceMatrix {
    pub address: u64,
    pub rows: usize,
    pub cols: usize,
    /// Elements from one row to the next (at least `cols`).
    pub row_stride: usize,
    pub dtype: DType,
}

impl DeviceMatrix {
    /// A matrix whose rows follow each other (`row_stride = cols`).
    pub fn contiguous(address: u64, rows: usize, cols: usize, dtype: DType) -> DeviceMatrix {
        DeviceMatrix { address, rows, cols, row_stride: cols, dtype }
    }

    /// Whether the tensor-core tiles can read it: 16-byte aligned start and rows.
    fn rows_16_byte_aligned(&self) -> bool {
        self.address.is_multiple_of(16) && (self.row_stride * self.dtype.bytes()).is_multiple_of(16)
    }
}

/// One sampling call in device memory: `draws` of each row of `H` from `softmax(H·Wᵀ / T)`.
#[derive(Clone, Copy, Debug)]
pub struct SampleRequest {
    /// `W[V, D]`.
    pub lm_head: DeviceMatrix,
    /// `H[B, D]`, the same dtype as `W`.
    pub hidden: DeviceMatrix,
    /// `[B]` row parameters ([`RowParams`], 8-byte aligned; see [`crate::params::row_params`]).
    pub row_params: u64,
    /// `[B, draws.count]` u32 tokens, row-major; every slot of a row without a token holds
    /// its status's sentinel ([`crate::RowStatus::of_token`]): `NON_FINITE_TOKEN` for a row
    /// with a NaN or +∞ logit, `NO_TOKEN` for a row whose logits are all −∞. Unread with
    /// `shard`.
    pub tokens: u64,
    pub draws: Draws,
    pub variant: Variant,
    /// Per-row soft-cap, bias, mask and penalties applied in the tile (device-side parameters:
    /// [`crate::DeviceProcessing::fused`]), or `None`.
    pub processing: Option<FusedProcessing>,
    /// `Some`: `W` is a vocabulary shard and the call writes the shard's winners for the
    /// shard merge instead of tokens.
    pub shard: Option<ShardTarget>,
}

/// A request over a vocabulary shard: `W`'s row `r` is the token `vocab_offset + r` of a
/// vocabulary of `vocab` tokens. Noise and processing are keyed by the global index, so the
/// shards' winners merge into the unsharded tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShardTarget {
    /// A multiple of [`SHARD_ALIGNMENT`] (4).
    pub vocab_offset: usize,
    /// The whole vocabulary's size.
    pub vocab: usize,
    /// `[B, draws.count]` [`ShardWinner`]s (20 bytes each, 4-byte aligned).
    pub winners: u64,
}

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
        let null = DevicePtr::NULL;
        WinnerTarget {
            winners,
            raw: null,
            processed: null,
            part_sums: DevicePtr::NULL,
            sum_parts: 0,
            sums: DevicePtr::NULL,
            logits_stride: 0,
            vocab_offset,
        }
    }
}

impl ReduceTarget {
    /// The target of a request: its tokens, or its shard's winners without logits.
    fn of(request: &SampleRequest) -> ReduceTarget {
        match request.shard {
            None => ReduceTarget::Tokens(DevicePtr::new(request.tokens)),
            Some(shard) => {
                ReduceTarget::Winners(WinnerTarget::bare(DevicePtr::new(shard.winners), shard.vocab_offset as u32))
            }
        }
    }
}

/// A batch's per-entry processing in device memory that the fused tiles apply: made by
/// [`crate::DeviceProcessing::fused`], which refuses rows with min-p, top-k, top-p or top
/// log-probabilities (those need the whole row: `CudaSampler::sample_processed_into`). It names
/// memory the `DeviceProcessing` owns; keep that alive until the stream has run the call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FusedProcessing {
    /// `[rows]` [`flashsample_core::abi::RowProcessing`] blocks.
    pub(crate) address: u64,
    pub(crate) rows: usize,
    pub(crate) vocab: usize,
}

/// Device memory a call may use for its scratch: candidates and the call's tensor maps.
#[derive(Clone, Copy, Debug)]
pub struct DeviceWorkspace {
    /// 64-byte aligned.
    pub address: u64,
    pub bytes: usize,
}

/// Where a TMA call's tensor maps come from.
#[derive(Clone, Copy, Debug)]
pub(crate) enum TensorMaps {
    /// Encoded on the host for this call and written to the workspace by a kernel on the
    /// stream (borrowed mode: the matrices may change from call to call).
    Store,
    /// Already in device memory for the lifetime of the call (the owned buffers keep theirs).
    Resident { lm_head: DevicePtr<TensorMap>, hidden: DevicePtr<TensorMap> },
}

/// Bytes at the start of a workspace that hold a call's two tensor maps.
const WORKSPACE_MAPS_BYTES: usize = 2 * TENSOR_MAP_BYTES;

/// The GPU sampling kernels loaded in one context; calls queue them on any stream of it.
///
/// `Send` and `Sync`: several threads and streams may sample with one `StreamSampler` at once,
/// each call with its own workspace.
pub struct StreamSampler {
    /// `None` only during [`StreamSampler::close`] and drop.
    module: Option<LoadedModule>,
    context: sys::CUcontext,
    device_name: String,
    multiprocessors: u32,
    compute_capability: (u32, u32),
    /// Keeps a cudarc context alive for samplers made by [`StreamSampler::on_context`].
    _context_owner: Option<Arc<CudaContext>>,
}

// SAFETY: the context handle and the loaded module may be used from any thread that makes the
// context current, which every call does; nothing is mutated after construction.
unsafe impl Send for StreamSampler {}
// SAFETY: as above; calls only read the kernel table and queue launches.
unsafe impl Sync for StreamSampler {}

impl StreamSampler {
    /// Loads the kernels into the caller's CUDA context: the module for its device, or the one
    /// `choice` names (`ModuleChoice::from_environment()` reads `FLASHSAMPLE_MODULE`). The
    /// thread's current context is restored before returning.
    ///
    /// # Safety
    /// `context` is a live `CUcontext` that outlives the sampler (for a primary context: keep
    /// it retained). The sampler unloads its module from it on [`StreamSampler::close`] or drop.
    pub unsafe fn new(context: *mut c_void, choice: ModuleChoice) -> Result<StreamSampler> {
        super::sampler::cuda_device_count()?;
        let context: sys::CUcontext = context.cast();
        if context.is_null() {
            return Err(invalid("context", "null: a live CUDA context is needed"));
        }
        // SAFETY: per this function's contract.
        unsafe {
            driver::in_context(context, || {
                let mut device = 0;
                driver::check("cuCtxGetDevice", sys::cuCtxGetDevice(&mut device).result())?;
                let attribute = |what: &str, attribute| {
                    driver::check(
                        &format!("cuDeviceGetAttribute({what})"),
                        cudarc::driver::result::device::get_attribute(device, attribute),
                    )
                    .map(|value| value as u32)
                };
                use sys::CUdevice_attribute as A;
                let major = attribute("COMPUTE_CAPABILITY_MAJOR", A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
                let minor = attribute("COMPUTE_CAPABILITY_MINOR", A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
                let multiprocessors = attribute("MULTIPROCESSOR_COUNT", A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
                let device_name = driver::check("cuDeviceGetName", cudarc::driver::result::device::get_name(device))?;
                let module = LoadedModule::load(context, choice.resolve(major, minor)?)?;
                Ok(StreamSampler {
                    module: Some(module),
                    context,
                    device_name,
                    multiprocessors,
                    compute_capability: (major, minor),
                    _context_owner: None,
                })
            })
        }
    }

    /// The kernels of `module` on an H200-like device (132 multiprocessors) with no context,
    /// for tests that record launches instead of making them (`driver::trace`).
    #[cfg(test)]
    pub(crate) fn recording(module: Module) -> StreamSampler {
        StreamSampler {
            module: Some(LoadedModule::recording(module)),
            context: std::ptr::null_mut(),
            device_name: "recording".into(),
            multiprocessors: 132,
            compute_capability: (9, 0),
            _context_owner: None,
        }
    }

    /// As [`StreamSampler::new`] on a cudarc context, which the sampler keeps alive.
    pub fn on_context(context: &Arc<CudaContext>, choice: ModuleChoice) -> Result<StreamSampler> {
        // SAFETY: the sampler holds a reference to the context, so it outlives the sampler.
        let mut sampler = unsafe { StreamSampler::new(context.cu_ctx().cast(), choice)? };
        sampler._context_owner = Some(context.clone());
        Ok(sampler)
    }

    /// The raw context the kernels are loaded in.
    pub fn context(&self) -> *mut c_void {
        self.context.cast()
    }

    pub fn device_name(&self) -> &str {
        &self.device_name
    }

    pub fn multiprocessors(&self) -> u32 {
        self.multiprocessors
    }

    /// The device's compute capability (major, minor).
    pub fn compute_capability(&self) -> (u32, u32) {
        self.compute_capability
    }

    /// The PTX module the kernels come from.
    pub fn module(&self) -> Module {
        self.loaded().module
    }

    fn loaded(&self) -> &LoadedModule {
        self.module.as_ref().expect("the module is unloaded only by close and drop")
    }

    /// Workspace bytes a call with these shapes needs (the candidates of its largest pass and
    /// room for two tensor maps); at most a few hundred MiB, however many draws.
    pub fn workspace_bytes(
        &self,
        lm_head: &DeviceMatrix,
        hidden: &DeviceMatrix,
        samples: u32,
        variant: Variant,
    ) -> Result<usize> {
        Ok(self.plan_shape(lm_head, hidden, samples, variant)?.workspace_bytes)
    }

    /// Checks `request` and plans it: what [`StreamSampler::enqueue`] runs and the workspace it
    /// needs, computed once per call.
    pub(crate) fn plan_call(&self, request: &SampleRequest) -> Result<CallPlan> {
        let samples = check_request(request)?;
        let plan = self.plan_shape(&request.lm_head, &request.hidden, samples, request.variant)?;
        if request.processing.is_some() && !plan.variant.fused_kernel(request.lm_head.dtype).applies_processing() {
            return Err(invalid(
                "variant",
                format!("{:?} does not apply per-row processing (no registers to spare); use another", plan.variant),
            ));
        }
        Ok(plan)
    }

    fn plan_shape(
        &self,
        lm_head: &DeviceMatrix,
        hidden: &DeviceMatrix,
        samples: u32,
        variant: Variant,
    ) -> Result<CallPlan> {
        let variant = self.resolve(lm_head, hidden, variant)?;
        let tiles = lm_head.rows.div_ceil(variant.tile_rows() as usize);
        let passes = Plan::new(hidden.rows, samples as usize, tiles, CANDIDATE_BUDGET_BYTES);
        let workspace_bytes = WORKSPACE_MAPS_BYTES + passes.candidate_pairs() * tiles * size_of::<Candidate>();
        Ok(CallPlan { variant, tiles, passes, samples, workspace_bytes })
    }

    fn resolve(&self, lm_head: &DeviceMatrix, hidden: &DeviceMatrix, variant: Variant) -> Result<Variant> {
        let aligned = lm_head.rows_16_byte_aligned() && hidden.rows_16_byte_aligned();
        variant.resolve_aligned(self.module(), lm_head.dtype, lm_head.cols, hidden.rows, aligned)
    }

    /// Queues one sampling call on the caller's `stream`: `request.tokens` holds the tokens
    /// once the stream reaches the end of the call. The caller's context is made current and
    /// the thread's previous context restored; nothing is allocated and nothing waits.
    /// Invalid shapes, strides, alignments or a small workspace are typed errors that name the
    /// argument, before anything is queued.
    ///
    /// # Safety
    /// - `stream` is a live stream of this sampler's context, or `CU_STREAM_PER_THREAD` (the
    ///   calling thread's per-thread default stream: the work then orders with what this
    ///   thread queued there, so call from the thread that queues the model's work), or null
    ///   (the legacy default stream).
    /// - Extents: `W` holds `V` rows and `H` `B` rows of `row_stride` elements each (the last
    ///   row `cols` elements), `row_params` `B` [`RowParams`], `tokens` `B · draws.count` u32,
    ///   `workspace` its `bytes`; all are device memory of this context (or mapped into it).
    /// - Lifetimes: every buffer (the `DeviceProcessing` behind `processing` included) stays
    ///   allocated, and `W`, `H`, the row parameters and the processing stay unchanged, until
    ///   `stream` has run past this call's work (the caller's later work on
    ///   the same stream may free or rewrite them).
    /// - Streams: no other stream writes `W`, `H` or the row parameters, or touches `tokens`
    ///   or `workspace`, until `stream` has run past this call's work, unless the caller
    ///   orders it after with an event. A workspace serves one stream at a time.
    pub unsafe fn sample(
        &self,
        stream: *mut c_void,
        request: &SampleRequest,
        workspace: DeviceWorkspace,
    ) -> Result<()> {
        let plan = self.plan_call(request)?;
        // SAFETY: per this function's contract.
        unsafe { self.sample_planned(stream.cast(), request, &plan, workspace) }
    }

    /// [`StreamSampler::sample`] of a request already planned by [`StreamSampler::plan_call`].
    ///
    /// # Safety
    /// As [`StreamSampler::sample`]; `plan` is `request`'s.
    pub(crate) unsafe fn sample_planned(
        &self,
        stream: sys::CUstream,
        request: &SampleRequest,
        plan: &CallPlan,
        workspace: DeviceWorkspace,
    ) -> Result<()> {
        // SAFETY: per this function's contract.
        unsafe {
            driver::in_context(self.context, || self.enqueue(stream, request, plan, TensorMaps::Store, workspace))
        }
    }

    /// As [`StreamSampler::sample`], reading the tensor maps the workspace already holds
    /// instead of writing them first: two launches instead of three on the Hopper module's TMA
    /// tiles (elsewhere the same as `sample`). A decode loop whose `W` and `H` buffers stay put
    /// (as under CUDA graphs) calls `sample` once and this afterwards.
    ///
    /// # Safety
    /// As [`StreamSampler::sample`]; further, the last call that wrote maps into `workspace`
    /// (a `sample` on it, ordered before this call) was for the same `lm_head`, `hidden` and
    /// variant (the same matrices, strides and B): otherwise the kernels read another call's
    /// matrices.
    pub unsafe fn sample_with_stored_maps(
        &self,
        stream: *mut c_void,
        request: &SampleRequest,
        workspace: DeviceWorkspace,
    ) -> Result<()> {
        let plan = self.plan_call(request)?;
        let destination = DevicePtr::<TensorMap>::new(workspace.address);
        let maps = TensorMaps::Resident { lm_head: destination, hidden: destination.add(1) };
        // SAFETY: per this function's contract; `enqueue` checks the workspace's size and
        // alignment before it reads the maps' slot.
        unsafe { driver::in_context(self.context, || self.enqueue(stream.cast(), request, &plan, maps, workspace)) }
    }

    /// Queues `row_params[b].step += by` (wrapping) for `b < batch` on `stream`: a decode loop
    /// (or a replayed CUDA graph) that reads its step from device memory draws fresh noise.
    ///
    /// # Safety
    /// As [`StreamSampler::sample`], for `row_params` holding `batch` row parameters.
    pub unsafe fn advance_steps(&self, stream: *mut c_void, row_params: u64, batch: usize, by: u32) -> Result<()> {
        check_address("row_params", row_params, align_of::<RowParams>())?;
        let batch = u32::try_from(batch).map_err(|_| invalid("batch", format!("{batch}: must be < 2^32")))?;
        let args = AdvanceStepsArgs { row_params: DevicePtr::new(row_params), batch, by };
        // SAFETY: per this function's contract.
        unsafe {
            driver::in_context(self.context, || {
                self.launch(stream.cast(), Kernel::AdvanceSteps, (batch as u64).div_ceil(256), &args)
            })
        }
    }

    /// Queues `count` values of `dtype`, uniform in `[-scale, scale)` and drawn from Philox
    /// under `seed`, into device memory at `address` on `stream`: inputs made on the device
    /// for benchmarks, tests and examples (the same seed gives the same values).
    ///
    /// # Safety
    /// As [`StreamSampler::sample`], for `address` holding `count` elements of `dtype` that no
    /// other stream touches until `stream` has run the fill.
    pub unsafe fn fill_uniform(
        &self,
        stream: *mut c_void,
        address: u64,
        count: usize,
        dtype: DType,
        seed: u64,
        scale: f32,
    ) -> Result<()> {
        check_address("fill", address, dtype.bytes())?;
        let args = FillArgs { out: DevicePtr::new(address), count: count as u64, seed, scale, padding: 0 };
        let kernel = Kernel::FillUniform { element: element_type(dtype) };
        // SAFETY: per this function's contract.
        unsafe {
            driver::in_context(self.context, || {
                self.launch(stream.cast(), kernel, count.div_ceil(4 * 256) as u64, &args)
            })
        }
    }

    /// [`StreamSampler::sample`] over cudarc buffers on a cudarc stream of this sampler's
    /// context: `W` is `lm_head` as `[vocab, lm_head.len() / vocab]`, `H` is `hidden` as
    /// `[rows.rows(), D]`, `tokens` gets `[B, draws.count]`. The workspace grows on `stream` to
    /// what the call needs (once per new largest shape: under CUDA graph capture, ensure it
    /// first, or the growth becomes an allocation the graph owns). cudarc's event tracking,
    /// where the context has it, orders the buffers' use with their other streams.
    #[allow(clippy::too_many_arguments)]
    pub fn sample_slices<T: DeviceElement>(
        &self,
        stream: &Arc<CudaStream>,
        lm_head: &CudaSlice<T>,
        vocab: usize,
        hidden: &CudaSlice<T>,
        rows: &DeviceRows,
        draws: Draws,
        variant: Variant,
        tokens: &mut CudaSlice<u32>,
        workspace: &mut StreamWorkspace,
    ) -> Result<()> {
        if stream.context().cu_ctx() != self.context {
            return Err(invalid("stream", "belongs to another context than the sampler's"));
        }
        if vocab == 0 || !lm_head.len().is_multiple_of(vocab) {
            return Err(invalid("lm_head", format!("{} elements are not [vocab = {vocab}, D] rows", lm_head.len())));
        }
        let dim = lm_head.len() / vocab;
        let batch = rows.rows();
        if hidden.len() != batch * dim {
            return Err(invalid("hidden", format!("{} elements for B = {batch} rows of D = {dim}", hidden.len())));
        }
        let needed = batch.saturating_mul(draws.count as usize);
        if tokens.len() < needed {
            return Err(invalid(
                "tokens",
                format!("room for {} tokens, the call writes B x N = {needed}", tokens.len()),
            ));
        }
        // cudarc's own calls below bind its context; the scope returns the caller's afterwards.
        // SAFETY: the sampler's context lives as long as the sampler.
        let scope = unsafe { driver::ContextScope::enter(self.context)? };
        let (w, _w_use) = lm_head.device_ptr(stream);
        let (h, _h_use) = hidden.device_ptr(stream);
        let (t, _t_use) = tokens.device_ptr_mut(stream);
        let _rows_use = rows.used_on(stream);
        let request = SampleRequest {
            lm_head: DeviceMatrix::contiguous(w, vocab, dim, T::DTYPE),
            hidden: DeviceMatrix::contiguous(h, batch, dim, T::DTYPE),
            row_params: rows.address(),
            tokens: t,
            draws,
            variant,
            processing: None,
            shard: None,
        };
        let plan = self.plan_call(&request)?;
        let workspace = workspace.ensure(stream, plan.workspace_bytes)?;
        // SAFETY: the slices hold the extents checked above and live until the guards drop
        // (cudarc frees them on their stream, after this work); the stream belongs to this
        // sampler's context; the workspace is this stream's.
        let queued = unsafe { self.sample_planned(stream.cu_stream(), &request, &plan, workspace) };
        queued.and(scope.leave())
    }

    /// Queues the kernels of a planned request on `stream`; the context is current.
    ///
    /// # Safety
    /// As [`StreamSampler::sample`]; `plan` is `request`'s ([`StreamSampler::plan_call`]);
    /// `maps`, when resident, describe `W` and `H` for the plan's variant's boxes and live until
    /// the stream has run the call.
    pub(crate) unsafe fn enqueue(
        &self,
        stream: sys::CUstream,
        request: &SampleRequest,
        plan: &CallPlan,
        maps: TensorMaps,
        workspace: DeviceWorkspace,
    ) -> Result<()> {
        // SAFETY: per this function's contract.
        unsafe {
            self.enqueue_tiles(stream, request, plan, maps, workspace, ReduceTarget::of(request), DevicePtr::NULL)
        }
    }

    /// Queues the tile kernel and the merge kernel of a planned request, the merge kernel
    /// writing into `target`; with `tile_sums` (`[B, tiles]` terms) not null, the tile kernel
    /// writes each (row, tile)'s log-sum-exp terms there in the pass of the row's first draws.
    ///
    /// # Safety
    /// As [`StreamSampler::enqueue`]; `target` holds `B · draws.count` slots (and its terms `B`
    /// rows), `tile_sums` (if not null) `B · tiles` terms and the plan's variant writes them
    /// (`Kernel::writes_tile_sums`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn enqueue_tiles(
        &self,
        stream: sys::CUstream,
        request: &SampleRequest,
        plan: &CallPlan,
        maps: TensorMaps,
        workspace: DeviceWorkspace,
        target: ReduceTarget,
        tile_sums: DevicePtr<RowSums>,
    ) -> Result<()> {
        let vocab_offset = request.shard.map_or(0, |shard| shard.vocab_offset as u32);
        let CallPlan { variant, tiles, samples, workspace_bytes: needed, .. } = *plan;
        let (lm_head, hidden) = (&request.lm_head, &request.hidden);
        self.check_workspace(workspace, needed)?;
        let kernel = variant.fused_kernel(lm_head.dtype);
        // SAFETY: the workspace is checked above; the maps per this function's contract.
        let maps = unsafe { self.tensor_maps(stream, variant, lm_head, hidden, maps, workspace)? };
        let candidates = DevicePtr::<Candidate>::new(workspace.address + WORKSPACE_MAPS_BYTES as u64);
        let element_bytes = lm_head.dtype.bytes() as u64;
        let row_params = DevicePtr::<RowParams>::new(request.row_params);
        let processing = DevicePtr::<RowProcessing>::new(request.processing.map_or(0, |p| p.address));
        // SAFETY: the candidates of the largest pass fit the workspace (checked above); the row
        // parameters and tokens hold the request's extents (`sample`'s contract).
        unsafe {
            self.queue_passes(stream, &plan.passes, tiles, row_params, candidates, target, samples, |pass, launch| {
                // The noise is keyed by the draw's index: the pass's first draw, after `draws.first`.
                let draw_offset = request.draws.first + pass.first_sample as u32;
                let items = tiles as u64 * launch.batch.div_ceil(variant.columns()) as u64;
                // The terms are written once per row, in the pass of its first draws.
                let tile_sums = match pass.first_sample {
                    0 => tile_sums.add_unless_null(pass.first_row as u64 * tiles as u64),
                    _ => DevicePtr::NULL,
                };
                if let Some((lm_head_map, hidden_map)) = maps {
                    let args = TmaArgs {
                        lm_head_map,
                        hidden_map,
                        row_params: launch.row_params,
                        out: candidates.cast(),
                        // A pass's rows start at its first row, in the processing blocks as in
                        // the row parameters.
                        processing: processing.add_unless_null(pass.first_row as u64),
                        tile_sums,
                        vocab: lm_head.rows as u32,
                        dim: lm_head.cols as u32,
                        batch: launch.batch,
                        hidden_row0: pass.first_row as u32,
                        draw_offset,
                        samples: pass.samples as u32,
                        tiles: tiles as u32,
                        logits_stride: 0,
                        vocab_offset,
                        padding: 0,
                    };
                    // SAFETY: the maps describe the request's matrices.
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
                // SAFETY: the matrices hold their extents (`sample`'s contract).
                self.launch(stream, kernel, items, &args)
            })
        }
    }

    /// A workspace's rules: 64-byte aligned, at least `needed` bytes.
    fn check_workspace(&self, workspace: DeviceWorkspace, needed: usize) -> Result<()> {
        check_address("workspace", workspace.address, 64)?;
        if workspace.bytes < needed {
            return Err(invalid(
                "workspace",
                format!("{} bytes: this call needs {needed} (StreamSampler::workspace_bytes)", workspace.bytes),
            ));
        }
        Ok(())
    }

    /// The tensor maps a call of `variant` reads (`None` unless TMA): resident ones, or
    /// `W`'s and `H`'s encoded here and written to the workspace's start on `stream`.
    ///
    /// # Safety
    /// The context is current; the workspace (checked) is only this stream's; resident `maps`
    /// describe `W` and `H` for the variant's boxes.
    unsafe fn tensor_maps(
        &self,
        stream: sys::CUstream,
        variant: Variant,
        lm_head: &DeviceMatrix,
        hidden: &DeviceMatrix,
        maps: TensorMaps,
        workspace: DeviceWorkspace,
    ) -> Result<Option<processed::MapPair>> {
        Ok(match (variant.tma_boxes(), maps) {
            (None, _) => None,
            (Some(_), TensorMaps::Resident { lm_head, hidden }) => Some((lm_head, hidden)),
            (Some((rows, columns)), TensorMaps::Store) => {
                let destination = DevicePtr::<TensorMap>::new(workspace.address);
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

    /// Queues, for each pass of `plan`, `tile_kernel` (which writes the pass's candidates) and
    /// the merge kernel into the pass's slots of the `[B, samples]` tokens or winners.
    ///
    /// # Safety
    /// The context is current; `candidates` holds the largest pass's `rows × samples × tiles`
    /// candidates, `row_params` `B` entries, `target` `B × samples` slots (and its logits, if
    /// any, `B` rows); `tile_kernel` queues a kernel that writes every candidate of its pass on
    /// `stream`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn queue_passes(
        &self,
        stream: sys::CUstream,
        plan: &Plan,
        tiles: usize,
        row_params: DevicePtr<RowParams>,
        candidates: DevicePtr<Candidate>,
        target: ReduceTarget,
        samples: u32,
        mut tile_kernel: impl FnMut(&Pass, &TileLaunch) -> Result<()>,
    ) -> Result<()> {
        for pass in plan.passes() {
            let launch = TileLaunch { row_params: row_params.add(pass.first_row as u64), batch: pass.rows as u32 };
            tile_kernel(&pass, &launch)?;
            let first_slot = (pass.first_row * samples as usize) as u64;
            let mut reduce = ReduceArgs {
                candidates,
                tokens: DevicePtr::NULL,
                winners: DevicePtr::NULL,
                raw: DevicePtr::NULL,
                processed: DevicePtr::NULL,
                row_params: launch.row_params,
                part_sums: DevicePtr::NULL,
                sums: DevicePtr::NULL,
                batch: launch.batch,
                samples: pass.samples as u32,
                tiles: tiles as u32,
                draw_offset: pass.first_sample as u32,
                token_stride: samples,
                logits_stride: 0,
                vocab_offset: 0,
                sum_parts: 0,
            };
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

    /// Launches `kernel` over `items` work items on `stream` with a persistent grid (at most
    /// one wave); the context is current.
    ///
    /// # Safety
    /// `args` is the kernel's argument block with valid device addresses, `stream` a stream
    /// of this sampler's context.
    pub(crate) unsafe fn launch<A: bytemuck::Pod>(
        &self,
        stream: sys::CUstream,
        kernel: Kernel,
        items: u64,
        args: &A,
    ) -> Result<()> {
        let loaded = self.loaded().kernel(kernel)?;
        let resident = loaded.blocks_per_multiprocessor as u64 * self.multiprocessors as u64;
        let grid = items.clamp(1, resident) as u32;
        // SAFETY: per this function's contract; the launch shape comes from the registry.
        unsafe { driver::launch(loaded.name, loaded.function, stream, grid, loaded.threads, loaded.shared_bytes, args) }
    }

    /// Unloads the kernels from the context and reports the driver's error, if any. Work
    /// already queued must have finished first (the caller synchronises its streams).
    pub fn close(mut self) -> Result<()> {
        self.module.take().map_or(Ok(()), LoadedModule::unload)
    }
}

/// What the tile kernel of one pass reads besides the request's own buffers.
pub(crate) struct TileLaunch {
    /// Row parameters of the pass's first row.
    pub row_params: DevicePtr<RowParams>,
    /// Rows in the pass.
    pub batch: u32,
}

/// A checked request's launch plan ([`StreamSampler::plan_call`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct CallPlan {
    /// The resolved tile variant.
    pub variant: Variant,
    /// Vocabulary tiles of that variant.
    pub tiles: usize,
    pub passes: Plan,
    /// Draws per row.
    pub samples: u32,
    /// The workspace the call needs: its tensor maps and the largest pass's candidates.
    pub workspace_bytes: usize,
}

/// The rules of a request that do not depend on the module: shapes, strides, dtypes,
/// alignments, and draws. Returns the draws per row.
fn check_request(request: &SampleRequest) -> Result<u32> {
    let (lm_head, hidden) = (&request.lm_head, &request.hidden);
    check_head_shape(lm_head.rows, lm_head.cols)?;
    check_matrix("lm_head", lm_head)?;
    check_matrix("hidden", hidden)?;
    let samples = request.draws.check()?.count;
    // The shape rules every backend applies (B, D, dtypes); one row of parameters per row of H.
    let head = HeadShape { vocab: lm_head.rows, dim: lm_head.cols, dtype: lm_head.dtype };
    let hidden_shape = MatrixShape { rows: hidden.rows, cols: hidden.cols, dtype: hidden.dtype };
    check_request_shape(head, hidden_shape, hidden.rows, "row_params", samples)?;
    check_address("row_params", request.row_params, align_of::<RowParams>())?;
    if request.shard.is_none() {
        check_address("tokens", request.tokens, align_of::<u32>())?;
    }
    if hidden.rows.checked_mul(samples as usize).is_none_or(|n| n > u32::MAX as usize) {
        return Err(invalid("samples", format!("B x samples = {} x {samples} tokens: must be < 2^32", hidden.rows)));
    }
    let vocab = match request.shard {
        Some(shard) => {
            check_shard(shard.vocab_offset, lm_head.rows, shard.vocab)?;
            check_address("shard.winners", shard.winners, align_of::<ShardWinner>())?;
            shard.vocab
        }
        None => lm_head.rows,
    };
    if let Some(p) = request.processing
        && (p.rows != hidden.rows || p.vocab != vocab)
    {
        return Err(invalid(
            "processing",
            format!("made for B = {}, V = {}; the request has B = {}, V = {vocab}", p.rows, p.vocab, hidden.rows),
        ));
    }
    Ok(samples)
}

/// The rules of a vocabulary shard of `rows` tokens at `vocab_offset` in a vocabulary of
/// `vocab`.
pub(crate) fn check_shard(vocab_offset: usize, rows: usize, vocab: usize) -> Result<()> {
    if !vocab_offset.is_multiple_of(SHARD_ALIGNMENT as usize) {
        return Err(invalid(
            "shard.vocab_offset",
            format!("{vocab_offset}: must be a multiple of {SHARD_ALIGNMENT} (one Philox block of 4 tokens)"),
        ));
    }
    if vocab_offset.checked_add(rows).is_none_or(|end| end > vocab) {
        return Err(invalid(
            "shard.vocab_offset",
            format!("{vocab_offset} + {rows} rows: the shard must lie inside the vocabulary of V = {vocab}"),
        ));
    }
    if vocab > MAX_VOCAB {
        return Err(invalid("shard.vocab", format!("V = {vocab}: must be < 2^31")));
    }
    Ok(())
}

fn check_matrix(what: &str, matrix: &DeviceMatrix) -> Result<()> {
    check_address(what, matrix.address, matrix.dtype.bytes())?;
    if matrix.row_stride < matrix.cols || matrix.row_stride > u32::MAX as usize {
        return Err(invalid(
            what,
            format!("row stride {}: must be at least the {} columns and below 2^32", matrix.row_stride, matrix.cols),
        ));
    }
    Ok(())
}

fn check_address(what: &str, address: u64, alignment: usize) -> Result<()> {
    if address == 0 || !address.is_multiple_of(alignment as u64) {
        return Err(invalid(what, format!("address {address:#x}: must be non-null and {alignment}-byte aligned")));
    }
    Ok(())
}

/// The tensor map of `matrix` for boxes of `box_rows` rows with L2 `promotion` (a tile of
/// `columns` columns wants [`l2_promotion`]`(columns)`).
pub(crate) fn tensor_map(
    what: &str,
    matrix: &DeviceMatrix,
    box_rows: u32,
    promotion: L2Promotion,
) -> Result<TensorMap> {
    let element = match matrix.dtype {
        DType::BF16 => TensorMapElement::Bf16,
        DType::F16 => TensorMapElement::F16,
        DType::F32 => return Err(invalid(what, "no TMA descriptor: the TMA kernels need BF16 or F16")),
    };
    driver::encode_tensor_map_2d(
        what,
        element,
        matrix.address,
        matrix.rows,
        matrix.cols,
        matrix.row_stride,
        box_rows,
        flashsample_core::abi::TMA_K_BLOCK,
        promotion,
    )
}

/// An element type the kernels read from cudarc buffers.
pub trait DeviceElement: cudarc::driver::DeviceRepr {
    const DTYPE: DType;
}

impl DeviceElement for half::bf16 {
    const DTYPE: DType = DType::BF16;
}

impl DeviceElement for half::f16 {
    const DTYPE: DType = DType::F16;
}

impl DeviceElement for f32 {
    const DTYPE: DType = DType::F32;
}

/// A grow-only workspace for the calls on one stream ([`StreamSampler::sample_slices`]); it
/// is allocated and freed on that stream, and asked for on another it is made anew there.
#[derive(Default)]
pub struct StreamWorkspace {
    bytes: Option<CudaSlice<u8>>,
    stream: Option<sys::CUstream>,
}

// SAFETY: the stream handle is only compared, never used to queue work.
unsafe impl Send for StreamWorkspace {}

impl StreamWorkspace {
    pub fn new() -> StreamWorkspace {
        StreamWorkspace::default()
    }

    /// At least `bytes` of workspace on `stream` (contents not kept when it grows).
    pub fn ensure(&mut self, stream: &Arc<CudaStream>, bytes: usize) -> Result<DeviceWorkspace> {
        let other_stream = self.stream != Some(stream.cu_stream());
        if other_stream || self.bytes.as_ref().is_none_or(|b| b.len() < bytes) {
            // Freed on the stream that used it, after that stream's work.
            self.bytes = None;
            self.stream = Some(stream.cu_stream());
            // SAFETY: the tile kernels write every candidate the merge reads, and the map
            // writer writes the maps before the TMA kernel reads them.
            let slice = unsafe { stream.alloc::<u8>(bytes) };
            self.bytes = Some(driver::check(&format!("cuMemAllocAsync(workspace, {bytes} bytes)"), slice)?);
        }
        let slice = self.bytes.as_ref().expect("just ensured");
        let (address, _) = slice.device_ptr(stream);
        Ok(DeviceWorkspace { address, bytes: slice.len() })
    }
}

impl Drop for StreamSampler {
    fn drop(&mut self) {
        if let Some(module) = self.module.take()
            && let Err(e) = module.unload()
        {
            eprintln!("flashsample: error while dropping StreamSampler (call close to handle it): {e}");
        }
    }
}
