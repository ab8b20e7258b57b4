//! The module map in `src/lib.rs` is true: every module is in a layer, and none imports from
//! a layer above its own or through the crate root (the checks are `support/modmap.rs`,
//! shared with the quantizer). The planted imports show each check can fail.

#[path = "support/modmap.rs"]
mod modmap;

use std::path::Path;

fn sources() -> Vec<modmap::Source> {
    modmap::read_crate(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"))
}

#[test]
fn the_module_map_is_true() {
    let problems = modmap::check(&sources(), false);
    assert!(
        problems.is_empty(),
        "src/lib.rs's module map is not what the code does:\n{}",
        problems.join("\n")
    );
}

/// Each kind of bad import, planted in a copy of the sources, is named.
#[test]
fn planted_bad_imports_are_caught() {
    let cases = [
        // A leaf calling the dispatch (the lanes layouts once called a SIMD tier).
        (
            "lanes",
            "use crate::dispatch::active;",
            "`lanes` (layer 2) imports `crate::dispatch::active`",
        ),
        // An expression path, and one inside a use tree.
        (
            "interleaved",
            "fn f() { crate::table::Kernels::isa; }",
            "imports `crate::table::Kernels::isa`",
        ),
        (
            "stats",
            "use crate::{error::KernelError, plan::Path};",
            "imports `crate::plan::Path`",
        ),
        // Through a parent, from a nested module.
        (
            "simd::x86::iq4",
            "use super::avx2::table;",
            "imports `crate::simd::x86::avx2::table`",
        ),
        ("tile", "use crate::TILE_ROWS;", "through the crate root"),
    ];
    for (module, line, expected) in cases {
        let mut s = sources();
        modmap::plant(&mut s, module, line);
        let problems = modmap::check(&s, false);
        assert!(
            problems.iter().any(|p| p.contains(expected)),
            "{line} in {module}: {problems:?}"
        );
    }
    // A module the map leaves out.
    let mut s = sources();
    s.push(modmap::Source {
        module: "unmapped".into(),
        text: String::new(),
    });
    let problems = modmap::check(&s, false);
    assert!(
        problems.contains(&"module `unmapped` is in no layer of the map".to_string()),
        "{problems:?}"
    );
}

/// Comments, strings and unit-test modules are not imports.
#[test]
fn comments_strings_and_tests_are_not_imports() {
    let text = r##"
        // use crate::matmul;
        /* crate::plan::plan /* nested */ crate::scores */
        const S: &str = "crate::dispatch::active";
        const R: &str = r#"crate::table"#;
        const C: char = '"';
        fn f<'a>(x: &'a str) -> &'a str { x }
        #[cfg(test)]
        #[allow(unused)]
        mod tests {
            use crate::matmul::matmul;
            fn g() { let _ = "}"; }
        }
        use crate::error::KernelError;
    "##;
    let found = modmap::imports("matrix", text);
    assert_eq!(
        found,
        [vec!["error".to_string(), "KernelError".to_string()]]
    );
}
