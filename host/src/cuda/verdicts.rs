//! A verification's verdicts: after the call's tokens, each verified sequence's count of kept
//! drafts (`flashsample_core::speculative`).

use cudarc::driver::sys;
use flashsample_core::abi::{AcceptDraftsArgs, DevicePtr};
use flashsample_core::registry::Kernel;

use super::modules::Kernels;
use super::plan::VerdictCall;
use crate::error::Result;

impl Kernels {
    /// Queues the verdicts of `verdicts`' sequences over its tokens.
    ///
    /// # Safety
    /// The context is current; the tokens' writes are ordered before on `stream`; the
    /// sequences' rows lie inside the tokens, their drafts inside the drafts, and `accepted`
    /// holds a slot per sequence.
    pub(crate) unsafe fn queue_verdicts(&self, stream: sys::CUstream, verdicts: &VerdictCall) -> Result<()> {
        let sequences = verdicts.sequences.count as u64;
        let args = AcceptDraftsArgs {
            tokens: DevicePtr::new(verdicts.tokens),
            verified: DevicePtr::new(verdicts.sequences.sequences),
            drafts: DevicePtr::new(verdicts.sequences.drafts),
            accepted: DevicePtr::new(verdicts.accepted),
            sequences: sequences as u32,
            padding: 0,
        };
        let blocks = sequences.div_ceil(Kernel::AcceptDrafts.threads() as u64);
        // SAFETY: per this function's contract.
        unsafe { self.launch(stream, Kernel::AcceptDrafts, blocks, &args) }
    }
}
