//! A tile's race for one draw summarised for every threshold the row's min-p may set, so that
//! min-p rows are decided and drawn without their logits.
//!
//! min-p keeps an upper set of a row's logits: the entries at or above a cut `τ` that only the
//! row's largest logit fixes ([`min_p_threshold`](crate::process::min_p_threshold)), which no
//! tile knows alone. For any `τ`, the winner of a tile's entries with logit `≥ τ` lies on the
//! tile's *chain* (its Pareto frontier of logit and candidate): from the tile's largest logit
//! down, each link is the first entry (largest logit, then best candidate) whose candidate
//! beats the link before; the winner is the last link at or above `τ`. On random noise a
//! chain over `n` entries has about `ln n` links, and a tile's entries below its own min-p cut
//! (its floor: the row's cut is never lower) need none. A [`Chain`] stores the first
//! [`CHAIN_LINKS`] links, where the next one starts (`open`), and the tile's winner at its
//! floor (`end`, the chain's last link); it answers every `τ` but those that keep an unstored
//! link, where the tile's logits need a second look ([`Chain::winner`]).
//!
//! Only entries whose exact candidate may beat the first link's can be later links or the
//! chain's `end`, so a kernel scores exactly only the entries the race's filter
//! ([`crate::estimate`]) passes against the best estimate among the entries with the first
//! link's logit: the first link's exact score is at least that entry's, so the race's
//! argument holds with it in place of the best estimate's entry, and the first link passes
//! too. The chain is the same with and without the filter.

use crate::candidate::Candidate;

/// Links a [`Chain`] stores from the tile's largest logit down.
pub const CHAIN_LINKS: usize = 8;

/// Whether a chain at `floor` searches an entry of processed logit `logit`: finite (NaN and
/// +∞ mark the tile non-finite instead; −∞ is dropped by the processing) and at or above the
/// floor.
#[inline(always)]
pub fn searched(logit: f32, floor: f32) -> bool {
    logit > f32::NEG_INFINITY && logit < f32::INFINITY && logit >= floor
}

/// An entry of a chain: its processed logit and its candidate in the draw's race.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
#[cfg_attr(not(target_arch = "nvptx64"), derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct Link {
    /// The processed logit; −∞ for no entry.
    pub logit: f32,
    /// The entry's candidate ([`Candidate::NONE`] for no entry).
    pub candidate: Candidate,
}

impl Link {
    /// No entry: comes after every entry.
    pub const NONE: Link = Link { logit: f32::NEG_INFINITY, candidate: Candidate::NONE };

    /// Whether `self` comes before `other` in a chain's search: a larger logit (−0 and +0
    /// equal), or an equal one with a better candidate. Total on distinct entries.
    #[inline(always)]
    pub fn comes_before(&self, other: &Link) -> bool {
        self.logit > other.logit || (self.logit == other.logit && self.candidate.beats(&other.candidate))
    }

    /// The one of `self` and `other` that comes first.
    #[inline(always)]
    pub fn first(self, other: Link) -> Link {
        if other.comes_before(&self) { other } else { self }
    }

    /// Whether `self` is an entry (not [`Link::NONE`]).
    #[inline(always)]
    pub fn is_entry(&self) -> bool {
        self.logit > f32::NEG_INFINITY
    }
}

/// A tile's chain for one (row, draw): see the module docs. Built by searching the tile's
/// entries at or above `floor` ([`Chain::follows`]): link 1 is the first of them, link `k + 1`
/// the first whose candidate beats link `k`'s; a NaN or +∞ entry in the tile makes `links[0]`'s
/// logit NaN (the row is non-finite).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
#[cfg_attr(not(target_arch = "nvptx64"), derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct Chain {
    /// The first links in order; [`Link::NONE`] past the chain's last link.
    pub links: [Link; CHAIN_LINKS],
    /// The best candidate at or above the floor (the chain's last link, stored or not).
    pub end: Link,
    /// The logit of the first link not stored; −∞ when every link is stored.
    pub open: f32,
    /// The tile's min-p cut: entries below it were not searched.
    pub floor: f32,
    /// Explicit tail padding, so that the chain has no padding bytes.
    pub padding: [u32; 2],
}

