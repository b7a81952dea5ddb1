//! Logit processing and log-probabilities where only the GPU has something to check (every
//! backend runs the processing bodies of the suite: `cpu.rs`, `gpu.rs`, `borrowed.rs`): the
//! fused and materialised paths against each other, every tile variant, the GPU against the
//! CPU on exact logits, borrowed mode against the owned sampler bit for bit. Ignored without a
//! GPU.

use flashsample::internals::{HANDOFF_COLUMNS, MMA_COLUMNS, STAGED_COLUMNS, Variant};
use flashsample::{
    Batch, CudaSampler, DType, DeviceMatrix, Draws, Error, Matrix, Module, OutputSlice, Processing, Request, Sampler,
    SamplingParams, Shard, StreamWorkspace, Target, VocabShard,
};
use flashsample_core::abi::TILE_ROWS;
use flashsample_core::truncation::{TileTop, select};
use flashsample_tests::processing::{
    OnDevice, assert_log_probabilities, each_mode, integer_matrix, largest_log_probability_difference,
    reference_logits, split_rows, uneven_bounds,
};
use flashsample_tests::{Backend, Borrowed, Cpu, Cuda, random_matrix};

fn cuda() -> Cuda {
    Cuda::new(Variant::Auto)
}

/// The GPU's `n` draws per row equal the CPU's token for token, and their log-probabilities
/// agree within 10⁻⁵ (relative above 1; the sums run in another order).
fn gpu_matches_cpu(w: &Matrix, h: &Matrix, params: &[SamplingParams], processing: &[Processing], n: u32) {
    let gpu = cuda().sample_processed(w, h, params, processing, n).unwrap();
    let cpu = Cpu.sample_processed(w, h, params, processing, n).unwrap();
    assert_eq!(gpu.tokens, cpu.tokens);
    let worst = largest_log_probability_difference(&gpu, &cpu, true);
    println!("tokens equal; log-probabilities within {worst:.2e} (relative above 1)");
    assert!(worst <= 1e-5, "log-probabilities differ by {worst} (relative above 1)");
}

/// The GPU draws the CPU's tokens: with integer inputs in [−4, 4] every logit is an integer
/// both backends compute exactly, so every mode in one batch (many ties, top-p cutting inside
/// them by index) must give the same tokens; the log-probabilities agree to 10⁻⁵ (relative
/// above 1; their sums run in another order).
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_and_cpu_draw_the_same_tokens_from_exact_logits() {
    let (vocab, dim) = (4099, 16);
    let modes = each_mode(vocab);
    let integers = |rows: usize, seed: u64| integer_matrix(rows, dim, seed).to_dtype(DType::BF16);
    let (w, h) = (integers(vocab, 53), integers(modes.len(), 54));
    let params: Vec<SamplingParams> =
        (0..modes.len()).map(|r| SamplingParams::new(if r == 2 { 0.0 } else { 3.0 }, 8, r as u32, 1)).collect();
    let processing: Vec<Processing> = modes.iter().map(|m| m.1.clone()).collect();
    gpu_matches_cpu(&w, &h, &params, &processing, 256);
}

/// A selection resolves where its members overflow the row's list: with most of a
/// vocabulary of 9,001 tied at one logit (every seventh entry spread around it), top-k, top-p
/// (its tie selection by index), both with min-p, and the top raw entries cut inside the tie,
/// whose entries share every bit of their key, far more than the `MEMBER_CAPACITY` a list
/// holds: the resolution reads the whole row, and the GPU draws the CPU's tokens (integer
/// inputs: exact logits), with log-probabilities within 10⁻⁵.
#[test]
#[ignore = "needs a CUDA GPU"]
fn selections_whose_members_overflow_the_list_resolve_over_the_row() {
    let (vocab, dim) = (9001, 16);
    assert!(vocab > 2 * flashsample_core::abi::MEMBER_CAPACITY as usize);
    let spread = integer_matrix(vocab, dim, 61);
    let values = (0..vocab * dim)
        .map(|k| {
            let (row, col) = (k / dim, k % dim);
            match row % 7 {
                0 => spread.get(row, col),
                _ => (col == 0) as u32 as f32,
            }
        })
        .collect();
    let w = flashsample_tests::matrix_of(vocab, dim, DType::F32, values).to_dtype(DType::BF16);
    let h = integer_matrix(6, dim, 62).to_dtype(DType::BF16);
    let base = Processing::default;
    let processing = vec![
        Processing { top_k: Some(3000), ..base() },
        Processing { top_p: 0.5, ..base() },
        Processing { top_k: Some(6000), top_p: 0.9, ..base() },
        Processing { min_p: 0.01, top_p: 0.7, ..base() },
        Processing { top_logprobs: 20, top_p: 0.95, ..base() },
        Processing { top_k: Some(1500), min_p: 0.02, top_logprobs: 5, ..base() },
    ];
    let params: Vec<SamplingParams> =
        (0..processing.len()).map(|r| SamplingParams::new(2.0, 17, r as u32, 1)).collect();
    gpu_matches_cpu(&w, &h, &params, &processing, 64);
}

