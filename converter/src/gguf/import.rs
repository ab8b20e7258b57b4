//! GGUF → `.kiln`: a llama.cpp model file as a Kiln model.
//!
//! The configuration is resolved from the architecture's hyperparameter keys, the tokenizer is
//! rebuilt as a `tokenizer.json` ([`super::tokenizer::from_gguf`]), and tensors get their
//! canonical names, Kiln's dimension order and (for the `llama` architecture) the Hugging Face
//! q/k row order back. Matrices of the GGML types Kiln stores (F32, F16, BF16, Q8_0, Q4_0,
//! Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) are kept byte for byte, except that Q4_0 matrices of whole
//! sixteen-row groups are stored as `q4_0x16` (the same blocks, interleaved:
//! [`DType::storage_for`]), as `kiln-quantize` writes them, because that is the layout the
//! runner's one-token product reads. The block types Kiln decodes but does not store
//! ([`super::dequant::DEQUANTIZED`]: Q4_1) are dequantized to a float dtype (F16 unless asked
//! otherwise), and so is every block type with `dequantize_all`; 1-D tensors (norms, biases)
//! in a block type become f32, since the runner reads vectors as floats. Both are listed in the
//! summary and the provenance; anything else is refused, naming the type. A `gemma3` file
//! states less than Kiln's configuration holds: the rest is what llama.cpp assumes when it runs
//! one (`gemma3_family`), and its norm weights lose the 1 llama.cpp's converter adds.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use kiln_format::metadata::now_rfc3339;
use kiln_format::values::{cast_bytes, count_non_finite};
use kiln_format::{
    expected_tensors, Architecture, DType, FamilyOptions, KilnWriter, LayerKind, Metadata,
    MlpActivation, ModelConfig, NormStyle, ProvenanceStep, Role, RopePairing, RopeScaling,
    TensorName, TensorSpec,
};
use rayon::prelude::*;
use serde_json::json;

use super::dequant::{dequantize, DEQUANTIZED};
use super::read::{GgufFile, GgufHeader, GgufTensor};
use super::rope::{self, Direction};
use super::tokenizer;
use super::value::Value;
use crate::error::{ConvertError, Result};
use crate::hf::sha256_file;
use crate::names::{self, Source};
use crate::Progress;

/// What to import and how.
#[derive(Debug, Clone)]
pub struct ImportOptions {
    /// The GGUF file to read.
    pub input: PathBuf,
    /// The `.kiln` file to write.
    pub output: PathBuf,
    /// Replace an existing output file.
    pub overwrite: bool,
    /// Float dtype for matrices whose GGML type Kiln does not store (Q4_1).
    pub dequantize_to: DType,
    /// Dequantize the block types Kiln does store (Q8_0, Q4_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K)
    /// too, so that the whole model is in `dequantize_to`: the file then computes exactly what
    /// a float runtime given the GGUF's dequantized weights computes, which is how it is
    /// checked against transformers.
    pub dequantize_all: bool,
    /// Import tensors holding NaN or infinity (listed in the summary) instead of refusing.
    pub allow_non_finite: bool,
}

/// What an import did.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ImportSummary {
    /// Input file.
    pub input: String,
    /// Output file.
    pub output: String,
    /// `general.architecture` of the input.
    pub architecture: String,
    /// Tensors written.
    pub tensors: usize,
    /// Tensors written per dtype.
    pub dtypes: BTreeMap<String, usize>,
    /// Tensors kept as the GGUF stores them (the dtype of the same id), per GGML type.
    pub kept: BTreeMap<String, usize>,
    /// Matrices dequantized to `dequantize_to`, per source GGML type.
    pub dequantized: BTreeMap<String, usize>,
    /// 1-D tensors (norms, biases) the GGUF holds in a block type, decoded to f32 (exactly:
    /// every dequantized value is an f32), per source GGML type.
    pub vectors_to_f32: BTreeMap<String, usize>,
    /// Size of the output file.
    pub bytes_out: u64,
    /// Wall time in seconds.
    pub seconds: f64,
    /// Tensors holding NaN or infinity, imported because `allow_non_finite` was set.
    pub non_finite: Vec<String>,
}

/// GGUF `general.architecture` names Kiln imports, and the architecture each becomes; the
/// reverse direction is [`super::export::gguf_architecture`] (a test keeps the two agreeing).
pub const SUPPORTED: &[(&str, Architecture)] = &[
    ("llama", Architecture::Llama),
    ("qwen2", Architecture::Qwen2),
    ("qwen3", Architecture::Qwen3),
    ("gemma3", Architecture::Gemma3),
    ("phi3", Architecture::Phi3),
    ("glm4", Architecture::Glm4),
    // What llama.cpp's converter writes for `GlmForCausalLM` (and the original ChatGLM).
    ("chatglm", Architecture::Glm),
];

/// The GGML types an import keeps as they are (Kiln's own dtypes), by name, for messages.
fn kept_type_names() -> String {
    kiln_format::DType::ALL
        .iter()
        .filter(|d| d.logical() == **d)
        .map(|d| super::types::GgmlType::of(*d).name)
        .collect::<Vec<_>>()
        .join(", ")
}

/// Families whose GGUF states the rotated width (`rope.dimension_count`) apart from the head
/// width: Phi-4-mini and GLM rotate only the leading part of each head.
fn partial_rotary(a: Architecture) -> bool {
    matches!(
        a,
        Architecture::Phi3 | Architecture::Glm4 | Architecture::Glm
    )
}

