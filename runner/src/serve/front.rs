//! The connection side of `kiln-run serve`: accept connections, route requests, turn them into
//! [`Job`]s for the engine and stream its [`Event`]s back.
//!
//! Each connection has its own thread (at most [`FrontConfig::max_connections`]; beyond that a
//! 503 and close). A thread only parses, validates and waits: the engine does the work. While
//! it waits for events it looks at its socket every [`POLL`], so a client that went away has
//! its job cancelled within that time instead of holding a sequence to the end; a write that
//! fails or times out cancels too. Every refusal is OpenAI-shaped ([`ApiError`]) and logged as
//! one line on stderr ([`log::line`] escapes what the client sent). A request that can be
//! refused on its head (route, method, API key, body size) is refused before its body is read.

use std::io::BufReader;
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};

mod answer;

use crate::chat::ChatTemplate;
use crate::error::{Result, RunnerError};
use crate::generate::Interrupt;
use crate::sampler::SamplerConfig;
use crate::serve::api::{self, embeddings, ApiError, Common, Meta, ResponseFormat};
use crate::serve::embeddings::EmbedService;
use crate::serve::engine::{EngineHandle, SubmitError};
use crate::serve::grammar::Grammars;
use crate::serve::http::{self, Head, HttpError, Limits, Request};
use crate::serve::job::{Job, TokenConstraint};
use crate::serve::{log, page};
use crate::tokenizer::Tokenizer;
use answer::{Output, Waiter};

/// How often a waiting thread looks at its socket and the stop flag: short
/// enough that a vanished client frees its sequence within a decode step or two, long enough
/// to cost nothing.
pub const POLL: Duration = Duration::from_millis(100);

/// How long the accept loop sleeps when no connection is waiting: the most a new connection
/// waits to be accepted on an idle server (a few hundred wake-ups a second cost nothing), and
/// what lets the loop see `stop` without a blocking accept.
const ACCEPT_POLL: Duration = Duration::from_millis(5);

/// How the server treats connections.
#[derive(Debug, Clone)]
pub struct FrontConfig {
    /// `--api-key`: required as `Authorization: Bearer KEY` on `/v1/*` and the tokenize routes.
    pub api_key: Option<String>,
    /// Largest request body accepted (413 beyond).
    pub max_body_bytes: usize,
    /// Connections served at once (503 beyond).
    pub max_connections: usize,
    /// Longest a request may take to arrive, and a response write to be taken (408, or the job
    /// cancelled).
    pub request_timeout: Duration,
    /// Longest an idle keep-alive connection is kept open waiting for its next request.
    pub idle_timeout: Duration,
    /// `max_tokens` when a request gives none (`None`: the room left in the context).
    pub default_max_tokens: Option<usize>,
    /// Sampling defaults (the file's generation config and the command line); a request's
    /// fields override them.
    pub sampling: SamplerConfig,
}

