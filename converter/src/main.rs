//! The `kiln-convert` command line. All the work happens in the library.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use kiln_format::ExitStatus;

use clap::{Parser, Subcommand, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use kiln_convert::gguf::{export_gguf, import_gguf, ExportOptions, ImportOptions};
use kiln_convert::{convert_hf, inspect, ConvertOptions, Progress};
use kiln_format::DType;

const EXAMPLES: &str = "\
Examples:
  kiln-convert hf ./SmolLM2-135M-Instruct -o smollm2.kiln
  kiln-convert hf ./model-dir -o model-f16.kiln --dtype f16 --force
  kiln-convert inspect smollm2.kiln --verify
  kiln-convert export-gguf smollm2-q4_0.kiln -o smollm2-q4_0.gguf
  kiln-convert gguf SmolLM2-135M-Instruct.Q4_1.gguf -o smollm2.kiln";

/// Convert Hugging Face checkpoints and GGUF files to .kiln files, .kiln files to GGUF, and
/// inspect .kiln files.
#[derive(Parser, Debug)]
#[command(name = "kiln-convert", version, after_help = EXAMPLES)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Convert a Hugging Face model directory (config.json, tokenizer files, *.safetensors).
    #[command(after_help = "Example:\n  kiln-convert hf ./SmolLM2-135M-Instruct -o smollm2.kiln")]
    Hf {
        /// The checkpoint directory.
        dir: PathBuf,
        /// The .kiln file to write.
        #[arg(short, long)]
        output: PathBuf,
        /// Output dtype (default: keep each tensor's source dtype, lossless).
        #[arg(long, value_enum)]
        dtype: Option<FloatType>,
        /// Overwrite the output file if it exists.
        #[arg(long)]
        force: bool,
        /// Convert tensors holding NaN or infinity (with a warning) instead of refusing.
        #[arg(long)]
        allow_non_finite: bool,
        /// Print a JSON summary on stdout.
        #[arg(long)]
        json: bool,
    },
    /// Write a .kiln file as a GGUF file that llama.cpp loads (tensors keep their dtype).
    #[command(
        name = "export-gguf",
        after_help = "Example:\n  kiln-convert export-gguf smollm2-q4_0.kiln -o smollm2-q4_0.gguf"
    )]
    ExportGguf {
        /// The .kiln file.
        file: PathBuf,
        /// The .gguf file to write.
        #[arg(short, long)]
        output: PathBuf,
        /// Overwrite the output file if it exists.
        #[arg(long)]
        force: bool,
        /// Print a JSON summary on stdout.
        #[arg(long)]
        json: bool,
    },
    /// Convert a GGUF file (llama, qwen2, qwen3, gemma3, phi3, glm4, chatglm, bert) to .kiln;
    /// F32/F16/BF16/Q8_0/Q4_0/Q5_0/Q5_1/Q2_K…Q6_K/IQ4_NL/IQ4_XS matrices are kept byte for byte, Q4_1
    /// ones are dequantized (see --dequantize-to), quantized 1-D tensors become F32.
    #[command(
        after_help = "Example:\n  kiln-convert gguf SmolLM2-135M-Instruct.Q4_1.gguf -o smollm2.kiln"
    )]
    Gguf {
        /// The .gguf file.
        file: PathBuf,
        /// The .kiln file to write.
        #[arg(short, long)]
        output: PathBuf,
        /// Dtype for matrices of GGML types Kiln does not store (Q4_1), and for every matrix
        /// with --dequantize-all.
        #[arg(long, value_enum, default_value = "f16")]
        dequantize_to: FloatType,
        /// Dequantize the block types Kiln keeps too (Q8_0, Q4_0, Q5_0, Q5_1, Q4_K, Q5_K,
        /// Q6_K), so that every matrix is in --dequantize-to
        /// (to compare the model with a float runtime given the same dequantized weights).
        #[arg(long)]
        dequantize_all: bool,
        /// Overwrite the output file if it exists.
        #[arg(long)]
        force: bool,
        /// Import tensors holding NaN or infinity (with a warning) instead of refusing.
        #[arg(long)]
        allow_non_finite: bool,
        /// Print a JSON summary on stdout.
        #[arg(long)]
        json: bool,
    },
    /// Show a .kiln file's metadata and tensor table; --verify checks every checksum and value.
    #[command(after_help = "Example:\n  kiln-convert inspect smollm2.kiln --verify")]
    Inspect {
        /// The .kiln file.
        file: PathBuf,
        /// Hash every tensor and compare with the index, and scan every value for NaN and
        /// infinity (exit status 1 on a mismatch or a non-finite value).
        #[arg(long)]
        verify: bool,
        /// Print JSON on stdout.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum FloatType {
    F32,
    F16,
    Bf16,
}

