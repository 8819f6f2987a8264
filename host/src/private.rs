//! Files and directories only this user may read or write.
//!
//! Directories are made 0700 and files 0600. A file is written whole or not at all: into a
//! temporary file beside it with a random name, created exclusively (`O_EXCL`, so nothing
//! planted under a predictable name is written through), synced, renamed into place, and
//! the directory synced. What was written by someone else, or can be written by others, is
//! not trusted: [`check`] says so.

use std::io::Write as _;
use std::os::unix::fs::{DirBuilderExt as _, MetadataExt as _, PermissionsExt as _};
use std::path::Path;

/// Makes `dir` and any missing parents, each 0700. A directory that exists is left as it is.
pub fn create_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
}

/// Makes `dir` (as [`create_dir`]) and, when it exists already, takes every permission
/// from group and others: a state directory holds tokens' hashes, secrets' names and
/// recorded answers.
pub fn create_private_dir(dir: &Path) -> std::io::Result<()> {
    create_dir(dir)?;
    let metadata = std::fs::metadata(dir)?;
    let mode = metadata.permissions().mode();
    if mode & 0o077 != 0 {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode & 0o700))?;
    }
    Ok(())
}

/// Writes `bytes` to `path` atomically, 0600: readers see the old file or the new one,
/// never part of one, also after a crash. A crash can leave a temporary file (`.tmp-*`)
/// beside it, which nothing reads.
pub fn write(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    write_staged(path, bytes, || {})
}

/// [`write`], calling `staged` once the bytes are durable under the temporary name and
/// before they are renamed into place: the crash kit stops a run there.
pub fn write_staged(path: &Path, bytes: &[u8], staged: impl FnOnce()) -> std::io::Result<()> {
    let (dir, temp) = written_beside(path, bytes)?;
    staged();
    temp.persist(path).map_err(|e| e.error)?;
    std::fs::File::open(dir)?.sync_all()
}

/// Writes `bytes` to `path` as [`write`] does, unless `path` exists: then leaves it as it
/// is and returns `false`. Of two writers at once, one writes and the other is told.
pub fn write_new(path: &Path, bytes: &[u8]) -> std::io::Result<bool> {
    let (dir, temp) = written_beside(path, bytes)?;
    match temp.persist_noclobber(path) {
        Ok(_) => {}
        Err(e) if e.error.kind() == std::io::ErrorKind::AlreadyExists => return Ok(false),
        Err(e) => return Err(e.error),
    }
    std::fs::File::open(dir)?.sync_all()?;
    Ok(true)
}

/// A new temporary file in `path`'s directory (made if missing) holding `bytes`, synced.
fn written_beside<'a>(
    path: &'a Path,
    bytes: &[u8],
) -> std::io::Result<(&'a Path, tempfile::NamedTempFile)> {
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    create_dir(dir)?;
    let mut temp = tempfile::Builder::new()
        .prefix(".tmp-")
        .permissions(std::fs::Permissions::from_mode(0o600))
        .tempfile_in(dir)?;
    temp.write_all(bytes)?;
    temp.as_file().sync_all()?;
    Ok((dir, temp))
}

/// Whether `path` may be trusted: owned by this user and writable by no one else. A
/// symbolic link is judged by what it points to. `Err` says why not.
pub fn check(path: &Path) -> Result<(), String> {
    let metadata = std::fs::metadata(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let me = rustix::process::geteuid().as_raw();
    if metadata.uid() != me {
        return Err(format!(
            "{} belongs to user {}, not to this user ({me})",
            path.display(),
            metadata.uid()
        ));
    }
    let mode = metadata.permissions().mode();
    if mode & 0o022 != 0 {
        return Err(format!(
            "{} can be written by {} (mode {:o})",
            path.display(),
            if mode & 0o002 != 0 {
                "anyone"
            } else {
                "its group"
            },
            mode & 0o777
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_is_written_private_and_whole() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("a").join("b.json");
        write(&path, b"one").expect("write");
        write(&path, b"two").expect("write again");
        assert_eq!(std::fs::read(&path).expect("read"), b"two");
        let mode = std::fs::metadata(&path).expect("stat").permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let parent = std::fs::metadata(dir.path().join("a")).expect("stat");
        assert_eq!(parent.permissions().mode() & 0o777, 0o700);
        let left: Vec<_> = std::fs::read_dir(dir.path().join("a"))
            .expect("list")
            .map(|e| e.expect("entry").file_name())
            .collect();
        assert_eq!(left, ["b.json"], "no temporary file is left");
        assert_eq!(check(&path), Ok(()));
    }

    #[test]
    fn what_others_can_write_is_not_trusted_and_a_state_directory_is_made_private() {
        let dir = tempfile::tempdir().expect("tempdir");
        let open = dir.path().join("open");
        std::fs::create_dir(&open).expect("mkdir");
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).expect("chmod");
        let error = check(&open).expect_err("world-writable");
        assert!(error.contains("can be written by anyone"), "{error}");
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o775)).expect("chmod");
        let error = check(&open).expect_err("group-writable");
        assert!(error.contains("its group"), "{error}");
        create_private_dir(&open).expect("made private");
        let mode = std::fs::metadata(&open).expect("stat").permissions().mode();
        assert_eq!(mode & 0o777, 0o700);
        assert_eq!(check(&open), Ok(()));
    }
}
