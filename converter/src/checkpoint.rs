//! A Hugging Face checkpoint directory: its files, its (possibly sharded) safetensors, memory
//! mapped, and the tensor list resolved to canonical names.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

use kiln_format::{DType, Role, TensorName};
use memmap2::Mmap;
use safetensors::{Dtype as StDtype, SafeTensors};
use serde_json::Value;

use crate::error::{ConvertError, Result};
use crate::names::{self, Source};

/// Largest side file read (config, generation config, tokenizer files, chat template, shard
/// index): what is kept of them goes into the output's metadata, which holds at most this
/// (tokenizers are the big ones, tens of MB).
pub const MAX_SIDE_FILE: u64 = kiln_format::layout::MAX_METADATA_LEN;
/// Most shards accepted from an index.
const MAX_SHARDS: usize = 10_000;

/// One memory-mapped safetensors file.
pub struct Shard {
    /// Full path.
    pub path: PathBuf,
    /// File name relative to the checkpoint directory.
    pub name: String,
    file: File,
    map: Mmap,
}

impl std::fmt::Debug for Shard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shard").field("path", &self.path).finish()
    }
}

impl Shard {
    fn open(dir: &Path, name: &str) -> Result<Shard> {
        let path = dir.join(name);
        // A FIFO or a device named as a shard is refused without blocking on it.
        let file = kiln_format::open_regular(&path, "safetensors file")?;
        // SAFETY: read-only private map; the checkpoint must not be modified while it is
        // being converted (the same contract as every memory-mapped model loader).
        let map =
            unsafe { Mmap::map(&file) }.map_err(|e| ConvertError::io(&path, "cannot map", e))?;
        Ok(Shard {
            path,
            name: name.to_string(),
            file,
            map,
        })
    }

    /// The whole file.
    pub fn bytes(&self) -> &[u8] {
        &self.map
    }

    /// Read `buf.len()` bytes at `offset` with a positioned read.
    ///
    /// Bulk tensor data is read this way rather than through the map so that a conversion's
    /// resident memory stays at its chunk buffers instead of growing to the model's size.
    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        kiln_format::io::read_exact_at(&self.file, buf, offset)
            .map_err(|e| ConvertError::io(&self.path, "cannot read", e))
    }

    fn parse(&self) -> Result<SafeTensors<'_>> {
        SafeTensors::deserialize(&self.map).map_err(|e| ConvertError::Safetensors {
            path: self.path.display().to_string(),
            reason: e.to_string(),
        })
    }
}

/// A source tensor resolved to its canonical name.
#[derive(Debug, Clone)]
pub struct SourceTensor {
    /// Canonical name.
    pub name: TensorName,
    /// Name in the source file.
    pub source_name: String,
    /// Index into [`Checkpoint::shards`].
    pub shard: usize,
    /// Element type.
    pub dtype: DType,
    /// Shape.
    pub shape: Vec<u64>,
    /// Byte range within the shard file.
    pub range: std::ops::Range<usize>,
}

/// An opened checkpoint directory.
#[derive(Debug)]
pub struct Checkpoint {
    /// The directory.
    pub dir: PathBuf,
    /// Its safetensors files.
    pub shards: Vec<Shard>,
    /// Its tensors, by canonical name.
    pub tensors: BTreeMap<TensorName, SourceTensor>,
    /// Source tensors that were skipped as derived buffers.
    pub skipped: Vec<String>,
    /// The index file, if the checkpoint is sharded.
    pub index_file: Option<String>,
}

/// Read a side file as text: a regular file (a FIFO or a device is refused without blocking)
/// of at most [`MAX_SIDE_FILE`] bytes (refused by its size before anything is allocated).
pub fn read_text(path: &Path) -> Result<String> {
    read_text_as(path, "checkpoint side file")
}

/// [`read_text`], naming what the file should be (`config.json`) in its errors.
pub fn read_text_as(path: &Path, what: &'static str) -> Result<String> {
    Ok(kiln_format::read_text_bounded(path, MAX_SIDE_FILE, what)?)
}

/// Read and parse a JSON side file.
pub fn read_json(path: &Path) -> Result<Value> {
    read_json_as(path, "checkpoint side file")
}

/// [`read_json`], naming what the file should be in its errors.
pub fn read_json_as(path: &Path, what: &'static str) -> Result<Value> {
    serde_json::from_str(&read_text_as(path, what)?).map_err(|e| ConvertError::Json {
        path: path.display().to_string(),
        reason: e.to_string(),
    })
}

