//! The candle adapter (feature `candle`; CUDA tensors with `candle-cuda`): tokens drawn from
//! candle tensors, on candle's device and candle's stream, returned as candle tensors that
//! stay where they were made. Built and tested with candle 0.11 (`>= 0.11.1, < 0.12`).
//!
//! On a CUDA device the adapter is borrowed mode ([`crate::StreamSampler::enqueue_on`]) with
//! candle's handles: the kernels are loaded in the device's context and queued on
//! `CudaDevice`'s stream (candle 0.11 queues every op on it), so they run after the op that
//! wrote the hidden states and before whatever candle frees next on that stream. The batch
//! lives on the device, and [`CandleSampler::advance_steps`] moves the decode step there. On
//! the CPU the adapter runs [`crate::CpuSampler`], the exact twin.
//!
//! candle's `Device::new_cuda` queues on the per-thread default stream, which is the calling
//! thread's own: call the sampler from the thread that runs the model (as candle's own ops
//! must be), or its work is not ordered after the model's.

use candle_core::{Device, Tensor};
use flashsample_core::NO_TOKEN;
use flashsample_core::process::MAX_TOP_LOGPROBS;

use crate::batch::Batch;
use crate::cpu::CpuSampler;
use crate::error::{Error, Result, invalid};
use crate::params::Draws;
use crate::sampled::Sampled;
use crate::sampler::Sampler;
use crate::tensor::{DType, Elements, Matrix};

/// What [`CandleSampler::sample`] returns, on the sampler's device.
pub struct CandleSampled {
    /// `[B, N]` u32 tokens (a row without a token holds its status's sentinel,
    /// [`crate::RowStatus::of_token`]).
    pub tokens: Tensor,
    /// `[B, N]` f32: each token's log-probability under the raw logits; when the batch
    /// reports log-probabilities.
    pub logprobs: Option<Tensor>,
    /// `[B, N]` f32: each token's log-probability under the distribution it was drawn from;
    /// with `logprobs`.
    pub processed_logprobs: Option<Tensor>,
    /// `[B, MAX_TOP_LOGPROBS, 2]` u32: per row its top raw entries (as many as its
    /// `Processing::top_logprobs`) as (token, bits of the f32 log-probability), by decreasing
    /// log-probability; the other slots hold `NO_TOKEN` and −∞. With `logprobs`.
    pub top_logprobs: Option<Tensor>,
    /// `[S]` u32: with a verification batch ([`Batch::verify`]), how many drafts each of its
    /// `S` sequences keeps; its tokens are those of its first `accepted + 1` rows.
    pub accepted: Option<Tensor>,
}

/// A sampler a generation loop keeps: one device and one batch (each row's parameters and
/// processing).
///
/// ```
/// use candle_core::{Device, Tensor};
/// use flashsample::{Batch, CandleSampler, SamplingParams};
/// let device = Device::Cpu;
/// let lm_head = Tensor::randn(0f32, 1.0, (100, 16), &device)?;
/// let hidden = Tensor::randn(0f32, 1.0, (2, 16), &device)?;
/// let batch = Batch::new((0..2).map(|r| SamplingParams::new(0.8, 5, r, 0)).collect());
/// let mut sampler = CandleSampler::new(&device, &batch)?;
/// let next = sampler.sample(&lm_head, &hidden, 1)?.tokens; // [2, 1] u32
/// sampler.advance_steps(1)?;
/// assert_eq!(next.dims(), &[2, 1]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct CandleSampler {
    device: Device,
    /// The batch, with the steps advanced so far.
    batch: Batch,
    #[cfg(feature = "candle-cuda")]
    cuda: Option<cuda::CudaState>,
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

