//! GGML's Q2_K: 256 weights in sixteen sub-blocks of 16, each with a 4-bit scale and a 4-bit
//! min, 2-bit codes: `w = d·sc[s]·q − dmin·m[s]` (84 bytes, 2.625 bits a weight).

use bytemuck::{Pod, Zeroable};
use half::f16;

use super::quantize::{make_qkx2_quants_with, super_blocks_of};
use super::weighted::weighted_row;
use super::{make_qp_quants, nearest_int, QK_K};
use crate::error::Result;

/// One Q2_K super-block, GGML's `block_q2_K` byte for byte.
///
/// `scales[s]` holds sub-block `s`'s scale in its low nibble and its min in the high one.
/// Each 32 bytes of `qs` hold 128 weights: weight `l + 32k` of the half (`l` < 32, `k` < 4)
/// is bits `2k..2k + 2` of `qs[l]` of that half.
#[derive(Debug, Clone, Copy, PartialEq, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ2K {
    /// Sub-block scales (low nibble) and mins (high nibble).
    pub scales: [u8; QK_K / 16],
    /// 2-bit codes.
    pub qs: [u8; QK_K / 4],
    /// Super-block scale of the sub-block scales.
    pub d: f16,
    /// Super-block scale of the sub-block mins.
    pub dmin: f16,
}

const _: () = assert!(std::mem::size_of::<BlockQ2K>() == 84);

/// The 2-bit codes of a Q2_K block, in weight order.
pub fn q2_k_codes(b: &BlockQ2K) -> [u8; QK_K] {
    let mut q = [0u8; QK_K];
    for (half, qs) in b.qs.chunks_exact(32).enumerate() {
        for (l, &byte) in qs.iter().enumerate() {
            for k in 0..4 {
                q[128 * half + 32 * k + l] = (byte >> (2 * k)) & 3;
            }
        }
    }
    q
}

/// Pack 256 codes (each 0..=3) into Q2_K's `qs`, the inverse of [`q2_k_codes`].
pub fn pack_q2_k_codes(l: &[u8; QK_K]) -> [u8; QK_K / 4] {
    debug_assert!(l.iter().all(|&q| q < 4), "2-bit codes");
    let mut qs = [0u8; QK_K / 4];
    for (half, qs) in qs.chunks_exact_mut(32).enumerate() {
        let y = &l[128 * half..128 * half + 128];
        for (i, q) in qs.iter_mut().enumerate() {
            *q = y[i] | (y[i + 32] << 2) | (y[i + 64] << 4) | (y[i + 96] << 6);
        }
    }
    qs
}

/// The last step of both GGML quantizers: each sub-block's codes recomputed from the stored
/// scale and min, `l = round((x + dmin·m) / (d·sc))` clamped to 0..=3. A sub-block whose scale
/// is zero keeps the codes of its fit.
fn requantize(x: &[f32; QK_K], b: &BlockQ2K, l: &mut [u8; QK_K]) {
    let (dall, dmin) = (b.d.to_f32(), b.dmin.to_f32());
    for (j, &sc) in b.scales.iter().enumerate() {
        let d = dall * f32::from(sc & 0x0f);
        if d == 0.0 {
            continue;
        }
        let dm = dmin * f32::from(sc >> 4);
        for ii in 16 * j..16 * j + 16 {
            l[ii] = nearest_int((x[ii] + dm) / d).clamp(0, 3) as u8;
        }
    }
}

