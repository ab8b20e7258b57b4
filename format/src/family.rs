//! The families Kiln implements, described as data: one [`FamilySpec`] row per
//! [`Architecture`], read by everything that used to branch on the architecture.
//!
//! A row holds what a family's sources spell and assume: its Hugging Face class and
//! `config.json` defaults ([`HfSpec`]), its GGUF architecture name and what llama.cpp's graph
//! for it hard-wires ([`GgufSpec`]), the options every model of the family has (q/k norms,
//! output norms, norm style, activation, rotary pairing), partial rotary, LongRoPE, interleaved
//! sliding-window layers ([`SlidingLayers`]), the Hugging Face module names of its norms
//! ([`NormModules`], for tensor and activation names) and the projections its sources store
//! fused ([`Fusion`]). The converter's config resolvers, GGUF import and export, its tensor-name
//! table and the runner's activation names read the row; a family that differs from another
//! only in these values is a new row (plus its tensor-name rows and fixtures), nothing else.

use crate::metadata::{
    Architecture, AttentionMask, FamilyOptions, MlpActivation, MlpKind, NormKind, NormPlace,
    NormStyle, Positions, RopePairing,
};

/// Everything Kiln knows about one family, as data.
#[derive(Debug)]
pub struct FamilySpec {
    /// The architecture this row describes.
    pub architecture: Architecture,
    /// The family's name in messages (`Gemma 3`).
    pub display: &'static str,
    /// Its Hugging Face checkpoints.
    pub hf: HfSpec,
    /// Its GGUF files, as llama.cpp writes and runs them.
    pub gguf: GgufSpec,
    /// Per-head RMSNorm of queries and keys.
    pub qk_norm: bool,
    /// Norms on the attention and MLP outputs.
    pub post_norms: bool,
    /// How every RMSNorm weight applies (and, for `(1 + w)`, that llama.cpp's converter
    /// stores the weights with the 1 added).
    pub norm_style: NormStyle,
    /// The MLP's gate activation, the only one the family's configs may name.
    pub mlp_activation: MlpActivation,
    /// Which elements a rotary pair couples.
    pub rope_pairing: RopePairing,
    /// The default `partial_rotary_factor` of a family that may rotate only the leading part of
    /// each head (and whose GGUF states the rotated width apart from the head width); `None`
    /// where every element rotates.
    pub partial_rotary: Option<f64>,
    /// Whether the family's configs may carry LongRoPE scaling (its GGUF as the
    /// `rope_factors_long`/`_short` tensors); the others may carry Llama 3 scaling as the
    /// `rope_freqs` tensor, unless they rotate partially.
    pub longrope: bool,
    /// Embeddings scaled by `√hidden` (as the f32 transformers computes).
    pub scaled_embeddings: bool,
    /// Sliding-window layers interleaved with global ones, if the family has them.
    pub sliding_layers: Option<SlidingLayers>,
    /// The Hugging Face module names of the norms around the MLP.
    pub norms: NormModules,
    /// The projections each source stores fused.
    pub fused: Fusion,
    /// How the norms normalize (RMSNorm, or LayerNorm with biases).
    pub norm_kind: NormKind,
    /// Where the norms sit (before each sublayer, or after each residual add).
    pub norm_place: NormPlace,
    /// Whether the MLP has a gate.
    pub mlp_kind: MlpKind,
    /// How positions enter (rotary, or learned rows added to the embeddings).
    pub positions: Positions,
    /// Which keys a query sees.
    pub attention_mask: AttentionMask,
    /// Biases on the attention output and the MLP projections.
    pub linear_bias: bool,
    /// Whether the family is an encoder whose checkpoints are embedding models (pooled
    /// states, no output head).
    pub encoder: bool,
}

