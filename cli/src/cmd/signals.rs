//! SIGINT, SIGTERM and SIGHUP: the watcher thread that raises an [`Interrupt`], and the exit
//! status (128 + the signal's number) of a run they stopped.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use kiln_format::ExitStatus;
use kiln_runner::Interrupt;

/// How long the signal watcher lets a run reach its next token and print its summary before
/// it exits on its own: a forward pass over a prefill batch of a large model takes seconds.
pub const SIGNAL_GRACE: Duration = Duration::from_secs(2);

/// Set while `chat` waits for a line on stdin: a signal then ends the program at once.
pub static WAITING_FOR_INPUT: AtomicBool = AtomicBool::new(false);

/// The exit status for a run stopped by `signal`: 128 + its number.
pub fn interrupted_status(signal: usize) -> ExitStatus {
    ExitStatus::Interrupted(i32::try_from(signal).unwrap_or(0))
}

pub fn signal_name(signal: usize) -> &'static str {
    kiln_format::signal_name(i32::try_from(signal).unwrap_or(0))
}

/// Watch SIGINT, SIGTERM and SIGHUP on a thread of its own. The first raises `interrupt`, and
/// the run stops at its next token; if it has not ended within [`SIGNAL_GRACE`], or a second
/// signal comes, or `chat` is waiting for input, the watcher removes unfinished outputs and
/// exits with the signal's status itself.
pub fn watch_signals(interrupt: Interrupt) -> std::io::Result<()> {
    let mut signals = signal_hook::iterator::Signals::new(kiln_format::exit::INTERRUPT_SIGNALS)?;
    std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || {
            let Some(signal) = signals.forever().next() else {
                return;
            };
            let signal = usize::try_from(signal).unwrap_or(0);
            interrupt.raise(signal);
            let deadline = Instant::now() + SIGNAL_GRACE;
            while Instant::now() < deadline && !WAITING_FOR_INPUT.load(Ordering::SeqCst) {
                if signals.pending().next().is_some() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            if WAITING_FOR_INPUT.load(Ordering::SeqCst) {
                eprintln!();
            }
            eprintln!("kiln-run: interrupted by {}", signal_name(signal));
            kiln_format::remove_pending_outputs();
            std::process::exit(i32::from(interrupted_status(signal).code()));
        })?;
    Ok(())
}
