//! Logit processing and log-probabilities on the CPU backend and (module `gpu`, ignored
//! without a GPU) the GPU: every mode against its exact target distribution (χ², α = 1e-3), the
//! boundary cases, log-probabilities against f64, the mixed batch, and the GPU's fused and
//! materialised paths against each other and the CPU.

use flashsample::DType;
use flashsample::Variant;
use flashsample_tests::processing::{
    OnDevice, assert_log_probabilities, check_every_mode, check_log_probabilities, check_mixed_batch,
    check_processing_edges, check_shards, check_top_k_keeps_ties, each_mode, integer_matrix,
    largest_log_probability_difference, split_rows, uneven_bounds,
};
use flashsample_tests::{Cpu, Cuda, matrix_of, random_matrix};

const ALPHA: f64 = 1e-3;

/// Small V: 30,000 draws per mode; a 5 % error in the kept mass (mass moved between the kept
/// set's halves, or onto a dropped token, which fails at once) moves χ² by about
/// 30,000 · 0.05² / 0.25 = 300 against a standard deviation of √(2·dof) ≈ 45 at 1000 bins.
#[test]
fn every_mode_samples_its_target_distribution_small_vocab() {
    let w = random_matrix(1000, 32, DType::BF16, 0.5, 41);
    let h = random_matrix(1, 32, DType::BF16, 1.0, 42);
    check_every_mode(&Cpu, &w, &h, 0.8, 30_000, ALPHA);
}

/// V = 100,003 (a prime): 2,000 draws per mode, each costing a full pass over V; the
/// truncating modes keep few enough tokens for χ² to have power there.
#[test]
fn every_mode_samples_its_target_distribution_large_vocab() {
    let w = random_matrix(100_003, 16, DType::BF16, 2.0, 43);
    let h = random_matrix(1, 16, DType::BF16, 1.0, 44);
    check_every_mode(&Cpu, &w, &h, 0.5, 2_000, ALPHA);
}

#[test]
fn processing_edges() {
    let w = random_matrix(777, 24, DType::F32, 0.5, 45);
    let h = random_matrix(2, 24, DType::F32, 1.0, 46);
    check_processing_edges(&Cpu, &w, &h);
}

#[test]
fn top_k_keeps_every_token_tied_at_the_kth_value() {
    let (vocab, dim) = (500, 4);
    // Column 0 holds the logits (H = [1, 0, 0, 0]): 2 at tokens 0–2, 1 at token 3, then
    // decreasing below 1.
    let logit = |i: usize| match i {
        0..=2 => 2.0,
        3 => 1.0,
        _ => 1.0 - i as f32 * 1e-3,
    };
    let w: Vec<f32> = (0..vocab * dim).map(|k| if k % dim == 0 { logit(k / dim) } else { 0.3 }).collect();
    let h = matrix_of(1, dim, DType::F32, vec![1.0, 0.0, 0.0, 0.0]);
    check_top_k_keeps_ties(&Cpu, &matrix_of(vocab, dim, DType::F32, w), &h, ALPHA);
}

#[test]
fn log_probabilities_match_f64() {
    let w = random_matrix(5003, 32, DType::BF16, 0.5, 47);
    let h = random_matrix(8, 32, DType::BF16, 1.0, 48);
    check_log_probabilities(&Cpu, &w, &h, 1e-4);
}

#[test]
fn every_row_of_a_mixed_batch_gets_what_it_gets_alone() {
    let w = random_matrix(3001, 16, DType::F16, 0.5, 49);
    let h = random_matrix(8, 16, DType::F16, 1.0, 50);
    check_mixed_batch(&Cpu, &w, &h);
}

