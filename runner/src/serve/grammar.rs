//! JSON-schema-constrained output (`response_format`), on the `llguidance` grammar engine.
//!
//! [`Grammars`] is built once per server: it reads every token's bytes off the tokenizer
//! ([`crate::tokenizer::Tokenizer::token_bytes`]) into llguidance's token trie and holds the
//! parser factory with its limits. [`Grammars::json_schema`] compiles a request's schema into
//! a [`JsonConstraint`], the engine's [`TokenConstraint`]: before each token it computes the
//! bitset of tokens that keep the output a valid prefix of a document the schema accepts,
//! and it advances by the sampled token.
//!
//! The output is compact JSON with fixed separators (`", "`, `": "`) and no free whitespace,
//! so a model cannot spend its token budget on blanks and the constraint finishes the moment
//! the top-level value closes. Every step is bounded by llguidance's fuel and item limits
//! ([`limits`]), so a hostile schema fails with a message instead of stalling the engine.

use std::sync::Arc;

use llguidance::api::{ParserLimits, StopReason, TopLevelGrammar};
use llguidance::earley::SlicedBiasComputer;
use llguidance::toktrie::{ApproximateTokEnv, InferenceCapabilities, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};
use serde_json::Value;

use crate::engine::job::TokenConstraint;
use crate::error::{Result, RunnerError};
use crate::tokenizer::Tokenizer;
use finite::Finite;

mod finite;

/// Largest schema accepted, serialized: the biggest real-world schemas (FHIR) are a few
/// hundred KiB; past this a schema is more likely an attack on compile time than a format.
pub const MAX_SCHEMA_BYTES: usize = 256 * 1024;

/// Deepest nesting of a schema's JSON: the compiler recurses over it, and no useful schema
/// nests anywhere near this.
pub const MAX_SCHEMA_DEPTH: usize = 64;

/// llguidance's trie keeps a token's depth in 10 bits (1024 bytes) and token ids in 24 bits;
/// tokens longer than this are left out of the trie (never allowed; no JSON needs them).
const MAX_TOKEN_BYTES: usize = 1000;

/// The trie counts its nodes in 22 bits: a vocabulary whose bytes exceed this cannot be held.
const MAX_VOCAB_BYTES: usize = 3_000_000;

/// Most token ids the trie can number (24 bits, one value reserved for "no token").
const MAX_VOCAB: usize = (1 << 24) - 1;

/// The refusal of a schema whose grammar allows no first token.
const NO_DOCUMENT: &str = "the JSON schema accepts no document the model can write (`$ref`s \
                           that lead only to each other accept none)";

/// The refusal of a schema whose every document would be infinite.
const NO_FINITE_DOCUMENT: &str = "the JSON schema accepts no finite document: its `$ref`s \
                                  recurse through required properties or non-empty arrays \
                                  without a way out";

/// Longest error message handed to a client: llguidance may append its grammar or a
/// backtrace, which is neither useful to a client nor bounded.
const MAX_MESSAGE_CHARS: usize = 400;

/// The compile and per-token limits. Defaults from llguidance are tuned for a GPU server that
/// can afford tens of milliseconds and hundreds of MiB per request; here one CPU engine thread
/// serves every sequence, so a schema gets about 20 ms to compile its lexer and 10 ms and a
/// bounded amount of memory per token before it fails with an error.
pub fn limits() -> ParserLimits {
    ParserLimits {
        // The grammar's branching factor: an enum or `anyOf` wider than this is refused.
        max_items_in_row: 2000,
        // ~50k/ms: about 20 ms to build the lexer's regexes.
        initial_lexer_fuel: 1_000_000,
        // ~14k/ms: about 10 ms of lexer work per token mask.
        step_lexer_fuel: 150_000,
        // ~20k/ms: about 2.5 ms of parser work per token mask.
        step_max_items: 50_000,
        // 1-2 kB each: at most ~100 MiB of lexer states for one request.
        max_lexer_states: 50_000,
        // Symbols in productions; FHIR's schema needs ~200k.
        max_grammar_size: 250_000,
        // Running large regexes over the whole trie at compile time is unbounded in wall time
        // for a hostile pattern; per-token work stays under the step fuel instead.
        precompute_large_lexemes: false,
        // Messages go to clients: no parser state or grammar dumps.
        verbose_errors: false,
    }
}

/// llguidance's state shared by every request: the token trie and the parser factory.
pub struct Grammars {
    factory: ParserFactory,
    /// The model's vocabulary (logit rows), which may exceed the tokenizer's.
    vocab: usize,
    /// End-of-sequence ids (below `vocab`), allowed once the document is complete.
    stop: Vec<u32>,
}

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammars")
            .field("vocab", &self.vocab)
            .field("stop", &self.stop)
            .finish_non_exhaustive()
    }
}

