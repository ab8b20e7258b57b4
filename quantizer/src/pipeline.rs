//! The file pipeline: `.kiln` in, smaller `.kiln` out, streamed tensor by tensor.
//!
//! [`quantize_file`] runs in three steps:
//!
//! 1. open and validate the input ([`KilnFile::open`]); decide every tensor
//!    ([`Policy`](crate::Policy));
//! 2. plan the output with [`KilnWriter::create`] (metadata = the input's, plus one
//!    [`ProvenanceStep`] whose input sha256 is a fixed-width placeholder, filled in with
//!    [`KilnWriter::replace_metadata`] from a whole-file hash that runs alongside the
//!    conversion) and convert tensors in parallel, largest first. Each tensor is written as
//!    its decision's storage dtype ([`Decision::storage`]: Q4_0 matrices of whole sixteen-row
//!    groups as `q4_0x16`). A tensor is cut into chunks of whole rows (about
//!    [`CHUNK_ELEMENTS`] values, whole sixteen-row groups for `q4_0x16`, independent of the
//!    thread count);
//!    chunks are converted in waves of [`WAVE_PER_THREAD`] per worker thread and written in
//!    order through the tensor's sink, so memory stays at a few chunks per thread whatever the
//!    model size, while a helper thread flushes the written data to disk. Input
//!    bytes are read with positioned reads (not through the memory map, so they do not stay in
//!    this process's resident set). The bytes each chunk reads are also hashed, in order, into
//!    the tensor's sha256, which must equal the one in the input's index: a corrupt tensor
//!    fails the run instead of being laundered into a new, valid file (and when a corrupt
//!    tensor's garbage trips a value check first, the checksum error is the one reported);
//! 3. finish the writer (atomic rename). On any error the writer is dropped and its temporary
//!    file removed: no partial output is ever left behind.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::Path;
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use kiln_format::io::{read_exact_at, sha256_range};
use kiln_format::metadata::now_rfc3339;
use kiln_format::values::decode_to_f32;
use kiln_format::{
    hex, DType, FormatError, KilnFile, KilnWriter, ProvenanceStep, SourceFile, TensorInfo,
    TensorSpec,
};
use kiln_kernels::ErrorStats;
use rayon::prelude::*;
use sha2::{Digest, Sha256};

use crate::error::{QuantizeError, Result};
use crate::factor::{factor, Factor};
use crate::gptq;
use crate::importance::Importance;
use crate::method::Method;
use crate::options::{QuantizeOptions, TOOL};
use crate::policy::{Action, Decision, POLICY_DESCRIPTION};
use crate::report::{advance, Progress, Report, TensorReport};
use crate::rows::{convert_rows, ValueError};

/// Target number of values per chunk: 64 Ki values = 256 KiB of f32, large enough to amortise
/// the per-chunk work, small enough that a wave per thread stays in the L2/L3 caches.
pub const CHUNK_ELEMENTS: usize = 64 * 1024;

/// Chunks per worker thread in one wave of a tensor. More than one, so that a thread that is
/// slow to finish its chunk (descheduled on a busy machine) does not hold the others at the
/// end of every wave; few, so memory stays at a few chunks per thread.
const WAVE_PER_THREAD: usize = 4;

/// How often the output's written data is flushed while tensors are converted (see
/// [`with_writeback`]).
const WRITEBACK_INTERVAL: std::time::Duration = std::time::Duration::from_millis(30);

/// Quantize `options.input` into `options.output`.
pub fn quantize_file(options: &QuantizeOptions, progress: &dyn Progress) -> Result<Report> {
    match options.threads {
        None => run(options, progress),
        Some(threads) => rayon::ThreadPoolBuilder::new()
            .num_threads(kiln_runner::threads::cap_threads(threads))
            .build()
            .map_err(|e| QuantizeError::ThreadPool {
                threads,
                reason: e.to_string(),
            })?
            .install(|| run(options, progress)),
    }
}

