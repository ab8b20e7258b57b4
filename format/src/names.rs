//! Canonical tensor names: one spelling per role, whatever the source called it.
//!
//! A `.kiln` file always uses these names, so the runner, quantizer and verifier never see a
//! source's naming (`model.layers.3.self_attn.q_proj.weight` in Hugging Face files,
//! `blk.3.attn_q.weight` in GGUF). The converter owns the table of source spellings; this module
//! owns the canonical side, keyed by [`Role`] and layer.

use std::fmt;

/// What a tensor is in a decoder of one of the supported families.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Role {
    /// Token embedding matrix, `(vocab, hidden)`.
    Embed,
    /// Final RMSNorm weight, `(hidden)`.
    FinalNorm,
    /// Output projection, `(vocab, hidden)`; absent when embeddings are tied.
    LmHead,
    /// Pre-attention RMSNorm weight, `(hidden)`.
    AttnNorm,
    /// Query projection, `(heads*head_dim, hidden)`.
    AttnQ,
    /// Key projection, `(kv_heads*head_dim, hidden)`.
    AttnK,
    /// Value projection, `(kv_heads*head_dim, hidden)`.
    AttnV,
    /// Attention output projection, `(hidden, heads*head_dim)`.
    AttnO,
    /// Query bias (Qwen2), `(heads*head_dim)`.
    AttnQBias,
    /// Key bias (Qwen2), `(kv_heads*head_dim)`.
    AttnKBias,
    /// Value bias (Qwen2), `(kv_heads*head_dim)`.
    AttnVBias,
    /// Per-head RMSNorm weight of the queries (Qwen3, Gemma 3), `(head_dim)`.
    AttnQNorm,
    /// Per-head RMSNorm weight of the keys (Qwen3, Gemma 3), `(head_dim)`.
    AttnKNorm,
    /// RMSNorm weight on the attention output before the residual add (Gemma 3), `(hidden)`.
    AttnPostNorm,
    /// Pre-MLP RMSNorm weight, `(hidden)`.
    MlpNorm,
    /// RMSNorm weight on the MLP output before the residual add (Gemma 3), `(hidden)`.
    MlpPostNorm,
    /// SwiGLU gate projection, `(intermediate, hidden)`.
    MlpGate,
    /// SwiGLU up projection, `(intermediate, hidden)`.
    MlpUp,
    /// SwiGLU down projection, `(hidden, intermediate)`.
    MlpDown,
    /// Learned position embeddings (BERT), `(max_position_embeddings, hidden)`.
    PosEmbed,
    /// Token-type embeddings (BERT), `(type_vocab_size, hidden)`.
    TypeEmbed,
    /// LayerNorm weight on the summed embeddings (BERT), `(hidden)`.
    EmbedNorm,
    /// Its bias, `(hidden)`.
    EmbedNormBias,
    /// The final norm's bias (LayerNorm families), `(hidden)`.
    FinalNormBias,
    /// The attention norm's bias (LayerNorm families), `(hidden)`.
    AttnNormBias,
    /// The MLP norm's bias (LayerNorm families), `(hidden)`.
    MlpNormBias,
    /// Attention output bias (BERT), `(hidden)`.
    AttnOBias,
    /// Up projection bias (BERT), `(intermediate)`.
    MlpUpBias,
    /// Down projection bias (BERT), `(hidden)`.
    MlpDownBias,
    /// An embedding model's first `Dense` projection of the pooled vector, `(out, in)`.
    Dense0,
    /// Its bias, `(out)`.
    Dense0Bias,
    /// The second `Dense` projection (EmbeddingGemma's 3072 → 768), `(out, in)`.
    Dense1,
    /// Its bias, `(out)`.
    Dense1Bias,
}

impl Role {
    /// Every role.
    pub const ALL: [Role; 33] = [
        Role::Embed,
        Role::FinalNorm,
        Role::LmHead,
        Role::AttnNorm,
        Role::AttnQ,
        Role::AttnK,
        Role::AttnV,
        Role::AttnO,
        Role::AttnQBias,
        Role::AttnKBias,
        Role::AttnVBias,
        Role::AttnQNorm,
        Role::AttnKNorm,
        Role::AttnPostNorm,
        Role::MlpNorm,
        Role::MlpPostNorm,
        Role::MlpGate,
        Role::MlpUp,
        Role::MlpDown,
        Role::PosEmbed,
        Role::TypeEmbed,
        Role::EmbedNorm,
        Role::EmbedNormBias,
        Role::FinalNormBias,
        Role::AttnNormBias,
        Role::MlpNormBias,
        Role::AttnOBias,
        Role::MlpUpBias,
        Role::MlpDownBias,
        Role::Dense0,
        Role::Dense0Bias,
        Role::Dense1,
        Role::Dense1Bias,
    ];

    /// The dense layer a role belongs to, if it is one's weight or bias.
    pub const fn dense_index(self) -> Option<usize> {
        match self {
            Role::Dense0 | Role::Dense0Bias => Some(0),
            Role::Dense1 | Role::Dense1Bias => Some(1),
            _ => None,
        }
    }

    /// The weight and bias roles of dense layer `k` (`k <` [`crate::metadata::MAX_DENSE_LAYERS`]).
    pub const fn dense(k: usize) -> Option<(Role, Role)> {
        match k {
            0 => Some((Role::Dense0, Role::Dense0Bias)),
            1 => Some((Role::Dense1, Role::Dense1Bias)),
            _ => None,
        }
    }

