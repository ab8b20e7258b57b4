//! Min-of-N matmul timer: on a shared, noisy machine the fastest of many runs is a steadier
//! estimate of what the kernel can do than criterion's mean.
//!
//! `cargo run --release -p kiln-kernels --example matmul_min -- ROWS COLS TOKENS THREADS`
//! (`KILN_ISA=avx2|scalar` to pin a tier).

use std::time::Instant;

use kiln_kernels::{bf16, f16, isa, matmul, Matrix, Pool, WeightData};

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| {
            a.parse()
                .expect("usage: matmul_min ROWS COLS TOKENS THREADS")
        })
        .collect();
    let [rows, cols, n_tokens, threads] = args[..] else {
        panic!("usage: matmul_min ROWS COLS TOKENS THREADS");
    };
    let w: Vec<f32> = (0..rows * cols)
        .map(|i| ((i * 7919 % 1000) as f32 - 500.0) * 1e-3)
        .collect();
    let x: Vec<f32> = (0..cols * n_tokens)
        .map(|i| ((i * 31 % 100) as f32 - 50.0) * 1e-2)
        .collect();
    let h: Vec<f16> = w.iter().map(|&v| f16::from_f32(v)).collect();
    let b: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
    let q8 = kiln_format::blocks::quantize_row_q8_0_ref(&w).expect("cols % 32 == 0");
    let q4 = kiln_format::blocks::quantize_row_q4_0_ref(&w).expect("cols % 32 == 0");
    let pool = Pool::new(threads).expect("threads >= 1");
    let mut out = vec![0.0; rows * n_tokens];
    let datas = [
        ("f32", WeightData::F32(&w)),
        ("f16", WeightData::F16(&h)),
        ("bf16", WeightData::BF16(&b)),
        ("q8_0", WeightData::Q8_0(&q8)),
        ("q4_0", WeightData::Q4_0(&q4)),
    ];
    for (name, data) in datas {
        let m = Matrix::new(rows, cols, data).expect("shape");
        let reps = (200_000_000 / (rows * cols * n_tokens)).clamp(10, 5000);
        let mut best = f64::MAX;
        for _ in 0..reps {
            let t = Instant::now();
            matmul(&m, &x, n_tokens, &mut out, &pool);
            best = best.min(t.elapsed().as_secs_f64());
        }
        println!(
            "{name:5} {rows}x{cols} tokens={n_tokens} threads={threads} {:?}: {:9.1} us  {:6.1} GB/s weights  {:6.1} GMAC/s",
            isa(),
            best * 1e6,
            m.data.byte_len() as f64 / best / 1e9,
            (rows * cols * n_tokens) as f64 / best / 1e9
        );
    }
}
