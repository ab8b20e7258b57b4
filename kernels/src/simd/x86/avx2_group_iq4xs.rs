//! The AVX2 kernel for sixteen interleaved IQ4_XS rows (`iq4_xsx16`, see
//! [`crate::interleaved`]): a 32-bit lane is a row, rows 0–7 in one 256-bit half and rows
//! 8–15 in the other, and one call takes up to [`TOKENS`] tokens' Q8_K rows. The AVX-512 tier
//! runs it too.
//!
//! A 32-weight sub-block goes as an interleaved IQ4_NL block does
//! ([`super::avx2_group_iq4`]): one `pshufb` per nibble half turns four indices of every row
//! into grid values. Q8_K's codes reach −128, which `vpsignb` cannot negate, so here the
//! activations go in as magnitudes (`|−128|` is 128 unsigned) and the grid values take their
//! signs: a pair of products is at most `2·128·127 = 32512`, inside `i16`. The widening
//! `vpmaddwd` multiplies by the sub-block's 6-bit scale `ls − 32` (held in both halves of a
//! lane) instead of by ones, so the scale costs no instruction of its own. A row's super-block
//! sum `Σ_s (ls_s − 32)·dot_s` stays below `2³¹` (at most `256·128·127·32`) and is exact.
//!
//! The float work is the reference's ([`crate::reference::dot_iq4_xs_q8_k_ref`]): super-block
//! `b`'s term `isum·(d_w·d_x)` goes into accumulator `b % 8`, and the eight are added in
//! [`crate::reference::sum_lanes8`]'s order, lane by lane. So every row's sum is the plain
//! IQ4_XS rows' bits, whatever tokens share the call.

use std::arch::x86_64::*;

use kiln_format::iq4::IQ4_GRID;
use kiln_format::{BlockIQ4XSx16, BlockQ8K, GROUP_ROWS, QK};

use super::float::with_prefetch_hint;
use crate::reference::BLOCK_LANES;
use crate::stream::Hint;

/// The most tokens one call takes.
pub(crate) const TOKENS: usize = 4;

/// Bytes of a group per sub-block: the prefetches go this far for each.
const SUB_BYTES: usize = std::mem::size_of::<BlockIQ4XSx16>() / (kiln_format::QK_K / QK);

/// `out[t][r] = Σ_b isum(w[b], row r; x[t·nb + b])·(d_r·d_x)`, in the reference's eight
/// accumulators, for each token `t < T` (`nb = w.len()`).
///
/// # Safety
/// AVX2, FMA and F16C are enabled, and `x.len() == T·w.len()`.
#[inline(always)]
pub(crate) unsafe fn matvec<const T: usize>(
    w: &[BlockIQ4XSx16],
    x: &[BlockQ8K],
) -> [[f32; GROUP_ROWS]; T] {
    // The interleaved weights' distance, in bytes.
    let sp = crate::stream::distances();
    // SAFETY: the caller's contract, passed on.
    unsafe {
        with_prefetch_hint!(
            sp.hint.unwrap_or(Hint::T0),
            matvec_hinted::<T>(w, x, sp.q4_0x16)
        )
    }
}

/// Sub-block `s`'s scales `ls − 32` of eight rows, each in both 16-bit halves of its lane:
/// `lo` holds the rows' `scales_l` (sub-block `s`'s four bits at bit `4s`), `hi` their
/// `scales_h` (two bits at `2s`).
///
/// # Safety
/// AVX2 is enabled.
#[inline(always)]
unsafe fn sub_scales(lo: __m256i, hi: __m256i, s: usize) -> __m256i {
    // SAFETY: register operations only; AVX2 enabled (caller contract).
    unsafe {
        let l = _mm256_and_si256(
            _mm256_srl_epi32(lo, _mm_cvtsi32_si128(4 * s as i32)),
            _mm256_set1_epi32(15),
        );
        let h = _mm256_and_si256(
            _mm256_srl_epi32(hi, _mm_cvtsi32_si128(2 * s as i32)),
            _mm256_set1_epi32(3),
        );
        let ls = _mm256_sub_epi32(
            _mm256_or_si256(l, _mm256_slli_epi32(h, 4)),
            _mm256_set1_epi32(32),
        );
        _mm256_or_si256(
            _mm256_and_si256(ls, _mm256_set1_epi32(0xffff)),
            _mm256_slli_epi32(ls, 16),
        )
    }
}

