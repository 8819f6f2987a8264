//! The embedded log: segment files per partition under one directory, records framed with
//! magic, version, length and checksum (`entry`), appends made durable together by one
//! writer thread (`writer`, group commit), torn tails found and cut at open (`recovery`).
//!
//! ```text
//! DIR/log.json                    {"format": 1, "partitions": N}
//! DIR/journal.wal                 the commit journal (journal.rs)
//! DIR/p0000/00000000000000000000.seg   records from offset 0
//! DIR/p0000/00000000000000052311.seg   records from offset 52311, and so on
//! ```

mod entry;
mod journal;
mod recovery;
mod segment;
mod writer;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use async_trait::async_trait;

use super::{Log, LogError, Offset, Record};
pub use journal::Replay;
pub use recovery::{OpenReport, Truncation};
use segment::Partition;

/// What to do at open with a partition whose last segment ends inside a record (the process
/// died during an append) or with bytes that are not a record.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Recovery {
    /// Cut the last segment back to its last whole record, and report how many bytes were
    /// dropped. Those bytes were never acknowledged: an append returns only after a sync.
    #[default]
    TruncateTornTail,
    /// Refuse to open.
    Strict,
    /// Open to read, changing nothing: nothing is created or cut (a torn tail, a record
    /// another process is writing now, is left out), the commit journal is not replayed,
    /// and appends and deletes fail with [`LogError::ReadOnly`]. Reads see each partition
    /// as it was at open. For a log another process may be writing (`rewind inspect`).
    /// Records that only the commit journal holds (after a power loss, until a writer
    /// opens the log again) are not seen.
    ReadOnly,
}

/// How a [`FileLog`] is opened.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FileLogOptions {
    /// Partitions of a new log; an existing log must have been created with as many.
    pub partitions: u32,
    /// A segment is rolled when the next record would take it past this size.
    pub segment_bytes: u64,
    /// When the commit journal reaches this size, the partitions it covers are synced and
    /// it is emptied.
    pub journal_bytes: u64,
    pub recovery: Recovery,
    /// What the records hold, named in a new log's `log.json` and checked at every open:
    /// a log of another kind, or of a newer format, is refused. `None`: not checked.
    pub contents: Option<Contents>,
}

/// What a log's records hold: their kind, and the format this build writes them in (the
/// newest it reads). A log written before its contents were named holds format 1.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Contents {
    pub kind: &'static str,
    pub format: u32,
}

impl Default for FileLogOptions {
    fn default() -> Self {
        Self {
            partitions: 8,
            segment_bytes: 64 << 20,
            journal_bytes: 16 << 20,
            recovery: Recovery::default(),
            contents: None,
        }
    }
}

/// What the writer thread and readers share.
#[derive(Debug)]
struct Shared {
    dir: PathBuf,
    options: FileLogOptions,
    partitions: Vec<Mutex<Partition>>,
}

impl Shared {
    fn partition(&self, partition: u32) -> Result<MutexGuard<'_, Partition>, LogError> {
        let slot = self
            .partitions
            .get(partition as usize)
            .ok_or(LogError::NoSuchPartition {
                partition,
                partitions: self.options.partitions,
            })?;
        Ok(slot.lock().unwrap_or_else(|poisoned| poisoned.into_inner()))
    }
}

/// The embedded, file-backed [`Log`].
#[derive(Debug)]
pub struct FileLog {
    shared: Arc<Shared>,
    /// `None` for a log opened to read only.
    writer: Option<writer::Writer>,
}

impl FileLog {
    /// Opens the log in `dir`, creating it when it does not exist, and recovers every
    /// partition as `options.recovery` says. The report says what recovery dropped.
    pub fn open(dir: &Path, options: FileLogOptions) -> Result<(Self, OpenReport), LogError> {
        let (mut partitions, mut report) = recovery::open(dir, options)?;
        let journal = if options.recovery == Recovery::ReadOnly {
            None
        } else {
            let (journal, replay) = journal::open(dir, &mut partitions)?;
            report.journal = replay;
            Some(journal)
        };
        let shared = Arc::new(Shared {
            dir: dir.to_owned(),
            options,
            partitions: partitions.into_iter().map(Mutex::new).collect(),
        });
        let writer = match journal {
            Some(journal) => Some(writer::Writer::start(Arc::clone(&shared), journal)?),
            None => None,
        };
        Ok((Self { shared, writer }, report))
    }

    fn writer(&self) -> Result<&writer::Writer, LogError> {
        self.writer.as_ref().ok_or_else(|| LogError::ReadOnly {
            path: self.shared.dir.display().to_string(),
        })
    }

    /// The partition count of the log in `dir`, or `None` when there is no log there.
    pub fn partitions_in(dir: &Path) -> Result<Option<u32>, LogError> {
        recovery::partitions_in(dir)
    }

    pub fn dir(&self) -> &Path {
        &self.shared.dir
    }
}

#[async_trait]
impl Log for FileLog {
    fn partitions(&self) -> u32 {
        self.shared.options.partitions
    }

    fn max_record(&self, _partition: u32) -> usize {
        entry::MAX_PAYLOAD
    }

    async fn append(&self, partition: u32, payload: Vec<u8>) -> Result<Offset, LogError> {
        if payload.len() > entry::MAX_PAYLOAD {
            return Err(LogError::TooLarge {
                size: payload.len(),
                max: entry::MAX_PAYLOAD,
            });
        }
        // Fails here, not in the writer thread, when the partition does not exist.
        drop(self.shared.partition(partition)?);
        self.writer()?.append(partition, payload).await
    }

    async fn append_many(&self, records: Vec<(u32, Vec<u8>)>) -> Result<Vec<Offset>, LogError> {
        for (partition, payload) in &records {
            if payload.len() > entry::MAX_PAYLOAD {
                return Err(LogError::TooLarge {
                    size: payload.len(),
                    max: entry::MAX_PAYLOAD,
                });
            }
            drop(self.shared.partition(*partition)?);
        }
        self.writer()?.append_many(records).await
    }

    async fn read(
        &self,
        partition: u32,
        from: Offset,
        max: usize,
    ) -> Result<Vec<Record>, LogError> {
        let plan = self
            .shared
            .partition(partition)?
            .plan_read(partition, from, max)?;
        tokio::task::spawn_blocking(move || plan.execute())
            .await
            .map_err(|e| LogError::Io {
                context: "reading the log".to_owned(),
                source: std::io::Error::other(e),
            })?
    }

    async fn bounds(&self, partition: u32) -> Result<(Offset, Offset), LogError> {
        let p = self.shared.partition(partition)?;
        Ok((p.start(), p.durable_end))
    }

    async fn delete_below(&self, partition: u32, offset: Offset) -> Result<(), LogError> {
        self.writer()?;
        self.shared.partition(partition)?.delete_below(offset)
    }
}

#[cfg(test)]
mod tests;
