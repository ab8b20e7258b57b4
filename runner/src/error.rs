//! The one error type of the runner.
//!
//! Every variant names what it is about (file, tensor, argument) and the expected and found
//! values, so that the message printed once by `kiln-run` is enough to act on.

use kiln_format::FormatError;
use kiln_kernels::KernelError;

/// Everything that can go wrong loading a model or running it.
#[derive(Debug, thiserror::Error)]
pub enum RunnerError {
    /// The container itself is unreadable (bad magic, newer major version, corrupt index…).
    #[error(transparent)]
    Format(#[from] FormatError),
    /// A configuration value that cannot describe a working model.
    #[error("{file}: invalid model config `{field}`: {reason}")]
    BadConfig {
        file: String,
        field: &'static str,
        reason: String,
    },
    /// A tensor the configuration requires is absent.
    #[error("{file}: missing tensor `{tensor}` (required by the model config)")]
    MissingTensor { file: String, tensor: String },
    /// A tensor the configuration does not use is present (a bias on a bias-free model…).
    #[error("{file}: unexpected tensor `{tensor}`: the model config does not use it ({reason})")]
    UnexpectedTensor {
        file: String,
        tensor: String,
        reason: &'static str,
    },
    /// A tensor's shape disagrees with the configuration.
    #[error(
        "{file}: tensor `{tensor}` has shape {found:?}, but the model config implies {expected:?}"
    )]
    TensorShape {
        file: String,
        tensor: String,
        expected: Vec<u64>,
        found: Vec<u64>,
    },
    /// A tensor stored in an encoding its role cannot use (e.g. a quantized norm weight).
    #[error("{file}: tensor `{tensor}` is {dtype}: {reason}")]
    TensorDType {
        file: String,
        tensor: String,
        dtype: String,
        reason: &'static str,
    },
    /// A weight view the kernels reject.
    #[error("{file}: tensor `{tensor}`: {source}")]
    Kernel {
        file: String,
        tensor: String,
        #[source]
        source: KernelError,
    },
    /// The thread pool could not be started.
    #[error("cannot start the thread pool: {0}")]
    Pool(#[source] KernelError),
    /// The file has no usable tokenizer.
    #[error("{file}: {reason}")]
    Tokenizer { file: String, reason: String },
    /// Encoding or decoding text failed.
    #[error("tokenizer: {0}")]
    Tokenize(String),
    /// Token bytes cannot be read off this vocabulary: its decoder does not simply concatenate
    /// token text (WordPiece, CTC, or no decoder at all).
    #[error(
        "structured output needs a vocabulary whose tokens concatenate into the text \
         (byte-level BPE or SentencePiece-style); this tokenizer's decoder is {decoder}"
    )]
    UnsupportedDecoder { decoder: String },
    /// The grammar engine could not be set up for this vocabulary.
    #[error("cannot set up structured output: {0}")]
    Grammar(String),
    /// `--chat` on a model without a chat template.
    #[error("{file}: the model has no chat template; run without --chat")]
    NoChatTemplate { file: String },
    /// The chat template failed to parse or render.
    #[error("chat template: {0}")]
    ChatTemplate(String),
    /// The engine gave up on a generation (a forward pass or the text stream failed).
    #[error("generation failed: {0}")]
    Generation(String),
    /// The prompt tokenized to nothing.
    #[error("the prompt is empty (0 tokens); give some text with -p")]
    EmptyPrompt,
    /// The prompt (or the conversation) does not fit in the context window.
    #[error(
        "the prompt is {tokens} tokens but the context holds {ctx}; shorten the prompt or raise \
         --ctx (the model was trained for {max_ctx})"
    )]
    ContextOverflow {
        tokens: usize,
        ctx: usize,
        max_ctx: usize,
    },
    /// A prompt so long that it cannot fit the context whatever its tokens, refused before
    /// tokenizing it.
    #[error(
        "the prompt is {bytes} bytes, more than a {ctx}-token context can hold with this \
         tokenizer (at most {limit} bytes); shorten the prompt or raise --ctx"
    )]
    PromptTooLong {
        bytes: usize,
        ctx: usize,
        limit: usize,
    },
    /// The chat template ran past its limits (instructions, output size).
    #[error("{file}: the chat template exceeded its limit: {reason}")]
    ChatTemplateLimit { file: String, reason: String },
    /// The prompt given on the command line or in a file is not valid UTF-8.
    #[error("the prompt {source_name} is not valid UTF-8 (first invalid byte at offset {offset})")]
    PromptNotUtf8 { source_name: String, offset: usize },
    /// Something wrong with one text of many (`kiln-run embed`'s lines), naming it.
    #[error("{place}: {source}")]
    InText {
        /// "line 12 of texts.txt", "text 3 (-p)".
        place: String,
        #[source]
        source: Box<RunnerError>,
    },
    /// A line longer than a text file's lines may be.
    #[error("longer than {limit} bytes, the most one line may hold; split it")]
    LineTooLong { limit: usize },
    /// A text that is not valid UTF-8.
    #[error("not valid UTF-8 (first invalid byte at byte {offset} of the line)")]
    TextNotUtf8 { offset: usize },
    /// A text so long, and so sparse in tokens, that finding the tokens an embedding keeps
    /// would mean tokenizing all of it (a run of characters a WordPiece vocabulary maps to one
    /// unknown token).
    #[error(
        "a text of {bytes} bytes whose first {scanned} bytes make only {tokens} tokens: too \
         few to find the {max_tokens} tokens kept without tokenizing the whole text; split \
         it, or break its long runs without spaces"
    )]
    TextTooSparse {
        bytes: usize,
        scanned: usize,
        tokens: usize,
        max_tokens: usize,
    },
    /// A sampling default in the file's generation_config.json that is out of range.
    #[error("{file}: generation_config.json `{field}`: {reason}; override it with {flag}")]
    BadGenerationConfig {
        file: String,
        field: &'static str,
        reason: String,
        flag: &'static str,
    },
    /// A chat-template variable (`--template-var NAME=VALUE`) that cannot be set.
    #[error("template variable `{name}`: {reason}")]
    TemplateVar { name: String, reason: String },
    /// A command-line value out of range.
    #[error(
        "{label}: generated token {at} is {plain} plainly but {speculative} speculatively; \
         speculative decoding must not change greedy output (a bug)"
    )]
    SpeculativeMismatch {
        label: String,
        at: usize,
        plain: u32,
        speculative: u32,
    },

    #[error("invalid value for {arg}: {reason}")]
    InvalidArgument { arg: &'static str, reason: String },
    /// A token id outside the vocabulary.
    #[error("token id {id} is outside the vocabulary (size {vocab})")]
    TokenOutOfRange { id: u32, vocab: usize },
    /// Reading or writing a stream failed.
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
}

/// Result alias for the runner.
pub type Result<T, E = RunnerError> = std::result::Result<T, E>;

impl RunnerError {
    /// Whether this is a write to a closed pipe (`kiln-run … | head`), which is not a failure.
    pub fn is_broken_pipe(&self) -> bool {
        matches!(self, RunnerError::Io { source, .. } if source.kind() == std::io::ErrorKind::BrokenPipe)
    }

    pub fn io(what: impl Into<String>, source: std::io::Error) -> Self {
        RunnerError::Io {
            what: what.into(),
            source,
        }
    }
}
