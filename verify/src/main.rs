//! The `kiln-verify` command line. Exit status ([`kiln_format::ExitStatus`]): 0 pass, 1 out of
//! tolerance or a checksum mismatch, 2 could not run (bad input, I/O), 128 + the signal's
//! number when interrupted (SIGINT 130, SIGTERM 143, SIGHUP 129).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use kiln_format::{args, ExitStatus, KilnFile};
use kiln_runner::CacheType;
use kiln_verify::perplexity::{PerplexityOptions, PerplexityProgress, ScoredLogits};
use kiln_verify::{diff, junit, layers, perplexity, report, request, Result, VerifyError};

const EXAMPLES: &str = "\
Examples:
  kiln-verify layers smollm2-f32.kiln --reference fixtures/reference/smollm2/0.safetensors
  kiln-verify integrity smollm2-q4_0.kiln
  kiln-verify diff smollm2-bf16.kiln smollm2-q4_0.kiln
  kiln-verify perplexity smollm2-f16.kiln --text wiki.txt -c 512 --save-logits base.logits
  kiln-verify perplexity smollm2-q4_0.kiln --text wiki.txt -c 512 --kl-base base.logits
  kiln-verify perplexity smollm2-q4_0.kiln --text wiki.txt -c 512 --kl-base base.logits \\
      --max-kld 0.05 --max-ppl-ratio 1.05 --junit ppl.xml --report ppl.html
  kiln-verify layers smollm2-q8_0.kiln --reference ref/0.safetensors --tolerance q8_0 --junit layers.xml";

/// Numerical accuracy checks for .kiln models.
#[derive(Parser, Debug)]
#[command(name = "kiln-verify", version, after_help = EXAMPLES)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Compare every named activation with a reference dump, in forward order.
    Layers(LayersArgs),
    /// Verify every checksum, and that every value is finite.
    Integrity(IntegrityArgs),
    /// Tensor-by-tensor error between two files of the same model.
    Diff(DiffArgs),
    /// Perplexity by llama.cpp's protocol; KL-divergence against a base model's saved logits.
    Perplexity(PerplexityArgs),
}

/// The arguments of `kiln-verify layers`.
#[derive(Args, Debug)]
struct LayersArgs {
    model: PathBuf,
    /// Reference dump (safetensors: input_ids + transformers module outputs).
    #[arg(long)]
    reference: PathBuf,
    /// Override the largest NMSE allowed for any activation (a finite value ≥ 0).
    #[arg(long, allow_negative_numbers = true, value_parser = request::max_nmse_arg())]
    max_nmse: Option<f64>,
    /// Override the smallest top-1 agreement of the logits (0..1).
    #[arg(long, allow_negative_numbers = true, value_parser = request::min_top1_arg())]
    min_top1: Option<f64>,
    /// Judge by a named tolerance class instead of the file's own weight class: f32, f16,
    /// bf16 (or half), q8_0, q4_0, q3_k or q2_k (also low). --max-nmse and --min-top1
    /// still override it.
    #[arg(long, value_name = "CLASS")]
    tolerance: Option<String>,
    /// Worker threads (default: the machine's physical cores).
    #[arg(short, long, allow_negative_numbers = true,
          value_parser = request::threads_arg())]
    threads: Option<usize>,
    /// Print the results as JSON on stdout instead of a table.
    #[arg(long)]
    json: bool,
    /// Also write the results as JUnit XML (one test case per activation site).
    #[arg(long, value_name = "FILE")]
    junit: Option<PathBuf>,
    /// Also write an HTML page of NMSE and cosine charts by activation site and the table.
    #[arg(long, value_name = "FILE.html")]
    report: Option<PathBuf>,
}

/// The arguments of `kiln-verify integrity`.
#[derive(Args, Debug)]
struct IntegrityArgs {
    model: PathBuf,
    /// Print the results as JSON on stdout.
    #[arg(long)]
    json: bool,
    /// Also write the results as JUnit XML (one test case per tensor).
    #[arg(long, value_name = "FILE")]
    junit: Option<PathBuf>,
}

/// The arguments of `kiln-verify diff`.
#[derive(Args, Debug)]
struct DiffArgs {
    a: PathBuf,
    b: PathBuf,
    /// Print the results as JSON on stdout instead of a table.
    #[arg(long)]
    json: bool,
    /// Also write the results as JUnit XML (one test case per tensor).
    #[arg(long, value_name = "FILE")]
    junit: Option<PathBuf>,
}

