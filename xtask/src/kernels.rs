//! `cargo xtask build-kernels` and `clippy-kernels`: the kernel crate built into the PTX modules
//! the host embeds, one per [`Module`] of the registry, through `nvptx-builder`.

use std::path::Path;

use flashsample_core::registry::{Kernel, Module};
use nvptx_builder::{Budget, Nightly, PtxBuilder, Target, entries, table};

use crate::toolchain;

pub struct Options {
    /// The modules to build; every module when empty.
    pub modules: Vec<Module>,
    pub check: bool,
}

/// How the kernel crate is compiled for a module.
fn target(module: Module) -> Target {
    let target = match module {
        // PTX ISA 7.4 (CUDA 11.4 drivers and newer JIT-compile it): the L2 prefetch-size hint
        // of the mma tile's loads.
        Module::Portable => Target::new("sm_80").ptx_isa(7, 4),
        // PTX ISA 8.3: `wgmma`, TMA and `sm_90a` (8.0) and the tensor-map proxy fence (8.3).
        Module::Hopper => Target::new("sm_90a").ptx_isa(8, 3),
    };
    target.cfg(&format!("flashsample_module=\"{}\"", module.name()))
}

/// Where a module's PTX is committed (the host embeds it unless the module ships machine
/// code: `include_str!` in `host/src/cuda/modules.rs`).
pub fn embedded_ptx(module: Module) -> String {
    format!("host/ptx/{}.ptx", module.name())
}

/// Where a module's machine code is committed, for modules that ship it
/// ([`Module::cubin_arch`]; `include_bytes!` in `host/src/cuda/modules.rs`).
fn embedded_cubin(module: Module, arch: &str) -> String {
    format!("host/ptx/{}.{arch}.cubin", module.name())
}

/// `ptxas -arch=<arch> -O3` of the PTX file `ptx` into `cubin`. The machine code depends on
/// ptxas's version: CI pins the one that made the committed files (`.ci/run`).
fn compile_cubin(ptx: &Path, arch: &str, cubin: &Path) -> Result<(), String> {
    let ptxas = nvptx_builder::find_ptxas()
        .ok_or("ptxas not found (PTXAS, PATH or NVIDIA's PyPI wheel nvidia-cuda-nvcc-cu12): the Hopper module ships machine code")?;
    let output = std::process::Command::new(&ptxas)
        .arg(format!("-arch={arch}"))
        .arg("-O3")
        .arg(ptx)
        .arg("-o")
        .arg(cubin)
        .output()
        .map_err(|e| format!("cannot run {}: {e}", ptxas.display()))?;
    if !output.status.success() {
        return Err(format!(
            "ptxas -arch={arch} failed on {}:\n{}",
            ptx.display(),
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    Ok(())
}

/// Compiles the module's PTX (at `ptx`) into its committed machine code, or with `check`
/// compares a fresh compile with the committed file; returns the stale file's name, if any.
fn cubin_step(root: &Path, module: Module, ptx: &Path, check: bool) -> Result<Option<String>, String> {
    let Some(arch) = module.cubin_arch() else { return Ok(None) };
    let embedded = embedded_cubin(module, arch);
    let destination = root.join(&embedded);
    if !check {
        compile_cubin(ptx, arch, &destination)?;
        let bytes = std::fs::metadata(&destination).map(|m| m.len()).unwrap_or(0);
        println!("wrote {embedded} ({bytes} bytes)");
        return Ok(None);
    }
    let fresh = root.join(format!("target/kernels/{}.{arch}.cubin", module.name()));
    compile_cubin(ptx, arch, &fresh)?;
    let (fresh, committed) =
        (std::fs::read(&fresh).unwrap_or_default(), std::fs::read(&destination).unwrap_or_default());
    if fresh == committed {
        println!("{embedded} is up to date");
        Ok(None)
    } else {
        Ok(Some(embedded))
    }
}

fn modules_or_all(modules: &[Module]) -> Vec<Module> {
    if modules.is_empty() { Module::ALL.to_vec() } else { modules.to_vec() }
}

pub fn build(options: &Options) -> Result<(), String> {
    let root = toolchain::workspace_root();
    let modules = modules_or_all(&options.modules);
    let mut builder = PtxBuilder::new(root.join("kernels"))
        .target_dir(root.join("target/kernels"))
        .validate(Budget::default())
        .launch_bounds(|name| Kernel::named(name).and_then(Kernel::launch_bounds))
        .written_once(|name| Kernel::named(name).map_or(&[], Kernel::aligned_ops_written_once));
    for &module in &modules {
        builder = builder.target(target(module));
    }
    let built = builder.build().map_err(|e| e.to_string())?;
    let mut stale = Vec::new();
    for (module, built) in modules.into_iter().zip(built) {
        if let Some(resources) = &built.resources {
            print!("{}", table(&built.target.cpu, resources));
        }
        check_entries(module, &built.ptx)?;
        let embedded = embedded_ptx(module);
        let destination = root.join(&embedded);
        if options.check {
            let committed = std::fs::read_to_string(&destination).unwrap_or_default();
            if committed == built.ptx {
                println!("{embedded} is up to date ({} kernels)", entries(&built.ptx).len());
                stale.extend(cubin_step(&root, module, &destination, true)?);
            } else {
                stale.push(embedded);
            }
        } else {
            std::fs::write(&destination, &built.ptx)
                .map_err(|e| format!("cannot write {}: {e}", destination.display()))?;
            println!("wrote {embedded} ({} kernels, {} bytes)", entries(&built.ptx).len(), built.ptx.len());
            cubin_step(&root, module, &destination, false)?;
        }
    }
    if stale.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "{} stale (differs from a fresh build of kernels/ and ptxas); fix: cargo xtask build-kernels",
            stale.join(" and ")
        ))
    }
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

/// `cargo xtask clippy-kernels`: clippy over the kernel crate as each module builds it, every
/// warning an error, and every `unsafe` block with its `// SAFETY:` line.
pub fn clippy(modules: &[Module]) -> Result<(), String> {
    let root = toolchain::workspace_root();
    let nightly = Nightly::find("nightly").map_err(|e| e.to_string())?;
    for module in modules_or_all(modules) {
        run_clippy(&root, &nightly, module)?;
    }
    Ok(())
}

fn run_clippy(root: &Path, nightly: &Nightly, module: Module) -> Result<(), String> {
    let target_dir = root.join("target/kernels/clippy").join(module.name());
    let status = nightly
        .kernel_cargo("clippy", &root.join("kernels"), &target_dir, &target(module).rustflags())
        .args(["--", "-D", "warnings", "-D", "clippy::undocumented_unsafe_blocks"])
        .status()
        .map_err(|e| format!("cannot run cargo clippy: {e}"))?;
    if !status.success() {
        return Err(format!("clippy found problems in kernels/ ({} module)", module.name()));
    }
    Ok(())
}
