//! OpenAI's request and response shapes for `/v1/chat/completions` and `/v1/completions`
//! (and, in [`embeddings`], `/v1/embeddings`).
//!
//! A body is parsed into a `serde_json::Value` and then walked field by field into
//! [`ChatRequest`] or [`CompletionRequest`], so every refusal names its field as OpenAI does
//! ([`ApiError::param`]). Nothing is ignored silently: a field the server does not implement
//! (`n > 1`, `tools`, `logit_bias`, an unknown name) is a 400 naming it, since a client that
//! asked for it would otherwise get an answer it did not ask for. `null` counts as absent, as
//! OpenAI's own SDKs send it.
//!
//! The builders in [`response`] (re-exported here) make the response objects:
//! `chat.completion`, `chat.completion.chunk`, `text_completion`, and both `logprobs` shapes.

use serde_json::{json, Map, Value};

use kiln_runner::chat::Message;

pub mod embeddings;
pub mod response;
pub use response::{
    chat_chunk_finish, chat_chunk_role, chat_chunk_text, chat_chunk_usage, chat_completion,
    chat_logprobs, legacy_logprobs, models, text_completion, text_completion_usage, usage, Meta,
    TokenLogprob,
};

/// An error as OpenAI reports it: `{"error": {message, type, param, code}}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// The HTTP status.
    pub status: u16,
    /// What went wrong, for a person.
    pub message: String,
    /// OpenAI's `type`: `invalid_request_error`, `authentication_error`, `server_error`…
    pub kind: &'static str,
    /// The request field at fault (`messages[1].content`), if one is.
    pub param: Option<String>,
    /// OpenAI's `code` (`invalid_api_key`…), if any.
    pub code: Option<&'static str>,
}

impl ApiError {
    /// A 400 about field `param`.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> ApiError {
        ApiError {
            status: 400,
            message: message.into(),
            kind: "invalid_request_error",
            param: Some(param.into()),
            code: None,
        }
    }

    /// An error not about one field.
    pub fn new(status: u16, kind: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
        }
    }

    /// The response body.
    pub fn to_json(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

type Res<T> = std::result::Result<T, ApiError>;

/// Parse a body as a JSON object; malformed JSON is a 400 saying where it broke.
pub fn parse_object(body: &[u8]) -> Res<Map<String, Value>> {
    let value: Value = serde_json::from_slice(body).map_err(|e| {
        ApiError::new(
            400,
            "invalid_request_error",
            format!("the request body is not valid JSON: {e}"),
        )
    })?;
    match value {
        Value::Object(m) => Ok(m),
        other => Err(ApiError::new(
            400,
            "invalid_request_error",
            format!(
                "the request body must be a JSON object, not {}",
                type_name(&other)
            ),
        )),
    }
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn wrong_type(param: &str, want: &str, v: &Value) -> ApiError {
    ApiError::invalid(
        param,
        format!("`{param}` must be {want}, not {}", type_name(v)),
    )
}

fn number(param: &str, v: &Value, lo: f64, hi: f64) -> Res<f32> {
    let x = v.as_f64().ok_or_else(|| wrong_type(param, "a number", v))?;
    if !(lo..=hi).contains(&x) {
        return Err(ApiError::invalid(
            param,
            format!("`{param}` is {x}; it must be between {lo} and {hi}"),
        ));
    }
    Ok(x as f32)
}

fn integer(param: &str, v: &Value, lo: u64, hi: u64) -> Res<u64> {
    let n = v.as_u64().or_else(|| {
        v.as_f64()
            .filter(|x| x.fract() == 0.0 && *x >= 0.0 && *x < 1.8e19)
            .map(|x| x as u64)
    });
    let n = match n {
        Some(n) => n,
        None if v.as_i64().is_some() => {
            return Err(ApiError::invalid(
                param,
                format!("`{param}` is {v}; it must be at least {lo}"),
            ))
        }
        None => return Err(wrong_type(param, "an integer", v)),
    };
    if !(lo..=hi).contains(&n) {
        return Err(ApiError::invalid(
            param,
            format!("`{param}` is {n}; it must be between {lo} and {hi}"),
        ));
    }
    Ok(n)
}

fn boolean(param: &str, v: &Value) -> Res<bool> {
    v.as_bool().ok_or_else(|| wrong_type(param, "a boolean", v))
}

fn string<'v>(param: &str, v: &'v Value) -> Res<&'v str> {
    v.as_str().ok_or_else(|| wrong_type(param, "a string", v))
}

