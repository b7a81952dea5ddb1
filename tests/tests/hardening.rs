//! The GPU at the edges: an LM head past 2³¹ elements, a batch of 4,096 rows, a request for
//! more memory than the card has, ten thousand decode steps of changing shapes, and the small
//! workload `compute-sanitizer` runs over every kernel variant (stage `sanitizer` of the GPU
//! bundle's run.sh). Ignored without a GPU.

use flashsample::cudarc::driver::result::mem_get_info;
use flashsample::internals::Variant;
use flashsample::{
    Batch, CudaSampler, DType, Draws, Elements, Error, LmHead, Matrix, Result, Sampled, Sampler, SamplingParams,
};
use flashsample_tests::processing::OnDevice;
use flashsample_tests::*;

/// Tokens computed elsewhere, offered to [`check_matches_cpu`] as a backend.
struct Fixed(Vec<u32>);

impl Backend for Fixed {
    fn name(&self) -> String {
        "cuda (tokens from the test)".into()
    }

    fn sample_shards(&self, _: &[Matrix], _: &Matrix, _: &Batch, draws: Draws) -> Result<Sampled> {
        Ok(Sampled {
            draws: draws.count as usize,
            tokens: self.0.clone(),
            logprobs: Vec::new(),
            processed_logprobs: Vec::new(),
            top_logprobs: Vec::new(),
            verdicts: Vec::new(),
        })
    }
}

/// `samples` plain draws of each row of `hidden` from `head` on `sampler`.
fn plain(sampler: &CudaSampler, head: &LmHead, hidden: &Matrix, params: &[SamplingParams], samples: u32) -> Vec<u32> {
    sampler.sample(head, hidden, &Batch::new(params.to_vec()), Draws::first(samples)).unwrap().tokens
}

/// bf16 matrices of one width, one under the other.
fn stack_bf16(parts: &[Matrix]) -> Matrix {
    let mut values = Vec::new();
    for part in parts {
        let Elements::BF16(part_values) = part.elements() else { panic!("bf16 parts") };
        values.extend_from_slice(part_values);
    }
    Matrix::new("hidden", values.len() / parts[0].cols(), parts[0].cols(), Elements::BF16(values)).unwrap()
}

fn sampler() -> CudaSampler {
    CudaSampler::new().expect("these tests need a CUDA GPU")
}

/// `W[262,147, 8,192]` bf16 holds 2,147,508,224 elements (4.3 GB): every offset past 2³¹
/// elements must be computed in 64 bits. Rows sample as on the CPU, and a greedy row whose
/// hidden state is one of the last rows of `W` gets that row.
#[test]
#[ignore = "needs a CUDA GPU"]
fn an_lm_head_past_2_pow_31_elements_samples_like_the_cpu() {
    let (vocab, dim) = (262_147, 8192);
    assert!(vocab * dim > 1 << 31);
    let sampler = sampler();
    let head = sampler.random_lm_head(vocab, dim, DType::BF16, 17, 0.05).unwrap();
    let w = sampler.lm_head_to_host(&head).unwrap();
    let random = sampler.hidden_to_host(&sampler.random_hidden(3, dim, DType::BF16, 18, 1.0).unwrap()).unwrap();
    let target = vocab - 3;
    let hidden = stack_bf16(&[random, w.row_range(target, target + 1)]);
    let mut params = params_for(4, 1.0, 19);
    params[3].temperature = 0.0;
    let tokens = plain(&sampler, &head, &hidden, &params, 8);
    assert!(tokens[24..].iter().all(|&t| t as usize == target), "greedy row: {:?}", &tokens[24..]);
    assert!(tokens.iter().any(|&t| t as usize > vocab / 2), "no token from the upper half: {tokens:?}");
    let disagreements = check_matches_cpu(&Fixed(tokens), &w, &hidden, &params, 8);
    assert!(disagreements <= 1, "{disagreements} near-tie disagreements");
}

