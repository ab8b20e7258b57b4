//! Weight conversion on AVX2: bf16 decoding, and GGML's reference Q8_0/Q4_0 quantization
//! with its round-trip statistics, all in registers (largest magnitude, scale, codes,
//! packing, dequantized values and error sums).
//!
//! Bit-identical to [`reference::quantize_blocks_ref`] and [`reference::decode_bf16_ref`]:
//! the same f32 operations in the same order (no FMA contraction, GGML's rounding rules
//! restated lane-wise, the eight-lane statistics partials added exactly as
//! [`ErrorStats::add`] adds them). Q8_0 goes block by block; Q4_0 computes the scales of
//! eight blocks at a time ([`group_q4_0`]), which shortens the scalar dependency chain of
//! each block. Blocks whose `1/d` overflows go through the scalar reference. The tests in
//! `tests/convert.rs` hold every tier to the references.

use std::arch::x86_64::*;

use half::f16;
use kiln_format::{DType, QK};

use crate::reference;
use crate::stats::ErrorStats;

/// [`reference::quantize_blocks_ref`] on AVX2 (the table entry of the x86 tiers): Q8_0 and
/// Q4_0 through the fused loop here, the other block types through the reference.
pub(crate) fn quantize_blocks(
    dtype: DType,
    x: &[f32],
    out: &mut Vec<u8>,
    stats: &mut ErrorStats,
) -> Result<(), usize> {
    crate::shape::quantize_blocks_shape(dtype, x);
    if !matches!(dtype, DType::Q8_0 | DType::Q4_0) {
        return reference::quantize_blocks_ref(dtype, x, out, stats);
    }
    // SAFETY: this function is only in the tables of tiers that include AVX2 and F16C, which
    // `crate::kernels` hands out only on CPUs that have them; the shape was checked above.
    unsafe { quantize_blocks_avx2(dtype, x, out, stats) }
}

/// [`reference::decode_bf16_ref`] on AVX2 (the table entry of the x86 tiers).
pub(crate) fn decode_bf16(bytes: &[u8], out: &mut [f32]) {
    assert_eq!(
        out.len(),
        bytes.len() / 2,
        "decode_bf16: one output per two bytes"
    );
    // SAFETY: as for `quantize_blocks`: only reachable on CPUs with AVX2; lengths checked.
    unsafe { decode_bf16_avx2(bytes, out) }
}

/// # Safety
/// The CPU must support AVX2 and F16C; `dtype` is Q8_0 or Q4_0 and `x` whole blocks.
#[target_feature(enable = "avx2,f16c")]
unsafe fn quantize_blocks_avx2(
    dtype: DType,
    x: &[f32],
    out: &mut Vec<u8>,
    stats: &mut ErrorStats,
) -> Result<(), usize> {
    let q8 = dtype == DType::Q8_0;
    out.reserve(x.len() / QK * dtype.block_bytes());
    let mut pending = Pending::new();
    // Q4_0: groups of eight blocks first (rows are contiguous, so groups may span rows).
    let grouped = if q8 { 0 } else { x.len() / (8 * QK) * (8 * QK) };
    for (g, xg) in x[..grouped].chunks_exact(8 * QK).enumerate() {
        let xg: &[f32; 8 * QK] = xg.try_into().expect("group of 8 blocks");
        // SAFETY: AVX2 and F16C are enabled on this function; `xg` holds 256 values.
        unsafe { group_q4_0(xg, out, &mut pending, stats) }.map_err(|b| g * 8 + b)?;
    }
    for (i, xb) in x[grouped..].chunks_exact(QK).enumerate() {
        let i = grouped / QK + i;
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
            Some(false) => return Err(i),
            None => {
                // 1/d overflows: the scalar reference handles the block, after the
                // blocks before it have been added (the sums are added in block order).
                pending.flush(stats);
                reference::quantize_blocks_ref(dtype, xb, out, stats).map_err(|_| i)?;
            }
        }
    }
    pending.finish(stats);
    Ok(())
}

