//! SmolLM2-135M-Instruct against transformers (`fixtures/reference/smollm2/`) and llama.cpp's
//! token ids (`fixtures/smollm2/tokens.json`).
//!
//! NEEDS the checkpoint `target/models/smollm2-bf16` (built by `ci/smollm2.sh`, not committed),
//! so every test here is `#[ignore]`d: `cargo test -- --include-ignored` runs them (CI does), and
//! a run without the checkpoint fails with a message saying how to build it.
//!
//! Metric as in `reference.rs`: per activation `max |kiln − ref| / max |ref|`, and per-token
//! cosine similarity of the logits. 30 layers of f32 sums in a different order than PyTorch's
//! leave more error than the 2-layer fixtures, hence looser bounds.

mod common;

use std::path::PathBuf;
use std::sync::OnceLock;

use common::*;
use kiln_format::DType;
use kiln_runner::{
    generate, ChatTemplate, Conversation, GenerateOptions, Message, Model, Sampler, SamplerConfig,
    Tokenizer,
};

/// Largest error of any activation, relative to that activation's largest magnitude.
const SMOLLM2_ACTIVATION_REL_MAX_ERR: f32 = 3e-5;
/// Smallest cosine similarity of kiln's and transformers' logits for any token.
const SMOLLM2_LOGITS_MIN_COSINE: f64 = 0.999_999;

/// The checkpoint converted at F32 and at its source dtype (bf16), once per test binary.
fn converted() -> &'static (PathBuf, PathBuf, PathBuf) {
    static CELL: OnceLock<(PathBuf, PathBuf, PathBuf)> = OnceLock::new();
    CELL.get_or_init(|| {
        let src = smollm2_dir();
        let dir = fixture_dir("smollm2");
        let f32_file = convert(&src, &dir, Some(DType::F32));
        let bf16_file = convert(&src, &dir, None);
        (dir, f32_file, bf16_file)
    })
}

#[test]
#[ignore = "real model: run ci/smollm2.sh first; CI runs it with --include-ignored"]
fn smollm2_matches_transformers_at_f32_and_bf16() {
    let (_, f32_file, bf16_file) = converted();
    for kiln in [f32_file, bf16_file] {
        for k in 0..3 {
            let dump = root().join(format!("fixtures/reference/smollm2/{k}.safetensors"));
            compare_dump(
                kiln,
                &dump,
                2,
                SMOLLM2_ACTIVATION_REL_MAX_ERR,
                SMOLLM2_LOGITS_MIN_COSINE,
            );
        }
    }
}

#[test]
#[ignore = "real model: run ci/smollm2.sh first; CI runs it with --include-ignored"]
fn smollm2_tokenizer_matches_llama_cpp_and_the_dumps() {
    let (_, _, bf16_file) = converted();
    let file = kiln_runner::open_model(bf16_file).unwrap();
    let tok = Tokenizer::from_file(&file).unwrap();
    let json: serde_json::Value = serde_json::from_slice(
        &std::fs::read(root().join("fixtures/smollm2/tokens.json")).unwrap(),
    )
    .unwrap();
    let prompts = json["prompts"].as_array().unwrap();
    assert!(prompts.len() >= 10);
    for p in prompts {
        let text = p["text"].as_str().unwrap();
        let want: Vec<u32> = p["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(tok.encode(text).unwrap(), want, "{text:?}");
    }
    for k in 0..3 {
        let r =
            Reference::load(&root().join(format!("fixtures/reference/smollm2/{k}.safetensors")));
        assert_eq!(
            tok.encode(&r.meta["prompt"]).unwrap(),
            r.input_ids,
            "dump {k}"
        );
    }
    // Dump 2 is the chat template with a system prompt.
    let template = ChatTemplate::from_file(&file).unwrap();
    let r = Reference::load(&root().join("fixtures/reference/smollm2/2.safetensors"));
    let rendered = template
        .render(
            &[
                Message::new("system", "Be brief."),
                Message::new("user", "Hi"),
            ],
            true,
        )
        .unwrap();
    assert_eq!(rendered, r.meta["prompt"]);
    // Without a system message the template's default system prompt appears.
    let default = template
        .render(&[Message::new("user", "Hi")], true)
        .unwrap();
    assert!(default.starts_with("<|im_start|>system\n"), "{default}");
    assert!(default.len() > rendered.len());
}

#[test]
#[ignore = "real model: run ci/smollm2.sh first; CI runs it with --include-ignored"]
fn smollm2_q8_0_and_q4_0_answer_coherently() {
    let (dir, f32_file, _) = converted();
    for to in [DType::Q8_0, DType::Q4_0] {
        let out = dir.join(format!("smollm2-{to}.kiln"));
        let policy = kiln_quantize::Policy::new(to, Vec::new()).unwrap();
        let mut opts = kiln_quantize::QuantizeOptions::new(f32_file, &out, policy);
        opts.overwrite = true;
        kiln_quantize::quantize_file(&opts, &kiln_quantize::NoProgress).unwrap();
        let file = kiln_runner::open_model(&out).unwrap();
        let model = Model::load(&file).unwrap();
        let tok = Tokenizer::from_file(&file).unwrap();
        let template = ChatTemplate::from_file(&file).unwrap();
        let mut sess = model.session(512, 2).unwrap();
        let mut conv = Conversation::new(&template, None);
        let g = conv
            .turn(
                &mut sess,
                None,
                &tok,
                // Not the dumps' bare question: there Q8_0's first-token logits for "The" and
                // "L" are 0.05 apart, and batched prefill (matrix-product attention, activations
                // re-quantized to Q8_0 per layer) vs one-token steps can flip which wins.
                "What is the capital of France? Answer in one word.",
                &GenerateOptions {
                    max_tokens: 24,
                    ..Default::default()
                },
                &mut Sampler::new(SamplerConfig::default()),
                &mut |_| Ok(()),
            )
            .unwrap();
        eprintln!("{to}: {:?}", g.text);
        assert!(g.text.contains("Paris"), "{to}: {:?}", g.text);
        if to == DType::Q4_0 {
            // 4.5 bits per weight on a 135M model: its plain continuation of this prompt
            // (" capital of France") drifts from the reference's; the chat answer above holds.
            continue;
        }
        // Plain continuation of dump 0's prompt starts like the reference's " Paris."
        let mut sess = model.session(64, 2).unwrap();
        let ids = tok.encode("The capital of France is").unwrap();
        let g = generate(
            &mut sess,
            &tok,
            &ids,
            &GenerateOptions {
                max_tokens: 3,
                ..Default::default()
            },
            &mut Sampler::new(SamplerConfig::default()),
            &mut |_| Ok(()),
        )
        .unwrap();
        assert!(g.text.starts_with(" Paris"), "{to}: {:?}", g.text);
    }
}
