//! Which GGUF bytes become which `.kiln` tensor, in what dtype: every GGUF tensor resolved to
//! its canonical names (a fused one to each of its parts, with the part's place in it), then
//! matched against the tensors the configuration implies.

use std::collections::BTreeMap;

use kiln_format::{expected_tensors, DType, ModelConfig, NormStyle, Role, RopeScaling, TensorName};

use super::super::dequant::DEQUANTIZED;
use super::super::read::{GgufHeader, GgufTensor};
use super::super::rope;
use super::super::value::Value;
use super::ImportOptions;
use crate::error::{ConvertError, Result};
use crate::names::{self, Source};

/// One canonical tensor to write: where its bytes are in the GGUF file, and how they change.
pub(super) struct Planned<'h> {
    pub(super) tensor: &'h GgufTensor,
    /// The bytes of `tensor` this canonical tensor holds: all of them, or one part's rows of
    /// a fused tensor.
    pub(super) bytes: std::ops::Range<usize>,
    /// Its first element's index in `tensor`, for messages.
    pub(super) first_element: usize,
    pub(super) shape: Vec<u64>,
    pub(super) name: TensorName,
    pub(super) dtype: DType,
    pub(super) permute_heads: Option<usize>,
    /// A `(1 + w)` norm weight stored with the 1 added: written as `w`, in f32.
    pub(super) minus_one: bool,
}

/// The whole plan, with what it did to each GGML type (for the summary and the provenance).
pub(super) struct Plan<'h> {
    pub(super) tensors: Vec<Planned<'h>>,
    /// Tensors kept as the GGUF stores them, per GGML type.
    pub(super) kept: BTreeMap<String, usize>,
    /// Matrices dequantized to the requested float dtype, per GGML type.
    pub(super) dequantized: BTreeMap<String, usize>,
    /// 1-D tensors in a block type decoded to f32, per GGML type.
    pub(super) vectors_to_f32: BTreeMap<String, usize>,
}

/// Each canonical name the file holds: the GGUF tensor, the part of it, and its part count.
pub(super) type ByName<'h> = BTreeMap<TensorName, (&'h GgufTensor, usize, usize)>;

/// The GGML types an import keeps as they are (Kiln's own dtypes), by name, for messages.
fn kept_type_names() -> String {
    kiln_format::DType::ALL
        .iter()
        .filter(|d| d.logical() == **d)
        .map(|d| super::super::types::GgmlType::of(*d).name)
        .collect::<Vec<_>>()
        .join(", ")
}

/// `t` in a GGML type Kiln neither keeps nor decodes: refused, naming the type.
fn check_type(file: &str, t: &GgufTensor) -> Result<()> {
    if t.ggml_type.kiln_dtype().is_none() && !DEQUANTIZED.contains(&t.ggml_type.name) {
        return Err(ConvertError::UnsupportedGgufType {
            file: file.into(),
            tensor: t.name.clone(),
            ggml_type: t.ggml_type.name.into(),
            kept: kept_type_names(),
            dequantized: DEQUANTIZED.join(", "),
        });
    }
    Ok(())
}

