//! Measuring one matrix for [`super::plan`]: the matrix quantized to every candidate type its
//! rows fit, each scored by the output error it causes, converted to KL-divergence by the
//! probe.

use std::collections::BTreeMap;
use std::fs::File;
use std::sync::Arc;

use kiln_format::io::read_exact_at;
use kiln_format::values::decode_rows_f32;
use kiln_format::{DType, TensorInfo};
use kiln_kernels::ErrorStats;
use rayon::prelude::*;

use super::{Candidate, CANDIDATES, PROBE_BITS};
use crate::error::{QuantizeError, Result};
use crate::factor::{self, Factor};
use crate::gptq;
use crate::importance::Importance;
use crate::method::Method;
use crate::pipeline::decode_values;
use crate::rows::convert_rows;
use crate::sensitivity::Probe;

/// What measuring the matrices reads, and what it keeps from one matrix to the next.
pub(super) struct Measure<'a, 'm> {
    /// The input file, and its name for messages.
    pub file: &'a File,
    pub label: &'a str,
    pub method: Method,
    pub importance: &'a Importance,
    /// Each input site's factorised second moment, made once for all its matrices.
    pub factors: BTreeMap<String, Arc<Factor>>,
    pub probe: Option<Probe<'m>>,
}

/// A rounding's decoded values and its output error.
type Rounding = (Vec<f32>, f64);

/// One matrix's values and what its roundings are made and weighed with.
struct Matrix<'a> {
    t: &'a TensorInfo,
    /// Its values, `rows × cols`.
    w: Vec<f32>,
    cols: usize,
    columns: Option<&'a [f32]>,
    factor: Option<Arc<Factor>>,
    weight: Weight<'a>,
}

impl<'a> Measure<'a, '_> {
    /// Tensor `t`'s candidates, their errors in KL-divergence where the probe covers it, and
    /// that conversion's gain.
    pub(super) fn candidates(&mut self, t: &TensorInfo) -> Result<(Vec<Candidate>, Option<f64>)> {
        let m = self.matrix(t)?;
        let (mut candidates, probed) = m.score(self.method);
        // Convert the output errors to KL-divergence: what the probe's rounding costs in the
        // logits, per unit of its output error.
        let gain = match (self.probe.as_mut(), probed) {
            (Some(p), Some((mut deq, error))) if p.covers(&t.name) => {
                deq.iter_mut().zip(&m.w).for_each(|(d, &x)| *d -= x);
                let kl = p.kl(&t.name, &deq, m.cols)?;
                let gain = if error > 0.0 { kl / error } else { 0.0 };
                for c in &mut candidates {
                    c.error *= gain;
                }
                Some(gain)
            }
            _ => None,
        };
        Ok((candidates, gain))
    }

    /// Read and decode tensor `t`, with its importance.
    fn matrix<'t>(&mut self, t: &'t TensorInfo) -> Result<Matrix<'t>>
    where
        'a: 't,
    {
        let cols = t.shape.last().copied().unwrap_or(1) as usize;
        let numel = t.numel() as usize;
        let mut bytes = vec![0u8; numel * t.dtype.block_bytes()];
        read_exact_at(self.file, &mut bytes, t.offset).map_err(|e| QuantizeError::Io {
            file: self.label.to_string(),
            action: "cannot read",
            source: e,
        })?;
        let w = decode_values(t.dtype, &bytes, numel);
        drop(bytes);
        let importance = self.importance;
        let moment = importance
            .moment(&t.name)
            .filter(|m| m.len() == cols * cols && self.method == Method::Gptq);
        let factor = match (moment, importance.sites.get(&t.name)) {
            (Some(m), Some(site)) => Some(
                self.factors
                    .entry(site.clone())
                    .or_insert_with(|| Arc::new(factor::factor(m, cols)))
                    .clone(),
            ),
            _ => None,
        };
        let columns = importance
            .columns
            .get(&t.name)
            .filter(|c| c.len() == cols)
            .map(Vec::as_slice);
        let weight = match (importance.moment(&t.name), columns) {
            (Some(m), _) if m.len() == cols * cols => Weight::Full(m),
            (_, Some(c)) => Weight::Diagonal(c),
            _ => Weight::Plain,
        };
        Ok(Matrix {
            t,
            w,
            cols,
            columns,
            factor,
            weight,
        })
    }
}

