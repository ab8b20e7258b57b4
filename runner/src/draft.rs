//! A draft model for speculative decoding: a smaller or lower-precision model with the
//! target's vocabulary proposes the next few tokens, and the engine ([`crate::engine`])
//! checks them in its batched pass, keeping what the target itself would have produced. The
//! draft only decides how many tokens a pass yields, never which: its numbers need no batch
//! invariance and its sequences are synced lazily.
//!
//! The draft proposes its most likely token each time (a guess made with certainty), so the
//! target's check is the rule [`crate::Sampler::sample_draft`] already applies to prompt
//! lookup, exact at every temperature. How many tokens it proposes is the engine's one
//! speculation policy ([`crate::engine::speculate`]): drafting stops early where the draft is
//! unsure ([`DraftOptions::p_min`]), and a guess is made where it is likely enough to pay for
//! its row and the draft's step.

use crate::error::{Result, RunnerError};
use crate::model::{Compute, Sequence, Session};
use crate::tokenizer::Tokenizer;

/// How the draft proposes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DraftOptions {
    /// Most tokens proposed per target pass (`--draft-max`).
    pub max: usize,
    /// Fewest tokens proposed per pass, however few get accepted (`--draft-min`); the
    /// draft's own doubt ([`DraftOptions::p_min`]) may still stop it earlier. With 0, drafting
    /// pauses while it does not pay (an occasional probe keeps the estimates current), so a
    /// draft that is too slow or too often wrong costs little.
    pub min: usize,
    /// Stop proposing once the draft gives its choice less than this probability
    /// (`--draft-p-min`): an unsure guess is mostly rejected, and each costs a draft step.
    pub p_min: f32,
    /// Tokens per forward pass when the draft reads the prompt or catches up after a pause.
    pub prefill_batch: usize,
}

impl Default for DraftOptions {
    fn default() -> Self {
        DraftOptions {
            max: 16,
            min: 0,
            p_min: 0.2,
            prefill_batch: crate::generate::DEFAULT_PREFILL_BATCH,
        }
    }
}

/// A draft model's compute (on the target's threads: [`Compute::alongside`]) and how it
/// proposes. Each sequence the engine decodes keeps a draft sequence beside its own.
pub struct Draft<'d> {
    pub(crate) compute: Compute<'d>,
    pub(crate) opts: DraftOptions,
    /// The target's vocabulary size: a draft id at or past it (padding rows) ends a proposal.
    pub(crate) target_vocab: usize,
    /// The draft sequence of a front end that runs one generation after another (a
    /// conversation's turns), kept between them so that the draft rereads only what is new.
    pub(crate) kept: Option<Sequence>,
}

impl std::fmt::Debug for Draft<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Draft")
            .field("opts", &self.opts)
            .field("target_vocab", &self.target_vocab)
            .finish_non_exhaustive()
    }
}

/// Refuse a draft whose vocabulary is not the target's, id for id, naming the first id that
/// differs.
pub fn same_vocabulary(draft: &Tokenizer, target: &Tokenizer) -> Result<()> {
    match draft.vocabulary_difference(target) {
        None => Ok(()),
        Some(why) => Err(RunnerError::InvalidArgument {
            arg: "--draft",
            reason: format!(
                "the draft model's vocabulary is not the model's ({why}); a draft must share \
                 the target's tokenizer"
            ),
        }),
    }
}

impl<'d> Draft<'d> {
    /// A draft over `session` (its sequence kept for the first generation), for a target
    /// whose tokenizer is `target` and whose logits have `target_vocab` entries. The
    /// vocabularies must be the same, id for id: otherwise the error names the first id that
    /// differs.
    pub fn new(
        session: Session<'d>,
        draft: &Tokenizer,
        target: &Tokenizer,
        target_vocab: usize,
        opts: DraftOptions,
    ) -> Result<Draft<'d>> {
        let (compute, seq) = session.into_parts();
        let mut d = Draft::with_compute(compute, draft, target, target_vocab, opts)?;
        d.kept = Some(seq);
        Ok(d)
    }

    /// [`Draft::new`] over a draft model's compute, for an engine that gives each of its
    /// sequences a draft sequence of its own.
    pub fn with_compute(
        compute: Compute<'d>,
        draft: &Tokenizer,
        target: &Tokenizer,
        target_vocab: usize,
        opts: DraftOptions,
    ) -> Result<Draft<'d>> {
        same_vocabulary(draft, target)?;
        if opts.max == 0 || opts.min > opts.max {
            return Err(RunnerError::InvalidArgument {
                arg: "--draft-min",
                reason: format!(
                    "must be at most --draft-max, which must be at least 1 (got {} and {})",
                    opts.min, opts.max
                ),
            });
        }
        if !(0.0..=1.0).contains(&opts.p_min) {
            return Err(RunnerError::InvalidArgument {
                arg: "--draft-p-min",
                reason: format!("must be between 0 and 1 (got {})", opts.p_min),
            });
        }
        Ok(Draft {
            compute,
            opts,
            target_vocab,
            kept: None,
        })
    }

    /// How it proposes.
    pub fn options(&self) -> &DraftOptions {
        &self.opts
    }

    /// A draft sequence for a new generation: the one kept from the last, or a new one.
    pub(crate) fn sequence(&mut self) -> Result<Sequence> {
        match self.kept.take() {
            Some(seq) => Ok(seq),
            None => self.compute.sequence(),
        }
    }
}

/// The id with the largest logit and its probability under the softmax.
pub(crate) fn most_likely(logits: &[f32]) -> (u32, f32) {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    let top = logits[best];
    let sum: f32 = logits.iter().map(|&l| (l - top).exp()).sum();
    (best as u32, if sum > 0.0 { 1.0 / sum } else { 0.0 })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn most_likely_gives_the_top_id_and_its_softmax_probability() {
        let (id, p) = most_likely(&[0.0, 2.0f32.ln(), 0.0]);
        assert_eq!(id, 1);
        assert!((p - 0.5).abs() < 1e-6, "{p}");
        let (id, p) = most_likely(&[5.0]);
        assert_eq!((id, p), (0, 1.0));
    }
}
