//! The GGUF reader: bytes → a validated header (metadata and tensor table), with every count,
//! length, offset and size checked before it is used.
//!
//! Hostile input is the normal case here: every length read from the file is capped by a
//! named constant and by the bytes actually left, so no allocation exceeds a small multiple of
//! the file size, and all arithmetic on sizes and offsets is checked. A parsed [`GgufHeader`]
//! guarantees that every tensor's bytes lie inside the file, aligned and without overlap.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use super::types::{GgmlType, ValueType};
use super::value::{Array, Value};
use crate::error::{ConvertError, Result};

/// The first four bytes of every GGUF file.
pub const MAGIC: [u8; 4] = *b"GGUF";
/// Versions read: 2 and 3 share one little-endian layout (version 1 had 32-bit counts).
pub const SUPPORTED_VERSIONS: [u32; 2] = [2, 3];
/// Alignment of tensor data when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// Most tensors accepted: large models hold a few thousand.
pub const MAX_TENSORS: u64 = 1 << 20;
/// Most metadata entries accepted: real files hold a few dozen.
pub const MAX_KV: u64 = 1 << 16;
/// Longest key accepted (keys are dotted identifiers).
pub const MAX_KEY_LEN: u64 = 1 << 16;
/// Longest string value accepted: chat templates are the long ones, a few tens of KB.
pub const MAX_STRING_LEN: u64 = 1 << 26;
/// Most array elements accepted: vocabularies and merge lists reach a few hundred thousand.
pub const MAX_ARRAY_LEN: u64 = 1 << 26;
/// Longest tensor name: GGML's `GGML_MAX_NAME` (64) less the terminating NUL.
pub const MAX_TENSOR_NAME: u64 = 63;
/// Most dimensions of a tensor (`GGML_MAX_DIMS`).
pub const MAX_DIMS: u32 = 4;
/// Largest `general.alignment` accepted (a power of two).
pub const MAX_ALIGNMENT: u64 = 1 << 16;

/// One tensor of a GGUF file.
#[derive(Debug, Clone, PartialEq)]
pub struct GgufTensor {
    /// The name as stored (`blk.0.attn_q.weight`).
    pub name: String,
    /// Dimensions in GGML order: `dims[0]` is the innermost (contiguous) one.
    pub dims: Vec<u64>,
    /// Element type.
    pub ggml_type: GgmlType,
    /// Absolute byte offset of the data in the file.
    pub offset: u64,
    /// Byte length of the data.
    pub len: u64,
}

impl GgufTensor {
    /// The shape in row-major (PyTorch) order: the GGML dims reversed.
    pub fn shape(&self) -> Vec<u64> {
        self.dims.iter().rev().copied().collect()
    }
}

/// A parsed and validated GGUF header.
#[derive(Debug, Clone, PartialEq)]
pub struct GgufHeader {
    /// Format version (2 or 3).
    pub version: u32,
    /// Metadata in file order, keys unique.
    pub metadata: Vec<(String, Value)>,
    /// Tensors in file order, names unique.
    pub tensors: Vec<GgufTensor>,
    /// Alignment of the tensor data.
    pub alignment: u64,
    /// Absolute offset of the tensor data section.
    pub data_offset: u64,
}

impl GgufHeader {
    /// The value of `key`, if present.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    /// The tensor named `name`, if present.
    pub fn tensor(&self, name: &str) -> Option<&GgufTensor> {
        self.tensors.iter().find(|t| t.name == name)
    }
}

/// A memory-mapped GGUF file with its parsed header.
pub struct GgufFile {
    path: PathBuf,
    map: Mmap,
    header: GgufHeader,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .finish()
    }
}

