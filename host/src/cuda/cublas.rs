//! cuBLAS, loaded at run time from a path, as the GEMM-only reference of `flashsample
//! bench`: the same `x @ Wᵀ` that `scripts/peers.py` times through torch, timed in the bench's
//! own process, stream, timer and L2 flush, right before our kernels at each point. On the
//! H200 the large batches run at the 700 W power cap, where the clock a kernel gets depends
//! on what ran in the seconds before (docs/PERF.md, sessions 6 and 7); timing both side by
//! side gives them the same conditions.
//!
//! Three layers, as elsewhere: the raw entry points (function pointers out of the library),
//! [`check_status`] turning a status into our `Error`, and [`Cublas`], whose handle is
//! destroyed by [`Cublas::close`] (an error there is returned) or, failing that, by `Drop`
//! (which can only print it).

use std::ffi::{c_int, c_void};
use std::path::Path;

use cust::memory::DeviceBuffer;
use libloading::Library;

use super::{CudaHidden, CudaLmHead, CudaSampler};
use crate::error::{Error, Result, invalid};
use crate::tensor::DType;

type Status = c_int;
type Handle = *mut c_void;
/// `cublasOperation_t`, `cudaDataType`, `cublasComputeType_t`, `cublasGemmAlgo_t`.
type Operation = c_int;
pub type DataType = c_int;
type ComputeType = c_int;
type Algorithm = c_int;
type Create = unsafe extern "C" fn(*mut Handle) -> Status;
type Destroy = unsafe extern "C" fn(Handle) -> Status;
type SetStream = unsafe extern "C" fn(Handle, cust::sys::CUstream) -> Status;
/// `cublasGemmEx(handle, transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta,
/// C, Ctype, ldc, computeType, algo)`.
type GemmEx = unsafe extern "C" fn(
    Handle,
    Operation,
    Operation,
    c_int,
    c_int,
    c_int,
    *const c_void,
    *const c_void,
    DataType,
    c_int,
    *const c_void,
    DataType,
    c_int,
    *const c_void,
    *mut c_void,
    DataType,
    c_int,
    ComputeType,
    Algorithm,
) -> Status;

// Values from cuBLAS's and the CUDA runtime's public headers (`cublas_api.h`,
// `library_types.h`).
const CUBLAS_STATUS_SUCCESS: Status = 0;
const CUBLAS_OP_N: Operation = 0;
const CUBLAS_OP_T: Operation = 1;
const CUDA_R_16F: DataType = 2;
const CUDA_R_16BF: DataType = 14;
const CUBLAS_COMPUTE_32F: ComputeType = 68;
const CUBLAS_GEMM_DEFAULT: Algorithm = -1;

/// A cuBLAS status as our error, naming the call.
fn check_status(call: &str, status: Status) -> Result<()> {
    if status == CUBLAS_STATUS_SUCCESS {
        Ok(())
    } else {
        Err(Error::Cuda { call: call.into(), detail: format!("cuBLAS status {status}") })
    }
}

/// The cuBLAS element type of `dtype`: the reference times 16-bit GEMMs only.
pub fn element_type(dtype: DType) -> Result<DataType> {
    match dtype {
        DType::BF16 => Ok(CUDA_R_16BF),
        DType::F16 => Ok(CUDA_R_16F),
        DType::F32 => Err(invalid("--cublas", "the cuBLAS reference times bf16 and f16 GEMMs, not f32")),
    }
}

/// A cuBLAS handle bound to the sampler's stream.
pub struct Cublas {
    handle: Handle,
    gemm_ex: GemmEx,
    destroy: Destroy,
    /// Keeps the function pointers above valid; dropped after the handle is destroyed.
    _library: Library,
}

