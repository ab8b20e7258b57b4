//! The one error type of the quantizer.
//!
//! Every variant names the file and, where there is one, the tensor and element at fault, so the
//! message printed once by `main` is enough to act on.

use kiln_format::{DType, FormatError};

/// Everything that can go wrong turning a `.kiln` into a smaller one.
#[derive(Debug, thiserror::Error)]
pub enum QuantizeError {
    /// Reading, validating or writing a `.kiln` failed (the message names the file).
    #[error(transparent)]
    Format(#[from] FormatError),
    /// An operating-system error while reading the input.
    #[error("{file}: {action}: {source}")]
    Io {
        file: String,
        action: &'static str,
        #[source]
        source: std::io::Error,
    },
    /// A `--keep` argument that does not parse.
    #[error("--keep `{arg}`: {reason}")]
    BadOverride { arg: String, reason: String },
    /// A target dtype that the command does not produce.
    #[error(
        "--to {dtype}: the target must be one of f16, q8_0, q4_0, q5_0, q5_1, q2_k, q3_k, q4_k, \
         q5_k, q6_k, iq4_nl, iq4_xs, or a mix: q2_k_mix, q3_k_s, q3_k_m, q3_k_l, q4_k_s, q4_k_m, \
         q5_k_s, q5_k_m, iq4_nl_mix, iq4_xs_mix"
    )]
    BadTarget { dtype: String },
    /// An override pattern that matched no tensor (almost always a typo).
    #[error(
        "{file}: --keep pattern `{pattern}` matches no tensor; canonical names look like \
         `layers.3.attn.q.weight`, `embed.weight`, `lm_head.weight`"
    )]
    UnmatchedOverride { file: String, pattern: String },
    /// A tensor that is already block-quantized and would be quantized again.
    #[error(
        "{file}: tensor `{tensor}` is already {from}; re-quantizing it to {to} would compound \
         the error. Quantize from the F32/F16/BF16 file, or keep it as is with \
         --keep '{tensor}=copy'"
    )]
    AlreadyQuantized {
        file: String,
        tensor: String,
        from: DType,
        to: DType,
    },
    /// A NaN or infinity in the input data.
    #[error(
        "{file}: tensor `{tensor}`: non-finite value {value} at element {position} \
         (row {row}, column {column}); the source model is corrupt or was exported wrongly"
    )]
    NonFinite {
        file: String,
        tensor: String,
        position: u64,
        row: u64,
        column: u64,
        value: f32,
    },
    /// A finite value too large for F16 (it would become infinity).
    #[error(
        "{file}: tensor `{tensor}`: value {value} at element {position} (row {row}, column \
         {column}) is outside the f16 range (±65504); keep this tensor wider, e.g. \
         --keep '{tensor}=bf16'"
    )]
    F16Overflow {
        file: String,
        tensor: String,
        position: u64,
        row: u64,
        column: u64,
        value: f32,
    },
    /// A block whose f16 scale would be infinite.
    #[error(
        "{file}: tensor `{tensor}`: the block at element {position} (row {row}, column {column}) \
         has magnitude {value}, too large for an f16 block scale; keep this tensor wider, e.g. \
         --keep '{tensor}=bf16'"
    )]
    ScaleOverflow {
        file: String,
        tensor: String,
        position: u64,
        row: u64,
        column: u64,
        value: f32,
    },
    /// Importance weights whose length does not match the tensor's rows.
    #[error(
        "tensor `{tensor}`: {found} importance weights given, the rows have {expected} columns"
    )]
    ImportanceLength {
        tensor: String,
        expected: u64,
        found: u64,
    },
    /// An importance file that cannot be used.
    #[error("{file}: not a usable importance file: {reason}")]
    BadImportance { file: String, reason: String },
    /// Importance measured on another model, or missing for a matrix.
    #[error("{file}: {reason}")]
    ImportanceMismatch { file: String, reason: String },
    /// The calibration pass could not run the model.
    #[error("{file}: calibration cannot run the model: {reason}")]
    Calibration { file: String, reason: String },
    /// The calibration text is unusable.
    #[error("calibration text: {reason}")]
    CalibrationText { reason: String },
    /// The thread pool could not be built.
    #[error("{file}: --to auto: {reason}")]
    Budget { file: String, reason: String },

    #[error("{arg}: {reason}")]
    BadArgument { arg: String, reason: String },

    /// The caller asked the run to stop ([`crate::Progress::stop_requested`]).
    #[error("stopped at the caller's request; no output was written")]
    Stopped,

    #[error("cannot start {threads} worker threads: {reason}")]
    ThreadPool { threads: usize, reason: String },
}

/// Result alias for the quantizer.
pub type Result<T, E = QuantizeError> = std::result::Result<T, E>;
