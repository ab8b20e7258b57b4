//! The model configuration the forward pass runs on, and its check against the file's tensors.
//!
//! [`Config::from_file`] turns the file's [`ModelConfig`] (already resolved by the converter:
//! no Hugging Face defaulting rules here) into `usize`s, checks that the numbers describe a
//! model that can run (`heads × head_dim`, GQA groups, even head width), and then checks every
//! tensor the configuration implies: present, with the right shape, in an encoding its role can
//! use, and nothing left over. After this the forward pass indexes without further checks.

use std::path::Path;

use kiln_format::{
    Architecture, AttentionMask, EmbeddingSpec, KilnFile, LayerKind, MlpActivation, MlpKind,
    ModelConfig, NormKind, NormPlace, NormStyle, Positions, RopePairing, RopeScaling,
};
use kiln_format::{Role, TensorName};

use crate::error::{Result, RunnerError};

/// The resolved configuration, in the units the forward pass uses.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// Which family (they differ only by the fields below).
    pub architecture: Architecture,
    /// Width of the residual stream.
    pub hidden: usize,
    /// Width of the SwiGLU hidden layer.
    pub intermediate: usize,
    /// Decoder layers.
    pub layers: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (`heads` is a multiple of it).
    pub kv_heads: usize,
    /// Per-head width (even: rope rotates halves).
    pub head_dim: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// The context length the model was trained for.
    pub max_position_embeddings: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f32,
    /// RoPE base.
    pub rope_theta: f64,
    /// RoPE frequency scaling.
    pub rope_scaling: Option<RopeScaling>,
    /// Output projection shares the embedding matrix.
    pub tie_word_embeddings: bool,
    /// q/k/v projections have biases (Qwen2, GLM-4, GLM).
    pub attention_bias: bool,
    /// Sliding-window attention span, if any (Mistral).
    pub sliding_window: Option<usize>,
    /// Beginning-of-sequence token.
    pub bos_token_id: Option<u32>,
    /// Tokens that end generation.
    pub eos_token_ids: Vec<u32>,
    /// Per-head RMSNorm of queries and keys before RoPE (Qwen3, Gemma 3).
    pub qk_norm: bool,
    /// Norms on the attention and MLP outputs before the residual adds (Gemma 3, GLM-4).
    pub post_norms: bool,
    /// How norm weights apply (`(1 + w)` for Gemma, folded into the weights at load).
    pub norm_style: NormStyle,
    /// The MLP's gate activation.
    pub mlp_activation: MlpActivation,
    /// Factor on embedding rows, if any (Gemma: `√hidden`).
    pub embed_scale: Option<f32>,
    /// Factor on attention scores.
    pub attn_scale: f32,
    /// Each layer's attention kind (all [`LayerKind::Full`] unless the file says otherwise;
    /// a model-wide `sliding_window` then windows every layer, as Mistral's does).
    pub layer_kinds: Vec<LayerKind>,
    /// RoPE base of sliding-window layers (no frequency scaling there), if they differ.
    pub rope_local_theta: Option<f64>,
    /// Leading elements of each head that RoPE rotates (`head_dim` unless partial).
    pub rotary_dim: usize,
    /// Which elements a rotary pair couples.
    pub rope_pairing: RopePairing,
    /// How the norms normalize (RMSNorm, or LayerNorm with biases).
    pub norm_kind: NormKind,
    /// Where the norms sit.
    pub norm_place: NormPlace,
    /// Whether the MLP has a gate.
    pub mlp_kind: MlpKind,
    /// How positions enter.
    pub positions: Positions,
    /// Which keys a query sees.
    pub attention_mask: AttentionMask,
    /// Biases on the attention output and the MLP projections.
    pub linear_bias: bool,
    /// Rows of the token-type table, if the model has one (every token gets row 0).
    pub type_vocab: Option<usize>,
    /// Pooling and normalisation of an embedding model; none for a generator.
    pub embedding: Option<EmbeddingSpec>,
}

impl Config {
    /// Query projection width, `heads × head_dim`.
    pub fn q_dim(&self) -> usize {
        self.heads * self.head_dim
    }

