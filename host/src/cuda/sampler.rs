//! [`CudaSampler`]: one device, one module, one stream, a grow-only workspace, and the entry
//! points that queue sampling on them.

use std::cell::RefCell;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream};
use flashsample_core::abi::{DevicePtr, EstimateErrorArgs, ReadProbeArgs};
use flashsample_core::registry::{Kernel, Module};
use flashsample_core::{Candidate, RowParams};

use super::buffers::{CudaHidden, CudaLmHead, DeviceBuffer, DeviceRows, DeviceTokens, Workspace, ensure};
use super::dispatch::Variant;
use super::driver;
use super::modules::ModuleChoice;
use super::stream::{
    DeviceWorkspace, FusedProcessing, ProcessedRequest, SampleRequest, ShardTarget, StreamSampler, TensorMaps,
};
use crate::error::{Error, Result, invalid, tokens_or_row_status};
use crate::params::{
    Draws, HeadShape, SamplingParams, check_hidden_values, check_lm_head, check_request, check_request_shape,
};
use crate::tensor::{DType, Elements, Matrix, MatrixShape};

mod processed;

#[cfg(test)]
pub(crate) use processed::summarize;
pub use processed::{DeviceProcessing, ProcessedOutputs, ShardParts, VocabShard};
#[cfg(feature = "nccl")]
pub(crate) use processed::{ShardHead, ShardsStage};

/// The number of CUDA devices; [`Error::NoCudaDevice`] without a driver or a device.
pub fn cuda_device_count() -> Result<usize> {
    if !driver::driver_library_present() {
        return Err(Error::NoCudaDevice("the NVIDIA driver library (libcuda) is not installed".into()));
    }
    let no_device = |e: cudarc::driver::DriverError| Error::NoCudaDevice(driver::describe(&e));
    cudarc::driver::result::init().map_err(no_device)?;
    let count = CudaContext::device_count().map_err(no_device)?;
    if count <= 0 {
        return Err(Error::NoCudaDevice("the driver reports no device".into()));
    }
    Ok(count as usize)
}

/// The fused sampler on one CUDA device.
///
/// It holds the device's primary context, the PTX module chosen for the device, one
/// non-blocking stream and a grow-only workspace, so repeated calls allocate nothing and only
/// the calls that return host values wait for the device. Kernel errors that surface
/// asynchronously are reported by the next synchronising call with the kernel's name, by
/// [`CudaSampler::close`], or, if the sampler is just dropped, on standard error (never
/// silently lost).
pub struct CudaSampler {
    /// The kernels, loaded in the context. `None` only after [`CudaSampler::close`] or in
    /// `Drop`, which unload them before collecting the errors the driver reports.
    kernels: Option<StreamSampler>,
    workspace: RefCell<Workspace>,
    closed: bool,
    stream: Arc<CudaStream>,
    context: Arc<CudaContext>,
}

impl CudaSampler {
    /// A sampler on device 0 with the module for the device (or the one `FLASHSAMPLE_MODULE`
    /// forces). Without a driver or a device this is [`Error::NoCudaDevice`].
    pub fn new() -> Result<CudaSampler> {
        CudaSampler::on_device(0)
    }

    /// A sampler on device `ordinal` (as the driver numbers them; `CUDA_VISIBLE_DEVICES`
    /// applies), with the module for the device or the one `FLASHSAMPLE_MODULE` forces.
    pub fn on_device(ordinal: usize) -> Result<CudaSampler> {
        CudaSampler::with_module(ordinal, ModuleChoice::from_environment()?)
    }

    /// A sampler on device `ordinal` running the module `choice` names.
    pub fn with_module(ordinal: usize, choice: ModuleChoice) -> Result<CudaSampler> {
        let count = cuda_device_count()?;
        if ordinal >= count {
            return Err(invalid(
                "device",
                format!("ordinal {ordinal}: this machine has {count} CUDA device(s), ordinals 0 to {}", count - 1),
            ));
        }
        let context = driver::check(&format!("cuDevicePrimaryCtxRetain(device {ordinal})"), CudaContext::new(ordinal))?;
        // SAFETY: every buffer this sampler makes is allocated, used and freed on its one
        // stream, in queue order, so cudarc's cross-stream events are not needed. Callers who
        // touch a buffer from another stream order that themselves (documented on the
        // buffers).
        unsafe { context.disable_event_tracking() };
        let kernels = StreamSampler::on_context(&context, choice)?;
        let stream = driver::check("cuStreamCreate(NON_BLOCKING)", context.new_stream())?;
        Ok(CudaSampler { kernels: Some(kernels), workspace: RefCell::default(), closed: false, stream, context })
    }

