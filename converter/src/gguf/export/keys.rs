//! The GGUF metadata keys an export writes for the model: the hyperparameters under the
//! architecture's prefix, and `general.file_type` named after the matrices' dtypes.

use std::collections::BTreeMap;

use kiln_format::family::GgufWindow;
use kiln_format::{DType, ModelConfig, RopeScaling};

use super::super::value::Value;

/// `general.file_type` (llama.cpp's `llama_ftype`) of a file whose matrices hold
/// `matrix_bytes` (bytes per logical dtype).
///
/// A file with K-quant matrices is named, as llama-quantize names its mixes, after the K-quant
/// holding most of their weights: Q4_K → `MOSTLY_Q4_K_M` (15), Q5_K → `MOSTLY_Q5_K_M` (17),
/// Q6_K → `MOSTLY_Q6_K` (18), Q3_K → `MOSTLY_Q3_K_M` (12), Q2_K → `MOSTLY_Q2_K` (10), IQ4_XS →
/// `MOSTLY_IQ4_XS` (30), IQ4_NL (not a K-quant, but named like one) → `MOSTLY_IQ4_NL` (25). Such a mix holds other types too: Q6_K for some matrices, and
/// llama-quantize's fallbacks (Q5_0, Q5_1, Q8_0) for matrices whose rows are not a multiple of
/// 256 — in Gemma 3 270M's Q4_K_M file the Q8_0 embedding alone is most of the bytes, and the
/// file still says 15. Without K-quants, the dtype holding most matrix bytes names the file.
pub(super) fn file_type(matrix_bytes: &BTreeMap<DType, u64>) -> u32 {
    let weights = |d: DType, bytes: u64| {
        u128::from(bytes) * d.block_len() as u128 / d.block_bytes().max(1) as u128
    };
    let k_quant = matrix_bytes
        .iter()
        .filter(|(d, _)| d.is_k_quant() || **d == DType::IQ4_NL)
        .max_by_key(|(d, b)| weights(**d, **b))
        .map(|(d, _)| *d);
    let dominant = k_quant.unwrap_or_else(|| {
        matrix_bytes
            .iter()
            .max_by_key(|(_, b)| **b)
            .map(|(d, _)| *d)
            .unwrap_or(DType::F32)
    });
    match dominant {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::Q4_0 | DType::Q4_0x16 => 2,
        DType::Q8_0 => 7,
        DType::Q5_0 => 8,
        DType::Q5_1 => 9,
        DType::Q4_K => 15,
        DType::Q5_K => 17,
        DType::Q6_K => 18,
        DType::Q2_K => 10,
        DType::Q3_K => 12,
        DType::IQ4_NL | DType::IQ4_NLx16 => 25,
        DType::IQ4_XS | DType::IQ4_XSx16 => 30,
        DType::BF16 => 32,
    }
}