/// B = 4,096: four rows of the batch (first, second, middle, last) get the tokens they get
/// alone, and those match the CPU.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_batch_of_4096_rows_samples_each_row_as_alone() {
    let (vocab, dim, batch, samples) = (151_936, 4096, 4096, 2u32);
    let sampler = sampler();
    let head = sampler.random_lm_head(vocab, dim, DType::BF16, 21, 0.05).unwrap();
    let hidden = sampler.hidden_to_host(&sampler.random_hidden(batch, dim, DType::BF16, 22, 1.0).unwrap()).unwrap();
    let params = params_for(batch, 0.9, 23);
    let tokens = plain(&sampler, &head, &hidden, &params, samples);
    let w = sampler.lm_head_to_host(&head).unwrap();
    for row in [0, 1, 2047, 4095] {
        let alone = plain(&sampler, &head, &hidden.row_range(row, row + 1), &params[row..row + 1], samples);
        let n = samples as usize;
        assert_eq!(alone, tokens[row * n..(row + 1) * n], "row {row}");
        let disagreements =
            check_matches_cpu(&Fixed(alone), &w, &hidden.row_range(row, row + 1), &params[row..row + 1], samples);
        assert!(disagreements <= 1, "row {row}: {disagreements} near-tie disagreements");
    }
}

/// An LM head of 2⁴⁸ bytes cannot be allocated: the error names the allocation, and the
/// sampler keeps working (the same tokens as a fresh sampler's).
#[test]
#[ignore = "needs a CUDA GPU"]
fn more_memory_than_the_card_has_is_an_error_and_the_sampler_stays_usable() {
    let sampler = sampler();
    let error = sampler.random_lm_head(1 << 30, 1 << 17, DType::BF16, 1, 0.05).expect_err("2^48 bytes do not fit");
    assert!(matches!(&error, Error::Cuda { call, .. } if call.contains("cuMemAllocAsync")), "{error}");
    let w = random_matrix(1000, 64, DType::BF16, 0.3, 2);
    let h = random_matrix(3, 64, DType::BF16, 1.0, 3);
    let params = params_for(3, 1.0, 4);
    let after = plain(&sampler, &sampler.upload_lm_head(&w).unwrap(), &h, &params, 5);
    let fresh = CudaSampler::new().unwrap();
    let expected = plain(&fresh, &fresh.upload_lm_head(&w).unwrap(), &h, &params, 5);
    assert_eq!(after, expected);
    sampler.close().unwrap();
}

/// Ten thousand decode steps whose batch size, temperatures and step counters change every
/// step: every step's tokens are read back (a fault or a missing token fails the step), every
/// 100th step's first rows are checked against the CPU, and the device's free memory is the
/// same before and after.
#[test]
#[ignore = "needs a CUDA GPU"]
fn ten_thousand_decode_steps_change_shapes_and_leak_nothing() {
    let (vocab, dim, steps) = (32_000, 1024, 10_000u32);
    let sampler = sampler();
    let head = sampler.random_lm_head(vocab, dim, DType::BF16, 31, 0.05).unwrap();
    let w = sampler.lm_head_to_host(&head).unwrap();
    let temperatures = [0.0, 0.5, 1.0, 1.7];
    let step = |s: u32| -> (Vec<u32>, Option<Matrix>, Vec<SamplingParams>) {
        let batch = 1 + (s as usize * 7919) % 64;
        let hidden = sampler.random_hidden(batch, dim, DType::BF16, s as u64, 1.0).unwrap();
        let params: Vec<_> =
            (0..batch).map(|b| SamplingParams::new(temperatures[(s as usize + b) % 4], 41, b as u32, s)).collect();
        let rows = sampler.upload_batch(&Batch::new(params.clone()), vocab).unwrap();
        let mut tokens = sampler.outputs(&rows, 1).unwrap();
        sampler.sample_into(&head, &hidden, &rows, Draws::first(1), &mut tokens).unwrap();
        let host = sampler.read(&tokens).unwrap().tokens;
        assert!(host.iter().all(|&t| (t as usize) < vocab), "step {s}");
        let hidden = s.is_multiple_of(100).then(|| sampler.hidden_to_host(&hidden).unwrap());
        (host, hidden, params)
    };
    // Warm: the workspace grows to the largest batch once.
    for s in 0..64 {
        step(s);
    }
    sampler.synchronize("warm-up").unwrap();
    let (free_before, _) = mem_get_info().unwrap();
    let mut disagreements = 0;
    for s in 0..steps {
        let (tokens, hidden, params) = step(s);
        if let Some(hidden) = hidden {
            let rows = hidden.rows().min(4);
            disagreements +=
                check_matches_cpu(&Fixed(tokens[..rows].to_vec()), &w, &hidden.row_range(0, rows), &params[..rows], 1);
        }
    }
    sampler.synchronize("the soak").unwrap();
    let (free_after, _) = mem_get_info().unwrap();
    assert!(disagreements <= 2, "{disagreements} near-tie disagreements");
    let lost = free_before.saturating_sub(free_after);
    assert!(lost <= 4 << 20, "{lost} bytes of device memory fewer after {steps} steps");
}

