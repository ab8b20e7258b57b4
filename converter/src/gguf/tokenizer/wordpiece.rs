//! BERT's WordPiece tokenizer ↔ GGUF's `bert` tokenizer model, as llama.cpp writes and reads it.
//!
//! llama.cpp stores a WordPiece vocabulary in "phantom space" spelling: a token that starts a
//! word gets `▁` in front, a continuation (`##ing`) loses its `##`, and control tokens
//! (`[CLS]`, `[SEP]`, …) stay as they are. Its tokenizer lowercases (when
//! `tokenizer.ggml.normalizer.lowercase` says so), splits on blanks and punctuation, and
//! matches the longest vocabulary entry, which is what Hugging Face's `BertNormalizer`,
//! `BertPreTokenizer` and `WordPiece` model do. Import rebuilds that `tokenizer.json`, with the
//! `[CLS] … [SEP]` template the file's BOS and separator ids name; export writes it back.

use std::collections::BTreeMap;

use kiln_format::TokenizerFiles;
use serde_json::{json, Map, Value as Json};

use super::super::value::{Array, Value};
use super::{key, token_type, unsupported, wrong};
use crate::error::Result;

/// llama.cpp's word-start marker.
const PHANTOM: char = '\u{2581}';
/// Hugging Face's continuation prefix.
const CONTINUATION: &str = "##";

/// Rebuild a BERT tokenizer from GGUF `tokenizer.ggml.*` keys (`tokenizer.ggml.model = bert`).
pub(super) fn from_gguf<'h>(
    file: &str,
    get: &dyn Fn(&str) -> Option<&'h Value>,
    context_length: u64,
) -> Result<TokenizerFiles> {
    let tokens_key = "tokenizer.ggml.tokens";
    let tokens = match key(file, get, tokens_key)? {
        Value::Array(Array::Str(t)) => t,
        v => return Err(wrong(file, tokens_key, v, "an array of strings")),
    };
    let types = super::from_gguf::token_types(file, get, tokens)?;
    let ids = BertIds::from_gguf(file, get, tokens.len())?;
    let lowercase = match get("tokenizer.ggml.normalizer.lowercase") {
        None => true,
        Some(Value::Bool(b)) => *b,
        Some(v) => {
            return Err(wrong(
                file,
                "tokenizer.ggml.normalizer.lowercase",
                v,
                "a bool",
            ))
        }
    };
    let (vocab, added) = wordpiece_vocabulary(file, tokens, &types)?;
    let name = |i: u32| tokens[i as usize].clone();
    let tokenizer = bert_tokenizer_json(tokens, &ids, vocab, added, lowercase);
    let (cls_s, sep_s, unk_s) = (name(ids.cls), name(ids.sep), name(ids.unk));
    let mut special_tokens = BTreeMap::new();
    special_tokens.insert("cls_token".to_string(), cls_s.clone());
    special_tokens.insert("sep_token".to_string(), sep_s.clone());
    special_tokens.insert("unk_token".to_string(), unk_s.clone());
    if let Some(p) = ids.pad {
        special_tokens.insert("pad_token".to_string(), name(p));
    }
    if let Some(m) = ids.mask {
        special_tokens.insert("mask_token".to_string(), name(m));
    }
    let mut config = Map::new();
    config.insert("tokenizer_class".into(), json!("BertTokenizer"));
    config.insert("do_lower_case".into(), json!(lowercase));
    config.insert("model_max_length".into(), json!(context_length));
    for (k, v) in &special_tokens {
        config.insert(k.clone(), json!(v));
    }
    Ok(TokenizerFiles {
        tokenizer_json: Some(serde_json::to_string(&tokenizer).expect("serializable")),
        tokenizer_config_json: Some(
            serde_json::to_string_pretty(&Json::Object(config)).expect("serializable") + "\n",
        ),
        chat_template: None,
        special_tokens,
        // The template adds [CLS]; no BOS besides.
        add_bos_token: Some(false),
    })
}

/// The special tokens of a `bert` vocabulary, by id.
struct BertIds {
    cls: u32,
    sep: u32,
    unk: u32,
    pad: Option<u32>,
    mask: Option<u32>,
}

