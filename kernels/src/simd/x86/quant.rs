//! Block-integer primitives and the generic Q8_0/Q4_0 kernels built on them.
//!
//! Per block, the ISA computes the exact integer dot product as eight i32 lanes (their sum is
//! the block's `isum`), the lanes are converted to f32 (exact: |isum| < 2^24) and accumulated
//! with one FMA by `d_w·d_x`. Only the float summation order differs from the reference.

use std::arch::x86_64::*;

use kiln_format::{BlockQ4_0, BlockQ8_0};

use super::float::prefetch_ahead;

/// One ISA's integer block dot products against a prepared Q8_0 activation block.
///
/// Weight blocks are loaded once (`load_*`) and dotted against several tokens (`dot_*`).
///
/// # Safety
/// Every method requires the implementing ISA's features to be enabled in the caller.
pub(crate) unsafe trait QDot {
    /// An activation block prepared once per tile and shared by all its rows.
    type Prep: Copy;
    /// A Q8_0 weight block in registers.
    type W8: Copy;
    /// A Q4_0 weight block in registers.
    type W4: Copy;
    unsafe fn prep(x: &BlockQ8_0) -> Self::Prep;
    unsafe fn load_q8(w: &BlockQ8_0) -> Self::W8;
    unsafe fn load_q4(w: &BlockQ4_0) -> Self::W4;
    /// Eight i32 lanes summing to `Σ w_j·x_j` over the block.
    unsafe fn dot_q8(w: Self::W8, x: &Self::Prep) -> __m256i;
    /// Eight i32 lanes summing to `Σ (q_j − 8)·x_j` over the block.
    unsafe fn dot_q4(w: Self::W4, x: &Self::Prep) -> __m256i;
}

/// A weight block type the generic kernel can dot against Q8_0 activations.
pub(crate) trait QBlock: kiln_format::BlockType {
    fn d(&self) -> half::f16;
    /// The block's integer dot with each of `T` prepared activation blocks.
    ///
    /// # Safety
    /// `Q`'s ISA features are enabled.
    unsafe fn dots<Q: QDot, const T: usize>(&self, xs: &[Q::Prep; T]) -> [__m256i; T];
}

impl QBlock for BlockQ8_0 {
    #[inline(always)]
    fn d(&self) -> half::f16 {
        self.d
    }
    #[inline(always)]
    unsafe fn dots<Q: QDot, const T: usize>(&self, xs: &[Q::Prep; T]) -> [__m256i; T] {
        // SAFETY: forwarded contract.
        unsafe {
            let w = Q::load_q8(self);
            let mut out = [_mm256_setzero_si256(); T];
            for t in 0..T {
                out[t] = Q::dot_q8(w, &xs[t]);
            }
            out
        }
    }
}

impl QBlock for BlockQ4_0 {
    #[inline(always)]
    fn d(&self) -> half::f16 {
        self.d
    }
    #[inline(always)]
    unsafe fn dots<Q: QDot, const T: usize>(&self, xs: &[Q::Prep; T]) -> [__m256i; T] {
        // SAFETY: forwarded contract.
        unsafe {
            let w = Q::load_q4(self);
            let mut out = [_mm256_setzero_si256(); T];
            for t in 0..T {
                out[t] = Q::dot_q4(w, &xs[t]);
            }
            out
        }
    }
}

/// f16 → f32 with F16C (both x86 tiers have it).
///
/// # Safety
/// F16C is enabled.
#[inline(always)]
pub(crate) unsafe fn f16_to_f32(h: half::f16) -> f32 {
    // SAFETY: F16C enabled (caller contract); register-only intrinsics.
    unsafe { _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h.to_bits() as i32))) }
}

/// Sum of eight f32 lanes.
///
/// # Safety
/// AVX is enabled.
#[inline(always)]
pub(crate) unsafe fn hsum256(v: __m256) -> f32 {
    // SAFETY: AVX enabled (caller contract); register-only intrinsics.
    unsafe {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }
}

