//! `kiln-quantize` stopped by a signal while it writes its output: the temporary file is
//! removed, the stderr names the signal, and the exit status is 128 + the signal's number
//! (SIGTERM 143, SIGINT 130), the rule every Kiln program follows.
//!
//! The run is caught mid-write deterministically: once the temporary output appears, the
//! process is stopped (SIGSTOP), the signal is queued, and the process is let go on (SIGCONT).

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{files_in, metadata, shapes, values, HIDDEN};
use kiln_format::{DType, KilnWriter, TensorSpec};

/// Longest wait for the temporary output to appear, and for the exit after the signal.
const DEADLINE: Duration = Duration::from_secs(60);

/// Rows of the widened embedding: 2^19 × 64 weights, so that quantizing takes long enough to
/// be caught (a tenth of a second or more).
const WIDE_VOCAB: u64 = 1 << 19;

/// The common tiny model with a `vocab`-row embedding (zeros; the other tensors as usual).
fn write_wide_model(path: &Path, vocab: u64) {
    let mut meta = metadata();
    meta.config.vocab_size = vocab;
    let specs: Vec<TensorSpec> = shapes()
        .into_iter()
        .map(|(name, shape)| {
            let shape = if name == "embed.weight" {
                vec![vocab, HIDDEN]
            } else {
                shape
            };
            let dtype = if shape.len() == 1 {
                DType::F32
            } else {
                DType::BF16
            };
            TensorSpec { name, dtype, shape }
        })
        .collect();
    let w = KilnWriter::create(path, &meta, specs.clone(), false).unwrap();
    for (i, spec) in specs.iter().enumerate() {
        let n = spec.shape.iter().product::<u64>() as usize;
        let bytes = match (spec.name.as_str(), spec.dtype) {
            ("embed.weight", _) => vec![0u8; n * 2],
            (_, DType::F32) => bytemuck::cast_slice(&vec![1.0f32; n]).to_vec(),
            _ => values(i as u64 + 1, n)
                .iter()
                .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())
                .collect(),
        };
        w.write_tensor(i, &bytes).unwrap();
    }
    w.finish().unwrap();
}

fn kill(signal: &str, pid: u32) {
    let ok = Command::new("kill")
        .args(["-s", signal, &pid.to_string()])
        .status()
        .expect("run kill");
    assert!(ok.success(), "kill -s {signal} {pid} failed");
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
fn sigterm_and_sigint_remove_the_unfinished_output_and_exit_with_128_plus_the_number() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("in.kiln");
    write_wide_model(&model, WIDE_VOCAB);
    for (signal, code) in [("TERM", 143), ("INT", 130)] {
        let out = tmp.path().join(format!("out-{signal}"));
        std::fs::create_dir(&out).unwrap();
        let (status, err) = interrupt_mid_write(
            Command::new(env!("CARGO_BIN_EXE_kiln-quantize"))
                .arg(&model)
                .arg(out.join("q.kiln"))
                .args(["--to", "q8_0", "--threads", "1", "-q"]),
            &out,
            "q.kiln",
            signal,
        );
        assert_eq!(status, Some(code), "SIG{signal}: {err}");
        assert!(
            err.contains(&format!("kiln-quantize: interrupted by SIG{signal}")),
            "SIG{signal}: {err}"
        );
        assert_eq!(files_in(&out), Vec::<String>::new(), "SIG{signal}");
    }
}
