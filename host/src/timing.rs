//! CUDA-event timing: warm-up, L2 flushed before every run, median of many runs.

use cust::event::{Event, EventFlags};
use cust::memory::DeviceBuffer;

use crate::cuda::{CudaSampler, driver};
use crate::error::Result;

/// Bytes written between runs so that no input is still in the 60 MB L2.
pub const FLUSH_BYTES: usize = 256 << 20;

/// Times queued GPU work with events.
pub struct Timer {
    flush: DeviceBuffer<u32>,
    start: Event,
    stop: Event,
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
    pub fn new() -> Result<Timer> {
        // SAFETY: the buffer is only ever written (by memset).
        let flush = driver::check("cuMemAlloc(L2 flush)", unsafe { DeviceBuffer::uninitialized(FLUSH_BYTES / 4) })?;
        let start = driver::check("cuEventCreate", Event::new(EventFlags::DEFAULT))?;
        let stop = driver::check("cuEventCreate", Event::new(EventFlags::DEFAULT))?;
        Ok(Timer { flush, start, stop })
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
            // SAFETY: the flush buffer is ours alone; the memset is ordered on our stream.
            driver::check("cuMemsetD32Async(L2 flush)", unsafe {
                self.flush.set_32_async(run as u32 ^ 0x5a5a_5a5a, stream)
            })?;
            driver::check("cuEventRecord", self.start.record(stream))?;
            work()?;
            driver::check("cuEventRecord", self.stop.record(stream))?;
            driver::check("cuEventSynchronize", self.stop.synchronize())?;
            samples.push(driver::check("cuEventElapsedTime", self.stop.elapsed_time_f32(&self.start))? as f64 * 1e3);
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
