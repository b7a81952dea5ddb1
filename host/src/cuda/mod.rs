//! The CUDA backend: a safe API over the checked layer in [`driver`].
//!
//! A [`CudaSampler`] owns the context, the module (the embedded PTX), one stream and a
//! grow-only workspace, so repeated calls allocate nothing and only `sample` (which returns
//! host tokens) waits for the device. Kernel errors that surface asynchronously are reported
//! by the next synchronising call with the kernel's name, by [`CudaSampler::close`], or, if
//! the sampler is just dropped, on standard error (never silently lost).

pub mod cublas;
pub mod driver;

use std::cell::RefCell;
use std::collections::HashMap;

use cust::context::{Context, CurrentContext};
use cust::device::{Device, DeviceAttribute};
use cust::memory::{CopyDestination, DeviceBuffer, DeviceCopy};
use cust::module::Module;
use cust::stream::{Stream, StreamFlags};
use cust::sys as raw;
use flashsample_core::abi::{
    EstimateErrorArgs, FillArgs, FusedArgs, HANDOFF_ROWS, LOGITS_SAMPLER_SHARED_BYTES, LOGITS_SAMPLER_TILE, LogitsArgs,
    LogitsSamplerArgs, N_TILE, REDUCE_SHARED_BYTES, REDUCE_THREADS, ReadProbeArgs, ReduceArgs, STAGE1_WARPS,
    TENSOR_MAP_BYTES, TILE_ROWS, TMA_HANDOFF_THREADS, TMA_K_BLOCK, TMA_THREADS, TmaArgs, fused_mma_shared_bytes,
    fused_simt_shared_bytes, tma_handoff_shared_bytes, tma_kernel_threads, tma_shared_bytes,
};
pub use flashsample_core::abi::{HANDOFF_COLUMNS, TMA_ITEM_ROWS};
use flashsample_core::{Candidate, RowParams};

use crate::error::{Error, Result, invalid};
use crate::module::{KERNELS, PTX};
use crate::params::{
    HeadShape, HiddenShape, SamplingParams, check_hidden_values, check_lm_head, check_request, check_request_shape,
    row_params,
};
use crate::tensor::{DType, Elements, Matrix};

/// Dynamic shared memory a kernel may use without opting in.
const STATIC_SHARED_LIMIT_BYTES: u32 = 48 << 10;

/// Candidate memory one pass may use; larger requests are split over rows and draws.
const CANDIDATE_BUDGET_BYTES: usize = 256 << 20;

/// Batch-tile widths of the register-direct mma kernels.
pub const MMA_COLUMNS: [u32; 3] = [8, 16, 32];
/// Batch-tile widths of the TMA + `wgmma` kernels.
pub const TMA_COLUMNS: [u32; 5] = [8, 16, 32, 64, 128];

/// Which stage-1 kernel computes the logits tile.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Variant {
    /// The dispatcher's choice for the dtype, D and B.
    Auto,
    /// Register-direct `mma.sync` tile with 8, 16 or 32 batch columns (BF16/F16, `D % 8 == 0`).
    Mma { columns: u32 },
    /// TMA + `wgmma` tile (sm_90) on items of `rows` (64: ping-pong warpgroups; 128: both
    /// warpgroups on one item) × `columns` (8, 16, 32, 64 or 128); BF16/F16, `D % 8 == 0`.
    Tma { rows: u32, columns: u32 },
    /// The cooperative TMA + `wgmma` tile on items of 128 rows × `columns` (64 or 128) whose
    /// sampling epilogue runs in warps of its own while the next item multiplies; BF16/F16,
    /// `D % 8 == 0`. The unfused pipeline runs `Tma { rows: 128, columns }` for it.
    TmaHandoff { columns: u32 },
    /// CUDA-core tile, any dtype and any D.
    Simt,
}

impl Variant {
    /// The variant for this problem: tensor cores when the dtype and D allow, then by B (from
    /// the forced variants of the benches, docs/PERF.md, sessions 3, 4 and 7):
    /// - B ≤ 32: the cooperative TMA tile (`Tma { rows: 128, columns }`) with the narrowest
    ///   width of 8, 16 and 32 that holds B (since `W` is streamed without L2 promotion, the
    ///   8-column tile is 0.3–2 % faster than the 16-column one at B ≤ 8, and the cooperative
    ///   32-column tile up to 3 % faster than the ping-pong one);
    /// - 32 < B ≤ 64: the handoff tile with 64 columns;
    /// - B > 64: the handoff tile with 128 columns, which stages each byte of `H` for 128 rows
    ///   of `W` and runs the sampling epilogue beside the next item's multiplies.
    pub fn resolve(self, dtype: DType, dim: usize, batch: usize) -> Result<Variant> {
        let tensor_cores = dtype != DType::F32 && dim.is_multiple_of(8);
        let needs_tensor_cores = |name: &str| {
            Err(invalid(
                "variant",
                format!("the {name} kernels need BF16 or F16 and D % 8 == 0 (got {dtype}, D = {dim})"),
            ))
        };
        match self {
            Variant::Auto if !tensor_cores => Ok(Variant::Simt),
            Variant::Auto if batch <= 8 => Ok(Variant::Tma { rows: 128, columns: 8 }),
            Variant::Auto if batch <= 16 => Ok(Variant::Tma { rows: 128, columns: 16 }),
            Variant::Auto if batch <= 32 => Ok(Variant::Tma { rows: 128, columns: 32 }),
            Variant::Auto if batch <= 64 => Ok(Variant::TmaHandoff { columns: 64 }),
            Variant::Auto => Ok(Variant::TmaHandoff { columns: 128 }),
            Variant::Mma { columns } if !MMA_COLUMNS.contains(&columns) => {
                Err(invalid("variant", format!("Mma {{ columns: {columns} }}: columns must be 8, 16 or 32")))
            }
            Variant::Tma { rows, columns } if !TMA_ITEM_ROWS.contains(&rows) || !TMA_COLUMNS.contains(&columns) => {
                Err(invalid(
                    "variant",
                    format!(
                        "Tma {{ rows: {rows}, columns: {columns} }}: rows must be 64 or 128, columns 8, 16, 32, 64 or 128"
                    ),
                ))
            }
            Variant::TmaHandoff { columns } if !HANDOFF_COLUMNS.contains(&columns) => {
                Err(invalid("variant", format!("TmaHandoff {{ columns: {columns} }}: columns must be 64 or 128")))
            }
            Variant::Mma { .. } if !tensor_cores => needs_tensor_cores("mma"),
            Variant::Tma { .. } | Variant::TmaHandoff { .. } if !tensor_cores => needs_tensor_cores("TMA"),
            other => Ok(other),
        }
    }