/// A family's Hugging Face checkpoints: its class, and the defaults its config class applies
/// to keys `config.json` leaves out.
#[derive(Debug)]
pub struct HfSpec {
    /// The class named in `architectures` (`LlamaForCausalLM`).
    pub class: &'static str,
    /// The bare backbone's class (`LlamaModel`), which `AutoModel` saves and an embedding
    /// model built on the family may name instead (EmbeddingGemma: `Gemma3TextModel`).
    pub backbone: &'static str,
    /// The `model_type` that names the family when `architectures` is absent.
    pub model_type: &'static str,
    /// `max_position_embeddings` when absent.
    pub max_position_embeddings: u64,
    /// `head_dim` when absent; `None`: `hidden_size / num_attention_heads`.
    pub head_dim: Option<u64>,
    /// The key naming the norm epsilon (`rms_norm_eps`; BERT's `layer_norm_eps`).
    pub eps_key: &'static str,
    /// The epsilon when absent.
    pub rms_norm_eps: f64,
    /// `rope_theta` when absent.
    pub rope_theta: f64,
    /// The key naming the MLP activation (`hidden_act`, Gemma's `hidden_activation`).
    pub activation_key: &'static str,
    /// Where the q/k/v biases come from.
    pub attention_bias: AttentionBias,
    /// `tie_word_embeddings` when absent.
    pub tie_word_embeddings: bool,
    /// How `sliding_window` is read.
    pub sliding_window: HfWindow,
    /// Keys naming features Kiln does not implement, refused when present (or true).
    pub refused: &'static [Refused],
    /// The key that, when true, makes every layer's attention bidirectional (Gemma 3's
    /// `use_bidirectional_attention`: EmbeddingGemma), if the family has one.
    pub bidirectional_key: Option<&'static str>,
}

/// Where a family's q/k/v biases come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionBias {
    /// Always present, whatever the config says (Qwen2Attention hard-wires them).
    Always,
    /// Never present, and no key for them (Phi-3's fused qkv_proj).
    Never,
    /// `attention_bias`, with this default.
    Config(bool),
    /// `attention_bias` must be false (or absent): Kiln does not implement them for the family.
    Refused,
}

/// How a family's `config.json` states its attention window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HfWindow {
    /// The family has none; the key is not read.
    Ignored,
    /// `sliding_window`, every layer windowed when set.
    Optional,
    /// `sliding_window`, with this default (the sliding layers' window).
    Default(u64),
}

/// A config key naming a feature Kiln does not implement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// Refused when present (and not null), with the reason.
    Present(&'static str, &'static str),
    /// Refused when true, with the reason.
    True(&'static str, &'static str),
}

/// A family's GGUF files: the name llama.cpp gives the architecture, and what its graph for
/// it assumes.
#[derive(Debug)]
pub struct GgufSpec {
    /// `general.architecture`.
    pub name: &'static str,
    /// Whether a file of that name imports as this family (one family per name: Mistral is
    /// written as `llama`, which imports as Llama).
    pub imported: bool,
    /// Whether llama.cpp's converter reorders the q/k rows for its rope (`llama` uses
    /// adjacent-pair rope on Hugging Face's half-split heads; the other graphs rotate as the
    /// checkpoint does).
    pub permute_qk: bool,
    /// How `<arch>.attention.sliding_window` states the window.
    pub window: GgufWindow,
    /// llama.cpp's graph hard-wires the family's options (the rotated width aside): an
    /// export refuses a model whose options, window or rope scaling differ from the row's.
    pub hard_wired: bool,
    /// llama.cpp's graph loads the attention output projection as `hidden × hidden`.
    pub square_attn_output: bool,
    /// Keys (after `<arch>.`) naming features Kiln does not implement, refused when present.
    pub refused: &'static [(&'static str, &'static str)],
    /// A token ending a turn that the file does not name as one, recognised (as llama.cpp
    /// does) by its spelling.
    pub end_of_turn: Option<&'static str>,
    /// Whether the vocabulary is written as SentencePiece's (Gemma's `▁` BPE with byte
    /// fallback), which import reads back for this family only.
    pub sentencepiece_vocab: bool,
    /// Whether llama.cpp ignores the window the file states (Phi-3), which an export notes.
    pub ignores_window: bool,
    /// The name of llama.cpp's graph for the family with bidirectional attention, an embedding
    /// model (Gemma 3's `gemma-embedding`: EmbeddingGemma), if it has one: such a file is
    /// written and read under this name, with the same keys and tensors as the family's
    /// (`<name>.` prefixed), its window two-sided.
    pub embedding_name: Option<&'static str>,
}

/// How a family's GGUF states its attention window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgufWindow {
    /// No key: the family attends over the whole context.
    Absent,
    /// The key must be present (the sliding layers' window).
    Required,
    /// The key, written even without a window, as 0 (Phi-4-mini).
    ZeroMeansNone,
}

