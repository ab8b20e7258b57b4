//! `config.json` as transformers 4.x or 5.x writes it, resolved into a [`ModelConfig`].
//!
//! The raw file keeps Hugging Face's names and defaults; this module applies those defaults
//! once (as `LlamaConfig`, `MistralConfig`, `Qwen2Config`, `Qwen3Config`,
//! `Gemma3TextConfig`, `Phi3Config`, `Glm4Config` and `GlmConfig` do) so that nothing downstream
//! deals with optional fields. Both spellings of the RoPE settings are accepted: 4.x's
//! top-level `rope_theta` / `rope_scaling` and 5.x's `rope_parameters`.

use std::path::Path;

use kiln_format::{
    Architecture, FamilyOptions, LayerKind, MlpActivation, ModelConfig, NormStyle, RopePairing,
    RopeScaling,
};
use serde_json::{Map, Value};

use crate::error::{ConvertError, Result};

/// Class names (and `model_type`s) Kiln converts.
pub const SUPPORTED: &[(&str, &str, Architecture)] = &[
    ("LlamaForCausalLM", "llama", Architecture::Llama),
    ("MistralForCausalLM", "mistral", Architecture::Mistral),
    ("Qwen2ForCausalLM", "qwen2", Architecture::Qwen2),
    ("Qwen3ForCausalLM", "qwen3", Architecture::Qwen3),
    ("Gemma3ForCausalLM", "gemma3_text", Architecture::Gemma3),
    ("Phi3ForCausalLM", "phi3", Architecture::Phi3),
    ("Glm4ForCausalLM", "glm4", Architecture::Glm4),
    ("GlmForCausalLM", "glm", Architecture::Glm),
];

/// Largest value accepted for any size field: the format's own cap, so that what converts
/// also opens ([`ModelConfig::check`]).
const MAX_SIZE: u64 = kiln_format::metadata::MAX_CONFIG_DIM;

/// The source dtype named in the config (`dtype` in 5.x, `torch_dtype` in 4.x), if any.
pub fn declared_dtype(raw: &Value) -> Option<String> {
    raw.get("dtype")
        .or_else(|| raw.get("torch_dtype"))
        .and_then(Value::as_str)
        .map(str::to_string)
}

struct Fields<'a> {
    path: &'a Path,
    map: &'a Map<String, Value>,
}

impl Fields<'_> {
    fn get(&self, key: &str) -> Option<&Value> {
        self.map.get(key).filter(|v| !v.is_null())
    }

    fn uint(&self, key: &str) -> Result<Option<u64>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => {
                let n = v.as_u64().ok_or_else(|| {
                    ConvertError::field(
                        self.path,
                        key,
                        format!("expected a non-negative integer, found {v}"),
                    )
                })?;
                if n == 0 || n > MAX_SIZE {
                    return Err(ConvertError::field(
                        self.path,
                        key,
                        format!("{n} is outside 1..={MAX_SIZE}"),
                    ));
                }
                Ok(Some(n))
            }
        }
    }

    fn req_uint(&self, key: &str) -> Result<u64> {
        self.uint(key)?
            .ok_or_else(|| ConvertError::field(self.path, key, "missing"))
    }

    fn float(&self, map: &Map<String, Value>, key: &str, ctx: &str) -> Result<Option<f64>> {
        match map.get(key).filter(|v| !v.is_null()) {
            None => Ok(None),
            Some(v) => {
                let f = v
                    .as_f64()
                    .filter(|f| f.is_finite() && *f > 0.0)
                    .ok_or_else(|| {
                        ConvertError::field(
                            self.path,
                            &format!("{ctx}{key}"),
                            format!("expected a positive number, found {v}"),
                        )
                    })?;
                Ok(Some(f))
            }
        }
    }

    fn bool(&self, key: &str, default: bool) -> Result<bool> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v.as_bool().ok_or_else(|| {
                ConvertError::field(self.path, key, format!("expected true or false, found {v}"))
            }),
        }
    }

    fn token_ids(&self, key: &str) -> Result<Vec<u32>> {
        let bad = |v: &Value| {
            ConvertError::field(
                self.path,
                key,
                format!("expected a token id or a list of ids, found {v}"),
            )
        };
        let one = |v: &Value| {
            v.as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| bad(v))
        };
        match self.get(key) {
            None => Ok(vec![]),
            Some(Value::Array(a)) => a.iter().map(one).collect(),
            Some(v) => Ok(vec![one(v)?]),
        }
    }
}

