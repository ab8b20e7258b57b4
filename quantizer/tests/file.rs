//! `quantize_file` on small real `.kiln` files: policy, bit-exact blocks, provenance, report
//! metrics, determinism across thread counts, and every error leaving no output behind.

mod common;

use std::path::Path;

use kiln_format::blocks::{
    dequantize_row_q4_0, interleave_q4_0, quantize_row_q4_0_ref, quantize_row_q8_0_ref, QK,
};
use kiln_format::{DType, FormatError, KilnFile};
use kiln_quantize::importance::{CalibrationInfo, Importance};
use kiln_quantize::{
    quantize_file, Method, NoProgress, Override, Policy, QuantizeError, QuantizeOptions, Report,
};
use sha2::{Digest, Sha256};

fn options(dir: &Path, to: DType, keep: &[&str]) -> QuantizeOptions {
    let overrides = keep.iter().map(|k| Override::parse(k).unwrap()).collect();
    QuantizeOptions::new(
        dir.join("in.kiln"),
        dir.join("out.kiln"),
        Policy::new(to, overrides).unwrap(),
    )
}

fn run(o: &QuantizeOptions) -> Result<Report, QuantizeError> {
    quantize_file(o, &NoProgress)
}

#[test]
fn q4_0_follows_the_policy_and_reproduces_the_reference_blocks() {
    let dir = tempfile::tempdir().unwrap();
    common::write_model(&dir.path().join("in.kiln"), DType::BF16, |_, _| {});
    let report = run(&options(dir.path(), DType::Q4_0, &[])).unwrap();
    let input = KilnFile::open(dir.path().join("in.kiln")).unwrap();
    let out = KilnFile::open(dir.path().join("out.kiln")).unwrap();
    out.verify().unwrap();
    assert_eq!(out.tensors().len(), input.tensors().len());
    for t in input.tensors() {
        let o = out.info(&t.name).unwrap();
        assert_eq!(o.shape, t.shape, "{}", t.name);
        let want = if t.shape.len() == 1 {
            DType::F32
        } else if t.shape[1] % 32 != 0 {
            DType::F16
        } else {
            // Every Q4_0 matrix of this model has whole sixteen-row groups.
            DType::Q4_0x16
        };
        assert_eq!(o.dtype, want, "{}", t.name);
        if want == DType::Q4_0x16 {
            let x = input.view(t).to_f32_vec();
            let blocks = quantize_row_q4_0_ref(&x).unwrap();
            let nb = t.shape[1] as usize / QK;
            assert_eq!(
                out.view(o).bytes(),
                bytemuck::cast_slice::<_, u8>(&interleave_q4_0(&blocks, nb))
            );
            assert!(out.view(o).q4_0_rows().unwrap() == blocks, "{}", t.name);
        }
        let r = report.tensors.iter().find(|r| r.name == t.name).unwrap();
        assert_eq!((r.to, r.stored_as), (want.logical(), want), "{}", t.name);
    }
    assert_eq!(out.version(), (1, 1));
    let down = report
        .tensors
        .iter()
        .find(|t| t.name == "layers.0.mlp.down.weight")
        .unwrap();
    assert_eq!(down.to, DType::F16);
    assert!(down
        .note
        .as_deref()
        .unwrap()
        .contains("not a multiple of 32"));
    // BF16 -> F32 for vectors is exact.
    let norm = report
        .tensors
        .iter()
        .find(|t| t.name == "final_norm.weight")
        .unwrap();
    assert_eq!((norm.rmse, norm.snr_db), (0.0, None));
    assert!(report.bits_per_weight_out < report.bits_per_weight_in);
    assert!(report.file_bytes_out < report.file_bytes_in);
}