/// W split by vocabulary into 2, 3 and 8 uneven shards, bounds inside Philox blocks: every
/// mode in one batch gives the unsharded tokens and log-probabilities, also on integer logits,
/// where top-k and top-p cut through values tied across shards.
#[test]
fn shards_give_the_unsharded_tokens_and_log_probabilities() {
    let (vocab, dim) = (5003, 16);
    let w = random_matrix(vocab, dim, DType::BF16, 1.0, 51);
    let modes = each_mode(vocab);
    let h = random_matrix(modes.len(), dim, DType::BF16, 1.0, 52);
    check_shards(&Cpu, &w, &h, &modes, 1, true);
    let (w, h) = (integer_matrix(vocab, dim, 53), integer_matrix(modes.len(), dim, 54));
    check_shards(&Cpu, &w.to_dtype(DType::BF16), &h.to_dtype(DType::BF16), &modes, 1, true);
}

/// The GPU's materialised path (each test once per module, `FLASHSAMPLE_MODULE`): the same
/// bodies on BF16/F16 heads (its GEMM's types), more draws where they are cheap.
mod gpu {
    use super::*;

    fn cuda() -> Cuda {
        Cuda::new(Variant::Auto)
    }

    /// 60,000 draws per mode: a 5 % error in the kept mass moves χ² by about 600 against a
    /// standard deviation of 45.
    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn every_mode_samples_its_target_distribution_small_vocab() {
        let w = random_matrix(1000, 32, DType::BF16, 0.5, 41);
        let h = random_matrix(1, 32, DType::BF16, 1.0, 42);
        check_every_mode(&cuda(), &w, &h, 0.8, 60_000, ALPHA);
    }

    /// V = 100,003 (a prime) with 20,000 draws per mode.
    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn every_mode_samples_its_target_distribution_large_vocab() {
        let w = random_matrix(100_003, 16, DType::BF16, 2.0, 43);
        let h = random_matrix(1, 16, DType::BF16, 1.0, 44);
        check_every_mode(&cuda(), &w, &h, 0.5, 20_000, ALPHA);
    }

    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn processing_edges() {
        let w = random_matrix(777, 24, DType::BF16, 0.5, 45);
        let h = random_matrix(2, 24, DType::BF16, 1.0, 46);
        check_processing_edges(&cuda(), &w, &h);
    }

    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn top_k_keeps_every_token_tied_at_the_kth_value() {
        let (vocab, dim) = (500, 8);
        let logit = |i: usize| match i {
            0..=2 => 2.0,
            3 => 1.0,
            _ => 1.0 - i as f32 * 1e-3,
        };
        let w: Vec<f32> = (0..vocab * dim).map(|k| if k % dim == 0 { logit(k / dim) } else { 0.3 }).collect();
        let mut h = vec![0.0; dim];
        h[0] = 1.0;
        let w = matrix_of(vocab, dim, DType::F32, w).to_dtype(DType::BF16);
        let h = matrix_of(1, dim, DType::F32, h).to_dtype(DType::BF16);
        check_top_k_keeps_ties(&cuda(), &w, &h, ALPHA);
    }

    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn log_probabilities_match_f64() {
        let w = random_matrix(5003, 32, DType::BF16, 0.5, 47);
        let h = random_matrix(8, 32, DType::BF16, 1.0, 48);
        check_log_probabilities(&cuda(), &w, &h, 1e-4);
    }

    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn every_row_of_a_mixed_batch_gets_what_it_gets_alone() {
        let w = random_matrix(3001, 16, DType::F16, 0.5, 49);
        let h = random_matrix(8, 16, DType::F16, 1.0, 50);
        check_mixed_batch(&cuda(), &w, &h);
    }

    /// The GPU's `n` draws per row equal the CPU's token for token, and their log-probabilities
    /// agree within 10⁻⁵ (relative above 1; the sums run in another order).
    fn gpu_matches_cpu(
        w: &flashsample::Matrix,
        h: &flashsample::Matrix,
        params: &[flashsample::SamplingParams],
        processing: &[flashsample::Processing],
        n: u32,
    ) {
        use flashsample_tests::processing::ProcessedBackend;
        let gpu = cuda().sample_processed(w, h, params, processing, n).unwrap();
        let cpu = Cpu.sample_processed(w, h, params, processing, n).unwrap();
        assert_eq!(gpu.tokens, cpu.tokens);
        let worst = largest_log_probability_difference(&gpu, &cpu, true);
        println!("tokens equal; log-probabilities within {worst:.2e} (relative above 1)");
        assert!(worst <= 1e-5, "log-probabilities differ by {worst} (relative above 1)");
    }