fn dtype_of(d: StDtype) -> Option<DType> {
    match d {
        StDtype::F32 => Some(DType::F32),
        StDtype::F16 => Some(DType::F16),
        StDtype::BF16 => Some(DType::BF16),
        _ => None,
    }
}

impl SourceTensor {
    /// Tensor `name` of shard `shard` (at `path`, mapped at address `base`) as `view` shows
    /// it: its dtype (refused by name when Kiln reads no such dtype), shape and byte range.
    /// Its canonical name is a placeholder for the caller to set.
    fn locate(
        path: &Path,
        shard: usize,
        base: usize,
        name: &str,
        view: &safetensors::tensor::TensorView<'_>,
    ) -> Result<SourceTensor> {
        let dtype = dtype_of(view.dtype()).ok_or_else(|| ConvertError::UnsupportedDtype {
            path: path.display().to_string(),
            tensor: name.to_string(),
            dtype: format!("{:?}", view.dtype()),
        })?;
        let data = view.data();
        let start = data.as_ptr() as usize - base;
        Ok(SourceTensor {
            name: TensorName::global(Role::Embed),
            source_name: name.to_string(),
            shard,
            dtype,
            shape: view.shape().iter().map(|&d| d as u64).collect(),
            range: start..start + data.len(),
        })
    }
}

impl Checkpoint {
    /// Find and map the weight files of `dir` and resolve every tensor's canonical name.
    ///
    /// `config` names the family (whose spellings apply) and the class named in messages.
    /// `dense_dirs` are the embedding model's `Dense` module directories, in order: each
    /// `model.safetensors` there holds `linear.weight` (and `linear.bias`).
    pub fn open(
        dir: &Path,
        config: &kiln_format::ModelConfig,
        dense_dirs: &[String],
    ) -> Result<Checkpoint> {
        let arch = config.source_architecture.as_str();
        let index_path = dir.join("model.safetensors.index.json");
        let WeightFiles {
            files,
            index_map,
            index_file,
        } = weight_files(dir, &index_path)?;
        let mut shards = files
            .iter()
            .map(|f| Shard::open(dir, f))
            .collect::<Result<Vec<_>>>()?;
        let mut tensors: BTreeMap<TensorName, SourceTensor> = BTreeMap::new();
        let mut skipped = Vec::new();
        let mut seen: HashMap<String, usize> = HashMap::new();
        for (si, shard) in shards.iter().enumerate() {
            let st = shard.parse()?;
            let base = shard.bytes().as_ptr() as usize;
            for (name, view) in st.tensors() {
                if let Some(&prev) = seen.get(&name) {
                    return Err(ConvertError::DuplicateTensor {
                        tensor: name,
                        first: shards[prev].path.display().to_string(),
                        second: shard.path.display().to_string(),
                    });
                }
                seen.insert(name.clone(), si);
                if let Some(map) = &index_map {
                    check_listed(&index_path, map, &name, &shard.name)?;
                }
                if names::is_ignorable_hf(&name) {
                    skipped.push(name);
                    continue;
                }
                let located = SourceTensor::locate(&shard.path, si, base, &name, &view)?;
                for t in resolve_names(&located, config, &shard.path)? {
                    insert_new(&mut tensors, &shards, t, &shard.path)?;
                }
            }
        }
        if let Some(map) = &index_map {
            check_all_stored(&index_path, map, &seen)?;
        }
        add_dense_modules(dir, dense_dirs, arch, &mut shards, &mut tensors)?;
        Ok(Checkpoint {
            dir: dir.to_path_buf(),
            shards,
            tensors,
            skipped,
            index_file,
        })
    }

    /// The bytes of a source tensor.
    pub fn bytes(&self, t: &SourceTensor) -> &[u8] {
        &self.shards[t.shard].bytes()[t.range.clone()]
    }
}

/// The weight files of a checkpoint directory.
struct WeightFiles {
    /// One `model.safetensors`, or the shards its index lists.
    files: Vec<String>,
    /// The index's weight_map (tensor → shard), when sharded.
    index_map: Option<HashMap<String, String>>,
    /// The index's file name, when sharded.
    index_file: Option<String>,
}

/// Find the weight files of `dir`: its index (at `index_path`) and the shards it lists, or
/// one `model.safetensors`.
fn weight_files(dir: &Path, index_path: &Path) -> Result<WeightFiles> {
    if index_path.is_file() {
        let (files, map) = read_index(dir, index_path)?;
        Ok(WeightFiles {
            files,
            index_map: Some(map),
            index_file: Some("model.safetensors.index.json".to_string()),
        })
    } else if dir.join("model.safetensors").is_file() {
        Ok(WeightFiles {
            files: vec!["model.safetensors".to_string()],
            index_map: None,
            index_file: None,
        })
    } else {
        Err(ConvertError::MissingFile {
            dir: dir.display().to_string(),
            file: "model.safetensors or model.safetensors.index.json".into(),
            hint: "Kiln converts checkpoints saved as safetensors (save_pretrained(..., safe_serialization=True))",
        })
    }
}

