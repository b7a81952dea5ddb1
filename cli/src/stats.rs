//! The statistics behind the exactness checks: the exact softmax a row is sampled from, and
//! Pearson's χ² of drawn tokens against it (the CPU demo prints its p-value; the test suite
//! tests with it).

use flashsample_core::RowParams;
use statrs::distribution::{ChiSquared, ContinuousCDF};

/// `softmax(logits / T)` in f64 from the CPU's f32 logits: the distribution being sampled.
pub fn exact_probabilities(logits: &[f32], row: &RowParams) -> Vec<f64> {
    let scaled: Vec<f64> = logits.iter().map(|&l| l as f64 / row.temperature as f64).collect();
    let max = scaled.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let weights: Vec<f64> = scaled.iter().map(|s| (s - max).exp()).collect();
    let total: f64 = weights.iter().sum();
    weights.iter().map(|w| w / total).collect()
}

/// Pearson's χ² of `counts` against `probabilities`, pooling adjacent bins (in decreasing
/// probability) until each pooled bin expects at least 5 draws. Returns `(χ², dof, p)`.
pub fn chi_square(counts: &[u64], probabilities: &[f64]) -> (f64, usize, f64) {
    let draws: u64 = counts.iter().sum();
    let mut order: Vec<usize> = (0..counts.len()).collect();
    order.sort_by(|&a, &b| probabilities[b].total_cmp(&probabilities[a]));
    let mut bins: Vec<(f64, u64)> = Vec::new();
    let (mut expected, mut observed) = (0.0, 0);
    for i in order {
        expected += probabilities[i] * draws as f64;
        observed += counts[i];
        if expected >= 5.0 {
            bins.push((expected, observed));
            (expected, observed) = (0.0, 0);
        }
    }
    if let Some(last) = bins.last_mut() {
        last.0 += expected;
        last.1 += observed;
    }
    let statistic: f64 = bins.iter().map(|&(e, o)| (o as f64 - e).powi(2) / e).sum();
    let dof = bins.len().saturating_sub(1).max(1);
    let p = 1.0 - ChiSquared::new(dof as f64).expect("dof > 0").cdf(statistic);
    (statistic, dof, p)
}
