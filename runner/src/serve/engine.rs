//! The engine: one thread that owns the model's sequences and runs continuous batching.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::draft::most_likely;
use crate::generate::Interrupt;
use crate::model::{common_prefix, Compute, Logits, Sequence};
use crate::sampler::Sampler;
use crate::serve::job::{Event, Finish, Job, Timings, TokenInfo, Usage};
use crate::serve::log;
use crate::serve::prompt_cache::{PromptCache, Reuse};
use crate::tokenizer::{TextStream, Tokenizer};

/// Why [`EngineHandle::submit`] refused a job (the job is handed back).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SubmitError {
    /// The queue is full: answer 503 with `Retry-After`.
    Full,
    /// The engine has stopped (the server is shutting down).
    Stopped,
}

/// Counters the engine keeps for `/health` and the load test.
#[derive(Debug, Default)]
pub struct EngineState {
    /// Sequences decoding or reading their prompt.
    pub active: AtomicUsize,
    /// Jobs waiting in the queue.
    pub queued: AtomicUsize,
    /// Finished conversations kept for reuse.
    pub cached: AtomicUsize,
    /// Bytes of KV those hold.
    pub cached_bytes: AtomicUsize,
}

/// A snapshot of [`EngineState`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct EngineStatus {
    /// Sequences decoded together at most (`--parallel`).
    pub slots: usize,
    /// Of those, in use.
    pub active: usize,
    /// Jobs waiting for a slot.
    pub queued: usize,
    /// Finished conversations kept for reuse.
    pub cached: usize,
    /// Bytes of KV those hold.
    pub cached_bytes: usize,
}

/// The connection threads' side of the engine: cheap to clone.
#[derive(Debug, Clone)]
pub struct EngineHandle {
    queue: SyncSender<Job>,
    state: Arc<EngineState>,
    slots: usize,
}

impl EngineHandle {
    /// Queue `job`, or hand it back when the queue is full or the engine has stopped.
    pub fn submit(&self, job: Job) -> std::result::Result<(), (SubmitError, Box<Job>)> {
        self.state.queued.fetch_add(1, Ordering::SeqCst);
        match self.queue.try_send(job) {
            Ok(()) => Ok(()),
            Err(e) => {
                self.state.queued.fetch_sub(1, Ordering::SeqCst);
                Err(match e {
                    TrySendError::Full(j) => (SubmitError::Full, Box::new(j)),
                    TrySendError::Disconnected(j) => (SubmitError::Stopped, Box::new(j)),
                })
            }
        }
    }

    /// The engine's counters now.
    pub fn status(&self) -> EngineStatus {
        let s = &self.state;
        EngineStatus {
            slots: self.slots,
            active: s.active.load(Ordering::SeqCst),
            queued: s.queued.load(Ordering::SeqCst),
            cached: s.cached.load(Ordering::SeqCst),
            cached_bytes: s.cached_bytes.load(Ordering::SeqCst),
        }
    }
}

/// A job queue holding at most `depth` waiting jobs, for an engine of `slots` sequences:
/// the handle for connection threads, and the receiving end the engine reads.
pub fn queue(slots: usize, depth: usize) -> (EngineHandle, std::sync::mpsc::Receiver<Job>) {
    let (tx, rx) = std::sync::mpsc::sync_channel(depth);
    let handle = EngineHandle {
        queue: tx,
        state: Arc::new(EngineState::default()),
        slots,
    };
    (handle, rx)
}

impl EngineHandle {
    /// The shared counters (the engine updates them).
    pub fn state(&self) -> &Arc<EngineState> {
        &self.state
    }
}

/// How the engine runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineOptions {
    /// Sequences decoded together at most (`--parallel`).
    pub parallel: usize,
    /// Prompt tokens read per forward pass (`-b`, as `generate` reads them), one chunk between
    /// two decoding steps.
    pub prefill_batch: usize,
    /// Bytes of finished conversations' KV kept for reuse (`--cache-mb`).
    pub cache_bytes: usize,
    /// Which part of a kept conversation a new prompt may reuse (`--cache-reuse`).
    pub reuse: Reuse,
    /// Tokens each sequence may guess per step by prompt lookup (`--lookup`, 0: none): they
    /// are checked in the same batched pass, and kept only where the model agrees, so the
    /// output is what plain decoding gives ([`crate::lookup`]).
    pub lookup: usize,
}

