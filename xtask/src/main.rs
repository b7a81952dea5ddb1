//! `cargo xtask <command>`: the project's build chores, in Rust (matklad's cargo-xtask).
//!
//! - `build-kernels [--module portable|hopper] [--check]`: build `kernels/` into one PTX module
//!   per module of the registry (`portable`: sm_80; `hopper`: sm_90a) with `nvptx-builder`
//!   (launch bounds and the aligned-op check from the registry, ptxas budgets), check that
//!   each holds exactly its registry kernels, and write `host/ptx/<module>.ptx`, which the host
//!   embeds, and `host/ptx/sources.digest`, a digest of the sources they came from. `--check`
//!   fails if a committed module differs from a fresh build and was not built from the
//!   current sources (CI runs it): builds of one commit have differed in their text.
//! - `clippy-kernels [--module portable|hopper]`: clippy over `kernels/` as each module builds
//!   it, warnings denied and every `unsafe` block documented (`// SAFETY:`); CI runs it.
//! - `bundle [--out DIR]`: build the release CLI, the test binaries and the examples and gather
//!   them with `scripts/gpu-run.sh` into one folder (default `bundle/`) to carry to the GPU
//!   machine. With `--candle`: the candle adapter's tests and example alone (default
//!   `bundle-candle/`), built in candle's CUDA environment (`scripts/candle-cuda-env.sh`).
//!
//! The same binary also serves as rustc's linker for the kernel crate
//! (`nvptx_builder::link_if_invoked`).

mod bundle;
mod kernels;
mod toolchain;

use std::process::ExitCode;

use flashsample_core::registry::Module;

const USAGE: &str = "usage: cargo xtask build-kernels [--module portable|hopper] [--check]\n       cargo xtask clippy-kernels [--module portable|hopper]\n       cargo xtask bundle [--out DIR] [--candle]";

fn main() -> ExitCode {
    // rustc calls this binary back as the kernel crate's linker (nvptx-builder's link step).
    nvptx_builder::link_if_invoked();
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run_command(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("error: {message}");
            ExitCode::FAILURE
        }
    }
}

fn run_command(args: &[String]) -> Result<(), String> {
    let (command, rest) = args.split_first().ok_or_else(|| USAGE.to_string())?;
    match command.as_str() {
        "build-kernels" => {
            let mut options = kernels::Options { modules: Vec::new(), check: false };
            let mut rest = rest.iter();
            while let Some(arg) = rest.next() {
                match arg.as_str() {
                    "--module" => options.modules.push(module_argument(rest.next())?),
                    "--check" => options.check = true,
                    other => return Err(format!("unknown argument `{other}`\n{USAGE}")),
                }
            }
            kernels::build(&options)
        }
        "clippy-kernels" => {
            let mut modules = Vec::new();
            let mut rest = rest.iter();
            while let Some(arg) = rest.next() {
                match arg.as_str() {
                    "--module" => modules.push(module_argument(rest.next())?),
                    other => return Err(format!("unknown argument `{other}`\n{USAGE}")),
                }
            }
            kernels::clippy(&modules)
        }
        "bundle" => {
            let (mut out, mut candle) = (None, false);
            let mut rest = rest.iter();
            while let Some(arg) = rest.next() {
                match arg.as_str() {
                    "--out" => out = Some(rest.next().ok_or("--out needs a folder")?.clone()),
                    "--candle" => candle = true,
                    other => return Err(format!("unknown argument `{other}`\n{USAGE}")),
                }
            }
            if candle { bundle::build_candle(out.as_deref()) } else { bundle::build(out.as_deref()) }
        }
        other => Err(format!("unknown command `{other}`\n{USAGE}")),
    }
}

/// The module `--module` names.
fn module_argument(value: Option<&String>) -> Result<Module, String> {
    let name = value.ok_or("--module needs a value: portable or hopper")?;
    Module::ALL
        .into_iter()
        .find(|m| m.name() == name)
        .ok_or_else(|| format!("--module `{name}`: the modules are portable and hopper"))
}
