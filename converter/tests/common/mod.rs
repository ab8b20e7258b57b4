//! What the converter's integration tests share: the repository root and the tiny fixtures.

use std::path::{Path, PathBuf};

use kiln_convert::{convert_hf, ConvertOptions, NoProgress};
use sha2::{Digest, Sha256};

/// The repository root.
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Convert the checkpoint directory `dir` to `out` with the defaults (no dtype change, no
/// overwrite); panics on any error.
#[allow(dead_code)]
pub fn convert(dir: &Path, out: &Path) {
    convert_hf(
        &ConvertOptions {
            input: dir.to_path_buf(),
            output: out.to_path_buf(),
            dtype: None,
            overwrite: false,
            allow_non_finite: false,
        },
        &NoProgress,
    )
    .unwrap();
}

/// The committed tiny checkpoints under `fixtures/tiny/` (not every test file walks them all).
#[allow(dead_code)]
pub const TINY: &[&str] = &[
    "llama-tied-f32",
    "llama-untied-bf16",
    "qwen2-bias-f32",
    "llama3-rope-f32",
    "mistral-f32",
    "llama-sharded-f16",
    "qwen3-f32",
    "gemma3-f32",
    "phi3-f32",
    "glm4-f32",
    "glm-f32",
];

/// `src` with its metadata JSON replaced by `edit`'s, the header rebuilt and re-sealed: a
/// file as a hostile tool would write it (the writer refuses such a configuration).
#[allow(dead_code)]
pub fn with_metadata(src: &[u8], edit: impl FnOnce(&mut serde_json::Value)) -> Vec<u8> {
    let u64_at = |b: &[u8], o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap());
    let (meta_len, index_len, files_len) = (u64_at(src, 24), u64_at(src, 40), u64_at(src, 72));
    let data_offset = u64_at(src, 48) as usize;
    let meta_end = 128 + meta_len as usize;
    let mut meta: serde_json::Value = serde_json::from_slice(&src[128..meta_end]).unwrap();
    edit(&mut meta);
    let meta = serde_json::to_vec(&meta).unwrap();
    let rest = &src[meta_end..meta_end + (index_len + files_len) as usize];
    let end = 128 + meta.len() + rest.len();
    let new_data_offset = end.next_multiple_of(64);
    let mut b = src[..128].to_vec();
    b.extend_from_slice(&meta);
    b.extend_from_slice(rest);
    b.resize(new_data_offset, 0);
    b.extend_from_slice(&src[data_offset..]);
    let set = |b: &mut Vec<u8>, o: usize, v: u64| b[o..o + 8].copy_from_slice(&v.to_le_bytes());
    set(&mut b, 24, meta.len() as u64);
    set(&mut b, 32, 128 + meta.len() as u64);
    set(&mut b, 48, new_data_offset as u64);
    let mut h = Sha256::new();
    h.update(&b[..96]);
    h.update(&b[128..end]);
    let sha: [u8; 32] = h.finalize().into();
    b[96..128].copy_from_slice(&sha);
    b
}
