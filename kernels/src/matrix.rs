//! Borrowed weight matrices in any of Kiln's encodings.

use half::{bf16, f16};
use kiln_format::{
    BlockIQ4NL, BlockIQ4NLx16, BlockIQ4XS, BlockIQ4XSx16, BlockQ2K, BlockQ3K, BlockQ4K, BlockQ4_0,
    BlockQ4_0x16, BlockQ5K, BlockQ5_0, BlockQ5_1, BlockQ6K, BlockQ8_0, BlockType, DType,
    GROUP_ROWS, QK,
};

use crate::error::KernelError;

/// The weight encodings, listed once: each variant borrows a slice of one block type, and the
/// enum, [`WeightData::as_bytes`] (and so the dtype, byte length and unit count) come from
/// this list. A variant's dtype is its block type's row of the format's table
/// ([`BlockType::DTYPE`]), checked at compile time to be the dtype of the same name.
macro_rules! weight_data {
    ($($(#[$doc:meta])* $v:ident($t:ty),)*) => {
        /// The elements of a row-major weight matrix, borrowed (usually from the mmap).
        #[derive(Debug, Clone, Copy)]
        #[allow(non_camel_case_types)] // the dtype names, as `DType` spells them
        pub enum WeightData<'a> {
            $($(#[$doc])* $v(&'a [$t]),)*
        }

        impl<'a> WeightData<'a> {
            /// The encoding's dtype and all its units' bytes, in storage order: the view every
            /// other question about the encoding is answered from, through the dtype's row of
            /// the block-type table ([`DType::block`]).
            pub fn as_bytes(&self) -> (DType, &'a [u8]) {
                match *self {
                    $(WeightData::$v(d) => (<$t as BlockType>::DTYPE, bytemuck::cast_slice(d)),)*
                }
            }
        }

        $(const _: () = assert!(matches!(<$t as BlockType>::DTYPE, DType::$v));)*
    };
}

weight_data! {
    /// `rows × cols` f32 values.
    F32(f32),
    /// `rows × cols` f16 values.
    F16(f16),
    /// `rows × cols` bf16 values.
    BF16(bf16),
    /// `rows × cols / 32` Q8_0 blocks, each row a whole number of blocks.
    Q8_0(BlockQ8_0),
    /// `rows × cols / 32` Q4_0 blocks, each row a whole number of blocks.
    Q4_0(BlockQ4_0),
    /// The same Q4_0 blocks sixteen rows interleaved: `rows / 16 × cols / 32` groups, group
    /// `g·(cols/32) + b` holding block `b` of rows `16g..16g + 16`. `rows` is a multiple of 16.
    Q4_0x16(BlockQ4_0x16),
    /// `rows × cols / 32` Q5_0 blocks, each row a whole number of blocks.
    Q5_0(BlockQ5_0),
    /// `rows × cols / 32` Q5_1 blocks, each row a whole number of blocks.
    Q5_1(BlockQ5_1),
    /// `rows × cols / 256` Q4_K super-blocks, each row a whole number of them.
    Q4_K(BlockQ4K),
    /// `rows × cols / 256` Q5_K super-blocks, each row a whole number of them.
    Q5_K(BlockQ5K),
    /// `rows × cols / 256` Q6_K super-blocks, each row a whole number of them.
    Q6_K(BlockQ6K),
    /// `rows × cols / 256` Q2_K super-blocks, each row a whole number of them.
    Q2_K(BlockQ2K),
    /// `rows × cols / 256` Q3_K super-blocks, each row a whole number of them.
    Q3_K(BlockQ3K),
    /// `rows × cols / 32` IQ4_NL blocks, each row a whole number of them.
    IQ4_NL(BlockIQ4NL),
    /// `rows × cols / 256` IQ4_XS super-blocks, each row a whole number of them.
    IQ4_XS(BlockIQ4XS),
    /// The same IQ4_NL blocks sixteen rows interleaved, grouped as [`WeightData::Q4_0x16`].
    IQ4_NLx16(BlockIQ4NLx16),
    /// The same IQ4_XS super-blocks sixteen rows interleaved: `rows / 16 × cols / 256` groups,
    /// group `g·(cols/256) + b` holding super-block `b` of rows `16g..16g + 16`.
    IQ4_XSx16(BlockIQ4XSx16),
}

impl WeightData<'_> {
    /// The encoding's dtype: its row of the format's block-type table ([`DType::block`]).
    pub fn dtype(&self) -> DType {
        self.as_bytes().0
    }

    /// The encoding's name, for messages.
    pub fn dtype_name(&self) -> &'static str {
        self.dtype().name()
    }

    /// Bytes of weight data (what a matvec must stream from memory).
    pub fn byte_len(&self) -> usize {
        self.as_bytes().1.len()
    }

    /// Storage units held: values for the float encodings, blocks, or sixteen-row groups for
    /// the interleaved layouts.
    pub fn units(&self) -> usize {
        let (dtype, bytes) = self.as_bytes();
        bytes.len() / dtype.block_bytes()
    }

    /// Weights per block of one row (1 for float encodings; 32 for `q4_0x16` and
    /// `iq4_nlx16` and 256 for `iq4_xsx16`, whose storage units span sixteen rows' blocks).
    pub fn block_len(&self) -> usize {
        let kind = self.dtype().block();
        kind.weights / kind.rows
    }
}

/// A borrowed weight matrix, row-major, `rows × cols` (PyTorch's `(out_features, in_features)`).
///
/// The fields are public for reading; build one with [`Matrix::new`], which checks the lengths.
#[derive(Debug, Clone, Copy)]
pub struct Matrix<'a> {
    /// Output features.
    pub rows: usize,
    /// Input features.
    pub cols: usize,
    /// The elements, `rows × cols` (or `rows × cols / 32` blocks).
    pub data: WeightData<'a>,
}

