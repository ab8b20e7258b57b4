//! `tokenizer.json` → GGUF's `tokenizer.ggml.*`: the vocabulary, merges (or SentencePiece
//! scores), token types and special tokens of a byte-level BPE or Gemma tokenizer.

use kiln_format::{ModelConfig, TokenizerFiles};
use serde_json::{json, Value as Json};

use super::super::sentencepiece::sentencepiece_scores;
use super::super::value::{Array, KeyValues, Value};
use super::{has_byte_level, recognise_pre, token_type, unsupported};
use crate::error::Result;

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
    if model_type == "WordPiece" {
        let kv = super::wordpiece::to_gguf(file, &tj, &tok.special_tokens, config.vocab_size)?;
        return Ok((kv, notices));
    }
    let sentencepiece = is_sentencepiece_bpe(file, &tj, config)?;
    let (strings, types) = vocabulary(file, &tj, config.vocab_size, &mut notices)?;
    let merges = merges(file, model)?;
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
    let mut kv = if sentencepiece {
        let (scores, types, notice) = sentencepiece_scores(&strings, types, &merges);
        notices.extend(notice);
        sentencepiece_vocabulary_keys(pre, strings.clone(), scores, types)
    } else {
        bpe_vocabulary_keys(pre, strings.clone(), types, merges)
    };
    let bos = config.bos_token_id.or_else(|| id_of("bos_token"));
    let eos = config
        .eos_token_ids
        .first()
        .copied()
        .or_else(|| id_of("eos_token"));
    let (eos, add_eos) = appended_eos(file, &tj, &strings, eos, config, &mut notices)?;
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
    kv.push(("tokenizer.ggml.add_eos_token".into(), Value::Bool(add_eos)));
    kv.push(("tokenizer.ggml.add_space_prefix".into(), Value::Bool(false)));
    if let Some(t) = &tok.chat_template {
        kv.push(("tokenizer.chat_template".into(), Value::Str(t.clone())));
    }
    Ok((kv, notices))
}

/// Whether a (non-WordPiece) tokenizer is written as a SentencePiece vocabulary (true) or as
/// byte-level BPE (false); anything else is refused.
fn is_sentencepiece_bpe(file: &str, tj: &Json, config: &ModelConfig) -> Result<bool> {
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
    Ok(sentencepiece)
}

/// Every token's text and GGUF type by id: the model's vocabulary, then the added tokens, with
/// the ids up to `vocab_size` the tokenizer does not define padded (and a notice saying so).
fn vocabulary(
    file: &str,
    tj: &Json,
    vocab_size: u64,
    notices: &mut Vec<String>,
) -> Result<(Vec<String>, Vec<i32>)> {
    let vocab = tj
        .get("model")
        .unwrap_or(&Json::Null)
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
    let (strings, types) = pad_undefined(tokens, vocab_size, notices);
    if strings.len() as u64 > vocab_size {
        return Err(unsupported(
            file,
            format!(
                "the tokenizer defines {} tokens, more than the model's vocab_size {}",
                strings.len(),
                vocab_size
            ),
        ));
    }
    Ok((strings, types))
}

/// The tokens up to `vocab_size`, the ids the tokenizer does not define written as
/// `[PAD<id>]` of type unused (with a notice saying how many).
fn pad_undefined(
    mut tokens: Vec<Option<(String, i32)>>,
    vocab_size: u64,
    notices: &mut Vec<String>,
) -> (Vec<String>, Vec<i32>) {
    let n = tokens.len().max(vocab_size as usize);
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
    (strings, types)
}

/// The BPE merges as GGUF spells them (`"a b"`), from either of `tokenizer.json`'s spellings.
fn merges(file: &str, model: &Json) -> Result<Vec<String>> {
    model
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
        .ok_or_else(|| unsupported(file, "tokenizer.json has a malformed merge"))
}

