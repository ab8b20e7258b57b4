//! GGML's Q8_0 and Q4_0 block layouts and their scalar reference quantize/dequantize, and
//! Kiln's sixteen-row interleaving of Q4_0 blocks ([`BlockQ4_0x16`]).
//!
//! These functions are the specification: every faster path in Kiln (SIMD kernels, scale
//! searches that keep the layout) is tested against them, and they reproduce GGML's
//! `quantize_row_q8_0_ref` / `quantize_row_q4_0_ref` bit for bit so that blocks can move between
//! `.kiln` and GGUF unchanged and checksums reproduce on every machine.

use bytemuck::{Pod, Zeroable};
use half::f16;

use crate::error::{FormatError, Result};

/// Weights per block for Q8_0 and Q4_0.
pub const QK: usize = 32;

/// 32 weights as an f16 scale `d` and 32 signed 8-bit codes: `w[j] = d * qs[j]`.
#[derive(Debug, Clone, Copy, PartialEq, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ8_0 {
    /// Scale.
    pub d: f16,
    /// Codes, weight `j` in `qs[j]`.
    pub qs: [i8; QK],
}

/// 32 weights as an f16 scale `d` and 16 bytes of 4-bit codes: `w[j] = d * (q[j] - 8)`.
///
/// Byte `j` holds weight `j` in its low nibble and weight `j + 16` in its high nibble; each
/// nibble stores `q + 8` so that it is unsigned (0..=15).
#[derive(Debug, Clone, Copy, PartialEq, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ4_0 {
    /// Scale.
    pub d: f16,
    /// Packed nibbles, see the type's documentation for the order.
    pub qs: [u8; QK / 2],
}

/// Rows per [`BlockQ4_0x16`] group.
pub const GROUP_ROWS: usize = 16;

/// Block `b` of sixteen consecutive rows of a Q4_0 matrix, interleaved (288 bytes, the size of
/// the sixteen blocks it holds).
///
/// Why: a one-token matrix–vector product over plain Q4_0 rows takes one block of one row at a
/// time, so every block pays for spreading its nibbles into the activation's order and for a
/// scale conversion, a multiply and an add of its own. Here a 32-bit lane is a row instead:
/// the sixteen scales convert in one instruction, and bytes `64i..64i + 64` of `qs` hold
/// bytes `4i..4i + 4` of each row's `qs` (row `r` at `64i + 4r`), so one load and a mask
/// gives four consecutive codes of every row, which meet the same four activation codes
/// (broadcast) in one `vpdpbusd`. The codes themselves are GGML's, byte for byte.
#[derive(Debug, Clone, Copy, PartialEq, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ4_0x16 {
    /// Row `r`'s scale.
    pub d: [f16; GROUP_ROWS],
    /// The rows' packed nibbles, interleaved four bytes at a time (see the type's documentation).
    pub qs: [u8; GROUP_ROWS * QK / 2],
}

impl BlockQ4_0x16 {
    /// Interleave one block of each of sixteen rows.
    pub fn from_rows(rows: &[BlockQ4_0; GROUP_ROWS]) -> BlockQ4_0x16 {
        BlockQ4_0x16 {
            d: std::array::from_fn(|r| rows[r].d),
            qs: interleave_nibbles(&std::array::from_fn(|r| rows[r].qs)),
        }
    }

    /// Row `r`'s block.
    #[inline]
    pub fn row(&self, r: usize) -> BlockQ4_0 {
        BlockQ4_0 {
            d: self.d[r],
            qs: row_nibbles(&self.qs, r),
        }
    }
}

/// Sixteen rows' sixteen bytes of nibbles in the interleaved order: bytes `64i..64i + 64` hold
/// bytes `4i..4i + 4` of each row (row `r` at `64i + 4r`). Every sixteen-row layout keeps a
/// 32-weight block's nibbles this way.
pub(crate) fn interleave_nibbles(rows: &[[u8; QK / 2]; GROUP_ROWS]) -> [u8; GROUP_ROWS * QK / 2] {
    let mut qs = [0u8; GROUP_ROWS * QK / 2];
    for (r, row) in rows.iter().enumerate() {
        for i in 0..QK / 8 {
            qs[64 * i + 4 * r..64 * i + 4 * r + 4].copy_from_slice(&row[4 * i..4 * i + 4]);
        }
    }
    qs
}

