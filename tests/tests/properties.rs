//! Property tests of the CPU backend and the file reader: random shapes, dtypes, parameters and
//! damaged files give a correct result or a typed error, never a panic; and an argument error
//! comes exactly when the input breaks a stated rule (each rule restated here from the docs).

use flashsample::{
    Batch, CpuSampler, DType, Draws, Elements, Error, Matrix, Penalties, Processing, RowStatus, Sampler,
    SamplingParams, VocabShard,
};
use flashsample_cli::io::load_matrix;
use proptest::prelude::*;

/// A value that is usually ordinary and sometimes one of the values that break arithmetic.
fn value() -> impl Strategy<Value = f32> {
    prop_oneof![
        8 => -4.0f32..4.0,
        1 => prop::sample::select(vec![0.0, -0.0, f32::NAN, f32::INFINITY, f32::NEG_INFINITY, f32::MAX, f32::MIN_POSITIVE]),
    ]
}

fn temperature() -> impl Strategy<Value = f32> {
    prop_oneof![
        6 => 0.01f32..10.0,
        1 => prop::sample::select(vec![0.0, -1.0, f32::NAN, f32::INFINITY, 1e-45, 1e-38, 1e30, 2e36]),
    ]
}

fn matrix(rows: usize, cols: usize, dtype: DType, values: Vec<f32>) -> Matrix {
    Matrix::new("m", rows, cols, Elements::F32(values)).unwrap().to_dtype(dtype)
}

/// The documented temperature rule: 0 (greedy) or in (0, 10³⁶].
fn temperature_allowed(t: f32) -> bool {
    (0.0..=1e36).contains(&t)
}