impl From<FloatType> for DType {
    fn from(f: FloatType) -> DType {
        match f {
            FloatType::F32 => DType::F32,
            FloatType::F16 => DType::F16,
            FloatType::Bf16 => DType::BF16,
        }
    }
}

struct Bar(ProgressBar);

impl Bar {
    fn new(what: &'static str) -> Bar {
        let pb = ProgressBar::with_draw_target(None, indicatif::ProgressDrawTarget::stderr());
        pb.set_style(
            ProgressStyle::with_template(
                "{prefix} [{bar:30}] {bytes}/{total_bytes} {binary_bytes_per_sec} {msg} ETA {eta}",
            )
            .expect("valid template")
            .progress_chars("=> "),
        );
        pb.set_prefix(what);
        Bar(pb)
    }
}

impl Progress for Bar {
    fn start(&self, bytes: u64, items: usize) {
        self.0.set_length(bytes);
        self.0.set_message(format!("0/{items} tensors"));
        self.0.set_position(0);
        // Store the total in the message template's state.
        *TOTAL.lock().unwrap_or_else(|e| e.into_inner()) = (0, items);
    }
    fn advance(&self, bytes: u64, items: usize) {
        self.0.inc(bytes);
        if items > 0 {
            let mut t = TOTAL.lock().unwrap_or_else(|e| e.into_inner());
            t.0 += items;
            self.0.set_message(format!("{}/{} tensors", t.0, t.1));
        }
    }
    fn finish(&self) {
        self.0.finish_and_clear();
    }
}

static TOTAL: std::sync::Mutex<(usize, usize)> = std::sync::Mutex::new((0, 0));

fn print_stdout(s: &str) {
    let mut out = std::io::stdout().lock();
    // A closed pipe (`| head`) is not an error worth reporting.
    let _ = out.write_all(s.as_bytes()).and_then(|_| out.flush());
}

fn run(cli: Cli) -> Result<ExitStatus, kiln_convert::ConvertError> {
    match cli.command {
        Command::Hf {
            dir,
            output,
            dtype,
            force,
            allow_non_finite,
            json,
        } => {
            let opts = ConvertOptions {
                input: dir,
                output,
                dtype: dtype.map(DType::from),
                overwrite: force,
                allow_non_finite,
            };
            run_hf(&opts, json)
        }
        Command::ExportGguf {
            file,
            output,
            force,
            json,
        } => {
            let opts = ExportOptions {
                input: file,
                output,
                overwrite: force,
            };
            run_export_gguf(&opts, json)
        }
        Command::Gguf {
            file,
            output,
            dequantize_to,
            dequantize_all,
            force,
            allow_non_finite,
            json,
        } => {
            let opts = ImportOptions {
                input: file,
                output,
                overwrite: force,
                dequantize_to: dequantize_to.into(),
                dequantize_all,
                allow_non_finite,
            };
            run_import_gguf(&opts, json)
        }
        Command::Inspect { file, verify, json } => run_inspect(&file, verify, json),
    }
}

/// `kiln-convert hf`: convert, then report what was written, skipped and let through.
fn run_hf(opts: &ConvertOptions, json: bool) -> Result<ExitStatus, kiln_convert::ConvertError> {
    let s = convert_hf(opts, &Bar::new("converting"))?;
    eprintln!(
        "wrote {} ({:.1} MB): {} tensors ({}) from {} ({})\n{:.1} MB of tensor data in {:.2} s ({:.2} GB/s, checksums included)\nheader sha256 {}",
        s.output,
        s.bytes_out as f64 / 1e6,
        s.tensors,
        counts(&s.dtypes),
        s.input,
        s.architecture,
        s.bytes_in as f64 / 1e6,
        s.seconds,
        s.gb_per_s,
        s.header_sha256
    );
    for t in &s.non_finite {
        eprintln!("warning: non-finite values converted as they are: {t}");
    }
    if !s.skipped.is_empty() {
        eprintln!(
            "skipped {} source tensor(s): {}",
            s.skipped.len(),
            s.skipped.join(", ")
        );
    }
    print_json_if(json, &s);
    Ok(ExitStatus::Success)
}

