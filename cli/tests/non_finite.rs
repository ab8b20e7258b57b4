//! A model whose checksums are valid but whose values are not finite (a NaN weight, a NaN
//! block scale) is refused before the first token by `kiln-run` (exit status 2, naming the
//! tensor) and by GGUF export (no output file), unless `--no-verify` skips the check.

/// The runner's test helpers (fixtures, reference dumps, metrics), shared rather than copied.
#[path = "../../runner/tests/common/mod.rs"]
mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::*;
use kiln_convert::gguf::{export_gguf, ExportOptions};
use kiln_convert::ConvertError;
use kiln_format::blocks::quantize_row_q4_0_ref;
use kiln_format::reader::CHECK_CHUNK;
use kiln_format::{DType, FormatError, KilnFile, KilnWriter, TensorSpec, QK};

/// Bad input, as every Kiln program reports it.
const BAD_INPUT: i32 = 2;

/// One way to put a non-finite value into a tensor.
struct Case {
    /// What the case is, for failure messages.
    what: &'static str,
    /// The tensor that holds it.
    tensor: &'static str,
    /// Its dtype in the crafted file.
    dtype: DType,
    /// Values counted as non-finite, and the first one's element index.
    count: usize,
    first: usize,
}

const CASES: [Case; 2] = [
    Case {
        what: "a NaN f32 weight",
        tensor: "layers.0.mlp.down.weight",
        dtype: DType::F32,
        count: 1,
        first: 5,
    },
    Case {
        what: "a NaN f16 scale in a Q4_0 block",
        tensor: "layers.1.attn.q.weight",
        dtype: DType::Q4_0,
        count: QK,
        first: 3 * QK,
    },
];

/// The tiny fixture rewritten through [`KilnWriter`] (so every checksum matches) with `case`'s
/// tensor holding a non-finite value.
fn crafted(dir: &Path, case: &Case) -> PathBuf {
    let src = convert(&root().join("fixtures/tiny/llama-tied-f32"), dir, None);
    let f = KilnFile::open(&src).unwrap();
    let dst = dir.join(format!("{}-{}.kiln", case.tensor, case.dtype));
    let mut specs = Vec::new();
    let mut data = Vec::new();
    for t in f.tensors() {
        let mut bytes = f.view(t).bytes().to_vec();
        let mut dtype = t.dtype;
        if t.name == case.tensor {
            dtype = case.dtype;
            match case.dtype {
                DType::F32 => {
                    let at = case.first * 4;
                    bytes[at..at + 4].copy_from_slice(&f32::NAN.to_le_bytes());
                }
                DType::Q4_0 => {
                    let x = f.view(t).to_f32_vec();
                    let blocks = quantize_row_q4_0_ref(&x).unwrap();
                    bytes = bytemuck::cast_slice(&blocks).to_vec();
                    let at = case.first / QK * DType::Q4_0.block_bytes();
                    bytes[at..at + 2].copy_from_slice(&half::f16::NAN.to_le_bytes());
                }
                d => panic!("no crafting for {d}"),
            }
        }
        specs.push(TensorSpec {
            name: t.name.clone(),
            dtype,
            shape: t.shape.clone(),
        });
        data.push(bytes);
    }
    let w = KilnWriter::create(&dst, f.metadata(), specs, true).unwrap();
    for (i, b) in data.iter().enumerate() {
        w.write_tensor(i, b).unwrap();
    }
    w.finish().unwrap();
    dst
}

fn kiln_run(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kiln-run"))
        .args(args)
        .output()
        .expect("run kiln-run")
}

#[test]
fn the_crafted_files_have_valid_checksums_and_the_non_finite_values_they_were_given() {
    let tmp = tempfile::tempdir().unwrap();
    for case in &CASES {
        let f = KilnFile::open(crafted(tmp.path(), case)).unwrap();
        assert!(f.verify_checksums(&|_| {}).is_empty(), "{}", case.what);
        let found = f.non_finite();
        assert_eq!(found.len(), 1, "{}: {found:?}", case.what);
        assert_eq!(
            (found[0].tensor.as_str(), found[0].count, found[0].first),
            (case.tensor, case.count, case.first),
            "{}",
            case.what
        );
        // The one-pass check finds the same, and nothing else.
        let (failures, one_pass) = f.check_tensors(&|_| {});
        assert!(failures.is_empty(), "{}", case.what);
        assert_eq!(one_pass, found, "{}", case.what);
    }
}

/// Where a block type keeps the f16 scale that makes a whole block non-finite.
fn scale_offset(d: DType) -> usize {
    match d {
        DType::Q6_K => 208,
        _ => 0,
    }
}

