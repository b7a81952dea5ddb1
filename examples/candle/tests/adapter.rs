//! The candle adapter with a real model's code: a Qwen2 from candle-transformers (random
//! weights, D = 1024, V = 32,000) decodes a few steps, and the adapter draws each next token
//! from the model's final hidden states. The GPU tests are ignored without a GPU; the CPU test
//! runs wherever the binary starts (it links the CUDA libraries candle's CUDA backend links,
//! but only CUDA tensors call them).

use candle_core::{DType, Device, Module as _, Tensor};
use flashsample::{
    Batch, CandleSampled, CandleSampler, CpuSampler, CudaSampler, Draws, Elements, Matrix, NO_TOKEN, Penalties,
    Processing, Sampled, Sampler, SamplingParams,
};
use flashsample_candle_example::{TinyQwen2, tiny_qwen2};
use flashsample_tests::chi_square;

const ALPHA: f64 = 1e-3;
const BATCH: usize = 4;

/// The model on `device` and a prompt of 6 tokens per row.
fn model_on(device: &Device) -> (TinyQwen2, Tensor) {
    let tiny = tiny_qwen2(device, DType::BF16).unwrap();
    let vocab = tiny.config.vocab_size as u32;
    let prompt: Vec<u32> = (0..BATCH * 6).map(|i| (i as u32 * 40_503 + 7) % vocab).collect();
    let input = Tensor::from_vec(prompt, (BATCH, 6), device).unwrap();
    (tiny, input)
}

fn gpu_model() -> (Device, TinyQwen2, Tensor) {
    let device = Device::new_cuda(0).expect("these tests need a CUDA GPU");
    let (tiny, input) = model_on(&device);
    (device, tiny, input)
}

/// candle's own LM head logits for `hidden`, in f32, on the host.
fn candle_logits(hidden: &Tensor, lm_head: &Tensor) -> Vec<Vec<f32>> {
    let head = candle_nn::Linear::new(lm_head.to_dtype(DType::F32).unwrap(), None);
    head.forward(&hidden.to_dtype(DType::F32).unwrap()).unwrap().to_vec2::<f32>().unwrap()
}

fn to_matrix(name: &str, tensor: &Tensor) -> Matrix {
    let (rows, cols) = tensor.dims2().unwrap();
    let values = tensor.contiguous().unwrap().flatten_all().unwrap().to_vec1::<half::bf16>().unwrap();
    Matrix::new(name, rows, cols, Elements::BF16(values)).unwrap()
}

fn flat_u32(tensor: &Tensor) -> Vec<u32> {
    tensor.flatten_all().unwrap().to_vec1::<u32>().unwrap()
}

/// Bits, so that NaN and signed zeros compare too.
fn flat_bits(tensor: &Tensor) -> Vec<u32> {
    tensor.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|v| v.to_bits()).collect()
}

fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|v| v.to_bits()).collect()
}

/// The adapter's tensors hold what `want` holds: the tokens, and the log-probabilities exactly
/// when `want` has them (the batch reports them), bit for bit, with each row's top entries as
/// (token, bits) pairs followed by unused slots of `NO_TOKEN` and −∞.
fn assert_same_results(got: &CandleSampled, want: &Sampled) {
    assert_eq!(flat_u32(&got.tokens), want.tokens, "tokens");
    let (Some(logprobs), Some(processed), Some(top)) = (&got.logprobs, &got.processed_logprobs, &got.top_logprobs)
    else {
        assert!(want.logprobs.is_empty(), "the batch reports log-probabilities; the adapter returned none");
        assert!(
            got.logprobs.is_none() && got.processed_logprobs.is_none() && got.top_logprobs.is_none(),
            "log-probabilities come all together or not at all"
        );
        return;
    };
    assert!(!want.logprobs.is_empty(), "log-probabilities for a batch that reports none");
    assert_eq!(flat_bits(logprobs), bits(&want.logprobs), "raw log-probabilities");
    assert_eq!(flat_bits(processed), bits(&want.processed_logprobs), "processed log-probabilities");
    let (rows, slots, pair) = top.dims3().unwrap();
    assert_eq!((rows, pair), (want.rows(), 2), "top log-probabilities' shape");
    let top = flat_u32(top);
    for (b, row) in want.top_logprobs.iter().enumerate() {
        let unused = std::iter::repeat_n((NO_TOKEN, f32::NEG_INFINITY), slots - row.len());
        let expected: Vec<u32> = row.iter().copied().chain(unused).flat_map(|(t, lp)| [t, lp.to_bits()]).collect();
        assert_eq!(&top[b * 2 * slots..(b + 1) * 2 * slots], &expected[..], "row {b}'s top log-probabilities");
    }
}

