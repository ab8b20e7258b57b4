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

/// Prefetch distances in bytes for the one-token kernels' weight streams (0: none).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamPrefetch {
    /// Float rows (F32/F16/BF16), read one row after another.
    pub float_rows: usize,
    /// Sixteen-row interleaved Q4_0 groups.
    pub q4_0x16: usize,
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
        }
    } else {
        StreamPrefetch {
            float_rows: 0,
            q4_0x16: 4 * 288,
        }
    }
}

/// Intel's distance for both streams.
const INTEL_DISTANCE: usize = 4096;

/// The largest distance accepted from the environment (a larger one only evicts what is still
/// to be used).
const MAX_DISTANCE: usize = 1 << 20;

/// The distances in use: the environment's if it sets a valid one, else the vendor's.
pub fn distances() -> StreamPrefetch {
    static CHOSEN: OnceLock<StreamPrefetch> = OnceLock::new();
    *CHOSEN.get_or_init(|| {
        match std::env::var(STREAM_PREFETCH_ENV)
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
        {
            Some(d) => {
                let d = d.min(MAX_DISTANCE);
                StreamPrefetch {
                    float_rows: d,
                    q4_0x16: d,
                }
            }
            None => defaults_for(&cpu_vendor()),
        }
    })
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

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn vendor_string_is_twelve_bytes() {
        assert_eq!(cpu_vendor().len(), 12);
    }
}
