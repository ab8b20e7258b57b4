//! `kiln-run generate -f FILE` reads only a regular file of bounded size: a device that reads
//! forever (`/dev/zero`) or a FIFO nobody writes to is refused at once, naming the file, with
//! exit status 2. Each run is killed past a deadline, so a regression cannot hang the tests.

/// The runner's test helpers (fixtures, reference dumps, metrics), shared rather than copied.
#[path = "../../runner/tests/common/mod.rs"]
mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

/// Bad input, as every Kiln program reports it.
const BAD_INPUT: i32 = 2;

/// Longest a refusal may take: it must not read the device or wait for the FIFO's writer.
const REFUSAL_DEADLINE: Duration = Duration::from_secs(20);

fn tiny(dir: &Path) -> PathBuf {
    convert(&root().join("fixtures/tiny/llama-tied-f32"), dir, None)
}

/// Run `kiln-run args`, killing it past [`REFUSAL_DEADLINE`]: (exit code, stderr).
fn run_bounded(args: &[&str]) -> (Option<i32>, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kiln-run"))
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start kiln-run");
    let start = Instant::now();
    loop {
        if child.try_wait().unwrap().is_some() {
            let out = child.wait_with_output().unwrap();
            return (
                out.status.code(),
                String::from_utf8_lossy(&out.stderr).into_owned(),
            );
        }
        if start.elapsed() > REFUSAL_DEADLINE {
            let _ = child.kill();
            let _ = child.wait();
            panic!("kiln-run {args:?} still running after {REFUSAL_DEADLINE:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn a_prompt_file_that_is_a_device_or_a_fifo_is_refused_at_once_naming_it() {
    let tmp = tempfile::tempdir().unwrap();
    let m = tiny(tmp.path());
    let fifo = tmp.path().join("prompt.fifo");
    let made = Command::new("mkfifo").arg(&fifo).status().expect("mkfifo");
    assert!(made.success());
    for (file, what) in [
        (Path::new("/dev/zero"), "is a device, not a file"),
        (fifo.as_path(), "is a FIFO (named pipe), not a file"),
    ] {
        let path = file.to_str().unwrap();
        let (code, err) = run_bounded(&["generate", m.to_str().unwrap(), "-f", path]);
        assert_eq!(code, Some(BAD_INPUT), "{path}: {err}");
        assert!(err.contains(&format!("{path}: {what}")), "{path}: {err}");
    }
}

#[test]
fn a_prompt_file_over_the_size_limit_is_refused_by_its_size() {
    let tmp = tempfile::tempdir().unwrap();
    let m = tiny(tmp.path());
    // A sparse file: its size is over the limit without writing its bytes.
    let big = tmp.path().join("big.txt");
    std::fs::File::create(&big)
        .unwrap()
        .set_len((64 << 20) + 1)
        .unwrap();
    let path = big.to_str().unwrap();
    let (code, err) = run_bounded(&["generate", m.to_str().unwrap(), "-f", path]);
    assert_eq!(code, Some(BAD_INPUT), "{err}");
    assert!(
        err.contains(&format!("{path}: 67108865 bytes is over the limit")),
        "{err}"
    );
}
