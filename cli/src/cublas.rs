//! cuBLAS, opened at run time through cudarc's bindings, as the GEMM-only reference of
//! `flashsample bench`: the same `x @ Wᵀ` that `scripts/peers.py` times through torch, timed in
//! the bench's own process, stream, timer and L2 flush, right before our kernels at each point.
//! On the H200 the large batches run at the 700 W power cap, where the clock a kernel gets
//! depends on what ran in the seconds before (docs/PERF.md); timing both side by side gives
//! them the same conditions.
//!
//! The library is found by the dynamic loader under the names cudarc tries (`libcublas.so`,
//! `libcublas.so.12`, …; `LD_LIBRARY_PATH` picks the folder, so torch's copy works). [`Cublas`]
//! creates the handle on the sampler's stream and destroys it in [`Cublas::close`] (an error
//! there is returned) or, failing that, in `Drop` (which can only print it).

use cudarc::cublas::{result, sys};
use flashsample::{CudaHidden, CudaSampler, DType, Error, HeadShape, Result};
use flashsample_core::abi::DevicePtr;

/// A cuBLAS error as ours, naming the call.
fn check(call: &str, status: std::result::Result<(), result::CublasError>) -> Result<()> {
    status.map_err(|e| Error::Cuda { call: call.into(), detail: format!("{e:?}") })
}

/// The cuBLAS element type of `dtype`: the reference times 16-bit GEMMs only.
pub fn element_type(dtype: DType) -> Result<sys::cudaDataType> {
    match dtype {
        DType::BF16 => Ok(sys::cudaDataType::CUDA_R_16BF),
        DType::F16 => Ok(sys::cudaDataType::CUDA_R_16F),
        DType::F32 => Err(Error::InvalidArgument {
            argument: "--cublas".into(),
            rule: "the cuBLAS reference times bf16 and f16 GEMMs, not f32".into(),
        }),
    }
}

/// A cuBLAS handle bound to a sampler's stream.
pub struct Cublas {
    handle: sys::cublasHandle_t,
}

impl Cublas {
    /// Opens cuBLAS and creates a handle on `sampler`'s context and stream.
    pub fn load(sampler: &CudaSampler) -> Result<Cublas> {
        // SAFETY: probing only opens and closes the library.
        if !unsafe { sys::is_culib_present() } {
            return Err(Error::InvalidArgument {
                argument: "--cublas".into(),
                rule: "cuBLAS cannot be opened: put the folder of libcublas.so (or libcublas.so.12) on LD_LIBRARY_PATH"
                    .into(),
            });
        }
        sampler.synchronize("loading cuBLAS")?;
        let handle = result::create_handle()
            .map_err(|e| Error::Cuda { call: "cublasCreate_v2".into(), detail: format!("{e:?}") })?;
        let cublas = Cublas { handle };
        // SAFETY: a live handle and the sampler's live stream, in the context cuBLAS took.
        check("cublasSetStream_v2", unsafe { result::set_stream(cublas.handle, sampler.stream().cu_stream() as _) })?;
        Ok(cublas)
    }

    /// Enqueues `out[B, V] = H · Wᵀ` in the element type of `W` (f32 accumulation), as torch's
    /// `x @ W.T`: column-major that is `out = Wᵀᵀ · Hᵀ` with `W` read transposed.
    pub fn gemm(
        &self,
        lm_head: u64,
        shape: HeadShape,
        hidden: &CudaHidden,
        out: DevicePtr<u16>,
        out_len: usize,
    ) -> Result<()> {
        let element = element_type(shape.dtype)?;
        let h = hidden.shape();
        if h.dtype != shape.dtype || h.cols != shape.dim || out_len < h.rows * shape.vocab {
            return Err(Error::InvalidArgument {
                argument: "out".into(),
                rule: "the cuBLAS reference needs H[B, D] of W's dtype and B × V elements out".into(),
            });
        }
        let dimension = |value: usize, name: &str| {
            i32::try_from(value).map_err(|_| Error::InvalidArgument {
                argument: name.into(),
                rule: format!("{value} exceeds cuBLAS's int range"),
            })
        };
        let (vocab, batch, dim) = (dimension(shape.vocab, "V")?, dimension(h.rows, "B")?, dimension(shape.dim, "D")?);
        let (alpha, beta) = (1.0f32, 0.0f32);
        // SAFETY: a live handle; W holds V × D, H holds B × D and `out` B × V elements of the
        // stated type (checked above); alpha and beta outlive the call (host pointer mode
        // reads them before it returns).
        let status = unsafe {
            result::gemm_ex(
                self.handle,
                sys::cublasOperation_t::CUBLAS_OP_T,
                sys::cublasOperation_t::CUBLAS_OP_N,
                vocab,
                batch,
                dim,
                (&alpha as *const f32).cast(),
                lm_head as *const _,
                element,
                dim,
                hidden.address() as *const _,
                element,
                dim,
                (&beta as *const f32).cast(),
                out.address() as *mut _,
                element,
                vocab,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        };
        check("cublasGemmEx", status)
    }

    /// Destroys the handle, returning cuBLAS's error if any.
    pub fn close(mut self) -> Result<()> {
        let handle = std::mem::replace(&mut self.handle, std::ptr::null_mut());
        // SAFETY: the handle is live and no longer used.
        check("cublasDestroy_v2", unsafe { result::destroy_handle(handle) })
    }
}

impl Drop for Cublas {
    fn drop(&mut self) {
        if !self.handle.is_null() {
            // SAFETY: the handle is live and no longer used.
            if let Err(e) = check("cublasDestroy_v2", unsafe { result::destroy_handle(self.handle) }) {
                eprintln!("warning: {e} (while dropping the cuBLAS handle; call Cublas::close to handle it)");
            }
        }
    }
}
