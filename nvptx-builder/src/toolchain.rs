//! Finding the nightly toolchain the kernels build with, its LLVM tools, and `ptxas`; every
//! failure names what is missing and the command that installs it.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::Error;

/// A command with the variables an outer cargo (a build, a build script or `cargo run`) sets for
/// its own build removed, so a nested cargo starts clean.
pub fn clean_command(program: impl AsRef<std::ffi::OsStr>) -> Command {
    let mut command = Command::new(program);
    for (key, _) in std::env::vars_os() {
        let key = key.to_string_lossy().into_owned();
        let leaked = (key.starts_with("CARGO_") && key != "CARGO_HOME")
            || key.starts_with("RUSTC")
            || matches!(
                key.as_str(),
                "CARGO"
                    | "RUSTFLAGS"
                    | "RUSTDOCFLAGS"
                    | "TARGET"
                    | "HOST"
                    | "OUT_DIR"
                    | "PROFILE"
                    | "OPT_LEVEL"
                    | "DEBUG"
                    | "NUM_JOBS"
            );
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

/// A nightly toolchain with `rust-src` (for `-Zbuild-std`) and `llvm-tools` (`llvm-link`,
/// `opt`, `llc`).
pub struct Nightly {
    pub name: String,
    pub rustc: PathBuf,
    pub cargo: PathBuf,
    pub llvm_bin: PathBuf,
}

impl Nightly {
    /// The toolchain rustup calls `name` (e.g. `nightly`), checked for what the build needs.
    pub fn find(name: &str) -> Result<Nightly, Error> {
        let install = format!("rustup toolchain install {name} --component rust-src,llvm-tools");
        let sysroot =
            output_of(clean_command("rustup").args(["run", name, "rustc", "--print", "sysroot"])).map_err(|why| {
                Error::Toolchain { missing: format!("the `{name}` toolchain ({why})"), fix: install.clone() }
            })?;
        let sysroot = PathBuf::from(sysroot);
        let rustc = sysroot.join("bin/rustc");
        let version = output_of(Command::new(&rustc).arg("-vV")).map_err(|why| Error::Toolchain {
            missing: format!("a working rustc in {} ({why})", sysroot.display()),
            fix: install.clone(),
        })?;
        if !version.contains("-nightly") {
            return Err(Error::Toolchain {
                missing: format!("a nightly rustc (`{name}` is `{}`)", version.lines().next().unwrap_or("")),
                fix: "rustup toolchain install nightly --component rust-src,llvm-tools".into(),
            });
        }
        if !sysroot.join("lib/rustlib/src/rust/library/core").is_dir() {
            return Err(Error::Toolchain {
                missing: format!("rust-src in `{name}` (needed by -Zbuild-std=core)"),
                fix: format!("rustup component add rust-src --toolchain {name}"),
            });
        }
        let host = version.lines().find_map(|l| l.strip_prefix("host: ")).unwrap_or("").to_string();
        let llvm_bin = sysroot.join("lib/rustlib").join(host).join("bin");
        for tool in ["llvm-link", "opt", "llc"] {
            if !llvm_bin.join(tool).is_file() {
                return Err(Error::Toolchain {
                    missing: format!("{tool} in `{name}` (component llvm-tools)"),
                    fix: format!("rustup component add llvm-tools --toolchain {name}"),
                });
            }
        }
        Ok(Nightly { name: name.to_string(), rustc, cargo: sysroot.join("bin/cargo"), llvm_bin })
    }

    /// `cargo <subcommand>` on the kernel crate in `kernel_crate` for the NVPTX target, release,
    /// with `core` built from source, into `target_dir`, with `rustflags`: the one nested cargo
    /// every kernel build and check runs (`build` here, `clippy` in a caller's xtask).
    pub fn kernel_cargo(
        &self,
        subcommand: &str,
        kernel_crate: &Path,
        target_dir: &Path,
        rustflags: &[String],
    ) -> Command {
        let mut command = clean_command(&self.cargo);
        command
            .current_dir(kernel_crate)
            .args([subcommand, "--release", "--target", NVPTX_TARGET, "-Zbuild-std=core", "--target-dir"])
            .arg(target_dir)
            .env("RUSTC", &self.rustc)
            .env("RUSTUP_TOOLCHAIN", &self.name)
            .env("CARGO_ENCODED_RUSTFLAGS", rustflags.join("\u{1f}"));
        command
    }
}

/// rustc's target for PTX.
pub const NVPTX_TARGET: &str = "nvptx64-nvidia-cuda";

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

/// The command that installs `ptxas` without a CUDA toolkit.
pub const INSTALL_PTXAS: &str = "python3 -m pip install nvidia-cuda-nvcc-cu12 (or set PTXAS to a ptxas)";
