//! Text ↔ token ids through the `tokenizer.json` embedded in the file (Hugging Face
//! `tokenizers`, so ids equal transformers' exactly), and a streaming detokenizer that emits
//! text only once it is valid UTF-8.

use std::collections::BTreeSet;
use std::str::FromStr;

use kiln_format::{KilnFile, TokenizerFiles};

use crate::error::{Result, RunnerError};

/// End-of-turn markers of common chat formats, treated as stop tokens when the vocabulary
/// has them as special tokens (ChatML, Llama 3, Llama 2/Mistral, Qwen, Gemma-style).
const END_OF_TURN: [&str; 6] = [
    "<|im_end|>",
    "<|eot_id|>",
    "<|end_of_text|>",
    "<|endoftext|>",
    "</s>",
    "<end_of_turn>",
];

/// The model's tokenizer.
#[derive(Debug)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    bos: Option<u32>,
    add_bos: Option<bool>,
    stop: Vec<u32>,
    bos_token: Option<String>,
    eos_token: Option<String>,
    /// The longest vocabulary entry in bytes (at least 1): no token covers more of a text.
    max_token_bytes: usize,
}

impl Tokenizer {
    /// Build from the file's embedded `tokenizer.json`.
    pub fn from_file(file: &KilnFile) -> Result<Tokenizer> {
        let meta = file.metadata();
        Tokenizer::from_parts(
            file.label(),
            &meta.tokenizer,
            meta.config.bos_token_id,
            &meta.config.eos_token_ids,
        )
    }

