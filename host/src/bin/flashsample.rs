//! `flashsample`: sample tokens from an LM head and hidden states, run the demo, benchmark.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use clap::{Parser, Subcommand, ValueEnum};
use flashsample::cpu::{draw, logits_row};
use flashsample::io::{load_matrix, write_npy_i64};
use flashsample::timing::Timer;
use flashsample::{CpuSampler, CudaSampler, DType, Elements, Error, Matrix, Result, SamplingParams, Variant};
use rand::{Rng, SeedableRng};

#[derive(Parser)]
#[command(name = "flashsample", version, about = "Exact token sampling fused into the LM-head matmul (Gumbel-max)")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum DeviceKind {
    Cuda,
    Cpu,
}

#[derive(Subcommand)]
enum Command {
    /// Draw N tokens per row from softmax(H·Wᵀ / T) and write them as int64 .npy [B, N].
    Sample {
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
        /// Draws per row (independent; may be millions).
        #[arg(long)]
        samples: u32,
        /// Seed of the noise; row r draws from stream r of it.
        #[arg(long)]
        seed: u64,
        /// Temperature T >= 0; 0 is greedy argmax. (A negative value is read, then rejected
        /// with the sampler's own error.)
        #[arg(long, allow_negative_numbers = true)]
        temperature: f32,
        #[arg(long, value_enum, default_value = "cuda")]
        device: DeviceKind,
        /// Output .npy path.
        #[arg(long)]
        out: PathBuf,
    },
    /// Sample from a synthetic LM head of a real model's shape; check against the CPU; time it.
    Demo,
    /// Time fused sampling, fused greedy, the unfused pipeline and the read floor on the GPU.
    Bench {
        /// Folder for bench.csv, bench.png and report.md.
        #[arg(long)]
        out: PathBuf,
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
        /// Also time fused sampling and greedy decoding with every tensor-core kernel variant
        /// (CSV rows `fused_sample@<variant>`, `fused_greedy@<variant>`), to check the
        /// dispatcher's choice.
        #[arg(long)]
        all_variants: bool,
        /// Path of libcublas.so: also time cuBLAS's GEMM (`x @ Wᵀ`, bf16/f16) in this process,
        /// right before our kernels at each point, so both run under the same clocks (CSV rows
        /// `cublas_gemm`).
        #[arg(long)]
        cublas: Option<PathBuf>,
    },
    /// Re-render report.md and bench.png from a bench run's CSVs (no GPU needed).
    Report {
        /// bench.csv written by `flashsample bench`.
        #[arg(long)]
        bench: PathBuf,
        /// peers.csv from scripts/peers.py.
        #[arg(long)]
        peers: Option<PathBuf>,
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

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Sample { lm_head, lm_head_tensor, hidden, hidden_tensor, samples, seed, temperature, device, out } => {
            sample(SampleArgs {
                lm_head,
                lm_head_tensor,
                hidden,
                hidden_tensor,
                samples,
                seed,
                temperature,
                device,
                out,
            })
        }
        Command::Demo => demo(),
        Command::Report { bench, peers, out, dtype } => report(&bench, peers.as_deref(), &out, dtype.into()),
        Command::Bench { out, shapes, batches, dtype, warmup, runs, peers, all_variants, cublas } => {
            let options = |shapes| flashsample::bench::Options {
                shapes,
                batches,
                dtype: dtype.into(),
                warmup,
                runs,
                all_variants,
                cublas,
            };
            bench(out, shapes, options, peers)
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

struct SampleArgs {
    lm_head: PathBuf,
    lm_head_tensor: Option<String>,
    hidden: PathBuf,
    hidden_tensor: Option<String>,
    samples: u32,
    seed: u64,
    temperature: f32,
    device: DeviceKind,
    out: PathBuf,
}

fn sample(args: SampleArgs) -> Result<()> {
    let w = load_matrix(&args.lm_head, args.lm_head_tensor.as_deref(), "--lm-head")?;
    let h = load_matrix(&args.hidden, args.hidden_tensor.as_deref(), "--hidden")?;
    // Different input types meet in the narrowest type holding both exactly.
    let common = w.dtype().common(h.dtype());
    let (w, h) = (w.to_dtype(common), h.to_dtype(common));
    let params: Vec<SamplingParams> =
        (0..h.rows()).map(|r| SamplingParams::new(args.temperature, args.seed, r as u32, 0)).collect();
    let tokens = match args.device {
        DeviceKind::Cuda => {
            let sampler = CudaSampler::new()?;
            let head = sampler.upload_lm_head(&w)?;
            let tokens = sampler.sample(&head, &h, &params, args.samples)?;
            sampler.close()?;
            tokens
        }
        DeviceKind::Cpu => {
            let sampler = CpuSampler::new();
            let head = sampler.upload_lm_head(&w)?;
            sampler.sample(&head, &h, &params, args.samples)?
        }
    };
    write_npy_i64(&args.out, h.rows(), args.samples as usize, &tokens)
}

fn demo() -> Result<()> {
    match CudaSampler::new() {
        Ok(sampler) => gpu_demo(sampler),
        Err(Error::NoCudaDevice(why)) => {
            println!("no CUDA device ({why}); running the CPU path on a smaller shape (bf16, D=256, V=8192, B=4)");
            cpu_demo()
        }
        Err(e) => Err(e),
    }
}

fn cpu_demo() -> Result<()> {
    let (vocab, dim, batch) = (8192, 256, 4);
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let mut random = |n: usize, scale: f32| {
        Elements::BF16((0..n).map(|_| half::bf16::from_f32(rng.random_range(-scale..scale))).collect())
    };
    let w = Matrix::new("lm_head", vocab, dim, random(vocab * dim, 0.2))?;
    let h = Matrix::new("hidden", batch, dim, random(batch * dim, 2.0))?;
    let params: Vec<SamplingParams> = (0..batch).map(|r| SamplingParams::new(1.0, 42, r as u32, 0)).collect();
    let sampler = CpuSampler::new();
    let head = sampler.upload_lm_head(&w)?;
    let started = Instant::now();
    let tokens = sampler.sample(&head, &h, &params, 8)?;
    println!("CPU: 8 draws for each of {batch} rows in {:.1} ms", started.elapsed().as_secs_f64() * 1e3);
    for (r, row) in tokens.chunks(8).enumerate() {
        println!("  row {r}: {row:?}");
    }
    Ok(())
}

fn gpu_demo(sampler: CudaSampler) -> Result<()> {
    let (vocab, dim, batch) = (151_936, 4096, 64);
    println!("{}: synthetic LM head bf16 D={dim} V={vocab}, B={batch}, T=1, one draw per row", sampler.device_name());
    let head = sampler.random_lm_head(vocab, dim, DType::BF16, 1, 0.05)?;
    let hidden = sampler.random_hidden(batch, dim, DType::BF16, 2, 2.0)?;
    let params: Vec<SamplingParams> = (0..batch).map(|r| SamplingParams::new(1.0, 42, r as u32, 0)).collect();

    let fused = sampler.sample_on_device(&head, &hidden, &params, 1, Variant::Auto)?;
    let fused = sampler.tokens_to_host(&fused)?;
    let variant = Variant::Auto.resolve(DType::BF16, dim, batch)?;
    let rows = sampler.upload_rows(&params)?;
    let mut tokens = flashsample::DeviceTokens::new(&sampler, batch, 1)?;
    sampler.sample_unfused_into(&head, &hidden, &rows, 1, variant, &mut tokens)?;
    let unfused = sampler.tokens_to_host(&tokens)?;
    let same = fused.iter().zip(&unfused).filter(|(a, b)| a == b).count();
    println!("fused vs unfused pipeline (same logits, same noise): {same}/{batch} tokens equal");

    let checked_rows = 4;
    let w = sampler.lm_head_to_host(&head)?;
    let h = sampler.hidden_to_host(&hidden)?;
    let mut agree = 0;
    for r in 0..checked_rows {
        let logits = logits_row(&w, &h, r);
        let row = flashsample::params::check_request(
            flashsample::HeadShape { vocab, dim, dtype: DType::BF16 },
            h.row_range(r, r + 1).shape(),
            &params[r..r + 1],
            1,
        )?[0];
        let cpu = draw(&logits, &row, 0).index;
        agree += (cpu == fused[r]) as usize;
        println!("  row {r}: GPU token {}  CPU token {cpu}", fused[r]);
    }
    println!("CPU check: {agree}/{checked_rows} rows give the same token");

    let mut timer = Timer::new()?;
    let fused_time = timer
        .time(&sampler, 3, 50, || sampler.sample_rows_into(&head, &hidden, &rows, 1, Variant::Auto, &mut tokens))?;
    let unfused_time =
        timer.time(&sampler, 3, 50, || sampler.sample_unfused_into(&head, &hidden, &rows, 1, variant, &mut tokens))?;
    println!(
        "median of {} runs, L2 flushed: fused {:.1} us, unfused (logits to HBM, then sample) {:.1} us: {:.2}x",
        fused_time.runs,
        fused_time.median_us,
        unfused_time.median_us,
        unfused_time.median_us / fused_time.median_us
    );
    sampler.close()
}

fn report(bench: &Path, peers: Option<&Path>, out: &Path, dtype: DType) -> Result<()> {
    let rows = flashsample::bench::read_csv(bench)?;
    let peers = read_optional_peers(peers)?;
    std::fs::create_dir_all(out)
        .map_err(|e| Error::File { path: out.display().to_string(), message: e.to_string() })?;
    flashsample::bench::plot(&out.join("bench.png"), &rows, &peers)?;
    write_report(out, &rows, &peers, dtype)
}

/// The peers' CSV when one is named, else none.
fn read_optional_peers(peers: Option<&Path>) -> Result<Vec<flashsample::bench::PeerTiming>> {
    peers.map_or(Ok(Vec::new()), flashsample::bench::read_peers)
}

/// Writes `report.md` into `out` and prints it.
fn write_report(
    out: &Path,
    rows: &[flashsample::bench::Row],
    peers: &[flashsample::bench::PeerTiming],
    dtype: DType,
) -> Result<()> {
    let report = flashsample::bench::report(rows, peers, dtype);
    std::fs::write(out.join("report.md"), &report)
        .map_err(|e| Error::File { path: out.display().to_string(), message: e.to_string() })?;
    println!("{report}");
    Ok(())
}

fn bench(
    out: PathBuf,
    shapes: Vec<String>,
    options: impl FnOnce(Vec<(usize, usize)>) -> flashsample::bench::Options,
    peers: Option<PathBuf>,
) -> Result<()> {
    let shapes = shapes
        .iter()
        .map(|s| {
            let parsed = s.split_once('x').and_then(|(d, v)| Some((d.parse().ok()?, v.parse().ok()?)));
            parsed.ok_or_else(|| Error::InvalidArgument {
                argument: "--shapes".into(),
                rule: format!("`{s}`: each shape is DxV, e.g. 4096x151936"),
            })
        })
        .collect::<Result<Vec<(usize, usize)>>>()?;
    let options = options(shapes);
    let (dtype, runs, warmup) = (options.dtype, options.runs, options.warmup);
    if runs == 0 {
        return Err(Error::InvalidArgument { argument: "--runs".into(), rule: "0: at least one timed run".into() });
    }
    std::fs::create_dir_all(&out)
        .map_err(|e| Error::File { path: out.display().to_string(), message: e.to_string() })?;
    let sampler = CudaSampler::new()?;
    println!(
        "{}: {} SMs; {dtype}; median of {runs} runs after {warmup} warm-up, L2 flushed",
        sampler.device_name(),
        sampler.multiprocessors()
    );
    let rows = flashsample::bench::run(&sampler, &options)?;
    flashsample::bench::write_csv(&out.join("bench.csv"), &rows, dtype)?;
    let peers = read_optional_peers(peers.as_deref())?;
    // After a GPU run a failed plot costs only the picture: the CSV and report still stand.
    if let Err(e) = flashsample::bench::plot(&out.join("bench.png"), &rows, &peers) {
        eprintln!("warning: no plot: {e}");
    }
    write_report(&out, &rows, &peers, dtype)?;
    sampler.close()
}
