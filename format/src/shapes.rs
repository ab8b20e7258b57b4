//! The tensors a model configuration implies: the one list every program checks a model
//! against (the converter when it plans the output, the runner when it loads a file).
//!
//! Kept beside [`crate::names`] because a tensor's name and its shape are the same knowledge:
//! a family that adds a tensor adds its [`Role`] there and its shape here, and the converter,
//! GGUF import and runner all follow.

use crate::metadata::ModelConfig;
use crate::names::{Role, TensorName};

/// Canonical names and row-major shapes `c` implies, in file order: the embedding, each
/// layer's tensors in forward-pass order, the final norm, then the output head unless it is
/// tied to the embedding.
pub fn expected_tensors(c: &ModelConfig) -> Vec<(TensorName, Vec<u64>)> {
    let (h, i, v) = (c.hidden_size, c.intermediate_size, c.vocab_size);
    let q = c.num_heads * c.head_dim;
    let kv = c.num_kv_heads * c.head_dim;
    let mut out = vec![(TensorName::global(Role::Embed), vec![v, h])];
    for l in 0..c.num_layers as u32 {
        let mut push = |role, shape: Vec<u64>| out.push((TensorName::layer(l, role), shape));
        push(Role::AttnNorm, vec![h]);
        push(Role::AttnQ, vec![q, h]);
        push(Role::AttnK, vec![kv, h]);
        push(Role::AttnV, vec![kv, h]);
        if c.attention_bias {
            push(Role::AttnQBias, vec![q]);
            push(Role::AttnKBias, vec![kv]);
            push(Role::AttnVBias, vec![kv]);
        }
        if c.family.qk_norm {
            push(Role::AttnQNorm, vec![c.head_dim]);
            push(Role::AttnKNorm, vec![c.head_dim]);
        }
        push(Role::AttnO, vec![h, q]);
        if c.family.post_norms {
            push(Role::AttnPostNorm, vec![h]);
        }
        push(Role::MlpNorm, vec![h]);
        push(Role::MlpGate, vec![i, h]);
        push(Role::MlpUp, vec![i, h]);
        push(Role::MlpDown, vec![h, i]);
        if c.family.post_norms {
            push(Role::MlpPostNorm, vec![h]);
        }
    }
    out.push((TensorName::global(Role::FinalNorm), vec![h]));
    if !c.tie_word_embeddings {
        out.push((TensorName::global(Role::LmHead), vec![v, h]));
    }
    out
}
