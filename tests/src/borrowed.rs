//! Borrowed mode as a [`Backend`]: the caller's context, stream and memory. One shard runs
//! through the safe layer ([`StreamSampler::enqueue_on`]) on cudarc slices; several shards
//! run through the raw layer ([`StreamSampler::enqueue`]) segment by segment, with the
//! exchanges between the segments made on the host, as an engine's own collective would make
//! them. Workspaces and outputs are poisoned first.

use std::sync::Arc;

use flashsample::cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr as _};
use flashsample::{
    Batch, DeviceBatch, DeviceMatrix, DeviceWorkspace, Draws, Elements, Exchange, Matrix, ModuleChoice, OutputSlice,
    Request, Result, Sampled, Shard, StreamSampler, StreamWorkspace, Target, Verdict, VocabShard,
};

use crate::{Backend, UNWRITTEN, check_written, with_row_statuses};

/// Borrowed mode on a stream of device 0's primary context, with the kernels loaded there.
pub struct Borrowed {
    pub kernels: StreamSampler,
    pub stream: Arc<CudaStream>,
}

impl Borrowed {
    pub fn new() -> Borrowed {
        let context = CudaContext::new(0).expect("these tests need a CUDA GPU");
        let kernels = StreamSampler::on_context(&context, ModuleChoice::from_environment().unwrap()).unwrap();
        let stream = context.new_stream().unwrap();
        Borrowed { kernels, stream }
    }

    /// `words` u32 on the stream, every one [`UNWRITTEN`].
    fn poisoned(&self, words: usize) -> CudaSlice<u32> {
        self.stream.clone_htod(&vec![UNWRITTEN; words.max(1)]).unwrap()
    }

    /// `words` f32 on the stream, every one the bits of [`UNWRITTEN`] (a NaN).
    fn poisoned_f32(&self, words: usize) -> CudaSlice<f32> {
        self.stream.clone_htod(&vec![f32::from_bits(UNWRITTEN); words.max(1)]).unwrap()
    }

    /// Fills `workspace` with +∞ words (as candidates: a score that wins every merge).
    fn poison(&self, workspace: DeviceWorkspace) {
        let words = vec![f32::INFINITY.to_bits(); workspace.bytes / 4];
        // SAFETY: the workspace holds `bytes` on this stream; the copy is waited for.
        unsafe {
            flashsample::cudarc::driver::result::memcpy_htod_async(workspace.address, &words, self.stream.cu_stream())
        }
        .unwrap();
        self.stream.synchronize().unwrap();
    }

    /// Reads a call's outputs back; a verification's verdicts are those of `batch`'s sequences.
    fn read(&self, draws: u32, outputs: &Outputs, batch: &Batch) -> Result<Sampled> {
        self.stream.synchronize().unwrap();
        let tokens = self.stream.clone_dtoh(&outputs.tokens).unwrap();
        let values = outputs.logprobs.as_ref().map(|v| self.stream.clone_dtoh(v).unwrap());
        let top = outputs.top.as_ref().map(|t| self.stream.clone_dtoh(t).unwrap());
        let mut sampled = Sampled::from_outputs(draws as usize, tokens, values.as_deref(), top.as_deref())?;
        if let Some(accepted) = &outputs.accepted {
            let accepted = self.stream.clone_dtoh(accepted).unwrap();
            sampled.verdicts = batch
                .first_rows()
                .into_iter()
                .zip(accepted)
                .map(|(first_row, accepted)| Verdict { first_row, accepted })
                .collect();
        }
        Ok(sampled)
    }

    /// Room for the outputs of a call with `batch` making `draws` draws of each row, poisoned.
    fn outputs(&self, batch: &DeviceBatch, draws: u32) -> Outputs {
        let (rows, logprobs, sequences) = (batch.rows(), batch.reports_logprobs(), batch.verified_sequences());
        Outputs {
            tokens: self.poisoned(rows * draws as usize),
            logprobs: logprobs.then(|| self.poisoned_f32(Target::logprobs_len(rows, draws))),
            top: logprobs.then(|| self.poisoned(Target::top_logprobs_len(rows))),
            accepted: (sequences > 0).then(|| self.poisoned(sequences)),
        }
    }
}

impl Default for Borrowed {
    fn default() -> Borrowed {
        Borrowed::new()
    }
}

/// A call's outputs in the caller's buffers.
struct Outputs {
    tokens: CudaSlice<u32>,
    logprobs: Option<CudaSlice<f32>>,
    top: Option<CudaSlice<u32>>,
    accepted: Option<CudaSlice<u32>>,
}

