//! The thread pool that [`crate::matmul`] splits work over.

use crate::error::KernelError;

/// A fixed-size pool of worker threads (a wrapper around a private `rayon::ThreadPool`).
///
/// Results never depend on the thread count: work is split into fixed chunks of output rows,
/// and every output element is reduced by one thread in a fixed order.
#[derive(Debug)]
pub struct Pool {
    inner: rayon::ThreadPool,
    threads: usize,
}

impl Pool {
    /// Start a pool of `threads` workers (`0` is an error).
    pub fn new(threads: usize) -> Result<Pool, KernelError> {
        if threads == 0 {
            return Err(KernelError::ZeroThreads);
        }
        let inner = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("kiln-kernel-{i}"))
            .build()
            .map_err(|e| KernelError::PoolBuild {
                threads,
                reason: e.to_string(),
            })?;
        Ok(Pool { inner, threads })
    }

    /// The number of worker threads.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Run `f` inside the pool, so that rayon parallel iterators in it use these workers.
    pub(crate) fn install<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        self.inner.install(f)
    }
}
