//! The metadata section: a JSON document describing the model, its tokenizer and its history.
//!
//! JSON keeps the section readable with any tool and lets minor versions add fields without
//! breaking older readers (unknown fields are ignored). Everything the runner needs to build the
//! model is in [`ModelConfig`], already resolved: no `Option`s for values that have defaults in
//! the source format, so the runner never re-implements Hugging Face's defaulting rules.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::num::Num;

/// Architectures the runner implements. They differ by configuration only: each is a row of
/// [`crate::family::FAMILIES`] ([`Architecture::spec`]), which the converter and the observer read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Architecture {
    /// Llama 2/3, SmolLM/SmolLM2, TinyLlama.
    Llama,
    /// Mistral (Llama with an optional sliding window).
    Mistral,
    /// Qwen2/2.5 (Llama with q/k/v biases).
    Qwen2,
    /// Qwen3 (per-head RMSNorm of queries and keys, an explicit head width).
    Qwen3,
    /// Gemma 3, text (sliding and global layers, four norms per block with `(1 + w)`
    /// weights, q/k norms, GeGLU, scaled embeddings).
    Gemma3,
    /// Phi-3 / Phi-4-mini (partial rotary, LongRoPE; the checkpoint's fused projections are
    /// stored split).
    Phi3,
    /// GLM-4 (q/k/v biases, partial rotary on interleaved pairs, norms on the attention and
    /// MLP outputs).
    Glm4,
    /// GLM (`GlmForCausalLM`): GLM-4's attention and MLP without the output norms.
    Glm,
    /// BERT-style encoders (`BertModel`: all-MiniLM, bge): learned absolute and token-type
    /// position embeddings, LayerNorm after each residual add, a plain GELU MLP, biases on
    /// every projection, bidirectional attention; an embedding model, not a generator.
    Bert,
}

impl Architecture {
    /// Every architecture this build implements, as the metadata spells them.
    pub const ALL: [Architecture; 9] = [
        Architecture::Llama,
        Architecture::Mistral,
        Architecture::Qwen2,
        Architecture::Qwen3,
        Architecture::Gemma3,
        Architecture::Phi3,
        Architecture::Glm4,
        Architecture::Glm,
        Architecture::Bert,
    ];

    /// The name stored in the metadata (`config.architecture`).
    pub const fn name(self) -> &'static str {
        match self {
            Architecture::Llama => "llama",
            Architecture::Mistral => "mistral",
            Architecture::Qwen2 => "qwen2",
            Architecture::Qwen3 => "qwen3",
            Architecture::Gemma3 => "gemma3",
            Architecture::Phi3 => "phi3",
            Architecture::Glm4 => "glm4",
            Architecture::Glm => "glm",
            Architecture::Bert => "bert",
        }
    }

    /// The architecture stored as `name`, if this build implements it.
    pub fn from_name(name: &str) -> Option<Architecture> {
        Architecture::ALL.into_iter().find(|a| a.name() == name)
    }

    /// `llama, mistral, qwen2, …`: the supported list, for error messages.
    pub fn supported() -> String {
        Architecture::ALL.map(Architecture::name).join(", ")
    }
}

/// Rotary-embedding frequency scaling.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum RopeScaling {
    /// Llama 3's piecewise scaling of the inverse frequencies.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: u64,
    },
    /// Position interpolation: every inverse frequency divided by `factor`.
    Linear { factor: f64 },
    /// LongRoPE (Phi-3): inverse frequency `i` divided by `short_factor[i]` while a forward
    /// call's last position is below `original_max_position_embeddings`, by `long_factor[i]`
    /// from there on, and `cos`/`sin` multiplied by `attention_factor`. One factor per rotated
    /// pair.
    #[serde(rename = "longrope")]
    LongRope {
        short_factor: Vec<f64>,
        long_factor: Vec<f64>,
        original_max_position_embeddings: u64,
        attention_factor: f64,
    },
}

/// How an RMSNorm weight scales the normalized values.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NormStyle {
    /// `x̂ · w` (Llama, Qwen).
    #[default]
    Weight,
    /// `x̂ · (1 + w)` (Gemma: the checkpoint stores the offset from one).
    OnePlusWeight,
}

/// The MLP's gate activation (the MLP is `down(act(gate(x)) · up(x))`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MlpActivation {
    /// SiLU: SwiGLU (Llama, Qwen).
    #[default]
    Silu,
    /// GELU with the tanh approximation (`gelu_pytorch_tanh`): GeGLU (Gemma).
    GeluTanh,
    /// Exact GELU, `x·Φ(x)` through `erf` (`gelu`: BERT's plain MLP).
    Gelu,
}

/// How a norm normalizes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NormKind {
    /// RMSNorm: `x / √(mean(x²) + ε) · w` (the decoders).
    #[default]
    Rms,
    /// LayerNorm: `(x − mean) / √(var + ε) · w + b`, with a bias tensor beside each weight
    /// (BERT).
    Layer,
}

/// Where a block's two norms sit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NormPlace {
    /// On each sublayer's input, with a final norm after the last layer (the decoders).
    #[default]
    Pre,
    /// On the residual stream after each add (`x = norm(x + f(x))`), with a norm on the
    /// embeddings and none after the last layer (BERT).
    Post,
}

