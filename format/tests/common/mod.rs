//! Shared helpers for the integration tests: a small valid sample file, a map of where each of
//! its fields lies, byte patching, re-sealing the header checksum after a patch, and a
//! per-thread allocation tracker that proves a corrupt length never sizes an allocation.
//!
//! Each test binary uses a different subset, hence the `dead_code` allowance.
#![allow(dead_code)]

use std::alloc::{GlobalAlloc, Layout as AllocLayout, System};
use std::cell::Cell;

use kiln_format::metadata::{Architecture, ModelConfig, ProvenanceStep, SourceFile};
use kiln_format::{DType, FormatError, KilnFile, KilnWriter, Metadata, TensorSpec, TokenizerFiles};
use sha2::{Digest, Sha256};

/// The label every in-memory file is opened under; every error message must contain it.
pub const LABEL: &str = "corrupt-sample.kiln";

/// A tokenizer string in the metadata, so that the metadata section is not trivially small.
pub const TOKENIZER_JSON: &str = r#"{"version":"1.0","model":{"type":"BPE","vocab":{"<s>":0,"</s>":1,"a":2,"b":3},"merges":["a b"]}}"#;

/// Metadata with every kind of field filled in.
pub fn sample_metadata() -> Metadata {
    let mut special = std::collections::BTreeMap::new();
    special.insert("bos_token".to_string(), "<s>".to_string());
    special.insert("eos_token".to_string(), "</s>".to_string());
    Metadata {
        config: ModelConfig {
            architecture: Architecture::Llama,
            source_architecture: "LlamaForCausalLM".into(),
            hidden_size: 64,
            intermediate_size: 128,
            num_layers: 1,
            num_heads: 4,
            num_kv_heads: 2,
            head_dim: 16,
            vocab_size: 4,
            max_position_embeddings: 256,
            rms_norm_eps: 1e-5,
            rope_theta: 10000.0,
            rope_scaling: None,
            tie_word_embeddings: true,
            attention_bias: false,
            sliding_window: None,
            bos_token_id: Some(0),
            eos_token_ids: vec![1],
            family: Default::default(),
        },
        tokenizer: TokenizerFiles {
            tokenizer_json: Some(TOKENIZER_JSON.into()),
            tokenizer_config_json: Some(r#"{"add_bos_token":true}"#.into()),
            chat_template: Some("{% for m in messages %}{{ m.content }}{% endfor %}".into()),
            special_tokens: special,
            add_bos_token: Some(true),
        },
        generation: serde_json::json!({"temperature": 0.7, "top_p": 0.9}),
        provenance: vec![ProvenanceStep {
            tool: "kiln-tests 0.0.0".into(),
            created: "2026-01-01T00:00:00Z".into(),
            details: serde_json::json!({"note": "sample"}),
            sources: vec![SourceFile {
                name: "model.safetensors".into(),
                bytes: 1234,
                sha256: "00".repeat(32),
            }],
        }],
    }
}

/// The sample's tensors: every dtype, lengths that leave padding after most of them, and two
/// names of equal length (`q` and `k`) so that one can be patched into the other in place.
pub fn sample_specs() -> Vec<TensorSpec> {
    let spec = |name: &str, dtype, shape: &[u64]| TensorSpec {
        name: name.into(),
        dtype,
        shape: shape.to_vec(),
    };
    vec![
        spec("embed.weight", DType::F32, &[4, 5]), // 80 bytes
        spec("layers.0.attn_norm.weight", DType::F16, &[7]), // 14 bytes
        spec("layers.0.attn.q.weight", DType::Q8_0, &[2, 64]), // 136 bytes
        spec("layers.0.attn.k.weight", DType::Q4_0, &[1, 32]), // 18 bytes
        spec("final_norm.weight", DType::BF16, &[3]), // 6 bytes, ends the file
    ]
}

/// Deterministic, tensor-specific content (never all zero, so a flipped byte always changes it).
pub fn tensor_bytes(i: usize, len: u64) -> Vec<u8> {
    (0..len)
        .map(|k| {
            (k as u8)
                .wrapping_mul(31)
                .wrapping_add((i as u8).wrapping_mul(17))
                | 1
        })
        .collect()
}

/// Write a file with the writer and return its bytes.
pub fn write_file(meta: &Metadata, specs: Vec<TensorSpec>) -> Vec<u8> {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("sample.kiln");
    let w = KilnWriter::create(&path, meta, specs, false).expect("create");
    for i in 0..w.len() {
        w.write_tensor(i, &tensor_bytes(i, w.tensor_len(i)))
            .expect("write");
    }
    w.finish().expect("finish");
    std::fs::read(&path).expect("read back")
}

/// The valid sample file, and where its fields are.
pub fn sample() -> (Vec<u8>, Map) {
    let bytes = write_file(&sample_metadata(), sample_specs());
    let map = Map::of(&bytes);
    (bytes, map)
}

/// Where one index record's fields lie (absolute file offsets).
#[derive(Debug, Clone)]
pub struct RecordMap {
    pub name: String,
    pub start: usize,
    pub name_len_at: usize,
    pub name_at: usize,
    pub dtype_at: usize,
    pub ndim_at: usize,
    pub dims_at: usize,
    pub ndim: usize,
    pub offset_at: usize,
    pub len_at: usize,
    pub sha_at: usize,
    pub end: usize,
    /// Absolute data range of the tensor.
    pub data: std::ops::Range<usize>,
}

/// Where the sections of a valid file lie.
#[derive(Debug, Clone)]
pub struct Map {
    pub file_len: usize,
    pub meta: std::ops::Range<usize>,
    pub index: std::ops::Range<usize>,
    pub data_offset: usize,
    pub records: Vec<RecordMap>,
}

impl Map {
    /// Walk a valid file's header and index.
    pub fn of(bytes: &[u8]) -> Map {
        let meta_len = u64_at(bytes, 24) as usize;
        let index_len = u64_at(bytes, 40) as usize;
        let data_offset = u64_at(bytes, 48) as usize;
        let count = u32_at(bytes, 64) as usize;
        let meta = 128..128 + meta_len;
        let index = meta.end..meta.end + index_len;
        let mut p = index.start;
        let mut records = Vec::new();
        for _ in 0..count {
            let start = p;
            let name_len = u32_at(bytes, p) as usize;
            let name_at = p + 4;
            let name = String::from_utf8(bytes[name_at..name_at + name_len].to_vec()).unwrap();
            let dtype_at = name_at + name_len;
            let ndim_at = dtype_at + 4;
            let ndim = u32_at(bytes, ndim_at) as usize;
            let dims_at = ndim_at + 4;
            let offset_at = dims_at + 8 * ndim;
            let len_at = offset_at + 8;
            let sha_at = len_at + 8;
            let end = sha_at + 32;
            let off = data_offset + u64_at(bytes, offset_at) as usize;
            let len = u64_at(bytes, len_at) as usize;
            records.push(RecordMap {
                name,
                start,
                name_len_at: start,
                name_at,
                dtype_at,
                ndim_at,
                dims_at,
                ndim,
                offset_at,
                len_at,
                sha_at,
                end,
                data: off..off + len,
            });
            p = end;
        }
        assert_eq!(p, index.end, "index walk");
        Map {
            file_len: bytes.len(),
            meta,
            index,
            data_offset,
            records,
        }
    }
}

pub fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}

