//! Every supported ISA tier against the scalar reference kernels, on odd lengths, tails and
//! unaligned slices.
//!
//! Metric: `|got − reference| / Σ|w_i·x_i|` (relative to the sum of absolute products, so that
//! cancellation in the result does not inflate the error). Both the reference and a SIMD
//! kernel are recursive/blocked float sums, each within `n·ε·Σ|w·x|` of the exact value, so
//! they agree within `2·n·ε` (`FLOAT_SUM_TERMS_TOL` per term).

use half::{bf16, f16};
use kiln_kernels::reference as r;
use kiln_kernels::{kernels, supported_isas, tested_isas, BlockQ4_0, BlockQ8_0, Isa, Kernels, QK};
use proptest::prelude::*;

/// Allowed relative error per summed term (two independent sums, each `n·ε`).
const FLOAT_SUM_TERMS_TOL: f32 = 2.0 * f32::EPSILON;
/// Extra terms for the quantized dots: each block partial is rounded up to three times
/// (lane conversion, scale product, FMA) in one order and twice in the other.
const QUANT_BLOCK_ROUNDINGS: f32 = 4.0;

/// Every tier tested here ([`tested_isas`]: fails if `KILN_EXPECT_TIERS` names one this CPU
/// lacks), each with its table.
fn tiers() -> Vec<&'static Kernels> {
    tested_isas()
        .into_iter()
        .map(|i| kernels(i).expect("a supported tier has a table"))
        .collect()
}

fn within(got: f32, want: f32, abs_sum: f32, terms: f32, what: &str, isa: Isa) {
    let tol = FLOAT_SUM_TERMS_TOL * terms * abs_sum + f32::MIN_POSITIVE;
    assert!(
        (got - want).abs() <= tol,
        "{what} at {isa:?}: got {got}, reference {want}, |diff| {} > tol {tol}",
        (got - want).abs()
    );
}

/// `Σ|w_j·x_j|` of one Q8_0 block pair's codes.
fn abs_isum_q8_0(w: &BlockQ8_0, x: &BlockQ8_0) -> f32 {
    w.qs.iter()
        .zip(&x.qs)
        .map(|(&a, &b)| (a as i32 * b as i32).abs())
        .sum::<i32>() as f32
}

/// `Σ|w_j·x_j|` of a Q4_0 block's codes (`q − 8`) against a Q8_0 block's.
fn abs_isum_q4_0(w: &BlockQ4_0, x: &BlockQ8_0) -> f32 {
    (0..QK / 2)
        .map(|j| {
            let lo = (w.qs[j] & 0x0f) as i32 - 8;
            let hi = (w.qs[j] >> 4) as i32 - 8;
            (lo * x.qs[j] as i32).abs() + (hi * x.qs[j + QK / 2] as i32).abs()
        })
        .sum::<i32>() as f32
}

fn vecf(max_len: usize) -> impl Strategy<Value = Vec<f32>> {
    prop::collection::vec(-4.0f32..4.0, 0..max_len)
}

fn q8_blocks(x: &[f32]) -> Vec<BlockQ8_0> {
    kiln_format::blocks::quantize_row_q8_0_ref(x).unwrap()
}

fn q4_blocks(x: &[f32]) -> Vec<BlockQ4_0> {
    kiln_format::blocks::quantize_row_q4_0_ref(x).unwrap()
}

#[test]
fn scalar_tier_is_always_supported_and_first() {
    assert_eq!(supported_isas()[0], Isa::Scalar);
    assert!(kernels(Isa::Scalar).is_some());
    assert!(kernels(Isa::Neon).is_none() || cfg!(target_arch = "aarch64"));
}

#[test]
fn isa_names_round_trip() {
    for i in [Isa::Scalar, Isa::Avx2, Isa::Avx512, Isa::Neon] {
        assert_eq!(Isa::from_name(i.name()), Some(i));
    }
    assert_eq!(Isa::from_name("sse9"), None);
}

