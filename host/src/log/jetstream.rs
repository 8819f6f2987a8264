//! `JetStreamLog`: the log on NATS JetStream.
//!
//! One stream per partition; a record's offset is its stream sequence − 1, taken from the
//! publish acknowledgement. Each partition has one writer task: it publishes the appends
//! queued since its last batch one after the other without waiting, then awaits their
//! acknowledgements together. An append is retried (with backoff, for up to
//! [`RETRY_FOR`]) with the same `Nats-Msg-Id`, so a retry whose first attempt landed gets the
//! original sequence back instead of a second record. Reads replay through an ordered
//! consumer.
//!
//! A fenced log ([`JetStreamLog::open`] with an [`Authority`]) is one that a lease holder
//! writes: every publish carries `Nats-Expected-Last-Sequence`, the sequence the writer
//! expects before it. Opening it publishes a fence message (on the partition's fence
//! subject, which readers skip) that moves the stream past whatever an earlier holder
//! expected, so an earlier holder still running can no longer write. A writer whose publish
//! is refused for a wrong last sequence reads the stream's last sequence, then asks its
//! authority whether it still holds the partition: if so it goes on from there (the
//! refusal was its own broken chain), if not the log is fenced for good.
//!
//! Offsets therefore have gaps where fences are; readers never see them.
//!
//! JetStream 2.9 acknowledges before fsync: a record is durable through replication (streams
//! of 3 replicas in production), not through one disk.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use async_nats::jetstream::consumer::{DeliverPolicy, pull};
use async_nats::jetstream::context::PublishErrorKind;
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::{self, stream};
use async_trait::async_trait;
use bytes::Bytes;
use futures_util::StreamExt;
use tokio::sync::{mpsc, oneshot};

use super::{Log, LogError, Offset, Record};

/// How long an operation is retried (the server restarting, a cluster electing a leader)
/// before it fails.
pub const RETRY_FOR: Duration = Duration::from_secs(30);

/// Appends published together before their acknowledgements are awaited.
const MAX_BATCH: usize = 512;

/// How long creating a replay consumer may take before a read gets its records one by one
/// instead: a cluster that has lost a node and not noticed yet (nats-server 2.9) may place
/// the consumer on the dead node, and then the creation never answers.
pub const CONSUMER_WITHIN: Duration = Duration::from_secs(2);

/// Decides whether this host may still write to a fenced partition.
#[async_trait]
pub trait Authority: Send + Sync + fmt::Debug {
    /// Whether this host still holds the partition. Asked after the stream's last sequence
    /// has been read, so a holder that says yes has not been fenced before that read.
    /// `Ok(false)` fences the log for good; `Err` is retried.
    async fn holds(&self) -> Result<bool, String>;
}

/// One partition's stream: its name and the subject its records are published on. The
/// stream also takes `SUBJECT.fence`, for fences.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StreamSpec {
    pub name: String,
    pub subject: String,
    /// Servers that keep a copy: 3 in production (JetStream 2.9 does not fsync before it
    /// acknowledges).
    pub replicas: usize,
}

impl StreamSpec {
    fn fence_subject(&self) -> String {
        format!("{}.fence", self.subject)
    }
}

/// A log over JetStream streams.
#[derive(Debug)]
pub struct JetStreamLog {
    /// The connection's context with a timeout of [`CONSUMER_WITHIN`], for requests that are retried or
    /// have a way around: replay consumers, stream info, purges. (The default, 10 s, is
    /// what a request to a stream whose leader just died waits for nothing.)
    quick: jetstream::Context,
    partitions: Vec<Partition>,
}

#[derive(Debug)]
struct Partition {
    spec: StreamSpec,
    /// After a replay consumer could not be created: reads go record by record until then.
    one_by_one_until: std::sync::Mutex<Option<Instant>>,
    appends: mpsc::UnboundedSender<Append>,
    fenced: Arc<AtomicBool>,
}

struct Append {
    id: String,
    payload: Bytes,
    done: oneshot::Sender<Result<Offset, LogError>>,
}

fn io(context: impl Into<String>, error: impl fmt::Display) -> LogError {
    LogError::Io {
        context: context.into(),
        source: std::io::Error::other(error.to_string()),
    }
}