    /// Build from a model's tokenizer files and the configuration's BOS and EOS ids; `label`
    /// (the model file) is named in errors. The `tokenizer.json` is untrusted input: a
    /// malformed one is an error, never a panic (the fuzz target `tokenizer` holds this).
    pub fn from_parts(
        label: &str,
        files: &TokenizerFiles,
        bos_token_id: Option<u32>,
        eos_token_ids: &[u32],
    ) -> Result<Tokenizer> {
        let err = |reason: String| RunnerError::Tokenizer {
            file: label.to_string(),
            reason,
        };
        let json = files.tokenizer_json.as_deref().ok_or_else(|| {
            err(
                "the file has no embedded tokenizer.json; re-convert from a directory that has one"
                    .into(),
            )
        })?;
        let mut inner = parse_tokenizer_json(json).map_err(err)?;
        // transformers' `tokenizer(text)` neither pads nor truncates unless asked, whatever
        // the tokenizer.json's `padding` and `truncation` say (all-MiniLM's pads to 128).
        inner.with_padding(None);
        inner
            .with_truncation(None)
            .map_err(|e| err(format!("cannot turn off its truncation: {e}")))?;
        let roles = role_tokens(files).map_err(err)?;
        mark_special(&mut inner, &roles).map_err(|e| err(e.to_string()))?;
        // A post-processor or decoder that crashes on every input is found here, naming the
        // file, rather than at the first prompt.
        guarded("encoding a probe text", || inner.encode("Hello 12", true))
            .and_then(|e| guarded("decoding it", || inner.decode(e.get_ids(), true)))
            .map_err(|e| err(e.to_string()))?;
        let special = &files.special_tokens;
        let bos_token = special.get("bos_token").cloned();
        let eos_token = special.get("eos_token").cloned();
        let mut stop: BTreeSet<u32> = eos_token_ids.iter().copied().collect();
        if let Some(id) = eos_token.as_deref().and_then(|t| inner.token_to_id(t)) {
            stop.insert(id);
        }
        let specials: Vec<(u32, String)> = inner
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, t)| t.special)
            .map(|(id, t)| (id, t.content))
            .collect();
        for (id, content) in &specials {
            if END_OF_TURN.contains(&content.as_str()) {
                stop.insert(*id);
            }
        }
        let max_token_bytes = inner
            .get_vocab(true)
            .keys()
            .map(String::len)
            .max()
            .unwrap_or(1)
            .max(1);
        Ok(Tokenizer {
            max_token_bytes,
            inner,
            bos: bos_token_id,
            add_bos: files.add_bos_token,
            stop: stop.into_iter().collect(),
            bos_token,
            eos_token,
        })
    }

    /// Encode plain text as transformers' `tokenizer(text)` does: the tokenizer's own
    /// post-processor adds special tokens (BOS for Llama 2), and `add_bos_token: true` from
    /// `tokenizer_config.json` adds BOS if the post-processor did not.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let mut ids = self.encode_raw(text, true)?;
        if let (Some(true), Some(bos)) = (self.add_bos, self.bos) {
            if ids.first() != Some(&bos) {
                ids.insert(0, bos);
            }
        }
        Ok(ids)
    }

    /// This tokenizer, cutting every [`Tokenizer::encode_cut`] to at most `max_tokens` ids as
    /// transformers' `truncation=True, max_length=max_tokens` cuts: the special tokens the
    /// post-processor adds are kept and counted.
    pub fn truncating(&self, max_tokens: usize) -> Result<Tokenizer> {
        let mut inner = self.inner.clone();
        let params = tokenizers::TruncationParams {
            max_length: max_tokens,
            ..Default::default()
        };
        inner
            .with_truncation(Some(params))
            .map_err(|e| RunnerError::InvalidArgument {
                arg: "--truncate",
                reason: format!("the tokenizer cannot cut to {max_tokens} tokens: {e}"),
            })?;
        Ok(Tokenizer {
            inner,
            bos: self.bos,
            add_bos: self.add_bos,
            stop: self.stop.clone(),
            bos_token: self.bos_token.clone(),
            eos_token: self.eos_token.clone(),
            max_token_bytes: self.max_token_bytes,
        })
    }

    /// Encode `text` with special tokens, as [`Tokenizer::truncating`] set it up, and say
    /// whether anything was cut.
    pub fn encode_cut(&self, text: &str) -> Result<(Vec<u32>, bool)> {
        let enc = guarded("encoding", || self.inner.encode(text, true))?;
        Ok((enc.get_ids().to_vec(), !enc.get_overflowing().is_empty()))
    }

    /// Encode text that already holds its special tokens (a rendered chat template): no
    /// post-processing, as `apply_chat_template(tokenize=True)` does.
    pub fn encode_rendered(&self, text: &str) -> Result<Vec<u32>> {
        self.encode_raw(text, false)
    }

    fn encode_raw(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        let enc = guarded("encoding", || self.inner.encode(text, add_special))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Decode ids to text, leaving out special tokens.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        guarded("decoding", || self.inner.decode(ids, true))
    }

    /// Tokens that end generation (EOS ids and end-of-turn markers).
    /// Refuse a text that cannot fit in `ctx` tokens, before spending time and memory on
    /// tokenizing it (a 10 MB prompt once took 11 s and 1.3 GB to be refused for length).
    ///
    /// No token covers more bytes of a text than the longest vocabulary entry's spelling (a
    /// byte-level or byte-fallback spelling is longer than the bytes it stands for), so a text
    /// longer than `ctx` such tokens needs more than `ctx` tokens. The factor 2 leaves room for
    /// normalizers that shorten text (Unicode composition), so only prompts that surely
    /// overflow are refused here; the exact check follows tokenization.
    pub fn check_fits(&self, text: &str, ctx: usize) -> Result<()> {
        let limit = ctx.saturating_mul(self.max_token_bytes).saturating_mul(2);
        if text.len() > limit {
            return Err(RunnerError::PromptTooLong {
                bytes: text.len(),
                ctx,
                limit,
            });
        }
        Ok(())
    }

    pub fn stop_tokens(&self) -> &[u32] {
        &self.stop
    }

    /// The BOS token's text, if any (for chat templates).
    pub fn bos_token(&self) -> Option<&str> {
        self.bos_token.as_deref()
    }

    /// The EOS token's text, if any (for chat templates).
    pub fn eos_token(&self) -> Option<&str> {
        self.eos_token.as_deref()
    }

    /// The bytes every token id contributes to the output, indexed by id (`None` for ids the
    /// vocabulary skips), for grammars that match output byte by byte.
    ///
    /// A token's bytes are what [`Tokenizer::decode`] yields for it in the middle of a text:
    /// the decoder's per-token rewrites (GPT-2's byte↔unicode map, SentencePiece's `▁` for a
    /// space and `<0xNN>` byte tokens, `Replace` rules) applied to its vocabulary string, so the
    /// bytes of a run of ids concatenate to its decoding. Edge-only effects are left out: a
    /// `Strip` after `Fuse`, or `Metaspace` dropping the very first space. Special tokens carry
    /// their text and `special: true`; decoding skips them, so a grammar must not allow them as
    /// text. An error names a decoder whose output is not a concatenation of tokens.
    pub fn token_bytes(&self) -> Result<Vec<Option<TokenBytes>>> {
        let steps = match self.inner.get_decoder() {
            None => {
                return Err(RunnerError::UnsupportedDecoder {
                    decoder: "absent (tokens are joined with spaces)".into(),
                })
            }
            Some(decoder) => {
                let json = serde_json::to_value(decoder)
                    .map_err(|e| RunnerError::Tokenize(format!("reading the decoder: {e}")))?;
                decoder_steps(&json)?
            }
        };
        let added = self.inner.get_added_tokens_decoder();
        let n = self.inner.get_vocab_size(true);
        let n = added.keys().map(|&id| id as usize + 1).fold(n, usize::max);
        let mut out = Vec::with_capacity(n);
        for id in 0..n {
            let id = u32::try_from(id).map_err(|_| {
                RunnerError::Tokenize(format!("the vocabulary has more than {} ids", u32::MAX))
            })?;
            out.push(match added.get(&id) {
                Some(t) if t.special => Some(TokenBytes {
                    bytes: t.content.as_bytes().to_vec(),
                    special: true,
                }),
                _ => self.inner.id_to_token(id).map(|text| TokenBytes {
                    bytes: apply_steps(&steps, &text),
                    special: false,
                }),
            });
        }
        Ok(out)
    }

    /// Where `other`'s vocabulary differs from this one, as a phrase naming the first id
    /// that does (or the sizes); `None` when every id maps to the same token, special tokens
    /// included. Speculative decoding needs this: a draft's ids are read as
    /// the target's.
    pub fn vocabulary_difference(&self, other: &Tokenizer) -> Option<String> {
        let (n, m) = (
            self.inner.get_vocab_size(true),
            other.inner.get_vocab_size(true),
        );
        if n != m {
            return Some(format!("{n} tokens against {m}"));
        }
        for id in 0..u32::try_from(n).unwrap_or(u32::MAX) {
            let (a, b) = (self.inner.id_to_token(id), other.inner.id_to_token(id));
            if a != b {
                let show =
                    |t: Option<String>| t.map_or("nothing".to_string(), |t| format!("{t:?}"));
                return Some(format!("id {id} is {} against {}", show(a), show(b)));
            }
        }
        let special = |t: &Tokenizer| {
            let mut v: Vec<(u32, String, bool)> = t
                .inner
                .get_added_tokens_decoder()
                .into_iter()
                .map(|(id, a)| (id, a.content, a.special))
                .collect();
            v.sort();
            v
        };
        if special(self) != special(other) {
            return Some("the added and special tokens differ".into());
        }
        None
    }

    /// A streaming decoder for a new run of generated tokens.
    pub fn stream(&self) -> TextStream<'_> {
        TextStream {
            tok: self,
            ids: Vec::new(),
            prefix: 0,
            read: 0,
        }
    }
}

