//! Reference activation dumps: one safetensors file per prompt.
//!
//! Layout (documented in `docs/ACCURACY.md` and `fixtures/README.md`): `input_ids` (i64 or
//! i32, `[T]`), and f32 activations named by the transformers module path plus `.output`
//! (`model.layers.3.output`, `logits`, …), `[T, width]`. A dump saved straight from
//! transformers keeps its batch dimension (`input_ids` `[1, T]`, activations `[1, T, width]`);
//! a batch of one is read as the unbatched shape, any other batch size is refused. Any other
//! tensors are listed as not compared. Dumps come from anyone's script, so every field is
//! checked before use.

use std::path::Path;

use safetensors::{Dtype, SafeTensors};

use crate::error::{Result, VerifyError};

/// Largest dump accepted (a dump is activations for a short prompt, not a model).
const MAX_DUMP_BYTES: u64 = 4 << 30;

/// A loaded reference dump.
#[derive(Debug, Clone)]
pub struct Dump {
    /// Where it came from.
    pub path: String,
    /// The prompt's token ids.
    pub input_ids: Vec<u32>,
    /// Activations `(name, [rows, cols], data)`, in file order.
    pub activations: Vec<(String, [usize; 2], Vec<f32>)>,
    /// An embedding model's final vector ([`SENTENCE_EMBEDDING`]), if the dump holds it.
    pub sentence_embedding: Option<Vec<f32>>,
    /// Tensors that are not activations Kiln compares.
    pub other: Vec<String>,
    /// String metadata (prompt text, producing versions…).
    pub metadata: std::collections::BTreeMap<String, String>,
}

impl Dump {
    /// Read and check a dump file.
    pub fn load(path: &Path) -> Result<Dump> {
        let bad = |reason: String| VerifyError::BadDump {
            path: path.display().to_string(),
            reason,
        };
        // A regular file only (`/dev/zero` or a FIFO is refused at once), at most the limit.
        let bytes = kiln_format::read_bounded(path, MAX_DUMP_BYTES, "reference dump")?;
        let (_, meta) = SafeTensors::read_metadata(&bytes)
            .map_err(|e| bad(format!("not a safetensors file: {e}")))?;
        let st = SafeTensors::deserialize(&bytes)
            .map_err(|e| bad(format!("not a safetensors file: {e}")))?;
        let ids = st
            .tensor("input_ids")
            .map_err(|_| bad("no `input_ids` tensor".into()))?;
        let (t, input_ids) = token_ids(&ids).map_err(&bad)?;
        let mut activations = Vec::new();
        let mut other = Vec::new();
        let mut sentence_embedding = None;
        // File order is alphabetical in safetensors; keep the header's order for stability.
        let mut names: Vec<String> = st.names().into_iter().map(|n| n.to_string()).collect();
        names.sort();
        for name in names {
            if name == "input_ids" {
                continue;
            }
            let v = st.tensor(&name).expect("listed");
            if name == SENTENCE_EMBEDDING {
                sentence_embedding = Some(vector(&name, &v).map_err(&bad)?);
                continue;
            }
            if !is_activation(&name) {
                other.push(name);
                continue;
            }
            let (shape, data) = activation(&name, &v, t).map_err(&bad)?;
            activations.push((name, shape, data));
        }
        Ok(Dump {
            path: path.display().to_string(),
            input_ids,
            activations,
            sentence_embedding,
            other,
            metadata: meta
                .metadata()
                .clone()
                .unwrap_or_default()
                .into_iter()
                .collect(),
        })
    }
}

/// The prompt's length T and token ids, from `input_ids` (`[T]` or `[1, T]`, I64 or I32).
fn token_ids(ids: &safetensors::tensor::TensorView<'_>) -> Result<(usize, Vec<u32>), String> {
    let ids_shape = unbatched("input_ids", ids.shape(), 1)?;
    if ids_shape.len() != 1 || ids_shape[0] == 0 {
        return Err(format!(
            "`input_ids` has shape {:?}, expected [T] or [1, T] with T ≥ 1",
            ids.shape()
        ));
    }
    let t = ids_shape[0];
    let id =
        |v: i64| u32::try_from(v).map_err(|_| format!("`input_ids` holds {v}, not a token id"));
    let input_ids: Vec<u32> = match ids.dtype() {
        Dtype::I64 => ids
            .data()
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")))
            .map(id)
            .collect::<Result<_, String>>()?,
        Dtype::I32 => ids
            .data()
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes(c.try_into().expect("4 bytes")))
            .map(|v| id(v.into()))
            .collect::<Result<_, String>>()?,
        d => return Err(format!("`input_ids` is {d:?}, expected I64 or I32")),
    };
    Ok((t, input_ids))
}

