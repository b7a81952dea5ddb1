//! Speculative decoding whose tokens do not depend on the drafter.
//!
//! A Qwen2 target (candle-transformers' model code, random f32 weights) generates 64 tokens
//! for each of 8 sequences, first by plain decoding (one token per forward), then by
//! speculative decoding with three drafters: a smaller Qwen2 that samples its drafts with the
//! target's keys (the same seed, sequence, step and draw), a drafter proposing random tokens,
//! and the target itself. Each round the target's forward over the pending token and the drafts
//! gives the hidden states of every drafted position; flashsample's candle adapter verifies them
//! all in one call ([`Batch::verify`]): each position is sampled with plain decoding's keys and
//! processing, the drafts are kept while they equal those tokens, and the first token that
//! differs is the target's. So every drafter's tokens are plain decoding's; only how many
//! rounds it takes changes. Twice: plain sampling at T = 0.8, and top-p 0.9 with a repetition
//! penalty (which sees the drafts before each position).
//!
//! Checked: each emitted token is what plain sampling draws from the verification's own hidden
//! state at that position (the sampler's identity, exact), the target as its own drafter has
//! every draft kept, and the tokens equal true one-token decoding (end to end: the forward
//! over several tokens may differ from the one-token forward in the last bits, so this agreement
//! is reported; with f32 weights it is exact in practice).
//!
//! `cargo run --release -p flashsample-speculative-example` (the CPU); with feature `cuda`
//! (after `source scripts/candle-cuda-env.sh`) and the argument `cuda`, on GPU 0.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};

