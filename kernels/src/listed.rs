//! The listed sampler and its fallback: a row's min-p, top-k and top-p decided from a set of
//! its entries (`flashsample_core::truncation`), its draws raced among the entries they keep.
//! One block per row, over one of two sources of entries ([`Entries`]):
//! - the row's tile lists (`sample_listed`): each thread owns tiles `thread + LISTED_THREADS·i`
//!   and copies their lists once from L2 into shared memory (up to `LISTED_CACHED_TILES`),
//!   where each step reads them (a thread reads only its own, so the copy needs no barrier);
//! - the row's whole row of logits (`sample_unsettled`, the fallback for rows whose lists do
//!   not settle), each thread its quads, with the tiles' per-entry processing applied again.
//!
//! The steps:
//! 1. the row's largest logit and whether an entry is non-finite;
//! 2. top-k's k-th largest order key among the entries min-p keeps, by a radix selection of
//!    8-bit digits (a shared histogram per digit);
//! 3. from lists, whether every tile settles: its entry after the floor fails the cuts of
//!    min-p and top-k;
//! 4. with top-p, the total of top-p's integer units over the entries min-p and top-k keep,
//!    the largest order key whose entries and the ones above it reach the target (a radix
//!    selection weighted by units), then among that key's entries the lowest indices that
//!    reach it (a radix selection of indices): the cut;
//! 5. per draw, the best candidate among the kept entries, scored by `block_candidate`.
//!
//! What the steps find is what `flashsample_core::truncation::select` finds from the same
//! entries (the CPU's definition): the same min-p cut, the k-th value with its ties, the
//! shortest prefix reaching top-p's target.

use core::sync::atomic::{AtomicU32, Ordering};

use flashsample_core::abi::{
    DevicePtr, LISTED_CACHED_TILES, LISTED_DIGIT_BUCKETS, LISTED_SHARED_BYTES, LISTED_THREADS, RowProcessing,
    SampleListedArgs, candidate_pair,
};
use flashsample_core::candidate::maximum;
use flashsample_core::process::{
    KeepRule, coarse_scale, key_logit, min_p_threshold, order_key, top_p_target, top_p_units_of,
};
use flashsample_core::truncation::TileTop;
use flashsample_core::{Candidate, RowParams, block_candidate};

use crate::arch;
use crate::process::{add_to_halves, fused_quad, halves_weight};
use crate::sample::merge_over_lanes;

const WARPS: usize = (LISTED_THREADS / 32) as usize;
const DIGIT_BUCKETS: usize = LISTED_DIGIT_BUCKETS as usize;

/// The listed sampler's shared memory (`LISTED_SHARED_BYTES`).
#[repr(C)]
pub struct ListedShared {
    /// The row's first `LISTED_CACHED_TILES` lists, each in its owner thread's slots.
    cached: [TileTop; LISTED_CACHED_TILES as usize],
    /// A digit's histogram of weights (a weighted selection's), kept as the low and then the
    /// high 32-bit halves of its buckets' weights.
    masses: [u64; DIGIT_BUCKETS],
    /// A digit's histogram of counts (a counting selection's: 32-bit shared atomics, which
    /// the hardware adds natively, where many entries share a bucket).
    counts: [u32; DIGIT_BUCKETS],
    warp_u64: [u64; WARPS],
    /// A selection's decisions: the weight still to reach, the weight above the prefix.
    wide: [u64; 2],
    warp_u32: [u32; WARPS],
    /// A selection's decisions: the digits' prefix, whether the target is reached.
    words: [u32; 4],
    warp_best: [Candidate; WARPS],
}

const _: () = assert!(core::mem::size_of::<ListedShared>() == LISTED_SHARED_BYTES as usize);
// Each thread clears one bucket of a digit's histogram.
const _: () = assert!(DIGIT_BUCKETS == LISTED_THREADS as usize);

/// A row's entries as the steps read them, each thread its share.
trait Entries {
    /// The largest of this thread's entries: NaN where one is NaN or +∞, −∞ for none.
    ///
    /// # Safety
    /// The source's buffers hold the row.
    unsafe fn thread_max(&self, thread: u32) -> f32;

