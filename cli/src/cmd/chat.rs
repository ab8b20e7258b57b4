//! `kiln-run chat`: an interactive multi-turn chat that keeps its KV cache between turns.

use std::io::BufRead;
use std::sync::atomic::Ordering;
use std::time::Instant;

use clap::Args;
use kiln_runner::generate::DEFAULT_PREFILL_BATCH;
use kiln_runner::{
    open_model_verified, Conversation, GenerateOptions, Generation, Interrupt, Result, RunnerError,
    Sampler, Session, StopReason,
};

use super::args::{RunArgs, SamplingArgs, SpeculativeArgs};
use super::common::{
    isolated_template, load, lookup_summary, make_draft, open_draft, sampler_config, session,
    stdout_writer, template_vars, threads_arg, Loaded,
};
use super::signals::WAITING_FOR_INPUT;

#[derive(Debug, Args)]
pub struct ChatArgs {
    #[command(flatten)]
    pub run: RunArgs,
    /// System prompt (replaces the template's default).
    #[arg(long)]
    pub system: Option<String>,
    /// Set a variable the chat template reads, as transformers' `apply_chat_template(**kwargs)`
    /// does (repeatable): VALUE is JSON when it parses (`false`, `3`, `"x"`, `[...]`), else a
    /// string. E.g. `--template-var enable_thinking=false` for Qwen3. A special token's name
    /// (`bos_token`…) overrides it; `messages` and `add_generation_prompt` are refused.
    #[arg(long = "template-var", value_name = "NAME=VALUE")]
    pub template_var: Vec<String>,
    /// Tokens per reply at most.
    #[arg(short = 'n', long, default_value_t = 512, allow_negative_numbers = true,
          value_parser = kiln_format::args::at_least::<usize>(0))]
    pub n_predict: usize,
    /// Prompt tokens per forward pass (matrix–matrix products; `serve -b` reads prompts the
    /// same way).
    #[arg(short = 'b', long = "batch-size", default_value_t = DEFAULT_PREFILL_BATCH as u32,
          allow_negative_numbers = true, value_parser = kiln_format::args::at_least::<u32>(1))]
    pub batch_size: u32,
    #[command(flatten)]
    pub speculative: SpeculativeArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
}

pub fn run(a: ChatArgs, interrupt: &Interrupt) -> Result<()> {
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
    print_loaded(&a, t0, &m, &sess);
    let mut conv = Conversation::new(&template, a.system.as_deref());
    let mut line = String::new();
    loop {
        if interrupt.is_raised() {
            break;
        }
        let Some(input) = read_input(&mut line)? else {
            break;
        };
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
        report_turn(conv.turn(
            &mut sess,
            draft.as_mut(),
            &m.tokenizer,
            input,
            &opts,
            &mut sampler,
            &mut stdout_writer(),
        ))?;
    }
    Ok(())
}

/// The banner once the model is loaded: its size, context, cache and threads, and the commands.
fn print_loaded(a: &ChatArgs, t0: Instant, m: &Loaded<'_>, sess: &Session<'_>) {
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
}

/// Prompt with `> ` and read a line of stdin into `line`: the line without its end, or `None`
/// at the end of the input. A signal while it waits ends the program at once.
fn read_input(line: &mut String) -> Result<Option<&str>> {
    WAITING_FOR_INPUT.store(true, Ordering::SeqCst);
    eprint!("> ");
    line.clear();
    let read = std::io::stdin().lock().read_line(line);
    WAITING_FOR_INPUT.store(false, Ordering::SeqCst);
    let n = read.map_err(|e| RunnerError::io("reading stdin", e))?;
    if n == 0 {
        return Ok(None);
    }
    Ok(Some(line.trim_end_matches(['\n', '\r'])))
}

/// End a turn's reply: its statistics on stderr, or the error that ended it; a conversation
/// that outgrew the context is said so and the chat goes on.
fn report_turn(turn: Result<Generation>) -> Result<()> {
    match turn {
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
    Ok(())
}
