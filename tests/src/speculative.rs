//! Speculative verification's bodies: a verification emits the tokens plain decoding draws,
//! whatever the drafter proposed, and a drafter sampling with the same keys agrees with the
//! target as often as the Gumbel coupling predicts.

use flashsample::{Batch, DType, Drafted, Draws, Matrix, Penalties, Processing, SamplingParams};
use rand::{Rng, SeedableRng};

use crate::processing::{split_rows, uneven_bounds};
use crate::{Backend, chi_square, matrix_of, random_matrix};

/// One sequence of the test: its parameters at its first position, its processing (its
/// history is the prompt) and how many tokens it drafts.
struct Sequence {
    params: SamplingParams,
    processing: Processing,
    drafts: usize,
}

/// Sequences of every kind a verification batch mixes: plain, greedy, top-p 0.9 with a
/// repetition penalty (which sees the drafts before each position), min-p, top-k with
/// frequency and presence penalties, and a greedy row with a repetition penalty so strong that
/// each token it drew must give way to another at the next position (its hidden state is the
/// same at every position: only the history tells the positions apart); from none to six
/// drafts each.
fn sequences() -> Vec<Sequence> {
    let penalised =
        |penalties: Penalties, extra: Processing| Processing { history: vec![3, 17, 17, 400], penalties, ..extra };
    let repetition = Penalties { repetition: 1.3, ..Penalties::NONE };
    let counting = Penalties { frequency: 0.4, presence: 0.3, ..Penalties::NONE };
    vec![
        Sequence { params: SamplingParams::new(1.0, 11, 0, 5), processing: Processing::default(), drafts: 3 },
        Sequence { params: SamplingParams::new(0.0, 11, 1, 9), processing: Processing::default(), drafts: 2 },
        Sequence {
            params: SamplingParams::new(0.8, 12, 2, 0),
            processing: penalised(repetition, Processing { top_p: 0.9, ..Processing::default() }),
            drafts: 6,
        },
        Sequence {
            params: SamplingParams::new(1.3, 12, 3, 40),
            processing: Processing { min_p: 0.05, ..Processing::default() },
            drafts: 0,
        },
        Sequence {
            params: SamplingParams::new(0.7, 13, 4, 2),
            processing: penalised(counting, Processing { top_k: Some(20), ..Processing::default() }),
            drafts: 4,
        },
        Sequence {
            params: SamplingParams::new(0.0, 14, 5, 1),
            processing: penalised(Penalties { repetition: 50.0, ..Penalties::NONE }, Processing::default()),
            drafts: 5,
        },
    ]
}

/// The sequence whose hidden state repeats at every position.
const REPEATING: usize = 5;

/// The tokens plain decoding draws for each sequence at its positions `0 ..= drafts`, one
/// step at a time (every sequence in one batch per step, sequences past their last position
/// left out), each step's penalties counting the tokens drawn before; `hidden[s]` holds the
/// sequence's hidden state at each position.
fn plain_decoding(
    backend: &dyn Backend,
    shards: &[Matrix],
    hidden: &[Matrix],
    sequences: &[Sequence],
) -> Vec<Vec<u32>> {
    let mut drawn: Vec<Vec<u32>> = vec![Vec::new(); sequences.len()];
    let positions = sequences.iter().map(|s| s.drafts + 1).max().unwrap_or(0);
    for position in 0..positions {
        let live: Vec<usize> = (0..sequences.len()).filter(|&s| position <= sequences[s].drafts).collect();
        let params = live
            .iter()
            .map(|&s| SamplingParams { step: sequences[s].params.step + position as u32, ..sequences[s].params });
        let processing = live.iter().map(|&s| {
            let mut processing = sequences[s].processing.clone();
            processing.history.extend_from_slice(&drawn[s]);
            processing
        });
        let batch = Batch::with_processing(params.collect(), processing.collect());
        let rows: Vec<Matrix> = live.iter().map(|&s| hidden[s].row_range(position, position + 1)).collect();
        let values = rows.iter().flat_map(|m| (0..m.cols()).map(move |c| m.get(0, c))).collect();
        let step_hidden = matrix_of(live.len(), rows[0].cols(), rows[0].dtype(), values);
        let sampled = backend.sample_shards(shards, &step_hidden, &batch, Draws::first(1)).expect("plain step");
        for (row, &s) in live.iter().enumerate() {
            drawn[s].push(sampled.tokens[row]);
        }
    }
    drawn
}