fn unsupported(param: &str, why: &str) -> ApiError {
    ApiError::invalid(
        param,
        format!("`{param}` is not supported by this server{why}"),
    )
}

/// Most sequences `stop` may list (OpenAI's limit).
pub const MAX_STOP: usize = 4;

/// Most alternatives `top_logprobs` may ask for (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: u64 = 20;

/// Most alternatives the legacy `logprobs` may ask for (OpenAI's limit).
pub const MAX_LEGACY_LOGPROBS: u64 = 5;

/// Sampling fields both endpoints share; `None`: the server's default.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Sampling {
    /// 0–2.
    pub temperature: Option<f32>,
    /// 0–1.
    pub top_p: Option<f32>,
    /// 0: all.
    pub top_k: Option<usize>,
    /// 0–1.
    pub min_p: Option<f32>,
    /// A fixed seed (an `int64` in OpenAI's API: negative seeds keep their bits).
    pub seed: Option<u64>,
    /// −2..2.
    pub presence_penalty: Option<f32>,
    /// −2..2.
    pub frequency_penalty: Option<f32>,
    /// llama.cpp's and transformers' multiplicative penalty on tokens already in the context
    /// (`repeat_penalty`; 1 is off): 0.01–10.
    pub repeat_penalty: Option<f32>,
}

/// What the output must look like.
#[derive(Debug, Clone, PartialEq)]
pub enum ResponseFormat {
    /// Anything.
    Text,
    /// Some JSON object.
    JsonObject,
    /// JSON following this schema.
    JsonSchema(Value),
}

/// Fields both endpoints share, parsed by [`Common::field`].
#[derive(Debug, Clone, PartialEq)]
pub struct Common {
    /// The `model` field (any name is accepted: the server has one model).
    pub model: Option<String>,
    /// Sampling settings.
    pub sampling: Sampling,
    /// `max_tokens` / `max_completion_tokens`.
    pub max_tokens: Option<usize>,
    /// Stop strings (at most four, none empty).
    pub stop: Vec<String>,
    /// Stream the answer as Server-Sent Events.
    pub stream: bool,
    /// `stream_options.include_usage`.
    pub include_usage: bool,
    /// Keep going past the model's stop tokens (llama-server's and vLLM's extension).
    pub ignore_eos: bool,
    /// `response_format`.
    pub response_format: ResponseFormat,
}

impl Default for Common {
    fn default() -> Self {
        Common {
            model: None,
            sampling: Sampling::default(),
            max_tokens: None,
            stop: Vec::new(),
            stream: false,
            include_usage: false,
            ignore_eos: false,
            response_format: ResponseFormat::Text,
        }
    }
}

/// Fields accepted and without effect on one model's output.
const HARMLESS: [&str; 4] = ["user", "metadata", "store", "service_tier"];

impl Common {
    /// Take field `key` if it is a shared one; `Ok(false)` if it is not.
    fn field(&mut self, key: &str, v: &Value) -> Res<bool> {
        let s = &mut self.sampling;
        match key {
            "model" => self.model = Some(string(key, v)?.to_string()),
            "temperature" => s.temperature = Some(number(key, v, 0.0, 2.0)?),
            "top_p" => s.top_p = Some(number(key, v, 0.0, 1.0)?),
            "min_p" => s.min_p = Some(number(key, v, 0.0, 1.0)?),
            "top_k" => s.top_k = Some(integer(key, v, 0, u32::MAX as u64)? as usize),
            "seed" => {
                s.seed = Some(match v.as_i64() {
                    Some(n) => n as u64,
                    None => integer(key, v, 0, u64::MAX)?,
                })
            }
            "presence_penalty" => s.presence_penalty = Some(number(key, v, -2.0, 2.0)?),
            "frequency_penalty" => s.frequency_penalty = Some(number(key, v, -2.0, 2.0)?),
            "repeat_penalty" => s.repeat_penalty = Some(number(key, v, 0.01, 10.0)?),
            "max_tokens" | "max_completion_tokens" => {
                self.max_tokens = Some(integer(key, v, 1, u32::MAX as u64)? as usize)
            }
            "stop" => self.stop = parse_stop(v)?,
            "stream" => self.stream = boolean(key, v)?,
            "stream_options" => {
                let Value::Object(o) = v else {
                    return Err(wrong_type(key, "an object", v));
                };
                for (k, x) in o {
                    match k.as_str() {
                        "include_usage" => {
                            self.include_usage = boolean("stream_options.include_usage", x)?
                        }
                        _ => {
                            return Err(unsupported(&format!("stream_options.{k}"), ""));
                        }
                    }
                }
            }
            "ignore_eos" => self.ignore_eos = boolean(key, v)?,
            "response_format" => self.response_format = parse_response_format(v)?,
            "n" => {
                if integer(key, v, 1, u64::MAX)? != 1 {
                    return Err(unsupported(key, " with a value other than 1"));
                }
            }
            "logit_bias" => return Err(unsupported(key, "")),
            k if HARMLESS.contains(&k) => {}
            _ => return Ok(false),
        }
        Ok(true)
    }