struct Keys<'h> {
    file: &'h str,
    header: &'h GgufHeader,
    arch: &'h str,
}

impl<'h> Keys<'h> {
    fn err(&self, key: &str, reason: impl Into<String>) -> ConvertError {
        ConvertError::GgufKey {
            file: self.file.to_string(),
            key: key.to_string(),
            reason: reason.into(),
        }
    }

    fn get(&self, suffix: &str) -> Option<(String, &'h Value)> {
        let key = format!("{}.{suffix}", self.arch);
        self.header.get(&key).map(|v| (key, v))
    }

    fn u64_opt(&self, suffix: &str) -> Result<Option<u64>> {
        match self.get(suffix) {
            None => Ok(None),
            Some((key, v)) => v
                .as_u64()
                .filter(|&n| n > 0 && n <= 1 << 32)
                .map(Some)
                .ok_or_else(|| self.err(&key, format!("expected a positive integer, found {v:?}"))),
        }
    }

    fn u64(&self, suffix: &str) -> Result<u64> {
        self.u64_opt(suffix)?
            .ok_or_else(|| self.err(&format!("{}.{suffix}", self.arch), "missing"))
    }

    fn f64_opt(&self, suffix: &str) -> Result<Option<f64>> {
        match self.get(suffix) {
            None => Ok(None),
            Some((key, v)) => v
                .as_f64()
                .filter(|x| x.is_finite() && *x > 0.0)
                .map(Some)
                .ok_or_else(|| self.err(&key, format!("expected a positive number, found {v:?}"))),
        }
    }
}

fn resolve_config(file: &str, h: &GgufHeader, bytes: &[u8]) -> Result<ModelConfig> {
    let arch_key = "general.architecture";
    let arch = h
        .get(arch_key)
        .ok_or_else(|| ConvertError::GgufKey {
            file: file.into(),
            key: arch_key.into(),
            reason: "missing".into(),
        })?
        .as_str()
        .ok_or_else(|| ConvertError::GgufKey {
            file: file.into(),
            key: arch_key.into(),
            reason: "expected a string".into(),
        })?;
    let architecture = SUPPORTED
        .iter()
        .find(|(name, _)| *name == arch)
        .map(|&(_, a)| a)
        .ok_or_else(|| ConvertError::UnsupportedArchitecture {
            path: file.into(),
            found: arch.into(),
            supported: format!(
                "GGUF general.architecture {}",
                SUPPORTED.iter().map(|s| s.0).collect::<Vec<_>>().join(", "),
            ),
        })?;
    let k = Keys {
        file,
        header: h,
        arch,
    };
    let hidden = k.u64("embedding_length")?;
    let heads = k.u64("attention.head_count")?;
    let head_dim = head_dim(&k, hidden, heads, partial_rotary(architecture))?;
    let rotary_dim = rotary_dim(&k, architecture, head_dim)?;
    let embed = h.tensor("token_embd.weight");
    let vocab = match k.u64_opt("vocab_size")? {
        Some(v) => v,
        None => match (embed, h.get("tokenizer.ggml.tokens")) {
            (Some(t), _) if t.dims.len() == 2 => t.dims[1],
            (_, Some(Value::Array(a))) => a.len() as u64,
            _ => return Err(k.err(&format!("{arch}.vocab_size"), "missing")),
        },
    };
    if let Some(Value::Array(a)) = h.get("tokenizer.ggml.tokens") {
        if a.len() as u64 > vocab {
            return Err(k.err(
                "tokenizer.ggml.tokens",
                format!(
                    "{} tokens, more than the model's vocabulary of {vocab} (the embedding's \
                     rows): ids past it have no embedding",
                    a.len()
                ),
            ));
        }
    }
    let rope_scaling = match k.get("rope.scaling.type") {
        None => None,
        Some((_, Value::Str(s))) if s == "none" => None,
        Some((_, Value::Str(s))) if s == "linear" => Some(RopeScaling::Linear {
            factor: k
                .f64_opt("rope.scaling.factor")?
                .ok_or_else(|| k.err(&format!("{arch}.rope.scaling.factor"), "missing"))?,
        }),
        Some((key, v)) => {
            return Err(k.err(
                &key,
                format!("rope scaling {v:?} is not supported (linear or none)"),
            ))
        }
    };
    let rope_theta = k.f64_opt("rope.freq_base")?.unwrap_or(10_000.0);
    let rope_scaling = if architecture == Architecture::Phi3 {
        match longrope_scaling(file, h, bytes, &k, rotary_dim)? {
            Some(s) => Some(s),
            None => rope_scaling,
        }
    } else if partial_rotary(architecture) {
        // `chatglm`/`glm4` load no factor tensors: one here is refused as unknown below.
        rope_scaling
    } else {
        match h.tensor("rope_freqs.weight") {
            None => rope_scaling,
            Some(_) => Some(llama3_scaling(file, h, rope_theta, head_dim)?),
        }
    };
    // A token id that does not fit a u32 is refused, not truncated into another token.
    let id = |key: &str| -> Result<Option<u32>> {
        match h.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .map(Some)
                .ok_or_else(|| k.err(key, format!("expected a token id, found {v:?}"))),
        }
    };
    let mut eos_token_ids: Vec<u32> = Vec::new();
    for key in ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"] {
        if let Some(e) = id(key)? {
            if !eos_token_ids.contains(&e) {
                eos_token_ids.push(e);
            }
        }
    }
    let gemma = architecture == Architecture::Gemma3;
    if gemma && h.get("tokenizer.ggml.eot_token_id").is_none() {
        // A Gemma turn ends with `<end_of_turn>`, which the file does not name as the end of
        // text; llama.cpp recognises it by its spelling, and so does Kiln.
        if let Some(Value::Array(super::value::Array::Str(tokens))) = h.get("tokenizer.ggml.tokens")
        {
            if let Some(i) = tokens.iter().position(|t| t == "<end_of_turn>") {
                if !eos_token_ids.contains(&(i as u32)) {
                    eos_token_ids.push(i as u32);
                }
            }
        }
    }
    let num_layers = k.u64("block_count")?;
    let (family, sliding_window) = match architecture {
        Architecture::Gemma3 => {
            let window = k.u64("attention.sliding_window")?;
            (
                gemma3_family(&k, num_layers, hidden, heads, head_dim)?,
                Some(window),
            )
        }
        Architecture::Phi3 | Architecture::Glm4 | Architecture::Glm => {
            glm_phi3_family(&k, architecture, rotary_dim, head_dim)?
        }
        _ => (
            FamilyOptions {
                qk_norm: architecture == Architecture::Qwen3,
                ..FamilyOptions::default()
            },
            None,
        ),
    };
    Ok(ModelConfig {
        architecture,
        source_architecture: format!("GGUF {arch}"),
        hidden_size: hidden,
        intermediate_size: k.u64("feed_forward_length")?,
        num_layers,
        num_heads: heads,
        num_kv_heads: k.u64_opt("attention.head_count_kv")?.unwrap_or(heads),
        head_dim,
        vocab_size: vocab,
        max_position_embeddings: k.u64("context_length")?,
        rms_norm_eps: k
            .f64_opt("attention.layer_norm_rms_epsilon")?
            .ok_or_else(|| {
                k.err(
                    &format!("{arch}.attention.layer_norm_rms_epsilon"),
                    "missing",
                )
            })?,
        rope_theta,
        rope_scaling,
        tie_word_embeddings: h.tensor("output.weight").is_none(),
        attention_bias: h.tensor("blk.0.attn_q.bias").is_some()
            || h.tensor("blk.0.attn_qkv.bias").is_some(),
        sliding_window,
        bos_token_id: id("tokenizer.ggml.bos_token_id")?,
        eos_token_ids,
        family,
    })
}

