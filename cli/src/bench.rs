//! `flashsample bench`: fused sampling, fused greedy and the unfused pipeline beside the
//! read-bandwidth floor, per (shape, B) and per PTX module, timed with CUDA events (L2
//! flushed, median of runs), written as CSV and plotted against the peers' CSV from
//! `scripts/peers.py`.

use std::fmt::Write as _;
use std::path::Path;

use flashsample::internals::Variant;
use flashsample::internals::check;
use flashsample::{
    Batch, CudaSampler, DType, Drafted, Draws, Error, LmHead, Module, ModuleChoice, Penalties, Processing, Result,
    SamplingParams,
};
use flashsample_core::abi::{DevicePtr, HANDOFF_ROWS, MMA_PEAK_FLOPS};
use indicatif::{ProgressBar, ProgressStyle};

use crate::cublas::{self, Cublas};
use crate::timing::{Timer, Timing};

/// One timed configuration.
#[derive(Clone, Debug)]
pub struct Row {
    /// The PTX module that ran it (cuBLAS and the read floor: the module of the sampler that
    /// launched them).
    pub module: Module,
    pub dim: usize,
    pub vocab: usize,
    pub batch: usize,
    /// `fused_sample`, `fused_greedy`, `unfused_sample`, `read_floor` or `cublas_gemm` (the
    /// in-process cuBLAS reference); `fused_sample@<variant>` for forced variants;
    /// `mma_peak` for the `mma.sync` peak probe (D = V = B = 0).
    pub variant: String,
    pub timing: Timing,
}

pub struct Options {
    pub gpu: usize,
    /// The modules to time, each on its own sampler; the first also times cuBLAS and the
    /// forced variants. Empty: the device's own module.
    pub modules: Vec<Module>,
    pub shapes: Vec<(usize, usize)>,
    pub batches: Vec<usize>,
    pub dtype: DType,
    pub warmup: usize,
    pub runs: usize,
    /// Also time fused sampling and greedy decoding with every tensor-core variant that can
    /// run the point (rows `fused_sample@mma_n16`, `fused_greedy@tma_m64_n64`, …), to check
    /// the dispatcher.
    pub all_variants: bool,
    /// Time cuBLAS's GEMM in this process, right before our kernels at each point (rows
    /// `cublas_gemm`).
    pub cublas: bool,
    /// Time processed sampling with each of [`PROCESSING_MODES`] on every module (rows
    /// `processed_<mode>`; the report's tables show the first module's).
    pub processing: bool,
    /// Time speculative verification of each of [`VERIFIED_DRAFTS`] drafts for each of
    /// [`VERIFIED_SEQUENCES`] sequences on the first module, and plain sampling of the same
    /// rows (rows `verify_k<k>` and `plain_k<k>`, B the sequences).
    pub verification: bool,
}

/// Drafts per sequence the verification bench times.
pub const VERIFIED_DRAFTS: [usize; 3] = [1, 3, 7];
/// Sequences the verification bench times.
pub const VERIFIED_SEQUENCES: [usize; 3] = [1, 16, 64];

/// A row's processing for a vocabulary of `V` tokens.
type ModeFor = fn(usize) -> Processing;

/// The processing modes the bench times, each on every row of the batch: its label and the
/// row's processing. `plain` processes nothing; `logprobs` is `plain` with log-probabilities,
/// which the other modes go without.
pub const PROCESSING_MODES: [(&str, ModeFor); 10] = [
    ("plain", |_| Processing::default()),
    ("logprobs", |_| Processing { logprobs: true, ..Processing::default() }),
    ("softcap", |_| Processing { softcap: Some(30.0), ..Processing::default() }),
    ("bias", |v| Processing {
        bias: (0..v as u32).step_by(v / 100).map(|t| (t, 2.0)).collect(),
        ..Processing::default()
    }),
    ("mask", |v| Processing { mask: Some(vec![0x5555_5555; v.div_ceil(32)]), ..Processing::default() }),
    ("penalties", |v| Processing {
        history: (0..512u32).map(|i| i * 7919 % v as u32).collect(),
        penalties: Penalties { repetition: 1.1, frequency: 0.1, presence: 0.1 },
        ..Processing::default()
    }),
    ("min_p", |_| Processing { min_p: 0.05, ..Processing::default() }),
    ("top_k", |_| Processing { top_k: Some(50), ..Processing::default() }),
    ("top_p", |_| Processing { top_p: 0.9, ..Processing::default() }),
    ("top_k_top_p", |_| Processing { top_k: Some(50), top_p: 0.9, ..Processing::default() }),
];

/// The processing modes the listed path takes: top-k on every row (the tiles' lists) and
/// min-p alone (the tiles' chains).
pub const LISTED_MODES: [&str; 3] = ["top_k", "top_k_top_p", "min_p"];

/// The suffix of a listed mode's label when timed on materialised logits.
const MATERIALISED: &str = "@materialised";

/// Every tensor-core tile variant of `module`, with its label in the CSV.
fn tensor_core_variants(module: Module) -> Vec<(String, Variant)> {
    Variant::tensor_core(module)
        .map(|variant| match variant {
            Variant::Mma { columns } => (format!("mma_n{columns}"), variant),
            Variant::Staged { columns } => (format!("staged_n{columns}"), variant),
            Variant::Tma { rows, columns } => (format!("tma_m{rows}_n{columns}"), variant),
            Variant::TmaHandoff { columns } => (format!("tma_h{HANDOFF_ROWS}_n{columns}"), variant),
            other => unreachable!("Variant::tensor_core lists mma, staged and TMA variants only, not {other:?}"),
        })
        .collect()
}

fn file_error(path: &Path, e: impl std::fmt::Display) -> Error {
    Error::File { path: path.display().to_string(), message: e.to_string() }
}

/// The samplers of the run, one per module, the first one's module the device's own when none
/// is named.
pub fn samplers(options: &Options) -> Result<Vec<CudaSampler>> {
    if options.modules.is_empty() {
        return Ok(vec![CudaSampler::on_device(options.gpu)?]);
    }
    options.modules.iter().map(|&module| CudaSampler::with_module(options.gpu, ModuleChoice::Force(module))).collect()
}

pub fn run(samplers: &[CudaSampler], options: &Options) -> Result<Vec<Row>> {
    if options.cublas {
        // Before anything is timed.
        cublas::element_type(options.dtype)?;
    }
    let cublas = if options.cublas { Some(Cublas::load(&samplers[0])?) } else { None };
    let rows = run_points(samplers, options, cublas.as_ref());
    match cublas {
        Some(cublas) => rows.and_then(|rows| cublas.close().map(|()| rows)),
        None => rows,
    }
}