/// The wait before attempt `attempt` (from 1) of a retried operation.
fn backoff(attempt: u32) -> Duration {
    Duration::from_millis((25u64 << attempt.min(6)).min(1_000))
}

/// Runs `operation` until it succeeds or [`RETRY_FOR`] has passed, backing off between
/// attempts.
pub(crate) async fn retrying<T, E: fmt::Display, F: Future<Output = Result<T, E>>>(
    what: &str,
    mut operation: impl FnMut() -> F,
) -> Result<T, LogError> {
    let started = Instant::now();
    let mut attempt = 0;
    loop {
        match operation().await {
            Ok(value) => return Ok(value),
            Err(error) if started.elapsed() >= RETRY_FOR => {
                return Err(io(format!("{what} (retried for {RETRY_FOR:?})"), error));
            }
            Err(error) => {
                attempt += 1;
                tracing::debug!(attempt, "{what}: {error}; retrying");
                tokio::time::sleep(backoff(attempt)).await;
            }
        }
    }
}

/// The sequence of the last message `stream` holds (0: none ever).
async fn last_sequence(context: &jetstream::Context, name: &str) -> Result<u64, LogError> {
    let mut quick = context.clone();
    quick.set_timeout(CONSUMER_WITHIN);
    let info = retrying(&format!("{name}: reading its last sequence"), || async {
        let stream = quick.get_stream_no_info(name).await?;
        stream.get_info().await.map_err(async_nats::Error::from)
    })
    .await?;
    Ok(info.state.last_sequence)
}

/// Connects to NATS at `urls` (one URL, or several separated by commas: the nodes of a
/// cluster; the client also learns the others from the one it reaches).
pub async fn connect(urls: &str) -> Result<async_nats::Client, LogError> {
    let addresses: Vec<&str> = urls.split(',').map(str::trim).collect();
    async_nats::ConnectOptions::new()
        .retry_on_initial_connect()
        .connection_timeout(Duration::from_secs(5))
        .connect(addresses)
        .await
        .map_err(|e| io(format!("connecting to NATS at {urls}"), e))
}

impl JetStreamLog {
    /// Connects to `url` and opens an unfenced log of `partitions` streams named
    /// `PREFIX-P`, subject `PREFIX.P`, of `replicas` replicas each.
    pub async fn connect(
        url: &str,
        prefix: &str,
        partitions: u32,
        replicas: usize,
    ) -> Result<Self, LogError> {
        let client = connect(url).await?;
        let streams = (0..partitions)
            .map(|partition| StreamSpec {
                name: format!("{prefix}-{partition}"),
                subject: format!("{prefix}.{partition}"),
                replicas,
            })
            .collect();
        Self::open(jetstream::new(client), streams, None).await
    }

    /// Opens a log whose partition P is `streams[P]`, creating the streams that do not
    /// exist. With an `authority`, the log is fenced: each stream is fenced now (so that an
    /// earlier writer can no longer write), and every write expects the stream's last
    /// sequence; see the module's documentation.
    pub async fn open(
        context: jetstream::Context,
        streams: Vec<StreamSpec>,
        authority: Option<Arc<dyn Authority>>,
    ) -> Result<Self, LogError> {
        let mut partitions = Vec::with_capacity(streams.len());
        for spec in streams {
            let config = stream::Config {
                name: spec.name.clone(),
                subjects: vec![spec.subject.clone(), spec.fence_subject()],
                num_replicas: spec.replicas,
                ..stream::Config::default()
            };
            retrying(&format!("creating stream {}", spec.name), || {
                context.get_or_create_stream(config.clone())
            })
            .await?;
            let fenced = Arc::new(AtomicBool::new(false));
            let expected = match &authority {
                Some(authority) => Some(fence(&context, &spec, &**authority).await?),
                None => None,
            };
            let (appends, queue) = mpsc::unbounded_channel();
            tokio::spawn(
                Writer {
                    context: context.clone(),
                    spec: spec.clone(),
                    authority: authority.clone(),
                    expected,
                    fenced: Arc::clone(&fenced),
                }
                .run(queue),
            );
            partitions.push(Partition {
                spec,
                one_by_one_until: std::sync::Mutex::new(None),
                appends,
                fenced,
            });
        }
        let mut quick = context.clone();
        quick.set_timeout(CONSUMER_WITHIN);
        Ok(Self { quick, partitions })
    }

