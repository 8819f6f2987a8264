//! The log: an append-only, partitioned, durable byte log with offsets.
//!
//! [`FileLog`] is the embedded default (segment files on local disk, group commit);
//! [`MemoryLog`] is its in-memory twin. Every implementation passes the suite in
//! [`conformance`].

#[cfg(any(test, feature = "testing"))]
pub mod conformance;
mod file;
#[cfg(feature = "jetstream")]
pub(crate) mod jetstream;
mod memory;

use async_trait::async_trait;

pub use file::{Contents, FileLog, FileLogOptions, OpenReport, Recovery, Truncation};
#[cfg(feature = "jetstream")]
pub use jetstream::{
    Authority, CONSUMER_WITHIN, IN_FLIGHT, JetStreamLog, NatsAuth, NatsConnect, NatsTls,
    PER_MESSAGE, RETRY_FOR, StreamSpec, connect as connect_nats,
};
pub use memory::MemoryLog;

/// A record's position in its partition: 0 for the first record ever appended, and higher
/// for each record after it: one more in the embedded logs; a remote log may leave gaps
/// (JetStream: where a fence is). Offsets are never reused, also after retention.
pub type Offset = u64;

/// One record read back from a partition.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    pub offset: Offset,
    pub payload: Vec<u8>,
}

/// Why a log operation failed.
#[derive(Debug, thiserror::Error)]
pub enum LogError {
    #[error("partition {partition} does not exist: the log has {partitions}")]
    NoSuchPartition { partition: u32, partitions: u32 },
    #[error(
        "partition {partition}: offset {offset} is outside what the log holds, [{start}, {end})"
    )]
    OutOfRange {
        partition: u32,
        offset: Offset,
        start: Offset,
        end: Offset,
    },
    #[error("{path}: {message}")]
    Corrupt { path: String, message: String },
    #[error("{context}: {source}")]
    Io {
        context: String,
        source: std::io::Error,
    },
    #[error(
        "{path} was created with {on_disk} partitions, not {asked}: open it with {on_disk}, or \
         start with an empty state directory"
    )]
    PartitionCount {
        path: String,
        on_disk: u32,
        asked: u32,
    },
    #[error("the log is closed")]
    Closed,
    #[error("{path} is open to read only")]
    ReadOnly { path: String },
    #[error(
        "{stream}: fenced: another host holds this partition now, and this one may no longer \
         write to it"
    )]
    Fenced { stream: String },
    #[error("record of {size} bytes is larger than the {max} a record may hold")]
    TooLarge { size: usize, max: usize },
    #[error(
        "stream {stream} was made {made} group commit, and is opened {opened}: its offsets \
         are counted the other way (open it {made} group commit, or use another stream)",
        made = if *group_commit { "with" } else { "without" },
        opened = if *group_commit { "without" } else { "with" },
    )]
    StreamMade { stream: String, group_commit: bool },
    #[error(
        "stream {stream} exists with {field} {found}, where this host asks for {wanted}: it \
         was made by another configuration (delete it, or start with the one that made it)"
    )]
    StreamConflict {
        stream: String,
        field: &'static str,
        wanted: String,
        found: String,
    },
    #[error(
        "stream {stream} cannot be made: its subject {subject} belongs to stream {holder} \
         (use another prefix, or delete {holder})"
    )]
    SubjectsTaken {
        stream: String,
        subject: String,
        holder: String,
    },
}

/// An append-only, partitioned, durable log.
///
/// The number of partitions is fixed when the log is created. Appends to one partition are
/// totally ordered; appends to different partitions are independent.
#[async_trait]
pub trait Log: Send + Sync + std::fmt::Debug {
    /// How many partitions the log has; partitions are numbered from 0.
    fn partitions(&self) -> u32;

    /// The largest payload an append to `partition` (an existing one) takes. An append, or
    /// an [`append_many`](Self::append_many), holding a longer payload fails with
    /// [`LogError::TooLarge`] and writes nothing: a caller may then write something smaller
    /// in its place.
    fn max_record(&self, partition: u32) -> usize;

