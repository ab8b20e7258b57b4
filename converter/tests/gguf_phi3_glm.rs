//! Phi-3, GLM and GLM-4 in GGUF as llama.cpp writes and reads them: the layout export writes
//! (fused `attn_qkv` and `ffn_up`, LongRoPE factor tensors, the rotated width), import of files
//! as llama.cpp's converter writes them (no Kiln keys, no head width, a window of 0), and one
//! test per malformed or inconsistent file, each an error naming the file and the tensor or
//! key, never a panic. Round trips of the tiny fixtures are in `gguf_roundtrip.rs`.

mod common;

use std::borrow::Cow;
use std::path::{Path, PathBuf};

use common::{convert, repo};
use kiln_convert::gguf::{
    export_gguf, import_gguf, ExportOptions, GgmlType, GgufBuilder, GgufFile, ImportOptions, Value,
};
use kiln_convert::{ConvertError, NoProgress};
use kiln_format::{Architecture, DType, KilnFile, KilnWriter, Metadata, RopeScaling, TensorSpec};

/// A tiny fixture converted and exported: the `.kiln` and the `.gguf` in `dir`.
fn exported(fixture: &str, dir: &Path) -> (PathBuf, PathBuf) {
    let kiln = dir.join(format!("{fixture}.kiln"));
    convert(&repo().join("fixtures/tiny").join(fixture), &kiln);
    let gguf = dir.join(format!("{fixture}.gguf"));
    export_gguf(
        &ExportOptions {
            input: kiln.clone(),
            output: gguf.clone(),
            overwrite: false,
        },
        &NoProgress,
    )
    .unwrap();
    (kiln, gguf)
}

fn import(gguf: &Path, out: &Path) -> kiln_convert::Result<kiln_convert::gguf::ImportSummary> {
    import_gguf(
        &ImportOptions {
            input: gguf.to_path_buf(),
            output: out.to_path_buf(),
            overwrite: false,
            dequantize_to: DType::F32,
            dequantize_all: false,
            allow_non_finite: false,
        },
        &NoProgress,
    )
}

/// A tensor of a GGUF file being rewritten: name, GGML dims, type, bytes.
type Tensor = (String, Vec<u64>, GgmlType, Vec<u8>);

/// `src` rewritten to `dst` after `edit` has changed its metadata and tensors.
fn rewrite(src: &Path, dst: &Path, edit: impl FnOnce(&mut Vec<(String, Value)>, &mut Vec<Tensor>)) {
    let g = GgufFile::open(src).unwrap();
    let mut kv = g.header().metadata.clone();
    let mut tensors: Vec<Tensor> = g
        .header()
        .tensors
        .iter()
        .map(|t| {
            (
                t.name.clone(),
                t.dims.clone(),
                t.ggml_type,
                g.tensor_bytes(t).to_vec(),
            )
        })
        .collect();
    edit(&mut kv, &mut tensors);
    let mut b = GgufBuilder::new();
    for (k, v) in kv {
        b.set(&k, v);
    }
    for (name, dims, ty, _) in &tensors {
        b.add_tensor(name, dims.clone(), *ty).unwrap();
    }
    b.write(dst, false, |i| Ok(Cow::Owned(tensors[i].3.clone())))
        .unwrap();
}

fn drop_key(kv: &mut Vec<(String, Value)>, key: &str) {
    let n = kv.len();
    kv.retain(|(k, _)| k != key);
    assert_eq!(kv.len(), n - 1, "{key} was there");
}

fn set_key(kv: &mut [(String, Value)], key: &str, v: Value) {
    kv.iter_mut().find(|(k, _)| k == key).unwrap().1 = v;
}

fn tensor<'t>(ts: &'t mut [Tensor], name: &str) -> &'t mut Tensor {
    ts.iter_mut().find(|t| t.0 == name).unwrap()
}

