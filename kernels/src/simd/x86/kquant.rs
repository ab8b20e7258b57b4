//! The x86 tiers' integer block sums for Q5_0, Q5_1, IQ4_NL, the K-quants (Q2_K…Q6_K) and
//! IQ4_XS, and their tiles.
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
//! activation block sums), Q6_K its −32 offset as `32·Σ sc_s·bsum_s`, as GGML does; Q3_K (codes
//! 0..=7, the `hmask` bit as bit 2) its −4 offset as `4·Σ sc_s·bsum_s`, Q2_K its mins as
//! `Σ (sc_s >> 4)·bsum_s`, both with sixteen sub-blocks of 16 (two to a 32-byte group).
//!
//! IQ4_NL and IQ4_XS look their 4-bit indices up in the signed grid with `pshufb` (low nibbles:
//! weights `j`, high nibbles: weights `j + 16` of each 32), then multiply signed by signed as
//! `|x|` (unsigned, at most 128) times the grid value with `x`'s sign (`psignb`; AVX-512, which
//! lacks it, negates under `x`'s sign mask): pair sums at most 2·128·127, no saturation. IQ4_XS
//! scales each 32-weight sub-block's sums by `ls − 32` (`madd` / `vpdpwssd`); IQ4_NL (32-weight
//! blocks, Q8_0 activations) runs eight blocks at a time as Q5_1 does, the eight terms in the
//! lanes of one register ([`iq4_nl_tile8`]).

use std::arch::x86_64::*;

use half::f16;
use kiln_format::iq4::IQ4_GRID;
use kiln_format::{
    BlockIQ4NL, BlockIQ4XS, BlockQ2K, BlockQ3K, BlockQ4K, BlockQ5K, BlockQ5_0, BlockQ5_1, BlockQ6K,
    BlockQ8K, BlockQ8_0,
};

use super::q5::{q5_codes, reduce8};
use super::quant::f16_to_f32;
use crate::klanes::scales_mins_k4;
use crate::kquant::tile_with;
use crate::reference::{iq4_xs_scale, sum_lanes8, KBlock, BLOCK_LANES};
use crate::tile::{TILE_ROWS, WIDE_ROWS};

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

/// A Q2_K or Q3_K block unpacked for [`k16_avx2`]: its codes 32 at a time (group `g` holds
/// weights `32g..32g + 32`, sub-blocks `2g` and `2g + 1`), each group's sub-block scales as
/// 16-bit lanes (lanes 0..8 scale `2g`, 8..16 scale `2g + 1`), and the sixteen weights of the
/// activation block sums as 16-bit lanes.
#[derive(Clone, Copy)]
pub(super) struct K16 {
    codes: [__m256i; 8],
    scales: [__m256i; 8],
    sums: __m256i,
}

/// The 2-bit fields of Q2_K/Q3_K's `qs` (group `g` of 32 weights: bits `2(g % 4)` of bytes
/// `32(g / 4)..32(g / 4) + 32`).
///
/// # Safety
/// AVX2 is enabled.
#[inline(always)]
unsafe fn low2_codes(qs: &[u8; 64]) -> [__m256i; 8] {
    // SAFETY: AVX2 enabled (caller contract); `qs` is 64 readable bytes, read 32 at offsets 0
    // and 32. A 16-bit shift right by 2k brings bits 2k, 2k + 1 of every byte to bits 0, 1;
    // the mask drops what came from the next byte.
    unsafe {
        let m3 = _mm256_set1_epi8(3);
        let mut out = [_mm256_setzero_si256(); 8];
        for half in 0..2 {
            let raw = load32(qs.as_ptr().add(32 * half));
            for k in 0..4 {
                let v = _mm256_srl_epi16(raw, _mm_cvtsi32_si128(2 * k as i32));
                out[4 * half + k] = _mm256_and_si256(v, m3);
            }
        }
        out
    }
}

