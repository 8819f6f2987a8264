//! The per-key core: for every key, its accepted inputs in order, one at a time; its
//! sequence counter and short-term memory; and what becomes of an input whose run fails
//! (retried with backoff, then parked until an operator retries or skips it).
//!
//! A front end feeds it inputs and records what it reports, through [`Front`]: `rewind run`
//! and `rewind cluster` ([`run_inputs`], progress in checkpoints), `rewind serve` (progress
//! in the tenant's journal). docs/SEMANTICS.md, "Failure of an input", states the rules.

mod signal;
mod stream;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fmt;
use std::hash::Hash;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, UNIX_EPOCH};

use async_trait::async_trait;
use tokio::sync::Notify;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

pub use stream::{
    CheckpointFailed, Checkpointing, CheckpointsFailing, FAILED_CHECKPOINTS_TO_STOP,
    HELD_PER_KEY_SLOT, Progress, Retention, RunOptions, Summary, WaitingInputs, run_inputs,
};

use crate::agent::{Agent, Control, InputError, InputReport, Memory, Waiting};
use crate::backoff::Backoff;
pub use crate::checkpoint::Ended;
use crate::durable::unix_ms;
use crate::event::{Deltas, Input};
use crate::functions::{Clock, RunSlot, SystemClock};
use crate::text;

/// Any error, as what an operator's command does first may fail with.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What names a key to its front end: the key alone for one agent, or with its agent.
pub trait KeyId: Clone + Eq + Hash + fmt::Debug + fmt::Display + Send + Sync + 'static {}

impl<T: Clone + Eq + Hash + fmt::Debug + fmt::Display + Send + Sync + 'static> KeyId for T {}

/// An accepted input, with what its front end keeps beside it (an event id, a version).
#[derive(Clone, Debug)]
pub struct Queued<X> {
    pub input: Input,
    pub extra: X,
}

/// What comes after an attempt that failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Next {
    /// Attempt `attempt + 1` starts after `after`.
    Retry { attempt: u32, after: Duration },
    /// The input is parked after `attempts` attempts: its key's later inputs wait until an
    /// operator retries or skips it.
    Parked { attempts: u32 },
}

/// How an operator ended an input, for its front end to record.
#[derive(Clone, Copy, Debug)]
pub struct Ending<'a> {
    pub ended: Ended,
    pub by: &'a str,
    /// Why, as the operator said (may be empty for a cancel).
    pub why: &'a str,
}

/// What a cancel did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cancelling {
    /// The input (parked) is finished as cancelled: the front end has recorded it.
    Ended(u64),
    /// The input runs, retries or waits for a slot: it stops at its next durable call (or
    /// its attempt's end), and the front end hears of it through [`Front::ended`].
    Requested(u64),
}

/// Why a front end did not record an input as completed.
#[derive(Debug)]
pub enum Refusal {
    /// The input fails (it produced more than the front end takes): retried, then parked.
    Failed(InputError),
    /// The host could not record it (its log failed): the key stops, the input stays.
    Fault(HostFault),
}

/// A fault of the host, not of an input (its log did not take a write, a version of its
/// agent cannot be loaded): it never finishes or parks the input, and stops its key until
/// the host recovers.
#[derive(Debug, thiserror::Error)]
#[error("{what}: {source}")]
pub struct HostFault {
    /// What could not be done.
    pub what: String,
    #[source]
    pub source: Box<dyn std::error::Error + Send + Sync>,
}

impl HostFault {
    pub fn new(
        what: impl Into<String>,
        source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Self {
        Self {
            what: what.into(),
            source: source.into(),
        }
    }
}

/// Where a front end records progress, and what it gives the core to run inputs with.
#[async_trait]
pub trait Front: Send + Sync + 'static {
    type Key: KeyId;
    type Extra: Clone + Send + Sync + 'static;
    /// What an input holds while it runs (permits of the run slots it counts against).
    type Slot: Send;

    /// Waits for a slot to run `key`'s input in; `None` when the front end is stopping (the
    /// input stays first in its key's queue, not run).
    async fn slot(&self, key: &Self::Key) -> Option<Self::Slot>;

    /// The agent that runs `input` (serve's inputs name a version of it). An error is a
    /// host fault: the key stops with the input first in its queue.
    async fn agent(
        &self,
        key: &Self::Key,
        input: &Queued<Self::Extra>,
    ) -> Result<Arc<Agent>, HostFault>;

    /// `input` completed: records its outputs and the key's memory after it (in
    /// `report`), durably or by handing them on. Until this returns, the key's next input
    /// does not start.
    async fn completed(
        &self,
        key: &Self::Key,
        input: &Queued<Self::Extra>,
        report: InputReport,
    ) -> Result<(), Refusal>;

    /// An attempt of `input` failed with `error` (`report` says what the attempt did);
    /// `next` says what comes of it.
    async fn failed(
        &self,
        key: &Self::Key,
        input: &Queued<Self::Extra>,
        report: InputReport,
        error: InputError,
        next: Next,
    );

    /// A host fault stopped the key: `input` stays first in its queue, not finished.
    async fn stopped(&self, key: &Self::Key, input: &Queued<Self::Extra>, fault: &HostFault);

    /// An operator ended `input` without completing it (skipped it parked, or cancelled
    /// it): records that durably, with the key's `memory` (as the input before it left it:
    /// its writes are not applied). The key's next input runs once this returns; an error
    /// is a host fault, which stops the key (a skip's command is refused instead).
    async fn ended(
        &self,
        key: &Self::Key,
        input: &Queued<Self::Extra>,
        memory: &Memory,
        ending: Ending<'_>,
    ) -> Result<(), HostFault>;

    /// `input` stopped at a durable wait (`Some`, recorded in its action state already;
    /// `report` says what the run did), or runs again because its wait may be over
    /// (`None`): records where it stands, so that a restart arms its wait again without
    /// running it ([`Keys::restore_waiting`]). A front end that records nothing runs it
    /// again at a restart, to the same wait.
    async fn waiting(
        &self,
        key: &Self::Key,
        input: &Queued<Self::Extra>,
        wait: Option<&Waiting>,
        report: InputReport,
    );