/// Row `r`'s sixteen bytes of [`interleave_nibbles`]'s order.
#[inline]
pub(crate) fn row_nibbles(qs: &[u8; GROUP_ROWS * QK / 2], r: usize) -> [u8; QK / 2] {
    let mut row = [0u8; QK / 2];
    for i in 0..QK / 8 {
        row[4 * i..4 * i + 4].copy_from_slice(&qs[64 * i + 4 * r..64 * i + 4 * r + 4]);
    }
    row
}

/// Interleave a row-major Q4_0 matrix of `blocks.len() / nb` rows (a multiple of 16) and `nb`
/// blocks per row: group `g·nb + b` is block `b` of rows `16g..16g + 16`.
pub fn interleave_q4_0(blocks: &[BlockQ4_0], nb: usize) -> Vec<BlockQ4_0x16> {
    interleave_groups(blocks, nb, BlockQ4_0x16::from_rows)
}

/// The row-major Q4_0 blocks of an interleaved matrix with `nb` blocks per row (the inverse of
/// [`interleave_q4_0`]).
pub fn deinterleave_q4_0x16(groups: &[BlockQ4_0x16], nb: usize) -> Vec<BlockQ4_0> {
    deinterleave_groups(groups, nb, BlockQ4_0x16::row)
}

/// The order every sixteen-row layout shares: a row-major matrix of `blocks.len() / nb` rows
/// (a multiple of 16) and `nb` blocks per row becomes groups, group `g·nb + b` made by `group`
/// from block `b` of rows `16g..16g + 16`.
pub(crate) fn interleave_groups<B: Copy, G>(
    blocks: &[B],
    nb: usize,
    group: impl Fn(&[B; GROUP_ROWS]) -> G,
) -> Vec<G> {
    assert!(
        nb > 0 && blocks.len().is_multiple_of(GROUP_ROWS * nb),
        "whole row groups"
    );
    let mut out = Vec::with_capacity(blocks.len() / GROUP_ROWS);
    for rows in blocks.chunks_exact(GROUP_ROWS * nb) {
        for b in 0..nb {
            out.push(group(&std::array::from_fn(|r| rows[r * nb + b])));
        }
    }
    out
}

/// The inverse of [`interleave_groups`]: `row(g, r)` is row `r`'s block of group `g`.
pub(crate) fn deinterleave_groups<B: Copy + Zeroable, G>(
    groups: &[G],
    nb: usize,
    row: impl Fn(&G, usize) -> B,
) -> Vec<B> {
    assert!(
        nb > 0 && groups.len().is_multiple_of(nb),
        "whole row groups"
    );
    let mut out = vec![B::zeroed(); groups.len() * GROUP_ROWS];
    for (c, chunk) in groups.chunks_exact(nb).enumerate() {
        let rows = &mut out[c * GROUP_ROWS * nb..(c + 1) * GROUP_ROWS * nb];
        for (b, g) in chunk.iter().enumerate() {
            for (r, row_blocks) in rows.chunks_exact_mut(nb).enumerate() {
                row_blocks[b] = row(g, r);
            }
        }
    }
    out
}

/// [`interleave_q4_0`] on bytes (little-endian blocks as stored), appending to `out`: what a
/// writer does to Q4_0 rows it produced as plain blocks.
pub fn interleave_q4_0_bytes(bytes: &[u8], nb: usize, out: &mut Vec<u8>) {
    let blocks: Vec<BlockQ4_0> = bytemuck::pod_collect_to_vec(bytes);
    out.extend_from_slice(bytemuck::cast_slice(&interleave_q4_0(&blocks, nb)));
}