    /// The GPU draws the CPU's tokens: with integer inputs in [−4, 4] every logit is an
    /// integer both backends compute exactly, so every mode in one batch (many ties, top-p
    /// cutting inside them by index) must give the same tokens; the log-probabilities agree
    /// to 10⁻⁵ (relative above 1; their sums run in another order).
    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn gpu_and_cpu_draw_the_same_tokens_from_exact_logits() {
        let (vocab, dim) = (4099, 16);
        let modes = each_mode(vocab);
        let integers = |rows: usize, seed: u64| integer_matrix(rows, dim, seed).to_dtype(DType::BF16);
        let (w, h) = (integers(vocab, 53), integers(modes.len(), 54));
        let params: Vec<flashsample::SamplingParams> = (0..modes.len())
            .map(|r| flashsample::SamplingParams::new(if r == 2 { 0.0 } else { 3.0 }, 8, r as u32, 1))
            .collect();
        let processing: Vec<flashsample::Processing> = modes.iter().map(|m| m.1.clone()).collect();
        gpu_matches_cpu(&w, &h, &params, &processing, 256);
    }

    /// Without log-probabilities the logits are processed in place and no log-sum-exp is
    /// summed: the same tokens, every mode in one batch, and no log-probabilities returned.
    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn without_log_probabilities_the_tokens_are_the_same() {
        let vocab = 2053;
        let modes = each_mode(vocab);
        let w = random_matrix(vocab, 24, DType::BF16, 0.5, 55);
        let h = random_matrix(modes.len(), 24, DType::BF16, 1.0, 56);
        let params: Vec<flashsample::SamplingParams> =
            (0..modes.len()).map(|r| flashsample::SamplingParams::new(0.9, 3, r as u32, 0)).collect();
        let processing: Vec<flashsample::Processing> = modes.iter().map(|m| m.1.clone()).collect();
        let sampler = &cuda().sampler;
        let on_device = OnDevice::new(sampler, &w, &h, &params, &processing);
        let run = |logprobs: bool| on_device.sample(sampler, 40, Variant::Auto, logprobs).unwrap();
        let (with, without) = (run(true), run(false));
        assert_eq!(with.tokens, without.tokens);
        assert_eq!(with.logprobs.len(), modes.len() * 40);
        assert!(without.logprobs.is_empty() && without.processed_logprobs.is_empty());
    }

    /// Row parameters of a batch at T = 0.8, with greedy rows and temperatures whose `1 / T`
    /// overflows (10⁻⁴⁵) or nearly vanishes (10³⁰) among them.
    fn mixed_temperatures(rows: usize) -> Vec<flashsample::SamplingParams> {
        let temperature = |r: usize| match r % 7 {
            3 => 0.0,
            5 => 1e-45,
            6 => 1e30,
            _ => 0.8,
        };
        (0..rows).map(|r| flashsample::SamplingParams::new(temperature(r), 5, r as u32, 0)).collect()
    }

    /// The per-entry modes (soft-cap, bias, mask, penalties, and all four), cycled over the
    /// rows of a batch.
    fn per_entry_modes(vocab: usize, rows: usize) -> Vec<flashsample::Processing> {
        let modes = each_mode(vocab);
        let mut all = modes[0].1.clone();
        all.bias = modes[1].1.bias.clone();
        all.mask = modes[2].1.mask.clone();
        (all.history, all.penalties) = (modes[3].1.history.clone(), modes[3].1.penalties);
        let per_entry: Vec<flashsample::Processing> = modes[..4].iter().map(|m| m.1.clone()).chain([all]).collect();
        (0..rows).map(|r| per_entry[r % per_entry.len()].clone()).collect()
    }

