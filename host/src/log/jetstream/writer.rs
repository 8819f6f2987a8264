//! The writing side of one fenced partition: its appends go out with up to [`IN_FLIGHT`] in
//! flight, each expecting the stream's last sequence to be where its predecessor lands, and
//! are settled strictly in the order they were published.
//!
//! Why that order matters. A publish expecting sequence S lands only if the stream's last
//! message is at S when it arrives. A pipelined publish predicts S (its predecessor is not
//! acknowledged yet), so a foreign message (a new holder's fence) that takes the place the
//! predecessor was to take makes the prediction come true: the next publish lands after
//! the fence. What bounds the damage: the predecessor is refused, and the chain learns of
//! that before it counts anything that landed after it, so nothing more is published until
//! the partition's authority has been asked whether this host still holds it. Every publish
//! predicts at most [`IN_FLIGHT`] places past the last one acknowledged in order, which is
//! before the fence; so none of them can land more than `IN_FLIGHT - 1` places after the
//! fence's first message. A fence ([`start`]) is `IN_FLIGHT` messages: once they are
//! acknowledged, nothing an earlier holder sent can land after them, and whatever landed
//! between them is read by the new holder's recovery like anything else before its fence.
//!
//! Two things keep "the last one acknowledged in order" honest: an acknowledgement counts
//! only if it is for the place its publish expected (a retry whose first attempt had
//! landed is answered with that attempt's place, and breaks the chain like a failure);
//! and what a broken chain's later publishes were acknowledged with never moves it (they
//! may have landed after a fence). Nothing is published again until the chain's mender has
//! read where the stream ends *and* heard from its authority that it still holds the
//! partition.
//!
//! Who does the work. On the way that matters for speed, nobody but the appender: under
//! the chain's lock it claims the next place in the window and hands its message to the
//! client's queue (at once, or not at all: messages leave in the order of their places);
//! then it awaits its own acknowledgement and records it in the window, which moves the
//! chain past every publish at its front that landed where expected. (A task in between
//! would cost each append two hand-overs, about a tenth of a publish's round trip on
//! loopback; an async publish lock costs a hand-over whenever appenders meet.) An
//! append that landed is answered at once, in or out of order; one that failed waits for
//! the mender. An appender cancelled with its publish in flight hands the acknowledgement to
//! a task of its own, so that the window never waits for an answer nobody will record.
//!
//! Group commit (a stream made with it, [`StreamSpec::group_commit`]). An append that finds
//! fewer than [`EAGER`] publishes in flight is published on its own, as above; one that
//! finds more joins the chain's *gathering*, the records of the next message, and waits
//! for its answer. A message of several records (framed, and counted in a header) is one
//! publish like any other: it takes one place in the window, is retried whole with its id,
//! and is refused whole; so the fencing argument above holds as it is. Its records' offsets
//! are its sequence's, one per place.
//!
//! When the gathering goes out. Once the window is down to [`EAGER`] again, it waits for
//! the appenders the settled publish answered: a host's keys each make their next call as
//! soon as the last one is answered, so they append again at once. Then it goes out,
//! holding both them and the records that waited while the publish was in flight. (Sent
//! at once instead, it would leave them to gather behind it: two groups taking turns, each
//! message half as full, twice the round trips.) The wait ends when as many appends have
//! joined as the settled publish carried, or when a turn of the tasks ready to run, on the
//! worker that answered them, passes with none joining ([`Shared::linger`]); appends join
//! a waiting gathering however empty the window is. A lone appender's next record goes out
//! on its own at once, as before. A gathering that is full (256 records, or the server's
//! largest message) goes out at once if the window has room.
//!
//! A broken chain (the publish at its front failed, or landed elsewhere than predicted)
//! gets one mender, a task that owns the chain until it is whole again: appends that come
//! meanwhile queue for it. It waits until everything in flight has settled, reads where the
//! stream ends, asks the authority, and publishes again what failed (with the same ids)
//! and then what queued, in that order, before it hands the chain back.

use std::collections::VecDeque;
use std::fmt;
use std::future::IntoFuture as _;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use async_nats::jetstream::context::{PublishError, PublishErrorKind};
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::{self, publish::PublishAck};
use bytes::Bytes;
use futures_util::FutureExt as _;
use tokio::sync::{Notify, oneshot};

