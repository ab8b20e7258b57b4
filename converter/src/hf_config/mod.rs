//! `config.json` as transformers 4.x or 5.x writes it, resolved into a [`ModelConfig`].
//!
//! The raw file keeps Hugging Face's names and defaults; this module applies those defaults
//! once (as `LlamaConfig`, `MistralConfig`, `Qwen2Config`, `Qwen3Config`,
//! `Gemma3TextConfig`, `Phi3Config`, `Glm4Config` and `GlmConfig` do, each default being a value
//! of the family's row, [`FamilySpec::hf`]) so that nothing downstream deals with optional
//! fields. [`parse`] runs the steps in order: the family, the dimensions, the block's options,
//! RoPE ([`rope`]: both spellings, 4.x's top-level `rope_theta` / `rope_scaling` and 5.x's
//! `rope_parameters`), the window and refused features, the family's options ([`layers`] for
//! sliding layers), the special tokens, then the one check every reader runs.
//!
//! - [`fields`]: the wire side, `config.json`'s object read key by key with typed errors.

mod fields;
mod layers;
mod rope;

use std::path::Path;

use kiln_format::family::{AttentionBias, HfWindow, Refused};
use kiln_format::{FamilySpec, LayerKind, MlpActivation, ModelConfig, RopeScaling};
use serde_json::Value;

use crate::error::{ConvertError, Result};
use fields::Fields;