fn run(options: &QuantizeOptions, progress: &dyn Progress) -> Result<Report> {
    let start = Instant::now();
    kiln_format::refuse_output_is_input(&options.output, [options.input.as_path()])?;
    let input = KilnFile::open(&options.input)?;
    let label = input.label().to_string();
    let tensors = input.tensors();
    options.policy.check_overrides(&label, tensors)?;
    let decisions = options.policy.decide_all(&label, tensors)?;
    let no_importance = BTreeMap::new();
    let columns = options
        .importance
        .as_ref()
        .map_or(&no_importance, |i| &i.columns);
    check_importance(&input, &label, columns)?;

    let file = open_input(&options.input, &label)?;
    // The whole-file sha256 for provenance is computed while the tensors are quantized; the
    // metadata holds a placeholder of the same width until then.
    let step = |sha256: &str| provenance_step(options, &options.input, &input, &decisions, sha256);
    let mut metadata = input.metadata().clone();
    metadata.provenance.push(step(&"0".repeat(64)));
    let specs = storage_specs(tensors, &decisions);
    let mut writer = KilnWriter::create(&options.output, &metadata, specs, options.overwrite)?;

    let total: u64 = tensors.iter().map(TensorInfo::numel).sum();
    progress.phase("quantizing", total);
    // Largest first, so the long tensors start early and the small ones fill the gaps.
    let mut order: Vec<usize> = (0..tensors.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(tensors[i].numel()));
    let factors = gptq_sites(options);
    let ctx = Ctx {
        file: &file,
        label: &label,
        writer: &writer,
        method: options.method,
        importance: columns,
        factors: &factors,
        calibration: options.importance.as_ref(),
        progress,
    };
    let quantize_all = || {
        order
            .par_iter()
            .map(|&i| {
                let r = ctx.tensor(i, &tensors[i], &decisions[i])?;
                progress.tensor_done(&r);
                Ok((i, r))
            })
            .collect::<Result<Vec<(usize, TensorReport)>>>()
    };
    let hash_all = || {
        let hash_start = Instant::now();
        let sha = hash_file(&file, &label, input.file_len());
        (sha, hash_start.elapsed().as_secs_f64())
    };
    let (reports, (input_sha256, hash_seconds)) =
        with_writeback(&writer, || rayon::join(quantize_all, hash_all))?;
    let mut reports = reports?;
    let input_sha256 = input_sha256?;
    reports.sort_by_key(|(i, _)| *i);
    metadata.provenance.pop();
    metadata.provenance.push(step(&input_sha256));
    writer.replace_metadata(&metadata)?;

    progress.phase("finishing", 0);
    let finish_start = Instant::now();
    let summary = writer.finish()?;
    let finish_seconds = finish_start.elapsed().as_secs_f64();
    Ok(Report::new(
        options,
        input.file_len(),
        summary.file_len,
        input_sha256,
        reports.into_iter().map(|(_, r)| r).collect(),
        [hash_seconds, finish_seconds, start.elapsed().as_secs_f64()],
        rayon::current_num_threads(),
    ))
}

/// The input file, for the positioned reads of its tensors and its hash.
fn open_input(path: &Path, label: &str) -> Result<File> {
    File::open(path).map_err(|e| QuantizeError::Io {
        file: label.to_string(),
        action: "cannot open",
        source: e,
    })
}

/// The output's tensors: the input's, each in its decision's storage dtype.
fn storage_specs(tensors: &[TensorInfo], decisions: &[Decision]) -> Vec<TensorSpec> {
    tensors
        .iter()
        .zip(decisions)
        .map(|(t, d)| TensorSpec {
            name: t.name.clone(),
            dtype: d.storage,
            shape: t.shape.clone(),
        })
        .collect()
}

/// Check that every tensor with importance weights is in `input`, one weight per column.
fn check_importance(
    input: &KilnFile,
    label: &str,
    columns: &BTreeMap<String, Vec<f32>>,
) -> Result<()> {
    for (name, w) in columns {
        let info = input
            .info(name)
            .ok_or_else(|| FormatError::TensorNotFound {
                file: label.to_string(),
                tensor: name.clone(),
            })?;
        let cols = info.shape.last().copied().unwrap_or(1);
        if w.len() as u64 != cols {
            return Err(QuantizeError::ImportanceLength {
                tensor: name.clone(),
                expected: cols,
                found: w.len() as u64,
            });
        }
    }
    Ok(())
}

/// The matrices whose rounding is compensated ([`Method::Gptq`] with measured second
/// moments), each with a place for its factor, computed when its tensor is reached.
fn gptq_sites(options: &QuantizeOptions) -> BTreeMap<String, OnceLock<Arc<Factor>>> {
    match &options.importance {
        Some(imp) if options.method == Method::Gptq => imp
            .moments
            .keys()
            .map(|k| (k.clone(), OnceLock::new()))
            .collect(),
        _ => BTreeMap::new(),
    }
}

