//! The work items of a block: (vocabulary tile, batch tile) in grid-stride order.

use flashsample_core::abi::TmaArgs;

use crate::arch;

/// The work items of this block in grid-stride order, with their position in the block's
/// sequence: the producer takes every one, consumer team `k` of `n` those at positions `k`,
/// `k + n`, ….
pub(super) struct Items {
    position: u32,
    step: u32,
    count: u32,
    column_tiles: u32,
    columns: u32,
}

impl Items {
    #[inline(always)]
    pub(super) fn new(args: &TmaArgs, columns: u32, first: u32, step: u32) -> Items {
        // At least one, so the divisions below need no zero check (the host never launches
        // an empty batch).
        let column_tiles = args.batch.div_ceil(columns).max(1);
        Items { position: first, step, count: args.tiles * column_tiles, column_tiles, columns }
    }
}

impl Iterator for Items {
    /// `(position, tile, col0)`: batch tiles vary fastest, so blocks reading the same `W` rows
    /// run together.
    type Item = (u32, u32, u32);

    #[inline(always)]
    fn next(&mut self) -> Option<(u32, u32, u32)> {
        let item = arch::block_index() + self.position * arch::grid_size();
        if item >= self.count {
            return None;
        }
        let position = self.position;
        self.position += self.step;
        Some((position, item / self.column_tiles, (item % self.column_tiles) * self.columns))
    }
}
