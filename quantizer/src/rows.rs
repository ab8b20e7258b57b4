//! Converting rows of f32 values to an output dtype, with the error statistics of the round
//! trip computed in the same pass.
//!
//! [`convert_rows`] is the one entry point the file pipeline uses for every tensor that is not
//! copied: it rejects NaN/Inf (and values that overflow f16) with their position, encodes or
//! quantizes, and accumulates [`ErrorStats`] of `x` against what a reader will decode.

use half::{bf16, f16};
use kiln_format::blocks::{GROUP_ROWS, QK};
use kiln_format::DType;

use crate::method::{quantize_block_q4_0, quantize_block_q8_0, Method};
use crate::metrics::ErrorStats;

/// Why a run of values could not be converted; positions are relative to the run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ValueError {
    /// NaN or infinity at this element.
    NonFinite { position: usize, value: f32 },
    /// A finite value that becomes infinity in f16.
    F16Overflow { position: usize, value: f32 },
    /// A block whose f16 scale overflows (largest magnitude above ~8.3e6 for Q8_0, ~5.2e5 for
    /// Q4_0); `position` is the block's first element, `value` its largest magnitude.
    ScaleOverflow { position: usize, value: f32 },
}

/// Convert `x` (whole rows of `cols` values) to `dtype`, appending the encoded bytes to `out`
/// and the round-trip error to `stats`.
///
/// `dtype` may be a storage layout: for `q4_0x16` the rows are quantized as Q4_0 (the same
/// blocks, the same statistics) and written sixteen rows interleaved, so `x` must then hold
/// whole sixteen-row groups.
///
/// `importance`, when given, holds one non-negative weight per column (length `cols`) and steers
/// [`Method::Search`]; it is ignored by the other methods and by plain float dtypes.
///
/// # Panics
/// If `x.len()` is not a multiple of `cols`, if `importance` has the wrong length, if `dtype`
/// is a block type and `cols` is not a multiple of 32 (the policy never asks for that), or if
/// `dtype` is `q4_0x16` and the rows are not whole groups of sixteen.
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
        DType::F16 => {
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
        }
        DType::BF16 => {
            let mut y = vec![0.0f32; x.len()];
            out.reserve(x.len() * 2);
            for (&v, yv) in x.iter().zip(y.iter_mut()) {
                let h = bf16::from_f32(v);
                *yv = h.to_f32();
                out.extend_from_slice(&h.to_le_bytes());
            }
            stats.add(x, &y);
        }
        DType::Q8_0 | DType::Q4_0 => {
            assert_eq!(cols % QK, 0, "block rows must be a multiple of {QK}");
            out.reserve(x.len() / QK * dtype.block_bytes());
            quantize_rows(x, cols, dtype, method, importance, out, stats)?;
        }
        DType::Q4_0x16 => {
            assert_eq!(cols % QK, 0, "block rows must be a multiple of {QK}");
            assert!(
                (x.len() / cols).is_multiple_of(GROUP_ROWS),
                "q4_0x16 rows must be whole groups of {GROUP_ROWS}"
            );
            // Row-major first, then rearranged: the blocks are exactly Q4_0's, and nothing
            // reaches `out` when a block fails.
            let mut plain = Vec::with_capacity(x.len() / QK * DType::Q4_0.block_bytes());
            quantize_rows(x, cols, DType::Q4_0, method, importance, &mut plain, stats)?;
            out.extend_from_slice(&dtype.to_storage(cols, &plain));
        }
    }
    Ok(())
}

/// Little-endian bf16 bytes to f32, dispatched to the widest vector ISA this CPU has.
/// Equal to [`decode_bf16_ref`] (and to the format crate's `decode_to_f32`) on every bit
/// pattern. A trailing odd byte is ignored.
pub fn decode_bf16(bytes: &[u8]) -> Vec<f32> {
    #[cfg(target_arch = "x86_64")]
    if isa::avx2() {
        // SAFETY: `isa::avx2` checked that this CPU supports AVX2.
        return unsafe { bf16_simd::decode_bf16_avx2_vec(bytes) };
    }
    let mut x = vec![0.0f32; bytes.len() / 2];
    decode_bf16_ref(bytes, &mut x);
    x
}

