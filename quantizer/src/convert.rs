//! Converting rows of f32 values to an output dtype, with the error statistics of the round
//! trip computed in the same pass.
//!
//! [`convert_rows`] is the one entry point the file pipeline uses for every tensor that is not
//! copied: it rejects NaN/Inf (and values that overflow f16) with their position, encodes or
//! quantizes, and accumulates [`ErrorStats`] of `x` against what a reader will decode.

use half::{bf16, f16};
use kiln_format::blocks::QK;
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
/// `importance`, when given, holds one non-negative weight per column (length `cols`) and steers
/// [`Method::Search`]; it is ignored by the other methods and by plain float dtypes.
///
/// # Panics
/// If `x.len()` is not a multiple of `cols`, if `importance` has the wrong length, or if `dtype`
/// is a block type and `cols` is not a multiple of 32 (the policy never asks for that).
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
            // SAFETY: `isa::avx2` checked that this CPU supports AVX2.
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

/// The reference method as one hand-written AVX2 pass per block: largest magnitude, scale,
/// codes, packing, dequantized values and error statistics, all in registers.
///
/// Bit-identical to [`quantize_rows_body`] with [`Method::Reference`]: the same f32 operations
/// in the same order (no FMA contraction, the `round_away`/truncation rules restated lane-wise,
/// the eight-lane statistics partials folded by [`ErrorStats::add_lanes`]). Blocks whose `1/d`
/// overflows go through the scalar reference. `tests::fused_reference_equals_scalar` holds it
/// to the scalar path.
#[cfg(target_arch = "x86_64")]
mod fused {
    use std::arch::x86_64::*;

    use half::f16;
    use kiln_format::blocks::QK;
    use kiln_format::DType;

    use super::{quantize_rows_body, scale_overflow, ValueError};
    use crate::method::Method;
    use crate::metrics::ErrorStats;

    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn quantize_rows_reference_avx2(
        x: &[f32],
        cols: usize,
        dtype: DType,
        out: &mut Vec<u8>,
        stats: &mut ErrorStats,
    ) -> Result<(), ValueError> {
        debug_assert!(cols.is_multiple_of(QK) && x.len().is_multiple_of(cols));
        let q8 = dtype == DType::Q8_0;
        let mut pending = Pending::new();
        for (i, xb) in x.chunks_exact(QK).enumerate() {
            let xb: &[f32; QK] = xb.try_into().expect("QK chunk");
            let ok = if q8 {
                // SAFETY: AVX2 is enabled on this function; `xb` holds 32 values.
                unsafe { block_q8_0(xb, out, &mut pending, stats) }
            } else {
                // SAFETY: as above.
                unsafe { block_q4_0(xb, out, &mut pending, stats) }
            };
            match ok {
                Some(true) => {}
                Some(false) => return Err(scale_overflow(out, i * QK, xb)),
                None => {
                    // 1/d overflows: the scalar reference handles the block, after the
                    // blocks before it have been added (the sums are added in block order).
                    pending.flush(stats);
                    quantize_rows_body(xb, QK, dtype, Method::Reference, None, out, stats)
                        .map_err(|_| scale_overflow(out, i * QK, xb))?;
                }
            }
        }
        pending.finish(stats);
        Ok(())
    }

    /// The error statistics of up to eight blocks, kept as vectors until eight are there and
    /// then added to an [`ErrorStats`] in block order with exactly [`ErrorStats::add_lanes`]'s
    /// arithmetic: per block `((s₀ + s₁) + s₂) + … + s₇` in f32, then added in f64. Eight
    /// blocks' lane sums are transposed so that those seven additions run once for all eight
    /// (vector lane b = block b). The largest error is order-independent (no NaN can occur:
    /// inputs are finite), so it is kept as one running vector maximum.
    struct Pending {
        /// Per-lane Σx² of each pending block.
        s: [__m256; 8],
        /// Per-lane Σ(x − x̂)² of each pending block.
        e: [__m256; 8],
        /// Blocks pending.
        n: usize,
        /// Running per-lane max |x − x̂| since the start of the call.
        max: __m256,
    }

    impl Pending {
        #[inline(always)]
        fn new() -> Self {
            // SAFETY: register-only AVX operations; callers enable AVX2.
            unsafe {
                Pending {
                    s: [_mm256_setzero_ps(); 8],
                    e: [_mm256_setzero_ps(); 8],
                    n: 0,
                    max: _mm256_setzero_ps(),
                }
            }
        }

