//! `--to auto`: every weight matrix's block type chosen from calibration, so that the file meets
//! a size budget with the least KL-divergence from the model it came from.
//!
//! Each matrix is quantized, exactly as the file pipeline would write it, to every type its
//! rows fit ([`CANDIDATES`]), and each result is scored by the *output error* it causes over
//! the calibration's inputs, `Σ_r (w_r − ŵ_r)ᵀ·H·(w_r − ŵ_r)` with `H = E[x·xᵀ]` (its diagonal
//! when only that was measured): the noise power the quantization adds to the matrix's outputs.
//! An untied embedding, whose "input" picks one row per token, scores the mean over its rows of
//! each row's squared error (every token equally likely).
//!
//! Output errors are in each matrix's own output's units, and the same noise is worth very
//! different amounts in the logits depending on where it enters. So each matrix's errors are
//! converted to KL-divergence: [`Probe`] runs the model on the calibration's first tokens
//! with that matrix alone rounded to its first candidate of at least [`PROBE_BITS`] bits, and
//! the measured KL-divergence per unit of that rounding's output error (the matrix's *gain*)
//! multiplies all of its candidates' errors. One forward pass per matrix.
//!
//! Minimising the summed KL-divergence under the byte budget is a multiple-choice knapsack. It
//! is solved by its Lagrangian: each matrix takes the type minimising `error + λ·bytes`, with
//! `λ` bisected to the smallest value whose choices fit, and the bytes that leaves are spent
//! greedily on the upgrades that save the most error per byte. Only standard GGML types are
//! candidates, so the file exports to GGUF and runs in llama.cpp as it is.
//!
//! Measured on SmolLM2-135M (calibrated on `fixtures/text/calibration.txt`, KL-divergence
//! against F32 on `gpl-3.txt` / `ulysses-1.txt`) at 4.5 bits per weight, with the
//! compensation's earlier settings (damping 0.25, no shrinkage; `crate::gptq`): weighed by the
//! probe 0.098 / 0.098; the same choice on unweighed output errors 0.119 / 0.119, no better
//! than calibrated IQ4_NL everywhere (0.118 / 0.116); the knapsack's exact optimum on
//! unweighed errors 0.215 / 0.227 (it dropped 17 `mlp.down` matrices to Q2_K to pay for a
//! Q5_0 output matrix); each matrix's error relative to its output's power 0.140 / 0.174.
//! Weighed by the probe with the current settings: 0.100 / 0.108 (docs/ACCURACY.md).

use std::collections::BTreeMap;
use std::fs::File;

use kiln_format::layout::ALIGNMENT;
use kiln_format::{DType, KilnFile, TensorInfo};
use kiln_runner::Model;

use crate::error::{QuantizeError, Result};
use crate::importance::Importance;
use crate::method::Method;
use crate::policy::{Action, Decision, Policy};
use crate::report::{advance, bits_per_weight, Progress};
use crate::sensitivity::Probe;

mod measure;

use measure::Measure;

/// Bits per weight of the rounding [`Probe`] measures each matrix at: the first candidate of
/// at least this size (Q4_0, IQ4_NL or Q4_K), near the budgets people ask for, where the
/// error is small enough that its cost grows in proportion.
pub const PROBE_BITS: f64 = 4.5;

/// The types a matrix may get, smallest first: every GGML block type Kiln writes, and F16.
pub const CANDIDATES: [DType; 12] = [
    DType::Q2_K,
    DType::Q3_K,
    DType::IQ4_XS,
    DType::Q4_0,
    DType::IQ4_NL,
    DType::Q4_K,
    DType::Q5_0,
    DType::Q5_1,
    DType::Q5_K,
    DType::Q6_K,
    DType::Q8_0,
    DType::F16,
];

/// What the file must fit.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Budget {
    /// Bits of tensor data per weight, over all tensors (what the report's bits per weight and
    /// llama.cpp's `BPW` count).
    Bpw(f64),
    /// The output file's size in bytes, metadata and index included.
    MaxBytes(u64),
}

impl std::fmt::Display for Budget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Budget::Bpw(b) => write!(f, "--bpw {b}"),
            Budget::MaxBytes(n) => write!(f, "--max-bytes {n}"),
        }
    }
}

