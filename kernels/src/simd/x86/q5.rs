//! The x86 tiers' Q5_0/Q5_1 tile: eight blocks at a time, their terms in the eight lanes of
//! one register.
//!
//! Each group of eight blocks gives eight exact integer sums (one per lane, by a transposing
//! reduction of the eight blocks' partial sums), converted and scaled with the same f32
//! operations as the reference's terms, lane by lane. Q5_1's reference adds block `b`'s term
//! into accumulator `b % 8` ([`crate::reference::BLOCK_LANES`]): lane `b % 8` of an
//! accumulator register. Q5_0's adds them block after block (as Q4_0's, which the lanes
//! kernel reproduces for prefill): the eight terms are added to one sum in block order.
//! Blocks past the last whole group go through the one-block path into the same lanes, so the
//! result is the reference's bits. The activations' sums per block (Q5_0's −16 offset, Q5_1's
//! minimum) are formed once per token and group, shared by the tile's rows.

use std::arch::x86_64::*;

use half::f16;
use kiln_format::{BlockQ5_0, BlockQ5_1, BlockQ8_0};

use crate::reference::KBlock;
use crate::reference::{sum_lanes8, BLOCK_LANES};

/// A Q5_0 or Q5_1 block, as the group kernel reads it.
pub(crate) trait Q5Block: KBlock<X = BlockQ8_0> {
    /// Fifth bits.
    fn qh(&self) -> [u8; 4];
    /// Low nibbles.
    fn qs(&self) -> &[u8; 16];
    /// Eight consecutive blocks' scales (and minima), widened once per row and group.
    type Scales: Copy;
    /// The scales of the eight blocks at `w`.
    ///
    /// # Safety
    /// AVX2 and F16C are enabled; `w` holds at least eight blocks.
    unsafe fn scales(w: &[Self]) -> Self::Scales;
    /// The terms of eight consecutive blocks (lane j: block j) from their scales `ws`, code
    /// sums `qx`, their activation blocks' code sums `sx` and scales `dx`, lane by lane in the
    /// reference's operations.
    ///
    /// # Safety
    /// AVX2 is enabled.
    unsafe fn terms8(ws: Self::Scales, qx: __m256i, sx: __m256i, dx: __m256) -> __m256;
}

/// `field` of the eight blocks at `w`, widened to f32 (exact).
///
/// # Safety
/// AVX and F16C are enabled; `w` holds at least eight blocks.
#[inline(always)]
unsafe fn scales8<W>(w: &[W], field: fn(&W) -> f16) -> __m256 {
    // SAFETY: F16C enabled (caller contract); indices below 8 ≤ w.len() (caller contract).
    unsafe {
        let b = |j: usize| field(w.get_unchecked(j)).to_bits() as i16;
        _mm256_cvtph_ps(_mm_setr_epi16(
            b(0),
            b(1),
            b(2),
            b(3),
            b(4),
            b(5),
            b(6),
            b(7),
        ))
    }
}

impl Q5Block for BlockQ5_0 {
    #[inline(always)]
    fn qh(&self) -> [u8; 4] {
        self.qh
    }
    #[inline(always)]
    fn qs(&self) -> &[u8; 16] {
        &self.qs
    }
    type Scales = __m256;
    #[inline(always)]
    unsafe fn scales(w: &[Self]) -> __m256 {
        // SAFETY: forwarded contract.
        unsafe { scales8(w, |b| b.d) }
    }
    /// `f32(qx − 16·sx) · (d_w·d_x)`: [`crate::reference::term_q5_0`] per lane.
    #[inline(always)]
    unsafe fn terms8(dw: __m256, qx: __m256i, sx: __m256i, dx: __m256) -> __m256 {
        // SAFETY: AVX2 enabled (caller contract); register-only intrinsics.
        unsafe {
            let isum = _mm256_sub_epi32(qx, _mm256_slli_epi32::<4>(sx));
            _mm256_mul_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(dw, dx))
        }
    }
}

impl Q5Block for BlockQ5_1 {
    #[inline(always)]
    fn qh(&self) -> [u8; 4] {
        self.qh
    }
    #[inline(always)]
    fn qs(&self) -> &[u8; 16] {
        &self.qs
    }
    type Scales = (__m256, __m256);
    #[inline(always)]
    unsafe fn scales(w: &[Self]) -> (__m256, __m256) {
        // SAFETY: forwarded contract.
        unsafe { (scales8(w, |b| b.d), scales8(w, |b| b.m)) }
    }
    /// `f32(qx)·(d_w·d_x) + f32(sx)·(m_w·d_x)`: [`crate::reference::term_q5_1`] per lane.
    #[inline(always)]
    unsafe fn terms8((dw, mw): (__m256, __m256), qx: __m256i, sx: __m256i, dx: __m256) -> __m256 {
        // SAFETY: AVX2 enabled (caller contract); register-only intrinsics.
        unsafe {
            _mm256_add_ps(
                _mm256_mul_ps(_mm256_cvtepi32_ps(qx), _mm256_mul_ps(dw, dx)),
                _mm256_mul_ps(_mm256_cvtepi32_ps(sx), _mm256_mul_ps(mw, dx)),
            )
        }
    }
}

