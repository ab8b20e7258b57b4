//! `exp` as a short polynomial, and the SiLU, tanh-GELU and softmax built on it: branch-free
//! code that the compiler turns into vector instructions when a SIMD tier compiles it (16 lanes
//! under AVX-512), where the reference's libm `expf`/`tanhf` is a scalar call per element.
//!
//! [`exp`] is Cephes' `expf` scheme: `x = n·ln 2 + r` with `|r| ≤ ln 2 / 2` (`n` rounded to
//! nearest by the `1.5·2^23` trick, `ln 2` split in two so that `r` is exact), `e^r` as a
//! degree-7 polynomial, and `2^n` put into the exponent bits. Inputs are clamped to
//! `[-87.3, 88]`, where `2^n` is a normal f32 (its exponent taken from the rounded value's bits,
//! not through a float-to-integer conversion). Against libm, on every 97th f32 of that range: at
//! most 1 unit in the last place (the test allows 2). Plain multiplies and adds, no FMA, so
//! every tier that compiles it gets the same bits.

/// Elements each step of the element-wise functions below takes: four AVX2 vectors (two
/// AVX-512 ones).
///
/// Why: each function is one long chain of dependent multiplies and adds (exact GELU's:
/// two polynomials, a division and the exponent). Written an element at a time, the compiler
/// makes one vector of it per iteration, and the out-of-order window holds only two or three
/// iterations' chains, so the units wait on latency; exact GELU was a sixteenth of a MiniLM
/// embedding's time at AVX2. Over arrays of `STEP` values each link is four independent vector
/// instructions for the core to overlap: 0.40 → 0.48 exact GELU values a nanosecond on the
/// AVX2 host (0.53 with [`gelu`]'s polynomial by Estrin's scheme). Every element still goes
/// through the same operations in the same order, so the bits are those of one element at a
/// time.
const STEP: usize = 32;

/// `f` on every element of `x` into `out` (the shorter length of the two), `STEP` at a time
/// and then one at a time.
#[inline(always)]
fn by_steps(x: &[f32], out: &mut [f32], f: impl Fn(&mut [f32; STEP]), one: impl Fn(f32) -> f32) {
    let n = x.len().min(out.len());
    let (x, out) = (&x[..n], &mut out[..n]);
    let mut xs = x.chunks_exact(STEP);
    let mut os = out.chunks_exact_mut(STEP);
    for (x, o) in (&mut xs).zip(&mut os) {
        let mut a: [f32; STEP] = x.try_into().expect("STEP values");
        f(&mut a);
        o.copy_from_slice(&a);
    }
    for (o, &v) in os.into_remainder().iter_mut().zip(xs.remainder()) {
        *o = one(v);
    }
}

/// [`exp`] of every element, in place.
#[inline(always)]
fn exp_n<const N: usize>(x: &mut [f32; N]) {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    const ROUND: f32 = 12_582_912.0; // 1.5 · 2^23
    let mut t = [0.0f32; N];
    let mut r = [0.0f32; N];
    for i in 0..N {
        let v = x[i].clamp(-87.3, 88.0);
        t[i] = v * LOG2E + ROUND;
        let n = t[i] - ROUND;
        r[i] = (v - n * LN2_HI) - n * LN2_LO;
    }
    let mut p = [1.987_569_1e-4f32; N];
    for c in [
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        0.166_666_65,
        0.5,
    ] {
        for i in 0..N {
            p[i] = p[i] * r[i] + c;
        }
    }
    for i in 0..N {
        let e = p[i] * (r[i] * r[i]) + r[i] + 1.0;
        // `t` lies in [2^23, 2^24), where an f32's unit is 1: its bits are those of 1.5·2^23
        // plus `n`. So 2^n's exponent field, `n + 127`, is an integer subtraction away, with
        // no float-to-integer conversion (Rust's saturating `as i32` is scalar code, lane by
        // lane).
        x[i] = e * f32::from_bits(t[i].to_bits().wrapping_sub(ROUND.to_bits() - 127) << 23);
    }
}

/// `e^x` within 2 ulp for `x` in `[-87.3, 88]`; clamped outside (so `e^-1000` is about
/// `1.2e-38`, not 0, and `e^1000` about `1.7e38`, not infinity).
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    let mut v = [x];
    exp_n(&mut v);
    v[0]
}

/// `v ← v / (1 + e^(−k·y))`, the form SiLU (`y = v`, `k = 1`) and tanh-GELU share.
#[inline(always)]
fn over_one_plus_exp<const N: usize>(v: &mut [f32; N], mut e: [f32; N]) {
    exp_n(&mut e);
    for i in 0..N {
        v[i] /= 1.0 + e[i];
    }
}

/// `silu(g)` of every element, in place.
#[inline(always)]
fn silu_n<const N: usize>(g: &mut [f32; N]) {
    let e = std::array::from_fn(|i| -g[i]);
    over_one_plus_exp(g, e);
}

