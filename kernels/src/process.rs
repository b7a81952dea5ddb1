//! Logit processing over materialised rows: a pipeline of launches over (row, slice) items
//! applies the per-entry steps of `flashsample_core::process`, decides min-p, top-k and top-p
//! exactly, writes the logits each row races with, each slice's log-sum-exp terms and each
//! row's top raw entries; the shard merge turns the winners and terms of one or more
//! vocabulary shards into tokens and log-probabilities.
//!
//! top-k and top-p are order statistics of the whole row. Each is found by a radix selection
//! over [`order_key`] (four 8-bit digits, most significant first): per digit one launch, in
//! which every slice adds a histogram of its entries still in play to the row's, with weights
//! that are counts (top-k) or top-p's integer masses ([`top_p_units`]), and the row's last
//! slice to finish picks the digit for the next launch. Integer sums do not depend on the
//! order the threads and slices add them in, so the cut is the same on every launch and for
//! every slicing, and the same as the CPU's, which sorts. A row split into many slices keeps
//! many multiprocessors busy when the batch is small.

use core::ptr::{addr_of_mut, read_volatile};
use core::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use flashsample_core::abi::{
    COARSE_DIGIT, DevicePtr, MEMBER_CAPACITY, PROCESS_SHARED_BYTES, PROCESS_THREADS, ProcessArgs, ProcessRowState,
    ProcessStep, RawTop, RowProcessing, RowSums, SELECT_BUCKETS, SELECT_DIGITS, Selection, ShardMergeArgs, ShardWinner,
    TopLogprob, digit_shift, maxima_per_row,
};
use flashsample_core::process::{
    KeepRule, LogSumExp, MAX_TOP_LOGPROBS, Penalties, SPARSE_BLOCK, SparseEntry, TOP_P_BUCKET_UNITS, coarse_key,
    coarse_position, coarse_scale, dense_step, extremum, key_logit, min_p_threshold, order_key, process_quad,
    sparse_step, token_log_probabilities, top_p_target, top_p_units,
};
use flashsample_core::{NO_TOKEN, NON_FINITE_TOKEN, RowParams};

use crate::{arch, each_index};

const WARPS: usize = (PROCESS_THREADS / 32) as usize;

/// Buckets whose weights each thread of a digit gathers in registers before adding them to
/// its warp's histogram: the first this many distinct buckets it meets. A leading digit puts a
/// row of normal logits into 18–19 buckets, the 8 fullest holding 98–99 % of its entries; with
/// eight slots a thread adds to the shared histogram for 2–3 % of its entries, against 61–65 %
/// with its two most recent buckets (a CPU simulation of N(0, σ²) rows, σ from 2.1, the
/// benchmark's rows at D = 4096, to 6, with 200 and 800 entries per thread).
const GATHERED_BUCKETS: usize = 8;

/// The processing kernel's shared memory (`PROCESS_SHARED_BYTES`).
#[repr(C)]
pub struct ProcessShared {
    /// A histogram per warp, as the low and then the high 32-bit halves of its buckets'
    /// weights (the first warp's words also a digit's prefix sums and the top entries' sort).
    buckets: [[u64; SELECT_BUCKETS as usize]; WARPS],
    warp_lse: [LogSumExp; WARPS],
    warp_max: [f32; WARPS],
    warp_non_finite: [u32; WARPS],
    /// Whether the block is its row's last slice to arrive ([`Slice::arrive`]), from thread 0
    /// to the block.
    last: u32,
    /// The members the block found in [`ProcessStep::Gather`] ([`ListMembers`]).
    gathered: u32,
    /// A digit's decision ([`decide_digit`]): whether the selection runs, the weight above
    /// its prefix, its target; the chosen bucket and the weight above it. In
    /// [`ProcessStep::Gather`], where the block's members start in the row's list.
    decision: [u64; 5],
    /// In [`ProcessStep::Resolve`], the row's histogram of the running digit, which only the
    /// row's block adds to.
    resolved: [u64; SELECT_BUCKETS as usize],
    /// [`TOP_P_BUCKET_UNITS`], copied in when the kernel starts: top-p's units read it once per
    /// entry at an index that varies by lane, which shared memory serves in one pass or a few.
    bucket_units: [f32; 256],
}

/// Members a block stages in [`ProcessStep::Gather`]: the histograms' words, which the step
/// does not use, hold as many column indices as a row's list.
const STAGED_MEMBERS: u32 = (WARPS * SELECT_BUCKETS as usize * 2) as u32;

const _: () = assert!(STAGED_MEMBERS == MEMBER_CAPACITY);

const _: () = assert!(core::mem::size_of::<ProcessShared>() == PROCESS_SHARED_BYTES as usize);

/// The per-entry processing of the quad at `index0` of row `b` in a fused tile
/// (`flashsample_core::process::process_quad` with the row's mask word and the sparse entries
/// of the quad's block); a quad past the vocabulary is returned as it is.
///
/// # Safety
/// `processing` holds row `b`'s block, whose mask, sparse entries and block offsets are valid
/// for `vocab` entries.
#[inline(always)]
pub unsafe fn fused_quad(
    processing: DevicePtr<RowProcessing>,
    b: u32,
    index0: u32,
    vocab: u32,
    quad: [f32; 4],
) -> [f32; 4] {
    if index0 >= vocab {
        return quad;
    }
    // Field by field, each when it is needed: the tiles' epilogues have few registers to spare.
    let p = processing.as_ptr().wrapping_add(b as usize);
    // SAFETY: row `b`'s block (this function's contract).
    let (mask, cap, sparse_len) = unsafe { ((*p).mask, (*p).softcap, (*p).sparse_len) };
    let mask_word = if mask.address() == 0 {
        u32::MAX
    } else {
        // SAFETY: `index0 < vocab`: a word of the row's `⌈vocab / 32⌉`.
        unsafe { *mask.as_ptr().add((index0 / 32) as usize) }
    };
    if sparse_len == 0 {
        return process_quad(quad, index0, cap, mask_word, &Penalties::NONE, 0..0, |_| SparseEntry {
            token: 0,
            bias: 0.0,
            count: 0,
        });
    }
    // SAFETY: as above; `index0 < vocab`: block `index0 / SPARSE_BLOCK` and the next offset exist.
    let (sparse, listed, penalties) = unsafe {
        let blocks = (*p).sparse_blocks.as_ptr().add((index0 / SPARSE_BLOCK) as usize);
        ((*p).sparse, *blocks..*blocks.add(1), (*p).penalties)
    };
    // SAFETY: the offsets index the row's `sparse_len` entries.
    process_quad(quad, index0, cap, mask_word, &penalties, listed, |k| unsafe { *sparse.as_ptr().add(k as usize) })
}

/// Four consecutive logits, loaded and stored as one 16-byte access.
#[repr(C, align(16))]
#[derive(Clone, Copy)]
struct Quad([f32; 4]);

/// Calls `f(q, quad)` for this thread's quads `q` of the row at `row` among the quads
/// `quads.0 .. quads.1`: `quads.0 + thread`, then every `PROCESS_THREADS`-th, two at a time,
/// each pair loaded while the one before it is used, so that each block keeps enough loads in
/// flight.
///
/// # Safety
/// `row` is 16-byte aligned and readable up to its quad `quads.1`.
#[inline(always)]
unsafe fn for_each_quad(row: *const f32, quads: (u32, u32), thread: u32, mut f: impl FnMut(u32, Quad)) {
    let (start, end) = quads;
    let load = |q: u32| {
        if q < end {
            // SAFETY: `q < end`: a whole aligned quad of the row (this function's contract).
            unsafe { *(row.add(4 * q as usize) as *const Quad) }
        } else {
            Quad([f32::NEG_INFINITY; 4])
        }
    };
    // The next pair is loaded before this one is used: a digit's per-entry work (a mass, the
    // histogram's adds) would otherwise leave the loads idle while it runs.
    let mut first = start + thread;
    let mut pair = (load(first), load(first + PROCESS_THREADS));
    while first < end {
        let (second, next) = (first + PROCESS_THREADS, first + 2 * PROCESS_THREADS);
        let (a, b) = pair;
        pair = (load(next), load(next + PROCESS_THREADS));
        f(first, a);
        // A quad past the slice may still lie inside the row: it is another slice's.
        if second < end {
            f(second, b);
        }
        first = next;
    }
}

/// Calls `f(i, logit)` for this thread's entries `i < vocab` of the row at `row` among its
/// quads `quads.0 .. quads.1`, as [`for_each_quad`] visits them.
///
/// # Safety
/// `row` is 16-byte aligned and readable up to `vocab` rounded up to a multiple of 4, and
/// `quads.1 ≤ ⌈vocab / 4⌉`.
#[inline(always)]
unsafe fn for_each_entry(row: *const f32, vocab: u32, quads: (u32, u32), thread: u32, mut f: impl FnMut(u32, f32)) {
    // Scalars, not an indexed array: an array indexed in a loop the compiler leaves rolled
    // goes to the stack. Inlined always: a visit LLVM leaves as a call passes the caller's
    // closure state through the stack.
    let visit = #[inline(always)]
    |q: u32, Quad([l0, l1, l2, l3]): Quad| {
        let i = 4 * q;
        if i < vocab {
            f(i, l0);
        }
        if i + 1 < vocab {
            f(i + 1, l1);
        }
        if i + 2 < vocab {
            f(i + 2, l2);
        }
        if i + 3 < vocab {
            f(i + 3, l3);
        }
    };
    // SAFETY: the quads lie inside the row (this function's contract).
    unsafe { for_each_quad(row, quads, thread, visit) }
}

