//! The words of every user-facing message, checked for the slips that have reached users: a
//! doubled word ("a importance file file"), "a" before a vowel ("a importance"), "a" before a
//! plural ("for a texts"), and a line break left inside a string where a `\` continuation was
//! meant (the message then holds the source's indentation).
//!
//! The text checked is every string literal and every doc comment (clap's help texts) in the
//! workspace crates' `src/`, plus the messages that name an input by a phrase the caller
//! passes (`NotAFile`, `InputTooLarge`, `NotUtf8`), rendered with every such phrase the code
//! passes. [`slips`] is tested on planted slips, so the checks can fail.

use std::path::{Path, PathBuf};

use kiln_format::FormatError;

/// The crates whose sources are scanned.
const CRATES: [&str; 6] = [
    "format",
    "kernels",
    "converter",
    "quantizer",
    "runner",
    "verify",
];

/// Words after "a" that start with a vowel letter but a consonant sound ("a unit", "a u32").
const CONSONANT_SOUND: [&str; 12] = [
    "one", "once", "uni", "use", "usa", "usu", "uti", "uint", "ui", "utf", "uri", "url",
];

/// Plurals seen after "a" where a singular was meant ("for a texts").
const PLURALS: [&str; 12] = [
    "texts", "files", "tokens", "tensors", "values", "bytes", "layers", "rows", "columns",
    "chunks", "weights", "threads",
];

/// Functions whose argument names an input for the messages above: the last string literal of
/// each call is that phrase.
const NAMING_CALLS: [&str; 6] = [
    "open_regular(",
    "read_bounded(",
    "read_text_bounded(",
    "read_text_as(",
    "read_json_as(",
    "tokenize_file(",
];

/// What is wrong with `text`, one line per slip.
fn slips(text: &str) -> Vec<String> {
    let mut found = Vec::new();
    // Prose broken by the source's line break: a word, the break, deep indentation, a word or
    // a flag (JSON and tables in strings break after punctuation, or indent less).
    for (at, _) in text.match_indices('\n') {
        let before = text[..at].chars().next_back();
        let after = &text[at + 1..];
        let next = after.trim_start_matches(' ');
        if before.is_some_and(|c| c.is_alphanumeric())
            && after.len() - next.len() >= 8
            && next.starts_with(|c: char| c.is_alphabetic() || c == '-')
        {
            found.push("a line break and indentation inside the string (a missing `\\`)".into());
        }
    }
    let words = words(text);
    for pair in words.windows(2) {
        let ((a, a_end), (b, b_start)) = ((pair[0].0, pair[0].2), (pair[1].0, pair[1].1));
        let single_space = &text[a_end..b_start] == " ";
        let glued = |i: usize| text[i..].starts_with(['.', '-', '_', '/']);
        let after_b = b_start + b.len();
        let has_letter = a.bytes().any(|c| c.is_ascii_alphabetic());
        if single_space && a == b && has_letter && !glued(after_b) && !matches!(a, "that" | "had") {
            found.push(format!("doubled word `{a} {b}`"));
        }
        if single_space && a == "a" {
            let lower = b.to_ascii_lowercase();
            let vowel = lower.starts_with(['a', 'e', 'i', 'o', 'u']);
            let consonant_sound = CONSONANT_SOUND.iter().any(|p| lower.starts_with(p))
                || lower.starts_with('u') && lower[1..].starts_with(|c: char| c.is_ascii_digit());
            if vowel && !consonant_sound && !glued(after_b) {
                found.push(format!("`a {b}`: \"an\" before a vowel"));
            }
            if PLURALS.contains(&lower.as_str()) {
                found.push(format!("`a {b}`: \"a\" before a plural"));
            }
        }
        if single_space && a == "the" && matches!(b, "a" | "an" | "the") {
            found.push(format!("`the {b}`: two articles"));
        }
    }
    found
}

