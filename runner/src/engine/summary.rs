//! What the engine reports to a front end that drives it itself: why a run ended
//! ([`StopReason`]) and its timings and speculation counts ([`Stats`], the summary
//! `kiln-run generate` prints), and the flag that stops it ([`Interrupt`]).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use serde::Serialize;

/// A flag that another thread (`kiln-run`'s signal watcher, a UI) raises to stop a generation
/// or a benchmark at its next token or forward pass. Clones share the flag; checking it is one
/// atomic load. The library installs no signal handlers: a program raises it.
#[derive(Debug, Clone, Default)]
pub struct Interrupt(Arc<AtomicUsize>);

impl Interrupt {
    /// A flag not yet raised.
    pub fn new() -> Interrupt {
        Interrupt::default()
    }

    /// Raise the flag with a nonzero `cause` (`kiln-run` gives the signal number; 0 is taken
    /// as 1). The first cause is kept.
    pub fn raise(&self, cause: usize) {
        let _ = self
            .0
            .compare_exchange(0, cause.max(1), Ordering::SeqCst, Ordering::SeqCst);
    }

    /// The cause the flag was raised with, if it was.
    pub fn cause(&self) -> Option<usize> {
        match self.0.load(Ordering::SeqCst) {
            0 => None,
            c => Some(c),
        }
    }

    /// Whether the flag was raised.
    pub fn is_raised(&self) -> bool {
        self.cause().is_some()
    }
}

/// Two handles are equal when they share one flag.
impl PartialEq for Interrupt {
    fn eq(&self, other: &Interrupt) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Eq for Interrupt {}

/// Whether `interrupt` is given and raised.
pub(crate) fn raised(interrupt: Option<&Interrupt>) -> bool {
    interrupt.is_some_and(Interrupt::is_raised)
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum StopReason {
    /// A stop token was sampled.
    Eos,
    /// `max_tokens` were generated.
    Length,
    /// The context window is full.
    Context,
    /// The [`crate::GenerateOptions::interrupt`] flag was raised (`kiln-run`: SIGINT, SIGTERM or
    /// SIGHUP); the tokens generated so far are kept.
    Interrupted,
}

impl StopReason {
    /// The lower-case name reports print (`eos`, `length`, `context`, `interrupted`), as
    /// serialized.
    pub fn name(self) -> &'static str {
        match self {
            StopReason::Eos => "eos",
            StopReason::Length => "length",
            StopReason::Context => "context",
            StopReason::Interrupted => "interrupted",
        }
    }
}

/// Timings of one generation.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Stats {
    /// Tokens in the prompt.
    pub prompt_tokens: usize,
    /// Prompt tokens actually run (the rest were already in the cache).
    pub prefill_tokens: usize,
    /// Seconds spent in prefill.
    pub prefill_s: f64,
    /// Tokens generated (including a final stop token).
    pub generated_tokens: usize,
    /// Forward passes run while decoding (one token each, or a token and its guesses).
    pub decode_steps: usize,
    /// Seconds spent decoding: those passes, and finding guesses.
    pub decode_s: f64,
    /// Tokens chosen from the decoding passes' logits (every generated token but the
    /// first, which comes from prefill).
    pub decoded_tokens: usize,
    /// Guessed tokens checked by those passes.
    pub drafted_tokens: usize,
    /// Guessed tokens the model agreed with (each one a token that needed no pass of its
    /// own).
    pub accepted_tokens: usize,
}

impl Stats {
    /// Prefill throughput.
    pub fn prefill_tok_s(&self) -> f64 {
        rate(self.prefill_tokens, self.prefill_s)
    }

    /// Decode throughput: tokens decoded per second of decoding, guessing and checking
    /// included (the first token comes from prefill).
    pub fn decode_tok_s(&self) -> f64 {
        rate(self.decoded_tokens, self.decode_s)
    }

    /// The share of checked guesses that were accepted (0 when none were checked).
    pub fn acceptance(&self) -> f64 {
        if self.drafted_tokens == 0 {
            0.0
        } else {
            self.accepted_tokens as f64 / self.drafted_tokens as f64
        }
    }

    /// Tokens decoded per decoding pass: 1 without guesses.
    pub fn tokens_per_pass(&self) -> f64 {
        if self.decode_steps == 0 {
            0.0
        } else {
            self.decoded_tokens as f64 / self.decode_steps as f64
        }
    }
}

fn rate(n: usize, s: f64) -> f64 {
    if n == 0 || s <= 0.0 {
        0.0
    } else {
        n as f64 / s
    }
}
