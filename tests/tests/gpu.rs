//! The suite on the owned GPU sampler, and the shared bodies for every tile variant the
//! dispatcher can pick in the module the sampler runs. Ignored without a GPU; on the H200:
//! `cargo xtask bundle`, then `run.sh` runs them with `--include-ignored`, once with the Hopper
//! module and once with `FLASHSAMPLE_MODULE=portable`. χ² tests use α = 1e-3 and fixed seeds.

use flashsample::internals::Variant;
use flashsample::{Batch, CudaSampler, DType, Draws, Elements, Matrix, Module, Processing, Sampler, SamplingParams};
use flashsample_tests::suite::{ALPHA, Scale};
use flashsample_tests::*;

flashsample_tests::suite!(Cuda::new(Variant::Auto), Scale::GPU, #[ignore = "needs a CUDA GPU"]);

/// The module the GPU tests run (the device's, or the one `FLASHSAMPLE_MODULE` forces).
fn module() -> Module {
    CudaSampler::new().expect("these tests need a CUDA GPU").module()
}

fn cases() -> Vec<(Variant, DType, usize)> {
    gpu_cases(module())
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn same_tokens_as_cpu_for_every_variant() {
    let mut total = 0;
    let cases = cases();
    for &(variant, dtype, dim) in &cases {
        let w = random_matrix(5003, dim, dtype, 0.3, 31);
        let h = random_matrix(37, dim, dtype, 1.0, 32);
        let params = params_for(37, 1.0, 77);
        total += check_matches_cpu(&Cuda::new(variant), &w, &h, &params, 16);
    }
    // cases × 37 rows × 16 draws; near-ties are rare: allow at most 1 in 1000 tokens.
    assert!(total <= cases.len() * 37 * 16 / 1000, "{total} near-tie disagreements");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn odd_shapes_match_cpu() {
    let backend = Cuda::new(Variant::Auto);
    for (vocab, dim, batch, dtype) in [
        (1, 8, 1, DType::BF16),
        (3, 16, 3, DType::BF16),
        (130, 72, 9, DType::F16),
        (1025, 136, 17, DType::BF16),
        (257, 7, 33, DType::BF16),
        (129, 1, 2, DType::F32),
        (300, 64, 1024, DType::BF16),
        (4099, 4096, 5, DType::BF16),
    ] {
        let w = random_matrix(vocab, dim, dtype, 0.3, vocab as u64);
        let h = random_matrix(batch, dim, dtype, 1.0, dim as u64);
        let params = params_for(batch, 0.9, 5);
        let disagreements = check_matches_cpu(&backend, &w, &h, &params, 3);
        assert!(disagreements <= (batch * 3).div_ceil(200), "V={vocab} D={dim} B={batch}: {disagreements}");
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn chi_square_v131071_bf16_4m_draws() {
    let w = random_matrix(131_071, 64, DType::BF16, 0.5, 41);
    let h = random_matrix(1, 64, DType::BF16, 1.0, 42);
    check_distribution(&Cuda::new(Variant::Auto), &w, &h, 1.0, 1 << 22, 43, ALPHA);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn chi_square_v131071_f32_4m_draws() {
    let w = random_matrix(131_071, 64, DType::F32, 0.5, 44);
    let h = random_matrix(1, 64, DType::F32, 1.0, 45);
    check_distribution(&Cuda::new(Variant::Auto), &w, &h, 1.0, 1 << 22, 46, ALPHA);
}

/// Top-k 50 and top-p 0.9 at V = 131,071 with 2²⁰ draws each against their exact truncated
/// distributions (α = 1e-3): top-k takes the listed path at B = 1 (the tiles' lists, no logits
/// written), top-p the materialised one. A token outside the kept set fails at once; a cut
/// that keeps 1 % of the mass too much or too little moves χ² by about 2²⁰ · 0.01 ≈ 10,000,
/// against a standard deviation of √(2·dof), under 600 here.
#[test]
#[ignore = "needs a CUDA GPU"]
fn top_k_50_and_top_p_0_9_sample_their_targets_at_v131071_with_1m_draws() {
    let w = random_matrix(131_071, 64, DType::BF16, 0.5, 51);
    let h = random_matrix(1, 64, DType::BF16, 1.0, 52);
    for processing in
        [Processing { top_k: Some(50), ..Processing::default() }, Processing { top_p: 0.9, ..Processing::default() }]
    {
        processing::check_processed_distribution(&Cuda::new(Variant::Auto), &w, &h, 1.0, &processing, 1 << 20, ALPHA);
    }
}

/// min-p 0.05 at V = 131,071 through the chained path (the tiles' chains, no logits written)
/// against its exact truncated distribution (α = 1e-3), 1,048,704 draws: 64 copies of one row,
/// 3 draws each per call (the most whose chains fit the logits' bytes), 5,462 calls whose draw
/// indices follow one another (every draw fresh noise); rows a chain cannot tell go to the fallback, which is exact too, and are counted.
/// A cut that keeps 1 % of the mass too much or too little moves χ² by about 10,000, against
/// a standard deviation under 600.
#[test]
#[ignore = "needs a CUDA GPU"]
fn min_p_0_05_samples_its_target_through_the_chains_at_v131071_with_1m_draws() {
    let (rows, draws, calls) = (64usize, 3u32, 5462u32);
    let w = random_matrix(131_071, 64, DType::BF16, 0.5, 51);
    let one = random_matrix(1, 64, DType::BF16, 1.0, 52);
    let copies: Vec<f32> = (0..rows * 64).map(|i| one.get(0, i % 64)).collect();
    let h = Matrix::new("hidden", rows, 64, Elements::F32(copies)).unwrap().to_dtype(DType::BF16);
    let processing = Processing { min_p: 0.05, ..Processing::default() };
    let params: Vec<SamplingParams> = (0..rows).map(|r| SamplingParams::new(1.0, 1234, r as u32, 0)).collect();
    // The staged tile named: the Hopper module's own choice, its TMA tile, writes no chains.
    let cuda = Cuda::new(Variant::Staged { columns: 64 });
    let sampler = &cuda.sampler;
    let head = sampler.upload_lm_head(&w).unwrap();
    let hidden = sampler.upload_hidden(&h).unwrap();
    let batch =
        sampler.upload_batch(&Batch::with_processing(params, vec![processing.clone(); rows]), w.rows()).unwrap();
    let mut out = sampler.outputs(&batch, draws).unwrap();
    let (mut tokens, mut unsettled) = (Vec::with_capacity(rows * (draws * calls) as usize), 0);
    for call in 0..calls {
        let step = Draws { first: call * draws, count: draws };
        unsettled +=
            sampler.sample_listed_into(&head, &hidden, &batch, step, &mut out).unwrap().expect("the chained path");
        tokens.extend(sampler.read(&out).unwrap().tokens);
    }
    println!("{unsettled} of {} rows went to the fallback", rows as u32 * calls);
    let raw = flashsample::internals::logits_row(&w, &one, 0);
    processing::check_processed_tokens("chained", &tokens, &raw, 1.0, &processing, ALPHA);
}

/// Every variant against the exact distribution at 262,144 draws (1M draws each took the test
/// binary past its time limit with 19 variants). The target is a variant-specific bug (wrong
/// rows, columns or temperature): the scaled logits here have a standard deviation near 1.2,
/// so a 10 % temperature error shifts χ² by about N·Var(0.09·z·1.2) ≈ 3,000 against a standard
/// deviation of about 450 (an estimate, ≈ 7σ). The dispatched variant gets 4M draws above, and
/// `tile_width_does_not_change_tokens` shows the widths of a family draw identical tokens.
#[test]
#[ignore = "needs a CUDA GPU"]
fn chi_square_every_variant_256k_draws() {
    for (variant, dtype, dim) in cases() {
        let w = random_matrix(131_071, dim, dtype, 0.2, 51);
        let h = random_matrix(1, dim, dtype, 1.0, 52);
        check_distribution(&Cuda::new(variant), &w, &h, 0.8, 1 << 18, 53, ALPHA);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn greedy_rows_are_argmax_in_every_variant() {
    for (variant, dtype, dim) in cases() {
        let w = random_matrix(2051, dim, dtype, 0.5, 61);
        let h = random_matrix(20, dim, dtype, 1.0, 62);
        check_greedy_is_argmax(&Cuda::new(variant), &w, &h);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn batch_permutation_permutes_tokens_in_every_variant() {
    for (variant, dtype, dim) in cases() {
        let w = random_matrix(1000, dim, dtype, 0.5, 63);
        let h = random_matrix(41, dim, dtype, 1.0, 64);
        check_batch_independence(&Cuda::new(variant), &w, &h);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn identical_rows_draw_independently_in_every_variant() {
    for (variant, dtype, dim) in cases() {
        let w = random_matrix(64, dim, dtype, 0.05, 65);
        let h = random_matrix(1, dim, dtype, 1.0, 66);
        check_identical_rows_independent(&Cuda::new(variant), &w, &h, 20_000);
    }
}

/// The unfused pipeline computes bit-identical logits with the same tile (mma or TMA), so
/// its tokens equal the fused kernel's exactly; the workspace and its outputs are poisoned
/// first.
#[test]
#[ignore = "needs a CUDA GPU"]
fn unfused_pipeline_gives_the_same_tokens() {
    let sampler = CudaSampler::new().unwrap();
    for variant in Variant::tensor_core(sampler.module()) {
        sampler.set_variant(variant);
        let w = random_matrix(3001, 136, DType::BF16, 0.3, 71);
        let h = random_matrix(45, 136, DType::BF16, 1.0, 72);
        let params: Vec<SamplingParams> =
            (0..45).map(|r| SamplingParams::new(if r == 3 { 0.0 } else { 1.2 }, 8, r, 1)).collect();
        let head = sampler.upload_lm_head(&w).unwrap();
        let hidden = sampler.upload_hidden(&h).unwrap();
        let batch = sampler.upload_batch(&Batch::new(params), 3001).unwrap();
        let mut fused = sampler.outputs(&batch, 5).unwrap();
        let mut unfused = sampler.outputs(&batch, 5).unwrap();
        sampler.sample_into(&head, &hidden, &batch, Draws::first(5), &mut fused).unwrap();
        sampler.sample_unfused_into(&head, &hidden, &batch, Draws::first(5), variant, &mut unfused).unwrap();
        sampler.poison_workspace().unwrap();
        sampler.fill_outputs(&mut unfused, 0xffff_fffe).unwrap();
        sampler.sample_unfused_into(&head, &hidden, &batch, Draws::first(5), variant, &mut unfused).unwrap();
        assert_eq!(sampler.read(&fused).unwrap(), sampler.read(&unfused).unwrap(), "{variant:?}");
    }
}

/// Many draws are split into passes (bounded candidate memory); the split must not change
/// any token: the same draws from a call with fewer samples are a prefix of each row.
#[test]
#[ignore = "needs a CUDA GPU"]
fn draws_do_not_depend_on_how_many_are_asked_for() {
    let backend = Cuda::new(Variant::Auto);
    let w = random_matrix(70_001, 16, DType::BF16, 0.5, 81);
    let h = random_matrix(3, 16, DType::BF16, 1.0, 82);
    let params = params_for(3, 1.0, 83);
    let many = backend.sample(&w, &h, &params, 200_000).unwrap();
    let few = backend.sample(&w, &h, &params, 1000).unwrap();
    for row in 0..3 {
        assert_eq!(few[row * 1000..(row + 1) * 1000], many[row * 200_000..row * 200_000 + 1000], "row {row}");
    }
}

/// The dispatcher picks the tile from B, so a row's token must not depend on it: every width
/// (and item height, and schedule) of one tile family sums each logit in the same order and
/// gives identical tokens.
/// (The two families sum in different orders; near-ties between them are covered by the CPU
/// comparison's tolerance.)
#[test]
#[ignore = "needs a CUDA GPU"]
fn tile_width_does_not_change_tokens() {
    let w = random_matrix(20_011, 4096, DType::BF16, 0.05, 91);
    let h = random_matrix(130, 4096, DType::BF16, 2.0, 92);
    let params = params_for(130, 1.0, 93);
    let variants = || Variant::tensor_core(module());
    let families = [
        variants().filter(|v| matches!(v, Variant::Mma { .. })).collect::<Vec<_>>(),
        variants().filter(|v| matches!(v, Variant::Tma { .. } | Variant::TmaHandoff { .. })).collect(),
    ];
    for family in families.into_iter().filter(|f| !f.is_empty()) {
        let reference = Cuda::new(family[0]).sample(&w, &h, &params, 4).unwrap();
        for &variant in &family[1..] {
            assert_eq!(Cuda::new(variant).sample(&w, &h, &params, 4).unwrap(), reference, "{variant:?}");
        }
    }
}

/// The fused kernels score every entry with `gumbel_estimate` (the hardware's `lg2.approx`)
/// and give exact scores only to entries within the bound's margin of the best; tokens are
/// exact only if the bound holds. It is checked here for every one of the 2³² words.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gumbel_estimate_is_within_its_bound_for_every_word() {
    use flashsample_core::estimate::GUMBEL_ESTIMATE_ERROR;
    let worst = CudaSampler::new().unwrap().gumbel_estimate_max_error().unwrap();
    println!("largest |gumbel_estimate - gumbel| over all 2^32 words: {worst:e} (bound {GUMBEL_ESTIMATE_ERROR:e})");
    assert!(worst <= GUMBEL_ESTIMATE_ERROR, "{worst:e} exceeds the bound {GUMBEL_ESTIMATE_ERROR:e}");
}

/// The draws of one call, made in two calls starting at draw 0 and draw 3000 (the CLI writes
/// large `--samples` this way), on every variant of the module.
#[test]
#[ignore = "needs a CUDA GPU"]
fn draws_split_across_calls_equal_one_call_in_every_variant() {
    for (variant, dtype, dim) in cases() {
        let w = random_matrix(1000, dim, dtype, 0.5, 23);
        let h = random_matrix(5, dim, dtype, 1.0, 24);
        check_draws_split_across_calls(&Cuda::new(variant), &w, &h, 5000, 3000);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn extreme_temperatures_sample_the_limit_distributions_in_every_variant() {
    for (variant, dtype, dim) in cases() {
        check_extreme_temperatures(&Cuda::new(variant), dtype, dim, ALPHA);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn extreme_temperatures_match_cpu_in_every_variant() {
    let temperatures = [1e-45, 1e-38, 1e-30, 1e-6, 1e6, 1e30, 1.0, 0.0];
    let mut total = 0;
    let cases = cases();
    for &(variant, dtype, dim) in &cases {
        let w = random_matrix(3001, dim, dtype, 0.3, 71);
        let h = random_matrix(16, dim, dtype, 1.0, 72);
        let params: Vec<SamplingParams> =
            (0..16).map(|r| SamplingParams::new(temperatures[r % temperatures.len()], 73, r as u32, 0)).collect();
        total += check_matches_cpu(&Cuda::new(variant), &w, &h, &params, 8);
    }
    assert!(total <= cases.len() * 16 * 8 / 1000, "{total} near-tie disagreements");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn non_finite_logits_give_row_statuses_in_every_variant() {
    // F16 cannot hold the overflowing inputs; the borrowed-mode test feeds NaN and ±inf to
    // those variants directly.
    for (variant, dtype, dim) in cases().into_iter().filter(|case| case.1 != DType::F16) {
        check_non_finite_logits(&Cuda::new(variant), dtype, dim, None);
    }
}