    /// An operator retries the parked `input` (its `extra` as the retry has it, a newer
    /// version for instance): records that durably, so that a restart runs it rather than
    /// parking it again. It runs once this returns.
    async fn retried(
        &self,
        key: &Self::Key,
        input: &Queued<Self::Extra>,
        by: &str,
    ) -> Result<(), HostFault>;

    /// Where the pieces of streamed answers go as they come (token deltas), when someone
    /// follows them: forwarded live, never recorded.
    fn deltas(&self) -> Option<Arc<dyn Deltas>> {
        None
    }

    /// Leave for a run whose call waits between attempts to let its slot go meanwhile
    /// (held until it has one again), or `None` (the default): it keeps its slot. A run
    /// away keeps its instance alive, so the leaves bound how many are away at once.
    fn leave(&self) -> Option<Box<dyn Send>> {
        None
    }
}

/// Where a key's first unfinished input stands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Head {
    /// Nothing runs: the queue is empty, or its worker is about to start.
    Idle,
    Running {
        sequence: u64,
        attempt: u32,
    },
    /// Attempt `attempt` failed with `error`; the next starts after a wait.
    Retrying {
        sequence: u64,
        attempt: u32,
        error: String,
    },
    /// Every attempt failed; the key waits for an operator.
    Parked {
        sequence: u64,
        attempts: u32,
        error: String,
    },
    /// A host fault stopped the key; it waits for the host to recover (a restart).
    Stopped {
        sequence: u64,
        fault: String,
    },
    /// It stopped at a durable wait: it runs again when its time comes or a signal it
    /// waits for is delivered, holding nothing meanwhile.
    Waiting {
        sequence: u64,
        waiting: Waiting,
    },
}

impl Head {
    /// Whether the key waits for something outside it (an operator, a restart, a wait's
    /// time or signal): its inputs hold no run slot and do not count against intake.
    pub fn stalled(&self) -> bool {
        matches!(
            self,
            Self::Parked { .. } | Self::Stopped { .. } | Self::Waiting { .. }
        )
    }
}

/// A key's first unfinished input: where it stands, and the inputs queued behind it.
#[derive(Clone, Debug)]
pub struct KeyHead<K, X> {
    pub key: K,
    pub head: Head,
    pub first: Queued<X>,
    /// Sequences of the inputs queued behind it, in order.
    pub waiting: Vec<u64>,
}

/// Why an operator command was refused.
#[derive(Debug, thiserror::Error)]
pub enum CommandError {
    #[error("key {key} has no parked input{}", sequence.map(|s| format!(" #{s}")).unwrap_or_default())]
    NotParked { key: String, sequence: Option<u64> },
    /// A cancel that cannot be carried out, and why.
    #[error("key {key}: {why}")]
    NotCancellable { key: String, why: String },
    /// What was to be done before the retry failed: it was refused (an answer for a call
    /// that is not in doubt, say), or could not be recorded (a [`HostFault`]).
    #[error("{error}")]
    Refused {
        #[source]
        error: BoxError,
    },
    #[error("recording the {what} of {key} #{sequence}: {fault}")]
    Record {
        what: &'static str,
        key: String,
        sequence: u64,
        #[source]
        fault: HostFault,
    },
}

struct KeyState<X> {
    /// The sequence the key's next accepted input gets.
    next_sequence: u64,
    /// The key's memory as its last completed input left it.
    memory: Memory,
    /// Accepted and not finished, in order; the one running, retrying, parked or stopped
    /// is first.
    queue: VecDeque<Queued<X>>,
    head: Head,
    /// A worker task drives the key (or, the key just parked, records the park; or an
    /// operator's command holds its parked input).
    working: bool,
    /// Cancelled when an operator cancels the first input: its run stops at its next
    /// durable call. A new one for each first input.
    cancel: CancellationToken,
    /// Who cancelled the first input, and why.
    cancelled: Option<(String, String)>,
    /// The first input completed and is being recorded: too late to cancel.
    completing: bool,
    /// An operator's command holds the parked first input (see `Keys::claim`).
    claimed: bool,
    /// The first input's wait may be over (its time came, or a signal came for it) while
    /// its worker still ran it: it runs again as soon as it stops.
    wake: bool,
    /// The first input was woken from a wait: its front end hears of it before it runs.
    woken: bool,
    /// When the timer of the first input's wait is armed for (taken out of the timer table
    /// as the input leaves its wait, so that none is left behind).
    armed: Option<u64>,
    /// The ids of the signals delivered to the key's inputs lately, with the input each went
    /// to (the newest [`SIGNAL_IDS_KEPT`]): a signal sent again after its input finished is
    /// known by its id, not delivered to the next input, even when the key has no
    /// unfinished input. The agent's index of signal ids is the durable copy, which a
    /// restart reads (`Agent::signal_sent`).
    signals: VecDeque<(String, u64)>,
    /// Signals to the key are delivered one at a time (each reads an inbox and the key's
    /// index of signal ids, then writes them whole); other keys' go on. Made at the key's
    /// first signal.
    signal_lock: Option<Arc<tokio::sync::Mutex<()>>>,
}

impl<X> Default for KeyState<X> {
    fn default() -> Self {
        Self {
            next_sequence: 1,
            memory: Memory::default(),
            queue: VecDeque::new(),
            head: Head::Idle,
            working: false,
            cancel: CancellationToken::new(),
            cancelled: None,
            completing: false,
            claimed: false,
            wake: false,
            woken: false,
            armed: None,
            signals: VecDeque::new(),
            signal_lock: None,
        }
    }
}

impl<X> KeyState<X> {
    /// The first input is finished: the next one (if any) is first, not cancelled.
    fn pop(&mut self) {
        self.queue.pop_front();
        self.cancel = CancellationToken::new();
        self.cancelled = None;
        self.completing = false;
        self.claimed = false;
        self.wake = false;
        self.woken = false;
    }
}

/// Every key's state, and how many inputs wait in stalled keys (kept as heads change, so
/// that intake can ask at every input).
struct Table<K, X> {
    keys: HashMap<K, KeyState<X>>,
    stalled: usize,
    /// Keys whose first input is at a durable wait (kept as heads change).
    waiting: usize,
    /// The waits with a time, by when it comes (milliseconds since the Unix epoch): the
    /// key and the sequence of the input that waits. One left behind (its input woke by a
    /// signal, or was cancelled) wakes nothing when its time comes.
    timers: BTreeMap<u64, Vec<(K, u64)>>,
}

