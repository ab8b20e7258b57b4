//! A draft model for speculative decoding: a smaller or lower-precision model with the
//! target's vocabulary proposes the next few tokens, and [`crate::generate`] checks them with
//! one pass of the target ([`crate::Session::verify`]), keeping what the target itself would
//! have produced. The draft only decides how many tokens a pass yields, never which: its
//! numbers need no batch invariance and its cache is synced lazily.
//!
//! The draft proposes its most likely token each time (a guess made with certainty), so the
//! target's check is the rule [`crate::Sampler::sample_draft`] already applies to prompt
//! lookup, exact at every temperature. How many tokens it proposes adapts to what pays:
//! drafting stops early where the draft is unsure ([`DraftOptions::p_min`]), and the length
//! aimed for is the one that maximizes the expected tokens per second given the acceptance
//! rate and the measured cost of a draft step against a target pass.

use std::time::Instant;

use crate::error::{Result, RunnerError};
use crate::model::{Logits, Session};
use crate::tokenizer::Tokenizer;

/// How the draft proposes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DraftOptions {
    /// Most tokens proposed per target pass (`--draft-max`).
    pub max: usize,
    /// Fewest tokens aimed for per pass, whatever the acceptance rate (`--draft-min`); the
    /// draft's own doubt ([`DraftOptions::p_min`]) may still stop it earlier. With 0, drafting
    /// pauses while it does not pay (an occasional probe keeps the estimates current), so a
    /// draft that is too slow or too often wrong costs little.
    pub min: usize,
    /// Stop proposing once the draft gives its choice less than this probability
    /// (`--draft-p-min`): an unsure guess is mostly rejected, and each costs a draft step.
    pub p_min: f32,
    /// Tokens per forward pass when the draft reads the prompt.
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

/// Decay of the running acceptance and cost estimates per target pass: about the last ten
/// passes count.
const DECAY: f64 = 0.9;

/// While drafting is paused (it did not pay), one short proposal is made anyway after this many
/// passes, so that a change in the text (a stretch the draft predicts well) is noticed. Each
/// probe that finds drafting still not paying doubles the wait, up to [`PROBE_EVERY_MAX`]: a
/// probe costs the draft's catching up on every token since the last one.
const PROBE_EVERY: usize = 32;
const PROBE_EVERY_MAX: usize = 1024;

/// The length of such a probe.
const PROBE_LEN: usize = 2;

/// The length of the first proposal, before anything is measured.
const FIRST_LEN: usize = 4;

/// A draft model's session and what it has learned about paying off.
pub struct Draft<'d> {
    session: Session<'d>,
    opts: DraftOptions,
    /// The target's vocabulary size: a draft id at or past it (padding rows) ends a proposal.
    target_vocab: usize,
    /// Decayed counts of accepted guesses and of guesses that were tried (accepted, or the
    /// first rejected one): their ratio estimates the chance the next guess is accepted.
    accepted: f64,
    tried: f64,
    /// Decayed seconds per draft step.
    step_s: f64,
    /// Decayed sums over target passes of 1, guesses `k`, seconds `s`, `k²` and `k·s`: a
    /// least-squares line for a pass's cost against its guesses (each row costs arithmetic,
    /// which matters where a few rows already keep the cores busy).
    fit: [f64; 5],
    /// The proposal length aimed for next (0: paused).
    aim: usize,
    /// Passes since drafting paused or last probed, the passes to wait before the next probe,
    /// and whether the proposal being checked is a probe.
    idle: usize,
    probe_every: usize,
    probing: bool,
}

