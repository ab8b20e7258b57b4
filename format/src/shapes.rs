//! The tensors a model configuration implies: the one list every program checks a model
//! against (the converter when it plans the output, the runner when it loads a file).
//!
//! Kept beside [`crate::names`] because a tensor's name and its shape are the same knowledge:
//! a family that adds a tensor adds its [`Role`] there and its shape here, and the converter,
//! GGUF import and runner all follow.
//!
//! The list grows with `num_layers`, a number read from a file, so it is never built before
//! the count is bounded: [`expected_tensor_count`] gives its length by arithmetic, and
//! [`check_layer_count`] compares the layers against the tensors a file actually holds.

use crate::metadata::{MlpKind, ModelConfig, NormKind, NormPlace, Positions};
use crate::names::{Role, TensorName};

/// Fewest tensors one decoder layer is stored as, in any source Kiln reads: its two norms,
/// the query/key/value projections (one fused tensor in Phi-3), the output projection, the
/// MLP's gate and up projections (one fused tensor in Phi-3 and GLM) and its down projection.
pub const MIN_TENSORS_PER_LAYER: u64 = 6;

/// Fewest tensors outside the layers any model has: the embedding and one norm (the final
/// norm, or an encoder's embedding norm).
pub const GLOBAL_TENSORS: u64 = 2;

/// The roles of one layer of `c`, in forward-pass order.
fn layer_roles(c: &ModelConfig) -> impl Iterator<Item = Role> + '_ {
    let f = &c.family;
    let layer_norm = f.norm_kind == NormKind::Layer;
    [
        (Role::AttnNorm, true),
        (Role::AttnNormBias, layer_norm),
        (Role::AttnQ, true),
        (Role::AttnK, true),
        (Role::AttnV, true),
        (Role::AttnQBias, c.attention_bias),
        (Role::AttnKBias, c.attention_bias),
        (Role::AttnVBias, c.attention_bias),
        (Role::AttnQNorm, c.family.qk_norm),
        (Role::AttnKNorm, c.family.qk_norm),
        (Role::AttnO, true),
        (Role::AttnOBias, f.linear_bias),
        (Role::AttnPostNorm, c.family.post_norms),
        (Role::MlpNorm, true),
        (Role::MlpNormBias, layer_norm),
        (Role::MlpGate, f.mlp_kind == MlpKind::Gated),
        (Role::MlpUp, true),
        (Role::MlpUpBias, f.linear_bias),
        (Role::MlpDown, true),
        (Role::MlpDownBias, f.linear_bias),
        (Role::MlpPostNorm, c.family.post_norms),
    ]
    .into_iter()
    .filter_map(|(role, present)| present.then_some(role))
}

/// The row-major shape `c` implies for `name`, or `None` if `c` has no such tensor (a role
/// the family lacks, a layer past `num_layers`, an output head of a tied model). Computed
/// from the name alone, without building the list.
pub fn expected_shape(c: &ModelConfig, name: TensorName) -> Option<Vec<u64>> {
    let (h, i, v) = (c.hidden_size, c.intermediate_size, c.vocab_size);
    let q = c.num_heads.saturating_mul(c.head_dim);
    let kv = c.num_kv_heads.saturating_mul(c.head_dim);
    let f = &c.family;
    let post = f.norm_place == NormPlace::Post;
    let layer_norm = f.norm_kind == NormKind::Layer;
    match name.layer {
        None => match name.role {
            Role::Embed => Some(vec![v, h]),
            Role::PosEmbed if f.positions == Positions::Learned => {
                Some(vec![c.max_position_embeddings, h])
            }
            Role::TypeEmbed => f.type_vocab_size.map(|t| vec![t, h]),
            Role::EmbedNorm if post => Some(vec![h]),
            Role::EmbedNormBias if post && layer_norm => Some(vec![h]),
            Role::FinalNorm if !post => Some(vec![h]),
            Role::FinalNormBias if !post && layer_norm => Some(vec![h]),
            Role::LmHead if has_head(c) => Some(vec![v, h]),
            Role::Dense0 | Role::Dense0Bias | Role::Dense1 | Role::Dense1Bias => {
                let k = name.role.dense_index()?;
                let d = f.embedding.as_ref()?.dense.get(k)?;
                match name.role {
                    Role::Dense0 | Role::Dense1 => Some(vec![d.out_features, d.in_features]),
                    _ => d.bias.then(|| vec![d.out_features]),
                }
            }
            _ => None,
        },
        Some(l) if u64::from(l) < c.num_layers && layer_roles(c).any(|r| r == name.role) => {
            Some(match name.role {
                Role::AttnQ => vec![q, h],
                Role::AttnK | Role::AttnV => vec![kv, h],
                Role::AttnQBias => vec![q],
                Role::AttnKBias | Role::AttnVBias => vec![kv],
                Role::AttnQNorm | Role::AttnKNorm => vec![c.head_dim],
                Role::AttnO => vec![h, q],
                Role::MlpGate | Role::MlpUp => vec![i, h],
                Role::MlpUpBias => vec![i],
                Role::MlpDown => vec![h, i],
                // The norms: one weight per residual element.
                _ => vec![h],
            })
        }
        Some(_) => None,
    }
}

/// Whether `c` has an output head of its own: a generator with untied embeddings (an
/// embedding model has none).
fn has_head(c: &ModelConfig) -> bool {
    !c.tie_word_embeddings && c.family.embedding.is_none()
}

