//! `kiln-quantize` against hostile paths: no output ever replaces a file the run reads (the
//! model, the calibration text, the importance file) or another output, `--force` or not;
//! devices, FIFOs and sockets named as inputs are refused at once; negative numbers are
//! refused by the flag's range; a long calibration text costs only the part of it that the
//! token limit needs.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// A real (tiny) model with a tokenizer, converted into `dir`, and its calibration text.
fn model_and_text(dir: &Path) -> (PathBuf, PathBuf) {
    let model = dir.join("in.kiln");
    kiln_convert::convert_hf(
        &kiln_convert::ConvertOptions {
            input: root().join("fixtures/tiny/llama-untied-bf16"),
            output: model.clone(),
            dtype: None,
            overwrite: true,
            allow_non_finite: false,
        },
        &kiln_convert::NoProgress,
    )
    .unwrap();
    let text = dir.join("text.txt");
    std::fs::copy(root().join("fixtures/tiny/corpus.txt"), &text).unwrap();
    (model, text)
}

/// Run `kiln-quantize` in `dir`, killing it (and failing) if it has not ended in 60 s: a run
/// that blocks on a FIFO must fail the test, not hang it.
fn kq(args: &[&str], dir: &Path) -> Output {
    kq_in(
        Command::new(env!("CARGO_BIN_EXE_kiln-quantize")).args(args),
        dir,
    )
}