    /// Appends `payload` to `partition` and returns its offset.
    ///
    /// Returns only once the record is durable (for the file log: its bytes are synced to
    /// disk). Concurrent appends to one partition get increasing offsets in the order the
    /// log took them; the log may make them durable together (group commit). On `Err` the
    /// record may or may not be in the log: a reader may see it later.
    async fn append(&self, partition: u32, payload: Vec<u8>) -> Result<Offset, LogError>;

    /// Appends each `(partition, payload)` as [`append`](Self::append) would, and returns
    /// their offsets in the same order, once all of them are durable. The log may make them
    /// durable together. On `Err`, any of them may or may not be in the log.
    async fn append_many(&self, records: Vec<(u32, Vec<u8>)>) -> Result<Vec<Offset>, LogError> {
        for (partition, payload) in &records {
            let max = self.max_record(*partition);
            if payload.len() > max {
                return Err(LogError::TooLarge {
                    size: payload.len(),
                    max,
                });
            }
        }
        let mut offsets = Vec::with_capacity(records.len());
        for (partition, payload) in records {
            offsets.push(self.append(partition, payload).await?);
        }
        Ok(offsets)
    }

    /// Reads up to `max` records of `partition` from offset `from`, in offset order.
    ///
    /// Returns only durable records. An empty result means no record follows `from` (it is
    /// the end, or only a gap is left before the end). Fails with
    /// [`LogError::OutOfRange`] when `from` is below the partition's start (retention
    /// deleted it) or past its end.
    async fn read(&self, partition: u32, from: Offset, max: usize)
    -> Result<Vec<Record>, LogError>;

    /// The partition's `[start, end)`: the first offset it still holds and the offset the
    /// next append will get. `start == end` when it holds nothing.
    async fn bounds(&self, partition: u32) -> Result<(Offset, Offset), LogError>;

    /// Retention: deletes whole segments of `partition` whose records are all below
    /// `offset`. Records at or above `offset` stay readable; records below it may stay too
    /// (a segment is deleted only as a whole). Offsets of later appends are unaffected.
    async fn delete_below(&self, partition: u32, offset: Offset) -> Result<(), LogError>;
}

/// A log that keeps something alive as long as it lives: the temporary directory a file log
/// is in, the test server a remote log talks to. Every call goes to `log`.
#[derive(Debug)]
pub struct Guarded<G: std::fmt::Debug + Send + Sync> {
    log: Box<dyn Log>,
    _guard: G,
}

impl<G: std::fmt::Debug + Send + Sync> Guarded<G> {
    pub fn new(log: impl Log + 'static, guard: G) -> Self {
        Self {
            log: Box::new(log),
            _guard: guard,
        }
    }
}

#[async_trait]
impl<G: std::fmt::Debug + Send + Sync> Log for Guarded<G> {
    fn partitions(&self) -> u32 {
        self.log.partitions()
    }
    fn max_record(&self, partition: u32) -> usize {
        self.log.max_record(partition)
    }
    async fn append(&self, partition: u32, payload: Vec<u8>) -> Result<Offset, LogError> {
        self.log.append(partition, payload).await
    }
    async fn append_many(&self, records: Vec<(u32, Vec<u8>)>) -> Result<Vec<Offset>, LogError> {
        self.log.append_many(records).await
    }
    async fn read(
        &self,
        partition: u32,
        from: Offset,
        max: usize,
    ) -> Result<Vec<Record>, LogError> {
        self.log.read(partition, from, max).await
    }
    async fn bounds(&self, partition: u32) -> Result<(Offset, Offset), LogError> {
        self.log.bounds(partition).await
    }
    async fn delete_below(&self, partition: u32, offset: Offset) -> Result<(), LogError> {
        self.log.delete_below(partition, offset).await
    }
}