/// A verification of `drafts` (one list per sequence): the verdicts and emitted tokens.
fn verify(
    backend: &dyn Backend,
    shards: &[Matrix],
    hidden: &[Matrix],
    sequences: &[Sequence],
    drafts: &[Vec<u32>],
) -> (Vec<u32>, Vec<Vec<u32>>) {
    let drafted = sequences
        .iter()
        .zip(drafts)
        .map(|(s, drafts)| Drafted { params: s.params, processing: s.processing.clone(), drafts: drafts.clone() })
        .collect();
    let batch = Batch::verify(drafted).expect("a verification batch");
    let rows: Vec<Matrix> = hidden.iter().zip(drafts).map(|(h, d)| h.row_range(0, d.len() + 1)).collect();
    let values = rows.iter().flat_map(|m| (0..m.rows() * m.cols()).map(move |i| m.get(i / m.cols(), i % m.cols())));
    let stacked = matrix_of(batch.rows(), hidden[0].cols(), hidden[0].dtype(), values.collect());
    let sampled = backend.sample_shards(shards, &stacked, &batch, Draws::first(1)).expect("verification");
    assert_eq!(sampled.verdicts.len(), sequences.len(), "{}: one verdict per sequence", backend.name());
    let accepted = sampled.verdicts.iter().map(|v| v.accepted).collect();
    let emitted = (0..sequences.len()).map(|s| sampled.emitted(s).to_vec()).collect();
    (accepted, emitted)
}

/// Verification emits exactly plain decoding's tokens with any drafter: drafts equal to the
/// target's own tokens are all kept (the target as its own drafter); drafts that differ first
/// at position `m` keep `m`; random drafts keep their longest agreeing prefix. Sequences of
/// every kind (penalties seeing the drafts before each position, truncations, greedy, from
/// none to six drafts) in one batch, at V = 2053, over the whole head and over three shards
/// (the verdicts after the shard merge). The hidden states do not depend on the tokens here:
/// the identity is the sampler's, exact on every backend.
pub fn check_verification_is_drafter_invariant(backend: &dyn Backend) {
    let (vocab, dim) = (2053, 32);
    let w = random_matrix(vocab, dim, DType::BF16, 1.0, 81);
    let sequences = sequences();
    let hidden: Vec<Matrix> = sequences
        .iter()
        .enumerate()
        .map(|(s, seq)| {
            let seed = 82 + s as u64;
            match s {
                REPEATING => {
                    let row = random_matrix(1, dim, DType::BF16, 1.0, seed);
                    let values = (0..(seq.drafts + 1) * dim).map(|i| row.get(0, i % dim)).collect();
                    matrix_of(seq.drafts + 1, dim, DType::BF16, values)
                }
                _ => random_matrix(seq.drafts + 1, dim, DType::BF16, 1.0, seed),
            }
        })
        .collect();
    let whole = [w.clone()];
    let sharded = split_rows(&w, &uneven_bounds(vocab, 3, 4));
    let mut rng = rand::rngs::StdRng::seed_from_u64(83);
    for shards in [&whole[..], &sharded[..]] {
        let plain = plain_decoding(backend, shards, &hidden, &sequences);
        let repeating = &plain[REPEATING];
        assert!(repeating.windows(2).all(|pair| pair[0] != pair[1]), "the penalty moves each token: {repeating:?}");
        let own: Vec<Vec<u32>> = plain.iter().zip(&sequences).map(|(p, s)| p[..s.drafts].to_vec()).collect();
        let (accepted, emitted) = verify(backend, shards, &hidden, &sequences, &own);
        for (s, seq) in sequences.iter().enumerate() {
            assert_eq!(accepted[s] as usize, seq.drafts, "{}: the target's own drafts, sequence {s}", backend.name());
            assert_eq!(emitted[s], plain[s], "{}: the target's own drafts, sequence {s}", backend.name());
        }
        for changed in 0..6 {
            let wrong: Vec<Vec<u32>> = own
                .iter()
                .map(|d| {
                    let mut d = d.clone();
                    if let Some(token) = d.get_mut(changed) {
                        *token = (*token + 1 + rng.random_range(0..vocab as u32 - 1)) % vocab as u32;
                    }
                    d
                })
                .collect();
            let (accepted, emitted) = verify(backend, shards, &hidden, &sequences, &wrong);
            for (s, seq) in sequences.iter().enumerate() {
                let kept = changed.min(seq.drafts);
                assert_eq!(accepted[s] as usize, kept, "{}: first change at {changed}, sequence {s}", backend.name());
                assert_eq!(
                    emitted[s],
                    plain[s][..=kept],
                    "{}: first change at {changed}, sequence {s}",
                    backend.name()
                );
            }
        }
        let random: Vec<Vec<u32>> =
            sequences.iter().map(|s| (0..s.drafts).map(|_| rng.random_range(0..vocab as u32)).collect()).collect();
        let (accepted, emitted) = verify(backend, shards, &hidden, &sequences, &random);
        for s in 0..sequences.len() {
            let kept = random[s].iter().zip(&plain[s]).take_while(|(d, t)| d == t).count();
            assert_eq!(accepted[s] as usize, kept, "{}: random drafts, sequence {s}", backend.name());
            assert_eq!(emitted[s], plain[s][..=kept], "{}: random drafts, sequence {s}", backend.name());
        }
    }
}

