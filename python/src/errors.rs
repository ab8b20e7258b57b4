//! The exceptions Kiln raises: each carries the message `kiln-run` prints for the same
//! failure, so a user reads the same words whichever front end they use.

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::PyErr;

create_exception!(
    _kiln,
    KilnError,
    PyException,
    "A Kiln failure: a file that cannot be opened, verified or loaded, a failed conversion, \
     quantization or verification, or the engine stopping. The message is the command line's."
);

create_exception!(
    _kiln,
    InvalidRequestError,
    KilnError,
    "A request Kiln refuses, as `kiln-run serve` answers it with a 4xx: `param` names the \
     argument at fault (or is None), `status` is the HTTP status the server would send."
);

/// `e` (a runner, converter, quantizer or verify error) as a [`KilnError`].
pub fn kiln_error(e: impl std::fmt::Display) -> PyErr {
    KilnError::new_err(e.to_string())
}
