//! Atomic file creation: a temporary file beside the destination, fsynced, then moved into
//! place (without replacing an existing file unless asked to), then the directory fsynced.
//!
//! Every file Kiln writes goes through [`AtomicFile`], so a crash, an error or Ctrl-C never
//! leaves a partial file under the destination's name: either the old state or the complete
//! new file. A file dropped before [`AtomicFile::commit`] deletes its temporary file, and
//! [`remove_pending_outputs`] lets a Ctrl-C handler do the same for every file in progress.

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use crate::error::{FormatError, Result};

/// Temporary files in progress, so an interrupt handler can remove them.
static PENDING: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// Delete the temporary files of every unfinished output in this process.
///
/// Meant for a Ctrl-C handler in a program's `main`, which then exits: libraries do not install
/// signal handlers themselves.
pub fn remove_pending_outputs() {
    let pending = PENDING.lock().unwrap_or_else(|e| e.into_inner());
    for p in pending.iter() {
        let _ = fs::remove_file(p);
    }
}

/// A file being written under a temporary name; [`AtomicFile::commit`] publishes it.
#[derive(Debug)]
pub struct AtomicFile {
    dest: PathBuf,
    tmp: PathBuf,
    file: File,
    overwrite: bool,
    committed: bool,
}

impl AtomicFile {
    /// Create the temporary file beside `dest`. Fails early if `dest` exists and `overwrite`
    /// is false.
    pub fn create(dest: impl AsRef<Path>, overwrite: bool) -> Result<AtomicFile> {
        let dest = dest.as_ref().to_path_buf();
        if !overwrite && dest.exists() {
            return Err(FormatError::AlreadyExists {
                file: dest.display().to_string(),
            });
        }
        let dir = dest
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        let base = dest
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "out".into());
        let (tmp, file) = create_temp(dir, &base)?;
        PENDING
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(tmp.clone());
        Ok(AtomicFile {
            dest,
            tmp,
            file,
            overwrite,
            committed: false,
        })
    }

    /// The open temporary file (read and write).
    pub fn file(&self) -> &File {
        &self.file
    }

    /// The temporary file's path (for error messages).
    pub fn tmp_path(&self) -> &Path {
        &self.tmp
    }

    /// The destination path.
    pub fn dest(&self) -> &Path {
        &self.dest
    }

    /// Fsync the file, move it into place and fsync the directory.
    ///
    /// On Linux the file's pages are then dropped from the page cache (they are on disk, so
    /// this is only a hint). The page cache holds a buffered write in folios no larger than
    /// the writes that made it, and Kiln writes in chunks of tens of kilobytes; read back
    /// instead (the reader asks for huge pages), the file comes in 2 MiB folios that a memory
    /// map uses as 2 MiB pages. Decoding SmolLM2 F16 on one thread streamed its weights ~10%
    /// faster that way (docs/BENCHMARKS.md), for a one-time read of the file on its first use.
    pub fn commit(mut self) -> Result<()> {
        self.file
            .sync_all()
            .map_err(|e| FormatError::io(&self.tmp, "cannot sync", e))?;
        #[cfg(target_os = "linux")]
        let _ = rustix::fs::fadvise(&self.file, 0, None, rustix::fs::Advice::DontNeed);
        self.publish()?;
        self.committed = true;
        self.forget_pending();
        Ok(())
    }

    fn publish(&self) -> Result<()> {
        let label = self.dest.display().to_string();
        if self.overwrite {
            fs::rename(&self.tmp, &self.dest)
                .map_err(|e| FormatError::io(&self.dest, "cannot move the output into place", e))?;
        } else {
            // A hard link fails if the destination appeared meanwhile: no silent replacement.
            match fs::hard_link(&self.tmp, &self.dest) {
                Ok(()) => {
                    let _ = fs::remove_file(&self.tmp);
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    return Err(FormatError::AlreadyExists { file: label });
                }
                Err(_) => {
                    // File systems without hard links: check, then rename.
                    if self.dest.exists() {
                        return Err(FormatError::AlreadyExists { file: label });
                    }
                    fs::rename(&self.tmp, &self.dest).map_err(|e| {
                        FormatError::io(&self.dest, "cannot move the output into place", e)
                    })?;
                }
            }
        }
        sync_parent_dir(&self.dest);
        Ok(())
    }

    fn forget_pending(&self) {
        let mut pending = PENDING.lock().unwrap_or_else(|e| e.into_inner());
        pending.retain(|p| p != &self.tmp);
    }
}

impl Drop for AtomicFile {
    fn drop(&mut self) {
        if !self.committed {
            let _ = fs::remove_file(&self.tmp);
            self.forget_pending();
        }
    }
}

/// Write `bytes` to `dest` atomically (temporary file, fsync, move into place).
pub fn write_file_atomic(dest: impl AsRef<Path>, bytes: &[u8], overwrite: bool) -> Result<()> {
    let out = AtomicFile::create(dest, overwrite)?;
    (&out.file)
        .write_all(bytes)
        .map_err(|e| FormatError::io(&out.tmp, "cannot write", e))?;
    out.commit()
}

fn create_temp(dir: &Path, base: &str) -> Result<(PathBuf, File)> {
    let pid = std::process::id();
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    for attempt in 0..100u32 {
        let tmp = dir.join(format!(".{base}.tmp-{pid}-{nanos:x}-{attempt}"));
        match OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&tmp)
        {
            Ok(f) => return Ok((tmp, f)),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(FormatError::io(&tmp, "cannot create a temporary file", e)),
        }
    }
    Err(FormatError::io(
        dir,
        "cannot create a temporary file",
        std::io::Error::new(std::io::ErrorKind::AlreadyExists, "100 names taken"),
    ))
}

#[cfg(unix)]
fn sync_parent_dir(path: &Path) {
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
}

#[cfg(not(unix))]
fn sync_parent_dir(_path: &Path) {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_atomically_and_refuses_to_clobber() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.bin");
        write_file_atomic(&p, b"one", false).unwrap();
        assert_eq!(fs::read(&p).unwrap(), b"one");
        let e = write_file_atomic(&p, b"two", false).unwrap_err();
        assert!(matches!(e, FormatError::AlreadyExists { .. }), "{e}");
        assert_eq!(fs::read(&p).unwrap(), b"one");
        write_file_atomic(&p, b"two", true).unwrap();
        assert_eq!(fs::read(&p).unwrap(), b"two");
        // No temporary files left behind.
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn dropped_without_commit_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("b.bin");
        {
            let f = AtomicFile::create(&p, false).unwrap();
            f.file().write_all(b"partial").unwrap();
        }
        assert!(!p.exists());
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 0);
    }
}
