//! The converter's one error type. Every message names the file, field or tensor at fault.

use kiln_format::FormatError;

/// Everything that can stop a conversion or an inspection.
#[derive(Debug, thiserror::Error)]
pub enum ConvertError {
    /// The input directory or one of its files cannot be read.
    #[error("{path}: {action}: {source}")]
    Io {
        path: String,
        action: &'static str,
        #[source]
        source: std::io::Error,
    },
    /// A required file is missing from the checkpoint directory.
    #[error("{dir}: no {file}; {hint}")]
    MissingFile {
        dir: String,
        file: String,
        hint: &'static str,
    },
    /// A JSON file that does not parse.
    #[error("{path}: invalid JSON: {reason}")]
    Json { path: String, reason: String },
    /// A `config.json` field that is missing, of the wrong type, or out of range.
    #[error("{path}: field `{field}`: {reason}")]
    ConfigField {
        path: String,
        field: String,
        reason: String,
    },
    /// An architecture Kiln does not implement.
    #[error(
        "{path}: architecture `{found}` is not supported; supported: {supported} (Llama 2/3, \
         SmolLM/SmolLM2, TinyLlama, Mistral, Qwen2/2.5, Qwen3, Gemma 3 text)"
    )]
    UnsupportedArchitecture {
        path: String,
        found: String,
        supported: String,
    },
    /// A safetensors file that cannot be parsed.
    #[error("{path}: not a valid safetensors file: {reason}")]
    Safetensors { path: String, reason: String },
    /// The shard index names a file that does not exist, or disagrees with the shards.
    #[error("{path}: {reason}")]
    ShardIndex { path: String, reason: String },
    /// A tensor with a name no table entry knows.
    #[error(
        "{path}: tensor `{tensor}` is not part of a {arch} checkpoint Kiln knows how to convert"
    )]
    UnknownTensor {
        path: String,
        tensor: String,
        arch: String,
    },
    /// A tensor the configuration requires is absent.
    #[error("{dir}: missing tensor `{tensor}` (expected shape {expected:?})")]
    MissingTensor {
        dir: String,
        tensor: String,
        expected: Vec<u64>,
    },
    /// A tensor whose shape disagrees with `config.json`.
    #[error("{path}: tensor `{tensor}` has shape {found:?}, the model configuration (config.json or GGUF metadata) implies {expected:?}")]
    ShapeMismatch {
        path: String,
        tensor: String,
        found: Vec<u64>,
        expected: Vec<u64>,
    },
    /// A tensor stored twice (two shards, or an HF and a duplicate spelling).
    #[error("tensor `{tensor}` appears twice: in {first} and in {second}")]
    DuplicateTensor {
        tensor: String,
        first: String,
        second: String,
    },
    /// A tensor of an element type the converter does not take.
    #[error(
        "{path}: tensor `{tensor}` has dtype {dtype}; Kiln converts F32, F16 and BF16 tensors"
    )]
    UnsupportedDtype {
        path: String,
        tensor: String,
        dtype: String,
    },
    /// A file that does not start with the GGUF magic.
    #[error("{file}: not a GGUF file (the first 4 bytes are {found}, expected \"GGUF\")")]
    GgufBadMagic { file: String, found: String },
    /// A GGUF version Kiln does not read.
    #[error(
        "{file}: GGUF version {version} is not supported (Kiln reads versions 2 and 3{})",
        if *byte_swapped { "; this looks like a big-endian GGUF file, which Kiln does not read" } else { "" }
    )]
    GgufVersion {
        file: String,
        version: u32,
        byte_swapped: bool,
    },
    /// The GGUF file ends inside a field it declares.
    #[error(
        "{file}: truncated GGUF: {what} needs {need} bytes at offset {offset}, the file is {len} \
         bytes long"
    )]
    GgufTruncated {
        file: String,
        what: String,
        offset: u64,
        need: u64,
        len: u64,
    },
    /// A count or length in a GGUF file beyond what Kiln accepts.
    #[error("{file}: GGUF {what} is {value}, more than the {limit} Kiln accepts")]
    GgufLimit {
        file: String,
        what: String,
        value: u64,
        limit: u64,
    },
    /// A structurally invalid GGUF file (bad value type, nested array, duplicate key, …).
    #[error("{file}: invalid GGUF at byte {offset}: {reason}")]
    GgufMalformed {
        file: String,
        offset: u64,
        reason: String,
    },
    /// A GGUF tensor-table entry that does not make sense.
    #[error("{file}: GGUF tensor `{tensor}`: {reason}")]
    GgufTensor {
        file: String,
        tensor: String,
        reason: String,
    },
    /// A GGUF metadata key that is missing or holds the wrong kind of value.
    #[error("{file}: GGUF metadata `{key}`: {reason}")]
    GgufKey {
        file: String,
        key: String,
        reason: String,
    },
    /// A GGUF tensor type Kiln can neither keep nor dequantize.
    #[error(
        "{file}: tensor `{tensor}` has GGML type {ggml_type}, which Kiln cannot import; \
         supported: {kept} (kept), {dequantized} (dequantized); requantize the model with \
         llama.cpp's llama-quantize to one of these"
    )]
    UnsupportedGgufType {
        file: String,
        tensor: String,
        ggml_type: String,
        kept: String,
        dequantized: String,
    },
    /// A tokenizer Kiln cannot carry between `tokenizer.json` and GGUF.
    #[error("{file}: tokenizer: {reason}")]
    UnsupportedTokenizer { file: String, reason: String },
    /// A source tensor holding NaN or infinity: a model that would stop after one token.
    #[error(
        "{file}: tensor `{tensor}` holds {count} non-finite value(s) (NaN or infinity), the \
         first at element {index}; the checkpoint is damaged (pass --allow-non-finite to \
         convert it anyway)"
    )]
    NonFinite {
        file: String,
        tensor: String,
        index: usize,
        count: usize,
    },
    /// A chat template that does not compile (a syntax error), found at conversion rather
    /// than at the first chat.
    #[error("{file}: chat template: {reason}; fix the template or remove it")]
    BadChatTemplate { file: String, reason: String },
    /// A `.kiln` file that cannot be written as GGUF.
    #[error("{file}: cannot export {what} to GGUF: {reason}")]
    Export {
        file: String,
        what: String,
        reason: String,
    },
    /// Errors from the `.kiln` reader and writer.
    #[error(transparent)]
    Format(#[from] FormatError),
    /// An option that does not apply, or a value it does not take.
    #[error("{option}: {reason}")]
    BadOption { option: String, reason: String },
    /// Checksums that do not match (from `inspect --verify`).
    #[error("{file}: {count} tensor checksum(s) do not match: {tensors}")]
    ChecksumMismatch {
        file: String,
        count: usize,
        tensors: String,
    },
}

/// Result alias for the converter.
pub type Result<T, E = ConvertError> = std::result::Result<T, E>;

impl ConvertError {
    pub(crate) fn io(path: &std::path::Path, action: &'static str, source: std::io::Error) -> Self {
        ConvertError::Io {
            path: path.display().to_string(),
            action,
            source,
        }
    }

    pub(crate) fn field(path: &std::path::Path, field: &str, reason: impl Into<String>) -> Self {
        ConvertError::ConfigField {
            path: path.display().to_string(),
            field: field.to_string(),
            reason: reason.into(),
        }
    }
}