impl CandleSampler {
    /// A sampler for tensors on `device` (the CPU, or with feature `candle-cuda` a CUDA
    /// device) drawing each row with its parameters and processing from `batch`.
    pub fn new(device: &Device, batch: &Batch) -> Result<CandleSampler> {
        crate::params::row_params(&batch.params)?;
        #[cfg(feature = "candle-cuda")]
        let cuda = match device {
            Device::Cuda(device) => Some(cuda::CudaState::new(device)?),
            _ => None,
        };
        match device {
            Device::Cpu => {}
            #[cfg(feature = "candle-cuda")]
            Device::Cuda(_) => {}
            other => {
                return Err(invalid(
                    "device",
                    format!(
                        "{other:?}: the adapter samples on the CPU{}",
                        if cfg!(feature = "candle-cuda") {
                            " and CUDA devices"
                        } else {
                            " (CUDA needs feature candle-cuda)"
                        }
                    ),
                ));
            }
        }
        Ok(CandleSampler {
            device: device.clone(),
            batch: batch.clone(),
            #[cfg(feature = "candle-cuda")]
            cuda,
        })
    }

    /// Makes every later call run the tile `variant` (CUDA only; tests and benchmarks).
    #[cfg(all(feature = "candle-cuda", feature = "internals"))]
    pub fn set_variant(&mut self, variant: crate::cuda::Variant) {
        if let Some(cuda) = self.cuda.as_mut() {
            cuda.variant = variant;
        }
    }

    /// The batch, with the steps advanced so far.
    pub fn batch(&self) -> &Batch {
        &self.batch
    }

    /// The module the kernels come from (`None` on the CPU).
    pub fn module(&self) -> Option<crate::Module> {
        #[cfg(feature = "candle-cuda")]
        if let Some(cuda) = &self.cuda {
            return Some(cuda.kernels.module());
        }
        None
    }

    /// Replaces the batch (its rows and processing), checked at the next `sample` against the
    /// vocabulary; on a CUDA device it goes to the device then.
    pub fn set_batch(&mut self, batch: &Batch) -> Result<()> {
        crate::params::row_params(&batch.params)?;
        self.batch = batch.clone();
        #[cfg(feature = "candle-cuda")]
        if let Some(cuda) = self.cuda.as_mut() {
            cuda.batch = None;
        }
        Ok(())
    }

    /// Adds `by` to every row's decode step, so the next call draws fresh noise. On a CUDA
    /// device a kernel on candle's stream does it: nothing is copied.
    pub fn advance_steps(&mut self, by: u32) -> Result<()> {
        for p in &mut self.batch.params {
            p.step = p.step.wrapping_add(by);
        }
        #[cfg(feature = "candle-cuda")]
        if let Some(cuda) = self.cuda.as_mut() {
            cuda.advance_steps(by)?;
        }
        Ok(())
    }

    /// `draws` draws per row from the row's processed `softmax(hidden · lm_headᵀ / T)`:
    /// `lm_head` `[V, D]` and `hidden` `[B, D]` of one dtype (bf16, f16 or f32; views with
    /// contiguous rows are read in place on CUDA), on this sampler's device. Returns `[B,
    /// draws]` u32 tokens on that device, with the log-probabilities when the batch reports
    /// them; on a CUDA device the call only queues work on candle's stream. Every slot of a row
    /// without a token (non-finite logits, or nothing allowed) holds its status's sentinel, on
    /// either device.
    pub fn sample(&mut self, lm_head: &Tensor, hidden: &Tensor, draws: u32) -> Result<CandleSampled> {
        let (w_dtype, h_dtype) = (dtype("lm_head", lm_head.dtype())?, dtype("hidden", hidden.dtype())?);
        if h_dtype != w_dtype {
            return Err(Error::DTypeMismatch { lm_head: w_dtype, hidden: h_dtype });
        }
        for (what, tensor) in [("lm_head", lm_head), ("hidden", hidden)] {
            if !tensor.device().same_device(&self.device) {
                return Err(invalid(
                    what,
                    format!("on {:?}, the sampler's device is {:?}", tensor.device(), self.device),
                ));
            }
        }
        let (batch, _) = hidden.dims2().map_err(|e| invalid("hidden", format!("{e}: must be a 2-D tensor")))?;
        if batch != self.batch.rows() {
            return Err(invalid("hidden", format!("B = {batch} rows for a batch of {} rows", self.batch.rows())));
        }
        #[cfg(feature = "candle-cuda")]
        if let Some(cuda) = self.cuda.as_mut() {
            return cuda.sample(&self.batch, lm_head, hidden, w_dtype, draws);
        }
        self.sample_on_cpu(lm_head, hidden, w_dtype, draws)
    }

