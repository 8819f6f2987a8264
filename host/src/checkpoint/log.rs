//! `LogCheckpoints`: checkpoints as records of one partition of a [`Log`].
//!
//! Each save appends the checkpoint as one record (JSON), so a save is atomic exactly as an
//! append is; then retention deletes the records before the newest `keep`. The store knows
//! where its checkpoints are (it reads them once, then notes each save), so a save reads
//! nothing back. On JetStream this
//! is how checkpoints live in the cluster instead of on a host's disk, and a fenced log
//! makes a save by a host that lost its partition fail.

use std::collections::VecDeque;
use std::sync::Arc;

use async_trait::async_trait;

use super::{Checkpoint, CheckpointError, CheckpointId, CheckpointStore};
use crate::log::{Log, Offset, Record};

/// Checkpoints in partition `partition` of `log`, which holds nothing else and which one
/// store writes at a time (on JetStream, the fenced holder's).
#[derive(Clone, Debug)]
pub struct LogCheckpoints {
    log: Arc<dyn Log>,
    partition: u32,
    /// The offsets of the checkpoints the partition holds, oldest first: read at the first
    /// save, then kept up to date by each one.
    saved: Arc<tokio::sync::Mutex<Option<VecDeque<Offset>>>>,
}

fn io(context: &str, error: impl std::fmt::Display) -> CheckpointError {
    CheckpointError::Io {
        context: context.to_owned(),
        source: std::io::Error::other(error.to_string()),
    }
}

impl LogCheckpoints {
    pub fn new(log: Arc<dyn Log>, partition: u32) -> Self {
        Self {
            log,
            partition,
            saved: Arc::default(),
        }
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
            let batch = self
                .log
                .read(self.partition, next, 16)
                .await
                .map_err(|e| io("reading the checkpoints", e))?;
            let Some(last) = batch.last() else { break };
            next = last.offset + 1;
            records.extend(batch);
        }
        Ok(records)
    }

    /// The offsets of the first and the last checkpoint this store keeps, once it has
    /// saved one (before, it has not read them).
    async fn saved_edges(&self) -> Option<(Offset, Offset)> {
        let saved = self.saved.lock().await;
        let saved = saved.as_ref()?;
        Some((*saved.front()?, *saved.back()?))
    }

    async fn records(&self) -> Result<Vec<Record>, CheckpointError> {
        self.records_from(None).await
    }

    /// The first record at or after `offset`.
    async fn first_from(&self, offset: Offset) -> Result<Option<Record>, CheckpointError> {
        let records = self
            .log
            .read(self.partition, offset, 1)
            .await
            .map_err(|e| io("reading a checkpoint", e))?;
        Ok(records.into_iter().next())
    }

    fn decode(&self, record: &Record) -> Result<Checkpoint, CheckpointError> {
        serde_json::from_slice(&record.payload).map_err(|e| CheckpointError::Unreadable {
            path: format!(
                "checkpoint log partition {} offset {}",
                self.partition, record.offset
            ),
            message: e.to_string(),
        })
    }
}

#[async_trait]
impl CheckpointStore for LogCheckpoints {
    async fn save(&self, checkpoint: &Checkpoint, keep: usize) -> Result<(), CheckpointError> {
        let payload = serde_json::to_vec(checkpoint).map_err(|e| io("encoding a checkpoint", e))?;
        let mut saved = self.saved.lock().await;
        let saved = match &mut *saved {
            Some(saved) => saved,
            None => saved.insert(self.records().await?.iter().map(|r| r.offset).collect()),
        };
        let offset = self
            .log
            .append(self.partition, payload)
            .await
            .map_err(|e| io(&format!("saving checkpoint {}", checkpoint.id), e))?;
        saved.push_back(offset);
        // Retention: the newest `keep` (this one included) stay. A failure here leaves more
        // than `keep`, which the next save deletes.
        let mut dropped = false;
        while saved.len() > keep.max(1) {
            saved.pop_front();
            dropped = true;
        }
        if dropped
            && let Some(&from) = saved.front()
            && let Err(e) = self.log.delete_below(self.partition, from).await
        {
            tracing::warn!("deleting old checkpoints: {e}");
        }
        Ok(())
    }

    async fn latest(&self) -> Result<Option<Checkpoint>, CheckpointError> {
        let last_saved = self.saved_edges().await.map(|(_, last)| last);
        // From the last this store saved: normally that one record, but anything appended
        // after it too.
        let record = self.records_from(last_saved).await?.pop();
        record.map(|record| self.decode(&record)).transpose()
    }

    async fn list(&self) -> Result<Vec<CheckpointId>, CheckpointError> {
        self.records()
            .await?
            .iter()
            .map(|record| self.decode(record).map(|c| c.id))
            .collect()
    }

    async fn oldest(&self) -> Result<Option<Checkpoint>, CheckpointError> {
        // The oldest this store kept (retention deletes only below it), or the start.
        let first_saved = self.saved_edges().await.map(|(first, _)| first);
        let from = match first_saved {
            Some(offset) => offset,
            None => {
                self.log
                    .bounds(self.partition)
                    .await
                    .map_err(|e| io("reading the checkpoints' bounds", e))?
                    .0
            }
        };
        let record = self.first_from(from).await?;
        record.map(|record| self.decode(&record)).transpose()
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
}