fn run_points(samplers: &[CudaSampler], options: &Options, cublas: Option<&Cublas>) -> Result<Vec<Row>> {
    let extra = if options.all_variants { 2 * tensor_core_variants(samplers[0].module()).len() } else { 0 };
    let processing = if options.processing { PROCESSING_MODES.len() + LISTED_MODES.len() } else { 0 };
    let reference = usize::from(cublas.is_some());
    let verification = if options.verification { 2 * VERIFIED_DRAFTS.len() * VERIFIED_SEQUENCES.len() } else { 0 };
    let points = samplers.len()
        + options.shapes.len()
            * (samplers.len() * (1 + (3 + processing) * options.batches.len())
                + (reference + extra) * options.batches.len()
                + verification);
    let progress = ProgressBar::new(points as u64);
    progress.set_style(ProgressStyle::with_template("{bar:40} {pos}/{len} {msg}").expect("valid template"));
    let mut rows = Vec::new();
    let mut timers = samplers.iter().map(Timer::new).collect::<Result<Vec<_>>>()?;
    for &(dim, vocab) in &options.shapes {
        for (position, (sampler, timer)) in samplers.iter().zip(&mut timers).enumerate() {
            let first = position == 0;
            let module = sampler.module();
            let head = sampler.random_lm_head(vocab, dim, options.dtype, 0x5eed ^ vocab as u64, 0.05)?;
            progress.set_message(format!("{} D={dim} V={vocab} read floor", module.name()));
            let timing = timer.time(sampler, options.warmup, options.runs, || sampler.read_probe(&head))?;
            rows.push(Row { module, dim, vocab, batch: 0, variant: "read_floor".into(), timing });
            progress.inc(1);
            if (dim, vocab) == options.shapes[0] {
                progress.set_message(format!("{} mma.sync peak", module.name()));
                let timing = timer.time(sampler, options.warmup, options.runs, || sampler.mma_peak())?;
                rows.push(Row { module, dim: 0, vocab: 0, batch: 0, variant: "mma_peak".into(), timing });
                progress.inc(1);
            }
            if first && options.verification {
                let point = (dim, vocab);
                rows.extend(time_verification(sampler, timer, &head, point, options, &progress)?);
            }
            for &batch in &options.batches {
                let hidden = sampler.random_hidden(batch, dim, options.dtype, batch as u64, 2.0)?;
                // The batch stays on the device, as the hidden states do: the timed region holds
                // kernels only, like the cuBLAS GEMM it is compared with.
                let params = |t: f32| (0..batch).map(|r| SamplingParams::new(t, 7, r as u32, 0)).collect::<Vec<_>>();
                let sampling = sampler.upload_batch(&Batch::new(params(1.0)), vocab)?;
                let greedy = sampler.upload_batch(&Batch::new(params(0.0)), vocab)?;
                let mut tokens = sampler.outputs(&sampling, 1)?;
                let auto = Variant::Auto.resolve(module, options.dtype, dim, batch)?;
                let one = Draws::first(1);
                let mut time = |name: &str, work: &mut dyn FnMut() -> Result<()>| -> Result<()> {
                    progress.set_message(format!("{} D={dim} V={vocab} B={batch} {name}", module.name()));
                    let timing = timer.time(sampler, options.warmup, options.runs, work)?;
                    rows.push(Row { module, dim, vocab, batch, variant: name.into(), timing });
                    progress.inc(1);
                    Ok(())
                };
                if let (true, Some(cublas)) = (first, cublas) {
                    // SAFETY: only written (by the GEMM), on the stream it is made on.
                    let out = unsafe { sampler.stream().alloc::<u16>(batch * vocab) };
                    let out = check("cuMemAllocAsync(cuBLAS output)", out)?;
                    let out_ptr = DevicePtr::new(cudarc::driver::DevicePtr::device_ptr(&out, sampler.stream()).0);
                    let w = sampler.lm_head_address(&head)?;
                    time("cublas_gemm", &mut || cublas.gemm(w, head.shape(), &hidden, out_ptr, out.len()))?;
                }
                time("fused_sample", &mut || sampler.sample_into(&head, &hidden, &sampling, one, &mut tokens))?;
                time("fused_greedy", &mut || sampler.sample_into(&head, &hidden, &greedy, one, &mut tokens))?;
                if auto != Variant::Simt {
                    time("unfused_sample", &mut || {
                        sampler.sample_unfused_into(&head, &hidden, &sampling, one, auto, &mut tokens)
                    })?;
                } else {
                    progress.inc(1);
                }
                if options.processing {
                    for (label, mode) in PROCESSING_MODES {
                        let rows = Batch::with_processing(params(1.0), vec![mode(vocab); batch]);
                        let processing = sampler.upload_batch(&rows, vocab)?;
                        let mut out = sampler.outputs(&processing, 1)?;
                        time(&format!("processed_{label}"), &mut || {
                            sampler.sample_into(&head, &hidden, &processing, one, &mut out)
                        })?;
                        // The same rows with their truncations on materialised logits: the
                        // listed and chained paths' same-run reference.
                        if LISTED_MODES.contains(&label) {
                            let mut materialised = sampler.upload_batch(&rows, vocab)?;
                            materialised.materialise_truncations();
                            time(&format!("processed_{label}{MATERIALISED}"), &mut || {
                                sampler.sample_into(&head, &hidden, &materialised, one, &mut out)
                            })?;
                        }
                    }
                }
                if first && options.all_variants {
                    for (label, variant) in tensor_core_variants(module) {
                        if variant.resolve(module, options.dtype, dim, batch).is_ok() {
                            sampler.set_variant(variant);
                            time(&format!("fused_sample@{label}"), &mut || {
                                sampler.sample_into(&head, &hidden, &sampling, one, &mut tokens)
                            })?;
                            time(&format!("fused_greedy@{label}"), &mut || {
                                sampler.sample_into(&head, &hidden, &greedy, one, &mut tokens)
                            })?;
                            sampler.set_variant(Variant::Auto);
                        } else {
                            progress.inc(2);
                        }
                    }
                }
            }
        }
    }
    progress.finish_and_clear();
    Ok(rows)
}

