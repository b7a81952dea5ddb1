//! The launch sequences of the GPU paths, recorded without a GPU (`driver::trace`) and held
//! against `host/launches.txt`: what every kind of request queues (kernels, argument blocks,
//! copies, fills, the reductions between segments) for fixed device addresses. A change to the
//! host code that changes what reaches the GPU shows here as a difference; regenerate the file
//! with `FLASHSAMPLE_BLESS=1` only for a change meant to alter the launches.

use flashsample_core::abi::{DevicePtr, Selection};
use flashsample_core::registry::Module;

use super::batch::{BatchRef, ProcessingRef, VerifiedRef};
use super::dispatch::Variant;
use super::driver::trace;
use super::memory::ResidentMaps;
use super::plan::Plan;
use super::request::{DeviceMatrix, DeviceWorkspace, Exchange, OutputSlice, Request, Shard, Target};
use super::stream::StreamSampler;
use crate::params::{Draws, VocabShard};
use crate::processing::Processing;
use crate::tensor::DType;
use flashsample_core::process::Penalties;

const LM_HEAD: u64 = 0x10_0000_0000;
const HIDDEN: u64 = 0x20_0000_0000;
const ROWS: u64 = 0x30_0000_0000;
const TOKENS: u64 = 0x40_0000_0000;
const LOGPROBS: u64 = 0x50_0000_0000;
const TOP_LOGPROBS: u64 = 0x60_0000_0000;
const PARTS: u64 = 0x70_0000_0000;
const EXCHANGE: u64 = 0x80_0000_0000;
const PROCESSING: u64 = 0x90_0000_0000;
const WORKSPACE: u64 = 0xA0_0000_0000;
const VERIFIED: u64 = 0xD0_0000_0000;
const DRAFTS: u64 = 0xD1_0000_0000;
const ACCEPTED: u64 = 0xE0_0000_0000;
/// Room every output has: more than any case writes.
const ROOM: usize = 1 << 30;

/// The shapes of a case: `W[vocab, dim]`, `H[batch, dim]`, the draws.
#[derive(Clone, Copy, Debug)]
struct Shape {
    dtype: DType,
    vocab: usize,
    dim: usize,
    batch: usize,
    draws: Draws,
}

impl Shape {
    /// The request of these shapes over the rows' `processing` (plain rows without one).
    fn request(&self, processing: Option<ProcessingRef>, shard: Option<Shard>) -> Request<'static> {
        let processing = processing.unwrap_or(ProcessingRef::plain(self.batch, self.vocab));
        let processing = ProcessingRef { address: processing.address, ..processing };
        // SAFETY: recorded, never launched: the addresses are never read.
        unsafe {
            Request {
                lm_head: DeviceMatrix::from_raw(LM_HEAD, self.vocab, self.dim, self.dim, self.dtype),
                hidden: DeviceMatrix::from_raw(HIDDEN, self.batch, self.dim, self.dim, self.dtype),
                batch: BatchRef::recording(ROWS, processing),
                draws: self.draws,
                shard,
            }
        }
    }
}

/// A target at the fixed addresses, with log-probabilities, top entries and parts as asked.
fn target(logprobs: bool, top: bool, parts: bool) -> Target<'static> {
    // SAFETY: recorded, never launched.
    unsafe {
        Target {
            tokens: OutputSlice::from_raw(TOKENS, ROOM),
            logprobs: logprobs.then(|| OutputSlice::from_raw(LOGPROBS, ROOM)),
            top_logprobs: top.then(|| OutputSlice::from_raw(TOP_LOGPROBS, ROOM)),
            parts: parts.then(|| OutputSlice::from_raw(PARTS, ROOM)),
            accepted: None,
        }
    }
}

/// `request` as a verification of `sequences` sequences, `target` with room for its verdicts.
fn verifying<'a>(mut request: Request<'a>, mut target: Target<'a>, sequences: usize) -> (Request<'a>, Target<'a>) {
    request.batch.verified =
        Some(VerifiedRef { sequences: VERIFIED, drafts: DRAFTS, count: sequences, drafted: 3 * sequences });
    // SAFETY: recorded, never launched.
    target.accepted = Some(unsafe { OutputSlice::from_raw(ACCEPTED, ROOM) });
    (request, target)
}

