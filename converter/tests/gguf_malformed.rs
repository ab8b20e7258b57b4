//! Hostile GGUF input: one test per malformed case, each expecting its own error variant and a
//! message naming the field at fault; plus truncation at every byte and byte flips, which must
//! give errors, never panics.

mod common;

use std::path::{Path, PathBuf};

use kiln_convert::gguf::{
    export_gguf, import_gguf, parse, read, Array, ExportOptions, GgmlType, GgufBuilder,
    ImportOptions, Value,
};
use kiln_convert::{ConvertError, NoProgress};
use kiln_format::DType;

/// Little-endian GGUF bytes written field by field.
#[derive(Default, Clone)]
struct Raw(Vec<u8>);

impl Raw {
    fn header(version: u32, tensors: u64, kvs: u64) -> Raw {
        let mut r = Raw(b"GGUF".to_vec());
        r.u32(version).u64(tensors).u64(kvs);
        r
    }
    fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend(v.to_le_bytes());
        self
    }
    fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend(v.to_le_bytes());
        self
    }
    fn str(&mut self, s: &str) -> &mut Self {
        self.u64(s.len() as u64);
        self.0.extend(s.as_bytes());
        self
    }
    fn kv_u32(&mut self, k: &str, v: u32) -> &mut Self {
        self.str(k).u32(4).u32(v)
    }
    fn tensor(&mut self, name: &str, dims: &[u64], ty: u32, offset: u64) -> &mut Self {
        self.str(name).u32(dims.len() as u32);
        for &d in dims {
            self.u64(d);
        }
        self.u32(ty).u64(offset)
    }
    /// Pad to 32 bytes and append `n` bytes of tensor data.
    fn data(&mut self, n: usize) -> &mut Self {
        let pad = self.0.len().next_multiple_of(32) - self.0.len();
        self.0.extend(std::iter::repeat_n(0u8, pad + n));
        self
    }
}

fn err(bytes: &[u8]) -> ConvertError {
    parse("hostile.gguf", bytes).expect_err("must be refused")
}

fn msg(e: &ConvertError) -> String {
    let m = e.to_string();
    assert!(m.starts_with("hostile.gguf: "), "names the file: {m}");
    m
}

#[test]
fn a_minimal_valid_file_parses() {
    let mut r = Raw::header(3, 2, 1);
    r.kv_u32("general.alignment", 32)
        .tensor("a", &[4, 2], 0, 0)
        .tensor("b", &[32], 8, 32)
        .data(32 + 34);
    let h = parse("ok.gguf", &r.0).unwrap();
    assert_eq!(h.tensors.len(), 2);
    assert_eq!(h.tensors[1].ggml_type.name, "Q8_0");
    assert_eq!(h.tensors[0].shape(), vec![2, 4]);
}

#[test]
fn bad_magic() {
    let e = err(b"GGML\x03\0\0\0");
    assert!(matches!(e, ConvertError::GgufBadMagic { .. }), "{e}");
    assert!(msg(&e).contains("not a GGUF file"));
}

#[test]
fn bad_version() {
    for v in [0u32, 1, 4, u32::MAX] {
        let e = err(&Raw::header(v, 0, 0).0);
        assert!(
            matches!(e, ConvertError::GgufVersion { version, byte_swapped: false, .. } if version == v),
            "{e}"
        );
    }
    let e = err(&Raw::header(3u32.swap_bytes(), 0, 0).0);
    assert!(msg(&e).contains("big-endian"), "{e}");
}

#[test]
fn absurd_tensor_count() {
    let e = err(&Raw::header(3, u64::MAX, 0).0);
    assert!(matches!(e, ConvertError::GgufLimit { .. }), "{e}");
    assert!(msg(&e).contains("tensor count"));
    // Within the limit but more than the bytes left can describe.
    let e = err(&Raw::header(3, 1000, 0).0);
    assert!(matches!(e, ConvertError::GgufTruncated { .. }), "{e}");
}

#[test]
fn absurd_kv_count() {
    let e = err(&Raw::header(3, 0, u64::MAX).0);
    assert!(matches!(e, ConvertError::GgufLimit { .. }), "{e}");
    let e = err(&Raw::header(3, 0, 1000).0);
    assert!(matches!(e, ConvertError::GgufTruncated { .. }), "{e}");
    assert!(msg(&e).contains("metadata count"));
}

