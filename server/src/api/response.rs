//! The response objects: `chat.completion`, `chat.completion.chunk`, `text_completion`, both
//! `logprobs` shapes, `usage` and the model list.

use serde_json::{json, Map, Value};

use kiln_runner::engine::job::{Finish, Usage};

/// What every response object of one request shares.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Meta {
    /// `chatcmpl-…` or `cmpl-…`, the same on every chunk.
    pub id: String,
    /// Unix seconds.
    pub created: u64,
    /// The model's name.
    pub model: String,
    /// `system_fingerprint`.
    pub fingerprint: String,
}

/// A generated token's text and log-probability, with its alternatives', for the `logprobs`
/// shapes.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    /// The token's text.
    pub text: String,
    /// Its natural-log probability.
    pub logprob: f32,
    /// The alternatives, most likely first.
    pub top: Vec<(String, f32)>,
}

/// `usage`, with `prompt_tokens_details.cached_tokens`.
pub fn usage(u: &Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    })
}

/// A log-probability as JSON: `-inf` (a token the model ruled out) becomes OpenAI's floor
/// instead of a `null`.
fn lp(x: f32) -> Value {
    json!(if x.is_finite() { x } else { -9999.0 })
}

/// The chat `logprobs` object: `{content: [{token, logprob, bytes, top_logprobs}]}`.
pub fn chat_logprobs(tokens: &[TokenLogprob]) -> Value {
    let entry = |text: &str, logprob: f32| json!({"token": text, "logprob": lp(logprob), "bytes": text.as_bytes()});
    let content: Vec<Value> = tokens
        .iter()
        .map(|t| {
            let mut e = entry(&t.text, t.logprob);
            e["top_logprobs"] = t.top.iter().map(|(s, l)| entry(s, *l)).collect();
            e
        })
        .collect();
    json!({"content": content, "refusal": null})
}

/// The legacy completions `logprobs` object; `offset` is the text offset (in characters) of
/// the first token.
pub fn legacy_logprobs(tokens: &[TokenLogprob], mut offset: usize) -> Value {
    let mut text_offset = Vec::with_capacity(tokens.len());
    for t in tokens {
        text_offset.push(offset);
        offset += t.text.chars().count();
    }
    json!({
        "tokens": tokens.iter().map(|t| t.text.as_str()).collect::<Vec<_>>(),
        "token_logprobs": tokens.iter().map(|t| lp(t.logprob)).collect::<Vec<_>>(),
        "top_logprobs": tokens.iter().map(|t| {
            t.top.iter().map(|(s, l)| (s.clone(), lp(*l))).collect::<Map<String, Value>>()
        }).collect::<Vec<_>>(),
        "text_offset": text_offset,
    })
}

/// A whole `chat.completion`.
pub fn chat_completion(
    meta: &Meta,
    text: &str,
    finish: Finish,
    u: &Usage,
    logprobs: Option<Value>,
) -> Value {
    json!({
        "id": meta.id,
        "object": "chat.completion",
        "created": meta.created,
        "model": meta.model,
        "system_fingerprint": meta.fingerprint,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": text, "refusal": null},
            "logprobs": logprobs,
            "finish_reason": finish.name(),
        }],
        "usage": usage(u),
    })
}

fn chunk(meta: &Meta, choices: Value, u: Option<&Usage>) -> Value {
    json!({
        "id": meta.id,
        "object": "chat.completion.chunk",
        "created": meta.created,
        "model": meta.model,
        "system_fingerprint": meta.fingerprint,
        "choices": choices,
        "usage": u.map(usage),
    })
}

/// The first `chat.completion.chunk`: `delta.role = "assistant"`.
pub fn chat_chunk_role(meta: &Meta) -> Value {
    chunk(
        meta,
        json!([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}]),
        None,
    )
}

/// A `chat.completion.chunk` carrying new text.
pub fn chat_chunk_text(meta: &Meta, text: &str, logprobs: Option<Value>) -> Value {
    chunk(
        meta,
        json!([{"index": 0, "delta": {"content": text}, "logprobs": logprobs, "finish_reason": null}]),
        None,
    )
}

/// The `chat.completion.chunk` that ends the choice.
pub fn chat_chunk_finish(meta: &Meta, finish: Finish) -> Value {
    chunk(
        meta,
        json!([{"index": 0, "delta": {}, "logprobs": null, "finish_reason": finish.name()}]),
        None,
    )
}

