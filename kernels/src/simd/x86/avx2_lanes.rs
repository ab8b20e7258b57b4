//! The AVX2 lanes kernel: four weight rows against sixteen or thirty-two tokens, a token per
//! 32-bit lane, eight tokens a vector (see [`crate::lanes`] for the layouts).
//!
//! AVX2 has no `vpdpbusd`. Its unsigned × signed byte product, `vpmaddubsw`, adds pairs of
//! products into saturating 16-bit lanes, which is exact while `2·code·127 ≤ 32767`, i.e. for
//! codes up to 127, and `vpmaddwd` by ones widens those pairs to 32 bits. Both are multiplies,
//! and this kernel is bound by them, so the fewer the better:
//! - Small codes (Q4_0's offset codes are at most 15, Q5_0's at most 31) leave room in the 16-bit
//!   lanes: a run of `L` groups of four codes adds its `vpmaddubsw` pairs in 16 bits
//!   (`2·L·max_code·127 ≤ 32767`: the whole block for Q4_0, half a block for Q5_0) and
//!   widens once, one `vpmaddwd` per run instead of per group; the block's `corr` removes the
//!   offset.
//! - Codes above 127 only come from the encodings offset by 128 (Q8_0, IQ4_NL), whose weights
//!   are then the codes with the top bit flipped (−128..=127): a call with them multiplies the
//!   weights' magnitudes by the activations with the weights' signs (`vpsignb`), exact because
//!   Q8_0 activations lie in −127..=127 (`2·128·127 ≤ 32767`), and needs no `corr`. The two
//!   halves of a token group share each broadcast weight word and its magnitude.
//!
//! Either way the integer sums are exact, and the float work is the scalar reference's
//! `s + isum·(d_w·d_x)` in block order, so every lane is the reference's bits, as with the
//! AVX-512 kernel.

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
/// `32 · x[0].len()` bytes and `dw[r]` `x[0].len()` scales for every row. (Codes above
/// `max_code`, or above 127 where the encoding's offset is not 128, or activations outside
/// −127..=127, give wrong sums, never undefined behaviour.)
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn tile<const G: usize>(
    codes: &[&[u8]; TILE_ROWS],
    dw: &[&[f32]; TILE_ROWS],
    max_code: u8,
    x: [&[LaneBlock]; G],
    acc: &mut LanesAcc,
) {
    for (g, xg) in x.iter().enumerate() {
        // SAFETY: features enabled; lengths as the caller guarantees.
        unsafe {
            match max_code {
                0..=15 => runs_tile::<8>(codes, dw, xg, acc, g),
                16..=31 => runs_tile::<4>(codes, dw, xg, acc, g),
                32..=63 => runs_tile::<2>(codes, dw, xg, acc, g),
                64..=127 => group_tile::<false>(codes, dw, xg, acc, g),
                128..=255 => group_tile::<true>(codes, dw, xg, acc, g),
            }
        }
    }
}

/// The sixteen tokens of group `g` against the four rows, for unsigned codes small enough
/// that `L` groups of four codes add in 16 bits (`2·L·code·127 ≤ 32767`): two rows at a time
/// against both halves of eight tokens, each run of `L` groups widened to 32 bits by one
/// `vpmaddwd`.
///
/// Why two rows by sixteen tokens rather than four rows by eight: the kernel is bound by
/// instructions issued, three (broadcast, `vpmaddubsw`, `vpaddw`) for every 32 products. Both
/// halves share each broadcast weight word, so a block costs an eighth fewer instructions,
/// and the twelve running sums (two rows × two halves; 16-bit, 32-bit and float) fit the
/// sixteen registers, where four rows' code spilled registers to the stack every block.
///
/// # Safety
/// As [`tile`].
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn runs_tile<const L: usize>(
    codes: &[&[u8]; TILE_ROWS],
    dw: &[&[f32]; TILE_ROWS],
    x: &[LaneBlock],
    acc: &mut LanesAcc,
    g: usize,
) {
    const R: usize = 2;
    let ones = _mm256_set1_epi16(1);
    for r0 in (0..TILE_ROWS).step_by(R) {
        let mut a: [[__m256; 2]; R] = std::array::from_fn(|i| {
            std::array::from_fn(|h| {
                // SAFETY: `acc[r][g]` holds LANES = 2·HALF f32; features enabled.
                unsafe { _mm256_loadu_ps(acc[r0 + i][g].as_ptr().add(h * HALF)) }
            })
        });
        for (b, xb) in x.iter().enumerate() {
            // SAFETY: xb's fields hold LANES entries (4 bytes of codes each) and h·HALF + 8 <=
            // LANES; row r's codes hold 32·nb bytes and its scales nb, b < nb (caller
            // contract).
            unsafe {
                let corr: [__m256i; 2] = std::array::from_fn(|h| {
                    _mm256_loadu_si256(xb.corr.as_ptr().add(h * HALF) as *const __m256i)
                });
                let mut isum = [corr; R];
                for run in 0..QK_GROUPS / L {
                    let mut s16 = [[_mm256_setzero_si256(); 2]; R];
                    for q in run * L..(run + 1) * L {
                        let xv: [__m256i; 2] = std::array::from_fn(|h| {
                            _mm256_loadu_si256(xb.codes[q].as_ptr().add(h * HALF) as *const __m256i)
                        });
                        for (i, s) in s16.iter_mut().enumerate() {
                            let p = codes[r0 + i].as_ptr().add(b * 32 + 4 * q) as *const i32;
                            let w = _mm256_set1_epi32(p.read_unaligned());
                            for (s, &xv) in s.iter_mut().zip(&xv) {
                                *s = _mm256_add_epi16(*s, _mm256_maddubs_epi16(w, xv));
                            }
                        }
                    }
                    for (i, s) in isum.iter_mut().zip(s16) {
                        for (i, s) in i.iter_mut().zip(s) {
                            *i = _mm256_add_epi32(*i, _mm256_madd_epi16(s, ones));
                        }
                    }
                }
                let dx: [__m256; 2] =
                    std::array::from_fn(|h| _mm256_loadu_ps(xb.dx.as_ptr().add(h * HALF)));
                for (i, (a, isum)) in a.iter_mut().zip(isum).enumerate() {
                    let d = _mm256_set1_ps(*dw[r0 + i].get_unchecked(b));
                    for ((a, isum), &dx) in a.iter_mut().zip(isum).zip(&dx) {
                        let scale = _mm256_mul_ps(d, dx);
                        let term = _mm256_mul_ps(_mm256_cvtepi32_ps(isum), scale);
                        *a = _mm256_add_ps(*a, term);
                    }
                }
            }
        }
        for (i, a) in a.into_iter().enumerate() {
            for (h, a) in a.into_iter().enumerate() {
                // SAFETY: as the load above.
                unsafe { _mm256_storeu_ps(acc[r0 + i][g].as_mut_ptr().add(h * HALF), a) };
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