/// A Q4_0 matrix of whole sixteen-row groups is stored as q4_0x16 (format 1.1), whatever the
/// chunking: its values are exactly those of the same quantization stored plainly. One that
/// is not (40 rows) is stored as plain Q4_0, and a file without q4_0x16 stays 1.0.
#[test]
fn q4_0_matrices_of_whole_row_groups_are_stored_interleaved() {
    let dir = tempfile::tempdir().unwrap();
    let inp = dir.path().join("in.kiln");
    // 1392 × 96: chunks of 688 rows (682 rounded up to whole groups), 688 and 16.
    let shapes = [
        ("layers.0.mlp.gate.weight", vec![1392u64, 96]),
        ("layers.0.mlp.up.weight", vec![40, 96]),
    ];
    const {
        assert!(
            682 * 96 <= kiln_quantize::CHUNK_ELEMENTS && 683 * 96 > kiln_quantize::CHUNK_ELEMENTS
        )
    };
    let specs = shapes
        .iter()
        .map(|(name, shape)| kiln_format::TensorSpec {
            name: (*name).into(),
            dtype: DType::F32,
            shape: shape.clone(),
        })
        .collect();
    let w = kiln_format::KilnWriter::create(&inp, &common::metadata(), specs, false).unwrap();
    for (i, (_, shape)) in shapes.iter().enumerate() {
        let x = common::values(i as u64 + 3, (shape[0] * shape[1]) as usize);
        w.write_tensor(i, bytemuck::cast_slice(&x)).unwrap();
    }
    w.finish().unwrap();
    for method in [Method::Reference, Method::Search] {
        let mut o = options(dir.path(), DType::Q4_0, &[]);
        o.method = method;
        o.overwrite = true;
        o.threads = Some(3);
        let report = run(&o).unwrap();
        let input = KilnFile::open(&inp).unwrap();
        let out = KilnFile::open(dir.path().join("out.kiln")).unwrap();
        out.verify().unwrap();
        assert_eq!(out.version(), (1, 1));
        for ((name, shape), want) in shapes.iter().zip([DType::Q4_0x16, DType::Q4_0]) {
            let v = out.tensor(name).unwrap();
            assert_eq!(v.dtype(), want, "{name}");
            let r = report.tensors.iter().find(|r| r.name == *name).unwrap();
            assert_eq!((r.to, r.stored_as), (DType::Q4_0, want), "{name}");
            // The plain blocks of the same quantization, row by row.
            let x = input.tensor(name).unwrap().to_f32_vec();
            let cols = shape[1] as usize;
            let mut plain = Vec::new();
            let mut stats = kiln_quantize::ErrorStats::default();
            kiln_quantize::rows::convert_rows(
                &x,
                cols,
                DType::Q4_0,
                method,
                None,
                &mut plain,
                &mut stats,
            )
            .unwrap();
            let blocks: Vec<kiln_format::BlockQ4_0> = bytemuck::pod_collect_to_vec(&plain);
            assert!(v.q4_0_rows().unwrap() == blocks, "{name} {method}");
            let mut want_values = vec![0f32; x.len()];
            dequantize_row_q4_0(&blocks, &mut want_values);
            assert_eq!(v.to_f32_vec(), want_values, "{name} {method}");
            let rmse = stats.rmse();
            assert!((r.rmse - rmse).abs() <= 1e-9 * rmse, "{name} {method}");
            if method == Method::Reference {
                assert!(blocks == quantize_row_q4_0_ref(&x).unwrap(), "{name}");
            }
        }
    }
    // Q8_0 only: no q4_0x16 tensor, so the file stays at format 1.0.
    let mut o = options(dir.path(), DType::Q8_0, &[]);
    o.overwrite = true;
    run(&o).unwrap();
    let out = KilnFile::open(dir.path().join("out.kiln")).unwrap();
    assert_eq!(out.version(), (1, 0));
}

