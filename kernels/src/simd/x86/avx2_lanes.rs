//! The AVX2 lanes kernel: four weight rows against sixteen or thirty-two tokens, a token per
//! 32-bit lane, eight tokens a vector (see [`crate::lanes`] for the layouts).
//!
//! AVX2 has no `vpdpbusd`. Its unsigned × signed byte product, `vpmaddubsw`, adds pairs of
//! products into saturating 16-bit lanes, which is exact while `2·code·128 ≤ 32767`, i.e. for
//! codes up to 127: Q4_0's and Q5_0's offset codes (at most 15 and 31) take one `vpmaddubsw`
//! and one `vpmaddwd` by ones per four codes, and the block's `corr` removes the offset. Codes
//! above 127 only come from the encodings offset by 128 (Q8_0, IQ4_NL), whose weights are
//! then the codes with the top bit flipped (−128..=127): a call with any such code multiplies
//! the weights' magnitudes by the activations with the weights' signs (`vpsignb`), exact
//! because Q8_0 activations lie in −127..=127 (`2·128·127 ≤ 32767`), and needs no `corr`. The
//! two halves of a token group share each broadcast weight word and its magnitude. Either way
//! the integer sums are exact, and the float work is the scalar reference's `s + isum·(d_w·d_x)`
//! in block order, so every lane is the reference's bits, as with the AVX-512 kernel.

use std::arch::x86_64::*;

use crate::lanes::{LaneBlock, LanesAcc};
use crate::tile::TILE_ROWS;

/// Tokens per AVX2 vector of 32-bit lanes.
const HALF: usize = 8;
/// Groups of four codes in a block.
const QK_GROUPS: usize = 8;

/// `acc[r][g][t] += Σ_b (Σ_j codes[r][b][j]·x[g][b][t][j] + corr[g][b][t]) · (dw[r][b]·dx[g][b][t])`
/// for `G` groups of sixteen tokens (one or two).
///
/// # Safety
/// AVX2 is enabled; every `x[g]` holds the same number of blocks, `codes[r]` holds
/// `32 · x[0].len()` bytes and `dw[r]` `x[0].len()` scales for every row; codes above 127
/// only where the encoding's offset is 128 and the activations lie in −127..=127.
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn tile<const G: usize>(
    codes: &[&[u8]; TILE_ROWS],
    dw: &[&[f32]; TILE_ROWS],
    x: [&[LaneBlock]; G],
    acc: &mut LanesAcc,
) {
    let signed = codes.iter().any(|c| c.iter().any(|&b| b >= 0x80));
    for (g, xg) in x.iter().enumerate() {
        // SAFETY: features enabled; lengths as the caller guarantees.
        unsafe {
            if signed {
                group_tile::<true>(codes, dw, xg, acc, g)
            } else {
                group_tile::<false>(codes, dw, xg, acc, g)
            }
        }
    }
}

/// The sixteen tokens of group `g` against the four rows, as two vectors of eight; `SIGNED`:
/// the codes are offset by 128 and multiplied as signed weights (no `corr`).
///
/// # Safety
/// As [`tile`].
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn group_tile<const SIGNED: bool>(
    codes: &[&[u8]; TILE_ROWS],
    dw: &[&[f32]; TILE_ROWS],
    x: &[LaneBlock],
    acc: &mut LanesAcc,
    g: usize,
) {
    const R: usize = TILE_ROWS;
    let mut a: [[__m256; 2]; R] = std::array::from_fn(|r| {
        std::array::from_fn(|h| {
            // SAFETY: `acc[r][g]` holds LANES = 2·HALF f32; features enabled.
            unsafe { _mm256_loadu_ps(acc[r][g].as_ptr().add(h * HALF)) }
        })
    });
    let ones = _mm256_set1_epi16(1);
    let flip = _mm256_set1_epi8(-128);
    for (b, xb) in x.iter().enumerate() {
        // SAFETY: xb's fields hold LANES entries (4 bytes of codes each) and h·HALF + 8 <=
        // LANES; row r's codes hold 32·nb bytes and its scales nb, b < nb (caller contract).
        unsafe {
            let mut isum: [[__m256i; 2]; R] = if SIGNED {
                [[_mm256_setzero_si256(); 2]; R]
            } else {
                let corr: [__m256i; 2] = std::array::from_fn(|h| {
                    _mm256_loadu_si256(xb.corr.as_ptr().add(h * HALF) as *const __m256i)
                });
                [corr; R]
            };
            for q in 0..QK_GROUPS {
                let xv: [__m256i; 2] = std::array::from_fn(|h| {
                    _mm256_loadu_si256(xb.codes[q].as_ptr().add(h * HALF) as *const __m256i)
                });
                for (r, s) in isum.iter_mut().enumerate() {
                    let p = codes[r].as_ptr().add(b * 32 + 4 * q) as *const i32;
                    let w = _mm256_set1_epi32(p.read_unaligned());
                    if SIGNED {
                        let w = _mm256_xor_si256(w, flip);
                        let mag = _mm256_abs_epi8(w);
                        for (s, &xv) in s.iter_mut().zip(&xv) {
                            let xs = _mm256_sign_epi8(xv, w);
                            let p = _mm256_madd_epi16(_mm256_maddubs_epi16(mag, xs), ones);
                            *s = _mm256_add_epi32(*s, p);
                        }
                    } else {
                        for (s, &xv) in s.iter_mut().zip(&xv) {
                            let p = _mm256_madd_epi16(_mm256_maddubs_epi16(w, xv), ones);
                            *s = _mm256_add_epi32(*s, p);
                        }
                    }
                }
            }
            for h in 0..2 {
                let dx = _mm256_loadu_ps(xb.dx.as_ptr().add(h * HALF));
                for r in 0..R {
                    let scale = _mm256_mul_ps(_mm256_set1_ps(*dw[r].get_unchecked(b)), dx);
                    let term = _mm256_mul_ps(_mm256_cvtepi32_ps(isum[r][h]), scale);
                    a[r][h] = _mm256_add_ps(a[r][h], term);
                }
            }
        }
    }
    for (acc, a) in acc.iter_mut().zip(a) {
        for (h, a) in a.into_iter().enumerate() {
            // SAFETY: as the load above.
            unsafe { _mm256_storeu_ps(acc[g].as_mut_ptr().add(h * HALF), a) };
        }
    }
}
