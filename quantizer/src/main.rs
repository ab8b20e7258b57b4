//! `kiln-quantize IN.kiln OUT.kiln --to DTYPE|MIX
//! [--method reference|search|gptq]
//! [--keep PATTERN=DTYPE]… [--threads N] [--force] [--json]`
//!
//! A thin shell over [`kiln_quantize::request::run`]: arguments become a [`Request`], which the
//! library validates and runs, a progress bar is drawn on stderr, the report goes to stdout (a table,
//! or JSON with `--json`), and errors are printed once.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Mutex;

use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use kiln_format::ExitStatus;
use kiln_quantize::request::{self, Request};
use kiln_quantize::{Progress, QuantizeError, Report};

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
          value_parser = request::calib_tokens_arg())]
    calib_tokens: usize,
    /// Calibration window in tokens (the KV cache is reset between windows).
    #[arg(long, value_name = "N", default_value_t = kiln_quantize::calibrate::DEFAULT_CTX,
          allow_negative_numbers = true, value_parser = request::calib_ctx_arg())]
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
          value_parser = request::bpw_arg())]
    bpw: Option<f64>,
    /// With `--to auto`: the largest output file, in bytes (metadata and index included)
    #[arg(long, value_name = "N", allow_negative_numbers = true,
          value_parser = request::max_bytes_arg())]
    max_bytes: Option<u64>,
    /// Per-tensor override, PATTERN=DTYPE (f32, f16, bf16, q8_0, q4_0, q5_0, q5_1, q2_k, q3_k,
    /// q4_k, q5_k, q6_k, iq4_nl, iq4_xs or copy); `*` matches any run of characters; the last
    /// matching flag wins. Example: --keep lm_head.weight=q8_0
    #[arg(long = "keep", value_name = "PATTERN=DTYPE")]
    keep: Vec<String>,
    /// Worker threads (default: all cores).
    #[arg(long, value_name = "N", allow_negative_numbers = true,
          value_parser = request::threads_arg())]
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

    fn notice(&self, text: &str) {
        if !self.quiet {
            self.bar.suspend(|| eprintln!("{text}"));
        }
    }
}

/// The flags as the library's [`Request`], which validates them; a `--threads` beyond the
/// CPUs available is capped, with a notice.
fn request(args: Args) -> Request {
    let threads = args.threads.map(|t| {
        if let Some(notice) = kiln_runner::threads::cap_notice(t as usize) {
            eprintln!("kiln-quantize: {notice}");
        }
        kiln_runner::threads::cap_threads(t as usize)
    });
    Request {
        input: args.input,
        output: args.output,
        to: args.to,
        method: args.method,
        calibrate: args.calibrate,
        calib_tokens: args.calib_tokens,
        calib_ctx: args.calib_ctx,
        importance: args.importance,
        save_importance: args.save_importance,
        bpw: args.bpw,
        max_bytes: args.max_bytes,
        keep: args.keep,
        threads,
        force: args.force,
    }
}

fn run(args: Args) -> Result<(), QuantizeError> {
    let (json, quiet) = (args.json, args.quiet);
    let bar = ProgressBar::new(0).with_style(
        ProgressStyle::with_template("{msg:>14} [{bar:40}] {percent:>3}% {elapsed_precise}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    let progress = Bar {
        bar,
        quiet,
        phase: Mutex::new(String::new()),
    };
    let report = request::run(&request(args), &progress);
    progress.bar.finish_and_clear();
    print_report(json, &report?)
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
