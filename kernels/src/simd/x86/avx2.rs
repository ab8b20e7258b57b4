//! The AVX2 tier (AVX2 + FMA + F16C): 8-lane float kernels and `maddubs`-based block dots.

use std::arch::x86_64::*;

use half::{bf16, f16};
use kiln_format::{BlockQ4_0, BlockQ8_0};

use super::avx2_rows;
use super::float::{self, F32Simd, Weight};
use super::kquant::avx2 as ktiles;
use super::quant::{self, hsum256, QBlock, QDot};
use super::{avx2_group, avx2_group_iq4, avx2_group_iq4xs};
use crate::isa::Isa;
use crate::kquant::KTiles;
use crate::table::{Kernels, SCALAR_TABLE};
use crate::tile::{Tile, TILE_ROWS, WIDE_ROWS};

/// Marker type for this ISA's primitives.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Avx2;

// SAFETY: every method is only called from functions compiled with `avx2,fma,f16c`.
unsafe impl F32Simd for Avx2 {
    const LANES: usize = 8;
    type V = __m256;
    #[inline(always)]
    unsafe fn zero() -> __m256 {
        // SAFETY: AVX enabled (trait contract).
        unsafe { _mm256_setzero_ps() }
    }
    #[inline(always)]
    unsafe fn splat(v: f32) -> __m256 {
        // SAFETY: AVX enabled (trait contract).
        unsafe { _mm256_set1_ps(v) }
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> __m256 {
        // SAFETY: p valid for 8 f32 (trait contract); unaligned load.
        unsafe { _mm256_loadu_ps(p) }
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: __m256) {
        // SAFETY: p valid for writing 8 f32 (trait contract); unaligned store.
        unsafe { _mm256_storeu_ps(p, v) }
    }
    #[inline(always)]
    unsafe fn load_f16(p: *const f16) -> __m256 {
        // SAFETY: p valid for 8 f16 = 16 bytes (trait contract); F16C enabled.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)) }
    }
    #[inline(always)]
    unsafe fn load_bf16(p: *const bf16) -> __m256 {
        // SAFETY: p valid for 8 bf16 = 16 bytes (trait contract); bf16 is the top half of f32.
        unsafe {
            let w = _mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i));
            _mm256_castsi256_ps(_mm256_slli_epi32(w, 16))
        }
    }
    #[inline(always)]
    unsafe fn add(a: __m256, b: __m256) -> __m256 {
        // SAFETY: AVX enabled (trait contract).
        unsafe { _mm256_add_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn fma(a: __m256, b: __m256, c: __m256) -> __m256 {
        // SAFETY: FMA enabled (trait contract).
        unsafe { _mm256_fmadd_ps(a, b, c) }
    }
    #[inline(always)]
    unsafe fn reduce(v: __m256) -> f32 {
        // SAFETY: AVX enabled (trait contract).
        unsafe { hsum256(v) }
    }
}

/// A Q8_0 activation block prepared for `maddubs`.
#[derive(Clone, Copy)]
pub(crate) struct Prep {
    /// The 32 codes.
    x: __m256i,
    /// `8·Σx` per group of four codes (i32 lanes), the Q4_0 offset correction.
    sum8: __m256i,
}

// SAFETY: every method is only called from functions compiled with `avx2,fma,f16c`.
unsafe impl QDot for Avx2 {
    type Prep = Prep;
    /// `(|w|, w)`: the sign trick needs both.
    type W8 = (__m256i, __m256i);
    /// Unsigned nibbles `q + 8` (0..=15), weight j in byte j.
    type W4 = __m256i;
    #[inline(always)]
    unsafe fn prep(x: &BlockQ8_0) -> Prep {
        // SAFETY: x.qs is 32 readable bytes; AVX2 enabled (trait contract).
        unsafe {
            let x = _mm256_loadu_si256(x.qs.as_ptr() as *const __m256i);
            let p16 = _mm256_maddubs_epi16(_mm256_set1_epi8(8), x);
            let sum8 = _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
            Prep { x, sum8 }
        }
    }
    #[inline(always)]
    unsafe fn load_q8(w: &BlockQ8_0) -> (__m256i, __m256i) {
        // SAFETY: w.qs is 32 readable bytes; AVX2 enabled (trait contract).
        unsafe {
            let w = _mm256_loadu_si256(w.qs.as_ptr() as *const __m256i);
            (_mm256_sign_epi8(w, w), w)
        }
    }
    #[inline(always)]
    unsafe fn load_q4(w: &BlockQ4_0) -> __m256i {
        // SAFETY: w.qs is 16 readable bytes; AVX2 enabled (trait contract).
        unsafe {
            let raw = _mm_loadu_si128(w.qs.as_ptr() as *const __m128i);
            let m4 = _mm_set1_epi8(0x0f);
            let lo = _mm_and_si128(raw, m4);
            let hi = _mm_and_si128(_mm_srli_epi16(raw, 4), m4);
            _mm256_set_m128i(hi, lo)
        }
    }
    /// Sign trick: `|w|` (unsigned) times `x·sign(w)` (signed) with `maddubs`. Exact for any
    /// weight code (|-128| wraps to 0x80 = 128 unsigned) and activation codes in -127..=127
    /// (negating an activation of -128 wraps); pair sums stay within i16 (2·128·127 < 2^15).
    #[inline(always)]
    unsafe fn dot_q8((aw, w): (__m256i, __m256i), x: &Prep) -> __m256i {
        // SAFETY: AVX2 enabled (trait contract); register-only intrinsics.
        unsafe {
            let sx = _mm256_sign_epi8(x.x, w);
            _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sx), _mm256_set1_epi16(1))
        }
    }
    /// Unsigned nibbles `q + 8` times `x` with `maddubs`, minus `8·Σx`.
    #[inline(always)]
    unsafe fn dot_q4(q: __m256i, x: &Prep) -> __m256i {
        // SAFETY: AVX2 enabled (trait contract); register-only intrinsics.
        unsafe {
            let p = _mm256_madd_epi16(_mm256_maddubs_epi16(q, x.x), _mm256_set1_epi16(1));
            _mm256_sub_epi32(p, x.sum8)
        }
    }
}

