//! `kiln-run`: generate text, chat, or benchmark a `.kiln` model on the CPU.
//!
//! A thin layer over `kiln_runner` (and `kiln_server` for `serve`): clap arguments are
//! validated into library settings, every error is printed once with its context, and a closed
//! stdout (`| head`) ends quietly.
//!
//! SIGINT, SIGTERM and SIGHUP raise an [`Interrupt`] that generation and bench check before
//! every forward pass: the run stops at the next token, prints its summary (stop reason
//! `interrupted`) and exits with 128 + the signal's number (SIGHUP 129, SIGINT 130, SIGTERM
//! 143: [`ExitStatus::Interrupted`], as in every Kiln program). A run that has not ended
//! [`SIGNAL_GRACE`](cmd::signals::SIGNAL_GRACE) after the signal (a long prefill batch, the
//! checksum pass), a second signal, or a chat waiting for input, exits at once with the same
//! status.
//!
//! This file parses the command line and dispatches; each subcommand's arguments and body
//! live in its module under [`cmd`], over the pieces they share ([`cmd::common`]).

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use kiln_format::ExitStatus;
use kiln_runner::{Interrupt, Result, RunnerError};

use cmd::bench::BenchArgs;
use cmd::chat::ChatArgs;
use cmd::embed::EmbedArgs;
use cmd::generate::GenerateArgs;
use cmd::serve::ServeArgs;
use cmd::signals::{interrupted_status, signal_name, watch_signals};

mod cmd;

#[derive(Debug, Parser)]
#[command(
    name = "kiln-run",
    version,
    about = "Run .kiln models (Llama, Mistral, Qwen2/3, Gemma 3, Phi-3, GLM families; BERT embedding models) on the CPU"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Continue a prompt (or answer it as a chat turn with --chat), streaming the text.
    Generate(GenerateArgs),
    /// Interactive multi-turn chat that keeps its KV cache between turns.
    Chat(ChatArgs),
    /// Measure prefill (ppN) and decode (tgN) throughput, like llama-bench.
    Bench(BenchArgs),
    /// Serve the model over HTTP with OpenAI's API (chat and text completions), decoding
    /// concurrent requests together; a chat page at `/`. An embedding model answers
    /// `/v1/embeddings` instead.
    Serve(ServeArgs),
    /// Embed texts with an embedding model (a converted sentence-transformers or BERT
    /// checkpoint): one vector per text, as JSON lines or a .npy file.
    #[command(after_help = "Examples:\n  \
        kiln-run embed minilm.kiln -p 'A man is eating food.' -p 'A man rides a horse.'\n  \
        kiln-run embed minilm.kiln -f sentences.txt -o vectors.npy --format npy\n  \
        cat docs.txt | kiln-run embed e5.kiln --prompt-name document")]
    Embed(EmbedArgs),
}

fn main() -> ExitCode {
    if let Some(code) = kiln_runner::sandbox::serve_if_child() {
        return code;
    }
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() {
                ExitStatus::Error.into()
            } else {
                ExitStatus::Success.into()
            };
        }
    };
    let interrupt = Interrupt::new();
    if let Err(e) = watch_signals(interrupt.clone()) {
        eprintln!(
            "kiln-run: warning: cannot watch for signals ({e}); Ctrl-C ends without a summary"
        );
    }
    let result = run(cli, &interrupt);
    if let Some(signal) = interrupt.cause() {
        match result {
            Err(e) if !e.is_broken_pipe() => {
                eprintln!("kiln-run: interrupted by {}: {e}", signal_name(signal))
            }
            _ => eprintln!("kiln-run: interrupted by {}", signal_name(signal)),
        }
        kiln_format::remove_pending_outputs();
        return interrupted_status(signal).into();
    }
    match result {
        Ok(()) => ExitStatus::Success.into(),
        Err(e) if e.is_broken_pipe() => ExitStatus::Success.into(),
        Err(e @ RunnerError::SpeculativeMismatch { .. }) => {
            eprintln!("kiln-run: error: {e}");
            ExitStatus::VerificationFailed.into()
        }
        Err(e) => {
            eprintln!("kiln-run: error: {e}");
            ExitStatus::Error.into()
        }
    }
}

fn run(cli: Cli, interrupt: &Interrupt) -> Result<()> {
    match cli.command {
        Command::Generate(a) => cmd::generate::run(a, interrupt),
        Command::Chat(a) => cmd::chat::run(a, interrupt),
        Command::Bench(a) => cmd::bench::run(a, interrupt),
        Command::Serve(a) => cmd::serve::run(a, interrupt),
        Command::Embed(a) => cmd::embed::run(a, interrupt),
    }
}
