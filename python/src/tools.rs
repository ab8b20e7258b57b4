//! `kiln.convert`, `kiln.quantize` and `kiln.verify.layers`: the library calls `kiln-convert`,
//! `kiln-quantize` and `kiln-verify layers` make, with the same flags (as keyword arguments,
//! snake_case) and the same validation, so the files written are byte for byte the command
//! line's and a refusal reads as the command line's message. Results are the reports
//! `--json` prints, as dicts and lists.
//!
//! The GIL is released while the work runs. A quantization runs on a thread of its own while
//! the calling thread looks at Python's signals (which only the main thread can), so Ctrl-C
//! stops it; a progress callback that raises stops it too, and the exception is re-raised.
//! Either way the library's atomic writer removes the unfinished output.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use kiln_convert::convert::{float_dtype, Request as ConvertRequest};
use kiln_convert::ConvertError;
use kiln_quantize::request::{self as quantize_request, Request as QuantizeRequest};
use kiln_quantize::{Progress, QuantizeError, TensorReport};
use kiln_verify::request::{self as verify_request, LayersRequest};
use kiln_verify::VerifyError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::{kiln_error, InvalidRequestError};

/// How often the calling thread looks at Python's signals while a quantization runs.
const SIGNAL_POLL: Duration = Duration::from_millis(50);

/// Add the three functions to `_kiln`.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(convert, m)?)?;
    m.add_function(wrap_pyfunction!(quantize, m)?)?;
    m.add_function(wrap_pyfunction!(verify_layers, m)?)?;
    Ok(())
}

/// A refused argument as [`InvalidRequestError`], with `param` (the keyword at fault, or
/// None) and `status` (400) as the server's refusals carry them.
fn invalid(py: Python<'_>, param: Option<&str>, message: String) -> PyErr {
    let e = InvalidRequestError::new_err(message);
    let value = e.value(py);
    // Setting attributes on a fresh exception instance cannot fail in practice; if it did,
    // the exception still carries its message.
    let _ = value.setattr("param", param);
    let _ = value.setattr("status", 400);
    e
}

/// A numeric keyword checked by the command line's parser for its flag, with clap's words.
fn number<T>(
    py: Python<'_>,
    param: &str,
    value: impl std::fmt::Display,
    parse: impl Fn(&str) -> Result<T, String>,
) -> PyResult<T> {
    let text = value.to_string();
    let flag = format!("--{}", param.replace('_', "-"));
    parse(&text).map_err(|reason| {
        invalid(
            py,
            Some(param),
            format!("invalid value '{text}' for '{flag}': {reason}"),
        )
    })
}

/// A report (serialized as `--json` prints it) as the dicts and lists that JSON parses to.
fn to_python(py: Python<'_>, json: serde_json::Result<String>) -> PyResult<Bound<'_, PyAny>> {
    let text = json.map_err(kiln_error)?;
    py.import("json")?.call_method1("loads", (text,))
}

/// Convert a model as `kiln-convert` does, choosing the subcommand by the paths: a `dst`
/// ending in `.gguf` exports a `.kiln` file (`export-gguf`); a `src` ending in `.gguf` (or a
/// file starting with GGUF's magic) is imported (`gguf`); anything else is a Hugging Face
/// checkpoint directory (`hf`). `dtype` (hf) and `dequantize_to` (gguf) take f32, f16 or
/// bf16. Returns the subcommand's summary (what `--json` prints). Raises KilnError with the
/// command line's message; InvalidRequestError for an option the subcommand has not.
#[pyfunction]
#[pyo3(signature = (src, dst, *, dtype=None, dequantize_to="f16", dequantize_all=false,
                    force=false, allow_non_finite=false))]
#[allow(clippy::too_many_arguments)] // the command line's flags, one keyword each
fn convert<'py>(
    py: Python<'py>,
    src: PathBuf,
    dst: PathBuf,
    dtype: Option<&str>,
    dequantize_to: &str,
    dequantize_all: bool,
    force: bool,
    allow_non_finite: bool,
) -> PyResult<Bound<'py, PyAny>> {
    let bad = |param: &str, e: ConvertError| invalid(py, Some(param), e.to_string());
    let mut req = ConvertRequest::new(src, dst);
    req.dtype = dtype
        .map(|d| float_dtype("--dtype", d))
        .transpose()
        .map_err(|e| bad("dtype", e))?;
    req.dequantize_to =
        float_dtype("--dequantize-to", dequantize_to).map_err(|e| bad("dequantize_to", e))?;
    req.dequantize_all = dequantize_all;
    req.force = force;
    req.allow_non_finite = allow_non_finite;
    let summary = py.detach(|| kiln_convert::convert::convert(&req, &kiln_convert::NoProgress));
    match summary {
        Ok(s) => to_python(py, serde_json::to_string(&s)),
        Err(e @ ConvertError::BadOption { .. }) => Err(invalid(py, None, e.to_string())),
        Err(e) => Err(kiln_error(e)),
    }
}

