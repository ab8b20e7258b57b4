//! `kiln-quantize IN.kiln OUT.kiln --to DTYPE|MIX
//! [--method reference|search|gptq]
//! [--keep PATTERN=DTYPE]… [--threads N] [--force] [--json]`
//!
//! A thin shell over [`kiln_quantize::quantize_file`]: arguments are validated into
//! [`QuantizeOptions`], a progress bar is drawn on stderr, the report goes to stdout (a table,
//! or JSON with `--json`), and errors are printed once.

use std::io::Write;
use std::ops::Bound;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Mutex;

use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use kiln_format::{args, DType, ExitStatus, QK_K};
use kiln_quantize::budget;
use kiln_quantize::calibrate::{calibrate_path, CalibrationOptions};
use kiln_quantize::importance::Importance;
use kiln_quantize::policy::{Mix, Target, TARGETS};
use kiln_quantize::{
    quantize_file, Method, Override, Policy, Progress, QuantizeError, QuantizeOptions, Report,
};

/// Turn a converted .kiln model into a smaller one (F16, or GGML's Q8_0, Q4_0, Q5_0, Q5_1,
/// Q2_K…Q6_K, IQ4_NL, IQ4_XS blocks, or llama.cpp's mixes of them).
///
/// Weight matrices (attention/MLP projections, embedding, output) get --to; norms, biases and
/// other 1-D tensors stay F32; rows that do not fit the blocks fall back as llama.cpp's do
/// (q2_k, q3_k -> q4_0, q4_k -> q5_0, q5_k -> q5_1, q6_k -> q8_0, iq4_xs -> iq4_nl, then f16).
/// See docs/QUANTIZE.md.
#[derive(Debug, Parser)]
#[command(name = "kiln-quantize", version)]
struct Args {
    /// The source .kiln (F32/F16/BF16 tensors).
    input: PathBuf,
    /// The .kiln to write (atomically; never the input).
    output: PathBuf,
    /// Dtype of the weight matrices: f16, q8_0, q4_0, q5_0, q5_1, q2_k, q3_k, q4_k, q5_k,
    /// q6_k, iq4_nl or iq4_xs; or one of llama.cpp's mixes: q2_k_mix, q3_k_s, q3_k_m, q3_k_l,
    /// q4_k_s, q4_k_m, q5_k_s, q5_k_m, iq4_nl_mix, iq4_xs_mix (llama-quantize's Q2_K, …,
    /// IQ4_XS: Q6_K for the output and more bits for some attn.v/mlp.down/attn.o); or `auto`
    /// with --bpw or --max-bytes and calibration: each matrix's type chosen to fit that size
    /// with the least KL-divergence, as calibration measures it (see docs/QUANTIZE.md).
    #[arg(long, value_name = "DTYPE")]
    to: String,
    /// How Q8_0/Q4_0 blocks are chosen: `reference` (GGML's rule, bit for bit), `search`
    /// (least-squares scale search in the same layout, weighted by importance when
    /// calibrating) or `gptq` (error-compensating rounding from calibration's second moments).
    /// Default: `reference`; `gptq` with --calibrate; with --importance, `gptq` if the file
    /// holds second moments, else `search`.
    #[arg(long, value_name = "METHOD")]
    method: Option<String>,
    /// Calibrate on this UTF-8 text: run the model over it and weight each block's error by
    /// how large its input columns are (see docs/QUANTIZE.md).
    #[arg(long, value_name = "TEXT", conflicts_with = "importance")]
    calibrate: Option<PathBuf>,
    /// At most this many tokens of the calibration text are used (only the part of the text
    /// that holds them is read; at most 1 000 000).
    #[arg(long, value_name = "N", default_value_t = kiln_quantize::calibrate::DEFAULT_TOKENS,
          allow_negative_numbers = true,
          value_parser = args::whole::<usize>(64, kiln_quantize::calibrate::MAX_TOKENS as u64))]
    calib_tokens: usize,
    /// Calibration window in tokens (the KV cache is reset between windows).
    #[arg(long, value_name = "N", default_value_t = kiln_quantize::calibrate::DEFAULT_CTX,
          allow_negative_numbers = true, value_parser = args::whole::<usize>(16, 1_000_000))]
    calib_ctx: usize,
    /// Use importance measured earlier (a file written by --save-importance).
    #[arg(long, value_name = "FILE")]
    importance: Option<PathBuf>,
    /// Save the importance measured by --calibrate, to reuse with --importance.
    #[arg(long, value_name = "FILE", requires = "calibrate")]
    save_importance: Option<PathBuf>,
    /// With `--to auto`: bits of tensor data per weight over all tensors (as the report and
    /// llama.cpp's BPW count them), e.g. 4.5
    #[arg(long, value_name = "B", conflicts_with = "max_bytes", allow_negative_numbers = true,
          value_parser = args::real::<f64>(Bound::Excluded(0.0), Bound::Included(32.0)))]
    bpw: Option<f64>,
    /// With `--to auto`: the largest output file, in bytes (metadata and index included)
    #[arg(long, value_name = "N", allow_negative_numbers = true,
          value_parser = args::at_least::<u64>(1))]
    max_bytes: Option<u64>,
    /// Per-tensor override, PATTERN=DTYPE (f32, f16, bf16, q8_0, q4_0, q5_0, q5_1, q2_k, q3_k,
    /// q4_k, q5_k, q6_k, iq4_nl, iq4_xs or copy); `*` matches any run of characters; the last
    /// matching flag wins. Example: --keep lm_head.weight=q8_0
    #[arg(long = "keep", value_name = "PATTERN=DTYPE")]
    keep: Vec<String>,
    /// Worker threads (default: all cores).
    #[arg(long, value_name = "N", allow_negative_numbers = true,
          value_parser = args::whole::<u32>(1, 1024))]
    threads: Option<u32>,
    /// Overwrite the output if it exists.
    #[arg(long)]
    force: bool,
    /// Print the report as JSON on stdout instead of a table.
    #[arg(long)]
    json: bool,
    /// No progress bar.
    #[arg(long, short)]
    quiet: bool,
}

