//! Converting every committed fixture, compared tensor by tensor with the safetensors source.

mod common;

use common::{repo, TINY};
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use kiln_convert::names::{canonical, fused_parts, Source};
use kiln_convert::{convert_hf, ConvertOptions, NoProgress};
use kiln_format::{DType, KilnFile};
use safetensors::SafeTensors;

fn source_files(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    v.sort();
    v
}

fn to_f32(dtype: safetensors::Dtype, b: &[u8]) -> Vec<f32> {
    match dtype {
        safetensors::Dtype::F32 => b
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect(),
        safetensors::Dtype::F16 => b
            .chunks_exact(2)
            .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        safetensors::Dtype::BF16 => b
            .chunks_exact(2)
            .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        d => panic!("unexpected {d:?}"),
    }
}

/// Convert `dir` with `dtype` and check every source tensor against the output.
fn convert_and_compare(dir: &Path, dtype: Option<DType>) -> KilnFile {
    let out = tempfile::tempdir().unwrap();
    let path = out.path().join("m.kiln");
    convert_hf(
        &ConvertOptions {
            input: dir.to_path_buf(),
            output: path.clone(),
            dtype,
            overwrite: false,
            allow_non_finite: false,
        },
        &NoProgress,
    )
    .unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    let f = KilnFile::open(&path).unwrap();
    f.verify().unwrap();
    let mut compared = 0;
    for file in source_files(dir) {
        let bytes = std::fs::read(&file).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        for (name, view) in st.tensors() {
            let arch = f.metadata().config.architecture;
            // A fused tensor (Phi-3's qkv_proj, gate_up_proj) is stored as its parts: each is
            // the next block of rows.
            let parts = match canonical(Source::HuggingFace, arch, &name) {
                Some(c) => vec![c],
                None => fused_parts(Source::HuggingFace, arch, &name)
                    .unwrap_or_else(|| panic!("{name} unknown")),
            };
            let source_shape: Vec<u64> = view.shape().iter().map(|&d| d as u64).collect();
            let row_bytes = view.data().len() / view.shape()[0];
            let mut first_row = 0usize;
            for part in parts {
                let canon = part.to_string();
                let Some(info) = f.info(&canon) else {
                    // Only a tied lm_head may be dropped.
                    assert!(
                        name == "lm_head.weight" && f.metadata().config.tie_word_embeddings,
                        "{name} missing"
                    );
                    continue;
                };
                let out_view = f.view(info);
                let rows = info.shape[0] as usize;
                let data = &view.data()[first_row * row_bytes..(first_row + rows) * row_bytes];
                let mut want_shape = source_shape.clone();
                want_shape[0] = rows as u64;
                first_row += rows;
                assert_eq!(info.shape, want_shape, "{name} ({canon})");
                match dtype {
                    None => assert_eq!(out_view.bytes(), data, "{canon} is not byte-identical"),
                    Some(d) => {
                        assert_eq!(info.dtype, d);
                        let src = to_f32(view.dtype(), data);
                        let got = out_view.to_f32_vec();
                        for (k, (a, b)) in src.iter().zip(&got).enumerate() {
                            // Round to nearest even, as torch's .to(dtype) does.
                            let want = match d {
                                DType::F32 => *a,
                                DType::F16 => f16::from_f32(*a).to_f32(),
                                DType::BF16 => bf16::from_f32(*a).to_f32(),
                                _ => unreachable!(),
                            };
                            assert_eq!(want.to_bits(), b.to_bits(), "{name}[{k}]");
                        }
                    }
                }
                compared += 1;
            }
            assert_eq!(
                first_row,
                view.shape()[0],
                "{name}: every row goes to a part"
            );
        }
    }
    assert_eq!(
        compared,
        f.tensors().len(),
        "every output tensor comes from the source"
    );
    f
}

#[test]
fn every_tiny_fixture_converts_byte_identically() {
    for name in TINY {
        let dir = repo().join("fixtures/tiny").join(name);
        let f = convert_and_compare(&dir, None);
        let m = f.metadata();
        assert!(m.tokenizer.tokenizer_json.is_some(), "{name}");
        assert!(
            m.tokenizer.chat_template.is_some(),
            "{name}: chat_template.jinja is carried"
        );
        let tj = std::fs::read_to_string(dir.join("tokenizer.json")).unwrap();
        assert_eq!(
            m.tokenizer.tokenizer_json.as_deref(),
            Some(tj.as_str()),
            "tokenizer.json kept byte for byte"
        );
    }
}

#[test]
fn every_tiny_fixture_converts_to_each_float_dtype() {
    for name in TINY {
        for d in [DType::F32, DType::F16, DType::BF16] {
            convert_and_compare(&repo().join("fixtures/tiny").join(name), Some(d));
        }
    }
}