#[test]
fn string_length_past_eof() {
    let mut r = Raw::header(3, 0, 1);
    r.u64(1 << 10).0.extend(b"general.name");
    let e = err(&r.0);
    assert!(matches!(e, ConvertError::GgufTruncated { .. }), "{e}");
    assert!(msg(&e).contains("metadata key #0"), "{e}");
    // A string value, not a key.
    let mut r = Raw::header(3, 0, 1);
    r.str("general.name").u32(8).u64(u64::MAX - 3);
    let e = err(&r.0);
    assert!(msg(&e).contains("`general.name`"), "{e}");
}

#[test]
fn unknown_value_type() {
    let mut r = Raw::header(3, 0, 1);
    r.str("general.x").u32(13).u32(0);
    let e = err(&r.0);
    assert!(matches!(e, ConvertError::GgufMalformed { .. }), "{e}");
    assert!(msg(&e).contains("unknown value type 13"), "{e}");
}

#[test]
fn nested_arrays() {
    let mut r = Raw::header(3, 0, 1);
    r.str("general.nested")
        .u32(9)
        .u32(9)
        .u64(1)
        .u32(4)
        .u64(1)
        .u32(7);
    let e = err(&r.0);
    assert!(matches!(e, ConvertError::GgufMalformed { .. }), "{e}");
    assert!(msg(&e).contains("nested arrays"), "{e}");
}

#[test]
fn absurd_array_length() {
    let mut r = Raw::header(3, 0, 1);
    r.str("tokenizer.ggml.tokens")
        .u32(9)
        .u32(8)
        .u64(u64::MAX / 2);
    let e = err(&r.0);
    assert!(matches!(e, ConvertError::GgufLimit { .. }), "{e}");
    let mut r = Raw::header(3, 0, 1);
    r.str("tokenizer.ggml.scores")
        .u32(9)
        .u32(6)
        .u64(1 << 20)
        .u32(0);
    let e = err(&r.0);
    assert!(matches!(e, ConvertError::GgufTruncated { .. }), "{e}");
}

#[test]
fn duplicate_key() {
    let mut r = Raw::header(3, 0, 2);
    r.kv_u32("llama.block_count", 1)
        .kv_u32("llama.block_count", 2);
    let e = err(&r.0);
    assert!(matches!(e, ConvertError::GgufMalformed { .. }), "{e}");
    assert!(msg(&e).contains("`llama.block_count` appears twice"), "{e}");
}

#[test]
fn invalid_utf8_and_bad_booleans() {
    let mut r = Raw::header(3, 0, 1);
    r.u64(2).0.extend([0xff, 0xfe]);
    r.u32(4).u32(0);
    assert!(msg(&err(&r.0)).contains("not UTF-8"));
    let mut r = Raw::header(3, 0, 1);
    r.str("tokenizer.ggml.add_bos_token").u32(7).0.push(2);
    assert!(msg(&err(&r.0)).contains("boolean byte 2"));
}

#[test]
fn bad_alignment() {
    for a in [0u32, 3, 48, 1 << 30] {
        let mut r = Raw::header(3, 0, 1);
        r.kv_u32("general.alignment", a);
        let e = err(&r.0);
        assert!(
            matches!(&e, ConvertError::GgufKey { key, .. } if key == "general.alignment"),
            "{e}"
        );
    }
}

#[test]
fn duplicate_tensor_names() {
    let mut r = Raw::header(3, 2, 0);
    r.tensor("w", &[8], 0, 0).tensor("w", &[8], 0, 32).data(64);
    let e = err(&r.0);
    assert!(
        matches!(&e, ConvertError::GgufTensor { tensor, .. } if tensor == "w"),
        "{e}"
    );
    assert!(msg(&e).contains("appears twice"), "{e}");
}

#[test]
fn tensor_data_out_of_bounds() {
    let mut r = Raw::header(3, 1, 0);
    r.tensor("w", &[8], 0, 0).data(31);
    let e = err(&r.0);
    assert!(matches!(e, ConvertError::GgufTensor { .. }), "{e}");
    assert!(msg(&e).contains("outside the file"), "{e}");
    let mut r = Raw::header(3, 1, 0);
    r.tensor("w", &[8], 0, u64::MAX - 31).data(32);
    assert!(msg(&err(&r.0)).contains("outside the file"));
}

#[test]
fn misaligned_offset() {
    let mut r = Raw::header(3, 1, 0);
    r.tensor("w", &[8], 0, 4).data(64);
    let e = err(&r.0);
    assert!(
        msg(&e).contains("not a multiple of the alignment 32"),
        "{e}"
    );
}