    /// Soft-cap, bias, mask and penalties applied in the fused tile (no logits in memory) give
    /// the materialised path's tokens with the same tile, whose logits are the same bits (rows
    /// that also ask for a top raw log-probability take the processing pipeline); the fused
    /// tile's log-probabilities (its per-tile log-sum-exp terms, the winners' dot products)
    /// leave the tokens as they are and match f64 within 10⁻⁴: every tensor-core variant of the
    /// module and the SIMT tile, 37 rows (greedy ones among them, and T = 10⁻⁴⁵ and 10³⁰),
    /// V = 2053 (tiles that end past V).
    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn fused_per_entry_steps_give_the_materialised_tokens() {
        let (vocab, dim, batch, n) = (2053, 64, 37, 8u32);
        let w = random_matrix(vocab, dim, DType::BF16, 0.5, 57);
        let h = random_matrix(batch, dim, DType::BF16, 1.0, 58);
        let params = mixed_temperatures(batch);
        let processing = per_entry_modes(vocab, batch);
        let with_top: Vec<flashsample::Processing> =
            processing.iter().map(|p| flashsample::Processing { top_logprobs: 1, ..p.clone() }).collect();
        let sampler = &cuda().sampler;
        let fused = OnDevice::new(sampler, &w, &h, &params, &processing);
        let materialised = OnDevice::new(sampler, &w, &h, &params, &with_top);
        let names = vec!["per-entry"; batch];
        let mut variants: Vec<Variant> = Variant::tensor_core(sampler.module()).collect();
        variants.push(Variant::Simt);
        let mut worst: f64 = 0.0;
        for variant in variants {
            let run = |logprobs: bool| fused.sample(sampler, n, variant, logprobs);
            if let Variant::Tma { rows, columns } = variant
                && !flashsample_core::registry::tma_tile_applies_processing(rows, columns)
            {
                for logprobs in [false, true] {
                    let refused = run(logprobs).unwrap_err().to_string();
                    assert!(refused.contains("does not apply per-row processing"), "{refused}");
                }
                continue;
            }
            let (plain, with_logprobs) = (run(false).unwrap(), run(true).unwrap());
            assert!(plain.tokens.iter().all(|&t| (t as usize) < vocab), "{variant:?}: {:?}", plain.tokens);
            assert_eq!(with_logprobs.tokens, plain.tokens, "{variant:?}");
            let name = format!("{variant:?}");
            let error = assert_log_probabilities(&name, &w, &h, &params, &processing, &names, &with_logprobs, 1e-4);
            worst = worst.max(error);
            if variant != Variant::Simt {
                let materialised = materialised.sample(sampler, n, variant, true).unwrap();
                assert_eq!(plain.tokens, materialised.tokens, "{variant:?}");
            }
        }
        println!("fused log-probabilities within {worst:.2e} of f64");
    }

    /// The SIMT tile (F32, D not a multiple of 8) applies the per-entry steps as the CPU does:
    /// integer inputs make every logit exact on both, so the tokens are equal.
    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn fused_per_entry_steps_on_the_simt_tile_give_the_cpu_tokens() {
        let (vocab, dim, batch, n) = (1031, 13, 10, 16u32);
        let integers = |rows: usize, seed: u64| integer_matrix(rows, dim, seed);
        let (w, h) = (integers(vocab, 59), integers(batch, 60));
        let params: Vec<flashsample::SamplingParams> =
            (0..batch).map(|r| flashsample::SamplingParams::new(2.5, 6, r as u32, 0)).collect();
        let processing = per_entry_modes(vocab, batch);
        let sampler = &cuda().sampler;
        let on_device = OnDevice::new(sampler, &w, &h, &params, &processing);
        let gpu = on_device.sample(sampler, n, Variant::Simt, false).unwrap().tokens;
        use flashsample_tests::processing::ProcessedBackend;
        assert_eq!(gpu, Cpu.sample_processed(&w, &h, &params, &processing, n).unwrap().tokens);
    }