/// The `#[target_feature]` entry points, their safe wrappers and the table, for one ISA.
///
/// `$tf` and `$tq` are the tokens per multi-token tile for float and quantized weights: as many
/// as the ISA's register file holds accumulators for (`TILE_ROWS × tokens`). `$wc` is the
/// vectors per row of a `weighted_sum` block, likewise (`WEIGHTED_ROWS × $wc` accumulators
/// plus `$wc` loaded vectors and a broadcast probability). `$fr × $fv` is the float lanes
/// kernel's register block: rows by vectors of tokens (`$fr·$fv` accumulators, `$fv` loaded
/// vectors and a broadcast weight). `$tr` is the most tokens the sixteen-row float kernel takes
/// per call (`2·$tr` accumulators, two weight vectors, the tokens' loads).
macro_rules! isa_entry_points {
    ($features:literal, $S:ty, $tf:literal, $tq:literal, $wc:literal, $fr:literal, $fv:literal,
     $tr:literal) => {
        #[target_feature(enable = $features)]
        unsafe fn float_lanes_impl(
            w: &[&[f32]; $crate::lanes::FLOAT_ROWS],
            x: &[[f32; $crate::lanes::FLOAT_TILE]],
            tokens: usize,
            acc: &mut $crate::lanes::FloatAcc,
        ) {
            // SAFETY: features enabled by this function's attribute; lengths checked by the
            // caller.
            unsafe { float::lanes::<$S, $fr, $fv>(w, x, tokens, acc) }
        }

        #[target_feature(enable = $features)]
        unsafe fn tile_float<W: Weight, const T: usize>(
            rows: &[&[W]; TILE_ROWS],
            xs: &[&[f32]; T],
        ) -> [[f32; TILE_ROWS]; T] {
            // SAFETY: features enabled by this function's attribute; lengths checked by callers.
            unsafe { float::tile::<$S, W, TILE_ROWS, T>(rows, xs) }
        }

        #[target_feature(enable = $features)]
        unsafe fn rows_float<W: Weight>(w: &[W], x: &[f32]) -> [f32; WIDE_ROWS] {
            // SAFETY: features enabled by this function's attribute; lengths checked by callers.
            unsafe { float::rows16::<$S, W>(w, x) }
        }

        #[target_feature(enable = $features)]
        unsafe fn rows_float_tokens<W: Weight, const T: usize>(
            w: &[W],
            xs: &[&[f32]; T],
        ) -> [[f32; WIDE_ROWS]; T] {
            // SAFETY: features enabled by this function's attribute; lengths checked by callers.
            unsafe { float::rows16_tokens::<$S, W, T>(w, xs) }
        }

        #[target_feature(enable = $features)]
        unsafe fn tile_quant<W: QBlock, const T: usize>(
            rows: &[&[W]; TILE_ROWS],
            xs: &[&[BlockQ8_0]; T],
        ) -> [[f32; TILE_ROWS]; T] {
            // SAFETY: features enabled by this function's attribute; lengths checked by callers.
            unsafe { quant::tile::<$S, W, TILE_ROWS, T>(rows, xs) }
        }

        #[target_feature(enable = $features)]
        unsafe fn dot_float<W: Weight>(w: &[W], x: &[f32]) -> f32 {
            // SAFETY: features enabled by this function's attribute; lengths checked by callers.
            unsafe { float::tile::<$S, W, 1, 1>(&[w], &[x])[0][0] }
        }

        #[target_feature(enable = $features)]
        unsafe fn dot_quant<W: QBlock>(w: &[W], x: &[BlockQ8_0]) -> f32 {
            // SAFETY: features enabled by this function's attribute; lengths checked by callers.
            unsafe { quant::tile::<$S, W, 1, 1>(&[w], &[x])[0][0] }
        }

        #[target_feature(enable = $features)]
        unsafe fn quantize_impl(x: &[f32], out: &mut [BlockQ8_0]) {
            // SAFETY: features enabled by this function's attribute; lengths checked by callers.
            unsafe { quant::quantize_row_q8_0(x, out) }
        }

        #[target_feature(enable = $features)]
        unsafe fn axpy_impl(alpha: f32, x: &[f32], y: &mut [f32]) {
            // SAFETY: features enabled by this function's attribute; lengths checked by callers.
            unsafe { float::axpy::<$S>(alpha, x, y) }
        }

        #[target_feature(enable = $features)]
        unsafe fn weighted_sum_impl(
            probs: &[f32],
            stride: usize,
            v: &[f32],
            width: usize,
            out: &mut [f32],
        ) {
            // SAFETY: features enabled by this function's attribute; lengths checked by callers.
            unsafe { float::weighted_sum::<$S, $wc, f32>(probs, stride, v, width, out) }
        }

        #[target_feature(enable = $features)]
        unsafe fn weighted_sum_f16_impl(
            probs: &[f32],
            stride: usize,
            v: &[f16],
            width: usize,
            out: &mut [f32],
        ) {
            // SAFETY: features enabled by this function's attribute; lengths checked by callers.
            unsafe { float::weighted_sum::<$S, $wc, f16>(probs, stride, v, width, out) }
        }

        #[target_feature(enable = $features)]
        unsafe fn rmsnorm_impl(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
            // SAFETY: features enabled by this function's attribute; lengths checked by callers.
            unsafe { float::rmsnorm::<$S>(x, weight, eps, out) }
        }

        #[target_feature(enable = $features)]
        fn silu_mul_impl(gate: &[f32], up: &[f32], out: &mut [f32]) {
            crate::approx::silu_mul(gate, up, out)
        }

        #[target_feature(enable = $features)]
        fn gelu_tanh_mul_impl(gate: &[f32], up: &[f32], out: &mut [f32]) {
            crate::approx::gelu_tanh_mul(gate, up, out)
        }

        #[target_feature(enable = $features)]
        fn gelu_impl(x: &[f32], out: &mut [f32]) {
            crate::approx::gelu(x, out)
        }

        #[target_feature(enable = $features)]
        fn softmax_impl(x: &mut [f32]) {
            crate::approx::softmax_inplace(x)
        }

        #[target_feature(enable = $features)]
        fn exp_sum_impl(x: &mut [f32], shift: f32) -> f32 {
            crate::approx::exp_sum(x, shift)
        }

        // The safe wrappers below check every length the kernels rely on. Their `unsafe` calls
        // are sound because `table()` is only handed out when the CPU has this tier's features
        // (`Isa::is_supported`, checked by `crate::kernels`).

        fn float_tile<W: Weight, const T: usize>(
            rows: &[&[W]; TILE_ROWS],
            xs: &[&[f32]],
            out: &mut [[f32; TILE_ROWS]],
        ) {
            let xs: &[&[f32]; T] = crate::simd::check_tile(rows, xs, out);
            // SAFETY: features supported (see above); lengths checked.
            let res = unsafe { tile_float::<W, T>(rows, xs) };
            out.copy_from_slice(&res);
        }

        fn float_lanes(
            w: &[&[f32]; $crate::lanes::FLOAT_ROWS],
            x: &[[f32; $crate::lanes::FLOAT_TILE]],
            tokens: usize,
            acc: &mut $crate::lanes::FloatAcc,
        ) {
            assert!(
                tokens <= $crate::lanes::FLOAT_TILE && w.iter().all(|r| r.len() == x.len()),
                "float lanes: row length or token count mismatch"
            );
            // SAFETY: features supported (see above); lengths checked.
            unsafe { float_lanes_impl(w, x, tokens, acc) }
        }

        #[target_feature(enable = $features)]
        unsafe fn widen_f16_impl(w: &[f16], out: &mut [f32]) {
            // SAFETY: features enabled by this function's attribute; lengths checked by the
            // caller.
            unsafe { float::widen::<$S, f16>(w, out) }
        }

        fn widen_f16(w: &[f16], out: &mut [f32]) {
            assert_eq!(w.len(), out.len(), "widen_f16: length mismatch");
            // SAFETY: features supported (see above); lengths checked.
            unsafe { widen_f16_impl(w, out) }
        }

        fn float_rows<W: Weight>(w: &[W], x: &[f32], out: &mut [f32; WIDE_ROWS]) {
            assert_eq!(w.len(), WIDE_ROWS * x.len(), "rows: row length mismatch");
            // SAFETY: features supported (see above); lengths checked.
            *out = unsafe { rows_float::<W>(w, x) };
        }

        fn float_rows_many<W: Weight>(w: &[W], xs: &[&[f32]], out: &mut [[f32; WIDE_ROWS]]) {
            let n = xs.first().map_or(0, |x| x.len());
            assert!(
                (1..=$tr).contains(&xs.len())
                    && out.len() == xs.len()
                    && xs.iter().all(|x| x.len() == n)
                    && w.len() == WIDE_ROWS * n,
                "rows: token count or row length mismatch"
            );
            /// The first `T` tokens as an array (the length is checked above).
            fn first<'a, const T: usize>(xs: &'a [&'a [f32]]) -> &'a [&'a [f32]; T] {
                xs.try_into().expect("token count checked")
            }
            match xs.len() {
                1 => {
                    // SAFETY: features supported (see above); lengths checked.
                    out.copy_from_slice(&unsafe { rows_float_tokens::<W, 1>(w, first(xs)) })
                }
                2 => {
                    // SAFETY: features supported (see above); lengths checked.
                    out.copy_from_slice(&unsafe { rows_float_tokens::<W, 2>(w, first(xs)) })
                }
                3 => {
                    // SAFETY: features supported (see above); lengths checked.
                    out.copy_from_slice(&unsafe { rows_float_tokens::<W, 3>(w, first(xs)) })
                }
                4 => {
                    // SAFETY: features supported (see above); lengths checked.
                    out.copy_from_slice(&unsafe { rows_float_tokens::<W, 4>(w, first(xs)) })
                }
                5 => {
                    // SAFETY: features supported (see above); lengths checked.
                    out.copy_from_slice(&unsafe { rows_float_tokens::<W, 5>(w, first(xs)) })
                }
                6 => {
                    // SAFETY: features supported (see above); lengths checked.
                    out.copy_from_slice(&unsafe { rows_float_tokens::<W, 6>(w, first(xs)) })
                }
                7 => {
                    // SAFETY: features supported (see above); lengths checked.
                    out.copy_from_slice(&unsafe { rows_float_tokens::<W, 7>(w, first(xs)) })
                }
                8 => {
                    // SAFETY: features supported (see above); lengths checked.
                    out.copy_from_slice(&unsafe { rows_float_tokens::<W, 8>(w, first(xs)) })
                }
                _ => unreachable!("token count checked"),
            }
        }

        fn quant_tile<W: QBlock, const T: usize>(
            rows: &[&[W]; TILE_ROWS],
            xs: &[&[BlockQ8_0]],
            out: &mut [[f32; TILE_ROWS]],
        ) {
            let xs: &[&[BlockQ8_0]; T] = crate::simd::check_tile(rows, xs, out);
            // SAFETY: features supported (see above); lengths checked.
            let res = unsafe { tile_quant::<W, T>(rows, xs) };
            out.copy_from_slice(&res);
        }

        fn float_dot<W: Weight>(w: &[W], x: &[f32]) -> f32 {
            assert_eq!(w.len(), x.len(), "dot: length mismatch");
            // SAFETY: features supported (see above); lengths checked.
            unsafe { dot_float(w, x) }
        }

        fn quant_dot<W: QBlock>(w: &[W], x: &[BlockQ8_0]) -> f32 {
            assert_eq!(w.len(), x.len(), "dot: block count mismatch");
            // SAFETY: features supported (see above); lengths checked.
            unsafe { dot_quant(w, x) }
        }

        fn quantize_row_q8_0_act(x: &[f32], out: &mut [BlockQ8_0]) {
            assert_eq!(
                x.len(),
                out.len() * kiln_format::QK,
                "quantize_row_q8_0_act: x must hold 32 values per output block"
            );
            // SAFETY: features supported (see above); lengths checked.
            unsafe { quantize_impl(x, out) }
        }

        fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
            assert_eq!(x.len(), y.len(), "axpy: length mismatch");
            // SAFETY: features supported (see above); lengths checked.
            unsafe { axpy_impl(alpha, x, y) }
        }

        fn weighted_sum(probs: &[f32], stride: usize, v: &[f32], width: usize, out: &mut [f32]) {
            crate::shape::weighted_sum_shape(probs, stride, v, width, out);
            // SAFETY: features supported (see above); lengths checked.
            unsafe { weighted_sum_impl(probs, stride, v, width, out) }
        }

        fn weighted_sum_f16(
            probs: &[f32],
            stride: usize,
            v: &[f16],
            width: usize,
            out: &mut [f32],
        ) {
            crate::shape::weighted_sum_shape(probs, stride, v, width, out);
            // SAFETY: features supported (see above); lengths checked.
            unsafe { weighted_sum_f16_impl(probs, stride, v, width, out) }
        }

        fn rmsnorm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
            assert!(
                weight.len() == x.len() && out.len() == x.len(),
                "rmsnorm: length mismatch"
            );
            // SAFETY: features supported (see above); lengths checked.
            unsafe { rmsnorm_impl(x, weight, eps, out) }
        }

        fn silu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
            assert!(
                up.len() == gate.len() && out.len() == gate.len(),
                "silu_mul: length mismatch"
            );
            // SAFETY: features supported (see above); a safe function with no length contract.
            unsafe { silu_mul_impl(gate, up, out) }
        }

        fn gelu_tanh_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
            assert!(
                up.len() == gate.len() && out.len() == gate.len(),
                "gelu_tanh_mul: length mismatch"
            );
            // SAFETY: features supported (see above); a safe function with no length contract.
            unsafe { gelu_tanh_mul_impl(gate, up, out) }
        }

        fn gelu(x: &[f32], out: &mut [f32]) {
            assert!(out.len() == x.len(), "gelu: length mismatch");
            // SAFETY: features supported (see above); a safe function with no length contract.
            unsafe { gelu_impl(x, out) }
        }

        fn softmax_inplace(x: &mut [f32]) {
            // SAFETY: features supported (see above); a safe function with no length contract.
            unsafe { softmax_impl(x) }
        }

        fn exp_sum(x: &mut [f32], shift: f32) -> f32 {
            // SAFETY: features supported (see above); a safe function with no length contract.
            unsafe { exp_sum_impl(x, shift) }
        }

        fn table_for(isa: Isa) -> Kernels {
            Kernels {
                isa,
                dot_f32: float_dot::<f32>,
                axpy,
                weighted_sum,
                weighted_sum_f16,
                dot_f16_f32: float_dot::<f16>,
                dot_bf16_f32: float_dot::<bf16>,
                dot_q8_0_q8_0: quant_dot::<BlockQ8_0>,
                dot_q4_0_q8_0: quant_dot::<BlockQ4_0>,
                rmsnorm,
                silu_mul,
                gelu_tanh_mul,
                gelu,
                softmax_inplace,
                exp_sum,
                quantize_row_q8_0_act,
                decode_bf16: super::avx2_convert::decode_bf16,
                quantize_blocks: super::avx2_convert::quantize_blocks,
                tile_f32: Tile::new(float_tile::<f32, 1>, $tf, float_tile::<f32, $tf>)
                    .with_rows(float_rows::<f32>)
                    .with_rows_many(float_rows_many::<f32>, $tr),
                tile_f16: Tile::new(float_tile::<f16, 1>, $tf, float_tile::<f16, $tf>)
                    .with_rows(float_rows::<f16>)
                    .with_rows_many(float_rows_many::<f16>, $tr),
                tile_bf16: Tile::new(float_tile::<bf16, 1>, $tf, float_tile::<bf16, $tf>)
                    .with_rows(float_rows::<bf16>)
                    .with_rows_many(float_rows_many::<bf16>, $tr),
                tile_q8_0: Tile::new(
                    quant_tile::<BlockQ8_0, 1>,
                    $tq,
                    quant_tile::<BlockQ8_0, $tq>,
                ),
                tile_q4_0: Tile::new(
                    quant_tile::<BlockQ4_0, 1>,
                    $tq,
                    quant_tile::<BlockQ4_0, $tq>,
                ),
                float_lanes: Some(float_lanes),
                widen_f16,
                ..SCALAR_TABLE
            }
        }
    };
}
pub(crate) use isa_entry_points;

