//! Fuzz target for the `.kiln` reader.
//!
//! Each input is tried twice: as given, and "re-sealed" (bytes 96..128 replaced by the correct
//! header checksum for whatever the header claims), so that mutations get past the checksum and
//! exercise the structural validation of the metadata, the tensor index and the files section
//! (packed, zlib-compressed tokenizer files). Whenever a file is
//! accepted, every view, typed accessor and the checksum verification are touched: an accepted
//! file must never make a later access panic or read out of bounds, and the tensors its
//! configuration implies are listed (bounded at open, whatever `num_layers` claims).
#![no_main]

use kiln_format::packed::PackedField;
use kiln_format::{DType, KilnFile};
use libfuzzer_sys::fuzz_target;
use sha2::{Digest, Sha256};

/// Largest tensor decoded to f32, to keep each run fast (the decode allocates numel floats).
const MAX_DECODE: u64 = 1 << 16;

fuzz_target!(|data: &[u8]| {
    exercise(data.to_vec());
    if data.len() >= 128 {
        let mut sealed = data.to_vec();
        reseal(&mut sealed);
        exercise(sealed);
    }
});

fn exercise(bytes: Vec<u8>) {
    let Ok(f) = KilnFile::from_bytes("fuzz.kiln", bytes) else {
        return;
    };
    let _ = f.version();
    let _ = f.metadata().quantization();
    // Every packed field was decoded to exactly its declared length.
    let tok = &f.metadata().tokenizer;
    for p in f.packed_fields() {
        let text = match p.field {
            PackedField::TokenizerJson => &tok.tokenizer_json,
            PackedField::TokenizerConfigJson => &tok.tokenizer_config_json,
            PackedField::ChatTemplate => &tok.chat_template,
        };
        assert_eq!(text.as_ref().map(|t| t.len() as u64), Some(p.len));
    }
    let mut total = 0u64;
    for info in f.tensors() {
        let by_name = f.tensor(&info.name).expect("every indexed name resolves");
        let v = f.view(info);
        assert_eq!(by_name.bytes().as_ptr(), v.bytes().as_ptr());
        assert_eq!(v.bytes().len() as u64, info.len);
        assert_eq!(info.dtype.byte_len(&info.shape), Ok(info.len));
        total += info.len;
        // Typed views: exactly one dtype matches; the others are errors, never panics.
        let typed = [
            v.as_f32().map(|s| s.len() as u64 * 4),
            v.as_f16().map(|s| s.len() as u64 * 2),
            v.as_bf16().map(|s| s.len() as u64 * 2),
            v.as_q8_0().map(|s| s.len() as u64 * 34),
            v.as_q4_0().map(|s| s.len() as u64 * 18),
            v.as_q4_0x16().map(|s| s.len() as u64 * 288),
        ];
        for len in typed.into_iter().flatten() {
            assert_eq!(len, info.len);
        }
        // Row-major Q4_0 blocks for q4_0 and (de-interleaved) q4_0x16, an error otherwise.
        match v.q4_0_rows() {
            Ok(rows) => {
                assert_eq!(info.dtype.logical(), DType::Q4_0);
                assert_eq!(rows.len() as u64 * 18, info.len);
            }
            Err(_) => assert_ne!(info.dtype.logical(), DType::Q4_0),
        }
        if info.numel() <= MAX_DECODE {
            let x = v.to_f32_vec();
            assert_eq!(x.len() as u64, info.numel());
        }
        let _ = DType::from_id(info.dtype.id());
    }
    assert!(total <= f.data_len());
    // The tensors the configuration implies, as the runner and GGUF export list them: the
    // count read from the file (`num_layers`) was bounded at open, so listing them is too.
    let config = &f.metadata().config;
    let implied = kiln_format::shapes::expected_tensor_count(config);
    assert!(implied <= u64::from(kiln_format::layout::MAX_TENSORS));
    let expected = kiln_format::expected_tensors(config);
    assert_eq!(expected.len() as u64, implied);
    let _ = kiln_format::shapes::check_layer_count(config.num_layers, f.tensors().len() as u64);
    let _ = f.verify_checksums(&|_| {});
    let _ = f.verify();
}

/// bytes[96..128] = sha256(bytes[0..96] ++ bytes[128..128 + metadata_len + index_len +
/// files_len]), the covered range clamped to the input.
fn reseal(b: &mut [u8]) {
    let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().expect("8 bytes"));
    let end = 128u64
        .saturating_add(u64_at(24))
        .saturating_add(u64_at(40))
        .saturating_add(u64_at(72))
        .min(b.len() as u64) as usize;
    let mut h = Sha256::new();
    h.update(&b[..96]);
    h.update(&b[128..end]);
    let sha: [u8; 32] = h.finalize().into();
    b[96..128].copy_from_slice(&sha);
}
