//! Tokenizer side files, carried into the `.kiln` metadata byte for byte.
//!
//! The runner tokenizes with the original `tokenizer.json`, so nothing is re-derived here; the
//! only interpretation is finding the chat template (inside `tokenizer_config.json` in
//! transformers 4.x, in `chat_template.jinja` in 5.x) and the special-token strings.

use std::collections::BTreeMap;
use std::path::Path;
use std::str::FromStr;

use kiln_format::TokenizerFiles;
use serde_json::Value;

use crate::checkpoint::{read_json, read_text};
use crate::error::{ConvertError, Result};

/// The files this module reads, for provenance hashing.
pub const FILES: &[&str] = &[
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "chat_template.json",
    "special_tokens_map.json",
];

fn token_string(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        // AddedToken serialized as {"content": "...", ...}.
        Value::Object(m) => m.get("content").and_then(Value::as_str).map(str::to_string),
        _ => None,
    }
}

/// Pick the default template from a string or a list of `{name, template}`.
fn template_of(v: &Value, path: &Path) -> Result<Option<String>> {
    match v {
        Value::Null => Ok(None),
        Value::String(s) => Ok(Some(s.clone())),
        Value::Array(list) => {
            let named = |want: &str| {
                list.iter().find_map(|e| {
                    (e.get("name").and_then(Value::as_str) == Some(want))
                        .then(|| e.get("template").and_then(Value::as_str))
                        .flatten()
                })
            };
            Ok(named("default")
                .or_else(|| list.first().and_then(|e| e.get("template")?.as_str()))
                .map(str::to_string))
        }
        other => Err(ConvertError::field(
            path,
            "chat_template",
            format!(
                "expected a string or a list of named templates, found {}",
                kind(other)
            ),
        )),
    }
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

/// Read the tokenizer files of a checkpoint directory.
pub fn read(dir: &Path) -> Result<TokenizerFiles> {
    let tj = dir.join("tokenizer.json");
    if !tj.exists() {
        return Err(ConvertError::MissingFile {
            dir: dir.display().to_string(),
            file: "tokenizer.json".into(),
            hint: "Kiln needs the fast-tokenizer file; save it with AutoTokenizer.from_pretrained(...).save_pretrained(dir)",
        });
    }
    let tokenizer_json = read_text(&tj)?;
    // Parse once to reject a corrupt file now rather than at the first run.
    serde_json::from_str::<Value>(&tokenizer_json).map_err(|e| ConvertError::Json {
        path: tj.display().to_string(),
        reason: e.to_string(),
    })?;

    let mut files = TokenizerFiles {
        tokenizer_json: Some(tokenizer_json),
        ..Default::default()
    };
    let mut special: BTreeMap<String, String> = BTreeMap::new();

    let map_path = dir.join("special_tokens_map.json");
    if map_path.exists() {
        if let Value::Object(m) = read_json(&map_path)? {
            for (k, v) in m {
                if let Some(s) = token_string(&v) {
                    special.insert(k, s);
                }
            }
        }
    }

    let tc = dir.join("tokenizer_config.json");
    if tc.exists() {
        let text = read_text(&tc)?;
        let v: Value = serde_json::from_str(&text).map_err(|e| ConvertError::Json {
            path: tc.display().to_string(),
            reason: e.to_string(),
        })?;
        for key in ["bos_token", "eos_token", "pad_token", "unk_token"] {
            if let Some(s) = v.get(key).and_then(token_string) {
                special.insert(key.to_string(), s);
            }
        }
        if let Some(b) = v.get("add_bos_token") {
            files.add_bos_token = Some(b.as_bool().ok_or_else(|| {
                ConvertError::field(&tc, "add_bos_token", "expected true or false")
            })?);
        }
        if let Some(t) = v.get("chat_template") {
            files.chat_template = template_of(t, &tc)?;
        }
        files.tokenizer_config_json = Some(text);
    }
    if files.chat_template.is_none() {
        let jinja = dir.join("chat_template.jinja");
        let json = dir.join("chat_template.json");
        if jinja.exists() {
            files.chat_template = Some(read_text(&jinja)?);
        } else if json.exists() {
            let v = read_json(&json)?;
            files.chat_template =
                template_of(v.get("chat_template").unwrap_or(&Value::Null), &json)?;
        }
    }
    files.special_tokens = special;
    validate(&files, &dir.display().to_string())?;
    Ok(files)
}

/// Check that what the runner will load, loads: the tokenizer builds from `tokenizer.json`
/// and the chat template compiles (with the syntax the runner renders it with). An unusable
/// tokenizer (`{}`) or a template with a syntax error is refused at conversion, naming
/// `source`, instead of converting fine and failing at the first run.
pub fn validate(files: &TokenizerFiles, source: &str) -> Result<()> {
    if let Some(json) = &files.tokenizer_json {
        // The tokenizers crate panics on some malformed documents: a panic is a refusal too.
        let loaded = std::panic::catch_unwind(|| tokenizers::Tokenizer::from_str(json));
        let reason = match loaded {
            Ok(Ok(_)) => None,
            Ok(Err(e)) => Some(format!("tokenizer.json does not load: {e}")),
            Err(_) => Some("tokenizer.json crashed the tokenizer library's parser".into()),
        };
        if let Some(reason) = reason {
            return Err(ConvertError::UnsupportedTokenizer {
                file: source.to_string(),
                reason,
            });
        }
    }
    if let Some(template) = &files.chat_template {
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| ConvertError::BadChatTemplate {
                file: source.to_string(),
                reason: e.to_string(),
            })?;
        let mut env = minijinja::Environment::new();
        env.set_syntax(syntax);
        env.add_template("chat_template", template)
            .map_err(|e| ConvertError::BadChatTemplate {
                file: source.to_string(),
                reason: e.to_string(),
            })?;
    }
    Ok(())
}