/// `vpshufb` patterns for [`group_scales`]: pattern `k` fills the low 128-bit half with 16-bit
/// lane `2k` of its source and the high half with lane `2k + 1`.
const SCALE_PICK: [[u8; 32]; 4] = {
    let mut p = [[0u8; 32]; 4];
    let mut k = 0;
    while k < 4 {
        let mut i = 0;
        while i < 16 {
            let byte = (i % 2) as u8;
            p[k][i] = 4 * k as u8 + byte;
            p[k][16 + i] = 4 * k as u8 + 2 + byte;
            i += 1;
        }
        k += 1;
    }
    p
};

/// The sixteen scales widened to 16 bits (`s16`: lane `s` scale `s`) as [`K16`]'s per-group
/// scale vectors: group `g`'s lanes 0..8 hold scale `2g`, 8..16 scale `2g + 1`. Each source
/// half is copied to both halves once, then one in-lane `vpshufb` a group.
///
/// # Safety
/// AVX2 is enabled.
#[inline(always)]
unsafe fn group_scales(s16: __m256i) -> [__m256i; 8] {
    // SAFETY: AVX2 enabled (caller contract); `SCALE_PICK` rows are 32 readable bytes.
    unsafe {
        let halves = [
            _mm256_permute2x128_si256::<0x00>(s16, s16),
            _mm256_permute2x128_si256::<0x11>(s16, s16),
        ];
        let mut out = [_mm256_setzero_si256(); 8];
        for (g, o) in out.iter_mut().enumerate() {
            *o = _mm256_shuffle_epi8(halves[g / 4], load32(SCALE_PICK[g % 4].as_ptr()));
        }
        out
    }
}

/// Unpack a Q2_K block: codes 0..=3, scales `sc & 15`, the block sums weighted by the mins
/// `sc >> 4`.
///
/// # Safety
/// AVX2 is enabled.
#[inline(always)]
pub(super) unsafe fn q2_k_unpack(w: &BlockQ2K) -> K16 {
    // SAFETY: AVX2 enabled (caller contract); `w.scales` is 16 readable bytes.
    unsafe {
        let raw = _mm_loadu_si128(w.scales.as_ptr() as *const __m128i);
        let m4 = _mm_set1_epi8(0x0f);
        let sc8 = _mm_and_si128(raw, m4);
        let mins8 = _mm_and_si128(_mm_srli_epi16(raw, 4), m4);
        K16 {
            codes: low2_codes(&w.qs),
            scales: group_scales(_mm256_cvtepu8_epi16(sc8)),
            sums: _mm256_cvtepu8_epi16(mins8),
        }
    }
}

/// Unpack a Q3_K block: codes 0..=7 (the `hmask` bit as bit 2), the signed scales, which also
/// weight the block sums (the −4 offset).
///
/// # Safety
/// AVX2 is enabled.
#[inline(always)]
pub(super) unsafe fn q3_k_unpack(w: &BlockQ3K) -> K16 {
    let ls = crate::klanes::q3_k_scales6(&w.scales);
    // SAFETY: AVX2 enabled (caller contract); `ls` is 16 readable bytes, `w.hmask` 32. Group
    // g = 4·half + k takes bit g of each `hmask` byte: a 16-bit shift right by g brings it to
    // bit 0, masked to the byte and moved to bit 2.
    unsafe {
        let sc8 = _mm_sub_epi8(
            _mm_loadu_si128(ls.as_ptr() as *const __m128i),
            _mm_set1_epi8(32),
        );
        let hm = load32(w.hmask.as_ptr());
        let one = _mm256_set1_epi8(1);
        let mut codes = low2_codes(&w.qs);
        for (g, c) in codes.iter_mut().enumerate() {
            let hb = _mm256_and_si256(_mm256_srl_epi16(hm, _mm_cvtsi32_si128(g as i32)), one);
            *c = _mm256_or_si256(*c, _mm256_slli_epi16(hb, 2));
        }
        let sc16 = _mm256_cvtepi8_epi16(sc8);
        K16 {
            codes,
            scales: group_scales(sc16),
            sums: sc16,
        }
    }
}

