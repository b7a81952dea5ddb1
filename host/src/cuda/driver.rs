//! The checked layer over raw driver calls: every call's result becomes our `Error` naming the
//! call, and the few raw calls cust does not wrap (launch with a by-value argument block,
//! async copies, occupancy) live here.

use std::ffi::{CStr, c_void};

use cust::sys as raw;

use crate::error::{Error, Result};

/// A cust result, checked.
pub fn check<T>(call: &str, result: cust::error::CudaResult<T>) -> Result<T> {
    result.map_err(|e| Error::Cuda { call: call.to_string(), detail: e.to_string() })
}

/// A raw driver result, checked, with the driver's own name and text for the code.
pub fn check_raw(call: &str, result: raw::CUresult) -> Result<()> {
    if result == raw::cudaError_enum::CUDA_SUCCESS {
        return Ok(());
    }
    let mut name: *const std::os::raw::c_char = std::ptr::null();
    let mut text: *const std::os::raw::c_char = std::ptr::null();
    // SAFETY: both calls only write a pointer to a static string (or leave it null).
    unsafe {
        raw::cuGetErrorName(result, &mut name);
        raw::cuGetErrorString(result, &mut text);
    }
    let as_string = |p: *const std::os::raw::c_char| {
        // SAFETY: non-null pointers from cuGetError* point to static NUL-terminated strings.
        if p.is_null() { format!("{result:?}") } else { unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned() }
    };
    Err(Error::Cuda { call: call.to_string(), detail: format!("{} ({})", as_string(name), as_string(text)) })
}

/// Launches `function` on a 1-D grid with one argument block passed by value.
///
/// # Safety
/// `A` must be the `#[repr(C)]` argument block the kernel declares, its device addresses
/// valid for the extents it states until the kernel completes, and the launch shape the one
/// the kernel's safety section requires.
pub unsafe fn launch<A>(
    name: &str,
    function: raw::CUfunction,
    stream: raw::CUstream,
    grid: u32,
    block: u32,
    shared_bytes: u32,
    args: &A,
) -> Result<()> {
    let mut params = [args as *const A as *mut c_void];
    // SAFETY: per this function's contract; the driver copies the argument block at launch.
    let result = unsafe {
        raw::cuLaunchKernel(
            function,
            grid,
            1,
            1,
            block,
            1,
            1,
            shared_bytes,
            stream,
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    };
    check_raw(&format!("cuLaunchKernel({name})"), result)
}

/// Copies `bytes` from the host to device address `destination`, ordered on `stream`.
///
/// # Safety
/// `destination` must be a device allocation of at least `bytes.len()` bytes.
pub unsafe fn copy_to_device_async(destination: u64, bytes: &[u8], stream: raw::CUstream) -> Result<()> {
    // SAFETY: per this function's contract; pageable sources are staged before the call returns.
    let result = unsafe { raw::cuMemcpyHtoDAsync_v2(destination, bytes.as_ptr().cast(), bytes.len(), stream) };
    check_raw("cuMemcpyHtoDAsync", result)
}

/// How many blocks of `block` threads and `shared_bytes` of dynamic shared memory fit on one
/// multiprocessor.
///
/// # Safety
/// `function` must be a live handle of a loaded module in the current context.
pub unsafe fn blocks_per_multiprocessor(
    name: &str,
    function: raw::CUfunction,
    block: u32,
    shared_bytes: u32,
) -> Result<u32> {
    let mut blocks = 0i32;
    // SAFETY: per this function's contract; the call writes one int.
    let result = unsafe {
        raw::cuOccupancyMaxActiveBlocksPerMultiprocessor(&mut blocks, function, block as i32, shared_bytes as usize)
    };
    check_raw(&format!("cuOccupancyMaxActiveBlocksPerMultiprocessor({name})"), result)?;
    Ok(blocks.max(1) as u32)
}

/// Lets `function` use `bytes` of dynamic shared memory (needed above 48 KiB).
///
/// # Safety
/// `function` must be a live handle of a loaded module in the current context.
pub unsafe fn allow_dynamic_shared_memory(name: &str, function: raw::CUfunction, bytes: u32) -> Result<()> {
    // SAFETY: per this function's contract.
    let result = unsafe {
        raw::cuFuncSetAttribute(
            function,
            raw::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            bytes as i32,
        )
    };
    check_raw(&format!("cuFuncSetAttribute({name}, MAX_DYNAMIC_SHARED_SIZE_BYTES = {bytes})"), result)
}

/// The driver's TMA descriptor (`CUtensorMap`): 128 opaque bytes, 64-byte aligned.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
pub struct TensorMap(pub [u64; 16]);

/// Element types of [`encode_tensor_map_2d`] (`CUtensorMapDataType`).
#[derive(Clone, Copy, Debug)]
pub enum TensorMapElement {
    F16 = 6,
    Bf16 = 9,
}

// The tensor-map entry point is newer than cust's bindings; libcuda (12.0+) exports it.
#[link(name = "cuda")]
unsafe extern "C" {
    fn cuTensorMapEncodeTiled(
        map: *mut TensorMap,
        element: u32,
        rank: u32,
        address: *mut c_void,
        dims: *const u64,
        strides: *const u64,
        box_dims: *const u32,
        element_strides: *const u32,
        interleave: u32,
        swizzle: u32,
        l2_promotion: u32,
        out_of_bounds_fill: u32,
    ) -> raw::CUresult;
}

/// How much a TMA load's L2 misses fetch from memory (`CUtensorMapL2promotion`): the
/// requested sectors only, or the whole 256-byte span around them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum L2Promotion {
    None = 0,
    Bytes256 = 3,
}

/// A TMA descriptor for a row-major `[rows, cols]` matrix of 16-bit elements at device
/// `address`, read in boxes of `box_cols × box_rows` with the 128-byte swizzle and L2
/// `promotion`; reads past the matrix give zeros. Needs `cols % 8 == 0` (16-byte row stride)
/// and a 16-byte aligned address; `box_cols · 2 ≤ 128`, `box_rows ≤ 256`.
#[allow(clippy::too_many_arguments)]
pub fn encode_tensor_map_2d(
    what: &str,
    element: TensorMapElement,
    address: u64,
    rows: usize,
    cols: usize,
    box_rows: u32,
    box_cols: u32,
    promotion: L2Promotion,
) -> Result<TensorMap> {
    const INTERLEAVE_NONE: u32 = 0;
    const SWIZZLE_128B: u32 = 3;
    const OUT_OF_BOUNDS_ZERO: u32 = 0;
    let mut map = TensorMap([0; 16]);
    let dims = [cols as u64, rows as u64];
    let strides = [cols as u64 * 2];
    let box_dims = [box_cols, box_rows];
    let element_strides = [1u32, 1];
    // SAFETY: every pointer refers to a live local of the length the rank (2) implies; the
    // call only writes `map`.
    let result = unsafe {
        cuTensorMapEncodeTiled(
            &mut map,
            element as u32,
            2,
            address as *mut c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            box_dims.as_ptr(),
            element_strides.as_ptr(),
            INTERLEAVE_NONE,
            SWIZZLE_128B,
            promotion as u32,
            OUT_OF_BOUNDS_ZERO,
        )
    };
    check_raw(&format!("cuTensorMapEncodeTiled({what}, {rows} x {cols}, box {box_rows} x {box_cols})"), result)?;
    Ok(map)
}
