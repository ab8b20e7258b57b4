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
         SmolLM/SmolLM2, TinyLlama, Mistral, Qwen2/2.5)"
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
    #[error("{path}: tensor `{tensor}` has shape {found:?}, config.json implies {expected:?}")]
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
    /// Errors from the `.kiln` reader and writer.
    #[error(transparent)]
    Format(#[from] FormatError),
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