impl std::fmt::Debug for Draft<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Draft")
            .field("opts", &self.opts)
            .field("acceptance", &self.acceptance())
            .field("aim", &self.aim)
            .finish()
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
    /// A draft over `session`, for a target whose tokenizer is `target` and whose logits have
    /// `target_vocab` entries. The vocabularies must be the same, id for id: otherwise the
    /// error names the first id that differs.
    pub fn new(
        session: Session<'d>,
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
            session,
            opts,
            target_vocab,
            // A mild prior: three of four guesses accepted, over four guesses' weight.
            accepted: 3.0,
            tried: 4.0,
            step_s: 0.0,
            fit: [0.0; 5],
            // Short until the costs are measured: a long first proposal is mostly wasted.
            aim: FIRST_LEN.clamp(opts.min, opts.max),
            idle: 0,
            probe_every: PROBE_EVERY,
            probing: false,
        })
    }

    /// The running estimate of the chance a guess is accepted.
    pub fn acceptance(&self) -> f64 {
        self.accepted / self.tried
    }

    /// The proposal length aimed for next.
    pub fn aim(&self) -> usize {
        self.aim
    }

    /// The draft's session (its cache holds a prefix of the text so far).
    pub fn session(&self) -> &Session<'d> {
        &self.session
    }

    /// Bring the draft's cache to `history[..len - 1]` and return the draft's logits for what
    /// follows `history` (running the tokens its cache lacks, in prefill batches).
    fn catch_up(&mut self, history: &[u32]) -> Result<Vec<f32>> {
        let reused = self.session.reuse_prefix(history);
        let mut logits = Vec::new();
        for chunk in history[reused..].chunks(self.opts.prefill_batch.max(1)) {
            let l = self.session.forward(chunk, Logits::Last, None)?;
            logits.clear();
            logits.extend_from_slice(l);
        }
        Ok(logits)
    }

    /// Read `prompt` into the draft's cache ahead of decoding, so the prompt's cost shows as
    /// prefill rather than as the first decoding step's.
    pub fn prefill(&mut self, prompt: &[u32]) -> Result<()> {
        if !prompt.is_empty() {
            self.catch_up(prompt)?;
        }
        Ok(())
    }

    /// Up to `room` tokens proposed to follow `history` (whose last token the target has not
    /// run yet): the draft's most likely token each time, as many as [`Draft::aim`] says,
    /// fewer where the draft is unsure. May be empty.
    pub fn propose(&mut self, history: &[u32], room: usize) -> Result<Vec<u32>> {
        let aim = if self.aim > 0 {
            self.aim
        } else {
            self.idle += 1;
            if self.idle < self.probe_every {
                return Ok(Vec::new());
            }
            self.idle = 0;
            self.probing = true;
            PROBE_LEN.min(self.opts.max)
        };
        // The draft's cache holds `history` and all but the last proposed token.
        let fits = (self.session.ctx() + 1).saturating_sub(history.len());
        let want = aim.min(room).min(fits);
        let mut out = Vec::with_capacity(want);
        if want == 0 {
            return Ok(out);
        }
        let t = Instant::now();
        let mut logits = self.catch_up(history)?;
        let mut steps = 1usize;
        loop {
            let (id, p) = most_likely(&logits);
            if id as usize >= self.target_vocab || p < self.opts.p_min {
                break;
            }
            out.push(id);
            if out.len() == want {
                break;
            }
            logits.clear();
            logits.extend_from_slice(self.session.forward(&[id], Logits::Last, None)?);
            steps += 1;
        }
        let per_step = t.elapsed().as_secs_f64() / steps as f64;
        self.step_s = if self.step_s == 0.0 {
            per_step
        } else {
            DECAY * self.step_s + (1.0 - DECAY) * per_step
        };
        if out.is_empty() {
            // A step that proposed nothing (the draft was unsure from the start) cost as much
            // as a rejected guess and gave as little: count it as one, so that a draft that is
            // mostly unsure pauses rather than paying a step on every pass.
            self.accepted *= DECAY;
            self.tried = DECAY * self.tried + 1.0;
            self.update_aim();
        }
        Ok(out)
    }

    /// What the target made of a proposal of `drafted` tokens: it accepted the first
    /// `accepted`, and its pass took `pass_s` seconds. Updates the estimates and the length
    /// aimed for next.
    pub fn record(&mut self, drafted: usize, accepted: usize, pass_s: f64) {
        if drafted == 0 {
            return;
        }
        let rejected = usize::from(accepted < drafted);
        self.accepted = DECAY * self.accepted + accepted as f64;
        self.tried = DECAY * self.tried + (accepted + rejected) as f64;
        let k = drafted as f64;
        for (sum, v) in self.fit.iter_mut().zip([1.0, k, pass_s, k * k, k * pass_s]) {
            *sum = DECAY * *sum + v;
        }
        self.update_aim();
    }

    /// Choose the length aimed for next from the current estimates (after a probe, also when
    /// to probe next).
    fn update_aim(&mut self) {
        let (base, per_row) = self.pass_cost();
        if base > 0.0 {
            self.aim = best_length(
                self.acceptance(),
                (per_row + self.step_s) / base,
                self.opts.min,
                self.opts.max,
            );
        }
        if std::mem::take(&mut self.probing) {
            self.probe_every = if self.aim == 0 {
                (2 * self.probe_every).min(PROBE_EVERY_MAX)
            } else {
                PROBE_EVERY
            };
        }
    }

    /// A target pass's seconds as `base + per_row · k` for `k` guesses, fitted to the recent
    /// passes.
    fn pass_cost(&self) -> (f64, f64) {
        line(self.fit)
    }
}

