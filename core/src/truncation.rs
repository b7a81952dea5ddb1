//! min-p, top-k and top-p as one selection, and the per-tile lists from which a row's
//! selection can be made without the row's logits.
//!
//! [`select`] is the truncations' one definition: min-p's cut from the row's largest processed
//! logit, then top-k's k-th value (ties kept), then top-p's shortest prefix (ties split by
//! index) over the entries min-p and top-k keep, as one [`KeepRule`]. It reads only the
//! entries that could be kept, so a backend may hand it fewer than the whole row.
//!
//! A tile (a run of consecutive vocabulary entries) can keep, per row, its [`TILE_TOP`] first
//! entries in the truncations' order (larger logit, then lower index): a [`TileTop`]. The
//! union of a row's tile lists holds its largest logit and, from each tile, every entry that
//! comes before the tile's last listed one (its floor); an entry left out comes after its
//! tile's floor. The rule [`select`] finds from the union is the row's own rule when no entry
//! left out could be kept ([`TileTop::settles`]): for min-p and top-k when the entry right
//! after every full tile's floor fails the rule, and, with top-p, when it fails the rule
//! before top-p (an entry kept by min-p and top-k adds to top-p's total). A tile that does not
//! settle is read whole (a second look at its logits) and the rule found again: more entries
//! only raise top-k's cut and leave min-p's, so every tile that settled still does, and one
//! second look settles every row.

use crate::process::{KeepRule, coarse_scale, key_logit, min_p_threshold, order_key, top_p_target, top_p_units_of};

/// Entries a [`TileTop`] lists.
pub const TILE_TOP: usize = 4;

/// A tile's first [`TILE_TOP`] entries of one row in the truncations' order (larger processed
/// logit, then lower vocabulary index); slots past the tile's finite entries hold −∞.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
#[cfg_attr(not(target_arch = "nvptx64"), derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct TileTop {
    /// The listed logits, in order.
    pub logits: [f32; TILE_TOP],
    /// Their global vocabulary indices.
    pub indices: [u32; TILE_TOP],
}

/// Whether entry `a` comes before entry `b` (each `(logit, index)`) in the truncations'
/// order: a larger logit, or an equal one (−0 and +0 are equal) at a lower index.
#[inline(always)]
pub fn comes_before(a: (f32, u32), b: (f32, u32)) -> bool {
    a.0 > b.0 || (a.0 == b.0 && a.1 < b.1)
}

/// A finite entry `(logit, index)` as one word whose unsigned order is the truncations'
/// order: `a` comes before `b` exactly when `order_word(a) > order_word(b)`. Never 0, which a
/// tile may use for "no entry".
#[inline(always)]
pub fn order_word(logit: f32, index: u32) -> u64 {
    (order_key(logit) as u64) << 32 | !index as u64
}

/// The entry of an [`order_word`] (a zero logit comes back as +0).
#[inline(always)]
pub fn order_entry(word: u64) -> (f32, u32) {
    (key_logit((word >> 32) as u32), !(word as u32))
}

impl TileTop {
    /// A tile with no finite entry.
    pub const EMPTY: TileTop = TileTop { logits: [f32::NEG_INFINITY; TILE_TOP], indices: [crate::NO_TOKEN; TILE_TOP] };

    /// Offers the entry `(logit, index)`: listed if it comes before the last listed entry. A
    /// −∞ entry is dropped by the processing and never listed; NaN or +∞ is not listed either
    /// but marks the list non-finite ([`TileTop::is_non_finite`]), as it makes the row's race
    /// report the row as non-finite.
    #[inline(always)]
    pub fn offer(&mut self, logit: f32, index: u32) {
        if !(logit > f32::NEG_INFINITY && logit < f32::INFINITY) {
            if logit != f32::NEG_INFINITY {
                self.logits[0] = f32::NAN;
            }
            return;
        }
        let mut entry = (logit, index);
        for slot in 0..TILE_TOP {
            let here = (self.logits[slot], self.indices[slot]);
            if comes_before(entry, here) {
                (self.logits[slot], self.indices[slot]) = entry;
                entry = here;
            }
        }
    }

    /// The first [`TILE_TOP`] entries of both lists: the list of the two tiles' entries
    /// together, in any grouping and order (the order is total on distinct entries).
    #[inline(always)]
    pub fn merge(mut self, other: TileTop) -> TileTop {
        for slot in 0..TILE_TOP {
            self.offer(other.logits[slot], other.indices[slot]);
        }
        self
    }

