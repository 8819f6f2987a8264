//! `LogCheckpoints`: checkpoints as records of one partition of a [`Log`].
//!
//! A checkpoint is JSON. One that fits in a record of the log ([`Log::max_record`]) is
//! saved as that record. A larger one is cut into parts, each a record `#ID INDEX\n` and
//! then its share of the JSON, appended before a head record,
//! `{"split":{"id":…,"first":…,"parts":…,"bytes":…}}`, that names them. The head (or the
//! whole record) is what makes a checkpoint exist, so a save is atomic exactly as that one
//! append is: parts whose head never came (a crash mid-save) are skipped by readers and
//! deleted by retention with the checkpoints before them. A checkpoint's size is so bound
//! only by memory, not by the log's largest record (on JetStream, the server's
//! `max_payload`).
//!
//! After each save, retention deletes the records before the first of the newest `keep`
//! checkpoints. The store knows where its checkpoints are (it reads them once, then notes
//! each save), so a save reads nothing back. On JetStream this is how checkpoints live in
//! the cluster instead of on a host's disk, and a fenced log makes a save by a host that
//! lost its partition fail.

use std::collections::VecDeque;
use std::sync::Arc;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use super::{Checkpoint, CheckpointError, CheckpointId, CheckpointStore};
use crate::log::{Log, Offset, Record};

/// Checkpoints in partition `partition` of `log`, which holds nothing else and which one
/// store writes at a time (on JetStream, the fenced holder's).
#[derive(Clone, Debug)]
pub struct LogCheckpoints {
    log: Arc<dyn Log>,
    partition: u32,
    /// Where the checkpoints the partition holds are, oldest first: read at the first save,
    /// then kept up to date by each one.
    saved: Arc<tokio::sync::Mutex<Option<VecDeque<Saved>>>>,
}

/// Where one checkpoint is in the partition.
#[derive(Clone, Copy, Debug)]
struct Saved {
    /// Its first record: its first part, or the checkpoint itself.
    first: Offset,
    /// The record that makes it exist: the head, or the checkpoint itself.
    head: Offset,
}

/// The head of a checkpoint saved in parts: `parts` part records from offset `first`,
/// `bytes` bytes of JSON together.
#[derive(Debug, Serialize, Deserialize)]
struct Split {
    id: CheckpointId,
    first: Offset,
    parts: u64,
    bytes: u64,
}

#[derive(Debug, Serialize, Deserialize)]
struct Head {
    split: Split,
}

/// How a head record starts (a whole checkpoint starts with `{"id":`).
const HEAD_PREFIX: &[u8] = b"{\"split\":";

/// The room a part's header takes at most: `#`, two numbers of up to 20 digits, a space
/// and a newline.
const PART_HEADER: usize = 43;

/// What a record of the partition is.
#[derive(Debug)]
enum Entry<'a> {
    /// A checkpoint in one record.
    Whole,
    /// The head of a checkpoint in parts.
    Head(Split),
    /// A part of checkpoint `id`: its `index`-th share of the JSON.
    Part {
        id: CheckpointId,
        index: u64,
        bytes: &'a [u8],
    },
}

fn io(context: &str, error: impl std::fmt::Display) -> CheckpointError {
    CheckpointError::Io {
        context: context.to_owned(),
        source: std::io::Error::other(error.to_string()),
    }
}

fn part(id: CheckpointId, index: usize, bytes: &[u8]) -> Vec<u8> {
    let mut record = format!("#{id} {index}\n").into_bytes();
    record.extend_from_slice(bytes);
    record
}

impl LogCheckpoints {
    pub fn new(log: Arc<dyn Log>, partition: u32) -> Self {
        Self {
            log,
            partition,
            saved: Arc::default(),
        }
    }

    fn unreadable(&self, offset: Offset, message: impl std::fmt::Display) -> CheckpointError {
        CheckpointError::Unreadable {
            path: format!(
                "checkpoint log partition {} offset {offset}",
                self.partition
            ),
            message: message.to_string(),
        }
    }

