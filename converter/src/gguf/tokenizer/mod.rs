//! The tokenizer in both directions: `tokenizer.json` (Hugging Face `tokenizers`) ↔ GGUF's
//! `tokenizer.ggml.*` metadata.
//!
//! Kiln carries byte-level BPE tokenizers (GGUF model `gpt2`: GPT-2, SmolLM/SmolLM2, Llama 3,
//! Qwen2). The vocabulary, merges and special tokens map one to one; the pre-tokenizer, which
//! GGUF names instead of describing (`tokenizer.ggml.pre`), is recognised from its structure on
//! export and rebuilt from [`PRE_TOKENIZERS`] on import.
//!
//! Gemma 3's tokenizer travels as a SentencePiece vocabulary (GGUF model `llama`: scored
//! tokens, no merges). Import rebuilds it as the BPE-with-byte-fallback `tokenizer.json`
//! transformers builds from the same file (merges recovered from the vocabulary in token order,
//! blanks respelled); export writes a Gemma `tokenizer.json` back as scored tokens, each scoring
//! minus the rank of the first merge that makes it, which llama.cpp's SentencePiece tokenizer
//! joins in the same order.
//!
//! Other SentencePiece vocabularies (Llama 2, Mistral v0.1, Phi-3) are imported as the
//! `tokenizer.json` transformers' `LlamaConverter` writes from the same model: BPE with byte
//! fallback, merges ranked by the score of the token they make, `▁` prepended to the text
//! (Hugging Face's "legacy" Llama tokenizer, which Phi-3's `tokenizer.json` is).

//!
//! [`to_gguf`] writes the export direction; [`from_gguf`] the import direction, whose
//! SentencePiece flavours are told apart by the family's row
//! ([`kiln_format::family::GgufSpec::sentencepiece_vocab`]).

mod from_gguf;
mod to_gguf;
mod wordpiece;

use serde_json::{json, Value as Json};

use super::value::Value;
use crate::error::{ConvertError, Result};

pub use from_gguf::from_gguf;
pub use to_gguf::to_gguf;

/// GGUF token types (`llama_token_type`).
pub mod token_type {
    pub const UNDEFINED: i32 = 0;
    pub const NORMAL: i32 = 1;
    pub const UNKNOWN: i32 = 2;
    pub const CONTROL: i32 = 3;
    pub const USER_DEFINED: i32 = 4;
    pub const UNUSED: i32 = 5;
    pub const BYTE: i32 = 6;
}

/// Llama 3's split pattern (`tokenizer.ggml.pre = "llama-bpe"`).
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2's split pattern (`tokenizer.ggml.pre = "qwen2"`): Llama 3's with single digits.
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// GPT-4o's split pattern (`o200k`; `tokenizer.ggml.pre = "gpt-4o"`), which Phi-4-mini's
/// tokenizer uses: cased words with their apostrophe suffixes, numbers in threes, and no
/// `ignore_merges` (llama.cpp sets it only for Llama 3's).
const GPT4O_SPLIT: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";

fn byte_level(use_regex: bool) -> Json {
    json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex})
}

fn split(pattern: &str) -> Json {
    json!({"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false})
}

/// `tokenizer.ggml.pre` names Kiln reads and writes, with the `tokenizer.json` pre-tokenizer
/// each stands for.
pub const PRE_TOKENIZERS: &[&str] = &["gpt-2", "default", "smollm", "llama-bpe", "qwen2", "gpt-4o"];

fn pre_tokenizer_json(pre: &str) -> Option<Json> {
    Some(match pre {
        "gpt-2" | "default" => byte_level(true),
        "smollm" => json!({"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": true}, byte_level(true)]}),
        "llama-bpe" => {
            json!({"type": "Sequence", "pretokenizers": [split(LLAMA3_SPLIT), byte_level(false)]})
        }
        "qwen2" => {
            json!({"type": "Sequence", "pretokenizers": [split(QWEN2_SPLIT), byte_level(false)]})
        }
        "gpt-4o" => {
            json!({"type": "Sequence", "pretokenizers": [split(GPT4O_SPLIT), byte_level(false)]})
        }
        _ => return None,
    })
}

