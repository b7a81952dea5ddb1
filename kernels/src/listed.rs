//! The listed sampler: a row's min-p, top-k and top-p decided from its tiles' lists
//! (`flashsample_core::truncation`), its draws raced among the entries they keep. One block
//! per row; each thread owns tiles `thread + LISTED_THREADS·i` and copies their lists once
//! from L2 into shared memory (up to `LISTED_CACHED_TILES`), where each step reads them (a
//! thread reads only its own, so the copy needs no barrier). Five steps over the union of the
//! row's lists (4 entries per tile):
//! 1. the row's largest logit and whether a list is non-finite;
//! 2. top-k's k-th largest order key among the entries min-p keeps, by a radix selection of
//!    8-bit digits (a shared histogram per digit);
//! 3. whether every tile settles: its entry after the floor fails the cuts of min-p and top-k;
//! 4. with top-p, the entries min-p and top-k keep, ranked in shared memory by a bitonic sort
//!    and summed in top-p's integer units; the prefix's last entry is the cut;
//! 5. per draw, the best candidate among the kept entries, scored by `block_candidate`.
//!
//! What the steps find is what `flashsample_core::truncation::select` finds from the same
//! entries (the CPU's definition): the same min-p cut, the k-th value with its ties, the
//! shortest prefix reaching top-p's target. A row that does not settle, or whose top-p would
//! rank more than `LISTED_RANK_CAP` entries, is left to the materialised path.

use core::sync::atomic::{AtomicU32, Ordering};

use flashsample_core::abi::{
    LISTED_CACHED_TILES, LISTED_RANK_CAP, LISTED_SHARED_BYTES, LISTED_THREADS, SampleListedArgs, candidate_pair,
};
use flashsample_core::candidate::maximum;
use flashsample_core::process::{KeepRule, key_logit, min_p_threshold, order_key, top_p_target, top_p_units};
use flashsample_core::truncation::TileTop;
use flashsample_core::{Candidate, block_candidate};

use crate::arch;
use crate::sample::merge_over_lanes;

const WARPS: usize = (LISTED_THREADS / 32) as usize;
const DIGIT_BUCKETS: usize = 256;

/// The listed sampler's shared memory (`LISTED_SHARED_BYTES`).
#[repr(C)]
pub struct ListedShared {
    /// The row's first `LISTED_CACHED_TILES` lists, each in its owner thread's slots.
    cached: [TileTop; LISTED_CACHED_TILES as usize],
    /// The entries top-p ranks: `order_key << 32 | !index`, sorted in decreasing order.
    ranked: [u64; LISTED_RANK_CAP as usize],
    /// A digit's histogram.
    histogram: [u32; DIGIT_BUCKETS],
    warp_u64: [u64; WARPS],
    warp_u32: [u32; WARPS],
    warp_best: [Candidate; WARPS],
    /// Decisions for the block: a digit's prefix and remaining rank, whether the k-th entry
    /// exists, the ranked count, top-p's last rank.
    words: [u32; 8],
}

const _: () = assert!(core::mem::size_of::<ListedShared>() == LISTED_SHARED_BYTES as usize);
// Each thread clears one bucket of a digit's histogram.
const _: () = assert!(DIGIT_BUCKETS == LISTED_THREADS as usize);

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

    /// Calls `f(logit, index)` for the finite entries of this thread's tiles.
    ///
    /// # Safety
    /// As [`RowLists::for_each_tile`].
    #[inline(always)]
    unsafe fn for_each(&self, thread: u32, mut f: impl FnMut(f32, u32)) {
        // SAFETY: per this function's contract.
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
        let other = unsafe {
            (arch::shuffle_xor(total as u32, mask) as u64)
                | (arch::shuffle_xor((total >> 32) as u32, mask) as u64) << 32
        };
        if lane & mask != 0 {
            before += other;
        }
        total += other;
        mask <<= 1;
    }
    (before, total)
}

