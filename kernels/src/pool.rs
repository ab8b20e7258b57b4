//! The threads that [`crate::matmul`] splits work over.
//!
//! A decode step runs a few hundred small matrix–vector products, each a few microseconds of
//! work, so what matters is how fast a product reaches the other threads and comes back. The
//! pool is a dedicated rayon pool of `threads` workers, and callers that issue many products
//! in a row (a forward pass) run them all inside one [`Pool::install`]: the products are then
//! issued from a worker, so splitting one is a push onto that worker's own deque for the others
//! (still spinning from the previous product) to steal, with no hand-over from an outside thread
//! and no wake-up on the way. A product issued from outside the pool is handed to it first,
//! which is correct but slower.
//!
//! Tasks get exclusive access to their own part of the output through rayon's split borrows,
//! so there is no `unsafe` here. Results never depend on the thread count: callers cut work into
//! tasks that do not depend on it, and every output element is written by exactly one task.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use rayon::prelude::*;

use crate::error::KernelError;

/// Pieces per thread a job is cut into at most: 2 on one or two threads, [`MAX_SPLITS`]
/// beyond. Each split is a deque push and possibly a steal, so few pay on few cores; but on
/// many cores a thread the OS or the hypervisor holds up keeps all the others waiting at the
/// end of every product, and small pieces let them take its share. On a 16-core Xeon virtual
/// machine, 16 and 32 pieces per thread ran 1B decode and prefill at 4 to 16 threads up to
/// 30% faster than 2 did, 32 at least as fast as 16; on 2 cores, 4 to 16 pieces were 0–3%
/// slower than 2 (docs/BENCHMARKS.md, "Many cores").
fn splits_for(threads: usize) -> usize {
    if threads <= 2 {
        MIN_SPLITS
    } else {
        MAX_SPLITS
    }
}

/// The fewest pieces per thread.
const MIN_SPLITS: usize = 2;

/// The most pieces per thread.
const MAX_SPLITS: usize = 32;

/// The environment variable that overrides [`splits_for`] (1 to 64 pieces per thread), for
/// measuring how a machine's threads balance; it never changes a result.
pub const POOL_SPLITS_ENV: &str = "KILN_POOL_SPLITS";

/// The environment's valid override of [`splits_for`], if any.
fn splits_override() -> Option<usize> {
    static CHOSEN: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    *CHOSEN.get_or_init(|| parse_splits(std::env::var(POOL_SPLITS_ENV).ok().as_deref()))
}

fn parse_splits(v: Option<&str>) -> Option<usize> {
    v.and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|n| (1..=64).contains(n))
}

/// A fixed-size set of compute threads (one thread: everything runs on the caller).
pub struct Pool {
    threads: usize,
    /// Pieces per thread a job is cut into at most ([`splits_for`]).
    splits: usize,
    /// `None` for one thread: no worker to hand anything to.
    workers: Option<rayon::ThreadPool>,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("threads", &self.threads)
            .finish_non_exhaustive()
    }
}

/// The most compute threads worth starting: the CPUs this process may run on.
///
/// The pool's helpers poll for work while a pass runs, so threads beyond the CPUs only take
/// turns with each other (`-t 1000` once turned a 0.6 s run into 99 s and stalled the machine).
pub fn max_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// `requested` threads, capped at [`max_threads`]. Every program resolves its `--threads`
/// through this, and says so when the value was lowered.
pub fn cap_threads(requested: usize) -> usize {
    requested.min(max_threads())
}

impl Pool {
    /// Start a pool of `threads` compute threads (`0` is an error), capped at [`max_threads`].
    pub fn new(threads: usize) -> Result<Pool, KernelError> {
        if threads == 0 {
            return Err(KernelError::ZeroThreads);
        }
        let threads = cap_threads(threads);
        let workers = if threads == 1 {
            None
        } else {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .thread_name(|i| format!("kiln-kernel-{i}"))
                .build()
                .map_err(|e| KernelError::PoolBuild {
                    threads,
                    reason: e.to_string(),
                })?;
            Some(pool)
        };
        let splits = splits_override().unwrap_or_else(|| splits_for(threads));
        Ok(Pool {
            threads,
            splits,
            workers,
        })
    }

    /// The number of compute threads.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Run `f` on one of the pool's threads and return its result. Wrap a whole sequence of
    /// products (a forward pass) in one call: each product inside then starts on the pool
    /// directly instead of being handed over from the calling thread, and for as long as `f`
    /// runs the other threads stay awake looking for its work (see `help_until`).
    pub fn install<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        let Some(p) = &self.workers else {
            return f();
        };
        if p.current_thread_index().is_some() {
            return f();
        }
        p.install(|| {
            let me = p.current_thread_index();
            let done = Arc::new(AtomicBool::new(false));
            let flag = Arc::clone(&done);
            p.spawn_broadcast(move |ctx| {
                if Some(ctx.index()) != me {
                    help_until(&flag);
                }
            });
            let _stop = Stop(done);
            f()
        })
    }

    /// Run `f(i, chunk)` for every `chunk`-sized piece of `items` (the last may be shorter),
    /// spread over the pool; returns when all are done. Each call gets its piece exclusively.
    /// A panic in any call is re-raised here. Worth it for work of tens of microseconds or
    /// more (a prompt's element-wise steps); below that, handing work over costs more.
    pub fn for_each_chunk<T: Send>(
        &self,
        items: &mut [T],
        chunk: usize,
        f: impl Fn(usize, &mut [T]) + Sync,
    ) {
        match &self.workers {
            Some(_) if items.len() > chunk => self.install(|| {
                let pieces = items.len().div_ceil(chunk);
                items
                    .par_chunks_mut(chunk)
                    .enumerate()
                    .with_min_len(pieces.div_ceil(self.threads * self.splits))
                    .for_each(|(i, c)| f(i, c))
            }),
            _ => items
                .chunks_mut(chunk)
                .enumerate()
                .for_each(|(i, c)| f(i, c)),
        }
    }
}