    fn sample_on_cpu(&self, lm_head: &Tensor, hidden: &Tensor, dtype: DType, draws: u32) -> Result<CandleSampled> {
        let w = to_matrix("lm_head", lm_head, dtype)?;
        let h = to_matrix("hidden", hidden, dtype)?;
        let sampler = CpuSampler::new();
        let head = sampler.upload_lm_head(&w)?;
        // Like the device path, a row without a token keeps its status sentinel in the tensor.
        let sampled = match sampler.sample(&head, &h, &self.batch, Draws::first(draws)) {
            Ok(sampled) => sampled,
            Err(Error::RowsWithoutToken { sampled, .. }) => *sampled,
            Err(e) => return Err(e),
        };
        let (rows, count) = (h.rows(), draws as usize);
        let cpu = |result: candle_core::Result<Tensor>| result.map_err(|e| candle_error("Tensor::from_vec", e));
        let Sampled { tokens, logprobs, processed_logprobs, top_logprobs, verdicts, .. } = sampled;
        let tokens = cpu(Tensor::from_vec(tokens, (rows, count), &Device::Cpu))?;
        let accepted = match verdicts.len() {
            0 => None,
            sequences => {
                let counts = verdicts.iter().map(|verdict| verdict.accepted).collect();
                Some(cpu(Tensor::from_vec(counts, sequences, &Device::Cpu))?)
            }
        };
        if logprobs.is_empty() {
            return Ok(CandleSampled {
                tokens,
                logprobs: None,
                processed_logprobs: None,
                top_logprobs: None,
                accepted,
            });
        }
        let mut top = Vec::with_capacity(rows * MAX_TOP_LOGPROBS as usize * 2);
        for row in &top_logprobs {
            let padding = std::iter::repeat_n((NO_TOKEN, f32::NEG_INFINITY), MAX_TOP_LOGPROBS as usize - row.len());
            top.extend(row.iter().copied().chain(padding).flat_map(|(token, lp)| [token, lp.to_bits()]));
        }
        Ok(CandleSampled {
            tokens,
            logprobs: Some(cpu(Tensor::from_vec(logprobs, (rows, count), &Device::Cpu))?),
            processed_logprobs: Some(cpu(Tensor::from_vec(processed_logprobs, (rows, count), &Device::Cpu))?),
            top_logprobs: Some(cpu(Tensor::from_vec(top, (rows, MAX_TOP_LOGPROBS as usize, 2), &Device::Cpu))?),
            accepted,
        })
    }
}

/// A 2-D tensor's values as a host matrix of `dtype`.
fn to_matrix(what: &str, tensor: &Tensor, dtype: DType) -> Result<Matrix> {
    let (rows, cols) = tensor.dims2().map_err(|e| candle_error(what, e))?;
    let flat = tensor.flatten_all().map_err(|e| candle_error(what, e))?;
    let elements = match dtype {
        DType::BF16 => Elements::BF16(flat.to_vec1::<half::bf16>().map_err(|e| candle_error(what, e))?),
        DType::F16 => Elements::F16(flat.to_vec1::<half::f16>().map_err(|e| candle_error(what, e))?),
        DType::F32 => Elements::F32(flat.to_vec1::<f32>().map_err(|e| candle_error(what, e))?),
    };
    Matrix::new(what, rows, cols, elements)
}