const _: () = assert!(std::mem::size_of::<BlockQ8_0>() == 34);
const _: () = assert!(std::mem::size_of::<BlockQ4_0>() == 18);
const _: () = assert!(std::mem::size_of::<BlockQ4_0x16>() == GROUP_ROWS * 18);
const _: () = assert!(std::mem::align_of::<BlockQ4_0x16>() == 2);
const _: () = assert!(std::mem::align_of::<BlockQ8_0>() == 2);
const _: () = assert!(std::mem::align_of::<BlockQ4_0>() == 2);

impl BlockQ4_0 {
    /// The signed code (-8..=7) of weight `j`.
    #[inline]
    pub fn code(&self, j: usize) -> i8 {
        let byte = self.qs[j % (QK / 2)];
        let nibble = if j < QK / 2 { byte & 0x0f } else { byte >> 4 };
        nibble as i8 - 8
    }
}

/// Fails on the first NaN or infinity so that no quantizer ever writes one silently.
pub fn check_finite(x: &[f32]) -> Result<()> {
    match x.iter().position(|v| !v.is_finite()) {
        Some(position) => Err(FormatError::NonFinite {
            position,
            value: x[position],
        }),
        None => Ok(()),
    }
}

/// Quantize one block to Q8_0 with GGML's reference rule: `d = max|x| / 127`,
/// `q = round(x / d)` (half away from zero, computed as `x * (1/d)` exactly as GGML does).
pub fn quantize_block_q8_0_ref(x: &[f32; QK]) -> BlockQ8_0 {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let mut qs = [0i8; QK];
    for (q, &v) in qs.iter_mut().zip(x) {
        *q = (v * id).round() as i8;
    }
    BlockQ8_0 {
        d: f16::from_f32(d),
        qs,
    }
}

/// Quantize one block to Q4_0 with GGML's reference rule: the scale is the signed value of
/// largest magnitude divided by -8, so that value maps exactly to code -8 and the opposite
/// side clips at +7.
pub fn quantize_block_q4_0_ref(x: &[f32; QK]) -> BlockQ4_0 {
    let mut amax = 0.0f32;
    let mut max = 0.0f32;
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    let d = max / -8.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let mut qs = [0u8; QK / 2];
    for (j, q) in qs.iter_mut().enumerate() {
        // GGML truncates toward zero after adding 8.5; the operand is in [0.5, 16.5] for
        // every finite block except those whose scale's reciprocal overflows (largest
        // magnitude below ~2.4e-38), where clamping keeps each code inside its nibble.
        let lo = ((x[j] * id + 8.5) as i8).clamp(0, 15) as u8;
        let hi = ((x[j + QK / 2] * id + 8.5) as i8).clamp(0, 15) as u8;
        *q = lo | (hi << 4);
    }
    BlockQ4_0 {
        d: f16::from_f32(d),
        qs,
    }
}

/// Dequantize one Q8_0 block.
pub fn dequantize_block_q8_0(b: &BlockQ8_0, out: &mut [f32; QK]) {
    let d = b.d.to_f32();
    for (o, &q) in out.iter_mut().zip(&b.qs) {
        *o = q as f32 * d;
    }
}

/// Dequantize one Q4_0 block.
pub fn dequantize_block_q4_0(b: &BlockQ4_0, out: &mut [f32; QK]) {
    let d = b.d.to_f32();
    for (j, &byte) in b.qs.iter().enumerate() {
        out[j] = ((byte & 0x0f) as i32 - 8) as f32 * d;
        out[j + QK / 2] = ((byte >> 4) as i32 - 8) as f32 * d;
    }
}

fn blocks_of(x: &[f32]) -> impl Iterator<Item = &[f32; QK]> {
    x.chunks_exact(QK)
        .map(|c| c.try_into().expect("chunks_exact yields QK elements"))
}

/// Quantize a row (length a multiple of 32) to Q8_0 with the reference rule.
///
/// Rejects NaN/Inf and lengths that are not a multiple of 32.
pub fn quantize_row_q8_0_ref(x: &[f32]) -> Result<Vec<BlockQ8_0>> {
    check_row(x)?;
    Ok(blocks_of(x).map(quantize_block_q8_0_ref).collect())
}