impl<K: KeyId, X> Table<K, X> {
    /// Sets `key`'s head, counting its queue in or out of the stalled inputs.
    fn set_head(&mut self, key: &K, head: Head) {
        let Some(state) = self.keys.get_mut(key) else {
            return;
        };
        match (state.head.stalled(), head.stalled()) {
            (false, true) => self.stalled += state.queue.len(),
            (true, false) => self.stalled -= state.queue.len(),
            _ => {}
        }
        let leaves = matches!(state.head, Head::Waiting { .. });
        let enters = matches!(head, Head::Waiting { .. });
        match (leaves, enters) {
            (false, true) => self.waiting += 1,
            (true, false) => self.waiting -= 1,
            _ => {}
        }
        let left_wait = leaves && !enters;
        state.head = head;
        if left_wait {
            self.disarm(key);
        }
    }

    /// Takes `key`'s armed timer (if any) out of the timer table.
    fn disarm(&mut self, key: &K) {
        let Some(until) = self.keys.get_mut(key).and_then(|state| state.armed.take()) else {
            return;
        };
        if let Some(due) = self.timers.get_mut(&until) {
            due.retain(|(k, _)| k != key);
            if due.is_empty() {
                self.timers.remove(&until);
            }
        }
    }

    /// `key`'s parked input (`sequence`, when given, must be it), or with `waits` its
    /// waiting one, once its park or wait is recorded and while no other command holds it.
    fn parked(
        &self,
        key: &K,
        sequence: Option<u64>,
        waits: bool,
    ) -> Result<&Queued<X>, CommandError> {
        self.keys
            .get(key)
            .filter(|state| !state.working)
            .and_then(|state| match state.head {
                Head::Parked { sequence: s, .. } if sequence.is_none_or(|n| n == s) => {
                    state.queue.front()
                }
                Head::Waiting { sequence: s, .. } if waits && sequence.is_none_or(|n| n == s) => {
                    state.queue.front()
                }
                _ => None,
            })
            .ok_or_else(|| CommandError::NotParked {
                key: key.to_string(),
                sequence,
            })
    }
}

/// Where a front end's inputs stand at one moment ([`Keys::standing`]).
#[derive(Clone, Copy, Debug)]
pub struct Standing {
    /// Inputs that wait for someone outside their key: parked, stopped or waiting ones,
    /// and those queued behind them.
    pub stalled: usize,
    /// Keys whose first input is at a durable wait (its wait recorded, or being recorded).
    pub waits: usize,
    /// Whether the front end has heard of every stalled key's park, wait or stop.
    pub stalls_heard: bool,
    /// Whether a wait's time has come (its timer about to wake it); on a clock that skips
    /// time, whether any timer is armed.
    pub waits_due: bool,
}

struct Shared<F: Front> {
    front: Arc<F>,
    table: Mutex<Table<F::Key, F::Extra>>,
    /// A timer earlier than the ones the timer task sleeps toward was armed.
    timers_changed: Notify,
    /// What the timers read the time from: the agents' clock.
    clock: Arc<dyn Clock>,
}

impl<F: Front> Shared<F> {
    /// Milliseconds since the Unix epoch, by the timers' clock.
    fn now_ms(&self) -> u64 {
        unix_ms(self.clock.now())
    }
}

impl<F: Front> Shared<F> {
    fn lock(&self) -> MutexGuard<'_, Table<F::Key, F::Extra>> {
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Arms the timer of `key`'s input `sequence`, which waits until `until` (the key's
    /// timer armed before, if any, taken out).
    fn arm(&self, table: &mut Table<F::Key, F::Extra>, key: &F::Key, sequence: u64, until: u64) {
        table.disarm(key);
        if let Some(state) = table.keys.get_mut(key) {
            state.armed = Some(until);
        }
        let earliest = table
            .timers
            .keys()
            .next()
            .is_none_or(|&first| until < first);
        table
            .timers
            .entry(until)
            .or_default()
            .push((key.clone(), sequence));
        if earliest {
            self.timers_changed.notify_one();
        }
    }
}

/// Where keys' workers run: the core's, and its timer task's to wake keys with.
struct Spawner {
    workers: Mutex<JoinSet<()>>,
    runtime: tokio::runtime::Handle,
}

impl Spawner {
    fn spawn<F: Front>(&self, shared: &Arc<Shared<F>>, key: F::Key) {
        let mut workers = self.workers.lock().unwrap_or_else(|p| p.into_inner());
        // Finished workers' results are of no use: drop them as new ones start.
        while workers.try_join_next().is_some() {}
        workers.spawn_on(work(Arc::clone(shared), key), &self.runtime);
    }
}

/// Every key of a front end. Dropping it stops the keys' workers and its timers.
pub struct Keys<F: Front> {
    shared: Arc<Shared<F>>,
    /// Where workers (and so the actions they run) are spawned.
    spawner: Arc<Spawner>,
    /// The task that wakes keys whose wait's time came.
    timer: tokio::task::AbortHandle,
}

impl<F: Front> Drop for Keys<F> {
    fn drop(&mut self) {
        self.timer.abort();
        (self
            .spawner
            .workers
            .lock()
            .unwrap_or_else(|p| p.into_inner()))
        .abort_all();
    }
}

impl<F: Front> fmt::Debug for Keys<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Keys")
            .field("keys", &self.shared.lock().keys.len())
            .finish_non_exhaustive()
    }
}

impl<F: Front> Keys<F> {
    /// Keys whose inputs run on the current runtime.
    pub fn new(front: Arc<F>) -> Self {
        Self::on(front, tokio::runtime::Handle::current())
    }

    /// Keys whose inputs run on the current runtime, their timers read `clock` (the one
    /// their agents' waits read; a clock that skips time fires every timer at once).
    pub fn with_clock(front: Arc<F>, clock: Arc<dyn Clock>) -> Self {
        Self::build(front, tokio::runtime::Handle::current(), clock)
    }

