//! The commit journal: one file through which a batch that wrote to several partitions is
//! made durable with one fdatasync instead of one per partition.
//!
//! On ext4 an fdatasync costs about the same whatever it flushes, and syncs of different
//! files do not share a journal commit: eight partitions written in one batch cost eight
//! times one (BENCHMARKS.md). So the writer appends such a batch's records to their
//! partitions' segments without syncing them, writes the same records to the journal, and
//! syncs the journal alone. The segments are synced later, all at once, when the journal
//! has grown past its size and is emptied ([`FileLogOptions::journal_bytes`]).
//!
//! ```text
//! DIR/journal.wal    entries framed like records (entry.rs); each payload is
//!                    partition (u32 LE) | offset (u64 LE) | the record's payload
//! ```
//!
//! At open, after each partition's torn tail is cut, every journal entry at or past its
//! partition's end is written back to the partition (what a power loss took from the
//! unsynced segments), the partitions are synced and the journal emptied. An entry below
//! the end is already there. An entry past the end would leave a gap and is refused.
//!
//! [`FileLogOptions::journal_bytes`]: super::FileLogOptions::journal_bytes

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};

use super::entry::{self, Decoded};
use super::segment::{Partition, sync_dir};
use crate::log::{LogError, Offset};

pub(super) const FILE: &str = "journal.wal";

/// Bytes before a journaled record's payload: partition and offset.
const HEADER: usize = 12;

/// The open journal file; used by the writer thread only.
#[derive(Debug)]
pub(super) struct Journal {
    path: PathBuf,
    file: File,
    size: u64,
    /// Set when a write or sync failed: the journal is not used again until reopened.
    pub broken: bool,
}

fn io(context: String) -> impl FnOnce(std::io::Error) -> LogError {
    move |source| LogError::Io { context, source }
}

/// Appends the journal entry for `payload`, written at `offset` of `partition`, to `out`.
pub(super) fn frame_into(out: &mut Vec<u8>, partition: u32, offset: Offset, payload: &[u8]) {
    let mut header = [0u8; HEADER];
    header[..4].copy_from_slice(&partition.to_le_bytes());
    header[4..].copy_from_slice(&offset.to_le_bytes());
    entry::encode_into(out, &[&header, payload]);
}

impl Journal {
    /// Writes `frames` (from [`frame_into`]) and syncs them.
    pub fn commit(&mut self, frames: &[u8]) -> Result<(), LogError> {
        let result = self
            .file
            .write_all(frames)
            .and_then(|()| self.file.sync_data());
        match result {
            Ok(()) => {
                self.size += frames.len() as u64;
                Ok(())
            }
            Err(source) => {
                self.broken = true;
                Err(io(format!("writing {}", self.path.display()))(source))
            }
        }
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    /// Empties the journal. Every partition it covered must be synced first.
    pub fn reset(&mut self) -> Result<(), LogError> {
        let result = self.file.set_len(0).and_then(|()| self.file.sync_all());
        match result {
            Ok(()) => {
                self.size = 0;
                Ok(())
            }
            Err(source) => {
                self.broken = true;
                Err(io(format!("emptying {}", self.path.display()))(source))
            }
        }
    }
}

/// What replaying the journal at open did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Replay {
    /// Records written back to each partition.
    pub restored: BTreeMap<u32, u64>,
    /// Bytes at the journal's end that were not a whole entry (a batch whose sync did not
    /// finish, so never acknowledged), dropped.
    pub dropped_bytes: u64,
}

/// Opens the journal in `dir`, writes back to `partitions` what they lost, syncs them and
/// empties the journal.
pub(super) fn open(
    dir: &Path,
    partitions: &mut [Partition],
) -> Result<(Journal, Replay), LogError> {
    let path = dir.join(FILE);
    let existed = path.exists();
    let bytes = match std::fs::read(&path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        Err(e) => return Err(io(format!("reading {}", path.display()))(e)),
    };
    let mut replay = Replay::default();
    let mut at = 0;
    loop {
        let (payload, next) = match entry::decode(&bytes, at) {
            Decoded::Record { payload, next } => (payload, next),
            Decoded::End => break,
            Decoded::Torn | Decoded::Corrupt(_) => {
                replay.dropped_bytes = (bytes.len() - at) as u64;
                break;
            }
        };
        restore(&path, at, &bytes[payload], partitions, &mut replay)?;
        at = next;
    }
    for &partition in replay.restored.keys() {
        if let Some(p) = partitions.get_mut(partition as usize) {
            p.sync()?;
        }
    }
    if replay.dropped_bytes > 0 {
        tracing::warn!(
            path = %path.display(),
            dropped = replay.dropped_bytes,
            "the commit journal ends inside an entry never acknowledged; dropped"
        );
    }
    if !replay.restored.is_empty() {
        tracing::warn!(path = %path.display(), restored = ?replay.restored, "records restored from the commit journal");
    }
    let file = File::options()
        .create(true)
        .mode(0o600)
        .append(true)
        .open(&path)
        .map_err(io(format!("opening {}", path.display())))?;
    let mut journal = Journal {
        path,
        file,
        size: bytes.len() as u64,
        broken: false,
    };
    if !bytes.is_empty() {
        journal.reset()?;
    } else if !existed {
        sync_dir(dir)?;
    }
    Ok((journal, replay))
}

/// Writes one journal entry back to its partition when the partition lacks it.
fn restore(
    path: &Path,
    at: usize,
    entry: &[u8],
    partitions: &mut [Partition],
    replay: &mut Replay,
) -> Result<(), LogError> {
    let corrupt = |message: String| LogError::Corrupt {
        path: path.display().to_string(),
        message: format!("entry at byte {at}: {message}"),
    };
    let (header, payload) = entry
        .split_at_checked(HEADER)
        .ok_or_else(|| corrupt("shorter than its header".to_owned()))?;
    let partition = u32::from_le_bytes([header[0], header[1], header[2], header[3]]);
    let mut offset = [0u8; 8];
    offset.copy_from_slice(&header[4..]);
    let offset = Offset::from_le_bytes(offset);
    let count = partitions.len();
    let p = partitions.get_mut(partition as usize).ok_or_else(|| {
        corrupt(format!(
            "partition {partition}, but the log has {count} partitions"
        ))
    })?;
    let end = p.next_offset();
    if offset < end {
        return Ok(());
    }
    if offset > end {
        return Err(corrupt(format!(
            "offset {offset} of partition {partition}, but the partition ends at {end}: \
             records between them are missing"
        )));
    }
    let mut frame = Vec::with_capacity(entry::HEADER + payload.len());
    entry::encode_into(&mut frame, &[payload]);
    p.write(&frame, u64::MAX)?;
    *replay.restored.entry(partition).or_default() += 1;
    Ok(())
}
