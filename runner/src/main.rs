//! `kiln-run`: generate text, chat, or benchmark a `.kiln` model on the CPU.
//!
//! A thin layer over `kiln_runner`: clap arguments are validated into library settings, every
//! error is printed once with its context, and a closed stdout (`| head`) ends quietly.
//!
//! SIGINT, SIGTERM and SIGHUP raise an [`Interrupt`] that generation and bench check before
//! every forward pass: the run stops at the next token, prints its summary (stop reason
//! `interrupted`) and exits with 128 + the signal's number (SIGHUP 129, SIGINT 130, SIGTERM
//! 143: [`ExitStatus::Interrupted`], as in every Kiln program). A run that has not ended
//! [`SIGNAL_GRACE`] after the signal (a long prefill batch, the checksum pass), a second
//! signal, or a chat waiting for input, exits at once with the same status.

use std::ffi::OsString;
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use clap::{Args, Parser, Subcommand};
use kiln_format::{ExitStatus, KilnFile};
use kiln_runner::bench::{
    bench, matrix_paths, speculative as speculative_test, BenchOptions, BenchResult, DraftMaker,
    SpecTest,
};
use kiln_runner::draft::{same_vocabulary, Draft, DraftOptions};
use kiln_runner::embed_stream::{
    EmbedStream, GivenTexts, InputTokenizer, JsonLines, Lines, NpyWriter, RowWriter, Summary,
    TextSource,
};
use kiln_runner::generate::{generate_with_draft, DEFAULT_PREFILL_BATCH};
use kiln_runner::serve::embeddings::EmbedService;
use kiln_runner::serve::engine::{self, EngineDraft, EngineOptions};
use kiln_runner::serve::front::{self, FrontConfig, FrontModel};
use kiln_runner::serve::grammar::Grammars;
use kiln_runner::serve::prompt_cache::Reuse;
use kiln_runner::threads::{cap_notice, cap_threads, physical_cores};
use kiln_runner::{
    open_model_verified, CacheType, ChatTemplate, Compute, Conversation, GenerateOptions,
    Generation, Interrupt, Model, Result, RunnerError, Sampler, SamplerConfig, Session,
    SlidingCache, StopReason, TemplateVars, Tokenizer,
};

/// Largest prompt file `-f` reads: 64 MiB, far above any context's worth of text (128k tokens
/// of English are about half a megabyte), so only a wrong file (a disk image, a log) is refused
/// here, by its size, before anything is allocated; a smaller prompt too long for the context
/// is refused by its length before tokenizing.
const MAX_PROMPT_FILE_BYTES: u64 = 64 << 20;

/// How long the signal watcher lets a run reach its next token and print its summary before
/// it exits on its own: a forward pass over a prefill batch of a large model takes seconds.
const SIGNAL_GRACE: Duration = Duration::from_secs(2);

/// Set while `chat` waits for a line on stdin: a signal then ends the program at once.
static WAITING_FOR_INPUT: AtomicBool = AtomicBool::new(false);

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

#[derive(Debug, Args)]
struct EmbedArgs {
    /// The .kiln embedding model.
    model: PathBuf,
    /// A text to embed; repeat for several.
    #[arg(short = 'p', long = "text")]
    texts: Vec<OsString>,
    /// A file of texts, one per line; without -p or -f the texts are read from standard
    /// input, the same way. Every line is a text, empty ones too (they share one vector,
    /// computed once). Lines are read, embedded and written a batch at a time, so an input of
    /// any number of lines takes the memory of one batch; a line may hold at most 64 MiB, and
    /// one longer than the model keeps is cut before it is tokenized.
    #[arg(short = 'f', long, conflicts_with = "texts")]
    file: Option<PathBuf>,
    /// Compute threads [default: physical cores; at most the CPUs available].
    #[arg(short = 't', long, allow_negative_numbers = true,
          value_parser = kiln_format::args::at_least::<usize>(1))]
    threads: Option<usize>,
    /// Pool token states this way instead of the model's (mean, cls, last_token).
    #[arg(long, value_parser = parse_pooling)]
    pooling: Option<kiln_format::Pooling>,
    /// Scale every vector to unit length (the default when the model has a Normalize module).
    #[arg(long, conflicts_with = "no_normalize")]
    normalize: bool,
    /// Keep the vectors as pooled, even if the model normalises them.
    #[arg(long)]
    no_normalize: bool,
    /// Cut each text to this many tokens, special tokens included [default: the model's
    /// max_seq_length].
    #[arg(long, allow_negative_numbers = true,
          value_parser = kiln_format::args::at_least::<usize>(1))]
    truncate: Option<usize>,
    /// Put the model's prompt of this name before every text (e.g. `query`, `document`, as
    /// the model's config_sentence_transformers.json lists them) [default: the model's
    /// default prompt, if it names one].
    #[arg(long, conflicts_with = "prefix")]
    prompt_name: Option<String>,
    /// Put this text before every text.
    #[arg(long)]
    prefix: Option<String>,
    /// jsonl: one JSON object per text, in input order ({"index", "tokens", "truncated",
    /// "embedding"}; `index` counts texts from 0, so for -f and standard input it is the
    /// line's number less one); npy: one float32 array of (texts, dim), row i the text of
    /// index i, which needs -o.
    #[arg(long, default_value = "jsonl", value_parser = ["jsonl", "npy"])]
    format: String,
    /// Write to this file instead of standard output, atomically: vectors go to a temporary
    /// file beside it, moved into place only once every text is embedded (an error or an
    /// interrupt removes it).
    #[arg(short = 'o', long)]
    output: Option<PathBuf>,
    /// Replace the output file if it exists.
    #[arg(long)]
    force: bool,
    /// Tokens per forward pass.
    #[arg(short = 'b', long = "batch-tokens",
          default_value_t = kiln_runner::embed::DEFAULT_BATCH_TOKENS as u32,
          allow_negative_numbers = true,
          value_parser = kiln_format::args::whole::<u32>(1, 1 << 20))]
    batch_tokens: u32,
    /// Skip checking every tensor's sha256 and value before running.
    #[arg(long)]
    no_verify: bool,
}

fn parse_pooling(s: &str) -> std::result::Result<kiln_format::Pooling, String> {
    kiln_format::Pooling::ALL
        .into_iter()
        .find(|p| p.name() == s)
        .ok_or_else(|| format!("`{s}`: expected mean, cls or last_token"))
}

