//! `kiln-run bench`: prefill (ppN) and decode (tgN) throughput, like llama-bench, and with
//! `--lookup` or `--draft` the speculative test, as a table or JSON.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::Args;
use kiln_format::KilnFile;
use kiln_runner::bench::{
    bench, matrix_paths, speculative as speculative_test, BenchOptions, BenchResult, DraftMaker,
    MatrixPath, SpecTest,
};
use kiln_runner::generate::DEFAULT_PREFILL_BATCH;
use kiln_runner::threads::physical_cores;
use kiln_runner::{
    open_model_verified, CacheType, Conversation, Interrupt, Result, RunnerError, Session,
    Tokenizer,
};

use super::args::SpeculativeArgs;
use super::common::{
    isolated_template, load, make_draft, open_draft, prompt_text, sliding, threads_arg,
    weight_summary, Loaded,
};

#[derive(Debug, Args)]
pub struct BenchArgs {
    /// The .kiln model.
    pub model: PathBuf,
    /// Prompt tokens for the prefill test (0: skip).
    #[arg(short = 'p', long = "n-prompt", default_value_t = 128, allow_negative_numbers = true,
          value_parser = kiln_format::args::at_least::<usize>(0))]
    pub n_prompt: usize,
    /// Tokens for the generation test (0: skip).
    #[arg(short = 'n', long = "n-gen", default_value_t = 64, allow_negative_numbers = true,
          value_parser = kiln_format::args::at_least::<usize>(0))]
    pub n_gen: usize,
    /// Repetitions of each test.
    #[arg(short = 'r', long, default_value_t = 3, allow_negative_numbers = true,
          value_parser = kiln_format::args::at_least::<usize>(1))]
    pub repetitions: usize,
    /// Thread counts to test, comma-separated [default: physical cores].
    #[arg(short = 't', long, value_delimiter = ',', allow_negative_numbers = true,
          value_parser = kiln_format::args::at_least::<usize>(1))]
    pub threads: Vec<usize>,
    /// Tokens already in the KV cache when each test starts, comma-separated (like
    /// llama-bench -d): `pp512 @ d4096` is a 512-token prompt after 4096 cached tokens.
    #[arg(short = 'd', long, value_delimiter = ',', default_value = "0",
          allow_negative_numbers = true, value_parser = kiln_format::args::at_least::<usize>(0))]
    pub depth: Vec<usize>,
    /// Most prompt tokens per forward pass (like llama-bench -ub): a longer prompt is run in
    /// batches of this size, as `generate` and `chat` run it.
    #[arg(short = 'b', long = "batch-size", default_value_t = DEFAULT_PREFILL_BATCH,
          allow_negative_numbers = true, value_parser = kiln_format::args::at_least::<usize>(1))]
    pub batch_size: usize,
    /// How the KV cache stores keys and values: f16 (half of f32's memory and reads), q8_0
    /// (GGML's blocks, about a quarter; heads must be a multiple of 32 wide) or f32 (exact).
    #[arg(long = "cache-type", default_value_t = CacheType::F16)]
    pub cache_type: CacheType,
    /// Keep every position of sliding-window layers in the KV cache, as full-attention layers
    /// do, instead of a ring of `window - 1 + 512` positions: more memory, but any rewind
    /// (a chat reusing an earlier turn) keeps its whole prefix instead of recomputing it.
    #[arg(long)]
    pub swa_full: bool,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Also print the product each distinct matrix (shape, encoding) takes at decode (one
    /// token) and at the prefill batch (`min(-p, -b)` tokens): tiles, lanes, k-lanes…
    #[arg(short = 'v', long)]
    pub verbose: bool,
    /// Skip checking every tensor's sha256, and every value for NaN and infinity, before
    /// running.
    #[arg(long)]
    pub no_verify: bool,
    /// With --lookup or --draft: a text prompt whose greedy continuation (-n tokens at most)
    /// is generated plainly and speculatively in turn, reporting both rates, the guesses'
    /// acceptance, tokens per pass and the speedup.
    #[arg(short = 'f', long, value_name = "FILE")]
    pub file: Option<PathBuf>,
    /// Render -f's text as a user turn through the model's chat template.
    #[arg(long, requires = "file")]
    pub chat: bool,
    #[command(flatten)]
    pub speculative: SpeculativeArgs,
}

