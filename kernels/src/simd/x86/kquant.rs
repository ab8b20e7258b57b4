//! The x86 tiers' integer block sums for Q5_0, Q5_1 and the K-quants, and their tiles.
//!
//! Each `*_avx2` / `*_avx512` function returns exactly the reference's integer sums
//! (`crate::reference::isum_*`) for one weight block against one activation block; the
//! generic tile ([`crate::kquant::tile_with`]) forms the float terms from them in the
//! reference's order, so both tiers give the reference's bits.
//!
//! - AVX2: `maddubs` of unsigned codes by signed activations (16-bit pair sums: at most
//!   2·63·128, no saturation), then `madd` by the sub-block scales into 32-bit lanes.
//! - AVX-512: the same over 64 bytes at a time, the scale product and accumulation fused in
//!   VNNI's `vpdpwssd`; Q5_0/Q5_1 with VNNI's `vpdpbusd`.
//!
//! Q4_K/Q5_K apply their sub-block mins as `Σ m_s·(bsum_2s + bsum_2s+1)` (one `madd` of the
//! activation block sums), Q6_K its −32 offset as `32·Σ sc_s·bsum_s`, as GGML does.

use std::arch::x86_64::*;

use half::f16;
use kiln_format::{BlockQ4K, BlockQ5K, BlockQ5_0, BlockQ5_1, BlockQ6K, BlockQ8K, BlockQ8_0};

use super::quant::f16_to_f32;
use crate::klanes::scales_mins_k4;
use crate::kquant::{tile_with, KTiles};
use crate::tile::{Tile, TILE_ROWS, WIDE_ROWS};

/// Sum of eight i32 lanes (exact; any order).
///
/// # Safety
/// AVX2 is enabled.
#[inline(always)]
unsafe fn hsum_i32(v: __m256i) -> i32 {
    // SAFETY: AVX2 enabled (caller contract); register-only intrinsics.
    unsafe {
        let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0x4E>(s));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0xB1>(s));
        _mm_cvtsi128_si32(s)
    }
}

/// Loads 32 bytes.
///
/// # Safety
/// AVX is enabled and `p` is valid for reading 32 bytes.
#[inline(always)]
unsafe fn load32<T>(p: *const T) -> __m256i {
    // SAFETY: caller contract; unaligned load.
    unsafe { _mm256_loadu_si256(p as *const __m256i) }
}

/// `Σ m_s·(bsum_2s + bsum_2s+1)`: a Q4_K/Q5_K block's mins against a Q8_K block's sums.
///
/// # Safety
/// AVX2 is enabled.
#[inline(always)]
unsafe fn mins_sum(m: &[u8; 8], x: &BlockQ8K) -> i32 {
    // SAFETY: AVX2 enabled (caller contract); `x.bsums` is 32 readable bytes, `m` 8.
    unsafe {
        let m8 = _mm_loadl_epi64(m.as_ptr() as *const __m128i);
        // Each min twice, as i16: lanes 2s and 2s + 1 hold m_s.
        let dup = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
        let m16 = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(m8, dup));
        let bs = load32(x.bsums.as_ptr());
        hsum_i32(_mm256_madd_epi16(bs, m16))
    }
}

/// The 32 codes (0..=31) of a Q5_0/Q5_1 block, weight `j` in byte `j`.
///
/// # Safety
/// AVX2 is enabled.
#[inline(always)]
pub(crate) unsafe fn q5_codes(qh: [u8; 4], qs: &[u8; 16]) -> __m256i {
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

/// `Σ_j u_j·x_j` of unsigned bytes `u` (at most 127 after any pair) and signed `x`, as eight
/// i32 lanes.
///
/// # Safety
/// AVX2 is enabled.
#[inline(always)]
unsafe fn dot_u8_i8(u: __m256i, x: __m256i) -> __m256i {
    // SAFETY: AVX2 enabled (caller contract); register-only intrinsics.
    unsafe { _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1)) }
}

