//! `flashsample bench-tp`: tensor-parallel sampling over N GPUs of this machine (feature
//! `nccl`), one step per (shape, B): total step time and its phases (stage 1, the all-gather,
//! the merge), with and without log-probabilities, beside one GPU's fused sampling of the
//! whole head. Each rank's phases are timed with events on its own stream, L2 flushed on every
//! rank before each run; a step's figure is the slowest rank's. CSV rows as
//! `scripts/tp_peers.py` writes for torch's baseline (all-gather of logits, then sample).

use std::fmt::Write as _;
use std::path::Path;

use cudarc::driver::CudaEvent;
use flashsample::internals::check;
use flashsample::{
    Batch, CudaSampler, DType, Draws, Error, LmHead, Processing, RankInputs, Result, SamplingParams,
    TensorParallelSampler, cuda_device_count,
};

use crate::timing::{L2Flush, event};

pub struct Options {
    /// GPU counts to run (those above the machine's count are skipped and named).
    pub gpus: Vec<usize>,
    pub shapes: Vec<(usize, usize)>,
    pub batches: Vec<usize>,
    pub dtype: DType,
    pub warmup: usize,
    pub runs: usize,
}

/// One timed configuration: `variant` is `tp_sample` / `tp_logprobs` (the whole step) or
/// either with `:stage_one`, `:all_gather`, `:merge` (the slowest rank's phase), or
/// `single_gpu_sample` (one GPU, the whole head, fused).
pub struct Row {
    pub gpus: usize,
    pub dim: usize,
    pub vocab: usize,
    pub batch: usize,
    pub variant: String,
    pub median_us: f64,
    pub min_us: f64,
    pub max_us: f64,
    pub runs: usize,
}

/// A rank's L2 flush buffer and its four events: before stage 1, after it, after the
/// all-gather, after the merge.
struct RankClock {
    flush: L2Flush,
    events: [CudaEvent; 4],
}

impl RankClock {
    fn new(sampler: &CudaSampler) -> Result<RankClock> {
        let events = [event(sampler)?, event(sampler)?, event(sampler)?, event(sampler)?];
        Ok(RankClock { flush: L2Flush::new(sampler)?, events })
    }

    fn record(&self, sampler: &CudaSampler, at: usize) -> Result<()> {
        check("cuEventRecord", self.events[at].record(sampler.stream()))
    }

    /// Microseconds between events `from` and `to` (the stream has run both).
    fn elapsed(&self, from: usize, to: usize) -> Result<f64> {
        check("cuEventSynchronize", self.events[to].synchronize())?;
        Ok(check("cuEventElapsedTime", self.events[from].elapsed_ms(&self.events[to]))? as f64 * 1e3)
    }
}

/// Median, min and max of `samples`.
fn summary(mut samples: Vec<f64>) -> (f64, f64, f64) {
    samples.sort_by(f64::total_cmp);
    (samples[samples.len() / 2], samples[0], samples[samples.len() - 1])
}

pub fn run(options: &Options) -> Result<Vec<Row>> {
    let available = cuda_device_count()?;
    let mut rows = Vec::new();
    let single = CudaSampler::on_device(0)?;
    for &(dim, vocab) in &options.shapes {
        rows.extend(single_gpu(&single, options, dim, vocab)?);
    }
    single.close()?;
    for &gpus in &options.gpus {
        if gpus > available {
            println!("N = {gpus}: skipped, this machine has {available} GPU(s)");
            continue;
        }
        let devices: Vec<usize> = (0..gpus).collect();
        for &(dim, vocab) in &options.shapes {
            let sampler = TensorParallelSampler::new(&devices)?;
            let head = sampler.random_lm_head(vocab, dim, options.dtype, 0x5eed, 0.05)?;
            for &batch in &options.batches {
                for logprobs in [false, true] {
                    rows.extend(time_step(&sampler, &head, options, (dim, vocab, batch), logprobs)?);
                }
            }
            drop(head);
            sampler.close()?;
        }
    }
    Ok(rows)
}

