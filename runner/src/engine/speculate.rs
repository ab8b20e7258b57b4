//! The one speculation policy: how many tokens each sequence guesses per step, and where the
//! guesses come from (a draft model, [`Draft`], or prompt lookup, [`crate::lookup`]).
//!
//! A guess costs its row in the batched pass, and with a draft the draft's step; it pays
//! when it is likely enough to be accepted. Each sequence keeps decayed counts of the guesses
//! its model agreed and disagreed with (`record`), and guesses the longest run whose last
//! guess is still worth its cost (`guess_len`); where none is, it stops guessing and probes
//! now and then with one guess (`PROBE_EVERY`). The guesses decide only how many tokens a
//! pass yields, never which: [`crate::Sampler::sample_draft`] keeps exactly what the model
//! itself would have produced.

use std::time::Instant;

use super::slot::Slot;
use crate::draft::{most_likely, Draft};
use crate::model::{common_prefix, Compute, Logits, Sequence};

/// How much the counts of [`guess_len`] and the smoothed costs keep per update: about the
/// last ten count.
pub(crate) const DECAY: f64 = 0.9;
/// Steps a sequence that stopped guessing first waits before guessing one token again, to see
/// whether its text has begun to repeat (or its draft to agree).
pub(crate) const PROBE_EVERY: usize = 16;
/// The longest wait between probes: each probe that finds guessing still not paying doubles
/// the wait (a draft's probe costs its catching up with the text).
const PROBE_MAX: usize = 1024;
/// Tokens a draft sequence may lack and still catch up inside the batched draft step.
const CATCH_UP_TOGETHER: usize = 4;

/// Rows of a pass a guess is worth, in a batch of `decoding` sequences: a row costs about a
/// fifth of a one-token pass's fixed cost (reading the weights; measured on the 1B and
/// SmolLM2 shapes, Q4_0 and F16), so where that is shared by `decoding` sequences a guess
/// must be right with probability `decoding / (decoding + 5)` to save time.
pub(crate) fn row_worth(decoding: usize) -> f64 {
    let n = decoding.max(1) as f64;
    n / (n + 5.0)
}

/// How many tokens a sequence should guess, at most `max`: the longest run whose last guess
/// is still right with at least probability `worth` (what a guess costs, in tokens' worth of
/// time: [`row_worth`], plus a draft's step), each guess right with the rate its recent
/// guesses had (`agreed` and `disagreed` tokens; one of each assumed to start).
pub(crate) fn guess_len(agreed: f64, disagreed: f64, worth: f64, max: usize) -> usize {
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

/// A running mean of step times, the recent ones weighing more (the first sets it).
fn smooth(mean: f64, x: f64) -> f64 {
    if mean == 0.0 {
        x
    } else {
        DECAY * mean + (1.0 - DECAY) * x
    }
}

/// What the model made of `guessed` guesses of `s`: it accepted the first `agreed`.
pub(crate) fn record(s: &mut Slot<'_>, agreed: usize, guessed: usize) {
    s.agreed = s.agreed * DECAY + agreed as f64;
    s.disagreed = s.disagreed * DECAY + f64::from(u8::from(agreed < guessed));
}

/// The measured costs guesses are weighed against.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Costs {
    /// Seconds of a decoding pass, smoothed.
    pub pass_s: f64,
    /// Seconds of a draft step, smoothed.
    pub draft_step_s: f64,
}

impl Costs {
    /// Record a decoding pass of `secs` seconds.
    pub fn pass(&mut self, secs: f64) {
        self.pass_s = smooth(self.pass_s, secs);
    }

    /// What a guess must be worth in a batch of `decoding` sequences: its row, and with a
    /// draft the draft's step, at worst one step for this sequence alone (the others stopped
    /// proposing), against a token's share of the pass, `pass_s / decoding`.
    fn worth(&self, decoding: usize, draft: bool) -> f64 {
        let draft_cost = if draft && self.pass_s > 0.0 {
            decoding as f64 * self.draft_step_s / self.pass_s
        } else {
            0.0
        };
        row_worth(decoding) + draft_cost
    }
}

