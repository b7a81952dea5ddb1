//! The candle adapter (feature `candle`): tokens drawn from candle tensors, on candle's device
//! and candle's stream, returned as a candle tensor that stays where it was made.
//!
//! On a CUDA device the adapter is borrowed mode ([`crate::StreamSampler`]) with candle's
//! handles: the kernels are loaded in the device's context and queued on `CudaDevice`'s stream
//! (candle 0.11 queues every op on it), so they run after the op that wrote the hidden states
//! and before whatever candle frees next on that stream. Per-row parameters live on the device,
//! and [`CandleSampler::advance_steps`] moves the decode step there. On the CPU the adapter
//! runs [`crate::CpuSampler`], the exact twin.
//!
//! candle's `Device::new_cuda` queues on the per-thread default stream, which is the calling
//! thread's own: call the sampler from the thread that runs the model (as candle's own ops
//! must be), or its work is not ordered after the model's.

use std::sync::Arc;

use candle_core::cuda_backend::{CudaDType, CudaStorage};
use candle_core::op::BackpropOp;
use candle_core::{Device, Storage, Tensor};
use cudarc::driver::{CudaStream, DevicePtr as _, DevicePtrMut as _};
use flashsample_core::NO_TOKEN;
use flashsample_core::process::MAX_TOP_LOGPROBS;

use crate::cuda::{
    DeviceMatrix, DeviceProcessing, DeviceRows, ModuleChoice, ProcessedRequest, ProcessedTarget, StreamSampler,
    StreamWorkspace, Variant,
};
use crate::error::{Error, Result, invalid};
use crate::params::{Draws, SamplingParams, batch_row_params};
use crate::process::Processing;
use crate::tensor::{DType, Elements, Matrix};
use crate::{CpuLmHead, CpuSampler};

/// What [`CandleSampler::sample_with_logprobs`] returns, on the sampler's device.
pub struct CandleSampled {
    /// `[B, N]` u32 tokens (a row without a token holds its status's sentinel).
    pub tokens: Tensor,
    /// `[B, N]` f32: each token's log-probability under the raw logits.
    pub logprobs: Tensor,
    /// `[B, N]` f32: each token's log-probability under the distribution it was drawn from.
    pub processed_logprobs: Tensor,
    /// `[B, MAX_TOP_LOGPROBS, 2]` u32: per row its top raw entries (as many as its
    /// `Processing::top_logprobs`) as (token, bits of the f32 log-probability), by decreasing
    /// log-probability; the other slots hold `NO_TOKEN` and −∞.
    pub top_logprobs: Tensor,
}

/// Tokens, and with log-probabilities the `[2, B, N]` log-probabilities and the top ones.
type Outputs = (Tensor, Option<(Tensor, Tensor)>);

/// A sampler a generation loop keeps: one device, one set of per-row parameters and, if set,
/// the rows' logit processing.
pub struct CandleSampler {
    device: Device,
    params: Vec<SamplingParams>,
    /// Per-row processing, empty for none.
    processing: Vec<Processing>,
    variant: Variant,
    cuda: Option<CudaState>,
}

/// What the adapter holds on a CUDA device.
struct CudaState {
    kernels: StreamSampler,
    stream: Arc<CudaStream>,
    rows: DeviceRows,
    /// The processing on the device for the vocabulary it was checked against.
    processing: Option<(usize, DeviceProcessing)>,
    workspace: StreamWorkspace,
}

impl Drop for CudaState {
    /// The kernels are unloaded after the drop; work queued on candle's stream that still uses
    /// them must finish first.
    fn drop(&mut self) {
        if let Err(e) = self.stream.synchronize() {
            eprintln!("flashsample: waiting for candle's stream before unloading the kernels failed: {e}");
        }
    }
}

fn candle_error(call: &str, error: candle_core::Error) -> Error {
    Error::Framework { call: call.to_string(), detail: error.to_string() }
}

/// The library's dtype of a candle dtype the kernels read.
fn dtype(what: &str, dtype: candle_core::DType) -> Result<DType> {
    match dtype {
        candle_core::DType::BF16 => Ok(DType::BF16),
        candle_core::DType::F16 => Ok(DType::F16),
        candle_core::DType::F32 => Ok(DType::F32),
        other => Err(invalid(what, format!("dtype {other:?}: must be bf16, f16 or f32"))),
    }
}