/// What one token adds to the output (see [`Tokenizer::token_bytes`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenBytes {
    /// The bytes, possibly not valid UTF-8 on their own (half a character).
    pub bytes: Vec<u8>,
    /// A special token (BOS, EOS, chat markers): decoding drops it, so it is not text.
    pub special: bool,
}

/// One per-token rewrite of a `tokenizers` decoder, in the order the decoder applies them.
#[derive(Debug, Clone, PartialEq)]
enum DecodeStep {
    /// GPT-2's byte↔unicode map: every character stands for one byte.
    ByteLevel,
    /// `<0xNN>` is the byte NN.
    ByteFallback,
    /// A literal substring replaced (SentencePiece's `▁` → space).
    Replace { from: String, to: String },
    /// Up to `start`/`stop` copies of `content` cut from each token's ends.
    Strip {
        content: char,
        start: usize,
        stop: usize,
    },
}

/// The per-token rewrites of a decoder given as `tokenizers` serializes it.
fn decode_steps(
    json: &serde_json::Value,
    fused: &mut bool,
    steps: &mut Vec<DecodeStep>,
) -> Result<()> {
    let kind = json["type"].as_str().unwrap_or("unknown");
    let unsupported = || RunnerError::UnsupportedDecoder {
        decoder: kind.to_string(),
    };
    match kind {
        "Sequence" => {
            for d in json["decoders"].as_array().ok_or_else(unsupported)? {
                decode_steps(d, fused, steps)?;
            }
        }
        "ByteLevel" => steps.push(DecodeStep::ByteLevel),
        "ByteFallback" => steps.push(DecodeStep::ByteFallback),
        // Joins the tokens into one string: later steps see the whole text, not each token.
        "Fuse" => *fused = true,
        "Replace" => {
            let from = json["pattern"]["String"].as_str().ok_or_else(|| {
                RunnerError::UnsupportedDecoder {
                    decoder: "Replace with a regex pattern".into(),
                }
            })?;
            let to = json["content"].as_str().ok_or_else(unsupported)?;
            if !*fused {
                steps.push(DecodeStep::Replace {
                    from: from.to_string(),
                    to: to.to_string(),
                });
            }
        }
        "Metaspace" => {
            let from = json["replacement"].as_str().ok_or_else(unsupported)?;
            steps.push(DecodeStep::Replace {
                from: from.to_string(),
                to: " ".to_string(),
            });
        }
        "Strip" => {
            let content = json["content"]
                .as_str()
                .and_then(|c| c.chars().next())
                .ok_or_else(unsupported)?;
            let count = |k: &str| json[k].as_u64().and_then(|n| usize::try_from(n).ok());
            let (start, stop) = (count("start").unwrap_or(0), count("stop").unwrap_or(0));
            // After `Fuse` it trims only the ends of the whole text.
            if !*fused {
                steps.push(DecodeStep::Strip {
                    content,
                    start,
                    stop,
                });
            }
        }
        _ => return Err(unsupported()),
    }
    Ok(())
}

/// [`decode_steps`] from the top.
fn decoder_steps(json: &serde_json::Value) -> Result<Vec<DecodeStep>> {
    let mut steps = Vec::new();
    decode_steps(json, &mut false, &mut steps)?;
    Ok(steps)
}

/// GPT-2's byte↔unicode map, inverted: the byte each printable stand-in character means.
fn byte_level_char(c: char) -> Option<u8> {
    let self_mapped = |b: u32| matches!(b, 0x21..=0x7E | 0xA1..=0xAC | 0xAE..=0xFF);
    let code = u32::from(c);
    if self_mapped(code) {
        return u8::try_from(code).ok();
    }
    // The other bytes, in order, stand at U+0100 onwards.
    let index = code.checked_sub(0x100)?;
    (0u8..=255)
        .filter(|&b| !self_mapped(u32::from(b)))
        .nth(usize::try_from(index).ok()?)
}

