//! Error metrics between an activation and its reference, each named for what it computes.

use serde::Serialize;

/// How far `got` is from `reference` (same length, any shape).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Metrics {
    /// max |got − ref|.
    pub max_abs: f64,
    /// Root mean square of the error, sqrt(Σ(got − ref)² / n).
    pub rms: f64,
    /// Relative error: ‖got − ref‖₂ / ‖ref‖₂.
    pub rel: f64,
    /// Cosine similarity ⟨got, ref⟩ / (‖got‖ ‖ref‖) (1 for two zero vectors).
    pub cosine: f64,
    /// Normalised mean squared error, Σ(got − ref)² / Σref² (= rel²).
    pub nmse: f64,
}

impl Metrics {
    /// Compare two equally long slices, accumulating in f64.
    pub fn compare(got: &[f32], reference: &[f32]) -> Metrics {
        assert_eq!(got.len(), reference.len(), "compare needs equal lengths");
        let (mut max_abs, mut se, mut rr, mut gg, mut gr) = (0f64, 0f64, 0f64, 0f64, 0f64);
        for (&g, &r) in got.iter().zip(reference) {
            let (g, r) = (g as f64, r as f64);
            let d = g - r;
            max_abs = max_abs.max(d.abs());
            se += d * d;
            rr += r * r;
            gg += g * g;
            gr += g * r;
        }
        let n = got.len().max(1) as f64;
        let nmse = if rr > 0.0 {
            se / rr
        } else if se == 0.0 {
            0.0
        } else {
            f64::INFINITY
        };
        let cosine = if gg == 0.0 && rr == 0.0 {
            1.0
        } else if gg == 0.0 || rr == 0.0 {
            0.0
        } else {
            gr / (gg.sqrt() * rr.sqrt())
        };
        // Non-finite output (NaN from a broken kernel) must never pass: make every metric say so.
        if got.iter().any(|v| !v.is_finite()) {
            return Metrics {
                max_abs: f64::INFINITY,
                rms: f64::INFINITY,
                rel: f64::INFINITY,
                cosine: 0.0,
                nmse: f64::INFINITY,
            };
        }
        Metrics {
            max_abs,
            rms: (se / n).sqrt(),
            rel: nmse.sqrt(),
            cosine,
            nmse,
        }
    }
}

/// Index of the largest value (first on ties).
pub fn argmax(x: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best
}

/// Log-softmax of one row, in f64 for the reduction.
pub fn log_softmax(x: &[f32], out: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = x.iter().map(|&v| (v as f64 - max).exp()).sum();
    let lse = max + sum.ln();
    for (o, &v) in out.iter_mut().zip(x) {
        *o = (v as f64 - lse) as f32;
    }
}

/// KL(P‖Q) = Σ p (log p − log q) from two log-probability rows.
pub fn kl_divergence(logp: &[f32], logq: &[f32]) -> f64 {
    logp.iter()
        .zip(logq)
        .map(|(&lp, &lq)| {
            let p = (lp as f64).exp();
            if p == 0.0 {
                0.0
            } else {
                p * (lp as f64 - lq as f64)
            }
        })
        .sum::<f64>()
        .max(0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identical_vectors_are_perfect() {
        let m = Metrics::compare(&[1.0, -2.0, 3.0], &[1.0, -2.0, 3.0]);
        assert_eq!((m.max_abs, m.rms, m.nmse, m.cosine), (0.0, 0.0, 0.0, 1.0));
    }

    #[test]
    fn known_values() {
        let m = Metrics::compare(&[1.0, 0.0], &[0.0, 1.0]);
        assert_eq!(m.cosine, 0.0);
        assert_eq!(m.nmse, 2.0);
        assert_eq!(m.max_abs, 1.0);
        assert!((m.rms - 1.0).abs() < 1e-12);
        let m = Metrics::compare(&[2.0, 4.0], &[1.0, 2.0]);
        assert!((m.cosine - 1.0).abs() < 1e-12);
        assert!((m.rel - 1.0).abs() < 1e-12);
    }

    #[test]
    fn nan_never_passes() {
        let m = Metrics::compare(&[f32::NAN, 1.0], &[1.0, 1.0]);
        assert!(m.nmse.is_infinite() && m.cosine == 0.0);
    }

    #[test]
    fn kl_of_identical_distributions_is_zero_and_positive_otherwise() {
        let mut p = [0f32; 3];
        let mut q = [0f32; 3];
        log_softmax(&[1.0, 2.0, 3.0], &mut p);
        log_softmax(&[3.0, 2.0, 1.0], &mut q);
        assert!(kl_divergence(&p, &p).abs() < 1e-9);
        assert!(kl_divergence(&p, &q) > 0.5);
        assert_eq!(argmax(&[1.0, 5.0, 5.0]), 1);
    }
}
