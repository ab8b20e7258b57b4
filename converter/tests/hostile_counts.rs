//! Counts read from a file that size allocations: a model file claiming far more layers than
//! it holds is refused by every program in bounded memory, naming the file and the field,
//! with exit status 2. Each case runs the real `kiln-convert` as a child whose address space is
//! capped ([`MEMORY_LIMIT_KIB`]): an allocation sized by the claim would abort it (134) or get
//! it killed, never exit 2.

mod common;

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{convert, repo, with_metadata};
use kiln_convert::gguf::{export_gguf, parse, read, ExportOptions, GgufBuilder, Value};
use kiln_convert::NoProgress;

/// Address space the child may use: ample for the tiny fixtures (the real runs need tens of
/// MB), a small fraction of what listing 2^24 layers' tensors took (over 5 GB).
const MEMORY_LIMIT_KIB: u64 = 1 << 20;

/// Longest a refusal may take: each is a few milliseconds, so reaching this means a hang.
const DEADLINE: Duration = Duration::from_secs(60);

/// 2^24: the largest layer count a configuration field may hold.
const HOSTILE_LAYERS: u64 = 1 << 24;

/// `kiln-convert ARGS` under the address-space limit, killed at [`DEADLINE`].
fn limited(args: &[&std::ffi::OsStr]) -> Output {
    let mut child = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "ulimit -v {MEMORY_LIMIT_KIB} && exec \"$0\" \"$@\""
        ))
        .arg(env!("CARGO_BIN_EXE_kiln-convert"))
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > DEADLINE {
            let _ = child.kill();
            panic!("kiln-convert {args:?} did not finish in {DEADLINE:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

/// Expect exit status 2 and every needle in the message; returns the message.
#[track_caller]
fn expect_refusal(r: &Output, needles: &[&str]) -> String {
    let err = String::from_utf8_lossy(&r.stderr).into_owned();
    assert_eq!(r.status.code(), Some(2), "{err}");
    for n in needles {
        assert!(err.contains(n), "{n:?} not in {err:?}");
    }
    err
}

/// Regression: a 5 MB-class `.kiln` whose metadata claims 2^24 layers (header checksum
/// recomputed) was accepted by `inspect` and drove programs that list the implied tensors
/// past 5 GB. It is refused at open, naming `num_layers` and both counts.
#[test]
fn inspect_refuses_a_kiln_file_claiming_more_layers_than_any_file_holds() {
    let tmp = tempfile::tempdir().unwrap();
    let good = tmp.path().join("good.kiln");
    convert(&repo().join("fixtures/tiny/llama-tied-f32"), &good);
    let bytes = with_metadata(&std::fs::read(&good).unwrap(), |m| {
        m["config"]["num_layers"] = HOSTILE_LAYERS.into();
    });
    let bad = tmp.path().join("bad.kiln");
    std::fs::write(&bad, bytes).unwrap();
    let r = limited(&["inspect".as_ref(), bad.as_os_str()]);
    expect_refusal(
        &r,
        &["bad.kiln", "config.num_layers", "16777216", "1048576"],
    );
    let r = limited(&[
        "export-gguf".as_ref(),
        bad.as_os_str(),
        "-o".as_ref(),
        tmp.path().join("x.gguf").as_os_str(),
    ]);
    expect_refusal(&r, &["bad.kiln", "config.num_layers"]);
    assert!(!tmp.path().join("x.gguf").exists());
}

/// Regression: `num_hidden_layers: 16777216` in config.json aborted conversion (exit 134)
/// after allocating the tensor list.
#[test]
fn hf_conversion_refuses_a_hostile_layer_count_in_bounded_memory() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("model");
    std::fs::create_dir(&dir).unwrap();
    for e in std::fs::read_dir(repo().join("fixtures/tiny/llama-tied-f32")).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, dir.join(p.file_name().unwrap())).unwrap();
    }
    let cfg = dir.join("config.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg).unwrap()).unwrap();
    v["num_hidden_layers"] = HOSTILE_LAYERS.into();
    std::fs::write(&cfg, v.to_string()).unwrap();
    let out = tmp.path().join("m.kiln");
    let r = limited(&[
        "hf".as_ref(),
        dir.as_os_str(),
        "-o".as_ref(),
        out.as_os_str(),
    ]);
    expect_refusal(&r, &["config.json", "num_hidden_layers", "16777216"]);
    assert!(!out.exists());
}

/// `src` (a GGUF file) rewritten with `edit` applied to its metadata, tensors unchanged.
fn edited_gguf(src: &Path, dst: &Path, edit: impl FnOnce(&mut Vec<(String, Value)>)) {
    let bytes = std::fs::read(src).unwrap();
    let h = parse("src.gguf", &bytes).unwrap();
    let mut meta = h.metadata.clone();
    edit(&mut meta);
    let mut b = GgufBuilder::new();
    for (k, v) in meta {
        b.set(&k, v);
    }
    for t in &h.tensors {
        b.add_tensor(&t.name, t.dims.clone(), t.ggml_type).unwrap();
    }
    b.write(dst, false, |i| {
        Ok(read::tensor_bytes(&bytes, &h.tensors[i]).to_vec().into())
    })
    .unwrap();
}

/// A GGUF file exported from the tiny Llama fixture, at `dir/llama.gguf`.
fn llama_gguf(dir: &Path) -> std::path::PathBuf {
    let kiln = dir.join("llama.kiln");
    convert(&repo().join("fixtures/tiny/llama-tied-f32"), &kiln);
    let gguf = dir.join("llama.gguf");
    export_gguf(
        &ExportOptions {
            input: kiln,
            output: gguf.clone(),
            overwrite: false,
        },
        &NoProgress,
    )
    .unwrap();
    gguf
}

/// Regression: a small GGUF whose `block_count` is 2^24 made import list every implied
/// tensor before matching any, past 5 GB until the allocator aborted.
#[test]
fn gguf_import_refuses_a_hostile_block_count_in_bounded_memory() {
    let tmp = tempfile::tempdir().unwrap();
    let src = llama_gguf(tmp.path());
    let bad = tmp.path().join("bad.gguf");
    edited_gguf(&src, &bad, |m| {
        for (k, v) in m.iter_mut() {
            if k == "llama.block_count" {
                *v = Value::U32(HOSTILE_LAYERS as u32);
            }
        }
    });
    let out = tmp.path().join("m.kiln");
    let r = limited(&[
        "gguf".as_ref(),
        bad.as_os_str(),
        "-o".as_ref(),
        out.as_os_str(),
    ]);
    expect_refusal(
        &r,
        &["bad.gguf", "llama.block_count", "16777216", "declares 20"],
    );
    assert!(!out.exists());
}

/// A FIFO (nobody writes to it) or a device named as the GGUF input is refused at once,
/// naming it, instead of blocking or reading forever.
#[cfg(target_os = "linux")]
#[test]
fn a_fifo_or_a_device_as_the_gguf_input_is_refused_without_blocking() {
    let tmp = tempfile::tempdir().unwrap();
    let fifo = tmp.path().join("model.gguf");
    assert!(Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap()
        .success());
    let out = tmp.path().join("m.kiln");
    let r = limited(&[
        "gguf".as_ref(),
        fifo.as_os_str(),
        "-o".as_ref(),
        out.as_os_str(),
    ]);
    expect_refusal(&r, &["model.gguf", "FIFO"]);
    let r = limited(&[
        "gguf".as_ref(),
        "/dev/zero".as_ref(),
        "-o".as_ref(),
        out.as_os_str(),
    ]);
    expect_refusal(&r, &["/dev/zero", "a device"]);
    assert!(!out.exists());
}
