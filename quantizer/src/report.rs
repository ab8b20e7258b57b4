//! What a run did: one [`TensorReport`] per tensor and the totals in [`Report`], printable as a
//! table ([`Report::table`]) or serialized as JSON (`serde`); and how a run reports as it goes,
//! the [`Progress`] callbacks.

use std::fmt::Write;

use kiln_format::{DType, TensorInfo};
use kiln_kernels::ErrorStats;
use serde::Serialize;

use crate::error::{QuantizeError, Result};
use crate::options::{QuantizeOptions, TOOL};
use crate::policy::{Action, Decision};

/// Progress callbacks; every method has an empty default. Called from worker threads.
pub trait Progress: Sync {
    /// A phase starts (`"quantizing"`, `"finishing"`) with `total` units (values for
    /// quantizing, 0 when not measurable).
    fn phase(&self, _name: &str, _total: u64) {}
    /// `n` more units of the current phase are done.
    fn advance(&self, _n: u64) {}
    /// A tensor is finished.
    fn tensor_done(&self, _tensor: &TensorReport) {}
    /// Something the user should know, between phases (what calibration measured, the types
    /// a budget bought).
    fn notice(&self, _text: &str) {}
    /// Whether the caller wants the run stopped (a Python callback raised, Ctrl-C in Python):
    /// asked between chunks, calibration windows and measured tensors, after each
    /// [`Progress::advance`]; the run then fails with [`QuantizeError::Stopped`] and, like any
    /// failed run, leaves no output. The command line never asks: its signal handler exits.
    fn stop_requested(&self) -> bool {
        false
    }
}

/// `n` more units done, then [`QuantizeError::Stopped`] if the caller asked to stop.
pub(crate) fn advance(progress: &dyn Progress, n: u64) -> Result<()> {
    progress.advance(n);
    if progress.stop_requested() {
        return Err(QuantizeError::Stopped);
    }
    Ok(())
}

/// A [`Progress`] that ignores everything.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoProgress;

impl Progress for NoProgress {}

/// Bits of storage per weight over a set of tensors.
pub fn bits_per_weight(bytes: u64, elements: u64) -> f64 {
    if elements == 0 {
        0.0
    } else {
        bytes as f64 * 8.0 / elements as f64
    }
}

/// One tensor's conversion and its error against the source.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TensorReport {
    /// Canonical name.
    pub name: String,
    /// Shape (outermost first).
    pub shape: Vec<u64>,
    /// Elements.
    pub elements: u64,
    /// Dtype of the input's values (`q4_0` for a `q4_0x16` input: [`DType::logical`]).
    #[serde(serialize_with = "dtype_name")]
    pub from: DType,
    /// Dtype of the output's values.
    #[serde(serialize_with = "dtype_name")]
    pub to: DType,
    /// How the output file stores them: `to`, or `q4_0x16` for a Q4_0 matrix stored sixteen
    /// rows interleaved (the same values; what `kiln-convert inspect` lists).
    #[serde(serialize_with = "dtype_name")]
    pub stored_as: DType,
    /// The policy rule that decided.
    pub rule: String,
    /// F16 fallback or other remark.
    pub note: Option<String>,
    /// Whether the bytes were copied unchanged (no statistics then).
    pub copied: bool,
    /// Bytes in the input.
    pub bytes_in: u64,
    /// Bytes in the output.
    pub bytes_out: u64,
    /// Root mean squared error, `sqrt(Σ(x − x̂)² / n)`.
    pub rmse: f64,
    /// Largest `|x − x̂|`.
    pub max_abs_error: f32,
    /// `10·log10(Σx² / Σ(x − x̂)²)`; `null` when the conversion is exact.
    pub snr_db: Option<f64>,
}

fn dtype_name<S: serde::Serializer>(d: &DType, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(d.name())
}

impl TensorReport {
    pub(crate) fn new(info: &TensorInfo, decision: &Decision, stats: ErrorStats) -> Self {
        let bytes_out = decision.storage.byte_len(&info.shape).unwrap_or(0);
        TensorReport {
            name: info.name.clone(),
            shape: info.shape.clone(),
            elements: info.numel(),
            from: info.dtype.logical(),
            to: decision.dtype,
            stored_as: decision.storage,
            rule: decision.rule.clone(),
            note: decision.note.clone(),
            copied: decision.action == Action::Copy,
            bytes_in: info.len,
            bytes_out,
            rmse: stats.rmse(),
            max_abs_error: stats.max_abs_error,
            snr_db: stats.snr_db(),
        }
    }
}