#[test]
fn overlapping_tensors() {
    let mut r = Raw::header(3, 2, 0);
    r.tensor("a", &[8], 0, 0).tensor("b", &[8], 0, 32).data(64);
    assert!(parse("ok.gguf", &r.0).is_ok());
    let mut r = Raw::header(3, 2, 0);
    r.tensor("a", &[16], 0, 96)
        .tensor("b", &[16], 0, 0)
        .data(160);
    assert!(parse("ok.gguf", &r.0).is_ok());
    let mut r = Raw::header(3, 2, 0);
    r.tensor("a", &[16], 0, 0)
        .tensor("b", &[16], 0, 32)
        .data(128);
    let e = err(&r.0);
    assert!(msg(&e).contains("overlaps tensor `a`"), "{e}");
}

#[test]
fn dims_overflow() {
    let mut r = Raw::header(3, 1, 0);
    r.tensor("w", &[1 << 40, 1 << 40], 0, 0).data(32);
    let e = err(&r.0);
    assert!(matches!(e, ConvertError::GgufTensor { .. }), "{e}");
    assert!(msg(&e).contains("overflow"), "{e}");
    let mut r = Raw::header(3, 1, 0);
    r.tensor("w", &[u64::MAX], 0, 0).data(32);
    assert!(msg(&err(&r.0)).contains("negative"));
    let mut r = Raw::header(3, 1, 0);
    r.tensor("w", &[1, 1, 1, 1, 1], 0, 0).data(32);
    assert!(msg(&err(&r.0)).contains("5 dimensions"));
    let mut r = Raw::header(3, 1, 0);
    r.tensor("w", &[33], 2, 0).data(64);
    assert!(msg(&err(&r.0)).contains("multiple of 32"));
}

/// K-quant and Q5 tensors: rows must be whole blocks (256 weights for a K-quant, 32 for Q5),
/// and a tensor's blocks must lie in the file; each error names the tensor and the type.
#[test]
fn k_quant_and_q5_tensors_of_the_wrong_size() {
    for (ty, name, block) in [
        (12u32, "Q4_K", 256u64),
        (13, "Q5_K", 256),
        (14, "Q6_K", 256),
        (6, "Q5_0", 32),
        (7, "Q5_1", 32),
    ] {
        // A row of 576 (Gemma 3 1B's width): 2¼ super-blocks; 48: 1½ Q5 blocks.
        let row = if block == 256 { 576 } else { 48 };
        let mut r = Raw::header(3, 1, 0);
        r.tensor("blk.0.ffn_down.weight", &[row, 2], ty, 0)
            .data(4096);
        let e = err(&r.0);
        assert!(matches!(e, ConvertError::GgufTensor { .. }), "{e}");
        let m = msg(&e);
        assert!(
            m.contains("blk.0.ffn_down.weight")
                && m.contains(name)
                && m.contains(&format!("multiple of {block}")),
            "{m}"
        );
        // Whole blocks, but one block's bytes short of the end of the file.
        let bytes = GgmlType::from_id(ty)
            .unwrap()
            .byte_len(&[block, 2])
            .unwrap() as usize;
        let mut r = Raw::header(3, 1, 0);
        r.tensor("blk.0.ffn_down.weight", &[block, 2], ty, 0)
            .data(bytes - 1);
        let e = err(&r.0);
        assert!(matches!(e, ConvertError::GgufTensor { .. }), "{e}");
        let m = msg(&e);
        assert!(
            m.contains("blk.0.ffn_down.weight") && m.contains("outside the file"),
            "{m}"
        );
    }
}

#[test]
fn unknown_ggml_type() {
    for ty in [4u32, 31, 40, u32::MAX] {
        let mut r = Raw::header(3, 1, 0);
        r.tensor("w", &[32], ty, 0).data(64);
        let e = err(&r.0);
        assert!(
            msg(&e).contains(&format!("unknown GGML type id {ty}")),
            "{e}"
        );
    }
}

#[test]
fn tensor_name_too_long() {
    let mut r = Raw::header(3, 1, 0);
    r.tensor(&"x".repeat(64), &[8], 0, 0).data(32);
    let e = err(&r.0);
    assert!(matches!(e, ConvertError::GgufLimit { .. }), "{e}");
}