impl Outputs {
    fn target<'a>(&'a mut self, stream: &'a CudaStream) -> Target<'a> {
        Target {
            tokens: OutputSlice::of_slice(&mut self.tokens, stream),
            logprobs: self.logprobs.as_mut().map(|v| OutputSlice::of_slice(v, stream)),
            top_logprobs: self.top.as_mut().map(|t| OutputSlice::of_slice(t, stream)),
            parts: None,
            accepted: self.accepted.as_mut().map(|a| OutputSlice::of_slice(a, stream)),
        }
    }
}

/// A host matrix in the caller's device memory, in its own element type.
pub enum DeviceValues {
    Bf16(CudaSlice<half::bf16>),
    F16(CudaSlice<half::f16>),
    F32(CudaSlice<f32>),
}

impl DeviceValues {
    /// `matrix` copied to `stream`.
    pub fn upload(stream: &Arc<CudaStream>, matrix: &Matrix) -> DeviceValues {
        match matrix.elements() {
            Elements::BF16(v) => DeviceValues::Bf16(stream.clone_htod(v).unwrap()),
            Elements::F16(v) => DeviceValues::F16(stream.clone_htod(v).unwrap()),
            Elements::F32(v) => DeviceValues::F32(stream.clone_htod(v).unwrap()),
        }
    }

    /// The values as a contiguous `[rows, cols]` matrix read on `stream`.
    pub fn view<'a>(&'a self, stream: &'a CudaStream, rows: usize, cols: usize) -> DeviceMatrix<'a> {
        match self {
            DeviceValues::Bf16(slice) => DeviceMatrix::of_slice(slice, stream, rows, cols),
            DeviceValues::F16(slice) => DeviceMatrix::of_slice(slice, stream, rows, cols),
            DeviceValues::F32(slice) => DeviceMatrix::of_slice(slice, stream, rows, cols),
        }
        .unwrap()
    }
}

impl Backend for Borrowed {
    fn name(&self) -> String {
        format!("cuda {} borrowed", self.kernels.module().name())
    }

    fn sample_shards(&self, shards: &[Matrix], hidden: &Matrix, batch: &Batch, draws: Draws) -> Result<Sampled> {
        let stream = &self.stream;
        let vocab: usize = shards.iter().map(Matrix::rows).sum();
        let on_device = DeviceBatch::upload(stream, batch, vocab)?;
        let h = DeviceValues::upload(stream, hidden);
        let (rows, dim) = (hidden.rows(), hidden.cols());
        if let [lm_head] = shards {
            let w = DeviceValues::upload(stream, lm_head);
            let mut outputs = self.outputs(&on_device, draws.count);
            let mut workspace = StreamWorkspace::new();
            let request = Request {
                lm_head: w.view(stream, vocab, dim),
                hidden: h.view(stream, rows, dim),
                batch: on_device.view(stream),
                draws,
                shard: None,
            };
            let target = outputs.target(stream);
            let plan = self.kernels.plan(&request, &target)?;
            self.poison(workspace.ensure(stream, plan.workspace_bytes())?);
            self.kernels.enqueue_on(stream, &request, &target, &mut workspace)?;
            drop((request, target));
            let got = self.read(draws.count, &outputs, batch)?;
            check_written(&self.name(), &got, vocab);
            return with_row_statuses(got);
        }
        self.sample_raw_shards(shards, &h, (batch, &on_device), rows, dim, draws)
    }
}

