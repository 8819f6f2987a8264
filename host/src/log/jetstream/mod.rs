//! `JetStreamLog`: the log on NATS JetStream.
//!
//! One stream per partition; a record's offset is its stream sequence − 1, taken from the
//! publish acknowledgement. Appends from many tasks are in flight together (an unfenced
//! append publishes at once and awaits its own acknowledgement). An append is retried (with
//! backoff, for up to [`RETRY_FOR`]) with the same `Nats-Msg-Id`, so a retry whose first
//! attempt landed gets the original sequence back instead of a second record. Reads replay
//! through an ordered consumer.
//!
//! A fenced log ([`JetStreamLog::open`] with an [`Authority`]) is one that a lease holder
//! writes. Opening it fences each partition's stream with messages on its fence subject
//! (readers skip them). After that, each write carries `Nats-Expected-Last-Sequence`, the
//! place its predecessor lands at, so the server takes it only if nothing else came in
//! between: whatever an earlier holder still sends expects a place before the fence, and is
//! refused. A partition's writes form one chain, its [`writer`]: several in flight, each
//! published by its own appender under the chain's lock, settled in order; its
//! documentation shows why an earlier holder's pipelined writes cannot land after the whole
//! fence. When a publish fails, the chain's mender reads where the stream ends and asks the
//! authority whether this host still holds the partition: if so it goes on from there, if
//! not the log is fenced for good.
//!
//! (The server also offers `Nats-Expected-Last-Msg-Id`, which chains writes by id and so
//! needs no predicting. nats-server 2.9 checks it against an id it keeps in memory and
//! rebuilds only within the duplicate window: a replica restarted after a quiet spell
//! refuses what the leader took and, once it leads, every write. The expected last sequence
//! is checked against the store.)
//!
//! Offsets therefore have gaps where fences are; readers never see them.
//!
//! Group commit ([`StreamSpec::group_commit`]): a fenced partition's appends that come
//! while one is in flight share the next message (see [`writer`]). A record's offset is
//! then `(sequence − 1) × 256 + its place in the message`; a message of several records
//! says how many in a `Rewind-Records` header. A stream is made one way or the other for
//! life, and says which in its description: a log opened the other way is refused.
//!
//! JetStream 2.9 acknowledges before fsync: a record is durable through replication (streams
//! of 3 replicas in production), not through one disk.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::consumer::{DeliverPolicy, pull};
use async_nats::jetstream::context::{PublishAckFuture, PublishError};
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::{self, stream};
use async_trait::async_trait;
use bytes::Bytes;
use futures_util::StreamExt;

use super::{Log, LogError, Offset, Record};

mod connect;
mod streams;
mod writer;

pub use connect::{NatsAuth, NatsConnect, NatsTls};

pub(crate) use streams::ensure_stream;

pub use writer::IN_FLIGHT;

/// How long JetStream remembers a `Nats-Msg-Id`: longer than an append is retried
/// ([`RETRY_FOR`], counted from its first publish) and its last attempt's acknowledgement
/// is awaited, so that a retry of a publish that landed is always known. Not JetStream's
/// default (2 minutes): a server keeps every id of the window in memory, and its garbage
/// collector scans them all.
const DUPLICATE_WINDOW: Duration = Duration::from_secs(45);

/// Room for an append's headers within the server's largest message: `Nats-Msg-Id` (32
/// hex digits) and `Nats-Expected-Last-Sequence` (up to 20 digits) take about 110 bytes.
const HEADERS: usize = 128;

/// More room on a stream with group commit, for the [`RECORDS`] header (`Rewind-Records:
/// 256`, 21 bytes) and a record's length in front of it (4).
const GROUPED: usize = 32;

/// The header of a message that holds several records (group commit): how many. Its
/// payload is each record's length (4 bytes, little-endian) followed by the record.
const RECORDS: &str = "Rewind-Records";

