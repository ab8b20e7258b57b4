//! Throughput measurement in the manner of `llama-bench`: `ppN` runs an N-token prompt in
//! forward passes of at most `batch` tokens (512 by default, as `kiln-run generate` prefills
//! and as `llama-bench` cuts its micro-batches), `tgN` generates N tokens one forward pass at a
//! time; each test repeated, reported as
//! median and spread of tokens per second. By default both start from an empty cache; with a
//! depth D (`llama-bench -d`) they start with D tokens already in the cache (`pp512 @ d4096`),
//! which is what a long conversation or document costs: attention reads the whole cache.
//!
//! The D context tokens are run once, unmeasured, and each repetition rewinds the cache to
//! them, so a deep test costs its own tokens only.
//!
//! An [`Interrupt`] raised while it runs stops it before the next forward pass; the tests
//! already completed are returned.
//!
//! [`speculative`] measures speculative decoding (`--lookup`, `--draft`) where it means
//! something, on a real prompt's greedy continuation rather than on synthetic ids: plain and
//! speculative generation take turns, and the result carries the acceptance, the tokens per
//! pass of the model and the speedup over the plain runs.
//!
//! [`matrix_paths`] says which product ([`kiln_kernels::Path`]) each of the model's matrices
//! takes at decode and at the prefill batch size (`kiln-run bench --verbose`).

use std::time::Instant;

use kiln_kernels::{plan, Kernels, Matrix};
use serde::Serialize;

use crate::draft::Draft;
use crate::error::{Result, RunnerError};
use crate::generate::{
    generate_with_draft, raised, GenerateOptions, Generation, Interrupt, StopReason,
};
use crate::model::{Logits, Model, Session};
use crate::sampler::{Sampler, SamplerConfig};
use crate::tokenizer::Tokenizer;

/// What to measure.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BenchOptions {
    /// Prompt length for the prefill test (0: skip).
    pub prompt_tokens: usize,
    /// Tokens for the generation test (0: skip).
    pub gen_tokens: usize,
    /// Repetitions of each test.
    pub reps: usize,
    /// Run each test once, unmeasured, first (page in the weights, warm the caches).
    pub warmup: bool,
    /// Tokens already in the cache when each test starts (0: an empty cache).
    pub depth: usize,
    /// Most prompt tokens per forward pass of the prefill test.
    pub batch: usize,
    /// Checked before every forward pass: once raised, the run stops and returns the tests
    /// completed so far.
    pub interrupt: Option<Interrupt>,
}

/// One test's result.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BenchResult {
    /// `pp128`, `tg64`…
    pub test: String,
    /// Tokens per repetition.
    pub n_tokens: usize,
    /// Tokens in the cache before each repetition (`llama-bench`'s `n_depth`).
    pub n_depth: usize,
    /// Most prompt tokens per forward pass (`llama-bench`'s `n_ubatch`).
    pub n_batch: usize,
    /// Compute threads.
    pub threads: usize,
    /// Median tokens per second.
    pub tok_s: f64,
    /// Slowest repetition.
    pub tok_s_min: f64,
    /// Fastest repetition.
    pub tok_s_max: f64,
    /// Sample standard deviation over repetitions (0 for one).
    pub tok_s_stddev: f64,
    /// Every repetition, in order.
    pub samples: Vec<f64>,
    /// Speculative tests: guesses accepted over guesses made, over all repetitions.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub acceptance: Option<f64>,
    /// Speculative tests: tokens generated per pass of the model, over all repetitions.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokens_per_pass: Option<f64>,
    /// Speculative tests: the median rate over the plain runs' median, same repetitions.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub speedup: Option<f64>,
}

/// Deterministic, varied token ids (no tokenizer needed): `i·7919 + 13 mod vocab`.
fn bench_tokens(n: usize, vocab: usize) -> Vec<u32> {
    (0..n).map(|i| ((i * 7919 + 13) % vocab) as u32).collect()
}

/// `-r 0` measures nothing: bad input.
fn need_reps(opts: &BenchOptions) -> Result<()> {
    if opts.reps == 0 {
        return Err(RunnerError::InvalidArgument {
            arg: "-r",
            reason: "at least one repetition is needed".into(),
        });
    }
    Ok(())
}

