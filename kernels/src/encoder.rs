//! LayerNorm (with its bias), which encoders add to the decoders' RMSNorm. (Their exact GELU
//! is a vector kernel of every tier: [`crate::gelu`].)
//!
//! It runs twice per token per layer over a vector of `hidden` values, next to matrix
//! products that cost hundreds of times more, so it is written once in portable code (no SIMD
//! tiers, no dispatch; its sums in eight lanes that the compiler vectorizes): it computes in
//! f64 and rounds once, which keeps it within an f32 rounding of PyTorch's `layer_norm` on
//! every input.

/// PyTorch's `LayerNorm` of one row: `(x − mean) / √(var + eps) · weight + bias`, the
/// variance biased (divided by `n`), as `torch.nn.functional.layer_norm` computes it.
///
/// Panics if the lengths differ (the caller checked the shapes when it loaded the model).
pub fn layernorm(x: &[f32], weight: &[f32], bias: &[f32], eps: f32, out: &mut [f32]) {
    assert_eq!(x.len(), weight.len(), "layernorm: weight length mismatch");
    assert_eq!(x.len(), bias.len(), "layernorm: bias length mismatch");
    assert_eq!(x.len(), out.len(), "layernorm: output length mismatch");
    if x.is_empty() {
        return;
    }
    let n = x.len() as f64;
    let mean = sum_f64(x, |v| v) / n;
    let var = sum_f64(x, |v| (v - mean) * (v - mean)) / n;
    let inv = 1.0 / (var + f64::from(eps)).sqrt();
    for (((o, &v), &w), &b) in out.iter_mut().zip(x).zip(weight).zip(bias) {
        *o = ((f64::from(v) - mean) * inv * f64::from(w) + f64::from(b)) as f32;
    }
}

/// `Σ f(x[i])` in f64, in eight running sums (lane `i % 8`) added pairwise at the end: a
/// single sum is one chain of dependent additions, four cycles an element, which made this
/// row's norm about 5% of an encoder's time; eight chains vectorize. The order depends on the
/// length alone, so a row gets the same bits wherever it is computed.
#[inline(always)]
fn sum_f64(x: &[f32], f: impl Fn(f64) -> f64) -> f64 {
    let mut acc = [0.0f64; 8];
    let chunks = x.chunks_exact(8);
    let tail = chunks.remainder();
    for c in chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a += f(f64::from(v));
        }
    }
    for (a, &v) in acc.iter_mut().zip(tail) {
        *a += f(f64::from(v));
    }
    for width in [4, 2, 1] {
        for k in 0..width {
            acc[k] += acc[k + width];
        }
    }
    acc[0]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layernorm_centres_and_scales() {
        let x = [1.0f32, 2.0, 3.0, 4.0];
        let mut out = [0.0f32; 4];
        layernorm(&x, &[1.0; 4], &[0.0; 4], 0.0, &mut out);
        // mean 2.5, variance 1.25
        let s = 1.25f64.sqrt();
        for (o, v) in out.iter().zip([-1.5, -0.5, 0.5, 1.5]) {
            assert!((f64::from(*o) - v / s).abs() < 1e-6, "{o}");
        }
        let mut shifted = [0.0f32; 4];
        layernorm(&x, &[2.0; 4], &[1.0; 4], 0.0, &mut shifted);
        for (a, b) in shifted.iter().zip(out) {
            assert!((a - (2.0 * b + 1.0)).abs() < 1e-6);
        }
        // A constant row is all bias, the epsilon keeping it finite.
        let mut flat = [0.0f32; 3];
        layernorm(&[5.0; 3], &[1.0; 3], &[0.25; 3], 1e-12, &mut flat);
        assert_eq!(flat, [0.25; 3]);
    }

    #[test]
    fn gelu_matches_known_values() {
        // x·Φ(x) at a few points (Φ from tables of the normal distribution).
        let x = [-3.0f32, -1.0, 0.0, 0.5, 1.0, 2.0];
        let want = [
            -0.004_049_71,
            -0.158_655_25,
            0.0,
            0.345_731_37,
            0.841_344_7,
            1.954_499_7,
        ];
        let mut out = [0.0f32; 6];
        crate::reference::gelu_ref(&x, &mut out);
        for (o, w) in out.iter().zip(want) {
            assert!((o - w).abs() < 1e-6, "gelu_ref = {o}, want {w}");
        }
        crate::gelu(&x, &mut out);
        for ((o, w), x) in out.iter().zip(want).zip(x) {
            assert!((o - w).abs() < 1e-6, "gelu({x}) = {o}, want {w}");
        }
    }
}
