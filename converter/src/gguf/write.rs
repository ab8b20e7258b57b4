//! The GGUF writer: metadata and a tensor table planned up front, then the header and every
//! tensor's bytes streamed into an atomically published file ([`kiln_format::AtomicFile`]:
//! temporary file beside the destination, fsync, no-clobber move into place, removed on error).

use std::borrow::Cow;
use std::io::{BufWriter, Write};
use std::path::Path;

use kiln_format::AtomicFile;

use super::read::{DEFAULT_ALIGNMENT, MAGIC, MAX_TENSOR_NAME};
use super::types::GgmlType;
use super::value::{Array, Value};
use crate::error::{ConvertError, Result};

/// The GGUF version written.
pub const VERSION: u32 = 3;

#[derive(Debug, Clone)]
struct Planned {
    name: String,
    dims: Vec<u64>,
    ggml_type: GgmlType,
    offset: u64,
    len: u64,
}

/// A GGUF file being planned: metadata, then tensors in file order.
#[derive(Debug, Clone)]
pub struct GgufBuilder {
    metadata: Vec<(String, Value)>,
    tensors: Vec<Planned>,
    data_len: u64,
}

impl Default for GgufBuilder {
    fn default() -> Self {
        GgufBuilder::new()
    }
}

impl GgufBuilder {
    /// An empty file with the default alignment (32 bytes, written explicitly).
    pub fn new() -> GgufBuilder {
        GgufBuilder {
            metadata: vec![(
                "general.alignment".into(),
                Value::U32(DEFAULT_ALIGNMENT as u32),
            )],
            tensors: Vec::new(),
            data_len: 0,
        }
    }

    /// Set a metadata value (replacing an earlier value of the same key).
    pub fn set(&mut self, key: &str, value: Value) {
        match self.metadata.iter_mut().find(|(k, _)| k == key) {
            Some(slot) => slot.1 = value,
            None => self.metadata.push((key.to_string(), value)),
        }
    }

    /// The value of `key`, if set.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    /// Add a tensor; `dims` in GGML order (innermost first).
    pub fn add_tensor(&mut self, name: &str, dims: Vec<u64>, ggml_type: GgmlType) -> Result<()> {
        let bad = |reason: String| ConvertError::Export {
            file: "(output)".into(),
            what: format!("tensor `{name}`"),
            reason,
        };
        if name.len() as u64 > MAX_TENSOR_NAME {
            return Err(bad(format!("name longer than {MAX_TENSOR_NAME} bytes")));
        }
        if self.tensors.iter().any(|t| t.name == name) {
            return Err(bad("added twice".into()));
        }
        let len = ggml_type.byte_len(&dims).map_err(bad)?;
        let offset = self.data_len;
        self.data_len = offset
            .checked_add(len)
            .and_then(|e| e.checked_next_multiple_of(DEFAULT_ALIGNMENT))
            .ok_or_else(|| bad("data size overflows".into()))?;
        self.tensors.push(Planned {
            name: name.to_string(),
            dims,
            ggml_type,
            offset,
            len,
        });
        Ok(())
    }

    /// Byte length of the `i`-th tensor added.
    pub fn tensor_len(&self, i: usize) -> Option<u64> {
        self.tensors.get(i).map(|t| t.len)
    }

    /// The header bytes (magic through the tensor table), unpadded.
    pub fn encode_header(&self) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(&MAGIC);
        b.extend_from_slice(&VERSION.to_le_bytes());
        b.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        b.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (k, v) in &self.metadata {
            put_str(&mut b, k);
            b.extend_from_slice(&(v.value_type() as u32).to_le_bytes());
            put_value(&mut b, v);
        }
        for t in &self.tensors {
            put_str(&mut b, &t.name);
            b.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                b.extend_from_slice(&d.to_le_bytes());
            }
            b.extend_from_slice(&t.ggml_type.id.to_le_bytes());
            b.extend_from_slice(&t.offset.to_le_bytes());
        }
        b
    }

    /// Write the file. `data(i)` returns the bytes of the `i`-th tensor added, which must have
    /// exactly the planned length. Returns the file size.
    pub fn write<'d>(
        &self,
        dest: &Path,
        overwrite: bool,
        mut data: impl FnMut(usize) -> Result<Cow<'d, [u8]>>,
    ) -> Result<u64> {
        let out = AtomicFile::create(dest, overwrite)?;
        let tmp = out.tmp_path().to_path_buf();
        let io = |e| ConvertError::io(&tmp, "cannot write", e);
        let mut w = BufWriter::with_capacity(1 << 20, out.file());
        let mut header = self.encode_header();
        let padded = (header.len() as u64).next_multiple_of(DEFAULT_ALIGNMENT);
        header.resize(padded as usize, 0);
        w.write_all(&header).map_err(io)?;
        let mut pos = 0u64;
        for (i, t) in self.tensors.iter().enumerate() {
            w.write_all(&vec![0u8; (t.offset - pos) as usize])
                .map_err(io)?;
            let bytes = data(i)?;
            if bytes.len() as u64 != t.len {
                return Err(ConvertError::Export {
                    file: dest.display().to_string(),
                    what: format!("tensor `{}`", t.name),
                    reason: format!(
                        "{} bytes supplied, {} planned for {:?} {}",
                        bytes.len(),
                        t.len,
                        t.dims,
                        t.ggml_type.name
                    ),
                });
            }
            w.write_all(&bytes).map_err(io)?;
            pos = t.offset + t.len;
        }
        w.write_all(&vec![0u8; (self.data_len - pos) as usize])
            .map_err(io)?;
        w.flush().map_err(io)?;
        drop(w);
        out.commit()?;
        Ok(padded + self.data_len)
    }
}

