//! Borrowed mode on the GPU: sampling queued on a caller's stream from the caller's device
//! memory, ordered with the caller's own kernels, concurrent on two streams, restoring the
//! caller's context, captured once in a CUDA graph that replays fresh noise each step (plain,
//! with per-entry processing, and with truncations and log-probabilities), and
//! reporting non-finite hidden states as row statuses on the device.
//! Ignored without a GPU (run by the GPU bundle with `--include-ignored`).

use std::sync::Arc;

use flashsample::cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, sys};
use flashsample::{
    CudaSampler, DType, DeviceMatrix, DeviceProcessing, DeviceRows, DeviceWorkspace, Draws, ModuleChoice,
    ProcessedRequest, ProcessedTarget, Processing, RowStatus, SampleRequest, Sampled, SamplingParams, StreamSampler,
    StreamWorkspace, Variant,
};
use flashsample_tests::{gpu_cases, uniform_values};
use half::{bf16, f16};

const VOCAB: usize = 151_936;
const DIM: usize = 1024;

fn params(batch: usize, seed: u64) -> Vec<SamplingParams> {
    (0..batch).map(|b| SamplingParams::new(if b % 4 == 3 { 0.0 } else { 0.8 }, seed, b as u32, 0)).collect()
}

/// The caller's side: a cudarc context, a non-blocking stream of it, and the kernels loaded
/// there.
struct Caller {
    context: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    sampler: StreamSampler,
}

impl Caller {
    fn new() -> Caller {
        let context = CudaContext::new(0).expect("these tests need a CUDA GPU");
        let stream = context.new_stream().unwrap();
        let sampler = StreamSampler::on_context(&context, ModuleChoice::from_environment().unwrap()).unwrap();
        Caller { context, stream, sampler }
    }

    /// `rows × cols` bf16 made on `stream` by the library's fill kernel (the values
    /// `CudaSampler::random_*` makes for the same seed), queued without waiting.
    fn random(&self, stream: &Arc<CudaStream>, rows: usize, cols: usize, seed: u64, scale: f32) -> CudaSlice<bf16> {
        let mut slice = stream.alloc_zeros::<bf16>(rows * cols).unwrap();
        let (address, _use) = slice.device_ptr_mut(stream);
        // SAFETY: the slice holds `rows × cols` elements on this stream.
        unsafe {
            self.sampler
                .fill_uniform(stream.cu_stream().cast(), address, rows * cols, DType::BF16, seed, scale)
                .unwrap()
        };
        drop(_use);
        slice
    }

    /// `workspace` grown to what `request` needs on `stream`.
    fn workspace_for(
        &self,
        stream: &Arc<CudaStream>,
        workspace: &mut StreamWorkspace,
        request: &SampleRequest,
    ) -> DeviceWorkspace {
        let bytes = self
            .sampler
            .workspace_bytes(&request.lm_head, &request.hidden, request.draws.count, request.variant)
            .unwrap();
        workspace.ensure(stream, bytes).unwrap()
    }

    fn tokens(&self, stream: &Arc<CudaStream>, len: usize) -> CudaSlice<u32> {
        // Poisoned, so that a slot the sampler does not write shows.
        stream.clone_htod(&vec![0xdead_beef_u32; len]).unwrap()
    }
}

