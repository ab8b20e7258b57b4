//! `Tokenizer::token_bytes` on real vocabularies: every token's bytes are what decoding yields
//! for it, and the bytes of a tokenized text concatenate to its decoding.
//!
//! NEEDS `target/models/smollm2-bf16/` (built by `ci/smollm2.sh`) and
//! `target/tokenizers/{qwen3,gemma3,gpt4o}/` (fetched by `ci/real-tokenizers.sh`), neither
//! committed, so every test here is `#[ignore]`d: `cargo test -- --include-ignored` runs them.

mod common;

use std::path::Path;

use common::root;
use kiln_runner::tokenizer::TokenBytes;
use kiln_runner::Tokenizer;

/// Texts that exercise spaces, newlines, JSON punctuation, multi-byte characters split over
/// byte tokens, and digits.
const TEXTS: [&str; 6] = [
    "Hello world! How are you?",
    "{\"name\": \"Ada Lovelace\", \"age\": 36, \"tags\": [\"math\", \"poetry\"]}",
    "  leading spaces\n\ttabs\r\nand CRLF  ",
    "naïve café, Ελληνικά, 日本語のテキスト, emoji 🙂🚀",
    "3.14159 2718281828 -42 1e-9",
    "fn main() { println!(\"{}\", 1 << 3); }",
];

fn tokenizer_in(dir: &Path) -> Tokenizer {
    assert!(
        dir.join("tokenizer.json").exists(),
        "{} is absent: run ci/smollm2.sh or ci/real-tokenizers.sh to fetch it",
        dir.display()
    );
    let files = kiln_convert::tokenizer_files::read(dir).unwrap();
    Tokenizer::from_parts("test", &files, None, &[]).unwrap()
}

/// Each token alone decodes to its bytes (where they are whole UTF-8), and each text's ids
/// concatenate to its decoding.
fn check(name: &str, tok: &Tokenizer) {
    let table = tok.token_bytes().unwrap();
    let mut compared = 0;
    for (id, entry) in table.iter().enumerate() {
        let Some(TokenBytes { bytes, special }) = entry else {
            continue;
        };
        let Ok(text) = std::str::from_utf8(bytes) else {
            continue;
        };
        let decoded = tok.decode(&[id as u32]).unwrap();
        if *special {
            assert_eq!(
                decoded, "",
                "{name}: special token {id} {text:?} is decoded"
            );
        } else {
            assert_eq!(decoded, text, "{name}: token {id}");
            compared += 1;
        }
    }
    assert!(
        compared > table.len() / 2,
        "{name}: {compared} tokens compared"
    );
    for text in TEXTS {
        let ids = tok.encode_rendered(text).unwrap();
        let decoded = tok.decode(&ids).unwrap();
        let joined: Vec<u8> = ids
            .iter()
            .filter_map(|&id| table[id as usize].as_ref())
            .filter(|t| !t.special)
            .flat_map(|t| t.bytes.iter().copied())
            .collect();
        assert_eq!(
            String::from_utf8_lossy(&joined),
            decoded,
            "{name}: {text:?}"
        );
    }
}

#[test]
#[ignore = "real model: run ci/smollm2.sh first; CI runs it with --include-ignored"]
fn smollm2_token_bytes_are_its_decoding() {
    check(
        "smollm2",
        &tokenizer_in(&root().join("target/models/smollm2-bf16")),
    );
}

#[test]
#[ignore = "real tokenizers: run ci/real-tokenizers.sh first; CI runs it with --include-ignored"]
fn real_tokenizers_token_bytes_are_their_decoding() {
    for name in ["qwen3", "gemma3", "gpt4o"] {
        check(
            name,
            &tokenizer_in(&root().join("target/tokenizers").join(name)),
        );
    }
}
