//! The pipeline: a ring of shared-memory stages and the barriers that pass each stage between
//! the producer and the consumers.

use flashsample_core::abi::{tma_hidden_stage_bytes, tma_lm_head_stage_bytes};

use crate::hopper;

/// The ring of pipeline stages in shared memory and its barriers: stage `s` holds a
/// `rows` × 64 box of `W` and a `columns` × 64 box of `H`; `full + 8·s` completes when its
/// TMA bytes land, `empty + 8·s` when every consumer thread is done reading it.
#[derive(Clone, Copy)]
pub(super) struct Ring {
    pub(super) stages: u32,
    pub(super) lm_head: u32,
    pub(super) lm_head_stage_bytes: u32,
    pub(super) hidden: u32,
    pub(super) hidden_stage_bytes: u32,
    pub(super) full: u32,
    pub(super) empty: u32,
}

impl Ring {
    /// `stages` stages from the 1024-aligned shared address `start`, the `W` boxes first,
    /// then the `H` boxes, then `barriers` (the barriers' own shared address).
    #[inline(always)]
    pub(super) fn new(start: u32, stages: u32, item_rows: u32, columns: u32, barriers: u32) -> Ring {
        let lm_head_stage_bytes = tma_lm_head_stage_bytes(item_rows);
        let hidden = start + stages * lm_head_stage_bytes;
        let hidden_stage_bytes = tma_hidden_stage_bytes(columns);
        Ring {
            stages,
            lm_head: start,
            lm_head_stage_bytes,
            hidden,
            hidden_stage_bytes,
            full: barriers,
            empty: barriers + stages * 8,
        }
    }

    /// The first shared address after the stages' boxes.
    #[inline(always)]
    pub(super) fn boxes_end(&self) -> u32 {
        self.hidden + self.stages * self.hidden_stage_bytes
    }

    /// The first shared address after the ring's barriers.
    #[inline(always)]
    pub(super) fn barriers_end(&self) -> u32 {
        self.empty + self.stages * 8
    }

    /// Initialises the barriers: one arrival (plus bytes) fills a stage, `readers` free it.
    ///
    /// # Safety
    /// One thread calls it before the block barrier that publishes the barriers.
    #[inline(always)]
    pub(super) unsafe fn init(&self, readers: u32) {
        for s in 0..self.stages {
            // SAFETY: per this function's contract one thread initialises the ring's barriers
            // before the block barrier publishes them.
            unsafe {
                hopper::barrier_init(self.full + 8 * s, 1);
                hopper::barrier_init(self.empty + 8 * s, readers);
            }
        }
    }
}
