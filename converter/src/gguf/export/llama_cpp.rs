//! What llama.cpp's graphs assume of each family (its row's [`kiln_format::family::GgufSpec`]),
//! checked before an export: a model llama.cpp would run differently is refused, and what a
//! user should know about one it runs faithfully is noted.

use kiln_format::family::{GgufWindow, SlidingLayers};
use kiln_format::{AttentionMask, DenseActivation, LayerKind, ModelConfig, RopeScaling, FAMILIES};

use super::super::value::{Array, Value};

/// Why llama.cpp would run this model differently from Kiln, if its graph hard-wires the
/// family's options ([`GgufSpec::hard_wired`]: Phi-3, GLM, GLM-4): the configuration field at
/// fault and the reason. Those graphs state no more than the keys [`config_metadata`] writes
/// (the rotated width among them); anything else Kiln's configuration holds (an option off
/// the family's row, a window where the graph has none, a square output projection for
/// `phi3`/`chatglm`) has no GGUF key, so such a model is refused rather than written as a
/// different one.
///
/// [`GgufSpec::hard_wired`]: kiln_format::family::GgufSpec::hard_wired
/// [`config_metadata`]: super::keys::config_metadata
pub fn hard_wired_mismatch(c: &ModelConfig) -> Option<(&'static str, String)> {
    let spec = c.architecture.spec();
    if !spec.gguf.hard_wired {
        return None;
    }
    if let Some(m) = family_option_mismatch(c) {
        return Some(m);
    }
    if let (GgufWindow::Absent, Some(w)) = (spec.gguf.window, c.sliding_window) {
        return Some((
            "sliding_window",
            // (The families without a window are GLM's.)
            format!("{w}: llama.cpp's GLM graphs attend over the whole context"),
        ));
    }
    if let Some(m) = rope_scaling_mismatch(c) {
        return Some(m);
    }
    // `phi3` and `chatglm` load the output projection as hidden × hidden.
    let q = c.num_heads * c.head_dim;
    if spec.gguf.square_attn_output && q != c.hidden_size {
        return Some((
            "head_dim",
            format!(
                "{} heads of {} make {q} query rows, but llama.cpp's graph for this family \
                 needs them to equal hidden_size ({})",
                c.num_heads, c.head_dim, c.hidden_size
            ),
        ));
    }
    None
}

/// The first family option of `c` that differs from what the family's llama.cpp graph
/// assumes.
fn family_option_mismatch(c: &ModelConfig) -> Option<(&'static str, String)> {
    let spec = c.architecture.spec();
    let want = spec.options();
    let f = &c.family;
    // Each option beside the family's, both as Debug prints them (equal exactly when the values
    // are, for these types), so that the message can show them.
    let show = |x: &dyn std::fmt::Debug| format!("{x:?}");
    let fields = [
        ("qk_norm", show(&f.qk_norm), show(&want.qk_norm)),
        ("post_norms", show(&f.post_norms), show(&want.post_norms)),
        ("norm_style", show(&f.norm_style), show(&want.norm_style)),
        (
            "mlp_activation",
            show(&f.mlp_activation),
            show(&want.mlp_activation),
        ),
        ("embed_scale", show(&f.embed_scale), show(&want.embed_scale)),
        ("attn_scale", show(&f.attn_scale), show(&want.attn_scale)),
        ("layer_kinds", show(&f.layer_kinds), show(&want.layer_kinds)),
        (
            "rope_local_theta",
            show(&f.rope_local_theta),
            show(&want.rope_local_theta),
        ),
        (
            "rope_pairing",
            show(&f.rope_pairing),
            show(&want.rope_pairing),
        ),
    ];
    let (field, found, want) = fields.into_iter().find(|(_, a, b)| a != b)?;
    Some((
        field,
        format!(
            "{found}, where llama.cpp's graph for this family assumes {want} and no GGUF \
             key says otherwise"
        ),
    ))
}

/// A RoPE scaling whose factors llama.cpp does not read for this family.
fn rope_scaling_mismatch(c: &ModelConfig) -> Option<(&'static str, String)> {
    let spec = c.architecture.spec();
    match &c.rope_scaling {
        Some(RopeScaling::Llama3 { .. }) => Some((
            "rope_scaling",
            "Llama 3 scaling: llama.cpp reads its factors (`rope_freqs`) for Llama-family \
                 graphs only"
                .into(),
        )),
        Some(RopeScaling::LongRope { .. }) if !spec.longrope => Some((
            "rope_scaling",
            format!(
                "LongRoPE: llama.cpp reads its factors for {} only",
                FAMILIES
                    .iter()
                    .filter(|s| s.longrope)
                    .map(|s| format!("`{}`", s.gguf.name))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        )),
        _ => None,
    }
}

/// The `general.architecture` an export writes: the family's graph, or, for a decoder family
/// with bidirectional attention, its embedding graph ([`GgufSpec::embedding_name`]).
///
/// [`GgufSpec::embedding_name`]: kiln_format::family::GgufSpec::embedding_name
pub fn gguf_name(c: &ModelConfig) -> &'static str {
    let gguf = &c.architecture.spec().gguf;
    match (bidirectional_decoder(c), gguf.embedding_name) {
        (true, Some(name)) => name,
        _ => gguf.name,
    }
}