/// Rewrites this thread's quads of a row as [`for_each_quad`] visits them, from the row at
/// `from` to the row at `to` (which may be the same): `f(i, logit)` gives entry `i`'s new
/// value and whether it changed, and a quad with a changed entry is stored whole (entries
/// past `vocab` as −∞) in one 16-byte access.
///
/// # Safety
/// As [`for_each_entry`] for `from`; `to` is 16-byte aligned and writable where `from` is
/// readable, and no other thread accesses this thread's quads meanwhile.
#[inline(always)]
unsafe fn map_entries(
    from: *const f32,
    to: *mut f32,
    vocab: u32,
    quads: (u32, u32),
    thread: u32,
    mut f: impl FnMut(u32, f32) -> (f32, bool),
) {
    let rewrite = |q: u32, Quad([l0, l1, l2, l3]): Quad| {
        let i = 4 * q;
        let mut changed = false;
        let mut entry = |k: u32, l: f32| {
            if i + k < vocab {
                let (value, change) = f(i + k, l);
                changed |= change;
                value
            } else {
                f32::NEG_INFINITY
            }
        };
        let quad = Quad([entry(0, l0), entry(1, l1), entry(2, l2), entry(3, l3)]);
        if changed {
            // SAFETY: a quad this thread visits: whole, aligned and this thread's in the row
            // at `to` (this function's contract).
            unsafe { *(to.add(i as usize) as *mut Quad) = quad };
        }
    };
    // SAFETY: the quads lie inside the row (this function's contract).
    unsafe { for_each_quad(from, quads, thread, rewrite) }
}

/// One (row, slice) item of a launch: the block's part of row `b`.
struct Slice {
    shared: *mut ProcessShared,
    b: u32,
    /// The slice's index among the row's `slices` and its quads `quads.0 .. quads.1`.
    index: u32,
    slices: u32,
    quads: (u32, u32),
    vocab: u32,
    thread: u32,
}

impl Slice {
    /// Item `item` of `args`' (row, slice) items; `args.slices` splits every row into runs of
    /// `⌈quads / slices⌉` quads (the last ones may be short or empty).
    fn of(args: &ProcessArgs, shared: *mut ProcessShared, item: u32) -> Slice {
        let quads = args.vocab.div_ceil(4);
        let per_slice = quads.div_ceil(args.slices);
        let (b, index) = (item / args.slices, item % args.slices);
        let start = (index * per_slice).min(quads);
        Slice {
            shared,
            b,
            index,
            slices: args.slices,
            quads: (start, (start + per_slice).min(quads)),
            vocab: args.vocab,
            thread: arch::thread_index(),
        }
    }

    /// The whole of row `b` as one slice, for a step with one block per row.
    fn whole_row(args: &ProcessArgs, shared: *mut ProcessShared, b: u32) -> Slice {
        Slice {
            shared,
            b,
            index: 0,
            slices: 1,
            quads: (0, args.vocab.div_ceil(4)),
            vocab: args.vocab,
            thread: arch::thread_index(),
        }
    }

    /// [`for_each_entry`] over this slice of the row at `row`.
    ///
    /// # Safety
    /// As [`for_each_entry`] for `row`.
    #[inline(always)]
    unsafe fn for_each(&self, row: *const f32, f: impl FnMut(u32, f32)) {
        // SAFETY: the slice's quads lie inside the row's (`Slice::of`), per this function's
        // contract.
        unsafe { for_each_entry(row, self.vocab, self.quads, self.thread, f) }
    }

    /// [`map_entries`] over this slice, from the row at `from` to the row at `to`.
    ///
    /// # Safety
    /// As [`map_entries`]; the slice is this block's alone.
    #[inline(always)]
    unsafe fn map(&self, from: *const f32, to: *mut f32, f: impl FnMut(u32, f32) -> (f32, bool)) {
        // SAFETY: as above.
        unsafe { map_entries(from, to, self.vocab, self.quads, self.thread, f) }
    }

    /// Adds the weights of the block's `entries` `i` (of the raw row if `raw`) with
    /// `member(i, logit) = Some(key)` to bucket `(key >> shift) % SELECT_BUCKETS` of the
    /// block's histogram, then the histogram to `row_histogram`. With `gather` each thread
    /// first gathers the weights of the first [`GATHERED_BUCKETS`] distinct buckets it meets in
    /// registers: for a leading digit over logits, whose entries crowd into a few buckets.
    ///
    /// # Safety
    /// Every thread of the block calls it together; `entries` are readable;
    /// `row_histogram` holds `SELECT_BUCKETS` words, only accessed atomically meanwhile.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    unsafe fn add_histogram(
        &self,
        entries: &impl EntrySource,
        raw: bool,
        shift: u32,
        member: impl Fn(u32, f32) -> Option<u32>,
        weight: impl Fn(f32) -> u64,
        row_histogram: *mut u64,
        gather: bool,
    ) {
        // SAFETY: the buckets lie inside the block's shared memory (`PROCESS_SHARED_BYTES`).
        let buckets = unsafe { addr_of_mut!((*self.shared).buckets) } as *mut u64;
        let words = WARPS * SELECT_BUCKETS as usize;
        let mut k = self.thread as usize;
        while k < words {
            // SAFETY: `k < words`: a bucket of one warp's histogram.
            unsafe { *buckets.add(k) = 0 };
            k += PROCESS_THREADS as usize;
        }
        // SAFETY: every thread of the block reaches it (this function's contract).
        unsafe { arch::sync_threads() };
        // Each warp adds to a histogram of its own, and with `gather` each thread adds the
        // weights it gathered per bucket in registers for the first `GATHERED_BUCKETS`
        // distinct buckets it meets, not single entries: a leading digit puts most of a row
        // in a few buckets, whose shared atomics would otherwise queue. A later digit spreads
        // its members over the buckets, where comparing with eight slots costs more than the
        // adds it saves (measured).
        //
        // A warp's histogram is two arrays of 32-bit words, the low and the high halves of its
        // buckets' weights: shared memory adds 32-bit words natively, 64-bit ones only by a
        // compare-and-swap loop. A low half that wraps carries one into the high half, so every
        // bucket's weight is its exact 64-bit sum.
        let low = buckets.wrapping_add((self.thread / 32) as usize * SELECT_BUCKETS as usize) as *mut u32;
        let high = low.wrapping_add(SELECT_BUCKETS as usize);
        // SAFETY: a bucket of the warp's histogram, only accessed atomically until the barrier
        // below.
        let add = |bucket: u32, weight: u64| unsafe { add_to_halves(low, high, bucket as usize, weight) };
        // `NO_BUCKET` marks a free slot; slots fill in order, so a free one has none taken
        // after it.
        const NO_BUCKET: u32 = u32::MAX;
        let mut gathered = [NO_BUCKET; GATHERED_BUCKETS];
        let mut weights = [0u64; GATHERED_BUCKETS];
        // SAFETY: per this function's contract.
        unsafe {
            entries.each(raw, |i, l| {
                if let Some(key) = member(i, l) {
                    let w = weight(l);
                    if w == 0 {
                        return;
                    }
                    let bucket = (key >> shift) & (SELECT_BUCKETS - 1);
                    // `placed`: the weight went to a slot; otherwise it goes to the histogram.
                    let mut placed = false;
                    if gather {
                        // Unrolled by hand: constant indices keep the slots in registers.
                        each_index!(slot < GATHERED_BUCKETS, {
                            if !placed && (gathered[slot] == bucket || gathered[slot] == NO_BUCKET) {
                                gathered[slot] = bucket;
                                weights[slot] += w;
                                placed = true;
                            }
                        });
                    }
                    if !placed {
                        add(bucket, w);
                    }
                }
            })
        };
        each_index!(slot < GATHERED_BUCKETS, {
            if gathered[slot] != NO_BUCKET {
                add(gathered[slot], weights[slot]);
            }
        });
        // SAFETY: as above.
        unsafe { arch::sync_threads() };
        if self.thread < SELECT_BUCKETS {
            let mut weight = 0u64;
            for w in 0..WARPS {
                // SAFETY: bucket `thread` of warp `w`'s histogram (its halves), written before
                // the barrier above.
                weight += unsafe {
                    let low = buckets.add(w * SELECT_BUCKETS as usize) as *const u32;
                    halves_weight(low, low.add(SELECT_BUCKETS as usize), self.thread as usize)
                };
            }
            if weight > 0 {
                // SAFETY: a word of the row's histogram, only accessed atomically (this
                // function's contract).
                unsafe { AtomicU64::from_ptr(row_histogram.add(self.thread as usize)) }
                    .fetch_add(weight, Ordering::Relaxed);
            }
        }
    }

    /// Whether this block is the last of the row's slices to get here in this launch: every
    /// thread's writes for the row are made visible first, and the last block sees every
    /// other slice's.
    ///
    /// # Safety
    /// Every thread of the block calls it together, once per launch and item; `state` is the
    /// row's.
    #[inline(always)]
    unsafe fn arrive(&self, state: *mut ProcessRowState) -> bool {
        // SAFETY: a fence, then a barrier every thread reaches (this function's contract).
        unsafe {
            arch::fence_device();
            arch::sync_threads();
        }
        // SAFETY: the flag lies inside the block's shared memory.
        let flag = unsafe { addr_of_mut!((*self.shared).last) };
        if self.thread == 0 {
            // SAFETY: the row's arrival count, only accessed atomically during the launch.
            let before =
                unsafe { AtomicU32::from_ptr(addr_of_mut!((*state).arrivals)) }.fetch_add(1, Ordering::Relaxed);
            let last = before + 1 == self.slices;
            if last {
                // SAFETY: a fence.
                unsafe { arch::fence_device() };
            }
            // SAFETY: read by the block after the barrier below; rewritten only after the
            // first barrier of the next call.
            unsafe { *flag = last as u32 };
        }
        // SAFETY: as above.
        unsafe {
            arch::sync_threads();
            *flag != 0
        }
    }

    /// The slice's largest entry of `row` and whether any is NaN or +∞, in every thread.
    ///
    /// # Safety
    /// Every thread of the block calls it together; `row` as [`Slice::for_each`].
    #[inline(always)]
    unsafe fn max_and_non_finite(&self, row: *const f32) -> (f32, bool) {
        let mut max = f32::NEG_INFINITY;
        let mut non_finite = false;
        // SAFETY: per this function's contract.
        unsafe {
            self.for_each(row, |_, l| {
                max = if l > max { l } else { max };
                non_finite |= l.is_nan() || l == f32::INFINITY;
            })
        };
        // SAFETY: every thread of the block together (this function's contract).
        unsafe { self.block_max_and_non_finite(max, non_finite) }
    }

    /// The largest of the threads' `max` and whether any thread's `non_finite` is set, in
    /// every thread.
    ///
    /// # Safety
    /// Every thread of the block calls it together.
    #[inline(always)]
    unsafe fn block_max_and_non_finite(&self, mut max: f32, mut non_finite: bool) -> (f32, bool) {
        let mut mask = 1;
        while mask < 32 {
            // SAFETY: every lane reaches it (uniform loop), per this function's contract.
            let other = f32::from_bits(unsafe { arch::shuffle_xor(max.to_bits(), mask) });
            max = if other > max { other } else { max };
            // SAFETY: as above.
            non_finite |= unsafe { arch::shuffle_xor(non_finite as u32, mask) } != 0;
            mask <<= 1;
        }
        let warp = (self.thread / 32) as usize;
        // SAFETY: per-warp slots of the block's shared memory.
        let (maxima, flags) = unsafe {
            (
                addr_of_mut!((*self.shared).warp_max) as *mut f32,
                addr_of_mut!((*self.shared).warp_non_finite) as *mut u32,
            )
        };
        if self.thread.is_multiple_of(32) {
            // SAFETY: `warp < WARPS`.
            unsafe { (*maxima.add(warp), *flags.add(warp)) = (max, non_finite as u32) };
        }
        // SAFETY: every thread of the block reaches it.
        unsafe { arch::sync_threads() };
        for w in 0..WARPS {
            // SAFETY: written before the barrier above.
            let (m, f) = unsafe { (*maxima.add(w), *flags.add(w)) };
            max = if m > max { m } else { max };
            non_finite |= f != 0;
        }
        // SAFETY: every thread has read the slots before they are written again.
        unsafe { arch::sync_threads() };
        (max, non_finite)
    }

    /// The block's log-sum-exp terms merged in lane, then warp order; meaningful in thread 0.
    ///
    /// # Safety
    /// Every thread of the block calls it together.
    #[inline(always)]
    unsafe fn merge_lse(&self, lse: LogSumExp, temperature: f32) -> LogSumExp {
        // SAFETY: per-warp slots of the block's shared memory.
        let slots = unsafe { addr_of_mut!((*self.shared).warp_lse) } as *mut LogSumExp;
        // SAFETY: every thread of the block together (this function's contract).
        unsafe { merge_lse_over_block(lse, temperature, slots, WARPS) }
    }
}

