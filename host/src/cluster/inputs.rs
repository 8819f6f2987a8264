//! The input source: events on JetStream subjects by tenant, agent and partition.
//!
//! Partition P's inputs are stream `PREFIX-in-P`, which takes the subjects
//! `PREFIX.in.TENANT.AGENT.P`. An event goes to its key's partition, the same hash the store
//! uses for its states (`KeyScope::partition`). Its message is the line `rewind run` reads,
//! `{"id": ..., "key": ..., "payload": ...}`; its position is its stream sequence, which a
//! checkpoint records and a host that takes the partition over resumes after. An event
//! published again is dropped by its id ([`Events`]). Once no kept checkpoint needs them, an
//! agent's inputs are purged ([`InputRetention`]).

use std::time::Duration;

use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::stream::RawMessageErrorKind;
use async_nats::jetstream::{self, stream};
use async_trait::async_trait;
use bytes::Bytes;
use futures_util::StreamExt as _;
use futures_util::stream::BoxStream;
use serde::Serialize;
use tokio::sync::mpsc;

use super::Layout;
use super::events::{Events, Verdict};
use crate::agent::Retention;
use crate::agent::input::{InputLine, LineError, MAX_EVENT_ID, parse_line};
use crate::checkpoint::Checkpoint;
use crate::log::jetstream::ensure_stream;
use crate::store::{Digest, KeyScope};

/// Whether `name` can be a subject token: letters, digits, `-` and `_`.
pub fn check_token(what: &str, name: &str) -> anyhow::Result<()> {
    let valid = !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
    anyhow::ensure!(
        valid,
        "{what} `{name}` cannot name a subject: use letters, digits, `-` and `_`"
    );
    Ok(())
}

impl Layout {
    pub fn input_stream(&self, partition: u32) -> String {
        format!("{}-in-{partition}", self.prefix)
    }

    pub fn input_subject(&self, tenant: &str, agent: &str, partition: u32) -> String {
        format!("{}.in.{tenant}.{agent}.{partition}", self.prefix)
    }

    /// Creates the input streams that do not exist.
    pub async fn create_input_streams(&self, context: &jetstream::Context) -> anyhow::Result<()> {
        for partition in 0..self.partitions {
            let config = stream::Config {
                name: self.input_stream(partition),
                subjects: vec![format!("{}.in.*.*.{partition}", self.prefix)],
                num_replicas: self.replicas,
                ..stream::Config::default()
            };
            ensure_stream(context, &config).await?;
        }
        Ok(())
    }
}

#[derive(Serialize)]
struct Line<'a> {
    id: &'a str,
    key: &'a str,
    payload: &'a serde_json::value::RawValue,
}

/// Where an event was published.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Published {
    pub partition: u32,
    /// Its position in the partition's input stream.
    pub position: u64,
    /// JetStream had it already (a publish of the same id within its duplicate window):
    /// nothing new was published.
    pub duplicate: bool,
}

/// Publishes event `id` for `tenant`'s `agent` to its key's partition, once JetStream has
/// it.
///
/// The id names the event: publishing it again (a retried publish, a file published
/// again) is dropped, by JetStream within its duplicate window and by the host that reads
/// the partition after it ([`Events`](super::events::Events)).
pub async fn publish(
    context: &jetstream::Context,
    layout: &Layout,
    tenant: &str,
    agent: &str,
    id: &str,
    key: &str,
    payload: &str,
) -> anyhow::Result<Published> {
    check_token("tenant", tenant)?;
    check_token("agent", agent)?;
    anyhow::ensure!(!key.is_empty(), "the key is empty");
    anyhow::ensure!(
        !id.is_empty() && id.len() <= MAX_EVENT_ID,
        "the event id is {} bytes: an event id is 1 to {MAX_EVENT_ID} bytes",
        id.len()
    );
    let payload: Box<serde_json::value::RawValue> = serde_json::from_str(payload)
        .map_err(|e| anyhow::anyhow!("the payload is not JSON: {e}"))?;
    let partition = KeyScope::new(tenant, agent, key).partition(layout.partitions);
    let line = serde_json::to_vec(&Line {
        id,
        key,
        payload: &payload,
    })?;
    // A header value of the id's digest: the id may hold any character.
    let message_id = Digest::of(&[tenant.as_bytes(), agent.as_bytes(), id.as_bytes()]);
    let message = PublishMessage::build()
        .payload(Bytes::from(line))
        .message_id(message_id.to_string());
    let subject = layout.input_subject(tenant, agent, partition);
    let ack = context
        .send_publish(subject.clone(), message)
        .await
        .map_err(|e| anyhow::anyhow!("publishing to {subject}: {e}"))?
        .await
        .map_err(|e| anyhow::anyhow!("publishing to {subject}: {e}"))?;
    Ok(Published {
        partition,
        position: ack.sequence,
        duplicate: ack.duplicate,
    })
}

