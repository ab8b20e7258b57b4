//! The module map a crate's `lib.rs` writes in its `//!` overview, checked against the code:
//! every module is in a layer, no module imports from a layer above its own or through the
//! crate root, and (where the crate's map says so) the imports between modules form no
//! circle.
//!
//! Shared by `kernels/tests/layers.rs` and `quantizer/tests/layers.rs` (through `#[path]`).
//!
//! - The map is the numbered list after the `//!` line containing [`MAP_HEADING`], up to the
//!   first empty `//!` line after it: item `N.` is layer `N`. Every module the item names in
//!   backticks (not a `[link]`) is in that layer, and so are its submodules unless the map
//!   names them too (`simd::x86::{avx2, …}` names `simd::x86`).
//! - A module's imports are the `crate::…`, `$crate::…` and `super::…` paths of its code, use
//!   trees expanded, with comments, strings and `#[cfg(test)] mod … { … }` blocks left out (a
//!   file whose first attribute is `#![cfg(test)]` has none): unit tests reach every layer.
//!   A path names the longest module it starts with; one that starts with no module names an
//!   item of the crate root, which re-exports every layer.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// The phrase on the line that opens the map.
pub const MAP_HEADING: &str = "Module map";

/// One module's source: its path from the crate root (`""` for `lib.rs`) and its text.
#[derive(Debug, Clone)]
pub struct Source {
    pub module: String,
    pub text: String,
}

/// Every module of the library whose sources are under `src` (`main.rs`, the binary, left
/// out), sorted by module path.
pub fn read_crate(src: &Path) -> Vec<Source> {
    let mut out = Vec::new();
    read_dir(src, src, &mut out);
    out.sort_by(|a, b| a.module.cmp(&b.module));
    out
}

fn read_dir(root: &Path, dir: &Path, out: &mut Vec<Source>) {
    for entry in std::fs::read_dir(dir).expect("a source directory") {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            read_dir(root, &path, out);
            continue;
        }
        if path.extension().is_none_or(|e| e != "rs") {
            continue;
        }
        let rel = path.strip_prefix(root).expect("under the root");
        let mut parts: Vec<String> = rel
            .with_extension("")
            .iter()
            .map(|p| p.to_string_lossy().into_owned())
            .collect();
        if parts == ["main"] {
            continue;
        }
        if matches!(parts.last().map(String::as_str), Some("mod" | "lib")) {
            parts.pop();
        }
        let text = std::fs::read_to_string(&path).expect("a readable source file");
        out.push(Source {
            module: parts.join("::"),
            text,
        });
    }
}

/// Everything wrong with the crate's map, one line each; empty when the map is true. With
/// `acyclic`, every import circle is wrong too (a circle across layers is already an import
/// from above; this finds those within a layer).
pub fn check(sources: &[Source], acyclic: bool) -> Vec<String> {
    let modules: BTreeSet<String> = sources.iter().map(|s| s.module.clone()).collect();
    let root = sources
        .iter()
        .find(|s| s.module.is_empty())
        .expect("the crate root, lib.rs");
    let (named, mut problems) = read_map(&root.text, &modules);
    if named.is_empty() {
        problems.push(format!("no module map: no `//!` line with {MAP_HEADING:?}"));
        return problems;
    }
    let layer = |m: &str| -> Option<usize> {
        let mut path: Vec<&str> = m.split("::").collect();
        while !path.is_empty() {
            if let Some(&l) = named.get(&path.join("::")) {
                return Some(l);
            }
            path.pop();
        }
        None
    };
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for s in sources.iter().filter(|s| !s.module.is_empty()) {
        let Some(own) = layer(&s.module) else {
            problems.push(format!("module `{}` is in no layer of the map", s.module));
            continue;
        };
        for path in imports(&s.module, &s.text) {
            let shown = format!("crate::{}", path.join("::"));
            let Some(target) = module_of(&path, &modules) else {
                problems.push(format!(
                    "`{}` imports `{shown}` through the crate root; name the module it is in",
                    s.module
                ));
                continue;
            };
            if target == s.module {
                continue;
            }
            // A target in no layer is reported as such above.
            if let Some(theirs) = layer(&target).filter(|&l| l > own) {
                problems.push(format!(
                    "`{}` (layer {own}) imports `{shown}` from `{target}` (layer {theirs})",
                    s.module
                ));
            }
            edges.entry(s.module.clone()).or_default().insert(target);
        }
    }
    if acyclic {
        problems.extend(circles(&edges));
    }
    // A path imported twice (a use and an expression) is one problem.
    problems.dedup();
    problems
}