/// A draft model for the engine (`serve --draft`): its compute, on the model's threads
/// ([`Compute::alongside`]), proposes the guesses instead of prompt lookup, each sequence
/// keeping its own draft sequence beside its own.
pub struct EngineDraft<'d> {
    /// The draft model's compute.
    pub compute: Compute<'d>,
    /// Most tokens proposed per sequence and step (`--draft-max`).
    pub max: usize,
    /// Fewest tokens aimed for, however few get accepted (`--draft-min`).
    pub min: usize,
    /// Proposing stops where the draft gives its next token less than this probability
    /// (`--draft-p-min`).
    pub p_min: f32,
    /// The model's vocabulary size: a draft id at or past it ends a proposal.
    pub target_vocab: usize,
}

impl std::fmt::Debug for EngineDraft<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineDraft")
            .field("max", &self.max)
            .field("p_min", &self.p_min)
            .finish_non_exhaustive()
    }
}

/// A job holding a sequence.
struct Slot<'t> {
    job: Job,
    seq: Sequence,
    /// The draft model's sequence for this job (with `--draft`): a prefix of `history`
    /// and the guesses it last proposed.
    draft_seq: Option<Sequence>,
    /// Tokens to guess this step.
    want: usize,
    /// Prompt tokens already in the cache (reused, then read).
    read: usize,
    /// Of those, reused from the prompt cache.
    reused: usize,
    /// Leading positions read in whole prefill chunks from position 0 (what
    /// [`Reuse::Exact`] may reuse later).
    exact: usize,
    /// The last pass's logits, once the prompt is read: one row, or one per guess in
    /// `guesses` and one after them.
    logits: Vec<f32>,
    /// The guesses the last pass checked.
    guesses: Vec<u32>,
    /// Guesses made, and of those accepted.
    drafted: usize,
    accepted: usize,
    /// Guessed tokens the model agreed and disagreed with, recent ones weighing more: how
    /// far ahead guessing pays ([`guess_len`]).
    agreed: f64,
    disagreed: f64,
    /// Steps since the slot last guessed, and the steps to wait before a probe (one guess
    /// while guessing does not pay).
    idle: usize,
    probe_every: usize,
    sampler: Sampler,
    /// Prompt and generated tokens (the penalties' window).
    history: Vec<u32>,
    generated: usize,
    stream: TextStream<'t>,
    /// Text not yet sent: it might be the start of a stop string.
    held: String,
    queued_s: f64,
    prompt_s: f64,
    decode_start: Option<Instant>,
}

/// How a slot's step ended.
enum Outcome {
    /// Keep decoding with this token.
    Continue(u32),
    /// Finished (the event is sent).
    Finished,
    /// The client has gone or the job failed: drop it.
    Dropped,
}

