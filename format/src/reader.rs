//! Opening a `.kiln` file: memory map, structural validation, typed zero-copy views and the
//! separate, parallel checksum verification.
//!
//! [`KilnFile::open`] checks everything that is cheap (bounds, overlaps, alignment, dtype ×
//! shape = byte length, limits, zero padding, and the header checksum over the header, metadata,
//! index and files section, a few megabytes at most) so that no later access can go out of
//! bounds, and decodes the packed metadata fields ([`crate::packed`]) into the [`Metadata`]. It
//! does not hash tensor data; [`KilnFile::verify_checksums`] does, over all cores.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use half::{bf16, f16};
use memmap2::Mmap;
use rayon::prelude::*;
use sha2::{Digest, Sha256};

use crate::blocks::{BlockQ4_0, BlockQ4_0x16, BlockQ8_0};
use crate::dtype::DType;
use crate::error::{FormatError, Result};
use crate::layout::{FixedHeader, HEADER_LEN, MAX_METADATA_LEN};
use crate::metadata::Metadata;
use crate::packed::PackedInfo;

mod validate;

#[cfg(target_endian = "big")]
compile_error!(
    "the .kiln format is little-endian and Kiln's zero-copy views need a little-endian host"
);

/// A tensor's entry in the index, with its absolute position in the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    /// Canonical name.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Row-major shape, outermost first (PyTorch order).
    pub shape: Vec<u64>,
    /// Absolute byte offset in the file.
    pub offset: u64,
    /// Byte length.
    pub len: u64,
    /// sha256 of the tensor's bytes.
    pub sha256: [u8; 32],
}

impl TensorInfo {
    /// Number of elements.
    pub fn numel(&self) -> u64 {
        self.shape.iter().product()
    }
}

enum Backing {
    Mmap(Mmap),
    Owned(Vec<u8>),
}

impl Backing {
    fn bytes(&self) -> &[u8] {
        match self {
            Backing::Mmap(m) => m,
            Backing::Owned(v) => v,
        }
    }
}

/// An open, structurally valid `.kiln` file.
pub struct KilnFile {
    label: String,
    path: Option<PathBuf>,
    backing: Backing,
    header: FixedHeader,
    metadata: Metadata,
    packed: Vec<PackedInfo>,
    tensors: Vec<TensorInfo>,
    by_name: HashMap<String, usize>,
}

impl std::fmt::Debug for KilnFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KilnFile")
            .field("file", &self.label)
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

/// One checksum that did not match, from [`KilnFile::verify_checksums`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChecksumFailure {
    /// Tensor name.
    pub tensor: String,
    /// Stored sha256, hex.
    pub stored: String,
    /// Computed sha256, hex.
    pub computed: String,
}

/// A tensor holding NaN or infinity, from [`KilnFile::non_finite`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NonFiniteTensor {
    /// Tensor name.
    pub tensor: String,
    /// Values that are NaN or infinite (a block with a non-finite scale counts all its values).
    pub count: usize,
    /// Element index of the first (storage order for interleaved layouts).
    pub first: usize,
}

/// When metadata that failed to parse names an architecture this build does not implement,
/// that is the error to report (rather than serde's "unknown variant"): the file may be fine,
/// and a newer Kiln may run it.
fn unsupported_architecture(label: &str, meta: &[u8]) -> Option<FormatError> {
    let v: serde_json::Value = serde_json::from_slice(meta).ok()?;
    let found = v.get("config")?.get("architecture")?.as_str()?;
    crate::metadata::Architecture::from_name(found)
        .is_none()
        .then(|| FormatError::UnsupportedArchitecture {
            file: label.to_string(),
            found: found.to_string(),
            supported: crate::metadata::Architecture::supported(),
        })
}

