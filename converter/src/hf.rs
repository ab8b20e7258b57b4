//! The conversion pipeline: checkpoint directory → validated plan → `.kiln`, in parallel.
//!
//! The plan (every output tensor with its dtype and shape) is checked against `config.json`
//! before the output file is created, so a bad checkpoint fails in milliseconds and leaves
//! nothing behind. Tensors are then written from all cores: a kept-dtype tensor goes straight
//! from the source map to the output (the writer hashes it on the way), a cast tensor goes
//! through a small chunk buffer, so peak memory stays far below the model size.

use std::path::{Path, PathBuf};
use std::time::Instant;

use kiln_format::metadata::now_rfc3339;
use kiln_format::values::{cast_bytes, count_non_finite};
use kiln_format::{
    DType, KilnWriter, Metadata, ModelConfig, ProvenanceStep, Role, SourceFile, TensorName,
    TensorSpec,
};
use rayon::prelude::*;
use serde_json::{json, Value};

use crate::checkpoint::{read_json_as, read_text_as, Checkpoint, SourceTensor};
use crate::error::{ConvertError, Result};
use crate::{hf_config, tokenizer_files, Progress};

/// What to convert and how.
#[derive(Debug, Clone, Default)]
pub struct ConvertOptions {
    /// The Hugging Face checkpoint directory.
    pub input: PathBuf,
    /// The `.kiln` file to write.
    pub output: PathBuf,
    /// Output dtype for every tensor; `None` keeps each tensor's source dtype (lossless).
    pub dtype: Option<DType>,
    /// Replace an existing output file.
    pub overwrite: bool,
    /// Convert tensors holding NaN or infinity (listed in the summary) instead of refusing.
    pub allow_non_finite: bool,
}

/// What a conversion did.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ConvertSummary {
    /// Input directory.
    pub input: String,
    /// Output file.
    pub output: String,
    /// Architecture class of the source.
    pub architecture: String,
    /// Tensors written.
    pub tensors: usize,
    /// Tensors written per dtype.
    pub dtypes: std::collections::BTreeMap<String, usize>,
    /// Bytes of tensor data read from the source.
    pub bytes_in: u64,
    /// Size of the output file.
    pub bytes_out: u64,
    /// Wall time in seconds.
    pub seconds: f64,
    /// Source bytes converted per second, in GB/s (10^9), checksums included.
    pub gb_per_s: f64,
    /// Header checksum of the output.
    pub header_sha256: String,
    /// Source tensors skipped (derived buffers, a tied duplicate of the embedding).
    pub skipped: Vec<String>,
    /// Tensors holding NaN or infinity, converted because `allow_non_finite` was set.
    pub non_finite: Vec<String>,
}

/// Match the checkpoint's tensors against what the config implies: every expected tensor
/// present with the right shape, nothing unexplained left over.
fn plan<'c>(
    ck: &'c Checkpoint,
    config: &ModelConfig,
    skipped: &mut Vec<String>,
) -> Result<Vec<&'c SourceTensor>> {
    let expected = kiln_format::expected_tensors(config);
    let mut planned = Vec::with_capacity(expected.len());
    for (name, shape) in &expected {
        let t = ck
            .tensors
            .get(name)
            .ok_or_else(|| ConvertError::MissingTensor {
                dir: ck.dir.display().to_string(),
                tensor: crate::names::source_name(
                    crate::names::Source::HuggingFace,
                    config.architecture,
                    *name,
                ),
                expected: shape.clone(),
            })?;
        if &t.shape != shape {
            return Err(ConvertError::ShapeMismatch {
                path: ck.shards[t.shard].path.display().to_string(),
                tensor: t.source_name.clone(),
                found: t.shape.clone(),
                expected: shape.clone(),
            });
        }
        planned.push(t);
    }
    for (name, t) in &ck.tensors {
        if expected.iter().any(|(n, _)| n == name) {
            continue;
        }
        // A tied model may still ship lm_head: accept it only as an exact copy.
        if name.role == Role::LmHead && config.tie_word_embeddings {
            let embed = &ck.tensors[&TensorName::global(Role::Embed)];
            if t.shape == embed.shape && t.dtype == embed.dtype && ck.bytes(t) == ck.bytes(embed) {
                skipped.push(t.source_name.clone());
                continue;
            }
            return Err(ConvertError::ShapeMismatch {
                path: ck.shards[t.shard].path.display().to_string(),
                tensor: format!(
                    "{} (tie_word_embeddings is true, but it differs from the embedding)",
                    t.source_name
                ),
                found: t.shape.clone(),
                expected: embed.shape.clone(),
            });
        }
        return Err(ConvertError::UnknownTensor {
            path: ck.shards[t.shard].path.display().to_string(),
            tensor: t.source_name.clone(),
            arch: format!(
                "{} ({} layers{})",
                config.source_architecture,
                config.num_layers,
                if config.attention_bias {
                    ", attention biases"
                } else {
                    ", no attention biases"
                }
            ),
        });
    }
    Ok(planned)
}