impl Matrix<'_> {
    /// Every candidate type the rows fit with its size and output error (0 for a matrix
    /// holding values that are not finite), and the rounding the probe runs: the first
    /// candidate of at least [`PROBE_BITS`], with its error.
    fn score(&self, method: Method) -> (Vec<Candidate>, Option<Rounding>) {
        let (t, w, cols) = (self.t, &self.w, self.cols);
        let finite = w.iter().all(|v| v.is_finite());
        let mut candidates = Vec::new();
        let mut probed: Option<Rounding> = None;
        for dtype in CANDIDATES {
            if !(cols as u64).is_multiple_of(dtype.block_len() as u64) {
                continue;
            }
            let Ok(bytes) = dtype.byte_len(&t.shape) else {
                continue;
            };
            let error = if finite {
                let deq = quantized(w, cols, dtype, method, self.columns, self.factor.as_deref());
                let error = deq
                    .as_ref()
                    .map_or(f64::INFINITY, |deq| self.weight.output_error(w, deq, cols));
                if let Some(deq) = deq {
                    if probed.is_none() && bytes as f64 * 8.0 >= PROBE_BITS * t.numel() as f64 {
                        probed = Some((deq, error));
                    }
                }
                error
            } else {
                0.0
            };
            candidates.push(Candidate {
                dtype,
                bytes,
                error,
            });
        }
        (candidates, probed)
    }
}

/// What a matrix's error is weighed by.
pub(super) enum Weight<'a> {
    /// The input's second moment, `cols × cols`.
    Full(&'a [f32]),
    /// The mean square of each input column.
    Diagonal(&'a [f32]),
    /// Nothing measured: every weight counts the same.
    Plain,
}

impl Weight<'_> {
    /// `Σ_r e_rᵀ·H·e_r` with `e = w − ŵ`; without `H`, the mean over rows of `‖e_r‖²`.
    pub(super) fn output_error(&self, w: &[f32], deq: &[f32], cols: usize) -> f64 {
        let sum: f64 = w
            .par_chunks(cols)
            .zip(deq.par_chunks(cols))
            .map(|(w, q)| {
                let e: Vec<f32> = w.iter().zip(q).map(|(a, b)| a - b).collect();
                self.quadratic(&e)
            })
            .sum();
        match self {
            Weight::Plain => sum / (w.len() / cols).max(1) as f64,
            _ => sum,
        }
    }

    /// `vᵀ·H·v`.
    fn quadratic(&self, v: &[f32]) -> f64 {
        match self {
            Weight::Full(h) => v
                .iter()
                .zip(h.chunks_exact(v.len()))
                .filter(|(&x, _)| x != 0.0)
                .map(|(&x, row)| f64::from(x) * f64::from(dot(row, v)))
                .sum(),
            Weight::Diagonal(d) => v
                .iter()
                .zip(*d)
                .map(|(&x, &h)| f64::from(h) * f64::from(x) * f64::from(x))
                .sum(),
            Weight::Plain => v.iter().map(|&x| f64::from(x) * f64::from(x)).sum(),
        }
    }
}

/// Dot product with sixteen independent accumulators (so it vectorizes).
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 16];
    let (ac, bc) = (a.chunks_exact(16), b.chunks_exact(16));
    let (ar, br) = (ac.remainder(), bc.remainder());
    for (x, y) in ac.zip(bc) {
        for i in 0..16 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (x, y) in ar.iter().zip(br) {
        s += x * y;
    }
    s
}

/// The values a reader will decode from `w` quantized to `dtype` as the pipeline writes it
/// (compensated rounding where there is a factor and the type supports it); `None` if a block
/// cannot be made (a scale beyond f16).
fn quantized(
    w: &[f32],
    cols: usize,
    dtype: DType,
    method: Method,
    columns: Option<&[f32]>,
    factor: Option<&Factor>,
) -> Option<Vec<f32>> {
    if let Some(f) = factor.filter(|_| gptq::supports(dtype)) {
        let mut out = Vec::new();
        return Some(gptq::quantize_matrix(w, cols, dtype, f, &mut out));
    }
    let mut out = Vec::new();
    let mut stats = ErrorStats::default();
    convert_rows(w, cols, dtype, method, columns, &mut out, &mut stats).ok()?;
    let mut deq = vec![0.0f32; w.len()];
    decode_rows_f32(dtype, cols, &out, &mut deq);
    Some(deq)
}