/// The configuration an import of the GGUF file `bytes` (parsed into `h`; `file` names it in
/// errors) writes, checked as the import checks it before listing any tensor: the layer count
/// against the tensors the file declares, then [`ModelConfig::check`].
pub fn checked_config(file: &str, h: &GgufHeader, bytes: &[u8]) -> Result<ModelConfig> {
    let config = resolve_config(file, h, bytes)?;
    check_config(file, h, &config)?;
    Ok(config)
}

/// The GGUF key behind a [`ModelConfig`] field (`arch`-prefixed where llama.cpp prefixes it),
/// for messages.
fn gguf_spelling(arch: &str, field: &str) -> String {
    let suffix = match field {
        "bos_token_id" => return "tokenizer.ggml.bos_token_id".into(),
        "eos_token_ids" => return "tokenizer.ggml.eos_token_id".into(),
        "rope_scaling.short_factor" => return rope::LONGROPE_SHORT.into(),
        "rope_scaling.long_factor" => return rope::LONGROPE_LONG.into(),
        "hidden_size" | "embed_scale" => "embedding_length",
        "intermediate_size" => "feed_forward_length",
        "num_layers" => "block_count",
        "num_heads" => "attention.head_count",
        "num_kv_heads" => "attention.head_count_kv",
        // Gemma 3's score scale is derived from the head width.
        "head_dim" | "attn_scale" => "attention.key_length",
        "max_position_embeddings" => "context_length",
        "sliding_window" => "attention.sliding_window",
        "rms_norm_eps" => "attention.layer_norm_rms_epsilon",
        "rope_theta" => "rope.freq_base",
        "rotary_dim" => "rope.dimension_count",
        "rope_scaling.factor" => "rope.scaling.factor",
        "rope_scaling.attention_factor" => "rope.scaling.attn_factor",
        "rope_scaling.original_max_position_embeddings" => "rope.scaling.original_context_length",
        "layer_kinds" => "attention.sliding_window_pattern",
        other => other,
    };
    format!("{arch}.{suffix}")
}

/// Before anything is listed per layer: the layer count against the tensors the file
/// declares, then the one validation every reader of the output runs
/// ([`ModelConfig::check`]), each naming the GGUF key at fault.
fn check_config(file: &str, h: &GgufHeader, config: &ModelConfig) -> Result<()> {
    let arch = h
        .get("general.architecture")
        .and_then(Value::as_str)
        .unwrap_or("");
    let declared = h.tensors.len() as u64;
    if let Err(need) = kiln_format::shapes::check_layer_count(config.num_layers, declared) {
        return Err(ConvertError::GgufKey {
            file: file.into(),
            key: format!("{arch}.block_count"),
            reason: format!(
                "{} layers need at least {need} tensors, but the file declares {declared}",
                config.num_layers
            ),
        });
    }
    config.check().map_err(|p| ConvertError::GgufKey {
        file: file.into(),
        key: gguf_spelling(arch, p.field),
        reason: p.reason,
    })
}