    pub fn device_name(&self) -> &str {
        self.kernels().device_name()
    }

    pub fn multiprocessors(&self) -> u32 {
        self.kernels().multiprocessors()
    }

    /// The device's compute capability (major, minor).
    pub fn compute_capability(&self) -> (u32, u32) {
        self.kernels().compute_capability()
    }

    /// The PTX module this sampler runs.
    pub fn module(&self) -> Module {
        self.kernels().module()
    }

    /// The kernels, which borrowed-mode callers can also use on streams of their own (see
    /// [`StreamSampler`]).
    pub fn kernels(&self) -> &StreamSampler {
        self.kernels.as_ref().expect("the kernels are unloaded only by close and drop")
    }

    /// The stream all work is queued on (for event timing and for ordering the caller's own
    /// work with the sampler's).
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Makes the context current on this thread and reports any error the driver kept from
    /// a call that could not return one (a buffer's drop).
    fn make_current(&self) -> Result<()> {
        driver::check("cuCtxSetCurrent", self.context.bind_to_thread())
    }

    /// Launches `kernel` over `items` work items with a persistent grid (at most one wave).
    ///
    /// # Safety
    /// `args` must be the kernel's argument block with valid device addresses.
    unsafe fn launch<A: bytemuck::Pod>(&self, kernel: Kernel, items: u64, args: &A) -> Result<()> {
        // SAFETY: per this function's contract; the stream is of the kernels' context.
        unsafe { self.kernels().launch(self.stream.cu_stream(), kernel, items, args) }
    }

    /// Waits for all queued work; a kernel fault is reported as failing `after`.
    pub fn synchronize(&self, after: &str) -> Result<()> {
        driver::check(&format!("cuStreamSynchronize (after {after})"), self.stream.synchronize())
    }

    fn tma(&self) -> bool {
        self.module() == Module::Hopper
    }

    /// Uploads and checks an LM head (non-empty, `V < 2³¹`, finite).
    pub fn upload_lm_head(&self, lm_head: &Matrix) -> Result<CudaLmHead> {
        let shape = check_lm_head(lm_head)?;
        self.make_current()?;
        let buffer = DeviceBuffer::from_host(&self.stream, lm_head.elements().as_bytes(), "lm_head")?;
        CudaLmHead::new(&self.stream, buffer, shape, self.tma())
    }

    /// Uploads hidden states, checked finite.
    pub fn upload_hidden(&self, hidden: &Matrix) -> Result<CudaHidden> {
        check_hidden_values(hidden)?;
        self.make_current()?;
        let buffer = DeviceBuffer::from_host(&self.stream, hidden.elements().as_bytes(), "hidden")?;
        CudaHidden::new(&self.stream, buffer, hidden.shape(), self.tma())
    }

    /// Room for `rows × samples` tokens (filled by a later `sample_into`).
    pub fn tokens(&self, rows: usize, samples: usize) -> Result<DeviceTokens> {
        let len = rows
            .checked_mul(samples)
            .filter(|&n| n <= u32::MAX as usize)
            .ok_or_else(|| invalid("samples", format!("B x samples = {rows} x {samples} tokens: must be < 2^32")))?;
        self.make_current()?;
        // SAFETY: the merge kernel writes every slot before anyone reads it.
        let buffer = unsafe { DeviceBuffer::uninitialized(&self.stream, len, "tokens")? };
        Ok(DeviceTokens { buffer, rows, samples })
    }

    /// Sets every slot of `tokens` to `value` (tests poison the output to see unwritten slots).
    pub fn fill_tokens(&self, tokens: &mut DeviceTokens, value: u32) -> Result<()> {
        self.make_current()?;
        // SAFETY: the buffer holds `len` words and lives on our stream.
        unsafe {
            driver::fill_words_async("tokens", tokens.buffer.ptr(), value, tokens.buffer.len(), self.stream.cu_stream())
        }
    }

