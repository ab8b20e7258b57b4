//! Rotary position embeddings in Hugging Face's layout.
//!
//! Weights are stored as in the Hugging Face checkpoint (no llama.cpp-style q/k row
//! permutation), so each head is rotated as `x·cos + rotate_half(x)·sin` over its first
//! `rotary_dim` elements (all of them except for partial rotary: Phi-4-mini, GLM), the rest
//! passing through. [`RopePairing::Half`] pairs element `i` with `i + rotary_dim/2`
//! (`LlamaRotaryEmbedding`, `apply_rotary_pos_emb`); [`RopePairing::Interleaved`] pairs `2i`
//! with `2i + 1` (GLM's `apply_rotary_pos_emb`). Inverse frequencies follow transformers'
//! `ROPE_INIT_FUNCTIONS` for the default, `linear`, `llama3` and `longrope` types; `cos`/`sin`
//! are precomputed once for every position of the context.

use kiln_format::{RopePairing, RopeScaling};

/// Which part of each head rotates, and how its elements pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RopeGeometry {
    /// Width of a head.
    pub head_dim: usize,
    /// Leading elements of a head that rotate (even, at most `head_dim`).
    pub rotary_dim: usize,
    /// Which elements a pair couples.
    pub pairing: RopePairing,
}

impl RopeGeometry {
    /// Every element rotates, in halves (Llama).
    pub fn full(head_dim: usize) -> RopeGeometry {
        RopeGeometry {
            head_dim,
            rotary_dim: head_dim,
            pairing: RopePairing::Half,
        }
    }
}

/// Which LongRoPE factor set a table uses (ignored by the other scaling types).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FactorSet {
    /// `short_factor`: while the sequence fits the original context.
    Short,
    /// `long_factor`: once a forward call's last position reaches past it.
    Long,
}

