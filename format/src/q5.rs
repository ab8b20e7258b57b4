//! GGML's Q5_0 and Q5_1 block layouts (32 weights a block) and their dequantizers.
//!
//! Why Kiln stores them: GGML's K-quant mixes (`Q4_K_M`, `Q5_K_M`) fall back to these types for
//! matrices whose rows are not a multiple of 256 weights (SmolLM2's 576, Gemma 3 270M's 640),
//! so a mix file holds them beside its K-quant tensors. Keeping them as they are keeps such a
//! file at its own size.

use bytemuck::{Pod, Zeroable};
use half::f16;

use crate::blocks::QK;
use crate::error::{FormatError, Result};

/// 32 weights as an f16 scale `d`, 32 fifth bits `qh` and 16 bytes of low nibbles `qs`:
/// `w[j] = d · (q[j] − 16)` with `q` in 0..=31 (22 bytes).
///
/// Byte `j` of `qs` holds weight `j`'s low four bits in its low nibble and weight `j + 16`'s in
/// its high nibble; bit `j` of the little-endian `u32` in `qh` is weight `j`'s fifth bit.
#[derive(Debug, Clone, Copy, PartialEq, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ5_0 {
    /// Scale.
    pub d: f16,
    /// Fifth bits, a little-endian `u32`, bit `j` for weight `j`.
    pub qh: [u8; 4],
    /// Low nibbles, the order of [`crate::BlockQ4_0`].
    pub qs: [u8; QK / 2],
}

/// As [`BlockQ5_0`] with an f16 minimum `m`: `w[j] = d · q[j] + m` (24 bytes).
#[derive(Debug, Clone, Copy, PartialEq, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ5_1 {
    /// Scale.
    pub d: f16,
    /// Minimum (the value of code 0).
    pub m: f16,
    /// Fifth bits, as in [`BlockQ5_0`].
    pub qh: [u8; 4],
    /// Low nibbles, as in [`BlockQ5_0`].
    pub qs: [u8; QK / 2],
}

/// The 5-bit codes (0..=31) of one block's 32 weights, in weight order.
#[inline]
pub fn q5_codes(qh: [u8; 4], qs: &[u8; QK / 2]) -> [u8; QK] {
    let qh = u32::from_le_bytes(qh);
    let mut q = [0u8; QK];
    for j in 0..QK / 2 {
        q[j] = (qs[j] & 0x0f) | ((((qh >> j) & 1) as u8) << 4);
        q[j + QK / 2] = (qs[j] >> 4) | ((((qh >> (j + QK / 2)) & 1) as u8) << 4);
    }
    q
}

/// Dequantize Q5_0 blocks into `out` (`out.len() == blocks.len() * 32`), GGML's
/// `dequantize_row_q5_0`.
pub fn dequantize_row_q5_0(blocks: &[BlockQ5_0], out: &mut [f32]) {
    assert_eq!(out.len(), blocks.len() * QK, "output length mismatch");
    for (b, o) in blocks.iter().zip(out.chunks_exact_mut(QK)) {
        let d = b.d.to_f32();
        for (o, q) in o.iter_mut().zip(q5_codes(b.qh, &b.qs)) {
            *o = (i32::from(q) - 16) as f32 * d;
        }
    }
}

/// Dequantize Q5_1 blocks into `out` (`out.len() == blocks.len() * 32`), GGML's
/// `dequantize_row_q5_1`.
pub fn dequantize_row_q5_1(blocks: &[BlockQ5_1], out: &mut [f32]) {
    assert_eq!(out.len(), blocks.len() * QK, "output length mismatch");
    for (b, o) in blocks.iter().zip(out.chunks_exact_mut(QK)) {
        let (d, m) = (b.d.to_f32(), b.m.to_f32());
        for (o, q) in o.iter_mut().zip(q5_codes(b.qh, &b.qs)) {
            *o = f32::from(q) * d + m;
        }
    }
}

