//! Library-level properties of the forward pass and its inputs: batching, observers, threads,
//! mixed weight encodings, config validation, streaming detokenization and chat-cache reuse.

mod common;

use std::path::{Path, PathBuf};

use common::*;
use kiln_format::{DType, KilnFile, KilnWriter, TensorSpec};
use kiln_runner::{
    generate, ChatTemplate, Compute, Conversation, GenerateOptions, Logits, Model, Recorder,
    RunnerError, Sampler, SamplerConfig, Sequence, Tokenizer,
};

/// Batched and one-token-at-a-time forward passes sum in different orders.
const BATCH_VS_SEQUENTIAL_MAX_ABS_ERR: f32 = 1e-4;
/// Q8_0 weights everywhere (and Q8_0 activations inside the kernels): smallest per-token
/// cosine of the logits against the F32 model's. The tiny random models have 64-wide rows, far
/// noisier under quantization than real ones (measured 0.99902); a broken block layout gives ~0.
const Q8_0_LOGITS_MIN_COSINE: f64 = 0.995;
/// Mixed Q4_0 (MLP) / Q8_0 (attention) / F16 (embeddings, output): measured 0.97106.
const MIXED_LOGITS_MIN_COSINE: f64 = 0.95;

fn tiny(dir: &Path, name: &str) -> PathBuf {
    convert(
        &root().join("fixtures/tiny").join(name),
        dir,
        Some(DType::F32),
    )
}

fn prompt_ids() -> Vec<u32> {
    Reference::load(&root().join("fixtures/reference/tiny/qwen2-bias-f32/1.safetensors")).input_ids
}

#[test]
fn batched_prefill_equals_token_by_token_and_chunked() {
    let tmp = tempfile::tempdir().unwrap();
    for name in ["qwen2-bias-f32", "llama3-rope-f32"] {
        let f = KilnFile::open(tiny(tmp.path(), name)).unwrap();
        let model = Model::load(&f).unwrap();
        let ids = prompt_ids();
        let mut s = model.session(64, 2).unwrap();
        let batch = s.forward(&ids, Logits::All, None).unwrap().to_vec();
        let vocab = model.config.vocab;
        s.reset();
        for (t, &id) in ids.iter().enumerate() {
            let one = s.forward(&[id], Logits::Last, None).unwrap();
            let err = max_abs_error(one, &batch[t * vocab..(t + 1) * vocab]);
            assert!(
                err <= BATCH_VS_SEQUENTIAL_MAX_ABS_ERR,
                "{name} token {t}: {err}"
            );
        }
        s.reset();
        let mut last = Vec::new();
        for chunk in ids.chunks(5) {
            last = s.forward(chunk, Logits::Last, None).unwrap().to_vec();
        }
        let err = max_abs_error(&last, &batch[batch.len() - vocab..]);
        assert!(
            err <= BATCH_VS_SEQUENTIAL_MAX_ABS_ERR,
            "{name} chunked: {err}"
        );
    }
}

#[test]
fn observer_and_thread_count_do_not_change_results() {
    let tmp = tempfile::tempdir().unwrap();
    let f = KilnFile::open(tiny(tmp.path(), "mistral-f32")).unwrap();
    let model = Model::load(&f).unwrap();
    let ids = prompt_ids();
    let mut plain = model.session(64, 1).unwrap();
    let want = plain.forward(&ids, Logits::Last, None).unwrap().to_vec();
    for threads in [1, 2, 3] {
        let mut s = model.session(64, threads).unwrap();
        let mut rec = Recorder {
            only: vec!["model.layers.1.output".into(), "logits".into()],
            ..Default::default()
        };
        let got = s
            .forward(&ids, Logits::Last, Some(&mut rec))
            .unwrap()
            .to_vec();
        assert_eq!(got, want, "threads {threads}");
        assert_eq!(rec.records.len(), 2);
        assert_eq!(
            rec.get("model.layers.1.output").unwrap().0,
            &[ids.len(), 64]
        );
        // Only the last token's logits were computed.
        assert_eq!(rec.get("logits").unwrap().0, &[1, model.config.vocab]);
    }
}