    /// Keys whose inputs run on `runtime`.
    pub fn on(front: Arc<F>, runtime: tokio::runtime::Handle) -> Self {
        Self::build(front, runtime, Arc::new(SystemClock))
    }

    fn build(front: Arc<F>, runtime: tokio::runtime::Handle, clock: Arc<dyn Clock>) -> Self {
        let shared = Arc::new(Shared {
            front,
            table: Mutex::new(Table {
                keys: HashMap::new(),
                stalled: 0,
                waiting: 0,
                timers: BTreeMap::new(),
            }),
            timers_changed: Notify::new(),
            clock,
        });
        let spawner = Arc::new(Spawner {
            workers: Mutex::new(JoinSet::new()),
            runtime,
        });
        let timer = spawner
            .runtime
            .spawn(timers(Arc::clone(&shared), Arc::clone(&spawner)))
            .abort_handle();
        Self {
            shared,
            spawner,
            timer,
        }
    }

    /// Sets where a recovered key stands: the sequence its next input gets and its memory.
    pub fn restore(&self, key: F::Key, next_sequence: u64, memory: Memory) {
        let mut table = self.shared.lock();
        let state = table.keys.entry(key).or_default();
        state.next_sequence = state.next_sequence.max(next_sequence);
        state.memory = memory;
    }

    /// Queues `queued` as `key`'s first input, parked as it was when the front end last
    /// recorded it (after `attempts` attempts, with `error`): recovery's counterpart of
    /// parking. Behind other inputs of its key it is queued as any other.
    pub fn restore_parked(
        &self,
        key: F::Key,
        queued: Queued<F::Extra>,
        attempts: u32,
        error: String,
    ) {
        let sequence = queued.input.sequence;
        let parked = Head::Parked {
            sequence,
            attempts,
            error,
        };
        self.restore_stalled(key, queued, parked);
    }

    /// Queues `queued` as `key`'s first input, waiting as it was when the front end last
    /// recorded it: its timer armed, not run until its time comes or a signal it waits for
    /// is delivered. (A front end that finds a signal delivered meanwhile queues it with
    /// [`push`](Self::push) instead, to run now.) Behind other inputs of its key it is
    /// queued as any other.
    pub fn restore_waiting(&self, key: F::Key, queued: Queued<F::Extra>, waiting: Waiting) {
        let sequence = queued.input.sequence;
        let until = waiting.wait.until;
        // Its time came while nothing ran it: it runs now.
        if until.is_some_and(|until| until <= self.shared.now_ms()) {
            self.push(key, queued);
            return;
        }
        if self.restore_stalled(key.clone(), queued, Head::Waiting { sequence, waiting })
            && let Some(until) = until
        {
            let mut table = self.shared.lock();
            self.shared.arm(&mut table, &key, sequence, until);
        }
    }

    /// Queues `queued` first on `key` with `head`; `false` (queued as any other) when the
    /// key has inputs before it.
    fn restore_stalled(&self, key: F::Key, queued: Queued<F::Extra>, head: Head) -> bool {
        let first = self
            .shared
            .lock()
            .keys
            .get(&key)
            .is_none_or(|state| state.queue.is_empty());
        if !first {
            self.push(key, queued);
            return false;
        }
        let mut table = self.shared.lock();
        let state = table.keys.entry(key.clone()).or_default();
        state.next_sequence = state.next_sequence.max(queued.input.sequence + 1);
        state.queue.push_back(queued);
        table.set_head(&key, head);
        true
    }

    /// The sequence the key's next input gets, taken: an input accepted with it is
    /// [`push`](Self::push)ed, or the sequence is never used.
    pub fn take_sequence(&self, key: &F::Key) -> u64 {
        let mut table = self.shared.lock();
        let state = table.keys.entry(key.clone()).or_default();
        let sequence = state.next_sequence;
        state.next_sequence += 1;
        sequence
    }

    /// Queues an accepted input on its key (sequences in order, one push per sequence) and
    /// starts the key's worker unless one runs or the key is stalled. Returns whether it
    /// waits behind a parked or stopped input.
    pub fn push(&self, key: F::Key, queued: Queued<F::Extra>) -> bool {
        let start = {
            let mut table = self.shared.lock();
            let state = table.keys.entry(key.clone()).or_default();
            state.next_sequence = state.next_sequence.max(queued.input.sequence + 1);
            state.queue.push_back(queued);
            if state.head.stalled() {
                table.stalled += 1;
                return true;
            }
            !std::mem::replace(&mut state.working, true)
        };
        if start {
            self.spawn(key);
        }
        false
    }

    /// Where the inputs stand, read at one moment (under one lock): a front end that ends
    /// when nothing is left to run decides on this, since separate reads could each miss a
    /// wait that a timer woke between them. `heard` says whether the front end has
    /// recorded a stalled key's head (the key, and its head with its first input's
    /// sequence).
    pub fn standing(&self, heard: impl Fn(&F::Key, &Head) -> bool) -> Standing {
        let now = self.shared.now_ms();
        let skips = self.shared.clock.skips();
        let table = self.shared.lock();
        Standing {
            stalled: table.stalled,
            waits: table.waiting,
            stalls_heard: (table.keys.iter())
                .filter(|(_, state)| state.head.stalled())
                .all(|(key, state)| heard(key, &state.head)),
            waits_due: (table.timers.keys().next()).is_some_and(|&first| first <= now || skips),
        }
    }

    /// Every key with an unfinished input whose head `select` takes, with its first input.
    /// (`select` sees a park being recorded as parked; the head returned shows it as still
    /// running until it is recorded.)
    pub fn heads(&self, select: impl Fn(&F::Key, &Head) -> bool) -> Vec<KeyHead<F::Key, F::Extra>> {
        let table = self.shared.lock();
        table
            .keys
            .iter()
            .filter(|(key, state)| select(key, &state.head))
            .filter_map(|(key, state)| key_head(key, state))
            .collect()
    }

    /// `key`'s first unfinished input, if it has one.
    pub fn head(&self, key: &F::Key) -> Option<KeyHead<F::Key, F::Extra>> {
        let table = self.shared.lock();
        key_head(key, table.keys.get(key)?)
    }

