//! The tensors an export writes: llama.cpp's names, GGML's dimension order, fused parts
//! stacked back by rows, 1-D tensors widened to F32, q/k rows reordered where the family's
//! rope needs it, and the rope factor tensors computed from the configuration.

use std::borrow::Cow;
use std::collections::BTreeMap;

use kiln_format::values::{cast_bytes, decode_rows_f32};
use kiln_format::{
    DType, KilnFile, ModelConfig, NormStyle, Role, RopeScaling, TensorInfo, TensorName,
};

use super::super::rope::{self, Direction};
use super::super::types::GgmlType;
use super::export_error;
use crate::error::Result;
use crate::names::{self, Source};
use crate::Progress;

/// One tensor as it will be written.
pub(super) struct Plan {
    /// The `.kiln` tensors it holds, stacked by rows in this order: one, or the parts of a
    /// tensor llama.cpp keeps fused; none for a tensor computed from the configuration.
    pub(super) sources: Vec<usize>,
    /// The F32 values of a tensor computed from the configuration (rope factors).
    data: Vec<f32>,
    pub(super) gguf_name: String,
    pub(super) ggml_type: GgmlType,
    pub(super) dims: Vec<u64>,
    permute_heads: Option<usize>,
    widen: bool,
    /// A `(1 + w)` norm weight `w`, written as `1 + w` in F32 as llama.cpp's converter writes
    /// it.
    plus_one: bool,
}

impl Plan {
    /// A 1-D F32 tensor of values computed from the configuration.
    fn computed(gguf_name: &str, data: Vec<f32>) -> Plan {
        Plan {
            sources: Vec::new(),
            gguf_name: gguf_name.into(),
            ggml_type: GgmlType::of(DType::F32),
            dims: vec![data.len() as u64],
            data,
            permute_heads: None,
            widen: false,
            plus_one: false,
        }
    }
}

/// One `.kiln` tensor's bytes as `p` writes them: GGML's row-major layout, widened to F32 (and
/// `1 +` for `(1 + w)` norms) where `p` says, q/k rows reordered for llama.cpp's rope where it
/// says.
fn tensor_bytes<'f>(
    f: &'f KilnFile,
    info: &'f TensorInfo,
    p: &Plan,
    label: &str,
) -> Result<Cow<'f, [u8]>> {
    let view = f.view(info);
    let mut bytes = Cow::Borrowed(view.bytes());
    if info.dtype != info.dtype.logical() {
        // A Kiln-only layout: back to GGML's row-major blocks.
        let cols = info.shape.last().copied().unwrap_or(1) as usize;
        bytes = Cow::Owned(info.dtype.from_storage(cols, &bytes).into_owned());
    }
    if p.widen {
        let mut out = Vec::new();
        if info.dtype.is_quantized() {
            // A 1-D tensor in a block type: its values, which are f32s.
            let n = usize::try_from(info.shape.iter().product::<u64>()).map_err(|_| {
                export_error(
                    label,
                    format!("tensor `{}`", info.name),
                    "too large for this machine",
                )
            })?;
            let mut x = vec![0f32; n];
            decode_rows_f32(info.dtype.logical(), n, &bytes, &mut x);
            out.extend(x.iter().flat_map(|v| v.to_le_bytes()));
        } else {
            cast_bytes(info.dtype, DType::F32, &bytes, &mut out);
        }
        if p.plus_one {
            // In f32, as llama.cpp's converter adds it.
            for v in out.chunks_exact_mut(4) {
                let x = f32::from_le_bytes([v[0], v[1], v[2], v[3]]) + 1.0;
                v.copy_from_slice(&x.to_le_bytes());
            }
        }
        bytes = Cow::Owned(out);
    }
    if let Some(n_head) = p.permute_heads {
        let cols = info.shape.last().copied().unwrap_or(0);
        // The bytes are row-major by now, in the dtype GGML knows.
        let row_bytes = info
            .dtype
            .logical()
            .byte_len(&[cols])
            .map_err(|r| export_error(label, format!("tensor `{}`", info.name), r))?;
        let permuted = rope::permute_rows(&bytes, row_bytes as usize, n_head, Direction::ToGguf)
            .map_err(|r| export_error(label, format!("tensor `{}`", info.name), r))?;
        bytes = Cow::Owned(permuted);
    }
    Ok(bytes)
}

/// Every tensor an export writes, in order, and what planning them found.
pub(super) struct Tensors {
    pub(super) plans: Vec<Plan>,
    /// 1-D tensors widened to F32.
    pub(super) widened: usize,
    /// Bytes of the matrices per logical dtype, for `general.file_type`.
    pub(super) matrix_bytes: BTreeMap<DType, u64>,
}

/// The rope factor tensors llama.cpp reads: Llama 3's `rope_freqs`, LongRoPE's long and short
/// factors (one divisor per rotated pair, in f32 as llama.cpp's converter writes them).
fn rope_factor_plans(c: &ModelConfig) -> Vec<Plan> {
    let mut plans = Vec::new();
    if let Some(factors) = c
        .rope_scaling
        .as_ref()
        .and_then(|s| rope::llama3_factors(s, c.rope_theta, c.head_dim))
    {
        plans.push(Plan::computed("rope_freqs.weight", factors));
    }
    if let Some(RopeScaling::LongRope {
        long_factor,
        short_factor,
        ..
    }) = &c.rope_scaling
    {
        for (gguf_name, fs) in [
            (rope::LONGROPE_LONG, long_factor),
            (rope::LONGROPE_SHORT, short_factor),
        ] {
            plans.push(Plan::computed(
                gguf_name,
                fs.iter().map(|&x| x as f32).collect(),
            ));
        }
    }
    plans
}