/// Rewrite `src` with each matrix re-encoded by `pick(name)` (None: unchanged).
fn reencode(src: &Path, dst: &Path, pick: impl Fn(&str) -> Option<DType>) {
    let f = KilnFile::open(src).unwrap();
    let mut specs = Vec::new();
    let mut data = Vec::new();
    for t in f.tensors() {
        let view = f.view(t);
        let target = if t.shape.len() == 2 {
            pick(&t.name)
        } else {
            None
        };
        let (dtype, bytes) = match target {
            None => (t.dtype, view.bytes().to_vec()),
            Some(d) => {
                let x = view.to_f32_vec();
                let bytes = match d {
                    DType::Q8_0 => bytemuck::cast_slice(
                        &kiln_format::blocks::quantize_row_q8_0_ref(&x).unwrap(),
                    )
                    .to_vec(),
                    DType::Q4_0 => bytemuck::cast_slice(
                        &kiln_format::blocks::quantize_row_q4_0_ref(&x).unwrap(),
                    )
                    .to_vec(),
                    d => {
                        let mut out = Vec::new();
                        kiln_format::values::encode_from_f32(d, &x, &mut out);
                        out
                    }
                };
                (d, bytes)
            }
        };
        specs.push(TensorSpec {
            name: t.name.clone(),
            dtype,
            shape: t.shape.clone(),
        });
        data.push(bytes);
    }
    let w = KilnWriter::create(dst, f.metadata(), specs, true).unwrap();
    for (i, b) in data.iter().enumerate() {
        w.write_tensor(i, b).unwrap();
    }
    w.finish().unwrap();
}

#[test]
fn quantized_and_mixed_encodings_run_through_the_same_forward_pass() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tiny(tmp.path(), "llama-untied-bf16");
    let f = KilnFile::open(&src).unwrap();
    let model = Model::load(&f).unwrap();
    let ids = prompt_ids();
    let vocab = model.config.vocab;
    let want = model
        .session(64, 2)
        .unwrap()
        .forward(&ids, Logits::All, None)
        .unwrap()
        .to_vec();
    let q8 = tmp.path().join("q8.kiln");
    reencode(&src, &q8, |_| Some(DType::Q8_0));
    let mixed = tmp.path().join("mixed.kiln");
    reencode(&src, &mixed, |n| {
        Some(if n.contains("mlp") {
            DType::Q4_0
        } else if n.contains("attn") {
            DType::Q8_0
        } else {
            DType::F16
        })
    });
    for (path, min_cos) in [
        (&q8, Q8_0_LOGITS_MIN_COSINE),
        (&mixed, MIXED_LOGITS_MIN_COSINE),
    ] {
        let qf = KilnFile::open(path).unwrap();
        let qm = Model::load(&qf).unwrap();
        let got = qm
            .session(64, 2)
            .unwrap()
            .forward(&ids, Logits::All, None)
            .unwrap()
            .to_vec();
        let cos = min_row_cosine(&got, &want, vocab);
        eprintln!("{}: min logits cosine vs f32 {cos:.6}", path.display());
        assert!(cos >= min_cos, "{}: {cos}", path.display());
    }
}

/// Write a copy of `src` with tensors dropped, reshaped or added.
fn edited(src: &Path, dst: &Path, edit: impl Fn(&mut Vec<(TensorSpec, Vec<u8>)>)) {
    let f = KilnFile::open(src).unwrap();
    let mut ts: Vec<(TensorSpec, Vec<u8>)> = f
        .tensors()
        .iter()
        .map(|t| {
            (
                TensorSpec {
                    name: t.name.clone(),
                    dtype: t.dtype,
                    shape: t.shape.clone(),
                },
                f.view(t).bytes().to_vec(),
            )
        })
        .collect();
    edit(&mut ts);
    let (specs, data): (Vec<_>, Vec<_>) = ts.into_iter().unzip();
    let w = KilnWriter::create(dst, f.metadata(), specs, true).unwrap();
    for (i, b) in data.iter().enumerate() {
        w.write_tensor(i, b).unwrap();
    }
    w.finish().unwrap();
}