/// Tokens of the owned API for the same W and H seeds.
fn owned_tokens(batch: usize, samples: u32, w_seed: u64, h_seed: u64, params: &[SamplingParams]) -> Vec<u32> {
    let owned = CudaSampler::new().unwrap();
    let head = owned.random_lm_head(VOCAB, DIM, DType::BF16, w_seed, 0.05).unwrap();
    let hidden = owned.random_hidden(batch, DIM, DType::BF16, h_seed, 1.0).unwrap();
    let rows = owned.upload_rows(params).unwrap();
    let mut tokens = owned.tokens(batch, samples as usize).unwrap();
    owned.sample_rows_into(&head, &hidden, &rows, samples, Variant::Auto, &mut tokens).unwrap();
    owned.tokens_to_host(&tokens).unwrap()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn inputs_made_on_the_callers_stream_just_before_give_the_owned_tokens() {
    for batch in [1, 37, 200] {
        let samples = 3;
        let params = params(batch, 11);
        let expected = owned_tokens(batch, samples, 5, 6, &params);
        let caller = Caller::new();
        let stream = &caller.stream;
        let rows = DeviceRows::upload(stream, &params).unwrap();
        let mut tokens = caller.tokens(stream, batch * samples as usize);
        let mut workspace = StreamWorkspace::new();
        stream.synchronize().unwrap();
        // W (about 300 MB) and H are written by kernels on the caller's stream and sampled at
        // once: a sampler on any other stream would read them half-written.
        let w = caller.random(stream, VOCAB, DIM, 5, 0.05);
        let h = caller.random(stream, batch, DIM, 6, 1.0);
        caller
            .sampler
            .sample_slices(
                stream,
                &w,
                VOCAB,
                &h,
                &rows,
                Draws::first(samples),
                Variant::Auto,
                &mut tokens,
                &mut workspace,
            )
            .unwrap();
        let got = stream.clone_dtoh(&tokens).unwrap();
        stream.synchronize().unwrap();
        assert_eq!(got, expected, "B = {batch}");
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_strided_hidden_view_gives_the_contiguous_tokens() {
    let caller = Caller::new();
    let stream = &caller.stream;
    // D = 1000 ends in a partial 64-element block, whose loads stop at D, not at the stride.
    let (batch, samples, dim, stride) = (9usize, 2u32, 1000usize, 1000 + 56);
    let params = params(batch, 3);
    let w = caller.random(stream, VOCAB, dim, 21, 0.05);
    let h = caller.random(stream, batch, dim, 22, 1.0);
    // The same rows, `stride` elements apart (the rest of each row is garbage).
    let mut wide = caller.random(stream, batch, stride, 23, 9.0);
    for b in 0..batch {
        let mut row = wide.slice_mut(b * stride..b * stride + dim);
        stream.memcpy_dtod(&h.slice(b * dim..(b + 1) * dim), &mut row).unwrap();
    }
    let rows = DeviceRows::upload(stream, &params).unwrap();
    for variant in [Variant::Auto, Variant::Simt] {
        let mut contiguous = caller.tokens(stream, batch * samples as usize);
        let mut strided = caller.tokens(stream, batch * samples as usize);
        let mut workspace = StreamWorkspace::new();
        caller
            .sampler
            .sample_slices(
                stream,
                &w,
                VOCAB,
                &h,
                &rows,
                Draws::first(samples),
                variant,
                &mut contiguous,
                &mut workspace,
            )
            .unwrap();
        let (w_address, _w) = w.device_ptr(stream);
        let (h_address, _h) = wide.device_ptr(stream);
        let (t_address, _t) = strided.device_ptr_mut(stream);
        let request = SampleRequest {
            lm_head: DeviceMatrix::contiguous(w_address, VOCAB, dim, DType::BF16),
            hidden: DeviceMatrix { address: h_address, rows: batch, cols: dim, row_stride: stride, dtype: DType::BF16 },
            row_params: rows.address(),
            tokens: t_address,
            draws: Draws::first(samples),
            variant,
            processing: None,
            shard: None,
        };
        let space = caller.workspace_for(stream, &mut workspace, &request);
        // SAFETY: every buffer above lives on `stream` with the extents the request states.
        unsafe { caller.sampler.sample(stream.cu_stream().cast(), &request, space).unwrap() };
        drop((_w, _h, _t));
        let a = stream.clone_dtoh(&contiguous).unwrap();
        let b = stream.clone_dtoh(&strided).unwrap();
        assert_eq!(a, b, "{variant:?}");
        assert!(a.iter().all(|&t| (t as usize) < VOCAB), "{variant:?}");
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn two_streams_at_once_give_the_tokens_each_gives_alone() {
    let caller = Caller::new();
    let streams = [caller.context.new_stream().unwrap(), caller.context.new_stream().unwrap()];
    let batches = [64usize, 5];
    let samples = 4u32;
    let w = caller.random(&caller.stream, VOCAB, DIM, 31, 0.05);
    let hs: Vec<_> =
        batches.iter().enumerate().map(|(i, &b)| caller.random(&caller.stream, b, DIM, 40 + i as u64, 1.0)).collect();
    let rows: Vec<_> = batches
        .iter()
        .enumerate()
        .map(|(i, &b)| DeviceRows::upload(&caller.stream, &params(b, 50 + i as u64)).unwrap())
        .collect();
    caller.stream.synchronize().unwrap();
    let mut workspaces = [StreamWorkspace::new(), StreamWorkspace::new()];
    let run = |i: usize, workspace: &mut StreamWorkspace, tokens: &mut CudaSlice<u32>| {
        caller
            .sampler
            .sample_slices(
                &streams[i],
                &w,
                VOCAB,
                &hs[i],
                &rows[i],
                Draws::first(samples),
                Variant::Auto,
                tokens,
                workspace,
            )
            .unwrap();
    };
    let alone: Vec<Vec<u32>> = (0..2)
        .map(|i| {
            let mut tokens = caller.tokens(&streams[i], batches[i] * samples as usize);
            run(i, &mut workspaces[i], &mut tokens);
            streams[i].clone_dtoh(&tokens).unwrap()
        })
        .collect();
    // Both streams queue 20 calls each from two threads, interleaved, with no wait between.
    let mut outputs: Vec<Vec<CudaSlice<u32>>> =
        (0..2).map(|i| (0..20).map(|_| caller.tokens(&streams[i], batches[i] * samples as usize)).collect()).collect();
    for s in &streams {
        s.synchronize().unwrap();
    }
    let [w0, w1] = &mut workspaces;
    let (o0, o1) = outputs.split_at_mut(1);
    std::thread::scope(|scope| {
        scope.spawn(|| o0[0].iter_mut().for_each(|t| run(0, w0, t)));
        scope.spawn(|| o1[0].iter_mut().for_each(|t| run(1, w1, t)));
    });
    for i in 0..2 {
        assert!(alone[i].iter().all(|&t| (t as usize) < VOCAB), "stream {i} alone wrote no tokens");
        for (call, tokens) in outputs[i].iter().enumerate() {
            assert_eq!(streams[i].clone_dtoh(tokens).unwrap(), alone[i], "stream {i}, call {call}");
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn the_callers_current_context_is_restored() {
    let caller = Caller::new();
    let stream = &caller.stream;
    let batch = 4;
    let w = caller.random(stream, VOCAB, DIM, 1, 0.05);
    let h = caller.random(stream, batch, DIM, 2, 1.0);
    let rows = DeviceRows::upload(stream, &params(batch, 3)).unwrap();
    let mut tokens = caller.tokens(stream, batch);
    let mut workspace = StreamWorkspace::new();
    // Warm: the workspace is allocated (cudarc binds its context for that).
    caller
        .sampler
        .sample_slices(stream, &w, VOCAB, &h, &rows, Draws::first(1), Variant::Auto, &mut tokens, &mut workspace)
        .unwrap();
    stream.synchronize().unwrap();
    let (w_address, _w) = w.device_ptr(stream);
    let (h_address, _h) = h.device_ptr(stream);
    let (t_address, _t) = tokens.device_ptr_mut(stream);
    let request = SampleRequest {
        lm_head: DeviceMatrix::contiguous(w_address, VOCAB, DIM, DType::BF16),
        hidden: DeviceMatrix::contiguous(h_address, batch, DIM, DType::BF16),
        row_params: rows.address(),
        tokens: t_address,
        draws: Draws::first(1),
        variant: Variant::Auto,
        processing: None,
        shard: None,
    };
    let space = caller.workspace_for(stream, &mut workspace, &request);
    let current = || {
        let mut context = std::ptr::null_mut();
        // SAFETY: writes one handle.
        unsafe { sys::cuCtxGetCurrent(&mut context) }.result().unwrap();
        context
    };
    // Empty this thread's context stack (cudarc's calls above left the primary context on it),
    // so that "no current context" is a state the test can set.
    while !current().is_null() {
        let mut popped = std::ptr::null_mut();
        // SAFETY: pops the current context off this thread's stack.
        unsafe { sys::cuCtxPopCurrent_v2(&mut popped) }.result().unwrap();
    }
    let mut device = 0;
    // SAFETY: writes one device handle.
    unsafe { sys::cuDeviceGet(&mut device, 0) }.result().unwrap();
    let mut other = std::ptr::null_mut();
    // SAFETY: creates a context (made current by the call) that this test destroys below.
    unsafe { sys::cuCtxCreate_v4(&mut other, std::ptr::null_mut(), 0, device) }.result().unwrap();
    for previous in [std::ptr::null_mut(), other] {
        // SAFETY: null unbinds; `other` is live.
        unsafe { sys::cuCtxSetCurrent(previous) }.result().unwrap();
        assert_eq!(current(), previous, "set by the test");
        // SAFETY: the buffers live on `stream` with the request's extents.
        unsafe { caller.sampler.sample(stream.cu_stream().cast(), &request, space).unwrap() };
        assert_eq!(current(), previous, "after sample");
        // SAFETY: as above.
        unsafe { caller.sampler.advance_steps(stream.cu_stream().cast(), rows.address(), batch, 1).unwrap() };
        assert_eq!(current(), previous, "after advance_steps");
        // An invalid call restores it too.
        let bad = SampleRequest { tokens: 0, ..request };
        // SAFETY: refused before anything is queued.
        assert!(unsafe { caller.sampler.sample(stream.cu_stream().cast(), &bad, space) }.is_err());
        assert_eq!(current(), previous, "after a refused call");
    }
    // SAFETY: `other` was created above and is no longer used.
    unsafe { sys::cuCtxDestroy_v2(other) }.result().unwrap();
    stream.synchronize().unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_captured_graph_replays_fresh_noise_as_the_step_advances_on_the_device() {
    graph_replays_fresh_noise(false);
}

/// As above with per-row processing (soft-cap, bias, mask, penalties) on the device, in the
/// request the graph captures.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_captured_graph_with_processing_replays_fresh_noise() {
    graph_replays_fresh_noise(true);
}

/// One call captured in a CUDA graph, replayed while `advance_steps` moves the step on the
/// device: the tokens of as many uncaptured calls, step for step, and never the previous
/// step's; with `processing`, every row has one of the per-entry modes.
fn graph_replays_fresh_noise(processing: bool) {
    let caller = Caller::new();
    let stream = &caller.stream;
    let (batch, samples, steps) = (8usize, 2u32, 100);
    let initial: Vec<_> = (0..batch).map(|b| SamplingParams::new(1.0, 99, b as u32, 0)).collect();
    let w = caller.random(stream, VOCAB, DIM, 7, 0.05);
    let h = caller.random(stream, batch, DIM, 8, 1.0);
    let mut tokens = caller.tokens(stream, batch * samples as usize);
    let mut workspace = StreamWorkspace::new();
    let (w_address, _w) = w.device_ptr(stream);
    let (h_address, _h) = h.device_ptr(stream);
    let (t_address, _t) = tokens.device_ptr_mut(stream);
    let modes = flashsample_tests::processing::each_mode(VOCAB);
    let per_entry: Vec<Processing> = (0..batch).map(|r| modes[r % 4].1.clone()).collect();
    let device_processing = processing.then(|| DeviceProcessing::upload(stream, &per_entry, VOCAB).unwrap());
    let fused = device_processing.as_ref().map(|p| p.fused().unwrap());
    let run_steps = |rows: &DeviceRows, step: &mut dyn FnMut()| -> Vec<Vec<u32>> {
        (0..steps)
            .map(|_| {
                step();
                let mut host = vec![0u32; batch * samples as usize];
                // SAFETY: `t_address` holds this many tokens; the copy is ordered on `stream`.
                unsafe {
                    sys::cuMemcpyDtoHAsync_v2(host.as_mut_ptr().cast(), t_address, host.len() * 4, stream.cu_stream())
                }
                .result()
                .unwrap();
                stream.synchronize().unwrap();
                // SAFETY: the step counter lives in `rows`, on `stream`.
                unsafe { caller.sampler.advance_steps(stream.cu_stream().cast(), rows.address(), batch, 1).unwrap() };
                host
            })
            .collect()
    };
    let request_for = |rows: &DeviceRows| SampleRequest {
        lm_head: DeviceMatrix::contiguous(w_address, VOCAB, DIM, DType::BF16),
        hidden: DeviceMatrix::contiguous(h_address, batch, DIM, DType::BF16),
        row_params: rows.address(),
        tokens: t_address,
        draws: Draws::first(samples),
        variant: Variant::Auto,
        processing: fused,
        shard: None,
    };
    let rows = DeviceRows::upload(stream, &initial).unwrap();
    let request = request_for(&rows);
    let space = caller.workspace_for(stream, &mut workspace, &request);
    // SAFETY (both closures): the buffers live on `stream` with the request's extents.
    let uncaptured =
        run_steps(&rows, &mut || unsafe { caller.sampler.sample(stream.cu_stream().cast(), &request, space).unwrap() });

    // After one call has written the maps into the workspace, later calls may read them.
    let rows = DeviceRows::upload(stream, &initial).unwrap();
    let request = request_for(&rows);
    let mut first = true;
    // SAFETY: as above; every call after the first reads the maps the first wrote for the same
    // matrices and batch.
    let stored = run_steps(&rows, &mut || unsafe {
        let stream = stream.cu_stream().cast();
        if std::mem::take(&mut first) {
            caller.sampler.sample(stream, &request, space).unwrap()
        } else {
            caller.sampler.sample_with_stored_maps(stream, &request, space).unwrap()
        }
    });
    assert_eq!(stored, uncaptured, "reading stored maps changed the tokens");

    let rows = DeviceRows::upload(stream, &initial).unwrap();
    let request = request_for(&rows);
    stream.synchronize().unwrap();
    stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).unwrap();
    // SAFETY: as above; captured, not run.
    unsafe { caller.sampler.sample(stream.cu_stream().cast(), &request, space).unwrap() };
    let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0)).unwrap().expect("one captured call");
    let replayed = run_steps(&rows, &mut || graph.launch().unwrap());

    for (step, (a, b)) in uncaptured.iter().zip(&replayed).enumerate() {
        assert_eq!(a, b, "step {step}");
        assert!(a.iter().all(|&t| (t as usize) < VOCAB), "step {step}");
    }
    let repeats = uncaptured.windows(2).filter(|pair| pair[0] == pair[1]).count();
    assert_eq!(repeats, 0, "a step drew the same {batch} x {samples} tokens as the step before");
    stream.synchronize().unwrap();
}

/// Processed sampling with every mode (truncations, per-entry steps, top raw entries) and
/// log-probabilities, captured once in a CUDA graph on the caller's stream: each replay, as
/// `advance_steps` moves the step on the device, gives the tokens and log-probabilities
/// (bit for bit) of an uncaptured call at that step, never the previous step's tokens; and
/// step 0 gives the owned sampler's.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_captured_graph_of_processed_sampling_with_log_probabilities_replays_fresh_noise() {
    let caller = Caller::new();
    let stream = &caller.stream;
    let (batch, samples, steps) = (8usize, 2u32, 20);
    let initial: Vec<_> = (0..batch).map(|b| SamplingParams::new(0.9, 77, b as u32, 0)).collect();
    let modes = flashsample_tests::processing::each_mode(VOCAB);
    let processing: Vec<Processing> =
        (0..batch).map(|r| Processing { top_logprobs: [5, 0][r % 2], ..modes[r % modes.len()].1.clone() }).collect();
    let w = caller.random(stream, VOCAB, DIM, 17, 0.05);
    let h = caller.random(stream, batch, DIM, 18, 1.0);
    let device_processing = DeviceProcessing::upload(stream, &processing, VOCAB).unwrap();
    let (logprob_bytes, top_bytes) =
        (ProcessedRequest::logprobs_bytes(batch, samples as usize), ProcessedRequest::top_logprobs_bytes(batch));
    let mut tokens = caller.tokens(stream, batch * samples as usize);
    let mut logprobs = stream.alloc_zeros::<u8>(logprob_bytes + top_bytes).unwrap();
    let (w_address, _w) = w.device_ptr(stream);
    let (h_address, _h) = h.device_ptr(stream);
    let (t_address, _t) = tokens.device_ptr_mut(stream);
    let (l_address, _l) = logprobs.device_ptr_mut(stream);
    let request_for = |rows: &DeviceRows| ProcessedRequest {
        lm_head: DeviceMatrix::contiguous(w_address, VOCAB, DIM, DType::BF16),
        hidden: DeviceMatrix::contiguous(h_address, batch, DIM, DType::BF16),
        row_params: rows.address(),
        draws: Draws::first(samples),
        variant: Variant::Auto,
        processing: device_processing.on_device(),
        target: ProcessedTarget::Tokens {
            tokens: t_address,
            logprobs: l_address,
            top_logprobs: l_address + logprob_bytes as u64,
        },
    };
    let rows = DeviceRows::upload(stream, &initial).unwrap();
    let mut workspace = StreamWorkspace::new();
    let bytes = caller.sampler.processed_workspace_bytes(&request_for(&rows)).unwrap();
    let space = workspace.ensure(stream, bytes).unwrap();
    let run_steps = |rows: &DeviceRows, step: &mut dyn FnMut()| -> Vec<(Vec<u32>, Vec<u32>)> {
        (0..steps)
            .map(|_| {
                step();
                let mut host_tokens = vec![0u32; batch * samples as usize];
                let mut host_logprobs = vec![0u32; (logprob_bytes + top_bytes) / 4];
                // SAFETY: the buffers hold this many bytes; the copies are ordered on `stream`.
                unsafe {
                    let copy = |to: *mut u8, from, bytes| {
                        sys::cuMemcpyDtoHAsync_v2(to.cast(), from, bytes, stream.cu_stream()).result().unwrap()
                    };
                    copy(host_tokens.as_mut_ptr().cast(), t_address, host_tokens.len() * 4);
                    copy(host_logprobs.as_mut_ptr().cast(), l_address, logprob_bytes + top_bytes);
                }
                stream.synchronize().unwrap();
                // SAFETY: the step counter lives in `rows`, on `stream`.
                unsafe { caller.sampler.advance_steps(stream.cu_stream().cast(), rows.address(), batch, 1).unwrap() };
                (host_tokens, host_logprobs)
            })
            .collect()
    };
    let request = request_for(&rows);
    // SAFETY (both closures): the buffers live on `stream` with the request's extents.
    let uncaptured = run_steps(&rows, &mut || unsafe {
        caller.sampler.sample_processed(stream.cu_stream().cast(), &request, space).unwrap()
    });

    let rows = DeviceRows::upload(stream, &initial).unwrap();
    let request = request_for(&rows);
    stream.synchronize().unwrap();
    stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).unwrap();
    // SAFETY: as above; captured, not run.
    unsafe { caller.sampler.sample_processed(stream.cu_stream().cast(), &request, space).unwrap() };
    let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0)).unwrap().expect("one captured call");
    let replayed = run_steps(&rows, &mut || graph.launch().unwrap());

    for (step, (a, b)) in uncaptured.iter().zip(&replayed).enumerate() {
        assert_eq!(a, b, "step {step}");
        assert!(a.0.iter().all(|&t| (t as usize) < VOCAB), "step {step}");
    }
    let repeats = uncaptured.windows(2).filter(|pair| pair[0].0 == pair[1].0).count();
    assert_eq!(repeats, 0, "a step drew the same {batch} x {samples} tokens as the step before");

    let owned = CudaSampler::new().unwrap();
    let head = owned.random_lm_head(VOCAB, DIM, DType::BF16, 17, 0.05).unwrap();
    let hidden = owned.random_hidden(batch, DIM, DType::BF16, 18, 1.0).unwrap();
    let (owned_rows, owned_processing) =
        (owned.upload_rows(&initial).unwrap(), owned.upload_processing(&processing, VOCAB).unwrap());
    let mut out = owned.processed_outputs(batch, samples as usize, true).unwrap();
    let draws = Draws::first(samples);
    owned
        .sample_processed_into(&head, &hidden, &owned_rows, &owned_processing, draws, Variant::Auto, &mut out)
        .unwrap();
    let want = owned.processed_to_host(&out).unwrap();
    let (values, top) = uncaptured[0].1.split_at(logprob_bytes / 4);
    let values: Vec<f32> = values.iter().map(|&v| f32::from_bits(v)).collect();
    let got =
        Sampled::from_processed_outputs(samples as usize, uncaptured[0].0.clone(), Some(&values), Some(top)).unwrap();
    assert_eq!(got.tokens, want.tokens);
    assert_eq!(got.top_logprobs, want.top_logprobs);
    let bits = |values: &[f32]| values.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&got.logprobs), bits(&want.logprobs));
    assert_eq!(bits(&got.processed_logprobs), bits(&want.processed_logprobs));
    assert!(got.top_logprobs.iter().enumerate().all(|(r, top)| top.len() == [5, 0][r % 2]));
    stream.synchronize().unwrap();
}

