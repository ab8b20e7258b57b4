//! The AVX2 one-token kernel for sixteen interleaved Q4_0 rows (see [`crate::interleaved`]):
//! a 32-bit lane is a row, rows 0–7 in one 256-bit half and rows 8–15 in the other.
//!
//! AVX2 has no `vpdpbusd`: `vpmaddubsw` multiplies the unsigned codes by the broadcast
//! activation codes and adds pairs into 16-bit lanes. A block's eight products per row half
//! are added in 16 bits (at most `8·2·15·127 = 30480`, inside `i16`, so nothing saturates)
//! and widened once by `vpmaddwd` with ones, then the block's offset correction is added.
//! The integer sum is exact and the float work is the reference's `s + isum·(d_w·d_x)` in
//! block order, so every row's sum is the scalar reference's bit for bit, as on AVX-512.

use std::arch::x86_64::*;

use kiln_format::{BlockQ4_0x16, GROUP_ROWS};

use super::float::with_prefetch_hint;
use crate::interleaved::GroupX;
use crate::stream::Hint;

/// `out[r] = Σ_b isum(w[b], row r; x[b])·(d_r·dx_b)`, blocks in order.
///
/// # Safety
/// AVX2, FMA and F16C are enabled, and `w.len() == x.len()`.
#[inline(always)]
pub(crate) unsafe fn matvec(w: &[BlockQ4_0x16], x: &[GroupX]) -> [f32; GROUP_ROWS] {
    // Groups ahead of the current one whose weights are asked for (288 bytes each), and the
    // cache level they fill: the CPU's, see `crate::stream`.
    let sp = crate::stream::distances();
    let ahead = sp.q4_0x16.div_ceil(std::mem::size_of::<BlockQ4_0x16>());
    // SAFETY: the caller's contract, passed on.
    unsafe { with_prefetch_hint!(sp.hint.unwrap_or(Hint::T0), matvec_hinted(w, x, ahead)) }
}

/// [`matvec`], asking for the lines of the group `ahead_groups` ahead (none for 0) with
/// `_mm_prefetch` strategy `H`.
///
/// # Safety
/// As [`matvec`].
#[inline(always)]
unsafe fn matvec_hinted<const H: i32>(
    w: &[BlockQ4_0x16],
    x: &[GroupX],
    ahead_groups: usize,
) -> [f32; GROUP_ROWS] {
    // SAFETY: every pointer read below is inside `w[b]` or `x[b]` for b < w.len() == x.len()
    // (caller contract); a prefetch of an address past the end is only a hint and never faults;
    // features enabled (caller contract).
    unsafe {
        let mask = _mm256_set1_epi8(0x0f);
        let ones = _mm256_set1_epi16(1);
        let mut acc = [_mm256_setzero_ps(); 2];
        for (b, (g, xb)) in w.iter().zip(x).enumerate() {
            if ahead_groups != 0 {
                let ahead = w.as_ptr().wrapping_add(b + ahead_groups) as *const i8;
                for line in 0..5 {
                    _mm_prefetch::<H>(ahead.wrapping_add(64 * line));
                }
            }
            let xq = xb.qs.as_ptr() as *const i32;
            let codes = g.qs.as_ptr() as *const __m256i;
            let dx = _mm256_set1_ps(xb.dx);
            let corr = _mm256_set1_epi32(xb.corr);
            for (h, acc) in acc.iter_mut().enumerate() {
                let mut p = _mm256_setzero_si256();
                for i in 0..4 {
                    let v = _mm256_loadu_si256(codes.add(2 * i + h));
                    let wl = _mm256_and_si256(v, mask);
                    let wh = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
                    let xl = _mm256_set1_epi32(xq.add(i).read_unaligned());
                    let xh = _mm256_set1_epi32(xq.add(4 + i).read_unaligned());
                    p = _mm256_add_epi16(p, _mm256_maddubs_epi16(wl, xl));
                    p = _mm256_add_epi16(p, _mm256_maddubs_epi16(wh, xh));
                }
                let isum = _mm256_add_epi32(_mm256_madd_epi16(p, ones), corr);
                let d = _mm256_cvtph_ps(_mm_loadu_si128(g.d.as_ptr().add(8 * h) as *const __m128i));
                let prod = _mm256_mul_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(d, dx));
                *acc = _mm256_add_ps(*acc, prod);
            }
        }
        let mut out = [0.0f32; GROUP_ROWS];
        _mm256_storeu_ps(out.as_mut_ptr(), acc[0]);
        _mm256_storeu_ps(out.as_mut_ptr().add(8), acc[1]);
        out
    }
}
