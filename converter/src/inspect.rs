//! `kiln-convert inspect`: what a `.kiln` file holds, and optionally whether every checksum
//! still matches.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;
use std::time::Instant;

use kiln_format::layout::minor_of;
use kiln_format::{ChecksumFailure, DType, KilnFile, Metadata};
use serde::Serialize;

use crate::error::Result;
use crate::Progress;

/// One row of the tensor table.
#[derive(Debug, Clone, Serialize)]
pub struct TensorRow {
    pub name: String,
    pub dtype: String,
    pub shape: Vec<u64>,
    pub offset: u64,
    pub len: u64,
    pub sha256: String,
}

/// Result of hashing every tensor.
#[derive(Debug, Clone, Serialize)]
pub struct VerifyResult {
    /// Whether every checksum matched.
    pub ok: bool,
    /// Seconds spent hashing.
    pub seconds: f64,
    /// Tensor bytes hashed per second, GB/s (10^9).
    pub gb_per_s: f64,
    /// Mismatches, by tensor name.
    pub failures: Vec<Failure>,
    /// Tensors holding NaN or infinity, by name (their checksums may well match).
    pub non_finite: Vec<NonFinite>,
}

/// A tensor holding NaN or infinity.
#[derive(Debug, Clone, Serialize)]
pub struct NonFinite {
    pub tensor: String,
    /// Non-finite values.
    pub count: usize,
    /// Element index of the first.
    pub first: usize,
}

/// A checksum mismatch.
#[derive(Debug, Clone, Serialize)]
pub struct Failure {
    pub tensor: String,
    pub stored: String,
    pub computed: String,
}

impl From<ChecksumFailure> for Failure {
    fn from(f: ChecksumFailure) -> Self {
        Failure {
            tensor: f.tensor,
            stored: f.stored,
            computed: f.computed,
        }
    }
}

/// The tensors of one dtype.
#[derive(Debug, Clone, Default, Serialize)]
pub struct DTypeSummary {
    /// Tensors of this dtype.
    pub tensors: usize,
    /// Their weights.
    pub parameters: u64,
    /// Their bytes.
    pub bytes: u64,
    /// Storage bits per weight (4.5 for Q4_0 and Q4_K, 6.5625 for Q6_K).
    pub bits_per_weight: f64,
    /// The format minor version that introduced the dtype (`q4_0x16` 1; Q5_0, Q5_1 and the
    /// K-quants from Q4_K 2; Q2_K, Q3_K, IQ4_NL and IQ4_XS 4; `iq4_nlx16` 6; `iq4_xsx16` 7).
    pub since_minor: u16,
    /// What the dtype is: its layout in a few words.
    pub layout: &'static str,
}

/// A few words on a dtype's layout, for the report.
fn layout(d: DType) -> &'static str {
    match d {
        DType::F32 => "IEEE binary32",
        DType::F16 => "IEEE binary16",
        DType::BF16 => "bfloat16",
        DType::Q8_0 => "GGML Q8_0: 32 weights, f16 scale, i8 codes",
        DType::Q4_0 => "GGML Q4_0: 32 weights, f16 scale, 4-bit codes",
        DType::Q4_0x16 => "GGML Q4_0 blocks of 16 rows interleaved",
        DType::IQ4_NLx16 => "GGML IQ4_NL blocks of 16 rows interleaved",
        DType::IQ4_XSx16 => "GGML IQ4_XS super-blocks of 16 rows interleaved",
        DType::Q5_0 => "GGML Q5_0: 32 weights, f16 scale, 5-bit codes",
        DType::Q5_1 => "GGML Q5_1: 32 weights, f16 scale and min, 5-bit codes",
        DType::Q4_K => {
            "GGML Q4_K: 256 weights, 8 sub-blocks with 6-bit scales and mins, 4-bit codes"
        }
        DType::Q5_K => {
            "GGML Q5_K: 256 weights, 8 sub-blocks with 6-bit scales and mins, 5-bit codes"
        }
        DType::Q6_K => "GGML Q6_K: 256 weights, 16 sub-blocks with 8-bit scales, 6-bit codes",
        DType::Q2_K => {
            "GGML Q2_K: 256 weights, 16 sub-blocks with 4-bit scales and mins, 2-bit codes"
        }
        DType::Q3_K => "GGML Q3_K: 256 weights, 16 sub-blocks with 6-bit scales, 3-bit codes",
        DType::IQ4_NL => "GGML IQ4_NL: 32 weights, f16 scale, 4-bit indices into a 16-value grid",
        DType::IQ4_XS => {
            "GGML IQ4_XS: 256 weights, 8 sub-blocks with 6-bit scales, 4-bit grid indices"
        }
    }
}