#[test]
fn every_truncation_and_byte_flip_is_an_error_not_a_panic() {
    let mut r = Raw::header(3, 2, 3);
    r.kv_u32("general.alignment", 32)
        .str("general.architecture")
        .u32(8)
        .str("llama")
        .str("tokenizer.ggml.tokens")
        .u32(9)
        .u32(8)
        .u64(2)
        .str("a")
        .str("b")
        .tensor("token_embd.weight", &[32, 2], 8, 0)
        .tensor("output_norm.weight", &[32], 0, 96)
        .data(96 + 128);
    let full = r.0;
    assert!(parse("x", &full).is_ok());
    for n in 0..full.len() - 1 {
        let _ = parse("x", &full[..n]).expect_err("truncated");
    }
    for i in 0..full.len() {
        for bit in [0x01u8, 0x80, 0xff] {
            let mut b = full.clone();
            b[i] ^= bit;
            let _ = parse("x", &b);
        }
    }
}

fn import_err(b: GgufBuilder, data: Vec<Vec<u8>>) -> ConvertError {
    let tmp = tempfile::tempdir().unwrap();
    let input = tmp.path().join("in.gguf");
    b.write(&input, false, |i| Ok(data[i].clone().into()))
        .unwrap();
    let out = tmp.path().join("out.kiln");
    let e = import_gguf(
        &ImportOptions {
            input,
            output: out.clone(),
            overwrite: false,
            dequantize_to: DType::F16,
            dequantize_all: false,
            allow_non_finite: false,
        },
        &NoProgress,
    )
    .unwrap_err();
    assert!(!out.exists(), "nothing written on error");
    e
}

fn llama_keys(b: &mut GgufBuilder, arch: &str) {
    b.set("general.architecture", Value::Str(arch.into()));
    for (k, v) in [
        ("embedding_length", 32u32),
        ("block_count", 1),
        ("feed_forward_length", 64),
        ("attention.head_count", 2),
        ("context_length", 128),
    ] {
        b.set(&format!("{arch}.{k}"), Value::U32(v));
    }
    b.set(
        &format!("{arch}.attention.layer_norm_rms_epsilon"),
        Value::F32(1e-5),
    );
    b.set("tokenizer.ggml.model", Value::Str("gpt2".into()));
    b.set(
        "tokenizer.ggml.tokens",
        Value::Array(Array::Str((0..4).map(|i| format!("t{i}")).collect())),
    );
}

#[test]
fn unsupported_architecture_is_named() {
    let mut b = GgufBuilder::new();
    llama_keys(&mut b, "gemma2");
    let e = import_err(b, vec![]);
    assert!(
        matches!(e, ConvertError::UnsupportedArchitecture { .. }),
        "{e}"
    );
    let m = e.to_string();
    assert!(m.contains("`gemma2`") && m.contains("gemma3"), "{m}");
}

/// Gemma 3 metadata that Kiln cannot run as llama.cpp would is refused, naming the key: logit
/// soft-capping (not implemented), and a file without its attention window.
#[test]
fn gemma3_keys_kiln_cannot_honour_are_named() {
    let gemma = || {
        let mut b = GgufBuilder::new();
        llama_keys(&mut b, "gemma3");
        b.set("gemma3.attention.sliding_window", Value::U32(8));
        b
    };
    let mut b = gemma();
    b.set("gemma3.final_logit_softcapping", Value::F32(30.0));
    let e = import_err(b, vec![]);
    assert!(
        matches!(&e, ConvertError::GgufKey { key, .. } if key == "gemma3.final_logit_softcapping"),
        "{e}"
    );
    assert!(e.to_string().contains("soft-capping"), "{e}");

    let mut b = GgufBuilder::new();
    llama_keys(&mut b, "gemma3");
    let e = import_err(b, vec![]);
    assert!(
        matches!(&e, ConvertError::GgufKey { key, .. } if key == "gemma3.attention.sliding_window"),
        "{e}"
    );

    let mut b = gemma();
    b.set("gemma3.attention.sliding_window_pattern", Value::U32(0));
    let e = import_err(b, vec![]);
    assert!(
        matches!(&e, ConvertError::GgufKey { key, .. } if key == "gemma3.attention.sliding_window_pattern"),
        "{e}"
    );
}

