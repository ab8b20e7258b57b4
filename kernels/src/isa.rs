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
    fn unknown_name_is_ignored_with_a_warning() {
        let (isa, warning) = resolve(Some("sse9"), &ALL_X86);
        assert_eq!(isa, Isa::Avx512);
        assert!(warning.unwrap().contains("sse9"));
    }
}
