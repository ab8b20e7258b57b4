//! Cross-check of the Q2_K…Q6_K, Q5_0, Q5_1, IQ4_NL and IQ4_XS quantizers against GGML itself.
//!
//! PyPI's `gguf` has no K-quant quantizer, so the expected blocks come from GGML's own
//! `quantize_row_*_ref`, called by `tests/vectors/ggml_kquants.c` linked against llama.cpp's
//! `libggml-base` (`tests/vectors/make_kquant_vectors.sh`; sources and checksums in
//! `kquant_manifest.json`, what each range of inputs exercises in `kquant_groups.json`). Every
//! block must match byte for byte, through the format crate's references (the specification)
//! and through the quantizer's row conversion (what `kiln-quantize` writes).

use kiln_format::blocks::QK;
use kiln_format::kquants::{
    quantize_row_q4_k_ref, quantize_row_q5_k_ref, quantize_row_q6_k_ref, QK_K,
};
use kiln_format::q5::{quantize_row_q5_0_ref, quantize_row_q5_1_ref};
use kiln_format::DType;
use kiln_quantize::rows::{convert_rows, ValueError};
use kiln_quantize::{ErrorStats, Method};

const KQ_INPUT: &[u8] = include_bytes!("vectors/kquant_input.f32");
const INPUT: &[u8] = include_bytes!("vectors/input.f32");

fn floats(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|e| f32::from_le_bytes([e[0], e[1], e[2], e[3]]))
        .collect()
}

/// Indices of the blocks (of `block_bytes` each) where `got` and `want` differ.
fn mismatches(got: &[u8], want: &[u8], block_bytes: usize) -> Vec<usize> {
    assert_eq!(got.len(), want.len(), "byte lengths");
    got.chunks_exact(block_bytes)
        .zip(want.chunks_exact(block_bytes))
        .enumerate()
        .filter(|(_, (g, w))| g != w)
        .map(|(i, _)| i)
        .collect()
}

/// The quantizer's own path: whole rows through `convert_rows`, rows of `cols` values.
fn quantizer_bytes(x: &[f32], cols: usize, dtype: DType) -> Vec<u8> {
    let mut out = Vec::new();
    let mut stats = ErrorStats::default();
    convert_rows(
        x,
        cols,
        dtype,
        Method::Reference,
        None,
        &mut out,
        &mut stats,
    )
    .unwrap_or_else(|e| panic!("{dtype}: {e:?}"));
    out
}

fn check(name: &str, x: &[f32], dtype: DType, spec: Vec<u8>, want: &[u8]) {
    let block = dtype.block_bytes();
    let bad = mismatches(&spec, want, block);
    assert!(
        bad.is_empty(),
        "{name}: format reference differs from GGML in blocks {bad:?}"
    );
    // Rows of 512 (two super-blocks) and the whole input, so row boundaries are exercised too.
    for cols in [x.len(), 512] {
        if x.len().is_multiple_of(cols) {
            let got = quantizer_bytes(x, cols, dtype);
            let bad = mismatches(&got, want, block);
            assert!(
                bad.is_empty(),
                "{name} (rows of {cols}): quantizer differs from GGML in blocks {bad:?}"
            );
        }
    }
}

/// Q5 blocks one row each: every block is GGML's, except those whose f16 scale or minimum
/// overflows in GGML (infinity in its bytes), which the quantizer refuses instead.
fn check_q5_rows(name: &str, x: &[f32], dtype: DType, want: &[u8]) {
    let mut refused = 0;
    for (i, (xb, w)) in x
        .chunks_exact(QK)
        .zip(want.chunks_exact(dtype.block_bytes()))
        .enumerate()
    {
        let mut out = Vec::new();
        let mut stats = ErrorStats::default();
        let r = convert_rows(xb, QK, dtype, Method::Reference, None, &mut out, &mut stats);
        let halves = if dtype == DType::Q5_1 { 2 } else { 1 };
        let ggml_overflows = w[..2 * halves]
            .chunks_exact(2)
            .any(|h| half::f16::from_le_bytes([h[0], h[1]]).is_infinite());
        match r {
            Err(ValueError::ScaleOverflow { position: 0, .. }) if ggml_overflows => refused += 1,
            Ok(()) => assert_eq!(out, w, "{name}: block {i}"),
            other => panic!("{name}: block {i}: {other:?} (GGML overflows: {ggml_overflows})"),
        }
    }
    assert!(
        refused > 0,
        "{name}: the vectors hold blocks whose scale overflows"
    );
}