fn f32s(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// The tensor names, shapes and keys of llama.cpp's own converter (`Phi3MiniModel`,
/// `Glm4Model`, `ChatGLMModel`): Phi-3's q/k/v fused in `attn_qkv`, gate and up fused in
/// `ffn_up` (2 · intermediate rows, gate first) for all three, split q/k/v with biases for
/// GLM, GLM-4's output norms, LongRoPE's factors as `rope_factors_long`/`_short` with the
/// original context and attention factor as keys, and the rotated width as
/// `rope.dimension_count`. The fused tensors hold the parts' bytes, rows stacked in order.
#[test]
fn phi3_and_glm_export_llama_cpp_layout() {
    struct Want {
        fixture: &'static str,
        arch: &'static str,
        rotated: u32,
        tensors: &'static [(&'static str, &'static [u64])],
        absent: &'static [&'static str],
    }
    let wants = [
        Want {
            fixture: "phi3-f32",
            arch: "phi3",
            // int(0.75 · 64) // 4 heads, as the converter computes it: 12 of 16.
            rotated: 12,
            tensors: &[
                ("blk.0.attn_qkv.weight", &[64, 64 + 2 * 32]),
                ("blk.1.ffn_up.weight", &[64, 2 * 128]),
                ("blk.1.ffn_down.weight", &[128, 64]),
                ("rope_factors_long.weight", &[6]),
                ("rope_factors_short.weight", &[6]),
                ("output.weight", &[64, 320]),
            ],
            absent: &["blk.0.attn_q.weight", "blk.0.ffn_gate.weight"],
        },
        Want {
            fixture: "glm-f32",
            arch: "chatglm",
            rotated: 8,
            tensors: &[
                ("blk.0.attn_q.weight", &[64, 64]),
                ("blk.0.attn_k.weight", &[64, 32]),
                ("blk.0.attn_q.bias", &[64]),
                ("blk.1.ffn_up.weight", &[64, 256]),
            ],
            absent: &[
                "blk.0.attn_qkv.weight",
                "blk.0.ffn_gate.weight",
                "output.weight",
                "blk.0.post_attention_norm.weight",
            ],
        },
        Want {
            fixture: "glm4-f32",
            arch: "glm4",
            rotated: 12,
            tensors: &[
                ("blk.0.attn_q.weight", &[64, 96]),
                ("blk.0.attn_v.bias", &[48]),
                ("blk.0.attn_output.weight", &[96, 64]),
                ("blk.1.ffn_up.weight", &[64, 256]),
                ("blk.1.post_attention_norm.weight", &[64]),
                ("blk.1.post_ffw_norm.weight", &[64]),
            ],
            absent: &["blk.0.attn_qkv.weight", "blk.0.ffn_gate.weight"],
        },
    ];
    for w in wants {
        let tmp = tempfile::tempdir().unwrap();
        let kiln = tmp.path().join("m.kiln");
        convert(&repo().join("fixtures/tiny").join(w.fixture), &kiln);
        let gguf = tmp.path().join("m.gguf");
        let s = export_gguf(
            &ExportOptions {
                input: kiln.clone(),
                output: gguf.clone(),
                overwrite: false,
            },
            &NoProgress,
        )
        .unwrap();
        assert_eq!(s.architecture, w.arch);
        let g = GgufFile::open(&gguf).unwrap();
        let h = g.header();
        let key = |k: &str| h.get(&format!("{}.{k}", w.arch)).and_then(Value::as_u64);
        assert_eq!(key("rope.dimension_count"), Some(u64::from(w.rotated)));
        for (name, dims) in w.tensors {
            let t = h
                .tensor(name)
                .unwrap_or_else(|| panic!("{} lacks {name}", w.fixture));
            assert_eq!(&t.dims, dims, "{} {name}", w.fixture);
        }
        for name in w.absent {
            assert!(h.tensor(name).is_none(), "{} has {name}", w.fixture);
        }
        // The fused MLP is [gate; up], byte for byte.
        let k = KilnFile::open(&kiln).unwrap();
        let mut want = k
            .tensor("layers.1.mlp.gate.weight")
            .unwrap()
            .bytes()
            .to_vec();
        want.extend_from_slice(k.tensor("layers.1.mlp.up.weight").unwrap().bytes());
        let up = h.tensor("blk.1.ffn_up.weight").unwrap();
        assert!(g.tensor_bytes(up) == want.as_slice(), "{}", w.fixture);
        if w.arch == "phi3" {
            let mut want = Vec::new();
            for p in ["q", "k", "v"] {
                let name = format!("layers.0.attn.{p}.weight");
                want.extend_from_slice(k.tensor(&name).unwrap().bytes());
            }
            let qkv = h.tensor("blk.0.attn_qkv.weight").unwrap();
            assert!(g.tensor_bytes(qkv) == want.as_slice());
            assert_eq!(key("rope.scaling.original_context_length"), Some(16));
            assert_eq!(key("attention.sliding_window"), Some(8));
            let attn = h
                .get("phi3.rope.scaling.attn_factor")
                .and_then(Value::as_f64)
                .unwrap();
            // √(1 + ln 16 / ln 16): the context stretch 256 / 16 over the original 16.
            assert!((attn - 2f64.sqrt()).abs() < 1e-6, "{attn}");
            let long = h.tensor("rope_factors_long.weight").unwrap();
            let got: Vec<f32> = g
                .tensor_bytes(long)
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            assert_eq!(got, [1.0, 1.5, 2.5, 4.5, 8.5, 16.5]);
            assert!(
                s.notices.iter().any(|n| n.contains("sliding_window")),
                "{:?}",
                s.notices
            );
            // A file named like Phi-3 makes llama.cpp look up Phi-3's special tokens, which
            // the tiny vocabulary lacks: the export says so.
            assert!(s.notices.iter().all(|n| !n.contains("rename")));
            let named = tmp.path().join("phi3-tiny.kiln");
            std::fs::copy(&kiln, &named).unwrap();
            let s = export_gguf(
                &ExportOptions {
                    input: named,
                    output: tmp.path().join("phi3-tiny.gguf"),
                    overwrite: false,
                },
                &NoProgress,
            )
            .unwrap();
            assert!(
                s.notices
                    .iter()
                    .any(|n| n.contains("rename") && n.contains("</s>")),
                "{:?}",
                s.notices
            );
        }
    }
}

