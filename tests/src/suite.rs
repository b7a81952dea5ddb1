//! One list of test bodies every backend runs ([`suite!`](crate::suite!)), at a [`Scale`] of
//! draws the backend affords: sampling against the exact softmax, the statuses of non-finite
//! rows, every processing mode against its f64 target, the boundary cases, log-probabilities,
//! the mixed batch, vocabulary shards and speculative verification. χ² tests use α = [`ALPHA`] and fixed seeds, so each
//! is deterministic and fails with probability α under a correct sampler.

use flashsample::{DType, Processing};

use crate::processing::{
    check_every_mode, check_log_probabilities, check_mixed_batch, check_processing_edges, check_shards,
    check_top_k_keeps_ties, each_mode, integer_matrix,
};
use crate::speculative::{check_same_key_drafting_agrees_as_coupled, check_verification_is_drafter_invariant};
use crate::{
    Backend, check_batch_independence, check_distribution, check_draws_split_across_calls, check_extreme_temperatures,
    check_greedy_is_argmax, check_identical_rows_independent, check_matches_cpu, check_non_finite_logits, matrix_of,
    params_for, random_matrix,
};

/// α of every χ² test of the suite.
pub const ALPHA: f64 = 1e-3;

/// How many draws a backend affords: the CPU's draws cost a pass over the logits each.
#[derive(Clone, Copy, Debug)]
pub struct Scale {
    /// Draws of the plain χ² tests (V = 1000 and 5003).
    pub plain_draws: u32,
    /// Draws per mode at V = 1000: a 5 % error in the kept mass moves χ² by about
    /// `draws · 0.05² / 0.25` against a standard deviation of √(2·dof) ≈ 45 at 1000 bins
    /// (300 at 30,000 draws, 600 at 60,000).
    pub mode_draws_small_vocab: u32,
    /// Draws per mode at V = 100,003 (a prime), where the truncating modes keep few enough
    /// tokens for χ² to have power.
    pub mode_draws_large_vocab: u32,
}

impl Scale {
    /// The CPU's.
    pub const CPU: Scale = Scale { plain_draws: 50_000, mode_draws_small_vocab: 30_000, mode_draws_large_vocab: 2_000 };
    /// A GPU's.
    pub const GPU: Scale =
        Scale { plain_draws: 200_000, mode_draws_small_vocab: 60_000, mode_draws_large_vocab: 20_000 };
}

/// V = 1000, bf16, T = 0.8: the draws against the exact softmax.
pub fn chi_square_small_vocab(backend: &dyn Backend, scale: &Scale) {
    let w = random_matrix(1000, 64, DType::BF16, 0.5, 3);
    let h = random_matrix(1, 64, DType::BF16, 1.0, 4);
    check_distribution(backend, &w, &h, 0.8, scale.plain_draws, 12, ALPHA);
}

/// V = 5003 (a prime: the last tile and the last Philox block are partial), bf16, T = 1.
pub fn chi_square_odd_vocab(backend: &dyn Backend, scale: &Scale) {
    let w = random_matrix(5003, 24, DType::BF16, 0.5, 7);
    let h = random_matrix(1, 24, DType::BF16, 2.0, 8);
    check_distribution(backend, &w, &h, 1.0, scale.plain_draws / 2, 14, ALPHA);
}

/// Every token equals the CPU's but for near-ties the two sums' rounding decides apart.
pub fn same_tokens_as_cpu(backend: &dyn Backend, _: &Scale) {
    let w = random_matrix(5003, 200, DType::BF16, 0.3, 31);
    let h = random_matrix(37, 200, DType::BF16, 1.0, 32);
    let disagreements = check_matches_cpu(backend, &w, &h, &params_for(37, 1.0, 77), 16);
    // Near-ties are rare: at most 1 in 200 tokens.
    assert!(disagreements <= (37 * 16usize).div_ceil(200), "{disagreements} near-tie disagreements");
}

pub fn greedy_rows_are_argmax(backend: &dyn Backend, _: &Scale) {
    let w = random_matrix(2051, 40, DType::BF16, 0.5, 61);
    let h = random_matrix(20, 40, DType::BF16, 1.0, 62);
    check_greedy_is_argmax(backend, &w, &h);
}

pub fn batch_permutation_permutes_tokens(backend: &dyn Backend, _: &Scale) {
    let w = random_matrix(1000, 32, DType::F16, 0.5, 63);
    let h = random_matrix(41, 32, DType::F16, 1.0, 64);
    check_batch_independence(backend, &w, &h);
}

