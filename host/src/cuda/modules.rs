//! The PTX modules the host embeds, the choice between them, and the loaded kernels.
//!
//! `host/ptx/<module>.ptx` is written by `cargo xtask build-kernels` from `kernels/` and
//! committed, so building the host needs no nightly-only component; CI rebuilds both and fails
//! if a committed file is stale (`cargo xtask build-kernels --check`).

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaModule, sys};
use cudarc::nvrtc::Ptx;
use flashsample_core::registry::{Kernel, Module};

use super::driver;
use crate::error::{Error, Result, invalid};

/// A module's PTX.
pub fn ptx(module: Module) -> &'static str {
    match module {
        Module::Portable => include_str!("../../ptx/portable.ptx"),
        Module::Hopper => include_str!("../../ptx/hopper.ptx"),
    }
}

/// Which module a sampler loads.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ModuleChoice {
    /// The Hopper module on compute capability 9.0, the portable one on every other GPU from
    /// Ampere on; `FLASHSAMPLE_MODULE` (see [`ModuleChoice::from_environment`]) may force one.
    #[default]
    Auto,
    /// This module, or an error if the device cannot load it.
    Force(Module),
}

/// The environment variable that forces a module when the choice is [`ModuleChoice::Auto`]:
/// `portable` or `hopper` (`auto` or unset: by the device).
pub const MODULE_VARIABLE: &str = "FLASHSAMPLE_MODULE";

impl ModuleChoice {
    /// The choice `FLASHSAMPLE_MODULE` names, or `Auto` when it is unset.
    pub fn from_environment() -> Result<ModuleChoice> {
        let Some(value) = std::env::var_os(MODULE_VARIABLE) else { return Ok(ModuleChoice::Auto) };
        match value.to_str() {
            Some("auto") | Some("") => Ok(ModuleChoice::Auto),
            Some(name) => match Module::ALL.into_iter().find(|m| m.name() == name) {
                Some(module) => Ok(ModuleChoice::Force(module)),
                None => Err(invalid(MODULE_VARIABLE, format!("`{name}`: must be portable, hopper or auto"))),
            },
            None => Err(invalid(MODULE_VARIABLE, "not valid UTF-8: must be portable, hopper or auto")),
        }
    }

    /// The module for a device of compute capability `(major, minor)`.
    pub fn resolve(self, major: u32, minor: u32) -> Result<Module> {
        let module = match self {
            ModuleChoice::Auto if Module::Hopper.loads_on(major, minor) => Module::Hopper,
            ModuleChoice::Auto => Module::Portable,
            ModuleChoice::Force(module) => module,
        };
        if module.loads_on(major, minor) {
            return Ok(module);
        }
        let ((oldest_major, oldest_minor), exact) = module.compute_capability();
        Err(Error::UnsupportedDevice {
            module: module.name(),
            found: format!("{major}.{minor}"),
            needs: if exact {
                format!("exactly {oldest_major}.{oldest_minor}")
            } else {
                format!("{oldest_major}.{oldest_minor} or newer")
            },
        })
    }
}

/// A kernel of the loaded module with its launch shape.
pub struct LoadedKernel {
    pub name: &'static str,
    pub function: sys::CUfunction,
    pub threads: u32,
    pub shared_bytes: u32,
    pub blocks_per_multiprocessor: u32,
}

/// Dynamic shared memory a kernel may use without opting in.
const STATIC_SHARED_LIMIT_BYTES: u32 = 48 << 10;

/// The module a sampler runs, with every kernel it holds looked up once.
pub struct LoadedModule {
    pub module: Module,
    kernels: HashMap<Kernel, LoadedKernel>,
    // Keeps every `function` above valid.
    _handle: Arc<CudaModule>,
}

impl LoadedModule {
    /// Loads `module` into `context` (which must be current) and looks up its kernels.
    pub fn load(context: &Arc<CudaContext>, module: Module) -> Result<LoadedModule> {
        let handle = driver::check(
            &format!("cuModuleLoadData({} module)", module.name()),
            context.load_module(Ptx::from_src(ptx(module))),
        )?;
        let mut kernels = HashMap::new();
        for entry in module.kernels() {
            let function =
                driver::check(&format!("cuModuleGetFunction({})", entry.name), handle.load_function(entry.name))?
                    .cu_function();
            let (threads, shared_bytes) = (entry.kernel.threads(), entry.kernel.shared_bytes());
            // SAFETY: `function` belongs to `handle`, which this struct keeps alive, in the
            // current context.
            let blocks_per_multiprocessor = unsafe {
                if shared_bytes > STATIC_SHARED_LIMIT_BYTES {
                    driver::allow_dynamic_shared_memory(entry.name, function, shared_bytes)?;
                }
                driver::blocks_per_multiprocessor(entry.name, function, threads, shared_bytes)?
            };
            let loaded = LoadedKernel { name: entry.name, function, threads, shared_bytes, blocks_per_multiprocessor };
            kernels.insert(entry.kernel, loaded);
        }
        Ok(LoadedModule { module, kernels, _handle: handle })
    }

    /// The loaded `kernel`; the dispatcher only asks for kernels the module holds.
    pub fn kernel(&self, kernel: Kernel) -> Result<&LoadedKernel> {
        self.kernels.get(&kernel).ok_or_else(|| {
            invalid(
                "variant",
                format!("{} is not in the {} module (it needs the Hopper module)", kernel.name(), self.module.name()),
            )
        })
    }
}