/// Plan every tensor of `f` (a model configured as `c`; `label` names it in errors).
pub(super) fn plan(f: &KilnFile, c: &ModelConfig, label: &str) -> Result<Tensors> {
    let spec = c.architecture.spec();
    let permute = spec.gguf.permute_qk;
    let mut plans = rope_factor_plans(c);
    let mut widened = 0usize;
    let mut matrix_bytes: BTreeMap<DType, u64> = BTreeMap::new();
    let mut planned = vec![false; f.tensors().len()];
    for (i, info) in f.tensors().iter().enumerate() {
        if planned[i] {
            continue; // a part of a fused tensor planned with its first part
        }
        let tn = TensorName::parse(&info.name).ok_or_else(|| {
            export_error(
                label,
                format!("tensor `{}`", info.name),
                "not a canonical Kiln tensor name, so its llama.cpp name is unknown",
            )
        })?;
        let gguf_name = names::source_name(Source::Gguf, c.architecture, tn);
        let sources = fused_sources(f, c, label, i, &gguf_name)?;
        let dims = dims(f, label, &sources, &gguf_name)?;
        for &j in &sources {
            planned[j] = true;
            if info.shape.len() == 2 {
                *matrix_bytes.entry(info.dtype.logical()).or_default() += f.tensors()[j].len;
            }
        }
        let plus_one = spec.norm_style == NormStyle::OnePlusWeight && tn.role.is_norm();
        let widen = info.shape.len() == 1 && info.dtype != DType::F32;
        widened += if widen { sources.len() } else { 0 };
        let permute_heads = match tn.role {
            Role::AttnQ if permute => Some(c.num_heads as usize),
            Role::AttnK if permute => Some(c.num_kv_heads as usize),
            _ => None,
        };
        plans.push(Plan {
            sources,
            data: Vec::new(),
            gguf_name,
            ggml_type: GgmlType::of(if widen { DType::F32 } else { info.dtype }),
            dims,
            permute_heads,
            widen: widen || plus_one,
            plus_one,
        });
    }
    Ok(Tensors {
        plans,
        widened,
        matrix_bytes,
    })
}

/// The `.kiln` tensors llama.cpp's `gguf_name` holds: tensor `i` alone, or, when the family
/// stores it fused, each of its parts in row order.
fn fused_sources(
    f: &KilnFile,
    c: &ModelConfig,
    label: &str,
    i: usize,
    gguf_name: &str,
) -> Result<Vec<usize>> {
    let info = &f.tensors()[i];
    match names::fused_parts(Source::Gguf, c.architecture, gguf_name) {
        None => Ok(vec![i]),
        Some(parts) => parts
            .iter()
            .map(|part| {
                let want = part.to_string();
                f.tensors()
                    .iter()
                    .position(|t| t.name == want)
                    .ok_or_else(|| {
                        export_error(
                            label,
                            format!("tensor `{}`", info.name),
                            format!(
                                "llama.cpp's `{gguf_name}` holds it with `{want}`, which the \
                                 file lacks"
                            ),
                        )
                    })
            })
            .collect(),
    }
}

/// GGML's dimensions (innermost first) of the tensor stacking `sources` by rows; the parts
/// must share a dtype and a row width.
fn dims(f: &KilnFile, label: &str, sources: &[usize], gguf_name: &str) -> Result<Vec<u64>> {
    let info = &f.tensors()[sources[0]];
    let mut dims: Vec<u64> = info.shape.iter().rev().copied().collect();
    if let [_, rest @ ..] = sources {
        let mut rows = info.shape.first().copied().unwrap_or(0);
        for &j in rest {
            let x = &f.tensors()[j];
            if x.dtype.logical() != info.dtype.logical() || x.shape[1..] != info.shape[1..] {
                return Err(export_error(
                    label,
                    format!("tensor `{}`", x.name),
                    format!(
                        "it is {} {:?} and `{}` is {} {:?}, but llama.cpp holds both in \
                         `{gguf_name}`, one type and one row width (quantize them alike)",
                        x.dtype.name(),
                        x.shape,
                        info.name,
                        info.dtype.name(),
                        info.shape
                    ),
                ));
            }
            rows += x.shape.first().copied().unwrap_or(0);
        }
        if let Some(last) = dims.last_mut() {
            *last = rows;
        }
    }
    Ok(dims)
}

/// The bytes `p` writes: its computed values, or its sources' bytes one after the other.
pub(super) fn data<'f>(
    f: &'f KilnFile,
    p: &Plan,
    label: &str,
    progress: &dyn Progress,
) -> Result<Cow<'f, [u8]>> {
    if p.sources.is_empty() {
        return Ok(Cow::Owned(
            p.data.iter().flat_map(|x| x.to_le_bytes()).collect(),
        ));
    }
    let mut out: Option<Cow<[u8]>> = None;
    for &src in &p.sources {
        let info = &f.tensors()[src];
        let bytes = tensor_bytes(f, info, p, label)?;
        progress.advance(info.len, 1);
        out = Some(match out {
            None => bytes,
            Some(acc) => {
                // The next part's rows after the previous ones.
                let mut v = acc.into_owned();
                v.extend_from_slice(&bytes);
                Cow::Owned(v)
            }
        });
    }
    Ok(out.unwrap_or_default())
}