/// `gelu_tanh(g)` of every element, in place.
#[inline(always)]
fn gelu_tanh_n<const N: usize>(g: &mut [f32; N]) {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    let e = std::array::from_fn(|i| {
        let g = g[i];
        -2.0 * (SQRT_2_OVER_PI * (g + 0.044_715 * g * g * g))
    });
    over_one_plus_exp(g, e);
}

/// `out = act(gate)·up`, `act` given for `STEP` values and for one.
#[inline(always)]
fn gated(
    gate: &[f32],
    up: &[f32],
    out: &mut [f32],
    act: impl Fn(&mut [f32; STEP]),
    one: impl Fn(&mut [f32; 1]),
) {
    let n = gate.len().min(up.len()).min(out.len());
    let (gate, up, out) = (&gate[..n], &up[..n], &mut out[..n]);
    by_steps(gate, out, act, |g| {
        let mut v = [g];
        one(&mut v);
        v[0]
    });
    for (o, &u) in out.iter_mut().zip(up) {
        *o *= u;
    }
}

/// `out = silu(gate)·up` with `silu(g) = g / (1 + e^-g)`, through [`exp`].
#[inline(always)]
pub(crate) fn silu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
    gated(gate, up, out, silu_n, silu_n);
}

/// `out = gelu_tanh(gate)·up` through [`exp`], using `½(1 + tanh y) = 1/(1 + e^-2y)`: with
/// `y = √(2/π)·(g + 0.044715·g³)`, `gelu_tanh(g) = g / (1 + e^-2y)`. The same function as the
/// reference's `0.5·g·(1 + tanh y)`, without its cancellation where `tanh y` is near −1 (there
/// the reference keeps fewer correct digits; both are within a few ulp of `|g|` absolutely).
#[inline(always)]
pub(crate) fn gelu_tanh_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
    gated(gate, up, out, gelu_tanh_n, gelu_tanh_n);
}

/// Exact GELU of every element, in place (see [`gelu`]).
#[inline(always)]
fn gelu_n<const N: usize>(x: &mut [f32; N]) {
    let mut t = [0.0f32; N];
    for i in 0..N {
        let z = x[i].abs() * std::f32::consts::FRAC_1_SQRT_2;
        t[i] = 1.0 / (1.0 + 0.5 * z);
    }
    // P(t) by Estrin's scheme: pairs `c_i + c_(i+1)·t`, joined by t², t⁴ and t⁸. About 21
    // cycles of latency where Horner's rule takes 54: this chain is what bounds the function.
    const C: [f32; 10] = [
        -1.265_512_2,
        1.000_023_7,
        0.374_091_96,
        0.096_784_18,
        -0.186_288_06,
        0.278_868_07,
        -1.135_204,
        1.488_515_9,
        -0.822_152_23,
        0.170_872_77,
    ];
    let mut p = [0.0f32; N];
    for i in 0..N {
        let t1 = t[i];
        let t2 = t1 * t1;
        let t4 = t2 * t2;
        let a: [f32; 5] = std::array::from_fn(|j| C[2 * j] + C[2 * j + 1] * t1);
        let b0 = a[0] + a[1] * t2;
        let b1 = a[2] + a[3] * t2;
        p[i] = (b0 + b1 * t4) + a[4] * (t4 * t4);
    }
    // z² as x²/2: one rounding, not z's and the square's.
    let mut e: [f32; N] = std::array::from_fn(|i| p[i] - x[i] * x[i] * 0.5);
    exp_n(&mut e);
    for i in 0..N {
        let half_erfc = 0.5 * t[i] * e[i];
        let phi = if x[i] < 0.0 {
            half_erfc
        } else {
            1.0 - half_erfc
        };
        x[i] *= phi;
    }
}

/// `out = gelu(x)`, the exact (erf) GELU, through [`exp`]: `gelu(x) = x·Φ(x)` with
/// `Φ(x) = ½·erfc(−x/√2)`, and `erfc(z)` for `z = |x|/√2 ≥ 0` as `t·e^(−z² + P(t))`,
/// `t = 1/(1 + z/2)`, `P` the degree-9 Chebyshev fit of Numerical Recipes' `erfcc` (relative
/// error below 1.2·10⁻⁷ for every `z`); `Φ = 1 − ½erfc` for `x ≥ 0`. Branch-free, so a tier
/// gets it as vector code, where the reference calls libm's f64 `erf` per element.
#[inline(always)]
pub(crate) fn gelu(x: &[f32], out: &mut [f32]) {
    by_steps(x, out, gelu_n, |v| {
        let mut a = [v];
        gelu_n(&mut a);
        a[0]
    });
}