    /// Calls `f(logit, index)` for this thread's finite entries.
    ///
    /// # Safety
    /// As [`Entries::thread_max`].
    unsafe fn for_each(&self, thread: u32, f: impl FnMut(f32, u32));

    /// Whether no entry left out of this thread's share can be kept by `bound` (a whole row
    /// leaves none out).
    ///
    /// # Safety
    /// As [`Entries::thread_max`].
    unsafe fn settles(&self, thread: u32, bound: &KeepRule) -> bool;

    /// This thread's best candidate of draw `draw` among its entries `rule` keeps.
    ///
    /// # Safety
    /// As [`Entries::thread_max`].
    unsafe fn race(&self, thread: u32, row: &RowParams, draw: u32, rule: &KeepRule) -> Candidate;
}

/// One row's view of its lists: `[tiles]` [`TileTop`]s in L2, the first
/// `LISTED_CACHED_TILES` of them also in shared memory once [`RowLists::cache`] ran.
struct RowLists {
    tops: *const TileTop,
    cached: *mut TileTop,
    tiles: u32,
}

impl RowLists {
    /// Copies this thread's tiles among the first `LISTED_CACHED_TILES` into shared memory.
    ///
    /// # Safety
    /// The lists are readable; no other thread uses this thread's slots of `cached`.
    #[inline(always)]
    unsafe fn cache(&self, thread: u32) {
        let mut tile = thread;
        while tile < self.tiles.min(LISTED_CACHED_TILES) {
            // SAFETY: `tile < tiles` and `tile < LISTED_CACHED_TILES`: one of the row's lists and
            // one of this thread's slots.
            unsafe { *self.cached.add(tile as usize) = *self.tops.add(tile as usize) };
            tile += LISTED_THREADS;
        }
    }

    /// Tile `tile`'s list, in shared memory when cached (a reference, not a copy: a copy's
    /// arrays, indexed at run time by `TileTop::settles`, went to local memory).
    ///
    /// # Safety
    /// `tile < self.tiles`, one of this thread's tiles (`tile % LISTED_THREADS == thread`),
    /// after [`RowLists::cache`].
    #[inline(always)]
    unsafe fn top(&self, tile: u32) -> &TileTop {
        let from = if tile < LISTED_CACHED_TILES { self.cached as *const TileTop } else { self.tops };
        // SAFETY: per this function's contract.
        unsafe { &*from.add(tile as usize) }
    }

    /// Calls `f(top)` for each of this thread's tiles.
    ///
    /// # Safety
    /// As [`RowLists::top`], for this thread's tiles.
    #[inline(always)]
    unsafe fn for_each_tile(&self, thread: u32, mut f: impl FnMut(&TileTop)) {
        let mut tile = thread;
        while tile < self.tiles {
            // SAFETY: `tile < tiles`, one of this thread's.
            f(unsafe { self.top(tile) });
            tile += LISTED_THREADS;
        }
    }
}

impl Entries for RowLists {
    #[inline(always)]
    unsafe fn thread_max(&self, thread: u32) -> f32 {
        let mut max = f32::NEG_INFINITY;
        // SAFETY: this thread's tiles (the trait's contract, after `cache`).
        unsafe { self.for_each_tile(thread, |top| max = maximum(max, top.logits[0])) };
        max
    }

    #[inline(always)]
    unsafe fn for_each(&self, thread: u32, mut f: impl FnMut(f32, u32)) {
        // SAFETY: this thread's tiles.
        unsafe {
            self.for_each_tile(thread, |top| {
                for (&logit, &index) in top.logits.iter().zip(&top.indices) {
                    if logit > f32::NEG_INFINITY && logit < f32::INFINITY {
                        f(logit, index);
                    }
                }
            })
        }
    }

    #[inline(always)]
    unsafe fn settles(&self, thread: u32, bound: &KeepRule) -> bool {
        let mut settles = true;
        // SAFETY: this thread's tiles.
        unsafe { self.for_each_tile(thread, |top| settles &= top.settles(bound)) };
        settles
    }