pub fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}

pub fn set_u16(b: &mut [u8], at: usize, v: u16) {
    b[at..at + 2].copy_from_slice(&v.to_le_bytes());
}

pub fn set_u32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

pub fn set_u64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

/// Header field offsets (see docs/FORMAT.md).
pub mod at {
    pub const MAJOR: usize = 8;
    pub const MINOR: usize = 10;
    pub const FLAGS: usize = 12;
    pub const METADATA_OFFSET: usize = 16;
    pub const METADATA_LEN: usize = 24;
    pub const INDEX_OFFSET: usize = 32;
    pub const INDEX_LEN: usize = 40;
    pub const DATA_OFFSET: usize = 48;
    pub const DATA_LEN: usize = 56;
    pub const TENSOR_COUNT: usize = 64;
    pub const ALIGNMENT: usize = 68;
    pub const FILES_LEN: usize = 72;
    pub const RESERVED: usize = 80;
    pub const SHA: usize = 96;
}

/// Recompute the header checksum after patching: bytes 96..128 = sha256(bytes[0..96] ++
/// metadata ++ index ++ files), with the sections taken from the (possibly patched) header fields and
/// clamped to the file, so that absurd lengths still produce a well-defined seal. A sealed
/// file can only be refused by the structural checks, never by the checksum.
pub fn reseal(b: &mut [u8]) {
    let meta_len = u64_at(b, at::METADATA_LEN);
    let index_len = u64_at(b, at::INDEX_LEN);
    let files_len = u64_at(b, at::FILES_LEN);
    let end = 128u64
        .saturating_add(meta_len)
        .saturating_add(index_len)
        .saturating_add(files_len)
        .min(b.len() as u64) as usize;
    let mut h = Sha256::new();
    h.update(&b[..at::SHA]);
    h.update(&b[128.min(end)..end]);
    let sha: [u8; 32] = h.finalize().into();
    b[at::SHA..128].copy_from_slice(&sha);
}