/// The arguments of `kiln-verify perplexity`.
#[derive(Args, Debug)]
struct PerplexityArgs {
    model: PathBuf,
    /// UTF-8 text file.
    #[arg(long)]
    text: PathBuf,
    /// Tokens per chunk (at least 8).
    #[arg(short = 'c', long = "ctx", default_value_t = 512, allow_negative_numbers = true,
          value_parser = args::at_least::<usize>(8))]
    ctx: usize,
    /// Use at most N chunks.
    #[arg(long, allow_negative_numbers = true, value_parser = args::at_least::<usize>(0))]
    chunks: Option<usize>,
    /// Save the scored log-probabilities (to compare other files against this one).
    #[arg(long)]
    save_logits: Option<PathBuf>,
    /// Replace an existing --save-logits file.
    #[arg(long)]
    force: bool,
    /// Skip checking every tensor's sha256 before running the model.
    #[arg(long)]
    no_verify: bool,
    /// Base model's saved log-probabilities: report mean KL-divergence and top-token agreement.
    #[arg(long)]
    kl_base: Option<PathBuf>,
    /// Fail (exit 1) if the mean KL-divergence against --kl-base is over this.
    #[arg(long, requires = "kl_base", allow_negative_numbers = true,
          value_parser = args::non_negative::<f64>())]
    max_kld: Option<f64>,
    /// Fail (exit 1) if this model's perplexity divided by the base's (computed from the
    /// --kl-base file over the same tokens) is over this.
    #[arg(long, requires = "kl_base", allow_negative_numbers = true,
          value_parser = args::non_negative::<f64>())]
    max_ppl_ratio: Option<f64>,
    /// How the KV cache stores keys and values: f32 (exact, the default here, so that the
    /// figures measure the weights), or f16 / q8_0 as `kiln-run --cache-type` runs them.
    #[arg(long = "cache-type", default_value_t = CacheType::F32)]
    cache_type: CacheType,
    /// Worker threads (default: the machine's physical cores).
    #[arg(short, long, allow_negative_numbers = true,
          value_parser = args::at_least::<usize>(1))]
    threads: Option<usize>,
    /// Print the results as JSON on stdout.
    #[arg(long)]
    json: bool,
    /// Also write the results as JUnit XML (one test case per chunk and per gate).
    #[arg(long, value_name = "FILE")]
    junit: Option<PathBuf>,
    /// Also write an HTML page of the per-chunk figures and the KL-divergence histogram.
    #[arg(long, value_name = "FILE.html")]
    report: Option<PathBuf>,
}

/// Refuse, before any work, results files that are not regular files or that name something
/// the run reads (or each other): `outputs` pairs each path with whether it may replace an
/// existing file.
fn check_outputs(outputs: &[(&Path, bool)], inputs: &[&Path]) -> Result<()> {
    for &(p, overwrite) in outputs {
        kiln_format::check_destination(p, overwrite)?;
    }
    let paths: Vec<&Path> = outputs.iter().map(|&(p, _)| p).collect();
    kiln_format::refuse_clobbering(&paths, inputs)?;
    Ok(())
}

/// `--junit`/`--report` paths, which replace an earlier results file of the same name.
fn results_files<'a>(paths: &[&'a Option<PathBuf>]) -> Vec<(&'a Path, bool)> {
    paths
        .iter()
        .filter_map(|p| p.as_deref())
        .map(|p| (p, true))
        .collect()
}

/// `-t` (at least 1, which clap checks) capped at the CPUs available, with a notice; by
/// default the machine's physical cores.
fn threads(t: Option<usize>) -> Result<usize> {
    Ok(t.map_or_else(kiln_runner::threads::physical_cores, capped))
}

/// `-t N` capped at the CPUs available, with a notice when it is.
fn capped(n: usize) -> usize {
    if let Some(notice) = kiln_runner::threads::cap_notice(n) {
        eprintln!("kiln-verify: {notice}");
    }
    kiln_runner::threads::cap_threads(n)
}

fn out(s: &str) {
    let mut o = std::io::stdout().lock();
    let _ = o.write_all(s.as_bytes()).and_then(|_| o.flush());
}

fn json<T: serde::Serialize>(v: &T) {
    out(&(serde_json::to_string_pretty(v).expect("serializable") + "\n"));
}

struct Bar(ProgressBar);

impl PerplexityProgress for Bar {
    fn chunk(&self, done: usize, total: usize, ppl: f64) {
        self.0.set_length(total as u64);
        self.0.set_position(done as u64);
        self.0.set_message(format!("ppl ≈ {ppl:.4}"));
    }
}