/// Set how many tokens each sequence in `next` guesses this step (`want`): as many as pay
/// for their rows, at most `lookup` (or the draft's most), and what its context and token
/// budget leave room for.
pub(crate) fn plan(
    slots: &mut [Slot<'_>],
    next: &[(usize, u32)],
    costs: &Costs,
    draft: Option<&Draft<'_>>,
    lookup: usize,
) {
    let worth = costs.worth(next.len(), draft.is_some());
    let most = draft.map_or(lookup, |d| d.opts.max);
    let least = draft.map_or(0, |d| d.opts.min);
    for &(i, _) in next {
        let s = &mut slots[i];
        let mut room =
            (s.seq.ctx() - s.seq.tokens().len() - 1).min(s.job.max_tokens - s.generated - 1);
        if let Some(ds) = &s.draft_seq {
            // The draft's cache holds the history and all but the last guess.
            room = room.min((ds.ctx() + 1).saturating_sub(s.history.len()));
        }
        let mut len = guess_len(s.agreed, s.disagreed, worth, most);
        if len > 0 {
            s.probe_every = PROBE_EVERY;
        } else if most > 0 && s.idle >= s.probe_every {
            // A probe; if the next step still finds no length that pays, the wait doubles.
            len = 1;
            s.probe_every = (s.probe_every * 2).min(PROBE_MAX);
        }
        s.want = len.max(least).min(room);
        s.guesses.clear();
    }
}

/// Fill the guesses `plan` asked for: the draft's proposals, or prompt lookup's. A draft's
/// failure costs its guesses, not the requests: it is reported and nothing is guessed.
pub(crate) fn guess(
    slots: &mut [Slot<'_>],
    next: &[(usize, u32)],
    costs: &mut Costs,
    draft: Option<&mut Draft<'_>>,
) {
    match draft {
        Some(d) => match propose(d, slots) {
            Ok((0, _)) => {}
            Ok((steps, secs)) => {
                costs.draft_step_s = smooth(costs.draft_step_s, secs / steps as f64)
            }
            Err(e) => {
                crate::serve::log::line(format_args!("the draft proposed nothing this step: {e}"));
                slots.iter_mut().for_each(|s| s.guesses.clear());
            }
        },
        None => {
            for &(i, _) in next {
                let s = &mut slots[i];
                s.guesses = crate::lookup::guess(&s.history, s.want);
            }
        }
    }
    for &(i, _) in next {
        let s = &mut slots[i];
        s.want = 0;
        s.idle = if s.guesses.is_empty() { s.idle + 1 } else { 0 };
        s.drafted += s.guesses.len();
    }
}

/// Bring `seq` to `tokens`: keep the common prefix and run the rest in chunks of `batch`
/// (no logits).
pub(crate) fn catch_up(
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
/// most likely token each time, stopping where it is less sure than its `p_min`. The draft
/// sequences first catch up with their histories (the tokens accepted since, and the token
/// about to run), then take one step for all the proposing slots together per token.
/// Returns the steps and their seconds (catching up left out: what a longer proposal costs).
fn propose(d: &mut Draft<'_>, slots: &mut [Slot<'_>]) -> crate::Result<(usize, f64)> {
    let mut inputs = draft_inputs(d, slots)?;
    let vocab = d.compute.model().config.vocab;
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
            if id as usize >= d.target_vocab || p < d.opts.p_min {
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

/// Each proposing slot's input for the first draft step: what its draft sequence lacks of
/// its history. A slot without a draft sequence proposes nothing.
fn draft_inputs(d: &mut Draft<'_>, slots: &mut [Slot<'_>]) -> crate::Result<Vec<Vec<u32>>> {
    let mut inputs = Vec::new();
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
            catch_up(&mut d.compute, ds, &s.history[..last], d.opts.prefill_batch)?;
        }
        let kept = ds.rewind(common_prefix(ds.tokens(), &s.history).min(last));
        inputs.push(s.history[kept..].to_vec());
    }
    Ok(inputs)
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

    #[test]
    fn a_draft_step_raises_what_a_guess_must_be_worth() {
        let mut c = Costs::default();
        assert_eq!(c.worth(1, true), row_worth(1));
        c.pass(0.010);
        c.draft_step_s = 0.005;
        assert!((c.worth(2, true) - (row_worth(2) + 1.0)).abs() < 1e-12);
        assert_eq!(c.worth(2, false), row_worth(2));
    }
}
