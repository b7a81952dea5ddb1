//! Tensor-parallel sampling through NCCL (feature `nccl`): the argument rules and a missing
//! library on any machine; on GPUs (ignored without one) every rank's tokens and
//! log-probabilities against the single-GPU path, for each GPU count the machine has of 1, 2,
//! 4 and 8, with one process driving every GPU and with a rank per thread in borrowed mode.

use flashsample::cudarc::driver::CudaContext;
use flashsample::{
    Batch, CudaSampler, DType, DeviceBatch, Draws, Error, Matrix, ModuleChoice, NcclId, OutputSlice, Processing,
    Request, Sampled, Sampler, SamplingParams, StreamSampler, StreamWorkspace, Target, TensorParallelRank,
    TensorParallelSampler, cuda_device_count, nccl_library_present,
};
use flashsample_tests::borrowed::DeviceValues;
use flashsample_tests::processing::{each_mode, largest_log_probability_difference};
use flashsample_tests::random_matrix;

#[test]
fn bad_device_lists_and_a_missing_library_are_typed_errors() {
    let error = |devices: &[usize]| TensorParallelSampler::new(devices).err().map(|e| e.to_string());
    assert!(error(&[]).unwrap().contains("invalid devices: none"));
    assert!(error(&[0, 0]).unwrap().contains("invalid devices[1]: GPU 0 is listed twice"));
    if !nccl_library_present() {
        let missing = TensorParallelSampler::new(&[0]).err().unwrap();
        assert!(matches!(&missing, Error::Nccl { rank: None, .. }), "{missing}");
        assert!(missing.to_string().contains("open the NCCL library"), "{missing}");
        let no_id = NcclId::new().err().unwrap();
        assert!(matches!(&no_id, Error::Nccl { rank: None, .. }) && no_id.to_string().contains("NCCL"), "{no_id}");
    }
}

/// Rows of every mode with their log-probabilities (and top raw ones on some rows).
fn logprob_rows(modes: &[Processing], top: impl Fn(usize) -> u32) -> Vec<Processing> {
    modes.iter().enumerate().map(|(r, p)| Processing { logprobs: true, top_logprobs: top(r), ..p.clone() }).collect()
}

/// V = 5003 (not divisible by 2, 4 or 8): with N GPUs the tokens and top raw tokens equal
/// one GPU's unsharded ones and the log-probabilities agree within 10⁻⁵ (the sampler checks
/// that every rank holds the same answer). Every mode, one per row (the truncations decided
/// over all ranks by all-reduces between the segments of stage 1).
#[test]
#[ignore = "needs a CUDA GPU"]
fn every_rank_gets_the_single_gpu_tokens() {
    let (vocab, dim) = (5003, 64);
    let w = random_matrix(vocab, dim, DType::BF16, 1.0, 71);
    let modes: Vec<Processing> = each_mode(vocab).into_iter().map(|m| m.1).collect();
    let h = random_matrix(modes.len(), dim, DType::BF16, 1.0, 72);
    let params: Vec<SamplingParams> =
        (0..modes.len()).map(|r| SamplingParams::new(if r == 2 { 0.0 } else { 0.9 }, 8, r as u32, 1)).collect();
    let batch = Batch::with_processing(params, logprob_rows(&modes, |r| r as u32 % 3 * 7));
    let draws = Draws::first(32);
    let single = CudaSampler::new().unwrap();
    let want = single.sample(&single.upload_lm_head(&w).unwrap(), &h, &batch, draws).unwrap();
    let gpus = cuda_device_count().unwrap();
    let counts: Vec<usize> = [1, 2, 4, 8].into_iter().filter(|&n| n <= gpus).collect();
    for &n in &counts {
        let devices: Vec<usize> = (0..n).collect();
        let sampler = TensorParallelSampler::new(&devices).unwrap();
        let head = sampler.upload_lm_head(&w).unwrap();
        assert_eq!(head.shards(), n);
        let sampled = sampler.sample(&head, &h, &batch, draws).unwrap();
        assert_eq!(sampled.tokens, want.tokens, "N = {n}");
        let worst = largest_log_probability_difference(&sampled, &want, false);
        assert!(worst <= 1e-5, "N = {n}: log-probabilities differ by {worst}");
        for (row, (a, b)) in sampled.top_logprobs.iter().zip(&want.top_logprobs).enumerate() {
            assert_eq!(
                a.iter().map(|x| x.0).collect::<Vec<_>>(),
                b.iter().map(|x| x.0).collect::<Vec<_>>(),
                "row {row}"
            );
        }
        drop(head);
        sampler.close().unwrap();
    }
    println!("GPU counts run: {counts:?} of [1, 2, 4, 8] ({gpus} GPU(s) on this machine)");
}