/// Gemma 3 as llama.cpp runs a `gemma3` file, whose metadata states only the window: every
/// sixth layer attends globally (unless `attention.sliding_window_pattern` says otherwise),
/// sliding layers use RoPE base 10 000 without scaling, scores are scaled by `1/√head_dim`
/// (by `1/√(hidden/heads)` for the 62-layer 27B, as llama.cpp does), embeddings by `√hidden`,
/// norms are `(1 + w)`, the MLP is GeGLU with tanh-GELU, and q/k and output norms are present.
/// Logit soft-capping, which Kiln does not implement, is refused by its key.
fn gemma3_family(
    k: &Keys,
    num_layers: u64,
    hidden: u64,
    heads: u64,
    head_dim: u64,
) -> Result<FamilyOptions> {
    for suffix in ["final_logit_softcapping", "attn_logit_softcapping"] {
        if let Some((key, v)) = k.get(suffix) {
            return Err(k.err(&key, format!("{v:?}: logit soft-capping is not supported")));
        }
    }
    let pattern = k.u64_opt("attention.sliding_window_pattern")?.unwrap_or(6);
    // One entry a layer: the count is bounded by the tensors the file declares first.
    let declared = k.header.tensors.len() as u64;
    if let Err(need) = kiln_format::shapes::check_layer_count(num_layers, declared) {
        return Err(k.err(
            &format!("{}.block_count", k.arch),
            format!("{num_layers} layers need at least {need} tensors, but the file declares {declared}"),
        ));
    }
    let layer_kinds = (0..num_layers)
        .map(|i| {
            if (i + 1) % pattern == 0 {
                LayerKind::Full
            } else {
                LayerKind::Sliding
            }
        })
        .collect();
    let scalar = if num_layers == 62 {
        hidden as f64 / heads as f64
    } else {
        head_dim as f64
    };
    Ok(FamilyOptions {
        qk_norm: true,
        post_norms: true,
        norm_style: NormStyle::OnePlusWeight,
        mlp_activation: MlpActivation::GeluTanh,
        // As Gemma3TextScaledWordEmbedding computes it: the f32 value of hidden ** 0.5.
        embed_scale: Some(f64::from((hidden as f64).sqrt() as f32)),
        attn_scale: Some(scalar.powf(-0.5)),
        layer_kinds,
        rope_local_theta: Some(10_000.0),
        ..FamilyOptions::default()
    })
}

/// The head width, from `attention.key_length` or else `embedding_length / head_count`, with
/// the keys that restate it checked against it: a file whose metadata contradicts itself is
/// refused here rather than run with one of the two readings.
///
/// Kiln applies RoPE to the whole head of a `llama`/`qwen2` model, so `rope.dimension_count`
/// (the rotated width) must equal the head width unless the family rotates part of it
/// (`partial`: [`rotary_dim`] reads it then); values and keys share it too.
fn head_dim(k: &Keys, hidden: u64, heads: u64, partial: bool) -> Result<u64> {
    let arch = k.arch;
    let (head_dim, from) = match k.u64_opt("attention.key_length")? {
        Some(d) => (d, format!("{arch}.attention.key_length")),
        None if hidden.is_multiple_of(heads) => (
            hidden / heads,
            format!("{arch}.embedding_length / {arch}.attention.head_count"),
        ),
        None => {
            return Err(k.err(
                &format!("{arch}.attention.head_count"),
                format!("{heads} heads do not divide embedding_length {hidden}, and no attention.key_length gives the head width"),
            ))
        }
    };
    let restated: &[(&str, &str)] = if partial {
        &[("attention.value_length", "the value head width")]
    } else {
        &[
            ("attention.value_length", "the value head width"),
            (
                "rope.dimension_count",
                "the rotated width (Kiln rotates whole heads of this family)",
            ),
        ]
    };
    for &(suffix, what) in restated {
        if let Some(v) = k.u64_opt(suffix)? {
            if v != head_dim {
                return Err(k.err(
                    &format!("{arch}.{suffix}"),
                    format!("{what} is {v}, but the head width is {head_dim} (from {from})"),
                ));
            }
        }
    }
    Ok(head_dim)
}

/// The rotated width of each head: `rope.dimension_count`, or the whole head when the key is
/// absent, as llama.cpp defaults it; even and within the head, or the key is refused.
fn rotary_dim(k: &Keys, arch: Architecture, head_dim: u64) -> Result<u64> {
    if !partial_rotary(arch) {
        return Ok(head_dim);
    }
    let r = k.u64_opt("rope.dimension_count")?.unwrap_or(head_dim);
    if r > head_dim || !r.is_multiple_of(2) {
        return Err(k.err(
            &format!("{}.rope.dimension_count", k.arch),
            format!(
                "{r} rotated elements: an even number within the head width {head_dim} is needed"
            ),
        ));
    }
    Ok(r)
}

/// Phi-3 and GLM as llama.cpp runs a `phi3`, `chatglm` or `glm4` file, and the window: the
/// rotated width from `rope.dimension_count`, GLM's adjacent rotary pairs (llama.cpp's
/// `NORM` rope), GLM-4's norms on the attention and MLP outputs; Phi-3's
/// `attention.sliding_window`, 0 meaning none (Phi-4-mini), as llama.cpp's converter writes
/// it. M-RoPE (`rope.dimension_sections`, GLM-4V) is refused by its key.
fn glm_phi3_family(
    k: &Keys,
    arch: Architecture,
    rotary_dim: u64,
    head_dim: u64,
) -> Result<(FamilyOptions, Option<u64>)> {
    if let Some((key, v)) = k.get("rope.dimension_sections") {
        return Err(k.err(
            &key,
            format!("{v:?}: multimodal rotary sections (M-RoPE) are not supported"),
        ));
    }
    let sliding_window = match (arch, k.get("attention.sliding_window")) {
        (Architecture::Phi3, Some((key, v))) => match v.as_u64() {
            Some(0) => None,
            Some(w) if w <= 1 << 32 => Some(w),
            _ => return Err(k.err(&key, format!("expected a window length, found {v:?}"))),
        },
        _ => None,
    };
    let glm = arch != Architecture::Phi3;
    Ok((
        FamilyOptions {
            post_norms: arch == Architecture::Glm4,
            rope_pairing: if glm {
                RopePairing::Interleaved
            } else {
                RopePairing::Half
            },
            rotary_dim: (rotary_dim != head_dim).then_some(rotary_dim),
            ..FamilyOptions::default()
        },
        sliding_window,
    ))
}