/// The engine's loop: admit queued jobs into free slots, read one prompt chunk, decode every
/// slot whose prompt is read in one batched step, and repeat until `stop` is raised (then every
/// job still held or queued gets [`Event::Failed`]).
#[allow(clippy::too_many_arguments)]
pub fn run(
    compute: &mut Compute<'_>,
    mut draft: Option<&mut EngineDraft<'_>>,
    tokenizer: &Tokenizer,
    jobs: Receiver<Job>,
    handle: &EngineHandle,
    opts: &EngineOptions,
    stop: &Interrupt,
) {
    let state = handle.state();
    let mut cache = PromptCache::new(opts.cache_bytes);
    let mut slots: Vec<Slot<'_>> = Vec::new();
    let vocab = compute.model().config.vocab;
    // Seconds of a decoding pass and of a draft step, smoothed: what a draft's guess costs.
    let (mut pass_s, mut draft_step_s) = (0.0f64, 0.0f64);
    let publish = |slots: &[Slot<'_>], cache: &PromptCache| {
        state.active.store(slots.len(), Ordering::SeqCst);
        state.cached.store(cache.len(), Ordering::SeqCst);
        state.cached_bytes.store(cache.bytes(), Ordering::SeqCst);
    };
    loop {
        if stop.is_raised() {
            let failed = |job: &Job| {
                let _ = job.events.send(Event::Failed {
                    message: "the server is shutting down".into(),
                });
            };
            slots.iter().for_each(|s| failed(&s.job));
            slots.clear();
            while let Ok(job) = jobs.try_recv() {
                state.queued.fetch_sub(1, Ordering::SeqCst);
                failed(&job);
            }
            publish(&slots, &cache);
            return;
        }
        // Admit: wait briefly when idle, so that shutdown and new jobs are both seen promptly.
        while slots.len() < opts.parallel.max(1) {
            let next = if slots.is_empty() {
                jobs.recv_timeout(Duration::from_millis(50)).ok()
            } else {
                jobs.try_recv().ok()
            };
            let Some(job) = next else { break };
            state.queued.fetch_sub(1, Ordering::SeqCst);
            match admit(compute, draft.as_deref(), tokenizer, &mut cache, opts, job) {
                Ok(slot) => slots.push(slot),
                Err((job, message)) => {
                    log_line(&job, &format!("refused: {message}"));
                    let _ = job.events.send(Event::Failed { message });
                }
            }
        }
        // Jobs whose client has gone free their sequence at once.
        slots.retain(|s| !s.job.cancel.load(Ordering::SeqCst));
        publish(&slots, &cache);
        if slots.is_empty() {
            continue;
        }

        // One prompt chunk, for the slot admitted first that is still reading.
        if let Some(i) = slots.iter().position(|s| s.logits.is_empty()) {
            let s = &mut slots[i];
            let t = Instant::now();
            let end = (s.read + opts.prefill_batch.max(1)).min(s.job.prompt.len());
            let chunk = &s.job.prompt[s.read..end];
            let read = compute.forward(&mut s.seq, chunk, Logits::Last, None);
            // The draft reads the prompt alongside, in chunks of the same size.
            let draft_read = match (draft.as_deref_mut(), s.draft_seq.as_mut()) {
                (Some(d), Some(ds)) if read.is_ok() => {
                    catch_up(&mut d.compute, ds, &s.job.prompt[..end], opts.prefill_batch)
                }
                _ => Ok(()),
            };
            if let Err(e) = draft_read {
                log_line(&s.job, &format!("the draft stops guessing: {e}"));
                s.draft_seq = None;
            }
            match read {
                Ok(l) => {
                    if end == s.job.prompt.len() {
                        s.logits = l.to_vec();
                    }
                    if s.exact == s.read && chunk.len() == opts.prefill_batch.max(1) {
                        s.exact = end;
                    }
                    s.read = end;
                    s.prompt_s += t.elapsed().as_secs_f64();
                }
                Err(e) => {
                    let s = slots.remove(i);
                    fail(s, &e.to_string());
                    continue;
                }
            }
        }

        // Sample every slot whose prompt is read; those that go on decode together.
        let mut next = Vec::new();
        let mut finished = Vec::new();
        // Slots whose batch failed, with the message.
        let mut failed: Option<String> = None;
        for (i, s) in slots.iter_mut().enumerate() {
            if s.logits.is_empty() {
                continue;
            }
            match settle(s, tokenizer, vocab) {
                Outcome::Continue(id) => match trim(compute, &mut s.seq, &s.history) {
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
        if !next.is_empty() {
            // Each sequence's token, then its guesses (the draft's proposal, or what followed
            // the last n-gram before), as many as pay for their rows and its context and token
            // budget leave room for.
            // A guess costs its row, and with a draft the draft's step: at worst one step for
            // this sequence alone (the others stopped proposing), against a token's share of
            // the pass, `pass_s / decoding` (both measured, smoothed).
            let decoding = next.len() as f64;
            let draft_cost = if pass_s > 0.0 {
                decoding * draft_step_s / pass_s
            } else {
                0.0
            };
            let worth = row_worth(next.len()) + draft_cost;
            let most = draft.as_deref().map_or(opts.lookup, |d| d.max);
            for &(i, _) in &next {
                let s = &mut slots[i];
                let mut room = (s.seq.ctx() - s.seq.tokens().len() - 1)
                    .min(s.job.max_tokens - s.generated - 1);
                if let Some(ds) = &s.draft_seq {
                    // The draft's cache holds the history and all but the last guess.
                    room = room.min((ds.ctx() + 1).saturating_sub(s.history.len()));
                }
                let mut len = guess_len(s.agreed, s.disagreed, worth, most);
                if len > 0 {
                    s.probe_every = PROBE_EVERY;
                } else if most > 0 && s.idle >= s.probe_every {
                    // A probe; if the next step still finds no length that pays, the wait
                    // doubles (a draft's probe costs its catching up with the text).
                    len = 1;
                    s.probe_every = (s.probe_every * 2).min(PROBE_MAX);
                }
                len = len.max(draft.as_deref().map_or(0, |d| d.min));
                s.want = len.min(room);
                s.guesses.clear();
            }
            match draft.as_deref_mut() {
                Some(d) => {
                    match propose(d, &mut slots, opts.prefill_batch) {
                        Ok((0, _)) => {}
                        Ok((steps, secs)) => {
                            draft_step_s = smooth(draft_step_s, secs / steps as f64);
                        }
                        Err(e) => {
                            // The draft's failure costs its guesses, not the requests.
                            log::line(format_args!("the draft proposed nothing this step: {e}"));
                            slots.iter_mut().for_each(|s| s.guesses.clear());
                        }
                    }
                }
                None => {
                    for &(i, _) in &next {
                        let s = &mut slots[i];
                        s.guesses = crate::lookup::guess(&s.history, s.want);
                    }
                }
            }
            let inputs: Vec<Vec<u32>> = next
                .iter()
                .map(|&(i, id)| {
                    let s = &mut slots[i];
                    s.want = 0;
                    s.idle = if s.guesses.is_empty() { s.idle + 1 } else { 0 };
                    s.drafted += s.guesses.len();
                    let mut input = Vec::with_capacity(s.guesses.len() + 1);
                    input.push(id);
                    input.extend_from_slice(&s.guesses);
                    input
                })
                .collect();
            let inputs: Vec<&[u32]> = inputs.iter().map(Vec::as_slice).collect();
            let mut seqs: Vec<&mut Sequence> = Vec::with_capacity(next.len());
            let mut rest = &mut slots[..];
            let mut base = 0;
            for &(i, _) in &next {
                let (_, tail) = std::mem::take(&mut rest).split_at_mut(i - base);
                let (here, tail) = tail.split_at_mut(1);
                seqs.push(&mut here[0].seq);
                rest = tail;
                base = i + 1;
            }
            let t = Instant::now();
            match compute.decode_rows(&mut seqs, &inputs, Logits::All) {
                Ok(logits) => {
                    pass_s = smooth(pass_s, t.elapsed().as_secs_f64());
                    let mut row = 0;
                    for (&(i, _), input) in next.iter().zip(&inputs) {
                        let s = &mut slots[i];
                        let end = row + input.len();
                        s.logits.clear();
                        s.logits
                            .extend_from_slice(&logits[row * vocab..end * vocab]);
                        row = end;
                    }
                }
                // Only a broken invariant gets here (every sequence was checked to have
                // room): fail the batch rather than the server.
                Err(e) => failed = Some(e.to_string()),
            }
        }
        // Take out, from the back so that indices hold, the finished slots (kept for reuse)
        // and those of a failed batch.
        let mut out: Vec<(usize, bool)> = finished.into_iter().map(|i| (i, true)).collect();
        if failed.is_some() {
            out.extend(next.iter().map(|&(i, _)| (i, false)));
        }
        out.sort_unstable();
        for (i, done) in out.into_iter().rev() {
            let mut s = slots.remove(i);
            if !done {
                fail(s, failed.as_deref().unwrap_or_default());
            } else if !s.job.cancel.load(Ordering::SeqCst) {
                // Without the guesses it rejected: what plain decoding leaves.
                let run = s.history.len() - 1;
                if s.seq.tokens().len() > run {
                    s.seq.rewind(run);
                }
                cache.put(s.seq, s.exact);
            }
        }
        publish(&slots, &cache);
    }
}

/// Give `job` a sequence: the kept one sharing the longest prefix with its prompt, rewound to
/// that prefix, or a new one. Refuses a prompt the context cannot hold with room to generate.
fn admit<'t>(
    compute: &mut Compute<'_>,
    draft: Option<&EngineDraft<'_>>,
    tokenizer: &'t Tokenizer,
    cache: &mut PromptCache,
    opts: &EngineOptions,
    job: Job,
) -> std::result::Result<Slot<'t>, (Box<Job>, String)> {
    let ctx = compute.ctx();
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
    let chunk = opts.prefill_batch.max(1);
    let (seq, reused, exact) = match cache.take(&job.prompt, opts.reuse, chunk) {
        Some((mut seq, n, exact)) => {
            // A ring may have forgotten what position `n` reads: then nothing is kept.
            let kept = seq.rewind(n);
            (seq, kept, exact.min(kept))
        }
        None => match compute.sequence() {
            Ok(seq) => (seq, 0, 0),
            Err(e) => return Err((Box::new(job), e.to_string())),
        },
    };
    let draft_seq = match draft.map(|d| d.compute.sequence()).transpose() {
        Ok(d) => d,
        Err(e) => return Err((Box::new(job), e.to_string())),
    };
    Ok(Slot {
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
        sampler: Sampler::new(job.sampler.clone()),
        history: job.prompt.clone(),
        generated: 0,
        stream: tokenizer.stream(),
        held: String::new(),
        queued_s: job.submitted.elapsed().as_secs_f64(),
        prompt_s: 0.0,
        decode_start: None,
        seq,
        job,
    })
}

/// Take `s`'s tokens from the last pass's rows: each guess in turn is checked against its
/// row ([`Sampler::sample_draft`]: the token chosen is the guess exactly when the model
/// accepts it), the first one rejected ends the check, and the row after the last accepted
/// guess gives the next token. Without guesses, one token from the one row.
fn settle(s: &mut Slot<'_>, tokenizer: &Tokenizer, vocab: usize) -> Outcome {
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
        let agreed = s.accepted - before;
        s.agreed = s.agreed * DECAY + agreed as f64;
        s.disagreed = s.disagreed * DECAY + f64::from(u8::from(agreed < guesses.len()));
    }
    // Kept (not empty) until the next pass replaces it: the slot is past its prompt.
    s.logits = rows;
    outcome
}

