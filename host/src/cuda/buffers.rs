//! Device memory: the typed allocation every buffer is made of, the LM head and hidden states
//! with their TMA descriptors, tokens, row parameters, and the sampler's grow-only workspace.
//!
//! Every allocation is made and freed on the sampler's stream (cudarc frees with
//! `cuMemFreeAsync` on it), so work queued on that stream before a buffer is dropped still sees
//! the buffer. An error from freeing is kept by the context and reported by the sampler's next
//! call or by [`super::CudaSampler::close`].

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr as _, DevicePtrMut as _};
use flashsample_core::RowParams;
use flashsample_core::abi::{DevicePtr, TMA_ITEM_ROWS, TensorMap};

use super::dispatch::TMA_COLUMNS;
use super::driver::{self, L2Promotion};
use super::stream::{DeviceMatrix, tensor_map};
use crate::error::{Error, Result, invalid};
use crate::params::{HeadShape, SamplingParams, batch_row_params};
use crate::tensor::{DType, MatrixShape};

/// `len` values of `T` in device memory, with their address.
pub(crate) struct DeviceBuffer<T> {
    // Bytes, so that any `Pod` type can be stored (cudarc's slices need its own trait).
    bytes: CudaSlice<u8>,
    len: usize,
    ptr: DevicePtr<T>,
}

impl<T: bytemuck::Pod> DeviceBuffer<T> {
    /// Allocates room for `len` values (at least one byte), not initialised.
    ///
    /// # Safety
    /// Nothing may read a value before something has written it.
    pub(crate) unsafe fn uninitialized(stream: &Arc<CudaStream>, len: usize, what: &str) -> Result<DeviceBuffer<T>> {
        let size = len
            .checked_mul(std::mem::size_of::<T>())
            .ok_or_else(|| invalid(what, format!("{len} elements do not fit in memory")))?;
        // SAFETY: per this function's contract.
        let bytes = driver::check(&format!("cuMemAllocAsync({what}, {size} bytes)"), unsafe {
            stream.alloc::<u8>(size.max(1))
        })?;
        let (address, _) = bytes.device_ptr(stream);
        Ok(DeviceBuffer { bytes, len, ptr: DevicePtr::new(address) })
    }

    /// A copy of `values` in device memory (queued on `stream`; the source may be dropped at
    /// once).
    pub(crate) fn from_host(stream: &Arc<CudaStream>, values: &[T], what: &str) -> Result<DeviceBuffer<T>> {
        // SAFETY: the copy below writes every value.
        let mut buffer = unsafe { DeviceBuffer::uninitialized(stream, values.len(), what)? };
        // Recorded as a write on `stream` for cudarc's event tracking, where the context has it.
        let (_, write) = buffer.bytes.device_ptr_mut(stream);
        // SAFETY: the buffer holds `values.len()` values and lives on `stream`.
        unsafe { driver::copy_to_device_async(what, buffer.ptr, values, stream.cu_stream())? };
        drop(write);
        Ok(buffer)
    }

    /// The values, once every queued write to them has finished.
    pub(crate) fn to_host(&self, stream: &Arc<CudaStream>, what: &str) -> Result<Vec<T>> {
        let mut bytes = vec![0u8; self.len * std::mem::size_of::<T>()];
        let view = self.bytes.slice(..bytes.len());
        driver::check(&format!("cuMemcpyDtoH({what})"), stream.memcpy_dtoh(&view, &mut bytes))?;
        driver::check(&format!("cuStreamSynchronize (after copying {what} to the host)"), stream.synchronize())?;
        Ok(bytemuck::pod_collect_to_vec(&bytes))
    }