/// A source file's size and sha256, for provenance (`name` is how provenance lists it).
pub(crate) fn sha256_file(path: &Path, name: &str) -> Result<SourceFile> {
    let f = kiln_format::open_regular(path, "source file")?;
    let bytes = f
        .metadata()
        .map_err(|e| ConvertError::io(path, "cannot read", e))?
        .len();
    let sha = kiln_format::io::sha256_range(&f, 0, bytes)
        .map_err(|e| ConvertError::io(path, "cannot read", e))?;
    Ok(SourceFile {
        name: name.to_string(),
        bytes,
        sha256: kiln_format::hex(&sha),
    })
}

/// `config.json` and what is read beside it, resolved.
struct SourceConfig {
    config_path: PathBuf,
    /// `config.json` as read, for the provenance's source dtype.
    config_text: String,
    generation: Option<Value>,
    config: ModelConfig,
    /// The sentence-transformers Dense modules' directories, in order.
    dense_dirs: Vec<String>,
}

/// What every tensor's copy shares while the tensors are written in parallel.
struct TensorCopy<'a> {
    ck: &'a Checkpoint,
    writer: &'a KilnWriter,
    opts: &'a ConvertOptions,
    progress: &'a dyn Progress,
    /// Tensors holding NaN or infinity, described, when `allow_non_finite` is set.
    non_finite: &'a std::sync::Mutex<Vec<String>>,
}

/// Convert a checkpoint directory to a `.kiln` file.
pub fn convert_hf(opts: &ConvertOptions, progress: &dyn Progress) -> Result<ConvertSummary> {
    let start = Instant::now();
    let dir = &opts.input;
    check_request(opts)?;
    let SourceConfig {
        config_path,
        config_text,
        generation,
        config,
        dense_dirs,
    } = read_config(dir)?;
    let tokenizer = tokenizer_files::read(dir)?;
    let ck = Checkpoint::open(dir, &config, &dense_dirs)?;
    check_layer_count(&config_path, &config, &ck)?;
    let mut skipped = ck.skipped.clone();
    let planned = plan(&ck, &config, &mut skipped)?;

    // Hash every source file (in parallel) for provenance.
    let side = side_files(dir, &dense_dirs, &ck);
    // Source checksums are computed while the tensors are written; the metadata holds
    // fixed-width placeholders until then (see KilnWriter::replace_metadata).
    let sources = unhashed_sources(dir, &side)?;

    let (specs, dtypes) = tensor_specs(&planned, opts.dtype);
    let details = conversion_details(opts, &config_text, &skipped);
    let metadata = Metadata {
        config: config.clone(),
        tokenizer,
        generation: generation.unwrap_or(Value::Null),
        provenance: vec![conversion_step(details, sources)],
    };

    let mut writer = KilnWriter::create(&opts.output, &metadata, specs, opts.overwrite)?;
    let bytes_in: u64 = planned.iter().map(|t| t.range.len() as u64).sum();
    progress.start(bytes_in, planned.len());
    // Largest first, so the long tensors do not end up alone at the tail of the schedule.
    let mut order: Vec<usize> = (0..planned.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(planned[i].range.len()));
    let non_finite = std::sync::Mutex::new(Vec::new());
    let copy = TensorCopy {
        ck: &ck,
        writer: &writer,
        opts,
        progress,
        non_finite: &non_finite,
    };
    let write_all = || {
        order
            .par_iter()
            .try_for_each(|&i| copy.write_tensor(i, planned[i]))
    };
    let hash_all = || {
        side.par_iter()
            .map(|f| sha256_file(&dir.join(f), f))
            .collect::<Result<Vec<_>>>()
    };
    let (written, hashed) = rayon::join(write_all, hash_all);
    written?;
    let mut metadata = metadata;
    metadata.provenance[0].sources = hashed?;
    writer.replace_metadata(&metadata)?;
    let summary = writer.finish()?;
    progress.finish();
    let seconds = start.elapsed().as_secs_f64();
    Ok(ConvertSummary {
        input: dir.display().to_string(),
        output: opts.output.display().to_string(),
        architecture: config.source_architecture,
        tensors: planned.len(),
        dtypes,
        bytes_in,
        bytes_out: summary.file_len,
        seconds,
        gb_per_s: bytes_in as f64 / seconds / 1e9,
        header_sha256: kiln_format::hex(&summary.header_sha256),
        skipped,
        non_finite: non_finite.into_inner().unwrap_or_else(|e| e.into_inner()),
    })
}