#[test]
fn vectors_have_the_expected_sizes() {
    let n = KQ_INPUT.len() / 4 / QK_K;
    assert!(n >= 40, "{n} super-blocks");
    assert_eq!(KQ_INPUT.len(), n * QK_K * 4);
    assert_eq!(include_bytes!("vectors/kq_q4_k.bin").len(), n * 144);
    assert_eq!(include_bytes!("vectors/kq_q5_k.bin").len(), n * 176);
    assert_eq!(include_bytes!("vectors/kq_q6_k.bin").len(), n * 210);
    assert_eq!(include_bytes!("vectors/kq_q5_0.bin").len(), n * 8 * 22);
    assert_eq!(include_bytes!("vectors/kq_q5_1.bin").len(), n * 8 * 24);
    assert_eq!(include_bytes!("vectors/kq_q2_k.bin").len(), n * 84);
    assert_eq!(include_bytes!("vectors/kq_q3_k.bin").len(), n * 110);
    assert_eq!(include_bytes!("vectors/kq_iq4_nl.bin").len(), n * 8 * 18);
    assert_eq!(include_bytes!("vectors/kq_iq4_xs.bin").len(), n * 136);
    let m = INPUT.len() / 4 / QK;
    assert_eq!(include_bytes!("vectors/q5_0.bin").len(), m * 22);
    assert_eq!(include_bytes!("vectors/q5_1.bin").len(), m * 24);
}

#[test]
fn q4_k_reference_matches_ggml_bit_for_bit() {
    let x = floats(KQ_INPUT);
    let spec = bytemuck::cast_slice(&quantize_row_q4_k_ref(&x).unwrap()).to_vec();
    check(
        "q4_k",
        &x,
        DType::Q4_K,
        spec,
        include_bytes!("vectors/kq_q4_k.bin"),
    );
}

#[test]
fn q5_k_reference_matches_ggml_bit_for_bit() {
    let x = floats(KQ_INPUT);
    let spec = bytemuck::cast_slice(&quantize_row_q5_k_ref(&x).unwrap()).to_vec();
    check(
        "q5_k",
        &x,
        DType::Q5_K,
        spec,
        include_bytes!("vectors/kq_q5_k.bin"),
    );
}

#[test]
fn q6_k_reference_matches_ggml_bit_for_bit() {
    let x = floats(KQ_INPUT);
    let spec = bytemuck::cast_slice(&quantize_row_q6_k_ref(&x).unwrap()).to_vec();
    check(
        "q6_k",
        &x,
        DType::Q6_K,
        spec,
        include_bytes!("vectors/kq_q6_k.bin"),
    );
}

#[test]
fn q5_0_reference_matches_ggml_bit_for_bit() {
    for (name, input, want) in [
        (
            "kquant input",
            KQ_INPUT,
            &include_bytes!("vectors/kq_q5_0.bin")[..],
        ),
        ("q4_0 input", INPUT, &include_bytes!("vectors/q5_0.bin")[..]),
    ] {
        let x = floats(input);
        let spec = bytemuck::cast_slice(&quantize_row_q5_0_ref(&x).unwrap()).to_vec();
        let bad = mismatches(&spec, want, DType::Q5_0.block_bytes());
        assert!(
            bad.is_empty(),
            "q5_0, {name}: format reference differs from GGML in blocks {bad:?}"
        );
        if input == KQ_INPUT {
            check(&format!("q5_0, {name}"), &x, DType::Q5_0, spec, want);
        } else {
            check_q5_rows(&format!("q5_0, {name}"), &x, DType::Q5_0, want);
        }
    }
}

#[test]
fn q5_1_reference_matches_ggml_bit_for_bit() {
    for (name, input, want) in [
        (
            "kquant input",
            KQ_INPUT,
            &include_bytes!("vectors/kq_q5_1.bin")[..],
        ),
        ("q4_0 input", INPUT, &include_bytes!("vectors/q5_1.bin")[..]),
    ] {
        let x = floats(input);
        let spec = bytemuck::cast_slice(&quantize_row_q5_1_ref(&x).unwrap()).to_vec();
        let bad = mismatches(&spec, want, DType::Q5_1.block_bytes());
        assert!(
            bad.is_empty(),
            "q5_1, {name}: format reference differs from GGML in blocks {bad:?}"
        );
        if input == KQ_INPUT {
            check(&format!("q5_1, {name}"), &x, DType::Q5_1, spec, want);
        } else {
            check_q5_rows(&format!("q5_1, {name}"), &x, DType::Q5_1, want);
        }
    }
}

const IMATRIX: &[u8] = include_bytes!("vectors/kquant_imatrix.f32");
/// The weighted vectors quantize `kquant_input.f32` as rows of this many values.
const ROW: usize = 1024;

