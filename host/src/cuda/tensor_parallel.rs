//! Tensor-parallel sampling across the GPUs of one process (feature `nccl`): each GPU holds a
//! vocabulary shard of the LM head, runs stage 1 of the shard path on it, and NCCL's
//! all-gather hands every GPU the others' parts (per row and draw a winner with its token's
//! logits, per row the log-sum-exp terms and top raw entries: a few hundred bytes per row, no
//! logits); every GPU then runs the shard merge and holds the tokens.
//!
//! Two ways in: [`TensorParallelSampler`] drives every GPU from one process (one thread), with
//! its own buffers and streams; [`TensorParallelRank`] is one rank as engines run them, one
//! process (or thread) per GPU, in borrowed mode on the engine's stream and memory, with a
//! communicator joined from a shared [`NcclId`] or the engine's own. Both queue the same
//! three steps: stage 1 into the rank's part of a gather buffer, NCCL's in-place all-gather
//! (one function for both), the shard merge. Rows with min-p, top-k or top-p run stage 1 in
//! segments, between which NCCL's all-reduces hand every rank each row's largest logit and
//! its histograms over the whole vocabulary, so that every rank decides the truncations as
//! the unsharded row does (`StreamSampler::sample_processed_segment`).
//!
//! NCCL is opened at run time (cudarc's loader, by the names `cudarc::get_lib_name_candidates`
//! gives: `libnccl.so` and the like); a machine without it gets [`Error::Nccl`], never a
//! panic. A collective that does not finish within the sampler's timeout aborts the
//! communicators and reports the rank that did not finish.

use std::ffi::c_void;
use std::time::{Duration, Instant};

use cudarc::driver::sys;
use cudarc::nccl::result as nccl;
use cudarc::nccl::sys as nccl_sys;

use super::buffers::{CudaHidden, CudaLmHead, DeviceRows};
use super::driver;
use super::sampler::{CudaSampler, DeviceProcessing, ProcessedOutputs, ShardHead, ShardParts, ShardsStage, VocabShard};
use super::stream::{
    DeviceMatrix, DeviceWorkspace, ProcessedRequest, ProcessedTarget, ProcessingRef, ShardMergeRequest, ShardReduction,
    StreamSampler, TensorMaps,
};
use crate::Variant;
use crate::cpu::Sampled;
use crate::error::{Error, Result, invalid};
use crate::params::{Draws, HeadShape, SamplingParams, check_processing_rows, check_request};
use crate::process::Processing;
use crate::tensor::Matrix;
use flashsample_core::abi::{DevicePtr, ShardPartLayout};

/// How long a call waits for its collective and merge before it aborts the communicators.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// A sampler over `N` GPUs of this process, each holding one vocabulary shard of the LM head
/// (shard bounds: [`VocabShard::bounds`]).
pub struct TensorParallelSampler {
    ranks: Vec<Rank>,
    vocab: usize,
    timeout: Duration,
    /// Set once a collective failed or timed out: the communicators are aborted.
    aborted: bool,
}

/// One GPU's sampler, shard and communicator.
struct Rank {
    sampler: CudaSampler,
    head: CudaLmHead,
    shard: VocabShard,
    comm: nccl_sys::ncclComm_t,
}

/// Whether NCCL can be opened by the names cudarc's loader tries.
pub fn nccl_library_present() -> bool {
    cudarc::get_lib_name_candidates("nccl").iter().any(|name| {
        // SAFETY: opening the library runs its initialisers, which have no preconditions; the
        // handle is closed again at once.
        unsafe { libloading::Library::new(name) }.is_ok()
    })
}

/// `Error::Nccl` for a failed call of `rank`, with NCCL's text for the result.
fn nccl_error(rank: Option<usize>, call: &str, error: nccl::NcclError) -> Error {
    // SAFETY: ncclGetErrorString returns a static string for every result value.
    let text = unsafe { std::ffi::CStr::from_ptr(nccl_sys::ncclGetErrorString(error.0)) };
    Error::Nccl { rank, call: call.to_string(), detail: format!("{:?} ({})", error.0, text.to_string_lossy()) }
}

impl TensorParallelSampler {
    /// A sampler over the GPUs `devices` (rank `r` on `devices[r]`, each listed once): splits
    /// `lm_head` into `devices.len()` shards of whole Philox blocks and uploads shard `r` to
    /// rank `r`, then makes one NCCL communicator per GPU.
    pub fn new(devices: &[usize], lm_head: &Matrix) -> Result<TensorParallelSampler> {
        TensorParallelSampler::with_heads(devices, lm_head.rows(), |sampler, rows| {
            sampler.upload_lm_head(&lm_head.row_range(rows.start, rows.end))
        })
    }

