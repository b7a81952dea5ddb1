//! `cargo xtask build-kernels`: Rust kernels → PTX embedded by the host.

use std::path::Path;

use crate::{link, ptxas, toolchain};

pub struct Options {
    pub arch: String,
    pub check: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options { arch: "sm_90a".into(), check: false }
    }
}

/// Where the host embeds the PTX from (`include_str!` in `host/src/module.rs`).
pub const EMBEDDED_PTX: &str = "host/ptx/kernels.ptx";
const TARGET: &str = "nvptx64-nvidia-cuda";
/// PTX ISA 8.3: `wgmma`, TMA and `sm_90a` (8.0) and the tensor-map proxy fence (8.3).
const PTX_FEATURE: &str = "-Ctarget-feature=+ptx83";

pub fn build(options: &Options) -> Result<(), String> {
    let root = toolchain::workspace_root();
    let nightly = toolchain::nightly(&root)?;
    let ptx = compile(&root, &nightly, &options.arch)?;
    match toolchain::find_ptxas() {
        Some(ptxas) => ptxas::validate(&ptxas, &ptx, &options.arch)?,
        None => {
            eprintln!("note: ptxas not found ($PTXAS, PATH, or `pip install nvidia-cuda-nvcc-cu12`): PTX not validated")
        }
    }
    let destination = root.join(EMBEDDED_PTX);
    let fresh = std::fs::read_to_string(&ptx).map_err(|e| format!("cannot read {}: {e}", ptx.display()))?;
    check_aligned_ops_not_duplicated(&fresh)?;
    if options.check {
        let committed = std::fs::read_to_string(&destination).unwrap_or_default();
        if committed != fresh {
            return Err(format!(
                "{EMBEDDED_PTX} is stale (differs from a fresh build of kernels/); fix: cargo xtask build-kernels"
            ));
        }
        println!("{EMBEDDED_PTX} is up to date ({} kernels)", count_entries(&fresh));
    } else {
        std::fs::write(&destination, &fresh).map_err(|e| format!("cannot write {}: {e}", destination.display()))?;
        println!("wrote {EMBEDDED_PTX} ({} kernels, {} bytes)", count_entries(&fresh), fresh.len());
    }
    Ok(())
}

/// Warpgroup-collective `.sync.aligned` ops that the TMA kernels write once each: every thread
/// of the warpgroup must execute the same instance. LLVM treats inline asm as ordinary code
/// and may duplicate it into both arms of a branch (it did, around `if lane == 0`), which
/// compiles but hangs on the GPU; a second copy in one kernel is that bug. The commit and
/// `wait_group 0` appear exactly once, `wait_group 1` at most once (the handoff kernels wait
/// with `wait_group 0` only).
const ALIGNED_OPS_WRITTEN_ONCE: [(&str, std::ops::RangeInclusive<usize>); 3] = [
    ("wgmma.commit_group.sync.aligned", 1..=1),
    ("wgmma.wait_group.sync.aligned 0", 1..=1),
    ("wgmma.wait_group.sync.aligned 1", 0..=1),
];

fn check_aligned_ops_not_duplicated(ptx: &str) -> Result<(), String> {
    let mut problems = Vec::new();
    for entry in ptx.split(".visible .entry ").skip(1) {
        let name = entry.split('(').next().unwrap_or("");
        if !name.contains("_tma_") {
            continue;
        }
        for (op, allowed) in ALIGNED_OPS_WRITTEN_ONCE {
            let copies = entry.lines().filter(|l| l.trim_start().starts_with(op)).count();
            if !allowed.contains(&copies) {
                problems.push(format!("{name}: `{op}` appears {copies} times (expected {allowed:?})"));
            }
        }
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "warpgroup-aligned ops duplicated or missing (see ALIGNED_OPS_WRITTEN_ONCE):\n{}",
            problems.join("\n")
        ))
    }
}

fn count_entries(ptx: &str) -> usize {
    ptx.lines().filter(|l| l.starts_with(".visible .entry")).count()
}

/// Runs the nested nightly cargo for the kernel crate with this binary as its linker.
fn compile(root: &Path, nightly: &toolchain::Nightly, arch: &str) -> Result<std::path::PathBuf, String> {
    let target_dir = root.join("target/ptx");
    let this = std::env::current_exe().map_err(|e| format!("cannot locate xtask itself: {e}"))?;
    // Cargo cannot see that this binary is the linker: a fingerprint of the link step's
    // source in the flags makes a changed link step relink the kernels.
    let mut link_step = std::hash::DefaultHasher::new();
    std::hash::Hash::hash(include_str!("link.rs"), &mut link_step);
    let rustflags = [
        format!("-Ctarget-cpu={arch}"),
        PTX_FEATURE.to_string(),
        format!("-Clinker={}", this.display()),
        format!("--cfg=link_step_{:016x}", std::hash::Hasher::finish(&link_step)),
    ]
    .join("\u{1f}");
    let status = toolchain::clean_command(&nightly.cargo)
        .current_dir(root.join("kernels"))
        .args(["build", "--release", "--target", TARGET, "-Zbuild-std=core", "--target-dir"])
        .arg(&target_dir)
        .env("RUSTC", &nightly.rustc)
        .env("CARGO_ENCODED_RUSTFLAGS", rustflags)
        .env(link::LINKER_MODE_VARIABLE, &nightly.llvm_bin)
        .status()
        .map_err(|e| format!("cannot run cargo: {e}"))?;
    if !status.success() {
        return Err(format!("building kernels/ for {TARGET} failed ({status})"));
    }
    let ptx = target_dir.join(TARGET).join("release/flashsample_kernels.ptx");
    if !ptx.is_file() {
        return Err(format!("the build wrote no {}", ptx.display()));
    }
    Ok(ptx)
}
