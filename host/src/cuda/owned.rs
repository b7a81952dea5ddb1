//! [`CudaSampler`]: one device, its primary context, the module for it, one stream and a
//! grow-only scratch workspace; the buffers it makes (LM heads, hidden states, outputs) keep
//! their tensor maps beside them. Every call plans a [`Request`] of its buffers and queues it
//! through the one segment driver, as borrowed mode does.

use std::cell::RefCell;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream, DevicePtr as _};
use flashsample_core::abi::{ShardExchangeLayout, TensorMap};
use flashsample_core::registry::Module;

#[cfg(feature = "internals")]
mod hooks;

use super::batch::DeviceBatch;
use super::dispatch::Variant;
use super::driver;
use super::enqueue::{Planned, drive};
use super::memory::{Allocation, MatrixRef, ResidentMaps, ensure};
use super::modules::{ModuleChoice, cuda_device_count};
use super::plan::Plan;
use super::request::{DeviceMatrix, DeviceWorkspace, OutputSlice, Request, Shard, Target};
use super::stream::StreamSampler;
use crate::batch::Batch;
use crate::error::{Result, invalid, sampled_or_row_status};
use crate::params::{Draws, HeadShape, VocabShard, check_hidden_values, check_lm_head, check_request_shape};
use crate::sampled::{Sampled, Verdict};
use crate::sampler::{HeadStorage, LmHead, Owner, Sampler};
use crate::tensor::{Matrix, MatrixShape};

/// The fused sampler on one CUDA device.
///
/// It holds the device's primary context, the PTX module chosen for the device, one
/// non-blocking stream and a grow-only workspace, so repeated calls allocate nothing and only
/// the calls that return host values wait for the device. Kernel errors that surface
/// asynchronously are reported by the next synchronising call with the kernel's name, by
/// [`CudaSampler::close`], or, if the sampler is just dropped, on standard error (never
/// silently lost).
///
/// A decode loop keeps its inputs on the device and queues [`CudaSampler::sample_into`]:
///
/// ```no_run
/// use flashsample::{Batch, CudaSampler, Draws, Elements, Matrix, Sampler, SamplingParams};
/// let sampler = CudaSampler::new()?;
/// let w = Matrix::new("lm_head", 4096, 64, Elements::F32(vec![0.01; 4096 * 64]))?;
/// let head = sampler.upload_lm_head(&w)?;
/// let batch = Batch::new((0..2).map(|r| SamplingParams::new(0.8, 1, r, 0)).collect());
/// let mut on_device = sampler.upload_batch(&batch, 4096)?;
/// let mut outputs = sampler.outputs(&on_device, 1)?;
/// for step in 0..3 {
///     let h = Matrix::new("hidden", 2, 64, Elements::F32(vec![step as f32; 128]))?;
///     let hidden = sampler.upload_hidden(&h)?;
///     sampler.sample_into(&head, &hidden, &on_device, Draws::first(1), &mut outputs)?;
///     sampler.advance_steps(&mut on_device, 1)?;
///     println!("step {step}: {:?}", sampler.read(&outputs)?.tokens);
/// }
/// # Ok::<(), flashsample::Error>(())
/// ```
pub struct CudaSampler {
    /// The kernels, loaded in the context. `None` only after [`CudaSampler::close`] or in
    /// `Drop`, which unload them before collecting the errors the driver reports.
    kernels: Option<StreamSampler>,
    scratch: RefCell<Scratch>,
    closed: bool,
    owner: Owner,
    /// The tile the calls run (`Auto`: the dispatcher's).
    variant: std::cell::Cell<Variant>,
    stream: Arc<CudaStream>,
    context: Arc<CudaContext>,
}

/// Device buffers reused across calls; they only grow.
#[derive(Default)]
struct Scratch {
    /// A call's workspace, or the workspaces of a call's shards side by side.
    workspace: Option<Allocation<u8>>,
    /// The gathered parts of a call over several shards.
    parts: Option<Allocation<u8>>,
    /// The exchange buffer of shards whose rows truncate.
    exchange: Option<Allocation<u8>>,
    /// The read probe's one-word sink.
    #[cfg_attr(not(feature = "internals"), allow(dead_code))]
    probe_sink: Option<Allocation<u32>>,
}