    /// Runs `key`'s parked input again (`sequence`, when given, must be it), from its
    /// first attempt, after `change` (a newer version, say). The front end records the
    /// retry with `by` first.
    pub async fn retry(
        &self,
        key: &F::Key,
        sequence: Option<u64>,
        by: &str,
        change: impl FnOnce(&mut Queued<F::Extra>) + Send,
    ) -> Result<u64, CommandError> {
        self.run_again(key, sequence, by, change, |_| async { Ok(()) })
            .await
    }

    /// Runs `key`'s parked input again (`sequence`, when given, must be it) after `first`
    /// succeeds: an operator's answer for a call of it left in doubt, say, recorded while
    /// nothing runs the input and no other command can take it. An error of `first`
    /// leaves the input parked as it was.
    pub async fn retry_after<Fut>(
        &self,
        key: &F::Key,
        sequence: Option<u64>,
        by: &str,
        first: impl FnOnce(Queued<F::Extra>) -> Fut + Send,
    ) -> Result<u64, CommandError>
    where
        Fut: Future<Output = Result<(), BoxError>> + Send,
    {
        self.run_again(key, sequence, by, |_| {}, first).await
    }

    async fn run_again<Fut>(
        &self,
        key: &F::Key,
        sequence: Option<u64>,
        by: &str,
        change: impl FnOnce(&mut Queued<F::Extra>) + Send,
        first: impl FnOnce(Queued<F::Extra>) -> Fut + Send,
    ) -> Result<u64, CommandError>
    where
        Fut: Future<Output = Result<(), BoxError>> + Send,
    {
        let (mut parked, _) = self.claim(key, sequence, false)?;
        let retried = parked.input.sequence;
        if let Err(error) = first(parked.clone()).await {
            self.release(key);
            return Err(CommandError::Refused { error });
        }
        change(&mut parked);
        if let Err(fault) = self.shared.front.retried(key, &parked, by).await {
            self.release(key);
            return Err(CommandError::Record {
                what: "retry",
                key: key.to_string(),
                sequence: retried,
                fault,
            });
        }
        tracing::warn!(key = %key, sequence = retried, by, "an operator retries the parked input");
        {
            let mut table = self.shared.lock();
            table.set_head(key, Head::Idle);
            if let Some(state) = table.keys.get_mut(key) {
                state.claimed = false;
                if let Some(first) = state.queue.front_mut() {
                    *first = parked;
                }
            }
        }
        // The claim is the worker's now.
        self.spawn(key.clone());
        Ok(retried)
    }

    /// Skips `key`'s parked input (`sequence`, when given, must be it): the front end
    /// records the skip with `by` and `why`, and the key's next input runs.
    pub async fn skip(
        &self,
        key: &F::Key,
        sequence: Option<u64>,
        by: &str,
        why: &str,
    ) -> Result<u64, CommandError> {
        let ending = Ending {
            ended: Ended::Skipped,
            by,
            why,
        };
        self.end_parked(key, sequence, ending).await
    }

    /// Cancels `key`'s first unfinished input (`sequence`, when given, must be it). A
    /// parked one is ended at once, as a skip is; one that runs, retries or waits for a
    /// slot stops at its next durable call (which is not made), or at its attempt's end,
    /// and is then ended as cancelled: nothing it did is applied and the key goes on.
    pub async fn cancel(
        &self,
        key: &F::Key,
        sequence: Option<u64>,
        by: &str,
        why: &str,
    ) -> Result<Cancelling, CommandError> {
        let refuse = |why: String| CommandError::NotCancellable {
            key: key.to_string(),
            why,
        };
        {
            let mut table = self.shared.lock();
            let state = table
                .keys
                .get_mut(key)
                .filter(|state| !state.queue.is_empty())
                .ok_or_else(|| refuse("it has no unfinished input".to_owned()))?;
            let first = state.queue.front().map_or(0, |q| q.input.sequence);
            if let Some(sequence) = sequence.filter(|&s| s != first) {
                return Err(refuse(
                    if state.queue.iter().any(|q| q.input.sequence == sequence) {
                        format!(
                            "#{sequence} waits behind #{first}; only a key's first unfinished \
                         input is cancelled (cancel #{first}, or wait until #{sequence} runs)"
                        )
                    } else {
                        format!("#{sequence} is not an unfinished input of it")
                    },
                ));
            }
            match &state.head {
                // Ended below, as a skip is.
                Head::Parked { .. } | Head::Waiting { .. } if !state.working => {}
                Head::Stopped { fault, .. } => {
                    return Err(refuse(format!(
                        "#{first} was stopped by a host fault and runs again when the host \
                         recovers; cancel it then ({fault})"
                    )));
                }
                _ if state.completing => {
                    return Err(refuse(format!(
                        "#{first} completed before the cancel came; its outputs are recorded"
                    )));
                }
                // Another command's outcome decides what comes of it: ask again after.
                _ if state.claimed => {
                    return Err(refuse(format!(
                        "another operator command is being carried out on #{first}; ask again"
                    )));
                }
                // Nothing drives the key: its front end is stopping, and runs it again at
                // its next start.
                _ if !state.working => {
                    return Err(refuse(format!(
                        "#{first} is not running: the front end is stopping; cancel it once \
                         it runs again"
                    )));
                }
                _ => {
                    if state.cancelled.is_none() {
                        state.cancelled = Some((by.to_owned(), why.to_owned()));
                        state.cancel.cancel();
                        tracing::warn!(key = %key, sequence = first, by, why,
                            "an operator cancels the input; it stops at its next durable call");
                    }
                    return Ok(Cancelling::Requested(first));
                }
            }
        }
        let ending = Ending {
            ended: Ended::Cancelled,
            by,
            why,
        };
        self.end_parked(key, sequence, ending)
            .await
            .map(Cancelling::Ended)
    }