    fn check(&self) -> Res<()> {
        if !self.stream && self.include_usage {
            return Err(ApiError::invalid(
                "stream_options",
                "`stream_options` is only allowed when `stream` is true",
            ));
        }
        Ok(())
    }
}

fn parse_stop(v: &Value) -> Res<Vec<String>> {
    let list = match v {
        Value::String(s) => vec![s.clone()],
        Value::Array(a) => {
            if a.len() > MAX_STOP {
                return Err(ApiError::invalid(
                    "stop",
                    format!(
                        "`stop` lists {} sequences; at most {MAX_STOP} are allowed",
                        a.len()
                    ),
                ));
            }
            a.iter()
                .enumerate()
                .map(|(i, x)| string(&format!("stop[{i}]"), x).map(str::to_string))
                .collect::<Res<Vec<_>>>()?
        }
        other => return Err(wrong_type("stop", "a string or an array of strings", other)),
    };
    if list.iter().any(String::is_empty) {
        return Err(ApiError::invalid(
            "stop",
            "`stop` sequences must not be empty",
        ));
    }
    Ok(list)
}

fn parse_response_format(v: &Value) -> Res<ResponseFormat> {
    let p = "response_format";
    let Value::Object(o) = v else {
        return Err(wrong_type(p, "an object", v));
    };
    let kind = match o.get("type") {
        Some(t) => string("response_format.type", t)?,
        None => {
            return Err(ApiError::invalid(
                "response_format.type",
                "`response_format.type` is required",
            ))
        }
    };
    let allowed: &[&str] = match kind {
        "text" | "json_object" => &["type"],
        "json_schema" => &["type", "json_schema"],
        other => {
            return Err(ApiError::invalid(
                "response_format.type",
                format!(
                    "`response_format.type` `{other}` is not one of text, json_object, json_schema"
                ),
            ))
        }
    };
    if let Some(k) = o.keys().find(|k| !allowed.contains(&k.as_str())) {
        return Err(unsupported(&format!("response_format.{k}"), ""));
    }
    Ok(match kind {
        "text" => ResponseFormat::Text,
        "json_object" => ResponseFormat::JsonObject,
        _ => {
            let p = "response_format.json_schema";
            let js = match o.get("json_schema") {
                Some(Value::Object(js)) => js,
                Some(other) => return Err(wrong_type(p, "an object", other)),
                None => return Err(ApiError::invalid(p, format!("`{p}` is required"))),
            };
            for k in js.keys() {
                if !["name", "description", "schema", "strict"].contains(&k.as_str()) {
                    return Err(unsupported(&format!("{p}.{k}"), ""));
                }
            }
            match js.get("schema") {
                Some(s @ Value::Object(_)) => ResponseFormat::JsonSchema(s.clone()),
                Some(other) => return Err(wrong_type(&format!("{p}.schema"), "an object", other)),
                None => {
                    return Err(ApiError::invalid(
                        format!("{p}.schema"),
                        format!("`{p}.schema` is required"),
                    ))
                }
            }
        }
    })
}