/// A 2-D tensor seen as rows of contiguous elements.
struct Rows {
    rows: usize,
    cols: usize,
    /// Elements from one row to the next.
    row_stride: usize,
    /// The first element's index in the storage.
    first: usize,
}

impl Rows {
    /// The matrix in a storage whose element 0 is at device address `base`.
    fn at(&self, base: u64, dtype: DType) -> DeviceMatrix {
        let address = base + (self.first * dtype.bytes()) as u64;
        DeviceMatrix { address, rows: self.rows, cols: self.cols, row_stride: self.row_stride, dtype }
    }
}

/// A 2-D tensor's layout as [`Rows`]; views whose rows are not contiguous are refused.
fn rows_of(what: &str, tensor: &Tensor) -> Result<Rows> {
    let (rows, cols) = tensor.dims2().map_err(|e| invalid(what, format!("{e}: must be a 2-D tensor")))?;
    let layout = tensor.layout();
    let stride = layout.stride();
    if cols > 1 && stride[1] != 1 {
        return Err(invalid(
            what,
            format!("a view with strides {stride:?}: each row's elements must be contiguous (call .contiguous())"),
        ));
    }
    let row_stride = if rows > 1 { stride[0] } else { cols };
    Ok(Rows { rows, cols, row_stride, first: layout.start_offset() })
}

impl CandleSampler {
    /// A sampler for tensors on `device` with one entry of `params` per batch row.
    pub fn new(device: &Device, params: &[SamplingParams]) -> Result<CandleSampler> {
        batch_row_params(params)?;
        let cuda = match device {
            Device::Cuda(cuda) => {
                let stream = cuda.cuda_stream();
                let kernels = StreamSampler::on_context(stream.context(), ModuleChoice::from_environment()?)?;
                let rows = DeviceRows::upload(&stream, params)?;
                Some(CudaState { kernels, stream, rows, processing: None, workspace: StreamWorkspace::new() })
            }
            Device::Cpu => None,
            other => {
                return Err(invalid("device", format!("{other:?}: the adapter samples on CUDA devices and the CPU")));
            }
        };
        Ok(CandleSampler {
            device: device.clone(),
            params: params.to_vec(),
            processing: Vec::new(),
            variant: Variant::Auto,
            cuda,
        })
    }

    /// The same sampler with a forced tile variant (CUDA only; tests and benchmarks).
    pub fn with_variant(mut self, variant: Variant) -> CandleSampler {
        self.variant = variant;
        self
    }

    /// The per-row parameters, with the steps advanced so far.
    pub fn params(&self) -> &[SamplingParams] {
        &self.params
    }

    /// The module the kernels come from (`None` on the CPU).
    pub fn module(&self) -> Option<crate::Module> {
        self.cuda.as_ref().map(|cuda| cuda.kernels.module())
    }

    /// Replaces the per-row parameters (copied to the device on candle's stream).
    pub fn set_params(&mut self, params: &[SamplingParams]) -> Result<()> {
        batch_row_params(params)?;
        if let Some(cuda) = self.cuda.as_mut() {
            cuda.rows = DeviceRows::upload(&cuda.stream, params)?;
        }
        self.params = params.to_vec();
        Ok(())
    }

    /// Sets each row's logit processing (`processing[b]` for row `b`; an empty slice for none),
    /// checked against the vocabulary at the next `sample`. Every mode runs on either device:
    /// on CUDA through [`StreamSampler::sample_processed`] on candle's stream (the parameters
    /// go to the device once per vocabulary; soft-cap, bias, mask and penalties alone stay in
    /// the fused tiles, min-p, top-k and top-p materialise the logits in the workspace), on
    /// the CPU through [`CpuSampler::sample_processed`]. Rows that ask for top
    /// log-probabilities need [`CandleSampler::sample_with_logprobs`].
    pub fn set_processing(&mut self, processing: &[Processing]) -> Result<()> {
        if !processing.is_empty() && processing.len() != self.params.len() {
            return Err(invalid(
                "processing",
                format!("{} entries for {} rows of parameters: one per row", processing.len(), self.params.len()),
            ));
        }
        if let Some(cuda) = self.cuda.as_mut() {
            cuda.processing = None;
        }
        self.processing = processing.to_vec();
        Ok(())
    }