/// `Σ_s sc_s·Σ_{j∈s} q_j·x_j` and `Σ_s sums_s·bsum_s` of an unpacked Q2_K/Q3_K block, each as
/// eight i32 lanes (summed by the caller: one block at a time or eight together).
///
/// # Safety
/// AVX2 is enabled.
#[inline(always)]
pub(super) unsafe fn k16_lanes(u: &K16, x: &BlockQ8K) -> (__m256i, __m256i) {
    // SAFETY: AVX2 enabled (caller contract); `x.qs` is 256 readable bytes, read 32 at a time
    // at offsets below 256; `x.bsums` 32 bytes. Codes are at most 7: maddubs pairs at most
    // 2·7·128, and the scales at most 32 in magnitude.
    unsafe {
        let mut acc = _mm256_setzero_si256();
        for g in 0..8 {
            let xv = load32(x.qs.as_ptr().add(32 * g));
            let p = _mm256_maddubs_epi16(u.codes[g], xv);
            acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, u.scales[g]));
        }
        let bs = load32(x.bsums.as_ptr());
        (acc, _mm256_madd_epi16(bs, u.sums))
    }
}

/// `(Σ_s sc_s·Σ_{j∈s} q_j·x_j, Σ_s sums_s·bsum_s)` of an unpacked Q2_K/Q3_K block.
///
/// # Safety
/// AVX2 is enabled.
#[inline(always)]
unsafe fn k16_avx2(u: &K16, x: &BlockQ8K) -> (i32, i32) {
    // SAFETY: forwarded contract.
    unsafe {
        let (isum, sums) = k16_lanes(u, x);
        (hsum_i32(isum), hsum_i32(sums))
    }
}

/// [`crate::reference::isum_q2_k`] from an unpacked block.
///
/// # Safety
/// AVX2 is enabled.
#[inline(always)]
pub(super) unsafe fn q2_k_avx2(u: &K16, x: &BlockQ8K) -> (i32, i32) {
    // SAFETY: forwarded contract.
    unsafe { k16_avx2(u, x) }
}

/// [`crate::reference::isum_q3_k`] from an unpacked block.
///
/// # Safety
/// AVX2 is enabled.
#[inline(always)]
pub(super) unsafe fn q3_k_avx2(u: &K16, x: &BlockQ8K) -> i32 {
    // SAFETY: forwarded contract.
    let (isum, sums) = unsafe { k16_avx2(u, x) };
    isum - 4 * sums
}

/// The sixteen IQ4 grid values, in both 128-bit halves.
///
/// # Safety
/// AVX2 is enabled.
#[inline(always)]
pub(super) unsafe fn iq4_grid256() -> __m256i {
    // SAFETY: AVX2 enabled (caller contract); `IQ4_GRID` is 16 readable bytes.
    unsafe { _mm256_broadcastsi128_si256(_mm_loadu_si128(IQ4_GRID.as_ptr() as *const __m128i)) }
}

/// The 32 signed grid values of sixteen bytes of IQ4 indices: weight `j` < 16 (low nibble of
/// byte `j`) in byte `j`, weight `j + 16` (its high nibble) in byte `j + 16`.
///
/// # Safety
/// AVX2 is enabled; `grid` is [`iq4_grid256`].
#[inline(always)]
unsafe fn iq4_values(grid: __m256i, qs: &[u8]) -> __m256i {
    debug_assert!(qs.len() >= 16);
    // SAFETY: AVX2 enabled (caller contract); `qs` holds 16 readable bytes (every caller
    // passes a 16-byte block or a 16-byte slice of one).
    unsafe {
        let raw = _mm_loadu_si128(qs.as_ptr() as *const __m128i);
        let m4 = _mm_set1_epi8(0x0f);
        let lo = _mm_and_si128(raw, m4);
        let hi = _mm_and_si128(_mm_srli_epi16(raw, 4), m4);
        _mm256_shuffle_epi8(grid, _mm256_set_m128i(hi, lo))
    }
}