/// Everything `inspect` reports.
#[derive(Debug, Clone, Serialize)]
pub struct Inspection {
    pub file: String,
    pub format_version: String,
    pub file_len: u64,
    pub header_sha256: String,
    /// Milliseconds to open and validate the file (no tensor hashing).
    pub open_ms: f64,
    pub parameters: u64,
    pub bytes_by_dtype: BTreeMap<String, u64>,
    /// Per dtype: tensors, weights, bytes, bits per weight, layout.
    pub dtypes: BTreeMap<String, DTypeSummary>,
    pub metadata: MetadataSummary,
    pub tensors: Vec<TensorRow>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub verify: Option<VerifyResult>,
}

/// A metadata field the file stores packed in its files section (format 1.3).
#[derive(Debug, Clone, Serialize)]
pub struct PackedRow {
    /// The field's path in the metadata, e.g. `tokenizer.tokenizer_json`.
    pub field: String,
    /// `zlib` or `stored`.
    pub encoding: String,
    /// Decoded bytes.
    pub len: u64,
    /// Bytes in the file.
    pub stored_len: u64,
}

/// The metadata, with the large tokenizer strings reduced to their sizes.
#[derive(Debug, Clone, Serialize)]
pub struct MetadataSummary {
    pub config: kiln_format::ModelConfig,
    pub tokenizer_json_bytes: Option<usize>,
    pub tokenizer_config_json_bytes: Option<usize>,
    pub chat_template: Option<String>,
    pub special_tokens: BTreeMap<String, String>,
    pub add_bos_token: Option<bool>,
    pub generation: serde_json::Value,
    pub provenance: Vec<kiln_format::ProvenanceStep>,
    /// The fields stored compressed outside the JSON document (empty when none are).
    pub packed: Vec<PackedRow>,
}

impl From<&Metadata> for MetadataSummary {
    fn from(m: &Metadata) -> Self {
        MetadataSummary {
            config: m.config.clone(),
            tokenizer_json_bytes: m.tokenizer.tokenizer_json.as_ref().map(String::len),
            tokenizer_config_json_bytes: m
                .tokenizer
                .tokenizer_config_json
                .as_ref()
                .map(String::len),
            chat_template: m.tokenizer.chat_template.clone(),
            special_tokens: m.tokenizer.special_tokens.clone(),
            add_bos_token: m.tokenizer.add_bos_token,
            generation: m.generation.clone(),
            provenance: m.provenance.clone(),
            packed: Vec::new(),
        }
    }
}

/// Open (and with `verify`, hash) a file.
pub fn inspect(path: &Path, verify: bool, progress: &dyn Progress) -> Result<Inspection> {
    let t0 = Instant::now();
    let f = KilnFile::open(path)?;
    let open_ms = t0.elapsed().as_secs_f64() * 1e3;
    let mut bytes_by_dtype = BTreeMap::new();
    let mut dtypes: BTreeMap<String, DTypeSummary> = BTreeMap::new();
    let mut parameters = 0;
    let tensors = f
        .tensors()
        .iter()
        .map(|t| {
            *bytes_by_dtype
                .entry(t.dtype.name().to_string())
                .or_insert(0) += t.len;
            parameters += t.numel();
            let d = dtypes.entry(t.dtype.name().to_string()).or_default();
            d.tensors += 1;
            d.parameters += t.numel();
            d.bytes += t.len;
            d.bits_per_weight = t.dtype.bits_per_weight();
            d.since_minor = minor_of(t.dtype);
            d.layout = layout(t.dtype);
            TensorRow {
                name: t.name.clone(),
                dtype: t.dtype.name().to_string(),
                shape: t.shape.clone(),
                offset: t.offset,
                len: t.len,
                sha256: kiln_format::hex(&t.sha256),
            }
        })
        .collect();
    let verify = verify.then(|| verify_tensors(&f, progress));
    let (major, minor) = f.version();
    Ok(Inspection {
        file: path.display().to_string(),
        format_version: format!("{major}.{minor}"),
        file_len: f.file_len(),
        header_sha256: kiln_format::hex(&f.header_sha256()),
        open_ms,
        parameters,
        bytes_by_dtype,
        dtypes,
        metadata: MetadataSummary {
            packed: f
                .packed_fields()
                .iter()
                .map(|p| PackedRow {
                    field: p.field.key().to_string(),
                    encoding: p.encoding.name().to_string(),
                    len: p.len,
                    stored_len: p.stored_len,
                })
                .collect(),
            ..MetadataSummary::from(f.metadata())
        },
        tensors,
        verify,
    })
}

