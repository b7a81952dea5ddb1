//! flashsample: exact token sampling fused into the LM-head matmul.
//!
//! `tokens = sample(softmax(H·Wᵀ / T))` per row, by the Gumbel-max trick: the GPU computes
//! each logits tile on chip, adds Philox-keyed Gumbel noise and keeps one (score, index) per
//! row and tile; a second small kernel reduces the tiles. The `[B, V]` logits never reach
//! device memory. [`CudaSampler`] runs it on an NVIDIA GPU; [`CpuSampler`] is its exact twin
//! (same noise, same merge rule) for tests and machines without a GPU.
//!
//! ```no_run
//! use flashsample::{CpuSampler, Elements, Matrix, SamplingParams};
//! let w = Matrix::new("lm_head", 3, 2, Elements::F32(vec![1.0, 0.0, 0.0, 1.0, 0.5, 0.5]))?;
//! let h = Matrix::new("hidden", 1, 2, Elements::F32(vec![2.0, -1.0]))?;
//! let sampler = CpuSampler::new();
//! let head = sampler.upload_lm_head(&w)?;
//! let tokens = sampler.sample(&head, &h, &[SamplingParams::new(1.0, 42, 0, 0)], 4)?;
//! assert_eq!(tokens.len(), 4);
//! # Ok::<(), flashsample::Error>(())
//! ```

#[cfg(feature = "candle")]
pub mod candle;
pub mod cpu;
pub mod cuda;
pub mod error;
pub mod params;
pub mod process;
pub mod tensor;

#[cfg(feature = "candle")]
pub use candle::{CandleSampled, CandleSampler};
pub use cpu::{CpuLmHead, CpuSampler, Sampled};
pub use cuda::{
    CudaHidden, CudaLmHead, CudaSampler, DeviceElement, DeviceMatrix, DeviceProcessing, DeviceRows, DeviceTokens,
    DeviceWorkspace, MMA_COLUMNS, ModuleChoice, ProcessedOutputs, ProcessedRequest, ProcessedTarget, ProcessingRef,
    SampleRequest, ShardMergeRequest, ShardParts, ShardTarget, StreamSampler, StreamWorkspace, TMA_COLUMNS, Variant,
    VocabShard, cuda_device_count,
};
#[cfg(feature = "nccl")]
pub use cuda::{NcclId, RankInputs, RankStep, TensorParallelRank, TensorParallelSampler, nccl_library_present};
/// The cudarc this crate is built with: the safe wrappers of borrowed mode take its
/// `CudaStream` and `CudaSlice`.
pub use cudarc;
pub use error::{Error, Result, RowStatus};
pub use flashsample_core::abi::{HANDOFF_COLUMNS, TMA_ITEM_ROWS};
pub use flashsample_core::process::{LogSumExp, Penalties};
pub use flashsample_core::registry::Module;
pub use flashsample_core::{NO_TOKEN, NON_FINITE_TOKEN, RowParams};
pub use params::{Draws, HeadShape, SamplingParams, row_params};
pub use process::Processing;
pub use tensor::{DType, Elements, Matrix, MatrixShape};
