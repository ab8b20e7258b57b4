//! Converting rows of f32 values to an output dtype, with the error statistics of the round
//! trip computed in the same pass.
//!
//! [`convert_rows`] is the one entry point the file pipeline uses for every tensor that is not
//! copied: it rejects NaN/Inf (and values that overflow f16) with their position, encodes or
//! quantizes, and accumulates [`ErrorStats`] of `x` against what a reader will decode.

use half::{bf16, f16};
use kiln_format::blocks::GROUP_ROWS;
use kiln_format::{BlockKind, DType};
use kiln_kernels::ErrorStats;

use crate::method::{Method, Rule};

/// Why a run of values could not be converted; positions are relative to the run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ValueError {
    /// NaN or infinity at this element.
    NonFinite { position: usize, value: f32 },
    /// A finite value that becomes infinity in f16.
    F16Overflow { position: usize, value: f32 },
    /// A block whose f16 scale (or minimum) overflows (largest magnitude above ~8.3e6 for Q8_0,
    /// ~5.2e5 for Q4_0, ~1.0e6 for Q5_0, 65504 for Q5_1's minimum); `position` is the block's
    /// first element, `value` its largest magnitude.
    ScaleOverflow { position: usize, value: f32 },
}

/// Convert `x` (whole rows of `cols` values) to `dtype`, appending the encoded bytes to `out`
/// and the round-trip error to `stats`.
///
/// `dtype` may be a storage layout: for `q4_0x16` (`iq4_nlx16`) the rows are quantized as Q4_0
/// (IQ4_NL): the same blocks, the same statistics, written sixteen rows interleaved, so `x`
/// must then hold whole sixteen-row groups.
///
/// Every block type goes through its row of the block-type table by the rule `method` takes
/// for it ([`Rule::choose`]). `importance`, when given, holds one non-negative weight per
/// column (length `cols`) and steers Kiln's [`Method::Search`] for Q8_0/Q4_0; for the other
/// block types any method but [`Method::Reference`] takes GGML's importance-weighted rules
/// (what `llama-quantize --imatrix` does). It is ignored by [`Method::Reference`] and by
/// plain float dtypes.
///
/// # Panics
/// If `x.len()` is not a multiple of `cols`, if `importance` has the wrong length, if `dtype`
/// is a block type and `cols` is not a multiple of its block (32, or 256 for the K-quants; the
/// policy never asks for that), or if
/// `dtype` is an interleaved layout and the rows are not whole groups of sixteen.
pub fn convert_rows(
    x: &[f32],
    cols: usize,
    dtype: DType,
    method: Method,
    importance: Option<&[f32]>,
    out: &mut Vec<u8>,
    stats: &mut ErrorStats,
) -> Result<(), ValueError> {
    assert!(
        cols > 0 && x.len().is_multiple_of(cols),
        "x must hold whole rows"
    );
    // A branch-free scan (it vectorizes) first; the position only on failure.
    let exponent_all_ones = x.iter().fold(0u32, |acc, v| {
        acc | u32::from(v.to_bits() & 0x7f80_0000 == 0x7f80_0000)
    });
    if exponent_all_ones != 0 {
        let pos = x.iter().position(|v| !v.is_finite()).unwrap_or(0);
        return Err(ValueError::NonFinite {
            position: pos,
            value: x[pos],
        });
    }
    if let Some(w) = importance {
        assert_eq!(w.len(), cols, "one importance weight per column");
    }
    match dtype {
        DType::F32 => {
            out.extend_from_slice(bytemuck::cast_slice(x));
            stats.add(x, x);
        }
        DType::F16 => encode_f16(x, out, stats)?,
        DType::BF16 => encode_bf16(x, out, stats),
        // The interleaved layouts (units spanning sixteen rows: `q4_0x16`, `iq4_nlx16`,
        // `iq4_xsx16`).
        _ if dtype.rows_per_unit() > 1 => {
            let block = dtype.logical().block_len();
            assert_eq!(cols % block, 0, "block rows must be a multiple of {block}");
            assert!(
                (x.len() / cols).is_multiple_of(GROUP_ROWS),
                "{dtype} rows must be whole groups of {GROUP_ROWS}"
            );
            // Row-major first, then rearranged: the blocks are exactly the plain type's, and
            // nothing reaches `out` when a block fails.
            let logical = dtype.logical();
            let mut plain = Vec::with_capacity(x.len() / block * logical.block_bytes());
            convert_rows(x, cols, logical, method, importance, &mut plain, stats)?;
            out.extend_from_slice(&dtype.to_storage(cols, &plain));
        }
        // Every block type of one row through its row of the table, by the rule the method
        // takes for it ([`Rule::choose`]). (Above, the floats differ in what they report,
        // F16's overflow per value.)
        _ => {
            let kind = dtype.block();
            assert_eq!(kind.rows, 1, "a block type of one row");
            assert_eq!(
                cols % kind.weights,
                0,
                "block rows must be a multiple of {}",
                kind.weights
            );
            out.reserve(x.len() / kind.weights * kind.bytes);
            let start = out.len();
            let r = match Rule::choose(kind, method, importance) {
                Rule::Reference => quantize_reference(x, kind, out, stats),
                rule => quantize_by_rule(x, cols, rule, kind, out, stats),
            };
            r.inspect_err(|_| out.truncate(start))?;
        }
    }
    Ok(())
}