#[test]
fn config_check_names_the_tensor_and_both_shapes() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tiny(tmp.path(), "llama-tied-f32");
    let bad = tmp.path().join("bad.kiln");
    let load_err = |p: &Path| {
        let f = KilnFile::open(p).unwrap();
        Model::load(&f).map(|_| ()).unwrap_err()
    };

    edited(&src, &bad, |ts| {
        ts.retain(|(s, _)| s.name != "layers.1.mlp.up.weight")
    });
    let e = load_err(&bad);
    assert!(
        matches!(&e, RunnerError::MissingTensor { tensor, .. } if tensor == "layers.1.mlp.up.weight"),
        "{e}"
    );

    edited(&src, &bad, |ts| {
        let (s, _) = ts
            .iter_mut()
            .find(|(s, _)| s.name == "layers.0.attn.k.weight")
            .unwrap();
        s.shape = vec![64, 32]; // (kv_dim, hidden) transposed
    });
    let e = load_err(&bad);
    assert!(
        matches!(&e, RunnerError::TensorShape { tensor, expected, found, .. }
            if tensor == "layers.0.attn.k.weight" && expected == &[32, 64] && found == &[64, 32]),
        "{e}"
    );
    assert!(e.to_string().contains("[64, 32]") && e.to_string().contains("[32, 64]"));

    edited(&src, &bad, |ts| {
        ts.push((
            TensorSpec {
                name: "layers.0.attn.q.bias".into(),
                dtype: DType::F32,
                shape: vec![64],
            },
            vec![0; 256],
        ))
    });
    let e = load_err(&bad);
    assert!(e.to_string().contains("attention_bias is false"), "{e}");
}

#[test]
fn streamed_text_is_valid_utf8_at_every_step() {
    let tmp = tempfile::tempdir().unwrap();
    let f = KilnFile::open(tiny(tmp.path(), "llama-tied-f32")).unwrap();
    let tok = Tokenizer::from_file(&f).unwrap();
    // The tiny vocabulary has no multi-byte merges: every non-ASCII character is 2-4 tokens.
    let text = "héllo wörld — 日本語 🎉👩‍🔬 done";
    let ids = tok.encode(text).unwrap();
    assert!(ids.len() > text.chars().count());
    let mut stream = tok.stream();
    let mut out = String::new();
    for &id in &ids {
        let piece = stream.push(id).unwrap();
        assert!(
            !piece.contains('\u{FFFD}'),
            "partial character emitted: {piece:?}"
        );
        out.push_str(&piece);
    }
    out.push_str(&stream.finish().unwrap());
    assert_eq!(out, text);
}

#[test]
fn conversation_reuses_the_cache_and_matches_a_fresh_run() {
    let tmp = tempfile::tempdir().unwrap();
    let f = KilnFile::open(tiny(tmp.path(), "qwen2-bias-f32")).unwrap();
    let model = Model::load(&f).unwrap();
    let tok = Tokenizer::from_file(&f).unwrap();
    let template = ChatTemplate::from_file(&f).unwrap();
    let opts = GenerateOptions {
        max_tokens: 5,
        ..Default::default()
    };
    let mut s = model.session(256, 1).unwrap();
    let mut conv = Conversation::new(&template, Some("Be brief."));
    let mut sampler = Sampler::new(SamplerConfig::default());
    let first = conv
        .turn(
            &mut s,
            None,
            &tok,
            "What is 7 * 6?",
            &opts,
            &mut sampler,
            &mut |_| Ok(()),
        )
        .unwrap();
    assert_eq!(first.stats.prefill_tokens, first.stats.prompt_tokens);
    let second = conv
        .turn(
            &mut s,
            None,
            &tok,
            "And 6 * 7?",
            &opts,
            &mut sampler,
            &mut |_| Ok(()),
        )
        .unwrap();
    assert!(second.stats.prefill_tokens < second.stats.prompt_tokens / 2);
    // The same second turn from an empty cache gives the same tokens.
    let mut fresh = model.session(256, 1).unwrap();
    let mut conv2 = Conversation::new(&template, Some("Be brief."));
    let _ = conv2
        .turn(
            &mut fresh,
            None,
            &tok,
            "What is 7 * 6?",
            &opts,
            &mut sampler,
            &mut |_| Ok(()),
        )
        .unwrap();
    fresh.reset();
    let again = conv2
        .turn(
            &mut fresh,
            None,
            &tok,
            "And 6 * 7?",
            &opts,
            &mut sampler,
            &mut |_| Ok(()),
        )
        .unwrap();
    assert_eq!(again.tokens, second.tokens);
    assert_eq!(conv.messages().len(), 5);
}

