//! Decode-shaped matmul timer: the seven matrices of a SmolLM2-135M layer, repeated for 30
//! distinct layers (far more than the last-level cache holds), each multiplied by one token in
//! turn, as a decode step does. Prints the best of N passes as time per pass and the rate at
//! which weights were streamed from memory.
//!
//! `cargo run --release -p kiln-kernels --example decode_stream -- DTYPE THREADS [TOKENS]`
//! (DTYPE: f32, f16, bf16, q8_0, q4_0; `KILN_ISA=avx2|scalar` to pin a tier).

use std::time::Instant;

use kiln_kernels::{isa, matmul, Matrix, OwnedWeights, Pool};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: decode_stream DTYPE THREADS [TOKENS]";
    let dtype = args.first().expect(usage).as_str();
    let threads: usize = args.get(1).expect(usage).parse().expect(usage);
    let n_tokens: usize = args.get(2).map_or(1, |t| t.parse().expect(usage));
    // (rows, cols) of q, k, v, o, gate, up, down.
    let shapes = [
        (576, 576),
        (192, 576),
        (192, 576),
        (576, 576),
        (1536, 576),
        (1536, 576),
        (576, 1536),
    ];
    let layers = 30;
    let mut owned = Vec::new();
    for l in 0..layers {
        for (i, &(rows, cols)) in shapes.iter().enumerate() {
            let seed = (l * 7 + i) as u64;
            let w: Vec<f32> = (0..rows * cols)
                .map(|j| (((j as u64 * 7919 + seed * 104729) % 1000) as f32 - 500.0) * 1e-3)
                .collect();
            owned.push((
                rows,
                cols,
                OwnedWeights::encode(dtype, &w).expect("a known dtype, cols % 32 == 0"),
            ));
        }
    }
    let mats: Vec<Matrix> = owned
        .iter()
        .map(|(r, c, o)| Matrix::new(*r, *c, o.data()).expect("shape"))
        .collect();
    let bytes: usize = mats.iter().map(|m| m.data.byte_len()).sum();
    let macs: usize = mats.iter().map(|m| m.rows * m.cols * n_tokens).sum();
    let x: Vec<f32> = (0..1536 * n_tokens)
        .map(|i| ((i * 31 % 100) as f32 - 50.0) * 1e-2)
        .collect();
    let mut out = vec![0.0; 1536 * n_tokens];
    let pool = Pool::new(threads).expect("threads >= 1");
    let mut best = f64::MAX;
    for _ in 0..20 {
        let t = Instant::now();
        for m in &mats {
            matmul(
                m,
                &x[..m.cols * n_tokens],
                n_tokens,
                &mut out[..m.rows * n_tokens],
                &pool,
            );
        }
        best = best.min(t.elapsed().as_secs_f64());
    }
    println!(
        "{dtype:5} {layers} layers tokens={n_tokens} threads={threads} {:?}: {:8.3} ms  {:6.1} GB/s weights  {:6.1} GMAC/s",
        isa(),
        best * 1e3,
        bytes as f64 / best / 1e9,
        macs as f64 / best / 1e9
    );
}