    /// Whether the tile holds a NaN or +∞ entry: its first slot is NaN (an offer never lists an
    /// entry before NaN, and merging offers that NaN on).
    pub fn is_non_finite(&self) -> bool {
        self.logits[0].is_nan()
    }

    /// The listed entries, in order.
    pub fn listed(&self) -> impl Iterator<Item = (f32, u32)> + '_ {
        (0..TILE_TOP).map(|slot| (self.logits[slot], self.indices[slot])).filter(|e| e.0 > f32::NEG_INFINITY)
    }

    /// The last listed entry when every slot is taken (the tile may hold entries left out, all
    /// after it); `None` when the list holds every finite entry of the tile.
    pub fn floor(&self) -> Option<(f32, u32)> {
        let last = TILE_TOP - 1;
        (self.logits[last] > f32::NEG_INFINITY).then_some((self.logits[last], self.indices[last]))
    }

    /// Whether no entry the tile left out can be kept by `bound` (the row's rule, or with
    /// top-p its rule before top-p, [`Selected::bound`]): the entry right after the floor is
    /// not, and `bound` keeps an upper set of the order, so no later entry is.
    pub fn settles(&self, bound: &KeepRule) -> bool {
        match self.floor() {
            None => true,
            Some((logit, index)) => !bound.keeps(logit, index.saturating_add(1)),
        }
    }
}

/// Sorts entries (`(logit, index)`, finite) into the truncations' order: decreasing logit (−0
/// and +0 equal), then increasing index.
pub fn rank(entries: &mut [(f32, u32)]) {
    entries.sort_unstable_by(|a, b| b.0.partial_cmp(&a.0).unwrap_or(core::cmp::Ordering::Equal).then(a.1.cmp(&b.1)));
}

/// How many of `ranked` entries ([`rank`]) top-k keeps: the first `k` and every entry tied with
/// the k-th (all of them when there are fewer than `k`).
pub fn top_k_kept(ranked: &[(f32, u32)], k: u32) -> usize {
    match ranked.get(k as usize - 1) {
        Some(&(kth, _)) => ranked.partition_point(|e| e.0 >= kth),
        None => ranked.len(),
    }
}

/// A row's truncations as [`select`] finds them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Selected {
    /// The entries min-p, top-k and top-p keep.
    pub rule: KeepRule,
    /// What an entry left out of the selection must fail for the rule to be the row's: the
    /// rule itself, or with top-p the rule of min-p and top-k alone (whose entries make up
    /// top-p's total).
    pub bound: KeepRule,
}

