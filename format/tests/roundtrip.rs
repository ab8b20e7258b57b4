//! Writer → reader round trips on arbitrary tensors and metadata.

use kiln_format::metadata::{Architecture, ModelConfig};
use kiln_format::{DType, KilnFile, KilnWriter, Metadata, TensorSpec};
use proptest::prelude::*;

pub fn sample_metadata() -> Metadata {
    Metadata {
        config: ModelConfig {
            architecture: Architecture::Llama,
            source_architecture: "LlamaForCausalLM".into(),
            hidden_size: 64,
            intermediate_size: 128,
            num_layers: 2,
            num_heads: 4,
            num_kv_heads: 2,
            head_dim: 16,
            vocab_size: 320,
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
        provenance: vec![],
    }
}

fn arb_tensor() -> impl Strategy<Value = (DType, Vec<u64>, u64)> {
    (
        prop::sample::select(DType::ALL.to_vec()),
        prop::collection::vec(1u64..5, 1..4),
        any::<u64>(),
    )
        .prop_map(|(dtype, mut shape, seed)| {
            if dtype.rows_per_unit() > 1 {
                // A matrix of whole sixteen-row groups.
                shape = vec![
                    16 * shape[0],
                    dtype.logical().block_len() as u64 * shape.last().unwrap(),
                ];
            } else if dtype.is_quantized() {
                // Whole blocks a row: 32 weights, 256 for the K-quants.
                *shape.last_mut().unwrap() *= dtype.block_len() as u64;
            }
            (dtype, shape, seed)
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    #[test]
    fn arbitrary_files_round_trip(tensors in prop::collection::vec(arb_tensor(), 0..6), eps in 1e-7f64..1e-3) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.kiln");
        let mut meta = sample_metadata();
        meta.config.rms_norm_eps = eps;
        let specs: Vec<TensorSpec> = tensors.iter().enumerate().map(|(i, (d, s, _))| TensorSpec {
            name: format!("t{i}"), dtype: *d, shape: s.clone(),
        }).collect();
        let w = KilnWriter::create(&path, &meta, specs.clone(), false).unwrap();
        let mut datas = Vec::new();
        for (i, (_, _, seed)) in tensors.iter().enumerate() {
            let n = w.tensor_len(i) as usize;
            let data: Vec<u8> = (0..n).map(|k| (seed.wrapping_mul(k as u64 + 1) >> 7) as u8).collect();
            // Write in two chunks to exercise the sink.
            let mut sink = w.tensor_sink(i).unwrap();
            sink.write(&data[..n / 2]).unwrap();
            sink.write(&data[n / 2..]).unwrap();
            sink.finish().unwrap();
            datas.push(data);
        }
        w.finish().unwrap();
        let f = KilnFile::open(&path).unwrap();
        // 1.1 added q4_0x16, 1.2 the Q5 and K-quant types, 1.4 Q2_K, Q3_K and the IQ4 types,
        // 1.6 iq4_nlx16, 1.7 iq4_xsx16; a file is written with the lowest.
        let minor = tensors
            .iter()
            .map(|(d, _, _)| match d {
                DType::Q4_0x16 => 1,
                DType::Q5_0 | DType::Q5_1 | DType::Q4_K | DType::Q5_K | DType::Q6_K => 2,
                DType::Q2_K | DType::Q3_K | DType::IQ4_NL | DType::IQ4_XS => 4,
                DType::IQ4_NLx16 => 6,
                DType::IQ4_XSx16 => 7,
                _ => 0,
            })
            .max()
            .unwrap_or(0);
        prop_assert_eq!(f.version(), (1, minor));
        prop_assert_eq!(f.metadata(), &meta);
        prop_assert_eq!(f.tensors().len(), specs.len());
        for (i, spec) in specs.iter().enumerate() {
            let v = f.tensor(&spec.name).unwrap();
            prop_assert_eq!(v.dtype(), spec.dtype);
            prop_assert_eq!(v.shape(), &spec.shape[..]);
            prop_assert_eq!(v.bytes(), &datas[i][..]);
            prop_assert_eq!(v.bytes().as_ptr() as usize % 64, 0);
        }
        prop_assert!(f.verify_checksums(&|_: u64| ()).is_empty());
        // Only the destination is left in the directory: no temporary files.
        prop_assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }
}