/// A `/v1/chat/completions` request.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatRequest {
    /// The conversation, its content parts joined.
    pub messages: Vec<Message>,
    /// The shared fields.
    pub common: Common,
    /// `Some(k)`: report log-probabilities with `k` alternatives (`logprobs: true`,
    /// `top_logprobs: k`).
    pub logprobs: Option<usize>,
}

/// The roles a message may have.
const ROLES: [&str; 4] = ["system", "developer", "user", "assistant"];

fn parse_content(param: &str, v: &Value) -> Res<String> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut text = String::new();
            for (i, part) in parts.iter().enumerate() {
                let pp = format!("{param}[{i}]");
                let Value::Object(o) = part else {
                    return Err(wrong_type(&pp, "an object", part));
                };
                match o
                    .get("type")
                    .map(|t| string(&format!("{pp}.type"), t))
                    .transpose()?
                {
                    Some("text") => {}
                    Some(other) => {
                        return Err(ApiError::invalid(
                            format!("{pp}.type"),
                            format!(
                                "content parts of type `{other}` are not supported; only `text` is"
                            ),
                        ))
                    }
                    None => {
                        return Err(ApiError::invalid(
                            format!("{pp}.type"),
                            format!("`{pp}.type` is required"),
                        ))
                    }
                }
                if let Some(k) = o.keys().find(|k| *k != "type" && *k != "text") {
                    return Err(unsupported(&format!("{pp}.{k}"), ""));
                }
                match o.get("text") {
                    Some(t) => text.push_str(string(&format!("{pp}.text"), t)?),
                    None => {
                        return Err(ApiError::invalid(
                            format!("{pp}.text"),
                            format!("`{pp}.text` is required"),
                        ))
                    }
                }
            }
            Ok(text)
        }
        other => Err(wrong_type(
            param,
            "a string or an array of content parts",
            other,
        )),
    }
}

fn parse_messages(v: &Value) -> Res<Vec<Message>> {
    let Value::Array(list) = v else {
        return Err(wrong_type("messages", "an array", v));
    };
    if list.is_empty() {
        return Err(ApiError::invalid(
            "messages",
            "`messages` must not be empty",
        ));
    }
    list.iter()
        .enumerate()
        .map(|(i, m)| {
            let p = format!("messages[{i}]");
            let Value::Object(o) = m else {
                return Err(wrong_type(&p, "an object", m));
            };
            let role = match o.get("role") {
                Some(r) => string(&format!("{p}.role"), r)?,
                None => {
                    return Err(ApiError::invalid(
                        format!("{p}.role"),
                        format!("`{p}.role` is required"),
                    ))
                }
            };
            if !ROLES.contains(&role) {
                return Err(ApiError::invalid(
                    format!("{p}.role"),
                    format!(
                        "role `{role}` is not supported; use system, developer, user or assistant"
                    ),
                ));
            }
            let mut content = None;
            for (k, x) in o {
                match k.as_str() {
                    "role" | "name" => {}
                    "content" if x.is_null() => {}
                    "content" => content = Some(parse_content(&format!("{p}.content"), x)?),
                    _ => return Err(unsupported(&format!("{p}.{k}"), "")),
                }
            }
            let content = content.ok_or_else(|| {
                ApiError::invalid(format!("{p}.content"), format!("`{p}.content` is required"))
            })?;
            Ok(Message::new(role, content))
        })
        .collect()
}

/// Parse a `/v1/chat/completions` body.
pub fn parse_chat(body: &[u8]) -> Res<ChatRequest> {
    let obj = parse_object(body)?;
    let mut common = Common::default();
    let mut messages = None;
    let mut logprobs = false;
    let mut top = None;
    for (k, v) in &obj {
        if v.is_null() {
            continue;
        }
        if common.field(k, v)? {
            continue;
        }
        match k.as_str() {
            "messages" => messages = Some(parse_messages(v)?),
            "logprobs" => logprobs = boolean(k, v)?,
            "top_logprobs" => top = Some(integer(k, v, 0, MAX_TOP_LOGPROBS)? as usize),
            "parallel_tool_calls" => {
                if boolean(k, v)? {
                    return Err(unsupported(k, " (no tools are)"));
                }
            }
            "tools" | "tool_choice" | "functions" | "function_call" => {
                return Err(unsupported(k, ": it has no tool calling"))
            }
            "audio" | "modalities" => return Err(unsupported(k, ": it produces text only")),
            _ => return Err(unsupported(k, "")),
        }
    }
    common.check()?;
    let messages =
        messages.ok_or_else(|| ApiError::invalid("messages", "`messages` is required"))?;
    if top.is_some() && !logprobs {
        return Err(ApiError::invalid(
            "top_logprobs",
            "`top_logprobs` needs `logprobs` set to true",
        ));
    }
    Ok(ChatRequest {
        messages,
        common,
        logprobs: logprobs.then(|| top.unwrap_or(0)),
    })
}