    /// Up to `max` records of `spec`'s stream from offset `from`, through an ordered
    /// consumer. Fails when the consumer cannot be created within [`CONSUMER_WITHIN`].
    async fn replay(
        &self,
        spec: &StreamSpec,
        from: Offset,
        max: usize,
    ) -> Result<Vec<Record>, async_nats::Error> {
        let config = pull::OrderedConfig {
            filter_subject: spec.subject.clone(),
            deliver_policy: DeliverPolicy::ByStartSequence {
                start_sequence: from + 1,
            },
            max_batch: i64::try_from(max.min(1_000)).unwrap_or(1_000),
            ..pull::OrderedConfig::default()
        };
        let stream = self.quick.get_stream_no_info(&spec.name).await?;
        let consumer = stream.create_consumer(config).await?;
        if consumer.cached_info().num_pending == 0 {
            // Only fences from `from` on.
            return Ok(Vec::new());
        }
        let mut messages = consumer.messages().await?;
        let mut records = Vec::new();
        loop {
            // The consumer's server may die under it, and its replacement be placed where
            // nothing answers: a read waits for each message only so long.
            let message = match tokio::time::timeout(CONSUMER_WITHIN, messages.next()).await {
                Ok(Some(Ok(message))) => message,
                Ok(None) => break,
                // What was read stays good; the caller reads on after it.
                Ok(Some(Err(_))) | Err(_) if !records.is_empty() => break,
                Ok(Some(Err(error))) => return Err(error.into()),
                Err(elapsed) => return Err(elapsed.into()),
            };
            let info = message.info()?;
            records.push(Record {
                offset: info.stream_sequence - 1,
                payload: message.payload.to_vec(),
            });
            if records.len() >= max || info.pending == 0 {
                break;
            }
        }
        Ok(records)
    }

    /// Up to `max` records of `spec`'s stream from offset `from` to `end`, one request
    /// each: slower than a consumer, but answered by whichever server leads the stream.
    async fn read_one_by_one(
        &self,
        spec: &StreamSpec,
        from: Offset,
        end: Offset,
        max: usize,
    ) -> Result<Vec<Record>, LogError> {
        let mut records = Vec::new();
        let started = Instant::now();
        let mut attempt = 0;
        let mut offset = from;
        while offset < end && records.len() < max {
            let got = match self.quick.get_stream_no_info(&spec.name).await {
                Ok(stream) => stream.get_raw_message(offset + 1).await.map_err(|e| {
                    let gap = e.kind() == stream::RawMessageErrorKind::NoMessageFound;
                    (gap, e.to_string())
                }),
                Err(e) => Err((false, e.to_string())),
            };
            match got {
                Ok(message) => {
                    if message.subject.as_str() == spec.subject {
                        records.push(Record {
                            offset,
                            payload: message.payload.to_vec(),
                        });
                    }
                    offset += 1;
                }
                // A fence purged with the records below it, or never there.
                Err((true, _)) => offset += 1,
                Err((false, error)) if started.elapsed() >= RETRY_FOR => {
                    return Err(io(format!("{}: reading offset {offset}", spec.name), error));
                }
                Err((false, error)) => {
                    attempt += 1;
                    tracing::debug!(stream = %spec.name, attempt, "reading: {error}; retrying");
                    tokio::time::sleep(backoff(attempt)).await;
                }
            }
        }
        Ok(records)
    }

    fn partition(&self, partition: u32) -> Result<&Partition, LogError> {
        self.partitions
            .get(partition as usize)
            .ok_or(LogError::NoSuchPartition {
                partition,
                partitions: self.partitions(),
            })
    }
}

