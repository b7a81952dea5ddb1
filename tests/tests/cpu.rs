//! The suite on the CPU backend (run in CI), and what only the CPU checks: the χ² tests'
//! power, and f32 and f16 heads at other temperatures.

use flashsample::DType;
use flashsample::internals::logits_row;
use flashsample_tests::suite::{ALPHA, Scale};
use flashsample_tests::*;

flashsample_tests::suite!(Cpu, Scale::CPU);

#[test]
fn chi_square_small_vocab_f32() {
    let w = random_matrix(7, 16, DType::F32, 0.5, 1);
    let h = random_matrix(1, 16, DType::F32, 1.0, 2);
    check_distribution(&Cpu, &w, &h, 1.0, 20_000, 11, ALPHA);
}

#[test]
fn chi_square_f16_high_temperature() {
    let w = random_matrix(1000, 32, DType::F16, 0.5, 5);
    let h = random_matrix(1, 32, DType::F16, 1.0, 6);
    check_distribution(&Cpu, &w, &h, 1.5, 50_000, 13, ALPHA);
}

/// The χ² tests have the power to see a 10 % temperature error: the same draws against the
/// softmax at 1.1·T are rejected far below α.
#[test]
fn chi_square_rejects_a_ten_percent_temperature_error() {
    let w = random_matrix(1000, 64, DType::BF16, 0.5, 3);
    let h = random_matrix(1, 64, DType::BF16, 1.0, 4);
    let params = [flashsample::SamplingParams::new(0.8, 12, 0, 0)];
    let tokens = Cpu.sample(&w, &h, &params, 50_000).unwrap();
    let mut counts = vec![0u64; 1000];
    tokens.iter().for_each(|&t| counts[t as usize] += 1);
    let wrong = row_params(&[flashsample::SamplingParams::new(0.88, 12, 0, 0)], 0);
    let (statistic, dof, p) = chi_square(&counts, &exact_probabilities(&logits_row(&w, &h, 0), &wrong));
    println!("against T x 1.1: chi2 = {statistic:.1}, dof = {dof}, p = {p:.2e}");
    assert!(p < 1e-6, "the test cannot tell T from 1.1 T (p = {p})");
}

#[test]
fn extreme_temperatures_in_f32() {
    check_extreme_temperatures(&Cpu, DType::F32, 24, ALPHA);
}

#[test]
fn non_finite_logits_in_f32() {
    check_non_finite_logits(&Cpu, DType::F32, 24, None);
}
