//! [`PtxBuilder`]: the kernel crate, its targets, and the checks to run.

use std::path::{Path, PathBuf};

use crate::checks::{LaunchBounds, Occurrences, add_launch_bounds, check_written_once};
use crate::ptxas::{self, Budget, KernelResources};
use crate::toolchain::{self, NVPTX_TARGET, Nightly};
use crate::{Error, link};

/// One PTX target of the kernel crate.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Target {
    /// rustc's `-Ctarget-cpu` and ptxas's `-arch`, e.g. `sm_80` or `sm_90a`.
    pub cpu: String,
    /// The PTX ISA version as `(major, minor)`; `None` leaves LLVM's default for the CPU (the
    /// oldest that has it).
    pub ptx_isa: Option<(u8, u8)>,
    /// More NVPTX target features (`+...`).
    pub features: Vec<String>,
    /// `--cfg` values the kernel crate sees, e.g. `my_module="fast"`.
    pub cfgs: Vec<String>,
    /// Where to write the final PTX; `None` keeps it in the builder's target folder.
    pub output: Option<PathBuf>,
}

impl Target {
    pub fn new(cpu: &str) -> Target {
        Target { cpu: cpu.into(), ptx_isa: None, features: Vec::new(), cfgs: Vec::new(), output: None }
    }

    pub fn ptx_isa(mut self, major: u8, minor: u8) -> Target {
        self.ptx_isa = Some((major, minor));
        self
    }

    pub fn feature(mut self, feature: &str) -> Target {
        self.features.push(feature.into());
        self
    }

    pub fn cfg(mut self, cfg: &str) -> Target {
        self.cfgs.push(cfg.into());
        self
    }

    pub fn output(mut self, path: impl Into<PathBuf>) -> Target {
        self.output = Some(path.into());
        self
    }

    /// The flags that build the kernel crate for this target (rustc and clippy alike).
    pub fn rustflags(&self) -> Vec<String> {
        let mut flags = vec![format!("-Ctarget-cpu={}", self.cpu)];
        flags.extend(self.ptx_isa.map(|(major, minor)| format!("-Ctarget-feature=+ptx{major}{minor}")));
        flags.extend(self.features.iter().map(|feature| format!("-Ctarget-feature={feature}")));
        flags.extend(self.cfgs.iter().map(|cfg| format!("--cfg={cfg}")));
        flags
    }
}

/// One target's result.
#[derive(Clone, Debug)]
pub struct Built {
    pub target: Target,
    /// The final PTX (launch bounds added).
    pub ptx: String,
    /// Where it was written: `target.output`, or a file in the builder's target folder.
    pub path: PathBuf,
    /// What ptxas reported per kernel, when the PTX was validated.
    pub resources: Option<Vec<KernelResources>>,
}

type LaunchBoundsOf = Box<dyn Fn(&str) -> Option<LaunchBounds>>;
type WrittenOnce = Box<dyn Fn(&str) -> &'static [Occurrences]>;

/// Builds a kernel crate into PTX for one or more targets.
pub struct PtxBuilder {
    kernel_crate: PathBuf,
    targets: Vec<Target>,
    toolchain: String,
    target_dir: Option<PathBuf>,
    budget: Option<Budget>,
    require_ptxas: bool,
    launch_bounds: Option<LaunchBoundsOf>,
    written_once: Option<WrittenOnce>,
    watch: Vec<PathBuf>,
}

impl PtxBuilder {
    /// A builder for the kernel crate in folder `kernel_crate` (a `cdylib` with
    /// `#![no_std]`; see the README for its layout).
    pub fn new(kernel_crate: impl Into<PathBuf>) -> PtxBuilder {
        PtxBuilder {
            kernel_crate: kernel_crate.into(),
            targets: Vec::new(),
            toolchain: "nightly".into(),
            target_dir: None,
            budget: None,
            require_ptxas: false,
            launch_bounds: None,
            written_once: None,
            watch: Vec::new(),
        }
    }

    pub fn target(mut self, target: Target) -> PtxBuilder {
        self.targets.push(target);
        self
    }

    /// The rustup toolchain to build with (default `nightly`).
    pub fn toolchain(mut self, name: &str) -> PtxBuilder {
        self.toolchain = name.into();
        self
    }

    /// The nested cargo's target folder (default: `$OUT_DIR/nvptx-builder` in a build script,
    /// else `<kernel crate>/target/nvptx-builder`). Each target gets a subfolder, so switching
    /// targets rebuilds nothing.
    pub fn target_dir(mut self, path: impl Into<PathBuf>) -> PtxBuilder {
        self.target_dir = Some(path.into());
        self
    }