#[test]
fn dispatched_tier_is_supported() {
    assert!(kiln_kernels::isa().is_supported());
    assert!(kiln_kernels::isa() <= kiln_kernels::best_isa());
}

/// Worst cases for the integer paths: activation codes at ±127, weight codes at ±127 and -128
/// (GGUF files may hold -128; no i16 saturation and no wrong sign on any tier).
#[test]
fn q8_0_extreme_codes_are_exact() {
    let w = vec![
        BlockQ8_0 {
            d: f16::ONE,
            qs: [127; QK],
        },
        BlockQ8_0 {
            d: f16::ONE,
            qs: [-127; QK],
        },
    ];
    let x = vec![
        BlockQ8_0 {
            d: f16::ONE,
            qs: [-127; QK],
        },
        BlockQ8_0 {
            d: f16::ONE,
            qs: [-127; QK],
        },
    ];
    let w128 = vec![BlockQ8_0 {
        d: f16::ONE,
        qs: [-128; QK],
    }];
    let x127 = vec![BlockQ8_0 {
        d: f16::ONE,
        qs: [127; QK],
    }];
    for k in tiers() {
        assert_eq!(
            k.dot_q8_0_q8_0(&w128, &x[..1]),
            32.0 * 128.0 * 127.0,
            "{:?}",
            k.isa()
        );
        assert_eq!(
            k.dot_q8_0_q8_0(&w128, &x127),
            -32.0 * 128.0 * 127.0,
            "{:?}",
            k.isa()
        );
        assert_eq!(k.dot_q8_0_q8_0(&w, &x), 0.0, "{:?}", k.isa());
        assert_eq!(
            k.dot_q8_0_q8_0(&w[..1], &x[..1]),
            -516128.0,
            "{:?}",
            k.isa()
        );
    }
    // Low nibbles 15 (code +7, weights 0..16), high nibbles 0 (code -8, weights 16..32).
    let w4 = vec![BlockQ4_0 {
        d: f16::ONE,
        qs: [0x0f; QK / 2],
    }];
    for k in tiers() {
        let got = k.dot_q4_0_q8_0(&w4, &x[..1]);
        assert_eq!(
            got,
            16.0 * 7.0 * -127.0 + 16.0 * -8.0 * -127.0,
            "{:?}",
            k.isa()
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn dot_f32_matches_reference(a in vecf(300), off in 0usize..4) {
        let b: Vec<f32> = a.iter().map(|v| v * 0.7 - 0.1).collect();
        let off = off.min(a.len());
        let (a, b) = (&a[off..], &b[off..]);
        let want = r::dot_f32_ref(a, b);
        let abs: f32 = a.iter().zip(b).map(|(x, y)| (x * y).abs()).sum();
        for k in tiers() {
            within(k.dot_f32(a, b), want, abs, a.len() as f32, "dot_f32", k.isa());
        }
    }

    /// Widening f16 to f32 is exact: every tier gives the reference's bits, NaN and infinity
    /// and subnormals included, on unaligned slices with tails.
    #[test]
    fn widen_f16_is_exact_in_every_tier(bits in prop::collection::vec(any::<u16>(), 0..300), off in 0usize..4) {
        let w: Vec<f16> = bits.iter().map(|&b| f16::from_bits(b)).collect();
        let w = &w[off.min(w.len())..];
        let mut want = vec![0.0f32; w.len()];
        r::widen_f16_ref(w, &mut want);
        for k in tiers() {
            let mut got = vec![1.5f32; w.len()];
            k.widen_f16(w, &mut got);
            for (i, (g, e)) in got.iter().zip(&want).enumerate() {
                prop_assert!(
                    g.to_bits() == e.to_bits() || (g.is_nan() && e.is_nan()),
                    "{:?} widen_f16[{}]: {} vs {}", k.isa(), i, g, e
                );
            }
        }
    }

    #[test]
    fn dot_f16_and_bf16_match_reference(x in vecf(300), off in 0usize..4) {
        let off = off.min(x.len());
        let wh: Vec<f16> = x.iter().map(|v| f16::from_f32(v * 1.3)).collect();
        let wb: Vec<bf16> = x.iter().map(|v| bf16::from_f32(v * 1.3)).collect();
        let (x, wh, wb) = (&x[off..], &wh[off..], &wb[off..]);
        let n = x.len() as f32;
        let abs_h: f32 = wh.iter().zip(x).map(|(w, x)| (w.to_f32() * x).abs()).sum();
        let abs_b: f32 = wb.iter().zip(x).map(|(w, x)| (w.to_f32() * x).abs()).sum();
        let want_h = r::dot_f16_f32_ref(wh, x);
        let want_b = r::dot_bf16_f32_ref(wb, x);
        for k in tiers() {
            within(k.dot_f16_f32(wh, x), want_h, abs_h, n, "dot_f16_f32", k.isa());
            within(k.dot_bf16_f32(wb, x), want_b, abs_b, n, "dot_bf16_f32", k.isa());
        }
    }

    #[test]
    fn quantized_dots_match_reference(nb in 0usize..40, seed in any::<u64>(), off in 0usize..3) {
        let mut s = seed;
        let mut next = || { s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407); ((s >> 40) as f32 / (1u64 << 24) as f32) * 8.0 - 4.0 };
        let w: Vec<f32> = (0..(nb + off) * QK).map(|_| next()).collect();
        let x: Vec<f32> = (0..(nb + off) * QK).map(|_| next()).collect();
        let (w8, w4, xq) = (q8_blocks(&w), q4_blocks(&w), q8_blocks(&x));
        // Unaligned block slices: start `off` blocks in (blocks are 34 or 18 bytes).
        let (w8, w4, xq) = (&w8[off..], &w4[off..], &xq[off..]);
        // Σ|w_j·x_j| over every element (not |Σ| per block: a kernel's partial sums inside a
        // block cancel too, and its rounding is relative to them).
        let abs8: f32 = w8.iter().zip(xq).map(|(a, b)| abs_isum_q8_0(a, b) * (a.d.to_f32() * b.d.to_f32()).abs()).sum();
        let abs4: f32 = w4.iter().zip(xq).map(|(a, b)| abs_isum_q4_0(a, b) * (a.d.to_f32() * b.d.to_f32()).abs()).sum();
        let terms = nb as f32 + QUANT_BLOCK_ROUNDINGS;
        let want8 = r::dot_q8_0_q8_0_ref(w8, xq);
        let want4 = r::dot_q4_0_q8_0_ref(w4, xq);
        for k in tiers() {
            within(k.dot_q8_0_q8_0(w8, xq), want8, abs8, terms, "dot_q8_0_q8_0", k.isa());
            within(k.dot_q4_0_q8_0(w4, xq), want4, abs4, terms, "dot_q4_0_q8_0", k.isa());
        }
    }

    /// Activation quantization is bit-identical to the reference on every tier.
    #[test]
    fn quantize_act_is_bit_exact(nb in 0usize..20, scale in 1e-3f32..1e3, seed in any::<u64>()) {
        let mut s = seed;
        let x: Vec<f32> = (0..nb * QK).map(|i| { s = s.wrapping_mul(6364136223846793005).wrapping_add(1); ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * scale * if i % 7 == 0 { 0.0 } else { 1.0 } }).collect();
        let mut want = vec![BlockQ8_0 { d: f16::ZERO, qs: [0; QK] }; nb];
        r::quantize_row_q8_0_act_ref(&x, &mut want);
        for k in tiers() {
            let mut got = want.clone();
            got.iter_mut().for_each(|b| b.qs = [99; QK]);
            k.quantize_row_q8_0_act(&x, &mut got);
            prop_assert_eq!(&got, &want, "{:?}", k.isa());
        }
    }

    #[test]
    fn axpy_rmsnorm_softmax_silu_gelu_match_reference(x in vecf(200), alpha in -2.0f32..2.0) {
        let y0: Vec<f32> = x.iter().map(|v| v * 0.5 + 0.25).collect();
        let mut want = y0.clone();
        r::axpy_ref(alpha, &x, &mut want);
        let wt: Vec<f32> = x.iter().map(|v| 1.0 + v * 0.1).collect();
        let mut want_norm = vec![0.0; x.len()];
        r::rmsnorm_ref(&x, &wt, 1e-5, &mut want_norm);
        let mut want_sm = x.clone();
        r::softmax_inplace_ref(&mut want_sm);
        let mut want_silu = vec![0.0; x.len()];
        r::silu_mul_ref(&x, &y0, &mut want_silu);
        let mut want_gelu = vec![0.0; x.len()];
        r::gelu_tanh_mul_ref(&x, &y0, &mut want_gelu);
        for k in tiers() {
            let mut got = y0.clone();
            k.axpy(alpha, &x, &mut got);
            // One FMA vs a multiply and an add: within one rounding of each term.
            for ((g, w), (xi, yi)) in got.iter().zip(&want).zip(x.iter().zip(&y0)) {
                within(*g, *w, (alpha * xi).abs() + yi.abs(), 1.0, "axpy", k.isa());
            }
            let mut got = vec![0.0; x.len()];
            k.rmsnorm(&x, &wt, 1e-5, &mut got);
            // The mean square's order differs: relative error in the scale <= n·ε.
            for (g, w) in got.iter().zip(&want_norm) {
                within(*g, *w, w.abs(), x.len() as f32 + 2.0, "rmsnorm", k.isa());
            }
            let mut got = x.clone();
            k.softmax_inplace(&mut got);
            for (g, w) in got.iter().zip(&want_sm) {
                within(*g, *w, 1.0, x.len() as f32 + 8.0, "softmax", k.isa());
            }
            // Against a shift at, above and below the maximum (an online softmax's running
            // maximum can be any of these); each term within a few ulp, the sum within n.
            let max = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
            for shift in [max, max + 3.0 * alpha.abs(), max - 1.5 * alpha.abs()] {
                let mut want_e = x.clone();
                let want_sum = r::exp_sum_ref(&mut want_e, shift);
                let mut got = x.clone();
                let sum = k.exp_sum(&mut got, shift);
                for (g, w) in got.iter().zip(&want_e) {
                    within(*g, *w, w.abs(), 8.0, "exp_sum", k.isa());
                }
                within(sum, want_sum, want_sum, x.len() as f32 + 8.0, "exp_sum total", k.isa());
            }
            let mut got = vec![0.0; x.len()];
            k.silu_mul(&x, &y0, &mut got);
            for (g, w) in got.iter().zip(&want_silu) {
                within(*g, *w, w.abs(), 8.0, "silu_mul", k.isa());
            }
            let mut want_erf = vec![0.0; x.len()];
            r::gelu_ref(&x, &mut want_erf);
            let mut got = vec![0.0; x.len()];
            k.gelu(&x, &mut got);
            for ((g, w), xi) in got.iter().zip(&want_erf).zip(&x) {
                within(*g, *w, xi.abs(), 8.0, "gelu", k.isa());
            }
            // Relative to |gate·up|: where tanh is near -1 the reference's `1 + tanh` cancels.
            let mut got = vec![0.0; x.len()];
            k.gelu_tanh_mul(&x, &y0, &mut got);
            for ((g, w), (xi, yi)) in got.iter().zip(&want_gelu).zip(x.iter().zip(&y0)) {
                within(*g, *w, (xi * yi).abs(), 8.0, "gelu_tanh_mul", k.isa());
            }
        }
    }
}

/// The weighted sum as the attention code used to compute it: per row, `axpy` of each value
/// row in order into a zeroed row.
fn axpy_sequence(
    axpy: impl Fn(f32, &[f32], &mut [f32]),
    probs: &[f32],
    stride: usize,
    v: &[f32],
    width: usize,
    rows: usize,
) -> Vec<f32> {
    let mut out = vec![0.0; rows * width];
    for (r, o) in out.chunks_exact_mut(width).enumerate() {
        for (j, vj) in v.chunks_exact(width).enumerate() {
            axpy(probs[r * stride + j], vj, o);
        }
    }
    out
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    /// Every tier's `weighted_sum` has the bits of its own `axpy` over the keys in order (FMA
    /// on full vectors, multiply and add on the tail), and the reference has `axpy_ref`'s: on
    /// widths with and without vector tails, no keys to many, one to five rows, strides
    /// longer than the keys, unaligned slices and a `probs` no longer than the rows need.
    #[test]
    fn weighted_sum_is_bitwise_its_tiers_axpy_sequence(
        width in 1usize..=130,
        keys in 0usize..=40,
        rows in 1usize..=5,
        pad in 0usize..3,
        off in 0usize..4,
        seed in any::<u64>(),
    ) {
        let stride = keys + pad;
        let mut s = seed;
        let mut next = || { s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407); (s >> 40) as f32 / (1u64 << 24) as f32 };
        let p_all: Vec<f32> = (0..off + (rows - 1) * stride + keys).map(|_| next()).collect();
        let v_all: Vec<f32> = (0..off + keys * width).map(|_| next() * 8.0 - 4.0).collect();
        let (probs, v) = (&p_all[off..], &v_all[off..]);
        // NaN-filled, so that an element a kernel fails to overwrite shows.
        let mut got_all = vec![f32::NAN; off + rows * width];
        let got = &mut got_all[off..];
        r::weighted_sum_ref(probs, stride, v, width, got);
        let want = axpy_sequence(r::axpy_ref, probs, stride, v, width, rows);
        prop_assert_eq!(bits(got), bits(&want), "reference");
        for k in tiers() {
            let want = axpy_sequence(|a, x, y| k.axpy(a, x, y), probs, stride, v, width, rows);
            got.fill(f32::NAN);
            k.weighted_sum(probs, stride, v, width, got);
            prop_assert_eq!(bits(got), bits(&want), "{:?}", k.isa());
        }
        // Over f16 values: the bits of the f32 kernel over the widened values, in each tier
        // and the reference.
        let v16: Vec<f16> = v.iter().map(|&x| f16::from_f32(x)).collect();
        let widened: Vec<f32> = v16.iter().map(|x| x.to_f32()).collect();
        let mut want = vec![0f32; rows * width];
        r::weighted_sum_ref(probs, stride, &widened, width, &mut want);
        got.fill(f32::NAN);
        r::weighted_sum_f16_ref(probs, stride, &v16, width, got);
        prop_assert_eq!(bits(got), bits(&want), "f16 reference");
        for k in tiers() {
            k.weighted_sum(probs, stride, &widened, width, &mut want);
            got.fill(f32::NAN);
            k.weighted_sum_f16(probs, stride, &v16, width, got);
            prop_assert_eq!(bits(got), bits(&want), "f16 {:?}", k.isa());
        }
    }
}

