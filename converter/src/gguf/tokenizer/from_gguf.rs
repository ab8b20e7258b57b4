//! GGUF → `tokenizer.json` and `tokenizer_config.json`: the vocabulary, merges and special
//! tokens of `tokenizer.ggml.*` rebuilt as the tokenizer transformers builds from the same
//! file, in steps: the flavour ([`flavour`]), the vocabulary and its merges ([`Vocabulary`]),
//! the special tokens and flags ([`Specials`]), then the two files.

use std::collections::{BTreeMap, HashMap};

use kiln_format::TokenizerFiles;
use serde_json::{json, Map, Value as Json};

use super::super::sentencepiece::{gemma_spelling, merges_by_score, merges_from_vocab};
use super::super::value::{Array, Value};
use super::{key, pre_tokenizer_json, token_type, unsupported, wrong, PRE_TOKENIZERS};
use crate::error::{ConvertError, Result};

/// A metadata lookup: the value of a key, if the file has it.
type Get<'g, 'h> = &'g dyn Fn(&str) -> Option<&'h Value>;

/// The tokenizer families GGUF import rebuilds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Flavour {
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
pub(super) fn flavour(file: &str, model: &str, arch: &str) -> Result<Flavour> {
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
                 (`gpt2`), SentencePiece (`llama`) and WordPiece (`bert`) tokenizers"
            ),
        )),
    }
}

/// The `post_processor` that puts `bos` before every encoding and `eos` after it (each a
/// token's spelling and id, where given), as transformers' templates do: `[bos] A [eos]`,
/// and for a pair `[bos] A [eos] [bos] B [eos]`.
pub(super) fn template_processor(bos: Option<(&str, u32)>, eos: Option<(&str, u32)>) -> Json {
    let special = |t: Option<(&str, u32)>, type_id: u32| {
        t.map(|(s, _)| json!({"SpecialToken": {"id": s, "type_id": type_id}}))
    };
    let seq = |id: &str, type_id: u32| Some(json!({"Sequence": {"id": id, "type_id": type_id}}));
    let single: Vec<Json> = [special(bos, 0), seq("A", 0), special(eos, 0)]
        .into_iter()
        .flatten()
        .collect();
    let pair: Vec<Json> = [
        special(bos, 0),
        seq("A", 0),
        special(eos, 0),
        special(bos, 1),
        seq("B", 1),
        special(eos, 1),
    ]
    .into_iter()
    .flatten()
    .collect();
    let mut specials = serde_json::Map::new();
    for (s, id) in [bos, eos].into_iter().flatten() {
        specials.insert(s.into(), json!({"id": s, "ids": [id], "tokens": [s]}));
    }
    json!({"type": "TemplateProcessing", "single": single, "pair": pair, "special_tokens": specials})
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
    if model == "bert" {
        return super::wordpiece::from_gguf(file, get, context_length);
    }
    let flavour = flavour(file, model, arch)?;
    let (pre, pre_json) = pre_tokenizer(file, get, flavour)?;
    let tokens_key = "tokenizer.ggml.tokens";
    let tokens = match key(file, get, tokens_key)? {
        Value::Array(Array::Str(t)) => t,
        v => return Err(wrong(file, tokens_key, v, "an array of strings")),
    };
    let types = token_types(file, get, tokens)?;
    let (file_merges, mut pairs) = merges(file, get)?;
    let spelled: Vec<String> = match flavour {
        Flavour::ByteLevel | Flavour::Llama => tokens.clone(),
        Flavour::Gemma => tokens
            .iter()
            .map(|t| gemma_spelling(t).into_owned())
            .collect(),
    };
    let (vocab, seen) = vocabulary(file, &spelled)?;
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
    let specials = Specials::read(file, get, tokens.len(), flavour)?;
    let (added, decoder) = added_tokens(tokens, &types, flavour, specials.unk, &seen);
    let merges: Vec<Json> = pairs.into_iter().map(|(a, b)| json!([a, b])).collect();
    let model = Model {
        flavour,
        pre,
        pre_json,
        tokens,
        vocab,
        merges,
        added,
    };
    let tokenizer_json = tokenizer_json(model, &specials);
    let (config, special_tokens) =
        tokenizer_config(flavour, tokens, &specials, decoder, context_length);
    Ok(TokenizerFiles {
        tokenizer_json: Some(serde_json::to_string(&tokenizer_json).expect("serializable")),
        tokenizer_config_json: Some(
            serde_json::to_string_pretty(&config).expect("serializable") + "\n",
        ),
        chat_template: specials.chat_template,
        special_tokens,
        add_bos_token: Some(specials.add_bos),
    })
}

