//! Logit processing over materialised rows: one block per row applies the per-entry steps of
//! `flashsample_core::process`, decides min-p, top-k and top-p exactly, writes the logits
//! the row races with and its log-sum-exp terms; the shard merge turns the winners and terms
//! of one or more vocabulary shards into tokens and log-probabilities.
//!
//! top-k and top-p are order statistics of the whole row. Each is found by a radix selection
//! over [`order_key`] (four 8-bit digits, most significant first): per digit a histogram of
//! the entries still in play, whose weights are counts (top-k) or top-p's integer masses
//! ([`top_p_units`]). Integer sums do not depend on the order the threads add them in, so the
//! cut is the same on every launch and the same as the CPU's, which sorts.

use core::ptr::addr_of_mut;
use core::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use flashsample_core::abi::{
    DevicePtr, PROCESS_THREADS, ProcessArgs, RawTop, RowProcessing, RowSums, SELECT_BUCKETS, ShardMergeArgs,
    ShardWinner, TopLogprob,
};
use flashsample_core::process::{
    KeepRule, LogSumExp, MAX_TOP_LOGPROBS, Penalties, SPARSE_BLOCK, SparseEntry, dense_step, key_logit,
    min_p_threshold, order_key, process_quad, sparse_step, token_log_probabilities, top_p_target, top_p_units,
};
use flashsample_core::{NO_TOKEN, NON_FINITE_TOKEN};

use crate::arch;

const WARPS: usize = (PROCESS_THREADS / 32) as usize;

/// The processing kernel's shared memory (`PROCESS_SHARED_BYTES`).
#[repr(C)]
pub struct ProcessShared {
    buckets: [u64; SELECT_BUCKETS as usize],
    warp_raw: [LogSumExp; WARPS],
    warp_kept: [LogSumExp; WARPS],
    warp_max: [f32; WARPS],
    warp_non_finite: [u32; WARPS],
    /// A selection digit's outcome, from thread 0 to the block: the key prefix, the weight
    /// above it, the target, and whether the set reached the target.
    selection: [u64; 4],
    /// The row's top raw entries as they are gathered: their count, indices and logits.
    top_count: u32,
    top_padding: u32,
    top_index: [u32; MAX_TOP_LOGPROBS as usize],
    top_logit: [f32; MAX_TOP_LOGPROBS as usize],
}

/// A selection's result: the largest key `K` whose entries at or above it reach the target,
/// the weight of the entries above `K`, and the target.
#[derive(Clone, Copy)]
struct Selected {
    key: u32,
    above: u64,
    target: u64,
}

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

