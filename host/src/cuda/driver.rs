//! The checked layer over the driver: every result becomes our [`Error`] naming the call, and
//! the raw calls that cudarc's safe API does not offer in the form we need (a launch with one
//! by-value argument block, async copies and fills at an address, occupancy, the dynamic
//! shared-memory opt-in, TMA descriptors) live here, each with its contract.
//!
//! cudarc opens the driver library at its first call and panics if there is none, so
//! [`driver_library_present`] is asked first: without a driver the answer is
//! [`Error::NoCudaDevice`], never a panic.

use std::ffi::c_void;

use cudarc::driver::{DriverError, sys};
use flashsample_core::abi::{DevicePtr, TensorMap};

use crate::error::{Error, Result};

/// A driver result, checked: the error names `call` and carries the driver's name and text
/// for the code.
pub fn check<T>(call: &str, result: std::result::Result<T, DriverError>) -> Result<T> {
    result.map_err(|e| Error::Cuda { call: call.to_string(), detail: describe(&e) })
}

/// `CUDA_ERROR_… (the driver's text)`.
pub fn describe(error: &DriverError) -> String {
    let name =
        error.error_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|_| format!("{:?}", error.0));
    match error.error_string() {
        Ok(text) => format!("{name} ({})", text.to_string_lossy()),
        Err(_) => name,
    }
}

/// The names the driver library has where cudarc looks for it (its last and most common
/// candidates on each system).
#[cfg(unix)]
const DRIVER_LIBRARIES: [&str; 2] = ["libcuda.so.1", "libcuda.so"];
#[cfg(windows)]
const DRIVER_LIBRARIES: [&str; 1] = ["nvcuda.dll"];

/// Whether the NVIDIA driver library can be opened in this process. Where the build links it
/// (cudarc's `dynamic-linking`, as candle asks), it is already loaded and this is true.
pub fn driver_library_present() -> bool {
    DRIVER_LIBRARIES.iter().any(|name| {
        // SAFETY: opening the driver library runs its initialisers, which have no
        // preconditions; the handle is closed again at once (the library stays loaded for
        // cudarc if it was already).
        unsafe { libloading::Library::new(*name) }.is_ok()
    })
}

/// Launches `function` on a 1-D grid with one argument block passed by value.
///
/// # Safety
/// `function` is a live kernel of a module loaded in the current context, `stream` a live
/// stream of that context, and `A` the argument block the kernel declares, its device
/// addresses valid for the extents it states until the kernel completes; the launch shape is
/// the one the kernel's safety section requires.
pub unsafe fn launch<A: bytemuck::Pod>(
    name: &str,
    function: sys::CUfunction,
    stream: sys::CUstream,
    grid: u32,
    block: u32,
    shared_bytes: u32,
    args: &A,
) -> Result<()> {
    #[cfg(test)]
    if trace::record(|| {
        let bytes: String = bytemuck::bytes_of(args).iter().map(|b| format!("{b:02x}")).collect();
        format!("launch {name} grid={grid} block={block} shared={shared_bytes} args={bytes}")
    }) {
        return Ok(());
    }
    let mut params = [(args as *const A).cast_mut().cast::<c_void>()];
    // SAFETY: per this function's contract; the driver copies the argument block at launch.
    let result = unsafe {
        cudarc::driver::result::launch_kernel(function, (grid, 1, 1), (block, 1, 1), shared_bytes, stream, &mut params)
    };
    check(&format!("cuLaunchKernel({name})"), result)
}

/// Copies `values` from the host to device address `destination`, ordered on `stream`.
///
/// # Safety
/// `destination` is a device allocation of at least `values.len()` elements, and `stream` a
/// live stream of the current context.
pub unsafe fn copy_to_device_async<T: bytemuck::Pod>(
    what: &str,
    destination: DevicePtr<T>,
    values: &[T],
    stream: sys::CUstream,
) -> Result<()> {
    #[cfg(test)]
    if trace::record(|| {
        let bytes: &[u8] = bytemuck::cast_slice(values);
        let sum = bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3));
        format!("copy to={:#x} bytes={} fnv={sum:016x}", destination.address(), bytes.len())
    }) {
        return Ok(());
    }
    // SAFETY: per this function's contract; the driver stages a pageable source before the
    // call returns.
    let result = unsafe { cudarc::driver::result::memcpy_htod_async(destination.address(), values, stream) };
    check(&format!("cuMemcpyHtoDAsync({what})"), result)
}

