//! `kiln-verify perplexity`: llama.cpp's `llama-perplexity` protocol, so figures compare.
//!
//! The text is tokenized once (BOS added only if the model's tokenizer adds it), cut into
//! non-overlapping chunks of `ctx` tokens (at least two chunks' worth of text is required, as
//! llama.cpp requires), each chunk is run from an empty cache (its first token replaced by BOS
//! when the tokenizer adds one) and scored on its second half: positions `ctx/2 .. ctx-1`
//! predict the next token. Perplexity = exp(mean negative log-likelihood over all scored
//! tokens). With a base model's saved log-probabilities, the same positions also give the
//! mean KL-divergence KL(base ‖ model) and the fraction whose top token agrees.

use std::path::Path;
use std::time::Instant;

use half::f16;
use kiln_format::KilnFile;
use kiln_runner::{CacheType, Logits, Model, Tokenizer};
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use serde::Serialize;

use crate::error::{Result, VerifyError};
use crate::metrics::{argmax, kl_divergence, log_softmax};

/// What to measure.
#[derive(Debug, Clone)]
pub struct PerplexityOptions {
    /// Tokens per chunk (`-c`).
    pub ctx: usize,
    /// Use at most this many chunks.
    pub chunks: Option<usize>,
    /// Worker threads.
    pub threads: usize,
    /// How the KV cache stores keys and values (f32 unless measuring a cache type's cost).
    pub cache_type: CacheType,
}

/// Largest saved-logits file read (it is read whole): 4096 chunks of 512 positions at a
/// 256k vocabulary in f16 is about 270 GB; the limit only keeps an absurd size from being tried.
const MAX_LOGITS_BYTES: u64 = 1 << 40;

/// Running figures, reported after every chunk.
pub trait PerplexityProgress {
    /// `done` of `total` chunks, with the estimate so far.
    fn chunk(&self, _done: usize, _total: usize, _ppl: f64) {}
}

impl PerplexityProgress for () {}

/// Per-position log-probabilities of the scored tokens, for `--save-logits`/`--kl-base`.
#[derive(Debug, Clone)]
pub struct ScoredLogits {
    /// The token ids the chunks were made from (after BOS substitution).
    pub tokens: Vec<u32>,
    /// Tokens per chunk.
    pub ctx: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// One `(ctx - 1 - ctx/2) × vocab` block of log-probabilities per chunk, as f16.
    pub chunks: Vec<Vec<f16>>,
}

/// The result.
#[derive(Debug, Clone, Serialize)]
pub struct PerplexityReport {
    pub model: String,
    pub text: String,
    pub ctx: usize,
    /// The KV cache's encoding.
    pub cache_type: &'static str,
    pub chunks: usize,
    pub tokens_scored: usize,
    /// exp(mean NLL).
    pub ppl: f64,
    /// Standard error of the perplexity (delta method on the NLL's standard error).
    pub ppl_stderr: f64,
    /// Mean KL(base ‖ model), with `--kl-base`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kld_mean: Option<f64>,
    /// Fraction of scored positions whose top token equals the base model's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub same_top_p: Option<f64>,
    /// Perplexity of the base model's saved log-probabilities over the same scored tokens,
    /// with `--kl-base`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub base_ppl: Option<f64>,
    /// Scored tokens per second.
    pub tok_s: f64,
    /// Figures of each chunk, in text order.
    pub per_chunk: Vec<ChunkFigures>,
    /// KL(base ‖ model) of every scored position, in order (empty without `--kl-base`).
    #[serde(skip)]
    pub kld_positions: Vec<f32>,
    /// Pass/fail limits checked on this report ([`check_gates`]).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub gates: Vec<Gate>,
}

/// One chunk's figures.
#[derive(Debug, Clone, Serialize)]
pub struct ChunkFigures {
    /// exp(mean NLL) over this chunk's scored tokens.
    pub ppl: f64,
    /// Mean KL(base ‖ model) over this chunk's scored tokens, with `--kl-base`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kld_mean: Option<f64>,
    /// Wall time of the chunk's forward pass and scoring.
    pub seconds: f64,
}

/// A limit on one perplexity figure.
#[derive(Debug, Clone, Serialize)]
pub struct Gate {
    /// The command-line option that set it (`--max-kld`, `--max-ppl-ratio`).
    pub name: &'static str,
    /// The figure measured.
    pub measured: f64,
    /// The largest value allowed.
    pub allowed: f64,
    /// `measured <= allowed`.
    pub pass: bool,
}