/// Pack 32 codes in 0..=31 into a Q5 block's `qh` and `qs` (the inverse of [`q5_codes`]).
#[inline]
pub fn pack_q5_codes(q: &[u8; QK]) -> ([u8; 4], [u8; QK / 2]) {
    let mut qs = [0u8; QK / 2];
    let mut qh = 0u32;
    for j in 0..QK / 2 {
        let (lo, hi) = (q[j], q[j + QK / 2]);
        qs[j] = (lo & 0x0f) | ((hi & 0x0f) << 4);
        qh |= u32::from(lo >> 4) << j;
        qh |= u32::from(hi >> 4) << (j + QK / 2);
    }
    (qh.to_le_bytes(), qs)
}

/// Quantize one block to Q5_0 with GGML's reference rule (`quantize_row_q5_0_ref`): the signed
/// value of largest magnitude (the first one, on ties) divided by −16 is the scale, so it maps
/// to code 0 (−16) and the opposite side clips at code 31 (+15); codes are `x·(1/d) + 16.5`
/// truncated.
pub fn quantize_block_q5_0_ref(x: &[f32; QK]) -> BlockQ5_0 {
    let mut amax = 0.0f32;
    let mut max = 0.0f32;
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    let d = max / -16.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let mut q = [0u8; QK];
    for (q, &v) in q.iter_mut().zip(x) {
        // The operand is in [0.5, 32.5] for every block whose scale has a finite reciprocal;
        // the clamp only keeps the others (largest magnitude below ~5e-38, undefined in C)
        // inside five bits.
        *q = ((v * id + 16.5) as i8).clamp(0, 31) as u8;
    }
    let (qh, qs) = pack_q5_codes(&q);
    BlockQ5_0 {
        d: f16::from_f32(d),
        qh,
        qs,
    }
}

/// Quantize one block to Q5_1 with GGML's reference rule (`quantize_row_q5_1_ref`):
/// `m = min`, `d = (max − min) / 31`, codes `(x − min)·(1/d) + 0.5` truncated.
pub fn quantize_block_q5_1_ref(x: &[f32; QK]) -> BlockQ5_1 {
    let mut min = f32::MAX;
    let mut max = -f32::MAX;
    for &v in x {
        if v < min {
            min = v;
        }
        if v > max {
            max = v;
        }
    }
    let d = (max - min) / 31.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let mut q = [0u8; QK];
    for (q, &v) in q.iter_mut().zip(x) {
        // In [0.5, 31.5] whenever 1/d is finite; the clamp as in Q5_0.
        *q = (((v - min) * id + 0.5) as i32).clamp(0, 31) as u8;
    }
    let (qh, qs) = pack_q5_codes(&q);
    BlockQ5_1 {
        d: f16::from_f32(d),
        m: f16::from_f32(min),
        qh,
        qs,
    }
}

fn q5_blocks_of(x: &[f32]) -> Result<impl Iterator<Item = &[f32; QK]>> {
    crate::blocks::check_finite(x)?;
    if !x.len().is_multiple_of(QK) {
        return Err(FormatError::RowLength {
            len: x.len(),
            block: QK,
        });
    }
    Ok(x.chunks_exact(QK)
        .map(|c| c.try_into().expect("chunks_exact yields QK elements")))
}

/// Quantize a row (length a multiple of 32) to Q5_0 with the reference rule.
///
/// Rejects NaN/Inf and lengths that are not a multiple of 32.
pub fn quantize_row_q5_0_ref(x: &[f32]) -> Result<Vec<BlockQ5_0>> {
    Ok(q5_blocks_of(x)?.map(quantize_block_q5_0_ref).collect())
}

/// Quantize a row (length a multiple of 32) to Q5_1 with the reference rule.
pub fn quantize_row_q5_1_ref(x: &[f32]) -> Result<Vec<BlockQ5_1>> {
    Ok(q5_blocks_of(x)?.map(quantize_block_q5_1_ref).collect())
}

/// `σ²` of GGML's weighted Q5 quantizers: the mean square of the whole row.
fn row_sigma2(x: &[f32]) -> f32 {
    let mut sum_x2 = 0.0f32;
    for &v in x {
        sum_x2 += v * v;
    }
    sum_x2 / x.len() as f32
}

