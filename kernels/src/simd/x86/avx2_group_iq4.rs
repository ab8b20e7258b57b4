//! The AVX2 kernel for sixteen interleaved IQ4_NL rows (`iq4_nlx16`, see
//! [`crate::interleaved`]): a 32-bit lane is a row, rows 0–7 in one 256-bit half and rows
//! 8–15 in the other, and one call takes up to [`TOKENS`] tokens. The AVX-512 tier runs it
//! too.
//!
//! One `pshufb` per nibble half turns four indices of every row into grid values
//! (−127..=113). `vpmaddubsw` wants one unsigned side, so the grid values go in as their
//! magnitudes and the broadcast activation codes take their signs (`vpsignb`): a pair of
//! products is at most `2·127·127 = 32258`, inside `i16`, but two pairs are not, so each
//! `vpmaddubsw` is widened by `vpmaddwd` with ones before it is added. The integer sum of a
//! block is exact.
//!
//! The float work is the reference's ([`crate::reference::dot_iq4_nl_q8_0_ref`]): block `b`'s
//! term `isum·(d_w·d_x)` goes into accumulator `b % 8`, and the eight are added in
//! [`crate::reference::sum_lanes8`]'s order, lane by lane. So every row's sum is the plain
//! IQ4_NL rows' bits, whatever tokens share the call. The accumulators (sixteen registers a
//! token) live on the stack; each is touched once per eight blocks.

use std::arch::x86_64::*;

use kiln_format::iq4::IQ4_GRID;
use kiln_format::{BlockQ4_0x16, GROUP_ROWS};

use super::float::with_prefetch_hint;
use crate::interleaved::GroupX;
use crate::reference::BLOCK_LANES;
use crate::stream::Hint;

/// The most tokens one call takes.
pub(crate) const TOKENS: usize = 4;

/// `out[t][r] = Σ_b isum(w[b], row r; x[t·nb + b])·(d_r·dx)`, in the reference's eight
/// accumulators, for each token `t < T` (`nb = w.len()`; the groups' nibbles are IQ4_NL
/// indices).
///
/// # Safety
/// AVX2, FMA and F16C are enabled, and `x.len() == T·w.len()`.
#[inline(always)]
pub(crate) unsafe fn matvec<const T: usize>(
    w: &[BlockQ4_0x16],
    x: &[GroupX],
) -> [[f32; GROUP_ROWS]; T] {
    // The same stream as interleaved Q4_0's: groups of the same size.
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
    // SAFETY: every pointer read below is inside `w[b]`, `x[t·nb + b]` for b < nb, t < T
    // (caller contract: x.len() == T·nb) or the sixteen-byte grid; a prefetch of an address
    // past the end is only a hint and never faults; features enabled (caller contract).
    unsafe {
        let mask = _mm256_set1_epi8(0x0f);
        let ones = _mm256_set1_epi16(1);
        let grid =
            _mm256_broadcastsi128_si256(_mm_loadu_si128(IQ4_GRID.as_ptr() as *const __m128i));
        // acc[k][t][h]: token t's terms of blocks b ≡ k (mod 8), rows 8h..8h + 8.
        let mut acc = [[[_mm256_setzero_ps(); 2]; T]; BLOCK_LANES];
        for (b, g) in w.iter().enumerate() {
            if ahead_groups != 0 {
                let ahead = w.as_ptr().wrapping_add(b + ahead_groups) as *const i8;
                for line in 0..5 {
                    _mm_prefetch::<H>(ahead.wrapping_add(64 * line));
                }
            }
            let codes = g.qs.as_ptr() as *const __m256i;
            let acc = &mut acc[b % BLOCK_LANES];
            for h in 0..2 {
                let mut p = [_mm256_setzero_si256(); T];
                for i in 0..4 {
                    let v = _mm256_loadu_si256(codes.add(2 * i + h));
                    let wl = _mm256_shuffle_epi8(grid, _mm256_and_si256(v, mask));
                    let wh =
                        _mm256_shuffle_epi8(grid, _mm256_and_si256(_mm256_srli_epi16(v, 4), mask));
                    // No grid value is 0, so `|w|·sign(x, w)` is `w·x` for every code.
                    let (al, ah) = (_mm256_abs_epi8(wl), _mm256_abs_epi8(wh));
                    for (t, p) in p.iter_mut().enumerate() {
                        let xq = x.get_unchecked(t * nb + b).qs.as_ptr() as *const i32;
                        let xl = _mm256_set1_epi32(xq.add(i).read_unaligned());
                        let xh = _mm256_set1_epi32(xq.add(4 + i).read_unaligned());
                        let sl = _mm256_maddubs_epi16(al, _mm256_sign_epi8(xl, wl));
                        let sh = _mm256_maddubs_epi16(ah, _mm256_sign_epi8(xh, wh));
                        *p = _mm256_add_epi32(*p, _mm256_madd_epi16(sl, ones));
                        *p = _mm256_add_epi32(*p, _mm256_madd_epi16(sh, ones));
                    }
                }
                let d = _mm256_cvtph_ps(_mm_loadu_si128(g.d.as_ptr().add(8 * h) as *const __m128i));
                for (t, (p, acc)) in p.iter().zip(acc.iter_mut()).enumerate() {
                    let dx = x.get_unchecked(t * nb + b).dx;
                    let term =
                        _mm256_mul_ps(_mm256_cvtepi32_ps(*p), _mm256_mul_ps(d, _mm256_set1_ps(dx)));
                    acc[h] = _mm256_add_ps(acc[h], term);
                }
            }
        }
        sum_accumulators(&acc)
    }
}

/// Each token's sixteen row sums from its eight accumulators (`acc[k][t][h]`: terms of blocks
/// `b ≡ k (mod 8)`, rows `8h..8h + 8`), added in [`crate::reference::sum_lanes8`]'s order lane
/// by lane: the end of every interleaved kernel whose reference keeps eight accumulators.
///
/// # Safety
/// AVX is enabled.
#[inline(always)]
pub(super) unsafe fn sum_accumulators<const T: usize>(
    acc: &[[[__m256; 2]; T]; BLOCK_LANES],
) -> [[f32; GROUP_ROWS]; T] {
    let mut out = [[0.0f32; GROUP_ROWS]; T];
    for (t, o) in out.iter_mut().enumerate() {
        for (h, half) in o.chunks_exact_mut(8).enumerate() {
            let a = |k: usize| acc[k][t][h];
            // SAFETY: register adds and a store of eight floats into `half` (eight long);
            // AVX enabled (caller contract).
            unsafe {
                // `sum_lanes8`: ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7)).
                let even = _mm256_add_ps(_mm256_add_ps(a(0), a(4)), _mm256_add_ps(a(2), a(6)));
                let odd = _mm256_add_ps(_mm256_add_ps(a(1), a(5)), _mm256_add_ps(a(3), a(7)));
                _mm256_storeu_ps(half.as_mut_ptr(), _mm256_add_ps(even, odd));
            }
        }
    }
    out
}
