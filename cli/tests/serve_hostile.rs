//! `kiln-run serve` against hostile clients (issue #65), over real sockets on 127.0.0.1: the
//! real binary serving the tiny Llama fixture, its stderr collected. A `$ref` cycle in a JSON
//! schema is a 400 naming `response_format.json_schema` before any 200 (streamed or not); a
//! request field holding a newline and an escape sequence cannot forge a log line or reach
//! the terminal; a client without the API key that sends `Expect: 100-continue` reads its 401
//! first; the prompt cache stays within `--cache-mb`; idle and slowloris connections keep no
//! one waiting; the server speaks standard HTTP/1.1 (HEAD, Date, chunked bodies, HTTP/1.0
//! keep-alive, absolute-form targets, one Host) and CORS only to `--cors-origin`s, and sends
//! the page with its security headers. Every wait is bounded: the server is killed when a
//! test ends, and every socket read times out.

/// The runner's test helpers (fixtures, reference dumps, metrics), shared rather than copied.
#[path = "../../runner/tests/common/mod.rs"]
mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

/// Longest wait for the server to listen (the checksum pass included, on a loaded machine).
const START_DEADLINE: Duration = Duration::from_secs(60);

/// Longest a socket read waits, and a log line takes to appear.
const READ_TIMEOUT: Duration = Duration::from_secs(20);

/// The tiny fixture as a `.kiln` file, converted once per test binary.
fn model() -> &'static PathBuf {
    static MODEL: OnceLock<PathBuf> = OnceLock::new();
    MODEL.get_or_init(|| {
        convert(
            &root().join("fixtures/tiny/llama-tied-f32"),
            &fixture_dir("serve_hostile"),
            None,
        )
    })
}

/// A running `kiln-run serve`, killed when dropped.
struct Server {
    child: Child,
    addr: SocketAddr,
    stderr: Arc<Mutex<Vec<u8>>>,
}

impl Server {
    /// Start the server on a free port with `extra` flags; wait until it listens.
    fn start(extra: &[&str]) -> Server {
        let model = model().to_str().unwrap().to_string();
        let mut child = Command::new(env!("CARGO_BIN_EXE_kiln-run"))
            .args(["serve", &model, "--port", "0", "-t", "1", "--parallel", "2"])
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start kiln-run serve");
        let stderr = Arc::new(Mutex::new(Vec::new()));
        let (mut from, to) = (child.stderr.take().unwrap(), Arc::clone(&stderr));
        std::thread::spawn(move || {
            let mut chunk = [0u8; 4096];
            while let Ok(n @ 1..) = from.read(&mut chunk) {
                to.lock().unwrap().extend_from_slice(&chunk[..n]);
            }
        });
        let mut server = Server {
            child,
            addr: "127.0.0.1:0".parse().unwrap(),
            stderr,
        };
        let line = server.wait_for_log("listening on http://", START_DEADLINE);
        let at = line.find("http://").unwrap() + "http://".len();
        server.addr = line[at..].trim().parse().unwrap();
        server
    }

    /// Everything the server wrote on stderr so far.
    fn log(&self) -> String {
        String::from_utf8_lossy(&self.stderr.lock().unwrap()).into_owned()
    }

