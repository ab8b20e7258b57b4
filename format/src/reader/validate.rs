//! The structural checks [`KilnFile::open`](super::KilnFile::open) makes, in the order it makes
//! them: the fixed header, the section bounds, the header checksum, the metadata document, the
//! configuration and the tensor index.

use std::collections::HashMap;

use sha2::{Digest, Sha256};

use super::{hex, unsupported_architecture, TensorInfo};
use crate::dtype::DType;
use crate::error::{FormatError, Result};
use crate::layout::{
    align_up, Cursor, FixedHeader, ALIGNMENT, FORMAT_MAJOR, HEADER_LEN, HEADER_SHA_RANGE, MAGIC,
    MAX_DIM, MAX_DIMS, MAX_FILES_LEN, MAX_INDEX_LEN, MAX_METADATA_LEN, MAX_NAME_LEN, MAX_TENSORS,
};
use crate::metadata::Metadata;

/// Where each section before the tensor data ends, in bytes from the start of the file.
pub(super) struct SectionEnds {
    pub meta_end: u64,
    pub index_end: u64,
    pub files_end: u64,
}

/// The file under check, for its error messages.
struct Checked<'a> {
    label: &'a str,
    file_len: u64,
}

impl Checked<'_> {
    fn truncated(&self, what: &str, start: u64, end: u64) -> FormatError {
        FormatError::Truncated {
            file: self.label.to_string(),
            what: what.to_string(),
            start,
            end,
            len: self.file_len,
        }
    }

    fn bad(&self, field: &'static str, reason: String) -> FormatError {
        FormatError::BadHeader {
            file: self.label.to_string(),
            field,
            reason,
        }
    }
}

/// The fixed header, once the magic and the major version are right.
pub(super) fn read_fixed_header(label: &str, bytes: &[u8]) -> Result<FixedHeader> {
    let file_len = bytes.len() as u64;
    let c = Checked { label, file_len };
    if file_len < 8 || bytes[..8] != MAGIC {
        if file_len >= 8 || (file_len > 0 && !MAGIC.starts_with(bytes)) {
            let n = bytes.len().min(8);
            return Err(FormatError::BadMagic {
                file: label.to_string(),
                found: format!("{:02x?}", &bytes[..n]),
                expected: format!("{MAGIC:02x?}"),
            });
        }
        return Err(c.truncated("the fixed header", 0, HEADER_LEN));
    }
    let Some(head) = bytes.get(..HEADER_LEN as usize) else {
        return Err(c.truncated("the fixed header", 0, HEADER_LEN));
    };
    let header = FixedHeader::decode(head.try_into().expect("128 bytes"));
    if header.major != FORMAT_MAJOR {
        return Err(FormatError::UnsupportedVersion {
            file: label.to_string(),
            major: header.major,
            minor: header.minor,
            supported: FORMAT_MAJOR,
        });
    }
    Ok(header)
}

/// Check every header field against this version's rules and limits, and that the sections
/// it declares fill the file exactly; returns where they end.
pub(super) fn check_header(
    label: &str,
    header: &FixedHeader,
    file_len: u64,
) -> Result<SectionEnds> {
    let c = Checked { label, file_len };
    check_header_flags(&c, header)?;
    let ends = section_ends(&c, header)?;
    check_sections_fit(&c, header, &ends)?;
    Ok(ends)
}

/// The flags, the alignment and the reserved bytes.
fn check_header_flags(c: &Checked, header: &FixedHeader) -> Result<()> {
    if header.flags != 0 {
        return Err(c.bad(
            "flags",
            format!("reserved flags {:#x} must be 0", header.flags),
        ));
    }
    if header.alignment as u64 != ALIGNMENT {
        return Err(c.bad(
            "alignment",
            format!("{} (this version requires {ALIGNMENT})", header.alignment),
        ));
    }
    if header.reserved.iter().any(|&b| b != 0) {
        return Err(c.bad("reserved", "reserved header bytes must be zero".into()));
    }
    Ok(())
}