    /// Adds `by` to every row's decode step, so the next call draws fresh noise. On a CUDA
    /// device a kernel on candle's stream does it: nothing is copied.
    pub fn advance_steps(&mut self, by: u32) -> Result<()> {
        for p in &mut self.params {
            p.step = p.step.wrapping_add(by);
        }
        if let Some(cuda) = &self.cuda {
            // SAFETY: the row parameters live on candle's stream, the kernels in its context.
            unsafe {
                cuda.kernels.advance_steps(
                    cuda.stream.cu_stream().cast(),
                    cuda.rows.address(),
                    self.params.len(),
                    by,
                )?
            };
        }
        Ok(())
    }

    /// `samples` draws per row from `softmax(hidden · lm_headᵀ / T)`: `hidden` `[B, D]` and
    /// `lm_head` `[V, D]` of one dtype (bf16, f16 or f32; views with contiguous rows are read
    /// in place), on this sampler's device. Returns `[B, samples]` u32 tokens on that device;
    /// on a CUDA device the call only queues work on candle's stream. Every slot of a row
    /// without a token (non-finite logits, or nothing allowed) holds its status's sentinel
    /// ([`crate::RowStatus::of_token`] reads it), on either device.
    pub fn sample(&mut self, hidden: &Tensor, lm_head: &Tensor, samples: u32) -> Result<Tensor> {
        Ok(self.sample_outputs(hidden, lm_head, samples, false)?.0)
    }

    /// As [`CandleSampler::sample`], with each token's raw and processed log-probabilities and
    /// each row's top raw log-probabilities (with or without processing; on CUDA the logits are
    /// then materialised in the workspace: `B · V` floats, or twice that with truncations).
    pub fn sample_with_logprobs(&mut self, hidden: &Tensor, lm_head: &Tensor, samples: u32) -> Result<CandleSampled> {
        let (tokens, logprobs) = self.sample_outputs(hidden, lm_head, samples, true)?;
        let (values, top_logprobs) = logprobs.expect("log-probabilities were asked for");
        let half = |i: usize| values.get(i).map_err(|e| candle_error("Tensor::get", e));
        Ok(CandleSampled { tokens, logprobs: half(0)?, processed_logprobs: half(1)?, top_logprobs })
    }

    fn sample_outputs(&mut self, hidden: &Tensor, lm_head: &Tensor, samples: u32, logprobs: bool) -> Result<Outputs> {
        let (h_dtype, w_dtype) = (dtype("hidden", hidden.dtype())?, dtype("lm_head", lm_head.dtype())?);
        if h_dtype != w_dtype {
            return Err(Error::DTypeMismatch { lm_head: w_dtype, hidden: h_dtype });
        }
        for (what, tensor) in [("hidden", hidden), ("lm_head", lm_head)] {
            if !tensor.device().same_device(&self.device) {
                return Err(invalid(
                    what,
                    format!("on {:?}, the sampler's device is {:?}", tensor.device(), self.device),
                ));
            }
        }
        let batch = rows_of("hidden", hidden)?.rows;
        if batch != self.params.len() {
            return Err(invalid("hidden", format!("B = {batch} rows for {} rows of parameters", self.params.len())));
        }
        match h_dtype {
            DType::BF16 => self.sample_typed::<half::bf16>(hidden, lm_head, samples, h_dtype, logprobs),
            DType::F16 => self.sample_typed::<half::f16>(hidden, lm_head, samples, h_dtype, logprobs),
            DType::F32 => self.sample_typed::<f32>(hidden, lm_head, samples, h_dtype, logprobs),
        }
    }