/// Fences `spec`'s stream: publishes a fence message expecting the last sequence read
/// while `authority` held the partition. Returns the sequence the fence got, which the
/// next write expects.
async fn fence(
    context: &jetstream::Context,
    spec: &StreamSpec,
    authority: &dyn Authority,
) -> Result<u64, LogError> {
    let started = Instant::now();
    let mut attempt = 0;
    loop {
        let last = last_sequence(context, &spec.name).await?;
        let holds = retrying(&format!("{}: asking for the lease", spec.name), || {
            authority.holds()
        })
        .await?;
        if !holds {
            return Err(LogError::Fenced {
                stream: spec.name.clone(),
            });
        }
        let publish = PublishMessage::build()
            .payload(Bytes::new())
            .expected_last_sequence(last);
        let result = match context.send_publish(spec.fence_subject(), publish).await {
            Ok(ack) => ack.await,
            Err(error) => Err(error),
        };
        match result {
            Ok(ack) => return Ok(ack.sequence),
            Err(error) if started.elapsed() >= RETRY_FOR => {
                return Err(io(format!("{}: fencing", spec.name), error));
            }
            Err(error) => {
                attempt += 1;
                tracing::debug!(stream = %spec.name, attempt, "fencing: {error}; retrying");
                tokio::time::sleep(backoff(attempt)).await;
            }
        }
    }
}

/// A partition's writer: the only task that publishes to its stream.
struct Writer {
    context: jetstream::Context,
    spec: StreamSpec,
    authority: Option<Arc<dyn Authority>>,
    /// Fenced logs: the sequence the stream's last message has before the next publish.
    expected: Option<u64>,
    fenced: Arc<AtomicBool>,
}

impl Writer {
    async fn run(mut self, mut queue: mpsc::UnboundedReceiver<Append>) {
        let mut batch = Vec::new();
        while queue.recv_many(&mut batch, MAX_BATCH).await > 0 {
            self.write(std::mem::take(&mut batch)).await;
        }
    }

    fn fenced_error(&self) -> LogError {
        LogError::Fenced {
            stream: self.spec.name.clone(),
        }
    }

    /// Publishes `batch` in order, retrying what fails until it lands, the log is fenced,
    /// or [`RETRY_FOR`] has passed.
    async fn write(&mut self, mut batch: Vec<Append>) {
        let started = Instant::now();
        let mut attempt = 0;
        loop {
            if self.fenced.load(Ordering::Acquire) {
                for append in batch {
                    let _ = append.done.send(Err(self.fenced_error()));
                }
                return;
            }
            let mut acks = Vec::with_capacity(batch.len());
            for append in &batch {
                let mut publish = PublishMessage::build()
                    .payload(append.payload.clone())
                    .message_id(&append.id);
                if let Some(expected) = &mut self.expected {
                    publish = publish.expected_last_sequence(*expected);
                    *expected += 1;
                }
                acks.push(
                    self.context
                        .send_publish(self.spec.subject.clone(), publish)
                        .await,
                );
            }
            let mut failed = Vec::new();
            let mut refused = false;
            let mut last_error = None;
            for (append, ack) in batch.into_iter().zip(acks) {
                let result = match ack {
                    Ok(ack) => ack.await,
                    Err(error) => Err(error),
                };
                match result {
                    Ok(ack) => {
                        let _ = append.done.send(Ok(ack.sequence - 1));
                    }
                    Err(error) => {
                        refused |= error.kind() == PublishErrorKind::WrongLastSequence;
                        last_error = Some(error.to_string());
                        failed.push(append);
                    }
                }
            }
            if failed.is_empty() {
                return;
            }
            batch = failed;
            if started.elapsed() >= RETRY_FOR {
                let error = last_error.unwrap_or_default();
                for append in batch {
                    let context = format!(
                        "appending to {} (retried for {RETRY_FOR:?})",
                        self.spec.subject
                    );
                    let _ = append.done.send(Err(io(context, &error)));
                }
                return;
            }
            attempt += 1;
            tracing::debug!(stream = %self.spec.name, attempt, "append failed: {last_error:?}; retrying");
            if !refused {
                tokio::time::sleep(backoff(attempt)).await;
            }
            if let Err(error) = self.resync().await {
                for append in batch {
                    let _ = append.done.send(Err(io(
                        format!("{}: after a failed append", self.spec.name),
                        &error,
                    )));
                }
                return;
            }
        }
    }

