//! The generation loop: batched prefill, then one token at a time until a stop token, the
//! token budget, the end of the context or an [`Interrupt`], streaming text as it becomes valid
//! UTF-8. With [`GenerateOptions::lookup`], each step may also check guesses from the text
//! itself ([`crate::lookup`]) in the same pass, keeping the ones the model agrees with; with
//! [`generate_with_draft`], guesses from a draft model ([`crate::draft`]).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use serde::Serialize;

use crate::chat::{ChatTemplate, Message};
use crate::draft::Draft;
use crate::error::{Result, RunnerError};
use crate::model::{Logits, Session};
use crate::sampler::Sampler;
use crate::tokenizer::Tokenizer;

/// Tokens per prefill batch: bounds the scratch buffers (`batch × intermediate` floats) while
/// keeping matrix–matrix products large enough to be efficient.
pub const DEFAULT_PREFILL_BATCH: usize = 512;

/// What to generate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GenerateOptions {
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Keep going past stop tokens (for comparisons with reference continuations).
    pub ignore_eos: bool,
    /// Tokens per prefill batch.
    pub prefill_batch: usize,
    /// Checked before each prefill batch and each token: once raised, generation stops with
    /// [`StopReason::Interrupted`].
    pub interrupt: Option<Interrupt>,
    /// Most tokens guessed by prompt lookup ([`crate::lookup`]) and checked per decoding
    /// pass (0: off). Lossless: greedy output is token for token what plain decoding gives,
    /// and sampled output has the same distribution (see [`Sampler::sample_draft`]).
    pub lookup: usize,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        GenerateOptions {
            max_tokens: 128,
            ignore_eos: false,
            prefill_batch: DEFAULT_PREFILL_BATCH,
            interrupt: None,
            lookup: 0,
        }
    }
}

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
    /// The [`GenerateOptions::interrupt`] flag was raised (`kiln-run`: SIGINT, SIGTERM or
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

/// The result of one generation.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Generation {
    /// Generated ids (a final stop token included).
    pub tokens: Vec<u32>,
    /// Their text (stop tokens and other special tokens left out).
    pub text: String,
    /// Why it ended.
    pub stop: StopReason,
    /// Timings.
    pub stats: Stats,
}

/// Generate a continuation of `prompt` (the whole sequence: tokens already in the session's
/// cache are reused). `on_text` receives text as it becomes complete.
pub fn generate(
    session: &mut Session<'_>,
    tokenizer: &Tokenizer,
    prompt: &[u32],
    opts: &GenerateOptions,
    sampler: &mut Sampler,
    on_text: &mut dyn FnMut(&str) -> Result<()>,
) -> Result<Generation> {
    generate_with_draft(session, None, tokenizer, prompt, opts, sampler, on_text)
}

