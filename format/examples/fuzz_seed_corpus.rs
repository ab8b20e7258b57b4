//! Writes the fuzzer's seed corpus: a few small valid `.kiln` files and truncated or damaged
//! variants of them, so that mutations start from inputs that reach deep into the reader.
//!
//! ```text
//! cargo run -p kiln-format --example fuzz_seed_corpus -- fuzz/corpus/reader
//! ```
//! The output is deterministic (fixed metadata, fixed tensor bytes), so re-running it leaves the
//! committed corpus unchanged.

use std::path::{Path, PathBuf};

use kiln_format::metadata::{Architecture, ModelConfig};
use kiln_format::{DType, KilnWriter, Metadata, TensorSpec, TokenizerFiles};

fn metadata(tokenizer: Option<&str>) -> Metadata {
    Metadata {
        config: ModelConfig {
            architecture: Architecture::Llama,
            source_architecture: "LlamaForCausalLM".into(),
            hidden_size: 64,
            intermediate_size: 128,
            num_layers: 1,
            num_heads: 4,
            num_kv_heads: 2,
            head_dim: 16,
            vocab_size: 4,
            max_position_embeddings: 128,
            rms_norm_eps: 1e-5,
            rope_theta: 10000.0,
            rope_scaling: None,
            tie_word_embeddings: true,
            attention_bias: false,
            sliding_window: None,
            bos_token_id: Some(0),
            eos_token_ids: vec![1],
            family: Default::default(),
        },
        tokenizer: TokenizerFiles {
            tokenizer_json: tokenizer.map(str::to_string),
            ..Default::default()
        },
        generation: serde_json::Value::Null,
        provenance: vec![],
    }
}

fn spec(name: &str, dtype: DType, shape: &[u64]) -> TensorSpec {
    TensorSpec {
        name: name.into(),
        dtype,
        shape: shape.to_vec(),
    }
}

/// Write a file and return its bytes.
fn write(dir: &Path, meta: &Metadata, specs: Vec<TensorSpec>) -> Vec<u8> {
    let path = dir.join(".seed.kiln");
    let w = KilnWriter::create(&path, meta, specs, true).expect("create");
    for i in 0..w.len() {
        let bytes: Vec<u8> = (0..w.tensor_len(i))
            .map(|k| (k as u8).wrapping_mul(37).wrapping_add(i as u8))
            .collect();
        w.write_tensor(i, &bytes).expect("write");
    }
    w.finish().expect("finish");
    let bytes = std::fs::read(&path).expect("read back");
    std::fs::remove_file(&path).expect("remove");
    bytes
}

fn main() {
    let out = PathBuf::from(
        std::env::args()
            .nth(1)
            .unwrap_or_else(|| "fuzz/corpus/reader".into()),
    );
    std::fs::create_dir_all(&out).expect("create the corpus directory");
    let tok = r#"{"model":{"type":"BPE","vocab":{"<s>":0,"</s>":1,"a":2,"b":3},"merges":[]}}"#;

    let empty = write(&out, &metadata(None), vec![]);
    let one = write(
        &out,
        &metadata(None),
        vec![spec("final_norm.weight", DType::F32, &[5])],
    );
    let all = write(
        &out,
        &metadata(Some(tok)),
        vec![
            spec("embed.weight", DType::F32, &[4, 5]),
            spec("layers.0.attn_norm.weight", DType::F16, &[7]),
            spec("layers.0.attn.q.weight", DType::Q8_0, &[2, 64]),
            spec("layers.0.attn.k.weight", DType::Q4_0, &[1, 32]),
            spec("layers.0.attn.v.weight", DType::Q4_0x16, &[16, 32]),
            spec("final_norm.weight", DType::BF16, &[3]),
        ],
    );

    // A tokenizer.json long enough to be packed (format 1.3), repetitive so that its zlib
    // stream, and so the seed, stays a few hundred bytes.
    let long_tok = format!(
        r#"{{"model":{{"type":"BPE","vocab":{{"<s>":0,"</s>":1,"a":2,"b":3}},"merges":[{}"a b"]}}}}"#,
        "\"a b\",".repeat(kiln_format::packed::PACK_MIN_LEN / 6)
    );
    let packed = write(
        &out,
        &metadata(Some(&long_tok)),
        vec![spec("final_norm.weight", DType::F32, &[5])],
    );
    let files_at = 128
        + u64::from_le_bytes(packed[24..32].try_into().expect("8 bytes")) as usize
        + u64::from_le_bytes(packed[40..48].try_into().expect("8 bytes")) as usize;
    let files_len = u64::from_le_bytes(packed[72..80].try_into().expect("8 bytes")) as usize;
    assert!(files_len > 0, "the long tokenizer is packed");

    let mut seeds: Vec<(String, Vec<u8>)> = vec![
        ("valid-no-tensors".into(), empty.clone()),
        ("valid-one-f32".into(), one),
        ("valid-all-dtypes".into(), all.clone()),
        ("valid-packed-tokenizer".into(), packed.clone()),
        (
            "truncated-files".into(),
            packed[..files_at + files_len / 2].to_vec(),
        ),
    ];
    let meta_len = u64::from_le_bytes(all[24..32].try_into().expect("8 bytes")) as usize;
    let data_offset = u64::from_le_bytes(all[48..56].try_into().expect("8 bytes")) as usize;
    for (what, cut) in [
        ("magic", 5),
        ("header", 100),
        ("metadata", 128 + meta_len / 2),
        ("index", 128 + meta_len + 20),
        ("data", data_offset + 40),
        ("last-byte", all.len() - 1),
    ] {
        seeds.push((format!("truncated-{what}"), all[..cut].to_vec()));
    }
    let mut trailing = empty;
    trailing.push(0);
    seeds.push(("trailing-byte".into(), trailing));

    for (name, bytes) in seeds {
        let path = out.join(format!("{name}.kiln"));
        std::fs::write(&path, &bytes).expect("write a seed");
        println!("{} ({} bytes)", path.display(), bytes.len());
    }
}