/// `Σ_j w_j·x_j` of signed bytes `w` (−127..=127) and signed `x` as sixteen i16 lanes (pair
/// sums): `|x|` (at most 128, unsigned) times `w` with `x`'s sign, each pair at most
/// 2·128·127, no saturation.
///
/// # Safety
/// AVX2 is enabled.
#[inline(always)]
unsafe fn dot_i8_pairs(w: __m256i, x: __m256i) -> __m256i {
    // SAFETY: AVX2 enabled (caller contract); register-only intrinsics.
    unsafe { _mm256_maddubs_epi16(_mm256_abs_epi8(x), _mm256_sign_epi8(w, x)) }
}

/// `Σ_j w_j·x_j` of signed bytes `w` (−127..=127) and signed `x` as eight i32 lanes.
///
/// # Safety
/// AVX2 is enabled.
#[inline(always)]
unsafe fn dot_i8_i8(w: __m256i, x: __m256i) -> __m256i {
    // SAFETY: AVX2 enabled (caller contract); register-only intrinsics.
    unsafe { _mm256_madd_epi16(dot_i8_pairs(w, x), _mm256_set1_epi16(1)) }
}

/// [`dot_i8_i8`] with VNNI's `vpdpbusd` (four exact products into 32 bits, no saturation).
///
/// # Safety
/// AVX-512VL/VNNI and AVX2 are enabled.
#[inline(always)]
unsafe fn dot_i8_i8_vnni(w: __m256i, x: __m256i) -> __m256i {
    // SAFETY: features enabled (caller contract); register-only intrinsics.
    unsafe {
        _mm256_dpbusd_epi32(
            _mm256_setzero_si256(),
            _mm256_abs_epi8(x),
            _mm256_sign_epi8(w, x),
        )
    }
}

/// [`crate::reference::isum_iq4_nl`].
///
/// # Safety
/// AVX2 is enabled.
#[inline(always)]
pub(super) unsafe fn iq4_nl_avx2(w: &BlockIQ4NL, x: &BlockQ8_0) -> i32 {
    // SAFETY: AVX2 enabled (caller contract); `x.qs` is 32 readable bytes, `w.qs` 16.
    unsafe {
        let v = iq4_values(iq4_grid256(), &w.qs);
        hsum_i32(dot_i8_i8(v, load32(x.qs.as_ptr())))
    }
}

/// [`crate::reference::isum_iq4_nl`] with VNNI.
///
/// # Safety
/// AVX-512VL/VNNI and AVX2 are enabled.
#[inline(always)]
unsafe fn iq4_nl_avx512(w: &BlockIQ4NL, x: &BlockQ8_0) -> i32 {
    // SAFETY: features enabled (caller contract); `x.qs` is 32 readable bytes, `w.qs` 16.
    unsafe {
        let v = iq4_values(iq4_grid256(), &w.qs);
        hsum_i32(dot_i8_i8_vnni(v, load32(x.qs.as_ptr())))
    }
}

/// The scales `d` of the eight blocks at `b`, widened to f32 (exact).
///
/// # Safety
/// AVX and F16C are enabled; `b` holds at least eight blocks.
#[inline(always)]
pub(super) unsafe fn scales8<B>(b: &[B], d: impl Fn(&B) -> f16) -> __m256 {
    // SAFETY: F16C enabled (caller contract); indices below 8 ≤ b.len() (caller contract).
    unsafe {
        let v = |j: usize| d(b.get_unchecked(j)).to_bits() as i16;
        _mm256_cvtph_ps(_mm_setr_epi16(
            v(0),
            v(1),
            v(2),
            v(3),
            v(4),
            v(5),
            v(6),
            v(7),
        ))
    }
}