/// [`crate::reference::isum_q5_0`].
///
/// # Safety
/// AVX2 is enabled.
#[inline(always)]
unsafe fn q5_0_avx2(w: &BlockQ5_0, x: &BlockQ8_0) -> i32 {
    // SAFETY: AVX2 enabled (caller contract); `x.qs` is 32 readable bytes.
    unsafe {
        let q = q5_codes(w.qh, &w.qs);
        let xv = load32(x.qs.as_ptr());
        let qx = dot_u8_i8(q, xv);
        let sx = dot_u8_i8(_mm256_set1_epi8(16), xv);
        hsum_i32(_mm256_sub_epi32(qx, sx))
    }
}

/// [`crate::reference::isum_q5_1`].
///
/// # Safety
/// AVX2 is enabled.
#[inline(always)]
unsafe fn q5_1_avx2(w: &BlockQ5_1, x: &BlockQ8_0) -> (i32, i32) {
    // SAFETY: AVX2 enabled (caller contract); `x.qs` is 32 readable bytes.
    unsafe {
        let q = q5_codes(w.qh, &w.qs);
        let xv = load32(x.qs.as_ptr());
        let qx = dot_u8_i8(q, xv);
        let sx = dot_u8_i8(_mm256_set1_epi8(1), xv);
        (hsum_i32(qx), hsum_i32(sx))
    }
}

/// `Σ_s sc_s·Σ_{j∈s} q_j·x_j` of a Q4_K/Q5_K block's codes: `codes(c)` gives pair `c`'s two
/// sub-blocks as (low, high) 32-byte vectors.
///
/// # Safety
/// AVX2 is enabled.
#[inline(always)]
unsafe fn k_affine_avx2(
    sc: &[u8; 8],
    x: &BlockQ8K,
    codes: impl Fn(usize) -> (__m256i, __m256i),
) -> i32 {
    // SAFETY: AVX2 enabled (caller contract); `x.qs` is 256 readable bytes, read 32 at a time
    // at offsets below 256.
    unsafe {
        let mut acc = _mm256_setzero_si256();
        for c in 0..4 {
            let (lo, hi) = codes(c);
            let x0 = load32(x.qs.as_ptr().add(64 * c));
            let x1 = load32(x.qs.as_ptr().add(64 * c + 32));
            let p0 = _mm256_maddubs_epi16(lo, x0);
            let p1 = _mm256_maddubs_epi16(hi, x1);
            let s0 = _mm256_set1_epi16(i16::from(sc[2 * c]));
            let s1 = _mm256_set1_epi16(i16::from(sc[2 * c + 1]));
            acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p0, s0));
            acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p1, s1));
        }
        hsum_i32(acc)
    }
}

/// Pair `c`'s nibbles of a Q4_K/Q5_K block: (low: sub-block 2c, high: sub-block 2c + 1).
///
/// # Safety
/// AVX2 is enabled and `c < 4`.
#[inline(always)]
unsafe fn nibbles(qs: &[u8; 128], c: usize) -> (__m256i, __m256i) {
    // SAFETY: AVX2 enabled; 32 bytes at 32c ≤ 96 lie inside `qs` (caller contract).
    unsafe {
        let raw = load32(qs.as_ptr().add(32 * c));
        let m4 = _mm256_set1_epi8(0x0f);
        (
            _mm256_and_si256(raw, m4),
            _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4),
        )
    }
}

/// Pair `c`'s fifth bits of a Q5_K block as 0x10 bytes: bits `2c` and `2c + 1` of each `qh`
/// byte.
///
/// # Safety
/// AVX2 is enabled and `c < 4`.
#[inline(always)]
unsafe fn fifth_bits(qh: __m256i, c: usize) -> (__m256i, __m256i) {
    // SAFETY: AVX2 enabled (caller contract); register-only intrinsics. A 16-bit shift right
    // by 2c brings bits 2c, 2c + 1 of every byte to bits 0, 1 (bits from the next byte only
    // reach the top two); shifting left by 4 and 3 puts them at bit 4, within the byte.
    unsafe {
        let h = _mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * c as i32));
        let b4 = _mm256_set1_epi8(0x10);
        (
            _mm256_and_si256(_mm256_slli_epi16(h, 4), b4),
            _mm256_and_si256(_mm256_slli_epi16(h, 3), b4),
        )
    }
}

