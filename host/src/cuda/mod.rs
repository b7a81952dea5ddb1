//! The CUDA backend, in three layers: cudarc's raw and safe driver API; [`driver`], which
//! checks every result and holds the few raw calls we make ourselves; and the safe API here,
//! [`CudaSampler`] with its device buffers.
//!
//! - [`modules`]: the embedded PTX modules (portable sm_80, Hopper sm_90a), which one a device
//!   gets, and the loaded kernels with their launch shapes from the registry.
//! - [`dispatch`]: [`Variant`], the tile a call runs, and the dispatcher's choice.
//! - [`buffers`]: device memory, the LM head and hidden states with their TMA descriptors,
//!   tokens, row parameters, the workspace.
//! - [`passes`]: requests split into passes of bounded candidate memory.
//! - [`stream`]: [`StreamSampler`], the one path every call takes: kernels loaded in a
//!   context, queued on a given stream over given device memory (borrowed mode).
//! - [`sampler`]: [`CudaSampler`], the owned sampler (its own stream and buffers) on top.

pub mod buffers;
pub mod dispatch;
pub mod driver;
#[cfg(test)]
mod launches;
pub mod modules;
pub mod passes;
pub mod sampler;
pub mod stream;
#[cfg(feature = "nccl")]
pub mod tensor_parallel;

pub use buffers::{CudaHidden, CudaLmHead, DeviceRows, DeviceTokens};
pub use dispatch::{MMA_COLUMNS, TMA_COLUMNS, Variant};
pub use modules::{MODULE_VARIABLE, ModuleChoice};
pub use sampler::{CudaSampler, DeviceProcessing, ProcessedOutputs, ShardParts, VocabShard, cuda_device_count};
pub use stream::{
    DeviceElement, DeviceMatrix, DeviceWorkspace, ProcessedRequest, ProcessedTarget, ProcessingRef, SampleRequest,
    ShardMergeRequest, ShardTarget, StreamSampler, StreamWorkspace,
};
#[cfg(feature = "nccl")]
pub use tensor_parallel::{
    NcclId, RankInputs, RankStep, TensorParallelRank, TensorParallelSampler, nccl_library_present,
};
