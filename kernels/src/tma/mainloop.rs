//! The consumers' mainloop: a warpgroup's `wgmma` multiplies over an item's stages.

use flashsample_core::abi::TMA_K_BLOCK;

use super::pipeline::Ring;
use crate::hopper;
use crate::hopper::WgmmaElement;

impl Ring {
    /// A consumer warpgroup issues the multiplies of one item, whose first stage is ring
    /// iteration `first`, on its 64 rows (`w_offset` bytes into each `W` box), freeing each
    /// stage but the last once its group is done. The last group may still be running.
    ///
    /// Pass a `w_offset` that ptxas knows to be warp-uniform ([`arch::broadcast_lane0`]):
    /// the tokens do not depend on it, but otherwise every descriptor is built in vector
    /// registers and moved to uniform ones before each `wgmma` (19 more instructions per
    /// warp and stage; docs/PERF.md, "warp-uniform mainloop bookkeeping").
    ///
    /// # Safety
    /// All 128 threads of the warpgroup call it together; `acc` is not touched until
    /// [`Ring::finish`].
    #[inline(always)]
    pub(super) unsafe fn multiply<T: WgmmaElement, const R: usize, const PENDING: u32>(
        &self,
        first: u32,
        k_blocks: u32,
        w_offset: u32,
        acc: &mut [f32; R],
    ) {
        // Stage and phase advance with the loop, and the descriptors are the stage-0 ones
        // plus the stage's offset: all warp-uniform 32-bit arithmetic (ptxas keeps it in
        // uniform registers when `w_offset` is known to be warp-uniform).
        let lm_head = hopper::SwizzledDescriptor::at(self.lm_head + w_offset);
        let hidden = hopper::SwizzledDescriptor::at(self.hidden);
        let mut stage = first % self.stages;
        let mut phase = (first / self.stages) & 1;
        let mut previous = stage;
        for k_block in 0..k_blocks {
            let a = lm_head.advanced(stage * self.lm_head_stage_bytes);
            let b = hidden.advanced(stage * self.hidden_stage_bytes);
            // SAFETY: per this function's contract the whole warpgroup is here; the stage is full
            // (waited on) and its descriptors address its boxes.
            unsafe {
                hopper::barrier_wait(self.full + 8 * stage, phase);
                hopper::wgmma_fence();
                for step in 0..TMA_K_BLOCK / 16 {
                    // 16 elements of K are 32 bytes along the swizzled row.
                    let (a, b) = (a.advanced(32 * step), b.advanced(32 * step));
                    T::wgmma::<R>(acc, a.bits(), b.bits(), (k_block > 0 || step > 0) as u32);
                }
                hopper::wgmma_commit();
                // The previous stage's group is done once at most this one is pending.
                hopper::wgmma_wait::<PENDING>();
                if PENDING == 0 {
                    hopper::barrier_arrive(self.empty + 8 * stage);
                } else if k_block > 0 {
                    hopper::barrier_arrive(self.empty + 8 * previous);
                }
            }
            previous = stage;
            stage += 1;
            if stage == self.stages {
                stage = 0;
                phase ^= 1;
            }
        }
    }

    /// Waits for the item's last group (its accumulators are final) and frees its stage.
    ///
    /// # Safety
    /// As [`Ring::multiply`], right after it (or after work that does not touch `acc`).
    #[inline(always)]
    pub(super) unsafe fn finish(&self, first: u32, k_blocks: u32) {
        // SAFETY: per this function's contract the whole warpgroup is here, right after its
        // multiplies.
        unsafe {
            hopper::wgmma_wait::<0>();
            hopper::barrier_arrive(self.empty + 8 * ((first + k_blocks - 1) % self.stages));
        }
    }
}