/// Sliding-window layers interleaved with global ones (Gemma 3).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SlidingLayers {
    /// Every this many-th layer is global (`sliding_window_pattern`, when `layer_types` is
    /// absent; all llama.cpp assumes).
    pub global_every: u64,
    /// The sliding layers' RoPE base (`rope_local_base_freq` when absent; all llama.cpp
    /// assumes).
    pub local_rope_theta: f64,
    /// `query_pre_attn_scalar` when absent: scores are scaled by its `-½` power.
    pub query_pre_attn_scalar: f64,
}

/// The Hugging Face module names (under `model.layers.N.`) of the norms around the MLP: the
/// tensor names (`.weight`) and the activation names (`.output`) both come from them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NormModules {
    /// The pre-MLP norm (`post_attention_layernorm` in Llama).
    pub mlp: &'static str,
    /// The norms on the attention output and on the MLP output, in families with
    /// [`FamilySpec::post_norms`].
    pub post: Option<(&'static str, &'static str)>,
}

/// Projections a source stores as one tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Projection {
    /// `[q; k; v]` (and their biases).
    Qkv,
    /// `[gate; up]`.
    GateUp,
}

/// Which projections each source stores fused for a family.
#[derive(Debug)]
pub struct Fusion {
    /// Hugging Face checkpoints store these fused (read and written so).
    pub hf: &'static [Projection],
    /// GGUF files store these fused (read and written so).
    pub gguf: &'static [Projection],
    /// GGUF files may store these either way: fused is read, split is written.
    pub gguf_also_read: &'static [Projection],
}

/// The Llama family's pre-MLP norm; no output norms.
const LLAMA_NORMS: NormModules = NormModules {
    mlp: "post_attention_layernorm",
    post: None,
};

const SPLIT: Fusion = Fusion {
    hf: &[],
    gguf: &[],
    gguf_also_read: &[],
};

/// A Llama-family row, the base of the others.
const LLAMA: FamilySpec = FamilySpec {
    architecture: Architecture::Llama,
    display: "Llama",
    hf: HfSpec {
        class: "LlamaForCausalLM",
        backbone: "LlamaModel",
        model_type: "llama",
        max_position_embeddings: 2048,
        head_dim: None,
        eps_key: "rms_norm_eps",
        rms_norm_eps: 1e-6,
        rope_theta: 10_000.0,
        activation_key: "hidden_act",
        attention_bias: AttentionBias::Config(false),
        tie_word_embeddings: false,
        sliding_window: HfWindow::Ignored,
        refused: &[],
        bidirectional_key: None,
    },
    gguf: GgufSpec {
        name: "llama",
        imported: true,
        permute_qk: true,
        window: GgufWindow::Absent,
        hard_wired: false,
        square_attn_output: false,
        refused: &[],
        end_of_turn: None,
        sentencepiece_vocab: false,
        ignores_window: false,
        embedding_name: None,
    },
    qk_norm: false,
    post_norms: false,
    norm_style: NormStyle::Weight,
    mlp_activation: MlpActivation::Silu,
    rope_pairing: RopePairing::Half,
    partial_rotary: None,
    longrope: false,
    scaled_embeddings: false,
    sliding_layers: None,
    norms: LLAMA_NORMS,
    fused: SPLIT,
    norm_kind: NormKind::Rms,
    norm_place: NormPlace::Pre,
    mlp_kind: MlpKind::Gated,
    positions: Positions::Rope,
    attention_mask: AttentionMask::Causal,
    linear_bias: false,
    encoder: false,
};

/// Qwen's per-layer window, which Kiln does not implement.
const QWEN_REFUSED: &[Refused] = &[Refused::True(
    "use_sliding_window",
    "Qwen's per-layer sliding window is not supported",
)];

/// GLM and GLM-4: what their config classes default and llama.cpp's `chatglm`/`glm4` graphs
/// assume (interleaved rotary pairs on half of each head, the MLP stored fused).
const GLM: FamilySpec = FamilySpec {
    architecture: Architecture::Glm,
    display: "GLM",
    hf: HfSpec {
        class: "GlmForCausalLM",
        backbone: "GlmModel",
        model_type: "glm",
        max_position_embeddings: 131_072,
        head_dim: Some(128),
        rms_norm_eps: 1.5625e-7,
        attention_bias: AttentionBias::Config(true),
        ..LLAMA.hf
    },
    gguf: GgufSpec {
        // What llama.cpp's converter writes for `GlmForCausalLM` (and the original ChatGLM).
        name: "chatglm",
        permute_qk: false,
        hard_wired: true,
        square_attn_output: true,
        refused: MROPE_REFUSED,
        ..LLAMA.gguf
    },
    rope_pairing: RopePairing::Interleaved,
    partial_rotary: Some(0.5),
    fused: Fusion {
        hf: &[Projection::GateUp],
        gguf: &[Projection::GateUp],
        // llama.cpp loads a fused `attn_qkv`, as the original ChatGLM checkpoints convert.
        gguf_also_read: &[Projection::Qkv],
    },
    ..LLAMA
};