/// Adds `weight` to bucket `bucket` of a histogram kept as the low (`low`) and high (`high`)
/// 32-bit halves of its buckets' weights, carrying one into the high half when the low one
/// wraps.
///
/// # Safety
/// Both words of the bucket are valid and, while any thread adds to them, accessed only
/// atomically.
#[inline(always)]
pub(crate) unsafe fn add_to_halves(low: *mut u32, high: *mut u32, bucket: usize, weight: u64) {
    let (weight_low, mut weight_high) = (weight as u32, (weight >> 32) as u32);
    if weight_low > 0 {
        // SAFETY: per this function's contract.
        let before = unsafe { AtomicU32::from_ptr(low.add(bucket)) }.fetch_add(weight_low, Ordering::Relaxed);
        weight_high += before.checked_add(weight_low).is_none() as u32;
    }
    if weight_high > 0 {
        // SAFETY: per this function's contract.
        unsafe { AtomicU32::from_ptr(high.add(bucket)) }.fetch_add(weight_high, Ordering::Relaxed);
    }
}

/// The weight of bucket `bucket` of a histogram kept as halves ([`add_to_halves`]).
///
/// # Safety
/// Both words of the bucket are valid, and no thread adds to them while this reads them.
#[inline(always)]
pub(crate) unsafe fn halves_weight(low: *const u32, high: *const u32, bucket: usize) -> u64 {
    // SAFETY: per this function's contract.
    unsafe { (*high.add(bucket) as u64) << 32 | *low.add(bucket) as u64 }
}

/// A block's log-sum-exp terms (one per thread) merged in lane, then warp order, through a
/// slot per warp at `slots`; meaningful in thread 0.
///
/// # Safety
/// Every thread of the block (`warps` warps) calls it together; `slots` holds `warps`
/// [`LogSumExp`]s of shared memory, free again once the call returns.
#[inline(always)]
pub(crate) unsafe fn merge_lse_over_block(
    lse: LogSumExp,
    temperature: f32,
    slots: *mut LogSumExp,
    warps: usize,
) -> LogSumExp {
    let thread = arch::thread_index();
    // SAFETY: all lanes together (this function's contract).
    let lse = unsafe { merge_lse_over_warp(lse, temperature) };
    if thread.is_multiple_of(32) {
        // SAFETY: the warp's slot.
        unsafe { *slots.add((thread / 32) as usize) = lse };
    }
    // SAFETY: every thread of the block reaches it.
    unsafe { arch::sync_threads() };
    let mut total = LogSumExp::EMPTY;
    if thread == 0 {
        for w in 0..warps {
            // SAFETY: written before the barrier above.
            total.merge_with(unsafe { *slots.add(w) }, temperature);
        }
    }
    // SAFETY: every thread of the block reaches it; the slots are free again after it.
    unsafe { arch::sync_threads() };
    total
}

/// Merges a log-sum-exp pair over the warp's lanes.
///
/// # Safety
/// All 32 lanes call it together.
#[inline(always)]
unsafe fn merge_lse_over_warp(mut lse: LogSumExp, temperature: f32) -> LogSumExp {
    let mut mask = 1;
    while mask < 32 {
        // SAFETY: all 32 lanes together (this function's contract).
        let max = f32::from_bits(unsafe { arch::shuffle_xor(lse.max.to_bits(), mask) });
        // SAFETY: as above.
        let sum = f32::from_bits(unsafe { arch::shuffle_xor(lse.sum.to_bits(), mask) });
        // Merged in lane order so that both lanes of a pair hold the same bits.
        let lane_bit = arch::thread_index() & mask;
        let (mut low, high) = if lane_bit == 0 { (lse, LogSumExp { max, sum }) } else { (LogSumExp { max, sum }, lse) };
        low.merge_with(high, temperature);
        lse = low;
        mask <<= 1;
    }
    lse
}

/// Whether a row samples with min-p, top-k or top-p (a greedy row keeps every entry).
fn truncates(params: &RowParams, p: &RowProcessing) -> bool {
    params.greedy == 0 && (p.min_p > 0.0 || p.top_k > 0 || p.top_p < 1.0)
}

/// Where a row's largest processed logit (its `order_key`) and non-finite flag are merged:
/// the exchange's words, which every shard of the row merges into, or the row's state.
///
/// # Safety
/// `item.state` is the row's; an exchange holds `[2, batch]` words.
#[inline(always)]
unsafe fn extrema(item: &Item) -> (*mut u32, *mut u32) {
    let (args, b) = (item.args, item.slice.b as usize);
    match args.exchange_extrema.address() {
        0 => {
            // SAFETY: the row's state (this function's contract).
            unsafe { (addr_of_mut!((*item.state).max_key), addr_of_mut!((*item.state).non_finite)) }
        }
        _ => {
            let words = args.exchange_extrema.as_mut_ptr();
            (words.wrapping_add(b), words.wrapping_add(args.batch as usize + b))
        }
    }
}

/// The largest processed logit of a row whose truncations apply (it [`truncates`] and its
/// processed logits are finite or −∞, not all −∞); `None`: the row keeps every entry.
///
/// # Safety
/// As [`extrema`], after the row's [`ProcessStep::Entries`] launch (with an exchange, every
/// shard's, merged).
#[inline(always)]
unsafe fn truncation_max(item: &Item) -> Option<f32> {
    // SAFETY: the row's words (this function's contract).
    unsafe { truncation_max_at(&item.params, &item.p, extrema(item)) }
}

/// [`truncation_max`] of a row whose merged extrema (its largest logit's `order_key`, its
/// non-finite flag) lie at `words`.
///
/// # Safety
/// Both words are readable and not written while this reads them.
#[inline(always)]
unsafe fn truncation_max_at(params: &RowParams, p: &RowProcessing, words: (*mut u32, *mut u32)) -> Option<f32> {
    if !truncates(params, p) {
        return None;
    }
    // SAFETY: per this function's contract.
    let (max_key, non_finite) = unsafe { (*words.0, *words.1) };
    let max = key_logit(max_key);
    (non_finite == 0 && max > f32::NEG_INFINITY).then_some(max)
}

/// The keep rule [`ProcessStep::Apply`] applies to a row whose [`truncation_max`] is `max`:
/// every selection's cut.
///
/// # Safety
/// `state` is the row's, after its selections.
#[inline(always)]
unsafe fn applied_rule(
    max: Option<f32>,
    params: &RowParams,
    p: &RowProcessing,
    state: *const ProcessRowState,
) -> KeepRule {
    // SAFETY: per this function's contract.
    max.map_or(KeepRule::ALL, |max| unsafe { keep_rule(max, params, p, state, None) })
}