/// `x` as f16 (round to nearest even), appended to `out`, and the round trip's error;
/// `Err` at the first finite value that becomes infinite (what was written is to discard).
fn encode_f16(x: &[f32], out: &mut Vec<u8>, stats: &mut ErrorStats) -> Result<(), ValueError> {
    let mut y = vec![0.0f32; x.len()];
    out.reserve(x.len() * 2);
    for (i, (&v, yv)) in x.iter().zip(y.iter_mut()).enumerate() {
        let h = f16::from_f32(v);
        if h.is_infinite() {
            return Err(ValueError::F16Overflow {
                position: i,
                value: v,
            });
        }
        *yv = h.to_f32();
        out.extend_from_slice(&h.to_le_bytes());
    }
    stats.add(x, &y);
    Ok(())
}

/// `x` as bf16 (round to nearest even), appended to `out`, and the round trip's error.
fn encode_bf16(x: &[f32], out: &mut Vec<u8>, stats: &mut ErrorStats) {
    let mut y = vec![0.0f32; x.len()];
    out.reserve(x.len() * 2);
    for (&v, yv) in x.iter().zip(y.iter_mut()) {
        let h = bf16::from_f32(v);
        *yv = h.to_f32();
        out.extend_from_slice(&h.to_le_bytes());
    }
    stats.add(x, &y);
}

/// Quantize whole rows one at a time by `rule` (GGML's importance-weighted rule, bit for bit
/// with GGML's `quantize_<type>` given an importance matrix, or Kiln's scale search),
/// dequantize them with the type's reference dequantizer and accumulate the error.
fn quantize_by_rule(
    x: &[f32],
    cols: usize,
    rule: Rule,
    kind: &BlockKind,
    out: &mut Vec<u8>,
    stats: &mut ErrorStats,
) -> Result<(), ValueError> {
    let mut y = vec![0.0f32; cols];
    for (r, row) in x.chunks_exact(cols).enumerate() {
        let start = out.len();
        rule.quantize_row(kind, row, out);
        if let Err(b) = finite_units(kind, &out[start..]) {
            let n = kind.weights;
            return Err(ValueError::ScaleOverflow {
                position: r * cols + b * n,
                value: max_abs(&row[b * n..(b + 1) * n]),
            });
        }
        kind.dequantize(&out[start..], cols, &mut y);
        stats.add(row, &y);
    }
    Ok(())
}

/// `Err(i)` for the first unit whose scales are not finite.
fn finite_units(kind: &BlockKind, bytes: &[u8]) -> Result<(), usize> {
    match bytes
        .chunks_exact(kind.bytes)
        .position(|u| !kind.scales_finite(u))
    {
        Some(i) => Err(i),
        None => Ok(()),
    }
}

fn max_abs(x: &[f32]) -> f32 {
    x.iter().fold(0.0f32, |m, v| m.max(v.abs()))
}