    /// As [`TensorParallelSampler::new`] with an LM head of `vocab × dim` uniform values in
    /// `[-scale, scale)` made on each GPU (each shard drawn under its own seed: benchmarks).
    pub fn with_random_head(
        devices: &[usize],
        vocab: usize,
        dim: usize,
        dtype: crate::DType,
        seed: u64,
        scale: f32,
    ) -> Result<TensorParallelSampler> {
        TensorParallelSampler::with_heads(devices, vocab, |sampler, rows| {
            sampler.random_lm_head(rows.len(), dim, dtype, seed ^ rows.start as u64, scale)
        })
    }

    /// The ranks on `devices`, rank `r`'s shard of a vocabulary of `vocab` made by
    /// `head(sampler, rows)` on its sampler, then the communicators.
    fn with_heads(
        devices: &[usize],
        vocab: usize,
        head: impl Fn(&CudaSampler, std::ops::Range<usize>) -> Result<CudaLmHead>,
    ) -> Result<TensorParallelSampler> {
        if devices.is_empty() {
            return Err(invalid("devices", "none: at least one GPU is needed"));
        }
        for (r, d) in devices.iter().enumerate() {
            if devices[..r].contains(d) {
                return Err(invalid(format!("devices[{r}]"), format!("GPU {d} is listed twice: one rank per GPU")));
            }
        }
        let bounds = VocabShard::bounds(vocab, devices.len())?;
        check_nccl_library()?;
        let mut ranks = Vec::with_capacity(devices.len());
        for (r, &device) in devices.iter().enumerate() {
            let sampler = CudaSampler::on_device(device)?;
            let head = head(&sampler, bounds[r]..bounds[r + 1])?;
            let shard = VocabShard { vocab_offset: bounds[r], vocab };
            ranks.push(Rank { sampler, head, shard, comm: std::ptr::null_mut() });
        }
        let ordinals: Vec<i32> = devices.iter().map(|&d| d as i32).collect();
        let mut comms = vec![std::ptr::null_mut(); devices.len()];
        // SAFETY: `comms` has room for one communicator per listed device.
        unsafe { nccl::comm_init_all(comms.as_mut_ptr(), ordinals.len() as i32, ordinals.as_ptr()) }
            .map_err(|e| nccl_error(None, "ncclCommInitAll", e))?;
        for (rank, comm) in ranks.iter_mut().zip(comms) {
            rank.comm = comm;
        }
        Ok(TensorParallelSampler { ranks, vocab, timeout: DEFAULT_TIMEOUT, aborted: false })
    }

    pub fn ranks(&self) -> usize {
        self.ranks.len()
    }

    /// Rank `r`'s vocabulary shard.
    pub fn shard(&self, r: usize) -> VocabShard {
        self.ranks[r].shard
    }

    /// How long a call waits for the collective and the merge (default [`DEFAULT_TIMEOUT`]).
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    /// Rank `r`'s sampler: its device, its stream (every call queues there) and the uploads a
    /// step's inputs need ([`CudaSampler::upload_hidden`], `upload_rows`, `upload_processing`,
    /// `shard_parts`, `processed_outputs`).
    pub fn sampler(&self, r: usize) -> &CudaSampler {
        &self.ranks[r].sampler
    }