/// Whether a tensor is an activation Kiln compares. Decoders' module paths start with
/// `model.`; a BERT encoder's with `embeddings` or `encoder.`.
fn is_activation(name: &str) -> bool {
    name == "logits"
        || (["model.", "embeddings.", "encoder."]
            .iter()
            .any(|p| name.starts_with(p))
            && name.ends_with(".output"))
}

/// An activation's `[T, width]` shape and values: F32, T rows, every value finite.
fn activation(
    name: &str,
    v: &safetensors::tensor::TensorView<'_>,
    t: usize,
) -> Result<([usize; 2], Vec<f32>), String> {
    if v.dtype() != Dtype::F32 {
        return Err(format!(
            "`{name}` is {:?}, activations must be F32",
            v.dtype()
        ));
    }
    let shape = unbatched(name, v.shape(), 2)?;
    if shape.len() != 2 || shape[0] != t || shape[1] == 0 {
        return Err(format!(
            "`{name}` has shape {:?}, expected [{t}, width] or [1, {t}, width] (T from \
             input_ids)",
            v.shape()
        ));
    }
    let data: Vec<f32> = v
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
        .collect();
    // A reference that is not a number cannot judge the model: bad input, not a
    // model out of tolerance.
    if let Some(p) = data.iter().position(|x| !x.is_finite()) {
        let count = data.iter().filter(|x| !x.is_finite()).count();
        return Err(format!(
            "`{name}` holds {count} NaN or infinite value(s), the first at element {p} \
             ({}); regenerate the reference",
            data[p]
        ));
    }
    Ok(([shape[0], shape[1]], data))
}

/// The name of an embedding model's final vector in a dump (`[dim]` or `[1, dim]`): what
/// sentence-transformers' `encode` returns (pooled, projected, normalised).
pub const SENTENCE_EMBEDDING: &str = "sentence_embedding";

/// A finite F32 vector `[n]` or `[1, n]`.
fn vector(name: &str, v: &safetensors::tensor::TensorView<'_>) -> Result<Vec<f32>, String> {
    if v.dtype() != Dtype::F32 {
        return Err(format!("`{name}` is {:?}, expected F32", v.dtype()));
    }
    match unbatched(name, v.shape(), 1)? {
        [n] if *n > 0 => {}
        other => {
            return Err(format!(
                "`{name}` has shape {other:?}, expected [dim] or [1, dim]"
            ))
        }
    }
    let data: Vec<f32> = v
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
        .collect();
    if data.iter().any(|x| !x.is_finite()) {
        return Err(format!(
            "`{name}` holds NaN or infinite values; regenerate the reference"
        ));
    }
    Ok(data)
}

/// `shape` without a leading batch dimension, for a tensor whose unbatched rank is `rank`: a
/// shape of rank `rank + 1` must lead with a batch of 1 (transformers' `[1, T, …]`); any other
/// shape is returned as it is, for the caller's own check.
fn unbatched<'a>(name: &str, shape: &'a [usize], rank: usize) -> Result<&'a [usize], String> {
    match shape.split_first() {
        Some((&1, rest)) if shape.len() == rank + 1 => Ok(rest),
        Some((&b, _)) if shape.len() == rank + 1 => Err(format!(
            "`{name}` has shape {shape:?}: a batch of {b} prompts; a dump holds one prompt \
             (batch 1, or no batch dimension)"
        )),
        _ => Ok(shape),
    }
}

#[cfg(test)]
mod tests {
    use super::unbatched;

    /// (shape, unbatched rank, the shape read, or `None` when refused).
    type Case = (&'static [usize], usize, Option<&'static [usize]>);

    #[test]
    fn a_batch_of_one_is_dropped_and_other_batches_are_refused() {
        let cases: &[Case] = &[
            (&[5], 1, Some(&[5])),
            (&[1, 5], 1, Some(&[5])),
            (&[2, 5], 1, None),
            (&[5, 8], 2, Some(&[5, 8])),
            (&[1, 5, 8], 2, Some(&[5, 8])),
            (&[3, 5, 8], 2, None),
            // Shapes of other ranks are left for the caller to refuse.
            (&[1, 1, 5, 8], 2, Some(&[1, 1, 5, 8])),
        ];
        for &(shape, rank, want) in cases {
            match (unbatched("x", shape, rank), want) {
                (Ok(got), Some(w)) => assert_eq!(got, w, "{shape:?}"),
                (Err(e), None) => {
                    assert!(
                        e.contains("`x`") && e.contains(&format!("{shape:?}")),
                        "{e}"
                    )
                }
                (got, want) => panic!("{shape:?}: got {got:?}, want {want:?}"),
            }
        }
    }
}
