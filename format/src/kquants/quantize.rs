//! The reference K-quant quantizers: GGML's `quantize_row_q4_K_ref`, `quantize_row_q5_K_ref`
//! and `quantize_row_q6_K_ref`, bit for bit, with the search routines they share.

use bytemuck::Zeroable;
use half::f16;

use super::{
    nearest_int, pack_scale_min_k4, scale_min_k4, BlockQ4K, BlockQ5K, BlockQ6K, K_SCALE_SIZE, QK_K,
};
use crate::error::{FormatError, Result};

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
pub fn make_qkx2_quants(
    nmax: i32,
    x: &[f32],
    weights: &[f32],
    l_out: &mut [u8],
    rmin: f32,
    rdelta: f32,
    nstep: i32,
) -> (f32, f32) {
    make_qkx2_quants_with(nmax, x, weights, l_out, rmin, rdelta, nstep, false)
}

/// [`make_qkx2_quants`] with GGML's `use_mad` flag: when set, candidates are judged by the
/// weighted absolute error instead of the squared one (Q2_K's reference quantizer; the
/// least-squares refinement of each candidate is the same).
// GGML's signature, flag included; the loops index several arrays in step, as GGML's do.
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
pub(super) fn make_qkx2_quants_with(
    nmax: i32,
    x: &[f32],
    weights: &[f32],
    l_out: &mut [u8],
    rmin: f32,
    rdelta: f32,
    nstep: i32,
    use_mad: bool,
) -> (f32, f32) {
    let err = |diff: f32| if use_mad { diff.abs() } else { diff * diff };
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
        best_error += weights[i] * err(diff);
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
                cur_error += weights[i] * err(diff);
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
/// The value of largest magnitude (the first such, keeping its sign) and that magnitude: where
/// GGML's symmetric fits (`make_qx_quants`, `make_q3_quants`) start.
pub(super) fn signed_max(x: &[f32]) -> (f32, f32) {
    let mut max = 0.0f32;
    let mut amax = 0.0f32;
    for &v in x {
        let ax = v.abs();
        if ax > amax {
            amax = ax;
            max = v;
        }
    }
    (max, amax)
}

// The loops index several arrays in step, as GGML's do.
#[allow(clippy::needless_range_loop)]
pub fn make_qx_quants(nmax: i32, x: &[f32], l_out: &mut [u8], qw: Option<&[f32]>) -> f32 {
    let n = x.len();
    debug_assert!(l_out.len() == n && qw.is_none_or(|w| w.len() == n));
    let (max, amax) = signed_max(x);
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
pub(super) fn requantize_with_scales(
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

/// Pack 256 codes in 0..=15 into Q4_K's `qs` (the inverse of [`super::q4_k_codes`]).
pub fn pack_q4_k_codes(l: &[u8; QK_K]) -> [u8; QK_K / 2] {
    let mut qs = [0u8; QK_K / 2];
    for (pair, q) in qs.chunks_exact_mut(32).enumerate() {
        for (i, q) in q.iter_mut().enumerate() {
            *q = l[64 * pair + i] | (l[64 * pair + 32 + i] << 4);
        }
    }
    qs
}

/// Pack 256 codes in 0..=31 into Q5_K's `qh` and `qs` (the inverse of [`super::q5_k_codes`]).
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

/// Pack 256 codes in 0..=63 into Q6_K's `ql` and `qh` (the inverse of [`super::q6_k_codes`]).
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

pub(super) fn super_blocks_of(x: &[f32]) -> Result<impl Iterator<Item = &[f32; QK_K]>> {
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