/// Tensor `name`, found in shard `shard_name`, is listed there by the index's weight_map.
fn check_listed(
    index_path: &Path,
    map: &HashMap<String, String>,
    name: &str,
    shard_name: &str,
) -> Result<()> {
    match map.get(name) {
        Some(f) if *f == shard_name => Ok(()),
        Some(f) => Err(ConvertError::ShardIndex {
            path: index_path.display().to_string(),
            reason: format!("tensor `{name}` is listed in {f} but stored in {shard_name}"),
        }),
        None => Err(ConvertError::ShardIndex {
            path: index_path.display().to_string(),
            reason: format!("tensor `{name}` in {shard_name} is not in the weight_map"),
        }),
    }
}

/// Every tensor the index's weight_map lists was found in a shard.
fn check_all_stored(
    index_path: &Path,
    map: &HashMap<String, String>,
    seen: &HashMap<String, usize>,
) -> Result<()> {
    if let Some(missing) = map.keys().find(|k| !seen.contains_key(*k)) {
        return Err(ConvertError::ShardIndex {
            path: index_path.display().to_string(),
            reason: format!(
                "tensor `{missing}` is listed in the weight_map but not stored in {}",
                map[missing]
            ),
        });
    }
    Ok(())
}

/// The canonical tensor(s) a located source tensor stands for: one, or the parts of a fused
/// tensor split by rows. A name no spelling of the family knows is refused.
fn resolve_names(
    located: &SourceTensor,
    config: &kiln_format::ModelConfig,
    shard_path: &Path,
) -> Result<Vec<SourceTensor>> {
    let name = &located.source_name;
    let source = |canon: TensorName| SourceTensor {
        name: canon,
        ..located.clone()
    };
    // A bare decoder backbone (what `AutoModel` saves: Qwen3-Embedding, for one)
    // spells its tensors without the `model.` prefix.
    let bare = (!config.architecture.spec().encoder && !name.starts_with("model."))
        .then(|| format!("model.{name}"));
    let spellings = [Some(name.as_str()), bare.as_deref()];
    let family = config.architecture;
    Ok(
        match spellings
            .iter()
            .flatten()
            .find_map(|n| names::canonical(Source::HuggingFace, family, n))
        {
            Some(canon) => vec![source(canon)],
            None => match spellings
                .iter()
                .flatten()
                .find_map(|n| names::fused_parts(names::Source::HuggingFace, family, n))
            {
                Some(parts) => split_rows(&source(parts[0]), &parts, config, shard_path)?,
                None => {
                    return Err(ConvertError::UnknownTensor {
                        path: shard_path.display().to_string(),
                        tensor: name.clone(),
                        arch: config.source_architecture.clone(),
                    })
                }
            },
        },
    )
}

/// Add `t` (from the shard at `shard_path`) under its canonical name, refusing a second
/// source tensor for the same name.
fn insert_new(
    tensors: &mut BTreeMap<TensorName, SourceTensor>,
    shards: &[Shard],
    t: SourceTensor,
    shard_path: &Path,
) -> Result<()> {
    if let Some(prev) = tensors.get(&t.name) {
        return Err(ConvertError::DuplicateTensor {
            tensor: t.name.to_string(),
            first: format!(
                "`{}` in {}",
                prev.source_name,
                shards[prev.shard].path.display()
            ),
            second: format!("`{}` in {}", t.source_name, shard_path.display()),
        });
    }
    tensors.insert(t.name, t);
    Ok(())
}

/// Map each sentence-transformers Dense module's `model.safetensors` (after the model's own
/// shards) and add its `linear.weight` and `linear.bias` under the module's roles.
fn add_dense_modules(
    dir: &Path,
    dense_dirs: &[String],
    arch: &str,
    shards: &mut Vec<Shard>,
    tensors: &mut BTreeMap<TensorName, SourceTensor>,
) -> Result<()> {
    for (k, sub) in dense_dirs.iter().enumerate() {
        let shard = Shard::open(dir, &format!("{sub}/model.safetensors"))?;
        let (weight, bias) = Role::dense(k).ok_or_else(|| ConvertError::UnknownTensor {
            path: shard.path.display().to_string(),
            tensor: "linear.weight".into(),
            arch: format!("{arch} (more Dense modules than Kiln implements)"),
        })?;
        let st = shard.parse()?;
        let base = shard.bytes().as_ptr() as usize;
        for (name, view) in st.tensors() {
            let role = match name.as_str() {
                "linear.weight" => weight,
                "linear.bias" => bias,
                _ => {
                    return Err(ConvertError::UnknownTensor {
                        path: shard.path.display().to_string(),
                        tensor: name,
                        arch: "a Dense module (linear.weight, linear.bias)".into(),
                    })
                }
            };
            let t = SourceTensor {
                name: TensorName::global(role),
                source_name: format!("{sub}/{name}"),
                ..SourceTensor::locate(&shard.path, shards.len(), base, &name, &view)?
            };
            tensors.insert(t.name, t);
        }
        drop(st);
        shards.push(shard);
    }
    Ok(())
}

