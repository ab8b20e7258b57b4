//! The AVX2 lanes kernel: four weight rows against sixteen or thirty-two tokens, a token per
//! 32-bit lane, eight tokens a vector (see [`crate::lanes`] for the layouts).
//!
//! AVX2 has no `vpdpbusd`. Its unsigned × signed byte product, `vpmaddubsw`, adds pairs of
//! products into saturating 16-bit lanes, which is exact while `2·code·128 ≤ 32767`, i.e. for
//! codes up to 127: Q4_0's and Q5_0's offset codes (at most 15 and 31) take one `vpmaddubsw`
//! and one `vpmaddwd` by ones per four codes. Q8_0's offset codes reach 255, so a call whose
//! codes have any top bit set splits each code into its nibbles and adds the high nibble's
//! products times sixteen in 32-bit lanes (two of each instruction). Either way the integer
//! sums are exact, and the float work is the scalar reference's `s + isum·(d_w·d_x)` in block
//! order, so every lane is the reference's bits, as with the AVX-512 kernel.

use std::arch::x86_64::*;

use crate::lanes::{LaneBlock, LanesAcc, LANES};
use crate::tile::TILE_ROWS;

/// Tokens per AVX2 vector of 32-bit lanes.
const HALF: usize = 8;
/// Groups of four codes in a block.
const QK_GROUPS: usize = 8;

/// `acc[r][g][t] += Σ_b (Σ_j codes[r][b][j]·x[g][b][t][j] + corr[g][b][t]) · (dw[r][b]·dx[g][b][t])`
/// for `G` groups of sixteen tokens (one or two), eight tokens at a time.
///
/// # Safety
/// AVX2 is enabled; every `x[g]` holds the same number of blocks, `codes[r]` holds
/// `32 · x[0].len()` bytes and `dw[r]` `x[0].len()` scales for every row.
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn tile<const G: usize>(
    codes: &[&[u8]; TILE_ROWS],
    dw: &[&[f32]; TILE_ROWS],
    x: [&[LaneBlock]; G],
    acc: &mut LanesAcc,
) {
    let wide = codes.iter().any(|c| c.iter().any(|&b| b >= 0x80));
    for (g, xg) in x.iter().enumerate() {
        for h in 0..LANES / HALF {
            // SAFETY: features enabled; lengths as the caller guarantees.
            unsafe {
                if wide {
                    half_tile::<true>(codes, dw, xg, acc, g, h)
                } else {
                    half_tile::<false>(codes, dw, xg, acc, g, h)
                }
            }
        }
    }
}

/// Tokens `8h..8h + 8` of group `g` against the four rows.
///
/// # Safety
/// As [`tile`].
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn half_tile<const WIDE: bool>(
    codes: &[&[u8]; TILE_ROWS],
    dw: &[&[f32]; TILE_ROWS],
    x: &[LaneBlock],
    acc: &mut LanesAcc,
    g: usize,
    h: usize,
) {
    const R: usize = TILE_ROWS;
    let lane0 = h * HALF;
    // SAFETY: `acc[r][g]` holds LANES f32 and lane0 + 8 <= LANES; features enabled.
    let mut a: [__m256; R] =
        std::array::from_fn(|r| unsafe { _mm256_loadu_ps(acc[r][g].as_ptr().add(lane0)) });
    let ones = _mm256_set1_epi16(1);
    let sixteen = _mm256_set1_epi16(16);
    let low = _mm256_set1_epi8(0x0f);
    for (b, xb) in x.iter().enumerate() {
        // SAFETY: xb's fields hold LANES entries (4 bytes of codes each), lane0 + 8 <= LANES;
        // row r's codes hold 32·nb bytes and its scales nb, b < nb (caller contract).
        unsafe {
            let corr = _mm256_loadu_si256(xb.corr.as_ptr().add(lane0) as *const __m256i);
            let mut isum = [corr; R];
            for q in 0..QK_GROUPS {
                let xv = _mm256_loadu_si256(xb.codes[q].as_ptr().add(lane0) as *const __m256i);
                for (r, s) in isum.iter_mut().enumerate() {
                    let p = codes[r].as_ptr().add(b * 32 + 4 * q) as *const i32;
                    let w = _mm256_set1_epi32(p.read_unaligned());
                    *s = if WIDE {
                        let lo = _mm256_and_si256(w, low);
                        let hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), low);
                        let plo = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, xv), ones);
                        let phi = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, xv), sixteen);
                        _mm256_add_epi32(*s, _mm256_add_epi32(plo, phi))
                    } else {
                        let p = _mm256_madd_epi16(_mm256_maddubs_epi16(w, xv), ones);
                        _mm256_add_epi32(*s, p)
                    };
                }
            }
            let dx = _mm256_loadu_ps(xb.dx.as_ptr().add(lane0));
            for r in 0..R {
                let scale = _mm256_mul_ps(_mm256_set1_ps(*dw[r].get_unchecked(b)), dx);
                let term = _mm256_mul_ps(_mm256_cvtepi32_ps(isum[r]), scale);
                a[r] = _mm256_add_ps(a[r], term);
            }
        }
    }
    for r in 0..R {
        // SAFETY: as the load above.
        unsafe { _mm256_storeu_ps(acc[r][g].as_mut_ptr().add(lane0), a[r]) };
    }
}
