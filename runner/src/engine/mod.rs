//! The decoding engine: the one loop every front end drives. `kiln-run generate`, `chat` and
//! `bench` run it with one slot on their own thread (`local`, behind
//! [`crate::generate::generate`]); `kiln-run serve` runs it on an engine thread fed by a
//! bounded queue ([`EngineHandle::submit`]), decoding up to `--parallel` sequences together.
//!
//! An [`Engine`] borrows a [`Compute`] (and a [`Draft`]'s, when there is one) and owns its
//! slots: each a [`Job`] with its [`Sequence`], sampler and text stream (`slot`). One
//! [`Engine::step`] runs its named steps in order:
//!
//! 1. *retire the cancelled*: a job whose client has gone frees its sequence;
//! 2. *prefill a chunk* (`Engine::prefill_chunk`): one chunk of the prompt of the slot
//!    admitted first that is still reading it;
//! 3. *settle* (`Engine::settle`): every slot past its prompt takes its tokens from the last
//!    pass's rows, checking the guesses that pass carried;
//! 4. *propose guesses* (`Engine::propose`): the one speculation policy ([`speculate`]) says
//!    how many tokens each sequence guesses, and a draft model or prompt lookup fills them;
//! 5. *decode a batch* (`Engine::decode`): one forward pass over every continuing sequence's
//!    token and guesses;
//! 6. *retire* (`Engine::retire`): finished sequences go to the prompt cache
//!    ([`prompt_cache`]) or back to the client that brought them.
//!
//! The engine's [`Interrupt`] is checked before each forward pass (a prompt chunk, a decoding
//! pass): a local run then ends as [`StopReason::Interrupted`] with what it generated, and a
//! server's jobs are answered as failed. A local run's summary ([`Stats`]: prefill and decode
//! rates, acceptance, tokens per pass, stop reason) comes from its slot.

pub mod handle;
pub mod job;
pub(crate) mod local;
pub mod prompt_cache;
pub(crate) mod slot;
pub mod speculate;
pub mod summary;

use std::sync::atomic::Ordering;
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub use handle::{queue, EngineHandle, EngineState, EngineStatus, SubmitError};
pub use job::{Event, Finish, Job, Timings, TokenConstraint, TokenInfo, Usage};
pub use summary::{Interrupt, Stats, StopReason};

pub(crate) use summary::raised;

use crate::draft::Draft;
use crate::model::{Compute, Logits, Sequence};
use crate::sampler::Sampler;
use crate::tokenizer::Tokenizer;
use prompt_cache::{PromptCache, Reuse};
use slot::{drop_failed, log_line, Origin, Outcome, Slot};
use speculate::{catch_up, Costs, PROBE_EVERY};

/// How the engine runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineOptions {
    /// Sequences decoded together at most (`--parallel`).
    pub parallel: usize,
    /// Prompt tokens read per forward pass (`-b`), one chunk between two decoding steps.
    pub prefill_batch: usize,
    /// Bytes of finished conversations' KV kept for reuse (`--cache-mb`).
    pub cache_bytes: usize,
    /// Which part of a kept conversation a new prompt may reuse (`--cache-reuse`).
    pub reuse: Reuse,
    /// Most tokens each sequence may guess per step by prompt lookup (`--lookup`, 0: none):
    /// they are checked in the same batched pass, and kept only where the model agrees, so
    /// the output is what plain decoding gives ([`crate::lookup`]).
    pub lookup: usize,
}

/// A local client's slot once it has ended: its sequence and sampler go back to the client.
pub(crate) struct Retired {
    pub seq: Sequence,
    pub sampler: Sampler,
    pub stop: Option<StopReason>,
    pub stats: Stats,
}

/// The decoding engine: the model's compute, its slots and the prompt cache.
pub struct Engine<'a, 'm, 'd> {
    compute: &'a mut Compute<'m>,
    draft: Option<&'a mut Draft<'d>>,
    tokenizer: &'a Tokenizer,
    opts: EngineOptions,
    interrupt: Option<Interrupt>,
    state: Arc<EngineState>,
    cache: PromptCache,
    slots: Vec<Slot<'a>>,
    costs: Costs,
    retired: Vec<Retired>,
}

impl std::fmt::Debug for Engine<'_, '_, '_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("opts", &self.opts)
            .field("slots", &self.slots.len())
            .finish_non_exhaustive()
    }
}