/// Each section's offset (each follows the one before) and length (each under its limit),
/// and the tensor count's limit.
fn section_ends(c: &Checked, header: &FixedHeader) -> Result<SectionEnds> {
    if header.metadata_offset != HEADER_LEN {
        return Err(c.bad(
            "metadata_offset",
            format!("{} (must be {HEADER_LEN})", header.metadata_offset),
        ));
    }
    if header.metadata_len > MAX_METADATA_LEN {
        return Err(c.bad(
            "metadata_len",
            format!(
                "{} exceeds the limit of {MAX_METADATA_LEN} bytes",
                header.metadata_len
            ),
        ));
    }
    let meta_end = HEADER_LEN + header.metadata_len;
    if header.index_offset != meta_end {
        return Err(c.bad(
            "index_offset",
            format!(
                "{} (must follow the metadata at {meta_end})",
                header.index_offset
            ),
        ));
    }
    if header.index_len > MAX_INDEX_LEN {
        return Err(c.bad(
            "index_len",
            format!(
                "{} exceeds the limit of {MAX_INDEX_LEN} bytes",
                header.index_len
            ),
        ));
    }
    let index_end = meta_end + header.index_len;
    if header.files_len > MAX_FILES_LEN {
        return Err(c.bad(
            "files_len",
            format!(
                "{} exceeds the limit of {MAX_FILES_LEN} bytes",
                header.files_len
            ),
        ));
    }
    let files_end = index_end + header.files_len;
    let expected_data = align_up(files_end).expect("bounded by limits");
    if header.data_offset != expected_data {
        return Err(c.bad(
            "data_offset",
            format!(
                "{} (must be the end of the index and files section, {files_end}, rounded \
                 up to {ALIGNMENT}: {expected_data})",
                header.data_offset
            ),
        ));
    }
    if header.tensor_count > MAX_TENSORS {
        return Err(c.bad(
            "tensor_count",
            format!("{} exceeds the limit of {MAX_TENSORS}", header.tensor_count),
        ));
    }
    Ok(SectionEnds {
        meta_end,
        index_end,
        files_end,
    })
}

/// The sections end inside the file, and the data section ends where the file does.
fn check_sections_fit(c: &Checked, header: &FixedHeader, ends: &SectionEnds) -> Result<()> {
    let data_end = header
        .data_offset
        .checked_add(header.data_len)
        .ok_or_else(|| c.bad("data_len", format!("{} overflows", header.data_len)))?;
    if ends.index_end > c.file_len {
        return Err(c.truncated("the metadata and tensor index", HEADER_LEN, ends.index_end));
    }
    if ends.files_end > c.file_len {
        return Err(c.truncated("the files section", ends.index_end, ends.files_end));
    }
    if data_end > c.file_len {
        return Err(c.truncated("the tensor data", header.data_offset, data_end));
    }
    if data_end < c.file_len {
        return Err(c.bad(
            "data_len",
            format!(
                "the file has {} bytes after the data section ends at {data_end}",
                c.file_len - data_end
            ),
        ));
    }
    Ok(())
}

/// The header checksum (over the fixed header minus the checksum itself, the metadata, the
/// index and the files section), and the zero padding before the data section.
pub(super) fn check_header_checksum(
    label: &str,
    bytes: &[u8],
    header: &FixedHeader,
    files_end: u64,
) -> Result<()> {
    let mut h = Sha256::new();
    h.update(&bytes[..HEADER_SHA_RANGE.start]);
    h.update(&bytes[HEADER_LEN as usize..files_end as usize]);
    let computed: [u8; 32] = h.finalize().into();
    if computed != header.header_sha256 {
        return Err(FormatError::HeaderChecksum {
            file: label.to_string(),
            stored: hex(&header.header_sha256),
            computed: hex(&computed),
        });
    }
    if bytes[files_end as usize..header.data_offset as usize]
        .iter()
        .any(|&b| b != 0)
    {
        return Err(FormatError::BadHeader {
            file: label.to_string(),
            field: "data_offset",
            reason: "padding before the data section is not zero".into(),
        });
    }
    Ok(())
}

