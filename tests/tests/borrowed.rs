//! Borrowed mode on the GPU: the suite through the safe layer (and the raw layer for shards),
//! and what only borrowed mode has: sampling queued on a caller's stream from the caller's
//! device memory, ordered with the caller's own kernels, concurrent on two streams, restoring
//! the caller's context, captured once in a CUDA graph that replays fresh noise each step
//! (plain, with per-entry processing, and with truncations and log-probabilities), stored
//! tensor maps, and non-finite hidden states reported as row statuses on the device.
//! Ignored without a GPU (run by the GPU bundle with `--include-ignored`).

use std::sync::Arc;

use flashsample::cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtrMut, sys};
use flashsample::internals::Variant;
use flashsample::{
    Batch, CudaSampler, DType, DeviceBatch, DeviceMatrix, Drafted, Draws, ModuleChoice, OutputSlice, Processing,
    Request, RowStatus, Sampled, SamplingParams, StreamSampler, StreamWorkspace, Target,
};
use flashsample_tests::suite::Scale;
use flashsample_tests::{Borrowed, gpu_cases, uniform_values};
use half::{bf16, f16};
use rand::{Rng, SeedableRng};

flashsample_tests::suite!(Borrowed::new(), Scale::GPU, #[ignore = "needs a CUDA GPU"]);

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

    /// Room for `len` tokens, poisoned, so that a slot the sampler does not write shows.
    fn tokens(&self, stream: &Arc<CudaStream>, len: usize) -> CudaSlice<u32> {
        stream.clone_htod(&vec![0xdead_beef_u32; len]).unwrap()
    }

    /// Queues `draws` of every row of `h` from `w` with `batch` into `tokens` on `stream`
    /// through the safe layer, with the tile `variant`.
    #[allow(clippy::too_many_arguments)]
    fn sample(
        &self,
        stream: &Arc<CudaStream>,
        w: &CudaSlice<bf16>,
        h: &CudaSlice<bf16>,
        batch: &DeviceBatch,
        draws: u32,
        variant: Variant,
        tokens: &mut CudaSlice<u32>,
        workspace: &mut StreamWorkspace,
    ) {
        let request = request(stream, w, h, batch, draws);
        let target = Target::tokens(OutputSlice::of_slice(tokens, stream));
        self.sampler.enqueue_on_with_variant(stream, &request, &target, workspace, variant).unwrap();
    }
}

/// The request for `draws` draws of every row of `batch` from `W[len / DIM, DIM]` and the
/// contiguous `H` on `stream`.
fn request<'a>(
    stream: &'a Arc<CudaStream>,
    w: &'a CudaSlice<bf16>,
    h: &'a CudaSlice<bf16>,
    batch: &'a DeviceBatch,
    draws: u32,
) -> Request<'a> {
    let rows = batch.rows();
    Request {
        lm_head: DeviceMatrix::of_slice(w, stream, w.len() / DIM, DIM).unwrap(),
        hidden: DeviceMatrix::of_slice(h, stream, rows, h.len() / rows).unwrap(),
        batch: batch.view(stream),
        draws: Draws::first(draws),
        shard: None,
    }
}