/// Whether `c` is a decoder family run with bidirectional attention (EmbeddingGemma).
fn bidirectional_decoder(c: &ModelConfig) -> bool {
    c.family.attention_mask == AttentionMask::Bidirectional && !c.architecture.spec().encoder
}

/// Why llama.cpp would compute an embedding model's vectors differently, if it would: a
/// bidirectional decoder whose family has no embedding graph, or Dense projections other than
/// the ones llama.cpp's `gemma-embedding` graph applies (`dense_2`, then `dense_3` back to the
/// hidden width, without biases or activations).
pub fn embedding_mismatch(c: &ModelConfig) -> Option<(&'static str, String)> {
    let spec = c.architecture.spec();
    if bidirectional_decoder(c) && spec.gguf.embedding_name.is_none() {
        return Some((
            "attention_mask",
            format!(
                "bidirectional: llama.cpp has no bidirectional graph for `{}`",
                spec.gguf.name
            ),
        ));
    }
    let dense = c
        .family
        .embedding
        .as_ref()
        .map_or(&[][..], |e| &e.dense[..]);
    if dense.is_empty() {
        return None;
    }
    let why = if !bidirectional_decoder(c) {
        format!(
            "{} Dense layer(s): llama.cpp applies them in its bidirectional embedding graphs \
             only",
            dense.len()
        )
    } else if let Some(d) = dense.iter().find(|d| d.bias) {
        format!(
            "a Dense layer {}→{} with a bias, which llama.cpp's `{}` graph does not load",
            d.in_features,
            d.out_features,
            gguf_name(c)
        )
    } else if let Some(d) = dense
        .iter()
        .find(|d| d.activation != DenseActivation::Identity)
    {
        format!(
            "a Dense layer {}→{} with {:?}, where llama.cpp's graph applies none",
            d.in_features, d.out_features, d.activation
        )
    } else if dense.len() == 2 && dense[1].out_features != c.hidden_size {
        format!(
            "the second Dense layer writes {} values; llama.cpp requires the hidden width ({})",
            dense[1].out_features, c.hidden_size
        )
    } else {
        return None;
    };
    Some(("embedding.dense", why))
}

/// Why llama.cpp would run this model of a family with sliding layers (Gemma 3) differently
/// from Kiln, if it would. Its GGUF states only the window; llama.cpp fixes the rest (every
/// [`SlidingLayers::global_every`]-th layer global, the sliding layers' RoPE base, scores
/// scaled by `1/√head_dim`, or `1/√(hidden/heads)` for the 62-layer 27B, and the family's
/// options), so a model that differs cannot be written as one.
///
/// [`SlidingLayers::global_every`]: kiln_format::family::SlidingLayers::global_every
pub fn sliding_layers_mismatch(c: &ModelConfig, layers: &SlidingLayers) -> Option<String> {
    let spec = c.architecture.spec();
    let f = &c.family;
    let every = layers.global_every;
    let pattern = (0..c.num_layers)
        .map(|i| {
            if (i + 1) % every == 0 {
                LayerKind::Full
            } else {
                LayerKind::Sliding
            }
        })
        .collect::<Vec<_>>();
    if f.layer_kinds != pattern {
        return Some(format!(
            "its layer kinds ({:?}) are not every {} layer global, the pattern llama.cpp assumes",
            f.layer_kinds,
            ordinal(every)
        ));
    }
    if f.rope_local_theta != Some(layers.local_rope_theta) {
        return Some(format!(
            "its sliding layers' RoPE base is {:?}, not the {} llama.cpp assumes",
            f.rope_local_theta, layers.local_rope_theta
        ));
    }
    let scalar = if c.num_layers == 62 {
        c.hidden_size as f64 / c.num_heads as f64
    } else {
        c.head_dim as f64
    };
    let want = scalar.powf(-0.5);
    match f.attn_scale {
        Some(s) if (s - want).abs() <= 1e-9 * want => {}
        other => {
            return Some(format!(
                "its score scale is {other:?}, not the {want} (1/√{scalar}) llama.cpp uses"
            ))
        }
    }
    let embed_scale = spec
        .scaled_embeddings
        .then(|| f64::from((c.hidden_size as f64).sqrt() as f32));
    if c.sliding_window.is_none()
        || f.qk_norm != spec.qk_norm
        || f.post_norms != spec.post_norms
        || f.norm_style != spec.norm_style
        || f.mlp_activation != spec.mlp_activation
        || f.embed_scale != embed_scale
        || f.rotary_dim.is_some()
    {
        return Some(format!(
            "its window, norms, activation, embedding scale or rotary width differ from \
             {}'s as llama.cpp runs it",
            spec.display
        ));
    }
    None
}

/// `sixth` for 6: the pattern's period in words.
fn ordinal(n: u64) -> String {
    const WORDS: [&str; 8] = [
        "first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth",
    ];
    match n {
        1..=8 => WORDS[n as usize - 1].to_string(),
        n => format!("{n}th"),
    }
}

