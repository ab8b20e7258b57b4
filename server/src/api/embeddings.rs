//! OpenAI's `/v1/embeddings` request and response.
//!
//! `input` is one text, an array of texts, one array of token ids, or an array of them, as
//! OpenAI takes it. Token ids are the model's input as given, special tokens included (the
//! server adds none). `encoding_format: base64` sends each vector as the base64 of its
//! little-endian float32 bytes, which is what OpenAI's Python SDK asks for by default.
//!
//! Three fields beyond OpenAI's, as other embedding servers name them: `truncate` (cut an
//! input longer than the model takes instead of refusing it), `normalize` (false: the vectors
//! as pooled; OpenAI's are unit length, and so are these by default) and `prompt_name` (one of
//! the prompts the model names, such as `query`, put before every text).

use serde_json::{json, Value};

use super::{boolean, integer, string, unsupported, wrong_type, ApiError, Res, HARMLESS};

/// Most inputs in one request (OpenAI's limit).
pub const MAX_INPUTS: usize = 2048;

pub use kiln_runner::serve::embeddings::EmbedInput;
use kiln_runner::serve::embeddings::EmbedJob;

/// How vectors are written in the response.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Encoding {
    /// JSON numbers.
    Float,
    /// Base64 of little-endian float32 bytes.
    Base64,
}

/// A `/v1/embeddings` request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EmbeddingRequest {
    /// The inputs, in order.
    pub input: EmbedInput,
    /// The `model` field (any name is accepted: the server has one model).
    pub model: Option<String>,
    /// `encoding_format`.
    pub encoding: Encoding,
    /// `dimensions`, if sent.
    pub dimensions: Option<usize>,
    /// Cut long inputs instead of refusing them.
    pub truncate: bool,
    /// Scale vectors to unit length.
    pub normalize: bool,
    /// A prompt the model names, put before every text.
    pub prompt_name: Option<String>,
}

impl EmbeddingRequest {
    /// The engine-side job: what to embed and how, without the protocol's fields.
    pub fn job(&self) -> EmbedJob {
        EmbedJob {
            input: self.input.clone(),
            dimensions: self.dimensions,
            truncate: self.truncate,
            normalize: self.normalize,
            prompt_name: self.prompt_name.clone(),
        }
    }
}

fn parse_input(v: &Value) -> Res<EmbedInput> {
    let too_many = |n: usize| {
        ApiError::invalid(
            "input",
            format!("{n} inputs; at most {MAX_INPUTS} in one request"),
        )
    };
    let ids = |param: &str, a: &[Value]| -> Res<Vec<u32>> {
        if a.is_empty() {
            return Err(ApiError::invalid(
                param,
                format!("`{param}` is an empty array of token ids"),
            ));
        }
        a.iter()
            .enumerate()
            .map(|(i, x)| {
                integer(&format!("{param}[{i}]"), x, 0, u32::MAX as u64).map(|n| n as u32)
            })
            .collect()
    };
    match v {
        Value::String(s) => Ok(EmbedInput::Texts(vec![s.clone()])),
        Value::Array(a) if a.is_empty() => Err(ApiError::invalid(
            "input",
            "`input` is an empty array; send at least one text",
        )),
        Value::Array(a) => match &a[0] {
            Value::String(_) => {
                if a.len() > MAX_INPUTS {
                    return Err(too_many(a.len()));
                }
                a.iter()
                    .enumerate()
                    .map(|(i, x)| string(&format!("input[{i}]"), x).map(str::to_string))
                    .collect::<Res<Vec<_>>>()
                    .map(EmbedInput::Texts)
            }
            Value::Array(_) => {
                if a.len() > MAX_INPUTS {
                    return Err(too_many(a.len()));
                }
                a.iter()
                    .enumerate()
                    .map(|(i, x)| {
                        let param = format!("input[{i}]");
                        match x {
                            Value::Array(inner) => ids(&param, inner),
                            other => Err(wrong_type(&param, "an array of token ids", other)),
                        }
                    })
                    .collect::<Res<Vec<_>>>()
                    .map(EmbedInput::Tokens)
            }
            _ => Ok(EmbedInput::Tokens(vec![ids("input", a)?])),
        },
        other => Err(wrong_type(
            "input",
            "a string, an array of strings, or token ids",
            other,
        )),
    }
}

