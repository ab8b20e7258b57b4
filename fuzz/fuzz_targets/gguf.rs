//! Fuzz target for the GGUF reader (`kiln-convert gguf`'s input side).
//!
//! Each input is parsed; when a header is accepted, every tensor's bytes are sliced and (when
//! small) dequantized, and the tokenizer is rebuilt from the metadata: an accepted file must
//! never make a later step panic or read out of bounds. The model configuration is resolved
//! and checked as import does it, and the tensors an accepted one implies are listed.
#![no_main]

use kiln_convert::gguf::{dequant, import, parse, read, tokenizer};
use libfuzzer_sys::fuzz_target;

/// Largest tensor decoded to f32, to keep each run fast.
const MAX_DECODE: u64 = 1 << 16;

fuzz_target!(|data: &[u8]| {
    let Ok(h) = parse("fuzz.gguf", data) else {
        return;
    };
    for t in &h.tensors {
        let bytes = read::tensor_bytes(data, t);
        assert_eq!(bytes.len() as u64, t.len);
        assert_eq!(t.ggml_type.byte_len(&t.dims), Ok(t.len));
        if t.len <= MAX_DECODE {
            let mut out = Vec::new();
            if dequant::dequantize(t.ggml_type, bytes, &mut out).is_some() {
                let numel: u64 = t.dims.iter().product();
                assert_eq!(out.len() as u64, numel);
            }
        }
    }
    // The configuration import would write, checked as import checks it (the layer count
    // against the declared tensors first): an accepted one lists its implied tensors in
    // bounded memory, whatever `<arch>.block_count` claims.
    if let Ok(c) = import::checked_config("fuzz.gguf", &h, data) {
        assert!(
            kiln_format::shapes::check_layer_count(c.num_layers, h.tensors.len() as u64).is_ok()
        );
        let expected = kiln_format::expected_tensors(&c);
        assert_eq!(
            expected.len() as u64,
            kiln_format::shapes::expected_tensor_count(&c)
        );
    }
    let arch = h.get("general.architecture").and_then(|v| v.as_str()).unwrap_or("");
    let _ = tokenizer::from_gguf("fuzz.gguf", &|k| h.get(k), arch, 0);
    // The SentencePiece path too, whatever the file claims to be.
    let _ = tokenizer::from_gguf("fuzz.gguf", &|k| h.get(k), "gemma3", 0);
});
