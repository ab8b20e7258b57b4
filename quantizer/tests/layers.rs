//! The module map in `src/lib.rs` is true: every module is in a layer, none imports from a
//! layer above its own or through the crate root, and the imports form no circle (the checks
//! are the kernels crate's `tests/support/modmap.rs`, shared). The planted imports show each
//! check can fail.

#[path = "../../kernels/tests/support/modmap.rs"]
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

/// Each kind of bad import, planted in a copy of the sources, is named; the circle is the
/// one the crate had (the progress callbacks and the probe's length imported from above).
#[test]
fn planted_bad_imports_are_caught() {
    let cases: [(&[(&str, &str)], &str); 4] = [
        (
            &[("calibrate", "use crate::pipeline::quantize_file;")],
            "`calibrate` (layer 5) imports `crate::pipeline::quantize_file`",
        ),
        (
            &[("rows", "use crate::ErrorStats;")],
            "`rows` imports `crate::ErrorStats` through the crate root",
        ),
        (
            &[("gptq", "fn f() { let _ = super::budget::plan; }")],
            "`gptq` (layer 3) imports `crate::budget::plan`",
        ),
        (
            &[
                ("importance", "use crate::policy::Policy;"),
                ("policy", "use crate::importance::PROBE_TOKENS;"),
            ],
            "import circle: importance -> policy -> importance",
        ),
    ];
    for (plants, expected) in cases {
        let mut s = sources();
        for (module, line) in plants {
            modmap::plant(&mut s, module, line);
        }
        let problems = modmap::check(&s, true);
        assert!(
            problems.iter().any(|p| p.contains(expected)),
            "{plants:?}: {problems:?}"
        );
    }
}
