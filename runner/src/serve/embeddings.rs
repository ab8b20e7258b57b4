//! `/v1/embeddings` when the served model is an embedding model.
//!
//! One [`Embedder`] does the work; requests take turns at it in arrival order ([`Turns`]),
//! at most `queue` waiting, each for at most the request timeout (then a 503). A text's
//! vector does not depend on what else is in its pass (see [`crate::embed`]), so a request's
//! answer is the same whether it ran alone or behind others, and the same as
//! `kiln-run embed`'s. Between passes of a long request the connection and the stop flag are
//! looked at, so a client that went away stops costing compute within one pass.

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use crate::embed::{l2_normalize, EmbedOptions, Embedder};
use crate::error::Result;
use crate::model::Model;
use crate::tokenizer::Tokenizer;

/// Inputs embedded between two looks at the client and the stop flag.
const CHECK_EVERY: usize = 64;

/// Most tokens one request may have embedded, over all its inputs (OpenAI allows 300,000): a
/// request holds the embedder while it runs, so this bounds how long others wait behind one
/// (a few seconds a thread at a small model's speed).
pub const MAX_REQUEST_TOKENS: usize = 65_536;

/// What to embed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EmbedInput {
    /// Texts to tokenize.
    Texts(Vec<String>),
    /// Token id sequences, used as they are.
    Tokens(Vec<Vec<u32>>),
}

impl EmbedInput {
    /// How many inputs.
    pub fn len(&self) -> usize {
        match self {
            EmbedInput::Texts(t) => t.len(),
            EmbedInput::Tokens(t) => t.len(),
        }
    }

    /// Whether there are none (never, once parsed).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One embedding job: what a front end asks of [`EmbedService::embed`], whatever protocol it
/// arrived in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EmbedJob {
    /// The inputs, in order.
    pub input: EmbedInput,
    /// The vector length the client expects, if it said (refused unless the model's).
    pub dimensions: Option<usize>,
    /// Cut long inputs instead of refusing them.
    pub truncate: bool,
    /// Scale vectors to unit length.
    pub normalize: bool,
    /// A prompt the model names, put before every text.
    pub prompt_name: Option<String>,
}

/// Why an embedding job was refused or failed; a front end maps each to its protocol's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EmbedError {
    /// The job is wrong: `param` names the field at fault (the client's to fix).
    Invalid {
        /// The field at fault, as `input[3]` or `dimensions`.
        param: String,
        /// What is wrong and how to fix it.
        message: String,
    },
    /// No turn at the model (queue full, timeout, abandoned): retrying later may succeed.
    Busy(String),
    /// The model failed on the job.
    Failed(String),
}

impl EmbedError {
    fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        EmbedError::Invalid {
            param: param.into(),
            message: message.into(),
        }
    }
}

impl std::fmt::Display for EmbedError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            EmbedError::Invalid { message, .. }
            | EmbedError::Busy(message)
            | EmbedError::Failed(message) => f.write_str(message),
        }
    }
}

impl std::error::Error for EmbedError {}

/// What the server embeds with.
#[derive(Debug)]
pub struct EmbedService<'m> {
    embedder: Mutex<Embedder<'m>>,
    turns: Turns,
    /// The model's tokenizer, cutting at [`EmbedService::max_tokens`] (a cut is a refusal
    /// unless the request allows it).
    tokenizer: Tokenizer,
    prompts: Vec<(String, String)>,
    default_prompt: String,
    dim: usize,
    max_tokens: usize,
    vocab: usize,
}

/// What a request got: vectors in input order and the tokens read.
#[derive(Debug)]
pub struct Embedded {
    /// One vector per input.
    pub vectors: Vec<Vec<f32>>,
    /// Tokens the model read, over every input.
    pub tokens: usize,
}

