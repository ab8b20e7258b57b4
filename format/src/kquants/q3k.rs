//! GGML's Q3_K: 256 weights in sixteen sub-blocks of 16, each with a signed 6-bit scale,
//! 3-bit codes: `w = d·(sc[s] − 32)·(q − 4)` (110 bytes, 3.4375 bits a weight).

use bytemuck::{Pod, Zeroable};
use half::f16;

use super::quantize::super_blocks_of;
use super::weighted::weighted_row;
use super::{make_qx_quants, nearest_int, GROUP_MAX_EPS, K_SCALE_SIZE, QK_K};
use crate::error::Result;

/// One Q3_K super-block, GGML's `block_q3_K` byte for byte.
///
/// A weight's code `q` (0..=7) is its two low bits in `qs` (laid out as Q2_K's) plus 4 when its
/// bit in `hmask` is set: bit `k` of `hmask[l]` (`k` < 8) belongs to weight `l + 32k`.
/// `scales` packs the sixteen 6-bit scales (stored as `sc + 32`).
#[derive(Debug, Clone, Copy, PartialEq, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ3K {
    /// High bit of each code.
    pub hmask: [u8; QK_K / 8],
    /// Low two bits of each code.
    pub qs: [u8; QK_K / 4],
    /// Packed 6-bit sub-block scales.
    pub scales: [u8; K_SCALE_SIZE],
    /// Super-block scale.
    pub d: f16,
}

const _: () = assert!(std::mem::size_of::<BlockQ3K>() == 110);

/// The sixteen sub-block scales of a Q3_K block, unpacked and offset (−32..=31).
///
/// Scale `j` keeps its low four bits in a nibble of byte `j % 8` (the low one for `j` < 8) and
/// its top two bits in bits `2·(j / 4)` of byte `8 + j % 4`.
pub fn q3_k_scales(scales: &[u8; K_SCALE_SIZE]) -> [i8; 16] {
    let mut sc = [0i8; 16];
    for (j, sc) in sc.iter_mut().enumerate() {
        let low = if j < 8 {
            scales[j] & 0x0f
        } else {
            scales[j - 8] >> 4
        };
        let high = (scales[8 + j % 4] >> (2 * (j / 4))) & 3;
        *sc = (low | (high << 4)) as i8 - 32;
    }
    sc
}

/// Pack sixteen 6-bit scales (already offset by 32) the way both GGML quantizers do, the
/// inverse of [`q3_k_scales`].
fn pack_q3_k_scales(ls: &[u8; 16]) -> [u8; K_SCALE_SIZE] {
    debug_assert!(ls.iter().all(|&v| v < 64), "6-bit values");
    let mut s = [0u8; K_SCALE_SIZE];
    for (j, &l) in ls.iter().enumerate() {
        if j < 8 {
            s[j] = l & 0x0f;
        } else {
            s[j - 8] |= (l & 0x0f) << 4;
        }
        s[8 + j % 4] |= (l >> 4) << (2 * (j / 4));
    }
    s
}

/// The 3-bit codes (0..=7, the value being `q − 4`) of a Q3_K block, in weight order.
pub fn q3_k_codes(b: &BlockQ3K) -> [u8; QK_K] {
    let mut q = [0u8; QK_K];
    for (half, qs) in b.qs.chunks_exact(32).enumerate() {
        for (l, &byte) in qs.iter().enumerate() {
            for k in 0..4 {
                let w = 128 * half + 32 * k + l;
                let high = (b.hmask[l] >> (4 * half + k)) & 1;
                q[w] = ((byte >> (2 * k)) & 3) | (high << 2);
            }
        }
    }
    q
}

/// Pack 256 codes (each 0..=7) into Q3_K's `hmask` and `qs`, the inverse of [`q3_k_codes`].
pub fn pack_q3_k_codes(l: &[u8; QK_K]) -> ([u8; QK_K / 8], [u8; QK_K / 4]) {
    debug_assert!(l.iter().all(|&q| q < 8), "3-bit codes");
    let mut hmask = [0u8; QK_K / 8];
    let mut qs = [0u8; QK_K / 4];
    for (w, &q) in l.iter().enumerate() {
        hmask[w % 32] |= (q >> 2) << (w / 32);
        let (half, k, i) = (w / 128, (w % 128) / 32, w % 32);
        qs[32 * half + i] |= (q & 3) << (2 * k);
    }
    (hmask, qs)
}