/// The MLP's shape.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MlpKind {
    /// `down(act(gate(x)) · up(x))` (SwiGLU, GeGLU).
    #[default]
    Gated,
    /// `down(act(up(x)))`: no gate (BERT's intermediate and output dense layers).
    Plain,
}

/// How positions enter the model.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Positions {
    /// Rotary embeddings of queries and keys.
    #[default]
    Rope,
    /// A learned row per position added to the token embeddings (BERT's
    /// `position_embeddings`); `max_position_embeddings` rows.
    Learned,
}

/// Which keys a query sees.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AttentionMask {
    /// Its own position and the ones before it.
    #[default]
    Causal,
    /// Every position of its sequence (encoders).
    Bidirectional,
}

/// How an embedding model turns the last hidden states into one vector per text (what
/// sentence-transformers' `Pooling` and `Normalize` modules do).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Pooling {
    /// The mean of every token's state.
    Mean,
    /// The first token's state (`[CLS]`).
    Cls,
    /// The last token's state (decoder-based embedders).
    LastToken,
}

impl Pooling {
    /// Every pooling, as the metadata and `--pooling` spell them.
    pub const ALL: [Pooling; 3] = [Pooling::Mean, Pooling::Cls, Pooling::LastToken];

    /// The name (`mean`, `cls`, `last_token`).
    pub const fn name(self) -> &'static str {
        match self {
            Pooling::Mean => "mean",
            Pooling::Cls => "cls",
            Pooling::LastToken => "last_token",
        }
    }
}

/// What makes a model an embedding model: its pooling, whether the vectors are normalised,
/// the longest input it was trained on, and the prompts its card documents.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EmbeddingSpec {
    /// How token states become one vector.
    pub pooling: Pooling,
    /// Whether the vector is scaled to unit length (a `Normalize` module).
    pub normalize: bool,
    /// Inputs are cut to this many tokens (`max_seq_length`), if the model states it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_seq_length: Option<u64>,
    /// Text put before an input, by name (`query`, `document`), as the model's
    /// `config_sentence_transformers.json` lists them.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub prompts: BTreeMap<String, String>,
    /// The prompt used when none is named, if the model sets one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_prompt_name: Option<String>,
    /// Projections applied to the pooled vector, in order, before any normalisation
    /// (sentence-transformers' `Dense` modules: EmbeddingGemma's 768 → 3072 → 768); their
    /// weights are the tensors `dense.K.weight` (and `dense.K.bias`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dense: Vec<DenseLayer>,
}

impl EmbeddingSpec {
    /// Pooling `pooling`, normalised or not, and nothing else stated (no length limit, no
    /// prompts, no dense layers).
    pub fn pooled(pooling: Pooling, normalize: bool) -> EmbeddingSpec {
        EmbeddingSpec {
            pooling,
            normalize,
            max_seq_length: None,
            prompts: BTreeMap::new(),
            default_prompt_name: None,
            dense: Vec::new(),
        }
    }
}

/// The most `Dense` modules an embedding model may have (each is two tensor roles).
pub const MAX_DENSE_LAYERS: usize = 2;

/// One projection of the pooled vector: `act(W·v + b)`, `W` of shape `(out, in)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct DenseLayer {
    /// The width it reads.
    pub in_features: u64,
    /// The width it writes.
    pub out_features: u64,
    /// Whether a bias vector `dense.K.bias` is added.
    pub bias: bool,
    /// The function applied to each output.
    pub activation: DenseActivation,
}

/// What a `Dense` module applies to its outputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DenseActivation {
    /// Nothing (`torch.nn.Identity`: EmbeddingGemma).
    Identity,
    /// `tanh` (`torch.nn.Tanh`, sentence-transformers' default).
    Tanh,
}

/// Which elements of a head a rotary pair couples.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RopePairing {
    /// `i` with `i + rotary_dim/2` (transformers' `rotate_half`: Llama, Qwen, Gemma, Phi-3).
    #[default]
    Half,
    /// `2i` with `2i + 1` (GLM's `rotate_half` over interleaved elements).
    Interleaved,
}

/// What kind of attention a layer runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LayerKind {
    /// Every earlier position, with the global RoPE settings.
    Full,
    /// Only the last `sliding_window` positions, with the local RoPE base.
    Sliding,
}

fn is_false(b: &bool) -> bool {
    !*b
}

fn is_default<T: Default + PartialEq>(v: &T) -> bool {
    *v == T::default()
}