    pub(crate) fn ptr(&self) -> DevicePtr<T> {
        self.ptr
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn size_bytes(&self) -> usize {
        self.len * std::mem::size_of::<T>()
    }
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

/// Both L2 promotions, in the order the `W` maps are stored (see [`CudaLmHead::tensor_map`]).
const W_PROMOTIONS: [L2Promotion; 2] = [L2Promotion::None, L2Promotion::Bytes256];

/// TMA descriptors for `matrix`, one per (box height, L2 promotion), stored back to back in
/// device memory; `None` when the TMA kernels cannot read it (f32, or rows not a multiple of 16
/// bytes).
fn tensor_maps(
    stream: &Arc<CudaStream>,
    what: &str,
    matrix: &DeviceMatrix,
    boxes: &[(u32, L2Promotion)],
) -> Result<Option<DeviceBuffer<TensorMap>>> {
    if matrix.dtype == DType::F32 || !matrix.cols.is_multiple_of(8) {
        return Ok(None);
    }
    let maps = boxes
        .iter()
        .map(|&(height, promotion)| tensor_map(what, matrix, height, promotion))
        .collect::<Result<Vec<_>>>()?;
    DeviceBuffer::from_host(stream, &maps, &format!("{what} tensor maps")).map(Some)
}

fn missing_tensor_map(what: &str) -> Error {
    invalid(what, "no TMA descriptor: the TMA kernels need BF16 or F16 and D % 8 == 0")
}

/// An LM head `W[V, D]` in device memory.
pub struct CudaLmHead {
    pub(crate) buffer: DeviceBuffer<u8>,
    pub(crate) shape: HeadShape,
    /// TMA descriptors, one per L2 promotion of `W_PROMOTIONS` and item height of
    /// `TMA_ITEM_ROWS` (boxes of that many rows), in that order, when the TMA kernels can
    /// read `W` (Hopper module).
    tensor_maps: Option<DeviceBuffer<TensorMap>>,
}

impl CudaLmHead {
    pub(crate) fn new(stream: &Arc<CudaStream>, buffer: DeviceBuffer<u8>, shape: HeadShape, tma: bool) -> Result<Self> {
        let boxes: Vec<_> =
            W_PROMOTIONS.iter().flat_map(|&promotion| TMA_ITEM_ROWS.map(|rows| (rows, promotion))).collect();
        let matrix = DeviceMatrix::contiguous(buffer.ptr().address(), shape.vocab, shape.dim, shape.dtype);
        let tensor_maps = if tma { tensor_maps(stream, "lm_head", &matrix, &boxes)? } else { None };
        Ok(CudaLmHead { buffer, shape, tensor_maps })
    }

    pub fn shape(&self) -> HeadShape {
        self.shape
    }

    /// The device address of `W[0, 0]` (row-major, `D` elements per row).
    pub fn address(&self) -> u64 {
        self.buffer.ptr().address()
    }

    /// `W` as a request names it.
    pub fn matrix(&self) -> DeviceMatrix {
        DeviceMatrix::contiguous(self.address(), self.shape.vocab, self.shape.dim, self.shape.dtype)
    }

    /// The tensor map for boxes of `rows` rows, promoted as a tile of `columns` columns is.
    pub(crate) fn tensor_map(&self, rows: u32, columns: u32) -> Result<DevicePtr<TensorMap>> {
        let maps = self.tensor_maps.as_ref().ok_or_else(|| missing_tensor_map("lm_head"))?;
        let row_index = TMA_ITEM_ROWS.iter().position(|&r| r == rows).expect("Variant::resolve checked the height");
        let promotion_index =
            W_PROMOTIONS.iter().position(|&p| p == l2_promotion(columns)).expect("W_PROMOTIONS lists every promotion");
        Ok(maps.ptr().add((promotion_index * TMA_ITEM_ROWS.len() + row_index) as u64))
    }
}

/// Hidden states `H[B, D]` in device memory.
pub struct CudaHidden {
    pub(crate) buffer: DeviceBuffer<u8>,
    pub(crate) shape: MatrixShape,
    /// One TMA descriptor per width of [`TMA_COLUMNS`] (boxes of that many rows, with that
    /// width's `l2_promotion`), when the TMA kernels can read `H` (Hopper module).
    tensor_maps: Option<DeviceBuffer<TensorMap>>,
}

impl CudaHidden {
    pub(crate) fn new(
        stream: &Arc<CudaStream>,
        buffer: DeviceBuffer<u8>,
        shape: MatrixShape,
        tma: bool,
    ) -> Result<Self> {
        let boxes = TMA_COLUMNS.map(|columns| (columns, l2_promotion(columns)));
        let matrix = DeviceMatrix::contiguous(buffer.ptr().address(), shape.rows, shape.cols, shape.dtype);
        let tensor_maps = if tma { tensor_maps(stream, "hidden", &matrix, &boxes)? } else { None };
        Ok(CudaHidden { buffer, shape, tensor_maps })
    }

    pub fn rows(&self) -> usize {
        self.shape.rows
    }

    pub fn shape(&self) -> MatrixShape {
        self.shape
    }

    /// The device address of `H[0, 0]` (row-major, `D` elements per row).
    pub fn address(&self) -> u64 {
        self.buffer.ptr().address()
    }

    /// `H` as a request names it.
    pub fn matrix(&self) -> DeviceMatrix {
        DeviceMatrix::contiguous(self.address(), self.shape.rows, self.shape.cols, self.shape.dtype)
    }

    /// The tensor map for boxes of `columns` rows.
    pub(crate) fn tensor_map(&self, columns: u32) -> Result<DevicePtr<TensorMap>> {
        let maps = self.tensor_maps.as_ref().ok_or_else(|| missing_tensor_map("hidden"))?;
        let index = TMA_COLUMNS.iter().position(|&c| c == columns).expect("Variant::resolve checked the width");
        Ok(maps.ptr().add(index as u64))
    }
}

/// Sampled tokens in device memory, `[rows, samples]` of u32; every slot of a row without a
/// token holds its status's sentinel ([`crate::RowStatus::of_token`]).
pub struct DeviceTokens {
    pub(crate) buffer: DeviceBuffer<u32>,
    pub rows: usize,
    pub samples: usize,
}

impl DeviceTokens {
    /// The device address of `tokens[0]`, for callers that consume tokens on the device.
    pub fn address(&self) -> u64 {
        self.buffer.ptr().address()
    }
}

/// Per-row sampling parameters already in device memory: a decode loop that keeps them there
/// samples without any host-to-device copy (see [`super::CudaSampler::sample_rows_into`]).
pub struct DeviceRows {
    pub(crate) buffer: DeviceBuffer<RowParams>,
}

impl DeviceRows {
    /// Checks `params` and copies them to the device on `stream` (any cudarc stream; the
    /// buffer is allocated and freed on it).
    pub fn upload(stream: &Arc<CudaStream>, params: &[SamplingParams]) -> Result<DeviceRows> {
        let rows = batch_row_params(params)?;
        Ok(DeviceRows { buffer: DeviceBuffer::from_host(stream, &rows, "row parameters")? })
    }

    pub fn rows(&self) -> usize {
        self.buffer.len()
    }

    /// The device address of the first row's parameters (`[rows]` [`RowParams`]).
    pub fn address(&self) -> u64 {
        self.buffer.ptr().address()
    }

    /// Marks a read of the rows on `stream` for cudarc's event tracking (where the context has
    /// it): the upload is waited for, and the free waits for the read. Dropping the guard
    /// records the read; keep it until the work is queued.
    pub(crate) fn used_on<'a>(&'a self, stream: &'a Arc<CudaStream>) -> cudarc::driver::SyncOnDrop<'a> {
        self.buffer.bytes.device_ptr(stream).1
    }
}

/// Device buffers reused across calls; they only grow.
#[derive(Default)]
pub(crate) struct Workspace {
    pub row_params: Option<DeviceBuffer<RowParams>>,
    /// A call's scratch: its tensor maps and candidates, and on the materialised path its
    /// logits and terms (`StreamSampler::workspace_bytes`, `processed_workspace_bytes`).
    pub scratch: Option<DeviceBuffer<u8>>,
    /// The read probe's one-word sink.
    pub probe_sink: Option<DeviceBuffer<u32>>,
    /// The exchange buffer of vocabulary shards whose rows truncate
    /// (`StreamSampler::shard_exchange_bytes`).
    pub exchange: Option<DeviceBuffer<u8>>,
}

/// The buffer in `slot`, grown to at least `len` values first (contents not kept).
pub(crate) fn ensure<T: bytemuck::Pod>(
    stream: &Arc<CudaStream>,
    slot: &mut Option<DeviceBuffer<T>>,
    len: usize,
    what: &str,
) -> Result<DevicePtr<T>> {
    if slot.as_ref().is_none_or(|b| b.len() < len) {
        *slot = None;
        // SAFETY: every consumer writes before it reads (the tile kernel fills what the merge kernel reads).
        *slot = Some(unsafe { DeviceBuffer::uninitialized(stream, len, what)? });
    }
    Ok(slot.as_ref().expect("just ensured").ptr())
}