impl Grammars {
    /// Build the token trie for a model whose logits cover `vocab` ids. Ids past the
    /// tokenizer's (padding rows) are never allowed; special tokens are never allowed as text,
    /// and the tokenizer's stop tokens only where the document may end.
    pub fn new(tokenizer: &Tokenizer, vocab: usize) -> Result<Grammars> {
        if vocab == 0 || vocab > MAX_VOCAB {
            return Err(RunnerError::Grammar(format!(
                "a vocabulary of {vocab} tokens is outside 1..={MAX_VOCAB}"
            )));
        }
        let table = tokenizer.token_bytes()?;
        let stop: Vec<u32> = tokenizer
            .stop_tokens()
            .iter()
            .copied()
            .filter(|&id| (id as usize) < vocab)
            .collect();
        if stop.is_empty() {
            return Err(RunnerError::Grammar(
                "the tokenizer has no end-of-sequence token within the model's vocabulary".into(),
            ));
        }
        let mut words: Vec<Vec<u8>> = vec![Vec::new(); vocab];
        let mut total = 0usize;
        for (word, entry) in words.iter_mut().zip(&table) {
            let Some(entry) = entry else { continue };
            if entry.bytes.len() > MAX_TOKEN_BYTES {
                continue;
            }
            // llguidance's convention: a special token is its text behind a 0xFF byte, which
            // never occurs in UTF-8 text, so no text grammar can produce one.
            if entry.special {
                word.push(TokTrie::SPECIAL_TOKEN_MARKER);
            }
            word.extend_from_slice(&entry.bytes);
            total = total.saturating_add(word.len());
        }
        if total > MAX_VOCAB_BYTES {
            return Err(RunnerError::Grammar(format!(
                "the vocabulary's tokens hold {total} bytes, more than the grammar engine's \
                 {MAX_VOCAB_BYTES}"
            )));
        }
        let vocab_u32 = u32::try_from(vocab)
            .map_err(|_| RunnerError::Grammar(format!("a vocabulary of {vocab} tokens")))?;
        let info = TokRxInfo::new(vocab_u32, stop[0]);
        let trie = std::panic::catch_unwind(|| TokTrie::from(&info, &words).with_eos_tokens(&stop))
            .map_err(|_| RunnerError::Grammar("building the token trie failed".into()))?;
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new(
            &env,
            InferenceCapabilities::default(),
            &SlicedBiasComputer::general_slices(),
        )
        .map_err(|e| RunnerError::Grammar(e.to_string()))?;
        factory.quiet();
        *factory.limits_mut() = limits();
        Ok(Grammars {
            factory,
            vocab,
            stop,
        })
    }

    /// Compile a JSON schema (`response_format.json_schema.schema`; `{"type": "object"}` for
    /// `json_object`) into a constraint for one generation.
    ///
    /// Err(message) when the schema is invalid, uses something unsupported, or accepts no
    /// document (nothing at all, or nothing finite): the server answers 400 with it. The
    /// first token's mask is computed here, so the schema is known to work before a request
    /// is queued.
    pub fn json_schema(
        &self,
        schema: &Value,
    ) -> std::result::Result<Box<dyn TokenConstraint>, String> {
        let grammar = TopLevelGrammar::from_json_schema(self.checked_schema(schema)?);
        let parser = llguidance::panic_utils::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.factory.create_parser(grammar)
        }))
        .map_err(|e| client_message("the JSON schema cannot be used", &e.to_string()))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(client_message("the JSON schema cannot be used", &e));
        }
        let mut constraint = JsonConstraint {
            matcher,
            mask: vec![0; self.vocab.div_ceil(32)],
            vocab: self.vocab,
            stop: self.stop.clone(),
            finished: false,
            ready: false,
        };
        // A schema can compile into a grammar that accepts no document at all (`$ref`s that
        // only lead to each other): llguidance finds out at the first mask. Computing it here,
        // on the connection's thread, makes that a 400 before the request is queued instead
        // of a failure once it runs; the engine then uses this mask for the first token.
        constraint.compute_mask().map_err(|e| match e {
            MaskError::Empty => NO_DOCUMENT.to_string(),
            MaskError::Engine(m) => client_message("the JSON schema cannot be used", &m),
        })?;
        constraint.ready = true;
        // A grammar can also accept prefixes forever without a document that ends (a
        // required property, or a non-empty array, whose schema is the whole again): the
        // model would write until `max_tokens` and return no JSON.
        if !Finite::accepts_some(schema) {
            return Err(NO_FINITE_DOCUMENT.into());
        }
        Ok(Box::new(constraint))
    }

    /// The schema with Kiln's output options in place of any the client set: checks shape
    /// and size first, so the compiler only sees bounded input.
    fn checked_schema(&self, schema: &Value) -> std::result::Result<Value, String> {
        let Value::Object(map) = schema else {
            return Err(format!(
                "the JSON schema must be an object, not {}",
                kind_of(schema)
            ));
        };
        let depth = depth_of(schema);
        if depth > MAX_SCHEMA_DEPTH {
            return Err(format!(
                "the JSON schema nests {depth} levels deep; at most {MAX_SCHEMA_DEPTH} are supported"
            ));
        }
        let bytes = serde_json::to_vec(schema).map_or(usize::MAX, |v| v.len());
        if bytes > MAX_SCHEMA_BYTES {
            return Err(format!(
                "the JSON schema is {bytes} bytes; at most {MAX_SCHEMA_BYTES} are supported"
            ));
        }
        let mut map = map.clone();
        // llguidance reads its compile options from `x-guidance`; the output format is the
        // server's choice, not the client's (a client's whitespace regex would be unbounded).
        map.insert(
            "x-guidance".into(),
            serde_json::json!({
                "whitespace_flexible": false,
                "item_separator": ", ",
                "key_separator": ": ",
            }),
        );
        Ok(Value::Object(map))
    }
}

