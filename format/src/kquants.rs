//! GGML's K-quant super-block layouts (Q4_K, Q5_K, Q6_K: 256 weights a block, with scales of
//! their own per sub-block) and Q8_K, the activation blocks their dot products take, with the
//! scalar reference dequantizers.
//!
//! Like [`crate::blocks`], these definitions are the specification: the layouts are GGML's byte
//! for byte, so blocks move between `.kiln` and GGUF unchanged, and every faster path (SIMD dot
//! products, quantizers) is tested against the functions here.

use bytemuck::{Pod, Zeroable};
use half::f16;

use crate::error::{FormatError, Result};

/// Weights per K-quant super-block.
pub const QK_K: usize = 256;
/// Bytes of packed 6-bit scales and mins in Q4_K and Q5_K.
pub const K_SCALE_SIZE: usize = 12;

/// 256 weights in eight sub-blocks of 32, each with a 6-bit scale and a 6-bit min:
/// `w = d·sc[s]·q − dmin·m[s]`, `q` in 0..=15 (144 bytes, 4.5 bits a weight).
///
/// `scales` packs the sixteen 6-bit values (see [`scale_min_k4`]). Each 32 bytes of `qs` hold
/// two consecutive sub-blocks: the first in the low nibbles, the second in the high ones.
#[derive(Debug, Clone, Copy, PartialEq, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ4K {
    /// Super-block scale of the sub-block scales.
    pub d: f16,
    /// Super-block scale of the sub-block mins.
    pub dmin: f16,
    /// Packed 6-bit scales and mins.
    pub scales: [u8; K_SCALE_SIZE],
    /// Nibbles, 32 bytes per pair of sub-blocks.
    pub qs: [u8; QK_K / 2],
}

/// As [`BlockQ4K`] with a fifth bit per weight, `q` in 0..=31 (176 bytes, 5.5 bits a weight).
///
/// Bit `2c` of `qh[l]` is the fifth bit of weight `l` of the low-nibble sub-block of pair `c`,
/// bit `2c + 1` that of the high-nibble one.
#[derive(Debug, Clone, Copy, PartialEq, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ5K {
    /// Super-block scale of the sub-block scales.
    pub d: f16,
    /// Super-block scale of the sub-block mins.
    pub dmin: f16,
    /// Packed 6-bit scales and mins.
    pub scales: [u8; K_SCALE_SIZE],
    /// Fifth bits.
    pub qh: [u8; QK_K / 8],
    /// Low nibbles, as in [`BlockQ4K`].
    pub qs: [u8; QK_K / 2],
}

/// 256 weights in sixteen sub-blocks of 16, each with a signed 8-bit scale:
/// `w = d·sc[s]·(q − 32)`, `q` in 0..=63 (210 bytes, 6.5625 bits a weight).
///
/// Each half of 128 weights uses 64 bytes of `ql` and 32 of `qh`: weight `l + 32k` of the half
/// (`l` < 32, `k` < 4) takes nibble `k / 2` of `ql[l + 32·(k % 2)]` and bits `2k..2k + 2` of
/// `qh[l]`. Sub-block `s` of the half covers weights `16s..16s + 16`.
#[derive(Debug, Clone, Copy, PartialEq, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ6K {
    /// Low four bits.
    pub ql: [u8; QK_K / 2],
    /// High two bits.
    pub qh: [u8; QK_K / 4],
    /// Sub-block scales.
    pub scales: [i8; QK_K / 16],
    /// Super-block scale.
    pub d: f16,
}

/// 256 activations as an f32 scale and signed bytes, with the sum of each 16 codes: what the
/// K-quant dot products take as their other operand (292 bytes). `bsums` lets the products
/// apply the sub-block mins (Q4_K/Q5_K) and the −32 offset (Q6_K) without touching the codes.
#[derive(Debug, Clone, Copy, PartialEq, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ8K {
    /// Scale: `x ≈ d·qs`.
    pub d: f32,
    /// Codes.
    pub qs: [i8; QK_K],
    /// `bsums[i]` = the sum of `qs[16i..16i + 16]`.
    pub bsums: [i16; QK_K / 16],
}

