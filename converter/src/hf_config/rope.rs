//! RoPE settings in both spellings transformers writes: 4.x's top-level `rope_theta` /
//! `rope_scaling` (and Gemma 3's `rope_local_base_freq`), 5.x's `rope_parameters` (per layer
//! type in families with sliding layers); Phi-3's LongRoPE; the rotated width of partial
//! rotary.

use kiln_format::{FamilySpec, RopeScaling};
use serde_json::{Map, Value};

use super::fields::Fields;
use crate::error::{ConvertError, Result};

/// A config's resolved RoPE: the base, the scaling, the sliding layers' base (families with
/// sliding layers), and the `rope_parameters` object the rotated width may be read from.
pub(super) struct Rope<'a> {
    pub(super) theta: f64,
    pub(super) scaling: Option<RopeScaling>,
    pub(super) local_theta: Option<f64>,
    pub(super) params: Option<&'a Map<String, Value>>,
}

/// The RoPE settings of the config `f` of a `spec` model: 5.x `rope_parameters` (per layer
/// type for families with sliding layers), else 4.x top-level `rope_theta` + `rope_scaling`
/// (+ `rope_local_base_freq`), defaulting as the family's config class does.
pub(super) fn resolve<'a>(
    f: &Fields<'a>,
    spec: &FamilySpec,
    max_position_embeddings: u64,
) -> Result<Rope<'a>> {
    let path = f.path;
    let params = match f.get("rope_parameters") {
        Some(Value::Object(m)) => Some(m),
        Some(v) => {
            return Err(ConvertError::field(
                path,
                "rope_parameters",
                format!("expected an object, found {v}"),
            ))
        }
        None => None,
    };
    let scaling_4x = match f.get("rope_scaling") {
        Some(Value::Object(m)) => Some(m),
        Some(v) => {
            return Err(ConvertError::field(
                path,
                "rope_scaling",
                format!("expected an object or null, found {v}"),
            ))
        }
        None => None,
    };
    if let Some(layers) = &spec.sliding_layers {
        let (theta, scaling, local) = per_layer_type(
            f,
            params,
            scaling_4x,
            spec.hf.rope_theta,
            layers.local_rope_theta,
        )?;
        return Ok(Rope {
            theta,
            scaling,
            local_theta: Some(local),
            params,
        });
    }
    let (rope_map, ctx) = match (params, scaling_4x) {
        (Some(m), _) => (Some(m), "rope_parameters."),
        (None, Some(m)) => (Some(m), "rope_scaling."),
        (None, None) => (None, ""),
    };
    let (theta, scaling) = if spec.longrope {
        longrope_settings(f, rope_map, ctx, max_position_embeddings)?
    } else {
        rope_settings(f, rope_map, ctx)?
    };
    let theta = match theta {
        Some(t) => t,
        None => f
            .float(f.map, "rope_theta", "")?
            .unwrap_or(spec.hf.rope_theta),
    };
    Ok(Rope {
        theta,
        scaling,
        local_theta: None,
        params,
    })
}

/// The global layers' base and scaling and the sliding layers' base, from
/// `rope_parameters.{full,sliding}_attention` or the 4.x keys. Sliding layers take no
/// frequency scaling.
fn per_layer_type(
    f: &Fields<'_>,
    params: Option<&Map<String, Value>>,
    scaling_4x: Option<&Map<String, Value>>,
    default_theta: f64,
    default_local_theta: f64,
) -> Result<(f64, Option<RopeScaling>, f64)> {
    let path = f.path;
    let layer_params = |kind: &str| -> Result<Option<&Map<String, Value>>> {
        match params.and_then(|m| m.get(kind)).filter(|v| !v.is_null()) {
            None => Ok(None),
            Some(Value::Object(m)) => Ok(Some(m)),
            Some(v) => Err(ConvertError::field(
                path,
                &format!("rope_parameters.{kind}"),
                format!("expected an object, found {v}"),
            )),
        }
    };
    let full = layer_params("full_attention")?;
    let local = layer_params("sliding_attention")?;
    let (full_map, full_ctx) = match full {
        Some(m) => (Some(m), "rope_parameters.full_attention."),
        None => (scaling_4x, "rope_scaling."),
    };
    let (theta, scaling) = rope_settings(f, full_map, full_ctx)?;
    let theta = theta
        .or(f.float(f.map, "rope_theta", "")?)
        .unwrap_or(default_theta);
    let (local_theta, local_scaling) =
        rope_settings(f, local, "rope_parameters.sliding_attention.")?;
    if local_scaling.is_some() {
        return Err(ConvertError::field(
            path,
            "rope_parameters.sliding_attention.rope_type",
            "frequency scaling on sliding-window layers is not supported",
        ));
    }
    let local_theta = local_theta
        .or(f.float(f.map, "rope_local_base_freq", "")?)
        .unwrap_or(default_local_theta);
    Ok((theta, scaling, local_theta))
}

