//! Splitting a request into passes of bounded candidate memory.
//!
//! The tile kernel writes one candidate (`CANDIDATE_BYTES`) per (row, draw, vocabulary tile), so a request for
//! millions of draws would need gigabytes at once. It runs instead as passes over blocks of
//! rows and draws whose candidates fit [`CANDIDATE_BUDGET_BYTES`]; each pass reduces its
//! candidates into its slots of the token buffer. Draw `j` of a row is keyed by its global
//! index, so how a request is split never changes a token.

use flashsample_core::abi::CANDIDATE_BYTES;

/// Candidate memory one pass may use.
pub(crate) const CANDIDATE_BUDGET_BYTES: usize = 256 << 20;

/// One pass: rows `first_row .. first_row + rows`, draws `first_sample .. first_sample + samples`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Pass {
    pub first_row: usize,
    pub rows: usize,
    pub first_sample: usize,
    pub samples: usize,
}

/// The passes of a request and the candidate slots the largest needs.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Passes {
    batch: usize,
    samples: usize,
    rows_per_pass: usize,
    samples_per_pass: usize,
}

impl Passes {
    /// Passes over `batch` rows × `samples` draws with `tiles` candidates each, at most
    /// `budget_bytes` of candidates per pass (one (row, draw) pair per pass at least).
    pub fn new(batch: usize, samples: usize, tiles: usize, budget_bytes: usize) -> Passes {
        let pairs_per_pass = (budget_bytes / (tiles.max(1) * CANDIDATE_BYTES as usize)).max(1);
        let rows_per_pass = batch.min(pairs_per_pass).max(1);
        let samples_per_pass = samples.min((pairs_per_pass / rows_per_pass).max(1)).max(1);
        Passes { batch, samples, rows_per_pass, samples_per_pass }
    }

    /// Candidate slots of the largest pass: `rows × samples × tiles` of it.
    pub fn candidate_pairs(&self) -> usize {
        self.rows_per_pass * self.samples_per_pass
    }

    pub fn passes(&self) -> impl Iterator<Item = Pass> + '_ {
        (0..self.batch).step_by(self.rows_per_pass).flat_map(move |first_row| {
            (0..self.samples).step_by(self.samples_per_pass).map(move |first_sample| Pass {
                first_row,
                rows: self.rows_per_pass.min(self.batch - first_row),
                first_sample,
                samples: self.samples_per_pass.min(self.samples - first_sample),
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every (row, draw) pair is in exactly one pass, and no pass needs more candidates than
    /// the budget allows (unless a single pair already does).
    #[test]
    fn passes_cover_every_pair_once_within_the_budget() {
        for (batch, samples, tiles, budget) in [
            (1, 1, 1, 8),
            (3, 200_000, 547, CANDIDATE_BUDGET_BYTES),
            (1024, 3, 2, 64),
            (37, 16, 40, 8 * 40 * 5),
            (5, 7, 1000, 8),
        ] {
            let plan = Passes::new(batch, samples, tiles, budget);
            let mut seen = vec![0u8; batch * samples];
            for pass in plan.passes() {
                assert!(pass.rows * pass.samples <= plan.candidate_pairs());
                for row in pass.first_row..pass.first_row + pass.rows {
                    for draw in pass.first_sample..pass.first_sample + pass.samples {
                        seen[row * samples + draw] += 1;
                    }
                }
            }
            assert!(seen.iter().all(|&n| n == 1), "B = {batch}, N = {samples}");
            assert!(plan.candidate_pairs() * tiles * 8 <= budget.max(tiles * 8), "B = {batch}, N = {samples}");
        }
    }
}
