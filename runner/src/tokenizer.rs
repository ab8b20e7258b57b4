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
        let inner = parse_tokenizer_json(json).map_err(err)?;
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
}
