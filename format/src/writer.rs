//! Writing a `.kiln` file: streamed, checksummed as it goes, parallel-friendly and atomic.
//!
//! The caller declares every tensor (name, dtype, shape) and the metadata up front, so the whole
//! layout is known before the first byte: tensors can then be written from many threads at once
//! (positioned writes into their own slots, each hashed by the thread that writes it), and no
//! tensor ever has to be held in memory beyond the chunk being written.
//!
//! Large tokenizer files are taken out of the metadata and compressed into the files section when
//! the writer is created ([`crate::packed`]), since the layout depends on their size.
//!
//! Atomicity: everything goes to a temporary file beside the destination; [`KilnWriter::finish`]
//! writes the index, files section and header, fsyncs, and only then moves the file into place
//! (without replacing an existing file unless overwriting was asked for) and fsyncs the
//! directory. A writer dropped before `finish` (an error, a panic) deletes its temporary file, and
//! [`crate::remove_pending_outputs`] lets a Ctrl-C handler do the same (see [`crate::atomic`]).

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use sha2::{Digest, Sha256};

use crate::atomic::AtomicFile;
use crate::dtype::DType;
use crate::error::{FormatError, Result};
use crate::layout::{
    align_up, minor_for, FixedHeader, IndexRecord, ALIGNMENT, FORMAT_MAJOR, HEADER_LEN,
    HEADER_SHA_RANGE, MAX_DIM, MAX_DIMS, MAX_FILES_LEN, MAX_INDEX_LEN, MAX_METADATA_LEN,
    MAX_NAME_LEN, MAX_TENSORS, MINOR_DENSE, MINOR_FILES,
};
use crate::metadata::Metadata;

/// A tensor to be written: everything but its bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    /// Canonical name.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Row-major shape.
    pub shape: Vec<u64>,
}

/// What a finished write produced.
#[derive(Debug, Clone)]
pub struct WriteSummary {
    /// The destination path.
    pub path: PathBuf,
    /// File size in bytes.
    pub file_len: u64,
    /// Bytes of tensor data.
    pub data_len: u64,
    /// Header checksum of the new file.
    pub header_sha256: [u8; 32],
}

#[derive(Debug)]
struct Slot {
    spec: TensorSpec,
    offset: u64,
    len: u64,
    sha256: Mutex<Option<[u8; 32]>>,
}

/// An in-progress `.kiln` file. Dropping it without [`KilnWriter::finish`] removes it.
#[derive(Debug)]
pub struct KilnWriter {
    dest: PathBuf,
    tmp: PathBuf,
    out: AtomicFile,
    /// The JSON document, packed fields left out.
    metadata: Vec<u8>,
    /// The files section: the packed fields, compressed.
    files: Vec<u8>,
    /// Digest of the packed fields' text, which [`KilnWriter::replace_metadata`] must keep.
    packed_digest: [u8; 32],
    slots: Vec<Slot>,
    data_offset: u64,
    data_len: u64,
    index_len: u64,
}

