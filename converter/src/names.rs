//! The one table of source tensor spellings, keyed by canonical role.
//!
//! Each row lists how a role is spelled by the formats Kiln reads. `{}` stands for the layer
//! number. Adding a source spelling means adding a row here and nowhere else. What differs by
//! family is read from its row of [`kiln_format::FAMILIES`]: the Hugging Face module names of
//! the norms around the MLP ([`NormModules`]) and which projections each source stores fused
//! ([`kiln_format::family::Fusion`]).

use std::borrow::Cow;

use kiln_format::family::{NormModules, Projection};
use kiln_format::{Architecture, Role, TensorName};

/// A spelling family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// Hugging Face transformers (`LlamaForCausalLM`, `Qwen3ForCausalLM`, `Gemma3ForCausalLM`…).
    HuggingFace,
    /// GGUF, as written by llama.cpp's converter.
    Gguf,
}

/// `(role, Hugging Face spelling, GGUF spelling)` of the roles every family spells alike.
const TABLE: &[(Role, &str, &str)] = &[
    (
        Role::Embed,
        "model.embed_tokens.weight",
        "token_embd.weight",
    ),
    (Role::FinalNorm, "model.norm.weight", "output_norm.weight"),
    (Role::LmHead, "lm_head.weight", "output.weight"),
    (
        Role::AttnNorm,
        "model.layers.{}.input_layernorm.weight",
        "blk.{}.attn_norm.weight",
    ),
    (
        Role::AttnQ,
        "model.layers.{}.self_attn.q_proj.weight",
        "blk.{}.attn_q.weight",
    ),
    (
        Role::AttnK,
        "model.layers.{}.self_attn.k_proj.weight",
        "blk.{}.attn_k.weight",
    ),
    (
        Role::AttnV,
        "model.layers.{}.self_attn.v_proj.weight",
        "blk.{}.attn_v.weight",
    ),
    (
        Role::AttnO,
        "model.layers.{}.self_attn.o_proj.weight",
        "blk.{}.attn_output.weight",
    ),
    (
        Role::AttnQBias,
        "model.layers.{}.self_attn.q_proj.bias",
        "blk.{}.attn_q.bias",
    ),
    (
        Role::AttnKBias,
        "model.layers.{}.self_attn.k_proj.bias",
        "blk.{}.attn_k.bias",
    ),
    (
        Role::AttnVBias,
        "model.layers.{}.self_attn.v_proj.bias",
        "blk.{}.attn_v.bias",
    ),
    (
        Role::AttnQNorm,
        "model.layers.{}.self_attn.q_norm.weight",
        "blk.{}.attn_q_norm.weight",
    ),
    (
        Role::AttnKNorm,
        "model.layers.{}.self_attn.k_norm.weight",
        "blk.{}.attn_k_norm.weight",
    ),
    (
        Role::MlpGate,
        "model.layers.{}.mlp.gate_proj.weight",
        "blk.{}.ffn_gate.weight",
    ),
    (
        Role::MlpUp,
        "model.layers.{}.mlp.up_proj.weight",
        "blk.{}.ffn_up.weight",
    ),
    (
        Role::MlpDown,
        "model.layers.{}.mlp.down_proj.weight",
        "blk.{}.ffn_down.weight",
    ),
];