impl<'a> Matrix<'a> {
    /// Check that `data` holds exactly `rows × cols` weights: whole blocks per row (32 weights
    /// for Q8_0, Q4_0, Q5_0, Q5_1 and IQ4_NL, 256 for the K-quants and IQ4_XS), and whole
    /// sixteen-row groups for the interleaved layouts. Everything is read from the dtype's row
    /// of the block-type table.
    pub fn new(rows: usize, cols: usize, data: WeightData<'a>) -> Result<Self, KernelError> {
        let elems = rows
            .checked_mul(cols)
            .ok_or(KernelError::ShapeOverflow { rows, cols })?;
        let dtype = data.dtype();
        let kind = dtype.block();
        let block = data.block_len();
        if !cols.is_multiple_of(block) {
            return Err(cols_not_whole_blocks(dtype, cols, block));
        }
        if !rows.is_multiple_of(kind.rows) {
            return Err(KernelError::RowsNotGroupMultiple {
                dtype: dtype.name(),
                plain: dtype.logical().name(),
                rows,
            });
        }
        // Counted in one row's blocks (values for the floats): a unit spanning sixteen rows
        // holds one block of each.
        let found = data.units() * kind.rows;
        let expected = elems / block;
        if found != expected {
            return Err(KernelError::LengthMismatch {
                rows,
                cols,
                expected,
                found,
                unit: if block == 1 { "elements" } else { "blocks" },
            });
        }
        Ok(Matrix { rows, cols, data })
    }
}

/// The error for `cols` columns that are not whole blocks of `block` weights of `dtype`: Q8_0
/// and Q4_0 blocks (and the interleaved layouts of 32-weight blocks) have the message without
/// a fallback type to suggest, the other block types the one that names GGML's fallbacks.
fn cols_not_whole_blocks(dtype: DType, cols: usize, block: usize) -> KernelError {
    match dtype {
        DType::Q8_0 | DType::Q4_0 | DType::Q4_0x16 | DType::IQ4_NLx16 => {
            KernelError::ColsNotBlockMultiple {
                dtype: dtype.name(),
                cols,
            }
        }
        _ => KernelError::ColsNotBlockLenMultiple {
            dtype: dtype.name(),
            cols,
            block,
        },
    }
}