/// Progress bar on stderr (hidden when stderr is not a terminal).
struct Bar {
    bar: ProgressBar,
    quiet: bool,
    phase: Mutex<String>,
}

impl Progress for Bar {
    fn phase(&self, name: &str, total: u64) {
        if self.quiet {
            return;
        }
        *self.phase.lock().unwrap_or_else(|e| e.into_inner()) = name.to_string();
        self.bar.reset();
        self.bar.set_length(total);
        self.bar.set_message(name.to_string());
    }

    fn advance(&self, n: u64) {
        if !self.quiet {
            self.bar.inc(n);
        }
    }
}

fn options(args: &Args) -> Result<QuantizeOptions, QuantizeError> {
    let overrides = args
        .keep
        .iter()
        .map(|k| Override::parse(k))
        .collect::<Result<Vec<_>, _>>()?;
    let auto = args.to.eq_ignore_ascii_case("auto");
    let calibrated = args.calibrate.is_some() || args.importance.is_some();
    check_budget_flags(args, auto, calibrated)?;
    let policy = match Mix::parse(&args.to) {
        _ if auto => Policy::auto(overrides),
        Some(mix) => Policy::mix(mix, overrides),
        None => {
            let to = DType::parse(&args.to)
                .filter(|d| TARGETS.contains(d))
                .ok_or_else(|| QuantizeError::BadTarget {
                    dtype: args.to.clone(),
                })?;
            Policy::new(to, overrides)?
        }
    };
    let policy = policy.with_importance(calibrated);
    let method = method(args, calibrated)?;
    check_ggml_only_types(&policy, method, calibrated)?;
    let mut o = QuantizeOptions::new(&args.input, &args.output, policy);
    o.method = method;
    o.threads = args.threads.map(|t| {
        if let Some(notice) = kiln_runner::threads::cap_notice(t as usize) {
            eprintln!("kiln-quantize: {notice}");
        }
        kiln_runner::threads::cap_threads(t as usize)
    });
    o.overwrite = args.force;
    Ok(o)
}