/// `tokenizer.ggml.pre` (default `default`) and the pre-tokenizer it names: a SentencePiece
/// vocabulary splits nothing before its merges (Gemma's splits on blanks), so there `pre` only
/// names the vocabulary's origin.
fn pre_tokenizer<'h>(file: &str, get: Get<'_, 'h>, flavour: Flavour) -> Result<(&'h str, Json)> {
    let pre_key = "tokenizer.ggml.pre";
    let pre = match get(pre_key) {
        None => "default",
        Some(v) => v
            .as_str()
            .ok_or_else(|| wrong(file, pre_key, v, "a string"))?,
    };
    let pre_json = match flavour {
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
    Ok((pre, pre_json))
}

/// `tokenizer.ggml.token_type`, one `llama_token_type` a token (all normal when absent).
pub(super) fn token_types(file: &str, get: Get<'_, '_>, tokens: &[String]) -> Result<Vec<i32>> {
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
    Ok(types)
}

/// `tokenizer.ggml.merges` as the file spells them (if it has them), and as pairs.
type Merges<'h> = (Option<&'h [String]>, Vec<(String, String)>);

/// Read `tokenizer.ggml.merges`, each two tokens separated by one space.
fn merges<'h>(file: &str, get: Get<'_, 'h>) -> Result<Merges<'h>> {
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
    Ok((file_merges, pairs))
}

/// The vocabulary as `tokenizer.json` holds it (spelling → id), and each spelling's id.
type Vocab<'s> = (Map<String, Json>, HashMap<&'s str, usize>);

/// The vocabulary of `spelled`; a spelling twice is refused.
fn vocabulary<'s>(file: &str, spelled: &'s [String]) -> Result<Vocab<'s>> {
    let mut vocab = Map::new();
    let mut seen: HashMap<&str, usize> = HashMap::new();
    for (i, t) in spelled.iter().enumerate() {
        if let Some(j) = seen.insert(t, i) {
            return Err(unsupported(
                file,
                format!("token `{t}` appears twice in tokenizer.ggml.tokens (ids {j} and {i})"),
            ));
        }
        vocab.insert(t.clone(), json!(i));
    }
    Ok((vocab, seen))
}

/// The special token ids and the flags that say how text is encoded.
struct Specials {
    bos: Option<u32>,
    eos: Option<u32>,
    unk: Option<u32>,
    pad: Option<u32>,
    add_bos: bool,
    /// `tokenizer.ggml.add_eos_token`: EOS after every text (a decoder-based embedder's).
    add_eos: bool,
    add_space_prefix: bool,
    chat_template: Option<String>,
}

