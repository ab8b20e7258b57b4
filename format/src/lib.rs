//! `kiln-format`: the `.kiln` container shared by every Kiln program.
//!
//! A `.kiln` file is one versioned, checksummed file holding a model: a fixed header
//! ([`layout::FixedHeader`]), a JSON [`Metadata`] document (model config, tokenizer files, chat
//! template, generation defaults, provenance), a tensor index ([`TensorInfo`]: canonical name,
//! [`DType`], shape, offset, length, sha256) and 64-byte-aligned tensor data.
//!
//! - [`KilnFile`] memory-maps and validates a file, and hands out typed zero-copy
//!   [`TensorView`]s; [`KilnFile::verify_checksums`] hashes every tensor in parallel.
//! - [`KilnWriter`] writes one: layout planned up front, tensors streamed (from many threads if
//!   wanted), hashed as written, and published atomically.
//! - [`block_type`] makes every storage unit a row of one table: the [`BlockType`] trait
//!   (sizes, GGML id, reference quantize, dequantize, the scales that must be finite) and
//!   [`BlockKind`], the row [`DType::block`] hands out to code that has a dtype at run time.
//! - [`blocks`] holds GGML's Q8_0/Q4_0 block layouts and their scalar reference quantizers,
//!   the specification every faster path is tested against; [`q5`] and [`kquants`] hold
//!   Q5_0/Q5_1 and the K-quant super-blocks (Q4_K, Q5_K, Q6_K, and Q8_K for activations).
//! - [`packed`] stores the large metadata fields (tokenizer files) zlib-compressed in the
//!   files section, and puts them back into the [`Metadata`] a reader hands out.
//! - [`names`] defines the canonical tensor names, and [`shapes`] the tensors (names and
//!   shapes) a [`ModelConfig`] implies.
//! - [`family`] describes each [`Architecture`] as data ([`FamilySpec`]: its Hugging Face
//!   class and defaults, its GGUF name and what llama.cpp assumes of it, its fixed options,
//!   norm module names and fused projections), the one table the converter and the runner's
//!   activation names read instead of matching on the architecture.
//!
//! - [`exit`] and [`args`] hold the conventions every program's command line shares: the exit
//!   statuses (128 + the signal's number when interrupted) and the interrupt handler, and the
//!   range-checked parsers of numeric flags, plain functions that need no argument parser.
//!
//! The format is specified in `docs/FORMAT.md`. This crate knows no model maths, no SIMD and no
//! user interface beyond those shared conventions.

pub mod args;
pub mod atomic;
pub mod block_type;
pub mod blocks;
pub mod dtype;
pub mod error;
pub mod exit;
pub mod family;
pub mod input;
pub mod io;
pub mod iq4;
pub mod kquants;
pub mod layout;
pub mod metadata;
pub mod names;
pub mod num;
pub mod packed;
pub mod q5;
pub mod reader;
pub mod shapes;
pub mod values;
pub mod writer;

pub use atomic::{
    check_destination, refuse_clobbering, refuse_output_is_input, remove_pending_outputs,
    write_file_atomic, AtomicFile,
};
pub use block_type::{BlockKind, BlockType};
pub use blocks::{BlockQ4_0, BlockQ4_0x16, BlockQ8_0, GROUP_ROWS, QK};
pub use dtype::DType;
pub use error::{FormatError, Result};
pub use exit::{install_interrupt_handler, signal_name, ExitStatus};
pub use family::{FamilySpec, FAMILIES};
pub use input::{open_regular, read_bounded, read_text_bounded};
pub use iq4::{BlockIQ4NL, BlockIQ4NLx16, BlockIQ4XS, BlockIQ4XSx16};
pub use kquants::{BlockQ2K, BlockQ3K, BlockQ4K, BlockQ5K, BlockQ6K, BlockQ8K, QK_K};
pub use metadata::{
    Architecture, AttentionMask, DenseActivation, DenseLayer, EmbeddingSpec, FamilyOptions,
    LayerKind, Metadata, MlpActivation, MlpKind, ModelConfig, NormKind, NormPlace, NormStyle,
    Pooling, Positions, ProvenanceStep, RopePairing, RopeScaling, SourceFile, TokenizerFiles,
};
pub use names::{Role, TensorName};
pub use num::Num;
pub use q5::{BlockQ5_0, BlockQ5_1};
pub use reader::{hex, ChecksumFailure, KilnFile, NonFiniteTensor, TensorInfo, TensorView};
pub use shapes::expected_tensors;
pub use writer::{KilnWriter, TensorSink, TensorSpec, WriteSummary};
