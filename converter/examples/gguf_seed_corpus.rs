//! Writes the seed corpus of the `gguf` fuzz target: small valid GGUF files covering every
//! value type, the tokenizer keys and tensors of kept and dequantized types.
//!
//! `cargo run -p kiln-convert --example gguf_seed_corpus -- fuzz/corpus/gguf`

use std::path::PathBuf;

use kiln_convert::gguf::{Array, GgmlType, GgufBuilder, Value};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = PathBuf::from(
        std::env::args()
            .nth(1)
            .ok_or("usage: gguf_seed_corpus DIR")?,
    );
    std::fs::create_dir_all(&dir)?;

    let mut empty = GgufBuilder::new();
    empty.set("general.architecture", Value::Str("llama".into()));
    write(&dir, "valid-no-tensors.gguf", &empty)?;

    let mut kv = GgufBuilder::new();
    for (k, v) in [
        ("a.u8", Value::U8(1)),
        ("a.i8", Value::I8(-1)),
        ("a.u16", Value::U16(2)),
        ("a.i16", Value::I16(-2)),
        ("a.u32", Value::U32(3)),
        ("a.i32", Value::I32(-3)),
        ("a.f32", Value::F32(0.5)),
        ("a.bool", Value::Bool(true)),
        ("a.str", Value::Str("s".into())),
        ("a.u64", Value::U64(4)),
        ("a.i64", Value::I64(-4)),
        ("a.f64", Value::F64(0.25)),
        ("a.arr", Value::Array(Array::I32(vec![1, 2, 3]))),
    ] {
        kv.set(k, v);
    }
    write(&dir, "valid-every-value-type.gguf", &kv)?;

    let mut tok = GgufBuilder::new();
    tok.set("tokenizer.ggml.model", Value::Str("gpt2".into()));
    tok.set("tokenizer.ggml.pre", Value::Str("smollm".into()));
    tok.set(
        "tokenizer.ggml.tokens",
        Value::Array(Array::Str(vec![
            "<s>".into(),
            "a".into(),
            "b".into(),
            "ab".into(),
        ])),
    );
    tok.set(
        "tokenizer.ggml.token_type",
        Value::Array(Array::I32(vec![3, 1, 1, 1])),
    );
    tok.set(
        "tokenizer.ggml.merges",
        Value::Array(Array::Str(vec!["a b".into()])),
    );
    tok.set("tokenizer.ggml.bos_token_id", Value::U32(0));
    tok.set("tokenizer.chat_template", Value::Str("{{ x }}".into()));
    write(&dir, "valid-tokenizer.gguf", &tok)?;

    for (id, name) in [
        (0u32, "f32"),
        (8, "q8_0"),
        (2, "q4_0"),
        (3, "q4_1"),
        (12, "q4_k"),
        (14, "q6_k"),
    ] {
        let ty = GgmlType::from_id(id).ok_or("known type")?;
        let mut b = GgufBuilder::new();
        b.add_tensor("blk.0.attn_q.weight", vec![ty.block_len.max(32), 2], ty)?;
        b.add_tensor(
            "output_norm.weight",
            vec![8],
            GgmlType::from_id(0).ok_or("f32")?,
        )?;
        write(&dir, &format!("valid-tensors-{name}.gguf"), &b)?;
    }
    Ok(())
}

fn write(
    dir: &std::path::Path,
    name: &str,
    b: &GgufBuilder,
) -> Result<(), Box<dyn std::error::Error>> {
    // Deterministic bytes; every 0x3c byte pair is a small f16, so block scales stay finite.
    b.write(&dir.join(name), true, |i| {
        let n = b.tensor_len(i).unwrap_or(0) as usize;
        Ok((0..n)
            .map(|j| if j % 2 == 1 { 0x3c } else { j as u8 })
            .collect::<Vec<u8>>()
            .into())
    })?;
    Ok(())
}