/// One vocabulary shard of an LM head in device memory, with its tensor maps when the TMA
/// tiles can read it.
pub(crate) struct ResidentHead {
    buffer: Allocation<u8>,
    /// The shard's own rows.
    shape: HeadShape,
    maps: Option<Allocation<TensorMap>>,
}

impl ResidentHead {
    fn matrix(&self) -> MatrixRef {
        MatrixRef::contiguous(self.buffer.ptr().address(), self.shape.vocab, self.shape.dim, self.shape.dtype)
    }

    fn view(&self) -> DeviceMatrix<'_> {
        DeviceMatrix::resident(self.matrix(), self.maps.as_ref().map(|m| ResidentMaps::LmHead(m.ptr())))
    }
}

/// Hidden states `H[B, D]` in device memory, with their tensor maps when the TMA tiles can
/// read them.
pub struct CudaHidden {
    buffer: Allocation<u8>,
    shape: MatrixShape,
    maps: Option<Allocation<TensorMap>>,
}

impl CudaHidden {
    /// B, the rows.
    pub fn rows(&self) -> usize {
        self.shape.rows
    }

    /// The shape and element type.
    pub fn shape(&self) -> MatrixShape {
        self.shape
    }

    /// The device address of `H[0, 0]` (row-major, `D` elements per row), for callers that
    /// also read `H` on the device.
    pub fn address(&self) -> u64 {
        self.buffer.ptr().address()
    }

    fn matrix(&self) -> MatrixRef {
        MatrixRef::contiguous(self.address(), self.shape.rows, self.shape.cols, self.shape.dtype)
    }

    fn view(&self) -> DeviceMatrix<'_> {
        DeviceMatrix::resident(self.matrix(), self.maps.as_ref().map(|m| ResidentMaps::Hidden(m.ptr())))
    }
}

/// What a call writes in device memory: `[B, N]` tokens and, when the batch asks for them,
/// their raw and processed log-probabilities and each row's top raw log-probabilities, and a
/// verification's verdicts (the layouts of [`Target`]).
pub struct DeviceOutputs {
    tokens: Allocation<u32>,
    logprobs: Option<(Allocation<f32>, Allocation<u32>)>,
    /// A verification's `[S]` counts of kept drafts, and each sequence's first row.
    verdicts: Option<(Allocation<u32>, Vec<usize>)>,
    rows: usize,
    draws: u32,
}

impl DeviceOutputs {
    /// B, the rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// N, the draws per row.
    pub fn draws(&self) -> u32 {
        self.draws
    }

    /// The device address of `tokens[0]` (`[B, N]` u32), for callers that consume tokens on
    /// the device.
    pub fn tokens_address(&self) -> u64 {
        self.tokens.ptr().address()
    }

    /// The target of a call with `batch` making `draws` draws of each of `rows` rows: its
    /// shape must be the outputs' and a verification's sequences those they were made for.
    fn target_of(&self, batch: &DeviceBatch, rows: usize, draws: u32) -> Result<Target<'_>> {
        if (self.rows, self.draws) != (rows, draws) {
            return Err(invalid(
                "outputs",
                format!("room for [{}, {}] draws, the call makes [{rows}, {draws}]", self.rows, self.draws),
            ));
        }
        let first_rows = self.verdicts.as_ref().map_or(&[][..], |(_, first_rows)| first_rows.as_slice());
        if first_rows != batch.first_rows() {
            return Err(invalid("outputs", "made for a batch that verifies other sequences: make them for this one"));
        }
        Ok(self.target())
    }

    fn target(&self) -> Target<'_> {
        let (logprobs, top_logprobs) = match &self.logprobs {
            Some((values, top)) => (
                Some(OutputSlice::resident(values.ptr().address(), values.len())),
                Some(OutputSlice::resident(top.ptr().address(), top.len())),
            ),
            None => (None, None),
        };
        Target {
            tokens: OutputSlice::resident(self.tokens.ptr().address(), self.tokens.len()),
            logprobs,
            top_logprobs,
            parts: None,
            accepted: self
                .verdicts
                .as_ref()
                .map(|(accepted, _)| OutputSlice::resident(accepted.ptr().address(), accepted.len())),
        }
    }
}