/// Every tensor of the file by canonical name, but the rope factor tensors the configuration
/// already folded in; an unknown tensor, a type Kiln cannot read, or a weight spelled twice is
/// refused.
pub(super) fn resolve_tensors<'h>(
    file: &str,
    h: &'h GgufHeader,
    config: &ModelConfig,
) -> Result<ByName<'h>> {
    let spec = config.architecture.spec();
    let longrope =
        spec.longrope && matches!(config.rope_scaling, Some(RopeScaling::LongRope { .. }));
    let rope_freqs = !spec.partial_rotary() && config.rope_scaling.is_some();
    let mut by_name: ByName<'h> = BTreeMap::new();
    for t in &h.tensors {
        let folded = match t.name.as_str() {
            "rope_freqs.weight" => rope_freqs,
            rope::LONGROPE_LONG | rope::LONGROPE_SHORT => longrope,
            _ => false,
        };
        if folded {
            continue; // folded into the configuration
        }
        // Every tensor left is imported (or refused as unknown): its type is checked here.
        check_type(file, t)?;
        let parts =
            match names::fused_parts(Source::Gguf, config.architecture, &t.name) {
                Some(parts) => parts,
                None => vec![names::canonical(Source::Gguf, config.architecture, &t.name)
                    .ok_or_else(|| ConvertError::UnknownTensor {
                        path: file.into(),
                        tensor: t.name.clone(),
                        arch: config.source_architecture.clone(),
                    })?],
            };
        let n = parts.len();
        for (i, name) in parts.into_iter().enumerate() {
            if let Some((other, _, _)) = by_name.insert(name, (t, i, n)) {
                return Err(ConvertError::GgufTensor {
                    file: file.into(),
                    tensor: t.name.clone(),
                    reason: format!(
                        "holds {name}, which `{}` holds too: a file spells each weight once, \
                         fused or split as llama.cpp's `{}` loader reads it",
                        other.name,
                        h.get("general.architecture")
                            .and_then(Value::as_str)
                            .unwrap_or("?")
                    ),
                });
            }
        }
    }
    Ok(by_name)
}

/// Plan every tensor the configuration implies from `by_name`; a missing tensor, a wrong
/// shape or a tensor left over is refused.
pub(super) fn plan<'h>(
    file: &str,
    config: &ModelConfig,
    mut by_name: ByName<'h>,
    opts: &ImportOptions,
) -> Result<Plan<'h>> {
    let mut plan = Plan {
        tensors: Vec::new(),
        kept: BTreeMap::new(),
        dequantized: BTreeMap::new(),
        vectors_to_f32: BTreeMap::new(),
    };
    for (name, shape) in expected_tensors(config) {
        let (t, part, of) = by_name
            .remove(&name)
            .ok_or_else(|| ConvertError::MissingTensor {
                dir: file.into(),
                tensor: names::source_name(Source::Gguf, config.architecture, name),
                expected: shape.clone(),
            })?;
        let planned = plan_one(file, config, name, shape, (t, part, of), opts, &mut plan)?;
        plan.tensors.push(planned);
    }
    if let Some((name, (t, _, _))) = by_name.into_iter().next() {
        return Err(ConvertError::UnknownTensor {
            path: file.into(),
            tensor: format!("{} ({name})", t.name),
            arch: format!(
                "{} ({} layers, tie_word_embeddings {})",
                config.source_architecture, config.num_layers, config.tie_word_embeddings
            ),
        });
    }
    Ok(plan)
}

/// One canonical tensor `name` of `shape`, held by part `part` of the `of` parts of `t`: its
/// dtype (counted in `plan`'s tallies), its bytes in `t`, and the row reordering and norm
/// offset it needs.
fn plan_one<'h>(
    file: &str,
    config: &ModelConfig,
    name: TensorName,
    shape: Vec<u64>,
    (t, part, of): (&'h GgufTensor, usize, usize),
    opts: &ImportOptions,
    plan: &mut Plan<'h>,
) -> Result<Planned<'h>> {
    let spec = config.architecture.spec();
    let (fused_shape, rows_before) = fused_place(file, config, &shape, t, part, of)?;
    // llama.cpp's converter stores `(1 + w)` norm weights with the 1 added.
    let minus_one = spec.norm_style == NormStyle::OnePlusWeight && name.role.is_norm();
    let own = t.ggml_type.kiln_dtype();
    check_type(file, t)?;
    let quantized = own.is_none_or(|d| d.is_quantized());
    let tally =
        |m: &mut BTreeMap<String, usize>| *m.entry(t.ggml_type.name.to_string()).or_default() += 1;
    let dtype = match own {
        _ if minus_one => DType::F32,
        // The runner reads norms and biases as floats; a block type's values are f32s.
        _ if quantized && shape.len() != 2 => {
            tally(&mut plan.vectors_to_f32);
            DType::F32
        }
        Some(d) if !(opts.dequantize_all && quantized) => {
            tally(&mut plan.kept);
            d.storage_for(&shape)
        }
        _ => {
            tally(&mut plan.dequantized);
            opts.dequantize_to
        }
    };
    if t.shape() != fused_shape {
        return Err(ConvertError::ShapeMismatch {
            path: file.into(),
            tensor: t.name.clone(),
            found: t.shape(),
            expected: fused_shape,
        });
    }
    let (bytes, first_element) = part_bytes(file, t, &shape, rows_before)?;
    // llama.cpp's converter reorders q/k rows for the families whose rope needs it.
    let permute = spec.gguf.permute_qk;
    let permute_heads = match name.role {
        Role::AttnQ if permute => Some(config.num_heads as usize),
        Role::AttnK if permute => Some(config.num_kv_heads as usize),
        _ => None,
    };
    Ok(Planned {
        tensor: t,
        bytes,
        first_element,
        shape,
        name,
        dtype,
        permute_heads,
        minus_one,
    })
}