/// The metadata document, its nesting bounded before serde reads it.
pub(super) fn parse_metadata(label: &str, meta_bytes: &[u8]) -> Result<Metadata> {
    if crate::metadata::json_depth_exceeds(meta_bytes, crate::metadata::MAX_JSON_DEPTH) {
        return Err(FormatError::BadMetadata {
            file: label.to_string(),
            field: "(document)".into(),
            reason: format!(
                "JSON nested deeper than {} levels",
                crate::metadata::MAX_JSON_DEPTH
            ),
        });
    }
    serde_json::from_slice(meta_bytes).map_err(|e| {
        unsupported_architecture(label, meta_bytes).unwrap_or_else(|| {
            let (field, reason) = if e.is_data() {
                crate::metadata::locate_json_error(meta_bytes, &e)
            } else {
                ("(json)".to_string(), e.to_string())
            };
            FormatError::BadMetadata {
                file: label.to_string(),
                field,
                reason,
            }
        })
    })
}

/// The one validation of the configuration, before anything is sized by it: it also bounds
/// the tensors `num_layers` implies (counted, not listed) by what a file can hold.
pub(super) fn check_config(label: &str, metadata: &Metadata, tensor_count: u32) -> Result<()> {
    if let Err(p) = metadata.config.check() {
        let reason = if p.field == "num_layers" {
            format!("{} (this file's index declares {})", p.reason, tensor_count)
        } else {
            p.reason
        };
        return Err(FormatError::BadMetadata {
            file: label.to_string(),
            field: format!("config.{}", p.field),
            reason,
        });
    }
    Ok(())
}

/// Each tensor's position in the index by name; a name listed twice is refused.
pub(super) fn index_by_name(label: &str, tensors: &[TensorInfo]) -> Result<HashMap<String, usize>> {
    let mut by_name = HashMap::with_capacity(tensors.len());
    for (i, t) in tensors.iter().enumerate() {
        if by_name.insert(t.name.clone(), i).is_some() {
            return Err(FormatError::BadTensor {
                file: label.to_string(),
                tensor: t.name.clone(),
                reason: "the name appears twice in the index".into(),
            });
        }
    }
    Ok(by_name)
}

/// What the index's records are checked against.
struct IndexCheck<'a> {
    label: &'a str,
    header: &'a FixedHeader,
    /// The whole file.
    bytes: &'a [u8],
}

/// One index record as stored, before its placement is checked.
struct Record {
    name: String,
    dtype: DType,
    shape: Vec<u64>,
    offset: u64,
    len: u64,
    sha256: [u8; 32],
}

/// Parse and check the tensor index: every record, each tensor stored in index order at the
/// previous end rounded up to the alignment, zero padding between them, and the data section
/// ending where the last tensor does.
pub(super) fn parse_index(
    label: &str,
    index: &[u8],
    header: &FixedHeader,
    bytes: &[u8],
) -> Result<Vec<TensorInfo>> {
    let check = IndexCheck {
        label,
        header,
        bytes,
    };
    let mut cur = Cursor::new(index);
    // Every record is at least 60 bytes, so the count is also bounded by the index length;
    // capping the capacity this way means a corrupt count cannot force a large allocation.
    let cap = (header.tensor_count as usize).min(index.len() / 60);
    let mut tensors = Vec::with_capacity(cap);
    let mut expected_offset = 0u64;
    for entry in 0..header.tensor_count as usize {
        let r = read_record(label, &mut cur, entry)?;
        expected_offset = check.placement(&r, expected_offset)?;
        tensors.push(TensorInfo {
            name: r.name,
            dtype: r.dtype,
            shape: r.shape,
            offset: header.data_offset + r.offset,
            len: r.len,
            sha256: r.sha256,
        });
    }
    if cur.remaining() != 0 {
        return Err(FormatError::BadHeader {
            file: label.to_string(),
            field: "index_len",
            reason: format!(
                "{} bytes are left in the index after {} records",
                cur.remaining(),
                header.tensor_count
            ),
        });
    }
    let last_end = tensors
        .last()
        .map(|t| t.offset + t.len - header.data_offset)
        .unwrap_or(0);
    if last_end != header.data_len {
        return Err(FormatError::BadHeader {
            file: label.to_string(),
            field: "data_len",
            reason: format!("{} but the last tensor ends at {last_end}", header.data_len),
        });
    }
    Ok(tensors)
}