impl Specials {
    fn read(file: &str, get: Get<'_, '_>, n_tokens: usize, flavour: Flavour) -> Result<Specials> {
        let id = |k: &str| -> Result<Option<u32>> {
            match get(k) {
                None => Ok(None),
                Some(v) => match v.as_u64() {
                    Some(i) if (i as usize) < n_tokens => Ok(Some(i as u32)),
                    _ => Err(ConvertError::GgufKey {
                        file: file.to_string(),
                        key: k.to_string(),
                        reason: format!("expected a token id below {n_tokens}, found {v:?}"),
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
        let add_eos = match get("tokenizer.ggml.add_eos_token") {
            None => false,
            Some(v) => v
                .as_bool()
                .ok_or_else(|| wrong(file, "tokenizer.ggml.add_eos_token", v, "a boolean"))?,
        };
        if add_eos && eos.is_none() {
            return Err(ConvertError::GgufKey {
                file: file.to_string(),
                key: "tokenizer.ggml.add_eos_token".into(),
                reason: "is true but the file names no tokenizer.ggml.eos_token_id to append"
                    .into(),
            });
        }
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
        Ok(Specials {
            bos,
            eos,
            unk,
            pad,
            add_bos,
            add_eos,
            add_space_prefix,
            chat_template,
        })
    }
}

/// The added tokens of `tokenizer.json` and the `added_tokens_decoder` of
/// `tokenizer_config.json`: control tokens, Llama's `<unk>`, and user-defined tokens the
/// vocabulary spells as they are.
fn added_tokens(
    tokens: &[String],
    types: &[i32],
    flavour: Flavour,
    unk: Option<u32>,
    seen: &HashMap<&str, usize>,
) -> (Vec<Json>, Map<String, Json>) {
    let mut added = Vec::new();
    let mut decoder = Map::new();
    for (i, (t, &ty)) in tokens.iter().zip(types).enumerate() {
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
    (added, decoder)
}

/// What `tokenizer.json`'s model is built from.
struct Model<'h> {
    flavour: Flavour,
    pre: &'h str,
    pre_json: Json,
    tokens: &'h [String],
    vocab: Map<String, Json>,
    merges: Vec<Json>,
    added: Vec<Json>,
}

/// `tokenizer.json`: byte-level BPE, or SentencePiece's BPE with byte fallback.
fn tokenizer_json(m: Model<'_>, specials: &Specials) -> Json {
    let Model {
        flavour,
        pre,
        pre_json,
        tokens,
        vocab,
        merges,
        added,
    } = m;
    // Llama 3's BPE takes a whole pre-tokenized word that is itself a token without merging
    // (`ignore_merges` in its tokenizer.json; llama.cpp sets it for `llama-bpe`): " Việt" is
    // one token there, three through the merges.
    let ignore_merges = pre == "llama-bpe";
    let eos = specials.eos.filter(|_| specials.add_eos);
    let spelled = |id: Option<u32>| id.map(|i| (tokens[i as usize].as_str(), i));
    let byte_level_post = json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true});
    match flavour {
        Flavour::ByteLevel => json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": added,
            "normalizer": null,
            "pre_tokenizer": pre_json,
            "post_processor": match eos {
                None => byte_level_post,
                // The appended EOS after the byte-level offsets step, with the BOS where
                // added: an embedder's texts (EmbeddingGemma's `<bos> … <eos>`) are encoded
                // by the post-processor alone, as sentence-transformers encodes them. (A
                // generator's BOS otherwise comes from `add_bos_token`, as for every
                // byte-level vocabulary.)
                Some(_) => json!({"type": "Sequence", "processors": [
                    byte_level_post,
                    template_processor(spelled(specials.bos.filter(|_| specials.add_bos)), spelled(eos))]}),
            },
            "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
            "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": ignore_merges,
                "vocab": vocab, "merges": merges},
        }),
        Flavour::Gemma | Flavour::Llama => {
            let bos = specials.bos.filter(|_| specials.add_bos);
            let post = match (bos, eos) {
                (None, None) => Json::Null,
                _ => template_processor(spelled(bos), spelled(eos)),
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
            let normalizer = if flavour == Flavour::Llama && specials.add_space_prefix {
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
                "model": {"type": "BPE", "dropout": null, "unk_token": specials.unk.map(|u| tokens[u as usize].clone()),
                    "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": true,
                    "byte_fallback": true, "ignore_merges": false, "vocab": vocab, "merges": merges},
            })
        }
    }
}

/// `tokenizer_config.json` (with the added tokens' `decoder`), and the special tokens by role.
fn tokenizer_config(
    flavour: Flavour,
    tokens: &[String],
    specials: &Specials,
    decoder: Map<String, Json>,
    context_length: u64,
) -> (Json, BTreeMap<String, String>) {
    let mut special_tokens = BTreeMap::new();
    let name = |i: Option<u32>| i.map(|i| tokens[i as usize].clone());
    for (role, i) in [
        ("bos_token", specials.bos),
        ("eos_token", specials.eos),
        ("pad_token", specials.pad),
        ("unk_token", specials.unk),
    ] {
        if let Some(s) = name(i) {
            special_tokens.insert(role.to_string(), s);
        }
    }
    let mut config = json!({
        "add_bos_token": specials.add_bos,
        "add_eos_token": specials.add_eos,
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
    if let Some(t) = &specials.chat_template {
        config["chat_template"] = json!(t);
    }
    (config, special_tokens)
}
