//! A decode loop over cudarc buffers in borrowed mode: the caller owns the context, the
//! stream and every buffer; flashsample queues its kernels on that stream and allocates
//! nothing once warm. Each step a stand-in for the model's forward pass writes the hidden
//! states on the stream (here: random values from the library's fill kernel), the sampler
//! draws one token per row into that step's slice of a `[STEPS, B]` token buffer, and a tiny
//! kernel advances the rows' decode step on the device. Nothing is copied to the host until
//! the loop ends. The same step is then captured once in a CUDA graph and replayed; the
//! replay draws the same tokens.
//!
//! `cargo run --release -p flashsample-cudarc-example` (needs an NVIDIA GPU).

use flashsample::cudarc::driver::{CudaContext, DevicePtrMut, sys};
use flashsample::{
    DType, DeviceMatrix, DeviceRows, Draws, ModuleChoice, SampleRequest, SamplingParams, StreamSampler,
    StreamWorkspace, Variant,
};

const VOCAB: usize = 128_256;
const DIM: usize = 4096;
const BATCH: usize = 16;
const STEPS: usize = 8;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let context = CudaContext::new(0)?;
    let stream = context.new_stream()?;
    let sampler = StreamSampler::on_context(&context, ModuleChoice::from_environment()?)?;
    let element = DType::BF16;

    // The caller's buffers: the LM head, the hidden states the model writes each step, the row
    // parameters (temperature, seed, stream, step) and the tokens of every step.
    let mut lm_head = stream.alloc_zeros::<u16>(VOCAB * DIM)?;
    let mut hidden = stream.alloc_zeros::<u16>(BATCH * DIM)?;
    let mut tokens = stream.alloc_zeros::<u32>(STEPS * BATCH)?;
    let params: Vec<_> = (0..BATCH).map(|b| SamplingParams::new(0.7, 2026, b as u32, 0)).collect();
    let rows = DeviceRows::upload(&stream, &params)?;
    let mut workspace = StreamWorkspace::new();

    let (w, _w) = lm_head.device_ptr_mut(&stream);
    let (h, _h) = hidden.device_ptr_mut(&stream);
    let (t, _t) = tokens.device_ptr_mut(&stream);
    let raw_stream = stream.cu_stream().cast();
    // SAFETY: `w` holds VOCAB × DIM bf16 on this stream.
    unsafe { sampler.fill_uniform(raw_stream, w, VOCAB * DIM, element, 1, 0.05)? };
    let step_request = |step: usize| SampleRequest {
        lm_head: DeviceMatrix::contiguous(w, VOCAB, DIM, element),
        hidden: DeviceMatrix::contiguous(h, BATCH, DIM, element),
        row_params: rows.address(),
        tokens: t + (step * BATCH * 4) as u64,
        draws: Draws::first(1),
        variant: Variant::Auto,
        processing: None,
        shard: None,
    };
    let first = step_request(0);
    let space = workspace.ensure(&stream, sampler.workspace_bytes(&first.lm_head, &first.hidden, 1, Variant::Auto)?)?;

    for step in 0..STEPS {
        // SAFETY (the calls): every buffer lives on `stream`, with the extents stated; the maps
        // in the workspace are this loop's (same W, H and B every step).
        unsafe {
            // The model's forward pass would write `hidden` here.
            sampler.fill_uniform(raw_stream, h, BATCH * DIM, element, 100 + step as u64, 2.0)?;
            // `W` and `H` stay put, so after the first step the tensor maps the first call
            // left in the workspace serve every later one (one launch fewer).
            if step == 0 {
                sampler.sample(raw_stream, &step_request(step), space)?;
            } else {
                sampler.sample_with_stored_maps(raw_stream, &step_request(step), space)?;
            }
            sampler.advance_steps(raw_stream, rows.address(), BATCH, 1)?;
        }
    }
    drop((_t, _h));
    let all = stream.clone_dtoh(&tokens)?;
    for (step, row) in all.chunks(BATCH).enumerate() {
        println!("step {step}: {row:?}");
    }
    assert!(all.iter().all(|&token| (token as usize) < VOCAB), "a token outside the vocabulary");

    // The last step again, captured once and replayed: reset the rows' step to the last one.
    let last = STEPS - 1;
    let replay_rows = DeviceRows::upload(
        &stream,
        &params.iter().map(|p| SamplingParams { step: last as u32, ..*p }).collect::<Vec<_>>(),
    )?;
    let mut replayed = stream.alloc_zeros::<u32>(BATCH)?;
    let (r, _r) = replayed.device_ptr_mut(&stream);
    let request = SampleRequest { row_params: replay_rows.address(), tokens: r, ..step_request(last) };
    stream.synchronize()?;
    stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
    // SAFETY: as above; `hidden` still holds the last step's states. Captured, not run.
    let captured = unsafe { sampler.sample(raw_stream, &request, space) };
    let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0))?.ok_or("nothing captured")?;
    captured?;
    graph.launch()?;
    drop(_r);
    let replay = stream.clone_dtoh(&replayed)?;
    assert_eq!(replay, all[last * BATCH..], "the graph replay drew other tokens than the loop");
    println!("graph replay of step {last}: {replay:?} (the same tokens)");
    stream.synchronize()?;
    Ok(())
}
