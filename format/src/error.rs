//! The one error type of the format crate.
//!
//! Every variant carries the file it is about and, where there is one, the tensor or header
//! field at fault, so that a message printed once at the top of a program is enough to act on.

use std::io;
use std::path::Path;

/// Everything that can go wrong reading, validating or writing a `.kiln` file.
#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    /// An operating-system error while touching `file`.
    #[error("{file}: {action}: {source}")]
    Io {
        file: String,
        action: &'static str,
        #[source]
        source: io::Error,
    },
    /// The first bytes are not the `.kiln` magic.
    #[error("{file}: not a .kiln file (the first 8 bytes are {found}, expected {expected})")]
    BadMagic {
        file: String,
        found: String,
        expected: String,
    },
    /// A major version this build does not read.
    #[error(
        "{file}: .kiln format version {major}.{minor} is not supported; this build reads major \
         version {supported} (any minor); upgrade Kiln to read this file"
    )]
    UnsupportedVersion {
        file: String,
        major: u16,
        minor: u16,
        supported: u16,
    },
    /// The file ends before a section it declares.
    #[error(
        "{file}: truncated: {what} needs bytes {start}..{end} but the file is {len} bytes long"
    )]
    Truncated {
        file: String,
        what: String,
        start: u64,
        end: u64,
        len: u64,
    },
    /// A fixed-header field holds an impossible value.
    #[error("{file}: header field `{field}` is invalid: {reason}")]
    BadHeader {
        file: String,
        field: &'static str,
        reason: String,
    },
    /// The header checksum does not match the header, metadata and index bytes.
    #[error(
        "{file}: header checksum mismatch (stored {stored}, computed {computed}): the header, \
         metadata or tensor index is corrupt; re-create the file"
    )]
    HeaderChecksum {
        file: String,
        stored: String,
        computed: String,
    },
    /// The metadata section is not the JSON document the spec describes.
    #[error("{file}: metadata field `{field}`: {reason}")]
    BadMetadata {
        file: String,
        field: String,
        reason: String,
    },
    /// A model of an architecture this build does not implement (a newer Kiln's file, or a
    /// crafted one): named, with the list this build runs.
    #[error(
        "{file}: unsupported architecture `{found}`; this build runs {supported}; convert a \
         supported model or upgrade Kiln"
    )]
    UnsupportedArchitecture {
        file: String,
        found: String,
        supported: String,
    },
    /// A tensor-index entry that cannot be parsed (its name may not be known yet).
    #[error("{file}: tensor index entry #{entry}: {reason}")]
    BadIndexEntry {
        file: String,
        entry: usize,
        reason: String,
    },
    /// A tensor whose index entry parses but does not make sense.
    #[error("{file}: tensor `{tensor}`: {reason}")]
    BadTensor {
        file: String,
        tensor: String,
        reason: String,
    },
    /// A tensor's bytes do not hash to the stored sha256.
    #[error(
        "{file}: tensor `{tensor}`: checksum mismatch (stored sha256 {stored}, computed {computed}): \
         the tensor data is corrupt; re-create or re-download the file"
    )]
    TensorChecksum {
        file: String,
        tensor: String,
        stored: String,
        computed: String,
    },
    /// A tensor holding NaN or infinity in a file whose checksums match (they were computed
    /// over the bad values): the model would produce garbage or stop after one token.
    #[error(
        "{file}: tensor `{tensor}`: {count} value(s) are NaN or infinite (the first at element \
         {first}): the file holds NaN/Inf weights; `kiln-verify integrity {file}` lists every \
         such tensor; re-create the file from a finite checkpoint"
    )]
    TensorNonFinite {
        file: String,
        tensor: String,
        count: usize,
        first: usize,
    },
    /// A tensor was asked for by name and is not in the file.
    #[error("{file}: no tensor named `{tensor}`")]
    TensorNotFound { file: String, tensor: String },
    /// A typed view of the wrong dtype was asked for.
    #[error("{file}: tensor `{tensor}` is {actual}, but {expected} was requested")]
    DTypeMismatch {
        file: String,
        tensor: String,
        expected: String,
        actual: String,
    },
    /// The output exists and overwriting was not allowed.
    #[error("{file}: already exists; pass --force to overwrite it")]
    AlreadyExists { file: String },
    /// An input path that is not a file (a directory, a device, a FIFO, a socket). `what` is
    /// what it is, with its article ("a socket"); `expected`, like every `what` naming an input
    /// below, is what it should be as read after "the" ("importance file", "prompt").
    #[error("{file}: is {what}, not a file; give the path of the {expected}")]
    NotAFile {
        file: String,
        what: &'static str,
        expected: &'static str,
    },
    /// An input file larger than what the program reads of that kind.
    #[error(
        "{file}: {size} bytes is over the limit of {limit} bytes for the {what}; \
         give a smaller file"
    )]
    InputTooLarge {
        file: String,
        what: &'static str,
        size: u64,
        limit: u64,
    },
    /// An input text that is not UTF-8.
    #[error("{file}: the {what} is not UTF-8 (invalid byte sequence at byte {offset})")]
    NotUtf8 {
        file: String,
        what: &'static str,
        offset: usize,
    },
    /// Two outputs of one run are the same file.
    #[error("{file}: named as two outputs ({other}); give each output its own path")]
    OutputsCollide { file: String, other: String },
    /// The destination exists and is not a regular file (a directory, a device, a pipe):
    /// `--force` replaces files, never anything else.
    #[error("{file}: exists and is not a regular file; choose a file path as the output")]
    NotARegularFile { file: String },
    /// The output would replace one of the files the program is reading.
    #[error(
        "{file}: the output is also an input ({input}); write to another path \
         (the input is read while the output is written)"
    )]
    OutputIsInput { file: String, input: String },
    /// More tensors declared than an index may hold.
    #[error("{file}: {count} tensors exceed the limit of {limit}")]
    TooManyTensors {
        file: String,
        count: usize,
        limit: u32,
    },
    /// A tensor name the index cannot hold.
    #[error(
        "{file}: tensor `{tensor}`: the name must be 1 to {max} bytes without control characters"
    )]
    BadTensorName {
        file: String,
        tensor: String,
        max: u32,
    },
    /// Two tensors declared under one name.
    #[error("{file}: tensor `{tensor}`: the name is declared twice")]
    DuplicateTensor { file: String, tensor: String },
    /// A declared shape the format cannot hold, or that does not fit its dtype's blocks.
    #[error("{file}: tensor `{tensor}`: {dtype} {shape:?}: {reason}")]
    BadShape {
        file: String,
        tensor: String,
        dtype: crate::DType,
        shape: Vec<u64>,
        reason: String,
    },
    /// The tensor index would pass its size limit.
    #[error("{file}: the tensor index needs {bytes} bytes, over the limit of {limit}")]
    IndexTooLarge {
        file: String,
        bytes: u64,
        limit: u64,
    },
    /// Tensor offsets that would pass 64 bits.
    #[error("{file}: the data section overflows 64 bits")]
    DataOverflow { file: String },
    /// A tensor number past those declared.
    #[error("{file}: tensor #{index}: only {declared} tensors were declared")]
    NoSuchTensor {
        file: String,
        index: usize,
        declared: usize,
    },
    /// A tensor written a second time.
    #[error("{file}: tensor `{tensor}`: written twice")]
    WrittenTwice { file: String, tensor: String },
    /// A declared tensor never written when the file was finished.
    #[error("{file}: tensor `{tensor}`: declared but never written")]
    NeverWritten { file: String, tensor: String },
    /// Bytes written for a tensor that do not add up to its declared length.
    #[error("{file}: tensor `{tensor}`: {written} bytes written, {expected} expected")]
    WrongLength {
        file: String,
        tensor: String,
        written: u64,
        expected: u64,
    },
    /// A row handed to a block quantizer whose length is not whole blocks.
    #[error("row length {len} is not a multiple of {block}")]
    RowLength { len: usize, block: usize },
    /// Values that cannot be quantized (NaN or infinity).
    #[error("non-finite value {value} at element {position} cannot be quantized")]
    NonFinite { position: usize, value: f32 },
    /// Importance weights handed to a weighted quantizer that are not one per value.
    #[error("{len} importance weights for a row of {expected} values")]
    ImportanceLength { len: usize, expected: usize },
    /// An importance weight that is negative, NaN or infinite.
    #[error("importance weight {value} at element {position} is not finite and non-negative")]
    BadImportance { position: usize, value: f32 },
}

/// Result alias for the format crate.
pub type Result<T, E = FormatError> = std::result::Result<T, E>;

impl FormatError {
    pub(crate) fn io(path: &Path, action: &'static str, source: io::Error) -> Self {
        FormatError::Io {
            file: path.display().to_string(),
            action,
            source,
        }
    }
}
