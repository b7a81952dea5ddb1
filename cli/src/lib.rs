//! The library half of `flashsample-cli`: what the `flashsample` command reads and writes
//! besides sampling, for the command and for the test suite.
//!
//! - [`io`]: one 2-D tensor from a safetensors file, `.npy` files in and out.
//! - [`stats`]: the exact softmax of a row and Pearson's χ² of drawn tokens against it.
//!
//! The sampler itself is the `flashsample` crate.

#![warn(missing_docs)]

pub mod io;
pub mod stats;