#[derive(Debug, Args)]
struct ServeArgs {
    #[command(flatten)]
    run: RunArgs,
    /// Sampling defaults for requests that do not set them.
    #[command(flatten)]
    sampling: SamplingArgs,
    /// Address to listen on. The default answers this machine only; 0.0.0.0 exposes the model
    /// to the network (set --api-key).
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on (0: any free port, printed when ready).
    #[arg(long, default_value_t = 8080, allow_negative_numbers = true,
          value_parser = kiln_format::args::whole::<u16>(0, 65535))]
    port: u16,
    /// Sequences decoded together; more requests wait in the queue.
    #[arg(long, default_value_t = 4, allow_negative_numbers = true,
          value_parser = kiln_format::args::whole::<u16>(1, 256))]
    parallel: u16,
    /// Requests that may wait for a sequence; beyond them the server answers 503.
    #[arg(long, default_value_t = 64, allow_negative_numbers = true,
          value_parser = kiln_format::args::whole::<u16>(1, 65535))]
    queue: u16,
    /// Require `Authorization: Bearer KEY` on the API (not on /health and the page itself).
    #[arg(long, conflicts_with = "api_key_file")]
    api_key: Option<String>,
    /// Read the API key from the first line of this file (keeps it out of the process list).
    #[arg(long)]
    api_key_file: Option<PathBuf>,
    /// Memory for finished conversations' KV caches, reused when a request continues one.
    #[arg(long, default_value_t = 256, allow_negative_numbers = true,
          value_parser = kiln_format::args::at_least::<usize>(0))]
    cache_mb: usize,
    /// What a request may reuse of a kept conversation: `exact` (whole prefill chunks of
    /// -b tokens, so that its output is what a cold request gives) or `prefix` (everything
    /// in common, as a `chat` turn: faster, but the last bits can differ).
    #[arg(long, default_value_t = Reuse::Exact)]
    cache_reuse: Reuse,
    /// Largest request body accepted, in KiB.
    #[arg(long, default_value_t = 1024, allow_negative_numbers = true,
          value_parser = kiln_format::args::at_least::<usize>(0))]
    max_body_kb: usize,
    /// Connections open at once; beyond them the server answers 503.
    #[arg(long, default_value_t = 64, allow_negative_numbers = true,
          value_parser = kiln_format::args::whole::<u16>(1, 65535))]
    max_connections: u16,
    /// Seconds a client may take to send a request, or to take a response's bytes.
    #[arg(long, default_value_t = 30, allow_negative_numbers = true,
          value_parser = kiln_format::args::at_least::<u64>(0))]
    timeout: u64,
    /// Tokens a request generates when it sets no max_tokens [default: the rest of the context].
    #[arg(short = 'n', long, allow_negative_numbers = true,
          value_parser = kiln_format::args::at_least::<usize>(0))]
    max_tokens: Option<usize>,
    /// Prompt tokens read per forward pass between decoding steps (as `generate` reads them:
    /// at the same size a request's output equals `generate`'s).
    #[arg(short = 'b', long = "batch-size", default_value_t = DEFAULT_PREFILL_BATCH as u32,
          allow_negative_numbers = true, value_parser = kiln_format::args::at_least::<u32>(1))]
    batch_size: u32,
    /// Speculative decoding (each sequence's guesses checked in the batched pass; output
    /// unchanged): --lookup or --draft, as for `generate`.
    #[command(flatten)]
    speculative: SpeculativeArgs,
    /// Set a variable the chat template reads, as transformers' `apply_chat_template(**kwargs)`
    /// does (NAME=VALUE, VALUE as JSON or a plain string).
    #[arg(long = "template-var", value_name = "NAME=VALUE")]
    template_var: Vec<String>,
}

#[derive(Debug, Args)]
struct RunArgs {
    /// The .kiln model.
    model: PathBuf,
    /// Context window in tokens [default: the model's, at most 4096].
    #[arg(long, allow_negative_numbers = true,
          value_parser = kiln_format::args::at_least::<usize>(1))]
    ctx: Option<usize>,
    /// Compute threads [default: physical cores; at most the CPUs available].
    #[arg(short = 't', long, allow_negative_numbers = true,
          value_parser = kiln_format::args::at_least::<usize>(1))]
    threads: Option<usize>,
    /// How the KV cache stores keys and values: f16 (half of f32's memory and reads), q8_0
    /// (GGML's blocks, about a quarter; heads must be a multiple of 32 wide) or f32 (exact).
    #[arg(long = "cache-type", default_value_t = CacheType::F16)]
    cache_type: CacheType,
    /// Keep every position of sliding-window layers in the KV cache, as full-attention layers
    /// do, instead of a ring of `window - 1 + 512` positions: more memory, but any rewind
    /// (a chat reusing an earlier turn) keeps its whole prefix instead of recomputing it.
    #[arg(long)]
    swa_full: bool,
    /// Skip checking every tensor's sha256, and every value for NaN and infinity, before
    /// running (for a file already verified, e.g. with `kiln-convert inspect --verify`).
    #[arg(long)]
    no_verify: bool,
}

#[derive(Debug, Args)]
struct SamplingArgs {
    /// Temperature; 0 is greedy [default: the model's generation_config, else greedy].
    #[arg(long, allow_negative_numbers = true,
          value_parser = kiln_format::args::non_negative::<f32>())]
    temp: Option<f32>,
    /// Always pick the most likely token (same as --temp 0).
    #[arg(long, conflicts_with = "temp")]
    greedy: bool,
    /// Sample from the K most likely tokens (0: all).
    #[arg(long, allow_negative_numbers = true,
          value_parser = kiln_format::args::at_least::<usize>(0))]
    top_k: Option<usize>,
    /// Sample from the smallest set of tokens with this much probability (1: all).
    #[arg(long, allow_negative_numbers = true,
          value_parser = kiln_format::args::real::<f32>(
              std::ops::Bound::Excluded(0.0),
              std::ops::Bound::Included(1.0),
          ))]
    top_p: Option<f32>,
    /// Drop tokens less likely than this fraction of the most likely one (0: off).
    #[arg(long, allow_negative_numbers = true, value_parser = kiln_format::args::fraction::<f32>())]
    min_p: Option<f32>,
    /// Penalize tokens seen in the last --repeat-last-n tokens (1: off).
    #[arg(long, allow_negative_numbers = true, value_parser = kiln_format::args::positive::<f32>())]
    repeat_penalty: Option<f32>,
    /// How many recent tokens the repetition penalty looks at.
    #[arg(long, default_value_t = 64, allow_negative_numbers = true,
          value_parser = kiln_format::args::at_least::<usize>(0))]
    repeat_last_n: usize,
    /// Random seed, for reproducible sampling [default: from the clock, printed].
    #[arg(long, allow_negative_numbers = true,
          value_parser = kiln_format::args::at_least::<u64>(0))]
    seed: Option<u64>,
}

/// Speculative decoding: guesses checked several at a time by one pass of the model. Lossless
/// either way: greedy output is token for token what plain decoding gives, sampled output has
/// the same distribution.
#[derive(Debug, Args)]
struct SpeculativeArgs {
    /// Speculative decoding by prompt lookup: guess up to N tokens per step from what followed
    /// the last few tokens earlier in the prompt or the output, and check them in the same
    /// pass (0: off). Pays off on edits, rewrites, code and summaries that repeat their input.
    #[arg(long, value_name = "N", default_value_t = 0,
          allow_negative_numbers = true, value_parser = kiln_format::args::whole::<u16>(0, 64))]
    lookup: u16,
    /// Speculative decoding with a draft model: a smaller or lower-precision .kiln with the
    /// same vocabulary (e.g. a q4_0 copy of an f16 model) proposes tokens, the model checks
    /// them. Verified as the model is, unless --no-verify.
    #[arg(long, value_name = "DRAFT.kiln", conflicts_with = "lookup")]
    draft: Option<PathBuf>,
    /// Most tokens the draft proposes per pass of the model.
    #[arg(long, value_name = "K", default_value_t = DraftOptions::default().max as u16,
          requires = "draft", allow_negative_numbers = true,
          value_parser = kiln_format::args::whole::<u16>(1, 64))]
    draft_max: u16,
    /// Fewest tokens aimed for per pass, however few get accepted: the length adapts between
    /// this and --draft-max to the acceptance rate and the measured costs of the draft and of
    /// the model's passes. With 0, drafting pauses while it does not pay (probing now and then).
    #[arg(long, value_name = "K", default_value_t = DraftOptions::default().min as u16,
          requires = "draft", allow_negative_numbers = true,
          value_parser = kiln_format::args::whole::<u16>(0, 64))]
    draft_min: u16,
    /// Stop proposing once the draft gives its next token less than this probability.
    #[arg(long, value_name = "P", default_value_t = DraftOptions::default().p_min,
          requires = "draft", allow_negative_numbers = true,
          value_parser = kiln_format::args::fraction::<f32>())]
    draft_p_min: f32,
}