use candle_core::{DType, Device, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{Activation, Init, VarBuilder};
use candle_transformers::models::qwen2::{Config, Model};
use flashsample::{Batch, CandleSampler, Drafted, Penalties, Processing, SamplingParams};
use rand::{Rng, SeedableRng};

const SEQUENCES: usize = 8;
const PROMPT: usize = 8;
const GENERATED: usize = 64;
/// Drafts per round (fewer when a sequence nears its end).
const DRAFTS: usize = 4;
const VOCAB: usize = 32_000;
const SEED: u64 = 2026;

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

/// Random weights from a fixed seed per tensor name (candle's CPU generator cannot be seeded):
/// constants as asked (the norms' ones), everything else uniform with the asked spread.
struct SeededWeights {
    seed: u64,
}

impl SimpleBackend for SeededWeights {
    fn get(&self, shape: Shape, name: &str, init: Init, dtype: DType, device: &Device) -> candle_core::Result<Tensor> {
        let bound = match init {
            Init::Const(value) => return Tensor::full(value as f32, shape, device)?.to_dtype(dtype),
            Init::Randn { stdev, .. } => stdev * 3f64.sqrt(),
            Init::Uniform { lo, up } => (up - lo) / 2.0,
            Init::Kaiming { .. } => 1.0 / (*shape.dims().last().unwrap_or(&1) as f64).sqrt(),
        };
        let mut hasher = DefaultHasher::new();
        (self.seed, name).hash(&mut hasher);
        let mut rng = rand::rngs::StdRng::seed_from_u64(hasher.finish());
        let bound = bound as f32;
        let values: Vec<f32> = (0..shape.elem_count()).map(|_| rng.random_range(-bound..bound)).collect();
        Tensor::from_vec(values, shape, device)?.to_dtype(dtype)
    }

    fn get_unchecked(&self, name: &str, _: DType, _: &Device) -> candle_core::Result<Tensor> {
        candle_core::bail!("{name}: the seeded weights need a shape")
    }

    fn contains_tensor(&self, _: &str) -> bool {
        true
    }
}

/// A Qwen2 with its LM head `[V, D]`.
#[derive(Clone)]
struct LanguageModel {
    model: Model,
    lm_head: Tensor,
}

impl LanguageModel {
    /// Qwen2's architecture at width `hidden` with `layers` layers, V = 32,000, f32 weights
    /// from `seed`.
    fn qwen2(device: &Device, hidden: usize, layers: usize, seed: u64) -> Result<LanguageModel> {
        let config = Config {
            vocab_size: VOCAB,
            hidden_size: hidden,
            intermediate_size: hidden * 11 / 4,
            num_hidden_layers: layers,
            num_attention_heads: hidden / 64,
            num_key_value_heads: (hidden / 128).max(1),
            max_position_embeddings: 4096,
            sliding_window: 4096,
            max_window_layers: layers,
            tie_word_embeddings: false,
            rope_theta: 10_000.0,
            rms_norm_eps: 1e-6,
            use_sliding_window: false,
            hidden_act: Activation::Silu,
        };
        let vb = VarBuilder::from_backend(Box::new(SeededWeights { seed }), DType::F32, device.clone());
        let model = Model::new(&config, vb.clone())?;
        // Spread enough that the next token is far from uniform.
        let init = Init::Randn { mean: 0.0, stdev: 0.15 };
        let lm_head = vb.pp("lm_head").get_with_hints((VOCAB, hidden), "weight", init)?;
        Ok(LanguageModel { model, lm_head })
    }

    /// The final hidden states `[L, D]` after `tokens` at position `offset` (the model's cache
    /// holds the `offset` tokens before).
    fn forward(&mut self, tokens: &[u32], offset: usize, device: &Device) -> Result<Tensor> {
        let input = Tensor::new(tokens, device)?.unsqueeze(0)?;
        Ok(self.model.forward(&input, offset, None)?.squeeze(0)?)
    }
}

/// How the rows are processed.
#[derive(Clone, Copy, Debug)]
enum Mode {
    Plain,
    TopPWithRepetitionPenalty,
}

impl Mode {
    fn temperature(self) -> f32 {
        0.8
    }

    /// A row's processing after `history` (the prompt and the tokens so far).
    fn processing(self, history: &[u32]) -> Processing {
        match self {
            Mode::Plain => Processing::default(),
            Mode::TopPWithRepetitionPenalty => Processing {
                top_p: 0.9,
                history: history.to_vec(),
                penalties: Penalties { repetition: 1.2, ..Penalties::NONE },
                ..Processing::default()
            },
        }
    }
}

/// One sequence mid-generation: the target's cache holds `history` but its last token
/// (`pending`), whose hidden state is the next position's.
#[derive(Clone)]
struct Sequence {
    target: LanguageModel,
    /// The drafting model's copy, its cache in step with the target's.
    drafter: Option<LanguageModel>,
    /// The prompt and the tokens generated so far.
    history: Vec<u32>,
    /// The tokens in the caches.
    cached: usize,
}

impl Sequence {
    fn pending(&self) -> u32 {
        *self.history.last().expect("a prompt")
    }

    fn generated(&self) -> usize {
        self.history.len() - PROMPT
    }

    /// The decode step of the next token: the prompt's length, then one more per token.
    fn step(&self) -> u32 {
        self.history.len() as u32
    }
}

/// The prompts: `PROMPT` tokens each.
fn prompts() -> Vec<Vec<u32>> {
    (0..SEQUENCES)
        .map(|s| (0..PROMPT).map(|i| ((s * PROMPT + i) as u64 * 2_654_435_761 % VOCAB as u64) as u32).collect())
        .collect()
}

/// The sequences at their prompts, the caches holding every prompt token but the last.
fn start(target: &LanguageModel, drafter: Option<&LanguageModel>, device: &Device) -> Result<Vec<Sequence>> {
    prompts()
        .into_iter()
        .map(|prompt| {
            let mut sequence =
                Sequence { target: target.clone(), drafter: drafter.cloned(), history: prompt, cached: 0 };
            sequence.target.model.clear_kv_cache();
            let before = sequence.history[..PROMPT - 1].to_vec();
            sequence.target.forward(&before, 0, device)?;
            if let Some(drafter) = sequence.drafter.as_mut() {
                drafter.model.clear_kv_cache();
                drafter.forward(&before, 0, device)?;
            }
            sequence.cached = PROMPT - 1;
            Ok(sequence)
        })
        .collect()
}

/// Sequence `s`'s parameters at `step`.
fn params(mode: Mode, s: usize, step: u32) -> SamplingParams {
    SamplingParams::new(mode.temperature(), SEED, s as u32, step)
}

/// One plain draw for each row of `hidden` `[rows, D]` from `lm_head` with `batch`.
fn draw(device: &Device, lm_head: &Tensor, hidden: &Tensor, batch: &Batch) -> Result<Vec<u32>> {
    let mut sampler = CandleSampler::new(device, batch)?;
    Ok(sampler.sample(lm_head, hidden, 1)?.tokens.flatten_all()?.to_vec1()?)
}

/// Plain decoding: one token per forward for every sequence.
fn decode_plainly(target: &LanguageModel, mode: Mode, device: &Device) -> Result<Vec<Vec<u32>>> {
    let mut sequences = start(target, None, device)?;
    for _ in 0..GENERATED {
        let mut hidden = Vec::with_capacity(SEQUENCES);
        for sequence in &mut sequences {
            let pending = sequence.pending();
            hidden.push(sequence.target.forward(&[pending], sequence.cached, device)?);
            sequence.cached += 1;
        }
        let batch = Batch::with_processing(
            sequences.iter().enumerate().map(|(s, q)| params(mode, s, q.step())).collect(),
            sequences.iter().map(|q| mode.processing(&q.history)).collect(),
        );
        let tokens = draw(device, &target.lm_head, &Tensor::cat(&hidden, 0)?, &batch)?;
        for (sequence, token) in sequences.iter_mut().zip(tokens) {
            sequence.history.push(token);
        }
    }
    Ok(sequences.into_iter().map(|q| q.history[PROMPT..].to_vec()).collect())
}

/// Who proposes the drafts.
#[derive(Clone, Copy)]
enum Drafter<'a> {
    /// A model sampling with the target's keys and processing.
    SameKeys(&'a LanguageModel),
    /// Uniformly random tokens.
    Random,
    /// The target itself (its drafts are plain decoding's tokens).
    Target,
}

impl Drafter<'_> {
    fn name(self) -> &'static str {
        match self {
            Drafter::SameKeys(_) => "a smaller model with the same keys",
            Drafter::Random => "random tokens",
            Drafter::Target => "the target itself",
        }
    }
}