impl Cublas {
    /// Loads `libcublas.so` from `path` and creates a handle on `sampler`'s context and
    /// stream (the CUDA runtime under cuBLAS takes the context current to the thread).
    pub fn load(path: &Path, sampler: &CudaSampler) -> Result<Cublas> {
        let file_error =
            |e: libloading::Error| Error::File { path: path.display().to_string(), message: e.to_string() };
        sampler.make_current()?;
        // SAFETY: loading cuBLAS runs its initialisers, which have no preconditions.
        let library = unsafe { Library::new(path) }.map_err(file_error)?;
        // SAFETY: the symbols are cuBLAS's exported C functions with the signatures above
        // (cuBLAS 12 and 13 keep them).
        let (create, destroy, set_stream, gemm_ex) = unsafe {
            (
                *library.get::<Create>(b"cublasCreate_v2\0").map_err(file_error)?,
                *library.get::<Destroy>(b"cublasDestroy_v2\0").map_err(file_error)?,
                *library.get::<SetStream>(b"cublasSetStream_v2\0").map_err(file_error)?,
                *library.get::<GemmEx>(b"cublasGemmEx\0").map_err(file_error)?,
            )
        };
        let mut handle: Handle = std::ptr::null_mut();
        // SAFETY: `handle` is a valid place for the new handle.
        check_status("cublasCreate_v2", unsafe { create(&mut handle) })?;
        let cublas = Cublas { handle, gemm_ex, destroy, _library: library };
        // SAFETY: a live handle and the sampler's live stream.
        check_status("cublasSetStream_v2", unsafe { set_stream(cublas.handle, sampler.stream().as_inner()) })?;
        Ok(cublas)
    }

    /// Enqueues `out[B, V] = H · Wᵀ` in the element type of `W` (f32 accumulation), as torch's
    /// `x @ W.T`: column-major that is `out = Wᵀᵀ · Hᵀ` with `W` read transposed.
    pub fn gemm(&self, lm_head: &CudaLmHead, hidden: &CudaHidden, out: &mut DeviceBuffer<u16>) -> Result<()> {
        let shape = lm_head.shape;
        let element = element_type(shape.dtype)?;
        if hidden.dtype != shape.dtype || hidden.cols != shape.dim || out.len() < hidden.rows * shape.vocab {
            return Err(invalid("out", "the cuBLAS reference needs H[B, D] of W's dtype and B × V elements out"));
        }
        let dimension = |value: usize, name: &str| {
            c_int::try_from(value).map_err(|_| invalid(name, format!("{value} exceeds cuBLAS's int range")))
        };
        let (vocab, batch, dim) =
            (dimension(shape.vocab, "V")?, dimension(hidden.rows, "B")?, dimension(shape.dim, "D")?);
        let (alpha, beta) = (1.0f32, 0.0f32);
        // SAFETY: a live handle; W holds V × D, H holds B × D and `out` B × V elements of the
        // stated type (checked above); alpha and beta outlive the call (host pointer mode
        // reads them before it returns).
        let status = unsafe {
            (self.gemm_ex)(
                self.handle,
                CUBLAS_OP_T,
                CUBLAS_OP_N,
                vocab,
                batch,
                dim,
                (&alpha as *const f32).cast(),
                lm_head.address() as *const c_void,
                element,
                dim,
                hidden.buffer.as_device_ptr().as_raw() as *const c_void,
                element,
                dim,
                (&beta as *const f32).cast(),
                out.as_device_ptr().as_raw() as *mut c_void,
                element,
                vocab,
                CUBLAS_COMPUTE_32F,
                CUBLAS_GEMM_DEFAULT,
            )
        };
        check_status("cublasGemmEx", status)
    }

    /// Destroys the handle, returning cuBLAS's error if any.
    pub fn close(mut self) -> Result<()> {
        let handle = std::mem::replace(&mut self.handle, std::ptr::null_mut());
        // SAFETY: the handle is live and no longer used.
        check_status("cublasDestroy_v2", unsafe { (self.destroy)(handle) })
    }
}

impl Drop for Cublas {
    fn drop(&mut self) {
        if !self.handle.is_null() {
            // SAFETY: the handle is live and no longer used.
            if let Err(e) = check_status("cublasDestroy_v2", unsafe { (self.destroy)(self.handle) }) {
                eprintln!("warning: {e} (while dropping the cuBLAS handle; call Cublas::close to handle it)");
            }
        }
    }
}
