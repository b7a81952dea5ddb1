//! `flashsample`: sample tokens from an LM head and hidden states, run the demo, benchmark.

mod bench;
#[cfg(feature = "nccl")]
mod bench_tp;
mod cublas;
mod host_cost;
mod output;
mod processing;
mod timing;

use std::ffi::OsString;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::{Args, Parser, Subcommand, ValueEnum};
use flashsample::internals::{Variant, draw, logits_row, row_params};
use flashsample::{
    Batch, CpuSampler, CudaSampler, DType, Draws, Elements, Error, Matrix, Module, Processing, Result, Sampled,
    Sampler, SamplingParams, VocabShard, cuda_device_count,
};
use flashsample_cli::io::{NpyType, NpyWriter, load_matrix};
use flashsample_cli::stats::{chi_square, exact_probabilities};
use indicatif::{ProgressBar, ProgressFinish, ProgressStyle};
use rand::{Rng, SeedableRng};
use timing::Timer;

#[derive(Parser)]
#[command(name = "flashsample", version, about = "Exact token sampling fused into the LM-head matmul (Gumbel-max)")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum DeviceKind {
    /// The GPU if one is usable, else the CPU (one line on standard error says which).
    Auto,
    Cuda,
    Cpu,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum ModuleArg {
    Portable,
    Hopper,
}

impl From<ModuleArg> for Module {
    fn from(m: ModuleArg) -> Module {
        match m {
            ModuleArg::Portable => Module::Portable,
            ModuleArg::Hopper => Module::Hopper,
        }
    }
}

