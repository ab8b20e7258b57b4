//! What `kiln-run serve` needs beside the engine (its HTTP side is the `kiln-server` crate).
//!
//! Front ends meet the decoding engine ([`crate::engine`]) only through its jobs: they turn
//! requests into [`crate::engine::Job`]s and submit them through an
//! [`crate::engine::EngineHandle`] (a bounded queue). Output can be held to a JSON schema
//! ([`grammar`]). Every log line goes through [`log::line`], which escapes what a client could
//! forge lines with. An embedding model is served by [`embeddings`] instead of the engine:
//! [`embeddings::EmbedJob`]s taking turns at one embedder.

pub mod embeddings;
pub mod grammar;
pub mod log;