/// The scalar reference of [`decode_bf16`]: `out[i]` from bytes `2i, 2i + 1`, for as many
/// values as both hold. NaNs get their quiet bit set (`half`'s rule, which the format crate's
/// `decode_to_f32` follows).
pub fn decode_bf16_ref(bytes: &[u8], out: &mut [f32]) {
    for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
        *o = bf16_value(u16::from_le_bytes([c[0], c[1]]));
    }
}

/// One bf16 bit pattern as f32, NaNs quieted.
#[inline(always)]
fn bf16_value(b: u16) -> f32 {
    let b = u32::from(b);
    let quiet = u32::from(b & 0x7fff > 0x7f80) << 6;
    f32::from_bits((b | quiet) << 16)
}

/// The AVX2 bf16 decode: sixteen values per step (zero-extend to 32 bits, shift into the high
/// half, set the quiet bit of NaNs), the tail one by one as [`decode_bf16_ref`] does.
#[cfg(target_arch = "x86_64")]
mod bf16_simd {
    use std::arch::x86_64::*;

    use super::bf16_value;

    /// A new vector of the `bytes.len() / 2` values, written once (not zeroed first).
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn decode_bf16_avx2_vec(bytes: &[u8]) -> Vec<f32> {
        let n = bytes.len() / 2;
        let mut x: Vec<f32> = Vec::with_capacity(n);
        // SAFETY: the capacity holds `n` values and `2n <= bytes.len()`; the caller
        // guarantees AVX2.
        unsafe { decode_into(bytes, x.as_mut_ptr(), n) };
        // SAFETY: `decode_into` wrote all `n` values.
        unsafe { x.set_len(n) };
        x
    }

    /// Write `n` decoded values to `out` (which need not be initialized; it is only written).
    ///
    /// # Safety
    /// The CPU must support AVX2, `out` must be valid for `n` writes of f32, and
    /// `2n <= bytes.len()`.
    #[target_feature(enable = "avx2")]
    unsafe fn decode_into(bytes: &[u8], out: *mut f32, n: usize) {
        debug_assert!(2 * n <= bytes.len());
        let abs = _mm256_set1_epi32(0x7fff_ffff);
        let inf = _mm256_set1_epi32(0x7f80_0000);
        let quiet = _mm256_set1_epi32(0x0040_0000);
        let mut i = 0;
        while i + 16 <= n {
            // SAFETY: `i + 16 <= n` and `2n <= bytes.len()`, so the 32 bytes at `2i` are in
            // bounds; the load is unaligned.
            let v = unsafe { _mm256_loadu_si256(bytes.as_ptr().add(2 * i).cast()) };
            let halves = [_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v)];
            for (k, h) in halves.into_iter().enumerate() {
                let f = _mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h));
                // (f & 0x7fffffff) > 0x7f800000 exactly when (b & 0x7fff) > 0x7f80: a NaN.
                let nan = _mm256_cmpgt_epi32(_mm256_and_si256(f, abs), inf);
                let f = _mm256_or_si256(f, _mm256_and_si256(nan, quiet));
                // SAFETY: `i + 8k + 8 <= i + 16 <= n`, and `out` is valid for `n` writes; the
                // store is unaligned.
                unsafe { _mm256_storeu_si256(out.add(i + 8 * k).cast(), f) };
            }
            i += 16;
        }
        for j in i..n {
            let v = bf16_value(u16::from_le_bytes([bytes[2 * j], bytes[2 * j + 1]]));
            // SAFETY: `j < n`, and `out` is valid for `n` writes.
            unsafe { out.add(j).write(v) };
        }
    }
}

/// The block loop, dispatched once per call to the widest vector ISA this CPU has. The code is
/// the same for every tier (compiled twice), so every tier writes the same bytes.
fn quantize_rows(
    x: &[f32],
    cols: usize,
    dtype: DType,
    method: Method,
    importance: Option<&[f32]>,
    out: &mut Vec<u8>,
    stats: &mut ErrorStats,
) -> Result<(), ValueError> {
    #[cfg(target_arch = "x86_64")]
    if isa::avx2() {
        if method == Method::Reference {
            // SAFETY: `isa::avx2` checked that this CPU supports AVX2 and F16C.
            return unsafe { fused::quantize_rows_reference_avx2(x, cols, dtype, out, stats) };
        }
        // SAFETY: `isa::avx2` checked that this CPU supports AVX2.
        return unsafe { quantize_rows_avx2(x, cols, dtype, method, importance, out, stats) };
    }
    quantize_rows_body(x, cols, dtype, method, importance, out, stats)
}

