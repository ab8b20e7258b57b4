//! GGML tensor types and GGUF metadata value types, as numbered on disk.
//!
//! The table lists every `ggml_type` a current GGUF file may hold, with its block geometry, so
//! that the reader can validate the size of any tensor, including types Kiln cannot decode.

use kiln_format::DType;

/// A `ggml_type`: id, name, weights per block and bytes per block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GgmlType {
    /// The on-disk id.
    pub id: u32,
    /// GGML's name (`Q4_K`, `BF16`, …).
    pub name: &'static str,
    /// Weights per block (1 for plain element types).
    pub block_len: u64,
    /// Bytes per block.
    pub block_bytes: u64,
}

const fn t(id: u32, name: &'static str, block_len: u64, block_bytes: u64) -> GgmlType {
    GgmlType {
        id,
        name,
        block_len,
        block_bytes,
    }
}

/// The GGML type a Kiln block type is, from its row of the format crate's block-type table.
const fn kiln(dtype: DType) -> GgmlType {
    let b = dtype.block();
    match b.ggml {
        Some((id, name)) => t(id, name, b.weights as u64, b.bytes as u64),
        None => panic!("a Kiln-only layout is no GGML type"),
    }
}

/// Every type id GGML assigns today (ids 4, 5 and 31–33 were retired and are refused). The
/// types Kiln stores take their geometry from the format crate's table; the others are
/// GGML's (`ggml-common.h`), so that the reader can size tensors it cannot decode.
pub const GGML_TYPES: &[GgmlType] = &[
    kiln(DType::F32),
    kiln(DType::F16),
    kiln(DType::Q4_0),
    t(3, "Q4_1", 32, 20),
    kiln(DType::Q5_0),
    kiln(DType::Q5_1),
    kiln(DType::Q8_0),
    t(9, "Q8_1", 32, 36),
    kiln(DType::Q2_K),
    kiln(DType::Q3_K),
    kiln(DType::Q4_K),
    kiln(DType::Q5_K),
    kiln(DType::Q6_K),
    t(15, "Q8_K", 256, 292),
    t(16, "IQ2_XXS", 256, 66),
    t(17, "IQ2_XS", 256, 74),
    t(18, "IQ3_XXS", 256, 98),
    t(19, "IQ1_S", 256, 50),
    kiln(DType::IQ4_NL),
    t(21, "IQ3_S", 256, 110),
    t(22, "IQ2_S", 256, 82),
    kiln(DType::IQ4_XS),
    t(24, "I8", 1, 1),
    t(25, "I16", 1, 2),
    t(26, "I32", 1, 4),
    t(27, "I64", 1, 8),
    t(28, "F64", 1, 8),
    t(29, "IQ1_M", 256, 56),
    kiln(DType::BF16),
    t(34, "TQ1_0", 256, 54),
    t(35, "TQ2_0", 256, 66),
    t(39, "MXFP4", 32, 17),
];

impl GgmlType {
    /// The type with on-disk id `id`, if GGML defines one.
    pub fn from_id(id: u32) -> Option<GgmlType> {
        GGML_TYPES.iter().copied().find(|t| t.id == id)
    }

    /// The GGML type a Kiln dtype is written to GGUF as: the one its row of the block-type
    /// table names, or for a Kiln-only layout (e.g. `q4_0x16`, which names none) that of the
    /// dtype whose values it stores ([`DType::logical`]), which export de-interleaves to.
    pub fn of(dtype: DType) -> GgmlType {
        let (id, _) = dtype
            .logical()
            .block()
            .ggml
            .expect("every logical Kiln dtype is a GGML type");
        GgmlType::from_id(id).expect("the table's GGML ids are GGML's")
    }

    /// The Kiln dtype whose row of the block-type table names this type, if Kiln stores it
    /// natively. Never a Kiln-only layout: GGML has none of them.
    pub fn kiln_dtype(self) -> Option<DType> {
        DType::ALL
            .into_iter()
            .find(|d| d.block().ggml.is_some_and(|(id, _)| id == self.id))
    }