/// Run `work` while a helper thread flushes what has been written to `writer` every
/// [`WRITEBACK_INTERVAL`], so the output's data reaches the disk during the conversion instead
/// of all in [`KilnWriter::finish`]'s final sync. The helper sleeps in I/O, not on a core.
fn with_writeback<T: Send>(writer: &KilnWriter, work: impl FnOnce() -> T + Send) -> Result<T> {
    let (stop, stopped) = std::sync::mpsc::channel::<()>();
    std::thread::scope(|s| {
        let flusher = s.spawn(move || loop {
            match stopped.recv_timeout(WRITEBACK_INTERVAL) {
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => writer.sync_data()?,
                _ => return Ok(()),
            }
        });
        let out = work();
        drop(stop);
        let flushed: Result<()> = flusher
            .join()
            .unwrap_or_else(|p| std::panic::resume_unwind(p));
        flushed.map(|()| out)
    })
}

fn hash_file(file: &File, label: &str, len: u64) -> Result<String> {
    let sha = sha256_range(file, 0, len).map_err(|e| read_err(label, e))?;
    Ok(hex(&sha))
}

fn read_err(label: &str, e: std::io::Error) -> QuantizeError {
    QuantizeError::Io {
        file: label.to_string(),
        action: "cannot read",
        source: e,
    }
}

/// Compare a tensor's computed sha256 with the one in the input's index.
fn check_tensor_sha(label: &str, info: &TensorInfo, computed: [u8; 32]) -> Result<()> {
    if computed != info.sha256 {
        return Err(FormatError::TensorChecksum {
            file: label.to_string(),
            tensor: info.name.clone(),
            stored: hex(&info.sha256),
            computed: hex(&computed),
        }
        .into());
    }
    Ok(())
}

/// Hash one whole tensor from the file and check it against the index (positioned reads).
///
/// Only used when a conversion stops early on a bad value, to tell a corrupt tensor (reported
/// as a checksum mismatch) from a genuine bad value.
fn verify_tensor(file: &File, label: &str, info: &TensorInfo) -> Result<()> {
    let sha = sha256_range(file, info.offset, info.len).map_err(|e| read_err(label, e))?;
    check_tensor_sha(label, info, sha)
}

fn provenance_step(
    options: &QuantizeOptions,
    input_path: &Path,
    input: &KilnFile,
    decisions: &[Decision],
    sha256: &str,
) -> ProvenanceStep {
    let per_tensor: serde_json::Map<String, serde_json::Value> = input
        .tensors()
        .iter()
        .zip(decisions)
        .map(|(t, d)| (t.name.clone(), d.dtype.name().into()))
        .collect();
    let fallbacks: serde_json::Map<String, serde_json::Value> = input
        .tensors()
        .iter()
        .zip(decisions)
        .filter_map(|(t, d)| d.note.as_ref().map(|n| (t.name.clone(), n.clone().into())))
        .collect();
    let name = input_path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| input_path.display().to_string());
    ProvenanceStep {
        tool: TOOL.to_string(),
        created: now_rfc3339(),
        details: serde_json::json!({
            "quantization": {
                "to": options.policy.target_name(),
                "method": options.method.name(),
                "policy": POLICY_DESCRIPTION,
                "overrides": options.policy.overrides.iter().map(ToString::to_string)
                    .collect::<Vec<_>>(),
                "calibration": options.importance.as_ref().map(|i| serde_json::json!({
                    "model_sha256": i.info.model_sha256,
                    "text_sha256": i.info.text_sha256,
                    "tokens": i.info.tokens,
                    "chunks": i.info.chunks,
                    "ctx": i.info.ctx,
                    "statistics": if i.moments.is_empty() {
                        "mean square of each input column"
                    } else {
                        "mean square of each input column; second moments of each input"
                    },
                    "weighted_tensors": i.columns.len(),
                })),
                "per_tensor": per_tensor,
                "notes": fallbacks,
            }
        }),
        sources: vec![SourceFile {
            name,
            bytes: input.file_len(),
            sha256: sha256.to_string(),
        }],
    }
}

/// What every tensor task shares.
struct Ctx<'a> {
    file: &'a File,
    label: &'a str,
    writer: &'a KilnWriter,
    method: Method,
    importance: &'a BTreeMap<String, Vec<f32>>,
    /// Factors of the input second moments, per site, computed once on first use.
    factors: &'a BTreeMap<String, OnceLock<Arc<Factor>>>,
    calibration: Option<&'a Importance>,
    progress: &'a dyn Progress,
}

