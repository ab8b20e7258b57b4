//! The AVX-512 tier's float primitives: the [`Avx512`] marker's [`F32Simd`] methods (16-lane
//! load, fma, reduce), and the fixed-tree lane sums [`sum1`] and [`sum16`] they reduce with.
//!
//! Below [`super::avx512`], which builds the tier's table, and [`super::avx512_pair`], whose
//! tiles reduce their accumulators with [`F32Simd::reduce_many`], so both take them from here.

use std::arch::x86_64::*;

use half::{bf16, f16};

use super::float::F32Simd;

/// Marker type for this ISA's primitives.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Avx512;

// SAFETY: every method is only called from functions compiled with this tier's features.
unsafe impl F32Simd for Avx512 {
    const LANES: usize = 16;
    type V = __m512;
    #[inline(always)]
    unsafe fn zero() -> __m512 {
        // SAFETY: AVX-512F enabled (trait contract).
        unsafe { _mm512_setzero_ps() }
    }
    #[inline(always)]
    unsafe fn splat(v: f32) -> __m512 {
        // SAFETY: AVX-512F enabled (trait contract).
        unsafe { _mm512_set1_ps(v) }
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> __m512 {
        // SAFETY: p valid for 16 f32 (trait contract); unaligned load.
        unsafe { _mm512_loadu_ps(p) }
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: __m512) {
        // SAFETY: p valid for writing 16 f32 (trait contract); unaligned store.
        unsafe { _mm512_storeu_ps(p, v) }
    }
    #[inline(always)]
    unsafe fn load_f16(p: *const f16) -> __m512 {
        // SAFETY: p valid for 16 f16 = 32 bytes (trait contract).
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)) }
    }
    #[inline(always)]
    unsafe fn load_bf16(p: *const bf16) -> __m512 {
        // SAFETY: p valid for 16 bf16 = 32 bytes (trait contract); bf16 is the top half of f32.
        unsafe {
            let w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p as *const __m256i));
            _mm512_castsi512_ps(_mm512_slli_epi32(w, 16))
        }
    }
    #[inline(always)]
    unsafe fn add(a: __m512, b: __m512) -> __m512 {
        // SAFETY: AVX-512F enabled (trait contract).
        unsafe { _mm512_add_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn fma(a: __m512, b: __m512, c: __m512) -> __m512 {
        // SAFETY: AVX-512F enabled (trait contract).
        unsafe { _mm512_fmadd_ps(a, b, c) }
    }
    #[inline(always)]
    unsafe fn reduce(v: __m512) -> f32 {
        // SAFETY: AVX-512F enabled (trait contract).
        unsafe { sum1(v) }
    }
    #[inline(always)]
    unsafe fn reduce_many(v: &[__m512; 16], n: usize) -> [f32; 16] {
        // SAFETY: AVX-512F enabled (trait contract).
        unsafe {
            if n > 4 {
                std::mem::transmute::<__m512, [f32; 16]>(sum16(v))
            } else {
                let mut out = [0.0; 16];
                for (o, &v) in out.iter_mut().zip(&v[..n]) {
                    *o = sum1(v);
                }
                out
            }
        }
    }
}

/// The sum of `v`'s lanes, in a fixed tree: lanes `i` and `i + 8` first, then `i` and `i + 4`,
/// `i` and `i + 2`, and the last two. [`sum16`] adds in the same tree, so a tile may reduce its
/// accumulators either way and give the same bits.
///
/// # Safety
/// AVX-512F is enabled.
#[inline(always)]
pub(crate) unsafe fn sum1(v: __m512) -> f32 {
    // SAFETY: register-only intrinsics; AVX-512F enabled (caller contract).
    unsafe {
        let s = _mm512_add_ps(v, _mm512_shuffle_f32x4::<0xEE>(v, v));
        let t = _mm512_add_ps(s, _mm512_shuffle_f32x4::<0x01>(s, s));
        let u = _mm512_add_ps(t, _mm512_shuffle_ps::<0x0E>(t, t));
        let r = _mm512_add_ps(u, _mm512_shuffle_ps::<0x01>(u, u));
        _mm512_cvtss_f32(r)
    }
}

/// Lane `i` of the result is [`sum1`]`(v[i])`, bit for bit: each level of the tree is done for
/// several vectors at once, shuffles gathering the operands of four (then eight, sixteen) rows
/// into one register, so sixteen sums cost 45 instructions instead of 128.
///
/// # Safety
/// AVX-512F is enabled.
#[inline(always)]
pub(crate) unsafe fn sum16(v: &[__m512; 16]) -> __m512 {
    // Where row `i`'s sum lands after the last level: `4·(i % 4) + i / 4`.
    const ORDER: [i32; 16] = [0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15];
    // SAFETY: register-only intrinsics and a 64-byte load of `ORDER`; AVX-512F enabled
    // (caller contract).
    unsafe {
        // Lanes i and i + 8: rows 2k (lanes 0..8) and 2k + 1 (lanes 8..16).
        let s: [__m512; 8] = std::array::from_fn(|k| {
            let (a, b) = (v[2 * k], v[2 * k + 1]);
            _mm512_add_ps(
                _mm512_shuffle_f32x4::<0x44>(a, b),
                _mm512_shuffle_f32x4::<0xEE>(a, b),
            )
        });
        // Lanes i and i + 4: 128-bit lane j holds row 4k + j.
        let t: [__m512; 4] = std::array::from_fn(|k| {
            let (c, d) = (s[2 * k], s[2 * k + 1]);
            _mm512_add_ps(
                _mm512_shuffle_f32x4::<0x88>(c, d),
                _mm512_shuffle_f32x4::<0xDD>(c, d),
            )
        });
        // Lanes i and i + 2, within each 128-bit lane, for two rows per lane.
        let u: [__m512; 2] = std::array::from_fn(|k| {
            let (e, f) = (t[2 * k], t[2 * k + 1]);
            _mm512_add_ps(
                _mm512_shuffle_ps::<0x44>(e, f),
                _mm512_shuffle_ps::<0xEE>(e, f),
            )
        });
        // The last two: lane 4j + m holds row 4m + j.
        let r = _mm512_add_ps(
            _mm512_shuffle_ps::<0x88>(u[0], u[1]),
            _mm512_shuffle_ps::<0xDD>(u[0], u[1]),
        );
        let order = _mm512_loadu_si512(ORDER.as_ptr() as *const __m512i);
        _mm512_permutexvar_ps(order, r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::isa::Isa;
    use proptest::prelude::*;

    #[target_feature(enable = "avx512f")]
    unsafe fn sums_both_ways(v: &[[f32; 16]; 16]) -> ([f32; 16], [f32; 16]) {
        // SAFETY: AVX-512F enabled; 16 readable f32 per row.
        unsafe {
            let v: [__m512; 16] = std::array::from_fn(|i| _mm512_loadu_ps(v[i].as_ptr()));
            let many = std::mem::transmute::<__m512, [f32; 16]>(sum16(&v));
            (many, std::array::from_fn(|i| sum1(v[i])))
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        /// `sum16` and `sum1` add in the same tree (lanes i and i+8, i and i+4, i and i+2, the
        /// last two), checked against a scalar model of it: the same bits, on values of mixed
        /// magnitudes where the order shows.
        #[test]
        fn sum16_and_sum1_add_in_the_same_tree(
            m in prop::collection::vec(-1.0f32..1.0, 256),
            e in prop::collection::vec(-20i32..20, 256),
        ) {
            if !crate::isa::tested_isas().contains(&Isa::Avx512) {
                return Ok(());
            }
            let v: [[f32; 16]; 16] =
                std::array::from_fn(|i| std::array::from_fn(|j| m[16 * i + j] * 2f32.powi(e[16 * i + j])));
            // SAFETY: AVX-512F checked above.
            let (many, one) = unsafe { sums_both_ways(&v) };
            for (i, a) in v.iter().enumerate() {
                let s: [f32; 8] = std::array::from_fn(|j| a[j] + a[j + 8]);
                let t: [f32; 4] = std::array::from_fn(|j| s[j] + s[j + 4]);
                let want = (t[0] + t[2]) + (t[1] + t[3]);
                prop_assert_eq!(many[i].to_bits(), want.to_bits(), "sum16 row {}", i);
                prop_assert_eq!(one[i].to_bits(), want.to_bits(), "sum1 row {}", i);
            }
        }
    }
}