/// GGML's `make_q3_quants` with `do_rmse` (the only way Q3_K calls it): symmetric codes
/// `l + nmax`, `l` in `-nmax..nmax`, starting from the value of largest magnitude at `−nmax`,
/// then moving single codes while that improves the fit under weights `x²` (5 passes at most).
/// Returns the least-squares scale of the final codes; 0 (zero codes) for an all-zero group.
// The loops index several arrays in step, as GGML's do.
#[allow(clippy::needless_range_loop)]
fn make_q3_quants(nmax: i32, x: &[f32], l_out: &mut [u8]) -> f32 {
    let n = x.len();
    debug_assert!(l_out.len() == n && n <= 16);
    let (max, amax) = super::quantize::signed_max(x);
    if amax < GROUP_MAX_EPS {
        l_out.fill(0);
        return 0.0;
    }
    let iscale = -(nmax as f32) / max;
    let mut l = [0i32; 16];
    let (mut sumlx, mut suml2) = (0.0f32, 0.0f32);
    for i in 0..n {
        l[i] = nearest_int(iscale * x[i]).clamp(-nmax, nmax - 1);
        let (w, lf) = (x[i] * x[i], l[i] as f32);
        sumlx += w * x[i] * lf;
        suml2 += w * lf * lf;
    }
    for _ in 0..5 {
        let mut n_changed = 0;
        for i in 0..n {
            let (w, li) = (x[i] * x[i], l[i] as f32);
            let mut slx = sumlx - w * x[i] * li;
            if slx > 0.0 {
                let mut sl2 = suml2 - w * li * li;
                let new_l = nearest_int(x[i] * sl2 / slx).clamp(-nmax, nmax - 1);
                if new_l != l[i] {
                    let nl = new_l as f32;
                    slx += w * x[i] * nl;
                    sl2 += w * nl * nl;
                    if sl2 > 0.0 && slx * slx * suml2 > sumlx * sumlx * sl2 {
                        l[i] = new_l;
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
    for (o, &l) in l_out.iter_mut().zip(&l) {
        *o = (l + nmax) as u8;
    }
    if suml2 > 0.0 {
        sumlx / suml2
    } else {
        0.0
    }
}

/// A block with the codes recomputed from its stored scales, `l = round(x / (d·sc))` clamped
/// to −4..=3, the last step of both GGML quantizers. A sub-block whose scale is zero keeps the
/// codes of its fit.
fn finish(x: &[f32; QK_K], d: f16, scales: [u8; K_SCALE_SIZE], l: &mut [u8; QK_K]) -> BlockQ3K {
    for (j, &sc) in q3_k_scales(&scales).iter().enumerate() {
        let ds = d.to_f32() * f32::from(sc);
        if ds == 0.0 {
            continue;
        }
        for ii in 16 * j..16 * j + 16 {
            l[ii] = (nearest_int(x[ii] / ds).clamp(-4, 3) + 4) as u8;
        }
    }
    let (hmask, qs) = pack_q3_k_codes(l);
    BlockQ3K {
        hmask,
        qs,
        scales,
        d,
    }
}

/// One super-block by GGML's reference rule: each sub-block of 16 fitted by `make_q3_quants`,
/// the sixteen scales rounded to signed 6 bits against the one of largest magnitude (which maps
/// to −32, the opposite extreme capped at 31).
fn quantize_block_q3_k_ref(x: &[f32; QK_K]) -> BlockQ3K {
    let mut l = [0u8; QK_K];
    let mut scales = [0f32; QK_K / 16];
    let mut max_scale = 0.0f32;
    let mut amax = 0.0f32;
    for j in 0..QK_K / 16 {
        scales[j] = make_q3_quants(4, &x[16 * j..16 * j + 16], &mut l[16 * j..16 * j + 16]);
        if scales[j].abs() > amax {
            amax = scales[j].abs();
            max_scale = scales[j];
        }
    }
    let (d, packed) = if max_scale != 0.0 {
        let iscale = -32.0 / max_scale;
        let mut ls = [0u8; 16];
        for (q, &scale) in ls.iter_mut().zip(&scales) {
            // C stores the rounded int in an int8_t (modulo 256) before clamping it.
            let r = i32::from(nearest_int(iscale * scale) as i8);
            *q = (r.clamp(-32, 31) + 32) as u8;
        }
        (f16::from_f32(1.0 / iscale), pack_q3_k_scales(&ls))
    } else {
        // All-zero bytes unpack to scales of −32, but times d = 0 every sub-block is skipped.
        (f16::ZERO, [0; K_SCALE_SIZE])
    };
    finish(x, d, packed, &mut l)
}

/// One super-block with importance `qw` (GGML's `quantize_row_q3_K_impl`): sub-block weights
/// `qw·sqrt(σ² + x²)` with `σ² = 2·mean(x²)`, each sub-block fitted by [`make_qx_quants`]
/// under them, and the sixteen scales by [`make_qx_quants`] again (6 bits, weighted by each
/// sub-block's total weight).
fn quantize_block_q3_k_weighted(x: &[f32; QK_K], qw: &[f32; QK_K]) -> BlockQ3K {
    let mut l = [0u8; QK_K];
    let mut scales = [0f32; QK_K / 16];
    let mut sw = [0f32; QK_K / 16];
    let mut weights = [0f32; 16];
    let mut sum_x2 = 0.0f32;
    for &v in x {
        sum_x2 += v * v;
    }
    let sigma2 = 2.0 * sum_x2 / QK_K as f32;
    for j in 0..QK_K / 16 {
        let xs = &x[16 * j..16 * j + 16];
        for ((w, &q), &v) in weights.iter_mut().zip(&qw[16 * j..16 * j + 16]).zip(xs) {
            *w = q * (sigma2 + v * v).sqrt();
        }
        let mut sumw = 0.0f32;
        for &w in &weights {
            sumw += w;
        }
        sw[j] = sumw;
        scales[j] = make_qx_quants(4, xs, &mut l[16 * j..16 * j + 16], Some(&weights));
    }
    let mut ls = [0u8; 16];
    let d_block = make_qx_quants(32, &scales, &mut ls, Some(&sw));
    finish(x, f16::from_f32(d_block), pack_q3_k_scales(&ls), &mut l)
}

/// GGML's `quantize_row_q3_K_ref` over whole rows (finite values, a multiple of 256).
pub fn quantize_row_q3_k_ref(x: &[f32]) -> Result<Vec<BlockQ3K>> {
    Ok(super_blocks_of(x)?.map(quantize_block_q3_k_ref).collect())
}

/// GGML's `quantize_q3_K` given an importance matrix (`quantize_row_q3_K_impl`).
pub fn quantize_row_q3_k_weighted(x: &[f32], qw: &[f32]) -> Result<Vec<BlockQ3K>> {
    Ok(weighted_row(x, qw)?
        .map(|(x, w)| quantize_block_q3_k_weighted(x, w))
        .collect())
}

/// GGML's `dequantize_row_q3_K`: `(d·sc)·(q − 4)`, in that order of operations.
pub fn dequantize_row_q3_k(blocks: &[BlockQ3K], out: &mut [f32]) {
    assert_eq!(out.len(), blocks.len() * QK_K, "output length mismatch");
    for (b, o) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let d = b.d.to_f32();
        let q = q3_k_codes(b);
        let scales = q3_k_scales(&b.scales);
        for ((o, q), &sc) in o.chunks_exact_mut(16).zip(q.chunks_exact(16)).zip(&scales) {
            let dl = d * f32::from(sc);
            for (o, &q) in o.iter_mut().zip(q) {
                *o = dl * (i32::from(q) - 4) as f32;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::FormatError;

    #[test]
    fn scales_unpack_what_the_quantizers_pack() {
        for first in 0..64u8 {
            let ls: [u8; 16] = std::array::from_fn(|j| (first + 5 * j as u8) % 64);
            let sc = q3_k_scales(&pack_q3_k_scales(&ls));
            for j in 0..16 {
                assert_eq!(i32::from(sc[j]), i32::from(ls[j]) - 32, "scale {j}");
            }
        }
    }

    #[test]
    fn codes_follow_the_layout() {
        let l: [u8; QK_K] = std::array::from_fn(|w| ((w / 3) % 8) as u8);
        let (hmask, qs) = pack_q3_k_codes(&l);
        for (w, &c) in l.iter().enumerate() {
            let (half, k, i) = (w / 128, (w % 128) / 32, w % 32);
            assert_eq!((qs[32 * half + i] >> (2 * k)) & 3, c & 3, "weight {w}");
            assert_eq!((hmask[w % 32] >> (w / 32)) & 1, c >> 2, "weight {w}");
        }
        let b = BlockQ3K {
            hmask,
            qs,
            ..BlockQ3K::zeroed()
        };
        assert_eq!(q3_k_codes(&b), l);
    }

    #[test]
    fn dequantization_is_d_times_scale_times_offset_code() {
        let ls: [u8; 16] = std::array::from_fn(|j| (4 * j) as u8);
        let l: [u8; QK_K] = std::array::from_fn(|w| (w % 8) as u8);
        let (hmask, qs) = pack_q3_k_codes(&l);
        let b = BlockQ3K {
            hmask,
            qs,
            scales: pack_q3_k_scales(&ls),
            d: f16::from_f32(0.25),
        };
        let mut out = [0f32; QK_K];
        dequantize_row_q3_k(&[b], &mut out);
        for (w, &v) in out.iter().enumerate() {
            let sc = (4 * (w / 16)) as f32 - 32.0;
            assert_eq!(v, 0.25 * sc * ((w % 8) as f32 - 4.0), "weight {w}");
        }
    }

    #[test]
    fn zeros_quantize_to_a_zero_block() {
        let zero = BlockQ3K::zeroed();
        assert_eq!(quantize_row_q3_k_ref(&[0.0; QK_K]).unwrap(), [zero]);
        let got = quantize_row_q3_k_weighted(&[0.0; QK_K], &[1.0; QK_K]).unwrap();
        assert_eq!(got, [zero]);
    }

    #[test]
    fn bad_rows_and_importance_are_refused() {
        let mut x = vec![0.5f32; 2 * QK_K];
        let qw = vec![1.0f32; 2 * QK_K];
        assert!(matches!(
            quantize_row_q3_k_ref(&x[..100]),
            Err(FormatError::RowLength { len: 100, .. })
        ));
        assert!(matches!(
            quantize_row_q3_k_weighted(&x, &qw[..QK_K + 1]),
            Err(FormatError::ImportanceLength { .. })
        ));
        let mut bad_qw = qw.clone();
        bad_qw[9] = f32::INFINITY;
        assert!(matches!(
            quantize_row_q3_k_weighted(&x, &bad_qw),
            Err(FormatError::BadImportance { position: 9, .. })
        ));
        x[3] = f32::NEG_INFINITY;
        assert!(matches!(
            quantize_row_q3_k_ref(&x),
            Err(FormatError::NonFinite { position: 3, .. })
        ));
        assert!(matches!(
            quantize_row_q3_k_weighted(&x, &qw),
            Err(FormatError::NonFinite { position: 3, .. })
        ));
    }

    #[test]
    fn reconstruction_is_close_for_a_smooth_ramp() {
        let x: Vec<f32> = (0..QK_K).map(|i| (i as f32 * 0.05).sin()).collect();
        let b = quantize_row_q3_k_ref(&x).unwrap();
        let mut y = vec![0f32; QK_K];
        dequantize_row_q3_k(&b, &mut y);
        let max_err = x
            .iter()
            .zip(&y)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(max_err < 0.2, "max error {max_err}");
    }
}
