//! `kiln-verify layers`: run the model on a dump's tokens and compare every named activation,
//! in forward order, so the first one out of tolerance points at where the numbers went wrong.

use kiln_format::KilnFile;
use kiln_runner::embed::{EmbedOptions, Embedder};
use kiln_runner::{Logits, Model, Recorder};
use serde::Serialize;

use crate::dump::{Dump, SENTENCE_EMBEDDING};
use crate::error::{Result, VerifyError};
use crate::metrics::{argmax, Metrics};
use crate::tolerance::{Tolerance, WeightClass};

/// One compared activation.
#[derive(Debug, Clone, Serialize)]
pub struct Entry {
    /// transformers module path + `.output`, or `logits`.
    pub name: String,
    /// `[tokens, width]`.
    pub shape: [usize; 2],
    /// max |got − ref|.
    pub max_abs: f64,
    /// RMS of the error.
    pub rms: f64,
    /// ‖got − ref‖ / ‖ref‖.
    pub rel: f64,
    /// Cosine similarity.
    pub cosine: f64,
    /// Normalised MSE.
    pub nmse: f64,
    /// For `logits`: fraction of positions whose argmax matches.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top1: Option<f64>,
    /// Within tolerance.
    pub pass: bool,
}

/// The `layers` report.
#[derive(Debug, Clone, Serialize)]
pub struct LayersReport {
    /// Model file.
    pub model: String,
    /// Reference dump.
    pub reference: String,
    /// Weight class that chose the tolerance.
    pub weight_class: WeightClass,
    /// Limits applied.
    pub tolerance: Tolerance,
    /// Prompt length.
    pub tokens: usize,
    /// Every entry passed.
    pub pass: bool,
    /// First entry out of tolerance in forward order.
    pub first_failure: Option<String>,
    /// Compared activations in forward order.
    pub entries: Vec<Entry>,
    /// Dump tensors that were not compared (unknown names, or not produced by the runner).
    pub not_compared: Vec<String>,
}

/// Compare `file` against `dump`. `tolerance` overrides the weight-class default.
pub fn verify_layers(
    file: &KilnFile,
    dump: &Dump,
    tolerance: Option<Tolerance>,
    threads: usize,
) -> Result<LayersReport> {
    let class = WeightClass::of_file(file);
    let tol = tolerance.unwrap_or_else(|| Tolerance::for_class(class));
    let rec = record_activations(file, dump, threads)?;
    let mut entries = Vec::new();
    let sentence = dump
        .sentence_embedding
        .as_ref()
        .map(|v| (SENTENCE_EMBEDDING.to_string(), [1, v.len()], v.clone()));
    for (name, shape, got) in &rec.records {
        let Some((_, rshape, reference)) = dump
            .activations
            .iter()
            .chain(&sentence)
            .find(|(n, _, _)| n == name)
        else {
            continue;
        };
        if shape != rshape {
            return Err(VerifyError::BadDump {
                path: dump.path.clone(),
                reason: format!(
                    "`{name}` is {rshape:?} in the dump but the model produces {shape:?}"
                ),
            });
        }
        entries.push(compare(name, *shape, got, reference, &tol));
    }
    let compared: Vec<&str> = entries.iter().map(|e| e.name.as_str()).collect();
    let mut not_compared: Vec<String> = dump
        .activations
        .iter()
        .map(|(n, _, _)| n.clone())
        .filter(|n| !compared.contains(&n.as_str()))
        .chain(dump.other.iter().cloned())
        .collect();
    not_compared.sort();
    if entries.is_empty() {
        return Err(VerifyError::BadDump {
            path: dump.path.clone(),
            reason: "no tensor in the dump names an activation the model produces".into(),
        });
    }
    let first_failure = entries.iter().find(|e| !e.pass).map(|e| e.name.clone());
    Ok(LayersReport {
        model: file.label().to_string(),
        reference: dump.path.clone(),
        weight_class: class,
        tolerance: tol,
        tokens: dump.input_ids.len(),
        pass: first_failure.is_none(),
        first_failure,
        entries,
        not_compared,
    })
}