#[derive(Debug, Args)]
struct GenerateArgs {
    #[command(flatten)]
    run: RunArgs,
    /// The prompt text.
    #[arg(
        short = 'p',
        long,
        required_unless_present = "file",
        conflicts_with = "file"
    )]
    prompt: Option<OsString>,
    /// Read the prompt from a file.
    #[arg(short = 'f', long)]
    file: Option<PathBuf>,
    /// Tokens to generate at most.
    #[arg(short = 'n', long, default_value_t = 128, allow_negative_numbers = true,
          value_parser = kiln_format::args::at_least::<usize>(0))]
    n_predict: usize,
    /// Prompt tokens per forward pass (matrix–matrix products; `serve -b` reads prompts the
    /// same way).
    #[arg(short = 'b', long = "batch-size", default_value_t = DEFAULT_PREFILL_BATCH as u32,
          allow_negative_numbers = true, value_parser = kiln_format::args::at_least::<u32>(1))]
    batch_size: u32,
    #[command(flatten)]
    speculative: SpeculativeArgs,
    /// Render the prompt as a user turn through the model's chat template.
    #[arg(long)]
    chat: bool,
    /// System prompt for --chat (replaces the template's default).
    #[arg(long, requires = "chat")]
    system: Option<String>,
    /// Set a variable the chat template reads, as transformers' `apply_chat_template(**kwargs)`
    /// does (repeatable): VALUE is JSON when it parses (`false`, `3`, `"x"`, `[...]`), else a
    /// string. E.g. `--template-var enable_thinking=false` for Qwen3. A special token's name
    /// (`bos_token`…) overrides it; `messages` and `add_generation_prompt` are refused.
    #[arg(long = "template-var", value_name = "NAME=VALUE", requires = "chat")]
    template_var: Vec<String>,
    /// Keep generating past end-of-sequence tokens.
    #[arg(long)]
    ignore_eos: bool,
    /// Print one JSON object on stdout instead of streaming text.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    sampling: SamplingArgs,
}

#[derive(Debug, Args)]
struct ChatArgs {
    #[command(flatten)]
    run: RunArgs,
    /// System prompt (replaces the template's default).
    #[arg(long)]
    system: Option<String>,
    /// Set a variable the chat template reads, as transformers' `apply_chat_template(**kwargs)`
    /// does (repeatable): VALUE is JSON when it parses (`false`, `3`, `"x"`, `[...]`), else a
    /// string. E.g. `--template-var enable_thinking=false` for Qwen3. A special token's name
    /// (`bos_token`…) overrides it; `messages` and `add_generation_prompt` are refused.
    #[arg(long = "template-var", value_name = "NAME=VALUE")]
    template_var: Vec<String>,
    /// Tokens per reply at most.
    #[arg(short = 'n', long, default_value_t = 512, allow_negative_numbers = true,
          value_parser = kiln_format::args::at_least::<usize>(0))]
    n_predict: usize,
    /// Prompt tokens per forward pass (matrix–matrix products; `serve -b` reads prompts the
    /// same way).
    #[arg(short = 'b', long = "batch-size", default_value_t = DEFAULT_PREFILL_BATCH as u32,
          allow_negative_numbers = true, value_parser = kiln_format::args::at_least::<u32>(1))]
    batch_size: u32,
    #[command(flatten)]
    speculative: SpeculativeArgs,
    #[command(flatten)]
    sampling: SamplingArgs,
}

#[derive(Debug, Args)]
struct BenchArgs {
    /// The .kiln model.
    model: PathBuf,
    /// Prompt tokens for the prefill test (0: skip).
    #[arg(short = 'p', long = "n-prompt", default_value_t = 128, allow_negative_numbers = true,
          value_parser = kiln_format::args::at_least::<usize>(0))]
    n_prompt: usize,
    /// Tokens for the generation test (0: skip).
    #[arg(short = 'n', long = "n-gen", default_value_t = 64, allow_negative_numbers = true,
          value_parser = kiln_format::args::at_least::<usize>(0))]
    n_gen: usize,
    /// Repetitions of each test.
    #[arg(short = 'r', long, default_value_t = 3, allow_negative_numbers = true,
          value_parser = kiln_format::args::at_least::<usize>(1))]
    repetitions: usize,
    /// Thread counts to test, comma-separated [default: physical cores].
    #[arg(short = 't', long, value_delimiter = ',', allow_negative_numbers = true,
          value_parser = kiln_format::args::at_least::<usize>(1))]
    threads: Vec<usize>,
    /// Tokens already in the KV cache when each test starts, comma-separated (like
    /// llama-bench -d): `pp512 @ d4096` is a 512-token prompt after 4096 cached tokens.
    #[arg(short = 'd', long, value_delimiter = ',', default_value = "0",
          allow_negative_numbers = true, value_parser = kiln_format::args::at_least::<usize>(0))]
    depth: Vec<usize>,
    /// Most prompt tokens per forward pass (like llama-bench -ub): a longer prompt is run in
    /// batches of this size, as `generate` and `chat` run it.
    #[arg(short = 'b', long = "batch-size", default_value_t = DEFAULT_PREFILL_BATCH,
          allow_negative_numbers = true, value_parser = kiln_format::args::at_least::<usize>(1))]
    batch_size: usize,
    /// How the KV cache stores keys and values: f16 (half of f32's memory and reads), q8_0
    /// (GGML's blocks, about a quarter; heads must be a multiple of 32 wide) or f32 (exact).
    #[arg(long = "cache-type", default_value_t = CacheType::F16)]
    cache_type: CacheType,
    /// Keep every position of sliding-window layers in the KV cache, as full-attention layers
    /// do, instead of a ring of `window - 1 + 512` positions: more memory, but any rewind
    /// (a chat reusing an earlier turn) keeps its whole prefix instead of recomputing it.
    #[arg(long)]
    swa_full: bool,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// Also print the product each distinct matrix (shape, encoding) takes at decode (one
    /// token) and at the prefill batch (`min(-p, -b)` tokens): tiles, lanes, k-lanes…
    #[arg(short = 'v', long)]
    verbose: bool,
    /// Skip checking every tensor's sha256, and every value for NaN and infinity, before
    /// running.
    #[arg(long)]
    no_verify: bool,
    /// With --lookup or --draft: a text prompt whose greedy continuation (-n tokens at most)
    /// is generated plainly and speculatively in turn, reporting both rates, the guesses'
    /// acceptance, tokens per pass and the speedup.
    #[arg(short = 'f', long, value_name = "FILE")]
    file: Option<PathBuf>,
    /// Render -f's text as a user turn through the model's chat template.
    #[arg(long, requires = "file")]
    chat: bool,
    #[command(flatten)]
    speculative: SpeculativeArgs,
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
        Command::Generate(a) => cmd_generate(a, interrupt),
        Command::Chat(a) => cmd_chat(a, interrupt),
        Command::Bench(a) => cmd_bench(a, interrupt),
        Command::Serve(a) => cmd_serve(a, interrupt),
        Command::Embed(a) => cmd_embed(a, interrupt),
    }
}

