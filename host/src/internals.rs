//! What the project's tests, benchmarks and CLI reach beyond the library's API (feature
//! `internals`): forced tile variants, the CPU backend's logits and winners, the kernels' row
//! parameters, and the checked driver calls the benchmark's timing makes. Not covered by the
//! crate's semver promise.
//!
//! The owned and borrowed samplers carry the rest of the hooks under the same feature:
//! `CudaSampler::{set_variant, poison_workspace, fill_outputs, random_lm_head, random_hidden,
//! lm_head_to_host, hidden_to_host, read_probe, mma_peak, gumbel_estimate_max_error,
//! sample_unfused_into}`, `StreamSampler::{plan_with_variant, enqueue_on_with_variant,
//! fill_uniform}`, `TensorParallelSampler::{random_lm_head, sample_into_phases}` and
//! `CandleSampler::set_variant`.

use flashsample_core::{Candidate, RowParams};

pub use crate::cuda::driver::{check, fill_words_async};
pub use crate::cuda::{MMA_COLUMNS, TMA_COLUMNS, Variant};
pub use flashsample_core::abi::{HANDOFF_COLUMNS, STAGED_COLUMNS, TMA_ITEM_ROWS};

use crate::error::Result;
use crate::params::SamplingParams;
use crate::tensor::Matrix;

/// The CPU backend's logits of row `row`: `Σ_k W[i, k] · H[row, k]`, summed in f32 in
/// increasing `k`.
pub fn logits_row(lm_head: &Matrix, hidden: &Matrix, row: usize) -> Vec<f32> {
    crate::cpu::logits_row(lm_head, hidden, row)
}

/// The CPU backend's winner of draw number `draw` of `row` over `logits` (the whole
/// vocabulary from index 0).
pub fn draw(logits: &[f32], row: &RowParams, draw: u32) -> Candidate {
    crate::cpu::draw_range(logits, 0, row, draw)
}

/// The kernels' form of each row's parameters (checked as every backend checks them).
pub fn row_params(params: &[SamplingParams]) -> Result<Vec<RowParams>> {
    crate::params::row_params(params)
}