impl<'m> EmbedService<'m> {
    /// A service over `model` (an embedding model, else an error naming `label`), on
    /// `threads` threads, letting `queue` requests wait.
    pub fn new(
        model: &'m Model<'m>,
        tokenizer: &Tokenizer,
        label: &str,
        threads: usize,
        queue: usize,
    ) -> Result<EmbedService<'m>> {
        // Pooled as the model pools; normalised per request (`normalize`, on by default).
        let opts = EmbedOptions {
            normalize: Some(false),
            ..EmbedOptions::default()
        };
        let embedder = Embedder::new(model, label, threads, &opts)?;
        let spec = model.config.embedding.as_ref();
        let prompts: Vec<(String, String)> = spec
            .map(|s| s.prompts.clone().into_iter().collect())
            .unwrap_or_default();
        let default_prompt = spec
            .and_then(|s| s.default_prompt_name.as_ref())
            .and_then(|n| prompts.iter().find(|(k, _)| k == n))
            .map(|(_, p)| p.clone())
            .unwrap_or_default();
        Ok(EmbedService {
            tokenizer: tokenizer.truncating(embedder.max_tokens())?,
            dim: embedder.dim(),
            max_tokens: embedder.max_tokens(),
            vocab: model.config.vocab,
            embedder: Mutex::new(embedder),
            turns: Turns::new(queue),
            prompts,
            default_prompt,
        })
    }

    /// The vectors' width.
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// The most tokens an input may have.
    pub fn max_tokens(&self) -> usize {
        self.max_tokens
    }

    /// Requests waiting for their turn, and whether one is being embedded.
    pub fn load(&self) -> (usize, bool) {
        self.turns.load()
    }

    /// Tokenize and check a request's inputs (no turn needed).
    fn prepare(&self, req: &EmbedJob) -> std::result::Result<Vec<Vec<u32>>, EmbedError> {
        if let Some(d) = req.dimensions {
            if d != self.dim {
                return Err(EmbedError::invalid(
                    "dimensions",
                    format!(
                        "`dimensions` is {d}, but this model's vectors have {} (it cannot \
                         shorten them)",
                        self.dim
                    ),
                ));
            }
        }
        let prefix = match &req.prompt_name {
            None => self.default_prompt.as_str(),
            Some(name) => self
                .prompts
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, p)| p.as_str())
                .ok_or_else(|| {
                    let names: Vec<&str> = self.prompts.iter().map(|(k, _)| k.as_str()).collect();
                    EmbedError::invalid(
                        "prompt_name",
                        format!(
                            "`prompt_name` is `{name}`; the model names {}",
                            if names.is_empty() {
                                "no prompts".to_string()
                            } else {
                                names.join(", ")
                            }
                        ),
                    )
                })?,
        };
        let limit = self.max_tokens;
        let too_long = |i: usize, count: Option<usize>| {
            let has = count.map_or(format!("more than {limit}"), |n| n.to_string());
            EmbedError::invalid(
                format!("input[{i}]"),
                format!(
                    "input {i} has {has} tokens; the model takes at most {limit}: shorten it \
                     or send `\"truncate\": true`"
                ),
            )
        };
        match &req.input {
            EmbedInput::Texts(texts) => texts
                .iter()
                .enumerate()
                .map(|(i, t)| {
                    let (ids, cut) = self
                        .tokenizer
                        .encode_cut(&format!("{prefix}{t}"))
                        .map_err(|e| EmbedError::invalid(format!("input[{i}]"), e.to_string()))?;
                    if cut && !req.truncate {
                        return Err(too_long(i, None));
                    }
                    if ids.is_empty() {
                        return Err(EmbedError::invalid(
                            format!("input[{i}]"),
                            format!("input {i} has no tokens"),
                        ));
                    }
                    Ok(ids)
                })
                .collect(),
            EmbedInput::Tokens(seqs) => seqs
                .iter()
                .enumerate()
                .map(|(i, ids)| {
                    if let Some(j) = ids.iter().position(|&id| id as usize >= self.vocab) {
                        return Err(EmbedError::invalid(
                            format!("input[{i}][{j}]"),
                            format!(
                                "token {} is not a token id (0 to {})",
                                ids[j],
                                self.vocab - 1
                            ),
                        ));
                    }
                    if ids.len() > limit && !req.truncate {
                        return Err(too_long(i, Some(ids.len())));
                    }
                    Ok(ids[..ids.len().min(limit)].to_vec())
                })
                .collect(),
        }
    }

    /// Embed a request's inputs, waiting until `deadline` for its turn; `abandoned` is asked
    /// between passes whether to stop (the client went away or the server stops).
    pub fn embed(
        &self,
        req: &EmbedJob,
        deadline: Option<Instant>,
        abandoned: &dyn Fn() -> bool,
    ) -> std::result::Result<Embedded, EmbedError> {
        let ids = self.prepare(req)?;
        let total: usize = ids.iter().map(Vec::len).sum();
        if total > MAX_REQUEST_TOKENS {
            return Err(EmbedError::invalid(
                "input",
                format!(
                    "the inputs total {total} tokens; at most {MAX_REQUEST_TOKENS} in one \
                     request: send them in several"
                ),
            ));
        }
        self.run(&ids, req.normalize, deadline, abandoned)
    }

    /// [`EmbedService::embed`] for an in-process caller, which may send any number of
    /// inputs: they are embedded in turns of at most [`MAX_REQUEST_TOKENS`] tokens, so others
    /// waiting for the embedder still get theirs between.
    pub fn embed_all(
        &self,
        req: &EmbedJob,
        abandoned: &dyn Fn() -> bool,
    ) -> std::result::Result<Embedded, EmbedError> {
        let ids = self.prepare(req)?;
        let mut out = Embedded {
            vectors: Vec::with_capacity(ids.len()),
            tokens: 0,
        };
        let mut start = 0;
        while start < ids.len() {
            let mut end = start;
            let mut tokens = 0;
            while end < ids.len() && (end == start || tokens + ids[end].len() <= MAX_REQUEST_TOKENS)
            {
                tokens += ids[end].len();
                end += 1;
            }
            let part = self.run(&ids[start..end], req.normalize, None, abandoned)?;
            out.vectors.extend(part.vectors);
            out.tokens += part.tokens;
            start = end;
        }
        Ok(out)
    }

    /// Embed checked inputs `ids` in one turn at the embedder.
    fn run(
        &self,
        ids: &[Vec<u32>],
        normalize: bool,
        deadline: Option<Instant>,
        abandoned: &dyn Fn() -> bool,
    ) -> std::result::Result<Embedded, EmbedError> {
        let busy = |why: &str| EmbedError::Busy(format!("{why}; retry"));
        let _turn = match self.turns.wait(deadline, abandoned) {
            Ok(t) => t,
            Err(Refused::Full) => {
                return Err(busy(
                    "the server is busy: every place in the embedding queue is taken",
                ))
            }
            Err(Refused::Timeout) => {
                return Err(busy(
                    "the server is busy: no turn at the model within the request timeout",
                ))
            }
            Err(Refused::Abandoned) => return Err(busy("the request was abandoned")),
        };
        let mut embedder = self.embedder.lock().unwrap_or_else(PoisonError::into_inner);
        let mut vectors = Vec::with_capacity(ids.len());
        for part in ids.chunks(CHECK_EVERY) {
            if abandoned() {
                return Err(busy("the request was abandoned"));
            }
            let got = embedder
                .embed_ids(part, &mut |_| {})
                .map_err(|e| EmbedError::Failed(format!("embedding failed: {e}")))?;
            vectors.extend(got);
        }
        if normalize {
            vectors.iter_mut().for_each(|v| l2_normalize(v));
        }
        Ok(Embedded {
            vectors,
            tokens: ids.iter().map(Vec::len).sum(),
        })
    }
}