/// Multimodal rotary sections (GLM-4V), which Kiln does not implement.
const MROPE_REFUSED: &[(&str, &str)] = &[(
    "rope.dimension_sections",
    "multimodal rotary sections (M-RoPE) are not supported",
)];

/// BERT-style encoders (`BertModel`, what sentence-transformers' all-MiniLM and bge
/// checkpoints hold): post-norm LayerNorm blocks with biases everywhere, a plain GELU MLP,
/// learned absolute and token-type position embeddings, bidirectional attention.
const BERT: FamilySpec = FamilySpec {
    architecture: Architecture::Bert,
    display: "BERT",
    hf: HfSpec {
        class: "BertModel",
        backbone: "BertModel",
        model_type: "bert",
        max_position_embeddings: 512,
        eps_key: "layer_norm_eps",
        rms_norm_eps: 1e-12,
        attention_bias: AttentionBias::Always,
        tie_word_embeddings: true,
        refused: &[
            Refused::True("is_decoder", "BERT as a decoder is not supported"),
            Refused::True("add_cross_attention", "cross-attention is not supported"),
        ],
        ..LLAMA.hf
    },
    gguf: GgufSpec {
        name: "bert",
        permute_qk: false,
        ..LLAMA.gguf
    },
    mlp_activation: MlpActivation::Gelu,
    norms: NormModules {
        mlp: "attention.output.LayerNorm",
        post: None,
    },
    norm_kind: NormKind::Layer,
    norm_place: NormPlace::Post,
    mlp_kind: MlpKind::Plain,
    positions: Positions::Learned,
    attention_mask: AttentionMask::Bidirectional,
    linear_bias: true,
    encoder: true,
    ..LLAMA
};

