//! The model configuration of a GGUF file: the architecture's hyperparameter keys under its
//! prefix, resolved with what llama.cpp assumes of the family (its row of
//! [`kiln_format::FAMILIES`], [`kiln_format::family::GgufSpec`]) into a [`ModelConfig`].

use kiln_format::family::GgufWindow;
use kiln_format::{FamilyOptions, FamilySpec, LayerKind, ModelConfig, RopeScaling};

use super::super::dequant::dequantize;
use super::super::read::{GgufHeader, GgufTensor};
use super::super::rope;
use super::super::value::{Array, Value};
use crate::error::{ConvertError, Result};

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

/// The file's `general.architecture` and the family it imports as.
fn architecture<'h>(file: &str, h: &'h GgufHeader) -> Result<(&'h str, &'static FamilySpec)> {
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
    let spec =
        FamilySpec::from_gguf(arch).ok_or_else(|| ConvertError::UnsupportedArchitecture {
            path: file.into(),
            found: arch.into(),
            supported: format!("GGUF general.architecture {}", FamilySpec::gguf_names()),
        })?;
    Ok((arch, spec))
}

/// The configuration the file states, with the family's assumptions filled in (unchecked:
/// [`checked_config`] checks it).
pub(super) fn resolve_config(file: &str, h: &GgufHeader, bytes: &[u8]) -> Result<ModelConfig> {
    let (arch, spec) = architecture(file, h)?;
    let k = Keys {
        file,
        header: h,
        arch,
    };
    let hidden = k.u64("embedding_length")?;
    let heads = k.u64("attention.head_count")?;
    let head_dim = head_dim(&k, hidden, heads, spec.partial_rotary())?;
    let rotary_dim = rotary_dim(&k, spec, head_dim)?;
    let vocab = vocab(&k)?;
    let (rope_theta, rope_scaling) = rope_settings(file, bytes, &k, spec, head_dim, rotary_dim)?;
    let eos_token_ids = eos_token_ids(&k, spec)?;
    let num_layers = k.u64("block_count")?;
    let (mut family, mut sliding_window) = family(&k, spec, num_layers, hidden, heads, head_dim)?;
    // llama.cpp's embedding graph of the family (`gemma-embedding`): bidirectional, each
    // sliding layer's window `n_swa / 2` positions to either side (the bound `|p − j| <
    // n_swa / 2 + 1`), pooled.
    let bidirectional = spec.gguf.embedding_name == Some(arch);
    if bidirectional {
        family.attention_mask = kiln_format::AttentionMask::Bidirectional;
        sliding_window = sliding_window.map(|w| w / 2 + 1);
    }
    if spec.encoder {
        encoder(&k, &mut family)?;
    } else if bidirectional
        || k.get("pooling_type").is_some()
        || k.header.get("kiln.embedding").is_some()
    {
        // A decoder-based embedder (Qwen3-Embedding: last-token pooling; EmbeddingGemma).
        family.embedding = Some(embedding_spec(&k)?);
    }
    let family = FamilyOptions {
        rotary_dim: (rotary_dim != head_dim).then_some(rotary_dim),
        ..family
    };
    // LayerNorm families state their epsilon under its own key.
    let eps_key = match family.norm_kind {
        kiln_format::NormKind::Rms => "attention.layer_norm_rms_epsilon",
        kiln_format::NormKind::Layer => "attention.layer_norm_epsilon",
    };
    Ok(ModelConfig {
        architecture: spec.architecture,
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
            .f64_opt(eps_key)?
            .ok_or_else(|| k.err(&format!("{arch}.{eps_key}"), "missing"))?,
        rope_theta,
        rope_scaling,
        tie_word_embeddings: h.tensor("output.weight").is_none(),
        attention_bias: h.tensor("blk.0.attn_q.bias").is_some()
            || h.tensor("blk.0.attn_qkv.bias").is_some(),
        sliding_window,
        bos_token_id: token_id(&k, "tokenizer.ggml.bos_token_id")?,
        eos_token_ids,
        family,
    })
}