/// Bring `seq` to `tokens`: keep the common prefix and run the rest in chunks of `batch`
/// (no logits).
fn catch_up(
    compute: &mut Compute<'_>,
    seq: &mut Sequence,
    tokens: &[u32],
    batch: usize,
) -> crate::Result<()> {
    let kept = seq.rewind(common_prefix(seq.tokens(), tokens));
    for chunk in tokens[kept..].chunks(batch.max(1)) {
        compute.forward(seq, chunk, Logits::None, None)?;
    }
    Ok(())
}

/// The draft's proposals for every slot that wants guesses (`want > 0`), into `guesses`: its
/// most likely token each time, stopping where it is less sure than `p_min`. The draft
/// sequences first catch up with their histories (the tokens accepted since, and the token
/// about to run), then take one step for all the proposing slots together per token.
/// Returns the steps and their seconds (catching up left out: what a longer proposal costs).
fn propose(
    d: &mut EngineDraft<'_>,
    slots: &mut [Slot<'_>],
    batch: usize,
) -> crate::Result<(usize, f64)> {
    let vocab = d.compute.model().config.vocab;
    // Each proposing slot's input for the next draft step.
    let mut inputs: Vec<Vec<u32>> = Vec::new();
    for s in slots.iter_mut() {
        let Some(ds) = s.draft_seq.as_mut().filter(|_| s.want > 0) else {
            s.want = 0;
            continue;
        };
        // What the draft lacks goes with the other slots' in one pass, giving the logits of
        // the history's last token. A long gap (after a pause) first runs alone, its tokens
        // batched together (the draft's bits need not match anything).
        let last = s.history.len() - 1;
        if last - common_prefix(ds.tokens(), &s.history).min(last) > CATCH_UP_TOGETHER {
            catch_up(&mut d.compute, ds, &s.history[..last], batch)?;
        }
        let kept = ds.rewind(common_prefix(ds.tokens(), &s.history).min(last));
        inputs.push(s.history[kept..].to_vec());
    }
    let mut steps = 0;
    let t = Instant::now();
    while !inputs.is_empty() {
        steps += 1;
        let mut seqs: Vec<&mut Sequence> = slots
            .iter_mut()
            .filter(|s| s.want > 0)
            .filter_map(|s| s.draft_seq.as_mut())
            .collect();
        let ins: Vec<&[u32]> = inputs.iter().map(Vec::as_slice).collect();
        let logits = d.compute.decode_rows(&mut seqs, &ins, Logits::Last)?;
        let mut going = Vec::with_capacity(inputs.len());
        let proposing = slots.iter_mut().filter(|s| s.want > 0);
        for (s, row) in proposing.zip(logits.chunks_exact(vocab)) {
            let (id, p) = most_likely(row);
            if id as usize >= d.target_vocab || p < d.p_min {
                s.want = 0;
                continue;
            }
            s.guesses.push(id);
            if s.guesses.len() == s.want {
                s.want = 0;
            } else {
                going.push(vec![id]);
            }
        }
        inputs = going;
    }
    Ok((steps, t.elapsed().as_secs_f64()))
}

/// A running mean of step times, the recent ones weighing more (the first sets it).
fn smooth(mean: f64, x: f64) -> f64 {
    if mean == 0.0 {
        x
    } else {
        DECAY * mean + (1.0 - DECAY) * x
    }
}

/// Tokens a draft sequence may lack and still catch up inside the batched step.
const CATCH_UP_TOGETHER: usize = 4;

/// How much the counts of [`guess_len`] keep per checked guess: about the last ten count.
const DECAY: f64 = 0.9;
/// Steps a slot that stopped guessing first waits before guessing one token again, to see
/// whether its text has begun to repeat.
const PROBE_EVERY: usize = 16;
/// The longest wait between probes.
const PROBE_MAX: usize = 1024;
/// Rows of a pass a guess is worth, in a batch of `decoding` sequences: a row costs about a
/// fifth of a one-token pass's fixed cost (reading the weights; measured on the 1B and
/// SmolLM2 shapes, Q4_0 and F16), so where that is shared by `decoding` sequences a guess
/// must be right with probability `decoding / (decoding + 5)` to save time.
fn row_worth(decoding: usize) -> f64 {
    let n = decoding.max(1) as f64;
    n / (n + 5.0)
}

/// How many tokens a sequence should guess, at most `max`: the longest run whose last guess
/// is still right with at least probability `worth` (what a guess costs, in tokens' worth of
/// time: [`row_worth`], plus a draft's step), each guess right with the rate its recent
/// guesses had (`agreed` and `disagreed` tokens; one of each assumed to start).
fn guess_len(agreed: f64, disagreed: f64, worth: f64, max: usize) -> usize {
    let p = (agreed + 1.0) / (agreed + disagreed + 2.0);
    let mut reach = 1.0;
    let mut len = 0;
    while len < max {
        reach *= p;
        if reach < worth {
            break;
        }
        len += 1;
    }
    len
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

/// Sample `s`'s next token from `row` (checking `guess`, when there is one), report it, and
/// say whether it goes on.
fn step(s: &mut Slot<'_>, tokenizer: &Tokenizer, row: &[f32], guess: Option<u32>) -> Outcome {
    if s.decode_start.is_none() {
        s.decode_start = Some(Instant::now());
    }
    if s.generated >= s.job.max_tokens {
        return finish(s, Finish::Length);
    }
    // The grammar's mask, over a copy of the logits (the originals give the log-probabilities).
    let mut masked;
    let mut logits: &[f32] = row;
    if let Some(c) = s.job.constraint.as_mut() {
        match c.allowed() {
            Ok(None) => {}
            Ok(Some(bits)) => {
                masked = row.to_vec();
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
                    return drop_failed(s, "the response format allows no further token");
                }
                logits = &masked;
            }
            Err(e) => return drop_failed(s, &format!("response format: {e}")),
        }
    }
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
    let is_stop = !s.job.ignore_eos && tokenizer.stop_tokens().contains(&id);
    if is_stop {
        if !send(s, String::new(), vec![info]) {
            return Outcome::Dropped;
        }
        return finish(s, Finish::Stop);
    }
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
        return finish(s, Finish::Stop);
    }
    let keep = stop_prefix_len(&s.held, &s.job.stop);
    let text = s.held[..s.held.len() - keep].to_string();
    s.held.drain(..s.held.len() - keep);
    if !send(s, text, vec![info]) {
        return Outcome::Dropped;
    }
    if s.job.constraint.as_ref().is_some_and(|c| c.is_finished()) {
        return finish(s, Finish::Stop);
    }
    // The chosen token runs next, after everything before it (`history` less rejected
    // guesses the cache may still hold).
    if s.generated >= s.job.max_tokens || s.history.len() > s.seq.ctx() {
        return finish(s, Finish::Length);
    }
    Outcome::Continue(id)
}