#[test]
fn generation_stops_at_the_context_end_and_rejects_longer_prompts() {
    let tmp = tempfile::tempdir().unwrap();
    let f = KilnFile::open(tiny(tmp.path(), "llama-tied-f32")).unwrap();
    let model = Model::load(&f).unwrap();
    let tok = Tokenizer::from_file(&f).unwrap();
    let ids = prompt_ids();
    let mut s = model.session(ids.len() + 3, 1).unwrap();
    let opts = GenerateOptions {
        max_tokens: 50,
        ignore_eos: true,
        ..Default::default()
    };
    let mut sampler = Sampler::new(SamplerConfig::default());
    let g = generate(&mut s, &tok, &ids, &opts, &mut sampler, &mut |_| Ok(())).unwrap();
    assert_eq!(g.stop, kiln_runner::StopReason::Context);
    assert_eq!(g.tokens.len(), 4);
    let mut small = model.session(ids.len() - 1, 1).unwrap();
    let e = generate(&mut small, &tok, &ids, &opts, &mut sampler, &mut |_| Ok(())).unwrap_err();
    assert!(matches!(e, RunnerError::ContextOverflow { .. }), "{e}");
}

/// Gemma 3's sliding layers (window 4 in the tiny fixture) kept in rings of
/// `window - 1 + batch` positions give the logits of a cache that keeps every position: in
/// one long batch (which each ring layer takes `batch` tokens at a time), in uneven chunks and
/// one token at a time; rewinding keeps a prefix the rings still hold and starts over when
/// they have overwritten what it needs.
#[test]
fn sliding_layers_in_rings_match_the_whole_cache() {
    use kiln_runner::{CacheType, SlidingCache};
    let tmp = tempfile::tempdir().unwrap();
    let f = KilnFile::open(tiny(tmp.path(), "gemma3-f32")).unwrap();
    let model = Model::load(&f).unwrap();
    let vocab = model.config.vocab;
    let ids: Vec<u32> = (0..200u32)
        .map(|i| (i.wrapping_mul(2654435761) >> 7) % vocab as u32)
        .collect();
    let ring = SlidingCache::Ring { batch: 8 };
    let mut full = model
        .session_sliding(256, 2, CacheType::F32, SlidingCache::Full)
        .unwrap();
    let want = full.forward(&ids, Logits::All, None).unwrap().to_vec();
    let mut s = model.session_sliding(256, 2, CacheType::F32, ring).unwrap();
    // Layers 0 and 1 slide (window 4): rings of 3 + 8 slots; layer 2 keeps all 256.
    assert_eq!(s.cache_capacities(), [11, 11, 256]);
    assert!(s.cache_bytes() < full.cache_bytes() / 2);
    let got = s.forward(&ids, Logits::All, None).unwrap().to_vec();
    let err = max_abs_error(&got, &want);
    assert!(err <= BATCH_VS_SEQUENTIAL_MAX_ABS_ERR, "one batch: {err}");

    s.reset();
    let mut at = 0;
    for (i, len) in [1usize, 37, 8, 9, 3, 100, 42].into_iter().enumerate() {
        let chunk = &ids[at..at + len];
        let which = if i % 2 == 0 {
            Logits::All
        } else {
            Logits::Last
        };
        let got = s.forward(chunk, which, None).unwrap();
        let rows = got.len() / vocab;
        let want_rows = &want[(at + len - rows) * vocab..(at + len) * vocab];
        let err = max_abs_error(got, want_rows);
        assert!(
            err <= BATCH_VS_SEQUENTIAL_MAX_ABS_ERR,
            "chunk of {len} at {at}: {err}"
        );
        at += len;
    }
    assert_eq!(at, ids.len());

    // A shallow rewind: the rings still hold the keys position 195 reads (192..195).
    assert_eq!(s.rewind(195), 195);
    let got = s.forward(&ids[195..], Logits::All, None).unwrap();
    let err = max_abs_error(got, &want[195 * vocab..]);
    assert!(
        err <= BATCH_VS_SEQUENTIAL_MAX_ABS_ERR,
        "after rewind: {err}"
    );
    // A deep one: positions 97..100 were overwritten long ago, so nothing is kept, and the
    // conversation-style reuse starts from the beginning.
    assert_eq!(s.rewind(100), 0);
    assert!(s.tokens().is_empty());
    s.forward(&ids, Logits::None, None).unwrap();
    assert_eq!(s.reuse_prefix(&ids[..150]), 0);
    let got = s.forward(&ids[..150], Logits::Last, None).unwrap();
    let err = max_abs_error(got, &want[149 * vocab..150 * vocab]);
    assert!(err <= BATCH_VS_SEQUENTIAL_MAX_ABS_ERR, "after reuse: {err}");
    // With every position kept, a deep rewind keeps its prefix.
    assert_eq!(full.rewind(100), 100);
}