/// The workload of the bundle's `sanitizer` stage: every kernel variant the module has (the
/// unfused pipeline too) on a prime vocabulary, D not a multiple of 8 for the SIMT tile, and
/// B = 1, 37 and 1023, each checked against the CPU; then processed sampling with every
/// processing mode in one batch, with log-probabilities (and top ones; also over a vocabulary
/// whose rows the processing pipeline splits into slices, and over three vocabulary shards)
/// and in place without them, and the per-entry modes in the fused tile of every variant.
#[test]
#[ignore = "needs a CUDA GPU"]
fn sanitizer_workload_every_variant_on_odd_shapes() {
    let module = sampler().module();
    let mut variants: Vec<Variant> = Variant::tensor_core(module).collect();
    variants.push(Variant::Simt);
    for variant in variants {
        let dim = if variant == Variant::Simt { 199 } else { 200 };
        for batch in [1, 37] {
            let w = random_matrix(1009, dim, DType::BF16, 0.3, 51);
            let h = random_matrix(batch, dim, DType::BF16, 1.0, 52);
            check_matches_cpu(&Cuda::new(variant), &w, &h, &params_for(batch, 1.0, 53), 3);
        }
    }
    let w = random_matrix(1009, 136, DType::F16, 0.3, 54);
    let h = random_matrix(1023, 136, DType::F16, 1.0, 55);
    check_matches_cpu(&Cuda::new(Variant::Auto), &w, &h, &params_for(1023, 0.7, 56), 2);
    let sampler = sampler();
    let head = sampler.upload_lm_head(&w).unwrap();
    let hidden = sampler.upload_hidden(&h).unwrap();
    let rows = sampler.upload_batch(&Batch::new(params_for(1023, 0.7, 56)), 1009).unwrap();
    let mut tokens = sampler.outputs(&rows, 2).unwrap();
    sampler.sample_unfused_into(&head, &hidden, &rows, Draws::first(2), Variant::Auto, &mut tokens).unwrap();
    assert!(sampler.read(&tokens).unwrap().tokens.iter().all(|&t| t < 1009));
    let modes = flashsample_tests::processing::each_mode(1009);
    let processing: Vec<flashsample::Processing> = modes
        .iter()
        .enumerate()
        .map(|(r, m)| flashsample::Processing { logprobs: true, top_logprobs: [20, 0, 3][r % 3], ..m.1.clone() })
        .collect();
    let params = params_for(modes.len(), 0.7, 57);
    let batch = h.row_range(0, modes.len());
    let processed = Batch::with_processing(params.clone(), processing.clone());
    let sampled = sampler.sample(&head, &batch, &processed, Draws::first(3)).unwrap();
    assert!(sampled.tokens.iter().all(|&t| t < 1009), "{:?}", sampled.tokens);
    // A vocabulary the processing pipeline splits into several slices per row.
    let long_vocab = 4099;
    let long_head = sampler.upload_lm_head(&random_matrix(long_vocab, 136, DType::F16, 0.3, 58)).unwrap();
    let long_processing: Vec<flashsample::Processing> = flashsample_tests::processing::each_mode(long_vocab)
        .into_iter()
        .enumerate()
        .map(|(r, m)| flashsample::Processing { logprobs: true, top_logprobs: [20, 0, 3][r % 3], ..m.1 })
        .collect();
    let long_batch = Batch::with_processing(params.clone(), long_processing);
    let long_sampled = sampler.sample(&long_head, &batch, &long_batch, Draws::first(3)).unwrap();
    assert!(long_sampled.tokens.iter().all(|&t| t < long_vocab as u32), "{:?}", long_sampled.tokens);
    // In place, without log-probabilities (so without top ones).
    let without_top: Vec<flashsample::Processing> =
        processing.iter().map(|p| flashsample::Processing { logprobs: false, top_logprobs: 0, ..p.clone() }).collect();
    let in_place = OnDevice::new(&sampler, &w, &batch, &params, &without_top);
    assert_eq!(in_place.sample(&sampler, 3, false).unwrap().tokens, sampled.tokens);
    // The per-entry modes alone run in the fused tile of every variant, with log-probabilities
    // (the tiles' per-tile terms and the winners' dot products) and without.
    let per_entry: Vec<flashsample::Processing> = (0..modes.len()).map(|r| without_top[r % 4].clone()).collect();
    let fused = OnDevice::new(&sampler, &w, &batch, &params, &per_entry);
    let mut variants: Vec<Variant> = Variant::tensor_core(sampler.module()).collect();
    variants.push(Variant::Simt);
    for &variant in &variants {
        sampler.set_variant(variant);
        for logprobs in [false, true] {
            match fused.sample(&sampler, 3, logprobs) {
                Ok(sampled) => assert!(sampled.tokens.iter().all(|&t| t < 1009)),
                Err(e) => assert!(e.to_string().contains("does not apply per-row processing"), "{variant:?}: {e}"),
            }
        }
    }
    // Three vocabulary shards: materialised with log-probabilities, every mode (the
    // truncations decided by the shards together, in segments), then fused per variant with
    // and without them.
    sampler.set_variant(Variant::Auto);
    let bounds = flashsample::VocabShard::bounds(1009, 3).unwrap();
    let parts: Vec<Matrix> = bounds.windows(2).map(|b| w.row_range(b[0], b[1])).collect();
    let sharded_head = sampler.upload_lm_head_shards(&parts).unwrap();
    let sharded = sampler.sample(&sharded_head, &batch, &processed, Draws::first(3)).unwrap();
    assert_eq!(sharded.tokens, sampled.tokens);
    for (&variant, logprobs) in variants.iter().flat_map(|v| [(v, false), (v, true)]) {
        sampler.set_variant(variant);
        let reporting = fused.batch_reporting(&sampler, logprobs).unwrap();
        let mut out = sampler.outputs(&reporting, 3).unwrap();
        match sampler.sample_into(&sharded_head, &fused.hidden, &reporting, Draws::first(3), &mut out) {
            Ok(()) => {}
            Err(e) if e.to_string().contains("does not apply per-row processing") => continue,
            Err(e) => panic!("{variant:?}: {e}"),
        }
    }
    sampler.synchronize("sharded sampling").unwrap();
    // The listed path (top-k on every row, no log-probabilities) on its tiles: random logits,
    // whose lists settle, and integer ones with many ties, whose rows the gated fallback
    // samples from their logits.
    let listed: Vec<flashsample::Processing> = (0..modes.len())
        .map(|r| flashsample::Processing {
            top_k: Some([1, 5, 40][r % 3]),
            top_p: [1.0, 0.9][r % 2],
            min_p: [0.0, 0.05][r % 2],
            ..without_top[r % 4].clone()
        })
        .collect();
    let tied = flashsample_tests::processing::integer_matrix(1009, 136, 59).to_dtype(DType::F16);
    let mut listing = vec![Variant::Auto, Variant::Simt];
    if sampler.module() == flashsample::Module::Hopper {
        listing.push(Variant::TmaHandoff { columns: 64 });
    }
    for head in [&w, &tied] {
        for &variant in &listing {
            sampler.set_variant(variant);
            let on_device = OnDevice::new(&sampler, head, &batch, &params, &listed);
            assert!(on_device.sample(&sampler, 3, false).unwrap().tokens.iter().all(|&t| t < 1009));
        }
    }
    // The chained path (min-p alone on every row, no log-probabilities) on its tiles, at
    // temperatures from peaked rows to flat ones whose chains leave rows to the fallback.
    let chained: Vec<flashsample::Processing> = (0..modes.len())
        .map(|r| flashsample::Processing { min_p: [0.05, 0.2, 0.01][r % 3], ..without_top[r % 4].clone() })
        .collect();
    for temperature in [1.0, 1.7, 3.0] {
        let params = params_for(modes.len(), temperature, 60);
        // Named tiles chain at any B; the dispatcher's only up to eight rows.
        let variants = [Variant::Auto, Variant::Mma { columns: 8 }, Variant::Staged { columns: 64 }, Variant::Simt];
        for variant in variants {
            sampler.set_variant(variant);
            let on_device = OnDevice::new(&sampler, &w, &batch, &params, &chained);
            assert!(on_device.sample(&sampler, 3, false).unwrap().tokens.iter().all(|&t| t < 1009));
        }
    }
    sampler.set_variant(Variant::Auto);
}
