//! `kiln-run serve`: an OpenAI-compatible HTTP server over one model.
//!
//! Two sides meet through [`job`]: connection threads ([`front`], over the HTTP/1.1 layer in
//! [`http`] and the request and response shapes in [`api`]) turn requests into [`job::Job`]s,
//! and one engine thread ([`engine`], the decoding engine the command line drives too)
//! decodes every active sequence in one forward pass per step, reads new prompts in chunks
//! between steps, and keeps finished conversations' KV caches for reuse ([`prompt_cache`]).
//! Output can be held to a JSON schema ([`grammar`]).
//! Every log line goes through [`log::line`], which escapes what a client could forge lines with.
//! [`page`] is the chat page served at `/`. An embedding model is served by [`embeddings`]
//! instead of the engine: `/v1/embeddings`, requests taking turns at one embedder.

pub mod api;
pub mod embeddings;
pub mod front;
pub mod grammar;
pub mod http;
pub mod log;
pub mod page;

/// The engine the server drives, at the paths the HTTP side names it by.
pub use crate::engine::{self, job, prompt_cache};