/// Every family, in [`Architecture::ALL`]'s order.
pub static FAMILIES: [FamilySpec; 9] = [
    LLAMA,
    FamilySpec {
        architecture: Architecture::Mistral,
        display: "Mistral",
        hf: HfSpec {
            class: "MistralForCausalLM",
            backbone: "MistralModel",
            model_type: "mistral",
            max_position_embeddings: 4096 * 32,
            sliding_window: HfWindow::Optional,
            ..LLAMA.hf
        },
        // llama.cpp runs Mistral checkpoints as `llama`, as its converter writes them.
        gguf: GgufSpec {
            imported: false,
            ..LLAMA.gguf
        },
        ..LLAMA
    },
    FamilySpec {
        architecture: Architecture::Qwen2,
        display: "Qwen2",
        hf: HfSpec {
            class: "Qwen2ForCausalLM",
            backbone: "Qwen2Model",
            model_type: "qwen2",
            max_position_embeddings: 32768,
            attention_bias: AttentionBias::Always,
            refused: QWEN_REFUSED,
            ..LLAMA.hf
        },
        gguf: GgufSpec {
            name: "qwen2",
            permute_qk: false,
            ..LLAMA.gguf
        },
        ..LLAMA
    },
    FamilySpec {
        architecture: Architecture::Qwen3,
        display: "Qwen3",
        hf: HfSpec {
            class: "Qwen3ForCausalLM",
            backbone: "Qwen3Model",
            model_type: "qwen3",
            max_position_embeddings: 32768,
            head_dim: Some(128),
            refused: QWEN_REFUSED,
            ..LLAMA.hf
        },
        gguf: GgufSpec {
            name: "qwen3",
            permute_qk: false,
            ..LLAMA.gguf
        },
        qk_norm: true,
        ..LLAMA
    },
    FamilySpec {
        architecture: Architecture::Gemma3,
        display: "Gemma 3",
        hf: HfSpec {
            class: "Gemma3ForCausalLM",
            backbone: "Gemma3TextModel",
            model_type: "gemma3_text",
            max_position_embeddings: 131_072,
            head_dim: Some(256),
            rope_theta: 1_000_000.0,
            activation_key: "hidden_activation",
            attention_bias: AttentionBias::Refused,
            tie_word_embeddings: true,
            sliding_window: HfWindow::Default(4096),
            refused: &[
                Refused::Present(
                    "final_logit_softcapping",
                    "logit soft-capping is not supported",
                ),
                Refused::Present(
                    "attn_logit_softcapping",
                    "logit soft-capping is not supported",
                ),
            ],
            bidirectional_key: Some("use_bidirectional_attention"),
            ..LLAMA.hf
        },
        gguf: GgufSpec {
            name: "gemma3",
            permute_qk: false,
            window: GgufWindow::Required,
            refused: &[
                (
                    "final_logit_softcapping",
                    "logit soft-capping is not supported",
                ),
                (
                    "attn_logit_softcapping",
                    "logit soft-capping is not supported",
                ),
            ],
            // A Gemma turn ends with `<end_of_turn>`, which the file does not name as the end
            // of text.
            end_of_turn: Some("<end_of_turn>"),
            sentencepiece_vocab: true,
            embedding_name: Some("gemma-embedding"),
            ..LLAMA.gguf
        },
        qk_norm: true,
        post_norms: true,
        norm_style: NormStyle::OnePlusWeight,
        mlp_activation: MlpActivation::GeluTanh,
        scaled_embeddings: true,
        sliding_layers: Some(SlidingLayers {
            global_every: 6,
            local_rope_theta: 10_000.0,
            query_pre_attn_scalar: 256.0,
        }),
        // Its `post_attention_layernorm` is the norm on the attention output (Llama's name for
        // the pre-MLP norm).
        norms: NormModules {
            mlp: "pre_feedforward_layernorm",
            post: Some(("post_attention_layernorm", "post_feedforward_layernorm")),
        },
        ..LLAMA
    },
    FamilySpec {
        architecture: Architecture::Phi3,
        display: "Phi-3",
        hf: HfSpec {
            class: "Phi3ForCausalLM",
            backbone: "Phi3Model",
            model_type: "phi3",
            max_position_embeddings: 4096,
            rms_norm_eps: 1e-5,
            // Phi-3's fused qkv_proj never has one (Phi3Config has no such field).
            attention_bias: AttentionBias::Never,
            // Every layer windowed when set (create_sliding_window_causal_mask).
            sliding_window: HfWindow::Optional,
            ..LLAMA.hf
        },
        gguf: GgufSpec {
            name: "phi3",
            permute_qk: false,
            window: GgufWindow::ZeroMeansNone,
            hard_wired: true,
            square_attn_output: true,
            refused: MROPE_REFUSED,
            ignores_window: true,
            ..LLAMA.gguf
        },
        partial_rotary: Some(1.0),
        longrope: true,
        fused: Fusion {
            hf: &[Projection::Qkv, Projection::GateUp],
            gguf: &[Projection::Qkv, Projection::GateUp],
            gguf_also_read: &[],
        },
        ..LLAMA
    },
    FamilySpec {
        architecture: Architecture::Glm4,
        display: "GLM-4",
        hf: HfSpec {
            class: "Glm4ForCausalLM",
            backbone: "Glm4Model",
            model_type: "glm4",
            ..GLM.hf
        },
        gguf: GgufSpec {
            name: "glm4",
            square_attn_output: false,
            ..GLM.gguf
        },
        post_norms: true,
        norms: NormModules {
            mlp: "post_attention_layernorm",
            post: Some(("post_self_attn_layernorm", "post_mlp_layernorm")),
        },
        ..GLM
    },
    GLM,
    BERT,
];

impl Architecture {
    /// This family's row of [`FAMILIES`].
    pub fn spec(self) -> &'static FamilySpec {
        FAMILIES
            .iter()
            .find(|s| s.architecture == self)
            .expect("every architecture has a row (tested)")
    }
}