/// `(role, Hugging Face spelling, GGUF spelling)` of an encoder (`BertModel`, and llama.cpp's
/// `bert` graph). Its norms sit after the residual adds: `attention.output.LayerNorm` is the
/// attention sublayer's ([`Role::AttnNorm`]), `output.LayerNorm` the MLP's ([`Role::MlpNorm`]).
const ENCODER_TABLE: &[(Role, &str, &str)] = &[
    (
        Role::Embed,
        "embeddings.word_embeddings.weight",
        "token_embd.weight",
    ),
    (
        Role::PosEmbed,
        "embeddings.position_embeddings.weight",
        "position_embd.weight",
    ),
    (
        Role::TypeEmbed,
        "embeddings.token_type_embeddings.weight",
        "token_types.weight",
    ),
    (
        Role::EmbedNorm,
        "embeddings.LayerNorm.weight",
        "token_embd_norm.weight",
    ),
    (
        Role::EmbedNormBias,
        "embeddings.LayerNorm.bias",
        "token_embd_norm.bias",
    ),
    (
        Role::AttnQ,
        "encoder.layer.{}.attention.self.query.weight",
        "blk.{}.attn_q.weight",
    ),
    (
        Role::AttnQBias,
        "encoder.layer.{}.attention.self.query.bias",
        "blk.{}.attn_q.bias",
    ),
    (
        Role::AttnK,
        "encoder.layer.{}.attention.self.key.weight",
        "blk.{}.attn_k.weight",
    ),
    (
        Role::AttnKBias,
        "encoder.layer.{}.attention.self.key.bias",
        "blk.{}.attn_k.bias",
    ),
    (
        Role::AttnV,
        "encoder.layer.{}.attention.self.value.weight",
        "blk.{}.attn_v.weight",
    ),
    (
        Role::AttnVBias,
        "encoder.layer.{}.attention.self.value.bias",
        "blk.{}.attn_v.bias",
    ),
    (
        Role::AttnO,
        "encoder.layer.{}.attention.output.dense.weight",
        "blk.{}.attn_output.weight",
    ),
    (
        Role::AttnOBias,
        "encoder.layer.{}.attention.output.dense.bias",
        "blk.{}.attn_output.bias",
    ),
    (
        Role::AttnNorm,
        "encoder.layer.{}.attention.output.LayerNorm.weight",
        "blk.{}.attn_output_norm.weight",
    ),
    (
        Role::AttnNormBias,
        "encoder.layer.{}.attention.output.LayerNorm.bias",
        "blk.{}.attn_output_norm.bias",
    ),
    (
        Role::MlpUp,
        "encoder.layer.{}.intermediate.dense.weight",
        "blk.{}.ffn_up.weight",
    ),
    (
        Role::MlpUpBias,
        "encoder.layer.{}.intermediate.dense.bias",
        "blk.{}.ffn_up.bias",
    ),
    (
        Role::MlpDown,
        "encoder.layer.{}.output.dense.weight",
        "blk.{}.ffn_down.weight",
    ),
    (
        Role::MlpDownBias,
        "encoder.layer.{}.output.dense.bias",
        "blk.{}.ffn_down.bias",
    ),
    (
        Role::MlpNorm,
        "encoder.layer.{}.output.LayerNorm.weight",
        "blk.{}.layer_output_norm.weight",
    ),
    (
        Role::MlpNormBias,
        "encoder.layer.{}.output.LayerNorm.bias",
        "blk.{}.layer_output_norm.bias",
    ),
];

/// One role's spellings in one family.
struct Row {
    role: Role,
    hf: Cow<'static, str>,
    gguf: &'static str,
}

/// A source tensor that holds several canonical ones stacked by rows, in `parts` order.
struct Fused {
    source: Source,
    /// The projection it holds; the family's row says whether its source stores it fused.
    projection: Projection,
    pattern: &'static str,
    parts: &'static [Role],
}

/// Every fused spelling. Hugging Face: Phi-3's `qkv_proj` is `[q; k; v]` and `gate_up_proj`
/// is `[gate; up]` (the models' forward slices their outputs so). GGUF: llama.cpp's converter
/// keeps both fused for Phi-3 (`attn_qkv`, and `ffn_up` of `2·intermediate` rows whose first
/// half its SwiGLU takes as the gate) and the MLP fused for GLM and GLM-4, whose loaders
/// require `ffn_up` so; they also load a fused `attn_qkv` (and its bias) for GLM, as the
/// original ChatGLM checkpoints are converted, so import accepts that too. Which family
/// stores which is its row's [`kiln_format::family::Fusion`].
const FUSED: &[Fused] = &[
    Fused {
        source: Source::HuggingFace,
        projection: Projection::Qkv,
        pattern: "model.layers.{}.self_attn.qkv_proj.weight",
        parts: &[Role::AttnQ, Role::AttnK, Role::AttnV],
    },
    Fused {
        source: Source::HuggingFace,
        projection: Projection::GateUp,
        pattern: "model.layers.{}.mlp.gate_up_proj.weight",
        parts: &[Role::MlpGate, Role::MlpUp],
    },
    Fused {
        source: Source::Gguf,
        projection: Projection::Qkv,
        pattern: "blk.{}.attn_qkv.weight",
        parts: &[Role::AttnQ, Role::AttnK, Role::AttnV],
    },
    Fused {
        source: Source::Gguf,
        projection: Projection::Qkv,
        pattern: "blk.{}.attn_qkv.bias",
        parts: &[Role::AttnQBias, Role::AttnKBias, Role::AttnVBias],
    },
    Fused {
        source: Source::Gguf,
        projection: Projection::GateUp,
        pattern: "blk.{}.ffn_up.weight",
        parts: &[Role::MlpGate, Role::MlpUp],
    },
];

