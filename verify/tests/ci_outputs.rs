//! kiln-verify as a CI gate, on the committed tiny fixtures: exit statuses, JUnit XML whose
//! structure and counts are checked, HTML reports, perplexity gates, tolerance classes, and
//! reference dumps that keep transformers' batch dimension.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use kiln_convert::{convert_hf, ConvertOptions, NoProgress};
use kiln_format::blocks::quantize_row_q8_0_ref;
use kiln_format::{DType, KilnFile, KilnWriter, TensorSpec};

const MODEL: &str = "llama-untied-bf16";

/// The activation site the corrupted layer's error first shows at.
const CORRUPT_TENSOR: &str = "layers.1.mlp.down.weight";
const CORRUPT_SITE: &str = "model.layers.1.mlp.output";

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn reference(k: usize) -> PathBuf {
    repo().join(format!("fixtures/reference/tiny/{MODEL}/{k}.safetensors"))
}

fn convert(dir: &Path) -> PathBuf {
    let out = dir.join("model.kiln");
    convert_hf(
        &ConvertOptions {
            input: repo().join("fixtures/tiny").join(MODEL),
            output: out.clone(),
            dtype: Some(DType::F32),
            overwrite: true,
            allow_non_finite: false,
        },
        &NoProgress,
    )
    .unwrap();
    out
}

/// Rewrite an F32 `.kiln` file through `KilnWriter` (so its checksums are valid), letting
/// `encode` choose each tensor's dtype and bytes from its name, shape and values.
fn rewritten(
    src: &Path,
    dst: &Path,
    encode: impl Fn(&str, &[u64], Vec<f32>) -> (DType, Vec<u8>),
) -> PathBuf {
    let f = KilnFile::open(src).unwrap();
    let encoded: Vec<(DType, Vec<u8>)> = f
        .tensors()
        .iter()
        .map(|t| encode(&t.name, &t.shape, f.view(t).to_f32_vec()))
        .collect();
    let specs: Vec<TensorSpec> = f
        .tensors()
        .iter()
        .zip(&encoded)
        .map(|(t, (d, _))| TensorSpec {
            name: t.name.clone(),
            dtype: *d,
            shape: t.shape.clone(),
        })
        .collect();
    let w = KilnWriter::create(dst, f.metadata(), specs, true).unwrap();
    for (i, (_, bytes)) in encoded.iter().enumerate() {
        w.write_tensor(i, bytes).unwrap();
    }
    w.finish().unwrap();
    dst.to_path_buf()
}

