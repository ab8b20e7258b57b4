//! Properties of the block quantizers, per (dtype × method) — the documented error bounds.
//!
//! Reference method, every element of `dequantize(quantize(x))` is within:
//! - Q8_0: half a step, `d/2`, plus the f16 rounding of the scale, `127·|d − f16(d)|`;
//! - Q4_0: half a step, or one step for a value that clips at +7 opposite the extreme, plus
//!   `8·|d − f16(d)|`.
//!
//! Both methods: exactly representable blocks (integer codes times a power-of-two scale)
//! round-trip exactly, an all-zero block gets a zero scale, and the search method is never
//! worse than the reference on any block (weighted by the importance weights when given).

use kiln_format::blocks::{
    dequantize_block_q4_0, dequantize_block_q8_0, quantize_block_q4_0_ref, quantize_block_q8_0_ref,
    QK,
};
use kiln_quantize::method::{quantize_block_q4_0, quantize_block_q8_0, Method};
use proptest::prelude::*;

const METHODS: [Method; 2] = [Method::Reference, Method::Search];

/// Slack for the f32 arithmetic of the bound itself, relative to the scale.
const BOUND_SLACK: f32 = 1e-6;

/// A block of values spread over many magnitudes (10^-6 .. 10^4).
fn block() -> impl Strategy<Value = [f32; QK]> {
    (prop::collection::vec(-1.0f32..1.0, QK), -6i32..4).prop_map(|(v, e)| {
        let s = 10f32.powi(e);
        let mut b = [0.0f32; QK];
        for (o, x) in b.iter_mut().zip(v) {
            *o = x * s;
        }
        b
    })
}

fn weights() -> impl Strategy<Value = [f32; QK]> {
    prop::collection::vec(0.0f32..4.0, QK).prop_map(|v| v.try_into().unwrap())
}

fn deq8(b: &kiln_format::BlockQ8_0) -> [f32; QK] {
    let mut y = [0.0; QK];
    dequantize_block_q8_0(b, &mut y);
    y
}

fn deq4(b: &kiln_format::BlockQ4_0) -> [f32; QK] {
    let mut y = [0.0; QK];
    dequantize_block_q4_0(b, &mut y);
    y
}