/// Parse a `/v1/embeddings` body.
pub fn parse_embeddings(body: &[u8]) -> Res<EmbeddingRequest> {
    let obj = super::parse_object(body)?;
    let mut input = None;
    let mut req = EmbeddingRequest {
        input: EmbedInput::Texts(Vec::new()),
        model: None,
        encoding: Encoding::Float,
        dimensions: None,
        truncate: false,
        normalize: true,
        prompt_name: None,
    };
    for (k, v) in &obj {
        if v.is_null() {
            continue;
        }
        match k.as_str() {
            "input" => input = Some(parse_input(v)?),
            "model" => req.model = Some(string(k, v)?.to_string()),
            "encoding_format" => {
                req.encoding = match string(k, v)? {
                    "float" => Encoding::Float,
                    "base64" => Encoding::Base64,
                    other => {
                        return Err(ApiError::invalid(
                            k.as_str(),
                            format!("`encoding_format` is `{other}`; it must be float or base64"),
                        ))
                    }
                }
            }
            "dimensions" => req.dimensions = Some(integer(k, v, 1, u32::MAX as u64)? as usize),
            "truncate" => req.truncate = boolean(k, v)?,
            "normalize" => req.normalize = boolean(k, v)?,
            "prompt_name" => req.prompt_name = Some(string(k, v)?.to_string()),
            k if HARMLESS.contains(&k) => {}
            _ => return Err(unsupported(k, "")),
        }
    }
    req.input = input.ok_or_else(|| ApiError::invalid("input", "`input` is required"))?;
    Ok(req)
}

/// The `list` of `embedding` objects, in input order, with the tokens read as usage.
pub fn embeddings_response(
    model: &str,
    vectors: &[Vec<f32>],
    encoding: Encoding,
    tokens: usize,
) -> Value {
    let data: Vec<Value> = vectors
        .iter()
        .enumerate()
        .map(|(i, v)| {
            let embedding = match encoding {
                Encoding::Float => json!(v),
                Encoding::Base64 => json!(base64_f32(v)),
            };
            json!({"object": "embedding", "index": i, "embedding": embedding})
        })
        .collect();
    json!({
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    })
}

/// The standard base64 (with padding) of `v`'s little-endian float32 bytes.
pub fn base64_f32(v: &[f32]) -> String {
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    base64(&bytes)
}