/// A RoPE parameter object's base and frequency scaling (`ctx` prefixes field names in
/// errors). `None` map: nothing set.
fn rope_settings(
    f: &Fields<'_>,
    m: Option<&Map<String, Value>>,
    ctx: &str,
) -> Result<(Option<f64>, Option<RopeScaling>)> {
    let path = f.path;
    let Some(m) = m else {
        return Ok((None, None));
    };
    let theta = f.float(m, "rope_theta", ctx)?;
    let kind = m
        .get("rope_type")
        .or_else(|| m.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let need = |key: &str| -> Result<f64> {
        f.float(m, key, ctx)?
            .ok_or_else(|| ConvertError::field(path, &format!("{ctx}{key}"), "missing"))
    };
    let scaling = match kind {
        "default" => None,
        "linear" => Some(RopeScaling::Linear {
            factor: need("factor")?,
        }),
        "llama3" => {
            let omp = m
                .get("original_max_position_embeddings")
                .and_then(Value::as_u64)
                .filter(|&n| n > 0)
                .ok_or_else(|| {
                    ConvertError::field(
                        path,
                        &format!("{ctx}original_max_position_embeddings"),
                        "missing or not a positive integer",
                    )
                })?;
            Some(RopeScaling::Llama3 {
                factor: need("factor")?,
                low_freq_factor: need("low_freq_factor")?,
                high_freq_factor: need("high_freq_factor")?,
                original_max_position_embeddings: omp,
            })
        }
        other => {
            return Err(ConvertError::field(
                path,
                &format!("{ctx}rope_type"),
                format!("`{other}` is not supported (supported: default, linear, llama3)"),
            ))
        }
    };
    Ok((theta, scaling))
}

/// How many leading elements of each head rotate: `int(head_dim * partial_rotary_factor)`,
/// the factor read from `rope_parameters` (5.x) or the top level (4.x), defaulting as the
/// family's config class does ([`FamilySpec::partial_rotary`]; GLM: 0.5). Families without
/// partial rotary refuse any other factor than 1.
pub(super) fn rotary_dim(
    f: &Fields<'_>,
    rope_params: Option<&Map<String, Value>>,
    spec: &FamilySpec,
    head_dim: u64,
) -> Result<u64> {
    let key = "partial_rotary_factor";
    let in_params = match rope_params {
        Some(m) if m.contains_key(key) => f.float(m, key, "rope_parameters.")?,
        _ => None,
    };
    let factor = match in_params.or(f.float(f.map, key, "")?) {
        Some(x) => x,
        None => spec.partial_rotary.unwrap_or(1.0),
    };
    if !spec.partial_rotary() {
        if factor != 1.0 {
            return Err(ConvertError::field(
                f.path,
                key,
                format!("{factor}: partial rotary is not supported for this family"),
            ));
        }
        return Ok(head_dim);
    }
    // int(head_dim * partial_rotary_factor), as transformers truncates it.
    let dim = (head_dim as f64 * factor) as u64;
    if factor > 1.0 || dim < 2 || !dim.is_multiple_of(2) {
        return Err(ConvertError::field(
            f.path,
            key,
            format!(
                "{factor} of head_dim {head_dim} gives {dim} rotated elements; an even number \
                 from 2 to head_dim is needed"
            ),
        ));
    }
    Ok(dim)
}

/// RoPE settings of a family with LongRoPE (Phi-3): the default type or LongRoPE (`longrope`; transformers also reads
/// the old names `su` and `yarn` as it), whose attention factor defaults, as
/// `_compute_longrope_parameters` does, to `√(1 + ln s / ln original)` for the context
/// stretch `s = factor`, or `max_position_embeddings / original` without one.
fn longrope_settings(
    f: &Fields<'_>,
    m: Option<&Map<String, Value>>,
    ctx: &str,
    max_position_embeddings: u64,
) -> Result<(Option<f64>, Option<RopeScaling>)> {
    let path = f.path;
    let kind = m
        .and_then(|m| m.get("rope_type").or_else(|| m.get("type")))
        .and_then(Value::as_str);
    let (Some(m), Some("longrope" | "su" | "yarn")) = (m, kind) else {
        return rope_settings(f, m, ctx);
    };
    let factors = |key: &str| -> Result<Vec<f64>> {
        let bad = |why: String| ConvertError::field(path, &format!("{ctx}{key}"), why);
        match m.get(key) {
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| {
                    v.as_f64()
                        .filter(|x| x.is_finite() && *x > 0.0)
                        .ok_or_else(|| bad(format!("{v} is not a positive number")))
                })
                .collect(),
            Some(v) => Err(bad(format!("expected a list of numbers, found {v}"))),
            None => Err(bad("missing".into())),
        }
    };
    let omp_key = "original_max_position_embeddings";
    let original = match m.get(omp_key).filter(|v| !v.is_null()) {
        Some(v) => v.as_u64().filter(|&n| n > 1).ok_or_else(|| {
            ConvertError::field(
                path,
                &format!("{ctx}{omp_key}"),
                format!("{v} is not an integer above 1"),
            )
        })?,
        None => f.uint(omp_key)?.filter(|&n| n > 1).ok_or_else(|| {
            ConvertError::field(path, omp_key, "missing (LongRoPE needs it) or not above 1")
        })?,
    };
    let stretch = f
        .float(m, "factor", ctx)?
        .unwrap_or(max_position_embeddings as f64 / original as f64);
    let attention_factor = match f.float(m, "attention_factor", ctx)? {
        Some(a) => a,
        None if stretch <= 1.0 => 1.0,
        None => (1.0 + stretch.ln() / (original as f64).ln()).sqrt(),
    };
    let scaling = RopeScaling::LongRope {
        short_factor: factors("short_factor")?,
        long_factor: factors("long_factor")?,
        original_max_position_embeddings: original,
        attention_factor,
    };
    Ok((f.float(m, "rope_theta", ctx)?, Some(scaling)))
}
