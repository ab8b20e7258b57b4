//! `kiln-run serve`'s connection side over real sockets, with a scripted engine: a thread that
//! reads the job queue and answers each job with events chosen by its `max_tokens`.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kiln_format::TokenizerFiles;
use kiln_runner::engine::job::{Event, Finish, Job, TokenInfo, Usage};
use kiln_runner::engine::{queue, EngineHandle};
use kiln_runner::serve::grammar::Grammars;
use kiln_runner::{ChatTemplate, Interrupt, Message, SamplerConfig, Tokenizer};
use kiln_server::{serve, FrontConfig, FrontModel};
use serde_json::{json, Value};

const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

const CTX: usize = 64;
const VOCAB: usize = 26;

/// `max_tokens` values that pick a script (no other test asks for these).
const FAIL: usize = 3;
const HANG: usize = 4;
const FLOOD: usize = 7;

fn tokenizer() -> Tokenizer {
    let json = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../fuzz/corpus/tokenizer/bpe.json"
    ))
    .unwrap();
    let files = TokenizerFiles {
        tokenizer_json: Some(json),
        ..TokenizerFiles::default()
    };
    Tokenizer::from_parts("tiny", &files, None, &[]).unwrap()
}

/// What the engine was asked.
struct Seen {
    prompt: Vec<u32>,
    max_tokens: usize,
    sampler: SamplerConfig,
    stop: Vec<String>,
    logprobs: Option<usize>,
    ignore_eos: bool,
    constrained: bool,
    cancel: Arc<AtomicBool>,
}

fn info(id: u32) -> TokenInfo {
    TokenInfo {
        id,
        logprob: -0.5,
        top: vec![(id, -0.5), (0, -2.0)],
    }
}

