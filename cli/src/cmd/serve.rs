//! `kiln-run serve`: OpenAI's API over HTTP. A generative model gets the engine thread
//! ([`kiln_runner::engine::Engine::serve`]) decoding the requests the server ([`kiln_server::serve`])
//! sends it; an embedding model answers `/v1/embeddings` from one embedder. The server holds
//! the model until the process ends, so what it borrows (the file, the weights, the template)
//! is leaked to `'static` once, here.

use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Args;
use kiln_format::KilnFile;
use kiln_runner::draft::{Draft, DraftOptions};
use kiln_runner::engine::prompt_cache::Reuse;
use kiln_runner::engine::{self, Engine, EngineOptions};
use kiln_runner::generate::DEFAULT_PREFILL_BATCH;
use kiln_runner::serve::embeddings::EmbedService;
use kiln_runner::serve::grammar::Grammars;
use kiln_runner::{
    open_model_verified, ChatTemplate, Compute, Interrupt, Result, RunnerError, SamplerConfig,
    TemplateVars,
};
use kiln_server::{FrontConfig, FrontModel, ServerError};

use super::args::{RunArgs, SamplingArgs, SpeculativeArgs};
use super::common::{
    isolated_template, load, open_draft, sampler_config, sliding, template_vars, threads_arg,
    weight_summary, Loaded,
};

#[derive(Debug, Args)]
pub struct ServeArgs {
    #[command(flatten)]
    pub run: RunArgs,
    /// Sampling defaults for requests that do not set them.
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// Address to listen on. The default answers this machine only; 0.0.0.0 exposes the model
    /// to the network (set --api-key).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0: any free port, printed when ready).
    #[arg(long, default_value_t = 8080, allow_negative_numbers = true,
          value_parser = kiln_format::args::whole::<u16>(0, 65535))]
    pub port: u16,
    /// Sequences decoded together; more requests wait in the queue.
    #[arg(long, default_value_t = 4, allow_negative_numbers = true,
          value_parser = kiln_format::args::whole::<u16>(1, 256))]
    pub parallel: u16,
    /// Requests that may wait for a sequence; beyond them the server answers 503.
    #[arg(long, default_value_t = 64, allow_negative_numbers = true,
          value_parser = kiln_format::args::whole::<u16>(1, 65535))]
    pub queue: u16,
    /// Require `Authorization: Bearer KEY` on the API (not on /health and the page itself).
    #[arg(long, conflicts_with = "api_key_file")]
    pub api_key: Option<String>,
    /// Read the API key from the first line of this file (keeps it out of the process list).
    #[arg(long)]
    pub api_key_file: Option<PathBuf>,
    /// Memory for finished conversations' KV caches, reused when a request continues one.
    #[arg(long, default_value_t = 256, allow_negative_numbers = true,
          value_parser = kiln_format::args::at_least::<usize>(0))]
    pub cache_mb: usize,
    /// What a request may reuse of a kept conversation: `exact` (whole prefill chunks of
    /// -b tokens, so that its output is what a cold request gives) or `prefix` (everything
    /// in common, as a `chat` turn: faster, but the last bits can differ).
    #[arg(long, default_value_t = Reuse::Exact)]
    pub cache_reuse: Reuse,
    /// Largest request body accepted, in KiB.
    #[arg(long, default_value_t = 1024, allow_negative_numbers = true,
          value_parser = kiln_format::args::at_least::<usize>(0))]
    pub max_body_kb: usize,
    /// Requests served at once (/health aside); beyond them the server answers 503. Idle,
    /// silent and slow connections do not count: only requests whose head has arrived.
    #[arg(long, default_value_t = 64, allow_negative_numbers = true,
          value_parser = kiln_format::args::whole::<u16>(1, 65535))]
    pub max_connections: u16,
    /// Let pages from ORIGIN (as `https://app.example`) call the API from a browser
    /// (repeatable). Without it the server sends no CORS headers.
    #[arg(long = "cors-origin", value_name = "ORIGIN")]
    pub cors_origin: Vec<String>,
    /// Seconds a client may take to send a request's head or body, or to take a response's
    /// bytes; also how long an idle keep-alive connection is kept.
    #[arg(long, default_value_t = 30, allow_negative_numbers = true,
          value_parser = kiln_format::args::at_least::<u64>(0))]
    pub timeout: u64,
    /// Tokens a request generates when it sets no max_tokens [default: the rest of the context].
    #[arg(short = 'n', long, allow_negative_numbers = true,
          value_parser = kiln_format::args::at_least::<usize>(0))]
    pub max_tokens: Option<usize>,
    /// Prompt tokens read per forward pass between decoding steps (as `generate` reads them:
    /// at the same size a request's output equals `generate`'s).
    #[arg(short = 'b', long = "batch-size", default_value_t = DEFAULT_PREFILL_BATCH as u32,
          allow_negative_numbers = true, value_parser = kiln_format::args::at_least::<u32>(1))]
    pub batch_size: u32,
    /// Speculative decoding (each sequence's guesses checked in the batched pass; output
    /// unchanged): --lookup or --draft, as for `generate`.
    #[command(flatten)]
    pub speculative: SpeculativeArgs,
    /// Set a variable the chat template reads, as transformers' `apply_chat_template(**kwargs)`
    /// does (NAME=VALUE, VALUE as JSON or a plain string).
    #[arg(long = "template-var", value_name = "NAME=VALUE")]
    pub template_var: Vec<String>,
}