#[test]
#[should_panic(expected = "weighted_sum: probs too short")]
fn weighted_sum_short_probs_panics() {
    // Two rows of three keys at stride 4 need 4 + 3 probabilities.
    let mut out = [0.0; 2 * 5];
    kiln_kernels::weighted_sum(&[0.5; 6], 4, &[1.0; 3 * 5], 5, &mut out);
}

#[test]
#[should_panic(expected = "weighted_sum: out is not a whole number of rows")]
fn weighted_sum_ragged_out_panics() {
    let mut out = [0.0; 7];
    kiln_kernels::weighted_sum(&[0.5; 8], 4, &[1.0; 3 * 5], 5, &mut out);
}

/// Ties round away from zero on every tier (`f32::round`, GGML's reference), not to even.
#[test]
fn quantize_act_rounds_half_away_from_zero() {
    let mut x = [0.0f32; QK];
    x[0] = 127.0; // d = 1, 1/d = 1: codes are round(x)
    let ties = [
        0.5,
        -0.5,
        1.5,
        -1.5,
        2.5,
        -2.5,
        126.5,
        -126.5,
        0.49999997,
        -0.49999997,
    ];
    x[1..=ties.len()].copy_from_slice(&ties);
    let want: Vec<i8> = x.iter().map(|v| v.round() as i8).collect();
    assert_eq!(&want[1..7], &[1, -1, 2, -2, 3, -3]);
    for k in tiers() {
        let mut out = [BlockQ8_0 {
            d: f16::ZERO,
            qs: [0; QK],
        }];
        k.quantize_row_q8_0_act(&x, &mut out);
        assert_eq!(out[0].d, f16::ONE, "{:?}", k.isa());
        assert_eq!(out[0].qs.to_vec(), want, "{:?}", k.isa());
    }
}