/// Copies `count` values from `source` to `destination` in device memory, ordered on `stream`.
///
/// # Safety
/// `source` and `destination` are device allocations of at least `count` elements that do not
/// overlap, and `stream` a live stream of the current context.
pub unsafe fn copy_on_device_async<T>(
    what: &str,
    destination: DevicePtr<T>,
    source: DevicePtr<T>,
    count: usize,
    stream: sys::CUstream,
) -> Result<()> {
    let bytes = count * size_of::<T>();
    #[cfg(test)]
    if trace::record(|| format!("copy to={:#x} from={:#x} bytes={bytes}", destination.address(), source.address())) {
        return Ok(());
    }
    // SAFETY: per this function's contract.
    let result =
        unsafe { cudarc::driver::result::memcpy_dtod_async(destination.address(), source.address(), bytes, stream) };
    check(&format!("cuMemcpyDtoDAsync({what})"), result)
}

/// Sets `count` 32-bit words at `destination` to `value`, ordered on `stream`.
///
/// # Safety
/// `destination` is a device allocation of at least `count` 4-byte words, and `stream` a live
/// stream of the current context.
pub unsafe fn fill_words_async(
    what: &str,
    destination: DevicePtr<u32>,
    value: u32,
    count: usize,
    stream: sys::CUstream,
) -> Result<()> {
    #[cfg(test)]
    if trace::record(|| format!("fill to={:#x} value={value:#x} words={count}", destination.address())) {
        return Ok(());
    }
    // SAFETY: per this function's contract.
    let result = unsafe { sys::cuMemsetD32Async(destination.address(), value, count, stream) }.result();
    check(&format!("cuMemsetD32Async({what})"), result)
}

/// How many blocks of `block` threads and `shared_bytes` of dynamic shared memory fit on one
/// multiprocessor (at least 1).
///
/// # Safety
/// `function` is a live kernel of a module loaded in the current context.
pub unsafe fn blocks_per_multiprocessor(
    name: &str,
    function: sys::CUfunction,
    block: u32,
    shared_bytes: u32,
) -> Result<u32> {
    let mut blocks = 0i32;
    // SAFETY: per this function's contract; the call writes one int.
    let result = unsafe {
        sys::cuOccupancyMaxActiveBlocksPerMultiprocessor(&mut blocks, function, block as i32, shared_bytes as usize)
    }
    .result();
    check(&format!("cuOccupancyMaxActiveBlocksPerMultiprocessor({name})"), result)?;
    Ok(blocks.max(1) as u32)
}

/// Lets `function` use `bytes` of dynamic shared memory (needed above 48 KiB).
///
/// # Safety
/// `function` is a live kernel of a module loaded in the current context.
pub unsafe fn allow_dynamic_shared_memory(name: &str, function: sys::CUfunction, bytes: u32) -> Result<()> {
    // SAFETY: per this function's contract.
    let result = unsafe {
        sys::cuFuncSetAttribute(
            function,
            sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            bytes as i32,
        )
    }
    .result();
    check(&format!("cuFuncSetAttribute({name}, MAX_DYNAMIC_SHARED_SIZE_BYTES = {bytes})"), result)
}

/// Element types of [`encode_tensor_map_2d`].
#[derive(Clone, Copy, Debug)]
pub enum TensorMapElement {
    F16,
    Bf16,
}

/// How much a TMA load's L2 misses fetch from memory: the requested sectors only, or the
/// whole 256-byte span around them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum L2Promotion {
    None,
    Bytes256,
}