/// `kiln-convert export-gguf`: export, then report what was written and the notices.
fn run_export_gguf(
    opts: &ExportOptions,
    json: bool,
) -> Result<ExitStatus, kiln_convert::ConvertError> {
    let s = export_gguf(opts, &Bar::new("exporting"))?;
    eprintln!(
        "wrote {} ({:.1} MB): {} tensors ({}), architecture {}, in {:.2} s",
        s.output,
        s.bytes_out as f64 / 1e6,
        s.tensors,
        counts(&s.types),
        s.architecture,
        s.seconds
    );
    for n in &s.notices {
        eprintln!("note: {n}");
    }
    print_json_if(json, &s);
    Ok(ExitStatus::Success)
}

/// `kiln-convert gguf`: import, then report what was written and what was decoded.
fn run_import_gguf(
    opts: &ImportOptions,
    json: bool,
) -> Result<ExitStatus, kiln_convert::ConvertError> {
    let s = import_gguf(opts, &Bar::new("importing"))?;
    eprintln!(
        "wrote {} ({:.1} MB): {} tensors ({}) from {} (GGUF {}) in {:.2} s",
        s.output,
        s.bytes_out as f64 / 1e6,
        s.tensors,
        counts(&s.dtypes),
        s.input,
        s.architecture,
        s.seconds
    );
    if !s.dequantized.is_empty() {
        eprintln!(
            "note: dequantized to {} ({}): {} tensor(s)",
            opts.dequantize_to,
            if opts.dequantize_all {
                "--dequantize-all"
            } else {
                "GGML types Kiln does not store"
            },
            counts(&s.dequantized)
        );
    }
    if !s.vectors_to_f32.is_empty() {
        eprintln!(
            "note: 1-D tensors (norms, biases) stored in block types decoded to f32: {} \
             tensor(s)",
            counts(&s.vectors_to_f32)
        );
    }
    for t in &s.non_finite {
        eprintln!("warning: non-finite values imported as they are: {t}");
    }
    print_json_if(json, &s);
    Ok(ExitStatus::Success)
}

/// `kiln-convert inspect`: the report, and with `--verify` the tensors that failed.
fn run_inspect(
    file: &std::path::Path,
    verify: bool,
    json: bool,
) -> Result<ExitStatus, kiln_convert::ConvertError> {
    let i = inspect(file, verify, &Bar::new("verifying"))?;
    if json {
        print_stdout(&(serde_json::to_string_pretty(&i).expect("serializable") + "\n"));
    } else {
        print_stdout(&kiln_convert::inspect::render(&i));
    }
    match &i.verify {
        Some(v) if !v.ok => {
            let names: Vec<&str> = v.failures.iter().map(|f| f.tensor.as_str()).collect();
            if !names.is_empty() {
                eprintln!(
                    "error: {}: {} tensor checksum(s) do not match: {}",
                    i.file,
                    names.len(),
                    names.join(", ")
                );
            }
            let names: Vec<&str> = v.non_finite.iter().map(|n| n.tensor.as_str()).collect();
            if !names.is_empty() {
                eprintln!(
                    "error: {}: {} tensor(s) hold NaN or infinity: {}",
                    i.file,
                    names.len(),
                    names.join(", ")
                );
            }
            Ok(ExitStatus::VerificationFailed)
        }
        _ => Ok(ExitStatus::Success),
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // SIGINT, SIGTERM, SIGHUP: remove any half-written output, then exit with 128 + the
    // signal's number.
    kiln_format::install_interrupt_handler("kiln-convert");
    match run(cli) {
        Ok(status) => status.into(),
        Err(e) => {
            eprintln!("error: {e}");
            ExitStatus::Error.into()
        }
    }
}

/// "3 bf16, 61 f32": how many of each kind.
fn counts<'a, K: std::fmt::Display + 'a>(
    items: impl IntoIterator<Item = (&'a K, &'a usize)>,
) -> String {
    let parts: Vec<String> = items.into_iter().map(|(k, n)| format!("{n} {k}")).collect();
    parts.join(", ")
}

/// With `--json`, the summary as JSON on stdout.
fn print_json_if<T: serde::Serialize>(json: bool, summary: &T) {
    if json {
        print_stdout(&(serde_json::to_string_pretty(summary).expect("serializable") + "\n"));
    }
}