/// Run the tests on `session` (its cache is reset before each repetition). When
/// `opts.interrupt` is raised, the tests completed so far (possibly none).
pub fn bench(session: &mut Session<'_>, opts: &BenchOptions) -> Result<Vec<BenchResult>> {
    need_reps(opts)?;
    if opts.batch == 0 {
        return Err(RunnerError::InvalidArgument {
            arg: "--batch-size",
            reason: "a forward pass needs at least one token".into(),
        });
    }
    let need = opts.depth + opts.prompt_tokens.max(opts.gen_tokens);
    if need > session.ctx() {
        return Err(RunnerError::ContextOverflow {
            tokens: need,
            ctx: session.ctx(),
            max_ctx: session.model().config.max_position_embeddings,
        });
    }
    let vocab = session.model().config.vocab;
    let context = bench_tokens(opts.depth, vocab);
    let suffix = if opts.depth > 0 {
        format!(" @ d{}", opts.depth)
    } else {
        String::new()
    };
    let mut results = Vec::new();
    if opts.prompt_tokens > 0 {
        let tokens = bench_tokens(opts.prompt_tokens, vocab);
        let run = |s: &mut Session<'_>| -> Result<Option<f64>> {
            if !at_depth(s, &context, opts)? {
                return Ok(None);
            }
            let t = Instant::now();
            let batches = tokens.len().div_ceil(opts.batch);
            for (i, batch) in tokens.chunks(opts.batch).enumerate() {
                if raised(opts.interrupt.as_ref()) {
                    return Ok(None);
                }
                let logits = if i + 1 == batches {
                    Logits::Last
                } else {
                    Logits::None
                };
                s.forward(batch, logits, None)?;
            }
            Ok(Some(t.elapsed().as_secs_f64()))
        };
        let test = format!("pp{}{suffix}", opts.prompt_tokens);
        match measure(session, test, opts, opts.prompt_tokens, run)? {
            Some(r) => results.push(r),
            None => {
                session.reset();
                return Ok(results);
            }
        }
    }
    if opts.gen_tokens > 0 {
        let tokens = bench_tokens(opts.gen_tokens, vocab);
        let run = |s: &mut Session<'_>| -> Result<Option<f64>> {
            if !at_depth(s, &context, opts)? {
                return Ok(None);
            }
            let t = Instant::now();
            for &id in &tokens {
                if raised(opts.interrupt.as_ref()) {
                    return Ok(None);
                }
                s.forward(&[id], Logits::Last, None)?;
            }
            Ok(Some(t.elapsed().as_secs_f64()))
        };
        let test = format!("tg{}{suffix}", opts.gen_tokens);
        results.extend(measure(session, test, opts, opts.gen_tokens, run)?);
    }
    session.reset();
    Ok(results)
}

/// Leave exactly `context` in the session's cache: rewind to it when the cache starts with it
/// (every repetition after the first) and still holds it whole, otherwise run it, unmeasured.
/// `false` when `opts.interrupt` was raised before it was done.
fn at_depth(s: &mut Session<'_>, context: &[u32], opts: &BenchOptions) -> Result<bool> {
    if s.tokens().starts_with(context) && s.rewind(context.len()) == context.len() {
        return Ok(true);
    }
    s.reset();
    // In batches, so that a deep context costs the memory of a normal prompt.
    for part in context.chunks(opts.batch) {
        if raised(opts.interrupt.as_ref()) {
            return Ok(false);
        }
        s.forward(part, Logits::None, None)?;
    }
    Ok(true)
}

fn measure(
    session: &mut Session<'_>,
    test: String,
    opts: &BenchOptions,
    n: usize,
    run: impl Fn(&mut Session<'_>) -> Result<Option<f64>>,
) -> Result<Option<BenchResult>> {
    if opts.warmup && run(session)?.is_none() {
        return Ok(None);
    }
    let mut samples = Vec::with_capacity(opts.reps);
    for _ in 0..opts.reps {
        match run(session)? {
            Some(s) => samples.push(n as f64 / s.max(1e-12)),
            None => return Ok(None),
        }
    }
    let (median, min, max, stddev) = summarize(&samples);
    Ok(Some(BenchResult {
        test,
        n_tokens: n,
        n_depth: opts.depth,
        n_batch: opts.batch,
        threads: session.threads(),
        tok_s: median,
        tok_s_min: min,
        tok_s_max: max,
        tok_s_stddev: stddev,
        samples,
        acceptance: None,
        tokens_per_pass: None,
        speedup: None,
    }))
}

/// Makes a draft for a model's session ([`crate::Session::alongside`] it).
pub type DraftMaker<'d> = dyn FnMut(&Session<'_>) -> Result<Draft<'d>> + 'd;

