//! A small, strict HTTP/1.1 layer over any `BufRead` + `Write` (a `TcpStream` in the server,
//! byte buffers in tests).
//!
//! [`read_request`] reads one request head ([`read_head`]) and its `Content-Length` body
//! ([`read_body`]), every part bounded:
//! a head over [`Limits::max_head_bytes`] or [`Limits::max_headers`] is a 431, a body over
//! [`Limits::max_body_bytes`] a 413, a chunked request body a 411 (the server has no use for
//! streamed uploads, and refusing them keeps the body bound exact). A deadline covers the whole
//! request, so a client that trickles bytes cannot hold a thread longer than one timeout.
//!
//! The writers answer with a whole JSON body ([`write_json`]) or a Server-Sent-Events stream in
//! chunked encoding ([`SseWriter`]).

use std::io::{BufRead, Write};
use std::time::Instant;

/// Most bytes a request head (request line and headers) may hold: far above any real client's
/// (a few hundred bytes, a few KiB with cookies), and small enough that a thread never buffers
/// much for a request it will refuse.
pub const MAX_HEAD_BYTES: usize = 16 * 1024;

/// Most header lines a request may carry (real clients send under 20).
pub const MAX_HEADERS: usize = 100;

/// Bounds on what one request may hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Bytes of request line and headers together.
    pub max_head_bytes: usize,
    /// Header lines.
    pub max_headers: usize,
    /// Bytes of body.
    pub max_body_bytes: usize,
}

impl Limits {
    /// The head limits above with a body limit of `max_body_bytes`.
    pub fn with_body(max_body_bytes: usize) -> Limits {
        Limits {
            max_head_bytes: MAX_HEAD_BYTES,
            max_headers: MAX_HEADERS,
            max_body_bytes,
        }
    }
}

/// One parsed request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// `GET`, `POST`… as sent (methods are case-sensitive).
    pub method: String,
    /// The path, without the query string.
    pub path: String,
    /// What followed `?`, if anything.
    pub query: Option<String>,
    /// Header names lowercased, values trimmed, in order.
    pub headers: Vec<(String, String)>,
    /// The body (`Content-Length` bytes).
    pub body: Vec<u8>,
    /// Whether the connection stays open after the response (HTTP/1.1 unless
    /// `Connection: close`; HTTP/1.0 only with `Connection: keep-alive`).
    pub keep_alive: bool,
}

impl Request {
    /// The first value of header `name` (lowercase).
    pub fn header(&self, name: &str) -> Option<&str> {
        header(&self.headers, name)
    }
}

/// Why no request could be read.
#[derive(Debug)]
pub enum HttpError {
    /// The client closed the connection (or stayed silent past the deadline) before sending a
    /// byte of a new request: not an error, the connection just ends.
    Closed,
    /// The deadline passed in the middle of a request: 408.
    Timeout,
    /// The connection failed; no response is possible.
    Io(std::io::Error),
    /// A malformed request: 400.
    BadRequest(String),
    /// The head is over a limit: 431.
    HeadTooLarge(String),
    /// The body is over the limit: 413.
    BodyTooLarge {
        /// The limit in bytes.
        limit: usize,
        /// The declared `Content-Length`.
        length: u64,
    },
    /// A request body in `Transfer-Encoding`: 411.
    LengthRequired,
    /// Not HTTP/1.0 or 1.1: 505.
    Version(String),
}

impl HttpError {
    /// The status to answer with, or `None` when no answer is possible.
    pub fn status(&self) -> Option<u16> {
        match self {
            HttpError::Closed | HttpError::Io(_) => None,
            HttpError::Timeout => Some(408),
            HttpError::BadRequest(_) => Some(400),
            HttpError::HeadTooLarge(_) => Some(431),
            HttpError::BodyTooLarge { .. } => Some(413),
            HttpError::LengthRequired => Some(411),
            HttpError::Version(_) => Some(505),
        }
    }
}