/// With group commit, an offset is `(sequence − 1) << PLACE_BITS | place in the message`.
const PLACE_BITS: u32 = 8;

/// The most records one message holds.
pub const PER_MESSAGE: usize = 1 << PLACE_BITS;

/// What a stream created for a log says of itself: how its offsets are made, so that a log
/// opened the other way is refused instead of misreading them.
const WITH_GROUP_COMMIT: &str = "rewind log: offset = (sequence - 1) * 256 + place in message";
const WITHOUT_GROUP_COMMIT: &str = "rewind log: offset = sequence - 1";

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
    /// `Ok(false)` fences the log for good; `Err` (the request that could not tell, with
    /// its cause) is retried.
    async fn holds(&self) -> Result<bool, async_nats::Error>;
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
    /// How long the server remembers a `Nats-Msg-Id`; it must outlast an append's retries
    /// ([`RETRY_FOR`]). 45 s unless a test shortens it.
    pub duplicate_window: Duration,
    /// Whether a fenced writer may put several records in one message when appends wait
    /// for the ones in flight (group commit). A record's offset is then
    /// `(sequence − 1) × 256 + its place in the message`, not `sequence − 1`; so this is a
    /// stream's for life: the stream records it, and a log opened the other way is refused.
    pub group_commit: bool,
}

impl StreamSpec {
    /// A stream with the log's duplicate window ([`DUPLICATE_WINDOW`]).
    pub fn new(name: impl Into<String>, subject: impl Into<String>, replicas: usize) -> Self {
        Self {
            name: name.into(),
            subject: subject.into(),
            replicas,
            duplicate_window: DUPLICATE_WINDOW,
            group_commit: false,
        }
    }

    /// The same stream, with group commit or without.
    pub fn group_commit(self, group_commit: bool) -> Self {
        Self {
            group_commit,
            ..self
        }
    }

    fn fence_subject(&self) -> String {
        format!("{}.fence", self.subject)
    }

    fn description(&self) -> &'static str {
        if self.group_commit {
            WITH_GROUP_COMMIT
        } else {
            WITHOUT_GROUP_COMMIT
        }
    }

    /// The offset of the record at `place` in the message at `sequence`.
    fn offset(&self, sequence: u64, place: usize) -> Offset {
        if self.group_commit {
            ((sequence - 1) << PLACE_BITS) | place as u64
        } else {
            sequence - 1
        }
    }

    /// The sequence of the message that holds (or would hold) `offset`.
    fn sequence(&self, offset: Offset) -> u64 {
        if self.group_commit {
            (offset >> PLACE_BITS) + 1
        } else {
            offset + 1
        }
    }

    /// The records of the message at `sequence`: one, or with group commit as many as its
    /// [`RECORDS`] header says.
    fn records(
        &self,
        sequence: u64,
        headers: Option<&async_nats::HeaderMap>,
        payload: Bytes,
    ) -> Result<Vec<Record>, LogError> {
        let Some(count) = headers.and_then(|headers| headers.get(RECORDS)) else {
            return Ok(vec![Record {
                offset: self.offset(sequence, 0),
                payload: payload.to_vec(),
            }]);
        };
        let corrupt = |message: String| LogError::Corrupt {
            path: format!("stream {}, message {sequence}", self.name),
            message,
        };
        if !self.group_commit {
            return Err(corrupt(format!(
                "it holds several records (group commit), but the log was opened without group \
                 commit ({RECORDS}: {count})"
            )));
        }
        let count: usize = count
            .as_str()
            .parse()
            .ok()
            .filter(|count| (1..=PER_MESSAGE).contains(count))
            .ok_or_else(|| {
                corrupt(format!(
                    "{RECORDS}: {count} is not a count of 1 to {PER_MESSAGE}"
                ))
            })?;
        let mut records = Vec::with_capacity(count);
        let mut rest = &payload[..];
        for place in 0..count {
            let length = rest
                .split_first_chunk::<4>()
                .map(|(length, tail)| {
                    rest = tail;
                    u32::from_le_bytes(*length) as usize
                })
                .filter(|length| *length <= rest.len())
                .ok_or_else(|| {
                    corrupt(format!(
                        "record {place} of {count} runs past the message's {} bytes",
                        payload.len()
                    ))
                })?;
            let (record, tail) = rest.split_at(length);
            records.push(Record {
                offset: self.offset(sequence, place),
                payload: record.to_vec(),
            });
            rest = tail;
        }
        if !rest.is_empty() {
            return Err(corrupt(format!(
                "{} bytes follow its {count} records",
                rest.len()
            )));
        }
        Ok(records)
    }
}