/// Send text and tokens; false when the client has gone.
fn send(s: &Slot<'_>, text: String, tokens: Vec<TokenInfo>) -> bool {
    s.job.events.send(Event::Text { text, tokens }).is_ok()
}

/// Flush what is held back and send [`Event::Done`].
fn finish(s: &mut Slot<'_>, why: Finish) -> Outcome {
    let mut rest = std::mem::take(&mut s.held);
    if let Ok(tail) = s.stream.finish() {
        rest.push_str(&tail);
    }
    // A stop string may complete only in the held-back tail.
    if let Some(at) = first_stop(&rest, &s.job.stop) {
        rest.truncate(at);
    }
    if !rest.is_empty() && !send(s, rest, Vec::new()) {
        return Outcome::Dropped;
    }
    let decode_s = s.decode_start.map_or(0.0, |t| t.elapsed().as_secs_f64());
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
            decode_s
        ),
    );
    if s.job
        .events
        .send(Event::Done {
            finish: why,
            usage,
            timings,
        })
        .is_err()
    {
        return Outcome::Dropped;
    }
    Outcome::Finished
}

/// Report a failure and drop the job.
fn drop_failed(s: &mut Slot<'_>, message: &str) -> Outcome {
    log_line(&s.job, &format!("failed: {message}"));
    let _ = s.job.events.send(Event::Failed {
        message: message.to_string(),
    });
    Outcome::Dropped
}