impl std::fmt::Display for HttpError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HttpError::Closed => write!(f, "the client closed the connection"),
            HttpError::Timeout => write!(f, "the request was not received in time"),
            HttpError::Io(e) => write!(f, "connection error: {e}"),
            HttpError::BadRequest(m) => write!(f, "malformed request: {m}"),
            HttpError::HeadTooLarge(m) => write!(f, "request head too large: {m}"),
            HttpError::BodyTooLarge { limit, length } => write!(
                f,
                "the request body is {length} bytes, more than the server accepts ({limit})"
            ),
            HttpError::LengthRequired => write!(
                f,
                "request bodies in Transfer-Encoding are not accepted; send Content-Length"
            ),
            HttpError::Version(v) => write!(f, "unsupported HTTP version `{v}`; use HTTP/1.1"),
        }
    }
}

fn io_error(e: std::io::Error, started: bool) -> HttpError {
    use std::io::ErrorKind;
    match e.kind() {
        ErrorKind::WouldBlock | ErrorKind::TimedOut if started => HttpError::Timeout,
        ErrorKind::WouldBlock | ErrorKind::TimedOut => HttpError::Closed,
        ErrorKind::UnexpectedEof if !started => HttpError::Closed,
        _ => HttpError::Io(e),
    }
}

/// Read one line ending in `\n` into `line` (without the line ending), taking at most `budget`
/// bytes in all; `Ok(false)` at end of input before any byte.
fn read_line<R: BufRead>(
    r: &mut R,
    line: &mut Vec<u8>,
    budget: &mut usize,
    deadline: Option<Instant>,
    started: bool,
) -> Result<bool, HttpError> {
    line.clear();
    loop {
        if deadline.is_some_and(|d| Instant::now() > d) {
            return Err(if started || !line.is_empty() {
                HttpError::Timeout
            } else {
                HttpError::Closed
            });
        }
        let buf = match r.fill_buf() {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(io_error(e, started || !line.is_empty())),
        };
        if buf.is_empty() {
            if line.is_empty() && !started {
                return Ok(false);
            }
            return Err(HttpError::BadRequest(
                "the connection closed in the middle of the request head".into(),
            ));
        }
        let (take, end) = match buf.iter().position(|&b| b == b'\n') {
            Some(i) => (i + 1, true),
            None => (buf.len(), false),
        };
        if take > *budget {
            return Err(HttpError::HeadTooLarge(format!(
                "the request head is over {MAX_HEAD_BYTES} bytes"
            )));
        }
        *budget -= take;
        line.extend_from_slice(&buf[..take]);
        r.consume(take);
        if end {
            line.pop();
            if line.last() == Some(&b'\r') {
                line.pop();
            }
            return Ok(true);
        }
    }
}

fn is_token(s: &str) -> bool {
    !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

/// A request's head: everything but the body, whose length it declares.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Head {
    /// `GET`, `POST`… as sent (methods are case-sensitive).
    pub method: String,
    /// The path, without the query string.
    pub path: String,
    /// What followed `?`, if anything.
    pub query: Option<String>,
    /// Header names lowercased, values trimmed, in order.
    pub headers: Vec<(String, String)>,
    /// Whether the connection stays open after the response (HTTP/1.1 unless
    /// `Connection: close`; HTTP/1.0 only with `Connection: keep-alive`).
    pub keep_alive: bool,
    /// The body's `Content-Length` (0 when absent), within [`Limits::max_body_bytes`].
    pub length: usize,
    /// The client waits for `100 Continue` before it sends the body.
    pub expect_continue: bool,
}

impl Head {
    /// The first value of header `name` (lowercase).
    pub fn header(&self, name: &str) -> Option<&str> {
        header(&self.headers, name)
    }
}

fn header<'h>(headers: &'h [(String, String)], name: &str) -> Option<&'h str> {
    headers
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v.as_str())
}

/// Read one request from `r`: [`read_head`], then [`read_body`] (`w` receives `100 Continue`
/// when the client asks for it). `deadline` bounds the whole request; a client silent until
/// then before its first byte gives [`HttpError::Closed`].
pub fn read_request<R: BufRead, W: Write>(
    r: &mut R,
    w: &mut W,
    limits: &Limits,
    deadline: Option<Instant>,
) -> Result<Request, HttpError> {
    let head = read_head(r, limits, deadline)?;
    read_body(r, w, head, deadline)
}

