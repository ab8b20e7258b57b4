//! The per-layer attention kinds and score scale of a family with sliding layers
//! ([`SlidingLayers`]: Gemma 3), as its config class defaults them.

use kiln_format::family::SlidingLayers;
use kiln_format::LayerKind;
use serde_json::Value;

use super::fields::Fields;
use crate::error::{ConvertError, Result};

/// Each layer's attention kind (`layer_types`, or every `sliding_window_pattern`-th layer
/// global) and the factor on attention scores (`query_pre_attn_scalar^-½`).
pub(super) fn sliding_layers(
    f: &Fields<'_>,
    layers: &SlidingLayers,
    num_layers: u64,
) -> Result<(Vec<LayerKind>, f64)> {
    let path = f.path;
    let query_pre_attn_scalar = f
        .float(f.map, "query_pre_attn_scalar", "")?
        .unwrap_or(layers.query_pre_attn_scalar);
    let layer_kinds = match f.get("layer_types") {
        Some(Value::Array(a)) => {
            if a.len() as u64 != num_layers {
                return Err(ConvertError::field(
                    path,
                    "layer_types",
                    format!("{} entries for {num_layers} layers", a.len()),
                ));
            }
            a.iter()
                .map(|v| match v.as_str() {
                    Some("full_attention") => Ok(LayerKind::Full),
                    Some("sliding_attention") => Ok(LayerKind::Sliding),
                    _ => Err(ConvertError::field(
                        path,
                        "layer_types",
                        format!(
                            "{v} is not supported (supported: full_attention, sliding_attention)"
                        ),
                    )),
                })
                .collect::<Result<Vec<_>>>()?
        }
        Some(v) => {
            return Err(ConvertError::field(
                path,
                "layer_types",
                format!("expected a list, found {v}"),
            ))
        }
        None => {
            let pattern = f
                .uint("sliding_window_pattern")?
                .unwrap_or(layers.global_every);
            (0..num_layers)
                .map(|i| {
                    if (i + 1) % pattern != 0 {
                        LayerKind::Sliding
                    } else {
                        LayerKind::Full
                    }
                })
                .collect()
        }
    };
    Ok((layer_kinds, query_pre_attn_scalar.powf(-0.5)))
}
