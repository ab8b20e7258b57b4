//! The module map in `src/lib.rs` is true: every module is in a layer, none imports from a
//! layer above its own or through the crate root, and the imports form no circle, within a
//! layer too (the SIMD tiers' modules, `simd::x86::*` and `simd::aarch64::*`, share one layer,
//! so only this keeps their primitives below the kernels built on them). The checks are
//! `support/modmap.rs`, shared with the quantizer; the planted imports show each can fail.

#[path = "support/modmap.rs"]
mod modmap;

use std::path::Path;

fn sources() -> Vec<modmap::Source> {
    modmap::read_crate(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"))
}

#[test]
fn the_module_map_is_true() {
    let problems = modmap::check(&sources(), true);
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
        let problems = modmap::check(&s, true);
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
    let problems = modmap::check(&s, true);
    assert!(
        problems.contains(&"module `unmapped` is in no layer of the map".to_string()),
        "{problems:?}"
    );
}

/// Whether `problems` names an import circle through every module of `modules`.
fn has_circle(problems: &[String], modules: &[&str]) -> bool {
    problems.iter().any(|p| {
        p.strip_prefix("import circle: ").is_some_and(|c| {
            let on: Vec<&str> = c.split(" -> ").collect();
            modules.iter().all(|m| on.contains(m))
        })
    })
}

/// An import that closes a circle among modules of one layer is named, in the SIMD tiers
/// (the circles this check was added for, planted back) and outside them.
#[test]
fn planted_circles_are_caught() {
    let cases = [
        // The pair tile importing from the AVX-512 tier, which is built on it.
        (
            "simd::x86::avx512_pair",
            "use super::avx512::table;",
            ["simd::x86::avx512_pair", "simd::x86::avx512"],
        ),
        // The Q5 tile importing from the K-quant tiles, which instantiate it.
        (
            "simd::x86::q5",
            "use super::kquant::avx2;",
            ["simd::x86::q5", "simd::x86::kquant"],
        ),
        // The K-quant sums naming the AVX2 sixteen-row kernels, which are built on them.
        (
            "simd::x86::kquant",
            "fn f() { super::avx2_rows::q2_k; }",
            ["simd::x86::kquant", "simd::x86::avx2_rows"],
        ),
        // Outside the tiers: two operand layouts of one layer.
        ("lanes", "use crate::klanes::KSUBS;", ["lanes", "klanes"]),
    ];
    for (module, line, circle) in cases {
        let mut s = sources();
        modmap::plant(&mut s, module, line);
        // Without the circle check the same sources are within the map.
        assert!(
            modmap::check(&s, false).is_empty(),
            "{line} in {module} breaks a layer"
        );
        let problems = modmap::check(&s, true);
        assert!(
            has_circle(&problems, &circle),
            "{line} in {module}: {problems:?}"
        );
    }
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