impl<'a, 'm, 'd> Engine<'a, 'm, 'd> {
    /// An engine over `compute`, with `draft` proposing guesses when given (else prompt
    /// lookup, as `opts.lookup` says).
    pub fn new(
        compute: &'a mut Compute<'m>,
        draft: Option<&'a mut Draft<'d>>,
        tokenizer: &'a Tokenizer,
        opts: EngineOptions,
    ) -> Engine<'a, 'm, 'd> {
        Engine {
            compute,
            draft,
            tokenizer,
            cache: PromptCache::new(opts.cache_bytes),
            opts,
            interrupt: None,
            state: Arc::default(),
            slots: Vec::new(),
            costs: Costs::default(),
            retired: Vec::new(),
        }
    }

    /// Stop when `interrupt` is raised (checked before each forward pass).
    pub fn with_interrupt(mut self, interrupt: Interrupt) -> Self {
        self.interrupt = Some(interrupt);
        self
    }

    /// Publish the engine's counters into `state` (a queue's: [`EngineHandle::state`]).
    pub fn with_state(mut self, state: Arc<EngineState>) -> Self {
        self.state = state;
        self
    }

    /// The server's loop: admit queued jobs into free slots and step, until the interrupt is
    /// raised; then every job still held or queued gets [`Event::Failed`].
    pub fn serve(mut self, jobs: Receiver<Job>) {
        loop {
            if raised(self.interrupt.as_ref()) {
                self.stop_all();
                while let Ok(job) = jobs.try_recv() {
                    self.state.queued.fetch_sub(1, Ordering::SeqCst);
                    let _ = job.events.send(Event::Failed {
                        message: "the server is shutting down".into(),
                    });
                }
                self.publish();
                return;
            }
            self.admit_queued(&jobs);
            self.step();
        }
    }

    /// Admit: take queued jobs while slots are free, waiting briefly when idle, so that
    /// shutdown and new jobs are both seen promptly.
    fn admit_queued(&mut self, jobs: &Receiver<Job>) {
        while self.slots.len() < self.opts.parallel.max(1) {
            let next = if self.slots.is_empty() {
                jobs.recv_timeout(Duration::from_millis(50)).ok()
            } else {
                jobs.try_recv().ok()
            };
            let Some(job) = next else { break };
            self.state.queued.fetch_sub(1, Ordering::SeqCst);
            if let Err((job, message)) = self.admit(job) {
                log_line(&job, &format!("refused: {message}"));
                let _ = job.events.send(Event::Failed { message });
            }
        }
    }

    /// Give a queued `job` a sequence: the kept one sharing the longest prefix with its
    /// prompt, rewound to that prefix, or a new one. Refuses a prompt the context cannot hold
    /// with room to generate.
    pub fn admit(&mut self, job: Job) -> std::result::Result<(), (Box<Job>, String)> {
        let ctx = self.compute.ctx();
        if job.prompt.is_empty() {
            return Err((Box::new(job), "the prompt is empty".into()));
        }
        if job.prompt.len() >= ctx {
            let message = format!(
                "the prompt has {} tokens; the context holds {ctx} with room to generate",
                job.prompt.len()
            );
            return Err((Box::new(job), message));
        }
        if let Err(e) = job.sampler.validate() {
            return Err((Box::new(job), e.to_string()));
        }
        let chunk = self.opts.prefill_batch.max(1);
        let (seq, reused, exact) = match self.cache.take(&job.prompt, self.opts.reuse, chunk) {
            Some((mut seq, n, exact)) => {
                // A ring may have forgotten what position `n` reads: then nothing is kept.
                let kept = seq.rewind(n);
                (seq, kept, exact.min(kept))
            }
            None => match self.compute.sequence() {
                Ok(seq) => (seq, 0, 0),
                Err(e) => return Err((Box::new(job), e.to_string())),
            },
        };
        let sampler = Sampler::new(job.sampler.clone());
        self.seat(job, Origin::Queue, (seq, reused, exact), sampler)
            .map_err(|(job, e)| (job, e.to_string()))
    }

    /// Give a local client's `job` its own `seq` (the cached prefix its prompt shares is
    /// kept) and `sampler`; both come back from `Engine::take_retired` when it ends.
    pub(crate) fn admit_local(
        &mut self,
        job: Job,
        mut seq: Sequence,
        sampler: Sampler,
    ) -> std::result::Result<(), (Box<Job>, crate::RunnerError)> {
        let reused = seq.reuse_prefix(&job.prompt);
        self.seat(job, Origin::Local, (seq, reused, 0), sampler)
    }

    /// Put `job` into a new slot over `seq`, of which `reused` tokens (the first `exact` read
    /// in whole chunks) already hold its prompt.
    fn seat(
        &mut self,
        job: Job,
        origin: Origin,
        (seq, reused, exact): (Sequence, usize, usize),
        sampler: Sampler,
    ) -> std::result::Result<(), (Box<Job>, crate::RunnerError)> {
        let draft_seq = match self.draft.as_deref_mut().map(Draft::sequence).transpose() {
            Ok(d) => d,
            Err(e) => return Err((Box::new(job), e)),
        };
        self.slots.push(Slot {
            origin,
            draft_seq,
            want: 0,
            read: reused,
            reused,
            exact,
            logits: Vec::new(),
            guesses: Vec::new(),
            drafted: 0,
            accepted: 0,
            agreed: 0.0,
            disagreed: 0.0,
            idle: 0,
            probe_every: PROBE_EVERY,
            sampler,
            history: job.prompt.clone(),
            generated: 0,
            passes: 0,
            stream: self.tokenizer.stream(),
            held: String::new(),
            queued_s: job.submitted.elapsed().as_secs_f64(),
            prompt_s: 0.0,
            decode_start: None,
            stop: None,
            seq,
            job,
        });
        Ok(())
    }

    /// One round of the engine's steps (see the module's overview). Does nothing without
    /// slots.
    pub fn step(&mut self) {
        // Jobs whose client has gone free their sequence at once.
        self.slots.retain(|s| !s.job.cancel.load(Ordering::SeqCst));
        self.publish();
        if self.slots.is_empty() || self.stopped() {
            return;
        }
        self.prefill_chunk();
        let (next, finished) = self.settle();
        let mut failed = None;
        if !next.is_empty() && !raised(self.interrupt.as_ref()) {
            self.propose(&next);
            failed = self.decode(&next).err();
        }
        self.retire(finished, &next, failed);
        self.stopped();
        self.publish();
    }

    /// Whether the interrupt is raised; if so, every slot ends (`slot::interrupt`).
    fn stopped(&mut self) -> bool {
        if !raised(self.interrupt.as_ref()) {
            return false;
        }
        self.stop_all();
        true
    }

    /// End every slot at an interrupt: local ones go back to their client as interrupted.
    fn stop_all(&mut self) {
        for mut s in std::mem::take(&mut self.slots) {
            slot::interrupt(&mut s);
            self.release(s, false);
        }
    }

    fn publish(&self) {
        let state = &self.state;
        state.active.store(self.slots.len(), Ordering::SeqCst);
        state.cached.store(self.cache.len(), Ordering::SeqCst);
        state
            .cached_bytes
            .store(self.cache.bytes(), Ordering::SeqCst);
    }

    /// One prompt chunk, for the slot admitted first that is still reading; the draft reads
    /// it alongside, in chunks of the same size.
    fn prefill_chunk(&mut self) {
        let Some(i) = self.slots.iter().position(|s| s.logits.is_empty()) else {
            return;
        };
        let batch = self.opts.prefill_batch.max(1);
        let s = &mut self.slots[i];
        let t = Instant::now();
        let end = (s.read + batch).min(s.job.prompt.len());
        let chunk = &s.job.prompt[s.read..end];
        let read = self.compute.forward(&mut s.seq, chunk, Logits::Last, None);
        let draft_read = match (self.draft.as_deref_mut(), s.draft_seq.as_mut()) {
            (Some(d), Some(ds)) if read.is_ok() => {
                catch_up(&mut d.compute, ds, &s.job.prompt[..end], batch)
            }
            _ => Ok(()),
        };
        if let Err(e) = draft_read {
            if s.origin == Origin::Queue {
                log_line(&s.job, &format!("the draft stops guessing: {e}"));
            }
            s.draft_seq = None;
        }
        match read {
            Ok(l) => {
                if end == s.job.prompt.len() {
                    s.logits = l.to_vec();
                }
                if s.exact == s.read && chunk.len() == batch {
                    s.exact = end;
                }
                s.read = end;
                s.prompt_s += t.elapsed().as_secs_f64();
            }
            Err(e) => {
                let mut s = self.slots.remove(i);
                drop_failed(&mut s, &e.to_string());
                self.release(s, false);
            }
        }
    }

    /// Sample every slot whose prompt is read: the indices and tokens of those that go on
    /// (their caches trimmed to what plain decoding would hold), and those that finished.
    fn settle(&mut self) -> (Vec<(usize, u32)>, Vec<usize>) {
        let vocab = self.compute.model().config.vocab;
        let (mut next, mut finished) = (Vec::new(), Vec::new());
        for (i, s) in self.slots.iter_mut().enumerate() {
            if s.logits.is_empty() {
                continue;
            }
            match slot::settle(s, self.tokenizer, vocab) {
                Outcome::Continue(id) => match trim(self.compute, &mut s.seq, &s.history) {
                    Ok(()) => next.push((i, id)),
                    Err(e) => {
                        // Not kept for reuse: its cache is in doubt.
                        s.job.cancel.store(true, Ordering::SeqCst);
                        drop_failed(s, &e.to_string());
                        finished.push(i);
                    }
                },
                Outcome::Finished | Outcome::Dropped => finished.push(i),
            }
        }
        (next, finished)
    }

    /// The guesses each continuing sequence carries into the pass ([`speculate`]).
    fn propose(&mut self, next: &[(usize, u32)]) {
        let lookup = self.opts.lookup;
        speculate::plan(
            &mut self.slots,
            next,
            &self.costs,
            self.draft.as_deref(),
            lookup,
        );
        speculate::guess(
            &mut self.slots,
            next,
            &mut self.costs,
            self.draft.as_deref_mut(),
        );
    }

    /// One forward pass over each continuing sequence's token and its guesses; each slot
    /// keeps its rows. `Err` (only from a broken invariant: every sequence was checked to
    /// have room) fails the batch rather than the server.
    fn decode(&mut self, next: &[(usize, u32)]) -> std::result::Result<(), String> {
        let vocab = self.compute.model().config.vocab;
        let inputs: Vec<Vec<u32>> = next
            .iter()
            .map(|&(i, id)| {
                let mut input = Vec::with_capacity(self.slots[i].guesses.len() + 1);
                input.push(id);
                input.extend_from_slice(&self.slots[i].guesses);
                input
            })
            .collect();
        let ins: Vec<&[u32]> = inputs.iter().map(Vec::as_slice).collect();
        let mut seqs = sequences(&mut self.slots, next);
        let t = Instant::now();
        let logits = self
            .compute
            .decode_rows(&mut seqs, &ins, Logits::All)
            .map_err(|e| e.to_string())?;
        self.costs.pass(t.elapsed().as_secs_f64());
        let mut row = 0;
        for (&(i, _), input) in next.iter().zip(&inputs) {
            let s = &mut self.slots[i];
            let end = row + input.len();
            s.logits.clear();
            s.logits
                .extend_from_slice(&logits[row * vocab..end * vocab]);
            s.passes += 1;
            row = end;
        }
        Ok(())
    }

    /// Take out, from the back so that indices hold, the finished slots (kept for reuse) and,
    /// when the pass `failed`, those of its batch.
    fn retire(&mut self, finished: Vec<usize>, next: &[(usize, u32)], failed: Option<String>) {
        let mut out: Vec<(usize, bool)> = finished.into_iter().map(|i| (i, true)).collect();
        if failed.is_some() {
            out.extend(next.iter().map(|&(i, _)| (i, false)));
        }
        out.sort_unstable();
        for (i, done) in out.into_iter().rev() {
            let mut s = self.slots.remove(i);
            if !done {
                drop_failed(&mut s, failed.as_deref().unwrap_or_default());
            }
            self.release(s, done);
        }
    }

    /// A slot leaves the engine: a local one goes back to its client, a queued one that
    /// ended normally (`keep`) to the prompt cache, without the guesses it rejected (what
    /// plain decoding leaves).
    fn release(&mut self, mut s: Slot<'a>, keep: bool) {
        let run = s.history.len() - 1;
        if s.seq.tokens().len() > run {
            s.seq.rewind(run);
        }
        match s.origin {
            Origin::Local => {
                if let (Some(d), Some(ds)) = (self.draft.as_deref_mut(), s.draft_seq.take()) {
                    d.kept = Some(ds);
                }
                self.retired.push(Retired {
                    stats: s.stats(),
                    stop: s.stop,
                    sampler: s.sampler,
                    seq: s.seq,
                });
            }
            Origin::Queue if keep && !s.job.cancel.load(Ordering::SeqCst) => {
                self.cache.put(s.seq, s.exact);
            }
            Origin::Queue => {}
        }
    }

    /// A local slot that has ended, if one has.
    pub(crate) fn take_retired(&mut self) -> Option<Retired> {
        self.retired.pop()
    }

    /// End every slot now, as an interrupt would.
    pub(crate) fn stop_now(&mut self) {
        self.stop_all();
    }
}