/// GGML's `quantize_<type>` with an importance matrix against the format crate's weighted
/// quantizers (`spec`, row by row) and the quantizer's row conversion with importance.
fn check_weighted(dtype: DType, spec: impl Fn(&[f32], &[f32]) -> Vec<u8>, want: &[u8]) {
    let x = floats(KQ_INPUT);
    let w = floats(IMATRIX);
    assert_eq!(w.len(), ROW);
    let ours: Vec<u8> = x.chunks_exact(ROW).flat_map(|row| spec(row, &w)).collect();
    let block = dtype.block_bytes();
    let bad = mismatches(&ours, want, block);
    assert!(
        bad.is_empty(),
        "{dtype} weighted: format differs from GGML in blocks {bad:?}"
    );
    for method in [Method::Search, Method::Gptq] {
        let mut out = Vec::new();
        let mut stats = ErrorStats::default();
        convert_rows(&x, ROW, dtype, method, Some(&w), &mut out, &mut stats).unwrap();
        let bad = mismatches(&out, want, block);
        assert!(
            bad.is_empty(),
            "{dtype} weighted ({method}): quantizer differs from GGML in blocks {bad:?}"
        );
    }
    // The importance matters: the reference blocks differ.
    assert_ne!(quantizer_bytes(&x, ROW, dtype), want, "{dtype}");
}

#[test]
fn weighted_quantizers_match_ggml_with_an_importance_matrix() {
    use kiln_format::kquants::{
        quantize_row_q4_k_weighted, quantize_row_q5_k_weighted, quantize_row_q6_k_weighted,
    };
    use kiln_format::q5::{quantize_row_q5_0_weighted, quantize_row_q5_1_weighted};
    fn bytes<T: bytemuck::Pod>(v: Vec<T>) -> Vec<u8> {
        bytemuck::cast_slice(&v).to_vec()
    }
    check_weighted(
        DType::Q4_K,
        |x, w| bytes(quantize_row_q4_k_weighted(x, w).unwrap()),
        include_bytes!("vectors/kqw_q4_k.bin"),
    );
    check_weighted(
        DType::Q5_K,
        |x, w| bytes(quantize_row_q5_k_weighted(x, w).unwrap()),
        include_bytes!("vectors/kqw_q5_k.bin"),
    );
    check_weighted(
        DType::Q6_K,
        |x, w| bytes(quantize_row_q6_k_weighted(x, w).unwrap()),
        include_bytes!("vectors/kqw_q6_k.bin"),
    );
    check_weighted(
        DType::Q5_0,
        |x, w| bytes(quantize_row_q5_0_weighted(x, w).unwrap()),
        include_bytes!("vectors/kqw_q5_0.bin"),
    );
    check_weighted(
        DType::Q5_1,
        |x, w| bytes(quantize_row_q5_1_weighted(x, w).unwrap()),
        include_bytes!("vectors/kqw_q5_1.bin"),
    );
}

#[test]
fn weighted_quantizers_reject_bad_importance() {
    use kiln_format::kquants::quantize_row_q4_k_weighted;
    use kiln_format::q5::quantize_row_q5_0_weighted;
    use kiln_format::FormatError;
    let x = vec![0.5f32; 512];
    let mut w = vec![1.0f32; 512];
    assert!(matches!(
        quantize_row_q4_k_weighted(&x, &w[..256]),
        Err(FormatError::ImportanceLength {
            len: 256,
            expected: 512
        })
    ));
    w[300] = -1.0;
    assert!(matches!(
        quantize_row_q4_k_weighted(&x, &w),
        Err(FormatError::BadImportance { position: 300, .. })
    ));
    w[300] = f32::NAN;
    assert!(matches!(
        quantize_row_q5_0_weighted(&x, &w),
        Err(FormatError::BadImportance { position: 300, .. })
    ));
}

/// Q2_K, Q3_K, IQ4_NL and IQ4_XS through the quantizer's own row conversion (what
/// `kiln-quantize` writes): GGML's blocks without importance (rows of the whole input and of
/// 512) and with it (every method but the reference). The format crate's rules themselves are
/// held to the same vectors, and GGML's dequantization, in kiln-format's tests.
#[test]
fn low_bit_and_iq4_types_through_the_quantizer_match_ggml() {
    let x = floats(KQ_INPUT);
    for (dtype, plain, weighted) in [
        (
            DType::Q2_K,
            &include_bytes!("vectors/kq_q2_k.bin")[..],
            &include_bytes!("vectors/kqw_q2_k.bin")[..],
        ),
        (
            DType::Q3_K,
            include_bytes!("vectors/kq_q3_k.bin"),
            include_bytes!("vectors/kqw_q3_k.bin"),
        ),
        (
            DType::IQ4_NL,
            include_bytes!("vectors/kq_iq4_nl.bin"),
            include_bytes!("vectors/kqw_iq4_nl.bin"),
        ),
        (
            DType::IQ4_XS,
            include_bytes!("vectors/kq_iq4_xs.bin"),
            include_bytes!("vectors/kqw_iq4_xs.bin"),
        ),
    ] {
        let mut spec = Vec::new();
        dtype.block().quantize_ref(&x, x.len(), &mut spec).unwrap();
        check(dtype.name(), &x, dtype, spec, plain);
        check_weighted(
            dtype,
            |row, w| {
                let mut out = Vec::new();
                dtype
                    .block()
                    .quantize_weighted(row, w, &mut out)
                    .unwrap()
                    .unwrap();
                out
            },
            weighted,
        );
    }
}
