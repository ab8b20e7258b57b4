//! One sequence in the engine ([`Slot`]) and the settle step: taking its tokens from the last
//! pass's rows, checking guesses, applying a grammar, holding back what might begin a stop
//! string, and reporting to its job.

use std::time::Instant;

use super::job::{Event, Finish, Job, Timings, TokenInfo, Usage};
use super::summary::{Stats, StopReason};
use crate::model::Sequence;
use crate::sampler::Sampler;
use crate::serve::log;
use crate::tokenizer::{TextStream, Tokenizer};

/// Who a slot's sequence goes back to when it retires.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Origin {
    /// A job from the queue (the server): its sequence goes to the prompt cache, and a stop
    /// of the engine answers it as a failure.
    Queue,
    /// A job of a client driving the engine itself (the command line): its sequence, sampler
    /// and summary go back to it, and an interrupt ends it as [`StopReason::Interrupted`].
    Local,
}

/// A job holding a sequence.
pub(crate) struct Slot<'t> {
    pub job: Job,
    pub origin: Origin,
    pub seq: Sequence,
    /// The draft model's sequence for this job (with a draft): a prefix of `history` and the
    /// guesses it last proposed.
    pub draft_seq: Option<Sequence>,
    /// Tokens to guess this step.
    pub want: usize,
    /// Prompt tokens already in the cache (reused, then read).
    pub read: usize,
    /// Of those, reused (from the prompt cache, or a client's own sequence).
    pub reused: usize,
    /// Leading positions read in whole prefill chunks from position 0 (what
    /// [`super::prompt_cache::Reuse::Exact`] may reuse later).
    pub exact: usize,
    /// The last pass's logits, once the prompt is read: one row, or one per guess in
    /// `guesses` and one after them.
    pub logits: Vec<f32>,
    /// The guesses the last pass checked.
    pub guesses: Vec<u32>,
    /// Guesses made, and of those accepted.
    pub drafted: usize,
    pub accepted: usize,
    /// Guessed tokens the model agreed and disagreed with, recent ones weighing more: how
    /// far ahead guessing pays ([`super::speculate::guess_len`]).
    pub agreed: f64,
    pub disagreed: f64,
    /// Steps since the slot last guessed, and the steps to wait before a probe (one guess
    /// while guessing does not pay).
    pub idle: usize,
    pub probe_every: usize,
    pub sampler: Sampler,
    /// Prompt and generated tokens (the penalties' window).
    pub history: Vec<u32>,
    pub generated: usize,
    /// Decoding passes this sequence was part of.
    pub passes: usize,
    pub stream: TextStream<'t>,
    /// Text not yet sent: it might be the start of a stop string.
    pub held: String,
    pub queued_s: f64,
    pub prompt_s: f64,
    pub decode_start: Option<Instant>,
    /// Why it ended, once it has.
    pub stop: Option<StopReason>,
}

/// How a slot's step ended.
pub(crate) enum Outcome {
    /// Keep decoding with this token.
    Continue(u32),
    /// Finished (the event is sent).
    Finished,
    /// The client has gone or the job failed: drop it.
    Dropped,
}

impl Slot<'_> {
    /// What the command line reports about this slot's run.
    pub fn stats(&self) -> Stats {
        Stats {
            prompt_tokens: self.job.prompt.len(),
            prefill_tokens: self.read - self.reused,
            prefill_s: self.prompt_s,
            generated_tokens: self.generated,
            decode_steps: self.passes,
            decode_s: self.decode_s(),
            // Every generated token but the first, which the prompt's last row gives.
            decoded_tokens: self.generated.saturating_sub(1),
            drafted_tokens: self.drafted,
            accepted_tokens: self.accepted,
        }
    }

    fn decode_s(&self) -> f64 {
        self.decode_start.map_or(0.0, |t| t.elapsed().as_secs_f64())
    }
}

/// Take `s`'s tokens from the last pass's rows: each guess in turn is checked against its
/// row ([`Sampler::sample_draft`]: the token chosen is the guess exactly when the model
/// accepts it), the first one rejected ends the check, and the row after the last accepted
/// guess gives the next token. Without guesses, one token from the one row.
pub(crate) fn settle(s: &mut Slot<'_>, tokenizer: &Tokenizer, vocab: usize) -> Outcome {
    let rows = std::mem::take(&mut s.logits);
    let guesses = std::mem::take(&mut s.guesses);
    let mut outcome = Outcome::Dropped;
    let before = s.accepted;
    for (i, row) in rows.chunks_exact(vocab).enumerate() {
        let guess = guesses.get(i).copied();
        outcome = step(s, tokenizer, row, guess);
        match outcome {
            Outcome::Continue(id) if guess == Some(id) => s.accepted += 1,
            _ => break,
        }
    }
    if !guesses.is_empty() {
        super::speculate::record(s, s.accepted - before, guesses.len());
    }
    // Kept (not empty) until the next pass replaces it: the slot is past its prompt.
    s.logits = rows;
    outcome
}