#[derive(Subcommand)]
enum Command {
    /// Draw N tokens per row from softmax(H·Wᵀ / T) and write them as int64 .npy [B, N].
    Sample(Box<SampleArgs>),
    /// Show what flashsample does: on a GPU, sample a synthetic LM head of a real model's shape,
    /// check it against the CPU and time it; without one, check a small head's draws against
    /// the exact softmax on the CPU.
    Demo {
        #[arg(long, value_enum, default_value = "auto")]
        device: DeviceKind,
        /// Which GPU (the driver's ordinal).
        #[arg(long, default_value_t = 0)]
        gpu: i64,
    },
    /// Time fused sampling, fused greedy, the unfused pipeline and the read floor on the GPU.
    Bench {
        /// Folder for bench.csv, bench.png and report.md.
        #[arg(long)]
        out: PathBuf,
        /// Which GPU (the driver's ordinal).
        #[arg(long, default_value_t = 0)]
        gpu: i64,
        /// PTX modules to time, each on a sampler of its own (e.g. hopper,portable); the
        /// first also times cuBLAS and the forced variants. Default: the device's module.
        #[arg(long, value_enum, value_delimiter = ',')]
        modules: Vec<ModuleArg>,
        /// Shapes as DxV, comma separated.
        #[arg(long, value_delimiter = ',', default_value = "4096x151936,8192x128256,4096x128256,2880x201088")]
        shapes: Vec<String>,
        #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16,32,64,128,256")]
        batches: Vec<usize>,
        #[arg(long, value_enum, default_value = "bf16")]
        dtype: DTypeArg,
        #[arg(long, default_value_t = 5)]
        warmup: usize,
        /// Timed runs per point; the median is reported.
        #[arg(long, default_value_t = 50)]
        runs: usize,
        /// CSV from scripts/peers.py (cuBLAS and torch in the same GPU run) for the report.
        #[arg(long)]
        peers: Option<PathBuf>,
        /// CSV from FlashInfer's benchmark in the same GPU run (`d,v,b,impl,median_us`, rows
        /// `fi_<mode>`: torch's GEMM into f32 logits, FlashInfer's softmax and its sampling
        /// kernel, the pipeline vLLM runs), shown beside processed sampling.
        #[arg(long)]
        flashinfer: Option<PathBuf>,
        /// Also time fused sampling and greedy decoding with every tensor-core kernel variant
        /// (CSV rows `fused_sample@<variant>`, `fused_greedy@<variant>`), to check the
        /// dispatcher.
        #[arg(long)]
        all_variants: bool,
        /// Also time cuBLAS's GEMM (`x @ Wᵀ`, bf16/f16) in this process, right before our
        /// kernels at each point, so both run under the same clocks (CSV rows `cublas_gemm`).
        /// cuBLAS is opened at run time from the loader's path (LD_LIBRARY_PATH), e.g. the
        /// copy torch ships.
        #[arg(long)]
        cublas: bool,
        /// Also time processed sampling with each processing mode on every module (CSV rows
        /// `processed_<mode>`; see `bench::PROCESSING_MODES`; the report shows the first's).
        #[arg(long)]
        processing: bool,
        /// Also time speculative verification of 1, 3 and 7 drafts for 1, 16 and 64
        /// sequences on the first module, beside plain sampling of as many rows (CSV rows
        /// `verify_k<k>`, `plain_k<k>`, B the sequences).
        #[arg(long)]
        verification: bool,
    },
    /// Time tensor-parallel sampling over 1, 2, 4, 8 GPUs of this machine (NCCL): the step,
    /// its phases and the all-gather's share, with and without log-probabilities, beside one
    /// GPU's fused sampling; writes tp.csv and tp-report.md.
    #[cfg(feature = "nccl")]
    BenchTp {
        /// Folder for tp.csv and tp-report.md.
        #[arg(long)]
        out: PathBuf,
        /// GPU counts (counts above the machine's are skipped).
        #[arg(long, value_delimiter = ',', default_value = "1,2,4,8")]
        gpus: Vec<usize>,
        /// Shapes as DxV, comma separated.
        #[arg(long, value_delimiter = ',', default_value = "4096x151936,8192x128256")]
        shapes: Vec<String>,
        #[arg(long, value_delimiter = ',', default_value = "1,16,64,256")]
        batches: Vec<usize>,
        #[arg(long, value_enum, default_value = "bf16")]
        dtype: DTypeArg,
        #[arg(long, default_value_t = 5)]
        warmup: usize,
        /// Timed steps per point; the median is reported.
        #[arg(long, default_value_t = 30)]
        runs: usize,
        /// CSV from scripts/tp_peers.py (torch's all-gather of logits, then sample) for the
        /// report.
        #[arg(long)]
        peers: Option<PathBuf>,
    },
    /// Re-render report.md and bench.png from a bench run's CSVs (no GPU needed).
    Report {
        /// bench.csv written by `flashsample bench`.
        #[arg(long)]
        bench: PathBuf,
        /// peers.csv from scripts/peers.py.
        #[arg(long)]
        peers: Option<PathBuf>,
        /// FlashInfer's CSV, as `bench --flashinfer` takes it.
        #[arg(long)]
        flashinfer: Option<PathBuf>,
        /// Folder for report.md and bench.png.
        #[arg(long)]
        out: PathBuf,
        #[arg(long, value_enum, default_value = "bf16")]
        dtype: DTypeArg,
    },
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum DTypeArg {
    Bf16,
    F16,
    F32,
}

impl From<DTypeArg> for DType {
    fn from(d: DTypeArg) -> DType {
        match d {
            DTypeArg::Bf16 => DType::BF16,
            DTypeArg::F16 => DType::F16,
            DTypeArg::F32 => DType::F32,
        }
    }
}

/// The command line with every argument that is a number starting with a hyphen (`-1`, `-inf`,
/// `-nan`, `-.5`) attached to the long flag before it (`--temperature=-inf`), so that the
/// flag's rule judges it. clap would read a separate `-inf` as the short flag `-i` (its
/// `allow_negative_numbers` knows only digits), and its `allow_hyphen_values` would make a
/// flag whose value was forgotten take the next flag as its value. Nothing after `--` changes.
fn attach_negative_numbers(args: impl IntoIterator<Item = OsString>) -> Vec<OsString> {
    let mut args = args.into_iter();
    // The program's own name is never a flag.
    let mut attached: Vec<OsString> = args.next().into_iter().collect();
    let mut escaped = false;
    for arg in args {
        let number = arg.to_str().is_some_and(|a| a.starts_with('-') && a.parse::<f64>().is_ok());
        let after_flag = attached
            .last()
            .and_then(|previous| previous.to_str())
            .is_some_and(|previous| previous.len() > 2 && previous.starts_with("--") && !previous.contains('='));
        match attached.last_mut() {
            Some(flag) if number && after_flag && !escaped => {
                flag.push("=");
                flag.push(&arg);
            }
            _ => {
                escaped |= arg == "--";
                attached.push(arg);
            }
        }
    }
    attached
}

fn main() -> ExitCode {
    let cli = Cli::parse_from(attach_negative_numbers(std::env::args_os()));
    let result = match cli.command {
        Command::Sample(args) => sample(*args),
        Command::Demo { device, gpu } => gpu_flag(gpu).and_then(|gpu| demo(device, gpu)),
        Command::Report { bench, peers, flashinfer, out, dtype } => {
            report(&bench, &Peers { peers, flashinfer }, &out, dtype.into())
        }
        #[cfg(feature = "nccl")]
        Command::BenchTp { out, gpus, shapes, batches, dtype, warmup, runs, peers } => {
            parse_shapes(&shapes).and_then(|shapes| {
                let options = bench_tp::Options { gpus, shapes, batches, dtype: dtype.into(), warmup, runs };
                run_bench_tp(&out, &options, peers.as_deref())
            })
        }
        Command::Bench {
            out,
            gpu,
            modules,
            shapes,
            batches,
            dtype,
            warmup,
            runs,
            peers,
            flashinfer,
            all_variants,
            cublas,
            processing,
            verification,
        } => {
            let gpu = match gpu_flag(gpu) {
                Ok(gpu) => gpu,
                Err(e) => {
                    eprintln!("error: {e}");
                    return ExitCode::FAILURE;
                }
            };
            let options = |shapes| bench::Options {
                gpu,
                modules: modules.into_iter().map(Module::from).collect(),
                shapes,
                batches,
                dtype: dtype.into(),
                warmup,
                runs,
                all_variants,
                cublas,
                processing,
                verification,
            };
            run_bench(out, shapes, options, &Peers { peers, flashinfer })
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        // The library returns the other rows' tokens beside such rows; `sample` writes a file
        // only when every slot has a token.
        Err(e @ Error::RowsWithoutToken { .. }) => {
            eprintln!("error: {e}; nothing was written");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Checks `--gpu` against the machine's devices ([`Error::NoCudaDevice`] without any).
fn check_gpu(gpu: usize) -> Result<()> {
    let count = cuda_device_count()?;
    if gpu >= count {
        return Err(Error::InvalidArgument {
            argument: "--gpu".into(),
            rule: format!("{gpu}: this machine has {count} CUDA device(s), 0 to {}", count - 1),
        });
    }
    Ok(())
}

/// The GPU sampler `--device` and `--gpu` ask for, or `None` for the CPU. `auto` says on
/// standard error which it took; `cuda` without a usable GPU is an error that says so.
fn gpu_sampler(device: DeviceKind, gpu: usize) -> Result<Option<CudaSampler>> {
    if device == DeviceKind::Cpu {
        return Ok(None);
    }
    match (device, check_gpu(gpu).and_then(|()| CudaSampler::on_device(gpu))) {
        (_, Ok(sampler)) => {
            if device == DeviceKind::Auto {
                eprintln!("flashsample: on GPU {gpu} ({}, {} module)", sampler.device_name(), sampler.module().name());
            }
            Ok(Some(sampler))
        }
        (DeviceKind::Auto, Err(e @ (Error::NoCudaDevice(_) | Error::UnsupportedDevice { .. }))) => {
            eprintln!("flashsample: no usable GPU ({e}); on the CPU");
            Ok(None)
        }
        (_, Err(Error::NoCudaDevice(why))) => {
            Err(Error::NoCudaDevice(format!("{why}; use --device cpu to run on the CPU")))
        }
        (_, Err(e)) => Err(e),
    }
}

#[derive(Args)]
struct SampleArgs {
    /// safetensors file holding W [V, D] (F32, F16 or BF16).
    #[arg(long)]
    lm_head: PathBuf,
    /// Tensor name in --lm-head, needed when the file holds several.
    #[arg(long)]
    lm_head_tensor: Option<String>,
    /// safetensors file holding H [B, D] (F32, F16 or BF16).
    #[arg(long)]
    hidden: PathBuf,
    /// Tensor name in --hidden, needed when the file holds several.
    #[arg(long)]
    hidden_tensor: Option<String>,
    /// Draws per row, 1 to 2^32 − 1 (independent; written in passes of bounded memory).
    #[arg(long)]
    samples: i64,
    /// Seed of the noise, 0 to 2^64 − 1; row r draws from sequence r of it.
    #[arg(long)]
    seed: i128,
    /// Temperature T >= 0; 0 is greedy argmax. (A negative, infinite or NaN value is read, then
    /// rejected with the sampler's own error.)
    #[arg(long)]
    temperature: f32,
    #[arg(long, value_enum, default_value = "auto")]
    device: DeviceKind,
    /// Which GPU (the driver's ordinal; CUDA_VISIBLE_DEVICES applies).
    #[arg(long, default_value_t = 0)]
    gpu: i64,
    /// Output int64 .npy [B, N]: not an input or another output. Written as <OUT>.partial and
    /// renamed at the end of a successful run, replacing an existing file if it is writable (a
    /// read-only one is refused before any work).
    #[arg(long)]
    out: PathBuf,
    #[command(flatten)]
    processing: processing::ProcessingArgs,
}

/// Which log-probabilities of a [`Sampled`] an output file receives.
type LogColumn = fn(&Sampled) -> &[f32];

/// Tokens per sampler call while the `.npy` is written: bounds the host and device memory
/// that any `--samples` needs (64 MiB of u32 tokens).
const TOKENS_PER_CALL: usize = 1 << 24;

/// Noise entries (rows × draws × vocabulary) per CPU pass: a fraction of a second on a few
/// cores, so that the progress bar of a long run moves often.
const CPU_PASS_ENTRIES: usize = 1 << 24;

/// Draws per CPU pass over `rows` rows of a `[vocab, dim]` head, at most `per_call`: about
/// [`CPU_PASS_ENTRIES`] noise entries, but at least `dim / 2` draws, because every pass
/// recomputes the rows' logits (`dim` multiply-adds per entry, against one noise entry per
/// draw): at D = 4096, passes of D / 2 draws took 3–8 % longer in all than one pass.
fn cpu_draws_per_pass(rows: usize, vocab: usize, dim: usize, per_call: u32) -> u32 {
    let by_work = CPU_PASS_ENTRIES.div_ceil(rows.saturating_mul(vocab).max(1));
    by_work.max(dim / 2).min(per_call as usize) as u32
}

/// Draws `0 .. samples` in passes of `per_call` draws.
fn passes(samples: u32, per_call: u32) -> impl Iterator<Item = Draws> {
    (0..samples).step_by(per_call as usize).map(move |first| Draws { first, count: per_call.min(samples - first) })
}

/// A bar of the `samples` draws per row on standard error while the CPU samples, hidden unless
/// standard error is a terminal, so tests, pipes and logs see none; cleared when dropped, so
/// the summary or an error starts a clean line.
fn draws_bar(samples: u32) -> ProgressBar {
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let style = ProgressStyle::with_template("{elapsed_precise} [{wide_bar}] {pos}/{len} draws per row, {eta} left")
        .expect("valid template");
    let bar = ProgressBar::new(samples.into()).with_style(style).with_finish(ProgressFinish::AndClear);
    // A pass may take seconds: the elapsed time and the estimate move between passes.
    bar.enable_steady_tick(Duration::from_millis(500));
    bar
}

/// `value` of `flag` when it lies in `low ..= high`.
fn flag_in_range<T: Copy + PartialOrd + std::fmt::Display>(flag: &str, value: T, low: T, high: T) -> Result<T> {
    if value < low || value > high {
        return Err(Error::InvalidArgument {
            argument: flag.into(),
            rule: format!("{value}: must be {low} to {high}"),
        });
    }
    Ok(value)
}

/// `--gpu`, an ordinal.
fn gpu_flag(gpu: i64) -> Result<usize> {
    Ok(flag_in_range("--gpu", gpu, 0, i64::from(u16::MAX))? as usize)
}

/// The library's argument names as the `sample` command's flags.
fn name_the_flag(error: Error) -> Error {
    match error {
        Error::InvalidArgument { argument, rule } => {
            let flag = match argument.as_str() {
                a if a.starts_with("params[") && a.ends_with(".temperature") => "--temperature",
                "draws" => "--samples",
                "shards" => "--shards",
                "lm_head" => "--lm-head",
                "hidden" => "--hidden",
                "device" => "--gpu",
                other => processing::flag_of_field(other).unwrap_or(other),
            };
            Error::InvalidArgument { argument: flag.into(), rule }
        }
        other => other,
    }
}

/// The rows a `sample` run drew and where it drew them, for its summary.
struct Done {
    rows: usize,
    device: String,
}

/// Runs `sample`; on success one line on standard error says what was written, in how long
/// and where (standard output stays free for the caller).
fn sample(args: SampleArgs) -> Result<()> {
    let started = Instant::now();
    let done = sample_command(&args).map_err(name_the_flag)?;
    let mut written = format!("[{}, {}] tokens to {}", done.rows, args.samples, args.out.display());
    if let Some(path) = &args.processing.logprobs {
        written.push_str(&format!(", log-probabilities to {}", path.display()));
    }
    if let Some(path) = &args.processing.processed_logprobs {
        written.push_str(&format!(", processed log-probabilities to {}", path.display()));
    }
    eprintln!("flashsample: wrote {written} in {:.2} s on {}", started.elapsed().as_secs_f64(), done.device);
    Ok(())
}

/// The device a run sampled on, as its summary names it.
fn gpu_name(gpu: usize, sampler: &CudaSampler) -> String {
    format!("GPU {gpu} ({})", sampler.device_name())
}

/// A read error of the input file of `flag` as an error of the flag: `invalid --lm-head:
/// <path>: <reason>`, like the errors of the `.npy` inputs.
fn input_file_error(flag: &str) -> impl FnOnce(Error) -> Error + '_ {
    move |error| match error {
        Error::File { path, message } => {
            Error::InvalidArgument { argument: flag.into(), rule: format!("{path}: {message}") }
        }
        other => other,
    }
}

fn sample_command(args: &SampleArgs) -> Result<Done> {
    let samples = flag_in_range("--samples", args.samples, 1, u32::MAX as i64)? as u32;
    let seed = flag_in_range("--seed", args.seed, 0, u64::MAX as i128)? as u64;
    let gpu = gpu_flag(args.gpu)?;
    let mut inputs = vec![("--lm-head", args.lm_head.as_path()), ("--hidden", args.hidden.as_path())];
    inputs.extend(args.processing.inputs());
    // Each log-probability output with the column of `Sampled` it receives.
    let columns: [(&str, &Option<PathBuf>, LogColumn); 2] = [
        ("--logprobs", &args.processing.logprobs, |s| &s.logprobs),
        ("--processed-logprobs", &args.processing.processed_logprobs, |s| &s.processed_logprobs),
    ];
    let log_columns: Vec<(&str, &Path, LogColumn)> =
        columns.into_iter().filter_map(|(flag, path, column)| Some((flag, path.as_deref()?, column))).collect();
    let mut outputs = vec![("--out", args.out.as_path())];
    outputs.extend(log_columns.iter().map(|&(flag, path, _)| (flag, path)));
    // Every clash is refused before any file is created.
    output::check_distinct(&inputs, &outputs)?;
    let out = output::Partial::new("--out", &args.out)?;
    let log_outputs = log_columns
        .into_iter()
        .map(|(flag, path, column)| Ok((output::Partial::new(flag, path)?, column)))
        .collect::<Result<Vec<_>>>()?;
    let w = load_matrix(&args.lm_head, args.lm_head_tensor.as_deref(), "--lm-head")
        .map_err(input_file_error("--lm-head"))?;
    let h =
        load_matrix(&args.hidden, args.hidden_tensor.as_deref(), "--hidden").map_err(input_file_error("--hidden"))?;
    // Different input types meet in the narrowest type holding both exactly; the shapes are
    // checked first, so a mismatch costs no conversion.
    let common = w.dtype().common(h.dtype());
    if h.cols() != w.cols() {
        return Err(Error::InvalidArgument {
            argument: "--hidden".into(),
            rule: format!("{} columns, but the LM head has D = {}: they must match", h.cols(), w.cols()),
        });
    }
    let (w, h) = (w.into_dtype(common), h.into_dtype(common));
    let (vocab, rows) = (w.rows(), h.rows());
    let params: Vec<SamplingParams> =
        (0..rows).map(|r| SamplingParams::new(args.temperature, seed, r as u32, 0)).collect();
    row_params(&params)?;
    let wants_logprobs = !log_outputs.is_empty();
    let processing: Vec<Processing> = match args.processing.any() {
        true => args
            .processing
            .rows(rows, vocab)?
            .into_iter()
            .map(|p| Processing { logprobs: wants_logprobs, ..p })
            .collect(),
        false => Vec::new(),
    };
    let shard_count = args.processing.shard_count(vocab)?;
    let shard_bounds = VocabShard::bounds(vocab, shard_count)?;
    let per_call = (TOKENS_PER_CALL / rows).max(1) as u32;
    let (sampler, sampled_on, per_call, bar): (Box<dyn Sampler>, String, u32, ProgressBar) =
        match gpu_sampler(args.device, gpu)? {
            Some(sampler) => {
                let name = gpu_name(gpu, &sampler);
                (Box::new(sampler), name, per_call, ProgressBar::hidden())
            }
            None => {
                let per_pass = cpu_draws_per_pass(rows, vocab, w.cols(), per_call);
                (Box::new(CpuSampler::new()), "the CPU".into(), per_pass, draws_bar(samples))
            }
        };
    let head = match shard_count {
        1 => sampler.upload_lm_head(&w)?,
        _ => sampler
            .upload_lm_head_shards(&shard_bounds.windows(2).map(|b| w.row_range(b[0], b[1])).collect::<Vec<_>>())?,
    };
    drop(w);
    let batch = Batch::with_processing(params, processing);
    let mut writer = NpyWriter::create(out.partial_path(), rows, samples as usize)?;
    let mut log_writers = log_outputs
        .iter()
        .map(|(o, column)| {
            Ok((NpyWriter::create_typed(o.partial_path(), NpyType::F32, rows, samples as usize)?, *column))
        })
        .collect::<Result<Vec<_>>>()?;
    for draws in passes(samples, per_call) {
        // A row without a token fails the run: nothing is written (the partial files go).
        let sampled = sampler.sample(&head, &h, &batch, draws)?;
        writer.write_columns(draws.first as usize, sampled.draws, &sampled.tokens)?;
        for (log_writer, column) in &mut log_writers {
            log_writer.write_f32_columns(draws.first as usize, sampled.draws, column(&sampled))?;
        }
        bar.inc(draws.count.into());
    }
    drop((head, bar));
    sampler.close()?;
    writer.finish()?;
    for (log_writer, _) in log_writers {
        log_writer.finish()?;
    }
    for (log_output, _) in log_outputs {
        log_output.commit()?;
    }
    out.commit()?;
    Ok(Done { rows, device: sampled_on })
}

fn demo(device: DeviceKind, gpu: usize) -> Result<()> {
    match gpu_sampler(device, gpu)? {
        Some(sampler) => gpu_demo(sampler),
        None => cpu_demo(),
    }
}

/// The most likely tokens of a small synthetic bf16 head, their empirical frequencies over
/// many draws beside their exact softmax probabilities, and Pearson's χ² over the whole
/// vocabulary.
fn cpu_demo() -> Result<()> {
    let (vocab, dim, draws, temperature) = (1000, 64, 100_000u32, 0.8);
    println!("CPU: synthetic LM head bf16 V={vocab} D={dim}, one row, T={temperature}, {draws} draws");
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let mut random = |n: usize, scale: f32| {
        Elements::BF16((0..n).map(|_| half::bf16::from_f32(rng.random_range(-scale..scale))).collect())
    };
    let w = Matrix::new("lm_head", vocab, dim, random(vocab * dim, 0.5))?;
    let h = Matrix::new("hidden", 1, dim, random(dim, 1.0))?;
    let params = [SamplingParams::new(temperature, 42, 0, 0)];
    let sampler = CpuSampler::new();
    let head = sampler.upload_lm_head(&w)?;
    let started = Instant::now();
    let tokens = sampler.sample(&head, &h, &Batch::new(params.to_vec()), Draws::first(draws))?.tokens;
    println!("sampled in {:.0} ms", started.elapsed().as_secs_f64() * 1e3);
    let mut counts = vec![0u64; vocab];
    for &t in &tokens {
        counts[t as usize] += 1;
    }
    let row = row_params(&params)?[0];
    let probabilities = exact_probabilities(&logits_row(&w, &h, 0), &row);
    let mut order: Vec<usize> = (0..vocab).collect();
    order.sort_by(|&a, &b| probabilities[b].total_cmp(&probabilities[a]));
    println!("{:>7} {:>12} {:>12}", "token", "frequency", "softmax");
    for &token in &order[..10] {
        println!("{token:>7} {:>12.5} {:>12.5}", counts[token] as f64 / draws as f64, probabilities[token]);
    }
    let (statistic, dof, p) = chi_square(&counts, &probabilities);
    println!(
        "chi-square over all {vocab} tokens: {statistic:.1} with {dof} dof, p = {p:.3} (exact sampling: p is uniform)"
    );
    println!("On an NVIDIA GPU (Ampere or newer, with its driver) the same command samples a synthetic");
    println!("LM head of a real model's shape with the fused kernels: flashsample demo --device cuda");
    Ok(())
}

fn gpu_demo(sampler: CudaSampler) -> Result<()> {
    let (vocab, dim, batch) = (151_936, 4096, 64);
    println!(
        "{} ({} module): synthetic LM head bf16 D={dim} V={vocab}, B={batch}, T=1, one draw per row",
        sampler.device_name(),
        sampler.module().name()
    );
    let head = sampler.random_lm_head(vocab, dim, DType::BF16, 1, 0.05)?;
    let hidden = sampler.random_hidden(batch, dim, DType::BF16, 2, 2.0)?;
    let params: Vec<SamplingParams> = (0..batch).map(|r| SamplingParams::new(1.0, 42, r as u32, 0)).collect();

    let rows = sampler.upload_batch(&Batch::new(params.clone()), vocab)?;
    let mut tokens = sampler.outputs(&rows, 1)?;
    let one = Draws::first(1);
    sampler.sample_into(&head, &hidden, &rows, one, &mut tokens)?;
    let fused = sampler.read(&tokens)?.tokens;
    let variant = Variant::Auto.resolve(sampler.module(), DType::BF16, dim, batch)?;
    sampler.sample_unfused_into(&head, &hidden, &rows, one, variant, &mut tokens)?;
    let unfused = sampler.read(&tokens)?.tokens;
    let same = fused.iter().zip(&unfused).filter(|(a, b)| a == b).count();
    println!("fused vs unfused pipeline (same logits, same noise): {same}/{batch} tokens equal");

    let checked_rows = 4;
    let w = sampler.lm_head_to_host(&head)?;
    let h = sampler.hidden_to_host(&hidden)?;
    let mut agree = 0;
    for r in 0..checked_rows {
        let logits = logits_row(&w, &h, r);
        let row = row_params(&params[r..r + 1])?[0];
        let cpu = draw(&logits, &row, 0).index;
        agree += (cpu == fused[r]) as usize;
        println!("  row {r}: GPU token {}  CPU token {cpu}", fused[r]);
    }
    println!("CPU check: {agree}/{checked_rows} rows give the same token");

    let mut timer = Timer::new(&sampler)?;
    let fused_time = timer.time(&sampler, 3, 50, || sampler.sample_into(&head, &hidden, &rows, one, &mut tokens))?;
    let unfused_time = timer
        .time(&sampler, 3, 50, || sampler.sample_unfused_into(&head, &hidden, &rows, one, variant, &mut tokens))?;
    println!(
        "median of {} runs, L2 flushed: fused {:.1} us, unfused (logits to HBM, then sample) {:.1} us: {:.2}x",
        fused_time.runs,
        fused_time.median_us,
        unfused_time.median_us,
        unfused_time.median_us / fused_time.median_us
    );
    drop((head, hidden, rows, tokens, timer));
    sampler.close()
}

fn report(bench: &Path, peers: &Peers, out: &Path, dtype: DType) -> Result<()> {
    let rows = bench::read_csv(bench)?;
    let peers = peers.read()?;
    std::fs::create_dir_all(out)
        .map_err(|e| Error::File { path: out.display().to_string(), message: e.to_string() })?;
    bench::plot(&out.join("bench.png"), &rows, &peers)?;
    write_report(out, &rows, &peers, dtype)
}

/// The peers' CSVs a bench or report command names.
struct Peers {
    /// `--peers`: scripts/peers.py's cuBLAS and torch timings.
    peers: Option<PathBuf>,
    /// `--flashinfer`: FlashInfer's pipeline timings.
    flashinfer: Option<PathBuf>,
}

impl Peers {
    /// Every named CSV's timings (their names do not overlap), an error naming the flag of a
    /// file that cannot be read.
    fn read(&self) -> Result<Vec<bench::PeerTiming>> {
        let mut timings = Vec::new();
        for (flag, path) in [("--peers", &self.peers), ("--flashinfer", &self.flashinfer)] {
            if let Some(path) = path {
                timings.extend(bench::read_peers(path).map_err(input_file_error(flag))?);
            }
        }
        Ok(timings)
    }
}

/// Writes `report.md` into `out` and prints it.
fn write_report(out: &Path, rows: &[bench::Row], peers: &[bench::PeerTiming], dtype: DType) -> Result<()> {
    let report = bench::report(rows, peers, dtype);
    std::fs::write(out.join("report.md"), &report)
        .map_err(|e| Error::File { path: out.display().to_string(), message: e.to_string() })?;
    println!("{report}");
    Ok(())
}

/// Batch sizes whose host cost per step the bench reports.
const HOST_COST_BATCHES: [usize; 2] = [1, 64];

fn run_bench(
    out: PathBuf,
    shapes: Vec<String>,
    options: impl FnOnce(Vec<(usize, usize)>) -> bench::Options,
    peers: &Peers,
) -> Result<()> {
    let options = options(parse_shapes(&shapes)?);
    // Read first: a missing file is an error before the GPU run, not after it.
    let peers = peers.read()?;
    let (dtype, runs, warmup) = (options.dtype, options.runs, options.warmup);
    if runs == 0 {
        return Err(Error::InvalidArgument { argument: "--runs".into(), rule: "0: at least one timed run".into() });
    }
    std::fs::create_dir_all(&out)
        .map_err(|e| Error::File { path: out.display().to_string(), message: e.to_string() })?;
    check_gpu(options.gpu)?;
    let samplers = bench::samplers(&options)?;
    let modules: Vec<&str> = samplers.iter().map(|s| s.module().name()).collect();
    println!(
        "{}: {} SMs; modules {}; {dtype}; median of {runs} runs after {warmup} warm-up, L2 flushed",
        samplers[0].device_name(),
        samplers[0].multiprocessors(),
        modules.join(", ")
    );
    let rows = bench::run(&samplers, &options)?;
    bench::write_csv(&out.join("bench.csv"), &rows, dtype)?;
    // After a GPU run a failed plot costs only the picture: the CSV and report still stand.
    if let Err(e) = bench::plot(&out.join("bench.png"), &rows, &peers) {
        eprintln!("warning: no plot: {e}");
    }
    write_report(&out, &rows, &peers, dtype)?;
    let (dim, vocab) = options.shapes[0];
    let costs = host_cost::measure(&samplers[0], dim, vocab, dtype, &HOST_COST_BATCHES)?;
    host_cost::write_csv(&out.join("host-cost.csv"), &costs)?;
    println!("{}", host_cost::table(&costs));
    samplers.into_iter().try_for_each(CudaSampler::close)
}

/// `--shapes`: `DxV` each.
fn parse_shapes(shapes: &[String]) -> Result<Vec<(usize, usize)>> {
    shapes
        .iter()
        .map(|s| {
            let parsed = s.split_once('x').and_then(|(d, v)| Some((d.parse().ok()?, v.parse().ok()?)));
            parsed.ok_or_else(|| Error::InvalidArgument {
                argument: "--shapes".into(),
                rule: format!("`{s}`: each shape is DxV, e.g. 4096x151936"),
            })
        })
        .collect()
}

#[cfg(feature = "nccl")]
fn run_bench_tp(out: &Path, options: &bench_tp::Options, peers: Option<&Path>) -> Result<()> {
    if options.runs == 0 {
        return Err(Error::InvalidArgument { argument: "--runs".into(), rule: "0: at least one timed run".into() });
    }
    if let Some(&n) = options.gpus.iter().find(|&&n| n == 0) {
        return Err(Error::InvalidArgument { argument: "--gpus".into(), rule: format!("{n}: at least one GPU") });
    }
    let peers = peers.map(bench_tp::read_csv).transpose()?.unwrap_or_default();
    std::fs::create_dir_all(out)
        .map_err(|e| Error::File { path: out.display().to_string(), message: e.to_string() })?;
    let rows = bench_tp::run(options)?;
    bench_tp::write_csv(&out.join("tp.csv"), &rows)?;
    let table = bench_tp::table(&rows, &peers);
    std::fs::write(out.join("tp-report.md"), &table)
        .map_err(|e| Error::File { path: out.display().to_string(), message: e.to_string() })?;
    println!("{table}");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `.npy` written three draws at a time holds what one call writes.
    #[test]
    fn passes_of_draws_write_what_one_call_writes() {
        let w = Matrix::new("w", 30, 4, Elements::F32((0..120).map(|i| (i % 7) as f32 * 0.3).collect())).unwrap();
        let h = Matrix::new("h", 2, 4, Elements::F32(vec![0.5, -1.0, 0.25, 2.0, 1.0, 1.0, -1.0, 0.0])).unwrap();
        let batch = Batch::new(vec![SamplingParams::new(1.0, 9, 0, 0), SamplingParams::new(0.7, 9, 1, 0)]);
        let sampler = CpuSampler::new();
        let head = sampler.upload_lm_head(&w).unwrap();
        let dir = std::env::temp_dir().join(format!("flashsample-passes-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (one, passes) = (dir.join("one.npy"), dir.join("passes.npy"));
        for (path, per_call) in [(&one, 10), (&passes, 3)] {
            let mut writer = NpyWriter::create(path, 2, 10).unwrap();
            for draws in super::passes(10, per_call) {
                let sampled = sampler.sample(&head, &h, &batch, draws).unwrap();
                writer.write_columns(draws.first as usize, sampled.draws, &sampled.tokens).unwrap();
            }
            writer.finish().unwrap();
        }
        assert_eq!(std::fs::read(&one).unwrap(), std::fs::read(&passes).unwrap());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// CPU passes hold about `CPU_PASS_ENTRIES` noise entries, at least D / 2 draws (the logits
    /// are recomputed each pass) and at most the memory bound's draws.
    #[test]
    fn cpu_passes_are_sized_by_work_and_dimension() {
        assert_eq!(cpu_draws_per_pass(1, 1000, 64, u32::MAX), 16_778);
        assert_eq!(cpu_draws_per_pass(1, 151_936, 4096, u32::MAX), 2048);
        assert_eq!(cpu_draws_per_pass(128, 32_768, 8, u32::MAX), 4);
        assert_eq!(cpu_draws_per_pass(64, 151_936, 1, u32::MAX), 2);
        assert_eq!(cpu_draws_per_pass(1, 10, 8, 100), 100);
    }

    /// Numbers that start with a hyphen join the long flag before them; nothing else changes,
    /// nor anything after `--`.
    #[test]
    fn negative_numbers_join_the_flag_before_them() {
        let args = |list: &[&str]| list.iter().map(OsString::from).collect::<Vec<_>>();
        let line = ["flashsample", "sample", "--temperature", "-inf", "--top-p", "-1e-3", "--seed", "-1"];
        assert_eq!(
            attach_negative_numbers(args(&line)),
            args(&["flashsample", "sample", "--temperature=-inf", "--top-p=-1e-3", "--seed=-1"])
        );
        for unchanged in [
            &["flashsample", "--temperature", "--out", "-x"][..],
            &["flashsample", "--min-p=-1", "-2", "-inf"],
            &["flashsample", "-h", "-nan"],
            &["flashsample", "--", "--top-k", "-1"],
            &["-1", "-2"],
        ] {
            assert_eq!(attach_negative_numbers(args(unchanged)), args(unchanged));
        }
    }
}