fn f32_bytes(x: &[f32]) -> Vec<u8> {
    x.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// The model with one layer's down projection scaled: out of tolerance from that layer on.
fn corrupted(good: &Path, dir: &Path) -> PathBuf {
    rewritten(good, &dir.join("corrupt.kiln"), |name, _, mut x| {
        if name == CORRUPT_TENSOR {
            x.iter_mut().for_each(|v| *v *= 1.5);
        }
        (DType::F32, f32_bytes(&x))
    })
}

/// The model with every layer matrix in Q8_0 blocks (the format's reference quantizer).
fn q8_0(good: &Path, dir: &Path) -> PathBuf {
    rewritten(good, &dir.join("q8_0.kiln"), |name, shape, x| {
        if name.starts_with("layers.") && shape.len() == 2 {
            let blocks = quantize_row_q8_0_ref(&x).unwrap();
            // Block layout: the f16 scale, then 32 signed codes.
            let bytes = blocks
                .iter()
                .flat_map(|b| {
                    b.d.to_le_bytes()
                        .into_iter()
                        .chain(b.qs.iter().map(|&q| q as u8))
                })
                .collect();
            (DType::Q8_0, bytes)
        } else {
            (DType::F32, f32_bytes(&x))
        }
    })
}

fn kv(args: &[&dyn AsRef<std::ffi::OsStr>]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kiln-verify"))
        .args(args.iter().map(|a| a.as_ref()))
        .output()
        .unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// One `<testcase>`: its name and, when it failed, its failure message.
#[derive(Debug)]
struct Case {
    name: String,
    failure: Option<String>,
}

/// The value of attribute `key` in the start tag `tag` (`<x a="1" …`), unescaped.
fn attr(tag: &str, key: &str) -> String {
    let start = tag
        .find(&format!(" {key}=\""))
        .unwrap_or_else(|| panic!("no {key} in {tag}"))
        + key.len()
        + 3;
    let len = tag[start..].find('"').unwrap();
    tag[start..start + len]
        .replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&quot;", "\"")
        .replace("&apos;", "'")
        .replace("&#10;", "\n")
        .replace("&amp;", "&")
}

/// Check a JUnit document's element structure by hand (`<testsuites>` holding `<testsuite>`s
/// holding `<testcase>`s, each with at most one `<failure>`, every element closed in order),
/// that `tests`/`failures` match what it holds at both levels and that every time is a number;
/// return the cases of its one suite.
fn junit_cases(path: &Path) -> Vec<Case> {
    let x = std::fs::read_to_string(path).unwrap();
    assert!(
        x.starts_with("<?xml version=\"1.0\" encoding=\"UTF-8\"?>"),
        "{x}"
    );
    let mut stack: Vec<String> = Vec::new();
    let mut cases: Vec<Case> = Vec::new();
    let (mut suites, mut suite_tests, mut suite_failures) = (0usize, 0usize, 0usize);
    let mut declared: Vec<(usize, usize)> = Vec::new();
    let mut rest = &x[x.find("?>").unwrap() + 2..];
    while let Some(open) = rest.find('<') {
        assert!(
            rest[..open].trim().is_empty() || stack.last().map(String::as_str) != Some("testsuite"),
            "stray text {:?}",
            &rest[..open]
        );
        let close = rest[open..].find('>').unwrap() + open;
        let tag = &rest[open..=close];
        rest = &rest[close + 1..];
        assert!(!tag[1..tag.len() - 1].contains('<'), "unescaped < in {tag}");
        if let Some(name) = tag.strip_prefix("</") {
            let name = name.trim_end_matches('>');
            assert_eq!(stack.pop().as_deref(), Some(name), "unbalanced {tag}");
            if name == "testsuite" {
                declared.push((suite_tests, suite_failures));
            }
            continue;
        }
        let name = tag[1..]
            .split(|c: char| c.is_whitespace() || c == '>' || c == '/')
            .next()
            .unwrap()
            .to_string();
        let parent = stack.last().map(String::as_str);
        match name.as_str() {
            "testsuites" => assert_eq!(parent, None),
            "testsuite" => {
                assert_eq!(parent, Some("testsuites"));
                suites += 1;
                suite_tests = attr(tag, "tests").parse().unwrap();
                suite_failures = attr(tag, "failures").parse().unwrap();
                attr(tag, "time").parse::<f64>().unwrap();
            }
            "testcase" => {
                assert_eq!(parent, Some("testsuite"));
                attr(tag, "time").parse::<f64>().unwrap();
                attr(tag, "classname");
                cases.push(Case {
                    name: attr(tag, "name"),
                    failure: None,
                });
            }
            "failure" => {
                assert_eq!(parent, Some("testcase"));
                let c = cases.last_mut().unwrap();
                assert!(c.failure.is_none(), "two failures in {}", c.name);
                c.failure = Some(attr(tag, "message"));
            }
            "system-out" => assert_eq!(parent, Some("testcase")),
            other => panic!("unexpected element <{other}>"),
        }
        if !tag.ends_with("/>") {
            stack.push(name);
        }
    }
    assert!(stack.is_empty(), "unclosed {stack:?}");
    assert_eq!(suites, 1);
    let failures = cases.iter().filter(|c| c.failure.is_some()).count();
    assert_eq!(declared, vec![(cases.len(), failures)], "suite counts");
    let top = &x[x.find("<testsuites").unwrap()..];
    let top = &top[..top.find('>').unwrap()];
    assert_eq!(attr(top, "tests"), cases.len().to_string());
    assert_eq!(attr(top, "failures"), failures.to_string());
    cases
}

#[test]
fn layers_junit_and_report_for_a_correct_model_pass() {
    let tmp = tempfile::tempdir().unwrap();
    let good = convert(tmp.path());
    let (junit, html) = (
        tmp.path().join("layers.xml"),
        tmp.path().join("layers.html"),
    );
    let o = kv(&[
        &"layers",
        &good,
        &"--reference",
        &reference(0),
        &"--junit",
        &junit,
        &"--report",
        &html,
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let cases = junit_cases(&junit);
    assert!(cases.iter().all(|c| c.failure.is_none()), "{cases:?}");
    assert!(cases.iter().any(|c| c.name == "logits"));
    let page = std::fs::read_to_string(&html).unwrap();
    // NMSE and cosine charts: one point per compared site in each.
    assert_eq!(
        page.matches("<circle class=\"point\"").count(),
        2 * cases.len()
    );
    assert!(!page.contains("http://") && !page.contains("https://"));
}

#[test]
fn a_corrupted_layer_fails_with_its_site_as_the_first_failing_testcase() {
    let tmp = tempfile::tempdir().unwrap();
    let good = convert(tmp.path());
    let bad = corrupted(&good, tmp.path());
    let junit = tmp.path().join("layers.xml");
    let o = kv(&[
        &"layers",
        &bad,
        &"--reference",
        &reference(0),
        &"--junit",
        &junit,
    ]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let cases = junit_cases(&junit);
    let first = cases.iter().find(|c| c.failure.is_some()).unwrap();
    assert_eq!(first.name, CORRUPT_SITE);
    let msg = first.failure.as_deref().unwrap();
    assert!(
        msg.contains("NMSE") && msg.contains("over the allowed 1e-8"),
        "{msg}"
    );
    // Every site before it passed.
    let at = cases.iter().position(|c| c.name == CORRUPT_SITE).unwrap();
    assert!(cases[..at].iter().all(|c| c.failure.is_none()));
}

#[test]
fn tolerance_classes_are_chosen_by_name_and_overridden_by_limits() {
    let tmp = tempfile::tempdir().unwrap();
    let good = convert(tmp.path());
    let bad = corrupted(&good, tmp.path());
    let r = reference(1);
    // The scaled layer is out of the f32 limit but within Q4_0's looser one.
    let run = |extra: &[&dyn AsRef<std::ffi::OsStr>]| {
        let mut args: Vec<&dyn AsRef<std::ffi::OsStr>> = vec![&"layers", &bad, &"--reference", &r];
        args.extend_from_slice(extra);
        kv(&args)
    };
    assert_eq!(run(&[&"--tolerance", &"f32"]).status.code(), Some(1));
    assert_eq!(run(&[&"--tolerance", &"q4_0"]).status.code(), Some(0));
    assert_eq!(
        run(&[&"--tolerance", &"q4_0", &"--max-nmse", &"0"])
            .status
            .code(),
        Some(1)
    );
    let o = run(&[&"--tolerance", &"q2"]);
    assert_eq!(o.status.code(), Some(2));
    let e = stderr(&o);
    for name in ["f32", "f16", "bf16", "q8_0", "q4_0"] {
        assert!(e.contains(name), "{e}");
    }
}

#[test]
fn perplexity_gates_fail_with_the_gate_named_and_pass_when_generous() {
    let tmp = tempfile::tempdir().unwrap();
    let good = convert(tmp.path());
    let quant = q8_0(&good, tmp.path());
    let text = repo().join("fixtures/tiny/corpus.txt");
    let base = tmp.path().join("base.logits");
    let common: [&dyn AsRef<std::ffi::OsStr>; 6] =
        [&"--text", &text, &"-c", &"64", &"--chunks", &"3"];
    let run = |model: &Path, extra: &[&dyn AsRef<std::ffi::OsStr>]| {
        let mut args: Vec<&dyn AsRef<std::ffi::OsStr>> = vec![&"perplexity", &model];
        args.extend_from_slice(&common);
        args.extend_from_slice(extra);
        kv(&args)
    };
    let o = run(&good, &[&"--save-logits", &base]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));

    // No divergence is allowed: the Q8_0 file fails, naming the gate in stderr and JUnit.
    let (junit, html) = (tmp.path().join("ppl.xml"), tmp.path().join("ppl.html"));
    let o = run(
        &quant,
        &[
            &"--kl-base",
            &base,
            &"--max-kld",
            &"0",
            &"--max-ppl-ratio",
            &"10",
            &"--junit",
            &junit,
            &"--report",
            &html,
        ],
    );
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("--max-kld"), "{}", stderr(&o));
    let cases = junit_cases(&junit);
    // Three chunks, then the two gates.
    let names: Vec<&str> = cases.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "chunk 0",
            "chunk 1",
            "chunk 2",
            "--max-kld",
            "--max-ppl-ratio"
        ]
    );
    let failing: Vec<&Case> = cases.iter().filter(|c| c.failure.is_some()).collect();
    assert_eq!(failing.len(), 1, "{cases:?}");
    assert_eq!(failing[0].name, "--max-kld");
    let msg = failing[0].failure.as_deref().unwrap();
    assert!(msg.contains("over the allowed 0 by"), "{msg}");
    let page = std::fs::read_to_string(&html).unwrap();
    assert_eq!(page.matches("<circle class=\"point\"").count(), 3);
    assert!(page.contains("<rect class=\"bin\""));
    assert!(!page.contains("http://") && !page.contains("https://"));

    // Generous gates pass, and the JUnit file is replaced.
    let o = run(
        &quant,
        &[
            &"--kl-base",
            &base,
            &"--max-kld",
            &"1",
            &"--max-ppl-ratio",
            &"1.5",
            &"--junit",
            &junit,
        ],
    );
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(junit_cases(&junit).iter().all(|c| c.failure.is_none()));

    // The base file against itself: perplexity ratio 1 (up to the saved f16 rounding).
    let o = run(
        &good,
        &[&"--kl-base", &base, &"--max-ppl-ratio", &"1.001", &"--json"],
    );
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let ratio = v["ppl"].as_f64().unwrap() / v["base_ppl"].as_f64().unwrap();
    assert!((ratio - 1.0).abs() < 1e-3, "{ratio}");
    // A ratio below 1 cannot be met by the model against itself.
    assert_eq!(
        run(&good, &[&"--kl-base", &base, &"--max-ppl-ratio", &"0.9"])
            .status
            .code(),
        Some(1)
    );
    // A gate needs the base.
    assert_eq!(run(&quant, &[&"--max-kld", &"1"]).status.code(), Some(2));
}

