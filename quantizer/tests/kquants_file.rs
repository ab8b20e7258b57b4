//! `quantize_file` to GGML's Q5_0/Q5_1/Q2_K…Q6_K/IQ4_NL/IQ4_XS and llama.cpp's mixes, on a
//! small `.kiln` whose rows are multiples of 256 (so the K-quants apply) beside rows that are
//! not (so they fall back as llama.cpp's do): stored blocks equal the format references, the
//! report's errors are those of the stored blocks, and the output is the same for any thread
//! count.

mod common;

use std::path::Path;

use kiln_format::{kquants, q5, DType, KilnFile, KilnWriter, TensorSpec};
use kiln_quantize::policy::{fallback, Mix};
use kiln_quantize::{quantize_file, NoProgress, Policy, QuantizeOptions, Report};

const LAYERS: u32 = 3;

/// (name, shape): hidden 256, MLP 512, an attention output of rows 96 (not a multiple of 256)
/// and a down projection of rows 48 (not even a multiple of 32); tied embeddings.
fn shapes() -> Vec<(String, Vec<u64>)> {
    let mut t = vec![
        ("embed.weight".to_string(), vec![64, 256]),
        ("final_norm.weight".to_string(), vec![256]),
    ];
    for l in 0..LAYERS {
        for (suffix, shape) in [
            ("attn_norm.weight", vec![256]),
            ("attn.q.weight", vec![256, 256]),
            ("attn.k.weight", vec![64, 256]),
            ("attn.v.weight", vec![64, 256]),
            ("attn.o.weight", vec![256, 96]),
            ("mlp.gate.weight", vec![512, 256]),
            ("mlp.up.weight", vec![512, 256]),
            ("mlp.down.weight", vec![256, if l == 1 { 48 } else { 512 }]),
        ] {
            t.push((format!("layers.{l}.{suffix}"), shape));
        }
    }
    t
}

fn write_model(path: &Path) {
    let specs: Vec<TensorSpec> = shapes()
        .into_iter()
        .map(|(name, shape)| TensorSpec {
            name,
            dtype: DType::F32,
            shape,
        })
        .collect();
    let w = KilnWriter::create(path, &common::metadata(), specs.clone(), false).unwrap();
    for (i, s) in specs.iter().enumerate() {
        let v = common::values(i as u64 + 7, s.shape.iter().product::<u64>() as usize);
        w.write_tensor(i, bytemuck::cast_slice(&v)).unwrap();
    }
    w.finish().unwrap();
}

fn quantize(dir: &Path, policy: Policy, threads: usize, out: &str) -> Report {
    let mut o = QuantizeOptions::new(dir.join("in.kiln"), dir.join(out), policy);
    o.threads = Some(threads);
    o.overwrite = true;
    quantize_file(&o, &NoProgress).unwrap()
}

/// The format crate's reference blocks of `x` in `dtype`.
fn reference_bytes(x: &[f32], dtype: DType) -> Vec<u8> {
    match dtype {
        DType::Q4_K => bytemuck::cast_slice(&kquants::quantize_row_q4_k_ref(x).unwrap()).to_vec(),
        DType::Q5_K => bytemuck::cast_slice(&kquants::quantize_row_q5_k_ref(x).unwrap()).to_vec(),
        DType::Q6_K => bytemuck::cast_slice(&kquants::quantize_row_q6_k_ref(x).unwrap()).to_vec(),
        DType::Q5_0 => bytemuck::cast_slice(&q5::quantize_row_q5_0_ref(x).unwrap()).to_vec(),
        DType::Q5_1 => bytemuck::cast_slice(&q5::quantize_row_q5_1_ref(x).unwrap()).to_vec(),
        DType::Q8_0 => {
            bytemuck::cast_slice(&kiln_format::blocks::quantize_row_q8_0_ref(x).unwrap()).to_vec()
        }
        DType::Q4_0 => {
            bytemuck::cast_slice(&kiln_format::blocks::quantize_row_q4_0_ref(x).unwrap()).to_vec()
        }
        DType::Q2_K => bytemuck::cast_slice(&kquants::quantize_row_q2_k_ref(x).unwrap()).to_vec(),
        DType::Q3_K => bytemuck::cast_slice(&kquants::quantize_row_q3_k_ref(x).unwrap()).to_vec(),
        DType::IQ4_NL => {
            bytemuck::cast_slice(&kiln_format::iq4::quantize_row_iq4_nl_ref(x).unwrap()).to_vec()
        }
        DType::IQ4_XS => {
            bytemuck::cast_slice(&kiln_format::iq4::quantize_row_iq4_xs_ref(x).unwrap()).to_vec()
        }
        d => panic!("not a block type here: {d}"),
    }
}