    fn sample_typed<T>(
        &mut self,
        hidden: &Tensor,
        lm_head: &Tensor,
        samples: u32,
        dtype: DType,
        logprobs: bool,
    ) -> Result<Outputs>
    where
        T: CudaDType + cudarc::driver::DeviceRepr + candle_core::WithDType,
    {
        let Some(cuda) = self.cuda.as_mut() else {
            let processing = &self.processing;
            return sample_on_cpu::<T>(hidden, lm_head, &self.params, processing, samples, dtype, logprobs);
        };
        let hidden_rows = rows_of("hidden", hidden)?;
        let lm_head_rows = rows_of("lm_head", lm_head)?;
        let batch = hidden_rows.rows;
        let stream = &cuda.stream;
        let (h_storage, _) = hidden.storage_and_layout();
        let (w_storage, _) = lm_head.storage_and_layout();
        let (h_slice, w_slice) = (cuda_slice::<T>("hidden", &h_storage)?, cuda_slice::<T>("lm_head", &w_storage)?);
        let (h_base, _h_use) = h_slice.device_ptr(stream);
        let (w_base, _w_use) = w_slice.device_ptr(stream);
        let vocab = lm_head_rows.rows;
        // Plain rows are the default processing: the plan runs them as plain fused sampling.
        if cuda.processing.as_ref().is_none_or(|(v, p)| *v != vocab || p.on_device().rows != batch) {
            let processing = match self.processing.is_empty() {
                true => vec![Processing::default(); batch],
                false => self.processing.clone(),
            };
            cuda.processing = Some((vocab, DeviceProcessing::upload(stream, &processing, vocab)?));
        }
        let processing = cuda.processing.as_ref().expect("just made").1.on_device();
        let count = Draws::first(samples).check()?.count as usize;
        if batch.checked_mul(count).is_none_or(|n| n > u32::MAX as usize) {
            return Err(invalid("samples", format!("B x samples = {batch} x {count} tokens: must be < 2^32")));
        }
        let mut tokens = allocate::<u32>(stream, batch * count, "tokens")?;
        let mut values =
            logprobs.then(|| allocate::<f32>(stream, 2 * batch * count, "log-probabilities")).transpose()?;
        let top_len = batch * MAX_TOP_LOGPROBS as usize * 2;
        let mut top = logprobs.then(|| allocate::<u32>(stream, top_len, "top log-probabilities")).transpose()?;
        let (t_base, t_use) = tokens.device_ptr_mut(stream);
        let values_use = values.as_mut().map(|v| v.device_ptr_mut(stream));
        let top_use = top.as_mut().map(|t| t.device_ptr_mut(stream));
        let request = ProcessedRequest {
            lm_head: lm_head_rows.at(w_base, dtype),
            hidden: hidden_rows.at(h_base, dtype),
            row_params: cuda.rows.address(),
            draws: Draws::first(samples),
            variant: self.variant,
            processing,
            target: ProcessedTarget::Tokens {
                tokens: t_base,
                logprobs: values_use.as_ref().map_or(0, |u| u.0),
                top_logprobs: top_use.as_ref().map_or(0, |u| u.0),
            },
        };
        let plan = cuda.kernels.plan_processed(&request)?;
        let workspace = cuda.workspace.ensure(stream, plan.workspace_bytes())?;
        // SAFETY: the tensors' storages are read-locked and live through the call, and candle
        // frees on this same stream, after this work; the views' extents were checked by
        // `rows_of` against candle's layouts; the processing, outputs and workspace are this
        // stream's, sized for the request.
        unsafe { cuda.kernels.sample_processed_planned(stream.cu_stream(), &request, &plan, workspace)? };
        drop((t_use, values_use, top_use));
        let device = self.device.as_cuda_device().map_err(|e| candle_error("as_cuda_device", e))?.clone();
        let tokens = wrap(tokens, &device, &[batch, count]);
        let outputs = values.zip(top).map(|(values, top)| {
            (wrap(values, &device, &[2, batch, count]), wrap(top, &device, &[batch, MAX_TOP_LOGPROBS as usize, 2]))
        });
        Ok((tokens, outputs))
    }
}

/// `len` uninitialised values on `stream` (the kernels write every one before it is read).
fn allocate<T: cudarc::driver::DeviceRepr>(
    stream: &Arc<CudaStream>,
    len: usize,
    what: &str,
) -> Result<cudarc::driver::CudaSlice<T>> {
    // SAFETY: the merge kernel writes every slot before anything reads it.
    let slice = unsafe { stream.alloc::<T>(len) };
    crate::cuda::driver::check(&format!("cuMemAllocAsync({what})"), slice)
}