/// A vocabulary string's bytes after the decoder's per-token steps, as `tokenizers` applies
/// them (a `ByteLevel` token with a character outside the map stays as its UTF-8, a token that
/// is not exactly `<0xNN>` passes `ByteFallback` untouched).
fn apply_steps(steps: &[DecodeStep], token: &str) -> Vec<u8> {
    let mut bytes = token.as_bytes().to_vec();
    for step in steps {
        bytes = match step {
            DecodeStep::ByteLevel => match std::str::from_utf8(&bytes) {
                Ok(text) => text
                    .chars()
                    .map(byte_level_char)
                    .collect::<Option<Vec<u8>>>()
                    .unwrap_or(bytes),
                Err(_) => bytes,
            },
            DecodeStep::ByteFallback => match bytes.as_slice() {
                [b'<', b'0', b'x', hi, lo, b'>'] => std::str::from_utf8(&[*hi, *lo])
                    .ok()
                    .and_then(|hex| u8::from_str_radix(hex, 16).ok())
                    .map_or(bytes, |b| vec![b]),
                _ => bytes,
            },
            DecodeStep::Replace { from, to } => match std::str::from_utf8(&bytes) {
                Ok(text) => text.replace(from.as_str(), to).into_bytes(),
                Err(_) => bytes,
            },
            DecodeStep::Strip {
                content,
                start,
                stop,
            } => match std::str::from_utf8(&bytes) {
                Ok(text) => {
                    let chars: Vec<char> = text.chars().collect();
                    let lead = chars
                        .iter()
                        .take(*start)
                        .take_while(|&c| c == content)
                        .count();
                    let rest = chars.get(lead..).unwrap_or_default();
                    let trail = rest
                        .iter()
                        .rev()
                        .take(*stop)
                        .take_while(|&c| c == content)
                        .count();
                    let keep = rest.get(..rest.len() - trail).unwrap_or_default();
                    keep.iter().collect::<String>().into_bytes()
                }
                Err(_) => bytes,
            },
        };
    }
    bytes
}

/// Turns tokens into text as they come, holding back bytes until they form whole characters.
///
/// Byte-level BPE splits multi-byte characters across tokens; decoding each token alone would
/// print U+FFFD. Like text-generation-inference, it decodes a short window of recent tokens and
/// emits the new suffix only when it does not end in a replacement character.
#[derive(Debug)]
pub struct TextStream<'t> {
    tok: &'t Tokenizer,
    ids: Vec<u32>,
    prefix: usize,
    read: usize,
}

impl TextStream<'_> {
    /// Add a token; returns the text that became complete (possibly empty).
    pub fn push(&mut self, id: u32) -> Result<String> {
        self.ids.push(id);
        let before = self.tok.decode(&self.ids[self.prefix..self.read])?;
        let now = self.tok.decode(&self.ids[self.prefix..])?;
        if now.len() > before.len() && !now.ends_with('\u{FFFD}') && now.starts_with(&before) {
            let new = now[before.len()..].to_string();
            self.prefix = self.read;
            self.read = self.ids.len();
            Ok(new)
        } else {
            // An incomplete character (or a decoder still rewriting the window): wait.
            Ok(String::new())
        }
    }

    /// Whatever is still held back (an incomplete character at the end of generation).
    pub fn finish(&mut self) -> Result<String> {
        let before = self.tok.decode(&self.ids[self.prefix..self.read])?;
        let now = self.tok.decode(&self.ids[self.prefix..])?;
        self.prefix = self.ids.len();
        self.read = self.ids.len();
        Ok(now.get(before.len()..).unwrap_or_default().to_string())
    }
}

/// The special-token roles transformers reads from `tokenizer_config.json`
/// (`PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES`).
const ROLES: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// Role tokens a transformers tokenizer class supplies from its constructor's defaults when
/// `tokenizer_config.json` leaves the key out (an explicit `null` means none). transformers 5's
/// `GemmaTokenizer` (`models/gemma/tokenization_gemma.py`) defaults `mask_token` to `<mask>`,
/// which Gemma 3's files list only as an ordinary added token; `GemmaTokenizerFast` is the
/// 4.x name of the same class.
const CLASS_DEFAULTS: [(&str, &[(&str, &str)]); 2] = [
    ("GemmaTokenizer", &GEMMA_DEFAULTS),
    ("GemmaTokenizerFast", &GEMMA_DEFAULTS),
];
const GEMMA_DEFAULTS: [(&str, &str); 5] = [
    ("unk_token", "<unk>"),
    ("bos_token", "<bos>"),
    ("eos_token", "<eos>"),
    ("pad_token", "<pad>"),
    ("mask_token", "<mask>"),
];