    #[inline(always)]
    unsafe fn race(&self, thread: u32, row: &RowParams, draw: u32, rule: &KeepRule) -> Candidate {
        let mut best = Candidate::NONE;
        // SAFETY: this thread's tiles.
        unsafe {
            self.for_each(thread, |logit, index| {
                if rule.keeps(logit, index) {
                    // Selects, not an indexed store, keep the quad in registers.
                    let quad: [f32; 4] =
                        core::array::from_fn(|r| if r as u32 == index % 4 { logit } else { f32::NEG_INFINITY });
                    best = best.merge(block_candidate(row, draw, index / 4, quad, 4));
                }
            })
        };
        best
    }
}

/// One row's whole row of raw logits, with the per-entry processing the tiles applied.
struct RowLogits {
    /// The row's `vocab` logits, 16-byte aligned.
    logits: DevicePtr<f32>,
    /// The rows' per-entry processing, or null.
    processing: DevicePtr<RowProcessing>,
    b: u32,
    vocab: u32,
}

impl RowLogits {
    /// Calls `f(index0, quad, valid)` for this thread's quads of processed logits: quad `q`
    /// holds entries `4q ..`, of which the first `valid` lie in the vocabulary.
    ///
    /// # Safety
    /// The logits hold the row's `vocab` entries (in whole quads), the processing (if set)
    /// row `b`'s block.
    #[inline(always)]
    unsafe fn for_each_quad(&self, thread: u32, mut f: impl FnMut(u32, [f32; 4], u32)) {
        let mut q = thread;
        while q < self.vocab.div_ceil(4) {
            let index0 = 4 * q;
            // SAFETY: `index0 < vocab`: a quad of the row, 16-byte aligned (this function's
            // contract).
            let raw = unsafe { arch::load_global_nc_v4(self.logits.add(index0 as u64).address()) }.map(f32::from_bits);
            let quad = if self.processing.address() != 0 {
                // SAFETY: the processing holds row `b`'s block (this function's contract).
                unsafe { fused_quad(self.processing, self.b, index0, self.vocab, raw) }
            } else {
                raw
            };
            f(index0, quad, (self.vocab - index0).min(4));
            q += LISTED_THREADS;
        }
    }
}

impl Entries for RowLogits {
    #[inline(always)]
    unsafe fn thread_max(&self, thread: u32) -> f32 {
        let mut max = f32::NEG_INFINITY;
        // SAFETY: the row (the trait's contract).
        unsafe {
            self.for_each_quad(thread, |_, quad, valid| {
                for (r, &logit) in quad.iter().enumerate() {
                    if (r as u32) < valid {
                        // +∞ makes the row non-finite, as NaN does.
                        max = maximum(max, if logit == f32::INFINITY { f32::NAN } else { logit });
                    }
                }
            })
        };
        max
    }

    #[inline(always)]
    unsafe fn for_each(&self, thread: u32, mut f: impl FnMut(f32, u32)) {
        // SAFETY: the row.
        unsafe {
            self.for_each_quad(thread, |index0, quad, valid| {
                for (r, &logit) in quad.iter().enumerate() {
                    if (r as u32) < valid && logit > f32::NEG_INFINITY && logit < f32::INFINITY {
                        f(logit, index0 + r as u32);
                    }
                }
            })
        }
    }

    #[inline(always)]
    unsafe fn settles(&self, _: u32, _: &KeepRule) -> bool {
        true
    }

    #[inline(always)]
    unsafe fn race(&self, thread: u32, row: &RowParams, draw: u32, rule: &KeepRule) -> Candidate {
        let mut best = Candidate::NONE;
        // SAFETY: the row.
        unsafe {
            self.for_each_quad(thread, |index0, quad, valid| {
                let kept: [f32; 4] = core::array::from_fn(|r| {
                    if rule.keeps(quad[r], index0 + r as u32) { quad[r] } else { f32::NEG_INFINITY }
                });
                best = best.merge(block_candidate(row, draw, index0 / 4, kept, valid));
            })
        };
        best
    }
}