    /// Key/value projection width, `kv_heads × head_dim`.
    pub fn kv_dim(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// The sliding window of layer `l`, if its attention is windowed.
    pub fn window(&self, l: usize) -> Option<usize> {
        match self.layer_kinds.get(l) {
            Some(LayerKind::Full) => None,
            Some(LayerKind::Sliding) | None => self.sliding_window,
        }
    }

    /// Where RoPE applies within a head.
    pub fn rope_geometry(&self) -> crate::rope::RopeGeometry {
        crate::rope::RopeGeometry {
            head_dim: self.head_dim,
            rotary_dim: self.rotary_dim,
            pairing: self.rope_pairing,
        }
    }

    /// LongRoPE's original context: a forward call whose last position reaches past it uses
    /// the long factors. None without LongRoPE.
    pub fn long_rope_from(&self) -> Option<usize> {
        match &self.rope_scaling {
            Some(RopeScaling::LongRope {
                original_max_position_embeddings,
                ..
            }) => Some(usize::try_from(*original_max_position_embeddings).unwrap_or(usize::MAX)),
            _ => None,
        }
    }

    /// Whether this is an embedding model (pooled states, no output head).
    pub fn is_encoder(&self) -> bool {
        self.embedding.is_some()
    }

    /// Whether queries see every position of their sequence.
    pub fn bidirectional(&self) -> bool {
        self.attention_mask == AttentionMask::Bidirectional
    }

    /// Whether layer `l` uses the local RoPE base.
    pub fn local_rope(&self, l: usize) -> bool {
        self.rope_local_theta.is_some() && self.layer_kinds.get(l) == Some(&LayerKind::Sliding)
    }

    /// Resolve and check the configuration of an open file, then check its tensors.
    pub fn from_file(file: &KilnFile) -> Result<Config> {
        let cfg = Self::from_model_config(file.label(), &file.metadata().config)?;
        cfg.check_tensors(file)?;
        Ok(cfg)
    }

    /// Resolve a [`ModelConfig`] (no tensor checks).
    pub fn from_model_config(label: &str, mc: &ModelConfig) -> Result<Config> {
        if let Err(p) = mc.check() {
            return Err(RunnerError::BadConfig {
                file: label.to_string(),
                field: p.field,
                reason: p.reason,
            });
        }
        // `check` bounded every dimension to 1..=MAX_CONFIG_DIM, so the casts are exact.
        let cfg = Config {
            architecture: mc.architecture,
            hidden: mc.hidden_size as usize,
            intermediate: mc.intermediate_size as usize,
            layers: mc.num_layers as usize,
            heads: mc.num_heads as usize,
            kv_heads: mc.num_kv_heads as usize,
            head_dim: mc.head_dim as usize,
            vocab: mc.vocab_size as usize,
            max_position_embeddings: mc.max_position_embeddings as usize,
            rms_norm_eps: mc.rms_norm_eps as f32,
            rope_theta: mc.rope_theta,
            rope_scaling: mc.rope_scaling.clone(),
            tie_word_embeddings: mc.tie_word_embeddings,
            attention_bias: mc.attention_bias,
            sliding_window: mc.sliding_window.map(|w| w as usize),
            bos_token_id: mc.bos_token_id,
            eos_token_ids: mc.eos_token_ids.clone(),
            qk_norm: mc.family.qk_norm,
            post_norms: mc.family.post_norms,
            norm_style: mc.family.norm_style,
            mlp_activation: mc.family.mlp_activation,
            embed_scale: mc.family.embed_scale.map(|s| s as f32),
            // transformers' `head_dim ** -0.5` for Llama, kept as the expression Kiln has
            // always used (the same f32 for every even head width in use).
            attn_scale: match mc.family.attn_scale {
                Some(s) => s as f32,
                None => 1.0 / (mc.head_dim as f32).sqrt(),
            },
            layer_kinds: mc.family.layer_kinds.clone(),
            rope_local_theta: mc.family.rope_local_theta,
            rotary_dim: mc.rotary_dim() as usize,
            rope_pairing: mc.family.rope_pairing,
            norm_kind: mc.family.norm_kind,
            norm_place: mc.family.norm_place,
            mlp_kind: mc.family.mlp_kind,
            positions: mc.family.positions,
            attention_mask: mc.family.attention_mask,
            linear_bias: mc.family.linear_bias,
            type_vocab: mc.family.type_vocab_size.map(|t| t as usize),
            embedding: mc.family.embedding.clone(),
        };
        Ok(cfg)
    }

    /// Check presence, shape and encoding of every tensor the file's configuration implies
    /// ([`kiln_format::expected_tensors`], the list the converter writes), and that none is
    /// left unused.
    pub fn check_tensors(&self, file: &KilnFile) -> Result<()> {
        let label = file.label();
        let config = &file.metadata().config;
        // The layer count against the tensors the file holds, before listing what it implies.
        let declared = file.tensors().len() as u64;
        if let Err(need) = kiln_format::shapes::check_layer_count(config.num_layers, declared) {
            return Err(RunnerError::BadConfig {
                file: label.to_string(),
                field: "num_layers",
                reason: format!(
                    "{} layers need at least {need} tensors, but the file holds {declared}",
                    config.num_layers
                ),
            });
        }
        let expected = kiln_format::expected_tensors(config);
        for (name, shape) in &expected {
            let tensor = name.to_string();
            let info = file
                .info(&tensor)
                .ok_or_else(|| RunnerError::MissingTensor {
                    file: label.to_string(),
                    tensor: tensor.clone(),
                })?;
            if &info.shape != shape {
                return Err(RunnerError::TensorShape {
                    file: label.to_string(),
                    tensor,
                    expected: shape.clone(),
                    found: info.shape.clone(),
                });
            }
            if !name.role.is_matrix() && info.dtype.is_quantized() {
                return Err(RunnerError::TensorDType {
                    file: label.to_string(),
                    tensor,
                    dtype: info.dtype.to_string(),
                    reason: "norm weights, biases and position tables must be f32, f16 or bf16",
                });
            }
        }
        let known: std::collections::HashSet<String> =
            expected.iter().map(|(n, _)| n.to_string()).collect();
        if let Some(extra) = file.tensors().iter().find(|t| !known.contains(&t.name)) {
            let reason = match TensorName::parse(&extra.name) {
                Some(TensorName {
                    role: Role::LmHead, ..
                }) => {
                    "tie_word_embeddings is true, so the embedding matrix is the output projection"
                }
                Some(TensorName {
                    role: Role::AttnQBias | Role::AttnKBias | Role::AttnVBias,
                    ..
                }) => "attention_bias is false",
                Some(TensorName { layer: Some(_), .. }) => "its layer is past num_layers",
                Some(TensorName {
                    role: Role::AttnQNorm | Role::AttnKNorm,
                    ..
                }) => "this family has no q/k norms",
                Some(TensorName {
                    role: Role::AttnPostNorm | Role::MlpPostNorm,
                    ..
                }) => "this family has no post-attention or post-MLP norms",
                _ => "it is not a canonical tensor name of a supported family",
            };
            return Err(RunnerError::UnexpectedTensor {
                file: label.to_string(),
                tensor: extra.name.clone(),
                reason,
            });
        }
        Ok(())
    }
}

/// Open a `.kiln` model. The format validates everything at open, the configuration
/// included; an architecture this build does not implement is
/// [`kiln_format::FormatError::UnsupportedArchitecture`], naming it and the supported list.
pub fn open_model(path: &Path) -> Result<KilnFile> {
    Ok(KilnFile::open(path)?)
}

/// [`open_model`], then, unless `verify` is false, hash every tensor and compare with the
/// index, and scan every value for NaN and infinity in the same pass
/// ([`KilnFile::verify_data`]): a model is untrusted input, a flipped byte in a weight would
/// otherwise change the output without a word, and a file written with NaN in it has matching
/// checksums. The error names the file, the first tensor that failed and, for non-finite
/// values, their count and the first.
///
/// The pass runs on every CPU and reads the file once, which also brings its pages into
/// memory before the first token (docs/SECURITY.md measures the cost); `--no-verify` skips
/// it for a file the caller has already verified.
pub fn open_model_verified(path: &Path, verify: bool) -> Result<KilnFile> {
    let file = open_model(path)?;
    if verify {
        file.verify_data()?;
    }
    Ok(file)
}