#[test]
fn report_metrics_match_a_recomputation_from_the_output() {
    let dir = tempfile::tempdir().unwrap();
    common::write_model(&dir.path().join("in.kiln"), DType::F32, |_, _| {});
    let report = run(&options(dir.path(), DType::Q8_0, &[])).unwrap();
    let input = KilnFile::open(dir.path().join("in.kiln")).unwrap();
    let out = KilnFile::open(dir.path().join("out.kiln")).unwrap();
    for t in &report.tensors {
        let x = input.tensor(&t.name).unwrap().to_f32_vec();
        let y = out.tensor(&t.name).unwrap().to_f32_vec();
        let (mut se, mut ss, mut max) = (0.0f64, 0.0f64, 0.0f32);
        for (a, b) in x.iter().zip(&y) {
            se += f64::from(a - b).powi(2);
            ss += f64::from(*a).powi(2);
            max = max.max((a - b).abs());
        }
        let rmse = (se / x.len() as f64).sqrt();
        assert!(
            (t.rmse - rmse).abs() <= 1e-6 * rmse.max(1e-12),
            "{}: {} vs {rmse}",
            t.name,
            t.rmse
        );
        assert_eq!(t.max_abs_error, max, "{}", t.name);
        if se > 0.0 {
            let snr = 10.0 * (ss / se).log10();
            assert!((t.snr_db.unwrap() - snr).abs() < 1e-4, "{}", t.name);
        }
        if t.to == DType::Q8_0 {
            let blocks = quantize_row_q8_0_ref(&x).unwrap();
            assert_eq!(
                out.tensor(&t.name).unwrap().bytes(),
                bytemuck::cast_slice::<_, u8>(&blocks)
            );
            // Q8_0 of weight-like data: about 40 dB.
            assert!(t.snr_db.unwrap() > 35.0, "{}: {:?}", t.name, t.snr_db);
        }
    }
}

#[test]
fn provenance_records_the_quantization_and_keeps_history() {
    let dir = tempfile::tempdir().unwrap();
    let inp = dir.path().join("in.kiln");
    common::write_model(&inp, DType::BF16, |_, _| {});
    let mut o = options(dir.path(), DType::Q4_0, &["lm_head.weight=q8_0"]);
    o.method = Method::Search;
    run(&o).unwrap();
    let input = KilnFile::open(&inp).unwrap();
    let out = KilnFile::open(dir.path().join("out.kiln")).unwrap();
    let (mi, mo) = (input.metadata(), out.metadata());
    assert_eq!(mo.config, mi.config);
    assert_eq!(mo.tokenizer, mi.tokenizer);
    assert_eq!(mo.provenance.len(), 2);
    assert_eq!(mo.provenance[0], mi.provenance[0]);
    let step = &mo.provenance[1];
    assert!(step.tool.starts_with("kiln-quantize "));
    let q = &step.details["quantization"];
    assert_eq!(q["to"], "q4_0");
    assert_eq!(q["method"], "search");
    assert_eq!(q["overrides"][0], "lm_head.weight=q8_0");
    assert!(q["policy"].as_str().unwrap().contains("last match wins"));
    // Tied embeddings: embed.weight answers to lm_head.weight.
    assert_eq!(q["per_tensor"]["embed.weight"], "q8_0");
    assert_eq!(q["per_tensor"]["layers.1.attn.q.weight"], "q4_0");
    assert_eq!(q["per_tensor"]["layers.1.mlp_norm.weight"], "f32");
    assert_eq!(mo.quantization(), Some(q));
    let bytes = std::fs::read(&inp).unwrap();
    let src = &step.sources[0];
    assert_eq!(src.name, "in.kiln");
    assert_eq!(src.bytes, bytes.len() as u64);
    assert_eq!(src.sha256, kiln_format::hex(&Sha256::digest(&bytes)));
}

#[test]
fn output_and_metrics_do_not_depend_on_the_thread_count() {
    let dir = tempfile::tempdir().unwrap();
    common::write_model(&dir.path().join("in.kiln"), DType::BF16, |_, _| {});
    let mut reports = Vec::new();
    let mut shas = Vec::new();
    for threads in [1, 3] {
        let mut o = options(dir.path(), DType::Q4_0, &[]);
        o.threads = Some(threads);
        o.overwrite = true;
        o.method = Method::Search;
        let r = run(&o).unwrap();
        let out = KilnFile::open(dir.path().join("out.kiln")).unwrap();
        shas.push(out.tensors().iter().map(|t| t.sha256).collect::<Vec<_>>());
        reports.push(
            r.tensors
                .iter()
                .map(|t| (t.rmse, t.max_abs_error, t.snr_db))
                .collect::<Vec<_>>(),
        );
    }
    assert_eq!(shas[0], shas[1]);
    assert_eq!(reports[0], reports[1]);
}