    /// Borrowed mode takes the fused processing as device-side parameters: the owned path's
    /// tokens; a row with top-k is refused by `fused`, naming the row.
    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn borrowed_mode_takes_device_side_processing() {
        use flashsample::{DeviceMatrix, DeviceProcessing, SampleRequest, StreamSampler, StreamWorkspace};
        let (vocab, dim, batch, n) = (2053usize, 64usize, 9usize, 4u32);
        let w = random_matrix(vocab, dim, DType::BF16, 0.5, 61);
        let h = random_matrix(batch, dim, DType::BF16, 1.0, 62);
        let params: Vec<flashsample::SamplingParams> =
            (0..batch).map(|r| flashsample::SamplingParams::new(0.9, 7, r as u32, 0)).collect();
        let processing = per_entry_modes(vocab, batch);
        let owned = &cuda().sampler;
        let on_device = OnDevice::new(owned, &w, &h, &params, &processing);
        let want = on_device.sample(owned, n, Variant::Auto, false).unwrap().tokens;
        let (head, hidden, rows) = (&on_device.head, &on_device.hidden, &on_device.rows);

        let stream = owned.stream();
        let borrowed = StreamSampler::on_context(&stream.context().clone(), flashsample::ModuleChoice::Auto).unwrap();
        let on_stream = DeviceProcessing::upload(stream, &processing, vocab).unwrap();
        let tokens = owned.tokens(batch, n as usize).unwrap();
        let request = SampleRequest {
            lm_head: DeviceMatrix::contiguous(head.address(), vocab, dim, DType::BF16),
            hidden: DeviceMatrix::contiguous(hidden.address(), batch, dim, DType::BF16),
            row_params: rows.address(),
            tokens: tokens.address(),
            draws: flashsample::Draws::first(n),
            variant: Variant::Auto,
            processing: Some(on_stream.fused().unwrap()),
            shard: None,
        };
        let mut workspace = StreamWorkspace::new();
        let bytes = borrowed.workspace_bytes(&request.lm_head, &request.hidden, n, Variant::Auto).unwrap();
        let space = workspace.ensure(stream, bytes).unwrap();
        // SAFETY: every buffer lives on `stream` with the extents the request states.
        unsafe { borrowed.sample(stream.cu_stream().cast(), &request, space).unwrap() };
        assert_eq!(owned.tokens_to_host(&tokens).unwrap(), want);

        let mut top_k = processing.clone();
        top_k[4].top_k = Some(5);
        let refused = DeviceProcessing::upload(stream, &top_k, vocab).unwrap().fused().unwrap_err().to_string();
        assert!(refused.contains("processing[4]"), "{refused}");
        stream.synchronize().unwrap();
        borrowed.close().unwrap();
    }

    /// Borrowed mode (`StreamSampler::sample_processed` and `merge_shards` on a second stream
    /// into caller buffers, workspace and parts poisoned first) gives the owned sampler's
    /// tokens and log-probabilities bit for bit for every mode in one batch (top raw entries on
    /// every other row, a greedy row), and passes the bodies the owned sampler passes: every
    /// mode's χ² at small V (60,000 draws, as above), the boundary cases, log-probabilities
    /// against f64, the mixed batch, and 2, 3 and 8 shards with log-probabilities.
    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn borrowed_mode_gives_the_owned_results_and_passes_every_body() {
        use flashsample_tests::processing::{Borrowed, ProcessedBackend};
        let borrowed = Borrowed::new();
        let (vocab, dim) = (5003, 32);
        let w = random_matrix(vocab, dim, DType::BF16, 0.5, 47);
        let modes = each_mode(vocab);
        let h = random_matrix(modes.len(), dim, DType::BF16, 1.0, 48);
        let params: Vec<flashsample::SamplingParams> = (0..modes.len())
            .map(|r| flashsample::SamplingParams::new(if r == 5 { 0.0 } else { 0.9 }, 3, r as u32, 0))
            .collect();
        let processing: Vec<flashsample::Processing> = modes
            .iter()
            .enumerate()
            .map(|(r, m)| flashsample::Processing { top_logprobs: [7, 0][r % 2], ..m.1.clone() })
            .collect();
        let want = cuda().sample_processed(&w, &h, &params, &processing, 32).unwrap();
        let got = borrowed.sample_processed(&w, &h, &params, &processing, 32).unwrap();
        let bits = |values: &[f32]| values.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(got.tokens, want.tokens);
        assert_eq!(bits(&got.logprobs), bits(&want.logprobs));
        assert_eq!(bits(&got.processed_logprobs), bits(&want.processed_logprobs));
        assert_eq!(got.top_logprobs, want.top_logprobs);

        let small = random_matrix(1000, 32, DType::BF16, 0.5, 41);
        check_every_mode(&borrowed, &small, &random_matrix(1, 32, DType::BF16, 1.0, 42), 0.8, 60_000, ALPHA);
        let (edges_w, edges_h) =
            (random_matrix(777, 24, DType::BF16, 0.5, 45), random_matrix(2, 24, DType::BF16, 1.0, 46));
        check_processing_edges(&borrowed, &edges_w, &edges_h);
        check_log_probabilities(&borrowed, &w, &h, 1e-4);
        check_mixed_batch(&borrowed, &w, &h);
        check_shards(&borrowed, &w, &h, &modes, 4, true);
    }

