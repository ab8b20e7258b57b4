//! `kiln-run` stopped by SIGINT, SIGTERM and SIGHUP: `generate` stops at the next token,
//! prints its summary marked interrupted and exits with 128 + the signal's number (SIGINT 130,
//! SIGTERM 143, SIGHUP 129), as every Kiln program does; `bench` stops with the same statuses;
//! `chat` waiting for input ends at once. Every test runs the real
//! binary and kills it (SIGKILL) past a deadline, so none can hang.

/// The runner's test helpers (fixtures, reference dumps, metrics), shared rather than copied.
#[path = "../../runner/tests/common/mod.rs"]
mod common;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;

/// Longest wait for the program to reach the state a test signals it in (conversion of the
/// fixture and the checksum pass included, on a loaded CI machine).
const START_DEADLINE: Duration = Duration::from_secs(60);

/// Longest wait for the program to exit after the signal: it must react at the next token,
/// and its own watcher ends it 2 s after the signal whatever it is doing.
const EXIT_DEADLINE: Duration = Duration::from_secs(10);

/// Longest a chat waiting for input may take to exit after a signal: well under the watcher's
/// 2 s grace, which it must not wait out.
const CHAT_EXIT: Duration = Duration::from_millis(1500);

/// Each signal and the exit status it must give.
const SIGNALS: [(&str, i32); 3] = [("TERM", 143), ("INT", 130), ("HUP", 129)];

/// The tiny fixture with a context of 2^18 positions, so that a generation with
/// `--ignore-eos` lasts minutes (each token attends to all before it) instead of ending at the
/// fixture's 256 positions in milliseconds.
fn long_context_tiny(dir: &Path) -> PathBuf {
    let src = root().join("fixtures/tiny/llama-tied-f32");
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
    convert(&copy, dir, None)
}

/// A running `kiln-run`, its stdout and stderr collected by threads.
struct Running {
    child: Child,
    stdout: Arc<Mutex<Vec<u8>>>,
    stderr: Arc<Mutex<Vec<u8>>>,
}

fn collect(mut from: impl Read + Send + 'static) -> Arc<Mutex<Vec<u8>>> {
    let buf = Arc::new(Mutex::new(Vec::new()));
    let to = Arc::clone(&buf);
    std::thread::spawn(move || {
        let mut chunk = [0u8; 4096];
        while let Ok(n @ 1..) = from.read(&mut chunk) {
            to.lock().unwrap().extend_from_slice(&chunk[..n]);
        }
    });
    buf
}

