//! `kiln-convert`: a Hugging Face checkpoint directory (or a GGUF file) → one versioned,
//! checksummed `.kiln` file, and a `.kiln` file → GGUF.
//!
//! - [`hf_config`] resolves `config.json` (transformers 4.x or 5.x) into a
//!   [`kiln_format::ModelConfig`], with the defaults of the family's row of
//!   [`kiln_format::FAMILIES`] (the one description of each family, which GGUF import and
//!   export and the name table read too);
//! - [`checkpoint`] maps the safetensors files (single or sharded) and resolves every tensor's
//!   canonical name through the one spelling table in [`names`];
//! - [`tokenizer_files`] carries `tokenizer.json`, the chat template and special tokens;
//! - [`hf`] checks the tensors against the config and writes the file in parallel through
//!   [`kiln_format::KilnWriter`];
//! - [`inspect`] reports on (and verifies) a `.kiln` file;
//! - [`gguf`] exports a `.kiln` file to llama.cpp's GGUF and imports GGUF files, each
//!   direction in steps (configuration, tensor plan, write) of its own submodule;
//! - [`convert::convert`] chooses among those three conversions by the source and destination
//!   paths, for front ends without subcommands (the Python package).
//!
//! Progress is reported through the [`Progress`] trait; the binary draws the bar.

pub mod checkpoint;
pub mod convert;
pub mod error;
pub mod gguf;
pub mod hf;
pub mod hf_config;
pub mod inspect;
pub mod names;
pub mod sentence_transformers;
pub mod tokenizer_files;

pub use error::{ConvertError, Result};
pub use hf::{convert_hf, ConvertOptions, ConvertSummary};
pub use inspect::{inspect, Inspection};

/// Progress of a long operation, reported from worker threads.
pub trait Progress: Sync {
    /// The work ahead: `bytes` of data in `items` tensors.
    fn start(&self, _bytes: u64, _items: usize) {}
    /// `bytes` more bytes and `items` more tensors done.
    fn advance(&self, _bytes: u64, _items: usize) {}
    /// All done.
    fn finish(&self) {}
}

/// A [`Progress`] that reports nothing.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoProgress;

impl Progress for NoProgress {}
