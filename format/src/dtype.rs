//! Element types a `.kiln` tensor may hold, and how many bytes a shape of each occupies.
//!
//! The numeric ids are GGML's `ggml_type` values, written explicitly so that the on-disk id never
//! depends on declaration order and so that blocks can be exchanged with GGUF without a table.

use std::fmt;

use crate::blocks::{BlockQ4_0, BlockQ8_0, QK};

/// A tensor element type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DType {
    /// IEEE 754 binary32.
    F32,
    /// IEEE 754 binary16.
    F16,
    /// bfloat16 (the top half of a binary32).
    BF16,
    /// GGML Q8_0: blocks of 32 weights, an f16 scale and 32 signed bytes (34 bytes a block).
    Q8_0,
    /// GGML Q4_0: blocks of 32 weights, an f16 scale and 16 bytes of nibbles (18 bytes a block).
    Q4_0,
}

impl DType {
    /// Every dtype, in id order.
    pub const ALL: [DType; 5] = [
        DType::F32,
        DType::F16,
        DType::Q4_0,
        DType::Q8_0,
        DType::BF16,
    ];

    /// The on-disk id (GGML's `ggml_type` number).
    pub const fn id(self) -> u32 {
        match self {
            DType::F32 => 0,
            DType::F16 => 1,
            DType::Q4_0 => 2,
            DType::Q8_0 => 8,
            DType::BF16 => 30,
        }
    }

    /// The dtype with on-disk id `id`, if this build knows it.
    pub const fn from_id(id: u32) -> Option<DType> {
        match id {
            0 => Some(DType::F32),
            1 => Some(DType::F16),
            2 => Some(DType::Q4_0),
            8 => Some(DType::Q8_0),
            30 => Some(DType::BF16),
            _ => None,
        }
    }

    /// Lower-case name as used on the command line and in reports.
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::Q8_0 => "q8_0",
            DType::Q4_0 => "q4_0",
        }
    }

    /// Parse a name as printed by [`DType::name`] (case-insensitive).
    pub fn parse(s: &str) -> Option<DType> {
        DType::ALL
            .into_iter()
            .find(|d| d.name().eq_ignore_ascii_case(s))
    }

    /// Number of weights one storage unit covers (1 for plain floats, 32 for blocks).
    pub const fn block_len(self) -> usize {
        match self {
            DType::F32 | DType::F16 | DType::BF16 => 1,
            DType::Q8_0 | DType::Q4_0 => QK,
        }
    }

    /// Bytes of one storage unit.
    pub const fn block_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::Q8_0 => std::mem::size_of::<BlockQ8_0>(),
            DType::Q4_0 => std::mem::size_of::<BlockQ4_0>(),
        }
    }

    /// Whether this is a block-quantized type.
    pub const fn is_quantized(self) -> bool {
        matches!(self, DType::Q8_0 | DType::Q4_0)
    }

    /// Bits of storage per weight (e.g. 4.5 for Q4_0).
    pub fn bits_per_weight(self) -> f64 {
        (self.block_bytes() * 8) as f64 / self.block_len() as f64
    }

    /// Byte length of a row-major tensor of `shape`, or why the shape cannot hold this dtype.
    ///
    /// Block types are laid out row by row, so the last (innermost) dimension must be a
    /// multiple of the block length; all arithmetic is checked because shapes come from disk.
    pub fn byte_len(self, shape: &[u64]) -> Result<u64, String> {
        let mut elements: u64 = 1;
        for &d in shape {
            elements = elements
                .checked_mul(d)
                .ok_or_else(|| format!("shape {shape:?} overflows 64 bits"))?;
        }
        let bl = self.block_len() as u64;
        if bl > 1 {
            let last = shape.last().copied().unwrap_or(1);
            if last % bl != 0 {
                return Err(format!(
                    "{} needs the last dimension to be a multiple of {bl}, shape is {shape:?}",
                    self.name()
                ));
            }
        }
        (elements / bl)
            .checked_mul(self.block_bytes() as u64)
            .ok_or_else(|| format!("shape {shape:?} overflows 64 bits"))
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_are_ggml_ids() {
        for d in DType::ALL {
            assert_eq!(DType::from_id(d.id()), Some(d));
            assert_eq!(DType::parse(d.name()), Some(d));
        }
        assert_eq!(DType::Q8_0.id(), 8);
        assert_eq!(DType::BF16.id(), 30);
        assert_eq!(DType::from_id(3), None);
    }

    #[test]
    fn byte_lengths() {
        assert_eq!(DType::F32.byte_len(&[3, 5]), Ok(60));
        assert_eq!(DType::BF16.byte_len(&[7]), Ok(14));
        assert_eq!(DType::Q8_0.byte_len(&[2, 64]), Ok(4 * 34));
        assert_eq!(DType::Q4_0.byte_len(&[1, 32]), Ok(18));
        assert!(DType::Q4_0.byte_len(&[1, 33]).is_err());
        assert!(DType::F32.byte_len(&[u64::MAX, 2]).is_err());
        assert_eq!(DType::Q4_0.bits_per_weight(), 4.5);
        assert_eq!(DType::Q8_0.bits_per_weight(), 8.5);
    }
}