#[test]
fn unsupported_tensor_type_is_named() {
    let mut b = GgufBuilder::new();
    llama_keys(&mut b, "llama");
    let iq2 = GgmlType::from_id(16).unwrap();
    b.add_tensor("token_embd.weight", vec![256, 4], iq2)
        .unwrap();
    let e = import_err(b, vec![vec![0; 4 * 66]]);
    assert!(matches!(e, ConvertError::UnsupportedGgufType { .. }), "{e}");
    assert!(e.to_string().contains("IQ2_XXS"), "{e}");
}

#[test]
fn unsupported_tokenizer_is_named() {
    let mut b = GgufBuilder::new();
    llama_keys(&mut b, "llama");
    b.set("tokenizer.ggml.model", Value::Str("t5".into()));
    let e = import_err(b, vec![]);
    assert!(
        matches!(e, ConvertError::UnsupportedTokenizer { .. }),
        "{e}"
    );
    assert!(e.to_string().contains("`t5`"), "{e}");
}

#[test]
fn missing_and_mistyped_keys_are_named() {
    let mut b = GgufBuilder::new();
    llama_keys(&mut b, "llama");
    b.set("llama.block_count", Value::Str("one".into()));
    let e = import_err(b, vec![]);
    assert!(
        matches!(&e, ConvertError::GgufKey { key, .. } if key == "llama.block_count"),
        "{e}"
    );
}

/// Regression: metadata that contradicts itself imported without a word, and the model ran
/// with one of the two readings. Each contradiction is now refused, naming the key.
#[test]
fn metadata_that_contradicts_itself_is_refused_naming_the_key() {
    let cases: [(&str, Value, &str); 4] = [
        // 32 / 2 heads = a head width of 16, but only 8 rotated dimensions.
        ("llama.rope.dimension_count", Value::U32(8), "rotated width"),
        (
            "llama.attention.value_length",
            Value::U32(8),
            "value head width",
        ),
        (
            "tokenizer.ggml.token_type",
            Value::Array(Array::I32(vec![1, 1, 9, 1])),
            "token 2 (`t2`) has type 9",
        ),
        (
            "llama.vocab_size",
            Value::U32(3),
            "more than the model's vocabulary of 3",
        ),
    ];
    for (key, value, says) in cases {
        let mut b = GgufBuilder::new();
        llama_keys(&mut b, "llama");
        b.set(key, value);
        let e = import_err(b, vec![]);
        let named = match &e {
            ConvertError::GgufKey { key: k, .. } => k.clone(),
            _ => String::new(),
        };
        let want = if key == "llama.vocab_size" {
            "tokenizer.ggml.tokens"
        } else {
            key
        };
        assert_eq!(named, want, "{e}");
        assert!(e.to_string().contains(says), "{key}: {e}");
    }
}

#[test]
fn metadata_that_agrees_with_itself_still_resolves() {
    // The same keys with consistent values get past the metadata checks: the import then
    // stops where the layers are counted against the tensors (none here).
    let mut b = GgufBuilder::new();
    llama_keys(&mut b, "llama");
    b.set("llama.rope.dimension_count", Value::U32(16));
    b.set("llama.attention.key_length", Value::U32(16));
    b.set("llama.attention.value_length", Value::U32(16));
    b.set(
        "tokenizer.ggml.token_type",
        Value::Array(Array::I32(vec![0, 1, 3, 6])),
    );
    let e = import_err(b, vec![]);
    assert!(
        matches!(&e, ConvertError::GgufKey { key, .. } if key == "llama.block_count"),
        "{e}"
    );
    assert!(e.to_string().contains("declares 0"), "{e}");
}

/// A GGUF file exported from the tiny `fixture`, with `edit` applied to its metadata (tensors
/// unchanged), at `dir/edited.gguf`.
fn edited_export(
    dir: &Path,
    fixture: &str,
    edit: impl FnOnce(&mut Vec<(String, Value)>),
) -> PathBuf {
    let kiln = dir.join("src.kiln");
    common::convert(&common::repo().join("fixtures/tiny").join(fixture), &kiln);
    let src = dir.join("src.gguf");
    export_gguf(
        &ExportOptions {
            input: kiln,
            output: src.clone(),
            overwrite: false,
        },
        &NoProgress,
    )
    .unwrap();
    let bytes = std::fs::read(&src).unwrap();
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
    let dst = dir.join("edited.gguf");
    b.write(&dst, false, |i| {
        Ok(read::tensor_bytes(&bytes, &h.tensors[i]).to_vec().into())
    })
    .unwrap();
    dst
}

