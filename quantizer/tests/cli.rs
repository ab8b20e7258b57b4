//! The `kiln-quantize` binary: exit status, messages on stderr, report on stdout, and no output
//! file left behind on failure.

mod common;

use std::path::Path;
use std::process::{Command, Output};

use kiln_format::{DType, KilnFile};

fn kq(args: &[&str], dir: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kiln-quantize"))
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn success_prints_a_table_and_writes_the_file() {
    let dir = tempfile::tempdir().unwrap();
    common::write_model(&dir.path().join("in.kiln"), DType::BF16, |_, _| {});
    let o = kq(
        &[
            "in.kiln",
            "out.kiln",
            "--to",
            "q4_0",
            "--threads",
            "2",
            "-q",
        ],
        dir.path(),
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let table = String::from_utf8(o.stdout).unwrap();
    assert!(table.contains("layers.1.mlp.down.weight"), "{table}");
    assert!(table.contains("falls back to f16"), "{table}");
    assert!(table.contains("bits per weight"), "{table}");
    KilnFile::open(dir.path().join("out.kiln"))
        .unwrap()
        .verify()
        .unwrap();
}

#[test]
fn json_report_parses_and_has_every_tensor() {
    let dir = tempfile::tempdir().unwrap();
    common::write_model(&dir.path().join("in.kiln"), DType::F32, |_, _| {});
    let o = kq(
        &[
            "in.kiln",
            "out.kiln",
            "--to",
            "q8_0",
            "--keep",
            "lm_head.weight=f16",
            "--json",
        ],
        dir.path(),
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(
        v["tensors"].as_array().unwrap().len(),
        common::shapes().len()
    );
    assert_eq!(v["to"], "q8_0");
    assert_eq!(v["tensors"][0]["name"], "embed.weight");
    assert_eq!(v["tensors"][0]["to"], "f16");
    assert!(v["tensors"][1]["snr_db"].is_null(), "f32 -> f32 is exact");
    assert_eq!(v["tensors"][3]["name"], "layers.0.attn.q.weight");
    assert!(v["tensors"][3]["snr_db"].as_f64().unwrap() > 30.0);
    assert!(v["bits_per_weight_out"].as_f64().unwrap() < 32.0);
}

/// Every failure: non-zero exit, one clear line on stderr, nothing written.
#[test]
fn bad_inputs_fail_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    common::write_model(&dir.path().join("in.kiln"), DType::F32, |name, v| {
        if name == "layers.0.attn.k.weight" {
            v[70] = f32::INFINITY;
        }
    });
    std::fs::write(
        dir.path().join("junk.kiln"),
        b"not a kiln file at all, just text",
    )
    .unwrap();
    let cases: &[(&[&str], &str)] = &[
        (
            &["in.kiln", "out.kiln", "--to", "q8_0"],
            "tensor `layers.0.attn.k.weight`: non-finite value inf at element 70 (row 1, column 6)",
        ),
        (
            &["missing.kiln", "out.kiln", "--to", "q8_0"],
            "missing.kiln: cannot open",
        ),
        (
            &["junk.kiln", "out.kiln", "--to", "q8_0"],
            "not a .kiln file",
        ),
        (
            &["in.kiln", "in.kiln", "--to", "q8_0", "--force"],
            "the output is also an input",
        ),
        (&["in.kiln", "out.kiln", "--to", "q3_k_xl"], "--to q3_k_xl"),
        (&["in.kiln", "out.kiln", "--to", "iq2_xs"], "--to iq2_xs"),
        (
            &[
                "in.kiln", "out.kiln", "--to", "q4_k_m", "--method", "search",
            ],
            "reference rule, or its importance-weighted rule",
        ),
        (
            &[
                "in.kiln", "out.kiln", "--to", "q8_0", "--method", "search", "--keep", "*=q6_k",
            ],
            "q6_k blocks are made by GGML's reference rule",
        ),
        (&["in.kiln", "out.kiln", "--to", "bf16"], "--to bf16"),
        (
            &[
                "in.kiln",
                "out.kiln",
                "--to",
                "q8_0",
                "--keep",
                "embed.weight",
            ],
            "PATTERN=DTYPE",
        ),
        (
            &[
                "in.kiln",
                "out.kiln",
                "--to",
                "q8_0",
                "--keep",
                "nope.*=f16",
            ],
            "matches no tensor",
        ),
        (
            &["in.kiln", "out.kiln", "--to", "q8_0", "--method", "magic"],
            "reference` or `search",
        ),
    ];
    for (args, want) in cases {
        let o = kq(args, dir.path());
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr(&o));
        let err = stderr(&o);
        assert!(err.contains(want), "{args:?}: {err}");
        assert!(err.starts_with("kiln-quantize: error: "), "{err}");
        assert_eq!(err.trim_end().lines().count(), 1, "one line: {err}");
        assert_eq!(
            common::files_in(dir.path()),
            ["in.kiln", "junk.kiln"],
            "{args:?}"
        );
    }
}

#[test]
fn existing_output_needs_force() {
    let dir = tempfile::tempdir().unwrap();
    common::write_model(&dir.path().join("in.kiln"), DType::BF16, |_, _| {});
    std::fs::write(dir.path().join("out.kiln"), b"old").unwrap();
    let o = kq(&["in.kiln", "out.kiln", "--to", "f16", "-q"], dir.path());
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("pass --force"), "{}", stderr(&o));
    assert_eq!(std::fs::read(dir.path().join("out.kiln")).unwrap(), b"old");
    let o = kq(
        &["in.kiln", "out.kiln", "--to", "f16", "-q", "--force"],
        dir.path(),
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let out = KilnFile::open(dir.path().join("out.kiln")).unwrap();
    assert_eq!(
        out.info("layers.0.attn.q.weight").unwrap().dtype,
        DType::F16
    );
    assert_eq!(
        out.info("layers.0.attn_norm.weight").unwrap().dtype,
        DType::F32
    );
}

#[test]
fn usage_errors_exit_2() {
    let dir = tempfile::tempdir().unwrap();
    let o = kq(&["in.kiln"], dir.path());
    assert_eq!(o.status.code(), Some(2));
    let o = kq(&["a", "b", "--to", "q8_0", "--threads", "0"], dir.path());
    assert_eq!(o.status.code(), Some(2));
}

#[test]
fn calibration_flags_are_checked() {
    let dir = tempfile::tempdir().unwrap();
    common::write_model(&dir.path().join("in.kiln"), DType::BF16, |_, _| {});
    let base = ["in.kiln", "out.kiln", "--to", "q4_0", "-q"];
    let with = |extra: &[&str]| {
        let mut a: Vec<&str> = base.to_vec();
        a.extend_from_slice(extra);
        kq(&a, dir.path())
    };
    // gptq needs calibration.
    let o = with(&["--method", "gptq"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("needs calibration"), "{}", stderr(&o));
    // The reference method ignores importance: refused rather than silently unweighted.
    std::fs::write(dir.path().join("text.txt"), "some text ".repeat(100)).unwrap();
    let o = with(&["--calibrate", "text.txt", "--method", "reference"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("ignores importance"), "{}", stderr(&o));
    // --save-importance only with --calibrate; --calibrate and --importance exclude each other.
    assert!(!with(&["--save-importance", "imp.safetensors"])
        .status
        .success());
    let o = with(&["--calibrate", "text.txt", "--importance", "imp.safetensors"]);
    assert!(!o.status.success());
    // Non-UTF-8 text names the file.
    std::fs::write(dir.path().join("bin.txt"), [0x66u8, 0x6f, 0xff, 0xfe]).unwrap();
    let o = with(&["--calibrate", "bin.txt"]);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("bin.txt") && stderr(&o).contains("not UTF-8"),
        "{}",
        stderr(&o)
    );
    // A missing importance file names the file.
    let o = with(&["--importance", "nope.safetensors"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("nope.safetensors"), "{}", stderr(&o));
    assert!(!dir.path().join("out.kiln").exists());
}

#[test]
fn size_budget_flags_are_checked() {
    let dir = tempfile::tempdir().unwrap();
    common::write_model(&dir.path().join("in.kiln"), DType::BF16, |_, _| {});
    std::fs::write(dir.path().join("text.txt"), "some text ".repeat(100)).unwrap();
    let run = |args: &[&str]| {
        let mut a = vec!["in.kiln", "out.kiln", "-q"];
        a.extend_from_slice(args);
        kq(&a, dir.path())
    };
    let refused = |args: &[&str], wants: &[&str]| {
        let o = run(args);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr(&o));
        for w in wants {
            assert!(stderr(&o).contains(w), "{args:?}: {}", stderr(&o));
        }
    };
    // auto needs a size and calibration; a size needs auto.
    refused(
        &["--to", "auto", "--calibrate", "text.txt"],
        &["--bpw", "--max-bytes"],
    );
    refused(&["--to", "auto", "--bpw", "4.5"], &["calibrat"]);
    refused(&["--to", "q4_0", "--bpw", "4.5"], &["--bpw", "--to auto"]);
    refused(&["--to", "q4_0", "--max-bytes", "1000"], &["--max-bytes"]);
    refused(
        &["--to", "auto", "--bpw", "0", "--calibrate", "text.txt"],
        &["'0' for '--bpw <B>'", "above 0 and at most 32"],
    );
    refused(
        &["--to", "auto", "--bpw", "nan", "--calibrate", "text.txt"],
        &["--bpw"],
    );
    refused(
        &[
            "--to",
            "auto",
            "--bpw",
            "4",
            "--max-bytes",
            "9",
            "--calibrate",
            "text.txt",
        ],
        &["--max-bytes"],
    );
    assert!(!dir.path().join("out.kiln").exists());
}