/// A row's processing of each kind the paths tell apart, for a vocabulary of `vocab`.
fn processing_kind(kind: &str, vocab: usize, row: usize) -> Processing {
    let v = vocab as u32;
    let base = Processing::default;
    let mut mask = vec![u32::MAX; vocab.div_ceil(32)];
    mask[0] = 0x5555_5555;
    match (kind, row % 4) {
        ("plain", _) => base(),
        ("per-entry", 0) => Processing { softcap: Some(30.0), ..base() },
        ("per-entry", 1) => Processing { bias: vec![(3, 1.5), (v - 1, f32::NEG_INFINITY)], ..base() },
        ("per-entry", 2) => Processing { mask: Some(mask), ..base() },
        ("per-entry", _) => Processing {
            history: vec![1, 2, 2, v - 2],
            penalties: Penalties { repetition: 1.2, frequency: 0.1, presence: 0.3 },
            ..base()
        },
        ("truncating", 0) => Processing { min_p: 0.05, ..base() },
        ("truncating", 1) => Processing { top_k: Some(50), ..base() },
        ("truncating", 2) => Processing { top_p: 0.9, ..base() },
        ("truncating", _) => base(),
        ("listed", 0) => Processing { min_p: 0.05, top_k: Some(100), ..base() },
        ("listed", 1) => Processing { top_k: Some(50), top_p: 0.9, bias: vec![(3, 1.0)], ..base() },
        ("listed", _) => Processing { top_k: Some(20), ..base() },
        ("chained", 0) => Processing { min_p: 0.05, ..base() },
        ("chained", 1) => Processing { min_p: 0.1, bias: vec![(3, 1.0)], ..base() },
        ("chained", _) => base(),
        ("top", r) => Processing { top_logprobs: [20, 0, 5, 1][r], ..base() },
        ("mixed", 0) => Processing { softcap: Some(30.0), top_k: Some(50), top_p: 0.9, ..base() },
        ("mixed", 1) => Processing { min_p: 0.1, top_logprobs: 3, ..base() },
        ("mixed", 2) => Processing { bias: vec![(0, 2.0)], ..base() },
        ("mixed", _) => Processing { top_k: Some(1), ..base() },
        (other, _) => panic!("no processing kind {other}"),
    }
}

/// The batch's processing of `kind` as a request names it, at [`PROCESSING`].
fn processing_ref(kind: &str, vocab: usize, batch: usize) -> ProcessingRef {
    let rows: Vec<Processing> = (0..batch).map(|r| processing_kind(kind, vocab, r)).collect();
    for (r, p) in rows.iter().enumerate() {
        p.check(r, vocab).expect("valid processing");
    }
    let sparse: Vec<_> = rows.iter().map(Processing::sparse_entries).collect();
    ProcessingRef::summarize(&rows, &sparse, vocab, PROCESSING)
}