/// The block's reductions through `shared`'s per-warp slots. Each call is made by every
/// thread of the block together, and returns the result to all of them.
struct Block {
    shared: *mut ListedShared,
    thread: u32,
}

impl Block {
    fn lane(&self) -> u32 {
        self.thread % 32
    }

    fn warp(&self) -> usize {
        (self.thread / 32) as usize
    }

    /// Combines one `u32` per thread with `combine` (associative, commutative) over the lanes by
    /// shuffles and over the warps through `slot(shared)`.
    ///
    /// # Safety
    /// Every thread of the block calls it together.
    #[inline(always)]
    unsafe fn reduce_u32(&self, mut value: u32, combine: impl Fn(u32, u32) -> u32) -> u32 {
        let mut mask = 1;
        while mask < 32 {
            // SAFETY: all 32 lanes are here together (this function's contract).
            value = combine(value, unsafe { arch::shuffle_xor(value, mask) });
            mask <<= 1;
        }
        // SAFETY: `warp < WARPS`: this warp's slot, read by all after the barrier.
        unsafe {
            if self.lane() == 0 {
                (*self.shared).warp_u32[self.warp()] = value;
            }
            arch::sync_threads();
            let mut all = (*self.shared).warp_u32[0];
            for w in 1..WARPS {
                all = combine(all, (*self.shared).warp_u32[w]);
            }
            arch::sync_threads();
            all
        }
    }

    /// The block's maximum of one logit per thread (NaN if any is NaN).
    ///
    /// # Safety
    /// Every thread of the block calls it together.
    #[inline(always)]
    unsafe fn max(&self, value: f32) -> f32 {
        // SAFETY: per this function's contract.
        f32::from_bits(unsafe {
            self.reduce_u32(value.to_bits(), |a, b| maximum(f32::from_bits(a), f32::from_bits(b)).to_bits())
        })
    }

    /// Whether any thread's `value` is true.
    ///
    /// # Safety
    /// Every thread of the block calls it together.
    #[inline(always)]
    unsafe fn any(&self, value: bool) -> bool {
        // SAFETY: per this function's contract.
        unsafe { self.reduce_u32(value as u32, |a, b| a | b) != 0 }
    }

    /// The block's sum of one `u64` per thread.
    ///
    /// # Safety
    /// Every thread of the block calls it together.
    #[inline(always)]
    unsafe fn sum(&self, value: u64) -> u64 {
        // SAFETY: all 32 lanes are here together (this function's contract).
        let (_, warp_total) = unsafe { warp_prefix(value, self.lane()) };
        // SAFETY: `warp < WARPS`: this warp's slot, read by all after the barrier.
        unsafe {
            if self.lane() == 0 {
                (*self.shared).warp_u64[self.warp()] = warp_total;
            }
            arch::sync_threads();
            let mut all = 0;
            for w in 0..WARPS {
                all += (*self.shared).warp_u64[w];
            }
            arch::sync_threads();
            all
        }
    }

    /// The block's best candidate by [`Candidate::merge`]; meaningful in thread 0.
    ///
    /// # Safety
    /// Every thread of the block calls it together.
    #[inline(always)]
    unsafe fn best(&self, candidate: Candidate) -> Candidate {
        // SAFETY: all 32 lanes of every warp are here together (this function's contract).
        let best = unsafe { merge_over_lanes(candidate, 1, 16) };
        // SAFETY: `warp < WARPS`: this warp's slot, read by thread 0 after the barrier.
        unsafe {
            if self.lane() == 0 {
                (*self.shared).warp_best[self.warp()] = best;
            }
            arch::sync_threads();
            let mut all = Candidate::NONE;
            if self.thread == 0 {
                for w in 0..WARPS {
                    all = all.merge((*self.shared).warp_best[w]);
                }
            }
            arch::sync_threads();
            all
        }
    }
}

