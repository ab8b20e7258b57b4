//! Activations to Q8_K at AVX2 and AVX-512: [`kiln_format::kquants::quantize_block_q8_k_ref`]
//! (GGML's `quantize_row_q8_K`), bit for bit, a vector of values at a time.
//!
//! The reference keeps the first value of largest magnitude (`max`), NaNs never compared
//! larger: here the largest magnitude comes from a vector maximum whose NaN lanes keep the
//! running maximum (an order-free reduction, so the same value), and `max` is the first value
//! of that magnitude. Each code is the reference's float trick (`iscale·v + 1.5·2²³`, a
//! multiply then an add, the mantissa bits less `2²²`), capped at 127 and truncated to a byte
//! as `as i8` truncates; the sub-block sums add those bytes. So every block is the reference's,
//! whatever the input, NaN and infinity included.

use std::arch::x86_64::*;

use kiln_format::{BlockQ8K, QK_K};

/// [`nearest_int`](kiln_format::kquants::nearest_int)'s constant, `1.5·2²³`.
const ROUND: f32 = 12_582_912.0;

/// One block at AVX-512.
///
/// # Safety
/// AVX-512 F/BW are enabled.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn block_avx512(x: &[f32; QK_K]) -> BlockQ8K {
    const N: usize = QK_K / 16;
    // SAFETY: 16 vectors of 16 f32 in the block.
    let v: [__m512; N] =
        std::array::from_fn(|i| unsafe { _mm512_loadu_ps(x.as_ptr().add(16 * i)) });
    let mut m = _mm512_setzero_ps();
    for v in v {
        // max(a, m): a NaN `a` gives `m`, as the reference's comparison skips it.
        m = _mm512_max_ps(_mm512_abs_ps(v), m);
    }
    let amax = _mm512_reduce_max_ps(m);
    let mut b: BlockQ8K = bytemuck::Zeroable::zeroed();
    if amax == 0.0 {
        return b;
    }
    let target = _mm512_set1_ps(amax);
    let first = v
        .iter()
        .enumerate()
        .find_map(|(i, &v)| {
            let k = _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(_mm512_abs_ps(v), target);
            (k != 0).then(|| 16 * i + k.trailing_zeros() as usize)
        })
        .expect("the largest magnitude is one of the values");
    let iscale = -127.0 / x[first];
    let (s, round) = (_mm512_set1_ps(iscale), _mm512_set1_ps(ROUND));
    let (mask, bias, cap) = (
        _mm512_set1_epi32(0x007f_ffff),
        _mm512_set1_epi32(0x0040_0000),
        _mm512_set1_epi32(127),
    );
    for (i, v) in v.into_iter().enumerate() {
        let r = _mm512_add_ps(_mm512_mul_ps(s, v), round);
        let q = _mm512_sub_epi32(_mm512_and_si512(_mm512_castps_si512(r), mask), bias);
        let q8 = _mm512_cvtepi32_epi8(_mm512_min_epi32(q, cap));
        // SAFETY: 16 bytes at codes 16i..16i + 16 of 256.
        unsafe { _mm_storeu_si128(b.qs.as_mut_ptr().add(16 * i) as *mut __m128i, q8) };
        b.bsums[i] = _mm512_reduce_add_epi32(_mm512_cvtepi8_epi32(q8)) as i16;
    }
    b.d = 1.0 / iscale;
    b
}

/// One block at AVX2.
///
/// # Safety
/// AVX2 is enabled.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn block_avx2(x: &[f32; QK_K]) -> BlockQ8K {
    const N: usize = QK_K / 8;
    // SAFETY: 32 vectors of 8 f32 in the block.
    let v: [__m256; N] = std::array::from_fn(|i| unsafe { _mm256_loadu_ps(x.as_ptr().add(8 * i)) });
    let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
    let mut m = _mm256_setzero_ps();
    for v in v {
        // max(a, m): a NaN `a` gives `m`, as the reference's comparison skips it.
        m = _mm256_max_ps(_mm256_and_ps(v, abs_mask), m);
    }
    let mut lanes = [0f32; 8];
    // SAFETY: 8 writable f32.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), m) };
    let amax = lanes.iter().fold(0f32, |a, &l| a.max(l));
    let mut b: BlockQ8K = bytemuck::Zeroable::zeroed();
    if amax == 0.0 {
        return b;
    }
    let target = _mm256_set1_ps(amax);
    let first = v
        .iter()
        .enumerate()
        .find_map(|(i, &v)| {
            let eq = _mm256_cmp_ps::<_CMP_EQ_OQ>(_mm256_and_ps(v, abs_mask), target);
            let k = _mm256_movemask_ps(eq);
            (k != 0).then(|| 8 * i + k.trailing_zeros() as usize)
        })
        .expect("the largest magnitude is one of the values");
    let iscale = -127.0 / x[first];
    let (s, round) = (_mm256_set1_ps(iscale), _mm256_set1_ps(ROUND));
    let (mask, bias, cap) = (
        _mm256_set1_epi32(0x007f_ffff),
        _mm256_set1_epi32(0x0040_0000),
        _mm256_set1_epi32(127),
    );
    let mut codes = [0i32; QK_K];
    for (i, v) in v.into_iter().enumerate() {
        let r = _mm256_add_ps(_mm256_mul_ps(s, v), round);
        let q = _mm256_sub_epi32(_mm256_and_si256(_mm256_castps_si256(r), mask), bias);
        // SAFETY: 8 writable i32 at 8i..8i + 8 of 256.
        unsafe {
            _mm256_storeu_si256(
                codes.as_mut_ptr().add(8 * i) as *mut __m256i,
                _mm256_min_epi32(q, cap),
            )
        };
    }
    for (q, &c) in b.qs.iter_mut().zip(&codes) {
        *q = c as i8;
    }
    for (s, q) in b.bsums.iter_mut().zip(b.qs.chunks_exact(16)) {
        *s = q.iter().map(|&q| i16::from(q)).sum();
    }
    b.d = 1.0 / iscale;
    b
}

/// Quantize `x` (256 values per block) into `out` at AVX-512.
///
/// # Safety
/// AVX-512 F/BW are enabled; `x.len() == 256 · out.len()`.
#[target_feature(enable = "avx512f,avx512bw")]
pub(crate) unsafe fn quantize_avx512(x: &[f32], out: &mut [BlockQ8K]) {
    for (b, xs) in out.iter_mut().zip(x.chunks_exact(QK_K)) {
        // SAFETY: features enabled (caller contract).
        *b = unsafe { block_avx512(xs.try_into().expect("QK_K chunk")) };
    }
}

/// Quantize `x` (256 values per block) into `out` at AVX2.
///
/// # Safety
/// AVX2 is enabled; `x.len() == 256 · out.len()`.
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn quantize_avx2(x: &[f32], out: &mut [BlockQ8K]) {
    for (b, xs) in out.iter_mut().zip(x.chunks_exact(QK_K)) {
        // SAFETY: features enabled (caller contract).
        *b = unsafe { block_avx2(xs.try_into().expect("QK_K chunk")) };
    }
}