/// Recognise a `tokenizer.json` pre-tokenizer; `None` if it is none of [`PRE_TOKENIZERS`].
fn recognise_pre(pre: &Json) -> Option<&'static str> {
    let ty = pre.get("type").and_then(Json::as_str)?;
    let regex = |p: &Json| p.get("use_regex").and_then(Json::as_bool).unwrap_or(true);
    match ty {
        "ByteLevel" if regex(pre) => Some("gpt-2"),
        "Sequence" => {
            let parts = pre.get("pretokenizers")?.as_array()?;
            let [a, b] = parts.as_slice() else {
                return None;
            };
            let (ta, tb) = (a.get("type")?.as_str()?, b.get("type")?.as_str()?);
            if tb != "ByteLevel" {
                return None;
            }
            match ta {
                "Digits"
                    if a.get("individual_digits").and_then(Json::as_bool) == Some(true)
                        && regex(b) =>
                {
                    Some("smollm")
                }
                // A pattern that matches every character splits the same way whether the
                // matches are isolated or the gaps removed and the result inverted (as
                // tiktoken-derived files such as GPT-4o's write it).
                "Split"
                    if !regex(b)
                        && matches!(
                            (a.get("behavior")?.as_str()?, a.get("invert")?.as_bool()?),
                            ("Isolated", false) | ("Removed", true)
                        ) =>
                {
                    match a.get("pattern")?.get("Regex")?.as_str()? {
                        p if p == LLAMA3_SPLIT => Some("llama-bpe"),
                        p if p == QWEN2_SPLIT => Some("qwen2"),
                        p if p == GPT4O_SPLIT => Some("gpt-4o"),
                        _ => None,
                    }
                }
                _ => None,
            }
        }
        _ => None,
    }
}

fn unsupported(file: &str, reason: impl Into<String>) -> ConvertError {
    ConvertError::UnsupportedTokenizer {
        file: file.to_string(),
        reason: reason.into(),
    }
}

fn has_byte_level(v: &Json) -> bool {
    match v.get("type").and_then(Json::as_str) {
        Some("ByteLevel") => true,
        Some("Sequence") => ["pretokenizers", "decoders"].iter().any(|k| {
            v.get(*k)
                .and_then(Json::as_array)
                .is_some_and(|a| a.iter().any(has_byte_level))
        }),
        _ => false,
    }
}

fn key<'h>(file: &str, get: &dyn Fn(&str) -> Option<&'h Value>, k: &str) -> Result<&'h Value> {
    get(k).ok_or_else(|| ConvertError::GgufKey {
        file: file.to_string(),
        key: k.to_string(),
        reason: "missing".into(),
    })
}