    fn entry<'a>(&self, record: &'a Record) -> Result<Entry<'a>, CheckpointError> {
        let payload = &record.payload[..];
        if let Some(rest) = payload.strip_prefix(b"#") {
            let newline = rest.iter().position(|&b| b == b'\n');
            let header = newline.and_then(|n| std::str::from_utf8(&rest[..n]).ok());
            let numbers = header.and_then(|header| {
                let (id, index) = header.split_once(' ')?;
                Some((id.parse().ok()?, index.parse().ok()?))
            });
            let (Some(newline), Some((id, index))) = (newline, numbers) else {
                return Err(self.unreadable(record.offset, "a part without its `#ID INDEX` line"));
            };
            return Ok(Entry::Part {
                id,
                index,
                bytes: &rest[newline + 1..],
            });
        }
        if payload.starts_with(HEAD_PREFIX) {
            let head: Head =
                serde_json::from_slice(payload).map_err(|e| self.unreadable(record.offset, e))?;
            return Ok(Entry::Head(head.split));
        }
        Ok(Entry::Whole)
    }

    /// Every record the partition holds from `from` (the start when `None`), oldest first:
    /// from the start, the kept checkpoints (and, after a crash between an append and its
    /// retention, a few more).
    async fn records_from(&self, from: Option<Offset>) -> Result<Vec<Record>, CheckpointError> {
        let (start, end) = self
            .log
            .bounds(self.partition)
            .await
            .map_err(|e| io("reading the checkpoints' bounds", e))?;
        let mut records = Vec::new();
        let mut next = from.unwrap_or(start).max(start);
        while next < end {
            let batch = self.read(next, 16).await?;
            let Some(last) = batch.last() else { break };
            next = last.offset + 1;
            records.extend(batch);
        }
        Ok(records)
    }

    async fn read(&self, from: Offset, max: usize) -> Result<Vec<Record>, CheckpointError> {
        self.log
            .read(self.partition, from, max)
            .await
            .map_err(|e| io("reading the checkpoints", e))
    }

    /// Where the checkpoints among `records` (oldest first) are.
    fn locate(&self, records: &[Record]) -> Result<VecDeque<Saved>, CheckpointError> {
        let mut saved = VecDeque::new();
        // The first part of the checkpoint whose parts are being read, and its id.
        let mut parts_from: Option<(CheckpointId, Offset)> = None;
        for record in records {
            match self.entry(record)? {
                Entry::Part { id, index: 0, .. } => parts_from = Some((id, record.offset)),
                Entry::Part { .. } => {}
                Entry::Head(split) => {
                    let first = match parts_from.take() {
                        Some((id, first)) if id == split.id => first,
                        _ => split.first,
                    };
                    saved.push_back(Saved {
                        first,
                        head: record.offset,
                    });
                }
                Entry::Whole => {
                    parts_from = None;
                    saved.push_back(Saved {
                        first: record.offset,
                        head: record.offset,
                    });
                }
            }
        }
        Ok(saved)
    }

    /// The checkpoint whose head (or whole record) is `record`; `None` when `record` is a
    /// part.
    async fn checkpoint(&self, record: &Record) -> Result<Option<Checkpoint>, CheckpointError> {
        let json = match self.entry(record)? {
            Entry::Part { .. } => return Ok(None),
            Entry::Whole => return self.decode(record.offset, &record.payload).map(Some),
            Entry::Head(split) => self.join(record.offset, &split).await?,
        };
        self.decode(record.offset, &json).map(Some)
    }

    /// The JSON of the checkpoint in parts whose head, at `head`, is `split`.
    async fn join(&self, head: Offset, split: &Split) -> Result<Vec<u8>, CheckpointError> {
        let mut json = Vec::with_capacity(usize::try_from(split.bytes).unwrap_or(0));
        let mut index = 0;
        let mut next = split.first;
        while index < split.parts {
            let batch = self.read(next, 4).await?;
            let Some(last) = batch.last() else { break };
            next = last.offset + 1;
            for record in &batch {
                match self.entry(record)? {
                    Entry::Part {
                        id,
                        index: i,
                        bytes,
                    } if id == split.id && i == index => {
                        json.extend_from_slice(bytes);
                        index += 1;
                    }
                    _ => {
                        return Err(self.unreadable(
                            record.offset,
                            format!("part {index} of checkpoint {} expected", split.id),
                        ));
                    }
                }
                if index == split.parts {
                    break;
                }
            }
        }
        if index < split.parts || json.len() as u64 != split.bytes {
            return Err(self.unreadable(
                head,
                format!(
                    "checkpoint {} in {} parts of {} bytes: {index} parts of {} bytes found",
                    split.id,
                    split.parts,
                    split.bytes,
                    json.len()
                ),
            ));
        }
        Ok(json)
    }

    fn decode(&self, offset: Offset, json: &[u8]) -> Result<Checkpoint, CheckpointError> {
        let what = format!(
            "checkpoint log partition {} offset {offset}",
            self.partition
        );
        Checkpoint::decode(json, &what)
    }

    /// The first checkpoint whose head is at or after `from`.
    async fn first_from(&self, from: Offset) -> Result<Option<Checkpoint>, CheckpointError> {
        let mut next = from;
        loop {
            let batch = self.read(next, 16).await?;
            let Some(last) = batch.last() else {
                return Ok(None);
            };
            next = last.offset + 1;
            for record in &batch {
                if let Some(checkpoint) = self.checkpoint(record).await? {
                    return Ok(Some(checkpoint));
                }
            }
        }
    }

    /// The first and the last checkpoint this store keeps, once it has saved one (before,
    /// it has not read them).
    async fn saved_edges(&self) -> Option<(Saved, Saved)> {
        let saved = self.saved.lock().await;
        let saved = saved.as_ref()?;
        Some((*saved.front()?, *saved.back()?))
    }

    /// Appends `checkpoint`, in parts if it does not fit in one record.
    async fn append(&self, checkpoint: &Checkpoint) -> Result<Saved, CheckpointError> {
        let context = format!("saving checkpoint {}", checkpoint.id);
        let saving = |e: &dyn std::fmt::Display| io(&context, e);
        let json = checkpoint
            .encode(false)
            .map_err(|e| io("encoding a checkpoint", e))?;
        let max = self.log.max_record(self.partition);
        if json.len() <= max {
            let offset = self
                .log
                .append(self.partition, json)
                .await
                .map_err(|e| saving(&e))?;
            return Ok(Saved {
                first: offset,
                head: offset,
            });
        }
        let share = max.saturating_sub(PART_HEADER);
        if share < PART_HEADER {
            return Err(saving(&format!(
                "the log's records of {max} bytes are too small to hold a checkpoint's parts"
            )));
        }
        let parts: Vec<(u32, Vec<u8>)> = json
            .chunks(share)
            .enumerate()
            .map(|(index, bytes)| (self.partition, part(checkpoint.id, index, bytes)))
            .collect();
        let count = parts.len() as u64;
        let offsets = self.log.append_many(parts).await.map_err(|e| saving(&e))?;
        let first = *offsets.first().ok_or_else(|| saving(&"no part written"))?;
        let head = Head {
            split: Split {
                id: checkpoint.id,
                first,
                parts: count,
                bytes: json.len() as u64,
            },
        };
        let head = serde_json::to_vec(&head).map_err(|e| io("encoding a checkpoint", e))?;
        let head = self
            .log
            .append(self.partition, head)
            .await
            .map_err(|e| saving(&e))?;
        Ok(Saved { first, head })
    }
}