/// [`crate::reference::isum_q4_k`].
///
/// # Safety
/// AVX2 is enabled.
#[inline(always)]
unsafe fn q4_k_avx2(w: &BlockQ4K, x: &BlockQ8K) -> (i32, i32) {
    let (sc, m) = scales_mins_k4(&w.scales);
    // SAFETY: AVX2 enabled (caller contract); c < 4.
    unsafe {
        let isum = k_affine_avx2(&sc, x, |c| nibbles(&w.qs, c));
        (isum, mins_sum(&m, x))
    }
}

/// [`crate::reference::isum_q5_k`].
///
/// # Safety
/// AVX2 is enabled.
#[inline(always)]
unsafe fn q5_k_avx2(w: &BlockQ5K, x: &BlockQ8K) -> (i32, i32) {
    let (sc, m) = scales_mins_k4(&w.scales);
    // SAFETY: AVX2 enabled (caller contract); `w.qh` is 32 readable bytes; c < 4.
    unsafe {
        let qh = load32(w.qh.as_ptr());
        let isum = k_affine_avx2(&sc, x, |c| {
            let (lo, hi) = nibbles(&w.qs, c);
            let (hlo, hhi) = fifth_bits(qh, c);
            (_mm256_or_si256(lo, hlo), _mm256_or_si256(hi, hhi))
        });
        (isum, mins_sum(&m, x))
    }
}

/// Half `h`'s four 32-weight groups of Q6_K codes (0..=63): group `k` holds weights
/// `128h + 32k..128h + 32k + 32`, sub-blocks `8h + 2k` (bytes 0..16) and `8h + 2k + 1`.
///
/// # Safety
/// AVX2 is enabled and `h < 2`.
#[inline(always)]
unsafe fn q6_codes(w: &BlockQ6K, h: usize) -> [__m256i; 4] {
    // SAFETY: AVX2 enabled; `ql[64h..64h + 64]` and `qh[32h..32h + 32]` lie inside the block
    // for h < 2 (caller contract). Each shift is applied after masking, so no bit crosses a
    // byte.
    unsafe {
        let ql0 = load32(w.ql.as_ptr().add(64 * h));
        let ql1 = load32(w.ql.as_ptr().add(64 * h + 32));
        let qh = load32(w.qh.as_ptr().add(32 * h));
        let m4 = _mm256_set1_epi8(0x0f);
        let mask = |m: u8| _mm256_and_si256(qh, _mm256_set1_epi8(m as i8));
        [
            _mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_slli_epi16(mask(0x03), 4)),
            _mm256_or_si256(_mm256_and_si256(ql1, m4), _mm256_slli_epi16(mask(0x0c), 2)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4), mask(0x30)),
            _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                _mm256_srli_epi16(mask(0xc0), 2),
            ),
        ]
    }
}

/// `32·Σ_s sc_s·bsum_s`: Q6_K's offset against a Q8_K block's sums, and the sixteen scales as
/// bytes.
///
/// # Safety
/// AVX2 is enabled.
#[inline(always)]
unsafe fn q6_offset(w: &BlockQ6K, x: &BlockQ8K) -> (i32, __m128i) {
    // SAFETY: AVX2 enabled (caller contract); `w.scales` is 16 readable bytes, `x.bsums` 32.
    unsafe {
        let sc8 = _mm_loadu_si128(w.scales.as_ptr() as *const __m128i);
        let sc16 = _mm256_cvtepi8_epi16(sc8);
        let bs = load32(x.bsums.as_ptr());
        (32 * hsum_i32(_mm256_madd_epi16(bs, sc16)), sc8)
    }
}

