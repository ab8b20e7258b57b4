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
        check_destination(&dest, overwrite)?;
        let dir = dest
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        let base = dest
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "out".into());
        remove_stale_temps(dir, &base);
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

/// Refuse a destination that exists and is not a regular file, even with `overwrite`: renaming
/// over a device node or a symlink's target directory would replace something that is not
/// Kiln's to replace (`-o /dev/full --force` once became a regular file). Without `overwrite`,
/// any existing destination is refused.
pub fn check_destination(dest: &Path, overwrite: bool) -> Result<()> {
    let label = || dest.display().to_string();
    match fs::symlink_metadata(dest) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(FormatError::io(dest, "cannot inspect the output path", e)),
        Ok(_) if !overwrite => Err(FormatError::AlreadyExists { file: label() }),
        Ok(m) if m.file_type().is_file() => Ok(()),
        // A symlink to a regular file is replaced by the new file, as `mv` would; a symlink to
        // anything else (or a dangling one) is refused like the thing it names.
        Ok(m) if m.file_type().is_symlink() => match fs::metadata(dest) {
            Ok(t) if t.is_file() => Ok(()),
            _ => Err(FormatError::NotARegularFile { file: label() }),
        },
        Ok(_) => Err(FormatError::NotARegularFile { file: label() }),
    }
}

/// Refuse an output that is one of `inputs`: the same path, another path to it (symlinks,
/// `..`), or a hard link to it. Every writer calls this before creating its output, so that
/// `--force` can never make a program destroy the file it is reading.
pub fn refuse_output_is_input<'a>(
    output: &Path,
    inputs: impl IntoIterator<Item = &'a Path>,
) -> Result<()> {
    let Ok(out_meta) = fs::metadata(output) else {
        return Ok(()); // a path that does not exist yet is no input
    };
    let out_canon = fs::canonicalize(output).ok();
    for input in inputs {
        let same_path = out_canon.is_some() && fs::canonicalize(input).ok() == out_canon;
        let same_inode = fs::metadata(input)
            .map(|m| same_inode(&m, &out_meta))
            .unwrap_or(false);
        if same_path || same_inode {
            return Err(FormatError::OutputIsInput {
                file: output.display().to_string(),
                input: input.display().to_string(),
            });
        }
    }
    Ok(())
}

/// Refuse a run whose outputs could destroy what it reads or each other: every output is
/// checked against every input ([`refuse_output_is_input`]: path, symlinks, `..`, hard links)
/// and against every other output (two names for one file, whether or not it exists yet).
///
/// The one check every program runs before writing anything, with the whole list of paths it
/// reads (model, texts, importance files, references) and writes (the model, saved importance,
/// saved logits), so that no flag combination and no `--force` lets one path overwrite
/// another.
pub fn refuse_clobbering(outputs: &[&Path], inputs: &[&Path]) -> Result<()> {
    for (i, out) in outputs.iter().enumerate() {
        refuse_output_is_input(out, inputs.iter().copied())?;
        for other in &outputs[..i] {
            if same_file_or_path(out, other) {
                return Err(FormatError::OutputsCollide {
                    file: out.display().to_string(),
                    other: other.display().to_string(),
                });
            }
        }
    }
    Ok(())
}

/// Whether two output paths name one file: the same inode if both exist, else the same
/// absolute path once the (existing) parent directory is resolved.
fn same_file_or_path(a: &Path, b: &Path) -> bool {
    if let (Ok(ma), Ok(mb)) = (fs::metadata(a), fs::metadata(b)) {
        return same_inode(&ma, &mb)
            || (fs::canonicalize(a).ok().is_some()
                && fs::canonicalize(a).ok() == fs::canonicalize(b).ok());
    }
    let resolve = |p: &Path| -> Option<PathBuf> {
        let name = p.file_name()?;
        let parent = match p.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        Some(fs::canonicalize(parent).ok()?.join(name))
    };
    match (resolve(a), resolve(b)) {
        (Some(x), Some(y)) => x == y,
        _ => a == b,
    }
}

#[cfg(unix)]
fn same_inode(a: &fs::Metadata, b: &fs::Metadata) -> bool {
    use std::os::unix::fs::MetadataExt;
    a.dev() == b.dev() && a.ino() == b.ino()
}

#[cfg(not(unix))]
fn same_inode(_a: &fs::Metadata, _b: &fs::Metadata) -> bool {
    false
}

/// The prefix of every temporary file made for `base`; the writer's process id follows it.
fn temp_prefix(base: &str) -> String {
    format!(".{base}.tmp-")
}

/// Delete temporary files for the same destination left by writers that no longer run (killed
/// by SIGKILL, or by a signal before this crate's handlers existed).
///
/// A temporary file's name carries its writer's process id; one whose process is gone
/// (`/proc/PID` absent) is stale. A live process with that id, whichever it is, keeps its file:
/// a reused id can only make a stale file outlive one more run, never remove a live one.
/// Only on Linux, where `/proc` answers the question; elsewhere nothing is removed.
fn remove_stale_temps(dir: &Path, base: &str) {
    if !cfg!(target_os = "linux") || !Path::new("/proc/self").exists() {
        return;
    }
    let prefix = temp_prefix(base);
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(&prefix)) else {
            continue;
        };
        let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        let is_file = entry.file_type().map(|t| t.is_file()).unwrap_or(false);
        if is_file && pid != std::process::id() && !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = fs::remove_file(entry.path());
        }
    }
}

