//! What the converter's integration tests share: the repository root and the tiny fixtures.

use std::path::{Path, PathBuf};

use kiln_convert::{convert_hf, ConvertOptions, NoProgress};

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