impl Default for FrontConfig {
    fn default() -> Self {
        FrontConfig {
            api_key: None,
            max_body_bytes: 8 << 20,
            max_connections: 64,
            request_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(60),
            default_max_tokens: None,
            sampling: SamplerConfig::default(),
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

/// The routes and the methods they take.
const ROUTES: [(&str, &str); 8] = [
    ("/", "GET"),
    ("/health", "GET"),
    ("/v1/models", "GET"),
    ("/v1/chat/completions", "POST"),
    ("/v1/completions", "POST"),
    ("/v1/embeddings", "POST"),
    ("/tokenize", "POST"),
    ("/detokenize", "POST"),
];

/// Serve on `listener` until `stop` is raised; returns once every connection has ended.
/// `engine` generates; an embedding model has none.
pub fn serve(
    listener: TcpListener,
    cfg: &FrontConfig,
    model: &FrontModel<'_>,
    engine: Option<&EngineHandle>,
    stop: &Interrupt,
) -> Result<()> {
    listener
        .set_nonblocking(true)
        .map_err(|e| RunnerError::io("making the listening socket nonblocking", e))?;
    let started = unix_now();
    let server = Server {
        cfg,
        model,
        engine,
        stop,
        next_id: AtomicU64::new(1),
        prefix: format!("{started:x}"),
        fingerprint: format!("kiln-{}", env!("CARGO_PKG_VERSION")),
    };
    let open = AtomicUsize::new(0);
    std::thread::scope(|scope| {
        while !stop.is_raised() {
            let stream = match listener.accept() {
                Ok((stream, _)) => stream,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    std::thread::sleep(ACCEPT_POLL);
                    continue;
                }
                Err(e) => {
                    // Out of descriptors or a connection reset before accept: log, back off,
                    // keep serving.
                    log::line(format_args!("accept failed: {e}"));
                    std::thread::sleep(POLL);
                    continue;
                }
            };
            if stream.set_nonblocking(false).is_err() {
                continue;
            }
            if open.load(Ordering::SeqCst) >= cfg.max_connections {
                refuse(stream, "too many connections");
                continue;
            }
            open.fetch_add(1, Ordering::SeqCst);
            let guard = OpenGuard(&open);
            let server = &server;
            let spawned = std::thread::Builder::new()
                .name("kiln-serve-conn".into())
                .spawn_scoped(scope, move || {
                    let _guard = guard;
                    server.connection(stream);
                });
            if let Err(e) = spawned {
                log::line(format_args!("cannot start a connection thread: {e}"));
            }
        }
    });
    Ok(())
}

/// Counts a connection thread out when it ends, however it ends.
struct OpenGuard<'a>(&'a AtomicUsize);

impl Drop for OpenGuard<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Answer 503 without reading the request, and close.
fn refuse(stream: TcpStream, why: &str) {
    log("-", "-", 503, why);
    let _ = stream.set_write_timeout(Some(Duration::from_secs(1)));
    let err = ApiError::new(
        503,
        "server_error",
        format!("the server is busy ({why}); retry"),
    );
    let _ = http::write_json(
        &mut &stream,
        503,
        &[("Retry-After", "1")],
        &err.to_json(),
        false,
    );
    let _ = stream.shutdown(std::net::Shutdown::Write);
    // Discard what has already arrived: closing with unread bytes sends a reset, which can
    // reach the client before the 503 does. Nonblocking, so the accept loop never waits here.
    if stream.set_nonblocking(true).is_ok() {
        drain(&stream, DRAIN_BYTES);
    }
}

/// Most bytes read and discarded from a connection being closed after an error.
const DRAIN_BYTES: usize = 1 << 20;

/// Longest a connection being closed after an error is drained.
const DRAIN_TIME: Duration = Duration::from_secs(1);

/// Read and discard up to `limit` bytes until end of input, a read timeout, an error, or
/// [`DRAIN_TIME`].
fn drain(mut stream: &TcpStream, limit: usize) {
    use std::io::Read;
    let until = Instant::now() + DRAIN_TIME;
    let mut buf = [0u8; 8192];
    let mut left = limit;
    while left > 0 && Instant::now() < until {
        match stream.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => left = left.saturating_sub(n),
        }
    }
}

/// Close after an error response without losing it: stop sending, then read what the client
/// still sends for a moment (a body the server refused to read), so the close does not reset
/// the connection before the client has read the response.
fn linger_close(stream: &TcpStream) {
    let _ = stream.shutdown(std::net::Shutdown::Write);
    if stream
        .set_read_timeout(Some(Duration::from_millis(200)))
        .is_ok()
    {
        drain(stream, DRAIN_BYTES);
    }
}

/// Answer a request that could not be read (when an answer is possible) and close.
fn refuse_http(stream: &TcpStream, e: &HttpError) -> Next {
    if let Some(status) = e.status() {
        log("-", "-", status, &e.to_string());
        let kind = if matches!(e, HttpError::Timeout) {
            "timeout_error"
        } else {
            "invalid_request_error"
        };
        let err = ApiError::new(status, kind, e.to_string());
        let _ = http::write_json(&mut &*stream, status, &[], &err.to_json(), false);
        linger_close(stream);
    }
    Next::End
}