impl Gate {
    fn new(name: &'static str, measured: f64, allowed: f64) -> Gate {
        Gate {
            name,
            measured,
            allowed,
            // NaN never passes.
            pass: measured <= allowed,
        }
    }

    /// "mean KL-divergence 0.0123 is over the allowed 0.01 by 0.0023".
    pub fn describe(&self) -> String {
        let what = match self.name {
            "--max-kld" => "mean KL-divergence",
            "--max-ppl-ratio" => "perplexity ratio (this model / base)",
            n => n,
        };
        if self.pass {
            format!(
                "{what} {:.6} is within the allowed {} ({})",
                self.measured, self.allowed, self.name
            )
        } else {
            format!(
                "{what} {:.6} is over the allowed {} by {:.6} ({})",
                self.measured,
                self.allowed,
                self.measured - self.allowed,
                self.name
            )
        }
    }
}

/// Check `--max-kld` and `--max-ppl-ratio` on a report made with a base (`--kl-base`); either
/// limit without base figures in the report is a usage error.
pub fn check_gates(
    r: &PerplexityReport,
    max_kld: Option<f64>,
    max_ppl_ratio: Option<f64>,
) -> Result<Vec<Gate>> {
    let need = |opt: &str| {
        VerifyError::Usage(format!(
            "{opt} compares with a base model: pass --kl-base FILE (saved by --save-logits)"
        ))
    };
    let mut gates = Vec::new();
    if let Some(max) = max_kld {
        let k = r.kld_mean.ok_or_else(|| need("--max-kld"))?;
        gates.push(Gate::new("--max-kld", k, max));
    }
    if let Some(max) = max_ppl_ratio {
        let b = r.base_ppl.ok_or_else(|| need("--max-ppl-ratio"))?;
        gates.push(Gate::new("--max-ppl-ratio", r.ppl / b, max));
    }
    Ok(gates)
}

/// Measure perplexity of `file` on `text`; optionally keep the scored log-probabilities and
/// compare with a base model's.
pub fn perplexity(
    file: &KilnFile,
    text_path: &Path,
    text: &str,
    opts: &PerplexityOptions,
    base: Option<&ScoredLogits>,
    keep: bool,
    progress: &dyn PerplexityProgress,
) -> Result<(PerplexityReport, Option<ScoredLogits>)> {
    let tok = Tokenizer::from_file(file)?;
    let tokens = tok.encode(text)?;
    perplexity_tokens(file, text_path, tokens, opts, base, keep, progress)
}

/// [`perplexity`] over text already tokenized with `file`'s tokenizer (for a text file read in
/// bounded memory by [`kiln_runner::text_file::tokenize_file`]).
pub fn perplexity_tokens(
    file: &KilnFile,
    text_path: &Path,
    tokens: Vec<u32>,
    opts: &PerplexityOptions,
    base: Option<&ScoredLogits>,
    keep: bool,
    progress: &dyn PerplexityProgress,
) -> Result<(PerplexityReport, Option<ScoredLogits>)> {
    let ctx = opts.ctx;
    if ctx < 8 {
        return Err(VerifyError::Usage(format!(
            "-c {ctx}: the context must be at least 8 tokens"
        )));
    }
    let model = Model::load(file)?;
    let bos = file.metadata().config.bos_token_id;
    let (tokens, n_chunks) = chunk_tokens(text_path, tokens, opts, bos)?;
    let vocab = model.config.vocab;
    let first = ctx / 2;
    let scored_per_chunk = ctx - 1 - first;
    if let Some(b) = base {
        check_base(b, ctx, vocab, &tokens)?;
    }
    let mut session = model.session_with(ctx, opts.threads, opts.cache_type)?;
    let start = Instant::now();
    let mut sums = Sums::default();
    let mut kept = Vec::new();
    let mut logp = vec![0f32; vocab];
    for c in 0..n_chunks {
        let chunk_start = Instant::now();
        let (chunk_nll, chunk_kl) = (sums.nll, sums.kl);
        session.reset();
        let chunk = &tokens[c * ctx..(c + 1) * ctx];
        let logits = session.forward(chunk, Logits::All, None)?;
        let mut block = if keep {
            Vec::with_capacity(scored_per_chunk * vocab)
        } else {
            Vec::new()
        };
        for (k, j) in (first..ctx - 1).enumerate() {
            let row = &logits[j * vocab..(j + 1) * vocab];
            log_softmax(row, &mut logp);
            let base_row = base.map(|b| &b.chunks[c][k * vocab..(k + 1) * vocab]);
            sums.add(&logp, chunk[j + 1] as usize, base_row);
            if keep {
                block.extend(logp.iter().map(|&v| f16::from_f32(v)));
            }
        }
        if keep {
            kept.push(block);
        }
        sums.per_chunk.push(ChunkFigures {
            ppl: ((sums.nll - chunk_nll) / scored_per_chunk as f64).exp(),
            kld_mean: base.map(|_| (sums.kl - chunk_kl) / scored_per_chunk as f64),
            seconds: chunk_start.elapsed().as_secs_f64(),
        });
        progress.chunk(c + 1, n_chunks, (sums.nll / sums.count as f64).exp());
    }
    let seconds = start.elapsed().as_secs_f64();
    let report = sums.report(file, text_path, opts, seconds, base.is_some());
    let kept = keep.then_some(ScoredLogits {
        tokens,
        ctx,
        vocab,
        chunks: kept,
    });
    Ok((report, kept))
}

