//! A sentence-transformers directory's modules: how an encoder's token states become one
//! embedding (pooling, normalisation), the longest input, and the prompts the model documents.
//!
//! sentence-transformers stores a model as a transformer checkpoint plus `modules.json`,
//! which lists the modules applied in order (`Transformer`, then `Pooling` with its
//! `1_Pooling/config.json`, then optionally `Dense` and `Normalize`);
//! `sentence_bert_config.json` holds `max_seq_length` and `config_sentence_transformers.json`
//! the named prompts. Kiln records what they say in the file's [`EmbeddingSpec`], and refuses a
//! module it does not implement by name rather than computing a different vector.

use std::path::Path;

use kiln_format::{EmbeddingSpec, Pooling};
use serde_json::Value;

use crate::checkpoint::read_json_as;
use crate::error::{ConvertError, Result};

/// The side files this module reads, relative to the model directory (kept in the
/// provenance with their checksums).
pub const FILES: [&str; 4] = [
    "modules.json",
    "1_Pooling/config.json",
    "sentence_bert_config.json",
    "config_sentence_transformers.json",
];

/// The embedding the directory's sentence-transformers files describe, starting from
/// `base` (what the checkpoint alone implies); `base` unchanged when there is no
/// `modules.json`.
pub fn read(dir: &Path, base: EmbeddingSpec) -> Result<EmbeddingSpec> {
    let modules_path = dir.join("modules.json");
    if !modules_path.exists() {
        return Ok(base);
    }
    let mut spec = base;
    let modules = read_json_as(&modules_path, "modules.json")?;
    let list = modules
        .as_array()
        .ok_or_else(|| bad(&modules_path, "the top level is not a list of modules"))?;
    let mut pooled = false;
    for (i, m) in list.iter().enumerate() {
        let kind = m
            .get("type")
            .and_then(Value::as_str)
            .ok_or_else(|| bad(&modules_path, format!("module {i} has no `type` string")))?;
        // `sentence_transformers.models.Pooling` → `Pooling`.
        let short = kind.rsplit('.').next().unwrap_or(kind);
        let sub = m.get("path").and_then(Value::as_str).unwrap_or("");
        match short {
            "Transformer" if i == 0 => {}
            "Pooling" if i == 1 => {
                spec.pooling = pooling(&dir.join(sub).join("config.json"))?;
                pooled = true;
            }
            "Normalize" if pooled => spec.normalize = true,
            _ => {
                return Err(bad(
                    &modules_path,
                    format!(
                        "module {i} (`{kind}`) is not supported here; Kiln implements a \
                         Transformer, then Pooling, then optionally Normalize"
                    ),
                ))
            }
        }
    }
    if !pooled {
        return Err(bad(
            &modules_path,
            "no Pooling module follows the Transformer",
        ));
    }
    let bert_config = dir.join("sentence_bert_config.json");
    if bert_config.exists() {
        let v = read_json_as(&bert_config, "sentence_bert_config.json")?;
        match v.get("max_seq_length") {
            None | Some(Value::Null) => {}
            Some(n) => {
                let n = n.as_u64().filter(|&n| n > 0).ok_or_else(|| {
                    ConvertError::field(
                        &bert_config,
                        "max_seq_length",
                        format!("{n} is not a positive integer"),
                    )
                })?;
                spec.max_seq_length = Some(n);
            }
        }
    }
    let st_config = dir.join("config_sentence_transformers.json");
    if st_config.exists() {
        let v = read_json_as(&st_config, "config_sentence_transformers.json")?;
        if let Some(prompts) = v.get("prompts").filter(|p| !p.is_null()) {
            let map = prompts.as_object().ok_or_else(|| {
                ConvertError::field(&st_config, "prompts", "not an object of name → text")
            })?;
            for (name, text) in map {
                let text = text.as_str().ok_or_else(|| {
                    ConvertError::field(&st_config, &format!("prompts.{name}"), "not a string")
                })?;
                spec.prompts.insert(name.clone(), text.to_string());
            }
        }
        match v.get("default_prompt_name") {
            None | Some(Value::Null) => {}
            Some(Value::String(name)) if spec.prompts.contains_key(name) => {
                spec.default_prompt_name = Some(name.clone());
            }
            Some(other) => {
                return Err(ConvertError::field(
                    &st_config,
                    "default_prompt_name",
                    format!("{other} names no prompt of `prompts`"),
                ))
            }
        }
    }
    Ok(spec)
}

