//! Error statistics of converted values against their source, accumulated on the fly.
//!
//! They live beside the kernels because their order of additions is part of the weight
//! quantization kernels' contract ([`crate::Kernels::quantize_blocks`]): every tier adds the
//! partial sums of a 32-value block exactly as [`ErrorStats::add`] does, so a quantized file's
//! error report has the same bits whatever the CPU. A tensor's chunks are merged in row order,
//! and chunk boundaries do not depend on the thread count, so the numbers are also the same
//! whatever the thread count is.

/// Sums from which the per-tensor metrics are derived.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ErrorStats {
    /// Elements compared.
    pub count: u64,
    /// Σ x² of the source values.
    pub sum_sq_signal: f64,
    /// Σ (x − x̂)².
    pub sum_sq_error: f64,
    /// max |x − x̂|.
    pub max_abs_error: f32,
}

impl ErrorStats {
    /// Add a run of source values `x` and their round-tripped values `y` (same length).
    #[inline(always)]
    pub fn add(&mut self, x: &[f32], y: &[f32]) {
        debug_assert_eq!(x.len(), y.len());
        // Eight independent lanes per 32-value block, so the loop vectorizes; the order of the
        // additions is fixed, so the result is too.
        const LANES: usize = 8;
        for (xb, yb) in x.chunks(32).zip(y.chunks(32)) {
            let (mut s, mut e, mut m) = ([0.0f32; LANES], [0.0f32; LANES], [0.0f32; LANES]);
            let full = xb.len() / LANES * LANES;
            for (xc, yc) in xb[..full]
                .chunks_exact(LANES)
                .zip(yb[..full].chunks_exact(LANES))
            {
                for l in 0..LANES {
                    let d = xc[l] - yc[l];
                    s[l] += xc[l] * xc[l];
                    e[l] += d * d;
                    m[l] = m[l].max(d.abs());
                }
            }
            for (l, (&a, &b)) in xb[full..].iter().zip(&yb[full..]).enumerate() {
                let d = a - b;
                s[l] += a * a;
                e[l] += d * d;
                m[l] = m[l].max(d.abs());
            }
            self.add_lanes(&s, &e, &m);
        }
        self.count += x.len() as u64;
    }

    /// Fold the eight lane partials of one 32-value block (Σx², Σ(x − x̂)², max |x − x̂|, each
    /// lane `l` over elements `l, l + 8, l + 16, l + 24` in that order) into the sums; `count`
    /// is not changed. Shared by [`ErrorStats::add`] and the SIMD quantization kernels, so both reduce
    /// in the same order and give the same bits.
    #[inline(always)]
    pub(crate) fn add_lanes(&mut self, s: &[f32; 8], e: &[f32; 8], m: &[f32; 8]) {
        self.sum_sq_signal += f64::from(s.iter().sum::<f32>());
        self.sum_sq_error += f64::from(e.iter().sum::<f32>());
        self.max_abs_error = m.iter().fold(self.max_abs_error, |a, &b| a.max(b));
    }

    /// Combine with the statistics of the following chunk.
    pub fn merge(&mut self, other: &ErrorStats) {
        self.count += other.count;
        self.sum_sq_signal += other.sum_sq_signal;
        self.sum_sq_error += other.sum_sq_error;
        self.max_abs_error = self.max_abs_error.max(other.max_abs_error);
    }

    /// Root mean squared error: `sqrt(Σ(x − x̂)² / n)`.
    pub fn rmse(&self) -> f64 {
        if self.count == 0 {
            0.0
        } else {
            (self.sum_sq_error / self.count as f64).sqrt()
        }
    }

    /// Signal-to-noise ratio in dB, `10·log10(Σx² / Σ(x − x̂)²)`; `None` when the conversion
    /// was exact (infinite SNR).
    pub fn snr_db(&self) -> Option<f64> {
        if self.sum_sq_error == 0.0 {
            None
        } else {
            Some(10.0 * (self.sum_sq_signal / self.sum_sq_error).log10())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_are_named_for_what_they_compute() {
        let x = [1.0f32, -2.0, 3.0, 0.0];
        let y = [1.5f32, -2.0, 2.0, 0.0];
        let mut s = ErrorStats::default();
        s.add(&x, &y);
        // errors 0.5, 0, 1, 0 -> Σe² = 1.25, n = 4
        assert_eq!(s.rmse(), (1.25f64 / 4.0).sqrt());
        assert_eq!(s.max_abs_error, 1.0);
        let snr = 10.0 * (14.0f64 / 1.25).log10();
        assert!((s.snr_db().unwrap() - snr).abs() < 1e-12);
        let mut exact = ErrorStats::default();
        exact.add(&x, &x);
        assert_eq!(exact.snr_db(), None);
        assert_eq!(exact.rmse(), 0.0);
    }

    #[test]
    fn merge_equals_one_pass_over_block_aligned_chunks() {
        let x: Vec<f32> = (0..256).map(|i| (i as f32 * 0.37).sin()).collect();
        let y: Vec<f32> = x.iter().map(|v| (v * 16.0).round() / 16.0).collect();
        let mut whole = ErrorStats::default();
        whole.add(&x, &y);
        let mut parts = ErrorStats::default();
        for (a, b) in x.chunks(64).zip(y.chunks(64)) {
            let mut p = ErrorStats::default();
            p.add(a, b);
            parts.merge(&p);
        }
        assert_eq!(whole, parts);
    }
}
