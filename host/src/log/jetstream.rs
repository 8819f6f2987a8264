//! `JetStreamLog`: the log on NATS JetStream (issue #7, first part).
//!
//! One stream per partition (`PREFIX-P`, subject `PREFIX.P`); a record's offset is its
//! stream sequence − 1, taken from the publish acknowledgement. An append is retried with
//! the same `Nats-Msg-Id`, so a retry whose first attempt landed gets the original sequence
//! back instead of a second record. JetStream 2.9 acknowledges before fsync: a record is
//! durable through replication (streams of 3 replicas in production), not one disk.

use std::time::Duration;

use async_nats::jetstream::{self, stream};
use async_trait::async_trait;
use bytes::Bytes;

use super::{Log, LogError, Offset, Record};

/// Attempts of one append before it fails.
const ATTEMPTS: u32 = 5;

/// A log over JetStream streams.
#[derive(Debug)]
pub struct JetStreamLog {
    context: jetstream::Context,
    prefix: String,
    partitions: u32,
}

fn io(context: impl Into<String>, error: impl std::fmt::Display) -> LogError {
    LogError::Io {
        context: context.into(),
        source: std::io::Error::other(error.to_string()),
    }
}

impl JetStreamLog {
    /// Connects to `url` and makes sure the `partitions` streams of `prefix` exist, each with
    /// `replicas` replicas.
    pub async fn connect(
        url: &str,
        prefix: &str,
        partitions: u32,
        replicas: usize,
    ) -> Result<Self, LogError> {
        let client = async_nats::connect(url)
            .await
            .map_err(|e| io(format!("connecting to NATS at {url}"), e))?;
        let context = jetstream::new(client);
        for partition in 0..partitions {
            let name = format!("{prefix}-{partition}");
            let config = stream::Config {
                name: name.clone(),
                subjects: vec![format!("{prefix}.{partition}")],
                num_replicas: replicas,
                ..stream::Config::default()
            };
            let existing = context
                .get_or_create_stream(config)
                .await
                .map_err(|e| io(format!("creating stream {name}"), e))?;
            drop(existing);
        }
        Ok(Self {
            context,
            prefix: prefix.to_owned(),
            partitions,
        })
    }

    fn check(&self, partition: u32) -> Result<(), LogError> {
        if partition >= self.partitions {
            return Err(LogError::NoSuchPartition {
                partition,
                partitions: self.partitions,
            });
        }
        Ok(())
    }

    fn stream_name(&self, partition: u32) -> String {
        format!("{}-{partition}", self.prefix)
    }

    async fn stream(&self, partition: u32) -> Result<stream::Stream, LogError> {
        self.check(partition)?;
        let name = self.stream_name(partition);
        self.context
            .get_stream(&name)
            .await
            .map_err(|e| io(format!("stream {name}"), e))
    }
}

#[async_trait]
impl Log for JetStreamLog {
    fn partitions(&self) -> u32 {
        self.partitions
    }

    async fn append(&self, partition: u32, payload: Vec<u8>) -> Result<Offset, LogError> {
        self.check(partition)?;
        let subject = format!("{}.{partition}", self.prefix);
        let id = format!("{:032x}", rand::random::<u128>());
        let payload = Bytes::from(payload);
        let mut last = None;
        for attempt in 0..ATTEMPTS {
            if attempt > 0 {
                tokio::time::sleep(Duration::from_millis(50 << attempt)).await;
            }
            let mut headers = async_nats::HeaderMap::new();
            headers.insert("Nats-Msg-Id", id.as_str());
            let ack = match self
                .context
                .publish_with_headers(subject.clone(), headers, payload.clone())
                .await
            {
                Ok(ack) => ack.await,
                Err(error) => {
                    last = Some(error.to_string());
                    continue;
                }
            };
            match ack {
                Ok(ack) => return Ok(ack.sequence - 1),
                Err(error) => last = Some(error.to_string()),
            }
        }
        Err(io(
            format!("appending to {subject} ({ATTEMPTS} attempts)"),
            last.unwrap_or_default(),
        ))
    }

    async fn read(
        &self,
        partition: u32,
        from: Offset,
        max: usize,
    ) -> Result<Vec<Record>, LogError> {
        let (start, end) = self.bounds(partition).await?;
        if from < start || from > end {
            return Err(LogError::OutOfRange {
                partition,
                offset: from,
                start,
                end,
            });
        }
        let stream = self.stream(partition).await?;
        let until = end.min(from.saturating_add(max as u64));
        let mut records = Vec::with_capacity(usize::try_from(until - from).unwrap_or(0));
        for offset in from..until {
            let message = stream
                .get_raw_message(offset + 1)
                .await
                .map_err(|e| io(format!("reading {}", self.stream_name(partition)), e))?;
            records.push(Record {
                offset,
                payload: message.payload.to_vec(),
            });
        }
        Ok(records)
    }

    async fn bounds(&self, partition: u32) -> Result<(Offset, Offset), LogError> {
        let mut stream = self.stream(partition).await?;
        let info = stream
            .info()
            .await
            .map_err(|e| io(format!("{}: stream info", self.stream_name(partition)), e))?;
        let end = info.state.last_sequence;
        let start = if info.state.messages == 0 {
            end
        } else {
            info.state.first_sequence - 1
        };
        Ok((start, end))
    }

    async fn delete_below(&self, partition: u32, offset: Offset) -> Result<(), LogError> {
        let stream = self.stream(partition).await?;
        stream
            .purge()
            .sequence(offset + 1)
            .await
            .map_err(|e| io(format!("{}: purging", self.stream_name(partition)), e))?;
        Ok(())
    }
}