/// The sum of `value` over the lanes below this one and over the whole warp, by a butterfly
/// over lane masks 1 to 16 (shuffles only).
///
/// # Safety
/// All 32 lanes call it together.
#[inline(always)]
unsafe fn warp_prefix(value: u64, lane: u32) -> (u64, u64) {
    let (mut before, mut total) = (0u64, value);
    let mut mask = 1;
    while mask < 32 {
        // SAFETY: all 32 lanes are here together (this function's contract).
        let other = unsafe { arch::shuffle_xor_u64(total, mask) };
        if lane & mask != 0 {
            before += other;
        }
        total += other;
        mask <<= 1;
    }
    (before, total)
}

/// A radix selection's answer: the key, and the weight of the selected entries whose key is
/// larger.
#[derive(Clone, Copy)]
struct Selected {
    key: u32,
    above: u64,
}

/// Among the entries `key_of` gives a key (and a weight), the largest key `K` whose entries
/// and the larger keys' together weigh at least `target`, by four 8-bit digits from the top;
/// `None` when all of them weigh less. `WEIGHTED = false` counts each entry once (its weight
/// is ignored): the `target`-th largest key.
///
/// # Safety
/// Every thread of the block calls it together; `target ≥ 1`, and below 2³² unless
/// `WEIGHTED`.
#[inline(always)]
unsafe fn radix_select<const WEIGHTED: bool, E: Entries>(
    entries: &E,
    block: &Block,
    key_of: impl Fn(f32, u32) -> Option<(u32, u64)>,
    target: u64,
) -> Option<Selected> {
    let shared = block.shared;
    let thread = block.thread;
    let (mut prefix, mut remaining, mut above) = (0u32, target, 0u64);
    let mut digit = 0;
    while digit < 4 {
        let shift = 24 - 8 * digit;
        // SAFETY: every thread of the block is here (this function's contract); the histogram
        // is cleared by its own thread, then added to atomically, then read by warp 0.
        unsafe {
            if WEIGHTED {
                (*shared).masses[thread as usize] = 0;
            } else {
                (*shared).counts[thread as usize] = 0;
            }
            arch::sync_threads();
            // The masses as the low and then the high 32-bit halves of the buckets' weights
            // (`add_to_halves`): shared memory adds 32-bit words natively, 64-bit ones only by
            // a compare-and-swap loop.
            let low = &raw mut (*shared).masses as *mut u32;
            let high = low.add(DIGIT_BUCKETS);
            let counts = &raw mut (*shared).counts as *mut u32;
            entries.for_each(thread, |logit, index| {
                if let Some((key, weight)) = key_of(logit, index) {
                    // The digits above this one must equal the prefix found so far.
                    let higher = if digit == 0 { 0 } else { (key ^ prefix) >> (shift + 8) };
                    let bucket = ((key >> shift) & 0xff) as usize;
                    if higher == 0 && WEIGHTED && weight > 0 {
                        add_to_halves(low, high, bucket, weight);
                    } else if higher == 0 && !WEIGHTED {
                        AtomicU32::from_ptr(counts.add(bucket)).fetch_add(1, Ordering::Relaxed);
                    }
                }
            });
            arch::sync_threads();
            let bucket_weight = |bucket: usize| match WEIGHTED {
                true => halves_weight(low, high, bucket),
                false => *counts.add(bucket) as u64,
            };
            // Warp 0 decides: lane `l` holds buckets `255 − 8l` down to `248 − 8l`, and the
            // lane whose run of weights (from the top) reaches the remaining target walks its
            // own.
            if thread < 32 {
                let top = DIGIT_BUCKETS - 1 - 8 * thread as usize;
                let mut run = 0u64;
                for i in 0..8 {
                    run += bucket_weight(top - i);
                }
                let (lanes_above, total) = warp_prefix(run, thread);
                if thread == 0 {
                    (*shared).words[1] = (total >= remaining) as u32;
                }
                if lanes_above < remaining && lanes_above + run >= remaining {
                    let mut heavier = lanes_above;
                    for i in 0..8 {
                        let weight = bucket_weight(top - i);
                        if heavier + weight >= remaining {
                            (*shared).words[0] = prefix | ((top - i) as u32) << shift;
                            (*shared).wide[0] = remaining - heavier;
                            (*shared).wide[1] = above + heavier;
                            break;
                        }
                        heavier += weight;
                    }
                }
            }
            arch::sync_threads();
            let found = (*shared).words[1];
            (prefix, remaining, above) = ((*shared).words[0], (*shared).wide[0], (*shared).wide[1]);
            arch::sync_threads();
            if found == 0 {
                return None;
            }
        }
        digit += 1;
    }
    Some(Selected { key: prefix, above })
}