/// LongRoPE (Phi-3) from the `rope_factors_long`/`_short` tensors llama.cpp reads, the
/// context that picks between them (`rope.scaling.original_context_length`) and the factor on
/// cos/sin (`rope.scaling.attn_factor`, 1 when absent, as llama.cpp defaults it). `None` when
/// the file has neither tensor. When Kiln's own `kiln.rope_scaling` key is present (a file
/// Kiln exported) its exact f64 factors are taken, after checking that they are the tensors'
/// to f32 rounding; a file whose tensors and keys disagree is refused.
fn longrope_scaling(
    file: &str,
    h: &GgufHeader,
    bytes: &[u8],
    k: &Keys,
    rotary_dim: u64,
) -> Result<Option<RopeScaling>> {
    let (long, short) = (
        h.tensor(rope::LONGROPE_LONG),
        h.tensor(rope::LONGROPE_SHORT),
    );
    let (long, short) = match (long, short) {
        (None, None) => return Ok(None),
        (Some(l), Some(s)) => (l, s),
        (l, _) => {
            let (have, missing) = if l.is_some() {
                (rope::LONGROPE_LONG, rope::LONGROPE_SHORT)
            } else {
                (rope::LONGROPE_SHORT, rope::LONGROPE_LONG)
            };
            return Err(ConvertError::GgufTensor {
                file: file.into(),
                tensor: missing.into(),
                reason: format!("missing, but `{have}` is present: LongRoPE needs both"),
            });
        }
    };
    let pairs = rotary_dim / 2;
    let factors = |t: &GgufTensor| -> Result<Vec<f64>> {
        let bad = |reason: String| ConvertError::GgufTensor {
            file: file.into(),
            tensor: t.name.clone(),
            reason,
        };
        if t.dims != [pairs] {
            return Err(bad(format!(
                "shape {:?}, but the {rotary_dim} rotated elements of a head make {pairs} pairs",
                t.shape()
            )));
        }
        let mut x = Vec::new();
        dequantize(t.ggml_type, super::read::tensor_bytes(bytes, t), &mut x)
            .ok_or_else(|| bad(format!("cannot decode {} factors", t.ggml_type.name)))?;
        if let Some(v) = x.iter().find(|v| !(v.is_finite() && **v > 0.0)) {
            return Err(bad(format!("{v} is not a positive factor")));
        }
        Ok(x.into_iter().map(f64::from).collect())
    };
    let (long_factor, short_factor) = (factors(long)?, factors(short)?);
    let orig_key = format!("{}.rope.scaling.original_context_length", k.arch);
    let original_max_position_embeddings = k
        .u64_opt("rope.scaling.original_context_length")?
        .ok_or_else(|| {
            k.err(
                &orig_key,
                "missing, but LongRoPE factors are present: it says when the long ones apply",
            )
        })?;
    let attention_factor = k.f64_opt("rope.scaling.attn_factor")?.unwrap_or(1.0);
    let from_tensors = RopeScaling::LongRope {
        short_factor,
        long_factor,
        original_max_position_embeddings,
        attention_factor,
    };
    let Some(stored) = h.get("kiln.rope_scaling") else {
        return Ok(Some(from_tensors));
    };
    let parsed = stored
        .as_str()
        .and_then(|s| serde_json::from_str::<RopeScaling>(s).ok());
    let as_f32 = |s: &RopeScaling| match s {
        RopeScaling::LongRope {
            short_factor,
            long_factor,
            original_max_position_embeddings,
            attention_factor,
        } => Some((
            short_factor.iter().map(|&x| x as f32).collect::<Vec<_>>(),
            long_factor.iter().map(|&x| x as f32).collect::<Vec<_>>(),
            *original_max_position_embeddings,
            *attention_factor as f32,
        )),
        _ => None,
    };
    match parsed {
        Some(p) if as_f32(&p).is_some() && as_f32(&p) == as_f32(&from_tensors) => Ok(Some(p)),
        _ => Err(k.err(
            "kiln.rope_scaling",
            format!(
                "{} does not match the LongRoPE factors, `{orig_key}` and \
                 `{}.rope.scaling.attn_factor` llama.cpp reads",
                stored.as_str().unwrap_or("(not a string)"),
                k.arch
            ),
        )),
    }
}

