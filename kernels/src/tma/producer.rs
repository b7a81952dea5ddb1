//! The producer: one thread streams every k-block of every item of the block into the ring.

use flashsample_core::abi::{TMA_K_BLOCK, TmaArgs};

use super::pipeline::Ring;
use super::scheduler::Items;
use crate::hopper;

impl Ring {
    /// The producer (one thread): fills stages in ring order as the consumers free them,
    /// every k-block of every item of the block in [`Items`] order.
    ///
    /// # Safety
    /// As the kernel that calls it; called by one thread, after the barriers are published.
    #[inline(always)]
    pub(super) unsafe fn produce(&self, args: &TmaArgs, item_rows: u32, columns: u32) {
        let k_blocks = args.dim.div_ceil(TMA_K_BLOCK);
        let stage_bytes = self.lm_head_stage_bytes + self.hidden_stage_bytes;
        // SAFETY: per this function's contract both maps are 128-byte tensor maps in global memory.
        unsafe {
            hopper::fence_tensor_map(args.lm_head_map.address());
            hopper::fence_tensor_map(args.hidden_map.address());
        }
        let mut iteration = 0u32;
        for (_, tile, col0) in Items::new(args, columns, 0, 1) {
            for k_block in 0..k_blocks {
                let stage = iteration % self.stages;
                let phase = (iteration / self.stages) & 1;
                let full = self.full + 8 * stage;
                let k = (k_block * TMA_K_BLOCK) as i32;
                // SAFETY: the producer waits for the stage to be free before refilling it; the box
                // destinations lie in the stage (the layout sizes them from the registry's shared
                // memory), and `full` expects exactly these bytes.
                unsafe {
                    // A fresh barrier counts its (never run) previous phase as complete, so the
                    // first lap through the ring does not wait.
                    hopper::barrier_wait(self.empty + 8 * stage, phase ^ 1);
                    hopper::barrier_arrive_expect_bytes(full, stage_bytes);
                    let w = self.lm_head + stage * self.lm_head_stage_bytes;
                    hopper::tma_load_2d(w, args.lm_head_map.address(), k, (tile * item_rows) as i32, full);
                    let h = self.hidden + stage * self.hidden_stage_bytes;
                    hopper::tma_load_2d(h, args.hidden_map.address(), k, (args.hidden_row0 + col0) as i32, full);
                }
                iteration += 1;
            }
        }
    }
}