impl Borrowed {
    /// Every shard through the raw layer on this stream: shard `s`'s part lies in one buffer
    /// of every shard's parts (so the gather moves nothing), each shard keeps its own exchange
    /// in its own workspace, and the maxima and sums between the segments are made on the host
    /// over every shard's words; each shard merges into outputs of its own, and every shard's
    /// results must equal shard 0's.
    #[allow(clippy::too_many_arguments)]
    fn sample_raw_shards(
        &self,
        shards: &[Matrix],
        h: &DeviceValues,
        (batch, on_device): (&Batch, &DeviceBatch),
        rows: usize,
        dim: usize,
        draws: Draws,
    ) -> Result<Sampled> {
        let logprobs = on_device.reports_logprobs();
        let stream = &self.stream;
        let vocab: usize = shards.iter().map(Matrix::rows).sum();
        let heads: Vec<DeviceValues> = shards.iter().map(|w| DeviceValues::upload(stream, w)).collect();
        let parts_bytes = Target::parts_bytes(shards.len(), rows, draws.count, logprobs)?;
        let parts = self.poisoned(parts_bytes.div_ceil(4));
        let parts_address = parts.device_ptr(stream).0;
        let mut outputs: Vec<Outputs> = shards.iter().map(|_| self.outputs(on_device, draws.count)).collect();
        let mut workspaces: Vec<StreamWorkspace> = shards.iter().map(|_| StreamWorkspace::new()).collect();
        let mut calls = Vec::new();
        let mut offset = 0;
        for (index, ((w, out), workspace)) in heads.iter().zip(&mut outputs).zip(&mut workspaces).enumerate() {
            let shard = Shard { tokens: VocabShard { offset, vocab }, index, count: shards.len() };
            offset += shards[index].rows();
            let request = Request {
                lm_head: w.view(stream, shards[index].rows(), dim),
                hidden: h.view(stream, rows, dim),
                batch: on_device.view(stream),
                draws,
                shard: Some(shard),
            };
            let mut target = out.target(stream);
            // SAFETY: the parts outlive every segment below, on this stream.
            target.parts = Some(unsafe { OutputSlice::from_raw(parts_address, parts_bytes) });
            let plan = self.kernels.plan(&request, &target)?;
            let space = workspace.ensure(stream, plan.workspace_bytes())?;
            self.poison(space);
            calls.push((plan, space, request, target));
        }
        let segments = calls[0].0.segments();
        for segment in 0..segments {
            let mut ended = Vec::new();
            for (plan, space, _, _) in &calls {
                // SAFETY: every buffer the plans name lives until the reads below, on this
                // stream; each exchange is made before the next segment.
                ended.push(unsafe { self.kernels.enqueue(stream.cu_stream().cast(), plan, *space, segment)? });
            }
            self.exchange_on_the_host(&ended, parts_address);
        }
        drop(calls);
        let results: Vec<Result<Sampled>> = outputs.iter().map(|out| self.read(draws.count, out, batch)).collect();
        let first = results[0]
            .as_ref()
            .map_err(|e| flashsample::Error::Framework { call: "read".into(), detail: e.to_string() })?;
        for (s, other) in results.iter().enumerate().skip(1) {
            assert_eq!(other.as_ref().ok(), Some(first), "{}: shard {s}'s results differ from shard 0's", self.name());
        }
        check_written(&self.name(), first, vocab);
        with_row_statuses(first.clone())
    }

    /// The exchanges one segment of every shard ended with, made on the host: the maximum or
    /// sum of every shard's words written back to each; a gather of parts that already lie in
    /// one buffer moves nothing.
    fn exchange_on_the_host(&self, ended: &[Option<Exchange>], parts: u64) {
        let stream = &self.stream;
        let read = |address: u64, words: usize| -> Vec<u32> {
            let mut host = vec![0u32; words];
            // SAFETY: the exchange's words lie at `address`, written on this stream.
            unsafe { flashsample::cudarc::driver::result::memcpy_dtoh_async(&mut host, address, stream.cu_stream()) }
                .unwrap();
            stream.synchronize().unwrap();
            host
        };
        let write = |address: u64, words: &[u32]| {
            // SAFETY: as above; the copy completes before the next segment reads it.
            unsafe { flashsample::cudarc::driver::result::memcpy_htod_async(address, words, stream.cu_stream()) }
                .unwrap();
            stream.synchronize().unwrap();
        };
        match ended[0] {
            None => assert!(ended.iter().all(Option::is_none), "the shards' segments end differently"),
            Some(Exchange::AllGather { .. }) => {
                for exchange in ended {
                    assert!(matches!(exchange, Some(Exchange::AllGather { parts: p, .. }) if *p == parts));
                }
            }
            Some(Exchange::MaxU32 { count, .. }) => {
                let addresses: Vec<u64> = ended
                    .iter()
                    .map(|x| match x {
                        Some(Exchange::MaxU32 { address, count: c }) if *c == count => *address,
                        other => panic!("the shards' segments end differently: {other:?}"),
                    })
                    .collect();
                let mut reduced = vec![0u32; count];
                for &address in &addresses {
                    for (r, w) in reduced.iter_mut().zip(read(address, count)) {
                        *r = (*r).max(w);
                    }
                }
                addresses.iter().for_each(|&address| write(address, &reduced));
            }
            Some(Exchange::SumU64 { count, .. }) => {
                let addresses: Vec<u64> = ended
                    .iter()
                    .map(|x| match x {
                        Some(Exchange::SumU64 { address, count: c }) if *c == count => *address,
                        other => panic!("the shards' segments end differently: {other:?}"),
                    })
                    .collect();
                let mut reduced = vec![0u64; count];
                for &address in &addresses {
                    let words = read(address, 2 * count);
                    for (r, pair) in reduced.iter_mut().zip(words.chunks(2)) {
                        *r += pair[0] as u64 | (pair[1] as u64) << 32;
                    }
                }
                let words: Vec<u32> = reduced.iter().flat_map(|&v| [v as u32, (v >> 32) as u32]).collect();
                addresses.iter().for_each(|&address| write(address, &words));
            }
        }
    }
}
