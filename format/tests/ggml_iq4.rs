//! Cross-check of the IQ4_NL and IQ4_XS quantizers and dequantizers against GGML itself.
//!
//! The expected blocks come from GGML's `quantize_iq4_nl`/`quantize_iq4_xs` (with and without
//! an importance matrix) and `dequantize_row_iq4_*`, called by
//! `quantizer/tests/vectors/ggml_kquants.c` linked against llama.cpp's `libggml-base`. Every
//! block must match byte for byte and every decoded value bit for bit.

use bytemuck::Pod;
use kiln_format::blocks::QK;
use kiln_format::iq4::{
    dequantize_row_iq4_nl, dequantize_row_iq4_xs, iq4_nl_codes, iq4_xs_codes, iq4_xs_scale,
    quantize_row_iq4_nl_ref, quantize_row_iq4_nl_weighted, quantize_row_iq4_xs_ref,
    quantize_row_iq4_xs_weighted, BlockIQ4NL, BlockIQ4XS, IQ4_GRID,
};
use kiln_format::kquants::QK_K;

const INPUT: &[u8] = include_bytes!("../../quantizer/tests/vectors/kquant_input.f32");
const IMATRIX: &[u8] = include_bytes!("../../quantizer/tests/vectors/kquant_imatrix.f32");
const NL: &[u8] = include_bytes!("../../quantizer/tests/vectors/kq_iq4_nl.bin");
const NL_DEQ: &[u8] = include_bytes!("../../quantizer/tests/vectors/kq_iq4_nl.deq.f32");
const XS: &[u8] = include_bytes!("../../quantizer/tests/vectors/kq_iq4_xs.bin");
const XS_DEQ: &[u8] = include_bytes!("../../quantizer/tests/vectors/kq_iq4_xs.deq.f32");
const NL_W: &[u8] = include_bytes!("../../quantizer/tests/vectors/kqw_iq4_nl.bin");
const NL_W_DEQ: &[u8] = include_bytes!("../../quantizer/tests/vectors/kqw_iq4_nl.deq.f32");
const XS_W: &[u8] = include_bytes!("../../quantizer/tests/vectors/kqw_iq4_xs.bin");
const XS_W_DEQ: &[u8] = include_bytes!("../../quantizer/tests/vectors/kqw_iq4_xs.deq.f32");

/// GGML's `kvalues_iq4nl` (ggml-common.h), copied here independently of the crate.
const GGML_KVALUES_IQ4NL: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

fn floats(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|e| f32::from_le_bytes([e[0], e[1], e[2], e[3]]))
        .collect()
}

fn input() -> Vec<f32> {
    let x = floats(INPUT);
    assert_eq!(x.len(), 12288, "kquant_input.f32 length");
    x
}

/// The imatrix's rows: the input as rows of its length, each quantized with it.
fn imatrix() -> Vec<f32> {
    let w = floats(IMATRIX);
    assert_eq!(w.len(), 1024, "kquant_imatrix.f32 length");
    w
}

/// Indices of the blocks where `got` and `want` differ, with the block count.
fn check_blocks<B: Pod>(name: &str, got: &[B], want: &[u8]) {
    let size = std::mem::size_of::<B>();
    let got: &[u8] = bytemuck::cast_slice(got);
    assert_eq!(got.len(), want.len(), "{name}: byte lengths");
    let bad: Vec<usize> = got
        .chunks_exact(size)
        .zip(want.chunks_exact(size))
        .enumerate()
        .filter(|(_, (g, w))| g != w)
        .map(|(i, _)| i)
        .collect();
    assert!(
        bad.is_empty(),
        "{name}: {} of {} blocks differ from GGML's, at {bad:?}",
        bad.len(),
        want.len() / size
    );
}

/// Bit-for-bit comparison of decoded values (so −0 and NaN payloads count).
fn check_values(name: &str, got: &[f32], want: &[u8]) {
    let want = floats(want);
    assert_eq!(got.len(), want.len(), "{name}: value counts");
    let bad: Vec<usize> = got
        .iter()
        .zip(&want)
        .enumerate()
        .filter(|(_, (g, w))| g.to_bits() != w.to_bits())
        .map(|(i, _)| i)
        .collect();
    assert!(
        bad.is_empty(),
        "{name}: {} values differ from GGML's, first at {:?}",
        bad.len(),
        bad.first().map(|&i| (i, got[i], want[i]))
    );
}

