//! The candle adapter on candle's CPU device (feature `candle`, no nvcc): the tokens and
//! log-probabilities of the CPU backend for the same matrices, the decode step moved by
//! `advance_steps`, and typed errors for tensors the adapter cannot take. The CUDA side runs
//! in `examples/candle`'s tests.

use candle_core::{DType as CandleDType, Device, Tensor};
use flashsample::{Batch, CandleSampler, CpuSampler, DType, Draws, Error, Matrix, Processing, Sampler, SamplingParams};
use flashsample_tests::processing::each_mode;
use flashsample_tests::random_matrix;

/// `matrix` as a candle tensor on the CPU, in its own element type.
fn tensor(matrix: &Matrix) -> Tensor {
    let shape = (matrix.rows(), matrix.cols());
    match matrix.elements() {
        flashsample::Elements::F32(v) => Tensor::from_vec(v.clone(), shape, &Device::Cpu),
        flashsample::Elements::F16(v) => Tensor::from_vec(v.clone(), shape, &Device::Cpu),
        flashsample::Elements::BF16(v) => Tensor::from_vec(v.clone(), shape, &Device::Cpu),
    }
    .unwrap()
}

/// The CPU backend's results for `batch`.
fn cpu(w: &Matrix, h: &Matrix, batch: &Batch, draws: u32) -> flashsample::Sampled {
    let sampler = CpuSampler::new();
    sampler.sample(&sampler.upload_lm_head(w).unwrap(), h, batch, Draws::first(draws)).unwrap()
}

/// Every mode in one batch, with log-probabilities and top entries on some rows: the adapter
/// returns the CPU backend's tokens and log-probabilities, as `[B, N]` tensors (top entries
/// `[B, 20, 2]`), for bf16 and f32 tensors.
#[test]
fn the_adapter_draws_the_cpu_backends_tokens_and_log_probabilities() {
    let vocab = 2003;
    let modes = each_mode(vocab);
    for dtype in [DType::BF16, DType::F32] {
        let w = random_matrix(vocab, 24, dtype, 0.5, 1);
        let h = random_matrix(modes.len(), 24, dtype, 1.0, 2);
        let params: Vec<SamplingParams> = (0..modes.len()).map(|r| SamplingParams::new(0.9, 4, r as u32, 0)).collect();
        let processing: Vec<Processing> = modes
            .iter()
            .enumerate()
            .map(|(r, m)| Processing { logprobs: true, top_logprobs: [3, 0][r % 2], ..m.1.clone() })
            .collect();
        let batch = Batch::with_processing(params, processing);
        let want = cpu(&w, &h, &batch, 5);
        let mut sampler = CandleSampler::new(&Device::Cpu, &batch).unwrap();
        let got = sampler.sample(&tensor(&w), &tensor(&h), 5).unwrap();
        let tokens: Vec<u32> = got.tokens.flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(tokens, want.tokens, "{dtype}");
        assert_eq!(got.tokens.dims(), &[modes.len(), 5]);
        let values = |t: Option<Tensor>| -> Vec<u32> {
            t.unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|v| v.to_bits()).collect()
        };
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(values(got.logprobs), bits(&want.logprobs), "{dtype}");
        assert_eq!(values(got.processed_logprobs), bits(&want.processed_logprobs), "{dtype}");
        let top = got.top_logprobs.unwrap();
        assert_eq!(top.dims(), &[modes.len(), 20, 2]);
        let words: Vec<u32> = top.flatten_all().unwrap().to_vec1().unwrap();
        for (r, want_row) in want.top_logprobs.iter().enumerate() {
            let row: Vec<(u32, f32)> = words[r * 40..r * 40 + 2 * want_row.len()]
                .chunks(2)
                .map(|pair| (pair[0], f32::from_bits(pair[1])))
                .collect();
            assert_eq!(&row, want_row, "{dtype}: row {r}");
        }
    }
}

/// Without a row that reports them, no log-probabilities; `advance_steps` moves every row's
/// step, so the next call draws what the CPU backend draws one step later.
#[test]
fn advance_steps_moves_the_noise_and_log_probabilities_follow_the_batch() {
    let w = random_matrix(500, 16, DType::F32, 1.0, 3);
    let h = random_matrix(3, 16, DType::F32, 1.0, 4);
    let params: Vec<SamplingParams> = (0..3).map(|r| SamplingParams::new(1.0, 5, r, 10)).collect();
    let batch = Batch::new(params.clone());
    let mut sampler = CandleSampler::new(&Device::Cpu, &batch).unwrap();
    let first = sampler.sample(&tensor(&w), &tensor(&h), 4).unwrap();
    assert!(first.logprobs.is_none() && first.processed_logprobs.is_none() && first.top_logprobs.is_none());
    sampler.advance_steps(1).unwrap();
    let second: Vec<u32> =
        sampler.sample(&tensor(&w), &tensor(&h), 4).unwrap().tokens.flatten_all().unwrap().to_vec1().unwrap();
    let later = Batch::new(params.iter().map(|p| SamplingParams { step: 11, ..*p }).collect());
    assert_eq!(second, cpu(&w, &h, &later, 4).tokens);
    assert_eq!(sampler.batch().params[0].step, 11);
}