/// The tokens cut to whole chunks of `-c` (at most `--chunks`, at least two needed), each
/// chunk starting with BOS when the text does; returns them and the chunk count.
fn chunk_tokens(
    text_path: &Path,
    mut tokens: Vec<u32>,
    opts: &PerplexityOptions,
    bos: Option<u32>,
) -> Result<(Vec<u32>, usize)> {
    let ctx = opts.ctx;
    let add_bos = bos.is_some() && tokens.first().copied() == bos;
    if tokens.len() < 2 * ctx {
        return Err(VerifyError::Text {
            path: text_path.display().to_string(),
            reason: format!(
                "{} tokens is too short: perplexity with -c {ctx} needs at least {} (two chunks)",
                tokens.len(),
                2 * ctx
            ),
        });
    }
    let mut n_chunks = tokens.len() / ctx;
    if let Some(c) = opts.chunks {
        n_chunks = n_chunks.min(c.max(1));
    }
    tokens.truncate(n_chunks * ctx);
    if add_bos {
        for c in 0..n_chunks {
            tokens[c * ctx] = bos.expect("add_bos implies bos");
        }
    }
    Ok((tokens, n_chunks))
}

/// The base's saved logits were made with the same `-c`, vocabulary and tokens.
fn check_base(b: &ScoredLogits, ctx: usize, vocab: usize, tokens: &[u32]) -> Result<()> {
    if b.ctx != ctx
        || b.vocab != vocab
        || b.tokens.len() < tokens.len()
        || b.tokens[..tokens.len()] != tokens[..]
    {
        return Err(VerifyError::BadLogits {
            path: "--kl-base".into(),
            reason: format!(
                "the base logits were made with -c {} on {} tokens (vocab {}); this run uses -c {ctx} on {} tokens (vocab {vocab}) of a different tokenization — use the same text, -c and tokenizer",
                b.ctx, b.tokens.len(), b.vocab, tokens.len()
            ),
        });
    }
    Ok(())
}

/// Running sums over the scored positions, in text order.
#[derive(Default)]
struct Sums {
    /// Negative log-likelihood, and its square.
    nll: f64,
    nll2: f64,
    /// Positions scored.
    count: usize,
    /// KL(base ‖ model), with a base.
    kl: f64,
    /// Positions whose top token is the base's.
    same: usize,
    /// The base's negative log-likelihood.
    base_nll: f64,
    kld_positions: Vec<f32>,
    per_chunk: Vec<ChunkFigures>,
}

impl Sums {
    /// Score one position: this model's log-probabilities `logp`, the token that follows,
    /// and the base's saved log-probabilities when comparing.
    fn add(&mut self, logp: &[f32], next: usize, base_row: Option<&[f16]>) {
        let nll = -(logp[next] as f64);
        self.nll += nll;
        self.nll2 += nll * nll;
        self.count += 1;
        if let Some(brow) = base_row {
            let blogp: Vec<f32> = brow.iter().map(|v| v.to_f32()).collect();
            let kl = kl_divergence(&blogp, logp);
            self.kl += kl;
            self.kld_positions.push(kl as f32);
            self.same += usize::from(argmax(&blogp) == argmax(logp));
            self.base_nll -= blogp[next] as f64;
        }
    }