/// [`quantize_rows_body`] compiled for AVX2.
///
/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn quantize_rows_avx2(
    x: &[f32],
    cols: usize,
    dtype: DType,
    method: Method,
    importance: Option<&[f32]>,
    out: &mut Vec<u8>,
    stats: &mut ErrorStats,
) -> Result<(), ValueError> {
    quantize_rows_body(x, cols, dtype, method, importance, out, stats)
}

/// Quantize whole rows to Q8_0/Q4_0 blocks, dequantize each block in registers and accumulate
/// the error (inlined into every ISA tier).
#[inline(always)]
fn quantize_rows_body(
    x: &[f32],
    cols: usize,
    dtype: DType,
    method: Method,
    importance: Option<&[f32]>,
    out: &mut Vec<u8>,
    stats: &mut ErrorStats,
) -> Result<(), ValueError> {
    let mut y = [0.0f32; QK];
    for (r, row) in x.chunks_exact(cols).enumerate() {
        for (b, xb) in row.chunks_exact(QK).enumerate() {
            let xb: &[f32; QK] = xb.try_into().expect("QK chunk");
            let w: Option<&[f32; QK]> =
                importance.map(|w| w[b * QK..(b + 1) * QK].try_into().expect("QK chunk"));
            let d = if dtype == DType::Q8_0 {
                let block = quantize_block_q8_0(method, xb, w);
                let d = block.d.to_f32();
                for (o, &q) in y.iter_mut().zip(&block.qs) {
                    *o = f32::from(q) * d;
                }
                out.extend_from_slice(bytemuck::bytes_of(&block));
                block.d
            } else {
                let block = quantize_block_q4_0(method, xb, w);
                let d = block.d.to_f32();
                for j in 0..QK / 2 {
                    y[j] = (i32::from(block.qs[j] & 0x0f) - 8) as f32 * d;
                    y[j + QK / 2] = (i32::from(block.qs[j] >> 4) - 8) as f32 * d;
                }
                out.extend_from_slice(bytemuck::bytes_of(&block));
                block.d
            };
            if !d.is_finite() {
                out.clear();
                return Err(ValueError::ScaleOverflow {
                    position: r * cols + b * QK,
                    value: xb.iter().fold(0.0f32, |m, v| m.max(v.abs())),
                });
            }
            stats.add(xb, &y);
        }
    }
    Ok(())
}

/// Error for a block whose f16 scale overflowed; clears what was written.
#[cold]
fn scale_overflow(out: &mut Vec<u8>, position: usize, xb: &[f32]) -> ValueError {
    out.clear();
    ValueError::ScaleOverflow {
        position,
        value: xb.iter().fold(0.0f32, |m, v| m.max(v.abs())),
    }
}

/// The fused AVX2 reference kernels (`rows/fused.rs`).
#[cfg(target_arch = "x86_64")]
mod fused;

/// Run-time ISA selection, decided once. `KILN_QUANTIZE_ISA=baseline` forces the baseline
/// tier (to test it, or to compare) on any machine.
#[cfg(target_arch = "x86_64")]
pub mod isa {
    use std::sync::OnceLock;

