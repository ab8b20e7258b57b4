//! Decoding GGML blocks to f32, for the tensors an import does not keep as they are.
//!
//! Kiln stores most of the GGML block types a GGUF file holds (Q8_0, Q4_0, Q5_0, Q5_1, Q4_K,
//! Q5_K, Q6_K: format 1.2; Q2_K, Q3_K, IQ4_NL, IQ4_XS: 1.4), so an import keeps those byte for
//! byte; it decodes them only where
//! it is asked to (`--dequantize-all`) or where the runner needs floats (1-D tensors such as
//! norms and biases, Gemma's `1 + w` norms). Those decode through their row of the format
//! crate's block-type table ([`kiln_format::BlockKind::dequantize`], GGML's reference
//! dequantizers), the same code every other Kiln program decodes them with. The GGML types Kiln does not store but can decode,
//! listed in [`DEQUANTIZED`] (Q4_1), are decoded here, following GGML's `dequantize_row_*`.

use half::f16;

use super::types::GgmlType;

/// The GGML types Kiln does not store but [`dequantize`] decodes, by name (for messages): an
/// import writes them as floats (`--dequantize-to`).
pub const DEQUANTIZED: &[&str] = &["Q4_1"];

fn h(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Decode `bytes` (whole blocks of `ty`) to f32, appended to `out`. `None` if Kiln cannot
/// decode `ty` or `bytes` is not a whole number of blocks.
pub fn dequantize(ty: GgmlType, bytes: &[u8], out: &mut Vec<f32>) -> Option<()> {
    let bb = ty.block_bytes as usize;
    if !bytes.len().is_multiple_of(bb) {
        return None;
    }
    let n = bytes.len() / bb * ty.block_len as usize;
    if let Some(d) = ty.kiln_dtype() {
        // Kiln's own dtypes, in GGML's row-major layout (never a Kiln-only layout, so the
        // column count, which only those need, does not matter).
        let start = out.len();
        out.resize(start + n, 0.0);
        d.block().dequantize(bytes, n, &mut out[start..]);
        return Some(());
    }
    out.reserve(n);
    match ty.name {
        "Q4_1" => bytes.chunks_exact(bb).for_each(|b| q4_1(b, out)),
        _ => return None,
    }
    Some(())
}

/// Whether [`dequantize`] decodes `ty`.
pub fn can_dequantize(ty: GgmlType) -> bool {
    ty.kiln_dtype().is_some() || DEQUANTIZED.contains(&ty.name)
}

/// Q4_1 (20 bytes): f16 `d`, f16 `m`, 16 bytes of nibbles; byte `j` holds weight `j` (low
/// nibble) and `j + 16` (high); `w = d·nibble + m`.
fn q4_1(b: &[u8], out: &mut Vec<f32>) {
    let (d, m) = (h(b, 0), h(b, 2));
    let qs = &b[4..20];
    out.extend(qs.iter().map(|&q| d * f32::from(q & 0x0f) + m));
    out.extend(qs.iter().map(|&q| d * f32::from(q >> 4) + m));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ty(name: &str) -> GgmlType {
        *super::super::types::GGML_TYPES
            .iter()
            .find(|t| t.name == name)
            .unwrap()
    }

    fn f16b(x: f32) -> [u8; 2] {
        f16::from_f32(x).to_le_bytes()
    }

    #[test]
    fn q4_1_known_block() {
        let mut b = Vec::new();
        b.extend(f16b(0.5));
        b.extend(f16b(-1.0));
        b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let mut out = Vec::new();
        dequantize(ty("Q4_1"), &b, &mut out).unwrap();
        assert_eq!(out.len(), 32);
        for j in 0..16 {
            assert_eq!(out[j], 0.5 * j as f32 - 1.0);
            assert_eq!(out[j + 16], 0.5 * (15 - j) as f32 - 1.0);
        }
    }

    #[test]
    fn q5_0_and_q5_1_use_the_fifth_bit() {
        let mut b = Vec::new();
        b.extend(f16b(1.0));
        b.extend((1u32 << 3 | 1 << 20).to_le_bytes());
        b.extend([0x21u8; 16]);
        let mut out = Vec::new();
        dequantize(ty("Q5_0"), &b, &mut out).unwrap();
        assert_eq!(out[0], 1.0 - 16.0);
        assert_eq!(out[3], 17.0 - 16.0);
        assert_eq!(out[16], 2.0 - 16.0);
        assert_eq!(out[20], 18.0 - 16.0);
        let mut b1 = f16b(2.0).to_vec();
        b1.extend(f16b(0.25));
        b1.extend_from_slice(&b[2..]);
        out.clear();
        dequantize(ty("Q5_1"), &b1, &mut out).unwrap();
        assert_eq!(out[3], 2.0 * 17.0 + 0.25);
    }

    #[test]
    fn q4_k_scales_and_mins() {
        let mut b = Vec::new();
        b.extend(f16b(1.0));
        b.extend(f16b(0.5));
        // Sub-blocks 0..4: scale j + 1, min j; 4..8: scale from the split bits (here 2), min 1.
        let mut s = [0u8; 12];
        for j in 0..4 {
            s[j] = j as u8 + 1;
            s[j + 4] = j as u8;
            s[j + 8] = 0x12;
        }
        b.extend(s);
        b.extend([0x31u8; 128]);
        let mut out = Vec::new();
        dequantize(ty("Q4_K"), &b, &mut out).unwrap();
        assert_eq!(out.len(), 256);
        assert_eq!(out[0], 1.0 * 1.0 * 1.0 - 0.5 * 0.0); // scale 1, q 1, min 0
        assert_eq!(out[32], 2.0 * 3.0 - 0.5 * 1.0); // sub-block 1: scale 2, q 3, min 1
        assert_eq!(out[4 * 32], 2.0 * 1.0 - 0.5 * 1.0); // sub-block 4: scale 2, min 1
    }

    #[test]
    fn q6_k_layout() {
        let mut b = vec![0u8; 210];
        b[0] = 0x05; // ql[0]: weight 0 low bits 5, weight 64 low bits 0
        b[128] = 0b0000_0010; // qh[0]: weight 0 high bits 2 -> q = 37
        b[192] = 3; // scale of sub-block 0
        b[208..210].copy_from_slice(&f16b(0.5));
        let mut out = Vec::new();
        dequantize(ty("Q6_K"), &b, &mut out).unwrap();
        assert_eq!(out[0], 0.5 * 3.0 * 5.0);
        assert_eq!(out[1], 0.5 * 3.0 * -32.0);
        assert_eq!(out[64], 0.0); // scale of sub-block 4 is 0
    }

    /// Blocks of seeded random bytes decoded by PyPI's `gguf` (an independent implementation),
    /// from `fixtures/gguf/make_dequant_vectors.py`: Kiln must decode them to the same f32 bits
    /// (Q4_1 here, the rest through `kiln_format`'s reference dequantizers).
    #[test]
    fn matches_the_gguf_python_package_bit_for_bit() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../fixtures/gguf/dequant_vectors.json"
        );
        let text = std::fs::read_to_string(path).unwrap();
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        let vectors = v["vectors"].as_object().unwrap();
        // Every block type an import decodes: Kiln's own (through the format crate) and Q4_1.
        let mut want_types: Vec<&str> = kiln_format::DType::ALL
            .iter()
            .filter(|d| d.is_quantized() && d.logical() == **d)
            .map(|d| super::super::types::GgmlType::of(*d).name)
            .chain(DEQUANTIZED.iter().copied())
            .collect();
        want_types.sort_unstable();
        let mut have: Vec<&str> = vectors.keys().map(String::as_str).collect();
        have.sort_unstable();
        assert_eq!(have, want_types);
        for (name, case) in vectors {
            let hex = case["hex"].as_str().unwrap();
            let bytes: Vec<u8> = (0..hex.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
                .collect();
            let want: Vec<u32> = case["f32_bits"]
                .as_array()
                .unwrap()
                .iter()
                .map(|b| b.as_u64().unwrap() as u32)
                .collect();
            let mut out = Vec::new();
            dequantize(ty(name), &bytes, &mut out).unwrap();
            let got: Vec<u32> = out.iter().map(|x| x.to_bits()).collect();
            assert_eq!(got.len(), want.len(), "{name}");
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(
                    g,
                    w,
                    "{name} weight {i}: {} vs {}",
                    f32::from_bits(*g),
                    f32::from_bits(*w)
                );
            }
        }
    }

    #[test]
    fn partial_blocks_and_unknown_types_are_refused() {
        let mut out = Vec::new();
        assert!(dequantize(ty("Q4_1"), &[0u8; 21], &mut out).is_none());
        assert!(dequantize(ty("IQ2_XXS"), &[0u8; 66], &mut out).is_none());
    }
}