/// `softmax(l / T)` in f64.
fn softmax(logits: &[f32], temperature: f64) -> Vec<f64> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let weights: Vec<f64> = logits.iter().map(|&l| ((l as f64 - max) / temperature).exp()).collect();
    let total: f64 = weights.iter().sum();
    weights.into_iter().map(|w| w / total).collect()
}

/// The probability that Gumbel-max with shared noise draws the same token from `p` and `q`:
/// token `i` wins both races when every other `j`'s exponential clock exceeds `i`'s times
/// `max(p_j / p_i, q_j / q_i)`, so `P = Σ_i 1 / Σ_j max(p_j / p_i, q_j / q_i)`.
pub fn coupled_agreement(p: &[f64], q: &[f64]) -> f64 {
    (0..p.len())
        .filter(|&i| p[i] > 0.0 && q[i] > 0.0)
        .map(|i| 1.0 / (0..p.len()).map(|j| (p[j] / p[i]).max(q[j] / q[i])).sum::<f64>())
        .sum()
}

/// A drafter that samples with the target's keys (the same seed, sequence, step and draw)
/// from its own distribution `q` draws the target's token exactly as often as the coupling
/// predicts (`coupled_agreement`, between `(1 − TV) / (1 + TV)` and `1 − TV`): 40,000 coupled
/// draws from a V = 1000 head and a perturbed copy (TV ≈ 0.15), the agreements against the
/// exact probability by a two-sided binomial test at α = 1e-3; and each head's draws against
/// its own softmax (χ²), so the coupling changes neither marginal. Returns (agreement, exact
/// probability, 1 − TV).
pub fn check_same_key_drafting_agrees_as_coupled(backend: &dyn Backend) -> (f64, f64, f64) {
    let (vocab, dim, draws) = (1000usize, 64usize, 40_000u32);
    let target = random_matrix(vocab, dim, DType::F32, 0.5, 91);
    let noise = random_matrix(vocab, dim, DType::F32, 0.12, 92);
    let drafter = matrix_of(
        vocab,
        dim,
        DType::F32,
        (0..vocab * dim).map(|i| target.get(i / dim, i % dim) + noise.get(i / dim, i % dim)).collect(),
    );
    let h = random_matrix(1, dim, DType::F32, 1.0, 93);
    let params = [SamplingParams::new(0.9, 94, 3, 17)];
    let y = backend.sample(&target, &h, &params, draws).expect("target");
    let d = backend.sample(&drafter, &h, &params, draws).expect("drafter");
    let agree = y.iter().zip(&d).filter(|(a, b)| a == b).count() as f64 / draws as f64;
    let logits = |w: &Matrix| flashsample::internals::logits_row(w, &h, 0);
    let (p, q) = (softmax(&logits(&target), 0.9), softmax(&logits(&drafter), 0.9));
    let tv = 0.5 * p.iter().zip(&q).map(|(a, b)| (a - b).abs()).sum::<f64>();
    let exact = coupled_agreement(&p, &q);
    assert!(
        exact >= (1.0 - tv) / (1.0 + tv) - 1e-12 && exact <= 1.0 - tv + 1e-12,
        "the coupling bound: {exact} outside [{}, {}]",
        (1.0 - tv) / (1.0 + tv),
        1.0 - tv
    );
    // z for α = 1e-3, two-sided.
    let sigma = (exact * (1.0 - exact) / draws as f64).sqrt();
    let z = (agree - exact) / sigma;
    println!(
        "{}: same-key drafting agrees on {agree:.4} of {draws} draws; exact {exact:.4} (z = {z:.2}), 1 - TV = {:.4}, (1 - TV)/(1 + TV) = {:.4}",
        backend.name(),
        1.0 - tv,
        (1.0 - tv) / (1.0 + tv)
    );
    assert!(z.abs() < 3.29, "{}: agreement {agree} against the coupling's {exact} (z = {z})", backend.name());
    for (name, tokens, probabilities) in [("target", &y, &p), ("drafter", &d, &q)] {
        let mut counts = vec![0u64; vocab];
        tokens.iter().for_each(|&t| counts[t as usize] += 1);
        let (statistic, dof, p_value) = chi_square(&counts, probabilities);
        assert!(
            p_value > 1e-3,
            "{}: the {name}'s draws: χ² {statistic:.1}, {dof} dof, p {p_value:.2e}",
            backend.name()
        );
    }
    (agree, exact, 1.0 - tv)
}