/// The words of `text` (runs of ASCII letters, digits and `_`, outside `{…}` placeholders and
/// `\x` escapes): (word, start, end).
fn words(text: &str) -> Vec<(&str, usize, usize)> {
    let bytes = text.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'{' => i = text[i..].find('}').map_or(bytes.len(), |e| i + e + 1),
            b'\\' => i += 2,
            b if b.is_ascii_alphanumeric() || b == b'_' => {
                let start = i;
                while i < bytes.len() && (bytes[i].is_ascii_alphanumeric() || bytes[i] == b'_') {
                    i += 1;
                }
                let glued_before = start > 0 && matches!(bytes[start - 1], b'.' | b'-' | b'`');
                if !glued_before {
                    out.push((&text[start..i], start, i));
                }
            }
            _ => i += 1,
        }
    }
    out
}

/// A piece of text of a source file: a string literal's contents (a `\` line continuation
/// removed, as the compiler removes it) or a doc comment's line, with its line number.
struct Text {
    line: usize,
    text: String,
}

/// The string literals and doc comments of the Rust source `src`.
fn texts(src: &str) -> Vec<Text> {
    let s: Vec<char> = src.chars().collect();
    let lines: Vec<usize> = s
        .iter()
        .scan(1, |line, &c| {
            let at = *line;
            *line += usize::from(c == '\n');
            Some(at)
        })
        .collect();
    let line_at = |i: usize| lines.get(i).copied().unwrap_or(0);
    let mut out = Vec::new();
    let mut i = 0;
    while i < s.len() {
        let rest = |k: usize| s.get(i + k).copied();
        match s[i] {
            '/' if rest(1) == Some('/') => {
                let end = (i..s.len()).find(|&k| s[k] == '\n').unwrap_or(s.len());
                let comment: String = s[i..end].iter().collect();
                if let Some(doc) = comment.strip_prefix("///").or(comment.strip_prefix("//!")) {
                    out.push(Text {
                        line: line_at(i),
                        text: doc.to_string(),
                    });
                }
                i = end;
            }
            '/' if rest(1) == Some('*') => {
                i = (i + 2..s.len().saturating_sub(1))
                    .find(|&k| s[k] == '*' && s[k + 1] == '/')
                    .map_or(s.len(), |k| k + 2);
            }
            'r' if raw_string_start(&s, i) => {
                let hashes = (i + 1..s.len()).take_while(|&k| s[k] == '#').count();
                if s.get(i + 1 + hashes) != Some(&'"') {
                    i += 1;
                    continue;
                }
                let start = i + 2 + hashes;
                let close: String = std::iter::once('"')
                    .chain(std::iter::repeat_n('#', hashes))
                    .collect();
                let body: String = s[start..].iter().collect();
                let len = body.find(&close).unwrap_or(body.len());
                out.push(Text {
                    line: line_at(i),
                    text: body[..len].to_string(),
                });
                i = start + body[..len].chars().count() + close.len();
            }
            '"' => {
                let (text, end) = string_body(&s, i + 1);
                out.push(Text {
                    line: line_at(i),
                    text,
                });
                i = end + 1;
            }
            '\'' if rest(1) == Some('\\') => {
                i = (i + 3..s.len())
                    .find(|&k| s[k] == '\'')
                    .map_or(s.len(), |k| k + 1);
            }
            '\'' if rest(2) == Some('\'') => i += 3,
            _ => i += 1,
        }
    }
    out
}

/// Whether the `r` at `i` starts a raw string (`r"`, `r#"`, `br"`), not an identifier.
fn raw_string_start(s: &[char], i: usize) -> bool {
    let ident_before = |k: usize| k > 0 && (s[k - 1].is_alphanumeric() || s[k - 1] == '_');
    let prefix_ok = !ident_before(i) || (s[i - 1] == 'b' && !ident_before(i - 1));
    prefix_ok && matches!(s.get(i + 1), Some('"' | '#'))
}