pub fn run(a: ServeArgs, interrupt: &Interrupt) -> Result<()> {
    let threads = threads_arg(a.run.threads)?;
    let vars = template_vars(&a.template_var)?;
    let api_key = api_key(&a)?;
    let file: &'static _ = Box::leak(Box::new(open_model_verified(
        &a.run.model,
        !a.run.no_verify,
    )?));
    let m: &'static Loaded<'static> = Box::leak(Box::new(load(file)?));
    let sampling = sampler_config(file.label(), &file.metadata().generation, &a.sampling)?;
    let cfg = front_config(&a, api_key, sampling);
    let id = ModelId::new(&a.run.model);
    if m.model.config.embedding.is_some() {
        return serve_embeddings(&a, file, m, threads, &cfg, id, interrupt);
    }
    let ctx = a.run.ctx.unwrap_or_else(|| m.model.default_ctx());
    let mut compute = Compute::new(
        &m.model,
        ctx,
        threads,
        a.run.cache_type,
        sliding(a.run.swa_full),
    )?;
    let (template, grammars) = chat_features(file, m, vars);
    let (template, grammars): (&'static _, &'static _) =
        (Box::leak(Box::new(template)), Box::leak(Box::new(grammars)));
    let (listener, addr) = listen(&a)?;
    let front_model = FrontModel {
        name: id.name,
        tokenizer: &m.tokenizer,
        template: template.as_ref(),
        ctx,
        vocab: m.model.config.vocab,
        grammars: grammars.as_ref(),
        created: id.created,
        embeddings: None,
    };
    let opts = engine_options(&a);
    let draft_file = open_draft(&a.speculative, a.run.no_verify)?;
    let draft_loaded = draft_file.as_ref().map(load).transpose()?;
    let mut draft = match &draft_loaded {
        Some(d) => Some(engine_draft(&a, d, m, &compute, ctx)?),
        None => None,
    };
    let (handle, jobs) = engine::queue(opts.parallel, usize::from(a.queue));
    announce(file, &compute, &opts, draft_file.as_ref(), addr);
    let engine_stop = Interrupt::new();
    std::thread::scope(|scope| {
        let engine_handle = handle.clone();
        let (tokenizer, stop) = (&m.tokenizer, engine_stop.clone());
        let compute = &mut compute;
        let opts = &opts;
        let draft = draft.as_mut();
        scope.spawn(move || {
            Engine::new(compute, draft, tokenizer, opts.clone())
                .with_interrupt(stop)
                .with_state(engine_handle.state().clone())
                .serve(jobs)
        });
        let served = kiln_server::serve(listener, &cfg, front_model, Some(handle), interrupt);
        engine_stop.raise(1);
        served.map_err(server_error)
    })
}

/// The engine's settings, from the flags.
fn engine_options(a: &ServeArgs) -> EngineOptions {
    EngineOptions {
        parallel: usize::from(a.parallel),
        prefill_batch: a.batch_size as usize,
        cache_bytes: a.cache_mb.saturating_mul(1 << 20),
        reuse: a.cache_reuse,
        lookup: usize::from(a.speculative.lookup),
    }
}

/// What is served and where, on stderr, before the first request.
fn announce(
    file: &KilnFile,
    compute: &Compute<'_>,
    opts: &EngineOptions,
    draft: Option<&KilnFile>,
    addr: std::net::SocketAddr,
) {
    let guessing = match (draft, opts.lookup) {
        (Some(d), _) => format!(", draft {}", d.label()),
        (None, n) if n > 0 => format!(", prompt lookup of {n} tokens"),
        _ => String::new(),
    };
    eprintln!(
        "kiln-run serve: {} ({}), {} sequences of {} tokens, {} threads, {} KV cache{guessing}",
        file.label(),
        weight_summary(file),
        opts.parallel,
        compute.ctx(),
        compute.threads(),
        compute.cache_type()
    );
    eprintln!("kiln-run serve: listening on http://{addr}");
}