/// The logits to sample from: `row`, or a copy masked by the job's grammar. `Err` carries
/// the message the job fails with.
fn constrained<'r>(
    s: &mut Slot<'_>,
    row: &'r [f32],
    masked: &'r mut Vec<f32>,
) -> std::result::Result<&'r [f32], String> {
    let Some(c) = s.job.constraint.as_mut() else {
        return Ok(row);
    };
    match c.allowed() {
        Ok(None) => Ok(row),
        Ok(Some(bits)) => {
            *masked = row.to_vec();
            let mut any = false;
            for (id, l) in masked.iter_mut().enumerate() {
                let on = bits.get(id / 32).is_some_and(|w| w >> (id % 32) & 1 == 1);
                if on {
                    any |= l.is_finite();
                } else {
                    *l = f32::NEG_INFINITY;
                }
            }
            if !any {
                return Err("the response format allows no further token".into());
            }
            Ok(masked)
        }
        Err(e) => Err(format!("response format: {e}")),
    }
}

/// Sample `s`'s next token from `row` (checking `guess`, when there is one), report it, and
/// say whether it goes on.
fn step(s: &mut Slot<'_>, tokenizer: &Tokenizer, row: &[f32], guess: Option<u32>) -> Outcome {
    if s.decode_start.is_none() {
        s.decode_start = Some(Instant::now());
    }
    if s.generated >= s.job.max_tokens {
        return finish(s, StopReason::Length);
    }
    // The grammar's mask, over a copy of the logits (the originals give the log-probabilities).
    let mut masked = Vec::new();
    let logits = match constrained(s, row, &mut masked) {
        Ok(l) => l,
        Err(message) => return drop_failed(s, &message),
    };
    let id = match guess {
        Some(g) => s.sampler.sample_draft(logits, &s.history, g),
        None => s.sampler.sample(logits, &s.history),
    };
    s.history.push(id);
    s.generated += 1;
    let info = TokenInfo {
        id,
        logprob: 0.0,
        top: Vec::new(),
    };
    let info = match s.job.logprobs {
        Some(k) => with_logprobs(info, row, k),
        None => info,
    };
    if !s.job.ignore_eos && tokenizer.stop_tokens().contains(&id) {
        if !send(s, String::new(), vec![info]) {
            return Outcome::Dropped;
        }
        return finish(s, StopReason::Eos);
    }
    report(s, id, info)
}

/// After `id` is chosen (not a stop token): advance the grammar, send its text (less what
/// might begin a stop string) and say whether it goes on.
fn report(s: &mut Slot<'_>, id: u32, info: TokenInfo) -> Outcome {
    if let Some(c) = s.job.constraint.as_mut() {
        if let Err(e) = c.commit(id) {
            return drop_failed(s, &format!("response format: {e}"));
        }
    }
    let piece = match s.stream.push(id) {
        Ok(p) => p,
        Err(e) => return drop_failed(s, &e.to_string()),
    };
    s.held.push_str(&piece);
    // A stop string ends the output before it.
    if let Some(at) = first_stop(&s.held, &s.job.stop) {
        let text = s.held[..at].to_string();
        s.held.clear();
        if !send(s, text, vec![info]) {
            return Outcome::Dropped;
        }
        return finish(s, StopReason::Eos);
    }
    let keep = stop_prefix_len(&s.held, &s.job.stop);
    let text = s.held[..s.held.len() - keep].to_string();
    s.held.drain(..s.held.len() - keep);
    if !send(s, text, vec![info]) {
        return Outcome::Dropped;
    }
    if s.job.constraint.as_ref().is_some_and(|c| c.is_finished()) {
        return finish(s, StopReason::Eos);
    }
    // The chosen token runs next, after everything before it (`history` less rejected
    // guesses the cache may still hold).
    if s.generated >= s.job.max_tokens {
        return finish(s, StopReason::Length);
    }
    if s.history.len() > s.seq.ctx() {
        return finish(s, StopReason::Context);
    }
    Outcome::Continue(id)
}

/// Send text and tokens; false when the client has gone.
fn send(s: &Slot<'_>, text: String, tokens: Vec<TokenInfo>) -> bool {
    s.job.events.send(Event::Text { text, tokens }).is_ok()
}

