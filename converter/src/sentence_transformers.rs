//! A sentence-transformers directory's modules: how an encoder's token states become one
//! embedding (pooling, normalisation), the longest input, and the prompts the model documents.
//!
//! sentence-transformers stores a model as a transformer checkpoint plus `modules.json`,
//! which lists the modules applied in order (`Transformer`, then `Pooling` with its
//! `1_Pooling/config.json`, then optionally `Dense` modules (each a directory holding its
//! `config.json` and `model.safetensors`) and `Normalize`);
//! `sentence_bert_config.json` holds `max_seq_length` and `config_sentence_transformers.json`
//! the named prompts. Kiln records what they say in the file's [`EmbeddingSpec`], and refuses a
//! module it does not implement by name rather than computing a different vector.

use std::path::Path;

use kiln_format::{DenseActivation, DenseLayer, EmbeddingSpec, Pooling};
use serde_json::Value;

use kiln_format::metadata::MAX_DENSE_LAYERS;

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
/// `base` (what the checkpoint alone implies, for hidden states `hidden` wide), and the directories (relative to `dir`) of
/// its `Dense` modules, in order, whose `model.safetensors` hold their weights; `base`
/// unchanged when there is no `modules.json`.
pub fn read(dir: &Path, base: EmbeddingSpec, hidden: u64) -> Result<(EmbeddingSpec, Vec<String>)> {
    let modules_path = dir.join("modules.json");
    if !modules_path.exists() {
        return Ok((base, Vec::new()));
    }
    let mut spec = base;
    let dense_dirs = read_modules(dir, &modules_path, &mut spec, hidden)?;
    read_max_seq_length(dir, &mut spec)?;
    read_prompts(dir, &mut spec)?;
    if spec.dense.len() > MAX_DENSE_LAYERS {
        return Err(bad(
            &modules_path,
            format!(
                "{} Dense modules; Kiln implements at most {MAX_DENSE_LAYERS}",
                spec.dense.len()
            ),
        ));
    }
    Ok((spec, dense_dirs))
}

/// `modules.json`: a Transformer, then Pooling, then optionally Dense modules, then
/// optionally Normalize, read into `spec`; returns the Dense modules' directories.
fn read_modules(
    dir: &Path,
    modules_path: &Path,
    spec: &mut EmbeddingSpec,
    hidden: u64,
) -> Result<Vec<String>> {
    let mut dense_dirs = Vec::new();
    let modules = read_json_as(modules_path, "modules.json")?;
    let list = modules
        .as_array()
        .ok_or_else(|| bad(modules_path, "the top level is not a list of modules"))?;
    let mut pooled = false;
    for (i, m) in list.iter().enumerate() {
        let kind = m
            .get("type")
            .and_then(Value::as_str)
            .ok_or_else(|| bad(modules_path, format!("module {i} has no `type` string")))?;
        // `sentence_transformers.models.Pooling` → `Pooling`.
        let short = kind.rsplit('.').next().unwrap_or(kind);
        let sub = m.get("path").and_then(Value::as_str).unwrap_or("");
        match short {
            "Transformer" if i == 0 => {}
            "Pooling" if i == 1 => {
                spec.pooling = pooling(&dir.join(sub).join("config.json"))?;
                pooled = true;
            }
            "Dense" if pooled && !spec.normalize => {
                if sub.is_empty() || sub.contains("..") || Path::new(sub).is_absolute() {
                    return Err(bad(
                        modules_path,
                        format!("module {i}'s `path` {sub:?} is not a directory inside the model"),
                    ));
                }
                let width = spec.dense.last().map_or(hidden, |d| d.out_features);
                spec.dense.push(dense(&dir.join(sub), width)?);
                dense_dirs.push(sub.to_string());
            }
            "Normalize" if pooled => spec.normalize = true,
            _ => {
                return Err(bad(
                    modules_path,
                    format!(
                        "module {i} (`{kind}`) is not supported here; Kiln implements a \
                         Transformer, then Pooling, then optionally Dense modules, then optionally \
                         Normalize"
                    ),
                ))
            }
        }
    }
    if !pooled {
        return Err(bad(
            modules_path,
            "no Pooling module follows the Transformer",
        ));
    }
    Ok(dense_dirs)
}

/// `sentence_bert_config.json`'s `max_seq_length`, when the file is there and sets it.
fn read_max_seq_length(dir: &Path, spec: &mut EmbeddingSpec) -> Result<()> {
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
    Ok(())
}

/// `config_sentence_transformers.json`'s prompts and default prompt, when the file is there.
fn read_prompts(dir: &Path, spec: &mut EmbeddingSpec) -> Result<()> {
    let st_config = dir.join("config_sentence_transformers.json");
    if !st_config.exists() {
        return Ok(());
    }
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
    Ok(())
}

