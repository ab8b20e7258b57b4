//! The AVX-512 kernel for sixteen interleaved Q4_0 rows (see [`crate::interleaved`]): a 32-bit
//! lane is a row, and one call takes up to [`TOKENS`] tokens.
//!
//! Per block of the chunk: the sixteen f16 scales convert in one `vcvtph2ps`; each of the four
//! 64-byte loads of codes holds four bytes of every row, whose low nibbles are codes `4i..4i+4`
//! and high nibbles codes `16+4i..16+4i+4`. The masked halves are made once per block and kept
//! in registers; for each token, each meets the matching four activation codes, broadcast to
//! every lane, in one `vpdpbusd`, in two chains (low and high nibbles) that start from the
//! block's offset correction. The integer sum is exact, and the float work is the reference's
//! `s + isum·(d_w·d_x)` in block order, so every row's sum is the scalar reference's bit for
//! bit, whatever tokens share the call.
//!
//! Several tokens per call matter when a server decodes several sequences together: one token
//! spends about as many instructions unpacking the weights as multiplying them, and the
//! unpacking is shared. Eight tokens keep 8 accumulators, 8 unpacked halves and the scales in
//! 18 of the 32 registers.

use std::arch::x86_64::*;

use kiln_format::{BlockQ4_0x16, GROUP_ROWS};

use super::float::with_prefetch_hint;
use crate::interleaved::GroupX;
use crate::stream::Hint;

/// The most tokens one call takes.
pub(crate) const TOKENS: usize = 8;

/// `out[t][r] = Σ_b isum(w[b], row r; x[t·nb + b])·(d_r·dx)`, blocks in order, for each token
/// `t < T` (`nb = w.len()`).
///
/// # Safety
/// AVX-512 F/BW/VNNI and F16C are enabled, and `x.len() == T·w.len()`.
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
        let mask = _mm512_set1_epi8(0x0f);
        let mut acc = [_mm512_setzero_ps(); T];
        for (b, g) in w.iter().enumerate() {
            if ahead_groups != 0 {
                let ahead = w.as_ptr().wrapping_add(b + ahead_groups) as *const i8;
                for line in 0..5 {
                    _mm_prefetch::<H>(ahead.wrapping_add(64 * line));
                }
            }
            let d = _mm512_cvtph_ps(_mm256_loadu_si256(g.d.as_ptr() as *const __m256i));
            let codes = g.qs.as_ptr() as *const __m512i;
            let mut wl = [_mm512_setzero_si512(); 4];
            let mut wh = [_mm512_setzero_si512(); 4];
            for i in 0..4 {
                let v = _mm512_loadu_si512(codes.add(i));
                wl[i] = _mm512_and_si512(v, mask);
                wh[i] = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
            }
            for (t, acc) in acc.iter_mut().enumerate() {
                let xb = x.get_unchecked(t * nb + b);
                let xq = xb.qs.as_ptr() as *const i32;
                let mut lo = _mm512_set1_epi32(xb.corr);
                let mut hi = _mm512_setzero_si512();
                for i in 0..4 {
                    let xl = _mm512_set1_epi32(xq.add(i).read_unaligned());
                    let xh = _mm512_set1_epi32(xq.add(4 + i).read_unaligned());
                    lo = _mm512_dpbusd_epi32(lo, wl[i], xl);
                    hi = _mm512_dpbusd_epi32(hi, wh[i], xh);
                }
                let isum = _mm512_cvtepi32_ps(_mm512_add_epi32(lo, hi));
                let scale = _mm512_mul_ps(d, _mm512_set1_ps(xb.dx));
                *acc = _mm512_add_ps(*acc, _mm512_mul_ps(isum, scale));
            }
        }
        let mut out = [[0.0f32; GROUP_ROWS]; T];
        for (o, a) in out.iter_mut().zip(acc) {
            _mm512_storeu_ps(o.as_mut_ptr(), a);
        }
        out
    }
}