use super::{
    Authority, CONSUMER_WITHIN, PER_MESSAGE, RECORDS, RETRY_FOR, StreamSpec, backoff, frame, io,
    message_id, retrying,
};
use crate::log::{LogError, Offset};

/// How many publishes one partition has in flight at most; also how many messages a fence
/// is (see the module's documentation). Every host must use the same number.
pub const IN_FLIGHT: usize = 32;

/// With group commit, how many publishes a partition has in flight before appends gather
/// into one message, published as soon as one of those settles (or when it is full).
const EAGER: usize = 1;

type AckFuture = Pin<Box<dyn Future<Output = Result<PublishAck, PublishError>> + Send>>;
type Reply = oneshot::Sender<Result<Offset, LogError>>;

/// Where a fenced partition's appends go.
pub struct Handle {
    shared: Arc<Shared>,
}

impl fmt::Debug for Handle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Handle")
            .field("stream", &self.shared.spec.name)
            .finish_non_exhaustive()
    }
}

/// An append on its way: [`settled`](Self::settled) tells where it landed. Dropping it does
/// not take the append back.
pub enum Pending {
    InFlight(InFlight),
    /// Gathered into the next message (group commit), or queued for the mender of a broken
    /// chain, or published by it.
    Queued(oneshot::Receiver<Result<Offset, LogError>>),
    Refused(LogError),
}

impl Pending {
    /// What the append came to.
    pub async fn settled(self) -> Result<Offset, LogError> {
        match self {
            Pending::InFlight(in_flight) => in_flight.settled().await,
            Pending::Queued(receiver) => receiver.await.unwrap_or(Err(LogError::Closed)),
            Pending::Refused(error) => Err(error),
        }
    }

    /// Has the acknowledgement awaited and recorded by a task of its own, at once: for a
    /// caller that holds several appends and awaits them one by one. (Each waits for
    /// those before it to be recorded: so a caller holding appends that it does not await
    /// could fill the window, keep a mender waiting, or with group commit hold back the
    /// records gathered behind it, for ever.)
    pub fn detach(self) -> oneshot::Receiver<Result<Offset, LogError>> {
        match self {
            Pending::InFlight(in_flight) => {
                let (reply, receiver) = oneshot::channel();
                let runtime = in_flight.shared.runtime.clone();
                runtime.spawn(async move {
                    let _ = reply.send(in_flight.settled().await);
                });
                receiver
            }
            Pending::Queued(receiver) => receiver,
            Pending::Refused(error) => {
                let (reply, receiver) = oneshot::channel();
                let _ = reply.send(Err(error));
                receiver
            }
        }
    }
}

impl Handle {
    /// Publishes `payload`, or queues it while the chain is being mended. Appends published
    /// one after another by one task land in that order.
    pub async fn publish(&self, payload: Bytes) -> Pending {
        let shared = &self.shared;
        loop {
            {
                let mut chain = shared.chain();
                if shared.fenced.load(Ordering::Acquire) {
                    return Pending::Refused(fenced(&shared.spec.name));
                }
                if chain.mending {
                    let (reply, receiver) = oneshot::channel();
                    let draft = Draft::new(payload);
                    chain.queued.push_back(Append { draft, reply });
                    return Pending::Queued(receiver);
                }
                // While the window is this empty, a gathering is one about to go out (see
                // `advance`): an append joins it rather than overtake it.
                if chain.window.len() < shared.eager && chain.gathering.is_none() {
                    let draft = Draft::new(payload);
                    let (serial, expected) = chain.claim();
                    // Handed to the client under the chain's lock, so that messages leave in
                    // the order of the places they expect. The client takes it at once
                    // unless its queue (or its acknowledgements in flight) is full: then the
                    // place is given back, and a mender task publishes the append, waiting as
                    // long as the client needs, while later appends queue behind it.
                    // (Unconstrained: a task out of its scheduling budget would find even
                    // a queue with room full.)
                    let sent =
                        tokio::task::unconstrained(shared.send(&draft, expected)).now_or_never();
                    return match sent {
                        Some(ack) => Pending::InFlight(InFlight {
                            shared: Arc::clone(shared),
                            serial,
                            draft: Some(draft),
                            ack: Some(ack),
                        }),
                        None => {
                            let (reply, receiver) = oneshot::channel();
                            shared.hand_to_mender(&mut chain, serial, Append { draft, reply });
                            Pending::Queued(receiver)
                        }
                    };
                }
                if shared.spec.group_commit {
                    let full = chain
                        .gathering
                        .as_ref()
                        .is_some_and(|gathering| !gathering.takes(&payload, shared.max_message));
                    if !full || chain.window.len() < IN_FLIGHT {
                        if full {
                            shared.flush(&mut chain);
                        }
                        if !chain.mending {
                            let (reply, receiver) = oneshot::channel();
                            chain
                                .gathering
                                .get_or_insert_with(Gathering::new)
                                .push(&payload, reply);
                            if chain.window.len() < shared.eager {
                                // The last of the appenders the gathering waits for.
                                chain.returning = chain.returning.saturating_sub(1);
                                if chain.returning == 0 {
                                    shared.flush(&mut chain);
                                }
                            }
                            return Pending::Queued(receiver);
                        }
                        // The client was too busy for the full message: a mender has it.
                        continue;
                    }
                }
            }
            shared.room().await;
        }
    }
}