    /// The report of a run over `self.per_chunk.len()` chunks that took `seconds`.
    fn report(
        self,
        file: &KilnFile,
        text_path: &Path,
        opts: &PerplexityOptions,
        seconds: f64,
        has_base: bool,
    ) -> PerplexityReport {
        let count = self.count;
        let n_chunks = self.per_chunk.len();
        let mean = self.nll / count as f64;
        let var = (self.nll2 / count as f64 - mean * mean).max(0.0);
        let nll_se = (var / (count as f64 - 1.0).max(1.0)).sqrt();
        let ppl = mean.exp();
        PerplexityReport {
            model: file.label().to_string(),
            text: text_path.display().to_string(),
            ctx: opts.ctx,
            cache_type: opts.cache_type.name(),
            chunks: n_chunks,
            tokens_scored: count,
            ppl,
            ppl_stderr: ppl * nll_se,
            kld_mean: has_base.then(|| self.kl / count as f64),
            same_top_p: has_base.then(|| self.same as f64 / count as f64),
            base_ppl: has_base.then(|| (self.base_nll / count as f64).exp()),
            tok_s: (n_chunks * opts.ctx) as f64 / seconds,
            per_chunk: self.per_chunk,
            kld_positions: self.kld_positions,
            gates: Vec::new(),
        }
    }
}

impl ScoredLogits {
    /// Write as safetensors: `tokens` (i32 `[n]`) and `chunk.N` (f16 `[scored, vocab]`).
    pub fn save(&self, path: &Path, overwrite: bool) -> Result<()> {
        let tokens: Vec<u8> = self
            .tokens
            .iter()
            .flat_map(|&t| (t as i32).to_le_bytes())
            .collect();
        let chunk_bytes: Vec<Vec<u8>> = self.chunks.iter().map(|c| bytemuck_f16(c)).collect();
        let scored = self.ctx - 1 - self.ctx / 2;
        let mut views = vec![(
            "tokens".to_string(),
            TensorView::new(Dtype::I32, vec![self.tokens.len()], &tokens).expect("sized"),
        )];
        for (i, b) in chunk_bytes.iter().enumerate() {
            views.push((
                format!("chunk.{i}"),
                TensorView::new(Dtype::F16, vec![scored, self.vocab], b).expect("sized"),
            ));
        }
        let meta = std::collections::HashMap::from([
            ("ctx".to_string(), self.ctx.to_string()),
            ("vocab".to_string(), self.vocab.to_string()),
            (
                "content".to_string(),
                "kiln-verify scored log-probabilities".to_string(),
            ),
        ]);
        let bytes = safetensors::tensor::serialize(views, Some(meta)).map_err(|e| {
            VerifyError::BadLogits {
                path: path.display().to_string(),
                reason: format!("cannot write: {e}"),
            }
        })?;
        // Atomically (temporary file, fsync, rename); an existing file only with `overwrite`.
        kiln_format::write_file_atomic(path, &bytes, overwrite).map_err(VerifyError::Format)
    }