#[test]
fn search_is_not_worse_than_reference_per_tensor() {
    let dir = tempfile::tempdir().unwrap();
    common::write_model(&dir.path().join("in.kiln"), DType::BF16, |_, _| {});
    let mut errs = Vec::new();
    for m in [Method::Reference, Method::Search] {
        let mut o = options(dir.path(), DType::Q4_0, &[]);
        o.method = m;
        o.overwrite = true;
        errs.push(run(&o).unwrap().tensors);
    }
    for (r, s) in errs[0].iter().zip(&errs[1]) {
        assert!(
            s.rmse <= r.rmse * (1.0 + 1e-6),
            "{}: {} > {}",
            r.name,
            s.rmse,
            r.rmse
        );
    }
}

#[test]
fn importance_weights_are_checked_and_accepted() {
    let dir = tempfile::tempdir().unwrap();
    common::write_model(&dir.path().join("in.kiln"), DType::BF16, |_, _| {});
    let mut o = options(dir.path(), DType::Q4_0, &[]);
    o.method = Method::Search;
    let importance = |len: usize, value: f32| Importance {
        columns: [("layers.0.attn.q.weight".to_string(), vec![value; len])].into(),
        sites: [(
            "layers.0.attn.q.weight".to_string(),
            "model.layers.0.input_layernorm.output".to_string(),
        )]
        .into(),
        moments: Default::default(),
        info: CalibrationInfo {
            model_sha256: String::new(),
            text_sha256: String::new(),
            tokens: 1,
            chunks: 1,
            ctx: 1,
        },
        probe: Vec::new(),
    };
    o.importance = Some(importance(7, 1.0));
    assert!(matches!(
        run(&o),
        Err(QuantizeError::ImportanceLength {
            expected: 64,
            found: 7,
            ..
        })
    ));
    assert_eq!(common::files_in(dir.path()), ["in.kiln"]);
    o.importance = Some(importance(64, 2.0));
    run(&o).unwrap();
}

#[test]
fn nan_is_rejected_with_tensor_and_position_and_no_output() {
    let dir = tempfile::tempdir().unwrap();
    common::write_model(&dir.path().join("in.kiln"), DType::F32, |name, v| {
        if name == "layers.1.attn.v.weight" {
            v[2 * 64 + 5] = f32::NAN;
        }
    });
    let err = run(&options(dir.path(), DType::Q8_0, &[])).unwrap_err();
    match &err {
        QuantizeError::NonFinite {
            tensor,
            position,
            row,
            column,
            ..
        } => {
            assert_eq!(tensor, "layers.1.attn.v.weight");
            assert_eq!((*position, *row, *column), (133, 2, 5));
        }
        other => panic!("expected NonFinite, got {other:?}"),
    }
    assert!(err.to_string().contains("row 2, column 5"), "{err}");
    assert_eq!(common::files_in(dir.path()), ["in.kiln"]);
}

#[test]
fn infinity_in_a_vector_is_rejected_too() {
    let dir = tempfile::tempdir().unwrap();
    common::write_model(&dir.path().join("in.kiln"), DType::F32, |name, v| {
        if name == "final_norm.weight" {
            v[63] = f32::NEG_INFINITY;
        }
    });
    let err = run(&options(dir.path(), DType::F16, &[])).unwrap_err();
    assert!(
        matches!(err, QuantizeError::NonFinite { position: 63, .. }),
        "{err}"
    );
    assert_eq!(common::files_in(dir.path()), ["in.kiln"]);
}

#[test]
fn f16_overflow_is_rejected_and_can_be_overridden() {
    let dir = tempfile::tempdir().unwrap();
    common::write_model(&dir.path().join("in.kiln"), DType::F32, |name, v| {
        if name == "layers.0.attn.o.weight" {
            v[10] = 1.0e5;
        }
    });
    let err = run(&options(dir.path(), DType::F16, &[])).unwrap_err();
    assert!(
        matches!(err, QuantizeError::F16Overflow { position: 10, .. }),
        "{err}"
    );
    assert!(
        err.to_string()
            .contains("--keep 'layers.0.attn.o.weight=bf16'"),
        "{err}"
    );
    assert_eq!(common::files_in(dir.path()), ["in.kiln"]);
    let r = run(&options(
        dir.path(),
        DType::F16,
        &["layers.0.attn.o.weight=bf16"],
    ))
    .unwrap();
    assert_eq!(
        r.tensors
            .iter()
            .find(|t| t.name == "layers.0.attn.o.weight")
            .unwrap()
            .to,
        DType::BF16
    );
}