/// A publish whose acknowledgement has not been recorded in the window yet.
pub struct InFlight {
    shared: Arc<Shared>,
    serial: u64,
    draft: Option<Draft>,
    ack: Option<AckFuture>,
}

impl InFlight {
    /// Where the append landed (or what the mender made of it); a gathering that its
    /// settling left waiting is seen to by a task of its own.
    async fn settled(self) -> Result<Offset, LogError> {
        let shared = Arc::clone(&self.shared);
        let recorded = self.recorded().await;
        shared.linger_soon();
        answer(recorded).await
    }

    /// Awaits the acknowledgement and records it (see [`Shared::settle`]), and no more: the
    /// caller sees to a gathering the settling left waiting.
    async fn recorded(mut self) -> Result<Offset, oneshot::Receiver<Result<Offset, LogError>>> {
        let result = self.ack.as_mut().expect("awaited once").await;
        self.ack = None;
        let draft = self.draft.take().expect("settled once");
        self.shared.settle(self.serial, draft, result)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        // Dropped before its acknowledgement came: the window waits for it, so it is awaited
        // and recorded elsewhere.
        let (Some(ack), Some(draft)) = (self.ack.take(), self.draft.take()) else {
            return;
        };
        let shared = Arc::clone(&self.shared);
        let serial = self.serial;
        self.shared.runtime.spawn(async move {
            let _ = shared.settle(serial, draft, ack.await);
            shared.linger_soon();
        });
    }
}

/// A place claimed in the window whose message may not have been handed to the client.
struct Claimed<'a> {
    shared: &'a Arc<Shared>,
    serial: u64,
    draft: Option<Draft>,
}

impl Claimed<'_> {
    fn draft_ref(&self) -> &Draft {
        self.draft.as_ref().expect("claimed with a draft")
    }
}

impl Drop for Claimed<'_> {
    fn drop(&mut self) {
        if let Some(draft) = self.draft.take() {
            let error = PublishError::with_source(
                PublishErrorKind::Other,
                "the appending task was dropped while publishing",
            );
            let _ = self.shared.settle(self.serial, draft, Err(error));
            self.shared.linger_soon();
        }
    }
}

/// What an append came to: where it landed, or the mender's answer.
async fn answer(
    recorded: Result<Offset, oneshot::Receiver<Result<Offset, LogError>>>,
) -> Result<Offset, LogError> {
    match recorded {
        Ok(offset) => Ok(offset),
        Err(retried) => retried.await.unwrap_or(Err(LogError::Closed)),
    }
}

/// Lets every task ready to run on this worker have a turn: woken by itself, a task goes
/// to the back of its worker's queue.
async fn a_turn() {
    let mut turned = false;
    std::future::poll_fn(|context| {
        if std::mem::replace(&mut turned, true) {
            return std::task::Poll::Ready(());
        }
        context.waker().wake_by_ref();
        std::task::Poll::Pending
    })
    .await;
}

fn fenced(stream: &str) -> LogError {
    LogError::Fenced {
        stream: stream.to_owned(),
    }
}