/// "Hell" + "o", then done; or a failure; or one token and then nothing until cancelled.
fn fake_engine(rx: Receiver<Job>, seen: Sender<Seen>, stop: &Interrupt) {
    loop {
        let job = match rx.recv_timeout(Duration::from_millis(20)) {
            Ok(j) => j,
            Err(RecvTimeoutError::Timeout) if stop.is_raised() => return,
            Err(RecvTimeoutError::Timeout) => continue,
            Err(RecvTimeoutError::Disconnected) => return,
        };
        let _ = seen.send(Seen {
            prompt: job.prompt.clone(),
            max_tokens: job.max_tokens,
            sampler: job.sampler.clone(),
            stop: job.stop.clone(),
            logprobs: job.logprobs,
            ignore_eos: job.ignore_eos,
            constrained: job.constraint.is_some(),
            cancel: job.cancel.clone(),
        });
        let ev = &job.events;
        match job.max_tokens {
            FAIL => {
                let _ = ev.send(Event::Failed {
                    message: "the model produced NaN".into(),
                });
            }
            FLOOD => {
                let t0 = Instant::now();
                while !job.cancel.load(Ordering::SeqCst) && t0.elapsed().as_secs() < 10 {
                    let _ = ev.send(Event::Text {
                        text: "Hello ".repeat(2000),
                        tokens: vec![info(17)],
                    });
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
            HANG => {
                let _ = ev.send(Event::Text {
                    text: "Hell".into(),
                    tokens: vec![info(17)],
                });
                let t0 = Instant::now();
                while !job.cancel.load(Ordering::SeqCst) && t0.elapsed().as_secs() < 10 {
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
            _ => {
                let _ = ev.send(Event::Text {
                    text: "Hell".into(),
                    tokens: vec![info(17)],
                });
                let _ = ev.send(Event::Text {
                    text: String::new(),
                    tokens: vec![],
                });
                let _ = ev.send(Event::Text {
                    text: "o".into(),
                    tokens: vec![info(3)],
                });
                let _ = ev.send(Event::Done {
                    finish: Finish::Stop,
                    usage: Usage {
                        prompt_tokens: job.prompt.len(),
                        cached_tokens: 1,
                        completion_tokens: 2,
                    },
                    timings: Default::default(),
                });
            }
        }
    }
}

struct Ctx<'a> {
    addr: SocketAddr,
    seen: Receiver<Seen>,
    tok: &'static Tokenizer,
    template: &'static ChatTemplate<'static>,
    engine: &'a EngineHandle,
}

impl Ctx<'_> {
    fn seen(&self) -> Seen {
        self.seen.recv_timeout(Duration::from_secs(5)).unwrap()
    }
}

/// Run `test` against a server with `cfg` and a queue of `depth`; `engine`: whether the
/// scripted engine reads the queue.
fn with_server(cfg: FrontConfig, depth: usize, engine: bool, test: impl FnOnce(&Ctx)) {
    with_server_chat(cfg, depth, engine, true, test)
}

/// [`with_server`]; `chat`: whether the model has a chat template.
fn with_server_chat(
    cfg: FrontConfig,
    depth: usize,
    engine: bool,
    chat: bool,
    test: impl FnOnce(&Ctx),
) {
    // The server holds its model for good, as `kiln-run serve` does.
    let tok: &'static Tokenizer = Box::leak(Box::new(tokenizer()));
    let template: &'static ChatTemplate<'static> = Box::leak(Box::new(
        ChatTemplate::new(CHATML, minijinja::Value::UNDEFINED).unwrap(),
    ));
    let grammars: &'static Grammars = Box::leak(Box::new(Grammars::new(tok, VOCAB).unwrap()));
    let model = FrontModel {
        name: "tiny".into(),
        tokenizer: tok,
        template: chat.then_some(template),
        ctx: CTX,
        vocab: VOCAB,
        grammars: Some(grammars),
        created: 1,
        embeddings: None,
    };
    let (handle, rx) = queue(2, depth);
    let stop = Interrupt::new();
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let (seen_tx, seen_rx) = channel();
    std::thread::scope(|s| {
        let served = handle.clone();
        let server = s.spawn(|| serve(listener, &cfg, model, Some(served), &stop));
        let _idle_queue = if engine {
            s.spawn(|| fake_engine(rx, seen_tx, &stop));
            None
        } else {
            Some(rx)
        };
        let ctx = Ctx {
            addr,
            seen: seen_rx,
            tok,
            template,
            engine: &handle,
        };
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| test(&ctx)));
        stop.raise(1);
        let t0 = Instant::now();
        server.join().unwrap().unwrap();
        assert!(t0.elapsed() < Duration::from_secs(2), "shutdown was slow");
        if let Err(p) = outcome {
            std::panic::resume_unwind(p);
        }
    });
}

#[derive(Debug)]
struct Response {
    status: u16,
    head: String,
    body: String,
}

impl Response {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
    }

    /// The SSE events' data, `[DONE]` included.
    fn events(&self) -> Vec<String> {
        assert!(
            self.head.contains("Content-Type: text/event-stream"),
            "{}",
            self.head
        );
        self.body
            .split_terminator("\n\n")
            .map(|e| e.strip_prefix("data: ").unwrap().to_string())
            .collect()
    }

    fn param(&self) -> Value {
        self.json()["error"]["param"].clone()
    }
}

fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    loop {
        let (size, rest) = body.split_once("\r\n").unwrap();
        let n = usize::from_str_radix(size, 16).unwrap();
        if n == 0 {
            assert_eq!(rest, "\r\n");
            return out;
        }
        out.push_str(&rest[..n]);
        body = rest[n..].strip_prefix("\r\n").unwrap();
    }
}

fn parse(bytes: &[u8]) -> Response {
    let text = String::from_utf8(bytes.to_vec()).unwrap();
    let (head, body) = text
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("no head in {text:?}"));
    let status = head[9..12].parse().unwrap();
    let body = if head.contains("Transfer-Encoding: chunked") {
        dechunk(body)
    } else {
        body.to_string()
    };
    Response {
        status,
        head: head.to_string(),
        body,
    }
}

fn connect(addr: SocketAddr) -> TcpStream {
    let s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s
}