/// The exit status for a run stopped by `signal`: 128 + its number.
fn interrupted_status(signal: usize) -> ExitStatus {
    ExitStatus::Interrupted(i32::try_from(signal).unwrap_or(0))
}

fn signal_name(signal: usize) -> &'static str {
    kiln_format::signal_name(i32::try_from(signal).unwrap_or(0))
}

/// Watch SIGINT, SIGTERM and SIGHUP on a thread of its own. The first raises `interrupt`, and
/// the run stops at its next token; if it has not ended within [`SIGNAL_GRACE`], or a second
/// signal comes, or `chat` is waiting for input, the watcher removes unfinished outputs and
/// exits with the signal's status itself.
fn watch_signals(interrupt: Interrupt) -> std::io::Result<()> {
    let mut signals = signal_hook::iterator::Signals::new(kiln_format::exit::INTERRUPT_SIGNALS)?;
    std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || {
            let Some(signal) = signals.forever().next() else {
                return;
            };
            let signal = usize::try_from(signal).unwrap_or(0);
            interrupt.raise(signal);
            let deadline = Instant::now() + SIGNAL_GRACE;
            while Instant::now() < deadline && !WAITING_FOR_INPUT.load(Ordering::SeqCst) {
                if signals.pending().next().is_some() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            if WAITING_FOR_INPUT.load(Ordering::SeqCst) {
                eprintln!();
            }
            eprintln!("kiln-run: interrupted by {}", signal_name(signal));
            kiln_format::remove_pending_outputs();
            std::process::exit(i32::from(interrupted_status(signal).code()));
        })?;
    Ok(())
}

/// A `--threads` value: at least one, at most the CPUs available (with a notice).
fn threads_arg(t: Option<usize>) -> Result<usize> {
    match t {
        Some(0) => Err(RunnerError::InvalidArgument {
            arg: "--threads",
            reason: "0; at least one thread is needed".into(),
        }),
        Some(n) => {
            if let Some(notice) = cap_notice(n) {
                eprintln!("kiln-run: {notice}");
            }
            Ok(cap_threads(n))
        }
        None => Ok(physical_cores()),
    }
}

/// The prompt as UTF-8, from `-p` or `-f`.
fn prompt_text(prompt: Option<OsString>, file: Option<&Path>) -> Result<String> {
    let (bytes, source_name) = match (prompt, file) {
        (Some(p), _) => (p.into_encoded_bytes(), "given with -p".to_string()),
        (None, Some(f)) => (
            kiln_format::read_bounded(f, MAX_PROMPT_FILE_BYTES, "prompt")?,
            format!("in {}", f.display()),
        ),
        (None, None) => unreachable!("clap requires -p or -f"),
    };
    String::from_utf8(bytes).map_err(|e| RunnerError::PromptNotUtf8 {
        source_name,
        offset: e.utf8_error().valid_up_to(),
    })
}

/// Sampling settings: the file's generation_config.json defaults, overridden by flags.
fn sampler_config(file: &str, gen: &serde_json::Value, a: &SamplingArgs) -> Result<SamplerConfig> {
    let num = |k: &str| gen.get(k).and_then(serde_json::Value::as_f64);
    let do_sample = gen.get("do_sample").and_then(serde_json::Value::as_bool) == Some(true);
    let mut c = SamplerConfig {
        repetition_penalty: num("repetition_penalty").unwrap_or(1.0) as f32,
        repeat_last_n: a.repeat_last_n,
        seed: a.seed.unwrap_or_else(clock_seed),
        ..SamplerConfig::default()
    };
    if do_sample {
        // transformers' GenerationConfig defaults: temperature 1, top_k 50, top_p 1.
        c.temperature = num("temperature").unwrap_or(1.0) as f32;
        c.top_k = num("top_k").unwrap_or(50.0) as usize;
        c.top_p = num("top_p").unwrap_or(1.0) as f32;
        c.min_p = num("min_p").unwrap_or(0.0) as f32;
    }
    if let Some(t) = a.temp {
        c.temperature = t;
    }
    if a.greedy {
        c.temperature = 0.0;
    }
    if let Some(k) = a.top_k {
        c.top_k = k;
    }
    if let Some(p) = a.top_p {
        c.top_p = p;
    }
    if let Some(p) = a.min_p {
        c.min_p = p;
    }
    if let Some(r) = a.repeat_penalty {
        c.repetition_penalty = r;
    }
    // A value no flag replaced came from the file: blame generation_config.json, not the flag.
    match c.validate() {
        Err(RunnerError::InvalidArgument { arg, reason }) => {
            let from_flag = match arg {
                "--temp" => a.temp.is_some() || a.greedy,
                "--top-p" => a.top_p.is_some(),
                "--min-p" => a.min_p.is_some(),
                "--repeat-penalty" => a.repeat_penalty.is_some(),
                _ => true,
            };
            if from_flag {
                Err(RunnerError::InvalidArgument { arg, reason })
            } else {
                Err(RunnerError::BadGenerationConfig {
                    file: file.to_string(),
                    field: generation_key(arg),
                    reason,
                    flag: arg,
                })
            }
        }
        other => other.map(|()| c),
    }
}

/// The generation_config.json key behind a sampling flag.
fn generation_key(flag: &str) -> &'static str {
    match flag {
        "--temp" => "temperature",
        "--top-p" => "top_p",
        "--min-p" => "min_p",
        _ => "repetition_penalty",
    }
}

fn clock_seed() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

/// A model opened for generation.
struct Loaded<'f> {
    model: Model<'f>,
    tokenizer: Tokenizer,
}

fn load(file: &KilnFile) -> Result<Loaded<'_>> {
    Ok(Loaded {
        model: Model::load(file)?,
        tokenizer: Tokenizer::from_file(file)?,
    })
}

/// The `--draft` file, opened and verified as the model is.
fn open_draft(spec: &SpeculativeArgs, no_verify: bool) -> Result<Option<KilnFile>> {
    spec.draft
        .as_deref()
        .map(|p| open_model_verified(p, !no_verify))
        .transpose()
}