/// [`generate`], with `draft` (when given) proposing the guesses each decoding pass checks
/// instead of prompt lookup. The output is what [`generate`] gives: the draft changes only
/// how many tokens a pass yields.
pub fn generate_with_draft(
    session: &mut Session<'_>,
    mut draft: Option<&mut Draft<'_>>,
    tokenizer: &Tokenizer,
    prompt: &[u32],
    opts: &GenerateOptions,
    sampler: &mut Sampler,
    on_text: &mut dyn FnMut(&str) -> Result<()>,
) -> Result<Generation> {
    if prompt.is_empty() {
        return Err(RunnerError::EmptyPrompt);
    }
    let ctx = session.ctx();
    if prompt.len() > ctx {
        return Err(RunnerError::ContextOverflow {
            tokens: prompt.len(),
            ctx,
            max_ctx: session.model().config.max_position_embeddings,
        });
    }
    let mut stats = Stats {
        prompt_tokens: prompt.len(),
        ..Default::default()
    };
    let interrupted = || raised(opts.interrupt.as_ref());
    let reused = session.reuse_prefix(prompt);
    let t0 = Instant::now();
    let mut logits = Vec::new();
    for chunk in prompt[reused..].chunks(opts.prefill_batch.max(1)) {
        if interrupted() {
            // Stopped inside the prompt: nothing to sample from yet.
            stats.prefill_tokens = session.tokens().len().saturating_sub(reused);
            stats.prefill_s = t0.elapsed().as_secs_f64();
            return Ok(Generation {
                tokens: Vec::new(),
                text: String::new(),
                stop: StopReason::Interrupted,
                stats,
            });
        }
        let l = session.forward(chunk, Logits::Last, None)?;
        logits.clear();
        logits.extend_from_slice(l);
    }
    if let Some(d) = draft.as_deref_mut() {
        d.prefill(prompt)?;
    }
    stats.prefill_tokens = prompt.len() - reused;
    stats.prefill_s = t0.elapsed().as_secs_f64();

    let mut history = prompt.to_vec();
    let mut tokens = Vec::new();
    let mut stream = tokenizer.stream();
    let mut text = String::new();
    // Record a chosen token: `Some(reason)` when generation ends with it.
    let mut take = |id: u32,
                    tokens: &mut Vec<u32>,
                    history: &mut Vec<u32>,
                    text: &mut String|
     -> Result<Option<StopReason>> {
        tokens.push(id);
        history.push(id);
        if !opts.ignore_eos && tokenizer.stop_tokens().contains(&id) {
            return Ok(Some(StopReason::Eos));
        }
        let piece = stream.push(id)?;
        if !piece.is_empty() {
            text.push_str(&piece);
            on_text(&piece)?;
        }
        Ok((tokens.len() >= opts.max_tokens).then_some(StopReason::Length))
    };
    if opts.max_tokens == 0 {
        stats.generated_tokens = 0;
        return Ok(Generation {
            tokens,
            text,
            stop: StopReason::Length,
            stats,
        });
    }
    if interrupted() {
        return Ok(Generation {
            tokens,
            text,
            stop: StopReason::Interrupted,
            stats,
        });
    }
    // `id` is chosen and recorded; its forward pass has not run.
    let mut id = sampler.sample(&logits, &history);
    let stop_reason = 'gen: loop {
        if let Some(stop) = take(id, &mut tokens, &mut history, &mut text)? {
            break stop;
        }
        if session.tokens().len() >= ctx {
            break StopReason::Context;
        }
        if interrupted() {
            break StopReason::Interrupted;
        }
        let t = Instant::now();
        // Guesses for what follows `id`, as many as fit the context and the token budget
        // (the pass runs `id` and every guess; the last guess's own row picks one more).
        let room = (ctx - session.tokens().len() - 1).min(opts.max_tokens - tokens.len() - 1);
        let guesses = match draft.as_deref_mut() {
            Some(d) => d.propose(&history, room)?,
            None => crate::lookup::guess(&history, opts.lookup.min(room)),
        };
        if guesses.is_empty() {
            let l = session.forward(&[id], Logits::Last, None)?;
            logits.clear();
            logits.extend_from_slice(l);
            stats.decode_steps += 1;
            id = sampler.sample(&logits, &history);
            stats.decoded_tokens += 1;
            stats.decode_s += t.elapsed().as_secs_f64();
            continue;
        }
        // One pass over `id` and the guesses; row i gives the token after input i.
        let base = session.tokens().len();
        let mut input = Vec::with_capacity(guesses.len() + 1);
        input.push(id);
        input.extend_from_slice(&guesses);
        let vocab = session.model().config.vocab;
        let pass = Instant::now();
        let rows = session.verify(&input)?.to_vec();
        let pass_s = pass.elapsed().as_secs_f64();
        stats.decode_steps += 1;
        stats.drafted_tokens += guesses.len();
        let mut accepted = 0;
        let mut stop = None;
        let mut rejected = None;
        let row = |i: usize| &rows[i * vocab..(i + 1) * vocab];
        for (i, &guess) in guesses.iter().enumerate() {
            let chosen = sampler.sample_draft(row(i), &history, guess);
            stats.decoded_tokens += 1;
            if chosen != guess {
                rejected = Some(chosen);
                break;
            }
            accepted += 1;
            stats.accepted_tokens += 1;
            if let Some(s) = take(chosen, &mut tokens, &mut history, &mut text)? {
                stop = Some(s);
                break;
            }
        }
        if let Some(d) = draft.as_deref_mut() {
            d.record(guesses.len(), accepted, pass_s);
        }
        // Keep `id` and the accepted guesses in the cache, as decoding them one at a time
        // would have left it (a token that ended generation is never run).
        let keep = match stop {
            Some(_) => base + accepted,
            None => base + 1 + accepted,
        };
        rewind_to(session, &history, keep)?;
        if let Some(s) = stop {
            stats.decode_s += t.elapsed().as_secs_f64();
            break 'gen s;
        }
        id = match rejected {
            Some(chosen) => chosen,
            // Every guess accepted: the last row gives the token after them.
            None => {
                stats.decoded_tokens += 1;
                sampler.sample(row(guesses.len()), &history)
            }
        };
        stats.decode_s += t.elapsed().as_secs_f64();
    };
    let rest = stream.finish()?;
    if !rest.is_empty() {
        text.push_str(&rest);
        on_text(&rest)?;
    }
    stats.generated_tokens = tokens.len();
    Ok(Generation {
        tokens,
        text,
        stop: stop_reason,
        stats,
    })
}

