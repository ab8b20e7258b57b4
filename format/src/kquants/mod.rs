//! GGML's K-quant super-block layouts (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K: 256 weights a block, with
//! scales of their own per sub-block) and Q8_K, the activation blocks their dot products take, with the
//! scalar reference dequantizers.
//!
//! Like [`crate::blocks`], these definitions are the specification: the layouts are GGML's byte
//! for byte, so blocks move between `.kiln` and GGUF unchanged, and every faster path (SIMD dot
//! products, quantizers) is tested against the functions here.
//!
//! The quantizers live beside them, re-exported here: `quantize.rs` holds GGML's reference
//! rounding (`llama-quantize --pure`), `weighted.rs` its importance-weighted variants
//! (`--imatrix`, and Kiln's `--calibrate`); Q2_K and Q3_K keep their layouts, rules and
//! dequantizers together in `q2k.rs` and `q3k.rs`.

use bytemuck::{Pod, Zeroable};
use half::f16;

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
pub(super) fn pack_scale_min_k4_bytes(sc: &[u8; 8], m: &[u8; 8]) -> [u8; K_SCALE_SIZE] {
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

mod q2k;
mod q3k;
mod quantize;
mod weighted;

pub use q2k::*;
pub use q3k::*;
pub use quantize::*;
pub use weighted::*;

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