/// Calls `f(i, logit)` for this thread's entries `i < vocab` of the row at `row`: quads
/// `thread, thread + PROCESS_THREADS, …`, two of them loaded before either is used, so that
/// one block per row keeps enough loads in flight.
///
/// # Safety
/// `row` is 16-byte aligned and readable up to `vocab` rounded up to a multiple of 4.
#[inline(always)]
unsafe fn for_each_entry(row: *const f32, vocab: u32, thread: u32, mut f: impl FnMut(u32, f32)) {
    let quads = vocab.div_ceil(4);
    let load = |q: u32| {
        if q < quads {
            // SAFETY: `q < ⌈vocab / 4⌉`: a whole aligned quad of the row (this function's
            // contract).
            unsafe { *(row.add(4 * q as usize) as *const Quad) }
        } else {
            Quad([f32::NEG_INFINITY; 4])
        }
    };
    // Scalars, not an indexed array: an array indexed in a loop the compiler leaves rolled
    // goes to the stack.
    let mut visit = |q: u32, Quad([l0, l1, l2, l3]): Quad| {
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
    let mut first = thread;
    while first < quads {
        let second = first + PROCESS_THREADS;
        let (a, b) = (load(first), load(second));
        visit(first, a);
        visit(second, b);
        first += 2 * PROCESS_THREADS;
    }
}

/// The block's view of one row.
struct Row {
    shared: *mut ProcessShared,
    /// The row's logits the selections read (processed, or raw for the top log-probabilities).
    logits: *const f32,
    vocab: u32,
    thread: u32,
}

impl Row {
    /// The largest key `K` such that the entries with `member(i) = Some((key, logit))` and
    /// `key ≥ K` weigh at least `target(total)` (`total` the weight of all members), with
    /// `weight(logit)` per entry; `None` when all members weigh less.
    ///
    /// # Safety
    /// Every thread of the block calls it together; the row is not written meanwhile.
    #[inline(always)]
    unsafe fn select(
        &self,
        member: impl Fn(u32, f32) -> Option<u32>,
        weight: impl Fn(f32) -> u64,
        target: impl Fn(u64) -> u64,
    ) -> Option<Selected> {
        // SAFETY: the fields lie inside the block's shared memory (`PROCESS_SHARED_BYTES`).
        let buckets = unsafe { addr_of_mut!((*self.shared).buckets) } as *mut u64;
        // SAFETY: as above.
        let selection = unsafe { addr_of_mut!((*self.shared).selection) } as *mut u64;
        let mut prefix = 0u32;
        for digit in 0..4u32 {
            let shift = 24 - 8 * digit;
            if self.thread < SELECT_BUCKETS {
                // SAFETY: `thread < SELECT_BUCKETS`: one bucket.
                unsafe { *buckets.add(self.thread as usize) = 0 };
            }
            // SAFETY: every thread of the block reaches it (this function's contract, uniform
            // loop).
            unsafe { arch::sync_threads() };
            // A thread's consecutive members mostly share a bucket (the leading digits most
            // of all): it adds runs, not entries, to keep the shared atomics uncontended.
            let add = |bucket: u32, weight: u64| {
                if weight > 0 {
                    // SAFETY: a bucket of the shared histogram, only accessed atomically until
                    // the barrier below.
                    unsafe { AtomicU64::from_ptr(buckets.add(bucket as usize)) }.fetch_add(weight, Ordering::Relaxed);
                }
            };
            let (mut run_bucket, mut run_weight) = (0u32, 0u64);
            // SAFETY: the row's processed logits, padded to the stride.
            unsafe {
                for_each_entry(self.logits, self.vocab, self.thread, |i, l| {
                    if let Some(key) = member(i, l)
                        && (digit == 0 || (key ^ prefix) >> (shift + 8) == 0)
                    {
                        let bucket = (key >> shift) & (SELECT_BUCKETS - 1);
                        if bucket != run_bucket {
                            add(run_bucket, run_weight);
                            (run_bucket, run_weight) = (bucket, 0);
                        }
                        run_weight += weight(l);
                    }
                })
            };
            add(run_bucket, run_weight);
            // SAFETY: as above.
            unsafe { arch::sync_threads() };
            if self.thread == 0 {
                // SAFETY: the selection words and buckets, read and written by thread 0 alone
                // between two barriers.
                unsafe {
                    if digit == 0 {
                        let mut total = 0u64;
                        for d in 0..SELECT_BUCKETS as usize {
                            total += *buckets.add(d);
                        }
                        *selection.add(1) = 0;
                        *selection.add(2) = target(total);
                        *selection.add(3) = (total >= target(total)) as u64;
                    }
                    let (mut above, goal) = (*selection.add(1), *selection.add(2));
                    let mut chosen = 0u32;
                    let mut d = SELECT_BUCKETS;
                    while d > 0 {
                        d -= 1;
                        let here = *buckets.add(d as usize);
                        if above + here >= goal {
                            chosen = d;
                            break;
                        }
                        above += here;
                    }
                    *selection = (prefix | chosen << shift) as u64;
                    *selection.add(1) = above;
                }
            }
            // SAFETY: as above.
            unsafe { arch::sync_threads() };
            // SAFETY: written by thread 0 before the barrier; rewritten only after the next
            // digit's two barriers.
            let (found, key) = unsafe { (*selection.add(3), *selection as u32) };
            if found == 0 {
                return None;
            }
            prefix = key;
        }
        // SAFETY: as above.
        let (above, target) = unsafe { (*selection.add(1), *selection.add(2)) };
        Some(Selected { key: prefix, above, target })
    }

    /// The block's largest entry and whether any entry is NaN or +∞.
    ///
    /// # Safety
    /// Every thread of the block calls it together.
    #[inline(always)]
    unsafe fn max_and_non_finite(&self) -> (f32, bool) {
        let mut max = f32::NEG_INFINITY;
        let mut non_finite = false;
        // SAFETY: the row's processed logits, padded to the stride.
        unsafe {
            for_each_entry(self.logits, self.vocab, self.thread, |_, l| {
                max = if l > max { l } else { max };
                non_finite |= l.is_nan() || l == f32::INFINITY;
            })
        };
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
}

/// Merges a log-sum-exp pair over the warp's lanes.
///
/// # Safety
/// All 32 lanes call it together.
#[inline(always)]
pub(crate) unsafe fn merge_lse_over_warp(mut lse: LogSumExp, temperature: f32) -> LogSumExp {
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

/// The row's keep rule (min-p, then top-k, then top-p), for a sampling row whose processed
/// logits are finite or −∞ with largest `max`.
///
/// # Safety
/// Every thread of the block calls it together.
#[inline(always)]
unsafe fn keep_rule(row: &Row, max: f32, temperature: f32, p: &flashsample_core::abi::RowProcessing) -> KeepRule {
    let min_cut = min_p_threshold(max, temperature, p.min_p);
    let mut rule = KeepRule { min_cut, ..KeepRule::ALL };
    let kept = |rule: KeepRule| move |i: u32, l: f32| (l > f32::NEG_INFINITY && rule.keeps(l, i)).then(|| order_key(l));
    if p.top_k > 0 {
        let k = p.top_k as u64;
        // SAFETY: every thread together (this function's contract).
        if let Some(kth) = unsafe { row.select(kept(rule), |_| 1, |_| k) } {
            rule.order_cut = (key_logit(kth.key), u32::MAX);
        }
    }
    if p.top_p < 1.0 {
        let units = |l: f32| top_p_units(l, max, temperature);
        let members = kept(rule);
        // SAFETY: as above.
        if let Some(last) = unsafe { row.select(members, units, |total| top_p_target(total, p.top_p)) } {
            // Entries tied at the last key weigh the same: the prefix ends at the n-th of them
            // by index.
            let n = (last.target - last.above).div_ceil(units(key_logit(last.key)).max(1));
            let ties = |i: u32, l: f32| members(i, l).filter(|&key| key == last.key).map(|_| !i);
            // SAFETY: as above.
            let index = unsafe { row.select(ties, |_| 1, |_| n) }.map_or(u32::MAX, |tie| !tie.key);
            rule.order_cut = (key_logit(last.key), index);
        }
    }
    rule
}

/// The processing kernel (see `ProcessArgs`): per row, the dense and sparse steps, the keep
/// rule, the kept logits and the row's log-sum-exp terms.
///
/// # Safety
/// Launched with `PROCESS_THREADS` threads and `PROCESS_SHARED_BYTES` of shared memory;
/// `args` describes valid buffers; each row's sparse tokens are distinct, its mask (if any)
/// holds a word for each of the global indices `vocab_offset .. vocab_offset + vocab`; rows
/// with truncations only when the logits are the whole vocabulary (`vocab_offset = 0`).
#[inline(always)]
pub unsafe fn process_rows(args: &ProcessArgs, shared: *mut ProcessShared) {
    let thread = arch::thread_index();
    // Without log-probabilities no log-sum-exp is summed; in place (`raw == processed`) the
    // raw logits are overwritten.
    let log_sums = !args.sums.as_ptr().is_null();
    let in_place = args.raw == args.processed;
    let mut b = arch::block_index();
    while b < args.batch {
        // SAFETY: `b < batch`: a row of the `[batch]` parameters.
        let (params, p) =
            unsafe { (*args.row_params.as_ptr().add(b as usize), *args.processing.as_ptr().add(b as usize)) };
        let offset = b as usize * args.logits_stride as usize;
        let raw = args.raw.as_ptr().wrapping_add(offset);
        let processed = args.processed.as_mut_ptr().wrapping_add(offset);
        let row = Row { shared, logits: processed, vocab: args.vocab, thread };
        let mask = p.mask.as_ptr();
        let mut raw_lse = LogSumExp::EMPTY;
        let dense = |i: u32, l: f32| {
            let index = args.vocab_offset + i;
            // SAFETY: `i < vocab`: inside the mask's words and row `b` of the processed logits.
            let allowed = mask.is_null() || unsafe { *mask.add(index as usize / 32) >> (index % 32) } & 1 == 1;
            if log_sums {
                raw_lse.add(l, 1.0);
            }
            // SAFETY: as above.
            unsafe { *processed.add(i as usize) = dense_step(l, p.softcap, allowed) };
        };
        // In place, a row without soft-cap or mask is already what the dense steps make.
        if log_sums || !in_place || p.softcap > 0.0 || !mask.is_null() {
            // SAFETY: row `b` of the raw logits, padded to the stride (a multiple of 4).
            unsafe { for_each_entry(raw, args.vocab, thread, dense) };
        }
        // The row's padding up to the stride: the logits sampler loads whole quads.
        if thread < args.logits_stride - args.vocab {
            // SAFETY: `vocab + thread < logits_stride`: inside row `b`.
            unsafe { *processed.add((args.vocab + thread) as usize) = f32::NEG_INFINITY };
        }
        // SAFETY: every thread of the block reaches it (uniform loops).
        unsafe { arch::sync_threads() };
        let mut e = thread;
        while e < p.sparse_len {
            // SAFETY: `e < sparse_len`.
            let entry = unsafe { *p.sparse.as_ptr().add(e as usize) };
            // Entries of other shards wrap past `vocab`.
            let column = entry.token.wrapping_sub(args.vocab_offset);
            if column < args.vocab {
                // SAFETY: `column < vocab`: inside the row; the token is listed once (this
                // function's contract), so no two threads touch one logit.
                unsafe {
                    let at = processed.add(column as usize);
                    *at = sparse_step(*at, &entry, &p.penalties);
                }
            }
            e += PROCESS_THREADS;
        }
        // SAFETY: as above.
        unsafe { arch::sync_threads() };
        let sampling = params.greedy == 0;
        let mut rule = KeepRule::ALL;
        if sampling && (p.min_p > 0.0 || p.top_k > 0 || p.top_p < 1.0) {
            // SAFETY: every thread together (uniform condition: one row per block).
            let (max, non_finite) = unsafe { row.max_and_non_finite() };
            if !non_finite && max > f32::NEG_INFINITY {
                // SAFETY: as above.
                rule = unsafe { keep_rule(&row, max, params.temperature, &p) };
            }
        }
        let mut kept = LogSumExp::EMPTY;
        let apply = |i: u32, l: f32| {
            if !rule.keeps(l, i) {
                // SAFETY: `i < vocab`: inside the row; only this thread touches entry `i`.
                unsafe { *processed.add(i as usize) = f32::NEG_INFINITY };
            } else if sampling && log_sums {
                kept.add(l, params.temperature);
            }
        };
        if log_sums || rule != KeepRule::ALL {
            // SAFETY: the row's processed logits, padded to the stride.
            unsafe { for_each_entry(processed, args.vocab, thread, apply) };
        }
        if log_sums {
            // SAFETY: every thread of the block together (a uniform condition).
            unsafe { write_sums(args, shared, b, raw_lse, kept, params.temperature) };
            if args.top.address() != 0 {
                let raw_row = Row { shared, logits: raw, vocab: args.vocab, thread };
                // SAFETY: as above.
                unsafe { write_top(args, &raw_row, b, p.top_logprobs) };
            }
        }
        // SAFETY: every thread of the block reaches it; the next row reuses the shared memory.
        unsafe { arch::sync_threads() };
        b += arch::grid_size();
    }
}

/// Writes `args.top[b]`: the row's `n` largest raw logits by (`order_key`, then increasing
/// index) with their global indices, then `NO_TOKEN` slots up to `MAX_TOP_LOGPROBS`.
///
/// # Safety
/// Every thread of the block calls it together; `raw` views row `b`'s raw logits; `args.top`
/// holds row `b`'s slots.
#[inline(always)]
unsafe fn write_top(args: &ProcessArgs, raw: &Row, b: u32, n: u32) {
    let shared = raw.shared;
    // SAFETY: the fields lie inside the block's shared memory.
    let (count, indices, logits) = unsafe {
        (
            addr_of_mut!((*shared).top_count),
            addr_of_mut!((*shared).top_index) as *mut u32,
            addr_of_mut!((*shared).top_logit) as *mut f32,
        )
    };
    let mut cut = (0u32, u32::MAX);
    if n > 0 {
        let all = |_: u32, l: f32| Some(order_key(l));
        // SAFETY: every thread together (this function's contract).
        if let Some(last) = unsafe { raw.select(all, |_| 1, |_| n as u64) } {
            // Entries tied at the last key: the first by index fill the rest.
            let ties = |i: u32, l: f32| (order_key(l) == last.key).then_some(!i);
            let wanted = n as u64 - last.above;
            // SAFETY: as above.
            let index = unsafe { raw.select(ties, |_| 1, |_| wanted) }.map_or(u32::MAX, |tie| !tie.key);
            cut = (last.key, index);
        }
    }
    if raw.thread == 0 {
        // SAFETY: read only after the barrier below.
        unsafe { *count = 0 };
    }
    // SAFETY: every thread of the block reaches it.
    unsafe { arch::sync_threads() };
    if n > 0 {
        let gather = |i: u32, l: f32| {
            let key = order_key(l);
            if key > cut.0 || (key == cut.0 && i <= cut.1) {
                // SAFETY: the shared count, only accessed atomically until the barrier below.
                let slot = unsafe { AtomicU32::from_ptr(count) }.fetch_add(1, Ordering::Relaxed);
                if slot < MAX_TOP_LOGPROBS {
                    // SAFETY: `slot < MAX_TOP_LOGPROBS`: a slot of the shared lists.
                    unsafe { (*indices.add(slot as usize), *logits.add(slot as usize)) = (args.vocab_offset + i, l) };
                }
            }
        };
        // SAFETY: the row's raw logits, padded to the stride.
        unsafe { for_each_entry(raw.logits, raw.vocab, raw.thread, gather) };
    }
    // SAFETY: every thread of the block reaches it.
    unsafe { arch::sync_threads() };
    if raw.thread == 0 {
        // SAFETY: written before the barrier above; the sums by this thread.
        unsafe {
            let found = (*count).min(n).min(MAX_TOP_LOGPROBS) as usize;
            // Insertion sort of at most MAX_TOP_LOGPROBS entries, by key then index.
            let before = |x: usize, y: usize| {
                let (kx, ky) = (order_key(*logits.add(x)), order_key(*logits.add(y)));
                kx > ky || (kx == ky && *indices.add(x) < *indices.add(y))
            };
            for k in 1..found {
                let mut j = k;
                while j > 0 && before(j, j - 1) {
                    core::ptr::swap(indices.add(j), indices.add(j - 1));
                    core::ptr::swap(logits.add(j), logits.add(j - 1));
                    j -= 1;
                }
            }
            let out = args.top.as_mut_ptr().add(b as usize * MAX_TOP_LOGPROBS as usize);
            for k in 0..MAX_TOP_LOGPROBS as usize {
                *out.add(k) = if k < found {
                    RawTop { token: *indices.add(k), logit: *logits.add(k) }
                } else {
                    RawTop { token: NO_TOKEN, logit: f32::NEG_INFINITY }
                };
            }
        }
    }
    // SAFETY: every thread of the block reaches it; the next row reuses the shared memory.
    unsafe { arch::sync_threads() };
}

/// Merges the block's log-sum-exp terms of row `b` and writes them to `args.sums[b]`.
///
/// # Safety
/// Every thread of the block calls it together; `args.sums` holds row `b`.
#[inline(always)]
unsafe fn write_sums(
    args: &ProcessArgs,
    shared: *mut ProcessShared,
    b: u32,
    raw_lse: LogSumExp,
    kept: LogSumExp,
    temperature: f32,
) {
    let thread = arch::thread_index();
    let (lane, warp) = (thread % 32, (thread / 32) as usize);
    // SAFETY: all lanes together (uniform loops).
    let (raw_lse, kept) = unsafe { (merge_lse_over_warp(raw_lse, 1.0), merge_lse_over_warp(kept, temperature)) };
    // SAFETY: per-warp slots of the shared memory.
    let (raws, kepts) = unsafe {
        (addr_of_mut!((*shared).warp_raw) as *mut LogSumExp, addr_of_mut!((*shared).warp_kept) as *mut LogSumExp)
    };
    if lane == 0 {
        // SAFETY: `warp < WARPS`.
        unsafe { (*raws.add(warp), *kepts.add(warp)) = (raw_lse, kept) };
    }
    // SAFETY: every thread of the block reaches it (this function's contract).
    unsafe { arch::sync_threads() };
    if thread == 0 {
        let mut sums = RowSums { raw: LogSumExp::EMPTY, kept: LogSumExp::EMPTY };
        for w in 0..WARPS {
            // SAFETY: written before the barrier above.
            let (r, k) = unsafe { (*raws.add(w), *kepts.add(w)) };
            sums.raw.merge_with(r, 1.0);
            sums.kept.merge_with(k, temperature);
        }
        // SAFETY: `args.sums` holds row `b` (this function's contract).
        unsafe { *args.sums.as_mut_ptr().add(b as usize) = sums };
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
        // SAFETY: `k < batch · samples`: inside the tokens.
        unsafe { *args.tokens.as_mut_ptr().add(k as usize) = token };
        if logprobs {
            let logits = (token < NON_FINITE_TOKEN).then_some((best.raw, best.processed));
            let greedy = params.greedy != 0;
            let (raw_lp, processed_lp) =
                token_log_probabilities(token, logits, &sums.raw, &sums.kept, greedy, params.temperature);
            // SAFETY: `k < batch · samples`: inside both outputs.
            unsafe {
                *args.logprobs.as_mut_ptr().add(k as usize) = raw_lp;
                *args.processed_logprobs.as_mut_ptr().add(k as usize) = processed_lp;
            }
            if k % args.samples as u64 == 0 && args.top.address() != 0 {
                // SAFETY: as this function's contract, for row `b`.
                unsafe { merge_top(args, b, &sums.raw) };
            }
        }
        k += step;
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
            None => TopLogprob { token: NO_TOKEN, logprob: f32::NEG_INFINITY },
        };
        // SAFETY: row `b`'s slots.
        unsafe { *out.add(slot) = written };
    }
}
