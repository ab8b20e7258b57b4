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

use std::collections::{BTreeMap, HashMap};

use kiln_format::{ModelConfig, TokenizerFiles};
use serde_json::{json, Map, Value as Json};

use super::sentencepiece::{
    gemma_spelling, merges_by_score, merges_from_vocab, sentencepiece_scores,
};
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
    // Gemma's: BPE over `▁`-spelled text with byte fallback, written as llama.cpp's
    // SentencePiece vocabulary (only for a family whose row says its import reads it back:
    // `GgufSpec::sentencepiece_vocab`, Gemma 3).
    let sentencepiece = model_type == "BPE"
        && !byte_level
        && config.architecture.spec().gguf.sentencepiece_vocab
        && model.get("byte_fallback").and_then(Json::as_bool) == Some(true)
        && tj.get("normalizer")
            == Some(&json!({"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"}));
    if model_type != "BPE" || !(byte_level || sentencepiece) {
        return Err(unsupported(
            file,
            format!(
                "GGUF export supports byte-level BPE tokenizers (GPT-2, SmolLM2, Llama 3, Qwen2) \
                 and Gemma's; this one is a {model_type} model{}",
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
        None if sentencepiece => "default",
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
    let mut kv: Vec<(String, Value)> = if sentencepiece {
        let (scores, types, notice) = sentencepiece_scores(&strings, types, &merges);
        notices.extend(notice);
        vec![
            ("tokenizer.ggml.model".into(), Value::Str("llama".into())),
            ("tokenizer.ggml.pre".into(), Value::Str(pre.into())),
            (
                "tokenizer.ggml.tokens".into(),
                Value::Array(Array::Str(strings.clone())),
            ),
            (
                "tokenizer.ggml.scores".into(),
                Value::Array(Array::F32(scores)),
            ),
            (
                "tokenizer.ggml.token_type".into(),
                Value::Array(Array::I32(types)),
            ),
        ]
    } else {
        vec![
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
        ]
    };
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

/// The tokenizer families GGUF import rebuilds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Flavour {
    /// `tokenizer.ggml.model = gpt2`: byte-level BPE, merges in the file.
    ByteLevel,
    /// `tokenizer.ggml.model = llama` in a `gemma3` file: SentencePiece BPE with byte fallback,
    /// rebuilt as transformers' `GemmaTokenizer` is from the same file.
    Gemma,
    /// `tokenizer.ggml.model = llama` in any other file (Llama 2, Mistral v0.1, Phi-3):
    /// SentencePiece BPE with byte fallback, rebuilt as transformers' `LlamaConverter` writes
    /// the `tokenizer.json` of the same model (merges ranked by score, `▁` prepended).
    Llama,
}

/// The flavour of tokenizer a file describes, or why it cannot be rebuilt.
fn flavour(file: &str, model: &str, arch: &str) -> Result<Flavour> {
    match (model, arch) {
        ("gpt2", _) => Ok(Flavour::ByteLevel),
        // A family whose row says its vocabulary is SentencePiece's (`gemma3`).
        ("llama", a)
            if kiln_format::FamilySpec::from_gguf(a)
                .is_some_and(|s| s.gguf.sentencepiece_vocab) =>
        {
            Ok(Flavour::Gemma)
        }
        // Gemma 1 and 2 spell and rank their vocabularies as Gemma 3 does, which only the
        // `gemma3` rebuild has been checked against: a wrong id would go unnoticed.
        ("llama", a) if a.starts_with("gemma") => Err(unsupported(
            file,
            format!(
                "GGUF tokenizer model `llama` (SentencePiece) of architecture `{arch}` is not \
                 supported; Kiln rebuilds Gemma's vocabulary for `gemma3` files only \
                 (convert the Hugging Face checkpoint instead)"
            ),
        )),
        ("llama", _) => Ok(Flavour::Llama),
        _ => Err(unsupported(
            file,
            format!(
                "GGUF tokenizer model `{model}` is not supported; Kiln imports byte-level BPE \
                 (`gpt2`) and SentencePiece (`llama`) tokenizers"
            ),
        )),
    }
}

/// The `post_processor` that puts `bos` (the token spelled `s`) before every encoding.
fn bos_processor(s: &str, bos: u32) -> Json {
    json!({"type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": s, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": s, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                 {"SpecialToken": {"id": s, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {s: {"id": s, "ids": [bos], "tokens": [s]}}})
}

/// Rebuild `tokenizer.json` and `tokenizer_config.json` from GGUF tokenizer metadata.
///
/// `get` looks a metadata key up; `arch` is the file's `general.architecture`, which decides
/// how a SentencePiece vocabulary is read; `context_length` goes into `model_max_length`.
pub fn from_gguf<'h>(
    file: &str,
    get: &dyn Fn(&str) -> Option<&'h Value>,
    arch: &str,
    context_length: u64,
) -> Result<TokenizerFiles> {
    let model_key = "tokenizer.ggml.model";
    let model = key(file, get, model_key)?;
    let model = model
        .as_str()
        .ok_or_else(|| wrong(file, model_key, model, "a string"))?;
    let flavour = flavour(file, model, arch)?;
    let pre_key = "tokenizer.ggml.pre";
    let pre = match get(pre_key) {
        None => "default",
        Some(v) => v
            .as_str()
            .ok_or_else(|| wrong(file, pre_key, v, "a string"))?,
    };
    let pre_json = match flavour {
        // SentencePiece splits nothing before its merges; `pre` names the vocabulary's origin.
        Flavour::Gemma => {
            json!({"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious", "invert": false})
        }
        Flavour::Llama => Json::Null,
        Flavour::ByteLevel => pre_tokenizer_json(pre).ok_or_else(|| {
            unsupported(
                file,
                format!(
                    "pre-tokenizer `{pre}` ({pre_key}) is not supported; Kiln knows {}",
                    PRE_TOKENIZERS.join(", ")
                ),
            )
        })?,
    };
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
    let file_merges = match get(merges_key) {
        None => None,
        Some(Value::Array(Array::Str(m))) => Some(m.as_slice()),
        Some(v) => return Err(wrong(file, merges_key, v, "an array of strings")),
    };
    let mut pairs: Vec<(String, String)> = Vec::new();
    for m in file_merges.unwrap_or(&[]) {
        match m.split_once(' ') {
            Some((a, b)) if !b.contains(' ') => pairs.push((a.to_string(), b.to_string())),
            _ => {
                return Err(ConvertError::GgufKey {
                    file: file.to_string(),
                    key: merges_key.into(),
                    reason: format!("merge `{m}` is not two tokens separated by one space"),
                })
            }
        }
    }
    let spelled: Vec<String> = match flavour {
        Flavour::ByteLevel | Flavour::Llama => tokens.clone(),
        Flavour::Gemma => tokens
            .iter()
            .map(|t| gemma_spelling(t).into_owned())
            .collect(),
    };
    let mut vocab = Map::new();
    let mut seen: HashMap<&str, usize> = HashMap::new();
    for (i, t) in spelled.iter().enumerate() {
        if let Some(j) = seen.insert(t, i) {
            return Err(unsupported(
                file,
                format!("token `{t}` appears twice in {tokens_key} (ids {j} and {i})"),
            ));
        }
        vocab.insert(t.clone(), json!(i));
    }
    if flavour == Flavour::Gemma && file_merges.is_none() {
        pairs = merges_from_vocab(&spelled, &seen);
    }
    if flavour == Flavour::Llama && file_merges.is_none() {
        let scores_key = "tokenizer.ggml.scores";
        let scores = match key(file, get, scores_key)? {
            Value::Array(Array::F32(s)) if s.len() == tokens.len() => s,
            v => {
                return Err(wrong(
                    file,
                    scores_key,
                    v,
                    &format!("an array of {} f32", tokens.len()),
                ))
            }
        };
        pairs = merges_by_score(&spelled, scores, &seen);
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
        // llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise.
        None => flavour != Flavour::ByteLevel,
        Some(v) => v
            .as_bool()
            .ok_or_else(|| wrong(file, "tokenizer.ggml.add_bos_token", v, "a boolean"))?,
    };
    let space_key = "tokenizer.ggml.add_space_prefix";
    let add_space_prefix = match get(space_key) {
        // llama.cpp prepends a space to SentencePiece text unless told not to.
        None => true,
        Some(v) => v
            .as_bool()
            .ok_or_else(|| wrong(file, space_key, v, "a boolean"))?,
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
        // A user-defined token whose spelling the vocabulary respelled is not added whole,
        // as transformers skips it: its respelled form is reached through the merges.
        // Llama's `<unk>` is typed unknown, and is a special token in its tokenizer.json.
        let unk_special =
            flavour == Flavour::Llama && ty == token_type::UNKNOWN && unk == Some(i as u32);
        let kept = ty == token_type::CONTROL
            || unk_special
            || (ty == token_type::USER_DEFINED && seen.contains_key(t.as_str()));
        if kept {
            let special = ty == token_type::CONTROL || unk_special;
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
    let merges: Vec<Json> = pairs.into_iter().map(|(a, b)| json!([a, b])).collect();
    // Llama 3's BPE takes a whole pre-tokenized word that is itself a token without merging
    // (`ignore_merges` in its tokenizer.json; llama.cpp sets it for `llama-bpe`): " Việt" is
    // one token there, three through the merges.
    let ignore_merges = pre == "llama-bpe";
    let tokenizer_json = match flavour {
        Flavour::ByteLevel => json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": added,
            "normalizer": null,
            "pre_tokenizer": pre_json,
            "post_processor": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true},
            "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
            "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": ignore_merges,
                "vocab": vocab, "merges": merges},
        }),
        Flavour::Gemma | Flavour::Llama => {
            let post = match bos.filter(|_| add_bos) {
                None => Json::Null,
                Some(b) => bos_processor(&tokens[b as usize], b),
            };
            let replace =
                json!({"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"});
            let mut decoders = vec![
                json!({"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "}),
                json!({"type": "ByteFallback"}),
                json!({"type": "Fuse"}),
            ];
            // Llama: every text (each piece between added tokens, as Hugging Face's legacy
            // Llama tokenizer does) gets a `▁` in front, and decoding strips one leading space.
            let normalizer = if flavour == Flavour::Llama && add_space_prefix {
                decoders.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
                json!({"type": "Sequence", "normalizers": [
                    {"type": "Prepend", "prepend": "\u{2581}"}, replace]})
            } else {
                replace
            };
            json!({
                "version": "1.0",
                "truncation": null,
                "padding": null,
                "added_tokens": added,
                "normalizer": normalizer,
                "pre_tokenizer": pre_json,
                "post_processor": post,
                "decoder": {"type": "Sequence", "decoders": decoders},
                "model": {"type": "BPE", "dropout": null, "unk_token": unk.map(|u| tokens[u as usize].clone()),
                    "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": true,
                    "byte_fallback": true, "ignore_merges": false, "vocab": vocab, "merges": merges},
            })
        }
    };
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
        "tokenizer_class": match flavour {
            Flavour::ByteLevel => "GPT2Tokenizer",
            Flavour::Gemma => "GemmaTokenizer",
            Flavour::Llama => "LlamaTokenizer",
        },
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
        kv.insert("tokenizer.ggml.model".into(), Value::Str("bert".into()));
        let e = from_gguf("b.gguf", &|k| kv.get(k), "bert", 64).unwrap_err();
        assert!(
            matches!(&e, ConvertError::UnsupportedTokenizer { reason, .. } if reason.contains("`bert`")),
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
