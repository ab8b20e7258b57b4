//! `kiln-verify`: proves a `.kiln` model's numbers, layer by layer, against an independent
//! reference.
//!
//! - [`dump::Dump`] loads a reference activation dump (one safetensors file per prompt, names
//!   from transformers' module paths) made by any forward-hook script;
//! - [`layers::verify_layers`] runs the model through the runner's observer on the dump's
//!   tokens and compares every activation with [`metrics::Metrics`], in forward order, against
//!   the [`tolerance::Tolerance`] of the file's weight encoding;
//! - [`perplexity::perplexity`] follows llama.cpp's `llama-perplexity` protocol, with
//!   KL-divergence against a base model's saved log-probabilities;
//! - [`diff::diff`] compares two files tensor by tensor;
//! - [`junit`] turns any of these reports into JUnit XML for CI, and [`report`] renders the
//!   `layers` and `perplexity` reports as a self-contained HTML page of inline SVG charts;
//! - [`request::layers`] is `kiln-verify layers` from its flags ([`request::LayersRequest`]),
//!   results files included, for every front end (the command line, the Python package).
//!
//! Checksums are verified by `kiln_format::KilnFile::verify_checksums`.

pub mod diff;
pub mod dump;
pub mod error;
pub mod junit;
pub mod layers;
pub mod metrics;
pub mod perplexity;
pub mod report;
pub mod request;
pub mod tolerance;

pub use error::{Result, VerifyError};