/// Read one request head from `r`, refusing one over a limit, malformed, or declaring a body
/// over [`Limits::max_body_bytes`]. Nothing is written: a server that must refuse the request
/// (no route, no key) answers before the client is told to send its body.
pub fn read_head<R: BufRead>(
    r: &mut R,
    limits: &Limits,
    deadline: Option<Instant>,
) -> Result<Head, HttpError> {
    let mut budget = limits.max_head_bytes;
    let mut line = Vec::new();
    // RFC 9112 §2.2: ignore empty lines before the request line.
    loop {
        if !read_line(r, &mut line, &mut budget, deadline, false)? {
            return Err(HttpError::Closed);
        }
        if !line.is_empty() {
            break;
        }
    }
    let (method, target, http10) = request_line(&line)?;
    let (path, query) = match target.split_once('?') {
        Some((p, q)) => (p.to_string(), Some(q.to_string())),
        None => (target.clone(), None),
    };
    let mut headers = Vec::new();
    loop {
        read_line(r, &mut line, &mut budget, deadline, true)?;
        if line.is_empty() {
            break;
        }
        if headers.len() == limits.max_headers {
            return Err(HttpError::HeadTooLarge(format!(
                "more than {} header lines",
                limits.max_headers
            )));
        }
        headers.push(header_line(&line)?);
    }
    let length = body_length(&headers, limits)?;
    let connection = values(&headers, "connection")
        .flat_map(|v| v.split(','))
        .map(|t| t.trim().to_ascii_lowercase())
        .collect::<Vec<_>>();
    let keep_alive = if http10 {
        connection.iter().any(|t| t == "keep-alive")
    } else {
        !connection.iter().any(|t| t == "close")
    };
    let expect = values(&headers, "expect")
        .next()
        .map(|v| v.to_ascii_lowercase());
    let expect_continue = match expect.as_deref() {
        // RFC 9110 §10.1.1: a 1.0 client cannot read a 1xx; it sends its body anyway.
        Some("100-continue") => !http10 && length > 0,
        None => false,
        Some(other) => {
            return Err(HttpError::BadRequest(format!(
                "unsupported Expect `{other}`"
            )))
        }
    };
    Ok(Head {
        method,
        path,
        query,
        headers,
        keep_alive,
        length,
        expect_continue,
    })
}

/// The request line's method, target and whether it is HTTP/1.0.
fn request_line(line: &[u8]) -> Result<(String, String, bool), HttpError> {
    let request_line = std::str::from_utf8(line)
        .map_err(|_| HttpError::BadRequest("the request line is not UTF-8".into()))?;
    let mut parts = request_line.split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(HttpError::BadRequest(format!(
            "the request line `{}` is not `METHOD TARGET HTTP/1.1`",
            request_line.escape_debug()
        )));
    };
    if !is_token(method) {
        return Err(HttpError::BadRequest(format!(
            "invalid method `{}`",
            method.escape_debug()
        )));
    }
    if !target.starts_with('/') || target.bytes().any(|b| b <= b' ' || b == 0x7f) {
        return Err(HttpError::BadRequest(format!(
            "invalid request target `{}`",
            target.escape_debug()
        )));
    }
    let http10 = match version {
        "HTTP/1.1" => false,
        "HTTP/1.0" => true,
        v => return Err(HttpError::Version(v.escape_debug().to_string())),
    };
    Ok((method.to_string(), target.to_string(), http10))
}

