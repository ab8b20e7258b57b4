//! Which instruction-set tier the kernels run at, detected once per process.

use std::sync::OnceLock;

/// An instruction-set tier. Tiers are ordered: each x86 tier implies the ones below it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Isa {
    /// Plain Rust: the reference kernels.
    Scalar,
    /// x86-64 AVX2 + FMA + F16C.
    Avx2,
    /// x86-64 AVX-512 F/BW/VL/VNNI (plus the AVX2 tier's features).
    Avx512,
    /// aarch64 NEON (part of the aarch64 baseline).
    Neon,
}

/// The environment variable that forces a lower tier: `scalar`, `avx2`, `avx512` (x86-64) or
/// `neon` (aarch64).
pub const ISA_ENV: &str = "KILN_ISA";

impl Isa {
    /// The lowercase name used by [`ISA_ENV`].
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
            Isa::Neon => "neon",
        }
    }

    /// Parse a name accepted by [`ISA_ENV`].
    pub fn from_name(name: &str) -> Option<Isa> {
        match name.trim().to_ascii_lowercase().as_str() {
            "scalar" => Some(Isa::Scalar),
            "avx2" => Some(Isa::Avx2),
            "avx512" => Some(Isa::Avx512),
            "neon" => Some(Isa::Neon),
            _ => None,
        }
    }

    /// Whether this CPU can run kernels of this tier.
    pub fn is_supported(self) -> bool {
        match self {
            Isa::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
                    && is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => {
                Isa::Avx2.is_supported()
                    && is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
                    && is_x86_feature_detected!("avx512vnni")
            }
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => std::arch::is_aarch64_feature_detected!("neon"),
            _ => false,
        }
    }
}

/// Every tier this CPU supports, lowest first (tests loop over this).
pub fn supported_isas() -> Vec<Isa> {
    [Isa::Scalar, Isa::Avx2, Isa::Avx512, Isa::Neon]
        .into_iter()
        .filter(|i| i.is_supported())
        .collect()
}

/// The environment variable naming the tiers a test run must cover, comma-separated
/// [`Isa::name`]s (`avx512,avx2` on an AVX-512 CI machine, `neon` under aarch64 emulation);
/// the scalar tier is always covered. See [`tested_isas`].
pub const EXPECT_TIERS_ENV: &str = "KILN_EXPECT_TIERS";

/// The tiers named in `expected` (comma-separated [`Isa::name`]s; empty items ignored) that
/// are not in `supported`, or the first name that is no tier.
pub fn missing_tiers(expected: &str, supported: &[Isa]) -> Result<Vec<Isa>, String> {
    let mut missing = Vec::new();
    for name in expected.split(',').filter(|n| !n.trim().is_empty()) {
        let isa = Isa::from_name(name).ok_or_else(|| format!("{name:?} is not a tier"))?;
        if !supported.contains(&isa) && !missing.contains(&isa) {
            missing.push(isa);
        }
    }
    Ok(missing)
}

/// Every tier the tests run here: [`supported_isas`], after checking [`EXPECT_TIERS_ENV`].
/// Panics when it names a tier this CPU or build does not support (or a name that is no tier),
/// so that a test run which expects a tier fails instead of quietly testing fewer; every test
/// that loops over tiers, or skips one, asks this.
pub fn tested_isas() -> Vec<Isa> {
    let supported = supported_isas();
    if let Ok(expected) = std::env::var(EXPECT_TIERS_ENV) {
        let names = |l: &[Isa]| l.iter().map(|i| i.name()).collect::<Vec<_>>().join(", ");
        match missing_tiers(&expected, &supported) {
            Ok(missing) if missing.is_empty() => {}
            Ok(missing) => panic!(
                "{EXPECT_TIERS_ENV}={expected:?} expects {}, which this CPU or build does not \
                 support (it supports {}): run on a machine that has them, or change the list",
                names(&missing),
                names(&supported)
            ),
            Err(e) => panic!("{EXPECT_TIERS_ENV}={expected:?}: {e}"),
        }
    }
    supported
}

/// The best tier this CPU supports, ignoring [`ISA_ENV`].
pub fn best_isa() -> Isa {
    supported_isas().into_iter().max().unwrap_or(Isa::Scalar)
}

/// The tier the top-level kernels use: the best supported one, lowered by [`ISA_ENV`] if set.
///
/// An unknown name or a tier above what the CPU has is ignored (with a warning on stderr), so a
/// stray setting can slow a run down but never crash it with an illegal instruction.
pub fn isa() -> Isa {
    static ISA: OnceLock<Isa> = OnceLock::new();
    *ISA.get_or_init(|| {
        let env = std::env::var(ISA_ENV).ok();
        let (chosen, warning) = resolve(env.as_deref(), &supported_isas());
        if let Some(w) = warning {
            eprintln!("kiln-kernels: {w}");
        }
        chosen
    })
}

/// Pick the tier from the environment setting and the supported tiers (lowest first): the
/// best supported tier unless `env` names a supported one, plus a warning if `env` was ignored.
fn resolve(env: Option<&str>, supported: &[Isa]) -> (Isa, Option<String>) {
    let best = supported.iter().copied().max().unwrap_or(Isa::Scalar);
    let Some(v) = env else {
        return (best, None);
    };
    match Isa::from_name(v) {
        Some(want) if supported.contains(&want) => (want, None),
        _ => {
            let names: Vec<_> = supported.iter().map(|i| i.name()).collect();
            let w = format!(
                "ignoring {ISA_ENV}={v:?}: this CPU supports {}; using {}",
                names.join(", "),
                best.name()
            );
            (best, Some(w))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL_X86: [Isa; 3] = [Isa::Scalar, Isa::Avx2, Isa::Avx512];

    #[test]
    fn unset_picks_the_best_tier() {
        assert_eq!(resolve(None, &ALL_X86), (Isa::Avx512, None));
        assert_eq!(resolve(None, &[Isa::Scalar]), (Isa::Scalar, None));
    }

    #[test]
    fn env_lowers_the_tier() {
        assert_eq!(resolve(Some("avx2"), &ALL_X86), (Isa::Avx2, None));
        assert_eq!(resolve(Some(" Scalar "), &ALL_X86), (Isa::Scalar, None));
    }

    #[test]
    fn env_never_raises_the_tier() {
        let (isa, warning) = resolve(Some("avx512"), &[Isa::Scalar, Isa::Avx2]);
        assert_eq!(isa, Isa::Avx2);
        assert!(warning.unwrap().contains("avx512"));
    }

    #[test]
    fn expected_tiers_missing_from_the_supported_ones_are_named() {
        let x86 = [Isa::Scalar, Isa::Avx2];
        assert_eq!(missing_tiers("avx2", &x86), Ok(vec![]));
        assert_eq!(missing_tiers("", &x86), Ok(vec![]));
        assert_eq!(missing_tiers("avx512, avx2", &x86), Ok(vec![Isa::Avx512]));
        assert_eq!(missing_tiers("neon,neon", &x86), Ok(vec![Isa::Neon]));
        assert!(missing_tiers("avx2,sse9", &x86)
            .unwrap_err()
            .contains("sse9"));
    }

    #[test]
    fn unknown_name_is_ignored_with_a_warning() {
        let (isa, warning) = resolve(Some("sse9"), &ALL_X86);
        assert_eq!(isa, Isa::Avx512);
        assert!(warning.unwrap().contains("sse9"));
    }
}