#[test]
fn integrity_and_diff_write_one_testcase_per_tensor() {
    let tmp = tempfile::tempdir().unwrap();
    let good = convert(tmp.path());
    let n = KilnFile::open(&good).unwrap().tensors().len();
    let junit = tmp.path().join("integrity.xml");
    let o = kv(&[&"integrity", &good, &"--junit", &junit]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_eq!(junit_cases(&junit).len(), n);

    // A flipped byte: exit 1 and exactly that tensor fails, in both commands.
    let copy = tmp.path().join("copy.kiln");
    std::fs::copy(&good, &copy).unwrap();
    let info = KilnFile::open(&copy)
        .unwrap()
        .info(CORRUPT_TENSOR)
        .unwrap()
        .clone();
    let mut bytes = std::fs::read(&copy).unwrap();
    bytes[info.offset as usize] ^= 1;
    std::fs::write(&copy, bytes).unwrap();
    let o = kv(&[&"integrity", &copy, &"--junit", &junit]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let failing: Vec<Case> = junit_cases(&junit)
        .into_iter()
        .filter(|c| c.failure.is_some())
        .collect();
    assert_eq!(failing.len(), 1);
    assert_eq!(failing[0].name, CORRUPT_TENSOR);
    assert!(failing[0]
        .failure
        .as_deref()
        .unwrap()
        .contains("checksum mismatch"));

    let diff = tmp.path().join("diff.xml");
    let o = kv(&[&"diff", &good, &copy, &"--junit", &diff]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let cases = junit_cases(&diff);
    assert_eq!(cases.len(), n);
    let failing: Vec<&str> = cases
        .iter()
        .filter(|c| c.failure.is_some())
        .map(|c| c.name.as_str())
        .collect();
    assert_eq!(failing, [CORRUPT_TENSOR]);
}

#[test]
fn results_files_never_replace_an_input_or_each_other() {
    let tmp = tempfile::tempdir().unwrap();
    let good = convert(tmp.path());
    let r = reference(0);
    let before = std::fs::read(&r).unwrap();
    let o = kv(&[&"layers", &good, &"--reference", &r, &"--junit", &r]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("also an input"), "{}", stderr(&o));
    assert_eq!(std::fs::read(&r).unwrap(), before);
    let o = kv(&[&"integrity", &good, &"--junit", &good]);
    assert_eq!(o.status.code(), Some(2));
    let same = tmp.path().join("out");
    let o = kv(&[
        &"layers",
        &good,
        &"--reference",
        &r,
        &"--junit",
        &same,
        &"--report",
        &same,
    ]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(!same.exists());
    let text = repo().join("fixtures/tiny/corpus.txt");
    let o = kv(&[
        &"perplexity",
        &good,
        &"--text",
        &text,
        &"-c",
        &"64",
        &"--chunks",
        &"2",
        &"--report",
        &text,
    ]);
    assert_eq!(o.status.code(), Some(2));
}

#[test]
fn a_dump_with_transformers_batch_dimension_is_read_as_unbatched() {
    let tmp = tempfile::tempdir().unwrap();
    let good = convert(tmp.path());
    let batched = tmp.path().join("batched.safetensors");
    common::rewrite_safetensors(&reference(0), &batched, |_, s, _| s.insert(0, 1));
    let plain = kiln_verify::dump::Dump::load(&reference(0)).unwrap();
    let b = kiln_verify::dump::Dump::load(&batched).unwrap();
    assert_eq!(b.input_ids, plain.input_ids);
    assert_eq!(b.activations.len(), plain.activations.len());
    for (x, y) in b.activations.iter().zip(&plain.activations) {
        assert_eq!((&x.0, x.1), (&y.0, y.1));
        assert_eq!(x.2, y.2);
    }
    let o = kv(&[&"layers", &good, &"--reference", &batched]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));

    // A batch of two prompts (the logits given twice) is refused, naming the tensor and its
    // shape.
    let two = tmp.path().join("two.safetensors");
    common::rewrite_safetensors(&reference(0), &two, |n, s, d| {
        if n == "logits" {
            s.insert(0, 2);
            d.extend_from_within(..);
        } else {
            s.insert(0, 1);
        }
    });
    let o = kv(&[&"layers", &good, &"--reference", &two]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let e = stderr(&o);
    assert!(
        e.contains("`logits`") && e.contains("[2, ") && e.contains("two.safetensors"),
        "{e}"
    );
}