/// The hyperparameter keys of `config` under the architecture prefix `arch`.
pub fn config_metadata(arch: &str, c: &ModelConfig) -> Vec<(String, Value)> {
    let k = |s: &str| format!("{arch}.{s}");
    let u = |v: u64| Value::U32(v.min(u64::from(u32::MAX)) as u32);
    if let (true, Some(e)) = (c.architecture.spec().encoder, &c.family.embedding) {
        return encoder_metadata(arch, c, e);
    }
    let mut kv = vec![
        (k("context_length"), u(c.max_position_embeddings)),
        (k("embedding_length"), u(c.hidden_size)),
        (k("block_count"), u(c.num_layers)),
        (k("feed_forward_length"), u(c.intermediate_size)),
        (k("attention.head_count"), u(c.num_heads)),
        (k("attention.head_count_kv"), u(c.num_kv_heads)),
        (k("attention.key_length"), u(c.head_dim)),
        (k("attention.value_length"), u(c.head_dim)),
        // The rotated width: all of the head but for Phi-4-mini and GLM (partial rotary).
        (k("rope.dimension_count"), u(c.rotary_dim())),
        (k("rope.freq_base"), Value::F32(c.rope_theta as f32)),
        (
            k("attention.layer_norm_rms_epsilon"),
            Value::F32(c.rms_norm_eps as f32),
        ),
        (k("vocab_size"), u(c.vocab_size)),
    ];
    // A bidirectional window as llama.cpp states it (`n_swa / 2` positions each side): what
    // transformers saves, `2 (w − 1)` for the bound `|p − j| < w`.
    let bidirectional = c.family.attention_mask == kiln_format::AttentionMask::Bidirectional;
    let window = c
        .sliding_window
        .map(|w| if bidirectional { 2 * (w - 1) } else { w });
    match (c.architecture.spec().gguf.window, window) {
        (GgufWindow::Required, Some(w)) => kv.push((k("attention.sliding_window"), u(w))),
        // llama.cpp's converter writes 0 for a Phi-3 without a window (Phi-4-mini).
        (GgufWindow::ZeroMeansNone, w) => {
            kv.push((k("attention.sliding_window"), u(w.unwrap_or(0))))
        }
        _ => {}
    }
    kv.extend(rope_scaling_keys(arch, c));
    // A decoder-based embedder (Qwen3-Embedding) is the decoder plus its pooling, as
    // llama.cpp's converter writes one, and the rest of its embedding for Kiln's import.
    if let Some(e) = &c.family.embedding {
        kv.extend(embedding_keys(arch, e));
        // EmbeddingGemma's projections, as llama.cpp's converter states them.
        for (d, name) in e.dense.iter().zip(["dense_2", "dense_3"]) {
            kv.push((k(&format!("{name}_feat_in")), u(d.in_features)));
            kv.push((k(&format!("{name}_feat_out")), u(d.out_features)));
        }
    }
    kv
}

/// The RoPE scaling's keys: llama.cpp's, and Kiln's own exact copy of what the factor tensors
/// round.
fn rope_scaling_keys(arch: &str, c: &ModelConfig) -> Vec<(String, Value)> {
    let k = |s: &str| format!("{arch}.{s}");
    let u = |v: u64| Value::U32(v.min(u64::from(u32::MAX)) as u32);
    let mut kv = Vec::new();
    match &c.rope_scaling {
        Some(RopeScaling::Linear { factor }) => {
            kv.push((k("rope.scaling.type"), Value::Str("linear".into())));
            kv.push((k("rope.scaling.factor"), Value::F32(*factor as f32)));
        }
        Some(s @ (RopeScaling::Llama3 { .. } | RopeScaling::LongRope { .. })) => {
            if let RopeScaling::LongRope {
                original_max_position_embeddings,
                attention_factor,
                ..
            } = s
            {
                // The factors travel as tensors (`rope_factors_long`/`_short`); the context
                // that picks between them and the factor on cos/sin as keys.
                kv.push((
                    k("rope.scaling.original_context_length"),
                    u(*original_max_position_embeddings),
                ));
                kv.push((
                    k("rope.scaling.attn_factor"),
                    Value::F32(*attention_factor as f32),
                ));
            }
            // llama.cpp reads the factor tensors; the parameters themselves go under Kiln's
            // own key so that an import can restore the configuration exactly (f64 factors
            // that the f32 tensors would round).
            kv.push((
                "kiln.rope_scaling".into(),
                Value::Str(serde_json::to_string(s).expect("serializable")),
            ));
        }
        None => {}
    }
    kv
}

/// `pooling_type` and `kiln.embedding`: how an embedding model's vector is made.
fn embedding_keys(arch: &str, e: &kiln_format::EmbeddingSpec) -> [(String, Value); 2] {
    let pooling = match e.pooling {
        kiln_format::Pooling::Mean => 1,
        kiln_format::Pooling::Cls => 2,
        kiln_format::Pooling::LastToken => 3,
    };
    [
        (format!("{arch}.pooling_type"), Value::U32(pooling)),
        // What GGUF has no key for (normalisation, max_seq_length, prompts), for Kiln's import.
        (
            "kiln.embedding".into(),
            Value::Str(serde_json::to_string(e).expect("serializable")),
        ),
    ]
}

