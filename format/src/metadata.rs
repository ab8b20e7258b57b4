//! The metadata section: a JSON document describing the model, its tokenizer and its history.
//!
//! JSON keeps the section readable with any tool and lets minor versions add fields without
//! breaking older readers (unknown fields are ignored). Everything the runner needs to build the
//! model is in [`ModelConfig`], already resolved: no `Option`s for values that have defaults in
//! the source format, so the runner never re-implements Hugging Face's defaulting rules.

use serde::{Deserialize, Serialize};

/// Architectures the runner implements. They differ by configuration only.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Architecture {
    /// Llama 2/3, SmolLM/SmolLM2, TinyLlama.
    Llama,
    /// Mistral (Llama with an optional sliding window).
    Mistral,
    /// Qwen2/2.5 (Llama with q/k/v biases).
    Qwen2,
}

/// Rotary-embedding frequency scaling.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum RopeScaling {
    /// Llama 3's piecewise scaling of the inverse frequencies.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: u64,
    },
    /// Position interpolation: every inverse frequency divided by `factor`.
    Linear { factor: f64 },
}

/// The resolved model configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    /// Which forward pass to build.
    pub architecture: Architecture,
    /// The source's class name (e.g. `LlamaForCausalLM`), kept for provenance.
    pub source_architecture: String,
    /// Width of the residual stream.
    pub hidden_size: u64,
    /// Width of the SwiGLU hidden layer.
    pub intermediate_size: u64,
    /// Decoder layers.
    pub num_layers: u64,
    /// Query heads.
    pub num_heads: u64,
    /// Key/value heads (grouped-query attention when fewer than `num_heads`).
    pub num_kv_heads: u64,
    /// Per-head width.
    pub head_dim: u64,
    /// Vocabulary size (rows of the embedding matrix).
    pub vocab_size: u64,
    /// The context length the model was trained for.
    pub max_position_embeddings: u64,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// RoPE base.
    pub rope_theta: f64,
    /// RoPE frequency scaling, if any.
    pub rope_scaling: Option<RopeScaling>,
    /// Whether the output projection reuses the embedding matrix.
    pub tie_word_embeddings: bool,
    /// Whether q/k/v projections carry biases.
    pub attention_bias: bool,
    /// Sliding-window attention span (Mistral), if any.
    pub sliding_window: Option<u64>,
    /// Beginning-of-sequence token id, if the model has one.
    pub bos_token_id: Option<u32>,
    /// Every token id that ends generation.
    pub eos_token_ids: Vec<u32>,
}

/// Tokenizer files, kept byte for byte.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TokenizerFiles {
    /// `tokenizer.json`, exactly as in the source.
    pub tokenizer_json: Option<String>,
    /// `tokenizer_config.json`, exactly as in the source.
    pub tokenizer_config_json: Option<String>,
    /// The chat template (from `tokenizer_config.json` or `chat_template.jinja`).
    pub chat_template: Option<String>,
    /// Special tokens by role (`bos_token`, `eos_token`, `pad_token`, `unk_token`).
    #[serde(default)]
    pub special_tokens: std::collections::BTreeMap<String, String>,
    /// Whether the tokenizer adds a BOS token when encoding (`add_bos_token`).
    pub add_bos_token: Option<bool>,
}

/// A source file the model was made from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SourceFile {
    /// File name relative to the source directory.
    pub name: String,
    /// Size in bytes.
    pub bytes: u64,
    /// Lower-case hex sha256 of the file.
    pub sha256: String,
}

/// One transformation step applied to the model (conversion, quantization…).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProvenanceStep {
    /// The tool and its version, e.g. `kiln-convert 0.1.0`.
    pub tool: String,
    /// RFC 3339 UTC time the step ran.
    pub created: String,
    /// What the step did, free-form but stable keys (e.g. `{"quantization": {...}}`).
    #[serde(default)]
    pub details: serde_json::Value,
    /// The files it read.
    #[serde(default)]
    pub sources: Vec<SourceFile>,
}

/// The whole metadata document.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Metadata {
    /// The model.
    pub config: ModelConfig,
    /// Tokenizer and chat template.
    #[serde(default)]
    pub tokenizer: TokenizerFiles,
    /// `generation_config.json` as parsed JSON (sampling defaults), or null.
    #[serde(default)]
    pub generation: serde_json::Value,
    /// Every step that produced this file, oldest first.
    #[serde(default)]
    pub provenance: Vec<ProvenanceStep>,
}

impl Metadata {
    /// The weight dtype summary used in reports: quantization applied, if any step recorded one.
    pub fn quantization(&self) -> Option<&serde_json::Value> {
        self.provenance
            .iter()
            .rev()
            .find_map(|s| s.details.get("quantization"))
    }
}

/// The current UTC time as RFC 3339 (`YYYY-MM-DDTHH:MM:SSZ`), without a date library.
pub fn now_rfc3339() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    rfc3339_from_unix(secs)
}

/// The UTC calendar date and time of day of `secs` since the Unix epoch:
/// `(year, month 1..=12, day 1..=31, seconds into the day)`.
///
/// Civil-from-days (Howard Hinnant's algorithm), valid for the proleptic Gregorian calendar;
/// it saves a date-library dependency for the two places Kiln prints dates.
pub fn civil_from_unix(secs: u64) -> (i64, i64, i64, u64) {
    let days = (secs / 86_400) as i64;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d, secs % 86_400)
}

/// Format seconds since the Unix epoch as RFC 3339 UTC.
pub fn rfc3339_from_unix(secs: u64) -> String {
    let (y, m, d, rem) = civil_from_unix(secs);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_known_dates() {
        assert_eq!(rfc3339_from_unix(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339_from_unix(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339_from_unix(1_795_000_000), "2026-11-18T11:06:40Z");
    }
}
