//! The thread pool that [`crate::matmul`] splits work over.
//!
//! A decode step runs a few hundred small matrix–vector products, each a few microseconds of
//! work, so the pool is built for low dispatch latency rather than generality: its workers are
//! started once, spin on an atomic job counter for a while after each job (so the next one
//! starts within a fraction of a microsecond), and only then park on a condition variable.
//! A job is a function of a task index. The task range is cut into one contiguous span per
//! thread, so that each thread streams through its own part of a weight matrix in order (and
//! its prefetches ahead land in its own cache); a thread that runs out of tasks takes the next
//! ones of the other spans, so a thread that the OS preempts delays the job by at most the one
//! task it holds.
//!
//! Results never depend on the thread count: callers cut work into tasks that do not depend
//! on it, and every output element is written by exactly one task.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::error::KernelError;

/// How long an idle worker spins before it parks: longer than the gap between two matmuls of a
/// decode step, short enough that an idle session stops burning a core quickly.
const SPIN: Duration = Duration::from_micros(300);

/// A job as the workers see it: `f(task)` for every task index. The lifetime is erased; see
/// [`Pool::run`] for why the pointee outlives every use.
#[derive(Clone, Copy)]
struct JobPtr(*const (dyn Fn(usize) + Sync + 'static));

// SAFETY: the pointee is `Sync`, so calling it from several threads at once is allowed, and
// `Pool::run` keeps it alive until every worker that loaded the pointer has stopped using it.
unsafe impl Send for JobPtr {}

/// State shared by the caller and the workers.
struct Shared {
    /// `epoch << 1 | open`: a new job bumps the epoch and opens it; the caller closes it once
    /// all tasks are claimed, after which no worker may join it.
    state: AtomicU64,
    /// Workers that joined the current job and have not finished with it.
    active: AtomicUsize,
    /// Per thread: the next unclaimed task of its span, and the span's end.
    spans: Vec<Span>,
    /// The current job (`Some` while open or while a joined worker may still use it).
    job: Mutex<Option<JobPtr>>,
    /// Workers parked on `wake`.
    sleepers: AtomicUsize,
    sleep: Mutex<()>,
    wake: Condvar,
    shutdown: AtomicBool,
    /// A task panicked on a worker thread (re-raised by the caller).
    panicked: AtomicBool,
}

impl Shared {
    fn job(&self) -> MutexGuard<'_, Option<JobPtr>> {
        self.job.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Cut `0..tasks` into one span per thread.
    fn split(&self, tasks: usize) {
        let n = self.spans.len();
        for (i, s) in self.spans.iter().enumerate() {
            s.next.store(tasks * i / n, Ordering::Relaxed);
            s.end.store(tasks * (i + 1) / n, Ordering::Relaxed);
        }
    }

    /// Run tasks of thread `me`'s span, then of the others', until none are left.
    fn drain(&self, me: usize, f: &(dyn Fn(usize) + Sync)) {
        let n = self.spans.len();
        for k in 0..n {
            let s = &self.spans[(me + k) % n];
            let end = s.end.load(Ordering::Relaxed);
            loop {
                let i = s.next.fetch_add(1, Ordering::Relaxed);
                if i >= end {
                    break;
                }
                f(i);
            }
        }
    }

    /// Mark every task claimed (after a panic, so the others stop soon).
    fn claim_all(&self) {
        for s in &self.spans {
            s.next.store(usize::MAX / 2, Ordering::Relaxed);
        }
    }
}

/// One thread's span of a job's tasks, on a cache line of its own.
#[repr(align(128))]
struct Span {
    next: AtomicUsize,
    end: AtomicUsize,
}

/// A fixed-size pool of compute threads: the calling thread plus `threads − 1` workers.
///
/// Results never depend on the thread count: work is split into fixed chunks of output rows,
/// and every output element is reduced by one thread in a fixed order.
pub struct Pool {
    threads: usize,
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    /// One job at a time (a `&Pool` may be shared between threads).
    running: Mutex<()>,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("threads", &self.threads)
            .finish_non_exhaustive()
    }
}

impl Pool {
    /// Start a pool of `threads` compute threads (`0` is an error): `threads − 1` workers are
    /// spawned, and the thread that calls into the kernels is the last one.
    pub fn new(threads: usize) -> Result<Pool, KernelError> {
        if threads == 0 {
            return Err(KernelError::ZeroThreads);
        }
        let shared = Arc::new(Shared {
            state: AtomicU64::new(0),
            active: AtomicUsize::new(0),
            spans: (0..threads)
                .map(|_| Span {
                    next: AtomicUsize::new(0),
                    end: AtomicUsize::new(0),
                })
                .collect(),
            job: Mutex::new(None),
            sleepers: AtomicUsize::new(0),
            sleep: Mutex::new(()),
            wake: Condvar::new(),
            shutdown: AtomicBool::new(false),
            panicked: AtomicBool::new(false),
        });
        let mut pool = Pool {
            threads,
            shared: Arc::clone(&shared),
            workers: Vec::with_capacity(threads - 1),
            running: Mutex::new(()),
        };
        for i in 1..threads {
            let sh = Arc::clone(&shared);
            let handle = std::thread::Builder::new()
                .name(format!("kiln-kernel-{i}"))
                .spawn(move || worker(&sh, i))
                .map_err(|e| KernelError::PoolBuild {
                    threads,
                    reason: e.to_string(),
                })?;
            // On an error above, dropping `pool` stops the workers already started.
            pool.workers.push(handle);
        }
        Ok(pool)
    }

    /// The number of compute threads.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Run `f(i)` for every `i` in `0..tasks`, spread over the pool; returns when all are done.
    /// A panic in any task is re-raised here once every thread has let go of `f`.
    pub(crate) fn run(&self, tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        if self.workers.is_empty() || tasks <= 1 {
            (0..tasks).for_each(f);
            return;
        }
        let _one_job = self.running.lock().unwrap_or_else(|e| e.into_inner());
        let sh = &*self.shared;
        sh.panicked.store(false, Ordering::Relaxed);
        let erased: *const (dyn Fn(usize) + Sync + '_) = f;
        // SAFETY: only the trait object's lifetime bound changes (same layout). The pointer is
        // dereferenced only by workers that joined this job (`active`), and `Close` below,
        // dropped before this function returns or unwinds, closes the job and waits until
        // no worker is active, so `f` outlives every use.
        let job = JobPtr(unsafe {
            std::mem::transmute::<
                *const (dyn Fn(usize) + Sync + '_),
                *const (dyn Fn(usize) + Sync + 'static),
            >(erased)
        });
        *sh.job() = Some(job);
        sh.split(tasks);
        let epoch = (sh.state.load(Ordering::Relaxed) >> 1) + 1;
        sh.state.store(epoch << 1 | 1, Ordering::SeqCst);
        if sh.sleepers.load(Ordering::SeqCst) > 0 {
            let _g = sh.sleep.lock().unwrap_or_else(|e| e.into_inner());
            sh.wake.notify_all();
        }
        let close = Close { sh, epoch };
        sh.drain(0, f);
        drop(close);
        if sh.panicked.swap(false, Ordering::AcqRel) {
            panic!("a kernel task panicked on a worker thread");
        }
    }
}

/// Closes a job and waits for the workers that joined it (also when the caller unwinds).
struct Close<'a> {
    sh: &'a Shared,
    epoch: u64,
}

impl Drop for Close<'_> {
    fn drop(&mut self) {
        let sh = self.sh;
        sh.state.store(self.epoch << 1, Ordering::SeqCst);
        let mut spins = 0u32;
        while sh.active.load(Ordering::SeqCst) != 0 {
            spins += 1;
            if spins < 1 << 12 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        *sh.job() = None;
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        {
            let _g = self.shared.sleep.lock().unwrap_or_else(|e| e.into_inner());
            self.shared.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

/// A worker: wait for a job (spinning, then parked), join it, claim tasks until none are left.
fn worker(sh: &Shared, me: usize) {
    let mut seen = 0u64;
    loop {
        let state = match wait_for_job(sh, seen) {
            Some(s) => s,
            None => return,
        };
        seen = state >> 1;
        if state & 1 == 0 {
            continue;
        }
        // Join, then check the job is still open: the caller closes before it waits for
        // `active` to reach zero, so either it sees this increment or this check fails.
        sh.active.fetch_add(1, Ordering::SeqCst);
        if sh.state.load(Ordering::SeqCst) != state {
            sh.active.fetch_sub(1, Ordering::SeqCst);
            continue;
        }
        let job = *sh.job();
        if let Some(job) = job {
            // SAFETY: this worker joined the open job, so the caller of `Pool::run` keeps the
            // closure alive until `active` drops back (see `Close`).
            let f = unsafe { &*job.0 };
            if catch_unwind(AssertUnwindSafe(|| sh.drain(me, f))).is_err() {
                sh.panicked.store(true, Ordering::Release);
                sh.claim_all();
            }
        }
        sh.active.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Wait until the epoch moves past `seen`; `None` on shutdown.
fn wait_for_job(sh: &Shared, seen: u64) -> Option<u64> {
    let start = Instant::now();
    let mut spins = 0u32;
    loop {
        if sh.shutdown.load(Ordering::Relaxed) {
            return None;
        }
        let s = sh.state.load(Ordering::Acquire);
        if s >> 1 != seen {
            return Some(s);
        }
        spins = spins.wrapping_add(1);
        if !spins.is_multiple_of(64) || start.elapsed() < SPIN {
            std::hint::spin_loop();
            continue;
        }
        let mut g = sh.sleep.lock().unwrap_or_else(|e| e.into_inner());
        sh.sleepers.fetch_add(1, Ordering::SeqCst);
        while sh.state.load(Ordering::SeqCst) >> 1 == seen && !sh.shutdown.load(Ordering::SeqCst) {
            g = sh.wake.wait(g).unwrap_or_else(|e| e.into_inner());
        }
        sh.sleepers.fetch_sub(1, Ordering::SeqCst);
        drop(g);
    }
}

/// A mutable slice that several tasks of one job write to, each through ranges no other task
/// touches (every output element belongs to exactly one task).
pub(crate) struct Disjoint<'a, T> {
    ptr: *mut T,
    len: usize,
    _borrow: std::marker::PhantomData<&'a mut [T]>,
}

// SAFETY: a `Disjoint` is only a shared handle to an exclusively borrowed slice of `Send`
// values; every access goes through `slice_mut`, whose contract rules out overlapping uses.
unsafe impl<T: Send> Sync for Disjoint<'_, T> {}

impl<'a, T> Disjoint<'a, T> {
    pub(crate) fn new(s: &'a mut [T]) -> Self {
        Disjoint {
            ptr: s.as_mut_ptr(),
            len: s.len(),
            _borrow: std::marker::PhantomData,
        }
    }

    /// `&mut s[range]`. Panics if the range is out of bounds.
    ///
    /// # Safety
    /// No other live reference obtained from this `Disjoint` overlaps `range`.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn slice_mut(&self, range: std::ops::Range<usize>) -> &mut [T] {
        assert!(
            range.start <= range.end && range.end <= self.len,
            "disjoint slice out of bounds"
        );
        // SAFETY: in bounds (checked above) of a slice borrowed mutably for 'a; no overlapping
        // reference exists (caller contract).
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(range.start), range.len()) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn every_task_runs_exactly_once() {
        for threads in [1, 2, 3] {
            let pool = Pool::new(threads).unwrap();
            for tasks in [0, 1, 2, 7, 100] {
                let hits: Vec<AtomicUsize> = (0..tasks).map(|_| AtomicUsize::new(0)).collect();
                for _ in 0..20 {
                    pool.run(tasks, &|i| {
                        hits[i].fetch_add(1, Ordering::Relaxed);
                    });
                }
                assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 20));
            }
        }
    }

    #[test]
    fn parked_workers_wake_up() {
        let pool = Pool::new(2).unwrap();
        std::thread::sleep(SPIN * 4);
        let n = AtomicUsize::new(0);
        pool.run(64, &|_| {
            n.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(n.load(Ordering::Relaxed), 64);
    }

    #[test]
    fn a_panicking_task_panics_the_caller_and_the_pool_survives() {
        let pool = Pool::new(2).unwrap();
        let r = catch_unwind(AssertUnwindSafe(|| {
            pool.run(50, &|i| assert!(i != 17, "task 17"));
        }));
        assert!(r.is_err());
        let n = AtomicUsize::new(0);
        pool.run(10, &|_| {
            n.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(n.load(Ordering::Relaxed), 10);
    }
}