/// Whether every element is finite (the rule of `W` and `H`).
fn finite(m: &Matrix) -> bool {
    (0..m.rows()).all(|r| (0..m.cols()).all(|c| m.get(r, c).is_finite()))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// An argument error exactly when a rule is broken (a weight or hidden state not finite,
    /// one parameter entry too many, a temperature outside its range, no draws); otherwise the
    /// tokens, each below V, or the rows without a token reported.
    #[test]
    fn cpu_sampler_refuses_exactly_the_inputs_that_break_a_rule(
        (vocab, dim, batch) in (1usize..40, 1usize..12, 1usize..5),
        dtype in prop::sample::select(vec![DType::F32, DType::F16, DType::BF16]),
        w in prop::collection::vec(value(), 480),
        h in prop::collection::vec(value(), 60),
        temperatures in prop::collection::vec(temperature(), 5),
        params_len_delta in 0usize..3,
        draws in 0u32..4,
        seed in any::<u64>(),
    ) {
        let w = matrix(vocab, dim, dtype, w[..vocab * dim].to_vec());
        let h = matrix(batch, dim, dtype, h[..batch * dim].to_vec());
        // Usually one parameter per row; sometimes one too many.
        let rows = batch + usize::from(params_len_delta == 2);
        let params: Vec<SamplingParams> =
            (0..rows).map(|r| SamplingParams::new(temperatures[r % 5], seed, r as u32, 0)).collect();
        let broken = !finite(&w)
            || !finite(&h)
            || rows != batch
            || draws == 0
            || params.iter().any(|p| !temperature_allowed(p.temperature));
        let sampler = CpuSampler::new();
        let result = sampler
            .upload_lm_head(&w)
            .and_then(|head| sampler.sample(&head, &h, &Batch::new(params), Draws::first(draws)));
        match result {
            Err(Error::InvalidArgument { .. }) => prop_assert!(broken, "refused input that breaks no rule"),
            Ok(sampled) => {
                prop_assert!(!broken, "accepted input that breaks a rule");
                prop_assert_eq!(sampled.tokens.len(), batch * draws as usize);
                prop_assert!(sampled.tokens.iter().all(|&t| (t as usize) < vocab));
            }
            Err(Error::RowsWithoutToken { rows, sampled }) => {
                prop_assert!(!broken, "accepted input that breaks a rule");
                for (row, status) in rows {
                    prop_assert!(sampled.row(row).iter().all(|&t| t == status.token()));
                }
            }
            Err(other) => prop_assert!(false, "unexpected error kind: {other}"),
        }
    }

    /// Random processing over 1 to 3 shards (mostly valid; sometimes a value out of its
    /// range, a mask of the wrong width, a token past V, a NaN bias): an argument error exactly
    /// when one of `Processing`'s rules is broken; otherwise tokens below V (or a row status)
    /// whose log-probabilities are ≤ 0 (NaN or −∞ exactly in rows without a token), and the
    /// shards draw the unsharded tokens.
    #[test]
    fn processing_is_refused_exactly_when_it_breaks_a_rule(
        (vocab, dim) in (1usize..70, 1usize..6),
        w in prop::collection::vec(-4.0f32..4.0, 420),
        h in prop::collection::vec(-4.0f32..4.0, 12),
        temperature in prop_oneof![4 => 0.05f32..5.0, 1 => Just(0.0), 1 => Just(1e-30)],
        softcap in prop::option::of(prop_oneof![9 => 0.1f32..30.0, 1 => Just(0.0)]),
        bias in prop::collection::vec((0.0f64..1.0, prop_oneof![8 => -3.0f32..3.0, 2 => Just(f32::NEG_INFINITY), 1 => Just(f32::NAN)]), 0..6),
        mask in prop::option::of((prop::collection::vec(any::<u32>(), 3), prop_oneof![9 => Just(0usize), 1 => Just(1)])),
        history in prop::collection::vec(0.0f64..1.0, 0..8),
        penalties in (prop_oneof![9 => 0.5f32..2.0, 1 => Just(0.0)], -1.0f32..1.0, -1.0f32..1.0),
        min_p in prop_oneof![3 => Just(0.0f32), 3 => 0.0f32..1.0, 1 => Just(1.5)],
        top_k in prop::option::of(prop_oneof![9 => 0.0f64..1.0, 1 => Just(2.0)]),
        top_p in prop_oneof![3 => Just(1.0f32), 3 => 0.01f32..1.0, 1 => Just(0.0)],
        top_logprobs in prop_oneof![9 => 0u32..=20, 1 => Just(21)],
        shards in 1usize..4,
        seed in any::<u64>(),
    ) {
        let w = matrix(vocab, dim, DType::F32, w[..vocab * dim].to_vec());
        let h = matrix(2, dim, DType::F32, h[..2 * dim].to_vec());
        let token = |f: f64| (f * vocab as f64) as u32;
        let words = vocab.div_ceil(32);
        let processing = Processing {
            softcap,
            bias: bias.iter().map(|&(f, b)| (token(f), b)).collect(),
            mask: mask.map(|(bits, extra)| bits.into_iter().cycle().take(words + extra).collect()),
            history: history.iter().map(|&f| token(f)).collect(),
            penalties: Penalties { repetition: penalties.0, frequency: penalties.1, presence: penalties.2 },
            min_p,
            top_k: top_k.map(|f| 1 + token(f)),
            top_p,
            logprobs: true,
            top_logprobs,
        };
        // `Processing`'s documented rules, restated.
        let p = &processing;
        let broken = p.softcap.is_some_and(|c| !(c.is_finite() && c > 0.0))
            || p.bias.iter().any(|&(t, b)| t as usize >= vocab || b.is_nan() || b == f32::INFINITY)
            || p.mask.as_ref().is_some_and(|m| m.len() != words)
            || p.history.iter().any(|&t| t as usize >= vocab)
            || !(p.penalties.repetition.is_finite() && p.penalties.repetition > 0.0)
            || !(0.0..=1.0).contains(&p.min_p)
            || p.top_k.is_some_and(|k| k == 0 || k as usize > vocab)
            || !(p.top_p > 0.0 && p.top_p <= 1.0)
            || p.top_logprobs > 20;
        let params = vec![SamplingParams::new(temperature, seed, 0, 0), SamplingParams::new(0.0, seed, 1, 0)];
        let batch = Batch::with_processing(params, vec![processing.clone(), processing]);
        let sampler = CpuSampler::new();
        let draws = Draws::first(3);
        let result = sampler.upload_lm_head(&w).and_then(|head| sampler.sample(&head, &h, &batch, draws));
        let sampled = match result {
            Err(Error::InvalidArgument { .. }) => {
                prop_assert!(broken, "refused processing that breaks no rule");
                return Ok(());
            }
            Ok(sampled) => sampled,
            Err(Error::RowsWithoutToken { sampled, .. }) => *sampled,
            Err(other) => return Err(TestCaseError::fail(format!("unexpected error kind: {other}"))),
        };
        prop_assert!(!broken, "accepted processing that breaks a rule");
        let without: Vec<usize> = sampled.rows_without_token().iter().map(|r| r.0).collect();
        for (k, &t) in sampled.tokens.iter().enumerate() {
            let (lp, plp) = (sampled.logprobs[k], sampled.processed_logprobs[k]);
            if without.contains(&(k / 3)) {
                prop_assert!(RowStatus::of_token(t).is_some());
                prop_assert!(plp.is_nan() || plp == f32::NEG_INFINITY);
            } else {
                prop_assert!((t as usize) < vocab);
                prop_assert!(plp <= 1e-6, "processed log-probability {}", plp);
                prop_assert!(lp <= 1e-6, "raw log-probability {}", lp);
            }
        }
        if let Ok(bounds) = VocabShard::bounds(vocab, shards) {
            let parts: Vec<Matrix> = bounds.windows(2).map(|b| w.row_range(b[0], b[1])).collect();
            let sharded = match sampler.sample(&sampler.upload_lm_head_shards(&parts).unwrap(), &h, &batch, draws) {
                Ok(sampled) => sampled,
                Err(Error::RowsWithoutToken { sampled, .. }) => *sampled,
                Err(other) => return Err(TestCaseError::fail(format!("shards: {other}"))),
            };
            prop_assert_eq!(sharded.tokens, sampled.tokens);
        }
    }

    #[test]
    fn damaged_safetensors_files_give_a_file_error(
        cut in 0usize..200,
        flips in prop::collection::vec((0usize..200, any::<u8>()), 0..4),
    ) {
        let path = std::env::temp_dir().join(format!("flashsample-prop-{}-{cut}.safetensors", std::process::id()));
        let data: Vec<u8> = (0..8 * 4 * 4).map(|i| (i * 37 % 251) as u8).collect();
        let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![8, 4], &data).unwrap();
        let mut bytes = safetensors::serialize([("w", view)], &None).unwrap();
        for (at, byte) in flips {
            if at < bytes.len() {
                bytes[at] = byte;
            }
        }
        bytes.truncate(cut.max(1).min(bytes.len()));
        std::fs::write(&path, &bytes).unwrap();
        let result = load_matrix(&path, None, "--lm-head");
        std::fs::remove_file(&path).unwrap();
        match result {
            Ok(m) => prop_assert_eq!(m.rows() * m.cols(), m.elements().len()),
            Err(Error::File { .. } | Error::InvalidArgument { .. }) => {}
            Err(other) => prop_assert!(false, "unexpected error kind: {other}"),
        }
    }
}
