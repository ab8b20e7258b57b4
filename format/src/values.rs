//! Tensor values: element conversions between the plain float dtypes, decoding whole rows of
//! any dtype to f32, and finding non-finite values.
//!
//! All narrowing conversions round to nearest, ties to even (IEEE 754's default, and what
//! PyTorch's `.to(torch.float16/bfloat16)` does), so a Kiln cast equals the reference cast.

use half::{bf16, f16};

#[cfg(test)]
use crate::blocks::{GROUP_ROWS, QK};
use crate::dtype::DType;

/// Decode little-endian elements of a float dtype into f32. `bytes.len()` must equal
/// `out.len() * dtype.block_bytes()`; quantized dtypes are not accepted here.
pub fn decode_to_f32(dtype: DType, bytes: &[u8], out: &mut [f32]) {
    assert!(
        !dtype.is_quantized(),
        "decode_to_f32 takes plain float dtypes"
    );
    assert_eq!(
        bytes.len(),
        out.len() * dtype.block_bytes(),
        "length mismatch"
    );
    dtype.block().dequantize(bytes, out.len(), out);
}

/// Decode whole rows of `cols` values of any dtype into f32, in logical row-major order:
/// floats element by element, blocks by GGML's rule, `q4_0x16` and `iq4_nlx16` de-interleaved
/// first (each type's [`crate::BlockType::dequantize_rows`], through its row of the table).
/// `bytes` must hold whole rows (whole sixteen-row groups for the interleaved layouts) and `out.len()` their values. The one per-dtype decoder every program's copies and reports use;
/// `bytes` need not be aligned (blocks are copied into aligned storage).
pub fn decode_rows_f32(dtype: DType, cols: usize, bytes: &[u8], out: &mut [f32]) {
    dtype.block().dequantize(bytes, cols, out)
}

/// Encode f32 values as little-endian elements of a plain float dtype, appending to `out`.
pub fn encode_from_f32(dtype: DType, x: &[f32], out: &mut Vec<u8>) {
    assert!(
        !dtype.is_quantized(),
        "encode_from_f32 takes plain float dtypes"
    );
    out.reserve(x.len() * dtype.block_bytes());
    match dtype {
        DType::F32 => x
            .iter()
            .for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
        DType::F16 => x
            .iter()
            .for_each(|v| out.extend_from_slice(&f16::from_f32(*v).to_le_bytes())),
        DType::BF16 => x
            .iter()
            .for_each(|v| out.extend_from_slice(&bf16::from_f32(*v).to_le_bytes())),
        _ => unreachable!("checked above"),
    }
}

/// Convert `bytes` of plain float dtype `from` to dtype `to`, appending to `out`.
/// Equal dtypes copy the bytes unchanged.
///
/// Works in chunks through an f32 buffer with slice conversions, which `half` vectorizes
/// (F16C where the CPU has it): the cast must not be what limits a conversion.
pub fn cast_bytes(from: DType, to: DType, bytes: &[u8], out: &mut Vec<u8>) {
    assert!(
        !from.is_quantized() && !to.is_quantized(),
        "cast_bytes takes plain float dtypes"
    );
    if from == to {
        out.extend_from_slice(bytes);
        return;
    }
    use half::slice::HalfFloatSliceExt;
    const CHUNK: usize = 16 * 1024;
    let n = bytes.len() / from.block_bytes();
    let mut wide = vec![0f32; CHUNK.min(n)];
    let mut narrow16 = vec![0u16; CHUNK.min(n)];
    out.reserve(n * to.block_bytes());
    for chunk in bytes.chunks(CHUNK * from.block_bytes()) {
        let m = chunk.len() / from.block_bytes();
        let w = &mut wide[..m];
        decode_to_f32(from, chunk, w);
        match to {
            DType::F32 => out.extend_from_slice(bytemuck::cast_slice(w)),
            DType::F16 => {
                let h: &mut [f16] = bytemuck::cast_slice_mut(&mut narrow16[..m]);
                h.convert_from_f32_slice(w);
                out.extend_from_slice(bytemuck::cast_slice(h));
            }
            DType::BF16 => {
                let h: &mut [bf16] = bytemuck::cast_slice_mut(&mut narrow16[..m]);
                h.convert_from_f32_slice(w);
                out.extend_from_slice(bytemuck::cast_slice(h));
            }
            _ => unreachable!("checked above"),
        }
    }
}

