//! `kiln-quantize`: turn a converted `.kiln` (F32/F16/BF16 tensors) into a smaller `.kiln`.
//!
//! How the pieces connect:
//!
//! - [`Policy`] ([`policy`]) decides each tensor's output dtype from its canonical role and the
//!   `--keep PATTERN=DTYPE` [`Override`]s: matrices to the `--to` dtype or by llama.cpp's
//!   Q4_K_M/Q5_K_M rules ([`policy::Mix`]), vectors to F32, rows that do not fit the blocks to
//!   llama.cpp's fallback types; and how the output stores it ([`Decision::storage`]: a
//!   Q4_0 matrix of whole sixteen-row groups as `q4_0x16`, the runner's one-token layout).
//! - [`Method`] ([`method`]) says how blocks choose their scales: GGML's bit-exact reference
//!   rule, GGML's importance-weighted rules, or Kiln's least-squares scale search for Q8_0 and
//!   Q4_0. Every block type is quantized through its row of the format's block-type table
//!   ([`kiln_format::BlockKind`]) by the [`method::Rule`] a method takes for it.
//! - [`rows::convert_rows`] converts whole rows to any dtype (`q4_0x16` for whole
//!   sixteen-row groups; every block type by its row's rules), rejecting NaN/Inf, and
//!   accumulates the round-trip [`ErrorStats`] in the same pass. GGML's reference rule and bf16
//!   decoding are the kernels crate's dispatched SIMD kernels (`kiln_kernels::quantize_blocks`,
//!   `kiln_kernels::decode_bf16`, one `KILN_ISA` switch for every program).
//! - [`gptq`] rounds calibrated matrices with error compensation through their inputs'
//!   second moments, factored by [`factor`]; [`refit`] refits the scales of the types whose
//!   layouts can store new ones.
//! - [`quantize_file`] ([`pipeline`]) streams a file through them as [`QuantizeOptions`]
//!   ([`options`]) say: positioned reads of chunks of rows, rayon over tensors and chunks, the
//!   format crate's atomic checksumming `KilnWriter`, and a provenance step recording what was
//!   done. It reports progress through the [`Progress`] trait and returns a [`Report`]
//!   ([`report`]): per-tensor RMSE, max abs error and SNR, and the totals.
//! - [`calibrate`] measures the importance statistics ([`importance`]) a run can take;
//!   [`sensitivity`] and [`budget`] choose per-matrix types for `--to auto`.
//! - [`request::run`] is a whole run as `kiln-quantize` states it ([`request::Request`]: its
//!   flags, validated here so every front end refuses the same requests with the same
//!   messages), through importance, calibration and the budget to [`quantize_file`].
//!
//! Module map, in layers: a module imports from its own layer and those below, never from
//! a layer above or through the crate root, and the imports form no circle (unit tests
//! excepted). `tests/layers.rs` holds the code to this map.
//!
//! 1. Leaves: `error`, `method` (the methods and their rules over the block-type table),
//!    `factor` (the factored second moments).
//! 2. Rules over values: `policy` (each tensor's dtype), `importance` (calibration's
//!    statistics and their file), `rows` (rows to any dtype), `refit` (scales through the
//!    factor).
//! 3. `gptq` (compensated rounding), `options` (what a run is asked to do).
//! 4. `report` (what a run did, and its progress callbacks).
//! 5. `calibrate` (running the model over a text for the statistics).
//! 6. `sensitivity` (each matrix's rounding weighed in the logits).
//! 7. `pipeline` (a file through all of it).
//! 8. `budget` (`--to auto`: the types a size budget buys, trying candidates through the
//!    pipeline's pieces).
//! 9. `request` (a whole run from the command line's flags).
//!
//! The binary (`src/main.rs`) only parses arguments into a [`request::Request`], draws the
//! progress bar and prints the report. The policy is documented in `docs/QUANTIZE.md`.

pub mod budget;
pub mod calibrate;
pub mod error;
pub mod factor;
pub mod gptq;
pub mod importance;
pub mod method;
pub mod options;
pub mod pipeline;
pub mod policy;
pub mod refit;
pub mod report;
pub mod request;
pub mod rows;
pub mod sensitivity;

pub use error::{QuantizeError, Result};
pub use kiln_kernels::ErrorStats;
pub use method::Method;
pub use options::{QuantizeOptions, TOOL};
pub use pipeline::{quantize_file, CHUNK_ELEMENTS};
pub use policy::{Action, Decision, Override, Policy, Target};
pub use report::{NoProgress, Progress, Report, TensorReport};
pub use request::Request;