/// The projections `source` stores fused for `arch` (read and written so), and those it may
/// store either way (fused read, split written).
fn fusion(source: Source, arch: Architecture) -> (&'static [Projection], &'static [Projection]) {
    let fused = &arch.spec().fused;
    match source {
        Source::HuggingFace => (fused.hf, &[]),
        Source::Gguf => (fused.gguf, fused.gguf_also_read),
    }
}

/// The canonical parts of a fused `source` tensor of an `arch` model, in row order, if `name`
/// is one (a spelling written or also read for the family).
pub fn fused_parts(source: Source, arch: Architecture, name: &str) -> Option<Vec<TensorName>> {
    let (written, also_read) = fusion(source, arch);
    FUSED.iter().find_map(|f| {
        if f.source != source
            || !(written.contains(&f.projection) || also_read.contains(&f.projection))
        {
            return None;
        }
        let layer = match_pattern(f.pattern, name)?;
        Some(
            f.parts
                .iter()
                .map(|&role| TensorName { layer, role })
                .collect(),
        )
    })
}

/// The fused `source` tensor that holds `name` in an `arch` model as Kiln writes it, if any.
fn fused_source(source: Source, arch: Architecture, name: TensorName) -> Option<String> {
    let (written, _) = fusion(source, arch);
    FUSED.iter().find_map(|f| {
        (f.source == source && written.contains(&f.projection) && f.parts.contains(&name.role))
            .then(|| {
                f.pattern
                    .replace("{}", &name.layer.unwrap_or(0).to_string())
            })
    })
}

/// The rows that apply to `arch`: the shared ones, then the norms around the MLP, which GGUF
/// spells alike in every family and Hugging Face by the modules the family's row names
/// ([`NormModules`]: Gemma 3's `post_attention_layernorm` is its attention-output norm,
/// Llama's name for the pre-MLP norm).
fn rows(arch: Architecture) -> Box<dyn Iterator<Item = Row>> {
    if arch.spec().encoder {
        return Box::new(ENCODER_TABLE.iter().map(|&(role, hf, gguf)| Row {
            role,
            hf: Cow::Borrowed(hf),
            gguf,
        }));
    }
    let NormModules { mlp, post } = arch.spec().norms;
    let norms = [
        Some((Role::MlpNorm, mlp, "blk.{}.ffn_norm.weight")),
        post.map(|(attn, _)| {
            (
                Role::AttnPostNorm,
                attn,
                "blk.{}.post_attention_norm.weight",
            )
        }),
        post.map(|(_, out)| (Role::MlpPostNorm, out, "blk.{}.post_ffw_norm.weight")),
    ];
    let shared = TABLE.iter().map(|&(role, hf, gguf)| Row {
        role,
        hf: Cow::Borrowed(hf),
        gguf,
    });
    Box::new(
        shared.chain(norms.into_iter().flatten().map(|(role, module, gguf)| Row {
            role,
            hf: Cow::Owned(format!("model.layers.{{}}.{module}.weight")),
            gguf,
        })),
    )
}