/// Files as llama.cpp's converter writes them, which carry no `kiln.*` key: `Phi3MiniModel`
/// writes no head width, vocabulary size or key/value lengths, and `sliding_window = 0` for a
/// model without a window; `ChatGLMModel` no head width or vocabulary size either. Each imports
/// to the configuration of the Hugging Face conversion (LongRoPE factors to f32 rounding, read
/// from the tensors) and the same tensors, byte for byte.
#[test]
fn files_as_llama_cpp_writes_them_import() {
    let tmp = tempfile::tempdir().unwrap();
    for (fixture, arch) in [
        ("phi3-f32", "phi3"),
        ("glm-f32", "chatglm"),
        ("glm4-f32", "glm4"),
    ] {
        let (kiln, gguf) = exported(fixture, tmp.path());
        let plain = tmp.path().join(format!("{fixture}-plain.gguf"));
        rewrite(&gguf, &plain, |kv, _| {
            let k = |s: &str| format!("{arch}.{s}");
            kv.retain(|(key, _)| !key.starts_with("kiln."));
            if arch != "glm4" {
                for key in [
                    "attention.key_length",
                    "attention.value_length",
                    "vocab_size",
                ] {
                    drop_key(kv, &k(key));
                }
            }
        });
        let back = tmp.path().join(format!("{fixture}-back.kiln"));
        import(&plain, &back).unwrap();
        let (a, b) = (
            KilnFile::open(&kiln).unwrap(),
            KilnFile::open(&back).unwrap(),
        );
        for (x, y) in a.tensors().iter().zip(b.tensors()) {
            assert_eq!((&x.name, &x.shape, x.dtype), (&y.name, &y.shape, y.dtype));
            assert!(a.view(x).bytes() == b.view(y).bytes(), "{} differs", x.name);
        }
        let (ca, mut cb) = (a.metadata().config.clone(), b.metadata().config.clone());
        cb.source_architecture = ca.source_architecture.clone();
        cb.rms_norm_eps = ca.rms_norm_eps;
        if let (
            Some(RopeScaling::LongRope {
                short_factor: sa,
                long_factor: la,
                attention_factor: fa,
                ..
            }),
            Some(RopeScaling::LongRope {
                short_factor: sb,
                long_factor: lb,
                attention_factor: fb,
                ..
            }),
        ) = (&ca.rope_scaling, &mut cb.rope_scaling)
        {
            let f32s = |v: &[f64]| v.iter().map(|&x| x as f32).collect::<Vec<_>>();
            assert_eq!((f32s(sa), f32s(la)), (f32s(sb), f32s(lb)));
            assert_eq!(*fa as f32, *fb as f32);
            (*sb, *lb, *fb) = (sa.clone(), la.clone(), *fa);
        }
        assert_eq!(ca, cb, "{fixture}");
    }
    // Phi-4-mini has no window: llama.cpp's converter writes 0.
    let again = tmp.path().join("again");
    std::fs::create_dir(&again).unwrap();
    let (_, gguf) = exported("phi3-f32", &again);
    let nowin = tmp.path().join("nowin.gguf");
    rewrite(&gguf, &nowin, |kv, _| {
        set_key(kv, "phi3.attention.sliding_window", Value::U32(0))
    });
    let back = tmp.path().join("nowin.kiln");
    import(&nowin, &back).unwrap();
    assert_eq!(
        KilnFile::open(&back)
            .unwrap()
            .metadata()
            .config
            .sliding_window,
        None
    );
}