/// The tokens transformers registers as special on top of `tokenizer.json`'s own flags.
///
/// transformers 5 (`TokenizersBackend._post_init`) adds every token named in a role (the seven
/// of [`ROLES`], with the class's defaults for a role the config leaves out; any other
/// `*_token` string such as Gemma 3's `boi_token`) and every entry of `extra_special_tokens`
/// (a list, or a map of names; `additional_special_tokens` in 4.x files) to the backend as
/// special, so `decode(skip_special_tokens=True)` leaves them out even where `tokenizer.json`
/// marks them `"special": false` (Gemma 3's `<mask>`). Reads the converter's role strings
/// (`tokenizer_config.json` and `special_tokens_map.json`) and the embedded
/// `tokenizer_config.json`; a role whose value is neither a string, an `{"content": …}`
/// object nor null is refused, as transformers refuses it.
fn role_tokens(files: &TokenizerFiles) -> std::result::Result<Vec<String>, String> {
    let mut out: Vec<String> = files.special_tokens.values().cloned().collect();
    let Some(text) = files.tokenizer_config_json.as_deref() else {
        return Ok(out);
    };
    let config: serde_json::Value = serde_json::from_str(text)
        .map_err(|e| format!("the embedded tokenizer_config.json is not valid JSON: {e}"))?;
    let Some(config) = config.as_object() else {
        return Err("the embedded tokenizer_config.json is not a JSON object".into());
    };
    let token = |key: &str, v: &serde_json::Value| match v {
        serde_json::Value::String(s) => Ok(Some(s.clone())),
        serde_json::Value::Object(m) => match m.get("content") {
            Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
            _ => Err(format!(
                "tokenizer_config.json: {key} is an object without a \"content\" string"
            )),
        },
        serde_json::Value::Null => Ok(None),
        other => Err(format!(
            "tokenizer_config.json: {key} must be a token string, found {other}"
        )),
    };
    let class = config.get("tokenizer_class").and_then(|c| c.as_str());
    let defaults = CLASS_DEFAULTS
        .iter()
        .find(|(name, _)| Some(*name) == class)
        .map_or(&[][..], |(_, d)| *d);
    for role in ROLES {
        match config.get(role) {
            Some(v) => out.extend(token(role, v)?),
            None => out.extend(
                defaults
                    .iter()
                    .filter(|(r, _)| *r == role)
                    .map(|(_, t)| (*t).to_string()),
            ),
        }
    }
    // Model-specific named tokens: transformers takes string values and skips the rest.
    for (key, v) in config {
        if key.ends_with("_token") && !ROLES.contains(&key.as_str()) && v.is_string() {
            out.extend(token(key, v)?);
        }
    }
    // transformers' from_pretrained reads `additional_special_tokens` when
    // `extra_special_tokens` is missing, null or empty.
    let empty = |v: &serde_json::Value| match v {
        serde_json::Value::Null => true,
        serde_json::Value::Array(a) => a.is_empty(),
        serde_json::Value::Object(m) => m.is_empty(),
        _ => false,
    };
    let extra = match config.get("extra_special_tokens") {
        Some(v) if !empty(v) => Some(("extra_special_tokens", v)),
        _ => config
            .get("additional_special_tokens")
            .map(|v| ("additional_special_tokens", v)),
    };
    match extra {
        None | Some((_, serde_json::Value::Null)) => {}
        Some((key, serde_json::Value::Array(list))) => {
            for v in list {
                out.extend(token(key, v)?);
            }
        }
        Some((key, serde_json::Value::Object(named))) => {
            for (name, v) in named {
                out.extend(token(&format!("{key}.{name}"), v)?);
            }
        }
        Some((key, other)) => {
            return Err(format!(
                "tokenizer_config.json: {key} must be a list or a map of tokens, found {other}"
            ))
        }
    }
    out.sort();
    out.dedup();
    Ok(out)
}

/// Mark `tokens` special in `inner`, as transformers' `add_special_tokens` does, so decoding
/// with special tokens skipped leaves them out. Only tokens the vocabulary already holds are
/// marked: transformers would append a missing one as a new id past the model's embedding,
/// which no forward pass could look up. A token only in the model's vocabulary becomes an added
/// token (matched whole before the model, with its own id), as in transformers.
fn mark_special(inner: &mut tokenizers::Tokenizer, tokens: &[String]) -> Result<()> {
    let special: BTreeSet<u32> = inner
        .get_added_tokens_decoder()
        .into_iter()
        .filter(|(_, t)| t.special)
        .map(|(id, _)| id)
        .collect();
    let todo: Vec<tokenizers::AddedToken> = tokens
        .iter()
        .filter(|t| {
            !t.is_empty()
                && inner
                    .token_to_id(t)
                    .is_some_and(|id| !special.contains(&id))
        })
        .map(|t| tokenizers::AddedToken::from(t.clone(), true).normalized(false))
        .collect();
    if todo.is_empty() {
        return Ok(());
    }
    guarded("marking special tokens", || {
        Ok(inner.add_special_tokens(&todo))
    })?;
    Ok(())
}

/// Run a call into the `tokenizers` crate, turning a panic inside it into an error: the crate
/// panics on some crafted `tokenizer.json` files while encoding (0.22: a `TemplateProcessing`
/// post-processor that names a special token it does not define), and the file is untrusted.
fn guarded<T>(what: &str, f: impl FnOnce() -> tokenizers::Result<T>) -> Result<T> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(RunnerError::Tokenize(e.to_string())),
        Err(_) => Err(RunnerError::Tokenize(format!(
            "the model's tokenizer.json crashed the tokenizer library while {what}; the file \
             is damaged or crafted"
        ))),
    }
}

