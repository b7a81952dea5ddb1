//! Tensor-parallel sampling (feature `nccl`): each GPU holds a vocabulary shard of the LM
//! head and runs stage 1 of a sharded call on it; NCCL's all-gather hands every GPU the
//! others' parts (per row and draw a winner with its token's logits, per row the log-sum-exp
//! terms and top raw entries: a few hundred bytes per row, no logits); every GPU then merges
//! them and holds the tokens. Rows with min-p, top-k or top-p run stage 1 in segments, between
//! which NCCL's all-reduces hand every rank each row's largest logit and its histograms over
//! the whole vocabulary, so that every rank decides the truncations as the unsharded row does.
//!
//! Two ways in, both thin wrappers over the one segment driver with NCCL as its collective:
//! [`TensorParallelSampler`] drives every GPU from one process (one thread), with its own
//! buffers and streams, and is a [`Sampler`]; [`TensorParallelRank`] is one rank as engines
//! run them, one process (or thread) per GPU, in borrowed mode on the engine's stream and
//! memory, with a communicator joined from a shared [`NcclId`] or the engine's own.
//!
//! NCCL is opened at run time (cudarc's loader, by the names `cudarc::get_lib_name_candidates`
//! gives: `libnccl.so` and the like); a machine without it gets [`Error::Nccl`], never a
//! panic. A collective that does not finish within the sampler's timeout aborts the
//! communicators and reports the rank that did not finish.

use std::cell::Cell;
use std::ffi::c_void;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaStream, sys};
use cudarc::nccl::result as nccl;
use cudarc::nccl::sys as nccl_sys;

use super::batch::DeviceBatch;
use super::driver;
use super::enqueue::{Planned, drive};
use super::owned::{CudaHidden, CudaSampler, DeviceOutputs};
use super::plan::Plan;
use super::request::{DeviceWorkspace, Exchange, Request, Shard, Target};
use super::stream::{StreamSampler, StreamWorkspace};
use crate::batch::Batch;
use crate::error::{Error, Result, invalid};
use crate::params::{Draws, VocabShard, check_request_shape};
use crate::sampled::Sampled;
use crate::sampler::{HeadStorage, LmHead, Owner, Sampler};
use crate::tensor::Matrix;

/// How long a call waits for its collectives and merge before it aborts the communicators.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// A sampler over `N` GPUs of this process: an LM head it uploads is split by vocabulary into
/// `N` shards of whole Philox blocks ([`VocabShard::bounds`]), shard `r` on GPU `r`, and every
/// call runs the sharded path over NCCL. Every rank ends with the same tokens and
/// log-probabilities, those of the unsharded head.
///
/// ```no_run
/// use flashsample::{Batch, Draws, Elements, Matrix, Sampler, SamplingParams, TensorParallelSampler};
/// let sampler = TensorParallelSampler::new(&[0, 1])?;
/// let w = Matrix::new("lm_head", 32_000, 64, Elements::F32(vec![0.01; 32_000 * 64]))?;
/// let head = sampler.upload_lm_head(&w)?; // 16,000 rows on each GPU
/// let h = Matrix::new("hidden", 1, 64, Elements::F32(vec![1.0; 64]))?;
/// let batch = Batch::new(vec![SamplingParams::new(0.8, 1, 0, 0)]);
/// let sampled = sampler.sample(&head, &h, &batch, Draws::first(4))?;
/// # Ok::<(), flashsample::Error>(())
/// ```
pub struct TensorParallelSampler {
    ranks: Vec<Rank>,
    owner: Owner,
    timeout: Duration,
    /// Set once a collective failed or timed out: the communicators are aborted.
    aborted: Cell<bool>,
}

/// One GPU's sampler and communicator.
struct Rank {
    sampler: CudaSampler,
    /// Null once aborted or destroyed.
    comm: Cell<nccl_sys::ncclComm_t>,
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

/// One rank's inputs and outputs of [`TensorParallelSampler::sample_into`], on its GPU (made
/// by [`TensorParallelSampler::sampler`]`(r)`).
pub struct RankInputs<'a> {
    /// `H`, replicated on every GPU.
    pub hidden: &'a CudaHidden,
    /// The batch, replicated on every GPU.
    pub batch: &'a DeviceBatch,
    /// Where the rank's tokens go.
    pub outputs: &'a mut DeviceOutputs,
}