/// A verification gives the CPU's emitted tokens, verdicts and log-probabilities: integer
/// inputs make every logit exact on both backends; six sequences (plain, greedy, top-p with a
/// repetition penalty, min-p, top-k with frequency and presence penalties, log-probabilities on
/// every row) of 0 to 5 drafts, some equal to the CPU's tokens, some not, whole and over 3
/// shards.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_verification_gives_the_cpus_tokens_and_verdicts() {
    let (vocab, dim) = (4099, 16);
    let w = integer_matrix(vocab, dim, 61).to_dtype(DType::BF16);
    let repetition = flashsample::Penalties { repetition: 1.3, ..flashsample::Penalties::NONE };
    let counting = flashsample::Penalties { frequency: 0.4, presence: 0.3, ..flashsample::Penalties::NONE };
    let history = vec![3, 17, 17, 400];
    let kinds = [
        (1.0, Processing::default()),
        (0.0, Processing::default()),
        (0.8, Processing { top_p: 0.9, penalties: repetition, history: history.clone(), ..Processing::default() }),
        (1.3, Processing { min_p: 0.05, ..Processing::default() }),
        (0.7, Processing { top_k: Some(20), penalties: counting, history, ..Processing::default() }),
        (2.0, Processing::default()),
    ];
    let batch = |drafts: &dyn Fn(usize) -> Vec<u32>| {
        let sequences = kinds
            .iter()
            .enumerate()
            .map(|(s, (t, processing))| flashsample::Drafted {
                params: SamplingParams::new(*t, 9, s as u32, 3),
                processing: Processing { logprobs: true, ..processing.clone() },
                drafts: drafts(s),
            })
            .collect();
        Batch::verify(sequences).unwrap()
    };
    let counts = [3usize, 2, 5, 0, 4, 1];
    let probe = batch(&|s| vec![0; counts[s]]);
    let h = integer_matrix(probe.rows(), dim, 62).to_dtype(DType::BF16);
    // The CPU's tokens at every position (whatever the drafts, as verification promises), then
    // drafts agreeing with them up to a position that differs per sequence.
    let cpu_probe = Cpu.sample_shards(std::slice::from_ref(&w), &h, &probe, Draws::first(1)).unwrap();
    let first_rows = probe.first_rows();
    let drafted = batch(&|s| {
        (0..counts[s])
            .map(|j| {
                let target = cpu_probe.tokens[first_rows[s] + j];
                if j == s % (counts[s] + 1) { (target + 1) % vocab as u32 } else { target }
            })
            .collect()
    });
    let shards = split_rows(&w, &uneven_bounds(vocab, 3, 4));
    for (name, heads) in [("whole", std::slice::from_ref(&w)), ("3 shards", &shards[..])] {
        let cpu = Cpu.sample_shards(heads, &h, &drafted, Draws::first(1)).unwrap();
        let gpu = cuda().sample_shards(heads, &h, &drafted, Draws::first(1)).unwrap();
        assert_eq!(gpu.tokens, cpu.tokens, "{name}");
        assert_eq!(gpu.verdicts, cpu.verdicts, "{name}");
        assert!(cpu.verdicts.iter().any(|v| v.accepted > 0), "{name}: some drafts are kept");
        let worst = largest_log_probability_difference(&gpu, &cpu, true);
        assert!(worst <= 1e-5, "{name}: log-probabilities differ by {worst} (relative above 1)");
    }
}

/// The fused `mma.sync` (register-direct and staged) and SIMT tiles, and on the Hopper module
/// the handoff tiles, list each (row, tile)'s first four processed entries (`TileTop`, what
/// fused truncation decides from) as the CPU does from the same logits:
/// integer inputs (every logit exact on both backends), plain rows, rows with a bias (one of
/// −∞) and rows with a mask; V = 1003 (a partial last tile), B = 37 (a partial column group);
/// every list poisoned first, so one left unwritten fails.
#[test]
#[ignore = "needs a CUDA GPU"]
fn the_tiles_list_their_first_entries_as_the_cpu_does() {
    let (vocab, dim, rows) = (1003, 16, 37);
    let (w, h) = (integer_matrix(vocab, dim, 71), integer_matrix(rows, dim, 72));
    let mut mask = vec![u32::MAX; vocab.div_ceil(32)];
    mask[1] = 0x0f0f_0f0f;
    let processing: Vec<Processing> = (0..rows)
        .map(|r| match r % 3 {
            0 => Processing::default(),
            1 => Processing { bias: vec![(5, 1.5), (130, -2.5), (600, f32::NEG_INFINITY)], ..Processing::default() },
            _ => Processing { mask: Some(mask.clone()), ..Processing::default() },
        })
        .collect();
    let params: Vec<SamplingParams> = (0..rows).map(|r| SamplingParams::new(0.8, 1, r as u32, 0)).collect();
    // The CPU's lists: the processed logits (exact here) offered tile by tile.
    let tiles = vocab.div_ceil(TILE_ROWS as usize);
    let expected: Vec<TileTop> = (0..rows)
        .flat_map(|r| {
            let raw: Vec<f32> =
                (0..vocab).map(|v| (0..dim).map(|k| (w.get(v, k) * h.get(r, k)) as f64).sum::<f64>() as f32).collect();
            let processed = reference_logits(&raw, &processing[r]);
            (0..tiles)
                .map(|tile| {
                    let mut top = TileTop::EMPTY;
                    let start = tile * TILE_ROWS as usize;
                    let end = (start + TILE_ROWS as usize).min(vocab);
                    for (v, &logit) in processed.iter().enumerate().take(end).skip(start) {
                        top.offer(logit as f32, v as u32);
                    }
                    top
                })
                .collect::<Vec<_>>()
        })
        .collect();
    let cuda = cuda();
    let sampler = &cuda.sampler;
    let (w, h) = (w.to_dtype(DType::BF16), h.to_dtype(DType::BF16));
    let head = sampler.upload_lm_head(&w).unwrap();
    let hidden = sampler.upload_hidden(&h).unwrap();
    let batch = sampler.upload_batch(&Batch::with_processing(params, processing), vocab).unwrap();
    let variants = MMA_COLUMNS
        .iter()
        .map(|&columns| Variant::Mma { columns })
        .chain(STAGED_COLUMNS.iter().map(|&columns| Variant::Staged { columns }))
        .chain([Variant::Simt])
        .chain(
            HANDOFF_COLUMNS
                .iter()
                .filter(|_| sampler.module() == Module::Hopper)
                .map(|&columns| Variant::TmaHandoff { columns }),
        );
    for variant in variants {
        let got = sampler.tile_tops(&head, &hidden, &batch, variant).unwrap();
        assert_eq!(got.len(), expected.len(), "{variant:?}");
        for (i, (got, want)) in got.iter().zip(&expected).enumerate() {
            assert_eq!(got, want, "{variant:?}: row {}, tile {}", i / tiles, i % tiles);
        }
    }
}

