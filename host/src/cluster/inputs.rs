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
use super::error::{ClusterError, ensure};
use super::events::{Events, Verdict};
use crate::agent::input::{InputLine, LineError, MAX_EVENT_ID, parse_line};
use crate::checkpoint::Checkpoint;
use crate::keys::Retention;
use crate::log::jetstream::ensure_stream;
use crate::store::{Digest, KeyScope};

/// Whether `name` can be a subject token: letters, digits, `-` and `_`.
pub fn check_token(what: &str, name: &str) -> Result<(), ClusterError> {
    let valid = !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
    ensure(valid, || {
        format!("{what} `{name}` cannot name a subject: use letters, digits, `-` and `_`")
    })
}

impl Layout {
    pub fn input_stream(&self, partition: u32) -> String {
        format!("{}-in-{partition}", self.prefix)
    }

    pub fn input_subject(&self, tenant: &str, agent: &str, partition: u32) -> String {
        format!("{}.in.{tenant}.{agent}.{partition}", self.prefix)
    }

    /// Creates the input streams that do not exist.
    pub async fn create_input_streams(
        &self,
        context: &jetstream::Context,
    ) -> Result<(), ClusterError> {
        for partition in 0..self.partitions {
            let config = stream::Config {
                name: self.input_stream(partition),
                subjects: vec![format!("{}.in.*.*.{partition}", self.prefix)],
                num_replicas: self.replicas,
                ..stream::Config::default()
            };
            ensure_stream(context, &config)
                .await
                .map_err(ClusterError::log(|| format!("making {}", config.name)))?;
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
) -> Result<Published, ClusterError> {
    check_token("tenant", tenant)?;
    check_token("agent", agent)?;
    ensure(!key.is_empty(), || "the key is empty".to_owned())?;
    ensure(!id.is_empty() && id.len() <= MAX_EVENT_ID, || {
        format!(
            "the event id is {} bytes: an event id is 1 to {MAX_EVENT_ID} bytes",
            id.len()
        )
    })?;
    let payload: Box<serde_json::value::RawValue> = serde_json::from_str(payload)
        .map_err(|e| ClusterError::Refused(format!("the payload is not JSON: {e}")))?;
    let partition = KeyScope::new(tenant, agent, key).partition(layout.partitions);
    let line = serde_json::to_vec(&Line {
        id,
        key,
        payload: &payload,
    })
    .map_err(ClusterError::record(|| "an input's line"))?;
    // A header value of the id's digest: the id may hold any character.
    let message_id = Digest::of(&[tenant.as_bytes(), agent.as_bytes(), id.as_bytes()]);
    let message = PublishMessage::build()
        .payload(Bytes::from(line))
        .message_id(message_id.to_string());
    let subject = layout.input_subject(tenant, agent, partition);
    let ack = context
        .send_publish(subject.clone(), message)
        .await
        .map_err(ClusterError::nats(|| format!("publishing to {subject}")))?
        .await
        .map_err(ClusterError::nats(|| format!("publishing to {subject}")))?;
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
) -> Result<BoxStream<'static, Result<InputLine, LineError>>, ClusterError> {
    let name = layout.input_stream(partition);
    let subject = layout.input_subject(tenant, agent, partition);
    let wake = context
        .client()
        .subscribe(subject.clone())
        .await
        .map_err(ClusterError::nats(|| {
            format!("{name}: subscribing to {subject}")
        }))?;
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
        ahead: 0,
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
    /// How many messages past the next one the last read asked for at once.
    ahead: u64,
}

/// The most messages a reader asks for at once beyond the first, and the most event ids it
/// has judged at once. A reader that waited for each answer before asking again would cap a
/// partition at one input per two round trips to the server (a get and an event id's
/// create), whatever the agent's parallelism.
const READ_AHEAD: u64 = 63;

/// What the reader makes of the message at a position.
type Read = (u64, Option<Result<InputLine, LineError>>);

impl Reader {
    /// Reads until the receiver is dropped.
    async fn run(
        mut self,
        mut wake: async_nats::Subscriber,
        inputs: mpsc::Sender<Result<InputLine, LineError>>,
    ) {
        let mut attempt = 0;
        loop {
            let (read, failed) = self.next_inputs().await;
            let idle = read.is_empty() && failed.is_none();
            for (position, input) in read {
                self.next = position + 1;
                let Some(input) = input else { continue };
                if inputs.send(input).await.is_err() {
                    return;
                }
            }
            if let Some(error) = failed {
                attempt += 1;
                tracing::debug!(stream = %self.name, attempt, "reading inputs: {error}");
                tokio::select! {
                    () = inputs.closed() => return,
                    () = tokio::time::sleep(Duration::from_millis((50u64 << attempt.min(5)).min(1_000))) => {}
                }
                continue;
            }
            attempt = 0;
            if idle {
                tokio::select! {
                    () = inputs.closed() => return,
                    _ = wake.next() => {}
                    () = tokio::time::sleep(IDLE_LOOK) => {}
                }
                // Wake-ups of messages already read are spent here, not one by one.
                while let Ok(Some(_)) = tokio::time::timeout(Duration::ZERO, wake.next()).await {}
            }
        }
    }