    /// Every tensor-core variant that can be forced: the mma widths, both TMA item heights at
    /// every width, then the handoff widths.
    pub fn tensor_core() -> impl Iterator<Item = Variant> {
        let mma = MMA_COLUMNS.map(|columns| Variant::Mma { columns });
        let tma = TMA_ITEM_ROWS.into_iter().flat_map(|rows| TMA_COLUMNS.map(|columns| Variant::Tma { rows, columns }));
        let handoff = HANDOFF_COLUMNS.map(|columns| Variant::TmaHandoff { columns });
        mma.into_iter().chain(tma).chain(handoff)
    }

    fn columns(self) -> u32 {
        match self {
            Variant::Mma { columns } | Variant::Tma { columns, .. } | Variant::TmaHandoff { columns } => columns,
            _ => N_TILE,
        }
    }

    /// Vocabulary rows per stage-1 work item (one candidate per row, draw and such tile).
    fn tile_rows(self) -> u32 {
        match self {
            Variant::Tma { rows, .. } => rows,
            Variant::TmaHandoff { .. } => HANDOFF_ROWS,
            _ => TILE_ROWS,
        }
    }

    /// The TMA boxes a TMA variant reads: (rows of `W`, rows of `H`).
    fn tma_boxes(self) -> Option<(u32, u32)> {
        match self {
            Variant::Tma { rows, columns } => Some((rows, columns)),
            Variant::TmaHandoff { columns } => Some((HANDOFF_ROWS, columns)),
            _ => None,
        }
    }
}

struct Kernel {
    function: raw::CUfunction,
    threads: u32,
    shared_bytes: u32,
    blocks_per_multiprocessor: u32,
}

fn launch_shape(name: &str) -> (u32, u32) {
    let stage1 = STAGE1_WARPS * 32;
    let columns = |name: &str| -> u32 {
        name.rsplit_once("_n").and_then(|(_, c)| c.parse().ok()).expect("kernel names end in _n<columns>")
    };
    if name.contains("_tma_") {
        if tma_kernel_threads(name) == TMA_HANDOFF_THREADS {
            return (TMA_HANDOFF_THREADS, tma_handoff_shared_bytes(columns(name)));
        }
        let rows = name.split("_m").nth(1).and_then(|r| r.split('_').next()).and_then(|r| r.parse().ok());
        return (TMA_THREADS, tma_shared_bytes(rows.expect("TMA kernel names hold _m<rows>_"), columns(name)));
    }
    if let Some(columns) = name.strip_prefix("fused_").and_then(|n| n.rsplit_once("_n")).map(|(_, c)| c) {
        return (stage1, fused_mma_shared_bytes(columns.parse().expect("kernel names end in _n<columns>")));
    }
    match name {
        n if n.starts_with("fused_simt_") => (stage1, fused_simt_shared_bytes()),
        n if n.starts_with("logits_gemm_") => (stage1, 0),
        "sample_logits" => (stage1, LOGITS_SAMPLER_SHARED_BYTES),
        "reduce_candidates" => (REDUCE_THREADS, REDUCE_SHARED_BYTES),
        _ => (256, 0),
    }
}

/// An LM head `W[V, D]` in device memory.
pub struct CudaLmHead {
    buffer: DeviceBuffer<u8>,
    shape: HeadShape,
    /// TMA descriptors, one per L2 promotion of `W_PROMOTIONS` and item height of
    /// `TMA_ITEM_ROWS` (boxes of that many rows), in that order, when the TMA kernels can
    /// read `W`.
    tensor_map: Option<DeviceBuffer<u64>>,
}

impl CudaLmHead {
    pub fn shape(&self) -> HeadShape {
        self.shape
    }

    fn address(&self) -> u64 {
        self.buffer.as_device_ptr().as_raw()
    }
}

/// Hidden states `H[B, D]` in device memory.
pub struct CudaHidden {
    buffer: DeviceBuffer<u8>,
    rows: usize,
    cols: usize,
    dtype: DType,
    /// One TMA descriptor per width of [`TMA_COLUMNS`] (boxes of that many rows, with that
    /// width's `l2_promotion`), when the TMA kernels can read `H`.
    tensor_maps: Option<DeviceBuffer<u64>>,
}

/// The L2 promotion of the TMA loads of a tile with `columns` batch columns. Up to 64
/// columns the tiles stream `W` from memory at the read bandwidth, and fetching only the
/// 128 bytes per row that a box asks for is faster: on the H200 the B ≤ 64 kernels ran
/// 1.7–3.1 % faster than with 256-byte promotion, and at B = 1, D = 8192 their L2 traffic fell
/// from 4.4 to 3.3 GB, what cuBLAS moves. The 128-column tiles keep the 256-byte promotion
/// (at B = 128 the two ran within −0.8 … +1.6 %); docs/PERF.md, session 7.
fn l2_promotion(columns: u32) -> driver::L2Promotion {
    if columns <= 64 { driver::L2Promotion::None } else { driver::L2Promotion::Bytes256 }
}

/// Both L2 promotions, in the order the `W` maps are stored (see [`tma_maps`]).
const W_PROMOTIONS: [driver::L2Promotion; 2] = [driver::L2Promotion::None, driver::L2Promotion::Bytes256];