impl GgufFile {
    /// Map and parse a GGUF file.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile> {
        let path = path.as_ref().to_path_buf();
        // A FIFO or a device (`/dev/zero`) is refused without blocking or reading it.
        let file = kiln_format::open_regular(&path, "GGUF file")?;
        // SAFETY: a read-only private map; the input must not be modified while it is being
        // read (the contract of every memory-mapped model loader). All access goes through
        // `parse`'s bounds-checked header.
        let map =
            unsafe { Mmap::map(&file) }.map_err(|e| ConvertError::io(&path, "cannot map", e))?;
        let header = parse(&path.display().to_string(), &map)?;
        Ok(GgufFile { path, map, header })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The parsed header.
    pub fn header(&self) -> &GgufHeader {
        &self.header
    }

    /// The whole file.
    pub fn bytes(&self) -> &[u8] {
        &self.map
    }

    /// The bytes of a tensor of this file's header.
    pub fn tensor_bytes(&self, t: &GgufTensor) -> &[u8] {
        tensor_bytes(&self.map, t)
    }
}

/// The bytes of `t` in `file` (empty if `t` does not belong to a header parsed from `file`).
pub fn tensor_bytes<'a>(file: &'a [u8], t: &GgufTensor) -> &'a [u8] {
    usize::try_from(t.offset)
        .ok()
        .zip(usize::try_from(t.offset.saturating_add(t.len)).ok())
        .and_then(|(a, b)| file.get(a..b))
        .unwrap_or(&[])
}