/// Adds `record` to the payload of a message of several, as [`StreamSpec::records`] reads
/// it.
fn frame(framed: &mut Vec<u8>, record: &[u8]) {
    let length = u32::try_from(record.len()).expect("a record fits a message");
    framed.extend_from_slice(&length.to_le_bytes());
    framed.extend_from_slice(record);
}

/// A log over JetStream streams.
#[derive(Debug)]
pub struct JetStreamLog {
    /// For publishes: their acknowledgements wait the client's default time.
    context: jetstream::Context,
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
    /// Fenced logs: the task that writes the partition.
    writer: Option<writer::Handle>,
    /// The largest record an append takes ([`max_record`]).
    max_record: usize,
}

/// An append of [`JetStreamLog::append_many`] on its way.
enum Published<'a> {
    Fenced(tokio::sync::oneshot::Receiver<Result<Offset, LogError>>),
    Unfenced(
        &'a Partition,
        String,
        Bytes,
        Result<PublishAckFuture, PublishError>,
    ),
}

/// A new append's `Nats-Msg-Id`: random, and the same in every attempt at that append.
fn message_id() -> String {
    format!("{:032x}", rand::random::<u128>())
}

fn io(context: impl Into<String>, error: impl fmt::Display) -> LogError {
    LogError::Io {
        context: context.into(),
        source: std::io::Error::other(error.to_string()),
    }
}