/// `R` IQ4_NL rows against `T` tokens' Q8_0 blocks, eight blocks at a time (as
/// [`super::q5::tile`] does Q5_1): each group's eight integer sums in the lanes of one
/// register (a transposing reduction), their terms `f32(isum)·(d_w·d_x)`
/// ([`crate::reference::term_q5_0`]) formed lane by lane and added into lane `b % 8` of the
/// accumulator, as the reference adds them into accumulator `b % 8`. Blocks past the last
/// whole group go through `one` into the same lanes. `dot(w, x)` gives eight i32 lanes summing
/// to `Σ w_j·x_j` of signed grid values `w` and activations `x`.
///
/// # Safety
/// AVX2, FMA and F16C are enabled (and whatever `dot` and `one` need), and every row and token
/// slice has the same number of blocks.
#[inline(always)]
unsafe fn iq4_nl_tile8<const R: usize, const T: usize>(
    rows: &[&[BlockIQ4NL]; R],
    xs: &[&[BlockQ8_0]; T],
    dot: impl Fn(__m256i, __m256i) -> __m256i,
    one: impl Fn(&BlockIQ4NL, &BlockQ8_0) -> i32,
    h: impl Fn(f16) -> f32 + Copy,
) -> [[f32; R]; T] {
    let nb = xs[0].len();
    let groups = nb / BLOCK_LANES;
    // SAFETY: features enabled (caller contract). Group g reads blocks 8g..8g + 8 ≤ nb of every
    // row and token, all of length nb (caller contract); the tail reads blocks below nb.
    unsafe {
        let grid = iq4_grid256();
        let mut acc = [[_mm256_setzero_ps(); R]; T];
        for g in 0..groups {
            let b0 = g * BLOCK_LANES;
            let mut dx = [_mm256_setzero_ps(); T];
            for t in 0..T {
                dx[t] = scales8(xs[t].get_unchecked(b0..b0 + BLOCK_LANES), |b| b.d);
            }
            for r in 0..R {
                let wb = rows[r].get_unchecked(b0..b0 + BLOCK_LANES);
                let mut q = [_mm256_setzero_si256(); BLOCK_LANES];
                for (q, w) in q.iter_mut().zip(wb) {
                    *q = iq4_values(grid, &w.qs);
                }
                let dw = scales8(wb, |b| b.d);
                for t in 0..T {
                    let xb = xs[t].get_unchecked(b0..b0 + BLOCK_LANES);
                    let mut v = [_mm256_setzero_si256(); BLOCK_LANES];
                    for j in 0..BLOCK_LANES {
                        v[j] = dot(q[j], load32(xb[j].qs.as_ptr()));
                    }
                    let isum = reduce8(&v);
                    let p = _mm256_mul_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(dw, dx[t]));
                    acc[t][r] = _mm256_add_ps(acc[t][r], p);
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
                    lanes[b % BLOCK_LANES] += KBlock::term(w, x, one(w, x), h);
                }
                out[t][r] = sum_lanes8(&lanes);
            }
        }
        out
    }
}

/// An IQ4_XS block unpacked for [`iq4_xs_avx2`]: each sub-block's 32 grid values and its
/// scale `ls − 32` in every 16-bit lane.
#[derive(Clone, Copy)]
pub(super) struct IQ4XS256 {
    values: [__m256i; 8],
    scales: [__m256i; 8],
}

/// Unpack an IQ4_XS block.
///
/// # Safety
/// AVX2 is enabled.
#[inline(always)]
pub(super) unsafe fn iq4_xs_unpack(w: &BlockIQ4XS) -> IQ4XS256 {
    // SAFETY: AVX2 enabled (caller contract); `w.qs[16s..16s + 16]` lies inside the block
    // for s < 8.
    unsafe {
        let grid = iq4_grid256();
        let mut u = IQ4XS256 {
            values: [_mm256_setzero_si256(); 8],
            scales: [_mm256_setzero_si256(); 8],
        };
        for s in 0..8 {
            u.values[s] = iq4_values(grid, &w.qs[16 * s..16 * s + 16]);
            u.scales[s] = _mm256_set1_epi16(iq4_xs_scale(w, s) as i16);
        }
        u
    }
}

