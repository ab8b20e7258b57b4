//! The AVX2 kernel for sixteen interleaved Q4_0 rows (see [`crate::interleaved`]): a 32-bit
//! lane is a row, rows 0–7 in one 256-bit half and rows 8–15 in the other, and one call takes
//! up to [`TOKENS`] tokens.
//!
//! AVX2 has no `vpdpbusd`: `vpmaddubsw` multiplies the unsigned codes by the broadcast
//! activation codes and adds pairs into 16-bit lanes. A block's eight products per row half
//! are added in 16 bits (at most `8·2·15·127 = 30480`, inside `i16`, so nothing saturates)
//! and widened once by `vpmaddwd` with ones, then the block's offset correction is added.
//! Each load of codes is masked once and meets every token of the call. The integer sum is
//! exact and the float work is the reference's `s + isum·(d_w·d_x)` in block order, so every
//! row's sum is the scalar reference's bit for bit, as on AVX-512, whatever tokens share the
//! call. With 16 registers, four tokens' accumulators (eight) are as many as stay put.

use std::arch::x86_64::*;

use kiln_format::{BlockQ4_0x16, GROUP_ROWS};

use super::float::with_prefetch_hint;
use crate::interleaved::GroupX;
use crate::stream::Hint;

/// The most tokens one call takes.
pub(crate) const TOKENS: usize = 4;

/// `out[t][r] = Σ_b isum(w[b], row r; x[t·nb + b])·(d_r·dx)`, blocks in order, for each token
/// `t < T` (`nb = w.len()`).
///
/// # Safety
/// AVX2, FMA and F16C are enabled, and `x.len() == T·w.len()`.
#[inline(always)]
pub(crate) unsafe fn matvec<const T: usize>(
    w: &[BlockQ4_0x16],
    x: &[GroupX],
) -> [[f32; GROUP_ROWS]; T] {
    // Groups ahead of the current one whose weights are asked for (288 bytes each), and the
    // cache level they fill: the CPU's, see `crate::stream`.
    let sp = crate::stream::distances();
    let ahead = sp.q4_0x16.div_ceil(std::mem::size_of::<BlockQ4_0x16>());
    // SAFETY: the caller's contract, passed on.
    unsafe { with_prefetch_hint!(sp.hint.unwrap_or(Hint::T0), matvec_hinted::<T>(w, x, ahead)) }
}

/// [`matvec`], asking for the lines of the group `ahead_groups` ahead (none for 0) with
/// `_mm_prefetch` strategy `H`.
///
/// # Safety
/// As [`matvec`].
#[inline(always)]
unsafe fn matvec_hinted<const T: usize, const H: i32>(
    w: &[BlockQ4_0x16],
    x: &[GroupX],
    ahead_groups: usize,
) -> [[f32; GROUP_ROWS]; T] {
    let nb = w.len();
    // SAFETY: every pointer read below is inside `w[b]` or `x[t·nb + b]` for b < nb, t < T
    // (caller contract: x.len() == T·nb); a prefetch of an address past the end is only a hint
    // and never faults; features enabled (caller contract).
    unsafe {
        let mask = _mm256_set1_epi8(0x0f);
        let ones = _mm256_set1_epi16(1);
        let mut acc = [[_mm256_setzero_ps(); 2]; T];
        for (b, g) in w.iter().enumerate() {
            if ahead_groups != 0 {
                let ahead = w.as_ptr().wrapping_add(b + ahead_groups) as *const i8;
                for line in 0..5 {
                    _mm_prefetch::<H>(ahead.wrapping_add(64 * line));
                }
            }
            let codes = g.qs.as_ptr() as *const __m256i;
            for h in 0..2 {
                let mut p = [_mm256_setzero_si256(); T];
                for i in 0..4 {
                    let v = _mm256_loadu_si256(codes.add(2 * i + h));
                    let wl = _mm256_and_si256(v, mask);
                    let wh = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
                    for (t, p) in p.iter_mut().enumerate() {
                        let xq = x.get_unchecked(t * nb + b).qs.as_ptr() as *const i32;
                        let xl = _mm256_set1_epi32(xq.add(i).read_unaligned());
                        let xh = _mm256_set1_epi32(xq.add(4 + i).read_unaligned());
                        *p = _mm256_add_epi16(*p, _mm256_maddubs_epi16(wl, xl));
                        *p = _mm256_add_epi16(*p, _mm256_maddubs_epi16(wh, xh));
                    }
                }
                let d = _mm256_cvtph_ps(_mm_loadu_si128(g.d.as_ptr().add(8 * h) as *const __m128i));
                for (t, (p, acc)) in p.iter().zip(acc.iter_mut()).enumerate() {
                    let xb = x.get_unchecked(t * nb + b);
                    let isum =
                        _mm256_add_epi32(_mm256_madd_epi16(*p, ones), _mm256_set1_epi32(xb.corr));
                    let prod = _mm256_mul_ps(
                        _mm256_cvtepi32_ps(isum),
                        _mm256_mul_ps(d, _mm256_set1_ps(xb.dx)),
                    );
                    acc[h] = _mm256_add_ps(acc[h], prod);
                }
            }
        }
        let mut out = [[0.0f32; GROUP_ROWS]; T];
        for (o, a) in out.iter_mut().zip(acc) {
            _mm256_storeu_ps(o.as_mut_ptr(), a[0]);
            _mm256_storeu_ps(o.as_mut_ptr().add(8), a[1]);
        }
        out
    }
}
