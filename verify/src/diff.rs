//! `kiln-verify diff`: tensor-by-tensor error between two files of the same model, e.g. a
//! BF16 conversion and its Q4_0 quantization.

use kiln_format::{KilnFile, TensorInfo};
use rayon::prelude::*;
use serde::Serialize;

use crate::error::{Result, VerifyError};
use crate::metrics::Metrics;

/// One tensor's comparison.
#[derive(Debug, Clone, Serialize)]
pub struct DiffRow {
    pub name: String,
    pub shape: Vec<u64>,
    pub dtype_a: String,
    pub dtype_b: String,
    /// Root mean square of the difference.
    pub rmse: f64,
    pub max_abs: f64,
    /// 10·log10(Σa² / Σ(a−b)²); infinite for identical tensors.
    pub snr_db: f64,
    pub cosine: f64,
}

/// The whole comparison.
#[derive(Debug, Clone, Serialize)]
pub struct DiffReport {
    pub a: String,
    pub b: String,
    pub rows: Vec<DiffRow>,
    /// Tensors only in A or only in B.
    pub only_in_a: Vec<String>,
    pub only_in_b: Vec<String>,
    pub identical: usize,
    /// Tensors whose data does not match their stored sha256, in either file: their rows
    /// compare the bytes as read, and the report fails.
    pub checksum_failures: Vec<DiffChecksumFailure>,
}

/// A tensor whose data fails its checksum.
#[derive(Debug, Clone, Serialize)]
pub struct DiffChecksumFailure {
    pub file: String,
    pub tensor: String,
    pub stored: String,
    pub computed: String,
}

/// Compare every tensor the two files share (by name), in parallel, from the data as read:
/// stored checksums are verified, never trusted as a stand-in for the bytes (a file with one
/// flipped byte and an unchanged index is not "identical" to its source).
pub fn diff(a: &KilnFile, b: &KilnFile) -> Result<DiffReport> {
    let checksum_failures = checksum_failures(a, b);
    let only_in_a: Vec<String> = a
        .tensors()
        .iter()
        .filter(|t| b.info(&t.name).is_none())
        .map(|t| t.name.clone())
        .collect();
    let only_in_b: Vec<String> = b
        .tensors()
        .iter()
        .filter(|t| a.info(&t.name).is_none())
        .map(|t| t.name.clone())
        .collect();
    let shared: Vec<_> = a
        .tensors()
        .iter()
        .filter_map(|t| b.info(&t.name).map(|u| (t, u)))
        .collect();
    if shared.is_empty() {
        return Err(VerifyError::Incompatible {
            a: a.label().into(),
            b: b.label().into(),
            reason: "they share no tensor names".into(),
        });
    }
    if let Some((t, u)) = shared.iter().find(|(t, u)| t.shape != u.shape) {
        return Err(VerifyError::Incompatible {
            a: a.label().into(),
            b: b.label().into(),
            reason: format!(
                "tensor `{}` is {:?} in one and {:?} in the other",
                t.name, t.shape, u.shape
            ),
        });
    }
    let rows: Vec<DiffRow> = shared
        .par_iter()
        .map(|(t, u)| diff_row(a, t, b, u))
        .collect();
    let identical = rows.iter().filter(|r| r.max_abs == 0.0).count();
    Ok(DiffReport {
        a: a.label().into(),
        b: b.label().into(),
        rows,
        only_in_a,
        only_in_b,
        identical,
        checksum_failures,
    })
}

/// Every tensor checksum of either file that does not match its data.
fn checksum_failures(a: &KilnFile, b: &KilnFile) -> Vec<DiffChecksumFailure> {
    [a, b]
        .iter()
        .flat_map(|f| {
            f.verify_checksums(&|_| {})
                .into_iter()
                .map(|x| DiffChecksumFailure {
                    file: f.label().to_string(),
                    tensor: x.tensor,
                    stored: x.stored,
                    computed: x.computed,
                })
        })
        .collect()
}

/// The error of tensor `u` of `b` against the same tensor `t` of `a` (none, without decoding,
/// when the two are byte-identical).
fn diff_row(a: &KilnFile, t: &TensorInfo, b: &KilnFile, u: &TensorInfo) -> DiffRow {
    let (x, y) = if t.dtype == u.dtype && a.view(t).bytes() == b.view(u).bytes() {
        (Vec::new(), Vec::new())
    } else {
        (a.view(t).to_f32_vec(), b.view(u).to_f32_vec())
    };
    let m = Metrics::compare(&y, &x);
    let signal: f64 = x.iter().map(|&v| (v as f64) * (v as f64)).sum();
    let noise = m.nmse * signal;
    DiffRow {
        name: t.name.clone(),
        shape: t.shape.clone(),
        dtype_a: t.dtype.to_string(),
        dtype_b: u.dtype.to_string(),
        rmse: m.rms,
        max_abs: m.max_abs,
        snr_db: if noise == 0.0 {
            f64::INFINITY
        } else {
            10.0 * (signal / noise).log10()
        },
        cosine: m.cosine,
    }
}

/// The human-readable table.
pub fn render(r: &DiffReport) -> String {
    use std::fmt::Write;
    let mut s = format!(
        "{} vs {}: {} shared tensors, {} identical\n",
        r.a,
        r.b,
        r.rows.len(),
        r.identical
    );
    let w = r.rows.iter().map(|x| x.name.len()).max().unwrap_or(4);
    let _ = writeln!(
        s,
        "  {:<w$}  {:>5} -> {:<5}  {:>10}  {:>10}  {:>8}",
        "tensor", "a", "b", "rmse", "max_abs", "snr_db"
    );
    for x in &r.rows {
        let _ = writeln!(
            s,
            "  {:<w$}  {:>5} -> {:<5}  {:>10.3e}  {:>10.3e}  {:>8.2}",
            x.name, x.dtype_a, x.dtype_b, x.rmse, x.max_abs, x.snr_db
        );
    }
    if !r.only_in_a.is_empty() {
        let _ = writeln!(s, "only in {}: {}", r.a, r.only_in_a.join(", "));
    }
    if !r.only_in_b.is_empty() {
        let _ = writeln!(s, "only in {}: {}", r.b, r.only_in_b.join(", "));
    }
    for f in &r.checksum_failures {
        let _ = writeln!(
            s,
            "{}: tensor `{}`: checksum mismatch (stored {}, computed {}); the data is corrupt",
            f.file, f.tensor, f.stored, f.computed
        );
    }
    s
}