fn create_temp(dir: &Path, base: &str) -> Result<(PathBuf, File)> {
    let pid = std::process::id();
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    for attempt in 0..100u32 {
        let tmp = dir.join(format!("{}{pid}-{nanos:x}-{attempt}", temp_prefix(base)));
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
    fn refuses_outputs_that_are_inputs_or_each_other() {
        let dir = tempfile::tempdir().unwrap();
        let model = dir.path().join("model.kiln");
        let text = dir.path().join("text.txt");
        fs::write(&model, b"m").unwrap();
        fs::write(&text, b"t").unwrap();
        let out = dir.path().join("out.kiln");
        let imp = dir.path().join("imp.safetensors");
        let inputs = [model.as_path(), text.as_path()];
        // Distinct paths pass, whether or not the outputs exist.
        refuse_clobbering(&[&out, &imp], &inputs).unwrap();
        // A second output that replaces an input (the input model, the calibration text).
        for victim in [&model, &text] {
            let e = refuse_clobbering(&[&out, victim], &inputs).unwrap_err();
            assert!(matches!(e, FormatError::OutputIsInput { .. }), "{e}");
        }
        // Two outputs naming one file that does not exist yet, through `..`.
        let alias = dir.path().join("sub").join("..").join("out.kiln");
        fs::create_dir(dir.path().join("sub")).unwrap();
        let e = refuse_clobbering(&[&out, &alias], &inputs).unwrap_err();
        assert!(matches!(e, FormatError::OutputsCollide { .. }), "{e}");
        // And through a hard link once they exist.
        fs::write(&out, b"o").unwrap();
        let link = dir.path().join("link");
        fs::hard_link(&out, &link).unwrap();
        let e = refuse_clobbering(&[&out, &link], &inputs).unwrap_err();
        assert!(matches!(e, FormatError::OutputsCollide { .. }), "{e}");
    }

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
    fn refuses_a_destination_that_is_not_a_regular_file_even_with_force() {
        let dir = tempfile::tempdir().unwrap();
        let sub = dir.path().join("sub");
        fs::create_dir(&sub).unwrap();
        for overwrite in [false, true] {
            let e = write_file_atomic(&sub, b"x", overwrite).unwrap_err();
            let want_not_regular = overwrite;
            assert_eq!(
                matches!(e, FormatError::NotARegularFile { .. }),
                want_not_regular,
                "{e}"
            );
        }
        assert!(sub.is_dir());
        #[cfg(unix)]
        {
            let e = write_file_atomic("/dev/null", b"x", true).unwrap_err();
            assert!(matches!(e, FormatError::NotARegularFile { .. }), "{e}");
            // A symlink to a regular file is replaced like the file.
            let target = dir.path().join("t.bin");
            fs::write(&target, b"old").unwrap();
            let link = dir.path().join("link.bin");
            std::os::unix::fs::symlink(&target, &link).unwrap();
            write_file_atomic(&link, b"new", true).unwrap();
            assert_eq!(fs::read(&link).unwrap(), b"new");
        }
    }

    #[test]
    fn output_is_input_through_other_names() {
        let dir = tempfile::tempdir().unwrap();
        let input = dir.path().join("in.kiln");
        fs::write(&input, b"data").unwrap();
        let other = dir.path().join("other.kiln");
        refuse_output_is_input(&other, [input.as_path()]).unwrap();
        fs::write(&other, b"x").unwrap();
        refuse_output_is_input(&other, [input.as_path()]).unwrap();
        let dotted = dir.path().join("sub/../in.kiln");
        fs::create_dir(dir.path().join("sub")).unwrap();
        let hard = dir.path().join("hard.kiln");
        fs::hard_link(&input, &hard).unwrap();
        for out in [&input, &dotted, &hard] {
            let e = refuse_output_is_input(out, [other.as_path(), input.as_path()]).unwrap_err();
            assert!(matches!(e, FormatError::OutputIsInput { .. }), "{e}");
        }
    }

    #[test]
    #[cfg(target_os = "linux")]
    fn stale_temporary_files_of_dead_writers_are_removed() {
        let dir = tempfile::tempdir().unwrap();
        let dest = dir.path().join("m.kiln");
        // A process id that cannot be running: above the kernel's pid_max limit (2^22).
        let stale = dir
            .path()
            .join(format!("{}{}-0-0", temp_prefix("m.kiln"), 1u32 << 23));
        let live = dir.path().join(format!(
            "{}{}-0-0",
            temp_prefix("m.kiln"),
            std::process::id()
        ));
        let other = dir
            .path()
            .join(format!("{}{}-0-0", temp_prefix("n.kiln"), 1u32 << 23));
        for p in [&stale, &live, &other] {
            fs::write(p, b"partial").unwrap();
        }
        write_file_atomic(&dest, b"x", false).unwrap();
        assert!(!stale.exists(), "a dead writer's file is removed");
        assert!(live.exists(), "a live writer's file is kept");
        assert!(other.exists(), "another destination's file is kept");
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
