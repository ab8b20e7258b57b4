//! Waiting for a job's events and turning them into a response: one JSON body, or a stream of
//! Server-Sent Events. [`Events`] carries the engine's events from its blocking channel to the
//! async handler, and cancels the job when the handler (or the stream) is dropped: a client
//! that goes away, or stops taking bytes, cancels its sequence.

use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError};

use axum::response::sse::Event as SseEvent;
use futures_util::stream::{self, Stream, StreamExt};
use kiln_runner::engine::job::{Event, TokenInfo};
use kiln_runner::generate::Interrupt;
use kiln_runner::serve::log;
use kiln_runner::tokenizer::Tokenizer;
use serde_json::Value;

use super::{Cancel, Kind, POLL};
use crate::api::{self, ApiError, Meta, TokenLogprob};

/// Events held between the engine and a client slower than it: beyond them the bridge waits,
/// so a stalled client costs bounded memory until the write timeout drops it.
const EVENT_BUFFER: usize = 64;

/// A job's events on the async side; dropping it cancels the job.
pub(crate) struct Events {
    rx: tokio::sync::mpsc::Receiver<Event>,
    cancel: Cancel,
}

impl Events {
    /// Carry `rx`'s events to the async side on a blocking-pool thread. That thread also
    /// cancels the job (through `cancel`) once the async side has gone or `stop` is raised,
    /// looking every [`POLL`] while no event comes.
    pub(crate) fn bridge(rx: Receiver<Event>, cancel: Cancel, stop: Interrupt) -> Events {
        let (tx, arx) = tokio::sync::mpsc::channel(EVENT_BUFFER);
        let flag = cancel.flag();
        tokio::task::spawn_blocking(move || loop {
            match rx.recv_timeout(POLL) {
                Ok(e) => {
                    let last = matches!(e, Event::Done { .. } | Event::Failed { .. });
                    if tx.blocking_send(e).is_err() {
                        flag.store(true, Ordering::SeqCst);
                        return;
                    }
                    if last {
                        return;
                    }
                }
                Err(RecvTimeoutError::Timeout) => {
                    if tx.is_closed() || stop.is_raised() {
                        flag.store(true, Ordering::SeqCst);
                        return;
                    }
                }
                Err(RecvTimeoutError::Disconnected) => return,
            }
        });
        Events { rx: arx, cancel }
    }

    /// The next event; a failure once the engine has dropped the job without finishing it.
    async fn next(&mut self) -> Event {
        let e = self.rx.recv().await.unwrap_or_else(|| Event::Failed {
            message: "the engine stopped before finishing the request".into(),
        });
        if matches!(e, Event::Done { .. } | Event::Failed { .. }) {
            self.cancel.finished();
        }
        e
    }
}

/// Builds one request's response objects from its events, as one JSON body
/// ([`Output::absorb`]) or chunks ([`Output::step`]); the HTTP side and in-process front ends
/// drive it alike.
#[derive(Debug)]
pub struct Output<'a> {
    pub(crate) meta: Meta,
    pub(crate) kind: Kind,
    pub(crate) logprobs: bool,
    /// The legacy `text_offset` of the next token.
    pub(crate) offset: usize,
    pub(crate) tokenizer: &'a Tokenizer,
    /// The text and tokens so far, for a whole answer.
    pub(crate) text: String,
    pub(crate) tokens: Vec<TokenInfo>,
}

/// What one event adds to a streamed answer.
#[derive(Debug)]
pub struct Step {
    /// Chunks to send, in order.
    pub chunks: Vec<Value>,
    /// `Some` once the answer has ended: normally, or with the engine's failure.
    pub end: Option<Result<(), ApiError>>,
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