/// `--to auto` needs a size budget (`--bpw` or `--max-bytes`) and calibration; a budget
/// needs `--to auto`.
fn check_budget_flags(args: &Args, auto: bool, calibrated: bool) -> Result<(), QuantizeError> {
    let budget_flag = match (args.bpw, args.max_bytes) {
        (Some(_), _) => Some("--bpw"),
        (_, Some(_)) => Some("--max-bytes"),
        _ => None,
    };
    match (auto, budget_flag) {
        (true, None) => {
            return Err(QuantizeError::BadArgument {
                arg: "--to auto".into(),
                reason: "give the size to fit: --bpw B (bits per weight, e.g. 4.5) or \
                         --max-bytes N"
                    .into(),
            })
        }
        (false, Some(flag)) => {
            return Err(QuantizeError::BadArgument {
                arg: flag.into(),
                reason: format!(
                    "a size budget goes with --to auto (this run has --to {})",
                    args.to
                ),
            })
        }
        _ => {}
    }
    if auto && !calibrated {
        return Err(QuantizeError::BadArgument {
            arg: "--to auto".into(),
            reason: "the types are chosen from calibration: add --calibrate TEXT (or \
                     --importance FILE)"
                .into(),
        });
    }
    Ok(())
}

/// The rounding method: `--method`, or by default GPTQ with calibration and GGML's
/// reference rule without; GPTQ without calibration and the reference rule with it are
/// refused.
fn method(args: &Args, calibrated: bool) -> Result<Method, QuantizeError> {
    let method = match &args.method {
        // Downgraded to `search` in `run` if an importance file has no second moments.
        None if calibrated => Method::Gptq,
        None => Method::Reference,
        Some(m) => Method::parse(m).ok_or_else(|| QuantizeError::BadOverride {
            arg: format!("--method {m}"),
            reason: "use `reference` or `search`".into(),
        })?,
    };
    if method == Method::Gptq && !calibrated {
        return Err(QuantizeError::BadOverride {
            arg: "--method gptq".into(),
            reason: "error-compensating rounding needs calibration: add --calibrate TEXT \
                     (or --importance FILE saved by a --method gptq calibration)"
                .into(),
        });
    }
    if calibrated && method == Method::Reference {
        return Err(QuantizeError::BadOverride {
            arg: "--method reference".into(),
            reason: "the reference method is GGML's fixed rule and ignores importance; drop \
                     --method (or use `search`) with --calibrate/--importance"
                .into(),
        });
    }
    Ok(method)
}

/// Types that have only GGML's rules (K-quants, Q5_0, Q5_1, IQ4_NL) take no `--method`
/// without calibration.
fn check_ggml_only_types(
    policy: &Policy,
    method: Method,
    calibrated: bool,
) -> Result<(), QuantizeError> {
    let ggml_only = std::iter::once(policy.to)
        .chain(policy.overrides.iter().filter_map(|o| match o.target {
            Target::DType(d) => Some(d),
            Target::Copy => None,
        }))
        .find(|d| d.block_len() == QK_K || matches!(d, DType::Q5_0 | DType::Q5_1 | DType::IQ4_NL));
    // Without calibration these types have only GGML's reference rule; with it, any method
    // other than `reference` gives them GGML's importance-weighted rule (llama.cpp's imatrix).
    if let (Some(d), false, false) = (ggml_only, method == Method::Reference, calibrated) {
        return Err(QuantizeError::BadOverride {
            arg: format!("--method {}", method.name()),
            reason: format!(
                "{} blocks are made by GGML's reference rule, or its importance-weighted rule \
                 with --calibrate/--importance; drop --method",
                d.name()
            ),
        });
    }
    Ok(())
}

