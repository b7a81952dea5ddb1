//! Tensor-parallel sampling across the GPUs of one process (feature `nccl`): each GPU holds a
//! vocabulary shard of the LM head, runs stage 1 of the shard path on it, and NCCL's
//! all-gather hands every GPU the others' parts (per row and draw a winner with its token's
//! logits, per row the log-sum-exp terms and top raw entries: a few hundred bytes per row, no
//! logits); every GPU then runs the shard merge and holds the tokens.
//!
//! NCCL is opened at run time (cudarc's loader, by the names `cudarc::get_lib_name_candidates`
//! gives: `libnccl.so` and the like); a machine without it gets [`Error::Nccl`], never a
//! panic. A collective that does not finish within the sampler's timeout aborts the
//! communicators and reports the rank that did not finish.

use std::time::{Duration, Instant};

use cudarc::driver::sys;
use cudarc::nccl::result as nccl;
use cudarc::nccl::sys as nccl_sys;

use super::buffers::CudaLmHead;
use super::sampler::{CudaSampler, VocabShard};
use crate::Variant;
use crate::cpu::Sampled;
use crate::error::{Error, Result, invalid};
use crate::params::{Draws, HeadShape, SamplingParams, check_processing_rows, check_request};
use crate::process::Processing;
use crate::tensor::Matrix;

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
        if devices.is_empty() {
            return Err(invalid("devices", "none: at least one GPU is needed"));
        }
        for (r, d) in devices.iter().enumerate() {
            if devices[..r].contains(d) {
                return Err(invalid(format!("devices[{r}]"), format!("GPU {d} is listed twice: one rank per GPU")));
            }
        }
        let vocab = lm_head.rows();
        let bounds = VocabShard::bounds(vocab, devices.len())?;
        if !nccl_library_present() {
            let names = cudarc::get_lib_name_candidates("nccl");
            return Err(Error::Nccl {
                rank: None,
                call: "open the NCCL library".into(),
                detail: format!("none of {names:?} on the loader's path (LD_LIBRARY_PATH)"),
            });
        }
        let mut ranks = Vec::with_capacity(devices.len());
        for (r, &device) in devices.iter().enumerate() {
            let sampler = CudaSampler::on_device(device)?;
            let head = sampler.upload_lm_head(&lm_head.row_range(bounds[r], bounds[r + 1]))?;
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

    /// The draws `draws` of each row of `hidden` (replicated to every GPU) with the row's
    /// processing and log-probabilities: stage 1 on every GPU over its shard, the all-gather of
    /// the parts, and the shard merge on every GPU. Returns each rank's result (all the same:
    /// every rank merges the same parts in the same order). min-p, top-k and top-p need one
    /// shard, as [`CudaSampler::sample_sharded`].
    pub fn sample(
        &mut self,
        hidden: &Matrix,
        params: &[SamplingParams],
        processing: &[Processing],
        draws: Draws,
    ) -> Result<Vec<Sampled>> {
        if self.aborted {
            return Err(Error::Nccl {
                rank: None,
                call: "sample".into(),
                detail: "the communicators were aborted after an earlier failure; make a new sampler".into(),
            });
        }
        let draws = draws.check()?;
        let shape = self.ranks[0].head.shape();
        check_request(HeadShape { vocab: self.vocab, ..shape }, hidden.shape(), params, draws.count)?;
        check_processing_rows(processing.len(), params.len())?;
        let (batch, count, world) = (params.len(), draws.count as usize, self.ranks.len());
        let mut staged = Vec::with_capacity(world);
        for (r, rank) in self.ranks.iter().enumerate() {
            let sampler = &rank.sampler;
            let device_processing = sampler.upload_processing(processing, self.vocab)?;
            let on_device = sampler.upload_hidden(hidden)?;
            let rows = sampler.upload_rows(params)?;
            let mut parts = sampler.shard_parts(world, batch, count, true)?;
            let (variant, shard) = (Variant::Auto, rank.shard);
            sampler.sample_shard_into(
                &rank.head,
                shard,
                &on_device,
                &rows,
                &device_processing,
                draws,
                variant,
                &mut parts,
                r,
            )?;
            staged.push((device_processing, rows, parts));
        }
        // Each rank sends its own part (NCCL's in-place all-gather).
        let own: Vec<u64> =
            staged.iter().enumerate().map(|(r, (_, _, parts))| parts.part_address(r)).collect::<Result<_>>()?;
        nccl::group_start().map_err(|e| nccl_error(None, "ncclGroupStart", e))?;
        for (r, (rank, (_, _, parts))) in self.ranks.iter().zip(&staged).enumerate() {
            let (bytes, own) = (parts.part_bytes(), own[r]);
            let stream = rank.sampler.stream().cu_stream();
            // SAFETY: the parts buffer holds `world` parts of `bytes` on this rank's device; the
            // send buffer is this rank's own part inside it (NCCL's in-place all-gather), and the
            // stream is the one stage 1 ran on, so the gather follows it.
            let queued = unsafe {
                nccl::all_gather(
                    own as *const _,
                    parts.address() as *mut _,
                    bytes,
                    nccl_sys::ncclDataType_t::ncclUint8,
                    rank.comm,
                    stream as nccl_sys::cudaStream_t,
                )
            };
            if let Err(e) = queued {
                // Leave the group before reporting, so that NCCL's state stays consistent.
                let _ = nccl::group_end();
                return Err(nccl_error(Some(r), "ncclAllGather", e));
            }
        }
        nccl::group_end().map_err(|e| nccl_error(None, "ncclGroupEnd", e))?;
        let mut outputs = Vec::with_capacity(world);
        for (rank, (device_processing, rows, parts)) in self.ranks.iter().zip(&staged) {
            let mut out = rank.sampler.processed_outputs(batch, count, true)?;
            rank.sampler.merge_shards_into(parts, rows, device_processing, &mut out)?;
            outputs.push(out);
        }
        self.wait_all()?;
        self.ranks.iter().zip(&outputs).map(|(rank, out)| rank.sampler.processed_to_host(out)).collect()
    }

    /// Waits until every rank's stream has run its work, polling NCCL for asynchronous errors;
    /// past the timeout, aborts the communicators and names the first rank not done.
    fn wait_all(&mut self) -> Result<()> {
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

impl Drop for TensorParallelSampler {
    /// Destroys the communicators; an error here is reported on stderr (call
    /// [`TensorParallelSampler::close`] to receive it instead).
    fn drop(&mut self) {
        if let Err(e) = self.destroy_comms() {
            eprintln!("flashsample: dropping a TensorParallelSampler: {e}");
        }
    }
}