/// A quantizer error as Python sees it: a refused flag is an [`InvalidRequestError`].
fn quantize_error(py: Python<'_>, e: QuantizeError) -> PyErr {
    match e {
        QuantizeError::BadTarget { .. } => invalid(py, Some("to"), e.to_string()),
        QuantizeError::BadOverride { .. } | QuantizeError::BadArgument { .. } => {
            invalid(py, None, e.to_string())
        }
        e => kiln_error(e),
    }
}

/// Quantize a `.kiln` model as `kiln-quantize` does; every keyword is the flag of that name
/// (`keep` a list of "PATTERN=DTYPE"). `progress(done, total, name)` is called with the GIL
/// held: during quantization after each tensor (`name` the tensor; `done`/`total` the values
/// converted so far and in all), during calibration and `to="auto"`'s measuring after each
/// step (`name` is "calibrating" or "measuring"; tokens or values). `done` never decreases
/// within a phase. If it raises, or Ctrl-C arrives, quantization stops, no output is left and
/// the exception propagates. Returns the report `--json` prints, plus "notices" (what
/// calibration and the budget found).
#[pyfunction]
#[pyo3(signature = (src, dst, *, to, method=None, calibrate=None, calib_tokens=None,
                    calib_ctx=None, importance=None, save_importance=None, bpw=None,
                    max_bytes=None, keep=Vec::new(), threads=None, force=false, progress=None))]
#[allow(clippy::too_many_arguments)] // the command line's flags, one keyword each
fn quantize<'py>(
    py: Python<'py>,
    src: PathBuf,
    dst: PathBuf,
    to: &str,
    method: Option<String>,
    calibrate: Option<PathBuf>,
    calib_tokens: Option<i64>,
    calib_ctx: Option<i64>,
    importance: Option<PathBuf>,
    save_importance: Option<PathBuf>,
    bpw: Option<f64>,
    max_bytes: Option<i64>,
    keep: Vec<String>,
    threads: Option<i64>,
    force: bool,
    progress: Option<Py<PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    let mut req = QuantizeRequest::new(src, dst, to);
    if let Some(n) = calib_tokens {
        req.calib_tokens = number(py, "calib_tokens", n, quantize_request::calib_tokens_arg())?;
    }
    if let Some(n) = calib_ctx {
        req.calib_ctx = number(py, "calib_ctx", n, quantize_request::calib_ctx_arg())?;
    }
    req.bpw = bpw
        .map(|b| number(py, "bpw", b, quantize_request::bpw_arg()))
        .transpose()?;
    req.max_bytes = max_bytes
        .map(|n| number(py, "max_bytes", n, quantize_request::max_bytes_arg()))
        .transpose()?;
    req.threads = threads
        .map(|n| number(py, "threads", n, quantize_request::threads_arg()))
        .transpose()?
        .map(|t| kiln_runner::threads::cap_threads(t as usize));
    req.method = method;
    req.calibrate = calibrate;
    req.importance = importance;
    req.save_importance = save_importance;
    req.keep = keep;
    req.force = force;
    let watcher = PyProgress::new(progress);
    let outcome = run_interruptible(py, &watcher.stop, || quantize_request::run(&req, &watcher))?;
    if let Some(e) = watcher
        .error
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .take()
    {
        return Err(e);
    }
    let report = outcome.map_err(|e| quantize_error(py, e))?;
    let report = to_python(py, serde_json::to_string(&report))?;
    let notices = std::mem::take(&mut *watcher.notices.lock().unwrap_or_else(|e| e.into_inner()));
    report.cast::<PyDict>()?.set_item("notices", notices)?;
    Ok(report)
}

/// Run `work` on a thread of its own with the GIL released, while this thread looks at
/// Python's signals every [`SIGNAL_POLL`]: a signal handler that raises (Ctrl-C's
/// KeyboardInterrupt) sets `stop` and its exception is returned once `work` has stopped.
fn run_interruptible<T: Send>(
    py: Python<'_>,
    stop: &AtomicBool,
    work: impl FnOnce() -> T + Send,
) -> PyResult<T> {
    let (value, interrupted) = py.detach(|| {
        std::thread::scope(|s| {
            let (done, finished) = std::sync::mpsc::channel();
            let worker = s.spawn(move || {
                let value = work();
                let _ = done.send(());
                value
            });
            let mut interrupted = None;
            while finished.recv_timeout(SIGNAL_POLL).is_err() && !worker.is_finished() {
                if interrupted.is_none() {
                    if let Err(e) = Python::attach(|py| py.check_signals()) {
                        stop.store(true, Ordering::Relaxed);
                        interrupted = Some(e);
                    }
                }
            }
            let value = worker
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
            (value, interrupted)
        })
    });
    match interrupted {
        Some(e) => Err(e),
        None => Ok(value),
    }
}