fn run(args: Args) -> Result<(), QuantizeError> {
    let mut options = options(&args)?;
    check_outputs(&args)?;
    let bar = ProgressBar::new(0).with_style(
        ProgressStyle::with_template("{msg:>14} [{bar:40}] {percent:>3}% {elapsed_precise}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    let progress = Bar {
        bar,
        quiet: args.quiet,
        phase: Mutex::new(String::new()),
    };
    if let Some(path) = &args.importance {
        load_importance(&args, path, &mut options)?;
    }
    if let Some(text) = &args.calibrate {
        calibrate(&args, text, &mut options, &progress)?;
    }
    if let Some(budget) = budget(&args) {
        options = plan_budget(&args, budget, options, &progress)?;
    }
    let report = quantize_file(&options, &progress);
    progress.bar.finish_and_clear();
    print_report(args.json, &report?)
}

/// Before an hour of calibration, not after it: no output may replace anything this run
/// reads (the model, the calibration text, the importance file) or another output.
fn check_outputs(args: &Args) -> Result<(), QuantizeError> {
    let outputs: Vec<&Path> = std::iter::once(args.output.as_path())
        .chain(args.save_importance.as_deref())
        .collect();
    let inputs: Vec<&Path> = std::iter::once(args.input.as_path())
        .chain(args.calibrate.as_deref())
        .chain(args.importance.as_deref())
        .collect();
    kiln_format::refuse_clobbering(&outputs, &inputs)?;
    for out in &outputs {
        kiln_format::check_destination(out, args.force)?;
    }
    Ok(())
}

/// `--importance`: read the file; without second moments the method defaults to search, and
/// GPTQ is refused.
fn load_importance(
    args: &Args,
    path: &Path,
    options: &mut QuantizeOptions,
) -> Result<(), QuantizeError> {
    let importance = Importance::load(path)?;
    if args.method.is_none() && importance.moments.is_empty() {
        options.method = Method::Search;
    }
    if options.method == Method::Gptq && importance.moments.is_empty() {
        return Err(QuantizeError::ImportanceMismatch {
            file: path.display().to_string(),
            reason: "--method gptq needs second moments, and this file has none; \
                     calibrate again with --method gptq --save-importance"
                .into(),
        });
    }
    options.importance = Some(importance);
    Ok(())
}

/// `--calibrate`: measure the importance on `text` (and with `--save-importance` keep it).
fn calibrate(
    args: &Args,
    text: &Path,
    options: &mut QuantizeOptions,
    progress: &Bar,
) -> Result<(), QuantizeError> {
    let calibration = CalibrationOptions {
        max_tokens: args.calib_tokens,
        ctx: args.calib_ctx,
        threads: options
            .threads
            .unwrap_or_else(kiln_runner::threads::physical_cores),
        second_moments: options.method == Method::Gptq,
    };
    let start = std::time::Instant::now();
    let importance = calibrate_path(&args.input, text, &calibration, progress);
    let importance = importance.inspect_err(|_| progress.bar.finish_and_clear())?;
    if !args.quiet {
        progress.bar.suspend(|| {
            eprintln!(
                "calibrated on {} tokens ({} windows of {}) in {:.1} s",
                importance.info.tokens,
                importance.info.chunks,
                importance.info.ctx,
                start.elapsed().as_secs_f64()
            )
        });
    }
    if let Some(path) = &args.save_importance {
        importance.save(path, args.force)?;
    }
    options.importance = Some(importance);
    Ok(())
}

/// `--to auto`: choose each tensor's type within the budget and apply the plan to the policy.
fn plan_budget(
    args: &Args,
    budget: budget::Budget,
    mut options: QuantizeOptions,
    progress: &Bar,
) -> Result<QuantizeOptions, QuantizeError> {
    let importance = options
        .importance
        .as_ref()
        .expect("--to auto requires calibration, checked in options()");
    let plan = budget::plan(
        &args.input,
        &options.policy,
        options.method,
        importance,
        budget,
        progress,
    );
    let plan = plan.inspect_err(|_| progress.bar.finish_and_clear())?;
    if !args.quiet {
        progress.bar.suspend(|| {
            let weighed = match plan.probe_tokens {
                0 => "output errors not weighed in KL-divergence (the importance keeps no \
                      probe tokens, or the model has no logits; calibrate again to weigh \
                      them)"
                    .to_string(),
                n => format!("errors weighed in KL-divergence on {n} calibration tokens"),
            };
            eprintln!(
                "{budget}: {} bytes of tensor data ({:.3} bits per weight) of {} allowed; \
                 {}; {weighed}",
                plan.total_bytes,
                plan.bits_per_weight(),
                plan.budget_bytes,
                plan.summary()
            )
        });
    }
    options.policy = plan.apply(options.policy);
    Ok(options)
}

/// The report on stdout, as a table or JSON; a closed pipe (`| head`) is not a failure: the
/// output file is already written.
fn print_report(json: bool, report: &Report) -> Result<(), QuantizeError> {
    let text = if json {
        let mut s = serde_json::to_string_pretty(report).expect("the report serializes");
        s.push('\n');
        s
    } else {
        report.table()
    };
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(QuantizeError::Io {
            file: "<stdout>".into(),
            action: "cannot write the report",
            source: e,
        }),
        _ => Ok(()),
    }
}

