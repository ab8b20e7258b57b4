//! Importance: what calibration learned about each matrix's inputs, and its file format.
//!
//! For every matrix that will be quantized, calibration records statistics of the vectors the
//! matrix multiplies (its *input columns*), because the error that matters is the error in
//! `W·x`, not in `W`: a weight whose input column is always near zero can be rounded coarsely,
//! one whose column is large must be kept close.
//!
//! - **Column importance**: the mean square of each input column, `E[x_j²]`. Weighted scale
//!   selection minimises `Σ_j E[x_j²]·(w_j − d·q_j)²` per block, which is the expected output
//!   error if the input columns were uncorrelated.
//! - **Second moments** (optional): the whole matrix `E[x·xᵀ]`, which keeps the correlations
//!   between columns. Error-compensating rounding ([`crate::gptq`]) needs it. Matrices that
//!   multiply the same input (q/k/v, gate/up) share one.
//!
//! # File format
//!
//! A safetensors file (so any tool can read it), written atomically:
//!
//! - one F32 tensor `[cols]` per matrix, named by the matrix's canonical name
//!   (`layers.3.attn.q.weight`): its column importance;
//! - optionally, one F32 tensor `[cols, cols]` per distinct input, named
//!   `second_moment.<site>` where `<site>` is the activation's name
//!   (`model.layers.3.input_layernorm.output`);
//! - metadata (string → string): `content` = `kiln importance`, `version` = `1`, `model_sha256`
//!   (the header checksum of the model it was measured on), `text_sha256`, `tokens`, `chunks`,
//!   `ctx`, and `sites`: a JSON object mapping each matrix name to its input site; optionally
//!   `probe_tokens`, a JSON array of the first calibration token ids (at most
//!   [`PROBE_TOKENS`]), which `--to auto` runs the model on to weigh each
//!   matrix's error in the logits ([`crate::sensitivity`]).
//!
//! Loading checks every field: names must be canonical, lengths must match, values must be
//! finite, non-negative (diagonals of second moments included) and at most
//! [`MAX_MEAN_SQUARE`], and every matrix must name a site. The file must be a regular file. The quantizer then checks the names and lengths against the model being quantized.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use kiln_format::{write_file_atomic, TensorName};
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};

use crate::error::{QuantizeError, Result};

/// The value of the `content` metadata key.
const CONTENT: &str = "kiln importance";
/// The file format version this code writes and reads.
const VERSION: &str = "1";
/// Prefix of second-moment tensor names.
const MOMENT_PREFIX: &str = "second_moment.";
/// Largest importance file read: it is read whole, and second moments at an 8B model's widths
/// take tens of GB, so this only keeps an absurd size from being tried.
const MAX_FILE_BYTES: u64 = 1 << 40;
/// Largest mean square (and second-moment entry) accepted: activations with an RMS of 10^10,
/// far beyond any model's. Larger finite values (3e38) would overflow the quantizer's
/// weighted sums to infinity, which then looks like a fault of the model's tensor.
pub const MAX_MEAN_SQUARE: f32 = 1e20;
/// Calibration tokens the probe runs (one window from an empty cache), and the most an
/// importance file keeps: enough for the KL-divergence of one matrix's rounding to rank
/// matrices apart by their orders of magnitude ([`crate::sensitivity`]), few enough that a
/// forward pass per matrix is a fraction of the candidates' quantization.
pub const PROBE_TOKENS: usize = 256;

/// How the statistics were measured (recorded in the file and in the output's provenance).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CalibrationInfo {
    /// Header sha256 of the model that was run.
    pub model_sha256: String,
    /// sha256 of the calibration text's bytes.
    pub text_sha256: String,
    /// Tokens the statistics were averaged over.
    pub tokens: u64,
    /// Independent windows of `ctx` tokens (the KV cache is reset between them).
    pub chunks: u64,
    /// Window length in tokens.
    pub ctx: u64,
}

/// Per-matrix input statistics.
#[derive(Debug, Clone, PartialEq)]
pub struct Importance {
    /// Matrix name → mean square of each input column.
    pub columns: BTreeMap<String, Vec<f32>>,
    /// Matrix name → its input site (matrices with the same input share a site).
    pub sites: BTreeMap<String, String>,
    /// Site → `E[x·xᵀ]`, `cols × cols` row-major (empty when not measured).
    pub moments: BTreeMap<String, Arc<Vec<f32>>>,
    /// How it was measured.
    pub info: CalibrationInfo,
    /// The first calibration tokens (at most [`PROBE_TOKENS`]; empty in
    /// files written before they were kept).
    pub probe: Vec<u32>,
}