/// The output tensors (each in `dtype`, or its source dtype) and how many there are of
/// each dtype.
fn tensor_specs(
    planned: &[&SourceTensor],
    dtype: Option<DType>,
) -> (Vec<TensorSpec>, std::collections::BTreeMap<String, usize>) {
    let specs: Vec<TensorSpec> = planned
        .iter()
        .map(|t| TensorSpec {
            name: t.name.to_string(),
            dtype: dtype.unwrap_or(t.dtype),
            shape: t.shape.clone(),
        })
        .collect();
    let mut dtypes = std::collections::BTreeMap::new();
    for s in &specs {
        *dtypes.entry(s.dtype.name().to_string()).or_insert(0usize) += 1;
    }
    (specs, dtypes)
}

/// This conversion's provenance step.
fn conversion_step(details: Value, sources: Vec<SourceFile>) -> ProvenanceStep {
    ProvenanceStep {
        tool: format!("kiln-convert {}", env!("CARGO_PKG_VERSION")),
        created: now_rfc3339(),
        details,
        sources,
    }
}

/// The provenance step's details: source and output dtypes, and the tensors skipped.
fn conversion_details(opts: &ConvertOptions, config_text: &str, skipped: &[String]) -> Value {
    json!({
        "conversion": {
            "from": "huggingface-safetensors",
            "source_dtype": hf_config::declared_dtype(&serde_json::from_str(config_text).unwrap_or(Value::Null)),
            "output_dtype": opts.dtype.map(|d| d.name()).unwrap_or("source"),
            "skipped": skipped,
        }
    })
}