/// Parse and resolve `config.json` (already read into `text`; `path` is for messages).
///
/// `generation` is `generation_config.json` if present: its `eos_token_id` list (Llama 3 keeps
/// the end-of-turn token there) is merged into the stop tokens.
pub fn parse(path: &Path, text: &str, generation: Option<&Value>) -> Result<ModelConfig> {
    let raw: Value = serde_json::from_str(text).map_err(|e| ConvertError::Json {
        path: path.display().to_string(),
        reason: e.to_string(),
    })?;
    let map = raw.as_object().ok_or_else(|| ConvertError::Json {
        path: path.display().to_string(),
        reason: "the top level is not an object".into(),
    })?;
    let f = Fields { path, map };

    let class = match f.get("architectures") {
        Some(Value::Array(a)) if a.len() == 1 => a[0].as_str().map(str::to_string),
        Some(v @ Value::Array(_)) => {
            return Err(ConvertError::field(
                path,
                "architectures",
                format!("expected exactly one class name, found {v}"),
            ))
        }
        Some(v) => {
            return Err(ConvertError::field(
                path,
                "architectures",
                format!("expected a list, found {v}"),
            ))
        }
        None => None,
    };
    let model_type = f.get("model_type").and_then(Value::as_str);
    let found = class
        .clone()
        .or(model_type.map(str::to_string))
        .ok_or_else(|| {
            ConvertError::field(
                path,
                "architectures",
                "missing (and no `model_type` either)",
            )
        })?;
    let (source_class, _, architecture) = SUPPORTED
        .iter()
        .find(|(c, t, _)| {
            Some(*c) == class.as_deref() || (class.is_none() && Some(*t) == model_type)
        })
        .copied()
        .ok_or_else(|| ConvertError::UnsupportedArchitecture {
            path: path.display().to_string(),
            found: found.clone(),
            supported: SUPPORTED.iter().map(|s| s.0).collect::<Vec<_>>().join(", "),
        })?;

    let hidden_size = f.req_uint("hidden_size")?;
    let intermediate_size = f.req_uint("intermediate_size")?;
    let num_layers = f.req_uint("num_hidden_layers")?;
    let num_heads = f.req_uint("num_attention_heads")?;
    let num_kv_heads = f.uint("num_key_value_heads")?.unwrap_or(num_heads);
    let vocab_size = f.req_uint("vocab_size")?;
    let max_position_embeddings =
        f.uint("max_position_embeddings")?
            .unwrap_or(match architecture {
                Architecture::Mistral => 4096 * 32,
                Architecture::Qwen2 | Architecture::Qwen3 => 32768,
                Architecture::Gemma3 | Architecture::Glm4 | Architecture::Glm => 131_072,
                Architecture::Phi3 => 4096,
                Architecture::Llama => 2048,
            });
    if num_heads % num_kv_heads != 0 {
        return Err(ConvertError::field(
            path,
            "num_key_value_heads",
            format!("{num_kv_heads} does not divide num_attention_heads ({num_heads})"),
        ));
    }
    let head_dim = match (f.uint("head_dim")?, architecture) {
        (Some(h), _) => h,
        // The classes' own defaults, not hidden / heads.
        (None, Architecture::Qwen3 | Architecture::Glm4 | Architecture::Glm) => 128,
        (None, Architecture::Gemma3) => 256,
        (None, _) => {
            if hidden_size % num_heads != 0 {
                return Err(ConvertError::field(
                    path,
                    "head_dim",
                    format!("missing, and hidden_size {hidden_size} is not a multiple of num_attention_heads {num_heads}"),
                ));
            }
            hidden_size / num_heads
        }
    };
    if head_dim % 2 != 0 {
        return Err(ConvertError::field(
            path,
            "head_dim",
            format!("{head_dim} must be even for rotary embeddings"),
        ));
    }
    let glm = matches!(architecture, Architecture::Glm4 | Architecture::Glm);
    let rms_norm_eps = f
        .float(map, "rms_norm_eps", "")?
        .unwrap_or(match architecture {
            Architecture::Phi3 => 1e-5,
            _ if glm => 1.5625e-7,
            _ => 1e-6,
        });

    let gemma = architecture == Architecture::Gemma3;
    let act_key = if gemma {
        "hidden_activation"
    } else {
        "hidden_act"
    };
    let mlp_activation = match (f.get(act_key).map(|v| v.as_str()), gemma) {
        (None, false) | (Some(Some("silu")), false) => MlpActivation::Silu,
        (None, true) | (Some(Some("gelu_pytorch_tanh")), true) => MlpActivation::GeluTanh,
        (Some(_), _) => {
            let act = f.get(act_key).expect("matched Some");
            let (want, what) = if gemma {
                ("gelu_pytorch_tanh", "GeGLU with tanh-approximated GELU")
            } else {
                ("silu", "SwiGLU with silu")
            };
            return Err(ConvertError::field(
                path,
                act_key,
                format!(
                    "{act} is not supported; Kiln implements {what} (`{want}`) for this family"
                ),
            ));
        }
    };
    if f.bool("mlp_bias", false)? {
        return Err(ConvertError::field(
            path,
            "mlp_bias",
            "MLP biases are not supported",
        ));
    }
    let attention_bias = match architecture {
        // Qwen2 always has q/k/v biases (hard-wired in transformers' Qwen2Attention).
        Architecture::Qwen2 => true,
        // Phi-3's fused qkv_proj never has one (Phi3Config has no such field).
        Architecture::Phi3 => false,
        _ => f.bool("attention_bias", glm)?,
    };
    if gemma && attention_bias {
        return Err(ConvertError::field(
            path,
            "attention_bias",
            "Gemma 3 with q/k/v biases is not supported",
        ));
    }
    // Gemma3TextConfig ties by default; the others do not.
    let tie_word_embeddings = f.bool("tie_word_embeddings", gemma)?;

    // RoPE: 5.x `rope_parameters` (per layer type for Gemma 3), else 4.x top-level
    // `rope_theta` + `rope_scaling` (+ `rope_local_base_freq` for Gemma 3).
    let rope_params = match f.get("rope_parameters") {
        Some(Value::Object(m)) => Some(m),
        Some(v) => {
            return Err(ConvertError::field(
                path,
                "rope_parameters",
                format!("expected an object, found {v}"),
            ))
        }
        None => None,
    };
    let rope_scaling_4x = match f.get("rope_scaling") {
        Some(Value::Object(m)) => Some(m),
        Some(v) => {
            return Err(ConvertError::field(
                path,
                "rope_scaling",
                format!("expected an object or null, found {v}"),
            ))
        }
        None => None,
    };
    let (rope_theta, rope_scaling, rope_local_theta) = if gemma {
        let layer_params = |kind: &str| -> Result<Option<&Map<String, Value>>> {
            match rope_params
                .and_then(|m| m.get(kind))
                .filter(|v| !v.is_null())
            {
                None => Ok(None),
                Some(Value::Object(m)) => Ok(Some(m)),
                Some(v) => Err(ConvertError::field(
                    path,
                    &format!("rope_parameters.{kind}"),
                    format!("expected an object, found {v}"),
                )),
            }
        };
        let full = layer_params("full_attention")?;
        let local = layer_params("sliding_attention")?;
        let (full_map, full_ctx) = match full {
            Some(m) => (Some(m), "rope_parameters.full_attention."),
            None => (rope_scaling_4x, "rope_scaling."),
        };
        let (theta, scaling) = rope_settings(&f, full_map, full_ctx)?;
        let theta = theta
            .or(f.float(map, "rope_theta", "")?)
            .unwrap_or(1_000_000.0);
        let (local_theta, local_scaling) =
            rope_settings(&f, local, "rope_parameters.sliding_attention.")?;
        if local_scaling.is_some() {
            return Err(ConvertError::field(
                path,
                "rope_parameters.sliding_attention.rope_type",
                "frequency scaling on sliding-window layers is not supported",
            ));
        }
        let local_theta = local_theta
            .or(f.float(map, "rope_local_base_freq", "")?)
            .unwrap_or(10_000.0);
        (theta, scaling, Some(local_theta))
    } else {
        let (rope_map, ctx) = match (rope_params, rope_scaling_4x) {
            (Some(m), _) => (Some(m), "rope_parameters."),
            (None, Some(m)) => (Some(m), "rope_scaling."),
            (None, None) => (None, ""),
        };
        let (theta, scaling) = if architecture == Architecture::Phi3 {
            phi3_rope_settings(&f, rope_map, ctx, max_position_embeddings)?
        } else {
            rope_settings(&f, rope_map, ctx)?
        };
        let theta = match theta {
            Some(t) => t,
            None => f.float(map, "rope_theta", "")?.unwrap_or(10000.0),
        };
        (theta, scaling, None)
    };

    let sliding_window = match architecture {
        Architecture::Mistral => f.uint("sliding_window")?,
        Architecture::Qwen2 | Architecture::Qwen3 => {
            if f.bool("use_sliding_window", false)? {
                return Err(ConvertError::field(
                    path,
                    "use_sliding_window",
                    "Qwen's per-layer sliding window is not supported",
                ));
            }
            None
        }
        Architecture::Gemma3 => Some(f.uint("sliding_window")?.unwrap_or(4096)),
        // Phi3Config: every layer windowed when set (create_sliding_window_causal_mask).
        Architecture::Phi3 => f.uint("sliding_window")?,
        Architecture::Llama | Architecture::Glm4 | Architecture::Glm => None,
    };
    let family = match architecture {
        Architecture::Qwen3 => FamilyOptions {
            qk_norm: true,
            ..FamilyOptions::default()
        },
        Architecture::Gemma3 => gemma3_options(&f, num_layers, hidden_size, rope_local_theta)?,
        // GLM-4: norms on the attention and MLP outputs (post_self_attn_layernorm,
        // post_mlp_layernorm); GLM's rotary pairs are interleaved.
        Architecture::Glm4 => FamilyOptions {
            post_norms: true,
            rope_pairing: RopePairing::Interleaved,
            ..FamilyOptions::default()
        },
        Architecture::Glm => FamilyOptions {
            rope_pairing: RopePairing::Interleaved,
            ..FamilyOptions::default()
        },
        _ => FamilyOptions::default(),
    };
    let rotary_dim = rotary_dim(&f, rope_params, architecture, head_dim)?;
    if let Some(RopeScaling::LongRope {
        short_factor,
        long_factor,
        ..
    }) = &rope_scaling
    {
        let pairs = rotary_dim / 2;
        for (key, v) in [("short_factor", short_factor), ("long_factor", long_factor)] {
            if v.len() as u64 != pairs {
                return Err(ConvertError::field(
                    path,
                    &format!("rope_scaling.{key}"),
                    format!(
                        "{} factors, but {pairs} rotated pairs (rotary dimension {rotary_dim})",
                        v.len()
                    ),
                ));
            }
        }
    }
    let sliding_window = if gemma && !family.layer_kinds.contains(&LayerKind::Sliding) {
        None
    } else {
        sliding_window
    };
    let family = FamilyOptions {
        mlp_activation,
        rotary_dim: (rotary_dim != head_dim).then_some(rotary_dim),
        ..family
    };

    let bos_token_id = f.token_ids("bos_token_id")?.first().copied();
    let mut eos_token_ids = f.token_ids("eos_token_id")?;
    if let Some(g) = generation.and_then(Value::as_object) {
        let gf = Fields { path, map: g };
        for id in gf.token_ids("eos_token_id")? {
            if !eos_token_ids.contains(&id) {
                eos_token_ids.push(id);
            }
        }
    }
    for (key, ids) in [
        (
            "bos_token_id",
            bos_token_id.iter().copied().collect::<Vec<_>>(),
        ),
        ("eos_token_id", eos_token_ids.clone()),
    ] {
        if let Some(bad) = ids.iter().find(|&&id| u64::from(id) >= vocab_size) {
            return Err(ConvertError::field(
                path,
                key,
                format!("token id {bad} is outside the vocabulary ({vocab_size})"),
            ));
        }
    }

    let config = ModelConfig {
        architecture,
        source_architecture: source_class.to_string(),
        hidden_size,
        intermediate_size,
        num_layers,
        num_heads,
        num_kv_heads,
        head_dim,
        vocab_size,
        max_position_embeddings,
        rms_norm_eps,
        rope_theta,
        rope_scaling,
        tie_word_embeddings,
        attention_bias,
        sliding_window,
        bos_token_id,
        eos_token_ids,
        family,
    };
    // The one validation every reader of the output runs, here so that a config its readers
    // would refuse is refused before anything is written, naming the field as config.json does.
    config
        .check()
        .map_err(|p| ConvertError::field(path, hf_spelling(p.field), p.reason))?;
    Ok(config)
}