/// Several sequences decoded together, joining and leaving the batch, each get exactly the
/// logits they get decoded alone: what lets a server promise that a request's output does not
/// depend on what else it is serving. Batches of 17 tokens, where one sequence's prompt would
/// take the block and float lanes kernels; every family's layout, float and block weights.
#[test]
fn batched_decode_gives_each_sequence_the_bits_it_gets_alone() {
    let tmp = tempfile::tempdir().unwrap();
    let ids = prompt_ids();
    for (label, path) in every_layout_and_encoding(tmp.path()) {
        let f = KilnFile::open(&path).unwrap();
        let model = Model::load(&f).unwrap();
        let vocab = model.config.vocab as u32;
        let cache = kiln_runner::CacheType::F16;
        let sliding = kiln_runner::SlidingCache::default();
        let mut batched = Compute::new(&model, 64, 2, cache, sliding).unwrap();
        let mut alone = Compute::new(&model, 64, 1, cache, sliding).unwrap();
        // Eighteen prompts of different lengths and contents.
        let prompts: Vec<Vec<u32>> = (0..18)
            .map(|i| {
                ids.iter()
                    .cycle()
                    .skip(i)
                    .take(3 + i)
                    .map(|&t| (t + i as u32) % vocab)
                    .collect()
            })
            .collect();
        let mut seqs: Vec<Sequence> = Vec::new();
        let mut solo: Vec<Sequence> = Vec::new();
        let mut next: Vec<u32> = Vec::new();
        for p in &prompts {
            let mut s = batched.sequence().unwrap();
            let l = batched.forward(&mut s, p, Logits::Last, None).unwrap();
            next.push(kiln_runner::sampler::argmax(l.iter().copied()));
            seqs.push(s);
            let mut s = alone.sequence().unwrap();
            alone.forward(&mut s, p, Logits::Last, None).unwrap();
            solo.push(s);
        }
        for step in 0..6 {
            // Sequences leave and rejoin: step k leaves out sequence k.
            let members: Vec<usize> = (0..18).filter(|&i| i != step).collect();
            let tokens: Vec<u32> = members.iter().map(|&i| next[i]).collect();
            let mut refs: Vec<&mut Sequence> = Vec::new();
            for (i, s) in seqs.iter_mut().enumerate() {
                if members.contains(&i) {
                    refs.push(s);
                }
            }
            let inputs: Vec<&[u32]> = tokens.chunks(1).collect();
            let logits = batched
                .decode_rows(&mut refs, &inputs, Logits::Last)
                .unwrap()
                .to_vec();
            for (row, &i) in members.iter().enumerate() {
                let want = alone
                    .forward(&mut solo[i], &[next[i]], Logits::Last, None)
                    .unwrap();
                let got = &logits[row * vocab as usize..(row + 1) * vocab as usize];
                assert!(
                    got.iter()
                        .zip(want)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{label}: step {step}, sequence {i}: batched logits differ from alone"
                );
                next[i] = kiln_runner::sampler::argmax(got.iter().copied());
            }
        }
    }
}