/// One way to store a matrix: its type, its bytes and its output error.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Candidate {
    /// The block type.
    pub dtype: DType,
    /// The matrix's bytes in that type.
    pub bytes: u64,
    /// Output error (see the module documentation), in KL-divergence when the choice has a
    /// [`Choice::gain`].
    pub error: f64,
}

/// One matrix the plan chose a type for.
#[derive(Debug, Clone, PartialEq)]
pub struct Choice {
    /// Canonical tensor name.
    pub tensor: String,
    /// Its measured candidates, smallest first, those no better than a smaller one dropped.
    pub candidates: Vec<Candidate>,
    /// Index of the chosen candidate.
    pub chosen: usize,
    /// KL-divergence of the logits per unit of this matrix's output error, measured by
    /// [`Probe`] (the candidates' errors are multiplied by it); `None` when not measured.
    pub gain: Option<f64>,
}

impl Choice {
    /// The chosen candidate.
    pub fn candidate(&self) -> Candidate {
        self.candidates[self.chosen]
    }

    /// Why this type, for the report: its error, and what the next larger type would have
    /// bought.
    pub fn reason(&self) -> String {
        let c = self.candidate();
        let what = if self.gain.is_some() {
            "KL-divergence"
        } else {
            "output error"
        };
        // Errors are never negative, but an exact candidate's empty sum is -0.0.
        let mut s = format!("auto: {what} {:.3e}", c.error.abs());
        match self.candidates.get(self.chosen + 1) {
            Some(n) => {
                let _ = std::fmt::Write::write_fmt(
                    &mut s,
                    format_args!(
                        "; {} would give {:.3e} for {} more bytes",
                        n.dtype.name(),
                        n.error.abs(),
                        n.bytes - c.bytes
                    ),
                );
            }
            None => s.push_str("; the most accurate candidate"),
        }
        s
    }
}

/// The plan: a type for every matrix the policy leaves to `--to`.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// The budget asked for.
    pub budget: Budget,
    /// Tensor data bytes the budget allows.
    pub budget_bytes: u64,
    /// Tensor data bytes of the plan (at most `budget_bytes`).
    pub total_bytes: u64,
    /// Bytes of the tensors the plan does not choose (vectors, `--keep` matches, copies).
    pub fixed_bytes: u64,
    /// Elements over all tensors.
    pub elements: u64,
    /// The matrices, in file order.
    pub choices: Vec<Choice>,
    /// Calibration tokens the errors were weighed in KL-divergence on ([`Probe`]); 0 when the
    /// importance kept none (a file written before they were kept) or the model has no logits.
    pub probe_tokens: usize,
}

impl Plan {
    /// Sum of the chosen output errors (the objective).
    pub fn total_error(&self) -> f64 {
        self.choices.iter().map(|c| c.candidate().error).sum()
    }

    /// Bits of tensor data per weight.
    pub fn bits_per_weight(&self) -> f64 {
        bits_per_weight(self.total_bytes, self.elements)
    }

