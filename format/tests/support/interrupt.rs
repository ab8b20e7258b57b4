//! Catching a Kiln program mid-write and interrupting it there, for the signal tests of the
//! programs that write outputs (`kiln-convert`, `kiln-quantize`); included by `#[path]`, so the
//! harness is written once.
//!
//! Deterministic rather than timed: once the temporary output appears the process is stopped
//! (SIGSTOP), the signal is queued, and the process is let go on (SIGCONT), so the signal
//! always lands while the output is unfinished.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Longest wait for the temporary output to appear, and for the exit after the signal.
pub const DEADLINE: Duration = Duration::from_secs(60);

/// Send `signal` (a name for `kill -s`: "TERM") to `pid`.
pub fn kill(signal: &str, pid: u32) {
    let ok = Command::new("kill")
        .args(["-s", signal, &pid.to_string()])
        .status()
        .expect("run kill");
    assert!(ok.success(), "kill -s {signal} {pid} failed");
}

/// The names of the entries of `dir`.
pub fn entries(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect()
}

/// Run `cmd` until a file appears in the empty directory `out` (the output's temporary file),
/// stop it there, send `signal` and let it go on: its exit status and stderr. Fails if the run
/// ends before, or if it had already published `final_name`.
pub fn interrupt_mid_write(
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
    while entries(out).is_empty() {
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
    let seen = entries(out);
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
