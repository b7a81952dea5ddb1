//! The one source of truth for exact Gumbel-max sampling.
//!
//! Everything that decides *which* token a row gets lives here and nowhere else: the
//! Philox4x32-10 generator ([`philox`]), the mapping from a draw's identity to Philox's key
//! and counter ([`noise`]), the uniform → Gumbel transform ([`gumbel`]), the perturbed score
//! and the (score, index) candidate merge ([`candidate`]), plus the cheap first pass
//! ([`estimate`]) that lets a kernel skip the exact noise for entries that cannot win. The crate is `no_std` and uses only
//! integer operations and IEEE `+ - * /` on `f32`, which rustc's NVPTX backend and the host
//! CPU both round to nearest without contraction, so the GPU kernels and the CPU sampler
//! compute the same bits for the same inputs.
//!
//! Architecture Invariant: nothing that decides a token may call a math library (`ln`, `exp`,
//! `fma`); those differ between the GPU and the CPU and would break bit-identical noise.
//! ([`estimate`] takes the hardware's logarithm as an argument and uses `mul_add`, only to
//! choose which entries get exact scores.)
//!
//! The crate builds on stable Rust for the host. Only the fused multiply-add of [`estimate`]
//! needs more than `core`: on the GPU it is `core`'s own (a nightly feature, which the kernel
//! build has anyway), on the host the standard library's; both are the correctly rounded
//! `fma`.
#![no_std]
#![warn(missing_docs)]
#![cfg_attr(target_arch = "nvptx64", feature(core_float_math, link_llvm_intrinsics))]
#![cfg_attr(target_arch = "nvptx64", allow(internal_features))]

#[cfg(not(target_arch = "nvptx64"))]
extern crate std;

pub mod abi;
pub mod candidate;
pub mod chain;
pub mod estimate;
pub mod gumbel;
pub mod noise;
pub mod philox;
pub mod process;
pub mod registry;
pub mod speculative;
#[cfg(test)]
mod testing;
pub mod truncation;

pub use candidate::{Candidate, NO_TOKEN, NON_FINITE_TOKEN, perturbed_score};
pub use noise::{RowParams, block_candidate, block_scores, noise_block};