/// The layer of every module the map names, and what is wrong with the map itself.
fn read_map(root: &str, modules: &BTreeSet<String>) -> (BTreeMap<String, usize>, Vec<String>) {
    let doc: Vec<&str> = root
        .lines()
        .map_while(|l| l.trim_start().strip_prefix("//!"))
        .collect();
    let mut items: Vec<(usize, String)> = Vec::new();
    let start = doc.iter().position(|l| l.contains(MAP_HEADING));
    for line in doc.iter().skip(start.map_or(doc.len(), |s| s + 1)) {
        let text = line.trim();
        if text.is_empty() && !items.is_empty() {
            break;
        }
        let number = text
            .split_once(". ")
            .and_then(|(n, _)| n.parse::<usize>().ok());
        match (number, items.last_mut()) {
            (Some(n), _) => items.push((n, text.to_string())),
            (None, Some((_, item))) => {
                item.push(' ');
                item.push_str(text);
            }
            (None, None) => {}
        }
    }
    let mut named = BTreeMap::new();
    let mut problems = Vec::new();
    for (n, item) in &items {
        for name in backticked(item) {
            if !modules.contains(&name) {
                continue;
            }
            if let Some(before) = named.insert(name.clone(), *n) {
                problems.push(format!("the map names `{name}` in layers {before} and {n}"));
            }
        }
    }
    (named, problems)
}

/// The module paths among `text`'s backticked spans that are not links: `a::b`, or the `a`
/// of `a::{b, c}`.
fn backticked(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(open) = rest.find('`') {
        let link = rest[..open].ends_with('[');
        let after = &rest[open + 1..];
        let Some(close) = after.find('`') else { break };
        let span = after[..close].split('{').next().unwrap_or("");
        let span = span.trim_end_matches("::");
        let is_path = !span.is_empty()
            && span
                .split("::")
                .all(|seg| !seg.is_empty() && seg.chars().all(|c| c.is_alphanumeric() || c == '_'));
        if !link && is_path {
            out.push(span.to_string());
        }
        rest = &after[close + 1..];
    }
    out
}

/// The longest module `path` starts with, or `None` for an item of the crate root.
fn module_of(path: &[String], modules: &BTreeSet<String>) -> Option<String> {
    (1..=path.len())
        .rev()
        .map(|n| path[..n].join("::"))
        .find(|m| modules.contains(m))
}

/// Every circle in the import graph, each once, as `a -> b -> … -> a`.
fn circles(edges: &BTreeMap<String, BTreeSet<String>>) -> Vec<String> {
    #[derive(Clone, Copy, PartialEq)]
    enum Mark {
        Open,
        Done,
    }
    fn visit(
        m: &str,
        edges: &BTreeMap<String, BTreeSet<String>>,
        marks: &mut BTreeMap<String, Mark>,
        stack: &mut Vec<String>,
        found: &mut BTreeSet<String>,
    ) {
        marks.insert(m.to_string(), Mark::Open);
        stack.push(m.to_string());
        for next in edges.get(m).into_iter().flatten() {
            match marks.get(next.as_str()) {
                Some(Mark::Open) => {
                    let at = stack.iter().position(|s| s == next).expect("on the stack");
                    let mut circle = stack[at..].to_vec();
                    circle.push(next.clone());
                    found.insert(format!("import circle: {}", circle.join(" -> ")));
                }
                Some(Mark::Done) => {}
                None => visit(next, edges, marks, stack, found),
            }
        }
        stack.pop();
        marks.insert(m.to_string(), Mark::Done);
    }
    let mut marks = BTreeMap::new();
    let mut found = BTreeSet::new();
    for m in edges.keys() {
        if !marks.contains_key(m.as_str()) {
            visit(m, edges, &mut marks, &mut Vec::new(), &mut found);
        }
    }
    found.into_iter().collect()
}