/// The launches of each case, as text: a `## name` line, then one line per driver call or
/// reduction.
fn record_all() -> String {
    let mut text = String::new();
    let mut case = |name: String, body: &dyn Fn() -> crate::Result<Vec<String>>| {
        trace::start();
        let result = body();
        let mut events = trace::take();
        if let Ok(extra) = result.as_ref() {
            events.extend(extra.iter().cloned());
        }
        text += &format!("## {name}\n");
        if let Err(e) = result {
            text += &format!("error {e}\n");
        }
        for event in events {
            text += &event;
            text.push('\n');
        }
    };
    let workspace = |bytes: usize| DeviceWorkspace { address: WORKSPACE, bytes };
    let stream = std::ptr::null_mut();
    for module in Module::ALL {
        let sampler = StreamSampler::recording(module);
        let kernels = sampler.kernels();
        let m = module.name();
        // Plain sampling in every family and in passes.
        let mut plain = vec![
            (Shape { dtype: DType::BF16, vocab: 151_936, dim: 4096, batch: 1, draws: Draws::first(1) }, Variant::Auto),
            (Shape { dtype: DType::BF16, vocab: 151_936, dim: 4096, batch: 37, draws: Draws::first(1) }, Variant::Auto),
            (
                Shape { dtype: DType::BF16, vocab: 151_936, dim: 4096, batch: 200, draws: Draws::first(1) },
                Variant::Auto,
            ),
            (Shape { dtype: DType::F32, vocab: 5003, dim: 199, batch: 9, draws: Draws::first(2) }, Variant::Auto),
            (
                Shape { dtype: DType::BF16, vocab: 151_936, dim: 64, batch: 64, draws: Draws::first(4096) },
                Variant::Auto,
            ),
        ];
        let small = Shape { dtype: DType::BF16, vocab: 5003, dim: 200, batch: 37, draws: Draws { first: 5, count: 3 } };
        let mut variants = vec![Variant::Auto, Variant::Mma { columns: 8 }, Variant::Simt];
        if module == Module::Hopper {
            variants.extend([
                Variant::Tma { rows: 64, columns: 8 },
                Variant::Tma { rows: 128, columns: 128 },
                Variant::TmaHandoff { columns: 64 },
            ]);
        }
        plain.extend(variants.iter().map(|&v| (small, v)));
        for (shape, variant) in plain {
            case(format!("{m} plain {shape:?} {variant:?}"), &|| {
                let plan = Plan::new(kernels, &shape.request(None, None), &target(false, false, false), variant)?;
                // SAFETY: recorded, not launched.
                unsafe { sampler.enqueue(stream, &plan, workspace(plan.workspace_bytes()), 0)? };
                Ok(vec![format!("workspace {}", plan.workspace_bytes())])
            });
            case(format!("{m} plain stored maps {shape:?} {variant:?}"), &|| {
                let plan = Plan::new(kernels, &shape.request(None, None), &target(false, false, false), variant)?;
                let plan = plan.with_stored_maps();
                // SAFETY: recorded, not launched.
                unsafe { sampler.enqueue(stream, &plan, workspace(plan.workspace_bytes()), 0)? };
                Ok(Vec::new())
            });
        }
        // A plain shard's winners (its part placed first among the parts).
        let shard_shape = Shape { dtype: DType::BF16, vocab: 3001, dim: 200, batch: 9, draws: Draws::first(3) };
        let tokens = VocabShard { offset: 2004, vocab: 5005 };
        let shard = Shard { tokens, index: 0, count: 2 };
        case(format!("{m} plain shard {shard_shape:?} {shard:?}"), &|| {
            let processing = ProcessingRef::plain(shard_shape.batch, tokens.vocab);
            let request = shard_shape.request(Some(processing), Some(shard));
            let plan = Plan::new(kernels, &request, &target(false, false, true), Variant::Auto)?;
            // SAFETY: recorded, not launched.
            unsafe { sampler.enqueue(stream, &plan, workspace(plan.workspace_bytes()), 0)? };
            Ok(Vec::new())
        });
        case(format!("{m} advance steps"), &|| {
            // SAFETY: recorded, not launched.
            unsafe { sampler.advance_steps(stream, ROWS, 37, 3)? };
            Ok(Vec::new())
        });
        case(format!("{m} fill"), &|| {
            // SAFETY: recorded, not launched.
            unsafe { sampler.fill_uniform(stream, LM_HEAD, 1000, DType::BF16, 7, 0.5)? };
            Ok(Vec::new())
        });
        // Processed sampling of every kind into tokens, with and without log-probabilities.
        let shapes = [
            Shape { dtype: DType::BF16, vocab: 5003, dim: 200, batch: 9, draws: Draws { first: 2, count: 3 } },
            Shape { dtype: DType::BF16, vocab: 151_936, dim: 4096, batch: 64, draws: Draws::first(1) },
            Shape { dtype: DType::F32, vocab: 5003, dim: 199, batch: 9, draws: Draws::first(2) },
            // Few enough rows for the dispatcher's tile to chain min-p.
            Shape { dtype: DType::BF16, vocab: 5003, dim: 200, batch: 5, draws: Draws { first: 2, count: 3 } },
        ];
        for shape in shapes {
            for kind in ["plain", "per-entry", "truncating", "listed", "chained", "top", "mixed"] {
                for logprobs in [false, true] {
                    let processing = processing_ref(kind, shape.vocab, shape.batch);
                    let top = processing.selections & Selection::TopRaw.bit() != 0;
                    if top && !logprobs {
                        continue;
                    }
                    case(format!("{m} processed {kind} logprobs={logprobs} {shape:?}"), &|| {
                        let request = shape.request(Some(processing), None);
                        let plan = Plan::new(kernels, &request, &target(logprobs, top, false), Variant::Auto)?;
                        let bytes = plan.workspace_bytes();
                        // SAFETY: recorded, not launched.
                        unsafe { sampler.enqueue(stream, &plan, workspace(bytes), 0)? };
                        Ok(vec![format!("workspace {bytes}")])
                    });
                }
            }
        }
        // Stage 1 of a shard, alone (per-entry steps, top entries) and with an exchange
        // (truncations), segment by segment, then (not recorded here) the gather and merge.
        for (kind, exchange) in
            [("plain", 0), ("per-entry", 0), ("top", 0), ("truncating", EXCHANGE), ("mixed", EXCHANGE)]
        {
            for logprobs in [false, true] {
                let processing = processing_ref(kind, 5005, shard_shape.batch);
                let top = processing.selections & Selection::TopRaw.bit() != 0;
                if top && !logprobs {
                    continue;
                }
                case(format!("{m} shard {kind} logprobs={logprobs} exchange={exchange:#x}"), &|| {
                    let request = shard_shape.request(Some(processing), Some(shard));
                    let plan = Plan::new(kernels, &request, &target(logprobs, top, true), Variant::Auto)?;
                    let plan = plan.share_exchange(EXCHANGE);
                    let (bytes, stages) = (plan.workspace_bytes(), plan.path.segments());
                    trace::record(|| format!("workspace {bytes} segments {stages}"));
                    for segment in 0..stages {
                        // SAFETY: recorded, not launched.
                        let ended = unsafe { sampler.enqueue(stream, &plan, workspace(bytes), segment)? };
                        let reduction = ended.filter(|x| !matches!(x, Exchange::AllGather { .. }));
                        trace::record(|| format!("reduction {reduction:?}"));
                    }
                    Ok(Vec::new())
                });
            }
        }
        // The shard merge: a sharded call's last segment.
        for (kind, logprobs) in [("plain", false), ("plain", true), ("mixed", true)] {
            let processing = processing_ref(kind, 5005, 9);
            let top = processing.selections & Selection::TopRaw.bit() != 0;
            case(format!("{m} merge {kind} logprobs={logprobs}"), &|| {
                let request = shard_shape.request(Some(processing), Some(Shard { tokens, index: 0, count: 3 }));
                let plan = Plan::new(kernels, &request, &target(logprobs, top, true), Variant::Auto)?;
                // SAFETY: recorded, not launched.
                unsafe { sampler.enqueue(stream, &plan, workspace(plan.workspace_bytes()), plan.segments() - 1)? };
                Ok(Vec::new())
            });
        }
        // What only the sharded plan does: the exchange at the workspace's start, cleared in
        // segment 0, every exchange a segment ends with (the gather too), then the merge.
        for kind in ["per-entry", "mixed"] {
            let processing = processing_ref(kind, 5005, shard_shape.batch);
            let request = shard_shape.request(Some(processing), Some(Shard { tokens, index: 1, count: 2 }));
            case(format!("{m} sharded call {kind} shard 1 of 2"), &|| {
                let plan = Plan::new(kernels, &request, &target(true, true, true), Variant::Auto)?;
                let bytes = plan.workspace_bytes();
                trace::record(|| format!("workspace {bytes} segments {}", plan.segments()));
                for segment in 0..plan.segments() {
                    // SAFETY: recorded, not launched.
                    let ended = unsafe { sampler.enqueue(stream, &plan, workspace(bytes), segment)? };
                    trace::record(|| format!("exchange {ended:?}"));
                }
                Ok(Vec::new())
            });
        }
        // Verification: the verdicts after the tokens, unsharded (plain and truncating rows) and
        // after a sharded call's merge; one draw per position only.
        let positions = Shape { dtype: DType::BF16, vocab: 5003, dim: 200, batch: 9, draws: Draws::first(1) };
        for kind in ["plain", "truncating"] {
            let processing = processing_ref(kind, positions.vocab, positions.batch);
            case(format!("{m} verification {kind}"), &|| {
                let (request, target) =
                    verifying(positions.request(Some(processing), None), target(false, false, false), 3);
                let plan = Plan::new(kernels, &request, &target, Variant::Auto)?;
                // SAFETY: recorded, not launched.
                unsafe { sampler.enqueue(stream, &plan, workspace(plan.workspace_bytes()), 0)? };
                Ok(Vec::new())
            });
        }
        case(format!("{m} verification sharded call shard 1 of 2"), &|| {
            let processing = processing_ref("mixed", 5005, positions.batch);
            let shard = Shard { tokens, index: 1, count: 2 };
            let request = Shape { vocab: 3001, ..positions }.request(Some(processing), Some(shard));
            let (request, target) = verifying(request, target(true, true, true), 3);
            let plan = Plan::new(kernels, &request, &target, Variant::Auto)?;
            for segment in 0..plan.segments() {
                // SAFETY: recorded, not launched.
                let ended = unsafe { sampler.enqueue(stream, &plan, workspace(plan.workspace_bytes()), segment)? };
                trace::record(|| format!("exchange {ended:?}"));
            }
            Ok(Vec::new())
        });
        case(format!("{m} verification of two draws"), &|| {
            let shape = Shape { draws: Draws::first(2), ..positions };
            let (request, target) = verifying(shape.request(None, None), target(false, false, false), 3);
            Plan::new(kernels, &request, &target, Variant::Auto).map(|_| Vec::new())
        });
        case(format!("{m} verification without verdicts"), &|| {
            let (request, _) = verifying(positions.request(None, None), target(false, false, false), 3);
            Plan::new(kernels, &request, &target(false, false, false), Variant::Auto).map(|_| Vec::new())
        });
        case(format!("{m} verdicts without a verification"), &|| {
            let (_, target) = verifying(positions.request(None, None), target(false, false, false), 3);
            Plan::new(kernels, &positions.request(None, None), &target, Variant::Auto).map(|_| Vec::new())
        });
        // Matrices with resident tensor maps (the owned sampler's buffers): no map is written.
        if module == Module::Hopper {
            for (batch, kind) in [(1usize, "plain"), (100, "per-entry"), (9, "truncating")] {
                let shape = Shape { dtype: DType::BF16, vocab: 5003, dim: 200, batch, draws: Draws::first(2) };
                let processing = processing_ref(kind, shape.vocab, batch);
                case(format!("{m} resident maps B = {batch} {kind}"), &|| {
                    let mut request = shape.request(Some(processing), None);
                    request.lm_head.maps = Some(ResidentMaps::LmHead(DevicePtr::new(0xB0_0000_0000)));
                    request.hidden.maps = Some(ResidentMaps::Hidden(DevicePtr::new(0xC0_0000_0000)));
                    let plan = Plan::new(kernels, &request, &target(false, false, false), Variant::Auto)?;
                    // SAFETY: recorded, not launched.
                    unsafe { sampler.enqueue(stream, &plan, workspace(plan.workspace_bytes()), 0)? };
                    Ok(Vec::new())
                });
            }
        }
    }
    text
}

/// Every case's launches equal the recorded ones.
#[test]
fn launches_are_the_recorded_ones() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/launches.txt");
    let got = record_all();
    if std::env::var_os("FLASHSAMPLE_BLESS").is_some() {
        std::fs::write(path, &got).unwrap();
        return;
    }
    let want = std::fs::read_to_string(path).expect("host/launches.txt (FLASHSAMPLE_BLESS=1 writes it)");
    let split = |text: &str| -> Vec<(String, String)> {
        text.split("## ")
            .filter(|c| !c.is_empty())
            .map(|c| {
                let (name, body) = c.split_once('\n').unwrap_or((c, ""));
                (name.to_string(), body.to_string())
            })
            .collect()
    };
    let (got, want) = (split(&got), split(&want));
    assert_eq!(got.len(), want.len(), "number of cases");
    let mut differ = Vec::new();
    for ((got_name, got_body), (want_name, want_body)) in got.iter().zip(&want) {
        if got_name != want_name || got_body != want_body {
            differ.push(format!("{got_name} (recorded as {want_name}):\n--- got\n{got_body}--- want\n{want_body}"));
        }
    }
    assert!(differ.is_empty(), "{} of {} cases differ:\n{}", differ.len(), got.len(), differ.join("\n"));
}