    /// Vocabulary shards on the GPU (bounds multiples of 4, the Philox block): every mode in
    /// one batch gives the unsharded tokens and log-probabilities, with top raw entries and
    /// without, the truncations decided by the shards together; on integer logits too, where
    /// top-k and top-p cut through values tied across shards.
    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn shards_give_the_unsharded_tokens_and_log_probabilities() {
        let (vocab, dim) = (5003, 16);
        let w = random_matrix(vocab, dim, DType::BF16, 1.0, 51);
        let modes = each_mode(vocab);
        let h = random_matrix(modes.len(), dim, DType::BF16, 1.0, 52);
        check_shards(&cuda(), &w, &h, &modes, 4, true);
        check_shards(&cuda(), &w, &h, &modes, 4, false);
        let (w, h) = (integer_matrix(vocab, dim, 53), integer_matrix(modes.len(), dim, 54));
        check_shards(&cuda(), &w.to_dtype(DType::BF16), &h.to_dtype(DType::BF16), &modes, 4, true);
    }

    /// Log-probabilities without truncations or top entries (the fused tiles' per-tile
    /// log-sum-exp terms, the winners' dot products): on integer inputs (exact logits on both
    /// backends) the per-entry modes, plain rows and a greedy row give the CPU's tokens, and
    /// log-probabilities within 10⁻⁵ (relative above 1).
    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn per_tile_log_sum_exp_gives_the_cpu_log_probabilities() {
        let (vocab, dim, batch) = (4099, 16, 11);
        let integers = |rows: usize, seed: u64| integer_matrix(rows, dim, seed).to_dtype(DType::BF16);
        let (w, h) = (integers(vocab, 67), integers(batch, 68));
        let params: Vec<flashsample::SamplingParams> = (0..batch)
            .map(|r| flashsample::SamplingParams::new(if r == 4 { 0.0 } else { 1.7 }, 9, r as u32, 2))
            .collect();
        let mut processing = per_entry_modes(vocab, batch);
        processing[batch - 1] = flashsample::Processing::default();
        gpu_matches_cpu(&w, &h, &params, &processing, 128);
    }

