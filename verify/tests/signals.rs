//! `kiln-verify` stopped by a signal mid-run: the stderr names the signal, no results file is
//! left (not even a temporary one), and the exit status is 128 + the signal's number (SIGTERM
//! 143), the rule every Kiln program follows.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Longest wait for the exit after the signal.
const DEADLINE: Duration = Duration::from_secs(60);

/// Tokens per perplexity chunk: each token attends to all before it, so two chunks of this
/// many keep even the tiny model busy for seconds, long after the signal.
const LONG_CTX: u32 = 16384;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The tiny Llama with a context of 2^18 positions, converted into `dir`.
fn long_context_tiny(dir: &Path) -> PathBuf {
    let src = repo().join("fixtures/tiny/llama-tied-f32");
    let copy = dir.join("long-context");
    std::fs::create_dir_all(&copy).unwrap();
    for e in std::fs::read_dir(&src).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), copy.join(e.file_name())).unwrap();
    }
    let config = copy.join("config.json");
    let mut v: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&config).unwrap()).unwrap();
    v["max_position_embeddings"] = (1u64 << 18).into();
    std::fs::write(&config, serde_json::to_vec(&v).unwrap()).unwrap();
    let out = dir.join("long.kiln");
    kiln_convert::convert_hf(
        &kiln_convert::ConvertOptions {
            input: copy,
            output: out.clone(),
            dtype: None,
            overwrite: true,
            allow_non_finite: false,
        },
        &kiln_convert::NoProgress,
    )
    .unwrap();
    out
}

#[test]
fn sigterm_mid_perplexity_leaves_no_results_file_and_exits_143() {
    let tmp = tempfile::tempdir().unwrap();
    let model = long_context_tiny(tmp.path());
    let corpus = std::fs::read_to_string(repo().join("fixtures/tiny/corpus.txt")).unwrap();
    let text = tmp.path().join("text.txt");
    std::fs::write(&text, corpus.repeat(200)).unwrap();
    let out = tmp.path().join("out");
    std::fs::create_dir(&out).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_kiln-verify"))
        .arg("perplexity")
        .arg(&model)
        .arg("--text")
        .arg(&text)
        .args(["-c", &LONG_CTX.to_string(), "--chunks", "2", "-t", "1"])
        .arg("--save-logits")
        .arg(out.join("base.logits"))
        .arg("--junit")
        .arg(out.join("ppl.xml"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Past the checksum pass and the tokenizing, into the first chunk.
    std::thread::sleep(Duration::from_millis(1000));
    if let Some(status) = child.try_wait().unwrap() {
        let o = child.wait_with_output().unwrap();
        panic!(
            "ended ({status}) before the signal: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
    let ok = Command::new("kill")
        .args(["-s", "TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(ok.success());
    let sent = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if sent.elapsed() > DEADLINE {
            let _ = child.kill();
            panic!("still running {DEADLINE:?} after SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let o = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(143), "{err}");
    assert!(err.contains("kiln-verify: interrupted by SIGTERM"), "{err}");
    let left: Vec<_> = std::fs::read_dir(&out).unwrap().collect();
    assert!(left.is_empty(), "{left:?}");
}