/// One header line as (lowercased name, trimmed value).
fn header_line(line: &[u8]) -> Result<(String, String), HttpError> {
    let text = std::str::from_utf8(line)
        .map_err(|_| HttpError::BadRequest("a header line is not UTF-8".into()))?;
    // A stray CR or NUL is how request smuggling starts (RFC 9110 §5.5): refuse it.
    if text.bytes().any(|b| (b < b' ' && b != b'\t') || b == 0x7f) {
        return Err(HttpError::BadRequest(format!(
            "the header line `{}` holds a control character",
            text.escape_debug()
        )));
    }
    let Some((name, value)) = text.split_once(':') else {
        return Err(HttpError::BadRequest(format!(
            "the header line `{}` has no `:`",
            text.escape_debug()
        )));
    };
    // RFC 9112 §5.1: no whitespace between the name and the colon (nor obsolete folding).
    if !is_token(name) {
        return Err(HttpError::BadRequest(format!(
            "invalid header name `{}`",
            name.escape_debug()
        )));
    }
    Ok((name.to_ascii_lowercase(), value.trim().to_string()))
}

fn values<'h>(headers: &'h [(String, String)], name: &'h str) -> impl Iterator<Item = &'h String> {
    headers
        .iter()
        .filter(move |(k, _)| k == name)
        .map(|(_, v)| v)
}

/// The body length the headers declare, refused when over the limit, conflicting, or in
/// `Transfer-Encoding`.
fn body_length(headers: &[(String, String)], limits: &Limits) -> Result<usize, HttpError> {
    if values(headers, "transfer-encoding").next().is_some() {
        return Err(HttpError::LengthRequired);
    }
    let mut length: Option<u64> = None;
    for v in values(headers, "content-length") {
        let n = (!v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()))
            .then(|| v.parse::<u64>().ok())
            .flatten()
            .ok_or_else(|| {
                HttpError::BadRequest(format!("invalid Content-Length `{}`", v.escape_debug()))
            })?;
        if length.is_some_and(|l| l != n) {
            return Err(HttpError::BadRequest(
                "conflicting Content-Length headers".into(),
            ));
        }
        length = Some(n);
    }
    let length = length.unwrap_or(0);
    match usize::try_from(length) {
        Ok(n) if n <= limits.max_body_bytes => Ok(n),
        _ => Err(HttpError::BodyTooLarge {
            limit: limits.max_body_bytes,
            length,
        }),
    }
}

/// Read the body `head` declares, first sending `100 Continue` on `w` when the client waits
/// for it: call this only once the request may go on (its route exists and it is
/// authorized), so a client that will be refused is refused before it sends its body.
pub fn read_body<R: BufRead, W: Write>(
    r: &mut R,
    w: &mut W,
    head: Head,
    deadline: Option<Instant>,
) -> Result<Request, HttpError> {
    if head.expect_continue {
        w.write_all(b"HTTP/1.1 100 Continue\r\n\r\n")
            .and_then(|()| w.flush())
            .map_err(HttpError::Io)?;
    }
    let mut body = vec![0u8; head.length];
    let mut filled = 0;
    while filled < body.len() {
        if deadline.is_some_and(|d| Instant::now() > d) {
            return Err(HttpError::Timeout);
        }
        match r.read(&mut body[filled..]) {
            Ok(0) => {
                return Err(HttpError::BadRequest(format!(
                    "the connection closed after {filled} of {} body bytes",
                    head.length
                )))
            }
            Ok(n) => filled += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(io_error(e, true)),
        }
    }
    Ok(Request {
        method: head.method,
        path: head.path,
        query: head.query,
        headers: head.headers,
        body,
        keep_alive: head.keep_alive,
    })
}

/// The reason phrase of the statuses the server sends.
pub fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        401 => "Unauthorized",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        411 => "Length Required",
        413 => "Content Too Large",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        501 => "Not Implemented",
        503 => "Service Unavailable",
        505 => "HTTP Version Not Supported",
        _ => "",
    }
}