/// The k-th largest [`order_key`] among this row's entries at or above `min_cut`, by a radix
/// selection of four 8-bit digits; `None` when fewer than `k` entries are.
///
/// # Safety
/// Every thread of the block calls it together; `k ≥ 1`.
#[inline(always)]
unsafe fn kth_key(lists: &RowLists, block: &Block, min_cut: f32, k: u32) -> Option<u32> {
    let shared = block.shared;
    let thread = block.thread;
    let (mut prefix, mut rank) = (0u32, k);
    let mut digit = 0;
    while digit < 4 {
        let shift = 24 - 8 * digit;
        // SAFETY: every thread of the block is here (this function's contract); the histogram
        // is cleared by its own thread, then added to atomically, then read by thread 0.
        unsafe {
            (*shared).histogram[thread as usize] = 0;
            arch::sync_threads();
            let histogram = &raw mut (*shared).histogram as *mut u32;
            lists.for_each(thread, |logit, _| {
                let key = order_key(logit);
                // The digits above this one must equal the prefix found so far.
                let above = if digit == 0 { 0 } else { (key ^ prefix) >> (shift + 8) };
                if logit >= min_cut && above == 0 {
                    let bucket = ((key >> shift) & 0xff) as usize;
                    AtomicU32::from_ptr(histogram.add(bucket)).fetch_add(1, Ordering::Relaxed);
                }
            });
            arch::sync_threads();
            // Warp 0 decides: lane `l` holds buckets `255 − 8l` down to `248 − 8l`, and the
            // lane whose run of counts (from the top) reaches `rank` walks its own.
            if thread < 32 {
                let top = DIGIT_BUCKETS - 1 - 8 * thread as usize;
                let mut run = 0u32;
                for i in 0..8 {
                    run += (*shared).histogram[top - i];
                }
                let (above, total) = warp_prefix(run as u64, thread);
                let above = above as u32;
                if thread == 0 {
                    (*shared).words[2] = (total >= rank as u64) as u32;
                }
                if above < rank && above + run >= rank {
                    let mut above = above;
                    for i in 0..8 {
                        let count = (*shared).histogram[top - i];
                        if above + count >= rank {
                            (*shared).words[0] = prefix | ((top - i) as u32) << shift;
                            (*shared).words[1] = rank - above;
                            break;
                        }
                        above += count;
                    }
                }
            }
            arch::sync_threads();
            prefix = (*shared).words[0];
            rank = (*shared).words[1];
            let found = (*shared).words[2];
            arch::sync_threads();
            if found == 0 {
                return None;
            }
        }
        digit += 1;
    }
    Some(prefix)
}