        #[inline(always)]
        fn push(&mut self, s: __m256, e: __m256, m: __m256, stats: &mut ErrorStats) {
            self.s[self.n] = s;
            self.e[self.n] = e;
            self.n += 1;
            // SAFETY: register-only AVX operation; callers enable AVX2.
            self.max = unsafe { _mm256_max_ps(self.max, m) };
            stats.count += QK as u64;
            if self.n == 8 {
                self.flush(stats);
            }
        }

        /// Add the pending blocks' sums to `stats`, in block order.
        #[inline(always)]
        fn flush(&mut self, stats: &mut ErrorStats) {
            let (mut ss, mut es) = ([0.0f32; 8], [0.0f32; 8]);
            if self.n == 8 {
                // SAFETY: register-only AVX operations and stores to local arrays of 8 f32.
                unsafe {
                    _mm256_storeu_ps(ss.as_mut_ptr(), sum_lanes(&self.s));
                    _mm256_storeu_ps(es.as_mut_ptr(), sum_lanes(&self.e));
                }
            } else {
                for b in 0..self.n {
                    let (mut sa, mut ea) = ([0.0f32; 8], [0.0f32; 8]);
                    // SAFETY: stores to local arrays of 8 f32.
                    unsafe {
                        _mm256_storeu_ps(sa.as_mut_ptr(), self.s[b]);
                        _mm256_storeu_ps(ea.as_mut_ptr(), self.e[b]);
                    }
                    ss[b] = sa.iter().sum::<f32>();
                    es[b] = ea.iter().sum::<f32>();
                }
            }
            for b in 0..self.n {
                stats.sum_sq_signal += f64::from(ss[b]);
                stats.sum_sq_error += f64::from(es[b]);
            }
            self.n = 0;
        }

        #[inline(always)]
        fn finish(mut self, stats: &mut ErrorStats) {
            self.flush(stats);
            stats.max_abs_error = stats.max_abs_error.max(hmax(self.max));
        }
    }

    /// Lane b of the result is `((r[b][0] + r[b][1]) + r[b][2]) + … + r[b][7]`: an 8×8
    /// transpose, then seven vector additions in lane order.
    #[inline(always)]
    fn sum_lanes(r: &[__m256; 8]) -> __m256 {
        // SAFETY: register-only AVX operations; callers enable AVX2.
        unsafe {
            let t0 = _mm256_unpacklo_ps(r[0], r[1]);
            let t1 = _mm256_unpackhi_ps(r[0], r[1]);
            let t2 = _mm256_unpacklo_ps(r[2], r[3]);
            let t3 = _mm256_unpackhi_ps(r[2], r[3]);
            let t4 = _mm256_unpacklo_ps(r[4], r[5]);
            let t5 = _mm256_unpackhi_ps(r[4], r[5]);
            let t6 = _mm256_unpacklo_ps(r[6], r[7]);
            let t7 = _mm256_unpackhi_ps(r[6], r[7]);
            let u0 = _mm256_shuffle_ps::<0x44>(t0, t2);
            let u1 = _mm256_shuffle_ps::<0xee>(t0, t2);
            let u2 = _mm256_shuffle_ps::<0x44>(t1, t3);
            let u3 = _mm256_shuffle_ps::<0xee>(t1, t3);
            let u4 = _mm256_shuffle_ps::<0x44>(t4, t6);
            let u5 = _mm256_shuffle_ps::<0xee>(t4, t6);
            let u6 = _mm256_shuffle_ps::<0x44>(t5, t7);
            let u7 = _mm256_shuffle_ps::<0xee>(t5, t7);
            // Column k (lane k of every row) for k = 0..8.
            let c = [
                _mm256_permute2f128_ps::<0x20>(u0, u4),
                _mm256_permute2f128_ps::<0x20>(u1, u5),
                _mm256_permute2f128_ps::<0x20>(u2, u6),
                _mm256_permute2f128_ps::<0x20>(u3, u7),
                _mm256_permute2f128_ps::<0x31>(u0, u4),
                _mm256_permute2f128_ps::<0x31>(u1, u5),
                _mm256_permute2f128_ps::<0x31>(u2, u6),
                _mm256_permute2f128_ps::<0x31>(u3, u7),
            ];
            let mut acc = c[0];
            for ck in &c[1..] {
                acc = _mm256_add_ps(acc, *ck);
            }
            acc
        }
    }