impl Importance {
    /// The second-moment matrix of `tensor`'s input, if measured.
    pub fn moment(&self, tensor: &str) -> Option<&Arc<Vec<f32>>> {
        self.moments.get(self.sites.get(tensor)?)
    }

    /// Write the file atomically.
    pub fn save(&self, path: &Path, overwrite: bool) -> Result<()> {
        let col_bytes: Vec<(String, Vec<u8>, usize)> = self
            .columns
            .iter()
            .map(|(n, v)| (n.clone(), f32_bytes(v), v.len()))
            .collect();
        let moment_bytes: Vec<(String, Vec<u8>, usize)> = self
            .moments
            .iter()
            .map(|(s, m)| {
                let side = (m.len() as f64).sqrt() as usize;
                (format!("{MOMENT_PREFIX}{s}"), f32_bytes(m), side)
            })
            .collect();
        let mut views = Vec::with_capacity(col_bytes.len() + moment_bytes.len());
        for (n, b, len) in &col_bytes {
            views.push((n.clone(), view(b, vec![*len])));
        }
        for (n, b, side) in &moment_bytes {
            views.push((n.clone(), view(b, vec![*side, *side])));
        }
        let i = &self.info;
        let meta = std::collections::HashMap::from([
            ("content".to_string(), CONTENT.to_string()),
            ("version".to_string(), VERSION.to_string()),
            ("model_sha256".to_string(), i.model_sha256.clone()),
            ("text_sha256".to_string(), i.text_sha256.clone()),
            ("tokens".to_string(), i.tokens.to_string()),
            ("chunks".to_string(), i.chunks.to_string()),
            ("ctx".to_string(), i.ctx.to_string()),
            (
                "sites".to_string(),
                serde_json::to_string(&self.sites).expect("a string map serializes"),
            ),
            (
                "probe_tokens".to_string(),
                serde_json::to_string(&self.probe).expect("a list of ids serializes"),
            ),
        ]);
        let bytes = safetensors::tensor::serialize(views, Some(meta)).map_err(|e| bad(path, e))?;
        write_file_atomic(path, &bytes, overwrite)?;
        Ok(())
    }

    /// Read and validate a file written by [`Importance::save`].
    pub fn load(path: &Path) -> Result<Importance> {
        let bytes = kiln_format::read_bounded(path, MAX_FILE_BYTES, "importance file")?;
        let (_, header) = SafeTensors::read_metadata(&bytes)
            .map_err(|e| bad(path, format!("not a safetensors file: {e}")))?;
        let st = SafeTensors::deserialize(&bytes)
            .map_err(|e| bad(path, format!("not a safetensors file: {e}")))?;
        let meta = FileMetadata {
            path,
            meta: header.metadata().clone().unwrap_or_default(),
        };
        meta.check_content()?;
        let info = meta.calibration_info()?;
        let sites = meta.sites()?;
        let probe = meta.probe()?;
        let mut columns = BTreeMap::new();
        let mut moments = BTreeMap::new();
        for (name, t) in st.tensors() {
            if t.dtype() != Dtype::F32 {
                return Err(bad(
                    path,
                    format!("tensor `{name}` is {:?}; importance is F32", t.dtype()),
                ));
            }
            let data: Vec<f32> = t
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            if let Some(site) = name.strip_prefix(MOMENT_PREFIX) {
                check_moment(path, &name, t.shape(), &data)?;
                moments.insert(site.to_string(), Arc::new(data));
            } else {
                check_columns(path, &name, t.shape(), &data)?;
                columns.insert(name, data);
            }
        }
        check_sites(path, &columns, &sites, &moments)?;
        Ok(Importance {
            columns,
            sites,
            moments,
            info,
            probe,
        })
    }
}

/// An importance file's string metadata, read field by field.
struct FileMetadata<'a> {
    path: &'a Path,
    meta: std::collections::HashMap<String, String>,
}

