//! The server's engine without HTTP: jobs in, events out, on a tiny model. Continuous batching
//! must give every job the tokens it gets alone and through `generate`; stop strings, cancels,
//! the prompt cache, the queue bound and shutdown behave as the server promises.

mod common;

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use kiln_format::{DType, KilnFile};
use kiln_runner::draft::{Draft, DraftOptions};
use kiln_runner::engine::job::{Event, Finish, Job, TokenInfo, Usage};
use kiln_runner::engine::prompt_cache::Reuse;
use kiln_runner::engine::{self, Engine, EngineHandle, EngineOptions, SubmitError};
use kiln_runner::{
    generate, CacheType, Compute, GenerateOptions, Interrupt, Model, Sampler, SamplerConfig,
    SlidingCache, Tokenizer,
};

const CTX: usize = 256;

/// What a job produced.
#[derive(Debug)]
struct Output {
    text: String,
    tokens: Vec<TokenInfo>,
    finish: Finish,
    usage: Usage,
    /// Prompt-lookup guesses made, and accepted.
    guessed: usize,
    accepted: usize,
}

fn job(id: u64, prompt: &[u32], max_tokens: usize) -> (Job, Receiver<Event>, Arc<AtomicBool>) {
    let (tx, rx) = channel();
    let cancel = Arc::new(AtomicBool::new(false));
    let job = Job {
        id,
        prompt: prompt.to_vec(),
        sampler: SamplerConfig::default(),
        max_tokens,
        stop: Vec::new(),
        ignore_eos: true,
        logprobs: None,
        constraint: None,
        events: tx,
        cancel: Arc::clone(&cancel),
        submitted: Instant::now(),
    };
    (job, rx, cancel)
}

fn collect(rx: &Receiver<Event>) -> Output {
    let (mut text, mut tokens) = (String::new(), Vec::new());
    loop {
        match rx
            .recv_timeout(Duration::from_secs(60))
            .expect("an event in time")
        {
            Event::Text { text: t, tokens: k } => {
                text.push_str(&t);
                tokens.extend(k);
            }
            Event::Done {
                finish,
                usage,
                timings,
            } => {
                return Output {
                    text,
                    tokens,
                    finish,
                    usage,
                    guessed: timings.guessed,
                    accepted: timings.accepted,
                }
            }
            Event::Failed { message } => panic!("job failed: {message}"),
        }
    }
}

/// An engine of `parallel` slots keeping `cache_mb` MiB of conversations.
fn options(parallel: usize, cache_mb: usize) -> EngineOptions {
    EngineOptions {
        parallel,
        prefill_batch: 512,
        cache_bytes: cache_mb << 20,
        reuse: Reuse::Exact,
        lookup: 0,
    }
}