/// Scales below f16's normal range (tiny activations) round like `half::f16::from_f32`.
#[test]
fn quantize_act_subnormal_scale_is_bit_exact() {
    for amax in [1e-9f32, 3e-7, 6.1e-5 * 127.0, 1e-4] {
        let x: Vec<f32> = (0..QK).map(|i| amax * (i as f32 - 15.0) / 16.0).collect();
        let mut want = [BlockQ8_0 {
            d: f16::ZERO,
            qs: [0; QK],
        }];
        r::quantize_row_q8_0_act_ref(&x, &mut want);
        for k in tiers() {
            let mut got = [BlockQ8_0 {
                d: f16::ONE,
                qs: [1; QK],
            }];
            k.quantize_row_q8_0_act(&x, &mut got);
            assert_eq!(got, want, "{:?} amax {amax}", k.isa());
        }
    }
}

#[test]
#[should_panic(expected = "length mismatch")]
fn dot_length_mismatch_panics() {
    kiln_kernels::dot_f32(&[1.0, 2.0], &[1.0]);
}

#[test]
#[should_panic(expected = "32 values per output block")]
fn quantize_length_mismatch_panics() {
    let mut out = vec![
        BlockQ8_0 {
            d: f16::ZERO,
            qs: [0; QK]
        };
        1
    ];
    kiln_kernels::quantize_row_q8_0_act(&[0.0; 31], &mut out);
}

