//! flashsample: exact token sampling fused into the LM-head matmul.
//!
//! `tokens = sample(softmax(H·Wᵀ / T))` per row, by the Gumbel-max trick: the GPU computes
//! each logits tile on chip, adds Philox-keyed Gumbel noise and keeps one (score, index) per
//! row and tile; a second small kernel reduces the tiles. The `[B, V]` logits never reach
//! device memory for plain sampling and the per-entry processing modes.
//!
//! Two concepts describe what to sample: [`SamplingParams`] (temperature, seed, sequence,
//! step) and [`Processing`] (soft-cap, bias, mask, penalties, min-p, top-k, top-p,
//! log-probabilities), one of each per row, together a [`Batch`]. Then there is one way in
//! per kind of memory:
//!
//! - host matrices: the [`Sampler`] trait, implemented by [`CpuSampler`], [`CudaSampler`] and
//!   (feature `nccl`) `TensorParallelSampler`; [`gpu_or_cpu`] picks the GPU if one is usable;
//! - the owned GPU sampler's buffers in a decode loop: [`CudaSampler::sample_into`];
//! - a caller's device memory (borrowed mode): a [`Request`] and a [`Target`] of views, planned
//!   by [`StreamSampler::plan`] and queued by [`StreamSampler::enqueue_on`] (safe, cudarc's
//!   handles) or [`StreamSampler::enqueue`] (`unsafe`, raw handles); tensor-parallel ranks
//!   (`TensorParallelRank`) queue the same requests with NCCL between their segments;
//! - candle tensors (feature `candle` on the CPU, `candle-cuda` on the GPU): `CandleSampler`.
//!
//! ```
//! use flashsample::{Batch, Draws, Elements, Matrix, Sampler, SamplingParams};
//! let w = Matrix::new("lm_head", 3, 2, Elements::F32(vec![1.0, 0.0, 0.0, 1.0, 0.5, 0.5]))?;
//! let h = Matrix::new("hidden", 1, 2, Elements::F32(vec![2.0, -1.0]))?;
//! let sampler = flashsample::gpu_or_cpu(0)?;
//! let head = sampler.upload_lm_head(&w)?;
//! let batch = Batch::new(vec![SamplingParams::new(1.0, 42, 0, 0)]);
//! let sampled = sampler.sample(&head, &h, &batch, Draws::first(4))?;
//! assert_eq!(sampled.tokens.len(), 4);
//! # Ok::<(), flashsample::Error>(())
//! ```

#![warn(missing_docs)]

mod batch;
#[cfg(feature = "candle")]
mod candle;
mod cpu;
mod cuda;
mod error;
#[cfg(feature = "internals")]
pub mod internals;
mod params;
mod processing;
mod sampled;
mod sampler;
mod tensor;

pub use batch::{Batch, Drafted};
#[cfg(feature = "candle")]
pub use candle::{CandleSampled, CandleSampler};
pub use cpu::CpuSampler;
pub use cuda::{
    BatchRef, CudaHidden, CudaSampler, DeviceBatch, DeviceElement, DeviceMatrix, DeviceOutputs, DeviceWorkspace,
    Exchange, ModuleChoice, OutputSlice, Plan, Request, Shard, StreamSampler, StreamWorkspace, Target,
    cuda_device_count,
};
#[cfg(feature = "nccl")]
pub use cuda::{DEFAULT_TIMEOUT, NcclId, RankInputs, TensorParallelRank, TensorParallelSampler, nccl_library_present};
/// The cudarc this crate is built with: the safe layer of borrowed mode takes its
/// `CudaStream` and `CudaSlice`.
pub use cudarc;
pub use error::{Error, Result};
pub use flashsample_core::process::Penalties;
pub use flashsample_core::registry::Module;
pub use flashsample_core::{NO_TOKEN, NON_FINITE_TOKEN, RowParams};
/// The `half` this crate is built with: `bf16` and `f16` elements of [`Elements`].
pub use half;
pub use params::{Draws, HeadShape, SamplingParams, VocabShard};
pub use processing::Processing;
pub use sampled::{RowStatus, Sampled, Verdict};
pub use sampler::{LmHead, Sampler};
pub use tensor::{DType, Elements, Matrix, MatrixShape};

/// Every Rust block of the repository's README, compiled and run as a doc-test (with the
/// features the workspace's tests turn on: candle's block needs `candle`, the tensor-parallel
/// part `nccl`).
#[cfg(all(doctest, feature = "candle", feature = "nccl"))]
#[doc = include_str!("../../README.md")]
pub struct ReadmeDoctests;

/// The GPU `ordinal` if it is usable (a driver, a device, a module for it), else the CPU.
/// Other failures of the GPU (a driver call that fails) are errors.
pub fn gpu_or_cpu(ordinal: usize) -> Result<Box<dyn Sampler>> {
    match CudaSampler::on_device(ordinal) {
        Ok(sampler) => Ok(Box::new(sampler)),
        Err(Error::NoCudaDevice(_) | Error::UnsupportedDevice { .. }) => Ok(Box::new(CpuSampler::new())),
        Err(other) => Err(other),
    }
}
