//! The serving engine behind `kiln-run serve` (its HTTP side is the `kiln-server` crate).
//!
//! Front ends meet the engine only through [`job`]: they turn requests into [`job::Job`]s and
//! submit them through an [`engine::EngineHandle`] (a bounded queue); one engine thread
//! ([`engine`]) decodes every active sequence in one forward pass per step, reads new prompts
//! in chunks between steps, and keeps finished conversations' KV caches for reuse
//! ([`prompt_cache`]). Output can be held to a JSON schema ([`grammar`]). Every log line goes
//! through [`log::line`], which escapes what a client could forge lines with. An embedding
//! model is served by [`embeddings`] instead of the engine: [`embeddings::EmbedJob`]s taking
//! turns at one embedder.

pub mod embeddings;
pub mod engine;
pub mod grammar;
pub mod job;
pub mod log;
pub mod prompt_cache;