    /// The draws `draws` of each row of `hidden` (replicated to every GPU) with the row's
    /// processing and log-probabilities: stage 1 on every GPU over its shard (with the
    /// all-reduces of the truncations), the all-gather of the parts, and the shard merge on
    /// every GPU. Returns each rank's result (all the same: every rank merges the same parts in
    /// the same order).
    pub fn sample(
        &mut self,
        hidden: &Matrix,
        params: &[SamplingParams],
        processing: &[Processing],
        draws: Draws,
    ) -> Result<Vec<Sampled>> {
        let draws = draws.check()?;
        let shape = self.ranks[0].head.shape();
        check_request(HeadShape { vocab: self.vocab, ..shape }, hidden.shape(), params, draws.count)?;
        check_processing_rows(processing.len(), params.len())?;
        let (batch, count, world) = (params.len(), draws.count as usize, self.ranks.len());
        let mut staged = Vec::with_capacity(world);
        for rank in &self.ranks {
            let sampler = &rank.sampler;
            let inputs = (
                sampler.upload_hidden(hidden)?,
                sampler.upload_rows(params)?,
                sampler.upload_processing(processing, self.vocab)?,
            );
            let buffers =
                (sampler.shard_parts(world, batch, count, true)?, sampler.processed_outputs(batch, count, true)?);
            staged.push((inputs, buffers));
        }
        let mut steps: Vec<RankInputs> = staged
            .iter_mut()
            .map(|((hidden, rows, processing), (parts, out))| RankInputs { hidden, rows, processing, parts, out })
            .collect();
        self.sample_into(&mut steps, draws)?;
        self.wait()?;
        self.ranks.iter().zip(&staged).map(|(rank, (_, (_, out)))| rank.sampler.processed_to_host(out)).collect()
    }

    /// Queues one step with inputs and outputs already on the GPUs (`inputs[r]` on rank `r`'s
    /// device, made by [`TensorParallelSampler::sampler`]`(r)`; `parts` with room for every
    /// rank's part of `[B, draws.count]` draws): [`TensorParallelSampler::stage_one_into`],
    /// [`TensorParallelSampler::all_gather`], [`TensorParallelSampler::merge_into`]. Nothing is
    /// copied from the host and nothing waits; [`TensorParallelSampler::wait`] waits with the
    /// timeout.
    pub fn sample_into(&mut self, inputs: &mut [RankInputs], draws: Draws) -> Result<()> {
        self.stage_one_into(inputs, draws)?;
        self.all_gather(inputs)?;
        self.merge_into(inputs)
    }

    /// Stage 1 on every rank: its shard's winners and terms into its own part of
    /// `inputs[r].parts`; with truncations, segment by segment, each ended by NCCL's in-place
    /// all-reduce of every rank's exchange buffer, in one group.
    pub fn stage_one_into(&mut self, inputs: &mut [RankInputs], draws: Draws) -> Result<()> {
        self.check_inputs(inputs)?;
        let heads: Vec<[ShardHead; 1]> = self
            .ranks
            .iter()
            .enumerate()
            .map(|(r, rank)| [ShardHead { head: &rank.head, shard: rank.shard, part: r }])
            .collect();
        let mut planned = Vec::with_capacity(self.ranks.len());
        for ((rank, heads), step) in self.ranks.iter().zip(&heads).zip(inputs.iter()) {
            let stage = ShardsStage {
                heads,
                hidden: step.hidden,
                rows: step.rows,
                processing: step.processing,
                draws,
                variant: Variant::Auto,
                parts: step.parts,
            };
            planned.push(rank.sampler.plan_shards(&stage)?);
        }
        let segments = planned[0].segments;
        if planned.iter().any(|p| p.segments != segments) {
            return Err(invalid(
                "inputs",
                "the ranks' stage 1 runs in different segments: give every rank the same processing",
            ));
        }
        for segment in 0..segments {
            let mut reductions = Vec::with_capacity(planned.len());
            for (rank, planned) in self.ranks.iter().zip(&planned) {
                reductions.push(rank.sampler.queue_shards_segment(planned, segment)?);
            }
            // Every rank ends a segment alike (same segments, same schedule): the last with none.
            let reductions: Vec<ShardReduction> = reductions.into_iter().flatten().collect();
            if reductions.is_empty() {
                break;
            }
            if reductions.len() != self.ranks.len() {
                return Err(invalid(
                    "inputs",
                    "the ranks' stage-1 segments end differently: give every rank the same processing",
                ));
            }
            nccl::group_start().map_err(|e| nccl_error(None, "ncclGroupStart", e))?;
            for (r, (rank, reduction)) in self.ranks.iter().zip(reductions).enumerate() {
                let stream = rank.sampler.stream().cu_stream();
                // SAFETY: the reduction's words lie in the rank's exchange buffer on its device,
                // used on this rank's stream.
                let queued = unsafe { queue_all_reduce(rank.comm, stream.cast(), reduction, r) };
                if let Err(e) = queued {
                    // Leave the group before reporting, so that NCCL's state stays consistent.
                    let _ = nccl::group_end();
                    return Err(e);
                }
            }
            nccl::group_end().map_err(|e| nccl_error(None, "ncclGroupEnd", e))?;
        }
        Ok(())
    }