/// top-p's cut among the entries `bound` keeps: the last entry of the shortest prefix in the
/// truncations' order whose units reach [`top_p_target`] of their total.
///
/// # Safety
/// Every thread of the block calls it together; `bound` keeps an entry.
#[inline(always)]
unsafe fn top_p_cut<E: Entries>(
    entries: &E,
    block: &Block,
    bound: &KeepRule,
    max: f32,
    temperature: f32,
    top_p: f32,
) -> (f32, u32) {
    let scale = coarse_scale(temperature);
    let units = |logit: f32| top_p_units_of(logit, max, scale);
    let mut sum = 0u64;
    // SAFETY: the row (this function's contract).
    unsafe {
        entries.for_each(block.thread, |logit, index| {
            if bound.keeps(logit, index) {
                sum += units(logit);
            }
        })
    };
    // SAFETY: every thread of the block is here.
    let total = unsafe { block.sum(sum) };
    let target = top_p_target(total, top_p);
    let by_mass = |logit: f32, index: u32| bound.keeps(logit, index).then(|| (order_key(logit), units(logit)));
    // The kept entries' units total at least the target (`target ≤ total`; the largest entry
    // has units > 0).
    // SAFETY: every thread of the block is here; `target ≥ 1`.
    let Some(value) = (unsafe { radix_select::<true, _>(entries, block, by_mass, target) }) else {
        return (max, u32::MAX);
    };
    let logit = key_logit(value.key);
    // Entries of one logit have equal units (> 0: the prefix reaches the target within
    // them); the cut is the `n`-th of them by index.
    let n = (target - value.above).div_ceil(units(logit).max(1));
    let by_index = |l: f32, index: u32| (l == logit && bound.keeps(l, index)).then_some((!index, 1));
    // SAFETY: every thread of the block is here; `n ≥ 1`, and at least `n` entries hold the key.
    match unsafe { radix_select::<false, _>(entries, block, by_index, n) } {
        Some(index) => (logit, !index.key),
        None => (logit, u32::MAX),
    }
}

/// Row `b`'s rule from `entries`, or `None` when an entry left out may be kept (lists that
/// do not settle).
///
/// # Safety
/// Every thread of the block calls it together; `max` is the row's largest entry, finite.
#[inline(always)]
unsafe fn decide<E: Entries>(
    entries: &E,
    block: &Block,
    row: &RowParams,
    processing: &RowProcessing,
    max: f32,
) -> Option<KeepRule> {
    if row.greedy != 0 {
        // The row's first entry in the truncations' order is among the entries; a greedy row
        // takes it, and keeps every entry.
        return Some(KeepRule::ALL);
    }
    let min_cut = min_p_threshold(max, row.temperature, processing.min_p);
    let mut bound = KeepRule { min_cut, ..KeepRule::ALL };
    if processing.top_k > 0 {
        let by_count = |logit: f32, _| (logit >= min_cut).then(|| (order_key(logit), 1));
        // SAFETY: every thread of the block is here; `top_k ≥ 1`.
        if let Some(kth) = unsafe { radix_select::<false, _>(entries, block, by_count, processing.top_k as u64) } {
            bound.order_cut = (key_logit(kth.key), u32::MAX);
        }
    }
    // With top-p, the bound is the rule before it.
    // SAFETY: this thread's share; every thread of the block is here.
    if unsafe { block.any(!entries.settles(block.thread, &bound)) } {
        return None;
    }
    if processing.top_p >= 1.0 {
        return Some(bound);
    }
    // SAFETY: every thread of the block is here; `bound` keeps the largest entry.
    let order_cut = unsafe { top_p_cut(entries, block, &bound, max, row.temperature, processing.top_p) };
    Some(KeepRule { order_cut, ..bound })
}

