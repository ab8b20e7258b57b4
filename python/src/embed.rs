//! `Model.embed`: the server's embedder ([`EmbedService::embed_all`]) into a NumPy array.
//!
//! The vectors are what `kiln-run embed` and `/v1/embeddings` give for the same texts (a text's
//! vector does not depend on its batch); the array takes the one flat buffer they are copied
//! into without another copy.

use std::sync::Mutex;

use kiln_runner::serve::embeddings::{EmbedError, EmbedInput, EmbedJob, EmbedService};
use numpy::{PyArray1, PyArrayMethods};
use pyo3::prelude::*;

use crate::errors::{InvalidRequestError, KilnError};
use crate::model::Embedding;

/// What to embed, from Python: one text (a vector back) or a list (a matrix back).
pub(crate) enum Texts {
    One(String),
    Many(Vec<String>),
}

/// Embed `texts` with `embedding`: a `(n, dim)` float32 array, or `(dim,)` for one text.
/// Ctrl-C stops it between passes.
pub(crate) fn embed<'py>(
    py: Python<'py>,
    embedding: &Embedding,
    texts: Texts,
    job: EmbedJob,
) -> PyResult<Bound<'py, PyAny>> {
    let (one, list) = match texts {
        Texts::One(t) => (true, vec![t]),
        Texts::Many(l) => (false, l),
    };
    if list.is_empty() {
        return Err(InvalidRequestError::new_err(
            "input is empty: give a text or a list of texts",
        ));
    }
    let job = EmbedJob {
        input: EmbedInput::Texts(list),
        ..job
    };
    let interrupted: Mutex<Option<PyErr>> = Mutex::new(None);
    let abandoned = || {
        Python::attach(|py| match py.check_signals() {
            Ok(()) => false,
            Err(e) => {
                *interrupted.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                true
            }
        })
    };
    let result = py.detach(|| {
        embedding.with_dependent(|_, service: &EmbedService<'_>| {
            service
                .embed_all(&job, &abandoned)
                .map(|out| (out, service.dim()))
        })
    });
    let (out, dim) = match result {
        Ok(r) => r,
        Err(e) => {
            if let Some(err) = interrupted.into_inner().unwrap_or_else(|p| p.into_inner()) {
                return Err(err);
            }
            return Err(embed_error(e));
        }
    };
    let n = out.vectors.len();
    let mut flat = Vec::with_capacity(n * dim);
    out.vectors.iter().for_each(|v| flat.extend_from_slice(v));
    let array = PyArray1::from_vec(py, flat);
    if one {
        return Ok(array.into_any());
    }
    Ok(array.reshape([n, dim])?.into_any())
}

fn embed_error(e: EmbedError) -> PyErr {
    match e {
        EmbedError::Invalid { param, message } => {
            let err = InvalidRequestError::new_err(message);
            Python::attach(|py| {
                let _ = err.value(py).setattr("param", param);
                let _ = err.value(py).setattr("status", 400);
            });
            err
        }
        EmbedError::Busy(m) | EmbedError::Failed(m) => KilnError::new_err(m),
    }
}