/// Run `body` against an engine over the tiny Qwen2 model.
fn with_engine(opts: EngineOptions, body: impl FnOnce(&EngineHandle, &Tokenizer, &Model<'_>)) {
    let tmp = tempfile::tempdir().unwrap();
    let path = convert(
        &root().join("fixtures/tiny/qwen2-bias-f32"),
        tmp.path(),
        Some(DType::F32),
    );
    run_on(&path, None, opts, body);
}

/// Run `body` against an engine over the model at `path`, with `draft` as its draft model
/// (`--draft-max 6`, `--draft-min 2`, `--draft-p-min 0`: it always proposes) when given.
fn run_on(
    path: &Path,
    draft: Option<&Path>,
    opts: EngineOptions,
    body: impl FnOnce(&EngineHandle, &Tokenizer, &Model<'_>),
) {
    let f = KilnFile::open(path).unwrap();
    let model = Model::load(&f).unwrap();
    let tok = Tokenizer::from_file(&f).unwrap();
    let draft_file = draft.map(|p| KilnFile::open(p).unwrap());
    let draft_model = draft_file.as_ref().map(|f| Model::load(f).unwrap());
    let (handle, jobs) = engine::queue(opts.parallel, 16);
    let stop = Interrupt::new();
    std::thread::scope(|scope| {
        let (h, t, m, s) = (handle.clone(), &tok, &model, stop.clone());
        let dm = draft_model.as_ref();
        scope.spawn(move || {
            let mut compute =
                Compute::new(m, CTX, 2, CacheType::F16, SlidingCache::default()).unwrap();
            let mut draft = dm.map(|dm| {
                let dc = compute
                    .alongside(dm, CTX, CacheType::F16, SlidingCache::default())
                    .unwrap();
                let opts = DraftOptions {
                    max: 6,
                    min: 2,
                    p_min: 0.0,
                    prefill_batch: 512,
                };
                Draft::with_compute(dc, t, t, m.config.vocab, opts).unwrap()
            });
            Engine::new(&mut compute, draft.as_mut(), t, opts)
                .with_interrupt(s)
                .with_state(h.state().clone())
                .serve(jobs);
        });
        // Stops the engine even when `body` panics, so that the scope can end.
        struct Raise(Interrupt);
        impl Drop for Raise {
            fn drop(&mut self) {
                self.0.raise(1);
            }
        }
        let _raise = Raise(stop.clone());
        body(&handle, &tok, &model);
    });
}

/// Wait (at most 30 s) until `done` holds.
fn settle(done: impl Fn() -> bool) {
    let t = Instant::now();
    while !done() {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "the engine did not settle"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn prompts(tok: &Tokenizer) -> Vec<Vec<u32>> {
    [
        "The quick brown fox",
        "What is 7 * 6?",
        "Once upon a time, in a land far away, there lived",
        "Hello",
        "Rust is a language that",
        "Tell me about the sea and the sky and the mountains between them",
        "1 2 3 4 5",
        "A",
    ]
    .iter()
    .map(|p| tok.encode(p).unwrap())
    .collect()
}

/// Guesses, from prompt lookup or from a draft model (an F16 copy), checked in the batched
/// pass beside other sequences, change no token, text, log-probability or finish: against an
/// engine without them, for jobs that run into the context, stop on a string or ask for
/// log-probabilities, and for a second turn that reuses a first one's cache (which must hold
/// no rejected guess).
#[test]
fn guesses_change_nothing() {
    let prompts_of = |tok: &Tokenizer| {
        let mut p = prompts(tok);
        p.push(
            tok.encode("red green blue red green blue red green blue red green")
                .unwrap(),
        );
        p
    };
    // Each job: prompt index, max_tokens, stop strings, log-probabilities.
    let spec = |i: usize| -> (usize, Vec<String>, Option<usize>) {
        match i {
            // Runs into the 256-token context.
            0 => (1000, Vec::new(), None),
            3 => (40, vec![" the".into()], None),
            5 => (40, Vec::new(), Some(3)),
            _ => (48, Vec::new(), None),
        }
    };
    let tmp = tempfile::tempdir().unwrap();
    let fixture = root().join("fixtures/tiny/qwen2-bias-f32");
    let target = convert(&fixture, tmp.path(), Some(DType::F32));
    let draft_dir = tmp.path().join("draft");
    std::fs::create_dir(&draft_dir).unwrap();
    let copy = convert(&fixture, &draft_dir, Some(DType::F16));
    let other = convert(&root().join("fixtures/tiny/qwen3-f32"), tmp.path(), None);
    let run = |lookup: usize, draft: Option<&Path>| -> (Vec<Output>, Output) {
        let mut outs = Vec::new();
        let mut second = None;
        let opts = EngineOptions {
            lookup,
            reuse: Reuse::Prefix,
            ..options(4, 64)
        };
        run_on(&target, draft, opts, |engine, tok, _| {
            let prompts = prompts_of(tok);
            let rxs: Vec<_> = prompts
                .iter()
                .enumerate()
                .map(|(i, p)| {
                    let (max, stop, logprobs) = spec(i);
                    let (mut j, rx, _) = job(i as u64, p, max);
                    j.stop = stop;
                    j.logprobs = logprobs;
                    engine.submit(j).unwrap();
                    rx
                })
                .collect();
            outs = rxs.iter().map(collect).collect();
            // A second turn over the last job's conversation and then some.
            let last = prompts.len() - 1;
            let mut p = prompts[last].clone();
            p.extend(outs[last].tokens.iter().map(|t| t.id));
            p.extend(tok.encode(" and again red green").unwrap());
            let (j, rx, _) = job(99, &p, 32);
            engine.submit(j).unwrap();
            second = Some(collect(&rx));
        });
        (outs, second.unwrap())
    };
    let (plain, plain_second) = run(0, None);
    let (looked, looked_second) = run(8, None);
    let (copied, copied_second) = run(0, Some(&copy));
    let (othered, othered_second) = run(0, Some(&other));
    let key = |o: &Output| {
        // Each token: id, log-probability's bits, the top alternatives and their bits.
        type Bits = (u32, u32, Vec<(u32, u32)>);
        let t: Vec<Bits> = o
            .tokens
            .iter()
            .map(|t| {
                let top = t.top.iter().map(|&(i, l)| (i, l.to_bits())).collect();
                (t.id, t.logprob.to_bits(), top)
            })
            .collect();
        (t, o.text.clone(), o.finish, o.usage)
    };
    assert_eq!(plain[0].finish, Finish::Length);
    assert!(plain[0].usage.prompt_tokens + plain[0].usage.completion_tokens >= CTX - 1);
    assert!(plain[5].tokens.iter().all(|t| t.top.len() == 3));
    assert!(plain.iter().all(|o| o.guessed == 0));
    let mut counts = Vec::new();
    for (how, guessed, second) in [
        ("lookup", &looked, &looked_second),
        ("the F16 copy as draft", &copied, &copied_second),
        ("another model as draft", &othered, &othered_second),
    ] {
        for (i, (a, b)) in plain.iter().zip(guessed).enumerate() {
            assert_eq!(key(a), key(b), "{how}: job {i}");
        }
        assert_eq!(key(&plain_second), key(second), "{how}: second turn");
        assert!(
            second.usage.cached_tokens > 0,
            "the second turn reused the first"
        );
        let made: usize = guessed.iter().map(|o| o.guessed).sum();
        let kept: usize = guessed.iter().map(|o| o.accepted).sum();
        counts.push((how, kept, made));
    }
    // Guesses were made and both kept and rejected, by lookup and by the drafts together.
    let (lookup_kept, lookup_made) = (counts[0].1, counts[0].2);
    assert!(lookup_kept > 0 && lookup_kept < lookup_made, "{counts:?}");
    let kept: usize = counts[1..].iter().map(|c| c.1).sum();
    let made: usize = counts[1..].iter().map(|c| c.2).sum();
    assert!(counts[1..].iter().all(|c| c.2 > 0), "{counts:?}");
    assert!(kept > 0 && kept < made, "{counts:?}");
}

#[test]
fn concurrent_jobs_get_the_tokens_they_get_alone_and_through_generate() {
    with_engine(options(8, 64), |engine, tok, model| {
        let prompts = prompts(tok);
        // Alone, one after another.
        let alone: Vec<Output> = prompts
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let (j, rx, _) = job(i as u64, p, 12);
                engine.submit(j).unwrap();
                collect(&rx)
            })
            .collect();
        // All at once: they join the batch as their prompts are read.
        let rxs: Vec<_> = prompts
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let (j, rx, _) = job(100 + i as u64, p, 12);
                engine.submit(j).unwrap();
                rx
            })
            .collect();
        for (i, rx) in rxs.iter().enumerate() {
            let together = collect(rx);
            let ids = |o: &Output| o.tokens.iter().map(|t| t.id).collect::<Vec<_>>();
            assert_eq!(ids(&together), ids(&alone[i]), "prompt {i}");
            assert_eq!(together.text, alone[i].text, "prompt {i}");
            assert_eq!(together.finish, Finish::Length);
            assert_eq!(together.usage.completion_tokens, 12);
            assert_eq!(together.usage.prompt_tokens, prompts[i].len());
        }
        // And through `generate`, as `kiln-run generate` runs it.
        for (i, p) in prompts.iter().enumerate() {
            let mut s = model.session_with(CTX, 1, CacheType::F16).unwrap();
            let opts = GenerateOptions {
                max_tokens: 12,
                ignore_eos: true,
                ..Default::default()
            };
            let mut sampler = Sampler::new(SamplerConfig::default());
            let g = generate(&mut s, tok, p, &opts, &mut sampler, &mut |_| Ok(())).unwrap();
            let ids: Vec<u32> = alone[i].tokens.iter().map(|t| t.id).collect();
            assert_eq!(g.tokens, ids, "prompt {i} through generate");
            assert_eq!(g.text, alone[i].text);
        }
        // The engine frees a slot just after its last event.
        settle(|| {
            let st = engine.status();
            (st.active, st.queued) == (0, 0)
        });
    });
}

