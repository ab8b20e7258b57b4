//! The `kiln-run` binary end to end on a tiny fixture: output formats, chat sessions, bench, and
//! one test per bad-input case (clear message, usage exit status 2 or failure status 1).

/// The runner's test helpers (fixtures, reference dumps, metrics), shared rather than copied.
#[path = "../../runner/tests/common/mod.rs"]
mod common;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use common::*;
use kiln_format::layout::{HEADER_LEN, HEADER_SHA_RANGE};
use sha2::{Digest, Sha256};

const USAGE: i32 = 2;
/// A corrupt, missing or unsupported model is bad input too: 1 is only "a verification failed".
const FAILURE: i32 = 2;

fn tiny(dir: &Path) -> PathBuf {
    convert(&root().join("fixtures/tiny/llama-tied-f32"), dir, None)
}

fn kiln_run(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kiln-run"))
        .args(args)
        .output()
        .expect("run kiln-run")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Assert a failure with `code` whose message contains every one of `needles`.
fn assert_fails(o: &Output, code: i32, needles: &[&str]) {
    let err = stderr(o);
    assert_eq!(o.status.code(), Some(code), "stderr: {err}");
    for n in needles {
        assert!(err.contains(n), "expected {n:?} in: {err}");
    }
    assert!(
        o.stdout.is_empty(),
        "stdout: {}",
        String::from_utf8_lossy(&o.stdout)
    );
}

/// `kiln-run generate MODEL` of the reference prompt, 8 greedy tokens, `--json`, plus `args`:
/// the JSON and the generated ids, after checking it succeeded.
fn greedy_json(m: &Path, args: &[&str]) -> (serde_json::Value, Vec<u32>) {
    let prompt = "Once upon a time, 42 potters";
    let mut all = vec!["generate", m.to_str().unwrap(), "-p", prompt, "-n", "8"];
    all.extend_from_slice(&["--greedy", "--ignore-eos", "--json"]);
    all.extend_from_slice(args);
    let o = kiln_run(&all);
    assert!(o.status.success(), "{args:?}: {}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let tokens = v["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect();
    (v, tokens)
}

#[test]
fn generate_json_reports_text_tokens_and_rates() {
    let tmp = tempfile::tempdir().unwrap();
    let m = tiny(tmp.path());
    let (v, tokens) = greedy_json(&m, &["-t", "1"]);
    let r = Reference::load(&root().join("fixtures/reference/tiny/llama-tied-f32/0.safetensors"));
    assert_eq!(tokens, r.greedy_ids);
    assert_eq!(
        v["prompt_tokens"].as_u64().unwrap() as usize,
        r.input_ids.len()
    );
    assert!(v["text"].is_string());
    assert!(v["prefill_tok_s"].as_f64().unwrap() > 0.0);
    assert!(v["decode_tok_s"].as_f64().unwrap() > 0.0);
}

/// `--lookup` checks guesses without changing the output: greedy ids are still transformers'
/// (the reference dump's), the JSON counts the guesses, and an out-of-range N is refused
/// with exit status 2, naming the flag.
#[test]
fn generate_with_prompt_lookup_keeps_the_reference_tokens() {
    let tmp = tempfile::tempdir().unwrap();
    let m = tiny(tmp.path());
    let r = Reference::load(&root().join("fixtures/reference/tiny/llama-tied-f32/0.safetensors"));
    for n in ["1", "4", "16"] {
        let (v, tokens) = greedy_json(&m, &["-t", "2", "--lookup", n]);
        assert_eq!(tokens, r.greedy_ids, "--lookup {n}");
        let drafted = v["drafted_tokens"].as_u64().unwrap();
        let accepted = v["accepted_tokens"].as_u64().unwrap();
        assert!(accepted <= drafted, "--lookup {n}: {v}");
        let passes = v["decode_passes"].as_u64().unwrap();
        assert!((1..8).contains(&passes), "--lookup {n}: {v}");
        assert!(
            v["tokens_per_pass"].as_f64().unwrap() >= 1.0,
            "--lookup {n}: {v}"
        );
    }
    let o = kiln_run(&["generate", m.to_str().unwrap(), "-p", "x", "--lookup", "65"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("--lookup"), "{}", stderr(&o));
}

/// `--draft` checks a draft model's guesses without changing the output: greedy ids are still
/// transformers' with an F16 copy of the model as the draft, and with another model of the
/// same vocabulary; the JSON counts the guesses. Bad combinations are refused with exit
/// status 2, naming the flag or the file.
#[test]
fn generate_with_a_draft_model_keeps_the_reference_tokens() {
    let tmp = tempfile::tempdir().unwrap();
    let m = tiny(tmp.path());
    let r = Reference::load(&root().join("fixtures/reference/tiny/llama-tied-f32/0.safetensors"));
    let copy = convert(
        &root().join("fixtures/tiny/llama-tied-f32"),
        tmp.path(),
        Some(kiln_format::DType::F16),
    );
    let other = convert(&root().join("fixtures/tiny/qwen3-f32"), tmp.path(), None);
    for draft in [&copy, &other] {
        let d = draft.to_str().unwrap();
        let (v, tokens) = greedy_json(&m, &["-t", "2", "--draft", d, "--draft-p-min", "0"]);
        assert_eq!(tokens, r.greedy_ids, "--draft {d}");
        let drafted = v["drafted_tokens"].as_u64().unwrap();
        let accepted = v["accepted_tokens"].as_u64().unwrap();
        assert!(drafted > 0 && accepted <= drafted, "--draft {d}: {v}");
        assert!(v["tokens_per_pass"].as_f64().unwrap() >= 1.0, "{v}");
    }
    let c = copy.to_str().unwrap();
    let mp = m.to_str().unwrap();
    let run = |extra: &[&str]| {
        let mut a = vec!["generate", mp, "-p", "x", "-n", "2"];
        a.extend_from_slice(extra);
        kiln_run(&a)
    };
    assert_fails(
        &run(&["--draft", c, "--draft-min", "5", "--draft-max", "2"]),
        USAGE,
        &["--draft-min"],
    );
    assert_fails(&run(&["--draft", c, "--lookup", "4"]), USAGE, &["--lookup"]);
    assert_fails(&run(&["--draft-max", "4"]), USAGE, &["--draft"]);
    let missing = tmp.path().join("missing.kiln");
    assert_fails(
        &run(&["--draft", missing.to_str().unwrap()]),
        FAILURE,
        &["missing.kiln"],
    );
}

#[test]
fn generate_streams_text_and_prints_a_summary_and_seeds_reproduce() {
    let tmp = tempfile::tempdir().unwrap();
    let m = tiny(tmp.path());
    let run = |seed: &str| {
        kiln_run(&[
            "generate",
            m.to_str().unwrap(),
            "-p",
            "What is 7 * 6?",
            "--chat",
            "-n",
            "12",
            "--temp",
            "0.9",
            "--top-k",
            "40",
            "--top-p",
            "0.95",
            "--min-p",
            "0.02",
            "--repeat-penalty",
            "1.1",
            "--seed",
            seed,
        ])
    };
    let a = run("5");
    assert!(a.status.success(), "{}", stderr(&a));
    let err = stderr(&a);
    for k in ["load", "prompt 27 tokens", "prefill", "decode", "tok/s"] {
        assert!(err.contains(k), "{k:?} missing from summary: {err}");
    }
    assert_eq!(a.stdout, run("5").stdout);
}

#[test]
fn chat_keeps_the_cache_between_turns() {
    let tmp = tempfile::tempdir().unwrap();
    let m = tiny(tmp.path());
    let mut child = Command::new(env!("CARGO_BIN_EXE_kiln-run"))
        .args([
            "chat",
            m.to_str().unwrap(),
            "-n",
            "6",
            "--greedy",
            "-t",
            "1",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"What is 7 * 6?\nAnd 6 * 7?\n/exit\n")
        .unwrap();
    let o = child.wait_with_output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let err = stderr(&o);
    let cached: Vec<usize> = err
        .lines()
        .filter_map(|l| {
            let i = l.find(" cached)")?;
            let start = l[..i].rfind('(')? + 1;
            l[start..i].parse().ok()
        })
        .collect();
    assert_eq!(cached.len(), 2, "{err}");
    assert_eq!(cached[0], 0);
    assert!(
        cached[1] > 20,
        "second turn reused only {} tokens: {err}",
        cached[1]
    );
}

/// `kiln-run bench MODEL ARGS --json`'s results, after checking it succeeded.
fn bench_json(m: &Path, args: &[&str]) -> Vec<serde_json::Value> {
    let mut all = vec!["bench", m.to_str().unwrap()];
    all.extend_from_slice(args);
    all.push("--json");
    let o = kiln_run(&all);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    v["results"].as_array().unwrap().clone()
}

#[test]
fn bench_json_names_tests_like_llama_bench() {
    let tmp = tempfile::tempdir().unwrap();
    let m = tiny(tmp.path());
    let results = bench_json(&m, &["-p", "16", "-n", "8", "-r", "2", "-t", "1,2"]);
    let names: Vec<(&str, u64)> = results
        .iter()
        .map(|r| (r["test"].as_str().unwrap(), r["threads"].as_u64().unwrap()))
        .collect();
    assert_eq!(names, [("pp16", 1), ("tg8", 1), ("pp16", 2), ("tg8", 2)]);
    assert!(results.iter().all(|r| r["tok_s"].as_f64().unwrap() > 0.0));
    let table = kiln_run(&[
        "bench",
        m.to_str().unwrap(),
        "-p",
        "8",
        "-n",
        "4",
        "-r",
        "1",
    ]);
    assert!(String::from_utf8_lossy(&table.stdout).contains("| pp8 |"));
}

/// `bench -f PROMPT --lookup N` / `--draft D`: plain and speculative greedy generation of
/// the prompt's continuation, with acceptance, tokens per pass and speedup on the
/// speculative row; either half alone is bad input.
#[test]
fn bench_measures_speculative_decoding_on_a_text_prompt() {
    let tmp = tempfile::tempdir().unwrap();
    let m = tiny(tmp.path());
    let copy = convert(
        &root().join("fixtures/tiny/llama-tied-f32"),
        tmp.path(),
        Some(kiln_format::DType::F16),
    );
    let prompt = tmp.path().join("prompt.txt");
    std::fs::write(&prompt, "one two three one two three one two").unwrap();
    let p = prompt.to_str().unwrap();
    for (how, label) in [
        (vec!["--lookup", "4"], "lookup 4".to_string()),
        (
            vec!["--draft", copy.to_str().unwrap(), "--draft-p-min", "0"],
            format!("draft {}", copy.file_name().unwrap().to_string_lossy()),
        ),
    ] {
        let mut args = vec!["-p", "0", "-n", "12", "-r", "2", "-t", "1", "-f", p];
        args.extend_from_slice(&how);
        let results = bench_json(&m, &args);
        let names: Vec<String> = results
            .iter()
            .map(|r| r["test"].as_str().unwrap().to_string())
            .collect();
        let want = [
            "tg12".to_string(),
            "tg12 text".into(),
            format!("tg12 text, {label}"),
        ];
        assert_eq!(names, want);
        let (plain, spec) = (&results[1], &results[2]);
        assert!(plain.get("speedup").is_none(), "{plain}");
        assert_eq!(plain["samples"].as_array().unwrap().len(), 2);
        let acceptance = spec["acceptance"].as_f64().unwrap();
        assert!(acceptance > 0.0 && acceptance <= 1.0, "{spec}");
        assert!(spec["tokens_per_pass"].as_f64().unwrap() > 1.0, "{spec}");
        let ratio = spec["tok_s"].as_f64().unwrap() / plain["tok_s"].as_f64().unwrap();
        assert!(
            (spec["speedup"].as_f64().unwrap() - ratio).abs() < 1e-9,
            "{spec}"
        );
    }
    let mp = m.to_str().unwrap();
    let o = kiln_run(&["bench", mp, "-n", "4", "-r", "1", "--lookup", "4"]);
    assert_fails(&o, FAILURE, &["-f FILE"]);
    let o = kiln_run(&["bench", mp, "-n", "4", "-r", "1", "-f", p]);
    assert_fails(&o, FAILURE, &["--lookup"]);
}

/// `-b`: a prompt longer than the batch runs in several forward passes (reported as
/// `n_batch`); a batch of zero tokens is bad input naming the option.
#[test]
fn bench_prefills_in_batches_of_the_size_asked_for() {
    let tmp = tempfile::tempdir().unwrap();
    let m = tiny(tmp.path());
    for (b, want) in [("5", 5), ("512", 512)] {
        let results = bench_json(&m, &["-p", "12", "-n", "0", "-r", "1", "-t", "1", "-b", b]);
        assert_eq!(results.len(), 1);
        assert_eq!(results[0]["test"], "pp12");
        assert_eq!(results[0]["n_batch"].as_u64(), Some(want));
        assert!(results[0]["tok_s"].as_f64().unwrap() > 0.0);
    }
    let o = kiln_run(&[
        "bench",
        m.to_str().unwrap(),
        "-p",
        "8",
        "-b",
        "0",
        "-r",
        "1",
    ]);
    assert_fails(&o, USAGE, &["--batch-size"]);
}

#[test]
fn bench_depth_starts_each_test_with_that_many_cached_tokens() {
    let tmp = tempfile::tempdir().unwrap();
    let m = tiny(tmp.path());
    let results = bench_json(
        &m,
        &["-p", "8", "-n", "4", "-r", "2", "-t", "1", "-d", "0,20"],
    );
    let names: Vec<(&str, u64)> = results
        .iter()
        .map(|r| (r["test"].as_str().unwrap(), r["n_depth"].as_u64().unwrap()))
        .collect();
    assert_eq!(
        names,
        [("pp8", 0), ("tg4", 0), ("pp8 @ d20", 20), ("tg4 @ d20", 20)]
    );
    // A depth past what the model can hold is refused before anything runs.
    let o = kiln_run(&["bench", m.to_str().unwrap(), "-d", "100000000", "-r", "1"]);
    assert_fails(&o, USAGE, &["context"]);
}

/// `--cache-type`: f32 and f16 give the reference's greedy tokens and report their size (f16
/// half of f32's); a q8_0 cache on heads that are not whole blocks, or an unknown type, is bad
/// input naming the option; bench reports the type.
#[test]
fn cache_types_run_report_their_size_and_refuse_what_cannot_work() {
    let tmp = tempfile::tempdir().unwrap();
    let m = tiny(tmp.path());
    let r = Reference::load(&root().join("fixtures/reference/tiny/llama-tied-f32/0.safetensors"));
    let mut bytes = Vec::new();
    for ty in ["f32", "f16"] {
        let (v, tokens) = greedy_json(&m, &["--cache-type", ty]);
        assert_eq!(tokens, r.greedy_ids, "{ty}");
        assert_eq!(v["cache_type"], ty);
        bytes.push(v["cache_bytes"].as_u64().unwrap());
    }
    assert_eq!(bytes[0], 2 * bytes[1], "f32 cache bytes = 2 × f16");
    let refused: [(&str, &[&str]); 2] = [
        ("q8_0", &["--cache-type", "16 wide", "f16"]),
        ("q4_0", &["q4_0", "f32, f16, q8_0"]),
    ];
    for (ty, needles) in refused {
        let args = [
            "generate",
            m.to_str().unwrap(),
            "-p",
            "hi",
            "--cache-type",
            ty,
        ];
        assert_fails(&kiln_run(&args), USAGE, needles);
    }
    let o = kiln_run(&[
        "bench",
        m.to_str().unwrap(),
        "-p",
        "8",
        "-n",
        "2",
        "-r",
        "1",
        "--cache-type",
        "f32",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["cache_type"], "f32");
}

#[test]
fn rejects_a_newer_major_version() {
    let tmp = tempfile::tempdir().unwrap();
    let m = tiny(tmp.path());
    let mut bytes = std::fs::read(&m).unwrap();
    bytes[8..10].copy_from_slice(&2u16.to_le_bytes());
    std::fs::write(&m, bytes).unwrap();
    let o = kiln_run(&["generate", m.to_str().unwrap(), "-p", "hi"]);
    assert_fails(
        &o,
        FAILURE,
        &["version 2.0 is not supported", "upgrade Kiln"],
    );
}

#[test]
fn rejects_an_unsupported_architecture() {
    let tmp = tempfile::tempdir().unwrap();
    let m = tiny(tmp.path());
    let mut bytes = std::fs::read(&m).unwrap();
    let meta_len = u64::from_le_bytes(bytes[24..32].try_into().unwrap()) as usize;
    let index_len = u64::from_le_bytes(bytes[40..48].try_into().unwrap()) as usize;
    let start = HEADER_LEN as usize;
    let meta = std::str::from_utf8(&bytes[start..start + meta_len]).unwrap();
    // Same length, so every offset stays valid; then re-seal the header checksum.
    let patched = meta.replacen(
        "\"architecture\":\"llama\"",
        "\"architecture\":\"gemma\"",
        1,
    );
    assert_ne!(
        patched, meta,
        "metadata spells the architecture differently"
    );
    bytes[start..start + meta_len].copy_from_slice(patched.as_bytes());
    let mut h = Sha256::new();
    h.update(&bytes[..HEADER_SHA_RANGE.start]);
    h.update(&bytes[start..start + meta_len + index_len]);
    let sha: [u8; 32] = h.finalize().into();
    bytes[HEADER_SHA_RANGE].copy_from_slice(&sha);
    std::fs::write(&m, bytes).unwrap();
    let o = kiln_run(&["generate", m.to_str().unwrap(), "-p", "hi"]);
    assert_fails(
        &o,
        FAILURE,
        &["unsupported architecture `gemma`", "llama, mistral, qwen2"],
    );
}

#[test]
fn rejects_a_prompt_longer_than_the_context() {
    let tmp = tempfile::tempdir().unwrap();
    let m = tiny(tmp.path());
    let o = kiln_run(&[
        "generate",
        m.to_str().unwrap(),
        "-p",
        "Once upon a time, 42 potters",
        "--ctx",
        "8",
    ]);
    assert_fails(
        &o,
        USAGE,
        &["the prompt is 21 tokens but the context holds 8"],
    );
    let o = kiln_run(&[
        "generate",
        m.to_str().unwrap(),
        "-p",
        "hi",
        "--ctx",
        "100000",
    ]);
    assert_fails(&o, USAGE, &["--ctx", "trained context of 256"]);
}

#[test]
fn rejects_a_non_utf8_prompt() {
    use std::os::unix::ffi::OsStrExt;
    let tmp = tempfile::tempdir().unwrap();
    let m = tiny(tmp.path());
    let bad = std::ffi::OsStr::from_bytes(b"caf\xe9 au lait");
    let o = Command::new(env!("CARGO_BIN_EXE_kiln-run"))
        .arg("generate")
        .arg(&m)
        .arg("-p")
        .arg(bad)
        .output()
        .unwrap();
    assert_fails(
        &o,
        USAGE,
        &["prompt given with -p is not valid UTF-8", "offset 3"],
    );
    let f = tmp.path().join("prompt.txt");
    std::fs::write(&f, b"ok \xff").unwrap();
    let o = kiln_run(&["generate", m.to_str().unwrap(), "-f", f.to_str().unwrap()]);
    assert_fails(&o, USAGE, &["not valid UTF-8", "offset 3"]);
}

#[test]
fn rejects_zero_threads() {
    let tmp = tempfile::tempdir().unwrap();
    let m = tiny(tmp.path());
    for args in [
        vec![
            "generate",
            m.to_str().unwrap(),
            "-p",
            "hi",
            "--threads",
            "0",
        ],
        vec!["bench", m.to_str().unwrap(), "-t", "0"],
        vec!["chat", m.to_str().unwrap(), "-t", "0"],
    ] {
        let o = kiln_run(&args);
        assert_fails(
            &o,
            USAGE,
            &[
                "invalid value '0' for '--threads <THREADS>'",
                "must be a whole number, at least 1",
            ],
        );
    }
}

#[test]
fn rejects_a_file_that_is_not_kiln() {
    let tmp = tempfile::tempdir().unwrap();
    let f = tmp.path().join("model.safetensors");
    std::fs::write(&f, b"\x10\x00\x00\x00\x00\x00\x00\x00{}              ").unwrap();
    let o = kiln_run(&["generate", f.to_str().unwrap(), "-p", "hi"]);
    assert_fails(&o, FAILURE, &["not a .kiln file"]);
    let o = kiln_run(&["generate", "/nonexistent/model.kiln", "-p", "hi"]);
    assert_fails(&o, FAILURE, &["cannot open"]);
}

#[test]
fn chat_flag_needs_a_template_and_system_needs_chat() {
    let tmp = tempfile::tempdir().unwrap();
    let m = tiny(tmp.path());
    let o = kiln_run(&["generate", m.to_str().unwrap(), "-p", "hi", "--system", "x"]);
    assert_eq!(o.status.code(), Some(USAGE));
}

/// `--template-var` reaches the template (rendered in the sandboxed child), checked before the
/// model is loaded; `generate` takes it with `--chat` only.
#[test]
fn template_vars_reach_the_template_and_bad_ones_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let m = tiny_with_template(
        tmp.path(),
        "{% if enable_thinking is false %}{{ 'a' }}{% else %}{{ 'b c d e f g h i j k' }}{% endif %}{{ messages[0]['content'] }}",
    );
    let m = m.to_str().unwrap();
    let prompt_tokens = |extra: &[&str]| {
        let mut args = vec!["generate", m, "-p", "hi", "-n", "1", "--chat", "--json"];
        args.extend_from_slice(extra);
        let o = kiln_run(&args);
        assert!(o.status.success(), "{}", stderr(&o));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        v["prompt_tokens"].as_u64().unwrap()
    };
    let thinking = prompt_tokens(&[]);
    let off = prompt_tokens(&["--template-var", "enable_thinking=false"]);
    assert!(off < thinking, "{off} < {thinking}");
    assert_eq!(
        prompt_tokens(&["--template-var", "enable_thinking=\"false\""]),
        thinking,
        "the string \"false\" is not false"
    );
    let o = kiln_run(&["chat", m, "--template-var", "messages=[]"]);
    assert_fails(
        &o,
        USAGE,
        &["template variable `messages`", "sets this one itself"],
    );
    let o = kiln_run(&["chat", m, "--template-var", "enable_thinking=False"]);
    assert_fails(&o, USAGE, &["`enable_thinking`", "JSON `false`"]);
    let o = kiln_run(&["generate", m, "-p", "hi", "--template-var", "x=1"]);
    assert_eq!(o.status.code(), Some(USAGE), "--template-var needs --chat");
}

/// The tiny fixture converted after `edit` changed a copy of its directory.
fn tiny_edited(dir: &Path, edit: impl FnOnce(&Path)) -> PathBuf {
    let src = root().join("fixtures/tiny/llama-tied-f32");
    let copy = dir.join("edited");
    let _ = std::fs::remove_dir_all(&copy);
    std::fs::create_dir_all(&copy).unwrap();
    for e in std::fs::read_dir(&src).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), copy.join(e.file_name())).unwrap();
    }
    edit(&copy);
    convert(&copy, dir, None)
}

/// The tiny fixture converted with `template` as its chat template.
fn tiny_with_template(dir: &Path, template: &str) -> PathBuf {
    tiny_edited(dir, |d| {
        std::fs::write(d.join("chat_template.jinja"), template).unwrap()
    })
}

/// Set `key` to `value` in the JSON file `name` of directory `d`.
fn set_json(d: &Path, name: &str, key: &str, value: serde_json::Value) {
    let p = d.join(name);
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    v[key] = value;
    std::fs::write(&p, serde_json::to_vec(&v).unwrap()).unwrap();
}

#[test]
fn messages_name_the_field_and_the_file_at_fault() {
    let tmp = tempfile::tempdir().unwrap();
    // A bos_token_id outside the vocabulary is blamed on bos_token_id (the converter refuses
    // it too, so the config is edited after conversion).
    let f = kiln_format::KilnFile::open(tiny(tmp.path())).unwrap();
    let mut mc = f.metadata().config.clone();
    mc.bos_token_id = Some(100_000);
    let e = kiln_runner::Config::from_model_config("m.kiln", &mc).unwrap_err();
    assert!(e.to_string().contains("`bos_token_id`"), "{e}");
    // A bad sampling default is the file's fault, not the flag's; the flag can override it.
    let m = tiny_edited(tmp.path(), |d| {
        set_json(d, "generation_config.json", "do_sample", true.into());
        set_json(d, "generation_config.json", "top_p", 5.into());
    });
    let o = kiln_run(&["generate", m.to_str().unwrap(), "-p", "hi", "-n", "1"]);
    assert_fails(
        &o,
        USAGE,
        &["generation_config.json `top_p`", "override it with --top-p"],
    );
    let o = kiln_run(&[
        "generate",
        m.to_str().unwrap(),
        "-p",
        "hi",
        "-n",
        "1",
        "--top-p",
        "0.9",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    // A directory given as the model.
    let o = kiln_run(&["generate", tmp.path().to_str().unwrap(), "-p", "hi"]);
    assert_fails(&o, FAILURE, &["is a directory, not a file"]);
}

#[test]
fn a_hostile_chat_template_is_stopped_with_an_error() {
    let tmp = tempfile::tempdir().unwrap();
    for (template, needle) in [
        (
            "{% for i in range(10000) %}{% for j in range(10000) %}{% for k in range(10000) %}{% endfor %}{% endfor %}{% endfor %}",
            "instructions",
        ),
        (
            "{% for i in range(1000) %}{{ 'x' * 10000000 }}{% endfor %}",
            "bytes of output",
        ),
        // Regression: doubling a string forty times asks for a terabyte in forty instructions
        // and aborted the process (SIGABRT, "memory allocation of N bytes failed").
        (
            "{% set ns = namespace(s='xxxxxxxx') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s | length }}",
            "MiB of memory",
        ),
    ] {
        let m = tiny_with_template(tmp.path(), template);
        let o = kiln_run(&["generate", m.to_str().unwrap(), "--chat", "-p", "hi", "-n", "1"]);
        assert_fails(
            &o,
            USAGE,
            &["the chat template exceeded its limit", needle, m.to_str().unwrap()],
        );
    }
}

#[test]
fn a_prompt_that_cannot_fit_is_refused_before_tokenizing() {
    let tmp = tempfile::tempdir().unwrap();
    let m = tiny(tmp.path());
    let prompt = tmp.path().join("big.txt");
    std::fs::write(&prompt, "potters ".repeat(1 << 20)).unwrap();
    let o = kiln_run(&[
        "generate",
        m.to_str().unwrap(),
        "-f",
        prompt.to_str().unwrap(),
        "--ctx",
        "64",
    ]);
    assert_fails(
        &o,
        USAGE,
        &["the prompt is 8388608 bytes", "64-token context"],
    );
}

#[test]
fn a_flipped_weight_byte_is_refused_unless_verification_is_skipped() {
    let tmp = tempfile::tempdir().unwrap();
    let m = tiny(tmp.path());
    let f = kiln_format::KilnFile::open(&m).unwrap();
    let info = f.info("layers.1.mlp.down.weight").unwrap().clone();
    drop(f);
    let mut bytes = std::fs::read(&m).unwrap();
    bytes[(info.offset + info.len / 2) as usize] ^= 0x08;
    std::fs::write(&m, bytes).unwrap();
    let path = m.to_str().unwrap();
    for cmd in [
        &["generate", path, "-p", "hi", "-n", "2"][..],
        &["bench", path, "-p", "4", "-n", "2", "-r", "1"][..],
    ] {
        let o = kiln_run(cmd);
        assert_fails(&o, FAILURE, &["layers.1.mlp.down.weight", "checksum", path]);
    }
    let o = kiln_run(&["generate", path, "-p", "hi", "-n", "2", "--no-verify"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
}

#[test]
fn absurd_thread_counts_are_capped_with_a_notice() {
    let tmp = tempfile::tempdir().unwrap();
    let m = tiny(tmp.path());
    let o = kiln_run(&[
        "generate",
        m.to_str().unwrap(),
        "-p",
        "hi",
        "-n",
        "2",
        "-t",
        "100000",
        "--json",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("--threads 100000 is more than"),
        "{}",
        stderr(&o)
    );
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let threads = v["threads"].as_u64().unwrap() as usize;
    assert_eq!(threads, kiln_runner::threads::max_threads());
}

/// `embed` on a generator is refused by name, before any output file is created; a bad
/// output request is refused before the model is read.
#[test]
fn embed_refuses_a_generator_and_leaves_no_output() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let m = model.to_str().unwrap();
    let out = dir.path().join("v.npy");
    let o = kiln_run(&[
        "embed",
        m,
        "-p",
        "hello",
        "--format",
        "npy",
        "-o",
        out.to_str().unwrap(),
    ]);
    assert_fails(&o, USAGE, &["not an embedding model", "Llama"]);
    assert!(!out.exists());
    let o = kiln_run(&["embed", m, "-p", "hello", "--format", "npy"]);
    assert_fails(&o, USAGE, &["--format", "-o"]);
    let o = kiln_run(&["embed", m, "-p", "hello", "--pooling", "max"]);
    assert_fails(&o, USAGE, &["max"]);
    // The vectors never replace the texts they came from, even with --force.
    let texts = dir.path().join("texts.txt");
    std::fs::write(&texts, "one\ntwo\n").unwrap();
    let t = texts.to_str().unwrap();
    let o = kiln_run(&["embed", m, "-f", t, "-o", t, "--force"]);
    assert_fails(&o, USAGE, &["the output is also an input"]);
    assert_eq!(std::fs::read_to_string(&texts).unwrap(), "one\ntwo\n");
}
