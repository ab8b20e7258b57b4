//! What one matrix's rounding costs in the logits: the KL-divergence from the model's own
//! next-token distributions when that matrix alone is quantized, measured on a short stretch of
//! the calibration text.
//!
//! Why: `--to auto` compares errors across matrices, and each matrix's output error
//! ([`crate::budget`]) is in its own output's units: noise in a late `mlp.down` and noise in the
//! logits are not worth the same. Quantizing one matrix and running the model tells what its
//! error is worth, in the one unit that is the same for every matrix (KL-divergence of the
//! output), and the ratio of that to its output error converts all of its candidates'.
//!
//! The model is not rebuilt per matrix. The forward pass offers each matrix's product to an
//! [`Observer`] ([`Observer::edit`]) before using it; adding `x·Eᵀ`, with `x` the matrix's input
//! (recorded a moment earlier at its input site) and `E = Ŵ − W` its rounding error, is exactly
//! the forward pass with the quantized matrix. An embedding's error is added to the rows its
//! tokens looked up (times the family's embedding scale); a tied embedding's to the logits too.

use std::collections::BTreeMap;

use kiln_format::{KilnFile, Role, TensorName};
use kiln_runner::{Activation, Logits, Model, Observer, Session};
use ndarray::linalg::general_mat_mul;
use ndarray::{ArrayView2, ArrayViewMut2};
use rayon::prelude::*;

use crate::calibrate::matrix_sites;
use crate::error::{QuantizeError, Result};
use crate::importance::PROBE_TOKENS;

/// Where a matrix's rounding enters the forward pass.
#[derive(Debug, Clone)]
struct Sites {
    /// The activation the matrix multiplies (recorded), if its error is a product.
    input: Option<String>,
    /// Where its product lands (edited): `x·Eᵀ` is added there.
    outputs: Vec<String>,
    /// The embedding rows the tokens looked up (edited): `scale·E[token]` is added there.
    lookup: Option<String>,
}

/// Runs the model with one matrix's error added and measures the KL-divergence of its
/// next-token distributions from the unchanged model's.
pub struct Probe<'m> {
    session: Session<'m>,
    tokens: Vec<u32>,
    /// The unchanged model's log-probabilities, `(T, vocab)`.
    base: Vec<f32>,
    vocab: usize,
    embed_scale: f32,
    sites: BTreeMap<String, Sites>,
}

impl std::fmt::Debug for Probe<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Probe")
            .field("tokens", &self.tokens.len())
            .field("vocab", &self.vocab)
            .finish_non_exhaustive()
    }
}

impl<'m> Probe<'m> {
    /// A probe of `model` (the file `file`) over `tokens`, or `None` when the model has no
    /// logits to compare (an encoder) or there are no tokens.
    pub fn new(
        file: &KilnFile,
        model: &'m Model<'m>,
        tokens: &[u32],
        threads: usize,
    ) -> Result<Option<Probe<'m>>> {
        let c = &model.config;
        if tokens.is_empty() || c.is_encoder() {
            return Ok(None);
        }
        let err = |reason: String| QuantizeError::Calibration {
            file: file.label().to_string(),
            reason,
        };
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= c.vocab) {
            return Err(err(format!(
                "the importance's probe token {t} is outside this model's vocabulary of {}; \
                 was it measured on another model?",
                c.vocab
            )));
        }
        let tokens = tokens[..tokens.len().min(PROBE_TOKENS)].to_vec();
        let mut session = model
            .session(tokens.len().max(1), threads)
            .map_err(|e| err(e.to_string()))?;
        let logits = session
            .forward(&tokens, Logits::All, None)
            .map_err(|e| err(e.to_string()))?;
        let mut base = logits.to_vec();
        base.par_chunks_mut(c.vocab).for_each(log_softmax);
        Ok(Some(Probe {
            session,
            tokens,
            base,
            vocab: c.vocab,
            embed_scale: c.embed_scale.unwrap_or(1.0),
            sites: sites(file),
        }))
    }

    /// How many tokens the probe runs.
    pub fn tokens(&self) -> usize {
        self.tokens.len()
    }

    /// Whether the probe knows where `matrix`'s error enters the forward pass.
    pub fn covers(&self, matrix: &str) -> bool {
        self.sites.contains_key(matrix)
    }

    /// Mean KL-divergence per token, from the unchanged model's next-token distribution to the
    /// one with `delta` (`Ŵ − W`, rows of `cols`) added to `matrix`'s weights.
    pub fn kl(&mut self, matrix: &str, delta: &[f32], cols: usize) -> Result<f64> {
        let sites = self
            .sites
            .get(matrix)
            .cloned()
            .ok_or_else(|| QuantizeError::Calibration {
                file: matrix.to_string(),
                reason: "no site of the forward pass takes this matrix".into(),
            })?;
        let mut edit = Edit {
            sites,
            tokens: &self.tokens,
            delta,
            cols,
            embed_scale: self.embed_scale,
            input: Vec::new(),
        };
        self.session.reset();
        let logits = self
            .session
            .forward(&self.tokens, Logits::All, Some(&mut edit))
            .map_err(|e| QuantizeError::Calibration {
                file: matrix.to_string(),
                reason: e.to_string(),
            })?;
        let sum: f64 = logits
            .par_chunks(self.vocab)
            .zip(self.base.par_chunks(self.vocab))
            .map(|(q, p)| {
                let mut q = q.to_vec();
                log_softmax(&mut q);
                p.iter()
                    .zip(&q)
                    .map(|(&lp, &lq)| f64::from(lp).exp() * f64::from(lp - lq))
                    .sum::<f64>()
            })
            .sum();
        Ok((sum / self.tokens.len() as f64).max(0.0))
    }
}