/// Buffers some checkpoints carry that are derived from the config, not weights.
/// BERT checkpoints carry their position ids as a buffer, and a pooler (a dense layer on the
/// `[CLS]` state, trained for next-sentence prediction) that sentence-transformers does not
/// use.
const IGNORED_HF: &[&str] = &[
    "model.layers.{}.self_attn.rotary_emb.inv_freq",
    "embeddings.position_ids",
    "pooler.dense.weight",
    "pooler.dense.bias",
];

fn pattern(row: &Row, source: Source) -> &str {
    match source {
        Source::HuggingFace => &row.hf,
        Source::Gguf => row.gguf,
    }
}

fn match_pattern(pat: &str, name: &str) -> Option<Option<u32>> {
    match pat.split_once("{}") {
        None => (pat == name).then_some(None),
        Some((pre, post)) => {
            let num = name.strip_prefix(pre)?.strip_suffix(post)?;
            if num.is_empty()
                || (num.len() > 1 && num.starts_with('0'))
                || !num.bytes().all(|b| b.is_ascii_digit())
            {
                return None;
            }
            num.parse().ok().map(Some)
        }
    }
}

/// The canonical name of a source tensor of an `arch` model, if the table knows its spelling.
pub fn canonical(source: Source, arch: Architecture, name: &str) -> Option<TensorName> {
    if source == Source::Gguf {
        if let Some(&(role, _)) = GGUF_DENSE.iter().find(|(_, n)| *n == name) {
            return Some(TensorName::global(role));
        }
    }
    rows(arch).find_map(|row| {
        match_pattern(pattern(&row, source), name).map(|layer| TensorName {
            layer,
            role: row.role,
        })
    })
}

/// The source spelling of a canonical name of an `arch` model (for a part of a tensor the
/// source writes fused, the fused tensor's name).
///
/// # Panics
/// If `arch` has no such role (callers name only roles from [`kiln_format::expected_tensors`]).
pub fn source_name(source: Source, arch: Architecture, name: TensorName) -> String {
    if let Some(fused) = fused_source(source, arch, name) {
        return fused;
    }
    if let (Source::Gguf, Some(&(_, spelled))) =
        (source, GGUF_DENSE.iter().find(|(r, _)| *r == name.role))
    {
        return spelled.to_string();
    }
    // A Dense module's weights come from its own directory, not the checkpoint's names.
    if let Some(k) = name.role.dense_index() {
        let part = if name.role.is_matrix() {
            "weight"
        } else {
            "bias"
        };
        return format!("linear.{part} of Dense module {k}");
    }
    let row = rows(arch)
        .find(|r| r.role == name.role)
        .expect("every role of the family has a row");
    let pat = pattern(&row, source);
    match name.layer {
        Some(l) => pat.replace("{}", &l.to_string()),
        None => pat.to_string(),
    }
}

/// llama.cpp's names of an embedding model's Dense projections (`gemma-embedding`: the
/// sentence-transformers modules 2 and 3), the same in every family.
const GGUF_DENSE: [(Role, &str); 4] = [
    (Role::Dense0, "dense_2.weight"),
    (Role::Dense0Bias, "dense_2.bias"),
    (Role::Dense1, "dense_3.weight"),
    (Role::Dense1Bias, "dense_3.bias"),
];