#[test]
fn stop_strings_logprobs_and_the_prompt_cache() {
    let opts = EngineOptions {
        reuse: Reuse::Prefix,
        ..options(4, 64)
    };
    with_engine(opts, |engine, tok, _| {
        let p = tok.encode("Once upon a time, in a land far away").unwrap();
        let (j, rx, _) = job(1, &p, 16);
        engine.submit(j).unwrap();
        let full = collect(&rx);
        assert_eq!(full.usage.cached_tokens, 0);
        // A stop string taken from the middle of the output ends it just before.
        let chars: Vec<char> = full.text.chars().collect();
        assert!(chars.len() >= 6, "{:?}", full.text);
        let mid = chars.len() / 2;
        let stop: String = chars[mid..mid + 2].iter().collect();
        let (mut j, rx, _) = job(2, &p, 16);
        j.stop = vec![stop.clone()];
        j.logprobs = Some(3);
        engine.submit(j).unwrap();
        let cut = collect(&rx);
        let at = full.text.find(&stop).unwrap();
        assert_eq!(cut.text, full.text[..at]);
        assert_eq!(cut.finish, Finish::Stop);
        // Greedy: the chosen token is the most likely; log-probabilities are ≤ 0 and sorted.
        for t in &cut.tokens {
            assert!(t.logprob <= 0.0 && t.top.len() == 3);
            assert_eq!(t.top[0].0, t.id);
            assert!(t.top.windows(2).all(|w| w[0].1 >= w[1].1));
            assert!((t.top[0].1 - t.logprob).abs() < 1e-6);
        }
        // The next turn (prompt + answer + more) reuses the kept sequence.
        let mut next = p.clone();
        next.extend(full.tokens.iter().map(|t| t.id));
        next.extend(tok.encode(" and then").unwrap());
        let (j, rx, _) = job(3, &next, 4);
        engine.submit(j).unwrap();
        let turn = collect(&rx);
        assert!(
            turn.usage.cached_tokens >= p.len(),
            "{} cached of {}",
            turn.usage.cached_tokens,
            next.len()
        );
        settle(|| engine.status().cached >= 1);
    });
}

