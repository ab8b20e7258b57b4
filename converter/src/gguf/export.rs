//! `.kiln` → GGUF: the model as current llama.cpp loads it.
//!
//! Metadata: `general.*`, the architecture's hyperparameters under its prefix (`llama.*`,
//! `qwen2.*`), and the tokenizer ([`super::tokenizer::to_gguf`]). Tensors: llama.cpp's names
//! (the one table in [`crate::names`]), dimensions in GGML order (innermost first), the q/k
//! rows of Llama-family models reordered for llama.cpp's rope ([`super::rope`]), the parts
//! llama.cpp keeps fused (Phi-3's `attn_qkv`, the `[gate; up]` `ffn_up` of Phi-3 and GLM)
//! stacked back by rows, and LongRoPE's factors as the `rope_factors_long`/`_short` tensors
//! llama.cpp reads them from. Matrices keep
//! their dtype byte for byte (Q8_0 and Q4_0 blocks are GGML's own layout), except Kiln's own
//! layouts, which GGML does not know: a `q4_0x16` matrix is de-interleaved to GGML's Q4_0
//! (type 2), the same blocks row after row. 1-D tensors (norms, biases) are written as F32, as
//! llama.cpp's converter writes them and its CPU kernels expect.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;

use kiln_format::values::{cast_bytes, decode_rows_f32};
use kiln_format::{
    Architecture, DType, FamilyOptions, KilnFile, ModelConfig, Role, RopePairing, RopeScaling,
    TensorName,
};

use super::rope::{self, Direction};
use super::tokenizer;
use super::types::GgmlType;
use super::value::{Array, Value};
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
/// q/k rows reordered (`llama` uses adjacent-pair rope on Hugging Face's half-split heads;
/// `qwen2`/`qwen3`/`gemma3`/`phi3` rotate halves as Hugging Face does, and `chatglm`/`glm4`
/// rotate adjacent pairs, which is GLM's own interleaved pairing, so none of them is
/// reordered); `None` for a family Kiln cannot write as GGUF.
pub fn gguf_architecture(a: Architecture) -> Option<(&'static str, bool)> {
    match a {
        // llama.cpp runs Mistral checkpoints as `llama`, as its converter writes them.
        Architecture::Llama | Architecture::Mistral => Some(("llama", true)),
        Architecture::Qwen2 => Some(("qwen2", false)),
        Architecture::Qwen3 => Some(("qwen3", false)),
        Architecture::Gemma3 => Some(("gemma3", false)),
        Architecture::Phi3 => Some(("phi3", false)),
        Architecture::Glm4 => Some(("glm4", false)),
        // `GlmForCausalLM` is what llama.cpp's converter writes as `chatglm`.
        Architecture::Glm => Some(("chatglm", false)),
    }
}

/// The family options llama.cpp's `phi3`, `chatglm` and `glm4` graphs hard-wire (the rotated
/// width aside, which `rope.dimension_count` states), for [`fused_family_mismatch`].
fn llama_cpp_family(a: Architecture) -> Option<FamilyOptions> {
    let glm = FamilyOptions {
        rope_pairing: RopePairing::Interleaved,
        ..FamilyOptions::default()
    };
    match a {
        Architecture::Phi3 => Some(FamilyOptions::default()),
        Architecture::Glm => Some(glm),
        Architecture::Glm4 => Some(FamilyOptions {
            post_norms: true,
            ..glm
        }),
        _ => None,
    }
}