/// TMA descriptors for a `[rows, cols]` matrix at `address`, one per (box height, L2
/// promotion), stored back to back in device memory; `None` when the TMA kernels cannot read
/// it (f32, or rows not a multiple of 16 bytes).
fn tensor_maps(
    what: &str,
    address: u64,
    rows: usize,
    cols: usize,
    dtype: DType,
    boxes: &[(u32, driver::L2Promotion)],
) -> Result<Option<DeviceBuffer<u64>>> {
    let element = match dtype {
        DType::BF16 => driver::TensorMapElement::Bf16,
        DType::F16 => driver::TensorMapElement::F16,
        DType::F32 => return Ok(None),
    };
    if !cols.is_multiple_of(8) {
        return Ok(None);
    }
    let mut words = Vec::with_capacity(boxes.len() * TENSOR_MAP_BYTES / 8);
    for &(height, promotion) in boxes {
        let map = driver::encode_tensor_map_2d(what, element, address, rows, cols, height, TMA_K_BLOCK, promotion)?;
        words.extend(map.0);
    }
    Ok(Some(driver::check(&format!("cuMemAlloc+cuMemcpyHtoD({what} tensor maps)"), DeviceBuffer::from_slice(&words))?))
}

fn missing_tensor_map(what: &str) -> Error {
    invalid(what, "no TMA descriptor: the TMA kernels need BF16 or F16 and D % 8 == 0")
}

impl CudaHidden {
    pub fn rows(&self) -> usize {
        self.rows
    }

    fn shape(&self) -> HiddenShape {
        HiddenShape { rows: self.rows, cols: self.cols, dtype: self.dtype }
    }
}

/// Sampled tokens in device memory, `[rows, samples]` of u32; `u32::MAX` marks a draw with
/// no finite score.
pub struct DeviceTokens {
    buffer: DeviceBuffer<u32>,
    pub rows: usize,
    pub samples: usize,
}

impl DeviceTokens {
    /// Allocates room for `rows × samples` tokens (filled by a later `sample_into`).
    pub fn new(sampler: &CudaSampler, rows: usize, samples: usize) -> Result<DeviceTokens> {
        sampler.make_current()?;
        let len = rows
            .checked_mul(samples)
            .filter(|&n| n <= u32::MAX as usize)
            .ok_or_else(|| invalid("samples", format!("B x samples = {rows} x {samples} tokens: must be < 2^32")))?;
        // SAFETY: stage 2 writes every slot before anyone reads it.
        let buffer = driver::check("cuMemAlloc(tokens)", unsafe { DeviceBuffer::<u32>::uninitialized(len.max(1)) })?;
        Ok(DeviceTokens { buffer, rows, samples })
    }

    /// Sets every slot to `value` (tests poison the output to see unwritten slots).
    pub fn fill(&mut self, sampler: &CudaSampler, value: u32) -> Result<()> {
        sampler.make_current()?;
        driver::check("cuMemsetD32(tokens)", self.buffer.set_32(value))
    }

    /// The device address of `tokens[0]`, for callers that consume tokens on the device.
    pub fn address(&self) -> u64 {
        self.buffer.as_device_ptr().as_raw()
    }
}

/// Per-row sampling parameters already in device memory: a decode loop that keeps them there
/// samples without any host-to-device copy (see [`CudaSampler::sample_rows_into`]).
pub struct DeviceRows {
    buffer: DeviceBuffer<u8>,
    rows: usize,
}

impl DeviceRows {
    pub fn rows(&self) -> usize {
        self.rows
    }

    fn address(&self) -> u64 {
        self.buffer.as_device_ptr().as_raw()
    }
}

/// Device buffers reused across calls; they only grow.
#[derive(Default)]
struct Workspace {
    rows: Option<DeviceBuffer<u8>>,
    candidates: Option<DeviceBuffer<u64>>,
    logits: Option<DeviceBuffer<f32>>,
}

fn ensure<T: DeviceCopy>(slot: &mut Option<DeviceBuffer<T>>, len: usize, what: &str) -> Result<u64> {
    if slot.as_ref().is_none_or(|b| b.len() < len) {
        *slot = None;
        // SAFETY: every consumer writes before it reads (stage 1 fills what stage 2 reads).
        let buffer = driver::check(&format!("cuMemAlloc({what}, {len} elements)"), unsafe {
            DeviceBuffer::uninitialized(len.max(1))
        })?;
        *slot = Some(buffer);
    }
    Ok(slot.as_ref().expect("just ensured").as_device_ptr().as_raw())
}

fn row_params_bytes(rows: &[RowParams]) -> &[u8] {
    // SAFETY: RowParams is #[repr(C)] of u64, u32, u32, f32, u32: 24 bytes without padding.
    unsafe { std::slice::from_raw_parts(rows.as_ptr().cast::<u8>(), std::mem::size_of_val(rows)) }
}

/// The fused sampler on one CUDA device.
pub struct CudaSampler {
    kernels: HashMap<&'static str, Kernel>,
    /// The entry point of every (stage, dtype, resolved variant), named once at start-up so
    /// a call does no formatting or search.
    stage1_names: HashMap<(Stage1, DType, Variant), &'static str>,
    workspace: RefCell<Workspace>,
    closed: bool,
    // Declared after everything that lives in the context, so they drop first.
    _module: Module,
    stream: Stream,
    context: Context,
    device_name: String,
    multiprocessors: u32,
}

