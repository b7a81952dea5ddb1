//! A generation loop on candle: a Qwen2 (random weights, candle-transformers' code) decodes
//! 32 tokens for 4 sequences; each next token is drawn by flashsample's candle adapter from the
//! model's final hidden states and the LM head, on candle's stream, and fed back as the next
//! input without leaving the GPU. The tokens are copied to the host once, at the end.
//!
//! Build after `source scripts/candle-cuda-env.sh` (candle's CUDA backend needs nvcc):
//! `cargo run --release --manifest-path examples/candle/Cargo.toml`.

use candle_core::{DType, Device, Tensor};
use flashsample::{Batch, CandleSampler, SamplingParams};
use flashsample_candle_example::tiny_qwen2;

const BATCH: usize = 4;
const PROMPT: usize = 8;
const STEPS: usize = 32;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let device = Device::new_cuda(0)?;
    let mut tiny = tiny_qwen2(&device, DType::BF16)?;
    let vocab = tiny.config.vocab_size as u32;
    let prompt: Vec<u32> = (0..BATCH * PROMPT).map(|i| (i as u32 * 2_654_435_761) % vocab).collect();
    let mut input = Tensor::from_vec(prompt, (BATCH, PROMPT), &device)?;
    // One noise stream per sequence; the step starts at the prompt's length.
    let batch = Batch::new((0..BATCH).map(|b| SamplingParams::new(0.8, 42, b as u32, PROMPT as u32)).collect());
    let mut sampler = CandleSampler::new(&device, &batch)?;
    let mut offset = 0;
    let mut generated = Vec::with_capacity(STEPS);
    for _ in 0..STEPS {
        let hidden = tiny.last_hidden(&input, offset)?;
        offset += input.dim(1)?;
        let next = sampler.sample(&tiny.lm_head, &hidden, 1)?.tokens;
        sampler.advance_steps(1)?;
        generated.push(next.clone());
        input = next;
    }
    let tokens = Tensor::cat(&generated, 1)?.to_vec2::<u32>()?;
    for (b, row) in tokens.iter().enumerate() {
        assert!(row.iter().all(|&t| t < vocab), "sequence {b}: a token outside the vocabulary");
        println!("sequence {b}: {row:?}");
    }
    println!("{BATCH} x {STEPS} tokens drawn on {:?} by the {:?} module", device.location(), sampler.module());
    Ok(())
}