/// Fences `spec`'s stream and opens it for appends. The fence is [`IN_FLIGHT`] messages on
/// the fence subject, published without condition (an earlier holder may be writing
/// without pause: a conditional fence could wait for ever); then `authority` is asked
/// whether this host holds the partition (after, not before: a fence retried past a
/// takeover would otherwise land after the new holder's). The first append expects the
/// last fence message's sequence.
pub async fn start(
    context: &jetstream::Context,
    spec: &StreamSpec,
    authority: Arc<dyn Authority>,
    max_message: usize,
) -> Result<Handle, LogError> {
    let fence_subject = spec.fence_subject();
    let mut acks = Vec::with_capacity(IN_FLIGHT);
    for _ in 0..IN_FLIGHT {
        let id = format!("fence-{}", message_id());
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
    Ok(Handle {
        shared: Arc::new(Shared {
            runtime: tokio::runtime::Handle::current(),
            context: context.clone(),
            spec: spec.clone(),
            authority,
            eager: if spec.group_commit { EAGER } else { IN_FLIGHT },
            max_message,
            chain: Mutex::new(Chain {
                last,
                first: 0,
                window: VecDeque::with_capacity(IN_FLIGHT),
                broken: false,
                mending: false,
                queued: VecDeque::new(),
                gathering: None,
                returning: 0,
                wait: None,
                waits: 0,
                lingering: false,
                breaks: 0,
            }),
            room: Notify::new(),
            settled: Notify::new(),
            fenced: AtomicBool::new(false),
        }),
    })
}

fn fence_message(id: &str) -> PublishMessage {
    PublishMessage::build().payload(Bytes::new()).message_id(id)
}

struct Shared {
    /// Where the partition's tasks run (its mender, acknowledgements handed over): the
    /// runtime the log was opened on, also when an append is dropped off it.
    runtime: tokio::runtime::Handle,
    context: jetstream::Context,
    spec: StreamSpec,
    authority: Arc<dyn Authority>,
    /// How many publishes may be in flight before appends gather (group commit), or wait
    /// for room: [`EAGER`] or [`IN_FLIGHT`].
    eager: usize,
    /// The most bytes of framed records one message carries (the largest record, framed,
    /// fits).
    max_message: usize,
    chain: Mutex<Chain>,
    /// Appenders waiting for room in a full window.
    room: Notify,
    /// The mender, waiting for a publish to settle.
    settled: Notify,
    /// Another host holds the partition: every append is refused, for good.
    fenced: AtomicBool,
}

/// The partition's chain of publishes.
struct Chain {
    /// The stream's last sequence as far as the chain knows: its fence's, or that of the
    /// publish last settled in order, or what the mender read.
    last: u64,
    /// The serial number of the window's front; each publish's is one more.
    first: u64,
    /// Published and not yet passed by the chain, in the order published; the one at index
    /// I expects the last sequence to be `last + I`.
    window: VecDeque<Slot>,
    /// The front failed or landed elsewhere than expected; until the mender has resynced,
    /// nothing moves `last`.
    broken: bool,
    /// A mender owns the chain: appends queue for it.
    mending: bool,
    /// Appends for the mender to publish, in order: its retries first.
    queued: VecDeque<Append>,
    /// With group commit: appends that came while [`Shared::eager`] publishes were in
    /// flight, to go out as one message when one settles. Only while the chain is whole.
    gathering: Option<Gathering>,
    /// With group commit, once the window is down to [`Shared::eager`]: how many more
    /// appends the gathering waits for (the records of the publish that settled) before it
    /// goes out.
    returning: usize,
    /// While the gathering waits for them: the number of the wait, which ends when they
    /// stop coming back (see [`Shared::linger`]), and whether a task sees to that. And how
    /// many waits there have been.
    wait: Option<u64>,
    lingering: bool,
    waits: u64,
    /// Breaks since an append last landed in order, for the mender's backoff.
    breaks: u32,
}

enum Slot {
    InFlight {
        expected: u64,
    },
    Landed {
        expected: u64,
        sequence: u64,
        duplicate: bool,
    },
    /// Failed; its appender waits for the mender's answer.
    Failed {
        append: Append,
        error: String,
        refused: bool,
    },
}

/// An append's message: its id (the same in every attempt), payload, and since when it has
/// been tried. A message of several records says how many.
struct Draft {
    id: String,
    payload: Bytes,
    records: Option<usize>,
    since: Instant,
}

impl Draft {
    fn new(payload: Bytes) -> Self {
        Self {
            id: message_id(),
            payload,
            records: None,
            since: Instant::now(),
        }
    }
}

/// Records gathering into one message, and who waits for each.
struct Gathering {
    framed: Vec<u8>,
    replies: Vec<Reply>,
    since: Instant,
}

impl Gathering {
    fn new() -> Self {
        Self {
            framed: Vec::new(),
            replies: Vec::new(),
            since: Instant::now(),
        }
    }

    /// Whether `record` fits in the message too.
    fn takes(&self, record: &[u8], max_message: usize) -> bool {
        self.replies.len() < PER_MESSAGE && self.framed.len() + 4 + record.len() <= max_message
    }

    fn push(&mut self, record: &[u8], reply: Reply) {
        frame(&mut self.framed, record);
        self.replies.push(reply);
    }

    /// The message, and whom to answer with the offset it lands at.
    fn into_message(self) -> (Draft, Vec<Reply>) {
        let draft = Draft {
            id: message_id(),
            records: Some(self.replies.len()),
            payload: Bytes::from(self.framed),
            since: self.since,
        };
        (draft, self.replies)
    }

    /// The message as an append for the mender.
    fn into_append(self, runtime: &tokio::runtime::Handle) -> Append {
        let (draft, replies) = self.into_message();
        let reply = reply_for_each(runtime, replies);
        Append { draft, reply }
    }
}

/// One reply for a message of several records: a task of its own answers each record once
/// it comes.
fn reply_for_each(runtime: &tokio::runtime::Handle, replies: Vec<Reply>) -> Reply {
    let (reply, receiver) = oneshot::channel();
    runtime.spawn(async move {
        answer_each(replies, receiver.await.unwrap_or(Err(LogError::Closed)));
    });
    reply
}

/// Answers the records of one message, which landed at `first` (or did not).
fn answer_each(replies: Vec<Reply>, first: Result<Offset, LogError>) {
    for (place, reply) in replies.into_iter().enumerate() {
        let answer = match &first {
            // The places of one message are consecutive offsets (see `StreamSpec::offset`).
            Ok(first) => Ok(first + place as u64),
            Err(LogError::Fenced { stream }) => Err(fenced(stream)),
            Err(LogError::Io { context, source }) => Err(LogError::Io {
                context: context.clone(),
                source: std::io::Error::new(source.kind(), source.to_string()),
            }),
            Err(LogError::Closed) => Err(LogError::Closed),
            // Nothing else comes out of a publish's settling.
            Err(error) => Err(io("appending", error)),
        };
        let _ = reply.send(answer);
    }
}

/// An append in the mender's hands, and who waits for it.
struct Append {
    draft: Draft,
    reply: Reply,
}

impl Chain {
    /// Claims the next place in the window: its serial number and the last sequence it
    /// expects.
    fn claim(&mut self) -> (u64, u64) {
        let placed = self.window.len() as u64;
        let expected = self.last + placed;
        self.window.push_back(Slot::InFlight { expected });
        (self.first + placed, expected)
    }

    fn all_settled(&self) -> bool {
        !self
            .window
            .iter()
            .any(|slot| matches!(slot, Slot::InFlight { .. }))
    }
}

/// Where the mender stopped.
enum Mended {
    /// The chain is whole again.
    Resumed,
    /// Another host holds the partition.
    Fenced,
    /// The log is gone and nothing waits for an append.
    Abandoned,
}

impl Shared {
    fn chain(&self) -> MutexGuard<'_, Chain> {
        self.chain.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits until the window has room, or the chain is in the mender's hands.
    async fn room(&self) {
        let notified = self.room.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        let full = {
            let chain = self.chain();
            chain.window.len() >= IN_FLIGHT && !chain.mending
        };
        if full {
            notified.await;
        }
    }

    /// The mender's publish of `draft` at the place `serial` claimed, expecting `expected`
    /// (nobody else publishes while it mends, so it may wait for the client's queue).
    /// Should the mender be dropped before the message is handed to the client, the place
    /// fails.
    async fn publish_claimed(
        self: &Arc<Self>,
        serial: u64,
        expected: u64,
        draft: Draft,
    ) -> InFlight {
        let mut claimed = Claimed {
            shared: self,
            serial,
            draft: Some(draft),
        };
        let ack = self.send(claimed.draft_ref(), expected).await;
        InFlight {
            shared: Arc::clone(self),
            serial,
            draft: claimed.draft.take(),
            ack: Some(ack),
        }
    }

    /// Hands `draft`'s message expecting `expected` to the client, and returns its
    /// acknowledgement to await.
    async fn send(&self, draft: &Draft, expected: u64) -> AckFuture {
        let mut message = PublishMessage::build()
            .payload(draft.payload.clone())
            .message_id(&draft.id)
            .expected_last_sequence(expected);
        if let Some(records) = draft.records {
            message = message.header(RECORDS, records.to_string());
        }
        match self
            .context
            .send_publish(self.spec.subject.clone(), message)
            .await
        {
            Ok(future) => future.into_future(),
            Err(error) => Box::pin(std::future::ready(Err(error))),
        }
    }

    /// Records what the publish `serial` came to, and moves the chain past what landed in
    /// order. A landed append's offset is answered at once; a failed one's later, by the
    /// mender (`Err` is where).
    fn settle(
        self: &Arc<Self>,
        serial: u64,
        draft: Draft,
        result: Result<PublishAck, PublishError>,
    ) -> Result<Offset, oneshot::Receiver<Result<Offset, LogError>>> {
        let mut chain = self.chain();
        let index = usize::try_from(serial - chain.first).expect("a place in the window");
        let Slot::InFlight { expected } = chain.window[index] else {
            unreachable!("a publish settles once");
        };
        let answer = match result {
            Ok(ack) => {
                chain.window[index] = Slot::Landed {
                    expected,
                    sequence: ack.sequence,
                    duplicate: ack.duplicate,
                };
                if self.spec.group_commit {
                    chain.returning = draft.records.unwrap_or(1);
                }
                Ok(self.spec.offset(ack.sequence, 0))
            }
            Err(error) => {
                tracing::debug!(stream = %self.spec.name, expected, "append failed: {error}");
                let (reply, receiver) = oneshot::channel();
                chain.window[index] = Slot::Failed {
                    refused: error.kind() == PublishErrorKind::WrongLastSequence,
                    error: error.to_string(),
                    append: Append { draft, reply },
                };
                Err(receiver)
            }
        };
        if !chain.broken {
            self.advance(&mut chain);
        }
        if chain.mending {
            self.settled.notify_one();
        }
        answer
    }

    /// Publishes what gathered as one message, at the next place in the window (which has
    /// room); a task of its own answers each record.
    fn flush(self: &Arc<Self>, chain: &mut Chain) {
        chain.returning = 0;
        chain.wait = None;
        let Some(gathering) = chain.gathering.take().filter(|g| !g.replies.is_empty()) else {
            return;
        };
        let (serial, expected) = chain.claim();
        let (draft, replies) = gathering.into_message();
        // As an appender's own publish: at once, under the lock, or by a mender.
        match tokio::task::unconstrained(self.send(&draft, expected)).now_or_never() {
            Some(ack) => {
                let in_flight = InFlight {
                    shared: Arc::clone(self),
                    serial,
                    draft: Some(draft),
                    ack: Some(ack),
                };
                // Its records' appenders are answered before the wait their return ends
                // begins, in this task: the wait's first turn is theirs.
                let shared = Arc::clone(self);
                self.runtime.spawn(async move {
                    let recorded = in_flight.recorded().await;
                    answer_each(replies, answer(recorded).await);
                    shared.linger().await;
                });
            }
            None => {
                let reply = reply_for_each(&self.runtime, replies);
                self.hand_to_mender(chain, serial, Append { draft, reply });
            }
        }
    }

    /// The client could not take the message of the place `serial`, just claimed: gives the
    /// place back, and hands `append` (and the chain) to a mender, which waits for the
    /// client. Nothing was sent, and nobody claimed a place after this one.
    fn hand_to_mender(self: &Arc<Self>, chain: &mut Chain, serial: u64, append: Append) {
        chain.window.pop_back();
        debug_assert_eq!(chain.first + chain.window.len() as u64, serial);
        debug_assert!(chain.gathering.is_none());
        chain.queued.push_back(append);
        chain.mending = true;
        self.runtime.spawn(Arc::clone(self).mend());
    }

    /// Moves `last` past the window's front while it landed where expected; at a front that
    /// did not, breaks the chain and gives it to a mender. What gathered goes out once the
    /// window is down to [`Shared::eager`] and the appenders the settled publish answered
    /// have joined it, or have stopped coming (see [`Self::linger`]).
    fn advance(self: &Arc<Self>, chain: &mut Chain) {
        let was_full = chain.window.len() >= IN_FLIGHT;
        while let Some(front) = chain.window.front() {
            match *front {
                Slot::InFlight { .. } => break,
                Slot::Landed {
                    expected,
                    sequence,
                    duplicate: false,
                } if sequence == expected + 1 => {
                    chain.last = sequence;
                    chain.window.pop_front();
                    chain.first += 1;
                    chain.breaks = 0;
                }
                _ => {
                    if let Slot::Landed {
                        sequence, expected, ..
                    } = *front
                    {
                        tracing::debug!(stream = %self.spec.name, sequence, expected, "an append had landed before; mending the chain");
                    }
                    chain.broken = true;
                    if !chain.mending {
                        chain.mending = true;
                        self.runtime.spawn(Arc::clone(self).mend());
                    }
                    // What gathered goes after the retries, before what queues from now.
                    chain.wait = None;
                    if let Some(gathering) = chain.gathering.take()
                        && !gathering.replies.is_empty()
                    {
                        chain.queued.push_back(gathering.into_append(&self.runtime));
                    }
                    // Appenders waiting for room queue for the mender instead.
                    self.room.notify_waiters();
                    return;
                }
            }
        }
        // (A lone appender's record goes out on its own, at once, when it comes back.)
        if chain.window.len() < self.eager
            && !chain.mending
            && chain.wait.is_none()
            && (chain.gathering.is_some() || chain.returning > 1)
        {
            chain.gathering.get_or_insert_with(Gathering::new);
            chain.waits += 1;
            chain.wait = Some(chain.waits);
            chain.lingering = false;
        }
        if was_full && chain.window.len() < IN_FLIGHT {
            self.room.notify_waiters();
        }
    }

    /// Has a task see to the gathering's wait, unless one does (see [`Self::linger`]).
    fn linger_soon(self: &Arc<Self>) {
        if !self.spec.group_commit {
            return;
        }
        let chain = self.chain();
        if chain.wait.is_some() && !chain.lingering {
            self.runtime.spawn(Arc::clone(self).linger());
        }
    }

    /// Publishes what gathered once the appenders it waits for stop coming back: after a
    /// turn of every task ready to run on this worker in which none joined it. Unless it
    /// went out before (all came back, or it filled) or the chain broke. Awaited where the
    /// appenders were answered, the first turn is theirs.
    async fn linger(self: Arc<Self>) {
        let (wait, mut returning) = {
            let mut chain = self.chain();
            match chain.wait {
                Some(wait) if !chain.lingering => {
                    chain.lingering = true;
                    (wait, chain.returning)
                }
                _ => return,
            }
        };
        loop {
            a_turn().await;
            let mut chain = self.chain();
            if chain.wait != Some(wait) {
                return;
            }
            if chain.returning == returning {
                self.flush(&mut chain);
                return;
            }
            returning = chain.returning;
        }
    }

    /// The mender: owns the chain from a break (or a client too busy to take a message at
    /// once) until it is whole and nothing is queued.
    async fn mend(self: Arc<Self>) {
        loop {
            if self.chain().broken {
                let (retries, refused, breaks) = self.take_window().await;
                match self.resync(retries, refused, breaks).await {
                    Mended::Resumed => {}
                    Mended::Fenced | Mended::Abandoned => return,
                }
            }
            if self.publish_queued().await {
                return;
            }
            if !self.chain().broken {
                self.settled.notified().await;
            }
        }
    }

    /// Waits until every publish in the window has settled, then empties it: the failed
    /// appends (in order) to publish again, whether the stream refused any, and how many
    /// breaks in a row this is.
    async fn take_window(&self) -> (Vec<(Append, String)>, bool, u32) {
        loop {
            {
                let mut chain = self.chain();
                if chain.all_settled() {
                    chain.first += chain.window.len() as u64;
                    chain.breaks += 1;
                    let mut retries = Vec::new();
                    let mut refused = false;
                    for slot in chain.window.drain(..) {
                        // What landed was answered when it settled, without moving `last`.
                        if let Slot::Failed {
                            append,
                            error,
                            refused: by_stream,
                        } = slot
                        {
                            refused |= by_stream;
                            retries.push((append, error));
                        }
                    }
                    return (retries, refused, chain.breaks);
                }
            }
            self.settled.notified().await;
        }
    }

    /// Until it knows: reads where the stream ends and asks whether this host still holds
    /// the partition. If so, the failed appends queue first, to be published from there;
    /// if not, every append is refused for good. Appends that have been tried for
    /// [`RETRY_FOR`] fail meanwhile.
    async fn resync(
        self: &Arc<Self>,
        mut retries: Vec<(Append, String)>,
        refused: bool,
        breaks: u32,
    ) -> Mended {
        let mut round = breaks;
        loop {
            // A refusal is the stream's answer, at once; anything else (a server
            // restarting, a leader being elected, the lease unanswered) is given time.
            if !refused || round > breaks {
                tokio::time::sleep(backoff(round)).await;
            }
            match resync(&self.context, &self.spec.name, &*self.authority).await {
                Ok(last) => {
                    let mut chain = self.chain();
                    chain.last = last;
                    chain.broken = false;
                    for (append, error) in retries.into_iter().rev() {
                        if append.draft.since.elapsed() >= RETRY_FOR {
                            let _ = append.reply.send(Err(self.gave_up(&error)));
                        } else {
                            chain.queued.push_front(append);
                        }
                    }
                    return Mended::Resumed;
                }
                Err(Unsettled::Fenced) => {
                    tracing::warn!(stream = %self.spec.name, "fenced: another host holds the partition");
                    let mut chain = self.chain();
                    self.fenced.store(true, Ordering::Release);
                    let queued = std::mem::take(&mut chain.queued);
                    for append in retries.into_iter().map(|(append, _)| append).chain(queued) {
                        let _ = append.reply.send(Err(fenced(&self.spec.name)));
                    }
                    return Mended::Fenced;
                }
                Err(Unsettled::Unanswered(error)) => {
                    tracing::debug!(stream = %self.spec.name, round, "mending the chain: {error}");
                    let mut chain = self.chain();
                    let (expired, waiting) = std::mem::take(&mut retries)
                        .into_iter()
                        .partition(|(append, _)| append.draft.since.elapsed() >= RETRY_FOR);
                    retries = waiting;
                    for (append, last_error) in expired {
                        let _ = append.reply.send(Err(self.gave_up(&last_error)));
                    }
                    let queued = std::mem::take(&mut chain.queued);
                    for append in queued {
                        if append.draft.since.elapsed() >= RETRY_FOR {
                            let _ = append.reply.send(Err(self.gave_up(&error)));
                        } else {
                            chain.queued.push_back(append);
                        }
                    }
                    // Only this task holds the partition's state: the log was dropped.
                    if retries.is_empty() && chain.queued.is_empty() && Arc::strong_count(self) == 1
                    {
                        return Mended::Abandoned;
                    }
                    round += 1;
                }
            }
        }
    }

    /// Publishes queued appends in order while the window has room, each settled by a task
    /// of its own. Hands the chain back (`true`) once nothing is queued.
    async fn publish_queued(self: &Arc<Self>) -> bool {
        loop {
            let (append, serial, expected) = {
                let mut chain = self.chain();
                if chain.broken || chain.window.len() >= IN_FLIGHT {
                    return false;
                }
                let Some(append) = chain.queued.pop_front() else {
                    chain.mending = false;
                    return true;
                };
                let (serial, expected) = chain.claim();
                (append, serial, expected)
            };
            let Append { draft, reply } = append;
            let in_flight = self.publish_claimed(serial, expected, draft).await;
            self.runtime.spawn(async move {
                let _ = reply.send(in_flight.settled().await);
            });
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

/// Why a broken chain is not mended yet.
enum Unsettled {
    /// Another host holds the partition.
    Fenced,
    /// The stream or the authority did not answer.
    Unanswered(String),
}