/// One GPU's fused sampling of the whole head (no log-probabilities) at every batch size, the
/// steps' reference.
fn single_gpu(sampler: &CudaSampler, options: &Options, dim: usize, vocab: usize) -> Result<Vec<Row>> {
    let head = sampler.random_lm_head(vocab, dim, options.dtype, 0x5eed, 0.05)?;
    let mut timer = crate::timing::Timer::new(sampler)?;
    let mut rows = Vec::with_capacity(options.batches.len());
    for &batch in &options.batches {
        let hidden = sampler.random_hidden(batch, dim, options.dtype, batch as u64, 2.0)?;
        let on_device = sampler.upload_batch(&Batch::new(params(batch)), vocab)?;
        let mut tokens = sampler.outputs(&on_device, 1)?;
        let timing = timer.time(sampler, options.warmup, options.runs, || {
            sampler.sample_into(&head, &hidden, &on_device, Draws::first(1), &mut tokens)
        })?;
        rows.push(Row {
            gpus: 1,
            dim,
            vocab,
            batch,
            variant: "single_gpu_sample".into(),
            median_us: timing.median_us,
            min_us: timing.min_us,
            max_us: timing.max_us,
            runs: timing.runs,
        });
    }
    Ok(rows)
}

fn params(batch: usize) -> Vec<SamplingParams> {
    (0..batch).map(|r| SamplingParams::new(1.0, 7, r as u32, 0)).collect()
}

/// Times `runs` steps of `[B, 1]` draws after `warmup`: the whole step and each phase, the
/// slowest rank's.
fn time_step(
    sampler: &TensorParallelSampler,
    head: &LmHead,
    options: &Options,
    (dim, vocab, batch): (usize, usize, usize),
    logprobs: bool,
) -> Result<Vec<Row>> {
    let ranks = sampler.ranks();
    let mut staged = Vec::with_capacity(ranks);
    let mut clocks = Vec::with_capacity(ranks);
    for r in 0..ranks {
        let s = sampler.sampler(r);
        let hidden = s.random_hidden(batch, dim, options.dtype, batch as u64, 2.0)?;
        let processing = Processing { logprobs, ..Processing::default() };
        let rows = s.upload_batch(&Batch::with_processing(params(batch), vec![processing; batch]), vocab)?;
        let out = s.outputs(&rows, 1)?;
        staged.push((hidden, rows, out));
        clocks.push(RankClock::new(s)?);
    }
    let mut inputs: Vec<RankInputs> =
        staged.iter_mut().map(|(hidden, batch, outputs)| RankInputs { hidden, batch, outputs }).collect();
    let draws = Draws::first(1);
    let mut phases: [Vec<f64>; 4] = Default::default();
    for run in 0..options.warmup + options.runs {
        for (r, clock) in clocks.iter().enumerate() {
            clock.flush.fill(sampler.sampler(r), run)?;
            clock.record(sampler.sampler(r), 0)?;
        }
        // The events mark stage 1's end (with its all-reduces) and the gather's.
        sampler.sample_into_phases(head, &mut inputs, draws, |at| record_all(sampler, &clocks, at))?;
        record_all(sampler, &clocks, 3)?;
        sampler.wait()?;
        if run >= options.warmup {
            for (phase, (from, to)) in [(0, 3), (0, 1), (1, 2), (2, 3)].into_iter().enumerate() {
                let slowest =
                    clocks.iter().map(|c| c.elapsed(from, to)).try_fold(0.0f64, |m, t| t.map(|t| m.max(t)))?;
                phases[phase].push(slowest);
            }
        }
    }
    let name = if logprobs { "tp_logprobs" } else { "tp_sample" };
    let labels = [name.to_string(), format!("{name}:stage_one"), format!("{name}:all_gather"), format!("{name}:merge")];
    Ok(labels
        .into_iter()
        .zip(phases)
        .map(|(variant, samples)| {
            let (median_us, min_us, max_us) = summary(samples);
            Row { gpus: ranks, dim, vocab, batch, variant, median_us, min_us, max_us, runs: options.runs }
        })
        .collect())
}

fn record_all(sampler: &TensorParallelSampler, clocks: &[RankClock], at: usize) -> Result<()> {
    clocks.iter().enumerate().try_for_each(|(r, clock)| clock.record(sampler.sampler(r), at))
}

pub const CSV_HEADER: &str = "gpus,dim,vocab,batch,variant,median_us,min_us,max_us,runs";

pub fn write_csv(path: &Path, rows: &[Row]) -> Result<()> {
    let mut text = format!("{CSV_HEADER}\n");
    for r in rows {
        let _ = writeln!(
            text,
            "{},{},{},{},{},{:.2},{:.2},{:.2},{}",
            r.gpus, r.dim, r.vocab, r.batch, r.variant, r.median_us, r.min_us, r.max_us, r.runs
        );
    }
    std::fs::write(path, text).map_err(|e| Error::File { path: path.display().to_string(), message: e.to_string() })
}

