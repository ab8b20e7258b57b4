//! A generation in flight, as a Python iterator of the server's JSON answers.
//!
//! The front validates the request and builds the answer exactly as `kiln-run serve` does
//! ([`kiln_server::App::chat`], [`kiln_server::front::answer::Output`]); the answer borrows
//! the model's tokenizer, so a thread holding the model's front turns the engine's events into
//! JSON and hands the Python side finished strings over a bounded channel. The Python side
//! waits with the GIL released, looking at signals between waits: Ctrl-C raises
//! `KeyboardInterrupt` in the caller and cancels the job, and so does dropping the iterator.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use kiln_server::api::ApiError;
use kiln_server::{App, Kind, Pending};
use pyo3::prelude::*;

use crate::errors::{InvalidRequestError, KilnError};
use crate::model::Front;

/// How often a waiting caller looks at Python's signals, and the forwarding thread at whether
/// its caller has gone: short enough that Ctrl-C feels immediate, long enough to cost nothing.
const POLL: Duration = Duration::from_millis(50);

/// Answers held for a caller slower than the engine (a stream being read a chunk at a time);
/// beyond them the forwarding thread waits.
const BUFFER: usize = 64;

/// What the forwarding thread sends the caller.
enum Msg {
    /// One JSON answer: the whole response, or a stream's next chunk.
    Json(String),
    /// The request was refused or failed.
    Error(ApiError),
}

/// An OpenAI request being answered: iterate it for the JSON answers (one for a whole
/// response; the chunks of a stream).
#[pyclass(module = "kiln._kiln")]
pub struct Request {
    /// `None` once cancelled: the forwarding thread's next send fails and it cancels the job.
    rx: Mutex<Option<Receiver<Msg>>>,
    /// Raised when the caller stops waiting (dropped, interrupted): the job is cancelled.
    abandon: Arc<AtomicBool>,
    finished: bool,
}

impl std::fmt::Debug for Request {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Request")
            .field("finished", &self.finished)
            .finish_non_exhaustive()
    }
}

impl Drop for Request {
    fn drop(&mut self) {
        self.abandon.store(true, Ordering::SeqCst);
    }
}

impl Request {
    /// Hand `body` to `front` as a `kind` request on a forwarding thread.
    pub(crate) fn start(
        py: Python<'_>,
        front: Arc<Front>,
        kind: Kind,
        body: Vec<u8>,
    ) -> PyResult<Request> {
        let (tx, rx) = std::sync::mpsc::sync_channel(BUFFER);
        let abandon = Arc::new(AtomicBool::new(false));
        let flag = abandon.clone();
        py.detach(|| {
            std::thread::Builder::new()
                .name("kiln-request".into())
                .spawn(move || forward(&front, kind, &body, &tx, &flag))
        })
        .map_err(|e| KilnError::new_err(format!("starting a request thread: {e}")))?;
        Ok(Request {
            rx: Mutex::new(Some(rx)),
            abandon,
            finished: false,
        })
    }
}

#[pymethods]
impl Request {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    /// The next JSON answer; `StopIteration` after the last.
    fn __next__(&mut self, py: Python<'_>) -> PyResult<Option<String>> {
        if self.finished {
            return Ok(None);
        }
        loop {
            let rx = &self.rx;
            let got = py.detach(
                || match &*rx.lock().unwrap_or_else(PoisonError::into_inner) {
                    Some(rx) => rx.recv_timeout(POLL),
                    None => Err(RecvTimeoutError::Disconnected),
                },
            );
            match got {
                Ok(Msg::Json(s)) => return Ok(Some(s)),
                Ok(Msg::Error(e)) => {
                    self.finished = true;
                    return Err(api_error(py, &e));
                }
                Err(RecvTimeoutError::Disconnected) => {
                    self.finished = true;
                    return Ok(None);
                }
                Err(RecvTimeoutError::Timeout) => {
                    if let Err(e) = py.check_signals() {
                        self.cancel();
                        return Err(e);
                    }
                }
            }
        }
    }

    /// Stop the generation: the engine frees its sequence at its next step.
    fn cancel(&mut self) {
        self.abandon.store(true, Ordering::SeqCst);
        self.finished = true;
        self.rx
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
    }
}