impl std::fmt::Debug for CudaSampler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.kernels {
            Some(kernels) => f
                .debug_struct("CudaSampler")
                .field("device", &kernels.device_name())
                .field("module", &kernels.module())
                .field("variant", &self.variant.get())
                .finish(),
            None => f.write_str("CudaSampler (closed)"),
        }
    }
}

impl std::fmt::Debug for CudaHidden {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaHidden").field("shape", &self.shape).field("tensor_maps", &self.maps.is_some()).finish()
    }
}

impl std::fmt::Debug for DeviceOutputs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceOutputs")
            .field("rows", &self.rows)
            .field("draws", &self.draws)
            .field("logprobs", &self.logprobs.is_some())
            .finish()
    }
}

impl CudaSampler {
    /// A sampler on device 0 with the module for the device (or the one `FLASHSAMPLE_MODULE`
    /// forces). Without a driver or a device this is [`crate::Error::NoCudaDevice`].
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
        // touch a buffer from another stream order that themselves.
        unsafe { context.disable_event_tracking() };
        let kernels = StreamSampler::on_context(&context, choice)?;
        let stream = driver::check("cuStreamCreate(NON_BLOCKING)", context.new_stream())?;
        Ok(CudaSampler {
            kernels: Some(kernels),
            scratch: RefCell::default(),
            closed: false,
            owner: Owner::next(),
            variant: std::cell::Cell::new(Variant::Auto),
            stream,
            context,
        })
    }

    /// Makes every later call run the tile `variant` (`Auto`: the dispatcher's; tests and
    /// benchmarks compare the tiles).
    #[cfg(feature = "internals")]
    pub fn set_variant(&self, variant: Variant) {
        self.variant.set(variant);
    }

    /// The device's name.
    pub fn device_name(&self) -> &str {
        self.kernels().device_name()
    }

    /// The device's multiprocessors.
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

    /// The kernels, which borrowed-mode calls can also use on streams of their own (see
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

    /// Waits for all queued work; a kernel fault is reported as failing `after`.
    pub fn synchronize(&self, after: &str) -> Result<()> {
        driver::check(&format!("cuStreamSynchronize (after {after})"), self.stream.synchronize())
    }

    fn tma(&self) -> bool {
        self.module() == Module::Hopper
    }

    /// A head's shards in this sampler's memory: its own, or an error naming `lm_head`.
    fn shards<'h>(&self, lm_head: &'h LmHead) -> Result<&'h [ResidentHead]> {
        lm_head.check_owner(self.owner)?;
        match &lm_head.storage {
            HeadStorage::Cuda(shards) => Ok(shards),
            HeadStorage::Cpu(_) => Err(invalid("lm_head", "uploaded by a CPU sampler: upload it with this one")),
        }
    }

    /// A shard of `W` in device memory, with its tensor maps (Hopper module).
    fn resident_head(&self, buffer: Allocation<u8>, shape: HeadShape) -> Result<ResidentHead> {
        let matrix = MatrixRef::contiguous(buffer.ptr().address(), shape.vocab, shape.dim, shape.dtype);
        let maps = match self.tma() {
            true => ResidentMaps::upload(&self.stream, "lm_head", &matrix, true)?,
            false => None,
        };
        Ok(ResidentHead { buffer, shape, maps })
    }

    /// Uploads hidden states `H[B, D]`, checked finite.
    pub fn upload_hidden(&self, hidden: &Matrix) -> Result<CudaHidden> {
        check_hidden_values(hidden)?;
        self.make_current()?;
        let buffer = Allocation::from_host(&self.stream, hidden.elements().as_bytes(), "hidden")?;
        self.resident_hidden(buffer, hidden.shape())
    }

    fn resident_hidden(&self, buffer: Allocation<u8>, shape: MatrixShape) -> Result<CudaHidden> {
        let matrix = MatrixRef::contiguous(buffer.ptr().address(), shape.rows, shape.cols, shape.dtype);
        let maps = match self.tma() {
            true => ResidentMaps::upload(&self.stream, "hidden", &matrix, false)?,
            false => None,
        };
        Ok(CudaHidden { buffer, shape, maps })
    }

    /// Checks `batch` for a vocabulary of `vocab` tokens and copies it to the device on the
    /// sampler's stream ([`DeviceBatch::upload`]).
    pub fn upload_batch(&self, batch: &Batch, vocab: usize) -> Result<DeviceBatch> {
        self.make_current()?;
        DeviceBatch::upload(&self.stream, batch, vocab)
    }

    /// Room for the outputs of calls with `batch` making `draws` draws of each row: the tokens,
    /// the log-probabilities and top log-probabilities if a row reports them (without them no
    /// log-sum-exp is summed and the logits are processed in place: less work, and half the
    /// workspace on the materialised path), and a verification's verdicts.
    pub fn outputs(&self, batch: &DeviceBatch, draws: u32) -> Result<DeviceOutputs> {
        let (rows, logprobs) = (batch.rows(), batch.reports_logprobs());
        crate::params::check_token_count(rows, draws)?;
        self.make_current()?;
        let slots = rows * draws as usize;
        // SAFETY: the merge kernel writes every slot before anyone reads it.
        let tokens = unsafe { Allocation::uninitialized(&self.stream, slots, "tokens")? };
        let logprobs = match logprobs {
            // SAFETY: the kernels write every value before it is read.
            true => Some(unsafe {
                (
                    Allocation::uninitialized(&self.stream, Target::logprobs_len(rows, draws), "log-probabilities")?,
                    Allocation::uninitialized(&self.stream, Target::top_logprobs_len(rows), "top log-probabilities")?,
                )
            }),
            false => None,
        };
        let verdicts = match batch.verified_sequences() {
            0 => None,
            // SAFETY: the verdicts kernel writes every slot before it is read.
            sequences => Some((
                unsafe { Allocation::uninitialized(&self.stream, sequences, "verdicts")? },
                batch.first_rows().to_vec(),
            )),
        };
        Ok(DeviceOutputs { tokens, logprobs, verdicts, rows, draws })
    }

    /// Queues the draws `draws` of each row of `hidden` from `lm_head` with `batch`'s
    /// parameters and processing into `outputs` (`[B, draws.count]`, with log-probabilities
    /// when it has room for them): the owned form of [`StreamSampler::enqueue_on`]. Unless a
    /// row needs its whole row (soft-cap, bias, mask and penalties only, with or without
    /// log-probabilities) the fused tiles apply the steps to each logits tile on chip: no
    /// logits in memory. Otherwise the logits are materialised in the workspace (`B · V`
    /// floats; twice that when log-probabilities keep the raw logits beside the processed
    /// ones), by the tensor-core GEMM for a BF16 or F16 head with `D % 8 == 0` and by the
    /// CUDA-core tile for any other. A head kept in several shards
    /// runs each shard's stage 1, the shards deciding min-p, top-k and top-p together through
    /// one exchange buffer, then merges them: the tokens of the whole head. Allocates nothing
    /// once the workspace has grown to the problem, and never waits for the device.
    pub fn sample_into(
        &self,
        lm_head: &LmHead,
        hidden: &CudaHidden,
        batch: &DeviceBatch,
        draws: Draws,
        outputs: &mut DeviceOutputs,
    ) -> Result<()> {
        let shards = self.shards(lm_head)?;
        let draws = draws.check()?;
        outputs.target_of(batch, hidden.rows(), draws.count)?;
        self.make_current()?;
        if let [head] = shards {
            return self.sample_head_into(head, hidden, batch, draws, outputs).map(|_| ());
        }
        self.sample_shards_into(lm_head, shards, hidden, batch, draws, outputs)
    }

    /// [`CudaSampler::sample_into`] for a head kept whole, with `draws` and `outputs` checked
    /// and the context current; returns the plan it queued.
    fn sample_head_into(
        &self,
        head: &ResidentHead,
        hidden: &CudaHidden,
        batch: &DeviceBatch,
        draws: Draws,
        outputs: &DeviceOutputs,
    ) -> Result<Plan> {
        let stream: &CudaStream = &self.stream;
        let kernels = self.kernels().kernels();
        let request =
            Request { lm_head: head.view(), hidden: hidden.view(), batch: batch.view(stream), draws, shard: None };
        let plan = Plan::new(kernels, &request, &outputs.target(), self.variant.get())?;
        let workspace = self.workspace(plan.workspace_bytes())?;
        let call = Planned { kernels, stream: stream.cu_stream(), plan, workspace };
        // SAFETY: every address comes from a live buffer of this sampler holding the request's
        // extents (checked by the plan), used on its one stream; the resident maps live as long
        // as the buffers; an unsharded call exchanges nothing.
        unsafe { drive(std::slice::from_ref(&call), |_| Err(invalid("lm_head", "one shard exchanges nothing")))? };
        Ok(plan)
    }

    /// Stage 1 of every shard of `lm_head` into the sampler's parts, segment by segment (the
    /// shards of one device share one exchange buffer, into which their processing kernels
    /// merge each row's largest logit and histograms, so there is nothing to reduce between
    /// the segments, and their parts lie side by side, so there is nothing to gather), then
    /// one merge into `outputs`.
    fn sample_shards_into(
        &self,
        lm_head: &LmHead,
        shards: &[ResidentHead],
        hidden: &CudaHidden,
        batch: &DeviceBatch,
        draws: Draws,
        outputs: &mut DeviceOutputs,
    ) -> Result<()> {
        let stream: &CudaStream = &self.stream;
        let kernels = self.kernels().kernels();
        let (rows, logprobs) = (hidden.rows(), outputs.logprobs.is_some());
        let parts_bytes = Target::parts_bytes(shards.len(), rows, draws.count, logprobs)?;
        let mut scratch = self.scratch.borrow_mut();
        let parts = ensure(&self.stream, &mut scratch.parts, parts_bytes, "shard parts")?.address();
        let processing = batch.summary();
        let exchange_bytes = match processing.truncates() {
            true => ShardExchangeLayout::of(rows as u32, processing.selections).bytes as usize,
            false => 0,
        };
        let exchange = ensure(&self.stream, &mut scratch.exchange, exchange_bytes.max(16), "shard exchange")?;
        drop(scratch);
        let mut planned = Vec::with_capacity(shards.len());
        let mut workspace_bytes = 0;
        for (index, (head, &offset)) in shards.iter().zip(&lm_head.offsets).enumerate() {
            let tokens = VocabShard { offset, vocab: lm_head.shape.vocab };
            let request = Request {
                lm_head: head.view(),
                hidden: hidden.view(),
                batch: batch.view(stream),
                draws,
                shard: Some(Shard { tokens, index, count: shards.len() }),
            };
            let mut target = outputs.target();
            target.parts = Some(OutputSlice::resident(parts, parts_bytes));
            let mut plan =
                Plan::new(kernels, &request, &target, self.variant.get())?.share_exchange(exchange.address());
            if index > 0 {
                // The parts lie side by side in one buffer: the first shard merges them all,
                // then judges a verification.
                plan.merge = None;
                plan.verdicts = None;
            }
            // Each shard's workspace starts on a 256-byte boundary, as an allocation does.
            let at = workspace_bytes;
            workspace_bytes = (at + plan.workspace_bytes()).next_multiple_of(256);
            let workspace = DeviceWorkspace { address: at as u64, bytes: plan.workspace_bytes() };
            planned.push(Planned { kernels, stream: stream.cu_stream(), plan, workspace });
        }
        let stages = planned[0].plan.path.segments();
        if let Some(s) = planned.iter().position(|p| p.plan.path.segments() != stages) {
            return Err(invalid(
                format!("lm_head.shards[{s}]"),
                "its stage 1 runs in other segments than shard 0's: the shards must share D and dtype",
            ));
        }
        let base = self.workspace(workspace_bytes)?.address;
        for call in &mut planned {
            call.workspace.address += base;
        }
        if exchange_bytes > 0 {
            // SAFETY: the exchange holds its layout's bytes (a multiple of 16) on our stream;
            // it is cleared before any shard's segment 0.
            unsafe {
                driver::fill_words_async(
                    "shard exchange",
                    exchange.cast(),
                    0,
                    exchange_bytes / 4,
                    self.stream.cu_stream(),
                )?;
            }
        }
        // SAFETY: every address comes from a live buffer of this sampler holding the requests'
        // extents (checked by the plans), used on its one stream; each shard has its own part
        // of the workspace; the shared exchange and the side-by-side parts need no collective.
        unsafe { drive(&planned, |_| Ok(())) }
    }

    /// The planned call of shard `shard` of a head whose shard on this device is `head`:
    /// stage 1 into its part of this sampler's parts, the gather, the merge into `outputs`.
    #[cfg(feature = "nccl")]
    pub(crate) fn plan_shard(
        &self,
        head: &ResidentHead,
        shard: Shard,
        hidden: &CudaHidden,
        batch: &DeviceBatch,
        draws: Draws,
        outputs: &DeviceOutputs,
    ) -> Result<Planned<'_>> {
        let draws = draws.check()?;
        self.make_current()?;
        let stream: &CudaStream = &self.stream;
        let logprobs = outputs.logprobs.is_some();
        let parts_bytes = Target::parts_bytes(shard.count, hidden.rows(), draws.count, logprobs)?;
        let parts = ensure(&self.stream, &mut self.scratch.borrow_mut().parts, parts_bytes, "shard parts")?;
        let request = Request {
            lm_head: head.view(),
            hidden: hidden.view(),
            batch: batch.view(stream),
            draws,
            shard: Some(shard),
        };
        let mut target = outputs.target_of(batch, hidden.rows(), draws.count)?;
        target.parts = Some(OutputSlice::resident(parts.address(), parts_bytes));
        let kernels = self.kernels().kernels();
        let plan = Plan::new(kernels, &request, &target, self.variant.get())?;
        let workspace = self.workspace(plan.workspace_bytes())?;
        Ok(Planned { kernels, stream: stream.cu_stream(), plan, workspace })
    }

    /// The scratch workspace, grown to at least `bytes`.
    fn workspace(&self, bytes: usize) -> Result<DeviceWorkspace> {
        let at = ensure(&self.stream, &mut self.scratch.borrow_mut().workspace, bytes, "workspace")?;
        Ok(DeviceWorkspace { address: at.address(), bytes })
    }

    /// Queues `batch`'s decode steps `+= by` on the sampler's stream, so the next call draws
    /// fresh noise.
    pub fn advance_steps(&self, batch: &mut DeviceBatch, by: u32) -> Result<()> {
        self.make_current()?;
        self.kernels().advance_steps_on(&self.stream, batch, by)
    }

    /// Queues the verification `batch`'s steps moved past the tokens each sequence emitted in
    /// the call that wrote `outputs` (its verdicts plus one), on the sampler's stream: with
    /// [`DeviceBatch::write_drafts`], a speculative loop verifies each round's drafts with no
    /// host copy. Errors name `outputs` when they hold no verdicts for the batch's sequences.
    pub fn advance_verified(&self, batch: &mut DeviceBatch, outputs: &DeviceOutputs) -> Result<()> {
        self.make_current()?;
        let Some((accepted, _)) = &outputs.verdicts else {
            return Err(invalid("outputs", "hold no verdicts: they were made for a batch that verifies nothing"));
        };
        let (_, _read) = accepted.slice().device_ptr(&self.stream);
        self.kernels().queue_advance_verified(&self.stream, batch, accepted.ptr().address(), accepted.len())
    }

    /// Waits for a call and copies its tokens and log-probabilities (empty if `outputs` has
    /// none) to the host; a row without a token is [`crate::Error::RowsWithoutToken`], which
    /// carries every row's results.
    pub fn read(&self, outputs: &DeviceOutputs) -> Result<Sampled> {
        self.make_current()?;
        self.synchronize("sampling")?;
        let tokens = outputs.tokens.to_host(&self.stream, "tokens")?;
        let draws = outputs.draws as usize;
        let mut sampled = match &outputs.logprobs {
            None => Sampled::tokens_only(tokens, draws),
            Some((values, top)) => {
                let values = values.to_host(&self.stream, "log-probabilities")?;
                let top = top.to_host(&self.stream, "top log-probabilities")?;
                Sampled::from_outputs(draws, tokens, Some(&values), Some(&top))?
            }
        };
        if let Some((accepted, first_rows)) = &outputs.verdicts {
            let accepted = accepted.to_host(&self.stream, "verdicts")?;
            sampled.verdicts =
                first_rows.iter().zip(accepted).map(|(&first_row, accepted)| Verdict { first_row, accepted }).collect();
        }
        sampled_or_row_status(sampled)
    }

    /// Waits for queued work, frees the workspace, unloads the module, and reports every
    /// error the driver kept on the way.
    fn finish(&mut self) -> Result<()> {
        self.closed = true;
        let waited = self.make_current().and_then(|()| self.synchronize("all queued work"));
        *self.scratch.get_mut() = Scratch::default();
        let unloaded = self.kernels.take().map_or(Ok(()), StreamSampler::close);
        let freed = self.synchronize("freeing the workspace and unloading the module");
        waited.and(unloaded).and(freed)
    }

    /// Waits for outstanding work and reports any error it left; the sampler is then gone.
    pub fn close(mut self) -> Result<()> {
        self.finish()
    }
}