/// (a) Greedy rows equal the argmax of candle's logits, step after step (a token may differ
/// only where two logits tie within f32 rounding of the two summation orders).
#[test]
#[ignore = "needs a CUDA GPU"]
fn greedy_tokens_are_the_argmax_of_candles_logits() {
    let (device, mut tiny, mut input) = gpu_model();
    let batch = Batch::new((0..BATCH).map(|b| SamplingParams::new(0.0, 1, b as u32, 0)).collect());
    let mut sampler = CandleSampler::new(&device, &batch).unwrap();
    let mut offset = 0;
    let (mut exact, mut near_ties) = (0, 0);
    for step in 0..4 {
        let hidden = tiny.last_hidden(&input, offset).unwrap();
        offset += input.dim(1).unwrap();
        let tokens = sampler.sample(&tiny.lm_head, &hidden, 1).unwrap().tokens;
        let got = tokens.to_vec2::<u32>().unwrap();
        for (b, logits) in candle_logits(&hidden, &tiny.lm_head).iter().enumerate() {
            let argmax = (0..logits.len()).max_by(|&i, &j| logits[i].total_cmp(&logits[j])).unwrap();
            let token = got[b][0] as usize;
            if token == argmax {
                exact += 1;
            } else {
                let gap = logits[argmax] - logits[token];
                assert!(
                    gap <= 1e-3 * logits[argmax].abs().max(1.0),
                    "step {step}, row {b}: {token} vs {argmax}, gap {gap}"
                );
                near_ties += 1;
            }
        }
        sampler.advance_steps(1).unwrap();
        input = tokens;
    }
    assert!(near_ties <= 1, "{exact} exact, {near_ties} near ties");
}

/// (b) 200,000 draws from one step's hidden states follow the softmax of candle's logits
/// (computed in f64 on the host): χ² at α = 1e-3, for T = 1 and T = 0.6.
#[test]
#[ignore = "needs a CUDA GPU"]
fn draws_follow_the_softmax_of_candles_logits() {
    let (device, mut tiny, input) = gpu_model();
    let hidden = tiny.last_hidden(&input, 0).unwrap();
    let logits = candle_logits(&hidden, &tiny.lm_head);
    let draws = 200_000u32;
    for (row, temperature) in [(0usize, 1.0f32), (2, 0.6)] {
        let batch = Batch::new(vec![SamplingParams::new(temperature, 1234, row as u32, 3)]);
        let mut sampler = CandleSampler::new(&device, &batch).unwrap();
        let one = hidden.narrow(0, row, 1).unwrap();
        let tokens = sampler.sample(&tiny.lm_head, &one, draws).unwrap().tokens.to_vec2::<u32>().unwrap();
        let mut counts = vec![0u64; logits[row].len()];
        for &t in &tokens[0] {
            counts[t as usize] += 1;
        }
        let scaled: Vec<f64> = logits[row].iter().map(|&l| l as f64 / temperature as f64).collect();
        let max = scaled.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let weights: Vec<f64> = scaled.iter().map(|s| (s - max).exp()).collect();
        let total: f64 = weights.iter().sum();
        let probabilities: Vec<f64> = weights.iter().map(|w| w / total).collect();
        let (statistic, dof, p) = chi_square(&counts, &probabilities);
        println!("row {row}, T = {temperature}: chi2 = {statistic:.1}, dof = {dof}, p = {p:.4}");
        assert!(p > ALPHA, "row {row}, T = {temperature}: chi2 = {statistic:.1}, dof = {dof}, p = {p}");
    }
}

/// (c) The adapter's tokens equal the owned API's for the same hidden states, weights and
/// keys (the adapter reads the model's strided view in place; the owned API gets a copy).
#[test]
#[ignore = "needs a CUDA GPU"]
fn adapter_tokens_equal_the_owned_apis() {
    let (device, mut tiny, input) = gpu_model();
    let hidden = tiny.last_hidden(&input, 0).unwrap();
    assert!(!hidden.is_contiguous(), "the model's last position is a strided view");
    let batch = Batch::new((0..BATCH).map(|b| SamplingParams::new(0.9, 77, b as u32, 5)).collect());
    let mut sampler = CandleSampler::new(&device, &batch).unwrap();
    let adapter = flat_u32(&sampler.sample(&tiny.lm_head, &hidden, 64).unwrap().tokens);
    let owned = CudaSampler::new().unwrap();
    let head = owned.upload_lm_head(&to_matrix("lm_head", &tiny.lm_head)).unwrap();
    let tokens = owned.sample(&head, &to_matrix("hidden", &hidden), &batch, Draws::first(64)).unwrap().tokens;
    assert_eq!(adapter, tokens);
}