/// The inverse frequency of each rotated pair, `(rotary_dim / 2)`.
pub fn inverse_frequencies(
    rotary_dim: usize,
    theta: f64,
    scaling: Option<&RopeScaling>,
    set: FactorSet,
) -> Vec<f32> {
    // inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim)), dim = rotary_dim
    let base: Vec<f64> = (0..rotary_dim / 2)
        .map(|i| 1.0 / theta.powf((2 * i) as f64 / rotary_dim as f64))
        .collect();
    let scaled: Vec<f64> = match scaling {
        None => base,
        // _compute_longrope_parameters: inv_freq = 1 / (ext_factors * base ** (arange / dim)).
        Some(RopeScaling::LongRope {
            short_factor,
            long_factor,
            ..
        }) => {
            let factors = match set {
                FactorSet::Short => short_factor,
                FactorSet::Long => long_factor,
            };
            base.iter().zip(factors).map(|(f, e)| f / e).collect()
        }
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
    /// Rotated pairs per head, `rotary_dim / 2`.
    half: usize,
    head_dim: usize,
    pairing: RopePairing,
    /// `(positions, head_dim/2)`
    cos: Vec<f32>,
    /// `(positions, head_dim/2)`
    sin: Vec<f32>,
}

impl Rope {
    /// Tables for `positions` positions.
    pub fn new(
        geometry: RopeGeometry,
        theta: f64,
        scaling: Option<&RopeScaling>,
        set: FactorSet,
        positions: usize,
    ) -> Rope {
        let inv = inverse_frequencies(geometry.rotary_dim, theta, scaling, set);
        let half = inv.len();
        // LongRoPE: cos = emb.cos() * attention_scaling (in f32), likewise sin.
        let gain = match scaling {
            Some(RopeScaling::LongRope {
                attention_factor, ..
            }) => *attention_factor as f32,
            _ => 1.0,
        };
        let mut cos = Vec::with_capacity(positions * half);
        let mut sin = Vec::with_capacity(positions * half);
        for p in 0..positions {
            for &f in &inv {
                // freqs = position (f32) × inv_freq (f32), as transformers computes it in
                // float32; cos/sin of that angle.
                let angle = f64::from(p as f32 * f);
                cos.push(angle.cos() as f32 * gain);
                sin.push(angle.sin() as f32 * gain);
            }
        }
        Rope {
            half,
            head_dim: geometry.head_dim,
            pairing: geometry.pairing,
            cos,
            sin,
        }
    }

    /// Bytes the cos and sin tables of [`Rope::new`] take for `positions` positions (f32 each,
    /// one per rotated pair and position), without computing them: a context's cost is
    /// checked before its tables are built. `None` past memory's address range.
    pub fn table_bytes(geometry: RopeGeometry, positions: usize) -> Option<usize> {
        (geometry.rotary_dim / 2)
            .checked_mul(positions)?
            .checked_mul(2 * std::mem::size_of::<f32>())
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
        for head in x.chunks_exact_mut(self.head_dim) {
            let rot = &mut head[..2 * half];
            match self.pairing {
                RopePairing::Half => {
                    let (a, b) = rot.split_at_mut(half);
                    for i in 0..half {
                        // q_embed = q·cos + rotate_half(q)·sin, rotate_half(q) = cat(-q2, q1)
                        let (x1, x2) = (a[i], b[i]);
                        a[i] = x1 * cos[i] - x2 * sin[i];
                        b[i] = x2 * cos[i] + x1 * sin[i];
                    }
                }
                RopePairing::Interleaved => {
                    for (i, pair) in rot.chunks_exact_mut(2).enumerate() {
                        // GLM: cos/sin repeat_interleave(2); rotate_half(x) = (-x[2i+1], x[2i])
                        let (x1, x2) = (pair[0], pair[1]);
                        pair[0] = x1 * cos[i] - x2 * sin[i];
                        pair[1] = x2 * cos[i] + x1 * sin[i];
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_frequencies_follow_the_formula() {
        let f = inverse_frequencies(8, 10_000.0, None, FactorSet::Short);
        let want = [1.0, 0.1, 0.01, 0.001];
        for (a, b) in f.iter().zip(want) {
            assert!((a - b).abs() < 1e-7 * b.max(1e-3), "{a} vs {b}");
        }
    }

    #[test]
    fn linear_scaling_divides_every_frequency() {
        let base = inverse_frequencies(16, 1e4, None, FactorSet::Short);
        let lin = inverse_frequencies(
            16,
            1e4,
            Some(&RopeScaling::Linear { factor: 4.0 }),
            FactorSet::Short,
        );
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
        let base = inverse_frequencies(16, 5e5, None, FactorSet::Short);
        let l3 = inverse_frequencies(16, 5e5, Some(&s), FactorSet::Long);
        // Highest frequency (wavelength 2π < 16): unchanged.
        assert_eq!(base[0], l3[0]);
        // Lowest frequency (wavelength far above 64): divided by 8.
        assert!((base[7] / 8.0 - l3[7]).abs() <= 1e-6 * l3[7]);
        // Monotone decreasing still.
        assert!(l3.windows(2).all(|w| w[0] >= w[1]));
    }

    #[test]
    fn position_zero_is_identity_and_rotation_preserves_norm() {
        let rope = Rope::new(RopeGeometry::full(8), 1e4, None, FactorSet::Short, 10);
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

    fn longrope() -> RopeScaling {
        RopeScaling::LongRope {
            short_factor: vec![1.0, 2.0, 4.0],
            long_factor: vec![1.0, 8.0, 64.0],
            original_max_position_embeddings: 16,
            attention_factor: 1.25,
        }
    }

    #[test]
    fn longrope_divides_by_the_chosen_factor_set() {
        let base = inverse_frequencies(6, 1e4, None, FactorSet::Short);
        let s = longrope();
        let short = inverse_frequencies(6, 1e4, Some(&s), FactorSet::Short);
        let long = inverse_frequencies(6, 1e4, Some(&s), FactorSet::Long);
        for i in 0..3 {
            let (fs, fl) = ([1.0, 2.0, 4.0][i], [1.0, 8.0, 64.0][i]);
            assert!((base[i] / fs - short[i]).abs() <= 1e-6 * short[i]);
            assert!((base[i] / fl - long[i]).abs() <= 1e-6 * long[i]);
        }
    }

    /// Partial rotary leaves the tail of each head alone; LongRoPE's attention factor scales
    /// the rotated part (position 0 multiplies it by the factor).
    #[test]
    fn partial_rotary_passes_the_tail_through() {
        for pairing in [RopePairing::Half, RopePairing::Interleaved] {
            let g = RopeGeometry {
                head_dim: 10,
                rotary_dim: 6,
                pairing,
            };
            let rope = Rope::new(g, 1e4, Some(&longrope()), FactorSet::Long, 8);
            let x0: Vec<f32> = (0..20).map(|i| i as f32 * 0.25 - 2.0).collect();
            let mut x = x0.clone();
            rope.apply(&mut x, 0);
            for (h, h0) in x.chunks(10).zip(x0.chunks(10)) {
                for i in 0..6 {
                    assert_eq!(h[i], h0[i] * 1.25);
                }
                assert_eq!(h[6..], h0[6..]);
            }
            let mut y = x0.clone();
            rope.apply(&mut y, 5);
            for (h, h0) in y.chunks(10).zip(x0.chunks(10)) {
                assert_eq!(h[6..], h0[6..], "{pairing:?}");
                assert_ne!(h[..6], h0[..6], "{pairing:?}");
            }
        }
    }

    /// Interleaved pairing is half pairing of a permuted head: rotating `(a0 b0 a1 b1 …)`
    /// interleaved equals rotating `(a0 a1 … b0 b1 …)` in halves, element for element.
    #[test]
    fn interleaved_pairs_are_permuted_half_pairs() {
        let geo = |pairing| RopeGeometry {
            head_dim: 8,
            rotary_dim: 8,
            pairing,
        };
        let half = Rope::new(geo(RopePairing::Half), 1e4, None, FactorSet::Short, 12);
        let inter = Rope::new(
            geo(RopePairing::Interleaved),
            1e4,
            None,
            FactorSet::Short,
            12,
        );
        let x: Vec<f32> = (0..8).map(|i| (i as f32).sin()).collect();
        let perm = |v: &[f32]| -> Vec<f32> { (0..8).map(|j| v[(j % 4) * 2 + j / 4]).collect() };
        for pos in [0, 3, 11] {
            let mut a = x.clone();
            inter.apply(&mut a, pos);
            let mut b = perm(&x);
            half.apply(&mut b, pos);
            assert_eq!(perm(&a), b, "position {pos}");
        }
    }
}