/// The one pooling mode `1_Pooling/config.json` turns on.
fn pooling(path: &Path) -> Result<Pooling> {
    let v = read_json_as(path, "1_Pooling/config.json")?;
    let on = |key: &str| -> Result<bool> {
        match v.get(key) {
            None | Some(Value::Null) => Ok(false),
            Some(Value::Bool(b)) => Ok(*b),
            Some(other) => Err(ConvertError::field(
                path,
                key,
                format!("{other} is not a boolean"),
            )),
        }
    };
    let modes = [
        ("pooling_mode_mean_tokens", Some(Pooling::Mean)),
        ("pooling_mode_cls_token", Some(Pooling::Cls)),
        ("pooling_mode_lasttoken", Some(Pooling::LastToken)),
        ("pooling_mode_max_tokens", None),
        ("pooling_mode_mean_sqrt_len_tokens", None),
        ("pooling_mode_weightedmean_tokens", None),
    ];
    let mut chosen = Vec::new();
    for (key, pooling) in modes {
        if on(key)? {
            match pooling {
                Some(p) => chosen.push(p),
                None => {
                    return Err(ConvertError::field(
                        path,
                        key,
                        "this pooling is not supported; Kiln implements mean, CLS and last-token pooling",
                    ))
                }
            }
        }
    }
    match chosen.as_slice() {
        [one] => Ok(*one),
        [] => Err(bad(path, "no pooling mode is turned on")),
        _ => Err(bad(
            path,
            "several pooling modes are turned on (their vectors concatenated), which Kiln does not implement",
        )),
    }
}

fn bad(path: &Path, reason: impl Into<String>) -> ConvertError {
    ConvertError::Json {
        path: path.display().to_string(),
        reason: reason.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> EmbeddingSpec {
        EmbeddingSpec {
            pooling: Pooling::Mean,
            normalize: false,
            max_seq_length: None,
            prompts: Default::default(),
            default_prompt_name: None,
        }
    }

    fn write(dir: &Path, name: &str, text: &str) {
        let p = dir.join(name);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    }

    const MODULES: &str = r#"[
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}
    ]"#;

    #[test]
    fn reads_pooling_normalisation_length_and_prompts() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), "modules.json", MODULES);
        write(
            dir.path(),
            "1_Pooling/config.json",
            r#"{"pooling_mode_cls_token": true, "pooling_mode_mean_tokens": false}"#,
        );
        write(
            dir.path(),
            "sentence_bert_config.json",
            r#"{"max_seq_length": 256}"#,
        );
        write(
            dir.path(),
            "config_sentence_transformers.json",
            r#"{"prompts": {"query": "query: ", "document": ""}, "default_prompt_name": null}"#,
        );
        let spec = read(dir.path(), base()).unwrap();
        assert_eq!(spec.pooling, Pooling::Cls);
        assert!(spec.normalize);
        assert_eq!(spec.max_seq_length, Some(256));
        assert_eq!(spec.prompts["query"], "query: ");
        // No modules.json: the checkpoint's own default.
        let bare = tempfile::tempdir().unwrap();
        assert_eq!(read(bare.path(), base()).unwrap(), base());
    }

    #[test]
    fn refuses_what_it_does_not_implement_by_name() {
        let dir = tempfile::tempdir().unwrap();
        write(
            dir.path(),
            "modules.json",
            &MODULES.replace("models.Normalize", "models.Dense"),
        );
        write(
            dir.path(),
            "1_Pooling/config.json",
            r#"{"pooling_mode_mean_tokens": true}"#,
        );
        let e = read(dir.path(), base()).unwrap_err().to_string();
        assert!(e.contains("modules.json") && e.contains("Dense"), "{e}");

        write(dir.path(), "modules.json", MODULES);
        write(
            dir.path(),
            "1_Pooling/config.json",
            r#"{"pooling_mode_max_tokens": true}"#,
        );
        let e = read(dir.path(), base()).unwrap_err().to_string();
        assert!(e.contains("pooling_mode_max_tokens"), "{e}");

        write(
            dir.path(),
            "1_Pooling/config.json",
            r#"{"pooling_mode_mean_tokens": true, "pooling_mode_cls_token": true}"#,
        );
        let e = read(dir.path(), base()).unwrap_err().to_string();
        assert!(e.contains("several pooling modes"), "{e}");

        write(
            dir.path(),
            "1_Pooling/config.json",
            r#"{"pooling_mode_mean_tokens": true}"#,
        );
        write(
            dir.path(),
            "config_sentence_transformers.json",
            r#"{"prompts": {"query": "q: "}, "default_prompt_name": "passage"}"#,
        );
        let e = read(dir.path(), base()).unwrap_err().to_string();
        assert!(e.contains("default_prompt_name"), "{e}");
    }
}