/// The `config.json` key behind a [`ModelConfig`] field, for messages.
fn hf_spelling(field: &'static str) -> &'static str {
    match field {
        "num_layers" => "num_hidden_layers",
        "num_heads" => "num_attention_heads",
        "num_kv_heads" => "num_key_value_heads",
        "rotary_dim" => "partial_rotary_factor",
        "layer_kinds" => "layer_types",
        // Gemma 3's score scale is `query_pre_attn_scalar^-½`, its embedding scale `√hidden`.
        "attn_scale" => "query_pre_attn_scalar",
        "embed_scale" => "hidden_size",
        "rope_local_theta" => "rope_local_base_freq",
        "eos_token_ids" => "eos_token_id",
        other => other,
    }
}

/// A RoPE parameter object's base and frequency scaling (`ctx` prefixes field names in
/// errors). `None` map: nothing set.
fn rope_settings(
    f: &Fields<'_>,
    m: Option<&Map<String, Value>>,
    ctx: &str,
) -> Result<(Option<f64>, Option<RopeScaling>)> {
    let path = f.path;
    let Some(m) = m else {
        return Ok((None, None));
    };
    let theta = f.float(m, "rope_theta", ctx)?;
    let kind = m
        .get("rope_type")
        .or_else(|| m.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let need = |key: &str| -> Result<f64> {
        f.float(m, key, ctx)?
            .ok_or_else(|| ConvertError::field(path, &format!("{ctx}{key}"), "missing"))
    };
    let scaling = match kind {
        "default" => None,
        "linear" => Some(RopeScaling::Linear {
            factor: need("factor")?,
        }),
        "llama3" => {
            let omp = m
                .get("original_max_position_embeddings")
                .and_then(Value::as_u64)
                .filter(|&n| n > 0)
                .ok_or_else(|| {
                    ConvertError::field(
                        path,
                        &format!("{ctx}original_max_position_embeddings"),
                        "missing or not a positive integer",
                    )
                })?;
            Some(RopeScaling::Llama3 {
                factor: need("factor")?,
                low_freq_factor: need("low_freq_factor")?,
                high_freq_factor: need("high_freq_factor")?,
                original_max_position_embeddings: omp,
            })
        }
        other => {
            return Err(ConvertError::field(
                path,
                &format!("{ctx}rope_type"),
                format!("`{other}` is not supported (supported: default, linear, llama3)"),
            ))
        }
    };
    Ok((theta, scaling))
}

/// Gemma 3's additions, as `Gemma3TextConfig` defaults them: `(1 + w)` norms, q/k norms,
/// post-attention and post-MLP norms, GeGLU, embeddings scaled by `√hidden`, scores scaled by
/// `query_pre_attn_scalar^-½`, and the per-layer attention kinds (`layer_types`, or every
/// `sliding_window_pattern`-th layer global). Features Kiln does not implement (logit
/// soft-capping, bidirectional attention) are refused, naming the field.
fn gemma3_options(
    f: &Fields<'_>,
    num_layers: u64,
    hidden_size: u64,
    rope_local_theta: Option<f64>,
) -> Result<FamilyOptions> {
    let path = f.path;
    for key in ["final_logit_softcapping", "attn_logit_softcapping"] {
        if let Some(v) = f.get(key) {
            return Err(ConvertError::field(
                path,
                key,
                format!("{v}: logit soft-capping is not supported"),
            ));
        }
    }
    if f.bool("use_bidirectional_attention", false)? {
        return Err(ConvertError::field(
            path,
            "use_bidirectional_attention",
            "bidirectional attention is not supported",
        ));
    }
    let query_pre_attn_scalar = f
        .float(f.map, "query_pre_attn_scalar", "")?
        .unwrap_or(256.0);
    let layer_kinds = match f.get("layer_types") {
        Some(Value::Array(a)) => {
            if a.len() as u64 != num_layers {
                return Err(ConvertError::field(
                    path,
                    "layer_types",
                    format!("{} entries for {num_layers} layers", a.len()),
                ));
            }
            a.iter()
                .map(|v| match v.as_str() {
                    Some("full_attention") => Ok(LayerKind::Full),
                    Some("sliding_attention") => Ok(LayerKind::Sliding),
                    _ => Err(ConvertError::field(
                        path,
                        "layer_types",
                        format!(
                            "{v} is not supported (supported: full_attention, sliding_attention)"
                        ),
                    )),
                })
                .collect::<Result<Vec<_>>>()?
        }
        Some(v) => {
            return Err(ConvertError::field(
                path,
                "layer_types",
                format!("expected a list, found {v}"),
            ))
        }
        None => {
            let pattern = f.uint("sliding_window_pattern")?.unwrap_or(6);
            (0..num_layers)
                .map(|i| {
                    if (i + 1) % pattern != 0 {
                        LayerKind::Sliding
                    } else {
                        LayerKind::Full
                    }
                })
                .collect()
        }
    };
    Ok(FamilyOptions {
        qk_norm: true,
        post_norms: true,
        norm_style: NormStyle::OnePlusWeight,
        mlp_activation: MlpActivation::GeluTanh,
        // Gemma3TextScaledWordEmbedding: the f32 value of hidden_size ** 0.5.
        embed_scale: Some(f64::from((hidden_size as f64).sqrt() as f32)),
        attn_scale: Some(query_pre_attn_scalar.powf(-0.5)),
        layer_kinds,
        rope_local_theta,
        ..FamilyOptions::default()
    })
}

/// How many leading elements of each head rotate: `int(head_dim * partial_rotary_factor)`,
/// the factor read from `rope_parameters` (5.x) or the top level (4.x), defaulting as the
/// family's config class does (GLM: 0.5).
fn rotary_dim(
    f: &Fields<'_>,
    rope_params: Option<&Map<String, Value>>,
    arch: Architecture,
    head_dim: u64,
) -> Result<u64> {
    let key = "partial_rotary_factor";
    let in_params = match rope_params {
        Some(m) if m.contains_key(key) => f.float(m, key, "rope_parameters.")?,
        _ => None,
    };
    let factor = match in_params.or(f.float(f.map, key, "")?) {
        Some(x) => x,
        None if matches!(arch, Architecture::Glm4 | Architecture::Glm) => 0.5,
        None => 1.0,
    };
    if !matches!(
        arch,
        Architecture::Phi3 | Architecture::Glm4 | Architecture::Glm
    ) {
        if factor != 1.0 {
            return Err(ConvertError::field(
                f.path,
                key,
                format!("{factor}: partial rotary is not supported for this family"),
            ));
        }
        return Ok(head_dim);
    }
    // int(head_dim * partial_rotary_factor), as transformers truncates it.
    let dim = (head_dim as f64 * factor) as u64;
    if factor > 1.0 || dim < 2 || !dim.is_multiple_of(2) {
        return Err(ConvertError::field(
            f.path,
            key,
            format!(
                "{factor} of head_dim {head_dim} gives {dim} rotated elements; an even number \
                 from 2 to head_dim is needed"
            ),
        ));
    }
    Ok(dim)
}

/// Phi-3's RoPE settings: the default type or LongRoPE (`longrope`; transformers also reads
/// the old names `su` and `yarn` as it), whose attention factor defaults, as
/// `_compute_longrope_parameters` does, to `√(1 + ln s / ln original)` for the context
/// stretch `s = factor`, or `max_position_embeddings / original` without one.
fn phi3_rope_settings(
    f: &Fields<'_>,
    m: Option<&Map<String, Value>>,
    ctx: &str,
    max_position_embeddings: u64,
) -> Result<(Option<f64>, Option<RopeScaling>)> {
    let path = f.path;
    let kind = m
        .and_then(|m| m.get("rope_type").or_else(|| m.get("type")))
        .and_then(Value::as_str);
    let (Some(m), Some("longrope" | "su" | "yarn")) = (m, kind) else {
        return rope_settings(f, m, ctx);
    };
    let factors = |key: &str| -> Result<Vec<f64>> {
        let bad = |why: String| ConvertError::field(path, &format!("{ctx}{key}"), why);
        match m.get(key) {
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| {
                    v.as_f64()
                        .filter(|x| x.is_finite() && *x > 0.0)
                        .ok_or_else(|| bad(format!("{v} is not a positive number")))
                })
                .collect(),
            Some(v) => Err(bad(format!("expected a list of numbers, found {v}"))),
            None => Err(bad("missing".into())),
        }
    };
    let omp_key = "original_max_position_embeddings";
    let original = match m.get(omp_key).filter(|v| !v.is_null()) {
        Some(v) => v.as_u64().filter(|&n| n > 1).ok_or_else(|| {
            ConvertError::field(
                path,
                &format!("{ctx}{omp_key}"),
                format!("{v} is not an integer above 1"),
            )
        })?,
        None => f.uint(omp_key)?.filter(|&n| n > 1).ok_or_else(|| {
            ConvertError::field(path, omp_key, "missing (LongRoPE needs it) or not above 1")
        })?,
    };
    let stretch = f
        .float(m, "factor", ctx)?
        .unwrap_or(max_position_embeddings as f64 / original as f64);
    let attention_factor = match f.float(m, "attention_factor", ctx)? {
        Some(a) => a,
        None if stretch <= 1.0 => 1.0,
        None => (1.0 + stretch.ln() / (original as f64).ln()).sqrt(),
    };
    let scaling = RopeScaling::LongRope {
        short_factor: factors("short_factor")?,
        long_factor: factors("long_factor")?,
        original_max_position_embeddings: original,
        attention_factor,
    };
    Ok((f.float(m, "rope_theta", ctx)?, Some(scaling)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(name: &str) -> String {
        let p = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../fixtures/tiny/configs")
            .join(name);
        std::fs::read_to_string(p).unwrap()
    }

    #[test]
    fn transformers_4x_and_5x_spellings_resolve_identically() {
        for (a, b) in [
            ("llama-4x-style.json", "llama-5x-style.json"),
            ("llama3-rope-4x-style.json", "llama3-rope-5x-style.json"),
        ] {
            let ca = parse(Path::new(a), &fixture(a), None).unwrap();
            let cb = parse(Path::new(b), &fixture(b), None).unwrap();
            assert_eq!(ca, cb, "{a} vs {b}");
        }
        let c = parse(Path::new("x"), &fixture("llama3-rope-5x-style.json"), None).unwrap();
        assert!(
            matches!(c.rope_scaling, Some(RopeScaling::Llama3 { factor, .. }) if factor == 8.0)
        );
        assert_eq!(c.rope_theta, 500000.0);
    }

    fn base() -> Value {
        serde_json::json!({
            "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": 320, "rms_norm_eps": 1e-5, "eos_token_id": 2, "bos_token_id": 1
        })
    }

    fn parse_value(v: &Value) -> Result<ModelConfig> {
        parse(Path::new("config.json"), &v.to_string(), None)
    }

    #[test]
    fn defaults_follow_transformers() {
        let c = parse_value(&base()).unwrap();
        assert_eq!(c.head_dim, 16);
        assert_eq!(c.rope_theta, 10000.0);
        assert!(!c.tie_word_embeddings);
        assert_eq!(c.max_position_embeddings, 2048);
        assert_eq!(c.eos_token_ids, vec![2]);
    }

    #[test]
    fn generation_config_eos_list_is_merged() {
        let g = serde_json::json!({"eos_token_id": [2, 7]});
        let c = parse(Path::new("c"), &base().to_string(), Some(&g)).unwrap();
        assert_eq!(c.eos_token_ids, vec![2, 7]);
    }

    #[test]
    fn unsupported_architecture_names_it_and_lists_supported() {
        let mut v = base();
        v["architectures"] = serde_json::json!(["GPT2LMHeadModel"]);
        let e = parse_value(&v).unwrap_err().to_string();
        assert!(
            e.contains("GPT2LMHeadModel")
                && e.contains("LlamaForCausalLM")
                && e.contains("Qwen2ForCausalLM"),
            "{e}"
        );
    }

    #[test]
    fn bad_fields_are_named() {
        for (key, val, needle) in [
            ("hidden_size", serde_json::json!("64"), "hidden_size"),
            (
                "num_key_value_heads",
                serde_json::json!(3),
                "num_key_value_heads",
            ),
            ("rms_norm_eps", serde_json::json!(-1.0), "rms_norm_eps"),
            ("vocab_size", serde_json::json!(0), "vocab_size"),
            ("hidden_act", serde_json::json!("gelu"), "hidden_act"),
            (
                "rope_scaling",
                serde_json::json!({"rope_type": "yarn", "factor": 4.0}),
                "rope_type",
            ),
            ("eos_token_id", serde_json::json!(999), "eos_token_id"),
            (
                "num_hidden_layers",
                serde_json::json!(1u64 << 40),
                "num_hidden_layers",
            ),
        ] {
            let mut v = base();
            v[key] = val;
            let e = parse_value(&v).unwrap_err().to_string();
            assert!(
                e.contains(needle) && e.contains("config.json"),
                "{key}: {e}"
            );
        }
        let mut v = base();
        v.as_object_mut().unwrap().remove("hidden_size");
        assert!(parse_value(&v)
            .unwrap_err()
            .to_string()
            .contains("hidden_size"));
        assert!(parse(Path::new("c.json"), "{not json", None)
            .unwrap_err()
            .to_string()
            .contains("c.json"));
    }

    fn tiny_config(name: &str) -> Value {
        let p = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../fixtures/tiny")
            .join(name)
            .join("config.json");
        serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
    }

    /// transformers 4.x saved Phi-3's LongRoPE as `rope_scaling` (type `longrope`, or the
    /// older `su`) with `rope_theta`, `partial_rotary_factor` and
    /// `original_max_position_embeddings` at the top level; both spellings resolve alike.
    #[test]
    fn phi3_longrope_in_both_spellings() {
        let v5 = tiny_config("phi3-f32");
        let c5 = parse_value(&v5).unwrap();
        let mut v4 = v5.clone();
        let rp = v4
            .as_object_mut()
            .unwrap()
            .remove("rope_parameters")
            .unwrap();
        v4["rope_theta"] = rp["rope_theta"].clone();
        v4["partial_rotary_factor"] = rp["partial_rotary_factor"].clone();
        for kind in ["longrope", "su"] {
            v4["rope_scaling"] = serde_json::json!({
                "type": kind,
                "short_factor": rp["short_factor"],
                "long_factor": rp["long_factor"],
            });
            assert_eq!(parse_value(&v4).unwrap(), c5, "{kind}");
        }
        assert_eq!(c5.family.rotary_dim, Some(12));
        assert_eq!(c5.sliding_window, Some(8));
        assert!(!c5.attention_bias);
        match c5.rope_scaling {
            Some(RopeScaling::LongRope {
                original_max_position_embeddings: 16,
                attention_factor,
                ref long_factor,
                ..
            }) => {
                // √(1 + ln(256/16) / ln 16)
                assert!((attention_factor - 2f64.sqrt()).abs() < 1e-12);
                assert_eq!(long_factor[5], 16.5);
            }
            ref other => panic!("{other:?}"),
        }
    }

    #[test]
    fn glm_defaults_follow_its_config_classes() {
        let mut v = base();
        v["architectures"] = serde_json::json!(["Glm4ForCausalLM"]);
        v.as_object_mut().unwrap().remove("rms_norm_eps");
        let c = parse_value(&v).unwrap();
        // Glm4Config: head_dim 128, partial_rotary_factor 0.5, attention_bias true.
        assert_eq!(c.head_dim, 128);
        assert_eq!(c.family.rotary_dim, Some(64));
        assert_eq!(c.family.rope_pairing, RopePairing::Interleaved);
        assert!(c.attention_bias && c.family.post_norms);
        assert_eq!(c.rms_norm_eps, 1.5625e-7);
        v["architectures"] = serde_json::json!(["GlmForCausalLM"]);
        assert!(!parse_value(&v).unwrap().family.post_norms);
        // Partial rotary is refused where the family has none.
        let mut l = base();
        l["partial_rotary_factor"] = serde_json::json!(0.5);
        let e = parse_value(&l).unwrap_err().to_string();
        assert!(e.contains("partial_rotary_factor"), "{e}");
    }

    /// Values every reader refuses are refused here, by the same check, under the key
    /// config.json spells them with: a layer count whose tensors no file holds, a RoPE base
    /// of 1, a score scale (`query_pre_attn_scalar^-½`) that is infinite as an f32.
    #[test]
    fn values_every_reader_refuses_are_refused_at_parse() {
        let cases = [
            (
                "num_hidden_layers",
                serde_json::json!(1u64 << 24),
                "num_hidden_layers",
            ),
            ("rope_theta", serde_json::json!(1.0), "rope_theta"),
            (
                "max_position_embeddings",
                serde_json::json!(1u64 << 32),
                "max_position_embeddings",
            ),
        ];
        for (key, val, field) in cases {
            let mut v = base();
            v[key] = val;
            let e = parse_value(&v).unwrap_err();
            assert!(
                matches!(&e, ConvertError::ConfigField { field: f, .. } if f == field),
                "{key}: {e}"
            );
        }
        let mut v = base();
        v["architectures"] = serde_json::json!(["Gemma3ForCausalLM"]);
        v["head_dim"] = serde_json::json!(16);
        v["query_pre_attn_scalar"] = serde_json::json!(1e-300);
        let e = parse_value(&v).unwrap_err();
        assert!(
            matches!(&e, ConvertError::ConfigField { field, .. } if field == "query_pre_attn_scalar"),
            "{e}"
        );
    }

    #[test]
    fn qwen2_always_has_attention_bias() {
        let mut v = base();
        v["architectures"] = serde_json::json!(["Qwen2ForCausalLM"]);
        assert!(parse_value(&v).unwrap().attention_bias);
    }
}