impl Chain {
    /// Whether `entry` is searched after `link` (the chain's last link so far; [`Link::NONE`]
    /// before the first): it is [`searched`] at `floor` and its candidate beats `link`'s.
    #[inline(always)]
    pub fn follows(entry: &Link, link: &Link, floor: f32) -> bool {
        searched(entry.logit, floor) && entry.candidate.beats(&link.candidate)
    }

    /// The chain of `entries` at `floor`, searched as a warp of the kernels does: one round
    /// per link, each the first entry that follows the last ([`Chain::follows`]); NaN or +∞
    /// among the entries makes the first link's logit NaN. The CPU's view of what a kernel's
    /// warp writes, for tests of the kernels and of the chains' reach.
    pub fn of(entries: &[Link], floor: f32) -> Chain {
        let after = |last: &Link| {
            let mut next = Link::NONE;
            for entry in entries {
                if Chain::follows(entry, last, floor) {
                    next = next.first(*entry);
                }
            }
            next
        };
        let mut links = [Link::NONE; CHAIN_LINKS];
        let mut last = Link::NONE;
        for slot in &mut links {
            let next = after(&last);
            if !next.is_entry() {
                break;
            }
            (*slot, last) = (next, next);
        }
        let open = if links[CHAIN_LINKS - 1].is_entry() { after(&last).logit } else { f32::NEG_INFINITY };
        let mut end = Link::NONE;
        for entry in entries {
            if searched(entry.logit, floor) && entry.candidate.beats(&end.candidate) {
                end = *entry;
            }
        }
        if entries.iter().any(|e| e.logit.is_nan() || e.logit == f32::INFINITY) {
            links[0].logit = f32::NAN;
        }
        Chain { links, end, open, floor, padding: [0; 2] }
    }

    /// Writes into `out` (which aliases neither) the chain of the union of two disjoint sets of
    /// entries from their chains `a` and `b`, in any grouping and order: the higher floor, the
    /// better end, and the chain searched again among both chains' stored links above both
    /// `open`s and at or above the floor, in one merge of the two lists by
    /// [`Link::comes_before`]. An entry that is not a link of its own set's chain is not one of
    /// the union's, and the union's links there are their sets' stored links, so the union
    /// answers every cut each chain could. A NaN first link (a non-finite tile) stays NaN.
    /// Links are read and written one at a time, so that a kernel may merge chains in shared
    /// memory into device memory without a copy in local memory.
    #[inline(always)]
    pub fn merge_into(a: &Chain, b: &Chain, out: &mut Chain) {
        let floor = if b.floor > a.floor { b.floor } else { a.floor };
        let above = if b.open > a.open { b.open } else { a.open };
        let (mut i, mut j, mut kept) = (0, 0, 0);
        let (mut last, mut open) = (Link::NONE, above);
        while i + j < 2 * CHAIN_LINKS {
            let ours = if i < CHAIN_LINKS { a.links[i] } else { Link::NONE };
            let theirs = if j < CHAIN_LINKS { b.links[j] } else { Link::NONE };
            let next = if theirs.comes_before(&ours) {
                j += 1;
                theirs
            } else {
                i += 1;
                ours
            };
            // Both lists descend: nothing after a link at or below `above` or the floor counts.
            if !(searched(next.logit, floor) && next.logit > above) {
                break;
            }
            if next.candidate.beats(&last.candidate) {
                if kept == CHAIN_LINKS {
                    open = next.logit;
                    break;
                }
                out.links[kept] = next;
                (last, kept) = (next, kept + 1);
            }
        }
        while kept < CHAIN_LINKS {
            out.links[kept] = Link::NONE;
            kept += 1;
        }
        out.end = if b.end.candidate.beats(&a.end.candidate) { b.end } else { a.end };
        (out.open, out.floor, out.padding) = (open, floor, [0; 2]);
        if a.links[0].logit.is_nan() || b.links[0].logit.is_nan() {
            out.links[0].logit = f32::NAN;
        }
    }

