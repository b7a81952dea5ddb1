//! `cargo xtask build-kernels`: Rust kernels → the PTX modules the host embeds, one per
//! [`Module`] of the registry.

use std::path::{Path, PathBuf};

use flashsample_core::registry::{KERNELS, Kernel, Module};

use crate::{link, ptxas, toolchain};

pub struct Options {
    /// The modules to build; every module when empty.
    pub modules: Vec<Module>,
    pub check: bool,
}

/// How the kernel crate is compiled for a module.
struct Target {
    /// rustc's `-Ctarget-cpu`, also ptxas's `-arch`.
    cpu: &'static str,
    /// The PTX ISA version as an NVPTX target feature, when the default for `cpu` is too old.
    ptx_feature: Option<&'static str>,
}

fn target(module: Module) -> Target {
    match module {
        // PTX ISA 7.4 (CUDA 11.4 drivers and newer JIT-compile it): the L2 prefetch-size hint
        // of the mma tile's loads.
        Module::Portable => Target { cpu: "sm_80", ptx_feature: Some("+ptx74") },
        // PTX ISA 8.3: `wgmma`, TMA and `sm_90a` (8.0) and the tensor-map proxy fence (8.3).
        Module::Hopper => Target { cpu: "sm_90a", ptx_feature: Some("+ptx83") },
    }
}

/// Where the host embeds a module from (`include_str!` in `host/src/cuda/registry.rs`).
pub fn embedded_ptx(module: Module) -> String {
    format!("host/ptx/{}.ptx", module.name())
}

const TARGET: &str = "nvptx64-nvidia-cuda";

pub fn build(options: &Options) -> Result<(), String> {
    let root = toolchain::workspace_root();
    let nightly = toolchain::nightly(&root)?;
    let ptxas = toolchain::find_ptxas();
    if ptxas.is_none() {
        eprintln!("note: ptxas not found ($PTXAS, PATH, or `pip install nvidia-cuda-nvcc-cu12`): PTX not validated");
    }
    let modules = if options.modules.is_empty() { Module::ALL.to_vec() } else { options.modules.clone() };
    let mut stale = Vec::new();
    for module in modules {
        let ptx = compile(&root, &nightly, module)?;
        if let Some(ptxas) = &ptxas {
            ptxas::validate(ptxas, &ptx, target(module).cpu)?;
        }
        let fresh = std::fs::read_to_string(&ptx).map_err(|e| format!("cannot read {}: {e}", ptx.display()))?;
        check_entries(module, &fresh)?;
        check_aligned_ops_not_duplicated(&fresh)?;
        let embedded = embedded_ptx(module);
        let destination = root.join(&embedded);
        if options.check {
            let committed = std::fs::read_to_string(&destination).unwrap_or_default();
            if committed == fresh {
                println!("{embedded} is up to date ({} kernels)", entries(&fresh).len());
            } else {
                stale.push(embedded);
            }
        } else {
            std::fs::write(&destination, &fresh).map_err(|e| format!("cannot write {}: {e}", destination.display()))?;
            println!("wrote {embedded} ({} kernels, {} bytes)", entries(&fresh).len(), fresh.len());
        }
    }
    if stale.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "{} stale (differs from a fresh build of kernels/); fix: cargo xtask build-kernels",
            stale.join(" and ")
        ))
    }
}

/// The names of the PTX's entry points.
fn entries(ptx: &str) -> Vec<&str> {
    ptx.lines().filter_map(|l| l.strip_prefix(".visible .entry ")).map(|l| l.split('(').next().unwrap_or(l)).collect()
}

/// The PTX holds exactly the registry's kernels of `module`, so the host finds every kernel it
/// looks up and nothing unlisted is compiled.
fn check_entries(module: Module, ptx: &str) -> Result<(), String> {
    let found = entries(ptx);
    let missing: Vec<&str> = module.kernels().map(|e| e.name).filter(|name| !found.contains(name)).collect();
    let unlisted: Vec<&str> =
        found.iter().copied().filter(|&name| Kernel::named(name).is_none_or(|k| !module.holds(k))).collect();
    if missing.is_empty() && unlisted.is_empty() {
        return Ok(());
    }
    Err(format!(
        "the {} module's PTX does not match the registry (flashsample_core::registry): missing {missing:?}, not listed for it {unlisted:?}",
        module.name()
    ))
}

