//! GGML's Q5_0 and Q5_1 block layouts (32 weights a block) and their dequantizers.
//!
//! Why Kiln stores them: GGML's K-quant mixes (`Q4_K_M`, `Q5_K_M`) fall back to these types for
//! matrices whose rows are not a multiple of 256 weights (SmolLM2's 576, Gemma 3 270M's 640),
//! so a mix file holds them beside its K-quant tensors. Keeping them as they are keeps such a
//! file at its own size.

use bytemuck::{Pod, Zeroable};
use half::f16;

use crate::blocks::QK;

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
