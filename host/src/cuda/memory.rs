//! Device memory as the library holds it: typed allocations made and freed on a stream,
//! matrices by address, and the TMA descriptors that describe them.
//!
//! Every allocation is made and freed on a stream (cudarc frees with `cuMemFreeAsync` on it),
//! so work queued on that stream before a buffer is dropped still sees the buffer. An error
//! from freeing is kept by the context and reported by the next checked call.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr as _, DevicePtrMut as _};
use flashsample_core::abi::{DevicePtr, TMA_ITEM_ROWS, TMA_K_BLOCK, TensorMap};

use super::dispatch::TMA_COLUMNS;
use super::driver::{self, L2Promotion, TensorMapElement};
use crate::error::{Result, invalid};
use crate::tensor::DType;

/// A matrix in device memory by address: `rows × cols` elements of `dtype`, row `r` starting
/// `r · row_stride` elements after `address`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct MatrixRef {
    pub address: u64,
    pub rows: usize,
    pub cols: usize,
    /// Elements from one row to the next (at least `cols`).
    pub row_stride: usize,
    pub dtype: DType,
}

impl MatrixRef {
    /// A matrix whose rows follow each other (`row_stride = cols`).
    pub fn contiguous(address: u64, rows: usize, cols: usize, dtype: DType) -> MatrixRef {
        MatrixRef { address, rows, cols, row_stride: cols, dtype }
    }

    /// Whether the tensor-core tiles can read it: 16-byte aligned start and rows.
    pub fn rows_16_byte_aligned(&self) -> bool {
        self.address.is_multiple_of(16) && (self.row_stride * self.dtype.bytes()).is_multiple_of(16)
    }

    /// The rules of a matrix named `what`: an aligned, non-null address and a row stride of
    /// at least `cols` elements, below 2³².
    pub fn check(&self, what: &str) -> Result<()> {
        check_address(what, self.address, self.dtype.bytes())?;
        if self.row_stride < self.cols || self.row_stride > u32::MAX as usize {
            return Err(invalid(
                what,
                format!("row stride {}: must be at least the {} columns and below 2^32", self.row_stride, self.cols),
            ));
        }
        Ok(())
    }
}

/// The rule of a device address named `what`: non-null and `alignment`-byte aligned.
pub(crate) fn check_address(what: &str, address: u64, alignment: usize) -> Result<()> {
    if address == 0 || !address.is_multiple_of(alignment as u64) {
        return Err(invalid(what, format!("address {address:#x}: must be non-null and {alignment}-byte aligned")));
    }
    Ok(())
}

/// `len` values of `T` in device memory, with their address.
pub(crate) struct Allocation<T> {
    // Bytes, so that any `Pod` type can be stored (cudarc's slices need its own trait).
    bytes: CudaSlice<u8>,
    len: usize,
    ptr: DevicePtr<T>,
}

impl<T: bytemuck::Pod> Allocation<T> {
    /// Allocates room for `len` values (at least one byte) on `stream`, not initialised.
    ///
    /// # Safety
    /// Nothing may read a value before something has written it.
    pub unsafe fn uninitialized(stream: &Arc<CudaStream>, len: usize, what: &str) -> Result<Allocation<T>> {
        let size = len
            .checked_mul(std::mem::size_of::<T>())
            .ok_or_else(|| invalid(what, format!("{len} elements do not fit in memory")))?;
        // SAFETY: per this function's contract.
        let bytes = driver::check(&format!("cuMemAllocAsync({what}, {size} bytes)"), unsafe {
            stream.alloc::<u8>(size.max(1))
        })?;
        let (address, _) = bytes.device_ptr(stream);
        Ok(Allocation { bytes, len, ptr: DevicePtr::new(address) })
    }

    /// A copy of `values` in device memory (queued on `stream`; the source may be dropped at
    /// once).
    pub fn from_host(stream: &Arc<CudaStream>, values: &[T], what: &str) -> Result<Allocation<T>> {
        // SAFETY: the copy below writes every value.
        let mut allocation = unsafe { Allocation::uninitialized(stream, values.len(), what)? };
        allocation.write(stream, values, what)?;
        Ok(allocation)
    }

    /// Copies `values` (at most `len`) to the start of the allocation, queued on `stream`.
    pub fn write(&mut self, stream: &Arc<CudaStream>, values: &[T], what: &str) -> Result<()> {
        if values.len() > self.len {
            return Err(invalid(what, format!("{} values for room of {}", values.len(), self.len)));
        }
        // Recorded as a write on `stream` for cudarc's event tracking, where the context has it.
        let (_, write) = self.bytes.device_ptr_mut(stream);
        // SAFETY: the allocation holds at least `values.len()` values and lives on `stream`.
        let copied = unsafe { driver::copy_to_device_async(what, self.ptr, values, stream.cu_stream()) };
        drop(write);
        copied
    }

    /// The values, once every queued write to them has finished.
    pub fn to_host(&self, stream: &Arc<CudaStream>, what: &str) -> Result<Vec<T>> {
        let mut bytes = vec![0u8; self.len * std::mem::size_of::<T>()];
        let view = self.bytes.slice(..bytes.len());
        driver::check(&format!("cuMemcpyDtoH({what})"), stream.memcpy_dtoh(&view, &mut bytes))?;
        driver::check(&format!("cuStreamSynchronize (after copying {what} to the host)"), stream.synchronize())?;
        Ok(bytemuck::pod_collect_to_vec(&bytes))
    }