/// Every warpgroup-collective op a kernel writes once appears once in its PTX
/// ([`Kernel::aligned_ops_written_once`]).
fn check_aligned_ops_not_duplicated(ptx: &str) -> Result<(), String> {
    let mut problems = Vec::new();
    for entry in ptx.split(".visible .entry ").skip(1) {
        let name = entry.split('(').next().unwrap_or("");
        let Some(kernel) = Kernel::named(name) else { continue };
        for &(op, fewest, most) in kernel.aligned_ops_written_once() {
            let copies = entry.lines().filter(|l| l.trim_start().starts_with(op)).count();
            if !(fewest..=most).contains(&copies) {
                problems.push(format!("{name}: `{op}` appears {copies} times (expected {fewest}..={most})"));
            }
        }
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(format!("warpgroup-aligned ops duplicated or missing:\n{}", problems.join("\n")))
    }
}

/// The flags that select `module`'s target for the kernel crate (rustc and clippy alike).
fn module_flags(module: Module) -> Vec<String> {
    let target = target(module);
    let mut flags = vec![format!("-Ctarget-cpu={}", target.cpu)];
    flags.extend(target.ptx_feature.map(|feature| format!("-Ctarget-feature={feature}")));
    flags.push(format!("--cfg=flashsample_module=\"{}\"", module.name()));
    flags
}

/// A nested nightly cargo in `kernels/` for `module`, with its own target folder (so switching
/// modules rebuilds nothing) and `flags`.
fn kernel_cargo(
    root: &Path,
    nightly: &toolchain::Nightly,
    module: Module,
    subcommand: &str,
    flags: Vec<String>,
) -> std::process::Command {
    let mut command = toolchain::clean_command(&nightly.cargo);
    command
        .current_dir(root.join("kernels"))
        .args([subcommand, "--release", "--target", TARGET, "-Zbuild-std=core", "--target-dir"])
        .arg(root.join("target/kernels").join(subcommand).join(module.name()))
        .env("RUSTC", &nightly.rustc)
        .env("CARGO_ENCODED_RUSTFLAGS", flags.join("\u{1f}"));
    command
}

/// Runs the nested nightly cargo for the kernel crate with this binary as its linker.
fn compile(root: &Path, nightly: &toolchain::Nightly, module: Module) -> Result<PathBuf, String> {
    let this = std::env::current_exe().map_err(|e| format!("cannot locate xtask itself: {e}"))?;
    // Cargo cannot see that this binary is the linker: a fingerprint of the link step's
    // source and of the registry (which decides the launch bounds it writes) in the flags
    // makes a changed link step relink the kernels.
    let mut link_step = std::hash::DefaultHasher::new();
    std::hash::Hash::hash(include_str!("link.rs"), &mut link_step);
    std::hash::Hash::hash(&format!("{KERNELS:?}"), &mut link_step);
    let mut flags = module_flags(module);
    flags.extend([
        format!("-Clinker={}", this.display()),
        format!("--cfg=link_step_{:016x}", std::hash::Hasher::finish(&link_step)),
    ]);
    let status = kernel_cargo(root, nightly, module, "build", flags)
        .env(link::LINKER_MODE_VARIABLE, &nightly.llvm_bin)
        .status()
        .map_err(|e| format!("cannot run cargo: {e}"))?;
    if !status.success() {
        return Err(format!("building kernels/ for {TARGET} ({} module) failed ({status})", module.name()));
    }
    let ptx =
        root.join("target/kernels/build").join(module.name()).join(TARGET).join("release/flashsample_kernels.ptx");
    if !ptx.is_file() {
        return Err(format!("the build wrote no {}", ptx.display()));
    }
    Ok(ptx)
}

/// `cargo xtask clippy-kernels`: clippy over the kernel crate as each module builds it, every
/// warning an error, and every `unsafe` block with its `// SAFETY:` line.
pub fn clippy(modules: &[Module]) -> Result<(), String> {
    let root = toolchain::workspace_root();
    let nightly = toolchain::nightly(&root)?;
    let modules = if modules.is_empty() { Module::ALL.to_vec() } else { modules.to_vec() };
    for module in modules {
        let status = kernel_cargo(&root, &nightly, module, "clippy", module_flags(module))
            .args(["--", "-D", "warnings", "-D", "clippy::undocumented_unsafe_blocks"])
            .status()
            .map_err(|e| format!("cannot run cargo clippy: {e}"))?;
        if !status.success() {
            return Err(format!("clippy found problems in kernels/ ({} module)", module.name()));
        }
    }
    Ok(())
}
