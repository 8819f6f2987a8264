//! `JetStreamLog`: the log on NATS JetStream.
//!
//! One stream per partition; a record's offset is its stream sequence − 1, taken from the
//! publish acknowledgement. An append publishes at once and awaits its own acknowledgement,
//! so appends from many tasks are in flight together. It is retried (with backoff, for up to
//! [`RETRY_FOR`]) with the same `Nats-Msg-Id`, so a retry whose first attempt landed gets the
//! original sequence back instead of a second record. Reads replay through an ordered
//! consumer.
//!
//! A fenced log ([`JetStreamLog::open`] with an [`Authority`]) is one that a lease holder
//! writes. Its publishes form a chain: each carries `Nats-Expected-Last-Msg-Id`, the id of
//! the message it must follow (this host's previous publish), so the server takes it only
//! if nothing else came in between. Opening the log publishes a fence message (on the
//! partition's fence subject, which readers skip): from then on whatever an earlier holder
//! still sends expects one of its own messages to be the last, and is refused, however many
//! it had in flight. (An expected last *sequence* would not do: an earlier holder's
//! pipelined publish predicts the sequence its predecessor lands at, and one taken by the
//! fence makes the prediction come true.) A writer whose publish fails reads the id of the
//! stream's last message, then asks its authority whether it still holds the partition: if
//! so the chain goes on from there (the failure broke it), if not the log is fenced for
//! good.
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
use async_nats::jetstream::context::{PublishAckFuture, PublishError, PublishErrorKind};
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::{self, stream};
use async_trait::async_trait;
use bytes::Bytes;
use futures_util::StreamExt;

use super::{Log, LogError, Offset, Record};

/// How long JetStream remembers a `Nats-Msg-Id` (its default): well beyond the time an
/// append is retried, so that a retry of a publish that landed is always known.
const DUPLICATE_WINDOW: Duration = Duration::from_secs(120);

/// How long an operation is retried (the server restarting, a cluster electing a leader)
/// before it fails.
pub const RETRY_FOR: Duration = Duration::from_secs(30);

/// How long creating a replay consumer may take before a read gets its records one by one
/// instead: a cluster that has lost a node and not noticed yet (nats-server 2.9) may place
/// the consumer on the dead node, and then the creation never answers.
pub const CONSUMER_WITHIN: Duration = Duration::from_secs(2);

/// Decides whether this host may still write to a fenced partition.
#[async_trait]
pub trait Authority: Send + Sync + fmt::Debug {
    /// Whether this host still holds the partition. Asked after the stream's last message
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
    /// For publishes: their acknowledgements wait the client's default time.
    context: jetstream::Context,
    authority: Option<Arc<dyn Authority>>,
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
    /// Publishes take their place in the chain under this lock.
    chain: tokio::sync::Mutex<Chain>,
    fenced: AtomicBool,
}