impl CudaSampler {
    /// Creates a context on device 0 and loads the kernels. Without a driver or a device this
    /// is [`Error::NoCudaDevice`].
    pub fn new() -> Result<CudaSampler> {
        let no_device = |e: cust::error::CudaError| Error::NoCudaDevice(e.to_string());
        cust::init(cust::CudaFlags::empty()).map_err(no_device)?;
        if cust::device::Device::num_devices().map_err(no_device)? == 0 {
            return Err(Error::NoCudaDevice("the driver reports no device".into()));
        }
        let device = Device::get_device(0).map_err(no_device)?;
        let context = driver::check("cuCtxCreate", Context::new(device))?;
        let module = driver::check("cuModuleLoadData(embedded PTX)", Module::from_ptx(PTX, &[]))?;
        let stream = driver::check("cuStreamCreate", Stream::new(StreamFlags::NON_BLOCKING, None))?;
        let device_name = driver::check("cuDeviceGetName", device.name())?;
        let multiprocessors = driver::check(
            "cuDeviceGetAttribute(MultiprocessorCount)",
            device.get_attribute(DeviceAttribute::MultiprocessorCount),
        )? as u32;
        let mut kernels = HashMap::new();
        for &name in KERNELS {
            let function = driver::check(&format!("cuModuleGetFunction({name})"), module.get_function(name))?.to_raw();
            let (threads, shared_bytes) = launch_shape(name);
            // SAFETY: `function` was just taken from the module we hold.
            let blocks_per_multiprocessor = unsafe {
                if shared_bytes > STATIC_SHARED_LIMIT_BYTES {
                    driver::allow_dynamic_shared_memory(name, function, shared_bytes)?;
                }
                driver::blocks_per_multiprocessor(name, function, threads, shared_bytes)?
            };
            kernels.insert(name, Kernel { function, threads, shared_bytes, blocks_per_multiprocessor });
        }
        Ok(CudaSampler {
            kernels,
            stage1_names: stage1_names(),
            workspace: RefCell::default(),
            closed: false,
            _module: module,
            stream,
            context,
            device_name,
            multiprocessors,
        })
    }

    pub fn device_name(&self) -> &str {
        &self.device_name
    }

    pub fn multiprocessors(&self) -> u32 {
        self.multiprocessors
    }

    /// The raw stream all work is queued on (for event timing).
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    fn make_current(&self) -> Result<()> {
        driver::check("cuCtxSetCurrent", CurrentContext::set_current(&self.context))
    }

    /// Launches `name` over `items` work items with a persistent grid (at most one wave).
    ///
    /// # Safety
    /// `args` must be the kernel's argument block with valid device addresses.
    unsafe fn launch<A>(&self, name: &'static str, items: u64, args: &A) -> Result<()> {
        let kernel = &self.kernels[name];
        let resident = kernel.blocks_per_multiprocessor as u64 * self.multiprocessors as u64;
        let grid = items.clamp(1, resident) as u32;
        // SAFETY: per this function's contract; threads and shared memory come from launch_shape.
        unsafe {
            driver::launch(
                name,
                kernel.function,
                self.stream.as_inner(),
                grid,
                kernel.threads,
                kernel.shared_bytes,
                args,
            )
        }
    }

    /// Waits for all queued work; a kernel fault is reported as failing `after`.
    pub fn synchronize(&self, after: &str) -> Result<()> {
        driver::check(&format!("cuStreamSynchronize (after {after})"), self.stream.synchronize())
    }

    /// Uploads and checks an LM head (non-empty, `V < 2³¹`, finite).
    pub fn upload_lm_head(&self, lm_head: &Matrix) -> Result<CudaLmHead> {
        let shape = check_lm_head(lm_head)?;
        self.make_current()?;
        let buffer =
            driver::check("cuMemAlloc+cuMemcpyHtoD(lm_head)", DeviceBuffer::from_slice(lm_head.elements().as_bytes()))?;
        self.lm_head_from(buffer, shape)
    }

    /// Uploads hidden states, checked finite.
    pub fn upload_hidden(&self, hidden: &Matrix) -> Result<CudaHidden> {
        check_hidden_values(hidden)?;
        self.make_current()?;
        let buffer =
            driver::check("cuMemAlloc+cuMemcpyHtoD(hidden)", DeviceBuffer::from_slice(hidden.elements().as_bytes()))?;
        self.hidden_from(buffer, hidden.rows(), hidden.cols(), hidden.dtype())
    }

    /// `samples` draws per row with the dispatcher's kernel, tokens returned to the host.
    pub fn sample(
        &self,
        lm_head: &CudaLmHead,
        hidden: &Matrix,
        params: &[SamplingParams],
        samples: u32,
    ) -> Result<Vec<u32>> {
        self.sample_with(lm_head, hidden, params, samples, Variant::Auto)
    }

    /// As [`CudaSampler::sample`] with an explicit stage-1 variant.
    pub fn sample_with(
        &self,
        lm_head: &CudaLmHead,
        hidden: &Matrix,
        params: &[SamplingParams],
        samples: u32,
        variant: Variant,
    ) -> Result<Vec<u32>> {
        check_request(lm_head.shape, hidden.shape(), params, samples)?;
        let hidden = self.upload_hidden(hidden)?;
        let tokens = self.sample_on_device(lm_head, &hidden, params, samples, variant)?;
        self.tokens_to_host(&tokens)
    }

    /// Queues fused sampling and returns the tokens in device memory without waiting.
    pub fn sample_on_device(
        &self,
        lm_head: &CudaLmHead,
        hidden: &CudaHidden,
        params: &[SamplingParams],
        samples: u32,
        variant: Variant,
    ) -> Result<DeviceTokens> {
        let mut tokens = DeviceTokens::new(self, hidden.rows, samples as usize)?;
        self.sample_into(lm_head, hidden, params, samples, variant, &mut tokens)?;
        Ok(tokens)
    }

    /// Queues fused sampling into `tokens` (`[B, samples]`); allocates nothing once the
    /// workspace has grown to the problem, and never waits for the device. The row
    /// parameters are copied to the device on the stream first; a loop that keeps them on
    /// the device calls [`CudaSampler::sample_rows_into`] instead.
    pub fn sample_into(
        &self,
        lm_head: &CudaLmHead,
        hidden: &CudaHidden,
        params: &[SamplingParams],
        samples: u32,
        variant: Variant,
        tokens: &mut DeviceTokens,
    ) -> Result<()> {
        let rows = self.check_device_request(lm_head, hidden, params, samples)?;
        let rows = self.stage_rows(&rows)?;
        self.sample_at(lm_head, hidden, rows, samples, variant, tokens)
    }