/// The whole run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Report {
    /// Tool and version.
    pub tool: String,
    /// Input path.
    pub input: String,
    /// Output path.
    pub output: String,
    /// sha256 of the input file (as recorded in provenance).
    pub input_sha256: String,
    /// `--to`: a dtype name, or a mix (`q4_k_m`).
    pub to: String,
    /// `--method`.
    pub method: String,
    /// `--keep` flags.
    pub overrides: Vec<String>,
    /// Worker threads used.
    pub threads: usize,
    /// Input file size in bytes.
    pub file_bytes_in: u64,
    /// Output file size in bytes.
    pub file_bytes_out: u64,
    /// Elements over all tensors.
    pub elements: u64,
    /// Tensor-data bits per weight of the input, over all tensors.
    pub bits_per_weight_in: f64,
    /// Tensor-data bits per weight of the output, over all tensors.
    pub bits_per_weight_out: f64,
    /// Seconds spent hashing the whole input file for provenance, on one thread alongside the
    /// conversion (which checks each tensor's checksum as it reads it).
    pub hash_seconds: f64,
    /// Seconds spent finishing the output: index, header, fsync, rename (part of `seconds`).
    pub finish_seconds: f64,
    /// Wall-clock seconds of the whole run.
    pub seconds: f64,
    /// Every tensor, in file order.
    pub tensors: Vec<TensorReport>,
}

impl Report {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        options: &QuantizeOptions,
        file_bytes_in: u64,
        file_bytes_out: u64,
        input_sha256: String,
        tensors: Vec<TensorReport>,
        [hash_seconds, finish_seconds, seconds]: [f64; 3],
        threads: usize,
    ) -> Self {
        let elements = tensors.iter().map(|t| t.elements).sum();
        let bytes_in = tensors.iter().map(|t| t.bytes_in).sum();
        let bytes_out = tensors.iter().map(|t| t.bytes_out).sum();
        Report {
            tool: TOOL.to_string(),
            input: options.input.display().to_string(),
            output: options.output.display().to_string(),
            input_sha256,
            to: options.policy.target_name().to_string(),
            method: options.method.name().to_string(),
            overrides: options
                .policy
                .overrides
                .iter()
                .map(ToString::to_string)
                .collect(),
            threads,
            file_bytes_in,
            file_bytes_out,
            elements,
            bits_per_weight_in: bits_per_weight(bytes_in, elements),
            bits_per_weight_out: bits_per_weight(bytes_out, elements),
            hash_seconds,
            finish_seconds,
            seconds,
            tensors,
        }
    }

    /// The per-tensor table followed by the totals, for a terminal.
    pub fn table(&self) -> String {
        let mut s = String::new();
        let w = self
            .tensors
            .iter()
            .map(|t| t.name.len())
            .max()
            .unwrap_or(6)
            .max(6);
        let _ = writeln!(
            s,
            "{:<w$}  {:<13} {:>5} -> {:<5} {:>10} {:>10} {:>7}  note",
            "tensor", "shape", "from", "to", "RMSE", "max|err|", "SNR dB"
        );
        for t in &self.tensors {
            let shape = t
                .shape
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join("x");
            let snr = match t.snr_db {
                Some(v) => format!("{v:7.2}"),
                None => format!("{:>7}", "exact"),
            };
            let note = match (&t.note, t.copied) {
                (Some(n), _) => n.clone(),
                (None, true) => "copied".to_string(),
                (None, false) if t.rule.starts_with("override") || t.rule.starts_with("auto") => {
                    t.rule.clone()
                }
                _ => String::new(),
            };
            let _ = writeln!(
                s,
                "{:<w$}  {:<13} {:>5} -> {:<5} {:>10.3e} {:>10.3e} {snr}  {note}",
                t.name, shape, t.from, t.to, t.rmse, t.max_abs_error
            );
        }
        let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
        let _ = writeln!(
            s,
            "\n{} tensors, {} weights; file {:.1} MiB -> {:.1} MiB ({:.1}%); {:.2} -> {:.2} bits \
             per weight; {} method, {} threads, {:.2} s ({:.2} s hashing the input file alongside, \
             {:.2} s finishing and syncing the output)",
            self.tensors.len(),
            self.elements,
            mib(self.file_bytes_in),
            mib(self.file_bytes_out),
            100.0 * self.file_bytes_out as f64 / self.file_bytes_in.max(1) as f64,
            self.bits_per_weight_in,
            self.bits_per_weight_out,
            self.method,
            self.threads,
            self.seconds,
            self.hash_seconds,
            self.finish_seconds,
        );
        s
    }
}