pub fn identical_rows_draw_independently(backend: &dyn Backend, _: &Scale) {
    let w = random_matrix(64, 16, DType::BF16, 0.3, 65);
    let h = random_matrix(1, 16, DType::BF16, 1.0, 66);
    check_identical_rows_independent(backend, &w, &h, 20_000);
}

pub fn draws_split_across_calls_equal_one_call(backend: &dyn Backend, _: &Scale) {
    let w = random_matrix(1000, 16, DType::BF16, 0.5, 23);
    let h = random_matrix(5, 16, DType::BF16, 1.0, 24);
    check_draws_split_across_calls(backend, &w, &h, 500, 300);
}

pub fn extreme_temperatures_sample_the_limit_distributions(backend: &dyn Backend, _: &Scale) {
    check_extreme_temperatures(backend, DType::BF16, 24, ALPHA);
}

pub fn non_finite_logits_give_row_statuses(backend: &dyn Backend, _: &Scale) {
    check_non_finite_logits(backend, DType::BF16, 24, None);
}

/// The same statuses under min-p, top-k and top-p, which take each row's largest logit and
/// non-finite flag from their own pipeline (on the GPU from the GEMM's maxima where the rows
/// have no per-entry step).
pub fn non_finite_logits_give_row_statuses_under_truncations(backend: &dyn Backend, _: &Scale) {
    for processing in [
        Processing { min_p: 0.05, ..Processing::default() },
        Processing { top_k: Some(50), ..Processing::default() },
        Processing { top_p: 0.9, ..Processing::default() },
    ] {
        check_non_finite_logits(backend, DType::BF16, 24, Some(&processing));
    }
}

pub fn every_mode_samples_its_target_distribution_small_vocab(backend: &dyn Backend, scale: &Scale) {
    let w = random_matrix(1000, 32, DType::BF16, 0.5, 41);
    let h = random_matrix(1, 32, DType::BF16, 1.0, 42);
    check_every_mode(backend, &w, &h, 0.8, scale.mode_draws_small_vocab, ALPHA);
}

pub fn every_mode_samples_its_target_distribution_large_vocab(backend: &dyn Backend, scale: &Scale) {
    let w = random_matrix(100_003, 16, DType::BF16, 2.0, 43);
    let h = random_matrix(1, 16, DType::BF16, 1.0, 44);
    check_every_mode(backend, &w, &h, 0.5, scale.mode_draws_large_vocab, ALPHA);
}

pub fn processing_edges(backend: &dyn Backend, _: &Scale) {
    let w = random_matrix(777, 24, DType::BF16, 0.5, 45);
    let h = random_matrix(2, 24, DType::BF16, 1.0, 46);
    check_processing_edges(backend, &w, &h);
}

/// Logits 2, 2, 2, 1, … (column 0 of `W`, H = [1, 0, …]) with k = 2 keep all three 2s, evenly.
pub fn top_k_keeps_every_token_tied_at_the_kth_value(backend: &dyn Backend, _: &Scale) {
    let (vocab, dim) = (500, 8);
    let logit = |i: usize| match i {
        0..=2 => 2.0,
        3 => 1.0,
        _ => 1.0 - i as f32 * 1e-3,
    };
    let w: Vec<f32> = (0..vocab * dim).map(|k| if k % dim == 0 { logit(k / dim) } else { 0.3 }).collect();
    let mut h = vec![0.0; dim];
    h[0] = 1.0;
    let w = matrix_of(vocab, dim, DType::BF16, w);
    let h = matrix_of(1, dim, DType::BF16, h);
    check_top_k_keeps_ties(backend, &w, &h, ALPHA);
}

pub fn log_probabilities_match_f64(backend: &dyn Backend, _: &Scale) {
    let w = random_matrix(5003, 32, DType::BF16, 0.5, 47);
    let h = random_matrix(8, 32, DType::BF16, 1.0, 48);
    check_log_probabilities(backend, &w, &h, 1e-4);
}

pub fn every_row_of_a_mixed_batch_gets_what_it_gets_alone(backend: &dyn Backend, _: &Scale) {
    let w = random_matrix(3001, 16, DType::F16, 0.5, 49);
    let h = random_matrix(8, 16, DType::F16, 1.0, 50);
    check_mixed_batch(backend, &w, &h);
}