impl FamilySpec {
    /// The family whose Hugging Face class is `class`, or (without one) whose `model_type` is
    /// `model_type`.
    pub fn from_hf(class: Option<&str>, model_type: Option<&str>) -> Option<&'static FamilySpec> {
        FAMILIES.iter().find(|s| {
            class.is_some_and(|c| c == s.hf.class || c == s.hf.backbone)
                || (class.is_none() && Some(s.hf.model_type) == model_type)
        })
    }

    /// The family a GGUF file of `general.architecture` `name` imports as (its graph's name,
    /// or its bidirectional embedding graph's: [`GgufSpec::embedding_name`]).
    pub fn from_gguf(name: &str) -> Option<&'static FamilySpec> {
        FAMILIES.iter().find(|s| {
            (s.gguf.imported && s.gguf.name == name) || s.gguf.embedding_name == Some(name)
        })
    }

    /// `LlamaForCausalLM, MistralForCausalLM, …`: the classes Kiln converts, for messages.
    pub fn hf_classes() -> String {
        FAMILIES
            .iter()
            .map(|s| s.hf.class)
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// `llama, qwen2, …`: the GGUF architectures Kiln imports, for messages.
    pub fn gguf_names() -> String {
        FAMILIES
            .iter()
            .filter(|s| s.gguf.imported)
            .flat_map(|s| std::iter::once(s.gguf.name).chain(s.gguf.embedding_name))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// The options every model of the family has (the rest at their Llama values).
    pub fn options(&self) -> FamilyOptions {
        FamilyOptions {
            qk_norm: self.qk_norm,
            post_norms: self.post_norms,
            norm_style: self.norm_style,
            mlp_activation: self.mlp_activation,
            rope_pairing: self.rope_pairing,
            norm_kind: self.norm_kind,
            norm_place: self.norm_place,
            mlp_kind: self.mlp_kind,
            positions: self.positions,
            attention_mask: self.attention_mask,
            linear_bias: self.linear_bias,
            ..FamilyOptions::default()
        }
    }

    /// Whether the family's sources may rotate only part of each head.
    pub fn partial_rotary(&self) -> bool {
        self.partial_rotary.is_some()
    }
}

impl MlpActivation {
    /// The activation as `config.json` names it, and what Kiln implements with it.
    pub fn hf_name(self) -> (&'static str, &'static str) {
        match self {
            MlpActivation::Silu => ("silu", "SwiGLU with silu"),
            MlpActivation::GeluTanh => ("gelu_pytorch_tanh", "GeGLU with tanh-approximated GELU"),
            MlpActivation::Gelu => ("gelu", "a plain MLP with exact (erf) GELU"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One row per architecture, in its order; every Hugging Face class and GGUF name imports
    /// as exactly one family, and every family exports under a name that imports as a family
    /// GGUF runs the same way (Mistral as Llama).
    #[test]
    fn the_table_has_one_row_per_architecture_and_names_meet() {
        assert_eq!(FAMILIES.len(), Architecture::ALL.len());
        for (spec, a) in FAMILIES.iter().zip(Architecture::ALL) {
            assert_eq!(spec.architecture, a);
            assert!(std::ptr::eq(a.spec(), spec));
            let hf = FamilySpec::from_hf(Some(spec.hf.class), None).unwrap();
            assert_eq!(hf.architecture, a);
            let by_type = FamilySpec::from_hf(None, Some(spec.hf.model_type)).unwrap();
            assert_eq!(by_type.architecture, a);
            let back = FamilySpec::from_gguf(spec.gguf.name).unwrap_or_else(|| {
                panic!(
                    "{a:?} exports as `{}`, which import refuses",
                    spec.gguf.name
                )
            });
            assert_eq!(back.gguf.name, spec.gguf.name);
            assert_eq!(back.gguf.permute_qk, spec.gguf.permute_qk, "{a:?}");
            assert_eq!(back.options(), spec.options(), "{a:?}");
            let importers = FAMILIES
                .iter()
                .filter(|s| s.gguf.imported && s.gguf.name == spec.gguf.name)
                .count();
            assert_eq!(importers, 1, "{}", spec.gguf.name);
        }
    }

    /// The rows agree with themselves: output norms have their module names, partial rotary
    /// and LongRoPE go with a GGUF that states them, sliding layers with a window.
    #[test]
    fn rows_are_consistent() {
        for s in &FAMILIES {
            assert_eq!(s.post_norms, s.norms.post.is_some(), "{:?}", s.architecture);
            if s.sliding_layers.is_some() {
                assert!(matches!(s.hf.sliding_window, HfWindow::Default(_)));
                assert_eq!(s.gguf.window, GgufWindow::Required);
            }
            if s.longrope {
                assert!(s.partial_rotary(), "{:?}", s.architecture);
            }
            if s.gguf.hard_wired {
                assert!(s.partial_rotary(), "{:?}", s.architecture);
            }
        }
    }
}
