//! Inputs that once cost `kiln-run` gigabytes or minutes, each run through the real binary
//! under an address-space limit far below what the old code needed, with a deadline:
//!
//! - `embed -f` on one 40 MB line tokenized it whole to keep 64 tokens (8.1 GB, 112 s); it
//!   is now cut first, and keeps the tokens the whole line gives.
//! - `embed -f` on a million empty lines held every text and vector (0.7 GB, 18 s); lines are
//!   now read, embedded and written a batch at a time, empty ones sharing one vector, in the
//!   same memory as ten thousand lines. A bad line or an interrupt still leaves no output.
//! - `generate`/`serve --ctx 16777216` and `bench --depth` built 1 GB of RoPE tables before
//!   the KV cache's mapping was refused (or aborted under a memory limit); the context's cost
//!   is now weighed first and refused in milliseconds, naming the flag and both byte counts.

/// The runner's test helpers (fixtures, reference dumps, metrics), shared rather than copied.
#[path = "../../runner/tests/common/mod.rs"]
mod common;

use std::ffi::OsStr;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::{convert, root};

/// Address space each run may use: the tiny models need tens of megabytes, while the old code
/// aborted under this limit on the 40 MB line and on a million empty lines.
const MEMORY_LIMIT_KIB: u64 = 512 << 10;

/// Longest any run may take: each takes a second or two; the old code took minutes.
const DEADLINE: Duration = Duration::from_secs(60);

/// Longest a refused context may take: the check takes milliseconds; building the refused
/// context's tables took 7-25 s.
const REFUSAL_DEADLINE: Duration = Duration::from_secs(5);

/// The tiny decoder-based embedder (Qwen3-Embedding's layout: inputs of at most 64 tokens,
/// 64-wide vectors), converted into `dir`.
fn embedder(dir: &Path) -> PathBuf {
    convert(
        &root().join("fixtures/embedding/qwen3-embedding-f32"),
        dir,
        None,
    )
}