/// The step table: per (N, shape, B) our step with and without log-probabilities, the
/// all-gather's share of it, one GPU's fused sampling, and torch's step from `peers` rows
/// (`torch_tp_sample`, `torch_tp_all_gather`) where given.
pub fn table(rows: &[Row], peers: &[Row]) -> String {
    let find = |set: &[Row], gpus: usize, dim: usize, vocab: usize, batch: usize, variant: &str| {
        set.iter()
            .find(|r| (r.gpus, r.dim, r.vocab, r.batch) == (gpus, dim, vocab, batch) && r.variant == variant)
            .map(|r| r.median_us)
    };
    let show = |t: Option<f64>| t.map_or("–".to_string(), |t| format!("{t:.1}"));
    let mut text = String::from(
        "| N | D × V | B | step µs | all-gather | with logprobs µs | all-gather | one GPU fused µs | torch step µs | torch all-gather µs |\n|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in rows.iter().filter(|r| r.variant == "tp_sample") {
        let (n, d, v, b) = (r.gpus, r.dim, r.vocab, r.batch);
        let share = |name: &str| {
            let step = find(rows, n, d, v, b, name)?;
            Some(format!("{:.1} %", 100.0 * find(rows, n, d, v, b, &format!("{name}:all_gather"))? / step))
        };
        let _ = writeln!(
            text,
            "| {n} | {d} × {v} | {b} | {:.1} | {} | {} | {} | {} | {} | {} |",
            r.median_us,
            share("tp_sample").unwrap_or_default(),
            show(find(rows, n, d, v, b, "tp_logprobs")),
            share("tp_logprobs").unwrap_or_default(),
            show(find(rows, 1, d, v, b, "single_gpu_sample")),
            show(find(peers, n, d, v, b, "torch_tp_sample")),
            show(find(peers, n, d, v, b, "torch_tp_all_gather")),
        );
    }
    text
}

/// Rows of a CSV in [`CSV_HEADER`]'s columns (ours or `scripts/tp_peers.py`'s).
pub fn read_csv(path: &Path) -> Result<Vec<Row>> {
    let bad = |message: String| Error::File { path: path.display().to_string(), message };
    let text = std::fs::read_to_string(path).map_err(|e| bad(e.to_string()))?;
    let mut lines = text.lines();
    if lines.next() != Some(CSV_HEADER) {
        return Err(bad(format!("the first line must be `{CSV_HEADER}`")));
    }
    lines
        .filter(|l| !l.is_empty())
        .map(|line| {
            let f: Vec<&str> = line.split(',').collect();
            let number =
                |i: usize| f.get(i).and_then(|x| x.parse::<f64>().ok()).ok_or_else(|| bad(format!("`{line}`")));
            if f.len() != 9 {
                return Err(bad(format!("`{line}`: 9 columns expected")));
            }
            Ok(Row {
                gpus: number(0)? as usize,
                dim: number(1)? as usize,
                vocab: number(2)? as usize,
                batch: number(3)? as usize,
                variant: f[4].to_string(),
                median_us: number(5)?,
                min_us: number(6)?,
                max_us: number(7)?,
                runs: number(8)? as usize,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The CSV reads back what it wrote, and the table finds every column.
    #[test]
    fn csv_round_trips_and_the_table_joins_the_rows() {
        let row = |gpus, variant: &str, us| Row {
            gpus,
            dim: 4096,
            vocab: 151_936,
            batch: 16,
            variant: variant.into(),
            median_us: us,
            min_us: us,
            max_us: us,
            runs: 3,
        };
        let rows = vec![
            row(1, "single_gpu_sample", 100.0),
            row(2, "tp_sample", 60.0),
            row(2, "tp_sample:all_gather", 6.0),
            row(2, "tp_logprobs", 80.0),
            row(2, "tp_logprobs:all_gather", 8.0),
        ];
        let path = std::env::temp_dir().join(format!("flashsample-tp-{}.csv", std::process::id()));
        write_csv(&path, &rows).unwrap();
        let back = read_csv(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(back.len(), rows.len());
        assert_eq!((back[2].gpus, back[2].variant.as_str(), back[2].median_us), (2, "tp_sample:all_gather", 6.0));
        let peers = vec![row(2, "torch_tp_sample", 150.0), row(2, "torch_tp_all_gather", 40.0)];
        let table = table(&back, &peers);
        assert!(
            table.contains("| 2 | 4096 × 151936 | 16 | 60.0 | 10.0 % | 80.0 | 10.0 % | 100.0 | 150.0 | 40.0 |"),
            "{table}"
        );
    }
}