/// Sets its flag when dropped: on return and on unwind alike, the helpers stop.
struct Stop(Arc<AtomicBool>);

impl Drop for Stop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

/// What every other thread of the pool does while a forward pass runs: take the pass's work
/// as soon as it is split off, spinning in between, until `done`.
///
/// A decode step is a few hundred products of a few microseconds each with short serial gaps
/// between them (norms, rope, attention); a rayon worker left idle goes to sleep within tens
/// of microseconds and then needs a system call to wake, which costs more than a product
/// takes. Kept busy here, a worker sees new work within a fraction of a microsecond.
///
/// Every [`IDLE_POLLS`] empty polls the thread also yields to the OS: with more threads than
/// free cores (a loaded machine, or `--threads` above the core count) the thread that holds
/// the work may be waiting for this core.
fn help_until(done: &AtomicBool) {
    let mut idle = 0u32;
    while !done.load(Ordering::Acquire) {
        if rayon::yield_now() == Some(rayon::Yield::Executed) {
            idle = 0;
            continue;
        }
        idle += 1;
        if idle >= GIVE_UP_POLLS {
            // Milliseconds without work: a long serial stretch, or this thread's spinning is
            // what keeps the work from running. Back to rayon's own idle loop, which still
            // takes the pass's work, only after a wake-up.
            return;
        }
        if idle.is_multiple_of(IDLE_POLLS) {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
}

/// Empty polls in a row after which a helper stops (a few milliseconds; a decode step's serial
/// gaps are tens of microseconds). This bounds what spinning can cost: a helper never holds a
/// core for long against the thread that has the work, and never waits indefinitely on a
/// flag that a frame deeper in some thread's stack would set.
const GIVE_UP_POLLS: u32 = 1 << 16;

/// Empty polls between two OS yields of a helper (each poll is a sweep of the pool's queues,
/// some tens of nanoseconds).
const IDLE_POLLS: u32 = 64;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_override_is_taken_only_in_range() {
        assert_eq!(parse_splits(None), None);
        assert_eq!(parse_splits(Some(" 8")), Some(8));
        assert_eq!(parse_splits(Some("0")), None);
        assert_eq!(parse_splits(Some("65")), None);
        assert_eq!(parse_splits(Some("many")), None);
    }

    #[test]
    fn more_threads_cut_jobs_finer() {
        assert_eq!(splits_for(1), MIN_SPLITS);
        assert_eq!(splits_for(2), MIN_SPLITS);
        assert_eq!(splits_for(3), MAX_SPLITS);
        assert_eq!(splits_for(16), MAX_SPLITS);
        assert_eq!(splits_for(500), MAX_SPLITS);
    }

    #[test]
    fn absurd_thread_counts_are_capped_at_the_cpus() {
        assert_eq!(cap_threads(100_000), max_threads());
        assert_eq!(cap_threads(1), 1);
        let pool = Pool::new(100_000).unwrap();
        assert_eq!(pool.threads(), max_threads());
    }
    use std::panic::{catch_unwind, AssertUnwindSafe};
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn every_chunk_runs_exactly_once_on_its_own_items() {
        for threads in [1, 2, 3] {
            let pool = Pool::new(threads).unwrap();
            for len in [0, 1, 2, 7, 100] {
                for chunk in [1, 3, 16] {
                    let calls = AtomicUsize::new(0);
                    let mut items = vec![0usize; len];
                    for _ in 0..5 {
                        pool.for_each_chunk(&mut items, chunk, |i, c| {
                            calls.fetch_add(1, Ordering::Relaxed);
                            assert!(c.len() <= chunk && !c.is_empty());
                            for v in c.iter_mut() {
                                *v += i + 1;
                            }
                        });
                    }
                    assert_eq!(calls.load(Ordering::Relaxed), 5 * len.div_ceil(chunk));
                    for (k, v) in items.iter().enumerate() {
                        assert_eq!(*v, 5 * (k / chunk + 1), "{threads} threads, item {k}");
                    }
                }
            }
        }
    }

    #[test]
    fn work_spreads_over_the_pool_from_inside_and_outside() {
        let pool = Pool::new(2).unwrap();
        let mut items = vec![0u8; 64];
        // From outside: handed over to the pool.
        pool.for_each_chunk(&mut items, 1, |_, c| c[0] = 1);
        // From inside an install, as a forward pass runs.
        let inside = pool.install(|| {
            pool.for_each_chunk(&mut items, 1, |_, c| c[0] += 1);
            rayon::current_thread_index().is_some()
        });
        assert!(inside);
        assert!(items.iter().all(|&v| v == 2));
    }

    #[test]
    fn a_panicking_task_panics_the_caller_and_the_pool_survives() {
        let pool = Pool::new(2).unwrap();
        let mut items = vec![0u32; 50];
        let r = catch_unwind(AssertUnwindSafe(|| {
            pool.for_each_chunk(&mut items, 1, |i, _| assert!(i != 17, "task 17"));
        }));
        assert!(r.is_err());
        let n = AtomicUsize::new(0);
        pool.for_each_chunk(&mut items, 5, |_, _| {
            n.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(n.load(Ordering::Relaxed), 10);
    }
}