/// top-p's cut among the entries `bound` keeps: the last entry of the shortest prefix in the
/// truncations' order whose units reach [`top_p_target`] of their total; `None` when none or
/// more than [`LISTED_RANK_CAP`] entries are kept (the row is left to the materialised path).
///
/// # Safety
/// Every thread of the block calls it together.
#[inline(always)]
unsafe fn top_p_cut(
    lists: &RowLists,
    block: &Block,
    bound: &KeepRule,
    max: f32,
    temperature: f32,
    top_p: f32,
) -> Option<(f32, u32)> {
    let shared = block.shared;
    let thread = block.thread;
    // SAFETY: every thread of the block is here (this function's contract); the count is only
    // accessed atomically until the barrier, each slot it hands out by one thread.
    let count = unsafe {
        if thread == 0 {
            (*shared).words[3] = 0;
        }
        arch::sync_threads();
        let count = &raw mut (*shared).words[3];
        let ranked = &raw mut (*shared).ranked as *mut u64;
        lists.for_each(thread, |logit, index| {
            if bound.keeps(logit, index) {
                let slot = AtomicU32::from_ptr(count).fetch_add(1, Ordering::Relaxed);
                if slot < LISTED_RANK_CAP {
                    *ranked.add(slot as usize) = (order_key(logit) as u64) << 32 | !index as u64;
                }
            }
        });
        arch::sync_threads();
        let n = *count;
        arch::sync_threads();
        n
    };
    if count == 0 || count > LISTED_RANK_CAP {
        return None;
    }
    let width = count.next_power_of_two().max(2);
    // SAFETY: every thread of the block is here; each step's pairs are disjoint, one thread
    // each, and barriers separate the steps.
    unsafe {
        let ranked = &raw mut (*shared).ranked as *mut u64;
        let mut slot = count + thread;
        while slot < width {
            *ranked.add(slot as usize) = 0;
            slot += LISTED_THREADS;
        }
        arch::sync_threads();
        // A bitonic sort into decreasing order.
        let mut size = 2;
        while size <= width {
            let mut stride = size / 2;
            while stride > 0 {
                let mut i = thread;
                while i < width {
                    let j = i ^ stride;
                    if j > i {
                        let (a, b) = (*ranked.add(i as usize), *ranked.add(j as usize));
                        let decreasing = i & size == 0;
                        if (a < b) == decreasing {
                            *ranked.add(i as usize) = b;
                            *ranked.add(j as usize) = a;
                        }
                    }
                    i += LISTED_THREADS;
                }
                arch::sync_threads();
                stride /= 2;
            }
            size *= 2;
        }
    }
    // SAFETY: a field of the block's shared memory.
    let ranked = unsafe { &raw const (*shared).ranked as *const u64 };
    let entry = |slot: u32| {
        // SAFETY: `slot < count`: a ranked entry, written before the barriers above.
        let word = unsafe { *ranked.add(slot as usize) };
        (key_logit((word >> 32) as u32), !(word as u32))
    };
    // Each thread sums a run of consecutive ranks; the block's scan turns the sums into
    // prefixes.
    let run = count.div_ceil(LISTED_THREADS);
    let (first, end) = ((thread * run).min(count), ((thread + 1) * run).min(count));
    let mut sum = 0u64;
    for slot in first..end {
        sum += top_p_units(entry(slot).0, max, temperature);
    }
    // SAFETY: every thread of the block is here; each warp's slot, then every thread reads,
    // separated by barriers.
    unsafe {
        let (in_warp, warp_total) = warp_prefix(sum, block.lane());
        if block.lane() == 0 {
            (*shared).warp_u64[block.warp()] = warp_total;
        }
        if thread == 0 {
            (*shared).words[4] = u32::MAX;
        }
        arch::sync_threads();
        let (mut before, mut total) = (in_warp, 0u64);
        for w in 0..WARPS {
            let part = (*shared).warp_u64[w];
            if w < block.warp() {
                before += part;
            }
            total += part;
        }
        let target = top_p_target(total, top_p);
        if before < target && before + sum >= target {
            let mut mass = before;
            for slot in first..end {
                mass += top_p_units(entry(slot).0, max, temperature);
                if mass >= target {
                    (*shared).words[4] = slot;
                    break;
                }
            }
        }
        arch::sync_threads();
        let last = (*shared).words[4];
        arch::sync_threads();
        // The mass reaches the target by the last entry (the largest one has units > 0).
        Some(entry(last.min(count - 1)))
    }
}