/// A JSON value's kind, for messages.
fn kind_of(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// How deeply `v` nests (a scalar is 1). Iterative, so any input is safe to measure.
fn depth_of(v: &Value) -> usize {
    let mut deepest = 0;
    let mut todo = vec![(v, 1usize)];
    while let Some((v, d)) = todo.pop() {
        deepest = deepest.max(d);
        match v {
            Value::Array(items) => todo.extend(items.iter().map(|i| (i, d + 1))),
            Value::Object(map) => todo.extend(map.values().map(|i| (i, d + 1))),
            _ => {}
        }
    }
    deepest
}

/// `context: detail`, on one line and bounded: llguidance's messages can carry a backtrace
/// or grammar dump after the first line.
fn client_message(context: &str, detail: &str) -> String {
    let first = detail.lines().next().unwrap_or_default().trim();
    let first: String = first.chars().take(MAX_MESSAGE_CHARS).collect();
    format!("{context}: {first}")
}

/// One generation held to a JSON schema (see the module doc).
pub struct JsonConstraint {
    matcher: Matcher,
    /// The last computed mask over the model's vocabulary: bit `id % 32` of word `id / 32`.
    mask: Vec<u32>,
    vocab: usize,
    stop: Vec<u32>,
    /// The document is complete and nothing may follow it.
    finished: bool,
    /// `mask` holds the mask for the next token, computed before it was asked for.
    ready: bool,
}

/// Why no mask could be computed.
enum MaskError {
    /// No token can continue: the grammar accepts nothing from here.
    Empty,
    /// llguidance failed (out of fuel, an internal error): its message.
    Engine(String),
}

impl std::fmt::Debug for JsonConstraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JsonConstraint")
            .field("vocab", &self.vocab)
            .field("finished", &self.finished)
            .finish_non_exhaustive()
    }
}

impl JsonConstraint {
    fn set(&mut self, id: u32) {
        if let Some(word) = self.mask.get_mut(id as usize / 32) {
            *word |= 1 << (id % 32);
        }
    }

    /// The mask of the tokens that may come next, into `mask` (stop tokens only once the
    /// document is complete).
    fn compute_mask(&mut self) -> std::result::Result<(), MaskError> {
        self.mask.fill(0);
        if self.finished {
            for id in self.stop.clone() {
                self.set(id);
            }
            return Ok(());
        }
        let set = self.matcher.compute_mask().map_err(|e| {
            let message = e.to_string();
            // llguidance stops with this reason when no byte can extend the output.
            let first = message.lines().next().unwrap_or_default().trim();
            if first == StopReason::NoExtensionBias.to_string() {
                MaskError::Empty
            } else {
                MaskError::Engine(message)
            }
        })?;
        for (dst, src) in self.mask.iter_mut().zip(set.as_slice()) {
            *dst = *src;
        }
        // Bits past the vocabulary in the last word (the trie spans exactly `vocab` ids, so
        // nothing else is set there, but the contract is the engine's, not llguidance's).
        let tail = self.vocab % 32;
        if tail != 0 {
            if let Some(last) = self.mask.last_mut() {
                *last &= (1u32 << tail) - 1;
            }
        }
        if self.mask.iter().all(|&w| w == 0) {
            return Err(MaskError::Empty);
        }
        Ok(())
    }

    fn is_set(&self, id: u32) -> bool {
        (id as usize) < self.vocab
            && self
                .mask
                .get(id as usize / 32)
                .is_some_and(|w| w & (1 << (id % 32)) != 0)
    }
}

