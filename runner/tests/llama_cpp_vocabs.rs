//! Real tokenizers against transformers through Kiln's GGUF import: llama.cpp's vocabulary
//! test files (`ggml-vocab-<name>.gguf`, converted from each model's Hugging Face tokenizer,
//! with `.inp` texts and the `.out` ids transformers' `AutoTokenizer` gave for them,
//! `add_special_tokens=False`), and Phi-3's chat templates against transformers'
//! `apply_chat_template` (`fixtures/tokenizers/phi3.json`, written by
//! `fixtures/tokenizers/make_expected.py`).
//!
//! Each vocabulary goes through `kiln_convert::gguf::read_tokenizer` (what `kiln-convert gguf`
//! embeds), the `.kiln` metadata's JSON round trip and `Tokenizer::from_parts` (what
//! `kiln-run` reads back). A vocabulary Kiln imports must give transformers' ids on every
//! text; one it does not must be refused with `UnsupportedTokenizer` naming what is missing,
//! never imported with other ids. [`VOCABS`] says which is which.
//!
//! NEEDS `target/tokenizers/{phi3,llama-cpp-vocab}/` (from the `llama-cpp-python` sdist on
//! PyPI, fetched by `ci/llama-cpp-vocabs.sh`, not committed), so every test here is
//! `#[ignore]`d: `cargo test -- --include-ignored` runs them (CI does), and a run without the
//! files fails with a message saying how to fetch them.

mod common;

use std::path::PathBuf;

use common::root;
use kiln_convert::ConvertError;
use kiln_format::TokenizerFiles;
use kiln_runner::{ChatTemplate, Tokenizer};
use serde_json::Value;
use sha2::{Digest, Sha256};

