//! The tokenizer in both directions: `tokenizer.json` (Hugging Face `tokenizers`) ↔ GGUF's
//! `tokenizer.ggml.*` metadata.
//!
//! Kiln carries byte-level BPE tokenizers (GGUF model `gpt2`: GPT-2, SmolLM/SmolLM2, Llama 3,
//! Qwen2). The vocabulary, merges and special tokens map one to one; the pre-tokenizer, which
//! GGUF names instead of describing (`tokenizer.ggml.pre`), is recognised from its structure on
//! export and rebuilt from [`PRE_TOKENIZERS`] on import.

use std::collections::{BTreeMap, HashMap};

use kiln_format::{ModelConfig, TokenizerFiles};
use serde_json::{json, Map, Value as Json};

use super::value::{Array, KeyValues, Value};
use crate::error::{ConvertError, Result};

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

fn byte_level(use_regex: bool) -> Json {
    json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex})
}

fn split(pattern: &str) -> Json {
    json!({"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false})
}

/// `tokenizer.ggml.pre` names Kiln reads and writes, with the `tokenizer.json` pre-tokenizer
/// each stands for.
pub const PRE_TOKENIZERS: &[&str] = &["gpt-2", "default", "smollm", "llama-bpe", "qwen2"];

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
                "Split" if !regex(b) => match a.get("pattern")?.get("Regex")?.as_str()? {
                    p if p == LLAMA3_SPLIT => Some("llama-bpe"),
                    p if p == QWEN2_SPLIT => Some("qwen2"),
                    _ => None,
                },
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

/// The GGUF tokenizer metadata for a `.kiln` file's tokenizer, and notices for the user.
///
/// `vocab_size` tokens are written (the embedding's row count): ids the tokenizer does not
/// define become `[PAD<id>]` tokens of type unused, as llama.cpp's converter writes them.
pub fn to_gguf(
    file: &str,
    tok: &TokenizerFiles,
    config: &ModelConfig,
) -> Result<(KeyValues, Vec<String>)> {
    let mut notices = Vec::new();
    let text = tok
        .tokenizer_json
        .as_deref()
        .ok_or_else(|| unsupported(file, "the file carries no tokenizer.json"))?;
    let tj: Json = serde_json::from_str(text)
        .map_err(|e| unsupported(file, format!("tokenizer.json does not parse: {e}")))?;
    let model = tj.get("model").unwrap_or(&Json::Null);
    let model_type = model.get("type").and_then(Json::as_str).unwrap_or("?");
    let byte_level = has_byte_level(tj.get("pre_tokenizer").unwrap_or(&Json::Null))
        || has_byte_level(tj.get("decoder").unwrap_or(&Json::Null));
    if model_type != "BPE" || !byte_level {
        return Err(unsupported(
            file,
            format!(
                "GGUF export supports byte-level BPE tokenizers (GPT-2, SmolLM2, Llama 3, Qwen2); \
                 this one is a {model_type} model{}",
                if byte_level {
                    ""
                } else {
                    " without a ByteLevel pre-tokenizer"
                }
            ),
        ));
    }
    let vocab = model
        .get("vocab")
        .and_then(Json::as_object)
        .ok_or_else(|| unsupported(file, "tokenizer.json model.vocab is not an object"))?;
    let max_id = |id: u64| -> Result<usize> {
        usize::try_from(id)
            .ok()
            .filter(|&i| i < (1 << 24))
            .ok_or_else(|| unsupported(file, format!("token id {id} is out of range")))
    };
    let mut tokens: Vec<Option<(String, i32)>> = Vec::new();
    let mut put = |id: usize, s: &str, ty: i32| {
        if tokens.len() <= id {
            tokens.resize(id + 1, None);
        }
        tokens[id] = Some((s.to_string(), ty));
    };
    for (s, id) in vocab {
        let id = id
            .as_u64()
            .ok_or_else(|| unsupported(file, format!("vocab entry `{s}` has no integer id")))?;
        put(max_id(id)?, s, token_type::NORMAL);
    }
    for a in tj
        .get("added_tokens")
        .and_then(Json::as_array)
        .map(Vec::as_slice)
        .unwrap_or(&[])
    {
        let (Some(id), Some(content)) = (
            a.get("id").and_then(Json::as_u64),
            a.get("content").and_then(Json::as_str),
        ) else {
            return Err(unsupported(file, format!("malformed added token {a}")));
        };
        let special = a.get("special").and_then(Json::as_bool).unwrap_or(false);
        let ty = if special {
            token_type::CONTROL
        } else {
            token_type::USER_DEFINED
        };
        put(max_id(id)?, content, ty);
    }
    let n = tokens.len().max(config.vocab_size as usize);
    tokens.resize(n, None);
    let mut padded = 0usize;
    let (strings, types): (Vec<String>, Vec<i32>) = tokens
        .into_iter()
        .enumerate()
        .map(|(i, t)| {
            t.unwrap_or_else(|| {
                padded += 1;
                (format!("[PAD{i}]"), token_type::UNUSED)
            })
        })
        .unzip();
    if padded > 0 {
        notices.push(format!(
            "{padded} token id(s) the tokenizer does not define written as [PAD<id>] (unused)"
        ));
    }
    if strings.len() as u64 > config.vocab_size {
        return Err(unsupported(
            file,
            format!(
                "the tokenizer defines {} tokens, more than the model's vocab_size {}",
                strings.len(),
                config.vocab_size
            ),
        ));
    }
    let merges = model
        .get("merges")
        .and_then(Json::as_array)
        .map(Vec::as_slice)
        .unwrap_or(&[])
        .iter()
        .map(|m| match m {
            Json::String(s) => Some(s.clone()),
            Json::Array(p) => match p.as_slice() {
                [Json::String(a), Json::String(b)] => Some(format!("{a} {b}")),
                _ => None,
            },
            _ => None,
        })
        .collect::<Option<Vec<String>>>()
        .ok_or_else(|| unsupported(file, "tokenizer.json has a malformed merge"))?;

    let pre = match tj.get("pre_tokenizer").and_then(recognise_pre) {
        Some(p) => p,
        None => {
            notices.push(
                "pre-tokenizer not recognised; written as \"default\" (GPT-2's split), which \
                 llama.cpp may tokenize differently from the original"
                    .into(),
            );
            "default"
        }
    };
    let id_of = |role: &str| -> Option<u32> {
        let s = tok.special_tokens.get(role)?;
        strings.iter().position(|t| t == s).map(|i| i as u32)
    };
    let mut kv: Vec<(String, Value)> = vec![
        ("tokenizer.ggml.model".into(), Value::Str("gpt2".into())),
        ("tokenizer.ggml.pre".into(), Value::Str(pre.into())),
        (
            "tokenizer.ggml.tokens".into(),
            Value::Array(Array::Str(strings.clone())),
        ),
        (
            "tokenizer.ggml.token_type".into(),
            Value::Array(Array::I32(types)),
        ),
        (
            "tokenizer.ggml.merges".into(),
            Value::Array(Array::Str(merges)),
        ),
    ];
    let bos = config.bos_token_id.or_else(|| id_of("bos_token"));
    let eos = config
        .eos_token_ids
        .first()
        .copied()
        .or_else(|| id_of("eos_token"));
    for (key, id) in [
        ("tokenizer.ggml.bos_token_id", bos),
        ("tokenizer.ggml.eos_token_id", eos),
        ("tokenizer.ggml.unknown_token_id", id_of("unk_token")),
        ("tokenizer.ggml.padding_token_id", id_of("pad_token")),
    ] {
        if let Some(id) = id {
            kv.push((key.into(), Value::U32(id)));
        }
    }
    let add_bos = tok.add_bos_token.unwrap_or_else(|| {
        // No explicit flag: a template post-processor that starts with a special token adds it.
        tj.pointer("/post_processor/single/0/SpecialToken")
            .is_some()
    });
    kv.push(("tokenizer.ggml.add_bos_token".into(), Value::Bool(add_bos)));
    kv.push(("tokenizer.ggml.add_space_prefix".into(), Value::Bool(false)));
    if let Some(t) = &tok.chat_template {
        kv.push(("tokenizer.chat_template".into(), Value::Str(t.clone())));
    }
    Ok((kv, notices))
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

/// Rebuild `tokenizer.json` and `tokenizer_config.json` from GGUF tokenizer metadata.
///
/// `get` looks a metadata key up; `context_length` goes into `model_max_length`.
pub fn from_gguf<'h>(
    file: &str,
    get: &dyn Fn(&str) -> Option<&'h Value>,
    context_length: u64,
) -> Result<TokenizerFiles> {
    let model_key = "tokenizer.ggml.model";
    let model = key(file, get, model_key)?;
    let model = model
        .as_str()
        .ok_or_else(|| wrong(file, model_key, model, "a string"))?;
    if model != "gpt2" {
        return Err(unsupported(
            file,
            format!(
                "GGUF tokenizer model `{model}` is not supported; Kiln imports byte-level BPE \
                 (`gpt2`) tokenizers"
            ),
        ));
    }
    let pre_key = "tokenizer.ggml.pre";
    let pre = match get(pre_key) {
        None => "default",
        Some(v) => v
            .as_str()
            .ok_or_else(|| wrong(file, pre_key, v, "a string"))?,
    };
    let pre_json = pre_tokenizer_json(pre).ok_or_else(|| {
        unsupported(
            file,
            format!(
                "pre-tokenizer `{pre}` ({pre_key}) is not supported; Kiln knows {}",
                PRE_TOKENIZERS.join(", ")
            ),
        )
    })?;
    let tokens_key = "tokenizer.ggml.tokens";
    let tokens = match key(file, get, tokens_key)? {
        Value::Array(Array::Str(t)) => t,
        v => return Err(wrong(file, tokens_key, v, "an array of strings")),
    };
    let types_key = "tokenizer.ggml.token_type";
    let types: Vec<i32> = match get(types_key) {
        None => vec![token_type::NORMAL; tokens.len()],
        Some(Value::Array(Array::I32(t))) if t.len() == tokens.len() => t.clone(),
        Some(v) => {
            return Err(wrong(
                file,
                types_key,
                v,
                &format!("an array of {} i32", tokens.len()),
            ))
        }
    };
    if let Some((i, ty)) = types
        .iter()
        .enumerate()
        .find(|(_, ty)| !(token_type::UNDEFINED..=token_type::BYTE).contains(*ty))
    {
        return Err(ConvertError::GgufKey {
            file: file.to_string(),
            key: types_key.into(),
            reason: format!(
                "token {i} (`{}`) has type {ty}, outside llama_token_type ({}..={})",
                tokens[i],
                token_type::UNDEFINED,
                token_type::BYTE
            ),
        });
    }
    let merges_key = "tokenizer.ggml.merges";
    let merges = match get(merges_key) {
        None => &[][..],
        Some(Value::Array(Array::Str(m))) => m.as_slice(),
        Some(v) => return Err(wrong(file, merges_key, v, "an array of strings")),
    };
    for m in merges {
        if m.split(' ').count() != 2 {
            return Err(ConvertError::GgufKey {
                file: file.to_string(),
                key: merges_key.into(),
                reason: format!("merge `{m}` is not two tokens separated by one space"),
            });
        }
    }
    let mut vocab = Map::new();
    let mut seen: HashMap<&str, usize> = HashMap::new();
    for (i, t) in tokens.iter().enumerate() {
        if let Some(j) = seen.insert(t, i) {
            return Err(unsupported(
                file,
                format!("token `{t}` appears twice in {tokens_key} (ids {j} and {i})"),
            ));
        }
        vocab.insert(t.clone(), json!(i));
    }
    let id = |k: &str| -> Result<Option<u32>> {
        match get(k) {
            None => Ok(None),
            Some(v) => match v.as_u64() {
                Some(i) if (i as usize) < tokens.len() => Ok(Some(i as u32)),
                _ => Err(ConvertError::GgufKey {
                    file: file.to_string(),
                    key: k.to_string(),
                    reason: format!("expected a token id below {}, found {v:?}", tokens.len()),
                }),
            },
        }
    };
    let bos = id("tokenizer.ggml.bos_token_id")?;
    let eos = id("tokenizer.ggml.eos_token_id")?;
    let unk = id("tokenizer.ggml.unknown_token_id")?;
    let pad = id("tokenizer.ggml.padding_token_id")?;
    let add_bos = match get("tokenizer.ggml.add_bos_token") {
        None => false,
        Some(v) => v
            .as_bool()
            .ok_or_else(|| wrong(file, "tokenizer.ggml.add_bos_token", v, "a boolean"))?,
    };
    let chat_template = match get("tokenizer.chat_template") {
        None => None,
        Some(v) => Some(
            v.as_str()
                .ok_or_else(|| wrong(file, "tokenizer.chat_template", v, "a string"))?
                .to_string(),
        ),
    };

    let mut added = Vec::new();
    let mut decoder = Map::new();
    for (i, (t, &ty)) in tokens.iter().zip(&types).enumerate() {
        if ty == token_type::CONTROL || ty == token_type::USER_DEFINED {
            let special = ty == token_type::CONTROL;
            let entry = json!({"id": i, "content": t, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": special});
            added.push(entry);
            decoder.insert(
                i.to_string(),
                json!({"content": t, "lstrip": false, "normalized": false, "rstrip": false,
                    "single_word": false, "special": special}),
            );
        }
    }
    let tokenizer_json = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre_json,
        "post_processor": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true},
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab, "merges": merges},
    });
    let mut special_tokens = BTreeMap::new();
    let name = |i: Option<u32>| i.map(|i| tokens[i as usize].clone());
    for (role, i) in [
        ("bos_token", bos),
        ("eos_token", eos),
        ("pad_token", pad),
        ("unk_token", unk),
    ] {
        if let Some(s) = name(i) {
            special_tokens.insert(role.to_string(), s);
        }
    }
    let mut config = json!({
        "add_bos_token": add_bos,
        "add_eos_token": false,
        "add_prefix_space": false,
        "added_tokens_decoder": decoder,
        "clean_up_tokenization_spaces": false,
        "model_max_length": context_length,
        "tokenizer_class": "GPT2Tokenizer",
    });
    for (role, s) in &special_tokens {
        config[role] = json!(s);
    }
    if let Some(t) = &chat_template {
        config["chat_template"] = json!(t);
    }
    Ok(TokenizerFiles {
        tokenizer_json: Some(serde_json::to_string(&tokenizer_json).expect("serializable")),
        tokenizer_config_json: Some(
            serde_json::to_string_pretty(&config).expect("serializable") + "\n",
        ),
        chat_template,
        special_tokens,
        add_bos_token: Some(add_bos),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

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
