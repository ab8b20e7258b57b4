//! The exit statuses of every Kiln program, and their interrupt handling.
//!
//! One definition so that the four programs cannot drift apart: scripts and CI read `1` as
//! "the numbers (or the checksums) are wrong" and `2` as "the run could not be done", and
//! mixing the two hides a corrupt model behind a "verification failed".

use std::process::ExitCode;

/// How a Kiln program ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum ExitStatus {
    /// The job was done (also when stdout was closed early, as `| head` does).
    Success = 0,
    /// A verification ran and failed: a checksum mismatch found by `inspect --verify`, a
    /// `kiln-verify` threshold not met. Only an explicit check ends with this status.
    VerificationFailed = 1,
    /// Bad input (arguments, a missing, corrupt or unsupported file, a model whose data fails
    /// its checksums while being used) or an I/O error (full disk, unreadable file).
    Error = 2,
    /// Interrupted by SIGINT, SIGTERM or SIGHUP; unfinished outputs were removed.
    Interrupted = 130,
}

impl From<ExitStatus> for ExitCode {
    fn from(s: ExitStatus) -> ExitCode {
        ExitCode::from(s as u8)
    }
}

/// Install the handler every program uses for SIGINT, SIGTERM and SIGHUP: remove the
/// temporary files of unfinished outputs ([`crate::remove_pending_outputs`]), then exit with
/// [`ExitStatus::Interrupted`]. Called once, from a program's `main`: libraries install no
/// handlers. Failing to install it (a handler already set) only loses the clean-up, so the
/// error is ignored.
pub fn install_interrupt_handler() {
    let _ = ctrlc::set_handler(|| {
        crate::remove_pending_outputs();
        std::process::exit(ExitStatus::Interrupted as i32);
    });
}
