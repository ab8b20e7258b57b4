//! `.kiln` → GGUF: the model as current llama.cpp loads it.
//!
//! Metadata: `general.*`, the architecture's hyperparameters under its prefix (`llama.*`,
//! `qwen2.*`), and the tokenizer ([`super::tokenizer::to_gguf`]). Tensors: llama.cpp's names
//! (the one table in [`crate::names`]), dimensions in GGML order (innermost first), the q/k
//! rows of Llama-family models reordered for llama.cpp's rope ([`super::rope`]). Matrices keep
//! their dtype byte for byte (Q8_0 and Q4_0 blocks are GGML's own layout), except Kiln's own
//! layouts, which GGML does not know: a `q4_0x16` matrix is de-interleaved to GGML's Q4_0
//! (type 2), the same blocks row after row. 1-D tensors (norms, biases) are written as F32, as
//! llama.cpp's converter writes them and its CPU kernels expect.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;

use kiln_format::values::cast_bytes;
use kiln_format::{Architecture, DType, KilnFile, ModelConfig, Role, RopeScaling, TensorName};

use super::rope::{self, Direction};
use super::tokenizer;
use super::types::GgmlType;
use super::value::Value;
use super::write::GgufBuilder;
use crate::error::{ConvertError, Result};
use crate::names::{self, Source};
use crate::Progress;

/// What to export.
#[derive(Debug, Clone, Default)]
pub struct ExportOptions {
    /// The `.kiln` file to read.
    pub input: PathBuf,
    /// The `.gguf` file to write.
    pub output: PathBuf,
    /// Replace an existing output file.
    pub overwrite: bool,
}

/// What an export did.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ExportSummary {
    /// Input file.
    pub input: String,
    /// Output file.
    pub output: String,
    /// `general.architecture` written.
    pub architecture: String,
    /// Tensors written.
    pub tensors: usize,
    /// Tensors per GGML type.
    pub types: BTreeMap<String, usize>,
    /// Size of the output file.
    pub bytes_out: u64,
    /// Wall time in seconds.
    pub seconds: f64,
    /// Things the user should know (widened norms, padded vocabulary, …).
    pub notices: Vec<String>,
}

/// llama.cpp's architecture name for a Kiln architecture, and whether its graph needs the
/// q/k rows reordered (`llama` uses adjacent-pair rope, `qwen2`/`qwen3`/`gemma3` the Hugging
/// Face halves); `None` for a family whose GGUF mapping Kiln does not write yet (Phi-3 and
/// GLM: llama.cpp wants their projections fused again, LongRoPE's factors as tensors and GLM's
/// rotary pairs in its own order).
pub fn gguf_architecture(a: Architecture) -> Option<(&'static str, bool)> {
    match a {
        // llama.cpp runs Mistral checkpoints as `llama`, as its converter writes them.
        Architecture::Llama | Architecture::Mistral => Some(("llama", true)),
        Architecture::Qwen2 => Some(("qwen2", false)),
        Architecture::Qwen3 => Some(("qwen3", false)),
        Architecture::Gemma3 => Some(("gemma3", false)),
        Architecture::Phi3 | Architecture::Glm4 | Architecture::Glm => None,
    }
}

/// Why llama.cpp would run this Gemma 3 model differently from Kiln, if it would. A `gemma3`
/// GGUF states only the window; llama.cpp fixes the rest (every sixth layer global, RoPE base
/// 10 000 on sliding layers, scores scaled by `1/√head_dim`, or `1/√(hidden/heads)` for the
/// 62-layer 27B), so a model that differs cannot be written as one.
pub fn gemma3_llama_cpp_mismatch(c: &ModelConfig) -> Option<String> {
    use kiln_format::{LayerKind, MlpActivation, NormStyle};
    let f = &c.family;
    let sixth = (0..c.num_layers as usize)
        .map(|i| {
            if (i + 1) % 6 == 0 {
                LayerKind::Full
            } else {
                LayerKind::Sliding
            }
        })
        .collect::<Vec<_>>();
    if f.layer_kinds != sixth {
        return Some(format!(
            "its layer kinds ({:?}) are not every sixth layer global, the pattern llama.cpp assumes",
            f.layer_kinds
        ));
    }
    if f.rope_local_theta != Some(10_000.0) {
        return Some(format!(
            "its sliding layers' RoPE base is {:?}, not the 10000 llama.cpp assumes",
            f.rope_local_theta
        ));
    }
    let scalar = if c.num_layers == 62 {
        c.hidden_size as f64 / c.num_heads as f64
    } else {
        c.head_dim as f64
    };
    let want = scalar.powf(-0.5);
    match f.attn_scale {
        Some(s) if (s - want).abs() <= 1e-9 * want => {}
        other => {
            return Some(format!(
                "its score scale is {other:?}, not the {want} (1/√{scalar}) llama.cpp uses"
            ))
        }
    }
    if c.sliding_window.is_none()
        || !f.qk_norm
        || !f.post_norms
        || f.norm_style != NormStyle::OnePlusWeight
        || f.mlp_activation != MlpActivation::GeluTanh
        || f.embed_scale != Some(f64::from((c.hidden_size as f64).sqrt() as f32))
        || f.rotary_dim.is_some()
    {
        return Some(
            "its window, norms, activation, embedding scale or rotary width differ from \
             Gemma 3's as llama.cpp runs it"
                .into(),
        );
    }
    None
}