impl Running {
    /// Start `kiln-run args`; stdin is a pipe kept open (and never written) when `stdin_open`.
    fn start(args: &[&str], stdin_open: bool) -> Running {
        let mut child = Command::new(env!("CARGO_BIN_EXE_kiln-run"))
            .args(args)
            .stdin(if stdin_open {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start kiln-run");
        let stdout = collect(child.stdout.take().unwrap());
        let stderr = collect(child.stderr.take().unwrap());
        Running {
            child,
            stdout,
            stderr,
        }
    }

    fn text(buf: &Arc<Mutex<Vec<u8>>>) -> String {
        String::from_utf8_lossy(&buf.lock().unwrap()).into_owned()
    }

    /// Wait until `ready` holds of (stdout, stderr); kill the program and fail past the
    /// deadline or if it exits first.
    fn wait_until(&mut self, what: &str, ready: impl Fn(&[u8], &str) -> bool) {
        let start = Instant::now();
        loop {
            if ready(&self.stdout.lock().unwrap(), &Running::text(&self.stderr)) {
                return;
            }
            if let Some(status) = self.child.try_wait().unwrap() {
                panic!(
                    "kiln-run exited ({status}) before {what}: {}",
                    Running::text(&self.stderr)
                );
            }
            if start.elapsed() > START_DEADLINE {
                let _ = self.child.kill();
                let _ = self.child.wait();
                panic!(
                    "kiln-run never reached {what}: {}",
                    Running::text(&self.stderr)
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Send `signal` (a name for `kill -s`), then wait for the exit: its status code and how
    /// long it took. Past [`EXIT_DEADLINE`] the program is killed and the test fails.
    fn signal_and_wait(&mut self, signal: &str) -> (Option<i32>, Duration) {
        let status = Command::new("kill")
            .args(["-s", signal, &self.child.id().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -s {signal} failed");
        let sent = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                // Let the reader threads drain the pipes.
                std::thread::sleep(Duration::from_millis(50));
                return (status.code(), sent.elapsed());
            }
            if sent.elapsed() > EXIT_DEADLINE {
                let _ = self.child.kill();
                let _ = self.child.wait();
                panic!(
                    "kiln-run still running {EXIT_DEADLINE:?} after SIG{signal}: {}",
                    Running::text(&self.stderr)
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

#[test]
fn generate_stops_at_the_next_token_prints_its_summary_and_exits_with_the_signal_status() {
    let tmp = tempfile::tempdir().unwrap();
    let m = long_context_tiny(tmp.path());
    for (signal, code) in SIGNALS {
        let mut run = Running::start(
            &[
                "generate",
                m.to_str().unwrap(),
                "-p",
                "Once upon a time",
                "-n",
                "1000000",
                "--ignore-eos",
                "--ctx",
                "262144",
                "-t",
                "1",
            ],
            false,
        );
        run.wait_until("the first generated text", |out, _| !out.is_empty());
        let (status, _) = run.signal_and_wait(signal);
        let err = Running::text(&run.stderr);
        assert_eq!(status, Some(code), "SIG{signal}: {err}");
        assert!(
            err.contains("| stop: interrupted]"),
            "SIG{signal}: no interrupted summary in {err}"
        );
        assert!(
            err.contains(&format!("interrupted by SIG{signal}")),
            "SIG{signal}: {err}"
        );
        // The summary is the generation loop's doing: the watcher exits without one.
    }
}

#[test]
fn generate_json_reports_the_interrupted_stop_reason() {
    let tmp = tempfile::tempdir().unwrap();
    let m = long_context_tiny(tmp.path());
    let mut run = Running::start(
        &[
            "generate",
            m.to_str().unwrap(),
            "-p",
            "Once upon a time",
            "-n",
            "1000000",
            "--ignore-eos",
            "--ctx",
            "262144",
            "-t",
            "1",
            "--json",
        ],
        false,
    );
    // Nothing is printed before the JSON: give it time to load and start generating.
    std::thread::sleep(Duration::from_millis(1500));
    let (status, _) = run.signal_and_wait("TERM");
    assert_eq!(status, Some(143), "{}", Running::text(&run.stderr));
    let out = run.stdout.lock().unwrap().clone();
    let v: serde_json::Value = serde_json::from_slice(&out)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out)));
    assert_eq!(v["stop"], "interrupted", "{v}");
    assert!(v["generated_tokens"].is_u64(), "{v}");
}

#[test]
fn chat_waiting_for_input_ends_at_once_with_the_signal_status() {
    let tmp = tempfile::tempdir().unwrap();
    let m = long_context_tiny(tmp.path());
    for (signal, code) in SIGNALS {
        let mut run = Running::start(&["chat", m.to_str().unwrap(), "-t", "1"], true);
        run.wait_until("the chat prompt", |_, err| err.contains("> "));
        let (status, took) = run.signal_and_wait(signal);
        assert_eq!(
            status,
            Some(code),
            "SIG{signal}: {}",
            Running::text(&run.stderr)
        );
        assert!(
            took < CHAT_EXIT,
            "SIG{signal}: {took:?} to end a chat waiting for input"
        );
    }
}

#[test]
fn bench_stops_with_the_signal_status() {
    let tmp = tempfile::tempdir().unwrap();
    let m = long_context_tiny(tmp.path());
    for (signal, code) in SIGNALS {
        let mut run = Running::start(
            &[
                "bench",
                m.to_str().unwrap(),
                "-p",
                "4096",
                "-n",
                "4096",
                "-r",
                "1000",
                "-t",
                "1",
            ],
            false,
        );
        std::thread::sleep(Duration::from_millis(500));
        let (status, _) = run.signal_and_wait(signal);
        let out = Running::text(&run.stdout);
        assert_eq!(
            status,
            Some(code),
            "SIG{signal}: {}",
            Running::text(&run.stderr)
        );
        // The table of the tests measured so far (none here) is still printed.
        assert!(out.starts_with("| model |"), "SIG{signal}: {out}");
    }
}
