//! A decode loop over cudarc buffers in borrowed mode: the caller owns the context, the
//! stream and every buffer; flashsample queues its kernels on that stream and allocates
//! nothing once warm. Each step a stand-in for the model's forward pass writes the hidden
//! states on the stream, the sampler draws one token per row into that step's slice of a
//! `[STEPS, B]` token buffer through the safe layer, and a tiny kernel advances the rows'
//! decode step on the device. Nothing is copied to the host until the loop ends. The same step
//! is then captured once in a CUDA graph and replayed; the replay draws the same tokens.
//!
//! `cargo run --release -p flashsample-cudarc-example` (needs an NVIDIA GPU).

use flashsample::cudarc::driver::{CudaContext, sys};
use flashsample::half::bf16;
use flashsample::{
    Batch, DeviceBatch, DeviceMatrix, Draws, ModuleChoice, OutputSlice, Request, SamplingParams, StreamSampler,
    StreamWorkspace, Target,
};

const VOCAB: usize = 128_256;
const DIM: usize = 4096;
const BATCH: usize = 16;
const STEPS: usize = 8;

/// Deterministic values in `[-scale, scale)`: the stand-in for a model's weights and states.
fn values(len: usize, seed: u64, scale: f32) -> Vec<bf16> {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            bf16::from_f32(((state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale)
        })
        .collect()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let context = CudaContext::new(0)?;
    let stream = context.new_stream()?;
    let sampler = StreamSampler::on_context(&context, ModuleChoice::from_environment()?)?;

    // The caller's buffers: the LM head, the hidden states the model writes each step, the
    // batch (each row's temperature, seed, sequence and step) and the tokens of every step.
    let lm_head = stream.clone_htod(&values(VOCAB * DIM, 1, 0.05))?;
    let mut hidden = stream.alloc_zeros::<bf16>(BATCH * DIM)?;
    let mut tokens = stream.alloc_zeros::<u32>(STEPS * BATCH)?;
    let params: Vec<_> = (0..BATCH).map(|b| SamplingParams::new(0.7, 2026, b as u32, 0)).collect();
    let mut batch = DeviceBatch::upload(&stream, &Batch::new(params.clone()), VOCAB)?;
    let mut workspace = StreamWorkspace::new();

    for step in 0..STEPS {
        // The model's forward pass would write `hidden` here.
        stream.memcpy_htod(&values(BATCH * DIM, 100 + step as u64, 2.0), &mut hidden)?;
        let mut slot = tokens.slice_mut(step * BATCH..(step + 1) * BATCH);
        let request = Request {
            lm_head: DeviceMatrix::of_slice(&lm_head, &stream, VOCAB, DIM)?,
            hidden: DeviceMatrix::of_slice(&hidden, &stream, BATCH, DIM)?,
            batch: batch.view(&stream),
            draws: Draws::first(1),
            shard: None,
        };
        // `W` and `H` stay put, so after the first step the workspace's stored tensor maps
        // serve every later one (one launch fewer).
        let target = Target::tokens(OutputSlice::of_slice(&mut slot, &stream));
        sampler.enqueue_on(&stream, &request, &target, &mut workspace)?;
        drop((request, target));
        sampler.advance_steps_on(&stream, &mut batch, 1)?;
    }
    let all = stream.clone_dtoh(&tokens)?;
    for (step, row) in all.chunks(BATCH).enumerate() {
        println!("step {step}: {row:?}");
    }
    assert!(all.iter().all(|&token| (token as usize) < VOCAB), "a token outside the vocabulary");

    // The last step again, captured once and replayed: a batch whose rows are at that step.
    let last = STEPS - 1;
    let at_last: Vec<_> = params.iter().map(|p| SamplingParams { step: last as u32, ..*p }).collect();
    let replay_batch = DeviceBatch::upload(&stream, &Batch::new(at_last), VOCAB)?;
    let mut replayed = stream.alloc_zeros::<u32>(BATCH)?;
    let request = Request {
        lm_head: DeviceMatrix::of_slice(&lm_head, &stream, VOCAB, DIM)?,
        hidden: DeviceMatrix::of_slice(&hidden, &stream, BATCH, DIM)?,
        batch: replay_batch.view(&stream),
        draws: Draws::first(1),
        shard: None,
    };
    let target = Target::tokens(OutputSlice::of_slice(&mut replayed, &stream));
    // Under capture the workspace must already be large enough: nothing is allocated there.
    workspace.reserve(&stream, &sampler.plan(&request, &target)?)?;
    stream.synchronize()?;
    stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
    let captured = sampler.enqueue_on(&stream, &request, &target, &mut workspace);
    let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0))?.ok_or("nothing captured")?;
    captured?;
    drop((request, target));
    graph.launch()?;
    let replay = stream.clone_dtoh(&replayed)?;
    assert_eq!(replay, all[last * BATCH..], "the graph replay drew other tokens than the loop");
    println!("graph replay of step {last}: {replay:?} (the same tokens)");
    stream.synchronize()?;
    Ok(())
}
