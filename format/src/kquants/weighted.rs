//! The importance-weighted K-quant quantizers: what GGML's `quantize_q4_K`, `quantize_q5_K`
//! and `quantize_q6_K` do when given an importance matrix, bit for bit.

use half::f16;

use super::quantize::{
    make_qkx2_quants, pack_q4_k_codes, pack_q5_k_codes, quantize_block_q6_k_with,
    requantize_with_scales, super_blocks_of,
};
use super::{
    nearest_int, pack_scale_min_k4_bytes, BlockQ4K, BlockQ5K, BlockQ6K, GROUP_MAX_EPS,
    K_SCALE_SIZE, QK_K,
};
use crate::error::{FormatError, Result};

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

/// A row and its importance as pairs of super-blocks, once both pass the checks every
/// weighted K-quant quantizer makes.
pub(super) fn weighted_row<'a>(
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