    /// NCCL's in-place all-gather of every rank's part into every rank's `parts`, in one
    /// group, on each rank's stream (after its stage 1).
    pub fn all_gather(&mut self, inputs: &[RankInputs]) -> Result<()> {
        self.check_inputs(inputs)?;
        nccl::group_start().map_err(|e| nccl_error(None, "ncclGroupStart", e))?;
        for (r, (rank, step)) in self.ranks.iter().zip(inputs).enumerate() {
            let stream = rank.sampler.stream().cu_stream();
            let (parts, bytes) = (step.parts.address(), step.parts.part_bytes());
            // SAFETY: the parts buffer holds `ranks` parts of `bytes` on this rank's device
            // (checked), used on this rank's stream.
            let queued = unsafe { queue_all_gather(rank.comm, stream.cast(), parts, bytes, r) };
            if let Err(e) = queued {
                // Leave the group before reporting, so that NCCL's state stays consistent.
                let _ = nccl::group_end();
                return Err(e);
            }
        }
        nccl::group_end().map(|_| ()).map_err(|e| nccl_error(None, "ncclGroupEnd", e))
    }

    /// The shard merge on every rank into its `out`.
    pub fn merge_into(&mut self, inputs: &mut [RankInputs]) -> Result<()> {
        self.check_inputs(inputs)?;
        for (rank, step) in self.ranks.iter().zip(inputs.iter_mut()) {
            let RankInputs { rows, processing, parts, out, .. } = step;
            rank.sampler.merge_shards_into(parts, rows, processing, out)?;
        }
        Ok(())
    }

    /// The rules of a step's inputs: one per rank, each with room for every rank's part, and
    /// communicators not aborted.
    fn check_inputs(&self, inputs: &[RankInputs]) -> Result<()> {
        if self.aborted {
            return Err(Error::Nccl {
                rank: None,
                call: "sample".into(),
                detail: "the communicators were aborted after an earlier failure; make a new sampler".into(),
            });
        }
        let world = self.ranks.len();
        if inputs.len() != world {
            return Err(invalid("inputs", format!("{} entries for {world} ranks: one per rank", inputs.len())));
        }
        if let Some(r) = inputs.iter().position(|step| step.parts.shards() != world) {
            return Err(invalid(
                format!("inputs[{r}].parts"),
                format!("room for {} parts; {world} ranks send one each", inputs[r].parts.shards()),
            ));
        }
        Ok(())
    }

    /// Waits until every rank's stream has run its work, polling NCCL for asynchronous errors;
    /// past the timeout, aborts the communicators and names the first rank not done.
    pub fn wait(&mut self) -> Result<()> {
        let start = Instant::now();
        let mut pending: Vec<usize> = (0..self.ranks.len()).collect();
        while !pending.is_empty() {
            let mut still = Vec::new();
            for &r in &pending {
                let rank = &self.ranks[r];
                let mut async_error = nccl_sys::ncclResult_t::ncclSuccess;
                // SAFETY: a live communicator and a place for its state.
                let polled = unsafe { nccl_sys::ncclCommGetAsyncError(rank.comm, &mut async_error) }.result();
                if let Err(e) = polled.and(async_error.result()) {
                    self.abort();
                    return Err(nccl_error(Some(r), "the all-gather", e));
                }
                // SAFETY: the rank's live stream; the query only reads its state.
                match unsafe { sys::cuStreamQuery(rank.sampler.stream().cu_stream()) } {
                    sys::CUresult::CUDA_SUCCESS => {}
                    sys::CUresult::CUDA_ERROR_NOT_READY => still.push(r),
                    error => {
                        self.abort();
                        return Err(Error::Cuda {
                            call: format!("cuStreamQuery (rank {r})"),
                            detail: format!("{error:?}"),
                        });
                    }
                }
            }
            pending = still;
            if !pending.is_empty() {
                if start.elapsed() > self.timeout {
                    let r = pending[0];
                    self.abort();
                    return Err(Error::Nccl {
                        rank: Some(r),
                        call: "the all-gather and merge".into(),
                        detail: format!("not finished within {:?}; the communicators are aborted", self.timeout),
                    });
                }
                std::thread::sleep(Duration::from_micros(50));
            }
        }
        Ok(())
    }