    /// Whether the role repeats once per decoder layer.
    pub const fn per_layer(self) -> bool {
        !matches!(
            self,
            Role::Embed
                | Role::FinalNorm
                | Role::LmHead
                | Role::PosEmbed
                | Role::TypeEmbed
                | Role::EmbedNorm
                | Role::EmbedNormBias
                | Role::FinalNormBias
                | Role::Dense0
                | Role::Dense0Bias
                | Role::Dense1
                | Role::Dense1Bias
        )
    }

    /// The name's part after `layers.N.` (or the whole name for model-level roles).
    pub const fn suffix(self) -> &'static str {
        match self {
            Role::Embed => "embed.weight",
            Role::FinalNorm => "final_norm.weight",
            Role::LmHead => "lm_head.weight",
            Role::AttnNorm => "attn_norm.weight",
            Role::AttnQ => "attn.q.weight",
            Role::AttnK => "attn.k.weight",
            Role::AttnV => "attn.v.weight",
            Role::AttnO => "attn.o.weight",
            Role::AttnQBias => "attn.q.bias",
            Role::AttnKBias => "attn.k.bias",
            Role::AttnVBias => "attn.v.bias",
            Role::AttnQNorm => "attn.q_norm.weight",
            Role::AttnKNorm => "attn.k_norm.weight",
            Role::AttnPostNorm => "attn_post_norm.weight",
            Role::MlpNorm => "mlp_norm.weight",
            Role::MlpPostNorm => "mlp_post_norm.weight",
            Role::MlpGate => "mlp.gate.weight",
            Role::MlpUp => "mlp.up.weight",
            Role::MlpDown => "mlp.down.weight",
            Role::PosEmbed => "pos_embed.weight",
            Role::TypeEmbed => "type_embed.weight",
            Role::EmbedNorm => "embed_norm.weight",
            Role::EmbedNormBias => "embed_norm.bias",
            Role::FinalNormBias => "final_norm.bias",
            Role::AttnNormBias => "attn_norm.bias",
            Role::MlpNormBias => "mlp_norm.bias",
            Role::AttnOBias => "attn.o.bias",
            Role::MlpUpBias => "mlp.up.bias",
            Role::MlpDownBias => "mlp.down.bias",
            Role::Dense0 => "dense.0.weight",
            Role::Dense0Bias => "dense.0.bias",
            Role::Dense1 => "dense.1.weight",
            Role::Dense1Bias => "dense.1.bias",
        }
    }

    /// Whether the tensor is a norm's weight (whose meaning `NormStyle` sets; a LayerNorm's
    /// bias is not one).
    pub const fn is_norm(self) -> bool {
        matches!(
            self,
            Role::FinalNorm
                | Role::EmbedNorm
                | Role::AttnNorm
                | Role::AttnQNorm
                | Role::AttnKNorm
                | Role::AttnPostNorm
                | Role::MlpNorm
                | Role::MlpPostNorm
        )
    }

    /// Whether the tensor is a projection or token-embedding matrix, which quantization may
    /// store in blocks (the small position and token-type tables stay as they are).
    pub const fn is_matrix(self) -> bool {
        matches!(
            self,
            Role::Embed
                | Role::LmHead
                | Role::AttnQ
                | Role::AttnK
                | Role::AttnV
                | Role::AttnO
                | Role::MlpGate
                | Role::MlpUp
                | Role::MlpDown
                | Role::Dense0
                | Role::Dense1
        )
    }
}

/// A role, with its layer for per-layer roles.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TensorName {
    /// Decoder layer, `None` for model-level tensors.
    pub layer: Option<u32>,
    /// What the tensor is.
    pub role: Role,
}

impl TensorName {
    /// A model-level tensor.
    pub const fn global(role: Role) -> Self {
        TensorName { layer: None, role }
    }

    /// A per-layer tensor.
    pub const fn layer(layer: u32, role: Role) -> Self {
        TensorName {
            layer: Some(layer),
            role,
        }
    }

    /// Parse a canonical name; `None` for anything else.
    pub fn parse(s: &str) -> Option<TensorName> {
        if let Some(rest) = s.strip_prefix("layers.") {
            let (num, suffix) = rest.split_once('.')?;
            if num.is_empty() || (num.len() > 1 && num.starts_with('0')) {
                return None;
            }
            let layer: u32 = num.parse().ok()?;
            let role = Role::ALL
                .into_iter()
                .find(|r| r.per_layer() && r.suffix() == suffix)?;
            Some(TensorName::layer(layer, role))
        } else {
            Role::ALL
                .into_iter()
                .find(|r| !r.per_layer() && r.suffix() == s)
                .map(TensorName::global)
        }
    }
}

impl fmt::Display for TensorName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.layer {
            Some(l) => write!(f, "layers.{l}.{}", self.role.suffix()),
            None => f.write_str(self.role.suffix()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_role_round_trips() {
        for role in Role::ALL {
            let n = if role.per_layer() {
                TensorName::layer(17, role)
            } else {
                TensorName::global(role)
            };
            assert_eq!(TensorName::parse(&n.to_string()), Some(n), "{n}");
        }
    }

    #[test]
    fn rejects_non_canonical() {
        for s in [
            "model.layers.0.self_attn.q_proj.weight",
            "layers.x.attn.q.weight",
            "layers.01.attn.q.weight",
            "layers.0.embed.weight",
            "attn.q.weight",
            "",
        ] {
            assert_eq!(TensorName::parse(s), None, "{s}");
        }
    }
}