impl KilnWriter {
    /// Create the temporary file and plan the layout. Fails early if `dest` exists and
    /// `overwrite` is false, if the model configuration fails the check every reader runs
    /// ([`crate::ModelConfig::check`]), or if any spec could not be read back by a reader.
    pub fn create(
        dest: impl AsRef<Path>,
        metadata: &Metadata,
        tensors: Vec<TensorSpec>,
        overwrite: bool,
    ) -> Result<KilnWriter> {
        let dest = dest.as_ref().to_path_buf();
        let label = dest.display().to_string();
        if !overwrite && dest.exists() {
            return Err(FormatError::AlreadyExists { file: label });
        }
        if tensors.len() > MAX_TENSORS as usize {
            return Err(FormatError::TooManyTensors {
                file: label,
                count: tensors.len(),
                limit: MAX_TENSORS,
            });
        }
        // What every reader runs at open (`ModelConfig::check`), so no writer produces a file
        // its readers refuse.
        if let Err(p) = metadata.config.check() {
            return Err(FormatError::BadMetadata {
                file: label,
                field: format!("config.{}", p.field),
                reason: p.reason,
            });
        }
        let split = crate::packed::split(metadata).map_err(|e| FormatError::BadMetadata {
            file: label.clone(),
            field: "(document)".into(),
            reason: e.to_string(),
        })?;
        let (slots, index_len) = lay_out(&label, tensors)?;
        let data_len = slots.last().map(|s| s.offset + s.len).unwrap_or(0);
        // Refuse what a reader would refuse, before writing (or compressing) anything.
        check_section_limits(&label, &split, index_len)?;
        let files = split.section();
        if files.len() as u64 > MAX_FILES_LEN {
            return Err(FormatError::BadMetadata {
                file: label,
                field: "(files section)".into(),
                reason: format!(
                    "{} bytes exceed the limit of {MAX_FILES_LEN} bytes",
                    files.len()
                ),
            });
        }
        let packed_digest = split.digest();
        let metadata_bytes = split.json;
        let index_end = HEADER_LEN + metadata_bytes.len() as u64 + index_len;
        let files_end = index_end + files.len() as u64;
        let data_offset = align_up(files_end).expect("bounded by the limits above");
        if data_offset.checked_add(data_len).is_none() {
            return Err(overflow(&label));
        }

        let out = AtomicFile::create(&dest, overwrite)?;
        let writer = KilnWriter {
            dest,
            tmp: out.tmp_path().to_path_buf(),
            out,
            metadata: metadata_bytes,
            files,
            packed_digest,
            slots,
            data_offset,
            data_len,
            index_len,
        };
        // Size the file now: padding reads as zeros, and a disk too small for a sparse file's
        // metadata fails here rather than late.
        writer
            .out
            .file()
            .set_len(data_offset + data_len)
            .map_err(|e| FormatError::io(&writer.tmp, "cannot size the output", e))?;
        Ok(writer)
    }

    /// Replace the metadata declared at [`KilnWriter::create`] with a document of exactly the
    /// same serialized length (the layout is already fixed).
    ///
    /// This lets a caller declare values it computes while tensors are written, such as source
    /// file checksums, as fixed-width placeholders and fill them in before `finish`. The packed
    /// fields (the large tokenizer files) must be the same text as declared.
    pub fn replace_metadata(&mut self, metadata: &Metadata) -> Result<()> {
        let split = crate::packed::split(metadata).map_err(|e| FormatError::BadMetadata {
            file: self.dest.display().to_string(),
            field: "(document)".into(),
            reason: e.to_string(),
        })?;
        if split.digest() != self.packed_digest {
            return Err(FormatError::BadMetadata {
                file: self.dest.display().to_string(),
                field: "tokenizer".into(),
                reason: "replacement metadata changes the packed tokenizer files, whose \
                         compressed layout is already fixed"
                    .into(),
            });
        }
        let bytes = split.json;
        if bytes.len() != self.metadata.len() {
            return Err(FormatError::BadMetadata {
                file: self.dest.display().to_string(),
                field: "(document)".into(),
                reason: format!(
                    "replacement metadata is {} bytes, the declared layout holds {}",
                    bytes.len(),
                    self.metadata.len()
                ),
            });
        }
        self.metadata = bytes;
        Ok(())
    }

    /// Number of declared tensors.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// Whether no tensors were declared.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// The declared spec of tensor `i`.
    pub fn spec(&self, i: usize) -> &TensorSpec {
        &self.slots[i].spec
    }

    /// Byte length tensor `i` must have.
    pub fn tensor_len(&self, i: usize) -> u64 {
        self.slots[i].len
    }

    /// Write tensor `i` in one call. Safe to call from several threads for different tensors.
    pub fn write_tensor(&self, i: usize, bytes: &[u8]) -> Result<()> {
        let mut sink = self.tensor_sink(i)?;
        sink.write(bytes)?;
        sink.finish()
    }

