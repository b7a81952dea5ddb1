//! The `flashsample` CLI as a user calls it: files in, `.npy` out, typed errors, no panics.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use flashsample_cli::io::read_npy_i64;
use flashsample_cli::stats::chi_square;
use half::bf16;
use safetensors::{Dtype, tensor::TensorView};

struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!("flashsample-cli-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }

    fn path(&self, file: &str) -> String {
        self.0.join(file).display().to_string()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Deterministic values in [-scale, scale) from a small LCG (no statistics needed here).
fn values(n: usize, scale: f32, seed: u64) -> Vec<f32> {
    let mut state = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
    (0..n)
        .map(|_| {
            state = state.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            ((state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

fn write_tensors(path: &str, tensors: &[(&str, Dtype, Vec<usize>, Vec<u8>)]) {
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .map(|(name, dtype, shape, bytes)| (name.to_string(), TensorView::new(*dtype, shape.clone(), bytes).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, &None, Path::new(path)).unwrap();
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn bf16_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| bf16::from_f32(*x).to_le_bytes()).collect()
}

/// The binary under test run with `args`.
fn flashsample(args: &[&str]) -> Output {
    flashsample_command().args(args).output().unwrap()
}

/// `report` re-renders a bench run with FlashInfer's timings beside our truncations; a peers
/// file that cannot be read is an error naming its flag.
#[test]
fn report_sets_flashinfer_beside_processed_sampling() {
    let scratch = Scratch::new("report");
    let bench = scratch.path("bench.csv");
    std::fs::write(
        &bench,
        "dim,vocab,batch,variant,median_us,min_us,max_us,runs,weight_gbps,tflops,module\n\
         64,1000,16,fused_sample,440.00,440.00,440.00,30,0.3,0.00,hopper\n\
         64,1000,16,processed_top_p,610.00,610.00,610.00,30,0.2,0.00,hopper\n",
    )
    .unwrap();
    let fi = scratch.path("fi.csv");
    std::fs::write(&fi, "d,v,b,impl,median_us\n64,1000,16,fi_top_p,536.00\n64,1000,16,fi_top_p_after_logits,90.00\n")
        .unwrap();
    let out = scratch.path("report");
    let done = flashsample(&["report", "--bench", &bench, "--flashinfer", &fi, "--out", &out]);
    let stdout = String::from_utf8_lossy(&done.stdout);
    assert!(done.status.success(), "{}", String::from_utf8_lossy(&done.stderr));
    assert!(stdout.contains("| 64 | 1000 | 16 | top_p | 610.0 | 536.0 | 90.0 | 1.138 |"), "{stdout}");
    let missing = scratch.path("missing.csv");
    let refused = flashsample(&["report", "--bench", &bench, "--flashinfer", &missing, "--out", &out]);
    assert_clean_failure(&refused, "--flashinfer");
}

/// The binary under test: cargo's build, or `$FLASHSAMPLE_BIN` where the test binary runs on
/// another machine (the GPU bundle).
fn flashsample_command() -> Command {
    Command::new(std::env::var_os("FLASHSAMPLE_BIN").unwrap_or_else(|| env!("CARGO_BIN_EXE_flashsample").into()))
}

/// `sample` on `w` and `h` into `out` with `extra`, on the device `--device` defaults to.
fn sample_on_default_device<'a>(w: &'a str, h: &'a str, out: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec!["sample", "--lm-head", w, "--hidden", h, "--out", out];
    args.extend_from_slice(extra);
    args
}

/// `sample` on the CPU.
fn sample_args<'a>(w: &'a str, h: &'a str, out: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = sample_on_default_device(w, h, out, &["--device", "cpu"]);
    args.extend_from_slice(extra);
    args
}

/// Writes W [v, d] in bf16 and H [b, d] in f32 and returns their paths.
fn inputs(scratch: &Scratch, v: usize, d: usize, b: usize) -> (String, String) {
    let (w, h) = (scratch.path("w.safetensors"), scratch.path("h.safetensors"));
    write_tensors(&w, &[("weight", Dtype::BF16, vec![v, d], bf16_bytes(&values(v * d, 0.5, 1)))]);
    write_tensors(&h, &[("hidden", Dtype::F32, vec![b, d], f32_bytes(&values(b * d, 1.0, 2)))]);
    (w, h)
}

fn assert_clean_failure(output: &Output, expected: &str) {
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "expected a failure; stderr: {stderr}");
    assert!(!stderr.contains("panicked"), "panicked: {stderr}");
    assert!(stderr.contains(expected), "stderr lacks `{expected}`: {stderr}");
}

const ARGS: [&str; 6] = ["--samples", "1", "--seed", "1", "--temperature", "1"];

#[test]
fn sample_writes_int64_npy_of_shape_rows_by_samples() {
    let scratch = Scratch::new("shape");
    let (w, h) = inputs(&scratch, 50, 16, 3);
    let (out, again, other) = (scratch.path("t.npy"), scratch.path("again.npy"), scratch.path("other.npy"));
    let output = flashsample(&sample_args(&w, &h, &out, &["--samples", "7", "--seed", "5", "--temperature", "1"]));
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let (rows, cols, tokens) = read_npy_i64(Path::new(&out)).unwrap();
    assert_eq!((rows, cols), (3, 7));
    assert!(tokens.iter().all(|&t| (0..50).contains(&t)));
    // The same seed gives the same file; another seed other tokens.
    flashsample(&sample_args(&w, &h, &again, &["--samples", "7", "--seed", "5", "--temperature", "1"]));
    assert_eq!(std::fs::read(&out).unwrap(), std::fs::read(&again).unwrap());
    flashsample(&sample_args(&w, &h, &other, &["--samples", "7", "--seed", "6", "--temperature", "1"]));
    assert_ne!(read_npy_i64(Path::new(&other)).unwrap().2, tokens);
}

/// W is bf16 and H f32: they meet in f32 (exact), and T = 0 returns the argmax every draw.
#[test]
fn temperature_zero_is_greedy_and_mixed_dtypes_meet_in_f32() {
    let scratch = Scratch::new("greedy");
    let (w, h) = inputs(&scratch, 40, 8, 2);
    let out = scratch.path("t.npy");
    let output = flashsample(&sample_args(&w, &h, &out, &["--samples", "4", "--seed", "1", "--temperature", "0"]));
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let (_, _, tokens) = read_npy_i64(Path::new(&out)).unwrap();
    let (wv, hv) = (values(40 * 8, 0.5, 1), values(2 * 8, 1.0, 2));
    for row in 0..2 {
        let logit = |i: usize| (0..8).map(|k| bf16::from_f32(wv[i * 8 + k]).to_f32() * hv[row * 8 + k]).sum::<f32>();
        let best = (0..40).fold(0, |b, i| if logit(i) > logit(b) { i } else { b });
        assert!(tokens[row * 4..row * 4 + 4].iter().all(|&t| t as usize == best), "row {row}: {tokens:?} vs {best}");
    }
}

#[test]
fn bad_inputs_fail_with_a_message_naming_the_problem() {
    let scratch = Scratch::new("errors");
    let (w, h) = inputs(&scratch, 20, 8, 2);
    let out = scratch.path("t.npy");
    let run = |extra: &[&str]| flashsample(&sample_args(&w, &h, &out, extra));
    // Every message names the flag and the rule; negative numbers reach the rule, not the parser.
    assert_clean_failure(
        &run(&["--samples", "2", "--seed", "1", "--temperature", "-1"]),
        "invalid --temperature: T = -1",
    );
    assert_clean_failure(&run(&["--samples", "0", "--seed", "1", "--temperature", "1"]), "invalid --samples: 0");
    assert_clean_failure(&run(&["--samples", "-1", "--seed", "1", "--temperature", "1"]), "invalid --samples: -1");
    assert_clean_failure(&run(&["--samples", "4294967296", "--seed", "1", "--temperature", "1"]), "--samples");
    assert_clean_failure(&run(&["--samples", "1", "--seed", "-1", "--temperature", "1"]), "invalid --seed: -1");
    assert_clean_failure(
        &run(&["--samples", "1", "--seed", "1", "--temperature", "1", "--gpu", "-1"]),
        "invalid --gpu",
    );

    // --out is checked before any work: not a folder, not an input, in a folder that exists;
    // a failed run leaves neither the output nor a partial file.
    let out_flag = |path: &str| flashsample(&sample_args(&w, &h, path, &ARGS));
    assert_clean_failure(&out_flag(&w), "invalid --out");
    assert!(std::fs::metadata(&w).unwrap().len() > 0, "the input was not touched");
    assert_clean_failure(&out_flag(&scratch.path("")), "is a folder");
    assert_clean_failure(&out_flag(&scratch.path("missing/t.npy")), "its folder does not exist");
    assert_clean_failure(&run(&["--samples", "1", "--seed", "1", "--temperature", "-1"]), "--temperature");
    assert!(!Path::new(&out).exists() && !Path::new(&format!("{out}.partial")).exists(), "no output after a failure");
    assert_clean_failure(&flashsample(&sample_args(&scratch.path(""), &h, &out, &ARGS)), "is a folder");
    assert_clean_failure(
        &flashsample(&sample_args("/nonexistent.safetensors", &h, &out, &ARGS)),
        "/nonexistent.safetensors",
    );

    let two = scratch.path("two.safetensors");
    write_tensors(
        &two,
        &[
            ("a", Dtype::F32, vec![20, 8], f32_bytes(&values(160, 1.0, 3))),
            ("b", Dtype::F32, vec![20, 8], f32_bytes(&values(160, 1.0, 4))),
        ],
    );
    assert_clean_failure(&flashsample(&sample_args(&two, &h, &out, &ARGS)), "--lm-head-tensor");
    let mut named = sample_args(&two, &h, &out, &ARGS);
    named.extend(["--lm-head-tensor", "zzz"]);
    assert_clean_failure(&flashsample(&named), "no tensor `zzz`");
    let mut good = sample_args(&two, &h, &out, &ARGS);
    good.extend(["--lm-head-tensor", "b"]);
    assert!(flashsample(&good).status.success());

    // A damaged file is described in words, not by the parser's enum.
    let truncated = scratch.path("truncated.safetensors");
    std::fs::write(&truncated, &std::fs::read(&w).unwrap()[..100]).unwrap();
    let output = flashsample(&sample_args(&truncated, &h, &out, &ARGS));
    assert_clean_failure(&output, "not a safetensors file: the file is truncated");
    assert!(!String::from_utf8_lossy(&output.stderr).contains("MetadataIncompleteBuffer"));

    let flat = scratch.path("flat.safetensors");
    write_tensors(&flat, &[("w", Dtype::F32, vec![160], f32_bytes(&values(160, 1.0, 5)))]);
    assert_clean_failure(&flashsample(&sample_args(&flat, &h, &out, &ARGS)), "must be 2-D");

    let ints = scratch.path("ints.safetensors");
    write_tensors(&ints, &[("w", Dtype::I32, vec![20, 8], vec![0u8; 640])]);
    assert_clean_failure(&flashsample(&sample_args(&ints, &h, &out, &ARGS)), "must be F32, F16 or BF16");

    let wide = scratch.path("wide.safetensors");
    write_tensors(&wide, &[("h", Dtype::F32, vec![2, 9], f32_bytes(&values(18, 1.0, 6)))]);
    assert_clean_failure(&flashsample(&sample_args(&w, &wide, &out, &ARGS)), "D = 8");

    let nan = scratch.path("nan.safetensors");
    let mut bad = values(16, 1.0, 7);
    bad[3] = f32::NAN;
    write_tensors(&nan, &[("h", Dtype::F32, vec![2, 8], f32_bytes(&bad))]);
    assert_clean_failure(&flashsample(&sample_args(&w, &nan, &out, &ARGS)), "finite");
}

/// `--device cuda` without a GPU says so in one line; with one it samples.
#[test]
fn cuda_device_without_a_gpu_is_a_one_line_error() {
    let scratch = Scratch::new("cuda");
    let (w, h) = inputs(&scratch, 20, 8, 2);
    let out = scratch.path("t.npy");
    let output = flashsample(&sample_on_default_device(
        &w,
        &h,
        &out,
        &["--device", "cuda", "--samples", "3", "--seed", "1", "--temperature", "1"],
    ));
    if !output.status.success() {
        assert_clean_failure(&output, "no CUDA device");
        assert_eq!(String::from_utf8_lossy(&output.stderr).lines().count(), 1);
    }
}

/// `--device auto` (the default) samples on the GPU or, without one, on the CPU, and says which
/// in exactly one line on standard error, before the summary, which names it too.
#[test]
fn device_auto_says_in_one_line_where_it_samples() {
    let scratch = Scratch::new("auto");
    let (w, h) = inputs(&scratch, 20, 8, 2);
    let out = scratch.path("t.npy");
    let output =
        flashsample(&sample_on_default_device(&w, &h, &out, &["--samples", "3", "--seed", "1", "--temperature", "1"]));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 2, "{stderr}");
    let on_gpu = lines[0].starts_with("flashsample: on GPU 0");
    assert!(on_gpu || lines[0].contains("on the CPU"), "{stderr}");
    let device = if on_gpu { " s on GPU 0 (" } else { " s on the CPU" };
    assert!(lines[1].starts_with("flashsample: wrote [2, 3] tokens to ") && lines[1].contains(device), "{stderr}");
    assert_eq!(read_npy_i64(Path::new(&out)).unwrap().0, 2);
}

/// A GPU ordinal past the machine's devices is an error naming `--gpu` (or, without a GPU,
/// the plain no-device error).
#[test]
fn gpu_ordinal_past_the_devices_names_the_flag() {
    let output = flashsample(&["demo", "--device", "cuda", "--gpu", "99"]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_clean_failure(&output, if stderr.contains("no CUDA device") { "no CUDA device" } else { "--gpu" });
}

/// Without a GPU the demo checks the CPU's draws against the exact softmax and says how to
/// run the GPU path; `--help` needs no driver either.
#[test]
fn cpu_demo_shows_frequencies_beside_the_softmax_and_a_p_value() {
    let output = flashsample(&["demo", "--device", "cpu"]);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    assert!(stdout.contains("frequency") && stdout.contains("softmax"), "{stdout}");
    assert!(stdout.contains("chi-square over all 1000 tokens") && stdout.contains("p = "), "{stdout}");
    assert!(stdout.contains("--device cuda"), "{stdout}");
    assert!(flashsample(&["--help"]).status.success());
}

/// The held-out exactness check's path: 4M draws at V = 131071 through the CLI on the GPU,
/// tested against the exact softmax (χ², bins pooled to ≥ 5 expected, α = 1e-3).
#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_cli_chi_square_v131071_4m_draws() {
    let scratch = Scratch::new("chi2");
    let (v, d) = (131_071, 32);
    let (wv, hv) = (values(v * d, 0.5, 11), values(d, 1.0, 12));
    let (w, h, out) = (scratch.path("w.safetensors"), scratch.path("h.safetensors"), scratch.path("t.npy"));
    write_tensors(&w, &[("weight", Dtype::BF16, vec![v, d], bf16_bytes(&wv))]);
    write_tensors(&h, &[("hidden", Dtype::BF16, vec![1, d], bf16_bytes(&hv))]);
    let draws = (1u32 << 22).to_string();
    let output = flashsample(&[
        "sample",
        "--lm-head",
        &w,
        "--hidden",
        &h,
        "--samples",
        &draws,
        "--seed",
        "2026",
        "--temperature",
        "1",
        "--device",
        "cuda",
        "--out",
        &out,
    ]);
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let (rows, cols, tokens) = read_npy_i64(Path::new(&out)).unwrap();
    assert_eq!((rows, cols), (1, 1 << 22));
    let mut counts = vec![0u64; v];
    tokens.iter().for_each(|&t| counts[t as usize] += 1);
    let logits: Vec<f64> = (0..v)
        .map(|i| {
            (0..d).map(|k| bf16::from_f32(wv[i * d + k]).to_f32() * bf16::from_f32(hv[k]).to_f32()).sum::<f32>() as f64
        })
        .collect();
    let max = logits.iter().cloned().fold(f64::MIN, f64::max);
    let weights: Vec<f64> = logits.iter().map(|l| (l - max).exp()).collect();
    let total: f64 = weights.iter().sum();
    let probabilities: Vec<f64> = weights.iter().map(|w| w / total).collect();
    let (statistic, dof, p) = chi_square(&counts, &probabilities);
    println!("CLI --device cuda: V={v} D={d} draws={}: chi2={statistic:.1} dof={dof} p={p:.4}", tokens.len());
    assert!(p > 1e-3, "chi2 = {statistic}, p = {p}");
}

/// Random argument lists (flags, values and files, good and bad, in any order) end in a
/// result or a message, never a panic: exit 0, 1 (our typed errors) or 2 (the parser's usage
/// errors), with an error or the usage in the message.
#[test]
fn random_arguments_never_panic() {
    use proptest::prelude::*;
    let scratch = Scratch::new("fuzz");
    let (w, h) = inputs(&scratch, 30, 8, 2);
    std::fs::write(scratch.path("junk.safetensors"), b"\x10\x00\x00\x00\x00\x00\x00\x00{\"w\": 1}").unwrap();
    // Processing inputs of the right shapes for V = 30, B = 2, and a file that is no `.npy`.
    write_npy(&scratch.path("bias.npy"), "<f4", &[30], f32_bytes(&values(30, 1.0, 7)));
    write_npy(&scratch.path("mask.npy"), "<i4", &[1], (-1i32).to_le_bytes().to_vec());
    write_npy(
        &scratch.path("history.npy"),
        "<i8",
        &[2, 2],
        [1i64, -1, 29, 3].iter().flat_map(|x| x.to_le_bytes()).collect(),
    );
    std::fs::write(scratch.path("junk.npy"), b"\x93NUMPY\x01\x00\xff\xff{").unwrap();
    let words: Vec<String> = [
        "sample",
        "report",
        "--lm-head",
        "--hidden",
        "--samples",
        "--seed",
        "--temperature",
        "--device",
        "--gpu",
        "--out",
        "--lm-head-tensor",
        "--hidden-tensor",
        "--bench",
        "--top-k",
        "--top-p",
        "--min-p",
        "--softcap",
        "--logprobs",
        "--processed-logprobs",
        "--bias",
        "--mask",
        "--history",
        "--repetition-penalty",
        "--frequency-penalty",
        "--presence-penalty",
        "--shards",
        "-1",
        "0",
        "1",
        "3",
        "4294967296",
        "1e-45",
        "nan",
        "inf",
        "cpu",
        "auto",
        "x",
        "",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([w.clone(), h.clone(), scratch.path("junk.safetensors"), scratch.path("out.npy"), scratch.path("")])
    .chain(["bias.npy", "mask.npy", "history.npy", "junk.npy"].map(|f| scratch.path(f)))
    .collect();
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig { cases: 96, ..ProptestConfig::default() });
    // Half the lists start with a whole `sample` command, so the words after it reach the
    // processing flags' checks and not only the parser's.
    let out = scratch.path("out.npy");
    let base = sample_args(&w, &h, &out, &ARGS);
    let strategy = (any::<bool>(), prop::collection::vec(prop::sample::select(words), 0..14));
    runner
        .run(&strategy, |(whole, words)| {
            let args: Vec<&str> =
                base.iter().copied().filter(|_| whole).chain(words.iter().map(String::as_str)).collect();
            // In the scratch folder: a word taken as an output path (`--logprobs 0`) writes there.
            let output = flashsample_command().current_dir(&scratch.0).args(&args).output().unwrap();
            let stderr = String::from_utf8_lossy(&output.stderr);
            prop_assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
            prop_assert!(matches!(output.status.code(), Some(0..=2)), "{args:?}: {:?} {stderr}", output.status);
            if !output.status.success() {
                prop_assert!(stderr.contains("error") || stderr.contains("Usage:"), "{args:?}: {stderr}");
            }
            Ok(())
        })
        .unwrap();
}

/// A float32 or int `.npy` (format 1.0) for the processing flags' inputs.
fn write_npy(path: &str, descr: &str, shape: &[usize], data: Vec<u8>) {
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let mut header = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': ({},), }}", dims.join(", "));
    let unpadded = 10 + header.len() + 1;
    header.push_str(&" ".repeat(unpadded.next_multiple_of(64) - unpadded));
    header.push('\n');
    let mut bytes = b"\x93NUMPY\x01\x00".to_vec();
    bytes.extend((header.len() as u16).to_le_bytes());
    bytes.extend(header.as_bytes());
    bytes.extend(data);
    std::fs::write(path, bytes).unwrap();
}

fn read_f32_npy(path: &str) -> (Vec<usize>, Vec<f32>) {
    match flashsample_cli::io::read_npy(Path::new(path), "test").unwrap() {
        (dims, flashsample_cli::io::NpyValues::F32(v)) => (dims, v),
        other => panic!("{other:?}"),
    }
}

/// The processing flags as a user gives them: a mask file allowing one token per row draws
/// it every time, with its log-probabilities written beside the tokens (raw: finite and
/// negative; processed: 0, the token's probability being 1); `--top-k 1` is the argmax; a
/// `[V]` bias of −inf on all but one token leaves that token; bad values and shapes are
/// refused naming the flag, before any output is written.
#[test]
fn processing_flags_sample_what_they_define_and_refuse_bad_values() {
    let scratch = Scratch::new("processing");
    let (v, d, b) = (70, 8, 2);
    let (w, h) = inputs(&scratch, v, d, b);
    let words = v.div_ceil(32);
    let (mask, bias, history) = (scratch.path("mask.npy"), scratch.path("bias.npy"), scratch.path("history.npy"));
    let mut mask_words = vec![0i32; b * words];
    mask_words[0] = 1 << 5; // row 0: token 5
    mask_words[words + 2] = 1 << 1; // row 1: token 65
    write_npy(&mask, "<i4", &[b, words], mask_words.iter().flat_map(|x| x.to_le_bytes()).collect());
    let bias_values: Vec<f32> = (0..v).map(|i| if i == 9 { 0.0 } else { f32::NEG_INFINITY }).collect();
    write_npy(&bias, "<f4", &[v], f32_bytes(&bias_values));
    write_npy(&history, "<i8", &[b, 3], [3i64, 3, -1, 70, 1, 2].iter().flat_map(|x| x.to_le_bytes()).collect());
    let (out, lp, plp) = (scratch.path("t.npy"), scratch.path("lp.npy"), scratch.path("plp.npy"));
    let run = |extra: &[&str]| {
        flashsample(&sample_args(
            &w,
            &h,
            &out,
            &[&["--samples", "6", "--seed", "3", "--temperature", "0.9"], extra].concat(),
        ))
    };

    let output = run(&["--mask", &mask, "--logprobs", &lp, "--processed-logprobs", &plp]);
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let (_, _, tokens) = read_npy_i64(Path::new(&out)).unwrap();
    assert_eq!(tokens, [5, 5, 5, 5, 5, 5, 65, 65, 65, 65, 65, 65]);
    let (dims, raw) = read_f32_npy(&lp);
    assert_eq!(dims, [b, 6]);
    assert!(raw.iter().all(|&x| x.is_finite() && x < 0.0), "{raw:?}");
    assert_eq!(read_f32_npy(&plp).1, vec![0.0; b * 6]);

    let output = run(&["--bias", &bias]);
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    assert!(read_npy_i64(Path::new(&out)).unwrap().2.iter().all(|&t| t == 9));

    let output = run(&["--top-k", "1"]);
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let greedy = flashsample(&sample_args(&w, &h, &lp, &["--samples", "6", "--seed", "3", "--temperature", "0"]));
    assert!(greedy.status.success());
    assert_eq!(read_npy_i64(Path::new(&out)).unwrap().2, read_npy_i64(Path::new(&lp)).unwrap().2);

    for (extra, message) in [
        (vec!["--top-k", "0"], "--top-k: 0: must be 1 to V = 70"),
        (vec!["--top-k", "71"], "--top-k: 71"),
        (vec!["--top-p", "1.5"], "--top-p: 1.5: must be in (0, 1]"),
        (vec!["--top-p", "0"], "--top-p"),
        (vec!["--min-p", "-0.5"], "--min-p: -0.5"),
        (vec!["--softcap", "-3"], "--softcap"),
        (vec!["--repetition-penalty", "1.2"], "--repetition-penalty: needs --history"),
        (vec!["--history", &history, "--repetition-penalty", "1.2"], "--history: row 1: token 70"),
        (vec!["--mask", &bias], "--mask"),
        (vec!["--bias", &mask], "--bias"),
        (vec!["--logprobs", &w], "--logprobs"),
    ] {
        assert_clean_failure(&run(&extra), message);
    }
    // A mask that leaves row 1 nothing: the row is named with its status, and no file is left.
    let none = scratch.path("none.npy");
    let mut words_none = mask_words.clone();
    words_none[words..].fill(0);
    write_npy(&none, "<i4", &[b, words], words_none.iter().flat_map(|x| x.to_le_bytes()).collect());
    let lonely = scratch.path("lonely.npy");
    let output = flashsample(&sample_args(
        &w,
        &h,
        &lonely,
        &["--samples", "2", "--seed", "1", "--temperature", "1", "--mask", &none],
    ));
    assert_clean_failure(&output, "1 row(s) have no token: row 1 (");
    assert_clean_failure(&output, "nothing was written");
    assert!(!Path::new(&lonely).exists() && !Path::new(&format!("{lonely}.partial")).exists());
    let wide = scratch.path("wide.npy");
    write_npy(&wide, "<i4", &[b, words + 1], vec![0; b * (words + 1) * 4]);
    assert_clean_failure(&run(&["--mask", &wide]), "must be [3] or [2, 3]");
}

/// `--shards S` samples W split into S vocabulary shards and merges them: the same tokens as
/// one shard (here with top-k and top-p, which need the shards' summaries); 0 and S > V are
/// refused naming the flag.
#[test]
fn shards_give_the_unsharded_tokens() {
    let scratch = Scratch::new("shards");
    let (w, h) = inputs(&scratch, 301, 8, 3);
    let (one, three) = (scratch.path("one.npy"), scratch.path("three.npy"));
    let flags = ["--samples", "20", "--seed", "4", "--temperature", "0.7", "--top-k", "50", "--top-p", "0.9"];
    let run =
        |out: &str, shards: &str| flashsample(&sample_args(&w, &h, out, &[&flags[..], &["--shards", shards]].concat()));
    assert!(run(&one, "1").status.success());
    let output = run(&three, "3");
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    assert_eq!(read_npy_i64(Path::new(&one)).unwrap(), read_npy_i64(Path::new(&three)).unwrap());
    assert_clean_failure(&run(&three, "0"), "--shards: 0: must be 1 to V = 301");
    assert_clean_failure(&run(&three, "302"), "--shards: 302");
}

/// The processing flags on the GPU: a mask leaves one token per row, the log-probabilities are
/// written, integer inputs (exact logits on both backends) give the CPU's tokens under every
/// truncation, `--shards 3` gives the CPU's tokens and log-probabilities with soft-cap and
/// the mask, and with every truncation, and more shards than blocks of 4 tokens are refused
/// naming the flag.
#[test]
#[ignore = "needs a CUDA GPU"]
fn processing_flags_on_the_gpu_give_the_cpu_tokens() {
    let scratch = Scratch::new("processing-gpu");
    let (v, d, b) = (70, 8, 2);
    let integers = |n: usize, seed: u64| -> Vec<f32> {
        (0..n).map(|k| ((k as u64 * 2_654_435_761 + seed) % 9) as f32 - 4.0).collect()
    };
    let (w, h) = (scratch.path("w.safetensors"), scratch.path("h.safetensors"));
    write_tensors(&w, &[("weight", Dtype::BF16, vec![v, d], bf16_bytes(&integers(v * d, 1)))]);
    write_tensors(&h, &[("hidden", Dtype::BF16, vec![b, d], bf16_bytes(&integers(b * d, 2)))]);
    let words = v.div_ceil(32);
    let mask = scratch.path("mask.npy");
    let mut mask_words = vec![0i32; b * words];
    mask_words[0] = 1 << 5;
    mask_words[words + 2] = 1 << 1;
    write_npy(&mask, "<i4", &[b, words], mask_words.iter().flat_map(|x| x.to_le_bytes()).collect());
    let (out, lp, plp, cpu) =
        (scratch.path("t.npy"), scratch.path("lp.npy"), scratch.path("plp.npy"), scratch.path("c.npy"));
    let run = |device: &str, out: &str, extra: &[&str]| {
        let flags = ["--device", device, "--samples", "50", "--seed", "3", "--temperature", "2"];
        flashsample(&sample_on_default_device(&w, &h, out, &[&flags[..], extra].concat()))
    };

    let output = run("cuda", &out, &["--mask", &mask, "--logprobs", &lp, "--processed-logprobs", &plp]);
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let (_, _, tokens) = read_npy_i64(Path::new(&out)).unwrap();
    assert_eq!(tokens, [[5; 50], [65; 50]].concat());
    let (dims, raw) = read_f32_npy(&lp);
    assert_eq!(dims, [b, 50]);
    assert!(raw.iter().all(|&x| x.is_finite() && x <= 0.0), "{raw:?}");
    assert_eq!(read_f32_npy(&plp).1, vec![0.0; b * 50]);

    let truncations = ["--top-k", "20", "--top-p", "0.8", "--min-p", "0.01", "--softcap", "30"];
    let output = run("cuda", &out, &truncations);
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    assert!(run("cpu", &cpu, &truncations).status.success());
    assert_eq!(read_npy_i64(Path::new(&out)).unwrap(), read_npy_i64(Path::new(&cpu)).unwrap());

    let cpu_lp = scratch.path("clp.npy");
    let sharded = |device: &str, out: &str, lp: &str| {
        run(device, out, &["--shards", "3", "--softcap", "3", "--mask", &mask, "--logprobs", lp])
    };
    assert!(sharded("cuda", &out, &lp).status.success());
    assert!(sharded("cpu", &cpu, &cpu_lp).status.success());
    assert_eq!(read_npy_i64(Path::new(&out)).unwrap(), read_npy_i64(Path::new(&cpu)).unwrap());
    let (gpu_lp, cpu_lp) = (read_f32_npy(&lp).1, read_f32_npy(&cpu_lp).1);
    assert!(gpu_lp.iter().zip(&cpu_lp).all(|(a, b)| (a - b).abs() <= 1e-5), "{gpu_lp:?} vs {cpu_lp:?}");

    let sharded_truncations = [&truncations[..], &["--shards", "3"]].concat();
    let output = run("cuda", &out, &sharded_truncations);
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    assert!(run("cpu", &cpu, &truncations).status.success());
    assert_eq!(read_npy_i64(Path::new(&out)).unwrap(), read_npy_i64(Path::new(&cpu)).unwrap());
    assert_clean_failure(&run("cuda", &out, &["--shards", "19"]), "--shards: 19: shards are whole blocks of 4 tokens");
}

/// The truncations on the GPU take every head the CPU takes: BF16, F16 and F32 with a D that is
/// no multiple of 8, and F32 with one that is; on integer inputs (exact logits on both
/// backends) each gives the CPU's tokens under top-k, top-p and min-p together, and under
/// top-p alone.
#[test]
#[ignore = "needs a CUDA GPU"]
fn truncations_on_the_gpu_take_every_dtype_and_width() {
    let scratch = Scratch::new("truncations-gpu");
    let (v, b) = (300, 3);
    let integers = |n: usize, seed: u64| -> Vec<f32> {
        (0..n).map(|k| ((k as u64 * 2_654_435_761 + seed) % 7) as f32 - 3.0).collect()
    };
    let f16_bytes = |x: &[f32]| -> Vec<u8> { x.iter().flat_map(|&x| half::f16::from_f32(x).to_le_bytes()).collect() };
    let (out, cpu) = (scratch.path("t.npy"), scratch.path("c.npy"));
    for (d, dtype) in [(13, Dtype::BF16), (13, Dtype::F16), (13, Dtype::F32), (8, Dtype::F32)] {
        let bytes = |x: &[f32]| match dtype {
            Dtype::BF16 => bf16_bytes(x),
            Dtype::F16 => f16_bytes(x),
            _ => f32_bytes(x),
        };
        let (w, h) = (scratch.path("w.safetensors"), scratch.path("h.safetensors"));
        write_tensors(&w, &[("weight", dtype, vec![v, d], bytes(&integers(v * d, 1)))]);
        write_tensors(&h, &[("hidden", dtype, vec![b, d], bytes(&integers(b * d, 2)))]);
        let run = |device: &str, out: &str, extra: &[&str]| {
            let flags = ["--device", device, "--samples", "40", "--seed", "5", "--temperature", "1.5"];
            flashsample(&sample_on_default_device(&w, &h, out, &[&flags[..], extra].concat()))
        };
        for truncation in [&["--top-k", "20", "--top-p", "0.8", "--min-p", "0.01"][..], &["--top-p", "0.5"]] {
            let output = run("cuda", &out, truncation);
            assert!(
                output.status.success(),
                "{dtype:?}, D = {d}, {truncation:?}: {}",
                String::from_utf8_lossy(&output.stderr)
            );
            assert!(run("cpu", &cpu, truncation).status.success());
            assert_eq!(
                read_npy_i64(Path::new(&out)).unwrap(),
                read_npy_i64(Path::new(&cpu)).unwrap(),
                "{dtype:?}, D = {d}, {truncation:?}"
            );
        }
    }
}

/// Two names for one file among the outputs, or between an output and an input, are refused
/// before any work, naming the flag and the rule: equal paths, another spelling of one path,
/// and an output named like another's temporary `.partial` file (which the final rename would
/// have put the other's bytes under). Nothing is written and no input is touched.
#[test]
fn colliding_outputs_are_refused_before_sampling() {
    let scratch = Scratch::new("collide");
    let (w, h) = inputs(&scratch, 20, 8, 2);
    let bias = scratch.path("bias.npy");
    write_npy(&bias, "<f4", &[20], f32_bytes(&[0.0; 20]));
    let (out, lp, plp) = (scratch.path("t.npy"), scratch.path("lp.npy"), scratch.path("plp.npy"));
    let (out_partial, lp_partial) = (format!("{out}.partial"), format!("{lp}.partial"));
    let input_as_partial = scratch.path("x.npy");
    let w_partial = format!("{input_as_partial}.partial");
    std::fs::copy(&w, &w_partial).unwrap();
    let w_bytes = std::fs::read(&w_partial).unwrap();
    // The same folder spelled another way: the paths are compared resolved.
    let respelled = scratch.0.join(".").join("t.npy.partial").display().to_string();
    for (out_path, extra, message) in [
        (&out, vec!["--logprobs", &out], format!("invalid --out: {out} is also --logprobs: each output needs a file")),
        (
            &out,
            vec!["--logprobs", &out_partial],
            format!("invalid --logprobs: {out_partial} is the name --out is written under until the run ends"),
        ),
        (&out, vec!["--logprobs", &respelled], "invalid --logprobs: ".to_string()),
        (&out, vec!["--processed-logprobs", &out_partial], "invalid --processed-logprobs: ".to_string()),
        (&out, vec!["--logprobs", &lp, "--processed-logprobs", &lp], format!("invalid --logprobs: {lp} is also")),
        (
            &out,
            vec!["--logprobs", &lp, "--processed-logprobs", &lp_partial],
            "invalid --processed-logprobs: ".to_string(),
        ),
        (&out, vec!["--processed-logprobs", &plp, "--logprobs", &h], "invalid --logprobs: ".to_string()),
        (&h, vec![], format!("invalid --out: {h} is also the input --hidden: it would be overwritten")),
        (&out, vec!["--bias", &bias, "--processed-logprobs", &bias], "is also the input --bias".to_string()),
        (
            &input_as_partial,
            vec!["--lm-head", &w_partial],
            format!(
                "invalid --out: {input_as_partial} is written as {w_partial} until the run ends, and that is the input --lm-head"
            ),
        ),
    ] {
        // `--lm-head` given twice is the parser's error: a colliding head replaces the default.
        let head = if extra.contains(&"--lm-head") { None } else { Some(["--lm-head", w.as_str()]) };
        let mut args = vec!["sample", "--hidden", &h, "--out", out_path, "--device", "cpu"];
        args.extend(head.iter().flatten());
        args.extend(ARGS);
        args.extend(&extra);
        let output = flashsample(&args);
        assert_clean_failure(&output, &message);
        for file in [&out, &lp, &plp, &out_partial, &lp_partial, &format!("{plp}.partial")] {
            assert!(!Path::new(file).exists(), "{file} written by {args:?}");
        }
    }
    assert_eq!(std::fs::read(&w_partial).unwrap(), w_bytes, "the input was not touched");
    assert!(std::fs::metadata(&h).unwrap().len() > 0 && std::fs::metadata(&bias).unwrap().len() > 0);
}

/// An existing output is replaced at the end of a successful run when it is writable; a
/// read-only one, or one that is no regular file, is refused before any work and left as it
/// is; `--help` says so.
#[test]
fn existing_outputs_are_replaced_only_when_writable() {
    let scratch = Scratch::new("existing");
    let (w, h) = inputs(&scratch, 20, 8, 2);
    let (out, lp) = (scratch.path("t.npy"), scratch.path("lp.npy"));
    std::fs::write(&out, b"old").unwrap();
    let output = flashsample(&sample_args(&w, &h, &out, &ARGS));
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    assert_eq!(read_npy_i64(Path::new(&out)).unwrap().0, 2, "the writable file was replaced");

    let read_only = |path: &str| {
        std::fs::write(path, b"keep").unwrap();
        let mut permissions = std::fs::metadata(path).unwrap().permissions();
        permissions.set_readonly(true);
        std::fs::set_permissions(path, permissions).unwrap();
    };
    read_only(&out);
    let output = flashsample(&sample_args(&w, &h, &out, &ARGS));
    assert_clean_failure(&output, &format!("invalid --out: {out} exists and is read-only"));
    assert_eq!(std::fs::read(&out).unwrap(), b"keep");
    read_only(&lp);
    let fresh = scratch.path("fresh.npy");
    let output = flashsample(&sample_args(&w, &h, &fresh, &[&ARGS[..], &["--logprobs", &lp]].concat()));
    assert_clean_failure(&output, &format!("invalid --logprobs: {lp} exists and is read-only"));
    assert_eq!(std::fs::read(&lp).unwrap(), b"keep");
    assert!(!Path::new(&fresh).exists() && !Path::new(&format!("{fresh}.partial")).exists());

    // A socket stands for any file that is not a regular one (a device, a pipe).
    let socket = scratch.path("socket");
    let _listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
    assert_clean_failure(
        &flashsample(&sample_args(&w, &h, &socket, &ARGS)),
        &format!("invalid --out: {socket} exists and is not a regular file"),
    );

    let help = String::from_utf8_lossy(&flashsample(&["sample", "--help"]).stdout).into_owned();
    assert!(help.contains("replacing an existing file if it is writable"), "{help}");
}

/// A missing, unreadable or truncated input file is an error naming its flag, then the file,
/// then what is wrong, for every input flag.
#[test]
fn input_file_errors_name_their_flag() {
    let scratch = Scratch::new("input-files");
    let (w, h) = inputs(&scratch, 20, 8, 2);
    let out = scratch.path("t.npy");
    let good_npy = [
        ("--bias", "<f4", vec![20], f32_bytes(&[0.0; 20])),
        ("--mask", "<i4", vec![1], (-1i32).to_le_bytes().to_vec()),
        ("--history", "<i8", vec![2, 1], [1i64, 2].iter().flat_map(|x| x.to_le_bytes()).collect()),
    ];
    let missing = scratch.path("missing");
    let folder = scratch.path("");
    let through_a_file = format!("{w}/inside");
    for flag in ["--lm-head", "--hidden", "--bias", "--mask", "--history"] {
        let good = match flag {
            "--lm-head" => w.clone(),
            "--hidden" => h.clone(),
            _ => {
                let (_, descr, shape, bytes) = good_npy.iter().find(|(f, ..)| *f == flag).unwrap();
                let path = scratch.path(&format!("{}.npy", &flag[2..]));
                write_npy(&path, descr, shape, bytes.clone());
                path
            }
        };
        let truncated = scratch.path(&format!("truncated-{}", &flag[2..]));
        let bytes = std::fs::read(&good).unwrap();
        std::fs::write(&truncated, &bytes[..bytes.len() - 3]).unwrap();
        let run = |file: &str| {
            let mut args = vec!["sample", "--out", &out, "--device", "cpu"];
            args.extend(ARGS);
            for (name, default) in [("--lm-head", &w), ("--hidden", &h)] {
                args.extend([name, if name == flag { file } else { default.as_str() }]);
            }
            if !["--lm-head", "--hidden"].contains(&flag) {
                args.extend([flag, file]);
            }
            flashsample(&args)
        };
        assert!(run(&good).status.success(), "{flag} {good}");
        assert_clean_failure(&run(&missing), &format!("error: invalid {flag}: {missing}: No such file"));
        assert_clean_failure(&run(&truncated), &format!("error: invalid {flag}: {truncated}: "));
        assert_clean_failure(&run(&through_a_file), &format!("error: invalid {flag}: {through_a_file}: "));
        assert_clean_failure(&run(&folder), &format!("error: invalid {flag}: {folder}"));
        // Without read permission (a superuser reads it anyway).
        let unreadable = scratch.path(&format!("unreadable-{}", &flag[2..]));
        std::fs::copy(&good, &unreadable).unwrap();
        std::fs::set_permissions(&unreadable, std::os::unix::fs::PermissionsExt::from_mode(0o000)).unwrap();
        if std::fs::read(&unreadable).is_err() {
            assert_clean_failure(&run(&unreadable), &format!("error: invalid {flag}: {unreadable}: Permission denied"));
        }
    }
}

/// Values that start with a hyphen but not a digit (`-inf`, `-nan`, `-.5`), infinities, NaN
/// and overflowing numbers reach each flag's rule, never the parser's "unexpected argument";
/// a forgotten value is still the parser's "a value is required".
#[test]
fn negative_and_infinite_numbers_reach_the_flags_rule() {
    let scratch = Scratch::new("numbers");
    let (w, h) = inputs(&scratch, 20, 8, 2);
    let out = scratch.path("t.npy");
    let history = scratch.path("history.npy");
    write_npy(&history, "<i8", &[2, 1], [1i64, 2].iter().flat_map(|x| x.to_le_bytes()).collect());
    let run = |extra: &[&str]| {
        let mut args = sample_args(&w, &h, &out, &["--samples", "1", "--seed", "1", "--history", &history]);
        args.extend(extra);
        flashsample(&args)
    };
    let mut cases = Vec::new();
    for t in ["-inf", "inf", "nan", "-nan", "-1e40", "1e40", "-.5", "-Infinity"] {
        cases.push((vec!["--temperature", t], "invalid --temperature: T = ".to_string()));
    }
    for (flag, rule) in [
        ("--top-p", "must be in (0, 1]"),
        ("--min-p", "must be in [0, 1]"),
        ("--softcap", "must be finite and > 0"),
        ("--repetition-penalty", "must be finite and > 0"),
        ("--frequency-penalty", "must be finite"),
        ("--presence-penalty", "must be finite"),
    ] {
        for value in ["-inf", "inf", "nan", "-1e40"] {
            let shown = if value == "nan" {
                "NaN"
            } else if value == "-1e40" {
                "-inf"
            } else {
                value
            };
            cases.push((vec!["--temperature", "1", flag, value], format!("invalid {flag}: {shown}: {rule}")));
        }
    }
    cases.push((vec!["--temperature=-inf"], "invalid --temperature: T = -inf".to_string()));
    // Integer flags: the parser names the flag and the value.
    cases.push((vec!["--temperature", "1", "--top-k", "-inf"], "invalid value '-inf' for '--top-k".to_string()));
    cases.push((vec!["--temperature", "1", "--gpu", "-nan"], "invalid value '-nan' for '--gpu".to_string()));
    cases.push((vec!["--temperature", "--top-k", "3"], "a value is required for '--temperature".to_string()));
    for (extra, message) in cases {
        let output = run(&extra);
        assert_clean_failure(&output, &message);
        assert!(!String::from_utf8_lossy(&output.stderr).contains("unexpected argument"), "{extra:?}");
    }
}

/// A successful run says in one line on standard error what it wrote, in how long and where;
/// standard output stays empty. A CPU run of several passes shows no progress bar where
/// standard error is no terminal.
#[test]
fn a_successful_run_summarises_on_standard_error() {
    let scratch = Scratch::new("summary");
    let (w, h) = inputs(&scratch, 20, 8, 3);
    let (out, lp, plp) = (scratch.path("t.npy"), scratch.path("lp.npy"), scratch.path("plp.npy"));
    let flags =
        ["--samples", "5", "--seed", "1", "--temperature", "1", "--logprobs", &lp, "--processed-logprobs", &plp];
    let output = flashsample(&sample_args(&w, &h, &out, &flags));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    assert!(output.stdout.is_empty());
    let expected = format!(
        "flashsample: wrote [3, 5] tokens to {out}, log-probabilities to {lp}, processed log-probabilities to {plp} in "
    );
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.starts_with(&expected) && stderr.trim_end().ends_with(" s on the CPU"), "{stderr}");

    // B · V = 2^22 and D = 8: passes of 4 draws, so 12 draws take 3 passes.
    let (wide_w, wide_h) = inputs(&scratch, 32_768, 8, 128);
    let output =
        flashsample(&sample_args(&wide_w, &wide_h, &out, &["--samples", "12", "--seed", "1", "--temperature", "1"]));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    assert_eq!(read_npy_i64(Path::new(&out)).unwrap().1, 12);
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.starts_with("flashsample: wrote [128, 12] tokens to "), "{stderr}");
}