/// Lane `j` of the result is the sum of `v[j]`'s eight lanes (exact).
///
/// A transposing reduction that leans on blends, which any vector pipe runs, rather than on
/// horizontal adds, whose two shuffles each go to the shuffle pipes that the kernels' table
/// lookups and scale gathers also need: seven shuffles for eight vectors instead of fourteen.
///
/// # Safety
/// AVX2 is enabled.
#[inline(always)]
pub(crate) unsafe fn reduce8(v: &[__m256i; 8]) -> __m256i {
    // SAFETY: AVX2 enabled (caller contract); register-only intrinsics.
    unsafe {
        // [a01, b01, a23, b23 | a45, b45, a67, b67], where a01 = a[0] + a[1].
        let pair = |a: __m256i, b: __m256i| {
            let x = _mm256_blend_epi32::<0b1010_1010>(a, b);
            let y = _mm256_blend_epi32::<0b1010_1010>(b, a);
            _mm256_add_epi32(x, _mm256_shuffle_epi32::<0xB1>(y))
        };
        // [a0123, b0123, c0123, d0123 | a4567, b4567, c4567, d4567].
        let quad = |ab: __m256i, cd: __m256i| {
            let x = _mm256_blend_epi32::<0b1100_1100>(ab, cd);
            let y = _mm256_blend_epi32::<0b1100_1100>(cd, ab);
            _mm256_add_epi32(x, _mm256_shuffle_epi32::<0x4E>(y))
        };
        let lo = quad(pair(v[0], v[1]), pair(v[2], v[3]));
        let hi = quad(pair(v[4], v[5]), pair(v[6], v[7]));
        _mm256_add_epi32(
            _mm256_blend_epi32::<0b1111_0000>(lo, hi),
            _mm256_permute2x128_si256::<0x21>(lo, hi),
        )
    }
}

/// The 32 codes (0..=31) of a Q5_0/Q5_1 block, weight `j` in byte `j`.
///
/// # Safety
/// AVX2 is enabled.
#[inline(always)]
pub(super) unsafe fn q5_codes(qh: [u8; 4], qs: &[u8; 16]) -> __m256i {
    // SAFETY: AVX2 enabled (caller contract); `qs` is 16 readable bytes.
    unsafe {
        let raw = _mm_loadu_si128(qs.as_ptr() as *const __m128i);
        let m4 = _mm_set1_epi8(0x0f);
        let lo = _mm_and_si128(raw, m4);
        let hi = _mm_and_si128(_mm_srli_epi16(raw, 4), m4);
        let nibbles = _mm256_set_m128i(hi, lo);
        // Byte j gets byte j / 8 of qh; then bit j % 8 of it is tested (GGML's
        // bytes_from_bits_32: all bits but the tested one set, compared with all ones).
        let h = _mm256_set1_epi32(i32::from_le_bytes(qh));
        let spread = _mm256_setr_epi8(
            0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3,
            3, 3, 3,
        );
        let b = _mm256_shuffle_epi8(h, spread);
        let others = _mm256_set1_epi64x(0x7fbf_dfef_f7fb_fdfe_u64 as i64);
        let set = _mm256_cmpeq_epi8(_mm256_or_si256(b, others), _mm256_set1_epi8(-1));
        _mm256_or_si256(nibbles, _mm256_and_si256(set, _mm256_set1_epi8(0x10)))
    }
}

/// [`q5_codes`] of `w`.
///
/// # Safety
/// AVX2 is enabled.
#[inline(always)]
unsafe fn codes<W: Q5Block>(w: &W) -> __m256i {
    // SAFETY: AVX2 enabled (caller contract).
    unsafe { q5_codes(w.qh(), w.qs()) }
}

