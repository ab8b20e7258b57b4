//! The one table of source tensor spellings, keyed by canonical role.
//!
//! Each row lists how a role is spelled by the formats Kiln reads. `{}` stands for the layer
//! number. Adding a source spelling means adding a row here and nowhere else.

use kiln_format::{Role, TensorName};

/// A spelling family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// Hugging Face transformers (`LlamaForCausalLM`, `MistralForCausalLM`, `Qwen2ForCausalLM`).
    HuggingFace,
    /// GGUF, as written by llama.cpp's converter.
    Gguf,
}

/// `(role, Hugging Face spelling, GGUF spelling)`.
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
        Role::MlpNorm,
        "model.layers.{}.post_attention_layernorm.weight",
        "blk.{}.ffn_norm.weight",
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

/// Buffers some checkpoints carry that are derived from the config, not weights.
const IGNORED_HF: &[&str] = &["model.layers.{}.self_attn.rotary_emb.inv_freq"];

fn pattern(row: &(Role, &'static str, &'static str), source: Source) -> &'static str {
    match source {
        Source::HuggingFace => row.1,
        Source::Gguf => row.2,
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

/// The canonical name of a source tensor, if the table knows its spelling.
pub fn canonical(source: Source, name: &str) -> Option<TensorName> {
    TABLE.iter().find_map(|row| {
        match_pattern(pattern(row, source), name).map(|layer| TensorName { layer, role: row.0 })
    })
}

/// The source spelling of a canonical name.
pub fn source_name(source: Source, name: TensorName) -> String {
    let row = TABLE
        .iter()
        .find(|r| r.0 == name.role)
        .expect("every role has a row");
    let pat = pattern(row, source);
    match name.layer {
        Some(l) => pat.replace("{}", &l.to_string()),
        None => pat.to_string(),
    }
}

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
            "model.layers.3.self_attn.q_proj.weight",
        );
        let gg = canonical(Source::Gguf, "blk.3.attn_q.weight");
        assert_eq!(hf, gg);
        assert_eq!(hf.unwrap().to_string(), "layers.3.attn.q.weight");
    }

    #[test]
    fn every_role_round_trips_through_both_spellings() {
        for role in Role::ALL {
            let name = if role.per_layer() {
                TensorName::layer(12, role)
            } else {
                TensorName::global(role)
            };
            for src in [Source::HuggingFace, Source::Gguf] {
                assert_eq!(canonical(src, &source_name(src, name)), Some(name));
            }
        }
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
            assert_eq!(canonical(Source::HuggingFace, n), None, "{n}");
        }
        assert!(is_ignorable_hf(
            "model.layers.7.self_attn.rotary_emb.inv_freq"
        ));
    }
}
