//! Every numeric flag of every `kiln-run` subcommand refuses `-1` by its range, naming the flag
//! and the range, with exit status 2. Regression: clap took `-1` for an unknown option and said
//! "unexpected argument '-1' found", which names no flag.
//!
//! The tables below list each subcommand's flags that take a value; a flag `--help` shows that
//! is in neither table fails the test, so a new numeric flag cannot miss its range check.

use std::process::Command;

/// Each subcommand's flags whose value is a number.
const NUMERIC: &[(&str, &[&str])] = &[
    (
        "generate",
        &[
            "--ctx",
            "--threads",
            "--n-predict",
            "--batch-size",
            "--lookup",
            "--draft-max",
            "--draft-min",
            "--draft-p-min",
            "--temp",
            "--top-k",
            "--top-p",
            "--min-p",
            "--repeat-penalty",
            "--repeat-last-n",
            "--seed",
        ],
    ),
    (
        "chat",
        &[
            "--ctx",
            "--threads",
            "--n-predict",
            "--batch-size",
            "--lookup",
            "--draft-max",
            "--draft-min",
            "--draft-p-min",
            "--temp",
            "--top-k",
            "--top-p",
            "--min-p",
            "--repeat-penalty",
            "--repeat-last-n",
            "--seed",
        ],
    ),
    (
        "bench",
        &[
            "--n-prompt",
            "--n-gen",
            "--repetitions",
            "--threads",
            "--depth",
            "--batch-size",
            "--lookup",
            "--draft-max",
            "--draft-min",
            "--draft-p-min",
        ],
    ),
    (
        "serve",
        &[
            "--ctx",
            "--threads",
            "--temp",
            "--top-k",
            "--top-p",
            "--min-p",
            "--repeat-penalty",
            "--repeat-last-n",
            "--seed",
            "--port",
            "--parallel",
            "--queue",
            "--cache-mb",
            "--max-body-kb",
            "--max-connections",
            "--timeout",
            "--max-tokens",
            "--batch-size",
            "--lookup",
            "--draft-max",
            "--draft-min",
            "--draft-p-min",
        ],
    ),
    ("embed", &["--threads", "--truncate", "--batch-tokens"]),
];

/// Flags, of any subcommand, whose value is not a number (a path, a text, a name).
const NOT_NUMERIC: &[&str] = &[
    "--cache-type",
    "--prompt",
    "--file",
    "--draft",
    "--system",
    "--template-var",
    "--host",
    "--api-key",
    "--api-key-file",
    "--cors-origin",
    "--cache-reuse",
    "--text",
    "--pooling",
    "--prompt-name",
    "--prefix",
    "--format",
    "--output",
];

fn kiln_run(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_kiln-run"))
        .args(args)
        .output()
        .unwrap()
}

/// The long flags taking a value that `kiln-run SUB --help` lists (`--ctx <CTX>`).
fn value_flags(sub: &str) -> Vec<String> {
    let o = kiln_run(&[sub, "--help"]);
    assert!(o.status.success(), "{sub} --help");
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .filter_map(|l| {
            // An option's line: `  -t, --threads <THREADS>` or `      --ctx <CTX>`.
            let flag = l.split_whitespace().take(2).find(|w| w.starts_with("--"))?;
            let head = l.trim_start().starts_with('-');
            (head && l.contains(&format!("{flag} <"))).then(|| flag.to_string())
        })
        .collect()
}

#[test]
fn every_flag_that_takes_a_value_is_listed_as_numeric_or_not() {
    for (sub, numeric) in NUMERIC {
        let listed = value_flags(sub);
        for flag in &listed {
            assert!(
                numeric.contains(&flag.as_str()) || NOT_NUMERIC.contains(&flag.as_str()),
                "kiln-run {sub} {flag}: add it to NUMERIC (with a range) or NOT_NUMERIC"
            );
        }
        for flag in *numeric {
            assert!(
                listed.iter().any(|l| l == flag),
                "kiln-run {sub} has no {flag}"
            );
        }
    }
}

#[test]
fn a_negative_number_is_refused_by_range_naming_the_flag() {
    for (sub, numeric) in NUMERIC {
        for flag in *numeric {
            let o = kiln_run(&[sub, flag, "-1"]);
            let e = String::from_utf8_lossy(&o.stderr);
            assert_eq!(o.status.code(), Some(2), "{sub} {flag} -1: {e}");
            assert!(
                e.contains(&format!("invalid value '-1' for '{flag} <")),
                "{sub} {flag} -1: {e}"
            );
            assert!(e.contains("must be a"), "{sub} {flag} -1: {e}");
        }
    }
    // The three named in the report, whole.
    for (args, message) in [
        (
            &["generate", "--lookup", "-1"][..],
            "'--lookup <N>': must be a whole number from 0 to 64",
        ),
        (
            &["generate", "--top-p", "-1"],
            "'--top-p <TOP_P>': must be a number above 0 and at most 1",
        ),
        (
            &["serve", "--port", "-1"],
            "'--port <PORT>': must be a whole number from 0 to 65535",
        ),
    ] {
        let o = kiln_run(args);
        let e = String::from_utf8_lossy(&o.stderr);
        assert!(e.contains(message), "{args:?}: {e}");
    }
}
