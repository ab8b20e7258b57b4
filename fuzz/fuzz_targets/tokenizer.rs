//! Fuzz target for tokenizer loading (`kiln-run`, `kiln-verify`) from a crafted
//! `tokenizer.json`, as embedded in a `.kiln` file.
//!
//! Each input is the `tokenizer.json` text, optionally followed by a NUL byte and the
//! `tokenizer_config.json` text (its role tokens are marked special at load). When it loads, a few texts (specials, digits,
//! whitespace runs, unicode) are encoded and decoded, and streamed back token by token: a
//! file that loads must never make a later step panic.
//!
//! Loading catches a panic inside the `tokenizers` crate and reports it as an error (it has
//! them: a syntax error inside `"decoder"` was one), so the target puts back Rust's default
//! panic hook, under which a caught panic is not a crash; a panic that escapes Kiln still is.
#![no_main]

use kiln_format::TokenizerFiles;
use kiln_runner::Tokenizer;
use libfuzzer_sys::fuzz_target;

const TEXTS: [&str; 4] = [
    "Hello, world! 12345",
    "  tabs\tand\n\nnewlines  ",
    "Ünïcödé 東京 👩‍👩‍👧",
    "<s>[INST] hi [/INST]</s><|im_start|>",
];

fuzz_target!(
    init: {
        // libfuzzer-sys's hook aborts on every panic, caught or not.
        let _ = std::panic::take_hook();
    },
    |data: &[u8]| {
        let Ok(text) = std::str::from_utf8(data) else {
            return;
        };
        let (json, config) = match text.split_once('\0') {
            Some((json, config)) => (json, Some(config.to_string())),
            None => (text, None),
        };
        let files = TokenizerFiles {
            tokenizer_json: Some(json.to_string()),
            tokenizer_config_json: config,
            ..TokenizerFiles::default()
        };
        let Ok(t) = Tokenizer::from_parts("fuzz.kiln", &files, Some(0), &[1]) else {
            return;
        };
        for text in TEXTS {
            if let Ok(ids) = t.encode(text) {
                let _ = t.decode(&ids);
                let mut stream = t.stream();
                for &id in ids.iter().take(64) {
                    let _ = stream.push(id);
                }
                let _ = stream.finish();
            }
            let _ = t.encode_rendered(text);
        }
    }
);