/// Every family's layout (tiny fixtures), as f32, q8_0, q4_0 and f16: the weights whose
/// products take different kernels at different batch sizes.
fn every_layout_and_encoding(dir: &std::path::Path) -> Vec<(String, std::path::PathBuf)> {
    let mut cases = Vec::new();
    for name in [
        "llama-untied-bf16",
        "gemma3-f32",
        "qwen3-f32",
        "phi3-f32",
        "mistral-f32",
    ] {
        let src = tiny(dir, name);
        for (tag, pick) in [
            ("f32", None),
            ("q8_0", Some(DType::Q8_0)),
            ("q4_0", Some(DType::Q4_0)),
            ("f16", Some(DType::F16)),
        ] {
            let path = match pick {
                None => src.clone(),
                Some(d) => {
                    let p = dir.join(format!("{name}-{tag}.kiln"));
                    reencode(&src, &p, |_| Some(d));
                    p
                }
            };
            cases.push((format!("{name} {tag}"), path));
        }
    }
    cases
}

/// A speculative check of several guessed tokens gives each row exactly the logits the token
/// gets decoded alone, one at a time, and after a rewind to the accepted ones the next check
/// still does: what makes speculative decoding lossless. Seventeen rows, where one prompt
/// chunk would take the block and float lanes kernels and attention's query blocks.
#[test]
fn verify_gives_each_row_the_bits_of_decoding_one_token_at_a_time() {
    let tmp = tempfile::tempdir().unwrap();
    let ids = prompt_ids();
    for (label, path) in every_layout_and_encoding(tmp.path()) {
        let f = KilnFile::open(&path).unwrap();
        let model = Model::load(&f).unwrap();
        let vocab = model.config.vocab;
        let mut checked = model.session(64, 2).unwrap();
        let mut alone = model.session(64, 2).unwrap();
        let prompt = &ids[..ids.len().min(9)];
        checked.forward(prompt, Logits::Last, None).unwrap();
        alone.forward(prompt, Logits::Last, None).unwrap();
        let guesses: Vec<u32> = ids
            .iter()
            .cycle()
            .skip(3)
            .take(17)
            .map(|&t| (t * 7 + 1) % vocab as u32)
            .collect();
        let mut at = prompt.len();
        for (round, (take, keep)) in [(17usize, 5usize), (12, 12)].into_iter().enumerate() {
            let tokens = &guesses[..take];
            let got = checked.verify(tokens).unwrap().to_vec();
            assert_eq!(got.len(), take * vocab, "{label}: one row per token");
            for (i, &t) in tokens.iter().enumerate() {
                let want = alone.forward(&[t], Logits::Last, None).unwrap();
                let row = &got[i * vocab..(i + 1) * vocab];
                assert!(
                    row.iter()
                        .zip(want)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{label}: round {round}, row {i}: checked logits differ from decoding alone"
                );
            }
            // Keep the accepted guesses only, on both sides.
            assert_eq!(checked.rewind(at + keep), at + keep, "{label}");
            assert_eq!(alone.rewind(at + keep), at + keep, "{label}");
            at += keep;
        }
    }
}

