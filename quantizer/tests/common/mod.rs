//! A tiny Llama-shaped `.kiln` written with the format crate's writer, for the file and CLI
//! tests. Two layers, hidden 64, intermediate 48 (so `mlp.down.weight` rows of 48 values do not
//! fit 32-value blocks and exercise the F16 fallback), vocabulary 96, tied embeddings.

#![allow(dead_code)]

use std::path::Path;

use half::bf16;
use kiln_format::{
    Architecture, DType, KilnWriter, Metadata, ModelConfig, ProvenanceStep, TensorSpec,
};

pub const HIDDEN: u64 = 64;
pub const INTER: u64 = 48;
pub const VOCAB: u64 = 96;
pub const LAYERS: u32 = 2;

pub fn metadata() -> Metadata {
    Metadata {
        config: ModelConfig {
            architecture: Architecture::Llama,
            source_architecture: "LlamaForCausalLM".into(),
            hidden_size: HIDDEN,
            intermediate_size: INTER,
            num_layers: LAYERS as u64,
            num_heads: 4,
            num_kv_heads: 2,
            head_dim: 16,
            vocab_size: VOCAB,
            max_position_embeddings: 256,
            rms_norm_eps: 1e-5,
            rope_theta: 10000.0,
            rope_scaling: None,
            tie_word_embeddings: true,
            attention_bias: false,
            sliding_window: None,
            bos_token_id: Some(1),
            eos_token_ids: vec![2],
            family: Default::default(),
        },
        tokenizer: Default::default(),
        generation: serde_json::Value::Null,
        provenance: vec![ProvenanceStep {
            tool: "kiln-convert 0.1.0".into(),
            created: "2025-01-01T00:00:00Z".into(),
            details: serde_json::json!({"conversion": "test"}),
            sources: vec![],
        }],
    }
}

/// Every tensor of the tiny model: (name, shape).
pub fn shapes() -> Vec<(String, Vec<u64>)> {
    let mut t = vec![
        ("embed.weight".to_string(), vec![VOCAB, HIDDEN]),
        ("final_norm.weight".to_string(), vec![HIDDEN]),
    ];
    for l in 0..LAYERS {
        for (suffix, shape) in [
            ("attn_norm.weight", vec![HIDDEN]),
            ("attn.q.weight", vec![HIDDEN, HIDDEN]),
            ("attn.k.weight", vec![32, HIDDEN]),
            ("attn.v.weight", vec![32, HIDDEN]),
            ("attn.o.weight", vec![HIDDEN, HIDDEN]),
            ("mlp_norm.weight", vec![HIDDEN]),
            ("mlp.gate.weight", vec![INTER, HIDDEN]),
            ("mlp.up.weight", vec![INTER, HIDDEN]),
            ("mlp.down.weight", vec![HIDDEN, INTER]),
        ] {
            t.push((format!("layers.{l}.{suffix}"), shape));
        }
    }
    t
}

/// Deterministic weight-like values (roughly normal, scale 0.05) for tensor number `seed`.
pub fn values(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            let mut acc = 0.0f32;
            for _ in 0..4 {
                s ^= s >> 12;
                s ^= s << 25;
                s ^= s >> 27;
                acc += (s.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 40) as f32 / (1u64 << 24) as f32;
            }
            (acc - 2.0) * 0.05
        })
        .collect()
}

/// Write the tiny model with matrices in `dtype` (F32 or BF16; vectors F32) and let `edit`
/// change tensor values (by name) before they are written.
pub fn write_model(path: &Path, dtype: DType, edit: impl Fn(&str, &mut Vec<f32>)) {
    let shapes = shapes();
    let specs: Vec<TensorSpec> = shapes
        .iter()
        .map(|(name, shape)| TensorSpec {
            name: name.clone(),
            dtype: if shape.len() == 1 { DType::F32 } else { dtype },
            shape: shape.clone(),
        })
        .collect();
    let w = KilnWriter::create(path, &metadata(), specs.clone(), false).unwrap();
    for (i, spec) in specs.iter().enumerate() {
        let n = spec.shape.iter().product::<u64>() as usize;
        let mut v = values(i as u64 + 1, n);
        if spec.shape.len() == 1 {
            v.iter_mut().for_each(|x| *x += 1.0); // norm-like
        }
        edit(&spec.name, &mut v);
        let bytes: Vec<u8> = match spec.dtype {
            DType::F32 => bytemuck::cast_slice(&v).to_vec(),
            DType::BF16 => v
                .iter()
                .flat_map(|x| bf16::from_f32(*x).to_le_bytes())
                .collect(),
            d => panic!("test models hold f32/bf16, not {d}"),
        };
        w.write_tensor(i, &bytes).unwrap();
    }
    w.finish().unwrap();
}

/// Files in `dir` (to check that no temporary or partial output is left behind).
pub fn files_in(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}
