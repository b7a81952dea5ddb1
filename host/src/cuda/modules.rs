//! The modules the host embeds, the choice between them, and the loaded kernels with the
//! one launch every kernel goes through.
//!
//! `host/ptx/<module>.ptx` is written by `cargo xtask build-kernels` from `kernels/` and
//! committed, so building the host needs no nightly-only component; so is the machine code
//! ptxas makes from it for a module that ships some (`host/ptx/hopper.sm_90a.cubin`,
//! [`Module::cubin_arch`]). CI rebuilds them and fails if a committed file is stale (`cargo
//! xtask build-kernels --check`).

use std::collections::HashMap;

use cudarc::driver::sys;
use flashsample_core::registry::{Kernel, Module};

use super::driver;
use crate::error::{Error, Result, invalid};

/// The number of CUDA devices; [`Error::NoCudaDevice`] without a driver or a device.
pub fn cuda_device_count() -> Result<usize> {
    if !driver::driver_library_present() {
        return Err(Error::NoCudaDevice("the NVIDIA driver library (libcuda) is not installed".into()));
    }
    let no_device = |e: cudarc::driver::DriverError| Error::NoCudaDevice(driver::describe(&e));
    cudarc::driver::result::init().map_err(no_device)?;
    let count = cudarc::driver::CudaContext::device_count().map_err(no_device)?;
    if count <= 0 {
        return Err(Error::NoCudaDevice("the driver reports no device".into()));
    }
    Ok(count as usize)
}