impl BertIds {
    /// The ids the GGUF keys give, or llama.cpp's defaults for a `bert` vocabulary when the
    /// file leaves a key out; [CLS], [SEP] and [UNK] are required.
    fn from_gguf<'h>(
        file: &str,
        get: &dyn Fn(&str) -> Option<&'h Value>,
        n_tokens: usize,
    ) -> Result<BertIds> {
        // A default outside this vocabulary counts as absent.
        let id = |k: &str, default: Option<u32>| -> Result<Option<u32>> {
            match get(k) {
                None => Ok(default.filter(|&d| (d as usize) < n_tokens)),
                Some(v) => match v.as_u64().and_then(|n| u32::try_from(n).ok()) {
                    Some(n) if (n as usize) < n_tokens => Ok(Some(n)),
                    _ => Err(wrong(file, k, v, "a token id inside the vocabulary")),
                },
            }
        };
        let cls = id("tokenizer.ggml.bos_token_id", Some(101))?;
        let sep = id("tokenizer.ggml.seperator_token_id", Some(102))?
            .or(id("tokenizer.ggml.eos_token_id", None)?);
        let unk = id("tokenizer.ggml.unknown_token_id", Some(100))?;
        let pad = id("tokenizer.ggml.padding_token_id", Some(0))?;
        let mask = id("tokenizer.ggml.mask_token_id", Some(103))?;
        let (Some(cls), Some(sep), Some(unk)) = (cls, sep, unk) else {
            return Err(unsupported(
                file,
                "a bert vocabulary needs [CLS], [SEP] and [UNK] ids",
            ));
        };
        Ok(BertIds {
            cls,
            sep,
            unk,
            pad,
            mask,
        })
    }
}

/// The WordPiece vocabulary (a word start without `▁`, a continuation with `##`) and the
/// added special tokens; two tokens spelled alike are refused.
fn wordpiece_vocabulary(
    file: &str,
    tokens: &[String],
    types: &[i32],
) -> Result<(Map<String, Json>, Vec<Json>)> {
    let mut vocab = Map::new();
    let mut added = Vec::new();
    for (i, (t, &ty)) in tokens.iter().zip(types).enumerate() {
        let spelled = if ty == token_type::CONTROL {
            added.push(
                json!({"id": i, "content": t, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": true}),
            );
            t.clone()
        } else if let Some(word) = t.strip_prefix(PHANTOM) {
            word.to_string()
        } else {
            format!("{CONTINUATION}{t}")
        };
        if vocab.insert(spelled.clone(), json!(i)).is_some() {
            return Err(unsupported(
                file,
                format!("token {i} (`{t}`) spells `{spelled}`, as an earlier token does"),
            ));
        }
    }
    Ok((vocab, added))
}

/// BERT's `tokenizer.json`: its normalizer and pre-tokenizer, `[CLS] A [SEP]` templates and
/// the WordPiece model.
fn bert_tokenizer_json(
    tokens: &[String],
    ids: &BertIds,
    vocab: Map<String, Json>,
    added: Vec<Json>,
    lowercase: bool,
) -> Json {
    let name = |i: u32| tokens[i as usize].clone();
    let (cls, sep) = (ids.cls, ids.sep);
    let (cls_s, sep_s, unk_s) = (name(cls), name(sep), name(ids.unk));
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": {"type": "BertNormalizer", "clean_text": true, "handle_chinese_chars": true,
            "strip_accents": null, "lowercase": lowercase},
        "pre_tokenizer": {"type": "BertPreTokenizer"},
        "post_processor": {"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": cls_s, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                       {"SpecialToken": {"id": sep_s, "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": cls_s, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": sep_s, "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}},
                     {"SpecialToken": {"id": sep_s, "type_id": 1}}],
            "special_tokens": {
                cls_s.clone(): {"id": cls_s, "ids": [cls], "tokens": [cls_s]},
                sep_s.clone(): {"id": sep_s, "ids": [sep], "tokens": [sep_s]}}},
        "decoder": {"type": "WordPiece", "prefix": CONTINUATION, "cleanup": true},
        "model": {"type": "WordPiece", "unk_token": unk_s, "continuing_subword_prefix": CONTINUATION,
            "max_input_chars_per_word": 100, "vocab": vocab},
    })
}