/// Llama 3 rope scaling from Kiln's `kiln.rope_scaling` key, checked against the
/// `rope_freqs.weight` tensor llama.cpp uses (files from other converters carry only the
/// tensor, whose parameters cannot be recovered: they are refused with that reason).
fn llama3_scaling(file: &str, h: &GgufHeader, theta: f64, head_dim: u64) -> Result<RopeScaling> {
    let err = |reason: String| ConvertError::GgufTensor {
        file: file.into(),
        tensor: "rope_freqs.weight".into(),
        reason,
    };
    let s: RopeScaling = h
        .get("kiln.rope_scaling")
        .and_then(Value::as_str)
        .and_then(|s| serde_json::from_str(s).ok())
        .ok_or_else(|| {
            err(
                "Llama 3 rope scaling given only as per-frequency factors is not supported; \
                 Kiln needs its parameters (convert the Hugging Face checkpoint instead)"
                    .into(),
            )
        })?;
    if rope::llama3_factors(&s, theta, head_dim).is_none() {
        return Err(err("kiln.rope_scaling is not Llama 3 scaling".into()));
    }
    Ok(s)
}

struct Planned<'h> {
    tensor: &'h GgufTensor,
    /// The bytes of `tensor` this canonical tensor holds: all of them, or one part's rows of
    /// a fused tensor.
    bytes: std::ops::Range<usize>,
    /// Its first element's index in `tensor`, for messages.
    first_element: usize,
    shape: Vec<u64>,
    name: TensorName,
    dtype: DType,
    permute_heads: Option<usize>,
    /// A Gemma norm weight stored as `1 + w`: written as `w`, in f32.
    minus_one: bool,
}

/// The tokenizer files of a GGUF file, rebuilt as [`import_gguf`] embeds them
/// ([`super::tokenizer::from_gguf`], then the same validation), without reading any tensor or
/// resolving the model's configuration: it also reads vocabulary-only files such as the
/// `ggml-vocab-*.gguf` llama.cpp tests its tokenizers with. `model_max_length` is the file's
/// `<arch>.context_length` when it has one, else 0.
pub fn read_tokenizer(path: &Path) -> Result<kiln_format::TokenizerFiles> {
    let g = GgufFile::open(path)?;
    let file = path.display().to_string();
    let h = g.header();
    let arch_key = "general.architecture";
    let arch = match h.get(arch_key) {
        None => "",
        Some(v) => v.as_str().ok_or_else(|| ConvertError::GgufKey {
            file: file.clone(),
            key: arch_key.into(),
            reason: format!("expected a string, found {}", v.type_name()),
        })?,
    };
    let context_key = format!("{arch}.context_length");
    let context = match h.get(&context_key) {
        None => 0,
        Some(v) => v.as_u64().ok_or_else(|| ConvertError::GgufKey {
            file: file.clone(),
            key: context_key.clone(),
            reason: format!("expected an unsigned integer, found {}", v.type_name()),
        })?,
    };
    let tokenizer = tokenizer::from_gguf(&file, &|k| h.get(k), arch, context)?;
    crate::tokenizer_files::validate(&tokenizer, &file)?;
    Ok(tokenizer)
}