#[test]
fn cancelled_jobs_free_their_slot_and_a_full_queue_refuses() {
    with_engine(options(2, 0), |engine, tok, _| {
        let p = tok.encode("Hello there").unwrap();
        let (j, rx, cancel) = job(1, &p, 200);
        engine.submit(j).unwrap();
        // Wait for the first token, then leave.
        assert!(matches!(
            rx.recv_timeout(Duration::from_secs(60)).unwrap(),
            Event::Text { .. }
        ));
        cancel.store(true, Ordering::SeqCst);
        // A receiver dropped mid-stream is the same as a cancel.
        let (j, rx2, _) = job(2, &p, 200);
        engine.submit(j).unwrap();
        rx2.recv_timeout(Duration::from_secs(60)).unwrap();
        drop(rx2);
        settle(|| engine.status().active == 0);
        drop(rx);
    });
    // No engine reading: the queue fills and refuses.
    let (handle, _jobs) = engine::queue(1, 2);
    for i in 0..2 {
        handle.submit(job(i, &[1], 1).0).unwrap();
    }
    let Err((why, _)) = handle.submit(job(9, &[1], 1).0) else {
        panic!("a full queue took a job")
    };
    assert_eq!(why, SubmitError::Full);
    assert_eq!(handle.status().queued, 2);
}

#[test]
fn prompts_the_context_cannot_hold_fail_with_a_message() {
    with_engine(options(2, 0), |engine, _, _| {
        let (j, rx, _) = job(1, &vec![1u32; CTX], 4);
        engine.submit(j).unwrap();
        match rx.recv_timeout(Duration::from_secs(60)).unwrap() {
            Event::Failed { message } => assert!(message.contains("context"), "{message}"),
            e => panic!("expected a failure, got {e:?}"),
        }
    });
}

/// With exact reuse a warm request reads only whole prefill chunks from the cache and gets
/// the cold request's tokens and log-probabilities bit for bit; prefix reuse takes more.
#[test]
fn exact_reuse_gives_the_cold_output_bit_for_bit() {
    let chunk = 4;
    for (reuse, want_cached) in [(Reuse::Exact, 12), (Reuse::Prefix, 14)] {
        let opts = EngineOptions {
            prefill_batch: chunk,
            reuse,
            ..options(2, 64)
        };
        with_engine(opts, |engine, tok, _| {
            let first = tok
                .encode("Once upon a time, in a land far away there")
                .unwrap();
            assert!(first.len() >= 14, "{}", first.len());
            let mut second = first[..14].to_vec();
            second.extend(tok.encode(" lived a quiet dragon who").unwrap());
            let ask = |id, prompt: &[u32]| {
                let (mut j, rx, _) = job(id, prompt, 8);
                j.logprobs = Some(2);
                engine.submit(j).unwrap();
                collect(&rx)
            };
            // Cold: the second prompt on an empty cache (nothing shares its start yet).
            let cold = ask(1, &second);
            assert_eq!(cold.usage.cached_tokens, 0);
            // The first prompt reuses that sequence and leaves its own run in it; the second
            // prompt, asked again, shares 14 tokens with it.
            let _ = ask(2, &first);
            let warm = ask(3, &second);
            assert_eq!(warm.usage.cached_tokens, want_cached, "{reuse}");
            if reuse == Reuse::Exact {
                let bits = |o: &Output| {
                    o.tokens
                        .iter()
                        .map(|t| (t.id, t.logprob.to_bits()))
                        .collect::<Vec<_>>()
                };
                assert_eq!(bits(&warm), bits(&cold));
            }
        });
    }
}