    /// Ends `key`'s parked input (`sequence`, when given, must be it) as `ending` says:
    /// the front end records it, and the key's next input runs.
    async fn end_parked(
        &self,
        key: &F::Key,
        sequence: Option<u64>,
        ending: Ending<'_>,
    ) -> Result<u64, CommandError> {
        let waits = ending.ended == Ended::Cancelled;
        let (parked, memory) = self.claim(key, sequence, waits)?;
        let ended = parked.input.sequence;
        let recorded = self.shared.front.ended(key, &parked, &memory, ending);
        if let Err(fault) = recorded.await {
            self.release(key);
            return Err(CommandError::Record {
                what: ending.ended.name(),
                key: key.to_string(),
                sequence: ended,
                fault,
            });
        }
        tracing::warn!(key = %key, sequence = ended, by = ending.by, why = ending.why,
            "an operator {} the parked input", ending.ended.name());
        let more = {
            let mut table = self.shared.lock();
            table.set_head(key, Head::Idle);
            table.keys.get_mut(key).is_some_and(|state| {
                state.pop();
                state.working = !state.queue.is_empty();
                state.working
            })
        };
        if more {
            self.spawn(key.clone());
        }
        Ok(ended)
    }

    /// Takes `key`'s parked input (`sequence`, when given, must be it), with the key's
    /// memory, for one operator's command: the key's worker flag, held until the command
    /// ends, refuses every other command meanwhile (of two at once, one records).
    fn claim(
        &self,
        key: &F::Key,
        sequence: Option<u64>,
        waits: bool,
    ) -> Result<(Queued<F::Extra>, Memory), CommandError> {
        let mut table = self.shared.lock();
        let parked = table.parked(key, sequence, waits)?.clone();
        let state = table
            .keys
            .get_mut(key)
            .ok_or_else(|| CommandError::NotParked {
                key: key.to_string(),
                sequence,
            })?;
        state.working = true;
        state.claimed = true;
        Ok((parked, Arc::clone(&state.memory)))
    }

    /// Lets go of a command's claim: the input stays parked as it was.
    fn release(&self, key: &F::Key) {
        let woken = {
            let mut table = self.shared.lock();
            let Some(state) = table.keys.get_mut(key) else {
                return;
            };
            state.working = false;
            state.claimed = false;
            // A wait that came to its end while the command held the input (it shows as
            // running since): it runs now.
            let woken =
                state.wake && matches!(state.head, Head::Waiting { .. } | Head::Running { .. });
            if woken {
                state.wake = false;
                state.working = true;
                state.woken = true;
                table.set_head(key, Head::Idle);
            }
            woken
        };
        if woken {
            self.spawn(key.clone());
        }
    }

    fn spawn(&self, key: F::Key) {
        self.spawner.spawn(&self.shared, key);
    }
}

/// Wakes the keys whose wait's time came, sleeping toward the earliest: one task for every
/// timer, however many.
async fn timers<F: Front>(shared: Arc<Shared<F>>, spawner: Arc<Spawner>) {
    loop {
        let next = shared.lock().timers.keys().next().copied();
        let Some(at) = next else {
            shared.timers_changed.notified().await;
            continue;
        };
        let now = shared.now_ms();
        let skipped = at > now && shared.clock.skip_to(UNIX_EPOCH + Duration::from_millis(at));
        if at > now && !skipped {
            tokio::select! {
                () = shared.timers_changed.notified() => continue,
                () = tokio::time::sleep(Duration::from_millis(at - now)) => {}
            }
        }
        // Taken out of the table and woken under one lock: no one sees a due timer gone
        // while its input still waits (a run would end on it).
        let start: Vec<F::Key> = {
            let mut table = shared.lock();
            let later = table.timers.split_off(&(shared.now_ms() + 1));
            let due = std::mem::replace(&mut table.timers, later);
            (due.into_values().flatten())
                .filter(|(key, sequence)| woken(&mut table, key, *sequence, None))
                .map(|(key, _)| key)
                .collect()
        };
        for key in start {
            spawner.spawn(&shared, key);
        }
    }
}

/// `key`'s input `sequence` may be past its wait (its time came, or `signal` was delivered
/// to it): if it is the key's first, it runs again if it waits (for `signal`, when given),
/// or as soon as its run stops if one runs.
fn wake<F: Front>(
    shared: &Arc<Shared<F>>,
    spawner: &Spawner,
    key: &F::Key,
    sequence: u64,
    signal: Option<&str>,
) {
    let start = woken(&mut shared.lock(), key, sequence, signal);
    if start {
        spawner.spawn(shared, key.clone());
    }
}

/// [`wake`]'s change to the table: whether a worker is to start for `key`.
fn woken<K: KeyId, X>(
    table: &mut Table<K, X>,
    key: &K,
    sequence: u64,
    signal: Option<&str>,
) -> bool {
    let Some(state) = table.keys.get_mut(key) else {
        return false;
    };
    if state.queue.front().map(|q| q.input.sequence) != Some(sequence) {
        return false;
    }
    match &state.head {
        Head::Waiting { waiting, .. }
            if signal.is_some_and(|name| !waiting.wait.signals.iter().any(|s| s == name)) =>
        {
            false
        }
        Head::Waiting { .. } if !state.working => {
            state.working = true;
            state.woken = true;
            table.set_head(key, Head::Idle);
            true
        }
        // Its wait is being recorded: it runs again once that is done, and counts as
        // running from now on (a run that ended now would leave it behind).
        Head::Waiting { sequence, .. } => {
            let running = Head::Running {
                sequence: *sequence,
                attempt: 1,
            };
            state.wake = true;
            table.set_head(key, running);
            false
        }
        Head::Idle | Head::Running { .. } => {
            state.wake = true;
            false
        }
        Head::Retrying { .. } | Head::Parked { .. } | Head::Stopped { .. } => false,
    }
}

fn key_head<K: Clone, X: Clone>(key: &K, state: &KeyState<X>) -> Option<KeyHead<K, X>> {
    let head = match &state.head {
        // Its park is being recorded: still its last attempt, until it takes commands.
        Head::Parked {
            sequence, attempts, ..
        } if state.working => Head::Running {
            sequence: *sequence,
            attempt: *attempts,
        },
        // Its wait is being recorded: still running.
        Head::Waiting { sequence, .. } if state.working => Head::Running {
            sequence: *sequence,
            attempt: 1,
        },
        head => head.clone(),
    };
    Some(KeyHead {
        key: key.clone(),
        head,
        first: state.queue.front()?.clone(),
        waiting: state
            .queue
            .iter()
            .skip(1)
            .map(|q| q.input.sequence)
            .collect(),
    })
}