/// One super-block by GGML's reference rule: each sub-block of 16 fitted by `make_qkx2_quants`
/// under weights `|x|`, judged by absolute error (`use_mad`), 16 candidate scales; scales and
/// mins then rounded to 4 bits against their largest.
fn quantize_block_q2_k_ref(x: &[f32; QK_K]) -> BlockQ2K {
    let mut l = [0u8; QK_K];
    let mut scales = [0f32; QK_K / 16];
    let mut mins = [0f32; QK_K / 16];
    let mut weights = [0f32; 16];
    let mut max_scale = 0.0f32;
    let mut max_min = 0.0f32;
    for j in 0..QK_K / 16 {
        let xs = &x[16 * j..16 * j + 16];
        for (w, &v) in weights.iter_mut().zip(xs) {
            *w = v.abs();
        }
        let lj = &mut l[16 * j..16 * j + 16];
        (scales[j], mins[j]) = make_qkx2_quants_with(3, xs, &weights, lj, -0.5, 0.1, 15, true);
        if scales[j] > max_scale {
            max_scale = scales[j];
        }
        if mins[j] > max_min {
            max_min = mins[j];
        }
    }
    let mut b = BlockQ2K::zeroed();
    // C stores the rounded ints in the uint8_t nibbles unchecked (modulo 256, the min shifted
    // left): nothing caps them at 15.
    if max_scale > 0.0 {
        let iscale = 15.0 / max_scale;
        for (s, &scale) in b.scales.iter_mut().zip(&scales) {
            *s = nearest_int(iscale * scale) as u8;
        }
        b.d = f16::from_f32(max_scale / 15.0);
    }
    if max_min > 0.0 {
        let iscale = 15.0 / max_min;
        for (s, &min) in b.scales.iter_mut().zip(&mins) {
            *s |= (nearest_int(iscale * min) << 4) as u8;
        }
        b.dmin = f16::from_f32(max_min / 15.0);
    }
    requantize(x, &b, &mut l);
    b.qs = pack_q2_k_codes(&l);
    b
}

/// One super-block with importance `qw` (GGML's `quantize_row_q2_K_impl`): sub-block weights
/// `qw·sqrt(σ² + x²)` with `σ² = mean(x²)` over the super-block (Q3_K–Q5_K double it), each
/// sub-block fitted by `make_qkx3_quants` (37 candidate scales from `3 − 0.9` in steps of
/// 0.05, squared error: with weights given, [`make_qkx2_quants_with`]'s computation), and the
/// 4-bit scales and mins chosen by [`make_qp_quants`] weighted by each sub-block's total weight.
fn quantize_block_q2_k_weighted(x: &[f32; QK_K], qw: &[f32; QK_K]) -> BlockQ2K {
    let mut l = [0u8; QK_K];
    let mut scales = [0f32; QK_K / 16];
    let mut mins = [0f32; QK_K / 16];
    let mut sw = [0f32; QK_K / 16];
    let mut weights = [0f32; 16];
    let mut sum_x2 = 0.0f32;
    for &v in x {
        sum_x2 += v * v;
    }
    let sigma2 = sum_x2 / QK_K as f32;
    for j in 0..QK_K / 16 {
        let xs = &x[16 * j..16 * j + 16];
        for ((w, &q), &v) in weights.iter_mut().zip(&qw[16 * j..16 * j + 16]).zip(xs) {
            *w = q * (sigma2 + v * v).sqrt();
        }
        for &w in &weights {
            sw[j] += w;
        }
        let lj = &mut l[16 * j..16 * j + 16];
        (scales[j], mins[j]) = make_qkx2_quants_with(3, xs, &weights, lj, -0.9, 0.05, 36, false);
    }
    let mut ls = [0u8; QK_K / 16];
    let mut lm = [0u8; QK_K / 16];
    let dm = make_qp_quants(15, &scales, &mut ls, &sw);
    let mm = make_qp_quants(15, &mins, &mut lm, &sw);
    let mut b = BlockQ2K {
        d: f16::from_f32(dm),
        dmin: f16::from_f32(mm),
        ..BlockQ2K::zeroed()
    };
    for ((s, &sc), &m) in b.scales.iter_mut().zip(&ls).zip(&lm) {
        // As C's uint8_t: a code past 15 (only from a negative fit) spills into the min's bits.
        *s = sc | (m << 4);
    }
    requantize(x, &b, &mut l);
    b.qs = pack_q2_k_codes(&l);
    b
}

/// GGML's `quantize_row_q2_K_ref` over whole rows (finite values, a multiple of 256).
pub fn quantize_row_q2_k_ref(x: &[f32]) -> Result<Vec<BlockQ2K>> {
    Ok(super_blocks_of(x)?.map(quantize_block_q2_k_ref).collect())
}

/// GGML's `quantize_q2_K` given an importance matrix (`quantize_row_q2_K_impl`): one row,
/// one non-negative weight per value.
pub fn quantize_row_q2_k_weighted(x: &[f32], qw: &[f32]) -> Result<Vec<BlockQ2K>> {
    Ok(weighted_row(x, qw)?
        .map(|(x, w)| quantize_block_q2_k_weighted(x, w))
        .collect())
}