/// Lower-case hex of a byte string.
pub fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    bytes.iter().fold(String::new(), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

impl KilnFile {
    /// Memory-map and validate a file. Tensor data is not read.
    pub fn open(path: impl AsRef<Path>) -> Result<KilnFile> {
        let path = path.as_ref();
        // A FIFO or a device is refused without blocking or reading it.
        let file = crate::input::open_regular(path, ".kiln file")?;
        // SAFETY: the map is read-only and private to this process. Like every memory-mapped
        // reader (safetensors, candle, llama.cpp) we rely on the file not being truncated or
        // rewritten by another process while it is open; Kiln's own writer never modifies a
        // finished file in place (it writes a new file and renames it).
        let map =
            unsafe { Mmap::map(&file) }.map_err(|e| FormatError::io(path, "cannot map", e))?;
        // Ask for huge pages: pages not yet in the page cache are then read ahead in 2 MiB
        // folios, which the map can use as 2 MiB pages (fewer TLB misses while the weights
        // stream). A hint: where the kernel cannot, it changes nothing.
        #[cfg(target_os = "linux")]
        let _ = map.advise(memmap2::Advice::HugePage);
        Self::parse(
            path.display().to_string(),
            Some(path.to_path_buf()),
            Backing::Mmap(map),
        )
    }

    /// Validate a file held in memory (used by tests and the fuzzer).
    ///
    /// Typed views need the buffer to be aligned for their element type; a `Vec<u8>` usually
    /// is, and a view that is not aligned returns an error rather than copying.
    pub fn from_bytes(label: impl Into<String>, bytes: Vec<u8>) -> Result<KilnFile> {
        Self::parse(label.into(), None, Backing::Owned(bytes))
    }

    /// Run every structural check ([`validate`], in its order) and decode the metadata, the
    /// packed fields and the index.
    fn parse(label: String, path: Option<PathBuf>, backing: Backing) -> Result<KilnFile> {
        let bytes = backing.bytes();
        let header = validate::read_fixed_header(&label, bytes)?;
        let ends = validate::check_header(&label, &header, bytes.len() as u64)?;
        validate::check_header_checksum(&label, bytes, &header, ends.files_end)?;
        let meta_bytes = &bytes[HEADER_LEN as usize..ends.meta_end as usize];
        let mut metadata = validate::parse_metadata(&label, meta_bytes)?;
        let packed = crate::packed::unpack(
            &label,
            &bytes[ends.index_end as usize..ends.files_end as usize],
            &mut metadata,
            MAX_METADATA_LEN - header.metadata_len,
        )?;
        validate::check_config(&label, &metadata, header.tensor_count)?;
        let index = &bytes[ends.meta_end as usize..ends.index_end as usize];
        let tensors = validate::parse_index(&label, index, &header, bytes)?;
        let by_name = validate::index_by_name(&label, &tensors)?;
        Ok(KilnFile {
            label,
            path,
            backing,
            header,
            metadata,
            packed,
            tensors,
            by_name,
        })
    }

    /// The file name used in messages.
    pub fn label(&self) -> &str {
        &self.label
    }

    /// The path it was opened from (None for in-memory files).
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// The format version the file was written with.
    pub fn version(&self) -> (u16, u16) {
        (self.header.major, self.header.minor)
    }

    /// The header checksum, which identifies the file's metadata and tensor index.
    pub fn header_sha256(&self) -> [u8; 32] {
        self.header.header_sha256
    }

    /// Total file size in bytes.
    pub fn file_len(&self) -> u64 {
        self.backing.bytes().len() as u64
    }

    /// The parsed metadata, with every packed field decoded into it: how every program reads
    /// the tokenizer files, whichever way the file stores them.
    pub fn metadata(&self) -> &Metadata {
        &self.metadata
    }

    /// The metadata fields the file packs in its files section and how (empty before 1.3, and
    /// when nothing is large enough to pack): for reports; their text is in [`Self::metadata`].
    pub fn packed_fields(&self) -> &[PackedInfo] {
        &self.packed
    }

    /// Every tensor, in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// A tensor's entry, if present.
    pub fn info(&self, name: &str) -> Option<&TensorInfo> {
        self.by_name.get(name).map(|&i| &self.tensors[i])
    }

    /// A tensor by name.
    pub fn tensor(&self, name: &str) -> Result<TensorView<'_>> {
        let info = self.info(name).ok_or_else(|| FormatError::TensorNotFound {
            file: self.label.clone(),
            tensor: name.to_string(),
        })?;
        Ok(self.view(info))
    }

    /// A view of a tensor from [`KilnFile::tensors`].
    pub fn view<'a>(&'a self, info: &'a TensorInfo) -> TensorView<'a> {
        let start = info.offset as usize;
        TensorView {
            file: &self.label,
            info,
            bytes: &self.backing.bytes()[start..start + info.len as usize],
        }
    }

    /// Hash every tensor in parallel and compare with the index. Returns every mismatch.
    ///
    /// `progress` is called with the number of bytes just hashed, from worker threads.
    pub fn verify_checksums(&self, progress: &(dyn Fn(u64) + Sync)) -> Vec<ChecksumFailure> {
        let done = AtomicU64::new(0);
        let mut failures: Vec<ChecksumFailure> = self
            .tensors
            .par_iter()
            .filter_map(|t| {
                let bytes = self.view(t).bytes;
                let mut h = Sha256::new();
                for chunk in bytes.chunks(1 << 20) {
                    h.update(chunk);
                    done.fetch_add(chunk.len() as u64, Ordering::Relaxed);
                    progress(chunk.len() as u64);
                }
                let computed: [u8; 32] = h.finalize().into();
                (computed != t.sha256).then(|| ChecksumFailure {
                    tensor: t.name.clone(),
                    stored: hex(&t.sha256),
                    computed: hex(&computed),
                })
            })
            .collect();
        failures.sort_by(|a, b| a.tensor.cmp(&b.tensor));
        failures
    }

    /// Every tensor holding NaN or infinity, sorted by name: a damaged or crafted file whose
    /// checksums match (they were computed over the bad values) but whose model would stop
    /// after one token. One pass over the tensor data, on every CPU.
    pub fn non_finite(&self) -> Vec<NonFiniteTensor> {
        let mut found: Vec<NonFiniteTensor> = self
            .tensors
            .par_iter()
            .filter_map(|t| {
                let (count, first) = crate::values::count_non_finite(t.dtype, self.view(t).bytes);
                first.map(|first| NonFiniteTensor {
                    tensor: t.name.clone(),
                    count,
                    first,
                })
            })
            .collect();
        found.sort_by(|a, b| a.tensor.cmp(&b.tensor));
        found
    }

    /// [`KilnFile::verify_checksums`] as a `Result`: the first mismatch (by name) as an error.
    pub fn verify(&self) -> Result<()> {
        match self.verify_checksums(&|_| {}).into_iter().next() {
            None => Ok(()),
            Some(f) => Err(FormatError::TensorChecksum {
                file: self.label.clone(),
                tensor: f.tensor,
                stored: f.stored,
                computed: f.computed,
            }),
        }
    }

    /// Hash every tensor and scan its values in one pass over the data, on every CPU: each
    /// chunk ([`CHECK_CHUNK`] bytes, whole storage units) is hashed and then scanned while it
    /// is still in the core's cache, so the scan costs little beside the hashing. Returns every
    /// checksum mismatch and every tensor holding NaN or infinity (as
    /// [`KilnFile::verify_checksums`] and [`KilnFile::non_finite`] would), each sorted by name.
    ///
    /// `progress` is called with the number of bytes just checked, from worker threads.
    pub fn check_tensors(
        &self,
        progress: &(dyn Fn(u64) + Sync),
    ) -> (Vec<ChecksumFailure>, Vec<NonFiniteTensor>) {
        let results: Vec<(Option<ChecksumFailure>, Option<NonFiniteTensor>)> = self
            .tensors
            .par_iter()
            .map(|t| {
                let bytes = self.view(t).bytes;
                let unit_bytes = t.dtype.block_bytes();
                let unit_values = t.dtype.block_len();
                let chunk = (CHECK_CHUNK / unit_bytes).max(1) * unit_bytes;
                let mut h = Sha256::new();
                let mut count = 0;
                let mut first = None;
                for (i, c) in bytes.chunks(chunk).enumerate() {
                    h.update(c);
                    if may_hold_non_finite(t.dtype, c) {
                        let (n, f) = crate::values::count_non_finite(t.dtype, c);
                        count += n;
                        if let Some(f) = f {
                            first.get_or_insert(i * (chunk / unit_bytes) * unit_values + f);
                        }
                    }
                    progress(c.len() as u64);
                }
                let computed: [u8; 32] = h.finalize().into();
                let checksum = (computed != t.sha256).then(|| ChecksumFailure {
                    tensor: t.name.clone(),
                    stored: hex(&t.sha256),
                    computed: hex(&computed),
                });
                let non_finite = first.map(|first| NonFiniteTensor {
                    tensor: t.name.clone(),
                    count,
                    first,
                });
                (checksum, non_finite)
            })
            .collect();
        let mut failures = Vec::new();
        let mut found = Vec::new();
        for (checksum, non_finite) in results {
            failures.extend(checksum);
            found.extend(non_finite);
        }
        failures.sort_by(|a, b| a.tensor.cmp(&b.tensor));
        found.sort_by(|a, b| a.tensor.cmp(&b.tensor));
        (failures, found)
    }

    /// [`KilnFile::check_tensors`] as a `Result`: every checksum and every value in one pass.
    /// The error is the first checksum mismatch (by name), else the first tensor (by name)
    /// holding NaN or infinity ([`FormatError::TensorNonFinite`], with its count and first
    /// element). What a program runs before using a model's weights.
    pub fn verify_data(&self) -> Result<()> {
        let (failures, non_finite) = self.check_tensors(&|_| {});
        if let Some(f) = failures.into_iter().next() {
            return Err(FormatError::TensorChecksum {
                file: self.label.clone(),
                tensor: f.tensor,
                stored: f.stored,
                computed: f.computed,
            });
        }
        match non_finite.into_iter().next() {
            None => Ok(()),
            Some(n) => Err(FormatError::TensorNonFinite {
                file: self.label.clone(),
                tensor: n.tensor,
                count: n.count,
                first: n.first,
            }),
        }
    }

    /// Total bytes of tensor data.
    pub fn data_len(&self) -> u64 {
        self.header.data_len
    }
}

