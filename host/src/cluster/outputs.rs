//! Outputs on JetStream: partition P's outputs are records of stream `PREFIX-out-P`, written
//! by the partition's holder through a fenced log, one [`OutputRecord`] per output.
//!
//! Each output is written once: the sink knows the ids written since the checkpoint it
//! resumed from (it reads them back at open) and drops an output it has written before,
//! until a checkpoint counts its input complete (it cannot run again then). A host that
//! lost the partition cannot write one more (fencing).

use std::collections::BTreeMap;
use std::sync::Arc;

use async_trait::async_trait;

use super::Layout;
use super::error::ClusterError;
use crate::agent::{OutputSink, WrittenIds};
use crate::checkpoint::KeyProgress;
use crate::event::{Output, OutputRecord};
use crate::log::{Log, StreamSpec};

impl Layout {
    pub fn output_stream(&self, partition: u32) -> StreamSpec {
        StreamSpec::new(
            format!("{}-out-{partition}", self.prefix),
            format!("{}.out.{partition}", self.prefix),
            self.replicas,
        )
        .group_commit(self.group_commit)
    }
}

/// Every output in `partition` of `log` from offset `from` on.
pub async fn read_outputs(
    log: &dyn Log,
    partition: u32,
    from: u64,
) -> Result<Vec<(u64, OutputRecord)>, ClusterError> {
    let reading = || ClusterError::log(|| "reading the outputs");
    let (start, end) = log.bounds(partition).await.map_err(reading())?;
    let mut next = from.max(start);
    let mut outputs = Vec::new();
    while next < end {
        let batch = log.read(partition, next, 1_000).await.map_err(reading())?;
        let Some(last) = batch.last() else { break };
        next = last.offset + 1;
        for record in batch {
            let output: OutputRecord =
                serde_json::from_slice(&record.payload).map_err(ClusterError::record(|| {
                    format!("output at offset {} is not an output", record.offset)
                }))?;
            outputs.push((record.offset, output));
        }
    }
    Ok(outputs)
}

/// An [`OutputSink`] over partition 0 of a (fenced) log.
#[derive(Debug)]
pub struct StreamSink {
    log: Arc<dyn Log>,
    seen: WrittenIds,
}

impl StreamSink {
    /// Opens the sink, reading the ids of the outputs written from `from` on (the resumed
    /// checkpoint's output position: outputs before it are of inputs that will not run
    /// again).
    pub async fn open(log: Arc<dyn Log>, from: u64) -> Result<Self, ClusterError> {
        let mut seen = WrittenIds::default();
        for (_, output) in read_outputs(&*log, 0, from).await? {
            seen.insert(&output.output_id());
        }
        Ok(Self { log, seen })
    }

    /// How many output ids the sink keeps, to drop repeats.
    pub fn remembered(&self) -> usize {
        self.seen.len()
    }
}

#[async_trait]
impl OutputSink for StreamSink {
    async fn write(&mut self, output: &Output) -> std::io::Result<bool> {
        if self.seen.contains(&output.id) {
            return Ok(false);
        }
        self.log
            .append(0, OutputRecord::new(output, None).encode())
            .await
            .map_err(std::io::Error::other)?;
        self.seen.insert(&output.id);
        Ok(true)
    }

    async fn sync(&mut self) -> std::io::Result<()> {
        // Each write returned once JetStream acknowledged it.
        Ok(())
    }

    async fn position(&mut self) -> std::io::Result<Option<u64>> {
        let (_, end) = self.log.bounds(0).await.map_err(std::io::Error::other)?;
        Ok(Some(end))
    }

    fn checkpointed(&mut self, keys: &BTreeMap<String, KeyProgress>) {
        self.seen.forget_completed(keys);
    }
}