/// The paths module `module` imports from its crate, each from the crate root.
pub fn imports(module: &str, text: &str) -> Vec<Vec<String>> {
    let code = strip(text);
    if code.trim_start().starts_with("#![cfg(test)]") {
        return Vec::new();
    }
    let toks = tokens(&without_test_modules(&code));
    let own: Vec<String> = module
        .split("::")
        .filter(|s| !s.is_empty())
        .map(String::from)
        .collect();
    // Inline modules (`mod grid { … }`) open at a brace depth; `super` is relative to them.
    let mut inline: Vec<(String, usize)> = Vec::new();
    let mut depth = 0;
    let mut out = Vec::new();
    let mut i = 0;
    while i < toks.len() {
        let t = toks[i].as_str();
        let starts_path =
            toks.get(i + 1).is_some_and(|n| n == "::") && (i == 0 || toks[i - 1] != "::");
        match t {
            "crate" if starts_path => {
                i = use_tree(&toks, i + 2, Vec::new(), &mut out);
                continue;
            }
            "super" if starts_path => {
                let mut here = own.clone();
                here.extend(inline.iter().map(|(m, _)| m.clone()));
                i = use_tree(&toks, i, here, &mut out);
                continue;
            }
            "{" => {
                depth += 1;
                if i >= 2 && toks[i - 2] == "mod" {
                    inline.push((toks[i - 1].clone(), depth));
                }
            }
            "}" => {
                if inline.last().is_some_and(|&(_, d)| d == depth) {
                    inline.pop();
                }
                depth -= 1;
            }
            _ => {}
        }
        i += 1;
    }
    out
}

/// Parse the use tree (or expression path) at `toks[i]` below `prefix`, pushing every full
/// path; returns the index after it.
fn use_tree(
    toks: &[String],
    mut i: usize,
    mut path: Vec<String>,
    out: &mut Vec<Vec<String>>,
) -> usize {
    loop {
        match toks.get(i).map(String::as_str) {
            Some("{") => {
                i += 1;
                while toks.get(i).is_some_and(|t| t != "}") {
                    i = use_tree(toks, i, path.clone(), out);
                    if toks.get(i).is_some_and(|t| t == ",") {
                        i += 1;
                    }
                }
                return i + 1;
            }
            Some("*") => {
                out.push(path);
                return i + 1;
            }
            Some(t) if is_ident(t) => {
                match t {
                    "super" => {
                        path.pop();
                    }
                    "self" => {}
                    _ => path.push(t.to_string()),
                }
                i += 1;
                let more = toks.get(i).is_some_and(|t| t == "::")
                    && toks
                        .get(i + 1)
                        .is_some_and(|t| t == "{" || t == "*" || is_ident(t));
                if !more {
                    out.push(path);
                    return i;
                }
                i += 1;
            }
            _ => {
                out.push(path);
                return i;
            }
        }
    }
}

fn is_ident(t: &str) -> bool {
    t.chars()
        .next()
        .is_some_and(|c| c.is_alphabetic() || c == '_')
}

/// Identifiers, `::`, and every other character as its own token.
fn tokens(code: &str) -> Vec<String> {
    let chars: Vec<char> = code.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c.is_alphanumeric() || c == '_' {
            let start = i;
            while i < chars.len() && (chars[i].is_alphanumeric() || chars[i] == '_') {
                i += 1;
            }
            out.push(chars[start..i].iter().collect());
        } else if c == ':' && chars.get(i + 1) == Some(&':') {
            out.push("::".to_string());
            i += 2;
        } else {
            if !c.is_whitespace() {
                out.push(c.to_string());
            }
            i += 1;
        }
    }
    out
}