/// Start `kiln-run args` under [`MEMORY_LIMIT_KIB`], stdin a pipe.
fn start(args: &[&OsStr]) -> Child {
    Command::new("sh")
        .arg("-c")
        .arg(format!(
            "ulimit -v {MEMORY_LIMIT_KIB} && exec \"$0\" \"$@\""
        ))
        .arg(env!("CARGO_BIN_EXE_kiln-run"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start kiln-run")
}

/// Wait for `child` (its pipes read as it runs), killing it and failing past `deadline`.
fn finish(child: Child, deadline: Duration) -> (Output, Duration) {
    let (t0, pid) = (Instant::now(), child.id());
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || tx.send(child.wait_with_output()));
    match rx.recv_timeout(deadline) {
        Ok(out) => (out.unwrap(), t0.elapsed()),
        Err(_) => {
            let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
            panic!("kiln-run did not finish in {deadline:?}");
        }
    }
}

/// `kiln-run args` under the memory limit with no input on stdin: its output and time.
fn run(args: &[&OsStr], deadline: Duration) -> (Output, Duration) {
    let mut child = start(args);
    drop(child.stdin.take());
    finish(child, deadline)
}

fn os(s: &str) -> &OsStr {
    OsStr::new(s)
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// The JSON lines of a run.
fn rows(o: &Output) -> Vec<serde_json::Value> {
    String::from_utf8(o.stdout.clone())
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// Names in `dir` other than `keep`: what a run left behind.
fn left_in(dir: &Path, keep: &[&Path]) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| !keep.contains(&p.as_path()))
        .map(|p| p.display().to_string())
        .collect()
}

/// Regression: one 40 MB line without a newline was tokenized whole only to keep its first
/// 64 tokens (8.1 GB, 112 s; under this limit it aborted). Its prefix is tokenized now, and
/// the vector is the one a short text with the same first tokens gets.
#[test]
fn a_40_mb_line_is_cut_before_it_is_tokenized() {
    let tmp = tempfile::tempdir().unwrap();
    let model = embedder(tmp.path());
    let sentence = "The quick brown fox jumps over the lazy dog. ";
    let big = tmp.path().join("big.txt");
    let line = sentence.repeat((40 << 20) / sentence.len());
    std::fs::write(&big, &line).unwrap();
    let m = model.as_os_str();
    let args = [os("embed"), m, os("-t"), os("1"), os("-f"), big.as_os_str()];
    let (o, took) = run(&args, DEADLINE);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    // A short text (tokenized whole) with the same 64 first tokens.
    let short = sentence.repeat(20);
    let (s, _) = run(
        &[os("embed"), m, os("-t"), os("1"), os("-p"), os(&short)],
        DEADLINE,
    );
    assert_eq!(s.status.code(), Some(0), "{}", stderr(&s));
    let (got, want) = (rows(&o), rows(&s));
    assert_eq!(got.len(), 1);
    assert_eq!(got[0]["index"], 0);
    assert_eq!(got[0]["tokens"], 64);
    assert_eq!(got[0]["truncated"], true);
    assert_eq!(
        got[0], want[0],
        "the cut line's vector differs from its first tokens'"
    );
    assert!(took < Duration::from_secs(20), "took {took:?}");
}

/// `lines` empty lines between a first and a last text, embedded to `.npy` under the limit:
/// the file, and the time taken.
fn embed_lines(dir: &Path, model: &Path, lines: usize) -> (PathBuf, Duration) {
    let input = dir.join(format!("{lines}.txt"));
    let mut text = String::from("first text\n");
    text.push_str(&"\n".repeat(lines));
    text.push_str("last text\n");
    std::fs::write(&input, text).unwrap();
    let out = dir.join(format!("{lines}.npy"));
    let (o, took) = run(
        &[
            os("embed"),
            model.as_os_str(),
            os("-t"),
            os("1"),
            os("-f"),
            input.as_os_str(),
            os("--format"),
            os("npy"),
            os("-o"),
            out.as_os_str(),
        ],
        DEADLINE,
    );
    assert_eq!(o.status.code(), Some(0), "{lines} lines: {}", stderr(&o));
    let summary = format!("{} texts", lines + 2);
    assert!(stderr(&o).contains(&summary), "{}", stderr(&o));
    std::fs::remove_file(&input).unwrap();
    (out, took)
}

/// Row `i` of a `.npy` of `width` float32 columns whose header is `header` bytes.
fn npy_row(file: &mut std::fs::File, header: usize, width: usize, i: usize) -> Vec<u8> {
    use std::io::{Seek, SeekFrom};
    let mut row = vec![0u8; width * 4];
    file.seek(SeekFrom::Start((header + i * row.len()) as u64))
        .unwrap();
    file.read_exact(&mut row).unwrap();
    row
}

/// Regression: a million empty lines took 18 s and 0.7 GB (every text, its tokens and its
/// vector held to the end; under this limit it aborted). They stream now: 10^4 and 10^6
/// lines run under one limit far below the old need, each line a row in order (row i the
/// text of index i, line i + 1), every empty line the one vector the empty text gets.
#[test]
fn a_million_empty_lines_stream_in_flat_memory() {
    let tmp = tempfile::tempdir().unwrap();
    let model = embedder(tmp.path());
    for lines in [10_000, 1_000_000] {
        let (path, took) = embed_lines(tmp.path(), &model, lines);
        let mut file = std::fs::File::open(&path).unwrap();
        let mut start = [0u8; 10];
        file.read_exact(&mut start).unwrap();
        let header = u16::from_le_bytes([start[8], start[9]]) as usize + 10;
        let mut dict = vec![0u8; header - 10];
        file.read_exact(&mut dict).unwrap();
        let dict = String::from_utf8(dict).unwrap();
        let rows = lines + 2;
        assert!(dict.contains(&format!("'shape': ({rows}, 64)")), "{dict}");
        let size = file.metadata().unwrap().len() as usize;
        assert_eq!(size, header + rows * 64 * 4);
        let mut at = |i| npy_row(&mut file, header, 64, i);
        let (first, empty, last) = (at(0), at(1), at(rows - 1));
        assert_ne!(first, empty, "the first text is not the empty one");
        assert_eq!(
            at(lines),
            empty,
            "every empty line has the empty text's vector"
        );
        assert_ne!(last, empty, "the last line is its own text");
        drop(file);
        std::fs::remove_file(&path).unwrap();
        assert!(
            took < Duration::from_secs(30),
            "{lines} lines took {took:?}"
        );
    }
    assert_eq!(left_in(tmp.path(), &[&model]), Vec::<String>::new());
}

/// A line that is not UTF-8 after thousands of good ones stops the run naming the line, and
/// the vectors already written go with the temporary file: no output, whole or partial.
#[test]
fn a_bad_line_stops_the_run_and_leaves_no_output() {
    let tmp = tempfile::tempdir().unwrap();
    let model = embedder(tmp.path());
    let input = tmp.path().join("texts.txt");
    let mut text = "a few words\n".repeat(5000).into_bytes();
    text.extend_from_slice(b"bad \xff byte\nfine\n");
    std::fs::write(&input, text).unwrap();
    let out = tmp.path().join("out.jsonl");
    let (o, _) = run(
        &[
            os("embed"),
            model.as_os_str(),
            os("-t"),
            os("1"),
            os("-f"),
            input.as_os_str(),
            os("-o"),
            out.as_os_str(),
        ],
        DEADLINE,
    );
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("line 5001 of") && err.contains("texts.txt"),
        "{err}"
    );
    assert!(err.contains("not valid UTF-8"), "{err}");
    assert_eq!(left_in(tmp.path(), &[&model, &input]), Vec::<String>::new());
}

