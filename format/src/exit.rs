//! The exit statuses of every Kiln program, and their interrupt handling.
//!
//! One definition so that the four programs cannot drift apart: scripts and CI read `1` as
//! "the numbers (or the checksums) are wrong" and `2` as "the run could not be done", and
//! mixing the two hides a corrupt model behind a "verification failed".
//!
//! The rule for an interrupted run: **128 + the signal's number** (SIGHUP 129, SIGINT 130,
//! SIGTERM 143), after the temporary files of unfinished outputs are removed. It is the status
//! a shell reports for a process that signal ended, so a script sees the same number whether
//! the program cleaned up first or not, and can tell a Ctrl-C from a `kill` or a closed
//! terminal. [`ExitStatus::Interrupted`] carries the signal and [`ExitStatus::code`] applies
//! the rule; `kiln-run`'s own signal watcher and [`install_interrupt_handler`] both use it.

use std::process::ExitCode;

/// SIGHUP's number on every Unix: the terminal closed.
pub const SIGHUP: i32 = 1;
/// SIGINT's number on every Unix: Ctrl-C.
pub const SIGINT: i32 = 2;
/// SIGTERM's number on every Unix: `kill`, a service manager stopping the program.
pub const SIGTERM: i32 = 15;

/// The signals every Kiln program handles by removing unfinished outputs and exiting with
/// [`ExitStatus::Interrupted`].
pub const INTERRUPT_SIGNALS: [i32; 3] = [SIGHUP, SIGINT, SIGTERM];

/// How a Kiln program ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExitStatus {
    /// The job was done (also when stdout was closed early, as `| head` does).
    Success,
    /// A verification ran and failed: a checksum mismatch found by `inspect --verify`, a
    /// `kiln-verify` threshold not met. Only an explicit check ends with this status.
    VerificationFailed,
    /// Bad input (arguments, a missing, corrupt or unsupported file, a model whose data fails
    /// its checksums while being used) or an I/O error (full disk, unreadable file).
    Error,
    /// Interrupted by the signal of this number (one of [`INTERRUPT_SIGNALS`]); unfinished
    /// outputs were removed. Exits with 128 + the number.
    Interrupted(i32),
}

impl ExitStatus {
    /// The process exit status: 0, 1, 2, or 128 + the signal's number (capped at 255, which
    /// no handled signal reaches).
    pub fn code(self) -> u8 {
        match self {
            ExitStatus::Success => 0,
            ExitStatus::VerificationFailed => 1,
            ExitStatus::Error => 2,
            ExitStatus::Interrupted(signal) => {
                u8::try_from(128i64 + i64::from(signal.max(0))).unwrap_or(u8::MAX)
            }
        }
    }
}

impl From<ExitStatus> for ExitCode {
    fn from(s: ExitStatus) -> ExitCode {
        ExitCode::from(s.code())
    }
}

/// The name a message gives the signal `signal` ("SIGTERM").
pub fn signal_name(signal: i32) -> &'static str {
    match signal {
        SIGHUP => "SIGHUP",
        SIGINT => "SIGINT",
        SIGTERM => "SIGTERM",
        _ => "a signal",
    }
}

/// Install the handler `kiln-convert`, `kiln-quantize` and `kiln-verify` use for SIGINT,
/// SIGTERM and SIGHUP: on the first of them, print `PROGRAM: interrupted by SIGNAL`, remove
/// the temporary files of unfinished outputs ([`crate::remove_pending_outputs`]), then exit
/// with [`ExitStatus::Interrupted`]. The signals are received on a thread of its own (not in
/// a signal handler), so the clean-up may allocate and take locks.
///
/// Called once, from a program's `main`: libraries install no handlers. Failing to install it
/// only loses the clean-up, so the error is ignored. Outside Unix nothing is installed.
pub fn install_interrupt_handler(program: &'static str) {
    #[cfg(unix)]
    {
        let Ok(mut signals) = signal_hook::iterator::Signals::new(INTERRUPT_SIGNALS) else {
            return;
        };
        let _ = std::thread::Builder::new()
            .name("signals".into())
            .spawn(move || {
                if let Some(signal) = signals.forever().next() {
                    eprintln!("{program}: interrupted by {}", signal_name(signal));
                    crate::remove_pending_outputs();
                    std::process::exit(i32::from(ExitStatus::Interrupted(signal).code()));
                }
            });
    }
    #[cfg(not(unix))]
    let _ = program;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_interrupted_run_exits_with_128_plus_the_signal_number() {
        for (signal, code) in [(SIGHUP, 129), (SIGINT, 130), (SIGTERM, 143)] {
            assert_eq!(ExitStatus::Interrupted(signal).code(), code);
        }
        assert_eq!(ExitStatus::Interrupted(500).code(), 255);
        assert_eq!(ExitStatus::Error.code(), 2);
    }

    #[cfg(unix)]
    #[test]
    fn the_signal_numbers_are_the_platform_s() {
        use signal_hook::consts as c;
        assert_eq!(INTERRUPT_SIGNALS, [c::SIGHUP, c::SIGINT, c::SIGTERM]);
    }
}