/// Refuse, before reading anything, an input that is not a directory, an output inside it
/// that the conversion may read, and a quantized output dtype.
fn check_request(opts: &ConvertOptions) -> Result<()> {
    let dir = &opts.input;
    if !dir.is_dir() {
        return Err(ConvertError::io(
            dir,
            "not a checkpoint directory",
            std::io::Error::new(std::io::ErrorKind::NotFound, "no such directory"),
        ));
    }
    // Every file the conversion may read lies in the checkpoint directory.
    let sources: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| ConvertError::io(dir, "cannot list the directory", e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .collect();
    kiln_format::refuse_output_is_input(&opts.output, sources.iter().map(PathBuf::as_path))?;
    if let Some(d) = opts.dtype {
        if d.is_quantized() {
            return Err(ConvertError::field(
                Path::new("--dtype"),
                "dtype",
                format!("{d} is a quantized type; convert to f32/f16/bf16 and use kiln-quantize"),
            ));
        }
    }
    Ok(())
}

/// Read and resolve `config.json` with `generation_config.json` and, for an embedding model,
/// the sentence-transformers modules.
fn read_config(dir: &Path) -> Result<SourceConfig> {
    let config_path = dir.join("config.json");
    // `exists`, not `is_file`: a FIFO or a device under the name is refused as what it is
    // (without blocking on it) rather than reported missing.
    if !config_path.exists() {
        return Err(ConvertError::MissingFile {
            dir: dir.display().to_string(),
            file: "config.json".into(),
            hint: "is this a Hugging Face model directory?",
        });
    }
    let gen_path = dir.join("generation_config.json");
    let generation = if gen_path.exists() {
        Some(read_json_as(&gen_path, "generation_config.json")?)
    } else {
        None
    };
    let config_text = read_text_as(&config_path, "config.json")?;
    // Resolves and runs the check every reader of the output runs (ModelConfig::check).
    let mut config = hf_config::parse(&config_path, &config_text, generation.as_ref())?;
    // An encoder is an embedding model by itself; a decoder is one when a sentence-transformers
    // `modules.json` says how its token states become a vector (Qwen3-Embedding: last token).
    // (The pooling is the Pooling module's: `read` requires one.)
    let base = config.family.embedding.take().or_else(|| {
        dir.join("modules.json")
            .exists()
            .then(|| kiln_format::EmbeddingSpec::pooled(kiln_format::Pooling::LastToken, false))
    });
    let mut dense_dirs = Vec::new();
    if let Some(base) = base {
        let (spec, dirs) = crate::sentence_transformers::read(dir, base, config.hidden_size)?;
        config.family.embedding = Some(spec);
        dense_dirs = dirs;
    }
    if config.family.attention_mask == kiln_format::AttentionMask::Bidirectional
        && config.family.embedding.is_none()
    {
        return Err(ConvertError::field(
            &config_path,
            "use_bidirectional_attention",
            "true, but the directory has no sentence-transformers modules.json saying how the \
             token states become an embedding; Kiln runs a bidirectional model as an embedding \
             model only",
        ));
    }
    Ok(SourceConfig {
        config_path,
        config_text,
        generation,
        config,
        dense_dirs,
    })
}

/// The layer count against the tensors the checkpoint holds, before the plan lists every
/// tensor the layers imply.
fn check_layer_count(config_path: &Path, config: &ModelConfig, ck: &Checkpoint) -> Result<()> {
    if let Err(need) =
        kiln_format::shapes::check_layer_count(config.num_layers, ck.tensors.len() as u64)
    {
        return Err(ConvertError::field(
            config_path,
            "num_hidden_layers",
            format!(
                "{} layers need at least {need} tensors, but the checkpoint holds {}",
                config.num_layers,
                ck.tensors.len()
            ),
        ));
    }
    Ok(())
}

/// Every file of the checkpoint directory the conversion reads, as provenance names them.
fn side_files(dir: &Path, dense_dirs: &[String], ck: &Checkpoint) -> Vec<String> {
    let mut side: Vec<String> = ["config.json", "generation_config.json"]
        .iter()
        .chain(tokenizer_files::FILES)
        .chain(crate::sentence_transformers::FILES.iter())
        .map(|s| s.to_string())
        .filter(|f| dir.join(f).is_file())
        .collect();
    side.extend(dense_dirs.iter().map(|d| format!("{d}/config.json")));
    side.extend(ck.index_file.clone());
    side.extend(ck.shards.iter().map(|s| s.name.clone()));
    side
}

/// Each file's provenance entry with its size and a fixed-width placeholder checksum.
fn unhashed_sources(dir: &Path, side: &[String]) -> Result<Vec<SourceFile>> {
    side.iter()
        .map(|f| {
            let p = dir.join(f);
            let bytes = std::fs::metadata(&p)
                .map_err(|e| ConvertError::io(&p, "cannot read", e))?
                .len();
            Ok(SourceFile {
                name: f.clone(),
                bytes,
                sha256: "0".repeat(64),
            })
        })
        .collect()
}

impl TensorCopy<'_> {
    /// Copy source tensor `t` to output tensor `i` in chunks, cast to the output dtype,
    /// counting the values that are not finite (refused unless `allow_non_finite`).
    fn write_tensor(&self, i: usize, t: &SourceTensor) -> Result<()> {
        let to = self.writer.spec(i).dtype;
        let mut sink = self.writer.tensor_sink(i)?;
        // 4 MiB of source per chunk: large enough for fast I/O, small for memory.
        const CHUNK_BYTES: usize = 4 << 20;
        let step = CHUNK_BYTES / t.dtype.block_bytes() * t.dtype.block_bytes();
        let shard = &self.ck.shards[t.shard];
        let mut src = vec![0u8; step.min(t.range.len())];
        let mut cast = Vec::new();
        let mut pos = t.range.start;
        let (mut bad, mut first_bad) = (0usize, None);
        while pos < t.range.end {
            let n = step.min(t.range.end - pos);
            let chunk = &mut src[..n];
            shard.read_at(chunk, pos as u64)?;
            let (count, first) = count_non_finite(t.dtype, chunk);
            let elem = (pos - t.range.start) / t.dtype.block_bytes() * t.dtype.block_len();
            bad += count;
            first_bad = first_bad.or(first.map(|f| elem + f));
            if to == t.dtype {
                sink.write(chunk)?;
            } else {
                cast.clear();
                cast_bytes(t.dtype, to, chunk, &mut cast);
                sink.write(&cast)?;
            }
            pos += n;
            self.progress.advance(n as u64, 0);
        }
        if let Some(index) = first_bad {
            let file = shard.path.display().to_string();
            if !self.opts.allow_non_finite {
                return Err(ConvertError::NonFinite {
                    file,
                    tensor: t.source_name.clone(),
                    index,
                    count: bad,
                });
            }
            self.non_finite
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(format!(
                    "{} ({bad} values, first at element {index})",
                    t.source_name
                ));
        }
        sink.finish()?;
        self.progress.advance(0, 1);
        Ok(())
    }
}
