//! `.kiln` → GGUF: the model as current llama.cpp loads it.
//!
//! Metadata: `general.*`, the architecture's hyperparameters under its prefix (`llama.*`,
//! `qwen2.*`), and the tokenizer ([`super::tokenizer::to_gguf`]). Tensors: llama.cpp's names
//! (the one table in [`crate::names`]), dimensions in GGML order (innermost first), the q/k
//! rows reordered for llama.cpp's rope where the family's graph needs it ([`super::rope`]), the parts
//! llama.cpp keeps fused (Phi-3's `attn_qkv`, the `[gate; up]` `ffn_up` of Phi-3 and GLM)
//! stacked back by rows, and LongRoPE's factors as the `rope_factors_long`/`_short` tensors
//! llama.cpp reads them from. Matrices keep
//! their dtype byte for byte (Q8_0 and Q4_0 blocks are GGML's own layout), except Kiln's own
//! layouts, which GGML does not know: a `q4_0x16` (`iq4_nlx16`) matrix is de-interleaved to
//! GGML's Q4_0 (type 2; IQ4_NL, type 20), the same blocks row after row. 1-D tensors (norms, biases) are written as F32, as
//! llama.cpp's converter writes them and its CPU kernels expect.
//!
//! What differs by family is its row of [`kiln_format::FAMILIES`]: the architecture name,
//! whether q/k rows are reordered, the window key, what llama.cpp's graph hard-wires (checked
//! in [`llama_cpp`], which refuses a model llama.cpp would run differently). [`keys`] writes
//! the hyperparameters, [`tensors`] plans and encodes the tensors.

mod keys;
mod llama_cpp;
mod tensors;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;

use kiln_format::{KilnFile, ModelConfig};

use super::tokenizer;
use super::value::Value;
use super::write::GgufBuilder;
use crate::error::{ConvertError, Result};
use crate::Progress;

pub use keys::config_metadata;
pub use llama_cpp::{hard_wired_mismatch, sliding_layers_mismatch};
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

fn export_error(file: &str, what: impl Into<String>, reason: impl Into<String>) -> ConvertError {
    ConvertError::Export {
        file: file.to_string(),
        what: what.into(),
        reason: reason.into(),
    }
}

/// Export a `.kiln` file to GGUF.
pub fn export_gguf(opts: &ExportOptions, progress: &dyn Progress) -> Result<ExportSummary> {
    let start = Instant::now();
    kiln_format::refuse_output_is_input(&opts.output, [opts.input.as_path()])?;
    let f = KilnFile::open(&opts.input)?;
    let label = opts.input.display().to_string();
    check_values(&f, &label)?;
    let meta = f.metadata();
    let c = &meta.config;
    check_llama_cpp_runs_it(c, &label)?;
    let arch = llama_cpp::gguf_name(c);
    let mut notices = llama_cpp::notices(c);

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
    notices.extend(llama_cpp::phi_name_notice(&name, &tok_kv));
    for (k, v) in tok_kv {
        b.set(&k, v);
    }
    notices.extend(tok_notices);

    let tensors::Tensors {
        plans,
        widened,
        matrix_bytes,
    } = tensors::plan(&f, c, &label)?;
    if widened > 0 {
        notices.push(format!(
            "{widened} 1-D tensor(s) (norms, biases) widened to F32, as llama.cpp expects"
        ));
    }
    b.set(
        "general.file_type",
        Value::U32(keys::file_type(&matrix_bytes)),
    );
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
        tensors::data(&f, &plans[i], &label, progress)
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

/// Checksums and values in one pass: a file whose checksums match may still hold NaN or
/// infinity (they were computed over the bad values), and llama.cpp would run it silently.
fn check_values(f: &KilnFile, label: &str) -> Result<()> {
    let (failures, non_finite) = f.check_tensors(&|_| {});
    if !failures.is_empty() {
        let names: Vec<&str> = failures.iter().map(|x| x.tensor.as_str()).collect();
        return Err(ConvertError::ChecksumMismatch {
            file: label.to_string(),
            count: names.len(),
            tensors: names.join(", "),
        });
    }
    if let Some(n) = non_finite.into_iter().next() {
        return Err(kiln_format::FormatError::TensorNonFinite {
            file: label.to_string(),
            tensor: n.tensor,
            count: n.count,
            first: n.first,
        }
        .into());
    }
    Ok(())
}

/// Refuse a model llama.cpp would run differently from Kiln: one whose family's sliding
/// layers or hard-wired options it departs from.
fn check_llama_cpp_runs_it(c: &ModelConfig, label: &str) -> Result<()> {
    let what = |field: Option<&str>| match field {
        None => format!("a {} model", c.architecture.name()),
        Some(field) => format!("a {} model's `{field}`", c.architecture.name()),
    };
    if let Some((field, why)) = llama_cpp::embedding_mismatch(c) {
        return Err(export_error(label, what(Some(field)), why));
    }
    if let Some(layers) = &c.architecture.spec().sliding_layers {
        if let Some(why) = sliding_layers_mismatch(c, layers) {
            return Err(export_error(
                label,
                what(None),
                format!("llama.cpp would run it differently: {why}"),
            ));
        }
    }
    if let Some((field, why)) = hard_wired_mismatch(c) {
        return Err(export_error(
            label,
            what(Some(field)),
            format!("llama.cpp would run it differently: {why}"),
        ));
    }
    Ok(())
}
