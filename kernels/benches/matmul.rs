//! Matmul throughput on SmolLM2-135M shapes, per weight encoding, at 1 and 2 threads.
//!
//! Throughput is reported as bytes of weights streamed per second (criterion's "GB/s" is
//! 10^9 bytes): a matvec reads every weight once, so this is the number to compare with the
//! memory bandwidth. Prefill (128 tokens) is compute-bound and reports multiply-adds per
//! second instead (criterion's "elem/s": rows × cols × tokens per call).
//!
//! Run: `cargo bench -p kiln-kernels --bench matmul [-- FILTER]`; `KILN_ISA=avx2` to pin a tier.

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kiln_kernels::{matmul, Matrix, OwnedWeights, Pool};

const DTYPES: [&str; 5] = OwnedWeights::DTYPES;

fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.2
        })
        .collect()
}

fn bench_shape(c: &mut Criterion, name: &str, rows: usize, cols: usize, n_tokens: usize) {
    let w = values(rows * cols, 1);
    let x = values(cols * n_tokens, 2);
    let mut out = vec![0.0; rows * n_tokens];
    let mut group = c.benchmark_group(format!("{name}/{rows}x{cols}/t{n_tokens}"));
    group
        .sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1));
    for dtype in DTYPES {
        let owned = OwnedWeights::encode(dtype, &w).expect("a known dtype");
        let m = Matrix::new(rows, cols, owned.data()).unwrap();
        // Matvec: weight bytes per second. Prefill: multiply-adds per second ("elem/s").
        group.throughput(if n_tokens == 1 {
            Throughput::Bytes(m.data.byte_len() as u64)
        } else {
            Throughput::Elements((rows * cols * n_tokens) as u64)
        });
        for threads in [1, 2] {
            let pool = Pool::new(threads).unwrap();
            group.bench_with_input(
                BenchmarkId::new(dtype, format!("{threads}thr")),
                &threads,
                |b, _| b.iter(|| matmul(&m, black_box(&x), n_tokens, &mut out, &pool)),
            );
        }
    }
    group.finish();
}

fn matvec(c: &mut Criterion) {
    eprintln!("kiln-kernels tier: {:?}", kiln_kernels::isa());
    bench_shape(c, "matvec", 1536, 576, 1);
    bench_shape(c, "matvec", 576, 1536, 1);
    bench_shape(c, "matvec", 49152, 576, 1);
}

fn prefill(c: &mut Criterion) {
    bench_shape(c, "prefill", 1536, 576, 128);
}

criterion_group!(benches, matvec, prefill);
criterion_main!(benches);
