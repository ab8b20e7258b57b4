//! The clap arguments several subcommands share: the model and its KV cache ([`RunArgs`]),
//! sampling defaults ([`SamplingArgs`]) and speculative decoding ([`SpeculativeArgs`]).

use std::path::PathBuf;

use clap::Args;
use kiln_runner::draft::DraftOptions;
use kiln_runner::CacheType;

#[derive(Debug, Args)]
pub struct RunArgs {
    /// The .kiln model.
    pub model: PathBuf,
    /// Context window in tokens [default: the model's, at most 4096].
    #[arg(long, allow_negative_numbers = true,
          value_parser = kiln_format::args::at_least::<usize>(1))]
    pub ctx: Option<usize>,
    /// Compute threads [default: physical cores; at most the CPUs available].
    #[arg(short = 't', long, allow_negative_numbers = true,
          value_parser = kiln_format::args::at_least::<usize>(1))]
    pub threads: Option<usize>,
    /// How the KV cache stores keys and values: f16 (half of f32's memory and reads), q8_0
    /// (GGML's blocks, about a quarter; heads must be a multiple of 32 wide) or f32 (exact).
    #[arg(long = "cache-type", default_value_t = CacheType::F16)]
    pub cache_type: CacheType,
    /// Keep every position of sliding-window layers in the KV cache, as full-attention layers
    /// do, instead of a ring of `window - 1 + 512` positions: more memory, but any rewind
    /// (a chat reusing an earlier turn) keeps its whole prefix instead of recomputing it.
    #[arg(long)]
    pub swa_full: bool,
    /// Skip checking every tensor's sha256, and every value for NaN and infinity, before
    /// running (for a file already verified, e.g. with `kiln-convert inspect --verify`).
    #[arg(long)]
    pub no_verify: bool,
}

#[derive(Debug, Args)]
pub struct SamplingArgs {
    /// Temperature; 0 is greedy [default: the model's generation_config, else greedy].
    #[arg(long, allow_negative_numbers = true,
          value_parser = kiln_format::args::non_negative::<f32>())]
    pub temp: Option<f32>,
    /// Always pick the most likely token (same as --temp 0).
    #[arg(long, conflicts_with = "temp")]
    pub greedy: bool,
    /// Sample from the K most likely tokens (0: all).
    #[arg(long, allow_negative_numbers = true,
          value_parser = kiln_format::args::at_least::<usize>(0))]
    pub top_k: Option<usize>,
    /// Sample from the smallest set of tokens with this much probability (1: all).
    #[arg(long, allow_negative_numbers = true,
          value_parser = kiln_format::args::real::<f32>(
              std::ops::Bound::Excluded(0.0),
              std::ops::Bound::Included(1.0),
          ))]
    pub top_p: Option<f32>,
    /// Drop tokens less likely than this fraction of the most likely one (0: off).
    #[arg(long, allow_negative_numbers = true, value_parser = kiln_format::args::fraction::<f32>())]
    pub min_p: Option<f32>,
    /// Penalize tokens seen in the last --repeat-last-n tokens (1: off).
    #[arg(long, allow_negative_numbers = true, value_parser = kiln_format::args::positive::<f32>())]
    pub repeat_penalty: Option<f32>,
    /// How many recent tokens the repetition penalty looks at.
    #[arg(long, default_value_t = 64, allow_negative_numbers = true,
          value_parser = kiln_format::args::at_least::<usize>(0))]
    pub repeat_last_n: usize,
    /// Random seed, for reproducible sampling [default: from the clock, printed].
    #[arg(long, allow_negative_numbers = true,
          value_parser = kiln_format::args::at_least::<u64>(0))]
    pub seed: Option<u64>,
}

/// Speculative decoding: guesses checked several at a time by one pass of the model. Lossless
/// either way: greedy output is token for token what plain decoding gives, sampled output has
/// the same distribution.
#[derive(Debug, Args)]
pub struct SpeculativeArgs {
    /// Speculative decoding by prompt lookup: guess up to N tokens per step from what followed
    /// the last few tokens earlier in the prompt or the output, and check them in the same
    /// pass (0: off). Pays off on edits, rewrites, code and summaries that repeat their input.
    #[arg(long, value_name = "N", default_value_t = 0,
          allow_negative_numbers = true, value_parser = kiln_format::args::whole::<u16>(0, 64))]
    pub lookup: u16,
    /// Speculative decoding with a draft model: a smaller or lower-precision .kiln with the
    /// same vocabulary (e.g. a q4_0 copy of an f16 model) proposes tokens, the model checks
    /// them. Verified as the model is, unless --no-verify.
    #[arg(long, value_name = "DRAFT.kiln", conflicts_with = "lookup")]
    pub draft: Option<PathBuf>,
    /// Most tokens the draft proposes per pass of the model.
    #[arg(long, value_name = "K", default_value_t = DraftOptions::default().max as u16,
          requires = "draft", allow_negative_numbers = true,
          value_parser = kiln_format::args::whole::<u16>(1, 64))]
    pub draft_max: u16,
    /// Fewest tokens aimed for per pass, however few get accepted: the length adapts between
    /// this and --draft-max to the acceptance rate and the measured costs of the draft and of
    /// the model's passes. With 0, drafting pauses while it does not pay (probing now and then).
    #[arg(long, value_name = "K", default_value_t = DraftOptions::default().min as u16,
          requires = "draft", allow_negative_numbers = true,
          value_parser = kiln_format::args::whole::<u16>(0, 64))]
    pub draft_min: u16,
    /// Stop proposing once the draft gives its next token less than this probability.
    #[arg(long, value_name = "P", default_value_t = DraftOptions::default().p_min,
          requires = "draft", allow_negative_numbers = true,
          value_parser = kiln_format::args::fraction::<f32>())]
    pub draft_p_min: f32,
}