/// Heads the tensor cores do not take (F32, and BF16 with D % 8 ≠ 0; the SIMT tile on the
/// GPU, whose GEMM writes the logits the truncations select on): every mode against its f64
/// target distribution, and a mixed batch whose rows each get what they get alone.
pub fn every_mode_on_heads_of_any_dtype_and_width(backend: &dyn Backend, scale: &Scale) {
    let w = random_matrix(1000, 13, DType::F32, 0.5, 55);
    let h = random_matrix(1, 13, DType::F32, 1.0, 56);
    check_every_mode(backend, &w, &h, 0.8, scale.mode_draws_small_vocab, ALPHA);
    for (dtype, dim) in [(DType::F32, 16), (DType::BF16, 21)] {
        let w = random_matrix(3001, dim, dtype, 0.5, 57);
        let h = random_matrix(8, dim, dtype, 1.0, 58);
        check_mixed_batch(backend, &w, &h);
    }
}

/// W split by vocabulary into 2, 3 and 8 uneven shards (bounds multiples of 4, the Philox
/// block): every mode in one batch gives the unsharded tokens and log-probabilities, with top
/// raw entries and without, the truncations decided by the shards together; on integer logits
/// too, where top-k and top-p cut through values tied across shards.
pub fn shards_give_the_unsharded_tokens_and_log_probabilities(backend: &dyn Backend, _: &Scale) {
    let (vocab, dim) = (5003, 16);
    let w = random_matrix(vocab, dim, DType::BF16, 1.0, 51);
    let modes = each_mode(vocab);
    let h = random_matrix(modes.len(), dim, DType::BF16, 1.0, 52);
    check_shards(backend, &w, &h, &modes, 4, true);
    check_shards(backend, &w, &h, &modes, 4, false);
    let (w, h) = (integer_matrix(vocab, dim, 53), integer_matrix(modes.len(), dim, 54));
    check_shards(backend, &w.to_dtype(DType::BF16), &h.to_dtype(DType::BF16), &modes, 4, true);
}

/// Verification emits plain decoding's tokens whatever the drafts (the target's own, one
/// changed at each position, random), sequences of every kind in one batch, whole and sharded.
pub fn verification_is_drafter_invariant(backend: &dyn Backend, _: &Scale) {
    check_verification_is_drafter_invariant(backend);
}

/// A drafter sampling with the target's keys agrees with it as often as the Gumbel coupling
/// predicts, and neither marginal changes.
pub fn same_key_drafting_agrees_as_coupled(backend: &dyn Backend, _: &Scale) {
    check_same_key_drafting_agrees_as_coupled(backend);
}

/// The suite's tests for `$backend` (an expression making the backend) at `$scale`, each with
/// the attributes given (`#[ignore = "needs a CUDA GPU"]` for the GPU's): the same list, the
/// same names, on every backend.
#[macro_export]
macro_rules! suite {
    ($backend:expr, $scale:expr $(, #[$attribute:meta])*) => {
        $crate::suite!(@tests ($backend, $scale, [$(#[$attribute])*])
            chi_square_small_vocab
            chi_square_odd_vocab
            same_tokens_as_cpu
            greedy_rows_are_argmax
            batch_permutation_permutes_tokens
            identical_rows_draw_independently
            draws_split_across_calls_equal_one_call
            extreme_temperatures_sample_the_limit_distributions
            non_finite_logits_give_row_statuses
            non_finite_logits_give_row_statuses_under_truncations
            every_mode_samples_its_target_distribution_small_vocab
            every_mode_samples_its_target_distribution_large_vocab
            processing_edges
            top_k_keeps_every_token_tied_at_the_kth_value
            log_probabilities_match_f64
            every_row_of_a_mixed_batch_gets_what_it_gets_alone
            every_mode_on_heads_of_any_dtype_and_width
            shards_give_the_unsharded_tokens_and_log_probabilities
            verification_is_drafter_invariant
            same_key_drafting_agrees_as_coupled
        );
    };
    (@tests ($backend:expr, $scale:expr, $attributes:tt) $($name:ident)*) => {
        $($crate::suite!(@test ($backend, $scale, $attributes) $name);)*
    };
    (@test ($backend:expr, $scale:expr, [$(#[$attribute:meta])*]) $name:ident) => {
        #[test]
        $(#[$attribute])*
        fn $name() {
            $crate::suite::$name(&$backend, &$scale);
        }
    };
}