/// One thread per GPU, as engines run ranks (`TensorParallelRank`, borrowed mode on each
/// thread's own context and stream, a communicator joined from one `NcclId`): for each GPU
/// count the machine has of 1, 2, 4 and 8, every rank's tokens, log-probabilities (within
/// 10⁻⁵) and top raw tokens equal one GPU's unsharded ones, with the outputs poisoned first.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_rank_per_thread_gets_the_single_gpu_tokens() {
    let (vocab, dim) = (5003, 64);
    let w = random_matrix(vocab, dim, DType::BF16, 1.0, 73);
    let modes: Vec<Processing> = each_mode(vocab).into_iter().map(|m| m.1).collect();
    let h = random_matrix(modes.len(), dim, DType::BF16, 1.0, 74);
    let params: Vec<SamplingParams> =
        (0..modes.len()).map(|r| SamplingParams::new(if r == 3 { 0.0 } else { 1.1 }, 4, r as u32, 2)).collect();
    let batch = Batch::with_processing(params, logprob_rows(&modes, |r| r as u32 % 2 * 9));
    let samples = 16u32;
    let single = CudaSampler::new().unwrap();
    let head = single.upload_lm_head(&w).unwrap();
    let want = single.sample(&head, &h, &batch, Draws::first(samples)).unwrap();
    let gpus = cuda_device_count().unwrap();
    for n in [1usize, 2, 4, 8].into_iter().filter(|&n| n <= gpus) {
        let id = NcclId::new().unwrap();
        let got: Vec<Sampled> = std::thread::scope(|scope| {
            let ranks: Vec<_> = (0..n)
                .map(|r| {
                    let (w, h, batch) = (&w, &h, &batch);
                    scope.spawn(move || rank_step(r, n, &id, w, h, batch, samples))
                })
                .collect();
            ranks.into_iter().map(|t| t.join().unwrap()).collect()
        });
        for (rank, sampled) in got.iter().enumerate() {
            assert_eq!(sampled.tokens, want.tokens, "N = {n}, rank {rank}");
            let worst = largest_log_probability_difference(sampled, &want, false);
            assert!(worst <= 1e-5, "N = {n}, rank {rank}: log-probabilities differ by {worst}");
            let tokens =
                |s: &Sampled| s.top_logprobs.iter().map(|t| t.iter().map(|x| x.0).collect()).collect::<Vec<Vec<u32>>>();
            assert_eq!(tokens(sampled), tokens(&want), "N = {n}, rank {rank}");
        }
        println!("N = {n}: every rank's tokens equal one GPU's");
    }
}

/// Rank `r` of `n` on GPU `r`: its shard of `w` and the replicated inputs made on a stream of
/// its own, one call queued there through the safe layer, the outputs read back.
fn rank_step(r: usize, n: usize, id: &NcclId, w: &Matrix, h: &Matrix, batch: &Batch, samples: u32) -> Sampled {
    let context = CudaContext::new(r).unwrap();
    let stream = context.new_stream().unwrap();
    let kernels = StreamSampler::on_context(&context, ModuleChoice::from_environment().unwrap()).unwrap();
    let rank = TensorParallelRank::join(&kernels, id, r, n).unwrap();
    let shard = rank.shard(w.rows()).unwrap();
    let rows_of_shard = flashsample::VocabShard::bounds(w.rows(), n).unwrap();
    let own = w.row_range(rows_of_shard[r], rows_of_shard[r + 1]);
    let (w_device, h_device) = (DeviceValues::upload(&stream, &own), DeviceValues::upload(&stream, h));
    let on_device = DeviceBatch::upload(&stream, batch, w.rows()).unwrap();
    let rows = h.rows();
    let poison = |words: usize| stream.clone_htod(&vec![f32::INFINITY.to_bits(); words]).unwrap();
    let mut parts = stream.alloc_zeros::<u8>(Target::parts_bytes(n, rows, samples, true).unwrap()).unwrap();
    let mut tokens = poison(rows * samples as usize);
    let mut logprobs = stream.clone_htod(&vec![f32::NAN; Target::logprobs_len(rows, samples)]).unwrap();
    let mut top = poison(Target::top_logprobs_len(rows));
    let mut workspace = StreamWorkspace::new();
    {
        let request = Request {
            lm_head: w_device.view(&stream, own.rows(), w.cols()),
            hidden: h_device.view(&stream, rows, h.cols()),
            batch: on_device.view(&stream),
            draws: Draws::first(samples),
            shard: Some(shard),
        };
        let target = Target {
            tokens: OutputSlice::of_slice(&mut tokens, &stream),
            logprobs: Some(OutputSlice::of_slice(&mut logprobs, &stream)),
            top_logprobs: Some(OutputSlice::of_slice(&mut top, &stream)),
            parts: Some(OutputSlice::of_slice(&mut parts, &stream)),
            accepted: None,
        };
        rank.enqueue_on(&kernels, &stream, &request, &target, &mut workspace).unwrap();
    }
    stream.synchronize().unwrap();
    rank.check().unwrap();
    let values = stream.clone_dtoh(&logprobs).unwrap();
    let top = stream.clone_dtoh(&top).unwrap();
    let tokens = stream.clone_dtoh(&tokens).unwrap();
    let got = Sampled::from_outputs(samples as usize, tokens, Some(&values), Some(&top)).unwrap();
    rank.close().unwrap();
    got
}