/// Decides row `b` from `entries` and writes its draws' candidates; returns whether it settled
/// (an unsettled row's candidates are [`Candidate::NONE`]).
///
/// # Safety
/// Every thread of the block calls it together; `b < args.batch`; the source holds the row.
#[inline(always)]
unsafe fn sample_row<E: Entries>(args: &SampleListedArgs, block: &Block, entries: &E, b: u32) -> bool {
    let thread = block.thread;
    // SAFETY: `b < batch`: a row of the row parameters and the processing.
    let (row, processing) =
        unsafe { (*args.row_params.as_ptr().add(b as usize), *args.processing.as_ptr().add(b as usize)) };
    // SAFETY: the row; every thread of the block is here.
    let max = unsafe { block.max(entries.thread_max(thread)) };
    let non_finite = max.is_nan();
    // Non-finite (every draw NON_FINITE) or nothing to draw (every draw NONE): the race below
    // finds that from the entries, as the materialised path does from the row.
    let rule = if non_finite || max == f32::NEG_INFINITY {
        Some(KeepRule::ALL)
    } else {
        // SAFETY: every thread of the block is here; `max` finite.
        unsafe { decide(entries, block, &row, &processing, max) }
    };
    for j in 0..args.samples {
        let mut best = Candidate::NONE;
        if let (Some(rule), false) = (rule, non_finite) {
            // SAFETY: the row.
            best = unsafe { entries.race(thread, &row, args.draw_offset + j, &rule) };
        }
        // SAFETY: every thread of the block is here (uniform loops).
        let best = unsafe { block.best(best) };
        if thread == 0 {
            let winner = match (non_finite, rule) {
                (true, _) => Candidate::NON_FINITE,
                (false, Some(_)) => best,
                (false, None) => Candidate::NONE,
            };
            // SAFETY: `b < batch`, `j < samples`: inside the `[batch · samples]` candidates.
            unsafe { *args.candidates.as_mut_ptr().add(candidate_pair(b, args.samples, j) as usize) = winner };
        }
    }
    rule.is_some()
}

/// The listed sampler (see the module docs and `SampleListedArgs`): one block per row, in
/// grid-stride order.
///
/// # Safety
/// Launched with `LISTED_THREADS` threads and `LISTED_SHARED_BYTES` of shared memory at
/// `shared`; `args` describes valid buffers: every row's `tiles` lists written.
#[inline(always)]
pub unsafe fn sample_listed(args: &SampleListedArgs, shared: *mut ListedShared) {
    let thread = arch::thread_index();
    let block = Block { shared, thread };
    let mut b = arch::block_index();
    while b < args.batch {
        let lists = RowLists {
            tops: args.tile_tops.as_ptr().wrapping_add(b as usize * args.tiles as usize),
            // SAFETY: a field of the block's shared memory.
            cached: unsafe { &raw mut (*shared).cached as *mut TileTop },
            tiles: args.tiles,
        };
        // SAFETY: the lists are readable; each thread copies its own tiles.
        unsafe { lists.cache(thread) };
        // SAFETY: every thread of the block is here (the row loop is per block); `b < batch`.
        let settled = unsafe { sample_row(args, &block, &lists, b) };
        if thread == 0 {
            // SAFETY: `b < batch`.
            unsafe { flag_row(args, b, settled) };
        }
        b += arch::grid_size();
    }
}