    /// The tile's winner among its entries whose logit is at least `cut` (a row's min-p cut,
    /// `≥ floor`): `Some(Candidate::NONE)` for none, `None` when the chain cannot tell (an
    /// unstored link is kept, or `cut` is below the floor).
    #[inline(always)]
    pub fn winner(&self, cut: f32) -> Option<Candidate> {
        if cut < self.floor {
            return None;
        }
        if self.end.logit >= cut {
            return Some(self.end.candidate);
        }
        if self.open >= cut {
            return None;
        }
        let mut best = Candidate::NONE;
        for link in &self.links {
            if link.is_entry() && link.logit >= cut {
                best = link.candidate;
            }
        }
        Some(best)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::estimate::{block_estimate, may_contend, race_threshold};
    use crate::noise::{RowParams, block_scores};
    use crate::process::min_p_threshold;
    use crate::testing::{normals, worst_log2};
    use std::vec::Vec;

    /// The chain of `entries` at the min-p 0.05 floor of their largest logit (T = 1).
    fn chain_at_own_floor(entries: &[Link]) -> Chain {
        let max = entries.iter().map(|e| e.logit).fold(f32::NEG_INFINITY, f32::max);
        Chain::of(entries, min_p_threshold(max, 1.0, 0.05))
    }

    /// The union of `chains`' sets, merged in order ([`Chain::merge_into`]).
    fn union(chains: &[Chain]) -> Chain {
        chains[1..].iter().fold(chains[0], |a, b| {
            let mut out = a;
            Chain::merge_into(&a, b, &mut out);
            out
        })
    }

    /// A tile's chain as the kernels make it: each warp's 32 entries at its own floor, merged
    /// in pairs (warps 0 and 1, 2 and 3), then the pairs.
    fn tile_chain(tile: &[Link]) -> Chain {
        let warps: Vec<Chain> = tile.chunks(32).map(chain_at_own_floor).collect();
        let pairs: Vec<Chain> = warps.chunks(2).map(union).collect();
        union(&pairs)
    }

    /// `n` normal logits (under `seed`) rounded to multiples of `1 / steps` (ties), every
    /// `minus_infinity_every`-th one −∞.
    fn on_a_grid(n: usize, seed: u32, steps: f32, minus_infinity_every: usize) -> Vec<f32> {
        normals(n, seed)
            .iter()
            .enumerate()
            .map(|(i, x)| if i % minus_infinity_every == 3 { f32::NEG_INFINITY } else { (x * steps).round() / steps })
            .collect()
    }

    /// The race among the entries at or above `cut`.
    fn brute_force(entries: &[Link], cut: f32) -> Candidate {
        entries.iter().filter(|e| e.is_entry() && e.logit >= cut).fold(Candidate::NONE, |a, e| a.merge(e.candidate))
    }

    /// A row's entries for draw `draw`: its logits with their candidates.
    fn scored(logits: &[f32], row: &RowParams, draw: u32) -> Vec<Link> {
        logits
            .chunks(4)
            .enumerate()
            .flat_map(|(block, quad)| {
                let mut four = [f32::NEG_INFINITY; 4];
                four[..quad.len()].copy_from_slice(quad);
                let (scores, words) = block_scores(row, draw, block as u32, four);
                (0..quad.len())
                    .map(move |r| Link {
                        logit: four[r],
                        candidate: if four[r] > f32::NEG_INFINITY {
                            Candidate::scored(scores[r], words[r], 4 * block as u32 + r as u32)
                        } else {
                            Candidate::NONE
                        },
                    })
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    #[test]
    fn a_chain_answers_every_cut_it_can_as_the_whole_race_does() {
        // 4,000 entries on a grid of 1/64 (ties), −∞ among them, cuts between and on the values:
        // with the lowest floors their chains outgrow the stored links.
        let row = RowParams { seed: 3, sequence: 1, step: 2, temperature: 1.0, greedy: 0 };
        let logits = on_a_grid(4000, 5, 64.0, 7);
        let (mut answered, mut open) = (0, 0);
        for draw in 0..50 {
            let entries = scored(&logits, &row, draw);
            for floor in [f32::NEG_INFINITY, -1.0, 0.25, 1.5] {
                let chain = Chain::of(&entries, floor);
                for cut in [-2.0, -1.0, -0.5, 0.0, 0.25, 1.0, 1.5, 1.75, 2.0, 2.5, 3.0, 5.0] {
                    match chain.winner(cut) {
                        Some(winner) => {
                            assert_eq!(winner, brute_force(&entries, cut), "draw {draw} floor {floor} cut {cut}");
                            answered += 1;
                        }
                        None => {
                            assert!(cut < floor || chain.open >= cut);
                            open += (cut >= floor) as u32;
                        }
                    }
                }
            }
        }
        // Both kinds of cut were met: answered ones and ones that keep an unstored link.
        assert!(answered > 1500 && open > 0, "{answered} answered, {open} open");
    }

    #[test]
    fn merged_chains_answer_every_cut_they_can_as_the_whole_race_does() {
        let row = RowParams { seed: 9, sequence: 4, step: 1, temperature: 1.0, greedy: 0 };
        let logits = on_a_grid(512, 6, 16.0, 11);
        let (mut answered, mut asked) = (0, 0);
        for draw in 0..40 {
            let entries = scored(&logits, &row, draw);
            // Groups of consecutive entries and interleaved ones, merged in two orders.
            let interleaved: Vec<Vec<Link>> =
                (0..4).map(|g| entries.iter().skip(g).step_by(4).copied().collect()).collect();
            for groups in [entries.chunks(128).map(<[Link]>::to_vec).collect::<Vec<_>>(), interleaved] {
                let chains: Vec<Chain> = groups.iter().map(|g| chain_at_own_floor(g)).collect();
                let at_once = union(&chains);
                let in_pairs = union(&[union(&chains[..2]), union(&chains[2..])]);
                for merged in [at_once, in_pairs] {
                    for cut in (0..40).map(|i| merged.floor + i as f32 / 16.0) {
                        asked += 1;
                        if let Some(winner) = merged.winner(cut) {
                            assert_eq!(winner, brute_force(&entries, cut), "draw {draw} cut {cut}");
                            answered += 1;
                        }
                    }
                }
            }
        }
        assert!(answered * 4 > asked * 3, "{answered} of {asked} answered");
    }

    #[test]
    fn estimate_filtered_warps_search_the_whole_warps_chains() {
        // Warps of 32 entries (eight Philox blocks), on a grid of 1/16 (ties at the first link's
        // logit and elsewhere) and spread normal logits, sampling rows at three temperatures and
        // a greedy row, floors at min-p 0.05 and none, `log2` off to each edge of its bound:
        // dropping the entries the race's filter rejects against the best estimate at the first
        // link's logit leaves every chain as it was.
        let (mut kept, mut searched_entries) = (0usize, 0usize);
        for (temperature, greedy) in [(1.0f32, 0u32), (0.05, 0), (3.0, 0), (1.0, 1)] {
            let row = RowParams { seed: 12, sequence: 3, step: 5, temperature, greedy };
            for (grid, scale) in [(16.0f32, 1.0f32), (f32::INFINITY, 2.1)] {
                let logits: Vec<f32> = normals(32 * 64, 31)
                    .iter()
                    .map(|x| if grid.is_finite() { (x * scale * grid).round() / grid } else { x * scale })
                    .collect();
                for sign in [-1.0, 1.0] {
                    for draw in 0..8 {
                        let entries = scored(&logits, &row, draw);
                        for (warp, quads) in logits.chunks(32).enumerate() {
                            let all = &entries[32 * warp..32 * warp + 32];
                            let most = quads.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                            for min_p in [0.05, 0.0] {
                                let floor = min_p_threshold(most, temperature, min_p);
                                let blocks = (0..8u32).map(|q| {
                                    let quad: [f32; 4] = quads[4 * q as usize..4 * q as usize + 4].try_into().unwrap();
                                    block_estimate(&row, draw, 8 * warp as u32 + q, quad, 4, worst_log2(sign))
                                });
                                let estimates: Vec<f32> = blocks.flat_map(|b| b.scores).collect();
                                let best_at_most = (0..32)
                                    .filter(|&e| quads[e] == most)
                                    .map(|e| estimates[e])
                                    .fold(f32::NEG_INFINITY, f32::max);
                                let threshold = race_threshold(&row, best_at_most);
                                let filtered: Vec<Link> = (0..32)
                                    .map(|e| if may_contend(estimates[e], threshold) { all[e] } else { Link::NONE })
                                    .collect();
                                assert_eq!(
                                    Chain::of(&filtered, floor),
                                    Chain::of(all, floor),
                                    "T {temperature} greedy {greedy} draw {draw} warp {warp} floor {floor}"
                                );
                                searched_entries += all.iter().filter(|e| searched(e.logit, floor)).count();
                                kept += filtered.iter().filter(|e| searched(e.logit, floor)).count();
                            }
                        }
                    }
                }
            }
        }
        // The filter drops most searched entries (what it saves the kernels).
        assert!(kept * 3 < searched_entries, "{kept} of {searched_entries} searched entries kept");
    }

    #[test]
    fn greedy_rows_chain_to_their_first_largest_logit() {
        let row = RowParams { seed: 3, sequence: 1, step: 2, temperature: 1.0, greedy: 1 };
        let entries = scored(&[1.0, 4.0, -2.0, 4.0, 3.0], &row, 0);
        let chain = Chain::of(&entries, 0.0);
        assert_eq!(chain.links[0].candidate.index, 1);
        assert!(!chain.links[1].is_entry());
        assert_eq!(chain.winner(3.5), Some(chain.links[0].candidate));
        assert_eq!(chain.winner(0.0), Some(chain.links[0].candidate));
    }

    #[test]
    fn chains_decide_every_min_p_row_at_the_headline_vocabulary() {
        // V = 151,936 in tiles of 128 (four warps' chains merged), min-p 0.05 at T = 1, logits
        // normal at the benchmark's
        // spread (σ ≈ 2.1), a peaked one (σ = 4) and a flat one (σ = 1), where min-p keeps
        // about 150, 20 and 12,000 entries. (Flatter rows need second looks: at σ = 0.7 to 0.85,
        // where min-p keeps a third of the row or more, about one tile in two rows cannot tell.)
        let vocab = 151_936;
        for (seed, scale, rows) in [(21u32, 2.1f32, 8u32), (22, 4.0, 8), (23, 1.0, 8)] {
            let logits: Vec<f32> = normals(vocab, seed).iter().map(|x| x * scale).collect();
            let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let cut = min_p_threshold(max, 1.0, 0.05);
            for sequence in 0..rows {
                let row = RowParams { seed: 7, sequence, step: 0, temperature: 1.0, greedy: 0 };
                let entries = scored(&logits, &row, 0);
                let mut best = Candidate::NONE;
                for tile in entries.chunks(128) {
                    let winner = tile_chain(tile).winner(cut);
                    assert!(winner.is_some(), "σ = {scale}: a tile's chain could not tell");
                    best = best.merge(winner.unwrap_or(Candidate::NONE));
                }
                assert_eq!(best, brute_force(&entries, cut), "σ = {scale}");
            }
        }
    }
}