    /// Checks per-row parameters and copies them to the device once.
    pub fn upload_rows(&self, params: &[SamplingParams]) -> Result<DeviceRows> {
        let rows = row_params(params)?;
        if rows.is_empty() {
            return Err(invalid("params", "no entries: one per batch row is needed"));
        }
        self.make_current()?;
        let buffer = driver::check(
            "cuMemAlloc+cuMemcpyHtoD(row parameters)",
            DeviceBuffer::from_slice(row_params_bytes(&rows)),
        )?;
        Ok(DeviceRows { buffer, rows: rows.len() })
    }

    /// As [`CudaSampler::sample_into`] with row parameters already on the device: the call
    /// queues kernels only, no copy.
    pub fn sample_rows_into(
        &self,
        lm_head: &CudaLmHead,
        hidden: &CudaHidden,
        rows: &DeviceRows,
        samples: u32,
        variant: Variant,
        tokens: &mut DeviceTokens,
    ) -> Result<()> {
        self.check_device_rows(lm_head, hidden, rows, samples)?;
        self.sample_at(lm_head, hidden, rows.address(), samples, variant, tokens)
    }

    fn sample_at(
        &self,
        lm_head: &CudaLmHead,
        hidden: &CudaHidden,
        rows: u64,
        samples: u32,
        variant: Variant,
        tokens: &mut DeviceTokens,
    ) -> Result<()> {
        let shape = lm_head.shape;
        let variant = variant.resolve(shape.dtype, shape.dim, hidden.rows)?;
        let tiles = shape.vocab.div_ceil(variant.tile_rows() as usize);
        let name = self.stage1_names[&(Stage1::Fused, shape.dtype, variant)];
        let maps = match variant.tma_boxes() {
            Some((rows, columns)) => Some(tma_maps(lm_head, hidden, rows, columns)?),
            None => None,
        };
        self.run_passes(hidden, rows, samples, tiles, tokens, |pass| {
            let items = tiles as u64 * pass.batch.div_ceil(variant.columns()) as u64;
            if let Some((lm_head_map, hidden_map)) = maps {
                let args = TmaArgs {
                    lm_head_map,
                    hidden_map,
                    rows: pass.rows,
                    out: pass.candidates,
                    vocab: shape.vocab as u32,
                    dim: shape.dim as u32,
                    batch: pass.batch,
                    hidden_row0: pass.first_row as u32,
                    sample_offset: pass.sample_offset,
                    samples: pass.samples,
                    tiles: tiles as u32,
                    logits_stride: 0,
                };
                // SAFETY: the maps describe live buffers; the others are sized for this pass.
                return unsafe { self.launch(name, items, &args) };
            }
            let args = FusedArgs {
                lm_head: lm_head.address(),
                hidden: pass.hidden,
                rows: pass.rows,
                candidates: pass.candidates,
                vocab: shape.vocab as u32,
                dim: shape.dim as u32,
                batch: pass.batch,
                sample_offset: pass.sample_offset,
                samples: pass.samples,
                tiles: tiles as u32,
            };
            // SAFETY: the addresses come from live buffers sized for this pass.
            unsafe { self.launch(name, items, &args) }
        })
    }

    /// The unfused pipeline on the same inputs: a GEMM (the tile of `variant`, an mma or TMA
    /// one) writes f32 logits `[B, V]`, a sampler reads them back. The logits are bit-identical
    /// to the fused kernel's of the same variant, so are the tokens.
    pub fn sample_unfused_into(
        &self,
        lm_head: &CudaLmHead,
        hidden: &CudaHidden,
        rows: &DeviceRows,
        samples: u32,
        variant: Variant,
        tokens: &mut DeviceTokens,
    ) -> Result<()> {
        self.check_device_rows(lm_head, hidden, rows, samples)?;
        let shape = lm_head.shape;
        let variant = match variant.resolve(shape.dtype, shape.dim, hidden.rows)? {
            Variant::Simt => {
                return Err(invalid(
                    "variant",
                    "the unfused pipeline has mma and TMA GEMMs only (BF16/F16, D % 8 == 0)",
                ));
            }
            other => other,
        };
        let stride = shape.vocab.next_multiple_of(4);
        let logits = ensure(&mut self.workspace.borrow_mut().logits, hidden.rows * stride, "logits")?;
        let name = self.stage1_names[&(Stage1::Logits, shape.dtype, variant)];
        let gemm_tiles = shape.vocab.div_ceil(variant.tile_rows() as usize);
        let items = gemm_tiles as u64 * hidden.rows.div_ceil(variant.columns() as usize) as u64;
        if let Some((rows, columns)) = variant.tma_boxes() {
            let (lm_head_map, hidden_map) = tma_maps(lm_head, hidden, rows, columns)?;
            let gemm = TmaArgs {
                lm_head_map,
                hidden_map,
                rows: 0,
                out: logits,
                vocab: shape.vocab as u32,
                dim: shape.dim as u32,
                batch: hidden.rows as u32,
                hidden_row0: 0,
                sample_offset: 0,
                samples: 0,
                tiles: gemm_tiles as u32,
                logits_stride: stride as u32,
            };
            // SAFETY: the logits buffer holds B × stride floats; the maps describe live buffers.
            unsafe { self.launch(name, items, &gemm)? };
        } else {
            let gemm = LogitsArgs {
                lm_head: lm_head.address(),
                hidden: hidden.buffer.as_device_ptr().as_raw(),
                logits,
                vocab: shape.vocab as u32,
                dim: shape.dim as u32,
                batch: hidden.rows as u32,
                logits_stride: stride as u32,
            };
            // SAFETY: the logits buffer holds B × stride floats.
            unsafe { self.launch(name, items, &gemm)? };
        }
        let tiles = shape.vocab.div_ceil(LOGITS_SAMPLER_TILE as usize);
        self.run_passes(hidden, rows.address(), samples, tiles, tokens, |pass| {
            let args = LogitsSamplerArgs {
                logits: logits + pass.first_row as u64 * stride as u64 * 4,
                rows: pass.rows,
                candidates: pass.candidates,
                vocab: shape.vocab as u32,
                logits_stride: stride as u32,
                batch: pass.batch,
                sample_offset: pass.sample_offset,
                samples: pass.samples,
                tiles: tiles as u32,
            };
            // SAFETY: as above.
            unsafe { self.launch("sample_logits", tiles as u64 * pass.batch as u64, &args) }
        })
    }