// AVX2 has 16 registers: 4 rows × 2 accumulators × 1 token for floats, 4 × 2 tokens for blocks,
// 4 rows × 2 vectors (+ 2 loaded, 1 broadcast) for weighted sums, 4 rows × 2 vectors of tokens
// (+ 2 loaded, 1 broadcast) for float lanes.
isa_entry_points!("avx2,fma,f16c", Avx2, 1, 2, 2, 4, 2, 4);

fn lanes_tile(
    codes: &[&[u8]; TILE_ROWS],
    dw: &[&[f32]; TILE_ROWS],
    max_code: u8,
    x0: &[crate::lanes::LaneBlock],
    x1: Option<&[crate::lanes::LaneBlock]>,
    acc: &mut crate::lanes::LanesAcc,
) {
    crate::lanes::check_lanes_tile(codes, dw, x0, x1);
    // SAFETY: this tier's table, the only way here, is handed out only when the CPU has the
    // tier's features (`crate::kernels`); lengths checked.
    unsafe {
        match x1 {
            Some(x1) => super::avx2_lanes::tile::<2>(codes, dw, max_code, [x0, x1], acc),
            None => super::avx2_lanes::tile::<1>(codes, dw, max_code, [x0], acc),
        }
    }
}

fn klanes_tile(
    kind: crate::klanes::KKind,
    rows: &[&crate::klanes::KLaneRow; TILE_ROWS],
    x0: &crate::klanes::KLaneBlock,
    x1: Option<&crate::klanes::KLaneBlock>,
    acc: &mut crate::lanes::LanesAcc,
) {
    // SAFETY: this tier's table, the only way here, is handed out only when the CPU has the
    // tier's features (`crate::kernels`); the layouts are fixed-size types.
    unsafe { super::avx2_klanes::ktile(kind, rows, x0, x1, acc) }
}