    /// Validates every target's PTX with `ptxas` and enforces `budget`. Without `ptxas` the
    /// build goes on with a warning, unless [`PtxBuilder::require_ptxas`].
    pub fn validate(mut self, budget: Budget) -> PtxBuilder {
        self.budget = Some(budget);
        self
    }

    /// Fails the build when `ptxas` cannot be found.
    pub fn require_ptxas(mut self) -> PtxBuilder {
        self.require_ptxas = true;
        self
    }

    /// Adds launch bounds to the entries `bounds` gives them for (see
    /// [`crate::add_launch_bounds`] for why).
    pub fn launch_bounds(mut self, bounds: impl Fn(&str) -> Option<LaunchBounds> + 'static) -> PtxBuilder {
        self.launch_bounds = Some(Box::new(bounds));
        self
    }

    /// Fails the build when an entry holds one of the instructions `ops` names for it more or
    /// fewer times than allowed (see [`crate::check_written_once`] for why).
    pub fn written_once(mut self, ops: impl Fn(&str) -> &'static [Occurrences] + 'static) -> PtxBuilder {
        self.written_once = Some(Box::new(ops));
        self
    }

    /// More paths whose changes rebuild the kernels in a build script (the kernel crate's
    /// `src/` and `Cargo.toml` are always watched), e.g. a path dependency of the kernel crate.
    pub fn watch(mut self, path: impl Into<PathBuf>) -> PtxBuilder {
        self.watch.push(path.into());
        self
    }

    /// Builds every target; in a build script, tells cargo what to watch.
    pub fn build(&self) -> Result<Vec<Built>, Error> {
        let build_script = std::env::var_os("OUT_DIR").is_some() && std::env::var_os("CARGO_MANIFEST_DIR").is_some();
        if build_script {
            for path in [self.kernel_crate.join("src"), self.kernel_crate.join("Cargo.toml")].iter().chain(&self.watch)
            {
                println!("cargo:rerun-if-changed={}", path.display());
            }
            println!("cargo:rerun-if-env-changed=PTXAS");
        }
        if self.targets.is_empty() {
            return Err(Error::NoTargets);
        }
        // The kernel crate is checked before the toolchain: a wrong path is the cheaper mistake
        // to report, and needs no nightly to find.
        let crate_name = crate_name(&self.kernel_crate)?;
        let nightly = Nightly::find(&self.toolchain)?;
        let ptxas = match (&self.budget, toolchain::find_ptxas()) {
            (None, _) => None,
            (Some(_), Some(ptxas)) => Some(ptxas),
            (Some(_), None) if self.require_ptxas => return Err(Error::NoPtxas),
            (Some(_), None) => {
                let note = format!("PTX not validated: {}", Error::NoPtxas);
                if build_script {
                    println!("cargo:warning={note}")
                } else {
                    eprintln!("note: {note}")
                }
                None
            }
        };
        let target_dir = match &self.target_dir {
            Some(dir) => dir.clone(),
            None => match std::env::var_os("OUT_DIR").filter(|_| build_script) {
                Some(out) => PathBuf::from(out).join("nvptx-builder"),
                None => self.kernel_crate.join("target/nvptx-builder"),
            },
        };
        let mut built = Vec::new();
        for (index, target) in self.targets.iter().enumerate() {
            let folder = target_dir.join(format!("{index}-{}", target.cpu));
            let raw = self.compile(&nightly, target, &folder, &crate_name)?;
            let mut ptx = std::fs::read_to_string(&raw)
                .map_err(|e| Error::File(format!("cannot read {}: {e}", raw.display())))?;
            if let Some(bounds) = &self.launch_bounds {
                ptx = add_launch_bounds(&ptx, bounds.as_ref());
            }
            if let Some(ops) = &self.written_once {
                check_written_once(&ptx, ops.as_ref()).map_err(|why| {
                    Error::Check(format!("warpgroup-aligned ops duplicated or missing ({}):\n{why}", target.cpu))
                })?;
            }
            let path = target.output.clone().unwrap_or_else(|| folder.join(format!("{crate_name}.ptx")));
            write(&path, &ptx)?;
            let resources = match (&self.budget, &ptxas) {
                (Some(budget), Some(ptxas)) => Some(ptxas::validate(ptxas, &path, &target.cpu, budget)?),
                _ => None,
            };
            built.push(Built { target: target.clone(), ptx, path, resources });
        }
        Ok(built)
    }