/// Where a partition's writes stand.
#[derive(Debug)]
struct Chain {
    /// Fenced logs: the id of the message the next publish expects to follow (this host's
    /// previous publish, or its fence).
    expected: Option<String>,
    /// Moves at each resync: a writer whose publish failed resyncs only if no other writer
    /// has since it published.
    generation: u64,
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

/// The `Nats-Msg-Id` of the last message `name` holds: `None` when it holds none.
async fn last_message_id(
    context: &jetstream::Context,
    name: &str,
) -> Result<Option<String>, LogError> {
    let mut quick = context.clone();
    quick.set_timeout(CONSUMER_WITHIN);
    retrying(&format!("{name}: reading its last message"), || async {
        let stream = quick.get_stream_no_info(name).await?;
        let last = stream.get_info().await?.state.last_sequence;
        if last == 0 {
            return Ok(None);
        }
        match stream.get_raw_message(last).await {
            Ok(message) => Ok(message
                .headers
                .get(async_nats::header::NATS_MESSAGE_ID)
                .map(|id| id.as_str().to_owned())),
            // Purged since (only retention purges, and never the last): read again.
            Err(e) => Err(async_nats::Error::from(e)),
        }
    })
    .await
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
                duplicate_window: DUPLICATE_WINDOW,
                ..stream::Config::default()
            };
            retrying(&format!("creating stream {}", spec.name), || {
                context.get_or_create_stream(config.clone())
            })
            .await?;
            let expected = match &authority {
                Some(authority) => Some(fence(&context, &spec, &**authority).await?),
                None => None,
            };
            partitions.push(Partition {
                spec,
                one_by_one_until: std::sync::Mutex::new(None),
                chain: tokio::sync::Mutex::new(Chain {
                    expected,
                    generation: 0,
                }),
                fenced: AtomicBool::new(false),
            });
        }
        let mut quick = context.clone();
        quick.set_timeout(CONSUMER_WITHIN);
        Ok(Self {
            context,
            quick,
            authority,
            partitions,
        })
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

    /// Publishes `payload` with its id, taking its place in the partition's chain. Returns
    /// the acknowledgement to await and the chain's generation it was published in.
    async fn publish(
        &self,
        partition: &Partition,
        id: &str,
        payload: &Bytes,
    ) -> Result<(Result<PublishAckFuture, PublishError>, u64), LogError> {
        if partition.fenced.load(Ordering::Acquire) {
            return Err(self.fenced_error(partition));
        }
        if self.authority.is_none() {
            // No chain to keep: publishes need no order among themselves.
            let message = PublishMessage::build()
                .payload(payload.clone())
                .message_id(id);
            let ack = self
                .context
                .send_publish(partition.spec.subject.clone(), message)
                .await;
            return Ok((ack, 0));
        }
        let mut chain = partition.chain.lock().await;
        let mut message = PublishMessage::build()
            .payload(payload.clone())
            .message_id(id);
        if let Some(expected) = &mut chain.expected {
            message = message.expected_last_message_id(&*expected);
            id.clone_into(expected);
        }
        let ack = self
            .context
            .send_publish(partition.spec.subject.clone(), message)
            .await;
        Ok((ack, chain.generation))
    }

    /// Awaits a publish's acknowledgement, retrying the publish (same id) until it lands,
    /// the log is fenced, or [`RETRY_FOR`] has passed since `started`.
    async fn settle(
        &self,
        partition: &Partition,
        id: &str,
        payload: &Bytes,
        mut ack: Result<PublishAckFuture, PublishError>,
        mut generation: u64,
        started: Instant,
    ) -> Result<Offset, LogError> {
        let mut attempt = 0;
        loop {
            let error = match ack {
                Ok(future) => match future.await {
                    // A retry of a publish that landed gets the original sequence.
                    Ok(ack) => return Ok(ack.sequence - 1),
                    Err(error) => error,
                },
                Err(error) => error,
            };
            if started.elapsed() >= RETRY_FOR {
                return Err(io(
                    format!(
                        "appending to {} (retried for {RETRY_FOR:?})",
                        partition.spec.subject
                    ),
                    error,
                ));
            }
            attempt += 1;
            tracing::debug!(stream = %partition.spec.name, attempt, "append failed: {error}; retrying");
            // A refusal for a wrong last message is answered at once: the chain broke (a
            // publish before it failed) or the partition is someone else's now.
            if error.kind() != PublishErrorKind::WrongLastMessageId {
                tokio::time::sleep(backoff(attempt)).await;
            }
            self.resync(partition, generation).await?;
            (ack, generation) = self.publish(partition, id, payload).await?;
        }
    }

    /// A fenced writer whose publish in `generation` failed: unless another writer has
    /// resynced since, reads the id of the stream's last message and goes on from it if this host
    /// still holds the partition, or fences the log for good if not.
    async fn resync(&self, partition: &Partition, generation: u64) -> Result<(), LogError> {
        let mut chain = partition.chain.lock().await;
        if chain.generation != generation {
            return Ok(());
        }
        chain.generation += 1;
        let Some(authority) = &self.authority else {
            return Ok(());
        };
        let last = last_message_id(&self.context, &partition.spec.name).await?;
        let holds = retrying(
            &format!("{}: asking for the lease", partition.spec.name),
            || authority.holds(),
        )
        .await?;
        if !holds {
            tracing::warn!(stream = %partition.spec.name, "fenced: another host holds the partition");
            partition.fenced.store(true, Ordering::Release);
            return Err(self.fenced_error(partition));
        }
        chain.expected = last;
        Ok(())
    }

    fn fenced_error(&self, partition: &Partition) -> LogError {
        LogError::Fenced {
            stream: partition.spec.name.clone(),
        }
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

/// Fences `spec`'s stream: publishes a fence message, then asks `authority` whether this
/// host holds the partition (after, not before: a fence retried past a takeover would
/// otherwise land after the new holder's and reopen this host's chain). Returns the
/// fence's id, which the next write expects as the last.
async fn fence(
    context: &jetstream::Context,
    spec: &StreamSpec,
    authority: &dyn Authority,
) -> Result<String, LogError> {
    // Unconditional: it needs no quiet moment to land (an earlier holder may be writing
    // without pause), and whatever that holder sends after it expects one of its own
    // messages to be the last, which none will be again.
    let id = format!("fence-{:032x}", rand::random::<u128>());
    retrying(&format!("{}: fencing", spec.name), || async {
        let message = PublishMessage::build()
            .payload(Bytes::new())
            .message_id(&id);
        context
            .send_publish(spec.fence_subject(), message)
            .await?
            .await
    })
    .await?;
    let holds = retrying(&format!("{}: asking for the lease", spec.name), || {
        authority.holds()
    })
    .await?;
    if !holds {
        return Err(LogError::Fenced {
            stream: spec.name.clone(),
        });
    }
    Ok(id)
}

#[async_trait]
impl Log for JetStreamLog {
    fn partitions(&self) -> u32 {
        u32::try_from(self.partitions.len()).unwrap_or(u32::MAX)
    }

    async fn append(&self, partition: u32, payload: Vec<u8>) -> Result<Offset, LogError> {
        let partition = self.partition(partition)?;
        let id = format!("{:032x}", rand::random::<u128>());
        let payload = Bytes::from(payload);
        let (ack, generation) = self.publish(partition, &id, &payload).await?;
        self.settle(partition, &id, &payload, ack, generation, Instant::now())
            .await
    }

    async fn append_many(&self, records: Vec<(u32, Vec<u8>)>) -> Result<Vec<Offset>, LogError> {
        // Every record is published before any acknowledgement is awaited.
        let mut published = Vec::with_capacity(records.len());
        for (partition, payload) in records {
            let partition = self.partition(partition)?;
            let id = format!("{:032x}", rand::random::<u128>());
            let payload = Bytes::from(payload);
            let (ack, generation) = self.publish(partition, &id, &payload).await?;
            published.push((partition, id, payload, ack, generation));
        }
        let started = Instant::now();
        let mut offsets = Vec::with_capacity(published.len());
        for (partition, id, payload, ack, generation) in published {
            offsets.push(
                self.settle(partition, &id, &payload, ack, generation, started)
                    .await?,
            );
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