/// The last chunk when `stream_options.include_usage`: no choices, the usage.
pub fn chat_chunk_usage(meta: &Meta, u: &Usage) -> Value {
    chunk(meta, json!([]), Some(u))
}

/// A `text_completion`: whole (`usage` given) or one streamed chunk (`usage` `None`;
/// `finish` only on the last).
pub fn text_completion(
    meta: &Meta,
    text: &str,
    finish: Option<Finish>,
    u: Option<&Usage>,
    logprobs: Option<Value>,
) -> Value {
    json!({
        "id": meta.id,
        "object": "text_completion",
        "created": meta.created,
        "model": meta.model,
        "system_fingerprint": meta.fingerprint,
        "choices": [{
            "index": 0,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": finish.map(Finish::name),
        }],
        "usage": u.map(usage),
    })
}

/// The final streamed `text_completion` when `stream_options.include_usage`.
pub fn text_completion_usage(meta: &Meta, u: &Usage) -> Value {
    json!({
        "id": meta.id,
        "object": "text_completion",
        "created": meta.created,
        "model": meta.model,
        "system_fingerprint": meta.fingerprint,
        "choices": [],
        "usage": usage(u),
    })
}

/// `GET /v1/models`.
pub fn models(name: &str, created: u64) -> Value {
    json!({"object": "list", "data": [{
        "id": name, "object": "model", "created": created, "owned_by": "kiln",
    }]})
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta() -> Meta {
        Meta {
            id: "chatcmpl-1".into(),
            created: 7,
            model: "m".into(),
            fingerprint: "fp".into(),
        }
    }

    #[test]
    fn chat_shapes() {
        let u = Usage {
            prompt_tokens: 5,
            cached_tokens: 2,
            completion_tokens: 3,
        };
        let c = chat_completion(&meta(), "hi", Finish::Length, &u, None);
        assert_eq!(c["object"], "chat.completion");
        assert_eq!(c["choices"][0]["message"]["content"], "hi");
        assert_eq!(c["choices"][0]["finish_reason"], "length");
        assert_eq!(c["usage"]["total_tokens"], 8);
        assert_eq!(c["usage"]["prompt_tokens_details"]["cached_tokens"], 2);
        let first = chat_chunk_role(&meta());
        assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
        assert!(first["usage"].is_null() && first.get("usage").is_some());
        let t = chat_chunk_text(&meta(), "x", None);
        assert_eq!(t["choices"][0]["delta"], json!({"content": "x"}));
        assert!(t["choices"][0]["finish_reason"].is_null());
        let f = chat_chunk_finish(&meta(), Finish::Stop);
        assert_eq!(f["choices"][0]["finish_reason"], "stop");
        let last = chat_chunk_usage(&meta(), &u);
        assert_eq!(last["choices"], json!([]));
        assert_eq!(last["usage"]["completion_tokens"], 3);
        for v in [&first, &t, &f, &last] {
            assert_eq!((&v["id"], &v["created"]), (&json!("chatcmpl-1"), &json!(7)));
            assert_eq!(v["object"], "chat.completion.chunk");
            assert_eq!(v["system_fingerprint"], "fp");
        }
    }

    #[test]
    fn logprob_shapes() {
        let toks = [
            TokenLogprob {
                text: "é".into(),
                logprob: -0.5,
                top: vec![("é".into(), -0.5), ("a".into(), f32::NEG_INFINITY)],
            },
            TokenLogprob {
                text: "b".into(),
                logprob: -1.0,
                top: vec![],
            },
        ];
        let c = chat_logprobs(&toks);
        assert_eq!(c["content"][0]["token"], "é");
        assert_eq!(c["content"][0]["bytes"], json!([0xc3, 0xa9]));
        assert_eq!(c["content"][0]["logprob"], -0.5);
        assert_eq!(c["content"][0]["top_logprobs"][1]["logprob"], -9999.0);
        assert_eq!(c["content"][1]["top_logprobs"], json!([]));
        let l = legacy_logprobs(&toks, 10);
        assert_eq!(l["tokens"], json!(["é", "b"]));
        assert_eq!(l["token_logprobs"], json!([-0.5, -1.0]));
        assert_eq!(l["top_logprobs"][0]["a"], -9999.0);
        assert_eq!(l["text_offset"], json!([10, 11]));
        let t = text_completion(&meta(), "x", Some(Finish::Stop), None, Some(l));
        assert_eq!(t["object"], "text_completion");
        assert_eq!(t["choices"][0]["logprobs"]["tokens"][1], "b");
        assert!(t["usage"].is_null());
    }
}