struct Cursor<'a> {
    file: &'a str,
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn left(&self) -> u64 {
        (self.bytes.len() - self.pos) as u64
    }

    fn take(&mut self, n: u64, what: &dyn Fn() -> String) -> Result<&'a [u8]> {
        let end = (self.pos as u64).checked_add(n);
        match end {
            Some(end) if end <= self.bytes.len() as u64 => {
                let s = &self.bytes[self.pos..end as usize];
                self.pos = end as usize;
                Ok(s)
            }
            _ => Err(ConvertError::GgufTruncated {
                file: self.file.to_string(),
                what: what(),
                offset: self.pos as u64,
                need: n,
                len: self.bytes.len() as u64,
            }),
        }
    }

    fn array<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N]> {
        let s = self.take(N as u64, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn malformed(&self, at: usize, reason: impl Into<String>) -> ConvertError {
        ConvertError::GgufMalformed {
            file: self.file.to_string(),
            offset: at as u64,
            reason: reason.into(),
        }
    }

    fn limit(&self, what: String, value: u64, limit: u64) -> ConvertError {
        ConvertError::GgufLimit {
            file: self.file.to_string(),
            what,
            value,
            limit,
        }
    }

    /// A count or length, capped by `limit` and by what the bytes left can hold at
    /// `min_size` bytes per item.
    fn count(&mut self, what: &dyn Fn() -> String, limit: u64, min_size: u64) -> Result<u64> {
        let n = self.u64(what)?;
        if n > limit {
            return Err(self.limit(what(), n, limit));
        }
        let need = n.saturating_mul(min_size);
        if need > self.left() {
            return Err(ConvertError::GgufTruncated {
                file: self.file.to_string(),
                what: format!("{} ({n} declared)", what()),
                offset: self.pos as u64,
                need,
                len: self.bytes.len() as u64,
            });
        }
        Ok(n)
    }

    fn string(&mut self, what: &dyn Fn() -> String, limit: u64) -> Result<String> {
        let at = self.pos;
        let n = self.count(&|| format!("length of {}", what()), limit, 1)?;
        let s = self.take(n, what)?;
        String::from_utf8(s.to_vec())
            .map_err(|e| self.malformed(at, format!("{} is not UTF-8: {e}", what())))
    }

    fn value_type(&mut self, what: &dyn Fn() -> String) -> Result<ValueType> {
        let at = self.pos;
        let id = self.u32(what)?;
        ValueType::from_id(id)
            .ok_or_else(|| self.malformed(at, format!("{}: unknown value type {id}", what())))
    }

    fn value(&mut self, ty: ValueType, what: &dyn Fn() -> String) -> Result<Value> {
        Ok(match ty {
            ValueType::U8 => Value::U8(self.array::<1>(what)?[0]),
            ValueType::I8 => Value::I8(i8::from_le_bytes(self.array(what)?)),
            ValueType::U16 => Value::U16(u16::from_le_bytes(self.array(what)?)),
            ValueType::I16 => Value::I16(i16::from_le_bytes(self.array(what)?)),
            ValueType::U32 => Value::U32(self.u32(what)?),
            ValueType::I32 => Value::I32(i32::from_le_bytes(self.array(what)?)),
            ValueType::F32 => Value::F32(f32::from_le_bytes(self.array(what)?)),
            ValueType::U64 => Value::U64(self.u64(what)?),
            ValueType::I64 => Value::I64(i64::from_le_bytes(self.array(what)?)),
            ValueType::F64 => Value::F64(f64::from_le_bytes(self.array(what)?)),
            ValueType::Bool => {
                let at = self.pos;
                match self.array::<1>(what)?[0] {
                    0 => Value::Bool(false),
                    1 => Value::Bool(true),
                    b => return Err(self.malformed(at, format!("{}: boolean byte {b}", what()))),
                }
            }
            ValueType::String => Value::Str(self.string(what, MAX_STRING_LEN)?),
            ValueType::Array => Value::Array(self.array_value(what)?),
        })
    }

    fn array_value(&mut self, what: &dyn Fn() -> String) -> Result<Array> {
        let at = self.pos;
        let elem = self.value_type(&|| format!("element type of {}", what()))?;
        if elem == ValueType::Array {
            return Err(self.malformed(at, format!("{}: nested arrays are not supported", what())));
        }
        let n = self.count(
            &|| format!("element count of {}", what()),
            MAX_ARRAY_LEN,
            elem.min_size(),
        )?;
        let n = n as usize; // <= MAX_ARRAY_LEN and <= bytes left
        macro_rules! fixed {
            ($variant:ident, $t:ty) => {{
                let raw = self.take(n as u64 * std::mem::size_of::<$t>() as u64, what)?;
                Array::$variant(
                    raw.chunks_exact(std::mem::size_of::<$t>())
                        .map(|c| <$t>::from_le_bytes(c.try_into().expect("exact chunk")))
                        .collect(),
                )
            }};
        }
        Ok(match elem {
            ValueType::U8 => Array::U8(self.take(n as u64, what)?.to_vec()),
            ValueType::I8 => fixed!(I8, i8),
            ValueType::U16 => fixed!(U16, u16),
            ValueType::I16 => fixed!(I16, i16),
            ValueType::U32 => fixed!(U32, u32),
            ValueType::I32 => fixed!(I32, i32),
            ValueType::F32 => fixed!(F32, f32),
            ValueType::U64 => fixed!(U64, u64),
            ValueType::I64 => fixed!(I64, i64),
            ValueType::F64 => fixed!(F64, f64),
            ValueType::Bool => {
                let at = self.pos;
                let raw = self.take(n as u64, what)?;
                if let Some(i) = raw.iter().position(|&b| b > 1) {
                    return Err(
                        self.malformed(at + i, format!("{}[{i}]: boolean byte {}", what(), raw[i]))
                    );
                }
                Array::Bool(raw.iter().map(|&b| b == 1).collect())
            }
            ValueType::String => {
                let mut v = Vec::with_capacity(n);
                for i in 0..n {
                    v.push(self.string(&|| format!("{}[{i}]", what()), MAX_STRING_LEN)?);
                }
                Array::Str(v)
            }
            ValueType::Array => unreachable!("refused above"),
        })
    }
}

fn tensor_error(file: &str, tensor: &str, reason: impl Into<String>) -> ConvertError {
    ConvertError::GgufTensor {
        file: file.to_string(),
        tensor: tensor.to_string(),
        reason: reason.into(),
    }
}

/// Parse and validate a whole GGUF file held in memory. `file` names it in errors.
pub fn parse(file: &str, bytes: &[u8]) -> Result<GgufHeader> {
    let mut c = Cursor {
        file,
        bytes,
        pos: 0,
    };
    let version = read_version(&mut c)?;
    let n_tensors = c.u64(&|| "the tensor count".into())?;
    if n_tensors > MAX_TENSORS {
        return Err(c.limit("tensor count".into(), n_tensors, MAX_TENSORS));
    }
    let n_kv = c.count(&|| "the metadata count".into(), MAX_KV, MIN_KV)?;
    // The tensor count is checked against the bytes left after the metadata, below.
    let metadata = read_metadata(&mut c, n_kv)?;
    let alignment = alignment_of(file, &metadata)?;
    let mut tensors = read_tensor_table(&mut c, n_tensors, alignment)?;
    let data_offset = (c.pos as u64)
        .checked_next_multiple_of(alignment)
        .ok_or_else(|| c.malformed(c.pos, "data offset overflows"))?;
    place_tensors(file, bytes.len() as u64, &mut tensors, data_offset)?;
    check_no_overlap(file, &tensors)?;
    Ok(GgufHeader {
        version,
        metadata,
        tensors,
        alignment,
        data_offset,
    })
}

// Minimum bytes of one tensor-info record (name length, n_dims, type, offset) and of one
// key/value record (key length, type, a one-byte value).
const MIN_TENSOR_INFO: u64 = 8 + 4 + 4 + 8;
const MIN_KV: u64 = 8 + 4 + 1;

/// The magic, then the version, which must be one this reader supports.
fn read_version(c: &mut Cursor<'_>) -> Result<u32> {
    let magic: [u8; 4] = c.array(&|| "the magic".into())?;
    if magic != MAGIC {
        return Err(ConvertError::GgufBadMagic {
            file: c.file.to_string(),
            found: format!("{magic:02x?}"),
        });
    }
    let version = c.u32(&|| "the version".into())?;
    if !SUPPORTED_VERSIONS.contains(&version) {
        return Err(ConvertError::GgufVersion {
            file: c.file.to_string(),
            version,
            byte_swapped: SUPPORTED_VERSIONS.contains(&version.swap_bytes()),
        });
    }
    Ok(version)
}

/// `n_kv` key/value records, each key unique.
fn read_metadata(c: &mut Cursor<'_>, n_kv: u64) -> Result<Vec<(String, Value)>> {
    let mut metadata: Vec<(String, Value)> = Vec::new();
    let mut keys = HashSet::new();
    for i in 0..n_kv {
        let at = c.pos;
        let key = c.string(&|| format!("metadata key #{i}"), MAX_KEY_LEN)?;
        let ty = c.value_type(&|| format!("type of metadata `{key}`"))?;
        let value = c.value(ty, &|| format!("metadata `{key}`"))?;
        if !keys.insert(key.clone()) {
            return Err(c.malformed(at, format!("metadata key `{key}` appears twice")));
        }
        metadata.push((key, value));
    }
    Ok(metadata)
}

/// `general.alignment` (a u32 power of two up to [`MAX_ALIGNMENT`]), or GGUF's default.
fn alignment_of(file: &str, metadata: &[(String, Value)]) -> Result<u64> {
    match metadata.iter().find(|(k, _)| k == "general.alignment") {
        None => Ok(DEFAULT_ALIGNMENT),
        Some((_, Value::U32(a))) if a.is_power_of_two() && u64::from(*a) <= MAX_ALIGNMENT => {
            Ok(u64::from(*a))
        }
        Some((_, v)) => Err(ConvertError::GgufKey {
            file: file.to_string(),
            key: "general.alignment".into(),
            reason: format!("expected a u32 power of two up to {MAX_ALIGNMENT}, found {v:?}"),
        }),
    }
}

/// The tensor table: `n_tensors` records (bounded first by the bytes left), names unique,
/// offsets relative to the data section.
fn read_tensor_table(
    c: &mut Cursor<'_>,
    n_tensors: u64,
    alignment: u64,
) -> Result<Vec<GgufTensor>> {
    let file = c.file;
    if n_tensors.saturating_mul(MIN_TENSOR_INFO) > c.left() {
        return Err(ConvertError::GgufTruncated {
            file: file.to_string(),
            what: format!("the tensor table ({n_tensors} tensors declared)"),
            offset: c.pos as u64,
            need: n_tensors.saturating_mul(MIN_TENSOR_INFO),
            len: c.bytes.len() as u64,
        });
    }
    let mut tensors = Vec::with_capacity(n_tensors as usize);
    let mut names = HashSet::new();
    for i in 0..n_tensors {
        let t = read_tensor_info(c, i, alignment)?;
        if !names.insert(t.name.clone()) {
            return Err(tensor_error(
                file,
                &t.name,
                "the name appears twice in the tensor table",
            ));
        }
        tensors.push(t);
    }
    Ok(tensors)
}

/// Tensor record `i`: name, dimensions, GGML type and an aligned offset.
fn read_tensor_info(c: &mut Cursor<'_>, i: u64, alignment: u64) -> Result<GgufTensor> {
    let file = c.file;
    let name = c.string(&|| format!("name of tensor #{i}"), MAX_TENSOR_NAME)?;
    let n_dims = c.u32(&|| format!("dimension count of tensor `{name}`"))?;
    if n_dims > MAX_DIMS {
        return Err(tensor_error(
            file,
            &name,
            format!("{n_dims} dimensions, GGML allows at most {MAX_DIMS}"),
        ));
    }
    let mut dims = Vec::with_capacity(n_dims as usize);
    for d in 0..n_dims {
        let v = c.u64(&|| format!("dimension {d} of tensor `{name}`"))?;
        if v > i64::MAX as u64 {
            return Err(tensor_error(
                file,
                &name,
                format!("dimension {d} is {v}, negative as GGML's int64"),
            ));
        }
        dims.push(v);
    }
    let type_id = c.u32(&|| format!("type of tensor `{name}`"))?;
    let ggml_type = GgmlType::from_id(type_id)
        .ok_or_else(|| tensor_error(file, &name, format!("unknown GGML type id {type_id}")))?;
    let offset = c.u64(&|| format!("offset of tensor `{name}`"))?;
    let len = ggml_type
        .byte_len(&dims)
        .map_err(|r| tensor_error(file, &name, r))?;
    if !offset.is_multiple_of(alignment) {
        return Err(tensor_error(
            file,
            &name,
            format!("data offset {offset} is not a multiple of the alignment {alignment}"),
        ));
    }
    Ok(GgufTensor {
        name,
        dims,
        ggml_type,
        offset,
        len,
    })
}

/// Make each tensor's offset absolute, refusing data that lies outside the file.
fn place_tensors(
    file: &str,
    file_len: u64,
    tensors: &mut [GgufTensor],
    data_offset: u64,
) -> Result<()> {
    for t in tensors {
        let start = data_offset.checked_add(t.offset);
        let end = start.and_then(|s| s.checked_add(t.len));
        match (start, end) {
            (Some(s), Some(e)) if e <= file_len => t.offset = s,
            _ => {
                return Err(tensor_error(
                    file,
                    &t.name,
                    format!(
                        "data at {}+{} ({} bytes) lies outside the file ({file_len} bytes)",
                        data_offset, t.offset, t.len
                    ),
                ))
            }
        }
    }
    Ok(())
}

/// No two tensors' data overlap.
fn check_no_overlap(file: &str, tensors: &[GgufTensor]) -> Result<()> {
    let mut order: Vec<&GgufTensor> = tensors.iter().filter(|t| t.len > 0).collect();
    order.sort_by_key(|t| t.offset);
    for w in order.windows(2) {
        if w[0].offset + w[0].len > w[1].offset {
            return Err(tensor_error(
                file,
                &w[1].name,
                format!("data overlaps tensor `{}`", w[0].name),
            ));
        }
    }
    Ok(())
}
