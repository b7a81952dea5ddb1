//! What tests and benchmarks need of the owned sampler beyond sampling (feature `internals`):
//! poisoned workspaces and outputs, inputs made on the device, copies back, the read-bandwidth
//! and `mma.sync` peak probes, the check of the estimate's bound, the unfused comparison pipeline, and the fused
//! tiles' lists of their first entries.

use flashsample_core::Candidate;
use flashsample_core::abi::{EstimateErrorArgs, MmaPeakArgs, ReadProbeArgs};
use flashsample_core::registry::Kernel;
use flashsample_core::truncation::{TILE_TOP, TileTop};

use super::{CudaHidden, CudaSampler, DeviceOutputs};
use crate::cuda::batch::DeviceBatch;
use crate::cuda::dispatch::Variant;
use crate::cuda::driver;
use crate::cuda::memory::{Allocation, ensure};
use crate::cuda::plan::{FusedCall, PathPlan, TensorMaps, WORKSPACE_MAPS_BYTES, plan_shape};
use crate::cuda::request::DeviceWorkspace;
use crate::error::{Result, invalid};
use crate::params::{Draws, HeadShape};
use crate::sampler::{HeadStorage, LmHead};
use crate::tensor::{DType, Elements, Matrix, MatrixShape};

impl CudaSampler {
    /// The index of the poisoned candidates of [`CudaSampler::poison_workspace`]: no token.
    pub const POISON_INDEX: u32 = 0x7fff_fff0;

    /// Fills the workspace with a candidate that wins every merge (score +∞, word
    /// `u32::MAX`, index [`CudaSampler::POISON_INDEX`], not a token) and the shards' parts with
    /// +∞ words: a tile kernel that leaves a slot unwritten then shows up as that index in the
    /// tokens, and unwritten logits, terms or winners of the materialised path and the shard
    /// merge as non-finite values or indices that are no token. Tests call this before sampling
    /// (after a call of the same shape has grown the buffers).
    pub fn poison_workspace(&self) -> Result<()> {
        self.make_current()?;
        let poison = Candidate { score: f32::INFINITY, word: u32::MAX, index: Self::POISON_INDEX };
        let scratch = self.scratch.borrow();
        if let Some(workspace) = scratch.workspace.as_ref() {
            let host = vec![poison; workspace.len() / size_of::<Candidate>()];
            // SAFETY: the workspace holds `len` bytes (at least this many candidates) and lives
            // on our stream.
            unsafe {
                driver::copy_to_device_async(
                    "poison candidates",
                    workspace.ptr().cast(),
                    &host,
                    self.stream.cu_stream(),
                )?
            };
        }
        if let Some(parts) = scratch.parts.as_ref() {
            // SAFETY: the parts hold `len` bytes on our stream.
            unsafe {
                driver::fill_words_async(
                    "poison shard parts",
                    parts.ptr().cast(),
                    f32::INFINITY.to_bits(),
                    parts.len() / 4,
                    self.stream.cu_stream(),
                )?
            };
        }
        Ok(())
    }

    /// Sets every word of `outputs` (tokens, log-probabilities, top entries) to `word`: tests
    /// poison the outputs to see unwritten slots.
    pub fn fill_outputs(&self, outputs: &mut DeviceOutputs, word: u32) -> Result<()> {
        self.make_current()?;
        let stream = self.stream.cu_stream();
        // SAFETY: each buffer holds `len` words and lives on our stream.
        unsafe {
            driver::fill_words_async("tokens", outputs.tokens.ptr(), word, outputs.tokens.len(), stream)?;
            if let Some((values, top)) = &outputs.logprobs {
                driver::fill_words_async("log-probabilities", values.ptr().cast(), word, values.len(), stream)?;
                driver::fill_words_async("top log-probabilities", top.ptr(), word, top.len(), stream)?;
            }
        }
        Ok(())
    }