/// The vocabulary keys of llama.cpp's SentencePiece (`llama`) tokenizer.
fn sentencepiece_vocabulary_keys(
    pre: &str,
    strings: Vec<String>,
    scores: Vec<f32>,
    types: Vec<i32>,
) -> Vec<(String, Value)> {
    vec![
        ("tokenizer.ggml.model".into(), Value::Str("llama".into())),
        ("tokenizer.ggml.pre".into(), Value::Str(pre.into())),
        (
            "tokenizer.ggml.tokens".into(),
            Value::Array(Array::Str(strings)),
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
}

/// The vocabulary keys of llama.cpp's byte-level BPE (`gpt2`) tokenizer.
fn bpe_vocabulary_keys(
    pre: &str,
    strings: Vec<String>,
    types: Vec<i32>,
    merges: Vec<String>,
) -> Vec<(String, Value)> {
    vec![
        ("tokenizer.ggml.model".into(), Value::Str("gpt2".into())),
        ("tokenizer.ggml.pre".into(), Value::Str(pre.into())),
        (
            "tokenizer.ggml.tokens".into(),
            Value::Array(Array::Str(strings)),
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
}

/// The EOS to write and whether GGUF's `add_eos_token` is set.
///
/// A template that puts a special token after the text (Qwen3-Embedding's `<|endoftext|>`)
/// is GGUF's `add_eos_token`, which llama.cpp and Kiln's import both honour: that token
/// must then be the EOS. An embedding model does not generate, so its EOS becomes the
/// appended token; a decoder whose EOS (where generation stops) is another token is
/// refused rather than written with either meaning lost.
fn appended_eos(
    file: &str,
    tj: &Json,
    strings: &[String],
    mut eos: Option<u32>,
    config: &ModelConfig,
    notices: &mut Vec<String>,
) -> Result<(Option<u32>, bool)> {
    let add_eos = match appended_token(tj) {
        Appended::Nothing => false,
        Appended::Other(why) => {
            let why = format!("the tokenizer's post-processor {why}, which GGUF cannot state");
            return Err(unsupported(file, format!("{why}; use the .kiln file")));
        }
        Appended::One(t) => {
            let id = strings.iter().position(|s| *s == t).map(|i| i as u32);
            let Some(id) = id else {
                return Err(unsupported(
                    file,
                    format!("the tokenizer's post-processor appends `{t}`, which is not in its vocabulary"),
                ));
            };
            if eos != Some(id) {
                if config.family.embedding.is_none() {
                    return Err(unsupported(
                        file,
                        format!(
                            "the tokenizer's post-processor appends `{t}` to every text, but the \
                             model's end-of-sequence token is another; GGUF appends only its EOS \
                             (use the .kiln file)"
                        ),
                    ));
                }
                if let Some(old) = eos {
                    notices.push(format!(
                        "EOS written as `{t}` (id {id}), the token the tokenizer appends to every \
                         text, instead of id {old}: llama.cpp appends its EOS"
                    ));
                }
                eos = Some(id);
            }
            true
        }
    };
    Ok((eos, add_eos))
}

/// What a `tokenizer.json`'s post-processor puts after a single text.
#[derive(Debug, PartialEq)]
enum Appended {
    Nothing,
    /// One special token (by its text).
    One(String),
    /// Something GGUF cannot say, described.
    Other(String),
}

/// The tokens a template post-processor (at the top or inside a `Sequence` of processors)
/// appends after the text of a single input.
fn appended_token(tj: &Json) -> Appended {
    let post = tj.get("post_processor").unwrap_or(&Json::Null);
    let templates: Vec<&Json> = match post.get("type").and_then(Json::as_str) {
        Some("TemplateProcessing") => vec![post],
        Some("Sequence") => post
            .get("processors")
            .and_then(Json::as_array)
            .map(|ps| {
                ps.iter()
                    .filter(|p| p.get("type").and_then(Json::as_str) == Some("TemplateProcessing"))
                    .collect()
            })
            .unwrap_or_default(),
        _ => Vec::new(),
    };
    let mut found = Appended::Nothing;
    for t in templates {
        let Some(single) = t.get("single").and_then(Json::as_array) else {
            continue;
        };
        let after: Vec<&Json> = single
            .iter()
            .skip_while(|p| p.get("Sequence").is_none())
            .skip(1)
            .collect();
        let token = |p: &Json| {
            p.pointer("/SpecialToken/id")
                .and_then(Json::as_str)
                .map(str::to_string)
        };
        match (after.as_slice(), &found) {
            ([], _) => {}
            ([p], Appended::Nothing) => match token(p) {
                // A special token whose template entry expands to several ids is not one EOS.
                Some(s)
                    if t.pointer(&format!(
                        "/special_tokens/{}/ids",
                        s.replace('~', "~0").replace('/', "~1")
                    ))
                    .and_then(Json::as_array)
                    .is_none_or(|ids| ids.len() == 1) =>
                {
                    found = Appended::One(s)
                }
                _ => return Appended::Other(format!("puts {p} after every text")),
            },
            _ => {
                return Appended::Other(format!("appends {} pieces after every text", after.len()))
            }
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    fn post(p: Json) -> Json {
        json!({ "post_processor": p })
    }

    fn template(single: Json, specials: Json) -> Json {
        json!({"type": "TemplateProcessing", "single": single, "pair": [], "special_tokens": specials})
    }

    #[test]
    fn the_token_a_template_appends_is_found_at_the_top_or_in_a_sequence() {
        let a = json!({"Sequence": {"id": "A", "type_id": 0}});
        let tok = |s: &str| json!({"SpecialToken": {"id": s, "type_id": 0}});
        let one = |s: &str| json!({ s: {"id": s, "ids": [7], "tokens": [s]} });
        let byte_level = json!({"type": "ByteLevel", "add_prefix_space": true});
        assert_eq!(appended_token(&json!({})), Appended::Nothing);
        assert_eq!(appended_token(&post(byte_level.clone())), Appended::Nothing);
        // BOS only: nothing after the text.
        let bos_only = template(json!([tok("<s>"), a]), one("<s>"));
        assert_eq!(appended_token(&post(bos_only)), Appended::Nothing);
        let eos = template(json!([a, tok("<|endoftext|>")]), one("<|endoftext|>"));
        assert_eq!(
            appended_token(&post(eos.clone())),
            Appended::One("<|endoftext|>".into())
        );
        let seq = json!({"type": "Sequence", "processors": [byte_level, eos]});
        assert_eq!(
            appended_token(&post(seq)),
            Appended::One("<|endoftext|>".into())
        );
        // Two tokens after the text, or one that stands for two ids: not one EOS.
        let two = template(json!([a, tok("</s>"), tok("</s>")]), one("</s>"));
        assert!(matches!(appended_token(&post(two)), Appended::Other(_)));
        let wide = template(
            json!([a, tok("<sep>")]),
            json!({"<sep>": {"id": "<sep>", "ids": [3, 4], "tokens": ["<", "sep>"]}}),
        );
        assert!(matches!(appended_token(&post(wide)), Appended::Other(_)));
        let text_after = template(
            json!([a, {"Sequence": {"id": "B", "type_id": 1}}]),
            json!({}),
        );
        assert!(matches!(
            appended_token(&post(text_after)),
            Appended::Other(_)
        ));
    }
}