/// [`crate::reference::isum_q6_k`].
///
/// # Safety
/// AVX2 is enabled.
#[inline(always)]
unsafe fn q6_k_avx2(w: &BlockQ6K, x: &BlockQ8K) -> i32 {
    // SAFETY: AVX2 enabled (caller contract); `x.qs` read 32 bytes at offsets below 256;
    // h < 2.
    unsafe {
        let (offset, sc8) = q6_offset(w, x);
        // Bytes 0..8 pick scale j, bytes 8..16 scale j + 1.
        let mut pick = _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
        let two = _mm_set1_epi8(2);
        let mut acc = _mm256_setzero_si256();
        for h in 0..2 {
            let q = q6_codes(w, h);
            for (k, q) in q.iter().enumerate() {
                let xv = load32(x.qs.as_ptr().add(128 * h + 32 * k));
                let s = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc8, pick));
                let p = _mm256_maddubs_epi16(*q, xv);
                acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, s));
                pick = _mm_add_epi8(pick, two);
            }
        }
        hsum_i32(acc) - offset
    }
}

/// Two 32-byte halves as one 64-byte vector (`lo` in bytes 0..32).
///
/// # Safety
/// AVX-512F is enabled.
#[inline(always)]
unsafe fn cat(lo: __m256i, hi: __m256i) -> __m512i {
    // SAFETY: AVX-512F enabled (caller contract); register-only intrinsics.
    unsafe { _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi) }
}

/// Sum of sixteen i32 lanes (exact).
///
/// # Safety
/// AVX-512F and AVX2 are enabled.
#[inline(always)]
unsafe fn hsum512_i32(v: __m512i) -> i32 {
    // SAFETY: features enabled (caller contract); register-only intrinsics.
    unsafe {
        hsum_i32(_mm256_add_epi32(
            _mm512_castsi512_si256(v),
            _mm512_extracti64x4_epi64::<1>(v),
        ))
    }
}

/// [`crate::reference::isum_q5_0`] with VNNI: `vpdpbusd` of the codes, less 16 times the
/// activations' sum.
///
/// # Safety
/// AVX-512VL/VNNI and AVX2 are enabled.
#[inline(always)]
unsafe fn q5_0_avx512(w: &BlockQ5_0, x: &BlockQ8_0) -> i32 {
    // SAFETY: features enabled (caller contract); `x.qs` is 32 readable bytes.
    unsafe {
        let q = q5_codes(w.qh, &w.qs);
        let xv = load32(x.qs.as_ptr());
        let z = _mm256_setzero_si256();
        let sx = _mm256_dpbusd_epi32(z, _mm256_set1_epi8(16), xv);
        hsum_i32(_mm256_dpbusd_epi32(_mm256_sub_epi32(z, sx), q, xv))
    }
}

/// [`crate::reference::isum_q5_1`] with VNNI.
///
/// # Safety
/// AVX-512VL/VNNI and AVX2 are enabled.
#[inline(always)]
unsafe fn q5_1_avx512(w: &BlockQ5_1, x: &BlockQ8_0) -> (i32, i32) {
    // SAFETY: features enabled (caller contract); `x.qs` is 32 readable bytes.
    unsafe {
        let q = q5_codes(w.qh, &w.qs);
        let xv = load32(x.qs.as_ptr());
        let z = _mm256_setzero_si256();
        let qx = _mm256_dpbusd_epi32(z, q, xv);
        let sx = _mm256_dpbusd_epi32(z, _mm256_set1_epi8(1), xv);
        (hsum_i32(qx), hsum_i32(sx))
    }
}

/// f16 → f32 through F16C, for the terms.
///
/// # Safety
/// F16C is enabled.
#[inline(always)]
unsafe fn h(v: f16) -> f32 {
    // SAFETY: F16C enabled (caller contract).
    unsafe { f16_to_f32(v) }
}

/// The block itself, for kernels that unpack it per token (the AVX2 K-quant sums).
///
/// # Safety
/// None; `unsafe` only to match the unpacking functions it stands in for.
#[inline(always)]
unsafe fn keep<W: Copy>(w: &W) -> W {
    *w
}

/// A Q4_K or Q5_K block unpacked for [`q4_k_dot512`]: the codes of each pair of sub-blocks
/// (64 bytes), the pair's scales as 16-bit lanes, and the mins.
#[derive(Clone, Copy)]
struct AffineK512 {
    codes: [__m512i; 4],
    scales: [__m512i; 4],
    mins: [u8; 8],
}