fn budget(args: &Args) -> Option<budget::Budget> {
    match (args.bpw, args.max_bytes) {
        (Some(b), _) => Some(budget::Budget::Bpw(b)),
        (_, Some(n)) => Some(budget::Budget::MaxBytes(n)),
        _ => None,
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    // SIGINT, SIGTERM, SIGHUP: remove the temporary output, then exit with 128 + the signal's
    // number; libraries install no handlers.
    kiln_format::install_interrupt_handler("kiln-quantize");
    match run(args) {
        Ok(()) => ExitStatus::Success.into(),
        Err(e) => {
            // Every message already includes its cause: print it once.
            eprintln!("kiln-quantize: error: {e}");
            ExitStatus::Error.into()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Args;
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

    /// Every numeric flag takes `-1` as its value and refuses it by its range, naming the flag
    /// and the range (not as an unexpected argument `-1`, which names no flag): exit status 2.
    #[test]
    fn a_negative_number_is_refused_by_range_naming_the_flag() {
        let flags = numeric_flags(&Args::command());
        assert_eq!(flags.len(), 5, "{flags:?}");
        for long in flags {
            let flag = format!("--{long}");
            let e = Args::try_parse_from(["kiln-quantize", flag.as_str(), "-1"]).unwrap_err();
            let text = e.to_string();
            assert_eq!(e.kind(), clap::error::ErrorKind::ValueValidation, "{text}");
            assert_eq!(e.exit_code(), 2, "{text}");
            assert!(text.contains(&format!("'{flag} <")), "{text}");
            assert!(text.contains("must be a"), "{text}");
        }
    }

    /// Every flag has its own line in `--help` (clap's built-in `--help` and `--version`
    /// aside), and the budget and override flags say what they are.
    #[test]
    fn help_describes_every_flag() {
        let cmd = Args::command();
        let help = |long: &str| {
            cmd.get_arguments()
                .find(|a| a.get_long() == Some(long))
                .and_then(|a| a.get_help())
                .map(|h| h.to_string())
        };
        for arg in cmd.get_arguments() {
            let Some(long) = arg.get_long() else { continue };
            if !matches!(long, "help" | "version") {
                assert!(help(long).is_some(), "--{long} has no description");
            }
        }
        for (long, words) in [
            ("bpw", "bits of tensor data per weight"),
            ("max-bytes", "largest output file"),
            ("keep", "Per-tensor override"),
        ] {
            let text = help(long).unwrap_or_default();
            assert!(text.contains(words), "--{long}: {text:?}");
        }
    }
}