    /// Whether the AVX2 tier is used (AVX2 with F16C, which every AVX2 CPU has).
    pub fn avx2() -> bool {
        static AVX2: OnceLock<bool> = OnceLock::new();
        *AVX2.get_or_init(|| {
            std::env::var("KILN_QUANTIZE_ISA").as_deref() != Ok("baseline")
                && std::is_x86_feature_detected!("avx2")
                && std::is_x86_feature_detected!("f16c")
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every bf16 bit pattern decodes as the format crate decodes it, in every tier, at
    /// lengths that exercise the vector tail.
    #[test]
    fn decode_bf16_tiers_equal_format_decode() {
        let bytes: Vec<u8> = (0..=u16::MAX).flat_map(u16::to_le_bytes).collect();
        let mut want = vec![0.0f32; 1 << 16];
        kiln_format::values::decode_to_f32(DType::BF16, &bytes, &mut want);
        let mut reference = vec![0.0f32; 1 << 16];
        decode_bf16_ref(&bytes, &mut reference);
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&reference), bits(&want));
        for len in [0usize, 1, 15, 16, 17, 33, 1000, 1 << 16] {
            // Start one value in too, so the vector loads are not 32-byte aligned; pass a
            // trailing odd byte where there is one (it must be ignored).
            for skip in [0usize, 1] {
                let src = &bytes[2 * skip..];
                let len = len.min(src.len() / 2);
                let got = decode_bf16(&src[..(2 * len + 1).min(src.len())]);
                assert_eq!(got.len(), len);
                assert_eq!(bits(&got), bits(&want[skip..skip + len]), "len {len}");
                #[cfg(target_arch = "x86_64")]
                if std::is_x86_feature_detected!("avx2") {
                    // SAFETY: AVX2 was detected above.
                    let simd = unsafe { bf16_simd::decode_bf16_avx2_vec(&src[..2 * len]) };
                    assert_eq!(bits(&simd), bits(&want[skip..skip + len]), "len {len}");
                }
            }
        }
    }

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

    /// Every ISA tier writes the same bytes and the same statistics.
    #[test]
    fn baseline_tier_equals_dispatched_tier() {
        let x: Vec<f32> = (0..4096)
            .map(|i| ((i * 7919) % 1000) as f32 / 997.0 - 0.5)
            .collect();
        let w: Vec<f32> = (0..256).map(|i| 0.5 + (i % 7) as f32).collect();
        for dtype in [DType::Q8_0, DType::Q4_0] {
            for method in [Method::Reference, Method::Search] {
                for importance in [None, Some(w.as_slice())] {
                    let (mut a, mut b) = (Vec::new(), Vec::new());
                    let (mut sa, mut sb) = (ErrorStats::default(), ErrorStats::default());
                    quantize_rows_body(&x, 256, dtype, method, importance, &mut a, &mut sa)
                        .unwrap();
                    quantize_rows(&x, 256, dtype, method, importance, &mut b, &mut sb).unwrap();
                    assert_eq!(a, b, "{dtype} {method}");
                    assert_eq!(sa, sb, "{dtype} {method}");
                }
            }
        }
    }

    /// The fused AVX2 reference kernel writes the bytes and statistics of the scalar path,
    /// including ties, all-zero and tiny blocks, repeated extremes of both signs and blocks
    /// whose 1/d overflows (scalar fallback inside the kernel).
    #[test]
    #[allow(clippy::needless_range_loop)] // the test writes patterns by index
    fn fused_reference_equals_scalar() {
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("f16c") {
            let mut x: Vec<f32> = (0..32 * 512)
                .map(|i| {
                    let h = (i as u32).wrapping_mul(2_654_435_761) >> 8;
                    (h % 20001) as f32 / 10000.0 - 1.0
                })
                .collect();
            // Ties of round-half-away: values k + 0.5 in units of d = 127/127.
            for j in 0..32 {
                x[j] = (j as f32 - 16.0) + 0.5;
            }
            x[0] = -127.0;
            x[32..64].fill(0.0);
            x[64..96].fill(-0.0);
            for j in 96..128 {
                x[j] = if j % 2 == 0 { 3.0 } else { -3.0 };
            }
            for j in 128..160 {
                x[j] = if j % 2 == 0 { -3.0 } else { 3.0 };
            }
            x[160..192].fill(1e-39);
            x[161] = -2e-39;
            x[192..224].fill(1e-37);
            x[225] = 0.5;
            x[226] = -0.5;
            for j in 256..288 {
                x[j] = (j as f32 - 270.0) * 1e-3 + 1e-4;
            }
            // Whole runs, and runs of 1..=17 blocks from different starts (the statistics of
            // eight blocks at a time are summed together; the rest one by one), some of them
            // beginning or ending next to a fallback block.
            let mut runs: Vec<(usize, usize, usize)> = vec![(0, x.len(), 32), (0, x.len(), 256)];
            for start in [0usize, 3, 4, 5, 6, 100] {
                for blocks in 1..=17 {
                    runs.push((start * 32, (start + blocks) * 32, 32));
                }
            }
            for dtype in [DType::Q8_0, DType::Q4_0] {
                for &(lo, hi, cols) in &runs {
                    let x = &x[lo..hi];
                    let (mut a, mut b) = (Vec::new(), Vec::new());
                    let (mut sa, mut sb) = (ErrorStats::default(), ErrorStats::default());
                    quantize_rows_body(x, cols, dtype, Method::Reference, None, &mut a, &mut sa)
                        .unwrap();
                    // SAFETY: AVX2 and F16C were detected above.
                    unsafe { fused::quantize_rows_reference_avx2(x, cols, dtype, &mut b, &mut sb) }
                        .unwrap();
                    assert_eq!(a, b, "{dtype} {lo}..{hi}");
                    assert_eq!(sa, sb, "{dtype} {lo}..{hi}");
                }
            }
            // Scale overflow: same error, nothing written.
            let mut y = x.clone();
            y[40] = 1.0e7;
            let mut b = Vec::new();
            let mut sb = ErrorStats::default();
            // SAFETY: AVX2 and F16C were detected above.
            let e = unsafe {
                fused::quantize_rows_reference_avx2(&y, 64, DType::Q8_0, &mut b, &mut sb)
            };
            assert_eq!(
                e,
                Err(ValueError::ScaleOverflow {
                    position: 32,
                    value: 1.0e7
                })
            );
            assert!(b.is_empty());
        }
    }

    /// Block values for the fused-kernel property: each block gets its own magnitude (from
    /// subnormal, where `1/d` overflows, to past the f16 scale limit), and some values are
    /// zero, negated extremes or repeated.
    #[cfg(target_arch = "x86_64")]
    fn fused_input() -> impl proptest::strategy::Strategy<Value = Vec<f32>> {
        use proptest::prelude::*;
        let block = (
            prop::sample::select(vec![0.0f32, 1e-39, 1e-30, 1e-3, 0.05, 1.0, 300.0, 6e5, 1e7]),
            prop::collection::vec(-1.0f32..1.0, QK),
            prop::collection::vec(0u8..8, QK),
        )
            .prop_map(|(scale, u, kind)| {
                u.iter()
                    .zip(&kind)
                    .map(|(&u, &k)| match k {
                        0 => 0.0,
                        1 => scale,
                        2 => -scale,
                        _ => u * scale,
                    })
                    .collect::<Vec<f32>>()
            });
        prop::collection::vec(block, 1..40).prop_map(|b| b.concat())
    }

    #[cfg(target_arch = "x86_64")]
    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig {
            cases: 512,
            failure_persistence: None,
            ..proptest::prelude::ProptestConfig::default()
        })]
        /// The fused kernel (eight-block groups and single blocks) equals the scalar reference:
        /// bytes, statistics, and the error (position and value) when a scale overflows.
        #[test]
        fn fused_reference_matches_scalar_on_random_blocks(x in fused_input()) {
            if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("f16c") {
                for dtype in [DType::Q4_0, DType::Q8_0] {
                    let (mut a, mut b) = (Vec::new(), Vec::new());
                    let (mut sa, mut sb) = (ErrorStats::default(), ErrorStats::default());
                    let ra = quantize_rows_body(
                        &x, QK, dtype, Method::Reference, None, &mut a, &mut sa,
                    );
                    // SAFETY: AVX2 and F16C were detected above.
                    let rb = unsafe {
                        fused::quantize_rows_reference_avx2(&x, QK, dtype, &mut b, &mut sb)
                    };
                    proptest::prop_assert_eq!(ra, rb);
                    if ra.is_ok() {
                        proptest::prop_assert_eq!(&a, &b);
                        proptest::prop_assert_eq!(sa, sb);
                    } else {
                        proptest::prop_assert!(b.is_empty());
                    }
                }
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