/// The wait before attempt `attempt` (from 1) of a retried operation.
pub(crate) fn backoff(attempt: u32) -> Duration {
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

/// The largest record an append to `spec`'s stream takes: the server's largest message,
/// less room for the headers (and with group commit, a record's length). Known once the
/// server has answered a request: the client has heard its INFO by then. (0 would be a
/// server that never said.)
fn max_record(context: &jetstream::Context, spec: &StreamSpec) -> usize {
    let room = if spec.group_commit {
        HEADERS + GROUPED
    } else {
        HEADERS
    };
    match context.client().server_info().max_payload {
        0 => usize::MAX - room,
        max => max.saturating_sub(room),
    }
}

/// Connects to NATS at `urls` with no credentials and no TLS options: see
/// [`NatsConnect::connect`].
pub async fn connect(urls: &str) -> Result<async_nats::Client, LogError> {
    NatsConnect::new(urls).connect().await
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
            .map(|partition| {
                StreamSpec::new(
                    format!("{prefix}-{partition}"),
                    format!("{prefix}.{partition}"),
                    replicas,
                )
            })
            .collect();
        Self::open(jetstream::new(client), streams, None).await
    }

    /// Opens a log whose partition P is `streams[P]`, creating the streams that do not
    /// exist. With an `authority`, the log is fenced: each stream is fenced now (so that an
    /// earlier writer can no longer write), and every write expects the sequence this host
    /// last wrote at; see the module's documentation.
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
                duplicate_window: spec.duplicate_window,
                description: Some(spec.description().to_owned()),
                ..stream::Config::default()
            };
            let stream = ensure_stream(&context, &config).await?;
            // A stream made before streams said how, or by hand, is without.
            let made_with =
                stream.cached_info().config.description.as_deref() == Some(WITH_GROUP_COMMIT);
            if made_with != spec.group_commit {
                return Err(LogError::StreamMade {
                    stream: spec.name,
                    group_commit: made_with,
                });
            }
            let max_record = max_record(&context, &spec);
            let writer = match &authority {
                Some(authority) => Some(
                    writer::start(&context, &spec, Arc::clone(authority), max_record + 4).await?,
                ),
                None => None,
            };
            partitions.push(Partition {
                spec,
                one_by_one_until: std::sync::Mutex::new(None),
                writer,
                max_record,
            });
        }
        let mut quick = context.clone();
        quick.set_timeout(CONSUMER_WITHIN);
        Ok(Self {
            context,
            quick,
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
                start_sequence: spec.sequence(from),
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
            let pending = info.pending;
            let read = spec.records(
                info.stream_sequence,
                message.headers.as_ref(),
                message.payload.clone(),
            )?;
            records.extend(read.into_iter().filter(|record| record.offset >= from));
            if records.len() >= max || pending == 0 {
                break;
            }
        }
        records.truncate(max);
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
        let (mut sequence, last) = (spec.sequence(from), spec.sequence(end));
        while sequence < last && records.len() < max {
            let got = match self.quick.get_stream_no_info(&spec.name).await {
                Ok(stream) => stream.get_raw_message(sequence).await.map_err(|e| {
                    let gap = e.kind() == stream::RawMessageErrorKind::NoMessageFound;
                    (gap, e.to_string())
                }),
                Err(e) => Err((false, e.to_string())),
            };
            match got {
                Ok(message) => {
                    if message.subject.as_str() == spec.subject {
                        let read =
                            spec.records(sequence, Some(&message.headers), message.payload)?;
                        records.extend(read.into_iter().filter(|record| record.offset >= from));
                    }
                    sequence += 1;
                }
                // A fence purged with the records below it, or never there.
                Err((true, _)) => sequence += 1,
                Err((false, error)) if started.elapsed() >= RETRY_FOR => {
                    return Err(io(
                        format!("{}: reading message {sequence}", spec.name),
                        error,
                    ));
                }
                Err((false, error)) => {
                    attempt += 1;
                    tracing::debug!(stream = %spec.name, attempt, "reading: {error}; retrying");
                    tokio::time::sleep(backoff(attempt)).await;
                }
            }
        }
        records.truncate(max);
        Ok(records)
    }

    /// Appends to an unfenced partition: publishes at once, so appends from many tasks are
    /// in flight together, and retries with the same id until the publish lands or
    /// [`RETRY_FOR`] has passed since `started`.
    async fn settle_unfenced(
        &self,
        partition: &Partition,
        id: &str,
        payload: &Bytes,
        mut ack: Result<PublishAckFuture, PublishError>,
        started: Instant,
    ) -> Result<Offset, LogError> {
        let mut attempt = 0;
        loop {
            let error = match ack {
                // A retry of a publish that landed gets the original sequence.
                Ok(future) => match future.await {
                    Ok(ack) => return Ok(partition.spec.offset(ack.sequence, 0)),
                    Err(error) => error,
                },
                Err(error) => error,
            };
            if started.elapsed() >= RETRY_FOR {
                return Err(self.gave_up(partition, error));
            }
            attempt += 1;
            tracing::debug!(stream = %partition.spec.name, attempt, "append failed: {error}; retrying");
            tokio::time::sleep(backoff(attempt)).await;
            ack = self.send(partition, id, payload).await;
        }
    }

    /// Publishes `payload` with its id to an unfenced partition, and returns the
    /// acknowledgement to await.
    async fn send(
        &self,
        partition: &Partition,
        id: &str,
        payload: &Bytes,
    ) -> Result<PublishAckFuture, PublishError> {
        let message = PublishMessage::build()
            .payload(payload.clone())
            .message_id(id);
        self.context
            .send_publish(partition.spec.subject.clone(), message)
            .await
    }

    fn gave_up(&self, partition: &Partition, error: PublishError) -> LogError {
        io(
            format!(
                "appending to {} (retried for {RETRY_FOR:?})",
                partition.spec.subject
            ),
            error,
        )
    }

    /// Refuses a record larger than the server takes, at once: retried, it would fail for
    /// [`RETRY_FOR`], and on a fenced partition hold up every append behind it meanwhile.
    fn fits(partition: &Partition, payload: &[u8]) -> Result<(), LogError> {
        if payload.len() > partition.max_record {
            return Err(LogError::TooLarge {
                size: payload.len(),
                max: partition.max_record,
            });
        }
        Ok(())
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

#[async_trait]
impl Log for JetStreamLog {
    fn partitions(&self) -> u32 {
        u32::try_from(self.partitions.len()).unwrap_or(u32::MAX)
    }

    fn max_record(&self, partition: u32) -> usize {
        self.partition(partition).map_or(0, |p| p.max_record)
    }

    async fn append(&self, partition: u32, payload: Vec<u8>) -> Result<Offset, LogError> {
        let partition = self.partition(partition)?;
        Self::fits(partition, &payload)?;
        let payload = Bytes::from(payload);
        if let Some(writer) = &partition.writer {
            return writer.publish(payload).await.settled().await;
        }
        let id = message_id();
        let ack = self.send(partition, &id, &payload).await;
        self.settle_unfenced(partition, &id, &payload, ack, Instant::now())
            .await
    }

    async fn append_many(&self, records: Vec<(u32, Vec<u8>)>) -> Result<Vec<Offset>, LogError> {
        for (partition, payload) in &records {
            Self::fits(self.partition(*partition)?, payload)?;
        }
        // Every record is published before any acknowledgement is awaited; a fenced one's is
        // awaited by a task of its own meanwhile (see `writer::Pending::detach`).
        let mut published = Vec::with_capacity(records.len());
        for (partition, payload) in records {
            let partition = self.partition(partition)?;
            let payload = Bytes::from(payload);
            published.push(match &partition.writer {
                Some(writer) => Published::Fenced(writer.publish(payload).await.detach()),
                None => {
                    let id = message_id();
                    let ack = self.send(partition, &id, &payload).await;
                    Published::Unfenced(partition, id, payload, ack)
                }
            });
        }
        let started = Instant::now();
        let mut offsets = Vec::with_capacity(published.len());
        for published in published {
            offsets.push(match published {
                Published::Fenced(receiver) => receiver.await.unwrap_or(Err(LogError::Closed))?,
                Published::Unfenced(partition, id, payload, ack) => {
                    self.settle_unfenced(partition, &id, &payload, ack, started)
                        .await?
                }
            });
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
                // A message this log cannot read: no other way reads it either.
                Err(error) if error.is::<LogError>() => {
                    return Err(*error.downcast::<LogError>().expect("is a LogError"));
                }
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
        // Where the next message lands, and the first one still held.
        let end = spec.offset(info.state.last_sequence + 1, 0);
        let start = if info.state.messages == 0 {
            end
        } else {
            spec.offset(info.state.first_sequence, 0)
        };
        Ok((start, end))
    }

    async fn delete_below(&self, partition: u32, offset: Offset) -> Result<(), LogError> {
        let spec = &self.partition(partition)?.spec;
        // Nothing below the start's message: and a purge up to the first sequence would
        // purge all (nats-server 2.9 does).
        if spec.sequence(offset) <= spec.sequence(self.bounds(partition).await?.0) {
            return Ok(());
        }
        retrying(&format!("{}: purging", spec.name), || async {
            let stream = self.quick.get_stream_no_info(&spec.name).await?;
            stream
                .purge()
                .sequence(spec.sequence(offset))
                .await
                .map_err(async_nats::Error::from)
        })
        .await?;
        Ok(())
    }
}