/// The scale vectors of [`k_affine_avx512`]: lanes 0..16 scale 2c, 16..32 scale 2c + 1.
///
/// # Safety
/// AVX-512F/BW and AVX2 are enabled.
#[inline(always)]
unsafe fn pair_scales512(sc: &[u8; 8]) -> [__m512i; 4] {
    // SAFETY: features enabled (caller contract); `sc` is 8 readable bytes.
    unsafe {
        let s16 = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_loadl_epi64(
            sc.as_ptr() as *const __m128i
        )));
        let mut pick = _mm512_inserti64x4::<1>(_mm512_setzero_si512(), _mm256_set1_epi16(1));
        let two = _mm512_set1_epi16(2);
        let mut out = [_mm512_setzero_si512(); 4];
        for o in &mut out {
            *o = _mm512_permutexvar_epi16(pick, s16);
            pick = _mm512_add_epi16(pick, two);
        }
        out
    }
}

/// Unpack a Q4_K block once for all the tokens of a tile.
///
/// # Safety
/// AVX-512F/BW/VNNI and AVX2 are enabled.
#[inline(always)]
unsafe fn q4_k_unpack512(w: &BlockQ4K) -> AffineK512 {
    let (sc, mins) = scales_mins_k4(&w.scales);
    // SAFETY: features enabled (caller contract); c < 4.
    unsafe {
        let mut codes = [_mm512_setzero_si512(); 4];
        for (c, o) in codes.iter_mut().enumerate() {
            let (lo, hi) = nibbles(&w.qs, c);
            *o = cat(lo, hi);
        }
        AffineK512 {
            codes,
            scales: pair_scales512(&sc),
            mins,
        }
    }
}

/// Unpack a Q5_K block once for all the tokens of a tile.
///
/// # Safety
/// AVX-512F/BW/VNNI and AVX2 are enabled.
#[inline(always)]
unsafe fn q5_k_unpack512(w: &BlockQ5K) -> AffineK512 {
    let (sc, mins) = scales_mins_k4(&w.scales);
    // SAFETY: features enabled (caller contract); `w.qh` is 32 readable bytes; c < 4.
    unsafe {
        let qh = load32(w.qh.as_ptr());
        let mut codes = [_mm512_setzero_si512(); 4];
        for (c, o) in codes.iter_mut().enumerate() {
            let (lo, hi) = nibbles(&w.qs, c);
            let (hlo, hhi) = fifth_bits(qh, c);
            *o = cat(_mm256_or_si256(lo, hlo), _mm256_or_si256(hi, hhi));
        }
        AffineK512 {
            codes,
            scales: pair_scales512(&sc),
            mins,
        }
    }
}

/// [`crate::reference::isum_q4_k`] (and `isum_q5_k`) from an unpacked block.
///
/// # Safety
/// AVX-512F/BW/VNNI and AVX2 are enabled.
#[inline(always)]
unsafe fn q4_k_dot512(u: &AffineK512, x: &BlockQ8K) -> (i32, i32) {
    // SAFETY: features enabled (caller contract); `x.qs` is 256 readable bytes, read 64 at a
    // time at offsets below 256.
    unsafe {
        let mut acc = _mm512_setzero_si512();
        for c in 0..4 {
            let xv = _mm512_loadu_si512(x.qs.as_ptr().add(64 * c) as *const __m512i);
            let p = _mm512_maddubs_epi16(u.codes[c], xv);
            acc = _mm512_dpwssd_epi32(acc, p, u.scales[c]);
        }
        (hsum512_i32(acc), mins_sum(&u.mins, x))
    }
}

/// A Q6_K block unpacked for [`q6_k_dot512`]: its codes 64 at a time, their sub-blocks'
/// scales as 16-bit lanes, and all sixteen scales as 16-bit lanes for the offset.
#[derive(Clone, Copy)]
struct Q6K512 {
    codes: [__m512i; 4],
    scales: [__m512i; 4],
    sc16: __m256i,
}