/// [`applied_rule`] for a row of one shard without an exchange, whose extrema are in its
/// state: for the logits sampler, which applies it itself where the pipeline skips `Apply`.
///
/// # Safety
/// `state` is the row's, after the row's selections, not written while this reads it.
#[inline(always)]
pub(crate) unsafe fn kept_by_state(params: &RowParams, p: &RowProcessing, state: *mut ProcessRowState) -> KeepRule {
    // SAFETY: the row's state (this function's contract).
    unsafe {
        let words = (addr_of_mut!((*state).max_key), addr_of_mut!((*state).non_finite));
        applied_rule(truncation_max_at(params, p, words), params, p, state)
    }
}

/// The row's keep rule with the cuts of the selections before `before` (all of them with
/// `None`), for a row whose truncations apply with largest logit `max`.
///
/// # Safety
/// `state` is the row's.
#[inline(always)]
unsafe fn keep_rule(
    max: f32,
    params: &RowParams,
    p: &RowProcessing,
    state: *const ProcessRowState,
    before: Option<Selection>,
) -> KeepRule {
    // SAFETY: the row's state (this function's contract).
    let (found, keys) = unsafe { ((*state).found, (*state).keys) };
    let done = |s: Selection| before.is_none_or(|b| s < b) && found & s.bit() != 0;
    let mut rule = KeepRule { min_cut: min_p_threshold(max, params.temperature, p.min_p), ..KeepRule::ALL };
    if done(Selection::TopK) {
        rule.order_cut = (key_logit(keys[Selection::TopK as usize]), u32::MAX);
    }
    if before.is_none_or(|b| b > Selection::TopPTie) && found & Selection::TopP.bit() != 0 {
        let index = if found & Selection::TopPTie.bit() != 0 { keys[Selection::TopPTie as usize] } else { u32::MAX };
        rule.order_cut = (key_logit(keys[Selection::TopP as usize]), index);
    }
    rule
}

/// The processing kernel (see `ProcessArgs`): one step of the pipeline for each (row, slice)
/// item, or with [`ProcessStep::Decide`] for each row.
///
/// # Safety
/// Launched with `PROCESS_THREADS` threads and `PROCESS_SHARED_BYTES` of shared memory, the
/// steps of one pipeline in order on one stream; `args` describes valid buffers; each row's
/// sparse tokens are distinct, its mask (if any) holds a word for each of the global indices
/// `vocab_offset .. vocab_offset + vocab`; rows with truncations only when the logits are the
/// whole vocabulary or with an exchange, whose extrema every shard merged (and reduced) after
/// `Entries` and whose histogram of a digit every shard added to (and reduced) between its
/// `Select` and `Decide`; `1 ≤ slices ≤ ⌈vocab / 4⌉` and `batch · slices < 2³²`.
#[inline(always)]
pub unsafe fn process_rows(args: &ProcessArgs, shared: *mut ProcessShared) {
    let per_row = args.step == ProcessStep::Decide as u32
        || args.step == ProcessStep::Resolve as u32
        || args.step == ProcessStep::Extrema as u32;
    let items = if per_row { args.batch } else { args.batch * args.slices };
    let thread = arch::thread_index();
    // SAFETY: the table lies inside the block's shared memory; each thread writes its own
    // words, read after the barrier below (every thread reaches it).
    unsafe {
        let units = addr_of_mut!((*shared).bucket_units) as *mut f32;
        let mut j = thread as usize;
        while j < TOP_P_BUCKET_UNITS.len() {
            *units.add(j) = TOP_P_BUCKET_UNITS[j];
            j += PROCESS_THREADS as usize;
        }
        arch::sync_threads();
    }
    let mut index = arch::block_index();
    while index < items {
        // A row's decision is its first slice's.
        let slice = Slice::of(args, shared, if per_row { index * args.slices } else { index });
        let b = slice.b as usize;
        // SAFETY: `b < batch`: a row of the `[batch]` parameters, processing and states.
        let item = unsafe {
            Item {
                args,
                slice,
                params: *args.row_params.as_ptr().add(b),
                p: *args.processing.as_ptr().add(b),
                state: args.state.as_mut_ptr().add(b),
            }
        };
        // SAFETY: every thread of the block together (the step and the item are the block's),
        // per this function's contract.
        unsafe {
            if args.step == ProcessStep::Entries as u32 {
                entries(&item);
            } else if args.step == ProcessStep::Extrema as u32 {
                extrema_from_maxima(&item);
            } else if args.step == ProcessStep::Apply as u32 {
                apply(&item);
            } else if let Some(selection) = Selection::from_u32(args.selection) {
                if args.step == ProcessStep::Gather as u32 {
                    gather(&item, selection);
                } else if args.step == ProcessStep::Resolve as u32 {
                    resolve(&item, selection);
                } else {
                    select_digit(&item, selection);
                }
            }
            // The next item reuses the shared memory.
            arch::sync_threads();
        }
        index += arch::grid_size();
    }
}

/// What a step of the pipeline knows of its (row, slice) item: the launch's arguments, the
/// block's slice, and the row's parameters, processing and state.
struct Item<'a> {
    args: &'a ProcessArgs,
    slice: Slice,
    params: RowParams,
    p: RowProcessing,
    state: *mut ProcessRowState,
}

/// [`ProcessStep::Entries`] on one slice: the dense and sparse steps, the slice's raw terms,
/// and for a truncating row its largest processed logit, merged into the row's state.
///
/// # Safety
/// As [`process_rows`], for `item`.
#[inline(always)]
unsafe fn entries(item: &Item) {
    let Item { args, slice, params, p, .. } = item;
    // Without log-probabilities no log-sum-exp is summed; in place (`raw == processed`) the
    // raw logits are overwritten.
    let log_sums = args.slice_sums.address() != 0;
    let in_place = args.raw == args.processed;
    let offset = slice.b as usize * args.logits_stride as usize;
    let raw = args.raw.as_ptr().wrapping_add(offset);
    let processed = args.processed.as_mut_ptr().wrapping_add(offset);
    let mask = p.mask.as_ptr();
    let mut raw_lse = LogSumExp::EMPTY;
    let dense = |i: u32, l: f32| {
        let index = args.vocab_offset + i;
        // SAFETY: `i < vocab`: inside the mask's words.
        let allowed = mask.is_null() || unsafe { *mask.add(index as usize / 32) >> (index % 32) } & 1 == 1;
        if log_sums {
            raw_lse.add(l, 1.0);
        }
        (dense_step(l, p.softcap, allowed), true)
    };
    // In place, a row without soft-cap or mask is already what the dense steps make.
    if log_sums || !in_place || p.softcap > 0.0 || !mask.is_null() {
        // SAFETY: row `b` of the raw and processed logits, padded to the stride (a multiple of
        // 4); the slice is this block's.
        unsafe { slice.map(raw, processed, dense) };
    }
    if slice.index + 1 == slice.slices {
        // SAFETY: the row's padding, which no other block of the launch writes.
        unsafe { pad_row(args, slice) };
    }
    // SAFETY: every thread of the block reaches it (uniform loops).
    unsafe { arch::sync_threads() };
    let (first, end) = (4 * slice.quads.0, (4 * slice.quads.1).min(args.vocab));
    let mut e = slice.thread;
    while e < p.sparse_len {
        // SAFETY: `e < sparse_len`.
        let entry = unsafe { *p.sparse.as_ptr().add(e as usize) };
        // Entries of other shards wrap past `vocab`.
        let column = entry.token.wrapping_sub(args.vocab_offset);
        if (first..end).contains(&column) {
            // SAFETY: `column < vocab`: inside the row; the token is listed once (this
            // function's contract) and in this slice, so no two threads touch one logit.
            unsafe {
                let at = processed.add(column as usize);
                *at = sparse_step(*at, &entry, &p.penalties);
            }
        }
        e += PROCESS_THREADS;
    }
    // SAFETY: as above.
    unsafe { arch::sync_threads() };
    if truncates(params, p) {
        // SAFETY: every thread together (uniform condition); the slice's processed logits.
        let (max, non_finite) = unsafe { slice.max_and_non_finite(processed) };
        if slice.thread == 0 {
            // SAFETY: the row's words, only accessed atomically during the launch.
            unsafe { merge_extrema(item, max, non_finite) };
        }
    }
    if log_sums {
        // SAFETY: every thread together (uniform condition).
        let lse = unsafe { slice.merge_lse(raw_lse, 1.0) };
        if slice.thread == 0 {
            // SAFETY: item `(b, index)` of the `[batch, slices]` terms.
            unsafe { (*args.slice_sums.as_mut_ptr().add(slice_slot(slice))).raw = lse };
        }
    }
}

/// Sets the padding of the slice's row in the processed logits (its entries from `vocab` up
/// to the stride) to −∞: the logits sampler loads whole quads.
///
/// # Safety
/// `args.processed` holds the row; the block's threads together.
#[inline(always)]
unsafe fn pad_row(args: &ProcessArgs, slice: &Slice) {
    if slice.thread < args.logits_stride - args.vocab {
        let at = slice.b as usize * args.logits_stride as usize + (args.vocab + slice.thread) as usize;
        // SAFETY: `vocab + thread < logits_stride`: inside the row (this function's contract).
        unsafe { *args.processed.as_mut_ptr().add(at) = f32::NEG_INFINITY };
    }
}