/// A normal string literal's contents from `start` (after the quote), escapes kept as written
/// and line continuations removed; and the index of the closing quote.
fn string_body(s: &[char], start: usize) -> (String, usize) {
    let mut text = String::new();
    let mut k = start;
    while k < s.len() && s[k] != '"' {
        if s[k] == '\\' && s.get(k + 1) == Some(&'\n') {
            k += 2;
            while k < s.len() && s[k].is_whitespace() {
                k += 1;
            }
            continue;
        }
        if s[k] == '\\' {
            text.extend(&s[k..(k + 2).min(s.len())]);
            k += 2;
            continue;
        }
        text.push(s[k]);
        k += 1;
    }
    (text, k)
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// Every source file of the scanned crates, with its path from the workspace root.
fn sources() -> Vec<(String, String)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut files = Vec::new();
    for c in CRATES {
        rust_files(&root.join(c).join("src"), &mut files);
    }
    assert!(files.len() > 100, "{} source files", files.len());
    files
        .into_iter()
        .map(|p| {
            let name = p.strip_prefix(&root).unwrap().display().to_string();
            (name, std::fs::read_to_string(&p).unwrap())
        })
        .collect()
}

#[test]
fn no_message_or_help_text_has_a_doubled_word_or_a_wrong_article() {
    let mut found = Vec::new();
    for (name, src) in sources() {
        for t in texts(&src) {
            for slip in slips(&t.text) {
                found.push(format!("{name}:{}: {slip}: {:?}", t.line, t.text));
            }
        }
    }
    assert!(found.is_empty(), "{}", found.join("\n"));
}

/// The phrases callers pass to name an input, read after "the" in [`FormatError::NotAFile`],
/// [`FormatError::InputTooLarge`] and [`FormatError::NotUtf8`]: each rendered message is
/// checked. Regression: "give the path of a importance file file", "for a texts".
#[test]
fn messages_naming_an_input_read_well_with_every_phrase_passed() {
    let mut phrases = Vec::new();
    for (name, src) in sources() {
        for call in NAMING_CALLS {
            for (at, _) in src.match_indices(call) {
                if src[..at].ends_with("fn ") {
                    continue;
                }
                let args = &src[at..];
                let args = &args[..args.find(';').unwrap_or(args.len())];
                if let Some(last) = texts(args).into_iter().last() {
                    phrases.push((name.clone(), last.text));
                }
            }
        }
    }
    assert!(phrases.len() >= 10, "{phrases:?}");
    let mut found = Vec::new();
    for (name, phrase) in phrases {
        let what: &'static str = phrase.clone().leak();
        let file = "f".to_string();
        for e in [
            FormatError::NotAFile {
                file: file.clone(),
                what: "a socket",
                expected: what,
            },
            FormatError::InputTooLarge {
                file: file.clone(),
                what,
                size: 2,
                limit: 1,
            },
            FormatError::NotUtf8 {
                file,
                what,
                offset: 0,
            },
        ] {
            let text = e.to_string();
            for slip in slips(&text) {
                found.push(format!("{name}: {phrase:?}: {slip}: {text}"));
            }
        }
    }
    assert!(found.is_empty(), "{}", found.join("\n"));
}

/// Each check finds the slip it is for, and lets the text around it be.
#[test]
fn the_checks_find_planted_slips() {
    for (text, slip) in [
        (
            "give the path of a importance file file",
            "doubled word `file file`",
        ),
        ("give the path of a importance file", "`a importance`"),
        ("bytes is over the limit for a texts", "`a texts`"),
        ("give the path of the a Dense module's config", "`the a`"),
        (
            "give the size: --bpw B or\n                          --max-bytes N",
            "a line break",
        ),
    ] {
        let found = slips(text);
        assert!(
            found.iter().any(|f| f.contains(slip)),
            "{text:?}: {found:?}"
        );
    }
    for fine in [
        "a u32 power of two, a unit, a one-thread pool, a usable file, an index",
        "--kl-base base.logits, tokenizer.json {}, the {what} file",
        "Examples:\n  kiln-verify layers m.kiln\n  kiln-verify integrity m.kiln",
        "a {} generator; the file that that names; 1 000 000; viewBox 0 0",
        "[\n        {\"idx\": 0},\n        {\"idx\": 1}\n    ]",
    ] {
        assert_eq!(slips(fine), Vec::<String>::new(), "{fine:?}");
    }
    let src = "let a = 'x'; let b = '\"'; /* \"no\" */ // \"no\"\n/// a doc\n\
               f(r#\"raw \"q\"\"#, \"one \\\n    two\")";
    let t: Vec<String> = texts(src).into_iter().map(|t| t.text).collect();
    assert_eq!(t, [" a doc", "raw \"q\"", "one two"]);
}