/// `code` without its `#[cfg(test)]` inline modules (attributes between, and a visibility,
/// allowed).
fn without_test_modules(code: &str) -> String {
    let mut out = String::with_capacity(code.len());
    let mut rest = code;
    while let Some(at) = rest.find("#[cfg(test)]") {
        out.push_str(&rest[..at]);
        let after = &rest[at + "#[cfg(test)]".len()..];
        match test_module_len(after) {
            Some(len) => rest = &after[len..],
            None => {
                out.push_str("#[cfg(test)]");
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out
}

/// The length of the `mod NAME { … }` item at the start of `s`, if there is one there.
fn test_module_len(s: &str) -> Option<usize> {
    let mut i = 0;
    let skip_ws = |i: &mut usize| {
        while s[*i..].starts_with(char::is_whitespace) {
            *i += s[*i..].chars().next().map_or(1, char::len_utf8);
        }
    };
    skip_ws(&mut i);
    while s[i..].starts_with("#[") {
        i += s[i..].find(']')? + 1;
        skip_ws(&mut i);
    }
    if s[i..].starts_with("pub") {
        i += 3;
        if s[i..].starts_with('(') {
            i += s[i..].find(')')? + 1;
        }
        skip_ws(&mut i);
    }
    i += s[i..].strip_prefix("mod ").map(|_| 4)?;
    let open = i + s[i..].find(['{', ';'])?;
    if !s[open..].starts_with('{') {
        return None;
    }
    let mut depth = 0;
    for (j, c) in s[open..].char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(open + j + 1);
                }
            }
            _ => {}
        }
    }
    None
}

/// `src` with comments, string literals and character literals blanked out (lifetimes kept).
fn strip(src: &str) -> String {
    let c: Vec<char> = src.chars().collect();
    let at = |i: usize| c.get(i).copied();
    let mut out = String::with_capacity(src.len());
    let mut i = 0;
    while i < c.len() {
        let prev_ident = i > 0 && (c[i - 1].is_alphanumeric() || c[i - 1] == '_');
        match (c[i], at(i + 1)) {
            ('/', Some('/')) => {
                while i < c.len() && c[i] != '\n' {
                    i += 1;
                }
            }
            ('/', Some('*')) => {
                let mut depth = 0;
                while i < c.len() {
                    if c[i] == '/' && at(i + 1) == Some('*') {
                        depth += 1;
                        i += 2;
                    } else if c[i] == '*' && at(i + 1) == Some('/') {
                        depth -= 1;
                        i += 2;
                        if depth == 0 {
                            break;
                        }
                    } else {
                        i += 1;
                    }
                }
                out.push(' ');
            }
            ('r', Some('"' | '#')) if !prev_ident => {
                let mut j = i + 1;
                let mut hashes = 0;
                while at(j) == Some('#') {
                    hashes += 1;
                    j += 1;
                }
                if at(j) != Some('"') {
                    out.push('r');
                    i += 1;
                    continue;
                }
                j += 1;
                while j < c.len() && !(c[j] == '"' && (1..=hashes).all(|h| at(j + h) == Some('#')))
                {
                    j += 1;
                }
                i = j + 1 + hashes;
                out.push_str("\"\"");
            }
            ('"', _) => {
                i += 1;
                while i < c.len() && c[i] != '"' {
                    i += if c[i] == '\\' { 2 } else { 1 };
                }
                i += 1;
                out.push_str("\"\"");
            }
            ('\'', Some('\\')) => {
                let mut j = i + 3;
                while j < c.len() && c[j] != '\'' {
                    j += 1;
                }
                i = j + 1;
                out.push_str("' '");
            }
            ('\'', Some(_)) if at(i + 2) == Some('\'') => {
                i += 3;
                out.push_str("' '");
            }
            (ch, _) => {
                out.push(ch);
                i += 1;
            }
        }
    }
    out
}

/// Append `line` to module `module`'s source (for tests that plant a bad import).
pub fn plant(sources: &mut [Source], module: &str, line: &str) {
    let s = sources
        .iter_mut()
        .find(|s| s.module == module)
        .unwrap_or_else(|| panic!("no module `{module}`"));
    s.text.push('\n');
    s.text.push_str(line);
    s.text.push('\n');
}