/// What the families beyond Llama add to its decoder block, stored in the config's JSON
/// object beside the Llama fields. Each field is left out when it has its Llama value
/// ([`Default`]), so a Llama-family file's metadata is the same as before these existed, and
/// a reader that predates them refuses the new families by their architecture name.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct FamilyOptions {
    /// Per-head RMSNorm of queries and keys (weights `(head_dim)`) before RoPE (Qwen3, Gemma 3).
    #[serde(default, skip_serializing_if = "is_false")]
    pub qk_norm: bool,
    /// Norms on the attention and MLP outputs before each residual add (Gemma 3).
    #[serde(default, skip_serializing_if = "is_false")]
    pub post_norms: bool,
    /// How every RMSNorm weight applies.
    #[serde(default, skip_serializing_if = "is_default")]
    pub norm_style: NormStyle,
    /// The MLP's gate activation.
    #[serde(default, skip_serializing_if = "is_default")]
    pub mlp_activation: MlpActivation,
    /// Factor on the embedding rows (Gemma: `√hidden`); none means 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub embed_scale: Option<f64>,
    /// Factor on attention scores; none means `1/√head_dim` (Gemma: `query_pre_attn_scalar^-½`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attn_scale: Option<f64>,
    /// Each layer's attention kind, when layers differ (Gemma 3); empty means every layer is
    /// alike, windowed by `sliding_window` if that is set (Mistral).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub layer_kinds: Vec<LayerKind>,
    /// RoPE base of [`LayerKind::Sliding`] layers, which use no frequency scaling (Gemma 3).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_local_theta: Option<f64>,
    /// How many leading elements of each head rotate (partial rotary: Phi-4-mini, GLM); the
    /// rest pass through. None means all `head_dim`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rotary_dim: Option<u64>,
    /// Which elements a rotary pair couples.
    #[serde(default, skip_serializing_if = "is_default")]
    pub rope_pairing: RopePairing,
    /// How every norm normalizes.
    #[serde(default, skip_serializing_if = "is_default")]
    pub norm_kind: NormKind,
    /// Where the norms sit.
    #[serde(default, skip_serializing_if = "is_default")]
    pub norm_place: NormPlace,
    /// The MLP's shape.
    #[serde(default, skip_serializing_if = "is_default")]
    pub mlp_kind: MlpKind,
    /// How positions enter.
    #[serde(default, skip_serializing_if = "is_default")]
    pub positions: Positions,
    /// Which keys a query sees.
    #[serde(default, skip_serializing_if = "is_default")]
    pub attention_mask: AttentionMask,
    /// Biases on the attention output and the MLP's projections (BERT).
    #[serde(default, skip_serializing_if = "is_false")]
    pub linear_bias: bool,
    /// Rows of the token-type embedding (BERT's `type_vocab_size`), whose row 0 every token
    /// gets; none when the model has no such table.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub type_vocab_size: Option<u64>,
    /// Pooling and normalisation, for an embedding model; none for a generator.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub embedding: Option<EmbeddingSpec>,
}

impl ModelConfig {
    /// The number of leading elements of each head that RoPE rotates.
    pub fn rotary_dim(&self) -> u64 {
        self.family.rotary_dim.unwrap_or(self.head_dim)
    }
}

/// The resolved model configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    /// Which forward pass to build.
    pub architecture: Architecture,
    /// The source's class name (e.g. `LlamaForCausalLM`), kept for provenance.
    pub source_architecture: String,
    /// Width of the residual stream.
    pub hidden_size: u64,
    /// Width of the SwiGLU hidden layer.
    pub intermediate_size: u64,
    /// Decoder layers.
    pub num_layers: u64,
    /// Query heads.
    pub num_heads: u64,
    /// Key/value heads (grouped-query attention when fewer than `num_heads`).
    pub num_kv_heads: u64,
    /// Per-head width.
    pub head_dim: u64,
    /// Vocabulary size (rows of the embedding matrix).
    pub vocab_size: u64,
    /// The context length the model was trained for.
    pub max_position_embeddings: u64,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// RoPE base.
    pub rope_theta: f64,
    /// RoPE frequency scaling, if any.
    pub rope_scaling: Option<RopeScaling>,
    /// Whether the output projection reuses the embedding matrix.
    pub tie_word_embeddings: bool,
    /// Whether q/k/v projections carry biases.
    pub attention_bias: bool,
    /// Sliding-window attention span (Mistral), if any: a query at `p` sees keys `j` with
    /// `p - j < sliding_window`, or, with bidirectional attention, `|p - j| < sliding_window`
    /// (the bound transformers keeps in memory, `w / 2 + 1` for a config.json's `w`).
    pub sliding_window: Option<u64>,
    /// Beginning-of-sequence token id, if the model has one.
    pub bos_token_id: Option<u32>,
    /// Every token id that ends generation.
    pub eos_token_ids: Vec<u32>,
    /// What the newer families add to the Llama block (all off for the Llama family).
    #[serde(flatten)]
    pub family: FamilyOptions,
}

/// Largest single dimension accepted from a config (2^24: far above any supported model, small
/// enough that `dim × dim` products of activations cannot overflow).
pub const MAX_CONFIG_DIM: u64 = 1 << 24;

/// Why `v` is not a positive finite number that stays one as the f32 the runner computes
/// with, if it is not: `1e150` is finite as an f64 but infinite as an f32, `1e-300` becomes
/// zero. The reason names the value as [`Num`] writes it, never as 309 digits.
fn positive_f32_problem(v: f64) -> Option<String> {
    let narrow = v as f32;
    if !(v > 0.0 && v.is_finite()) {
        Some(format!("{} must be a positive number", Num(v)))
    } else if !narrow.is_finite() {
        Some(format!(
            "{} does not fit in an f32 (whose largest value is about {:.1e})",
            Num(v),
            f32::MAX
        ))
    } else if narrow == 0.0 {
        Some(format!(
            "{} is too small for an f32 (it rounds to 0)",
            Num(v)
        ))
    } else {
        None
    }
}

/// What is wrong with a [`ModelConfig`]: the field (as the config names it) and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigProblem {
    /// The field at fault, e.g. `hidden_size`.
    pub field: &'static str,
    /// Why, with the value found.
    pub reason: String,
}