/// The parts of a fused tensor `whole` (named as its first part; `[part; part; …]` by rows):
/// each part's rows are its expected
/// shape's first dimension, the columns shared. A fused tensor of the wrong shape is refused
/// here, naming it, rather than as a mis-shaped part later.
fn split_rows(
    whole: &SourceTensor,
    parts: &[TensorName],
    config: &kiln_format::ModelConfig,
    path: &Path,
) -> Result<Vec<SourceTensor>> {
    // Each part's shape from its name: the full list is not built before the layer count
    // is bounded by the checkpoint's tensors.
    let shapes: Vec<Vec<u64>> = parts
        .iter()
        .map(|p| {
            kiln_format::shapes::expected_shape(config, *p).ok_or_else(|| {
                ConvertError::UnknownTensor {
                    path: path.display().to_string(),
                    tensor: whole.source_name.clone(),
                    arch: format!(
                        "{} ({} layers)",
                        config.source_architecture, config.num_layers
                    ),
                }
            })
        })
        .collect::<Result<_>>()?;
    let cols = shapes[0][1];
    let rows: u64 = shapes.iter().map(|s| s[0]).sum();
    if whole.shape != [rows, cols] {
        return Err(ConvertError::ShapeMismatch {
            path: path.display().to_string(),
            tensor: format!(
                "{} (fused {})",
                whole.source_name,
                parts
                    .iter()
                    .map(|p| p.role.suffix())
                    .collect::<Vec<_>>()
                    .join(" + ")
            ),
            found: whole.shape.clone(),
            expected: vec![rows, cols],
        });
    }
    // Row-major: each part is a contiguous byte range of the fused tensor.
    let row_bytes = cols as usize * whole.dtype.block_bytes() / whole.dtype.block_len();
    let mut start = whole.range.start;
    Ok(parts
        .iter()
        .zip(shapes)
        .map(|(&name, shape)| {
            let len = shape[0] as usize * row_bytes;
            let first_row = (start - whole.range.start) / row_bytes;
            let t = SourceTensor {
                name,
                source_name: format!(
                    "{} (rows {first_row}..{})",
                    whole.source_name,
                    first_row + shape[0] as usize
                ),
                shard: whole.shard,
                dtype: whole.dtype,
                shape,
                range: start..start + len,
            };
            start += len;
            t
        })
        .collect())
}

fn read_index(dir: &Path, index_path: &Path) -> Result<(Vec<String>, HashMap<String, String>)> {
    let v = read_json(index_path)?;
    let bad = |reason: String| ConvertError::ShardIndex {
        path: index_path.display().to_string(),
        reason,
    };
    let wm = v
        .get("weight_map")
        .and_then(Value::as_object)
        .ok_or_else(|| bad("no `weight_map` object".into()))?;
    let mut map = HashMap::with_capacity(wm.len());
    let mut files: Vec<String> = Vec::new();
    for (tensor, file) in wm {
        let file = file
            .as_str()
            .ok_or_else(|| bad(format!("weight_map[`{tensor}`] is not a file name")))?;
        // Shard names are plain file names inside the checkpoint directory.
        if file.is_empty() || file.contains('/') || file.contains('\\') || file == ".." {
            return Err(bad(format!(
                "weight_map[`{tensor}`] = `{file}` is not a file name in the checkpoint directory"
            )));
        }
        if !files.iter().any(|f| f == file) {
            files.push(file.to_string());
            if files.len() > MAX_SHARDS {
                return Err(bad(format!("more than {MAX_SHARDS} shard files")));
            }
        }
        map.insert(tensor.clone(), file.to_string());
    }
    files.sort();
    for f in &files {
        if !dir.join(f).is_file() {
            return Err(bad(format!(
                "names shard `{f}`, which does not exist in {}",
                dir.display()
            )));
        }
    }
    Ok((files, map))
}