impl FileMetadata<'_> {
    fn get(&self, k: &str) -> Result<&String> {
        self.meta.get(k).ok_or_else(|| {
            bad(
                self.path,
                format!(
                    "metadata `{k}` is missing; was this written by kiln-quantize \
                     --save-importance?"
                ),
            )
        })
    }

    fn num(&self, k: &str) -> Result<u64> {
        self.get(k)?
            .parse()
            .map_err(|_| bad(self.path, format!("metadata `{k}` is not a whole number")))
    }

    /// The file says it holds importance, in the version this build reads.
    fn check_content(&self) -> Result<()> {
        if self.get("content")? != CONTENT {
            return Err(bad(
                self.path,
                format!("metadata `content` is not `{CONTENT}`"),
            ));
        }
        if self.get("version")? != VERSION {
            return Err(bad(
                self.path,
                format!(
                    "version {} is not supported (this kiln-quantize reads version {VERSION})",
                    self.get("version")?
                ),
            ));
        }
        Ok(())
    }

    fn calibration_info(&self) -> Result<CalibrationInfo> {
        Ok(CalibrationInfo {
            model_sha256: self.get("model_sha256")?.clone(),
            text_sha256: self.get("text_sha256")?.clone(),
            tokens: self.num("tokens")?,
            chunks: self.num("chunks")?,
            ctx: self.num("ctx")?,
        })
    }

    fn sites(&self) -> Result<BTreeMap<String, String>> {
        serde_json::from_str(self.get("sites")?).map_err(|e| {
            bad(
                self.path,
                format!("metadata `sites` is not a JSON string map: {e}"),
            )
        })
    }

    /// The probe tokens (none in files written before they were kept), at most
    /// [`PROBE_TOKENS`].
    fn probe(&self) -> Result<Vec<u32>> {
        let probe: Vec<u32> = match self.meta.get("probe_tokens") {
            None => Vec::new(),
            Some(p) => serde_json::from_str(p).map_err(|e| {
                bad(
                    self.path,
                    format!("metadata `probe_tokens` is not a JSON list of token ids: {e}"),
                )
            })?,
        };
        if probe.len() > PROBE_TOKENS {
            return Err(bad(
                self.path,
                format!(
                    "metadata `probe_tokens` holds {} ids; at most {} are kept",
                    probe.len(),
                    PROBE_TOKENS
                ),
            ));
        }
        Ok(probe)
    }
}

/// A second moment is square, its diagonal non-negative, every element finite and at most
/// [`MAX_MEAN_SQUARE`] in magnitude.
fn check_moment(path: &Path, name: &str, shape: &[usize], data: &[f32]) -> Result<()> {
    if shape.len() != 2 || shape[0] != shape[1] {
        return Err(bad(
            path,
            format!("`{name}` has shape {shape:?}; a second moment is square"),
        ));
    }
    let n = shape[0];
    if let Some(i) = (0..n).find(|&i| data[i * n + i].is_nan() || data[i * n + i] < 0.0) {
        return Err(bad(
            path,
            format!(
                "`{name}`: diagonal element {i} is {}; mean squares are \
                 non-negative",
                data[i * n + i]
            ),
        ));
    }
    if let Some(p) = data
        .iter()
        .position(|v| v.is_nan() || v.abs() > MAX_MEAN_SQUARE)
    {
        return Err(bad(
            path,
            format!(
                "`{name}`: element {p} is {}; second moments must be finite and \
                 at most {MAX_MEAN_SQUARE:e} in magnitude",
                data[p]
            ),
        ));
    }
    Ok(())
}

/// Column importance is named by a canonical matrix name, 1-D, every element finite,
/// non-negative and at most [`MAX_MEAN_SQUARE`].
fn check_columns(path: &Path, name: &str, shape: &[usize], data: &[f32]) -> Result<()> {
    if TensorName::parse(name).is_none() {
        return Err(bad(
            path,
            format!("tensor `{name}` is not a canonical matrix name"),
        ));
    }
    if shape.len() != 1 {
        return Err(bad(
            path,
            format!("`{name}` has shape {shape:?}; column importance is 1-D"),
        ));
    }
    if let Some(p) = data
        .iter()
        .position(|v| !(*v >= 0.0 && *v <= MAX_MEAN_SQUARE))
    {
        return Err(bad(
            path,
            format!(
                "`{name}`: element {p} is {}; importance must be finite, \
                 non-negative and at most {MAX_MEAN_SQUARE:e}",
                data[p]
            ),
        ));
    }
    Ok(())
}

/// Every matrix has a site, and a site's second moment matches its matrices' columns.
fn check_sites(
    path: &Path,
    columns: &BTreeMap<String, Vec<f32>>,
    sites: &BTreeMap<String, String>,
    moments: &BTreeMap<String, Arc<Vec<f32>>>,
) -> Result<()> {
    for name in columns.keys() {
        let site = sites
            .get(name)
            .ok_or_else(|| bad(path, format!("metadata `sites` has no entry for `{name}`")))?;
        if let Some(m) = moments.get(site) {
            let cols = columns[name].len();
            if m.len() != cols * cols {
                return Err(bad(
                    path,
                    format!("`{MOMENT_PREFIX}{site}` does not match `{name}`'s {cols} columns"),
                ));
            }
        }
    }
    Ok(())
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn view(bytes: &[u8], shape: Vec<usize>) -> TensorView<'_> {
    TensorView::new(Dtype::F32, shape, bytes).expect("the shape matches the bytes")
}