fn write_head<W: Write>(
    w: &mut W,
    status: u16,
    content_type: &str,
    extra: &[(&str, &str)],
    keep_alive: bool,
    length: Option<usize>,
) -> std::io::Result<()> {
    let mut head = format!(
        "HTTP/1.1 {status} {}\r\nContent-Type: {content_type}\r\n",
        reason(status)
    );
    match length {
        Some(n) => head.push_str(&format!("Content-Length: {n}\r\n")),
        None => head.push_str("Transfer-Encoding: chunked\r\n"),
    }
    for (name, value) in extra {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    if !keep_alive {
        head.push_str("Connection: close\r\n");
    }
    head.push_str("\r\n");
    w.write_all(head.as_bytes())
}

/// A whole response with `Content-Length`.
pub fn write_response<W: Write>(
    w: &mut W,
    status: u16,
    content_type: &str,
    extra: &[(&str, &str)],
    body: &[u8],
    keep_alive: bool,
) -> std::io::Result<()> {
    let mut out = Vec::with_capacity(body.len() + 256);
    write_head(
        &mut out,
        status,
        content_type,
        extra,
        keep_alive,
        Some(body.len()),
    )?;
    out.extend_from_slice(body);
    w.write_all(&out)?;
    w.flush()
}

/// A JSON response.
pub fn write_json<W: Write>(
    w: &mut W,
    status: u16,
    extra: &[(&str, &str)],
    body: &serde_json::Value,
    keep_alive: bool,
) -> std::io::Result<()> {
    let bytes = body.to_string();
    write_response(
        w,
        status,
        "application/json",
        extra,
        bytes.as_bytes(),
        keep_alive,
    )
}

/// A Server-Sent-Events response: one `data: {json}` event per chunk of the chunked body,
/// each flushed as it is written, ending with `data: [DONE]` and the zero-length chunk.
#[derive(Debug)]
pub struct SseWriter<W: Write> {
    w: W,
}

impl<W: Write> SseWriter<W> {
    /// Write the response head (status 200).
    pub fn start(mut w: W, keep_alive: bool) -> std::io::Result<SseWriter<W>> {
        write_head(
            &mut w,
            200,
            "text/event-stream",
            &[("Cache-Control", "no-cache")],
            keep_alive,
            None,
        )?;
        w.flush()?;
        Ok(SseWriter { w })
    }

    fn chunk(&mut self, data: &[u8]) -> std::io::Result<()> {
        let mut out = Vec::with_capacity(data.len() + 16);
        out.extend_from_slice(format!("{:x}\r\n", data.len()).as_bytes());
        out.extend_from_slice(data);
        out.extend_from_slice(b"\r\n");
        self.w.write_all(&out)?;
        self.w.flush()
    }

    /// One event carrying `value`.
    pub fn event(&mut self, value: &serde_json::Value) -> std::io::Result<()> {
        self.chunk(format!("data: {value}\n\n").as_bytes())
    }

    /// `data: [DONE]` and the end of the body.
    pub fn finish(mut self) -> std::io::Result<W> {
        self.chunk(b"data: [DONE]\n\n")?;
        self.w.write_all(b"0\r\n\r\n")?;
        self.w.flush()?;
        Ok(self.w)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{BufReader, Cursor, Read};

    fn limits() -> Limits {
        Limits::with_body(100)
    }

    fn read(bytes: &[u8]) -> (Result<Request, HttpError>, Vec<u8>) {
        let mut r = BufReader::new(Cursor::new(bytes.to_vec()));
        let mut w = Vec::new();
        let res = read_request(&mut r, &mut w, &limits(), None);
        (res, w)
    }

    fn status(bytes: &[u8]) -> Option<u16> {
        match read(bytes).0 {
            Ok(_) => Some(200),
            Err(e) => e.status(),
        }
    }

    #[test]
    fn reads_a_post_with_a_body_and_query() {
        let (req, w) = read(
            b"POST /v1/x?a=1 HTTP/1.1\r\nHost: h\r\nContent-Length: 5\r\nX-A:  b \r\n\r\nhello",
        );
        let req = req.unwrap();
        assert_eq!(req.method, "POST");
        assert_eq!(req.path, "/v1/x");
        assert_eq!(req.query.as_deref(), Some("a=1"));
        assert_eq!(req.header("x-a"), Some("b"));
        assert_eq!(req.body, b"hello");
        assert!(req.keep_alive);
        assert!(w.is_empty());
    }

    #[test]
    fn reads_two_pipelined_requests() {
        let mut r = BufReader::new(Cursor::new(
            b"GET /a HTTP/1.1\r\n\r\nGET /b HTTP/1.1\r\nConnection: close\r\n\r\n".to_vec(),
        ));
        let mut w = Vec::new();
        let a = read_request(&mut r, &mut w, &limits(), None).unwrap();
        let b = read_request(&mut r, &mut w, &limits(), None).unwrap();
        assert_eq!((a.path.as_str(), a.keep_alive), ("/a", true));
        assert_eq!((b.path.as_str(), b.keep_alive), ("/b", false));
        assert!(matches!(
            read_request(&mut r, &mut w, &limits(), None),
            Err(HttpError::Closed)
        ));
    }

    #[test]
    fn http10_closes_unless_asked_to_keep_alive() {
        assert!(!read(b"GET / HTTP/1.0\r\n\r\n").0.unwrap().keep_alive);
        assert!(
            read(b"GET / HTTP/1.0\r\nConnection: Keep-Alive\r\n\r\n")
                .0
                .unwrap()
                .keep_alive
        );
    }

    #[test]
    fn answers_expect_continue_before_the_body() {
        let (req, w) =
            read(b"POST / HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\nhi");
        assert_eq!(req.unwrap().body, b"hi");
        assert_eq!(w, b"HTTP/1.1 100 Continue\r\n\r\n");
        assert_eq!(
            status(b"POST / HTTP/1.1\r\nExpect: magic\r\n\r\n"),
            Some(400)
        );
    }

    /// Issue #65: `100 Continue` went out while the head was read, before the server knew
    /// whether it would refuse the request (a missing API key). Reading the head writes
    /// nothing; only reading the body, once the request may go on, sends it.
    #[test]
    fn reading_the_head_sends_no_continue() {
        let bytes = b"POST / HTTP/1.1\r\nExpect: 100-Continue\r\nContent-Length: 2\r\n\r\nhi";
        let mut r = BufReader::new(Cursor::new(bytes.to_vec()));
        let head = read_head(&mut r, &limits(), None).unwrap();
        assert!(head.expect_continue);
        assert_eq!(head.length, 2);
        let mut w = Vec::new();
        let req = read_body(&mut r, &mut w, head, None).unwrap();
        assert_eq!(
            (req.body.as_slice(), w.as_slice()),
            (&b"hi"[..], &b"HTTP/1.1 100 Continue\r\n\r\n"[..])
        );
        // HTTP/1.0, or no body: nothing to wait for.
        for bytes in [
            &b"POST / HTTP/1.0\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n"[..],
            &b"POST / HTTP/1.1\r\nExpect: 100-continue\r\n\r\n"[..],
        ] {
            let mut r = BufReader::new(Cursor::new(bytes.to_vec()));
            assert!(!read_head(&mut r, &limits(), None).unwrap().expect_continue);
        }
    }

    #[test]
    fn every_limit_and_malformed_case_has_its_status() {
        let long_header = format!(
            "GET / HTTP/1.1\r\nX: {}\r\n\r\n",
            "a".repeat(MAX_HEAD_BYTES)
        );
        let many: String = (0..=MAX_HEADERS).map(|i| format!("H{i}: v\r\n")).collect();
        let many = format!("GET / HTTP/1.1\r\n{many}\r\n");
        let cases: [(&[u8], Option<u16>); 17] = [
            (b"GET / HTTP/1.1\r\nX: a\rb\r\n\r\n", Some(400)),
            (long_header.as_bytes(), Some(431)),
            (many.as_bytes(), Some(431)),
            (b"POST / HTTP/1.1\r\nContent-Length: 101\r\n\r\n", Some(413)),
            (
                b"POST / HTTP/1.1\r\nContent-Length: 99999999999999999999999\r\n\r\n",
                Some(400),
            ),
            (b"POST / HTTP/1.1\r\nContent-Length: -1\r\n\r\n", Some(400)),
            (
                b"POST / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab",
                Some(400),
            ),
            (
                b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
                Some(411),
            ),
            (b"GET / HTTP/2.0\r\n\r\n", Some(505)),
            (b"GET /\r\n\r\n", Some(400)),
            (b"GET  / HTTP/1.1\r\n\r\n", Some(400)),
            (b"GET x HTTP/1.1\r\n\r\n", Some(400)),
            (b"G(T / HTTP/1.1\r\n\r\n", Some(400)),
            (b"GET / HTTP/1.1\r\nNoColon\r\n\r\n", Some(400)),
            (b"GET / HTTP/1.1\r\nBad Name: v\r\n\r\n", Some(400)),
            (b"GET / HTTP/1.1\r\nHost: h\r\n", Some(400)),
            (
                b"POST / HTTP/1.1\r\nContent-Length: 10\r\n\r\nshort",
                Some(400),
            ),
        ];
        for (bytes, want) in cases {
            assert_eq!(
                status(bytes),
                want,
                "{}",
                String::from_utf8_lossy(&bytes[..bytes.len().min(80)])
            );
        }
        assert!(matches!(read(b"").0, Err(HttpError::Closed)));
        assert!(matches!(read(b"\r\n\r\n").0, Err(HttpError::Closed)));
    }

    /// A reader that yields its bytes and then reports a read timeout, as a socket with a
    /// read timeout does when the client goes quiet.
    struct Stalls(Cursor<Vec<u8>>);

    impl Read for Stalls {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            match self.0.read(buf)? {
                0 => Err(std::io::ErrorKind::WouldBlock.into()),
                n => Ok(n),
            }
        }
    }

    #[test]
    fn a_client_that_stalls_mid_request_times_out_and_a_silent_one_is_closed() {
        let stall = |bytes: &[u8]| {
            let mut r = BufReader::new(Stalls(Cursor::new(bytes.to_vec())));
            read_request(&mut r, &mut Vec::new(), &limits(), None)
        };
        assert!(matches!(
            stall(b"GET / HTTP/1.1\r\nHo"),
            Err(HttpError::Timeout)
        ));
        assert!(matches!(
            stall(b"POST / HTTP/1.1\r\nContent-Length: 9\r\n\r\nab"),
            Err(HttpError::Timeout)
        ));
        assert!(matches!(stall(b""), Err(HttpError::Closed)));
        // A deadline already past: the request is refused even though bytes keep coming.
        let mut r = BufReader::new(Cursor::new(b"GET / HTTP/1.1\r\n\r\n".to_vec()));
        let past = Instant::now() - std::time::Duration::from_secs(1);
        assert!(matches!(
            read_request(&mut r, &mut Vec::new(), &limits(), Some(past)),
            Err(HttpError::Closed)
        ));
    }

    #[test]
    fn json_responses_carry_their_length() {
        let mut out = Vec::new();
        write_json(
            &mut out,
            404,
            &[("Allow", "GET")],
            &serde_json::json!({"a": 1}),
            false,
        )
        .unwrap();
        let s = String::from_utf8(out).unwrap();
        assert_eq!(
            s,
            "HTTP/1.1 404 Not Found\r\nContent-Type: application/json\r\nContent-Length: 7\r\n\
             Allow: GET\r\nConnection: close\r\n\r\n{\"a\":1}"
        );
    }

    #[test]
    fn sse_stream_is_chunked_events_ending_in_done() {
        let mut sse = SseWriter::start(Vec::new(), true).unwrap();
        sse.event(&serde_json::json!({"x": "é"})).unwrap();
        let out = String::from_utf8(sse.finish().unwrap()).unwrap();
        let (head, body) = out.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 200 OK\r\n"));
        assert!(head.contains("Content-Type: text/event-stream"));
        assert!(head.contains("Cache-Control: no-cache"));
        assert!(head.contains("Transfer-Encoding: chunked"));
        let event = "data: {\"x\":\"é\"}\n\n";
        assert_eq!(
            body,
            format!(
                "{:x}\r\n{event}\r\ne\r\ndata: [DONE]\n\n\r\n0\r\n\r\n",
                event.len()
            )
        );
    }
}