/// [`crate::reference::isum_iq4_xs`] from an unpacked block, as eight i32 lanes.
///
/// # Safety
/// AVX2 is enabled.
#[inline(always)]
pub(super) unsafe fn iq4_xs_lanes(u: &IQ4XS256, x: &BlockQ8K) -> __m256i {
    // SAFETY: AVX2 enabled (caller contract); `x.qs` is 256 readable bytes, read 32 at a time
    // at offsets below 256. Pair sums at most 32512, scales at most 32 in magnitude.
    unsafe {
        let mut acc = _mm256_setzero_si256();
        for s in 0..8 {
            let p = dot_i8_pairs(u.values[s], load32(x.qs.as_ptr().add(32 * s)));
            acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, u.scales[s]));
        }
        acc
    }
}

/// [`crate::reference::isum_iq4_xs`] from an unpacked block.
///
/// # Safety
/// AVX2 is enabled.
#[inline(always)]
pub(super) unsafe fn iq4_xs_avx2(u: &IQ4XS256, x: &BlockQ8K) -> i32 {
    // SAFETY: forwarded contract.
    unsafe { hsum_i32(iq4_xs_lanes(u, x)) }
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
pub(super) unsafe fn h(v: f16) -> f32 {
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
    // SAFETY: forwarded contract.
    let (isum, sums) = unsafe { k16_dot512(u, x) };
    isum - 32 * sums
}

/// The scalars of [`q6_k_dot512`] and its Q2_K/Q3_K kin: `(Σ_s sc_s·Σ_{j∈s} q_j·x_j,
/// Σ_s sums_s·bsum_s)` with `sc16` as the block-sum weights.
///
/// # Safety
/// AVX-512F/BW/VNNI and AVX2 are enabled.
#[inline(always)]
unsafe fn k16_dot512(u: &Q6K512, x: &BlockQ8K) -> (i32, i32) {
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
        (hsum512_i32(acc), hsum_i32(_mm256_madd_epi16(bs, u.sc16)))
    }
}

/// Sixteen sub-block scales (as 16-bit lanes) spread over [`Q6K512`]'s four scale vectors:
/// vector `i`, lanes `8k..8k + 8` scale `4i + k`.
///
/// # Safety
/// AVX-512F/BW and AVX2 are enabled.
#[inline(always)]
unsafe fn quad_scales512(sc16: __m256i) -> [__m512i; 4] {
    // SAFETY: features enabled (caller contract); register-only intrinsics.
    unsafe {
        let s16 = _mm512_castsi256_si512(sc16);
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
        let mut out = [_mm512_setzero_si512(); 4];
        for o in &mut out {
            *o = _mm512_permutexvar_epi16(pick, s16);
            pick = _mm512_add_epi16(pick, four);
        }
        out
    }
}

/// A Q2_K/Q3_K block's [`K16`] as a [`Q6K512`], for [`k16_dot512`].
///
/// # Safety
/// AVX-512F/BW and AVX2 are enabled.
#[inline(always)]
unsafe fn k16_to_512(u: K16, sc16: __m256i) -> Q6K512 {
    // SAFETY: features enabled (caller contract); register-only intrinsics.
    unsafe {
        let mut codes = [_mm512_setzero_si512(); 4];
        for (i, c) in codes.iter_mut().enumerate() {
            *c = cat(u.codes[2 * i], u.codes[2 * i + 1]);
        }
        Q6K512 {
            codes,
            scales: quad_scales512(sc16),
            sc16: u.sums,
        }
    }
}

