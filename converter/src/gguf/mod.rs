//! GGUF, llama.cpp's model file, in both directions.
//!
//! - [`read`] parses and validates a GGUF file (hostile input welcome) into a [`GgufHeader`];
//!   [`write`] plans and writes one atomically through [`GgufBuilder`].
//! - [`types`] numbers GGML's tensor types and GGUF's value types; [`value`] holds metadata
//!   values; [`dequant`] decodes the block types Kiln does not store.
//! - [`tokenizer`] maps `tokenizer.json` to `tokenizer.ggml.*` and back ([`sentencepiece`]:
//!   merges and scores of SentencePiece vocabularies); [`rope`] reorders the
//!   q/k rows between Hugging Face's and llama.cpp's rope layouts.
//! - [`export`] writes a `.kiln` file as GGUF ([`export_gguf`]); [`import`] reads a GGUF file
//!   into a `.kiln` file ([`import_gguf`]); [`read_tokenizer`] rebuilds only the tokenizer
//!   (vocabulary-only files too). Both read what differs by family (architecture name, q/k
//!   reordering, window key, what llama.cpp's graph assumes) from the family's row of
//!   [`kiln_format::FAMILIES`].

pub mod dequant;
pub mod export;
pub mod import;
pub mod read;
pub mod rope;
pub mod sentencepiece;
pub mod tokenizer;
pub mod types;
pub mod value;
pub mod write;

pub use export::{export_gguf, ExportOptions, ExportSummary};
pub use import::{import_gguf, read_tokenizer, ImportOptions, ImportSummary};
pub use read::{parse, GgufFile, GgufHeader, GgufTensor};
pub use types::GgmlType;
pub use value::{Array, Value};
pub use write::GgufBuilder;
