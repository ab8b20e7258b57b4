//! Borrowed weight matrices in any of Kiln's encodings.

use half::{bf16, f16};
use kiln_format::{
    BlockIQ4NL, BlockIQ4NLx16, BlockIQ4XS, BlockIQ4XSx16, BlockQ2K, BlockQ3K, BlockQ4K, BlockQ4_0,
    BlockQ4_0x16, BlockQ5K, BlockQ5_0, BlockQ5_1, BlockQ6K, BlockQ8_0, DType, GROUP_ROWS, QK,
};

use crate::error::KernelError;

/// The elements of a row-major weight matrix, borrowed (usually from the mmap).
#[derive(Debug, Clone, Copy)]
#[allow(non_camel_case_types)] // the dtype names, as `DType` spells them
pub enum WeightData<'a> {
    /// `rows × cols` f32 values.
    F32(&'a [f32]),
    /// `rows × cols` f16 values.
    F16(&'a [f16]),
    /// `rows × cols` bf16 values.
    BF16(&'a [bf16]),
    /// `rows × cols / 32` Q8_0 blocks, each row a whole number of blocks.
    Q8_0(&'a [BlockQ8_0]),
    /// `rows × cols / 32` Q4_0 blocks, each row a whole number of blocks.
    Q4_0(&'a [BlockQ4_0]),
    /// The same Q4_0 blocks sixteen rows interleaved: `rows / 16 × cols / 32` groups, group
    /// `g·(cols/32) + b` holding block `b` of rows `16g..16g + 16`. `rows` is a multiple of 16.
    Q4_0x16(&'a [BlockQ4_0x16]),
    /// `rows × cols / 32` Q5_0 blocks, each row a whole number of blocks.
    Q5_0(&'a [BlockQ5_0]),
    /// `rows × cols / 32` Q5_1 blocks, each row a whole number of blocks.
    Q5_1(&'a [BlockQ5_1]),
    /// `rows × cols / 256` Q4_K super-blocks, each row a whole number of them.
    Q4_K(&'a [BlockQ4K]),
    /// `rows × cols / 256` Q5_K super-blocks, each row a whole number of them.
    Q5_K(&'a [BlockQ5K]),
    /// `rows × cols / 256` Q6_K super-blocks, each row a whole number of them.
    Q6_K(&'a [BlockQ6K]),
    /// `rows × cols / 256` Q2_K super-blocks, each row a whole number of them.
    Q2_K(&'a [BlockQ2K]),
    /// `rows × cols / 256` Q3_K super-blocks, each row a whole number of them.
    Q3_K(&'a [BlockQ3K]),
    /// `rows × cols / 32` IQ4_NL blocks, each row a whole number of them.
    IQ4_NL(&'a [BlockIQ4NL]),
    /// `rows × cols / 256` IQ4_XS super-blocks, each row a whole number of them.
    IQ4_XS(&'a [BlockIQ4XS]),
    /// The same IQ4_NL blocks sixteen rows interleaved, grouped as [`WeightData::Q4_0x16`].
    IQ4_NLx16(&'a [BlockIQ4NLx16]),
    /// The same IQ4_XS super-blocks sixteen rows interleaved: `rows / 16 × cols / 256` groups,
    /// group `g·(cols/256) + b` holding super-block `b` of rows `16g..16g + 16`.
    IQ4_XSx16(&'a [BlockIQ4XSx16]),
}

impl WeightData<'_> {
    /// The encoding's dtype: its row of the format's block-type table ([`DType::block`]).
    pub fn dtype(&self) -> DType {
        match self {
            WeightData::F32(_) => DType::F32,
            WeightData::F16(_) => DType::F16,
            WeightData::BF16(_) => DType::BF16,
            WeightData::Q8_0(_) => DType::Q8_0,
            WeightData::Q4_0(_) => DType::Q4_0,
            WeightData::Q4_0x16(_) => DType::Q4_0x16,
            WeightData::Q5_0(_) => DType::Q5_0,
            WeightData::Q5_1(_) => DType::Q5_1,
            WeightData::Q4_K(_) => DType::Q4_K,
            WeightData::Q5_K(_) => DType::Q5_K,
            WeightData::Q6_K(_) => DType::Q6_K,
            WeightData::Q2_K(_) => DType::Q2_K,
            WeightData::Q3_K(_) => DType::Q3_K,
            WeightData::IQ4_NL(_) => DType::IQ4_NL,
            WeightData::IQ4_XS(_) => DType::IQ4_XS,
            WeightData::IQ4_NLx16(_) => DType::IQ4_NLx16,
            WeightData::IQ4_XSx16(_) => DType::IQ4_XSx16,
        }
    }

    /// The encoding's name, for messages.
    pub fn dtype_name(&self) -> &'static str {
        self.dtype().name()
    }

    /// Bytes of weight data (what a matvec must stream from memory).
    pub fn byte_len(&self) -> usize {
        match self {
            WeightData::F32(d) => std::mem::size_of_val(*d),
            WeightData::F16(d) => std::mem::size_of_val(*d),
            WeightData::BF16(d) => std::mem::size_of_val(*d),
            WeightData::Q8_0(d) => std::mem::size_of_val(*d),
            WeightData::Q4_0(d) => std::mem::size_of_val(*d),
            WeightData::Q4_0x16(d) => std::mem::size_of_val(*d),
            WeightData::Q5_0(d) => std::mem::size_of_val(*d),
            WeightData::Q5_1(d) => std::mem::size_of_val(*d),
            WeightData::Q4_K(d) => std::mem::size_of_val(*d),
            WeightData::Q5_K(d) => std::mem::size_of_val(*d),
            WeightData::Q6_K(d) => std::mem::size_of_val(*d),
            WeightData::Q2_K(d) => std::mem::size_of_val(*d),
            WeightData::Q3_K(d) => std::mem::size_of_val(*d),
            WeightData::IQ4_NL(d) => std::mem::size_of_val(*d),
            WeightData::IQ4_XS(d) => std::mem::size_of_val(*d),
            WeightData::IQ4_NLx16(d) => std::mem::size_of_val(*d),
            WeightData::IQ4_XSx16(d) => std::mem::size_of_val(*d),
        }
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
    /// Check that `data` holds exactly `rows × cols` weights (whole 32-weight blocks per row for
    /// Q8_0, Q4_0, Q5_0, Q5_1 and IQ4_NL; whole 256-weight super-blocks for the K-quants and
    /// IQ4_XS).
    pub fn new(rows: usize, cols: usize, data: WeightData<'a>) -> Result<Self, KernelError> {
        let elems = rows
            .checked_mul(cols)
            .ok_or(KernelError::ShapeOverflow { rows, cols })?;
        let (found, expected, unit) = match data {
            WeightData::F32(d) => (d.len(), elems, "elements"),
            WeightData::F16(d) => (d.len(), elems, "elements"),
            WeightData::BF16(d) => (d.len(), elems, "elements"),
            WeightData::Q8_0(_)
            | WeightData::Q4_0(_)
            | WeightData::Q4_0x16(_)
            | WeightData::IQ4_NLx16(_) => {
                if !cols.is_multiple_of(QK) {
                    return Err(KernelError::ColsNotBlockMultiple {
                        dtype: data.dtype_name(),
                        cols,
                    });
                }
                let interleaved = data.dtype().rows_per_unit() > 1;
                if interleaved && !rows.is_multiple_of(GROUP_ROWS) {
                    return Err(KernelError::RowsNotGroupMultiple {
                        dtype: data.dtype_name(),
                        plain: data.dtype().logical().name(),
                        rows,
                    });
                }
                let found = match data {
                    WeightData::Q8_0(d) => d.len(),
                    WeightData::Q4_0(d) => d.len(),
                    // Counted in blocks: each group holds sixteen.
                    WeightData::Q4_0x16(d) => d.len() * GROUP_ROWS,
                    WeightData::IQ4_NLx16(d) => d.len() * GROUP_ROWS,
                    _ => unreachable!("matched above"),
                };
                (found, elems / QK, "blocks")
            }
            WeightData::Q5_0(_)
            | WeightData::Q5_1(_)
            | WeightData::Q4_K(_)
            | WeightData::Q5_K(_)
            | WeightData::Q6_K(_)
            | WeightData::Q2_K(_)
            | WeightData::Q3_K(_)
            | WeightData::IQ4_NL(_)
            | WeightData::IQ4_XS(_)
            | WeightData::IQ4_XSx16(_) => {
                let block = data.block_len();
                if !cols.is_multiple_of(block) {
                    return Err(KernelError::ColsNotBlockLenMultiple {
                        dtype: data.dtype_name(),
                        cols,
                        block,
                    });
                }
                if data.dtype().rows_per_unit() > 1 && !rows.is_multiple_of(GROUP_ROWS) {
                    return Err(KernelError::RowsNotGroupMultiple {
                        dtype: data.dtype_name(),
                        plain: data.dtype().logical().name(),
                        rows,
                    });
                }
                let found = match data {
                    WeightData::Q5_0(d) => d.len(),
                    WeightData::Q5_1(d) => d.len(),
                    WeightData::Q4_K(d) => d.len(),
                    WeightData::Q5_K(d) => d.len(),
                    WeightData::Q6_K(d) => d.len(),
                    WeightData::Q2_K(d) => d.len(),
                    WeightData::Q3_K(d) => d.len(),
                    WeightData::IQ4_NL(d) => d.len(),
                    WeightData::IQ4_XS(d) => d.len(),
                    // Counted in super-blocks: each group holds sixteen.
                    WeightData::IQ4_XSx16(d) => d.len() * GROUP_ROWS,
                    _ => unreachable!("matched above"),
                };
                (found, elems / block, "blocks")
            }
        };
        if found != expected {
            return Err(KernelError::LengthMismatch {
                rows,
                cols,
                expected,
                found,
                unit,
            });
        }
        Ok(Matrix { rows, cols, data })
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