fn kq_in(cmd: &mut Command, dir: &Path) -> Output {
    let mut child = cmd
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
            let o = child.wait_with_output().unwrap();
            panic!(
                "kiln-quantize did not end in 60 s: {}",
                String::from_utf8_lossy(&o.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

const CALIBRATE: &[&str] = &["--calib-tokens", "256", "--calib-ctx", "64", "-q"];

#[test]
fn no_output_replaces_an_input_or_another_output() {
    let dir = tempfile::tempdir().unwrap();
    let (model, text) = model_and_text(dir.path());
    // An importance file to name as an input.
    let mut args = vec![
        "in.kiln",
        "first.kiln",
        "--to",
        "q4_0",
        "--calibrate",
        "text.txt",
        "--save-importance",
        "imp.safetensors",
    ];
    args.extend(CALIBRATE);
    let o = kq(&args, dir.path());
    assert!(o.status.success(), "{}", stderr(&o));
    std::fs::hard_link(&model, dir.path().join("model-link.kiln")).unwrap();

    let snapshot = |p: &Path| std::fs::read(p).unwrap();
    let (model_bytes, text_bytes) = (snapshot(&model), snapshot(&text));
    let imp = dir.path().join("imp.safetensors");
    let imp_bytes = snapshot(&imp);

    let calibrated = |output: &'static str, save: &'static str| {
        let mut a = vec![
            "in.kiln",
            output,
            "--to",
            "q4_0",
            "--calibrate",
            "text.txt",
            "--save-importance",
            save,
            "--force",
        ];
        a.extend(CALIBRATE);
        a
    };
    let cases: Vec<(&str, Vec<&str>, &str)> = vec![
        (
            "--save-importance over the model",
            calibrated("out.kiln", "in.kiln"),
            "also an input",
        ),
        (
            "--save-importance over a hard link to the model",
            calibrated("out.kiln", "model-link.kiln"),
            "also an input",
        ),
        (
            "--save-importance over the calibration text",
            calibrated("out.kiln", "text.txt"),
            "also an input",
        ),
        (
            "the output over the calibration text",
            calibrated("text.txt", "other.safetensors"),
            "also an input",
        ),
        (
            "the output over the importance file",
            vec![
                "in.kiln",
                "imp.safetensors",
                "--to",
                "q4_0",
                "--importance",
                "imp.safetensors",
                "--force",
                "-q",
            ],
            "also an input",
        ),
        (
            "--save-importance and the output the same file",
            calibrated("same.kiln", "./same.kiln"),
            "two outputs",
        ),
    ];
    for (what, args, needle) in cases {
        let o = kq(&args, dir.path());
        assert_eq!(o.status.code(), Some(2), "{what}: {}", stderr(&o));
        assert!(stderr(&o).contains(needle), "{what}: {}", stderr(&o));
        assert_eq!(snapshot(&model), model_bytes, "{what}: the model changed");
        assert_eq!(snapshot(&text), text_bytes, "{what}: the text changed");
        assert_eq!(snapshot(&imp), imp_bytes, "{what}: the importance changed");
        assert!(!dir.path().join("same.kiln").exists(), "{what}");
        assert!(!dir.path().join("out.kiln").exists(), "{what}");
    }
}

/// Devices, FIFOs and sockets named as inputs are refused at once, saying what they are and
/// what was expected in plain words (regression: "a importance file file"; a socket was
/// "No such device or address (os error 6)").
#[cfg(unix)]
#[test]
fn devices_fifos_and_sockets_as_inputs_are_refused_at_once() {
    let dir = tempfile::tempdir().unwrap();
    model_and_text(dir.path());
    let fifo = dir.path().join("fifo");
    assert!(Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap()
        .success());
    let _listener = std::os::unix::net::UnixListener::bind(dir.path().join("sock")).unwrap();
    for (path, what) in [
        ("/dev/zero", "a device"),
        ("fifo", "a FIFO"),
        ("sock", "a socket"),
    ] {
        for (flag, expected) in [
            ("--calibrate", "calibration text"),
            ("--importance", "importance file"),
        ] {
            let o = kq(
                &["in.kiln", "out.kiln", "--to", "q4_0", flag, path, "-q"],
                dir.path(),
            );
            let e = stderr(&o);
            assert_eq!(o.status.code(), Some(2), "{flag} {path}: {e}");
            let said = format!("{path}: is {what}");
            let wanted = format!("not a file; give the path of the {expected}");
            assert!(
                e.contains(&said) && e.contains(&wanted),
                "{flag} {path}: {e}"
            );
            assert!(
                !e.contains("os error") && !e.contains("file file"),
                "{flag} {path}: {e}"
            );
            assert!(!dir.path().join("out.kiln").exists());
        }
    }
}

/// A negative number given to a numeric flag is refused by the flag's range, naming the flag
/// and the range (regression: clap's "unexpected argument '-1' found" named no flag).
#[test]
fn a_negative_number_is_refused_naming_the_flag_and_its_range() {
    let dir = tempfile::tempdir().unwrap();
    for (extra, flag, range) in [
        (
            &["--to", "auto", "--bpw", "-1"][..],
            "--bpw",
            "must be a number above 0 and at most 32",
        ),
        (
            &["--to", "auto", "--max-bytes", "-1"],
            "--max-bytes",
            "must be a whole number, at least 1",
        ),
        (
            &["--to", "q8_0", "--threads", "-1"],
            "--threads",
            "must be a whole number from 1 to 1024",
        ),
        (
            &["--to", "q8_0", "--calib-ctx", "-1"],
            "--calib-ctx",
            "must be a whole number from 16 to 1000000",
        ),
    ] {
        let mut args = vec!["in.kiln", "out.kiln"];
        args.extend_from_slice(extra);
        let o = kq(&args, dir.path());
        let e = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {e}");
        assert!(
            e.contains(&format!("invalid value '-1' for '{flag} <")) && e.contains(range),
            "{args:?}: {e}"
        );
        assert!(!e.contains("unexpected argument"), "{args:?}: {e}");
    }
}

/// A 40 MB calibration text under a 2 GiB address-space limit: tokenized whole it took about
/// 7.5 GB and the allocator aborted; only the prefix that the token limit needs is read.
#[cfg(target_os = "linux")]
#[test]
fn a_long_calibration_text_costs_only_the_tokens_it_gives() {
    let dir = tempfile::tempdir().unwrap();
    let (_, text) = model_and_text(dir.path());
    let corpus = std::fs::read(&text).unwrap();
    let mut long = Vec::with_capacity(40 << 20);
    while long.len() < 40 << 20 {
        long.extend_from_slice(&corpus);
    }
    std::fs::write(dir.path().join("long.txt"), &long).unwrap();
    let o = kq_in(
        Command::new("sh").args([
            "-c",
            "ulimit -v 2097152 && exec \"$0\" in.kiln out.kiln --to q4_0 --calibrate long.txt \
             --calib-tokens 4096 --calib-ctx 64 --threads 2 -q",
            env!("CARGO_BIN_EXE_kiln-quantize"),
        ]),
        dir.path(),
    );
    assert!(o.status.success(), "{:?}: {}", o.status, stderr(&o));
    // The tokens are the first 4096 of the whole text: calibrating on the short text that
    // holds them gives the same importance.
    let a = kq(
        &[
            "in.kiln",
            "a.kiln",
            "--to",
            "q4_0",
            "--calibrate",
            "long.txt",
            "--calib-tokens",
            "300",
            "--calib-ctx",
            "64",
            "--save-importance",
            "a.safetensors",
            "-q",
        ],
        dir.path(),
    );
    assert!(a.status.success(), "{}", stderr(&a));
    let b = kq(
        &[
            "in.kiln",
            "b.kiln",
            "--to",
            "q4_0",
            "--calibrate",
            "text.txt",
            "--calib-tokens",
            "300",
            "--calib-ctx",
            "64",
            "--save-importance",
            "b.safetensors",
            "-q",
        ],
        dir.path(),
    );
    assert!(b.status.success(), "{}", stderr(&b));
    let load = |p: &str| kiln_quantize::importance::Importance::load(&dir.path().join(p)).unwrap();
    let (ia, ib) = (load("a.safetensors"), load("b.safetensors"));
    assert_eq!(ia.columns, ib.columns);
    assert_eq!(ia.info.tokens, 300);
}
