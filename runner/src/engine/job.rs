//! What the HTTP side hands the engine ([`Job`]) and what it gets back ([`Event`]).
//!
//! The engine owns the model and every sequence; connection threads own sockets. They meet
//! only here: a job goes in through [`super::EngineHandle::submit`] (a bounded queue, so a
//! full server answers 503 instead of growing), and its events come back through the job's
//! own channel. The command line hands its one job to an engine it runs itself. A connection that stops reading (the client went away, or a write
//! timed out) raises [`Job::cancel`] or drops its receiver, and the engine frees the sequence
//! at its next step.

use std::sync::atomic::AtomicBool;
use std::sync::mpsc::Sender;
use std::sync::Arc;

use crate::sampler::SamplerConfig;

/// A constraint on which tokens may come next (a JSON schema's grammar): the engine masks the
/// logits with [`TokenConstraint::allowed`] before sampling and reports each sampled token
/// through [`TokenConstraint::commit`].
pub trait TokenConstraint: Send {
    /// The tokens allowed next, as a bitset over the vocabulary (bit `id % 32` of word
    /// `id / 32`), or `None` when any token is. Called once before each sampled token.
    fn allowed(&mut self) -> std::result::Result<Option<&[u32]>, String>;
    /// Advance past `token`, which [`TokenConstraint::allowed`] allowed.
    fn commit(&mut self, token: u32) -> std::result::Result<(), String>;
    /// Whether the output is complete: nothing more may follow (the engine stops with
    /// [`Finish::Stop`]).
    fn is_finished(&self) -> bool;
}

/// One request for tokens.
pub struct Job {
    /// A number for log lines.
    pub id: u64,
    /// The whole prompt, tokenized (chat template already applied).
    pub prompt: Vec<u32>,
    /// Sampling settings (temperature 0: greedy).
    pub sampler: SamplerConfig,
    /// Most tokens to generate; the engine also stops at the end of the context.
    pub max_tokens: usize,
    /// Strings that end the output when generated (the string itself is not returned).
    pub stop: Vec<String>,
    /// Keep going past the model's stop tokens.
    pub ignore_eos: bool,
    /// `Some(k)`: report each generated token's log-probability and the `k` most likely
    /// alternatives (k ≤ 20).
    pub logprobs: Option<usize>,
    /// A grammar the output must follow.
    pub constraint: Option<Box<dyn TokenConstraint>>,
    /// Where the engine sends this job's [`Event`]s, in order; the last is [`Event::Done`] or
    /// [`Event::Failed`].
    pub events: Sender<Event>,
    /// Raised by the connection when the client has gone: the engine drops the job.
    pub cancel: Arc<AtomicBool>,
    /// When the request was submitted (for the time it waited in the queue).
    pub submitted: std::time::Instant,
}

impl std::fmt::Debug for Job {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Job")
            .field("id", &self.id)
            .field("prompt_tokens", &self.prompt.len())
            .field("max_tokens", &self.max_tokens)
            .finish_non_exhaustive()
    }
}

/// A generated token, as reported with log-probabilities.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenInfo {
    /// The token id.
    pub id: u32,
    /// Its natural-log probability under the model (before temperature and filtering).
    pub logprob: f32,
    /// The most likely tokens at that position and their log-probabilities, most likely first
    /// (empty unless asked for).
    pub top: Vec<(u32, f32)>,
}

/// Why a generation ended, as OpenAI names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// A stop token, a stop string, or a finished grammar.
    Stop,
    /// `max_tokens` or the end of the context.
    Length,
}

impl Finish {
    /// OpenAI's `finish_reason`.
    pub fn name(self) -> &'static str {
        match self {
            Finish::Stop => "stop",
            Finish::Length => "length",
        }
    }
}

/// Token counts for `usage`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    /// Tokens in the prompt.
    pub prompt_tokens: usize,
    /// Of those, how many came from the prompt cache instead of being computed.
    pub cached_tokens: usize,
    /// Tokens generated (a final stop token included, as it was sampled).
    pub completion_tokens: usize,
}

/// Where the time went.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Timings {
    /// Seconds from submission until the job had a sequence.
    pub queued_s: f64,
    /// Seconds spent reading the prompt.
    pub prompt_s: f64,
    /// Seconds from the first generated token to the last.
    pub decode_s: f64,
    /// Tokens guessed by prompt lookup (`--lookup`).
    pub guessed: usize,
    /// Of [`Timings::guessed`], how many the model agreed with.
    pub accepted: usize,
}

/// What the engine reports about a job.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// New output: `text` (possibly empty, while a token's bytes are not yet whole UTF-8 or
    /// might begin a stop string) and the tokens that produced it (with log-probabilities when
    /// asked for; `logprob` is 0 and `top` empty otherwise).
    Text {
        /// Text that is final.
        text: String,
        /// The tokens since the previous event.
        tokens: Vec<TokenInfo>,
    },
    /// The job ended normally.
    Done {
        /// Why.
        finish: Finish,
        /// Token counts.
        usage: Usage,
        /// Time spent.
        timings: Timings,
    },
    /// The job failed; the message is for the client (no paths, no internals).
    Failed {
        /// What went wrong.
        message: String,
    },
}