/// Unpack a Q6_K block once for all the tokens of a tile.
///
/// # Safety
/// AVX-512F/BW/VNNI and AVX2 are enabled.
#[inline(always)]
unsafe fn q6_k_unpack512(w: &BlockQ6K) -> Q6K512 {
    // SAFETY: features enabled (caller contract); `w.scales` is 16 readable bytes; h < 2.
    unsafe {
        let sc8 = _mm_loadu_si128(w.scales.as_ptr() as *const __m128i);
        let sc16 = _mm256_cvtepi8_epi16(sc8);
        let s16 = _mm512_castsi256_si512(sc16);
        // Lanes 8i..8i + 8 pick scale j + i.
        let mut pick = _mm512_setr_epi64(
            0,
            0,
            0x0001_0001_0001_0001,
            0x0001_0001_0001_0001,
            0x0002_0002_0002_0002,
            0x0002_0002_0002_0002,
            0x0003_0003_0003_0003,
            0x0003_0003_0003_0003,
        );
        let four = _mm512_set1_epi16(4);
        let mut codes = [_mm512_setzero_si512(); 4];
        let mut scales = [_mm512_setzero_si512(); 4];
        for h in 0..2 {
            let q = q6_codes(w, h);
            for k in 0..2 {
                codes[2 * h + k] = cat(q[2 * k], q[2 * k + 1]);
                scales[2 * h + k] = _mm512_permutexvar_epi16(pick, s16);
                pick = _mm512_add_epi16(pick, four);
            }
        }
        Q6K512 {
            codes,
            scales,
            sc16,
        }
    }
}

/// [`crate::reference::isum_q6_k`] from an unpacked block.
///
/// # Safety
/// AVX-512F/BW/VNNI and AVX2 are enabled.
#[inline(always)]
unsafe fn q6_k_dot512(u: &Q6K512, x: &BlockQ8K) -> i32 {
    // SAFETY: features enabled (caller contract); `x.qs` is 256 readable bytes, read 64 at a
    // time at offsets below 256; `x.bsums` 32 bytes.
    unsafe {
        let mut acc = _mm512_setzero_si512();
        for i in 0..4 {
            let xv = _mm512_loadu_si512(x.qs.as_ptr().add(64 * i) as *const __m512i);
            let p = _mm512_maddubs_epi16(u.codes[i], xv);
            acc = _mm512_dpwssd_epi32(acc, p, u.scales[i]);
        }
        let bs = load32(x.bsums.as_ptr());
        hsum512_i32(acc) - 32 * hsum_i32(_mm256_madd_epi16(bs, u.sc16))
    }
}

/// [`dot_u8_i8`] with VNNI's `vpdpbusd`.
///
/// # Safety
/// AVX-512VL/VNNI are enabled.
#[inline(always)]
unsafe fn dot_u8_i8_vnni(u: __m256i, x: __m256i) -> __m256i {
    // SAFETY: features enabled (caller contract); register-only intrinsics.
    unsafe { _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, x) }
}

