//! Coverage that cannot vanish: `KILN_EXPECT_TIERS` (comma-separated tier names, e.g.
//! `avx512,avx2` or `neon`) lists the tiers a CI job expects its machine and build to run, and
//! this test fails when one of them is not supported, instead of every tier loop quietly
//! testing fewer tiers. The scalar tier is always tested. Unset, it reports which tiers the
//! tests here cover.

use kiln_kernels::{kernels, missing_tiers, supported_isas, tested_isas, Isa, EXPECT_TIERS_ENV};

#[test]
fn every_expected_tier_is_supported_and_tested() {
    let supported = supported_isas();
    let names = |l: &[Isa]| l.iter().map(|i| i.name()).collect::<Vec<_>>().join(", ");
    match std::env::var(EXPECT_TIERS_ENV) {
        Ok(expected) => {
            let missing = missing_tiers(&expected, &supported)
                .unwrap_or_else(|e| panic!("{EXPECT_TIERS_ENV}={expected:?}: {e}"));
            assert!(
                missing.is_empty(),
                "{EXPECT_TIERS_ENV}={expected:?}: {} not supported here (supported: {})",
                names(&missing),
                names(&supported)
            );
            eprintln!(
                "{EXPECT_TIERS_ENV}={expected:?}: testing {}",
                names(&supported)
            );
        }
        Err(_) => eprintln!(
            "{EXPECT_TIERS_ENV} unset: testing the tiers this CPU supports: {}",
            names(&supported)
        ),
    }
    let tested = tested_isas();
    assert_eq!(
        tested.first(),
        Some(&Isa::Scalar),
        "scalar is always tested"
    );
    for isa in tested {
        assert_eq!(
            kernels(isa).map(|k| k.isa()),
            Some(isa),
            "a tested tier without its table"
        );
    }
}
