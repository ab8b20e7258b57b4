//! What llama.cpp's Llama graph expects of rotary embeddings, and its inverse.
//!
//! Hugging Face Llama checkpoints rotate pairs `(x[i], x[i + d/2])` of each head; llama.cpp's
//! `llama` architecture rotates adjacent pairs `(x[2i], x[2i + 1])`. Its converter therefore
//! reorders the rows of `q_proj` and `k_proj` per head: GGUF row `h·d + 2i + j` is Hugging Face
//! row `h·d + j·d/2 + i` (`j` = 0, 1). Rows move whole, so the same byte permutation serves
//! every dtype, quantized blocks included (a row is always a whole number of blocks).
//! Llama 3's frequency scaling travels as a `rope_freqs.weight` tensor of per-frequency
//! divisors ([`llama3_factors`]); LongRoPE's (Phi-3) as two tensors of per-pair divisors,
//! [`LONGROPE_LONG`] and [`LONGROPE_SHORT`]. Phi-3 and GLM need no reordering: llama.cpp
//! rotates Phi-3's halves as Hugging Face does, and GLM's adjacent pairs are its own
//! (`LLAMA_ROPE_TYPE_NORM`, on the leading `rope.dimension_count` elements of each head).

use kiln_format::RopeScaling;

/// LongRoPE's long factors as llama.cpp reads them (`LLM_TENSOR_ROPE_FACTORS_LONG`): one F32
/// divisor per rotated pair, used at every position when the context exceeds
/// `rope.scaling.original_context_length`.
pub const LONGROPE_LONG: &str = "rope_factors_long.weight";
/// LongRoPE's short factors (`LLM_TENSOR_ROPE_FACTORS_SHORT`), used otherwise.
pub const LONGROPE_SHORT: &str = "rope_factors_short.weight";

/// Which way to reorder rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// Hugging Face (Kiln) order → llama.cpp's.
    ToGguf,
    /// llama.cpp's order → Hugging Face (Kiln).
    FromGguf,
}

/// Reorder the rows of a q or k projection of `n_head` heads. `bytes` holds whole rows of
/// `row_bytes` each. Fails (with a reason) if the rows do not split into heads of even size.
pub fn permute_rows(
    bytes: &[u8],
    row_bytes: usize,
    n_head: usize,
    dir: Direction,
) -> Result<Vec<u8>, String> {
    if row_bytes == 0 || !bytes.len().is_multiple_of(row_bytes) {
        return Err(format!(
            "{} bytes are not whole rows of {row_bytes}",
            bytes.len()
        ));
    }
    let rows = bytes.len() / row_bytes;
    if n_head == 0 || !rows.is_multiple_of(n_head) || !(rows / n_head).is_multiple_of(2) {
        return Err(format!(
            "{rows} rows do not split into {n_head} heads of even size"
        ));
    }
    let hd = rows / n_head;
    let half = hd / 2;
    let mut out = vec![0u8; bytes.len()];
    for h in 0..n_head {
        for i in 0..half {
            for j in 0..2 {
                let gguf = h * hd + 2 * i + j;
                let hf = h * hd + j * half + i;
                let (to, from) = match dir {
                    Direction::ToGguf => (gguf, hf),
                    Direction::FromGguf => (hf, gguf),
                };
                out[to * row_bytes..(to + 1) * row_bytes]
                    .copy_from_slice(&bytes[from * row_bytes..(from + 1) * row_bytes]);
            }
        }
    }
    Ok(out)
}

/// Llama 3 rope scaling as llama.cpp applies it: one divisor per rotary frequency
/// (`head_dim / 2` values) for the `rope_freqs.weight` tensor. `None` for other scalings.
pub fn llama3_factors(scaling: &RopeScaling, rope_theta: f64, head_dim: u64) -> Option<Vec<f32>> {
    let RopeScaling::Llama3 {
        factor,
        low_freq_factor,
        high_freq_factor,
        original_max_position_embeddings,
    } = *scaling
    else {
        return None;
    };
    let old = original_max_position_embeddings as f64;
    let low_wavelen = old / low_freq_factor;
    let high_wavelen = old / high_freq_factor;
    Some(
        (0..head_dim / 2)
            .map(|i| {
                let freq = 1.0 / rope_theta.powf((2 * i) as f64 / head_dim as f64);
                let wavelen = 2.0 * std::f64::consts::PI / freq;
                let f = if wavelen < high_wavelen {
                    1.0
                } else if wavelen > low_wavelen {
                    factor
                } else {
                    let smooth =
                        (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                    1.0 / ((1.0 - smooth) / factor + smooth)
                };
                f as f32
            })
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permutation_matches_the_definition_and_inverts() {
        // 2 heads of head_dim 4, rows of one byte: HF rows 0..8.
        let hf: Vec<u8> = (0..8).collect();
        let g = permute_rows(&hf, 1, 2, Direction::ToGguf).unwrap();
        // Head 0: GGUF rows (0,1,2,3) = HF rows (0,2,1,3).
        assert_eq!(g, vec![0, 2, 1, 3, 4, 6, 5, 7]);
        assert_eq!(permute_rows(&g, 1, 2, Direction::FromGguf).unwrap(), hf);
        let wide: Vec<u8> = (0..=255).cycle().take(3 * 64 * 7).collect();
        let there = permute_rows(&wide, 7, 3, Direction::ToGguf).unwrap();
        assert_ne!(there, wide);
        assert_eq!(
            permute_rows(&there, 7, 3, Direction::FromGguf).unwrap(),
            wide
        );
    }

    #[test]
    fn permutation_refuses_odd_heads() {
        assert!(permute_rows(&[0; 6], 1, 2, Direction::ToGguf).is_err());
        assert!(permute_rows(&[0; 8], 3, 2, Direction::ToGguf).is_err());
        assert!(permute_rows(&[0; 8], 1, 0, Direction::ToGguf).is_err());
    }

    #[test]
    fn llama3_factors_span_one_to_factor() {
        let s = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        };
        let f = llama3_factors(&s, 500_000.0, 128).unwrap();
        assert_eq!(f.len(), 64);
        assert_eq!(f[0], 1.0);
        assert_eq!(f[63], 8.0);
        assert!(f.windows(2).all(|w| w[0] <= w[1]));
        assert!(llama3_factors(&RopeScaling::Linear { factor: 2.0 }, 1e4, 64).is_none());
    }
}