/// The id of the event a line of an input file names: its `id`, or else one made from its
/// key, its payload and how many lines with that key and payload came before it in the
/// file. So publishing the same file again names the same events (and they are dropped),
/// and two equal lines are two events.
pub fn event_id(line: &InputLine, earlier: u64) -> String {
    match &line.id {
        Some(id) => id.clone(),
        None => format!(
            "line-{}",
            Digest::of(&[
                line.key.as_bytes(),
                line.payload.as_bytes(),
                &earlier.to_le_bytes()
            ])
        ),
    }
}

/// How long an idle reader waits for a wake-up before it looks again anyway.
const IDLE_LOOK: Duration = Duration::from_secs(1);

/// The inputs of `tenant`'s `agent` in `partition`, from position `after` + 1 on, as they
/// arrive. A message that is not an input is a [`LineError`] at its position.
///
/// Each input is a get of the next message on its subject from the stream's leader (no
/// consumer: nats-server 2.9 may place a consumer on a server that has died, where it never
/// answers). A plain subscription to the subject wakes the reader when an input is
/// published; without one it looks again every [`IDLE_LOOK`].
pub async fn subscribe(
    context: &jetstream::Context,
    layout: &Layout,
    events: &Events,
    tenant: &str,
    agent: &str,
    partition: u32,
    after: u64,
) -> anyhow::Result<BoxStream<'static, Result<InputLine, LineError>>> {
    let name = layout.input_stream(partition);
    let subject = layout.input_subject(tenant, agent, partition);
    let wake = context
        .client()
        .subscribe(subject.clone())
        .await
        .map_err(|e| anyhow::anyhow!("{name}: subscribing to {subject}: {e}"))?;
    let (inputs, queue) = mpsc::channel(256);
    let reader = Reader {
        context: context.clone(),
        events: events.clone(),
        tenant: tenant.to_owned(),
        agent: agent.to_owned(),
        partition,
        name,
        subject,
        next: after + 1,
    };
    tokio::spawn(reader.run(wake, inputs));
    Ok(Box::pin(futures_util::stream::unfold(
        queue,
        |mut queue| async move { queue.recv().await.map(|input| (input, queue)) },
    )))
}

struct Reader {
    context: jetstream::Context,
    /// Which event ids were seen first where.
    events: Events,
    tenant: String,
    agent: String,
    partition: u32,
    name: String,
    subject: String,
    /// The position to look from.
    next: u64,
}

impl Reader {
    /// Reads until the receiver is dropped.
    async fn run(
        mut self,
        mut wake: async_nats::Subscriber,
        inputs: mpsc::Sender<Result<InputLine, LineError>>,
    ) {
        let mut attempt = 0;
        loop {
            match self.next_input().await {
                Ok(Some((position, input))) => {
                    attempt = 0;
                    self.next = position + 1;
                    let Some(input) = input else { continue };
                    if inputs.send(input).await.is_err() {
                        return;
                    }
                }
                Ok(None) => {
                    attempt = 0;
                    tokio::select! {
                        () = inputs.closed() => return,
                        _ = wake.next() => {}
                        () = tokio::time::sleep(IDLE_LOOK) => {}
                    }
                    // Wake-ups of messages already read are spent here, not one by one.
                    while let Ok(Some(_)) = tokio::time::timeout(Duration::ZERO, wake.next()).await
                    {
                    }
                }
                Err(error) => {
                    attempt += 1;
                    tracing::debug!(stream = %self.name, attempt, "reading inputs: {error}");
                    tokio::select! {
                        () = inputs.closed() => return,
                        () = tokio::time::sleep(Duration::from_millis((50u64 << attempt.min(5)).min(1_000))) => {}
                    }
                }
            }
        }
    }

