//! `kiln-quantize`: turn a converted `.kiln` (F32/F16/BF16 tensors) into a smaller `.kiln`.
//!
//! How the pieces connect:
//!
//! - [`Policy`] ([`policy`]) decides each tensor's output dtype from its canonical role and the
//!   `--keep PATTERN=DTYPE` [`Override`]s: matrices to the `--to` dtype or by llama.cpp's
//!   Q4_K_M/Q5_K_M rules ([`policy::Mix`]), vectors to F32, rows that do not fit the blocks to
//!   llama.cpp's fallback types; and how the output stores it ([`Decision::storage`]: a
//!   Q4_0 matrix of whole sixteen-row groups as `q4_0x16`, the runner's one-token layout).
//! - [`Method`] ([`method`]) turns one block of 32 values into GGML's Q8_0/Q4_0 layout: the
//!   bit-exact GGML reference rule or a least-squares scale search, both taking optional
//!   per-column importance weights.
//! - [`rows::convert_rows`] converts whole rows to any dtype (`q4_0x16` for whole
//!   sixteen-row groups; Q5_0, Q5_1, Q4_K, Q5_K and Q6_K by the format crate's bit-exact GGML
//!   references `kiln_format::{q5, kquants}`), rejecting NaN/Inf, and
//!   accumulates the round-trip [`ErrorStats`] in the same pass. GGML's reference rule and bf16
//!   decoding are the kernels crate's dispatched SIMD kernels (`kiln_kernels::quantize_blocks`,
//!   `kiln_kernels::decode_bf16`, one `KILN_ISA` switch for every program).
//! - [`quantize_file`] ([`pipeline`]) streams a file through them: positioned reads of chunks of
//!   rows, rayon over tensors and chunks, the format crate's atomic checksumming `KilnWriter`,
//!   and a provenance step recording what was done. It reports progress through the
//!   [`Progress`] trait and returns a [`Report`] ([`report`]): per-tensor RMSE, max abs error and
//!   SNR, and the totals.
//!
//! The binary (`src/main.rs`) only parses arguments, draws the progress bar and prints the
//! report. The policy is documented in `docs/QUANTIZE.md`.

pub mod budget;
pub mod calibrate;
pub mod error;
pub mod gptq;
pub mod importance;
pub mod method;
pub mod pipeline;
pub mod policy;
pub mod refit;
pub mod report;
pub mod rows;
pub mod sensitivity;

pub use error::{QuantizeError, Result};
pub use kiln_kernels::ErrorStats;
pub use method::Method;
pub use pipeline::{quantize_file, NoProgress, Progress, QuantizeOptions, CHUNK_ELEMENTS, TOOL};
pub use policy::{Action, Decision, Override, Policy, Target};
pub use report::{Report, TensorReport};