/// A completion prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prompt {
    /// Text to tokenize.
    Text(String),
    /// Token ids as they are.
    Tokens(Vec<u32>),
}

/// A `/v1/completions` request.
#[derive(Debug, Clone, PartialEq)]
pub struct CompletionRequest {
    /// The prompt.
    pub prompt: Prompt,
    /// The shared fields.
    pub common: Common,
    /// The legacy `logprobs`: `Some(k)` alternatives per token (0–5).
    pub logprobs: Option<usize>,
}

fn parse_prompt(v: &Value) -> Res<Prompt> {
    match v {
        Value::String(s) => Ok(Prompt::Text(s.clone())),
        Value::Array(a) => match a.first() {
            Some(Value::String(_)) => {
                if a.len() > 1 {
                    return Err(ApiError::invalid(
                        "prompt",
                        "several prompts in one request are not supported; send one",
                    ));
                }
                Ok(Prompt::Text(string("prompt[0]", &a[0])?.to_string()))
            }
            Some(Value::Array(_)) => Err(ApiError::invalid(
                "prompt",
                "several prompts in one request are not supported; send one",
            )),
            Some(_) => a
                .iter()
                .enumerate()
                .map(|(i, x)| {
                    integer(&format!("prompt[{i}]"), x, 0, u32::MAX as u64).map(|n| n as u32)
                })
                .collect::<Res<Vec<_>>>()
                .map(Prompt::Tokens),
            None => Err(ApiError::invalid("prompt", "`prompt` must not be empty")),
        },
        other => Err(wrong_type(
            "prompt",
            "a string or an array of token ids",
            other,
        )),
    }
}