/// A TMA descriptor for a `[rows, cols]` matrix of 16-bit elements at device `address`, rows
/// `row_stride` elements apart, read in boxes of `box_cols × box_rows` with the 128-byte
/// swizzle and L2 `promotion`; reads past the matrix give zeros. Needs a 16-byte aligned
/// address and row stride (`row_stride % 8 == 0`); `box_cols · 2 ≤ 128`, `box_rows ≤ 256`.
/// Encoding only reads its arguments; the device memory is not touched.
#[allow(clippy::too_many_arguments)]
pub fn encode_tensor_map_2d(
    what: &str,
    element: TensorMapElement,
    address: u64,
    rows: usize,
    cols: usize,
    row_stride: usize,
    box_rows: u32,
    box_cols: u32,
    promotion: L2Promotion,
) -> Result<TensorMap> {
    #[cfg(test)]
    if trace::recording() {
        // A stand-in whose words name what was encoded, so that the kernels' argument blocks
        // that carry it show the parameters.
        let words = [address, rows as u64, cols as u64, row_stride as u64, box_rows as u64, box_cols as u64];
        let tags = [element as u64, promotion as u64];
        let mut map = TensorMap([0; 16]);
        map.0[..6].copy_from_slice(&words);
        map.0[6..8].copy_from_slice(&tags);
        return Ok(map);
    }
    let element = match element {
        TensorMapElement::F16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
        TensorMapElement::Bf16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
    };
    let promotion = match promotion {
        L2Promotion::None => sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_NONE,
        L2Promotion::Bytes256 => sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
    };
    let mut map = TensorMap([0; 16]);
    let dims = [cols as u64, rows as u64];
    let strides = [row_stride as u64 * 2];
    let box_dims = [box_cols, box_rows];
    let element_strides = [1u32, 1];
    // SAFETY: `TensorMap` has the size (128) and alignment (64) of `CUtensorMap`; every
    // pointer refers to a live local of the length the rank (2) implies; the call only writes
    // `map`.
    let result = unsafe {
        sys::cuTensorMapEncodeTiled(
            (&mut map as *mut TensorMap).cast::<sys::CUtensorMap>(),
            element,
            2,
            address as *mut c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            box_dims.as_ptr(),
            element_strides.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            promotion,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    }
    .result();
    check(&format!("cuTensorMapEncodeTiled({what}, {rows} x {cols}, box {box_rows} x {box_cols})"), result)?;
    Ok(map)
}

/// The context current on this thread (null if none).
pub fn current_context() -> Result<sys::CUcontext> {
    let mut context = std::ptr::null_mut();
    // SAFETY: the call writes one handle.
    let result = unsafe { sys::cuCtxGetCurrent(&mut context) }.result();
    check("cuCtxGetCurrent", result)?;
    Ok(context)
}

/// Makes `context` current on this thread.
///
/// # Safety
/// `context` is a live context (or null, which unbinds the thread's context).
pub unsafe fn set_current_context(context: sys::CUcontext) -> Result<()> {
    // SAFETY: per this function's contract.
    check("cuCtxSetCurrent", unsafe { cudarc::driver::result::ctx::set_current(context) })
}

/// A context made current for the duration of a call, and the one it displaced: the library
/// never leaves a caller's thread with a different current context than it found.
pub struct ContextScope {
    previous: sys::CUcontext,
    /// Whether entering changed the current context (and leaving must restore it).
    switched: bool,
}

impl ContextScope {
    /// Makes `context` current, remembering the current one.
    ///
    /// # Safety
    /// `context` is a live context for as long as the scope lasts.
    pub unsafe fn enter(context: sys::CUcontext) -> Result<ContextScope> {
        #[cfg(test)]
        if trace::recording() {
            return Ok(ContextScope { previous: context, switched: false });
        }
        let previous = current_context()?;
        let switched = previous != context;
        if switched {
            // SAFETY: per this function's contract.
            unsafe { set_current_context(context)? };
        }
        Ok(ContextScope { previous, switched })
    }

    /// Restores the context that was current before [`ContextScope::enter`].
    pub fn leave(mut self) -> Result<()> {
        self.restore()
    }

    fn restore(&mut self) -> Result<()> {
        if !std::mem::take(&mut self.switched) {
            return Ok(());
        }
        // SAFETY: `previous` was current on this thread when the scope began; a caller that
        // destroys a context while it is current elsewhere breaks the driver's own rules.
        unsafe { set_current_context(self.previous) }
    }
}

impl Drop for ContextScope {
    /// A scope left by an early return: restore here, and say so if that fails (the caller is
    /// already getting the error that ended the scope).
    fn drop(&mut self) {
        if let Err(e) = self.restore() {
            eprintln!("flashsample: restoring the caller's CUDA context failed: {e}");
        }
    }
}

/// Runs `body` with `context` current, then restores the caller's context; the body's error
/// comes first.
///
/// # Safety
/// `context` is a live context.
pub unsafe fn in_context<R>(context: sys::CUcontext, body: impl FnOnce() -> Result<R>) -> Result<R> {
    // SAFETY: per this function's contract.
    let scope = unsafe { ContextScope::enter(context)? };
    let result = body();
    let left = scope.leave();
    match (result, left) {
        (Ok(value), left) => left.map(|()| value),
        (Err(error), Err(restore)) => {
            // The body's error is the one returned; the restore's would be lost otherwise.
            eprintln!("flashsample: restoring the caller's CUDA context failed: {restore}");
            Err(error)
        }
        (Err(error), Ok(())) => Err(error),
    }
}

/// A recording of what the host asks of the driver, for tests that run the launch logic
/// without a GPU: while a thread records, the driver calls above append a line each (launches
/// with their argument blocks, copies, fills) and return without touching the driver.
#[cfg(test)]
pub(crate) mod trace {
    use std::cell::RefCell;

    thread_local! {
        static EVENTS: RefCell<Option<Vec<String>>> = const { RefCell::new(None) };
    }

    /// Starts recording on this thread.
    pub fn start() {
        EVENTS.with(|events| *events.borrow_mut() = Some(Vec::new()));
    }

    /// Stops recording and returns what was recorded.
    pub fn take() -> Vec<String> {
        EVENTS.with(|events| events.borrow_mut().take().unwrap_or_default())
    }

    pub fn recording() -> bool {
        EVENTS.with(|events| events.borrow().is_some())
    }

    /// Appends `event()` when recording; returns whether it did.
    pub fn record(event: impl FnOnce() -> String) -> bool {
        EVENTS.with(|events| match events.borrow_mut().as_mut() {
            Some(list) => {
                list.push(event());
                true
            }
            None => false,
        })
    }
}