/// A `Dense` module's layer, from `dir/config.json`; `width` is the vector it must read. sentence-transformers' defaults apply to absent
/// keys (a bias, `tanh`); a residual or another input or output than the sentence embedding
/// is refused by name.
fn dense(dir: &Path, width: u64) -> Result<DenseLayer> {
    let path = dir.join("config.json");
    let what = "Dense module's config.json";
    let v = read_json_as(&path, what)?;
    let field = |key: &str, reason: String| ConvertError::field(&path, key, reason);
    let size = |key: &str| -> Result<u64> {
        v.get(key)
            .and_then(Value::as_u64)
            .filter(|&n| n > 0)
            .ok_or_else(|| field(key, format!("{}: not a positive integer", show(v.get(key)))))
    };
    let (in_features, out_features) = (size("in_features")?, size("out_features")?);
    if in_features != width {
        return Err(field(
            "in_features",
            format!("{in_features}, but the vector the module reads has {width} values"),
        ));
    }
    let bias = match v.get("bias") {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => *b,
        Some(other) => return Err(field("bias", format!("{other} is not a boolean"))),
    };
    let activation = dense_activation(v.get("activation_function"))
        .map_err(|r| field("activation_function", r))?;
    for key in ["module_input_name", "module_output_name"] {
        match v.get(key) {
            None | Some(Value::Null) => {}
            Some(Value::String(s)) if s == "sentence_embedding" => {}
            Some(other) => {
                return Err(field(
                    key,
                    format!(
                        "{other}: Kiln implements a Dense module on the sentence embedding only"
                    ),
                ))
            }
        }
    }
    match v.get("use_residual") {
        None | Some(Value::Null) | Some(Value::Bool(false)) => {}
        Some(other) => {
            return Err(field(
                "use_residual",
                format!("{other}: a residual Dense module is not supported"),
            ))
        }
    }
    if !dir.join("model.safetensors").is_file() {
        return Err(ConvertError::MissingFile {
            dir: dir.display().to_string(),
            file: "model.safetensors".into(),
            hint: if dir.join("pytorch_model.bin").exists() {
                "this Dense module's weights are a pickle (pytorch_model.bin); Kiln reads safetensors: re-save the model with safe_serialization=True"
            } else {
                "a Dense module's weights are its model.safetensors"
            },
        });
    }
    Ok(DenseLayer {
        in_features,
        out_features,
        bias,
        activation,
    })
}

/// A Dense module's `activation_function` (Tanh when absent); the reason it is refused
/// otherwise.
fn dense_activation(v: Option<&Value>) -> std::result::Result<DenseActivation, String> {
    match v {
        None | Some(Value::Null) => Ok(DenseActivation::Tanh),
        Some(Value::String(s)) => match s.as_str() {
            "torch.nn.modules.linear.Identity" => Ok(DenseActivation::Identity),
            "torch.nn.modules.activation.Tanh" => Ok(DenseActivation::Tanh),
            other => Err(format!(
                "`{other}` is not supported; Kiln implements Identity and Tanh"
            )),
        },
        Some(other) => Err(format!("{other} is not a class name")),
    }
}

