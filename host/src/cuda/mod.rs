//! The CUDA backend, in three layers: cudarc's raw and safe driver API; [`driver`], which
//! checks every result and holds the few raw calls we make ourselves; and the library's safe
//! API on top, with the `unsafe` raw-pointer layer beside it for foreign memory.
//!
//! - [`modules`]: the embedded modules (portable sm_80 PTX, Hopper sm_90a machine code), which
//!   one a device gets, and the loaded kernels with the one launch.
//! - [`dispatch`]: [`Variant`], the tile a call runs, and the dispatcher's choice.
//! - [`memory`], [`batch`]: allocations, matrices by address, tensor maps; a batch's rows and
//!   processing on the device.
//! - [`request`], [`plan`]: what a call samples and where its results go (views of any
//!   memory), checked once into a [`Plan`].
//! - [`tiles`], [`materialised`], [`merge`], [`verdicts`], with [`schedule`] and [`passes`]:
//!   the launches of the fused path, the materialised path, the shard merge and a
//!   verification's verdicts.
//! - [`enqueue`]: one segment of a plan, and the one driver of every call's segments.
//! - [`stream`]: [`StreamSampler`], borrowed mode (the caller's context, stream and memory).
//! - [`owned`]: [`CudaSampler`], the owned sampler (its own stream and buffers).
//! - [`tensor_parallel`] (feature `nccl`): the sharded path over NCCL.

mod batch;
mod dispatch;
pub(crate) mod driver;
mod enqueue;
#[cfg(test)]
mod launches;
mod listed;
mod materialised;
mod memory;
mod merge;
mod modules;
mod owned;
mod passes;
mod plan;
mod request;
mod schedule;
mod stream;
#[cfg(feature = "nccl")]
mod tensor_parallel;
mod tiles;
mod verdicts;

pub use batch::{BatchRef, DeviceBatch};
#[cfg(feature = "internals")]
pub use dispatch::{MMA_COLUMNS, TMA_COLUMNS, Variant};
pub use modules::{ModuleChoice, cuda_device_count};
pub(crate) use owned::ResidentHead;
pub use owned::{CudaHidden, CudaSampler, DeviceOutputs};
pub use plan::Plan;
pub use request::{DeviceElement, DeviceMatrix, DeviceWorkspace, Exchange, OutputSlice, Request, Shard, Target};
pub use stream::{StreamSampler, StreamWorkspace};
#[cfg(feature = "nccl")]
pub use tensor_parallel::{
    DEFAULT_TIMEOUT, NcclId, RankInputs, TensorParallelRank, TensorParallelSampler, nccl_library_present,
};