    /// A fenced writer whose chain broke: reads the stream's last sequence, then goes on
    /// from it if this host still holds the partition, or fences the log if not.
    async fn resync(&mut self) -> Result<(), LogError> {
        let Some(authority) = &self.authority else {
            return Ok(());
        };
        let last = last_sequence(&self.context, &self.spec.name).await?;
        let holds = retrying(&format!("{}: asking for the lease", self.spec.name), || {
            authority.holds()
        })
        .await?;
        if holds {
            self.expected = Some(last);
        } else {
            tracing::warn!(stream = %self.spec.name, "fenced: another host holds the partition");
            self.fenced.store(true, Ordering::Release);
        }
        Ok(())
    }
}

#[async_trait]
impl Log for JetStreamLog {
    fn partitions(&self) -> u32 {
        u32::try_from(self.partitions.len()).unwrap_or(u32::MAX)
    }

    async fn append(&self, partition: u32, payload: Vec<u8>) -> Result<Offset, LogError> {
        let partition = self.partition(partition)?;
        if partition.fenced.load(Ordering::Acquire) {
            return Err(LogError::Fenced {
                stream: partition.spec.name.clone(),
            });
        }
        let (done, offset) = oneshot::channel();
        let append = Append {
            id: format!("{:032x}", rand::random::<u128>()),
            payload: Bytes::from(payload),
            done,
        };
        partition
            .appends
            .send(append)
            .map_err(|_| LogError::Closed)?;
        offset.await.map_err(|_| LogError::Closed)?
    }

    async fn append_many(&self, records: Vec<(u32, Vec<u8>)>) -> Result<Vec<Offset>, LogError> {
        // Queued all at once, so that each partition's writer publishes them together.
        let mut waiting = Vec::with_capacity(records.len());
        for (partition, payload) in records {
            let partition = self.partition(partition)?;
            let (done, offset) = oneshot::channel();
            let append = Append {
                id: format!("{:032x}", rand::random::<u128>()),
                payload: Bytes::from(payload),
                done,
            };
            partition
                .appends
                .send(append)
                .map_err(|_| LogError::Closed)?;
            waiting.push(offset);
        }
        let mut offsets = Vec::with_capacity(waiting.len());
        for offset in waiting {
            offsets.push(offset.await.map_err(|_| LogError::Closed)??);
        }
        Ok(offsets)
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
        if from == end || max == 0 {
            return Ok(Vec::new());
        }
        let state = self.partition(partition)?;
        let spec = &state.spec;
        let one_by_one = |until: Option<Instant>| {
            let mut guard = state
                .one_by_one_until
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            match until {
                Some(until) => {
                    *guard = Some(until);
                    true
                }
                None => guard.is_some_and(|until| Instant::now() < until),
            }
        };
        if !one_by_one(None) {
            match self.replay(spec, from, max).await {
                Ok(records) => return Ok(records),
                Err(error) => {
                    tracing::debug!(stream = %spec.name, "replay: {error}; reading record by record for a while");
                    one_by_one(Some(Instant::now() + RETRY_FOR));
                }
            }
        }
        self.read_one_by_one(spec, from, end, max).await
    }
    async fn bounds(&self, partition: u32) -> Result<(Offset, Offset), LogError> {
        let spec = &self.partition(partition)?.spec;
        let info = retrying(&format!("{}: reading its bounds", spec.name), || async {
            let stream = self.quick.get_stream_no_info(&spec.name).await?;
            stream.get_info().await.map_err(async_nats::Error::from)
        })
        .await?;
        let end = info.state.last_sequence;
        let start = if info.state.messages == 0 {
            end
        } else {
            info.state.first_sequence - 1
        };
        Ok((start, end))
    }

    async fn delete_below(&self, partition: u32, offset: Offset) -> Result<(), LogError> {
        let spec = &self.partition(partition)?.spec;
        // Nothing below the start: and a purge up to the first sequence would purge all
        // (nats-server 2.9 does).
        if offset <= self.bounds(partition).await?.0 {
            return Ok(());
        }
        retrying(&format!("{}: purging", spec.name), || async {
            let stream = self.quick.get_stream_no_info(&spec.name).await?;
            stream
                .purge()
                .sequence(offset + 1)
                .await
                .map_err(async_nats::Error::from)
        })
        .await?;
        Ok(())
    }
}
