//! Scalar dequantization of the GGML block types Kiln does not store natively (Q4_1, Q5_0,
//! Q5_1, Q4_K, Q5_K, Q6_K), for importing GGUF files that use them.
//!
//! Each function reads whole blocks in GGML's layout (documented per type) and appends the
//! weights as f32 in order. They follow GGML's `dequantize_row_*` reference definitions.

use half::{bf16, f16};

use super::types::GgmlType;

/// The GGML types [`dequantize`] decodes, by name (for messages).
pub const DEQUANTIZED: &[&str] = &["Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"];

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
    let blocks = bytes.chunks_exact(bb);
    out.reserve(bytes.len() / bb * ty.block_len as usize);
    match ty.name {
        "F32" => out.extend(
            bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
        ),
        "F16" => out.extend(bytes.chunks_exact(2).map(|c| h(c, 0))),
        "BF16" => out.extend(
            bytes
                .chunks_exact(2)
                .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32()),
        ),
        "Q4_0" => blocks.for_each(|b| q4_0(b, out)),
        "Q8_0" => blocks.for_each(|b| q8_0(b, out)),
        "Q4_1" => blocks.for_each(|b| q4_1(b, out)),
        "Q5_0" => blocks.for_each(|b| q5(b, false, out)),
        "Q5_1" => blocks.for_each(|b| q5(b, true, out)),
        "Q4_K" => blocks.for_each(|b| q4_k(b, out)),
        "Q5_K" => blocks.for_each(|b| q5_k(b, out)),
        "Q6_K" => blocks.for_each(|b| q6_k(b, out)),
        _ => return None,
    }
    Some(())
}

/// Whether [`dequantize`] decodes `ty`.
pub fn can_dequantize(ty: GgmlType) -> bool {
    ty.kiln_dtype().is_some() || DEQUANTIZED.contains(&ty.name)
}

/// Q8_0 (34 bytes): f16 `d`, 32 × i8 `q`; `w = d·q`.
fn q8_0(b: &[u8], out: &mut Vec<f32>) {
    let d = h(b, 0);
    out.extend(b[2..34].iter().map(|&q| d * f32::from(q as i8)));
}

/// Q4_0 (18 bytes): f16 `d`, 16 bytes; byte `j` holds weight `j` (low nibble) and `j + 16`
/// (high); `w = d·(nibble − 8)`.
fn q4_0(b: &[u8], out: &mut Vec<f32>) {
    let d = h(b, 0);
    let qs = &b[2..18];
    out.extend(qs.iter().map(|&q| d * (f32::from(q & 0x0f) - 8.0)));
    out.extend(qs.iter().map(|&q| d * (f32::from(q >> 4) - 8.0)));
}

/// Q4_1 (20 bytes): f16 `d`, f16 `m`, nibbles as Q4_0; `w = d·nibble + m`.
fn q4_1(b: &[u8], out: &mut Vec<f32>) {
    let (d, m) = (h(b, 0), h(b, 2));
    let qs = &b[4..20];
    out.extend(qs.iter().map(|&q| d * f32::from(q & 0x0f) + m));
    out.extend(qs.iter().map(|&q| d * f32::from(q >> 4) + m));
}

/// Q5_0 (22 bytes): f16 `d`, u32 `qh` (bit `j` is the fifth bit of weight `j`), nibbles as
/// Q4_0; `w = d·(q − 16)`. Q5_1 (24 bytes): f16 `d`, f16 `m`, `qh`, nibbles; `w = d·q + m`.
fn q5(b: &[u8], with_min: bool, out: &mut Vec<f32>) {
    let d = h(b, 0);
    let (m, o) = if with_min { (h(b, 2), 4) } else { (0.0, 2) };
    let qh = u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
    let qs = &b[o + 4..o + 20];
    let bias = if with_min { 0.0 } else { 16.0 };
    let w = |q: u8, bit: u32| -> f32 {
        let v = u32::from(q) | (((qh >> bit) & 1) << 4);
        d * (v as f32 - bias) + m
    };
    out.extend(qs.iter().enumerate().map(|(j, &q)| w(q & 0x0f, j as u32)));
    out.extend(
        qs.iter()
            .enumerate()
            .map(|(j, &q)| w(q >> 4, j as u32 + 16)),
    );
}