    /// The next message on the subject, at its position: the input, why it is not one, or
    /// nothing (a repeat of an event read before, dropped).
    async fn next_input(
        &self,
    ) -> Result<Option<(u64, Option<Result<InputLine, LineError>>)>, async_nats::Error> {
        let Some((position, payload)) = self.get_next().await? else {
            return Ok(None);
        };
        let input = match parse(&self.name, position, &payload) {
            Ok(input) => input,
            Err(error) => return Ok(Some((position, Some(Err(error))))),
        };
        let verdict = self
            .events
            .verdict(&self.tenant, &self.agent, self.partition, position, &input)
            .await
            .map_err(|e| async_nats::Error::from(e.to_string()))?;
        let line = usize::try_from(position).unwrap_or(usize::MAX);
        Ok(Some((
            position,
            match verdict {
                Verdict::First => Some(Ok(input)),
                Verdict::Repeat {
                    partition,
                    position: first,
                } => {
                    tracing::info!(stream = %self.name, position, first_partition = partition,
                        first_position = first, id = ?input.id,
                        "an event published again; dropped");
                    None
                }
                Verdict::Reused {
                    partition,
                    position: first,
                } => Some(Err(LineError {
                    line,
                    message: format!(
                        "event id {:?} was first published with another key or payload \
                         (message {first} of partition {partition}); an event id names one \
                         event",
                        input.id.as_deref().unwrap_or_default()
                    ),
                    stream: Some(self.name.clone()),
                })),
            },
        )))
    }

    /// The first message on the subject at or after `next`: its position and payload.
    async fn get_next(&self) -> Result<Option<(u64, Bytes)>, async_nats::Error> {
        let stream = self.context.get_stream_no_info(&self.name).await?;
        match stream
            .raw_message_builder()
            .sequence(self.next)
            .next_by_subject(self.subject.clone())
            .send()
            .await
        {
            Ok(message) => Ok(Some((message.sequence, message.payload))),
            Err(e) if e.kind() == RawMessageErrorKind::NoMessageFound => Ok(None),
            Err(e) => Err(e.into()),
        }
    }
}

/// The input at `position` of stream `stream`, or why it is not one.
fn parse(stream: &str, position: u64, payload: &[u8]) -> Result<InputLine, LineError> {
    let line = usize::try_from(position).unwrap_or(usize::MAX);
    let not_an_input = |message: String| LineError {
        line,
        message,
        stream: Some(stream.to_owned()),
    };
    let text =
        std::str::from_utf8(payload).map_err(|_| not_an_input("not UTF-8 text".to_owned()))?;
    match parse_line(line, text) {
        Ok(Some(input)) => Ok(input),
        Ok(None) => Err(not_an_input("an empty message".to_owned())),
        Err(error) => Err(not_an_input(error.message)),
    }
}

/// Retention of one agent's inputs in a partition: the messages of its subject up to the
/// oldest kept checkpoint's position are purged. (Those the checkpoint had not seen
/// finish are in it, and rerun from there.)
#[derive(Debug)]
pub struct InputRetention {
    context: jetstream::Context,
    stream: String,
    subject: String,
    /// What is purged already: below this position. A checkpoint that has not moved the
    /// oldest one on asks nothing of the server.
    purged_below: std::sync::atomic::AtomicU64,
}

impl InputRetention {
    pub fn new(
        context: &jetstream::Context,
        layout: &Layout,
        tenant: &str,
        agent: &str,
        partition: u32,
    ) -> Self {
        Self {
            context: context.clone(),
            stream: layout.input_stream(partition),
            subject: layout.input_subject(tenant, agent, partition),
            purged_below: std::sync::atomic::AtomicU64::new(0),
        }
    }
}

#[async_trait]
impl Retention for InputRetention {
    async fn retain(&self, oldest: &Checkpoint) {
        let below = oldest.input_position + 1;
        if below <= self.purged_below.load(std::sync::atomic::Ordering::Acquire) {
            return;
        }
        let purged = async {
            let stream = self.context.get_stream_no_info(&self.stream).await?;
            // Nothing below the stream's first message: and nats-server 2.9 purges
            // everything when asked to purge up to it.
            if below <= stream.get_info().await?.state.first_sequence {
                return Ok(());
            }
            stream.purge().filter(&self.subject).sequence(below).await?;
            Ok::<_, async_nats::Error>(())
        }
        .await;
        match purged {
            Ok(()) => self
                .purged_below
                .store(below, std::sync::atomic::Ordering::Release),
            Err(e) => tracing::warn!(stream = %self.stream, "purging the inputs read: {e}"),
        }
    }
}