fn set_key(meta: &mut Vec<(String, Value)>, key: &str, value: Value) {
    match meta.iter_mut().find(|(k, _)| k == key) {
        Some(slot) => slot.1 = value,
        None => meta.push((key.to_string(), value)),
    }
}

/// Regression: a GGUF whose values `kiln-run` refuses at open (`ModelConfig::check`) imported
/// with exit 0: a context or a sliding window of 2^32, a RoPE base of 1, an attention factor
/// of 1e150 (finite as an f64, infinite as the runner's f32). Import now runs the same check
/// before writing, naming the GGUF key, and writes nothing.
#[test]
fn values_every_reader_refuses_are_refused_at_import_naming_the_key() {
    type Edit = fn(&mut Vec<(String, Value)>);
    let cases: [(&str, Edit, &str); 4] = [
        (
            "llama-tied-f32",
            |m| set_key(m, "llama.context_length", Value::U64(1 << 32)),
            "llama.context_length",
        ),
        (
            "phi3-f32",
            |m| set_key(m, "phi3.attention.sliding_window", Value::U64(1 << 32)),
            "phi3.attention.sliding_window",
        ),
        (
            "llama-tied-f32",
            |m| set_key(m, "llama.rope.freq_base", Value::F32(1.0)),
            "llama.rope.freq_base",
        ),
        (
            "phi3-f32",
            |m| {
                // Kiln's own exact copy of the factors would disagree first: leave it out.
                m.retain(|(k, _)| k != "kiln.rope_scaling");
                set_key(m, "phi3.rope.scaling.attn_factor", Value::F64(1e150));
            },
            "phi3.rope.scaling.attn_factor",
        ),
    ];
    for (fixture, edit, key) in cases {
        let tmp = tempfile::tempdir().unwrap();
        let input = edited_export(tmp.path(), fixture, edit);
        let out = tmp.path().join("out.kiln");
        let e = import_gguf(
            &ImportOptions {
                input,
                output: out.clone(),
                overwrite: false,
                dequantize_to: DType::F16,
                dequantize_all: false,
                allow_non_finite: false,
            },
            &NoProgress,
        )
        .unwrap_err();
        assert!(
            matches!(&e, ConvertError::GgufKey { key: k, .. } if k == key),
            "{fixture} {key}: {e}"
        );
        assert!(e.to_string().contains("edited.gguf"), "{e}");
        assert!(!out.exists(), "nothing written on error");
    }
}

/// A layer count beyond the tensors the file declares is refused before anything is built
/// per layer, naming `<arch>.block_count` and both counts (Gemma 3 builds its per-layer
/// attention kinds while its configuration is resolved: the bound comes first there too).
#[test]
fn a_block_count_beyond_the_declared_tensors_is_refused_naming_both_counts() {
    let tmp = tempfile::tempdir().unwrap();
    let input = edited_export(tmp.path(), "llama-tied-f32", |m| {
        set_key(m, "llama.block_count", Value::U64(1 << 24))
    });
    let e = import_err_at(&input);
    assert!(
        matches!(&e, ConvertError::GgufKey { key, .. } if key == "llama.block_count"),
        "{e}"
    );
    let m = e.to_string();
    assert!(m.contains("16777216") && m.contains("declares 20"), "{m}");

    // Gemma 3: refused while the configuration is resolved, before the tokenizer (which
    // would refuse `t5`) and before the per-layer attention kinds are listed.
    let mut b = GgufBuilder::new();
    llama_keys(&mut b, "gemma3");
    b.set("gemma3.attention.sliding_window", Value::U32(8));
    b.set("gemma3.block_count", Value::U64(1 << 32));
    b.set("tokenizer.ggml.model", Value::Str("t5".into()));
    let e = import_err(b, vec![]);
    assert!(
        matches!(&e, ConvertError::GgufKey { key, .. } if key == "gemma3.block_count"),
        "{e}"
    );
    assert!(e.to_string().contains("4294967296"), "{e}");
}

fn import_err_at(input: &Path) -> ConvertError {
    let out = input.with_extension("kiln");
    let e = import_gguf(
        &ImportOptions {
            input: input.to_path_buf(),
            output: out.clone(),
            overwrite: false,
            dequantize_to: DType::F16,
            dequantize_all: false,
            allow_non_finite: false,
        },
        &NoProgress,
    )
    .unwrap_err();
    assert!(!out.exists(), "nothing written on error");
    e
}