/// Check every tensor of `out` against `want(name, row length)`, the blocks against the
/// references and the report's RMSE against the stored values.
fn check(dir: &Path, out: &str, report: &Report, want: impl Fn(&str, u64) -> DType) {
    let input = KilnFile::open(dir.join("in.kiln")).unwrap();
    let output = KilnFile::open(dir.join(out)).unwrap();
    output.verify().unwrap();
    let mut minor = 0;
    for t in input.tensors() {
        let o = output.info(&t.name).unwrap();
        let row = *t.shape.last().unwrap();
        let d = if t.shape.len() == 1 {
            DType::F32
        } else {
            want(&t.name, row)
        };
        // Q4_0 fallbacks of whole sixteen-row groups are stored interleaved.
        assert_eq!(o.dtype.logical(), d, "{}", t.name);
        minor = minor.max(kiln_format::layout::minor_of(o.dtype));
        let x = input.view(t).to_f32_vec();
        let y = output.view(o).to_f32_vec();
        if d.is_quantized() {
            let cols = row as usize;
            let stored = output.view(o).bytes();
            assert_eq!(
                o.dtype.from_storage(cols, stored).as_ref(),
                reference_bytes(&x, d),
                "{}",
                t.name
            );
        }
        let r = report.tensors.iter().find(|r| r.name == t.name).unwrap();
        assert_eq!((r.to, r.stored_as), (d, o.dtype), "{}", t.name);
        let sq: f64 = x
            .iter()
            .zip(&y)
            .map(|(a, b)| f64::from(a - b).powi(2))
            .sum();
        let rmse = (sq / x.len() as f64).sqrt();
        assert!(
            (r.rmse - rmse).abs() <= 1e-9 + 1e-6 * rmse,
            "{}: report {} vs stored {rmse}",
            t.name,
            r.rmse
        );
        if d.is_quantized() {
            assert!(r.rmse > 0.0, "{}", t.name);
        }
    }
    // Written with the lowest minor version that holds its dtypes.
    assert_eq!(output.version(), (1, minor.max(2)));
}

#[test]
fn each_ggml_type_reproduces_the_references_and_falls_back_like_llama_cpp() {
    let dir = tempfile::tempdir().unwrap();
    write_model(&dir.path().join("in.kiln"));
    for (to, small) in [
        (DType::Q4_K, DType::Q5_0),
        (DType::Q5_K, DType::Q5_1),
        (DType::Q6_K, DType::Q8_0),
        (DType::Q5_0, DType::Q5_0),
        (DType::Q5_1, DType::Q5_1),
        (DType::Q2_K, DType::Q4_0),
        (DType::Q3_K, DType::Q4_0),
        (DType::IQ4_XS, DType::IQ4_NL),
        (DType::IQ4_NL, DType::IQ4_NL),
    ] {
        let out = format!("{to}.kiln");
        let report = quantize(dir.path(), Policy::new(to, vec![]).unwrap(), 2, &out);
        assert_eq!(report.to, to.name());
        check(dir.path(), &out, &report, |_, row| match row {
            48 => DType::F16,
            96 => small,
            _ => to,
        });
        let o = report
            .tensors
            .iter()
            .find(|t| t.name == "layers.0.attn.o.weight")
            .unwrap();
        if to != small {
            let note = o.note.as_deref().unwrap();
            assert!(
                note.contains(&format!("{} falls back to {}", to.name(), small.name())),
                "{note}"
            );
        }
    }
}

#[test]
fn mixes_follow_llama_cpp_and_do_not_depend_on_threads() {
    let dir = tempfile::tempdir().unwrap();
    write_model(&dir.path().join("in.kiln"));
    for mix in Mix::ALL {
        let base = mix.base();
        let one = quantize(dir.path(), Policy::mix(mix, vec![]), 1, "one.kiln");
        assert_eq!(one.to, mix.name());
        check(dir.path(), "one.kiln", &one, |name, row| {
            // Three layers, four query heads per key/value head (attn.q 256 rows, attn.k 64);
            // use_more_bits(i, 3) holds for layer 2 only.
            let layer = name
                .strip_prefix("layers.")
                .and_then(|r| r.split('.').next())
                .and_then(|l| l.parse::<u32>().ok());
            let k = match layer {
                None if name == "embed.weight" => Some(DType::Q6_K),
                Some(i) if name.ends_with("attn.v.weight") => mix.attn_v(i, LAYERS, 4),
                Some(i) if name.ends_with("mlp.down.weight") => mix.mlp_down(i, LAYERS, false),
                Some(_) if name.ends_with("attn.o.weight") => mix.attn_o(),
                _ => None,
            }
            .unwrap_or(base);
            fallback(k, row).unwrap_or(k)
        });
        // Spot checks against llama.cpp's rules, written out.
        let got = |name: &str| one.tensors.iter().find(|t| t.name == name).unwrap().to;
        match mix {
            Mix::Q4KM => {
                assert_eq!(got("layers.2.attn.v.weight"), DType::Q6_K);
                assert_eq!(got("layers.0.attn.v.weight"), DType::Q4_K);
            }
            Mix::Q3KM => {
                assert_eq!(got("layers.0.attn.v.weight"), DType::Q5_K);
                assert_eq!(got("layers.2.attn.v.weight"), DType::Q4_K);
                assert_eq!(got("layers.0.mlp.down.weight"), DType::Q4_K);
            }
            Mix::Q2K => {
                assert_eq!(got("layers.0.attn.v.weight"), DType::Q4_K);
                assert_eq!(got("layers.2.mlp.down.weight"), DType::Q3_K);
                assert_eq!(got("layers.0.attn.q.weight"), DType::Q2_K);
            }
            Mix::IQ4XS => {
                assert_eq!(got("layers.0.attn.v.weight"), DType::Q5_K);
                assert_eq!(got("layers.2.mlp.down.weight"), DType::IQ4_XS);
                // Rows of 96: IQ4_XS falls back to IQ4_NL.
                assert_eq!(got("layers.0.attn.o.weight"), DType::IQ4_NL);
            }
            _ => {}
        }
        let two = quantize(dir.path(), Policy::mix(mix, vec![]), 2, "two.kiln");
        let a = std::fs::read(dir.path().join("one.kiln")).unwrap();
        let b = std::fs::read(dir.path().join("two.kiln")).unwrap();
        let data = |f: &str| {
            let k = KilnFile::open(dir.path().join(f)).unwrap();
            k.tensors()
                .iter()
                .map(|t| k.view(t).bytes().to_vec())
                .collect::<Vec<_>>()
        };
        assert_eq!(data("one.kiln"), data("two.kiln"), "{}", mix.name());
        assert_eq!(a.len(), b.len());
        assert_eq!(one.tensors, two.tensors);
    }
}