    /// The next messages on the subject, in order, each at its position: the input, why it
    /// is not one, or nothing (a repeat of an event read before, dropped). An error stops
    /// the batch where it happened: what comes before it is returned with it.
    async fn next_inputs(&mut self) -> (Vec<Read>, Option<async_nats::Error>) {
        let messages = match self.get_batch().await {
            Ok(messages) => messages,
            Err(error) => return (Vec::new(), Some(error)),
        };
        let this = &*self;
        let mut read = Vec::with_capacity(messages.len());
        let mut parsed: Vec<_> = messages
            .into_iter()
            .map(|(position, payload)| (position, payload.map(|p| parse(&this.name, position, &p))))
            .collect();
        while !parsed.is_empty() {
            // Judged at once: a run with no event id twice. A second message of an id is
            // judged after the first, so the first is the one that runs.
            let ids = parsed.iter().map(|(_, message)| match message {
                Some(Ok(input)) => input.id.as_deref(),
                _ => None,
            });
            let judged_at_once = distinct_run(ids);
            let run: Vec<_> = parsed.drain(..judged_at_once).collect();
            let verdicts = futures_util::future::join_all(run.iter().map(|(position, message)| {
                let position = *position;
                async move {
                    match message {
                        Some(Ok(input)) => this
                            .events
                            .verdict(&this.tenant, &this.agent, this.partition, position, input)
                            .await
                            .map(Some),
                        _ => Ok(None),
                    }
                }
            }))
            .await;
            for ((position, message), verdict) in run.into_iter().zip(verdicts) {
                let verdict = match verdict {
                    Ok(verdict) => verdict,
                    Err(error) => return (read, Some(Box::new(error))),
                };
                let input = match message {
                    // Another agent's message.
                    None => None,
                    Some(Err(error)) => Some(Err(error)),
                    Some(Ok(input)) => this.judged(position, input, verdict),
                };
                read.push((position, input));
            }
        }
        (read, None)
    }

    /// What comes of `input` at `position` by its id's verdict (none: it has no id).
    fn judged(
        &self,
        position: u64,
        input: InputLine,
        verdict: Option<Verdict>,
    ) -> Option<Result<InputLine, LineError>> {
        let line = usize::try_from(position).unwrap_or(usize::MAX);
        match verdict {
            None | Some(Verdict::First) => Some(Ok(input)),
            Some(Verdict::Repeat {
                partition,
                position: first,
            }) => {
                tracing::info!(stream = %self.name, position, first_partition = partition,
                    first_position = first, id = ?input.id,
                    "an event published again; dropped");
                None
            }
            Some(Verdict::Reused {
                partition,
                position: first,
            }) => Some(Err(LineError {
                line,
                message: format!(
                    "event id {:?} was first published with another key or payload \
                     (message {first} of partition {partition}); an event id names one \
                     event",
                    input.id.as_deref().unwrap_or_default()
                ),
                stream: Some(self.name.clone()),
            })),
        }
    }

    /// The messages from the first one on the subject at or after `next` on, in order,
    /// each at its position, with its payload when it is on the subject (the stream holds
    /// other agents' subjects too). After the first, up to [`READ_AHEAD`] messages are
    /// asked for at once, by position, as many as the last batch found (doubled) while
    /// they keep being there; the batch ends before the first position that holds nothing
    /// (the stream's end, or a message deleted: the next batch looks past it by subject).
    async fn get_batch(&mut self) -> Result<Vec<(u64, Option<Bytes>)>, async_nats::Error> {
        let stream = self.context.get_stream_no_info(&self.name).await?;
        let first = match stream
            .raw_message_builder()
            .sequence(self.next)
            .next_by_subject(self.subject.clone())
            .send()
            .await
        {
            Ok(message) => message,
            Err(e) if e.kind() == RawMessageErrorKind::NoMessageFound => return Ok(Vec::new()),
            Err(e) => return Err(e.into()),
        };
        let ahead = self.ahead;
        let mut batch = vec![(first.sequence, Some(first.payload))];
        let mut later = futures_util::stream::iter(first.sequence + 1..=first.sequence + ahead)
            .map(|position| {
                let stream = &stream;
                async move { stream.raw_message_builder().sequence(position).send().await }
            })
            .buffered(usize::try_from(ahead.max(1)).unwrap_or(1));
        let mut found = 0;
        while let Some(Ok(message)) = later.next().await {
            found += 1;
            let ours = message.subject.as_str() == self.subject;
            batch.push((message.sequence, ours.then_some(message.payload)));
        }
        self.ahead = if found == ahead {
            (ahead * 2 + 1).min(READ_AHEAD)
        } else {
            found
        };
        Ok(batch)
    }
}

/// How many of `ids` from the first on hold no id twice (messages without one never
/// repeat): at least one, unless there are none.
fn distinct_run<'a>(ids: impl Iterator<Item = Option<&'a str>>) -> usize {
    let mut seen = std::collections::HashSet::new();
    let mut run = 0;
    for id in ids {
        if id.is_some_and(|id| !seen.insert(id)) {
            break;
        }
        run += 1;
    }
    run
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

#[cfg(test)]
mod tests {
    use super::distinct_run;

    #[test]
    fn a_run_judged_at_once_ends_before_an_id_it_holds_already() {
        let run = |ids: &[Option<&str>]| distinct_run(ids.iter().copied());
        assert_eq!(run(&[]), 0);
        assert_eq!(run(&[Some("a")]), 1);
        assert_eq!(run(&[Some("a"), None, None, Some("b")]), 4, "no id repeats");
        assert_eq!(run(&[Some("a"), Some("b"), Some("a"), Some("c")]), 2);
        assert_eq!(run(&[Some("a"), Some("a")]), 1, "the first runs alone");
    }
}