    /// `samples` draws per row with the dispatcher's kernel, tokens returned to the host.
    pub fn sample(
        &self,
        lm_head: &CudaLmHead,
        hidden: &Matrix,
        params: &[SamplingParams],
        samples: u32,
    ) -> Result<Vec<u32>> {
        self.sample_with(lm_head, hidden, params, samples, Variant::Auto)
    }

    /// As [`CudaSampler::sample`] with an explicit tile variant.
    pub fn sample_with(
        &self,
        lm_head: &CudaLmHead,
        hidden: &Matrix,
        params: &[SamplingParams],
        samples: u32,
        variant: Variant,
    ) -> Result<Vec<u32>> {
        self.sample_draws(lm_head, hidden, params, Draws::first(samples), variant)
    }

    /// The draws `draws` of each row with `variant`, tokens returned to the host:
    /// `tokens[b · draws.count + (j − draws.first)]`.
    pub fn sample_draws(
        &self,
        lm_head: &CudaLmHead,
        hidden: &Matrix,
        params: &[SamplingParams],
        draws: Draws,
        variant: Variant,
    ) -> Result<Vec<u32>> {
        check_request(lm_head.shape, hidden.shape(), params, draws.check()?.count)?;
        let hidden = self.upload_hidden(hidden)?;
        let mut tokens = self.tokens(hidden.rows(), draws.count as usize)?;
        self.sample_draws_into(lm_head, &hidden, params, draws, variant, &mut tokens)?;
        self.tokens_to_host(&tokens)
    }

    /// Queues fused sampling into `tokens` (`[B, samples]`); allocates nothing once the
    /// workspace has grown to the problem, and never waits for the device. The row
    /// parameters are copied to the device on the stream first; a loop that keeps them on
    /// the device calls [`CudaSampler::sample_rows_into`] instead.
    pub fn sample_into(
        &self,
        lm_head: &CudaLmHead,
        hidden: &CudaHidden,
        params: &[SamplingParams],
        samples: u32,
        variant: Variant,
        tokens: &mut DeviceTokens,
    ) -> Result<()> {
        self.sample_draws_into(lm_head, hidden, params, Draws::first(samples), variant, tokens)
    }

    /// As [`CudaSampler::sample_into`] for the draws `draws` (`tokens` is `[B, draws.count]`).
    pub fn sample_draws_into(
        &self,
        lm_head: &CudaLmHead,
        hidden: &CudaHidden,
        params: &[SamplingParams],
        draws: Draws,
        variant: Variant,
        tokens: &mut DeviceTokens,
    ) -> Result<()> {
        let row_params = check_request(lm_head.shape, hidden.shape, params, draws.check()?.count)?;
        self.make_current()?;
        let row_params = self.stage_row_params(&row_params)?;
        self.sample_at(lm_head, hidden, row_params, draws, variant, None, tokens)
    }

    /// Checks per-row parameters and copies them to the device once.
    pub fn upload_rows(&self, params: &[SamplingParams]) -> Result<DeviceRows> {
        self.make_current()?;
        DeviceRows::upload(&self.stream, params)
    }

    /// As [`CudaSampler::sample_into`] with row parameters already on the device: the call
    /// queues kernels only, no copy.
    pub fn sample_rows_into(
        &self,
        lm_head: &CudaLmHead,
        hidden: &CudaHidden,
        rows: &DeviceRows,
        samples: u32,
        variant: Variant,
        tokens: &mut DeviceTokens,
    ) -> Result<()> {
        self.check_device_rows(lm_head, hidden, rows, samples)?;
        self.sample_at(lm_head, hidden, rows.buffer.ptr(), Draws::first(samples), variant, None, tokens)
    }