/// The speculative test's prompt and guesser.
pub struct SpecTest<'a, 'd> {
    /// The prompt's tokens (a rendered chat turn, or plain text).
    pub prompt: &'a [u32],
    /// The model's tokenizer.
    pub tokenizer: &'a Tokenizer,
    /// Prompt lookup's guesses per pass, when there is no draft.
    pub lookup: usize,
    /// Makes a fresh draft for each speculative run (its cache and adaptive length start
    /// anew, as for a new `generate`).
    pub draft: Option<&'a mut DraftMaker<'d>>,
    /// How the results name the speculative runs (`lookup 8`, `draft small.kiln`).
    pub label: String,
}

impl std::fmt::Debug for SpecTest<'_, '_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SpecTest")
            .field("prompt", &self.prompt.len())
            .field("lookup", &self.lookup)
            .field("draft", &self.draft.is_some())
            .field("label", &self.label)
            .finish_non_exhaustive()
    }
}

/// Greedy generation of `opts.gen_tokens` tokens at most from `test.prompt` (stopping at an
/// end-of-sequence token, as text does), plain and speculative in turn, `opts.reps` times
/// after one unmeasured pair: two results, `tgN text` and `tgN text, LABEL`, whose rates count
/// every generated token over the decode time (drafting and checking included). Fails if the
/// two ever generate different tokens. Empty when interrupted.
pub fn speculative(
    session: &mut Session<'_>,
    test: &mut SpecTest<'_, '_>,
    opts: &BenchOptions,
) -> Result<Vec<BenchResult>> {
    need_reps(opts)?;
    if opts.gen_tokens == 0 {
        return Err(RunnerError::InvalidArgument {
            arg: "-n",
            reason: "the speculative test generates tokens: give -n 1 or more".into(),
        });
    }
    let need = test.prompt.len() + opts.gen_tokens;
    if need > session.ctx() {
        return Err(RunnerError::ContextOverflow {
            tokens: need,
            ctx: session.ctx(),
            max_ctx: session.model().config.max_position_embeddings,
        });
    }
    let run = |s: &mut Session<'_>, t: &mut SpecTest<'_, '_>, spec: bool| {
        s.reset();
        let gen = GenerateOptions {
            max_tokens: opts.gen_tokens,
            ignore_eos: false,
            prefill_batch: opts.batch,
            interrupt: opts.interrupt.clone(),
            lookup: if spec { t.lookup } else { 0 },
        };
        let mut draft = match (&mut t.draft, spec) {
            (Some(make), true) => Some(make(s)?),
            _ => None,
        };
        let mut sampler = Sampler::new(SamplerConfig::default());
        let g = generate_with_draft(
            s,
            draft.as_mut(),
            t.tokenizer,
            t.prompt,
            &gen,
            &mut sampler,
            &mut |_| Ok(()),
        )?;
        Ok::<_, RunnerError>((g.stop != StopReason::Interrupted).then_some(g))
    };
    let mut plain: Vec<Generation> = Vec::with_capacity(opts.reps);
    let mut spec: Vec<Generation> = Vec::with_capacity(opts.reps);
    for rep in 0..=opts.reps {
        let (Some(a), Some(b)) = (run(session, test, false)?, run(session, test, true)?) else {
            session.reset();
            return Ok(Vec::new());
        };
        if let Some(at) = a.tokens.iter().zip(&b.tokens).position(|(x, y)| x != y) {
            return Err(RunnerError::SpeculativeMismatch {
                label: test.label.clone(),
                at,
                plain: a.tokens[at],
                speculative: b.tokens[at],
            });
        }
        if rep > 0 || !opts.warmup {
            plain.push(a);
            spec.push(b);
        }
    }
    session.reset();
    Ok(spec_results(
        opts,
        session.threads(),
        &test.label,
        &plain,
        &spec,
    ))
}