/// One tier's `#[target_feature]` kernels per encoding and their safe wrappers, in module
/// `$name`: the tile (`$entry::<T>`, T tokens against four rows) and the sixteen-row one-token
/// kernel (`rows::$entry`, the rows one after another, so the weights stream from memory in
/// order). `k` entries run the block-by-block tile ([`tile_with`]) over the integer sums
/// `$f`; `q5` entries the eight-block tile ([`super::q5::tile`]) over the block dot `$dot`
/// and the one-block sums `$one`. The closures are written inside the `#[target_feature]`
/// functions, so they are compiled with the tier's features (and inlined with the intrinsics
/// they call).
macro_rules! k_tiles {
    ($name:ident, $tf:literal,
        k: [$( $ty:ty => $entry:ident, $unpack:ident, $f:ident );* $(;)?],
        q5: [$( $qty:ty => $qentry:ident, $dot:ident, $one:ident );* $(;)?] $(,)?) => {
        pub(crate) mod $name {
            use super::*;

            /// The `#[target_feature]` kernels; their callers check the lengths.
            mod imp {
                use super::*;
                $(
                    #[target_feature(enable = $tf)]
                    pub(super) unsafe fn $entry<const R: usize, const T: usize>(
                        rows: &[&[$ty]; R],
                        xs: &[&[BlockQ8K]; T],
                    ) -> [[f32; R]; T] {
                        // Every row and token has the same block count (caller contract), the
                        // only length the tile indexes by.
                        tile_with(
                            rows,
                            xs,
                            // SAFETY: this function's features are the ones `$unpack` needs.
                            |w| unsafe { $unpack(w) },
                            // SAFETY: this function's features are the ones `$f` needs.
                            |u, x| unsafe { $f(u, x) },
                            // SAFETY: F16C is among this function's features.
                            |v| unsafe { h(v) },
                        )
                    }
                )*
                $(
                    #[target_feature(enable = $tf)]
                    pub(super) unsafe fn $qentry<const R: usize, const T: usize>(
                        rows: &[&[$qty]; R],
                        xs: &[&[BlockQ8_0]; T],
                    ) -> [[f32; R]; T] {
                        // SAFETY: this function's features are the ones the tile, `$dot`,
                        // `$one` and `h` need; every row and token has the same block count
                        // (caller contract).
                        unsafe {
                            crate::simd::x86::q5::tile(
                                rows,
                                xs,
                                |u, x| $dot(u, x),
                                |w, x| $one(w, x),
                                |v| h(v),
                            )
                        }
                    }
                )*
            }

            /// The tiles' safe wrappers.
            $(
                pub(in crate::simd) fn $entry<const T: usize>(
                    rows: &[&[$ty]; TILE_ROWS],
                    xs: &[&[BlockQ8K]],
                    out: &mut [[f32; TILE_ROWS]],
                ) {
                    let xs = crate::simd::check_tile::<_, _, T>(rows, xs, out);
                    // SAFETY: this tier's table, the only way here, is handed out only when
                    // the CPU has its features (`crate::kernels`); lengths checked above.
                    out.copy_from_slice(&unsafe { imp::$entry::<TILE_ROWS, T>(rows, xs) });
                }
            )*
            $(
                pub(in crate::simd) fn $qentry<const T: usize>(
                    rows: &[&[$qty]; TILE_ROWS],
                    xs: &[&[BlockQ8_0]],
                    out: &mut [[f32; TILE_ROWS]],
                ) {
                    let xs = crate::simd::check_tile::<_, _, T>(rows, xs, out);
                    // SAFETY: as above.
                    out.copy_from_slice(&unsafe { imp::$qentry::<TILE_ROWS, T>(rows, xs) });
                }
            )*

            /// The sixteen-row one-token kernels' safe wrappers: each row through the one-row
            /// tile, the same bits as the four-row tiles.
            pub(in crate::simd) mod rows {
                use super::*;
                $(
                    pub(in crate::simd) fn $entry(
                        w: &[$ty],
                        x: &[BlockQ8K],
                        out: &mut [f32; WIDE_ROWS],
                    ) {
                        let nb = x.len();
                        assert_eq!(w.len(), WIDE_ROWS * nb, "rows: row length mismatch");
                        for (r, o) in out.iter_mut().enumerate() {
                            let row = &w[r * nb..(r + 1) * nb];
                            // SAFETY: as above; the row and the token have nb blocks.
                            *o = unsafe { imp::$entry::<1, 1>(&[row], &[x]) }[0][0];
                        }
                    }
                )*
                $(
                    pub(in crate::simd) fn $qentry(
                        w: &[$qty],
                        x: &[BlockQ8_0],
                        out: &mut [f32; WIDE_ROWS],
                    ) {
                        let nb = x.len();
                        assert_eq!(w.len(), WIDE_ROWS * nb, "rows: row length mismatch");
                        for (r, o) in out.iter_mut().enumerate() {
                            let row = &w[r * nb..(r + 1) * nb];
                            // SAFETY: as above; the row and the token have nb blocks.
                            *o = unsafe { imp::$qentry::<1, 1>(&[row], &[x]) }[0][0];
                        }
                    }
                )*
            }
        }
    };
}

k_tiles!(avx2, "avx2,fma,f16c",
    k: [
        BlockQ4K => q4_k_tile_avx2, keep, q4_k_avx2;
        BlockQ5K => q5_k_tile_avx2, keep, q5_k_avx2;
        BlockQ6K => q6_k_tile_avx2, keep, q6_k_avx2;
    ],
    q5: [
        BlockQ5_0 => q5_0_tile_avx2, dot_u8_i8, q5_0_avx2;
        BlockQ5_1 => q5_1_tile_avx2, dot_u8_i8, q5_1_avx2;
    ],
);