/// The adapter on candle's CUDA devices: borrowed mode on candle's stream.
#[cfg(feature = "candle-cuda")]
mod cuda {
    use std::sync::Arc;

    use candle_core::cuda_backend::{CudaDType, CudaStorage};
    use candle_core::op::BackpropOp;
    use candle_core::{Storage, Tensor};
    use cudarc::driver::CudaStream;
    use flashsample_core::process::MAX_TOP_LOGPROBS;

    use super::{CandleSampled, candle_error};
    use crate::batch::Batch;
    #[cfg(feature = "internals")]
    use crate::cuda::Variant;
    use crate::cuda::{
        DeviceBatch, DeviceElement, DeviceMatrix, ModuleChoice, OutputSlice, Request, StreamSampler, StreamWorkspace,
        Target,
    };
    use crate::error::{Result, invalid};
    use crate::params::Draws;
    use crate::tensor::DType;

    /// What the adapter holds on a CUDA device.
    pub(super) struct CudaState {
        pub kernels: StreamSampler,
        device: candle_core::CudaDevice,
        stream: Arc<CudaStream>,
        /// The batch on the device, for the vocabulary it was checked against.
        pub batch: Option<(usize, DeviceBatch)>,
        workspace: StreamWorkspace,
        /// The tile every call runs (`Auto`: the dispatcher's).
        #[cfg(feature = "internals")]
        pub variant: Variant,
    }

    impl Drop for CudaState {
        /// The kernels are unloaded after the drop; work queued on candle's stream that still
        /// uses them must finish first.
        fn drop(&mut self) {
            if let Err(e) = self.stream.synchronize() {
                eprintln!("flashsample: waiting for candle's stream before unloading the kernels failed: {e}");
            }
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

    /// The cudarc buffer under a candle storage.
    fn cuda_slice<'a, T: CudaDType>(what: &str, storage: &'a Storage) -> Result<&'a cudarc::driver::CudaSlice<T>> {
        match storage {
            Storage::Cuda(storage) => storage.as_cuda_slice::<T>().map_err(|e| candle_error(what, e)),
            _ => Err(invalid(what, "not in CUDA memory")),
        }
    }