/// Prompt lookup is lossless: greedy generation with guesses checked gives token for token
/// what plain decoding gives, leaves the same tokens in the cache (what the next chat turn
/// reuses), and stops where it does, at the token budget and at the context's end. On a
/// repetitive prompt guesses are accepted, so the check is exercised. Gemma 3's sliding
/// layers in rings of 3 + 2 slots cannot rewind past what they overwrote, so there the
/// rejected guesses' positions are recomputed.
#[test]
fn prompt_lookup_generates_what_plain_decoding_generates() {
    use kiln_runner::{CacheType, SlidingCache};
    let tmp = tempfile::tempdir().unwrap();
    let ids = prompt_ids();
    let prompt: Vec<u32> = ids.iter().take(7).cycle().take(28).copied().collect();
    let mut accepted = 0;
    for name in ["llama-tied-f32", "gemma3-f32", "qwen3-f32"] {
        let f = KilnFile::open(tiny(tmp.path(), name)).unwrap();
        let model = Model::load(&f).unwrap();
        let tok = Tokenizer::from_file(&f).unwrap();
        for (ctx, max_tokens) in [(128, 60), (40, 60), (128, 9)] {
            let run = |lookup: usize| {
                let ring = SlidingCache::Ring { batch: 2 };
                let mut s = model.session_sliding(ctx, 2, CacheType::F16, ring).unwrap();
                let opts = GenerateOptions {
                    max_tokens,
                    ignore_eos: true,
                    lookup,
                    ..Default::default()
                };
                let mut sampler = Sampler::new(SamplerConfig::default());
                let g =
                    generate(&mut s, &tok, &prompt, &opts, &mut sampler, &mut |_| Ok(())).unwrap();
                (g, s.tokens().to_vec())
            };
            let (plain, plain_cache) = run(0);
            assert_eq!(plain.stats.drafted_tokens, 0);
            for lookup in [1, 4, 8] {
                let (g, cache) = run(lookup);
                let label = format!("{name}, ctx {ctx}, {max_tokens} tokens, lookup {lookup}");
                assert_eq!(g.tokens, plain.tokens, "{label}: tokens");
                assert_eq!(g.text, plain.text, "{label}: text");
                assert_eq!(g.stop, plain.stop, "{label}: stop");
                assert_eq!(cache, plain_cache, "{label}: cached tokens");
                assert!(g.stats.accepted_tokens <= g.stats.drafted_tokens);
                assert_eq!(g.stats.decoded_tokens + 1, g.tokens.len(), "{label}");
                accepted += g.stats.accepted_tokens;
                eprintln!(
                    "{label}: {:?} {}/{}",
                    g.stop, g.stats.accepted_tokens, g.stats.drafted_tokens
                );
            }
        }
    }
    assert!(
        accepted > 0,
        "no guess was ever accepted: the check was not exercised"
    );
}