/// Tokens of the owned API for the same W and H seeds.
fn owned_tokens(batch: usize, samples: u32, w_seed: u64, h_seed: u64, params: &[SamplingParams]) -> Vec<u32> {
    let owned = CudaSampler::new().unwrap();
    let head = owned.random_lm_head(VOCAB, DIM, DType::BF16, w_seed, 0.05).unwrap();
    let hidden = owned.random_hidden(batch, DIM, DType::BF16, h_seed, 1.0).unwrap();
    let on_device = owned.upload_batch(&Batch::new(params.to_vec()), VOCAB).unwrap();
    let mut out = owned.outputs(&on_device, samples).unwrap();
    owned.sample_into(&head, &hidden, &on_device, Draws::first(samples), &mut out).unwrap();
    owned.read(&out).unwrap().tokens
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
        let on_device = DeviceBatch::upload(stream, &Batch::new(params), VOCAB).unwrap();
        let mut tokens = caller.tokens(stream, batch * samples as usize);
        let mut workspace = StreamWorkspace::new();
        stream.synchronize().unwrap();
        // W (about 300 MB) and H are written by kernels on the caller's stream and sampled at
        // once: a sampler on any other stream would read them half-written.
        let w = caller.random(stream, VOCAB, DIM, 5, 0.05);
        let h = caller.random(stream, batch, DIM, 6, 1.0);
        caller.sample(stream, &w, &h, &on_device, samples, Variant::Auto, &mut tokens, &mut workspace);
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
    let w = caller.random(stream, VOCAB, dim, 21, 0.05);
    let h = caller.random(stream, batch, dim, 22, 1.0);
    // The same rows, `stride` elements apart (the rest of each row is garbage).
    let mut wide = caller.random(stream, batch, stride, 23, 9.0);
    for b in 0..batch {
        let mut row = wide.slice_mut(b * stride..b * stride + dim);
        stream.memcpy_dtod(&h.slice(b * dim..(b + 1) * dim), &mut row).unwrap();
    }
    let on_device = DeviceBatch::upload(stream, &Batch::new(params(batch, 3)), VOCAB).unwrap();
    for variant in [Variant::Auto, Variant::Simt] {
        let mut tokens =
            [caller.tokens(stream, batch * samples as usize), caller.tokens(stream, batch * samples as usize)];
        let mut workspace = StreamWorkspace::new();
        let [contiguous, strided] = &mut tokens;
        for (hidden, row_stride, out) in [(&h, dim, contiguous), (&wide, stride, strided)] {
            let request = Request {
                lm_head: DeviceMatrix::of_slice(&w, stream, VOCAB, dim).unwrap(),
                hidden: DeviceMatrix::of_rows(hidden, stream, 0, batch, dim, row_stride).unwrap(),
                batch: on_device.view(stream),
                draws: Draws::first(samples),
                shard: None,
            };
            let target = Target::tokens(OutputSlice::of_slice(out, stream));
            caller.sampler.enqueue_on_with_variant(stream, &request, &target, &mut workspace, variant).unwrap();
        }
        let a = stream.clone_dtoh(&tokens[0]).unwrap();
        let b = stream.clone_dtoh(&tokens[1]).unwrap();
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
    let on_device: Vec<_> = batches
        .iter()
        .enumerate()
        .map(|(i, &b)| DeviceBatch::upload(&caller.stream, &Batch::new(params(b, 50 + i as u64)), VOCAB).unwrap())
        .collect();
    caller.stream.synchronize().unwrap();
    let mut workspaces = [StreamWorkspace::new(), StreamWorkspace::new()];
    let run = |i: usize, workspace: &mut StreamWorkspace, tokens: &mut CudaSlice<u32>| {
        caller.sample(&streams[i], &w, &hs[i], &on_device[i], samples, Variant::Auto, tokens, workspace);
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
    let mut on_device = DeviceBatch::upload(stream, &Batch::new(params(batch, 3)), VOCAB).unwrap();
    let mut tokens = caller.tokens(stream, batch);
    let mut workspace = StreamWorkspace::new();
    // Warm: the workspace is allocated (cudarc binds its context for that).
    caller.sample(stream, &w, &h, &on_device, 1, Variant::Auto, &mut tokens, &mut workspace);
    stream.synchronize().unwrap();
    let current = || {
        let mut context = std::ptr::null_mut();
        // SAFETY: writes one handle.
        unsafe { sys::cuCtxGetCurrent(&mut context) }.result().unwrap();
        context
    };
    let plan_and_space = |tokens: &mut CudaSlice<u32>, workspace: &mut StreamWorkspace| {
        let request = request(stream, &w, &h, &on_device, 1);
        let plan = caller.sampler.plan(&request, &Target::tokens(OutputSlice::of_slice(tokens, stream))).unwrap();
        (plan, workspace.ensure(stream, plan.workspace_bytes()).unwrap())
    };
    let (plan, space) = plan_and_space(&mut tokens, &mut workspace);
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
    let raw_stream = stream.cu_stream().cast();
    for previous in [std::ptr::null_mut(), other] {
        // SAFETY: null unbinds; `other` is live.
        unsafe { sys::cuCtxSetCurrent(previous) }.result().unwrap();
        assert_eq!(current(), previous, "set by the test");
        // SAFETY: the plan's buffers live on `stream` until the end of the test.
        unsafe { caller.sampler.enqueue(raw_stream, &plan, space, 0).unwrap() };
        assert_eq!(current(), previous, "after enqueue");
        // SAFETY: as above.
        unsafe { caller.sampler.advance_steps(raw_stream, 0, batch, 1) }.unwrap_err();
        caller.sampler.advance_steps_on(stream, &mut on_device, 1).unwrap();
        assert_eq!(current(), previous, "after advance_steps");
        // An invalid call (a workspace too small) restores it too.
        let small = flashsample::DeviceWorkspace { bytes: 64, ..space };
        // SAFETY: refused before anything is queued.
        assert!(unsafe { caller.sampler.enqueue(raw_stream, &plan, small, 0) }.is_err());
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

/// The values of `slice`, after the stream's work.
fn read_words<T: Copy + Default + flashsample::cudarc::driver::DeviceRepr>(
    stream: &Arc<CudaStream>,
    slice: &CudaSlice<T>,
) -> Vec<T> {
    stream.clone_dtoh(slice).unwrap()
}

/// One call captured in a CUDA graph, replayed while `advance_steps` moves the step on the
/// device: the tokens of as many uncaptured calls, step for step, and never the previous
/// step's; the same with a workspace that keeps the tensor maps its first call stored. With
/// `processing`, every row has one of the per-entry modes.
fn graph_replays_fresh_noise(processing: bool) {
    let caller = Caller::new();
    let stream = &caller.stream;
    let (batch, samples, steps) = (8usize, 2u32, 100);
    let initial: Vec<_> = (0..batch).map(|b| SamplingParams::new(1.0, 99, b as u32, 0)).collect();
    let modes = flashsample_tests::processing::each_mode(VOCAB);
    let per_entry: Vec<Processing> = (0..batch).map(|r| modes[r % 4].1.clone()).collect();
    let rows = Batch::with_processing(initial, if processing { per_entry } else { Vec::new() });
    let w = caller.random(stream, VOCAB, DIM, 7, 0.05);
    let h = caller.random(stream, batch, DIM, 8, 1.0);
    let mut tokens = caller.tokens(stream, batch * samples as usize);
    // Each loop starts from step 0 and reads every step's tokens.
    let run_steps = |step: &mut dyn FnMut(&mut DeviceBatch, &mut CudaSlice<u32>)| -> Vec<Vec<u32>> {
        let mut on_device = DeviceBatch::upload(stream, &rows, VOCAB).unwrap();
        let mut tokens = caller.tokens(stream, batch * samples as usize);
        (0..steps)
            .map(|_| {
                step(&mut on_device, &mut tokens);
                let host = read_words(stream, &tokens);
                caller.sampler.advance_steps_on(stream, &mut on_device, 1).unwrap();
                host
            })
            .collect()
    };
    // A fresh workspace every step: every call writes its tensor maps.
    let uncaptured = run_steps(&mut |on_device, tokens| {
        let mut fresh = StreamWorkspace::new();
        caller.sample(stream, &w, &h, on_device, samples, Variant::Auto, tokens, &mut fresh);
    });
    // One workspace for every step: after the first, the calls read the maps it stored.
    let mut kept = StreamWorkspace::new();
    let stored = run_steps(&mut |on_device, tokens| {
        caller.sample(stream, &w, &h, on_device, samples, Variant::Auto, tokens, &mut kept);
    });
    assert_eq!(stored, uncaptured, "reading stored maps changed the tokens");

    // One call captured, replayed every step.
    let mut on_device = DeviceBatch::upload(stream, &rows, VOCAB).unwrap();
    let mut workspace = StreamWorkspace::new();
    let request = request(stream, &w, &h, &on_device, samples);
    let target = Target::tokens(OutputSlice::of_slice(&mut tokens, stream));
    workspace.reserve(stream, &caller.sampler.plan(&request, &target).unwrap()).unwrap();
    stream.synchronize().unwrap();
    stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).unwrap();
    caller.sampler.enqueue_on(stream, &request, &target, &mut workspace).unwrap();
    let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0)).unwrap().expect("one captured call");
    drop((request, target));
    let mut replayed = Vec::new();
    for _ in 0..steps {
        graph.launch().unwrap();
        replayed.push(read_words(stream, &tokens));
        caller.sampler.advance_steps_on(stream, &mut on_device, 1).unwrap();
    }
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
/// `advance_steps` moves the step on the device, gives the tokens and log-probabilities (bit
/// for bit) of an uncaptured call at that step, never the previous step's tokens; and step 0
/// gives the owned sampler's.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_captured_graph_of_processed_sampling_with_log_probabilities_replays_fresh_noise() {
    let caller = Caller::new();
    let stream = &caller.stream;
    let (batch, samples, steps) = (8usize, 2u32, 20);
    let initial: Vec<_> = (0..batch).map(|b| SamplingParams::new(0.9, 77, b as u32, 0)).collect();
    let modes = flashsample_tests::processing::each_mode(VOCAB);
    let processing: Vec<Processing> = (0..batch)
        .map(|r| Processing { logprobs: true, top_logprobs: [5, 0][r % 2], ..modes[r % modes.len()].1.clone() })
        .collect();
    let rows = Batch::with_processing(initial, processing);
    let w = caller.random(stream, VOCAB, DIM, 17, 0.05);
    let h = caller.random(stream, batch, DIM, 18, 1.0);
    let mut outputs = ProcessedOutputs {
        tokens: caller.tokens(stream, batch * samples as usize),
        logprobs: stream.alloc_zeros::<f32>(Target::logprobs_len(batch, samples)).unwrap(),
        top: stream.alloc_zeros::<u32>(Target::top_logprobs_len(batch)).unwrap(),
    };
    let mut on_device = DeviceBatch::upload(stream, &rows, VOCAB).unwrap();
    let mut workspace = StreamWorkspace::new();
    // The call's views are made (and dropped) outside any capture: cudarc's event tracking
    // waits and records there.
    let call =
        |on_device: &DeviceBatch, outputs: &mut ProcessedOutputs, workspace: &mut StreamWorkspace, capture: bool| {
            let request = request(stream, &w, &h, on_device, samples);
            let target = Target {
                tokens: OutputSlice::of_slice(&mut outputs.tokens, stream),
                logprobs: Some(OutputSlice::of_slice(&mut outputs.logprobs, stream)),
                top_logprobs: Some(OutputSlice::of_slice(&mut outputs.top, stream)),
                parts: None,
                accepted: None,
            };
            if !capture {
                caller.sampler.enqueue_on(stream, &request, &target, workspace).unwrap();
                return None;
            }
            workspace.reserve(stream, &caller.sampler.plan(&request, &target).unwrap()).unwrap();
            stream.synchronize().unwrap();
            stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).unwrap();
            caller.sampler.enqueue_on(stream, &request, &target, workspace).unwrap();
            stream.end_capture(sys::CUgraphInstantiate_flags(0)).unwrap()
        };
    let read = |outputs: &ProcessedOutputs| -> (Vec<u32>, Vec<f32>, Vec<u32>) {
        (read_words(stream, &outputs.tokens), read_words(stream, &outputs.logprobs), read_words(stream, &outputs.top))
    };
    let mut uncaptured = Vec::new();
    for _ in 0..steps {
        call(&on_device, &mut outputs, &mut workspace, false);
        uncaptured.push(read(&outputs));
        caller.sampler.advance_steps_on(stream, &mut on_device, 1).unwrap();
    }
    let mut on_device = DeviceBatch::upload(stream, &rows, VOCAB).unwrap();
    let graph = call(&on_device, &mut outputs, &mut StreamWorkspace::new(), true).expect("one captured call");
    let mut replayed = Vec::new();
    for _ in 0..steps {
        graph.launch().unwrap();
        replayed.push(read(&outputs));
        caller.sampler.advance_steps_on(stream, &mut on_device, 1).unwrap();
    }
    let bits = |values: &[f32]| values.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    for (step, (a, b)) in uncaptured.iter().zip(&replayed).enumerate() {
        assert_eq!((&a.0, bits(&a.1), &a.2), (&b.0, bits(&b.1), &b.2), "step {step}");
        assert!(a.0.iter().all(|&t| (t as usize) < VOCAB), "step {step}");
    }
    let repeats = uncaptured.windows(2).filter(|pair| pair[0].0 == pair[1].0).count();
    assert_eq!(repeats, 0, "a step drew the same {batch} x {samples} tokens as the step before");

    let owned = CudaSampler::new().unwrap();
    let head = owned.random_lm_head(VOCAB, DIM, DType::BF16, 17, 0.05).unwrap();
    let hidden = owned.random_hidden(batch, DIM, DType::BF16, 18, 1.0).unwrap();
    let owned_batch = owned.upload_batch(&rows, VOCAB).unwrap();
    let mut out = owned.outputs(&owned_batch, samples).unwrap();
    owned.sample_into(&head, &hidden, &owned_batch, Draws::first(samples), &mut out).unwrap();
    let want = owned.read(&out).unwrap();
    let (tokens, values, top) = &uncaptured[0];
    let got = Sampled::from_outputs(samples as usize, tokens.clone(), Some(values), Some(top)).unwrap();
    assert_eq!(got.tokens, want.tokens);
    assert_eq!(got.top_logprobs, want.top_logprobs);
    assert_eq!(bits(&got.logprobs), bits(&want.logprobs));
    assert_eq!(bits(&got.processed_logprobs), bits(&want.processed_logprobs));
    assert!(got.top_logprobs.iter().enumerate().all(|(r, top)| top.len() == [5, 0][r % 2]));
    stream.synchronize().unwrap();
}

