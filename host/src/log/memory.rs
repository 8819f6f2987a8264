//! The in-memory log: the file log's twin for tests and one-off runs.

use std::sync::Mutex;

use async_trait::async_trait;

use super::{Log, LogError, Offset, Record};

#[derive(Debug, Default)]
struct Partition {
    /// Offset of `records[0]`.
    start: Offset,
    records: Vec<Vec<u8>>,
}

impl Partition {
    fn end(&self) -> Offset {
        self.start + self.records.len() as u64
    }
}

/// A [`Log`] in memory. "Segments" are single records, so retention is exact.
#[derive(Debug)]
pub struct MemoryLog {
    partitions: Vec<Mutex<Partition>>,
    /// The largest record an append takes.
    max_record: usize,
}

impl MemoryLog {
    /// A log of `partitions` partitions whose records may be of any size.
    pub fn new(partitions: u32) -> Self {
        Self {
            partitions: (0..partitions.max(1)).map(|_| Mutex::default()).collect(),
            max_record: usize::MAX,
        }
    }

    /// The same log, refusing a record longer than `max` bytes with
    /// [`LogError::TooLarge`], as the file log and JetStream refuse one past theirs.
    pub fn with_max_record(mut self, max: usize) -> Self {
        self.max_record = max;
        self
    }

    fn partition(&self, partition: u32) -> Result<std::sync::MutexGuard<'_, Partition>, LogError> {
        let slot = self
            .partitions
            .get(partition as usize)
            .ok_or(LogError::NoSuchPartition {
                partition,
                partitions: self.partitions(),
            })?;
        Ok(slot.lock().unwrap_or_else(|poisoned| poisoned.into_inner()))
    }
}

#[async_trait]
impl Log for MemoryLog {
    fn partitions(&self) -> u32 {
        u32::try_from(self.partitions.len()).unwrap_or(u32::MAX)
    }

    fn max_record(&self, _partition: u32) -> usize {
        self.max_record
    }

    async fn append(&self, partition: u32, payload: Vec<u8>) -> Result<Offset, LogError> {
        if payload.len() > self.max_record {
            return Err(LogError::TooLarge {
                size: payload.len(),
                max: self.max_record,
            });
        }
        let mut p = self.partition(partition)?;
        let offset = p.end();
        p.records.push(payload);
        Ok(offset)
    }

    async fn read(
        &self,
        partition: u32,
        from: Offset,
        max: usize,
    ) -> Result<Vec<Record>, LogError> {
        let p = self.partition(partition)?;
        if from < p.start || from > p.end() {
            return Err(LogError::OutOfRange {
                partition,
                offset: from,
                start: p.start,
                end: p.end(),
            });
        }
        let skip = usize::try_from(from - p.start).unwrap_or(usize::MAX);
        Ok(p.records
            .iter()
            .enumerate()
            .skip(skip)
            .take(max)
            .map(|(i, payload)| Record {
                offset: p.start + i as u64,
                payload: payload.clone(),
            })
            .collect())
    }

    async fn bounds(&self, partition: u32) -> Result<(Offset, Offset), LogError> {
        let p = self.partition(partition)?;
        Ok((p.start, p.end()))
    }

    async fn delete_below(&self, partition: u32, offset: Offset) -> Result<(), LogError> {
        let mut p = self.partition(partition)?;
        let offset = offset.min(p.end());
        if offset > p.start {
            let drop = usize::try_from(offset - p.start).unwrap_or(usize::MAX);
            p.records.drain(..drop);
            p.start = offset;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::MemoryLog;

    fn memory_log(partitions: u32) -> std::sync::Arc<dyn crate::log::Log> {
        std::sync::Arc::new(MemoryLog::new(partitions))
    }

    fn bounded_memory_log(partitions: u32) -> std::sync::Arc<dyn crate::log::Log> {
        std::sync::Arc::new(MemoryLog::new(partitions).with_max_record(2 << 20))
    }

    crate::log_conformance_tests!(memory_log);

    mod bounded {
        crate::log_conformance_tests!(super::bounded_memory_log);
    }
}