    /// Load the 32 values of a block as four vectors.
    #[inline(always)]
    fn load(xb: &[f32; QK]) -> [__m256; 4] {
        // SAFETY: `xb` holds 32 f32, so each 8-lane unaligned load at 0, 8, 16, 24 is in bounds;
        // AVX is implied by the callers' `avx2` target feature.
        unsafe {
            let p = xb.as_ptr();
            [
                _mm256_loadu_ps(p),
                _mm256_loadu_ps(p.add(8)),
                _mm256_loadu_ps(p.add(16)),
                _mm256_loadu_ps(p.add(24)),
            ]
        }
    }

    /// Horizontal max of eight non-negative, non-NaN lanes.
    #[inline(always)]
    fn hmax(m: __m256) -> f32 {
        // SAFETY: register-only AVX operations; callers enable AVX2.
        unsafe {
            let m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
            let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            let m1 = _mm_max_ss(m2, _mm_shuffle_ps::<0b01>(m2, m2));
            _mm_cvtss_f32(m1)
        }
    }

    /// The statistics of `v` against `y` in [`ErrorStats::add`]'s lane order, handed to
    /// `pending`.
    #[inline(always)]
    fn add_stats(v: &[__m256; 4], y: &[__m256; 4], pending: &mut Pending, stats: &mut ErrorStats) {
        // SAFETY: register-only AVX operations.
        let (s, e, m) = unsafe {
            let sign = _mm256_set1_ps(-0.0);
            let (mut s, mut e, mut m) = (
                _mm256_setzero_ps(),
                _mm256_setzero_ps(),
                _mm256_setzero_ps(),
            );
            for k in 0..4 {
                let d = _mm256_sub_ps(v[k], y[k]);
                s = _mm256_add_ps(s, _mm256_mul_ps(v[k], v[k]));
                e = _mm256_add_ps(e, _mm256_mul_ps(d, d));
                m = _mm256_max_ps(m, _mm256_andnot_ps(sign, d));
            }
            (s, e, m)
        };
        pending.push(s, e, m, stats);
    }