/// A JSON value for a message, `missing` when absent.
fn show(v: Option<&Value>) -> String {
    v.map_or_else(|| "missing".to_string(), Value::to_string)
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
        EmbeddingSpec::pooled(Pooling::Mean, false)
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
        let (spec, _) = read(dir.path(), base(), 64).unwrap();
        assert_eq!(spec.pooling, Pooling::Cls);
        assert!(spec.normalize);
        assert_eq!(spec.max_seq_length, Some(256));
        assert_eq!(spec.prompts["query"], "query: ");
        // No modules.json: the checkpoint's own default.
        let bare = tempfile::tempdir().unwrap();
        assert_eq!(read(bare.path(), base(), 64).unwrap().0, base());
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
        let e = read(dir.path(), base(), 64).unwrap_err().to_string();
        assert!(e.contains("2_Normalize/config.json"), "{e}");

        write(dir.path(), "modules.json", MODULES);
        write(
            dir.path(),
            "1_Pooling/config.json",
            r#"{"pooling_mode_max_tokens": true}"#,
        );
        let e = read(dir.path(), base(), 64).unwrap_err().to_string();
        assert!(e.contains("pooling_mode_max_tokens"), "{e}");

        write(
            dir.path(),
            "1_Pooling/config.json",
            r#"{"pooling_mode_mean_tokens": true, "pooling_mode_cls_token": true}"#,
        );
        let e = read(dir.path(), base(), 64).unwrap_err().to_string();
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
        let e = read(dir.path(), base(), 64).unwrap_err().to_string();
        assert!(e.contains("default_prompt_name"), "{e}");
    }

    /// `Transformer, Pooling, Dense…, Normalize` with each Dense module's files.
    fn with_dense(dir: &Path, configs: &[&str]) {
        let mut modules = vec![
            r#"{"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"}"#
                .to_string(),
            r#"{"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}"#
                .to_string(),
        ];
        for (k, config) in configs.iter().enumerate() {
            let sub = format!("{}_Dense", k + 2);
            modules.push(format!(
                r#"{{"idx": {}, "path": "{sub}", "type": "sentence_transformers.models.Dense"}}"#,
                k + 2
            ));
            write(dir, &format!("{sub}/config.json"), config);
            write(dir, &format!("{sub}/model.safetensors"), "");
        }
        modules.push(
            r#"{"idx": 9, "path": "9_Normalize", "type": "sentence_transformers.models.Normalize"}"#
                .to_string(),
        );
        write(dir, "modules.json", &format!("[{}]", modules.join(",")));
        write(
            dir,
            "1_Pooling/config.json",
            r#"{"pooling_mode_mean_tokens": true}"#,
        );
    }

    #[test]
    fn reads_dense_modules_in_order_with_their_defaults() {
        let dir = tempfile::tempdir().unwrap();
        with_dense(
            dir.path(),
            &[
                r#"{"in_features": 64, "out_features": 96, "bias": false,
                    "activation_function": "torch.nn.modules.linear.Identity"}"#,
                // sentence-transformers' defaults: a bias and tanh.
                r#"{"in_features": 96, "out_features": 32,
                    "module_input_name": "sentence_embedding", "use_residual": false}"#,
            ],
        );
        let (spec, dirs) = read(dir.path(), base(), 64).unwrap();
        assert_eq!(dirs, ["2_Dense", "3_Dense"]);
        assert!(spec.normalize);
        assert_eq!(
            spec.dense,
            [
                DenseLayer {
                    in_features: 64,
                    out_features: 96,
                    bias: false,
                    activation: DenseActivation::Identity
                },
                DenseLayer {
                    in_features: 96,
                    out_features: 32,
                    bias: true,
                    activation: DenseActivation::Tanh
                },
            ]
        );
    }

    #[test]
    fn refuses_dense_modules_it_cannot_run_by_name() {
        let ok = r#"{"in_features": 64, "out_features": 64}"#;
        for (configs, want) in [
            (
                vec![r#"{"in_features": 32, "out_features": 64}"#],
                "in_features",
            ),
            (vec![r#"{"in_features": 64}"#], "out_features"),
            (
                vec![
                    r#"{"in_features": 64, "out_features": 64, "activation_function": "torch.nn.modules.activation.ReLU"}"#,
                ],
                "activation_function",
            ),
            (
                vec![r#"{"in_features": 64, "out_features": 64, "use_residual": true}"#],
                "use_residual",
            ),
            (
                vec![
                    r#"{"in_features": 64, "out_features": 64, "module_input_name": "token_embeddings"}"#,
                ],
                "module_input_name",
            ),
            (vec![ok, ok, ok], "at most 2"),
        ] {
            let dir = tempfile::tempdir().unwrap();
            with_dense(dir.path(), &configs);
            let e = read(dir.path(), base(), 64).unwrap_err().to_string();
            assert!(e.contains(want), "{want}: {e}");
        }
        // Weights only as a pickle: refused with the way out.
        let dir = tempfile::tempdir().unwrap();
        with_dense(dir.path(), &[ok]);
        std::fs::remove_file(dir.path().join("2_Dense/model.safetensors")).unwrap();
        write(dir.path(), "2_Dense/pytorch_model.bin", "");
        let e = read(dir.path(), base(), 64).unwrap_err().to_string();
        assert!(
            e.contains("model.safetensors") && e.contains("safe_serialization"),
            "{e}"
        );
        // A Dense module after Normalize computes something else: refused.
        let dir = tempfile::tempdir().unwrap();
        write(
            dir.path(),
            "modules.json",
            &MODULES.replace(
                "]",
                r#", {"idx": 3, "path": "3_Dense", "type": "sentence_transformers.models.Dense"}]"#,
            ),
        );
        write(
            dir.path(),
            "1_Pooling/config.json",
            r#"{"pooling_mode_mean_tokens": true}"#,
        );
        let e = read(dir.path(), base(), 64).unwrap_err().to_string();
        assert!(e.contains("modules.json") && e.contains("Dense"), "{e}");
    }
}