fn raw(addr: SocketAddr, request: &[u8]) -> Response {
    let mut s = connect(addr);
    s.write_all(request).unwrap();
    let mut out = Vec::new();
    s.read_to_end(&mut out).unwrap();
    parse(&out)
}

fn request(addr: SocketAddr, method: &str, path: &str, key: Option<&str>, body: &str) -> Response {
    let auth = key.map_or(String::new(), |k| format!("Authorization: Bearer {k}\r\n"));
    raw(
        addr,
        format!(
            "{method} {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n{auth}\
             Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .as_bytes(),
    )
}

fn post(addr: SocketAddr, path: &str, body: &Value) -> Response {
    request(addr, "POST", path, None, &body.to_string())
}

fn chat_body(extra: Value) -> Value {
    let mut b = json!({"model": "any", "messages": [{"role": "user", "content": "Hello world"}]});
    b.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    b
}

#[test]
fn a_chat_completion_carries_the_request_to_the_engine_and_the_answer_back() {
    with_server(FrontConfig::default(), 4, true, |c| {
        let r = post(
            c.addr,
            "/v1/chat/completions",
            &chat_body(
                json!({"temperature": 0.7, "seed": 5, "max_tokens": 10, "stop": ["!"],
                "logprobs": true, "top_logprobs": 1, "ignore_eos": true,
                "response_format": {"type": "json_schema",
                                    "json_schema": {"name": "n", "schema": {"type": "integer"}}}}),
            ),
        );
        assert_eq!(r.status, 200, "{}", r.body);
        let j = r.json();
        assert_eq!(j["object"], "chat.completion");
        assert!(j["id"].as_str().unwrap().starts_with("chatcmpl-"));
        assert_eq!(j["model"], "tiny");
        assert_eq!(j["choices"][0]["message"]["content"], "Hello");
        assert_eq!(j["choices"][0]["finish_reason"], "stop");
        assert_eq!(j["usage"]["completion_tokens"], 2);
        assert_eq!(j["usage"]["prompt_tokens_details"]["cached_tokens"], 1);
        let lp = &j["choices"][0]["logprobs"]["content"];
        assert_eq!(lp[0]["token"], "Hell");
        assert_eq!(lp[0]["top_logprobs"][1]["token"], "H");
        assert_eq!(lp[1]["token"], "o");

        let s = c.seen();
        let rendered = c
            .template
            .render(&[Message::new("user", "Hello world")], true)
            .unwrap();
        assert_eq!(s.prompt, c.tok.encode_rendered(&rendered).unwrap());
        assert_eq!(s.max_tokens, 10);
        assert_eq!((s.sampler.temperature, s.sampler.seed), (0.7, 5));
        assert_eq!(s.stop, vec!["!"]);
        assert_eq!(s.logprobs, Some(1));
        assert!(s.ignore_eos && s.constrained);
        assert_eq!(j["usage"]["prompt_tokens"], s.prompt.len());

        // This vocabulary has no `{`: no object can be written, and the schema is refused
        // before the job is queued.
        let r = post(
            c.addr,
            "/v1/chat/completions",
            &chat_body(json!({"response_format": {"type": "json_object"}})),
        );
        assert_eq!((r.status, r.param()), (400, json!("response_format")));
        assert!(
            r.body.contains("no document the model can write"),
            "{}",
            r.body
        );

        // No max_tokens: the room left in the context.
        let r = post(c.addr, "/v1/chat/completions", &chat_body(json!({})));
        assert_eq!(r.status, 200);
        let s = c.seen();
        assert_eq!(s.max_tokens, CTX - s.prompt.len());
        assert!(!s.constrained && s.logprobs.is_none());
        // More than the room: capped.
        post(
            c.addr,
            "/v1/chat/completions",
            &chat_body(json!({"max_tokens": 1000})),
        );
        let s = c.seen();
        assert_eq!(s.max_tokens, CTX - s.prompt.len());
    });
}

#[test]
fn a_streamed_chat_follows_the_chunk_rules() {
    with_server(FrontConfig::default(), 4, true, |c| {
        let r = post(
            c.addr,
            "/v1/chat/completions",
            &chat_body(json!({"stream": true, "stream_options": {"include_usage": true}})),
        );
        assert_eq!(r.status, 200);
        assert!(r.head.contains("Cache-Control: no-cache"));
        let events = r.events();
        assert_eq!(events.last().unwrap(), "[DONE]");
        let chunks: Vec<Value> = events[..events.len() - 1]
            .iter()
            .map(|e| serde_json::from_str(e).unwrap())
            .collect();
        assert_eq!(
            chunks.len(),
            5,
            "role, two texts, finish, usage: {events:?}"
        );
        assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
        let text: String = chunks[1..3]
            .iter()
            .map(|c| c["choices"][0]["delta"]["content"].as_str().unwrap())
            .collect();
        assert_eq!(text, "Hello");
        assert_eq!(chunks[3]["choices"][0]["finish_reason"], "stop");
        assert_eq!(chunks[4]["choices"], json!([]));
        assert_eq!(
            chunks[4]["usage"]["total_tokens"],
            c.seen().prompt.len() + 2
        );
        for ch in &chunks {
            assert_eq!(ch["object"], "chat.completion.chunk");
            assert_eq!(ch["id"], chunks[0]["id"]);
            assert_eq!(ch["created"], chunks[0]["created"]);
            assert!(ch["system_fingerprint"].is_string());
        }
        for ch in &chunks[..4] {
            assert!(ch["usage"].is_null() && ch.get("usage").is_some());
        }
        // Without include_usage, no usage chunk.
        let r = post(
            c.addr,
            "/v1/chat/completions",
            &chat_body(json!({"stream": true})),
        );
        assert_eq!(r.events().len(), 5);
    });
}

#[test]
fn completions_take_text_or_token_prompts_and_report_legacy_logprobs() {
    with_server(FrontConfig::default(), 4, true, |c| {
        let r = post(
            c.addr,
            "/v1/completions",
            &json!({"prompt": [17, 3], "logprobs": 1, "max_tokens": 5}),
        );
        assert_eq!(r.status, 200, "{}", r.body);
        let j = r.json();
        assert_eq!(j["object"], "text_completion");
        assert_eq!(j["choices"][0]["text"], "Hello");
        let lp = &j["choices"][0]["logprobs"];
        assert_eq!(lp["tokens"], json!(["Hell", "o"]));
        assert_eq!(lp["text_offset"], json!([0, 4]));
        assert_eq!(c.seen().prompt, vec![17, 3]);

        let r = post(c.addr, "/v1/completions", &json!({"prompt": "Hello"}));
        assert_eq!(r.status, 200);
        assert_eq!(c.seen().prompt, c.tok.encode("Hello").unwrap());

        let r = post(
            c.addr,
            "/v1/completions",
            &json!({"prompt": "Hello", "stream": true}),
        );
        let events = r.events();
        let last: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
        assert_eq!(last["choices"][0]["finish_reason"], "stop");
        c.seen();

        let r = post(c.addr, "/v1/completions", &json!({"prompt": [1, 26]}));
        assert_eq!((r.status, r.param()), (400, json!("prompt[1]")));
    });
}

#[test]
fn the_api_key_guards_the_api_but_not_health_or_the_page() {
    let cfg = FrontConfig {
        api_key: Some("sekrit".into()),
        ..FrontConfig::default()
    };
    with_server(cfg, 4, true, |c| {
        for key in [None, Some("wrong"), Some("sekri"), Some("sekrit2")] {
            let r = request(c.addr, "GET", "/v1/models", key, "");
            assert_eq!(r.status, 401, "{key:?}");
            assert_eq!(r.json()["error"]["code"], "invalid_api_key");
        }
        let r = request(c.addr, "POST", "/tokenize", None, r#"{"content":"a"}"#);
        assert_eq!(r.status, 401);
        let r = request(c.addr, "GET", "/v1/models", Some("sekrit"), "");
        assert_eq!(r.status, 200);
        assert_eq!(r.json()["data"][0]["id"], "tiny");
        let r = request(c.addr, "GET", "/health", None, "");
        assert_eq!(r.status, 200);
        let h = r.json();
        assert_eq!(h["status"], "ok");
        assert_eq!(
            (h["slots"].as_u64(), h["slots_idle"].as_u64()),
            (Some(2), Some(2))
        );
        for k in ["active", "queued", "cached_sequences", "cached_bytes"] {
            assert!(h[k].is_u64(), "{k}");
        }
        let r = request(c.addr, "GET", "/", None, "");
        assert_eq!(r.status, 200);
        assert!(r.head.contains("text/html"));
        assert!(r.body.starts_with("<!doctype html>"));
    });
}

#[test]
fn client_errors_are_openai_shaped() {
    let cfg = FrontConfig {
        max_body_bytes: 1000,
        ..FrontConfig::default()
    };
    with_server(cfg, 4, true, |c| {
        let r = request(c.addr, "GET", "/nope", None, "");
        assert_eq!(r.status, 404);
        assert_eq!(r.json()["error"]["type"], "invalid_request_error");
        let r = request(c.addr, "GET", "/v1/chat/completions", None, "");
        assert_eq!(r.status, 405);
        assert!(r.head.contains("Allow: POST"), "{}", r.head);
        let r = post(
            c.addr,
            "/v1/chat/completions",
            &chat_body(json!({"temperature": "hot"})),
        );
        assert_eq!((r.status, r.param()), (400, json!("temperature")));
        let r = request(
            c.addr,
            "POST",
            "/v1/chat/completions",
            None,
            "{\"messages\": [",
        );
        assert_eq!(r.status, 400);
        assert!(r.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("column"));
        let r = post(
            c.addr,
            "/v1/chat/completions",
            &chat_body(json!({"tools": []})),
        );
        assert_eq!((r.status, r.param()), (400, json!("tools")));
        let r = post(
            c.addr,
            "/v1/chat/completions",
            &chat_body(json!({"messages": [{"role": "user", "content": "Hello ".repeat(60)}]})),
        );
        assert_eq!((r.status, r.param()), (400, json!("messages")));
        let msg = r.json()["error"]["message"].as_str().unwrap().to_string();
        assert!(
            msg.contains("tokens") && msg.contains(&CTX.to_string()),
            "{msg}"
        );
        let r = request(c.addr, "POST", "/v1/completions", None, &"x".repeat(1001));
        assert_eq!(r.status, 413);
        let big = format!(
            "GET /health HTTP/1.1\r\nHost: t\r\nX-Big: {}\r\nConnection: close\r\n\r\n",
            "a".repeat(20_000)
        );
        assert_eq!(raw(c.addr, big.as_bytes()).status, 431);
        // An empty chunked body is read (no longer refused for its framing) and found empty.
        let chunked = "POST /v1/completions HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\
                       Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n";
        assert_eq!(raw(c.addr, chunked.as_bytes()).status, 400);
        // A chunked body over the limit is cut off where it passes it.
        let chunked = format!(
            "POST /v1/completions HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\
             Transfer-Encoding: chunked\r\n\r\n5dc\r\n{}\r\n0\r\n\r\n",
            "x".repeat(1500)
        );
        let r = raw(c.addr, chunked.as_bytes());
        assert_eq!(r.status, 413, "{}", r.body);
        assert!(r.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("(1000 bytes)"));
        // The engine's failure is a 500 with its message.
        let r = post(
            c.addr,
            "/v1/completions",
            &json!({"prompt": "Hello", "max_tokens": FAIL}),
        );
        assert_eq!(r.status, 500);
        assert_eq!(r.json()["error"]["message"], "the model produced NaN");
        c.seen();
    });
}

#[test]
fn tokenize_and_detokenize_round_trip() {
    with_server(FrontConfig::default(), 4, true, |c| {
        let r = post(c.addr, "/tokenize", &json!({"content": "Hello world"}));
        let ids = r.json()["tokens"].clone();
        assert_eq!(ids, json!(c.tok.encode_rendered("Hello world").unwrap()));
        let r = post(c.addr, "/detokenize", &json!({"tokens": ids}));
        assert_eq!(r.json()["content"], "Hello world");
        let r = post(c.addr, "/detokenize", &json!({"tokens": [1, 26]}));
        assert_eq!((r.status, r.param()), (400, json!("tokens[1]")));
        let r = post(c.addr, "/tokenize", &json!({"content": 1}));
        assert_eq!((r.status, r.param()), (400, json!("content")));
    });
}

#[test]
fn a_full_queue_answers_503_with_retry_after() {
    with_server(FrontConfig::default(), 1, false, |c| {
        // The first job fills the one queue place (nothing reads the queue).
        let mut first = connect(c.addr);
        let body = chat_body(json!({"stream": true})).to_string();
        write!(
            first,
            "POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let t0 = Instant::now();
        while c.engine.status().queued == 0 {
            assert!(t0.elapsed() < Duration::from_secs(5));
            std::thread::sleep(Duration::from_millis(10));
        }
        let r = post(c.addr, "/v1/chat/completions", &chat_body(json!({})));
        assert_eq!(r.status, 503);
        assert!(r.head.contains("Retry-After: 1"), "{}", r.head);
        drop(first);
    });
}

#[test]
fn a_client_that_disconnects_mid_stream_has_its_job_cancelled() {
    with_server(FrontConfig::default(), 4, true, |c| {
        let mut s = connect(c.addr);
        let body = chat_body(json!({"stream": true, "max_tokens": HANG})).to_string();
        write!(
            s,
            "POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        while !String::from_utf8_lossy(&got).contains("Hell") {
            let n = s.read(&mut buf).unwrap();
            assert!(n > 0);
            got.extend_from_slice(&buf[..n]);
        }
        let seen = c.seen();
        assert!(!seen.cancel.load(Ordering::SeqCst));
        drop(s);
        wait_cancelled(&seen);
    });
}

#[test]
fn slow_headers_are_cut_off_by_the_header_timeout() {
    let cfg = FrontConfig {
        request_timeout: Duration::from_millis(300),
        ..FrontConfig::default()
    };
    with_server(cfg, 4, true, |c| {
        let mut s = connect(c.addr);
        s.write_all(b"POST /v1/completions HTTP/1.1\r\nHost")
            .unwrap();
        let t0 = Instant::now();
        let mut out = Vec::new();
        // The connection closes without an answer (hyper's header read timeout).
        let _ = s.read_to_end(&mut out);
        assert!(t0.elapsed() < Duration::from_secs(2));
        assert!(!String::from_utf8_lossy(&out).contains(" 200 "), "{out:?}");
    });
}

#[test]
fn requests_beyond_the_in_flight_limit_get_503_but_idle_connections_and_health_do_not() {
    let cfg = FrontConfig {
        max_requests: 1,
        ..FrontConfig::default()
    };
    with_server(cfg, 4, true, |c| {
        let idle: Vec<TcpStream> = (0..8).map(|_| connect(c.addr)).collect();
        let r = request(c.addr, "GET", "/v1/models", None, "");
        assert_eq!(r.status, 200, "idle connections took the only place");
        // A whole answer that never comes holds the one place.
        let mut waiting = connect(c.addr);
        let body = json!({"prompt": "Hello", "max_tokens": HANG}).to_string();
        write!(
            waiting,
            "POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let seen = c.seen();
        let r = request(c.addr, "GET", "/v1/models", None, "");
        assert_eq!(r.status, 503);
        assert!(r.head.contains("Retry-After: 1"), "{}", r.head);
        assert_eq!(r.json()["error"]["type"], "server_error");
        assert_eq!(request(c.addr, "GET", "/health", None, "").status, 200);
        drop(waiting);
        wait_cancelled(&seen);
        drop(idle);
    });
}

#[test]
fn keep_alive_carries_several_requests() {
    with_server(FrontConfig::default(), 4, true, |c| {
        let mut s = connect(c.addr);
        for _ in 0..2 {
            s.write_all(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
                .unwrap();
            let mut got = Vec::new();
            let mut byte = [0u8; 1];
            while !got.ends_with(b"\r\n\r\n") {
                s.read_exact(&mut byte).unwrap();
                got.push(byte[0]);
            }
            let head = String::from_utf8(got).unwrap();
            assert!(head.starts_with("HTTP/1.1 200"));
            assert!(!head.contains("Connection: close"));
            let len: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("Content-Length: "))
                .unwrap()
                .parse()
                .unwrap();
            let mut body = vec![0u8; len];
            s.read_exact(&mut body).unwrap();
            let v: Value = serde_json::from_slice(&body).unwrap();
            assert_eq!(v["status"], "ok");
        }
    });
}

#[test]
fn a_model_without_a_template_refuses_chat_but_serves_completions() {
    with_server_chat(FrontConfig::default(), 4, true, false, |c| {
        let r = post(c.addr, "/v1/chat/completions", &chat_body(json!({})));
        assert_eq!((r.status, r.param()), (400, json!("messages")));
        assert!(r.body.contains("no chat template"), "{}", r.body);
        let r = post(c.addr, "/v1/completions", &json!({"prompt": "Hello"}));
        assert_eq!(r.status, 200);
        c.seen();
    });
}

#[test]
fn a_client_that_disconnects_while_waiting_for_a_whole_answer_has_its_job_cancelled() {
    with_server(FrontConfig::default(), 4, true, |c| {
        let mut s = connect(c.addr);
        let body = json!({"prompt": "Hello", "max_tokens": HANG}).to_string();
        write!(
            s,
            "POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let seen = c.seen();
        drop(s);
        wait_cancelled(&seen);
    });
}

#[test]
fn shutdown_is_prompt_with_idle_and_waiting_connections_open() {
    let held = std::cell::RefCell::new(Vec::new());
    with_server(FrontConfig::default(), 4, true, |c| {
        // One idle keep-alive connection, one waiting for a job that never ends.
        let mut idle = connect(c.addr);
        idle.write_all(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
            .unwrap();
        let mut waiting = connect(c.addr);
        let body = json!({"prompt": "Hello", "max_tokens": HANG}).to_string();
        write!(
            waiting,
            "POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        c.seen();
        held.borrow_mut().extend([idle, waiting]);
    });
    // with_server asserts that serve returned within 2 s of the stop.
    assert_eq!(held.borrow().len(), 2);
}

/// Waits until the job `seen` describes is cancelled.
fn wait_cancelled(seen: &Seen) {
    let t0 = Instant::now();
    while !seen.cancel.load(Ordering::SeqCst) {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "the job was not cancelled"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn a_client_that_leaves_while_tokens_flow_has_its_job_cancelled() {
    with_server(FrontConfig::default(), 4, true, |c| {
        let mut s = connect(c.addr);
        let body = json!({"prompt": "Hello", "max_tokens": FLOOD}).to_string();
        write!(
            s,
            "POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let seen = c.seen();
        drop(s);
        wait_cancelled(&seen);
    });
}

#[test]
fn a_client_that_stops_reading_a_stream_has_its_job_cancelled_by_the_write_timeout() {
    let cfg = FrontConfig {
        request_timeout: Duration::from_millis(300),
        ..FrontConfig::default()
    };
    with_server(cfg, 4, true, |c| {
        let mut s = connect(c.addr);
        let body = json!({"prompt": "Hello", "max_tokens": FLOOD, "stream": true}).to_string();
        write!(
            s,
            "POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        // The client stays connected and never reads.
        let seen = c.seen();
        wait_cancelled(&seen);
        drop(s);
    });
}