    /// How many matrices got each type, largest count first (`q4_k ×120, q6_k ×3`).
    pub fn summary(&self) -> String {
        let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
        for c in &self.choices {
            *counts.entry(c.candidate().dtype.name()).or_default() += 1;
        }
        let mut v: Vec<(&str, usize)> = counts.into_iter().collect();
        v.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
        v.iter()
            .map(|(d, n)| format!("{d} ×{n}"))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// `policy` with the plan's types for its matrices (`--keep` flags still win).
    pub fn apply(&self, policy: Policy) -> Policy {
        let planned = self
            .choices
            .iter()
            .map(|c| (c.tensor.clone(), (c.candidate().dtype, c.reason())))
            .collect();
        Policy { planned, ..policy }
    }
}

/// Measure every matrix's candidates and choose within `budget`.
///
/// `policy` decides which tensors are the plan's (matrices it would give `--to`; `--keep`
/// matches, vectors and copies keep its decision and count as fixed bytes); `method` and
/// `importance` are the run's, so each candidate is scored on the blocks the pipeline will
/// write. Tensors with a non-finite value are left to the pipeline, which names the value.
pub fn plan(
    path: &std::path::Path,
    policy: &Policy,
    method: Method,
    importance: &Importance,
    budget: Budget,
    progress: &dyn Progress,
) -> Result<Plan> {
    let input = KilnFile::open(path)?;
    let label = input.label().to_string();
    let tensors = input.tensors();
    policy.check_overrides(&label, tensors)?;
    let decisions = policy.decide_all(&label, tensors)?;
    let elements: u64 = tensors.iter().map(TensorInfo::numel).sum();
    let budget_bytes = match budget {
        Budget::Bpw(b) => (b * elements as f64 / 8.0).floor() as u64,
        Budget::MaxBytes(n) => n.saturating_sub(overhead(&input)),
    };
    let file = File::open(path).map_err(|e| QuantizeError::Io {
        file: label.clone(),
        action: "cannot open",
        source: e,
    })?;
    let (planned, mut fixed_bytes) = split_matrices(tensors, &decisions);
    let total: u64 = planned.iter().map(|(t, _)| t.numel()).sum();
    let model = Model::load(&input).map_err(|e| QuantizeError::Calibration {
        file: label.clone(),
        reason: e.to_string(),
    })?;
    let probe = Probe::new(
        &input,
        &model,
        &importance.probe,
        rayon::current_num_threads(),
    )?;
    let probe_tokens = probe.as_ref().map_or(0, Probe::tokens);
    progress.phase("measuring", total);
    let mut measure = Measure {
        file: &file,
        label: &label,
        method,
        importance,
        factors: BTreeMap::new(),
        probe,
    };
    let mut choices = Vec::with_capacity(planned.len());
    for (t, d) in planned {
        let (candidates, gain) = measure.candidates(t)?;
        advance(progress, t.numel())?;
        if candidates.is_empty() {
            // Rows no block fits (not a multiple of 32): the policy's own decision stands.
            fixed_bytes += d.storage.byte_len(&t.shape).unwrap_or(t.len);
            continue;
        }
        choices.push(Choice {
            tensor: t.name.clone(),
            candidates: pareto(candidates),
            chosen: 0,
            gain,
        });
    }
    let mut plan = Plan {
        budget,
        budget_bytes,
        total_bytes: 0,
        fixed_bytes,
        elements,
        choices,
        probe_tokens,
    };
    solve(&mut plan, &label)?;
    Ok(plan)
}

/// The matrices the plan chooses types for, and the bytes of every other tensor as the
/// policy stores it.
fn split_matrices<'t>(
    tensors: &'t [TensorInfo],
    decisions: &'t [Decision],
) -> (Vec<(&'t TensorInfo, &'t Decision)>, u64) {
    let mut fixed_bytes = 0u64;
    let mut planned = Vec::new();
    for (t, d) in tensors.iter().zip(decisions) {
        if d.action == Action::Convert && d.rule.starts_with("matrix") {
            planned.push((t, d));
        } else {
            fixed_bytes += d.storage.byte_len(&t.shape).unwrap_or(t.len);
        }
    }
    (planned, fixed_bytes)
}

/// An upper bound on the output's bytes outside tensor data: the input's (header, metadata,
/// index), one provenance step naming every tensor, and each tensor's alignment padding.
fn overhead(input: &KilnFile) -> u64 {
    let data: u64 = input.tensors().iter().map(|t| t.len).sum();
    let names: u64 = input
        .tensors()
        .iter()
        .map(|t| t.name.len() as u64 + 256)
        .sum();
    input.file_len().saturating_sub(data) + names + 4096 + input.tensors().len() as u64 * ALIGNMENT
}

/// Drop every candidate that is no more accurate than a smaller one (it can never be best).
fn pareto(mut c: Vec<Candidate>) -> Vec<Candidate> {
    c.sort_by(|a, b| a.bytes.cmp(&b.bytes).then(a.error.total_cmp(&b.error)));
    let mut out: Vec<Candidate> = Vec::with_capacity(c.len());
    for x in c {
        if out.last().is_none_or(|l| x.error < l.error) {
            out.push(x);
        }
    }
    out
}