#[test]
fn corrupt_input_data_is_not_laundered_into_a_valid_file() {
    let dir = tempfile::tempdir().unwrap();
    let inp = dir.path().join("in.kiln");
    common::write_model(&inp, DType::BF16, |_, _| {});
    let info = KilnFile::open(&inp)
        .unwrap()
        .info("layers.0.mlp.up.weight")
        .unwrap()
        .clone();
    let mut bytes = std::fs::read(&inp).unwrap();
    bytes[info.offset as usize + 100] ^= 0x01;
    std::fs::write(&inp, &bytes).unwrap();
    let err = run(&options(dir.path(), DType::Q8_0, &[])).unwrap_err();
    assert!(err.to_string().contains("checksum mismatch"), "{err}");
    assert!(err.to_string().contains("layers.0.mlp.up.weight"), "{err}");
    assert_eq!(common::files_in(dir.path()), ["in.kiln"]);
}

/// Flip bytes of tensor `name` in the file at `path` (offsets relative to the tensor's data).
fn corrupt(path: &Path, name: &str, edits: &[(usize, u8)]) {
    let info = KilnFile::open(path).unwrap().info(name).unwrap().clone();
    let mut bytes = std::fs::read(path).unwrap();
    for &(at, value) in edits {
        let at = if at == usize::MAX {
            info.len as usize - 1
        } else {
            at
        };
        bytes[info.offset as usize + at] = value;
    }
    std::fs::write(path, &bytes).unwrap();
}

fn assert_checksum_error(err: &QuantizeError, tensor: &str) {
    match err {
        QuantizeError::Format(FormatError::TensorChecksum { tensor: t, .. }) => {
            assert_eq!(t, tensor)
        }
        other => panic!("expected a checksum mismatch in {tensor}, got {other:?}"),
    }
}

/// The input checksums are checked as the conversion reads the tensors, chunk by chunk: a
/// corrupt byte in the last chunk of a tensor several chunks long is caught too, at any thread
/// count, and no output is left.
#[test]
fn corruption_in_a_later_chunk_is_caught() {
    let dir = tempfile::tempdir().unwrap();
    let inp = dir.path().join("in.kiln");
    // 4096 x 64 values: four chunks of whole rows.
    let shape = vec![4096u64, common::HIDDEN];
    let n = (shape[0] * shape[1]) as usize;
    assert!(n > 3 * kiln_quantize::CHUNK_ELEMENTS);
    let spec = kiln_format::TensorSpec {
        name: "layers.0.mlp.up.weight".into(),
        dtype: DType::BF16,
        shape,
    };
    let w = kiln_format::KilnWriter::create(&inp, &common::metadata(), vec![spec], false).unwrap();
    let bytes: Vec<u8> = common::values(7, n)
        .iter()
        .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())
        .collect();
    w.write_tensor(0, &bytes).unwrap();
    w.finish().unwrap();
    // Intact, it converts.
    run(&options(dir.path(), DType::Q4_0, &[])).unwrap();
    std::fs::remove_file(dir.path().join("out.kiln")).unwrap();
    let last = bytes[bytes.len() - 1];
    corrupt(&inp, "layers.0.mlp.up.weight", &[(usize::MAX, last ^ 0x01)]);
    for threads in [1, 2, 3] {
        let mut o = options(dir.path(), DType::Q4_0, &[]);
        o.threads = Some(threads);
        let err = run(&o).unwrap_err();
        assert_checksum_error(&err, "layers.0.mlp.up.weight");
        assert_eq!(
            common::files_in(dir.path()),
            ["in.kiln"],
            "{threads} threads"
        );
    }
}

/// Corruption that turns a value into NaN is reported as what it is, a checksum mismatch,
/// not as a NaN in the model.
#[test]
fn corruption_that_decodes_to_nan_is_reported_as_a_checksum_mismatch() {
    let dir = tempfile::tempdir().unwrap();
    let inp = dir.path().join("in.kiln");
    common::write_model(&inp, DType::BF16, |_, _| {});
    // bf16 0x7fc0 (little-endian c0 7f) is a quiet NaN.
    corrupt(&inp, "layers.1.attn.q.weight", &[(10, 0xc0), (11, 0x7f)]);
    for to in [DType::Q4_0, DType::Q8_0, DType::F16] {
        let err = run(&options(dir.path(), to, &[])).unwrap_err();
        assert_checksum_error(&err, "layers.1.attn.q.weight");
        assert_eq!(common::files_in(dir.path()), ["in.kiln"]);
    }
}

