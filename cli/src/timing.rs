//! CUDA-event timing: warm-up, L2 flushed before every run, median of many runs.

use cudarc::driver::{CudaEvent, CudaSlice, DevicePtr as _, sys};
use flashsample::cuda::driver::{self, fill_words_async};
use flashsample::{CudaSampler, Result};
use flashsample_core::abi::DevicePtr;

/// Bytes written between runs so that no input is still in the 60 MB L2.
pub const FLUSH_BYTES: usize = 256 << 20;

/// Times work queued on one sampler's stream with events.
pub struct Timer {
    flush: CudaSlice<u32>,
    flush_ptr: DevicePtr<u32>,
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
        let stream = sampler.stream();
        // SAFETY: the buffer is only ever written (by the flush).
        let flush = driver::check("cuMemAllocAsync(L2 flush)", unsafe { stream.alloc::<u32>(FLUSH_BYTES / 4) })?;
        let flush_ptr = DevicePtr::new(flush.device_ptr(stream).0);
        let event =
            || driver::check("cuEventCreate", stream.context().new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT)));
        Ok(Timer { flush_ptr, flush, start: event()?, stop: event()? })
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
            // SAFETY: the flush buffer is ours alone and holds `len` words; the fill is
            // ordered on the sampler's stream, on which the buffer was made.
            unsafe {
                fill_words_async(
                    "L2 flush",
                    self.flush_ptr,
                    run as u32 ^ 0x5a5a_5a5a,
                    self.flush.len(),
                    stream.cu_stream(),
                )?
            };
            driver::check("cuEventRecord", self.start.record(stream))?;
            work()?;
            driver::check("cuEventRecord", self.stop.record(stream))?;
            driver::check("cuEventSynchronize", self.stop.synchronize())?;
            samples.push(driver::check("cuEventElapsedTime", self.start.elapsed_ms(&self.stop))? as f64 * 1e3);
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
