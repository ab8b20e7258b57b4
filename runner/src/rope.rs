//! Rotary position embeddings in Hugging Face's layout.
//!
//! Weights are stored as in the Hugging Face checkpoint (no llama.cpp-style q/k row
//! permutation), so each head is rotated as `x·cos + rotate_half(x)·sin`, pairing element `i`
//! with `i + head_dim/2` (`LlamaRotaryEmbedding`, `apply_rotary_pos_emb`). Inverse frequencies
//! follow transformers' `ROPE_INIT_FUNCTIONS` for the default, `linear` and `llama3` types;
//! `cos`/`sin` are precomputed once for every position of the context.

use kiln_format::RopeScaling;

/// The inverse frequency of each rotated pair, `(head_dim / 2)`.
pub fn inverse_frequencies(head_dim: usize, theta: f64, scaling: Option<&RopeScaling>) -> Vec<f32> {
    // inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
    let base: Vec<f64> = (0..head_dim / 2)
        .map(|i| 1.0 / theta.powf((2 * i) as f64 / head_dim as f64))
        .collect();
    let scaled: Vec<f64> = match scaling {
        None => base,
        // Position interpolation: positions divided by `factor`, i.e. frequencies divided.
        Some(RopeScaling::Linear { factor }) => base.iter().map(|f| f / factor).collect(),
        // _compute_llama3_parameters: long wavelengths slowed by `factor`, short ones kept,
        // a smooth blend in between.
        Some(RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        }) => {
            let old = *original_max_position_embeddings as f64;
            let low_freq_wavelen = old / low_freq_factor;
            let high_freq_wavelen = old / high_freq_factor;
            base.iter()
                .map(|&f| {
                    let wavelen = 2.0 * std::f64::consts::PI / f;
                    if wavelen > low_freq_wavelen {
                        f / factor
                    } else if wavelen < high_freq_wavelen {
                        f
                    } else {
                        let smooth = (old / wavelen - low_freq_factor)
                            / (high_freq_factor - low_freq_factor);
                        (1.0 - smooth) * f / factor + smooth * f
                    }
                })
                .collect()
        }
    };
    scaled.into_iter().map(|f| f as f32).collect()
}

/// Precomputed `cos`/`sin` for every position below `positions`.
#[derive(Debug, Clone)]
pub struct Rope {
    half: usize,
    /// `(positions, head_dim/2)`
    cos: Vec<f32>,
    /// `(positions, head_dim/2)`
    sin: Vec<f32>,
}

impl Rope {
    /// Tables for `positions` positions.
    pub fn new(
        head_dim: usize,
        theta: f64,
        scaling: Option<&RopeScaling>,
        positions: usize,
    ) -> Rope {
        let inv = inverse_frequencies(head_dim, theta, scaling);
        let half = inv.len();
        let mut cos = Vec::with_capacity(positions * half);
        let mut sin = Vec::with_capacity(positions * half);
        for p in 0..positions {
            for &f in &inv {
                // freqs = position (f32) × inv_freq (f32), as transformers computes it in
                // float32; cos/sin of that angle.
                let angle = f64::from(p as f32 * f);
                cos.push(angle.cos() as f32);
                sin.push(angle.sin() as f32);
            }
        }
        Rope { half, cos, sin }
    }

    /// Number of positions covered.
    pub fn positions(&self) -> usize {
        self.cos.len() / self.half.max(1)
    }

    /// Rotate every head of one token's `x` (`(heads, head_dim)`) for position `pos`.
    pub fn apply(&self, x: &mut [f32], pos: usize) {
        let half = self.half;
        let cos = &self.cos[pos * half..(pos + 1) * half];
        let sin = &self.sin[pos * half..(pos + 1) * half];
        for head in x.chunks_exact_mut(2 * half) {
            let (a, b) = head.split_at_mut(half);
            for i in 0..half {
                // q_embed = q·cos + rotate_half(q)·sin, rotate_half(q) = cat(-q2, q1)
                let (x1, x2) = (a[i], b[i]);
                a[i] = x1 * cos[i] - x2 * sin[i];
                b[i] = x2 * cos[i] + x1 * sin[i];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_frequencies_follow_the_formula() {
        let f = inverse_frequencies(8, 10_000.0, None);
        let want = [1.0, 0.1, 0.01, 0.001];
        for (a, b) in f.iter().zip(want) {
            assert!((a - b).abs() < 1e-7 * b.max(1e-3), "{a} vs {b}");
        }
    }

    #[test]
    fn linear_scaling_divides_every_frequency() {
        let base = inverse_frequencies(16, 1e4, None);
        let lin = inverse_frequencies(16, 1e4, Some(&RopeScaling::Linear { factor: 4.0 }));
        for (a, b) in base.iter().zip(&lin) {
            assert!((a / 4.0 - b).abs() <= 1e-9 + 1e-6 * b);
        }
    }

    #[test]
    fn llama3_scaling_keeps_high_and_slows_low_frequencies() {
        let s = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 64,
        };
        let base = inverse_frequencies(16, 5e5, None);
        let l3 = inverse_frequencies(16, 5e5, Some(&s));
        // Highest frequency (wavelength 2π < 16): unchanged.
        assert_eq!(base[0], l3[0]);
        // Lowest frequency (wavelength far above 64): divided by 8.
        assert!((base[7] / 8.0 - l3[7]).abs() <= 1e-6 * l3[7]);
        // Monotone decreasing still.
        assert!(l3.windows(2).all(|w| w[0] >= w[1]));
    }

    #[test]
    fn position_zero_is_identity_and_rotation_preserves_norm() {
        let rope = Rope::new(8, 1e4, None, 10);
        let x0: Vec<f32> = (0..16).map(|i| i as f32 * 0.3 - 2.0).collect();
        let mut x = x0.clone();
        rope.apply(&mut x, 0);
        assert_eq!(x, x0);
        rope.apply(&mut x, 7);
        for (h, h0) in x.chunks(8).zip(x0.chunks(8)) {
            for i in 0..4 {
                let n = h[i].hypot(h[i + 4]);
                let n0 = h0[i].hypot(h0[i + 4]);
                assert!((n - n0).abs() < 1e-5);
            }
        }
    }
}