    /// Bytes of a tensor whose innermost dimension is `dims[0]` (GGML order), or why not.
    pub fn byte_len(self, dims: &[u64]) -> Result<u64, String> {
        let first = dims.first().copied().unwrap_or(1);
        if !first.is_multiple_of(self.block_len) {
            return Err(format!(
                "{} packs {} weights a block and a block never straddles rows, so the row \
                 length (the first dimension, {first}) must be a multiple of {}; dims are \
                 {dims:?}",
                self.name, self.block_len, self.block_len
            ));
        }
        let mut elements: u64 = 1;
        for &d in dims {
            elements = elements
                .checked_mul(d)
                .ok_or_else(|| format!("dims {dims:?} overflow 64 bits"))?;
        }
        (elements / self.block_len)
            .checked_mul(self.block_bytes)
            .ok_or_else(|| format!("dims {dims:?} overflow 64 bits"))
    }
}

/// GGUF metadata value types (`gguf_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum ValueType {
    U8 = 0,
    I8 = 1,
    U16 = 2,
    I16 = 3,
    U32 = 4,
    I32 = 5,
    F32 = 6,
    Bool = 7,
    String = 8,
    Array = 9,
    U64 = 10,
    I64 = 11,
    F64 = 12,
}

impl ValueType {
    /// The value type with on-disk id `id`.
    pub fn from_id(id: u32) -> Option<ValueType> {
        use ValueType::*;
        Some(match id {
            0 => U8,
            1 => I8,
            2 => U16,
            3 => I16,
            4 => U32,
            5 => I32,
            6 => F32,
            7 => Bool,
            8 => String,
            9 => Array,
            10 => U64,
            11 => I64,
            12 => F64,
            _ => return None,
        })
    }

    /// Bytes of one value of a fixed-size type; `None` for strings and arrays.
    pub fn fixed_size(self) -> Option<u64> {
        use ValueType::*;
        match self {
            U8 | I8 | Bool => Some(1),
            U16 | I16 => Some(2),
            U32 | I32 | F32 => Some(4),
            U64 | I64 | F64 => Some(8),
            String | Array => None,
        }
    }

    /// The fewest bytes one value of this type occupies on disk (a string is at least its
    /// 8-byte length, an array its type and count). Bounds element counts by the bytes left.
    pub fn min_size(self) -> u64 {
        match self {
            ValueType::String => 8,
            ValueType::Array => 12,
            other => other.fixed_size().unwrap_or(1),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kiln_dtypes_are_ggml_types_of_the_same_size() {
        for d in DType::ALL {
            let g = GgmlType::of(d);
            if d.logical() != d {
                // Kiln-only layouts (ids from 1000) have no GGML type: they are written as the
                // type of their values, whose blocks they rearrange.
                assert!(d.id() >= 1000, "{d}");
                assert_eq!(GgmlType::from_id(d.id()), None, "{d}");
                assert_eq!(g.kiln_dtype(), Some(d.logical()), "{d}");
                assert_eq!(
                    g.block_bytes * d.block_len() as u64,
                    d.block_bytes() as u64 * g.block_len,
                    "{d}"
                );
                continue;
            }
            assert_eq!(g.kiln_dtype(), Some(d));
            assert_eq!(d.block().ggml, Some((g.id, g.name)), "{d}");
            assert_eq!(g.block_len, d.block_len() as u64, "{d}");
            assert_eq!(g.block_bytes, d.block_bytes() as u64, "{d}");
        }
        assert_eq!(GgmlType::of(DType::Q4_0x16).name, "Q4_0");
    }

    #[test]
    fn ids_are_unique_and_retired_ids_unknown() {
        for (i, a) in GGML_TYPES.iter().enumerate() {
            assert!(GGML_TYPES[i + 1..].iter().all(|b| b.id != a.id));
        }
        for id in [4, 5, 31, 32, 33, 40, u32::MAX] {
            assert_eq!(GgmlType::from_id(id), None);
        }
    }

    #[test]
    fn byte_len_checks_blocks_and_overflow() {
        let q4k = GgmlType::from_id(12).unwrap();
        assert_eq!(q4k.byte_len(&[256, 2]), Ok(288));
        assert!(q4k.byte_len(&[128, 2]).is_err());
        assert!(GgmlType::of(DType::F32).byte_len(&[u64::MAX, 3]).is_err());
        assert!(GgmlType::of(DType::F32).byte_len(&[u64::MAX / 2]).is_err());
    }
}