/// A Hugging Face WordPiece `tokenizer.json` (`tj`) as GGUF `tokenizer.ggml.*` keys, spelled as
/// llama.cpp's converter spells them. `special` names the roles (`cls_token`, `sep_token`, …).
pub(super) fn to_gguf(
    file: &str,
    tj: &Json,
    special: &BTreeMap<String, String>,
    vocab_size: u64,
) -> Result<Vec<(String, Value)>> {
    check_bert_wordpiece(file, tj)?;
    let lowercase = tj
        .pointer("/normalizer/lowercase")
        .and_then(Json::as_bool)
        .unwrap_or(true);
    let vocab = tj["model"]
        .get("vocab")
        .and_then(Json::as_object)
        .ok_or_else(|| unsupported(file, "tokenizer.json model.vocab is not an object"))?;
    let (tokens, types) = gguf_vocabulary(file, tj, vocab, vocab_size)?;
    let id_of = |role: &str| -> Option<u32> {
        let s = special.get(role)?;
        vocab.get(s).and_then(Json::as_u64).map(|i| i as u32)
    };
    let mut kv = vec![
        (
            "tokenizer.ggml.model".to_string(),
            Value::Str("bert".into()),
        ),
        (
            "tokenizer.ggml.pre".to_string(),
            Value::Str("default".into()),
        ),
        (
            "tokenizer.ggml.tokens".to_string(),
            Value::Array(Array::Str(tokens)),
        ),
        (
            "tokenizer.ggml.token_type".to_string(),
            Value::Array(Array::I32(types)),
        ),
    ];
    for (k, role) in [
        ("tokenizer.ggml.bos_token_id", "cls_token"),
        ("tokenizer.ggml.eos_token_id", "sep_token"),
        ("tokenizer.ggml.seperator_token_id", "sep_token"),
        ("tokenizer.ggml.unknown_token_id", "unk_token"),
        ("tokenizer.ggml.padding_token_id", "pad_token"),
        ("tokenizer.ggml.mask_token_id", "mask_token"),
    ] {
        if let Some(id) = id_of(role) {
            kv.push((k.to_string(), Value::U32(id)));
        }
    }
    kv.push(("tokenizer.ggml.add_bos_token".into(), Value::Bool(true)));
    kv.push(("tokenizer.ggml.add_eos_token".into(), Value::Bool(true)));
    kv.push((
        "tokenizer.ggml.normalizer.lowercase".into(),
        Value::Bool(lowercase),
    ));
    Ok(kv)
}

/// GGUF's `bert` tokenizer is BERT's: `##` continuations, the BertNormalizer and the
/// BertPreTokenizer; any other WordPiece tokenizer is refused.
fn check_bert_wordpiece(file: &str, tj: &Json) -> Result<()> {
    if tj["model"]
        .get("continuing_subword_prefix")
        .and_then(Json::as_str)
        != Some(CONTINUATION)
    {
        return Err(unsupported(
            file,
            "a WordPiece tokenizer whose continuation prefix is not `##`",
        ));
    }
    if tj.pointer("/normalizer/type").and_then(Json::as_str) != Some("BertNormalizer")
        || tj.pointer("/pre_tokenizer/type").and_then(Json::as_str) != Some("BertPreTokenizer")
    {
        return Err(unsupported(
            file,
            "GGUF's `bert` tokenizer is BERT's: a WordPiece tokenizer.json needs the \
             BertNormalizer and BertPreTokenizer",
        ));
    }
    Ok(())
}

