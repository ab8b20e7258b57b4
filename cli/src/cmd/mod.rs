//! The subcommands of `kiln-run`, one module each, over the shared pieces they use.
//!
//! - [`args`]: the clap arguments several subcommands flatten in (model and cache, sampling,
//!   speculative decoding).
//! - [`common`]: what turns those arguments into library settings (threads, prompt text,
//!   sampler config, loading the model and its draft, chat templates) and the summaries
//!   `generate` and `chat` print.
//! - [`signals`]: the watcher that turns SIGINT, SIGTERM and SIGHUP into an [`Interrupt`], and
//!   the exit status of an interrupted run.
//! - [`generate`], [`chat`], [`bench`], [`serve`], [`embed`]: each subcommand's arguments and
//!   body.
//!
//! [`Interrupt`]: kiln_runner::Interrupt

pub mod args;
pub mod bench;
pub mod chat;
pub mod common;
pub mod embed;
pub mod generate;
pub mod serve;
pub mod signals;