/// Quantize a row (length a multiple of 32) to Q4_0 with the reference rule.
pub fn quantize_row_q4_0_ref(x: &[f32]) -> Result<Vec<BlockQ4_0>> {
    check_row(x)?;
    Ok(blocks_of(x).map(quantize_block_q4_0_ref).collect())
}

fn check_row(x: &[f32]) -> Result<()> {
    check_finite(x)?;
    if !x.len().is_multiple_of(QK) {
        return Err(FormatError::RowLength {
            len: x.len(),
            block: QK,
        });
    }
    Ok(())
}

/// Dequantize Q8_0 blocks into `out` (`out.len() == blocks.len() * 32`).
pub fn dequantize_row_q8_0(blocks: &[BlockQ8_0], out: &mut [f32]) {
    assert_eq!(out.len(), blocks.len() * QK, "output length mismatch");
    for (b, o) in blocks.iter().zip(out.chunks_exact_mut(QK)) {
        dequantize_block_q8_0(b, o.try_into().expect("QK chunk"));
    }
}

/// Dequantize Q4_0 blocks into `out` (`out.len() == blocks.len() * 32`).
pub fn dequantize_row_q4_0(blocks: &[BlockQ4_0], out: &mut [f32]) {
    assert_eq!(out.len(), blocks.len() * QK, "output length mismatch");
    for (b, o) in blocks.iter().zip(out.chunks_exact_mut(QK)) {
        dequantize_block_q4_0(b, o.try_into().expect("QK chunk"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn block(v: Vec<f32>) -> [f32; QK] {
        v.try_into().unwrap()
    }

    #[test]
    fn interleaved_rows_hold_each_rows_codes_in_lane_order() {
        // Row r, block b: scale r + 16b, byte j = 16r + j (so every byte is distinct per row).
        let nb = 3;
        let blocks: Vec<BlockQ4_0> = (0..32 * nb)
            .map(|i| {
                let (r, b) = (i / nb, i % nb);
                BlockQ4_0 {
                    d: f16::from_f32((r + 16 * b) as f32),
                    qs: std::array::from_fn(|j| (16 * (r % 16) + j) as u8 ^ (b as u8)),
                }
            })
            .collect();
        let g = interleave_q4_0(&blocks, nb);
        assert_eq!(g.len(), 2 * nb);
        // Group 1 of the second row group is block 1 of rows 16..32.
        let x = &g[nb + 1];
        for r in 0..16 {
            let src = &blocks[(16 + r) * nb + 1];
            assert_eq!(x.d[r], src.d);
            for i in 0..4 {
                assert_eq!(
                    x.qs[64 * i + 4 * r..64 * i + 4 * r + 4],
                    src.qs[4 * i..4 * i + 4]
                );
            }
            assert_eq!(x.row(r), *src);
        }
        assert_eq!(deinterleave_q4_0x16(&g, nb), blocks);
        let mut bytes = Vec::new();
        interleave_q4_0_bytes(bytemuck::cast_slice(&blocks), nb, &mut bytes);
        assert_eq!(bytes, bytemuck::cast_slice::<BlockQ4_0x16, u8>(&g));
    }

    #[test]
    fn all_zero_blocks_have_zero_scale() {
        let z = [0.0f32; QK];
        let q8 = quantize_block_q8_0_ref(&z);
        assert_eq!(q8.d.to_f32(), 0.0);
        assert!(q8.qs.iter().all(|&q| q == 0));
        let q4 = quantize_block_q4_0_ref(&z);
        assert_eq!(q4.d.to_f32(), 0.0);
        // Code 0 is stored as nibble 8.
        assert!(q4.qs.iter().all(|&b| b == 0x88));
    }

    #[test]
    fn q4_0_nibble_order_is_ggml() {
        // Weight j = -8 * (j == 0) dominates: scale 1, weight 0 -> code -8 (nibble 0).
        let mut x = [0.0f32; QK];
        x[0] = -8.0;
        x[16] = 7.0;
        x[1] = 3.0;
        let b = quantize_block_q4_0_ref(&x);
        assert_eq!(b.d.to_f32(), 1.0);
        assert_eq!(b.qs[0], 15 << 4); // low nibble: -8+8 = 0, high nibble: 7+8 = 15
        assert_eq!(b.qs[1] & 0x0f, 11);
        assert_eq!(b.code(0), -8);
        assert_eq!(b.code(16), 7);
        assert_eq!(b.code(1), 3);
    }

    /// Regression: a block of tiny values made 1/d overflow and a negative code spill into
    /// the neighbouring nibble.
    #[test]
    fn q4_0_tiny_block_codes_stay_in_their_nibbles() {
        let mut x = [0.0f32; QK];
        x[0] = 1e-39;
        x[1] = -1e-39;
        x[17] = -5e-40;
        let b = quantize_block_q4_0_ref(&x);
        for j in 0..QK {
            assert!((-8..=7).contains(&b.code(j)));
        }
        let mut out = [1.0f32; QK];
        dequantize_block_q4_0(&b, &mut out);
        assert!(out.iter().all(|v| v.abs() < 1e-30));
    }

    #[test]
    fn non_finite_is_rejected_with_position() {
        let mut x = vec![0.5f32; 64];
        x[37] = f32::NAN;
        match quantize_row_q8_0_ref(&x) {
            Err(FormatError::NonFinite { position, .. }) => assert_eq!(position, 37),
            other => panic!("expected NonFinite, got {other:?}"),
        }
        x[37] = f32::INFINITY;
        assert!(quantize_row_q4_0_ref(&x).is_err());
    }

    /// Representable values: integer codes times a power-of-two scale survive exactly.
    #[test]
    fn exactly_representable_values_round_trip() {
        let x = block((0..32).map(|i| ((i % 15) as f32 - 7.0) * 0.25).collect());
        let mut x4 = x;
        x4[5] = -8.0 * 0.25; // make -8 the extreme so the scale is exactly 0.25
        let mut out = [0.0; QK];
        dequantize_block_q4_0(&quantize_block_q4_0_ref(&x4), &mut out);
        assert_eq!(out, x4);
        let x8 = block((0..32).map(|i| (i * 8 - 127) as f32 / 8.0).collect());
        let b = quantize_block_q8_0_ref(&x8);
        dequantize_block_q8_0(&b, &mut out);
        // max is 127/8 -> d = 1/8 exactly; codes are integers.
        for (a, e) in out.iter().zip(&x8) {
            assert_eq!(a, e);
        }
    }

    fn finite_block() -> impl Strategy<Value = Vec<f32>> {
        prop::collection::vec(-1.0e3f32..1.0e3, QK)
    }

    proptest! {
        /// |x - deq| <= d/2 (+ the f16 rounding of the scale, bounded by 2^-11 relative per code).
        #[test]
        fn q8_0_error_within_half_step(v in finite_block()) {
            let x = block(v);
            let b = quantize_block_q8_0_ref(&x);
            let mut out = [0.0; QK];
            dequantize_block_q8_0(&b, &mut out);
            let d = b.d.to_f32();
            for j in 0..QK {
                let bound = 0.5 * d + 127.0 * d * (1.0 / 2048.0) + 1e-6;
                prop_assert!((x[j] - out[j]).abs() <= bound, "j={} x={} out={} d={}", j, x[j], out[j], d);
            }
        }

        /// Half a step, or one step for values clipped at +7 opposite the extreme.
        #[test]
        fn q4_0_error_within_bound(v in finite_block()) {
            let x = block(v);
            let b = quantize_block_q4_0_ref(&x);
            let mut out = [0.0; QK];
            dequantize_block_q4_0(&b, &mut out);
            let d = b.d.to_f32().abs();
            for j in 0..QK {
                let clipped = b.code(j) == 7;
                let step = if clipped { 1.0 } else { 0.5 };
                let bound = step * d + 8.0 * d * (1.0 / 2048.0) + 1e-6;
                prop_assert!((x[j] - out[j]).abs() <= bound, "j={} x={} out={} d={}", j, x[j], out[j], d);
            }
        }
    }
}