impl TensorParallelSampler {
    /// A sampler over the GPUs `devices` (rank `r` on `devices[r]`, each listed once), with
    /// one NCCL communicator per GPU.
    pub fn new(devices: &[usize]) -> Result<TensorParallelSampler> {
        if devices.is_empty() {
            return Err(invalid("devices", "none: at least one GPU is needed"));
        }
        for (r, d) in devices.iter().enumerate() {
            if devices[..r].contains(d) {
                return Err(invalid(format!("devices[{r}]"), format!("GPU {d} is listed twice: one rank per GPU")));
            }
        }
        check_nccl_library()?;
        let samplers = devices.iter().map(|&device| CudaSampler::on_device(device)).collect::<Result<Vec<_>>>()?;
        let ordinals: Vec<i32> = devices.iter().map(|&d| d as i32).collect();
        let mut comms = vec![std::ptr::null_mut(); devices.len()];
        // SAFETY: `comms` has room for one communicator per listed device.
        unsafe { nccl::comm_init_all(comms.as_mut_ptr(), ordinals.len() as i32, ordinals.as_ptr()) }
            .map_err(|e| nccl_error(None, "ncclCommInitAll", e))?;
        let ranks = samplers.into_iter().zip(comms).map(|(sampler, comm)| Rank { sampler, comm: Cell::new(comm) });
        Ok(TensorParallelSampler {
            ranks: ranks.collect(),
            owner: Owner::next(),
            timeout: DEFAULT_TIMEOUT,
            aborted: Cell::new(false),
        })
    }

    /// N, the ranks.
    pub fn ranks(&self) -> usize {
        self.ranks.len()
    }

    /// How long a call waits for the collectives and the merge (default [`DEFAULT_TIMEOUT`]).
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    /// Rank `r`'s sampler: its device, its stream (every call queues there) and the uploads a
    /// step's inputs need ([`CudaSampler::upload_hidden`], [`CudaSampler::upload_batch`],
    /// [`CudaSampler::outputs`]).
    pub fn sampler(&self, r: usize) -> &CudaSampler {
        &self.ranks[r].sampler
    }

    /// A head of the ranks' shards (rank `r`'s uploaded by `shard(r)` on its sampler): each
    /// rank's own head's memory moves into one head of this sampler.
    fn head_of(&self, shard: impl Fn(usize, &CudaSampler) -> Result<LmHead>) -> Result<LmHead> {
        let mut shapes = Vec::with_capacity(self.ranks.len());
        let mut resident = Vec::with_capacity(self.ranks.len());
        for (r, rank) in self.ranks.iter().enumerate() {
            let head = shard(r, &rank.sampler)?;
            shapes.push(head.shape);
            let HeadStorage::Cuda(mut shards) = head.storage else {
                unreachable!("a GPU sampler keeps its heads on the GPU")
            };
            resident.push(shards.remove(0));
        }
        LmHead::new(self.owner, &shapes, HeadStorage::Cuda(resident))
    }

    /// An LM head of `vocab × dim` uniform values in `[-scale, scale)` made on each GPU (each
    /// shard drawn under its own seed: benchmarks).
    #[cfg(feature = "internals")]
    pub fn random_lm_head(
        &self,
        vocab: usize,
        dim: usize,
        dtype: crate::DType,
        seed: u64,
        scale: f32,
    ) -> Result<LmHead> {
        let bounds = VocabShard::bounds(vocab, self.ranks.len())?;
        self.head_of(|r, sampler| {
            sampler.random_lm_head(bounds[r + 1] - bounds[r], dim, dtype, seed ^ bounds[r] as u64, scale)
        })
    }