/// The vocabulary size: `vocab_size`, else the embedding's rows, else the token list's
/// length; a token list longer than it is refused.
fn vocab(k: &Keys) -> Result<u64> {
    let h = k.header;
    let vocab = match k.u64_opt("vocab_size")? {
        Some(v) => v,
        None => match (
            h.tensor("token_embd.weight"),
            h.get("tokenizer.ggml.tokens"),
        ) {
            (Some(t), _) if t.dims.len() == 2 => t.dims[1],
            (_, Some(Value::Array(a))) => a.len() as u64,
            _ => return Err(k.err(&format!("{}.vocab_size", k.arch), "missing")),
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
    Ok(vocab)
}

/// The RoPE base and scaling: `rope.scaling.type` (linear or none), LongRoPE from its factor
/// tensors for families that have it, Llama 3 scaling from `rope_freqs` for families that
/// rotate whole heads (`chatglm`/`glm4` load no factor tensors: one there is refused as
/// unknown when the tensors are listed).
fn rope_settings(
    file: &str,
    bytes: &[u8],
    k: &Keys,
    spec: &FamilySpec,
    head_dim: u64,
    rotary_dim: u64,
) -> Result<(f64, Option<RopeScaling>)> {
    let h = k.header;
    let scaling = match k.get("rope.scaling.type") {
        None => None,
        Some((_, Value::Str(s))) if s == "none" => None,
        Some((_, Value::Str(s))) if s == "linear" => Some(RopeScaling::Linear {
            factor: k
                .f64_opt("rope.scaling.factor")?
                .ok_or_else(|| k.err(&format!("{}.rope.scaling.factor", k.arch), "missing"))?,
        }),
        Some((key, v)) => {
            return Err(k.err(
                &key,
                format!("rope scaling {v:?} is not supported (linear or none)"),
            ))
        }
    };
    let theta = k.f64_opt("rope.freq_base")?.unwrap_or(10_000.0);
    let scaling = if spec.longrope {
        match longrope_scaling(file, h, bytes, k, rotary_dim)? {
            Some(s) => Some(s),
            None => scaling,
        }
    } else if spec.partial_rotary() {
        scaling
    } else {
        match h.tensor("rope_freqs.weight") {
            None => scaling,
            Some(_) => Some(llama3_scaling(file, h, theta, head_dim)?),
        }
    };
    Ok((theta, scaling))
}

/// A token id key; one that does not fit a u32 is refused, not truncated into another token.
fn token_id(k: &Keys, key: &str) -> Result<Option<u32>> {
    match k.header.get(key) {
        None => Ok(None),
        Some(v) => v
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .map(Some)
            .ok_or_else(|| k.err(key, format!("expected a token id, found {v:?}"))),
    }
}

/// The end-of-text and end-of-turn tokens, and the family's end-of-turn token by its spelling
/// when the file names none (llama.cpp recognises Gemma's `<end_of_turn>` so, and so does Kiln).
fn eos_token_ids(k: &Keys, spec: &FamilySpec) -> Result<Vec<u32>> {
    let h = k.header;
    let mut eos_token_ids: Vec<u32> = Vec::new();
    for key in ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"] {
        if let Some(e) = token_id(k, key)? {
            if !eos_token_ids.contains(&e) {
                eos_token_ids.push(e);
            }
        }
    }
    if let Some(spelling) = spec.gguf.end_of_turn {
        if h.get("tokenizer.ggml.eot_token_id").is_none() {
            if let Some(Value::Array(Array::Str(tokens))) = h.get("tokenizer.ggml.tokens") {
                if let Some(i) = tokens.iter().position(|t| t == spelling) {
                    if !eos_token_ids.contains(&(i as u32)) {
                        eos_token_ids.push(i as u32);
                    }
                }
            }
        }
    }
    Ok(eos_token_ids)
}

/// The family's options as llama.cpp runs a file of it, and the window: its fixed options
/// ([`FamilySpec::options`]), the window as [`GgufWindow`] says the file states it (Phi-3's
/// 0 meaning none, as llama.cpp's converter writes it for Phi-4-mini), the per-layer kinds and
/// scales of sliding layers ([`sliding_layers`]), the embedding scale. Keys naming what Kiln
/// does not implement (logit soft-capping, M-RoPE's `rope.dimension_sections`) are refused.
fn family(
    k: &Keys,
    spec: &FamilySpec,
    num_layers: u64,
    hidden: u64,
    heads: u64,
    head_dim: u64,
) -> Result<(FamilyOptions, Option<u64>)> {
    let mut window = match spec.gguf.window {
        GgufWindow::Required => Some(k.u64("attention.sliding_window")?),
        GgufWindow::Absent | GgufWindow::ZeroMeansNone => None,
    };
    for &(suffix, why) in spec.gguf.refused {
        if let Some((key, v)) = k.get(suffix) {
            return Err(k.err(&key, format!("{v:?}: {why}")));
        }
    }
    if spec.gguf.window == GgufWindow::ZeroMeansNone {
        if let Some((key, v)) = k.get("attention.sliding_window") {
            window = match v.as_u64() {
                Some(0) => None,
                Some(w) if w <= 1 << 32 => Some(w),
                _ => return Err(k.err(&key, format!("expected a window length, found {v:?}"))),
            };
        }
    }
    let mut family = spec.options();
    if let Some(layers) = &spec.sliding_layers {
        let (layer_kinds, attn_scale) =
            sliding_layers(k, layers, num_layers, hidden, heads, head_dim)?;
        family.layer_kinds = layer_kinds;
        family.attn_scale = Some(attn_scale);
        family.rope_local_theta = Some(layers.local_rope_theta);
    }
    if spec.scaled_embeddings {
        // As Gemma3TextScaledWordEmbedding computes it: the f32 value of hidden ** 0.5.
        family.embed_scale = Some(f64::from((hidden as f64).sqrt() as f32));
    }
    Ok((family, window))
}

/// An encoder's options as llama.cpp's `bert` graph runs it: non-causal attention, the
/// token-type table's rows, and the pooling `pooling_type` names. The file does not say
/// whether the model normalises its vectors; llama.cpp's tools normalise by default
/// (`--embd-normalize 2`), and so does the imported file (`kiln-run embed --no-normalize`
/// keeps them raw).
fn encoder(k: &Keys, family: &mut FamilyOptions) -> Result<()> {
    if let Some((key, v)) = k.get("attention.causal") {
        if *v != Value::Bool(false) {
            return Err(k.err(&key, format!("{v:?}: a causal encoder is not supported")));
        }
    }
    family.type_vocab_size = match k.header.tensor("token_types.weight") {
        Some(t) if t.dims.len() == 2 => Some(t.dims[1]),
        Some(t) => {
            return Err(k.err(
                "token_types.weight",
                format!("expected 2 dimensions, found {:?}", t.dims),
            ))
        }
        None => None,
    };
    family.embedding = Some(embedding_spec(k)?);
    Ok(())
}

/// The pooling `pooling_type` names (mean when absent, llama.cpp's default for `bert`), and,
/// in a file Kiln wrote, the rest of the model's embedding from `kiln.embedding`, checked
/// against that pooling. Without it the vectors are normalised, as llama.cpp's tools do.
fn embedding_spec(k: &Keys) -> Result<kiln_format::EmbeddingSpec> {
    let pooling = match k.get("pooling_type") {
        None => kiln_format::Pooling::Mean,
        Some((key, v)) => match v.as_u64() {
            Some(1) => kiln_format::Pooling::Mean,
            Some(2) => kiln_format::Pooling::Cls,
            Some(3) => kiln_format::Pooling::LastToken,
            _ => {
                return Err(k.err(
                    &key,
                    format!("{v:?}: Kiln pools by mean (1), CLS (2) or last token (3)"),
                ))
            }
        },
    };
    let spec = match k.header.get("kiln.embedding") {
        // A file Kiln wrote: the rest of the model's embedding, checked against the pooling
        // llama.cpp reads.
        Some(v) => {
            let stored: kiln_format::EmbeddingSpec = v
                .as_str()
                .and_then(|s| serde_json::from_str(s).ok())
                .ok_or_else(|| {
                    k.err(
                        "kiln.embedding",
                        format!("{v:?} is not Kiln's embedding JSON"),
                    )
                })?;
            if stored.pooling != pooling {
                return Err(k.err(
                    "kiln.embedding",
                    format!(
                        "names {} pooling, but {}.pooling_type names {}",
                        stored.pooling.name(),
                        k.arch,
                        pooling.name()
                    ),
                ));
            }
            stored
        }
        None => {
            let mut spec = kiln_format::EmbeddingSpec::pooled(pooling, true);
            spec.dense = dense_layers(k)?;
            spec
        }
    };
    Ok(spec)
}

/// The Dense projections llama.cpp's converter states for an embedding model
/// (`dense_2_feat_in`/`_out`, `dense_3_feat_in`/`_out`: EmbeddingGemma's 768 → 3072 → 768),
/// as its graph runs them: `dense_2.weight` then `dense_3.weight`, no bias, no activation.
fn dense_layers(k: &Keys) -> Result<Vec<kiln_format::DenseLayer>> {
    let mut layers = Vec::new();
    for name in ["dense_2", "dense_3"] {
        let feat_in = k.u64_opt(&format!("{name}_feat_in"))?;
        let feat_out = k.u64_opt(&format!("{name}_feat_out"))?;
        match (feat_in, feat_out) {
            (None, None) => {}
            (Some(in_features), Some(out_features)) => layers.push(kiln_format::DenseLayer {
                in_features,
                out_features,
                bias: false,
                activation: kiln_format::DenseActivation::Identity,
            }),
            _ => {
                return Err(k.err(
                    &format!("{}.{name}_feat_in", k.arch),
                    "the Dense layer's input and output widths must both be stated",
                ))
            }
        }
    }
    Ok(layers)
}

/// Sliding layers as llama.cpp runs them (Gemma 3), whose file states only the window: every
/// [`SlidingLayers::global_every`]-th layer attends globally (unless
/// `attention.sliding_window_pattern` says otherwise), and scores are scaled by `1/√head_dim`
/// (by `1/√(hidden/heads)` for the 62-layer 27B, as llama.cpp does).
///
/// [`SlidingLayers::global_every`]: kiln_format::family::SlidingLayers::global_every
fn sliding_layers(
    k: &Keys,
    layers: &kiln_format::family::SlidingLayers,
    num_layers: u64,
    hidden: u64,
    heads: u64,
    head_dim: u64,
) -> Result<(Vec<LayerKind>, f64)> {
    let pattern = k
        .u64_opt("attention.sliding_window_pattern")?
        .unwrap_or(layers.global_every);
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
    Ok((layer_kinds, scalar.powf(-0.5)))
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
pub(super) fn check_config(file: &str, h: &GgufHeader, config: &ModelConfig) -> Result<()> {
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
/// absent, as llama.cpp defaults it; even and within the head, or the key is refused. A
/// family without partial rotary rotates whole heads ([`head_dim`] checks the key then).
fn rotary_dim(k: &Keys, spec: &FamilySpec, head_dim: u64) -> Result<u64> {
    if !spec.partial_rotary() {
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
    let factors = |t: &GgufTensor| longrope_factors(file, bytes, t, rotary_dim);
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
    match h.get("kiln.rope_scaling") {
        None => Ok(Some(from_tensors)),
        Some(stored) => check_stored_longrope(k, stored, from_tensors, &orig_key).map(Some),
    }
}

/// One LongRoPE factor tensor: one positive, finite factor per rotated pair.
fn longrope_factors(file: &str, bytes: &[u8], t: &GgufTensor, rotary_dim: u64) -> Result<Vec<f64>> {
    let pairs = rotary_dim / 2;
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
    dequantize(
        t.ggml_type,
        super::super::read::tensor_bytes(bytes, t),
        &mut x,
    )
    .ok_or_else(|| bad(format!("cannot decode {} factors", t.ggml_type.name)))?;
    if let Some(v) = x.iter().find(|v| !(v.is_finite() && **v > 0.0)) {
        return Err(bad(format!("{v} is not a positive factor")));
    }
    Ok(x.into_iter().map(f64::from).collect())
}

/// The exact scaling Kiln stored (`kiln.rope_scaling`), kept when it agrees, at f32, with what
/// llama.cpp reads (`from_tensors`); a disagreement is refused.
fn check_stored_longrope(
    k: &Keys,
    stored: &Value,
    from_tensors: RopeScaling,
    orig_key: &str,
) -> Result<RopeScaling> {
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
        Some(p) if as_f32(&p).is_some() && as_f32(&p) == as_f32(&from_tensors) => Ok(p),
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
