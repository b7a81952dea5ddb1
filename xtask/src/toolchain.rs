//! Finding the workspace, the nightly toolchain and its LLVM tools, with one-line fixes.

use std::path::{Path, PathBuf};
use std::process::Command;

pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("xtask lives in the workspace").to_path_buf()
}

/// The cargo that runs us (`$CARGO`), or plain `cargo`.
pub fn cargo() -> PathBuf {
    std::env::var_os("CARGO").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("cargo"))
}

/// A command with the variables an outer cargo sets for its own build removed, so a nested
/// cargo starts clean. `RUSTUP_TOOLCHAIN` stays: cargo runs rustc in each dependency's own
/// folder, where rustup's proxy would not see our `rust-toolchain.toml`.
pub fn clean_command(program: impl AsRef<std::ffi::OsStr>) -> Command {
    let mut command = Command::new(program);
    for (key, _) in std::env::vars_os() {
        let key = key.to_string_lossy().into_owned();
        let leaked = (key.starts_with("CARGO_") && key != "CARGO_HOME")
            || key.starts_with("RUSTC")
            || key == "RUSTFLAGS"
            || key == "RUSTDOCFLAGS"
            || key == "CARGO";
        if leaked {
            command.env_remove(&key);
        }
    }
    command
}

fn output_of(command: &mut Command) -> Result<String, String> {
    let output = command.output().map_err(|e| format!("cannot run {command:?}: {e}"))?;
    if !output.status.success() {
        return Err(format!("{command:?} failed: {}", String::from_utf8_lossy(&output.stderr).trim()));
    }
    Ok(String::from_utf8_lossy(&output.stdout).trim().to_string())
}

/// The nightly toolchain the kernels build with, checked for `rust-src` and `llvm-tools`.
pub struct Nightly {
    pub rustc: PathBuf,
    pub cargo: PathBuf,
    pub llvm_bin: PathBuf,
}

const INSTALL_NIGHTLY: &str = "rustup toolchain install nightly --component rust-src,llvm-tools";

pub fn nightly(root: &Path) -> Result<Nightly, String> {
    let sysroot = output_of(clean_command("rustc").current_dir(root).args(["--print", "sysroot"]))
        .map_err(|e| format!("no usable rustc ({e}); fix: {INSTALL_NIGHTLY}"))?;
    let sysroot = PathBuf::from(sysroot);
    let rustc = sysroot.join("bin/rustc");
    let version = output_of(Command::new(&rustc).arg("-vV"))?;
    if !version.contains("-nightly") {
        return Err(format!(
            "the kernels need a nightly rustc, found `{}`; fix: {INSTALL_NIGHTLY}",
            version.lines().next().unwrap_or("")
        ));
    }
    if !sysroot.join("lib/rustlib/src/rust/library/core").is_dir() {
        return Err("the nightly toolchain lacks rust-src (needed by -Zbuild-std); fix: rustup component add rust-src --toolchain nightly".into());
    }
    let host =
        version.lines().find_map(|l| l.strip_prefix("host: ")).ok_or("rustc -vV printed no host line")?.to_string();
    let llvm_bin = sysroot.join("lib/rustlib").join(host).join("bin");
    for tool in ["llvm-link", "opt", "llc"] {
        if !llvm_bin.join(tool).is_file() {
            return Err(format!(
                "the nightly toolchain lacks {tool} (component llvm-tools); fix: rustup component add llvm-tools --toolchain nightly"
            ));
        }
    }
    Ok(Nightly { rustc, cargo: sysroot.join("bin/cargo"), llvm_bin })
}

/// `ptxas` from `$PTXAS`, the `PATH`, or the NVIDIA PyPI wheels of `python3`.
pub fn find_ptxas() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("PTXAS") {
        return Some(PathBuf::from(path));
    }
    if let Ok(path) = output_of(Command::new("sh").args(["-c", "command -v ptxas"]))
        && !path.is_empty()
    {
        return Some(PathBuf::from(path));
    }
    let script = "import nvidia, os\nfor p in nvidia.__path__:\n  for d in ('cuda_nvcc/bin', 'cu13/bin', 'cu12/bin'):\n    f = os.path.join(p, d, 'ptxas')\n    if os.path.isfile(f): print(f); raise SystemExit";
    output_of(Command::new("python3").args(["-c", script])).ok().filter(|p| !p.is_empty()).map(PathBuf::from)
}
