//! `kiln-runner`: fast CPU inference of Llama-family models stored in `.kiln` files.
//!
//! Loading: [`config::open_model`] maps and validates the file, [`Model::load`] resolves the
//! [`Config`] (checking every tensor's presence, shape and encoding) and borrows the
//! [`Weights`] in place from the map: F32, F16, BF16, Q8_0 and Q4_0 matrices, mixed freely,
//! are never dequantized to a copy.
//!
//! Running: a [`Session`] owns one sequence's [`kv_cache::KvCache`] (allocated once for the
//! context), rope tables and thread pool; [`Session::forward`] runs a batch of tokens through
//! the one forward pass ([`model`]) built from the `kiln-kernels` operations plus the
//! model-level ones here ([`rope`], [`attention`], the embedding lookup), optionally reporting
//! named activations to an [`Observer`] for layer-by-layer verification.
//!
//! Text: [`Tokenizer`] wraps the embedded `tokenizer.json`; [`ChatTemplate`] renders the
//! embedded chat template (under instruction and output limits, and for `kiln-run` in a child
//! process with memory and CPU limits: [`sandbox`]); [`Sampler`] picks tokens.
//!
//! Decoding: one [`engine::Engine`] owns the decoding loop (admit, prefill a chunk, settle,
//! propose guesses, decode a batch, retire), the one speculation policy (prompt lookup,
//! [`lookup`], or a [`draft::Draft`] model) and the [`Interrupt`] check. `kiln-run serve`
//! feeds it from a bounded queue ([`engine::EngineHandle`], behind the HTTP side in
//! [`serve`]); [`generate::generate`] and [`generate::Conversation`] run it with one slot,
//! streaming UTF-8-safe text and returning the run's [`generate::Stats`]; [`bench::bench`]
//! measures prefill and decode throughput (its speculative test through the engine). The
//! `kiln-run` binary is a thin command line over these.
//!
//! Embeddings: [`embed::Embedder`] pools an encoder's token states into vectors;
//! [`embed_stream`] feeds it texts from the command line, a file or a stream and writes JSON
//! lines or `.npy`, a batch at a time. Every context is weighed by [`Model::check_context`]
//! against [`memory::available`] before anything is built for it.

pub mod attention;
pub mod bench;
pub mod chat;
pub mod config;
pub mod draft;
pub mod embed;
pub mod embed_stream;
pub mod engine;
pub mod error;
pub mod generate;
pub mod kv_cache;
pub mod lookup;
pub mod memory;
pub mod model;
pub mod observer;
pub mod rope;
pub mod sampler;
pub mod sandbox;
pub mod serve;
pub mod text_file;
pub mod threads;
pub mod tokenizer;
pub mod weights;

pub use chat::{ChatTemplate, Message, TemplateVars};
pub use config::{open_model, open_model_verified, Config};
pub use error::{Result, RunnerError};
pub use generate::{generate, Conversation, GenerateOptions, Generation, Interrupt, StopReason};
pub use kv_cache::{CacheType, SlidingCache};
pub use model::{Compute, Logits, Model, Sequence, Session};
pub use observer::{Activation, Observer, Recorder};
pub use sampler::{Sampler, SamplerConfig};
pub use tokenizer::Tokenizer;
pub use weights::Weights;