/// Whether a Hugging Face tensor is a derived buffer that conversion may skip.
pub fn is_ignorable_hf(name: &str) -> bool {
    IGNORED_HF.iter().any(|p| match_pattern(p, name).is_some())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hf_and_gguf_spellings_meet_in_one_canonical_name() {
        let hf = canonical(
            Source::HuggingFace,
            Architecture::Llama,
            "model.layers.3.self_attn.q_proj.weight",
        );
        let gg = canonical(Source::Gguf, Architecture::Llama, "blk.3.attn_q.weight");
        assert_eq!(hf, gg);
        assert_eq!(hf.unwrap().to_string(), "layers.3.attn.q.weight");
    }

    #[test]
    fn every_role_round_trips_through_both_spellings() {
        for arch in Architecture::ALL {
            for row in rows(arch) {
                let role = row.role;
                let name = if role.per_layer() {
                    TensorName::layer(12, role)
                } else {
                    TensorName::global(role)
                };
                for src in [Source::HuggingFace, Source::Gguf] {
                    let spelled = source_name(src, arch, name);
                    match fused_parts(src, arch, &spelled) {
                        Some(parts) => assert!(parts.contains(&name), "{arch:?} {spelled}"),
                        _ => assert_eq!(canonical(src, arch, &spelled), Some(name), "{arch:?}"),
                    }
                }
            }
        }
    }

    /// Every tensor a family's configuration implies has a spelling in both sources, and
    /// Gemma 3's `post_attention_layernorm` is its attention-output norm, not the pre-MLP one.
    #[test]
    fn every_family_spells_every_expected_role() {
        for arch in Architecture::ALL {
            if arch.spec().encoder {
                continue;
            }
            // (A Dense module's tensors are read from its own files: `checkpoint.rs`.)
            let spelled = |r: &Role| !encoder_only(*r) && r.dense_index().is_none();
            for role in Role::ALL.into_iter().filter(spelled) {
                let covered = rows(arch).any(|r| r.role == role);
                let needed = matches!(role, Role::AttnPostNorm | Role::MlpPostNorm)
                    .then_some(matches!(arch, Architecture::Gemma3 | Architecture::Glm4))
                    .unwrap_or(true);
                assert_eq!(covered, needed, "{arch:?} {role:?}");
            }
        }
        let n = "model.layers.2.post_attention_layernorm.weight";
        assert_eq!(
            canonical(Source::HuggingFace, Architecture::Gemma3, n),
            Some(TensorName::layer(2, Role::AttnPostNorm))
        );
        assert_eq!(
            canonical(Source::HuggingFace, Architecture::Llama, n),
            Some(TensorName::layer(2, Role::MlpNorm))
        );
    }

    /// The roles no decoder family has (LayerNorm biases, learned positions, BERT's biases).
    fn encoder_only(role: Role) -> bool {
        matches!(
            role,
            Role::PosEmbed
                | Role::TypeEmbed
                | Role::EmbedNorm
                | Role::EmbedNormBias
                | Role::FinalNormBias
                | Role::AttnNormBias
                | Role::MlpNormBias
                | Role::AttnOBias
                | Role::MlpUpBias
                | Role::MlpDownBias
        )
    }

    /// An encoder's every role (those of a `BertModel` config) has a spelling in both
    /// sources, and its norms are the ones after each residual add.
    #[test]
    fn encoders_spell_every_bert_role() {
        let arch = Architecture::Bert;
        let config = kiln_format::ModelConfig {
            architecture: arch,
            source_architecture: "BertModel".into(),
            hidden_size: 8,
            intermediate_size: 16,
            num_layers: 2,
            num_heads: 2,
            num_kv_heads: 2,
            head_dim: 4,
            vocab_size: 10,
            max_position_embeddings: 32,
            rms_norm_eps: 1e-12,
            rope_theta: 1e4,
            rope_scaling: None,
            tie_word_embeddings: true,
            attention_bias: true,
            sliding_window: None,
            bos_token_id: None,
            eos_token_ids: vec![],
            family: kiln_format::FamilyOptions {
                type_vocab_size: Some(2),
                embedding: Some(kiln_format::EmbeddingSpec::pooled(
                    kiln_format::Pooling::Mean,
                    true,
                )),
                ..arch.spec().options()
            },
        };
        let expected = kiln_format::expected_tensors(&config);
        assert_eq!(expected.len(), 5 + 2 * 16);
        for (name, _) in expected {
            for src in [Source::HuggingFace, Source::Gguf] {
                let spelled = source_name(src, arch, name);
                assert_eq!(canonical(src, arch, &spelled), Some(name), "{spelled}");
            }
        }
        assert_eq!(
            canonical(
                Source::HuggingFace,
                arch,
                "encoder.layer.3.attention.output.LayerNorm.bias"
            ),
            Some(TensorName::layer(3, Role::AttnNormBias))
        );
        assert!(is_ignorable_hf("pooler.dense.weight"));
    }

    #[test]
    fn fused_tensors_split_in_row_order_for_their_families_only() {
        let qkv = "model.layers.3.self_attn.qkv_proj.weight";
        let parts = fused_parts(Source::HuggingFace, Architecture::Phi3, qkv).unwrap();
        assert_eq!(
            parts,
            [Role::AttnQ, Role::AttnK, Role::AttnV].map(|r| TensorName::layer(3, r))
        );
        assert_eq!(
            fused_parts(Source::HuggingFace, Architecture::Glm4, qkv),
            None
        );
        assert_eq!(
            fused_parts(Source::HuggingFace, Architecture::Llama, qkv),
            None
        );
        let gu = "model.layers.0.mlp.gate_up_proj.weight";
        for arch in [Architecture::Phi3, Architecture::Glm4, Architecture::Glm] {
            assert_eq!(
                fused_parts(Source::HuggingFace, arch, gu).unwrap(),
                [Role::MlpGate, Role::MlpUp].map(|r| TensorName::layer(0, r))
            );
        }
        assert_eq!(
            source_name(
                Source::HuggingFace,
                Architecture::Phi3,
                TensorName::layer(3, Role::AttnV)
            ),
            qkv
        );
        assert_eq!(
            canonical(
                Source::HuggingFace,
                Architecture::Glm4,
                "model.layers.1.post_self_attn_layernorm.weight"
            ),
            Some(TensorName::layer(1, Role::AttnPostNorm))
        );
    }

    /// llama.cpp's fused spellings: Phi-3 writes `attn_qkv` and a `[gate; up]` `ffn_up`; GLM
    /// and GLM-4 write split q/k/v (a fused `attn_qkv` is read, not written) and the fused
    /// `ffn_up`; other families keep `ffn_up` as the up projection alone.
    #[test]
    fn gguf_fused_tensors_are_written_and_read_per_family() {
        let up = |arch| source_name(Source::Gguf, arch, TensorName::layer(1, Role::MlpGate));
        for arch in [Architecture::Phi3, Architecture::Glm4, Architecture::Glm] {
            assert_eq!(up(arch), "blk.1.ffn_up.weight");
            assert_eq!(
                fused_parts(Source::Gguf, arch, "blk.1.ffn_up.weight").unwrap(),
                [Role::MlpGate, Role::MlpUp].map(|r| TensorName::layer(1, r))
            );
            assert_eq!(
                fused_parts(Source::Gguf, arch, "blk.2.attn_qkv.weight").unwrap(),
                [Role::AttnQ, Role::AttnK, Role::AttnV].map(|r| TensorName::layer(2, r))
            );
        }
        assert_eq!(up(Architecture::Llama), "blk.1.ffn_gate.weight");
        assert_eq!(
            fused_parts(Source::Gguf, Architecture::Llama, "blk.1.ffn_up.weight"),
            None
        );
        let q = TensorName::layer(0, Role::AttnQ);
        assert_eq!(
            source_name(Source::Gguf, Architecture::Phi3, q),
            "blk.0.attn_qkv.weight"
        );
        assert_eq!(
            source_name(Source::Gguf, Architecture::Glm4, q),
            "blk.0.attn_q.weight"
        );
        assert_eq!(
            fused_parts(Source::Gguf, Architecture::Glm, "blk.0.attn_qkv.bias").unwrap(),
            [Role::AttnQBias, Role::AttnKBias, Role::AttnVBias].map(|r| TensorName::layer(0, r))
        );
    }

    #[test]
    fn near_misses_are_unknown() {
        for n in [
            "model.layers.x.mlp.up_proj.weight",
            "model.layers.01.mlp.up_proj.weight",
            "model.layers.1.mlp.up_proj.weight.extra",
            "model.layers.-1.mlp.up_proj.weight",
            "embed_tokens.weight",
        ] {
            assert_eq!(
                canonical(Source::HuggingFace, Architecture::Llama, n),
                None,
                "{n}"
            );
        }
        assert!(is_ignorable_hf(
            "model.layers.7.self_attn.rotary_emb.inv_freq"
        ));
    }
}
