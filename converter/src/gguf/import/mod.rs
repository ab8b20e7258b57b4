//! GGUF → `.kiln`: a llama.cpp model file as a Kiln model.
//!
//! The configuration is resolved from the architecture's hyperparameter keys, the tokenizer is
//! rebuilt as a `tokenizer.json` ([`super::tokenizer::from_gguf`]), and tensors get their
//! canonical names, Kiln's dimension order and (for the `llama` architecture) the Hugging Face
//! q/k row order back. Matrices of the GGML types Kiln stores (F32, F16, BF16, Q8_0, Q4_0,
//! Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) are kept byte for byte, except that Q4_0 matrices of whole
//! sixteen-row groups are stored as `q4_0x16` (IQ4_NL ones as `iq4_nlx16`; the same blocks, interleaved:
//! [`DType::storage_for`]), as `kiln-quantize` writes them, because that is the layout the
//! runner's one-token product reads. The block types Kiln decodes but does not store
//! ([`super::dequant::DEQUANTIZED`]: Q4_1) are dequantized to a float dtype (F16 unless asked
//! otherwise), and so is every block type with `dequantize_all`; 1-D tensors (norms, biases)
//! in a block type become f32, since the runner reads vectors as floats. Both are listed in the
//! summary and the provenance; anything else is refused, naming the type. A `gemma3` file
//! states less than Kiln's configuration holds: the rest is what llama.cpp assumes when it runs
//! one ([`kiln_format::family::GgufSpec`], [`config`]), and its norm weights lose the 1
//! llama.cpp's converter adds.

//!
//! An import runs in steps, one submodule each: [`config`] resolves and checks the
//! configuration, [`plan`] matches the file's tensors with the ones it implies and chooses each
//! one's dtype and bytes, [`write`] streams them into the `.kiln` file.

mod config;
mod plan;
mod write;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use kiln_format::DType;

use super::read::GgufFile;
use super::tokenizer;
use super::value::Value;
use crate::error::{ConvertError, Result};
use crate::Progress;

pub use config::checked_config;

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
    let config = config::resolve_config(&file, h, g.bytes())?;
    let arch = h
        .get("general.architecture")
        .and_then(Value::as_str)
        .unwrap_or("");
    let tokenizer =
        tokenizer::from_gguf(&file, &|k| h.get(k), arch, config.max_position_embeddings)?;
    crate::tokenizer_files::validate(&tokenizer, &file)?;
    let by_name = plan::resolve_tensors(&file, h, &config)?;
    config::check_config(&file, h, &config)?;
    let plan = plan::plan(&file, &config, by_name, opts)?;
    let written = write::write(&g, &file, config, tokenizer, &plan, opts, progress)?;
    Ok(ImportSummary {
        input: file,
        output: opts.output.display().to_string(),
        architecture: arch.to_string(),
        tensors: plan.tensors.len(),
        dtypes: written.dtypes,
        kept: plan.kept,
        dequantized: plan.dequantized,
        vectors_to_f32: plan.vectors_to_f32,
        bytes_out: written.bytes_out,
        seconds: start.elapsed().as_secs_f64(),
        non_finite: written.non_finite,
    })
}