/// Non-finite values (NaN, ±infinity) in `bytes` of `dtype`: how many, and the element index
/// of the first (`None` when there is none).
///
/// Conversion runs this on every source chunk, so a checkpoint holding NaN or infinity is
/// refused at conversion rather than producing a model that stops after one token; `inspect
/// --verify` runs it over a whole file. A float is non-finite when its exponent bits are all
/// ones. A block type's values are `d * q`: a block whose f16 scale `d` is non-finite makes
/// all of its values non-finite (`0 * inf` is NaN), so such a block counts as all of its
/// values (e.g. [`QK`](crate::QK)), indexed from its first. For `q4_0x16` and `iq4_nlx16`, whose
/// sixteen rows are interleaved, the index is in storage order (group, then row within the group). Where
/// each type keeps its scales is its row of the block-type table ([`crate::BlockType::SCALES`]).
pub fn count_non_finite(dtype: DType, bytes: &[u8]) -> (usize, Option<usize>) {
    dtype.block().count_non_finite(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn non_finite_values_are_found_in_every_float_dtype() {
        let f32s: Vec<u8> = [1.0f32, f32::NAN, 2.0, f32::INFINITY, f32::MAX, -0.0]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        assert_eq!(count_non_finite(DType::F32, &f32s), (2, Some(1)));
        let f16s: Vec<u8> = [half::f16::ONE, half::f16::MAX, half::f16::NEG_INFINITY]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        assert_eq!(count_non_finite(DType::F16, &f16s), (1, Some(2)));
        let bf16s: Vec<u8> = [half::bf16::NAN, half::bf16::MAX]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        assert_eq!(count_non_finite(DType::BF16, &bf16s), (1, Some(0)));
        assert_eq!(count_non_finite(DType::Q8_0, &[0; 34]), (0, None));
    }

    #[test]
    fn a_block_whose_scale_is_not_finite_counts_all_its_values() {
        let mut q8 = vec![0u8; 3 * 34];
        q8[34..36].copy_from_slice(&half::f16::INFINITY.to_le_bytes());
        assert_eq!(count_non_finite(DType::Q8_0, &q8), (QK, Some(QK)));
        let mut q4 = vec![0u8; 2 * 18];
        q4[18..20].copy_from_slice(&half::f16::NAN.to_le_bytes());
        assert_eq!(count_non_finite(DType::Q4_0, &q4), (QK, Some(QK)));
        // Second group, fourth row's scale.
        let mut x16 = vec![0u8; 2 * GROUP_ROWS * 18];
        let at = GROUP_ROWS * 18 + 3 * 2;
        x16[at..at + 2].copy_from_slice(&half::f16::NEG_INFINITY.to_le_bytes());
        assert_eq!(
            count_non_finite(DType::Q4_0x16, &x16),
            (QK, Some(GROUP_ROWS * QK + 3 * QK))
        );
    }
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn bf16_to_f32_and_back_is_lossless(bits in any::<u16>()) {
            let v = bf16::from_bits(bits);
            prop_assume!(!v.is_nan());
            let mut out = Vec::new();
            cast_bytes(DType::F32, DType::BF16, &v.to_f32().to_le_bytes(), &mut out);
            prop_assert_eq!(out, bits.to_le_bytes().to_vec());
        }

        #[test]
        fn f16_casts_match_half(x in -7.0e4f32..7.0e4) {
            let mut out = Vec::new();
            cast_bytes(DType::F32, DType::F16, &x.to_le_bytes(), &mut out);
            prop_assert_eq!(out, f16::from_f32(x).to_le_bytes().to_vec());
        }
    }

    #[test]
    fn ties_round_to_even() {
        // 1 + 2^-8 lies exactly between two bf16 values; even mantissa wins (1.0).
        let x = 1.0f32 + 1.0 / 256.0;
        let mut out = Vec::new();
        encode_from_f32(DType::BF16, &[x], &mut out);
        assert_eq!(bf16::from_le_bytes([out[0], out[1]]).to_f32(), 1.0);
    }
}