/// The `vocab_size` tokens as GGUF spells them (a word start after `▁`, a continuation
/// without `##`, a special token as it is) with their types.
fn gguf_vocabulary(
    file: &str,
    tj: &Json,
    vocab: &Map<String, Json>,
    vocab_size: u64,
) -> Result<(Vec<String>, Vec<i32>)> {
    let n = usize::try_from(vocab_size).unwrap_or(usize::MAX);
    let mut tokens: Vec<Option<String>> = vec![None; n.min(1 << 24)];
    let control: Vec<&str> = tj
        .get("added_tokens")
        .and_then(Json::as_array)
        .map(Vec::as_slice)
        .unwrap_or(&[])
        .iter()
        .filter(|a| a.get("special").and_then(Json::as_bool) == Some(true))
        .filter_map(|a| a.get("content").and_then(Json::as_str))
        .collect();
    let mut types = vec![token_type::NORMAL; tokens.len()];
    for (s, id) in vocab {
        let i = id
            .as_u64()
            .and_then(|i| usize::try_from(i).ok())
            .filter(|&i| i < tokens.len())
            .ok_or_else(|| {
                unsupported(
                    file,
                    format!("vocab entry `{s}` has no id below {vocab_size}"),
                )
            })?;
        let spelled = if control.contains(&s.as_str()) {
            types[i] = token_type::CONTROL;
            s.clone()
        } else if let Some(rest) = s.strip_prefix(CONTINUATION) {
            rest.to_string()
        } else {
            format!("{PHANTOM}{s}")
        };
        tokens[i] = Some(spelled);
    }
    // Ids the vocabulary leaves out (a padded embedding): unused, as llama.cpp's converter
    // writes them.
    let tokens: Vec<String> = tokens
        .into_iter()
        .enumerate()
        .map(|(i, t)| {
            t.unwrap_or_else(|| {
                types[i] = token_type::UNUSED;
                format!("[PAD{i}]")
            })
        })
        .collect();
    Ok((tokens, types))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::str::FromStr;

    /// A small BERT tokenizer.json, as transformers writes all-MiniLM's.
    fn bert_json() -> Json {
        let words = [
            "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "quick", "brown", "fox", "jump",
            "##s", "##ed", "over", "lazy", "dog", ".", ",", "!", "un", "##believ", "##able", "a",
        ];
        let vocab: Map<String, Json> = words
            .iter()
            .enumerate()
            .map(|(i, w)| (w.to_string(), json!(i)))
            .collect();
        let special = |id: usize, s: &str| {
            json!({"id": id, "content": s, "single_word": false, "lstrip": false, "rstrip": false,
                   "normalized": false, "special": true})
        };
        json!({
            "version": "1.0", "truncation": null, "padding": null,
            "added_tokens": [special(0, "[PAD]"), special(1, "[UNK]"), special(2, "[CLS]"),
                             special(3, "[SEP]"), special(4, "[MASK]")],
            "normalizer": {"type": "BertNormalizer", "clean_text": true, "handle_chinese_chars": true,
                           "strip_accents": null, "lowercase": true},
            "pre_tokenizer": {"type": "BertPreTokenizer"},
            "post_processor": {"type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": "[CLS]", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                           {"SpecialToken": {"id": "[SEP]", "type_id": 0}}],
                "pair": [{"SpecialToken": {"id": "[CLS]", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                         {"SpecialToken": {"id": "[SEP]", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}},
                         {"SpecialToken": {"id": "[SEP]", "type_id": 1}}],
                "special_tokens": {"[CLS]": {"id": "[CLS]", "ids": [2], "tokens": ["[CLS]"]},
                                   "[SEP]": {"id": "[SEP]", "ids": [3], "tokens": ["[SEP]"]}}},
            "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": true},
            "model": {"type": "WordPiece", "unk_token": "[UNK]", "continuing_subword_prefix": "##",
                      "max_input_chars_per_word": 100, "vocab": vocab},
        })
    }

    /// Export then import gives a tokenizer that encodes every text as the original does, and
    /// the GGUF spelling is llama.cpp's phantom-space one.
    #[test]
    fn a_bert_tokenizer_survives_gguf_both_ways() {
        let tj = bert_json();
        let special: BTreeMap<String, String> = [
            ("cls_token", "[CLS]"),
            ("sep_token", "[SEP]"),
            ("unk_token", "[UNK]"),
            ("pad_token", "[PAD]"),
            ("mask_token", "[MASK]"),
        ]
        .into_iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect();
        let kv: HashMap<String, Value> = to_gguf("t.kiln", &tj, &special, 24)
            .unwrap()
            .into_iter()
            .collect();
        let Value::Array(Array::Str(tokens)) = &kv["tokenizer.ggml.tokens"] else {
            panic!("tokens")
        };
        assert_eq!(tokens.len(), 24, "padded to the model's vocabulary");
        assert_eq!(tokens[2], "[CLS]");
        assert_eq!(tokens[5], "\u{2581}the");
        assert_eq!(tokens[10], "s");
        assert_eq!(tokens[23], "[PAD23]");
        assert_eq!(kv["tokenizer.ggml.bos_token_id"], Value::U32(2));
        assert_eq!(kv["tokenizer.ggml.seperator_token_id"], Value::U32(3));
        let back = from_gguf("t.gguf", &|k| kv.get(k), 512).unwrap();
        let original = tokenizers::Tokenizer::from_str(&tj.to_string()).unwrap();
        let rebuilt =
            tokenizers::Tokenizer::from_str(back.tokenizer_json.as_deref().unwrap()).unwrap();
        for text in [
            "The quick brown fox jumps over the lazy dog.",
            "UNBELIEVABLE, a fox jumped!",
            "zebra",
            "",
        ] {
            let a = original.encode(text, true).unwrap();
            let b = rebuilt.encode(text, true).unwrap();
            assert_eq!(a.get_ids(), b.get_ids(), "{text:?}");
        }
        assert_eq!(back.special_tokens["cls_token"], "[CLS]");
    }

    #[test]
    fn refuses_what_is_not_bert() {
        let mut tj = bert_json();
        tj["pre_tokenizer"] = json!({"type": "Whitespace"});
        let e = to_gguf("t.kiln", &tj, &BTreeMap::new(), 22)
            .unwrap_err()
            .to_string();
        assert!(e.contains("BertPreTokenizer"), "{e}");
        let kv: HashMap<String, Value> = HashMap::from([
            (
                "tokenizer.ggml.tokens".to_string(),
                Value::Array(Array::Str(vec!["a".into()])),
            ),
            ("tokenizer.ggml.bos_token_id".to_string(), Value::U32(5)),
        ]);
        let e = from_gguf("t.gguf", &|k| kv.get(k), 8)
            .unwrap_err()
            .to_string();
        assert!(e.contains("bos_token_id"), "{e}");
        // Without the id keys, llama.cpp's defaults (101, 102, 100) are past this vocabulary.
        let kv: HashMap<String, Value> = HashMap::from([(
            "tokenizer.ggml.tokens".to_string(),
            Value::Array(Array::Str(vec!["a".into()])),
        )]);
        let e = from_gguf("t.gguf", &|k| kv.get(k), 8)
            .unwrap_err()
            .to_string();
        assert!(e.contains("[CLS], [SEP] and [UNK]"), "{e}");
    }
}