    /// Aborts every communicator (what NCCL offers to end a hung collective).
    fn abort(&mut self) {
        for rank in &mut self.ranks {
            if !rank.comm.is_null() {
                // SAFETY: a live communicator, not used again (it is nulled).
                let _ = unsafe { nccl::comm_abort(rank.comm) };
                rank.comm = std::ptr::null_mut();
            }
        }
        self.aborted = true;
    }

    /// Destroys the communicators and closes every rank's sampler, reporting the first error.
    pub fn close(mut self) -> Result<()> {
        self.destroy_comms()?;
        let ranks = std::mem::take(&mut self.ranks);
        let mut first = Ok(());
        for rank in ranks {
            drop(rank.head);
            let closed = rank.sampler.close();
            if first.is_ok() {
                first = closed;
            }
        }
        first
    }

    fn destroy_comms(&mut self) -> Result<()> {
        let mut first = Ok(());
        for (r, rank) in self.ranks.iter_mut().enumerate() {
            if !rank.comm.is_null() {
                // SAFETY: a live communicator whose work has finished (every call waits), not
                // used again (it is nulled).
                let destroyed = unsafe { nccl::comm_destroy(rank.comm) };
                rank.comm = std::ptr::null_mut();
                if let Err(e) = destroyed
                    && first.is_ok()
                {
                    first = Err(nccl_error(Some(r), "ncclCommDestroy", e));
                }
            }
        }
        first
    }
}

/// One rank's inputs and outputs of [`TensorParallelSampler::sample_into`], on its GPU.
pub struct RankInputs<'a> {
    pub hidden: &'a CudaHidden,
    pub rows: &'a DeviceRows,
    pub processing: &'a DeviceProcessing,
    /// Room for every rank's part (`shard_parts(ranks, B, N, logprobs)`).
    pub parts: &'a mut ShardParts,
    pub out: &'a mut ProcessedOutputs,
}

/// Queues NCCL's in-place all-gather of `ranks` parts of `part_bytes` at `parts`, rank `rank`
/// sending its own, on `stream`.
///
/// # Safety
/// `comm` is a live communicator of the stream's device; `parts` holds `ranks · part_bytes`
/// bytes of that device, used on `stream` until the gather has run.
unsafe fn queue_all_gather(
    comm: nccl_sys::ncclComm_t,
    stream: *mut c_void,
    parts: u64,
    part_bytes: usize,
    rank: usize,
) -> Result<()> {
    let own = parts + (rank * part_bytes) as u64;
    // SAFETY: per this function's contract; the send buffer is this rank's part inside the
    // receive buffer (NCCL's in-place all-gather).
    unsafe {
        nccl::all_gather(
            own as *const _,
            parts as *mut _,
            part_bytes,
            nccl_sys::ncclDataType_t::ncclUint8,
            comm,
            stream as nccl_sys::cudaStream_t,
        )
    }
    .map(|_| ())
    .map_err(|e| nccl_error(Some(rank), "ncclAllGather", e))
}

/// Queues NCCL's in-place all-reduce of `reduction`'s words, rank `rank`'s, on `stream`.
///
/// # Safety
/// `comm` is a live communicator of the stream's device; the words lie in that device's
/// memory, used on `stream` until the all-reduce has run.
unsafe fn queue_all_reduce(
    comm: nccl_sys::ncclComm_t,
    stream: *mut c_void,
    reduction: ShardReduction,
    rank: usize,
) -> Result<()> {
    let (address, count, datatype, op) = match reduction {
        ShardReduction::MaxU32 { address, count } => {
            (address, count, nccl_sys::ncclDataType_t::ncclUint32, nccl_sys::ncclRedOp_t::ncclMax)
        }
        ShardReduction::SumU64 { address, count } => {
            (address, count, nccl_sys::ncclDataType_t::ncclUint64, nccl_sys::ncclRedOp_t::ncclSum)
        }
    };
    // SAFETY: per this function's contract; in place (send and receive buffers the same).
    unsafe {
        nccl::all_reduce(
            address as *const _,
            address as *mut _,
            count,
            datatype,
            op,
            comm,
            stream as nccl_sys::cudaStream_t,
        )
    }
    .map(|_| ())
    .map_err(|e| nccl_error(Some(rank), "ncclAllReduce", e))
}

/// NCCL's unique id of a communicator: one rank makes it ([`NcclId::new`]) and the engine
/// hands its bytes to every other rank ([`NcclId::from_bytes`]), as it hands its own.
#[derive(Clone, Copy)]
pub struct NcclId(nccl_sys::ncclUniqueId);