/// [`ProcessStep::Extrema`] for one row: its padding set to −∞, and its largest logit and
/// non-finite flag, for a truncating row, from the GEMM's maxima (as [`entries`] finds them
/// in the row, which is already what its steps make).
///
/// # Safety
/// As [`process_rows`] with one block for the row, `args.maxima` the GEMM's maxima of the
/// call's logits.
#[inline(always)]
unsafe fn extrema_from_maxima(item: &Item) {
    let Item { args, slice, params, p, .. } = item;
    // SAFETY: the row's padding, which no other block of the launch writes.
    unsafe { pad_row(args, slice) };
    if !truncates(params, p) {
        return;
    }
    let groups = maxima_per_row(args.vocab);
    let row = args.maxima.as_ptr().wrapping_add(slice.b as usize * groups as usize);
    let mut key = 0;
    let mut g = slice.thread;
    while g < groups {
        // SAFETY: `g < groups`: a word of the row's maxima (this function's contract).
        key = key.max(unsafe { *row.add(g as usize) });
        g += PROCESS_THREADS;
    }
    let (max, non_finite) = extremum(key);
    // SAFETY: every thread of the block together (a uniform condition above).
    let (max, non_finite) = unsafe { slice.block_max_and_non_finite(max, non_finite) };
    if slice.thread == 0 {
        // SAFETY: the row's words, only accessed atomically during the launch.
        unsafe { merge_extrema(item, max, non_finite) };
    }
}

/// Merges a part of the item's row's largest logit `max` and non-finite flag into the row's
/// extrema ([`extrema`]).
///
/// # Safety
/// The row's extrema words are only accessed atomically during the launch.
#[inline(always)]
unsafe fn merge_extrema(item: &Item, max: f32, non_finite: bool) {
    // SAFETY: per this function's contract.
    unsafe {
        let (max_key, flag) = extrema(item);
        AtomicU32::from_ptr(max_key).fetch_max(order_key(max), Ordering::Relaxed);
        if non_finite {
            AtomicU32::from_ptr(flag).fetch_or(1, Ordering::Relaxed);
        }
    }
}

/// The index of `slice`'s terms in `[batch, slices]`.
fn slice_slot(slice: &Slice) -> usize {
    (slice.b * slice.slices + slice.index) as usize
}

/// Whether `selection` runs for the item's row and has not ended: its row truncates (or asks
/// for top entries), its parent found its key (a tie selection), and its members reached its
/// target at digit 0.
///
/// # Safety
/// `item.state` is the row's, not written while this reads it.
#[inline(always)]
unsafe fn runs(item: &Item, selection: Selection) -> bool {
    let Item { args, p, state, .. } = item;
    // SAFETY: the row's state and extrema (this function's contract).
    let (found, ended, max) = unsafe { ((**state).found, (**state).ended, truncation_max(item)) };
    let top_asked = args.slice_sums.address() != 0 && args.top.address() != 0 && p.top_logprobs > 0;
    let runs = match selection {
        Selection::TopK => max.is_some() && p.top_k > 0,
        Selection::TopP => max.is_some() && p.top_p < 1.0,
        Selection::TopPTie => max.is_some() && found & Selection::TopP.bit() != 0,
        Selection::TopRaw => top_asked,
        Selection::TopRawTie => top_asked && found & Selection::TopRaw.bit() != 0,
    };
    runs && ended & selection.bit() == 0
}

/// The block's copy of [`TOP_P_BUCKET_UNITS`], as [`top_p_units`] reads it.
///
/// # Safety
/// `shared` is the block's shared memory, whose table [`process_rows`] filled; the closure
/// reads it with `j < 256`, as [`top_p_units`] does.
#[inline(always)]
unsafe fn bucket_units(shared: *mut ProcessShared) -> impl Fn(u32) -> f32 + Copy {
    // SAFETY: the field lies inside the block's shared memory.
    let table = unsafe { addr_of_mut!((*shared).bucket_units) } as *const f32;
    // SAFETY: `j < 256`: a word of the table (this function's contract).
    move |j: u32| unsafe { *table.add(j as usize) }
}

/// What a step does with the members of a selection's digit (see [`visit_members`]).
trait MemberVisitor {
    /// `raw`: the members lie in the raw logits (else the processed ones); `member(i,
    /// logit)`: entry `i`'s key if it is a member; `weight(logit)`: a member's weight;
    /// `gather`: the digit is a leading digit of logits, whose members crowd into a few
    /// buckets.
    ///
    /// # Safety
    /// As the step that calls it.
    unsafe fn visit(
        self,
        raw: bool,
        gather: bool,
        member: impl Fn(u32, f32) -> Option<u32>,
        weight: impl Fn(f32) -> u64,
    );
}

/// Calls `visitor` with the members of digit `digit` of `selection` for the item's row (whose
/// truncations apply with largest logit `max`, or −∞): the entries kept by the cuts before it,
/// within the decided coarse key of a [`Selection::coarse`] selection and the decided prefix
/// of their key, weighed by count or by top-p's units; at [`COARSE_DIGIT`] the kept entries
/// by their coarse key. One arm per selection and key, so that each member test is its own
/// closure and the loops over entries stay free of the selection's branches.
///
/// # Safety
/// `item.state` is the row's, not written while this reads it; as the visitor's step.
#[inline(always)]
unsafe fn visit_members(item: &Item, selection: Selection, digit: u32, max: f32, visitor: impl MemberVisitor) {
    let Item { args, params, p, state, .. } = item;
    let state = *state;
    // SAFETY: the row's state (this function's contract).
    let (prefix, keys, chosen) = unsafe { ((*state).prefix, (*state).keys, (*state).coarse) };
    let shift = digit_shift(digit);
    let in_prefix = move |key: &u32| digit == 0 || (key ^ prefix) >> (shift + 8) == 0;
    // SAFETY: as above.
    let rule = unsafe { keep_rule(max, params, p, state, Some(selection)) };
    // Cuts and ties compare global indices: every shard of a row applies the same rule.
    let vocab_offset = args.vocab_offset;
    let global = move |i: u32| vocab_offset + i;
    let scale = coarse_scale(params.temperature);
    let coarse = move |l: f32| coarse_key(l, max, scale);
    // Past its coarse key a coarse selection's members are the entries of the decided one.
    let in_run = selection.coarse(args.exchanges()) && digit != COARSE_DIGIT;
    let kept = move |i: u32, l: f32| {
        (l > f32::NEG_INFINITY && rule.keeps(l, global(i)) && (!in_run || coarse(l) == chosen)).then(|| order_key(l))
    };
    let by_coarse = move |i: u32, l: f32| kept(i, l).map(|_| coarse(l) << 24);
    let one = |_: f32| 1u64;
    // A leading digit of logits gathers per thread first; a tie selection's keys are indices,
    // spread over every bucket.
    let leading = digit == 0;
    // SAFETY: the block's shared memory, its table filled when the kernel started.
    let table = unsafe { bucket_units(item.slice.shared) };
    // SAFETY: per this function's contract.
    unsafe {
        match selection {
            Selection::TopK if digit == COARSE_DIGIT => visitor.visit(false, false, by_coarse, one),
            Selection::TopK => visitor.visit(false, leading, move |i, l| kept(i, l).filter(in_prefix), one),
            Selection::TopP => {
                let units = move |l: f32| top_p_units(coarse_position(l, max, scale), table);
                match digit {
                    COARSE_DIGIT => visitor.visit(false, false, by_coarse, units),
                    _ => visitor.visit(false, leading, move |i, l| kept(i, l).filter(in_prefix), units),
                }
            }
            Selection::TopPTie => {
                let last = keys[Selection::TopP as usize];
                let tie =
                    move |i: u32, l: f32| kept(i, l).filter(|&key| key == last).map(|_| !global(i)).filter(in_prefix);
                visitor.visit(false, false, tie, one)
            }
            Selection::TopRaw => visitor.visit(true, leading, move |_, l| Some(order_key(l)).filter(in_prefix), one),
            Selection::TopRawTie => {
                let last = keys[Selection::TopRaw as usize];
                let tie = move |i: u32, l: f32| (order_key(l) == last).then_some(!i).filter(in_prefix);
                visitor.visit(true, false, tie, one)
            }
        }
    }
}

/// A [`MemberVisitor`] that adds a digit's histogram of the members of `entries` to
/// `histogram` ([`Slice::add_histogram`]), gathering per thread where the digit asks for it
/// and `may_gather` allows (a constant for each step, so that a step that never gathers
/// holds no slots).
struct AddHistogram<'a, E> {
    slice: &'a Slice,
    entries: E,
    shift: u32,
    histogram: *mut u64,
    may_gather: bool,
}

impl<E: EntrySource> MemberVisitor for AddHistogram<'_, E> {
    #[inline(always)]
    unsafe fn visit(
        self,
        raw: bool,
        gather: bool,
        member: impl Fn(u32, f32) -> Option<u32>,
        weight: impl Fn(f32) -> u64,
    ) {
        let gather = gather && self.may_gather;
        // SAFETY: as the calling step (this trait's contract).
        unsafe { self.slice.add_histogram(&self.entries, raw, self.shift, member, weight, self.histogram, gather) }
    }
}

/// A [`MemberVisitor`] that lists the members of a slice of a row in the row's member list
/// (`MEMBER_CAPACITY` column indices), counting all of them at `count`: the block stages its
/// members in shared memory, then one add to `count` reserves their places (the first to
/// arrive are listed), where one add per member queued on the row's one counter.
struct ListMembers<'a> {
    entries: SliceSource<'a>,
    list: *mut u32,
    count: *mut u32,
}