/// On aarch64 the NEON tier is detected and dispatched (so the tier tests above cover it).
#[cfg(target_arch = "aarch64")]
#[test]
fn neon_is_the_best_tier_on_aarch64() {
    assert_eq!(kiln_kernels::best_isa(), Isa::Neon);
    assert_eq!(kernels(Isa::Neon).map(|k| k.isa()), Some(Isa::Neon));
}

/// The exact GELU of every tier, over a fine sweep of `[-20, 20]` and the extremes: within a
/// few roundings of `|x|` of the reference (f64 libm `erf`), and, for large negative `x`
/// where the value is a tail probability, within `10⁻⁶ + 10⁻⁷·x²` relative of it (the square's
/// rounding) where it is a normal f32.
#[test]
fn gelu_tracks_the_reference_over_its_range() {
    let mut x: Vec<f32> = (-20_000..=20_000).map(|i| i as f32 * 1e-3).collect();
    x.extend([f32::MAX, -f32::MAX, 1e-30, -1e-30, 0.0, -0.0, 1e6, -1e6]);
    let mut want = vec![0.0; x.len()];
    r::gelu_ref(&x, &mut want);
    for k in tiers() {
        let mut got = vec![0.0; x.len()];
        k.gelu(&x, &mut got);
        for ((&g, &w), &xi) in got.iter().zip(&want).zip(&x) {
            within(g, w, xi.abs(), 8.0, "gelu", k.isa());
            if xi < -1.0 && w.abs() > 1e-30 {
                // The tail's relative error grows with x² from the rounding of x²/2 in f32.
                let rel = ((g - w) / w).abs();
                let bound = 1e-6 + 1e-7 * xi * xi;
                assert!(
                    rel < bound,
                    "gelu({xi}) at {:?}: {g} vs {w} ({rel:e} relative)",
                    k.isa()
                );
            }
        }
    }
}
