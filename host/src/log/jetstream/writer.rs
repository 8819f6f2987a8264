//! The writer of one fenced partition: a task that publishes the partition's appends with
//! up to [`IN_FLIGHT`] in flight, each expecting the stream's last sequence to be where its
//! predecessor lands, and settles them strictly in the order it published them.
//!
//! Why that order matters. A publish expecting sequence S lands only if the stream's last
//! message is at S when it arrives. A pipelined publish predicts S (its predecessor is not
//! acknowledged yet), so a foreign message (a new holder's fence) that takes the place the
//! predecessor was to take makes the prediction come true: the next publish lands after
//! the fence. What bounds the damage: the predecessor is refused, and the writer learns of
//! that before it learns of anything that landed after it, so it publishes nothing more
//! until it has asked whether it still holds the partition. Every publish it made predicts
//! at most [`IN_FLIGHT`] places past the last one acknowledged to it in order, which is
//! before the fence; so none of its messages can land more than `IN_FLIGHT - 1` places after
//! the fence's first message. A fence ([`start`]) is `IN_FLIGHT` messages: once they are
//! acknowledged, nothing an earlier holder sent can land after them, and whatever landed
//! between them is read by the new holder's recovery like anything else before its fence.
//!
//! Two things keep "the last one acknowledged in order" honest: an acknowledgement counts
//! only if it is for the place its publish expected (a retry whose first attempt had
//! landed is answered with that attempt's place, and breaks the chain like a failure);
//! and what a broken chain's later publishes were acknowledged with never moves it (they
//! may have landed after a fence). Nothing is published again until the writer has read
//! where the stream ends *and* heard from its authority that it still holds the partition.

use std::collections::VecDeque;
use std::future::IntoFuture as _;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use async_nats::jetstream::context::{PublishError, PublishErrorKind};
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::{self, publish::PublishAck};
use bytes::Bytes;
use tokio::sync::{mpsc, oneshot};

use super::{Authority, CONSUMER_WITHIN, RETRY_FOR, StreamSpec, backoff, io, retrying};
use crate::log::{LogError, Offset};

/// How many publishes one partition's writer has in flight at most; also how many messages
/// a fence is (see the module's documentation). Every host must use the same number.
pub const IN_FLIGHT: usize = 32;

type AckFuture = Pin<Box<dyn Future<Output = Result<PublishAck, PublishError>> + Send>>;
type Reply = oneshot::Sender<Result<Offset, LogError>>;
/// An append as submitted: its payload, who waits for it, and since when.
type Request = (Bytes, Reply, Instant);

/// Where a fenced partition's appends go.
#[derive(Debug)]
pub struct Handle {
    requests: mpsc::UnboundedSender<Request>,
    fenced: Arc<AtomicBool>,
    stream: String,
}

impl Handle {
    /// Queues `payload`; the receiver gets its offset once it has landed. Appends queued
    /// one after another are published in that order.
    pub fn submit(&self, payload: Bytes) -> oneshot::Receiver<Result<Offset, LogError>> {
        let (reply, receiver) = oneshot::channel();
        if self.fenced.load(Ordering::Acquire) {
            let _ = reply.send(Err(fenced(&self.stream)));
        } else if let Err(mpsc::error::SendError((_, reply, _))) =
            self.requests.send((payload, reply, Instant::now()))
        {
            let _ = reply.send(Err(LogError::Closed));
        }
        receiver
    }

    /// What a submitted append came to.
    pub async fn settled(
        receiver: oneshot::Receiver<Result<Offset, LogError>>,
    ) -> Result<Offset, LogError> {
        receiver.await.unwrap_or(Err(LogError::Closed))
    }
}

fn fenced(stream: &str) -> LogError {
    LogError::Fenced {
        stream: stream.to_owned(),
    }
}

/// Fences `spec`'s stream and starts its writer. The fence is [`IN_FLIGHT`] messages on the
/// fence subject, published without condition (an earlier holder may be writing without
/// pause: a conditional fence could wait for ever); then `authority` is asked whether this
/// host holds the partition (after, not before: a fence retried past a takeover would
/// otherwise land after the new holder's). The writer's first publish expects the last
/// fence message's sequence.
pub async fn start(
    context: &jetstream::Context,
    spec: &StreamSpec,
    authority: Arc<dyn Authority>,
) -> Result<Handle, LogError> {
    let fence_subject = spec.fence_subject();
    let mut acks = Vec::with_capacity(IN_FLIGHT);
    for _ in 0..IN_FLIGHT {
        let id = format!("fence-{:032x}", rand::random::<u128>());
        let ack = context
            .send_publish(fence_subject.clone(), fence_message(&id))
            .await;
        acks.push((id, ack));
    }
    // Awaited together: each acknowledgement's timeout starts when it is awaited.
    let acks = futures_util::future::join_all(acks.into_iter().map(|(id, ack)| async move {
        let first = match ack {
            Ok(future) => future.await,
            Err(error) => Err(error),
        };
        (id, first)
    }))
    .await;
    let mut last = 0;
    for (id, first) in acks {
        let ack = match first {
            Ok(ack) => ack,
            Err(_) => {
                retrying(&format!("{}: fencing", spec.name), || async {
                    context
                        .send_publish(fence_subject.clone(), fence_message(&id))
                        .await?
                        .await
                })
                .await?
            }
        };
        last = last.max(ack.sequence);
    }
    let holds = retrying(&format!("{}: asking for the lease", spec.name), || {
        authority.holds()
    })
    .await?;
    if !holds {
        return Err(fenced(&spec.name));
    }
    let (requests, receiver) = mpsc::unbounded_channel();
    let fenced = Arc::new(AtomicBool::new(false));
    let writer = Writer {
        context: context.clone(),
        spec: spec.clone(),
        authority,
        fenced: Arc::clone(&fenced),
        last,
        requests: receiver,
        closed: false,
        waiting: VecDeque::new(),
        window: VecDeque::new(),
    };
    tokio::spawn(writer.run());
    Ok(Handle {
        requests,
        fenced,
        stream: spec.name.clone(),
    })
}

