//! `kiln-verify` against hostile inputs: a reference or base that holds NaN is the
//! reference's fault (exit 2 naming it), never the model's (exit 1); devices, FIFOs and
//! sockets named as inputs are refused at once, saying what they are; `--save-logits` never
//! replaces what the run reads; a negative number is refused by the flag's range.

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
fn devices_fifos_and_sockets_as_inputs_are_refused_at_once() {
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
    let _listener = std::os::unix::net::UnixListener::bind(dir.path().join("sock")).unwrap();
    for path in ["/dev/zero", "fifo", "sock"] {
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
                e.contains(path) && e.contains("not a file; give the path of the "),
                "{args:?}: {e}"
            );
            assert!(
                !e.contains("os error") && !e.contains("file file"),
                "{args:?}: {e}"
            );
        }
    }
}

/// A negative number given to a numeric flag is refused by the flag's range, naming the flag
/// and the range (regression: clap's "unexpected argument '-1' found" named no flag).
#[test]
fn a_negative_number_is_refused_naming_the_flag_and_its_range() {
    let dir = tempfile::tempdir().unwrap();
    for (args, flag, range) in [
        (
            &[
                "perplexity",
                "m.kiln",
                "--text",
                "t.txt",
                "--kl-base",
                "b",
                "--max-kld",
                "-1",
            ][..],
            "--max-kld",
            "must be a finite number, at least 0",
        ),
        (
            &["perplexity", "m.kiln", "--text", "t.txt", "-c", "-1"],
            "--ctx",
            "must be a whole number, at least 8",
        ),
        (
            &["layers", "m.kiln", "--reference", "r", "--min-top1", "-1"],
            "--min-top1",
            "must be a number from 0 to 1",
        ),
        (
            &["layers", "m.kiln", "--reference", "r", "-t", "-1"],
            "--threads",
            "must be a whole number, at least 1",
        ),
    ] {
        let o = kv(args, dir.path());
        let e = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {e}");
        assert!(
            e.contains(&format!("invalid value '-1' for '{flag} <")) && e.contains(range),
            "{args:?}: {e}"
        );
        assert!(!e.contains("unexpected argument"), "{args:?}: {e}");
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