impl ModelConfig {
    /// Check that the configuration describes a model that can be built: every dimension in
    /// `1..=MAX_CONFIG_DIM`, no more implied tensors than a file can hold, heads that group,
    /// an even head width, positive epsilon and RoPE base, sane RoPE scaling, scales and
    /// factors that stay finite and positive as f32, special tokens inside the vocabulary.
    ///
    /// The one validation of a model configuration: [`crate::KilnFile::open`] runs it, so every
    /// program refuses the same files, and the runner's resolved config relies on it.
    pub fn check(&self) -> std::result::Result<(), ConfigProblem> {
        let bad = |field: &'static str, reason: String| Err(ConfigProblem { field, reason });
        self.check_sizes()?;
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return bad(
                "num_kv_heads",
                format!(
                    "{} query heads cannot be grouped over {} key/value heads",
                    self.num_heads, self.num_kv_heads
                ),
            );
        }
        if !self.head_dim.is_multiple_of(2) {
            return bad(
                "head_dim",
                format!(
                    "{} is odd; rotary embeddings need an even width",
                    self.head_dim
                ),
            );
        }
        // As the runner uses it: an f32 that must be positive.
        if let Some(reason) = positive_f32_problem(self.rms_norm_eps) {
            return bad("rms_norm_eps", reason);
        }
        self.check_embedding()?;
        self.check_positions()?;
        for (field, v) in [
            ("embed_scale", self.family.embed_scale),
            ("attn_scale", self.family.attn_scale),
        ] {
            if let Some(v) = v {
                if let Some(reason) = positive_f32_problem(v) {
                    return bad(field, reason);
                }
            }
        }
        let specials = self
            .eos_token_ids
            .iter()
            .map(|&id| ("eos_token_ids", id))
            .chain(self.bos_token_id.map(|id| ("bos_token_id", id)));
        for (field, id) in specials {
            if u64::from(id) >= self.vocab_size {
                return bad(
                    field,
                    format!(
                        "special token {id} is outside the vocabulary ({})",
                        self.vocab_size
                    ),
                );
            }
        }
        Ok(())
    }

    /// Every dimension in `1..=MAX_CONFIG_DIM`, and no more implied tensors than a file holds.
    fn check_sizes(&self) -> std::result::Result<(), ConfigProblem> {
        let bad = |field: &'static str, reason: String| Err(ConfigProblem { field, reason });
        let dims = [
            ("hidden_size", Some(self.hidden_size)),
            ("intermediate_size", Some(self.intermediate_size)),
            ("num_layers", Some(self.num_layers)),
            ("num_heads", Some(self.num_heads)),
            ("num_kv_heads", Some(self.num_kv_heads)),
            ("head_dim", Some(self.head_dim)),
            ("vocab_size", Some(self.vocab_size)),
            (
                "max_position_embeddings",
                Some(self.max_position_embeddings),
            ),
            ("sliding_window", self.sliding_window),
            ("type_vocab_size", self.family.type_vocab_size),
            (
                "max_seq_length",
                self.family
                    .embedding
                    .as_ref()
                    .and_then(|e| e.max_seq_length),
            ),
        ];
        for (field, v) in dims {
            if let Some(v) = v {
                if v == 0 || v > MAX_CONFIG_DIM {
                    return bad(field, format!("{v} is outside 1..={MAX_CONFIG_DIM}"));
                }
            }
        }
        // Counted, never listed: the list is what this bound protects.
        let implied = crate::shapes::expected_tensor_count(self);
        if implied > u64::from(crate::layout::MAX_TENSORS) {
            return bad(
                "num_layers",
                format!(
                    "{} layers imply {implied} tensors, more than the {} a .kiln file can hold",
                    self.num_layers,
                    crate::layout::MAX_TENSORS
                ),
            );
        }
        Ok(())
    }

    /// The embedding model's Dense layers chain from the hidden width, each of a bounded
    /// width, and its default prompt is one of its prompts.
    fn check_embedding(&self) -> std::result::Result<(), ConfigProblem> {
        let bad = |field: &'static str, reason: String| Err(ConfigProblem { field, reason });
        if let Some(e) = &self.family.embedding {
            if e.dense.len() > MAX_DENSE_LAYERS {
                return bad(
                    "embedding.dense",
                    format!(
                        "{} dense layers; at most {MAX_DENSE_LAYERS} are supported",
                        e.dense.len()
                    ),
                );
            }
            let mut width = self.hidden_size;
            for (k, d) in e.dense.iter().enumerate() {
                if d.in_features != width {
                    return bad(
                        "embedding.dense",
                        format!(
                            "dense layer {k} reads {} values, but the vector before it has {width}",
                            d.in_features
                        ),
                    );
                }
                if d.out_features == 0 || d.out_features > MAX_CONFIG_DIM {
                    return bad(
                        "embedding.dense",
                        format!(
                            "dense layer {k} writes {} values, outside 1..={MAX_CONFIG_DIM}",
                            d.out_features
                        ),
                    );
                }
                width = d.out_features;
            }
            if let Some(name) = e.default_prompt_name.as_ref() {
                if !e.prompts.contains_key(name) {
                    return bad(
                        "embedding.default_prompt_name",
                        format!("`{name}` names none of the prompts"),
                    );
                }
            }
        }
        Ok(())
    }

    /// RoPE: bases above 1, an even rotated width within the head, the scaling's factors, and
    /// per-layer attention kinds that have their window and local base.
    fn check_positions(&self) -> std::result::Result<(), ConfigProblem> {
        let bad = |field: &'static str, reason: String| Err(ConfigProblem { field, reason });
        if !(self.rope_theta > 1.0 && self.rope_theta.is_finite()) {
            return bad(
                "rope_theta",
                format!("{} must exceed 1", Num(self.rope_theta)),
            );
        }
        if let Some(r) = self.family.rotary_dim {
            if r == 0 || r > self.head_dim || !r.is_multiple_of(2) {
                return bad(
                    "rotary_dim",
                    format!(
                        "{r} must be even and within 2..=head_dim ({})",
                        self.head_dim
                    ),
                );
            }
        }
        self.check_rope_scaling()?;
        if !self.family.layer_kinds.is_empty() {
            if self.family.layer_kinds.len() as u64 != self.num_layers {
                return bad(
                    "layer_kinds",
                    format!(
                        "{} entries for {} layers",
                        self.family.layer_kinds.len(),
                        self.num_layers
                    ),
                );
            }
            let sliding = self.family.layer_kinds.contains(&LayerKind::Sliding);
            if sliding && self.sliding_window.is_none() {
                return bad(
                    "sliding_window",
                    "missing, but some layers use sliding-window attention".into(),
                );
            }
            if sliding && self.family.rope_local_theta.is_none() {
                return bad(
                    "rope_local_theta",
                    "missing, but some layers use sliding-window attention".into(),
                );
            }
        }
        if let Some(t) = self.family.rope_local_theta {
            if !(t > 1.0 && t.is_finite()) {
                return bad("rope_local_theta", format!("{} must exceed 1", Num(t)));
            }
        }
        Ok(())
    }

    /// The RoPE scaling's factors: each a positive number an f32 holds, named by its field
    /// (`rope_scaling.factor`), Llama 3's high-frequency factor above its low one.
    fn check_rope_scaling(&self) -> std::result::Result<(), ConfigProblem> {
        let bad = |field: &'static str, reason: String| Err(ConfigProblem { field, reason });
        let positive = |fields: &[(&'static str, f64)]| -> std::result::Result<(), ConfigProblem> {
            for &(field, v) in fields {
                if let Some(reason) = positive_f32_problem(v) {
                    return bad(field, reason);
                }
            }
            Ok(())
        };
        match &self.rope_scaling {
            None => Ok(()),
            Some(RopeScaling::Linear { factor }) => positive(&[("rope_scaling.factor", *factor)]),
            Some(RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            }) => {
                positive(&[
                    ("rope_scaling.factor", *factor),
                    ("rope_scaling.low_freq_factor", *low_freq_factor),
                    ("rope_scaling.high_freq_factor", *high_freq_factor),
                ])?;
                if high_freq_factor <= low_freq_factor {
                    return bad(
                        "rope_scaling.high_freq_factor",
                        format!(
                            "{} must exceed low_freq_factor ({})",
                            Num(*high_freq_factor),
                            Num(*low_freq_factor)
                        ),
                    );
                }
                if *original_max_position_embeddings == 0 {
                    return bad(
                        "rope_scaling.original_max_position_embeddings",
                        "0 must be positive".into(),
                    );
                }
                Ok(())
            }
            Some(RopeScaling::LongRope {
                short_factor,
                long_factor,
                original_max_position_embeddings,
                attention_factor,
            }) => {
                let pairs = (self.rotary_dim() / 2) as usize;
                for (field, f) in [
                    ("rope_scaling.short_factor", short_factor),
                    ("rope_scaling.long_factor", long_factor),
                ] {
                    if f.len() != pairs {
                        return bad(
                            field,
                            format!(
                                "{} factors for {pairs} rotated pairs (rotary_dim {})",
                                f.len(),
                                self.rotary_dim()
                            ),
                        );
                    }
                    if let Some(reason) = f.iter().find_map(|&x| positive_f32_problem(x)) {
                        return bad(field, reason);
                    }
                }
                if *original_max_position_embeddings == 0 {
                    return bad(
                        "rope_scaling.original_max_position_embeddings",
                        "0 must be positive".into(),
                    );
                }
                positive(&[("rope_scaling.attention_factor", *attention_factor)])
            }
        }
    }
}

