//! Memory read bandwidth: the rate at which THREADS threads, each streaming its own part of a
//! buffer far larger than the last-level cache, can read it. A decode step reads every weight
//! once, so this is the ceiling that decode speed is measured against (`weights bytes ×
//! tokens/s ÷ this`, docs/BENCHMARKS.md).
//!
//! `cargo run --release -p kiln-kernels --example bandwidth -- [THREADS] [MIB] [PASSES]`
//! (defaults: every available CPU, 1024 MiB, 15 passes). Prints the median and best pass for
//! one thread and for THREADS threads.
//!
//! Each thread reads its part through the dispatched tier's `dot_f32` of each 16 KiB piece
//! with itself (every cache line loaded once, full-width vector loads, several accumulators in
//! flight, nothing written back), so the figure is what the kernels' own sequential loads
//! reach.

use std::hint::black_box;
use std::time::Instant;

/// Read `x` once: the sum of the squares of its 16 KiB pieces.
fn read_all(x: &[f32]) -> f32 {
    x.chunks(4096).map(|c| kiln_kernels::dot_f32(c, c)).sum()
}

/// One pass over `buf` split evenly across `threads`; returns seconds.
fn pass(buf: &[f32], threads: usize) -> f64 {
    let part = buf.len().div_ceil(threads);
    let t = Instant::now();
    let total = std::thread::scope(|s| {
        let handles: Vec<_> = buf
            .chunks(part)
            .map(|c| s.spawn(move || read_all(black_box(c))))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("reader thread"))
            .sum::<f32>()
    });
    black_box(total);
    t.elapsed().as_secs_f64()
}

/// Median and best GB/s over `passes` passes.
fn measure(buf: &[f32], threads: usize, passes: usize) -> (f64, f64) {
    let bytes = std::mem::size_of_val(buf) as f64;
    pass(buf, threads); // warm: page the buffer in, start the threads once
    let mut rates: Vec<f64> = (0..passes)
        .map(|_| bytes / pass(buf, threads) / 1e9)
        .collect();
    rates.sort_by(f64::total_cmp);
    (rates[rates.len() / 2], rates[rates.len() - 1])
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: bandwidth [THREADS] [MIB] [PASSES]";
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads: usize = args.first().map_or(cpus, |a| a.parse().expect(usage));
    let mib: usize = args.get(1).map_or(1024, |a| a.parse().expect(usage));
    let passes: usize = args.get(2).map_or(15, |a| a.parse().expect(usage));
    assert!(threads >= 1 && mib >= 1 && passes >= 1, "{usage}");
    // Written values, so no page is shared copy-on-write zero memory.
    let buf: Vec<f32> = (0..mib * (1 << 20) / 4)
        .map(|i| (i % 1000) as f32 * 1e-3)
        .collect();
    for t in [1, threads] {
        let (median, best) = measure(&buf, t, passes);
        println!(
            "{mib} MiB, {t} thread(s), {passes} passes, {:?} tier: median {median:.2} GB/s, best {best:.2} GB/s",
            kiln_kernels::isa()
        );
        if threads == 1 {
            break;
        }
    }
}
