//! What to quantize, and how: the [`QuantizeOptions`] a run takes, and the [`TOOL`] name it
//! records.

use std::path::PathBuf;

use crate::importance::Importance;
use crate::method::Method;
use crate::policy::Policy;

/// The tool name and version recorded in provenance.
pub const TOOL: &str = concat!("kiln-quantize ", env!("CARGO_PKG_VERSION"));

/// What to quantize, and how.
#[derive(Debug, Clone)]
pub struct QuantizeOptions {
    /// The source `.kiln`.
    pub input: PathBuf,
    /// The destination `.kiln` (must differ from `input`).
    pub output: PathBuf,
    /// Which dtype each tensor gets.
    pub policy: Policy,
    /// How blocks choose their scale.
    pub method: Method,
    /// Worker threads; `None` uses rayon's default (all cores or `RAYON_NUM_THREADS`).
    pub threads: Option<usize>,
    /// Replace an existing output.
    pub overwrite: bool,
    /// Calibration statistics ([`Importance`]): per-column weights by tensor name steer the
    /// scale choice of those tensors' blocks. `None`: every weight is 1.
    pub importance: Option<Importance>,
}

impl QuantizeOptions {
    /// Options with the defaults: reference method, default threads, no overwrite.
    pub fn new(input: impl Into<PathBuf>, output: impl Into<PathBuf>, policy: Policy) -> Self {
        QuantizeOptions {
            input: input.into(),
            output: output.into(),
            policy,
            method: Method::Reference,
            threads: None,
            overwrite: false,
            importance: None,
        }
    }
}