/// Choose every matrix's candidate: the Lagrangian choice within the room ([`lagrangian`]),
/// greedy upgrades into what it left ([`fill`]), exchanges of bytes between two matrices
/// while one lowers the total error ([`exchange`]), and upgrades that many matrices pay for
/// ([`upgrade_many`]).
fn solve(plan: &mut Plan, label: &str) -> Result<()> {
    let room = plan.budget_bytes.checked_sub(plan.fixed_bytes);
    let smallest: u64 = plan.choices.iter().map(|c| c.candidates[0].bytes).sum();
    let room = match room {
        Some(r) if r >= smallest => r,
        _ => {
            return Err(QuantizeError::Budget {
                file: label.to_string(),
                reason: format!(
                    "{} allows {} bytes of tensor data, and the smallest file this model can \
                     make is {} bytes ({:.3} bits per weight): every matrix at its smallest \
                     type, the other tensors as the policy keeps them",
                    plan.budget,
                    plan.budget_bytes,
                    smallest + plan.fixed_bytes,
                    bits_per_weight(smallest + plan.fixed_bytes, plan.elements)
                ),
            });
        }
    };
    lagrangian(&mut plan.choices, room);
    let used = upgrade_many(&mut plan.choices, room);
    plan.total_bytes = used + plan.fixed_bytes;
    Ok(())
}

/// The candidate minimising `error + λ·bytes` (the larger one on a tie).
fn pick(c: &Choice, lambda: f64) -> usize {
    (0..c.candidates.len())
        .min_by(|&a, &b| {
            let f = |i: usize| c.candidates[i].error + lambda * c.candidates[i].bytes as f64;
            f(a).total_cmp(&f(b)).then(b.cmp(&a))
        })
        .expect("at least one candidate")
}

