//! `kiln-verify` against hostile inputs: a reference or base that holds NaN is the
//! reference's fault (exit 2 naming it), never the model's (exit 1); devices and FIFOs named
//! as inputs are refused at once; `--save-logits` never replaces what the run reads.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

const MODEL: &str = "qwen2-bias-f32";

fn model(dir: &Path) -> PathBuf {
    let out = dir.join("model.kiln");
    kiln_convert::convert_hf(
        &kiln_convert::ConvertOptions {
            input: repo().join("fixtures/tiny").join(MODEL),
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

/// Run `kiln-verify` in `dir`, failing (not hanging) if it has not ended in 60 s.
fn kv(args: &[&str], dir: &Path) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kiln-verify"))
        .args(args)
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            panic!("kiln-verify {args:?} did not end in 60 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Rewrite a safetensors file with `edit` applied to one tensor's bytes.
fn rewrite(src: &Path, dst: &Path, tensor: &str, edit: impl FnOnce(&mut Vec<u8>)) {
    let mut edit = Some(edit);
    common::rewrite_safetensors(src, dst, |name, _, bytes| {
        if name == tensor {
            (edit.take().expect("one tensor of that name"))(bytes);
        }
    });
}

#[test]
fn a_reference_holding_nan_is_bad_input_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let m = model(dir.path());
    let good = repo().join(format!("fixtures/reference/tiny/{MODEL}/1.safetensors"));
    let site = "model.layers.0.mlp.output";
    for (name, value) in [
        ("nan.safetensors", f32::NAN),
        ("inf.safetensors", f32::INFINITY),
    ] {
        rewrite(&good, &dir.path().join(name), site, |b| {
            b[4..8].copy_from_slice(&value.to_le_bytes());
        });
        let o = kv(
            &["layers", m.to_str().unwrap(), "--reference", name],
            dir.path(),
        );
        let e = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{name}: {e}");
        assert!(
            e.contains(name) && e.contains(site) && e.contains("element 1"),
            "{e}"
        );
    }
}

#[test]
fn saved_logits_holding_nan_are_bad_input_naming_them() {
    let dir = tempfile::tempdir().unwrap();
    let m = model(dir.path());
    std::fs::copy(
        repo().join("fixtures/tiny/corpus.txt"),
        dir.path().join("t.txt"),
    )
    .unwrap();
    let ppl = |extra: &[&str]| {
        let mut a = vec![
            "perplexity",
            m.to_str().unwrap(),
            "--text",
            "t.txt",
            "-c",
            "16",
        ];
        a.extend(extra);
        kv(&a, dir.path())
    };
    let o = ppl(&["--save-logits", "base.logits"]);
    assert!(o.status.success(), "{}", stderr(&o));
    rewrite(
        &dir.path().join("base.logits"),
        &dir.path().join("nan.logits"),
        "chunk.0",
        |b| b[2..4].copy_from_slice(&half::f16::NAN.to_le_bytes()),
    );
    let o = ppl(&["--kl-base", "nan.logits"]);
    let e = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{e}");
    assert!(e.contains("nan.logits") && e.contains("chunk.0"), "{e}");
}

#[cfg(unix)]
#[test]
fn devices_and_fifos_as_inputs_are_refused_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let m = model(dir.path());
    let m = m.to_str().unwrap();
    std::fs::copy(
        repo().join("fixtures/tiny/corpus.txt"),
        dir.path().join("t.txt"),
    )
    .unwrap();
    assert!(Command::new("mkfifo")
        .arg(dir.path().join("fifo"))
        .status()
        .unwrap()
        .success());
    for path in ["/dev/zero", "fifo"] {
        let runs: [Vec<&str>; 4] = [
            vec!["layers", m, "--reference", path],
            vec!["perplexity", m, "--text", path, "-c", "16"],
            vec![
                "perplexity",
                m,
                "--text",
                "t.txt",
                "-c",
                "16",
                "--kl-base",
                path,
            ],
            vec!["integrity", path],
        ];
        for args in runs {
            let o = kv(&args, dir.path());
            let e = stderr(&o);
            assert_eq!(o.status.code(), Some(2), "{args:?}: {e}");
            assert!(
                e.contains(path) && e.contains("not a file"),
                "{args:?}: {e}"
            );
        }
    }
}

#[test]
fn saved_logits_never_replace_an_input() {
    let dir = tempfile::tempdir().unwrap();
    let m = model(dir.path());
    let m = m.to_str().unwrap();
    std::fs::copy(
        repo().join("fixtures/tiny/corpus.txt"),
        dir.path().join("t.txt"),
    )
    .unwrap();
    let o = kv(
        &[
            "perplexity",
            m,
            "--text",
            "t.txt",
            "-c",
            "16",
            "--save-logits",
            "base.logits",
        ],
        dir.path(),
    );
    assert!(o.status.success(), "{}", stderr(&o));
    std::fs::hard_link(dir.path().join("t.txt"), dir.path().join("t-link.txt")).unwrap();
    let text = std::fs::read(dir.path().join("t.txt")).unwrap();
    let base = std::fs::read(dir.path().join("base.logits")).unwrap();
    for save in ["t.txt", "t-link.txt", "./base.logits", m] {
        let o = kv(
            &[
                "perplexity",
                m,
                "--text",
                "t.txt",
                "-c",
                "16",
                "--kl-base",
                "base.logits",
                "--save-logits",
                save,
                "--force",
            ],
            dir.path(),
        );
        let e = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{save}: {e}");
        assert!(e.contains("also an input"), "{save}: {e}");
    }
    assert_eq!(std::fs::read(dir.path().join("t.txt")).unwrap(), text);
    assert_eq!(std::fs::read(dir.path().join("base.logits")).unwrap(), base);
    kiln_format::KilnFile::open(m).unwrap().verify().unwrap();
}