    /// `len` uninitialised values on `stream` (the kernels write every one before it is read).
    fn allocate<T: cudarc::driver::DeviceRepr>(
        stream: &Arc<CudaStream>,
        len: usize,
        what: &str,
    ) -> Result<cudarc::driver::CudaSlice<T>> {
        // SAFETY: the kernels write every slot before anything reads it.
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

    impl CudaState {
        pub fn new(device: &candle_core::CudaDevice) -> Result<CudaState> {
            let stream = device.cuda_stream();
            let kernels = StreamSampler::on_context(stream.context(), ModuleChoice::from_environment()?)?;
            Ok(CudaState {
                kernels,
                device: device.clone(),
                stream,
                batch: None,
                workspace: StreamWorkspace::new(),
                #[cfg(feature = "internals")]
                variant: Variant::Auto,
            })
        }

        /// Moves the device batch's steps (if it is uploaded yet) on candle's stream.
        pub fn advance_steps(&mut self, by: u32) -> Result<()> {
            match self.batch.as_mut() {
                Some((_, batch)) => self.kernels.advance_steps_on(&self.stream, batch, by),
                None => Ok(()),
            }
        }

        pub fn sample(
            &mut self,
            batch: &Batch,
            lm_head: &Tensor,
            hidden: &Tensor,
            dtype: DType,
            draws: u32,
        ) -> Result<CandleSampled> {
            match dtype {
                DType::BF16 => self.sample_typed::<half::bf16>(batch, lm_head, hidden, draws),
                DType::F16 => self.sample_typed::<half::f16>(batch, lm_head, hidden, draws),
                DType::F32 => self.sample_typed::<f32>(batch, lm_head, hidden, draws),
            }
        }

        fn sample_typed<T: CudaDType + DeviceElement>(
            &mut self,
            batch: &Batch,
            lm_head: &Tensor,
            hidden: &Tensor,
            draws: u32,
        ) -> Result<CandleSampled> {
            let (w_rows, h_rows) = (rows_of("lm_head", lm_head)?, rows_of("hidden", hidden)?);
            let (vocab, rows) = (w_rows.rows, h_rows.rows);
            let count = Draws::first(draws).check()?.count as usize;
            crate::params::check_token_count(rows, draws)?;
            if self.batch.as_ref().is_none_or(|(v, _)| *v != vocab) {
                self.batch = Some((vocab, DeviceBatch::upload(&self.stream, batch, vocab)?));
            }
            let on_device = &self.batch.as_ref().expect("just uploaded").1;
            let logprobs = on_device.reports_logprobs();
            let stream = &self.stream;
            let mut tokens = allocate::<u32>(stream, rows * count, "tokens")?;
            let mut values =
                logprobs.then(|| allocate::<f32>(stream, 2 * rows * count, "log-probabilities")).transpose()?;
            let top_len = crate::cuda::Target::top_logprobs_len(rows);
            let mut top = logprobs.then(|| allocate::<u32>(stream, top_len, "top log-probabilities")).transpose()?;
            let sequences = on_device.verified_sequences();
            let mut accepted = (sequences > 0).then(|| allocate::<u32>(stream, sequences, "verdicts")).transpose()?;
            {
                let (h_storage, _) = hidden.storage_and_layout();
                let (w_storage, _) = lm_head.storage_and_layout();
                let (h, w) = (cuda_slice::<T>("hidden", &h_storage)?, cuda_slice::<T>("lm_head", &w_storage)?);
                let request = Request {
                    lm_head: DeviceMatrix::of_rows(w, stream, w_rows.first, vocab, w_rows.cols, w_rows.row_stride)?,
                    hidden: DeviceMatrix::of_rows(h, stream, h_rows.first, rows, h_rows.cols, h_rows.row_stride)?,
                    batch: on_device.view(stream),
                    draws: Draws::first(draws),
                    shard: None,
                };
                let target = Target {
                    tokens: OutputSlice::of_slice(&mut tokens, stream),
                    logprobs: values.as_mut().map(|v| OutputSlice::of_slice(v, stream)),
                    top_logprobs: top.as_mut().map(|t| OutputSlice::of_slice(t, stream)),
                    parts: None,
                    accepted: accepted.as_mut().map(|a| OutputSlice::of_slice(a, stream)),
                };
                // The tensors' storages stay read-locked through the call, and candle frees on
                // this same stream, after this work.
                #[cfg(feature = "internals")]
                self.kernels.enqueue_on_with_variant(stream, &request, &target, &mut self.workspace, self.variant)?;
                #[cfg(not(feature = "internals"))]
                self.kernels.enqueue_on(stream, &request, &target, &mut self.workspace)?;
            }
            let device = &self.device;
            let split = |values: cudarc::driver::CudaSlice<f32>| -> Result<(Tensor, Tensor)> {
                let both = wrap(values, device, &[2, rows, count]);
                let half = |i: usize| both.get(i).map_err(|e| candle_error("Tensor::get", e));
                Ok((half(0)?, half(1)?))
            };
            let (logprobs, processed_logprobs) = match values.map(split).transpose()? {
                Some((raw, processed)) => (Some(raw), Some(processed)),
                None => (None, None),
            };
            Ok(CandleSampled {
                tokens: wrap(tokens, device, &[rows, count]),
                logprobs,
                processed_logprobs,
                top_logprobs: top.map(|t| wrap(t, device, &[rows, MAX_TOP_LOGPROBS as usize, 2])),
                accepted: accepted.map(|a| wrap(a, device, &[sequences])),
            })
        }
    }
}