/// An encoder's keys, as llama.cpp's converter writes a `BertModel`: no rotary keys, the
/// LayerNorm epsilon, non-causal attention, the pooling, and the token-type count.
fn encoder_metadata(
    arch: &str,
    c: &ModelConfig,
    e: &kiln_format::EmbeddingSpec,
) -> Vec<(String, Value)> {
    let k = |s: &str| format!("{arch}.{s}");
    let u = |v: u64| Value::U32(v.min(u64::from(u32::MAX)) as u32);
    let mut kv = vec![
        (k("context_length"), u(c.max_position_embeddings)),
        (k("embedding_length"), u(c.hidden_size)),
        (k("block_count"), u(c.num_layers)),
        (k("feed_forward_length"), u(c.intermediate_size)),
        (k("attention.head_count"), u(c.num_heads)),
        (
            k("attention.layer_norm_epsilon"),
            Value::F32(c.rms_norm_eps as f32),
        ),
        (k("attention.causal"), Value::Bool(false)),
        (
            "tokenizer.ggml.token_type_count".into(),
            u(c.family.type_vocab_size.unwrap_or(1)),
        ),
    ];
    kv.extend(embedding_keys(arch, e));
    kv
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mix(parts: &[(DType, u64)]) -> BTreeMap<DType, u64> {
        parts
            .iter()
            .map(|&(d, weights)| (d, weights / d.block_len() as u64 * d.block_bytes() as u64))
            .collect()
    }

    #[test]
    fn file_type_names_k_quant_mixes_as_llama_quantize_does() {
        // Gemma 3 270M's Q4_K_M file: the Q8_0 embedding is most of the bytes, Q5_0 stands in
        // for the matrices of 640-wide rows; Q4_K holds more weights than Q6_K.
        let gemma = mix(&[
            (DType::Q8_0, 262_144 * 640),
            (DType::Q5_0, 81 * 640 * 1024),
            (DType::Q4_K, 27 * 640 * 1536),
            (DType::Q6_K, 9 * 640 * 2048),
        ]);
        assert_eq!(file_type(&gemma), 15);
        let q5_k_m = mix(&[(DType::Q5_K, 1 << 20), (DType::Q6_K, 1 << 18)]);
        assert_eq!(file_type(&q5_k_m), 17);
        assert_eq!(file_type(&mix(&[(DType::Q6_K, 1 << 20)])), 18);
        // More Q6_K bytes than Q4_K bytes, but fewer weights: still Q4_K_M.
        let close = mix(&[(DType::Q4_K, 1_000_192), (DType::Q6_K, 700_160)]);
        assert!(close[&DType::Q6_K] > close[&DType::Q4_K]);
        assert_eq!(file_type(&close), 15);
        // The lower types and the IQ4 mixes (their Q5_K matrices hold fewer weights).
        let iq4_xs = mix(&[
            (DType::IQ4_XS, 1 << 20),
            (DType::Q5_K, 1 << 16),
            (DType::Q8_0, 1 << 22),
        ]);
        assert_eq!(file_type(&iq4_xs), 30);
        assert_eq!(
            file_type(&mix(&[(DType::IQ4_NL, 1 << 20), (DType::Q5_K, 1 << 10)])),
            25
        );
        assert_eq!(
            file_type(&mix(&[(DType::Q3_K, 1 << 20), (DType::Q5_K, 1 << 16)])),
            12
        );
        assert_eq!(
            file_type(&mix(&[(DType::Q2_K, 1 << 20), (DType::Q3_K, 1 << 16)])),
            10
        );
        // Without K-quants, the dtype of most bytes.
        assert_eq!(
            file_type(&mix(&[(DType::Q5_0, 1 << 20), (DType::Q8_0, 1 << 10)])),
            8
        );
        assert_eq!(file_type(&mix(&[(DType::Q5_1, 1 << 20)])), 9);
        assert_eq!(
            file_type(&mix(&[(DType::Q4_0, 1 << 20), (DType::F16, 1 << 10)])),
            2
        );
        assert_eq!(file_type(&BTreeMap::new()), 0);
    }
}