    fn check_device_request(
        &self,
        lm_head: &CudaLmHead,
        hidden: &CudaHidden,
        params: &[SamplingParams],
        samples: u32,
    ) -> Result<Vec<RowParams>> {
        let rows = check_request(lm_head.shape, hidden.shape(), params, samples)?;
        self.make_current()?;
        Ok(rows)
    }

    fn check_device_rows(
        &self,
        lm_head: &CudaLmHead,
        hidden: &CudaHidden,
        rows: &DeviceRows,
        samples: u32,
    ) -> Result<()> {
        check_request_shape(lm_head.shape, hidden.shape(), rows.rows, "rows", samples)?;
        self.make_current()
    }

    /// Copies row parameters into the workspace, ordered on the stream; returns their address.
    fn stage_rows(&self, rows: &[RowParams]) -> Result<u64> {
        let address = ensure(&mut self.workspace.borrow_mut().rows, std::mem::size_of_val(rows), "row parameters")?;
        // SAFETY: the rows buffer holds at least this many bytes; the copy is ordered on our stream.
        unsafe { driver::copy_to_device_async(address, row_params_bytes(rows), self.stream.as_inner())? };
        Ok(address)
    }

    /// Splits (rows × draws) into passes whose candidates fit the budget, runs `stage1` for
    /// each, then stage 2 into one `[B, samples]` token buffer.
    fn run_passes(
        &self,
        hidden: &CudaHidden,
        rows_address: u64,
        samples: u32,
        tiles: usize,
        tokens: &mut DeviceTokens,
        mut stage1: impl FnMut(&Pass) -> Result<()>,
    ) -> Result<()> {
        let batch = hidden.rows;
        if tokens.rows != batch || tokens.samples != samples as usize {
            return Err(invalid(
                "tokens",
                format!(
                    "room for [{}, {}] tokens, the request makes [{batch}, {samples}]",
                    tokens.rows, tokens.samples
                ),
            ));
        }
        let pairs_per_pass = (CANDIDATE_BUDGET_BYTES / (tiles * 8)).max(1);
        let rows_per_pass = batch.min(pairs_per_pass);
        let samples_per_pass = (samples as usize).min((pairs_per_pass / rows_per_pass).max(1));
        let candidates = ensure(
            &mut self.workspace.borrow_mut().candidates,
            rows_per_pass * samples_per_pass * tiles,
            "candidates",
        )?;
        let element_bytes = hidden.dtype.bytes() as u64;
        for first_row in (0..batch).step_by(rows_per_pass) {
            let pass_rows = rows_per_pass.min(batch - first_row);
            for first_sample in (0..samples as usize).step_by(samples_per_pass) {
                let pass_samples = samples_per_pass.min(samples as usize - first_sample);
                let pass = Pass {
                    first_row,
                    hidden: hidden.buffer.as_device_ptr().as_raw() + (first_row * hidden.cols) as u64 * element_bytes,
                    rows: rows_address + (first_row * std::mem::size_of::<RowParams>()) as u64,
                    candidates,
                    batch: pass_rows as u32,
                    sample_offset: first_sample as u32,
                    samples: pass_samples as u32,
                };
                stage1(&pass)?;
                let reduce = ReduceArgs {
                    candidates,
                    tokens: tokens.address() + (first_row * samples as usize * 4) as u64,
                    batch: pass.batch,
                    samples: pass.samples,
                    tiles: tiles as u32,
                    sample_offset: pass.sample_offset,
                    token_stride: samples,
                };
                // SAFETY: candidates hold batch × samples × tiles entries written by stage 1.
                unsafe { self.launch("reduce_candidates", pass_rows as u64 * pass_samples as u64, &reduce)? };
            }
        }
        Ok(())
    }

    /// Fills the candidate and logits workspaces with a candidate that wins every merge
    /// (score +inf, index [`CudaSampler::POISON_INDEX`], not a token). A stage-1 kernel that leaves a slot
    /// unwritten then shows up as that index in the tokens: tests call this before sampling.
    pub fn poison_workspace(&self) -> Result<()> {
        self.make_current()?;
        self.synchronize("work before poisoning")?;
        let poison = ((Self::POISON_INDEX as u64) << 32) | f32::INFINITY.to_bits() as u64;
        let mut workspace = self.workspace.borrow_mut();
        if let Some(candidates) = workspace.candidates.as_mut() {
            let host = vec![poison; candidates.len()];
            driver::check("cuMemcpyHtoD(poison candidates)", candidates.copy_from(&host[..]))?;
        }
        if let Some(logits) = workspace.logits.as_mut() {
            driver::check("cuMemsetD32(poison logits)", logits.set_32(f32::INFINITY.to_bits()))?;
        }
        Ok(())
    }

    /// The poison index of [`CudaSampler::poison_workspace`].
    pub const POISON_INDEX: u32 = 0x7fff_fff0;

    /// Waits for the tokens and copies them to the host; a draw without a token is
    /// [`Error::NoToken`].
    pub fn tokens_to_host(&self, tokens: &DeviceTokens) -> Result<Vec<u32>> {
        self.synchronize("sampling")?;
        let host = driver::check("cuMemcpyDtoH(tokens)", tokens.buffer.as_host_vec())?;
        if let Some(at) = host.iter().position(|&t| t == Candidate::NONE.index) {
            return Err(Error::NoToken { row: at / tokens.samples, draw: at % tokens.samples });
        }
        Ok(host)
    }

