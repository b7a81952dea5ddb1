//! The CPU time a decode loop spends queueing one sampling step in borrowed mode (warm: the
//! workspace is allocated, nothing else is), and replaying the same step captured in a CUDA
//! graph. Each call is timed alone on the host clock; the stream is drained between rounds so
//! that a full launch queue never makes a call wait.

use std::path::Path;
use std::time::Instant;

use flashsample::cudarc::driver::sys;
use flashsample::{
    Batch, CudaSampler, DType, DeviceMatrix, Draws, Error, OutputSlice, Request, Result, SamplingParams,
    StreamWorkspace, Target,
};

/// Calls per round, and rounds.
const CALLS: usize = 25;
const ROUNDS: usize = 8;

/// Median and 90th percentile CPU microseconds per call, at one batch size.
pub struct HostCost {
    pub batch: usize,
    pub enqueue: (f64, f64),
    /// The plan reading the tensor maps the previous call left in the workspace.
    pub enqueue_stored_maps: (f64, f64),
    pub graph_launch: (f64, f64),
}

fn cuda(call: &str, e: impl std::fmt::Display) -> Error {
    Error::Cuda { call: call.into(), detail: e.to_string() }
}

/// Times `call` `ROUNDS × CALLS` times, waiting for the stream between rounds.
fn time_calls(sampler: &CudaSampler, call: &mut dyn FnMut() -> Result<()>) -> Result<(f64, f64)> {
    for _ in 0..CALLS {
        call()?;
    }
    let mut micros = Vec::with_capacity(ROUNDS * CALLS);
    for _ in 0..ROUNDS {
        sampler.synchronize("host-cost round")?;
        for _ in 0..CALLS {
            let start = Instant::now();
            call()?;
            micros.push(start.elapsed().as_secs_f64() * 1e6);
        }
    }
    sampler.synchronize("host-cost round")?;
    micros.sort_by(f64::total_cmp);
    Ok((micros[micros.len() / 2], micros[micros.len() * 9 / 10]))
}

/// The host cost of one step at each of `batches` on the LM head `[vocab, dim]`.
pub fn measure(
    sampler: &CudaSampler,
    dim: usize,
    vocab: usize,
    dtype: DType,
    batches: &[usize],
) -> Result<Vec<HostCost>> {
    let head = sampler.random_lm_head(vocab, dim, dtype, 0x5eed, 0.05)?;
    let stream = sampler.stream();
    let kernels = sampler.kernels();
    let mut workspace = StreamWorkspace::new();
    let mut costs = Vec::new();
    for &batch in batches {
        let hidden = sampler.random_hidden(batch, dim, dtype, batch as u64, 2.0)?;
        let params: Vec<_> = (0..batch).map(|r| SamplingParams::new(1.0, 7, r as u32, 0)).collect();
        let rows = sampler.upload_batch(&Batch::new(params), vocab)?;
        let tokens = sampler.outputs(&rows, 1)?;
        let w = sampler.lm_head_address(&head)?;
        // SAFETY: the sampler's buffers live through the timing, used on its stream only.
        let request = unsafe {
            Request {
                lm_head: DeviceMatrix::from_raw(w, vocab, dim, dim, dtype),
                hidden: DeviceMatrix::from_raw(hidden.address(), batch, dim, dim, dtype),
                batch: rows.view(stream),
                draws: Draws::first(1),
                shard: None,
            }
        };
        // SAFETY: as above.
        let target = Target::tokens(unsafe { OutputSlice::from_raw(tokens.tokens_address(), batch) });
        let space = workspace.ensure(stream, kernels.plan(&request, &target)?.workspace_bytes())?;
        let raw_stream = stream.cu_stream().cast();
        // Each call plans (every check) and queues, as a decode loop's step does.
        // SAFETY: every buffer belongs to the sampler, lives through the timing, and is used on
        // its stream only.
        let enqueue = time_calls(sampler, &mut || unsafe {
            kernels.enqueue(raw_stream, &kernels.plan(&request, &target)?, space, 0).map(|_| ())
        })?;
        // SAFETY: as above; the last call wrote this request's maps into the workspace.
        let enqueue_stored_maps = time_calls(sampler, &mut || unsafe {
            kernels.enqueue(raw_stream, &kernels.plan(&request, &target)?.with_stored_maps(), space, 0).map(|_| ())
        })?;
        sampler.synchronize("host-cost capture")?;
        let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
        stream.begin_capture(mode).map_err(|e| cuda("cuStreamBeginCapture", e))?;
        // SAFETY: as above; captured, not run.
        let captured = unsafe { kernels.enqueue(raw_stream, &kernels.plan(&request, &target)?, space, 0) };
        let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0)).map_err(|e| cuda("cuStreamEndCapture", e))?;
        captured?;
        let graph = graph.ok_or_else(|| cuda("cuStreamEndCapture", "nothing was captured"))?;
        let graph_launch = time_calls(sampler, &mut || graph.launch().map_err(|e| cuda("cuGraphLaunch", e)))?;
        costs.push(HostCost { batch, enqueue, enqueue_stored_maps, graph_launch });
    }
    Ok(costs)
}

impl HostCost {
    /// Median and p90 of the enqueue, the stored-maps enqueue and the graph launch, in µs.
    fn figures(&self) -> [f64; 6] {
        let (e, s, g) = (self.enqueue, self.enqueue_stored_maps, self.graph_launch);
        [e.0, e.1, s.0, s.1, g.0, g.1]
    }
}

/// The CSV `host-cost.csv`: batch, enqueue and graph-launch medians and 90th percentiles (µs).
pub fn write_csv(path: &Path, costs: &[HostCost]) -> Result<()> {
    let mut text = String::from(
        "batch,enqueue_median_us,enqueue_p90_us,stored_maps_median_us,stored_maps_p90_us,graph_launch_median_us,graph_launch_p90_us\n",
    );
    for c in costs {
        let figures: Vec<String> = c.figures().iter().map(|f| format!("{f:.2}")).collect();
        text += &format!("{},{}\n", c.batch, figures.join(","));
    }
    std::fs::write(path, text).map_err(|e| Error::File { path: path.display().to_string(), message: e.to_string() })
}

/// The table the bench prints.
pub fn table(costs: &[HostCost]) -> String {
    let mut text = String::from(
        "host cost of one step (CPU µs per call, median / p90; borrowed mode, warm)\n  B      enqueue          maps stored      graph launch\n",
    );
    for c in costs {
        text += &format!("  {:<6}", c.batch);
        for pair in c.figures().chunks(2) {
            text += &format!(" {:>6.2} / {:<6.2} ", pair[0], pair[1]);
        }
        text = text.trim_end().to_string() + "\n";
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_and_csv_list_the_three_costs_in_order() {
        let cost =
            HostCost { batch: 64, enqueue: (12.5, 16.0), enqueue_stored_maps: (7.84, 9.85), graph_launch: (1.8, 2.5) };
        assert_eq!(
            table(std::slice::from_ref(&cost)).lines().last().unwrap(),
            "  64      12.50 / 16.00     7.84 / 9.85      1.80 / 2.50"
        );
        let path = std::env::temp_dir().join(format!("flashsample-host-cost-{}.csv", std::process::id()));
        write_csv(&path, &[cost]).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(text.lines().nth(1).unwrap(), "64,12.50,16.00,7.84,9.85,1.80,2.50");
    }
}