fn run(cli: Cli) -> Result<bool> {
    match cli.command {
        Command::Layers(a) => run_layers(a),
        Command::Integrity(a) => run_integrity(a),
        Command::Diff(a) => run_diff(a),
        Command::Perplexity(a) => run_perplexity(a),
    }
}

/// `kiln-verify layers`: every activation against the reference dump ([`request::layers`]).
fn run_layers(a: LayersArgs) -> Result<bool> {
    let req = request::LayersRequest {
        threads: a.threads.map(capped),
        model: a.model,
        reference: a.reference,
        max_nmse: a.max_nmse,
        min_top1: a.min_top1,
        tolerance: a.tolerance,
        junit: a.junit,
        report: a.report,
    };
    let r = request::layers(&req)?;
    if a.json {
        json(&r);
    } else {
        out(&layers::render(&r));
    }
    Ok(r.pass)
}

/// A progress bar drawn with `template` (indicatif's syntax).
fn progress_bar(len: u64, template: &str) -> ProgressBar {
    let pb = ProgressBar::new(len);
    pb.set_style(
        ProgressStyle::with_template(template)
            .expect("template")
            .progress_chars("=> "),
    );
    pb
}

/// `kiln-verify integrity`: every checksum, and every value finite.
fn run_integrity(a: IntegrityArgs) -> Result<bool> {
    let t0 = std::time::Instant::now();
    check_outputs(&results_files(&[&a.junit]), &[&a.model])?;
    let f = KilnFile::open(&a.model)?;
    let pb = progress_bar(
        f.data_len(),
        "verifying [{bar:30}] {bytes}/{total_bytes} {binary_bytes_per_sec}",
    );
    // Checksums cover what was written: a file written with NaN in it matches them, so
    // every value is scanned too, in the same pass.
    let (failures, non_finite) = f.check_tensors(&|n| pb.inc(n));
    pb.finish_and_clear();
    let secs = t0.elapsed().as_secs_f64();
    let pass = failures.is_empty() && non_finite.is_empty();
    if let Some(p) = &a.junit {
        let names: Vec<String> = f.tensors().iter().map(|t| t.name.clone()).collect();
        let problems = integrity_problems(&failures, &non_finite);
        junit::write(
            p,
            &[junit::integrity_suite(f.label(), &names, &problems, secs)],
        )?;
    }
    if a.json {
        json(&serde_json::json!({
            "file": f.label(), "pass": pass, "tensors": f.tensors().len(),
            "bytes": f.data_len(), "seconds": secs,
            "failures": failures.iter().map(|x| serde_json::json!({"tensor": x.tensor, "stored": x.stored, "computed": x.computed})).collect::<Vec<_>>(),
            "non_finite": non_finite.iter().map(|x| serde_json::json!({"tensor": x.tensor, "count": x.count, "first": x.first})).collect::<Vec<_>>(),
        }));
    } else if pass {
        out(&format!("{}: all {} tensor checksums and the header checksum match, every value is finite ({:.1} MB in {:.2} s)\n", f.label(), f.tensors().len(), f.data_len() as f64 / 1e6, secs));
    } else {
        out(&render_integrity_failures(
            f.label(),
            &failures,
            &non_finite,
        ));
    }
    Ok(pass)
}

/// The JUnit failure message of each tensor that failed `integrity`, by tensor name.
fn integrity_problems(
    failures: &[kiln_format::ChecksumFailure],
    non_finite: &[kiln_format::NonFiniteTensor],
) -> Vec<(String, String)> {
    failures
        .iter()
        .map(|x| {
            (
                x.tensor.clone(),
                format!(
                    "checksum mismatch (stored {}, computed {})",
                    x.stored, x.computed
                ),
            )
        })
        .chain(non_finite.iter().map(|x| {
            (
                x.tensor.clone(),
                format!(
                    "{} value(s) are NaN or infinite (allowed 0), the first at \
                     element {}",
                    x.count, x.first
                ),
            )
        }))
        .collect()
}

/// One line per checksum mismatch, then one per tensor holding a value that is not finite.
fn render_integrity_failures(
    label: &str,
    failures: &[kiln_format::ChecksumFailure],
    non_finite: &[kiln_format::NonFiniteTensor],
) -> String {
    let mut s = String::new();
    for x in failures {
        s += &format!(
            "{}: tensor `{}`: checksum mismatch (stored {}, computed {})\n",
            label, x.tensor, x.stored, x.computed
        );
    }
    for x in non_finite {
        s += &format!(
            "{}: tensor `{}`: {} value(s) are NaN or infinite, the first at element {}\n",
            label, x.tensor, x.count, x.first
        );
    }
    s
}