fn sq_err(x: &[f32; QK], y: &[f32; QK], w: Option<&[f32; QK]>) -> f64 {
    (0..QK)
        .map(|j| {
            let e = f64::from(x[j] - y[j]);
            f64::from(w.map_or(1.0, |w| w[j])) * e * e
        })
        .sum()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn reference_equals_the_format_crate_spec(x in block()) {
        prop_assert_eq!(quantize_block_q8_0(Method::Reference, &x, None), quantize_block_q8_0_ref(&x));
        prop_assert_eq!(quantize_block_q4_0(Method::Reference, &x, None), quantize_block_q4_0_ref(&x));
    }

    #[test]
    fn q8_0_reference_within_half_a_step(x in block()) {
        let b = quantize_block_q8_0(Method::Reference, &x, None);
        let y = deq8(&b);
        let d = x.iter().fold(0.0f32, |m, v| m.max(v.abs())) / 127.0;
        let dh = b.d.to_f32();
        let bound = 0.5 * d + 127.0 * (d - dh).abs() + BOUND_SLACK * d;
        for j in 0..QK {
            prop_assert!((x[j] - y[j]).abs() <= bound, "j={} x={} y={} d={}", j, x[j], y[j], d);
        }
    }

    #[test]
    fn q4_0_reference_within_half_a_step_or_one_at_the_clip(x in block()) {
        let b = quantize_block_q4_0(Method::Reference, &x, None);
        let y = deq4(&b);
        let mut max = 0.0f32;
        for &v in &x {
            if max.abs() < v.abs() {
                max = v;
            }
        }
        let d = (max / -8.0).abs();
        let dh = b.d.to_f32().abs();
        for j in 0..QK {
            let steps = if b.code(j) == 7 { 1.0 } else { 0.5 };
            let bound = steps * d + 8.0 * (d - dh).abs() + BOUND_SLACK * d;
            prop_assert!((x[j] - y[j]).abs() <= bound, "j={} x={} y={} d={}", j, x[j], y[j], d);
        }
    }

    #[test]
    fn search_is_never_worse_than_reference(x in block(), w in weights(), weighted in any::<bool>()) {
        let w = weighted.then_some(&w);
        let r8 = sq_err(&x, &deq8(&quantize_block_q8_0(Method::Reference, &x, None)), w);
        let s8 = sq_err(&x, &deq8(&quantize_block_q8_0(Method::Search, &x, w)), w);
        // The search compares in f32; allow its rounding in the f64 recomputation.
        prop_assert!(s8 <= r8 * (1.0 + 1e-5) + 1e-30, "q8_0 search {} > reference {}", s8, r8);
        let r4 = sq_err(&x, &deq4(&quantize_block_q4_0(Method::Reference, &x, None)), w);
        let s4 = sq_err(&x, &deq4(&quantize_block_q4_0(Method::Search, &x, w)), w);
        prop_assert!(s4 <= r4 * (1.0 + 1e-5) + 1e-30, "q4_0 search {} > reference {}", s4, r4);
    }

    #[test]
    fn exactly_representable_blocks_round_trip_exactly(
        codes in prop::collection::vec(-7i32..=7, QK),
        at in 0usize..QK,
        e in -20i32..10,
    ) {
        let scale = 2f32.powi(e);
        // Q4_0: the extreme is -8·scale so the reference scale is exactly `scale`.
        let mut x4 = [0.0f32; QK];
        for j in 0..QK {
            x4[j] = codes[j] as f32 * scale;
        }
        x4[at] = -8.0 * scale;
        // Q8_0: codes in -127..=127 with one at ±127 (d = scale exactly).
        let mut x8 = [0.0f32; QK];
        for j in 0..QK {
            x8[j] = (codes[j] * 18) as f32 * scale;
        }
        x8[at] = if e % 2 == 0 { 127.0 } else { -127.0 } * scale;
        for m in METHODS {
            prop_assert_eq!(deq4(&quantize_block_q4_0(m, &x4, None)), x4, "{}", m);
            prop_assert_eq!(deq8(&quantize_block_q8_0(m, &x8, None)), x8, "{}", m);
        }
    }
}

#[test]
fn all_zero_block_has_zero_scale_for_every_method() {
    let z = [0.0f32; QK];
    for m in METHODS {
        let b8 = quantize_block_q8_0(m, &z, None);
        assert_eq!(b8.d.to_f32(), 0.0, "{m}");
        assert_eq!(deq8(&b8), z);
        let b4 = quantize_block_q4_0(m, &z, Some(&[1.0; QK]));
        assert_eq!(b4.d.to_f32(), 0.0, "{m}");
        assert_eq!(deq4(&b4), z);
    }
}

/// The search helps on average: it must cut the total squared error on Gaussian data (the
/// point of the option), here by at least 5% for Q4_0.
#[test]
fn search_reduces_total_q4_0_error_on_gaussian_blocks() {
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = || {
        // xorshift64* then Box-Muller: a deterministic normal sample without a dependency.
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        (state.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 40) as f32 / (1u64 << 24) as f32
    };
    let (mut r, mut s) = (0.0f64, 0.0f64);
    for _ in 0..2000 {
        let mut x = [0.0f32; QK];
        for v in x.iter_mut() {
            let (u1, u2) = (next().max(1e-7), next());
            *v = (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos();
        }
        r += sq_err(
            &x,
            &deq4(&quantize_block_q4_0(Method::Reference, &x, None)),
            None,
        );
        s += sq_err(
            &x,
            &deq4(&quantize_block_q4_0(Method::Search, &x, None)),
            None,
        );
    }
    assert!(s < 0.95 * r, "search {s} vs reference {r}");
    eprintln!("q4_0 squared error: search / reference = {:.3}", s / r);
}