pub fn run(a: BenchArgs, interrupt: &Interrupt) -> Result<()> {
    let threads = thread_counts(&a.threads)?;
    let speculative = check_speculative(&a)?;
    let t0 = Instant::now();
    let file = open_model_verified(&a.model, !a.no_verify)?;
    let loaded = load(&file)?;
    let model = &loaded.model;
    let load_ms = t0.elapsed().as_secs_f64() * 1e3;
    let prompt: Vec<u32> = match &a.file {
        Some(f) => spec_prompt(f, a.chat, &file, &loaded.tokenizer)?,
        None => Vec::new(),
    };
    let draft_file = open_draft(&a.speculative, a.no_verify)?;
    let draft_loaded = draft_file.as_ref().map(load).transpose()?;
    let ctx = context(&a, prompt.len())?;
    // The deepest test's context, weighed before any session builds it.
    model.check_context(ctx, a.cache_type, sliding(a.swa_full), "--depth")?;
    let mut results: Vec<BenchResult> = Vec::new();
    'threads: for &t in &threads {
        let mut sess = model.session_sliding(ctx, t, a.cache_type, sliding(a.swa_full))?;
        for &depth in &a.depth {
            let opts = options(&a, a.n_prompt, depth, interrupt);
            results.extend(bench(&mut sess, &opts)?);
            // Interrupted: report the tests measured so far.
            if interrupt.is_raised() {
                break 'threads;
            }
        }
        if speculative {
            let spec = Speculative {
                a: &a,
                loaded: &loaded,
                draft: draft_loaded.as_ref(),
                prompt: &prompt,
            };
            results.extend(spec.run(&mut sess, interrupt)?);
            if interrupt.is_raised() {
                break 'threads;
            }
        }
    }
    let paths = a.verbose.then(|| {
        let prefill = a.n_prompt.min(a.batch_size).max(1);
        matrix_paths(model, kiln_kernels::active(), prefill)
    });
    let report = Report {
        a: &a,
        file: &file,
        weights: weight_summary(&file),
        load_ms,
        results: &results,
        paths: paths.as_deref(),
    };
    if a.json {
        report.json()
    } else {
        report.tables()
    }
}

/// The `-t` thread counts, each checked as `--threads` is [default: physical cores].
fn thread_counts(threads: &[usize]) -> Result<Vec<usize>> {
    if threads.is_empty() {
        return Ok(vec![physical_cores()]);
    }
    threads.iter().map(|&t| threads_arg(Some(t))).collect()
}

/// Whether the speculative test runs: it needs both `-f` and `--lookup` or `--draft`.
fn check_speculative(a: &BenchArgs) -> Result<bool> {
    let speculative = a.speculative.lookup > 0 || a.speculative.draft.is_some();
    if speculative != a.file.is_some() {
        return Err(RunnerError::InvalidArgument {
            arg: if speculative {
                "--lookup/--draft"
            } else {
                "-f"
            },
            reason: "the speculative test needs both a text prompt (-f FILE) and a way to \
                     guess (--lookup N or --draft DRAFT.kiln)"
                .into(),
        });
    }
    Ok(speculative)
}

/// The speculative test's prompt: `-f`'s text, as a user turn of the chat template with
/// `--chat`.
fn spec_prompt(f: &Path, chat: bool, file: &KilnFile, tokenizer: &Tokenizer) -> Result<Vec<u32>> {
    let text = prompt_text(None, Some(f))?;
    let ids = if chat {
        let template = isolated_template(file)?;
        let rendered = Conversation::new(&template, None).prompt_for(&text)?;
        tokenizer.encode_rendered(&rendered)?
    } else {
        tokenizer.encode(&text)?
    };
    if ids.is_empty() {
        return Err(RunnerError::EmptyPrompt);
    }
    Ok(ids)
}

/// The context every test fits in: the deepest depth and the longest test, or the
/// speculative test's prompt and output.
fn context(a: &BenchArgs, prompt_len: usize) -> Result<usize> {
    let depth_max = a.depth.iter().copied().max().unwrap_or(0);
    Ok(depth_max
        .checked_add(a.n_prompt.max(a.n_gen).max(1))
        .ok_or(RunnerError::InvalidArgument {
            arg: "--depth",
            reason: "too large".into(),
        })?
        .max(prompt_len.saturating_add(a.n_gen)))
}

/// One test's options: `prompt_tokens` after `depth` cached tokens, then `-n` generated.
fn options(
    a: &BenchArgs,
    prompt_tokens: usize,
    depth: usize,
    interrupt: &Interrupt,
) -> BenchOptions {
    BenchOptions {
        prompt_tokens,
        gen_tokens: a.n_gen,
        reps: a.repetitions,
        warmup: true,
        depth,
        batch: a.batch_size,
        interrupt: Some(interrupt.clone()),
    }
}

/// The speculative test: the prompt's greedy continuation, plainly and with guesses.
struct Speculative<'a, 'f> {
    a: &'a BenchArgs,
    loaded: &'a Loaded<'f>,
    draft: Option<&'a Loaded<'a>>,
    prompt: &'a [u32],
}