/// Writes row `b`'s flag, and counts it when it did not settle.
///
/// # Safety
/// `b < args.batch`; one thread per row.
#[inline(always)]
unsafe fn flag_row(args: &SampleListedArgs, b: u32, settled: bool) {
    // SAFETY: `b < batch`: the row's flag; the count is only accessed atomically.
    unsafe {
        *args.row_unsettled.as_mut_ptr().add(b as usize) = !settled as u32;
        if !settled {
            AtomicU32::from_ptr(args.unsettled.as_mut_ptr()).fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// The chained sampler (see `SampleListedArgs`): one block per min-p row, in grid-stride
/// order. The row's largest logit is the largest of its tiles' first links (each tile's
/// largest entry, in every draw's chain), its cut min-p's from it, and each draw's winner the
/// best of its tiles' winners at that cut
/// ([`flashsample_core::chain::Chain::winner`]); a row where a tile cannot tell
/// is flagged for the fallback.
///
/// # Safety
/// Launched with `LISTED_THREADS` threads and `LISTED_SHARED_BYTES` of shared memory at
/// `shared`; `args` describes valid buffers: every row's `samples · tiles` chains written.
#[inline(always)]
pub unsafe fn sample_chained(args: &SampleListedArgs, shared: *mut ListedShared) {
    let thread = arch::thread_index();
    let block = Block { shared, thread };
    let (tiles, samples) = (args.tiles, args.samples);
    let mut b = arch::block_index();
    while b < args.batch {
        // SAFETY: `b < batch`: a row of the row parameters and the processing.
        let (row, processing) =
            unsafe { (*args.row_params.as_ptr().add(b as usize), *args.processing.as_ptr().add(b as usize)) };
        let chains = args.tile_chains.as_ptr().wrapping_add(candidate_pair(b, samples, 0) as usize * tiles as usize);
        let mut most = f32::NEG_INFINITY;
        let mut tile = thread;
        while tile < tiles {
            // SAFETY: `tile < tiles`: draw 0's chain of this tile.
            most = maximum(most, unsafe { (*chains.add(tile as usize)).links[0].logit });
            tile += LISTED_THREADS;
        }
        // SAFETY: every thread of the block is here (the row loop is per block).
        let max = unsafe { block.max(most) };
        let non_finite = max.is_nan();
        let cut = min_p_threshold(max, row.temperature, processing.min_p);
        let mut settled = true;
        for j in 0..samples {
            let mut best = Candidate::NONE;
            let mut tells = true;
            let mut tile = thread;
            while tile < tiles && !non_finite {
                // SAFETY: `j < samples`, `tile < tiles`: a chain of the row's.
                match unsafe { (*chains.add((j * tiles + tile) as usize)).winner(cut) } {
                    Some(winner) => best = best.merge(winner),
                    None => tells = false,
                }
                tile += LISTED_THREADS;
            }
            // SAFETY: every thread of the block is here (uniform loops).
            let (best, tells) = unsafe { (block.best(best), !block.any(!tells)) };
            settled &= tells;
            if thread == 0 {
                let winner = match (non_finite, tells) {
                    (true, _) => Candidate::NON_FINITE,
                    (false, true) => best,
                    (false, false) => Candidate::NONE,
                };
                // SAFETY: `b < batch`, `j < samples`: inside the `[batch · samples]` candidates.
                unsafe { *args.candidates.as_mut_ptr().add(candidate_pair(b, samples, j) as usize) = winner };
            }
        }
        if thread == 0 {
            // SAFETY: `b < batch`.
            unsafe { flag_row(args, b, settled) };
        }
        b += arch::grid_size();
    }
}

/// The listed path's fallback (see `SampleListedArgs`): the rows flagged unsettled, one block
/// per row, decided and raced from their whole rows of logits; nothing when no row is.
///
/// # Safety
/// As [`sample_listed`], after it and after the GEMM wrote `args.logits` where a row is
/// flagged.
#[inline(always)]
pub unsafe fn sample_unsettled(args: &SampleListedArgs, shared: *mut ListedShared) {
    // SAFETY: the count, written before (this function's contract).
    if unsafe { *args.unsettled.as_ptr() } == 0 {
        return;
    }
    let block = Block { shared, thread: arch::thread_index() };
    let mut b = arch::block_index();
    while b < args.batch {
        // SAFETY: `b < batch`: the row's flag.
        if unsafe { *args.row_unsettled.as_ptr().add(b as usize) } != 0 {
            let row = RowLogits {
                logits: args.logits.add(b as u64 * args.logits_stride as u64),
                processing: args.entry_processing,
                b,
                vocab: args.vocab,
            };
            // SAFETY: every thread of the block is here; `b < batch`; the GEMM wrote the row.
            unsafe { sample_row(args, &block, &row, b) };
        }
        b += arch::grid_size();
    }
}