/// `kiln-verify diff`: tensor-by-tensor error between two files.
fn run_diff(a: DiffArgs) -> Result<bool> {
    let t0 = std::time::Instant::now();
    check_outputs(&results_files(&[&a.junit]), &[&a.a, &a.b])?;
    let (fa, fb) = (KilnFile::open(&a.a)?, KilnFile::open(&a.b)?);
    let r = diff::diff(&fa, &fb)?;
    if let Some(p) = &a.junit {
        junit::write(p, &[junit::diff_suite(&r, t0.elapsed().as_secs_f64())])?;
    }
    if a.json {
        json(&r);
    } else {
        out(&diff::render(&r));
    }
    Ok(r.checksum_failures.is_empty())
}

/// Refuse a destination of `perplexity` before an hour of scoring, not after it: it must not
/// be anything this run reads, nor another of its outputs.
fn check_perplexity_outputs(a: &PerplexityArgs) -> Result<()> {
    let inputs: Vec<&Path> = [Some(&a.model), Some(&a.text), a.kl_base.as_ref()]
        .into_iter()
        .flatten()
        .map(PathBuf::as_path)
        .collect();
    let mut outputs = results_files(&[&a.junit, &a.report]);
    if let Some(p) = &a.save_logits {
        outputs.insert(0, (p.as_path(), a.force));
    }
    check_outputs(&outputs, &inputs)
}

/// The tokens of `a.text`. Only the text the chunks need is read and tokenized (at least two
/// chunks, as the protocol needs); all of it only when no --chunks is given.
fn tokenize_text(f: &KilnFile, a: &PerplexityArgs) -> Result<Vec<u32>> {
    let text = &a.text;
    let wanted = a.chunks.map(|c| c.max(2).saturating_mul(a.ctx));
    let tokenizer = kiln_runner::Tokenizer::from_file(f)?;
    let mut encode = |s: &str| tokenizer.encode(s);
    let body = kiln_runner::text_file::tokenize_file(&mut encode, text, wanted, "perplexity text")
        .map_err(|e| match e {
            kiln_runner::RunnerError::Format(kiln_format::FormatError::InputTooLarge {
                size,
                limit,
                ..
            }) => VerifyError::Text {
                path: text.display().to_string(),
                reason: format!(
                    "{size} bytes is over the {limit}-byte limit for a text used \
                                 whole; pass --chunks N to read only the text N chunks need"
                ),
            },
            kiln_runner::RunnerError::Format(f) => VerifyError::Format(f),
            e => VerifyError::Text {
                path: text.display().to_string(),
                reason: e.to_string(),
            },
        })?;
    Ok(body.tokens)
}

/// `kiln-verify perplexity`: perplexity, KL-divergence against a base, and the gates.
fn run_perplexity(a: PerplexityArgs) -> Result<bool> {
    let t0 = std::time::Instant::now();
    check_perplexity_outputs(&a)?;
    if a.ctx < 8 {
        return Err(VerifyError::Usage(format!(
            "-c {}: the context must be at least 8 tokens",
            a.ctx
        )));
    }
    let f = kiln_runner::open_model_verified(&a.model, !a.no_verify)?;
    let tokens = tokenize_text(&f, &a)?;
    let base = a.kl_base.as_deref().map(ScoredLogits::load).transpose()?;
    let pb = progress_bar(
        1,
        "perplexity [{bar:30}] {pos}/{len} chunks {msg} ETA {eta}",
    );
    let opts = PerplexityOptions {
        ctx: a.ctx,
        chunks: a.chunks,
        threads: threads(a.threads)?,
        cache_type: a.cache_type,
    };
    let (mut r, kept) = perplexity::perplexity_tokens(
        &f,
        &a.text,
        tokens,
        &opts,
        base.as_ref(),
        a.save_logits.is_some(),
        &Bar(pb.clone()),
    )?;
    pb.finish_and_clear();
    if let (Some(p), Some(k)) = (&a.save_logits, kept) {
        k.save(p, a.force)?;
    }
    r.gates = perplexity::check_gates(&r, a.max_kld, a.max_ppl_ratio)?;
    // A perplexity that is not a number (NaN or infinite logits) fails like a gate.
    let finite = r.per_chunk.iter().all(|c| c.ppl.is_finite());
    let pass = finite && r.gates.iter().all(|g| g.pass);
    if !finite {
        eprintln!(
            "kiln-verify: FAIL: perplexity {} is not a finite number (see the chunks)",
            r.ppl
        );
    }
    if let Some(p) = &a.junit {
        junit::write(
            p,
            &[junit::perplexity_suite(&r, t0.elapsed().as_secs_f64())],
        )?;
    }
    if let Some(p) = &a.report {
        report::write(p, &report::perplexity_html(&r))?;
    }
    for g in r.gates.iter().filter(|g| !g.pass) {
        eprintln!("kiln-verify: FAIL: {}", g.describe());
    }
    if a.json {
        json(&r);
    } else {
        out(&render_perplexity(&r));
    }
    Ok(pass)
}