/// Drives `key`: runs its queued inputs one at a time, in order, until the queue is empty
/// or its first input is parked or stopped.
async fn work<F: Front>(shared: Arc<Shared<F>>, key: F::Key) {
    loop {
        let (queued, memory, cancel, woken) = {
            let mut table = shared.lock();
            let Some(state) = table.keys.get_mut(&key) else {
                return;
            };
            match state.queue.front() {
                Some(queued) => (
                    queued.clone(),
                    Arc::clone(&state.memory),
                    state.cancel.clone(),
                    std::mem::take(&mut state.woken),
                ),
                None => {
                    state.working = false;
                    state.head = Head::Idle;
                    return;
                }
            }
        };
        if woken {
            let report = InputReport::default();
            shared.front.waiting(&key, &queued, None, report).await;
        }
        let memory = match attempts(&shared, &key, &queued, &memory, &cancel).await {
            Attempts::Completed(memory) => Some(memory),
            Attempts::Cancelled => {
                if !end_cancelled(&shared, &key, &queued, &memory).await {
                    return;
                }
                None
            }
            Attempts::Over => return,
        };
        let mut table = shared.lock();
        table.set_head(&key, Head::Idle);
        if let Some(state) = table.keys.get_mut(&key) {
            state.pop();
            if let Some(memory) = memory {
                state.memory = memory;
            }
        }
    }
}

/// How the attempts at a key's first input ended.
enum Attempts {
    /// It completed and is recorded, leaving the key's memory so.
    Completed(Memory),
    /// An operator cancelled it; the front end has not recorded that yet.
    Cancelled,
    /// It is parked or stopped, or the front end stops: the worker ends.
    Over,
}

/// Runs `queued` (the key's first input, on `memory`) until it completes, is cancelled, or
/// is parked or stopped: each failed attempt retried after its backoff.
async fn attempts<F: Front>(
    shared: &Shared<F>,
    key: &F::Key,
    queued: &Queued<F::Extra>,
    memory: &Memory,
    cancel: &CancellationToken,
) -> Attempts {
    let front = &shared.front;
    let sequence = queued.input.sequence;
    let mut attempt = 0;
    loop {
        attempt += 1;
        let slot = tokio::select! {
            biased;
            () = cancel.cancelled() => return Attempts::Cancelled,
            slot = front.slot(key) => slot,
        };
        let Some(slot) = slot else {
            set_head(shared, key, Head::Idle, true);
            return Attempts::Over;
        };
        let lent = Arc::new(Lent {
            front: Arc::clone(front),
            key: key.clone(),
            slot: Mutex::new(Some(slot)),
        });
        let agent = match front.agent(key, queued).await {
            Ok(agent) => agent,
            Err(fault) => {
                lent.release();
                stop(shared, key, queued, fault).await;
                return Attempts::Over;
            }
        };
        set_head(shared, key, Head::Running { sequence, attempt }, false);
        let control = Control {
            cancel: cancel.clone(),
            slot: Some(Arc::clone(&lent) as Arc<dyn RunSlot>),
            deltas: front.deltas(),
        };
        let mut report = agent
            .process_isolated(&queued.input, memory, &control)
            .await;
        if let Some(waiting) = report.waiting.take() {
            lent.release();
            match suspend(shared, key, queued, waiting, report).await {
                Suspended::Over => return Attempts::Over,
                Suspended::Cancelled => return Attempts::Cancelled,
                // A run after a wait is a first attempt again.
                Suspended::Woken => {
                    attempt = 0;
                    continue;
                }
            }
        }
        if cancelled(shared, key, report.error.is_none()) {
            return Attempts::Cancelled;
        }
        let error = match report.error.take() {
            None => {
                let memory = Arc::clone(&report.memory);
                // The slot is held until the input is recorded: a front end that stops
                // waits for that too.
                let completed = front.completed(key, queued, report).await;
                lent.release();
                match completed {
                    Ok(()) => return Attempts::Completed(memory),
                    Err(Refusal::Fault(fault)) => {
                        stop(shared, key, queued, fault).await;
                        return Attempts::Over;
                    }
                    Err(Refusal::Failed(error)) => {
                        if let Some(state) = shared.lock().keys.get_mut(key) {
                            state.completing = false;
                        }
                        report = InputReport::default();
                        error
                    }
                }
            }
            Some(error) if error.is_host_fault() => {
                lent.release();
                stop(shared, key, queued, HostFault::new("the run", error)).await;
                return Attempts::Over;
            }
            Some(error) => {
                lent.release();
                error
            }
        };
        let retry = agent.retry();
        let labels = (agent.tenant(), agent.name());
        // Escaped and bounded: a guest's error is its own text.
        let message = text::outside_error(&error.to_string());
        if attempt < retry.attempts {
            let after = Backoff::from_millis(retry.initial_ms, retry.max_ms).delay(attempt);
            tracing::warn!(tenant = %labels.0, agent = labels.1, key = %key, sequence,
                attempt, attempts = retry.attempts, retry_in = ?after,
                "input failed; retrying: {message}");
            let retrying = Head::Retrying {
                sequence,
                attempt,
                error: message,
            };
            set_head(shared, key, retrying, false);
            front
                .failed(key, queued, report, error, Next::Retry { attempt, after })
                .await;
            tokio::select! {
                () = cancel.cancelled() => return Attempts::Cancelled,
                () = tokio::time::sleep(after) => continue,
            }
        }
        let parked = Head::Parked {
            sequence,
            attempts: attempt,
            error: message.clone(),
        };
        // Stalled from now on (a front end that waits for its inputs to finish or stall
        // counts on that once it hears of the park), but shown as parked, and taking
        // commands, only once the front end has recorded it: a retry recorded before the
        // park would be undone by it at recovery.
        set_head(shared, key, parked, false);
        let next = Next::Parked { attempts: attempt };
        front.failed(key, queued, report, error, next).await;
        {
            let mut table = shared.lock();
            let Some(state) = table.keys.get_mut(key) else {
                return Attempts::Over;
            };
            // A cancel that came while the park was recorded ends it now.
            if state.cancelled.is_some() {
                return Attempts::Cancelled;
            }
            state.working = false;
        }
        // Once it takes commands, so that an operator who reads this can act on it.
        tracing::error!(tenant = %labels.0, agent = labels.1, key = %key, sequence,
            attempts = attempt, "input parked after its last attempt; its key's later \
            inputs wait for an operator to retry, skip or cancel it: {message}");
        return Attempts::Over;
    }
}