k_tiles!(avx512, "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c",
    k: [
        BlockQ4K => q4_k_tile_avx512, q4_k_unpack512, q4_k_dot512;
        BlockQ5K => q5_k_tile_avx512, q5_k_unpack512, q4_k_dot512;
        BlockQ6K => q6_k_tile_avx512, q6_k_unpack512, q6_k_dot512;
    ],
    q5: [
        BlockQ5_0 => q5_0_tile_avx512, dot_u8_i8_vnni, q5_0_avx512;
        BlockQ5_1 => q5_1_tile_avx512, dot_u8_i8_vnni, q5_1_avx512;
    ],
);

/// Tokens per multi-token tile: AVX2 has 16 registers, AVX-512 32, in which a K-quant block
/// (or eight Q5 blocks) stays unpacked across the tile's tokens.
const AVX2_TOKENS: usize = 2;
const AVX512_TOKENS: usize = 8;

/// The AVX2 tier's tiles.
pub(crate) const AVX2_TILES: KTiles = KTiles {
    q5_0: Tile::new(
        avx2::q5_0_tile_avx2::<1>,
        AVX2_TOKENS,
        avx2::q5_0_tile_avx2::<AVX2_TOKENS>,
    )
    .with_rows(avx2::rows::q5_0_tile_avx2),
    q5_1: Tile::new(
        avx2::q5_1_tile_avx2::<1>,
        AVX2_TOKENS,
        avx2::q5_1_tile_avx2::<AVX2_TOKENS>,
    )
    .with_rows(avx2::rows::q5_1_tile_avx2),
    q4_k: Tile::new(
        avx2::q4_k_tile_avx2::<1>,
        AVX2_TOKENS,
        avx2::q4_k_tile_avx2::<AVX2_TOKENS>,
    )
    .with_rows(avx2::rows::q4_k_tile_avx2),
    q5_k: Tile::new(
        avx2::q5_k_tile_avx2::<1>,
        AVX2_TOKENS,
        avx2::q5_k_tile_avx2::<AVX2_TOKENS>,
    )
    .with_rows(avx2::rows::q5_k_tile_avx2),
    q6_k: Tile::new(
        avx2::q6_k_tile_avx2::<1>,
        AVX2_TOKENS,
        avx2::q6_k_tile_avx2::<AVX2_TOKENS>,
    )
    .with_rows(avx2::rows::q6_k_tile_avx2),
};

/// The AVX-512 tier's tiles.
pub(crate) const AVX512_TILES: KTiles = KTiles {
    q5_0: Tile::new(
        avx512::q5_0_tile_avx512::<1>,
        AVX512_TOKENS,
        avx512::q5_0_tile_avx512::<AVX512_TOKENS>,
    )
    .with_rows(avx512::rows::q5_0_tile_avx512),
    q5_1: Tile::new(
        avx512::q5_1_tile_avx512::<1>,
        AVX512_TOKENS,
        avx512::q5_1_tile_avx512::<AVX512_TOKENS>,
    )
    .with_rows(avx512::rows::q5_1_tile_avx512),
    q4_k: Tile::new(
        avx512::q4_k_tile_avx512::<1>,
        AVX512_TOKENS,
        avx512::q4_k_tile_avx512::<AVX512_TOKENS>,
    )
    .with_rows(avx512::rows::q4_k_tile_avx512),
    q5_k: Tile::new(
        avx512::q5_k_tile_avx512::<1>,
        AVX512_TOKENS,
        avx512::q5_k_tile_avx512::<AVX512_TOKENS>,
    )
    .with_rows(avx512::rows::q5_k_tile_avx512),
    q6_k: Tile::new(
        avx512::q6_k_tile_avx512::<1>,
        AVX512_TOKENS,
        avx512::q6_k_tile_avx512::<AVX512_TOKENS>,
    )
    .with_rows(avx512::rows::q6_k_tile_avx512),
};