/// The least-squares line through decayed sums `[n, Σk, Σs, Σk², Σk·s]`: `(base, per_row)`,
/// `per_row` 0 until the lengths have varied (and never below 0).
fn line(fit: [f64; 5]) -> (f64, f64) {
    let [n, k, s, kk, ks] = fit;
    if n <= 0.0 {
        return (0.0, 0.0);
    }
    let spread = n * kk - k * k;
    let per_row = if spread > 1e-9 * n * n {
        ((n * ks - k * s) / spread).max(0.0)
    } else {
        0.0
    };
    (((s - per_row * k) / n).max(0.0), per_row)
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

/// The proposal length in `min..=max` with the most expected tokens per unit of time, when
/// each guess is accepted with probability `a` (until the first rejection) and each guess
/// costs `c` target passes (its draft step and its row in the target's pass): a pass over `k`
/// guesses yields `1 + a + … + a^k` tokens and costs `1 + k·c`. Length 0 is plain decoding
/// (one token per pass).
pub fn best_length(a: f64, c: f64, min: usize, max: usize) -> usize {
    let a = a.clamp(0.0, 1.0);
    let c = c.max(0.0);
    let mut best = (min, f64::MIN);
    let mut yield_ = 1.0;
    let mut power = 1.0;
    for k in 0..=max {
        if k > 0 {
            power *= a;
            yield_ += power;
        }
        if k < min {
            continue;
        }
        let rate = yield_ / (1.0 + k as f64 * c);
        if rate > best.1 {
            best = (k, rate);
        }
    }
    best.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pass_cost_line_fits_what_was_recorded() {
        let mut fit = [0.0; 5];
        for (k, s) in [(1.0, 0.012), (3.0, 0.016), (5.0, 0.020), (2.0, 0.014)] {
            for (sum, v) in fit.iter_mut().zip([1.0, k, s, k * k, k * s]) {
                *sum = DECAY * *sum + v;
            }
        }
        let (base, per_row) = line(fit);
        assert!((base - 0.010).abs() < 1e-9, "{base}");
        assert!((per_row - 0.002).abs() < 1e-9, "{per_row}");
        // One length only: no slope to fit, the mean as the base.
        let mut fit = [0.0; 5];
        for _ in 0..3 {
            for (sum, v) in fit.iter_mut().zip([1.0, 4.0, 0.02, 16.0, 0.08]) {
                *sum = DECAY * *sum + v;
            }
        }
        let (base, per_row) = line(fit);
        assert!(
            (base - 0.02).abs() < 1e-12 && per_row == 0.0,
            "{base} {per_row}"
        );
    }

    #[test]
    fn a_sure_cheap_draft_aims_long_and_an_unsure_costly_one_short() {
        assert_eq!(best_length(0.99, 0.01, 1, 16), 16);
        assert_eq!(best_length(0.2, 0.5, 1, 16), 1);
        // Where no length pays, plain decoding, unless a minimum is set.
        assert_eq!(best_length(0.2, 0.5, 0, 16), 0);
        assert_eq!(best_length(0.9, 1.0, 0, 16), 0);
        assert_eq!(best_length(0.9, 0.3, 0, 16), best_length(0.9, 0.3, 1, 16));
        // In between, the optimum moves with acceptance and cost.
        let mid = best_length(0.8, 0.15, 1, 16);
        assert!((2..16).contains(&mid), "{mid}");
        assert!(best_length(0.9, 0.15, 1, 16) > mid);
        assert!(best_length(0.8, 0.05, 1, 16) > mid);
    }

    #[test]
    fn the_length_stays_within_its_bounds() {
        assert_eq!(best_length(0.0, 10.0, 3, 8), 3);
        assert_eq!(best_length(1.0, 0.0, 1, 5), 5);
        assert_eq!(best_length(0.5, 0.1, 2, 2), 2);
    }

    #[test]
    fn most_likely_gives_the_top_id_and_its_softmax_probability() {
        let (id, p) = most_likely(&[0.0, 2.0f32.ln(), 0.0]);
        assert_eq!(id, 1);
        assert!((p - 0.5).abs() < 1e-6, "{p}");
        let (id, p) = most_likely(&[5.0]);
        assert_eq!((id, p), (0, 1.0));
    }
}