/// Every matrix takes the candidate minimising `error + λ·bytes`, with `λ` bisected to the
/// smallest value whose choices fit in `room` (which holds at least every smallest candidate).
/// Whatever `λ`, such a choice has the least total error of any assignment of its total size
/// or less; and it only takes points on each matrix's lower convex hull, moving every matrix
/// along its own error-per-byte curve at the same price.
fn lagrangian(choices: &mut [Choice], room: u64) {
    let bytes_at = |choices: &[Choice], lambda: f64| -> u64 {
        choices
            .iter()
            .map(|c| c.candidates[pick(c, lambda)].bytes)
            .sum()
    };
    // λ = 0 takes every matrix's most accurate type; a large enough λ its smallest.
    let lambda = if bytes_at(choices, 0.0) <= room {
        0.0
    } else {
        let mut hi = 1e-12;
        while bytes_at(choices, hi) > room && hi.is_finite() {
            hi *= 2.0;
        }
        let mut lo = hi / 2.0;
        for _ in 0..100 {
            let mid = 0.5 * (lo + hi);
            if bytes_at(choices, mid) > room {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        hi
    };
    for c in choices.iter_mut() {
        c.chosen = if lambda.is_finite() {
            pick(c, lambda)
        } else {
            0
        };
    }
    if choices.iter().map(|c| c.candidate().bytes).sum::<u64>() > room {
        for c in choices.iter_mut() {
            c.chosen = 0;
        }
    }
}

/// Spend what `room` has left on the upgrades that save the most error per byte, one at a
/// time, until none fits; returns the bytes the choices take.
fn fill(choices: &mut [Choice], room: u64) -> u64 {
    let mut used: u64 = choices.iter().map(|c| c.candidate().bytes).sum();
    loop {
        let mut best: Option<(usize, usize, f64)> = None;
        for (ci, c) in choices.iter().enumerate() {
            let cur = c.candidate();
            for (k, n) in c.candidates.iter().enumerate().skip(c.chosen + 1) {
                let extra = n.bytes - cur.bytes;
                if used + extra > room {
                    break;
                }
                let gain = (cur.error - n.error) / extra.max(1) as f64;
                if best.is_none_or(|(_, _, g)| gain > g) {
                    best = Some((ci, k, gain));
                }
            }
        }
        let Some((ci, k, _)) = best else { break };
        let c = &mut choices[ci];
        used += c.candidates[k].bytes - c.candidate().bytes;
        c.chosen = k;
    }
    used
}

/// Move bytes from one matrix to another while that lowers the total error: the best such
/// exchange (one matrix down to any smaller candidate, another up to any larger one that the
/// freed and unused bytes pay for) is made, then upgrades are filled again, until no exchange
/// helps; returns the bytes the choices take.
///
/// The Lagrangian only takes points on each matrix's lower convex hull, and the greedy fill
/// cannot give bytes back, so a type off the hull can be left out where it fits best (the
/// unit test's random plans hold such exchanges without this pass). Every exchange lowers
/// the total error, so it ends; the result can still be short of the exact optimum, which
/// may need several matrices to move at once.
fn exchange(choices: &mut [Choice], room: u64) -> u64 {
    let mut used = fill(choices, room);
    loop {
        // (down matrix, its candidate, up matrix, its candidate, error saved)
        let mut best: Option<(usize, usize, usize, usize, f64)> = None;
        for (di, d) in choices.iter().enumerate() {
            let dc = d.candidate();
            for (dk, down) in d.candidates.iter().enumerate().take(d.chosen) {
                let freed = dc.bytes - down.bytes;
                let cost = down.error - dc.error;
                let spare = room - used + freed;
                for (ui, u) in choices.iter().enumerate() {
                    if ui == di {
                        continue;
                    }
                    let uc = u.candidate();
                    for (uk, up) in u.candidates.iter().enumerate().skip(u.chosen + 1) {
                        if up.bytes - uc.bytes > spare {
                            break;
                        }
                        let saved = (uc.error - up.error) - cost;
                        // A relative margin keeps rounding noise from cycling.
                        if saved > 1e-12 * (uc.error + dc.error).abs()
                            && best.is_none_or(|b| saved > b.4)
                        {
                            best = Some((di, dk, ui, uk, saved));
                        }
                    }
                }
            }
        }
        let Some((di, dk, ui, uk, _)) = best else {
            return used;
        };
        choices[di].chosen = dk;
        choices[ui].chosen = uk;
        used = fill(choices, room);
    }
}

/// One matrix up by more bytes than are left, paid for by moving as many others down as it
/// takes, each time the step down that costs the least error per byte freed; the best such
/// move that lowers the total error is made, then upgrades are filled and exchanges tried
/// again, until no move helps. Returns the bytes the choices take.
///
/// [`exchange`] pairs one matrix with one other, so a large step of one matrix that only
/// several smaller steps of others can pay for is out of its reach: on Gemma 3 270M the tied
/// embedding's step from Q5_1 to Q8_0 costs 52 MB, more than any one other matrix can free.
/// Every move lowers the total error, so it ends.
fn upgrade_many(choices: &mut [Choice], room: u64) -> u64 {
    let mut used = exchange(choices, room);
    loop {
        // (every matrix's new choice, error saved)
        let mut best: Option<(Vec<usize>, f64)> = None;
        for (ui, u) in choices.iter().enumerate() {
            let uc = u.candidate();
            for (uk, up) in u.candidates.iter().enumerate().skip(u.chosen + 1) {
                let gain = uc.error - up.error;
                let need = (up.bytes - uc.bytes).saturating_sub(room - used);
                if need == 0 || best.as_ref().is_some_and(|b| gain <= b.1) {
                    continue;
                }
                let mut chosen: Vec<usize> = choices.iter().map(|c| c.chosen).collect();
                chosen[ui] = uk;
                let (mut freed, mut cost) = (0u64, 0.0f64);
                while freed < need && cost < gain {
                    let step = choices
                        .iter()
                        .enumerate()
                        .filter(|&(i, _)| i != ui && chosen[i] > 0)
                        .map(|(i, c)| {
                            let (a, b) = (c.candidates[chosen[i]], c.candidates[chosen[i] - 1]);
                            let bytes = a.bytes - b.bytes;
                            (i, bytes, b.error - a.error)
                        })
                        .min_by(|x, y| {
                            (x.2 / x.1.max(1) as f64).total_cmp(&(y.2 / y.1.max(1) as f64))
                        });
                    let Some((i, bytes, e)) = step else { break };
                    chosen[i] -= 1;
                    freed += bytes;
                    cost += e;
                }
                let saved = gain - cost;
                // A relative margin keeps rounding noise from cycling.
                if freed >= need
                    && saved > 1e-12 * (uc.error.abs() + cost.abs())
                    && best.as_ref().is_none_or(|b| saved > b.1)
                {
                    best = Some((chosen, saved));
                }
            }
        }
        let Some((chosen, _)) = best else {
            return used;
        };
        for (c, k) in choices.iter_mut().zip(chosen) {
            c.chosen = k;
        }
        used = exchange(choices, room);
    }
}

#[cfg(test)]
mod tests {
    use super::measure::Weight;
    use super::*;

    fn cand(dtype: DType, bytes: u64, error: f64) -> Candidate {
        Candidate {
            dtype,
            bytes,
            error,
        }
    }

    fn plan_of(choices: Vec<Vec<Candidate>>, budget_bytes: u64, fixed: u64) -> Plan {
        Plan {
            budget: Budget::MaxBytes(budget_bytes),
            budget_bytes,
            total_bytes: 0,
            fixed_bytes: fixed,
            elements: 1000,
            probe_tokens: 0,
            choices: choices
                .into_iter()
                .enumerate()
                .map(|(i, c)| Choice {
                    tensor: format!("t{i}"),
                    candidates: pareto(c),
                    chosen: 0,
                    gain: None,
                })
                .collect(),
        }
    }

    /// Every assignment of candidates, by brute force: the least total error that fits.
    fn brute_force(p: &Plan) -> f64 {
        let room = p.budget_bytes - p.fixed_bytes;
        let mut best = f64::INFINITY;
        let n = p.choices.len();
        let mut idx = vec![0usize; n];
        loop {
            let bytes: u64 = (0..n).map(|i| p.choices[i].candidates[idx[i]].bytes).sum();
            if bytes <= room {
                let e: f64 = (0..n).map(|i| p.choices[i].candidates[idx[i]].error).sum();
                best = best.min(e);
            }
            let mut k = 0;
            loop {
                if k == n {
                    return best;
                }
                idx[k] += 1;
                if idx[k] < p.choices[k].candidates.len() {
                    break;
                }
                idx[k] = 0;
                k += 1;
            }
        }
    }

    #[test]
    fn pareto_drops_candidates_no_better_than_a_smaller_one() {
        let c = pareto(vec![
            cand(DType::Q5_0, 22, 0.3),
            cand(DType::Q4_0, 18, 0.5),
            cand(DType::IQ4_NL, 18, 0.4),
            cand(DType::Q5_1, 24, 0.35),
            cand(DType::Q8_0, 34, 0.01),
        ]);
        let kept: Vec<DType> = c.iter().map(|c| c.dtype).collect();
        assert_eq!(kept, [DType::IQ4_NL, DType::Q5_0, DType::Q8_0]);
    }

    /// A reproducible stream of numbers in [0, 1) (xorshift), for random plans.
    fn uniform(mut seed: u64) -> impl FnMut() -> f64 {
        move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed % 10_000) as f64 / 10_000.0
        }
    }

    #[test]
    fn the_plan_fits_and_each_step_is_optimal_for_its_size() {
        let mut rnd = uniform(5);
        for trial in 0..40 {
            let choices: Vec<Vec<Candidate>> = (0..5)
                .map(|_| {
                    let size = 50 + (rnd() * 200.0) as u64;
                    let scale = 0.1 + rnd();
                    [(2.6, 4.0), (3.4, 2.0), (4.5, 1.0), (5.5, 0.5), (8.5, 0.05)]
                        .iter()
                        .map(|&(bpw, e)| {
                            cand(
                                DType::Q8_0,
                                (size as f64 * bpw) as u64,
                                scale * e * (0.8 + 0.4 * rnd()),
                            )
                        })
                        .collect()
                })
                .collect();
            let smallest: u64 = choices.iter().map(|c| c[0].bytes).sum();
            let largest: u64 = choices.iter().map(|c| c[4].bytes).sum();
            let budget = smallest + ((largest - smallest) as f64 * rnd()) as u64 + 7;
            let mut p = plan_of(choices, budget, 7);
            let room = budget - 7;
            // The Lagrangian choice is the best assignment of its own size or less.
            let mut lag = p.clone();
            lagrangian(&mut lag.choices, room);
            let lag_bytes: u64 = lag.choices.iter().map(|c| c.candidate().bytes).sum();
            assert!(lag_bytes <= room, "trial {trial}: over the room");
            let mut within = p.clone();
            within.budget_bytes = lag_bytes + 7;
            let best = brute_force(&within);
            assert!(
                lag.total_error() <= best + 1e-12,
                "trial {trial}: {} against the best {best} in {lag_bytes} bytes",
                lag.total_error()
            );
            // The fill only improves it, fits, and leaves no upgrade that would fit.
            solve(&mut p, "m.kiln").unwrap();
            assert!(p.total_bytes <= budget, "trial {trial}: over the budget");
            let used: u64 = p.choices.iter().map(|c| c.candidate().bytes).sum();
            assert_eq!(p.total_bytes, used + 7);
            assert!(
                p.total_error() <= lag.total_error() + 1e-12,
                "trial {trial}"
            );
            assert!(p.total_error() >= brute_force(&p) - 1e-12, "trial {trial}");
            // No exchange of bytes between two matrices would lower the error.
            for (di, d) in p.choices.iter().enumerate() {
                for down in &d.candidates[..d.chosen] {
                    for (_, u) in p.choices.iter().enumerate().filter(|&(ui, _)| ui != di) {
                        for up in &u.candidates[u.chosen + 1..] {
                            let bytes = used - d.candidate().bytes + down.bytes
                                - u.candidate().bytes
                                + up.bytes;
                            let e = p.total_error() - d.candidate().error + down.error
                                - u.candidate().error
                                + up.error;
                            assert!(
                                bytes > room || e >= p.total_error() - 1e-9,
                                "trial {trial}: {} down, {} up saves {}",
                                d.tensor,
                                u.tensor,
                                p.total_error() - e
                            );
                        }
                    }
                }
            }
            for c in &p.choices {
                if let Some(next) = c.candidates.get(c.chosen + 1) {
                    assert!(
                        used + next.bytes - c.candidate().bytes > room,
                        "trial {trial}: {} could still be upgraded",
                        c.tensor
                    );
                }
            }
        }
    }

    #[test]
    fn a_budget_below_the_smallest_file_is_refused_with_the_smallest_size() {
        let mut p = plan_of(
            vec![vec![
                cand(DType::Q4_0, 18, 0.5),
                cand(DType::Q8_0, 34, 0.01),
            ]],
            20,
            5,
        );
        let e = solve(&mut p, "m.kiln").unwrap_err().to_string();
        assert!(e.contains("m.kiln") && e.contains("23 bytes"), "{e}");
    }

    /// Plans like Gemma 3's: a few small matrices with fine steps, and one large matrix whose
    /// steps cost more than any other matrix can free (a 640-wide tied embedding: Q4_0, Q5_1,
    /// Q8_0). Exchanges between two matrices miss the best plan in many of them; with the
    /// upgrades many matrices pay for, the solver reaches it in nearly all, never worse.
    #[test]
    fn one_large_step_paid_for_by_many_matrices() {
        let mut rnd = uniform(9);
        let (mut pairwise_short, mut short) = (0, 0);
        for trial in 0..300 {
            let mut choices: Vec<Vec<Candidate>> = (0..5)
                .map(|_| {
                    let size = 20 + (rnd() * 40.0) as u64;
                    let scale = 0.01 + 0.1 * rnd();
                    [(4.5, 1.0), (5.5, 0.3), (6.5, 0.1), (8.5, 0.02), (16.0, 0.0)]
                        .iter()
                        .map(|&(bpw, e)| {
                            let err = scale * e * (0.8 + 0.4 * rnd());
                            cand(DType::Q8_0, (size as f64 * bpw) as u64, err)
                        })
                        .collect()
                })
                .collect();
            let big = 300 + (rnd() * 200.0) as u64;
            choices.push(vec![
                cand(DType::Q4_0, (big as f64 * 4.5) as u64, 0.5 + rnd()),
                cand(DType::Q5_1, (big as f64 * 6.0) as u64, 0.05 + 0.1 * rnd()),
                cand(DType::Q8_0, (big as f64 * 8.5) as u64, 0.0),
            ]);
            let smallest: u64 = choices.iter().map(|c| c[0].bytes).sum();
            let largest: u64 = choices.iter().map(|c| c[c.len() - 1].bytes).sum();
            let budget = smallest + ((largest - smallest) as f64 * rnd()) as u64 + 7;
            let p = plan_of(choices, budget, 7);
            let best = brute_force(&p);
            let mut pairwise = p.clone();
            lagrangian(&mut pairwise.choices, budget - 7);
            exchange(&mut pairwise.choices, budget - 7);
            let mut full = p.clone();
            solve(&mut full, "m.kiln").unwrap();
            assert!(full.total_bytes <= budget, "trial {trial}: over the budget");
            assert!(
                full.total_error() <= pairwise.total_error() + 1e-12,
                "trial {trial}: {} against {} without the pass",
                full.total_error(),
                pairwise.total_error()
            );
            pairwise_short += usize::from(pairwise.total_error() > best + 1e-12);
            short += usize::from(full.total_error() > best + 1e-12);
        }
        assert!(
            pairwise_short >= 30,
            "exchanges alone missed {pairwise_short}"
        );
        assert!(
            short <= 6,
            "the solver missed the best plan in {short} of 300"
        );
    }

    #[test]
    fn a_generous_budget_takes_every_most_accurate_type() {
        let mut p = plan_of(
            vec![
                vec![cand(DType::Q4_0, 18, 0.5), cand(DType::Q8_0, 34, 0.01)],
                vec![cand(DType::Q4_K, 144, 0.4), cand(DType::Q6_K, 210, 0.02)],
            ],
            10_000,
            0,
        );
        solve(&mut p, "m.kiln").unwrap();
        assert!(p.choices.iter().all(|c| c.chosen == c.candidates.len() - 1));
        assert!(p.choices[1]
            .reason()
            .contains("the most accurate candidate"));
    }

    #[test]
    fn an_exact_candidate_reads_zero() {
        // An exact rounding's error is an empty sum, which is -0.0.
        let exact = Weight::Full(&[1.0f32]).output_error(&[1.0], &[1.0], 1);
        let c = Choice {
            tensor: "m".into(),
            candidates: vec![cand(DType::Q4_0, 18, 0.5), cand(DType::Q8_0, 34, exact)],
            chosen: 0,
            gain: Some(1.0),
        };
        assert!(
            c.reason().contains("q8_0 would give 0.000e0"),
            "{}",
            c.reason()
        );
        let c = Choice { chosen: 1, ..c };
        assert!(
            c.reason().starts_with("auto: KL-divergence 0.000e0"),
            "{}",
            c.reason()
        );
    }

    #[test]
    fn output_error_weighs_by_the_input() {
        let w = [1.0f32, 1.0, 2.0, 2.0];
        let q = [1.0f32, 0.0, 2.0, 2.0];
        // The second column never carries signal: its error costs nothing.
        let h = [1.0f32, 0.0, 0.0, 0.0];
        assert_eq!(Weight::Full(&h).output_error(&w, &q, 2), 0.0);
        assert_eq!(Weight::Diagonal(&[0.0, 3.0]).output_error(&w, &q, 2), 3.0);
        // Two rows (an embedding's two tokens), one wrong by 1 in one value.
        assert_eq!(Weight::Plain.output_error(&w, &q, 2), 0.5);
        // Correlated inputs: errors that cancel through H.
        let h = [1.0f32, -1.0, -1.0, 1.0];
        let q = [2.0f32, 2.0, 2.0, 2.0];
        assert_eq!(Weight::Full(&h).output_error(&w, &q, 2), 0.0);
        let h = [2.0f32, 1.0, 1.0, 2.0];
        assert_eq!(Weight::Full(&h).output_error(&w, &q, 2), 6.0);
    }
}