/// The sequences of the slots `next` names, in that order (indices ascending).
fn sequences<'s>(slots: &'s mut [Slot<'_>], next: &[(usize, u32)]) -> Vec<&'s mut Sequence> {
    let mut seqs = Vec::with_capacity(next.len());
    let mut rest = slots;
    let mut base = 0;
    for &(i, _) in next {
        let (_, tail) = std::mem::take(&mut rest).split_at_mut(i - base);
        let (here, tail) = tail.split_at_mut(1);
        seqs.push(&mut here[0].seq);
        rest = tail;
        base = i + 1;
    }
    seqs
}

/// Cut `seq` back to the tokens plain decoding would have run: all of `history` but its
/// last token (chosen, not yet run), dropping rejected guesses. A sliding layer's ring may
/// have lost what that position reads (only with a window shorter than the guesses): the
/// rest runs again a token at a time, as decoding ran it.
fn trim(compute: &mut Compute<'_>, seq: &mut Sequence, history: &[u32]) -> crate::Result<()> {
    let run = history.len() - 1;
    if seq.tokens().len() <= run {
        return Ok(());
    }
    let kept = seq.rewind(run);
    for &t in &history[kept..run] {
        compute.forward(seq, &[t], Logits::None, None)?;
    }
    Ok(())
}
