//! The command line as a one-slot client of the engine: [`generate`] runs one generation
//! over a [`Session`]'s own sequence on the caller's thread, streaming its text to a callback,
//! and gives the sequence (and the sampler's state) back for the next turn.

use std::sync::atomic::AtomicBool;
use std::sync::mpsc::{self, Receiver};
use std::sync::Arc;
use std::time::Instant;

use super::job::{Event, Job};
use super::prompt_cache::Reuse;
use super::{Engine, EngineOptions, Retired, StopReason};
use crate::draft::Draft;
use crate::error::{Result, RunnerError};
use crate::generate::{GenerateOptions, Generation};
use crate::model::Session;
use crate::sampler::Sampler;
use crate::tokenizer::Tokenizer;

/// What the client has read of its job's events.
#[derive(Default)]
struct Output {
    tokens: Vec<u32>,
    text: String,
}

/// Generate a continuation of `prompt` with a one-slot engine over `session` (the tokens its
/// cache shares with `prompt` are reused) and `draft`'s guesses when given. `on_text` gets
/// the text as it becomes final; its error stops the run and is returned.
pub(crate) fn generate(
    session: &mut Session<'_>,
    draft: Option<&mut Draft<'_>>,
    tokenizer: &Tokenizer,
    prompt: &[u32],
    opts: &GenerateOptions,
    sampler: &mut Sampler,
    on_text: &mut dyn FnMut(&str) -> Result<()>,
) -> Result<Generation> {
    check_prompt(session, prompt)?;
    let (compute, own) = session.parts_mut();
    let seq = std::mem::replace(own, compute.sequence_of(1)?);
    let (job, events) = job(prompt, opts, sampler);
    let settings = EngineOptions {
        parallel: 1,
        prefill_batch: opts.prefill_batch,
        cache_bytes: 0,
        reuse: Reuse::Exact,
        lookup: opts.lookup,
    };
    let mut engine = Engine::new(compute, draft, tokenizer, settings);
    if let Some(i) = &opts.interrupt {
        engine = engine.with_interrupt(i.clone());
    }
    if let Err((_, e)) = engine.admit_local(job, seq, sampler.clone()) {
        // Only a draft sequence that could not be made gets here; the session's own is lost
        // with the job, so it starts over.
        *own = engine.compute.sequence()?;
        return Err(e);
    }
    let mut out = Output::default();
    let (retired, read) = loop {
        engine.step();
        let read = drain(&events, &mut out, on_text);
        if read.is_err() {
            engine.stop_now();
        }
        if let Some(r) = engine.take_retired() {
            break (r, read);
        }
    };
    let Retired {
        seq,
        sampler: used,
        stop,
        stats,
    } = retired;
    *own = seq;
    *sampler = used;
    // The tail an interrupt flushed.
    let tail = drain(&events, &mut out, on_text);
    read.and(tail)?;
    Ok(Generation {
        tokens: out.tokens,
        text: out.text,
        stop: stop.unwrap_or(StopReason::Interrupted),
        stats,
    })
}

/// Refuse an empty prompt or one longer than the session's context.
fn check_prompt(session: &Session<'_>, prompt: &[u32]) -> Result<()> {
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
    Ok(())
}

/// The job for one generation, and the receiving end of its events.
fn job(prompt: &[u32], opts: &GenerateOptions, sampler: &Sampler) -> (Job, Receiver<Event>) {
    let (events, rx) = mpsc::channel();
    let job = Job {
        id: 0,
        prompt: prompt.to_vec(),
        sampler: sampler.config().clone(),
        max_tokens: opts.max_tokens,
        stop: Vec::new(),
        ignore_eos: opts.ignore_eos,
        logprobs: None,
        constraint: None,
        events,
        cancel: Arc::new(AtomicBool::new(false)),
        submitted: Instant::now(),
    };
    (job, rx)
}

/// Read the events sent so far: tokens and text into `out` (the text also to `on_text`), a
/// failure as an error.
fn drain(
    events: &Receiver<Event>,
    out: &mut Output,
    on_text: &mut dyn FnMut(&str) -> Result<()>,
) -> Result<()> {
    while let Ok(event) = events.try_recv() {
        match event {
            Event::Text { text, tokens } => {
                out.tokens.extend(tokens.iter().map(|t| t.id));
                if !text.is_empty() {
                    out.text.push_str(&text);
                    on_text(&text)?;
                }
            }
            Event::Done { .. } => {}
            Event::Failed { message } => return Err(RunnerError::Generation(message)),
        }
    }
    Ok(())
}