/// Why llama.cpp would run this Phi-3, GLM or GLM-4 model differently from Kiln, if it would:
/// the configuration field at fault and the reason. Those graphs state no more than the keys
/// [`config_metadata`] writes; anything else Kiln's configuration holds (an option off the
/// family's usual value, a window on GLM, a square output projection for `phi3`/`chatglm`)
/// has no GGUF key, so such a model is refused rather than written as a different one.
pub fn fused_family_mismatch(c: &ModelConfig) -> Option<(&'static str, String)> {
    let want = llama_cpp_family(c.architecture)?;
    let f = &c.family;
    // Each option beside the family's, both as Debug prints them (equal exactly when the values
    // are, for these types), so that the message can show them.
    let show = |x: &dyn std::fmt::Debug| format!("{x:?}");
    let fields = [
        ("qk_norm", show(&f.qk_norm), show(&want.qk_norm)),
        ("post_norms", show(&f.post_norms), show(&want.post_norms)),
        ("norm_style", show(&f.norm_style), show(&want.norm_style)),
        (
            "mlp_activation",
            show(&f.mlp_activation),
            show(&want.mlp_activation),
        ),
        ("embed_scale", show(&f.embed_scale), show(&want.embed_scale)),
        ("attn_scale", show(&f.attn_scale), show(&want.attn_scale)),
        ("layer_kinds", show(&f.layer_kinds), show(&want.layer_kinds)),
        (
            "rope_local_theta",
            show(&f.rope_local_theta),
            show(&want.rope_local_theta),
        ),
        (
            "rope_pairing",
            show(&f.rope_pairing),
            show(&want.rope_pairing),
        ),
    ];
    if let Some((field, found, want)) = fields.into_iter().find(|(_, a, b)| a != b) {
        return Some((
            field,
            format!(
                "{found}, where llama.cpp's graph for this family assumes {want} and no GGUF \
                 key says otherwise"
            ),
        ));
    }
    let glm = matches!(c.architecture, Architecture::Glm | Architecture::Glm4);
    if let (true, Some(w)) = (glm, c.sliding_window) {
        return Some((
            "sliding_window",
            format!("{w}: llama.cpp's GLM graphs attend over the whole context"),
        ));
    }
    match &c.rope_scaling {
        Some(RopeScaling::Llama3 { .. }) => {
            return Some((
                "rope_scaling",
                "Llama 3 scaling: llama.cpp reads its factors (`rope_freqs`) for Llama-family \
                 graphs only"
                    .into(),
            ))
        }
        Some(RopeScaling::LongRope { .. }) if glm => {
            return Some((
                "rope_scaling",
                "LongRoPE: llama.cpp reads its factors for `phi3` only".into(),
            ))
        }
        _ => {}
    }
    // `phi3` and `chatglm` load the output projection as hidden × hidden.
    let q = c.num_heads * c.head_dim;
    if c.architecture != Architecture::Glm4 && q != c.hidden_size {
        return Some((
            "head_dim",
            format!(
                "{} heads of {} make {q} query rows, but llama.cpp's graph for this family \
                 needs them to equal hidden_size ({})",
                c.num_heads, c.head_dim, c.hidden_size
            ),
        ));
    }
    None
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

/// `general.file_type` (llama.cpp's `llama_ftype`) of a file whose matrices hold
/// `matrix_bytes` (bytes per logical dtype).
///
/// A file with K-quant matrices is named, as llama-quantize names its mixes, after the K-quant
/// holding most of their weights: Q4_K → `MOSTLY_Q4_K_M` (15), Q5_K → `MOSTLY_Q5_K_M` (17),
/// Q6_K → `MOSTLY_Q6_K` (18). Such a mix holds other types too: Q6_K for some matrices, and
/// llama-quantize's fallbacks (Q5_0, Q5_1, Q8_0) for matrices whose rows are not a multiple of
/// 256 — in Gemma 3 270M's Q4_K_M file the Q8_0 embedding alone is most of the bytes, and the
/// file still says 15. Without K-quants, the dtype holding most matrix bytes names the file.
fn file_type(matrix_bytes: &BTreeMap<DType, u64>) -> u32 {
    let weights = |d: DType, bytes: u64| {
        u128::from(bytes) * d.block_len() as u128 / d.block_bytes().max(1) as u128
    };
    let k_quant = matrix_bytes
        .iter()
        .filter(|(d, _)| d.is_k_quant())
        .max_by_key(|(d, b)| weights(**d, **b))
        .map(|(d, _)| *d);
    let dominant = k_quant.unwrap_or_else(|| {
        matrix_bytes
            .iter()
            .max_by_key(|(_, b)| **b)
            .map(|(d, _)| *d)
            .unwrap_or(DType::F32)
    });
    match dominant {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::Q4_0 | DType::Q4_0x16 => 2,
        DType::Q8_0 => 7,
        DType::Q5_0 => 8,
        DType::Q5_1 => 9,
        DType::Q4_K => 15,
        DType::Q5_K => 17,
        DType::Q6_K => 18,
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
        // The rotated width: all of the head but for Phi-4-mini and GLM (partial rotary).
        (k("rope.dimension_count"), u(c.rotary_dim())),
        (k("rope.freq_base"), Value::F32(c.rope_theta as f32)),
        (
            k("attention.layer_norm_rms_epsilon"),
            Value::F32(c.rms_norm_eps as f32),
        ),
        (k("vocab_size"), u(c.vocab_size)),
    ];
    match (c.architecture, c.sliding_window) {
        (Architecture::Gemma3, Some(w)) => kv.push((k("attention.sliding_window"), u(w))),
        // llama.cpp's converter writes 0 for a Phi-3 without a window (Phi-4-mini).
        (Architecture::Phi3, w) => kv.push((k("attention.sliding_window"), u(w.unwrap_or(0)))),
        _ => {}
    }
    match &c.rope_scaling {
        Some(RopeScaling::Linear { factor }) => {
            kv.push((k("rope.scaling.type"), Value::Str("linear".into())));
            kv.push((k("rope.scaling.factor"), Value::F32(*factor as f32)));
        }
        Some(s @ (RopeScaling::Llama3 { .. } | RopeScaling::LongRope { .. })) => {
            if let RopeScaling::LongRope {
                original_max_position_embeddings,
                attention_factor,
                ..
            } = s
            {
                // The factors travel as tensors (`rope_factors_long`/`_short`); the context
                // that picks between them and the factor on cos/sin as keys.
                kv.push((
                    k("rope.scaling.original_context_length"),
                    u(*original_max_position_embeddings),
                ));
                kv.push((
                    k("rope.scaling.attn_factor"),
                    Value::F32(*attention_factor as f32),
                ));
            }
            // llama.cpp reads the factor tensors; the parameters themselves go under Kiln's
            // own key so that an import can restore the configuration exactly (f64 factors
            // that the f32 tensors would round).
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
    /// The `.kiln` tensors it holds, stacked by rows in this order: one, or the parts of a
    /// tensor llama.cpp keeps fused; none for a tensor computed from the configuration.
    sources: Vec<usize>,
    /// The F32 values of a tensor computed from the configuration (rope factors).
    data: Vec<f32>,
    gguf_name: String,
    ggml_type: GgmlType,
    dims: Vec<u64>,
    permute_heads: Option<usize>,
    widen: bool,
    /// A Gemma norm weight `w`, written as `1 + w` in F32 as llama.cpp's converter writes it.
    plus_one: bool,
}

impl Plan {
    /// A 1-D F32 tensor of values computed from the configuration.
    fn computed(gguf_name: &str, data: Vec<f32>) -> Plan {
        Plan {
            sources: Vec::new(),
            gguf_name: gguf_name.into(),
            ggml_type: GgmlType::of(DType::F32),
            dims: vec![data.len() as u64],
            data,
            permute_heads: None,
            widen: false,
            plus_one: false,
        }
    }
}

/// Export a `.kiln` file to GGUF.
pub fn export_gguf(opts: &ExportOptions, progress: &dyn Progress) -> Result<ExportSummary> {
    let start = Instant::now();
    kiln_format::refuse_output_is_input(&opts.output, [opts.input.as_path()])?;
    let f = KilnFile::open(&opts.input)?;
    let label = opts.input.display().to_string();
    // Checksums and values in one pass: a file whose checksums match may still hold NaN or
    // infinity (they were computed over the bad values), and llama.cpp would run it silently.
    let (failures, non_finite) = f.check_tensors(&|_| {});
    if !failures.is_empty() {
        let names: Vec<&str> = failures.iter().map(|x| x.tensor.as_str()).collect();
        return Err(ConvertError::ChecksumMismatch {
            file: label,
            count: names.len(),
            tensors: names.join(", "),
        });
    }
    if let Some(n) = non_finite.into_iter().next() {
        return Err(kiln_format::FormatError::TensorNonFinite {
            file: label,
            tensor: n.tensor,
            count: n.count,
            first: n.first,
        }
        .into());
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
    if let Some((field, why)) = fused_family_mismatch(c) {
        return Err(export_error(
            &label,
            format!("a {} model's `{field}`", c.architecture.name()),
            format!("llama.cpp would run it differently: {why}"),
        ));
    }
    let gemma = c.architecture == Architecture::Gemma3;
    let mut notices = phi3_notices(c);

    let mut b = GgufBuilder::new();
    b.set("general.architecture", Value::Str(arch.into()));
    let name = opts
        .input
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into());
    b.set("general.name", Value::Str(name.clone()));
    for (k, v) in config_metadata(arch, c) {
        b.set(&k, v);
    }
    let (tok_kv, tok_notices) = tokenizer::to_gguf(&label, &meta.tokenizer, c)?;
    notices.extend(phi_name_notice(&name, &tok_kv));
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
        plans.push(Plan::computed("rope_freqs.weight", factors));
    }
    if let Some(RopeScaling::LongRope {
        long_factor,
        short_factor,
        ..
    }) = &c.rope_scaling
    {
        // One divisor per rotated pair, in f32 as llama.cpp's converter writes them.
        for (gguf_name, fs) in [
            (rope::LONGROPE_LONG, long_factor),
            (rope::LONGROPE_SHORT, short_factor),
        ] {
            plans.push(Plan::computed(
                gguf_name,
                fs.iter().map(|&x| x as f32).collect(),
            ));
        }
    }
    let mut widened = 0usize;
    let mut matrix_bytes: BTreeMap<DType, u64> = BTreeMap::new();
    let mut planned = vec![false; f.tensors().len()];
    for (i, info) in f.tensors().iter().enumerate() {
        if planned[i] {
            continue; // a part of a fused tensor planned with its first part
        }
        let tn = TensorName::parse(&info.name).ok_or_else(|| {
            export_error(
                &label,
                format!("tensor `{}`", info.name),
                "not a canonical Kiln tensor name, so its llama.cpp name is unknown",
            )
        })?;
        let gguf_name = names::source_name(Source::Gguf, c.architecture, tn);
        let sources = match names::fused_parts(Source::Gguf, c.architecture, &gguf_name) {
            None => vec![i],
            Some(parts) => parts
                .iter()
                .map(|part| {
                    let want = part.to_string();
                    f.tensors()
                        .iter()
                        .position(|t| t.name == want)
                        .ok_or_else(|| {
                            export_error(
                                &label,
                                format!("tensor `{}`", info.name),
                                format!(
                                    "llama.cpp's `{gguf_name}` holds it with `{want}`, which \
                                     the file lacks"
                                ),
                            )
                        })
                })
                .collect::<Result<Vec<_>>>()?,
        };
        let mut dims: Vec<u64> = info.shape.iter().rev().copied().collect();
        if let [_, rest @ ..] = sources.as_slice() {
            let mut rows = info.shape.first().copied().unwrap_or(0);
            for &j in rest {
                let x = &f.tensors()[j];
                if x.dtype.logical() != info.dtype.logical() || x.shape[1..] != info.shape[1..] {
                    return Err(export_error(
                        &label,
                        format!("tensor `{}`", x.name),
                        format!(
                            "it is {} {:?} and `{}` is {} {:?}, but llama.cpp holds both in \
                             `{gguf_name}`, one type and one row width (quantize them alike)",
                            x.dtype.name(),
                            x.shape,
                            info.name,
                            info.dtype.name(),
                            info.shape
                        ),
                    ));
                }
                rows += x.shape.first().copied().unwrap_or(0);
            }
            if let Some(last) = dims.last_mut() {
                *last = rows;
            }
        }
        for &j in &sources {
            planned[j] = true;
            if info.shape.len() == 2 {
                *matrix_bytes.entry(info.dtype.logical()).or_default() += f.tensors()[j].len;
            }
        }
        let plus_one = gemma && tn.role.is_norm();
        let widen = info.shape.len() == 1 && info.dtype != DType::F32;
        widened += if widen { sources.len() } else { 0 };
        let permute_heads = match tn.role {
            Role::AttnQ if permute => Some(c.num_heads as usize),
            Role::AttnK if permute => Some(c.num_kv_heads as usize),
            _ => None,
        };
        plans.push(Plan {
            sources,
            data: Vec::new(),
            gguf_name,
            ggml_type: GgmlType::of(if widen { DType::F32 } else { info.dtype }),
            dims,
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
    b.set("general.file_type", Value::U32(file_type(&matrix_bytes)));
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
    progress.start(total, f.tensors().len());
    let bytes_out = b.write(&opts.output, opts.overwrite, |i| {
        let p = &plans[i];
        if p.sources.is_empty() {
            return Ok(Cow::Owned(
                p.data.iter().flat_map(|x| x.to_le_bytes()).collect(),
            ));
        }
        let mut out: Option<Cow<[u8]>> = None;
        for &src in &p.sources {
            let info = &f.tensors()[src];
            let bytes = tensor_bytes(&f, info, p, &label)?;
            progress.advance(info.len, 1);
            out = Some(match out {
                None => bytes,
                Some(acc) => {
                    // The next part's rows after the previous ones.
                    let mut v = acc.into_owned();
                    v.extend_from_slice(&bytes);
                    Cow::Owned(v)
                }
            });
        }
        Ok(out.unwrap_or_default())
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

/// One `.kiln` tensor's bytes as `p` writes them: GGML's row-major layout, widened to F32 (and
/// `1 +` for Gemma norms) where `p` says, q/k rows reordered for llama.cpp's rope where it
/// says.
fn tensor_bytes<'f>(
    f: &'f KilnFile,
    info: &'f kiln_format::TensorInfo,
    p: &Plan,
    label: &str,
) -> Result<Cow<'f, [u8]>> {
    let view = f.view(info);
    let mut bytes = Cow::Borrowed(view.bytes());
    if info.dtype != info.dtype.logical() {
        // A Kiln-only layout: back to GGML's row-major blocks.
        let cols = info.shape.last().copied().unwrap_or(1) as usize;
        bytes = Cow::Owned(info.dtype.from_storage(cols, &bytes).into_owned());
    }
    if p.widen {
        let mut out = Vec::new();
        if info.dtype.is_quantized() {
            // A 1-D tensor in a block type: its values, which are f32s.
            let n = usize::try_from(info.shape.iter().product::<u64>()).map_err(|_| {
                export_error(
                    label,
                    format!("tensor `{}`", info.name),
                    "too large for this machine",
                )
            })?;
            let mut x = vec![0f32; n];
            decode_rows_f32(info.dtype.logical(), n, &bytes, &mut x);
            out.extend(x.iter().flat_map(|v| v.to_le_bytes()));
        } else {
            cast_bytes(info.dtype, DType::F32, &bytes, &mut out);
        }
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
            .map_err(|r| export_error(label, format!("tensor `{}`", info.name), r))?;
        let permuted = rope::permute_rows(&bytes, row_bytes as usize, n_head, Direction::ToGguf)
            .map_err(|r| export_error(label, format!("tensor `{}`", info.name), r))?;
        bytes = Cow::Owned(permuted);
    }
    Ok(bytes)
}

/// llama.cpp (`llama-vocab.cpp`) marks `</s>`, `<unk>`, `<s>` and `<|endoftext|>` as special
/// in any model whose `general.name` contains `phi3` or `phi-3`, and fails to load one whose
/// vocabulary lacks any of them. The name is the input file's stem, so the remedy is a rename.
fn phi_name_notice(name: &str, tok_kv: &[(String, Value)]) -> Option<String> {
    let lower = name.to_lowercase();
    if !(lower.contains("phi3") || lower.contains("phi-3")) {
        return None;
    }
    let tokens = tok_kv.iter().find_map(|(k, v)| match v {
        Value::Array(Array::Str(t)) if k == "tokenizer.ggml.tokens" => Some(t),
        _ => None,
    })?;
    let missing: Vec<&str> = ["</s>", "<unk>", "<s>", "<|endoftext|>"]
        .into_iter()
        .filter(|want| !tokens.iter().any(|t| t == want))
        .collect();
    (!missing.is_empty()).then(|| {
        format!(
            "general.name `{name}` names Phi-3, for which llama.cpp looks up {} in the \
             vocabulary and fails to load the file without them: rename the input file (its \
             stem is the name) to run it in llama.cpp",
            missing.join(", ")
        )
    })
}

/// What a user should know before running an exported Phi-3 model in llama.cpp: where its
/// graph, as it stands, departs from Kiln's and transformers' for a configuration the file
/// states faithfully.
fn phi3_notices(c: &ModelConfig) -> Vec<String> {
    let mut out = Vec::new();
    if c.architecture != Architecture::Phi3 {
        return out;
    }
    if let Some(w) = c.sliding_window {
        out.push(format!(
            "phi3.attention.sliding_window = {w} is written as llama.cpp's converter writes it, \
             but llama.cpp currently disables Phi-3's window and attends over the whole \
             context: its results differ from Kiln's past {w} tokens"
        ));
    }
    if let Some(RopeScaling::LongRope {
        original_max_position_embeddings: n,
        ..
    }) = &c.rope_scaling
    {
        out.push(format!(
            "llama.cpp applies LongRoPE's long factors at every position when its context \
             (--ctx-size, rounded up to a multiple of 256) exceeds {n}, the short ones \
             otherwise; Kiln and transformers choose by the length of the sequence in hand"
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mix(parts: &[(DType, u64)]) -> BTreeMap<DType, u64> {
        parts
            .iter()
            .map(|&(d, weights)| (d, weights / d.block_len() as u64 * d.block_bytes() as u64))
            .collect()
    }

    #[test]
    fn file_type_names_k_quant_mixes_as_llama_quantize_does() {
        // Gemma 3 270M's Q4_K_M file: the Q8_0 embedding is most of the bytes, Q5_0 stands in
        // for the matrices of 640-wide rows; Q4_K holds more weights than Q6_K.
        let gemma = mix(&[
            (DType::Q8_0, 262_144 * 640),
            (DType::Q5_0, 81 * 640 * 1024),
            (DType::Q4_K, 27 * 640 * 1536),
            (DType::Q6_K, 9 * 640 * 2048),
        ]);
        assert_eq!(file_type(&gemma), 15);
        let q5_k_m = mix(&[(DType::Q5_K, 1 << 20), (DType::Q6_K, 1 << 18)]);
        assert_eq!(file_type(&q5_k_m), 17);
        assert_eq!(file_type(&mix(&[(DType::Q6_K, 1 << 20)])), 18);
        // More Q6_K bytes than Q4_K bytes, but fewer weights: still Q4_K_M.
        let close = mix(&[(DType::Q4_K, 1_000_192), (DType::Q6_K, 700_160)]);
        assert!(close[&DType::Q6_K] > close[&DType::Q4_K]);
        assert_eq!(file_type(&close), 15);
        // Without K-quants, the dtype of most bytes.
        assert_eq!(
            file_type(&mix(&[(DType::Q5_0, 1 << 20), (DType::Q8_0, 1 << 10)])),
            8
        );
        assert_eq!(file_type(&mix(&[(DType::Q5_1, 1 << 20)])), 9);
        assert_eq!(
            file_type(&mix(&[(DType::Q4_0, 1 << 20), (DType::F16, 1 << 10)])),
            2
        );
        assert_eq!(file_type(&BTreeMap::new()), 0);
    }
}