/// The listed sampler (see the module docs and `SampleListedArgs`): one block per row, in
/// grid-stride order.
///
/// # Safety
/// Launched with `LISTED_THREADS` threads and `LISTED_SHARED_BYTES` of shared memory at
/// `shared`; `args` describes valid buffers: every row's `tiles` lists written.
pub unsafe fn sample_listed(args: &SampleListedArgs, shared: *mut ListedShared) {
    let thread = arch::thread_index();
    let block = Block { shared, thread };
    let mut b = arch::block_index();
    while b < args.batch {
        // SAFETY: `b < batch`: a row of the lists, the row parameters and the processing.
        let (lists, row, processing) = unsafe {
            (
                RowLists {
                    tops: args.tile_tops.as_ptr().add(b as usize * args.tiles as usize),
                    cached: &raw mut (*shared).cached as *mut TileTop,
                    tiles: args.tiles,
                },
                *args.row_params.as_ptr().add(b as usize),
                *args.processing.as_ptr().add(b as usize),
            )
        };
        // SAFETY: the lists are readable; each thread copies its own tiles.
        unsafe { lists.cache(thread) };
        // Step 1: the row's largest logit; NaN if a list is non-finite.
        let mut max = f32::NEG_INFINITY;
        // SAFETY: this thread's tiles, cached above.
        unsafe { lists.for_each_tile(thread, |top| max = maximum(max, top.logits[0])) };
        // SAFETY: every thread of the block is here (the row loop is per block).
        let max = unsafe { block.max(max) };
        let truncates = processing.min_p > 0.0 || processing.top_k > 0 || processing.top_p < 1.0;
        let (rule, settled) = if max.is_nan() || max == f32::NEG_INFINITY {
            // Non-finite (every draw NON_FINITE) or nothing to draw (every draw NONE): the race
            // below finds that from the lists, as the materialised path does from the row.
            (KeepRule::ALL, true)
        } else if row.greedy != 0 {
            // The row's first entry in the truncations' order is in its tile's list; a greedy
            // row takes it, and keeps every entry.
            (KeepRule::ALL, true)
        } else {
            let min_cut = min_p_threshold(max, row.temperature, processing.min_p);
            let mut bound = KeepRule { min_cut, ..KeepRule::ALL };
            if processing.top_k > 0 {
                // SAFETY: every thread of the block is here; `top_k ≥ 1`.
                if let Some(key) = unsafe { kth_key(&lists, &block, min_cut, processing.top_k) } {
                    bound.order_cut = (key_logit(key), u32::MAX);
                }
            }
            // Step 3: with top-p, the bound is the rule before it.
            let mut open = !truncates;
            // SAFETY: this thread's tiles, cached above.
            unsafe { lists.for_each_tile(thread, |top| open |= !top.settles(&bound)) };
            // SAFETY: every thread of the block is here.
            let mut settled = !unsafe { block.any(open) };
            let mut rule = bound;
            if settled && processing.top_p < 1.0 {
                // SAFETY: every thread of the block is here.
                match unsafe { top_p_cut(&lists, &block, &bound, max, row.temperature, processing.top_p) } {
                    Some(cut) => rule.order_cut = cut,
                    None => settled = false,
                }
            }
            (rule, settled)
        };
        if !settled && thread == 0 {
            // SAFETY: the count is only accessed atomically.
            unsafe { AtomicU32::from_ptr(args.unsettled.as_mut_ptr()) }.fetch_add(1, Ordering::Relaxed);
        }
        let non_finite = max.is_nan();
        for j in 0..args.samples {
            let mut best = Candidate::NONE;
            if settled && !non_finite {
                // SAFETY: the lists are readable.
                unsafe {
                    lists.for_each(thread, |logit, index| {
                        if rule.keeps(logit, index) {
                            // Selects, not an indexed store, keep the quad in registers.
                            let quad: [f32; 4] =
                                core::array::from_fn(|r| if r as u32 == index % 4 { logit } else { f32::NEG_INFINITY });
                            best = best.merge(block_candidate(&row, args.draw_offset + j, index / 4, quad, 4));
                        }
                    })
                };
            }
            // SAFETY: every thread of the block is here (uniform loops).
            let best = unsafe { block.best(best) };
            if thread == 0 {
                let winner = match (non_finite, settled) {
                    (true, _) => Candidate::NON_FINITE,
                    (false, true) => best,
                    (false, false) => Candidate::NONE,
                };
                // SAFETY: `b < batch`, `j < samples`: inside the `[batch · samples]` candidates.
                unsafe { *args.candidates.as_mut_ptr().add(candidate_pair(b, args.samples, j) as usize) = winner };
            }
        }
        b += arch::grid_size();
    }
}