/// `R` quantized weight rows against `T` Q8_0 activation rows: one accumulator per
/// (row, token), updated block by block with `fma(f32(lanes), d_w·d_x)`. Each (row, token)
/// result depends only on that row and token, so every `R`, `T` gives the same bits.
///
/// # Safety
/// `Q`'s ISA features (including AVX2, FMA and F16C) are enabled and every row and token
/// slice has the same number of blocks.
#[inline(always)]
pub(crate) unsafe fn tile<Q: QDot, W: QBlock, const R: usize, const T: usize>(
    rows: &[&[W]; R],
    xs: &[&[BlockQ8_0]; T],
) -> [[f32; R]; T] {
    let nb = xs[0].len();
    // SAFETY: features enabled (caller contract).
    let mut acc = [[unsafe { _mm256_setzero_ps() }; R]; T];
    for b in 0..nb {
        // SAFETY: features enabled; b < nb == every slice's length (caller contract), and
        // r0 + 4 <= R keeps the 4-lane store inside `scale[t]`.
        unsafe {
            let mut preps = [Q::prep(xs[0].get_unchecked(b)); T];
            let mut dx = [0.0f32; T];
            for t in 0..T {
                let xb = xs[t].get_unchecked(b);
                preps[t] = Q::prep(xb);
                dx[t] = f16_to_f32(xb.d);
            }
            // d_w·d_x for every (token, row): one F16C conversion per four rows.
            let mut scale = [[0.0f32; R]; T];
            let mut r0 = 0;
            while r0 + 4 <= R {
                let bits = |r: usize| rows[r0 + r].get_unchecked(b).d().to_bits() as i16;
                let dw = _mm_cvtph_ps(_mm_set_epi16(
                    0,
                    0,
                    0,
                    0,
                    bits(3),
                    bits(2),
                    bits(1),
                    bits(0),
                ));
                for t in 0..T {
                    let d = _mm_mul_ps(dw, _mm_set1_ps(dx[t]));
                    _mm_storeu_ps(scale[t].as_mut_ptr().add(r0), d);
                }
                r0 += 4;
            }
            for r in r0..R {
                let dw = f16_to_f32(rows[r].get_unchecked(b).d());
                for t in 0..T {
                    scale[t][r] = dw * dx[t];
                }
            }
            for r in 0..R {
                let wb = rows[r].get_unchecked(b);
                if T == 1 {
                    prefetch_ahead(wb, std::mem::size_of::<W>());
                }
                let lanes = wb.dots::<Q, T>(&preps);
                for t in 0..T {
                    let d = _mm256_set1_ps(scale[t][r]);
                    acc[t][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes[t]), d, acc[t][r]);
                }
            }
        }
    }
    let mut out = [[0.0; R]; T];
    for t in 0..T {
        for r in 0..R {
            // SAFETY: features enabled (caller contract).
            out[t][r] = unsafe { hsum256(acc[t][r]) };
        }
    }
    out
}

/// Quantize activations to Q8_0, bit-identical to
/// [`crate::reference::quantize_row_q8_0_act_ref`] for finite input: the same `amax / 127`,
/// the same `x · (1/d)` product, rounding half away from zero (as `f32::round`) built from
/// truncation plus an exact fraction test, and the scale rounded to f16 to nearest-even by
/// F16C (as `half::f16::from_f32`).
///
/// # Safety
/// AVX2, FMA and F16C are enabled and `x.len() == 32 · out.len()`.
#[inline(always)]
pub(crate) unsafe fn quantize_row_q8_0(x: &[f32], out: &mut [BlockQ8_0]) {
    for (b, xs) in out.iter_mut().zip(x.chunks_exact(kiln_format::QK)) {
        // SAFETY: features enabled (caller contract); `xs` holds 32 f32 (chunks_exact), read
        // as four 8-lane vectors; `b.qs` is 32 writable bytes.
        unsafe {
            let p = xs.as_ptr();
            let v = [
                _mm256_loadu_ps(p),
                _mm256_loadu_ps(p.add(8)),
                _mm256_loadu_ps(p.add(16)),
                _mm256_loadu_ps(p.add(24)),
            ];
            let sign = _mm256_set1_ps(-0.0);
            let mut m = _mm256_andnot_ps(sign, v[0]);
            for vi in &v[1..] {
                m = _mm256_max_ps(m, _mm256_andnot_ps(sign, *vi));
            }
            let m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
            let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            let amax = _mm_cvtss_f32(_mm_max_ss(m2, _mm_movehdup_ps(m2)));
            let d = amax / 127.0;
            let id = _mm256_set1_ps(if d != 0.0 { 1.0 / d } else { 0.0 });
            let half = _mm256_set1_ps(0.5);
            let one = _mm256_set1_ps(1.0);
            let mut q = [_mm256_setzero_si256(); 4];
            for (qi, vi) in q.iter_mut().zip(&v) {
                let s = _mm256_mul_ps(*vi, id);
                let t = _mm256_round_ps(s, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
                // s − trunc(s) is exact; step away from zero when it is at least one half.
                let frac = _mm256_andnot_ps(sign, _mm256_sub_ps(s, t));
                let away = _mm256_cmp_ps(frac, half, _CMP_GE_OQ);
                let step = _mm256_or_ps(_mm256_and_ps(s, sign), one);
                let r = _mm256_add_ps(t, _mm256_and_ps(away, step));
                *qi = _mm256_cvttps_epi32(r);
            }
            let ab = _mm256_packs_epi32(q[0], q[1]);
            let cd = _mm256_packs_epi32(q[2], q[3]);
            let packed = _mm256_packs_epi16(ab, cd);
            let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
            let codes = _mm256_permutevar8x32_epi32(packed, order);
            _mm256_storeu_si256(b.qs.as_mut_ptr() as *mut __m256i, codes);
            let dh = _mm_cvtps_ph(_mm_set_ss(d), _MM_FROUND_TO_NEAREST_INT);
            b.d = half::f16::from_bits(_mm_extract_epi16(dh, 0) as u16);
        }
    }
}