/// Unpack a Q2_K block once for all the tokens of a tile.
///
/// # Safety
/// AVX-512F/BW/VNNI and AVX2 are enabled.
#[inline(always)]
unsafe fn q2_k_unpack512(w: &BlockQ2K) -> Q6K512 {
    // SAFETY: features enabled (caller contract); `w.scales` is 16 readable bytes.
    unsafe {
        let raw = _mm_loadu_si128(w.scales.as_ptr() as *const __m128i);
        let sc16 = _mm256_cvtepu8_epi16(_mm_and_si128(raw, _mm_set1_epi8(0x0f)));
        k16_to_512(q2_k_unpack(w), sc16)
    }
}

/// Unpack a Q3_K block once for all the tokens of a tile.
///
/// # Safety
/// AVX-512F/BW/VNNI and AVX2 are enabled.
#[inline(always)]
unsafe fn q3_k_unpack512(w: &BlockQ3K) -> Q6K512 {
    // SAFETY: features enabled (caller contract); the Q3_K scales weight both the codes and
    // the block sums.
    unsafe {
        let u = q3_k_unpack(w);
        k16_to_512(u, u.sums)
    }
}

/// [`crate::reference::isum_q2_k`] from an unpacked block.
///
/// # Safety
/// AVX-512F/BW/VNNI and AVX2 are enabled.
#[inline(always)]
unsafe fn q2_k_dot512(u: &Q6K512, x: &BlockQ8K) -> (i32, i32) {
    // SAFETY: forwarded contract.
    unsafe { k16_dot512(u, x) }
}

/// [`crate::reference::isum_q3_k`] from an unpacked block.
///
/// # Safety
/// AVX-512F/BW/VNNI and AVX2 are enabled.
#[inline(always)]
unsafe fn q3_k_dot512(u: &Q6K512, x: &BlockQ8K) -> i32 {
    // SAFETY: forwarded contract.
    let (isum, sums) = unsafe { k16_dot512(u, x) };
    isum - 4 * sums
}

/// An IQ4_XS block unpacked for [`iq4_xs_dot512`]: its grid values 64 at a time (two
/// sub-blocks) and their scales `ls − 32` as 16-bit lanes (lanes 0..16 the first sub-block's).
#[derive(Clone, Copy)]
struct IQ4XS512 {
    values: [__m512i; 4],
    scales: [__m512i; 4],
}

/// Unpack an IQ4_XS block once for all the tokens of a tile.
///
/// # Safety
/// AVX-512F/BW/VNNI and AVX2 are enabled.
#[inline(always)]
unsafe fn iq4_xs_unpack512(w: &BlockIQ4XS) -> IQ4XS512 {
    // SAFETY: features enabled (caller contract).
    unsafe {
        let u = iq4_xs_unpack(w);
        let mut out = IQ4XS512 {
            values: [_mm512_setzero_si512(); 4],
            scales: [_mm512_setzero_si512(); 4],
        };
        for i in 0..4 {
            out.values[i] = cat(u.values[2 * i], u.values[2 * i + 1]);
            out.scales[i] = cat(u.scales[2 * i], u.scales[2 * i + 1]);
        }
        out
    }
}

