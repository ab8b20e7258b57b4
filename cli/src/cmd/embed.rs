//! `kiln-run embed`: texts through an embedding model a batch at a time
//! ([`kiln_runner::embed_stream`]), one vector per text, as JSON lines or a .npy file.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::Args;
use kiln_runner::embed_stream::{
    EmbedStream, GivenTexts, InputTokenizer, JsonLines, Lines, NpyWriter, RowWriter, Summary,
    TextSource,
};
use kiln_runner::{open_model_verified, Interrupt, Result, RunnerError};

use super::common::{load, prompt_text, threads_arg};

#[derive(Debug, Args)]
pub struct EmbedArgs {
    /// The .kiln embedding model.
    pub model: PathBuf,
    /// A text to embed; repeat for several.
    #[arg(short = 'p', long = "text")]
    pub texts: Vec<OsString>,
    /// A file of texts, one per line; without -p or -f the texts are read from standard
    /// input, the same way. Every line is a text, empty ones too (they share one vector,
    /// computed once). Lines are read, embedded and written a batch at a time, so an input of
    /// any number of lines takes the memory of one batch; a line may hold at most 64 MiB, and
    /// one longer than the model keeps is cut before it is tokenized.
    #[arg(short = 'f', long, conflicts_with = "texts")]
    pub file: Option<PathBuf>,
    /// Compute threads [default: physical cores; at most the CPUs available].
    #[arg(short = 't', long, allow_negative_numbers = true,
          value_parser = kiln_format::args::at_least::<usize>(1))]
    pub threads: Option<usize>,
    /// Pool token states this way instead of the model's (mean, cls, last_token).
    #[arg(long, value_parser = parse_pooling)]
    pub pooling: Option<kiln_format::Pooling>,
    /// Scale every vector to unit length (the default when the model has a Normalize module).
    #[arg(long, conflicts_with = "no_normalize")]
    pub normalize: bool,
    /// Keep the vectors as pooled, even if the model normalises them.
    #[arg(long)]
    pub no_normalize: bool,
    /// Cut each text to this many tokens, special tokens included [default: the model's
    /// max_seq_length].
    #[arg(long, allow_negative_numbers = true,
          value_parser = kiln_format::args::at_least::<usize>(1))]
    pub truncate: Option<usize>,
    /// Put the model's prompt of this name before every text (e.g. `query`, `document`, as
    /// the model's config_sentence_transformers.json lists them) [default: the model's
    /// default prompt, if it names one].
    #[arg(long, conflicts_with = "prefix")]
    pub prompt_name: Option<String>,
    /// Put this text before every text.
    #[arg(long)]
    pub prefix: Option<String>,
    /// jsonl: one JSON object per text, in input order ({"index", "tokens", "truncated",
    /// "embedding"}; `index` counts texts from 0, so for -f and standard input it is the
    /// line's number less one); npy: one float32 array of (texts, dim), row i the text of
    /// index i, which needs -o.
    #[arg(long, default_value = "jsonl", value_parser = ["jsonl", "npy"])]
    pub format: String,
    /// Write to this file instead of standard output, atomically: vectors go to a temporary
    /// file beside it, moved into place only once every text is embedded (an error or an
    /// interrupt removes it).
    #[arg(short = 'o', long)]
    pub output: Option<PathBuf>,
    /// Replace the output file if it exists.
    #[arg(long)]
    pub force: bool,
    /// Tokens per forward pass.
    #[arg(short = 'b', long = "batch-tokens",
          default_value_t = kiln_runner::embed::DEFAULT_BATCH_TOKENS as u32,
          allow_negative_numbers = true,
          value_parser = kiln_format::args::whole::<u32>(1, 1 << 20))]
    pub batch_tokens: u32,
    /// Skip checking every tensor's sha256 and value before running.
    #[arg(long)]
    pub no_verify: bool,
}

fn parse_pooling(s: &str) -> std::result::Result<kiln_format::Pooling, String> {
    kiln_format::Pooling::ALL
        .into_iter()
        .find(|p| p.name() == s)
        .ok_or_else(|| format!("`{s}`: expected mean, cls or last_token"))
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
pub fn run(a: EmbedArgs, interrupt: &Interrupt) -> Result<()> {
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