/// [`matvec`], asking for the lines `ahead` bytes on (none for 0) with `_mm_prefetch`
/// strategy `H`.
///
/// # Safety
/// As [`matvec`].
#[inline(always)]
unsafe fn matvec_hinted<const T: usize, const H: i32>(
    w: &[BlockIQ4XSx16],
    x: &[BlockQ8K],
    ahead: usize,
) -> [[f32; GROUP_ROWS]; T] {
    let nb = w.len();
    // SAFETY: every pointer read below is inside `w[b]`, `x[t·nb + b]` for b < nb, t < T
    // (caller contract: x.len() == T·nb) or the sixteen-byte grid; a prefetch of an address
    // past the end is only a hint and never faults; features enabled (caller contract).
    unsafe {
        let mask = _mm256_set1_epi8(0x0f);
        let grid =
            _mm256_broadcastsi128_si256(_mm_loadu_si128(IQ4_GRID.as_ptr() as *const __m128i));
        // acc[k][t][h]: token t's terms of super-blocks b ≡ k (mod 8), rows 8h..8h + 8.
        let mut acc = [[[_mm256_setzero_ps(); 2]; T]; BLOCK_LANES];
        for (b, g) in w.iter().enumerate() {
            let at = (g as *const BlockIQ4XSx16).cast::<i8>();
            let hi: [__m256i; 2] = std::array::from_fn(|h| {
                _mm256_cvtepu16_epi32(_mm_loadu_si128(
                    g.scales_h.as_ptr().add(8 * h) as *const __m128i
                ))
            });
            let lo: [__m256i; 2] = std::array::from_fn(|h| {
                _mm256_loadu_si256(g.scales_l.as_ptr().add(8 * h) as *const __m256i)
            });
            let mut isum = [[_mm256_setzero_si256(); 2]; T];
            for (s, qs) in g.qs.iter().enumerate() {
                if ahead != 0 {
                    let p = at.wrapping_add(ahead + SUB_BYTES * s);
                    for line in 0..SUB_BYTES.div_ceil(64) {
                        _mm_prefetch::<H>(p.wrapping_add(64 * line));
                    }
                }
                let codes = qs.as_ptr() as *const __m256i;
                let sc = [sub_scales(lo[0], hi[0], s), sub_scales(lo[1], hi[1], s)];
                for i in 0..4 {
                    // Both halves' grid values, then each token's four codes (the same for
                    // both halves) broadcast once.
                    let w: [(__m256i, __m256i); 2] = std::array::from_fn(|h| {
                        let v = _mm256_loadu_si256(codes.add(2 * i + h));
                        (
                            _mm256_shuffle_epi8(grid, _mm256_and_si256(v, mask)),
                            _mm256_shuffle_epi8(
                                grid,
                                _mm256_and_si256(_mm256_srli_epi16(v, 4), mask),
                            ),
                        )
                    });
                    for (t, isum) in isum.iter_mut().enumerate() {
                        let xq = x.get_unchecked(t * nb + b).qs.as_ptr().add(QK * s) as *const i32;
                        let xl = _mm256_set1_epi32(xq.add(i).read_unaligned());
                        let xh = _mm256_set1_epi32(xq.add(4 + i).read_unaligned());
                        // |x| unsigned (128 for −128) against the grid value with x's sign.
                        let (al, ah) = (_mm256_abs_epi8(xl), _mm256_abs_epi8(xh));
                        for (h, &(wl, wh)) in w.iter().enumerate() {
                            let pl = _mm256_maddubs_epi16(al, _mm256_sign_epi8(wl, xl));
                            let ph = _mm256_maddubs_epi16(ah, _mm256_sign_epi8(wh, xh));
                            isum[h] = _mm256_add_epi32(isum[h], _mm256_madd_epi16(pl, sc[h]));
                            isum[h] = _mm256_add_epi32(isum[h], _mm256_madd_epi16(ph, sc[h]));
                        }
                    }
                }
            }
            let acc = &mut acc[b % BLOCK_LANES];
            for h in 0..2 {
                let d = _mm256_cvtph_ps(_mm_loadu_si128(g.d.as_ptr().add(8 * h) as *const __m128i));
                for (t, (isum, acc)) in isum.iter().zip(acc.iter_mut()).enumerate() {
                    let dx = x.get_unchecked(t * nb + b).d;
                    let term = _mm256_mul_ps(
                        _mm256_cvtepi32_ps(isum[h]),
                        _mm256_mul_ps(d, _mm256_set1_ps(dx)),
                    );
                    acc[h] = _mm256_add_ps(acc[h], term);
                }
            }
        }
        super::avx2_group_iq4::sum_accumulators(&acc)
    }
}