impl MemberVisitor for ListMembers<'_> {
    #[inline(always)]
    unsafe fn visit(self, raw: bool, _: bool, member: impl Fn(u32, f32) -> Option<u32>, _: impl Fn(f32) -> u64) {
        let (shared, thread) = (self.entries.slice.shared, self.entries.slice.thread);
        // SAFETY: the fields lie inside the block's shared memory.
        let (staged, found, start) = unsafe {
            (
                addr_of_mut!((*shared).buckets) as *mut u32,
                addr_of_mut!((*shared).gathered),
                addr_of_mut!((*shared).decision) as *mut u32,
            )
        };
        if thread == 0 {
            // SAFETY: read by the block after the barrier below.
            unsafe { *found = 0 };
        }
        // SAFETY: every thread of the block reaches it (this trait's contract).
        unsafe { arch::sync_threads() };
        // SAFETY: the block's count, only accessed atomically until the barrier below.
        let block_count = unsafe { AtomicU32::from_ptr(found) };
        // SAFETY: the slice's logits; a staged slot is its thread's alone.
        unsafe {
            self.entries.each(raw, |i, l| {
                if member(i, l).is_some() {
                    let slot = block_count.fetch_add(1, Ordering::Relaxed);
                    if slot < STAGED_MEMBERS {
                        *staged.add(slot as usize) = i;
                    }
                }
            })
        };
        // SAFETY: as above.
        unsafe { arch::sync_threads() };
        if thread == 0 {
            // SAFETY: the block's count, final after the barrier above; the row's count, only
            // accessed atomically during the launch (this trait's contract); the start, read
            // by the block after the barrier below.
            unsafe { *start = AtomicU32::from_ptr(self.count).fetch_add(*found, Ordering::Relaxed) };
        }
        // SAFETY: as above.
        unsafe { arch::sync_threads() };
        // SAFETY: written before the barriers above. A block with more members than it stages
        // makes the row's count pass the list's capacity: only the staged ones can be listed.
        let (found, start) = unsafe { ((*found).min(STAGED_MEMBERS), *start) };
        let mut k = thread;
        while k < found && start + k < MEMBER_CAPACITY {
            // SAFETY: a staged member, written before the barriers above; a slot of the row's
            // list this block reserved.
            unsafe { *self.list.add((start + k) as usize) = *staged.add(k as usize) };
            k += PROCESS_THREADS;
        }
    }
}

/// Where a step reads a row's entries, from the raw row or the processed one.
trait EntrySource {
    /// Calls `f(i, logit)` for this thread's share of the entries of the raw row (`raw`) or
    /// the processed one.
    ///
    /// # Safety
    /// Every thread of the block calls it together; the rows behind it are readable.
    unsafe fn each(&self, raw: bool, f: impl FnMut(u32, f32));
}

/// A block's slice of a row, in both of the row's copies (raw, processed).
#[derive(Clone, Copy)]
struct SliceSource<'a> {
    slice: &'a Slice,
    rows: (*const f32, *const f32),
}

impl SliceSource<'_> {
    /// The item's slice of its row.
    fn of<'a>(item: &'a Item<'_>) -> SliceSource<'a> {
        let offset = item.slice.b as usize * item.args.logits_stride as usize;
        let rows = (item.args.raw.as_ptr().wrapping_add(offset), item.args.processed.as_ptr().wrapping_add(offset));
        SliceSource { slice: &item.slice, rows }
    }

    fn row(&self, raw: bool) -> *const f32 {
        if raw { self.rows.0 } else { self.rows.1 }
    }
}

impl EntrySource for SliceSource<'_> {
    #[inline(always)]
    unsafe fn each(&self, raw: bool, f: impl FnMut(u32, f32)) {
        // SAFETY: the slice's quads of a row of the logits (this function's contract).
        unsafe { self.slice.for_each(self.row(raw), f) }
    }
}

/// A row's gathered members ([`ProcessStep::Gather`]), read by one block: their column
/// indices in the list, or where there were more than `MEMBER_CAPACITY` the whole row.
#[derive(Clone, Copy)]
struct MemberSource<'a> {
    whole_row: SliceSource<'a>,
    /// The list and its length, when it holds every member.
    list: Option<(*const u32, u32)>,
}

impl EntrySource for MemberSource<'_> {
    #[inline(always)]
    unsafe fn each(&self, raw: bool, mut f: impl FnMut(u32, f32)) {
        let Some((list, count)) = self.list else {
            // SAFETY: the whole row's quads (this function's contract).
            return unsafe { self.whole_row.each(raw, f) };
        };
        let row = self.whole_row.row(raw);
        let mut k = self.whole_row.slice.thread;
        while k < count {
            // SAFETY: `k < count ≤ MEMBER_CAPACITY`: a listed column of the row.
            let (i, l) = unsafe {
                let i = *list.add(k as usize);
                (i, *row.add(i as usize))
            };
            f(i, l);
            k += PROCESS_THREADS;
        }
    }
}

/// Digit `args.digit` of `selection` for a row that runs it (and whose members still reach
/// its target). [`ProcessStep::Select`] on one slice adds the slice's histogram: to the row
/// state's, whose last slice to arrive then picks the digit, or for an exchanged selection
/// with an exchange to the exchange's, from which [`ProcessStep::Decide`] picks it once every
/// shard's histograms are in.
///
/// # Safety
/// As [`process_rows`], for `item`, after the row's earlier steps.
#[inline(always)]
unsafe fn select_digit(item: &Item, selection: Selection) {
    let Item { args, slice, state, .. } = item;
    let state = *state;
    // SAFETY: the row's state, written by earlier launches only while this one reads it.
    if !unsafe { runs(item, selection) } {
        return;
    }
    let exchanged = args.exchanges() && selection.exchanged();
    // The row's histogram: only accessed atomically while the slices add to it.
    let histogram = match exchanged {
        true => args.exchange_histogram.as_mut_ptr().wrapping_add(slice.b as usize * SELECT_BUCKETS as usize),
        // SAFETY: a field of the row's state.
        false => unsafe { addr_of_mut!((*state).histogram).cast::<u64>() },
    };
    // SAFETY: as above.
    let max = unsafe { truncation_max(item) }.unwrap_or(f32::NEG_INFINITY);
    if args.step == ProcessStep::Decide as u32 {
        if exchanged {
            // SAFETY: every thread of the block together; every shard's adds are in (this
            // function's contract), and other shards' decisions still read them.
            unsafe { decide_digit(item, selection, args.digit, max, histogram, false) };
        }
        return;
    }
    let entries = SliceSource::of(item);
    let add = AddHistogram { slice, entries, shift: digit_shift(args.digit), histogram, may_gather: true };
    // SAFETY: every thread of the block together (uniform conditions); the rows' logits,
    // padded to the stride; the row's histogram, as above.
    unsafe { visit_members(item, selection, args.digit, max, add) };
    // SAFETY: every thread together, once in this launch for this item.
    if !exchanged && unsafe { slice.arrive(state) } {
        // SAFETY: the last slice of the row: every other slice has added its histogram, which
        // no one reads after this decision.
        unsafe { decide_digit(item, selection, args.digit, max, histogram, true) };
    }
}

/// [`ProcessStep::Gather`] on one slice: lists the slice's members of `selection` after its
/// [`Selection::leading_digits`].
///
/// # Safety
/// As [`process_rows`], for `item`, after the selection's first digits.
#[inline(always)]
unsafe fn gather(item: &Item, selection: Selection) {
    // SAFETY: the row's state, written by earlier launches only.
    if !unsafe { runs(item, selection) } {
        return;
    }
    // SAFETY: as above.
    let max = unsafe { truncation_max(item) }.unwrap_or(f32::NEG_INFINITY);
    let Item { args, slice, state, .. } = item;
    let list = ListMembers {
        entries: SliceSource::of(item),
        list: args.members.as_mut_ptr().wrapping_add(slice.b as usize * MEMBER_CAPACITY as usize),
        // SAFETY: a field of the row's state.
        count: unsafe { addr_of_mut!((**state).members) },
    };
    let (_, resolved_from) = selection.leading_digits(args.exchanges());
    // SAFETY: the row's state as above; the slice's logits, the row's list and count.
    unsafe { visit_members(item, selection, resolved_from, max, list) };
}

/// [`ProcessStep::Resolve`] for one row: `selection`'s digits after its
/// [`Selection::leading_digits`], then its tie selection's, each a histogram of the gathered
/// members in the block's shared memory, decided as [`ProcessStep::Select`]'s last slice
/// decides; the member count set back to 0.
///
/// # Safety
/// As [`process_rows`] with one block for the row (`item.slice` its first slice), after the
/// selection's [`ProcessStep::Gather`].
#[inline(always)]
unsafe fn resolve(item: &Item, selection: Selection) {
    let Item { args, slice, state, .. } = item;
    let state = *state;
    // SAFETY: the row's state, written by earlier launches (then by this block's thread 0
    // between barriers).
    let count = unsafe { (*state).members };
    // The digits' histograms stay in the block's shared memory: no round trip through the
    // row's state per digit.
    // SAFETY: the field lies inside the block's shared memory.
    let histogram = unsafe { addr_of_mut!((*slice.shared).resolved) }.cast::<u64>();
    if slice.thread < SELECT_BUCKETS {
        // SAFETY: a bucket of the histogram, this thread's alone until the barrier below.
        unsafe { *histogram.add(slice.thread as usize) = 0 };
    }
    // SAFETY: every thread of the block reaches it (this function's contract).
    unsafe { arch::sync_threads() };
    let whole_row = Slice::whole_row(args, slice.shared, slice.b);
    let list = args.members.as_ptr().wrapping_add(slice.b as usize * MEMBER_CAPACITY as usize);
    let entries = MemberSource {
        whole_row: SliceSource { slice: &whole_row, ..SliceSource::of(item) },
        list: (count <= MEMBER_CAPACITY).then_some((list, count)),
    };
    // SAFETY: the row's extrema, written by earlier launches only.
    let max = unsafe { truncation_max(item) }.unwrap_or(f32::NEG_INFINITY);
    // The selection's remaining digits, then its tie selection's.
    for part in 0..2 {
        let (s, first) = match (part, selection.tie()) {
            (0, _) => (selection, selection.leading_digits(args.exchanges()).1),
            (_, Some(tie)) => (tie, 0),
            (_, None) => break,
        };
        for digit in first..SELECT_DIGITS {
            // SAFETY: the row's state: thread 0's writes are behind the barrier that ends the
            // previous digit. Every thread reads the same words, so the loop stays uniform.
            if !unsafe { runs(item, s) } || unsafe { (*state).found } & s.bit() != 0 {
                break;
            }
            // Its digits are past the leading one: no gathering.
            let shift = digit_shift(digit);
            let add = AddHistogram { slice: &whole_row, entries, shift, histogram, may_gather: false };
            // SAFETY: every thread of the block together; the members' rows; the block's
            // histogram, cleared by each decision for the next digit.
            unsafe {
                visit_members(item, s, digit, max, add);
                arch::sync_threads();
                decide_digit(item, s, digit, max, histogram, true);
                arch::sync_threads();
            }
        }
    }
    if slice.thread == 0 {
        // SAFETY: the row's state; every thread read the count above, before the barriers.
        unsafe { (*state).members = 0 };
    }
}