/// Parse a `/v1/completions` body.
pub fn parse_completion(body: &[u8]) -> Res<CompletionRequest> {
    let obj = parse_object(body)?;
    let mut common = Common::default();
    let mut prompt = None;
    let mut logprobs = None;
    for (k, v) in &obj {
        if v.is_null() {
            continue;
        }
        if common.field(k, v)? {
            continue;
        }
        match k.as_str() {
            "prompt" => prompt = Some(parse_prompt(v)?),
            "logprobs" => logprobs = Some(integer(k, v, 0, MAX_LEGACY_LOGPROBS)? as usize),
            "echo" => {
                if boolean(k, v)? {
                    return Err(unsupported(k, " (only false is)"));
                }
            }
            "best_of" => {
                if integer(k, v, 1, u64::MAX)? != 1 {
                    return Err(unsupported(k, " with a value other than 1"));
                }
            }
            _ => return Err(unsupported(k, "")),
        }
    }
    common.check()?;
    let prompt = prompt.ok_or_else(|| ApiError::invalid("prompt", "`prompt` is required"))?;
    Ok(CompletionRequest {
        prompt,
        common,
        logprobs,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat_err(body: &str) -> ApiError {
        parse_chat(body.as_bytes()).unwrap_err()
    }

    fn with(extra: &str) -> String {
        format!(r#"{{"model":"m","messages":[{{"role":"user","content":"hi"}}]{extra}}}"#)
    }

    #[test]
    fn a_full_chat_request_parses() {
        let r = parse_chat(
            with(
                r#","temperature":0.5,"top_p":0.9,"top_k":40,"min_p":0.05,"seed":-1,
                "max_completion_tokens":7,"stop":"x","presence_penalty":1,"frequency_penalty":-1,
                "logprobs":true,"top_logprobs":3,"stream":true,"stream_options":{"include_usage":true},
                "response_format":{"type":"json_schema","json_schema":{"name":"a","schema":{"type":"object"}}},
                "n":1,"user":"u","metadata":{},"store":false,"parallel_tool_calls":false,"tools":null"#,
            )
            .as_bytes(),
        )
        .unwrap();
        assert_eq!(r.messages, vec![Message::new("user", "hi")]);
        let s = &r.common.sampling;
        assert_eq!(
            (s.temperature, s.top_p, s.top_k, s.min_p, s.seed),
            (Some(0.5), Some(0.9), Some(40), Some(0.05), Some(u64::MAX))
        );
        assert_eq!(
            (s.presence_penalty, s.frequency_penalty),
            (Some(1.0), Some(-1.0))
        );
        assert_eq!(r.common.max_tokens, Some(7));
        assert_eq!(r.common.stop, vec!["x"]);
        assert!(r.common.stream && r.common.include_usage);
        assert_eq!(r.logprobs, Some(3));
        assert_eq!(
            r.common.response_format,
            ResponseFormat::JsonSchema(json!({"type":"object"}))
        );
    }

    #[test]
    fn content_parts_are_joined() {
        let r = parse_chat(
            br#"{"messages":[{"role":"developer","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]},{"role":"assistant","content":"c","name":"x"}]}"#,
        )
        .unwrap();
        assert_eq!(
            r.messages,
            vec![
                Message::new("developer", "ab"),
                Message::new("assistant", "c")
            ]
        );
    }

    /// Each case: extra fields, the `param` the error must name, and a word of its message.
    #[test]
    fn every_chat_field_error_names_its_field() {
        let cases: &[(&str, &str, &str)] = &[
            (r#","temperature":"hot""#, "temperature", "a number"),
            (r#","temperature":2.5"#, "temperature", "between"),
            (r#","top_p":1.5"#, "top_p", "between"),
            (r#","top_k":-1"#, "top_k", "at least"),
            (r#","top_k":1.5"#, "top_k", "integer"),
            (r#","min_p":2"#, "min_p", "between"),
            (r#","seed":"x""#, "seed", "integer"),
            (r#","max_tokens":0"#, "max_tokens", "between"),
            (
                r#","max_completion_tokens":"9""#,
                "max_completion_tokens",
                "integer",
            ),
            (r#","stop":["a","b","c","d","e"]"#, "stop", "at most"),
            (r#","stop":[""]"#, "stop", "empty"),
            (r#","stop":[1]"#, "stop[0]", "string"),
            (r#","stop":7"#, "stop", "string"),
            (r#","presence_penalty":3"#, "presence_penalty", "between"),
            (r#","frequency_penalty":-3"#, "frequency_penalty", "between"),
            (r#","logprobs":1"#, "logprobs", "boolean"),
            (r#","top_logprobs":2"#, "top_logprobs", "logprobs"),
            (
                r#","logprobs":true,"top_logprobs":21"#,
                "top_logprobs",
                "between",
            ),
            (r#","stream":"yes""#, "stream", "boolean"),
            (
                r#","stream_options":{"include_usage":true}"#,
                "stream_options",
                "stream",
            ),
            (
                r#","stream":true,"stream_options":{"x":1}"#,
                "stream_options.x",
                "not supported",
            ),
            (
                r#","response_format":{"type":"xml"}"#,
                "response_format.type",
                "not one of",
            ),
            (
                r#","response_format":{}"#,
                "response_format.type",
                "required",
            ),
            (
                r#","response_format":{"type":"json_schema"}"#,
                "response_format.json_schema",
                "required",
            ),
            (
                r#","response_format":{"type":"json_schema","json_schema":{"name":"a"}}"#,
                "response_format.json_schema.schema",
                "required",
            ),
            (r#","n":2"#, "n", "other than 1"),
            (r#","tools":[]"#, "tools", "tool"),
            (r#","tool_choice":"none""#, "tool_choice", "tool"),
            (r#","functions":[]"#, "functions", "tool"),
            (r#","logit_bias":{}"#, "logit_bias", "not supported"),
            (r#","audio":{}"#, "audio", "text only"),
            (r#","modalities":["text"]"#, "modalities", "text only"),
            (r#","prediction":{}"#, "prediction", "not supported"),
            (
                r#","parallel_tool_calls":true"#,
                "parallel_tool_calls",
                "not supported",
            ),
            (r#","frobnicate":1"#, "frobnicate", "not supported"),
            (r#","model":3"#, "model", "string"),
        ];
        for (extra, param, word) in cases {
            let e = chat_err(&with(extra));
            assert_eq!(e.status, 400, "{extra}");
            assert_eq!(e.param.as_deref(), Some(*param), "{extra}: {}", e.message);
            assert!(e.message.contains(word), "{extra}: {}", e.message);
        }
    }

    #[test]
    fn every_message_error_names_its_field() {
        let cases: &[(&str, &str)] = &[
            (r#"{"model":"m"}"#, "messages"),
            (r#"{"messages":[]}"#, "messages"),
            (r#"{"messages":{}}"#, "messages"),
            (r#"{"messages":["hi"]}"#, "messages[0]"),
            (r#"{"messages":[{"content":"hi"}]}"#, "messages[0].role"),
            (
                r#"{"messages":[{"role":"tool","content":"x"}]}"#,
                "messages[0].role",
            ),
            (r#"{"messages":[{"role":"user"}]}"#, "messages[0].content"),
            (
                r#"{"messages":[{"role":"user","content":5}]}"#,
                "messages[0].content",
            ),
            (
                r#"{"messages":[{"role":"user","content":"a"},{"role":"user","content":[{"type":"image_url","image_url":{}}]}]}"#,
                "messages[1].content[0].type",
            ),
            (
                r#"{"messages":[{"role":"user","content":[{"type":"input_audio"}]}]}"#,
                "messages[0].content[0].type",
            ),
            (
                r#"{"messages":[{"role":"user","content":[{"type":"text"}]}]}"#,
                "messages[0].content[0].text",
            ),
            (
                r#"{"messages":[{"role":"assistant","content":null,"tool_calls":[]}]}"#,
                "messages[0].tool_calls",
            ),
        ];
        for (body, param) in cases {
            let e = chat_err(body);
            assert_eq!(e.param.as_deref(), Some(*param), "{body}: {}", e.message);
        }
    }

    #[test]
    fn malformed_json_says_where_it_broke() {
        let e = chat_err("{\"messages\": [\n  {\"role\": }");
        assert_eq!((e.status, e.param.as_deref()), (400, None));
        assert!(e.message.contains("line 2"), "{}", e.message);
        assert!(chat_err("[1]").message.contains("an array"));
        let j = e.to_json();
        assert_eq!(j["error"]["type"], "invalid_request_error");
        assert!(j["error"]["code"].is_null());
    }

    #[test]
    fn completion_requests_parse_and_refuse_what_they_cannot_do() {
        let r = parse_completion(
            br#"{"prompt":["hi"],"echo":false,"ignore_eos":true,"logprobs":2,"max_tokens":null}"#,
        )
        .unwrap();
        assert_eq!(r.prompt, Prompt::Text("hi".into()));
        assert!(r.common.ignore_eos);
        assert_eq!(r.logprobs, Some(2));
        assert_eq!(r.common.max_tokens, None);
        let r = parse_completion(br#"{"prompt":[1,2,3]}"#).unwrap();
        assert_eq!(r.prompt, Prompt::Tokens(vec![1, 2, 3]));
        let cases: &[(&str, &str)] = &[
            (r#"{}"#, "prompt"),
            (r#"{"prompt":[]}"#, "prompt"),
            (r#"{"prompt":["a","b"]}"#, "prompt"),
            (r#"{"prompt":[[1]]}"#, "prompt"),
            (r#"{"prompt":[1,"a"]}"#, "prompt[1]"),
            (r#"{"prompt":[1,-2]}"#, "prompt[1]"),
            (r#"{"prompt":5}"#, "prompt"),
            (r#"{"prompt":"a","echo":true}"#, "echo"),
            (r#"{"prompt":"a","suffix":"b"}"#, "suffix"),
            (r#"{"prompt":"a","logprobs":6}"#, "logprobs"),
            (r#"{"prompt":"a","logprobs":true}"#, "logprobs"),
            (r#"{"prompt":"a","ignore_eos":1}"#, "ignore_eos"),
            (r#"{"prompt":"a","best_of":2}"#, "best_of"),
            (r#"{"prompt":"a","messages":[]}"#, "messages"),
        ];
        for (body, param) in cases {
            let e = parse_completion(body.as_bytes()).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(*param), "{body}: {}", e.message);
        }
    }
}