/// With calibration's importance, every Q5_0/Q5_1/K-quant matrix is GGML's importance-weighted
/// quantization of its rows (what llama-quantize --imatrix writes); matrices without importance
/// keep the reference rule.
#[test]
fn importance_gives_ggml_s_weighted_blocks() {
    use kiln_format::kquants::{quantize_row_q4_k_weighted, quantize_row_q6_k_weighted};
    use kiln_format::q5::quantize_row_q5_0_weighted;
    use kiln_quantize::importance::{CalibrationInfo, Importance};
    use kiln_quantize::Method;

    let dir = tempfile::tempdir().unwrap();
    write_model(&dir.path().join("in.kiln"));
    let weighted = [
        ("layers.0.attn.q.weight", 256),
        ("layers.0.attn.o.weight", 96),
        ("layers.2.mlp.down.weight", 512),
    ];
    let column = |name: &str, cols: usize| -> Vec<f32> {
        // Deterministic, uneven, some zeros.
        (0..cols)
            .map(|j| ((j * 7 + name.len()) % 11) as f32 * 0.3)
            .collect()
    };
    let importance = Importance {
        columns: weighted
            .iter()
            .map(|&(n, c)| (n.to_string(), column(n, c)))
            .collect(),
        sites: weighted
            .iter()
            .map(|&(n, _)| (n.to_string(), "site".to_string()))
            .collect(),
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
    let mut o = QuantizeOptions::new(
        dir.path().join("in.kiln"),
        dir.path().join("out.kiln"),
        Policy::mix(Mix::Q4KM, vec![]),
    );
    o.method = Method::Search;
    o.importance = Some(importance);
    quantize_file(&o, &NoProgress).unwrap();
    let input = KilnFile::open(dir.path().join("in.kiln")).unwrap();
    let out = KilnFile::open(dir.path().join("out.kiln")).unwrap();
    for (name, cols) in weighted {
        let t = input.info(name).unwrap();
        let x = input.view(t).to_f32_vec();
        let w = column(name, cols);
        let o = out.info(name).unwrap();
        let want: Vec<u8> = x
            .chunks_exact(cols)
            .flat_map(|row| -> Vec<u8> {
                match o.dtype {
                    DType::Q4_K => {
                        bytemuck::cast_slice(&quantize_row_q4_k_weighted(row, &w).unwrap()).to_vec()
                    }
                    DType::Q6_K => {
                        bytemuck::cast_slice(&quantize_row_q6_k_weighted(row, &w).unwrap()).to_vec()
                    }
                    DType::Q5_0 => {
                        bytemuck::cast_slice(&quantize_row_q5_0_weighted(row, &w).unwrap()).to_vec()
                    }
                    d => panic!("{name}: {d}"),
                }
            })
            .collect();
        assert_eq!(out.view(o).bytes(), want, "{name} ({})", o.dtype);
        assert_ne!(
            out.view(o).bytes(),
            reference_bytes(&x, o.dtype),
            "{name}: the importance changes the blocks"
        );
    }
    // Without importance: the reference blocks.
    let t = input.info("layers.1.attn.q.weight").unwrap();
    let o = out.info("layers.1.attn.q.weight").unwrap();
    let x = input.view(t).to_f32_vec();
    assert_eq!(out.view(o).bytes(), reference_bytes(&x, o.dtype));
}