/// The source dtype named in the config (`dtype` in 5.x, `torch_dtype` in 4.x), if any.
pub fn declared_dtype(raw: &Value) -> Option<String> {
    raw.get("dtype")
        .or_else(|| raw.get("torch_dtype"))
        .and_then(Value::as_str)
        .map(str::to_string)
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
    let (spec, class) = family(&f)?;
    let dims = Dims::read(&f, spec)?;
    let block = Block::read(&f, spec)?;
    let rope = rope::resolve(&f, spec, dims.max_position_embeddings)?;
    let sliding_window = window(&f, spec)?;
    refuse_unsupported(&f, spec)?;
    let family = options(&f, spec, &dims, &rope, block.mlp_activation)?;
    // A family with sliding layers has no window when every layer is global.
    let sliding_window =
        if spec.sliding_layers.is_some() && !family.layer_kinds.contains(&LayerKind::Sliding) {
            None
        } else if family.attention_mask == kiln_format::AttentionMask::Bidirectional {
            // Gemma3TextConfig's `__post_init__`: a bidirectional window of `w` (as config.json
            // states it) sees `w / 2` positions each side, the exclusive bound `w / 2 + 1`.
            sliding_window.map(|w| w / 2 + 1)
        } else {
            sliding_window
        };
    let (bos_token_id, eos_token_ids) = special_tokens(&f, generation, dims.vocab_size)?;

    let config = ModelConfig {
        architecture: spec.architecture,
        source_architecture: class.unwrap_or_else(|| spec.hf.class.to_string()),
        hidden_size: dims.hidden_size,
        intermediate_size: dims.intermediate_size,
        num_layers: dims.num_layers,
        num_heads: dims.num_heads,
        num_kv_heads: dims.num_kv_heads,
        head_dim: dims.head_dim,
        vocab_size: dims.vocab_size,
        max_position_embeddings: dims.max_position_embeddings,
        rms_norm_eps: block.rms_norm_eps,
        rope_theta: rope.theta,
        rope_scaling: rope.scaling,
        tie_word_embeddings: block.tie_word_embeddings,
        attention_bias: block.attention_bias,
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

/// The family's row, by the class `architectures` names (or, without one, by `model_type`),
/// and that class.
fn family(f: &Fields<'_>) -> Result<(&'static FamilySpec, Option<String>)> {
    let path = f.path;
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
    let spec = FamilySpec::from_hf(class.as_deref(), model_type).ok_or_else(|| {
        ConvertError::UnsupportedArchitecture {
            path: path.display().to_string(),
            found,
            supported: FamilySpec::hf_classes(),
        }
    })?;
    Ok((spec, class))
}

/// The model's sizes, defaulted as the family's config class defaults them.
struct Dims {
    hidden_size: u64,
    intermediate_size: u64,
    num_layers: u64,
    num_heads: u64,
    num_kv_heads: u64,
    vocab_size: u64,
    max_position_embeddings: u64,
    head_dim: u64,
}

impl Dims {
    fn read(f: &Fields<'_>, spec: &FamilySpec) -> Result<Dims> {
        let path = f.path;
        let hidden_size = f.req_uint("hidden_size")?;
        let intermediate_size = f.req_uint("intermediate_size")?;
        let num_layers = f.req_uint("num_hidden_layers")?;
        let num_heads = f.req_uint("num_attention_heads")?;
        let num_kv_heads = f.uint("num_key_value_heads")?.unwrap_or(num_heads);
        let vocab_size = f.req_uint("vocab_size")?;
        let max_position_embeddings = f
            .uint("max_position_embeddings")?
            .unwrap_or(spec.hf.max_position_embeddings);
        if num_heads % num_kv_heads != 0 {
            return Err(ConvertError::field(
                path,
                "num_key_value_heads",
                format!("{num_kv_heads} does not divide num_attention_heads ({num_heads})"),
            ));
        }
        let head_dim = match (f.uint("head_dim")?, spec.hf.head_dim) {
            (Some(h), _) => h,
            // The class's own default, not hidden / heads.
            (None, Some(h)) => h,
            (None, None) => {
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
        Ok(Dims {
            hidden_size,
            intermediate_size,
            num_layers,
            num_heads,
            num_kv_heads,
            vocab_size,
            max_position_embeddings,
            head_dim,
        })
    }
}

/// The decoder block's settings outside RoPE: the norm epsilon, the MLP's activation (the
/// family's, the only one accepted), the q/k/v biases and the tied output projection.
struct Block {
    rms_norm_eps: f64,
    mlp_activation: MlpActivation,
    attention_bias: bool,
    tie_word_embeddings: bool,
}

impl Block {
    fn read(f: &Fields<'_>, spec: &FamilySpec) -> Result<Block> {
        let path = f.path;
        let rms_norm_eps = f
            .float(f.map, spec.hf.eps_key, "")?
            .unwrap_or(spec.hf.rms_norm_eps);
        let act_key = spec.hf.activation_key;
        let (want, what) = spec.mlp_activation.hf_name();
        match f.get(act_key) {
            None => {}
            Some(v) if v.as_str() == Some(want) => {}
            Some(act) => {
                return Err(ConvertError::field(
                    path,
                    act_key,
                    format!(
                        "{act} is not supported; Kiln implements {what} (`{want}`) for this family"
                    ),
                ))
            }
        }
        if f.bool("mlp_bias", false)? {
            return Err(ConvertError::field(
                path,
                "mlp_bias",
                "MLP biases are not supported",
            ));
        }
        let attention_bias = match spec.hf.attention_bias {
            AttentionBias::Always => true,
            AttentionBias::Never => false,
            AttentionBias::Config(default) => f.bool("attention_bias", default)?,
            AttentionBias::Refused => {
                if f.bool("attention_bias", false)? {
                    return Err(ConvertError::field(
                        path,
                        "attention_bias",
                        format!("{} with q/k/v biases is not supported", spec.display),
                    ));
                }
                false
            }
        };
        let tie_word_embeddings = f.bool("tie_word_embeddings", spec.hf.tie_word_embeddings)?;
        Ok(Block {
            rms_norm_eps,
            mlp_activation: spec.mlp_activation,
            attention_bias,
            tie_word_embeddings,
        })
    }
}

/// The attention window, as the family states it.
fn window(f: &Fields<'_>, spec: &FamilySpec) -> Result<Option<u64>> {
    Ok(match spec.hf.sliding_window {
        HfWindow::Ignored => None,
        HfWindow::Optional => f.uint("sliding_window")?,
        HfWindow::Default(w) => Some(f.uint("sliding_window")?.unwrap_or(w)),
    })
}

/// Refuse the keys naming features of the family that Kiln does not implement.
fn refuse_unsupported(f: &Fields<'_>, spec: &FamilySpec) -> Result<()> {
    for refused in spec.hf.refused {
        match *refused {
            Refused::Present(key, why) => {
                if let Some(v) = f.get(key) {
                    return Err(ConvertError::field(f.path, key, format!("{v}: {why}")));
                }
            }
            Refused::True(key, why) => {
                if f.bool(key, false)? {
                    return Err(ConvertError::field(f.path, key, why));
                }
            }
        }
    }
    Ok(())
}

/// An encoder's options: its token-type table, and the pooling a bare checkpoint gets (the
/// mean of the last hidden states, unnormalised, as sentence-transformers builds for a model
/// without `modules.json`; the directory's sentence-transformers files replace it).
fn encoder_options(f: &Fields<'_>, family: &mut kiln_format::FamilyOptions) -> Result<()> {
    match f.get("position_embedding_type") {
        None => {}
        Some(v) if v.as_str() == Some("absolute") => {}
        Some(v) => {
            return Err(ConvertError::field(
                f.path,
                "position_embedding_type",
                format!("{v} is not supported; Kiln implements absolute position embeddings"),
            ))
        }
    }
    family.type_vocab_size = Some(f.uint("type_vocab_size")?.unwrap_or(2));
    family.embedding = Some(kiln_format::EmbeddingSpec::pooled(
        kiln_format::Pooling::Mean,
        false,
    ));
    Ok(())
}

/// The family's options: its fixed ones ([`FamilySpec::options`]), the per-layer kinds and
/// scales of sliding layers, the embedding scale, and the rotated width, checked against
/// LongRoPE's factor count.
fn options(
    f: &Fields<'_>,
    spec: &FamilySpec,
    dims: &Dims,
    rope: &rope::Rope<'_>,
    mlp_activation: MlpActivation,
) -> Result<kiln_format::FamilyOptions> {
    let mut family = spec.options();
    family.mlp_activation = mlp_activation;
    if spec.encoder {
        encoder_options(f, &mut family)?;
    }
    if let Some(key) = spec.hf.bidirectional_key {
        if f.bool(key, false)? {
            family.attention_mask = kiln_format::AttentionMask::Bidirectional;
        }
    }
    if let Some(layers) = &spec.sliding_layers {
        let (layer_kinds, attn_scale) = layers::sliding_layers(f, layers, dims.num_layers)?;
        family.layer_kinds = layer_kinds;
        family.attn_scale = Some(attn_scale);
        family.rope_local_theta = rope.local_theta;
    }
    if spec.scaled_embeddings {
        // Gemma3TextScaledWordEmbedding: the f32 value of hidden_size ** 0.5.
        family.embed_scale = Some(f64::from((dims.hidden_size as f64).sqrt() as f32));
    }
    let rotary_dim = rope::rotary_dim(f, rope.params, spec, dims.head_dim)?;
    if let Some(RopeScaling::LongRope {
        short_factor,
        long_factor,
        ..
    }) = &rope.scaling
    {
        let pairs = rotary_dim / 2;
        for (key, v) in [("short_factor", short_factor), ("long_factor", long_factor)] {
            if v.len() as u64 != pairs {
                return Err(ConvertError::field(
                    f.path,
                    &format!("rope_scaling.{key}"),
                    format!(
                        "{} factors, but {pairs} rotated pairs (rotary dimension {rotary_dim})",
                        v.len()
                    ),
                ));
            }
        }
    }
    family.rotary_dim = (rotary_dim != dims.head_dim).then_some(rotary_dim);
    Ok(family)
}

/// The BOS token and every stop token (`eos_token_id`, merged with
/// `generation_config.json`'s), each inside the vocabulary.
fn special_tokens(
    f: &Fields<'_>,
    generation: Option<&Value>,
    vocab_size: u64,
) -> Result<(Option<u32>, Vec<u32>)> {
    let path = f.path;
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
    Ok((bos_token_id, eos_token_ids))
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

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_format::RopePairing;

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

    /// EmbeddingGemma's config: the bare backbone's class, bidirectional attention, and the
    /// window transformers keeps in memory (`w / 2 + 1` for the saved `w`); causal otherwise.
    #[test]
    fn gemma3_backbone_with_bidirectional_attention() {
        let mut v = base();
        v["architectures"] = serde_json::json!(["Gemma3TextModel"]);
        v["head_dim"] = serde_json::json!(16);
        v["sliding_window"] = serde_json::json!(512);
        v["use_bidirectional_attention"] = serde_json::json!(true);
        let c = parse_value(&v).unwrap();
        assert_eq!(c.architecture, kiln_format::Architecture::Gemma3);
        assert_eq!(c.source_architecture, "Gemma3TextModel");
        assert_eq!(
            c.family.attention_mask,
            kiln_format::AttentionMask::Bidirectional
        );
        assert_eq!(c.sliding_window, Some(257));
        v["use_bidirectional_attention"] = serde_json::json!(false);
        let c = parse_value(&v).unwrap();
        assert_eq!(c.family.attention_mask, kiln_format::AttentionMask::Causal);
        assert_eq!(c.sliding_window, Some(512));
    }
}