/// A processed call's outputs in the caller's buffers.
struct ProcessedOutputs {
    tokens: CudaSlice<u32>,
    logprobs: CudaSlice<f32>,
    top: CudaSlice<u32>,
}

/// `values` in `dtype` on `stream`, as the model would have left them there.
fn upload(stream: &Arc<CudaStream>, values: &[f32], dtype: DType) -> flashsample_tests::borrowed::DeviceValues {
    use flashsample::{Elements, Matrix};
    let elements = match dtype {
        DType::F32 => Elements::F32(values.to_vec()),
        DType::BF16 => Elements::BF16(values.iter().map(|&v| bf16::from_f32(v)).collect()),
        DType::F16 => Elements::F16(values.iter().map(|&v| f16::from_f32(v)).collect()),
    };
    let matrix = Matrix::new("values", 1, values.len(), elements).unwrap();
    flashsample_tests::borrowed::DeviceValues::upload(stream, &matrix)
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
    let on_device = DeviceBatch::upload(stream, &Batch::new(params), vocab).unwrap();
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
            let request = Request {
                lm_head: w.view(stream, vocab, dim),
                hidden: h.view(stream, batch, dim),
                batch: on_device.view(stream),
                draws: Draws::first(samples),
                shard: None,
            };
            let target = Target::tokens(OutputSlice::of_slice(&mut tokens, stream));
            caller.sampler.enqueue_on_with_variant(stream, &request, &target, &mut workspace, variant).unwrap();
            drop((request, target));
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

/// A speculative loop with no host copy in it: one verification round (the drafts copied from
/// the drafter's device buffer into the batch, the verification with its verdicts, the steps
/// moved past the emitted tokens) captured once in a CUDA graph and replayed round after
/// round. Each round's emitted tokens are the next tokens of plain decoding, token for token,
/// and each verdict keeps exactly the drafts that equal them: one sequence drafts plain
/// decoding's tokens (every draft kept), one random tokens, one a correct prefix of a length
/// that changes every round, and one drafts nothing.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_captured_speculative_round_replays_plain_decoding_as_drafts_change_on_the_device() {
    let caller = Caller::new();
    // One stream: nothing to track, and cudarc would otherwise wait inside the capture on
    // events recorded before it (which invalidates the capture).
    // SAFETY: every buffer of this test is used on this one stream only.
    unsafe { caller.context.disable_event_tracking() };
    let stream = &caller.stream;
    let (rounds, drafts_per_sequence) = (24usize, [4usize, 4, 3, 0]);
    let sequences = drafts_per_sequence.len();
    let params: Vec<_> = (0..sequences).map(|s| SamplingParams::new(0.9, 21, s as u32, 0)).collect();
    let w = caller.random(stream, VOCAB, DIM, 31, 0.05);
    let hidden: Vec<Vec<bf16>> = (0..sequences)
        .map(|s| uniform_values(DIM, 1.0, 40 + s as u64).into_iter().map(bf16::from_f32).collect())
        .collect();
    // Plain decoding: one row per sequence (its hidden state is the same at every position),
    // one step per call, the step moved on the device.
    let steps = rounds * (drafts_per_sequence.iter().max().unwrap() + 1);
    let h_plain = stream.clone_htod(&hidden.concat()).unwrap();
    let mut plain_batch = DeviceBatch::upload(stream, &Batch::new(params.clone()), VOCAB).unwrap();
    let mut tokens = caller.tokens(stream, sequences);
    let mut workspace = StreamWorkspace::new();
    let mut plain = vec![Vec::new(); sequences];
    for _ in 0..steps {
        caller.sample(stream, &w, &h_plain, &plain_batch, 1, Variant::Auto, &mut tokens, &mut workspace);
        for (s, token) in read_words(stream, &tokens).into_iter().enumerate() {
            plain[s].push(token);
        }
        caller.sampler.advance_steps_on(stream, &mut plain_batch, 1).unwrap();
    }

    // The verification batch, built once with placeholder drafts.
    let drafted: Vec<Drafted> = (0..sequences)
        .map(|s| Drafted {
            params: params[s],
            processing: Processing::default(),
            drafts: vec![0; drafts_per_sequence[s]],
        })
        .collect();
    let batch = Batch::verify(drafted).unwrap();
    let first_rows = batch.first_rows();
    let h_verify: Vec<bf16> = (0..sequences).flat_map(|s| hidden[s].repeat(drafts_per_sequence[s] + 1)).collect();
    let h_verify = stream.clone_htod(&h_verify).unwrap();
    let mut on_device = DeviceBatch::upload(stream, &batch, VOCAB).unwrap();
    let mut drafts = stream.alloc_zeros::<u32>(drafts_per_sequence.iter().sum::<usize>()).unwrap();
    let mut tokens = caller.tokens(stream, batch.rows());
    let mut accepted = caller.tokens(stream, sequences);
    let mut workspace = StreamWorkspace::new();

    // The workspace grows before the capture: a captured round allocates nothing.
    fn verification<'a>(
        stream: &'a Arc<CudaStream>,
        (w, h): (&'a CudaSlice<bf16>, &'a CudaSlice<bf16>),
        on_device: &'a DeviceBatch,
        tokens: &'a mut CudaSlice<u32>,
        accepted: &'a mut CudaSlice<u32>,
    ) -> (Request<'a>, Target<'a>) {
        let target = Target {
            accepted: Some(OutputSlice::of_slice(accepted, stream)),
            ..Target::tokens(OutputSlice::of_slice(tokens, stream))
        };
        (request(stream, w, h, on_device, 1), target)
    }
    {
        let (request, target) = verification(stream, (&w, &h_verify), &on_device, &mut tokens, &mut accepted);
        workspace.reserve(stream, &caller.sampler.plan(&request, &target).unwrap()).unwrap();
    }
    stream.synchronize().unwrap();
    stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).unwrap();
    on_device.write_drafts(stream, &drafts).unwrap();
    {
        let (request, target) = verification(stream, (&w, &h_verify), &on_device, &mut tokens, &mut accepted);
        caller.sampler.enqueue_on(stream, &request, &target, &mut workspace).unwrap();
    }
    caller.sampler.advance_verified_on(stream, &mut on_device, &accepted).unwrap();
    let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0)).unwrap().expect("one captured round");

    let mut rng = rand::rngs::StdRng::seed_from_u64(77);
    let mut position = vec![0usize; sequences];
    let mut kept = vec![0usize; sequences];
    for round in 0..rounds {
        // The drafter's proposals for each sequence's next positions, written to its buffer.
        let proposals: Vec<u32> = (0..sequences)
            .flat_map(|s| {
                let truth = &plain[s][position[s]..position[s] + drafts_per_sequence[s]];
                let correct = match s {
                    0 => truth.len(),
                    1 => 0,
                    _ => round % (truth.len() + 1),
                };
                let mut proposal = truth.to_vec();
                for (j, token) in proposal.iter_mut().enumerate().skip(correct) {
                    // A token that differs from plain decoding's at its position.
                    *token = (truth[j] + rng.random_range(1..VOCAB as u32)) % VOCAB as u32;
                }
                proposal
            })
            .collect();
        stream.memcpy_htod(&proposals, &mut drafts).unwrap();
        graph.launch().unwrap();
        let (tokens, accepted) = (read_words(stream, &tokens), read_words(stream, &accepted));
        let mut offset = 0;
        for s in 0..sequences {
            let proposal = &proposals[offset..offset + drafts_per_sequence[s]];
            offset += drafts_per_sequence[s];
            let truth = &plain[s][position[s]..=position[s] + drafts_per_sequence[s]];
            let expected = proposal.iter().zip(truth).take_while(|(a, b)| a == b).count();
            assert_eq!(accepted[s] as usize, expected, "round {round}, sequence {s}");
            let emitted = &tokens[first_rows[s]..=first_rows[s] + expected];
            assert_eq!(emitted, &truth[..=expected], "round {round}, sequence {s}");
            position[s] += expected + 1;
            kept[s] += expected;
        }
    }
    assert_eq!(kept[0], rounds * drafts_per_sequence[0], "the exact drafter had a draft refused");
    assert_eq!(kept[2], (0..rounds).map(|round| round % (drafts_per_sequence[2] + 1)).sum::<usize>());
    assert_eq!(position[3], rounds, "a sequence without drafts emits one token a round");
    stream.synchronize().unwrap();
}