/// `llama_ftype` of the dominant matrix dtype, for `general.file_type`.
fn file_type(d: DType) -> u32 {
    match d {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::Q4_0 | DType::Q4_0x16 => 2,
        DType::Q8_0 => 7,
        DType::BF16 => 32,
    }
}

/// The hyperparameter keys of `config` under the architecture prefix `arch`.
pub fn config_metadata(arch: &str, c: &ModelConfig) -> Vec<(String, Value)> {
    let k = |s: &str| format!("{arch}.{s}");
    let u = |v: u64| Value::U32(v.min(u64::from(u32::MAX)) as u32);
    let mut kv = vec![
        (k("context_length"), u(c.max_position_embeddings)),
        (k("embedding_length"), u(c.hidden_size)),
        (k("block_count"), u(c.num_layers)),
        (k("feed_forward_length"), u(c.intermediate_size)),
        (k("attention.head_count"), u(c.num_heads)),
        (k("attention.head_count_kv"), u(c.num_kv_heads)),
        (k("attention.key_length"), u(c.head_dim)),
        (k("attention.value_length"), u(c.head_dim)),
        (k("rope.dimension_count"), u(c.head_dim)),
        (k("rope.freq_base"), Value::F32(c.rope_theta as f32)),
        (
            k("attention.layer_norm_rms_epsilon"),
            Value::F32(c.rms_norm_eps as f32),
        ),
        (k("vocab_size"), u(c.vocab_size)),
    ];
    if let (Architecture::Gemma3, Some(w)) = (c.architecture, c.sliding_window) {
        kv.push((k("attention.sliding_window"), u(w)));
    }
    match &c.rope_scaling {
        Some(RopeScaling::Linear { factor }) => {
            kv.push((k("rope.scaling.type"), Value::Str("linear".into())));
            kv.push((k("rope.scaling.factor"), Value::F32(*factor as f32)));
        }
        Some(s @ (RopeScaling::Llama3 { .. } | RopeScaling::LongRope { .. })) => {
            // llama.cpp reads the rope_freqs tensor; the parameters themselves go under Kiln's
            // own key so that an import can restore the configuration exactly.
            kv.push((
                "kiln.rope_scaling".into(),
                Value::Str(serde_json::to_string(s).expect("serializable")),
            ));
        }
        None => {}
    }
    kv
}

fn export_error(file: &str, what: impl Into<String>, reason: impl Into<String>) -> ConvertError {
    ConvertError::Export {
        file: file.to_string(),
        what: what.into(),
        reason: reason.into(),
    }
}

/// One tensor as it will be written.
struct Plan {
    source: Option<usize>,
    gguf_name: String,
    ggml_type: GgmlType,
    dims: Vec<u64>,
    permute_heads: Option<usize>,
    widen: bool,
    /// A Gemma norm weight `w`, written as `1 + w` in F32 as llama.cpp's converter writes it.
    plus_one: bool,
}