/// A verification batch set on the adapter gives the CPU backend's verdicts as a `[S]` u32
/// tensor beside the tokens: the target's own drafts all kept, a wrong first draft none.
#[test]
fn a_verification_returns_its_verdicts_as_a_tensor() {
    let (vocab, dim) = (500, 16);
    let w = random_matrix(vocab, dim, DType::F32, 1.0, 7);
    let h = random_matrix(5, dim, DType::F32, 1.0, 8);
    let params = |sequence: u32| SamplingParams::new(0.8, 9, sequence, 3);
    let positions = |drafts: &[u32]| drafts.len() + 1;
    // What plain decoding draws at the first sequence's first two positions.
    let step = |row: usize, step: u32| {
        let batch = Batch::new(vec![SamplingParams { step, ..params(0) }]);
        cpu(&w, &h.row_range(row, row + 1), &batch, 1).tokens[0]
    };
    let own = vec![step(0, 3), step(1, 4)];
    let wrong = vec![(own[0] + 1) % vocab as u32, 7];
    let verify = |first: Vec<u32>, second: Vec<u32>| {
        let rows = positions(&first) + positions(&second);
        let sequences = [(0, first), (1, second)].map(|(s, drafts)| flashsample::Drafted {
            params: params(s),
            processing: Processing::default(),
            drafts,
        });
        (Batch::verify(sequences.into()).unwrap(), rows)
    };
    for (batch, rows) in [verify(own.clone(), vec![]), verify(wrong, vec![4])] {
        let want = cpu(&w, &h.row_range(0, rows), &batch, 1);
        let mut sampler = CandleSampler::new(&Device::Cpu, &batch).unwrap();
        let got = sampler.sample(&tensor(&w), &tensor(&h.row_range(0, rows)), 1).unwrap();
        let accepted: Vec<u32> = got.accepted.expect("verdicts").to_vec1().unwrap();
        assert_eq!(accepted, want.verdicts.iter().map(|v| v.accepted).collect::<Vec<_>>());
        let tokens: Vec<u32> = got.tokens.flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(tokens, want.tokens);
    }
    let (batch, rows) = verify(own.clone(), vec![]);
    let kept = cpu(&w, &h.row_range(0, rows), &batch, 1);
    assert_eq!(kept.verdicts[0].accepted, 2);
    assert_eq!(kept.emitted(0), &[own[0], own[1], kept.tokens[2]]);
    let (batch, rows) = verify(vec![(own[0] + 1) % vocab as u32, 7], vec![4]);
    assert_eq!(cpu(&w, &h.row_range(0, rows), &batch, 1).verdicts[0].accepted, 0);
}

/// Tensors the adapter cannot take are typed errors naming them: differing dtypes, an
/// integer dtype, a batch of another size.
#[test]
fn tensors_the_adapter_cannot_take_are_typed_errors() {
    let w = random_matrix(100, 8, DType::F32, 1.0, 5);
    let h = random_matrix(2, 8, DType::F32, 1.0, 6);
    let batch = Batch::new(vec![SamplingParams::new(1.0, 1, 0, 0); 2]);
    let mut sampler = CandleSampler::new(&Device::Cpu, &batch).unwrap();
    let half_h = tensor(&h).to_dtype(CandleDType::BF16).unwrap();
    assert!(matches!(sampler.sample(&tensor(&w), &half_h, 1), Err(Error::DTypeMismatch { .. })));
    let integers = tensor(&h).to_dtype(CandleDType::U32).unwrap();
    match sampler.sample(&tensor(&w), &integers, 1) {
        Err(Error::InvalidArgument { argument, .. }) => assert_eq!(argument, "hidden"),
        other => panic!("{:?}", other.map(|s| s.tokens)),
    }
    let three = tensor(&random_matrix(3, 8, DType::F32, 1.0, 7));
    match sampler.sample(&tensor(&w), &three, 1) {
        Err(Error::InvalidArgument { argument, .. }) => assert_eq!(argument, "hidden"),
        other => panic!("{:?}", other.map(|s| s.tokens)),
    }
}