/// llama.cpp (`llama-vocab.cpp`) marks `</s>`, `<unk>`, `<s>` and `<|endoftext|>` as special
/// in any model whose `general.name` contains `phi3` or `phi-3`, and fails to load one whose
/// vocabulary lacks any of them. The name is the input file's stem, so the remedy is a rename.
pub(super) fn phi_name_notice(name: &str, tok_kv: &[(String, Value)]) -> Option<String> {
    let lower = name.to_lowercase();
    if !(lower.contains("phi3") || lower.contains("phi-3")) {
        return None;
    }
    let tokens = tok_kv.iter().find_map(|(k, v)| match v {
        Value::Array(Array::Str(t)) if k == "tokenizer.ggml.tokens" => Some(t),
        _ => None,
    })?;
    let missing: Vec<&str> = ["</s>", "<unk>", "<s>", "<|endoftext|>"]
        .into_iter()
        .filter(|want| !tokens.iter().any(|t| t == want))
        .collect();
    (!missing.is_empty()).then(|| {
        format!(
            "general.name `{name}` names Phi-3, for which llama.cpp looks up {} in the \
             vocabulary and fails to load the file without them: rename the input file (its \
             stem is the name) to run it in llama.cpp",
            missing.join(", ")
        )
    })
}

/// What a user should know before running an exported model in llama.cpp: where its graph,
/// as it stands, departs from Kiln's and transformers' for a configuration the file states
/// faithfully (Phi-3's window, which llama.cpp ignores, and LongRoPE's choice of factors).
pub(super) fn notices(c: &ModelConfig) -> Vec<String> {
    let spec = c.architecture.spec();
    let mut out = Vec::new();
    if let (true, Some(w)) = (spec.gguf.ignores_window, c.sliding_window) {
        out.push(format!(
            "{}.attention.sliding_window = {w} is written as llama.cpp's converter writes it, \
             but llama.cpp currently disables {}'s window and attends over the whole \
             context: its results differ from Kiln's past {w} tokens",
            spec.gguf.name, spec.display
        ));
    }
    if let (
        true,
        Some(RopeScaling::LongRope {
            original_max_position_embeddings: n,
            ..
        }),
    ) = (spec.longrope, &c.rope_scaling)
    {
        out.push(format!(
            "llama.cpp applies LongRoPE's long factors at every position when its context \
             (--ctx-size, rounded up to a multiple of 256) exceeds {n}, the short ones \
             otherwise; Kiln and transformers choose by the length of the sequence in hand"
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_format::{DenseLayer, EmbeddingSpec, Pooling};

    /// The committed EmbeddingGemma-layout fixture's configuration, with `dense` layers.
    fn embedding_gemma(dense: &[(u64, u64, bool, DenseActivation)]) -> ModelConfig {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../fixtures/embedding/embedding-gemma-f32/config.json");
        let text = std::fs::read_to_string(&path).unwrap();
        let mut c = crate::hf_config::parse(&path, &text, None).unwrap();
        let mut e = EmbeddingSpec::pooled(Pooling::Mean, true);
        e.dense = dense
            .iter()
            .map(
                |&(in_features, out_features, bias, activation)| DenseLayer {
                    in_features,
                    out_features,
                    bias,
                    activation,
                },
            )
            .collect();
        c.family.embedding = Some(e);
        c
    }

    #[test]
    fn bidirectional_gemma_exports_as_gemma_embedding_with_its_dense_layers_only() {
        use DenseActivation::{Identity, Tanh};
        let plain = embedding_gemma(&[(64, 96, false, Identity), (96, 64, false, Identity)]);
        assert_eq!(gguf_name(&plain), "gemma-embedding");
        assert_eq!(embedding_mismatch(&plain), None);
        assert_eq!(embedding_mismatch(&embedding_gemma(&[])), None);
        for (dense, want) in [
            (vec![(64, 96, true, Identity)], "bias"),
            (vec![(64, 96, false, Tanh)], "Tanh"),
            (
                vec![(64, 96, false, Identity), (96, 32, false, Identity)],
                "hidden width",
            ),
        ] {
            let (field, why) = embedding_mismatch(&embedding_gemma(&dense)).unwrap();
            assert_eq!(field, "embedding.dense");
            assert!(why.contains(want), "{want}: {why}");
        }
        // Causal: the family's own graph, which applies no Dense layers.
        let mut causal = plain.clone();
        causal.family.attention_mask = AttentionMask::Causal;
        assert_eq!(gguf_name(&causal), "gemma3");
        let (field, _) = embedding_mismatch(&causal).unwrap();
        assert_eq!(field, "embedding.dense");
        // A bidirectional decoder of a family without an embedding graph.
        let mut qwen = embedding_gemma(&[]);
        qwen.architecture = kiln_format::Architecture::Qwen3;
        let (field, why) = embedding_mismatch(&qwen).unwrap();
        assert_eq!(field, "attention_mask");
        assert!(why.contains("qwen3"), "{why}");
    }
}
