//! Speculative verification: which drafted tokens a target keeps.
//!
//! Verification samples each drafted position of a sequence with the keys plain decoding
//! uses there (the sequence's seed and noise sequence, the position's decode step), over the
//! processing plain decoding would apply there (penalties see the drafts before the
//! position). The target's token at a position is then plain decoding's as long as every
//! draft before it was kept. A sequence keeps its drafts while each equals the target's token
//! at its position; at the first that differs the target's token replaces it, and after `k`
//! kept drafts the target's token at position `k` follows. The emitted tokens are the
//! target's tokens at positions `0 ..= accepted`: the tokens plain decoding draws, whatever
//! the drafter proposed.

/// How many of `drafts` the target keeps: the length of the longest prefix of `drafts` equal
/// to the target's tokens at the same positions (`targets`, at least as long as the prefix
/// compared). A row without a token holds a sentinel above every token index, which no draft
/// equals.
pub fn accepted_drafts(drafts: &[u32], targets: &[u32]) -> u32 {
    drafts.iter().zip(targets).take_while(|(draft, target)| draft == target).count() as u32
}

/// How far a verified sequence's decode step moves after a verdict of `accepted` kept drafts:
/// it emitted `accepted + 1` tokens, so its next position is that many steps on (wrapping, as
/// every step counter).
pub fn steps_emitted(accepted: u32) -> u32 {
    accepted.wrapping_add(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{NO_TOKEN, NON_FINITE_TOKEN};

    #[test]
    fn drafts_are_kept_up_to_the_first_that_differs() {
        let targets = [5, 9, 2, 7];
        assert_eq!(accepted_drafts(&[5, 9, 2], &targets), 3);
        assert_eq!(accepted_drafts(&[5, 8, 2], &targets), 1);
        assert_eq!(accepted_drafts(&[6, 9, 2], &targets), 0);
        assert_eq!(accepted_drafts(&[], &targets), 0);
    }

    #[test]
    fn a_verdict_moves_the_step_past_every_emitted_token() {
        assert_eq!(steps_emitted(0), 1);
        assert_eq!(steps_emitted(3), 4);
        assert_eq!(steps_emitted(u32::MAX), 0);
    }

    #[test]
    fn no_draft_matches_a_row_without_a_token() {
        assert_eq!(accepted_drafts(&[3, 4], &[3, NO_TOKEN, 4]), 1);
        assert_eq!(accepted_drafts(&[3, 4], &[NON_FINITE_TOKEN, 4, 4]), 0);
    }
}