/// What Kiln must do with a vocabulary.
#[derive(Debug, Clone, Copy)]
enum Expect {
    /// Import it and give transformers' ids on every text.
    Agree,
    /// Refuse it (`UnsupportedTokenizer`) with a message containing this.
    Refuse(&'static str),
}

/// Every vocabulary with tests in the vendored llama.cpp: the directory under
/// target/tokenizers/, the name, and what Kiln must do.
const VOCABS: &[(&str, &str, Expect)] = &[
    // SentencePiece (GGUF model `llama`) rebuilt as Hugging Face's Llama tokenizer.
    ("phi3", "phi-3", Expect::Agree),
    ("llama-cpp-vocab", "llama-spm", Expect::Agree),
    // Byte-level BPE with a pre-tokenizer Kiln knows.
    ("llama-cpp-vocab", "gpt-2", Expect::Agree),
    ("llama-cpp-vocab", "llama-bpe", Expect::Agree),
    ("llama-cpp-vocab", "qwen2", Expect::Agree),
    // Byte-level BPE whose pre-tokenizer (a regex llama.cpp names) Kiln does not rebuild.
    (
        "llama-cpp-vocab",
        "command-r",
        Expect::Refuse("`command-r`"),
    ),
    (
        "llama-cpp-vocab",
        "deepseek-coder",
        Expect::Refuse("`deepseek-coder`"),
    ),
    (
        "llama-cpp-vocab",
        "deepseek-llm",
        Expect::Refuse("`deepseek-llm`"),
    ),
    ("llama-cpp-vocab", "falcon", Expect::Refuse("`falcon`")),
    ("llama-cpp-vocab", "mpt", Expect::Refuse("`mpt`")),
    ("llama-cpp-vocab", "qwen35", Expect::Refuse("`qwen35`")),
    ("llama-cpp-vocab", "refact", Expect::Refuse("`refact`")),
    (
        "llama-cpp-vocab",
        "starcoder",
        Expect::Refuse("`starcoder`"),
    ),
    // Other tokenizer models.
    // WordPiece (GGUF model `bert`) rebuilt as BERT's tokenizer.
    ("llama-cpp-vocab", "bert-bge", Expect::Agree),
    ("llama-cpp-vocab", "gemma-4", Expect::Refuse("`gemma4`")),
];

/// The separator between texts in a `.inp` file (llama.cpp's convert_hf_to_gguf_update.py
/// writes each text followed by it; tests/test-tokenizer-0.cpp splits on it).
const SEPARATOR: &str = "\n__ggml_vocab_test__\n";

/// Fewest texts a `.inp` file holds, so a truncated file is noticed.
const MIN_TEXTS: usize = 40;

fn dir(name: &str) -> PathBuf {
    root().join("target/tokenizers").join(name)
}

fn read(path: &std::path::Path) -> Vec<u8> {
    std::fs::read(path).unwrap_or_else(|e| {
        panic!(
            "{}: {e}; run ci/llama-cpp-vocabs.sh to fetch it",
            path.display()
        )
    })
}

/// The texts of a `.inp` file and the ids of its `.out` file, paired.
fn cases(gguf: &std::path::Path) -> Vec<(String, Vec<u32>)> {
    let inp = String::from_utf8(read(&gguf.with_extension("gguf.inp"))).unwrap();
    let out = String::from_utf8(read(&gguf.with_extension("gguf.out"))).unwrap();
    let mut texts = Vec::new();
    let mut rest = inp.as_str();
    while !rest.is_empty() {
        let (text, after) = rest.split_once(SEPARATOR).unwrap_or((rest, ""));
        texts.push(text.to_string());
        rest = after;
    }
    let ids: Vec<Vec<u32>> = out
        .lines()
        .map(|l| l.split_whitespace().map(|i| i.parse().unwrap()).collect())
        .collect();
    assert_eq!(
        texts.len(),
        ids.len(),
        "{}: .inp and .out disagree on the number of texts",
        gguf.display()
    );
    texts.into_iter().zip(ids).collect()
}

/// Kiln's tokenizer for a GGUF vocabulary, as `kiln-convert gguf` embeds it and `kiln-run`
/// reads it back.
fn import(gguf: &std::path::Path) -> Result<(TokenizerFiles, Tokenizer), ConvertError> {
    let files = kiln_convert::gguf::read_tokenizer(gguf)?;
    // The .kiln metadata is JSON: what the runner reads is this round trip.
    let files: TokenizerFiles =
        serde_json::from_str(&serde_json::to_string(&files).unwrap()).unwrap();
    let tok = Tokenizer::from_parts(&gguf.display().to_string(), &files, None, &[]).unwrap();
    Ok((files, tok))
}

#[test]
#[ignore = "real tokenizers: run ci/llama-cpp-vocabs.sh first; CI runs it with --include-ignored"]
fn llama_cpp_vocabularies_match_transformers_or_are_refused() {
    let mut report = Vec::new();
    let mut bad = Vec::new();
    for &(sub, name, expect) in VOCABS {
        let gguf = dir(sub).join(format!("ggml-vocab-{name}.gguf"));
        let cases = cases(&gguf);
        assert!(
            cases.len() >= MIN_TEXTS,
            "{name}: only {} texts",
            cases.len()
        );
        match (import(&gguf), expect) {
            (Ok((_, tok)), Expect::Agree) => {
                let mut differ = 0;
                for (text, want) in &cases {
                    let got = tok.encode_rendered(text).unwrap();
                    if &got != want {
                        differ += 1;
                        bad.push(format!(
                            "{name}: {text:?}: kiln {got:?}, transformers {want:?}"
                        ));
                    }
                }
                report.push(format!(
                    "{name}: {} of {} texts agree",
                    cases.len() - differ,
                    cases.len()
                ));
            }
            (Err(ConvertError::UnsupportedTokenizer { reason, .. }), Expect::Refuse(says)) => {
                if !reason.contains(says) {
                    bad.push(format!("{name}: refused without naming {says}: {reason}"));
                }
                report.push(format!("{name}: refused ({reason})"));
            }
            (Ok(_), Expect::Refuse(_)) => bad.push(format!(
                "{name}: imported, but Kiln is not known to tokenize it as transformers does; \
                 check its ids and move it to Expect::Agree"
            )),
            (Err(e), _) => bad.push(format!("{name}: {e}")),
        }
    }
    eprintln!("{}", report.join("\n"));
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

/// Phi-3's fixture, its files checked against the hashes it was made from.
fn phi3_fixture() -> Value {
    let expected: Value = serde_json::from_slice(
        &std::fs::read(root().join("fixtures/tokenizers/phi3.json")).unwrap(),
    )
    .unwrap();
    for (file, want) in expected["files_sha256"].as_object().unwrap() {
        let path = dir("phi3").join(file);
        let got = format!("{:x}", Sha256::digest(read(&path)));
        assert_eq!(
            got,
            want.as_str().unwrap(),
            "{} is not the file fixtures/tokenizers/phi3.json was made from; \
             run ci/llama-cpp-vocabs.sh again",
            path.display()
        );
    }
    expected
}

/// Phi-3.5-mini-instruct's template (llama.cpp's models/templates/) and the one embedded in
/// ggml-vocab-phi-3.gguf (Phi-3-mini-4k-instruct's), with the special tokens Kiln's import
/// gives, render as transformers renders them.
#[test]
#[ignore = "real tokenizers: run ci/llama-cpp-vocabs.sh first; CI runs it with --include-ignored"]
fn phi3_chat_templates_match_transformers() {
    let expected = phi3_fixture();
    let (files, _) = import(&dir("phi3").join("ggml-vocab-phi-3.gguf")).unwrap();
    let special: serde_json::Map<String, Value> = files
        .special_tokens
        .iter()
        .map(|(k, v)| (k.clone(), Value::from(v.as_str())))
        .collect();
    assert_eq!(
        &special,
        expected["special_tokens"].as_object().unwrap(),
        "the import's special tokens are the ones transformers rendered with"
    );
    let source = String::from_utf8(read(&dir("phi3").join("phi3.5-mini-instruct.jinja"))).unwrap();
    let mut bad = Vec::new();
    for (what, source, key) in [
        ("phi-3.5-mini-instruct", source.as_str(), "chats"),
        (
            "ggml-vocab-phi-3.gguf",
            files.chat_template.as_deref().unwrap(),
            "gguf_template_chats",
        ),
    ] {
        let template = ChatTemplate::from_source(source, &files.special_tokens, what).unwrap();
        let cases = expected[key].as_array().unwrap();
        assert!(
            cases.len() >= 12,
            "{key}: only {} conversations",
            cases.len()
        );
        bad.extend(common::compare_chats(
            &format!("{what} "),
            &template,
            cases,
            &|_, _| None,
        ));
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}