impl NcclId {
    /// A fresh id (`ncclGetUniqueId`); [`Error::Nccl`] without the library.
    pub fn new() -> Result<NcclId> {
        check_nccl_library()?;
        nccl::get_uniqueid().map(NcclId).map_err(|e| nccl_error(None, "ncclGetUniqueId", e))
    }

    pub fn to_bytes(&self) -> [u8; 128] {
        self.0.internal.map(|c| c as u8)
    }

    pub fn from_bytes(bytes: [u8; 128]) -> NcclId {
        NcclId(nccl_sys::ncclUniqueId { internal: bytes.map(|b| b as _) })
    }
}

/// One rank of tensor-parallel sampling as engines run them: one process (or thread) per GPU,
/// the engine's context, stream and device memory (borrowed mode), and one NCCL communicator.
/// [`TensorParallelRank::sample`] queues stage 1 of the rank's vocabulary shard into its part
/// of a gather buffer, the in-place all-gather and the shard merge on the caller's stream;
/// every rank ends with the same tokens and log-probabilities.
pub struct TensorParallelRank {
    comm: nccl_sys::ncclComm_t,
    rank: usize,
    ranks: usize,
    /// Whether the communicator was made here (and is destroyed here).
    owned: bool,
}

// SAFETY: a communicator may be used from any thread, one call at a time (`&self` calls only
// queue work on the caller's stream).
unsafe impl Send for TensorParallelRank {}

/// One step of a [`TensorParallelRank`]: the rank's shard, the replicated inputs, the gather
/// buffer and the outputs, all device memory of the rank's context.
#[derive(Clone, Copy, Debug)]
pub struct RankStep {
    /// This rank's shard of `W`: its rows are the tokens `vocab_offset ..` (a multiple of 4).
    pub lm_head: DeviceMatrix,
    pub vocab_offset: usize,
    /// The whole vocabulary.
    pub vocab: usize,
    pub hidden: DeviceMatrix,
    pub row_params: u64,
    pub draws: Draws,
    pub variant: Variant,
    pub processing: ProcessingRef,
    /// `ranks` parts side by side ([`TensorParallelRank::parts_bytes`], 16-byte aligned).
    pub parts: u64,
    /// Whether the parts carry log-sum-exp terms and top entries (log-probabilities).
    pub logprobs: bool,
    /// The merge's outputs, as [`ShardMergeRequest`]'s.
    pub tokens: u64,
    pub out_logprobs: u64,
    pub out_top_logprobs: u64,
}

impl TensorParallelRank {
    /// Joins the communicator of `ranks` ranks named by `id` as rank `rank`, on the GPU of
    /// `kernels`' context; returns once every rank has joined (`ncclCommInitRank`).
    pub fn join(kernels: &StreamSampler, id: &NcclId, rank: usize, ranks: usize) -> Result<TensorParallelRank> {
        if rank >= ranks || ranks > i32::MAX as usize {
            return Err(invalid("rank", format!("{rank} of {ranks} ranks: must be below the count")));
        }
        check_nccl_library()?;
        let mut comm = std::ptr::null_mut();
        // SAFETY: the sampler's context is live; NCCL takes the device current in it.
        unsafe {
            driver::in_context(kernels.context().cast(), || {
                nccl::comm_init_rank(&mut comm, ranks as i32, id.0, rank as i32)
                    .map_err(|e| nccl_error(Some(rank), "ncclCommInitRank", e))
            })?
        };
        Ok(TensorParallelRank { comm, rank, ranks, owned: true })
    }

