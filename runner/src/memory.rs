//! How much memory this process may still take, so that a context is checked against it
//! before anything is built per position.
//!
//! A context's KV cache is mapped at once but touched only as it fills, and its RoPE tables
//! are computed whole: asking for 2^24 positions once spent 25 s and 4.1 GB on tables before
//! the cache's mapping was refused. [`available`] answers in microseconds from `/proc`, so
//! [`crate::Model::check_context`] can refuse such a context first, naming the bytes.

/// Bytes this process can still take, and what bounds them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Available {
    /// The bytes.
    pub bytes: u64,
    /// What sets the bound, for messages: "free memory and swap", "the address-space limit
    /// (ulimit -v)" or "the cgroup's memory.max".
    pub bound: &'static str,
}

/// The memory this process may still allocate: the system's available memory and free swap,
/// less where an address-space limit or a cgroup limit leaves less. `None` where the system
/// does not say (not Linux, no `/proc`): then only the allocation itself can refuse.
pub fn available() -> Option<Available> {
    imp::available()
}

/// The value in kB of `key` (e.g. `MemAvailable:`) in a `/proc` file of `key value kB` lines,
/// in bytes.
#[cfg_attr(not(target_os = "linux"), allow(dead_code))]
fn kb_field(text: &str, key: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix(key))?
        .split_whitespace()
        .next()?
        .parse::<u64>()
        .ok()?
        .checked_mul(1024)
}

#[cfg(target_os = "linux")]
mod imp {
    use super::{kb_field, Available};

    pub(super) fn available() -> Option<Available> {
        let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
        let free = kb_field(&meminfo, "MemAvailable:")?
            .saturating_add(kb_field(&meminfo, "SwapFree:").unwrap_or(0));
        let mut best = Available {
            bytes: free,
            bound: "free memory and swap",
        };
        for other in [address_space_left(), cgroup_left()].into_iter().flatten() {
            if other.bytes < best.bytes {
                best = other;
            }
        }
        Some(best)
    }

    /// What `ulimit -v` (RLIMIT_AS) leaves beyond the address space already in use: mapping
    /// past it fails however little of the mapping is touched.
    fn address_space_left() -> Option<Available> {
        let limit = rustix::process::getrlimit(rustix::process::Resource::As).current?;
        let status = std::fs::read_to_string("/proc/self/status").ok()?;
        let used = kb_field(&status, "VmSize:")?;
        Some(Available {
            bytes: limit.saturating_sub(used),
            bound: "the address-space limit (ulimit -v)",
        })
    }

    /// What this process's cgroup (v2) leaves under its `memory.max`: a container's limit,
    /// which `/proc/meminfo` does not show.
    fn cgroup_left() -> Option<Available> {
        let cgroup = std::fs::read_to_string("/proc/self/cgroup").ok()?;
        let path = cgroup.lines().find_map(|l| l.strip_prefix("0::"))?;
        let dir = std::path::Path::new("/sys/fs/cgroup").join(path.trim_start_matches('/'));
        let read = |name: &str| std::fs::read_to_string(dir.join(name)).ok();
        let max = read("memory.max")?.trim().parse::<u64>().ok()?;
        let current = read("memory.current")?.trim().parse::<u64>().ok()?;
        Some(Available {
            bytes: max.saturating_sub(current),
            bound: "the cgroup's memory.max",
        })
    }
}

#[cfg(not(target_os = "linux"))]
mod imp {
    pub(super) fn available() -> Option<super::Available> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_kb_fields() {
        let text = "MemTotal:       24684000 kB\nMemAvailable:    2000 kB\nSwapFree: 0 kB\n";
        assert_eq!(kb_field(text, "MemAvailable:"), Some(2000 * 1024));
        assert_eq!(kb_field(text, "SwapFree:"), Some(0));
        assert_eq!(kb_field(text, "Missing:"), None);
    }

    #[test]
    #[cfg(target_os = "linux")]
    fn linux_says_something() {
        let a = available().expect("/proc/meminfo answers on Linux");
        assert!(a.bytes > 0, "{a:?}");
    }
}
