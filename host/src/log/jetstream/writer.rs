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
//! the fence's first message. [`fence`] publishes `IN_FLIGHT` messages: once they are
//! acknowledged, nothing an earlier holder sent can land after them, and whatever landed
//! between them is read by the new holder's recovery like anything else before its fence.

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

/// Where a fenced partition's appends go.
#[derive(Debug)]
pub struct Handle {
    requests: mpsc::UnboundedSender<(Bytes, Reply)>,
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
        } else if let Err(mpsc::error::SendError((_, reply))) = self.requests.send((payload, reply))
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
    let mut last = 0;
    for (id, ack) in acks {
        let first = match ack {
            Ok(future) => future.await,
            Err(error) => Err(error),
        };
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
    requests: mpsc::UnboundedReceiver<(Bytes, Reply)>,
    /// No more requests will come.
    closed: bool,
    /// Appends to publish, in order: retries first.
    waiting: VecDeque<Append>,
    /// Published and not settled, in the order published: the one at index I expects
    /// `last + I`.
    window: VecDeque<(Append, AckFuture)>,
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
            let Some((_, ack)) = self.window.front_mut() else {
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
            let (append, _) = self.window.pop_front().expect("the front was there");
            match result {
                Ok(ack) => {
                    attempt = 0;
                    self.settle(append, &ack);
                }
                Err(error) => {
                    attempt += 1;
                    if self.mend(append, error, attempt).await.is_err() {
                        return self.refuse_everything().await;
                    }
                }
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
            self.window.push_back((append, ack));
        }
    }

    fn settle(&mut self, append: Append, ack: &PublishAck) {
        // A retry of a publish that had landed gets its original sequence back.
        self.last = self.last.max(ack.sequence);
        let _ = append.reply.send(Ok(ack.sequence - 1));
    }

    /// `failed`, the oldest publish in flight, failed: the chain is broken, and nothing more
    /// is published until it is mended. Settles what is still in flight, in order; reads
    /// where the stream ends and asks whether this host still holds the partition: if so,
    /// the failed appends are published again (same ids) from there; if not, the log is
    /// fenced for good (`Err`).
    async fn mend(
        &mut self,
        failed: Append,
        error: PublishError,
        attempt: u32,
    ) -> Result<(), LogError> {
        let mut refused = error.kind() == PublishErrorKind::WrongLastSequence;
        tracing::debug!(stream = %self.spec.name, attempt, "append failed: {error}; mending the chain");
        let mut retries = vec![(failed, error.to_string())];
        while let Some((append, ack)) = self.window.pop_front() {
            match ack.await {
                Ok(ack) => self.settle(append, &ack),
                Err(error) => {
                    refused |= error.kind() == PublishErrorKind::WrongLastSequence;
                    retries.push((append, error.to_string()));
                }
            }
        }
        if !refused {
            // Not an answer from the stream (a server restarting, a leader being elected):
            // give it time.
            tokio::time::sleep(backoff(attempt)).await;
        }
        let mended = async {
            let last = last_sequence(&self.context, &self.spec.name).await?;
            let holds = retrying(&format!("{}: asking for the lease", self.spec.name), || {
                self.authority.holds()
            })
            .await?;
            Ok::<_, LogError>((last, holds))
        }
        .await;
        let last = match mended {
            Ok((last, true)) => last,
            Ok((_, false)) => {
                tracing::warn!(stream = %self.spec.name, "fenced: another host holds the partition");
                self.fenced.store(true, Ordering::Release);
                for (append, _) in retries {
                    let _ = append.reply.send(Err(fenced(&self.spec.name)));
                }
                return Err(fenced(&self.spec.name));
            }
            Err(error) => {
                // Neither the stream nor the lease answers: these appends fail; later ones
                // try again.
                let error = error.to_string();
                for (append, _) in retries {
                    let _ = append.reply.send(Err(io(
                        format!("appending to {}", self.spec.subject),
                        &error,
                    )));
                }
                return Ok(());
            }
        };
        self.last = last;
        for (append, error) in retries.into_iter().rev() {
            if append.since.elapsed() >= RETRY_FOR {
                let _ = append.reply.send(Err(io(
                    format!(
                        "appending to {} (retried for {RETRY_FOR:?})",
                        self.spec.subject
                    ),
                    error,
                )));
            } else {
                self.waiting.push_front(append);
            }
        }
        Ok(())
    }

    /// Fenced: every append queued or still to come is refused.
    async fn refuse_everything(mut self) {
        for append in self.waiting.drain(..) {
            let _ = append.reply.send(Err(fenced(&self.spec.name)));
        }
        while let Some((_, reply)) = self.requests.recv().await {
            let _ = reply.send(Err(fenced(&self.spec.name)));
        }
    }
}

impl Append {
    fn new((payload, reply): (Bytes, Reply)) -> Self {
        Self {
            id: format!("{:032x}", rand::random::<u128>()),
            payload,
            since: Instant::now(),
            reply,
        }
    }
}

/// The stream's last sequence (0 when it never held a message).
async fn last_sequence(context: &jetstream::Context, name: &str) -> Result<u64, LogError> {
    let mut quick = context.clone();
    quick.set_timeout(CONSUMER_WITHIN);
    retrying(&format!("{name}: reading where it ends"), || async {
        let stream = quick.get_stream_no_info(name).await?;
        let info = stream.get_info().await?;
        Ok::<_, async_nats::Error>(info.state.last_sequence)
    })
    .await
}