/// `rows × cols` integers in [−3, 3] from a splitmix64 stream: exact in every dtype, and with
/// `cols` large their dot products spread over many values (few ties).
fn spread_integers(rows: usize, cols: usize, seed: u64) -> Matrix {
    let mut state = seed;
    let values = (0..rows * cols)
        .map(|_| {
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            ((z ^ (z >> 31)) % 7) as f32 - 3.0
        })
        .collect();
    flashsample_tests::matrix_of(rows, cols, DType::F32, values)
}

/// Rows of every mode the listed path takes (top-k alone, with min-p before it, with top-p
/// after it), with a bias, a mask or a repetition penalty on some, and one greedy row.
fn listed_rows(vocab: usize) -> (Vec<SamplingParams>, Vec<Processing>) {
    let mut mask = vec![u32::MAX; vocab.div_ceil(32)];
    mask[3] = 0x5555_5555;
    let repetition = flashsample::Penalties { repetition: 1.3, ..flashsample::Penalties::NONE };
    let base = Processing::default;
    let processing = vec![
        Processing { top_k: Some(8), ..base() },
        Processing { min_p: 0.05, top_k: Some(200), bias: vec![(11, 6.0), (4000, f32::NEG_INFINITY)], ..base() },
        Processing { top_k: Some(16), top_p: 0.9, ..base() },
        Processing { min_p: 0.1, top_k: Some(64), top_p: 0.8, mask: Some(mask), ..base() },
        Processing { top_k: Some(1), min_p: 0.2, ..base() },
        Processing { top_k: Some(8), penalties: repetition, history: vec![5, 5, 90, 2000], ..base() },
        Processing { top_k: Some(12), min_p: 0.02, top_p: 0.95, ..base() },
        Processing { top_k: Some(8), ..base() },
    ];
    let params = (0..processing.len())
        .map(|r| SamplingParams::new([6.0, 9.0, 4.0, 12.0, 5.0, 7.0, 8.0, 0.0][r], 13, r as u32, 2))
        .collect();
    (params, processing)
}

/// How many rows the listed sampler leaves to its fallback, as the CPU finds it from exact
/// logits (`reference_logits` holds them exactly for these inputs and steps): each tile's
/// `TileTop`, the selection from their union, and a row that does not settle.
fn unsettled_on_cpu(w: &Matrix, h: &Matrix, params: &[SamplingParams], processing: &[Processing]) -> usize {
    let (vocab, dim) = (w.rows(), w.cols());
    (0..h.rows())
        .filter(|&r| {
            if params[r].temperature == 0.0 {
                return false;
            }
            let raw: Vec<f32> =
                (0..vocab).map(|v| (0..dim).map(|k| (w.get(v, k) * h.get(r, k)) as f64).sum::<f64>() as f32).collect();
            let logits: Vec<f32> = reference_logits(&raw, &processing[r]).iter().map(|&l| l as f32).collect();
            let tops: Vec<TileTop> = logits
                .chunks(TILE_ROWS as usize)
                .enumerate()
                .map(|(tile, chunk)| {
                    let mut top = TileTop::EMPTY;
                    for (i, &l) in chunk.iter().enumerate() {
                        top.offer(l, (tile * TILE_ROWS as usize + i) as u32);
                    }
                    top
                })
                .collect();
            let max = tops.iter().map(|top| top.logits[0]).fold(f32::NEG_INFINITY, f32::max);
            let mut union: Vec<(f32, u32)> = tops.iter().flat_map(|top| top.listed().collect::<Vec<_>>()).collect();
            let p = &processing[r];
            let selected = select(&mut union, max, params[r].temperature, p.min_p, p.top_k, p.top_p);
            tops.iter().any(|top| !top.settles(&selected.bound))
        })
        .count()
}