/// A draft over `loaded` (when `--draft` gave one) for the model `target`, on the threads of
/// its session (the draft's context is the session's, at most its own model's).
fn make_draft<'d>(
    loaded: Option<&'d Loaded<'d>>,
    spec: &SpeculativeArgs,
    (cache_type, swa_full): (CacheType, bool),
    target: &Loaded<'_>,
    target_session: &Session<'_>,
    prefill_batch: usize,
) -> Result<Option<Draft<'d>>> {
    let Some(loaded) = loaded else {
        return Ok(None);
    };
    let ctx = target_session
        .ctx()
        .min(loaded.model.config.max_position_embeddings.max(1));
    let sess = target_session.alongside(&loaded.model, ctx, cache_type, sliding(swa_full))?;
    Draft::new(
        sess,
        &loaded.tokenizer,
        &target.tokenizer,
        target.model.config.vocab,
        DraftOptions {
            max: usize::from(spec.draft_max),
            min: usize::from(spec.draft_min),
            p_min: spec.draft_p_min,
            prefill_batch,
        },
    )
    .map(Some)
}

fn session<'m>(model: &'m Model<'m>, run: &RunArgs, threads: usize) -> Result<Session<'m>> {
    let ctx = run.ctx.unwrap_or_else(|| model.default_ctx());
    model.session_sliding(ctx, threads, run.cache_type, sliding(run.swa_full))
}

/// How sessions keep sliding-window layers: `--swa-full` keeps every position.
fn sliding(full: bool) -> SlidingCache {
    if full {
        SlidingCache::Full
    } else {
        SlidingCache::default()
    }
}

fn stdout_writer() -> impl FnMut(&str) -> Result<()> {
    let mut out = std::io::stdout();
    move |s: &str| {
        out.write_all(s.as_bytes())
            .and_then(|()| out.flush())
            .map_err(|e| RunnerError::io("writing to stdout", e))
    }
}

fn print_summary(load_ms: f64, g: &Generation) {
    let s = &g.stats;
    eprintln!(
        "\n[load {load_ms:.0} ms | prompt {} tokens, prefill {:.1} tok/s | generated {} tokens, \
         decode {:.1} tok/s{} | stop: {}]",
        s.prompt_tokens,
        s.prefill_tok_s(),
        s.generated_tokens,
        s.decode_tok_s(),
        lookup_summary(s),
        g.stop.name(),
    );
}

/// ", N of M guesses accepted, T tokens per pass" when guesses were checked.
fn lookup_summary(s: &kiln_runner::generate::Stats) -> String {
    if s.drafted_tokens == 0 {
        return String::new();
    }
    format!(
        ", {} of {} guesses accepted ({:.0}%), {:.2} tokens per pass",
        s.accepted_tokens,
        s.drafted_tokens,
        100.0 * s.acceptance(),
        s.tokens_per_pass()
    )
}

fn cmd_generate(a: GenerateArgs, interrupt: &Interrupt) -> Result<()> {
    let threads = threads_arg(a.run.threads)?;
    let vars = template_vars(&a.template_var)?;
    let text = prompt_text(a.prompt, a.file.as_deref())?;
    let t0 = Instant::now();
    let file = open_model_verified(&a.run.model, !a.run.no_verify)?;
    let m = load(&file)?;
    let mut sess = session(&m.model, &a.run, threads)?;
    let draft_file = open_draft(&a.speculative, a.run.no_verify)?;
    let draft_loaded = draft_file.as_ref().map(load).transpose()?;
    let mut draft = make_draft(
        draft_loaded.as_ref(),
        &a.speculative,
        (a.run.cache_type, a.run.swa_full),
        &m,
        &sess,
        a.batch_size as usize,
    )?;
    let sampling = sampler_config(file.label(), &file.metadata().generation, &a.sampling)?;
    m.tokenizer.check_fits(&text, sess.ctx())?;
    let ids = if a.chat {
        let template = isolated_template(&file)?.with_vars(vars);
        let conv = Conversation::new(&template, a.system.as_deref());
        let rendered = conv.prompt_for(&text)?;
        m.tokenizer.check_fits(&rendered, sess.ctx())?;
        m.tokenizer.encode_rendered(&rendered)?
    } else {
        m.tokenizer.encode(&text)?
    };
    if ids.is_empty() {
        return Err(RunnerError::EmptyPrompt);
    }
    let load_ms = t0.elapsed().as_secs_f64() * 1e3;
    let opts = GenerateOptions {
        max_tokens: a.n_predict,
        ignore_eos: a.ignore_eos,
        prefill_batch: a.batch_size as usize,
        interrupt: Some(interrupt.clone()),
        lookup: usize::from(a.speculative.lookup),
    };
    let seed = sampling.seed;
    let mut sampler = Sampler::new(sampling);
    if a.json {
        let g = generate_with_draft(
            &mut sess,
            draft.as_mut(),
            &m.tokenizer,
            &ids,
            &opts,
            &mut sampler,
            &mut |_| Ok(()),
        )?;
        let s = &g.stats;
        let out = serde_json::json!({
            "text": g.text,
            "tokens": g.tokens,
            "prompt_tokens": s.prompt_tokens,
            "generated_tokens": s.generated_tokens,
            "prefill_tok_s": s.prefill_tok_s(),
            "decode_tok_s": s.decode_tok_s(),
            "decode_passes": s.decode_steps,
            "drafted_tokens": s.drafted_tokens,
            "accepted_tokens": s.accepted_tokens,
            "acceptance": s.acceptance(),
            "tokens_per_pass": s.tokens_per_pass(),
            "load_ms": load_ms,
            "stop": g.stop,
            "seed": seed,
            "threads": sess.threads(),
            "ctx": sess.ctx(),
            "cache_type": sess.cache_type().name(),
            "cache_bytes": sess.cache_bytes(),
        });
        println!("{out}");
    } else {
        let g = generate_with_draft(
            &mut sess,
            draft.as_mut(),
            &m.tokenizer,
            &ids,
            &opts,
            &mut sampler,
            &mut stdout_writer(),
        )?;
        stdout_writer()("\n")?;
        print_summary(load_ms, &g);
    }
    Ok(())
}