fn wrong(file: &str, k: &str, v: &Value, want: &str) -> ConvertError {
    ConvertError::GgufKey {
        file: file.to_string(),
        key: k.to_string(),
        reason: format!("expected {want}, found {}", v.type_name()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::value::Array;
    use std::collections::HashMap;

    fn strs(v: &[&str]) -> Value {
        Value::Array(Array::Str(v.iter().map(|s| s.to_string()).collect()))
    }

    /// A SentencePiece vocabulary as a `gemma3` GGUF stores it: no merges, blanks as spaces.
    fn gemma_keys(tokens: &[&str], types: &[i32]) -> HashMap<String, Value> {
        HashMap::from([
            (
                "tokenizer.ggml.model".to_string(),
                Value::Str("llama".into()),
            ),
            ("tokenizer.ggml.tokens".to_string(), strs(tokens)),
            (
                "tokenizer.ggml.token_type".to_string(),
                Value::Array(Array::I32(types.to_vec())),
            ),
            ("tokenizer.ggml.bos_token_id".to_string(), Value::U32(1)),
            ("tokenizer.ggml.unknown_token_id".to_string(), Value::U32(0)),
        ])
    }

    #[test]
    fn gemma_vocabulary_becomes_bpe_with_merges_in_token_order() {
        use token_type::{CONTROL, NORMAL, USER_DEFINED};
        let tokens = [
            "<unk>", "<bos>", "a", "b", "c", "ab", "abc", "bc", "  ", "\u{2581}", "\n",
        ];
        let types = [
            CONTROL,
            CONTROL,
            NORMAL,
            NORMAL,
            NORMAL,
            NORMAL,
            NORMAL,
            NORMAL,
            USER_DEFINED,
            NORMAL,
            USER_DEFINED,
        ];
        let kv = gemma_keys(&tokens, &types);
        let t = from_gguf("g.gguf", &|k| kv.get(k), "gemma3", 64).unwrap();
        let j: Json = serde_json::from_str(t.tokenizer_json.as_deref().unwrap()).unwrap();
        // "  " is respelled "▁▁", so it merges from two "▁" and is not an added token.
        assert_eq!(j["model"]["vocab"]["\u{2581}\u{2581}"], json!(8));
        assert_eq!(
            j["model"]["merges"],
            json!([
                ["a", "b"],
                ["ab", "c"],
                ["a", "bc"],
                ["b", "c"],
                ["\u{2581}", "\u{2581}"]
            ])
        );
        let added: Vec<(&str, bool)> = j["added_tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| {
                (
                    a["content"].as_str().unwrap(),
                    a["special"].as_bool().unwrap(),
                )
            })
            .collect();
        assert_eq!(added, [("<unk>", true), ("<bos>", true), ("\n", false)]);
        assert_eq!(j["model"]["byte_fallback"], json!(true));
        assert_eq!(
            j["post_processor"]["single"][0]["SpecialToken"]["id"],
            json!("<bos>")
        );
        assert_eq!(
            t.add_bos_token,
            Some(true),
            "SentencePiece adds BOS unless told not to"
        );
        let tok: tokenizers::Tokenizer = t.tokenizer_json.unwrap().parse().unwrap();
        let ids = tok.encode("abc  ab\n", true).unwrap().get_ids().to_vec();
        assert_eq!(ids, [1, 6, 8, 5, 10]);
    }

    /// `add_eos_token` (a decoder-based embedder's) rebuilds a post-processor that appends the
    /// EOS after BOS and the text; without an EOS id it is refused, naming the key.
    #[test]
    fn add_eos_token_appends_the_eos_and_needs_one() {
        let tokens = ["<unk>", "<bos>", "<eos>", "a", "b", "ab"];
        let types = [3, 3, 3, 1, 1, 1];
        let mut kv = gemma_keys(&tokens, &types);
        kv.insert("tokenizer.ggml.add_eos_token".into(), Value::Bool(true));
        let e = from_gguf("g.gguf", &|k| kv.get(k), "gemma3", 64)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("g.gguf") && e.contains("tokenizer.ggml.add_eos_token"),
            "{e}"
        );
        kv.insert("tokenizer.ggml.eos_token_id".into(), Value::U32(2));
        let t = from_gguf("g.gguf", &|k| kv.get(k), "gemma3", 64).unwrap();
        let tok: tokenizers::Tokenizer = t.tokenizer_json.unwrap().parse().unwrap();
        assert_eq!(tok.encode("ab", true).unwrap().get_ids(), [1, 5, 2]);
        assert_eq!(tok.encode("ab", false).unwrap().get_ids(), [5]);
        let config: Json = serde_json::from_str(&t.tokenizer_config_json.unwrap()).unwrap();
        assert_eq!(config["add_eos_token"], json!(true));
        kv.insert("tokenizer.ggml.add_eos_token".into(), Value::U32(1));
        let e = from_gguf("g.gguf", &|k| kv.get(k), "gemma3", 64)
            .unwrap_err()
            .to_string();
        assert!(e.contains("tokenizer.ggml.add_eos_token"), "{e}");
    }

    #[test]
    fn gemma_before_3_is_refused_naming_the_architecture() {
        let kv = gemma_keys(&["<unk>", "<bos>"], &[3, 3]);
        let e = from_gguf("g2.gguf", &|k| kv.get(k), "gemma2", 64).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("g2.gguf") && msg.contains("`gemma2`"), "{msg}");
        assert!(msg.contains("gemma3"), "{msg}");
    }

    #[test]
    fn unknown_tokenizer_model_is_refused_naming_it() {
        let mut kv = gemma_keys(&["<unk>", "<bos>"], &[3, 3]);
        kv.insert("tokenizer.ggml.model".into(), Value::Str("t5".into()));
        let e = from_gguf("b.gguf", &|k| kv.get(k), "t5", 64).unwrap_err();
        assert!(
            matches!(&e, ConvertError::UnsupportedTokenizer { reason, .. } if reason.contains("`t5`")),
            "{e}"
        );
    }

    /// A Llama 2 style vocabulary: scored pieces, `▁▁` added by hand with the worst score.
    fn llama_keys() -> HashMap<String, Value> {
        use token_type::{BYTE, CONTROL, NORMAL, UNKNOWN};
        let tokens = [
            "<unk>",
            "<s>",
            "</s>",
            "<0x0A>",
            "\u{2581}\u{2581}",
            "\u{2581}",
            "H",
            "i",
            "\u{2581}H",
            "\u{2581}Hi",
        ];
        let types = [
            UNKNOWN, CONTROL, CONTROL, BYTE, NORMAL, NORMAL, NORMAL, NORMAL, NORMAL, NORMAL,
        ];
        let scores = [0.0, 0.0, 0.0, 0.0, -1e9, -1.0, -2.0, -3.0, -4.0, -5.0];
        let mut kv = gemma_keys(&tokens, &types);
        kv.insert(
            "tokenizer.ggml.scores".into(),
            Value::Array(Array::F32(scores.to_vec())),
        );
        kv
    }

    #[test]
    fn llama_vocabulary_becomes_bpe_with_merges_by_score() {
        let kv = llama_keys();
        let t = from_gguf("l.gguf", &|k| kv.get(k), "llama", 64).unwrap();
        let j: Json = serde_json::from_str(t.tokenizer_json.as_deref().unwrap()).unwrap();
        // `▁▁` is token 4 but scores worst: its merge comes last.
        assert_eq!(
            j["model"]["merges"],
            json!([
                ["\u{2581}", "H"],
                ["\u{2581}H", "i"],
                ["\u{2581}", "\u{2581}"]
            ])
        );
        let added: Vec<(&str, bool)> = j["added_tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| {
                (
                    a["content"].as_str().unwrap(),
                    a["special"].as_bool().unwrap(),
                )
            })
            .collect();
        assert_eq!(added, [("<unk>", true), ("<s>", true), ("</s>", true)]);
        assert_eq!(t.add_bos_token, Some(true));
        let tok: tokenizers::Tokenizer = t.tokenizer_json.unwrap().parse().unwrap();
        // `▁` is prepended: " Hi" is `▁▁Hi`, joined as `▁` `▁Hi` (not `▁▁` `H` `i`).
        let enc = tok.encode(" Hi\n", true).unwrap();
        assert_eq!(enc.get_ids(), [1, 5, 9, 3]);
        assert_eq!(tok.decode(enc.get_ids(), true).unwrap(), " Hi\n");
        assert_eq!(tok.encode("", false).unwrap().get_ids(), [0u32; 0]);
    }

    #[test]
    fn llama_vocabulary_without_space_prefix_or_scores() {
        let mut kv = llama_keys();
        kv.insert("tokenizer.ggml.add_space_prefix".into(), Value::Bool(false));
        let t = from_gguf("l.gguf", &|k| kv.get(k), "phi3", 64).unwrap();
        let tok: tokenizers::Tokenizer = t.tokenizer_json.unwrap().parse().unwrap();
        assert_eq!(tok.encode("Hi", false).unwrap().get_ids(), [6, 7]);
        kv.remove("tokenizer.ggml.scores");
        let e = from_gguf("l.gguf", &|k| kv.get(k), "phi3", 64).unwrap_err();
        assert!(
            matches!(&e, ConvertError::GgufKey { key, .. } if key == "tokenizer.ggml.scores"),
            "{e}"
        );
    }

    /// Regression: a Llama 3 vocabulary imported with `ignore_merges` off tokenized " Việt"
    /// as three tokens where transformers gives one (llama.cpp's ggml-vocab-llama-bpe test).
    #[test]
    fn llama3_byte_level_vocabulary_ignores_merges_for_whole_tokens() {
        for (pre, want) in [("llama-bpe", true), ("qwen2", false), ("gpt-2", false)] {
            let kv = HashMap::from([
                (
                    "tokenizer.ggml.model".to_string(),
                    Value::Str("gpt2".into()),
                ),
                ("tokenizer.ggml.pre".to_string(), Value::Str(pre.into())),
                (
                    "tokenizer.ggml.tokens".to_string(),
                    strs(&["a", "b", "c", "ab", "abc"]),
                ),
                ("tokenizer.ggml.merges".to_string(), strs(&["a b"])),
            ]);
            let t = from_gguf("b.gguf", &|k| kv.get(k), "llama", 64).unwrap();
            let tok: tokenizers::Tokenizer = t.tokenizer_json.unwrap().parse().unwrap();
            let ids = tok.encode("abc", false).unwrap().get_ids().to_vec();
            assert_eq!(ids == [4], want, "{pre}: {ids:?}");
        }
    }

    #[test]
    fn every_pre_tokenizer_is_recognised_from_its_own_json() {
        for pre in PRE_TOKENIZERS {
            let j = pre_tokenizer_json(pre).unwrap();
            let want = if *pre == "default" { "gpt-2" } else { pre };
            assert_eq!(recognise_pre(&j), Some(want), "{pre}");
        }
        assert_eq!(recognise_pre(&json!({"type": "Whitespace"})), None);
        assert_eq!(
            recognise_pre(
                &json!({"type": "Sequence", "pretokenizers": [split("\\w+"), byte_level(false)]})
            ),
            None
        );
        assert!(pre_tokenizer_json("tekken").is_none());
    }
}