#[test]
fn configs_resolve_as_transformers_does() {
    let f = convert_and_compare(&repo().join("fixtures/tiny/qwen2-bias-f32"), None);
    let c = &f.metadata().config;
    assert!(c.attention_bias);
    assert_eq!(c.rope_theta, 1_000_000.0);
    assert!(f.info("layers.1.attn.k.bias").is_some());
    let f = convert_and_compare(&repo().join("fixtures/tiny/llama-tied-f32"), None);
    assert!(f.metadata().config.tie_word_embeddings);
    assert!(
        f.info("lm_head.weight").is_none(),
        "tied embeddings are not duplicated"
    );
    let f = convert_and_compare(&repo().join("fixtures/tiny/llama3-rope-f32"), None);
    assert!(matches!(
        f.metadata().config.rope_scaling,
        Some(kiln_format::RopeScaling::Llama3 { .. })
    ));
    let f = convert_and_compare(&repo().join("fixtures/tiny/mistral-f32"), None);
    assert_eq!(
        f.metadata().config.architecture,
        kiln_format::Architecture::Mistral
    );
}

#[test]
fn sharded_and_single_file_give_the_same_tensors() {
    // The sharded fixture is f16; convert it and check it has every layer's tensors.
    let f = convert_and_compare(&repo().join("fixtures/tiny/llama-sharded-f16"), None);
    assert_eq!(
        f.tensors()
            .iter()
            .filter(|t| t.name.starts_with("layers.1."))
            .count(),
        9
    );
    let sources = &f.metadata().provenance[0].sources;
    assert!(sources
        .iter()
        .any(|s| s.name == "model.safetensors.index.json"));
    assert_eq!(
        sources
            .iter()
            .filter(|s| s.name.ends_with(".safetensors"))
            .count(),
        3
    );
}

#[test]
fn a_bare_decoder_backbone_with_sentence_transformers_modules_is_an_embedding_model() {
    // Qwen3-Embedding's layout: the decoder's tensors without `model.` and without a head,
    // with modules.json and last-token pooling beside them.
    let convert = |name: &str, out: &Path| {
        convert_hf(
            &ConvertOptions {
                input: repo().join("fixtures").join(name),
                output: out.to_path_buf(),
                dtype: None,
                overwrite: false,
                allow_non_finite: false,
            },
            &NoProgress,
        )
        .unwrap_or_else(|e| panic!("{name}: {e}"));
        KilnFile::open(out).unwrap()
    };
    let dir = tempfile::tempdir().unwrap();
    let gen = convert("tiny/qwen3-f32", &dir.path().join("g.kiln"));
    let emb = convert("embedding/qwen3-embedding-f32", &dir.path().join("e.kiln"));
    let tensors = |f: &KilnFile| {
        f.tensors()
            .iter()
            .map(|t| (t.name.clone(), t.sha256))
            .collect::<Vec<_>>()
    };
    assert_eq!(
        tensors(&gen),
        tensors(&emb),
        "the same weights under the same names"
    );
    let spec = emb.metadata().config.family.embedding.clone().unwrap();
    assert_eq!(spec.pooling, kiln_format::Pooling::LastToken);
    assert!(spec.normalize);
    assert_eq!(spec.max_seq_length, Some(64));
    assert_eq!(
        spec.prompts.keys().collect::<Vec<_>>(),
        ["document", "query"]
    );
    assert!(gen.metadata().config.family.embedding.is_none());
}

const SMOLLM2: &str = "target/models/smollm2-bf16";

/// Real model: needs `ci/smollm2.sh` to have built the checkpoint (CI does).
#[test]
#[ignore = "real model: run ci/smollm2.sh first; CI runs it with --include-ignored"]
fn smollm2_converts_losslessly_and_verifies() {
    for dir in [SMOLLM2, "target/models/smollm2-bf16-sharded"] {
        let dir = repo().join(dir);
        assert!(
            dir.is_dir(),
            "{} is missing: run ci/smollm2.sh",
            dir.display()
        );
        let f = convert_and_compare(&dir, None);
        let c = &f.metadata().config;
        assert_eq!(
            (c.num_layers, c.hidden_size, c.num_kv_heads, c.vocab_size),
            (30, 576, 3, 49152)
        );
        assert_eq!(f.tensors().len(), 272);
    }
}

#[test]
#[ignore = "real model: run ci/smollm2.sh first; CI runs it with --include-ignored"]
fn smollm2_converts_to_f32_exactly() {
    convert_and_compare(&repo().join(SMOLLM2), Some(DType::F32));
}

#[test]
fn provenance_records_every_source_file_with_its_sha256() {
    use sha2::{Digest, Sha256};
    let dir = repo().join("fixtures/tiny/llama-sharded-f16");
    let f = convert_and_compare(&dir, None);
    let step = &f.metadata().provenance[0];
    assert!(step.tool.starts_with("kiln-convert "));
    for src in &step.sources {
        let bytes = std::fs::read(dir.join(&src.name)).unwrap();
        assert_eq!(src.bytes, bytes.len() as u64, "{}", src.name);
        assert_eq!(
            src.sha256,
            kiln_format::hex(&Sha256::digest(&bytes)),
            "{}",
            src.name
        );
    }
    for name in [
        "config.json",
        "tokenizer.json",
        "model.safetensors.index.json",
        "model-00003-of-00003.safetensors",
    ] {
        assert!(
            step.sources.iter().any(|s| s.name == name),
            "{name} recorded"
        );
    }
}