fn cmd_chat(a: ChatArgs, interrupt: &Interrupt) -> Result<()> {
    let threads = threads_arg(a.run.threads)?;
    let vars = template_vars(&a.template_var)?;
    let t0 = Instant::now();
    let file = open_model_verified(&a.run.model, !a.run.no_verify)?;
    let m = load(&file)?;
    let template = isolated_template(&file)?.with_vars(vars);
    let mut sess = session(&m.model, &a.run, threads)?;
    let draft_file = open_draft(&a.speculative, a.run.no_verify)?;
    let draft_loaded = draft_file.as_ref().map(load).transpose()?;
    let mut draft = make_draft(
        draft_loaded.as_ref(),
        &a.speculative,
        (a.run.cache_type, a.run.swa_full),
        &m,
        &sess,
        a.batch_size as usize,
    )?;
    let mut sampler = Sampler::new(sampler_config(
        file.label(),
        &file.metadata().generation,
        &a.sampling,
    )?);
    let opts = GenerateOptions {
        max_tokens: a.n_predict,
        prefill_batch: a.batch_size as usize,
        interrupt: Some(interrupt.clone()),
        lookup: usize::from(a.speculative.lookup),
        ..GenerateOptions::default()
    };
    eprintln!(
        "[loaded {} in {:.0} ms: {} layers, ctx {} ({} KV cache, {:.0} MiB), {} threads; /reset clears, /exit or EOF quits]",
        a.run.model.display(),
        t0.elapsed().as_secs_f64() * 1e3,
        m.model.config.layers,
        sess.ctx(),
        sess.cache_type(),
        sess.cache_bytes() as f64 / (1 << 20) as f64,
        sess.threads()
    );
    let mut conv = Conversation::new(&template, a.system.as_deref());
    let stdin = std::io::stdin();
    let mut line = String::new();
    loop {
        if interrupt.is_raised() {
            break;
        }
        WAITING_FOR_INPUT.store(true, Ordering::SeqCst);
        eprint!("> ");
        line.clear();
        let read = stdin.lock().read_line(&mut line);
        WAITING_FOR_INPUT.store(false, Ordering::SeqCst);
        let n = read.map_err(|e| RunnerError::io("reading stdin", e))?;
        if n == 0 {
            break;
        }
        let input = line.trim_end_matches(['\n', '\r']);
        match input.trim() {
            "" => continue,
            "/exit" | "/quit" => break,
            "/reset" => {
                conv = Conversation::new(&template, a.system.as_deref());
                sess.reset();
                continue;
            }
            _ => {}
        }
        match conv.turn(
            &mut sess,
            draft.as_mut(),
            &m.tokenizer,
            input,
            &opts,
            &mut sampler,
            &mut stdout_writer(),
        ) {
            Ok(g) => {
                stdout_writer()("\n")?;
                let s = &g.stats;
                let stop = if g.stop == StopReason::Interrupted {
                    " | stop: interrupted"
                } else {
                    ""
                };
                eprintln!(
                    "[{} new prompt tokens ({} cached), {:.1} tok/s | {} tokens, {:.1} tok/s{}{stop}]",
                    s.prefill_tokens,
                    s.prompt_tokens - s.prefill_tokens,
                    s.prefill_tok_s(),
                    s.generated_tokens,
                    s.decode_tok_s(),
                    lookup_summary(s)
                );
            }
            // The conversation outgrew the context: say so and keep the session usable.
            Err(e @ (RunnerError::ContextOverflow { .. } | RunnerError::PromptTooLong { .. })) => {
                eprintln!("kiln-run: {e}; use /reset to start over");
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Where `kiln-run embed` reads its texts: its -p texts, the lines of -f, or standard
/// input's, read as they are embedded.
fn embed_source(a: &EmbedArgs) -> Result<Box<dyn TextSource>> {
    if !a.texts.is_empty() {
        let texts = a
            .texts
            .iter()
            .map(|t| prompt_text(Some(t.clone()), None))
            .collect::<Result<Vec<_>>>()?;
        return Ok(Box::new(GivenTexts::new(texts)));
    }
    Ok(match &a.file {
        Some(f) => Box::new(Lines::open(f)?),
        None => Box::new(Lines::new(std::io::stdin().lock(), "standard input")),
    })
}

/// Refuse `embed`'s output before anything is read: .npy without -o, a destination that
/// exists (without --force) or is not a regular file, or one that is an input.
fn check_embed_output(a: &EmbedArgs) -> Result<()> {
    if a.format == "npy" && a.output.is_none() {
        return Err(RunnerError::InvalidArgument {
            arg: "--format",
            reason: "npy is binary: name a file with -o".into(),
        });
    }
    if let Some(out) = &a.output {
        kiln_format::check_destination(out, a.force)?;
        // Neither the model nor the texts' file may be replaced by the vectors.
        let inputs = std::iter::once(a.model.as_path()).chain(a.file.as_deref());
        kiln_format::refuse_output_is_input(out, inputs)?;
    }
    Ok(())
}

/// `kiln-run embed`: texts through the model a batch at a time
/// ([`kiln_runner::embed_stream`]), each vector written as it comes; with -o, to a temporary
/// file that only a finished run moves into place.
fn cmd_embed(a: EmbedArgs, interrupt: &Interrupt) -> Result<()> {
    use kiln_runner::embed::{input_prefix, EmbedOptions, Embedder};
    let threads = threads_arg(a.threads)?;
    check_embed_output(&a)?;
    let mut source = embed_source(&a)?;
    let file = open_model_verified(&a.model, !a.no_verify)?;
    let m = load(&file)?;
    let opts = EmbedOptions {
        pooling: a.pooling,
        normalize: (a.normalize || a.no_normalize).then_some(a.normalize),
        truncate: a.truncate,
        batch_tokens: a.batch_tokens as usize,
    };
    let mut embedder = Embedder::new(&m.model, file.label(), threads, &opts)?;
    let prefix = input_prefix(
        m.model.config.embedding.as_ref(),
        a.prefix.as_deref(),
        a.prompt_name.as_deref(),
    )?;
    let tokenizer = InputTokenizer::new(&m.tokenizer, embedder.max_tokens())?;
    let norm = if embedder.normalizes() {
        ", normalised"
    } else {
        ""
    };
    let settings = format!(
        "{} dims, {} pooling{norm}",
        embedder.dim(),
        embedder.pooling().name(),
    );
    let mut stream = EmbedStream::new(&mut embedder, &tokenizer, &prefix);
    let show = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let mut progress = |done: u64| {
        if show && done > 64 {
            eprint!("\rkiln-run: embedded {done} texts");
        }
    };
    let t0 = Instant::now();
    let done = match &a.output {
        Some(path) => embed_to_file(
            &mut stream,
            &mut *source,
            path,
            &a,
            interrupt,
            &mut progress,
        )?,
        None => {
            let stdout = std::io::BufWriter::new(std::io::stdout().lock());
            let mut out = JsonLines::new(stdout, "standard output");
            let done = stream.run(&mut *source, &mut out, Some(interrupt), &mut progress)?;
            if !done.interrupted {
                out.finish()?;
            }
            done
        }
    };
    if show && done.texts > 64 {
        eprintln!();
    }
    let Some(path) = a.output.as_ref().filter(|_| !done.interrupted) else {
        return Ok(());
    };
    let secs = t0.elapsed().as_secs_f64();
    eprintln!(
        "kiln-run: {} texts ({} tokens) → {} ({settings}) in {secs:.2} s, {:.1} texts/s",
        done.texts,
        done.tokens,
        path.display(),
        done.texts as f64 / secs.max(1e-9),
    );
    Ok(())
}

/// Embed `source` into `-o`'s temporary file and move it into place once every text is
/// written; an error or an interrupt drops it unfinished, which removes it.
fn embed_to_file(
    stream: &mut EmbedStream<'_, '_, '_>,
    source: &mut dyn TextSource,
    path: &Path,
    a: &EmbedArgs,
    interrupt: &Interrupt,
    progress: &mut dyn FnMut(u64),
) -> Result<Summary> {
    let output = kiln_format::AtomicFile::create(path, a.force)?;
    let name = path.display().to_string();
    let mut out: Box<dyn RowWriter> = if a.format == "npy" {
        Box::new(NpyWriter::new(output.file(), stream.embedder.dim(), name)?)
    } else {
        Box::new(JsonLines::new(std::io::BufWriter::new(output.file()), name))
    };
    let done = stream.run(source, &mut *out, Some(interrupt), progress)?;
    if !done.interrupted {
        out.finish()?;
        drop(out);
        output.commit()?;
    }
    Ok(done)
}

fn cmd_bench(a: BenchArgs, interrupt: &Interrupt) -> Result<()> {
    let threads: Vec<usize> = if a.threads.is_empty() {
        vec![physical_cores()]
    } else {
        a.threads
            .iter()
            .map(|&t| threads_arg(Some(t)))
            .collect::<Result<_>>()?
    };
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
    let t0 = Instant::now();
    let file = open_model_verified(&a.model, !a.no_verify)?;
    let loaded = load(&file)?;
    let model = &loaded.model;
    let load_ms = t0.elapsed().as_secs_f64() * 1e3;
    let prompt: Vec<u32> = match &a.file {
        Some(f) => {
            let text = prompt_text(None, Some(f))?;
            let ids = if a.chat {
                let template = isolated_template(&file)?;
                let rendered = Conversation::new(&template, None).prompt_for(&text)?;
                loaded.tokenizer.encode_rendered(&rendered)?
            } else {
                loaded.tokenizer.encode(&text)?
            };
            if ids.is_empty() {
                return Err(RunnerError::EmptyPrompt);
            }
            ids
        }
        None => Vec::new(),
    };
    let draft_file = open_draft(&a.speculative, a.no_verify)?;
    let draft_loaded = draft_file.as_ref().map(load).transpose()?;
    let depth_max = a.depth.iter().copied().max().unwrap_or(0);
    let ctx = depth_max
        .checked_add(a.n_prompt.max(a.n_gen).max(1))
        .ok_or(RunnerError::InvalidArgument {
            arg: "--depth",
            reason: "too large".into(),
        })?
        .max(prompt.len().saturating_add(a.n_gen));
    // The deepest test's context, weighed before any session builds it.
    model.check_context(ctx, a.cache_type, sliding(a.swa_full), "--depth")?;
    let mut results: Vec<BenchResult> = Vec::new();
    'threads: for &t in &threads {
        let mut sess = model.session_sliding(ctx, t, a.cache_type, sliding(a.swa_full))?;
        for &depth in &a.depth {
            let opts = BenchOptions {
                prompt_tokens: a.n_prompt,
                gen_tokens: a.n_gen,
                reps: a.repetitions,
                warmup: true,
                depth,
                batch: a.batch_size,
                interrupt: Some(interrupt.clone()),
            };
            results.extend(bench(&mut sess, &opts)?);
            // Interrupted: report the tests measured so far.
            if interrupt.is_raised() {
                break 'threads;
            }
        }
        if speculative {
            let opts = BenchOptions {
                prompt_tokens: 0,
                gen_tokens: a.n_gen,
                reps: a.repetitions,
                warmup: true,
                depth: 0,
                batch: a.batch_size,
                interrupt: Some(interrupt.clone()),
            };
            let mut make = |target: &Session<'_>| {
                make_draft(
                    draft_loaded.as_ref(),
                    &a.speculative,
                    (a.cache_type, a.swa_full),
                    &loaded,
                    target,
                    a.batch_size,
                )
                .map(|d| d.expect("--draft was given"))
            };
            let label = match &a.speculative.draft {
                Some(d) => format!(
                    "draft {}",
                    d.file_name().map_or(d.display().to_string(), |n| n
                        .to_string_lossy()
                        .into_owned())
                ),
                None => format!("lookup {}", a.speculative.lookup),
            };
            let mut test = SpecTest {
                prompt: &prompt,
                tokenizer: &loaded.tokenizer,
                lookup: usize::from(a.speculative.lookup),
                draft: draft_loaded
                    .is_some()
                    .then_some(&mut make as &mut DraftMaker<'_>),
                label,
            };
            results.extend(speculative_test(&mut sess, &mut test, &opts)?);
            if interrupt.is_raised() {
                break 'threads;
            }
        }
    }
    let weights = weight_summary(&file);
    let paths = a.verbose.then(|| {
        let prefill = a.n_prompt.min(a.batch_size).max(1);
        matrix_paths(model, kiln_kernels::active(), prefill)
    });
    let mut out = std::io::stdout();
    let w = |e| RunnerError::io("writing to stdout", e);
    if a.json {
        let mut v = serde_json::json!({
            "model": a.model.display().to_string(),
            "weights": weights,
            "size_bytes": file.file_len(),
            "load_ms": load_ms,
            "isa": format!("{:?}", kiln_kernels::isa()),
            "cache_type": a.cache_type.name(),
            "results": results,
        });
        if let Some(p) = &paths {
            v["matrix_paths"] = serde_json::json!(p);
        }
        writeln!(out, "{v}").map_err(w)?;
    } else {
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
        for r in &results {
            writeln!(
                out,
                "| {name} | {weights} | {:.1} MiB | {:?} | {} | {} | {} | {:.2} ± {:.2} | {:.2} | {:.2} |",
                file.file_len() as f64 / (1 << 20) as f64,
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
        let spec: Vec<&BenchResult> = results.iter().filter(|r| r.speedup.is_some()).collect();
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
        if paths.is_some() {
            writeln!(
                out,
                "\n| matrices | rows × cols | weights | decode (1 tok) | prefill |"
            )
            .map_err(w)?;
            writeln!(out, "|---|--:|---|---|---|").map_err(w)?;
        }
        for p in paths.iter().flatten() {
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
    }
    Ok(())
}

/// `--template-var NAME=VALUE` arguments, checked before the model is loaded.
fn template_vars(args: &[String]) -> Result<TemplateVars> {
    let mut vars = TemplateVars::new();
    for a in args {
        vars.set_assignment(a)?;
    }
    Ok(vars)
}

/// The file's chat template, rendered in a child process with memory and CPU limits
/// ([`kiln_runner::sandbox`]): the template is untrusted code from the model file.
fn isolated_template(file: &KilnFile) -> Result<ChatTemplate<'_>> {
    let exe = std::env::current_exe().map_err(|e| {
        RunnerError::ChatTemplate(format!(
            "cannot find kiln-run's own executable to render the template in: {e}"
        ))
    })?;
    Ok(ChatTemplate::from_file(file)?.isolated(exe))
}

/// The matrices' dtypes, e.g. `bf16` or `q4_0+f32`.
fn weight_summary(file: &KilnFile) -> String {
    let mut dtypes: Vec<String> = file
        .tensors()
        .iter()
        .filter(|t| t.shape.len() == 2)
        .map(|t| t.dtype.to_string())
        .collect();
    dtypes.sort();
    dtypes.dedup();
    dtypes.join("+")
}

fn cmd_serve(a: ServeArgs, interrupt: &Interrupt) -> Result<()> {
    let threads = threads_arg(a.run.threads)?;
    let vars = template_vars(&a.template_var)?;
    let api_key = match (&a.api_key, &a.api_key_file) {
        (Some(k), _) => Some(k.clone()),
        (None, Some(path)) => Some(read_key(path)?),
        (None, None) => None,
    };
    if api_key.as_deref() == Some("") {
        return Err(RunnerError::InvalidArgument {
            arg: "--api-key",
            reason: "the key is empty".into(),
        });
    }
    let file = open_model_verified(&a.run.model, !a.run.no_verify)?;
    let m = load(&file)?;
    let sampling = sampler_config(file.label(), &file.metadata().generation, &a.sampling)?;
    let timeout = Duration::from_secs(a.timeout.max(1));
    let cfg = FrontConfig {
        api_key,
        max_body_bytes: a.max_body_kb.saturating_mul(1024),
        max_connections: usize::from(a.max_connections),
        request_timeout: timeout,
        idle_timeout: timeout.max(Duration::from_secs(60)),
        default_max_tokens: a.max_tokens,
        sampling,
    };
    let name = a
        .run
        .model
        .file_stem()
        .map_or("model".into(), |s| s.to_string_lossy().into_owned());
    let created = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    if m.model.config.embedding.is_some() {
        return serve_embeddings(&a, &file, &m, threads, cfg, name, created, interrupt);
    }
    let ctx = a.run.ctx.unwrap_or_else(|| m.model.default_ctx());
    let mut compute = Compute::new(
        &m.model,
        ctx,
        threads,
        a.run.cache_type,
        sliding(a.run.swa_full),
    )?;
    let template = match isolated_template(&file) {
        Ok(t) => Some(t.with_vars(vars)),
        Err(e) => {
            eprintln!("kiln-run serve: no chat completions: {e}");
            None
        }
    };
    let vocab = m.model.config.vocab;
    let grammars = match Grammars::new(&m.tokenizer, vocab) {
        Ok(g) => Some(g),
        Err(e) => {
            eprintln!("kiln-run serve: no structured output: {e}");
            None
        }
    };
    let (listener, addr) = listen(&a)?;
    let front_model = FrontModel {
        name,
        tokenizer: &m.tokenizer,
        template: template.as_ref(),
        ctx,
        vocab,
        grammars: grammars.as_ref(),
        created,
        embeddings: None,
    };
    let opts = EngineOptions {
        parallel: usize::from(a.parallel),
        prefill_batch: a.batch_size as usize,
        cache_bytes: a.cache_mb.saturating_mul(1 << 20),
        reuse: a.cache_reuse,
        lookup: usize::from(a.speculative.lookup),
    };
    let draft_file = open_draft(&a.speculative, a.run.no_verify)?;
    let draft_loaded = draft_file.as_ref().map(load).transpose()?;
    let mut draft = match &draft_loaded {
        Some(d) => {
            same_vocabulary(&d.tokenizer, &m.tokenizer)?;
            if a.speculative.draft_min > a.speculative.draft_max {
                return Err(RunnerError::InvalidArgument {
                    arg: "--draft-min",
                    reason: format!(
                        "must be at most --draft-max (got {} and {})",
                        a.speculative.draft_min, a.speculative.draft_max
                    ),
                });
            }
            if !(0.0..=1.0).contains(&a.speculative.draft_p_min) {
                return Err(RunnerError::InvalidArgument {
                    arg: "--draft-p-min",
                    reason: format!(
                        "must be between 0 and 1 (got {})",
                        a.speculative.draft_p_min
                    ),
                });
            }
            let dctx = ctx.min(d.model.config.max_position_embeddings.max(1));
            Some(EngineDraft {
                compute: compute.alongside(
                    &d.model,
                    dctx,
                    a.run.cache_type,
                    sliding(a.run.swa_full),
                )?,
                max: usize::from(a.speculative.draft_max),
                min: usize::from(a.speculative.draft_min),
                p_min: a.speculative.draft_p_min,
                target_vocab: vocab,
            })
        }
        None => None,
    };
    let (handle, jobs) = engine::queue(opts.parallel, usize::from(a.queue));
    let guessing = match (&draft_file, opts.lookup) {
        (Some(d), _) => format!(", draft {}", d.label()),
        (None, n) if n > 0 => format!(", prompt lookup of {n} tokens"),
        _ => String::new(),
    };
    eprintln!(
        "kiln-run serve: {} ({}), {} sequences of {ctx} tokens, {} threads, {} KV cache{guessing}",
        file.label(),
        weight_summary(&file),
        opts.parallel,
        compute.threads(),
        compute.cache_type()
    );
    eprintln!("kiln-run serve: listening on http://{addr}");
    let engine_stop = Interrupt::new();
    std::thread::scope(|scope| {
        let engine_handle = handle.clone();
        let (tokenizer, stop) = (&m.tokenizer, engine_stop.clone());
        let compute = &mut compute;
        let opts = &opts;
        let draft = draft.as_mut();
        scope.spawn(move || {
            engine::run(compute, draft, tokenizer, jobs, &engine_handle, opts, &stop)
        });
        let served = front::serve(listener, &cfg, &front_model, Some(&handle), interrupt);
        engine_stop.raise(1);
        served
    })
}

/// Bind `--host`/`--port`; the socket and the address it got.
fn listen(a: &ServeArgs) -> Result<(std::net::TcpListener, std::net::SocketAddr)> {
    let listener = std::net::TcpListener::bind((a.host.as_str(), a.port)).map_err(|e| {
        RunnerError::InvalidArgument {
            arg: "--host/--port",
            reason: format!("cannot listen on {}:{}: {e}", a.host, a.port),
        }
    })?;
    let addr = listener
        .local_addr()
        .map_err(|e| RunnerError::io("reading the listening address", e))?;
    Ok((listener, addr))
}

/// `serve` on an embedding model: `/v1/embeddings` (with `/v1/models`, `/health` and the
/// tokenize routes), requests taking turns at one embedder, `--queue` of them waiting.
#[allow(clippy::too_many_arguments)]
fn serve_embeddings(
    a: &ServeArgs,
    file: &KilnFile,
    m: &Loaded<'_>,
    threads: usize,
    cfg: FrontConfig,
    name: String,
    created: u64,
    interrupt: &Interrupt,
) -> Result<()> {
    if a.speculative.lookup > 0 || a.speculative.draft.is_some() {
        return Err(RunnerError::InvalidArgument {
            arg: if a.speculative.lookup > 0 {
                "--lookup"
            } else {
                "--draft"
            },
            reason: format!(
                "{} is an embedding model: it does not generate, so there is nothing to speculate on",
                file.label()
            ),
        });
    }
    let service = EmbedService::new(
        &m.model,
        &m.tokenizer,
        file.label(),
        threads,
        usize::from(a.queue),
    )?;
    let (listener, addr) = listen(a)?;
    let front_model = FrontModel {
        name,
        tokenizer: &m.tokenizer,
        template: None,
        ctx: service.max_tokens(),
        vocab: m.model.config.vocab,
        grammars: None,
        created,
        embeddings: Some(&service),
    };
    eprintln!(
        "kiln-run serve: {} ({}), embeddings of {} dims, inputs of at most {} tokens, {threads} threads",
        file.label(),
        weight_summary(file),
        service.dim(),
        service.max_tokens(),
    );
    eprintln!("kiln-run serve: listening on http://{addr}");
    front::serve(listener, &cfg, &front_model, None, interrupt)
}

/// The API key in the first line of `path`.
fn read_key(path: &Path) -> Result<String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| RunnerError::io(format!("reading the API key from {}", path.display()), e))?;
    Ok(text.lines().next().unwrap_or_default().trim().to_string())
}