/// One converted chunk, waiting to be written in order.
struct Chunk {
    /// The input bytes it was converted from, for the tensor's checksum.
    input: Vec<u8>,
    output: Vec<u8>,
    stats: ErrorStats,
}

impl Ctx<'_> {
    fn io_err(&self, e: std::io::Error) -> QuantizeError {
        read_err(self.label, e)
    }

    fn tensor(&self, i: usize, info: &TensorInfo, decision: &Decision) -> Result<TensorReport> {
        let mut sink = self.writer.tensor_sink(i)?;
        let mut stats = ErrorStats::default();
        // The input's bytes, hashed in order as they are read, checked against the index below.
        let mut input_sha = Sha256::new();
        let numel = info.numel();
        match decision.action {
            Action::Copy => {
                let mut buf = vec![0u8; (CHUNK_ELEMENTS * 4).min(info.len as usize)];
                let mut pos = 0u64;
                while pos < info.len {
                    let n = (info.len - pos).min(buf.len() as u64) as usize;
                    read_exact_at(self.file, &mut buf[..n], info.offset + pos)
                        .map_err(|e| self.io_err(e))?;
                    input_sha.update(&buf[..n]);
                    sink.write(&buf[..n])?;
                    pos += n as u64;
                }
                advance(self.progress, numel)?;
            }
            Action::Convert if self.moment(info, decision).is_some() => {
                let (bytes, s) = self
                    .compensated(info, decision, &mut input_sha)
                    .map_err(|e| self.checksum_first(info, e))?;
                sink.write(&bytes)?;
                stats.merge(&s);
                advance(self.progress, numel)?;
            }
            Action::Convert => {
                let cols = info.shape.last().copied().unwrap_or(1) as usize;
                let rows = (numel / cols as u64) as usize;
                // A chunk holds whole storage units (sixteen rows for q4_0x16; the row count
                // is a multiple of it, so the last chunk does too).
                let rows_per_chunk = (CHUNK_ELEMENTS / cols)
                    .max(1)
                    .next_multiple_of(decision.storage.rows_per_unit());
                let chunks = rows.div_ceil(rows_per_chunk);
                let wave = WAVE_PER_THREAD * rayon::current_num_threads().max(1);
                for first in (0..chunks).step_by(wave) {
                    let done: Vec<Chunk> = (first..(first + wave).min(chunks))
                        .into_par_iter()
                        .map(|c| {
                            let r0 = c * rows_per_chunk;
                            let r1 = (r0 + rows_per_chunk).min(rows);
                            self.chunk(info, decision, cols, r0, r1)
                        })
                        .collect::<Result<_>>()
                        .map_err(|e| self.checksum_first(info, e))?;
                    for c in done {
                        input_sha.update(&c.input);
                        sink.write(&c.output)?;
                        stats.merge(&c.stats);
                        advance(self.progress, c.stats.count)?;
                    }
                }
            }
        }
        check_tensor_sha(self.label, info, input_sha.finalize().into())?;
        sink.finish()?;
        Ok(TensorReport::new(info, decision, stats))
    }

    /// A bad value can be the garbage of a corrupt tensor: report the checksum mismatch then.
    #[cold]
    fn checksum_first(&self, info: &TensorInfo, e: QuantizeError) -> QuantizeError {
        match e {
            QuantizeError::NonFinite { .. }
            | QuantizeError::F16Overflow { .. }
            | QuantizeError::ScaleOverflow { .. } => verify_tensor(self.file, self.label, info)
                .err()
                .unwrap_or(e),
            e => e,
        }
    }

    /// Read, decode and convert rows `r0..r1` of a tensor.
    ///
    /// The input is a float dtype: quantized input (whose rows, for `q4_0x16`, are not even
    /// byte ranges) is only ever copied, the policy refuses anything else.
    fn chunk(
        &self,
        info: &TensorInfo,
        decision: &Decision,
        cols: usize,
        r0: usize,
        r1: usize,
    ) -> Result<Chunk> {
        debug_assert!(!info.dtype.is_quantized(), "quantized input is copied");
        let unit = info.dtype.block_bytes() as u64;
        let start = (r0 * cols) as u64;
        let n = (r1 - r0) * cols;
        let mut input = vec![0u8; n * unit as usize];
        read_exact_at(self.file, &mut input, info.offset + start * unit)
            .map_err(|e| self.io_err(e))?;
        let x = decode_values(info.dtype, &input, n);
        let mut output = Vec::new();
        let mut stats = ErrorStats::default();
        let importance = self.importance.get(&info.name).map(Vec::as_slice);
        convert_rows(
            &x,
            cols,
            decision.storage,
            self.method,
            importance,
            &mut output,
            &mut stats,
        )
        .map_err(|e| self.value_error(info, cols, start, e))?;
        Ok(Chunk {
            input,
            output,
            stats,
        })
    }

    /// The site and second moment for error-compensating rounding of this tensor, if any.
    fn moment(&self, info: &TensorInfo, decision: &Decision) -> Option<(&str, &Arc<Vec<f32>>)> {
        if !gptq::supports(decision.dtype) {
            return None;
        }
        let imp = self.calibration?;
        let site = imp.sites.get(&info.name)?;
        self.factors.get(site)?;
        Some((site.as_str(), imp.moments.get(site)?))
    }

    /// Quantize a whole matrix with error compensation ([`crate::gptq`]).
    fn compensated(
        &self,
        info: &TensorInfo,
        decision: &Decision,
        input_sha: &mut Sha256,
    ) -> Result<(Vec<u8>, ErrorStats)> {
        let (site, moment) = self.moment(info, decision).expect("checked by the caller");
        debug_assert!(!info.dtype.is_quantized(), "quantized input is copied");
        let cols = info.shape.last().copied().unwrap_or(1) as usize;
        let numel = info.numel() as usize;
        let unit = info.dtype.block_bytes();
        let mut input = vec![0u8; numel * unit];
        read_exact_at(self.file, &mut input, info.offset).map_err(|e| self.io_err(e))?;
        input_sha.update(&input);
        let x = decode_values(info.dtype, &input, numel);
        drop(input);
        if let Some(p) = x.iter().position(|v| !v.is_finite()) {
            let e = ValueError::NonFinite {
                position: p,
                value: x[p],
            };
            return Err(self.value_error(info, cols, 0, e));
        }
        if moment.len() != cols * cols {
            return Err(QuantizeError::ImportanceMismatch {
                file: self.label.to_string(),
                reason: format!(
                    "the second moment of `{site}` is not {cols}×{cols}, as `{}` needs",
                    info.name
                ),
            });
        }
        let f = self.factors[site].get_or_init(|| Arc::new(factor(moment, cols)));
        let mut out = Vec::with_capacity(numel / 32 * decision.dtype.block_bytes());
        let deq = gptq::quantize_matrix(&x, cols, decision.dtype, f, &mut out);
        let mut stats = ErrorStats::default();
        stats.add(&x, &deq);
        // The compensation runs over plain rows; the file stores them in its layout.
        if decision.storage != decision.storage.logical() {
            out = decision.storage.to_storage(cols, &out).into_owned();
        }
        Ok((out, stats))
    }

    /// The error for a bad value at `position` (relative to element `start`) of a tensor.
    fn value_error(
        &self,
        info: &TensorInfo,
        cols: usize,
        start: u64,
        e: ValueError,
    ) -> QuantizeError {
        {
            let (position, value) = match e {
                ValueError::NonFinite { position, value }
                | ValueError::F16Overflow { position, value }
                | ValueError::ScaleOverflow { position, value } => (start + position as u64, value),
            };
            let (row, column) = (position / cols as u64, position % cols as u64);
            let (file, tensor) = (self.label.to_string(), info.name.clone());
            match e {
                ValueError::NonFinite { .. } => QuantizeError::NonFinite {
                    file,
                    tensor,
                    position,
                    row,
                    column,
                    value,
                },
                ValueError::F16Overflow { .. } => QuantizeError::F16Overflow {
                    file,
                    tensor,
                    position,
                    row,
                    column,
                    value,
                },
                ValueError::ScaleOverflow { .. } => QuantizeError::ScaleOverflow {
                    file,
                    tensor,
                    position,
                    row,
                    column,
                    value,
                },
            }
        }
    }
}

/// A float tensor's bytes as f32: bf16 (the usual source dtype, and the hot path) through the
/// kernels crate's dispatched decoder, the other float dtypes through the format crate.
pub(crate) fn decode_values(dtype: DType, input: &[u8], n: usize) -> Vec<f32> {
    let mut x = vec![0.0f32; n];
    if dtype == DType::BF16 {
        kiln_kernels::decode_bf16(input, &mut x);
    } else {
        decode_to_f32(dtype, input, &mut x);
    }
    x
}