/// A draft model is lossless too: greedy generation with its guesses checked gives token for
/// token what plain decoding gives, leaves the same tokens in the cache and stops where plain
/// decoding does, whether the draft is a lower-precision copy of the model (mostly right) or
/// another model with the same vocabulary (mostly wrong), and whatever the proposal lengths.
/// The draft shares the model's threads and catches up lazily after each check.
#[test]
fn a_draft_model_generates_what_plain_decoding_generates() {
    use kiln_runner::draft::{Draft, DraftOptions};
    use kiln_runner::generate::generate_with_draft;
    use kiln_runner::{CacheType, SlidingCache};
    let tmp = tempfile::tempdir().unwrap();
    let prompt = prompt_ids();
    let other = tiny(tmp.path(), "qwen3-f32");
    let (mut drafted, mut accepted) = (0, 0);
    for name in ["llama-tied-f32", "gemma3-f32", "qwen3-f32"] {
        let f = KilnFile::open(tiny(tmp.path(), name)).unwrap();
        let model = Model::load(&f).unwrap();
        let tok = Tokenizer::from_file(&f).unwrap();
        let copy_path = convert(
            &root().join("fixtures/tiny").join(name),
            tmp.path(),
            Some(DType::F16),
        );
        let copy = KilnFile::open(copy_path).unwrap();
        let foreign = KilnFile::open(if name == "qwen3-f32" {
            tiny(tmp.path(), "llama-tied-f32")
        } else {
            other.clone()
        })
        .unwrap();
        for (ctx, max_tokens) in [(128, 40), (30, 40), (128, 5)] {
            let ring = SlidingCache::Ring { batch: 2 };
            let opts = GenerateOptions {
                max_tokens,
                ignore_eos: true,
                ..Default::default()
            };
            let mut s = model.session_sliding(ctx, 2, CacheType::F16, ring).unwrap();
            let mut sampler = Sampler::new(SamplerConfig::default());
            let plain =
                generate(&mut s, &tok, &prompt, &opts, &mut sampler, &mut |_| Ok(())).unwrap();
            let plain_cache = s.tokens().to_vec();
            for (which, draft_file) in [("f16 copy", &copy), ("another model", &foreign)] {
                let draft_model = Model::load(draft_file).unwrap();
                let draft_tok = Tokenizer::from_file(draft_file).unwrap();
                for (min, max) in [(1, 1), (0, 4), (2, 16)] {
                    let label = format!(
                        "{name} + {which}, ctx {ctx}, {max_tokens} tokens, draft {min}..={max}"
                    );
                    let mut s = model.session_sliding(ctx, 2, CacheType::F16, ring).unwrap();
                    let ds = s
                        .alongside(&draft_model, ctx, CacheType::F16, ring)
                        .unwrap();
                    let mut d = Draft::new(
                        ds,
                        &draft_tok,
                        &tok,
                        model.config.vocab,
                        // The tiny models' distributions are nearly flat: no confidence floor.
                        DraftOptions {
                            min,
                            max,
                            p_min: 0.0,
                            ..Default::default()
                        },
                    )
                    .unwrap();
                    let g = generate_with_draft(
                        &mut s,
                        Some(&mut d),
                        &tok,
                        &prompt,
                        &opts,
                        &mut sampler,
                        &mut |_| Ok(()),
                    )
                    .unwrap();
                    assert_eq!(g.tokens, plain.tokens, "{label}: tokens");
                    assert_eq!(g.text, plain.text, "{label}: text");
                    assert_eq!(g.stop, plain.stop, "{label}: stop");
                    assert_eq!(s.tokens(), &plain_cache[..], "{label}: cached tokens");
                    assert!(g.stats.accepted_tokens <= g.stats.drafted_tokens, "{label}");
                    assert_eq!(g.stats.decoded_tokens + 1, g.tokens.len(), "{label}");
                    drafted += g.stats.drafted_tokens;
                    accepted += g.stats.accepted_tokens;
                }
            }
        }
    }
    assert!(
        accepted > 0 && accepted < drafted,
        "guesses were never accepted, or never rejected ({accepted} of {drafted}): the check was not exercised"
    );
}

/// A draft whose vocabulary is not the model's is refused, naming the flag and the first id
/// that differs.
#[test]
fn a_draft_with_another_vocabulary_is_refused() {
    use kiln_runner::draft::{Draft, DraftOptions};
    let tmp = tempfile::tempdir().unwrap();
    let f = KilnFile::open(tiny(tmp.path(), "llama-tied-f32")).unwrap();
    let model = Model::load(&f).unwrap();
    let tok = Tokenizer::from_file(&f).unwrap();
    let src = root().join("fixtures/tiny/llama-tied-f32");
    let renamed = tmp.path().join("renamed");
    std::fs::create_dir(&renamed).unwrap();
    for e in std::fs::read_dir(&src).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), renamed.join(e.file_name())).unwrap();
    }
    // Rename the token with id 100.
    let tj = renamed.join("tokenizer.json");
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&tj).unwrap()).unwrap();
    let vocab = json["model"]["vocab"].as_object_mut().unwrap();
    let key = vocab
        .iter()
        .find(|(_, v)| v.as_u64() == Some(100))
        .map(|(k, _)| k.clone())
        .unwrap();
    vocab.remove(&key);
    vocab.insert("renamed-token".into(), 100.into());
    std::fs::write(&tj, serde_json::to_string(&json).unwrap()).unwrap();
    let other = KilnFile::open(convert(&renamed, tmp.path(), None)).unwrap();
    let other_model = Model::load(&other).unwrap();
    let other_tok = Tokenizer::from_file(&other).unwrap();
    let s = model.session(64, 1).unwrap();
    let ds = s
        .alongside(
            &other_model,
            64,
            kiln_runner::CacheType::F32,
            Default::default(),
        )
        .unwrap();
    let e = Draft::new(
        ds,
        &other_tok,
        &tok,
        model.config.vocab,
        DraftOptions::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("--draft") && e.contains("id 100") && e.contains("renamed-token"),
        "{e}"
    );
}
