//! The default thread count: physical cores, not hardware threads (two hyper-threads share one
//! core's FMA units, so matmul gains nothing from the second and loses to contention).

use std::collections::BTreeSet;

pub use kiln_kernels::{cap_threads, max_threads};

/// Physical cores of this machine (Linux: distinct `(physical id, core id)` pairs in
/// `/proc/cpuinfo`), falling back to the logical CPU count.
pub fn physical_cores() -> usize {
    let logical = std::thread::available_parallelism().map_or(1, |n| n.get());
    let cores = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .map(|s| count_cores(&s))
        .unwrap_or(0);
    // A restricted affinity mask (containers, taskset) can allow fewer CPUs than the package has.
    if cores == 0 {
        logical
    } else {
        cores.min(logical)
    }
}

fn count_cores(cpuinfo: &str) -> usize {
    let mut set = BTreeSet::new();
    let mut physical = None;
    for line in cpuinfo.lines() {
        let Some((key, value)) = line.split_once(':') else {
            continue;
        };
        match key.trim() {
            "physical id" => physical = Some(value.trim().to_string()),
            "core id" => {
                set.insert((physical.clone(), value.trim().to_string()));
            }
            _ => {}
        }
    }
    set.len()
}

/// The notice a program prints when `--threads` asked for more threads than
/// [`max_threads`]: `None` when `requested` is usable as it is.
pub fn cap_notice(requested: usize) -> Option<String> {
    let max = max_threads();
    (requested > max).then(|| {
        format!(
            "--threads {requested} is more than the {max} CPUs this process may use; using {max}"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_distinct_cores_not_siblings() {
        let info = "processor\t: 0\nphysical id\t: 0\ncore id\t: 0\n\nprocessor\t: 1\nphysical id\t: 0\ncore id\t: 0\n\nprocessor\t: 2\nphysical id\t: 0\ncore id\t: 1\n\nprocessor\t: 3\nphysical id\t: 1\ncore id\t: 0\n";
        assert_eq!(count_cores(info), 3);
        assert_eq!(count_cores(""), 0);
        assert!(physical_cores() >= 1);
    }
}
