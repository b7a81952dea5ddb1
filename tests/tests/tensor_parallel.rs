//! Tensor-parallel sampling through NCCL (feature `nccl`): the argument rules and a missing
//! library on any machine; on GPUs (ignored without one) every rank's tokens and
//! log-probabilities against the single-GPU path, for each GPU count the machine has of 1, 2,
//! 4 and 8, with one process driving every GPU and with a rank per thread in borrowed mode.

use flashsample::cudarc::driver::{CudaContext, CudaSlice, DevicePtr};
use flashsample::{
    CudaSampler, DType, DeviceMatrix, DeviceProcessing, DeviceRows, Draws, Error, Matrix, ModuleChoice, NcclId,
    ProcessedRequest, Processing, RankStep, Sampled, SamplingParams, StreamSampler, StreamWorkspace,
    TensorParallelRank, TensorParallelSampler, Variant, VocabShard, cuda_device_count, nccl_library_present,
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
        let no_id = NcclId::new().err().unwrap();
        assert!(matches!(&no_id, Error::Nccl { rank: None, .. }) && no_id.to_string().contains("NCCL"), "{no_id}");
    }
}

/// V = 5003 (not divisible by 2, 4 or 8): with N GPUs, each rank's tokens and top raw tokens
/// equal one GPU's unsharded ones and the log-probabilities agree within 10⁻⁵; every rank holds
/// the same answer. Every mode, one per row (the truncations decided over all ranks by
/// all-reduces between the segments of stage 1).
#[test]
#[ignore = "needs a CUDA GPU"]
fn every_rank_gets_the_single_gpu_tokens() {
    let (vocab, dim) = (5003, 64);
    let w = random_matrix(vocab, dim, DType::BF16, 1.0, 71);
    let modes: Vec<Processing> = each_mode(vocab).into_iter().map(|m| m.1).collect();
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
    let processing: Vec<Processing> =
        modes.iter().enumerate().map(|(r, p)| Processing { top_logprobs: r as u32 % 2 * 9, ..p.clone() }).collect();
    let samples = 16u32;
    let single = CudaSampler::new().unwrap();
    let head = single.upload_lm_head(&w).unwrap();
    let want = single.sample_processed(&head, &h, &params, &processing, Draws::first(samples)).unwrap();
    let gpus = cuda_device_count().unwrap();
    for n in [1usize, 2, 4, 8].into_iter().filter(|&n| n <= gpus) {
        let id = NcclId::new().unwrap();
        let bounds = VocabShard::bounds(vocab, n).unwrap();
        let got: Vec<Sampled> = std::thread::scope(|scope| {
            let ranks: Vec<_> = (0..n)
                .map(|r| {
                    let (w, h, params, processing, bounds) = (&w, &h, &params, &processing, &bounds);
                    scope.spawn(move || rank_step(r, n, &id, w, h, params, processing, bounds, samples))
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
/// its own, one step queued there, the outputs read back.
#[allow(clippy::too_many_arguments)]
fn rank_step(
    r: usize,
    n: usize,
    id: &NcclId,
    w: &Matrix,
    h: &Matrix,
    params: &[SamplingParams],
    processing: &[Processing],
    bounds: &[usize],
    samples: u32,
) -> Sampled {
    let context = CudaContext::new(r).unwrap();
    let stream = context.new_stream().unwrap();
    let kernels = StreamSampler::on_context(&context, ModuleChoice::from_environment().unwrap()).unwrap();
    let shard = w.row_range(bounds[r], bounds[r + 1]);
    let w_device = stream.clone_htod(shard.elements().as_bytes()).unwrap();
    let h_device = stream.clone_htod(h.elements().as_bytes()).unwrap();
    let rows = DeviceRows::upload(&stream, params).unwrap();
    let device_processing = DeviceProcessing::upload(&stream, processing, w.rows()).unwrap();
    let rank = TensorParallelRank::join(&kernels, id, r, n).unwrap();
    let batch = h.rows();
    let poison = |bytes: usize| stream.clone_htod(&vec![f32::INFINITY.to_bits(); bytes / 4]).unwrap();
    let parts = poison(rank.parts_bytes(batch, samples, true).unwrap());
    let tokens = poison(4 * batch * samples as usize);
    let logprobs = poison(ProcessedRequest::logprobs_bytes(batch, samples as usize));
    let top = poison(ProcessedRequest::top_logprobs_bytes(batch));
    let address = |slice: &CudaSlice<u32>| slice.device_ptr(&stream).0;
    let bytes_address = |slice: &CudaSlice<u8>| slice.device_ptr(&stream).0;
    let step = RankStep {
        lm_head: DeviceMatrix::contiguous(bytes_address(&w_device), shard.rows(), w.cols(), DType::BF16),
        vocab_offset: bounds[r],
        vocab: w.rows(),
        hidden: DeviceMatrix::contiguous(bytes_address(&h_device), batch, h.cols(), DType::BF16),
        row_params: rows.address(),
        draws: Draws::first(samples),
        variant: Variant::Auto,
        processing: device_processing.on_device(),
        parts: address(&parts),
        logprobs: true,
        tokens: address(&tokens),
        out_logprobs: address(&logprobs),
        out_top_logprobs: address(&top),
    };
    let mut workspace = StreamWorkspace::new();
    let space = workspace.ensure(&stream, rank.workspace_bytes(&kernels, &step).unwrap()).unwrap();
    // SAFETY: every buffer lives on `stream` with the step's extents until the reads below
    // have waited for it.
    unsafe { rank.sample(&kernels, stream.cu_stream().cast(), &step, space).unwrap() };
    stream.synchronize().unwrap();
    rank.check().unwrap();
    let values: Vec<f32> = stream.clone_dtoh(&logprobs).unwrap().into_iter().map(f32::from_bits).collect();
    let top = stream.clone_dtoh(&top).unwrap();
    let got = Sampled::from_processed_outputs(
        samples as usize,
        stream.clone_dtoh(&tokens).unwrap(),
        Some(&values),
        Some(&top),
    )
    .unwrap();
    rank.close().unwrap();
    got
}