/// A cudarc buffer as a candle tensor of `shape` on `device`.
fn wrap<T: CudaDType + cudarc::driver::DeviceRepr>(
    slice: cudarc::driver::CudaSlice<T>,
    device: &candle_core::CudaDevice,
    shape: &[usize],
) -> Tensor {
    let storage = Storage::Cuda(CudaStorage::wrap_cuda_slice(slice, device.clone()));
    Tensor::from_storage(storage, shape, BackpropOp::none(), false)
}

/// The cudarc buffer under a candle storage.
fn cuda_slice<'a, T: CudaDType>(what: &str, storage: &'a Storage) -> Result<&'a cudarc::driver::CudaSlice<T>> {
    match storage {
        Storage::Cuda(storage) => storage.as_cuda_slice::<T>().map_err(|e| candle_error(what, e)),
        _ => Err(invalid(what, "not in CUDA memory")),
    }
}

fn to_matrix<T: candle_core::WithDType>(what: &str, tensor: &Tensor, dtype: DType) -> Result<Matrix> {
    let (rows, cols) = tensor.dims2().map_err(|e| candle_error(what, e))?;
    let flat = tensor.flatten_all().and_then(|t| t.to_vec1::<T>()).map_err(|e| candle_error(what, e))?;
    let values: Vec<f64> = flat.iter().map(|v| v.to_f64()).collect();
    let elements = match dtype {
        DType::BF16 => Elements::BF16(values.iter().map(|&v| half::bf16::from_f64(v)).collect()),
        DType::F16 => Elements::F16(values.iter().map(|&v| half::f16::from_f64(v)).collect()),
        DType::F32 => Elements::F32(values.iter().map(|&v| v as f32).collect()),
    };
    Matrix::new(what, rows, cols, elements)
}

fn sample_on_cpu<T: candle_core::WithDType>(
    hidden: &Tensor,
    lm_head: &Tensor,
    params: &[SamplingParams],
    processing: &[Processing],
    samples: u32,
    dtype: DType,
    logprobs: bool,
) -> Result<Outputs> {
    let h = to_matrix::<T>("hidden", hidden, dtype)?;
    let w = to_matrix::<T>("lm_head", lm_head, dtype)?;
    let (sampler, head) = (CpuSampler::new(), CpuLmHead::new(w)?);
    let cpu_tensor = |result: candle_core::Result<Tensor>| result.map_err(|e| candle_error("Tensor::from_vec", e));
    let (rows, count) = (h.rows(), samples as usize);
    if processing.is_empty() && !logprobs {
        // Like the device path, a row without a token keeps its status sentinel in the tensor.
        let tokens = match sampler.sample(&head, &h, params, samples) {
            Ok(tokens) | Err(Error::RowsWithoutToken { tokens, .. }) => tokens,
            Err(e) => return Err(e),
        };
        return Ok((cpu_tensor(Tensor::from_vec(tokens, (rows, count), &Device::Cpu))?, None));
    }
    let plain;
    let processing = match processing.is_empty() {
        true => {
            plain = vec![Processing::default(); rows];
            &plain
        }
        false => processing,
    };
    let sampled = sampler.sample_processed(&head, &h, params, processing, Draws::first(samples))?;
    let tokens = cpu_tensor(Tensor::from_vec(sampled.tokens, (rows, count), &Device::Cpu))?;
    if !logprobs {
        return Ok((tokens, None));
    }
    let values = [sampled.logprobs, sampled.processed_logprobs].concat();
    let mut top = Vec::with_capacity(rows * MAX_TOP_LOGPROBS as usize * 2);
    for row in &sampled.top_logprobs {
        let padding = std::iter::repeat((NO_TOKEN, f32::NEG_INFINITY)).take(MAX_TOP_LOGPROBS as usize - row.len());
        top.extend(row.iter().copied().chain(padding).flat_map(|(token, lp)| [token, lp.to_bits()]));
    }
    let values = cpu_tensor(Tensor::from_vec(values, (2, rows, count), &Device::Cpu))?;
    let top = cpu_tensor(Tensor::from_vec(top, (rows, MAX_TOP_LOGPROBS as usize, 2), &Device::Cpu))?;
    Ok((tokens, Some((values, top))))
}