/// CPU tensors go to the CPU sampler: the same tokens as `CpuSampler` on the same values, on
/// the CPU, with no log-probabilities for a plain batch; then, with one row asking for its top
/// raw entries (and a top-k), the batch's log-probabilities and top entries as `CpuSampler`
/// reports them. The model runs on candle's CPU backend: no GPU needed.
#[test]
fn cpu_tensors_are_sampled_on_the_cpu() {
    let (mut tiny, input) = model_on(&Device::Cpu);
    let hidden = tiny.last_hidden(&input, 0).unwrap();
    let params: Vec<_> = (0..BATCH).map(|b| SamplingParams::new(1.0, 5, b as u32, 0)).collect();
    let plain = Batch::new(params.clone());
    let mut processing = vec![Processing::default(); BATCH];
    processing[1] = Processing { top_k: Some(40), top_logprobs: 3, ..Processing::default() };
    let reporting = Batch::with_processing(params, processing);
    let cpu = CpuSampler::new();
    let head = cpu.upload_lm_head(&to_matrix("lm_head", &tiny.lm_head)).unwrap();
    let mut sampler = CandleSampler::new(&Device::Cpu, &plain).unwrap();
    for batch in [&plain, &reporting] {
        sampler.set_batch(batch).unwrap();
        let got = sampler.sample(&tiny.lm_head, &hidden, 8).unwrap();
        assert!(got.tokens.device().is_cpu());
        let want = cpu.sample(&head, &to_matrix("hidden", &hidden), batch, Draws::first(8)).unwrap();
        assert_eq!(want.logprobs.is_empty(), !batch.reports_logprobs());
        assert_same_results(&got, &want);
    }
}

/// Per-row processing in the adapter on candle's stream gives the owned API's results: every
/// mode (soft-cap alone stays in the fused tiles, with log-probabilities too; bias with top-k,
/// the mask with top-p and top raw log-probabilities, penalties with min-p take the
/// materialised path). A batch that reports no log-probabilities gives tokens alone, equal to
/// the owned API's; with every row reporting them, the tokens, both log-probabilities (bit
/// for bit) and the top entries equal `CudaSampler`'s.
#[test]
#[ignore = "needs a CUDA GPU"]
fn adapter_processing_equals_the_owned_apis() {
    let (device, mut tiny, input) = gpu_model();
    let hidden = tiny.last_hidden(&input, 0).unwrap();
    let vocab = tiny.config.vocab_size;
    let params: Vec<_> = (0..BATCH).map(|b| SamplingParams::new(0.9, 78, b as u32, 2)).collect();
    let mut mask = vec![0u32; vocab.div_ceil(32)];
    (0..vocab).filter(|i| i % 3 != 0).for_each(|i| mask[i / 32] |= 1 << (i % 32));
    let per_entry = vec![
        Processing { softcap: Some(1.0), ..Processing::default() },
        Processing { bias: (0..vocab as u32).step_by(97).map(|t| (t, 3.0)).collect(), ..Processing::default() },
        Processing { mask: Some(mask), ..Processing::default() },
        Processing {
            history: (0..300u32).map(|i| i * 7919 % vocab as u32).collect(),
            penalties: Penalties { repetition: 1.3, frequency: 0.5, presence: 0.5 },
            ..Processing::default()
        },
    ];
    let mut truncating = per_entry.clone();
    truncating[1].top_k = Some(50);
    (truncating[2].top_p, truncating[2].top_logprobs) = (0.8, 5);
    truncating[3].min_p = 0.1;
    let owned = CudaSampler::new().unwrap();
    let head = owned.upload_lm_head(&to_matrix("lm_head", &tiny.lm_head)).unwrap();
    let owned_hidden = to_matrix("hidden", &hidden);
    let owned_sample = |batch: &Batch| owned.sample(&head, &owned_hidden, batch, Draws::first(32)).unwrap();
    let mut sampler = CandleSampler::new(&device, &Batch::new(params.clone())).unwrap();
    for processing in [&per_entry, &truncating] {
        let silent = Batch::with_processing(params.clone(), processing.clone());
        // A row that asks for top entries reports log-probabilities: no tokens-only call then.
        if !silent.reports_logprobs() {
            sampler.set_batch(&silent).unwrap();
            let got = sampler.sample(&tiny.lm_head, &hidden, 32).unwrap();
            assert_same_results(&got, &owned_sample(&silent));
        }
        let reported = processing.iter().map(|p| Processing { logprobs: true, ..p.clone() }).collect();
        let reporting = Batch::with_processing(params.clone(), reported);
        sampler.set_batch(&reporting).unwrap();
        let got = sampler.sample(&tiny.lm_head, &hidden, 32).unwrap();
        let want = owned_sample(&reporting);
        for (b, row) in want.top_logprobs.iter().enumerate() {
            assert_eq!(row.len(), processing[b].top_logprobs as usize, "row {b}");
        }
        assert_same_results(&got, &want);
    }
}