    /// Queues one step with inputs and outputs already on the GPUs (`inputs[r]` on rank `r`'s
    /// device): stage 1 on every rank (with the all-reduces of the truncations), the
    /// all-gather of the parts, the merge on every rank. Nothing is copied from the host and
    /// nothing waits; [`TensorParallelSampler::wait`] waits with the timeout.
    pub fn sample_into(&self, lm_head: &LmHead, inputs: &mut [RankInputs], draws: Draws) -> Result<()> {
        self.sample_into_marked(lm_head, inputs, draws, |_| Ok(()))
    }

    /// [`TensorParallelSampler::sample_into`], calling `mark(1)` once stage 1 is queued on
    /// every rank and `mark(2)` once the all-gather is (benchmarks record events there to time
    /// the phases).
    #[cfg(feature = "internals")]
    pub fn sample_into_phases(
        &self,
        lm_head: &LmHead,
        inputs: &mut [RankInputs],
        draws: Draws,
        mark: impl FnMut(usize) -> Result<()>,
    ) -> Result<()> {
        self.sample_into_marked(lm_head, inputs, draws, mark)
    }

    fn sample_into_marked(
        &self,
        lm_head: &LmHead,
        inputs: &mut [RankInputs],
        draws: Draws,
        mut mark: impl FnMut(usize) -> Result<()>,
    ) -> Result<()> {
        self.check_usable()?;
        lm_head.check_owner(self.owner)?;
        let HeadStorage::Cuda(heads) = &lm_head.storage else { unreachable!("a tensor-parallel head is on the GPUs") };
        let world = self.ranks.len();
        if inputs.len() != world {
            return Err(invalid("inputs", format!("{} entries for {world} ranks: one per rank", inputs.len())));
        }
        let mut planned = Vec::with_capacity(world);
        for (r, (rank, step)) in self.ranks.iter().zip(inputs.iter()).enumerate() {
            let shard = Shard {
                tokens: VocabShard { offset: lm_head.offsets[r], vocab: lm_head.shape.vocab },
                index: r,
                count: world,
            };
            planned.push(rank.sampler.plan_shard(&heads[r], shard, step.hidden, step.batch, draws, step.outputs)?);
        }
        let segments = planned[0].plan.segments();
        if planned.iter().any(|p| p.plan.segments() != segments) {
            return Err(invalid(
                "inputs",
                "the ranks' calls run in different segments: give every rank the same batch",
            ));
        }
        let mut gathered = false;
        // SAFETY: every rank's plan names live buffers of its sampler on its stream; each
        // exchange is queued below on its rank's stream, in one group per segment.
        unsafe {
            drive(&planned, |ended| {
                if ended.len() != world {
                    return Err(invalid(
                        "inputs",
                        "the ranks' segments end differently: give every rank the same batch",
                    ));
                }
                let gather = matches!(ended[0].1, Exchange::AllGather { .. });
                if gather {
                    mark(1)?;
                }
                self.group(|| {
                    ended.iter().try_for_each(|&(r, exchange)| {
                        let stream = self.ranks[r].sampler.stream().cu_stream();
                        queue_collective(self.ranks[r].comm.get(), stream.cast(), exchange, r)
                    })
                })?;
                if gather {
                    gathered = true;
                    mark(2)?;
                }
                Ok(())
            })?
        };
        if !gathered {
            // One rank gathers nothing: its phases are stage 1 and the merge alone.
            mark(1)?;
            mark(2)?;
        }
        Ok(())
    }

    /// Runs `queue` inside one NCCL group, leaving the group before reporting an error so
    /// that NCCL's state stays consistent.
    fn group(&self, queue: impl FnOnce() -> Result<()>) -> Result<()> {
        nccl::group_start().map_err(|e| nccl_error(None, "ncclGroupStart", e))?;
        let queued = queue();
        let ended = nccl::group_end().map(|_| ()).map_err(|e| nccl_error(None, "ncclGroupEnd", e));
        queued.and(ended)
    }

    /// Refuses calls once the communicators are aborted.
    fn check_usable(&self) -> Result<()> {
        if self.aborted.get() {
            return Err(Error::Nccl {
                rank: None,
                call: "sample".into(),
                detail: "the communicators were aborted after an earlier failure; make a new sampler".into(),
            });
        }
        Ok(())
    }