    /// A sink that takes tensor `i`'s bytes in consecutive chunks and hashes them as they pass.
    pub fn tensor_sink(&self, i: usize) -> Result<TensorSink<'_>> {
        let slot = self.slots.get(i).ok_or_else(|| FormatError::NoSuchTensor {
            file: self.dest.display().to_string(),
            index: i,
            declared: self.slots.len(),
        })?;
        if slot
            .sha256
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
        {
            return Err(FormatError::WrittenTwice {
                file: self.dest.display().to_string(),
                tensor: slot.spec.name.clone(),
            });
        }
        Ok(TensorSink {
            writer: self,
            slot,
            pos: 0,
            hasher: Sha256::new(),
        })
    }

    fn wrong_length(&self, slot: &Slot, written: u64) -> FormatError {
        FormatError::WrongLength {
            file: self.dest.display().to_string(),
            tensor: slot.spec.name.clone(),
            written,
            expected: slot.len,
        }
    }

    fn write_at(&self, bytes: &[u8], at: u64) -> Result<()> {
        crate::io::write_all_at(self.out.file(), bytes, at)
            .map_err(|e| FormatError::io(&self.tmp, "cannot write", e))
    }

    /// Flush the tensor data written so far to stable storage (`fdatasync`).
    ///
    /// Optional: [`KilnWriter::finish`] syncs everything. Calling this from a spare thread
    /// while tensors are still being written moves most of that I/O off the end of the run,
    /// so `finish` only waits for the last stretch. Safe to call from any thread at any time.
    pub fn sync_data(&self) -> Result<()> {
        self.out
            .file()
            .sync_data()
            .map_err(|e| FormatError::io(&self.tmp, "cannot sync", e))
    }

    /// Write the index and header, fsync, and move the file into place.
    pub fn finish(self) -> Result<WriteSummary> {
        let mut index = Vec::with_capacity(self.index_len as usize);
        for slot in &self.slots {
            let sha = slot
                .sha256
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .ok_or_else(|| FormatError::NeverWritten {
                    file: self.dest.display().to_string(),
                    tensor: slot.spec.name.clone(),
                })?;
            IndexRecord {
                name: slot.spec.name.clone(),
                dtype: slot.spec.dtype,
                shape: slot.spec.shape.clone(),
                offset: slot.offset,
                len: slot.len,
                sha256: sha,
            }
            .encode(&mut index);
        }
        debug_assert_eq!(index.len() as u64, self.index_len);
        let mut dtypes_minor = minor_for(self.slots.iter().map(|s| s.spec.dtype));
        if self.slots.iter().any(|s| {
            crate::TensorName::parse(&s.spec.name).is_some_and(|n| n.role.dense_index().is_some())
        }) {
            dtypes_minor = dtypes_minor.max(MINOR_DENSE);
        }
        let mut header = FixedHeader {
            major: FORMAT_MAJOR,
            minor: if self.files.is_empty() {
                dtypes_minor
            } else {
                dtypes_minor.max(MINOR_FILES)
            },
            flags: 0,
            metadata_offset: HEADER_LEN,
            metadata_len: self.metadata.len() as u64,
            index_offset: HEADER_LEN + self.metadata.len() as u64,
            index_len: self.index_len,
            data_offset: self.data_offset,
            data_len: self.data_len,
            tensor_count: self.slots.len() as u32,
            alignment: ALIGNMENT as u32,
            files_len: self.files.len() as u64,
            reserved: [0; 16],
            header_sha256: [0; 32],
        }
        .encode();
        let mut h = Sha256::new();
        h.update(&header[..HEADER_SHA_RANGE.start]);
        h.update(&self.metadata);
        h.update(&index);
        h.update(&self.files);
        let sha: [u8; 32] = h.finalize().into();
        header[HEADER_SHA_RANGE].copy_from_slice(&sha);

        let index_at = HEADER_LEN + self.metadata.len() as u64;
        self.write_at(&self.metadata, HEADER_LEN)?;
        self.write_at(&index, index_at)?;
        self.write_at(&self.files, index_at + self.index_len)?;
        self.write_at(&header, 0)?;
        self.out.commit()?;
        Ok(WriteSummary {
            path: self.dest,
            file_len: self.data_offset + self.data_len,
            data_len: self.data_len,
            header_sha256: sha,
        })
    }
}

/// Consecutive chunks of one tensor; see [`KilnWriter::tensor_sink`].
#[derive(Debug)]
pub struct TensorSink<'w> {
    writer: &'w KilnWriter,
    slot: &'w Slot,
    pos: u64,
    hasher: Sha256,
}

