//! The verifier's one error type: everything that stops a check from running (exit status 2).
//! A check that runs and finds numbers out of tolerance is not an error; it is a report.

use kiln_format::FormatError;
use kiln_runner::RunnerError;

/// Why a verification could not run.
#[derive(Debug, thiserror::Error)]
pub enum VerifyError {
    /// A reference dump that is not the documented safetensors layout.
    #[error("{path}: {reason}")]
    BadDump { path: String, reason: String },
    /// A saved-logits file that does not fit the model or text being compared.
    #[error("{path}: {reason}")]
    BadLogits { path: String, reason: String },
    /// Two models that cannot be compared tensor by tensor.
    #[error("cannot compare {a} with {b}: {reason}")]
    Incompatible {
        a: String,
        b: String,
        reason: String,
    },
    /// A text too short for the requested perplexity protocol.
    #[error("{path}: {reason}")]
    Text { path: String, reason: String },
    /// A bad command-line value.
    #[error("{0}")]
    Usage(String),
    /// The `.kiln` reader.
    #[error(transparent)]
    Format(#[from] FormatError),
    /// The runner.
    #[error(transparent)]
    Runner(#[from] RunnerError),
}

/// Result alias for the verifier.
pub type Result<T, E = VerifyError> = std::result::Result<T, E>;