#[async_trait]
impl CheckpointStore for LogCheckpoints {
    async fn save(&self, checkpoint: &Checkpoint, keep: usize) -> Result<(), CheckpointError> {
        let mut saved = self.saved.lock().await;
        let saved = match &mut *saved {
            Some(saved) => saved,
            None => saved.insert(self.locate(&self.records_from(None).await?)?),
        };
        saved.push_back(self.append(checkpoint).await?);
        // Retention: the newest `keep` (this one included) stay. A failure here leaves more
        // than `keep`, which the next save deletes.
        let mut dropped = false;
        while saved.len() > keep.max(1) {
            saved.pop_front();
            dropped = true;
        }
        if dropped
            && let Some(oldest) = saved.front()
            && let Err(e) = self.log.delete_below(self.partition, oldest.first).await
        {
            tracing::warn!("deleting old checkpoints: {e}");
        }
        Ok(())
    }

    async fn latest(&self) -> Result<Option<Checkpoint>, CheckpointError> {
        let last_saved = self.saved_edges().await.map(|(_, last)| last.head);
        // From the last this store saved: normally that one record, but anything appended
        // after it too (parts of a save that did not finish are skipped).
        for record in self.records_from(last_saved).await?.iter().rev() {
            if let Some(checkpoint) = self.checkpoint(record).await? {
                return Ok(Some(checkpoint));
            }
        }
        Ok(None)
    }

    async fn list(&self) -> Result<Vec<CheckpointId>, CheckpointError> {
        let records = self.records_from(None).await?;
        let mut ids = Vec::new();
        for record in &records {
            match self.entry(record)? {
                Entry::Part { .. } => {}
                Entry::Head(split) => ids.push(split.id),
                Entry::Whole => ids.push(self.decode(record.offset, &record.payload)?.id),
            }
        }
        Ok(ids)
    }

