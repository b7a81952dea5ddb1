//! Property tests of the CPU backend and the file reader: random shapes, dtypes, parameters and
//! damaged files give a correct result or a typed error, never a panic.

use flashsample::io::load_matrix;
use flashsample::{CpuSampler, DType, Elements, Error, Matrix, SamplingParams};
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
        1 => prop::sample::select(vec![0.0, -1.0, f32::NAN, f32::INFINITY, 1e-45, 1e-38, 1e30]),
    ]
}

fn matrix(rows: usize, cols: usize, dtype: DType, values: Vec<f32>) -> Matrix {
    Matrix::new("m", rows, cols, Elements::F32(values)).unwrap().to_dtype(dtype)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn cpu_sampler_returns_tokens_or_a_typed_error(
        (vocab, dim, batch) in (1usize..40, 1usize..12, 1usize..5),
        dtype in prop::sample::select(vec![DType::F32, DType::F16, DType::BF16]),
        w in prop::collection::vec(value(), 480),
        h in prop::collection::vec(value(), 60),
        temperatures in prop::collection::vec(temperature(), 5),
        params_len_delta in 0usize..3,
        samples in 0u32..4,
        seed in any::<u64>(),
    ) {
        let w = matrix(vocab, dim, dtype, w[..vocab * dim].to_vec());
        let h = matrix(batch, dim, dtype, h[..batch * dim].to_vec());
        // Usually one parameter per row; sometimes one too many (a typed error).
        let rows = batch + usize::from(params_len_delta == 2);
        let params: Vec<SamplingParams> =
            (0..rows).map(|r| SamplingParams::new(temperatures[r % 5], seed, r as u32, 0)).collect();
        let sampler = CpuSampler::new();
        let result = sampler.upload_lm_head(&w).and_then(|head| sampler.sample(&head, &h, &params, samples));
        match result {
            Ok(tokens) => {
                prop_assert_eq!(tokens.len(), batch * samples as usize);
                prop_assert!(tokens.iter().all(|&t| (t as usize) < vocab));
            }
            Err(Error::InvalidArgument { .. } | Error::RowsWithoutToken { .. }) => {}
            Err(other) => prop_assert!(false, "unexpected error kind: {other}"),
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