/// The digit the row's `histogram` picks for `selection` (by the row's last slice to arrive,
/// or by the row's block of [`ProcessStep::Decide`]): the largest bucket whose entries at or
/// above it reach the target (computed from the total at the selection's leading digit, its
/// coarse key or digit 0; a selection whose total falls short ends there); after the last
/// digit the selection's outcome. The block loads the
/// buckets at once (clearing them for the next launch if `clear`) and finds the bucket by a
/// prefix sum over them from the top, so that the decision costs one round trip to memory,
/// not one per bucket. A top-p or top-raw selection whose last bucket's tied entries are all
/// kept ends its tie selection there (the cut needs no index).
///
/// # Safety
/// Every thread of the block calls it together, once every add to the row's `histogram`
/// (`SELECT_BUCKETS` words) is visible to the block.
#[inline(always)]
unsafe fn decide_digit(item: &Item, selection: Selection, digit: u32, max: f32, histogram: *mut u64, clear: bool) {
    let Item { args, slice, params, p, state } = item;
    let state = *state;
    let t = slice.thread as usize;
    let top = SELECT_BUCKETS as usize - 1;
    let leading = digit == COARSE_DIGIT || digit == 0 && !selection.coarse(args.exchanges());
    // SAFETY: the fields lie inside the block's shared memory.
    let (sums, decision) = unsafe {
        (addr_of_mut!((*slice.shared).buckets) as *mut u64, addr_of_mut!((*slice.shared).decision) as *mut u64)
    };
    if t <= top {
        // SAFETY: bucket `top - t` of the row's histogram, this thread's alone: the other
        // slices' adds are visible (this function's contract) and read from where they were
        // made, not from this multiprocessor's cache.
        unsafe {
            *sums.add(t) = read_volatile(histogram.add(top - t));
            if clear {
                *histogram.add(top - t) = 0;
            }
        }
    }
    // `sums[t]` becomes the weight of buckets `top - t ..= top` (an inclusive prefix sum).
    let mut offset = 1;
    while offset <= top {
        // SAFETY: every thread of the block reaches both barriers (uniform loop); between them
        // the sums are only read, after the second only `sums[t]` is written, by thread `t`.
        unsafe {
            arch::sync_threads();
            let add = if t <= top && t >= offset { *sums.add(t - offset) } else { 0 };
            arch::sync_threads();
            if t <= top {
                *sums.add(t) += add;
            }
        }
        offset <<= 1;
    }
    // SAFETY: as above.
    unsafe { arch::sync_threads() };
    if t == 0 {
        // SAFETY: the row's state, written by this thread alone until the launch ends; the
        // decision words, read by the block after the barrier below.
        unsafe {
            let s = &mut *state;
            if leading {
                let total = *sums.add(top);
                s.target = match selection {
                    Selection::TopK => p.top_k as u64,
                    Selection::TopP => top_p_target(total, p.top_p),
                    Selection::TopPTie | Selection::TopRawTie => s.tie_goal,
                    Selection::TopRaw => p.top_logprobs as u64,
                };
                (s.above, s.prefix) = (0, 0);
                if total < s.target {
                    s.ended |= selection.bit();
                }
            }
            *decision = (s.ended & selection.bit() == 0) as u64;
            (*decision.add(1), *decision.add(2)) = (s.above, s.target);
            (*decision.add(3), *decision.add(4)) = (0, s.above);
            s.arrivals = 0;
        }
    }
    // SAFETY: every thread of the block reaches it.
    unsafe { arch::sync_threads() };
    // SAFETY: written by thread 0 before the barrier above.
    let (running, above, goal) = unsafe { (*decision != 0, *decision.add(1), *decision.add(2)) };
    if running && t <= top {
        // While the running selection's weight above its prefix is short of the goal (and
        // its members reach it), exactly one bucket takes the weight across the goal.
        // SAFETY: the prefix sums, final since the barriers above.
        let (before, through) = unsafe { (if t == 0 { 0 } else { *sums.add(t - 1) }, *sums.add(t)) };
        if above + before < goal && above + through >= goal {
            // SAFETY: written by this thread alone, read after the barrier below.
            unsafe { (*decision.add(3), *decision.add(4)) = ((top - t) as u64, above + before) };
        }
    }
    // SAFETY: every thread of the block reaches it.
    unsafe { arch::sync_threads() };
    if t == 0 && running {
        // SAFETY: the row's state, as above; the decision, written before the barrier above;
        // the prefix sums, final since the barriers above.
        unsafe {
            let s = &mut *state;
            let (chosen, above) = (*decision.add(3) as u32, *decision.add(4));
            s.above = above;
            // After the coarse key the key's digits run over the entries of the chosen one.
            let key = s.prefix | chosen << digit_shift(digit);
            match digit {
                COARSE_DIGIT => s.coarse = chosen,
                _ => s.prefix = key,
            }
            if digit + 1 == SELECT_DIGITS {
                s.found |= selection.bit();
                s.keys[selection as usize] = match selection {
                    Selection::TopPTie | Selection::TopRawTie => !key,
                    Selection::TopK | Selection::TopP | Selection::TopRaw => key,
                };
                // The chosen bucket's weight: its entries share the key, so it counts them.
                let at = top - chosen as usize;
                let weight = *sums.add(at) - if at == 0 { 0 } else { *sums.add(at - 1) };
                // Where the tie selection would keep every tied entry, the cut needs no index
                // and its launches have nothing to do.
                if selection == Selection::TopP {
                    // Entries tied at the last key weigh the same: the prefix ends at the n-th
                    // of them by index.
                    let position = coarse_position(key_logit(key), max, coarse_scale(params.temperature));
                    let units = top_p_units(position, bucket_units(item.slice.shared)).max(1);
                    s.tie_goal = (goal - above).div_ceil(units);
                    if s.tie_goal >= weight / units {
                        s.ended |= Selection::TopPTie.bit();
                    }
                } else if selection == Selection::TopRaw {
                    // Entries tied at the last key: the first by index fill the rest.
                    s.tie_goal = goal - above;
                    if s.tie_goal >= weight {
                        s.ended |= Selection::TopRawTie.bit();
                    }
                }
            }
        }
    }
}

/// [`ProcessStep::Apply`] on one slice: the keep rule (dropped entries set to −∞), the
/// slice's kept terms, the row's top raw entries in the slice; the row's last slice writes the
/// row's top entries in order.
///
/// # Safety
/// As [`process_rows`], for `item`, after the row's selections.
#[inline(always)]
unsafe fn apply(item: &Item) {
    let Item { args, slice, params, p, state } = item;
    let state = *state;
    let log_sums = args.slice_sums.address() != 0;
    let top_asked = log_sums && args.top.address() != 0;
    let sampling = params.greedy == 0;
    // SAFETY: the row's state and extrema, written by earlier launches only.
    let rule = unsafe { applied_rule(truncation_max(item), params, p, state) };
    let offset = slice.b as usize * args.logits_stride as usize;
    let processed = args.processed.as_mut_ptr().wrapping_add(offset);
    let mut kept = LogSumExp::EMPTY;
    let drop = |i: u32, l: f32| {
        if !rule.keeps(l, args.vocab_offset + i) {
            return (f32::NEG_INFINITY, true);
        }
        if sampling && log_sums {
            kept.add(l, params.temperature);
        }
        (l, false)
    };
    // A greedy row keeps every entry and sums no kept terms: its slice is left as it is.
    if (sampling && log_sums) || rule != KeepRule::ALL {
        // SAFETY: the row's processed logits, padded to the stride; the slice is this block's.
        unsafe { slice.map(processed, processed, drop) };
    }
    if top_asked && p.top_logprobs > 0 {
        // SAFETY: the row's state, as above.
        let (found, keys) = unsafe { ((*state).found, (*state).keys) };
        let cut = match found & Selection::TopRaw.bit() {
            0 => (0, u32::MAX),
            _ => {
                let index = match found & Selection::TopRawTie.bit() {
                    0 => u32::MAX,
                    _ => keys[Selection::TopRawTie as usize],
                };
                (keys[Selection::TopRaw as usize], index)
            }
        };
        // SAFETY: the row's gathered entries: a count only accessed atomically during the
        // launch, and the slots it hands out.
        let (count, top) = unsafe { (addr_of_mut!((*state).top_count), addr_of_mut!((*state).top) as *mut RawTop) };
        let gather = |i: u32, l: f32| {
            let key = order_key(l);
            if key > cut.0 || (key == cut.0 && i <= cut.1) {
                // SAFETY: as above.
                let slot = unsafe { AtomicU32::from_ptr(count) }.fetch_add(1, Ordering::Relaxed);
                if slot < MAX_TOP_LOGPROBS {
                    // SAFETY: `slot < MAX_TOP_LOGPROBS`: a slot of the row's state, this thread's.
                    unsafe { *top.add(slot as usize) = RawTop { token: args.vocab_offset + i, logit: l } };
                }
            }
        };
        // SAFETY: the row's raw logits, padded to the stride.
        unsafe { slice.for_each(args.raw.as_ptr().wrapping_add(offset), gather) };
    }
    if log_sums {
        // SAFETY: every thread together (uniform condition).
        let lse = unsafe { slice.merge_lse(kept, params.temperature) };
        if slice.thread == 0 {
            // SAFETY: item `(b, index)` of the `[batch, slices]` terms.
            unsafe { (*args.slice_sums.as_mut_ptr().add(slice_slot(slice))).kept = lse };
        }
    }
    // SAFETY: every thread together, once in this launch for this item.
    if top_asked && unsafe { slice.arrive(state) } && slice.thread == 0 {
        // SAFETY: the last slice of the row: every slice's entries are visible.
        unsafe { write_top(item) };
    }
}

