//! What the subcommands share: their arguments turned into library settings (threads, the
//! prompt's text, the sampler's config, the model and its draft, the chat template) and the
//! summaries `generate` and `chat` print.

use std::ffi::OsString;
use std::io::Write;
use std::path::Path;

use kiln_format::KilnFile;
use kiln_runner::draft::{Draft, DraftOptions};
use kiln_runner::threads::{cap_notice, cap_threads, physical_cores};
use kiln_runner::{
    open_model_verified, CacheType, ChatTemplate, Generation, Model, Result, RunnerError,
    SamplerConfig, Session, SlidingCache, TemplateVars, Tokenizer,
};

use super::args::{RunArgs, SamplingArgs, SpeculativeArgs};

/// Largest prompt file `-f` reads: 64 MiB, far above any context's worth of text (128k tokens
/// of English are about half a megabyte), so only a wrong file (a disk image, a log) is refused
/// here, by its size, before anything is allocated; a smaller prompt too long for the context
/// is refused by its length before tokenizing.
pub const MAX_PROMPT_FILE_BYTES: u64 = 64 << 20;

/// A `--threads` value: at least one, at most the CPUs available (with a notice).
pub fn threads_arg(t: Option<usize>) -> Result<usize> {
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
pub fn prompt_text(prompt: Option<OsString>, file: Option<&Path>) -> Result<String> {
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
pub fn sampler_config(
    file: &str,
    gen: &serde_json::Value,
    a: &SamplingArgs,
) -> Result<SamplerConfig> {
    let mut c = SamplerConfig {
        repeat_last_n: a.repeat_last_n,
        seed: a.seed.unwrap_or_else(clock_seed),
        ..SamplerConfig::from_generation_config(gen)
    };
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
pub struct Loaded<'f> {
    pub model: Model<'f>,
    pub tokenizer: Tokenizer,
}

pub fn load(file: &KilnFile) -> Result<Loaded<'_>> {
    Ok(Loaded {
        model: Model::load(file)?,
        tokenizer: Tokenizer::from_file(file)?,
    })
}

/// The `--draft` file, opened and verified as the model is.
pub fn open_draft(spec: &SpeculativeArgs, no_verify: bool) -> Result<Option<KilnFile>> {
    spec.draft
        .as_deref()
        .map(|p| open_model_verified(p, !no_verify))
        .transpose()
}

/// A draft over `loaded` (when `--draft` gave one) for the model `target`, on the threads of
/// its session (the draft's context is the session's, at most its own model's).
pub fn make_draft<'d>(
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

pub fn session<'m>(model: &'m Model<'m>, run: &RunArgs, threads: usize) -> Result<Session<'m>> {
    let ctx = run.ctx.unwrap_or_else(|| model.default_ctx());
    model.session_sliding(ctx, threads, run.cache_type, sliding(run.swa_full))
}

/// How sessions keep sliding-window layers: `--swa-full` keeps every position.
pub fn sliding(full: bool) -> SlidingCache {
    if full {
        SlidingCache::Full
    } else {
        SlidingCache::default()
    }
}

pub fn stdout_writer() -> impl FnMut(&str) -> Result<()> {
    let mut out = std::io::stdout();
    move |s: &str| {
        out.write_all(s.as_bytes())
            .and_then(|()| out.flush())
            .map_err(|e| RunnerError::io("writing to stdout", e))
    }
}

pub fn print_summary(load_ms: f64, g: &Generation) {
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
pub fn lookup_summary(s: &kiln_runner::generate::Stats) -> String {
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

/// `--template-var NAME=VALUE` arguments, checked before the model is loaded.
pub fn template_vars(args: &[String]) -> Result<TemplateVars> {
    let mut vars = TemplateVars::new();
    for a in args {
        vars.set_assignment(a)?;
    }
    Ok(vars)
}

/// The file's chat template, rendered in a child process with memory and CPU limits
/// ([`kiln_runner::sandbox`]): the template is untrusted code from the model file.
pub fn isolated_template(file: &KilnFile) -> Result<ChatTemplate<'_>> {
    let exe = std::env::current_exe().map_err(|e| {
        RunnerError::ChatTemplate(format!(
            "cannot find kiln-run's own executable to render the template in: {e}"
        ))
    })?;
    Ok(ChatTemplate::from_file(file)?.isolated(exe))
}

/// The matrices' dtypes, e.g. `bf16` or `q4_0+f32`.
pub fn weight_summary(file: &KilnFile) -> String {
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