    /// The first log line containing `what`, waiting for it up to `deadline`.
    fn wait_for_log(&mut self, what: &str, deadline: Duration) -> String {
        let start = Instant::now();
        loop {
            if let Some(line) = self.log().lines().find(|l| l.contains(what)) {
                return line.to_string();
            }
            if let Some(status) = self.child.try_wait().unwrap() {
                panic!("kiln-run serve exited ({status}): {}", self.log());
            }
            assert!(
                start.elapsed() < deadline,
                "no log line with {what:?}: {}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn connect(&self) -> TcpStream {
        let s = TcpStream::connect(self.addr).unwrap();
        s.set_read_timeout(Some(READ_TIMEOUT)).unwrap();
        s
    }

    /// Send `request` and read the whole answer (the request asks to close).
    fn raw(&self, request: &[u8]) -> Response {
        let mut s = self.connect();
        s.write_all(request).unwrap();
        let mut out = Vec::new();
        s.read_to_end(&mut out).unwrap();
        parse(&out)
    }

    fn post(&self, path: &str, body: &Value) -> Response {
        let body = body.to_string();
        self.raw(
            format!(
                "POST {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\
                 Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            )
            .as_bytes(),
        )
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
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
}

fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    loop {
        let (size, rest) = body.split_once("\r\n").unwrap();
        let n = usize::from_str_radix(size, 16).unwrap();
        if n == 0 {
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
    let body = if head.contains("Transfer-Encoding: chunked") {
        dechunk(body)
    } else {
        body.to_string()
    };
    Response {
        status: head[9..12].parse().unwrap(),
        head: head.to_string(),
        body,
    }
}

fn chat(extra: Value) -> Value {
    let mut b = json!({"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8});
    b.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    b
}

fn schema_format(schema: Value) -> Value {
    json!({"response_format": {"type": "json_schema",
                               "json_schema": {"name": "s", "schema": schema}}})
}

/// Issue #65: `{"$ref": "#"}` compiled, then failed in the engine at the first token: a 500,
/// or a 200 and an error event when streamed.
#[test]
fn a_cyclic_schema_is_a_400_naming_json_schema_streamed_or_not() {
    let server = Server::start(&[]);
    let cycles = [
        json!({"$ref": "#"}),
        json!({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
               "$ref": "#/$defs/a"}),
        json!({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}),
    ];
    for schema in cycles {
        for stream in [false, true] {
            let mut body = chat(schema_format(schema.clone()));
            body["stream"] = json!(stream);
            let r = server.post("/v1/chat/completions", &body);
            assert_eq!(r.status, 400, "{schema}, stream {stream}: {}", r.body);
            assert!(!r.head.contains("text/event-stream"), "{}", r.head);
            let e = &r.json()["error"];
            assert_eq!(e["param"], "response_format.json_schema", "{e}");
            assert_eq!(e["type"], "invalid_request_error", "{e}");
        }
    }
    // A schema that works still runs through the engine, its first mask computed up front.
    let ok = schema_format(json!({"type": "object", "properties": {"a": {"type": "integer"}}}));
    for stream in [false, true] {
        let mut body = chat(ok.clone());
        body["stream"] = json!(stream);
        let r = server.post("/v1/chat/completions", &body);
        assert_eq!(r.status, 200, "stream {stream}: {}", r.body);
        assert!(!r.body.contains("\"error\""), "{}", r.body);
    }
    let log = server.log();
    assert!(!log.contains("structured output failed"), "{log}");
    assert!(!log.contains(" 500: "), "{log}");
}

/// Whether `c` is something a log line must never hold raw: a C0 or C1 control, DEL, or a
/// Unicode line or paragraph separator.
fn forbidden(c: char) -> bool {
    (c.is_control() && c != '\n') || matches!(c, '\u{2028}' | '\u{2029}')
}

/// Issue #65: a `role` of `x\nkiln-run serve: GET /admin 200: forged\e[2J` was copied raw
/// into the log: a forged line, and a clear-screen sent to the terminal.
#[test]
fn a_forged_role_path_or_header_cannot_forge_a_log_line() {
    let mut server = Server::start(&[]);
    let forged = "x\nkiln-run serve: GET /admin 200: forged\u{1b}[2J";
    let r = server.post(
        "/v1/chat/completions",
        &json!({"messages": [{"role": forged, "content": "hi"}]}),
    );
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["param"], "messages[0].role");
    // Raw UTF-8 the request parser lets through: a C1 control (NEL) and a line separator
    // in the path, a CSI and a paragraph separator in a header value.
    let r = server.raw(
        "GET /v1/\u{85}x\u{2028}y HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n".as_bytes(),
    );
    assert_eq!(r.status, 404);
    let r = server.raw(
        "POST /v1/completions HTTP/1.1\r\nHost: t\r\nExpect: \u{9b}2J\u{2029}\r\n\
         Content-Length: 2\r\nConnection: close\r\n\r\n{}"
            .as_bytes(),
    );
    assert_eq!(r.status, 417);
    server.wait_for_log("forged", READ_TIMEOUT);
    server.wait_for_log("/v1/\\u{85}x\\u{2028}y", READ_TIMEOUT);
    server.wait_for_log("unsupported Expect", READ_TIMEOUT);
    let log = server.log();
    for line in log.lines() {
        assert!(line.starts_with("kiln-run serve: "), "{line:?}");
        // The forged text stays inside the line that quotes it.
        assert!(!line.starts_with("kiln-run serve: GET /admin"), "{line:?}");
        let bad: Vec<char> = line.chars().filter(|&c| forbidden(c)).collect();
        assert!(bad.is_empty(), "{bad:?} in {line:?}");
    }
    assert!(
        log.contains("x\\nkiln-run serve: GET /admin 200: forged\\u{1b}[2J"),
        "{log}"
    );
}

/// Issue #65: a client without the key that asked for `100 Continue` got it before its 401,
/// an invitation to upload a body the server would refuse.
#[test]
fn expect_continue_without_the_key_reads_401_first() {
    let server = Server::start(&["--api-key", "sekrit", "--max-body-kb", "1"]);
    let head = |auth: &str, path: &str, length: usize| {
        format!(
            "POST {path} HTTP/1.1\r\nHost: t\r\n{auth}Content-Type: application/json\r\n\
             Content-Length: {length}\r\nExpect: 100-continue\r\n\r\n"
        )
    };
    let first_line = |s: &mut TcpStream| {
        let mut got = Vec::new();
        let mut byte = [0u8; 1];
        while !got.ends_with(b"\r\n") {
            assert_eq!(s.read(&mut byte).unwrap(), 1, "closed after {got:?}");
            got.push(byte[0]);
        }
        String::from_utf8(got).unwrap()
    };
    for auth in ["", "Authorization: Bearer wrong\r\n"] {
        let mut s = server.connect();
        s.write_all(head(auth, "/v1/chat/completions", 100).as_bytes())
            .unwrap();
        let mut out = Vec::new();
        s.read_to_end(&mut out).unwrap();
        assert!(out.starts_with(b"HTTP/1.1 401 "), "{auth:?}: {out:?}");
        assert_eq!(parse(&out).json()["error"]["code"], "invalid_api_key");
    }
    // No route, and a body over the limit: refused first too.
    for (path, length, want) in [("/v1/nope", 100, "404"), ("/v1/completions", 2000, "413")] {
        let auth = "Authorization: Bearer sekrit\r\n";
        let mut s = server.connect();
        s.write_all(head(auth, path, length).as_bytes()).unwrap();
        let line = first_line(&mut s);
        assert!(line.starts_with(&format!("HTTP/1.1 {want} ")), "{line:?}");
    }
    // With the key: 100 Continue, then the answer once the body is sent.
    let body = r#"{"content": "Hello"}"#;
    let mut s = server.connect();
    s.write_all(head("Authorization: Bearer sekrit\r\n", "/tokenize", body.len()).as_bytes())
        .unwrap();
    assert_eq!(first_line(&mut s), "HTTP/1.1 100 Continue\r\n");
    assert_eq!(first_line(&mut s), "\r\n");
    s.write_all(body.as_bytes()).unwrap();
    assert!(first_line(&mut s).starts_with("HTTP/1.1 200 "));
}

/// The prompt cache keeps what `--cache-mb` allows, counted as the memory its sequences hold.
#[test]
fn the_prompt_cache_stays_within_cache_mb() {
    let server = Server::start(&["--cache-mb", "1"]);
    for i in 0..48 {
        let content = format!("{i} {}", "word ".repeat(i % 7 * 3));
        let r = server.post(
            "/v1/chat/completions",
            &chat(json!({"messages": [{"role": "user", "content": content}]})),
        );
        assert_eq!(r.status, 200, "{}", r.body);
    }
    let r = server.raw(b"GET /health HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n");
    let h = r.json();
    let (cached, bytes) = (h["cached_sequences"].as_u64(), h["cached_bytes"].as_u64());
    // About 33 KiB each (a page per head, layer, keys and values): some were evicted.
    assert!(cached.is_some_and(|n| (1..48).contains(&n)), "{h}");
    assert!(bytes.is_some_and(|b| b > 0 && b <= 1 << 20), "{h}");
}

/// Read one response on a kept-alive connection: its head, and a body of `Content-Length`.
fn read_one(s: &mut TcpStream) -> Response {
    let mut got = Vec::new();
    let mut byte = [0u8; 1];
    while !got.ends_with(b"\r\n\r\n") {
        assert_eq!(s.read(&mut byte).unwrap(), 1, "closed after {got:?}");
        got.push(byte[0]);
    }
    let head = String::from_utf8(got).unwrap();
    let len: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("Content-Length: "))
        .map_or(0, |n| n.parse().unwrap());
    let mut body = vec![0u8; len];
    s.read_exact(&mut body).unwrap();
    Response {
        status: head[9..12].parse().unwrap(),
        head,
        body: String::from_utf8(body).unwrap(),
    }
}

/// A header line of `head`, by its name.
fn header<'h>(head: &'h str, name: &str) -> Option<&'h str> {
    head.lines().find_map(|l| {
        let (n, v) = l.split_once(": ")?;
        n.eq_ignore_ascii_case(name).then_some(v)
    })
}

/// What a standard HTTP/1.1 server does: HEAD, Date, chunked request bodies, HTTP/1.0
/// keep-alive, absolute-form targets, one Host required; CORS only for a named origin; the
/// page's security headers.
#[test]
fn the_server_speaks_standard_http_and_cors_only_to_named_origins() {
    let allowed = "http://allowed.test";
    let server = Server::start(&["--cors-origin", allowed]);
    let close = "Host: t\r\nConnection: close\r\n";
    let r = server.raw(format!("HEAD /health HTTP/1.1\r\n{close}\r\n").as_bytes());
    assert_eq!((r.status, r.body.as_str()), (200, ""), "{}", r.head);
    let r = server.raw(format!("GET /health HTTP/1.1\r\n{close}\r\n").as_bytes());
    assert!(
        header(&r.head, "Date").is_some_and(|d| d.ends_with(" GMT")),
        "{}",
        r.head
    );
    let r = server.raw(b"GET /health HTTP/1.1\r\nConnection: close\r\n\r\n");
    assert_eq!(r.status, 400, "no Host");
    let r = server.raw(format!("GET /health HTTP/1.1\r\nHost: u\r\n{close}\r\n").as_bytes());
    assert_eq!(r.status, 400, "two Hosts");
    assert!(r.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("Host"));
    let r = server.raw(format!("GET http://t/health HTTP/1.1\r\n{close}\r\n").as_bytes());
    assert_eq!(r.status, 200, "absolute form: {}", r.body);
    let chunked = format!(
        "POST /tokenize HTTP/1.1\r\n{close}Transfer-Encoding: chunked\r\n\r\n\
         b\r\n{{\"content\":\r\n9\r\n \"Hello\"}}\r\n0\r\n\r\n"
    );
    let r = server.raw(chunked.as_bytes());
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r.json()["tokens"].is_array());
    // HTTP/1.0 with keep-alive: two requests on one connection.
    let mut s = server.connect();
    for _ in 0..2 {
        s.write_all(b"GET /health HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
            .unwrap();
        let r = read_one(&mut s);
        assert_eq!(r.status, 200, "{}", r.head);
        assert_eq!(r.json()["status"], "ok");
    }
    let origin = |o: &str| {
        let r =
            server.raw(format!("GET /v1/models HTTP/1.1\r\n{close}Origin: {o}\r\n\r\n").as_bytes());
        assert_eq!(r.status, 200);
        assert!(header(&r.head, "Access-Control-Allow-Credentials").is_none());
        header(&r.head, "Access-Control-Allow-Origin").map(str::to_string)
    };
    assert_eq!(origin(allowed).as_deref(), Some(allowed));
    assert_eq!(origin("http://evil.test"), None);
    let r = server.raw(
        format!(
            "OPTIONS /v1/chat/completions HTTP/1.1\r\n{close}Origin: {allowed}\r\n\
             Access-Control-Request-Method: POST\r\n\
             Access-Control-Request-Headers: authorization, content-type\r\n\r\n"
        )
        .as_bytes(),
    );
    assert_eq!(
        header(&r.head, "Access-Control-Allow-Origin"),
        Some(allowed),
        "{}",
        r.head
    );
    let r = server.raw(format!("GET / HTTP/1.1\r\n{close}\r\n").as_bytes());
    assert_eq!(r.status, 200);
    assert_eq!(header(&r.head, "X-Frame-Options"), Some("DENY"));
    assert_eq!(header(&r.head, "X-Content-Type-Options"), Some("nosniff"));
    let csp = header(&r.head, "Content-Security-Policy").unwrap();
    assert!(csp.contains("frame-ancestors 'none'") && csp.contains("default-src 'none'"));
}

/// Without --cors-origin no response carries CORS headers, whatever the Origin.
#[test]
fn cors_is_off_by_default() {
    let server = Server::start(&[]);
    for path in ["/v1/models", "/health"] {
        let r = server.raw(
            format!("GET {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\nOrigin: http://a.test\r\n\r\n")
                .as_bytes(),
        );
        assert_eq!(r.status, 200);
        assert!(
            !r.head.to_ascii_lowercase().contains("access-control-"),
            "{}",
            r.head
        );
    }
}

/// Idle connections, and slowloris senders dribbling a head, hold no place the server
/// serves from: with 100 of each open, /health and a completion still answer at once.
#[test]
fn idle_and_slow_connections_do_not_keep_others_waiting() {
    let server = Server::start(&["--max-connections", "4"]);
    let idle: Vec<TcpStream> = (0..100).map(|_| server.connect()).collect();
    let mut slow: Vec<TcpStream> = (0..100).map(|_| server.connect()).collect();
    for s in &mut slow {
        s.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nX-A: ")
            .unwrap();
    }
    // Another byte on every slow head, as a slowloris keeps its sockets alive.
    for s in &mut slow {
        s.write_all(b"a").unwrap();
    }
    let t0 = Instant::now();
    let r = server.raw(b"GET /health HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n");
    let health = t0.elapsed();
    assert_eq!(r.status, 200);
    let t0 = Instant::now();
    let r = server.post(
        "/v1/completions",
        &json!({"prompt": "Hello", "max_tokens": 2}),
    );
    let completion = t0.elapsed();
    assert_eq!(r.status, 200, "{}", r.body);
    // About a millisecond each on an idle machine; the bounds leave room for a loaded one.
    assert!(
        health < Duration::from_millis(500),
        "/health took {health:?}"
    );
    assert!(
        completion < Duration::from_secs(2),
        "completion took {completion:?}"
    );
    drop((idle, slow));
}