#[test]
fn the_one_pass_check_counts_across_chunk_boundaries_as_a_whole_tensor_scan_does() {
    let tmp = tempfile::tempdir().unwrap();
    let src = convert(
        &root().join("fixtures/tiny/llama-tied-f32"),
        tmp.path(),
        None,
    );
    let meta = KilnFile::open(&src).unwrap().metadata().clone();
    // 512 × 4096: several chunks of every dtype, whole blocks and sixteen-row groups.
    let shape = vec![512u64, 4096];
    let dtypes = [
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::Q8_0,
        DType::Q4_0,
        DType::Q4_0x16,
        DType::Q5_0,
        DType::Q5_1,
        DType::Q4_K,
        DType::Q5_K,
        DType::Q6_K,
    ];
    let mut specs = Vec::new();
    let mut data = Vec::new();
    for d in dtypes {
        let units = 512 * 4096 / d.block_len();
        let bb = d.block_bytes();
        let mut bytes = vec![0u8; units * bb];
        assert!(bytes.len() > 2 * CHECK_CHUNK, "{d}: {} bytes", bytes.len());
        // Two bad units past the first chunk, the second in the last.
        for unit in [units * 7 / 10, units - 1] {
            let at = unit * bb;
            match d {
                DType::F32 => bytes[at..at + 4].copy_from_slice(&f32::NAN.to_le_bytes()),
                DType::F16 => bytes[at..at + 2].copy_from_slice(&half::f16::INFINITY.to_le_bytes()),
                DType::BF16 => bytes[at..at + 2].copy_from_slice(&half::bf16::NAN.to_le_bytes()),
                _ => {
                    let at = at + scale_offset(d);
                    bytes[at..at + 2].copy_from_slice(&half::f16::NAN.to_le_bytes());
                }
            }
        }
        specs.push(TensorSpec {
            name: format!("scan.{d}"),
            dtype: d,
            shape: shape.clone(),
        });
        data.push(bytes);
    }
    let path = tmp.path().join("scan.kiln");
    let w = KilnWriter::create(&path, &meta, specs, true).unwrap();
    for (i, b) in data.iter().enumerate() {
        w.write_tensor(i, b).unwrap();
    }
    w.finish().unwrap();
    let f = KilnFile::open(&path).unwrap();
    let whole = f.non_finite();
    assert_eq!(whole.len(), dtypes.len(), "{whole:?}");
    // Two bad units each: a Q4_0x16 unit is sixteen rows' blocks, one of whose scales is bad.
    let mut want: Vec<(String, usize)> = dtypes
        .iter()
        .map(|&d| {
            let values = if d == DType::Q4_0x16 {
                QK
            } else {
                d.block_len()
            };
            (format!("scan.{d}"), 2 * values)
        })
        .collect();
    want.sort();
    let got: Vec<(String, usize)> = whole.iter().map(|n| (n.tensor.clone(), n.count)).collect();
    assert_eq!(got, want);
    let (failures, one_pass) = f.check_tensors(&|_| {});
    assert!(failures.is_empty(), "{failures:?}");
    assert_eq!(one_pass, whole);
    assert!(matches!(
        f.verify_data(),
        Err(FormatError::TensorNonFinite { tensor, .. }) if tensor == "scan.bf16"
    ));
}

#[test]
fn kiln_run_refuses_non_finite_values_naming_the_tensor_unless_verification_is_skipped() {
    let tmp = tempfile::tempdir().unwrap();
    for case in &CASES {
        let m = crafted(tmp.path(), case);
        let path = m.to_str().unwrap();
        for cmd in [
            &["generate", path, "-p", "hi", "-n", "2"][..],
            &["bench", path, "-p", "4", "-n", "2", "-r", "1"][..],
        ] {
            let o = kiln_run(cmd);
            let err = String::from_utf8_lossy(&o.stderr);
            assert_eq!(o.status.code(), Some(BAD_INPUT), "{}: {err}", case.what);
            for needle in [
                path,
                &format!("tensor `{}`", case.tensor),
                &format!("{} value(s) are NaN or infinite", case.count),
                &format!("the first at element {}", case.first),
                "NaN/Inf",
                "kiln-verify integrity",
            ] {
                assert!(
                    err.contains(needle),
                    "{}: {needle:?} not in {err}",
                    case.what
                );
            }
            assert!(o.stdout.is_empty(), "{}", case.what);
        }
        let o = kiln_run(&["generate", path, "-p", "hi", "-n", "2", "--no-verify"]);
        assert_eq!(
            o.status.code(),
            Some(0),
            "{}: --no-verify skips the values too: {}",
            case.what,
            String::from_utf8_lossy(&o.stderr)
        );
    }
}

#[test]
fn gguf_export_refuses_non_finite_values_and_writes_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    for case in &CASES {
        let m = crafted(tmp.path(), case);
        let out = tmp.path().join("out.gguf");
        let e = export_gguf(
            &ExportOptions {
                input: m.clone(),
                output: out.clone(),
                overwrite: false,
            },
            &kiln_convert::NoProgress,
        )
        .unwrap_err();
        match &e {
            ConvertError::Format(FormatError::TensorNonFinite {
                file,
                tensor,
                count,
                first,
            }) => {
                assert_eq!(file, m.to_str().unwrap(), "{}", case.what);
                assert_eq!(
                    (tensor.as_str(), *count, *first),
                    (case.tensor, case.count, case.first),
                    "{}",
                    case.what
                );
            }
            other => panic!("{}: expected a non-finite error, got {other}", case.what),
        }
        assert!(
            !out.exists(),
            "{}: {} was written",
            case.what,
            out.display()
        );
        let leftovers: Vec<_> = std::fs::read_dir(tmp.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.contains("out.gguf"))
            .collect();
        assert!(leftovers.is_empty(), "{}: {leftovers:?}", case.what);
    }
}