/// A tensor whose bytes are copied unchanged is checked as well.
#[test]
fn corrupt_copied_tensor_is_not_laundered() {
    let dir = tempfile::tempdir().unwrap();
    let inp = dir.path().join("in.kiln");
    common::write_model(&inp, DType::BF16, |_, _| {});
    corrupt(&inp, "layers.0.attn.v.weight", &[(3, 0x55)]);
    let err = run(&options(
        dir.path(),
        DType::Q4_0,
        &["layers.0.attn.v.weight=copy"],
    ))
    .unwrap_err();
    assert_checksum_error(&err, "layers.0.attn.v.weight");
    assert_eq!(common::files_in(dir.path()), ["in.kiln"]);
}

#[test]
fn requantizing_is_refused_but_copy_is_allowed() {
    let dir = tempfile::tempdir().unwrap();
    common::write_model(&dir.path().join("in.kiln"), DType::BF16, |_, _| {});
    run(&options(dir.path(), DType::Q4_0, &[])).unwrap();
    std::fs::rename(dir.path().join("out.kiln"), dir.path().join("in.kiln")).unwrap();
    let err = run(&options(dir.path(), DType::Q8_0, &[])).unwrap_err();
    assert!(
        matches!(
            err,
            QuantizeError::AlreadyQuantized {
                from: DType::Q4_0,
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(common::files_in(dir.path()), ["in.kiln"]);
    // Same target: blocks copied unchanged (q4_0x16 stays q4_0x16, and counts as q4_0);
    // explicit copy works for any target.
    let r = run(&options(dir.path(), DType::Q4_0, &[])).unwrap();
    let a = KilnFile::open(dir.path().join("in.kiln")).unwrap();
    let b = KilnFile::open(dir.path().join("out.kiln")).unwrap();
    assert!(a.tensors().iter().any(|t| t.dtype == DType::Q4_0x16));
    for t in a.tensors() {
        let o = b.info(&t.name).unwrap();
        assert_eq!((o.sha256, o.dtype), (t.sha256, t.dtype), "{}", t.name);
    }
    let q = r
        .tensors
        .iter()
        .find(|t| t.name == "layers.0.attn.q.weight")
        .unwrap();
    assert_eq!(
        (q.from, q.to, q.stored_as, q.copied),
        (DType::Q4_0, DType::Q4_0, DType::Q4_0x16, true)
    );
    assert_eq!(b.version(), (1, 1));
    let mut o = options(dir.path(), DType::Q8_0, &["*=copy"]);
    o.overwrite = true;
    run(&o).unwrap();
}

#[test]
fn same_file_and_existing_output_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    common::write_model(&dir.path().join("in.kiln"), DType::BF16, |_, _| {});
    let mut o = options(dir.path(), DType::Q8_0, &[]);
    o.output = dir.path().join("./in.kiln");
    o.overwrite = true;
    assert!(matches!(
        run(&o),
        Err(QuantizeError::Format(FormatError::OutputIsInput { .. }))
    ));
    std::fs::write(dir.path().join("out.kiln"), b"keep me").unwrap();
    let o = options(dir.path(), DType::Q8_0, &[]);
    let err = run(&o).unwrap_err();
    assert!(err.to_string().contains("--force"), "{err}");
    assert_eq!(
        std::fs::read(dir.path().join("out.kiln")).unwrap(),
        b"keep me"
    );
}

#[test]
fn unmatched_pattern_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    common::write_model(&dir.path().join("in.kiln"), DType::BF16, |_, _| {});
    let err = run(&options(
        dir.path(),
        DType::Q8_0,
        &["layers.*.attn.qq.weight=f16"],
    ))
    .unwrap_err();
    assert!(
        matches!(err, QuantizeError::UnmatchedOverride { .. }),
        "{err}"
    );
}
