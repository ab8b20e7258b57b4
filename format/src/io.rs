//! Positioned reads and writes, and the sha256 of a byte range of a file: the file access
//! every program shares.
//!
//! Positioned I/O (`pread`/`pwrite`) lets many threads read one source or write one output at
//! once without sharing a cursor, which is how conversion and quantization stream tensors in
//! parallel. One copy here, so a platform fix lands everywhere.

use std::fs::File;

use sha2::{Digest, Sha256};

/// Read exactly `buf.len()` bytes at `at` (an early end of file is `UnexpectedEof`).
#[cfg(unix)]
pub fn read_exact_at(file: &File, buf: &mut [u8], at: u64) -> std::io::Result<()> {
    std::os::unix::fs::FileExt::read_exact_at(file, buf, at)
}

/// Read exactly `buf.len()` bytes at `at` (an early end of file is `UnexpectedEof`).
#[cfg(windows)]
pub fn read_exact_at(file: &File, mut buf: &mut [u8], mut at: u64) -> std::io::Result<()> {
    use std::os::windows::fs::FileExt;
    while !buf.is_empty() {
        let n = file.seek_read(buf, at)?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        buf = &mut buf[n..];
        at += n as u64;
    }
    Ok(())
}

/// Write all of `bytes` at `at`.
#[cfg(unix)]
pub fn write_all_at(file: &File, bytes: &[u8], at: u64) -> std::io::Result<()> {
    std::os::unix::fs::FileExt::write_all_at(file, bytes, at)
}

/// Write all of `bytes` at `at`.
#[cfg(windows)]
pub fn write_all_at(file: &File, mut bytes: &[u8], mut at: u64) -> std::io::Result<()> {
    use std::os::windows::fs::FileExt;
    while !bytes.is_empty() {
        let n = file.seek_write(bytes, at)?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        bytes = &bytes[n..];
        at += n as u64;
    }
    Ok(())
}

/// Bytes read per positioned read while hashing: large enough to amortise the call, small
/// enough to stay in cache while it is hashed.
pub const HASH_READ_BYTES: usize = 512 << 10;

/// The sha256 of `len` bytes of `file` from `start`, read with positioned reads (the file's
/// cursor is untouched, so other threads may read it meanwhile).
pub fn sha256_range(file: &File, start: u64, len: u64) -> std::io::Result<[u8; 32]> {
    let mut h = Sha256::new();
    let mut buf = vec![0u8; HASH_READ_BYTES.min(usize::try_from(len).unwrap_or(usize::MAX))];
    let mut pos = 0u64;
    while pos < len {
        let n = (len - pos).min(buf.len() as u64) as usize;
        read_exact_at(file, &mut buf[..n], start + pos)?;
        h.update(&buf[..n]);
        pos += n as u64;
    }
    Ok(h.finalize().into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_range_hashes_as_its_bytes_do() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let data: Vec<u8> = (0..3 * HASH_READ_BYTES + 17)
            .map(|i| (i * 7) as u8)
            .collect();
        std::fs::write(&path, &data).unwrap();
        let f = File::open(&path).unwrap();
        for (start, len) in [(0, data.len()), (5, HASH_READ_BYTES + 3), (100, 0)] {
            let want: [u8; 32] = Sha256::digest(&data[start..start + len]).into();
            assert_eq!(sha256_range(&f, start as u64, len as u64).unwrap(), want);
        }
        let e = sha256_range(&f, 10, data.len() as u64).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof);
        let out = File::create(dir.path().join("g")).unwrap();
        write_all_at(&out, b"abc", 4).unwrap();
        assert_eq!(std::fs::read(dir.path().join("g")).unwrap(), b"\0\0\0\0abc");
    }
}