/// Import a GGUF file as a `.kiln` file.
pub fn import_gguf(opts: &ImportOptions, progress: &dyn Progress) -> Result<ImportSummary> {
    let start = Instant::now();
    if opts.dequantize_to.is_quantized() {
        return Err(ConvertError::field(
            Path::new("--dequantize-to"),
            "dtype",
            "must be f32, f16 or bf16",
        ));
    }
    kiln_format::refuse_output_is_input(&opts.output, [opts.input.as_path()])?;
    let g = GgufFile::open(&opts.input)?;
    let file = opts.input.display().to_string();
    let h = g.header();
    let config = resolve_config(&file, h, g.bytes())?;
    let context = config.max_position_embeddings;
    let arch = h
        .get("general.architecture")
        .and_then(Value::as_str)
        .unwrap_or("");
    let tokenizer = tokenizer::from_gguf(&file, &|k| h.get(k), arch, context)?;
    crate::tokenizer_files::validate(&tokenizer, &file)?;
    // llama.cpp's converter reorders q/k rows for the `llama` architecture only.
    let permute = super::export::gguf_architecture(config.architecture).is_some_and(|(_, p)| p);
    // llama.cpp's converter stores Gemma's `(1 + w)` norm weights with the 1 added.
    let plus_one_norms = config.architecture == Architecture::Gemma3;

    // Every GGUF tensor resolved (a fused one to each of its parts, with the part's place in
    // it), then matched against what the configuration implies.
    let longrope = config.architecture == Architecture::Phi3
        && matches!(config.rope_scaling, Some(RopeScaling::LongRope { .. }));
    let rope_freqs = !partial_rotary(config.architecture) && config.rope_scaling.is_some();
    let mut by_name: BTreeMap<TensorName, (&GgufTensor, usize, usize)> = BTreeMap::new();
    for t in &h.tensors {
        let folded = match t.name.as_str() {
            "rope_freqs.weight" => rope_freqs,
            rope::LONGROPE_LONG | rope::LONGROPE_SHORT => longrope,
            _ => false,
        };
        if folded {
            continue; // folded into the configuration above
        }
        // Every tensor left is imported (or refused as unknown): its type is checked here.
        if t.ggml_type.kiln_dtype().is_none() && !DEQUANTIZED.contains(&t.ggml_type.name) {
            return Err(ConvertError::UnsupportedGgufType {
                file: file.clone(),
                tensor: t.name.clone(),
                ggml_type: t.ggml_type.name.into(),
                kept: kept_type_names(),
                dequantized: DEQUANTIZED.join(", "),
            });
        }
        let parts =
            match names::fused_parts(Source::Gguf, config.architecture, &t.name) {
                Some(parts) => parts,
                None => vec![names::canonical(Source::Gguf, config.architecture, &t.name)
                    .ok_or_else(|| ConvertError::UnknownTensor {
                        path: file.clone(),
                        tensor: t.name.clone(),
                        arch: config.source_architecture.clone(),
                    })?],
            };
        let n = parts.len();
        for (i, name) in parts.into_iter().enumerate() {
            if let Some((other, _, _)) = by_name.insert(name, (t, i, n)) {
                return Err(ConvertError::GgufTensor {
                    file: file.clone(),
                    tensor: t.name.clone(),
                    reason: format!(
                        "holds {name}, which `{}` holds too: a file spells each weight once, \
                         fused or split as llama.cpp's `{}` loader reads it",
                        other.name,
                        h.get("general.architecture")
                            .and_then(Value::as_str)
                            .unwrap_or("?")
                    ),
                });
            }
        }
    }
    check_config(&file, h, &config)?;
    let mut planned = Vec::new();
    let mut dequantized: BTreeMap<String, usize> = BTreeMap::new();
    let mut vectors_to_f32: BTreeMap<String, usize> = BTreeMap::new();
    let mut kept: BTreeMap<String, usize> = BTreeMap::new();
    let expected = expected_tensors(&config);
    let expected_shape = |n: &TensorName| kiln_format::shapes::expected_shape(&config, *n);
    for (name, shape) in &expected {
        let (t, part, of) = by_name
            .remove(name)
            .ok_or_else(|| ConvertError::MissingTensor {
                dir: file.clone(),
                tensor: names::source_name(Source::Gguf, config.architecture, *name),
                expected: shape.clone(),
            })?;
        // A fused tensor stacks its parts' rows: its shape is theirs with the rows summed, and
        // this part's rows follow those of the parts before it.
        let (fused_shape, rows_before) = if of == 1 {
            (shape.clone(), 0)
        } else {
            let parts =
                names::fused_parts(Source::Gguf, config.architecture, &t.name).unwrap_or_default();
            let shapes: Vec<Vec<u64>> = parts.iter().filter_map(expected_shape).collect();
            if shapes.len() != of {
                return Err(ConvertError::UnknownTensor {
                    path: file.clone(),
                    tensor: format!("{} (fused {})", t.name, parts.len()),
                    arch: format!(
                        "{} (attention_bias {})",
                        config.source_architecture, config.attention_bias
                    ),
                });
            }
            let mut fused = shape.clone();
            fused[0] = shapes.iter().map(|s| s[0]).sum();
            (fused, shapes[..part].iter().map(|s| s[0]).sum::<u64>())
        };
        let minus_one = plus_one_norms && name.role.is_norm();
        let own = t.ggml_type.kiln_dtype();
        if own.is_none() && !DEQUANTIZED.contains(&t.ggml_type.name) {
            return Err(ConvertError::UnsupportedGgufType {
                file: file.clone(),
                tensor: t.name.clone(),
                ggml_type: t.ggml_type.name.into(),
                kept: kept_type_names(),
                dequantized: DEQUANTIZED.join(", "),
            });
        }
        let quantized = own.is_none_or(|d| d.is_quantized());
        let dtype = match own {
            _ if minus_one => DType::F32,
            // The runner reads norms and biases as floats; a block type's values are f32s.
            _ if quantized && shape.len() != 2 => {
                *vectors_to_f32
                    .entry(t.ggml_type.name.to_string())
                    .or_default() += 1;
                DType::F32
            }
            Some(d) if !(opts.dequantize_all && quantized) => {
                *kept.entry(t.ggml_type.name.to_string()).or_default() += 1;
                d.storage_for(shape)
            }
            _ => {
                *dequantized.entry(t.ggml_type.name.to_string()).or_default() += 1;
                opts.dequantize_to
            }
        };
        if t.shape() != fused_shape {
            return Err(ConvertError::ShapeMismatch {
                path: file.clone(),
                tensor: t.name.clone(),
                found: t.shape(),
                expected: fused_shape,
            });
        }
        // This part's elements (all of the tensor unless it is fused) must be whole blocks:
        // the reader checked that the tensor's rows are, and a matrix part is whole rows, but
        // a part of a fused 1-D tensor in a block type need not be.
        let row_elems: u64 = shape[1..].iter().product();
        let (first, count) = (rows_before * row_elems, shape[0] * row_elems);
        let (block_len, block_bytes) = (t.ggml_type.block_len, t.ggml_type.block_bytes);
        if !first.is_multiple_of(block_len) || !count.is_multiple_of(block_len) {
            return Err(ConvertError::GgufTensor {
                file: file.clone(),
                tensor: t.name.clone(),
                reason: format!(
                    "its {} blocks of {block_len} weights do not split into its parts ({} \
                     elements from element {first})",
                    t.ggml_type.name, count
                ),
            });
        }
        let start = first / block_len * block_bytes;
        let bytes = usize::try_from(start)
            .ok()
            .zip(usize::try_from(start + count / block_len * block_bytes).ok())
            .map(|(a, b)| a..b)
            .ok_or_else(|| ConvertError::GgufTensor {
                file: file.clone(),
                tensor: t.name.clone(),
                reason: "too large for this machine's address space".into(),
            })?;
        let permute_heads = match name.role {
            Role::AttnQ if permute => Some(config.num_heads as usize),
            Role::AttnK if permute => Some(config.num_kv_heads as usize),
            _ => None,
        };
        planned.push(Planned {
            tensor: t,
            bytes,
            first_element: usize::try_from(rows_before * row_elems).unwrap_or(usize::MAX),
            shape: shape.clone(),
            name: *name,
            dtype,
            permute_heads,
            minus_one,
        });
    }
    if let Some((name, (t, _, _))) = by_name.into_iter().next() {
        return Err(ConvertError::UnknownTensor {
            path: file.clone(),
            tensor: format!("{} ({name})", t.name),
            arch: format!(
                "{} ({} layers, tie_word_embeddings {})",
                config.source_architecture, config.num_layers, config.tie_word_embeddings
            ),
        });
    }

    let specs: Vec<TensorSpec> = planned
        .iter()
        .map(|p| TensorSpec {
            name: p.name.to_string(),
            dtype: p.dtype,
            shape: p.shape.clone(),
        })
        .collect();
    let mut dtypes = BTreeMap::new();
    for s in &specs {
        *dtypes.entry(s.dtype.name().to_string()).or_insert(0usize) += 1;
    }
    let source_name = opts
        .input
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let source = sha256_file(&opts.input, &source_name)?;
    let metadata = Metadata {
        config: config.clone(),
        tokenizer,
        generation: serde_json::Value::Null,
        provenance: vec![ProvenanceStep {
            tool: format!("kiln-convert {}", env!("CARGO_PKG_VERSION")),
            created: now_rfc3339(),
            details: json!({
                "conversion": {
                    "from": "gguf",
                    "gguf_version": h.version,
                    "architecture": h.get("general.architecture").and_then(Value::as_str),
                    "kept": kept,
                    "dequantized": dequantized,
                    "dequantized_to": opts.dequantize_to.name(),
                    "vectors_to_f32": vectors_to_f32,
                }
            }),
            sources: vec![source],
        }],
    };
    let writer = KilnWriter::create(&opts.output, &metadata, specs, opts.overwrite)?;
    let total: u64 = planned.iter().map(|p| p.bytes.len() as u64).sum();
    progress.start(total, planned.len());
    let non_finite = std::sync::Mutex::new(Vec::new());
    planned
        .par_iter()
        .enumerate()
        .try_for_each(|(i, p)| -> Result<()> {
            let t = p.tensor;
            let raw = g.tensor_bytes(t).get(p.bytes.clone()).unwrap_or_default();
            let bad = |reason: String| ConvertError::GgufTensor {
                file: file.clone(),
                tensor: t.name.clone(),
                reason,
            };
            let (bytes, dtype) =
                if t.ggml_type.kiln_dtype() == Some(p.dtype.logical()) && !p.minus_one {
                    (std::borrow::Cow::Borrowed(raw), p.dtype.logical())
                } else {
                    let mut x = Vec::new();
                    dequantize(t.ggml_type, raw, &mut x)
                        .ok_or_else(|| bad("cannot dequantize".into()))?;
                    if p.minus_one {
                        // In f32, as transformers' GGUF loader subtracts it.
                        x.iter_mut().for_each(|v| *v -= 1.0);
                    }
                    let f32s: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
                    (std::borrow::Cow::Owned(f32s), DType::F32)
                };
            // The values as the file holds them (dequantized where they were), before any
            // row reordering: the element index is the GGUF tensor's own.
            if let (count @ 1.., Some(index)) = count_non_finite(dtype, &bytes) {
                let index = index + p.first_element;
                if !opts.allow_non_finite {
                    return Err(ConvertError::NonFinite {
                        file: file.clone(),
                        tensor: t.name.clone(),
                        index,
                        count,
                    });
                }
                non_finite
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(format!(
                        "{} ({count} values, first at element {index})",
                        t.name
                    ));
            }
            let bytes = match p.permute_heads {
                None => bytes,
                Some(n) => {
                    let cols = t.dims.first().copied().unwrap_or(0);
                    let row = dtype.byte_len(&[cols]).map_err(bad)? as usize;
                    std::borrow::Cow::Owned(
                        rope::permute_rows(&bytes, row, n, Direction::FromGguf).map_err(bad)?,
                    )
                }
            };
            if dtype == p.dtype.logical() {
                // GGML's row-major blocks (rows already in Kiln's order), in the storage
                // layout the writer chose (interleaved for q4_0x16).
                let cols = t.dims.first().copied().unwrap_or(0) as usize;
                writer.write_tensor(i, &p.dtype.to_storage(cols, &bytes))?;
            } else {
                let mut out = Vec::new();
                cast_bytes(dtype, p.dtype, &bytes, &mut out);
                writer.write_tensor(i, &out)?;
            }
            progress.advance(p.bytes.len() as u64, 1);
            Ok(())
        })?;
    let summary = writer.finish()?;
    progress.finish();
    Ok(ImportSummary {
        input: file,
        output: opts.output.display().to_string(),
        architecture: h
            .get("general.architecture")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string(),
        tensors: planned.len(),
        dtypes,
        kept,
        dequantized,
        vectors_to_f32,
        bytes_out: summary.file_len,
        seconds: start.elapsed().as_secs_f64(),
        non_finite: {
            let mut v = non_finite.into_inner().unwrap_or_else(|e| e.into_inner());
            v.sort();
            v
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_architecture_exports_under_a_name_that_imports() {
        for a in Architecture::ALL {
            let Some((name, permuted)) = super::super::export::gguf_architecture(a) else {
                assert!(SUPPORTED.iter().all(|(_, b)| *b != a), "{a:?}");
                continue;
            };
            let (_, back) = SUPPORTED
                .iter()
                .find(|(n, _)| *n == name)
                .unwrap_or_else(|| panic!("{a:?} exports as `{name}`, which import refuses"));
            assert_eq!(
                super::super::export::gguf_architecture(*back),
                Some((name, permuted)),
                "{a:?}"
            );
        }
    }
}