/// How `/v1/models` lists the model: the file's stem, and when the server started.
struct ModelId {
    name: String,
    created: u64,
}

impl ModelId {
    fn new(model: &Path) -> Self {
        let name = model
            .file_stem()
            .map_or("model".into(), |s| s.to_string_lossy().into_owned());
        let created = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        ModelId { name, created }
    }
}

/// `--api-key` or the first line of `--api-key-file`, refused when empty.
fn api_key(a: &ServeArgs) -> Result<Option<String>> {
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
    Ok(api_key)
}

/// The front's limits and defaults, from the flags.
fn front_config(a: &ServeArgs, api_key: Option<String>, sampling: SamplerConfig) -> FrontConfig {
    let timeout = Duration::from_secs(a.timeout.max(1));
    FrontConfig {
        api_key,
        max_body_bytes: a.max_body_kb.saturating_mul(1024),
        max_requests: usize::from(a.max_connections),
        request_timeout: timeout,
        cors_origins: a.cors_origin.clone(),
        default_max_tokens: a.max_tokens,
        sampling,
    }
}

/// The chat template (without one, no chat completions) and the grammars of structured
/// output (without them, none), each said on stderr when missing.
fn chat_features<'f>(
    file: &'f KilnFile,
    m: &Loaded<'_>,
    vars: TemplateVars,
) -> (Option<ChatTemplate<'f>>, Option<Grammars>) {
    let template = match isolated_template(file) {
        Ok(t) => Some(t.with_vars(vars)),
        Err(e) => {
            eprintln!("kiln-run serve: no chat completions: {e}");
            None
        }
    };
    let grammars = match Grammars::new(&m.tokenizer, m.model.config.vocab) {
        Ok(g) => Some(g),
        Err(e) => {
            eprintln!("kiln-run serve: no structured output: {e}");
            None
        }
    };
    (template, grammars)
}

/// The `--draft` model `d` for the engine, on `compute`'s threads, its context at most
/// `ctx`; refused when its vocabulary or the `--draft-*` settings do not fit.
fn engine_draft<'d>(
    a: &ServeArgs,
    d: &'d Loaded<'d>,
    m: &Loaded<'_>,
    compute: &Compute<'_>,
    ctx: usize,
) -> Result<Draft<'d>> {
    let spec = &a.speculative;
    let dctx = ctx.min(d.model.config.max_position_embeddings.max(1));
    Draft::with_compute(
        compute.alongside(&d.model, dctx, a.run.cache_type, sliding(a.run.swa_full))?,
        &d.tokenizer,
        &m.tokenizer,
        m.model.config.vocab,
        DraftOptions {
            max: usize::from(spec.draft_max),
            min: usize::from(spec.draft_min),
            p_min: spec.draft_p_min,
            prefill_batch: a.batch_size as usize,
        },
    )
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
fn serve_embeddings(
    a: &ServeArgs,
    file: &'static KilnFile,
    m: &'static Loaded<'static>,
    threads: usize,
    cfg: &FrontConfig,
    id: ModelId,
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
    let service: &'static _ = Box::leak(Box::new(EmbedService::new(
        &m.model,
        &m.tokenizer,
        file.label(),
        threads,
        usize::from(a.queue),
    )?));
    let (listener, addr) = listen(a)?;
    let front_model = FrontModel {
        name: id.name,
        tokenizer: &m.tokenizer,
        template: None,
        ctx: service.max_tokens(),
        vocab: m.model.config.vocab,
        grammars: None,
        created: id.created,
        embeddings: Some(service),
    };
    eprintln!(
        "kiln-run serve: {} ({}), embeddings of {} dims, inputs of at most {} tokens, {threads} threads",
        file.label(),
        weight_summary(file),
        service.dim(),
        service.max_tokens(),
    );
    eprintln!("kiln-run serve: listening on http://{addr}");
    kiln_server::serve(listener, cfg, front_model, None, interrupt).map_err(server_error)
}

/// The server's failure as the command's error.
fn server_error(e: ServerError) -> RunnerError {
    match e {
        ServerError::Io { what, source } => RunnerError::io(what, source),
    }
}

/// The API key in the first line of `path`.
fn read_key(path: &Path) -> Result<String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| RunnerError::io(format!("reading the API key from {}", path.display()), e))?;
    Ok(text.lines().next().unwrap_or_default().trim().to_string())
}
