//! `config.json`'s top-level object as read field by field: each getter checks the value's
//! type and range and names the key (and the file) when it refuses one.

use std::path::Path;

use serde_json::{Map, Value};

use crate::error::{ConvertError, Result};

/// Largest value accepted for any size field: the format's own cap, so that what converts
/// also opens ([`kiln_format::ModelConfig::check`]).
const MAX_SIZE: u64 = kiln_format::metadata::MAX_CONFIG_DIM;

/// A JSON object of `config.json` (the top level, or `generation_config.json`'s), with the
/// file's path for messages.
pub(super) struct Fields<'a> {
    pub(super) path: &'a Path,
    pub(super) map: &'a Map<String, Value>,
}

impl<'a> Fields<'a> {
    pub(super) fn get(&self, key: &str) -> Option<&'a Value> {
        self.map.get(key).filter(|v| !v.is_null())
    }

    pub(super) fn uint(&self, key: &str) -> Result<Option<u64>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => {
                let n = v.as_u64().ok_or_else(|| {
                    ConvertError::field(
                        self.path,
                        key,
                        format!("expected a non-negative integer, found {v}"),
                    )
                })?;
                if n == 0 || n > MAX_SIZE {
                    return Err(ConvertError::field(
                        self.path,
                        key,
                        format!("{n} is outside 1..={MAX_SIZE}"),
                    ));
                }
                Ok(Some(n))
            }
        }
    }

    pub(super) fn req_uint(&self, key: &str) -> Result<u64> {
        self.uint(key)?
            .ok_or_else(|| ConvertError::field(self.path, key, "missing"))
    }

    pub(super) fn float(
        &self,
        map: &Map<String, Value>,
        key: &str,
        ctx: &str,
    ) -> Result<Option<f64>> {
        match map.get(key).filter(|v| !v.is_null()) {
            None => Ok(None),
            Some(v) => {
                let f = v
                    .as_f64()
                    .filter(|f| f.is_finite() && *f > 0.0)
                    .ok_or_else(|| {
                        ConvertError::field(
                            self.path,
                            &format!("{ctx}{key}"),
                            format!("expected a positive number, found {v}"),
                        )
                    })?;
                Ok(Some(f))
            }
        }
    }

    pub(super) fn bool(&self, key: &str, default: bool) -> Result<bool> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v.as_bool().ok_or_else(|| {
                ConvertError::field(self.path, key, format!("expected true or false, found {v}"))
            }),
        }
    }

    pub(super) fn token_ids(&self, key: &str) -> Result<Vec<u32>> {
        let bad = |v: &Value| {
            ConvertError::field(
                self.path,
                key,
                format!("expected a token id or a list of ids, found {v}"),
            )
        };
        let one = |v: &Value| {
            v.as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| bad(v))
        };
        match self.get(key) {
            None => Ok(vec![]),
            Some(Value::Array(a)) => a.iter().map(one).collect(),
            Some(v) => Ok(vec![one(v)?]),
        }
    }
}
