//! `kiln-run generate`: continue a prompt (or answer it as a chat turn with `--chat`),
//! streaming the text, or printing one JSON object with `--json`.

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Instant;

use clap::Args;
use kiln_format::KilnFile;
use kiln_runner::generate::{generate_with_draft, DEFAULT_PREFILL_BATCH};
use kiln_runner::{
    open_model_verified, Conversation, GenerateOptions, Generation, Interrupt, Result, RunnerError,
    Sampler, Session, TemplateVars, Tokenizer,
};

use super::args::{RunArgs, SamplingArgs, SpeculativeArgs};
use super::common::{
    isolated_template, load, make_draft, open_draft, print_summary, prompt_text, sampler_config,
    session, stdout_writer, template_vars, threads_arg,
};

#[derive(Debug, Args)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub run: RunArgs,
    /// The prompt text.
    #[arg(
        short = 'p',
        long,
        required_unless_present = "file",
        conflicts_with = "file"
    )]
    pub prompt: Option<OsString>,
    /// Read the prompt from a file.
    #[arg(short = 'f', long)]
    pub file: Option<PathBuf>,
    /// Tokens to generate at most.
    #[arg(short = 'n', long, default_value_t = 128, allow_negative_numbers = true,
          value_parser = kiln_format::args::at_least::<usize>(0))]
    pub n_predict: usize,
    /// Prompt tokens per forward pass (matrix–matrix products; `serve -b` reads prompts the
    /// same way).
    #[arg(short = 'b', long = "batch-size", default_value_t = DEFAULT_PREFILL_BATCH as u32,
          allow_negative_numbers = true, value_parser = kiln_format::args::at_least::<u32>(1))]
    pub batch_size: u32,
    #[command(flatten)]
    pub speculative: SpeculativeArgs,
    /// Render the prompt as a user turn through the model's chat template.
    #[arg(long)]
    pub chat: bool,
    /// System prompt for --chat (replaces the template's default).
    #[arg(long, requires = "chat")]
    pub system: Option<String>,
    /// Set a variable the chat template reads, as transformers' `apply_chat_template(**kwargs)`
    /// does (repeatable): VALUE is JSON when it parses (`false`, `3`, `"x"`, `[...]`), else a
    /// string. E.g. `--template-var enable_thinking=false` for Qwen3. A special token's name
    /// (`bos_token`…) overrides it; `messages` and `add_generation_prompt` are refused.
    #[arg(long = "template-var", value_name = "NAME=VALUE", requires = "chat")]
    pub template_var: Vec<String>,
    /// Keep generating past end-of-sequence tokens.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Print one JSON object on stdout instead of streaming text.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub sampling: SamplingArgs,
}

pub fn run(mut a: GenerateArgs, interrupt: &Interrupt) -> Result<()> {
    let threads = threads_arg(a.run.threads)?;
    let vars = template_vars(&a.template_var)?;
    let text = prompt_text(a.prompt.take(), a.file.as_deref())?;
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
    let ids = prompt_ids(&a, &file, &m.tokenizer, sess.ctx(), vars, &text)?;
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
    let mut quiet = |_: &str| Ok(());
    let mut stream = stdout_writer();
    let on_text: &mut dyn FnMut(&str) -> Result<()> = if a.json { &mut quiet } else { &mut stream };
    let g = generate_with_draft(
        &mut sess,
        draft.as_mut(),
        &m.tokenizer,
        &ids,
        &opts,
        &mut sampler,
        on_text,
    )?;
    if a.json {
        print_json(&g, load_ms, seed, &sess);
    } else {
        stdout_writer()("\n")?;
        print_summary(load_ms, &g);
    }
    Ok(())
}

/// The prompt's tokens: its text as it is, or with `--chat` a user turn of the model's chat
/// template; refused when it does not fit the context or holds no token.
fn prompt_ids(
    a: &GenerateArgs,
    file: &KilnFile,
    tokenizer: &Tokenizer,
    ctx: usize,
    vars: TemplateVars,
    text: &str,
) -> Result<Vec<u32>> {
    tokenizer.check_fits(text, ctx)?;
    let ids = if a.chat {
        let template = isolated_template(file)?.with_vars(vars);
        let conv = Conversation::new(&template, a.system.as_deref());
        let rendered = conv.prompt_for(text)?;
        tokenizer.check_fits(&rendered, ctx)?;
        tokenizer.encode_rendered(&rendered)?
    } else {
        tokenizer.encode(text)?
    };
    if ids.is_empty() {
        return Err(RunnerError::EmptyPrompt);
    }
    Ok(ids)
}

/// `--json`: the text, its tokens and the run's statistics and settings, as one object.
fn print_json(g: &Generation, load_ms: f64, seed: u64, sess: &Session<'_>) {
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
}