/// Speculative verification of `k` drafts for each of `S` sequences (`S · (k + 1)` rows, the
/// drafts random, plain sampling at T = 1) beside plain sampling of as many rows, for every
/// `k` of [`VERIFIED_DRAFTS`] and `S` of [`VERIFIED_SEQUENCES`].
fn time_verification(
    sampler: &CudaSampler,
    timer: &mut Timer,
    head: &LmHead,
    (dim, vocab): (usize, usize),
    options: &Options,
    progress: &ProgressBar,
) -> Result<Vec<Row>> {
    let module = sampler.module();
    let one = Draws::first(1);
    let mut rows = Vec::new();
    for sequences in VERIFIED_SEQUENCES {
        for k in VERIFIED_DRAFTS {
            let positions = sequences * (k + 1);
            let hidden = sampler.random_hidden(positions, dim, options.dtype, positions as u64, 2.0)?;
            let drafted = (0..sequences)
                .map(|s| Drafted {
                    params: SamplingParams::new(1.0, 7, s as u32, 0),
                    processing: Processing::default(),
                    drafts: (0..k).map(|j| ((s * 7919 + j * 104_729) % vocab) as u32).collect(),
                })
                .collect();
            let verifying = sampler.upload_batch(&Batch::verify(drafted)?, vocab)?;
            let params = (0..positions).map(|r| SamplingParams::new(1.0, 7, r as u32, 0)).collect();
            let plain = sampler.upload_batch(&Batch::new(params), vocab)?;
            for (name, batch) in [(format!("verify_k{k}"), &verifying), (format!("plain_k{k}"), &plain)] {
                progress.set_message(format!("{} D={dim} V={vocab} S={sequences} {name}", module.name()));
                let mut out = sampler.outputs(batch, 1)?;
                let timing = timer.time(sampler, options.warmup, options.runs, || {
                    sampler.sample_into(head, &hidden, batch, one, &mut out)
                })?;
                rows.push(Row { module, dim, vocab, batch: sequences, variant: name, timing });
                progress.inc(1);
            }
        }
    }
    Ok(rows)
}

/// Writes our rows as CSV with achieved bandwidth (W's bytes over the time) and TFLOP/s.
pub fn write_csv(path: &Path, rows: &[Row], dtype: DType) -> Result<()> {
    let mut out = String::from("dim,vocab,batch,variant,median_us,min_us,max_us,runs,weight_gbps,tflops,module\n");
    for r in rows {
        let bytes = (r.dim * r.vocab * dtype.bytes()) as f64;
        let flops = 2.0 * (r.dim * r.vocab * r.batch) as f64;
        let t = r.timing.median_us * 1e-6;
        writeln!(
            out,
            "{},{},{},{},{:.2},{:.2},{:.2},{},{:.1},{:.2},{}",
            r.dim,
            r.vocab,
            r.batch,
            r.variant,
            r.timing.median_us,
            r.timing.min_us,
            r.timing.max_us,
            r.timing.runs,
            bytes / t / 1e9,
            flops / t / 1e12,
            r.module.name()
        )
        .expect("writing to a String");
    }
    std::fs::write(path, out).map_err(|e| file_error(path, e))
}

/// Reads rows back from a CSV written by [`write_csv`] (`flashsample report` re-renders a
/// GPU run's report and plot on any machine). Only the median is kept; rows of a CSV from
/// before the module column are the Hopper module's, the only one there was.
pub fn read_csv(path: &Path) -> Result<Vec<Row>> {
    let text = std::fs::read_to_string(path).map_err(|e| file_error(path, e))?;
    let mut rows = Vec::new();
    for (number, line) in text.lines().enumerate().skip(1) {
        let f: Vec<&str> = line.split(',').collect();
        let parse = |i: usize| f.get(i).and_then(|s| s.trim().parse::<usize>().ok());
        let median = f.get(4).and_then(|s| s.trim().parse::<f64>().ok());
        let module = match f.get(10).map(|s| s.trim()) {
            None => Some(Module::Hopper),
            Some(name) => Module::ALL.into_iter().find(|m| m.name() == name),
        };
        match (parse(0), parse(1), parse(2), f.get(3), median, parse(7), module) {
            (Some(dim), Some(vocab), Some(batch), Some(name), Some(us), Some(runs), Some(module)) => rows.push(Row {
                module,
                dim,
                vocab,
                batch,
                variant: name.to_string(),
                timing: Timing { median_us: us, min_us: us, max_us: us, runs },
            }),
            _ => return Err(file_error(path, format!("line {}: not a bench.csv row", number + 1))),
        }
    }
    Ok(rows)
}

/// One peer timing: from `scripts/peers.py` (`cublas_gemm`, `torch_sample`, …) or FlashInfer's
/// benchmark (`fi_<mode>`, `fi_<mode>_after_logits`, `torch_mm_f32`).
#[derive(Clone, Debug)]
pub struct PeerTiming {
    pub dim: usize,
    pub vocab: usize,
    pub batch: usize,
    pub variant: String,
    pub median_us: f64,
}

/// Reads the peers' CSV.
pub fn read_peers(path: &Path) -> Result<Vec<PeerTiming>> {
    let text = std::fs::read_to_string(path).map_err(|e| file_error(path, e))?;
    let mut peers = Vec::new();
    for line in text.lines().skip(1) {
        let f: Vec<&str> = line.split(',').collect();
        let parse = |i: usize| f.get(i).and_then(|s| s.trim().parse::<usize>().ok());
        if let (Some(d), Some(v), Some(b), Some(name), Some(us)) =
            (parse(0), parse(1), parse(2), f.get(3), f.get(4).and_then(|s| s.parse().ok()))
        {
            peers.push(PeerTiming { dim: d, vocab: v, batch: b, variant: name.to_string(), median_us: us });
        }
    }
    Ok(peers)
}

/// Our median at (D, V, B) for `variant`, if the bench timed it.
fn our_median(rows: &[Row], d: usize, v: usize, b: usize, variant: &str) -> Option<f64> {
    rows.iter().find(|r| r.dim == d && r.vocab == v && r.batch == b && r.variant == variant).map(|r| r.timing.median_us)
}

/// The peers' median at (D, V, B) for `variant`, if the script timed it.
fn peer_median(peers: &[PeerTiming], d: usize, v: usize, b: usize, variant: &str) -> Option<f64> {
    peers.iter().find(|p| p.dim == d && p.vocab == v && p.batch == b && p.variant == variant).map(|p| p.median_us)
}

