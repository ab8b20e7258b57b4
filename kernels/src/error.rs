//! Errors raised when building kernel inputs.

use thiserror::Error;

/// Why a [`crate::Matrix`] or [`crate::Pool`] could not be built.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum KernelError {
    /// The element (or block) count does not match `rows × cols`.
    #[error("weight data has {found} {unit}, but a {rows}×{cols} matrix needs {expected}")]
    LengthMismatch {
        /// Output features.
        rows: usize,
        /// Input features.
        cols: usize,
        /// Elements or blocks required.
        expected: usize,
        /// Elements or blocks supplied.
        found: usize,
        /// "elements" or "blocks".
        unit: &'static str,
    },
    /// Block-quantized rows must hold whole 32-weight blocks.
    #[error("{dtype} matrix has {cols} columns, which is not a multiple of 32; quantize only tensors whose rows are whole blocks")]
    ColsNotBlockMultiple {
        /// Weight encoding name.
        dtype: &'static str,
        /// Input features.
        cols: usize,
    },
    /// Q5_0/Q5_1 rows hold whole 32-weight blocks, K-quant rows whole 256-weight super-blocks.
    #[error("{dtype} matrix has {cols} columns, which is not a multiple of its {block}-weight blocks; store such tensors in a type whose blocks divide the rows (GGML's mixes use q5_0 or q8_0)")]
    ColsNotBlockLenMultiple {
        /// Weight encoding name.
        dtype: &'static str,
        /// Input features.
        cols: usize,
        /// Weights per block of the encoding.
        block: usize,
    },
    /// The interleaved layouts (`q4_0x16`, `iq4_nlx16`) hold whole groups of sixteen rows.
    #[error("{dtype} matrix has {rows} rows, which is not a multiple of 16; store it as {plain}")]
    RowsNotGroupMultiple {
        /// Weight encoding name.
        dtype: &'static str,
        /// The plain layout of the same blocks.
        plain: &'static str,
        /// Output features.
        rows: usize,
    },
    /// `rows × cols` overflows `usize`.
    #[error("matrix shape {rows}×{cols} overflows")]
    ShapeOverflow {
        /// Output features.
        rows: usize,
        /// Input features.
        cols: usize,
    },
    /// A pool needs at least one thread.
    #[error("a thread pool needs at least one thread (got 0)")]
    ZeroThreads,
    /// The operating system refused to start the pool's threads.
    #[error("could not start a {threads}-thread pool: {reason}")]
    PoolBuild {
        /// Requested thread count.
        threads: usize,
        /// The underlying error, as text.
        reason: String,
    },
}