fn fence_message(id: &str) -> PublishMessage {
    PublishMessage::build().payload(Bytes::new()).message_id(id)
}

struct Writer {
    context: jetstream::Context,
    spec: StreamSpec,
    authority: Arc<dyn Authority>,
    fenced: Arc<AtomicBool>,
    /// The stream's last sequence as far as this writer knows: its fence's, or that of the
    /// publish last settled in order, or what it read when it mended its chain.
    last: u64,
    requests: mpsc::UnboundedReceiver<Request>,
    /// No more requests will come.
    closed: bool,
    /// Appends to publish, in order: retries first.
    waiting: VecDeque<Append>,
    /// Published and not settled, in the order published, each with the last sequence it
    /// expects (the one at index I: `last + I`).
    window: VecDeque<(Append, u64, AckFuture)>,
}

struct Append {
    id: String,
    payload: Bytes,
    since: Instant,
    reply: Reply,
}

impl Writer {
    async fn run(mut self) {
        let mut attempt = 0;
        loop {
            self.publish_waiting().await;
            let room = self.window.len() < IN_FLIGHT && !self.closed;
            let Some((_, _, ack)) = self.window.front_mut() else {
                match self.requests.recv().await {
                    Some(request) => self.waiting.push_back(Append::new(request)),
                    None => return,
                }
                continue;
            };
            let result = tokio::select! {
                biased;
                result = ack => result,
                request = self.requests.recv(), if room => {
                    match request {
                        Some(request) => self.waiting.push_back(Append::new(request)),
                        None => self.closed = true,
                    }
                    continue;
                }
            };
            let (append, expected, _) = self.window.pop_front().expect("the front was there");
            let broken = match result {
                Ok(ack) if !ack.duplicate && ack.sequence == expected + 1 => {
                    attempt = 0;
                    self.last = ack.sequence;
                    let _ = append.reply.send(Ok(ack.sequence - 1));
                    continue;
                }
                // Landed, but not where the publishes after it predicted: a retry whose
                // first attempt had landed before.
                Ok(ack) => {
                    tracing::debug!(stream = %self.spec.name, sequence = ack.sequence, expected, "an append had landed before; mending the chain");
                    let _ = append.reply.send(Ok(ack.sequence - 1));
                    Broken::default()
                }
                Err(error) => {
                    tracing::debug!(stream = %self.spec.name, attempt, "append failed: {error}; mending the chain");
                    Broken {
                        refused: error.kind() == PublishErrorKind::WrongLastSequence,
                        retries: vec![(append, error.to_string())],
                    }
                }
            };
            attempt += 1;
            if self.mend(broken, attempt).await.is_err() {
                return self.refuse_everything().await;
            }
        }
    }

    /// Publishes waiting appends while the window has room.
    async fn publish_waiting(&mut self) {
        while self.window.len() < IN_FLIGHT {
            let append = match self.waiting.pop_front() {
                Some(append) => append,
                None => match self.requests.try_recv() {
                    Ok(request) => Append::new(request),
                    Err(mpsc::error::TryRecvError::Empty) => return,
                    Err(mpsc::error::TryRecvError::Disconnected) => {
                        self.closed = true;
                        return;
                    }
                },
            };
            let expected = self.last + self.window.len() as u64;
            let message = PublishMessage::build()
                .payload(append.payload.clone())
                .message_id(&append.id)
                .expected_last_sequence(expected);
            let ack: AckFuture = match self
                .context
                .send_publish(self.spec.subject.clone(), message)
                .await
            {
                Ok(future) => Box::pin(future.into_future()),
                Err(error) => Box::pin(std::future::ready(Err(error))),
            };
            self.window.push_back((append, expected, ack));
        }
    }