/// Read index record number `entry`: its name, dtype, shape, offset, length and checksum,
/// each within its limits.
fn read_record(label: &str, cur: &mut Cursor<'_>, entry: usize) -> Result<Record> {
    let err = |reason: String| FormatError::BadIndexEntry {
        file: label.to_string(),
        entry,
        reason,
    };
    let name_len = cur.u32("name length").map_err(err)?;
    if name_len == 0 || name_len > MAX_NAME_LEN {
        return Err(err(format!(
            "name length {name_len} is outside 1..={MAX_NAME_LEN}"
        )));
    }
    let name_bytes = cur.take(name_len as usize, "name").map_err(err)?;
    let name = std::str::from_utf8(name_bytes)
        .map_err(|e| err(format!("name is not UTF-8: {e}")))?
        .to_string();
    if name.chars().any(char::is_control) {
        return Err(err(format!("name {name:?} contains control characters")));
    }
    let terr = |reason: String| FormatError::BadTensor {
        file: label.to_string(),
        tensor: name.clone(),
        reason,
    };
    let dtype_id = cur.u32("dtype").map_err(terr)?;
    let dtype = DType::from_id(dtype_id).ok_or_else(|| {
        terr(format!(
            "unknown dtype id {dtype_id} (this build knows {}); the file may come from a newer Kiln",
            DType::ALL.map(|d| format!("{}={}", d.name(), d.id())).join(", ")
        ))
    })?;
    let ndim = cur.u32("rank").map_err(terr)?;
    if ndim == 0 || ndim > MAX_DIMS {
        return Err(terr(format!("rank {ndim} is outside 1..={MAX_DIMS}")));
    }
    let mut shape = Vec::with_capacity(ndim as usize);
    for _ in 0..ndim {
        let d = cur.u64("dimension").map_err(terr)?;
        if d == 0 || d > MAX_DIM {
            return Err(terr(format!("dimension {d} is outside 1..={MAX_DIM}")));
        }
        shape.push(d);
    }
    let offset = cur.u64("offset").map_err(terr)?;
    let len = cur.u64("length").map_err(terr)?;
    let sha256: [u8; 32] = cur
        .take(32, "sha256")
        .map_err(terr)?
        .try_into()
        .expect("32 bytes");
    Ok(Record {
        name,
        dtype,
        shape,
        offset,
        len,
        sha256,
    })
}

impl IndexCheck<'_> {
    /// Check that a record's length matches its dtype and shape, that it starts where the
    /// previous tensor's padding ends and ends inside the data section, and that its own
    /// padding is zero; returns where the next tensor must start.
    fn placement(&self, r: &Record, expected_offset: u64) -> Result<u64> {
        let header = self.header;
        let (offset, len) = (r.offset, r.len);
        let terr = |reason: String| FormatError::BadTensor {
            file: self.label.to_string(),
            tensor: r.name.clone(),
            reason,
        };
        let expected_len = r.dtype.byte_len(&r.shape).map_err(terr)?;
        if len != expected_len {
            return Err(terr(format!(
                "byte length {len} does not match {} {:?} ({expected_len} bytes)",
                r.dtype, r.shape
            )));
        }
        if offset != expected_offset {
            let why = if offset < expected_offset {
                "overlaps the previous tensor"
            } else {
                "leaves a gap after the previous tensor"
            };
            return Err(terr(format!(
                "data offset {offset} {why}: tensors are stored in index order, each at the \
                 previous end rounded up to {ALIGNMENT} (expected {expected_offset})"
            )));
        }
        let end = offset
            .checked_add(len)
            .filter(|&e| e <= header.data_len)
            .ok_or_else(|| {
                terr(format!(
                    "bytes {offset}..{} run past the end of the data section ({} bytes)",
                    offset.saturating_add(len),
                    header.data_len
                ))
            })?;
        let next = align_up(end).expect("end <= data_len, far below u64::MAX");
        // Padding between this tensor and the next must be zero.
        let pad_start = (header.data_offset + end) as usize;
        let pad_end = (header.data_offset + next.min(header.data_len)) as usize;
        if self.bytes[pad_start..pad_end].iter().any(|&b| b != 0) {
            return Err(terr("the padding after the tensor is not zero".into()));
        }
        Ok(next)
    }
}