/// The 6-bit scale and min of sub-block `j` (0..8) from the 12 packed bytes of Q4_K/Q5_K.
fn scale_min_k4(j: usize, s: &[u8]) -> (f32, f32) {
    let (sc, mn) = if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    };
    (f32::from(sc), f32::from(mn))
}

/// Q4_K (144 bytes, 256 weights in 8 sub-blocks of 32): f16 `d`, f16 `dmin`, 12 bytes of
/// 6-bit scales/mins, 128 bytes of nibbles. Each 32 bytes of nibbles hold two sub-blocks (low
/// nibbles first); `w = d·scale·q − dmin·min`.
fn q4_k(b: &[u8], out: &mut Vec<f32>) {
    let (d, dmin) = (h(b, 0), h(b, 2));
    let scales = &b[4..16];
    for (chunk, qs) in b[16..144].chunks_exact(32).enumerate() {
        let (s1, m1) = scale_min_k4(2 * chunk, scales);
        let (s2, m2) = scale_min_k4(2 * chunk + 1, scales);
        out.extend(qs.iter().map(|&q| d * s1 * f32::from(q & 0x0f) - dmin * m1));
        out.extend(qs.iter().map(|&q| d * s2 * f32::from(q >> 4) - dmin * m2));
    }
}

/// Q5_K (176 bytes): as Q4_K plus 32 bytes `qh` of fifth bits (bit `2c` of `qh[l]` for the
/// low-nibble sub-block of chunk `c`, bit `2c + 1` for the high one) before the nibbles.
fn q5_k(b: &[u8], out: &mut Vec<f32>) {
    let (d, dmin) = (h(b, 0), h(b, 2));
    let scales = &b[4..16];
    let qh = &b[16..48];
    for (chunk, qs) in b[48..176].chunks_exact(32).enumerate() {
        let (s1, m1) = scale_min_k4(2 * chunk, scales);
        let (s2, m2) = scale_min_k4(2 * chunk + 1, scales);
        let (u1, u2) = (1u8 << (2 * chunk), 1u8 << (2 * chunk + 1));
        out.extend(qs.iter().zip(qh).map(|(&q, &hb)| {
            let v = (q & 0x0f) + if hb & u1 != 0 { 16 } else { 0 };
            d * s1 * f32::from(v) - dmin * m1
        }));
        out.extend(qs.iter().zip(qh).map(|(&q, &hb)| {
            let v = (q >> 4) + if hb & u2 != 0 { 16 } else { 0 };
            d * s2 * f32::from(v) - dmin * m2
        }));
    }
}

/// Q6_K (210 bytes, 256 weights in 16 sub-blocks of 16): 128 bytes `ql` (low 4 bits), 64
/// bytes `qh` (high 2 bits), 16 × i8 scales, f16 `d`; `w = d·scale·(q − 32)`. Each half of 128
/// weights uses 64 bytes of `ql` and 32 of `qh`: weight `l + 32k` (k = 0..4) takes nibble
/// `k / 2` of `ql[l + 32(k % 2)]` and bits `2k..2k+2` of `qh[l]`.
fn q6_k(b: &[u8], out: &mut Vec<f32>) {
    let d = h(b, 208);
    let start = out.len();
    out.resize(start + 256, 0.0);
    let y = &mut out[start..];
    for half in 0..2 {
        let ql = &b[64 * half..64 * half + 64];
        let qh = &b[128 + 32 * half..128 + 32 * half + 32];
        let sc = &b[192 + 8 * half..192 + 8 * half + 8];
        for l in 0..32 {
            let is = l / 16;
            let q = [
                (ql[l] & 0x0f) | ((qh[l] & 3) << 4),
                (ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4),
                (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4),
                (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4),
            ];
            for (k, &qk) in q.iter().enumerate() {
                let s = f32::from(sc[is + 2 * k] as i8);
                y[128 * half + l + 32 * k] = d * s * (f32::from(qk) - 32.0);
            }
        }
    }
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
    /// from `fixtures/gguf/make_dequant_vectors.py`: Kiln must decode them to the same f32 bits.
    #[test]
    fn matches_the_gguf_python_package_bit_for_bit() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../fixtures/gguf/dequant_vectors.json"
        );
        let text = std::fs::read_to_string(path).unwrap();
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        let vectors = v["vectors"].as_object().unwrap();
        assert_eq!(vectors.len(), DEQUANTIZED.len() + 2);
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