/// [`crate::reference::isum_iq4_xs`] from an unpacked block: `|x|` times the grid values with
/// `x`'s sign (AVX-512 has no `vpsignb`: a masked negation by `x`'s sign bits), then the
/// sub-block scales fused in VNNI's `vpdpwssd`.
///
/// # Safety
/// AVX-512F/BW/VNNI and AVX2 are enabled.
#[inline(always)]
unsafe fn iq4_xs_dot512(u: &IQ4XS512, x: &BlockQ8K) -> i32 {
    // SAFETY: features enabled (caller contract); `x.qs` is 256 readable bytes, read 64 at a
    // time at offsets below 256. Grid values are at least −127, so negating them is exact;
    // pair sums at most 2·128·127.
    unsafe {
        let z = _mm512_setzero_si512();
        let mut acc = z;
        for i in 0..4 {
            let xv = _mm512_loadu_si512(x.qs.as_ptr().add(64 * i) as *const __m512i);
            let neg = _mm512_movepi8_mask(xv);
            let w = _mm512_mask_sub_epi8(u.values[i], neg, z, u.values[i]);
            let p = _mm512_maddubs_epi16(_mm512_abs_epi8(xv), w);
            acc = _mm512_dpwssd_epi32(acc, p, u.scales[i]);
        }
        hsum512_i32(acc)
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
/// `$f` of the blocks unpacked by `$unpack`; `q5` entries an eight-block tile `$tile`
/// ([`super::q5::tile`], [`iq4_nl_tile8`]) over the block dot `$dot` and the one-block sums
/// `$one`. The closures are written inside the `#[target_feature]`
/// functions, so they are compiled with the tier's features (and inlined with the intrinsics
/// they call).
macro_rules! k_tiles {
    ($name:ident, $tf:literal,
        k: [$( $ty:ty => $entry:ident, $unpack:ident, $f:ident );* $(;)?],
        q5: [$( $qty:ty => $qentry:ident, $tile:path, $dot:ident, $one:ident );* $(;)?] $(,)?) => {
        pub(crate) mod $name {
            use super::*;

            /// The `#[target_feature]` kernels; their callers check the lengths.
            mod imp {
                use super::*;
                $(
                    #[target_feature(enable = $tf)]
                    pub(super) unsafe fn $entry<const R: usize, const T: usize>(
                        rows: &[&[$ty]; R],
                        xs: &[&[<$ty as KBlock>::X]; T],
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
                            $tile(
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
                    xs: &[&[<$ty as KBlock>::X]],
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
            /// tile, the same bits as the four-row tiles. A tier may take its own kernel for an
            /// encoding instead (AVX2 for Q2_K, Q3_K, IQ4_XS and IQ4_NL:
            /// [`crate::simd::x86::avx2_rows`]),
            /// which leaves that encoding's wrapper here unused.
            #[allow(dead_code)]
            pub(in crate::simd) mod rows {
                use super::*;
                $(
                    pub(in crate::simd) fn $entry(
                        w: &[$ty],
                        x: &[<$ty as KBlock>::X],
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
        BlockQ2K => q2_k_tile_avx2, q2_k_unpack, q2_k_avx2;
        BlockQ3K => q3_k_tile_avx2, q3_k_unpack, q3_k_avx2;
        BlockIQ4XS => iq4_xs_tile_avx2, iq4_xs_unpack, iq4_xs_avx2;
    ],
    q5: [
        BlockQ5_0 => q5_0_tile_avx2, crate::simd::x86::q5::tile, dot_u8_i8, q5_0_avx2;
        BlockQ5_1 => q5_1_tile_avx2, crate::simd::x86::q5::tile, dot_u8_i8, q5_1_avx2;
        BlockIQ4NL => iq4_nl_tile_avx2, iq4_nl_tile8, dot_i8_i8, iq4_nl_avx2;
    ],
);

k_tiles!(avx512, "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c",
    k: [
        BlockQ4K => q4_k_tile_avx512, q4_k_unpack512, q4_k_dot512;
        BlockQ5K => q5_k_tile_avx512, q5_k_unpack512, q4_k_dot512;
        BlockQ6K => q6_k_tile_avx512, q6_k_unpack512, q6_k_dot512;
        BlockQ2K => q2_k_tile_avx512, q2_k_unpack512, q2_k_dot512;
        BlockQ3K => q3_k_tile_avx512, q3_k_unpack512, q3_k_dot512;
        BlockIQ4XS => iq4_xs_tile_avx512, iq4_xs_unpack512, iq4_xs_dot512;
    ],
    q5: [
        BlockQ5_0 => q5_0_tile_avx512, crate::simd::x86::q5::tile, dot_u8_i8_vnni, q5_0_avx512;
        BlockQ5_1 => q5_1_tile_avx512, crate::simd::x86::q5::tile, dot_u8_i8_vnni, q5_1_avx512;
        BlockIQ4NL => iq4_nl_tile_avx512, iq4_nl_tile8, dot_i8_i8_vnni, iq4_nl_avx512;
    ],
);