/// Quantize whole rows with the type's reference rule (GGML's, bit for bit) and accumulate the
/// round trip's error, through the kernels crate's dispatched [`kiln_kernels::quantize_blocks`]
/// (a fused SIMD loop for the types a tier has one for, the row's reference rule and
/// dequantizer for the others; the same bits in every tier). Blocks never straddle rows
/// (rows are whole blocks), so the blocks of the concatenated rows are the rows' blocks.
fn quantize_reference(
    x: &[f32],
    kind: &BlockKind,
    out: &mut Vec<u8>,
    stats: &mut ErrorStats,
) -> Result<(), ValueError> {
    kiln_kernels::quantize_blocks(kind.dtype, x, out, stats).map_err(|b| {
        let n = kind.weights;
        ValueError::ScaleOverflow {
            position: b * n,
            value: max_abs(&x[b * n..(b + 1) * n]),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::method::{quantize_block_q4_0, quantize_block_q8_0};
    use kiln_format::QK;

    #[test]
    fn f16_overflow_is_reported_not_written() {
        let x = [1.0f32, 65504.0, 65520.0, 2.0];
        let mut out = Vec::new();
        let mut s = ErrorStats::default();
        let e = convert_rows(&x, 4, DType::F16, Method::Reference, None, &mut out, &mut s);
        assert_eq!(
            e,
            Err(ValueError::F16Overflow {
                position: 2,
                value: 65520.0
            })
        );
        // BF16 has the range of f32.
        out.clear();
        convert_rows(
            &x,
            4,
            DType::BF16,
            Method::Reference,
            None,
            &mut out,
            &mut s,
        )
        .unwrap();
        assert_eq!(out.len(), 8);
    }

    #[test]
    fn non_finite_is_reported_for_every_dtype() {
        let mut x = vec![0.25f32; 64];
        x[40] = f32::NEG_INFINITY;
        for d in DType::ALL {
            let mut out = Vec::new();
            let mut s = ErrorStats::default();
            let e = convert_rows(&x, 64, d, Method::Search, None, &mut out, &mut s);
            assert!(
                matches!(e, Err(ValueError::NonFinite { position: 40, .. })),
                "{d}: {e:?}"
            );
            assert!(out.is_empty(), "{d}: nothing may be written");
        }
    }

    #[test]
    fn scale_overflow_is_reported_not_written() {
        let mut x = vec![0.5f32; 64];
        x[40] = 1.0e7; // 1e7 / 127 > 65504
        let mut out = Vec::new();
        let mut s = ErrorStats::default();
        let e = convert_rows(
            &x,
            64,
            DType::Q8_0,
            Method::Reference,
            None,
            &mut out,
            &mut s,
        );
        assert_eq!(
            e,
            Err(ValueError::ScaleOverflow {
                position: 32,
                value: 1.0e7
            })
        );
        assert!(out.is_empty());
        // Q4_0 overflows earlier: 1e6 / 8 > 65504.
        x[40] = 1.0e6;
        let e = convert_rows(
            &x,
            64,
            DType::Q4_0,
            Method::Reference,
            None,
            &mut out,
            &mut s,
        );
        assert!(matches!(
            e,
            Err(ValueError::ScaleOverflow { position: 32, .. })
        ));
    }

    /// iq4_nlx16 and iq4_xsx16 are IQ4_NL's and IQ4_XS's blocks and statistics, rearranged,
    /// with or without importance.
    #[test]
    fn iq4_layouts_are_the_plain_blocks_interleaved() {
        for (x16, cols) in [(DType::IQ4_NLx16, 96), (DType::IQ4_XSx16, 512)] {
            let plain_dtype = x16.logical();
            let rows = 32;
            let x: Vec<f32> = (0..rows * cols)
                .map(|i| ((i * 7919) % 1000) as f32 / 997.0 - 0.5)
                .collect();
            let imp: Vec<f32> = (0..cols).map(|c| 1.0 + (c % 7) as f32).collect();
            for (method, importance) in [
                (Method::Reference, None),
                (Method::Search, Some(imp.as_slice())),
            ] {
                let (mut plain, mut inter) = (Vec::new(), Vec::new());
                let (mut sp, mut si) = (ErrorStats::default(), ErrorStats::default());
                convert_rows(
                    &x,
                    cols,
                    plain_dtype,
                    method,
                    importance,
                    &mut plain,
                    &mut sp,
                )
                .unwrap();
                convert_rows(&x, cols, x16, method, importance, &mut inter, &mut si).unwrap();
                assert_eq!(inter.len(), plain.len(), "{x16} {method}");
                assert_ne!(inter, plain, "{x16} {method}");
                assert_eq!(x16.from_storage(cols, &inter).as_ref(), plain.as_slice());
                assert_eq!(si, sp, "{x16} {method}");
            }
        }
    }

    /// q4_0x16 is Q4_0's blocks and statistics, rearranged; a failing block writes nothing.
    #[test]
    fn q4_0x16_is_q4_0_interleaved() {
        let (rows, cols) = (32, 96);
        let mut x: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 7919) % 1000) as f32 / 997.0 - 0.5)
            .collect();
        for method in [Method::Reference, Method::Search] {
            let (mut plain, mut inter) = (Vec::new(), Vec::new());
            let (mut sp, mut si) = (ErrorStats::default(), ErrorStats::default());
            convert_rows(&x, cols, DType::Q4_0, method, None, &mut plain, &mut sp).unwrap();
            convert_rows(&x, cols, DType::Q4_0x16, method, None, &mut inter, &mut si).unwrap();
            let mut want = Vec::new();
            kiln_format::blocks::interleave_q4_0_bytes(&plain, cols / QK, &mut want);
            assert_eq!(inter, want, "{method}");
            assert_eq!(si, sp, "{method}");
        }
        x[5 * cols + 40] = 1.0e6;
        let mut out = Vec::new();
        let mut s = ErrorStats::default();
        let e = convert_rows(
            &x,
            cols,
            DType::Q4_0x16,
            Method::Reference,
            None,
            &mut out,
            &mut s,
        );
        assert!(matches!(
            e,
            Err(ValueError::ScaleOverflow { position, .. }) if position == 5 * cols + 32
        ));
        assert!(out.is_empty());
    }

    /// The method code's reference blocks ([`Method::Reference`] in [`crate::method`], where
    /// every search starts) are the kernels' reference quantization in every ISA tier.
    #[test]
    fn method_reference_equals_kernels_in_every_tier() {
        let mut x: Vec<f32> = (0..4096)
            .map(|i| ((i * 7919) % 1000) as f32 / 997.0 - 0.5)
            .collect();
        x[64..96].fill(1e-39); // 1/d overflows
        x[96..128].fill(-0.0);
        for dtype in [DType::Q8_0, DType::Q4_0] {
            let mut want = Vec::new();
            for xb in x.chunks_exact(QK) {
                let xb: &[f32; QK] = xb.try_into().unwrap();
                if dtype == DType::Q8_0 {
                    let b = quantize_block_q8_0(Method::Reference, xb, None);
                    want.extend_from_slice(bytemuck::bytes_of(&b));
                } else {
                    let b = quantize_block_q4_0(Method::Reference, xb, None);
                    want.extend_from_slice(bytemuck::bytes_of(&b));
                }
            }
            for isa in kiln_kernels::supported_isas() {
                let k = kiln_kernels::kernels(isa).expect("supported tier");
                let mut got = Vec::new();
                let mut s = ErrorStats::default();
                k.quantize_blocks(dtype, &x, &mut got, &mut s).unwrap();
                assert_eq!(got, want, "{dtype} {isa:?}");
            }
        }
    }

    #[test]
    fn q8_0_row_bytes_are_blocks_in_order() {
        let x: Vec<f32> = (0..128).map(|i| (i as f32 - 60.0) / 7.0).collect();
        let mut out = Vec::new();
        let mut s = ErrorStats::default();
        convert_rows(
            &x,
            64,
            DType::Q8_0,
            Method::Reference,
            None,
            &mut out,
            &mut s,
        )
        .unwrap();
        let want = kiln_format::blocks::quantize_row_q8_0_ref(&x).unwrap();
        assert_eq!(out, bytemuck::cast_slice::<_, u8>(&want));
        assert_eq!(s.count, 128);
    }
}