impl Sampler for CudaSampler {
    fn device(&self) -> String {
        format!("{} ({} module)", self.device_name(), self.module().name())
    }

    fn upload_lm_head(&self, lm_head: &Matrix) -> Result<LmHead> {
        self.upload_lm_head_shards(std::slice::from_ref(lm_head))
    }

    fn upload_lm_head_shards(&self, shards: &[Matrix]) -> Result<LmHead> {
        let shapes = shards.iter().map(check_lm_head).collect::<Result<Vec<_>>>()?;
        self.make_current()?;
        let resident = shards
            .iter()
            .zip(&shapes)
            .map(|(shard, &shape)| {
                let buffer = Allocation::from_host(&self.stream, shard.elements().as_bytes(), "lm_head")?;
                self.resident_head(buffer, shape)
            })
            .collect::<Result<Vec<_>>>()?;
        LmHead::new(self.owner, &shapes, HeadStorage::Cuda(resident))
    }

    /// Uploads `hidden` and the batch, runs [`CudaSampler::sample_into`] and reads the results
    /// back: the whole vocabulary in one call (or its shards deciding the truncations
    /// together), so a row draws what [`crate::CpuSampler`] draws for it, but for near-ties
    /// that the two sums' rounding orders decide apart.
    fn sample(&self, lm_head: &LmHead, hidden: &Matrix, batch: &Batch, draws: Draws) -> Result<Sampled> {
        self.shards(lm_head)?;
        let draws = draws.check()?;
        check_request_shape(lm_head.shape, hidden.shape(), batch.rows(), "params", draws.count)?;
        let on_device = self.upload_batch(batch, lm_head.shape.vocab)?;
        let hidden = self.upload_hidden(hidden)?;
        let mut outputs = self.outputs(&on_device, draws.count)?;
        self.sample_into(lm_head, &hidden, &on_device, draws, &mut outputs)?;
        self.read(&outputs)
    }

    fn close(self: Box<Self>) -> Result<()> {
        CudaSampler::close(*self)
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