/// Weights held in memory rather than borrowed from a file: what tests, benchmarks and tools
/// build from f32 values to exercise every encoding the kernels read.
#[derive(Debug, Clone, PartialEq)]
pub enum OwnedWeights {
    /// f32 values.
    F32(Vec<f32>),
    /// f16 values (round to nearest even).
    F16(Vec<f16>),
    /// bf16 values (round to nearest even).
    BF16(Vec<bf16>),
    /// Q8_0 blocks (GGML's reference rule).
    Q8_0(Vec<BlockQ8_0>),
    /// Q4_0 blocks (GGML's reference rule).
    Q4_0(Vec<BlockQ4_0>),
    /// Q4_0 blocks sixteen rows interleaved (see [`WeightData::Q4_0x16`]).
    Q4_0x16 {
        /// The groups.
        groups: Vec<BlockQ4_0x16>,
        /// Blocks per row.
        nb: usize,
    },
}

impl OwnedWeights {
    /// The dtype names [`OwnedWeights::encode`] accepts.
    pub const DTYPES: [&'static str; 5] = ["f32", "f16", "bf16", "q8_0", "q4_0"];

    /// Encode `values` as `dtype` (one of [`OwnedWeights::DTYPES`]). `None` for an unknown
    /// name, or for a block dtype when `values` is not a whole number of 32-value blocks.
    pub fn encode(dtype: &str, values: &[f32]) -> Option<OwnedWeights> {
        Some(match dtype {
            "f32" => OwnedWeights::F32(values.to_vec()),
            "f16" => OwnedWeights::F16(values.iter().map(|&v| f16::from_f32(v)).collect()),
            "bf16" => OwnedWeights::BF16(values.iter().map(|&v| bf16::from_f32(v)).collect()),
            "q8_0" => OwnedWeights::Q8_0(kiln_format::blocks::quantize_row_q8_0_ref(values).ok()?),
            "q4_0" => OwnedWeights::Q4_0(kiln_format::blocks::quantize_row_q4_0_ref(values).ok()?),
            _ => return None,
        })
    }

    /// Borrow as the kernels' [`WeightData`].
    pub fn data(&self) -> WeightData<'_> {
        match self {
            OwnedWeights::F32(d) => WeightData::F32(d),
            OwnedWeights::F16(d) => WeightData::F16(d),
            OwnedWeights::BF16(d) => WeightData::BF16(d),
            OwnedWeights::Q8_0(d) => WeightData::Q8_0(d),
            OwnedWeights::Q4_0(d) => WeightData::Q4_0(d),
            OwnedWeights::Q4_0x16 { groups, .. } => WeightData::Q4_0x16(groups),
        }
    }

    /// The values the weights stand for, as f32.
    pub fn dequantized(&self) -> Vec<f32> {
        let (dtype, cols, bytes): (DType, usize, &[u8]) = match self {
            OwnedWeights::F32(d) => return d.clone(),
            OwnedWeights::F16(d) => (DType::F16, 1, bytemuck::cast_slice(d)),
            OwnedWeights::BF16(d) => (DType::BF16, 1, bytemuck::cast_slice(d)),
            OwnedWeights::Q8_0(d) => (DType::Q8_0, QK, bytemuck::cast_slice(d)),
            OwnedWeights::Q4_0(d) => (DType::Q4_0, QK, bytemuck::cast_slice(d)),
            OwnedWeights::Q4_0x16 { groups, nb } => {
                (DType::Q4_0x16, nb * QK, bytemuck::cast_slice(groups))
            }
        };
        let mut out = vec![0.0; bytes.len() / dtype.block_bytes() * dtype.block_len()];
        kiln_format::values::decode_rows_f32(dtype, cols, bytes, &mut out);
        out
    }

    /// Q4_0 weights of a matrix of `cols` columns stored sixteen rows interleaved, as a
    /// `q4_0x16` file holds them: `None` unless these are Q4_0 weights of whole sixteen-row
    /// groups.
    pub fn interleaved(&self, cols: usize) -> Option<OwnedWeights> {
        let OwnedWeights::Q4_0(d) = self else {
            return None;
        };
        let nb = cols / QK;
        let whole = nb > 0 && cols.is_multiple_of(QK) && d.len().is_multiple_of(GROUP_ROWS * nb);
        whole.then(|| OwnedWeights::Q4_0x16 {
            groups: kiln_format::blocks::interleave_q4_0(d, nb),
            nb,
        })
    }
}