/// The text held back and the stream's tail, less a stop string completed only there.
fn tail(s: &mut Slot<'_>) -> String {
    let mut rest = std::mem::take(&mut s.held);
    if let Ok(tail) = s.stream.finish() {
        rest.push_str(&tail);
    }
    if let Some(at) = first_stop(&rest, &s.job.stop) {
        rest.truncate(at);
    }
    rest
}

/// End `s` early at an interrupt: a local client gets the text held back and its run ends
/// as [`StopReason::Interrupted`]; a queued job is told the engine is stopping.
pub(crate) fn interrupt(s: &mut Slot<'_>) {
    match s.origin {
        Origin::Local => {
            let rest = tail(s);
            if !rest.is_empty() {
                send(s, rest, Vec::new());
            }
            s.stop = Some(StopReason::Interrupted);
        }
        Origin::Queue => {
            let _ = s.job.events.send(Event::Failed {
                message: "the server is shutting down".into(),
            });
        }
    }
}

/// Flush what is held back and send [`Event::Done`].
fn finish(s: &mut Slot<'_>, why: StopReason) -> Outcome {
    s.stop = Some(why);
    let rest = tail(s);
    if !rest.is_empty() && !send(s, rest, Vec::new()) {
        return Outcome::Dropped;
    }
    let decode_s = s.decode_s();
    let usage = Usage {
        prompt_tokens: s.job.prompt.len(),
        cached_tokens: s.reused,
        completion_tokens: s.generated,
    };
    let timings = Timings {
        queued_s: s.queued_s,
        prompt_s: s.prompt_s,
        decode_s,
        guessed: s.drafted,
        accepted: s.accepted,
    };
    let finish = match why {
        StopReason::Eos => Finish::Stop,
        _ => Finish::Length,
    };
    if s.origin == Origin::Queue {
        log_done(s, finish, &usage, &timings);
    }
    let done = Event::Done {
        finish,
        usage,
        timings,
    };
    if s.job.events.send(done).is_err() {
        return Outcome::Dropped;
    }
    Outcome::Finished
}

/// The server's line about a finished job.
fn log_done(s: &Slot<'_>, why: Finish, usage: &Usage, timings: &Timings) {
    let guessed = if s.drafted > 0 {
        format!(", {} of {} guesses accepted", s.accepted, s.drafted)
    } else {
        String::new()
    };
    log_line(
        &s.job,
        &format!(
            "{}: {} prompt tokens ({} cached) in {:.3} s, {} generated in {:.3} s{guessed}",
            why.name(),
            usage.prompt_tokens,
            usage.cached_tokens,
            timings.prompt_s,
            usage.completion_tokens,
            timings.decode_s
        ),
    );
}

/// Report a failure and drop the job.
pub(crate) fn drop_failed(s: &mut Slot<'_>, message: &str) -> Outcome {
    if s.origin == Origin::Queue {
        log_line(&s.job, &format!("failed: {message}"));
    }
    let _ = s.job.events.send(Event::Failed {
        message: message.to_string(),
    });
    Outcome::Dropped
}

/// One line on stderr about a job ([`log::line`] escapes messages that quote the request).
pub(crate) fn log_line(job: &Job, what: &str) {
    log::line(format_args!("request {}: {what}", job.id));
}

/// Where the first of `stops` begins in `text`, if any does.
fn first_stop(text: &str, stops: &[String]) -> Option<usize> {
    stops
        .iter()
        .filter(|s| !s.is_empty())
        .filter_map(|s| text.find(s.as_str()))
        .min()
}

/// The length of the longest suffix of `text` that begins some stop string (held back, since
/// the next token may complete it), on a character boundary.
fn stop_prefix_len(text: &str, stops: &[String]) -> usize {
    let mut best = 0;
    for stop in stops {
        for (i, _) in stop.char_indices().skip(1) {
            let prefix = &stop[..i];
            if i > best && text.ends_with(prefix) {
                best = i;
            }
        }
    }
    best
}

/// `info` with the chosen token's log-probability under `logits` and the `k` most likely.
fn with_logprobs(mut info: TokenInfo, logits: &[f32], k: usize) -> TokenInfo {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| f64::from(l - max).exp()).sum();
    let lse = f64::from(max) + sum.ln();
    let lp = |l: f32| (f64::from(l) - lse) as f32;
    info.logprob = lp(logits[info.id as usize]);
    if k > 0 {
        let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
        let by = |a: &u32, b: &u32| {
            logits[*b as usize]
                .total_cmp(&logits[*a as usize])
                .then(a.cmp(b))
        };
        let k = k.min(idx.len());
        idx.select_nth_unstable_by(k - 1, by);
        idx.truncate(k);
        idx.sort_unstable_by(by);
        info.top = idx
            .into_iter()
            .map(|i| (i, lp(logits[i as usize])))
            .collect();
    }
    info
}
