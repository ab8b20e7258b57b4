//! The on-disk layout: the fixed header, the tensor-index records, and the limits a reader
//! enforces before it trusts any length read from disk.
//!
//! ```text
//! 0        fixed header (128 bytes)
//! 128      metadata (UTF-8 JSON, metadata_len bytes)
//! ..       tensor index (index_len bytes, tensor_count records)
//! ..       files section (files_len bytes, since 1.3; empty in most files)
//! ..       zero padding up to data_offset (a multiple of 64)
//! data     tensors, each at a multiple of 64 from data_offset, zero padding between
//! ```
//! Everything is little-endian. See `docs/FORMAT.md` for the full specification.

use crate::dtype::DType;

/// The eight magic bytes. The `\r\n\x1a\n` tail (as in PNG) detects text-mode mangling.
pub const MAGIC: [u8; 8] = *b"KILN\r\n\x1a\n";
/// The major version this build writes and reads. Readers refuse any other major version.
pub const FORMAT_MAJOR: u16 = 1;
/// The newest minor version this build writes. Minor versions only add; any minor is read.
/// 1.1 added the `q4_0x16` dtype; 1.2 added `q5_0`, `q5_1`, `q4_k`, `q5_k` and `q6_k`; 1.3
/// added the files section (packed metadata fields, [`crate::packed`]); 1.4 added `q2_k`,
/// `q3_k`, `iq4_nl` and `iq4_xs`; 1.5 added an embedding model's dense layers (the
/// `embedding.dense` metadata field and the `dense.K.*` tensors); 1.6 added `iq4_nlx16`; 1.7
/// added `iq4_xsx16`.
pub const FORMAT_MINOR: u16 = 7;

/// The minor version that introduced dense layers: a file holding a `dense.K.*` tensor says
/// at least this.
pub const MINOR_DENSE: u16 = 5;

/// The minor version that introduced the files section: a file with a non-empty one says at
/// least this.
pub const MINOR_FILES: u16 = 3;

/// The minor version that introduced `dtype` (0 for the original ones).
pub const fn minor_of(dtype: crate::DType) -> u16 {
    use crate::DType;
    match dtype {
        DType::F32 | DType::F16 | DType::BF16 | DType::Q8_0 | DType::Q4_0 => 0,
        DType::Q4_0x16 => 1,
        DType::Q5_0 | DType::Q5_1 | DType::Q4_K | DType::Q5_K | DType::Q6_K => 2,
        DType::Q2_K | DType::Q3_K | DType::IQ4_NL | DType::IQ4_XS => 4,
        DType::IQ4_NLx16 => 6,
        DType::IQ4_XSx16 => 7,
    }
}

/// The minor version a file holding tensors of `dtypes` is written with: the lowest that
/// describes it, so that a file of the original dtypes stays 1.0 and a 1.0 reader still
/// reads it.
pub fn minor_for(dtypes: impl IntoIterator<Item = crate::DType>) -> u16 {
    dtypes.into_iter().map(minor_of).max().unwrap_or(0)
}
/// Size of the fixed header.
pub const HEADER_LEN: u64 = 128;
/// Alignment of the data section and of every tensor within it: a cache line, and enough for
/// any SIMD load of an element type, so memory-mapped views are aligned and zero-copy.
pub const ALIGNMENT: u64 = 64;
/// Byte range of the header checksum within the fixed header.
pub const HEADER_SHA_RANGE: std::ops::Range<usize> = 96..128;

/// Largest metadata section a reader accepts. The biggest tokenizers in use are ~10 MB of JSON;
/// 256 MiB leaves room while refusing to parse a multi-gigabyte "metadata" from a corrupt file.
pub const MAX_METADATA_LEN: u64 = 256 << 20;
/// Largest files section a reader accepts. Its fields, decoded, count towards
/// [`MAX_METADATA_LEN`] (they are metadata), and a zlib stream is never much longer than its
/// text, so this is the same bound.
pub const MAX_FILES_LEN: u64 = MAX_METADATA_LEN;
/// Largest tensor index a reader accepts (a million tensors with long names fit).
pub const MAX_INDEX_LEN: u64 = 128 << 20;
/// Most tensors in one file. Large models have a few thousand.
pub const MAX_TENSORS: u32 = 1 << 20;
/// Longest tensor name in bytes.
pub const MAX_NAME_LEN: u32 = 1024;
/// Most dimensions of a tensor.
pub const MAX_DIMS: u32 = 4;
/// Largest single dimension (2^40): far above any real model, far below overflow.
pub const MAX_DIM: u64 = 1 << 40;

/// Round `x` up to a multiple of [`ALIGNMENT`], or `None` on overflow.
pub fn align_up(x: u64) -> Option<u64> {
    x.checked_add(ALIGNMENT - 1)
        .map(|v| v / ALIGNMENT * ALIGNMENT)
}

/// The fixed header, decoded but not yet validated against the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FixedHeader {
    pub major: u16,
    pub minor: u16,
    pub flags: u32,
    pub metadata_offset: u64,
    pub metadata_len: u64,
    pub index_offset: u64,
    pub index_len: u64,
    pub data_offset: u64,
    pub data_len: u64,
    pub tensor_count: u32,
    pub alignment: u32,
    /// Length of the files section after the index (0 before 1.3, and when nothing is packed).
    pub files_len: u64,
    pub reserved: [u8; 16],
    pub header_sha256: [u8; 32],
}

