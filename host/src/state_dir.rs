//! A directory that holds state: `rewind run --state DIR`, `rewind serve`'s state
//! directory, and each tenant's directory under it.
//!
//! ```text
//! DIR/lock           held (flock, exclusive) by the one process that writes DIR; it says
//!                    that process's id
//! DIR/incarnation    32 hex digits, drawn when DIR was first opened to write
//! ```
//!
//! One writer at a time: two processes writing one state log would hand out the same
//! sequence numbers and interleave their records. The lock is the operating system's, so
//! it goes with the process however it ends (SIGKILL included), and a stale lock file left
//! behind is simply taken. Readers (`rewind inspect`) do not take it.
//!
//! The incarnation names the state for the idempotency keys of its calls: same state, same
//! keys; new state (a wiped or new directory), new keys. See `store::Incarnation`.

use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read as _, Seek as _, Write as _};
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};

use crate::private;
use crate::store::Incarnation;

const LOCK: &str = "lock";
const INCARNATION: &str = "incarnation";

/// Why a state directory could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum StateDirError {
    #[error(
        "{dir} is in use by another rewind process ({holder}); one process writes a state \
         directory at a time: stop it, or give this one another directory"
    )]
    Locked { dir: String, holder: String },
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Corrupt { path: String, message: String },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> StateDirError + '_ {
    move |source| StateDirError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// A state directory this process writes: its lock is held until this is dropped.
#[derive(Debug)]
pub struct StateDir {
    path: PathBuf,
    incarnation: Incarnation,
    /// Holds the lock.
    _lock: File,
}

impl StateDir {
    /// Opens `path` to write, creating it when missing: takes its lock, or fails at once
    /// with [`StateDirError::Locked`] naming the process that holds it; then reads its
    /// incarnation, or makes one when there is none (a new directory, or one an earlier
    /// build wrote).
    pub fn open(path: &Path) -> Result<Self, StateDirError> {
        private::create_private_dir(path).map_err(io(path))?;
        let lock_path = path.join(LOCK);
        let mut lock = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(&lock_path)
            .map_err(io(&lock_path))?;
        match lock.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                let mut said = String::new();
                let _ = lock.read_to_string(&mut said);
                let holder = match said.trim() {
                    "" => "its process id not yet written".to_owned(),
                    pid => format!("pid {pid}"),
                };
                return Err(StateDirError::Locked {
                    dir: path.display().to_string(),
                    holder,
                });
            }
            Err(TryLockError::Error(e)) => return Err(io(&lock_path)(e)),
        }
        // Say who holds it, for the next one to name.
        lock.set_len(0).map_err(io(&lock_path))?;
        lock.rewind().map_err(io(&lock_path))?;
        writeln!(lock, "{}", std::process::id()).map_err(io(&lock_path))?;
        let incarnation = match read_incarnation(path)? {
            Some(incarnation) => incarnation,
            None => make_incarnation(path)?,
        };
        Ok(Self {
            path: path.to_owned(),
            incarnation,
            _lock: lock,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn incarnation(&self) -> Incarnation {
        self.incarnation
    }
}

/// The incarnation recorded in `dir`, without taking its lock; `None` when it has none.
pub fn read_incarnation(dir: &Path) -> Result<Option<Incarnation>, StateDirError> {
    let path = dir.join(INCARNATION);
    match std::fs::read_to_string(&path) {
        Ok(text) => text
            .trim()
            .parse()
            .map(Some)
            .map_err(|e: crate::store::BadIncarnation| StateDirError::Corrupt {
                path: path.display().to_string(),
                message: e.to_string(),
            }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(io(&path)(e)),
    }
}

/// The incarnation of `dir`, made now when it has none. For a directory whose writer holds
/// the lock of it, or of a directory above it (a server's tenants).
pub fn incarnation_of(dir: &Path) -> Result<Incarnation, StateDirError> {
    match read_incarnation(dir)? {
        Some(incarnation) => Ok(incarnation),
        None => make_incarnation(dir),
    }
}

/// Writes `incarnation` to `dir` (whole, private to the user), for a state that is to share
/// another's: the crash kit's runs of one agent.
pub fn set_incarnation(dir: &Path, incarnation: Incarnation) -> Result<(), StateDirError> {
    let path = dir.join(INCARNATION);
    private::write(&path, format!("{incarnation}\n").as_bytes()).map_err(io(&path))
}

fn make_incarnation(dir: &Path) -> Result<Incarnation, StateDirError> {
    let incarnation = Incarnation::random();
    set_incarnation(dir, incarnation)?;
    Ok(incarnation)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_writer_is_refused_naming_the_holder() {
        let dir = tempfile::tempdir().expect("tempdir");
        let first = StateDir::open(dir.path()).expect("the first writer");
        let error = StateDir::open(dir.path()).expect_err("a second writer");
        let message = error.to_string();
        assert!(
            message.contains(&format!("pid {}", std::process::id()))
                && message.contains(&dir.path().display().to_string()),
            "{message}"
        );
        drop(first);
        let again = StateDir::open(dir.path()).expect("free once the first is gone");
        assert_eq!(
            Some(again.incarnation()),
            read_incarnation(dir.path()).expect("read")
        );
    }

    #[test]
    fn a_directory_keeps_its_incarnation_and_a_new_one_gets_another() {
        let dir = tempfile::tempdir().expect("tempdir");
        let first = StateDir::open(dir.path()).expect("open").incarnation();
        let again = StateDir::open(dir.path()).expect("open").incarnation();
        assert_eq!(first, again);
        let other = tempfile::tempdir().expect("tempdir");
        assert_ne!(first, incarnation_of(other.path()).expect("made"));
    }

    #[test]
    fn a_damaged_incarnation_is_named() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join(INCARNATION), "not hex\n").expect("write");
        let message = StateDir::open(dir.path()).expect_err("damaged").to_string();
        assert!(
            message.contains("incarnation") && message.contains("32 hex digits"),
            "{message}"
        );
    }
}