    /// One Q8_0 block. `Some(true)`: written; `Some(false)`: the f16 scale overflowed;
    /// `None`: 1/d overflows, nothing written (scalar fallback).
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    unsafe fn block_q8_0(
        xb: &[f32; QK],
        out: &mut Vec<u8>,
        pending: &mut Pending,
        stats: &mut ErrorStats,
    ) -> Option<bool> {
        let v = load(xb);
        let sign = _mm256_set1_ps(-0.0);
        let a = v.map(|v| _mm256_andnot_ps(sign, v));
        let amax = hmax(_mm256_max_ps(
            _mm256_max_ps(a[0], a[1]),
            _mm256_max_ps(a[2], a[3]),
        ));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        if !id.is_finite() {
            return None;
        }
        let dh = f16::from_f32(d);
        if !dh.is_finite() {
            return Some(false);
        }
        let (idv, half, nhalf) = (
            _mm256_set1_ps(id),
            _mm256_set1_ps(0.5),
            _mm256_set1_ps(-0.5),
        );
        let (lo, hi) = (_mm256_set1_epi32(-128), _mm256_set1_epi32(127));
        let dq = _mm256_set1_ps(dh.to_f32());
        // |x·id| <= ~127.00002 here, so round_away's ±256 clamp never applies.
        let q = v.map(|v| {
            let p = _mm256_mul_ps(v, idv);
            let t = _mm256_cvttps_epi32(p);
            let frac = _mm256_sub_ps(p, _mm256_cvtepi32_ps(t));
            // Compare masks are -1 where true: subtracting `up` adds one, adding `down` subtracts.
            let up = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_GE_OQ>(frac, half));
            let down = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_LE_OQ>(frac, nhalf));
            let t = _mm256_add_epi32(_mm256_sub_epi32(t, up), down);
            _mm256_min_epi32(_mm256_max_epi32(t, lo), hi)
        });
        let y = q.map(|q| _mm256_mul_ps(_mm256_cvtepi32_ps(q), dq));
        let p16 = _mm256_packs_epi32(q[0], q[1]);
        let p16b = _mm256_packs_epi32(q[2], q[3]);
        let p8 = _mm256_packs_epi16(p16, p16b);
        let codes = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        let mut block = [0u8; 2 + QK];
        block[..2].copy_from_slice(&dh.to_le_bytes());
        // SAFETY: `block[2..]` holds exactly 32 bytes; the store is unaligned.
        unsafe { _mm256_storeu_si256(block[2..].as_mut_ptr().cast(), codes) };
        out.extend_from_slice(&block);
        add_stats(&v, &y, pending, stats);
        Some(true)
    }

    /// One Q4_0 block; results as for [`block_q8_0`].
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    unsafe fn block_q4_0(
        xb: &[f32; QK],
        out: &mut Vec<u8>,
        pending: &mut Pending,
        stats: &mut ErrorStats,
    ) -> Option<bool> {
        let v = load(xb);
        let sign = _mm256_set1_ps(-0.0);
        let a = v.map(|v| _mm256_andnot_ps(sign, v));
        let amax = hmax(_mm256_max_ps(
            _mm256_max_ps(a[0], a[1]),
            _mm256_max_ps(a[2], a[3]),
        ));
        // GGML's extreme: the first value of largest magnitude, with its sign (+0 if all zero).
        let max = if amax == 0.0 {
            0.0
        } else {
            let av = _mm256_set1_ps(amax);
            let mut mask = 0u32;
            for (k, a) in a.iter().enumerate() {
                let eq = _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_EQ_OQ>(*a, av)) as u32;
                mask |= eq << (8 * k);
            }
            xb[mask.trailing_zeros() as usize]
        };
        let d = max / -8.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        if !id.is_finite() {
            return None;
        }
        let dh = f16::from_f32(d);
        if !dh.is_finite() {
            return Some(false);
        }
        let (idv, off) = (_mm256_set1_ps(id), _mm256_set1_ps(8.5));
        let (zero, fifteen, eight) = (
            _mm256_setzero_si256(),
            _mm256_set1_epi32(15),
            _mm256_set1_epi32(8),
        );
        let dq = _mm256_set1_ps(dh.to_f32());
        let c = v.map(|v| {
            let t = _mm256_cvttps_epi32(_mm256_add_ps(_mm256_mul_ps(v, idv), off));
            _mm256_min_epi32(_mm256_max_epi32(t, zero), fifteen)
        });
        let y = c.map(|c| _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(c, eight)), dq));
        // Byte j = code j | code (j + 16) << 4.
        let lo = _mm256_or_si256(c[0], _mm256_slli_epi32::<4>(c[2]));
        let hi = _mm256_or_si256(c[1], _mm256_slli_epi32::<4>(c[3]));
        let p16 = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packs_epi32(lo, hi));
        let bytes = _mm_packus_epi16(
            _mm256_castsi256_si128(p16),
            _mm256_extracti128_si256::<1>(p16),
        );
        let mut block = [0u8; 2 + QK / 2];
        block[..2].copy_from_slice(&dh.to_le_bytes());
        // SAFETY: `block[2..]` holds exactly 16 bytes; the store is unaligned.
        unsafe { _mm_storeu_si128(block[2..].as_mut_ptr().cast(), bytes) };
        out.extend_from_slice(&block);
        add_stats(&v, &y, pending, stats);
        Some(true)
    }
}

/// Run-time ISA selection, decided once. `KILN_QUANTIZE_ISA=baseline` forces the baseline
/// tier (to test it, or to compare) on any machine.
#[cfg(target_arch = "x86_64")]
pub mod isa {
    use std::sync::OnceLock;

    /// Whether the AVX2 tier is used.
    pub fn avx2() -> bool {
        static AVX2: OnceLock<bool> = OnceLock::new();
        *AVX2.get_or_init(|| {
            std::env::var("KILN_QUANTIZE_ISA").as_deref() != Ok("baseline")
                && std::is_x86_feature_detected!("avx2")
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
        kiln_format::convert::decode_to_f32(DType::BF16, &bytes, &mut want);
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
        if std::is_x86_feature_detected!("avx2") {
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
                    // SAFETY: AVX2 was detected above.
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
            // SAFETY: AVX2 was detected above.
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
