//! Philox4x32-10, the counter-based generator of Salmon, Moraes, Dror and Shaw,
//! "Parallel random numbers: as easy as 1, 2, 3" (SC 2011). Multipliers and Weyl
//! constants are the ones given there; the tests check the Random123 known-answer vectors.

const MULTIPLIER_0: u32 = 0xD251_1F53;
const MULTIPLIER_1: u32 = 0xCD9E_8D57;
const WEYL_0: u32 = 0x9E37_79B9;
const WEYL_1: u32 = 0xBB67_AE85;

/// The 128-bit counter of one Philox call.
pub type Counter = [u32; 4];
/// The 64-bit key of one Philox call.
pub type Key = [u32; 2];

#[inline(always)]
fn mul_hi_lo(a: u32, b: u32) -> (u32, u32) {
    let product = (a as u64) * (b as u64);
    ((product >> 32) as u32, product as u32)
}

#[inline(always)]
fn round(c: Counter, k: Key) -> Counter {
    let (hi0, lo0) = mul_hi_lo(MULTIPLIER_0, c[0]);
    let (hi1, lo1) = mul_hi_lo(MULTIPLIER_1, c[2]);
    [hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0]
}

/// Ten rounds of Philox4x32 on `counter` under `key`: four independent uniform 32-bit words.
#[inline(always)]
pub fn philox4x32_10(counter: Counter, key: Key) -> [u32; 4] {
    let mut c = counter;
    let mut k = key;
    c = round(c, k);
    for _ in 0..9 {
        k = [k[0].wrapping_add(WEYL_0), k[1].wrapping_add(WEYL_1)];
        c = round(c, k);
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Known-answer vectors of Random123 1.09 (`kat_vectors`, lines `philox4x32 10`).
    #[test]
    fn random123_known_answers() {
        let cases: [(Counter, Key, [u32; 4]); 3] = [
            ([0, 0, 0, 0], [0, 0], [0x6627_e8d5, 0xe169_c58d, 0xbc57_ac4c, 0x9b00_dbd8]),
            ([0xffff_ffff; 4], [0xffff_ffff; 2], [0x408f_276d, 0x41c8_3b0e, 0xa20b_c7c6, 0x6d54_51fd]),
            (
                [0x243f_6a88, 0x85a3_08d3, 0x1319_8a2e, 0x0370_7344],
                [0xa409_3822, 0x299f_31d0],
                [0xd16c_fe09, 0x94fd_cceb, 0x5001_e420, 0x2412_6ea1],
            ),
        ];
        for (counter, key, expected) in cases {
            assert_eq!(philox4x32_10(counter, key), expected, "counter {counter:08x?} key {key:08x?}");
        }
    }
}