/// What the driver loads for a module.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Image {
    /// PTX text, compiled by the driver for the device at load (cached by the driver).
    Ptx(&'static str),
    /// Machine code for [`Module::cubin_arch`], loaded as it is.
    Cubin(&'static [u8]),
}

/// The image a module is loaded from: the Hopper module's `sm_90a` machine code (every device
/// that loads it is compute capability 9.0), the portable module's PTX.
pub(crate) fn image(module: Module) -> Image {
    match module {
        Module::Portable => Image::Ptx(include_str!("../../ptx/portable.ptx")),
        Module::Hopper => Image::Cubin(include_bytes!("../../ptx/hopper.sm_90a.cubin")),
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
pub(crate) const MODULE_VARIABLE: &str = "FLASHSAMPLE_MODULE";

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

/// `image` copied into 8-byte aligned words, the address the driver reads it from; zeroed
/// words past the image also end PTX text with its NUL.
fn aligned_words(image: Image) -> Vec<u64> {
    let (bytes, terminator) = match image {
        Image::Ptx(text) => (text.as_bytes(), 1),
        Image::Cubin(bytes) => (bytes, 0),
    };
    let mut words = vec![0u64; (bytes.len() + terminator).div_ceil(8)];
    bytemuck::cast_slice_mut::<u64, u8>(&mut words)[..bytes.len()].copy_from_slice(bytes);
    words
}

/// A kernel of the loaded module with its launch shape.
pub(crate) struct LoadedKernel {
    pub name: &'static str,
    pub function: sys::CUfunction,
    pub threads: u32,
    pub shared_bytes: u32,
    pub blocks_per_multiprocessor: u32,
}

/// Dynamic shared memory a kernel may use without opting in.
const STATIC_SHARED_LIMIT_BYTES: u32 = 48 << 10;

/// The module a sampler runs, loaded in one context, with every kernel it holds looked up
/// once. Unloaded by [`LoadedModule::unload`] (or, failing that, on drop).
pub(crate) struct LoadedModule {
    pub module: Module,
    kernels: HashMap<Kernel, LoadedKernel>,
    handle: sys::CUmodule,
    context: sys::CUcontext,
}

// SAFETY: a module handle and its functions may be used from any thread that makes their
// context current (the driver's rule); the table is never written after loading.
unsafe impl Send for LoadedModule {}
// SAFETY: as above; shared use only reads the table and launches.
unsafe impl Sync for LoadedModule {}

impl LoadedModule {
    /// Loads `module` into `context` and looks up its kernels.
    ///
    /// # Safety
    /// `context` is live and current on this thread, and outlives the returned module.
    pub unsafe fn load(context: sys::CUcontext, module: Module) -> Result<LoadedModule> {
        let words = aligned_words(image(module));
        // SAFETY: `words` holds a whole PTX (NUL-terminated) or ELF image; the driver copies
        // what it keeps.
        let handle = driver::check(&format!("cuModuleLoadData({} module)", module.name()), unsafe {
            cudarc::driver::result::module::load_data(words.as_ptr().cast())
        })?;
        let mut loaded = LoadedModule { module, kernels: HashMap::new(), handle, context };
        for entry in module.kernels() {
            let name = std::ffi::CString::new(entry.name).expect("kernel names have no NUL byte");
            // SAFETY: `handle` is the module just loaded.
            let function = driver::check(&format!("cuModuleGetFunction({})", entry.name), unsafe {
                cudarc::driver::result::module::get_function(handle, name)
            })?;
            let (threads, shared_bytes) = (entry.kernel.threads(), entry.kernel.shared_bytes());
            // SAFETY: `function` belongs to `handle`, which lives as long as this struct, in the
            // current context.
            let blocks_per_multiprocessor = unsafe {
                if shared_bytes > STATIC_SHARED_LIMIT_BYTES {
                    driver::allow_dynamic_shared_memory(entry.name, function, shared_bytes)?;
                }
                driver::blocks_per_multiprocessor(entry.name, function, threads, shared_bytes)?
            };
            let kernel = LoadedKernel { name: entry.name, function, threads, shared_bytes, blocks_per_multiprocessor };
            loaded.kernels.insert(entry.kernel, kernel);
        }
        Ok(loaded)
    }

    /// The kernels of `module` as the recording driver of the tests sees them: no module or
    /// function handles, two blocks of each kernel per multiprocessor.
    #[cfg(test)]
    pub fn recording(module: Module) -> LoadedModule {
        let kernels = module
            .kernels()
            .map(|entry| {
                let kernel = LoadedKernel {
                    name: entry.name,
                    function: std::ptr::null_mut(),
                    threads: entry.kernel.threads(),
                    shared_bytes: entry.kernel.shared_bytes(),
                    blocks_per_multiprocessor: 2,
                };
                (entry.kernel, kernel)
            })
            .collect();
        LoadedModule { module, kernels, handle: std::ptr::null_mut(), context: std::ptr::null_mut() }
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

    /// Unloads the module from its context (made current for the call, then restored).
    pub fn unload(mut self) -> Result<()> {
        self.unload_handle()
    }

    fn unload_handle(&mut self) -> Result<()> {
        let handle = std::mem::replace(&mut self.handle, std::ptr::null_mut());
        if handle.is_null() {
            return Ok(());
        }
        self.kernels.clear();
        // SAFETY: the context outlives the module (`load`'s contract); `handle` is its module,
        // unloaded once.
        unsafe {
            driver::in_context(self.context, || {
                driver::check("cuModuleUnload", cudarc::driver::result::module::unload(handle))
            })
        }
    }
}

impl Drop for LoadedModule {
    fn drop(&mut self) {
        if let Err(e) = self.unload_handle() {
            eprintln!("flashsample: unloading the {} module failed: {e}", self.module.name());
        }
    }
}

/// The kernels of one module loaded in one context, with the device facts a launch needs;
/// every kernel is launched through [`Kernels::launch`].
pub(crate) struct Kernels {
    /// `None` only during [`Kernels::close`] and drop.
    module: Option<LoadedModule>,
    pub context: sys::CUcontext,
    pub device_name: String,
    pub multiprocessors: u32,
    pub compute_capability: (u32, u32),
}

// SAFETY: the context handle and the loaded module may be used from any thread that makes the
// context current, which every call does; nothing is mutated after construction.
unsafe impl Send for Kernels {}
// SAFETY: as above; calls only read the kernel table and queue launches.
unsafe impl Sync for Kernels {}

impl Kernels {
    /// Loads the module `choice` picks for `context`'s device into it; the thread's current
    /// context is restored before returning.
    ///
    /// # Safety
    /// `context` is a live `CUcontext` that outlives the kernels.
    pub unsafe fn load(context: sys::CUcontext, choice: ModuleChoice) -> Result<Kernels> {
        cuda_device_count()?;
        if context.is_null() {
            return Err(invalid("context", "null: a live CUDA context is needed"));
        }
        // SAFETY: per this function's contract.
        unsafe {
            driver::in_context(context, || {
                let mut device = 0;
                driver::check("cuCtxGetDevice", sys::cuCtxGetDevice(&mut device).result())?;
                let attribute = |what: &str, attribute| {
                    driver::check(
                        &format!("cuDeviceGetAttribute({what})"),
                        cudarc::driver::result::device::get_attribute(device, attribute),
                    )
                    .map(|value| value as u32)
                };
                use sys::CUdevice_attribute as A;
                let major = attribute("COMPUTE_CAPABILITY_MAJOR", A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
                let minor = attribute("COMPUTE_CAPABILITY_MINOR", A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
                let multiprocessors = attribute("MULTIPROCESSOR_COUNT", A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
                let device_name = driver::check("cuDeviceGetName", cudarc::driver::result::device::get_name(device))?;
                let module = LoadedModule::load(context, choice.resolve(major, minor)?)?;
                Ok(Kernels {
                    module: Some(module),
                    context,
                    device_name,
                    multiprocessors,
                    compute_capability: (major, minor),
                })
            })
        }
    }

    /// The kernels of `module` on an H200-like device (132 multiprocessors) with no context,
    /// for tests that record launches instead of making them (`driver::trace`).
    #[cfg(test)]
    pub fn recording(module: Module) -> Kernels {
        Kernels {
            module: Some(LoadedModule::recording(module)),
            context: std::ptr::null_mut(),
            device_name: "recording".into(),
            multiprocessors: 132,
            compute_capability: (9, 0),
        }
    }

    fn loaded(&self) -> &LoadedModule {
        self.module.as_ref().expect("the module is unloaded only by close and drop")
    }

    /// The module the kernels come from.
    pub fn module(&self) -> Module {
        self.loaded().module
    }

    /// How many blocks of `kernel` the device holds at once.
    pub fn resident_blocks(&self, kernel: Kernel) -> Result<usize> {
        let loaded = self.loaded().kernel(kernel)?;
        Ok(loaded.blocks_per_multiprocessor as usize * self.multiprocessors as usize)
    }

    /// Launches `kernel` over `items` work items on `stream` with a persistent grid (at most
    /// one wave); the context is current.
    ///
    /// # Safety
    /// `args` is the kernel's argument block with valid device addresses, `stream` a stream
    /// of this context.
    pub unsafe fn launch<A: bytemuck::Pod>(
        &self,
        stream: sys::CUstream,
        kernel: Kernel,
        items: u64,
        args: &A,
    ) -> Result<()> {
        let loaded = self.loaded().kernel(kernel)?;
        let resident = loaded.blocks_per_multiprocessor as u64 * self.multiprocessors as u64;
        let grid = items.clamp(1, resident) as u32;
        // SAFETY: per this function's contract; the launch shape comes from the registry.
        unsafe { driver::launch(loaded.name, loaded.function, stream, grid, loaded.threads, loaded.shared_bytes, args) }
    }

    /// Unloads the kernels from the context and reports the driver's error, if any. Work
    /// already queued must have finished first.
    pub fn close(mut self) -> Result<()> {
        self.module.take().map_or(Ok(()), LoadedModule::unload)
    }
}

impl Drop for Kernels {
    fn drop(&mut self) {
        if let Some(module) = self.module.take()
            && let Err(e) = module.unload()
        {
            eprintln!("flashsample: error while unloading the kernels (close the sampler to handle it): {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The words hold the image's bytes, then zeros: PTX of any length gets its NUL.
    #[test]
    fn images_are_copied_whole_into_words() {
        for (image, len) in [(Image::Ptx("12345678"), 8), (Image::Ptx("123"), 3), (Image::Cubin(b"\x7fELF1234"), 8)] {
            let words = aligned_words(image);
            let bytes: &[u8] = bytemuck::cast_slice(&words);
            let original = match image {
                Image::Ptx(text) => text.as_bytes(),
                Image::Cubin(bytes) => bytes,
            };
            assert_eq!(&bytes[..len], original);
            assert!(bytes[len..].iter().all(|&b| b == 0));
            if let Image::Ptx(_) = image {
                assert!(bytes.len() > len, "no room for the NUL");
            }
        }
    }

    /// A module ships machine code exactly when the registry says so, as an ELF image; the
    /// others ship PTX for the oldest architecture they load on.
    #[test]
    fn images_follow_the_registry() {
        for module in Module::ALL {
            match (image(module), module.cubin_arch()) {
                (Image::Cubin(bytes), Some(_)) => assert_eq!(&bytes[..4], b"\x7fELF", "{}", module.name()),
                (Image::Ptx(text), None) => {
                    let ((major, minor), _) = module.compute_capability();
                    assert!(text.contains(&format!(".target sm_{major}{minor}")), "{}", module.name());
                }
                (image, arch) => panic!("{}: {image:?} but cubin_arch {arch:?}", module.name()),
            }
        }
    }
}
