//! The shard merge's launch: the parts of every vocabulary shard (per row and draw a winner
//! with its token's logits, per row its log-sum-exp terms and top raw entries) become tokens
//! and log-probabilities.

use cudarc::driver::sys;
use flashsample_core::abi::{DevicePtr, ShardMergeArgs, ShardPartLayout};
use flashsample_core::registry::Kernel;

use super::modules::Kernels;
use super::plan::MergeCall;
use crate::error::Result;

impl Kernels {
    /// Queues the merge kernel over `merge`'s parts (of `layout`) into its outputs.
    ///
    /// # Safety
    /// The context is current; `parts` holds `shards` parts of `layout` whose writes are
    /// ordered before on `stream`, the row parameters and processing are stage 1's, and the
    /// outputs hold their extents.
    pub(crate) unsafe fn queue_merge(
        &self,
        stream: sys::CUstream,
        layout: &ShardPartLayout,
        merge: &MergeCall,
    ) -> Result<()> {
        let slots = (merge.rows * merge.samples as usize) as u64;
        let raw = DevicePtr::<f32>::new(merge.out_logprobs);
        let processed = raw.add_unless_null(slots);
        let args = ShardMergeArgs {
            parts: DevicePtr::new(merge.parts),
            row_params: DevicePtr::new(merge.row_params),
            processing: merge.processing.blocks(),
            tokens: DevicePtr::new(merge.tokens),
            logprobs: raw,
            processed_logprobs: processed,
            top: DevicePtr::new(merge.out_top_logprobs),
            part_sums: layout.sums,
            part_top: layout.top,
            part_bytes: layout.bytes,
            shards: merge.shards as u32,
            batch: merge.rows as u32,
            samples: merge.samples,
            padding: 0,
        };
        let blocks = slots.div_ceil(Kernel::MergeShards.threads() as u64);
        // SAFETY: per this function's contract.
        unsafe { self.launch(stream, Kernel::MergeShards, blocks, &args) }
    }
}