/// SIGINT while `embed` streams standard input to `-o`: exit 130, and neither the output nor
/// its temporary file is left.
#[test]
fn an_interrupt_leaves_no_partial_output() {
    let tmp = tempfile::tempdir().unwrap();
    let model = embedder(tmp.path());
    let out = tmp.path().join("out.npy");
    let mut child = start(&[
        os("embed"),
        model.as_os_str(),
        os("-t"),
        os("1"),
        os("--format"),
        os("npy"),
        os("-o"),
        out.as_os_str(),
    ]);
    let mut stdin = child.stdin.take().unwrap();
    stdin
        .write_all(&"some text\n".repeat(1000).into_bytes())
        .unwrap();
    stdin.flush().unwrap();
    // Wait for the temporary output: the model is loaded and vectors are being written.
    let t0 = Instant::now();
    while left_in(tmp.path(), &[&model]).is_empty() {
        assert!(t0.elapsed() < DEADLINE, "no temporary output appeared");
        std::thread::sleep(Duration::from_millis(20));
    }
    let sent = Command::new("kill")
        .args(["-s", "INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(sent.success());
    drop(stdin);
    let mut err = String::new();
    let mut pipe = child.stderr.take().unwrap();
    let (o, _) = finish(child, Duration::from_secs(10));
    pipe.read_to_string(&mut err).unwrap();
    assert_eq!(o.status.code(), Some(130), "{err}");
    assert!(err.contains("interrupted by SIGINT"), "{err}");
    assert_eq!(left_in(tmp.path(), &[&model]), Vec::<String>::new());
}

/// The tiny Llama with `max_position_embeddings` of 2^24, so that `--ctx 16777216` is within
/// its trained context.
fn long_context_tiny(dir: &Path) -> PathBuf {
    let copy = dir.join("long-context");
    std::fs::create_dir_all(&copy).unwrap();
    let src = root().join("fixtures/tiny/llama-tied-f32");
    for e in std::fs::read_dir(&src).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), copy.join(e.file_name())).unwrap();
    }
    let config = copy.join("config.json");
    let mut v: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&config).unwrap()).unwrap();
    v["max_position_embeddings"] = (1u64 << 24).into();
    std::fs::write(&config, serde_json::to_vec(&v).unwrap()).unwrap();
    convert(&copy, dir, None)
}

/// Regression: a context of 2^24 positions (5 GiB: 4 GiB of f16 KV cache, 1 GiB of RoPE
/// tables) built its tables first, 7-25 s and 1 GB, and aborted under a memory limit. Its cost
/// is now checked before anything is built: `generate`, `chat` and `serve --ctx` and
/// `bench --depth` are refused at once, naming the flag, the bytes needed and available.
#[test]
fn a_context_beyond_memory_is_refused_before_it_is_built() {
    let tmp = tempfile::tempdir().unwrap();
    let model = long_context_tiny(tmp.path());
    let m = model.to_str().unwrap();
    let cases: [(&[&str], &str, &str); 4] = [
        (
            &["generate", m, "-p", "hi", "-n", "1", "--ctx", "16777216"],
            "--ctx",
            "16777216",
        ),
        (&["chat", m, "--ctx", "16777216"], "--ctx", "16777216"),
        (
            &["serve", m, "--ctx", "16777216", "--port", "0"],
            "--ctx",
            "16777216",
        ),
        (
            &["bench", m, "--depth", "16777000", "-p", "16", "-n", "4"],
            "--depth",
            "16777016",
        ),
    ];
    for (args, flag, ctx) in cases {
        let args: Vec<&OsStr> = args.iter().map(|a| os(a)).collect();
        let (o, took) = run(&args, DEADLINE);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        for needle in [
            format!("invalid value for {flag}"),
            format!("a context of {ctx} tokens needs"),
            "bytes are available".into(),
            "ulimit -v".into(),
        ] {
            assert!(err.contains(&needle), "{args:?}: no {needle:?} in {err}");
        }
        assert!(took < REFUSAL_DEADLINE, "{args:?} took {took:?}");
    }
}
