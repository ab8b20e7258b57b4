//! How far ahead of a single weight stream the one-token kernels prefetch.
//!
//! A matrix–vector product at decode reads each thread's rows as one sequential stream, and the
//! bandwidth one core gets from one stream is bounded by how many cache lines are in flight for
//! it. Processors differ in how far their hardware prefetchers run ahead of such a stream:
//! on AMD Zen the prefetchers keep enough lines in flight and software prefetching on top only
//! costs instructions (F16 rows ran faster without it), while Intel's L2 streamer stops at each
//! 4 KiB page and runs a short distance ahead, so one Intel core streamed F16 weights at about
//! half the rate of a core that asked for lines further ahead (see docs/BENCHMARKS.md, "Many
//! cores"). The distance is therefore chosen per CPU vendor at first use, and
//! `KILN_STREAM_PREFETCH` (bytes; 0 turns software prefetching in these kernels off) overrides
//! it for measurement. It never changes a result, only when lines are asked for.

use std::sync::OnceLock;

/// The environment variable that overrides [`distances`].
pub const STREAM_PREFETCH_ENV: &str = "KILN_STREAM_PREFETCH";
/// The environment variable that overrides [`StreamPrefetch::hint`].
pub const STREAM_HINT_ENV: &str = "KILN_STREAM_HINT";

/// The cache level a software prefetch fills (`prefetcht0`, `t1`, `t2`, `prefetchnta`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hint {
    /// Every level, L1 included.
    T0,
    /// L2 and below.
    T1,
    /// The last level (on most cores the same as T1).
    T2,
    /// Non-temporal: close to the core, kept out of the outer levels where the CPU can.
    Nta,
}

impl Hint {
    /// `t0`, `t1`, `t2` or `nta`.
    pub fn parse(s: &str) -> Option<Hint> {
        match s.trim().to_ascii_lowercase().as_str() {
            "t0" => Some(Hint::T0),
            "t1" => Some(Hint::T1),
            "t2" => Some(Hint::T2),
            "nta" => Some(Hint::Nta),
            _ => None,
        }
    }
}

/// Prefetch distances in bytes for the one-token kernels' weight streams (0: none).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamPrefetch {
    /// Float rows (F32/F16/BF16), read one row after another.
    pub float_rows: usize,
    /// Sixteen-row interleaved Q4_0 groups.
    pub q4_0x16: usize,
    /// The level prefetches fill; `None`: each kernel's own (L2 for float rows, L1 for Q4_0
    /// groups).
    pub hint: Option<Hint>,
}

/// The CPU's vendor string (`GenuineIntel`, `AuthenticAMD`, …), empty off x86-64.
pub fn cpu_vendor() -> String {
    #[cfg(target_arch = "x86_64")]
    {
        let r = std::arch::x86_64::__cpuid(0);
        let mut v = Vec::with_capacity(12);
        for w in [r.ebx, r.edx, r.ecx] {
            v.extend_from_slice(&w.to_le_bytes());
        }
        String::from_utf8_lossy(&v).into_owned()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        String::new()
    }
}

/// The defaults for a vendor: Zen's measured best (no software prefetch on float rows, four
/// 288-byte groups ahead on Q4_0 groups) everywhere but Intel, which asks further ahead.
pub fn defaults_for(vendor: &str) -> StreamPrefetch {
    if vendor == "GenuineIntel" {
        StreamPrefetch {
            float_rows: INTEL_DISTANCE,
            q4_0x16: INTEL_DISTANCE,
            hint: None,
        }
    } else {
        StreamPrefetch {
            float_rows: 0,
            q4_0x16: 4 * 288,
            hint: None,
        }
    }
}

/// Intel's distance for both streams.
const INTEL_DISTANCE: usize = 4096;

/// The largest distance accepted from the environment (a larger one only evicts what is still
/// to be used).
const MAX_DISTANCE: usize = 1 << 20;

/// The settings in use: the vendor's, with whatever the environment sets validly instead.
pub fn distances() -> StreamPrefetch {
    static CHOSEN: OnceLock<StreamPrefetch> = OnceLock::new();
    *CHOSEN.get_or_init(|| {
        let var = |name| std::env::var(name).ok();
        with_overrides(
            defaults_for(&cpu_vendor()),
            var(STREAM_PREFETCH_ENV).as_deref(),
            var(STREAM_HINT_ENV).as_deref(),
        )
    })
}

/// `base` with a valid distance and hint put in (an invalid value is ignored: these are
/// measurement settings, never needed for a correct run).
fn with_overrides(
    base: StreamPrefetch,
    distance: Option<&str>,
    hint: Option<&str>,
) -> StreamPrefetch {
    let mut sp = base;
    if let Some(d) = distance.and_then(|v| v.trim().parse::<usize>().ok()) {
        let d = d.min(MAX_DISTANCE);
        (sp.float_rows, sp.q4_0x16) = (d, d);
    }
    if let Some(h) = hint.and_then(Hint::parse) {
        sp.hint = Some(h);
    }
    sp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vendors_get_their_defaults() {
        let amd = defaults_for("AuthenticAMD");
        assert_eq!(amd.float_rows, 0);
        assert_eq!(amd.q4_0x16, 4 * 288);
        let intel = defaults_for("GenuineIntel");
        assert!(intel.float_rows > 0 && intel.q4_0x16 > 0);
        assert_eq!(defaults_for(""), amd);
    }

    #[test]
    fn the_environment_overrides_only_what_it_sets_validly() {
        let amd = defaults_for("AuthenticAMD");
        assert_eq!(with_overrides(amd, None, None), amd);
        let sp = with_overrides(amd, Some(" 8192"), Some("NTA"));
        assert_eq!((sp.float_rows, sp.q4_0x16), (8192, 8192));
        assert_eq!(sp.hint, Some(Hint::Nta));
        assert_eq!(with_overrides(amd, Some("far"), Some("t9")), amd);
        let sp = with_overrides(amd, Some("99999999"), Some("t2"));
        assert_eq!(sp.float_rows, MAX_DISTANCE);
        assert_eq!(sp.hint, Some(Hint::T2));
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn vendor_string_is_twelve_bytes() {
        assert_eq!(cpu_vendor().len(), 12);
    }
}