    async fn oldest(&self) -> Result<Option<Checkpoint>, CheckpointError> {
        // The oldest this store kept (retention deletes only below its first record), or
        // the first after the start.
        let from = match self.saved_edges().await {
            Some((first, _)) => first.head,
            None => {
                self.log
                    .bounds(self.partition)
                    .await
                    .map_err(|e| io("reading the checkpoints' bounds", e))?
                    .0
            }
        };
        self.first_from(from).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::conformance::{Fresh, checkpoint};
    use crate::log::MemoryLog;

    crate::checkpoint_conformance_tests!(|| Fresh {
        store: Arc::new(LogCheckpoints::new(Arc::new(MemoryLog::new(2)), 1)),
        guard: Box::new(()),
    });

    /// The suite again on a log of 4 KiB records: the large checkpoint goes in parts.
    mod in_parts {
        use super::*;

        crate::checkpoint_conformance_tests!(|| Fresh {
            store: Arc::new(LogCheckpoints::new(
                Arc::new(MemoryLog::new(1).with_max_record(4096)),
                0,
            )),
            guard: Box::new(()),
        });
    }

    #[tokio::test]
    async fn a_damaged_checkpoint_is_named() {
        let log: Arc<dyn Log> = Arc::new(MemoryLog::new(1));
        let store = LogCheckpoints::new(Arc::clone(&log), 0);
        store.save(&checkpoint(1), 3).await.expect("save");
        log.append(0, b"not json".to_vec()).await.expect("append");
        let error = store.latest().await.expect_err("unreadable");
        assert!(
            error.to_string().contains("partition 0 offset 1"),
            "{error}"
        );
    }

    /// A checkpoint of `keys` keys, each with a little memory.
    fn large(id: CheckpointId, keys: u64) -> Checkpoint {
        let mut large = checkpoint(id);
        large.keys = (0..keys)
            .map(|k| {
                let mut progress = large.keys["ana"].clone();
                progress.memory.insert("k".to_owned(), k.to_string());
                (format!("key-{k}"), progress)
            })
            .collect();
        large
    }

    #[tokio::test]
    async fn a_checkpoint_past_the_record_limit_is_saved_in_parts_behind_its_head() {
        let log: Arc<dyn Log> = Arc::new(MemoryLog::new(1).with_max_record(1024));
        let store = LogCheckpoints::new(Arc::clone(&log), 0);
        let first = large(1, 200);
        store.save(&first, 2).await.expect("save");
        let (start, end) = log.bounds(0).await.expect("bounds");
        assert!(end - start > 2, "saved in parts: {start}..{end}");
        let records = log.read(0, start, 1000).await.expect("read");
        assert!(records.iter().all(|r| r.payload.len() <= 1024));
        assert!(
            records
                .last()
                .expect("a head")
                .payload
                .starts_with(HEAD_PREFIX)
        );

        // A fresh store (a host that takes the partition) reads it back.
        let again = LogCheckpoints::new(Arc::clone(&log), 0);
        assert_eq!(again.latest().await.expect("latest"), Some(first.clone()));
        assert_eq!(again.oldest().await.expect("oldest"), Some(first.clone()));

        // Parts whose head never came (a crash mid-save) are not a checkpoint.
        for index in 0..3 {
            log.append(0, part(2, index, b"{\"id\":2,"))
                .await
                .expect("append");
        }
        let again = LogCheckpoints::new(Arc::clone(&log), 0);
        assert_eq!(again.latest().await.expect("latest"), Some(first.clone()));
        assert_eq!(again.list().await.expect("list"), [1]);

        // Saving on, retention deletes the older checkpoints' parts and the stray ones.
        for id in 2..=4 {
            again.save(&large(id, 200), 2).await.expect("save");
        }
        assert_eq!(again.list().await.expect("list"), [3, 4]);
        assert_eq!(again.oldest().await.expect("oldest"), Some(large(3, 200)));
        let (start, _) = log.bounds(0).await.expect("bounds");
        let first_record = &log.read(0, start, 1).await.expect("read")[0];
        assert!(
            first_record.payload.starts_with(b"#3 0\n"),
            "the log starts at checkpoint 3's first part"
        );
    }

    #[tokio::test]
    async fn a_missing_part_is_named() {
        let log: Arc<dyn Log> = Arc::new(MemoryLog::new(1).with_max_record(1024));
        let store = LogCheckpoints::new(Arc::clone(&log), 0);
        store.save(&large(1, 200), 2).await.expect("save");
        let (start, end) = log.bounds(0).await.expect("bounds");
        let head = log.read(0, end - 1, 1).await.expect("read").remove(0);
        // The same head, naming parts one further on: its first part is not there.
        let mut split: Head = serde_json::from_slice(&head.payload).expect("a head");
        split.split.first = start + 1;
        let damaged = MemoryLog::new(1).with_max_record(1024);
        for record in log.read(0, start, 1000).await.expect("read") {
            let payload = if record.offset == head.offset {
                serde_json::to_vec(&split).expect("JSON")
            } else {
                record.payload
            };
            damaged.append(0, payload).await.expect("append");
        }
        let store = LogCheckpoints::new(Arc::new(damaged), 0);
        let error = store.latest().await.expect_err("a part is missing");
        assert!(error.to_string().contains("checkpoint 1"), "{error}");
    }

    #[tokio::test]
    async fn a_log_too_small_for_parts_is_an_error_that_says_so() {
        let log: Arc<dyn Log> = Arc::new(MemoryLog::new(1).with_max_record(64));
        let store = LogCheckpoints::new(Arc::clone(&log), 0);
        let error = store.save(&large(1, 10), 2).await.expect_err("too small");
        assert!(error.to_string().contains("too small"), "{error}");
        assert_eq!(store.latest().await.expect("latest"), None);
    }
}