/// Writes `args.top[b]`: the row's `n` gathered raw entries (its `top_logprobs`) by
/// (`order_key`, then increasing index), then `NO_TOKEN` slots up to `MAX_TOP_LOGPROBS`;
/// clears the arrivals.
///
/// # Safety
/// Thread 0 of the row's last slice in [`ProcessStep::Apply`]; `args.top` holds row `b`'s slots.
#[inline(always)]
unsafe fn write_top(item: &Item) {
    let Item { args, slice, p, state, .. } = item;
    let (n, state) = (p.top_logprobs, *state);
    // The block's buckets are free: the entries are sorted there.
    // SAFETY: the buckets hold `SELECT_BUCKETS · 8` bytes, more than `MAX_TOP_LOGPROBS`
    // entries.
    let sorted = unsafe { addr_of_mut!((*slice.shared).buckets) } as *mut RawTop;
    // SAFETY: the row's gathered entries, read from where the other slices wrote them.
    let found = unsafe { read_volatile(addr_of_mut!((*state).top_count)) }.min(n).min(MAX_TOP_LOGPROBS) as usize;
    // SAFETY: the row's state and the block's buckets, this thread's alone here.
    unsafe {
        let gathered = addr_of_mut!((*state).top) as *const RawTop;
        for k in 0..found {
            *sorted.add(k) = read_volatile(gathered.add(k));
        }
        (*state).arrivals = 0;
        // Insertion sort of at most MAX_TOP_LOGPROBS entries, by key then index.
        let before = |x: usize, y: usize| {
            let (ex, ey) = (*sorted.add(x), *sorted.add(y));
            let (kx, ky) = (order_key(ex.logit), order_key(ey.logit));
            kx > ky || (kx == ky && ex.token < ey.token)
        };
        for k in 1..found {
            let mut j = k;
            while j > 0 && before(j, j - 1) {
                core::ptr::swap(sorted.add(j), sorted.add(j - 1));
                j -= 1;
            }
        }
        let out = args.top.as_mut_ptr().add(slice.b as usize * MAX_TOP_LOGPROBS as usize);
        for k in 0..MAX_TOP_LOGPROBS as usize {
            *out.add(k) = if k < found { *sorted.add(k) } else { RawTop { token: NO_TOKEN, logit: f32::NEG_INFINITY } };
        }
    }
}

/// The shard merge (see `ShardMergeArgs`): one thread per (row, draw) merges the shards'
/// winners and, with log-probabilities, the row's log-sum-exp terms in shard order; the
/// thread of a row's first draw also merges its top raw entries.
///
/// # Safety
/// `args` describes valid buffers: `shards` parts of `part_bytes` each (16-byte aligned), laid
/// out as `ShardPartLayout::of(batch, samples, logprobs)` with log-probabilities when
/// `args.logprobs` is not null; `[batch]` row parameters (and processing blocks, if not null);
/// `[batch, samples]` tokens and log-probabilities; `[batch, MAX_TOP_LOGPROBS]` top slots.
#[inline(always)]
pub unsafe fn merge_shards(args: &ShardMergeArgs) {
    let (mut k, step) = arch::global_thread();
    let slots = args.batch as u64 * args.samples as u64;
    let logprobs = args.logprobs.address() != 0;
    let part = |s: u32| args.parts.as_ptr().wrapping_add(s as usize * args.part_bytes as usize);
    while k < slots {
        let b = (k / args.samples as u64) as usize;
        // SAFETY: `b < batch`.
        let params = unsafe { *args.row_params.as_ptr().add(b) };
        let mut best = ShardWinner::NONE;
        let mut sums = RowSums { raw: LogSumExp::EMPTY, kept: LogSumExp::EMPTY };
        for s in 0..args.shards {
            // SAFETY: shard `s`'s part holds `batch · samples` winners and (with log-probabilities)
            // `batch` row sums at `part_sums`.
            unsafe {
                best = best.merge(*(part(s) as *const ShardWinner).add(k as usize));
                if logprobs {
                    let terms = *(part(s).add(args.part_sums as usize) as *const RowSums).add(b);
                    sums.raw.merge_with(terms.raw, 1.0);
                    sums.kept.merge_with(terms.kept, params.temperature);
                }
            }
        }
        let token = best.candidate.index;
        let logits = (token < NON_FINITE_TOKEN).then_some((best.raw, best.processed));
        let outputs = TokenOutputs { tokens: args.tokens, logprobs: args.logprobs, processed: args.processed_logprobs };
        // SAFETY: `k < batch · samples`: inside the outputs.
        unsafe { outputs.write(k as usize, token, logits, &sums, &params) };
        if logprobs && k % args.samples as u64 == 0 && args.top.address() != 0 {
            // SAFETY: as this function's contract, for row `b`.
            unsafe { merge_top(args, b, &sums.raw) };
        }
        k += step;
    }
}

/// Where a call's tokens and their log-probabilities go (`[batch, samples]` each; the
/// log-probabilities null for none).
pub struct TokenOutputs {
    pub tokens: DevicePtr<u32>,
    pub logprobs: DevicePtr<f32>,
    pub processed: DevicePtr<f32>,
}

impl TokenOutputs {
    /// Writes slot `k`'s token and, with log-probabilities, both of them from the token's
    /// (raw, processed) logits (`None` for no token) and its row's merged terms.
    ///
    /// # Safety
    /// `k` is a slot of the outputs.
    #[inline(always)]
    pub unsafe fn write(&self, k: usize, token: u32, logits: Option<(f32, f32)>, sums: &RowSums, row: &RowParams) {
        // SAFETY: slot `k` of the tokens (this function's contract).
        unsafe { *self.tokens.as_mut_ptr().add(k) = token };
        if self.logprobs.address() != 0 {
            let greedy = row.greedy != 0;
            let (raw, processed) =
                token_log_probabilities(token, logits, &sums.raw, &sums.kept, greedy, row.temperature);
            // SAFETY: slot `k` of both log-probabilities.
            unsafe {
                *self.logprobs.as_mut_ptr().add(k) = raw;
                *self.processed.as_mut_ptr().add(k) = processed;
            }
        }
    }
}

/// Writes row `b`'s top raw log-probabilities: the best `n` (the row's count) of all shards'
/// top entries by decreasing `order_key`, then increasing index, then `NO_TOKEN` slots.
///
/// # Safety
/// As [`merge_shards`], for row `b`.
#[inline(always)]
unsafe fn merge_top(args: &ShardMergeArgs, b: usize, raw: &LogSumExp) {
    let n = if args.processing.address() == 0 {
        0
    } else {
        // SAFETY: `b < batch`: a row of the processing blocks.
        unsafe { (*args.processing.as_ptr().add(b)).top_logprobs.min(MAX_TOP_LOGPROBS) }
    };
    // An entry's rank: larger comes first; distinct for distinct tokens.
    let rank = |e: &RawTop| ((order_key(e.logit) as u64) << 32) | !e.token as u64;
    let out = args.top.as_mut_ptr().wrapping_add(b * MAX_TOP_LOGPROBS as usize);
    let mut previous: Option<u64> = None;
    for slot in 0..MAX_TOP_LOGPROBS as usize {
        let mut next: Option<(u64, RawTop)> = None;
        if (slot as u32) < n {
            for s in 0..args.shards {
                let tops =
                    args.parts.as_ptr().wrapping_add(s as usize * args.part_bytes as usize + args.part_top as usize)
                        as *const RawTop;
                for t in 0..MAX_TOP_LOGPROBS as usize {
                    // SAFETY: shard `s`'s `[batch, MAX_TOP_LOGPROBS]` top entries.
                    let entry = unsafe { *tops.add(b * MAX_TOP_LOGPROBS as usize + t) };
                    let r = rank(&entry);
                    if entry.token != NO_TOKEN && previous.is_none_or(|p| r < p) && next.is_none_or(|(q, _)| r > q) {
                        next = Some((r, entry));
                    }
                }
            }
        }
        let written = match next {
            Some((r, entry)) => {
                previous = Some(r);
                TopLogprob { token: entry.token, logprob: raw.log_probability(entry.logit, 1.0) }
            }
            None => TopLogprob::NONE,
        };
        // SAFETY: row `b`'s slots.
        unsafe { *out.add(slot) = written };
    }
}
