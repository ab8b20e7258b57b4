//! Waiting for a job's events and turning them into a response: one JSON body, or a stream of
//! Server-Sent Events. While it waits, [`Waiter`] watches the client, so a job whose client
//! has gone is cancelled.

use std::cell::Cell;
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::Instant;

use serde_json::Value;

use super::{log, Kind, Reply, POLL};
use crate::generate::Interrupt;
use crate::serve::api::{self, ApiError, Meta, TokenLogprob};
use crate::serve::http::{Request, SseWriter};
use crate::serve::job::{Event, TokenInfo};
use crate::tokenizer::Tokenizer;

/// Waits for a job's events while watching its client.
pub(super) struct Waiter<'a> {
    rx: Receiver<Event>,
    stream: &'a TcpStream,
    cancel: Arc<AtomicBool>,
    stop: &'a Interrupt,
    /// When the client was last looked at.
    checked: Cell<Instant>,
}

impl<'a> Waiter<'a> {
    pub(super) fn new(
        rx: Receiver<Event>,
        stream: &'a TcpStream,
        cancel: Arc<AtomicBool>,
        stop: &'a Interrupt,
    ) -> Waiter<'a> {
        Waiter {
            rx,
            stream,
            cancel,
            stop,
            checked: Cell::new(Instant::now()),
        }
    }

    /// The next event, or `None` once the client has gone or the server stops (the job is
    /// cancelled). The client is looked at every [`POLL`] whether events flow or not: a
    /// steady stream of tokens must not hide a client that left.
    fn next(&self) -> Option<Event> {
        loop {
            let due = self.checked.get() + POLL;
            match self
                .rx
                .recv_timeout(due.saturating_duration_since(Instant::now()))
            {
                Ok(e) => {
                    if Instant::now() >= due && self.abandoned() {
                        return None;
                    }
                    return Some(e);
                }
                Err(RecvTimeoutError::Disconnected) => {
                    return Some(Event::Failed {
                        message: "the engine stopped before finishing the request".into(),
                    })
                }
                Err(RecvTimeoutError::Timeout) => {
                    if self.abandoned() {
                        return None;
                    }
                }
            }
        }
    }

    /// Whether the server stops or the client has gone; cancels the job if so.
    fn abandoned(&self) -> bool {
        self.checked.set(Instant::now());
        if self.stop.is_raised() || client_gone(self.stream) {
            self.cancel();
            return true;
        }
        false
    }

    fn cancel(&self) {
        self.cancel.store(true, Ordering::SeqCst);
    }
}

/// Whether the client has closed its side or the connection broke. Bytes waiting (a pipelined
/// request) do not count: only end of input or an error does.
pub(super) fn client_gone(stream: &TcpStream) -> bool {
    if stream.set_nonblocking(true).is_err() {
        return true;
    }
    let gone = match stream.peek(&mut [0u8; 1]) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => !matches!(
            e.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted
        ),
    };
    stream.set_nonblocking(false).is_err() || gone
}

/// Builds one request's response objects.
pub(super) struct Output<'t> {
    pub(super) meta: Meta,
    pub(super) kind: Kind,
    pub(super) logprobs: bool,
    /// The legacy `text_offset` of the next token.
    pub(super) offset: usize,
    pub(super) tokenizer: &'t Tokenizer,
}

impl Output<'_> {
    fn token_text(&self, id: u32) -> String {
        self.tokenizer.decode(&[id]).unwrap_or_default()
    }

    fn token_logprobs(&self, tokens: &[TokenInfo]) -> Vec<TokenLogprob> {
        tokens
            .iter()
            .map(|t| TokenLogprob {
                text: self.token_text(t.id),
                logprob: t.logprob,
                top: t
                    .top
                    .iter()
                    .map(|&(id, lp)| (self.token_text(id), lp))
                    .collect(),
            })
            .collect()
    }

    /// The `logprobs` value for `tokens`, advancing the legacy offset.
    fn logprobs(&mut self, tokens: &[TokenInfo]) -> Option<Value> {
        if !self.logprobs {
            return None;
        }
        let list = self.token_logprobs(tokens);
        Some(match self.kind {
            Kind::Chat => api::chat_logprobs(&list),
            Kind::Completion => {
                let v = api::legacy_logprobs(&list, self.offset);
                self.offset += list.iter().map(|t| t.text.chars().count()).sum::<usize>();
                v
            }
        })
    }

    pub(super) fn collect(mut self, wait: Waiter<'_>) -> std::result::Result<Reply, ApiError> {
        let mut text = String::new();
        let mut tokens = Vec::new();
        loop {
            match wait.next() {
                None => return Ok(Reply::Written(false)),
                Some(Event::Text {
                    text: t,
                    tokens: ts,
                }) => {
                    text.push_str(&t);
                    tokens.extend(ts);
                }
                Some(Event::Failed { message }) => {
                    return Err(ApiError::new(500, "server_error", message))
                }
                Some(Event::Done { finish, usage, .. }) => {
                    let lp = self.logprobs(&tokens);
                    return Ok(Reply::Json(match self.kind {
                        Kind::Chat => api::chat_completion(&self.meta, &text, finish, &usage, lp),
                        Kind::Completion => {
                            api::text_completion(&self.meta, &text, Some(finish), Some(&usage), lp)
                        }
                    }));
                }
            }
        }
    }

    /// Stream the events as Server-Sent Events; whether the connection may go on.
    pub(super) fn stream(mut self, wait: Waiter<'_>, req: &Request, include_usage: bool) -> bool {
        let mut out = wait.stream;
        let written = (|| -> std::io::Result<bool> {
            let mut sse = SseWriter::start(&mut out, req.keep_alive)?;
            if self.kind == Kind::Chat {
                sse.event(&api::chat_chunk_role(&self.meta))?;
            }
            loop {
                match wait.next() {
                    None => return Ok(false),
                    Some(Event::Text { text, tokens }) => {
                        if text.is_empty() && (tokens.is_empty() || !self.logprobs) {
                            continue;
                        }
                        let lp = self.logprobs(&tokens);
                        sse.event(&match self.kind {
                            Kind::Chat => api::chat_chunk_text(&self.meta, &text, lp),
                            Kind::Completion => {
                                api::text_completion(&self.meta, &text, None, None, lp)
                            }
                        })?;
                    }
                    Some(Event::Failed { message }) => {
                        log(&req.method, &req.path, 500, &message);
                        sse.event(&ApiError::new(500, "server_error", message).to_json())?;
                        sse.finish()?;
                        return Ok(true);
                    }
                    Some(Event::Done { finish, usage, .. }) => {
                        match self.kind {
                            Kind::Chat => {
                                sse.event(&api::chat_chunk_finish(&self.meta, finish))?;
                                if include_usage {
                                    sse.event(&api::chat_chunk_usage(&self.meta, &usage))?;
                                }
                            }
                            Kind::Completion => {
                                sse.event(&api::text_completion(
                                    &self.meta,
                                    "",
                                    Some(finish),
                                    None,
                                    None,
                                ))?;
                                if include_usage {
                                    sse.event(&api::text_completion_usage(&self.meta, &usage))?;
                                }
                            }
                        }
                        sse.finish()?;
                        return Ok(true);
                    }
                }
            }
        })();
        match written {
            Ok(keep) => keep,
            Err(e) => {
                wait.cancel();
                log(
                    &req.method,
                    &req.path,
                    200,
                    &format!("stream write failed: {e}"),
                );
                false
            }
        }
    }
}