/// The report: per (shape, B), ours and the peers with ratios to cuBLAS GEMM-only, as the
/// peers' script timed it and, when the bench ran it too, as timed in the bench; for the first
/// module of the run, then a table for each other module.
pub fn report(rows: &[Row], peers: &[PeerTiming], dtype: DType) -> String {
    let Some(primary) = rows.first().map(|r| r.module) else { return String::from("no timings\n") };
    let of = |module: Module| rows.iter().filter(|r| r.module == module).cloned().collect::<Vec<Row>>();
    let primary_rows = of(primary);
    let mut out = format!("{} module:\n\n", primary.name());
    out.push_str(&primary_table(&primary_rows, peers, dtype));
    out.push_str(&processing_table(&primary_rows, peers));
    out.push_str(&listed_table(&primary_rows));
    out.push_str(&flashinfer_table(&primary_rows, peers));
    out.push_str(&verification_table(&primary_rows, peers));
    for module in Module::ALL.into_iter().filter(|&m| m != primary) {
        let module_rows = of(module);
        if !module_rows.is_empty() {
            out.push_str(&module_table(module, &module_rows, &primary_rows));
        }
    }
    out.push_str(&tensor_rates(rows));
    out
}

/// The (D, V) shapes the rows time, in their first order, each once (the `mma.sync` peak
/// probe's row has none).
fn shapes_of(rows: &[Row]) -> Vec<(usize, usize)> {
    let mut shapes = Vec::new();
    for r in rows.iter().filter(|r| r.variant != "mma_peak") {
        if !shapes.contains(&(r.dim, r.vocab)) {
            shapes.push((r.dim, r.vocab));
        }
    }
    shapes
}

/// Each module's `mma.sync` peak probe and, at each shape's largest B, the rate of fused
/// greedy decoding and sampling (2·B·V·D operations over their time) against it.
fn tensor_rates(rows: &[Row]) -> String {
    let mut out = String::new();
    for module in Module::ALL {
        let of_module = |variant: &'static str| rows.iter().filter(move |r| r.module == module && r.variant == variant);
        let Some(peak) = of_module("mma_peak").next() else { continue };
        let peak_tflops = MMA_PEAK_FLOPS as f64 / (peak.timing.median_us * 1e-6) / 1e12;
        writeln!(
            out,
            "\n{} module: mma.sync peak probe {peak_tflops:.0} TFLOP/s (bf16 m16n8k16, f32 accumulators)",
            module.name()
        )
        .unwrap();
        let largest = |d: usize, v: usize| {
            of_module("fused_sample").filter(|r| (r.dim, r.vocab) == (d, v)).map(|r| r.batch).max()
        };
        for (d, v) in shapes_of(rows) {
            let Some(b) = largest(d, v) else { continue };
            let flops = 2.0 * (b * v * d) as f64;
            let rate = |variant: &'static str| {
                of_module(variant)
                    .find(|r| (r.dim, r.vocab, r.batch) == (d, v, b))
                    .map(|r| flops / (r.timing.median_us * 1e-6) / 1e12)
            };
            if let (Some(greedy), Some(sample)) = (rate("fused_greedy"), rate("fused_sample")) {
                writeln!(
                    out,
                    "  D = {d}, V = {v}, B = {b}: greedy {greedy:.0} TFLOP/s ({:.1} % of the probe), sample {sample:.0} TFLOP/s ({:.1} %)",
                    100.0 * greedy / peak_tflops,
                    100.0 * sample / peak_tflops
                )
                .unwrap();
            }
        }
    }
    out
}

/// The first module's `processed_plain` rows, one per (shape, B) that timed processing (the
/// tables' lookups find the first module's rows first).
fn first_module_processing(rows: &[Row]) -> impl Iterator<Item = &Row> {
    let first = rows.first().map(|r| r.module);
    rows.iter().filter(move |r| r.variant == "processed_plain" && Some(r.module) == first)
}

/// Processed sampling per mode (µs) beside plain fused sampling and torch's unfused
/// pipelines of the same run, when the bench timed it.
fn processing_table(rows: &[Row], peers: &[PeerTiming]) -> String {
    if !rows.iter().any(|r| r.variant.starts_with("processed_")) {
        return String::new();
    }
    let show = |x: Option<f64>| x.map(|v| format!("{v:.1}")).unwrap_or_else(|| "-".into());
    let torch = ["torch_sample", "torch_top_k", "torch_top_p", "torch_min_p"];
    let mut out = String::from(
        "\nProcessed sampling, µs (per-entry modes and log-probabilities fused; top-k from the tiles' lists and min-p from their chains where the plan takes them, top-p alone on materialised logits):\n\n| D | V | B | fused sample |",
    );
    for (label, _) in PROCESSING_MODES {
        write!(out, " {label} |").unwrap();
    }
    for name in torch {
        write!(out, " {name} |").unwrap();
    }
    writeln!(out, "\n|{}", "---|".repeat(4 + PROCESSING_MODES.len() + torch.len())).unwrap();
    for r in first_module_processing(rows) {
        let (d, v, b) = (r.dim, r.vocab, r.batch);
        write!(out, "| {d} | {v} | {b} | {} |", show(our_median(rows, d, v, b, "fused_sample"))).unwrap();
        for (label, _) in PROCESSING_MODES {
            write!(out, " {} |", show(our_median(rows, d, v, b, &format!("processed_{label}")))).unwrap();
        }
        for name in torch {
            write!(out, " {} |", show(peer_median(peers, d, v, b, name))).unwrap();
        }
        out.push('\n');
    }
    out
}

/// The listed modes on the listed path (what the plan picks) and on materialised logits, per
/// (shape, B), when the bench timed both.
fn listed_table(rows: &[Row]) -> String {
    if !rows.iter().any(|r| r.variant.ends_with(MATERIALISED)) {
        return String::new();
    }
    let show = |x: Option<f64>| x.map(|v| format!("{v:.1}")).unwrap_or_else(|| "-".into());
    let mut out = String::from(
        "\nTruncations as the plan runs them (listed where it applies) and on materialised logits (the same rows with lists and chains off), µs:\n\n| D | V | B | mode | planned | materialised | planned / materialised |\n|---|---|---|---|---|---|---|\n",
    );
    for r in first_module_processing(rows) {
        let (d, v, b) = (r.dim, r.vocab, r.batch);
        for mode in LISTED_MODES {
            let planned = our_median(rows, d, v, b, &format!("processed_{mode}"));
            let materialised = our_median(rows, d, v, b, &format!("processed_{mode}{MATERIALISED}"));
            let ratio = match (planned, materialised) {
                (Some(a), Some(b)) => format!("{:.3}", a / b),
                _ => "-".into(),
            };
            writeln!(out, "| {d} | {v} | {b} | {mode} | {} | {} | {ratio} |", show(planned), show(materialised))
                .unwrap();
        }
    }
    out
}

