//! Cross-check of the reference method against GGML, through the independent numpy
//! implementation in PyPI's `gguf` package (`gguf.quants.quantize`).
//!
//! The vectors are committed (`tests/vectors/`, made by `tests/vectors/make_vectors.py`; see
//! `manifest.json` for the versions and what each range of blocks exercises: ties, all-zero,
//! outliers, the +7 clip, tiny and huge values). Every block must match byte for byte.

use kiln_format::blocks::{quantize_block_q4_0_ref, quantize_block_q8_0_ref, QK};
use kiln_quantize::method::{quantize_block_q4_0, quantize_block_q8_0, Method};

const INPUT: &[u8] = include_bytes!("vectors/input.f32");
const Q8_0: &[u8] = include_bytes!("vectors/q8_0.bin");
const Q4_0: &[u8] = include_bytes!("vectors/q4_0.bin");

fn blocks() -> Vec<[f32; QK]> {
    INPUT
        .chunks_exact(4 * QK)
        .map(|c| {
            let mut b = [0.0f32; QK];
            for (v, e) in b.iter_mut().zip(c.chunks_exact(4)) {
                *v = f32::from_le_bytes([e[0], e[1], e[2], e[3]]);
            }
            b
        })
        .collect()
}

#[test]
fn vectors_have_the_expected_sizes() {
    let n = blocks().len();
    assert!(n >= 200, "{n} blocks");
    assert_eq!(Q8_0.len(), n * 34);
    assert_eq!(Q4_0.len(), n * 18);
}

#[test]
fn q8_0_reference_matches_ggml_bit_for_bit() {
    let mut mismatches = Vec::new();
    for (i, (x, want)) in blocks().iter().zip(Q8_0.chunks_exact(34)).enumerate() {
        let ours = quantize_block_q8_0(Method::Reference, x, None);
        let spec = quantize_block_q8_0_ref(x);
        if bytemuck::bytes_of(&ours) != want || bytemuck::bytes_of(&spec) != want {
            mismatches.push(i);
        }
    }
    assert!(
        mismatches.is_empty(),
        "blocks differing from gguf: {mismatches:?}"
    );
}

/// gguf-py and ggml-quants.c differ on one input: an all-zero block whose first element is
/// `-0.0`. GGML C never updates `max` (`amax < fabsf(v)` is false for every zero), so
/// `d = +0.0 / -8 = -0.0` (f16 bits 0x8000); numpy takes the element at `argmax`, `-0.0`, and
/// gets `d = +0.0`. Kiln follows GGML C; the codes agree.
fn gguf_py_signed_zero_divergence(x: &[f32; QK]) -> bool {
    x.iter().all(|&v| v == 0.0) && x[0].is_sign_negative()
}

#[test]
fn q4_0_reference_matches_ggml_bit_for_bit() {
    let mut mismatches = Vec::new();
    let mut divergent = 0;
    for (i, (x, want)) in blocks().iter().zip(Q4_0.chunks_exact(18)).enumerate() {
        let ours = quantize_block_q4_0(Method::Reference, x, None);
        let spec = quantize_block_q4_0_ref(x);
        let mut want = want.to_vec();
        if gguf_py_signed_zero_divergence(x) {
            assert_eq!(&want[..2], &[0x00, 0x00], "gguf-py writes +0.0 here");
            want[..2].copy_from_slice(&[0x00, 0x80]); // GGML C: -0.0
            divergent += 1;
        }
        if bytemuck::bytes_of(&ours) != want || bytemuck::bytes_of(&spec) != want {
            mismatches.push(i);
        }
    }
    assert_eq!(divergent, 1, "the vectors hold one signed-zero block");
    assert!(
        mismatches.is_empty(),
        "blocks differing from gguf: {mismatches:?}"
    );
}
