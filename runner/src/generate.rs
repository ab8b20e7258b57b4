//! Generation as the command line runs it: [`generate`] continues a prompt and
//! [`Conversation`] keeps a chat's turns over one session. Both are one-slot clients of the
//! engine ([`crate::engine`]), which reads the prompt in batches, decodes until a stop token,
//! the token budget, the end of the context or an [`Interrupt`], streams text as it becomes
//! valid UTF-8, and checks guesses (prompt lookup, [`GenerateOptions::lookup`], or a draft
//! model, [`generate_with_draft`]) in the same pass.

use serde::Serialize;

use crate::chat::{ChatTemplate, Message};
use crate::draft::Draft;
use crate::error::Result;
use crate::model::Session;
use crate::sampler::Sampler;
use crate::tokenizer::Tokenizer;

pub(crate) use crate::engine::raised;
pub use crate::engine::{Interrupt, Stats, StopReason};

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
    draft: Option<&mut Draft<'_>>,
    tokenizer: &Tokenizer,
    prompt: &[u32],
    opts: &GenerateOptions,
    sampler: &mut Sampler,
    on_text: &mut dyn FnMut(&str) -> Result<()>,
) -> Result<Generation> {
    crate::engine::local::generate(session, draft, tokenizer, prompt, opts, sampler, on_text)
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