/// min-p, then top-k, then top-p as one [`KeepRule`] for a row whose largest processed logit
/// is `max`, at temperature `temperature`, from `entries` (`(logit, index)`, any order;
/// reordered here): every entry of the row that the rule could keep must be among them (any
/// others are ignored). `top_k = None` and `top_p = 1` leave those steps out, `min_p = 0`
/// keeps every entry; top-p's masses are [`top_p_units_of`] relative to `max`, summed exactly.
pub fn select(
    entries: &mut [(f32, u32)],
    max: f32,
    temperature: f32,
    min_p: f32,
    top_k: Option<u32>,
    top_p: f32,
) -> Selected {
    let min_cut = min_p_threshold(max, temperature, min_p);
    if top_k.is_none() && top_p >= 1.0 {
        let rule = KeepRule { min_cut, ..KeepRule::ALL };
        return Selected { rule, bound: rule };
    }
    let mut kept = 0;
    for i in 0..entries.len() {
        if entries[i].0 >= min_cut {
            entries.swap(i, kept);
            kept += 1;
        }
    }
    let order = &mut entries[..kept];
    rank(order);
    let kept = top_k.map_or(order.len(), |k| top_k_kept(order, k));
    let order = &order[..kept];
    let order_cut = match order.last() {
        Some(&(last, _)) if top_k.is_some() => (last, u32::MAX),
        _ => KeepRule::ALL.order_cut,
    };
    let bound = KeepRule { min_cut, order_cut };
    if top_p >= 1.0 {
        return Selected { rule: bound, bound };
    }
    let scale = coarse_scale(temperature);
    let total: u64 = order.iter().map(|e| top_p_units_of(e.0, max, scale)).sum();
    let target = top_p_target(total, top_p);
    let mut mass = 0;
    let cut = order.iter().position(|e| {
        mass += top_p_units_of(e.0, max, scale);
        mass >= target
    });
    let rule = match cut {
        Some(last) => KeepRule { min_cut, order_cut: order[last] },
        None => bound,
    };
    Selected { rule, bound }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{normals, uniforms};
    use std::vec::Vec;

    /// The truncations' settings the tests go through: (min-p, top-k, top-p).
    const MODES: [(f32, Option<u32>, f32); 6] = [
        (0.05, None, 1.0),
        (0.0, Some(50), 1.0),
        (0.0, Some(50), 0.9),
        (0.1, Some(20), 1.0),
        (0.02, None, 0.8),
        (0.3, Some(1), 0.5),
    ];

    /// The row's rule from its tiles of `width` entries: each tile's list, the selection from
    /// their union, a second look at every tile that does not settle, the selection again.
    /// Returns the rule and how many tiles needed the second look.
    fn rule_from_tiles(logits: &[f32], width: usize, t: f32, mode: (f32, Option<u32>, f32)) -> (KeepRule, usize) {
        let tops: Vec<TileTop> = logits
            .chunks(width)
            .enumerate()
            .map(|(tile, chunk)| {
                let mut top = TileTop::EMPTY;
                for (i, &l) in chunk.iter().enumerate() {
                    top.offer(l, (tile * width + i) as u32);
                }
                top
            })
            .collect();
        // Tree order differs from the offer order; the lists agree.
        for (tile, chunk) in logits.chunks(width).enumerate() {
            let halves = chunk.len() / 2;
            let mut a = TileTop::EMPTY;
            let mut b = TileTop::EMPTY;
            for (i, &l) in chunk.iter().enumerate().rev() {
                if i < halves { a.offer(l, (tile * width + i) as u32) } else { b.offer(l, (tile * width + i) as u32) }
            }
            assert_eq!(b.merge(a), tops[tile]);
        }
        let max = tops.iter().map(|top| top.logits[0]).fold(f32::NEG_INFINITY, f32::max);
        let (min_p, top_k, top_p) = mode;
        let mut union: Vec<(f32, u32)> = tops.iter().flat_map(|top| top.listed().collect::<Vec<_>>()).collect();
        let first = select(&mut union.clone(), max, t, min_p, top_k, top_p);
        let unsettled: Vec<usize> = (0..tops.len()).filter(|&tile| !tops[tile].settles(&first.bound)).collect();
        if unsettled.is_empty() {
            return (first.rule, 0);
        }
        for &tile in &unsettled {
            union.retain(|e| e.1 as usize / width != tile);
            let start = tile * width;
            union.extend(
                logits[start..(start + width).min(logits.len())]
                    .iter()
                    .enumerate()
                    .filter(|(_, l)| **l > f32::NEG_INFINITY)
                    .map(|(i, &l)| (l, (start + i) as u32)),
            );
        }
        let second = select(&mut union, max, t, min_p, top_k, top_p);
        for (tile, top) in tops.iter().enumerate() {
            assert!(
                unsettled.contains(&tile) || top.settles(&second.bound),
                "tile {tile} unsettled after a second look"
            );
        }
        (second.rule, unsettled.len())
    }

    /// The whole row's rule: every entry handed to the selection.
    fn rule_from_row(logits: &[f32], t: f32, mode: (f32, Option<u32>, f32)) -> KeepRule {
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut all: Vec<(f32, u32)> =
            logits.iter().enumerate().filter(|(_, l)| **l > f32::NEG_INFINITY).map(|(i, &l)| (l, i as u32)).collect();
        select(&mut all, max, t, mode.0, mode.1, mode.2).rule
    }

    #[test]
    fn a_list_keeps_the_first_entries_in_order_whatever_the_offer_order() {
        let mut top = TileTop::EMPTY;
        for (l, i) in [(1.0, 9), (3.0, 4), (f32::NEG_INFINITY, 0), (3.0, 2), (-0.0, 7), (0.0, 3), (2.5, 8)] {
            top.offer(l, i);
        }
        assert_eq!(top.logits, [3.0, 3.0, 2.5, 1.0]);
        assert_eq!(top.indices, [2, 4, 8, 9]);
        assert_eq!(top.floor(), Some((1.0, 9)));
        assert!(!top.is_non_finite());
        for bad in [f32::NAN, f32::INFINITY] {
            let mut non_finite = TileTop::EMPTY;
            non_finite.offer(2.0, 1);
            non_finite.offer(bad, 2);
            non_finite.offer(5.0, 3);
            assert!(non_finite.is_non_finite());
            assert!(TileTop::EMPTY.merge(non_finite).is_non_finite() && top.merge(non_finite).is_non_finite());
        }
        let mut short = TileTop::EMPTY;
        short.offer(-0.0, 7);
        short.offer(0.0, 3);
        assert_eq!(short.listed().collect::<Vec<_>>(), [(0.0, 3), (-0.0, 7)]);
        assert_eq!(short.floor(), None);
        assert!(short.settles(&KeepRule::ALL));
        assert!(!top.settles(&KeepRule::ALL));
        assert!(top.settles(&KeepRule { min_cut: 1.5, ..KeepRule::ALL }));
        // A tie with the floor after its index may be left out: top-k's cut at the floor's
        // value does not settle; top-p's cut at the floor itself does.
        assert!(!top.settles(&KeepRule { min_cut: f32::NEG_INFINITY, order_cut: (1.0, u32::MAX) }));
        assert!(top.settles(&KeepRule { min_cut: f32::NEG_INFINITY, order_cut: (1.0, 9) }));
    }

    #[test]
    fn order_words_order_entries_as_the_truncations_do() {
        let logits = [f32::MIN, -3.5, -1e-30, -0.0, 0.0, 1e-30, 2.0, 2.0, f32::MAX];
        let entries: Vec<(f32, u32)> =
            logits.iter().enumerate().flat_map(|(i, &l)| [(l, i as u32), (l, u32::MAX - i as u32), (l, 0)]).collect();
        for &a in &entries {
            assert_ne!(order_word(a.0, a.1), 0);
            let back = order_entry(order_word(a.0, a.1));
            assert!(back.0 == a.0 && back.1 == a.1, "{a:?} came back as {back:?}");
            for &b in &entries {
                assert_eq!(comes_before(a, b), order_word(a.0, a.1) > order_word(b.0, b.1), "{a:?} {b:?}");
            }
        }
    }

    #[test]
    fn tiles_give_the_whole_rows_rule_on_random_logits() {
        for (seed, (vocab, width, scale, t)) in
            [(5000, 128, 2.1, 1.0), (4099, 128, 4.0, 0.7), (3001, 37, 1.0, 1.3), (2048, 128, 8.0, 2.0)]
                .into_iter()
                .enumerate()
        {
            let logits: Vec<f32> = normals(vocab, seed as u32).iter().map(|x| x * scale).collect();
            for mode in MODES {
                let (rule, _) = rule_from_tiles(&logits, width, t, mode);
                assert_eq!(rule, rule_from_row(&logits, t, mode), "V = {vocab}, width {width}, {mode:?}");
            }
        }
    }

    #[test]
    fn ties_and_sorted_rows_need_second_looks_and_still_give_the_whole_rows_rule() {
        // Few distinct values (ties across and within tiles), a row sorted ascending (every
        // large logit in the last tiles), one sorted descending, −∞ entries (masked) among them.
        let vocab = 3000;
        let integers: Vec<f32> = uniforms(vocab, 9).iter().map(|u| (u * 6.0).floor() - 3.0).collect();
        let ascending: Vec<f32> = (0..vocab).map(|i| i as f32 * 0.01).collect();
        let descending: Vec<f32> = ascending.iter().rev().copied().collect();
        let masked: Vec<f32> = normals(vocab, 4)
            .iter()
            .enumerate()
            .map(|(i, &x)| if i % 3 == 0 { f32::NEG_INFINITY } else { x })
            .collect();
        let mut second_looks = 0;
        for logits in [&integers, &ascending, &descending, &masked] {
            for mode in MODES {
                let (rule, looks) = rule_from_tiles(logits, 128, 1.0, mode);
                assert_eq!(rule, rule_from_row(logits, 1.0, mode), "{mode:?}");
                second_looks += looks;
            }
        }
        assert!(second_looks > 0, "these rows were meant to need second looks");
    }

    #[test]
    fn second_looks_are_rare_at_the_headline_vocabulary() {
        // V = 151,936 in tiles of 128 at the benchmark's logit spread (σ ≈ 2.1) and a peaked one
        // (σ = 4): top-k 50 and min-p 0.05 alone, with and without top-p 0.9 after top-k.
        let vocab = 151_936;
        for (seed, scale) in [(11u32, 2.1f32), (12, 4.0)] {
            let logits: Vec<f32> = normals(vocab, seed).iter().map(|x| x * scale).collect();
            for mode in [(0.05, None, 1.0), (0.0, Some(50), 1.0), (0.0, Some(50), 0.9)] {
                let (rule, looks) = rule_from_tiles(&logits, 128, 1.0, mode);
                assert_eq!(rule, rule_from_row(&logits, 1.0, mode), "{mode:?}");
                assert!(looks <= 2, "σ = {scale}, {mode:?}: {looks} second looks");
            }
        }
    }
}