impl TensorSink<'_> {
    /// Append bytes to the tensor.
    pub fn write(&mut self, bytes: &[u8]) -> Result<()> {
        let end = self.pos + bytes.len() as u64;
        if end > self.slot.len {
            return Err(self.writer.wrong_length(self.slot, end));
        }
        self.writer
            .write_at(bytes, self.writer.data_offset + self.slot.offset + self.pos)?;
        self.hasher.update(bytes);
        self.pos = end;
        Ok(())
    }

    /// Check the length and record the checksum.
    pub fn finish(self) -> Result<()> {
        if self.pos != self.slot.len {
            return Err(self.writer.wrong_length(self.slot, self.pos));
        }
        let mut sha = self.slot.sha256.lock().unwrap_or_else(|e| e.into_inner());
        if sha.is_some() {
            return Err(FormatError::WrittenTwice {
                file: self.writer.dest.display().to_string(),
                tensor: self.slot.spec.name.clone(),
            });
        }
        *sha = Some(self.hasher.finalize().into());
        Ok(())
    }
}

/// Check each tensor's name and shape and place it in the data section, in order, each at
/// the previous end rounded up to the alignment; returns the slots and the index's length.
fn lay_out(label: &str, tensors: Vec<TensorSpec>) -> Result<(Vec<Slot>, u64)> {
    let mut slots = Vec::with_capacity(tensors.len());
    let mut seen = std::collections::HashSet::new();
    let mut offset = 0u64;
    let mut index_len = 0u64;
    for spec in tensors {
        let len = check_spec(label, &spec, &mut seen)?;
        index_len += IndexRecord::encoded_len(spec.name.len(), spec.shape.len()) as u64;
        slots.push(Slot {
            spec,
            offset,
            len,
            sha256: Mutex::new(None),
        });
        // Checked: shapes are only bounded per dimension, so a few huge tensors can sum
        // past 64 bits; that must be an error, not an overflow panic.
        offset = offset
            .checked_add(len)
            .and_then(align_up)
            .ok_or_else(|| overflow(label))?;
    }
    Ok((slots, index_len))
}

/// A tensor's name (non-empty, bounded, no control characters, not seen before) and shape
/// (1 to [`MAX_DIMS`] dimensions of 1..=[`MAX_DIM`]); returns its byte length.
fn check_spec(
    label: &str,
    spec: &TensorSpec,
    seen: &mut std::collections::HashSet<String>,
) -> Result<u64> {
    let bad_shape = |reason: String| FormatError::BadShape {
        file: label.to_string(),
        tensor: spec.name.clone(),
        dtype: spec.dtype,
        shape: spec.shape.clone(),
        reason,
    };
    if spec.name.is_empty()
        || spec.name.len() > MAX_NAME_LEN as usize
        || spec.name.chars().any(char::is_control)
    {
        return Err(FormatError::BadTensorName {
            file: label.to_string(),
            tensor: spec.name.clone(),
            max: MAX_NAME_LEN,
        });
    }
    if !seen.insert(spec.name.clone()) {
        return Err(FormatError::DuplicateTensor {
            file: label.to_string(),
            tensor: spec.name.clone(),
        });
    }
    if spec.shape.is_empty()
        || spec.shape.len() > MAX_DIMS as usize
        || spec.shape.iter().any(|&d| d == 0 || d > MAX_DIM)
    {
        return Err(bad_shape(format!(
            "a shape must have 1 to {MAX_DIMS} dimensions of 1..={MAX_DIM}"
        )));
    }
    spec.dtype.byte_len(&spec.shape).map_err(bad_shape)
}

/// The metadata (JSON and packed fields, decoded) and the index within a reader's limits.
fn check_section_limits(
    label: &str,
    split: &crate::packed::Split<'_>,
    index_len: u64,
) -> Result<()> {
    let decoded_len = split.json.len() as u64 + split.packed_len();
    if decoded_len > MAX_METADATA_LEN {
        return Err(FormatError::BadMetadata {
            file: label.to_string(),
            field: "(document)".into(),
            reason: format!(
                "{decoded_len} bytes of JSON and packed fields exceed the limit of \
                 {MAX_METADATA_LEN} bytes"
            ),
        });
    }
    if index_len > MAX_INDEX_LEN {
        return Err(FormatError::IndexTooLarge {
            file: label.to_string(),
            bytes: index_len,
            limit: MAX_INDEX_LEN,
        });
    }
    Ok(())
}

fn overflow(label: &str) -> FormatError {
    FormatError::DataOverflow {
        file: label.to_string(),
    }
}