/// Deepest JSON nesting accepted in the metadata (docs/FORMAT.md, section 5). serde_json
/// enforces 128 only where it builds values; under a key it skips it does not, so the reader
/// checks the whole document with [`json_depth_exceeds`] first.
pub const MAX_JSON_DEPTH: usize = 128;

/// Whether the JSON text `bytes` nests arrays and objects deeper than `max`. One pass with a
/// counter (no recursion), skipping string contents and their escapes; malformed JSON is left
/// to the parser.
pub fn json_depth_exceeds(bytes: &[u8], max: usize) -> bool {
    let mut depth = 0usize;
    let mut in_string = false;
    let mut escaped = false;
    for &b in bytes {
        if in_string {
            match (escaped, b) {
                (true, _) => escaped = false,
                (false, b'\\') => escaped = true,
                (false, b'"') => in_string = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'[' | b'{' => {
                depth += 1;
                if depth > max {
                    return true;
                }
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    false
}

/// Where a data error of serde in the metadata document `bytes` is: the field it is about, as
/// the other metadata errors name fields (`config.embedding.dense[1].activation`; `(document)`
/// for the document itself), and serde's message without its "at line 1 column 972", which
/// the field replaces.
///
/// The family options are flattened into `config`, and serde reads a flattened struct from a
/// buffer once the whole object is read, so an error inside them points at the end of
/// `config`: those options are then read again alone to find the field.
pub fn locate_json_error(bytes: &[u8], e: &serde_json::Error) -> (String, String) {
    let mut path = json_path_at(bytes, byte_offset(bytes, e.line(), e.column()));
    let mut reason = without_position(e);
    if path == "config" {
        if let Some((inner, inner_reason)) = family_options_error(bytes) {
            path = format!("config.{inner}");
            reason = inner_reason;
        }
    }
    if path.is_empty() {
        path = "(document)".into();
    }
    (path, reason)
}

/// The path and message of the error reading `config`'s family options alone, if they fail.
fn family_options_error(bytes: &[u8]) -> Option<(String, String)> {
    let doc: serde_json::Value = serde_json::from_slice(bytes).ok()?;
    let config = serde_json::to_vec(doc.get("config")?).ok()?;
    let e = serde_json::from_slice::<FamilyOptions>(&config).err()?;
    let path = json_path_at(&config, byte_offset(&config, e.line(), e.column()));
    (!path.is_empty()).then(|| (path, without_position(&e)))
}

/// serde's message without the position it appends.
fn without_position(e: &serde_json::Error) -> String {
    let text = e.to_string();
    let suffix = format!(" at line {} column {}", e.line(), e.column());
    text.strip_suffix(&suffix).unwrap_or(&text).to_string()
}

/// The byte offset of serde's (1-based line, column counted in bytes from the line's start).
fn byte_offset(bytes: &[u8], line: usize, column: usize) -> usize {
    let line_start = if line <= 1 {
        0
    } else {
        bytes
            .iter()
            .enumerate()
            .filter(|&(_, &b)| b == b'\n')
            .nth(line - 2)
            .map_or(bytes.len(), |(i, _)| i + 1)
    };
    line_start.saturating_add(column).min(bytes.len())
}

/// The path of the value the JSON text `bytes` is inside at byte `offset`: object keys joined
/// by `.`, array indices in brackets (`config.embedding.dense[1].activation`); empty at the
/// top level. One pass with a stack, skipping string contents; just past a value (where serde
/// reports an error about it) the path still names that value, and just past an object's
/// closing brace the path names the object.
pub fn json_path_at(bytes: &[u8], offset: usize) -> String {
    enum Frame {
        Object {
            key: Option<String>,
            wants_key: bool,
        },
        Array(usize),
    }
    let mut stack: Vec<Frame> = Vec::new();
    let end = offset.min(bytes.len());
    let mut i = 0;
    while i < end {
        match bytes[i] {
            b'"' => {
                let close = string_end(bytes, i + 1);
                if let Some(Frame::Object { key, wants_key }) = stack.last_mut() {
                    if *wants_key {
                        let text = &bytes[i + 1..close.min(bytes.len())];
                        *key = Some(String::from_utf8_lossy(text).into_owned());
                        *wants_key = false;
                    }
                }
                i = close;
            }
            b'{' => stack.push(Frame::Object {
                key: None,
                wants_key: true,
            }),
            b'[' => stack.push(Frame::Array(0)),
            b'}' | b']' => {
                stack.pop();
            }
            b',' => match stack.last_mut() {
                Some(Frame::Array(n)) => *n += 1,
                Some(Frame::Object { wants_key, .. }) => *wants_key = true,
                None => {}
            },
            _ => {}
        }
        i += 1;
    }
    let mut path = String::new();
    for frame in &stack {
        match frame {
            Frame::Object { key: Some(k), .. } => {
                if !path.is_empty() {
                    path.push('.');
                }
                path.push_str(k);
            }
            Frame::Object { key: None, .. } => {}
            Frame::Array(n) => path.push_str(&format!("[{n}]")),
        }
    }
    path
}

/// The index of the quote closing the string whose contents start at `start` (or the end).
fn string_end(bytes: &[u8], start: usize) -> usize {
    let mut escaped = false;
    for (i, &b) in bytes.iter().enumerate().skip(start) {
        match (escaped, b) {
            (true, _) => escaped = false,
            (false, b'\\') => escaped = true,
            (false, b'"') => return i,
            _ => {}
        }
    }
    bytes.len()
}

/// Tokenizer files, kept byte for byte. A file stores the large ones packed (compressed, outside
/// the JSON document: [`crate::packed`]); the reader puts them back, so they read the same here.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TokenizerFiles {
    /// `tokenizer.json`, exactly as in the source.
    pub tokenizer_json: Option<String>,
    /// `tokenizer_config.json`, exactly as in the source.
    pub tokenizer_config_json: Option<String>,
    /// The chat template (from `tokenizer_config.json` or `chat_template.jinja`).
    pub chat_template: Option<String>,
    /// Special tokens by role (`bos_token`, `eos_token`, `pad_token`, `unk_token`).
    #[serde(default)]
    pub special_tokens: std::collections::BTreeMap<String, String>,
    /// Whether the tokenizer adds a BOS token when encoding (`add_bos_token`).
    pub add_bos_token: Option<bool>,
}

/// A source file the model was made from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SourceFile {
    /// File name relative to the source directory.
    pub name: String,
    /// Size in bytes.
    pub bytes: u64,
    /// Lower-case hex sha256 of the file.
    pub sha256: String,
}

/// One transformation step applied to the model (conversion, quantization…).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProvenanceStep {
    /// The tool and its version, e.g. `kiln-convert 0.1.0`.
    pub tool: String,
    /// RFC 3339 UTC time the step ran.
    pub created: String,
    /// What the step did, free-form but stable keys (e.g. `{"quantization": {...}}`).
    #[serde(default)]
    pub details: serde_json::Value,
    /// The files it read.
    #[serde(default)]
    pub sources: Vec<SourceFile>,
}

/// The whole metadata document.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Metadata {
    /// The model.
    pub config: ModelConfig,
    /// Tokenizer and chat template.
    #[serde(default)]
    pub tokenizer: TokenizerFiles,
    /// `generation_config.json` as parsed JSON (sampling defaults), or null.
    #[serde(default)]
    pub generation: serde_json::Value,
    /// Every step that produced this file, oldest first.
    #[serde(default)]
    pub provenance: Vec<ProvenanceStep>,
}