    /// Read a file written by [`ScoredLogits::save`], checking every field.
    pub fn load(path: &Path) -> Result<ScoredLogits> {
        let bad = |reason: String| VerifyError::BadLogits {
            path: path.display().to_string(),
            reason,
        };
        // A regular file only (`/dev/zero` or a FIFO is refused at once), read whole.
        let bytes = kiln_format::read_bounded(path, MAX_LOGITS_BYTES, "saved logits file")?;
        let (_, meta) = SafeTensors::read_metadata(&bytes)
            .map_err(|e| bad(format!("not a safetensors file: {e}")))?;
        let st = SafeTensors::deserialize(&bytes)
            .map_err(|e| bad(format!("not a safetensors file: {e}")))?;
        let m = meta.metadata().clone().unwrap_or_default();
        let num = |k: &str| -> Result<usize> {
            m.get(k).and_then(|v| v.parse().ok()).ok_or_else(|| {
                bad(format!(
                    "metadata `{k}` is missing; was this written by kiln-verify --save-logits?"
                ))
            })
        };
        let (ctx, vocab) = (num("ctx")?, num("vocab")?);
        if ctx < 8 {
            return Err(bad(format!("ctx {ctx} is too small")));
        }
        let t = st
            .tensor("tokens")
            .map_err(|_| bad("no `tokens` tensor".into()))?;
        if t.dtype() != Dtype::I32 {
            return Err(bad("`tokens` must be I32".into()));
        }
        let tokens: Vec<u32> = t
            .data()
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes(c.try_into().expect("4")) as u32)
            .collect();
        let n_chunks = tokens.len() / ctx;
        let scored = ctx - 1 - ctx / 2;
        let mut chunks = Vec::with_capacity(n_chunks);
        for i in 0..n_chunks {
            let v = st
                .tensor(&format!("chunk.{i}"))
                .map_err(|_| bad(format!("no `chunk.{i}` tensor")))?;
            if v.dtype() != Dtype::F16 || v.shape() != [scored, vocab] {
                return Err(bad(format!(
                    "`chunk.{i}` is {:?} {:?}, expected F16 [{scored}, {vocab}]",
                    v.dtype(),
                    v.shape()
                )));
            }
            let values: Vec<f16> = v
                .data()
                .chunks_exact(2)
                .map(|c| f16::from_le_bytes([c[0], c[1]]))
                .collect();
            // A log-probability may be -inf (a token the base ruled out), never NaN or +inf.
            if let Some(p) = values
                .iter()
                .position(|x| x.is_nan() || *x == f16::INFINITY)
            {
                return Err(bad(format!(
                    "`chunk.{i}` element {p} is {}, not a log-probability; save the logits \
                     again",
                    values[p]
                )));
            }
            chunks.push(values);
        }
        Ok(ScoredLogits {
            tokens,
            ctx,
            vocab,
            chunks,
        })
    }
}

fn bytemuck_f16(v: &[f16]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(kld: Option<f64>, base_ppl: Option<f64>) -> PerplexityReport {
        PerplexityReport {
            model: "m.kiln".into(),
            text: "t.txt".into(),
            ctx: 64,
            cache_type: "f32",
            chunks: 1,
            tokens_scored: 31,
            ppl: 12.0,
            ppl_stderr: 0.5,
            kld_mean: kld,
            same_top_p: kld.map(|_| 0.9),
            base_ppl,
            tok_s: 1.0,
            per_chunk: Vec::new(),
            kld_positions: Vec::new(),
            gates: Vec::new(),
        }
    }

    #[test]
    fn gates_pass_at_their_limit_and_say_by_how_much_they_fail() {
        let r = report(Some(0.02), Some(10.0));
        // (max KLD, max ratio, KLD passes, ratio passes); the ratio is 12 / 10 = 1.2.
        let table = [
            (0.02, 1.2, true, true),
            (0.019, 1.19, false, false),
            (1.0, 2.0, true, true),
            (0.0, 1.0, false, false),
        ];
        for (kld, ratio, kld_pass, ratio_pass) in table {
            let g = check_gates(&r, Some(kld), Some(ratio)).unwrap();
            assert_eq!(g.len(), 2);
            assert_eq!((g[0].name, g[0].pass), ("--max-kld", kld_pass), "{kld}");
            assert_eq!(
                (g[1].name, g[1].pass),
                ("--max-ppl-ratio", ratio_pass),
                "{ratio}"
            );
        }
        let g = check_gates(&r, Some(0.01), None).unwrap();
        assert_eq!(
            g[0].describe(),
            "mean KL-divergence 0.020000 is over the allowed 0.01 by 0.010000 (--max-kld)"
        );
        assert!(check_gates(&r, None, None).unwrap().is_empty());
    }

    #[test]
    fn a_not_a_number_figure_never_passes_a_gate() {
        let r = report(Some(f64::NAN), Some(f64::NAN));
        let g = check_gates(&r, Some(f64::MAX), Some(f64::MAX)).unwrap();
        assert!(g.iter().all(|g| !g.pass));
    }

    #[test]
    fn a_gate_without_base_figures_is_a_usage_error_naming_kl_base() {
        let r = report(None, None);
        for (kld, ratio, opt) in [
            (Some(0.1), None, "--max-kld"),
            (None, Some(1.1), "--max-ppl-ratio"),
        ] {
            let e = check_gates(&r, kld, ratio).unwrap_err();
            assert!(matches!(e, VerifyError::Usage(_)));
            let e = e.to_string();
            assert!(e.contains(opt) && e.contains("--kl-base"), "{e}");
        }
    }
}