/// [`drop_failed`] for a slot already taken out of the engine.
fn fail(mut s: Slot<'_>, message: &str) {
    drop_failed(&mut s, message);
}

/// One line on stderr about a job ([`log::line`] escapes messages that quote the request).
fn log_line(job: &Job, what: &str) {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guesses_grow_with_agreement_and_shrink_with_a_fuller_batch() {
        // No history: even odds, worth two guesses alone (0.25 >= 1/6), none beside seven
        // others (0.5 < 8/13).
        assert_eq!(guess_len(0.0, 0.0, row_worth(1), 8), 2);
        assert_eq!(guess_len(0.0, 0.0, row_worth(8), 8), 0);
        // Mostly right: long guesses alone, shorter in a batch, never past `max`.
        assert_eq!(guess_len(9.0, 1.0, row_worth(1), 8), 8);
        let p: f64 = 10.0 / 12.0;
        let alone = (row_worth(1).ln() / p.ln()).floor() as usize;
        assert_eq!(guess_len(9.0, 1.0, row_worth(1), 64), alone);
        assert!(guess_len(9.0, 1.0, row_worth(8), 8) < guess_len(9.0, 1.0, row_worth(1), 8));
        assert!(guess_len(9.0, 1.0, row_worth(8), 8) > 0);
        // A draft step costing half a pass on top: shorter, and none at even odds.
        assert!(guess_len(9.0, 1.0, row_worth(1) + 0.5, 8) < guess_len(9.0, 1.0, row_worth(1), 8));
        assert_eq!(guess_len(0.0, 0.0, row_worth(1) + 0.5, 8), 0);
        // Mostly wrong: none.
        assert_eq!(guess_len(0.0, 9.0, row_worth(1), 8), 0);
        assert_eq!(guess_len(5.0, 5.0, row_worth(1), 0), 0);
    }
}