/// Our sampling and truncations against FlashInfer's pipeline at the same settings (rows
/// `fi_<mode>` of its CSV), when both were timed.
const AGAINST_FLASHINFER: [(&str, &str); 5] = [
    ("sample", "fused_sample"),
    ("min_p", "processed_min_p"),
    ("top_k", "processed_top_k"),
    ("top_p", "processed_top_p"),
    ("top_k_top_p", "processed_top_k_top_p"),
];

/// Per (shape, B) and mode: our µs, FlashInfer's whole pipeline and its part after the
/// logits, and our time over its pipeline's.
fn flashinfer_table(rows: &[Row], peers: &[PeerTiming]) -> String {
    if !peers.iter().any(|p| p.variant.starts_with("fi_")) {
        return String::new();
    }
    let show = |x: Option<f64>| x.map(|v| format!("{v:.1}")).unwrap_or_else(|| "-".into());
    let mut out = String::from(
        "\nAgainst FlashInfer (torch's GEMM into f32 logits, FlashInfer's softmax and sampling kernel), µs:\n\n| D | V | B | mode | ours | FlashInfer | FlashInfer after the logits | ours / FlashInfer |\n|---|---|---|---|---|---|---|---|\n",
    );
    let mut points: Vec<(usize, usize, usize)> =
        peers.iter().filter(|p| p.variant.starts_with("fi_")).map(|p| (p.dim, p.vocab, p.batch)).collect();
    points.sort_unstable();
    points.dedup();
    for (d, v, b) in points {
        for (mode, ours) in AGAINST_FLASHINFER {
            let (ours, theirs) = (our_median(rows, d, v, b, ours), peer_median(peers, d, v, b, &format!("fi_{mode}")));
            let after = peer_median(peers, d, v, b, &format!("fi_{mode}_after_logits"));
            let ratio = match (ours, theirs) {
                (Some(a), Some(b)) => format!("{:.3}", a / b),
                _ => "-".into(),
            };
            writeln!(
                out,
                "| {d} | {v} | {b} | {mode} | {} | {} | {} | {ratio} |",
                show(ours),
                show(theirs),
                show(after)
            )
            .unwrap();
        }
    }
    out
}

/// Speculative verification per (shape, S sequences, k drafts): ours, plain sampling of the
/// same `S · (k + 1)` rows, and torch's rejection-sampling verifier (`torch_verify_k<k>` from
/// `scripts/peers.py --verification`), when the bench timed it.
fn verification_table(rows: &[Row], peers: &[PeerTiming]) -> String {
    if !rows.iter().any(|r| r.variant.starts_with("verify_k")) {
        return String::new();
    }
    let show = |x: Option<f64>| x.map(|v| format!("{v:.1}")).unwrap_or_else(|| "-".into());
    let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) => format!("{:.3}", a / b),
        _ => "-".into(),
    };
    let mut out = String::from(
        "\nSpeculative verification, µs (S sequences of k drafts: S · (k + 1) rows):\n\n| D | V | S | k | verify | plain, same rows | verify / plain | torch rejection sampling | verify / torch |\n|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in rows.iter().filter(|r| r.variant.starts_with("verify_k")) {
        let (d, v, s) = (r.dim, r.vocab, r.batch);
        let k = &r.variant["verify_k".len()..];
        let ours = Some(r.timing.median_us);
        let plain = our_median(rows, d, v, s, &format!("plain_k{k}"));
        let torch = peer_median(peers, d, v, s, &format!("torch_verify_k{k}"));
        writeln!(
            out,
            "| {d} | {v} | {s} | {k} | {} | {} | {} | {} | {} |",
            show(ours),
            show(plain),
            ratio(ours, plain),
            show(torch),
            ratio(ours, torch)
        )
        .unwrap();
    }
    out
}

/// Another module's fused sampling beside the first module's cuBLAS reference and its own
/// read floor (the read probe is the same kernel in every module).
fn module_table(module: Module, rows: &[Row], primary_rows: &[Row]) -> String {
    let show = |x: Option<f64>| x.map(|v| format!("{v:.1}")).unwrap_or_else(|| "-".into());
    let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) => format!("{:.3}", a / b),
        _ => "-".into(),
    };
    let mut out = format!(
        "\n{} module:\n\n| D | V | B | fused sample µs | fused greedy µs | unfused µs | cuBLAS in bench µs | sample/cuBLAS in bench | % of read floor |\n|---|---|---|---|---|---|---|---|---|\n",
        module.name()
    );
    for r in rows.iter().filter(|r| r.variant == "fused_sample") {
        let (d, v, b) = (r.dim, r.vocab, r.batch);
        let sample = Some(r.timing.median_us);
        let cublas = our_median(primary_rows, d, v, b, "cublas_gemm");
        let floor = our_median(rows, d, v, 0, "read_floor");
        writeln!(
            out,
            "| {d} | {v} | {b} | {} | {} | {} | {} | {} | {} |",
            show(sample),
            show(our_median(rows, d, v, b, "fused_greedy")),
            show(our_median(rows, d, v, b, "unfused_sample")),
            show(cublas),
            ratio(sample, cublas),
            floor.map(|f| format!("{:.1}", 100.0 * f / r.timing.median_us)).unwrap_or_else(|| "-".into()),
        )
        .unwrap();
    }
    out
}