/// The standard base64 (with padding) of `bytes`.
pub fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = u32::from(b[0]) << 16 | u32::from(b[1]) << 8 | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(char::from(ALPHABET[(n >> (18 - 6 * i) & 63) as usize]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(body: &str) -> Res<EmbeddingRequest> {
        parse_embeddings(body.as_bytes())
    }

    #[test]
    fn every_input_shape_openai_takes() {
        let texts = |v: &[&str]| EmbedInput::Texts(v.iter().map(|s| s.to_string()).collect());
        assert_eq!(parse(r#"{"input":"a"}"#).unwrap().input, texts(&["a"]));
        assert_eq!(parse(r#"{"input":""}"#).unwrap().input, texts(&[""]));
        assert_eq!(
            parse(r#"{"input":["a","b"],"model":"m","user":"u"}"#)
                .unwrap()
                .input,
            texts(&["a", "b"])
        );
        assert_eq!(
            parse(r#"{"input":[1,2,3]}"#).unwrap().input,
            EmbedInput::Tokens(vec![vec![1, 2, 3]])
        );
        assert_eq!(
            parse(r#"{"input":[[1],[2,3]]}"#).unwrap().input,
            EmbedInput::Tokens(vec![vec![1], vec![2, 3]])
        );
        let r = parse(
            r#"{"input":"a","encoding_format":"base64","dimensions":384,"truncate":true,
                "normalize":false,"prompt_name":"query","model":null}"#,
        )
        .unwrap();
        assert_eq!(r.encoding, Encoding::Base64);
        assert_eq!(r.dimensions, Some(384));
        assert!(r.truncate && !r.normalize);
        assert_eq!(r.prompt_name.as_deref(), Some("query"));
        assert_eq!(r.model, None);
        let d = parse(r#"{"input":"a"}"#).unwrap();
        assert!(d.normalize && !d.truncate && d.encoding == Encoding::Float);
    }

    #[test]
    fn refusals_name_the_field() {
        let many = format!(
            r#"{{"input":[{}]}}"#,
            vec![r#""x""#; MAX_INPUTS + 1].join(",")
        );
        for (body, param) in [
            (r#"{}"#, "input"),
            (r#"{"input":[]}"#, "input"),
            (r#"{"input":5}"#, "input"),
            (r#"{"input":{"a":1}}"#, "input"),
            (r#"{"input":["a",3]}"#, "input[1]"),
            (r#"{"input":[1,-2]}"#, "input[1]"),
            (r#"{"input":[1,"a"]}"#, "input[1]"),
            (r#"{"input":[[1],[]]}"#, "input[1]"),
            (r#"{"input":[[1],2]}"#, "input[1]"),
            (r#"{"input":[[1,2.5]]}"#, "input[0][1]"),
            (r#"{"input":[1,4294967296]}"#, "input[1]"),
            (many.as_str(), "input"),
            (
                r#"{"input":"a","encoding_format":"int8"}"#,
                "encoding_format",
            ),
            (r#"{"input":"a","encoding_format":1}"#, "encoding_format"),
            (r#"{"input":"a","dimensions":0}"#, "dimensions"),
            (r#"{"input":"a","truncate":"yes"}"#, "truncate"),
            (r#"{"input":"a","normalize":1}"#, "normalize"),
            (r#"{"input":"a","prompt_name":2}"#, "prompt_name"),
            (r#"{"input":"a","model":2}"#, "model"),
            (r#"{"input":"a","stream":true}"#, "stream"),
        ] {
            let e = parse(body).unwrap_err();
            assert_eq!(e.status, 400, "{body}");
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {}", e.message);
        }
        assert_eq!(parse("[1]").unwrap_err().param, None);
        assert_eq!(parse("{").unwrap_err().status, 400);
    }

    #[test]
    fn base64_is_little_endian_float32() {
        // 1.0f32 = 00 00 80 3f; -2.0f32 = 00 00 00 c0.
        assert_eq!(base64_f32(&[1.0]), "AACAPw==");
        assert_eq!(base64_f32(&[1.0, -2.0]), "AACAPwAAAMA=");
        assert_eq!(base64_f32(&[]), "");
        // Every residue of the byte count (4k bytes is always 4k ≡ 1 mod 3 or 2 or 0).
        assert_eq!(base64_f32(&[1.0; 3]), "AACAPwAAgD8AAIA/");
        assert_eq!(base64_f32(&[f32::from_bits(0xfbff_ffff)]), "////+w==");
        let r = embeddings_response("m", &[vec![0.5, 0.25]], Encoding::Float, 7);
        assert_eq!(
            r,
            json!({"object": "list", "model": "m",
                   "data": [{"object": "embedding", "index": 0, "embedding": [0.5, 0.25]}],
                   "usage": {"prompt_tokens": 7, "total_tokens": 7}})
        );
        let r = embeddings_response("m", &[vec![1.0], vec![1.0]], Encoding::Base64, 2);
        assert_eq!(r["data"][1]["embedding"], "AACAPw==");
        assert_eq!(r["data"][1]["index"], 1);
    }
}