impl Metadata {
    /// The weight dtype summary used in reports: quantization applied, if any step recorded one.
    pub fn quantization(&self) -> Option<&serde_json::Value> {
        self.provenance
            .iter()
            .rev()
            .find_map(|s| s.details.get("quantization"))
    }
}

/// The current UTC time as RFC 3339 (`YYYY-MM-DDTHH:MM:SSZ`), without a date library.
pub fn now_rfc3339() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    rfc3339_from_unix(secs)
}

/// The UTC calendar date and time of day of `secs` since the Unix epoch:
/// `(year, month 1..=12, day 1..=31, seconds into the day)`.
///
/// Civil-from-days (Howard Hinnant's algorithm), valid for the proleptic Gregorian calendar;
/// it saves a date-library dependency for the two places Kiln prints dates.
pub fn civil_from_unix(secs: u64) -> (i64, i64, i64, u64) {
    let days = (secs / 86_400) as i64;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d, secs % 86_400)
}

/// Format seconds since the Unix epoch as RFC 3339 UTC.
pub fn rfc3339_from_unix(secs: u64) -> String {
    let (y, m, d, rem) = civil_from_unix(secs);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A value's path names the keys and indices down to it, right after the value (where
    /// serde reports an error about it) and inside escaped strings alike.
    #[test]
    fn json_paths_name_keys_and_indices() {
        let doc = br#"{"config":{"a\"b":"x,]","embedding":{"dense":[{"activation":"tanh"},
{"activation":"relu"}]}},"provenance":[]}"#;
        let at = |needle: &str| {
            let i = doc
                .windows(needle.len())
                .position(|w| w == needle.as_bytes())
                .unwrap();
            json_path_at(doc, i + needle.len())
        };
        assert_eq!(at(r#""relu""#), "config.embedding.dense[1].activation");
        assert_eq!(at(r#""tanh""#), "config.embedding.dense[0].activation");
        assert_eq!(at(r#""x,]""#), r#"config.a\"b"#);
        assert_eq!(at("]}}"), "config");
        assert_eq!(at("[]}"), "");
        let e = serde_json::from_slice::<Metadata>(doc).unwrap_err();
        let (field, reason) = locate_json_error(doc, &e);
        assert!(!reason.contains("column"), "{field}: {reason}");
    }

    fn phi_like() -> ModelConfig {
        ModelConfig {
            architecture: Architecture::Phi3,
            source_architecture: "Phi3ForCausalLM".into(),
            hidden_size: 64,
            intermediate_size: 128,
            num_layers: 2,
            num_heads: 4,
            num_kv_heads: 2,
            head_dim: 16,
            vocab_size: 320,
            max_position_embeddings: 256,
            rms_norm_eps: 1e-5,
            rope_theta: 1e4,
            rope_scaling: Some(RopeScaling::LongRope {
                short_factor: vec![1.0; 6],
                long_factor: vec![2.0; 6],
                original_max_position_embeddings: 16,
                attention_factor: 1.4,
            }),
            tie_word_embeddings: false,
            attention_bias: false,
            sliding_window: None,
            bos_token_id: None,
            eos_token_ids: vec![2],
            family: FamilyOptions {
                rotary_dim: Some(12),
                ..FamilyOptions::default()
            },
        }
    }

    /// The new fields round-trip through JSON under their documented names, and `check`
    /// names the field of each inconsistency a file could carry.
    #[test]
    fn partial_rotary_and_longrope_are_checked() {
        let c = phi_like();
        assert_eq!(c.check(), Ok(()));
        let json = serde_json::to_value(&c).unwrap();
        assert_eq!(json["rotary_dim"], 12);
        assert_eq!(json["rope_scaling"]["type"], "longrope");
        assert!(
            json.get("rope_pairing").is_none(),
            "default pairing is omitted"
        );
        let back: ModelConfig = serde_json::from_value(json).unwrap();
        assert_eq!(back, c);

        type Edit = fn(&mut ModelConfig);
        let cases: [(Edit, &str); 6] = [
            (|c| c.family.rotary_dim = Some(11), "rotary_dim"),
            (|c| c.family.rotary_dim = Some(18), "rotary_dim"),
            (|c| c.family.rotary_dim = Some(0), "rotary_dim"),
            (
                |c| c.family.rotary_dim = Some(16),
                "rope_scaling.short_factor",
            ),
            (
                |c| {
                    if let Some(RopeScaling::LongRope { long_factor, .. }) = &mut c.rope_scaling {
                        long_factor[2] = f64::NAN;
                    }
                },
                "rope_scaling.long_factor",
            ),
            (
                |c| {
                    if let Some(RopeScaling::LongRope {
                        attention_factor, ..
                    }) = &mut c.rope_scaling
                    {
                        *attention_factor = 0.0;
                    }
                },
                "rope_scaling.attention_factor",
            ),
        ];
        for (edit, field) in cases {
            let mut c = phi_like();
            edit(&mut c);
            assert_eq!(c.check().unwrap_err().field, field);
        }
    }

    /// Values that fit an f64 or a u64 but not what the runner narrows them to, and layer
    /// counts whose tensors no file can hold, are refused by the check, naming the field.
    #[test]
    fn values_that_overflow_when_narrowed_are_refused() {
        type Edit = fn(&mut ModelConfig);
        let cases: [(Edit, &str); 9] = [
            (
                |c| c.max_position_embeddings = 1 << 32,
                "max_position_embeddings",
            ),
            (|c| c.sliding_window = Some(1 << 32), "sliding_window"),
            (|c| c.rope_theta = 1.0, "rope_theta"),
            (|c| c.family.attn_scale = Some(1e150), "attn_scale"),
            (|c| c.family.attn_scale = Some(1e-300), "attn_scale"),
            (|c| c.family.embed_scale = Some(1e39), "embed_scale"),
            (|c| c.num_layers = 1 << 24, "num_layers"),
            (|c| c.num_layers = 1 << 20, "num_layers"),
            (
                |c| {
                    if let Some(RopeScaling::LongRope {
                        attention_factor, ..
                    }) = &mut c.rope_scaling
                    {
                        *attention_factor = 1e150;
                    }
                },
                "rope_scaling.attention_factor",
            ),
        ];
        for (edit, field) in cases {
            let mut c = phi_like();
            edit(&mut c);
            let p = c.check().unwrap_err();
            assert_eq!(p.field, field, "{}", p.reason);
        }
        let mut c = phi_like();
        c.num_layers = 1 << 16;
        assert_eq!(c.check(), Ok(()), "a large layer count a file can hold");
    }

    /// Dense layers chain from the hidden width, at most two, each of a bounded width; their
    /// tensors join the expected list.
    #[test]
    fn dense_layers_are_checked_and_listed() {
        let dense = |i, o| DenseLayer {
            in_features: i,
            out_features: o,
            bias: true,
            activation: DenseActivation::Tanh,
        };
        let with = |layers: Vec<DenseLayer>| {
            let mut c = phi_like();
            let mut e = EmbeddingSpec::pooled(Pooling::Mean, true);
            e.dense = layers;
            c.family.embedding = Some(e);
            c
        };
        let h = phi_like().hidden_size;
        let c = with(vec![dense(h, 3 * h), dense(3 * h, 7)]);
        assert_eq!(c.check(), Ok(()));
        let listed: Vec<_> = crate::expected_tensors(&c)
            .into_iter()
            .filter(|(n, _)| n.role.dense_index().is_some())
            .map(|(n, shape)| (n.to_string(), shape))
            .collect();
        assert_eq!(
            listed,
            [
                ("dense.0.weight".to_string(), vec![3 * h, h]),
                ("dense.0.bias".to_string(), vec![3 * h]),
                ("dense.1.weight".to_string(), vec![7, 3 * h]),
                ("dense.1.bias".to_string(), vec![7]),
            ]
        );
        for layers in [
            vec![dense(h + 1, h)],
            vec![dense(h, 8), dense(9, 8)],
            vec![dense(h, 0)],
            vec![dense(h, MAX_CONFIG_DIM + 1)],
            vec![dense(h, h), dense(h, h), dense(h, h)],
        ] {
            let p = with(layers.clone()).check().unwrap_err();
            assert_eq!(p.field, "embedding.dense", "{layers:?}: {}", p.reason);
        }
    }

    #[test]
    fn json_depth_is_counted_outside_strings() {
        let nested = |n: usize| format!("{}{}", "[".repeat(n), "]".repeat(n));
        assert!(!json_depth_exceeds(nested(128).as_bytes(), 128));
        assert!(json_depth_exceeds(nested(129).as_bytes(), 128));
        assert!(json_depth_exceeds(nested(1_000_000).as_bytes(), 128));
        let in_string = format!("{{\"k\": \"{}\\\"[\"}}", "[".repeat(500));
        assert!(!json_depth_exceeds(in_string.as_bytes(), 2), "{in_string}");
    }

    #[test]
    fn rfc3339_known_dates() {
        assert_eq!(rfc3339_from_unix(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339_from_unix(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339_from_unix(1_795_000_000), "2026-11-18T11:06:40Z");
    }
}