/// Bytes [`KilnFile::check_tensors`] hashes and then scans at a time (rounded down to whole
/// storage units): small enough that the chunk is still in a core's L2 cache when the scan
/// reads it after the hash, large enough that the per-chunk work is negligible.
pub const CHECK_CHUNK: usize = 256 << 10;

/// Whether `bytes` of `dtype` may hold a non-finite value: for the plain floats, one
/// branch-free pass the compiler vectorizes (a value is non-finite when its exponent bits are
/// all ones), so that [`crate::values::count_non_finite`] runs only on a chunk that has one.
/// Block types read only their scales, which is cheap already: always `true`.
fn may_hold_non_finite(dtype: DType, bytes: &[u8]) -> bool {
    fn any_exponent_all_ones<const N: usize>(bytes: &[u8], mask: u32) -> bool {
        let mut bad = false;
        for c in bytes.chunks_exact(N) {
            let mut e = [0u8; 4];
            e[..N].copy_from_slice(c);
            bad |= u32::from_le_bytes(e) & mask == mask;
        }
        bad
    }
    if dtype.is_quantized() {
        return true;
    }
    // A plain float's unit is its one "scale": the table says which encoding it is.
    let float = dtype.block().scales.float;
    match float.bytes() {
        4 => any_exponent_all_ones::<4>(bytes, float.exponent_mask()),
        _ => any_exponent_all_ones::<2>(bytes, float.exponent_mask()),
    }
}