impl FixedHeader {
    /// Serialize to the 128 on-disk bytes.
    pub fn encode(&self) -> [u8; HEADER_LEN as usize] {
        let mut b = [0u8; HEADER_LEN as usize];
        b[0..8].copy_from_slice(&MAGIC);
        b[8..10].copy_from_slice(&self.major.to_le_bytes());
        b[10..12].copy_from_slice(&self.minor.to_le_bytes());
        b[12..16].copy_from_slice(&self.flags.to_le_bytes());
        b[16..24].copy_from_slice(&self.metadata_offset.to_le_bytes());
        b[24..32].copy_from_slice(&self.metadata_len.to_le_bytes());
        b[32..40].copy_from_slice(&self.index_offset.to_le_bytes());
        b[40..48].copy_from_slice(&self.index_len.to_le_bytes());
        b[48..56].copy_from_slice(&self.data_offset.to_le_bytes());
        b[56..64].copy_from_slice(&self.data_len.to_le_bytes());
        b[64..68].copy_from_slice(&self.tensor_count.to_le_bytes());
        b[68..72].copy_from_slice(&self.alignment.to_le_bytes());
        b[72..80].copy_from_slice(&self.files_len.to_le_bytes());
        b[80..96].copy_from_slice(&self.reserved);
        b[HEADER_SHA_RANGE].copy_from_slice(&self.header_sha256);
        b
    }

    /// Decode the 128 header bytes. The magic is checked by the caller.
    pub fn decode(b: &[u8; HEADER_LEN as usize]) -> FixedHeader {
        let u16_at = |o: usize| u16::from_le_bytes([b[o], b[o + 1]]);
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().expect("4 bytes"));
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().expect("8 bytes"));
        FixedHeader {
            major: u16_at(8),
            minor: u16_at(10),
            flags: u32_at(12),
            metadata_offset: u64_at(16),
            metadata_len: u64_at(24),
            index_offset: u64_at(32),
            index_len: u64_at(40),
            data_offset: u64_at(48),
            data_len: u64_at(56),
            tensor_count: u32_at(64),
            alignment: u32_at(68),
            files_len: u64_at(72),
            reserved: b[80..96].try_into().expect("16 bytes"),
            header_sha256: b[HEADER_SHA_RANGE].try_into().expect("32 bytes"),
        }
    }
}

/// One tensor-index record as stored (offset relative to the data section).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexRecord {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<u64>,
    pub offset: u64,
    pub len: u64,
    pub sha256: [u8; 32],
}

impl IndexRecord {
    /// Bytes this record occupies in the index.
    pub fn encoded_len(name_len: usize, ndim: usize) -> usize {
        4 + name_len + 4 + 4 + 8 * ndim + 8 + 8 + 32
    }

    /// Append the record's bytes.
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&(self.name.len() as u32).to_le_bytes());
        out.extend_from_slice(self.name.as_bytes());
        out.extend_from_slice(&self.dtype.id().to_le_bytes());
        out.extend_from_slice(&(self.shape.len() as u32).to_le_bytes());
        for d in &self.shape {
            out.extend_from_slice(&d.to_le_bytes());
        }
        out.extend_from_slice(&self.offset.to_le_bytes());
        out.extend_from_slice(&self.len.to_le_bytes());
        out.extend_from_slice(&self.sha256);
    }
}

/// A bounds-checked little-endian cursor over untrusted bytes.
#[derive(Debug)]
pub(crate) struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
    /// The section read, as messages name it.
    section: &'static str,
}

impl<'a> Cursor<'a> {
    /// A cursor over the tensor index.
    pub(crate) fn new(bytes: &'a [u8]) -> Self {
        Self::over(bytes, "index")
    }

    /// A cursor over `section`, which messages name.
    pub(crate) fn over(bytes: &'a [u8], section: &'static str) -> Self {
        Cursor {
            bytes,
            pos: 0,
            section,
        }
    }

    pub(crate) fn remaining(&self) -> usize {
        self.bytes.len() - self.pos
    }

    pub(crate) fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], String> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.bytes.len())
            .ok_or_else(|| {
                format!(
                    "{what} needs {n} bytes at {} offset {} but only {} remain",
                    self.section,
                    self.pos,
                    self.remaining()
                )
            })?;
        let s = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    pub(crate) fn u32(&mut self, what: &str) -> Result<u32, String> {
        Ok(u32::from_le_bytes(
            self.take(4, what)?.try_into().expect("4 bytes"),
        ))
    }

    pub(crate) fn u64(&mut self, what: &str) -> Result<u64, String> {
        Ok(u64::from_le_bytes(
            self.take(8, what)?.try_into().expect("8 bytes"),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trips() {
        let h = FixedHeader {
            major: 1,
            minor: 3,
            flags: 0,
            metadata_offset: 128,
            metadata_len: 77,
            index_offset: 205,
            index_len: 1000,
            data_offset: 1216,
            data_len: 1 << 33,
            tensor_count: 12,
            alignment: 64,
            files_len: 5000,
            reserved: [0; 16],
            header_sha256: [7; 32],
        };
        let b = h.encode();
        assert_eq!(&b[..8], &MAGIC);
        assert_eq!(FixedHeader::decode(&b), h);
    }

    #[test]
    fn align_up_works() {
        assert_eq!(align_up(0), Some(0));
        assert_eq!(align_up(1), Some(64));
        assert_eq!(align_up(64), Some(64));
        assert_eq!(align_up(u64::MAX), None);
    }
}