    /// Take one event toward the whole answer: the response once the last event has come.
    pub fn absorb(&mut self, event: Event) -> Option<Result<Value, ApiError>> {
        match event {
            Event::Text { text, tokens } => {
                self.text.push_str(&text);
                self.tokens.extend(tokens);
                None
            }
            Event::Failed { message } => Some(Err(ApiError::new(500, "server_error", message))),
            Event::Done { finish, usage, .. } => {
                let tokens = std::mem::take(&mut self.tokens);
                let lp = self.logprobs(&tokens);
                let (meta, text) = (&self.meta, &self.text);
                Some(Ok(match self.kind {
                    Kind::Chat => api::chat_completion(meta, text, finish, &usage, lp),
                    Kind::Completion => {
                        api::text_completion(meta, text, Some(finish), Some(&usage), lp)
                    }
                }))
            }
        }
    }

    /// The chunk a streamed answer opens with (a chat's role), before any event.
    pub fn opening(&self) -> Option<Value> {
        (self.kind == Kind::Chat).then(|| api::chat_chunk_role(&self.meta))
    }

    /// The chunks `event` adds to a streamed answer, and whether (and how) it ends there.
    pub fn step(&mut self, event: Event, include_usage: bool) -> Step {
        let meta = &self.meta;
        match event {
            Event::Text { text, tokens } => {
                if text.is_empty() && (tokens.is_empty() || !self.logprobs) {
                    return Step {
                        chunks: Vec::new(),
                        end: None,
                    };
                }
                let lp = self.logprobs(&tokens);
                let meta = &self.meta;
                let chunk = match self.kind {
                    Kind::Chat => api::chat_chunk_text(meta, &text, lp),
                    Kind::Completion => api::text_completion(meta, &text, None, None, lp),
                };
                Step {
                    chunks: vec![chunk],
                    end: None,
                }
            }
            Event::Failed { message } => Step {
                chunks: Vec::new(),
                end: Some(Err(ApiError::new(500, "server_error", message))),
            },
            Event::Done { finish, usage, .. } => {
                let (last, usage) = match self.kind {
                    Kind::Chat => (
                        api::chat_chunk_finish(meta, finish),
                        api::chat_chunk_usage(meta, &usage),
                    ),
                    Kind::Completion => (
                        api::text_completion(meta, "", Some(finish), None, None),
                        api::text_completion_usage(meta, &usage),
                    ),
                };
                let mut chunks = vec![last];
                if include_usage {
                    chunks.push(usage);
                }
                Step {
                    chunks,
                    end: Some(Ok(())),
                }
            }
        }
    }
}

impl Output<'static> {
    /// Wait for the whole answer: one JSON body.
    pub(crate) async fn collect(mut self, mut events: Events) -> Result<Value, ApiError> {
        loop {
            if let Some(answer) = self.absorb(events.next().await) {
                return answer;
            }
        }
    }

    /// The answer as Server-Sent Events: each chunk's JSON, then `[DONE]`. `what` names the
    /// request in the log line of an engine failure.
    pub(crate) fn stream(
        self,
        events: Events,
        include_usage: bool,
        what: String,
    ) -> impl Stream<Item = Result<SseEvent, Infallible>> + Send {
        let first = self.opening();
        let state = Some((self, events));
        let chunks = stream::unfold(state, move |state| {
            let what = what.clone();
            async move {
                let (mut out, mut events) = state?;
                loop {
                    let (values, done) = out.chunks(events.next().await, include_usage, &what);
                    if done {
                        return Some((values, None));
                    }
                    if !values.is_empty() {
                        return Some((values, Some((out, events))));
                    }
                }
            }
        });
        stream::iter(first.map(|v| vec![v.to_string()]))
            .chain(chunks)
            .flat_map(|datas| {
                stream::iter(datas.into_iter().map(|d| Ok(SseEvent::default().data(d))))
            })
    }

    /// The SSE data `event` adds, and whether the stream ends with them.
    fn chunks(&mut self, event: Event, include_usage: bool, what: &str) -> (Vec<String>, bool) {
        let step = self.step(event, include_usage);
        let mut out: Vec<String> = step.chunks.iter().map(Value::to_string).collect();
        match step.end {
            None => return (out, false),
            Some(Ok(())) => {}
            Some(Err(e)) => {
                log::line(format_args!("{what} 500: {}", e.message));
                out.push(e.to_json().to_string());
            }
        }
        out.push("[DONE]".into());
        (out, true)
    }
}
