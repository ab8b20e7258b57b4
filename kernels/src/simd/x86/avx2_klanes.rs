//! The AVX2 K-quant lanes kernel: one super-block of four weight rows against sixteen or
//! thirty-two tokens, a token per 32-bit lane, eight tokens a vector (see [`crate::klanes`]).
//!
//! AVX2 has no `vpdpbusd`: `vpmaddubsw` adds pairs of unsigned-code × signed-activation
//! products into 16-bit lanes, exact for codes up to 63 (`2·63·128 < 32767`, Q6_K's widest),
//! and `vpmaddwd` by the broadcast sub-block scale (|sc| ≤ 128) then adds those pairs into
//! 32-bit lanes already scaled, so a sub-block costs no separate multiply. IQ4_XS's codes
//! (grid values plus 128, up to 241) would overflow that, so the kernel takes them back to the
//! signed grid values (a flip of the top bit) and multiplies signed by signed: `|x|` (unsigned,
//! at most 128) times the grid value with `x`'s sign (`vpsignb`), pairs at most 2·128·127, no
//! saturation; the sums are then already the grid values', and the stored −128 offset is not
//! applied. The mins (or the offset) of the other kinds take one `vpmaddwd` per pair of
//! activation sums. Every sum is exact and the float work is the reference's, as in the
//! AVX-512 kernel.

use std::arch::x86_64::*;

use crate::klanes::{pair_word, KKind, KLaneBlock, KLaneRow, KSUBS};
use crate::lanes::{LanesAcc, LANES};
use crate::tile::TILE_ROWS;

/// Tokens per AVX2 vector of 32-bit lanes.
const HALF: usize = 8;

/// Tokens `8h..8h + 8` of one group against the four rows: [`crate::reference::klanes::ktile_ref`]'s
/// terms added to `acc[r]`.
///
/// # Safety
/// AVX2 is enabled.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn half_tile<const SUB: usize, const AFFINE: bool, const WIDE: bool>(
    rows: &[&KLaneRow; TILE_ROWS],
    x: &KLaneBlock,
    h: usize,
    acc: &mut [[f32; LANES]; TILE_ROWS],
) {
    const R: usize = TILE_ROWS;
    let lane0 = h * HALF;
    let zero = _mm256_setzero_si256();
    let flip = _mm256_set1_epi8(i8::MIN);
    let mut isum = [zero; R];
    for s in 0..KSUBS * 16 / SUB {
        // |sc| ≤ 128: i16 factors.
        let sc: [__m256i; R] = std::array::from_fn(|r| _mm256_set1_epi16(rows[r].scales[s] as i16));
        for q in s * SUB / 4..(s + 1) * SUB / 4 {
            // SAFETY: `codes[q]` holds LANES words and lane0 + 8 <= LANES.
            let xv =
                unsafe { _mm256_loadu_si256(x.codes[q].as_ptr().add(lane0) as *const __m256i) };
            let ax = _mm256_abs_epi8(xv);
            for r in 0..R {
                // SAFETY: codes 4q..4q + 4 of the row's 256; read unaligned.
                let word =
                    unsafe { (rows[r].codes.as_ptr().add(4 * q) as *const i32).read_unaligned() };
                let w = _mm256_set1_epi32(word);
                let p = if WIDE {
                    // Stored plus 128: the top bit flipped gives the signed grid value `g`.
                    // `x`'s sign is applied first and the top bit flipped after, which is the
                    // same bytes (a flip adds 128 modulo 256, and negation commutes with it
                    // modulo 256; the result −113..=127 fits), except where `x` is zero and
                    // `|x|` zeroes the product anyway: so the word broadcasts straight from
                    // memory instead of through a shuffle.
                    let gx = _mm256_xor_si256(_mm256_sign_epi8(w, xv), flip);
                    _mm256_maddubs_epi16(ax, gx)
                } else {
                    _mm256_maddubs_epi16(w, xv)
                };
                isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(p, sc[r]));
            }
        }
    }
    let mut mins = [zero; R];
    // The wide kind's sums are of the signed grid values already: its offset term stays out.
    for k in (0..KSUBS / 2).filter(|_| !WIDE) {
        // SAFETY: `bsums[k]` holds LANES words and lane0 + 8 <= LANES.
        let bv = unsafe { _mm256_loadu_si256(x.bsums[k].as_ptr().add(lane0) as *const __m256i) };
        for r in 0..R {
            let p = _mm256_madd_epi16(_mm256_set1_epi32(pair_word(rows[r].pairs[k])), bv);
            if AFFINE {
                mins[r] = _mm256_add_epi32(mins[r], p);
            } else {
                isum[r] = _mm256_add_epi32(isum[r], p);
            }
        }
    }
    // SAFETY: `dx` holds LANES f32 and lane0 + 8 <= LANES.
    let dx = unsafe { _mm256_loadu_ps(x.dx.as_ptr().add(lane0)) };
    for r in 0..R {
        let dxd = _mm256_mul_ps(dx, _mm256_set1_ps(rows[r].d));
        let mut term = _mm256_mul_ps(dxd, _mm256_cvtepi32_ps(isum[r]));
        if AFFINE {
            let dxm = _mm256_mul_ps(dx, _mm256_set1_ps(rows[r].dmin));
            term = _mm256_sub_ps(term, _mm256_mul_ps(dxm, _mm256_cvtepi32_ps(mins[r])));
        }
        // SAFETY: `acc[r]` holds LANES f32 and lane0 + 8 <= LANES.
        unsafe {
            let a = acc[r].as_mut_ptr().add(lane0);
            _mm256_storeu_ps(a, _mm256_add_ps(_mm256_loadu_ps(a), term));
        }
    }
}

/// [`crate::klanes::KLanesFn`] at AVX2.
///
/// # Safety
/// AVX2 is enabled.
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn ktile(
    kind: KKind,
    rows: &[&KLaneRow; TILE_ROWS],
    x0: &KLaneBlock,
    x1: Option<&KLaneBlock>,
    acc: &mut LanesAcc,
) {
    for (g, x) in std::iter::once(x0).chain(x1).enumerate() {
        let mut a: [[f32; LANES]; TILE_ROWS] = std::array::from_fn(|r| acc[r][g]);
        for h in 0..LANES / HALF {
            // SAFETY: features enabled (caller contract).
            unsafe {
                match kind {
                    KKind::Affine32 => half_tile::<32, true, false>(rows, x, h, &mut a),
                    KKind::Affine16 => half_tile::<16, true, false>(rows, x, h, &mut a),
                    KKind::Offset16 => half_tile::<16, false, false>(rows, x, h, &mut a),
                    KKind::Offset32 => half_tile::<32, false, true>(rows, x, h, &mut a),
                }
            }
        }
        for (acc, a) in acc.iter_mut().zip(a) {
            acc[g] = a;
        }
    }
}
