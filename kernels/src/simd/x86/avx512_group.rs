//! The AVX-512 one-token kernel for sixteen interleaved Q4_0 rows (see [`crate::interleaved`]):
//! a 32-bit lane is a row.
//!
//! Per block of the chunk: the sixteen f16 scales convert in one `vcvtph2ps`; each of the four
//! 64-byte loads of codes holds four bytes of every row, whose low nibbles are codes `4i..4i+4`
//! and high nibbles codes `16+4i..16+4i+4`; each masked half meets the matching four activation
//! codes, broadcast to every lane, in one `vpdpbusd`, in two chains (low and high nibbles)
//! that start from the block's offset correction. The integer sum is exact, and the float work
//! is the reference's `s + isum·(d_w·d_x)` in block order, so every row's sum is the scalar
//! reference's bit for bit.

use std::arch::x86_64::*;

use kiln_format::{BlockQ4_0x16, GROUP_ROWS};

use super::float::with_prefetch_hint;
use crate::interleaved::GroupX;
use crate::stream::Hint;

/// `out[r] = Σ_b isum(w[b], row r; x[b])·(d_r·dx_b)`, blocks in order.
///
/// # Safety
/// AVX-512 F/BW/VNNI and F16C are enabled, and `w.len() == x.len()`.
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
        let mask = _mm512_set1_epi8(0x0f);
        let mut acc = _mm512_setzero_ps();
        for (b, (g, xb)) in w.iter().zip(x).enumerate() {
            if ahead_groups != 0 {
                let ahead = w.as_ptr().wrapping_add(b + ahead_groups) as *const i8;
                for line in 0..5 {
                    _mm_prefetch::<H>(ahead.wrapping_add(64 * line));
                }
            }
            let d = _mm512_cvtph_ps(_mm256_loadu_si256(g.d.as_ptr() as *const __m256i));
            let codes = g.qs.as_ptr() as *const __m512i;
            let xq = xb.qs.as_ptr() as *const i32;
            let mut lo = _mm512_set1_epi32(xb.corr);
            let mut hi = _mm512_setzero_si512();
            for i in 0..4 {
                let v = _mm512_loadu_si512(codes.add(i));
                let wl = _mm512_and_si512(v, mask);
                let wh = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
                lo = _mm512_dpbusd_epi32(lo, wl, _mm512_set1_epi32(xq.add(i).read_unaligned()));
                hi = _mm512_dpbusd_epi32(hi, wh, _mm512_set1_epi32(xq.add(4 + i).read_unaligned()));
            }
            let isum = _mm512_cvtepi32_ps(_mm512_add_epi32(lo, hi));
            let scale = _mm512_mul_ps(d, _mm512_set1_ps(xb.dx));
            acc = _mm512_add_ps(acc, _mm512_mul_ps(isum, scale));
        }
        let mut out = [0.0f32; GROUP_ROWS];
        _mm512_storeu_ps(out.as_mut_ptr(), acc);
        out
    }
}