/// `src` rewritten to `dst` with its metadata edited and only the tensors `keep` accepts.
fn edited_kiln(
    src: &Path,
    dst: &Path,
    edit: impl FnOnce(&mut Metadata),
    keep: impl Fn(&str) -> bool,
) {
    let f = KilnFile::open(src).unwrap();
    let mut meta = f.metadata().clone();
    edit(&mut meta);
    let kept: Vec<_> = f.tensors().iter().filter(|t| keep(&t.name)).collect();
    let specs = kept
        .iter()
        .map(|t| TensorSpec {
            name: t.name.clone(),
            dtype: t.dtype,
            shape: t.shape.clone(),
        })
        .collect();
    let w = KilnWriter::create(dst, &meta, specs, false).unwrap();
    for (i, t) in kept.iter().enumerate() {
        w.write_tensor(i, f.view(t).bytes()).unwrap();
    }
    w.finish().unwrap();
}

/// What llama.cpp cannot represent is refused on export, naming the field, and nothing is
/// written: a GLM-4 with a sliding window (llama.cpp's GLM graphs have none), a GLM whose
/// heads do not make the hidden width (llama.cpp's `chatglm` loads a square output
/// projection), a Phi-3 with a score scale of its own (no GGUF key states one).
#[test]
fn export_refuses_what_llama_cpp_cannot_represent() {
    let tmp = tempfile::tempdir().unwrap();
    type Case = (
        &'static str,
        &'static str,
        fn(&mut Metadata),
        fn(&str) -> bool,
    );
    let cases: [Case; 3] = [
        (
            "glm4-f32",
            "sliding_window",
            |m| m.config.sliding_window = Some(8),
            |_| true,
        ),
        (
            "glm4-f32",
            "head_dim",
            |m| {
                m.config.architecture = Architecture::Glm;
                m.config.family.post_norms = false;
            },
            |n| !n.contains("post_norm"),
        ),
        (
            "phi3-f32",
            "attn_scale",
            |m| m.config.family.attn_scale = Some(0.1),
            |_| true,
        ),
    ];
    for (i, (fixture, field, edit, keep)) in cases.into_iter().enumerate() {
        let kiln = tmp.path().join(format!("{i}.kiln"));
        convert(&repo().join("fixtures/tiny").join(fixture), &kiln);
        let edited = tmp.path().join(format!("{i}-edited.kiln"));
        edited_kiln(&kiln, &edited, edit, keep);
        let out = tmp.path().join(format!("{i}.gguf"));
        let e = export_gguf(
            &ExportOptions {
                input: edited,
                output: out.clone(),
                overwrite: false,
            },
            &NoProgress,
        )
        .unwrap_err();
        assert!(matches!(e, ConvertError::Export { .. }), "{e}");
        let m = e.to_string();
        assert!(m.contains(&format!("`{field}`")), "{fixture}: {m}");
        assert!(!out.exists());
    }
}