/// `R` Q5_0/Q5_1 rows against `T` tokens' Q8_0 blocks. `dot(u, x)` gives eight i32 lanes
/// summing to `Σ u_j·x_j` for unsigned codes `u` (at most 31) and signed `x`; `one(w, x)` is
/// one block's exact integer sums, for the blocks past the last group of eight.
///
/// # Safety
/// AVX2, FMA and F16C are enabled (and whatever `dot` and `one` need), and every row and token
/// slice has the same number of blocks.
#[inline(always)]
pub(crate) unsafe fn tile<W: Q5Block, const R: usize, const T: usize>(
    rows: &[&[W]; R],
    xs: &[&[BlockQ8_0]; T],
    dot: impl Fn(__m256i, __m256i) -> __m256i,
    one: impl Fn(&W, &BlockQ8_0) -> W::Ints,
    h: impl Fn(f16) -> f32 + Copy,
) -> [[f32; R]; T] {
    let nb = xs[0].len();
    let groups = nb / BLOCK_LANES;
    // SAFETY: features enabled (caller contract). Group g reads blocks 8g..8g + 8 < nb of every
    // row and token, all of length nb (caller contract).
    unsafe {
        let mut acc = [[_mm256_setzero_ps(); R]; T];
        // The running sums of a sequential encoding (Q5_0).
        let mut sum = [[0f32; R]; T];
        let ones = _mm256_set1_epi8(1);
        for g in 0..groups {
            let b0 = g * BLOCK_LANES;
            let mut sx = [_mm256_setzero_si256(); T];
            let mut dx = [_mm256_setzero_ps(); T];
            for t in 0..T {
                let xb = xs[t].get_unchecked(b0..b0 + BLOCK_LANES);
                let mut v = [_mm256_setzero_si256(); 8];
                for (v, x) in v.iter_mut().zip(xb) {
                    *v = dot(ones, _mm256_loadu_si256(x.qs.as_ptr() as *const __m256i));
                }
                sx[t] = reduce8(&v);
                dx[t] = scales8(xb, |b| b.d);
            }
            for r in 0..R {
                let wb = rows[r].get_unchecked(b0..b0 + BLOCK_LANES);
                let mut q = [_mm256_setzero_si256(); 8];
                for (q, w) in q.iter_mut().zip(wb) {
                    *q = codes(w);
                }
                let ws = W::scales(wb);
                for t in 0..T {
                    let xb = xs[t].get_unchecked(b0..b0 + BLOCK_LANES);
                    let mut v = [_mm256_setzero_si256(); 8];
                    for j in 0..BLOCK_LANES {
                        let x = _mm256_loadu_si256(xb[j].qs.as_ptr() as *const __m256i);
                        v[j] = dot(q[j], x);
                    }
                    let p = W::terms8(ws, reduce8(&v), sx[t], dx[t]);
                    if W::SEQUENTIAL {
                        let mut terms = [0f32; BLOCK_LANES];
                        _mm256_storeu_ps(terms.as_mut_ptr(), p);
                        for term in terms {
                            sum[t][r] += term;
                        }
                    } else {
                        acc[t][r] = _mm256_add_ps(acc[t][r], p);
                    }
                }
            }
        }
        let mut out = [[0f32; R]; T];
        for t in 0..T {
            for r in 0..R {
                let mut lanes = [0f32; BLOCK_LANES];
                _mm256_storeu_ps(lanes.as_mut_ptr(), acc[t][r]);
                for b in groups * BLOCK_LANES..nb {
                    let (w, x) = (rows[r].get_unchecked(b), xs[t].get_unchecked(b));
                    let term = W::term(w, x, one(w, x), h);
                    if W::SEQUENTIAL {
                        sum[t][r] += term;
                    } else {
                        lanes[b % BLOCK_LANES] += term;
                    }
                }
                out[t][r] = if W::SEQUENTIAL {
                    sum[t][r]
                } else {
                    sum_lanes8(&lanes)
                };
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    proptest::proptest! {
        #[test]
        fn reduce8_sums_each_vector(v in proptest::collection::vec(-(1 << 27)..(1i32 << 27), 64)) {
            if !std::arch::is_x86_feature_detected!("avx2") {
                return Ok(());
            }
            #[target_feature(enable = "avx2")]
            unsafe fn run(v: &[i32]) -> [i32; 8] {
                let mut regs = [_mm256_setzero_si256(); 8];
                for (j, r) in regs.iter_mut().enumerate() {
                    // SAFETY: AVX2 enabled by this function's attribute; 8 lanes from v.
                    *r = unsafe { _mm256_loadu_si256(v[8 * j..].as_ptr() as *const __m256i) };
                }
                let mut out = [0i32; 8];
                // SAFETY: as above; `out` is 8 lanes.
                unsafe { _mm256_storeu_si256(out.as_mut_ptr() as *mut __m256i, reduce8(&regs)) };
                out
            }
            // SAFETY: AVX2 detected above.
            let got = unsafe { run(&v) };
            for (j, &g) in got.iter().enumerate() {
                proptest::prop_assert_eq!(g, v[8 * j..8 * j + 8].iter().sum::<i32>());
            }
        }
    }
}