/// Quantize a row to Q5_0 with one importance weight per value, as GGML's `quantize_q5_0` does
/// with an importance matrix (`quantize_row_q5_0_impl`): each block fitted by GGML's
/// `make_qx_quants` (symmetric, 19 candidate scales) under weights `qw·sqrt(σ² + x²)`, `σ²`
/// the row's mean square; the codes are the fit's (not recomputed from the f16 scale).
///
/// Rejects NaN/Inf, rows that are not a multiple of 32, and importance of another length or
/// with negative or non-finite values.
pub fn quantize_row_q5_0_weighted(x: &[f32], qw: &[f32]) -> Result<Vec<BlockQ5_0>> {
    let blocks = q5_blocks_of(x)?;
    crate::kquants::check_importance(qw, x.len())?;
    let sigma2 = row_sigma2(x);
    Ok(blocks
        .zip(qw.chunks_exact(QK))
        .map(|(xb, qb)| {
            let mut w = [0f32; QK];
            for ((w, &q), &v) in w.iter_mut().zip(qb).zip(xb) {
                *w = q * (sigma2 + v * v).sqrt();
            }
            let mut q = [0u8; QK];
            let d = crate::kquants::make_qx_quants(16, xb, &mut q, Some(&w));
            let (qh, qs) = pack_q5_codes(&q);
            BlockQ5_0 {
                d: f16::from_f32(d),
                qh,
                qs,
            }
        })
        .collect())
}

/// Quantize a row to Q5_1 with importance, as GGML's `quantize_q5_1` does with an importance
/// matrix (`quantize_row_q5_1_impl`): each block fitted with an affine `d·l + m` by GGML's
/// `make_qkx3_quants` (37 candidate scales) under weights `qw·sqrt(σ² + x²)`; codes as fitted.
pub fn quantize_row_q5_1_weighted(x: &[f32], qw: &[f32]) -> Result<Vec<BlockQ5_1>> {
    let blocks = q5_blocks_of(x)?;
    crate::kquants::check_importance(qw, x.len())?;
    let sigma2 = row_sigma2(x);
    Ok(blocks
        .zip(qw.chunks_exact(QK))
        .map(|(xb, qb)| {
            let mut w = [0f32; QK];
            for ((w, &q), &v) in w.iter_mut().zip(qb).zip(xb) {
                *w = q * (sigma2 + v * v).sqrt();
            }
            let mut q = [0u8; QK];
            let (d, min) = crate::kquants::make_qkx2_quants(31, xb, &w, &mut q, -0.9, 0.05, 36);
            let (qh, qs) = pack_q5_codes(&q);
            BlockQ5_1 {
                d: f16::from_f32(d),
                m: f16::from_f32(-min),
                qh,
                qs,
            }
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_are_ggml_sizes() {
        assert_eq!(std::mem::size_of::<BlockQ5_0>(), 22);
        assert_eq!(std::mem::size_of::<BlockQ5_1>(), 24);
    }

    #[test]
    fn fifth_bits_and_nibbles_land_on_their_weights() {
        // Weight j gets code j (0..=31): low nibble j & 15, fifth bit j >> 4.
        let mut qs = [0u8; 16];
        let mut qh = 0u32;
        for j in 0..32u32 {
            let lo = (j & 15) as u8;
            if j < 16 {
                qs[j as usize] |= lo;
            } else {
                qs[j as usize - 16] |= lo << 4;
            }
            qh |= (j >> 4) << j;
        }
        let b = BlockQ5_0 {
            d: f16::from_f32(0.5),
            qh: qh.to_le_bytes(),
            qs,
        };
        let mut out = [0f32; 32];
        dequantize_row_q5_0(&[b], &mut out);
        for (j, &v) in out.iter().enumerate() {
            assert_eq!(v, (j as f32 - 16.0) * 0.5, "weight {j}");
        }
        let b1 = BlockQ5_1 {
            d: f16::from_f32(0.25),
            m: f16::from_f32(-1.0),
            qh: b.qh,
            qs,
        };
        dequantize_row_q5_1(&[b1], &mut out);
        for (j, &v) in out.iter().enumerate() {
            assert_eq!(v, j as f32 * 0.25 - 1.0, "weight {j}");
        }
    }
}