/// A fused tensor stacks its parts' rows: its shape is theirs with the rows summed, and part
/// `part`'s rows follow those of the parts before it. `(the GGUF tensor's expected shape, rows
/// before this part)`.
fn fused_place(
    file: &str,
    config: &ModelConfig,
    shape: &[u64],
    t: &GgufTensor,
    part: usize,
    of: usize,
) -> Result<(Vec<u64>, u64)> {
    if of == 1 {
        return Ok((shape.to_vec(), 0));
    }
    let parts = names::fused_parts(Source::Gguf, config.architecture, &t.name).unwrap_or_default();
    let shapes: Vec<Vec<u64>> = parts
        .iter()
        .filter_map(|n| kiln_format::shapes::expected_shape(config, *n))
        .collect();
    if shapes.len() != of {
        return Err(ConvertError::UnknownTensor {
            path: file.into(),
            tensor: format!("{} (fused {})", t.name, parts.len()),
            arch: format!(
                "{} (attention_bias {})",
                config.source_architecture, config.attention_bias
            ),
        });
    }
    let mut fused = shape.to_vec();
    fused[0] = shapes.iter().map(|s| s[0]).sum();
    Ok((fused, shapes[..part].iter().map(|s| s[0]).sum::<u64>()))
}

/// The byte range of `t` holding the part of `shape` after `rows_before` rows (all of `t`
/// unless it is fused), and its first element's index. The part's elements must be whole
/// blocks: the reader checked that the tensor's rows are, and a matrix part is whole rows,
/// but a part of a fused 1-D tensor in a block type need not be.
fn part_bytes(
    file: &str,
    t: &GgufTensor,
    shape: &[u64],
    rows_before: u64,
) -> Result<(std::ops::Range<usize>, usize)> {
    let row_elems: u64 = shape[1..].iter().product();
    let (first, count) = (rows_before * row_elems, shape[0] * row_elems);
    let (block_len, block_bytes) = (t.ggml_type.block_len, t.ggml_type.block_bytes);
    if !first.is_multiple_of(block_len) || !count.is_multiple_of(block_len) {
        return Err(ConvertError::GgufTensor {
            file: file.into(),
            tensor: t.name.clone(),
            reason: format!(
                "its {} blocks of {block_len} weights do not split into its parts ({} \
                 elements from element {first})",
                t.ggml_type.name, count
            ),
        });
    }
    let start = first / block_len * block_bytes;
    let bytes = usize::try_from(start)
        .ok()
        .zip(usize::try_from(start + count / block_len * block_bytes).ok())
        .map(|(a, b)| a..b)
        .ok_or_else(|| ConvertError::GgufTensor {
            file: file.into(),
            tensor: t.name.clone(),
            reason: "too large for this machine's address space".into(),
        })?;
    Ok((bytes, usize::try_from(first).unwrap_or(usize::MAX)))
}