    /// A rank on the engine's own communicator (an `ncclComm_t`), which stays the engine's:
    /// [`TensorParallelRank::close`] leaves it alive.
    ///
    /// # Safety
    /// `comm` is a live communicator that outlives this rank.
    pub unsafe fn with_comm(comm: *mut c_void) -> Result<TensorParallelRank> {
        check_nccl_library()?;
        let comm: nccl_sys::ncclComm_t = comm.cast();
        // SAFETY: a live communicator (this function's contract).
        let (rank, ranks) = unsafe { (nccl::comm_user_rank(comm), nccl::comm_count(comm)) };
        let rank = rank.map_err(|e| nccl_error(None, "ncclCommUserRank", e))? as usize;
        let ranks = ranks.map_err(|e| nccl_error(None, "ncclCommCount", e))? as usize;
        Ok(TensorParallelRank { comm, rank, ranks, owned: false })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn ranks(&self) -> usize {
        self.ranks
    }

    /// Bytes of the gather buffer of `[rows, samples]` draws.
    pub fn parts_bytes(&self, rows: usize, samples: u32, logprobs: bool) -> Result<usize> {
        let rows = u32::try_from(rows).map_err(|_| invalid("rows", format!("{rows}: must be < 2^32")))?;
        Ok(self.ranks * ShardPartLayout::of(rows, samples, logprobs).bytes as usize)
    }

    /// Workspace bytes `step` needs (its stage 1: the materialised logits when a row needs its
    /// whole row, `B · V/N` floats or twice that, else the fused tiles' candidates and terms;
    /// with truncations the exchange with the other ranks first).
    pub fn workspace_bytes(&self, kernels: &StreamSampler, step: &RankStep) -> Result<usize> {
        let part_bytes = self.parts_bytes(step.hidden.rows, step.draws.count, step.logprobs)? / self.ranks;
        let exchange = exchange_bytes(&step.processing);
        // The stage-1 request with its exchange where `sample` puts it (the plan needs only
        // whether there is one).
        let request = self.stage_one(step, part_bytes, exchange.map_or(0, |_| EXCHANGE_PLACEHOLDER));
        Ok(exchange.unwrap_or(0) + kernels.processed_workspace_bytes(&request)?)
    }

    /// Queues one step on `stream` (a stream of `kernels`' context): stage 1 of this rank's
    /// shard into its part of `step.parts` (with min-p, top-k or top-p, in segments between
    /// all-reduces of the rank's exchange, which lies at the workspace's start), the
    /// all-gather of every rank's part, and the shard merge into the outputs. Every rank calls
    /// it for the same step (NCCL's collective order) with the same rows' processing: the
    /// processing decides how many all-reduces the step queues and their sizes, and ranks given
    /// different ones would queue mismatched collectives, which hang (no rank can see another's
    /// processing; [`TensorParallelRank::abort`] is the way out). Nothing is allocated and
    /// nothing waits;
    /// NCCL lets a CUDA graph capture it. A failed collective shows in
    /// [`TensorParallelRank::check`] or as the stream's error.
    ///
    /// # Safety
    /// As [`StreamSampler::sample_processed`] and [`StreamSampler::merge_shards`] for the
    /// step's buffers, with the workspace of [`TensorParallelRank::workspace_bytes`]; the
    /// communicator's device is the context's.
    pub unsafe fn sample(
        &self,
        kernels: &StreamSampler,
        stream: *mut c_void,
        step: &RankStep,
        workspace: DeviceWorkspace,
    ) -> Result<()> {
        let part_bytes = self.parts_bytes(step.hidden.rows, step.draws.count, step.logprobs)? / self.ranks;
        let exchange = exchange_bytes(&step.processing).unwrap_or(0);
        let request = self.stage_one(step, part_bytes, if exchange > 0 { workspace.address } else { 0 });
        if workspace.bytes < exchange {
            return Err(invalid(
                "workspace",
                format!("{} bytes: the exchange alone takes {exchange}", workspace.bytes),
            ));
        }
        let stage_workspace =
            DeviceWorkspace { address: workspace.address + exchange as u64, bytes: workspace.bytes - exchange };
        let merge = ShardMergeRequest {
            parts: step.parts,
            shards: self.ranks,
            rows: step.hidden.rows,
            samples: step.draws.count,
            logprobs: step.logprobs,
            row_params: step.row_params,
            processing: step.processing,
            tokens: step.tokens,
            out_logprobs: step.out_logprobs,
            out_top_logprobs: step.out_top_logprobs,
        };
        // Planned once for all the segments.
        let plan = kernels.plan_processed(&request)?;
        // SAFETY: per this function's contract: the workspace holds the exchange, then the
        // stage's workspace; the exchange is cleared on `stream` before segment 0, and each
        // all-reduce is queued on `stream` between two segments.
        unsafe {
            driver::in_context(kernels.context().cast(), || {
                if exchange > 0 {
                    let words = exchange / 4;
                    driver::fill_words_async(
                        "shard exchange",
                        DevicePtr::new(workspace.address),
                        0,
                        words,
                        stream.cast(),
                    )?;
                }
                for segment in 0..plan.segments() {
                    let maps = TensorMaps::Store;
                    let queued = kernels.enqueue_processed_segment(
                        stream.cast(),
                        &request,
                        &plan,
                        maps,
                        stage_workspace,
                        segment,
                    )?;
                    if let Some(reduction) = queued {
                        queue_all_reduce(self.comm, stream, reduction, self.rank)?;
                    }
                }
                queue_all_gather(self.comm, stream, step.parts, part_bytes, self.rank)
            })?;
            kernels.merge_shards(stream, &merge)
        }
    }

    /// The stage-1 request of `step`: this rank's shard into its part, with the exchange at
    /// `exchange` (0 for none).
    fn stage_one(&self, step: &RankStep, part_bytes: usize, exchange: u64) -> ProcessedRequest {
        ProcessedRequest {
            lm_head: step.lm_head,
            hidden: step.hidden,
            row_params: step.row_params,
            draws: step.draws,
            variant: step.variant,
            processing: step.processing,
            target: ProcessedTarget::Shard {
                vocab_offset: step.vocab_offset,
                vocab: step.vocab,
                part: step.parts + (self.rank * part_bytes) as u64,
                logprobs: step.logprobs,
                exchange,
            },
        }
    }

    /// NCCL's asynchronous error of the communicator, if any (`ncclCommGetAsyncError`): a
    /// collective that failed after it was queued.
    pub fn check(&self) -> Result<()> {
        let mut async_error = nccl_sys::ncclResult_t::ncclSuccess;
        // SAFETY: a live communicator and a place for its state.
        let polled = unsafe { nccl_sys::ncclCommGetAsyncError(self.comm, &mut async_error) }.result();
        polled.and(async_error.result()).map(|_| ()).map_err(|e| nccl_error(Some(self.rank), "the all-gather", e))
    }

    /// Aborts the communicator (NCCL's way out of a collective that hangs, for example when
    /// another rank died); the rank is unusable afterwards.
    pub fn abort(mut self) -> Result<()> {
        let comm = std::mem::replace(&mut self.comm, std::ptr::null_mut());
        // SAFETY: a live communicator, not used again.
        unsafe { nccl::comm_abort(comm) }.map(|_| ()).map_err(|e| nccl_error(Some(self.rank), "ncclCommAbort", e))
    }

    /// Destroys the communicator if it was made here (after the caller's streams have run
    /// this rank's work), reporting NCCL's error.
    pub fn close(mut self) -> Result<()> {
        self.destroy()
    }

    fn destroy(&mut self) -> Result<()> {
        let comm = std::mem::replace(&mut self.comm, std::ptr::null_mut());
        if comm.is_null() || !self.owned {
            return Ok(());
        }
        // SAFETY: a live communicator made here, not used again.
        unsafe { nccl::comm_destroy(comm) }.map(|_| ()).map_err(|e| nccl_error(Some(self.rank), "ncclCommDestroy", e))
    }
}

impl Drop for TensorParallelRank {
    /// Destroys a communicator made here; an error is reported on stderr (call
    /// [`TensorParallelRank::close`] to receive it instead).
    fn drop(&mut self) {
        if let Err(e) = self.destroy() {
            eprintln!("flashsample: dropping a TensorParallelRank: {e}");
        }
    }
}

/// Bytes of a rank's exchange buffer for `processing` (a multiple of 256, so that the stage's
/// workspace after it stays aligned), or `None` when no row truncates.
fn exchange_bytes(processing: &ProcessingRef) -> Option<usize> {
    processing.truncates().then(|| StreamSampler::shard_exchange_bytes(processing).next_multiple_of(256))
}

/// An aligned, non-null exchange address for planning only: a plan reads whether there is an
/// exchange, never its memory.
const EXCHANGE_PLACEHOLDER: u64 = 256;

/// [`Error::Nccl`] unless NCCL can be opened.
fn check_nccl_library() -> Result<()> {
    if nccl_library_present() {
        return Ok(());
    }
    let names = cudarc::get_lib_name_candidates("nccl");
    Err(Error::Nccl {
        rank: None,
        call: "open the NCCL library".into(),
        detail: format!("none of {names:?} on the loader's path (LD_LIBRARY_PATH)"),
    })
}

impl Drop for TensorParallelSampler {
    /// Destroys the communicators; an error here is reported on stderr (call
    /// [`TensorParallelSampler::close`] to receive it instead).
    fn drop(&mut self) {
        if let Err(e) = self.destroy_comms() {
            eprintln!("flashsample: dropping a TensorParallelSampler: {e}");
        }
    }
}