/// The run slot an input's run holds, lent to its durable calls: they let go of it while
/// they wait between attempts (a 429's `Retry-After`, a backoff), so that other keys run
/// meanwhile, and take one again before they go on.
struct Lent<F: Front> {
    front: Arc<F>,
    key: F::Key,
    slot: Mutex<Option<F::Slot>>,
}

impl<F: Front> Lent<F> {
    /// Lets go of the slot (the run is over, or the front end has recorded it).
    fn release(&self) {
        drop(self.slot.lock().unwrap_or_else(|p| p.into_inner()).take());
    }
}

#[async_trait]
impl<F: Front> RunSlot for Lent<F> {
    async fn away<'a>(&'a self, wait: Pin<Box<dyn Future<Output = ()> + Send + 'a>>) -> bool {
        let Some(leave) = self.front.leave() else {
            wait.await;
            return true;
        };
        self.release();
        wait.await;
        // None: the front end is stopping.
        let slot = self.front.slot(&self.key).await;
        drop(leave);
        let taken = slot.is_some();
        *self.slot.lock().unwrap_or_else(|p| p.into_inner()) = slot;
        taken
    }
}

/// What came of a run that stopped at a wait.
enum Suspended {
    /// It waits, holding nothing: the worker ends.
    Over,
    /// Its wait may be over already (its time came, or a signal, while it ran or its wait
    /// was recorded): it runs again now.
    Woken,
    /// An operator cancelled it.
    Cancelled,
}

/// `key`'s first input (`queued`) stopped at `waiting` (`report` says what its run did):
/// it waits, its timer armed and its front end told, unless the wait may be over already.
async fn suspend<F: Front>(
    shared: &Shared<F>,
    key: &F::Key,
    queued: &Queued<F::Extra>,
    waiting: Waiting,
    report: InputReport,
) -> Suspended {
    let sequence = queued.input.sequence;
    {
        let mut table = shared.lock();
        if let Some(until) = waiting.wait.until {
            shared.arm(&mut table, key, sequence, until);
        }
        let head = Head::Waiting {
            sequence,
            waiting: waiting.clone(),
        };
        table.set_head(key, head);
    }
    shared
        .front
        .waiting(key, queued, Some(&waiting), report)
        .await;
    {
        let mut table = shared.lock();
        let Some(state) = table.keys.get_mut(key) else {
            return Suspended::Over;
        };
        if state.cancelled.is_some() {
            return Suspended::Cancelled;
        }
        // A wake that came while the input ran, or while its wait was recorded, is for
        // this wait (or one it passed): it runs again.
        if !std::mem::take(&mut state.wake) {
            state.working = false;
            tracing::debug!(key = %key, sequence, action = %waiting.action,
                "the input waits {}; it holds no run slot meanwhile", waiting.wait);
            return Suspended::Over;
        }
        table.set_head(key, Head::Idle);
    }
    shared
        .front
        .waiting(key, queued, None, InputReport::default())
        .await;
    Suspended::Woken
}

/// Whether an operator cancelled `key`'s first input; if not and `completing`, from now on
/// it is too late to.
fn cancelled<F: Front>(shared: &Shared<F>, key: &F::Key, completing: bool) -> bool {
    let mut table = shared.lock();
    let Some(state) = table.keys.get_mut(key) else {
        return false;
    };
    if state.cancelled.is_some() {
        return true;
    }
    state.completing = completing;
    false
}

/// Has the front end record `key`'s first input (`queued`) as cancelled; `false` when it
/// could not (a host fault, which stops the key).
async fn end_cancelled<F: Front>(
    shared: &Shared<F>,
    key: &F::Key,
    queued: &Queued<F::Extra>,
    memory: &Memory,
) -> bool {
    let (by, why) = {
        let mut table = shared.lock();
        // A park or wait being recorded when the cancel came was stalled: no longer.
        let running = match table.keys.get(key).map(|state| &state.head) {
            Some(Head::Parked {
                sequence, attempts, ..
            }) => Some(Head::Running {
                sequence: *sequence,
                attempt: *attempts,
            }),
            Some(Head::Waiting { sequence, .. }) => Some(Head::Running {
                sequence: *sequence,
                attempt: 1,
            }),
            _ => None,
        };
        if let Some(running) = running {
            table.set_head(key, running);
        }
        table
            .keys
            .get(key)
            .and_then(|state| state.cancelled.clone())
            .unwrap_or_default()
    };
    let ending = Ending {
        ended: Ended::Cancelled,
        by: &by,
        why: &why,
    };
    match shared.front.ended(key, queued, memory, ending).await {
        Ok(()) => {
            tracing::warn!(key = %key, sequence = queued.input.sequence, by, why,
                "an operator cancelled the input; its key goes on");
            true
        }
        Err(fault) => {
            stop(shared, key, queued, fault).await;
            false
        }
    }
}

/// Sets `key`'s head; with `done`, its worker is ending.
fn set_head<F: Front>(shared: &Shared<F>, key: &F::Key, head: Head, done: bool) {
    let mut table = shared.lock();
    table.set_head(key, head);
    if done && let Some(state) = table.keys.get_mut(key) {
        state.working = false;
    }
}

/// A host fault stops `key` with `queued` first in its queue.
async fn stop<F: Front>(
    shared: &Shared<F>,
    key: &F::Key,
    queued: &Queued<F::Extra>,
    fault: HostFault,
) {
    let sequence = queued.input.sequence;
    tracing::error!(key = %key, sequence, "a host fault stops the key until the host recovers \
        (the input is not finished, and runs again then): {fault}");
    let head = Head::Stopped {
        sequence,
        fault: fault.to_string(),
    };
    set_head(shared, key, head, true);
    shared.front.stopped(key, queued, &fault).await;
}