    /// An LM head of uniform values in `[-scale, scale)` made on the device (benchmarks, demo).
    pub fn random_lm_head(&self, vocab: usize, dim: usize, dtype: DType, seed: u64, scale: f32) -> Result<CudaLmHead> {
        let buffer = self.random_buffer(vocab * dim, dtype, seed, scale)?;
        self.lm_head_from(buffer, HeadShape { vocab, dim, dtype })
    }

    /// Hidden states of uniform values made on the device.
    pub fn random_hidden(&self, rows: usize, cols: usize, dtype: DType, seed: u64, scale: f32) -> Result<CudaHidden> {
        let buffer = self.random_buffer(rows * cols, dtype, seed, scale)?;
        self.hidden_from(buffer, rows, cols, dtype)
    }

    fn lm_head_from(&self, buffer: DeviceBuffer<u8>, shape: HeadShape) -> Result<CudaLmHead> {
        let address = buffer.as_device_ptr().as_raw();
        let boxes: Vec<_> =
            W_PROMOTIONS.iter().flat_map(|&promotion| TMA_ITEM_ROWS.map(|rows| (rows, promotion))).collect();
        let tensor_map = tensor_maps("lm_head", address, shape.vocab, shape.dim, shape.dtype, &boxes)?;
        Ok(CudaLmHead { buffer, shape, tensor_map })
    }

    fn hidden_from(&self, buffer: DeviceBuffer<u8>, rows: usize, cols: usize, dtype: DType) -> Result<CudaHidden> {
        let address = buffer.as_device_ptr().as_raw();
        let boxes = TMA_COLUMNS.map(|columns| (columns, l2_promotion(columns)));
        let tensor_maps = tensor_maps("hidden", address, rows, cols, dtype, &boxes)?;
        Ok(CudaHidden { buffer, rows, cols, dtype, tensor_maps })
    }

    fn random_buffer(&self, count: usize, dtype: DType, seed: u64, scale: f32) -> Result<DeviceBuffer<u8>> {
        self.make_current()?;
        // SAFETY: the fill kernel writes every element before anything reads it.
        let buffer =
            driver::check("cuMemAlloc(random)", unsafe { DeviceBuffer::<u8>::uninitialized(count * dtype.bytes()) })?;
        let args = FillArgs { out: buffer.as_device_ptr().as_raw(), count: count as u64, seed, scale };
        let name = match dtype {
            DType::F32 => "fill_uniform_f32",
            DType::F16 => "fill_uniform_f16",
            DType::BF16 => "fill_uniform_bf16",
        };
        // SAFETY: the buffer holds `count` elements of `dtype`.
        unsafe { self.launch(name, count.div_ceil(4 * 256) as u64, &args)? };
        Ok(buffer)
    }

    /// Copies a device LM head back (the demo checks the GPU against the CPU on it).
    pub fn lm_head_to_host(&self, lm_head: &CudaLmHead) -> Result<Matrix> {
        self.synchronize("making the LM head")?;
        let bytes = driver::check("cuMemcpyDtoH(lm_head)", lm_head.buffer.as_host_vec())?;
        let elements = elements_from_bytes(&bytes, lm_head.shape.dtype);
        Matrix::new("lm_head", lm_head.shape.vocab, lm_head.shape.dim, elements)
    }

    /// Copies device hidden states back.
    pub fn hidden_to_host(&self, hidden: &CudaHidden) -> Result<Matrix> {
        self.synchronize("making the hidden states")?;
        let bytes = driver::check("cuMemcpyDtoH(hidden)", hidden.buffer.as_host_vec())?;
        Matrix::new("hidden", hidden.rows, hidden.cols, elements_from_bytes(&bytes, hidden.dtype))
    }

    /// Queues one pass of 16-byte loads over the LM head's bytes: the read-bandwidth floor.
    pub fn read_probe(&self, lm_head: &CudaLmHead, sink: &DeviceBuffer<u32>) -> Result<()> {
        let bytes = (lm_head.buffer.len() / 64 * 64) as u64;
        let args = ReadProbeArgs { source: lm_head.address(), bytes, sink: sink.as_device_ptr().as_raw() };
        // SAFETY: `bytes` is within the buffer; the sink holds one u32.
        unsafe { self.launch("read_probe", u64::MAX, &args) }
    }

    /// The largest `|gumbel_estimate(x) − gumbel(x)|` over all 2³² words `x`, computed on this
    /// device with its `lg2.approx`: what the fused kernels' filter assumes is at most
    /// [`flashsample_core::estimate::GUMBEL_ESTIMATE_ERROR`].
    pub fn gumbel_estimate_max_error(&self) -> Result<f32> {
        self.make_current()?;
        let out = driver::check("cuMemAlloc+cuMemcpyHtoD(estimate error)", DeviceBuffer::from_slice(&[0u32]))?;
        let args = EstimateErrorArgs { out: out.as_device_ptr().as_raw() };
        // SAFETY: `out` is one zeroed u32.
        unsafe { self.launch("gumbel_estimate_error", u64::MAX, &args)? };
        self.synchronize("gumbel_estimate_error")?;
        let bits = driver::check("cuMemcpyDtoH(estimate error)", out.as_host_vec())?;
        Ok(f32::from_bits(bits[0]))
    }

    /// Waits for outstanding work and reports any error it left; the sampler is then gone.
    pub fn close(mut self) -> Result<()> {
        self.closed = true;
        self.make_current()?;
        self.synchronize("all queued work")
    }
}

impl Drop for CudaSampler {
    fn drop(&mut self) {
        if !self.closed {
            let result = self.make_current().and_then(|_| self.synchronize("all queued work"));
            if let Err(e) = result {
                eprintln!("flashsample: error while dropping CudaSampler: {e}");
            }
        }
    }
}

struct Pass {
    first_row: usize,
    hidden: u64,
    rows: u64,
    candidates: u64,
    batch: u32,
    sample_offset: u32,
    samples: u32,
}