fn primary_table(rows: &[Row], peers: &[PeerTiming], dtype: DType) -> String {
    let ours = |d: usize, v: usize, b: usize, name: &str| our_median(rows, d, v, b, name);
    let peer = |d: usize, v: usize, b: usize, name: &str| peer_median(peers, d, v, b, name);
    let show = |x: Option<f64>| x.map(|v| format!("{v:.1}")).unwrap_or_else(|| "-".into());
    let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) => format!("{:.3}", a / b),
        _ => "-".into(),
    };
    let mut out = String::new();
    writeln!(out, "| D | V | B | fused sample µs | fused greedy µs | unfused µs | cuBLAS µs | cuBLAS in bench µs | torch sample µs | sample/cuBLAS | sample/cuBLAS in bench | sample/greedy | % of read floor |").unwrap();
    writeln!(out, "|---|---|---|---|---|---|---|---|---|---|---|---|---|").unwrap();
    let shapes = shapes_of(rows);
    for (d, v) in shapes {
        let floor = ours(d, v, 0, "read_floor");
        // The batches this table times (a verification run's rows are tabled apart), each once.
        let headline = ["fused_sample", "fused_greedy", "unfused_sample", "cublas_gemm"];
        let mut batches: Vec<usize> = rows
            .iter()
            .filter(|r| r.dim == d && r.vocab == v && r.batch > 0 && headline.contains(&r.variant.as_str()))
            .map(|r| r.batch)
            .collect();
        batches.sort_unstable();
        batches.dedup();
        for b in batches {
            let sample = ours(d, v, b, "fused_sample");
            let cublas = peer(d, v, b, "cublas_gemm");
            let cublas_in_bench = ours(d, v, b, "cublas_gemm");
            writeln!(
                out,
                "| {d} | {v} | {b} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                show(sample),
                show(ours(d, v, b, "fused_greedy")),
                show(ours(d, v, b, "unfused_sample")),
                show(cublas),
                show(cublas_in_bench),
                show(peer(d, v, b, "torch_sample")),
                ratio(sample, cublas),
                ratio(sample, cublas_in_bench),
                ratio(sample, ours(d, v, b, "fused_greedy")),
                match (floor, sample) {
                    (Some(f), Some(s)) => format!("{:.1}", 100.0 * f / s),
                    _ => "-".into(),
                }
            )
            .unwrap();
        }
        if let Some(f) = floor {
            let gbps = (d * v * dtype.bytes()) as f64 / (f * 1e-6) / 1e9;
            writeln!(out, "| {d} | {v} | read floor | {f:.1} µs = {gbps:.0} GB/s over W | | | | | | | | | |").unwrap();
        }
    }
    if dtype == DType::BF16 {
        out.push_str(&targets_table(rows, peers));
    }
    out.push_str(&variants_table(rows));
    out
}

/// The project's speed targets for fused sampling (bf16): at most this many times cuBLAS's GEMM alone,
/// up to [`SMALL_BATCH`] rows.
const CUBLAS_TARGET_SMALL_BATCH: f64 = 1.03;
/// The same above [`SMALL_BATCH`] rows.
const CUBLAS_TARGET_LARGE_BATCH: f64 = 1.10;
/// The largest B of the small-batch targets (cuBLAS and the read floor).
const SMALL_BATCH: usize = 16;
/// Fused sampling at most this many times fused greedy decoding, at every B.
const GREEDY_TARGET: f64 = 1.05;
/// Up to [`SMALL_BATCH`] rows, at least this share of the read floor over `W`.
const READ_FLOOR_TARGET: f64 = 0.90;

/// The cuBLAS target at batch `b`.
fn cublas_target(b: usize) -> f64 {
    if b <= SMALL_BATCH { CUBLAS_TARGET_SMALL_BATCH } else { CUBLAS_TARGET_LARGE_BATCH }
}

/// Per point, each target that fused sampling misses and by how much (a ratio that could not
/// be formed, for want of a timing, is not judged).
fn targets_table(rows: &[Row], peers: &[PeerTiming]) -> String {
    let over = |ratio: f64, target: f64| (ratio > target).then(|| format!("+{:.1} %", 100.0 * (ratio / target - 1.0)));
    let (small, large) = (CUBLAS_TARGET_SMALL_BATCH, CUBLAS_TARGET_LARGE_BATCH);
    let floor_percent = 100.0 * READ_FLOOR_TARGET;
    let mut out = format!(
        "\nTargets (bf16, set for D × V = 4096 × 151936 and 8192 × 128256): sample ≤ {small:.2}× \
         cuBLAS at B ≤ {SMALL_BATCH} and ≤ {large:.2}× above, ≤ {GREEDY_TARGET:.2}× greedy, ≥ {floor_percent:.0} % \
         of the read floor at B ≤ {SMALL_BATCH}. Misses, by how much over the target (what bounds them: \
         docs/PERF.md):\n\n| D | V | B | missed |\n|---|---|---|---|\n",
    );
    for r in rows.iter().filter(|r| r.variant == "fused_sample") {
        let (d, v, b, sample) = (r.dim, r.vocab, r.batch, r.timing.median_us);
        let mut missed = Vec::new();
        if let Some(c) = peer_median(peers, d, v, b, "cublas_gemm") {
            missed.extend(over(sample / c, cublas_target(b)).map(|m| format!("cuBLAS {m}")));
        }
        if let Some(c) = our_median(rows, d, v, b, "cublas_gemm") {
            missed.extend(over(sample / c, cublas_target(b)).map(|m| format!("cuBLAS in bench {m}")));
        }
        if let Some(g) = our_median(rows, d, v, b, "fused_greedy") {
            missed.extend(over(sample / g, GREEDY_TARGET).map(|m| format!("greedy {m}")));
        }
        if let (true, Some(floor)) = (b <= SMALL_BATCH, our_median(rows, d, v, 0, "read_floor")) {
            let share = floor / sample;
            if share < READ_FLOOR_TARGET {
                missed.push(format!("read floor {:.1} % < {floor_percent:.0} %", 100.0 * share));
            }
        }
        let missed = if missed.is_empty() { "all met".to_string() } else { missed.join(", ") };
        writeln!(out, "| {d} | {v} | {b} | {missed} |").unwrap();
    }
    out
}

/// With `--all-variants`: per point, the dispatched time beside the fastest forced variant.
fn variants_table(rows: &[Row]) -> String {
    let mut out = String::new();
    let points: Vec<(usize, usize, usize, f64)> = rows
        .iter()
        .filter(|r| r.variant == "fused_sample")
        .map(|r| (r.dim, r.vocab, r.batch, r.timing.median_us))
        .collect();
    for (d, v, b, dispatched) in points {
        let fastest = rows
            .iter()
            .filter(|r| r.dim == d && r.vocab == v && r.batch == b)
            .filter_map(|r| r.variant.strip_prefix("fused_sample@").map(|name| (name, r.timing.median_us)))
            .min_by(|x, y| x.1.total_cmp(&y.1));
        if let Some((name, us)) = fastest {
            if out.is_empty() {
                out.push_str(
                    "\n| D | V | B | dispatched µs | fastest forced variant | its µs | dispatched / fastest |\n",
                );
                out.push_str("|---|---|---|---|---|---|---|\n");
            }
            writeln!(out, "| {d} | {v} | {b} | {dispatched:.1} | {name} | {us:.1} | {:.3} |", dispatched / us).unwrap();
        }
    }
    out
}

