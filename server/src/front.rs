//! What the API's routes mean: [`App`] parses and validates a request ([`api`]), turns it
//! into a [`Job`] for the engine (or an embedding job), and [`answer`] turns the engine's
//! [`Event`]s into the response. Nothing here knows HTTP beyond status codes: the routes,
//! limits and connections are [`crate::routes`]' and [`crate::listen`]'s.
//!
//! The work here (tokenizing, rendering the chat template, compiling a schema, embedding)
//! blocks, so the routes run it on tokio's blocking pool. Every refusal is OpenAI-shaped
//! ([`ApiError`]) and logged as one line on stderr ([`kiln_runner::serve::log::line`] escapes what the
//! client sent).
//!
//! [`Event`]: kiln_runner::engine::job::Event

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use kiln_runner::chat::ChatTemplate;
use kiln_runner::engine::job::{Event, Job, TokenConstraint};
use kiln_runner::engine::{EngineHandle, SubmitError};
use kiln_runner::generate::Interrupt;
use kiln_runner::sampler::SamplerConfig;
use kiln_runner::serve::embeddings::{EmbedError, EmbedService};
use kiln_runner::serve::grammar::Grammars;
use kiln_runner::tokenizer::Tokenizer;
use kiln_runner::RunnerError;
use serde_json::{json, Value};

pub mod answer;

use crate::api::{self, embeddings, ApiError, Common, Meta, ResponseFormat};
use answer::Output;

/// How often a waiting task looks at the stop flag and whether its client is still there:
/// short enough that a vanished client frees its sequence within a decode step or two, long
/// enough to cost nothing.
pub const POLL: Duration = Duration::from_millis(100);

/// How the server treats requests.
#[derive(Debug, Clone)]
pub struct FrontConfig {
    /// `--api-key`: required as `Authorization: Bearer KEY` on `/v1/*` and the tokenize routes.
    pub api_key: Option<String>,
    /// Largest request body accepted (413 beyond).
    pub max_body_bytes: usize,
    /// Requests served at once, `/health` aside (503 and `Retry-After` beyond). Connections
    /// that are idle or still sending their head do not count.
    pub max_requests: usize,
    /// Longest a request head or body may take to arrive (the connection closes, or 408), a
    /// response write to be taken (the connection closes and the job is cancelled), and an
    /// idle keep-alive connection is kept.
    pub request_timeout: Duration,
    /// `max_tokens` when a request gives none (`None`: the room left in the context).
    pub default_max_tokens: Option<usize>,
    /// Sampling defaults (the file's generation config and the command line); a request's
    /// fields override them.
    pub sampling: SamplerConfig,
    /// Origins a browser may call the API from (`--cors-origin`); none: no CORS headers, so
    /// browsers keep pages of other origins out.
    pub cors_origins: Vec<String>,
}

impl Default for FrontConfig {
    fn default() -> Self {
        FrontConfig {
            api_key: None,
            max_body_bytes: 8 << 20,
            max_requests: 64,
            request_timeout: Duration::from_secs(30),
            default_max_tokens: None,
            sampling: SamplerConfig::default(),
            cors_origins: Vec::new(),
        }
    }
}

/// What the server says about its model.
#[derive(Debug)]
pub struct FrontModel<'a> {
    /// The name in responses and `/v1/models`.
    pub name: String,
    /// The model's tokenizer.
    pub tokenizer: &'a Tokenizer,
    /// Its chat template (`None`: `/v1/chat/completions` answers 400).
    pub template: Option<&'a ChatTemplate<'a>>,
    /// Context length in tokens: prompt plus output.
    pub ctx: usize,
    /// Vocabulary size (token ids in requests must be below it).
    pub vocab: usize,
    /// JSON-schema constraints (`None`: `response_format` other than text answers 400).
    pub grammars: Option<&'a Grammars>,
    /// Unix seconds, for `/v1/models` (the file's modification time).
    pub created: u64,
    /// The embedder, when the model is an embedding model (then it has no engine: the
    /// generation routes answer 400, and `/v1/embeddings` answers).
    pub embeddings: Option<&'a EmbedService<'a>>,
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Whether `a` equals `b`, looking at every byte of the longer whatever the contents, so the
/// time taken says nothing about how much of a guessed key was right.
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    let mut diff = u8::from(a.len() != b.len());
    for i in 0..a.len().max(b.len()) {
        let x = a.get(i).copied().unwrap_or(0);
        let y = b.get(i).copied().unwrap_or(0);
        diff |= std::hint::black_box(x ^ y);
    }
    diff == 0
}

