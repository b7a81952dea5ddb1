//! CUDA-event timing: warm-up, L2 flushed before every run, median of many runs.

use cudarc::driver::{CudaEvent, CudaSlice, DevicePtr as _, sys};
use flashsample::internals::{check, fill_words_async};
use flashsample::{CudaSampler, Result};
use flashsample_core::abi::DevicePtr;

/// Bytes written between runs so that no input is still in the 60 MB L2.
pub const FLUSH_BYTES: usize = 256 << 20;

/// A buffer that overwrites the L2 cache when filled (before each timed run).
pub struct L2Flush {
    buffer: CudaSlice<u32>,
    address: DevicePtr<u32>,
}

impl L2Flush {
    /// [`FLUSH_BYTES`] on the sampler's stream.
    pub fn new(sampler: &CudaSampler) -> Result<L2Flush> {
        let stream = sampler.stream();
        // SAFETY: the buffer is only ever written (by the flush).
        let buffer = check("cuMemAllocAsync(L2 flush)", unsafe { stream.alloc::<u32>(FLUSH_BYTES / 4) })?;
        let address = DevicePtr::new(buffer.device_ptr(stream).0);
        Ok(L2Flush { buffer, address })
    }

    /// Queues the fill for run `run` (a different word each run) on the sampler's stream.
    pub fn fill(&self, sampler: &CudaSampler, run: usize) -> Result<()> {
        // SAFETY: the buffer is ours alone and holds `len` words; the fill is ordered on the
        // sampler's stream, on which the buffer was made.
        unsafe {
            fill_words_async(
                "L2 flush",
                self.address,
                run as u32 ^ 0x5a5a_5a5a,
                self.buffer.len(),
                sampler.stream().cu_stream(),
            )
        }
    }
}

/// A CUDA event on the sampler's stream's context.
pub fn event(sampler: &CudaSampler) -> Result<CudaEvent> {
    let context = sampler.stream().context();
    check("cuEventCreate", context.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT)))
}

/// Times work queued on one sampler's stream with events.
pub struct Timer {
    flush: L2Flush,
    start: CudaEvent,
    stop: CudaEvent,
}

/// Median and spread of one timed region, in microseconds.
#[derive(Clone, Copy, Debug)]
pub struct Timing {
    pub median_us: f64,
    pub min_us: f64,
    pub max_us: f64,
    pub runs: usize,
}

impl Timer {
    pub fn new(sampler: &CudaSampler) -> Result<Timer> {
        Ok(Timer { flush: L2Flush::new(sampler)?, start: event(sampler)?, stop: event(sampler)? })
    }

    /// Runs `work` `warmup` times, then `runs` times with the L2 flushed before each, and
    /// returns the median of the event-timed region (the flush is outside it).
    pub fn time(
        &mut self,
        sampler: &CudaSampler,
        warmup: usize,
        runs: usize,
        mut work: impl FnMut() -> Result<()>,
    ) -> Result<Timing> {
        let stream = sampler.stream();
        for _ in 0..warmup {
            work()?;
        }
        let mut samples = Vec::with_capacity(runs);
        for run in 0..runs {
            self.flush.fill(sampler, run)?;
            check("cuEventRecord", self.start.record(stream))?;
            work()?;
            check("cuEventRecord", self.stop.record(stream))?;
            check("cuEventSynchronize", self.stop.synchronize())?;
            samples.push(check("cuEventElapsedTime", self.start.elapsed_ms(&self.stop))? as f64 * 1e3);
        }
        sampler.synchronize("the timed work")?;
        samples.sort_by(f64::total_cmp);
        Ok(Timing {
            median_us: samples[samples.len() / 2],
            min_us: samples[0],
            max_us: samples[samples.len() - 1],
            runs,
        })
    }
}