/// The inputs of the listed path's tests: `spread` (dot products of 256 integers: every row
/// settles) and `tied` (9 distinct rows of `W`: many ties, rows left to the fallback).
fn listed_inputs(vocab: usize, rows: usize) -> [(&'static str, Matrix, Matrix); 2] {
    [
        ("spread", spread_integers(vocab, 256, 81), spread_integers(rows, 256, 82)),
        ("tied", integer_matrix(vocab, 16, 83), integer_matrix(rows, 16, 84)),
    ]
}

/// The listed path's tests take the cases they mean to: every spread row settles, some tied
/// row does not.
#[test]
fn the_listed_inputs_settle_as_their_tests_need() {
    let vocab = 5003;
    let (params, processing) = listed_rows(vocab);
    let [(_, w, h), (_, tied_w, tied_h)] = listed_inputs(vocab, params.len());
    assert_eq!(unsettled_on_cpu(&w, &h, &params, &processing), 0);
    assert!(unsettled_on_cpu(&tied_w, &tied_h, &params, &processing) > 0);
}

/// The listed path (every row with top-k, no log-probabilities) gives the CPU's tokens, in
/// BF16 (the register-direct and the staged `mma.sync` tiles, and on the Hopper module the
/// handoff tile) and F32 (the SIMT tile), 4 draws
/// per row, outputs and workspace poisoned first: on spread logits every row settles (the
/// GPU's count of unsettled rows is the CPU's, 0), so the listed sampler's own tokens are the
/// ones checked; on tied
/// logits some rows do not, and the fallback behind it (the tile's GEMM and the sampler of
/// whole rows, top-p's cut by weighted radix selections over thousands of kept entries)
/// samples them from their logits.
#[test]
#[ignore = "needs a CUDA GPU"]
fn the_listed_path_gives_the_cpus_tokens_and_falls_back_where_lists_do_not_settle() {
    let vocab = 5003;
    let (params, processing) = listed_rows(vocab);
    let cuda = cuda();
    let sampler = &cuda.sampler;
    // BF16 on the register-direct and the staged `mma.sync` tiles (and the handoff tile), F32
    // on the SIMT tile.
    let mut cases =
        vec![(DType::BF16, Variant::Auto), (DType::BF16, Variant::Staged { columns: 64 }), (DType::F32, Variant::Auto)];
    if sampler.module() == Module::Hopper {
        cases.push((DType::BF16, Variant::TmaHandoff { columns: 64 }));
    }
    for (dtype, variant) in cases {
        sampler.set_variant(variant);
        for (name, w, h) in listed_inputs(vocab, params.len()) {
            let (w, h) = (w.to_dtype(dtype), h.to_dtype(dtype));
            let head = sampler.upload_lm_head(&w).unwrap();
            let hidden = sampler.upload_hidden(&h).unwrap();
            let batch =
                sampler.upload_batch(&Batch::with_processing(params.clone(), processing.clone()), vocab).unwrap();
            let mut out = sampler.outputs(&batch, 4).unwrap();
            sampler.sample_into(&head, &hidden, &batch, Draws::first(4), &mut out).unwrap();
            sampler.poison_workspace().unwrap();
            sampler.fill_outputs(&mut out, 0xffff_fffe).unwrap();
            let unsettled = sampler.sample_listed_into(&head, &hidden, &batch, Draws::first(4), &mut out).unwrap();
            let expected = unsettled_on_cpu(&w, &h, &params, &processing) as u32;
            assert_eq!(unsettled, Some(expected), "{name} {dtype:?} {variant:?}: rows left to the fallback");
            let gpu = sampler.read(&out).unwrap();
            let cpu = Cpu.sample_processed(&w, &h, &params, &processing, 4).unwrap();
            assert_eq!(gpu.tokens, cpu.tokens, "{name} {dtype:?} {variant:?}");
            println!("{name} {dtype:?} {variant:?}: {expected} of {} rows unsettled; tokens equal", params.len());
        }
    }
    sampler.set_variant(Variant::Auto);
}

/// Rows the chained path takes (min-p alone, with a bias, a mask or a repetition penalty on
/// some, one plain row and one greedy row) at temperatures scaled by `heat`: the dot products
/// of `spread_integers` spread over about ±64, so at `heat` 1 min-p keeps few entries and at
/// `heat` 12 a large part of each row (flat rows, whose tiles' chains reach less far).
fn chained_rows(vocab: usize, heat: f32) -> (Vec<SamplingParams>, Vec<Processing>) {
    let mut mask = vec![u32::MAX; vocab.div_ceil(32)];
    mask[3] = 0x5555_5555;
    let repetition = flashsample::Penalties { repetition: 1.3, ..flashsample::Penalties::NONE };
    let base = Processing::default;
    let processing = vec![
        Processing { min_p: 0.05, ..base() },
        Processing { min_p: 0.1, bias: vec![(11, 6.0), (4000, f32::NEG_INFINITY)], ..base() },
        Processing { min_p: 0.01, ..base() },
        Processing { min_p: 0.2, mask: Some(mask), ..base() },
        base(),
        Processing { min_p: 0.05, penalties: repetition, history: vec![5, 5, 90, 2000], ..base() },
        Processing { min_p: 0.5, ..base() },
        Processing { min_p: 0.05, ..base() },
    ];
    let params = (0..processing.len())
        .map(|r| SamplingParams::new([6.0, 9.0, 4.0, 12.0, 5.0, 7.0, 8.0, 0.0][r] * heat, 13, r as u32, 2))
        .collect();
    (params, processing)
}

/// How many rows the chained sampler leaves to its fallback, as the CPU finds it from exact
/// logits and the rows' noise for `draws`: per draw, each tile's chain as its four warps
/// write them (32 consecutive entries each, at the min-p floor of their own largest logit,
/// merged in pairs, then the pairs), and a row where one cannot tell at the row's cut.
fn unsettled_chains_on_cpu(
    w: &Matrix,
    h: &Matrix,
    params: &[SamplingParams],
    processing: &[Processing],
    draws: Draws,
) -> usize {
    use flashsample_core::chain::{Chain, Link};
    use flashsample_core::process::min_p_threshold;
    let (vocab, dim) = (w.rows(), w.cols());
    (0..h.rows())
        .filter(|&r| {
            let row = flashsample_tests::row_params(params, r);
            let min_p = processing[r].min_p;
            let raw: Vec<f32> =
                (0..vocab).map(|v| (0..dim).map(|k| (w.get(v, k) * h.get(r, k)) as f64).sum::<f64>() as f32).collect();
            let logits: Vec<f32> = reference_logits(&raw, &processing[r]).iter().map(|&l| l as f32).collect();
            let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let cut = min_p_threshold(max, row.temperature, min_p);
            (draws.first..draws.first + draws.count).any(|draw| {
                let entries: Vec<Link> = logits
                    .chunks(4)
                    .enumerate()
                    .flat_map(|(block, quad)| {
                        let mut four = [f32::NEG_INFINITY; 4];
                        four[..quad.len()].copy_from_slice(quad);
                        let (scores, words) = flashsample_core::block_scores(&row, draw, block as u32, four);
                        (0..quad.len()).map(move |i| Link {
                            logit: four[i],
                            candidate: flashsample_core::Candidate::scored(scores[i], words[i], (4 * block + i) as u32),
                        })
                    })
                    .collect();
                entries.chunks(TILE_ROWS as usize).any(|tile| {
                    // Warps past the vocabulary search nothing.
                    let warps: Vec<Chain> = (0..4)
                        .map(|w| {
                            let warp = tile.get(32 * w..).map_or(&[][..], |rest| &rest[..rest.len().min(32)]);
                            let most = warp.iter().map(|e| e.logit).fold(f32::NEG_INFINITY, f32::max);
                            Chain::of(warp, min_p_threshold(most, row.temperature, min_p))
                        })
                        .collect();
                    let merge = |a: &Chain, b: &Chain| {
                        let mut out = *a;
                        Chain::merge_into(a, b, &mut out);
                        out
                    };
                    let chain = merge(&merge(&warps[0], &warps[1]), &merge(&warps[2], &warps[3]));
                    chain.winner(cut).is_none()
                })
            })
        })
        .count()
}

/// The chained path's tests take the cases they mean to: at heat 1 every row settles, at heat
/// 12 some do not.
#[test]
fn the_chained_inputs_settle_as_their_tests_need() {
    let vocab = 5003;
    let (w, draws) = (spread_integers(vocab, 256, 81), Draws { first: 3, count: 3 });
    for (heat, settles) in [(1.0, true), (12.0, false)] {
        let (params, processing) = chained_rows(vocab, heat);
        let h = spread_integers(params.len(), 256, 82);
        let unsettled = unsettled_chains_on_cpu(&w, &h, &params, &processing, draws);
        println!("heat {heat}: {unsettled} of {} rows unsettled", params.len());
        assert_eq!(unsettled == 0, settles, "heat {heat}: {unsettled} rows unsettled");
    }
}

/// The chained path (every row's truncation min-p alone, no log-probabilities) gives the CPU's
/// tokens, in BF16 (the register-direct and the staged `mma.sync` tiles) and F32 (the SIMT
/// tile), 3 draws per row after 3 earlier ones (the most whose chains fit the logits' bytes), outputs and workspace poisoned first: at heat 1
/// every row's chains tell (the GPU's count of unsettled rows is the CPU's, 0), so the chained
/// sampler's own tokens are the ones checked; at heat 12 some rows' chains cannot, and the
/// fallback behind it samples them from their logits.
#[test]
#[ignore = "needs a CUDA GPU"]
fn the_chained_path_gives_the_cpus_tokens_and_falls_back_where_chains_cannot_tell() {
    let vocab = 5003;
    let draws = Draws { first: 3, count: 3 };
    let cuda = cuda();
    let sampler = &cuda.sampler;
    let (w, h) = (spread_integers(vocab, 256, 81), spread_integers(8, 256, 82));
    // Named, as the Hopper module's own choice is its TMA tile (which writes no chains).
    for (dtype, variant) in [
        (DType::BF16, Variant::Mma { columns: 8 }),
        (DType::BF16, Variant::Staged { columns: 64 }),
        (DType::F32, Variant::Auto),
    ] {
        sampler.set_variant(variant);
        for heat in [1.0, 12.0] {
            let (params, processing) = chained_rows(vocab, heat);
            let (w, h) = (w.to_dtype(dtype), h.to_dtype(dtype));
            let head = sampler.upload_lm_head(&w).unwrap();
            let hidden = sampler.upload_hidden(&h).unwrap();
            let batch =
                sampler.upload_batch(&Batch::with_processing(params.clone(), processing.clone()), vocab).unwrap();
            let mut out = sampler.outputs(&batch, draws.count).unwrap();
            sampler.sample_into(&head, &hidden, &batch, draws, &mut out).unwrap();
            sampler.poison_workspace().unwrap();
            sampler.fill_outputs(&mut out, 0xffff_fffe).unwrap();
            let unsettled = sampler.sample_listed_into(&head, &hidden, &batch, draws, &mut out).unwrap();
            let expected = unsettled_chains_on_cpu(&w, &h, &params, &processing, draws) as u32;
            assert_eq!(unsettled, Some(expected), "heat {heat} {dtype:?} {variant:?}: rows left to the fallback");
            let gpu = sampler.read(&out).unwrap();
            let cpu = Cpu
                .sample_shards(
                    std::slice::from_ref(&w),
                    &h,
                    &Batch::with_processing(params.clone(), processing.clone()),
                    draws,
                )
                .unwrap();
            assert_eq!(gpu.tokens, cpu.tokens, "heat {heat} {dtype:?} {variant:?}");
            println!("heat {heat} {dtype:?} {variant:?}: {expected} of {} rows unsettled; tokens equal", params.len());
        }
    }
    sampler.set_variant(Variant::Auto);
}

/// Without log-probabilities the logits are processed in place and no log-sum-exp is summed:
/// the same tokens, every mode in one batch, and no log-probabilities returned.
#[test]
#[ignore = "needs a CUDA GPU"]
fn without_log_probabilities_the_tokens_are_the_same() {
    let vocab = 2053;
    let modes = each_mode(vocab);
    let w = random_matrix(vocab, 24, DType::BF16, 0.5, 55);
    let h = random_matrix(modes.len(), 24, DType::BF16, 1.0, 56);
    let params: Vec<SamplingParams> = (0..modes.len()).map(|r| SamplingParams::new(0.9, 3, r as u32, 0)).collect();
    let processing: Vec<Processing> = modes.iter().map(|m| m.1.clone()).collect();
    let sampler = &cuda().sampler;
    let on_device = OnDevice::new(sampler, &w, &h, &params, &processing);
    let run = |logprobs: bool| on_device.sample(sampler, 40, logprobs).unwrap();
    let (with, without) = (run(true), run(false));
    assert_eq!(with.tokens, without.tokens);
    assert_eq!(with.logprobs.len(), modes.len() * 40);
    assert!(without.logprobs.is_empty() && without.processed_logprobs.is_empty());
}

/// Row parameters of a batch at T = 0.8, with greedy rows and temperatures whose `1 / T`
/// overflows (10⁻⁴⁵) or nearly vanishes (10³⁰) among them.
fn mixed_temperatures(rows: usize) -> Vec<SamplingParams> {
    let temperature = |r: usize| match r % 7 {
        3 => 0.0,
        5 => 1e-45,
        6 => 1e30,
        _ => 0.8,
    };
    (0..rows).map(|r| SamplingParams::new(temperature(r), 5, r as u32, 0)).collect()
}

/// The per-entry modes (soft-cap, bias, mask, penalties, and all four), cycled over the rows
/// of a batch.
fn per_entry_modes(vocab: usize, rows: usize) -> Vec<Processing> {
    let modes = each_mode(vocab);
    let mut all = modes[0].1.clone();
    all.bias = modes[1].1.bias.clone();
    all.mask = modes[2].1.mask.clone();
    (all.history, all.penalties) = (modes[3].1.history.clone(), modes[3].1.penalties);
    let per_entry: Vec<Processing> = modes[..4].iter().map(|m| m.1.clone()).chain([all]).collect();
    (0..rows).map(|r| per_entry[r % per_entry.len()].clone()).collect()
}

/// The tensor-core variants of the sampler's module and the SIMT tile.
fn every_variant(sampler: &CudaSampler) -> Vec<Variant> {
    Variant::tensor_core(sampler.module()).chain([Variant::Simt]).collect()
}

/// Whether a TMA tile has the registers to apply the per-entry steps.
fn applies_processing(variant: Variant) -> bool {
    match variant {
        Variant::Tma { rows, columns } => flashsample_core::registry::tma_tile_applies_processing(rows, columns),
        _ => true,
    }
}

/// Soft-cap, bias, mask and penalties applied in the fused tile (no logits in memory) give
/// the materialised path's tokens with the same tile, whose logits are the same bits (rows
/// that also ask for a top raw log-probability take the processing pipeline); the fused
/// tile's log-probabilities (its per-tile log-sum-exp terms, the winners' dot products) leave
/// the tokens as they are and match f64 within 10⁻⁴: every tensor-core variant of the module
/// and the SIMT tile, 37 rows (greedy ones among them, and T = 10⁻⁴⁵ and 10³⁰), V = 2053
/// (tiles that end past V).
#[test]
#[ignore = "needs a CUDA GPU"]
fn fused_per_entry_steps_give_the_materialised_tokens() {
    let (vocab, dim, batch, n) = (2053, 64, 37, 8u32);
    let w = random_matrix(vocab, dim, DType::BF16, 0.5, 57);
    let h = random_matrix(batch, dim, DType::BF16, 1.0, 58);
    let params = mixed_temperatures(batch);
    let processing = per_entry_modes(vocab, batch);
    let with_top: Vec<Processing> = processing.iter().map(|p| Processing { top_logprobs: 1, ..p.clone() }).collect();
    let sampler = cuda().sampler;
    let fused = OnDevice::new(&sampler, &w, &h, &params, &processing);
    let materialised = OnDevice::new(&sampler, &w, &h, &params, &with_top);
    let names = vec!["per-entry"; batch];
    let mut worst: f64 = 0.0;
    for variant in every_variant(&sampler) {
        sampler.set_variant(variant);
        let run = |logprobs: bool| fused.sample(&sampler, n, logprobs);
        if !applies_processing(variant) {
            for logprobs in [false, true] {
                let refused = run(logprobs).unwrap_err().to_string();
                assert!(refused.contains("does not apply per-row processing"), "{refused}");
            }
            continue;
        }
        let (plain, with_logprobs) = (run(false).unwrap(), run(true).unwrap());
        assert!(plain.tokens.iter().all(|&t| (t as usize) < vocab), "{variant:?}: {:?}", plain.tokens);
        assert_eq!(with_logprobs.tokens, plain.tokens, "{variant:?}");
        let name = format!("{variant:?}");
        let error = assert_log_probabilities(&name, &w, &h, &params, &processing, &names, &with_logprobs, 1e-4);
        worst = worst.max(error);
        if variant != Variant::Simt {
            let materialised = materialised.sample(&sampler, n, true).unwrap();
            assert_eq!(plain.tokens, materialised.tokens, "{variant:?}");
        }
    }
    println!("fused log-probabilities within {worst:.2e} of f64");
}

/// The SIMT tile (F32, D not a multiple of 8) applies the per-entry steps as the CPU does:
/// integer inputs make every logit exact on both, so the tokens are equal.
#[test]
#[ignore = "needs a CUDA GPU"]
fn fused_per_entry_steps_on_the_simt_tile_give_the_cpu_tokens() {
    let (vocab, dim, batch, n) = (1031, 13, 10, 16u32);
    let integers = |rows: usize, seed: u64| integer_matrix(rows, dim, seed);
    let (w, h) = (integers(vocab, 59), integers(batch, 60));
    let params: Vec<SamplingParams> = (0..batch).map(|r| SamplingParams::new(2.5, 6, r as u32, 0)).collect();
    let processing = per_entry_modes(vocab, batch);
    let sampler = cuda().sampler;
    sampler.set_variant(Variant::Simt);
    let on_device = OnDevice::new(&sampler, &w, &h, &params, &processing);
    let gpu = on_device.sample(&sampler, n, false).unwrap().tokens;
    assert_eq!(gpu, Cpu.sample_processed(&w, &h, &params, &processing, n).unwrap().tokens);
}

/// Borrowed mode (the safe layer on a second stream into the caller's buffers, workspace and
/// outputs poisoned first) gives the owned sampler's tokens and log-probabilities bit for bit
/// for every mode in one batch (top raw entries on every other row, a greedy row).
#[test]
#[ignore = "needs a CUDA GPU"]
fn borrowed_mode_gives_the_owned_results_bit_for_bit() {
    let (vocab, dim) = (5003, 32);
    let w = random_matrix(vocab, dim, DType::BF16, 0.5, 47);
    let modes = each_mode(vocab);
    let h = random_matrix(modes.len(), dim, DType::BF16, 1.0, 48);
    let params: Vec<SamplingParams> =
        (0..modes.len()).map(|r| SamplingParams::new(if r == 5 { 0.0 } else { 0.9 }, 3, r as u32, 0)).collect();
    let processing: Vec<Processing> =
        modes.iter().enumerate().map(|(r, m)| Processing { top_logprobs: [7, 0][r % 2], ..m.1.clone() }).collect();
    let want = cuda().sample_processed(&w, &h, &params, &processing, 32).unwrap();
    let got = Borrowed::new().sample_processed(&w, &h, &params, &processing, 32).unwrap();
    let bits = |values: &[f32]| values.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    assert_eq!(got.tokens, want.tokens);
    assert_eq!(bits(&got.logprobs), bits(&want.logprobs));
    assert_eq!(bits(&got.processed_logprobs), bits(&want.processed_logprobs));
    assert_eq!(got.top_logprobs, want.top_logprobs);
}

/// Log-probabilities without truncations or top entries (the fused tiles' per-tile
/// log-sum-exp terms, the winners' dot products): on integer inputs (exact logits on both
/// backends) the per-entry modes, plain rows and a greedy row give the CPU's tokens, and
/// log-probabilities within 10⁻⁵ (relative above 1).
#[test]
#[ignore = "needs a CUDA GPU"]
fn per_tile_log_sum_exp_gives_the_cpu_log_probabilities() {
    let (vocab, dim, batch) = (4099, 16, 11);
    let integers = |rows: usize, seed: u64| integer_matrix(rows, dim, seed).to_dtype(DType::BF16);
    let (w, h) = (integers(vocab, 67), integers(batch, 68));
    let params: Vec<SamplingParams> =
        (0..batch).map(|r| SamplingParams::new(if r == 4 { 0.0 } else { 1.7 }, 9, r as u32, 2)).collect();
    let mut processing = per_entry_modes(vocab, batch);
    processing[batch - 1] = Processing::default();
    gpu_matches_cpu(&w, &h, &params, &processing, 128);
}

/// The safe layer queues no request sharded over several shards (its segments exchange with
/// the other shards: a tensor-parallel rank's work), naming the shard; a request over a shard
/// whose offset splits a Philox block is refused before anything is queued.
#[test]
#[ignore = "needs a CUDA GPU"]
fn the_safe_layer_refuses_exchanges_and_unaligned_shards() {
    let borrowed = Borrowed::new();
    let stream = &borrowed.stream;
    let (vocab, dim, rows) = (1000usize, 16usize, 2usize);
    let w = stream.clone_htod(&vec![half::bf16::from_f32(0.1); 500 * dim]).unwrap();
    let h = stream.clone_htod(&vec![half::bf16::from_f32(1.0); rows * dim]).unwrap();
    let params = vec![SamplingParams::new(0.9, 1, 0, 0); rows];
    let batch = flashsample::DeviceBatch::upload(stream, &Batch::new(params), vocab).unwrap();
    let mut tokens = stream.alloc_zeros::<u32>(rows * 4).unwrap();
    let mut parts = stream.alloc_zeros::<u8>(Target::parts_bytes(2, rows, 4, false).unwrap()).unwrap();
    for (offset, expected) in [(500, "request.shard"), (502, "shard.offset")] {
        let request = Request {
            lm_head: DeviceMatrix::of_slice(&w, stream, 500, dim).unwrap(),
            hidden: DeviceMatrix::of_slice(&h, stream, rows, dim).unwrap(),
            batch: batch.view(stream),
            draws: Draws::first(4),
            shard: Some(Shard { tokens: VocabShard { offset, vocab }, index: 1, count: 2 }),
        };
        let mut target = Target::tokens(OutputSlice::of_slice(&mut tokens, stream));
        target.parts = Some(OutputSlice::of_slice(&mut parts, stream));
        let refused = borrowed.kernels.enqueue_on(stream, &request, &target, &mut StreamWorkspace::new());
        match refused {
            Err(Error::InvalidArgument { argument, .. }) => assert_eq!(argument, expected, "offset {offset}"),
            other => panic!("offset {offset}: {other:?}"),
        }
    }
    stream.synchronize().unwrap();
}

/// Fused shards (no log-probabilities: the tile kernels with the shard's global offset, plain
/// and with per-entry steps) give the unsharded tokens on every tile variant of the module and
/// the SIMT tile: 3 uneven shards, 37 rows (greedy ones among them, and T = 10⁻⁴⁵ and 10³⁰),
/// V = 2053.
#[test]
#[ignore = "needs a CUDA GPU"]
fn fused_shards_give_the_unsharded_tokens_on_every_variant() {
    let (vocab, dim, batch, n) = (2053, 64, 37, 8u32);
    let w = random_matrix(vocab, dim, DType::BF16, 0.5, 65);
    let h = random_matrix(batch, dim, DType::BF16, 1.0, 66);
    let params = mixed_temperatures(batch);
    let bounds = uneven_bounds(vocab, 3, 4);
    let sampler = cuda().sampler;
    let sharded = sampler.upload_lm_head_shards(&split_rows(&w, &bounds)).unwrap();
    for (label, processing) in
        [("plain", vec![Processing::default(); batch]), ("per-entry", per_entry_modes(vocab, batch))]
    {
        let on_device = OnDevice::new(&sampler, &w, &h, &params, &processing);
        for variant in every_variant(&sampler) {
            if label == "per-entry" && !applies_processing(variant) {
                continue;
            }
            sampler.set_variant(variant);
            let whole = on_device.sample(&sampler, n, false).unwrap().tokens;
            let mut out = sampler.outputs(&on_device.batch, n).unwrap();
            sampler.sample_into(&sharded, &on_device.hidden, &on_device.batch, Draws::first(n), &mut out).unwrap();
            sampler.poison_workspace().unwrap();
            sampler.sample_into(&sharded, &on_device.hidden, &on_device.batch, Draws::first(n), &mut out).unwrap();
            let got = sampler.read(&out).unwrap().tokens;
            assert!(whole.iter().all(|&t| (t as usize) < vocab), "{label} {variant:?}: {whole:?}");
            assert_eq!(got, whole, "{label} {variant:?} at {bounds:?}");
        }
    }
}