    /// Waits until every rank's stream has run its work, polling NCCL for asynchronous errors;
    /// past the timeout, aborts the communicators and names the first rank not done.
    pub fn wait(&self) -> Result<()> {
        let start = Instant::now();
        let mut pending: Vec<usize> = (0..self.ranks.len()).collect();
        while !pending.is_empty() {
            let mut still = Vec::new();
            for &r in &pending {
                let rank = &self.ranks[r];
                let mut async_error = nccl_sys::ncclResult_t::ncclSuccess;
                // SAFETY: a live communicator and a place for its state.
                let polled = unsafe { nccl_sys::ncclCommGetAsyncError(rank.comm.get(), &mut async_error) }.result();
                if let Err(e) = polled.and(async_error.result()) {
                    self.abort();
                    return Err(nccl_error(Some(r), "a collective", e));
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
                        call: "the collectives and merge".into(),
                        detail: format!("not finished within {:?}; the communicators are aborted", self.timeout),
                    });
                }
                std::thread::sleep(Duration::from_micros(50));
            }
        }
        Ok(())
    }

    /// Aborts every communicator (what NCCL offers to end a hung collective).
    fn abort(&self) {
        for rank in &self.ranks {
            let comm = rank.comm.replace(std::ptr::null_mut());
            if !comm.is_null() {
                // SAFETY: a live communicator, not used again (it is nulled).
                let _ = unsafe { nccl::comm_abort(comm) };
            }
        }
        self.aborted.set(true);
    }

    /// Destroys the communicators and closes every rank's sampler, reporting the first error.
    pub fn close(mut self) -> Result<()> {
        self.destroy_comms()?;
        let ranks = std::mem::take(&mut self.ranks);
        let mut first = Ok(());
        for rank in ranks {
            let closed = rank.sampler.close();
            if first.is_ok() {
                first = closed;
            }
        }
        first
    }

    fn destroy_comms(&mut self) -> Result<()> {
        let mut first = Ok(());
        for (r, rank) in self.ranks.iter().enumerate() {
            let comm = rank.comm.replace(std::ptr::null_mut());
            if !comm.is_null() {
                // SAFETY: a live communicator whose work has finished (every call waits), not
                // used again (it is nulled).
                let destroyed = unsafe { nccl::comm_destroy(comm) };
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

impl Sampler for TensorParallelSampler {
    fn device(&self) -> String {
        let names: Vec<String> = self.ranks.iter().map(|rank| rank.sampler.device()).collect();
        format!("{} GPUs: {}", self.ranks.len(), names.join(", "))
    }

    /// Splits `lm_head` into one shard per rank ([`VocabShard::bounds`]) and uploads shard `r`
    /// to rank `r`.
    fn upload_lm_head(&self, lm_head: &Matrix) -> Result<LmHead> {
        let bounds = VocabShard::bounds(lm_head.rows(), self.ranks.len())?;
        self.head_of(|r, sampler| sampler.upload_lm_head(&lm_head.row_range(bounds[r], bounds[r + 1])))
    }

    /// Uploads shard `r` to rank `r`: one shard per rank.
    fn upload_lm_head_shards(&self, shards: &[Matrix]) -> Result<LmHead> {
        if shards.len() != self.ranks.len() {
            return Err(invalid(
                "shards",
                format!("{} shards for {} ranks: one per rank", shards.len(), self.ranks.len()),
            ));
        }
        self.head_of(|r, sampler| sampler.upload_lm_head(&shards[r]))
    }

    /// Uploads `hidden` and the batch to every GPU, queues a step, waits for it with the
    /// timeout and returns rank 0's results, which every rank's equal (they merge the same parts
    /// in the same order; a difference is reported as an error).
    fn sample(&self, lm_head: &LmHead, hidden: &Matrix, batch: &Batch, draws: Draws) -> Result<Sampled> {
        lm_head.check_owner(self.owner)?;
        let draws = draws.check()?;
        check_request_shape(lm_head.shape, hidden.shape(), batch.rows(), "params", draws.count)?;
        let mut staged = Vec::with_capacity(self.ranks.len());
        for rank in &self.ranks {
            let sampler = &rank.sampler;
            let on_device = sampler.upload_batch(batch, lm_head.shape.vocab)?;
            let outputs = sampler.outputs(&on_device, draws.count)?;
            staged.push((sampler.upload_hidden(hidden)?, on_device, outputs));
        }
        let mut inputs: Vec<RankInputs> =
            staged.iter_mut().map(|(hidden, batch, outputs)| RankInputs { hidden, batch, outputs }).collect();
        self.sample_into(lm_head, &mut inputs, draws)?;
        self.wait()?;
        let mut results =
            self.ranks.iter().zip(&staged).map(|(rank, (_, _, outputs))| match rank.sampler.read(outputs) {
                Err(Error::RowsWithoutToken { sampled, .. }) => Ok(*sampled),
                other => other,
            });
        let first = results.next().expect("at least one rank")?;
        for (r, other) in results.enumerate() {
            if other? != first {
                return Err(Error::Nccl {
                    rank: Some(r + 1),
                    call: "the merge".into(),
                    detail: "this rank's results differ from rank 0's".into(),
                });
            }
        }
        crate::error::sampled_or_row_status(first)
    }

    fn close(self: Box<Self>) -> Result<()> {
        TensorParallelSampler::close(*self)
    }
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

/// Queues NCCL's collective for `exchange` of rank `rank` on `stream`: an in-place
/// all-reduce of the exchange's words, or the in-place all-gather of the parts.
///
/// # Safety
/// `comm` is a live communicator of the stream's device; the exchange's memory lies in that
/// device's memory, used on `stream` until the collective has run.
unsafe fn queue_collective(
    comm: nccl_sys::ncclComm_t,
    stream: *mut c_void,
    exchange: Exchange,
    rank: usize,
) -> Result<()> {
    let stream = stream as nccl_sys::cudaStream_t;
    let (address, count, datatype, op) = match exchange {
        Exchange::AllGather { parts, part_bytes, index, .. } => {
            let own = parts + (index * part_bytes) as u64;
            // SAFETY: per this function's contract; the send buffer is this rank's part inside
            // the receive buffer (NCCL's in-place all-gather).
            return unsafe {
                nccl::all_gather(
                    own as *const _,
                    parts as *mut _,
                    part_bytes,
                    nccl_sys::ncclDataType_t::ncclUint8,
                    comm,
                    stream,
                )
            }
            .map(|_| ())
            .map_err(|e| nccl_error(Some(rank), "ncclAllGather", e));
        }
        Exchange::MaxU32 { address, count } => {
            (address, count, nccl_sys::ncclDataType_t::ncclUint32, nccl_sys::ncclRedOp_t::ncclMax)
        }
        Exchange::SumU64 { address, count } => {
            (address, count, nccl_sys::ncclDataType_t::ncclUint64, nccl_sys::ncclRedOp_t::ncclSum)
        }
    };
    // SAFETY: per this function's contract; in place (send and receive buffers the same).
    unsafe { nccl::all_reduce(address as *const _, address as *mut _, count, datatype, op, comm, stream) }
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

    /// The id's 128 bytes, to hand to the other ranks.
    pub fn to_bytes(&self) -> [u8; 128] {
        self.0.internal.map(|c| c as u8)
    }

    /// The id another rank made, from its bytes.
    pub fn from_bytes(bytes: [u8; 128]) -> NcclId {
        NcclId(nccl_sys::ncclUniqueId { internal: bytes.map(|b| b as _) })
    }
}

/// One rank of tensor-parallel sampling as engines run them: one process (or thread) per GPU,
/// the engine's context, stream and device memory (borrowed mode), and one NCCL communicator.
/// A call is a [`Request`] whose `shard` is this rank's (`index` the rank, `count` the ranks)
/// and a [`Target`] with room for every rank's part; the rank queues its segments with NCCL's
/// collectives between them, and every rank ends with the same tokens and log-probabilities.
///
/// Every rank queues the same calls in the same order (NCCL's collective order) with the same
/// batch: the batch decides how many collectives a call queues and their sizes, and ranks given
/// different ones would queue mismatched collectives, which hang (no rank can see another's
/// batch; [`TensorParallelRank::abort`] is the way out). Nothing is allocated (but the growth of
/// a safe workspace) and nothing waits; NCCL lets a CUDA graph capture the calls. A failed
/// collective shows in [`TensorParallelRank::check`] or as the stream's error.
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

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// How many ranks the communicator joins.
    pub fn ranks(&self) -> usize {
        self.ranks
    }

    /// This rank's [`Shard`] of a vocabulary of `vocab` tokens split as
    /// [`VocabShard::bounds`] splits it.
    pub fn shard(&self, vocab: usize) -> Result<Shard> {
        let bounds = VocabShard::bounds(vocab, self.ranks)?;
        Ok(Shard { tokens: VocabShard { offset: bounds[self.rank], vocab }, index: self.rank, count: self.ranks })
    }

    /// The rule that a call's shard is this rank's place among the ranks: `(index, count)`.
    fn check_place(&self, place: Option<(usize, usize)>) -> Result<()> {
        match place {
            Some(place) if place == (self.rank, self.ranks) => Ok(()),
            _ => Err(invalid(
                "request.shard",
                format!("must be this rank's: index {} of {} shards", self.rank, self.ranks),
            )),
        }
    }

    /// Queues every segment of `plan` (this rank's request, planned by `kernels`) on `stream`,
    /// with NCCL's collectives between them: the raw layer.
    ///
    /// # Safety
    /// As [`StreamSampler::enqueue`] for the plan and `workspace`; the communicator's device
    /// is the context's.
    pub unsafe fn enqueue(
        &self,
        kernels: &StreamSampler,
        stream: *mut c_void,
        plan: &Plan,
        workspace: DeviceWorkspace,
    ) -> Result<()> {
        self.check_place(plan.gather.map(|g| (g.index, g.count)))?;
        let call = Planned { kernels: kernels.kernels(), stream: stream.cast(), plan: *plan, workspace };
        // SAFETY: per this function's contract; each collective is queued on `stream`.
        unsafe {
            drive(std::slice::from_ref(&call), |ended| {
                ended.iter().try_for_each(|&(_, exchange)| queue_collective(self.comm, stream, exchange, self.rank))
            })
        }
    }

    /// Queues the call `request` → `target` on `stream` with NCCL's collectives between its
    /// segments: the safe layer, as [`StreamSampler::enqueue_on`].
    pub fn enqueue_on(
        &self,
        kernels: &StreamSampler,
        stream: &Arc<CudaStream>,
        request: &Request,
        target: &Target,
        workspace: &mut StreamWorkspace,
    ) -> Result<()> {
        self.check_place(request.shard.map(|s| (s.index, s.count)))?;
        let raw: *mut c_void = stream.cu_stream().cast();
        // SAFETY: the exchange's memory is the call's, on this rank's device and stream.
        let mut collective = |exchange| unsafe { queue_collective(self.comm, raw, exchange, self.rank) };
        // SAFETY: the views' memory lives through the call; each collective is queued on the
        // call's stream.
        unsafe {
            kernels.enqueue_with(
                stream,
                request,
                target,
                workspace,
                super::dispatch::Variant::Auto,
                Some(&mut collective),
            )
        }
    }

    /// NCCL's asynchronous error of the communicator, if any (`ncclCommGetAsyncError`): a
    /// collective that failed after it was queued.
    pub fn check(&self) -> Result<()> {
        let mut async_error = nccl_sys::ncclResult_t::ncclSuccess;
        // SAFETY: a live communicator and a place for its state.
        let polled = unsafe { nccl_sys::ncclCommGetAsyncError(self.comm, &mut async_error) }.result();
        polled.and(async_error.result()).map(|_| ()).map_err(|e| nccl_error(Some(self.rank), "a collective", e))
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