/// The device-side speculative loop's rules name their argument: drafts for a batch that
/// verifies nothing, of another length, or counted in a penalty's history; verdicts of another
/// length.
#[test]
#[ignore = "needs a CUDA GPU"]
fn device_drafts_and_verdicts_check_their_shapes() {
    let caller = Caller::new();
    let stream = &caller.stream;
    let drafted = |penalties: flashsample::Penalties| Drafted {
        params: SamplingParams::new(1.0, 1, 0, 0),
        processing: Processing { penalties, history: vec![5], ..Processing::default() },
        drafts: vec![1, 2, 3],
    };
    let three = stream.alloc_zeros::<u32>(3).unwrap();
    let two = stream.alloc_zeros::<u32>(2).unwrap();
    let name = |e: flashsample::Error| match e {
        flashsample::Error::InvalidArgument { argument, .. } => Some(argument),
        _ => None,
    };

    let mut plain = DeviceBatch::upload(stream, &Batch::new(params(2, 1)), VOCAB).unwrap();
    assert_eq!(name(plain.write_drafts(stream, &three).unwrap_err()).as_deref(), Some("drafts"));
    assert_eq!(
        name(caller.sampler.advance_verified_on(stream, &mut plain, &two).unwrap_err()).as_deref(),
        Some("batch")
    );

    let mut verified =
        DeviceBatch::upload(stream, &Batch::verify(vec![drafted(flashsample::Penalties::NONE)]).unwrap(), VOCAB)
            .unwrap();
    assert_eq!(name(verified.write_drafts(stream, &two).unwrap_err()).as_deref(), Some("drafts"));
    verified.write_drafts(stream, &three).unwrap();
    assert_eq!(
        name(caller.sampler.advance_verified_on(stream, &mut verified, &two).unwrap_err()).as_deref(),
        Some("accepted")
    );

    let repetition = flashsample::Penalties { repetition: 1.2, ..flashsample::Penalties::NONE };
    let mut penalised = DeviceBatch::upload(stream, &Batch::verify(vec![drafted(repetition)]).unwrap(), VOCAB).unwrap();
    assert_eq!(name(penalised.write_drafts(stream, &three).unwrap_err()).as_deref(), Some("drafts"));
    stream.synchronize().unwrap();
}
