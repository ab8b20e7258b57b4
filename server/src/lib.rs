//! `kiln-server`: the HTTP side of `kiln-run serve`, OpenAI's API and a chat page over
//! `kiln-runner`'s serving engine.
//!
//! The HTTP stack is axum's router on hyper's HTTP/1.1 over tokio; Kiln's code here is only
//! what the API means. [`serve`] runs a small tokio runtime ([`WORKER_THREADS`] threads: they
//! parse and wait, the engine's own threads compute) and its own accept loop
//! ([`listen`]), which hands each connection to hyper with the header read timeout and a
//! write timeout. One [`axum::Router`] ([`routes`]) holds every route and every limit:
//!
//! - request bodies: `Content-Length` checked on the head, and axum's `DefaultBodyLimit`
//!   for chunked bodies (413), read within the request timeout (408);
//! - heads: hyper's buffer and header-count limits (431) and its header read timeout;
//! - requests in flight: tower's global concurrency limit with load shedding (503 and
//!   `Retry-After`); idle, silent and slow connections never count, and `/health` is outside it;
//! - the engine's bounded queue: a full queue is a 503 with `Retry-After`;
//! - `Host` (one, required on HTTP/1.1), the API key (checked before a body is read, so before
//!   `100 Continue`), CORS (tower-http, off unless origins are named), and the page's security
//!   headers.
//!
//! The handlers ([`front`]) parse and validate with [`api`], send the engine a
//! [`kiln_runner::engine::job::Job`] through its [`kiln_runner::engine::EngineHandle`],
//! and stream back what it sends: one JSON body or Server-Sent Events ([`front::answer`]).
//! A client that goes away drops its handler, which cancels its sequence. An embedding model
//! is served through [`kiln_runner::serve::embeddings::EmbedService`] instead. Every log line
//! goes through the runner's [`kiln_runner::serve::log::line`].

pub mod api;
mod error;
pub mod front;
mod listen;
pub mod page;
mod routes;

pub use error::ServerError;
pub use front::{App, Cancel, FrontConfig, FrontModel, Kind, Pending};
pub use listen::{serve, WORKER_THREADS};