fn bad(path: &Path, reason: impl ToString) -> QuantizeError {
    QuantizeError::BadImportance {
        file: path.display().to_string(),
        reason: reason.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Importance {
        let mut columns = BTreeMap::new();
        columns.insert("layers.0.attn.q.weight".to_string(), vec![1.0, 2.0]);
        columns.insert("layers.0.attn.k.weight".to_string(), vec![1.0, 2.0]);
        let mut sites = BTreeMap::new();
        for n in columns.keys() {
            sites.insert(
                n.clone(),
                "model.layers.0.input_layernorm.output".to_string(),
            );
        }
        let mut moments = BTreeMap::new();
        moments.insert(
            "model.layers.0.input_layernorm.output".to_string(),
            Arc::new(vec![1.0, 0.5, 0.5, 2.0]),
        );
        Importance {
            columns,
            sites,
            moments,
            info: CalibrationInfo {
                model_sha256: "ab".repeat(32),
                text_sha256: "cd".repeat(32),
                tokens: 1024,
                chunks: 2,
                ctx: 512,
            },
            probe: vec![1, 7, 300],
        }
    }

    #[test]
    fn round_trips() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("imp.safetensors");
        let imp = sample();
        imp.save(&p, false).unwrap();
        let back = Importance::load(&p).unwrap();
        assert_eq!(back, imp);
        assert_eq!(
            back.moment("layers.0.attn.k.weight").unwrap().as_slice(),
            &[1.0, 0.5, 0.5, 2.0]
        );
        // No clobbering without overwrite.
        assert!(imp.save(&p, false).is_err());
    }

    fn rejects(edit: impl FnOnce(&mut Importance), needle: &str) {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("imp.safetensors");
        let mut imp = sample();
        edit(&mut imp);
        imp.save(&p, false).unwrap();
        let e = Importance::load(&p).unwrap_err().to_string();
        assert!(e.contains(needle), "{e}");
        assert!(e.contains("imp.safetensors"), "{e}");
    }

    #[test]
    fn rejects_bad_contents() {
        rejects(
            |i| {
                i.columns.get_mut("layers.0.attn.q.weight").unwrap()[1] = -1.0;
            },
            "non-negative",
        );
        rejects(
            |i| {
                i.columns.get_mut("layers.0.attn.q.weight").unwrap()[0] = f32::NAN;
            },
            "non-negative",
        );
        // Finite, but it would overflow the weighted sums and be blamed on the model.
        rejects(
            |i| {
                i.columns.get_mut("layers.0.attn.q.weight").unwrap()[1] = 3e38;
            },
            "at most 1e20",
        );
        rejects(
            |i| {
                let m = i.moments.values_mut().next().unwrap();
                Arc::make_mut(m)[1] = -3e38;
            },
            "at most 1e20 in magnitude",
        );
        rejects(
            |i| {
                let v = i.columns.remove("layers.0.attn.q.weight").unwrap();
                i.columns.insert("model.layers.0.q.weight".into(), v);
                i.sites.insert(
                    "model.layers.0.q.weight".into(),
                    "model.layers.0.input_layernorm.output".into(),
                );
            },
            "canonical",
        );
        rejects(
            |i| {
                i.sites.remove("layers.0.attn.k.weight");
            },
            "no entry",
        );
        rejects(
            |i| {
                i.moments.insert(
                    "model.layers.0.input_layernorm.output".into(),
                    Arc::new(vec![1.0; 9]),
                );
            },
            "does not match",
        );
        rejects(
            |i| {
                i.moments.insert(
                    "model.layers.0.input_layernorm.output".into(),
                    Arc::new(vec![-1.0, 0.0, 0.0, 1.0]),
                );
            },
            "diagonal",
        );
        rejects(|i| i.probe = vec![0; PROBE_TOKENS + 1], "probe_tokens");
    }

    #[test]
    fn rejects_other_files() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x.safetensors");
        std::fs::write(&p, b"not safetensors").unwrap();
        let e = Importance::load(&p).unwrap_err().to_string();
        assert!(
            e.contains("not a safetensors file") && e.contains("x.safetensors"),
            "{e}"
        );
        let e = Importance::load(&dir.path().join("missing"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("missing"), "{e}");
    }
}