/// What the API means, without HTTP: the configuration, the model and the engine's handle.
/// The server shares one among its handlers; an in-process front end (the Python package)
/// calls the same methods with a request's JSON body, so both validate, refuse and answer
/// alike.
pub struct App<'a> {
    pub(crate) cfg: FrontConfig,
    pub(crate) model: FrontModel<'a>,
    engine: Option<EngineHandle>,
    pub(crate) stop: Interrupt,
    next_id: AtomicU64,
    /// The server's start time, so ids stay unique across restarts.
    prefix: String,
    fingerprint: String,
}

/// Which endpoint a generation answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `/v1/chat/completions`.
    Chat,
    /// `/v1/completions`.
    Completion,
}

/// A generation the engine has accepted: its events as the engine sends them (a front end
/// waits on `events` in its own way, and raises `cancel` when its client has gone), and how
/// to answer with them.
#[derive(Debug)]
pub struct Pending<'a> {
    /// The job's events, in order; the last is `Done` or `Failed`.
    pub events: Receiver<Event>,
    /// The job's cancel flag, raised when this is dropped before the job finished: a front end
    /// that goes away at any point (even before it takes the events) cancels the job.
    pub cancel: Cancel,
    /// Turns the events into the response's JSON.
    pub output: Output<'a>,
    /// Whether the client asked for chunks.
    pub stream: bool,
    /// Whether a streamed answer ends with a usage chunk.
    pub include_usage: bool,
}

/// A job's cancel flag that raises itself when dropped, unless the job has finished: whatever
/// path a front end leaves by (an error, a client gone, a future dropped mid-await), the
/// engine frees the sequence at its next step.
#[derive(Debug)]
pub struct Cancel {
    flag: Arc<AtomicBool>,
    armed: bool,
}

impl Cancel {
    /// A guard over `flag`.
    pub fn new(flag: Arc<AtomicBool>) -> Cancel {
        Cancel { flag, armed: true }
    }

    /// Cancel the job now.
    pub fn raise(&self) {
        self.flag.store(true, Ordering::SeqCst);
    }

    /// The job has ended (its last event came): dropping the guard no longer cancels.
    pub fn finished(&mut self) {
        self.armed = false;
    }

    /// The flag itself, for a thread that watches the job on the guard's behalf.
    pub fn flag(&self) -> Arc<AtomicBool> {
        Arc::clone(&self.flag)
    }
}

impl Drop for Cancel {
    fn drop(&mut self) {
        if self.armed {
            self.raise();
        }
    }
}

impl std::fmt::Debug for App<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("App")
            .field("model", &self.model.name)
            .finish_non_exhaustive()
    }
}