/// Assemble a file from raw sections, with a correct header (offsets, lengths, checksum).
/// `records` is the raw index, `data` the raw data section.
pub fn assemble(metadata: &[u8], index: &[u8], tensor_count: u32, data: &[u8]) -> Vec<u8> {
    assemble_with_files(metadata, index, tensor_count, &[], data)
}

/// [`assemble`] with a files section (raw records) after the index; minor 3 when it is not
/// empty, as the writer does.
pub fn assemble_with_files(
    metadata: &[u8],
    index: &[u8],
    tensor_count: u32,
    files: &[u8],
    data: &[u8],
) -> Vec<u8> {
    let index_end = 128 + metadata.len() + index.len();
    let files_end = index_end + files.len();
    let data_offset = files_end.div_ceil(64) * 64;
    let mut b = vec![0u8; data_offset + data.len()];
    b[..8].copy_from_slice(b"KILN\r\n\x1a\n");
    set_u16(&mut b, at::MAJOR, 1);
    set_u16(&mut b, at::MINOR, if files.is_empty() { 0 } else { 3 });
    set_u64(&mut b, at::METADATA_OFFSET, 128);
    set_u64(&mut b, at::METADATA_LEN, metadata.len() as u64);
    set_u64(&mut b, at::INDEX_OFFSET, 128 + metadata.len() as u64);
    set_u64(&mut b, at::INDEX_LEN, index.len() as u64);
    set_u64(&mut b, at::DATA_OFFSET, data_offset as u64);
    set_u64(&mut b, at::DATA_LEN, data.len() as u64);
    set_u32(&mut b, at::TENSOR_COUNT, tensor_count);
    set_u32(&mut b, at::ALIGNMENT, 64);
    set_u64(&mut b, at::FILES_LEN, files.len() as u64);
    b[128..128 + metadata.len()].copy_from_slice(metadata);
    b[128 + metadata.len()..index_end].copy_from_slice(index);
    b[index_end..files_end].copy_from_slice(files);
    b[data_offset..].copy_from_slice(data);
    reseal(&mut b);
    b
}

/// Open in memory under [`LABEL`].
pub fn open(bytes: Vec<u8>) -> Result<KilnFile, FormatError> {
    KilnFile::from_bytes(LABEL, bytes)
}

// ---------------------------------------------------------------------------------------------
// Allocation tracking.

/// A global allocator that records, per thread, the largest single allocation while armed.
/// Per thread because the test harness runs tests on parallel threads; [`KilnFile::from_bytes`]
/// parses on the calling thread.
pub struct TrackingAlloc;

thread_local! {
    static ARMED: Cell<bool> = const { Cell::new(false) };
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

fn note(size: usize) {
    // `try_with` because the allocator can run while thread-locals are torn down.
    let _ = ARMED.try_with(|armed| {
        if armed.get() {
            let _ = LARGEST.try_with(|l| l.set(l.get().max(size)));
        }
    });
}

// SAFETY: every method forwards to the system allocator with the caller's arguments unchanged;
// the bookkeeping only touches const-initialised thread-locals, which never allocate.
unsafe impl GlobalAlloc for TrackingAlloc {
    unsafe fn alloc(&self, layout: AllocLayout) -> *mut u8 {
        note(layout.size());
        // SAFETY: forwarded unchanged; the caller upholds `GlobalAlloc::alloc`'s contract.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: AllocLayout) -> *mut u8 {
        note(layout.size());
        // SAFETY: forwarded unchanged; the caller upholds `GlobalAlloc::alloc_zeroed`'s contract.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: AllocLayout) {
        // SAFETY: `ptr` came from `System` through this allocator with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: AllocLayout, new_size: usize) -> *mut u8 {
        note(new_size);
        // SAFETY: forwarded unchanged; `ptr` came from `System` with `layout`.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

/// Run `f` and return its result with the largest single allocation it made on this thread.
pub fn largest_allocation_during<T>(f: impl FnOnce() -> T) -> (T, usize) {
    LARGEST.with(|l| l.set(0));
    ARMED.with(|a| a.set(true));
    let out = f();
    ARMED.with(|a| a.set(false));
    (out, LARGEST.with(|l| l.get()))
}
