//! The shared test bodies on the CPU backend (run in CI). α is stated per test; seeds are
//! fixed, so each test is deterministic and fails with probability α under a correct sampler.

use flashsample::cpu::logits_row;
use flashsample::{DType, SamplingParams};
use flashsample_tests::*;

/// α for each χ² test below.
const ALPHA: f64 = 1e-3;

#[test]
fn chi_square_small_vocab_f32() {
    let w = random_matrix(7, 16, DType::F32, 0.5, 1);
    let h = random_matrix(1, 16, DType::F32, 1.0, 2);
    check_distribution(&Cpu, &w, &h, 1.0, 20_000, 11, ALPHA);
}

#[test]
fn chi_square_bf16_low_temperature() {
    let w = random_matrix(100, 64, DType::BF16, 0.5, 3);
    let h = random_matrix(1, 64, DType::BF16, 1.0, 4);
    check_distribution(&Cpu, &w, &h, 0.7, 50_000, 12, ALPHA);
}

#[test]
fn chi_square_f16_high_temperature() {
    let w = random_matrix(1000, 32, DType::F16, 0.5, 5);
    let h = random_matrix(1, 32, DType::F16, 1.0, 6);
    check_distribution(&Cpu, &w, &h, 1.5, 50_000, 13, ALPHA);
}

#[test]
fn chi_square_odd_vocab_bf16() {
    let w = random_matrix(5003, 24, DType::BF16, 0.5, 7);
    let h = random_matrix(1, 24, DType::BF16, 2.0, 8);
    check_distribution(&Cpu, &w, &h, 1.0, 20_000, 14, ALPHA);
}

/// The χ² tests above have the power to see a 10 % temperature error: the same draws against
/// the softmax at 1.1·T are rejected far below α.
#[test]
fn chi_square_rejects_a_ten_percent_temperature_error() {
    let w = random_matrix(100, 64, DType::BF16, 0.5, 3);
    let h = random_matrix(1, 64, DType::BF16, 1.0, 4);
    let params = [SamplingParams::new(0.7, 12, 0, 0)];
    let tokens = Cpu.sample(&w, &h, &params, 50_000).unwrap();
    let mut counts = vec![0u64; 100];
    tokens.iter().for_each(|&t| counts[t as usize] += 1);
    let wrong = row_params(&w, &h, &[SamplingParams::new(0.77, 12, 0, 0)], 0);
    let (statistic, dof, p) = chi_square(&counts, &exact_probabilities(&logits_row(&w, &h, 0), &wrong));
    println!("against T x 1.1: chi2 = {statistic:.1}, dof = {dof}, p = {p:.2e}");
    assert!(p < 1e-6, "the test cannot tell T from 1.1 T (p = {p})");
}

#[test]
fn greedy_rows_are_argmax() {
    let w = random_matrix(513, 40, DType::BF16, 0.5, 21);
    let h = random_matrix(6, 40, DType::BF16, 1.0, 22);
    check_greedy_is_argmax(&Cpu, &w, &h);
}

#[test]
fn batch_permutation_permutes_tokens() {
    let w = random_matrix(300, 32, DType::F16, 0.5, 23);
    let h = random_matrix(11, 32, DType::F16, 1.0, 24);
    check_batch_independence(&Cpu, &w, &h);
}

#[test]
fn identical_rows_draw_independently() {
    let w = random_matrix(64, 16, DType::F32, 0.3, 25);
    let h = random_matrix(1, 16, DType::F32, 1.0, 26);
    check_identical_rows_independent(&Cpu, &w, &h, 20_000);
}

#[test]
fn draws_split_across_calls_equal_one_call() {
    let w = random_matrix(300, 16, DType::BF16, 0.5, 21);
    let h = random_matrix(3, 16, DType::BF16, 1.0, 22);
    check_draws_split_across_calls(&Cpu, &w, &h, 50, 17);
}

#[test]
fn extreme_temperatures_sample_the_limit_distributions() {
    for dtype in [DType::F32, DType::BF16] {
        check_extreme_temperatures(&Cpu, dtype, 24, ALPHA);
    }
}

#[test]
fn non_finite_logits_give_row_statuses() {
    for dtype in [DType::F32, DType::BF16] {
        check_non_finite_logits(&Cpu, dtype, 24);
    }
}