/// `values` in `dtype` on `stream`, as the model would have left them there.
fn upload(stream: &Arc<CudaStream>, values: &[f32], dtype: DType) -> CudaSlice<u8> {
    let bytes: Vec<u8> = match dtype {
        DType::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        DType::BF16 => values.iter().flat_map(|&v| bf16::from_f32(v).to_le_bytes()).collect(),
        DType::F16 => values.iter().flat_map(|&v| f16::from_f32(v).to_le_bytes()).collect(),
    };
    stream.clone_htod(&bytes).unwrap()
}

/// Hidden states a model left non-finite reach the row statuses in every variant: a row with
/// a NaN (NaN logits), a row with +∞ or −∞ in the column where every row of `W` is positive
/// (+∞ logits; −∞ logits, so no allowed token). Their slots on the device hold the statuses,
/// whatever the temperature, and the other rows draw what they draw when those rows are finite.
#[test]
#[ignore = "needs a CUDA GPU"]
fn non_finite_hidden_states_give_row_statuses_in_every_variant() {
    let caller = Caller::new();
    let stream = &caller.stream;
    let (vocab, batch, samples) = (2003, 6, 3u32);
    let bad = [
        (1, f32::NAN, RowStatus::NonFiniteLogits),
        (2, f32::INFINITY, RowStatus::NonFiniteLogits),
        (4, f32::NEG_INFINITY, RowStatus::NoAllowedToken),
    ];
    let temperatures = [0.8, 0.8, 0.0, 1.0, 0.8, 0.0];
    let params: Vec<SamplingParams> =
        temperatures.iter().enumerate().map(|(b, &t)| SamplingParams::new(t, 21, b as u32, 0)).collect();
    let rows = DeviceRows::upload(stream, &params).unwrap();
    let mut workspace = StreamWorkspace::new();
    for (variant, dtype, dim) in gpu_cases(caller.sampler.module()) {
        let mut w = uniform_values(vocab * dim, 0.3, 5);
        for i in 0..vocab {
            w[i * dim] = 0.5;
        }
        let mut h = uniform_values(batch * dim, 1.0, 6);
        for b in 0..batch {
            h[b * dim] = 0.0;
        }
        let finite = h.clone();
        for &(b, value, _) in &bad {
            h[b * dim] = value;
        }
        let w = upload(stream, &w, dtype);
        let mut draw = |values: &[f32]| -> Vec<u32> {
            let h = upload(stream, values, dtype);
            let mut tokens = caller.tokens(stream, batch * samples as usize);
            let (w_address, _w) = w.device_ptr(stream);
            let (h_address, _h) = h.device_ptr(stream);
            let (t_address, _t) = tokens.device_ptr_mut(stream);
            let request = SampleRequest {
                lm_head: DeviceMatrix::contiguous(w_address, vocab, dim, dtype),
                hidden: DeviceMatrix::contiguous(h_address, batch, dim, dtype),
                row_params: rows.address(),
                tokens: t_address,
                draws: Draws::first(samples),
                variant,
                processing: None,
                shard: None,
            };
            let space = caller.workspace_for(stream, &mut workspace, &request);
            // SAFETY: every buffer lives on `stream` with the request's extents until the copy
            // below has waited for the call.
            unsafe { caller.sampler.sample(stream.cu_stream().cast(), &request, space).unwrap() };
            drop((_w, _h, _t));
            stream.clone_dtoh(&tokens).unwrap()
        };
        let (got, want) = (draw(&h), draw(&finite));
        let s = samples as usize;
        for b in 0..batch {
            let slots = &got[b * s..(b + 1) * s];
            match bad.iter().find(|row| row.0 == b) {
                Some(&(_, value, status)) => {
                    assert!(
                        slots.iter().all(|&t| t == status.token()),
                        "{variant:?} {dtype:?}: H has {value}: {slots:?}"
                    )
                }
                None => assert_eq!(slots, &want[b * s..(b + 1) * s], "{variant:?} {dtype:?}: row {b}"),
            }
        }
        assert!(want.iter().all(|&t| (t as usize) < vocab), "{variant:?} {dtype:?}: {want:?}");
    }
    stream.synchronize().unwrap();
}