impl Speculative<'_, '_> {
    fn run(&self, sess: &mut Session<'_>, interrupt: &Interrupt) -> Result<Vec<BenchResult>> {
        let a = self.a;
        let opts = options(a, 0, 0, interrupt);
        let mut make = |target: &Session<'_>| {
            make_draft(
                self.draft,
                &a.speculative,
                (a.cache_type, a.swa_full),
                self.loaded,
                target,
                a.batch_size,
            )
            .map(|d| d.expect("--draft was given"))
        };
        let mut test = SpecTest {
            prompt: self.prompt,
            tokenizer: &self.loaded.tokenizer,
            lookup: usize::from(a.speculative.lookup),
            draft: self
                .draft
                .is_some()
                .then_some(&mut make as &mut DraftMaker<'_>),
            label: self.label(),
        };
        speculative_test(sess, &mut test, &opts)
    }

    /// `draft FILE` or `lookup N`.
    fn label(&self) -> String {
        let spec = &self.a.speculative;
        match &spec.draft {
            Some(d) => format!(
                "draft {}",
                d.file_name().map_or(d.display().to_string(), |n| n
                    .to_string_lossy()
                    .into_owned())
            ),
            None => format!("lookup {}", spec.lookup),
        }
    }
}

fn stdout_error(e: std::io::Error) -> RunnerError {
    RunnerError::io("writing to stdout", e)
}

/// What `bench` prints: the tests' results and, with `--verbose`, the matrices' paths.
struct Report<'a> {
    a: &'a BenchArgs,
    file: &'a KilnFile,
    weights: String,
    load_ms: f64,
    results: &'a [BenchResult],
    paths: Option<&'a [MatrixPath]>,
}

impl Report<'_> {
    /// `--json`: one object.
    fn json(&self) -> Result<()> {
        let a = self.a;
        let mut v = serde_json::json!({
            "model": a.model.display().to_string(),
            "weights": self.weights,
            "size_bytes": self.file.file_len(),
            "load_ms": self.load_ms,
            "isa": format!("{:?}", kiln_kernels::isa()),
            "cache_type": a.cache_type.name(),
            "results": self.results,
        });
        if let Some(p) = &self.paths {
            v["matrix_paths"] = serde_json::json!(p);
        }
        writeln!(std::io::stdout(), "{v}").map_err(stdout_error)
    }

    /// Markdown tables: the results, the speculative tests' acceptance, the matrices' paths.
    fn tables(&self) -> Result<()> {
        let mut out = std::io::stdout();
        self.results_table(&mut out)?;
        self.speculative_table(&mut out)?;
        self.paths_table(&mut out)
    }

    fn results_table(&self, out: &mut impl Write) -> Result<()> {
        let a = self.a;
        let w = stdout_error;
        writeln!(
            out,
            "| model | weights | size | isa | kv | threads | test | tok/s | min | max |"
        )
        .map_err(w)?;
        writeln!(out, "|---|---|--:|---|---|--:|---|--:|--:|--:|").map_err(w)?;
        let name = a
            .model
            .file_name()
            .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
        let weights = &self.weights;
        for r in self.results {
            writeln!(
                out,
                "| {name} | {weights} | {:.1} MiB | {:?} | {} | {} | {} | {:.2} ± {:.2} | {:.2} | {:.2} |",
                self.file.file_len() as f64 / (1 << 20) as f64,
                kiln_kernels::isa(),
                a.cache_type,
                r.threads,
                r.test,
                r.tok_s,
                r.tok_s_stddev,
                r.tok_s_min,
                r.tok_s_max
            )
            .map_err(w)?;
        }
        Ok(())
    }

    fn speculative_table(&self, out: &mut impl Write) -> Result<()> {
        let w = stdout_error;
        let spec: Vec<&BenchResult> = self
            .results
            .iter()
            .filter(|r| r.speedup.is_some())
            .collect();
        if !spec.is_empty() {
            writeln!(
                out,
                "\n| threads | test | guesses accepted | tokens per pass | speedup |"
            )
            .map_err(w)?;
            writeln!(out, "|--:|---|--:|--:|--:|").map_err(w)?;
        }
        for r in spec {
            writeln!(
                out,
                "| {} | {} | {:.1}% | {:.2} | {:.2}× |",
                r.threads,
                r.test,
                100.0 * r.acceptance.unwrap_or(0.0),
                r.tokens_per_pass.unwrap_or(0.0),
                r.speedup.unwrap_or(0.0)
            )
            .map_err(w)?;
        }
        Ok(())
    }

    fn paths_table(&self, out: &mut impl Write) -> Result<()> {
        let w = stdout_error;
        if self.paths.is_some() {
            writeln!(
                out,
                "\n| matrices | rows × cols | weights | decode (1 tok) | prefill |"
            )
            .map_err(w)?;
            writeln!(out, "|---|--:|---|---|---|").map_err(w)?;
        }
        for p in self.paths.iter().copied().flatten() {
            writeln!(
                out,
                "| {}× {} | {} × {} | {} | {} | {} tok: {} |",
                p.count,
                p.roles.join(", "),
                p.rows,
                p.cols,
                p.dtype,
                p.decode,
                p.prefill_tokens,
                p.prefill
            )
            .map_err(w)?;
        }
        Ok(())
    }
}
