//! Q2_K and Q3_K against GGML itself: the reference and importance-weighted quantizers byte for
//! byte, the dequantizers bit for bit.
//!
//! The expected blocks come from llama.cpp's `libggml-base` (`quantizer/tests/vectors/
//! ggml_kquants.c`): `quantize_row_q*_K_ref` over the whole input, `quantize_q*_K` with an
//! importance matrix over rows of 1024, and GGML's dequantization of the reference blocks.
//! What each range of the input exercises is listed in `kquant_groups.json`.

use bytemuck::Pod;
use kiln_format::kquants::{
    dequantize_row_q2_k, dequantize_row_q3_k, pack_q2_k_codes, pack_q3_k_codes, q2_k_codes,
    q3_k_codes, quantize_row_q2_k_ref, quantize_row_q2_k_weighted, quantize_row_q3_k_ref,
    quantize_row_q3_k_weighted, BlockQ2K, BlockQ3K, QK_K,
};

const INPUT: &[u8] = include_bytes!("../../quantizer/tests/vectors/kquant_input.f32");
const IMATRIX: &[u8] = include_bytes!("../../quantizer/tests/vectors/kquant_imatrix.f32");
const Q2_K: &[u8] = include_bytes!("../../quantizer/tests/vectors/kq_q2_k.bin");
const Q3_K: &[u8] = include_bytes!("../../quantizer/tests/vectors/kq_q3_k.bin");
const Q2_K_DEQ: &[u8] = include_bytes!("../../quantizer/tests/vectors/kq_q2_k.deq.f32");
const Q3_K_DEQ: &[u8] = include_bytes!("../../quantizer/tests/vectors/kq_q3_k.deq.f32");
const Q2_K_W: &[u8] = include_bytes!("../../quantizer/tests/vectors/kqw_q2_k.bin");
const Q3_K_W: &[u8] = include_bytes!("../../quantizer/tests/vectors/kqw_q3_k.bin");

/// The weighted vectors quantize the input as rows of this many values.
const ROW: usize = 1024;

fn floats(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|e| f32::from_le_bytes([e[0], e[1], e[2], e[3]]))
        .collect()
}

/// GGML's blocks, read without assuming the byte string's alignment.
fn blocks<B: Pod>(bytes: &[u8]) -> Vec<B> {
    let size = std::mem::size_of::<B>();
    assert_eq!(bytes.len() % size, 0, "whole blocks");
    bytes
        .chunks_exact(size)
        .map(bytemuck::pod_read_unaligned)
        .collect()
}

/// Indices of the blocks where `got` and `want` differ.
fn mismatches<B: Pod>(got: &[B], want: &[u8]) -> Vec<usize> {
    let got: &[u8] = bytemuck::cast_slice(got);
    assert_eq!(got.len(), want.len(), "byte lengths");
    let size = std::mem::size_of::<B>();
    got.chunks_exact(size)
        .zip(want.chunks_exact(size))
        .enumerate()
        .filter(|(_, (g, w))| g != w)
        .map(|(i, _)| i)
        .collect()
}

/// Indices of the values whose bits differ (so −0 against 0 counts).
fn bit_mismatches(got: &[f32], want: &[f32]) -> Vec<usize> {
    assert_eq!(got.len(), want.len(), "value counts");
    got.iter()
        .zip(want)
        .enumerate()
        .filter(|(_, (g, w))| g.to_bits() != w.to_bits())
        .map(|(i, _)| i)
        .collect()
}

fn weighted<B: Pod>(quantize: fn(&[f32], &[f32]) -> kiln_format::error::Result<Vec<B>>) -> Vec<B> {
    let x = floats(INPUT);
    let qw = floats(IMATRIX);
    assert_eq!(qw.len(), ROW);
    x.chunks_exact(ROW)
        .flat_map(|row| quantize(row, &qw).expect("a valid row"))
        .collect()
}

#[test]
fn q2_k_reference_blocks_are_ggmls() {
    let got = quantize_row_q2_k_ref(&floats(INPUT)).unwrap();
    let bad = mismatches(&got, Q2_K);
    assert!(bad.is_empty(), "Q2_K differs from GGML in blocks {bad:?}");
}

#[test]
fn q3_k_reference_blocks_are_ggmls() {
    let got = quantize_row_q3_k_ref(&floats(INPUT)).unwrap();
    let bad = mismatches(&got, Q3_K);
    assert!(bad.is_empty(), "Q3_K differs from GGML in blocks {bad:?}");
}

#[test]
fn q2_k_dequantization_is_ggmls() {
    let b: Vec<BlockQ2K> = blocks(Q2_K);
    let mut out = vec![0f32; b.len() * QK_K];
    dequantize_row_q2_k(&b, &mut out);
    let bad = bit_mismatches(&out, &floats(Q2_K_DEQ));
    assert!(bad.is_empty(), "Q2_K dequantization differs at {bad:?}");
}

#[test]
fn q3_k_dequantization_is_ggmls() {
    let b: Vec<BlockQ3K> = blocks(Q3_K);
    let mut out = vec![0f32; b.len() * QK_K];
    dequantize_row_q3_k(&b, &mut out);
    let bad = bit_mismatches(&out, &floats(Q3_K_DEQ));
    assert!(bad.is_empty(), "Q3_K dequantization differs at {bad:?}");
}

#[test]
fn q2_k_weighted_blocks_are_ggmls() {
    let got = weighted(quantize_row_q2_k_weighted);
    let bad = mismatches(&got, Q2_K_W);
    assert!(
        bad.is_empty(),
        "weighted Q2_K differs from GGML in blocks {bad:?}"
    );
}

#[test]
fn q3_k_weighted_blocks_are_ggmls() {
    let got = weighted(quantize_row_q3_k_weighted);
    let bad = mismatches(&got, Q3_K_W);
    assert!(
        bad.is_empty(),
        "weighted Q3_K differs from GGML in blocks {bad:?}"
    );
}

/// The importance must change the blocks, or the weighted check above proves little.
#[test]
fn importance_changes_the_blocks() {
    assert_ne!(Q2_K_W, Q2_K);
    assert_ne!(Q3_K_W, Q3_K);
    let x = floats(INPUT);
    let q2_ref = quantize_row_q2_k_ref(&x).unwrap();
    assert_ne!(weighted(quantize_row_q2_k_weighted), q2_ref);
    let q3_ref = quantize_row_q3_k_ref(&x).unwrap();
    assert_ne!(weighted(quantize_row_q3_k_weighted), q3_ref);
}

#[test]
fn codes_round_trip_through_packing() {
    for b in blocks::<BlockQ2K>(Q2_K).iter().chain(&blocks(Q2_K_W)) {
        assert_eq!(pack_q2_k_codes(&q2_k_codes(b)), b.qs);
    }
    for b in blocks::<BlockQ3K>(Q3_K).iter().chain(&blocks(Q3_K_W)) {
        let (hmask, qs) = pack_q3_k_codes(&q3_k_codes(b));
        assert_eq!((hmask, qs), (b.hmask, b.qs));
    }
}