/// The quantizer's [`Progress`] reported to a Python callable; an exception it raises is
/// kept (the first one) and stops the run.
struct PyProgress {
    callback: Option<Py<PyAny>>,
    /// The current phase's name, total and units done; held while the callback runs, so
    /// calls from worker threads are in order.
    state: Mutex<(String, u64, u64)>,
    error: Mutex<Option<PyErr>>,
    stop: AtomicBool,
    notices: Mutex<Vec<String>>,
}

impl PyProgress {
    fn new(callback: Option<Py<PyAny>>) -> PyProgress {
        PyProgress {
            callback,
            state: Mutex::new((String::new(), 0, 0)),
            error: Mutex::new(None),
            stop: AtomicBool::new(false),
            notices: Mutex::new(Vec::new()),
        }
    }

    /// `callback(done, total, name)`, unless the run is already stopping.
    fn call(&self, done: u64, total: u64, name: &str) {
        let Some(callback) = &self.callback else {
            return;
        };
        if self.stop.load(Ordering::Relaxed) {
            return;
        }
        let result = Python::attach(|py| callback.call1(py, (done, total, name)).map(drop));
        if let Err(e) = result {
            self.error
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get_or_insert(e);
            self.stop.store(true, Ordering::Relaxed);
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, (String, u64, u64)> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Progress for PyProgress {
    fn phase(&self, name: &str, total: u64) {
        *self.state() = (name.to_string(), total, 0);
    }

    /// Calibration and measuring report here; quantization per tensor, in `tensor_done`.
    fn advance(&self, n: u64) {
        let mut s = self.state();
        s.2 += n;
        if s.0 != "quantizing" {
            self.call(s.2, s.1, &s.0);
        }
    }

    fn tensor_done(&self, tensor: &TensorReport) {
        let s = self.state();
        self.call(s.2, s.1, &tensor.name);
    }

    fn notice(&self, text: &str) {
        let mut notices = self.notices.lock().unwrap_or_else(|e| e.into_inner());
        notices.push(text.to_string());
    }

    fn stop_requested(&self) -> bool {
        self.stop.load(Ordering::Relaxed)
    }
}

/// Compare a model's activations with a reference dump as `kiln-verify layers` does; each
/// keyword is the flag of that name (`junit` and `report` write those results files too).
/// Returns the report `--json` prints: "pass" (False when an activation is out of
/// tolerance: a result, not an exception), "first_failure", "tolerance", "weight_class" and
/// "entries" (per activation: "name", "shape", "max_abs", "rms", "rel", "cosine", "nmse",
/// "top1" for the logits, "pass"). Raises KilnError when the check cannot run (a missing or
/// corrupt file), with the command line's message.
#[pyfunction]
#[pyo3(signature = (model, reference, *, max_nmse=None, min_top1=None, tolerance=None,
                    threads=None, junit=None, report=None))]
#[allow(clippy::too_many_arguments)] // the command line's flags, one keyword each
fn verify_layers<'py>(
    py: Python<'py>,
    model: PathBuf,
    reference: PathBuf,
    max_nmse: Option<f64>,
    min_top1: Option<f64>,
    tolerance: Option<String>,
    threads: Option<i64>,
    junit: Option<PathBuf>,
    report: Option<PathBuf>,
) -> PyResult<Bound<'py, PyAny>> {
    let req = LayersRequest {
        model,
        reference,
        max_nmse: max_nmse
            .map(|v| number(py, "max_nmse", v, verify_request::max_nmse_arg()))
            .transpose()?,
        min_top1: min_top1
            .map(|v| number(py, "min_top1", v, verify_request::min_top1_arg()))
            .transpose()?,
        tolerance,
        threads: threads
            .map(|n| number(py, "threads", n, verify_request::threads_arg()))
            .transpose()?
            .map(kiln_runner::threads::cap_threads),
        junit,
        report,
    };
    match py.detach(|| verify_request::layers(&req)) {
        Ok(r) => to_python(py, serde_json::to_string(&r)),
        Err(e @ VerifyError::Usage(_)) => Err(invalid(py, Some("tolerance"), e.to_string())),
        Err(e) => Err(kiln_error(e)),
    }
}