/// Export a `.kiln` file to GGUF.
pub fn export_gguf(opts: &ExportOptions, progress: &dyn Progress) -> Result<ExportSummary> {
    let start = Instant::now();
    kiln_format::refuse_output_is_input(&opts.output, [opts.input.as_path()])?;
    let f = KilnFile::open(&opts.input)?;
    let label = opts.input.display().to_string();
    let failures = f.verify_checksums(&|_| {});
    if !failures.is_empty() {
        let names: Vec<&str> = failures.iter().map(|x| x.tensor.as_str()).collect();
        return Err(ConvertError::ChecksumMismatch {
            file: label,
            count: names.len(),
            tensors: names.join(", "),
        });
    }
    let meta = f.metadata();
    let c = &meta.config;
    let (arch, permute) = gguf_architecture(c.architecture).ok_or_else(|| {
        export_error(
            &label,
            format!("a {} model", c.architecture.name()),
            "GGUF export of this family is not implemented yet",
        )
    })?;
    if c.architecture == Architecture::Gemma3 {
        if let Some(why) = gemma3_llama_cpp_mismatch(c) {
            return Err(export_error(
                &label,
                "a gemma3 model",
                format!("llama.cpp would run it differently: {why}"),
            ));
        }
    }
    let gemma = c.architecture == Architecture::Gemma3;
    let mut notices = Vec::new();

    let mut b = GgufBuilder::new();
    b.set("general.architecture", Value::Str(arch.into()));
    let name = opts
        .input
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into());
    b.set("general.name", Value::Str(name));
    for (k, v) in config_metadata(arch, c) {
        b.set(&k, v);
    }
    let (tok_kv, tok_notices) = tokenizer::to_gguf(&label, &meta.tokenizer, c)?;
    for (k, v) in tok_kv {
        b.set(&k, v);
    }
    notices.extend(tok_notices);

    let mut plans = Vec::new();
    if let Some(factors) = c
        .rope_scaling
        .as_ref()
        .and_then(|s| rope::llama3_factors(s, c.rope_theta, c.head_dim))
    {
        plans.push(Plan {
            source: None,
            gguf_name: "rope_freqs.weight".into(),
            ggml_type: GgmlType::of(DType::F32),
            dims: vec![factors.len() as u64],
            permute_heads: None,
            widen: false,
            plus_one: false,
        });
    }
    let mut widened = 0usize;
    let mut matrix_bytes: BTreeMap<DType, u64> = BTreeMap::new();
    for (i, info) in f.tensors().iter().enumerate() {
        let tn = TensorName::parse(&info.name).ok_or_else(|| {
            export_error(
                &label,
                format!("tensor `{}`", info.name),
                "not a canonical Kiln tensor name, so its llama.cpp name is unknown",
            )
        })?;
        let plus_one = gemma && tn.role.is_norm();
        let widen = info.shape.len() == 1 && info.dtype != DType::F32;
        widened += usize::from(widen);
        if info.shape.len() == 2 {
            *matrix_bytes.entry(info.dtype.logical()).or_default() += info.len;
        }
        let permute_heads = match tn.role {
            Role::AttnQ if permute => Some(c.num_heads as usize),
            Role::AttnK if permute => Some(c.num_kv_heads as usize),
            _ => None,
        };
        plans.push(Plan {
            source: Some(i),
            gguf_name: names::source_name(Source::Gguf, c.architecture, tn),
            ggml_type: GgmlType::of(if widen { DType::F32 } else { info.dtype }),
            dims: info.shape.iter().rev().copied().collect(),
            permute_heads,
            widen: widen || plus_one,
            plus_one,
        });
    }
    if widened > 0 {
        notices.push(format!(
            "{widened} 1-D tensor(s) (norms, biases) widened to F32, as llama.cpp expects"
        ));
    }
    let dominant = matrix_bytes
        .iter()
        .max_by_key(|(_, n)| **n)
        .map(|(d, _)| *d)
        .unwrap_or(DType::F32);
    b.set("general.file_type", Value::U32(file_type(dominant)));
    if matrix_bytes.keys().any(|d| d.is_quantized()) {
        b.set("general.quantization_version", Value::U32(2));
    }
    for p in &plans {
        b.add_tensor(&p.gguf_name, p.dims.clone(), p.ggml_type)?;
    }

    let mut types = BTreeMap::new();
    for p in &plans {
        *types.entry(p.ggml_type.name.to_string()).or_insert(0usize) += 1;
    }
    let total: u64 = f.tensors().iter().map(|t| t.len).sum();
    progress.start(total, plans.len());
    let factors = c
        .rope_scaling
        .as_ref()
        .and_then(|s| rope::llama3_factors(s, c.rope_theta, c.head_dim));
    let bytes_out = b.write(&opts.output, opts.overwrite, |i| {
        let p = &plans[i];
        let Some(src) = p.source else {
            let fs = factors.as_deref().unwrap_or(&[]);
            return Ok(Cow::Owned(
                fs.iter().flat_map(|x| x.to_le_bytes()).collect(),
            ));
        };
        let info = &f.tensors()[src];
        let view = f.view(info);
        let mut bytes = Cow::Borrowed(view.bytes());
        if info.dtype != info.dtype.logical() {
            // A Kiln-only layout: back to GGML's row-major blocks.
            let cols = info.shape.last().copied().unwrap_or(1) as usize;
            bytes = Cow::Owned(info.dtype.from_storage(cols, &bytes).into_owned());
        }
        if p.widen {
            let mut out = Vec::new();
            cast_bytes(info.dtype, DType::F32, &bytes, &mut out);
            if p.plus_one {
                // In f32, as llama.cpp's converter adds it.
                for v in out.chunks_exact_mut(4) {
                    let x = f32::from_le_bytes([v[0], v[1], v[2], v[3]]) + 1.0;
                    v.copy_from_slice(&x.to_le_bytes());
                }
            }
            bytes = Cow::Owned(out);
        }
        if let Some(n_head) = p.permute_heads {
            let cols = info.shape.last().copied().unwrap_or(0);
            // The bytes are row-major by now, in the dtype GGML knows.
            let row_bytes = info
                .dtype
                .logical()
                .byte_len(&[cols])
                .map_err(|r| export_error(&label, format!("tensor `{}`", info.name), r))?;
            let permuted =
                rope::permute_rows(&bytes, row_bytes as usize, n_head, Direction::ToGguf)
                    .map_err(|r| export_error(&label, format!("tensor `{}`", info.name), r))?;
            bytes = Cow::Owned(permuted);
        }
        progress.advance(info.len, 1);
        Ok(bytes)
    })?;
    progress.finish();
    Ok(ExportSummary {
        input: label,
        output: opts.output.display().to_string(),
        architecture: arch.to_string(),
        tensors: plans.len(),
        types,
        bytes_out,
        seconds: start.elapsed().as_secs_f64(),
        notices,
    })
}