/// Cut the session's cache back to the first `keep` tokens of `history`. A sliding layer's
/// ring may already have dropped keys that position needs (only with a window shorter than
/// the guesses); then the missing tokens run again one at a time, as decoding ran them.
fn rewind_to(session: &mut Session<'_>, history: &[u32], keep: usize) -> Result<()> {
    let kept = session.rewind(keep);
    for &t in &history[kept..keep] {
        session.forward(&[t], Logits::None, None)?;
    }
    Ok(())
}

/// A multi-turn conversation over one session, reusing the KV cache between turns.
#[derive(Debug)]
pub struct Conversation<'t> {
    template: &'t ChatTemplate<'t>,
    messages: Vec<Message>,
}

impl<'t> Conversation<'t> {
    /// A conversation, starting with `system` if given (else the template's default applies).
    pub fn new(template: &'t ChatTemplate<'t>, system: Option<&str>) -> Conversation<'t> {
        Conversation {
            template,
            messages: system
                .map(|s| vec![Message::new("system", s)])
                .unwrap_or_default(),
        }
    }

    /// The messages so far.
    pub fn messages(&self) -> &[Message] {
        &self.messages
    }

    /// The rendered prompt for a user turn `user` (not yet added).
    pub fn prompt_for(&self, user: &str) -> Result<String> {
        let mut msgs = self.messages.clone();
        msgs.push(Message::new("user", user));
        self.template.render(&msgs, true)
    }

    /// Run one user turn: render, tokenize, reuse the cached prefix, generate (with `draft`
    /// proposing guesses when given: [`generate_with_draft`]), record.
    #[allow(clippy::too_many_arguments)]
    pub fn turn(
        &mut self,
        session: &mut Session<'_>,
        draft: Option<&mut Draft<'_>>,
        tokenizer: &Tokenizer,
        user: &str,
        opts: &GenerateOptions,
        sampler: &mut Sampler,
        on_text: &mut dyn FnMut(&str) -> Result<()>,
    ) -> Result<Generation> {
        let rendered = self.prompt_for(user)?;
        tokenizer.check_fits(&rendered, session.ctx())?;
        let ids = tokenizer.encode_rendered(&rendered)?;
        let g = generate_with_draft(session, draft, tokenizer, &ids, opts, sampler, on_text)?;
        self.messages.push(Message::new("user", user));
        self.messages
            .push(Message::new("assistant", g.text.clone()));
        Ok(g)
    }
}