    /// A shard that is not the whole vocabulary, sampled on its own (no exchange with the
    /// other shards), refuses a row with top-k, naming the row; a shard offset that splits a
    /// Philox block is refused.
    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn shards_refuse_lone_truncations_and_unaligned_offsets() {
        use flashsample::{CudaSampler, Draws, VocabShard};
        use flashsample_tests::processing::ProcessedBackend;
        let (vocab, dim) = (1000, 16);
        let w = random_matrix(vocab, dim, DType::BF16, 1.0, 63);
        let h = random_matrix(2, dim, DType::BF16, 1.0, 64);
        let params = vec![flashsample::SamplingParams::new(0.9, 1, 0, 0); 2];
        let mut processing = vec![flashsample::Processing::default(); 2];
        processing[1].top_k = Some(5);
        let sampler = CudaSampler::new().unwrap();
        let head = sampler.upload_lm_head(&w.row_range(0, 500)).unwrap();
        let (hidden, rows) = (sampler.upload_hidden(&h).unwrap(), sampler.upload_rows(&params).unwrap());
        let device_processing = sampler.upload_processing(&processing, vocab).unwrap();
        let mut parts = sampler.shard_parts(2, 2, 4, true).unwrap();
        let shard = VocabShard { vocab_offset: 0, vocab };
        let draws = Draws::first(4);
        let refused = sampler.sample_shard_into(
            &head,
            shard,
            &hidden,
            &rows,
            &device_processing,
            draws,
            Variant::Auto,
            &mut parts,
            0,
        );
        let refused = refused.unwrap_err().to_string();
        assert!(refused.contains("processing[1]") && refused.contains("whole vocabulary"), "{refused}");
        let plain = vec![flashsample::Processing::default(); 2];
        let unaligned = cuda().sample_sharded(&split_rows(&w, &[0, 502, 1000]), &h, &params, &plain, 4);
        let unaligned = unaligned.unwrap_err().to_string();
        assert!(unaligned.contains("shard.vocab_offset") && unaligned.contains("multiple of 4"), "{unaligned}");
    }

    /// Fused shards (no log-probabilities: the tile kernels with the shard's global offset,
    /// plain and with per-entry steps) give the unsharded tokens on every tile variant of the
    /// module and the SIMT tile: 3 uneven shards, 37 rows (greedy ones among them, and
    /// T = 10⁻⁴⁵ and 10³⁰), V = 2053.
    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn fused_shards_give_the_unsharded_tokens_on_every_variant() {
        use flashsample::{Draws, VocabShard};
        let (vocab, dim, batch, n) = (2053, 64, 37, 8u32);
        let w = random_matrix(vocab, dim, DType::BF16, 0.5, 65);
        let h = random_matrix(batch, dim, DType::BF16, 1.0, 66);
        let params = mixed_temperatures(batch);
        let bounds = uneven_bounds(vocab, 3, 4);
        let shards = split_rows(&w, &bounds);
        let sampler = &cuda().sampler;
        let heads: Vec<_> = shards.iter().map(|s| sampler.upload_lm_head(s).unwrap()).collect();
        let variants: Vec<Variant> = Variant::tensor_core(sampler.module()).chain([Variant::Simt]).collect();
        for (label, processing) in
            [("plain", vec![flashsample::Processing::default(); batch]), ("per-entry", per_entry_modes(vocab, batch))]
        {
            let on_device = OnDevice::new(sampler, &w, &h, &params, &processing);
            for &variant in &variants {
                if let Variant::Tma { rows, columns } = variant
                    && label == "per-entry"
                    && !flashsample_core::registry::tma_tile_applies_processing(rows, columns)
                {
                    continue;
                }
                let whole = on_device.sample(sampler, n, variant, false).unwrap().tokens;
                let mut parts = sampler.shard_parts(heads.len(), batch, n as usize, false).unwrap();
                sampler.poison_parts(&parts).unwrap();
                for (s, head) in heads.iter().enumerate() {
                    let shard = VocabShard { vocab_offset: bounds[s], vocab };
                    let (hidden, rows, p) = (&on_device.hidden, &on_device.rows, &on_device.processing);
                    sampler
                        .sample_shard_into(head, shard, hidden, rows, p, Draws::first(n), variant, &mut parts, s)
                        .unwrap();
                }
                let mut out = sampler.processed_outputs(batch, n as usize, false).unwrap();
                sampler.merge_shards_into(&parts, &on_device.rows, &on_device.processing, &mut out).unwrap();
                let sharded = sampler.processed_to_host(&out).unwrap().tokens;
                assert!(whole.iter().all(|&t| (t as usize) < vocab), "{label} {variant:?}: {whole:?}");
                assert_eq!(sharded, whole, "{label} {variant:?} at {bounds:?}");
            }
        }
    }
}