/// GGML's `nearest_int`: `x` rounded to the nearest integer, ties to even, by the float trick
/// GGML uses (exact for |x| < 2²²; the K-quant quantizers only pass values far below that).
#[inline]
pub fn nearest_int(x: f32) -> i32 {
    let v = x + 12_582_912.0;
    (v.to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
}

/// The 6-bit scale and min of sub-block `j` (0..8) from Q4_K/Q5_K's packed `scales`
/// (GGML's `get_scale_min_k4`): sub-blocks 0–3 keep theirs in the low six bits of bytes
/// `j` and `j + 4`; sub-blocks 4–7 in the nibbles of byte `j + 4` with the top two bits in the
/// spare bits of bytes `j − 4` and `j`.
#[inline]
pub fn scale_min_k4(j: usize, s: &[u8; K_SCALE_SIZE]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

/// Pack eight 6-bit scales and mins into Q4_K/Q5_K's 12 bytes, the inverse of
/// [`scale_min_k4`] (GGML's quantizers' packing).
pub fn pack_scale_min_k4(sc: &[u8; 8], m: &[u8; 8]) -> [u8; K_SCALE_SIZE] {
    debug_assert!(sc.iter().chain(m).all(|&v| v < 64), "6-bit values");
    pack_scale_min_k4_bytes(sc, m)
}

/// [`pack_scale_min_k4`] for any bytes, with C's truncations: what GGML's importance-weighted
/// Q4_K quantizer stores when a value is not 6 bits (it does not cap them).
fn pack_scale_min_k4_bytes(sc: &[u8; 8], m: &[u8; 8]) -> [u8; K_SCALE_SIZE] {
    let mut s = [0u8; K_SCALE_SIZE];
    for j in 0..8 {
        if j < 4 {
            s[j] = sc[j];
            s[j + 4] = m[j];
        } else {
            s[j + 4] = (sc[j] & 0x0f) | ((m[j] & 0x0f) << 4);
            s[j - 4] |= (sc[j] >> 4) << 6;
            s[j] |= (m[j] >> 4) << 6;
        }
    }
    s
}

/// The 4-bit codes of a Q4_K block, in weight order.
pub fn q4_k_codes(b: &BlockQ4K) -> [u8; QK_K] {
    let mut q = [0u8; QK_K];
    for (pair, qs) in b.qs.chunks_exact(32).enumerate() {
        for (l, &byte) in qs.iter().enumerate() {
            q[64 * pair + l] = byte & 0x0f;
            q[64 * pair + 32 + l] = byte >> 4;
        }
    }
    q
}

/// The 5-bit codes of a Q5_K block, in weight order.
pub fn q5_k_codes(b: &BlockQ5K) -> [u8; QK_K] {
    let mut q = [0u8; QK_K];
    for (pair, qs) in b.qs.chunks_exact(32).enumerate() {
        for (l, &byte) in qs.iter().enumerate() {
            let hb = b.qh[l];
            q[64 * pair + l] = (byte & 0x0f) | (((hb >> (2 * pair)) & 1) << 4);
            q[64 * pair + 32 + l] = (byte >> 4) | (((hb >> (2 * pair + 1)) & 1) << 4);
        }
    }
    q
}

/// The 6-bit codes (0..=63, before the −32 offset) of a Q6_K block, in weight order.
pub fn q6_k_codes(b: &BlockQ6K) -> [u8; QK_K] {
    let mut q = [0u8; QK_K];
    for half in 0..2 {
        let ql = &b.ql[64 * half..64 * half + 64];
        let qh = &b.qh[32 * half..32 * half + 32];
        for l in 0..32 {
            let y = &mut q[128 * half..128 * half + 128];
            y[l] = (ql[l] & 0x0f) | ((qh[l] & 3) << 4);
            y[l + 32] = (ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4);
            y[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
            y[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
        }
    }
    q
}

/// Dequantize Q4_K blocks into `out` (`out.len() == blocks.len() * 256`), GGML's
/// `dequantize_row_q4_K`: `(d·sc)·q − (dmin·m)`, in that order of operations.
pub fn dequantize_row_q4_k(blocks: &[BlockQ4K], out: &mut [f32]) {
    assert_eq!(out.len(), blocks.len() * QK_K, "output length mismatch");
    for (b, o) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let q = q4_k_codes(b);
        sub_block_affine(b.d, b.dmin, &b.scales, &q, o);
    }
}

/// Dequantize Q5_K blocks into `out` (`out.len() == blocks.len() * 256`), GGML's
/// `dequantize_row_q5_K`.
pub fn dequantize_row_q5_k(blocks: &[BlockQ5K], out: &mut [f32]) {
    assert_eq!(out.len(), blocks.len() * QK_K, "output length mismatch");
    for (b, o) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let q = q5_k_codes(b);
        sub_block_affine(b.d, b.dmin, &b.scales, &q, o);
    }
}

fn sub_block_affine(d: f16, dmin: f16, scales: &[u8; K_SCALE_SIZE], q: &[u8; QK_K], o: &mut [f32]) {
    let (d, dmin) = (d.to_f32(), dmin.to_f32());
    for (s, (o, q)) in o.chunks_exact_mut(32).zip(q.chunks_exact(32)).enumerate() {
        let (sc, m) = scale_min_k4(s, scales);
        let (d1, m1) = (d * f32::from(sc), dmin * f32::from(m));
        for (o, &q) in o.iter_mut().zip(q) {
            *o = d1 * f32::from(q) - m1;
        }
    }
}

/// Dequantize Q6_K blocks into `out` (`out.len() == blocks.len() * 256`), GGML's
/// `dequantize_row_q6_K`: `d·sc·(q − 32)`, left to right.
pub fn dequantize_row_q6_k(blocks: &[BlockQ6K], out: &mut [f32]) {
    assert_eq!(out.len(), blocks.len() * QK_K, "output length mismatch");
    for (b, o) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let d = b.d.to_f32();
        let q = q6_k_codes(b);
        for (s, (o, q)) in o.chunks_exact_mut(16).zip(q.chunks_exact(16)).enumerate() {
            let sc = f32::from(b.scales[s]);
            for (o, &q) in o.iter_mut().zip(q) {
                *o = d * sc * (i32::from(q) - 32) as f32;
            }
        }
    }
}

/// Quantize 256 activations to Q8_K, GGML's `quantize_row_q8_K_ref`: the value of largest
/// magnitude maps to −127 (so `d` takes its sign), codes are rounded to nearest (ties to even)
/// and capped at 127. An all-zero block gets `d = 0` and zero codes.
pub fn quantize_block_q8_k_ref(x: &[f32; QK_K]) -> BlockQ8K {
    let mut amax = 0f32;
    let mut max = 0f32;
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    let mut b = BlockQ8K::zeroed();
    if amax == 0.0 {
        return b;
    }
    let iscale = -127.0 / max;
    for (q, &v) in b.qs.iter_mut().zip(x) {
        *q = nearest_int(iscale * v).min(127) as i8;
    }
    for (s, q) in b.bsums.iter_mut().zip(b.qs.chunks_exact(16)) {
        *s = q.iter().map(|&q| i16::from(q)).sum();
    }
    b.d = 1.0 / iscale;
    b
}

// ---------------------------------------------------------------------------------------------
// Reference quantizers: GGML's `quantize_row_q4_K_ref`, `quantize_row_q5_K_ref` and
// `quantize_row_q6_K_ref`, bit for bit.
//
// Bit-exactness rests on details that look incidental: every sum is an f32 accumulated left to
// right in GGML's loop order, products are evaluated in GGML's association (`w*l*x` is
// `(w*l)*x`), no multiply-add is fused, rounding is [`nearest_int`] (ties to even) and integer
// conversions truncate the way C's do. Checked byte for byte against GGML's own functions
// (`quantizer/tests/vectors/`, `quantizer/tests/ggml_kquants.rs`).
// ---------------------------------------------------------------------------------------------

/// GGML's `GROUP_MAX_EPS`: a group whose largest magnitude (or largest scale) is below this is
/// treated as all zero.
pub const GROUP_MAX_EPS: f32 = 1e-15;

/// GGML's `make_qkx2_quants` (with `use_mad` false): codes `l` in `0..=nmax` for
/// `x ≈ scale·l − the_min` over one sub-block, minimising the `weights`-weighted squared error
/// over `nstep + 1` candidate scales `(nmax + rmin + rdelta·is) / (max − min)`, each refined by
/// a weighted least-squares fit of scale and min. Returns `(scale, the_min)`; `the_min ≥ 0`
/// (the sub-block's minimum is clamped to at most zero before it is negated).
// The loops index several arrays in step, as GGML's do.
#[allow(clippy::needless_range_loop)]
pub fn make_qkx2_quants(
    nmax: i32,
    x: &[f32],
    weights: &[f32],
    l_out: &mut [u8],
    rmin: f32,
    rdelta: f32,
    nstep: i32,
) -> (f32, f32) {
    let n = x.len();
    debug_assert!(weights.len() == n && l_out.len() == n && n <= 32);
    let mut laux = [0u8; 32];
    let mut min = x[0];
    let mut max = x[0];
    let mut sum_w = weights[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..n {
        if x[i] < min {
            min = x[i];
        }
        if x[i] > max {
            max = x[i];
        }
        let w = weights[i];
        sum_w += w;
        sum_x += w * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        l_out.fill(0);
        return (0.0, -min);
    }
    let nmax_f = nmax as f32;
    let mut iscale = nmax_f / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best_error = 0.0f32;
    for i in 0..n {
        let l = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
        l_out[i] = l as u8;
        let diff = scale * f32::from(l_out[i]) + min - x[i];
        best_error += weights[i] * (diff * diff);
    }
    if nstep < 1 {
        return (scale, -min);
    }
    for is in 0..=nstep {
        iscale = (rmin + rdelta * is as f32 + nmax_f) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0.0f32, 0.0f32, 0.0f32);
        for i in 0..n {
            let l = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
            laux[i] = l as u8;
            let (w, lf) = (weights[i], l as f32);
            sum_l += w * lf;
            sum_l2 += w * lf * lf;
            sum_xl += w * lf * x[i];
        }
        let d = sum_w * sum_l2 - sum_l * sum_l;
        if d > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / d;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / d;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut cur_error = 0.0f32;
            for i in 0..n {
                let diff = this_scale * f32::from(laux[i]) + this_min - x[i];
                cur_error += weights[i] * (diff * diff);
            }
            if cur_error < best_error {
                l_out.copy_from_slice(&laux[..n]);
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

/// GGML's `make_qx_quants` with `rmse_type` 1: symmetric codes `l + nmax`, `l` in
/// `-nmax..nmax`, for `x ≈ scale·l`, starting from the value of largest magnitude at `−nmax`
/// and trying 18 nearby scales `−(nmax + 0.1·is) / max`; each candidate's codes get the
/// least-squares scale under weights `qw` (GGML's default, `x²`, when `None`), and the best
/// fit wins. Returns the scale; 0 (with zero codes) for a group below [`GROUP_MAX_EPS`].
// The loops index several arrays in step, as GGML's do.
#[allow(clippy::needless_range_loop)]
pub fn make_qx_quants(nmax: i32, x: &[f32], l_out: &mut [u8], qw: Option<&[f32]>) -> f32 {
    let n = x.len();
    debug_assert!(l_out.len() == n && qw.is_none_or(|w| w.len() == n));
    let mut max = 0.0f32;
    let mut amax = 0.0f32;
    for &v in x {
        let ax = v.abs();
        if ax > amax {
            amax = ax;
            max = v;
        }
    }
    if amax < GROUP_MAX_EPS {
        l_out.fill(0);
        return 0.0;
    }
    let weight = |i: usize| qw.map_or(x[i] * x[i], |w| w[i]);
    let nmax_f = nmax as f32;
    let mut iscale = -nmax_f / max;
    let (mut sumlx, mut suml2) = (0.0f32, 0.0f32);
    for i in 0..n {
        let l = nearest_int(iscale * x[i]).clamp(-nmax, nmax - 1);
        l_out[i] = (l + nmax) as u8;
        let (w, lf) = (weight(i), l as f32);
        sumlx += w * x[i] * lf;
        suml2 += w * lf * lf;
    }
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for is in -9..=9 {
        if is == 0 {
            continue;
        }
        iscale = -(nmax_f + 0.1 * is as f32) / max;
        sumlx = 0.0;
        suml2 = 0.0;
        for i in 0..n {
            let l = nearest_int(iscale * x[i]).clamp(-nmax, nmax - 1);
            let (w, lf) = (weight(i), l as f32);
            sumlx += w * x[i] * lf;
            suml2 += w * lf * lf;
        }
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            for i in 0..n {
                let l = nearest_int(iscale * x[i]).clamp(-nmax, nmax - 1);
                l_out[i] = (l + nmax) as u8;
            }
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

/// Sub-block scales and mins of a Q4_K/Q5_K super-block as GGML's reference quantizers choose
/// them: each sub-block fitted by [`make_qkx2_quants`] under weights `av_x + |x|` (`av_x` the
/// sub-block's root mean square), then both sets scaled to 6 bits against their largest value.
/// Returns `(d, dmin, packed scales, codes)`, the codes recomputed from the stored f16 scales.
fn quantize_super_block_qkx(
    x: &[f32; QK_K],
    nmax: i32,
    rmin: f32,
    rdelta: f32,
    nstep: i32,
) -> (f16, f16, [u8; K_SCALE_SIZE], [u8; QK_K]) {
    let mut l = [0u8; QK_K];
    let mut scales = [0f32; QK_K / 32];
    let mut mins = [0f32; QK_K / 32];
    let mut weights = [0f32; 32];
    let mut max_scale = 0.0f32;
    let mut max_min = 0.0f32;
    for j in 0..QK_K / 32 {
        let xs = &x[32 * j..32 * j + 32];
        let mut sum_x2 = 0.0f32;
        for &v in xs {
            sum_x2 += v * v;
        }
        let av_x = (sum_x2 / 32.0).sqrt();
        for (w, &v) in weights.iter_mut().zip(xs) {
            *w = av_x + v.abs();
        }
        let (scale, min) = make_qkx2_quants(
            nmax,
            xs,
            &weights,
            &mut l[32 * j..32 * j + 32],
            rmin,
            rdelta,
            nstep,
        );
        scales[j] = scale;
        mins[j] = min;
        if scale > max_scale {
            max_scale = scale;
        }
        if min > max_min {
            max_min = min;
        }
    }
    let inv_scale = if max_scale > 0.0 {
        63.0 / max_scale
    } else {
        0.0
    };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let mut ls = [0u8; 8];
    let mut lm = [0u8; 8];
    for j in 0..QK_K / 32 {
        // C assigns the int to a uint8_t (modulo 256) before taking the minimum with 63.
        ls[j] = (nearest_int(inv_scale * scales[j]) as u8).min(63);
        lm[j] = (nearest_int(inv_min * mins[j]) as u8).min(63);
    }
    let packed = pack_scale_min_k4(&ls, &lm);
    let d = f16::from_f32(max_scale / 63.0);
    let dmin = f16::from_f32(max_min / 63.0);
    requantize_with_scales(x, d, dmin, &packed, nmax, &mut l);
    (d, dmin, packed, l)
}

/// The last step of GGML's Q4_K/Q5_K quantizers: each sub-block's codes recomputed from the
/// stored scales, `l = round((x + dmin·m) / (d·sc))` clamped to `0..=nmax`. A sub-block whose
/// scale is zero keeps the codes it had.
fn requantize_with_scales(
    x: &[f32; QK_K],
    d: f16,
    dmin: f16,
    packed: &[u8; K_SCALE_SIZE],
    nmax: i32,
    l: &mut [u8; QK_K],
) {
    for j in 0..QK_K / 32 {
        let (sc, m) = scale_min_k4(j, packed);
        let ds = d.to_f32() * f32::from(sc);
        if ds == 0.0 {
            continue;
        }
        let dm = dmin.to_f32() * f32::from(m);
        for ii in 0..32 {
            l[32 * j + ii] = nearest_int((x[32 * j + ii] + dm) / ds).clamp(0, nmax) as u8;
        }
    }
}

/// Pack 256 codes in 0..=15 into Q4_K's `qs` (the inverse of [`q4_k_codes`]).
pub fn pack_q4_k_codes(l: &[u8; QK_K]) -> [u8; QK_K / 2] {
    let mut qs = [0u8; QK_K / 2];
    for (pair, q) in qs.chunks_exact_mut(32).enumerate() {
        for (i, q) in q.iter_mut().enumerate() {
            *q = l[64 * pair + i] | (l[64 * pair + 32 + i] << 4);
        }
    }
    qs
}

/// Pack 256 codes in 0..=31 into Q5_K's `qh` and `qs` (the inverse of [`q5_k_codes`]).
pub fn pack_q5_k_codes(l: &[u8; QK_K]) -> ([u8; QK_K / 8], [u8; QK_K / 2]) {
    let mut qh = [0u8; QK_K / 8];
    let mut qs = [0u8; QK_K / 2];
    for pair in 0..QK_K / 64 {
        for i in 0..32 {
            let (lo, hi) = (l[64 * pair + i], l[64 * pair + 32 + i]);
            qh[i] |= ((lo >> 4) << (2 * pair)) | ((hi >> 4) << (2 * pair + 1));
            qs[32 * pair + i] = (lo & 0x0f) | ((hi & 0x0f) << 4);
        }
    }
    (qh, qs)
}

/// Pack 256 codes in 0..=63 into Q6_K's `ql` and `qh` (the inverse of [`q6_k_codes`]).
pub fn pack_q6_k_codes(l: &[u8; QK_K]) -> ([u8; QK_K / 2], [u8; QK_K / 4]) {
    let mut ql = [0u8; QK_K / 2];
    let mut qh = [0u8; QK_K / 4];
    for half in 0..2 {
        let y = &l[128 * half..128 * half + 128];
        for i in 0..32 {
            let (q1, q2, q3, q4) = (y[i], y[i + 32], y[i + 64], y[i + 96]);
            ql[64 * half + i] = (q1 & 0x0f) | ((q3 & 0x0f) << 4);
            ql[64 * half + 32 + i] = (q2 & 0x0f) | ((q4 & 0x0f) << 4);
            qh[32 * half + i] = (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6);
        }
    }
    (ql, qh)
}

/// Quantize one super-block to Q4_K with GGML's reference rule (`quantize_row_q4_K_ref`):
/// sub-blocks fitted by [`make_qkx2_quants`] with 21 candidate scales (`rmin` −1, step 0.1).
pub fn quantize_block_q4_k_ref(x: &[f32; QK_K]) -> BlockQ4K {
    let (d, dmin, scales, l) = quantize_super_block_qkx(x, 15, -1.0, 0.1, 20);
    BlockQ4K {
        d,
        dmin,
        scales,
        qs: pack_q4_k_codes(&l),
    }
}

/// Quantize one super-block to Q5_K with GGML's reference rule (`quantize_row_q5_K_ref`):
/// as Q4_K with 5-bit codes and 16 candidate scales (`rmin` −0.5, step 0.1).
pub fn quantize_block_q5_k_ref(x: &[f32; QK_K]) -> BlockQ5K {
    let (d, dmin, scales, l) = quantize_super_block_qkx(x, 31, -0.5, 0.1, 15);
    let (qh, qs) = pack_q5_k_codes(&l);
    BlockQ5K {
        d,
        dmin,
        scales,
        qh,
        qs,
    }
}

/// Quantize one super-block to Q6_K with GGML's reference rule (`quantize_row_q6_K_ref`):
/// each sub-block of 16 fitted by [`make_qx_quants`] (weights `x²`), the sixteen scales
/// quantized to signed 8 bits against the one of largest magnitude (which maps to −128, capped
/// at 127), then the codes recomputed from the stored scales.
pub fn quantize_block_q6_k_ref(x: &[f32; QK_K]) -> BlockQ6K {
    quantize_block_q6_k_with(x, None)
}

/// [`quantize_block_q6_k_ref`] with optional per-weight importance (GGML's
/// `quantize_row_q6_K_impl`: the importance replaces the `x²` weights of each sub-block fit).
// The loops index several arrays in step, as GGML's do.
#[allow(clippy::needless_range_loop)]
pub fn quantize_block_q6_k_with(x: &[f32; QK_K], qw: Option<&[f32; QK_K]>) -> BlockQ6K {
    let mut l = [0u8; QK_K];
    let mut scales = [0f32; QK_K / 16];
    let mut max_scale = 0.0f32;
    let mut max_abs_scale = 0.0f32;
    for ib in 0..QK_K / 16 {
        let r = 16 * ib..16 * ib + 16;
        let w = qw.map(|w| &w[r.clone()]);
        let scale = make_qx_quants(32, &x[r.clone()], &mut l[r], w);
        scales[ib] = scale;
        if scale.abs() > max_abs_scale {
            max_abs_scale = scale.abs();
            max_scale = scale;
        }
    }
    let mut b = BlockQ6K::zeroed();
    if max_abs_scale < GROUP_MAX_EPS {
        return b;
    }
    let iscale = -128.0 / max_scale;
    b.d = f16::from_f32(1.0 / iscale);
    for (s, &scale) in b.scales.iter_mut().zip(&scales) {
        // C stores the int in an int8_t (modulo 256) after capping it at 127.
        *s = nearest_int(iscale * scale).min(127) as i8;
    }
    for j in 0..QK_K / 16 {
        let d = b.d.to_f32() * f32::from(b.scales[j]);
        if d == 0.0 {
            continue;
        }
        for ii in 0..16 {
            let q = nearest_int(x[16 * j + ii] / d).clamp(-32, 31);
            l[16 * j + ii] = (q + 32) as u8;
        }
    }
    (b.ql, b.qh) = pack_q6_k_codes(&l);
    b
}

fn super_blocks_of(x: &[f32]) -> Result<impl Iterator<Item = &[f32; QK_K]>> {
    crate::blocks::check_finite(x)?;
    if !x.len().is_multiple_of(QK_K) {
        return Err(FormatError::RowLength {
            len: x.len(),
            block: QK_K,
        });
    }
    Ok(x.chunks_exact(QK_K)
        .map(|c| c.try_into().expect("chunks_exact yields QK_K elements")))
}

/// Quantize a row (length a multiple of 256) to Q4_K with the reference rule.
///
/// Rejects NaN/Inf and lengths that are not a multiple of 256.
pub fn quantize_row_q4_k_ref(x: &[f32]) -> Result<Vec<BlockQ4K>> {
    Ok(super_blocks_of(x)?.map(quantize_block_q4_k_ref).collect())
}

/// Quantize a row (length a multiple of 256) to Q5_K with the reference rule.
pub fn quantize_row_q5_k_ref(x: &[f32]) -> Result<Vec<BlockQ5K>> {
    Ok(super_blocks_of(x)?.map(quantize_block_q5_k_ref).collect())
}

/// Quantize a row (length a multiple of 256) to Q6_K with the reference rule.
pub fn quantize_row_q6_k_ref(x: &[f32]) -> Result<Vec<BlockQ6K>> {
    Ok(super_blocks_of(x)?.map(quantize_block_q6_k_ref).collect())
}

// ---------------------------------------------------------------------------------------------
// Importance-weighted quantizers: what GGML's `quantize_q4_K`, `quantize_q5_K` and
// `quantize_q6_K` do when they are given an importance matrix (llama-quantize --imatrix;
// `quantize_row_q*_K_impl`), bit for bit. `qw` holds one non-negative weight per column of the
// row (llama.cpp's imatrix: the mean square of each input column over calibration text).
// ---------------------------------------------------------------------------------------------

/// GGML's `make_qp_quants`: non-negative codes `0..=nmax` for `x ≈ scale·l` under weights
/// `qw`, starting from the largest value at `nmax`, trying 8 nearby scales and then moving
/// single codes while that improves the weighted fit (5 passes at most). Returns the scale.
/// Used for the sub-block scales and minimums of the weighted Q4_K/Q5_K quantizers.
///
/// Codes are stored as C stores them in a `uint8_t` (modulo 256): only a negative `x`, which
/// the callers never pass, would show it.
// The loops index several arrays in step, as GGML's do.
#[allow(clippy::needless_range_loop)]
pub fn make_qp_quants(nmax: i32, x: &[f32], l_out: &mut [u8], qw: &[f32]) -> f32 {
    let n = x.len();
    debug_assert!(l_out.len() == n && qw.len() == n);
    let mut max = 0.0f32;
    for &v in x {
        max = if max > v { max } else { v };
    }
    if max < GROUP_MAX_EPS {
        l_out.fill(0);
        return 0.0;
    }
    let nmax_f = nmax as f32;
    let mut iscale = nmax_f / max;
    for i in 0..n {
        l_out[i] = nearest_int(iscale * x[i]) as u8;
    }
    let scale = 1.0 / iscale;
    let mut best_mse = 0.0f32;
    for i in 0..n {
        let diff = x[i] - scale * f32::from(l_out[i]);
        best_mse += qw[i] * diff * diff;
    }
    for is in -4..=4 {
        if is == 0 {
            continue;
        }
        let iscale_is = (0.1 * is as f32 + nmax_f) / max;
        let scale_is = 1.0 / iscale_is;
        let mut mse = 0.0f32;
        for i in 0..n {
            let l = nearest_int(iscale_is * x[i]).min(nmax);
            let diff = x[i] - scale_is * l as f32;
            mse += qw[i] * diff * diff;
        }
        if mse < best_mse {
            best_mse = mse;
            iscale = iscale_is;
        }
    }
    let (mut sumlx, mut suml2) = (0.0f32, 0.0f32);
    for i in 0..n {
        let l = nearest_int(iscale * x[i]).min(nmax);
        l_out[i] = l as u8;
        let (w, lf) = (qw[i], l as f32);
        sumlx += w * x[i] * lf;
        suml2 += w * lf * lf;
    }
    for _ in 0..5 {
        let mut n_changed = 0;
        for i in 0..n {
            let (w, li) = (qw[i], f32::from(l_out[i]));
            let mut slx = sumlx - w * x[i] * li;
            let mut sl2 = suml2 - w * li * li;
            if slx > 0.0 && sl2 > 0.0 {
                let new_l = nearest_int(x[i] * sl2 / slx).min(nmax);
                if new_l != i32::from(l_out[i]) {
                    let nl = new_l as f32;
                    slx += w * x[i] * nl;
                    sl2 += w * nl * nl;
                    if slx * slx * suml2 > sumlx * sumlx * sl2 {
                        l_out[i] = new_l as u8;
                        sumlx = slx;
                        suml2 = sl2;
                        n_changed += 1;
                    }
                }
            }
        }
        if n_changed == 0 {
            break;
        }
    }
    if suml2 > 0.0 {
        sumlx / suml2
    } else {
        0.0
    }
}

/// One Q4_K/Q5_K super-block with importance `qw` (GGML's `quantize_row_q4_K_impl` /
/// `quantize_row_q5_K_impl`): sub-block weights `qw·sqrt(σ² + x²)` with `σ² = 2·mean(x²)` over
/// the super-block, each sub-block fitted by GGML's `make_qkx3_quants` (37 candidate scales from
/// `nmax − 0.9` in steps of 0.05; with weights given it is [`make_qkx2_quants`]'s computation),
/// and the 6-bit scales and minimums chosen by [`make_qp_quants`] weighted by each sub-block's
/// total weight. `cap` is Q5_K's `MIN(63, ·)` on the packed values (Q4_K has none).
fn quantize_super_block_weighted(
    x: &[f32; QK_K],
    qw: &[f32; QK_K],
    nmax: i32,
    cap: bool,
) -> (f16, f16, [u8; K_SCALE_SIZE], [u8; QK_K]) {
    let mut l = [0u8; QK_K];
    let mut scales = [0f32; QK_K / 32];
    let mut mins = [0f32; QK_K / 32];
    let mut sw = [0f32; QK_K / 32];
    let mut weights = [0f32; 32];
    let mut sum_x2 = 0.0f32;
    for &v in x {
        sum_x2 += v * v;
    }
    let sigma2 = 2.0 * sum_x2 / QK_K as f32;
    for j in 0..QK_K / 32 {
        let xs = &x[32 * j..32 * j + 32];
        for ((w, &q), &v) in weights.iter_mut().zip(&qw[32 * j..32 * j + 32]).zip(xs) {
            *w = q * (sigma2 + v * v).sqrt();
        }
        let mut sumw = 0.0f32;
        for &w in &weights {
            sumw += w;
        }
        sw[j] = sumw;
        let lj = &mut l[32 * j..32 * j + 32];
        (scales[j], mins[j]) = make_qkx2_quants(nmax, xs, &weights, lj, -0.9, 0.05, 36);
    }
    let mut ls = [0u8; 8];
    let mut lm = [0u8; 8];
    let d_block = make_qp_quants(63, &scales, &mut ls, &sw);
    let m_block = make_qp_quants(63, &mins, &mut lm, &sw);
    if cap {
        ls.iter_mut()
            .chain(lm.iter_mut())
            .for_each(|v| *v = (*v).min(63));
    }
    let packed = pack_scale_min_k4_bytes(&ls, &lm);
    let d = f16::from_f32(d_block);
    let dmin = f16::from_f32(m_block);
    requantize_with_scales(x, d, dmin, &packed, nmax, &mut l);
    (d, dmin, packed, l)
}

/// Quantize one super-block to Q4_K with importance `qw` (one weight per value), as GGML's
/// `quantize_q4_K` does with an importance matrix.
pub fn quantize_block_q4_k_weighted(x: &[f32; QK_K], qw: &[f32; QK_K]) -> BlockQ4K {
    let (d, dmin, scales, l) = quantize_super_block_weighted(x, qw, 15, false);
    BlockQ4K {
        d,
        dmin,
        scales,
        qs: pack_q4_k_codes(&l),
    }
}

/// Quantize one super-block to Q5_K with importance `qw`, as GGML's `quantize_q5_K` does with an
/// importance matrix.
pub fn quantize_block_q5_k_weighted(x: &[f32; QK_K], qw: &[f32; QK_K]) -> BlockQ5K {
    let (d, dmin, scales, l) = quantize_super_block_weighted(x, qw, 31, true);
    let (qh, qs) = pack_q5_k_codes(&l);
    BlockQ5K {
        d,
        dmin,
        scales,
        qh,
        qs,
    }
}

/// Importance weights must be one per value, finite and non-negative.
pub(crate) fn check_importance(qw: &[f32], expected: usize) -> Result<()> {
    if qw.len() != expected {
        return Err(FormatError::ImportanceLength {
            len: qw.len(),
            expected,
        });
    }
    match qw.iter().position(|w| !(w.is_finite() && *w >= 0.0)) {
        Some(position) => Err(FormatError::BadImportance {
            position,
            value: qw[position],
        }),
        None => Ok(()),
    }
}

fn weighted_row<'a>(
    x: &'a [f32],
    qw: &'a [f32],
) -> Result<impl Iterator<Item = (&'a [f32; QK_K], &'a [f32; QK_K])>> {
    let blocks = super_blocks_of(x)?;
    check_importance(qw, x.len())?;
    let weights = qw
        .chunks_exact(QK_K)
        .map(|c| <&[f32; QK_K]>::try_from(c).expect("chunks_exact yields QK_K elements"));
    Ok(blocks.zip(weights))
}

/// Quantize a row to Q4_K with one importance weight per value (GGML's `quantize_q4_K` with an
/// importance matrix). Rejects NaN/Inf, rows that are not a multiple of 256, and importance of
/// another length or with negative values.
pub fn quantize_row_q4_k_weighted(x: &[f32], qw: &[f32]) -> Result<Vec<BlockQ4K>> {
    Ok(weighted_row(x, qw)?
        .map(|(x, w)| quantize_block_q4_k_weighted(x, w))
        .collect())
}

/// Quantize a row to Q5_K with importance (GGML's `quantize_q5_K` with an importance matrix).
pub fn quantize_row_q5_k_weighted(x: &[f32], qw: &[f32]) -> Result<Vec<BlockQ5K>> {
    Ok(weighted_row(x, qw)?
        .map(|(x, w)| quantize_block_q5_k_weighted(x, w))
        .collect())
}

/// Quantize a row to Q6_K with importance (GGML's `quantize_q6_K` with an importance matrix:
/// the importance replaces the `x²` weights of each sub-block's fit).
pub fn quantize_row_q6_k_weighted(x: &[f32], qw: &[f32]) -> Result<Vec<BlockQ6K>> {
    Ok(weighted_row(x, qw)?
        .map(|(x, w)| quantize_block_q6_k_with(x, Some(w)))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn sizes_are_ggml_sizes() {
        assert_eq!(std::mem::size_of::<BlockQ4K>(), 144);
        assert_eq!(std::mem::size_of::<BlockQ5K>(), 176);
        assert_eq!(std::mem::size_of::<BlockQ6K>(), 210);
        assert_eq!(std::mem::size_of::<BlockQ8K>(), 292);
    }

    #[test]
    fn nearest_int_rounds_ties_to_even() {
        for (x, want) in [
            (0.5, 0),
            (1.5, 2),
            (2.5, 2),
            (-0.5, 0),
            (-1.5, -2),
            (-2.4, -2),
            (126.6, 127),
            (-127.0, -127),
        ] {
            assert_eq!(nearest_int(x), want, "{x}");
        }
    }

    proptest! {
        #[test]
        fn scale_min_packing_round_trips(v in proptest::collection::vec(0u8..64, 16)) {
            let sc: [u8; 8] = v[..8].try_into().unwrap();
            let m: [u8; 8] = v[8..].try_into().unwrap();
            let packed = pack_scale_min_k4(&sc, &m);
            for j in 0..8 {
                prop_assert_eq!(scale_min_k4(j, &packed), (sc[j], m[j]));
            }
        }

        #[test]
        fn q8_k_codes_reconstruct_within_half_a_step(
            x in proptest::collection::vec(-100f32..100.0, QK_K)
        ) {
            let x: [f32; QK_K] = x.try_into().unwrap();
            let b = quantize_block_q8_k_ref(&x);
            for i in 0..16 {
                let s: i16 = b.qs[16 * i..16 * i + 16].iter().map(|&q| i16::from(q)).sum();
                prop_assert_eq!(b.bsums[i], s);
            }
            for (&v, &q) in x.iter().zip(&b.qs) {
                // Half a step, plus the rounding of d = 1/iscale times a code up to 127.
                prop_assert!((v - b.d * f32::from(q)).abs() <= b.d.abs() * (0.5 + 1e-4));
            }
        }
    }

    #[test]
    fn q6_k_weight_order() {
        // Give weight w the code w % 64 and check every bit lands where the layout says.
        let mut b = BlockQ6K::zeroed();
        for w in 0..QK_K {
            let (half, i) = (w / 128, w % 128);
            let (k, l) = (i / 32, i % 32);
            let code = (w % 64) as u8;
            let ql = &mut b.ql[64 * half + l + 32 * (k % 2)];
            *ql |= (code & 0x0f) << (4 * (k / 2));
            b.qh[32 * half + l] |= (code >> 4) << (2 * k);
        }
        let q = q6_k_codes(&b);
        for (w, &c) in q.iter().enumerate() {
            assert_eq!(c as usize, w % 64, "weight {w}");
        }
        b.d = f16::from_f32(0.5);
        b.scales = [2; 16];
        let mut out = [0f32; QK_K];
        dequantize_row_q6_k(&[b], &mut out);
        for (w, &v) in out.iter().enumerate() {
            assert_eq!(v, ((w % 64) as f32 - 32.0), "weight {w}");
        }
    }

    #[test]
    fn q4_k_and_q5_k_sub_blocks_take_their_own_scale_and_min() {
        let sc = [1, 2, 3, 4, 5, 6, 7, 63];
        let m = [0, 1, 2, 3, 4, 5, 6, 63];
        let mut b = BlockQ4K {
            d: f16::from_f32(0.5),
            dmin: f16::from_f32(0.25),
            scales: pack_scale_min_k4(&sc, &m),
            qs: [0; QK_K / 2],
        };
        for (i, q) in b.qs.iter_mut().enumerate() {
            *q = (i % 16) as u8 | (((i + 3) % 16) as u8) << 4;
        }
        let mut out = [0f32; QK_K];
        dequantize_row_q4_k(&[b], &mut out);
        for (w, &v) in out.iter().enumerate() {
            // Weight w is in byte 32·pair + w % 32: the low nibble for the pair's first
            // sub-block, the high one for its second.
            let (pair, r) = (w / 64, w % 64);
            let i = 32 * pair + r % 32;
            let code = if r < 32 { i % 16 } else { (i + 3) % 16 };
            let s = w / 32;
            let want = 0.5 * sc[s] as f32 * code as f32 - 0.25 * m[s] as f32;
            assert_eq!(v, want, "weight {w}");
        }
        let mut b5 = BlockQ5K {
            d: b.d,
            dmin: b.dmin,
            scales: b.scales,
            qh: [0; 32],
            qs: b.qs,
        };
        // Fifth bit set for every weight of sub-block 5 (pair 2, high nibbles).
        for h in &mut b5.qh {
            *h |= 1 << 5;
        }
        let mut out5 = [0f32; QK_K];
        dequantize_row_q5_k(&[b5], &mut out5);
        for w in 0..QK_K {
            let s = w / 32;
            let extra = if s == 5 {
                16.0 * 0.5 * sc[s] as f32
            } else {
                0.0
            };
            assert_eq!(out5[w], out[w] + extra, "weight {w}");
        }
    }
}