/// Run the model over the dump's prompt, recording the activations the dump names, and for
/// an embedding model whose dump holds one, its final vector.
fn record_activations(file: &KilnFile, dump: &Dump, threads: usize) -> Result<Recorder> {
    let model = Model::load(file)?;
    let encoder = model.config.is_encoder();
    let mut session = model.session(dump.input_ids.len(), threads)?;
    let mut rec = Recorder {
        only: dump.activations.iter().map(|(n, _, _)| n.clone()).collect(),
        records: Vec::new(),
    };
    // An embedding model's output is its token states (and then one vector), not logits.
    let which = if encoder { Logits::States } else { Logits::All };
    session.forward(&dump.input_ids, which, Some(&mut rec))?;
    if let (true, Some(want)) = (encoder, &dump.sentence_embedding) {
        let opts = EmbedOptions {
            truncate: Some(dump.input_ids.len()),
            ..EmbedOptions::default()
        };
        let mut embedder = Embedder::new(&model, file.label(), threads, &opts)?;
        let got = embedder
            .embed_ids(std::slice::from_ref(&dump.input_ids), &mut |_| {})?
            .remove(0);
        if want.len() != got.len() {
            return Err(VerifyError::BadDump {
                path: dump.path.clone(),
                reason: format!(
                    "`{SENTENCE_EMBEDDING}` has {} values but the model's vectors have {}",
                    want.len(),
                    got.len()
                ),
            });
        }
        rec.records
            .push((SENTENCE_EMBEDDING.into(), [1, got.len()], got));
    }
    Ok(rec)
}

/// One activation's figures against the reference, and whether they are within `tol` (the
/// logits' top-1 agreement too).
fn compare(
    name: &str,
    shape: [usize; 2],
    got: &[f32],
    reference: &[f32],
    tol: &Tolerance,
) -> Entry {
    let m = Metrics::compare(got, reference);
    let top1 = (name == "logits").then(|| {
        let w = shape[1];
        let same = got
            .chunks_exact(w)
            .zip(reference.chunks_exact(w))
            .filter(|(g, r)| argmax(g) == argmax(r))
            .count();
        same as f64 / shape[0] as f64
    });
    let pass = m.nmse <= tol.max_nmse && top1.is_none_or(|t| t >= tol.min_top1);
    Entry {
        name: name.to_string(),
        shape,
        max_abs: m.max_abs,
        rms: m.rms,
        rel: m.rel,
        cosine: m.cosine,
        nmse: m.nmse,
        top1,
        pass,
    }
}

/// The human-readable table.
pub fn render(r: &LayersReport) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{} vs {} ({} tokens; {:?} weights: NMSE ≤ {:e}, top-1 ≥ {})",
        r.model, r.reference, r.tokens, r.weight_class, r.tolerance.max_nmse, r.tolerance.min_top1
    );
    let w = r.entries.iter().map(|e| e.name.len()).max().unwrap_or(10);
    let _ = writeln!(
        s,
        "  {:<w$}  {:>10}  {:>10}  {:>10}  {:>12}  {:>10}  result",
        "activation", "max_abs", "rms", "rel", "cosine", "nmse"
    );
    for e in &r.entries {
        let mark = if Some(&e.name) == r.first_failure.as_ref() {
            "FAIL  <- first out of tolerance"
        } else if e.pass {
            "ok"
        } else {
            "FAIL"
        };
        let top = e
            .top1
            .map(|t| format!("  top-1 {:.1}%", t * 100.0))
            .unwrap_or_default();
        let _ = writeln!(
            s,
            "  {:<w$}  {:>10.3e}  {:>10.3e}  {:>10.3e}  {:>12.9}  {:>10.3e}  {mark}{top}",
            e.name, e.max_abs, e.rms, e.rel, e.cosine, e.nmse
        );
    }
    if !r.not_compared.is_empty() {
        let _ = writeln!(s, "not compared: {}", r.not_compared.join(", "));
    }
    let _ = writeln!(
        s,
        "{}",
        match &r.first_failure {
            None => format!("PASS: {} activations within tolerance", r.entries.len()),
            Some(f) => format!(
                "FAIL: {} of {} activations out of tolerance; first: {f}",
                r.entries.iter().filter(|e| !e.pass).count(),
                r.entries.len()
            ),
        }
    );
    s
}