fn elements_from_bytes(bytes: &[u8], dtype: DType) -> Elements {
    match dtype {
        DType::F32 => Elements::F32(bytemuck::pod_collect_to_vec(bytes)),
        DType::F16 => Elements::F16(bytemuck::pod_collect_to_vec(bytes)),
        DType::BF16 => Elements::BF16(bytemuck::pod_collect_to_vec(bytes)),
    }
}

/// The device addresses of `W`'s tensor map for `rows`-row boxes and of `H`'s map for
/// `columns`-row boxes.
fn tma_maps(lm_head: &CudaLmHead, hidden: &CudaHidden, rows: u32, columns: u32) -> Result<(u64, u64)> {
    let lm_head_maps = lm_head.tensor_map.as_ref().ok_or_else(|| missing_tensor_map("lm_head"))?;
    let hidden_maps = hidden.tensor_maps.as_ref().ok_or_else(|| missing_tensor_map("hidden"))?;
    let row_index = TMA_ITEM_ROWS.iter().position(|&r| r == rows).expect("Variant::resolve checked the height");
    let column_index = TMA_COLUMNS.iter().position(|&c| c == columns).expect("Variant::resolve checked the width");
    let promotion_index =
        W_PROMOTIONS.iter().position(|&p| p == l2_promotion(columns)).expect("W_PROMOTIONS lists every promotion");
    let lm_head_index = promotion_index * TMA_ITEM_ROWS.len() + row_index;
    Ok((
        lm_head_maps.as_device_ptr().as_raw() + (lm_head_index * TENSOR_MAP_BYTES) as u64,
        hidden_maps.as_device_ptr().as_raw() + (column_index * TENSOR_MAP_BYTES) as u64,
    ))
}

/// What a stage-1 kernel writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Stage1 {
    /// Candidates (fused sampling).
    Fused,
    /// f32 logits (the unfused pipeline's GEMM).
    Logits,
}

/// The entry point that runs `variant` for `dtype`, as named in `kernels/src/lib.rs`. Only
/// resolved variants come here; the unfused pipeline has no SIMT or f32 GEMM.
fn kernel_name(stage: Stage1, dtype: DType, variant: Variant) -> &'static str {
    let element = match dtype {
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        DType::F32 => "f32",
    };
    let name = match (stage, variant) {
        (Stage1::Fused, Variant::Simt) => format!("fused_simt_{element}"),
        (Stage1::Fused, Variant::Mma { columns }) => format!("fused_{element}_n{columns}"),
        (Stage1::Logits, Variant::Mma { columns }) => format!("logits_gemm_{element}_n{columns}"),
        (Stage1::Fused, Variant::Tma { rows, columns }) => format!("fused_tma_{element}_m{rows}_n{columns}"),
        (Stage1::Logits, Variant::Tma { rows, columns }) => format!("logits_tma_{element}_m{rows}_n{columns}"),
        (Stage1::Fused, Variant::TmaHandoff { columns }) => format!("fused_tma_{element}_h{HANDOFF_ROWS}_n{columns}"),
        (Stage1::Logits, Variant::TmaHandoff { columns }) => format!("logits_tma_{element}_m{HANDOFF_ROWS}_n{columns}"),
        (_, other) => unreachable!("{stage:?} kernel for an unresolved or unsupported variant {other:?}"),
    };
    KERNELS.iter().copied().find(|&k| k == name).unwrap_or_else(|| unreachable!("{name} is not in KERNELS"))
}

/// Names every stage-1 kernel a resolved variant can launch (see [`kernel_name`]).
fn stage1_names() -> HashMap<(Stage1, DType, Variant), &'static str> {
    let simt = [DType::F32, DType::BF16, DType::F16].map(|dtype| (Stage1::Fused, dtype, Variant::Simt));
    let tensor_core = [DType::BF16, DType::F16].into_iter().flat_map(|dtype| {
        Variant::tensor_core()
            .flat_map(move |variant| [(Stage1::Fused, dtype, variant), (Stage1::Logits, dtype, variant)])
    });
    simt.into_iter().chain(tensor_core).map(|key| (key, kernel_name(key.0, key.1, key.2))).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every TMA kernel's dynamic shared memory fits one block of an sm_90 multiprocessor, with
    /// at least two stages so that loads overlap multiplies (a launch asking for more fails).
    #[test]
    fn tma_kernels_fit_in_shared_memory_with_two_stages() {
        use flashsample_core::abi::{SM90_SHARED_LIMIT_BYTES, tma_handoff_stages, tma_stages};
        for rows in TMA_ITEM_ROWS {
            for columns in TMA_COLUMNS {
                assert!(tma_shared_bytes(rows, columns) <= SM90_SHARED_LIMIT_BYTES, "Tma {{ {rows}, {columns} }}");
                assert!(tma_stages(rows, columns) >= 2, "Tma {{ {rows}, {columns} }}");
            }
        }
        for columns in HANDOFF_COLUMNS {
            assert!(tma_handoff_shared_bytes(columns) <= SM90_SHARED_LIMIT_BYTES, "TmaHandoff {{ {columns} }}");
            assert!(tma_handoff_stages(columns) >= 2, "TmaHandoff {{ {columns} }}");
        }
    }

    /// Every name the dispatcher can launch is one the sampler loads (and the PTX holds).
    #[test]
    fn dispatched_kernel_names_are_loaded_kernels() {
        let names = stage1_names();
        for dtype in [DType::BF16, DType::F16] {
            for variant in Variant::tensor_core() {
                assert!(KERNELS.contains(&names[&(Stage1::Fused, dtype, variant)]));
                assert!(KERNELS.contains(&names[&(Stage1::Logits, dtype, variant)]));
            }
        }
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            assert!(KERNELS.contains(&names[&(Stage1::Fused, dtype, Variant::Simt)]));
        }
        for batch in [1, 8, 9, 16, 17, 64, 65, 128, 129, 1024] {
            let variant = Variant::Auto.resolve(DType::BF16, 4096, batch).unwrap();
            assert!(KERNELS.contains(&names[&(Stage1::Fused, DType::BF16, variant)]), "B = {batch}");
        }
    }
}
