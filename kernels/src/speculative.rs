//! Speculative verification's verdicts: for each verified sequence, how many of its drafts
//! the target's tokens keep, by `flashsample_core::speculative`'s rule, and the decode steps
//! moved past the tokens it emitted.

use flashsample_core::abi::{AcceptDraftsArgs, AdvanceVerifiedArgs};
use flashsample_core::speculative::{accepted_drafts, steps_emitted};

use crate::arch;

/// `accepted[s]` for every verified sequence `s`, one thread per sequence.
///
/// # Safety
/// `args.verified` holds `args.sequences` sequences whose rows lie inside `args.tokens` and
/// whose drafts lie inside `args.drafts`; `args.accepted` holds `args.sequences` slots no
/// other kernel touches meanwhile; the tokens' writes are ordered before this kernel.
#[inline(always)]
pub unsafe fn accept_drafts(args: &AcceptDraftsArgs) {
    let (mut s, stride) = arch::global_thread();
    while s < args.sequences as u64 {
        // SAFETY: `s < sequences`; the sequence's rows and drafts lie inside their buffers
        // (this function's contract).
        unsafe {
            let sequence = *args.verified.add(s).as_ptr();
            let count = sequence.drafts as usize;
            let drafts = core::slice::from_raw_parts(args.drafts.add(sequence.draft_offset as u64).as_ptr(), count);
            let targets = core::slice::from_raw_parts(args.tokens.add(sequence.first_row as u64).as_ptr(), count);
            *args.accepted.add(s).as_mut_ptr() = accepted_drafts(drafts, targets);
        }
        s += stride;
    }
}

/// `row_params[r].step += steps_emitted(accepted[s])` for every row `r` of every verified
/// sequence `s`, one thread per sequence.
///
/// # Safety
/// `args.verified` holds `args.sequences` sequences whose rows lie inside `args.row_params`;
/// `args.accepted` holds `args.sequences` verdicts written before on the stream; no other
/// kernel touches the row parameters meanwhile.
#[inline(always)]
pub unsafe fn advance_verified(args: &AdvanceVerifiedArgs) {
    let (mut s, stride) = arch::global_thread();
    while s < args.sequences as u64 {
        // SAFETY: `s < sequences`; the sequence's rows lie inside the row parameters (this
        // function's contract).
        unsafe {
            let sequence = *args.verified.add(s).as_ptr();
            let by = steps_emitted(*args.accepted.add(s).as_ptr());
            for position in 0..=sequence.drafts {
                let row = &mut *args.row_params.add((sequence.first_row + position) as u64).as_mut_ptr();
                row.step = row.step.wrapping_add(by);
            }
        }
        s += stride;
    }
}