fn quantize_row_q8_k_act(x: &[f32], out: &mut [kiln_format::BlockQ8K]) {
    assert_eq!(
        x.len(),
        out.len() * kiln_format::QK_K,
        "quantize_row_q8_k_act: length mismatch"
    );
    // SAFETY: this tier's table, the only way here, is handed out only when the CPU has the
    // tier's features (`crate::kernels`); lengths checked.
    unsafe { super::q8k::quantize_avx2(x, out) }
}

/// This tier's table; [`crate::kernels`] only calls it when the CPU supports the tier.
/// The AVX2 kernel for interleaved IQ4_NL rows, which the AVX-512 tier runs too (it has none
/// of its own for the layout yet: one would take offset grid codes into `vpdpbusd`).
pub(crate) fn group_iq4_nlx16() -> crate::interleaved::Group {
    super::group_kernel!("avx2,fma,f16c", avx2_group_iq4)
}

/// The same for interleaved IQ4_XS rows against Q8_K activations.
pub(crate) fn group_iq4_xsx16(
) -> crate::interleaved::Group<kiln_format::BlockIQ4XSx16, kiln_format::BlockQ8K> {
    super::group_kernel!(
        "avx2,fma,f16c",
        avx2_group_iq4xs,
        kiln_format::BlockIQ4XSx16,
        kiln_format::BlockQ8K
    )
}