/// Load a `tokenizer.json` that may be crafted.
///
/// The `tokenizers` crate panics on some malformed documents instead of returning an error
/// (0.22: a JSON syntax error inside `"decoder"` reaches an `expect`), so the text's JSON syntax
/// is checked first (cheaply: nothing is built), and any panic left is caught and reported as
/// an error rather than ending the program.
fn parse_tokenizer_json(json: &str) -> std::result::Result<tokenizers::Tokenizer, String> {
    serde_json::from_str::<serde::de::IgnoredAny>(json)
        .map_err(|e| format!("the embedded tokenizer.json is not valid JSON: {e}"))?;
    match std::panic::catch_unwind(|| tokenizers::Tokenizer::from_str(json)) {
        Ok(Ok(t)) => Ok(t),
        Ok(Err(e)) => Err(format!("cannot parse the embedded tokenizer.json: {e}")),
        Err(_) => Err(
            "the embedded tokenizer.json crashed the tokenizer library's parser; \
                       the file is damaged or crafted"
                .into(),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn files(json: &str) -> TokenizerFiles {
        TokenizerFiles {
            tokenizer_json: Some(json.to_string()),
            ..TokenizerFiles::default()
        }
    }

    /// The fuzz target `tokenizer` starts from these seeds: each must load and round-trip,
    /// or the fuzzer would spend its time on parse errors.
    #[test]
    fn the_fuzz_seeds_load_and_round_trip() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../fuzz/corpus/tokenizer");
        for (name, text) in [
            ("bpe.json", "Hello world!"),
            ("wordlevel.json", "hello world"),
        ] {
            let json = std::fs::read_to_string(format!("{dir}/{name}")).unwrap();
            let t = Tokenizer::from_parts("seed", &files(&json), None, &[]).unwrap();
            let ids = t.encode(text).unwrap();
            assert!(!ids.is_empty(), "{name}");
            assert_eq!(t.decode(&ids).unwrap().trim(), text, "{name}");
        }
        // tokenizer.json, NUL, tokenizer_config.json: its role tokens become special.
        let seed = std::fs::read_to_string(format!("{dir}/bpe-with-config.bin")).unwrap();
        let (json, config) = seed.split_once('\0').unwrap();
        let files = TokenizerFiles {
            tokenizer_json: Some(json.to_string()),
            tokenizer_config_json: Some(config.to_string()),
            ..TokenizerFiles::default()
        };
        let t = Tokenizer::from_parts("seed", &files, None, &[]).unwrap();
        let ids = t.encode_rendered("Hello world").unwrap();
        // "Hell" is the sep token; "or" is not special (a non-empty extra_special_tokens wins).
        assert_eq!(t.decode(&ids).unwrap(), "o world");
    }

    /// The `bpe.json` seed plus two added tokens that `tokenizer.json` marks not special,
    /// `<mask>` (24) and `<x>` (25), and `tokenizer_config`.
    fn with_config(config: Option<&str>) -> TokenizerFiles {
        let seed = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../fuzz/corpus/tokenizer/bpe.json"
        ))
        .unwrap();
        let plain = |id: u32, content: &str| {
            format!(
                "{{\"id\": {id}, \"content\": \"{content}\", \"single_word\": false, \"lstrip\": false, \
                 \"rstrip\": false, \"normalized\": false, \"special\": false}}"
            )
        };
        // After the seed's own two: the crate gives added tokens ids in list order.
        let json = seed.replacen(
            "}], \"normalizer\"",
            &format!(
                "}}, {}, {}], \"normalizer\"",
                plain(24, "<mask>"),
                plain(25, "<x>")
            ),
            1,
        );
        assert_ne!(json, seed);
        TokenizerFiles {
            tokenizer_json: Some(json),
            tokenizer_config_json: config.map(str::to_string),
            ..TokenizerFiles::default()
        }
    }

    fn decoded(config: Option<&str>, ids: &[u32]) -> String {
        let t = Tokenizer::from_parts("m.kiln", &with_config(config), None, &[]).unwrap();
        t.decode(ids).unwrap()
    }

    /// Regression: Gemma 3's `<mask>` is an ordinary added token in its `tokenizer.json`, but
    /// transformers' `GemmaTokenizer` names it the mask token by default, so its decoding
    /// (skipping special tokens) leaves it out where Kiln printed it.
    #[test]
    fn gemma_tokenizer_s_default_mask_token_is_left_out_of_decoding() {
        let ids = [17, 24, 25];
        assert_eq!(decoded(None, &ids), "Hell<mask><x>");
        let gemma = r#"{"tokenizer_class": "GemmaTokenizer"}"#;
        assert_eq!(decoded(Some(gemma), &ids), "Hell<x>");
        let none = r#"{"tokenizer_class": "GemmaTokenizer", "mask_token": null}"#;
        assert_eq!(decoded(Some(none), &ids), "Hell<mask><x>");
        let other = r#"{"tokenizer_class": "Qwen2Tokenizer"}"#;
        assert_eq!(decoded(Some(other), &ids), "Hell<mask><x>");
    }

    #[test]
    fn tokens_named_in_tokenizer_config_are_left_out_of_decoding() {
        let ids = [17, 24, 25];
        for config in [
            r#"{"mask_token": "<mask>", "additional_special_tokens": ["<x>"]}"#,
            r#"{"mask_token": {"content": "<mask>"}, "extra_special_tokens": ["<x>"]}"#,
            r#"{"mask_token": "<mask>", "extra_special_tokens": [], "additional_special_tokens": ["<x>"]}"#,
            r#"{"pad_token": "<mask>", "extra_special_tokens": {"image_token": "<x>"}}"#,
            r#"{"boi_token": "<x>", "cls_token": "<mask>", "eoi_token": 3}"#,
        ] {
            assert_eq!(decoded(Some(config), &ids), "Hell", "{config}");
        }
        // A role token that only the model's vocabulary holds is matched whole, as in
        // transformers, and left out of decoding.
        let config = r#"{"sep_token": "Hell"}"#;
        let t = Tokenizer::from_parts("m.kiln", &with_config(Some(config)), None, &[]).unwrap();
        assert_eq!(t.encode_rendered("Hello").unwrap(), [17, 3]);
        assert_eq!(t.decode(&[17, 3]).unwrap(), "o");
    }

    #[test]
    fn a_role_token_missing_from_the_vocabulary_adds_no_id() {
        let config = r#"{"mask_token": "<absent>", "extra_special_tokens": ["<also absent>"]}"#;
        let t = Tokenizer::from_parts("m.kiln", &with_config(Some(config)), None, &[]).unwrap();
        assert_eq!(t.inner.token_to_id("<absent>"), None);
        assert_eq!(t.inner.token_to_id("<also absent>"), None);
        assert_eq!(t.inner.get_vocab_size(true), 26);
    }

    #[test]
    fn a_malformed_tokenizer_config_is_an_error_naming_the_file() {
        for (config, says) in [
            ("not json", "not valid JSON"),
            ("[]", "not a JSON object"),
            (r#"{"mask_token": 5}"#, "mask_token must be a token string"),
            (
                r#"{"bos_token": {"id": 1}}"#,
                "bos_token is an object without",
            ),
            (r#"{"extra_special_tokens": 3}"#, "must be a list or a map"),
            (
                r#"{"additional_special_tokens": [[]]}"#,
                "must be a token string",
            ),
        ] {
            let e =
                Tokenizer::from_parts("m.kiln", &with_config(Some(config)), None, &[]).unwrap_err();
            assert!(
                matches!(&e, RunnerError::Tokenizer { file, reason } if file == "m.kiln" && reason.contains(says)),
                "{config}: {e}"
            );
        }
    }

    #[test]
    fn a_malformed_tokenizer_json_is_an_error_naming_the_file() {
        for json in [
            "{}",
            "[]",
            "{\"model\": {\"type\": \"BPE\", \"vocab\": 3}}",
            "\u{0}",
        ] {
            let e = Tokenizer::from_parts("m.kiln", &files(json), None, &[]).unwrap_err();
            assert!(
                matches!(&e, RunnerError::Tokenizer { file, .. } if file == "m.kiln"),
                "{json}: {e}"
            );
        }
        // Regression (found by the fuzz target): a syntax error inside "decoder" made the
        // tokenizers crate panic ("Helper: Error(\"expected ident\" …)").
        let seed = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../fuzz/corpus/tokenizer/bpe.json"
        ))
        .unwrap();
        let broken = seed.replacen("\"decoder\": {\"type\"", "\"decoder\": {tru, \"type\"", 1);
        assert_ne!(broken, seed);
        let e = Tokenizer::from_parts("m.kiln", &files(&broken), None, &[]).unwrap_err();
        assert!(e.to_string().contains("not valid JSON"), "{e}");
        // Regression (found by the fuzz target): a TemplateProcessing post-processor naming a
        // special token it does not define panicked inside `encode` ("no entry found for key").
        let seed = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../fuzz/corpus/tokenizer/wordlevel.json"
        ))
        .unwrap();
        let broken = seed.replacen(
            "{\"SpecialToken\": {\"id\": \"[UNK]\"",
            "{\"SpecialToken\": {\"id\": \"ZUNK]\"",
            1,
        );
        assert_ne!(broken, seed);
        let e = Tokenizer::from_parts("m.kiln", &files(&broken), None, &[]).unwrap_err();
        assert!(
            matches!(&e, RunnerError::Tokenizer { file, reason } if file == "m.kiln" && reason.contains("crashed")),
            "{e}"
        );
        let e = Tokenizer::from_parts("m.kiln", &TokenizerFiles::default(), None, &[]).unwrap_err();
        assert!(e.to_string().contains("no embedded tokenizer.json"), "{e}");
    }

    /// The tiny fixtures' byte-level BPE tokenizer (320 entries, ChatML specials), with its
    /// config, as the converter embeds it.
    fn tiny_fixture() -> Tokenizer {
        let dir = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../fixtures/tiny/llama-tied-f32"
        );
        let read = |name: &str| std::fs::read_to_string(format!("{dir}/{name}")).unwrap();
        let files = TokenizerFiles {
            tokenizer_json: Some(read("tokenizer.json")),
            tokenizer_config_json: Some(read("tokenizer_config.json")),
            ..TokenizerFiles::default()
        };
        Tokenizer::from_parts("tiny", &files, Some(1), &[2]).unwrap()
    }

    /// Concatenated token bytes of `ids`, with special tokens left out as decoding does.
    fn joined(table: &[Option<TokenBytes>], ids: &[u32]) -> Vec<u8> {
        ids.iter()
            .filter_map(|&id| table[id as usize].as_ref())
            .filter(|t| !t.special)
            .flat_map(|t| t.bytes.iter().copied())
            .collect()
    }

    #[test]
    fn byte_level_token_bytes_concatenate_to_the_decoding() {
        let t = tiny_fixture();
        let table = t.token_bytes().unwrap();
        assert_eq!(table.len(), t.inner.get_vocab_size(true));
        for text in [
            "Hello world!",
            "{\"name\": \"Ada\", \"age\": 36}\n\ttabs  and  spaces",
            "naïve café 日本語 🙂",
            "\u{0}\u{7f} control",
        ] {
            let ids = t.encode_rendered(text).unwrap();
            assert_eq!(t.decode(&ids).unwrap(), text);
            assert_eq!(joined(&table, &ids), text.as_bytes(), "{text:?}");
        }
        // Every one of the 256 bytes is a token of its own.
        let singles: BTreeSet<u8> = table
            .iter()
            .flatten()
            .filter(|t| t.bytes.len() == 1 && !t.special)
            .map(|t| t.bytes[0])
            .collect();
        assert_eq!(singles.len(), 256);
        // The ChatML markers are special, with their text.
        let im_end = t.inner.token_to_id("<|im_end|>").unwrap();
        let entry = table[im_end as usize].as_ref().unwrap();
        assert!(entry.special);
        assert_eq!(entry.bytes, b"<|im_end|>");
    }

    #[test]
    fn gpt2_space_and_newline_stand_ins_are_bytes() {
        assert_eq!(byte_level_char('Ġ'), Some(b' '));
        assert_eq!(byte_level_char('Ċ'), Some(b'\n'));
        assert_eq!(byte_level_char('ĉ'), Some(b'\t'));
        assert_eq!(byte_level_char('Ā'), Some(0));
        assert_eq!(byte_level_char('a'), Some(b'a'));
        assert_eq!(byte_level_char('ÿ'), Some(0xFF));
        assert_eq!(byte_level_char('\u{AD}'), None);
        assert_eq!(byte_level_char('日'), None);
        let all: BTreeSet<u8> = (0..0x200u32)
            .filter_map(char::from_u32)
            .filter_map(byte_level_char)
            .collect();
        assert_eq!(all.len(), 256);
    }

    /// A SentencePiece-style vocabulary: `▁` for spaces, byte tokens for what it lacks, and
    /// Llama 2's decoder (Replace, ByteFallback, Fuse, Strip).
    fn sentencepiece_style() -> Tokenizer {
        let mut vocab = vec![
            "\"<unk>\": 0".to_string(),
            "\"<s>\": 1".into(),
            "\"</s>\": 2".into(),
        ];
        for b in 0..=255u32 {
            vocab.push(format!("\"<0x{b:02X}>\": {}", 3 + b));
        }
        for (i, piece) in ["▁", "a", "b", "▁a", "▁b"].iter().enumerate() {
            vocab.push(format!("\"{piece}\": {}", 259 + i));
        }
        let special = |id: u32, content: &str| {
            format!(
                "{{\"id\": {id}, \"content\": \"{content}\", \"single_word\": false, \"lstrip\": false, \
                 \"rstrip\": false, \"normalized\": false, \"special\": true}}"
            )
        };
        let json = format!(
            "{{\"version\": \"1.0\", \"truncation\": null, \"padding\": null, \
             \"added_tokens\": [{}, {}, {}], \
             \"normalizer\": {{\"type\": \"Sequence\", \"normalizers\": [\
                {{\"type\": \"Prepend\", \"prepend\": \"▁\"}}, \
                {{\"type\": \"Replace\", \"pattern\": {{\"String\": \" \"}}, \"content\": \"▁\"}}]}}, \
             \"pre_tokenizer\": null, \"post_processor\": null, \
             \"decoder\": {{\"type\": \"Sequence\", \"decoders\": [\
                {{\"type\": \"Replace\", \"pattern\": {{\"String\": \"▁\"}}, \"content\": \" \"}}, \
                {{\"type\": \"ByteFallback\"}}, {{\"type\": \"Fuse\"}}, \
                {{\"type\": \"Strip\", \"content\": \" \", \"start\": 1, \"stop\": 0}}]}}, \
             \"model\": {{\"type\": \"BPE\", \"dropout\": null, \"unk_token\": \"<unk>\", \
                \"continuing_subword_prefix\": null, \"end_of_word_suffix\": null, \
                \"fuse_unk\": true, \"byte_fallback\": true, \"ignore_merges\": false, \
                \"vocab\": {{{}}}, \"merges\": [\"▁ a\", \"▁ b\"]}}}}",
            special(0, "<unk>"),
            special(1, "<s>"),
            special(2, "</s>"),
            vocab.join(", ")
        );
        Tokenizer::from_parts("sp", &files(&json), Some(1), &[2]).unwrap()
    }

    #[test]
    fn sentencepiece_token_bytes_map_spaces_and_byte_tokens() {
        let t = sentencepiece_style();
        let table = t.token_bytes().unwrap();
        let bytes_of = |piece: &str| {
            let id = t.inner.token_to_id(piece).unwrap();
            table[id as usize].clone().unwrap()
        };
        assert_eq!(bytes_of("▁a").bytes, b" a");
        assert_eq!(bytes_of("<0xC3>").bytes, [0xC3]);
        assert_eq!(bytes_of("<0x0A>").bytes, b"\n");
        assert!(bytes_of("</s>").special);
        for text in ["a b", "ab é\n", "b 🙂 a"] {
            let ids = t.encode_rendered(text).unwrap();
            let decoded = t.decode(&ids).unwrap();
            assert_eq!(decoded, text);
            // The decoder strips the space `Prepend` put before the whole text, and only that.
            let mut want = b" ".to_vec();
            want.extend_from_slice(decoded.as_bytes());
            assert_eq!(joined(&table, &ids), want, "{text:?}");
        }
    }

    #[test]
    fn token_bytes_refuse_a_decoder_that_does_not_concatenate() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../fuzz/corpus/tokenizer");
        let json = std::fs::read_to_string(format!("{dir}/wordlevel.json")).unwrap();
        let t = Tokenizer::from_parts("seed", &files(&json), None, &[]).unwrap();
        let e = t.token_bytes().unwrap_err();
        assert!(matches!(&e, RunnerError::UnsupportedDecoder { .. }), "{e}");
        assert!(e.to_string().contains("byte-level BPE"), "{e}");
    }
}
