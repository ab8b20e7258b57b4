//! The front ends' side of a shared engine: a bounded queue of [`Job`]s
//! ([`EngineHandle::submit`]) and the counters the engine publishes ([`EngineStatus`]).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{SyncSender, TrySendError};
use std::sync::Arc;

use super::job::Job;

/// Why [`EngineHandle::submit`] refused a job (the job is handed back).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SubmitError {
    /// The queue is full: answer 503 with `Retry-After`.
    Full,
    /// The engine has stopped (the server is shutting down).
    Stopped,
}

/// Counters the engine keeps for `/health` and the load test.
#[derive(Debug, Default)]
pub struct EngineState {
    /// Sequences decoding or reading their prompt.
    pub active: AtomicUsize,
    /// Jobs waiting in the queue.
    pub queued: AtomicUsize,
    /// Finished conversations kept for reuse.
    pub cached: AtomicUsize,
    /// Bytes of KV those hold.
    pub cached_bytes: AtomicUsize,
}

/// A snapshot of [`EngineState`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct EngineStatus {
    /// Sequences decoded together at most (`--parallel`).
    pub slots: usize,
    /// Of those, in use.
    pub active: usize,
    /// Jobs waiting for a slot.
    pub queued: usize,
    /// Finished conversations kept for reuse.
    pub cached: usize,
    /// Bytes of KV those hold.
    pub cached_bytes: usize,
}

/// The connection threads' side of the engine: cheap to clone.
#[derive(Debug, Clone)]
pub struct EngineHandle {
    queue: SyncSender<Job>,
    state: Arc<EngineState>,
    slots: usize,
}

impl EngineHandle {
    /// Queue `job`, or hand it back when the queue is full or the engine has stopped.
    pub fn submit(&self, job: Job) -> std::result::Result<(), (SubmitError, Box<Job>)> {
        self.state.queued.fetch_add(1, Ordering::SeqCst);
        match self.queue.try_send(job) {
            Ok(()) => Ok(()),
            Err(e) => {
                self.state.queued.fetch_sub(1, Ordering::SeqCst);
                Err(match e {
                    TrySendError::Full(j) => (SubmitError::Full, Box::new(j)),
                    TrySendError::Disconnected(j) => (SubmitError::Stopped, Box::new(j)),
                })
            }
        }
    }

    /// The engine's counters now.
    pub fn status(&self) -> EngineStatus {
        let s = &self.state;
        EngineStatus {
            slots: self.slots,
            active: s.active.load(Ordering::SeqCst),
            queued: s.queued.load(Ordering::SeqCst),
            cached: s.cached.load(Ordering::SeqCst),
            cached_bytes: s.cached_bytes.load(Ordering::SeqCst),
        }
    }
}

/// A job queue holding at most `depth` waiting jobs, for an engine of `slots` sequences:
/// the handle for connection threads, and the receiving end the engine reads.
pub fn queue(slots: usize, depth: usize) -> (EngineHandle, std::sync::mpsc::Receiver<Job>) {
    let (tx, rx) = std::sync::mpsc::sync_channel(depth);
    let handle = EngineHandle {
        queue: tx,
        state: Arc::new(EngineState::default()),
        slots,
    };
    (handle, rx)
}

impl EngineHandle {
    /// The shared counters (the engine updates them).
    pub fn state(&self) -> &Arc<EngineState> {
        &self.state
    }
}