/// One log line about a request; [`log::line`] escapes what the client sent.
fn log(method: &str, path: &str, status: u16, message: &str) {
    log::line(format_args!("{method} {path} {status}: {message}"));
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

/// What reading a request gave.
enum Next {
    /// A whole request and its route.
    Request(Request, &'static str),
    /// A request refused on its head, answered; the connection may carry another.
    Refused,
    /// The connection ends (any answer is written).
    End,
}

/// What a handler produced.
enum Reply {
    /// A JSON body with status 200.
    Json(Value),
    /// An HTML page.
    Html(&'static str),
    /// The handler wrote the response itself; whether the connection may go on.
    Written(bool),
}

struct Server<'s, 'm> {
    cfg: &'s FrontConfig,
    model: &'s FrontModel<'m>,
    engine: Option<&'s EngineHandle>,
    stop: &'s Interrupt,
    next_id: AtomicU64,
    /// The server's start time, so ids stay unique across restarts.
    prefix: String,
    fingerprint: String,
}

/// Which endpoint a generation answers.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Chat,
    Completion,
}

impl Server<'_, '_> {
    /// [`FrontConfig::request_timeout`], at least a millisecond: a socket timeout of zero
    /// would mean none.
    fn timeout(&self) -> Duration {
        self.cfg.request_timeout.max(Duration::from_millis(1))
    }

    fn connection(&self, stream: TcpStream) {
        let _ = stream.set_nodelay(true);
        let _ = stream.set_write_timeout(Some(self.timeout()));
        let Ok(read_half) = stream.try_clone() else {
            return;
        };
        let mut reader = BufReader::new(read_half);
        let limits = Limits::with_body(self.cfg.max_body_bytes);
        loop {
            if reader.buffer().is_empty() && !self.wait_readable(&stream) {
                return;
            }
            let _ = stream.set_read_timeout(Some(self.timeout()));
            // A timeout too large to add to the clock means none.
            let deadline = Instant::now().checked_add(self.cfg.request_timeout);
            let (req, route) = match self.read(&mut reader, &stream, &limits, deadline) {
                Next::Request(req, route) => (req, route),
                Next::Refused if !self.stop.is_raised() => continue,
                Next::Refused | Next::End => return,
            };
            if !self.respond(&req, route, &stream) || !req.keep_alive || self.stop.is_raised() {
                return;
            }
        }
    }

    /// Read one request and the route it takes. A request refused on its head alone (no
    /// route, a method the route does not take, no API key) is answered before its body is
    /// read, and before a client that sent `Expect: 100-continue` is told to send it: a
    /// client without the key gets its 401, not an invitation to upload. A body left unread
    /// ends the connection.
    fn read(
        &self,
        reader: &mut BufReader<TcpStream>,
        stream: &TcpStream,
        limits: &Limits,
        deadline: Option<Instant>,
    ) -> Next {
        let head = match http::read_head(reader, limits, deadline) {
            Ok(head) => head,
            Err(e) => return refuse_http(stream, &e),
        };
        let route = match self.check_head(&head) {
            Ok(route) => route,
            Err(e) => {
                let keep = head.keep_alive && head.length == 0;
                let written = self.write_error(stream, &head.method, &head.path, &e, keep);
                if written.is_ok() && keep {
                    return Next::Refused;
                }
                linger_close(stream);
                return Next::End;
            }
        };
        match http::read_body(reader, &mut &*stream, head, deadline) {
            Ok(req) => Next::Request(req, route),
            Err(e) => refuse_http(stream, &e),
        }
    }

    /// Wait until the client sends a byte (true), or closes, goes idle too long, or the
    /// server stops (false).
    fn wait_readable(&self, stream: &TcpStream) -> bool {
        let until = Instant::now().checked_add(self.cfg.idle_timeout);
        if stream.set_read_timeout(Some(POLL)).is_err() {
            return false;
        }
        let mut byte = [0u8; 1];
        while !self.stop.is_raised() && until.is_none_or(|u| Instant::now() < u) {
            match stream.peek(&mut byte) {
                Ok(0) => return false,
                Ok(_) => return true,
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock
                            | std::io::ErrorKind::TimedOut
                            | std::io::ErrorKind::Interrupted
                    ) => {}
                Err(_) => return false,
            }
        }
        false
    }

    /// Answer one request on `route`; whether the connection may carry another.
    fn respond(&self, req: &Request, route: &'static str, stream: &TcpStream) -> bool {
        let mut out = stream;
        let keep = req.keep_alive;
        let written = match self.route(req, route, stream) {
            Ok(Reply::Json(v)) => http::write_json(&mut out, 200, &[], &v, keep),
            Ok(Reply::Html(page)) => http::write_response(
                &mut out,
                200,
                "text/html; charset=utf-8",
                &[],
                page.as_bytes(),
                keep,
            ),
            Ok(Reply::Written(ok)) => return ok,
            Err(e) => self.write_error(stream, &req.method, &req.path, &e, keep),
        };
        written.is_ok()
    }

    /// Log `e` and answer with it, with the headers its status calls for.
    fn write_error(
        &self,
        mut out: &TcpStream,
        method: &str,
        path: &str,
        e: &ApiError,
        keep: bool,
    ) -> std::io::Result<()> {
        log(method, path, e.status, &e.message);
        let allow = ROUTES
            .iter()
            .find(|(p, _)| *p == path)
            .map_or("", |(_, m)| *m);
        let extra: &[(&str, &str)] = match e.status {
            503 => &[("Retry-After", "1")],
            401 => &[("WWW-Authenticate", "Bearer")],
            405 => &[("Allow", allow)],
            _ => &[],
        };
        http::write_json(&mut out, e.status, extra, &e.to_json(), keep)
    }

    /// The route `head` takes, once its method and API key are checked: what can be refused
    /// before the body is read.
    fn check_head(&self, head: &Head) -> std::result::Result<&'static str, ApiError> {
        let Some((path, method)) = ROUTES.iter().find(|(p, _)| *p == head.path) else {
            return Err(ApiError::new(
                404,
                "invalid_request_error",
                format!("no route {} {}", head.method, head.path),
            ));
        };
        if head.method != *method {
            return Err(ApiError::new(
                405,
                "invalid_request_error",
                format!("{} takes {method}, not {}", head.path, head.method),
            ));
        }
        if *path != "/" && *path != "/health" {
            self.authorize(head.header("authorization"))?;
        }
        Ok(path)
    }

    fn route(
        &self,
        req: &Request,
        route: &'static str,
        stream: &TcpStream,
    ) -> std::result::Result<Reply, ApiError> {
        match route {
            "/" => Ok(Reply::Html(page::PAGE)),
            "/health" => Ok(Reply::Json(self.health())),
            "/v1/models" => Ok(Reply::Json(api::models(
                &self.model.name,
                self.model.created,
            ))),
            "/v1/chat/completions" => self.chat(req, stream),
            "/v1/completions" => self.completion(req, stream),
            "/v1/embeddings" => self.embeddings(req, stream),
            "/tokenize" => self.tokenize(req),
            _ => self.detokenize(req),
        }
    }

    /// Check `authorization` (the header's value) against `--api-key`, if one is set.
    fn authorize(&self, authorization: Option<&str>) -> std::result::Result<(), ApiError> {
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

    fn health(&self) -> Value {
        let Some(engine) = self.engine else {
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

    fn tokenize(&self, req: &Request) -> std::result::Result<Reply, ApiError> {
        let obj = api::parse_object(&req.body)?;
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
        Ok(Reply::Json(json!({ "tokens": ids })))
    }

    fn detokenize(&self, req: &Request) -> std::result::Result<Reply, ApiError> {
        let obj = api::parse_object(&req.body)?;
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
        Ok(Reply::Json(json!({ "content": content })))
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
        self.engine.ok_or_else(|| {
            ApiError::invalid(
                param,
                format!(
                    "{} is an embedding model: it does not generate; use /v1/embeddings",
                    self.model.name
                ),
            )
        })
    }

    fn chat(&self, req: &Request, stream: &TcpStream) -> std::result::Result<Reply, ApiError> {
        let r = api::parse_chat(&req.body)?;
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
        self.generate(gen, req, stream)
    }

    fn completion(
        &self,
        req: &Request,
        stream: &TcpStream,
    ) -> std::result::Result<Reply, ApiError> {
        let r = api::parse_completion(&req.body)?;
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
        self.generate(gen, req, stream)
    }

    fn embeddings(
        &self,
        req: &Request,
        stream: &TcpStream,
    ) -> std::result::Result<Reply, ApiError> {
        let r = embeddings::parse_embeddings(&req.body)?;
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
        let abandoned = || self.stop.is_raised() || answer::client_gone(stream);
        let out = service.embed(&r, deadline, &abandoned)?;
        Ok(Reply::Json(embeddings::embeddings_response(
            &self.model.name,
            &out.vectors,
            r.encoding,
            out.tokens,
        )))
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

    fn generate(
        &self,
        gen: Generation<'_>,
        req: &Request,
        stream: &TcpStream,
    ) -> std::result::Result<Reply, ApiError> {
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
        let wait = Waiter::new(rx, stream, cancel, self.stop);
        let out = Output {
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
        };
        if common.stream {
            Ok(Reply::Written(out.stream(wait, req, common.include_usage)))
        } else {
            out.collect(wait)
        }
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