/// `v ← log_softmax(v)`, in f64 sums.
fn log_softmax(v: &mut [f32]) {
    let max = v.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = v.iter().map(|&x| f64::from(x - max).exp()).sum();
    let log_sum = max + sum.ln() as f32;
    v.iter_mut().for_each(|x| *x -= log_sum);
}

/// Where each quantizable matrix of `file` enters the forward pass.
fn sites(file: &KilnFile) -> BTreeMap<String, Sites> {
    let arch = file.metadata().config.architecture;
    let inputs = matrix_sites(file);
    let names: Vec<&str> = file.tensors().iter().map(|t| t.name.as_str()).collect();
    let tied = !names.contains(&Role::LmHead.suffix());
    let mut out = BTreeMap::new();
    for name in names {
        let Some(t) = TensorName::parse(name) else {
            continue;
        };
        let l = t.layer.unwrap_or(0) as usize;
        let output = match t.role {
            Role::AttnQ => Activation::Q(l),
            Role::AttnK => Activation::K(l),
            Role::AttnV => Activation::V(l),
            Role::AttnO => Activation::O(l),
            Role::MlpGate => Activation::Gate(l),
            Role::MlpUp => Activation::Up(l),
            Role::MlpDown => Activation::Mlp(l),
            Role::LmHead => Activation::Logits,
            Role::Embed => {
                let mut outputs = Vec::new();
                if tied {
                    outputs.push(Activation::Logits.name(arch));
                }
                out.insert(
                    name.to_string(),
                    Sites {
                        input: inputs.get(name).cloned(),
                        outputs,
                        lookup: Some(Activation::Embed.name(arch)),
                    },
                );
                continue;
            }
            _ => continue,
        };
        let Some(input) = inputs.get(name) else {
            continue;
        };
        out.insert(
            name.to_string(),
            Sites {
                input: Some(input.clone()),
                outputs: vec![output.name(arch)],
                lookup: None,
            },
        );
    }
    out
}

/// The observer that adds one matrix's error to the forward pass.
struct Edit<'a> {
    sites: Sites,
    tokens: &'a [u32],
    delta: &'a [f32],
    cols: usize,
    embed_scale: f32,
    /// The matrix's input, `(T, cols)`, recorded at its input site.
    input: Vec<f32>,
}

impl Observer for Edit<'_> {
    fn wants(&self, name: &str) -> bool {
        self.sites.input.as_deref() == Some(name)
            || self.sites.lookup.as_deref() == Some(name)
            || self.sites.outputs.iter().any(|o| o == name)
    }

    fn record(&mut self, name: &str, data: &[f32], shape: [usize; 2]) {
        if self.sites.input.as_deref() == Some(name) && shape[1] == self.cols {
            self.input.clear();
            self.input.extend_from_slice(&data[..shape[0] * shape[1]]);
        }
    }

    fn edit(&mut self, name: &str, data: &mut [f32], shape: [usize; 2]) {
        let [rows, width] = shape;
        if self.sites.lookup.as_deref() == Some(name) && width == self.cols {
            for (row, &t) in data.chunks_exact_mut(width).zip(self.tokens) {
                let e = &self.delta[t as usize * width..(t as usize + 1) * width];
                row.iter_mut()
                    .zip(e)
                    .for_each(|(v, &d)| *v += self.embed_scale * d);
            }
        }
        let out_rows = self.delta.len() / self.cols.max(1);
        if self.sites.outputs.iter().any(|o| o == name)
            && width == out_rows
            && self.input.len() == rows * self.cols
        {
            // data (T × out_rows) += input (T × cols) · deltaᵀ (cols × out_rows)
            let x = ArrayView2::from_shape((rows, self.cols), &self.input).expect("input shape");
            let e = ArrayView2::from_shape((out_rows, self.cols), self.delta).expect("delta shape");
            let mut y =
                ArrayViewMut2::from_shape((rows, width), &mut data[..rows * width]).expect("shape");
            general_mat_mul(1.0, &x, &e.t(), 1.0, &mut y);
        }
    }
}