/// `e` as Python sees it: a refused request (4xx) is an [`InvalidRequestError`] carrying
/// `param` and `status`; the engine failing (5xx) a [`KilnError`].
fn api_error(py: Python<'_>, e: &ApiError) -> PyErr {
    let err = if e.status < 500 {
        InvalidRequestError::new_err(e.message.clone())
    } else {
        KilnError::new_err(e.message.clone())
    };
    let value = err.value(py);
    // Setting attributes on a fresh exception instance cannot fail but for memory; the
    // message alone still says everything.
    let _ = value.setattr("param", e.param.clone());
    let _ = value.setattr("status", e.status);
    err
}

/// Send `msg`, waiting while the caller is [`BUFFER`] answers behind; whether it was taken
/// (not when the caller has dropped or cancelled the request).
fn send(tx: &SyncSender<Msg>, abandon: &AtomicBool, msg: Msg) -> bool {
    !abandon.load(Ordering::SeqCst) && tx.send(msg).is_ok()
}

/// The forwarding thread: submit the request, then turn each event into the answer's JSON
/// until the last, or until the caller goes (then cancel the job).
fn forward(front: &Front, kind: Kind, body: &[u8], tx: &SyncSender<Msg>, abandon: &AtomicBool) {
    front.with_dependent(|_, app| answer(app, kind, body, tx, abandon));
}

/// [`forward`] with the front borrowed.
fn answer(app: &App<'_>, kind: Kind, body: &[u8], tx: &SyncSender<Msg>, abandon: &AtomicBool) {
    let started = match kind {
        Kind::Chat => app.chat(body),
        Kind::Completion => app.completion(body),
    };
    let mut p = match started {
        Ok(p) => p,
        Err(e) => {
            send(tx, abandon, Msg::Error(e));
            return;
        }
    };
    let answered = if p.stream {
        stream(&mut p, tx, abandon)
    } else {
        whole(&mut p, tx, abandon)
    };
    if answered {
        p.cancel.finished();
    }
}

/// The next event, or `None` once the caller has gone (looked at before every event: a
/// running job sends one a token, so waiting for a quiet moment would never see it) or the
/// engine dropped the job.
fn next_event(p: &Pending<'_>, abandon: &AtomicBool) -> Option<kiln_runner::engine::job::Event> {
    loop {
        if abandon.load(Ordering::SeqCst) {
            return None;
        }
        match p.events.recv_timeout(POLL) {
            Ok(e) => return Some(e),
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => return None,
        }
    }
}

/// A whole answer; whether the caller took it.
fn whole(p: &mut Pending<'_>, tx: &SyncSender<Msg>, abandon: &AtomicBool) -> bool {
    loop {
        let Some(event) = next_event(p, abandon) else {
            return engine_gone(tx, abandon);
        };
        match p.output.absorb(event) {
            None => {}
            Some(Ok(v)) => return send(tx, abandon, Msg::Json(v.to_string())),
            Some(Err(e)) => return send(tx, abandon, Msg::Error(e)),
        }
    }
}

/// A streamed answer, chunk by chunk; whether the caller took it all.
fn stream(p: &mut Pending<'_>, tx: &SyncSender<Msg>, abandon: &AtomicBool) -> bool {
    if let Some(first) = p.output.opening() {
        if !send(tx, abandon, Msg::Json(first.to_string())) {
            return false;
        }
    }
    loop {
        let Some(event) = next_event(p, abandon) else {
            return engine_gone(tx, abandon);
        };
        let step = p.output.step(event, p.include_usage);
        for chunk in step.chunks {
            if !send(tx, abandon, Msg::Json(chunk.to_string())) {
                return false;
            }
        }
        match step.end {
            None => {}
            Some(Ok(())) => return true,
            Some(Err(e)) => return send(tx, abandon, Msg::Error(e)),
        }
    }
}

/// The events stopped without a last one: the caller went (nothing to say), or the engine
/// dropped the job (it stopped: say so).
fn engine_gone(tx: &SyncSender<Msg>, abandon: &AtomicBool) -> bool {
    if abandon.load(Ordering::SeqCst) {
        return false;
    }
    let e = ApiError::new(
        500,
        "server_error",
        "the engine stopped before finishing the request",
    );
    send(tx, abandon, Msg::Error(e))
}