/// Hash every tensor and scan it for NaN and infinity.
fn verify_tensors(f: &KilnFile, progress: &dyn Progress) -> VerifyResult {
    progress.start(f.data_len(), f.tensors().len());
    let t = Instant::now();
    // One pass: each chunk hashed, then scanned for NaN and infinity while in cache.
    let (failures, non_finite) = f.check_tensors(&|n| progress.advance(n, 0));
    progress.finish();
    let seconds = t.elapsed().as_secs_f64();
    let non_finite: Vec<NonFinite> = non_finite
        .into_iter()
        .map(|n| NonFinite {
            tensor: n.tensor,
            count: n.count,
            first: n.first,
        })
        .collect();
    VerifyResult {
        ok: failures.is_empty() && non_finite.is_empty(),
        seconds,
        gb_per_s: f.data_len() as f64 / seconds / 1e9,
        failures: failures.into_iter().map(Failure::from).collect(),
        non_finite,
    }
}

fn human(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

/// The human-readable report.
pub fn render(i: &Inspection) -> String {
    let mut s = String::new();
    render_model(&mut s, i);
    render_metadata(&mut s, &i.metadata);
    render_dtypes(&mut s, i);
    render_tensor_table(&mut s, i);
    if let Some(v) = &i.verify {
        render_verify(&mut s, i, v);
    }
    s
}

/// The file, its header checksum, the model's configuration and its embedding head.
fn render_model(s: &mut String, i: &Inspection) {
    let c = &i.metadata.config;
    let _ = writeln!(
        s,
        "{}  (.kiln {}, {}, opened in {:.1} ms)",
        i.file,
        i.format_version,
        human(i.file_len),
        i.open_ms
    );
    let _ = writeln!(s, "header sha256  {}", i.header_sha256);
    let _ = writeln!(
        s,
        "model          {} ({:?}): {} layers, hidden {}, ffn {}, heads {}/{} kv, head_dim {}, vocab {}",
        c.source_architecture, c.architecture, c.num_layers, c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size
    );
    let _ = writeln!(
        s,
        "               rope theta {}{}, rms eps {:e}, context {}, tied embeddings {}, attention bias {}{}",
        c.rope_theta,
        c.rope_scaling.as_ref().map(|r| format!(" ({r:?})")).unwrap_or_default(),
        c.rms_norm_eps,
        c.max_position_embeddings,
        c.tie_word_embeddings,
        c.attention_bias,
        c.sliding_window.map(|w| format!(", sliding window {w}")).unwrap_or_default()
    );
    let _ = writeln!(
        s,
        "               bos {:?}, eos {:?}, {} parameters",
        c.bos_token_id, c.eos_token_ids, i.parameters
    );
    if let Some(e) = &c.family.embedding {
        let _ = writeln!(
            s,
            "embedding      {} pooling{}{}, max {} tokens{}",
            e.pooling.name(),
            e.dense
                .iter()
                .map(|d| format!(
                    ", dense {}→{}{} {:?}",
                    d.in_features,
                    d.out_features,
                    if d.bias { " +bias" } else { "" },
                    d.activation
                ))
                .collect::<String>(),
            if e.normalize { ", normalised" } else { "" },
            e.max_seq_length.unwrap_or(c.max_position_embeddings),
            if e.prompts.is_empty() {
                String::new()
            } else {
                format!(
                    ", prompts {}",
                    e.prompts.keys().cloned().collect::<Vec<_>>().join(", ")
                )
            }
        );
    }
}

/// The tokenizer files, the packed fields and the provenance.
fn render_metadata(s: &mut String, m: &MetadataSummary) {
    let _ = writeln!(
        s,
        "tokenizer      tokenizer.json {}, tokenizer_config.json {}, chat template {}, special {:?}",
        m.tokenizer_json_bytes.map(|b| human(b as u64)).unwrap_or_else(|| "absent".into()),
        m.tokenizer_config_json_bytes.map(|b| human(b as u64)).unwrap_or_else(|| "absent".into()),
        if m.chat_template.is_some() { "present" } else { "absent" },
        m.special_tokens
    );
    for p in &m.packed {
        let _ = writeln!(
            s,
            "packed         {}: {} stored as {} {}",
            p.field,
            human(p.len),
            human(p.stored_len),
            p.encoding
        );
    }
    for p in &m.provenance {
        let _ = writeln!(
            s,
            "provenance     {} at {}: {}",
            p.tool, p.created, p.details
        );
        for src in &p.sources {
            let _ = writeln!(
                s,
                "                 {} ({}) sha256 {}",
                src.name,
                human(src.bytes),
                src.sha256
            );
        }
    }
}

/// The tensor count and, per dtype, its tensors, weights, bytes and layout.
fn render_dtypes(s: &mut String, i: &Inspection) {
    let by: Vec<String> = i
        .bytes_by_dtype
        .iter()
        .map(|(d, b)| format!("{d} {}", human(*b)))
        .collect();
    let _ = writeln!(s, "tensors        {} ({})", i.tensors.len(), by.join(", "));
    for (name, d) in &i.dtypes {
        let _ = writeln!(
            s,
            "  {name:<8} {:>4} tensor(s), {:>12} weights, {:>9}, {} bits/weight{}; {}",
            d.tensors,
            d.parameters,
            human(d.bytes),
            d.bits_per_weight,
            if d.since_minor > 0 {
                format!(" (format 1.{})", d.since_minor)
            } else {
                String::new()
            },
            d.layout
        );
    }
}

/// One line per tensor: name, dtype, shape, offset, bytes and the start of its sha256.
fn render_tensor_table(s: &mut String, i: &Inspection) {
    let w = i
        .tensors
        .iter()
        .map(|t| t.name.len())
        .max()
        .unwrap_or(4)
        .max(4);
    // Storage layouts have longer names (`q4_0x16`) than the plain dtypes.
    let dw = i
        .tensors
        .iter()
        .map(|t| t.dtype.len())
        .max()
        .unwrap_or(5)
        .max(5);
    let _ = writeln!(
        s,
        "  {:<w$}  {:<dw$}  {:<14}  {:>12}  {:>10}  sha256",
        "name", "dtype", "shape", "offset", "bytes"
    );
    for t in &i.tensors {
        let _ = writeln!(
            s,
            "  {:<w$}  {:<dw$}  {:<14}  {:>12}  {:>10}  {}…",
            t.name,
            t.dtype,
            format!("{:?}", t.shape),
            t.offset,
            t.len,
            &t.sha256[..16]
        );
    }
}

/// The checksum and finite-value results of `--verify`.
fn render_verify(s: &mut String, i: &Inspection, v: &VerifyResult) {
    if v.failures.is_empty() {
        let _ = writeln!(
            s,
            "checksums      all {} match ({:.3} s, {:.2} GB/s)",
            i.tensors.len(),
            v.seconds,
            v.gb_per_s
        );
    } else {
        let _ = writeln!(s, "checksums      {} MISMATCH:", v.failures.len());
        for f in &v.failures {
            let _ = writeln!(
                s,
                "  {}: stored {} computed {}",
                f.tensor, f.stored, f.computed
            );
        }
    }
    if v.non_finite.is_empty() {
        let _ = writeln!(s, "values         all finite");
    } else {
        let _ = writeln!(
            s,
            "values         {} tensor(s) hold NaN or infinity:",
            v.non_finite.len()
        );
        for n in &v.non_finite {
            let _ = writeln!(
                s,
                "  {}: {} value(s), the first at element {}",
                n.tensor, n.count, n.first
            );
        }
    }
}