/// Softmax in place through [`exp`]: the maximum subtracted first, the sum taken left to
/// right as the reference does.
#[inline(always)]
pub(crate) fn softmax_inplace(x: &mut [f32]) {
    if x.is_empty() {
        return;
    }
    let max = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    for v in x.iter_mut() {
        *v = exp(*v - max);
    }
    let inv = 1.0 / x.iter().sum::<f32>();
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// `x[i] = e^(x[i] - shift)` through [`exp`], returning their sum: sixteen running partial
/// sums (lane `i` takes elements `i, i + 16, …`), added pairwise (lanes `i` and `i + 8`, then
/// `i + 4`, `i + 2`, `i + 1`), then the last `len % 16` elements left to right.
///
/// Why not left to right as the reference sums: that is one chain of dependent additions, four
/// cycles an element, and it was the larger part of this kernel's time in long prompts (the
/// attention calls it for every row of every block of 128 keys). The order is fixed by the
/// length alone, so results stay the same on every thread count; the sum is within the
/// reference's error bound of the exact one (it is no less accurate: the partial sums are
/// shorter chains).
#[inline(always)]
pub(crate) fn exp_sum(x: &mut [f32], shift: f32) -> f32 {
    let mut steps = x.chunks_exact_mut(STEP);
    for c in &mut steps {
        let c: &mut [f32; STEP] = c.try_into().expect("STEP values");
        c.iter_mut().for_each(|v| *v -= shift);
        exp_n(c);
    }
    for v in steps.into_remainder() {
        *v = exp(*v - shift);
    }
    let mut acc = [0.0f32; 16];
    let chunks = x.chunks_exact(16);
    let tail = chunks.remainder();
    for c in chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a += v;
        }
    }
    let mut width = 8;
    while width > 0 {
        for i in 0..width {
            acc[i] += acc[i + width];
        }
        width /= 2;
    }
    tail.iter().fold(acc[0], |s, &v| s + v)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Distance in units in the last place between two positive finite floats.
    fn ulps(a: f32, b: f32) -> u32 {
        (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs() as u32
    }

    /// `exp_sum` adds in the order its documentation gives: sixteen lanes, a pairwise tree,
    /// then the tail, on every length around the lanes.
    #[test]
    fn exp_sum_adds_in_its_documented_order() {
        for n in [0usize, 1, 15, 16, 17, 31, 32, 100, 128] {
            let x: Vec<f32> = (0..n)
                .map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.7)
                .collect();
            let e: Vec<f32> = x.iter().map(|&v| exp(v - 1.5)).collect();
            let full = n - n % 16;
            let mut lanes: Vec<f32> = (0..16)
                .map(|l| (l..full).step_by(16).fold(0.0f32, |s, i| s + e[i]))
                .collect();
            for w in [8, 4, 2, 1] {
                for i in 0..w {
                    lanes[i] += lanes[i + w];
                }
            }
            let want = e[full..].iter().fold(lanes[0], |s, &v| s + v);
            let mut got = x.clone();
            let sum = exp_sum(&mut got, 1.5);
            assert_eq!(sum.to_bits(), want.to_bits(), "n={n}");
            assert_eq!(got, e, "n={n}");
        }
    }

    /// Every 97th f32 bit pattern in the clamp range, against libm (itself within an ulp).
    #[test]
    fn exp_is_within_two_ulp_of_libm_over_its_range() {
        let (mut worst, mut worst_x) = (0, 0.0);
        for bits in (0..u32::MAX).step_by(97) {
            let x = f32::from_bits(bits);
            if !(-87.3..=88.0).contains(&x) {
                continue;
            }
            let u = ulps(exp(x), x.exp());
            if u > worst {
                (worst, worst_x) = (u, x);
            }
        }
        assert!(worst <= 2, "worst {worst} ulp at {worst_x}");
    }

    #[test]
    fn exp_clamps_instead_of_overflowing() {
        assert!(exp(1000.0).is_finite() && exp(1000.0) > 1.6e38);
        assert!(exp(-1000.0) >= 0.0 && exp(-1000.0) < 1e-37);
        assert_eq!(exp(0.0), 1.0);
    }

    #[test]
    fn silu_and_softmax_follow_the_reference() {
        let x: Vec<f32> = (0..300).map(|i| (i as f32 - 150.0) * 0.37).collect();
        let up: Vec<f32> = x.iter().map(|v| 1.0 - v * 0.01).collect();
        let (mut a, mut b) = (vec![0.0; 300], vec![0.0; 300]);
        silu_mul(&x, &up, &mut a);
        crate::reference::silu_mul_ref(&x, &up, &mut b);
        for (a, b) in a.iter().zip(&b) {
            assert!(
                (a - b).abs() <= 4.0 * f32::EPSILON * b.abs() + 1e-36,
                "{a} {b}"
            );
        }
        gelu_tanh_mul(&x, &up, &mut a);
        crate::reference::gelu_tanh_mul_ref(&x, &up, &mut b);
        for ((a, b), (g, u)) in a.iter().zip(&b).zip(x.iter().zip(&up)) {
            assert!(
                (a - b).abs() <= 8.0 * f32::EPSILON * (g * u).abs() + 1e-36,
                "gelu_tanh({g}): {a} {b}"
            );
        }
        let (mut a, mut b) = (x.clone(), x.clone());
        softmax_inplace(&mut a);
        crate::reference::softmax_inplace_ref(&mut b);
        for (a, b) in a.iter().zip(&b) {
            assert!(
                (a - b).abs() <= 8.0 * f32::EPSILON * b.abs() + 1e-37,
                "{a} {b}"
            );
        }
    }
}
