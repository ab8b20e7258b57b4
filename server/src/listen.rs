//! The accept loop: a small tokio runtime, one task per connection served by hyper's HTTP/1.1
//! with the header read timeout, and writes that must make progress within the request
//! timeout ([`WriteTimeout`]), so a client that stops reading cannot hold a response (and its
//! sequence) forever.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use kiln_runner::engine::EngineHandle;
use kiln_runner::generate::Interrupt;
use kiln_runner::serve::log;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::task::JoinSet;
use tokio::time::Sleep;

use crate::error::ServerError;
use crate::front::{App, FrontConfig, FrontModel, POLL};
use crate::routes;

/// Threads of the HTTP runtime. They only parse, validate and move bytes (the engine's own
/// threads do the compute, and blocking work such as template rendering and embedding runs on
/// tokio's blocking pool), so two keep the server responsive without taking cores from the
/// model.
pub const WORKER_THREADS: usize = 2;

/// Largest request head hyper buffers (431 beyond): room for long bearer tokens and cookies,
/// far below what would let a client make the server hold much memory per connection.
const MAX_HEAD_BYTES: usize = 16 * 1024;

/// Most header lines in a request head (431 beyond).
const MAX_HEADERS: usize = 100;

/// How long the runtime waits, once stopped, for blocking tasks still running (a request
/// being embedded notices the stop between passes).
const SHUTDOWN_WAIT: Duration = Duration::from_secs(1);

/// Serve on `listener` until `stop` is raised, then close every connection and return. `engine`
/// generates; an embedding model has none. The model is `'static`: the server holds it
/// until the process ends.
pub fn serve(
    listener: std::net::TcpListener,
    cfg: &FrontConfig,
    model: FrontModel<'static>,
    engine: Option<EngineHandle>,
    stop: &Interrupt,
) -> Result<(), ServerError> {
    listener
        .set_nonblocking(true)
        .map_err(|e| ServerError::io("making the listening socket nonblocking", e))?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(WORKER_THREADS)
        .thread_name("kiln-http")
        .enable_all()
        .build()
        .map_err(|e| ServerError::io("starting the HTTP runtime", e))?;
    let app = Arc::new(App::new(cfg.clone(), model, engine, stop.clone()));
    let served = runtime.block_on(accept_loop(listener, app, cfg.request_timeout, stop));
    runtime.shutdown_timeout(SHUTDOWN_WAIT);
    served
}

/// Accept connections until `stop`, each served on its own task; then drop them all.
async fn accept_loop(
    listener: std::net::TcpListener,
    app: Arc<App<'static>>,
    timeout: Duration,
    stop: &Interrupt,
) -> Result<(), ServerError> {
    let listener = tokio::net::TcpListener::from_std(listener)
        .map_err(|e| ServerError::io("registering the listening socket", e))?;
    let router = routes::router(app);
    let mut connections = JoinSet::new();
    let mut tick = tokio::time::interval(POLL);
    let timeout = timeout.max(Duration::from_millis(1));
    while !stop.is_raised() {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    connections.spawn(connection(stream, router.clone(), timeout));
                }
                Err(e) => {
                    // Out of descriptors or a connection reset before accept: log, back off,
                    // keep serving.
                    log::line(format_args!("accept failed: {e}"));
                    tokio::time::sleep(POLL).await;
                }
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
            _ = tick.tick() => {}
        }
    }
    connections.abort_all();
    while connections.join_next().await.is_some() {}
    Ok(())
}

/// Serve one connection with hyper until it closes, fails or times out.
async fn connection(stream: TcpStream, router: axum::Router, timeout: Duration) {
    let _ = stream.set_nodelay(true);
    let io = TokioIo::new(WriteTimeout::new(stream, timeout));
    let service = TowerToHyperService::new(router);
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(timeout)
        .max_buf_size(MAX_HEAD_BYTES)
        .max_headers(MAX_HEADERS)
        .title_case_headers(true);
    // An error here is the client's (a reset, a timeout, a malformed head hyper answered);
    // the connection simply ends.
    let _ = http.serve_connection(io, service).await;
}

/// A stream whose writes fail with `TimedOut` once one has waited `limit` for the client to
/// take bytes: hyper then drops the connection, and with it the response and its job.
struct WriteTimeout {
    inner: TcpStream,
    limit: Duration,
    /// Armed while a write waits; cleared by any progress.
    waiting: Option<Pin<Box<Sleep>>>,
}

impl WriteTimeout {
    fn new(inner: TcpStream, limit: Duration) -> Self {
        WriteTimeout {
            inner,
            limit,
            waiting: None,
        }
    }

    /// `poll` made progress (clear the timer), or waits (arm it, and fail once it fires).
    fn timed<T>(
        &mut self,
        cx: &mut Context<'_>,
        poll: impl FnOnce(Pin<&mut TcpStream>, &mut Context<'_>) -> Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>> {
        match poll(Pin::new(&mut self.inner), cx) {
            Poll::Ready(r) => {
                self.waiting = None;
                Poll::Ready(r)
            }
            Poll::Pending => {
                let limit = self.limit;
                let timer = self
                    .waiting
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
                match timer.as_mut().poll(cx) {
                    Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "the client took no bytes within the request timeout",
                    ))),
                    Poll::Pending => Poll::Pending,
                }
            }
        }
    }
}

impl AsyncRead for WriteTimeout {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for WriteTimeout {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.timed(cx, |s, cx| s.poll_write(cx, buf))
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.timed(cx, |s, cx| s.poll_write_vectored(cx, bufs))
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.timed(cx, |s, cx| s.poll_flush(cx))
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.timed(cx, |s, cx| s.poll_shutdown(cx))
    }
}
