//! Outputs on JetStream: partition P's outputs are records of stream `PREFIX-out-P`, written
//! by the partition's holder through a fenced log, one JSON object per output.
//!
//! Each output is written once: the sink knows the ids written since the checkpoint it
//! resumed from (it reads them back at open) and drops an output it has written before,
//! until a checkpoint counts its input complete (it cannot run again then). A host that
//! lost the partition cannot write one more (fencing).

use std::collections::BTreeMap;
use std::sync::Arc;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use super::Layout;
use crate::agent::{OutputSink, WrittenIds};
use crate::checkpoint::KeyProgress;
use crate::event::{Output, OutputId};
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

/// One output as it is on the stream: the line `rewind run --output` writes.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct OutputRecord {
    pub id: String,
    pub tenant: String,
    pub agent: String,
    pub key: String,
    pub sequence: u64,
    pub index: u32,
    pub payload: Box<serde_json::value::RawValue>,
}

impl OutputRecord {
    fn id(&self) -> OutputId {
        OutputId {
            tenant: self.tenant.clone(),
            agent: self.agent.clone(),
            key: self.key.clone(),
            sequence: self.sequence,
            index: self.index,
        }
    }
}

/// Every output in `partition` of `log` from offset `from` on.
pub async fn read_outputs(
    log: &dyn Log,
    partition: u32,
    from: u64,
) -> anyhow::Result<Vec<(u64, OutputRecord)>> {
    let (start, end) = log.bounds(partition).await?;
    let mut next = from.max(start);
    let mut outputs = Vec::new();
    while next < end {
        let batch = log.read(partition, next, 1_000).await?;
        let Some(last) = batch.last() else { break };
        next = last.offset + 1;
        for record in batch {
            let output: OutputRecord = serde_json::from_slice(&record.payload).map_err(|e| {
                anyhow::anyhow!("output at offset {} is not an output: {e}", record.offset)
            })?;
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
    pub async fn open(log: Arc<dyn Log>, from: u64) -> anyhow::Result<Self> {
        let mut seen = WrittenIds::default();
        for (_, output) in read_outputs(&*log, 0, from).await? {
            seen.insert(&output.id());
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
        let payload = serde_json::value::RawValue::from_string(output.payload.clone())
            .unwrap_or_else(|_| serde_json::value::RawValue::NULL.to_owned());
        let record = OutputRecord {
            id: output.id.to_string(),
            tenant: output.id.tenant.clone(),
            agent: output.id.agent.clone(),
            key: output.id.key.clone(),
            sequence: output.id.sequence,
            index: output.id.index,
            payload,
        };
        let bytes = serde_json::to_vec(&record).map_err(std::io::Error::other)?;
        self.log
            .append(0, bytes)
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
