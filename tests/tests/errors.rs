//! Bad input through the API gives a typed error naming the argument and the rule; nothing
//! panics. These run on the CPU backend and on the validation the CUDA backend shares.

use flashsample::internals::Variant;
use flashsample::{
    Batch, CpuSampler, CudaSampler, DType, Drafted, Draws, Elements, Error, LmHead, Matrix, Module, Processing,
    Sampler, SamplingParams, cuda_device_count,
};
use flashsample_tests::random_matrix;

fn invalid_argument(result: Result<impl std::fmt::Debug, Error>) -> String {
    match result {
        Err(Error::InvalidArgument { argument, rule }) => {
            assert!(!rule.is_empty());
            argument
        }
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
}

fn setup() -> (CpuSampler, LmHead, Matrix) {
    let sampler = CpuSampler::new();
    let head = sampler.upload_lm_head(&random_matrix(10, 4, DType::F32, 1.0, 1)).unwrap();
    (sampler, head, random_matrix(2, 4, DType::F32, 1.0, 2))
}

/// Plain sampling of `params` rows.
fn plain(params: &[SamplingParams]) -> Batch {
    Batch::new(params.to_vec())
}

#[test]
fn shape_mismatch_names_hidden() {
    let (sampler, head, _) = setup();
    let h = random_matrix(2, 5, DType::F32, 1.0, 2);
    let batch = plain(&[SamplingParams::new(1.0, 0, 0, 0); 2]);
    assert_eq!(invalid_argument(sampler.sample(&head, &h, &batch, Draws::first(1))), "hidden");
}

#[test]
fn dtype_mismatch_is_its_own_error() {
    let (sampler, head, _) = setup();
    let h = random_matrix(2, 4, DType::BF16, 1.0, 2);
    let err = sampler.sample(&head, &h, &plain(&[SamplingParams::new(1.0, 0, 0, 0); 2]), Draws::first(1)).unwrap_err();
    assert!(matches!(err, Error::DTypeMismatch { lm_head: DType::F32, hidden: DType::BF16 }), "{err}");
}

#[test]
fn empty_vocabulary_or_dimension_names_lm_head() {
    let sampler = CpuSampler::new();
    let empty_v = Matrix::new("lm_head", 0, 4, Elements::F32(vec![])).unwrap();
    let empty_d = Matrix::new("lm_head", 4, 0, Elements::F32(vec![])).unwrap();
    assert_eq!(invalid_argument(sampler.upload_lm_head(&empty_v)), "lm_head");
    assert_eq!(invalid_argument(sampler.upload_lm_head(&empty_d)), "lm_head");
}

#[test]
fn bad_temperatures_name_the_row() {
    let (sampler, head, h) = setup();
    for bad in [-1.0, -1e-45, f32::NAN, f32::INFINITY, 2e36] {
        let params = [SamplingParams::new(1.0, 0, 0, 0), SamplingParams::new(bad, 0, 1, 0)];
        let result = sampler.sample(&head, &h, &plain(&params), Draws::first(1));
        assert_eq!(invalid_argument(result), "params[1].temperature", "T = {bad}");
    }
}

#[test]
fn zero_draws_zero_rows_and_missing_params_are_rejected() {
    let (sampler, head, h) = setup();
    let params = [SamplingParams::new(1.0, 0, 0, 0); 2];
    assert_eq!(invalid_argument(sampler.sample(&head, &h, &plain(&params), Draws::first(0))), "draws");
    assert_eq!(invalid_argument(sampler.sample(&head, &h, &plain(&params[..1]), Draws::first(1))), "params");
    let no_rows = Matrix::new("hidden", 0, 4, Elements::F32(vec![])).unwrap();
    assert_eq!(invalid_argument(sampler.sample(&head, &no_rows, &plain(&[]), Draws::first(1))), "hidden");
    let past = Draws { first: u32::MAX, count: 2 };
    assert_eq!(invalid_argument(sampler.sample(&head, &h, &plain(&params), past)), "draws");
}

/// A verification draws one token per position, its drafts are tokens, its positions' steps
/// fit in 32 bits, and its rows are its positions.
#[test]
fn verification_rules_name_their_argument() {
    let (sampler, head, _) = setup();
    let sequence = |drafts: Vec<u32>, step: u32| Drafted {
        params: SamplingParams::new(1.0, 0, 0, step),
        processing: Processing::default(),
        drafts,
    };
    let h = random_matrix(3, 4, DType::F32, 1.0, 3);
    let batch = Batch::verify(vec![sequence(vec![1], 0), sequence(vec![], 0)]).unwrap();
    assert!(sampler.sample(&head, &h, &batch, Draws::first(1)).is_ok());
    assert_eq!(invalid_argument(sampler.sample(&head, &h, &batch, Draws::first(2))), "draws");
    let past_vocab = Batch::verify(vec![sequence(vec![1], 0), sequence(vec![10], 0)]).unwrap();
    let h4 = random_matrix(4, 4, DType::F32, 1.0, 4);
    assert_eq!(invalid_argument(sampler.sample(&head, &h4, &past_vocab, Draws::first(1))), "sequences[1].drafts");
    assert_eq!(invalid_argument(Batch::verify(vec![sequence(vec![1, 2], u32::MAX - 1)])), "sequences[0].drafts");
    assert!(Batch::verify(vec![sequence(vec![1], u32::MAX - 1)]).is_ok());
    let mut cut = batch.clone();
    cut.params.pop();
    let h2 = random_matrix(2, 4, DType::F32, 1.0, 5);
    assert_eq!(invalid_argument(sampler.sample(&head, &h2, &cut, Draws::first(1))), "params");
}

#[test]
fn processing_of_another_length_names_processing() {
    let (sampler, head, h) = setup();
    let params = vec![SamplingParams::new(1.0, 0, 0, 0); 2];
    let batch = Batch::with_processing(params, vec![Processing::default(); 3]);
    assert_eq!(invalid_argument(sampler.sample(&head, &h, &batch, Draws::first(1))), "processing");
}

#[test]
fn non_finite_inputs_are_rejected() {
    let sampler = CpuSampler::new();
    let mut values = vec![0.5f32; 12];
    values[7] = f32::NAN;
    let w = Matrix::new("lm_head", 3, 4, Elements::F32(values.clone())).unwrap();
    assert_eq!(invalid_argument(sampler.upload_lm_head(&w)), "lm_head");
    let head = sampler.upload_lm_head(&random_matrix(3, 4, DType::F32, 1.0, 1)).unwrap();
    values[7] = f32::INFINITY;
    let h = Matrix::new("hidden", 3, 4, Elements::F32(values)).unwrap();
    let batch = plain(&[SamplingParams::new(1.0, 0, 0, 0); 3]);
    assert_eq!(invalid_argument(sampler.sample(&head, &h, &batch, Draws::first(1))), "hidden");
}

#[test]
fn matrix_with_wrong_element_count_is_rejected() {
    assert_eq!(invalid_argument(Matrix::new("lm_head", 3, 4, Elements::F32(vec![0.0; 11]))), "lm_head");
}

/// Shards of a head are whole Philox blocks of 4 tokens but the last, of one D and dtype, on
/// every backend: a shard that splits a block, or that differs, is named.
#[test]
fn shards_that_split_a_philox_block_or_differ_are_named() {
    let sampler = CpuSampler::new();
    let w = random_matrix(30, 4, DType::F32, 1.0, 3);
    assert_eq!(invalid_argument(sampler.upload_lm_head_shards(&[w.row_range(0, 6), w.row_range(6, 30)])), "shards[0]");
    assert_eq!(sampler.upload_lm_head_shards(&[w.row_range(0, 8), w.row_range(8, 30)]).unwrap().shards(), 2);
    let other = random_matrix(10, 5, DType::F32, 1.0, 4);
    assert_eq!(invalid_argument(sampler.upload_lm_head_shards(&[w.row_range(0, 8), other])), "shards[1]");
    assert_eq!(invalid_argument(sampler.upload_lm_head_shards(&[])), "shards");
}

#[test]
fn tensor_core_variants_need_16_bit_types_and_aligned_dim() {
    for variant in [
        Variant::Mma { columns: 8 },
        Variant::Staged { columns: 64 },
        Variant::Tma { rows: 64, columns: 64 },
        Variant::Tma { rows: 128, columns: 8 },
        Variant::TmaHandoff { columns: 128 },
    ] {
        assert_eq!(invalid_argument(variant.resolve(Module::Hopper, DType::F32, 64, 1)), "variant");
        assert_eq!(invalid_argument(variant.resolve(Module::Hopper, DType::BF16, 63, 1)), "variant");
        assert_eq!(variant.resolve(Module::Hopper, DType::F16, 64, 1).unwrap(), variant);
    }
    assert_eq!(invalid_argument(Variant::Mma { columns: 12 }.resolve(Module::Hopper, DType::BF16, 64, 1)), "variant");
    assert_eq!(invalid_argument(Variant::Mma { columns: 64 }.resolve(Module::Hopper, DType::BF16, 64, 1)), "variant");
    assert_eq!(
        invalid_argument(Variant::Staged { columns: 32 }.resolve(Module::Hopper, DType::BF16, 64, 1)),
        "variant"
    );
    assert_eq!(
        invalid_argument(Variant::Tma { rows: 64, columns: 256 }.resolve(Module::Hopper, DType::BF16, 64, 1)),
        "variant"
    );
    assert_eq!(
        invalid_argument(Variant::Tma { rows: 32, columns: 8 }.resolve(Module::Hopper, DType::BF16, 64, 1)),
        "variant"
    );
    assert_eq!(
        invalid_argument(Variant::TmaHandoff { columns: 32 }.resolve(Module::Hopper, DType::BF16, 64, 1)),
        "variant"
    );
    assert_eq!(Variant::Auto.resolve(Module::Hopper, DType::F32, 64, 1).unwrap(), Variant::Simt);
    assert_eq!(Variant::Auto.resolve(Module::Hopper, DType::BF16, 63, 9).unwrap(), Variant::Simt);
    for batch in [1, 9, 100, 5000] {
        let picked = Variant::Auto.resolve(Module::Hopper, DType::BF16, 64, batch).unwrap();
        assert!(matches!(picked, Variant::Tma { .. } | Variant::TmaHandoff { .. }), "B = {batch}: {picked:?}");
        let picked = Variant::Auto.resolve(Module::Portable, DType::BF16, 64, batch).unwrap();
        if batch <= 32 {
            assert!(matches!(picked, Variant::Mma { .. }), "B = {batch}: {picked:?}");
        } else {
            assert_eq!(picked, Variant::Staged { columns: 64 }, "B = {batch}");
        }
    }
    for variant in [Variant::Tma { rows: 128, columns: 8 }, Variant::TmaHandoff { columns: 64 }] {
        assert_eq!(invalid_argument(variant.resolve(Module::Portable, DType::BF16, 64, 1)), "variant");
    }
}

/// A module named in `FLASHSAMPLE_MODULE` that a device cannot load, or a name that is no
/// module, is a typed error before any device work.
#[test]
fn module_choice_is_checked_against_the_device() {
    use flashsample::ModuleChoice;
    assert_eq!(ModuleChoice::Auto.resolve(9, 0).unwrap(), Module::Hopper);
    assert_eq!(ModuleChoice::Auto.resolve(8, 6).unwrap(), Module::Portable);
    assert_eq!(ModuleChoice::Auto.resolve(12, 0).unwrap(), Module::Portable);
    assert_eq!(ModuleChoice::Force(Module::Portable).resolve(9, 0).unwrap(), Module::Portable);
    for (major, minor) in [(8, 0), (10, 0)] {
        assert!(matches!(
            ModuleChoice::Force(Module::Hopper).resolve(major, minor),
            Err(Error::UnsupportedDevice { module: "hopper", .. })
        ));
    }
    assert!(matches!(ModuleChoice::Auto.resolve(7, 5), Err(Error::UnsupportedDevice { module: "portable", .. })));
}

/// Without a GPU the CUDA backend says so in a typed error, and `gpu_or_cpu` samples on the
/// CPU. Skipped where a GPU is present (the GPU suites cover that machine).
#[test]
fn without_a_device_the_cuda_sampler_is_a_typed_error() {
    if let Ok(count) = cuda_device_count() {
        println!("skipped: this machine has {count} CUDA device(s)");
        return;
    }
    match CudaSampler::new() {
        Err(Error::NoCudaDevice(why)) => assert!(!why.is_empty()),
        Err(other) => panic!("expected NoCudaDevice, got {other}"),
        Ok(_) => panic!("a CUDA sampler started on a machine that reports no device"),
    }
    assert_eq!(flashsample::gpu_or_cpu(0).unwrap().device(), "cpu");
}