    pub fn ptr(&self) -> DevicePtr<T> {
        self.ptr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// The allocation's cudarc slice, for cudarc's event tracking of its uses.
    pub fn slice(&self) -> &CudaSlice<u8> {
        &self.bytes
    }

    /// As [`Allocation::slice`], for a write.
    pub fn slice_mut(&mut self) -> &mut CudaSlice<u8> {
        &mut self.bytes
    }
}

/// The allocation in `slot`, grown to at least `len` values first (contents not kept).
pub(crate) fn ensure<T: bytemuck::Pod>(
    stream: &Arc<CudaStream>,
    slot: &mut Option<Allocation<T>>,
    len: usize,
    what: &str,
) -> Result<DevicePtr<T>> {
    if slot.as_ref().is_none_or(|b| b.len() < len) {
        *slot = None;
        // SAFETY: every consumer writes before it reads (the tile kernel fills what the merge
        // kernel reads).
        *slot = Some(unsafe { Allocation::uninitialized(stream, len, what)? });
    }
    Ok(slot.as_ref().expect("just ensured").ptr())
}

/// The L2 promotion of the TMA loads of a tile with `columns` batch columns. Up to 64
/// columns the tiles stream `W` from memory at the read bandwidth, and fetching only the
/// 128 bytes per row that a box asks for is faster: on the H200 the B ≤ 64 kernels ran
/// 1.7–3.1 % faster than with 256-byte promotion, and at B = 1, D = 8192 their L2 traffic fell
/// from 4.4 to 3.3 GB, what cuBLAS moves. The 128-column tiles keep the 256-byte promotion
/// (at B = 128 the two ran within −0.8 … +1.6 %; docs/PERF.md).
pub(crate) fn l2_promotion(columns: u32) -> L2Promotion {
    if columns <= 64 { L2Promotion::None } else { L2Promotion::Bytes256 }
}

/// Both L2 promotions, in the order `W`'s resident maps are stored.
const W_PROMOTIONS: [L2Promotion; 2] = [L2Promotion::None, L2Promotion::Bytes256];

/// The tensor map of `matrix` (named `what`) for boxes of `box_rows` rows with L2
/// `promotion` (a tile of `columns` columns wants [`l2_promotion`]`(columns)`).
pub(crate) fn tensor_map(what: &str, matrix: &MatrixRef, box_rows: u32, promotion: L2Promotion) -> Result<TensorMap> {
    let element = match matrix.dtype {
        DType::BF16 => TensorMapElement::Bf16,
        DType::F16 => TensorMapElement::F16,
        DType::F32 => return Err(invalid(what, "no TMA descriptor: the TMA kernels need BF16 or F16")),
    };
    driver::encode_tensor_map_2d(
        what,
        element,
        matrix.address,
        matrix.rows,
        matrix.cols,
        matrix.row_stride,
        box_rows,
        TMA_K_BLOCK,
        promotion,
    )
}

/// The tensor maps a buffer keeps beside its matrix for every box a TMA tile may read it in,
/// so that calls on it write none.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ResidentMaps {
    /// `W`'s: one per L2 promotion of `W_PROMOTIONS` and item height of `TMA_ITEM_ROWS`, in
    /// that order.
    LmHead(DevicePtr<TensorMap>),
    /// `H`'s: one per width of [`TMA_COLUMNS`], each with that width's promotion.
    Hidden(DevicePtr<TensorMap>),
}

impl ResidentMaps {
    /// The boxes whose maps a matrix in the role of `lm_head` (or not: `H`) keeps.
    fn boxes(lm_head: bool) -> Vec<(u32, L2Promotion)> {
        match lm_head {
            true => W_PROMOTIONS.iter().flat_map(|&promotion| TMA_ITEM_ROWS.map(|rows| (rows, promotion))).collect(),
            false => TMA_COLUMNS.iter().map(|&columns| (columns, l2_promotion(columns))).collect(),
        }
    }

    /// The maps of `matrix` in the role of `lm_head` (or `H`), uploaded on `stream`; `None`
    /// when the TMA tiles cannot read it (f32, or D not a multiple of 8).
    pub fn upload(
        stream: &Arc<CudaStream>,
        what: &str,
        matrix: &MatrixRef,
        lm_head: bool,
    ) -> Result<Option<Allocation<TensorMap>>> {
        if matrix.dtype == DType::F32 || !matrix.cols.is_multiple_of(8) {
            return Ok(None);
        }
        let maps = ResidentMaps::boxes(lm_head)
            .into_iter()
            .map(|(height, promotion)| tensor_map(what, matrix, height, promotion))
            .collect::<Result<Vec<_>>>()?;
        Allocation::from_host(stream, &maps, &format!("{what} tensor maps")).map(Some)
    }

    /// The map for a TMA tile's boxes: `rows` of `W` or `columns` of `H`, with the promotion
    /// a tile of `columns` columns wants.
    pub fn map(self, rows: u32, columns: u32) -> DevicePtr<TensorMap> {
        match self {
            ResidentMaps::LmHead(maps) => {
                let row_index =
                    TMA_ITEM_ROWS.iter().position(|&r| r == rows).expect("Variant::resolve checked the height");
                let promotion_index = W_PROMOTIONS
                    .iter()
                    .position(|&p| p == l2_promotion(columns))
                    .expect("W_PROMOTIONS lists every promotion");
                maps.add((promotion_index * TMA_ITEM_ROWS.len() + row_index) as u64)
            }
            ResidentMaps::Hidden(maps) => {
                let index = TMA_COLUMNS.iter().position(|&c| c == columns).expect("Variant::resolve checked the width");
                maps.add(index as u64)
            }
        }
    }
}