/// `count` drafts for each sequence from a model (the drafting copy or the target),
/// autoregressively from a copy of its cache, each sampled with the target's keys and
/// processing.
fn draft_with_model(
    sequences: &[Sequence],
    counts: &[usize],
    use_drafter: bool,
    mode: Mode,
    device: &Device,
) -> Result<Vec<Vec<u32>>> {
    let model_of =
        |q: &Sequence| if use_drafter { q.drafter.clone().expect("a drafting model") } else { q.target.clone() };
    let mut copies: Vec<LanguageModel> = sequences.iter().map(model_of).collect();
    let mut drafts: Vec<Vec<u32>> = vec![Vec::new(); sequences.len()];
    for j in 0..counts.iter().copied().max().unwrap_or(0) {
        let live: Vec<usize> = (0..sequences.len()).filter(|&s| j < counts[s]).collect();
        let mut hidden = Vec::with_capacity(live.len());
        for &s in &live {
            let last = drafts[s].last().copied().unwrap_or(sequences[s].pending());
            hidden.push(copies[s].forward(&[last], sequences[s].cached + j, device)?);
        }
        let batch = Batch::with_processing(
            live.iter().map(|&s| params(mode, s, sequences[s].step() + j as u32)).collect(),
            live.iter().map(|&s| mode.processing(&[&sequences[s].history[..], &drafts[s]].concat())).collect(),
        );
        let lm_head = &copies[live[0]].lm_head;
        for (&s, token) in live.iter().zip(draw(device, lm_head, &Tensor::cat(&hidden, 0)?, &batch)?) {
            drafts[s].push(token);
        }
    }
    Ok(drafts)
}

/// What a speculative run did.
struct Run {
    tokens: Vec<Vec<u32>>,
    rounds: usize,
    drafted: usize,
    accepted: usize,
}