    /// An LM head of uniform values in `[-scale, scale)` made on the device (benchmarks, demo).
    pub fn random_lm_head(&self, vocab: usize, dim: usize, dtype: DType, seed: u64, scale: f32) -> Result<LmHead> {
        crate::params::check_head_shape(vocab, dim)?;
        let shape = HeadShape { vocab, dim, dtype };
        let buffer = self.random_buffer(vocab * dim, dtype, seed, scale)?;
        LmHead::new(self.owner, &[shape], HeadStorage::Cuda(vec![self.resident_head(buffer, shape)?]))
    }

    /// Hidden states of uniform values made on the device.
    pub fn random_hidden(&self, rows: usize, cols: usize, dtype: DType, seed: u64, scale: f32) -> Result<CudaHidden> {
        let buffer = self.random_buffer(rows * cols, dtype, seed, scale)?;
        self.resident_hidden(buffer, MatrixShape { rows, cols, dtype })
    }

    fn random_buffer(&self, count: usize, dtype: DType, seed: u64, scale: f32) -> Result<Allocation<u8>> {
        self.make_current()?;
        // SAFETY: the fill kernel writes every element before anything reads it.
        let buffer = unsafe { Allocation::<u8>::uninitialized(&self.stream, count * dtype.bytes(), "random")? };
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

    /// Copies a device LM head of one shard back (the demo checks the GPU against the CPU on
    /// it).
    pub fn lm_head_to_host(&self, lm_head: &LmHead) -> Result<Matrix> {
        let [head] = self.shards(lm_head)? else {
            return Err(invalid("lm_head", "kept in several shards: copy them one by one"));
        };
        self.make_current()?;
        let bytes = head.buffer.to_host(&self.stream, "lm_head")?;
        Matrix::new("lm_head", head.shape.vocab, head.shape.dim, elements_from_bytes(&bytes, head.shape.dtype))
    }

    /// The device address of `W[0, 0]` of a head kept in one shard (a reference GEMM reads it).
    pub fn lm_head_address(&self, lm_head: &LmHead) -> Result<u64> {
        match self.shards(lm_head)? {
            [head] => Ok(head.buffer.ptr().address()),
            _ => Err(invalid("lm_head", "kept in several shards: it has no one address")),
        }
    }

    /// Copies device hidden states back.
    pub fn hidden_to_host(&self, hidden: &CudaHidden) -> Result<Matrix> {
        self.make_current()?;
        let bytes = hidden.buffer.to_host(&self.stream, "hidden")?;
        Matrix::new("hidden", hidden.shape.rows, hidden.shape.cols, elements_from_bytes(&bytes, hidden.shape.dtype))
    }

    /// Queues one pass of 16-byte loads over the LM head's bytes (its first shard): the
    /// read-bandwidth floor.
    pub fn read_probe(&self, lm_head: &LmHead) -> Result<()> {
        let head = &self.shards(lm_head)?[0];
        self.make_current()?;
        let sink = ensure(&self.stream, &mut self.scratch.borrow_mut().probe_sink, 1, "probe sink")?;
        let bytes = (head.buffer.len() / 64 * 64) as u64;
        let args = ReadProbeArgs { source: head.buffer.ptr().cast(), bytes, sink };
        // SAFETY: `bytes` is within the buffer; the sink holds one u32.
        unsafe {
            driver::in_context(self.kernels().context().cast(), || {
                self.kernels().kernels().launch(self.stream.cu_stream(), Kernel::ReadProbe, u64::MAX, &args)
            })
        }
    }

    /// Queues the `mma.sync` peak probe over a full grid of resident blocks: its
    /// [`flashsample_core::abi::MMA_PEAK_FLOPS`] operations over its time give the tensor
    /// cores' `mma.sync` rate, beside which the tiles' rates are read.
    pub fn mma_peak(&self) -> Result<()> {
        self.make_current()?;
        let sink = ensure(&self.stream, &mut self.scratch.borrow_mut().probe_sink, 1, "probe sink")?;
        let args = MmaPeakArgs { sink };
        // SAFETY: the sink holds one u32; the kernel reads nothing else.
        unsafe {
            driver::in_context(self.kernels().context().cast(), || {
                self.kernels().kernels().launch(self.stream.cu_stream(), Kernel::MmaPeak, u64::MAX, &args)
            })
        }
    }

    /// The largest `|gumbel_estimate(x) − gumbel(x)|` over all 2³² words `x`, computed on this
    /// device with its `lg2.approx`: what the fused kernels' filter assumes is at most
    /// [`flashsample_core::estimate::GUMBEL_ESTIMATE_ERROR`].
    pub fn gumbel_estimate_max_error(&self) -> Result<f32> {
        self.make_current()?;
        let out = Allocation::from_host(&self.stream, &[0u32], "estimate error")?;
        let args = EstimateErrorArgs { out: out.ptr() };
        // SAFETY: `out` is one zeroed u32.
        unsafe {
            driver::in_context(self.kernels().context().cast(), || {
                self.kernels().kernels().launch(self.stream.cu_stream(), Kernel::GumbelEstimateError, u64::MAX, &args)
            })?
        };
        self.synchronize("gumbel_estimate_error")?;
        Ok(f32::from_bits(out.to_host(&self.stream, "estimate error")?[0]))
    }

    /// The unfused pipeline on the same inputs, plain rows only: a GEMM (the tile of
    /// `variant`, an mma or TMA one) writes f32 logits `[B, V]`, a sampler reads them back. The
    /// logits are bit-identical to the fused kernel's of the same variant, so are the tokens.
    pub fn sample_unfused_into(
        &self,
        lm_head: &LmHead,
        hidden: &CudaHidden,
        batch: &DeviceBatch,
        draws: Draws,
        variant: Variant,
        outputs: &mut DeviceOutputs,
    ) -> Result<()> {
        let [head] = self.shards(lm_head)? else {
            return Err(invalid("lm_head", "kept in several shards: the unfused pipeline takes one"));
        };
        if batch.rows() != hidden.rows() || (outputs.rows, outputs.draws) != (hidden.rows(), draws.count) {
            return Err(invalid("outputs", "the batch, the hidden states and the outputs must have the same rows"));
        }
        self.make_current()?;
        let call = FusedCall {
            lm_head: head.matrix(),
            hidden: hidden.matrix(),
            row_params: batch.row_params().address(),
            tokens: outputs.tokens.ptr().address(),
            draws,
            variant,
            processing: None,
            shard: None,
        };
        let kernels = self.kernels().kernels();
        let plan = kernels.plan_unfused(&call)?;
        let maps = match (plan.variant.tma_boxes(), &head.maps, &hidden.maps) {
            (Some(_), Some(w), Some(h)) => TensorMaps::Resident {
                lm_head: crate::cuda::memory::ResidentMaps::LmHead(w.ptr()),
                hidden: crate::cuda::memory::ResidentMaps::Hidden(h.ptr()),
            },
            _ => TensorMaps::Store,
        };
        let workspace: DeviceWorkspace = self.workspace(plan.workspace_bytes)?;
        // SAFETY: every address comes from a live buffer of this sampler sized for the call.
        unsafe {
            driver::in_context(self.kernels().context().cast(), || {
                kernels.enqueue_unfused(self.stream.cu_stream(), &call, &plan, maps, workspace)
            })
        }
    }

    /// The tile lists ([`TileTop`]) the fused `mma.sync`, SIMT or handoff tile of `variant`
    /// writes for each row of `hidden` with `batch`'s per-entry processing, `[B, tiles]` in
    /// tiles of [`flashsample_core::abi::TILE_ROWS`] entries: what the listed path decides
    /// from. Every list is poisoned first (NaN logits at [`CudaSampler::POISON_INDEX`]), so
    /// one a tile leaves unwritten shows. The cooperative TMA tiles do not write them (an
    /// error naming `variant`).
    pub fn tile_tops(
        &self,
        lm_head: &LmHead,
        hidden: &CudaHidden,
        batch: &DeviceBatch,
        variant: Variant,
    ) -> Result<Vec<TileTop>> {
        let [head] = self.shards(lm_head)? else {
            return Err(invalid("lm_head", "kept in several shards: the tile lists are of one head"));
        };
        if batch.rows() != hidden.rows() {
            return Err(invalid("batch", "the batch and the hidden states must have the same rows"));
        }
        self.make_current()?;
        let per_entry = batch.summary().per_entry_blocks();
        let call = FusedCall {
            lm_head: head.matrix(),
            hidden: hidden.matrix(),
            row_params: batch.row_params().address(),
            tokens: 0,
            draws: Draws::first(1),
            variant,
            processing: (per_entry.address() != 0).then_some(per_entry.address()),
            shard: None,
        };
        let kernels = self.kernels().kernels();
        let plan = plan_shape(kernels, &call.lm_head, &call.hidden, 1, variant)?;
        let call = FusedCall { variant: plan.variant, ..call };
        let poison = TileTop { logits: [f32::NAN; TILE_TOP], indices: [Self::POISON_INDEX; TILE_TOP] };
        let tops = Allocation::from_host(&self.stream, &vec![poison; hidden.rows() * plan.tiles], "tile lists")?;
        let workspace = self.workspace(WORKSPACE_MAPS_BYTES)?;
        // SAFETY: every address comes from a live buffer of this sampler sized for the call: the
        // lists hold `B · tiles` entries, the workspace the maps written there first.
        unsafe {
            driver::in_context(self.kernels().context().cast(), || {
                let stream = self.stream.cu_stream();
                let maps = kernels.tensor_maps(
                    stream,
                    call.variant,
                    &call.lm_head,
                    &call.hidden,
                    TensorMaps::Store,
                    workspace,
                )?;
                kernels.queue_tile_lists(stream, &call, plan.tiles, tops.ptr(), maps)
            })?
        };
        self.synchronize("tile lists")?;
        tops.to_host(&self.stream, "tile lists")
    }

    /// [`CudaSampler::sample_into`], returning for a call on the listed path (lists or chains)
    /// how many rows its tiles' summaries did not settle (the rows the fallback behind it
    /// sampled from their logits), and `None` for a call on another path.
    pub fn sample_listed_into(
        &self,
        lm_head: &LmHead,
        hidden: &CudaHidden,
        batch: &DeviceBatch,
        draws: Draws,
        outputs: &mut DeviceOutputs,
    ) -> Result<Option<u32>> {
        let [head] = self.shards(lm_head)? else {
            return Err(invalid("lm_head", "kept in several shards: the listed path takes one shard"));
        };
        let draws = draws.check()?;
        outputs.target_of(batch, hidden.rows(), draws.count)?;
        self.make_current()?;
        let plan = self.sample_head_into(head, hidden, batch, draws, outputs)?;
        let PathPlan::Listed(listed) = &plan.path else { return Ok(None) };
        let at = plan.stage_offset() + listed.unsettled_at;
        let scratch = self.scratch.borrow();
        let workspace = scratch.workspace.as_ref().ok_or_else(|| invalid("workspace", "none after a call"))?;
        let mut count = [0u8; 4];
        let copied = self.stream.memcpy_dtoh(&workspace.slice().slice(at..at + 4), &mut count);
        driver::check("cuMemcpyDtoHAsync (unsettled rows)", copied)?;
        self.synchronize("listed call")?;
        Ok(Some(u32::from_le_bytes(count)))
    }
}

fn elements_from_bytes(bytes: &[u8], dtype: DType) -> Elements {
    match dtype {
        DType::F32 => Elements::F32(bytemuck::pod_collect_to_vec(bytes)),
        DType::F16 => Elements::F16(bytemuck::pod_collect_to_vec(bytes)),
        DType::BF16 => Elements::BF16(bytemuck::pod_collect_to_vec(bytes)),
    }
}