fn put_str(b: &mut Vec<u8>, s: &str) {
    b.extend_from_slice(&(s.len() as u64).to_le_bytes());
    b.extend_from_slice(s.as_bytes());
}

fn put_value(b: &mut Vec<u8>, v: &Value) {
    match v {
        Value::U8(x) => b.push(*x),
        Value::I8(x) => b.extend_from_slice(&x.to_le_bytes()),
        Value::U16(x) => b.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => b.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => b.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => b.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => b.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(x) => b.push(u8::from(*x)),
        Value::Str(s) => put_str(b, s),
        Value::U64(x) => b.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => b.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => b.extend_from_slice(&x.to_le_bytes()),
        Value::Array(a) => {
            b.extend_from_slice(&(a.elem_type() as u32).to_le_bytes());
            b.extend_from_slice(&(a.len() as u64).to_le_bytes());
            macro_rules! each {
                ($v:expr) => {
                    for x in $v {
                        b.extend_from_slice(&x.to_le_bytes());
                    }
                };
            }
            match a {
                Array::U8(v) => b.extend_from_slice(v),
                Array::I8(v) => each!(v),
                Array::U16(v) => each!(v),
                Array::I16(v) => each!(v),
                Array::U32(v) => each!(v),
                Array::I32(v) => each!(v),
                Array::F32(v) => each!(v),
                Array::Bool(v) => b.extend(v.iter().map(|&x| u8::from(x))),
                Array::Str(v) => v.iter().for_each(|s| put_str(b, s)),
                Array::U64(v) => each!(v),
                Array::I64(v) => each!(v),
                Array::F64(v) => each!(v),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::read::{parse, GgufFile};

    #[test]
    fn written_files_parse_back_with_every_value_and_tensor() {
        let mut b = GgufBuilder::new();
        let values = [
            Value::U8(1),
            Value::I8(-2),
            Value::U16(3),
            Value::I16(-4),
            Value::U32(5),
            Value::I32(-6),
            Value::F32(0.5),
            Value::Bool(true),
            Value::Str("héllo".into()),
            Value::U64(u64::MAX),
            Value::I64(i64::MIN),
            Value::F64(-0.25),
            Value::Array(Array::Str(vec!["a".into(), String::new()])),
            Value::Array(Array::Bool(vec![true, false])),
            Value::Array(Array::F64(vec![1.5])),
            Value::Array(Array::U8(vec![])),
        ];
        for (i, v) in values.iter().enumerate() {
            b.set(&format!("k.{i}"), v.clone());
        }
        let q8 = GgmlType::from_id(8).unwrap();
        let f32t = GgmlType::from_id(0).unwrap();
        b.add_tensor("a", vec![32, 3], q8).unwrap();
        b.add_tensor("b", vec![5], f32t).unwrap();
        assert!(b.add_tensor("a", vec![5], f32t).is_err());
        assert!(b.add_tensor("c", vec![31], q8).is_err());
        let data = [vec![7u8; 3 * 34], vec![9u8; 20]];
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.gguf");
        let n = b.write(&p, false, |i| Ok(data[i].clone().into())).unwrap();
        let bytes = std::fs::read(&p).unwrap();
        assert_eq!(bytes.len() as u64, n);
        let h = parse("t.gguf", &bytes).unwrap();
        for (i, v) in values.iter().enumerate() {
            assert_eq!(h.get(&format!("k.{i}")), Some(v));
        }
        let g = GgufFile::open(&p).unwrap();
        for (t, d) in g.header().tensors.iter().zip(&data) {
            assert_eq!(g.tensor_bytes(t), &d[..]);
            assert_eq!(t.offset % 32, 0);
        }
    }

    #[test]
    fn a_wrong_tensor_length_fails_and_leaves_nothing() {
        let mut b = GgufBuilder::new();
        b.add_tensor("a", vec![4], GgmlType::from_id(0).unwrap())
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.gguf");
        let e = b
            .write(&p, false, |_| Ok(vec![0u8; 15].into()))
            .unwrap_err();
        assert!(
            e.to_string().contains("15 bytes supplied, 16 planned"),
            "{e}"
        );
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }
}