/// Tokens per multi-token Q5 or K-quant tile: this tier's 16 registers, in which a K-quant
/// block (or eight Q5 blocks) stays unpacked across the tile's tokens.
const KQ_TOKENS: usize = 2;

/// This tier's Q5 and K-quant tiles: [`super::kquant`]'s, with [`avx2_rows`]' one-token
/// kernels for sixteen Q2_K, Q3_K, IQ4_NL or IQ4_XS rows.
const KQ_TILES: KTiles = KTiles {
    q5_0: Tile::new(
        ktiles::q5_0_tile_avx2::<1>,
        KQ_TOKENS,
        ktiles::q5_0_tile_avx2::<KQ_TOKENS>,
    )
    .with_rows(ktiles::rows::q5_0_tile_avx2),
    q5_1: Tile::new(
        ktiles::q5_1_tile_avx2::<1>,
        KQ_TOKENS,
        ktiles::q5_1_tile_avx2::<KQ_TOKENS>,
    )
    .with_rows(ktiles::rows::q5_1_tile_avx2),
    q4_k: Tile::new(
        ktiles::q4_k_tile_avx2::<1>,
        KQ_TOKENS,
        ktiles::q4_k_tile_avx2::<KQ_TOKENS>,
    )
    .with_rows(ktiles::rows::q4_k_tile_avx2),
    q5_k: Tile::new(
        ktiles::q5_k_tile_avx2::<1>,
        KQ_TOKENS,
        ktiles::q5_k_tile_avx2::<KQ_TOKENS>,
    )
    .with_rows(ktiles::rows::q5_k_tile_avx2),
    q6_k: Tile::new(
        ktiles::q6_k_tile_avx2::<1>,
        KQ_TOKENS,
        ktiles::q6_k_tile_avx2::<KQ_TOKENS>,
    )
    .with_rows(ktiles::rows::q6_k_tile_avx2),
    q2_k: Tile::new(
        ktiles::q2_k_tile_avx2::<1>,
        KQ_TOKENS,
        ktiles::q2_k_tile_avx2::<KQ_TOKENS>,
    )
    .with_rows(avx2_rows::q2_k),
    q3_k: Tile::new(
        ktiles::q3_k_tile_avx2::<1>,
        KQ_TOKENS,
        ktiles::q3_k_tile_avx2::<KQ_TOKENS>,
    )
    .with_rows(avx2_rows::q3_k),
    iq4_nl: Tile::new(
        ktiles::iq4_nl_tile_avx2::<1>,
        KQ_TOKENS,
        ktiles::iq4_nl_tile_avx2::<KQ_TOKENS>,
    )
    .with_rows(avx2_rows::iq4_nl),
    iq4_xs: Tile::new(
        ktiles::iq4_xs_tile_avx2::<1>,
        KQ_TOKENS,
        ktiles::iq4_xs_tile_avx2::<KQ_TOKENS>,
    )
    .with_rows(avx2_rows::iq4_xs),
};

pub(crate) fn table() -> &'static Kernels {
    static TABLE: std::sync::OnceLock<Kernels> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| Kernels {
        group_q4_0x16: Some(super::group_kernel!("avx2,fma,f16c", avx2_group)),
        group_iq4_nlx16: Some(group_iq4_nlx16()),
        group_iq4_xsx16: Some(group_iq4_xsx16()),
        lanes: Some(lanes_tile),
        klanes: Some(klanes_tile),
        quantize_row_q8_k_act,
        kq: KQ_TILES,
        ..table_for(Isa::Avx2)
    })
}