/// A borrowed view of one tensor's bytes, with typed accessors that never copy.
#[derive(Debug, Clone, Copy)]
pub struct TensorView<'a> {
    file: &'a str,
    info: &'a TensorInfo,
    bytes: &'a [u8],
}

impl<'a> TensorView<'a> {
    /// The index entry.
    pub fn info(&self) -> &'a TensorInfo {
        self.info
    }

    /// The raw little-endian bytes.
    pub fn bytes(&self) -> &'a [u8] {
        self.bytes
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        self.info.dtype
    }

    /// Shape.
    pub fn shape(&self) -> &'a [u64] {
        &self.info.shape
    }

    fn cast<T: bytemuck::Pod>(&self, want: DType) -> Result<&'a [T]> {
        if self.info.dtype != want {
            return Err(FormatError::DTypeMismatch {
                file: self.file.to_string(),
                tensor: self.info.name.clone(),
                expected: want.to_string(),
                actual: self.info.dtype.to_string(),
            });
        }
        bytemuck::try_cast_slice(self.bytes).map_err(|e| FormatError::BadTensor {
            file: self.file.to_string(),
            tensor: self.info.name.clone(),
            reason: format!("cannot view the bytes as {want}: {e:?}"),
        })
    }

    /// The data as f32 elements.
    pub fn as_f32(&self) -> Result<&'a [f32]> {
        self.cast(DType::F32)
    }

    /// The data as f16 elements.
    pub fn as_f16(&self) -> Result<&'a [f16]> {
        self.cast(DType::F16)
    }

    /// The data as bf16 elements.
    pub fn as_bf16(&self) -> Result<&'a [bf16]> {
        self.cast(DType::BF16)
    }

    /// The data as Q8_0 blocks, row after row.
    pub fn as_q8_0(&self) -> Result<&'a [BlockQ8_0]> {
        self.cast(DType::Q8_0)
    }

    /// The data as Q4_0 blocks, row after row.
    pub fn as_q4_0(&self) -> Result<&'a [BlockQ4_0]> {
        self.cast(DType::Q4_0)
    }

    /// The data as sixteen-row Q4_0 groups ([`BlockQ4_0x16`]): for each group of sixteen
    /// rows, block after block.
    pub fn as_q4_0x16(&self) -> Result<&'a [BlockQ4_0x16]> {
        self.cast(DType::Q4_0x16)
    }

    /// The data as Q5_0 blocks, row after row.
    pub fn as_q5_0(&self) -> Result<&'a [crate::BlockQ5_0]> {
        self.cast(DType::Q5_0)
    }

    /// The data as Q5_1 blocks, row after row.
    pub fn as_q5_1(&self) -> Result<&'a [crate::BlockQ5_1]> {
        self.cast(DType::Q5_1)
    }

    /// The data as Q4_K super-blocks, row after row.
    pub fn as_q4_k(&self) -> Result<&'a [crate::BlockQ4K]> {
        self.cast(DType::Q4_K)
    }

    /// The data as Q5_K super-blocks, row after row.
    pub fn as_q5_k(&self) -> Result<&'a [crate::BlockQ5K]> {
        self.cast(DType::Q5_K)
    }

    /// The data as Q6_K super-blocks, row after row.
    pub fn as_q6_k(&self) -> Result<&'a [crate::BlockQ6K]> {
        self.cast(DType::Q6_K)
    }

    /// The data as units of block type `T` (any row of the block-type table), refused unless
    /// the tensor's dtype is `T`'s.
    pub fn as_blocks<T: crate::BlockType>(&self) -> Result<&'a [T]> {
        self.cast(T::DTYPE)
    }

    /// The data as row-major Q4_0 blocks, for `q4_0` and (de-interleaved, a copy) `q4_0x16`
    /// tensors: what a consumer that does not care about the storage order reads.
    pub fn q4_0_rows(&self) -> Result<std::borrow::Cow<'a, [BlockQ4_0]>> {
        match self.info.dtype {
            DType::Q4_0x16 => {
                let nb = self.shape().last().copied().unwrap_or(0) as usize / crate::QK;
                let groups: Vec<BlockQ4_0x16> = bytemuck::pod_collect_to_vec(self.bytes);
                Ok(crate::blocks::deinterleave_q4_0x16(&groups, nb.max(1)).into())
            }
            _ => self.as_q4_0().map(Into::into),
        }
    }

    /// Decode the whole tensor to f32 (a copy: for tests, reports and small tensors).
    pub fn to_f32_vec(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.info.numel() as usize];
        let cols = self.shape().last().copied().unwrap_or(1) as usize;
        crate::values::decode_rows_f32(self.info.dtype, cols, self.bytes, &mut out);
        out
    }
}