/// GGML's `dequantize_row_q2_K`: `(d·sc)·q − dmin·m`, in that order of operations.
pub fn dequantize_row_q2_k(blocks: &[BlockQ2K], out: &mut [f32]) {
    assert_eq!(out.len(), blocks.len() * QK_K, "output length mismatch");
    for (b, o) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let (d, dmin) = (b.d.to_f32(), b.dmin.to_f32());
        let q = q2_k_codes(b);
        for ((o, q), &sc) in o
            .chunks_exact_mut(16)
            .zip(q.chunks_exact(16))
            .zip(&b.scales)
        {
            let (dl, ml) = (d * f32::from(sc & 0x0f), dmin * f32::from(sc >> 4));
            for (o, &q) in o.iter_mut().zip(q) {
                *o = dl * f32::from(q) - ml;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::FormatError;

    #[test]
    fn codes_follow_the_layout() {
        // Weight w gets code (w / 7) % 4; check each lands in the bits the layout names.
        let l: [u8; QK_K] = std::array::from_fn(|w| ((w / 7) % 4) as u8);
        let qs = pack_q2_k_codes(&l);
        for (w, &c) in l.iter().enumerate() {
            let (half, k, i) = (w / 128, (w % 128) / 32, w % 32);
            assert_eq!((qs[32 * half + i] >> (2 * k)) & 3, c, "weight {w}");
        }
        let b = BlockQ2K {
            qs,
            ..BlockQ2K::zeroed()
        };
        assert_eq!(q2_k_codes(&b), l);
    }

    #[test]
    fn dequantization_applies_each_sub_blocks_scale_and_min() {
        let mut b = BlockQ2K {
            d: f16::from_f32(0.5),
            dmin: f16::from_f32(0.25),
            ..BlockQ2K::zeroed()
        };
        for (s, sc) in b.scales.iter_mut().enumerate() {
            *sc = (s as u8) | ((15 - s as u8) << 4);
        }
        let l: [u8; QK_K] = std::array::from_fn(|w| (w % 4) as u8);
        b.qs = pack_q2_k_codes(&l);
        let mut out = [0f32; QK_K];
        dequantize_row_q2_k(&[b], &mut out);
        for (w, &v) in out.iter().enumerate() {
            let s = w / 16;
            let want = 0.5 * s as f32 * (w % 4) as f32 - 0.25 * (15 - s) as f32;
            assert_eq!(v, want, "weight {w}");
        }
    }

    #[test]
    fn zeros_quantize_to_a_zero_block() {
        let zero = BlockQ2K::zeroed();
        assert_eq!(quantize_row_q2_k_ref(&[0.0; QK_K]).unwrap(), [zero]);
        let got = quantize_row_q2_k_weighted(&[0.0; QK_K], &[1.0; QK_K]).unwrap();
        assert_eq!(got, [zero]);
    }

    #[test]
    fn bad_rows_and_importance_are_refused() {
        let mut x = vec![0.5f32; 2 * QK_K];
        let qw = vec![1.0f32; 2 * QK_K];
        assert!(matches!(
            quantize_row_q2_k_ref(&x[..300]),
            Err(FormatError::RowLength { len: 300, .. })
        ));
        assert!(matches!(
            quantize_row_q2_k_weighted(&x[..300], &qw[..300]),
            Err(FormatError::RowLength { len: 300, .. })
        ));
        assert!(matches!(
            quantize_row_q2_k_weighted(&x, &qw[..QK_K]),
            Err(FormatError::ImportanceLength { .. })
        ));
        let mut bad_qw = qw.clone();
        bad_qw[7] = -1.0;
        assert!(matches!(
            quantize_row_q2_k_weighted(&x, &bad_qw),
            Err(FormatError::BadImportance { position: 7, .. })
        ));
        x[300] = f32::NAN;
        assert!(matches!(
            quantize_row_q2_k_ref(&x),
            Err(FormatError::NonFinite { position: 300, .. })
        ));
        assert!(matches!(
            quantize_row_q2_k_weighted(&x, &qw),
            Err(FormatError::NonFinite { position: 300, .. })
        ));
    }

    #[test]
    fn reconstruction_is_close_for_a_smooth_ramp() {
        let x: Vec<f32> = (0..QK_K).map(|i| (i as f32 * 0.05).sin()).collect();
        let b = quantize_row_q2_k_ref(&x).unwrap();
        let mut y = vec![0f32; QK_K];
        dequantize_row_q2_k(&b, &mut y);
        let max_err = x
            .iter()
            .zip(&y)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        // Four levels over each sub-block's range: within about a third of the full range.
        assert!(max_err < 0.35, "max error {max_err}");
    }
}