/// Time against B per shape (log-log), ours beside cuBLAS and the read floor.
pub fn plot(path: &Path, rows: &[Row], peers: &[PeerTiming]) -> Result<()> {
    use plotters::prelude::*;
    // DejaVu Sans (Bitstream Vera license, `cli/assets/DejaVuSans.LICENSE`), embedded so the
    // plot needs no system font.
    static FONT: &[u8] = include_bytes!("../assets/DejaVuSans.ttf");
    plotters::style::register_font("sans-serif", FontStyle::Normal, FONT)
        .map_err(|_| file_error(path, "the embedded font is invalid"))?;
    let shapes = shapes_of(rows);
    let primary = rows.first().map(|r| r.module);
    let root = BitMapBackend::new(path, (640 * shapes.len().min(2) as u32, 480 * shapes.len().div_ceil(2) as u32))
        .into_drawing_area();
    root.fill(&WHITE).map_err(|e| file_error(path, e))?;
    let panels = root.split_evenly((shapes.len().div_ceil(2), shapes.len().min(2)));
    for ((d, v), panel) in shapes.iter().zip(panels.iter()) {
        type Series = (String, Vec<(f64, f64)>, RGBColor);
        let mut series: Vec<Series> = Vec::new();
        for (name, label, color) in [
            ("fused_sample", "fused_sample", RED),
            ("fused_greedy", "fused_greedy", MAGENTA),
            ("unfused_sample", "unfused_sample", BLUE),
            ("cublas_gemm", "cublas_gemm in bench", RGBColor(128, 128, 128)),
        ] {
            let points = rows
                .iter()
                .filter(|r| r.dim == *d && r.vocab == *v && r.variant == name && Some(r.module) == primary)
                .map(|r| (r.batch as f64, r.timing.median_us))
                .collect();
            series.push((label.to_string(), points, color));
        }
        for module in Module::ALL.into_iter().filter(|&m| Some(m) != primary) {
            let points = rows
                .iter()
                .filter(|r| r.dim == *d && r.vocab == *v && r.variant == "fused_sample" && r.module == module)
                .map(|r| (r.batch as f64, r.timing.median_us))
                .collect();
            series.push((format!("fused_sample ({} module)", module.name()), points, RGBColor(230, 140, 0)));
        }
        for (name, color) in [("cublas_gemm", BLACK), ("torch_sample", GREEN)] {
            let points = peers
                .iter()
                .filter(|p| p.dim == *d && p.vocab == *v && p.variant == name)
                .map(|p| (p.batch as f64, p.median_us))
                .collect();
            series.push((name.to_string(), points, color));
        }
        let floor = rows
            .iter()
            .find(|r| r.dim == *d && r.vocab == *v && r.variant == "read_floor" && Some(r.module) == primary)
            .map(|r| r.timing.median_us);
        let all: Vec<f64> = series.iter().flat_map(|s| s.1.iter().map(|p| p.1)).chain(floor).collect();
        let (low, high) = all.iter().fold((f64::MAX, 0.0f64), |(l, h), &x| (l.min(x), h.max(x)));
        let max_b = series.iter().flat_map(|s| s.1.iter().map(|p| p.0)).fold(1.0, f64::max);
        let mut chart = ChartBuilder::on(panel)
            .caption(format!("D={d}, V={v}"), ("sans-serif", 20))
            .margin(10)
            .x_label_area_size(35)
            .y_label_area_size(55)
            .build_cartesian_2d((1.0..max_b * 1.1).log_scale(), (low * 0.8..high * 1.2).log_scale())
            .map_err(|e| file_error(path, e))?;
        chart.configure_mesh().x_desc("batch B").y_desc("µs (median)").draw().map_err(|e| file_error(path, e))?;
        for (name, points, color) in series.into_iter().filter(|s| !s.1.is_empty()) {
            chart
                .draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))
                .map_err(|e| file_error(path, e))?
                .label(name)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 15, y)], color.stroke_width(3)));
            chart
                .draw_series(points.iter().map(|&p| Circle::new(p, 3, color.filled())))
                .map_err(|e| file_error(path, e))?;
        }
        if let Some(f) = floor {
            chart
                .draw_series(LineSeries::new(vec![(1.0, f), (max_b, f)], BLACK.mix(0.4)))
                .map_err(|e| file_error(path, e))?
                .label("read floor (W once)")
                .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 15, y)], BLACK.mix(0.4)));
        }
        chart
            .configure_series_labels()
            // Upper left: the curves rise to the right, where B = 256 would hide behind it.
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .map_err(|e| file_error(path, e))?;
    }
    root.present().map_err(|e| file_error(path, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(batch: usize, variant: &str, us: f64) -> Row {
        Row {
            module: Module::Hopper,
            dim: 64,
            vocab: 1000,
            batch,
            variant: variant.into(),
            timing: Timing { median_us: us, min_us: us, max_us: us, runs: 1 },
        }
    }

    /// Verification sits beside plain sampling of the same rows and torch's verifier.
    #[test]
    fn the_report_sets_verification_beside_plain_rows_and_torch() {
        let rows = vec![row(16, "verify_k3", 460.0), row(16, "plain_k3", 450.0)];
        let torch = PeerTiming { dim: 64, vocab: 1000, batch: 16, variant: "torch_verify_k3".into(), median_us: 920.0 };
        let text = verification_table(&rows, &[torch]);
        assert!(text.contains("| 64 | 1000 | 16 | 3 | 460.0 | 450.0 | 1.022 | 920.0 | 0.500 |"), "{text}");
        assert!(verification_table(&rows[1..], &[]).is_empty());
    }

    /// A verification run's batches stay out of the headline table, and a batch timed by
    /// several variants has one line.
    #[test]
    fn the_headline_table_lists_each_timed_batch_once_and_no_verification_batch() {
        let rows = vec![
            row(1, "fused_sample", 440.0),
            row(1, "verify_k1", 441.0),
            row(16, "verify_k1", 445.0),
            row(64, "plain_k7", 1085.0),
            row(1, "fused_greedy", 439.0),
        ];
        let report = report(&rows, &[], DType::BF16);
        let table = &report[..report.find("Targets").expect("the targets follow the table")];
        let lines: Vec<&str> = table.lines().filter(|l| l.starts_with("| 64 | 1000 |")).collect();
        assert_eq!(lines.len(), 1, "{report}");
        assert!(lines[0].starts_with("| 64 | 1000 | 1 | 440.0 | 439.0 |"), "{report}");
    }

    /// The `mma.sync` peak probe's row (no shape) splits no shape's table in two, and the
    /// report reads the largest B's rate against the probe: 2·B·V·D operations over the time.
    #[test]
    fn the_peak_probe_row_leaves_the_shapes_whole_and_rates_the_largest_batch() {
        let other = |dim, vocab, batch, variant: &str, us| Row { dim, vocab, ..row(batch, variant, us) };
        let flops_us = MMA_PEAK_FLOPS as f64 / 500e12 * 1e6;
        let rows = vec![
            row(0, "read_floor", 10.0),
            other(0, 0, 0, "mma_peak", flops_us),
            row(16, "fused_sample", 440.0),
            other(128, 1000, 16, "fused_sample", 880.0),
            row(256, "fused_sample", 2.0 * 256.0 * 1000.0 * 64.0 / 100e12 * 1e6),
            row(256, "fused_greedy", 2.0 * 256.0 * 1000.0 * 64.0 / 250e12 * 1e6),
            row(16, "fused_sample", 441.0),
        ];
        assert_eq!(shapes_of(&rows), vec![(64, 1000), (128, 1000)]);
        let text = tensor_rates(&rows);
        assert!(text.contains("mma.sync peak probe 500 TFLOP/s"), "{text}");
        assert!(
            text.contains(
                "D = 64, V = 1000, B = 256: greedy 250 TFLOP/s (50.0 % of the probe), sample 100 TFLOP/s (20.0 %)"
            ),
            "{text}"
        );
    }

    /// FlashInfer's rows sit beside ours per mode, with our time over its pipeline's.
    #[test]
    fn the_report_sets_flashinfer_beside_our_truncations() {
        let rows = vec![row(16, "fused_sample", 440.0), row(16, "processed_top_k", 552.0)];
        let fi = |variant: &str, us: f64| PeerTiming {
            dim: 64,
            vocab: 1000,
            batch: 16,
            variant: variant.into(),
            median_us: us,
        };
        let peers = vec![fi("fi_top_k", 733.0), fi("fi_top_k_after_logits", 250.0), fi("fi_top_p", 536.0)];
        let text = flashinfer_table(&rows, &peers);
        assert!(text.contains("| 64 | 1000 | 16 | top_k | 552.0 | 733.0 | 250.0 | 0.753 |"), "{text}");
        assert!(text.contains("| 64 | 1000 | 16 | top_p | - | 536.0 | - | - |"), "{text}");
        assert!(text.contains("| 64 | 1000 | 16 | sample | 440.0 | - | - | - |"), "{text}");
        assert!(flashinfer_table(&rows, &[]).is_empty());
    }

    /// A written CSV reads back to the same points.
    #[test]
    fn csv_round_trips() {
        let rows = vec![row(0, "read_floor", 10.0), row(8, "fused_sample@tma_m64_n8", 13.25)];
        let path = std::env::temp_dir().join(format!("flashsample-csv-{}.csv", std::process::id()));
        write_csv(&path, &rows, DType::BF16).unwrap();
        let back = read_csv(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(back.len(), 2);
        assert_eq!(
            (back[1].batch, back[1].variant.as_str(), back[1].timing.median_us),
            (8, "fused_sample@tma_m64_n8", 13.25)
        );
    }

    /// The plot renders with the embedded font alone, and the report lists every batch.
    #[test]
    fn plot_and_report_need_no_gpu_and_no_system_font() {
        let rows = vec![
            row(0, "read_floor", 10.0),
            row(1, "fused_sample", 12.0),
            row(1, "fused_greedy", 11.5),
            row(8, "fused_sample", 13.0),
            row(8, "fused_sample@tma_m64_n8", 13.0),
            row(8, "fused_sample@tma_m128_n16", 12.5),
            row(8, "cublas_gemm", 12.0),
        ];
        let peers = vec![PeerTiming { dim: 64, vocab: 1000, batch: 1, variant: "cublas_gemm".into(), median_us: 11.0 }];
        let path = std::env::temp_dir().join(format!("flashsample-plot-{}.png", std::process::id()));
        plot(&path, &rows, &peers).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(&bytes[1..4], b"PNG");
        let text = report(&rows, &peers, DType::BF16);
        assert!(
            text.contains("| 64 | 1000 | 1 | 12.0 | 11.5 |") && text.contains("| 64 | 1000 | 8 | 13.0 |"),
            "{text}"
        );
        assert!(text.contains("1.091"), "sample/cuBLAS ratio 12/11 missing: {text}");
        assert!(text.contains("| 12.0 | - | - | 1.083 |"), "in-bench cuBLAS and its ratio 13/12 missing: {text}");
        assert!(text.contains("| 64 | 1000 | 8 | 13.0 | tma_m128_n16 | 12.5 | 1.040 |"), "variants table: {text}");
        // B = 1: 12 / 11 = 1.091 is 5.9 % over 1.03, 12 / 11.5 = 1.043 meets 1.05, and the
        // floor share 10 / 12 = 83.3 % misses 90 %; B = 8: 13 / 12 = 1.083 is 5.2 % over 1.03
        // and 10 / 13 = 76.9 % misses 90 %.
        assert!(text.contains("| 64 | 1000 | 1 | cuBLAS +5.9 %, read floor 83.3 % < 90 % |"), "targets: {text}");
        assert!(
            text.contains("| 64 | 1000 | 8 | cuBLAS in bench +5.2 %, read floor 76.9 % < 90 % |"),
            "targets: {text}"
        );
        assert!(!report(&rows, &peers, DType::F16).contains("Targets"), "the targets are set for bf16 only");
    }

    /// A second module's rows get a table of their own, against the first module's cuBLAS
    /// and their own read floor; a CSV written with them reads back with their module.
    #[test]
    fn other_modules_get_their_own_table() {
        let portable = |batch, variant: &str, us| Row { module: Module::Portable, ..row(batch, variant, us) };
        let rows = vec![
            row(0, "read_floor", 10.0),
            row(1, "cublas_gemm", 12.0),
            row(1, "fused_sample", 11.0),
            portable(0, "read_floor", 10.0),
            portable(1, "fused_sample", 10.5),
            portable(1, "fused_greedy", 10.4),
        ];
        let text = report(&rows, &[], DType::BF16);
        assert!(text.contains("portable module:"), "{text}");
        assert!(text.contains("| 64 | 1000 | 1 | 10.5 | 10.4 | - | 12.0 | 0.875 | 95.2 |"), "{text}");
        let path = std::env::temp_dir().join(format!("flashsample-modules-{}.csv", std::process::id()));
        write_csv(&path, &rows, DType::BF16).unwrap();
        let back = read_csv(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(back.iter().filter(|r| r.module == Module::Portable).count(), 3);
    }
}