fn blocks<B: Pod>(bytes: &[u8]) -> Vec<B> {
    bytemuck::pod_collect_to_vec(bytes)
}

#[test]
fn grid_is_ggmls() {
    assert_eq!(IQ4_GRID, GGML_KVALUES_IQ4NL);
}

#[test]
fn iq4_nl_matches_ggml_without_imatrix() {
    let got = quantize_row_iq4_nl_ref(&input()).unwrap();
    check_blocks("iq4_nl", &got, NL);
}

#[test]
fn iq4_xs_matches_ggml_without_imatrix() {
    let got = quantize_row_iq4_xs_ref(&input()).unwrap();
    check_blocks("iq4_xs", &got, XS);
}

#[test]
fn iq4_nl_matches_ggml_with_imatrix() {
    let (x, w) = (input(), imatrix());
    let got: Vec<BlockIQ4NL> = x
        .chunks_exact(w.len())
        .flat_map(|row| quantize_row_iq4_nl_weighted(row, &w).unwrap())
        .collect();
    check_blocks("iq4_nl weighted", &got, NL_W);
    let plain = quantize_row_iq4_nl_ref(&x).unwrap();
    let differ = got.iter().zip(&plain).filter(|(a, b)| a != b).count();
    assert!(differ > 0, "the importance matrix changed no IQ4_NL block");
}

#[test]
fn iq4_xs_matches_ggml_with_imatrix() {
    let (x, w) = (input(), imatrix());
    let got: Vec<BlockIQ4XS> = x
        .chunks_exact(w.len())
        .flat_map(|row| quantize_row_iq4_xs_weighted(row, &w).unwrap())
        .collect();
    check_blocks("iq4_xs weighted", &got, XS_W);
    let plain = quantize_row_iq4_xs_ref(&x).unwrap();
    let differ = got.iter().zip(&plain).filter(|(a, b)| a != b).count();
    assert!(differ > 0, "the importance matrix changed no IQ4_XS block");
}

#[test]
fn iq4_nl_dequantizes_as_ggml() {
    for (name, bytes, deq) in [("iq4_nl", NL, NL_DEQ), ("iq4_nl weighted", NL_W, NL_W_DEQ)] {
        let b: Vec<BlockIQ4NL> = blocks(bytes);
        let mut out = vec![0.0f32; b.len() * QK];
        dequantize_row_iq4_nl(&b, &mut out);
        check_values(name, &out, deq);
    }
}

#[test]
fn iq4_xs_dequantizes_as_ggml() {
    for (name, bytes, deq) in [("iq4_xs", XS, XS_DEQ), ("iq4_xs weighted", XS_W, XS_W_DEQ)] {
        let b: Vec<BlockIQ4XS> = blocks(bytes);
        let mut out = vec![0.0f32; b.len() * QK_K];
        dequantize_row_iq4_xs(&b, &mut out);
        check_values(name, &out, deq);
    }
}

/// The accessors the kernels use decode GGML's blocks to GGML's values.
#[test]
fn accessors_decode_ggmls_blocks() {
    let deq = floats(XS_DEQ);
    for (b, want) in blocks::<BlockIQ4XS>(XS).iter().zip(deq.chunks_exact(QK_K)) {
        let (d, q) = (b.d.to_f32(), iq4_xs_codes(b));
        for (i, &w) in want.iter().enumerate() {
            let v = d * iq4_xs_scale(b, i / 32) as f32 * f32::from(IQ4_GRID[usize::from(q[i])]);
            assert_eq!(v.to_bits(), w.to_bits(), "iq4_xs value {i}");
        }
    }
    let deq = floats(NL_DEQ);
    for (b, want) in blocks::<BlockIQ4NL>(NL).iter().zip(deq.chunks_exact(QK)) {
        let q = iq4_nl_codes(b);
        for (i, &w) in want.iter().enumerate() {
            let v = b.d.to_f32() * f32::from(IQ4_GRID[usize::from(q[i])]);
            assert_eq!(v.to_bits(), w.to_bits(), "iq4_nl value {i}");
        }
    }
}
