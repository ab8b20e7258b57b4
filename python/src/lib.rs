//! `kiln._kiln`: the extension module under the `kiln` Python package.
//!
//! Nothing here is a second implementation: a [`model::Model`] opens and verifies a `.kiln`
//! file as `kiln-run` does, runs the same engine on a thread of its own
//! ([`kiln_runner::engine::Engine::serve`]) and answers through the same front as
//! `kiln-run serve` ([`kiln_server::front::App`]): a Python call hands it the request's JSON
//! body and gets the server's JSON answer, so parameters, refusals and response shapes are the
//! server's. Embeddings go through the server's embedder ([`kiln_runner::serve::embeddings`])
//! into a NumPy array; [`tools`] exposes the converter, the quantizer and layer-by-layer
//! verification.
//!
//! The GIL is released whenever Kiln computes or waits, and every wait looks at Python's
//! signals, so Ctrl-C interrupts a generation (its sequence is freed at the engine's next step).

use pyo3::prelude::*;

mod embed;
mod errors;
mod model;
mod request;
mod tools;

pub use errors::{InvalidRequestError, KilnError};

/// Write the engine's log on stderr (off by default): one line per finished request (tokens,
/// times, cache use) and each refusal or failure, as `kiln-run serve` writes them.
#[pyfunction]
fn log_to_stderr(on: bool) {
    kiln_runner::serve::log::set_enabled(on);
}

/// The module `kiln._kiln`.
#[pymodule]
fn _kiln(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("KilnError", m.py().get_type::<KilnError>())?;
    m.add(
        "InvalidRequestError",
        m.py().get_type::<InvalidRequestError>(),
    )?;
    m.add_class::<model::Model>()?;
    m.add_class::<request::Request>()?;
    m.add_function(wrap_pyfunction!(log_to_stderr, m)?)?;
    // Quiet unless asked: a library's user owns their stderr.
    kiln_runner::serve::log::set_enabled(false);
    tools::register(m)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
