//! `kiln-convert` stopped by a signal while it writes its output: the temporary file is removed,
//! the stderr names the signal, and the exit status is 128 + the signal's number (SIGINT 130,
//! SIGTERM 143, SIGHUP 129), the rule every Kiln program follows.
//!
//! The run is caught mid-write deterministically (format/tests/support/interrupt.rs).

mod common;
#[path = "../../format/tests/support/interrupt.rs"]
mod interrupt;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::repo;
use interrupt::{entries as files_in, interrupt_mid_write};

/// Rows of the widened embedding: 2^19 × 64 f32 values, 128 MiB, so that writing the output
/// takes long enough to be caught (a tenth of a second or more).
const WIDE_VOCAB: u64 = 1 << 19;

/// Each signal, its name for `kill -s`, and the exit status it must give.
const SIGNALS: [(&str, i32); 3] = [("INT", 130), ("TERM", 143), ("HUP", 129)];

/// The tiny Llama checkpoint with a vocabulary of `vocab` rows (the tokenizer's ids are the
/// first 320). The embedding, zeros, is the last tensor of `model.safetensors` and is left as
/// a hole in the file, so a checkpoint of a hundred megabytes costs neither disk nor time.
fn wide_vocabulary_checkpoint(dir: &Path, vocab: u64) -> PathBuf {
    let src = repo().join("fixtures/tiny/llama-tied-f32");
    let ckpt = dir.join("wide");
    std::fs::create_dir_all(&ckpt).unwrap();
    for e in std::fs::read_dir(&src).unwrap() {
        let e = e.unwrap();
        if e.file_name() != "model.safetensors" {
            std::fs::copy(e.path(), ckpt.join(e.file_name())).unwrap();
        }
    }
    let config = ckpt.join("config.json");
    let mut v: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&config).unwrap()).unwrap();
    v["vocab_size"] = vocab.into();
    std::fs::write(&config, serde_json::to_vec(&v).unwrap()).unwrap();

    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for (name, t) in st.tensors() {
        if name == "model.embed_tokens.weight" {
            continue;
        }
        let start = data.len();
        data.extend_from_slice(t.data());
        header.insert(
            name,
            serde_json::json!({
                "dtype": "F32", "shape": t.shape(), "data_offsets": [start, data.len()]
            }),
        );
    }
    let embed_end = data.len() as u64 + vocab * 64 * 4;
    header.insert(
        "model.embed_tokens.weight".into(),
        serde_json::json!({
            "dtype": "F32", "shape": [vocab, 64], "data_offsets": [data.len(), embed_end]
        }),
    );
    let mut json = serde_json::to_vec(&header).unwrap();
    json.resize(json.len().next_multiple_of(8), b' ');
    let mut file_bytes = (json.len() as u64).to_le_bytes().to_vec();
    file_bytes.extend_from_slice(&json);
    file_bytes.extend_from_slice(&data);
    let path = ckpt.join("model.safetensors");
    std::fs::write(&path, &file_bytes).unwrap();
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.set_len(8 + json.len() as u64 + embed_end).unwrap();
    ckpt
}

#[test]
fn each_signal_removes_the_unfinished_output_and_exits_with_128_plus_its_number() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = wide_vocabulary_checkpoint(tmp.path(), WIDE_VOCAB);
    for (signal, code) in SIGNALS {
        let out = tmp.path().join(format!("out-{signal}"));
        std::fs::create_dir(&out).unwrap();
        let (status, err) = interrupt_mid_write(
            Command::new(env!("CARGO_BIN_EXE_kiln-convert"))
                .arg("hf")
                .arg(&ckpt)
                .arg("-o")
                .arg(out.join("m.kiln")),
            &out,
            "m.kiln",
            signal,
        );
        assert_eq!(status, Some(code), "SIG{signal}: {err}");
        assert!(
            err.contains(&format!("kiln-convert: interrupted by SIG{signal}")),
            "SIG{signal}: {err}"
        );
        let left = files_in(&out);
        assert!(left.is_empty(), "SIG{signal} left {left:?}");
    }
}