    /// Runs the nested nightly cargo with this process as the linker; returns the raw PTX.
    fn compile(&self, nightly: &Nightly, target: &Target, folder: &Path, crate_name: &str) -> Result<PathBuf, Error> {
        let this = std::env::current_exe().map_err(|e| Error::Build(format!("cannot locate this program: {e}")))?;
        // Cargo cannot see that this program is the linker: a fingerprint of the link step's
        // source in the flags makes a changed link step relink the kernels.
        let mut link_step = std::hash::DefaultHasher::new();
        std::hash::Hash::hash(include_str!("link.rs"), &mut link_step);
        let mut flags = target.rustflags();
        flags.extend([
            format!("-Clinker={}", this.display()),
            format!("--cfg=nvptx_builder_link_{:016x}", std::hash::Hasher::finish(&link_step)),
        ]);
        let status = nightly
            .kernel_cargo("build", &self.kernel_crate, folder, &flags)
            .env(link::LINKER_MODE_VARIABLE, &nightly.llvm_bin)
            .status()
            .map_err(|e| Error::Build(format!("cannot run {}: {e}", nightly.cargo.display())))?;
        if !status.success() {
            return Err(Error::Build(format!(
                "building {} for {NVPTX_TARGET} ({}) failed ({status})",
                self.kernel_crate.display(),
                target.cpu
            )));
        }
        let ptx = folder.join(NVPTX_TARGET).join("release").join(format!("{crate_name}.ptx"));
        if !ptx.is_file() {
            return Err(Error::Build(format!("the build wrote no {}", ptx.display())));
        }
        Ok(ptx)
    }
}

/// The kernel crate's library name, which names its PTX: `[lib] name` if set, else the package
/// name with `-` as `_`.
fn crate_name(kernel_crate: &Path) -> Result<String, Error> {
    let manifest = kernel_crate.join("Cargo.toml");
    let text = std::fs::read_to_string(&manifest).map_err(|e| {
        Error::File(format!("cannot read {} (is {} a kernel crate?): {e}", manifest.display(), kernel_crate.display()))
    })?;
    let (mut section, mut package, mut lib) = ("", None, None);
    for line in text.lines().map(str::trim) {
        if line.starts_with('[') {
            section = line;
        } else if let Some(value) = line.strip_prefix("name").map(str::trim).and_then(|v| v.strip_prefix('=')) {
            let value = Some(value.trim().trim_matches('"').replace('-', "_"));
            match section {
                "[package]" => package = value,
                "[lib]" => lib = value,
                _ => {}
            }
        }
    }
    lib.or(package).ok_or_else(|| Error::File(format!("{} has no [package] name", manifest.display())))
}

fn write(path: &Path, ptx: &str) -> Result<(), Error> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(|e| Error::File(format!("cannot create {}: {e}", parent.display())))?;
    }
    std::fs::write(path, ptx).map_err(|e| Error::File(format!("cannot write {}: {e}", path.display())))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kernel_crate(manifest: &str) -> PathBuf {
        let folder = std::env::temp_dir().join(format!("nvptx-builder-test-{}-{}", std::process::id(), manifest.len()));
        std::fs::create_dir_all(&folder).unwrap();
        std::fs::write(folder.join("Cargo.toml"), manifest).unwrap();
        folder
    }

    #[test]
    fn a_target_becomes_rustc_flags() {
        let target = Target::new("sm_90a").ptx_isa(8, 3).feature("+ptx84").cfg("module=\"hopper\"");
        assert_eq!(
            target.rustflags(),
            ["-Ctarget-cpu=sm_90a", "-Ctarget-feature=+ptx83", "-Ctarget-feature=+ptx84", "--cfg=module=\"hopper\""]
        );
    }

    #[test]
    fn the_ptx_is_named_for_the_library() {
        let plain = kernel_crate("[package]\nname = \"my-kernels\"\nversion = \"0.1.0\"\n");
        assert_eq!(crate_name(&plain).unwrap(), "my_kernels");
        let renamed =
            kernel_crate("[package]\nname = \"my-kernels\"\n\n[lib]\nname = \"gpu\"\ncrate-type = [\"cdylib\"]\n");
        assert_eq!(crate_name(&renamed).unwrap(), "gpu");
        for folder in [plain, renamed] {
            std::fs::remove_dir_all(folder).unwrap();
        }
    }

    #[test]
    fn a_build_without_targets_or_kernel_crate_says_what_is_missing() {
        let no_targets = PtxBuilder::new("kernels").build().unwrap_err();
        assert!(matches!(no_targets, Error::NoTargets), "{no_targets}");
        let missing = PtxBuilder::new("/no/such/kernels").target(Target::new("sm_80")).build().unwrap_err();
        assert!(matches!(missing, Error::File(_)), "{missing}");
        assert!(missing.to_string().contains("/no/such/kernels/Cargo.toml"), "{missing}");
    }
}
