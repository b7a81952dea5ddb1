//! `cargo xtask build-kernels` and `clippy-kernels`: the kernel crate built into the PTX modules
//! the host embeds, one per [`Module`] of the registry, through `nvptx-builder`.

use std::path::Path;

use flashsample_core::registry::{Kernel, Module};
use nvptx_builder::{Budget, LaunchBounds, Nightly, PtxBuilder, Target, entries, table};

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

/// Where the digest of the sources the committed modules were built from is committed.
const SOURCES_DIGEST: &str = "host/ptx/sources.digest";

/// What a kernel build reads, relative to the workspace root: folders (every file below
/// them) and files.
const KERNEL_SOURCES: [&str; 8] = [
    "kernels/src",
    "kernels/Cargo.toml",
    "core/src",
    "core/Cargo.toml",
    "nvptx-builder/src",
    "nvptx-builder/Cargo.toml",
    "rust-toolchain.toml",
    "xtask/src/kernels.rs",
];

/// A digest of the kernel build's sources ([`KERNEL_SOURCES`]): two FNV-1a hashes (64-bit,
/// two offsets) over every file's relative path and contents, in path order, as 32 hex
/// digits. Not a defence against tampering: a record of which sources made the committed
/// modules.
fn sources_digest(root: &Path) -> Result<String, String> {
    fn files(root: &Path, relative: &Path, out: &mut Vec<std::path::PathBuf>) -> Result<(), String> {
        let path = root.join(relative);
        if path.is_dir() {
            let entries = std::fs::read_dir(&path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
            for entry in entries {
                let entry = entry.map_err(|e| format!("cannot read {}: {e}", path.display()))?;
                files(root, &relative.join(entry.file_name()), out)?;
            }
        } else {
            out.push(relative.to_path_buf());
        }
        Ok(())
    }
    let mut paths = Vec::new();
    for source in KERNEL_SOURCES {
        files(root, Path::new(source), &mut paths)?;
    }
    paths.sort();
    let mut hashes = [0xcbf2_9ce4_8422_2325u64, 0x6c62_272e_07bb_0142];
    let mut add = |bytes: &[u8]| {
        for hash in &mut hashes {
            for &byte in bytes {
                *hash = (*hash ^ byte as u64).wrapping_mul(0x0000_0100_0000_01b3);
            }
        }
    };
    for path in &paths {
        let contents = std::fs::read(root.join(path)).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        add(path.to_string_lossy().as_bytes());
        add(&(contents.len() as u64).to_le_bytes());
        add(&contents);
    }
    Ok(format!("{:016x}{:016x}", hashes[0], hashes[1]))
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
        .launch_bounds(|name| {
            let kernel = Kernel::named(name)?;
            let min_blocks = kernel.min_blocks_per_multiprocessor();
            kernel.launch_bounds().map(|threads| LaunchBounds { threads, min_blocks })
        })
        .written_once(|name| Kernel::named(name).map_or(&[], Kernel::aligned_ops_written_once));
    for &module in &modules {
        builder = builder.target(target(module));
    }
    let built = builder.build().map_err(|e| e.to_string())?;
    let digest = sources_digest(&root)?;
    let digest_path = root.join(SOURCES_DIGEST);
    let sources_unchanged = std::fs::read_to_string(&digest_path).is_ok_and(|committed| committed.trim() == digest);
    let mut stale = Vec::new();
    let every_module = modules.len() == Module::ALL.len();
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
            } else if sources_unchanged {
                // A fresh build need not match byte for byte: two clones of one commit on one
                // machine built PTX whose phi operands came in another order in two kernels
                // (the cause not found). The committed module stands if it was built from
                // these sources and holds the registry's kernels.
                check_entries(module, &committed)?;
                println!(
                    "{embedded} was built from these sources ({SOURCES_DIGEST}); this folder's build differs in its text"
                );
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
    if !options.check {
        if every_module {
            std::fs::write(&digest_path, format!("{digest}\n"))
                .map_err(|e| format!("cannot write {}: {e}", digest_path.display()))?;
            println!("wrote {SOURCES_DIGEST} ({digest})");
        } else {
            println!("{SOURCES_DIGEST} left as it was: only a build of every module records its sources");
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A workspace-like folder holding every [`KERNEL_SOURCES`] entry, under `name` in the
    /// system's temporary folder.
    fn sources(name: &str) -> std::path::PathBuf {
        let root = std::env::temp_dir().join(format!("flashsample-xtask-digest-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        for source in KERNEL_SOURCES {
            let path = root.join(source);
            if Path::new(source).extension().is_some() {
                std::fs::create_dir_all(path.parent().unwrap()).unwrap();
                std::fs::write(&path, source).unwrap();
            } else {
                std::fs::create_dir_all(path.join("nested")).unwrap();
                std::fs::write(path.join("lib.rs"), "a").unwrap();
                std::fs::write(path.join("nested/b.rs"), "b").unwrap();
            }
        }
        root
    }

    #[test]
    fn the_digest_follows_the_sources_and_nothing_else() {
        let (one, two) = (sources("one"), sources("two"));
        let digest = sources_digest(&one).unwrap();
        // The same sources in another folder, and a file outside the sources: the same digest.
        assert_eq!(sources_digest(&two).unwrap(), digest);
        std::fs::write(two.join("README.md"), "not a source").unwrap();
        assert_eq!(sources_digest(&two).unwrap(), digest);
        // A changed byte, a moved file, a new file: another digest.
        std::fs::write(two.join("core/src/nested/b.rs"), "c").unwrap();
        assert_ne!(sources_digest(&two).unwrap(), digest);
        std::fs::write(two.join("core/src/nested/b.rs"), "b").unwrap();
        std::fs::rename(two.join("core/src/nested/b.rs"), two.join("core/src/b.rs")).unwrap();
        assert_ne!(sources_digest(&two).unwrap(), digest);
        std::fs::rename(two.join("core/src/b.rs"), two.join("core/src/nested/b.rs")).unwrap();
        assert_eq!(sources_digest(&two).unwrap(), digest);
        std::fs::write(two.join("kernels/src/new.rs"), "").unwrap();
        assert_ne!(sources_digest(&two).unwrap(), digest);
        // A missing source is an error naming it.
        std::fs::remove_file(two.join("rust-toolchain.toml")).unwrap();
        assert!(sources_digest(&two).unwrap_err().contains("rust-toolchain.toml"));
        for root in [one, two] {
            std::fs::remove_dir_all(root).unwrap();
        }
    }
}