    /// Fused sampling of a vocabulary shard (`shard`'s winners instead of tokens), or of the
    /// whole head into `tokens` (`shard = None`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn sample_at_target(
        &self,
        lm_head: &CudaLmHead,
        hidden: &CudaHidden,
        row_params: DevicePtr<RowParams>,
        draws: Draws,
        variant: Variant,
        processing: Option<FusedProcessing>,
        tokens: u64,
        shard: Option<ShardTarget>,
    ) -> Result<()> {
        let request = SampleRequest {
            lm_head: lm_head.matrix(),
            hidden: hidden.matrix(),
            row_params: row_params.address(),
            tokens,
            draws,
            variant,
            processing,
            shard,
        };
        let plan = self.kernels().plan_call(&request)?;
        let maps = resident_maps(lm_head, hidden, plan.variant)?;
        let workspace = self.scratch(plan.workspace_bytes)?;
        // SAFETY: every address comes from a live buffer of this sampler, sized for the request
        // and used on its one stream; the resident maps live as long as the buffers.
        unsafe { self.kernels().enqueue(self.stream.cu_stream(), &request, &plan, maps, workspace) }
    }

    /// Queues a processed request over this sampler's buffers (`lm_head` and `hidden` are
    /// the request's matrices) on its stream; the context is current.
    ///
    /// # Safety
    /// Every address of `request` comes from a live buffer of this sampler holding the
    /// request's extents.
    pub(crate) unsafe fn enqueue_processed(
        &self,
        lm_head: &CudaLmHead,
        hidden: &CudaHidden,
        request: &ProcessedRequest,
    ) -> Result<()> {
        let plan = self.kernels().plan_processed(request)?;
        let maps = resident_maps(lm_head, hidden, plan.variant())?;
        let workspace = self.scratch(plan.workspace_bytes())?;
        // SAFETY: per this function's contract; the workspace is this stream's, sized by the
        // plan; the resident maps live as long as the buffers.
        unsafe { self.kernels().enqueue_processed(self.stream.cu_stream(), request, &plan, maps, workspace) }
    }

    /// The scratch workspace, grown to at least `bytes`.
    fn scratch(&self, bytes: usize) -> Result<DeviceWorkspace> {
        let scratch = ensure(&self.stream, &mut self.workspace.borrow_mut().scratch, bytes, "workspace")?;
        Ok(DeviceWorkspace { address: scratch.address(), bytes })
    }

    #[allow(clippy::too_many_arguments)]
    fn sample_at(
        &self,
        lm_head: &CudaLmHead,
        hidden: &CudaHidden,
        row_params: DevicePtr<RowParams>,
        draws: Draws,
        variant: Variant,
        processing: Option<FusedProcessing>,
        tokens: &mut DeviceTokens,
    ) -> Result<()> {
        self.check_tokens(hidden, draws.count, tokens)?;
        self.sample_at_target(lm_head, hidden, row_params, draws, variant, processing, tokens.address(), None)
    }

    fn check_tokens(&self, hidden: &CudaHidden, samples: u32, tokens: &DeviceTokens) -> Result<()> {
        let batch = hidden.rows();
        if tokens.rows != batch || tokens.samples != samples as usize {
            return Err(invalid(
                "tokens",
                format!(
                    "room for [{}, {}] tokens, the request makes [{batch}, {samples}]",
                    tokens.rows, tokens.samples
                ),
            ));
        }
        Ok(())
    }

    /// The unfused pipeline on the same inputs: a GEMM (the tile of `variant`, an mma or TMA
    /// one) writes f32 logits `[B, V]`, a sampler reads them back. The logits are bit-identical
    /// to the fused kernel's of the same variant, so are the tokens.
    pub fn sample_unfused_into(
        &self,
        lm_head: &CudaLmHead,
        hidden: &CudaHidden,
        rows: &DeviceRows,
        samples: u32,
        variant: Variant,
        tokens: &mut DeviceTokens,
    ) -> Result<()> {
        self.check_device_rows(lm_head, hidden, rows, samples)?;
        self.check_tokens(hidden, samples, tokens)?;
        let request = SampleRequest {
            lm_head: lm_head.matrix(),
            hidden: hidden.matrix(),
            row_params: rows.address(),
            tokens: tokens.address(),
            draws: Draws::first(samples),
            variant,
            processing: None,
            shard: None,
        };
        let plan = self.kernels().plan_unfused(&request)?;
        let maps = resident_maps(lm_head, hidden, plan.variant)?;
        let workspace = self.scratch(plan.workspace_bytes)?;
        // SAFETY: every address comes from a live buffer of this sampler sized for the request.
        unsafe { self.kernels().enqueue_unfused(self.stream.cu_stream(), &request, &plan, maps, workspace) }
    }

    fn check_device_rows(
        &self,
        lm_head: &CudaLmHead,
        hidden: &CudaHidden,
        rows: &DeviceRows,
        samples: u32,
    ) -> Result<()> {
        check_request_shape(lm_head.shape, hidden.shape, rows.rows(), "rows", samples)?;
        self.make_current()
    }

    /// Copies row parameters into the workspace, ordered on the stream; returns their address.
    fn stage_row_params(&self, row_params: &[RowParams]) -> Result<DevicePtr<RowParams>> {
        let address =
            ensure(&self.stream, &mut self.workspace.borrow_mut().row_params, row_params.len(), "row parameters")?;
        // SAFETY: the buffer holds at least this many; the copy is ordered on our stream.
        unsafe { driver::copy_to_device_async("row parameters", address, row_params, self.stream.cu_stream())? };
        Ok(address)
    }

    /// Fills the workspace with a candidate that wins every merge (score +inf, word
    /// `u32::MAX`, index [`CudaSampler::POISON_INDEX`], not a token): a tile kernel that leaves
    /// a slot unwritten then shows up as that index in the tokens, and unwritten logits, terms
    /// or winners of the materialised path as non-finite values or indices that are no token.
    /// Tests call this before sampling (after a call of the same shape has grown it).
    pub fn poison_workspace(&self) -> Result<()> {
        self.make_current()?;
        let poison = Candidate { score: f32::INFINITY, word: u32::MAX, index: Self::POISON_INDEX };
        let workspace = self.workspace.borrow();
        if let Some(scratch) = workspace.scratch.as_ref() {
            let host = vec![poison; scratch.len() / size_of::<Candidate>()];
            // SAFETY: the buffer holds `len` bytes (at least this many candidates) and lives on
            // our stream.
            unsafe {
                driver::copy_to_device_async("poison candidates", scratch.ptr().cast(), &host, self.stream.cu_stream())?
            };
        }
        Ok(())
    }

    /// Fills `words` u32 at `at` with the bits of +∞: as a winner, a score that wins every
    /// merge with an index that is no token; as logits or sums, +∞.
    ///
    /// # Safety
    /// `at` holds `words` u32 of device memory used on this sampler's stream.
    pub(crate) unsafe fn poison_words(&self, what: &str, at: DevicePtr<u32>, words: usize) -> Result<()> {
        // SAFETY: per this function's contract.
        unsafe { driver::fill_words_async(what, at, f32::INFINITY.to_bits(), words, self.stream.cu_stream()) }
    }

    /// The poison index of [`CudaSampler::poison_workspace`].
    pub const POISON_INDEX: u32 = 0x7fff_fff0;

    /// Waits for the tokens and copies them to the host; rows without a token are
    /// [`Error::RowsWithoutToken`].
    pub fn tokens_to_host(&self, tokens: &DeviceTokens) -> Result<Vec<u32>> {
        self.make_current()?;
        self.synchronize("sampling")?;
        let host = tokens.buffer.to_host(&self.stream, "tokens")?;
        tokens_or_row_status(host, tokens.samples)
    }

    /// An LM head of uniform values in `[-scale, scale)` made on the device (benchmarks, demo).
    pub fn random_lm_head(&self, vocab: usize, dim: usize, dtype: DType, seed: u64, scale: f32) -> Result<CudaLmHead> {
        let buffer = self.random_buffer(vocab * dim, dtype, seed, scale)?;
        CudaLmHead::new(&self.stream, buffer, HeadShape { vocab, dim, dtype }, self.tma())
    }

    /// Hidden states of uniform values made on the device.
    pub fn random_hidden(&self, rows: usize, cols: usize, dtype: DType, seed: u64, scale: f32) -> Result<CudaHidden> {
        let buffer = self.random_buffer(rows * cols, dtype, seed, scale)?;
        CudaHidden::new(&self.stream, buffer, MatrixShape { rows, cols, dtype }, self.tma())
    }

    fn random_buffer(&self, count: usize, dtype: DType, seed: u64, scale: f32) -> Result<DeviceBuffer<u8>> {
        self.make_current()?;
        // SAFETY: the fill kernel writes every element before anything reads it.
        let buffer = unsafe { DeviceBuffer::<u8>::uninitialized(&self.stream, count * dtype.bytes(), "random")? };
        // SAFETY: the buffer holds `count` elements of `dtype` and lives on our stream.
        unsafe {
            self.kernels().fill_uniform(
                self.stream.cu_stream().cast(),
                buffer.ptr().address(),
                count,
                dtype,
                seed,
                scale,
            )?
        };
        Ok(buffer)
    }

    /// Copies a device LM head back (the demo checks the GPU against the CPU on it).
    pub fn lm_head_to_host(&self, lm_head: &CudaLmHead) -> Result<Matrix> {
        self.make_current()?;
        let bytes = lm_head.buffer.to_host(&self.stream, "lm_head")?;
        let elements = elements_from_bytes(&bytes, lm_head.shape.dtype);
        Matrix::new("lm_head", lm_head.shape.vocab, lm_head.shape.dim, elements)
    }

    /// Copies device hidden states back.
    pub fn hidden_to_host(&self, hidden: &CudaHidden) -> Result<Matrix> {
        self.make_current()?;
        let bytes = hidden.buffer.to_host(&self.stream, "hidden")?;
        Matrix::new("hidden", hidden.shape.rows, hidden.shape.cols, elements_from_bytes(&bytes, hidden.shape.dtype))
    }

    /// Queues one pass of 16-byte loads over the LM head's bytes: the read-bandwidth floor.
    pub fn read_probe(&self, lm_head: &CudaLmHead) -> Result<()> {
        self.make_current()?;
        let sink = ensure(&self.stream, &mut self.workspace.borrow_mut().probe_sink, 1, "probe sink")?;
        let bytes = (lm_head.buffer.size_bytes() / 64 * 64) as u64;
        let args = ReadProbeArgs { source: lm_head.buffer.ptr().cast(), bytes, sink };
        // SAFETY: `bytes` is within the buffer; the sink holds one u32.
        unsafe { self.launch(Kernel::ReadProbe, u64::MAX, &args) }
    }

    /// The largest `|gumbel_estimate(x) − gumbel(x)|` over all 2³² words `x`, computed on this
    /// device with its `lg2.approx`: what the fused kernels' filter assumes is at most
    /// [`flashsample_core::estimate::GUMBEL_ESTIMATE_ERROR`].
    pub fn gumbel_estimate_max_error(&self) -> Result<f32> {
        self.make_current()?;
        let out = DeviceBuffer::from_host(&self.stream, &[0u32], "estimate error")?;
        let args = EstimateErrorArgs { out: out.ptr() };
        // SAFETY: `out` is one zeroed u32.
        unsafe { self.launch(Kernel::GumbelEstimateError, u64::MAX, &args)? };
        self.synchronize("gumbel_estimate_error")?;
        Ok(f32::from_bits(out.to_host(&self.stream, "estimate error")?[0]))
    }

    /// Waits for queued work, frees the workspace, unloads the module, and reports every
    /// error the driver kept on the way.
    fn finish(&mut self) -> Result<()> {
        self.closed = true;
        let waited = self.make_current().and_then(|()| self.synchronize("all queued work"));
        *self.workspace.get_mut() = Workspace::default();
        let unloaded = self.kernels.take().map_or(Ok(()), StreamSampler::close);
        let freed = self.synchronize("freeing the workspace and unloading the module");
        waited.and(unloaded).and(freed)
    }

    /// Waits for outstanding work and reports any error it left; the sampler is then gone.
    pub fn close(mut self) -> Result<()> {
        self.finish()
    }
}

impl Drop for CudaSampler {
    fn drop(&mut self) {
        if !self.closed
            && let Err(e) = self.finish()
        {
            eprintln!("flashsample: error while dropping CudaSampler (call close to handle it): {e}");
        }
    }
}

fn elements_from_bytes(bytes: &[u8], dtype: DType) -> Elements {
    match dtype {
        DType::F32 => Elements::F32(bytemuck::pod_collect_to_vec(bytes)),
        DType::F16 => Elements::F16(bytemuck::pod_collect_to_vec(bytes)),
        DType::BF16 => Elements::BF16(bytemuck::pod_collect_to_vec(bytes)),
    }
}

/// The resident tensor maps of `lm_head` and `hidden` for `variant`'s boxes (TMA), or none.
fn resident_maps(lm_head: &CudaLmHead, hidden: &CudaHidden, variant: Variant) -> Result<TensorMaps> {
    Ok(match variant.tma_boxes() {
        Some((rows, columns)) => {
            TensorMaps::Resident { lm_head: lm_head.tensor_map(rows, columns)?, hidden: hidden.tensor_map(columns)? }
        }
        None => TensorMaps::Store,
    })
}
