//! `kiln-convert` stopped by a signal while it writes its output: the temporary file is removed,
//! the stderr names the signal, and the exit status is 128 + the signal's number (SIGINT 130,
//! SIGTERM 143, SIGHUP 129), the rule every Kiln program follows.
//!
//! The run is caught mid-write deterministically: once the temporary output appears, the
//! process is stopped (SIGSTOP), the signal is queued, and the process is let go on (SIGCONT).

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::repo;

/// Longest wait for the temporary output to appear, and for the exit after the signal.
const DEADLINE: Duration = Duration::from_secs(60);

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

fn kill(signal: &str, pid: u32) {
    let ok = Command::new("kill")
        .args(["-s", signal, &pid.to_string()])
        .status()
        .expect("run kill");
    assert!(ok.success(), "kill -s {signal} {pid} failed");
}

fn files_in(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect()
}

/// Run `cmd` until a file appears in the empty directory `out` (the output's temporary file),
/// stop it there, send `signal` and let it go on: its exit status and stderr. Fails if the run
/// ends before, or if it had already published `final_name`.
fn interrupt_mid_write(
    cmd: &mut Command,
    out: &Path,
    final_name: &str,
    signal: &str,
) -> (Option<i32>, String) {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while files_in(out).is_empty() {
        if let Some(status) = child.try_wait().unwrap() {
            let o = child.wait_with_output().unwrap();
            panic!(
                "ended ({status}) before writing: {}",
                String::from_utf8_lossy(&o.stderr)
            );
        }
        assert!(start.elapsed() < DEADLINE, "no output after {DEADLINE:?}");
        std::thread::sleep(Duration::from_millis(1));
    }
    kill("STOP", child.id());
    let seen = files_in(out);
    assert!(
        !seen.iter().any(|f| f == final_name),
        "SIG{signal}: the run finished before it was stopped ({seen:?}); widen the model"
    );
    kill(signal, child.id());
    kill("CONT", child.id());
    let sent = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if sent.elapsed() > DEADLINE {
            let _ = child.kill();
            panic!("SIG{signal}: still running {DEADLINE:?} after the signal");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let o = child.wait_with_output().unwrap();
    (
        o.status.code(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
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
