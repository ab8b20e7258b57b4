//! Opening and reading the files a program is given, bounded.
//!
//! Every path a user names is untrusted in two ways the `.kiln` checks do not cover: it may
//! not be a file at all (`/dev/zero` reads forever, a FIFO nobody writes to blocks `open` and
//! then `read` forever, a socket cannot be opened at all, a directory fails late), and it may
//! be far larger than the job needs (a 40 MB "calibration text" tokenized whole).
//! [`open_regular`] refuses anything but a regular file without ever blocking, naming what
//! the path is (the open is non-blocking, then the opened handle is checked, so no swap
//! between a check and the open can slip a FIFO in), and [`read_bounded`] reads at most a
//! stated number of bytes, refusing a file over it before allocating.

use std::fs::File;
use std::io::Read;
use std::path::Path;

use crate::error::{FormatError, Result};

/// Open `path` for reading, refusing anything that is not a regular file (a directory, a FIFO,
/// a socket, a device such as `/dev/zero`) with [`FormatError::NotAFile`] naming it and what it
/// should be (`expected`, a noun phrase read after "the": "calibration text", "importance
/// file"). Never blocks: on Linux the open itself is
/// non-blocking, so a FIFO without a writer is refused at once instead of hanging.
pub fn open_regular(path: &Path, expected: &'static str) -> Result<File> {
    let not_a_file = |kind: &std::fs::FileType| FormatError::NotAFile {
        file: path.display().to_string(),
        what: describe(kind),
        expected,
    };
    // Opening a socket fails ("No such device or address"): say what the path is instead.
    let file = open_nonblocking(path).map_err(|e| match std::fs::metadata(path) {
        Ok(m) if !m.is_file() => not_a_file(&m.file_type()),
        _ => FormatError::io(path, "cannot open", e),
    })?;
    let kind = file
        .metadata()
        .map_err(|e| FormatError::io(path, "cannot inspect", e))?
        .file_type();
    if !kind.is_file() {
        return Err(not_a_file(&kind));
    }
    Ok(file)
}

/// Read all of `path`, a regular file of at most `limit` bytes (`expected` names what it
/// should hold, for the error). A larger file is refused by its size before anything is
/// allocated, and the read itself stops at `limit + 1` bytes, so a file that grows while it
/// is read is refused too.
pub fn read_bounded(path: &Path, limit: u64, expected: &'static str) -> Result<Vec<u8>> {
    let file = open_regular(path, expected)?;
    let size = file
        .metadata()
        .map_err(|e| FormatError::io(path, "cannot inspect", e))?
        .len();
    let too_large = |size: u64| FormatError::InputTooLarge {
        file: path.display().to_string(),
        what: expected,
        size,
        limit,
    };
    if size > limit {
        return Err(too_large(size));
    }
    let mut bytes = Vec::with_capacity(size as usize);
    file.take(limit + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| FormatError::io(path, "cannot read", e))?;
    if bytes.len() as u64 > limit {
        return Err(too_large(bytes.len() as u64));
    }
    Ok(bytes)
}

/// [`read_bounded`], then UTF-8: the error names the file and the byte offset of the first
/// invalid sequence.
pub fn read_text_bounded(path: &Path, limit: u64, expected: &'static str) -> Result<String> {
    let bytes = read_bounded(path, limit, expected)?;
    String::from_utf8(bytes).map_err(|e| FormatError::NotUtf8 {
        file: path.display().to_string(),
        what: expected,
        offset: e.utf8_error().valid_up_to(),
    })
}

#[cfg(target_os = "linux")]
fn open_nonblocking(path: &Path) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(rustix::fs::OFlags::NONBLOCK.bits() as i32)
        .open(path)
}

#[cfg(not(target_os = "linux"))]
fn open_nonblocking(path: &Path) -> std::io::Result<File> {
    // Without a non-blocking open, look first: only a FIFO swapped in between the two calls
    // could still block.
    let meta = std::fs::metadata(path)?;
    if !meta.is_file() {
        return Err(std::io::Error::other(format!(
            "is {}, not a regular file",
            describe(&meta.file_type())
        )));
    }
    File::open(path)
}

fn describe(kind: &std::fs::FileType) -> &'static str {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if kind.is_fifo() {
            return "a FIFO (named pipe)";
        }
        if kind.is_char_device() || kind.is_block_device() {
            return "a device";
        }
        if kind.is_socket() {
            return "a socket";
        }
    }
    if kind.is_dir() {
        "a directory"
    } else {
        "not a regular file"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_a_file_within_its_limit() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.txt");
        std::fs::write(&p, "hello").unwrap();
        assert_eq!(read_bounded(&p, 5, "text").unwrap(), b"hello");
        assert_eq!(read_text_bounded(&p, 100, "text").unwrap(), "hello");
    }

    #[test]
    fn refuses_a_file_over_its_limit() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.txt");
        std::fs::write(&p, "hello!").unwrap();
        let e = read_bounded(&p, 5, "calibration text")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("t.txt") && e.contains("6 bytes") && e.contains("5"),
            "{e}"
        );
    }

    #[test]
    fn refuses_a_directory() {
        let dir = tempfile::tempdir().unwrap();
        let e = read_bounded(dir.path(), 5, "text").unwrap_err().to_string();
        assert!(e.contains("a directory"), "{e}");
    }

    #[cfg(unix)]
    #[test]
    fn refuses_a_device_without_reading_it() {
        let e = read_bounded(Path::new("/dev/zero"), 1 << 40, "importance file")
            .unwrap_err()
            .to_string();
        assert!(e.contains("/dev/zero") && e.contains("a device"), "{e}");
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn refuses_a_fifo_without_blocking() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("fifo");
        let made = std::process::Command::new("mkfifo").arg(&p).status();
        if !matches!(made, Ok(s) if s.success()) {
            panic!("mkfifo failed: {made:?}");
        }
        let e = read_bounded(&p, 10, "text").unwrap_err().to_string();
        assert!(e.contains("FIFO"), "{e}");
    }

    #[cfg(unix)]
    #[test]
    fn refuses_a_socket_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("sock");
        let _listener = std::os::unix::net::UnixListener::bind(&p).unwrap();
        let e = read_bounded(&p, 10, "importance file")
            .unwrap_err()
            .to_string();
        assert!(e.contains("is a socket, not a file"), "{e}");
        assert!(!e.contains("os error"), "{e}");
    }

    #[test]
    fn names_the_first_invalid_utf8_byte() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.txt");
        std::fs::write(&p, b"ab\xffcd").unwrap();
        let e = read_text_bounded(&p, 100, "text").unwrap_err().to_string();
        assert!(e.contains("byte 2"), "{e}");
    }
}