/// Why a request got no turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Refused {
    /// `queue` requests were already waiting.
    Full,
    /// The deadline passed.
    Timeout,
    /// The client went away or the server stops.
    Abandoned,
}

/// Turns at one resource in arrival order, with a bounded line.
#[derive(Debug)]
struct Turns {
    state: Mutex<Line>,
    changed: Condvar,
    queue: usize,
}

#[derive(Debug, Default)]
struct Line {
    /// Tickets in order; the first holds the turn (if `taken`).
    tickets: VecDeque<u64>,
    next: u64,
    taken: bool,
}

/// How often a waiting request looks at its client and the stop flag.
const TURN_POLL: Duration = Duration::from_millis(50);

impl Turns {
    fn new(queue: usize) -> Turns {
        Turns {
            state: Mutex::new(Line::default()),
            changed: Condvar::new(),
            queue,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Line> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn load(&self) -> (usize, bool) {
        let l = self.lock();
        (l.tickets.len() - usize::from(l.taken), l.taken)
    }

    /// Wait for this request's turn; it lasts until the [`Turn`] is dropped.
    fn wait(
        &self,
        deadline: Option<Instant>,
        abandoned: &dyn Fn() -> bool,
    ) -> std::result::Result<Turn<'_>, Refused> {
        let mut line = self.lock();
        if line.tickets.len() - usize::from(line.taken) >= self.queue {
            return Err(Refused::Full);
        }
        let me = line.next;
        line.next += 1;
        line.tickets.push_back(me);
        loop {
            if !line.taken && line.tickets.front() == Some(&me) {
                line.taken = true;
                return Ok(Turn { turns: self, me });
            }
            let why = if deadline.is_some_and(|d| Instant::now() >= d) {
                Some(Refused::Timeout)
            } else {
                drop(line);
                let gone = abandoned();
                line = self.lock();
                gone.then_some(Refused::Abandoned)
            };
            if let Some(why) = why {
                line.tickets.retain(|&t| t != me);
                self.changed.notify_all();
                return Err(why);
            }
            line = self
                .changed
                .wait_timeout(line, TURN_POLL)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }
}

/// A request's turn; the next one's begins when it is dropped.
struct Turn<'t> {
    turns: &'t Turns,
    me: u64,
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        let mut line = self.turns.lock();
        line.tickets.retain(|&t| t != self.me);
        line.taken = false;
        self.turns.changed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    #[test]
    fn turns_go_in_order_one_at_a_time() {
        let turns = Arc::new(Turns::new(8));
        let inside = Arc::new(AtomicUsize::new(0));
        let order = Arc::new(Mutex::new(Vec::new()));
        let first = turns.wait(None, &|| false).unwrap();
        let mut handles = Vec::new();
        for i in 0..4 {
            let (mine, inside, order) = (turns.clone(), inside.clone(), order.clone());
            handles.push(std::thread::spawn(move || {
                let _t = mine.wait(None, &|| false).unwrap();
                assert_eq!(
                    inside.fetch_add(1, Ordering::SeqCst),
                    0,
                    "two turns at once"
                );
                order.lock().unwrap().push(i);
                std::thread::sleep(Duration::from_millis(5));
                inside.fetch_sub(1, Ordering::SeqCst);
            }));
            // Let thread i take its ticket before thread i + 1.
            while turns.load().0 < i + 1 {
                std::thread::yield_now();
            }
        }
        assert_eq!(turns.load(), (4, true));
        drop(first);
        for h in handles {
            h.join().unwrap();
        }
        assert_eq!(*order.lock().unwrap(), [0, 1, 2, 3]);
        assert_eq!(turns.load(), (0, false));
    }

    #[test]
    fn a_full_line_a_deadline_and_a_gone_client_are_refused_and_leave_the_line() {
        let turns = Turns::new(1);
        let held = turns.wait(None, &|| false).unwrap();
        let soon = Some(Instant::now() + Duration::from_millis(30));
        assert_eq!(turns.wait(soon, &|| false).err(), Some(Refused::Timeout));
        assert_eq!(turns.wait(None, &|| true).err(), Some(Refused::Abandoned));
        assert_eq!(turns.load(), (0, true));
        std::thread::scope(|s| {
            let waiter = s.spawn(|| turns.wait(None, &|| false).map(|_| ()));
            while turns.load().0 == 0 {
                std::thread::yield_now();
            }
            assert_eq!(turns.wait(None, &|| false).err(), Some(Refused::Full));
            drop(held);
            waiter.join().unwrap().unwrap();
        });
        assert_eq!(turns.load(), (0, false));
    }
}
