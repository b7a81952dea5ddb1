//! The GEMM's maxima: each (batch row, run of `MAXIMA_ROWS` vocabulary entries)'s largest
//! `extremum_key`, written beside the logits so that the processing pipeline takes a row's
//! largest logit and non-finite flag from them ([`ProcessStep::Extrema`]) without reading the
//! row. The logits themselves are stored as before: a key comes from registers the store
//! reads anyway, and a shuffle between the lanes that hold a run's other rows. One
//! implementation for the `mma.sync`, SIMT and TMA GEMMs' epilogues.
//!
//! [`ProcessStep::Extrema`]: flashsample_core::abi::ProcessStep::Extrema

use flashsample_core::abi::{DevicePtr, MAXIMA_ROWS, maxima_per_row};
use flashsample_core::process::extremum_key;

use crate::arch;

/// The largest [`extremum_key`] of a quad of logits at rows `row0 .. row0 + 4` among its rows
/// below `vocab` (0, below every key, for none).
#[inline(always)]
pub(crate) fn quad_key(quad: [f32; 4], row0: u32, vocab: u32) -> u32 {
    let mut key = 0;
    for (r, &logit) in quad.iter().enumerate() {
        if row0 + (r as u32) < vocab {
            key = key.max(extremum_key(logit));
        }
    }
    key
}

/// The largest `key` over this lane and the lanes `l ^ first`, `l ^ second` and
/// `l ^ first ^ second`.
///
/// # Safety
/// All 32 lanes call it together.
#[inline(always)]
pub(crate) unsafe fn max_over_lanes(key: u32, first: u32, second: u32) -> u32 {
    // SAFETY: every lane is here (this function's contract).
    let key = key.max(unsafe { arch::shuffle_xor(key, first) });
    // SAFETY: as above.
    key.max(unsafe { arch::shuffle_xor(key, second) })
}

/// Writes `key` as the maximum of column `b`'s run of rows from `row0` (a multiple of
/// `MAXIMA_ROWS`), if the column and the run lie inside the logits.
///
/// # Safety
/// `maxima` holds `batch × maxima_per_row(vocab)` words.
#[inline(always)]
pub(crate) unsafe fn write(maxima: DevicePtr<u32>, vocab: u32, batch: u32, b: u32, row0: u32, key: u32) {
    if b < batch && row0 < vocab {
        let at = b as usize * maxima_per_row(vocab) as usize + (row0 / MAXIMA_ROWS) as usize;
        // SAFETY: `b < batch` and `row0 < vocab`: a word of the maxima (this function's contract).
        unsafe { *maxima.as_mut_ptr().add(at) = key };
    }
}