/// Sixteen values per step (zero-extend to 32 bits, shift into the high half, set the quiet
/// bit of NaNs), the tail as [`reference::decode_bf16_ref`] does.
///
/// # Safety
/// The CPU must support AVX2, and `out.len() == bytes.len() / 2`.
#[target_feature(enable = "avx2")]
unsafe fn decode_bf16_avx2(bytes: &[u8], out: &mut [f32]) {
    let n = out.len();
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
            // SAFETY: `i + 8k + 8 <= i + 16 <= n = out.len()`; the store is unaligned.
            unsafe { _mm256_storeu_si256(out.as_mut_ptr().add(i + 8 * k).cast(), f) };
        }
        i += 16;
    }
    reference::decode_bf16_ref(&bytes[2 * i..2 * n], &mut out[i..]);
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
            // SAFETY: register-only AVX2 operations and stores to local arrays of 8 f32;
            // `Pending` only exists inside the AVX2 kernels, on CPUs that have AVX2.
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
#[target_feature(enable = "avx2")]
#[inline]
fn sum_lanes(r: &[__m256; 8]) -> __m256 {
    fold_lanes(r, |a, b| _mm256_add_ps(a, b))
}

/// Lane b of the result is `f(…f(f(r[b][0], r[b][1]), r[b][2])…, r[b][7])`: an 8×8
/// transpose, then seven applications of `f` in lane order.
#[inline(always)]
fn fold_lanes(r: &[__m256; 8], f: impl Fn(__m256, __m256) -> __m256) -> __m256 {
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
            acc = f(acc, *ck);
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

/// A block's values and their magnitudes (four vectors each), and its largest magnitude.
#[inline(always)]
fn load_abs_max(xb: &[f32; QK]) -> ([__m256; 4], [__m256; 4], f32) {
    let v = load(xb);
    // SAFETY: register-only AVX operations; callers enable AVX2. (No closures: they would
    // not inherit the callers' target features.)
    let (a, m) = unsafe {
        let sign = _mm256_set1_ps(-0.0);
        let a = [
            _mm256_andnot_ps(sign, v[0]),
            _mm256_andnot_ps(sign, v[1]),
            _mm256_andnot_ps(sign, v[2]),
            _mm256_andnot_ps(sign, v[3]),
        ];
        let m = _mm256_max_ps(_mm256_max_ps(a[0], a[1]), _mm256_max_ps(a[2], a[3]));
        (a, m)
    };
    (v, a, hmax(m))
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
    let (v, _, amax) = load_abs_max(xb);
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
    let (v, a, amax) = load_abs_max(xb);
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
    emit_q4_0(&v, id, dh.to_bits(), dh.to_f32(), out, pending, stats);
    Some(true)
}

/// Eight Q4_0 blocks (`xg` holds 256 values) with their scales computed together: the
/// largest magnitudes reduced in one transpose, `d`, `1/d` and the f16 rounding of `d` as
/// eight-lane vector operations (F16C's round-to-nearest-even conversion is the IEEE
/// rounding `half::f16::from_f32` performs), so the long scalar chain of [`block_q4_0`]
/// runs once per eight blocks. Blocks are then handled in order exactly as
/// [`block_q4_0`] and its caller do: a block whose `1/d` overflows goes through the scalar
/// reference, a block whose f16 scale overflows stops the run (`Err(block index)`).
///
/// # Safety
/// The CPU must support AVX2 and F16C.
#[target_feature(enable = "avx2,f16c")]
unsafe fn group_q4_0(
    xg: &[f32; 8 * QK],
    out: &mut Vec<u8>,
    pending: &mut Pending,
    stats: &mut ErrorStats,
) -> Result<(), usize> {
    let block = |b: usize| -> &[f32; QK] { xg[b * QK..(b + 1) * QK].try_into().expect("QK chunk") };
    let sign = _mm256_set1_ps(-0.0);
    let mut lane_max = [_mm256_setzero_ps(); 8];
    for (b, m) in lane_max.iter_mut().enumerate() {
        let a = load(block(b)).map(|v| _mm256_andnot_ps(sign, v));
        *m = _mm256_max_ps(_mm256_max_ps(a[0], a[1]), _mm256_max_ps(a[2], a[3]));
    }
    // Lane b: block b's largest magnitude (max is exact in any order).
    let amax = fold_lanes(&lane_max, |a, b| _mm256_max_ps(a, b));
    let mut amaxs = [0.0f32; 8];
    // SAFETY: a store to a local array of 8 f32.
    unsafe { _mm256_storeu_ps(amaxs.as_mut_ptr(), amax) };
    // GGML's extreme: the first value of largest magnitude, with its sign (+0 if all zero).
    let mut maxs = [0.0f32; 8];
    for (b, m) in maxs.iter_mut().enumerate() {
        if amaxs[b] != 0.0 {
            let xb = block(b);
            let av = _mm256_set1_ps(amaxs[b]);
            let mut mask = 0u32;
            for (k, v) in load(xb).iter().enumerate() {
                let a = _mm256_andnot_ps(sign, *v);
                let eq = _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_EQ_OQ>(a, av)) as u32;
                mask |= eq << (8 * k);
            }
            *m = xb[mask.trailing_zeros() as usize];
        }
    }
    // SAFETY: a load from a local array of 8 f32.
    let max = unsafe { _mm256_loadu_ps(maxs.as_ptr()) };
    let d = _mm256_div_ps(max, _mm256_set1_ps(-8.0));
    // id = 1/d, or 0 where d == 0 (±0).
    let is_zero = _mm256_cmp_ps::<_CMP_EQ_OQ>(d, _mm256_setzero_ps());
    let id = _mm256_andnot_ps(is_zero, _mm256_div_ps(_mm256_set1_ps(1.0), d));
    let dh = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(d);
    let dq = _mm256_cvtph_ps(dh);
    let (mut ids, mut dqs, mut dhs) = ([0.0f32; 8], [0.0f32; 8], [0u16; 8]);
    // SAFETY: stores to local arrays of 8 f32 and 8 u16 (16 bytes).
    unsafe {
        _mm256_storeu_ps(ids.as_mut_ptr(), id);
        _mm256_storeu_ps(dqs.as_mut_ptr(), dq);
        _mm_storeu_si128(dhs.as_mut_ptr().cast(), dh);
    }
    for b in 0..8 {
        let xb = block(b);
        if !ids[b].is_finite() {
            // 1/d overflows: the scalar reference handles the block (after the blocks
            // before it have been added to the statistics, which are added in order).
            pending.flush(stats);
            reference::quantize_blocks_ref(DType::Q4_0, xb, out, stats).map_err(|_| b)?;
        } else if dhs[b] & 0x7c00 == 0x7c00 {
            return Err(b);
        } else {
            emit_q4_0(&load(xb), ids[b], dhs[b], dqs[b], out, pending, stats);
        }
    }
    Ok(())
}

/// Codes, packing, dequantized values and statistics of one Q4_0 block whose `1/d` is
/// `id`, f16 scale bits `dh` and f16 scale value `dq`. (A `target_feature` function, not
/// just `inline(always)`, so that the closures inside are compiled for AVX2 too.)
#[target_feature(enable = "avx2")]
#[inline]
fn emit_q4_0(
    v: &[__m256; 4],
    id: f32,
    dh: u16,
    dq: f32,
    out: &mut Vec<u8>,
    pending: &mut Pending,
    stats: &mut ErrorStats,
) {
    // SAFETY: register-only AVX2 operations (enabled on this function) and one store
    // into a local 16-byte array.
    unsafe {
        let (idv, off) = (_mm256_set1_ps(id), _mm256_set1_ps(8.5));
        let (zero, fifteen, eight) = (
            _mm256_setzero_si256(),
            _mm256_set1_epi32(15),
            _mm256_set1_epi32(8),
        );
        let dq = _mm256_set1_ps(dq);
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
        // `block[2..]` holds exactly 16 bytes; the store is unaligned.
        _mm_storeu_si128(block[2..].as_mut_ptr().cast(), bytes);
        out.extend_from_slice(&block);
        add_stats(v, &y, pending, stats);
    }
}