/// The perplexity report as text: the figures, the base's, and each gate's verdict.
fn render_perplexity(r: &perplexity::PerplexityReport) -> String {
    let mut s = format!(
        "{}: perplexity {:.4} ± {:.4} over {} chunks of {} ({} tokens scored, {} KV cache, {:.0} tok/s)\n",
        r.model, r.ppl, r.ppl_stderr, r.chunks, r.ctx, r.tokens_scored, r.cache_type, r.tok_s
    );
    if let (Some(k), Some(p)) = (r.kld_mean, r.same_top_p) {
        s += &format!(
            "mean KL-divergence {k:.6}, same top token {:.2}%\n",
            p * 100.0
        );
    }
    if let Some(b) = r.base_ppl {
        s += &format!(
            "base perplexity {b:.4} (from the saved log-probabilities), ratio {:.6}\n",
            r.ppl / b
        );
    }
    for g in &r.gates {
        s += &format!(
            "{}: {}\n",
            if g.pass { "PASS" } else { "FAIL" },
            g.describe()
        );
    }
    s
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // SIGINT, SIGTERM, SIGHUP: remove unfinished outputs, then exit with 128 + the signal's
    // number.
    kiln_format::install_interrupt_handler("kiln-verify");
    match run(cli) {
        Ok(true) => ExitStatus::Success.into(),
        Ok(false) => ExitStatus::VerificationFailed.into(),
        Err(e) => {
            eprintln!("error: {e}");
            ExitStatus::Error.into()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Cli;
    use clap::{CommandFactory, Parser};
    use std::any::TypeId;

    /// The long names of the flags whose values are numbers, by the type clap parses them to.
    fn numeric_flags(cmd: &clap::Command) -> Vec<String> {
        let numeric = [
            TypeId::of::<u16>(),
            TypeId::of::<u32>(),
            TypeId::of::<u64>(),
            TypeId::of::<usize>(),
            TypeId::of::<f32>(),
            TypeId::of::<f64>(),
        ];
        cmd.get_arguments()
            .filter(|a| numeric.iter().any(|t| a.get_value_parser().type_id() == *t))
            .filter_map(|a| a.get_long().map(str::to_string))
            .collect()
    }

    /// Every numeric flag of every subcommand takes `-1` as its value and refuses it by its
    /// range, naming the flag and the range (not as an unexpected argument `-1`, which names
    /// no flag): exit status 2.
    #[test]
    fn a_negative_number_is_refused_by_range_naming_the_flag() {
        let cli = Cli::command();
        let mut checked = 0;
        for sub in cli.get_subcommands() {
            for long in numeric_flags(sub) {
                let flag = format!("--{long}");
                let args = ["kiln-verify", sub.get_name(), flag.as_str(), "-1"];
                let e = Cli::try_parse_from(args).unwrap_err();
                let text = e.to_string();
                assert_eq!(e.kind(), clap::error::ErrorKind::ValueValidation, "{text}");
                assert_eq!(e.exit_code(), 2, "{text}");
                assert!(text.contains(&format!("'{flag} <")), "{text}");
                assert!(text.contains("must be a"), "{text}");
                checked += 1;
            }
        }
        assert_eq!(checked, 8, "layers: 3 flags, perplexity: 5");
    }

    /// Every flag of every subcommand has its own line in `--help` (clap's built-in `--help`
    /// and `--version` aside).
    #[test]
    fn every_flag_is_described() {
        let cli = Cli::command();
        for sub in cli.get_subcommands() {
            for arg in sub.get_arguments() {
                let Some(long) = arg.get_long() else { continue };
                if matches!(long, "help" | "version") {
                    continue;
                }
                assert!(
                    arg.get_help().is_some(),
                    "kiln-verify {} --{long} has no description",
                    sub.get_name()
                );
            }
        }
    }
}
