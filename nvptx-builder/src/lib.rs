//! Build `no_std` Rust kernel crates into PTX with rustc's own NVPTX backend, from a build
//! script or an xtask: no LLVM 7 (which `rustc_codegen_nvvm` needs) and no
//! `llvm-bitcode-linker` (a rustup component many installs cannot add).
//!
//! [`PtxBuilder`] runs a nested nightly cargo on the kernel crate for each [`Target`]
//! (`-Zbuild-std=core`, fat LTO), with this very process as rustc's linker: rustc calls it back,
//! [`link_if_invoked`] sees that, and links the crate's bitcode with the toolchain's own
//! `llvm-link` → `opt` → `llc`. Optional checks then guard what GPU kernels get wrong silently:
//! `ptxas` validation with register and local-memory budgets (and a per-kernel resource table),
//! `.maxntid` launch bounds rustc cannot express, and warpgroup-collective instructions that
//! LLVM duplicated into branches. See `README.md` for setting up a kernel crate from zero.
//!
//! ```no_run
//! // build.rs of a crate that embeds its kernels
//! fn main() {
//!     nvptx_builder::link_if_invoked();
//!     let out = std::path::PathBuf::from(std::env::var_os("OUT_DIR").unwrap());
//!     nvptx_builder::PtxBuilder::new("kernels")
//!         .target(nvptx_builder::Target::new("sm_80").ptx_isa(7, 4).output(out.join("kernels_sm80.ptx")))
//!         .target(nvptx_builder::Target::new("sm_90a").ptx_isa(8, 3).output(out.join("kernels_sm90a.ptx")))
//!         .validate(nvptx_builder::Budget::default())
//!         .build()
//!         .unwrap_or_else(|e| panic!("{e}"));
//! }
//! ```

// The crate-level example is a build script, whose `main` is the point of it.
#![allow(clippy::needless_doctest_main)]

mod builder;
mod checks;
mod link;
mod ptxas;
mod toolchain;

pub use builder::{Built, PtxBuilder, Target};
pub use checks::{LaunchBounds, Occurrences, add_launch_bounds, check_written_once, entries};
pub use ptxas::{Budget, KernelResources, table};
pub use toolchain::{NVPTX_TARGET, Nightly, clean_command, find_ptxas};

/// What can go wrong, each with what is missing and how to fix it where that is known.
#[derive(Debug)]
pub enum Error {
    /// The toolchain lacks something the build needs; `fix` is the command that installs it.
    Toolchain { missing: String, fix: String },
    /// The builder was given no [`Target`].
    NoTargets,
    /// `ptxas` is needed ([`PtxBuilder::require_ptxas`]) and was not found.
    NoPtxas,
    /// The kernel crate did not build.
    Build(String),
    /// `ptxas` rejected the PTX or could not run.
    Ptxas(String),
    /// A kernel is over its [`Budget`].
    Budget(String),
    /// A check on the PTX failed.
    Check(String),
    /// Reading or writing a file failed.
    File(String),
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Error::Toolchain { missing, fix } => write!(f, "the kernel build needs {missing}; fix: {fix}"),
            Error::NoTargets => f.write_str("no target to build: add one, e.g. .target(Target::new(\"sm_80\"))"),
            Error::NoPtxas => {
                write!(f, "ptxas not found ($PTXAS, PATH or NVIDIA's PyPI wheels); fix: {}", toolchain::INSTALL_PTXAS)
            }
            Error::Build(why) | Error::Ptxas(why) | Error::Budget(why) | Error::Check(why) | Error::File(why) => {
                f.write_str(why)
            }
        }
    }
}

impl std::error::Error for Error {}

/// Performs the link step and exits when rustc has invoked this process as the kernel crate's
/// linker; returns at once otherwise. Call it first thing in the `main` of the build script or
/// xtask that runs [`PtxBuilder::build`].
pub fn link_if_invoked() {
    if let Some(llvm_bin) = std::env::var_os(link::LINKER_MODE_VARIABLE) {
        let args: Vec<String> = std::env::args().skip(1).collect();
        match link::run(llvm_bin.into(), &args) {
            Ok(()) => std::process::exit(0),
            Err(why) => {
                eprintln!("error: nvptx-builder link step: {why}");
                std::process::exit(1)
            }
        }
    }
}
