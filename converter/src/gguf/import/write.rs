//! The `.kiln` file an import writes: the metadata (configuration, tokenizer, provenance
//! naming what was kept and what dequantized) and the planned tensors, decoded, reordered and
//! cast where the plan says, from many threads.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::sync::Mutex;

use kiln_format::metadata::now_rfc3339;
use kiln_format::values::{cast_bytes, count_non_finite};
use kiln_format::{
    DType, KilnWriter, Metadata, ModelConfig, ProvenanceStep, TensorSpec, TokenizerFiles,
};
use rayon::prelude::*;
use serde_json::json;

use super::super::dequant::dequantize;
use super::super::read::GgufFile;
use super::super::rope::{self, Direction};
use super::super::value::Value;
use super::plan::{Plan, Planned};
use super::ImportOptions;
use crate::error::{ConvertError, Result};
use crate::hf::sha256_file;
use crate::Progress;

/// What writing produced, for the summary.
pub(super) struct Written {
    /// Tensors written per dtype.
    pub(super) dtypes: BTreeMap<String, usize>,
    /// Size of the output file.
    pub(super) bytes_out: u64,
    /// Tensors holding NaN or infinity, sorted.
    pub(super) non_finite: Vec<String>,
}

/// The metadata: `config`, the tokenizer, and a provenance step naming the source file and
/// what the plan did to each GGML type.
fn metadata(
    g: &GgufFile,
    config: ModelConfig,
    tokenizer: TokenizerFiles,
    plan: &Plan,
    opts: &ImportOptions,
) -> Result<Metadata> {
    let h = g.header();
    let source_name = opts
        .input
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let source = sha256_file(&opts.input, &source_name)?;
    Ok(Metadata {
        config,
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
                    "kept": plan.kept,
                    "dequantized": plan.dequantized,
                    "dequantized_to": opts.dequantize_to.name(),
                    "vectors_to_f32": plan.vectors_to_f32,
                }
            }),
            sources: vec![source],
        }],
    })
}

/// Write the `.kiln` file `plan` describes.
pub(super) fn write(
    g: &GgufFile,
    file: &str,
    config: ModelConfig,
    tokenizer: TokenizerFiles,
    plan: &Plan,
    opts: &ImportOptions,
    progress: &dyn Progress,
) -> Result<Written> {
    let planned = &plan.tensors;
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
    let metadata = metadata(g, config, tokenizer, plan, opts)?;
    let writer = KilnWriter::create(&opts.output, &metadata, specs, opts.overwrite)?;
    let total: u64 = planned.iter().map(|p| p.bytes.len() as u64).sum();
    progress.start(total, planned.len());
    let non_finite = Mutex::new(Vec::new());
    planned
        .par_iter()
        .enumerate()
        .try_for_each(|(i, p)| -> Result<()> {
            let (bytes, dtype) = decoded(g, file, p, opts, &non_finite)?;
            let t = p.tensor;
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
    let mut non_finite = non_finite.into_inner().unwrap_or_else(|e| e.into_inner());
    non_finite.sort();
    Ok(Written {
        dtypes,
        bytes_out: summary.file_len,
        non_finite,
    })
}

/// `p`'s bytes in Kiln's row order, and their dtype: as the file holds them when the plan
/// keeps the type, else dequantized to f32 (less the 1 of a `(1 + w)` norm weight). Values
/// that are NaN or infinite are refused, or listed in `non_finite` when allowed.
fn decoded<'g>(
    g: &'g GgufFile,
    file: &str,
    p: &Planned,
    opts: &ImportOptions,
    non_finite: &Mutex<Vec<String>>,
) -> Result<(Cow<'g, [u8]>, DType)> {
    let t = p.tensor;
    let raw = g.tensor_bytes(t).get(p.bytes.clone()).unwrap_or_default();
    let bad = |reason: String| ConvertError::GgufTensor {
        file: file.to_string(),
        tensor: t.name.clone(),
        reason,
    };
    let (bytes, dtype) = if t.ggml_type.kiln_dtype() == Some(p.dtype.logical()) && !p.minus_one {
        (Cow::Borrowed(raw), p.dtype.logical())
    } else {
        let mut x = Vec::new();
        dequantize(t.ggml_type, raw, &mut x).ok_or_else(|| bad("cannot dequantize".into()))?;
        if p.minus_one {
            // In f32, as transformers' GGUF loader subtracts it.
            x.iter_mut().for_each(|v| *v -= 1.0);
        }
        let f32s: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
        (Cow::Owned(f32s), DType::F32)
    };
    // The values as the file holds them (dequantized where they were), before any row
    // reordering: the element index is the GGUF tensor's own.
    if let (count @ 1.., Some(index)) = count_non_finite(dtype, &bytes) {
        let index = index + p.first_element;
        if !opts.allow_non_finite {
            return Err(ConvertError::NonFinite {
                file: file.to_string(),
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
            Cow::Owned(rope::permute_rows(&bytes, row, n, Direction::FromGguf).map_err(bad)?)
        }
    };
    Ok((bytes, dtype))
}