/// Speculative decoding with `drafter`: each round drafts, verifies every sequence's drafts in
/// one call, checks each emitted token against plain sampling of its own hidden state, and
/// moves the caches past the emitted tokens.
fn decode_speculatively(target: &LanguageModel, drafter: Drafter, mode: Mode, device: &Device) -> Result<Run> {
    let drafting_model = match drafter {
        Drafter::SameKeys(model) => Some(model),
        _ => None,
    };
    let mut sequences = start(target, drafting_model, device)?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(SEED);
    let mut run = Run { tokens: Vec::new(), rounds: 0, drafted: 0, accepted: 0 };
    let mut live: Vec<usize> = (0..SEQUENCES).collect();
    while !live.is_empty() {
        let group: Vec<Sequence> = live.iter().map(|&s| sequences[s].clone()).collect();
        // Never more than the sequence still generates: the drafts and the target's token.
        let counts: Vec<usize> = group.iter().map(|q| DRAFTS.min(GENERATED - q.generated() - 1)).collect();
        let drafts = match drafter {
            Drafter::SameKeys(_) => draft_with_model(&group, &counts, true, mode, device)?,
            Drafter::Target => draft_with_model(&group, &counts, false, mode, device)?,
            Drafter::Random => {
                counts.iter().map(|&k| (0..k).map(|_| rng.random_range(0..VOCAB as u32)).collect()).collect()
            }
        };
        // The target's hidden states at every drafted position and the one after, from one
        // forward over the pending token and the drafts; the caches are rewound after.
        let mut hidden = Vec::with_capacity(group.len());
        for (q, d) in group.iter().zip(&drafts) {
            let mut model = q.target.clone();
            hidden.push(model.forward(&[&[q.pending()][..], d].concat(), q.cached, device)?);
        }
        let hidden = Tensor::cat(&hidden, 0)?;
        let batch = Batch::verify(
            live.iter()
                .zip(&group)
                .zip(&drafts)
                .map(|((&s, q), d)| Drafted {
                    params: params(mode, s, q.step()),
                    processing: mode.processing(&q.history),
                    drafts: d.clone(),
                })
                .collect(),
        )?;
        let mut sampler = CandleSampler::new(device, &batch)?;
        let verified = sampler.sample(&target.lm_head, &hidden, 1)?;
        let tokens: Vec<u32> = verified.tokens.flatten_all()?.to_vec1()?;
        let accepted: Vec<u32> = verified.accepted.expect("a verification's verdicts").to_vec1()?;
        let first_rows = batch.first_rows();
        // The sampler's identity: each emitted token is plain sampling's from its own row.
        let (mut rows, mut params_of, mut processing_of, mut emitted_all) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (g, (&s, q)) in live.iter().zip(&group).enumerate() {
            let emitted = &tokens[first_rows[g]..=first_rows[g] + accepted[g] as usize];
            for (j, &token) in emitted.iter().enumerate() {
                rows.push(first_rows[g] + j);
                params_of.push(params(mode, s, q.step() + j as u32));
                processing_of.push(mode.processing(&[&q.history[..], &emitted[..j]].concat()));
                emitted_all.push(token);
            }
        }
        let row_index = Tensor::new(rows.iter().map(|&r| r as u32).collect::<Vec<_>>().as_slice(), device)?;
        let plain = draw(
            device,
            &target.lm_head,
            &hidden.index_select(&row_index, 0)?,
            &Batch::with_processing(params_of, processing_of),
        )?;
        assert_eq!(plain, emitted_all, "{}: an emitted token is not plain sampling's", drafter.name());
        run.rounds += 1;
        for (g, &s) in live.iter().enumerate() {
            let a = accepted[g] as usize;
            run.drafted += drafts[g].len();
            run.accepted += a;
            let emitted = tokens[first_rows[g]..=first_rows[g] + a].to_vec();
            let sequence = &mut sequences[s];
            // The caches take the pending token and the kept drafts, from the copies made
            // before this round's forwards.
            let kept = [&[sequence.pending()][..], &emitted[..a]].concat();
            sequence.target.forward(&kept, sequence.cached, device)?;
            if let Some(model) = sequence.drafter.as_mut() {
                model.forward(&kept, sequence.cached, device)?;
            }
            sequence.cached += kept.len();
            sequence.history.extend_from_slice(&emitted);
        }
        live.retain(|&s| sequences[s].generated() < GENERATED);
    }
    run.tokens = sequences.into_iter().map(|q| q.history[PROMPT..].to_vec()).collect();
    Ok(run)
}

fn device() -> Result<Device> {
    match std::env::args().nth(1).as_deref() {
        None | Some("cpu") => Ok(Device::Cpu),
        Some("cuda") => Ok(Device::new_cuda(0)?),
        Some(other) => Err(format!("unknown device {other}: cpu or cuda").into()),
    }
}

fn main() -> Result<()> {
    let device = device()?;
    let target = LanguageModel::qwen2(&device, 256, 2, 1)?;
    let small = LanguageModel::qwen2(&device, 128, 1, 2)?;
    for mode in [Mode::Plain, Mode::TopPWithRepetitionPenalty] {
        let plain = decode_plainly(&target, mode, &device)?;
        for drafter in [Drafter::SameKeys(&small), Drafter::Random, Drafter::Target] {
            let run = decode_speculatively(&target, drafter, mode, &device)?;
            let agree: usize =
                run.tokens.iter().zip(&plain).map(|(a, b)| a.iter().zip(b).filter(|(x, y)| x == y).count()).sum();
            println!(
                "{mode:?}, drafts from {}: {} rounds, {} of {} drafts kept ({:.1} %); every token plain sampling's from its hidden state; {agree} of {} equal to one-token decoding",
                drafter.name(),
                run.rounds,
                run.accepted,
                run.drafted,
                100.0 * run.accepted as f64 / run.drafted.max(1) as f64,
                SEQUENCES * GENERATED,
            );
            if let Drafter::Target = drafter {
                assert_eq!(run.accepted, run.drafted, "the target as its own drafter has a draft refused");
            }
        }
    }
    Ok(())
}