/// The two results of [`speculative`]: the plain runs' and the speculative runs' rates, the
/// latter with the guesses' acceptance, tokens per pass and the speedup.
fn spec_results(
    opts: &BenchOptions,
    threads: usize,
    label: &str,
    plain: &[Generation],
    spec: &[Generation],
) -> Vec<BenchResult> {
    let result = |name: String, runs: &[Generation]| {
        let samples: Vec<f64> = runs.iter().map(|g| g.stats.decode_tok_s()).collect();
        let (median, min, max, stddev) = summarize(&samples);
        BenchResult {
            test: name,
            n_tokens: runs.last().map_or(0, |g| g.stats.generated_tokens),
            n_depth: 0,
            n_batch: opts.batch,
            threads,
            tok_s: median,
            tok_s_min: min,
            tok_s_max: max,
            tok_s_stddev: stddev,
            samples,
            acceptance: None,
            tokens_per_pass: None,
            speedup: None,
        }
    };
    let base = format!("tg{} text", opts.gen_tokens);
    let p = result(base.clone(), plain);
    let mut s = result(format!("{base}, {label}"), spec);
    let sum = |f: fn(&Generation) -> usize| spec.iter().map(f).sum::<usize>() as f64;
    let drafted = sum(|g| g.stats.drafted_tokens);
    s.acceptance = Some(if drafted > 0.0 {
        sum(|g| g.stats.accepted_tokens) / drafted
    } else {
        0.0
    });
    s.tokens_per_pass =
        Some(sum(|g| g.stats.decoded_tokens) / sum(|g| g.stats.decode_steps).max(1.0));
    s.speedup = Some(s.tok_s / p.tok_s.max(1e-12));
    vec![p, s]
}

/// The matrices of one shape and encoding in a model, and the path
/// ([`kiln_kernels::plan`]) they take.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MatrixPath {
    /// The roles of the matrices of this kind (`q`, `gate`, `output`…), in the order met.
    pub roles: Vec<&'static str>,
    /// How many matrices of the model are of this kind.
    pub count: usize,
    /// Output rows.
    pub rows: usize,
    /// Input columns.
    pub cols: usize,
    /// The encoding (`q4_0`, `f16`…).
    pub dtype: &'static str,
    /// The path for one token (decode).
    pub decode: String,
    /// Tokens per product at prefill: the batch size, except for the output matrix, which
    /// only the last token of a prompt goes through.
    pub prefill_tokens: usize,
    /// The path for those tokens.
    pub prefill: String,
}

/// The paths the model's matrices take through `kernels`: at decode (one token) and at a
/// prefill of `prefill_tokens` tokens a forward pass, one entry per distinct (roles' shape,
/// encoding, paths), in the order of a forward pass.
pub fn matrix_paths(
    model: &Model<'_>,
    kernels: &Kernels,
    prefill_tokens: usize,
) -> Vec<MatrixPath> {
    let w = &model.weights;
    let mut all: Vec<(&'static str, &Matrix, usize)> = Vec::new();
    for l in &w.layers {
        let gate = l.gate.as_ref().map(|g| ("gate", g));
        for (role, m) in [
            ("q", &l.q),
            ("k", &l.k),
            ("v", &l.v),
            ("o", &l.o),
            ("up", &l.up),
            ("down", &l.down),
        ]
        .into_iter()
        .chain(gate)
        {
            all.push((role, m, prefill_tokens));
        }
    }
    // The prompt's logits are the last token's only (`Logits::Last`).
    all.push(("output", w.output(), 1.min(prefill_tokens)));
    let mut out: Vec<MatrixPath> = Vec::new();
    for (role, m, n) in all {
        let entry = MatrixPath {
            roles: vec![role],
            count: 1,
            rows: m.rows,
            cols: m.cols,
            dtype: m.data.dtype_name(),
            decode: plan(kernels, m, 1).to_string(),
            prefill_tokens: n,
            prefill: plan(kernels, m, n).to_string(),
        };
        let same = |e: &MatrixPath| {
            (
                e.rows,
                e.cols,
                e.dtype,
                &e.decode,
                e.prefill_tokens,
                &e.prefill,
            ) == (
                entry.rows,
                entry.cols,
                entry.dtype,
                &entry.decode,
                entry.prefill_tokens,
                &entry.prefill,
            )
        };
        match out.iter_mut().find(|e| same(e)) {
            Some(e) => {
                e.count += 1;
                if !e.roles.contains(&role) {
                    e.roles.push(role);
                }
            }
            None => out.push(entry),
        }
    }
    out
}

/// Median, min, max and sample standard deviation.
pub fn summarize(xs: &[f64]) -> (f64, f64, f64, f64) {
    let mut s = xs.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    let median = if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    };
    let mean = s.iter().sum::<f64>() / n as f64;
    let var = if n > 1 {
        s.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1) as f64
    } else {
        0.0
    };
    (median, s[0], s[n - 1], var.sqrt())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summary_statistics() {
        let (med, min, max, sd) = summarize(&[3.0, 1.0, 2.0]);
        assert_eq!((med, min, max), (2.0, 1.0, 3.0));
        assert!((sd - 1.0).abs() < 1e-12);
        assert_eq!(summarize(&[4.0, 1.0, 2.0, 3.0]).0, 2.5);
        assert_eq!(summarize(&[5.0]).3, 0.0);
    }
}