/// One malformed or inconsistent file per case, each refused with its own error naming the
/// file and the tensor or key at fault.
#[test]
fn malformed_phi3_and_glm_files_are_refused_naming_the_culprit() {
    type Edit = fn(&mut Vec<(String, Value)>, &mut Vec<Tensor>);
    let cases: &[(&str, &str, &str, Edit)] = &[
        (
            "phi3-f32",
            "fused q/k/v one row short",
            "blk.0.attn_qkv.weight",
            |_, ts| {
                let t = tensor(ts, "blk.0.attn_qkv.weight");
                t.1[1] -= 1;
                t.3.truncate(t.3.len() - 64 * 4);
            },
        ),
        (
            "phi3-f32",
            "fused MLP of intermediate rows only",
            "blk.1.ffn_up.weight",
            |_, ts| {
                let t = tensor(ts, "blk.1.ffn_up.weight");
                t.1[1] /= 2;
                t.3.truncate(t.3.len() / 2);
            },
        ),
        (
            "phi3-f32",
            "short factors missing",
            "rope_factors_short.weight",
            |_, ts| {
                ts.retain(|t| t.0 != "rope_factors_short.weight");
            },
        ),
        (
            "phi3-f32",
            "long factors of the wrong length",
            "rope_factors_long.weight",
            |_, ts| {
                let t = tensor(ts, "rope_factors_long.weight");
                t.1[0] = 5;
                t.3.truncate(5 * 4);
            },
        ),
        (
            "phi3-f32",
            "a factor that is not positive",
            "rope_factors_short.weight",
            |_, ts| {
                tensor(ts, "rope_factors_short.weight").3 = f32s(&[1.0, 0.0, 1.0, 1.0, 1.0, 1.0]);
            },
        ),
        (
            "phi3-f32",
            "factors without the original context",
            "phi3.rope.scaling.original_context_length",
            |kv, _| drop_key(kv, "phi3.rope.scaling.original_context_length"),
        ),
        (
            "phi3-f32",
            "Kiln's key contradicting the tensors",
            "kiln.rope_scaling",
            |_, ts| {
                tensor(ts, "rope_factors_long.weight").3 = f32s(&[1.0, 1.5, 2.5, 4.5, 8.5, 16.0]);
            },
        ),
        (
            "phi3-f32",
            "q/k/v both fused and split",
            "blk.0.attn_q.weight",
            |_, ts| {
                let q = tensor(ts, "blk.0.attn_qkv.weight").clone();
                let bytes = q.3[..64 * 64 * 4].to_vec();
                ts.push(("blk.0.attn_q.weight".into(), vec![64, 64], q.2, bytes));
            },
        ),
        (
            "glm4-f32",
            "gate and up split, as for llama",
            "blk.0.ffn_up.weight",
            |_, ts| {
                let t = tensor(ts, "blk.0.ffn_up.weight").clone();
                let half = t.3.len() / 2;
                let gate = (
                    "blk.0.ffn_gate.weight".into(),
                    vec![64, 128],
                    t.2,
                    t.3[..half].to_vec(),
                );
                let up = tensor(ts, "blk.0.ffn_up.weight");
                up.1 = vec![64, 128];
                up.3.truncate(half);
                ts.insert(0, gate);
            },
        ),
        (
            "glm-f32",
            "an odd rotated width",
            "chatglm.rope.dimension_count",
            |kv, _| set_key(kv, "chatglm.rope.dimension_count", Value::U32(7)),
        ),
        (
            "glm-f32",
            "a rotated width past the head",
            "chatglm.rope.dimension_count",
            |kv, _| set_key(kv, "chatglm.rope.dimension_count", Value::U32(18)),
        ),
        (
            "glm4-f32",
            "M-RoPE sections (GLM-4V)",
            "glm4.rope.dimension_sections",
            |kv, _| {
                kv.push((
                    "glm4.rope.dimension_sections".into(),
                    Value::Array(kiln_convert::gguf::Array::I32(vec![2, 2, 2, 0])),
                ))
            },
        ),
        (
            "glm4-f32",
            "LongRoPE factors on a GLM",
            "rope_factors_long.weight",
            |_, ts| {
                ts.push((
                    "rope_factors_long.weight".into(),
                    vec![6],
                    GgmlType::from_id(0).unwrap(),
                    f32s(&[1.0; 6]),
                ));
            },
        ),
    ];
    let tmp = tempfile::tempdir().unwrap();
    let mut sources = std::collections::HashMap::new();
    for (i, (fixture, what, culprit, edit)) in cases.iter().enumerate() {
        let gguf = sources
            .entry(*fixture)
            .or_insert_with(|| exported(fixture, tmp.path()).1)
            .clone();
        let bad = tmp.path().join(format!("bad-{i}.gguf"));
        rewrite(&gguf, &bad, edit);
        let out = tmp.path().join(format!("bad-{i}.kiln"));
        let e = import(&bad, &out).expect_err(what);
        let m = e.to_string();
        assert!(
            m.contains(&bad.display().to_string()) && m.contains(culprit),
            "{what}: {m}"
        );
        assert!(!out.exists(), "{what}: nothing written");
    }
}