impl<'a> App<'a> {
    /// The front over `model`; `engine` generates (an embedding model has none), and `stop`
    /// raised ends waits and streams.
    pub fn new(
        cfg: FrontConfig,
        model: FrontModel<'a>,
        engine: Option<EngineHandle>,
        stop: Interrupt,
    ) -> App<'a> {
        App {
            cfg,
            model,
            engine,
            stop,
            next_id: AtomicU64::new(1),
            prefix: format!("{:x}", unix_now()),
            fingerprint: format!("kiln-{}", env!("CARGO_PKG_VERSION")),
        }
    }

    /// The model served.
    pub fn model(&self) -> &FrontModel<'a> {
        &self.model
    }

    /// Check `authorization` (the header's value) against `--api-key`, if one is set.
    pub(crate) fn authorize(
        &self,
        authorization: Option<&str>,
    ) -> std::result::Result<(), ApiError> {
        let Some(key) = &self.cfg.api_key else {
            return Ok(());
        };
        let given = authorization.and_then(|v| {
            let (scheme, token) = v.split_once(' ')?;
            scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
        });
        match given {
            Some(token) if same_secret(token.as_bytes(), key.as_bytes()) => Ok(()),
            given => Err(ApiError {
                code: Some("invalid_api_key"),
                ..ApiError::new(
                    401,
                    "authentication_error",
                    if given.is_some() {
                        "invalid API key"
                    } else {
                        "an API key is required: send `Authorization: Bearer KEY`"
                    },
                )
            }),
        }
    }

    pub fn health(&self) -> Value {
        let Some(engine) = &self.engine else {
            let (queued, active) = self.model.embeddings.map_or((0, false), |e| e.load());
            return json!({
                "status": "ok",
                "slots": 1,
                "slots_idle": usize::from(!active),
                "active": usize::from(active),
                "queued": queued,
            });
        };
        let s = engine.status();
        json!({
            "status": "ok",
            "slots": s.slots,
            "slots_idle": s.slots.saturating_sub(s.active),
            "active": s.active,
            "queued": s.queued,
            "cached_sequences": s.cached,
            "cached_bytes": s.cached_bytes,
        })
    }

    pub fn tokenize(&self, body: &[u8]) -> std::result::Result<Value, ApiError> {
        let obj = api::parse_object(body)?;
        let mut content = None;
        let mut add_special = false;
        for (k, v) in &obj {
            match k.as_str() {
                "content" => {
                    content = Some(v.as_str().ok_or_else(|| {
                        ApiError::invalid("content", "`content` must be a string")
                    })?)
                }
                "add_special" => {
                    add_special = v.as_bool().ok_or_else(|| {
                        ApiError::invalid("add_special", "`add_special` must be a boolean")
                    })?
                }
                _ => {
                    return Err(ApiError::invalid(
                        k.as_str(),
                        format!("`{k}` is not supported by this server"),
                    ))
                }
            }
        }
        let content =
            content.ok_or_else(|| ApiError::invalid("content", "`content` is required"))?;
        let tok = self.model.tokenizer;
        let ids = if add_special {
            tok.encode(content)
        } else {
            tok.encode_rendered(content)
        }
        .map_err(|e| ApiError::invalid("content", e.to_string()))?;
        Ok(json!({ "tokens": ids }))
    }

    pub fn detokenize(&self, body: &[u8]) -> std::result::Result<Value, ApiError> {
        let obj = api::parse_object(body)?;
        if let Some(k) = obj.keys().find(|k| *k != "tokens") {
            return Err(ApiError::invalid(
                k.as_str(),
                format!("`{k}` is not supported by this server"),
            ));
        }
        let Some(Value::Array(list)) = obj.get("tokens") else {
            return Err(ApiError::invalid(
                "tokens",
                "`tokens` is required: an array of token ids",
            ));
        };
        let ids = list
            .iter()
            .enumerate()
            .map(|(i, v)| self.token_id(&format!("tokens[{i}]"), v))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let content = self
            .model
            .tokenizer
            .decode(&ids)
            .map_err(|e| ApiError::invalid("tokens", e.to_string()))?;
        Ok(json!({ "content": content }))
    }

    fn token_id(&self, param: &str, v: &Value) -> std::result::Result<u32, ApiError> {
        match v.as_u64() {
            Some(id) if id < self.model.vocab as u64 => Ok(id as u32),
            _ => Err(ApiError::invalid(
                param,
                format!(
                    "`{param}` is {v}, not a token id (0 to {})",
                    self.model.vocab.saturating_sub(1)
                ),
            )),
        }
    }

    /// The engine, or a 400 about `param` when the model only embeds.
    fn engine(&self, param: &str) -> std::result::Result<&EngineHandle, ApiError> {
        self.engine.as_ref().ok_or_else(|| {
            ApiError::invalid(
                param,
                format!(
                    "{} is an embedding model: it does not generate; use /v1/embeddings",
                    self.model.name
                ),
            )
        })
    }

    /// Validate a chat completion and hand it to the engine.
    pub fn chat(&self, body: &[u8]) -> std::result::Result<Pending<'a>, ApiError> {
        let r = api::parse_chat(body)?;
        self.engine("messages")?;
        let template = self.model.template.ok_or_else(|| {
            ApiError::invalid(
                "messages",
                "the model has no chat template; use /v1/completions",
            )
        })?;
        let bad = |e: RunnerError| ApiError::invalid("messages", e.to_string());
        let text = template.render(&r.messages, true).map_err(bad)?;
        let tok = self.model.tokenizer;
        tok.check_fits(&text, self.model.ctx).map_err(bad)?;
        let prompt = tok.encode_rendered(&text).map_err(bad)?;
        let gen = Generation {
            kind: Kind::Chat,
            prompt,
            param: "messages",
            common: &r.common,
            logprobs: r.logprobs,
            text_offset: 0,
        };
        self.generate(gen)
    }

    /// Validate a completion and hand it to the engine.
    pub fn completion(&self, body: &[u8]) -> std::result::Result<Pending<'a>, ApiError> {
        let r = api::parse_completion(body)?;
        self.engine("prompt")?;
        let (prompt, text_offset) = match &r.prompt {
            api::Prompt::Text(text) => {
                let tok = self.model.tokenizer;
                let bad = |e: RunnerError| ApiError::invalid("prompt", e.to_string());
                tok.check_fits(text, self.model.ctx).map_err(bad)?;
                (tok.encode(text).map_err(bad)?, text.chars().count())
            }
            api::Prompt::Tokens(ids) => {
                for (i, &id) in ids.iter().enumerate() {
                    self.token_id(&format!("prompt[{i}]"), &json!(id))?;
                }
                (ids.clone(), 0)
            }
        };
        let gen = Generation {
            kind: Kind::Completion,
            prompt,
            param: "prompt",
            common: &r.common,
            logprobs: r.logprobs,
            text_offset,
        };
        self.generate(gen)
    }

    /// Embed a request's inputs, taking a turn at the embedder; `gone` is raised when the
    /// client goes away.
    pub fn embeddings(
        &self,
        body: &[u8],
        gone: &AtomicBool,
    ) -> std::result::Result<Value, ApiError> {
        let r = embeddings::parse_embeddings(body)?;
        let Some(service) = self.model.embeddings else {
            return Err(ApiError::invalid(
                "model",
                format!(
                    "{} generates text and has no pooling; serve an embedding model (one \
                     converted from a sentence-transformers or BERT checkpoint) for \
                     /v1/embeddings",
                    self.model.name
                ),
            ));
        };
        let deadline = Instant::now().checked_add(self.cfg.request_timeout);
        let abandoned = || self.stop.is_raised() || gone.load(Ordering::SeqCst);
        let out = service
            .embed(&r.job(), deadline, &abandoned)
            .map_err(embed_error)?;
        Ok(embeddings::embeddings_response(
            &self.model.name,
            &out.vectors,
            r.encoding,
            out.tokens,
        ))
    }

    /// The request's sampling fields over the server's defaults.
    fn sampler(&self, s: &api::Sampling) -> SamplerConfig {
        let mut c = self.cfg.sampling.clone();
        if let Some(t) = s.temperature {
            c.temperature = t;
        }
        if let Some(p) = s.top_p {
            // OpenAI accepts 0, which keeps only the most likely token.
            c.top_p = p.max(f32::MIN_POSITIVE);
        }
        if let Some(k) = s.top_k {
            c.top_k = k;
        }
        if let Some(m) = s.min_p {
            c.min_p = m;
        }
        if let Some(p) = s.presence_penalty {
            c.presence_penalty = p;
        }
        if let Some(p) = s.frequency_penalty {
            c.frequency_penalty = p;
        }
        if let Some(p) = s.repeat_penalty {
            c.repetition_penalty = p;
        }
        c.seed = s.seed.unwrap_or_else(|| {
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64)
        });
        c
    }

    fn constraint(
        &self,
        format: &ResponseFormat,
    ) -> std::result::Result<Option<Box<dyn TokenConstraint>>, ApiError> {
        let (schema, param) = match format {
            ResponseFormat::Text => return Ok(None),
            ResponseFormat::JsonObject => (json!({"type": "object"}), "response_format"),
            ResponseFormat::JsonSchema(s) => (s.clone(), "response_format.json_schema"),
        };
        let grammars = self.model.grammars.ok_or_else(|| {
            ApiError::invalid(
                "response_format",
                "this server does not constrain output; send `response_format` of type text",
            )
        })?;
        // Compiled (and its first mask computed) here, before the job is queued: a schema
        // that cannot constrain output is the client's mistake, a 400 naming it, never a
        // failure once the job runs.
        grammars
            .json_schema(&schema)
            .map(Some)
            .map_err(|m| ApiError::invalid(param, m))
    }

    fn generate(&self, gen: Generation<'_>) -> std::result::Result<Pending<'a>, ApiError> {
        let n = gen.prompt.len();
        let ctx = self.model.ctx;
        if n == 0 {
            return Err(ApiError::invalid(
                gen.param,
                "the prompt is empty (0 tokens)",
            ));
        }
        if n >= ctx {
            return Err(ApiError::invalid(
                gen.param,
                format!(
                    "the prompt is {n} tokens but the context holds {ctx}, leaving no room to \
                     generate; shorten it"
                ),
            ));
        }
        let room = ctx - n;
        let common = gen.common;
        let max_tokens = common
            .max_tokens
            .or(self.cfg.default_max_tokens)
            .unwrap_or(room)
            .min(room);
        let constraint = self.constraint(&common.response_format)?;
        let (tx, rx) = std::sync::mpsc::channel();
        let cancel = Arc::new(AtomicBool::new(false));
        let id = self.next_id.fetch_add(1, Ordering::SeqCst);
        let job = Job {
            id,
            prompt: gen.prompt,
            sampler: self.sampler(&common.sampling),
            max_tokens,
            stop: common.stop.clone(),
            ignore_eos: common.ignore_eos,
            logprobs: gen.logprobs,
            constraint,
            events: tx,
            cancel: cancel.clone(),
            submitted: std::time::Instant::now(),
        };
        if let Err((why, _)) = self.engine(gen.param)?.submit(job) {
            let message = match why {
                SubmitError::Full => {
                    "the server is busy: every slot and queue place is taken; retry"
                }
                SubmitError::Stopped => "the server is shutting down",
            };
            return Err(ApiError::new(503, "server_error", message));
        }
        let prefix = match gen.kind {
            Kind::Chat => "chatcmpl",
            Kind::Completion => "cmpl",
        };
        let output = Output {
            meta: Meta {
                id: format!("{prefix}-{}{id:06x}", self.prefix),
                created: unix_now(),
                model: self.model.name.clone(),
                fingerprint: self.fingerprint.clone(),
            },
            kind: gen.kind,
            logprobs: gen.logprobs.is_some(),
            offset: gen.text_offset,
            tokenizer: self.model.tokenizer,
            text: String::new(),
            tokens: Vec::new(),
        };
        Ok(Pending {
            events: rx,
            cancel: Cancel::new(cancel),
            output,
            stream: common.stream,
            include_usage: common.include_usage,
        })
    }
}

/// The answer to an embedding job the runner refused or failed.
fn embed_error(e: EmbedError) -> ApiError {
    match e {
        EmbedError::Invalid { param, message } => ApiError::invalid(param, message),
        EmbedError::Busy(message) => ApiError::new(503, "server_error", message),
        EmbedError::Failed(message) => ApiError::new(500, "server_error", message),
    }
}

/// A validated generation request.
struct Generation<'c> {
    kind: Kind,
    prompt: Vec<u32>,
    /// The field the prompt came from, for errors.
    param: &'static str,
    common: &'c Common,
    logprobs: Option<usize>,
    /// Characters before the first generated one, for the legacy `text_offset`.
    text_offset: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_compare_equal_only_when_identical() {
        assert!(same_secret(b"abc", b"abc"));
        assert!(same_secret(b"", b""));
        assert!(!same_secret(b"abc", b"abd"));
        assert!(!same_secret(b"abc", b"abcd"));
        assert!(!same_secret(b"abc\0", b"abc"));
        assert!(!same_secret(b"", b"a"));
    }
}
