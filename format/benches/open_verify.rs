//! Opening and verifying a ~256 MB `.kiln` file.
//!
//! - `open`: memory-map and validate (header, metadata, index, padding); tensor data is not read,
//!   so this should be nearly independent of the file's size.
//! - `verify_checksums`: sha256 of every tensor, in parallel over the rayon pool.
//!
//! Throughput is reported in bytes of the whole file (`open`) and of tensor data (`verify`).
//! The file is written once per run into a temporary directory. Set `KILN_BENCH_MB` to change its
//! size, e.g. `KILN_BENCH_MB=32 cargo bench -p kiln-format -- --quick` for a short check.

use std::hint::black_box;
use std::path::Path;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kiln_format::metadata::{Architecture, ModelConfig};
use kiln_format::{DType, KilnFile, KilnWriter, Metadata, TensorSpec};

const DEFAULT_MB: u64 = 256;

fn metadata() -> Metadata {
    Metadata {
        config: ModelConfig {
            architecture: Architecture::Llama,
            source_architecture: "LlamaForCausalLM".into(),
            hidden_size: 2048,
            intermediate_size: 8192,
            num_layers: 4,
            num_heads: 32,
            num_kv_heads: 8,
            head_dim: 64,
            vocab_size: 32768,
            max_position_embeddings: 8192,
            rms_norm_eps: 1e-5,
            rope_theta: 500000.0,
            rope_scaling: None,
            tie_word_embeddings: false,
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

/// One large f16 tensor holding about half the file, then per-layer tensors of every dtype.
fn specs(total_mb: u64) -> Vec<TensorSpec> {
    let hidden = 2048u64;
    let big_rows = (total_mb << 20) / 2 / (hidden * 2);
    let mut v = vec![TensorSpec {
        name: "embed.weight".into(),
        dtype: DType::F16,
        shape: vec![big_rows.max(1), hidden],
    }];
    // The rest, split over 4 layers of 4 tensors each (f32, bf16, q8_0, q4_0).
    let per = (total_mb << 20) / 2 / 16;
    for layer in 0..4 {
        for (name, dtype) in [
            ("attn_norm.weight", DType::F32),
            ("attn.q.weight", DType::BF16),
            ("mlp.up.weight", DType::Q8_0),
            ("mlp.down.weight", DType::Q4_0),
        ] {
            let row_bytes = dtype.byte_len(&[1, hidden]).expect("valid");
            v.push(TensorSpec {
                name: format!("layers.{layer}.{name}"),
                dtype,
                shape: vec![(per / row_bytes).max(1), hidden],
            });
        }
    }
    v
}

fn write_file(path: &Path, total_mb: u64) -> u64 {
    let w = KilnWriter::create(path, &metadata(), specs(total_mb), true).expect("create");
    let chunk: Vec<u8> = (0..1u32 << 20)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8)
        .collect();
    for i in 0..w.len() {
        let mut sink = w.tensor_sink(i).expect("sink");
        let mut left = w.tensor_len(i) as usize;
        while left > 0 {
            let n = left.min(chunk.len());
            sink.write(&chunk[..n]).expect("write");
            left -= n;
        }
        sink.finish().expect("finish tensor");
    }
    w.finish().expect("finish").file_len
}

fn bench(c: &mut Criterion) {
    let mb = std::env::var("KILN_BENCH_MB")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(DEFAULT_MB);
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("bench.kiln");
    let file_len = write_file(&path, mb);
    let data_len = KilnFile::open(&path).expect("open").data_len();
    eprintln!(
        "bench file: {file_len} bytes, {data_len} bytes of tensor data, {} tensors",
        specs(mb).len()
    );

    let mut g = c.benchmark_group("kiln_file");
    g.throughput(Throughput::Bytes(file_len));
    g.bench_function("open", |b| {
        b.iter(|| black_box(KilnFile::open(&path).expect("open")))
    });

    let f = KilnFile::open(&path).expect("open");
    g.throughput(Throughput::Bytes(data_len));
    g.sample_size(10);
    g.measurement_time(Duration::from_secs(10));
    g.bench_function("verify_checksums", |b| {
        b.iter(|| {
            let failures = f.verify_checksums(&|_| {});
            assert!(failures.is_empty());
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