/// The model-level roles, in file order before the layers (`true`) or after them.
const GLOBAL_ROLES: [(Role, bool); 12] = [
    (Role::Embed, true),
    (Role::PosEmbed, true),
    (Role::TypeEmbed, true),
    (Role::EmbedNorm, true),
    (Role::EmbedNormBias, true),
    (Role::FinalNorm, false),
    (Role::FinalNormBias, false),
    (Role::LmHead, false),
    (Role::Dense0, false),
    (Role::Dense0Bias, false),
    (Role::Dense1, false),
    (Role::Dense1Bias, false),
];

/// How many tensors [`expected_tensors`] lists for `c`, by arithmetic (saturating, so a
/// hostile layer count gives a huge number rather than an overflow).
pub fn expected_tensor_count(c: &ModelConfig) -> u64 {
    let per_layer = layer_roles(c).count() as u64;
    let globals = GLOBAL_ROLES
        .iter()
        .filter(|(r, _)| expected_shape(c, TensorName::global(*r)).is_some())
        .count() as u64;
    c.num_layers
        .saturating_mul(per_layer)
        .saturating_add(globals)
}

/// The fewest tensors a source holding `num_layers` layers can declare
/// ([`MIN_TENSORS_PER_LAYER`] a layer, plus the embedding and the final norm), saturating.
pub fn min_tensors_for_layers(num_layers: u64) -> u64 {
    num_layers
        .saturating_mul(MIN_TENSORS_PER_LAYER)
        .saturating_add(GLOBAL_TENSORS)
}

/// Check that a source declaring `declared` tensors can hold `num_layers` layers, before
/// anything is built per layer: returns the fewest tensors those layers need when it cannot.
///
/// This is a bound, not the full match (a source one tensor short passes it and is then
/// refused naming the missing tensor): it keeps every per-layer list within a small multiple
/// of what the source actually holds, whatever layer count its metadata claims.
pub fn check_layer_count(num_layers: u64, declared: u64) -> Result<(), u64> {
    let need = min_tensors_for_layers(num_layers);
    if need > declared {
        Err(need)
    } else {
        Ok(())
    }
}

/// Canonical names and row-major shapes `c` implies, in file order: the embedding, each
/// layer's tensors in forward-pass order, the final norm, then the output head unless it is
/// tied to the embedding.
///
/// The list has [`expected_tensor_count`] entries: callers bound `c.num_layers` first (a
/// `.kiln` file's configuration is bounded when it is opened; a source's by
/// [`check_layer_count`]).
pub fn expected_tensors(c: &ModelConfig) -> Vec<(TensorName, Vec<u64>)> {
    let len = usize::try_from(expected_tensor_count(c)).unwrap_or(usize::MAX);
    let mut out = Vec::with_capacity(len.min(crate::layout::MAX_TENSORS as usize));
    let mut push = |name: TensorName| {
        if let Some(shape) = expected_shape(c, name) {
            out.push((name, shape));
        }
    };
    for (role, _) in GLOBAL_ROLES.iter().filter(|(_, before)| *before) {
        push(TensorName::global(*role));
    }
    let roles: Vec<Role> = layer_roles(c).collect();
    for l in 0..u32::try_from(c.num_layers).unwrap_or(u32::MAX) {
        for &role in &roles {
            push(TensorName::layer(l, role));
        }
    }
    for (role, _) in GLOBAL_ROLES.iter().filter(|(_, before)| !*before) {
        push(TensorName::global(*role));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metadata::{Architecture, FamilyOptions};

    fn config(num_layers: u64) -> ModelConfig {
        ModelConfig {
            architecture: Architecture::Llama,
            source_architecture: "LlamaForCausalLM".into(),
            hidden_size: 8,
            intermediate_size: 16,
            num_layers,
            num_heads: 2,
            num_kv_heads: 1,
            head_dim: 4,
            vocab_size: 10,
            max_position_embeddings: 32,
            rms_norm_eps: 1e-5,
            rope_theta: 1e4,
            rope_scaling: None,
            tie_word_embeddings: false,
            attention_bias: false,
            sliding_window: None,
            bos_token_id: None,
            eos_token_ids: vec![],
            family: FamilyOptions::default(),
        }
    }

    /// The arithmetic count and the shape of each name agree with the list, for every
    /// combination of the options that add tensors.
    #[test]
    fn count_and_shapes_agree_with_the_list() {
        for bits in 0..16u8 {
            let mut c = config(3);
            c.attention_bias = bits & 1 != 0;
            c.family.qk_norm = bits & 2 != 0;
            c.family.post_norms = bits & 4 != 0;
            c.tie_word_embeddings = bits & 8 != 0;
            let list = expected_tensors(&c);
            assert_eq!(list.len() as u64, expected_tensor_count(&c), "{bits}");
            for (name, shape) in &list {
                assert_eq!(expected_shape(&c, *name).as_ref(), Some(shape), "{name}");
            }
            assert_eq!(expected_shape(&c, TensorName::layer(3, Role::AttnQ)), None);
            // Every layout stores at least the minimum a layer.
            assert!(list.len() as u64 >= min_tensors_for_layers(3));
        }
    }

    #[test]
    fn a_hostile_layer_count_is_counted_without_building_the_list() {
        let c = config(1 << 24);
        assert_eq!(expected_tensor_count(&c), 9 * (1 << 24) + 3);
        assert_eq!(check_layer_count(1 << 24, 12), Err(6 * (1 << 24) + 2));
        assert_eq!(check_layer_count(2, 14), Ok(()));
        assert_eq!(check_layer_count(u64::MAX, u64::MAX - 1), Err(u64::MAX));
    }
}
