//! Tensor-parallel sampling through NCCL (feature `nccl`): the argument rules and a missing
//! library on any machine; on GPUs (ignored without one) every rank's tokens and
//! log-probabilities against the single-GPU path, for each GPU count the machine has of 1, 2,
//! 4 and 8.

use flashsample::{
    CudaSampler, DType, Draws, Error, Processing, SamplingParams, TensorParallelSampler, cuda_device_count,
    nccl_library_present,
};
use flashsample_tests::processing::{each_mode, largest_log_probability_difference};
use flashsample_tests::random_matrix;

#[test]
fn bad_device_lists_and_a_missing_library_are_typed_errors() {
    let w = random_matrix(64, 8, DType::BF16, 1.0, 70);
    let error = |devices: &[usize]| TensorParallelSampler::new(devices, &w).err().map(|e| e.to_string());
    assert!(error(&[]).unwrap().contains("invalid devices: none"));
    assert!(error(&[0, 0]).unwrap().contains("invalid devices[1]: GPU 0 is listed twice"));
    let too_many: Vec<usize> = (0..17).collect();
    assert!(error(&too_many).unwrap().contains("invalid shards: 17: shards are whole blocks of 4 tokens"));
    if !nccl_library_present() {
        let missing = TensorParallelSampler::new(&[0], &w).err().unwrap();
        assert!(matches!(&missing, Error::Nccl { rank: None, .. }), "{missing}");
        assert!(missing.to_string().contains("open the NCCL library"), "{missing}");
    }
}

/// V = 5003 (not divisible by 2, 4 or 8): with N GPUs, each rank's tokens and top raw tokens
/// equal one GPU's unsharded ones and the log-probabilities agree within 10⁻⁵; every rank holds
/// the same answer. The modes that decompose over shards, one per row.
#[test]
#[ignore = "needs a CUDA GPU"]
fn every_rank_gets_the_single_gpu_tokens() {
    let (vocab, dim) = (5003, 64);
    let w = random_matrix(vocab, dim, DType::BF16, 1.0, 71);
    let modes: Vec<Processing> = each_mode(vocab).into_iter().filter(|m| !m.1.truncates()).map(|m| m.1).collect();
    let h = random_matrix(modes.len(), dim, DType::BF16, 1.0, 72);
    let params: Vec<SamplingParams> =
        (0..modes.len()).map(|r| SamplingParams::new(if r == 2 { 0.0 } else { 0.9 }, 8, r as u32, 1)).collect();
    let processing: Vec<Processing> =
        modes.iter().enumerate().map(|(r, p)| Processing { top_logprobs: r as u32 % 3 * 7, ..p.clone() }).collect();
    let draws = Draws::first(32);
    let single = CudaSampler::new().unwrap();
    let want = single.sample_processed(&single.upload_lm_head(&w).unwrap(), &h, &params, &processing, draws).unwrap();
    let gpus = cuda_device_count().unwrap();
    let counts: Vec<usize> = [1, 2, 4, 8].into_iter().filter(|&n| n <= gpus).collect();
    for &n in &counts {
        let devices: Vec<usize> = (0..n).collect();
        let mut sampler = TensorParallelSampler::new(&devices, &w).unwrap();
        let got = sampler.sample(&h, &params, &processing, draws).unwrap();
        assert_eq!(got.len(), n);
        for (rank, sampled) in got.iter().enumerate() {
            assert_eq!(sampled, &got[0], "N = {n}: rank {rank} differs from rank 0");
        }
        let sampled = &got[0];
        assert_eq!(sampled.tokens, want.tokens, "N = {n}");
        let worst = largest_log_probability_difference(sampled, &want, false);
        assert!(worst <= 1e-5, "N = {n}: log-probabilities differ by {worst}");
        for (row, (a, b)) in sampled.top_logprobs.iter().zip(&want.top_logprobs).enumerate() {
            assert_eq!(
                a.iter().map(|x| x.0).collect::<Vec<_>>(),
                b.iter().map(|x| x.0).collect::<Vec<_>>(),
                "row {row}"
            );
        }
        sampler.close().unwrap();
    }
    println!("GPU counts run: {counts:?} of [1, 2, 4, 8] ({gpus} GPU(s) on this machine)");
}