    /// The chain is broken (the oldest publish in flight failed, or landed elsewhere than
    /// predicted): nothing more is published until it is mended. Settles what is still in
    /// flight (together, so that their timeouts run at once), answering what landed
    /// without moving `last` by it; then, until it knows, reads where the stream ends and
    /// asks whether this host still holds the partition. If so, the failed appends are
    /// published again (same ids) from there; if not, the log is fenced for good (`Err`).
    async fn mend(&mut self, mut broken: Broken, attempt: u32) -> Result<(), LogError> {
        let in_flight = self
            .window
            .drain(..)
            .map(|(append, _, ack)| async move { (append, ack.await) });
        for (append, result) in futures_util::future::join_all(in_flight).await {
            match result {
                Ok(ack) => {
                    let _ = append.reply.send(Ok(ack.sequence - 1));
                }
                Err(error) => {
                    broken.refused |= error.kind() == PublishErrorKind::WrongLastSequence;
                    broken.retries.push((append, error.to_string()));
                }
            }
        }
        let mut round = attempt;
        loop {
            // A refusal is the stream's answer, at once; anything else (a server
            // restarting, a leader being elected, the lease unanswered) is given time.
            if !broken.refused || round > attempt {
                tokio::time::sleep(backoff(round)).await;
            }
            match resync(&self.context, &self.spec.name, &*self.authority).await {
                Ok(last) => {
                    self.last = last;
                    for (append, error) in broken.retries.into_iter().rev() {
                        if append.since.elapsed() >= RETRY_FOR {
                            let _ = append.reply.send(Err(self.gave_up(&error)));
                        } else {
                            self.waiting.push_front(append);
                        }
                    }
                    return Ok(());
                }
                Err(Unsettled::Fenced) => {
                    tracing::warn!(stream = %self.spec.name, "fenced: another host holds the partition");
                    self.fenced.store(true, Ordering::Release);
                    for (append, _) in broken.retries {
                        let _ = append.reply.send(Err(fenced(&self.spec.name)));
                    }
                    return Err(fenced(&self.spec.name));
                }
                Err(Unsettled::Unanswered(error)) => {
                    tracing::debug!(stream = %self.spec.name, round, "mending the chain: {error}");
                    // Appends that have waited RETRY_FOR fail; the others wait on.
                    self.take_requests();
                    let retries = std::mem::take(&mut broken.retries);
                    for (append, last_error) in retries {
                        if append.since.elapsed() >= RETRY_FOR {
                            let _ = append.reply.send(Err(self.gave_up(&last_error)));
                        } else {
                            broken.retries.push((append, last_error));
                        }
                    }
                    let waiting = std::mem::take(&mut self.waiting);
                    for append in waiting {
                        if append.since.elapsed() >= RETRY_FOR {
                            let _ = append.reply.send(Err(self.gave_up(&error)));
                        } else {
                            self.waiting.push_back(append);
                        }
                    }
                    if self.closed && broken.retries.is_empty() && self.waiting.is_empty() {
                        return Ok(());
                    }
                    round += 1;
                }
            }
        }
    }

    /// Moves the requests submitted so far to the waiting appends.
    fn take_requests(&mut self) {
        loop {
            match self.requests.try_recv() {
                Ok(request) => self.waiting.push_back(Append::new(request)),
                Err(mpsc::error::TryRecvError::Empty) => return,
                Err(mpsc::error::TryRecvError::Disconnected) => {
                    self.closed = true;
                    return;
                }
            }
        }
    }

    fn gave_up(&self, error: &str) -> LogError {
        io(
            format!(
                "appending to {} (retried for {RETRY_FOR:?})",
                self.spec.subject
            ),
            error,
        )
    }

    /// Fenced: every append queued or still to come is refused.
    async fn refuse_everything(mut self) {
        for append in self.waiting.drain(..) {
            let _ = append.reply.send(Err(fenced(&self.spec.name)));
        }
        while let Some((_, reply, _)) = self.requests.recv().await {
            let _ = reply.send(Err(fenced(&self.spec.name)));
        }
    }
}

impl Append {
    fn new((payload, reply, since): Request) -> Self {
        Self {
            id: format!("{:032x}", rand::random::<u128>()),
            payload,
            since,
            reply,
        }
    }
}

/// Where stream `name` ends, once `authority` says this host still holds the partition
/// (asked after the read: a holder that says yes was not fenced before it).
async fn resync(
    context: &jetstream::Context,
    name: &str,
    authority: &dyn Authority,
) -> Result<u64, Unsettled> {
    let mut quick = context.clone();
    quick.set_timeout(CONSUMER_WITHIN);
    let last = async {
        let stream = quick.get_stream_no_info(name).await?;
        let info = stream.get_info().await?;
        Ok::<_, async_nats::Error>(info.state.last_sequence)
    }
    .await
    .map_err(|e| Unsettled::Unanswered(format!("reading where the stream ends: {e}")))?;
    match authority.holds().await {
        Ok(true) => Ok(last),
        Ok(false) => Err(Unsettled::Fenced),
        Err(e) => Err(Unsettled::Unanswered(format!("asking for the lease: {e}"))),
    }
}

/// A broken chain: whether the stream refused a publish, and the appends to publish again
/// with the last error of each.
#[derive(Default)]
struct Broken {
    refused: bool,
    retries: Vec<(Append, String)>,
}

/// Why a broken chain is not mended yet.
enum Unsettled {
    /// Another host holds the partition.
    Fenced,
    /// The stream or the authority did not answer.
    Unanswered(String),
}