impl TokenConstraint for JsonConstraint {
    fn allowed(&mut self) -> std::result::Result<Option<&[u32]>, String> {
        // The first mask was computed when the schema was checked.
        if !std::mem::take(&mut self.ready) {
            self.compute_mask().map_err(|e| match e {
                MaskError::Empty => {
                    "structured output failed: no token can continue the JSON".into()
                }
                MaskError::Engine(m) => client_message("structured output failed", &m),
            })?;
        }
        Ok(Some(&self.mask))
    }

    fn commit(&mut self, token: u32) -> std::result::Result<(), String> {
        if !self.is_set(token) {
            return Err(format!(
                "token {token} is not allowed here by the JSON schema"
            ));
        }
        if self.finished {
            // Only a stop token was allowed: the generation ends with it.
            return Ok(());
        }
        self.matcher
            .consume_token(token)
            .map_err(|e| client_message("structured output failed", &e.to_string()))?;
        // Clear the mask so a token is never committed twice against one computation.
        self.mask.fill(0);
        self.finished = self.matcher.is_stopped();
        Ok(())
    }

    fn is_finished(&self) -> bool {
        self.finished
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;
    use std::time::{Duration, Instant};

    use serde_json::json;

    use super::*;
    use crate::sampler::Rng;
    use crate::tokenizer::TokenBytes;

    /// A model's tokenizer as the converter embeds it.
    fn tokenizer_in(dir: &Path, bos: Option<u32>, eos: &[u32]) -> Tokenizer {
        let files = kiln_convert::tokenizer_files::read(dir).unwrap();
        Tokenizer::from_parts("test", &files, bos, eos).unwrap()
    }

    /// The tiny fixtures' byte-level BPE tokenizer: 320 entries, 3 ChatML specials, EOS 2.
    fn tiny() -> Tokenizer {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/tiny/llama-tied-f32");
        tokenizer_in(&dir, Some(1), &[2])
    }

    /// SmolLM2's real tokenizer (49152 entries), built by `ci/smollm2.sh`.
    fn smollm2() -> Tokenizer {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/models/smollm2-bf16");
        assert!(
            dir.join("tokenizer.json").exists(),
            "{} is absent: run ci/smollm2.sh to build it",
            dir.display()
        );
        tokenizer_in(&dir, Some(1), &[2])
    }

    fn is_allowed(mask: &[u32], id: u32) -> bool {
        mask.get(id as usize / 32)
            .is_some_and(|w| w & (1 << (id % 32)) != 0)
    }

    fn allowed_ids(mask: &[u32], vocab: usize) -> Vec<u32> {
        (0..vocab as u32)
            .filter(|&id| is_allowed(mask, id))
            .collect()
    }

    /// Steps a walk may take before it counts as a failure to finish.
    const MAX_STEPS: usize = 3000;

    /// Sample allowed tokens until the constraint finishes or a stop token is drawn, and
    /// return the text. Uniform choices would almost never close a string in a big vocabulary,
    /// so three draws in four come from tokens that end something (a quote, bracket or comma,
    /// or a stop token).
    fn walk(grammars: &Grammars, tok: &Tokenizer, schema: &Value, seed: u64) -> String {
        let table = tok.token_bytes().unwrap();
        let vocab = grammars.vocab;
        let mut c = grammars.json_schema(schema).unwrap();
        let mut rng = Rng::new(seed);
        let mut ids = Vec::new();
        for _ in 0..MAX_STEPS {
            if c.is_finished() {
                return tok.decode(&ids).unwrap();
            }
            let mask = c.allowed().unwrap().unwrap().to_vec();
            let allowed = allowed_ids(&mask, vocab);
            assert!(!allowed.is_empty());
            for &id in &allowed {
                let entry: Option<&TokenBytes> = table.get(id as usize).and_then(Option::as_ref);
                let entry = entry.unwrap_or_else(|| panic!("padding id {id} allowed"));
                assert!(
                    !entry.special || tok.stop_tokens().contains(&id),
                    "special token {id} allowed"
                );
            }
            let closing: Vec<u32> = allowed
                .iter()
                .copied()
                .filter(|&id| {
                    tok.stop_tokens().contains(&id)
                        || table[id as usize]
                            .as_ref()
                            .is_some_and(|t| t.bytes.iter().any(|b| b"\"]},".contains(b)))
                })
                .collect();
            let pool = if !closing.is_empty() && !rng.next_u64().is_multiple_of(4) {
                &closing
            } else {
                &allowed
            };
            let id = pool[(rng.next_u64() % pool.len() as u64) as usize];
            c.commit(id).unwrap();
            if tok.stop_tokens().contains(&id) {
                return tok.decode(&ids).unwrap();
            }
            ids.push(id);
        }
        panic!("no end after {MAX_STEPS} tokens: {:?}", tok.decode(&ids));
    }

    /// Whether `value` satisfies the parts of `schema` the tests use: `type`, `properties`,
    /// `required`, `additionalProperties: false`, `enum`, `items`, `minItems`/`maxItems`,
    /// `minLength`/`maxLength`, `minimum`/`maximum`.
    fn check(value: &Value, schema: &Value, path: &str) -> std::result::Result<(), String> {
        let fail = |what: &str| Err(format!("{path}: {what} (value {value})"));
        if let Some(options) = schema.get("enum").and_then(Value::as_array) {
            if !options.contains(value) {
                return fail("not one of the enum");
            }
        }
        let ty = schema.get("type").and_then(Value::as_str);
        let type_ok = match ty {
            None => true,
            Some("object") => value.is_object(),
            Some("array") => value.is_array(),
            Some("string") => value.is_string(),
            Some("integer") => value.is_i64() || value.is_u64(),
            Some("number") => value.is_number(),
            Some("boolean") => value.is_boolean(),
            Some("null") => value.is_null(),
            Some(other) => return fail(&format!("the check does not know type {other}")),
        };
        if !type_ok {
            return fail(&format!("not of type {}", ty.unwrap_or_default()));
        }
        if let Value::Object(map) = value {
            let props = schema.get("properties").and_then(Value::as_object);
            for key in schema
                .get("required")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
            {
                if !map.contains_key(key.as_str().unwrap_or_default()) {
                    return fail(&format!("required {key} missing"));
                }
            }
            for (k, v) in map {
                match props.and_then(|p| p.get(k)) {
                    Some(sub) => check(v, sub, &format!("{path}.{k}"))?,
                    None if schema.get("additionalProperties") == Some(&json!(false)) => {
                        return fail(&format!("unexpected key {k}"))
                    }
                    None => {}
                }
            }
        }
        if let Value::Array(items) = value {
            let n = items.len() as u64;
            if schema
                .get("minItems")
                .and_then(Value::as_u64)
                .is_some_and(|m| n < m)
            {
                return fail("too few items");
            }
            if schema
                .get("maxItems")
                .and_then(Value::as_u64)
                .is_some_and(|m| n > m)
            {
                return fail("too many items");
            }
            if let Some(sub) = schema.get("items") {
                for (i, item) in items.iter().enumerate() {
                    check(item, sub, &format!("{path}[{i}]"))?;
                }
            }
        }
        if let Value::String(s) = value {
            let n = s.chars().count() as u64;
            if schema
                .get("minLength")
                .and_then(Value::as_u64)
                .is_some_and(|m| n < m)
            {
                return fail("too short");
            }
            if schema
                .get("maxLength")
                .and_then(Value::as_u64)
                .is_some_and(|m| n > m)
            {
                return fail("too long");
            }
        }
        if let Some(x) = value.as_f64() {
            if schema
                .get("minimum")
                .and_then(Value::as_f64)
                .is_some_and(|m| x < m)
            {
                return fail("below the minimum");
            }
            if schema
                .get("maximum")
                .and_then(Value::as_f64)
                .is_some_and(|m| x > m)
            {
                return fail("above the maximum");
            }
        }
        Ok(())
    }

    /// The schemas every walk is tried on, with a name for messages.
    fn schemas() -> Vec<(&'static str, Value)> {
        vec![
            ("json_object", json!({"type": "object"})),
            (
                "person",
                json!({
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "maxLength": 12},
                        "age": {"type": "integer", "minimum": 0, "maximum": 150},
                        "role": {"enum": ["admin", "user", "guest"]},
                        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                 "maxItems": 3},
                        "active": {"type": "boolean"},
                    },
                    "required": ["name", "age", "role", "tags", "active"],
                    "additionalProperties": false,
                }),
            ),
            (
                "nested",
                json!({
                    "type": "object",
                    "properties": {
                        "id": {"type": "integer"},
                        "owner": {
                            "type": "object",
                            "properties": {
                                "login": {"type": "string", "maxLength": 10},
                                "address": {
                                    "type": "object",
                                    "properties": {"city": {"type": "string", "maxLength": 10},
                                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                                    "required": ["city", "zip"],
                                },
                            },
                            "required": ["login", "address"],
                        },
                        "scores": {"type": "array", "items": {"type": "number"},
                                   "minItems": 1, "maxItems": 4},
                    },
                    "required": ["id", "owner", "scores"],
                    "additionalProperties": false,
                }),
            ),
            (
                "refs",
                json!({
                    "$defs": {"point": {"type": "object",
                                        "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                                        "required": ["x", "y"], "additionalProperties": false}},
                    "type": "object",
                    "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}},
                    "required": ["a", "b"],
                    "additionalProperties": false,
                }),
            ),
        ]
    }

    fn walks_satisfy_their_schemas(tok: &Tokenizer, vocab: usize, seeds: u64) {
        let grammars = Grammars::new(tok, vocab).unwrap();
        for (name, schema) in schemas() {
            for seed in 0..seeds {
                let text = walk(&grammars, tok, &schema, seed);
                let value: Value = serde_json::from_str(&text)
                    .unwrap_or_else(|e| panic!("{name}, seed {seed}: {e}: {text:?}"));
                check(&value, &schema, "$")
                    .unwrap_or_else(|e| panic!("{name}, seed {seed}: {e}: {text:?}"));
            }
        }
    }

    #[test]
    fn random_walks_under_the_mask_give_documents_the_schema_accepts() {
        let tok = tiny();
        // 40 padding rows past the tokenizer's 323 ids: the walk checks none is ever allowed.
        walks_satisfy_their_schemas(&tok, 363, 12);
    }

    #[test]
    #[ignore = "real model: run ci/smollm2.sh first; CI runs it with --include-ignored"]
    fn smollm2_random_walks_give_documents_the_schema_accepts() {
        walks_satisfy_their_schemas(&smollm2(), 49152, 4);
    }

    #[test]
    fn stop_tokens_are_allowed_only_where_the_document_may_end() {
        let tok = tiny();
        let vocab = 330;
        let grammars = Grammars::new(&tok, vocab).unwrap();
        let stop = tok.stop_tokens().to_vec();
        assert!(!stop.is_empty());
        let mut c = grammars.json_schema(&json!({"type": "integer"})).unwrap();
        let mask = c.allowed().unwrap().unwrap().to_vec();
        assert_eq!(mask.len(), vocab.div_ceil(32));
        assert!(
            stop.iter().all(|&s| !is_allowed(&mask, s)),
            "stop before any digit"
        );
        assert!(c.commit(stop[0]).is_err());
        let mut c = grammars.json_schema(&json!({"type": "integer"})).unwrap();
        c.allowed().unwrap();
        let seven = tok.encode_rendered("7").unwrap();
        assert_eq!(seven.len(), 1);
        c.commit(seven[0]).unwrap();
        assert!(!c.is_finished(), "more digits may follow");
        let mask = c.allowed().unwrap().unwrap().to_vec();
        assert!(
            stop.iter().all(|&s| is_allowed(&mask, s)),
            "a number may end here"
        );
        assert!(is_allowed(&mask, seven[0]));
        c.commit(stop[0]).unwrap();
        assert!(c.is_finished());
    }

    #[test]
    fn an_object_finishes_when_it_closes() {
        let tok = tiny();
        let grammars = Grammars::new(&tok, 323).unwrap();
        let mut c = grammars.json_schema(&json!({"type": "object"})).unwrap();
        for id in tok.encode_rendered("{}").unwrap() {
            assert!(!c.is_finished());
            c.allowed().unwrap();
            c.commit(id).unwrap();
        }
        assert!(c.is_finished());
        // Only a stop token may follow.
        let mask = c.allowed().unwrap().unwrap().to_vec();
        assert_eq!(allowed_ids(&mask, 323), tok.stop_tokens());
    }

    #[test]
    fn a_disallowed_token_is_refused() {
        let tok = tiny();
        let vocab = 400;
        let grammars = Grammars::new(&tok, vocab).unwrap();
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}},
                            "required": ["a"]});
        let close = tok.encode_rendered("}").unwrap()[0];
        let open = tok.encode_rendered("{").unwrap()[0];
        let mut c = grammars.json_schema(&schema).unwrap();
        c.allowed().unwrap();
        let e = c.commit(close).unwrap_err();
        assert!(e.contains("not allowed"), "{e}");
        // A padding row and an id past the vocabulary.
        assert!(c.commit(390).is_err());
        assert!(c.commit(u32::MAX).is_err());
        // The constraint is still usable after a refused commit.
        c.allowed().unwrap();
        c.commit(open).unwrap();
        // A commit needs a fresh mask.
        assert!(c.commit(open).is_err());
    }

    #[test]
    fn invalid_schemas_are_refused_with_a_message() {
        let tok = tiny();
        let grammars = Grammars::new(&tok, 323).unwrap();
        let deep = (0..80).fold(
            json!({"type": "string"}),
            |inner, _| json!({"type": "array", "items": inner}),
        );
        let big =
            json!({"enum": (0..30_000).map(|i| format!("value number {i}")).collect::<Vec<_>>()});
        for (schema, want) in [
            (json!([1, 2]), "must be an object, not an array"),
            (json!("string"), "must be an object, not a string"),
            (json!({"type": "frobnicate"}), "frobnicate"),
            (
                json!({"type": "string", "minLength": 5, "maxLength": 2}),
                "schema",
            ),
            (json!({"$ref": "#/$defs/missing"}), "missing"),
            (json!({"$ref": "https://example.com/schema.json"}), "ref"),
            (
                json!({"type": "integer", "minimum": 5, "maximum": 1}),
                "schema",
            ),
            (deep, "levels deep"),
            (big, "bytes"),
        ] {
            let e = grammars
                .json_schema(&schema)
                .err()
                .unwrap_or_else(|| panic!("{schema} was accepted"));
            assert!(e.contains(want), "{schema}: {e}");
            assert!(!e.contains('\n') && e.len() < 600, "{e}");
        }
    }

    /// Issue #65: `$ref`s that only lead to each other compiled, then failed at the first
    /// mask inside the engine (a 500, or an error event after a 200). They, and recursion
    /// with no finite document, are refused when the schema is compiled; recursion with a
    /// way out is kept, and a walk under it ends.
    #[test]
    fn schemas_accepting_no_document_are_refused_when_compiled() {
        let tok = tiny();
        let grammars = Grammars::new(&tok, 323).unwrap();
        for (schema, want) in [
            (
                json!({"$ref": "#"}),
                "accepts no document the model can write",
            ),
            (
                json!({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                       "$ref": "#/$defs/a"}),
                "accepts no document",
            ),
            (json!({"anyOf": [{"$ref": "#"}]}), "accepts no document"),
            (json!({"allOf": [{"$ref": "#"}]}), "accepts no document"),
            (
                json!({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}),
                "no finite document",
            ),
            (
                json!({"type": "array", "items": {"$ref": "#"}, "minItems": 1}),
                "no finite document",
            ),
            (
                json!({"$defs": {"n": {"type": "object", "properties": {"x": {"$ref": "#/$defs/n"}},
                                       "required": ["x"]}},
                       "type": "object", "properties": {"a": {"$ref": "#/$defs/n"}},
                       "required": ["a"]}),
                "no finite document",
            ),
        ] {
            let e = grammars
                .json_schema(&schema)
                .err()
                .unwrap_or_else(|| panic!("{schema} was accepted"));
            assert!(e.contains(want), "{schema}: {e}");
        }
        let with_a_way_out = [
            json!({"type": "object", "properties": {"a": {"$ref": "#"}}}),
            json!({"type": "object",
                   "properties": {"a": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
                   "required": ["a"]}),
            json!({"type": "array", "items": {"$ref": "#"}}),
            json!({"type": ["object", "null"], "properties": {"a": {"$ref": "#"}},
                   "required": ["a"]}),
            json!({"$defs": {"n": {"type": "object", "properties": {"x": {"$ref": "#/$defs/n"}},
                                   "required": []}},
                   "type": "object", "properties": {"a": {"$ref": "#/$defs/n"}},
                   "required": ["a"]}),
        ];
        for schema in with_a_way_out {
            for seed in 0..4 {
                let text = walk(&grammars, &tok, &schema, seed);
                serde_json::from_str::<Value>(&text)
                    .unwrap_or_else(|e| panic!("{schema}, seed {seed}: {e}: {text:?}"));
            }
        }
    }

    /// Schemas built to blow up compile time or memory: each is refused, or compiles and
    /// steps, within a bounded time.
    #[test]
    fn pathological_schemas_are_refused_or_bounded_quickly() {
        let tok = tiny();
        let grammars = Grammars::new(&tok, 323).unwrap();
        let wide_any_of =
            json!({"anyOf": (0..3000).map(|i| json!({"const": i})).collect::<Vec<_>>()});
        let nested_any_of = (0..12).fold(json!({"type": "integer"}), |inner, _| {
            json!({"anyOf": [
                {"type": "array", "items": inner.clone()},
                {"type": "object", "properties": {"a": inner.clone(), "b": inner}},
            ]})
        });
        for (name, schema) in [
            (
                "nested repetition",
                json!({"type": "string", "pattern": "^((a|aa){50}b{20}){40}$"}),
            ),
            (
                "huge counted repeat",
                json!({"type": "string", "pattern": "^(x{1000}){1000}$"}),
            ),
            (
                "huge minLength",
                json!({"type": "string", "minLength": 10_000_000}),
            ),
            (
                "huge minItems",
                json!({"type": "array", "items": {"type": "integer"},
                                     "minItems": 1_000_000}),
            ),
            ("wide anyOf", wide_any_of),
            ("nested anyOf", nested_any_of),
            (
                "many properties",
                json!({"type": "object",
                "properties": (0..2000).map(|i| (format!("k{i}"), json!({"type": "string"})))
                    .collect::<serde_json::Map<_, _>>(),
                "required": (0..2000).map(|i| format!("k{i}")).collect::<Vec<_>>()}),
            ),
        ] {
            let start = Instant::now();
            if let Ok(mut c) = grammars.json_schema(&schema) {
                let mut rng = Rng::new(7);
                for _ in 0..20 {
                    let Ok(mask) = c.allowed() else { break };
                    let allowed = allowed_ids(mask.unwrap(), 323);
                    let id = allowed[(rng.next_u64() % allowed.len() as u64) as usize];
                    if c.commit(id).is_err() || c.is_finished() {
                        break;
                    }
                }
            }
            let took = start.elapsed();
            assert!(took < Duration::from_secs(5), "{name}: {took:?}");
        }
    }

    /// Connection threads compile schemas (to answer 400 before queueing) while the engine
    /// thread steps constraints: the shared state must cross threads.
    #[test]
    fn grammars_are_shared_across_threads() {
        fn shared<T: Send + Sync>() {}
        shared::<Grammars>();
        let grammars = Grammars::new(&tiny(), 323).unwrap();
        std::thread::scope(|s| {
            for _ in 0..2 {
                s.spawn(|| grammars.json_schema(&json!({"type": "object"})).unwrap());
            }
        });
    }

    #[test]
    fn setup_refuses_a_vocabulary_without_an_end() {
        // The fuzz seed's byte-level BPE: 22 entries, then `<s>` (22) and `</s>` (23).
        let json = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../fuzz/corpus/tokenizer/bpe.json"
        ))
        .unwrap();
        let files = kiln_format::TokenizerFiles {
            tokenizer_json: Some(json),
            ..kiln_format::TokenizerFiles::default()
        };
        let tok = Tokenizer::from_parts("seed", &files, None, &[]).unwrap();
        assert_eq!(tok.stop_tokens(), [23]);
        assert!(Grammars::new(&tok, 24).is_ok());
        // A model vocabulary that ends before `</s>` leaves no way to end.
        let e = Grammars::new(&tok, 23).unwrap_err();
        assert!(e.to_string().contains("end-of-sequence"), "{e}");
        let e = Grammars::new(&tok, 0).unwrap_err();
        assert!(e.to_string().contains("outside"), "{e}");
    }

    /// The per-token cost of the constraint (`allowed()` then `commit()`) on SmolLM2's 49k
    /// vocabulary, stepping through the tokenization of documents a model would write for a
    /// realistic schema. Prints the mean, median and 90th percentile; run with
    /// `cargo test -p kiln-runner --lib grammar_cost -- --ignored --nocapture`.
    #[test]
    #[ignore = "real model: run ci/smollm2.sh first; a timing, printed"]
    fn smollm2_grammar_cost_per_token() {
        let tok = smollm2();
        let start = Instant::now();
        let grammars = Grammars::new(&tok, 49152).unwrap();
        let setup = start.elapsed();
        let (_, schema) = schemas().swap_remove(1);
        let documents = [
            r#"{"name": "Ada Lovelace", "age": 36, "role": "admin", "tags": ["math", "poetry"], "active": true}"#,
            r#"{"name": "Alan Turing", "age": 41, "role": "user", "tags": ["logic"], "active": false}"#,
            r#"{"name": "Grace Hopper", "age": 85, "role": "guest", "tags": [], "active": true}"#,
        ];
        let mut steps = Vec::new();
        let mut compile = Vec::new();
        for _ in 0..10 {
            for doc in documents {
                let t = Instant::now();
                let mut c = grammars.json_schema(&schema).unwrap();
                compile.push(t.elapsed());
                for id in tok.encode_rendered(doc).unwrap() {
                    let t = Instant::now();
                    c.allowed().unwrap();
                    c.commit(id).unwrap_or_else(|e| panic!("{doc}: {e}"));
                    steps.push(t.elapsed());
                }
                assert!(c.is_finished(), "{doc}");
            }
        }
        steps.sort();
        compile.sort();
        let at = |v: &[Duration], q: f64| v[((v.len() - 1) as f64 * q) as usize];
        println!(
            "setup {setup:?}; compile median {:?}; per token ({} tokens): mean {:?}, median {:?}, \
             p90 {:?}, max {:?}",
            at(&compile, 0.5),
            steps.len(),
            steps.iter().sum::<Duration>() / steps.len() as u32,
            at(&steps, 0.5),
            at(&steps, 0.9),
            at(&steps, 1.0),
        );
    }
}
