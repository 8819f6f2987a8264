//! The front end of `rewind run` and `rewind cluster`: inputs from a stream of lines,
//! outputs to a sink, progress saved in checkpoints.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use futures_util::{Stream, StreamExt as _};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};

use super::{
    BoxError, Cancelling, CommandError, Ended, Ending, Front, Head, HostFault, Keys, Next, Queued,
    Refusal,
};
use crate::agent::input::{InputLine, LineError};
use crate::agent::output::OutputSink;
use crate::agent::{Agent, InputError, InputReport, Memory, SignalIn, StateConfig, Waiting};
use crate::checkpoint::{
    Checkpoint, CheckpointError, CheckpointId, CheckpointStore, KeyProgress, ParkedInput,
    PendingInput, SkippedInput,
};
use crate::commands::{CallAnswer, Command, CommandQueue, Outcome, Verb};
use crate::crash::{self, CrashPoint};
use crate::durable::{self, Answer, CallStats, CallsByFunction};
use crate::event::{Deltas, Input};
use crate::store::{ActionStateStore, LogStore, StoreError};
use crate::text;

/// Told as inputs are accepted and finished (a progress bar, for instance).
pub trait Progress: Sync {
    fn accepted(&self) {}
    /// `input` is done: completed, or failed (`completed` is false).
    fn finished(&self, _input: &Input, _completed: bool) {}
}

impl Progress for () {}

/// What a run over an input file did.
#[derive(Debug, Default)]
pub struct Summary {
    /// Inputs accepted (valid lines).
    pub inputs: u64,
    /// Lines that were not valid inputs, with why.
    pub malformed: Vec<LineError>,
    pub completed: u64,
    /// Failed attempts that were retried.
    pub retries: u64,
    /// Inputs parked after their last attempt failed and still parked at the end (not
    /// retried or skipped by an operator meanwhile), each with its last error.
    pub parked: Vec<InputError>,
    /// Per key with a parked or stopped input: its later inputs, which wait behind it.
    pub waiting: BTreeMap<String, WaitingInputs>,
    /// Inputs whose key a host fault stopped (the state log failed a write, the host
    /// panicked), each with the fault: not finished, run again by the next run.
    pub stopped: Vec<(String, u64, String)>,
    /// Outputs written.
    pub outputs: u64,
    /// Outputs dropped because their id had been written already.
    pub duplicates: u64,
    /// Action runs.
    pub runs: u64,
    /// Completed actions re-applied from their records instead of run.
    pub reapplied: u64,
    pub calls: CallStats,
    pub calls_by_function: CallsByFunction,
    /// Events of a kind no action handles, dropped (`unhandled-events = "drop"`).
    pub unhandled: u64,
    /// Operator commands carried out or refused, in the order they ended.
    pub commands: Vec<(Command, Outcome)>,
    /// Inputs an operator skipped or cancelled during the run.
    pub ended: Vec<(String, u64, Ended)>,
    /// Inputs stopped at a durable wait at the end (key, sequence, the wait): pending, run
    /// again by a later run once their time comes or a signal they wait for is delivered.
    pub waits: Vec<(String, u64, Waiting)>,
    /// The line after which the run stopped reading, holding as many inputs at a wait as it
    /// may and nothing else to run; the next run goes on from the next.
    pub held_at: Option<u64>,
    pub elapsed: Duration,
}

/// The inputs of one key that wait behind its parked (or stopped) input: not run, still
/// pending, so a run from the checkpoint runs that one and then them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WaitingInputs {
    /// The sequence of the input they wait behind.
    pub behind: u64,
    /// How many inputs wait, and the first and last of their sequences.
    pub inputs: u64,
    pub first: u64,
    pub last: u64,
}

impl Summary {
    /// Inputs not run because an earlier input of their key is parked or stopped.
    pub fn waiting_inputs(&self) -> u64 {
        self.waiting.values().map(|b| b.inputs).sum()
    }

    /// Whether the inputs not completed are all at a durable wait (or behind one), and
    /// every line was an input.
    pub fn only_waits(&self) -> bool {
        !self.waits.is_empty()
            && self.parked.is_empty()
            && self.stopped.is_empty()
            && self.malformed.is_empty()
            && self
                .waiting
                .keys()
                .all(|key| self.waits.iter().any(|(k, _, _)| k == key))
    }

    /// Whether every input accepted completed and every line was an input.
    pub fn all_completed(&self) -> bool {
        self.held_at.is_none()
            && self.parked.is_empty()
            && self.waits.is_empty()
            && self.stopped.is_empty()
            && self.waiting.is_empty()
            && self.malformed.is_empty()
    }
}

/// How a run takes checkpoints (docs/SEMANTICS.md, "Checkpoints and recovery").
#[derive(Clone, Debug)]
pub struct Checkpointing {
    pub store: Arc<dyn CheckpointStore>,
    /// Take one after this many accepted inputs.
    pub every_inputs: Option<u64>,
    /// Take one when this much time has passed since the last.
    pub every: Option<Duration>,
    /// Checkpoints kept.
    pub keep: usize,
    /// What each checkpoint lets go of: the log under the agent's store, the inputs read.
    pub retention: Vec<Arc<dyn Retention>>,
}

impl Checkpointing {
    /// Checkpoints saved to `store` as an agent's `[state]` says (how often, how many
    /// kept), letting go of what `retention` names.
    pub fn new(
        store: Arc<dyn CheckpointStore>,
        state: &StateConfig,
        retention: Vec<Arc<dyn Retention>>,
    ) -> Self {
        Self {
            store,
            every_inputs: Some(state.checkpoint_every_inputs),
            every: Some(Duration::from_millis(state.checkpoint_every_ms)),
            keep: state.keep_checkpoints,
            retention,
        }
    }
}

/// Data that checkpoints make unneeded: once a checkpoint is saved, what the oldest one
/// kept no longer needs is deleted.
#[async_trait]
pub trait Retention: Send + Sync + std::fmt::Debug {
    /// Deletes what `oldest`, the oldest checkpoint kept, no longer needs. Best effort: a
    /// failure is logged, and the next checkpoint tries again.
    async fn retain(&self, oldest: &Checkpoint);
}

/// The logs under the agent's store (its log and its shelf): their records below the
/// oldest checkpoint's marker.
#[async_trait]
impl Retention for LogStore {
    async fn retain(&self, oldest: &Checkpoint) {
        if let Err(e) = ActionStateStore::retain(self, &oldest.marker).await {
            tracing::warn!("retention: {e}");
        }
    }
}

/// How [`run_inputs`] runs.
#[derive(Clone, Copy, Debug, Default)]
pub struct RunOptions<'a> {
    pub checkpointing: Option<&'a Checkpointing>,
    /// Where to resume: the checkpoint recovery started from.
    pub resume: Option<&'a Checkpoint>,
    /// Where operators leave commands (retry or skip a parked input): those left before
    /// the run are carried out first, then every parked input still parked is retried, and
    /// while it runs, new ones are carried out within [`COMMAND_POLL`].
    pub commands: Option<&'a dyn CommandQueue>,
    /// Whether the run goes on until every input at a durable wait finished (its time
    /// comes, its signal is delivered), rather than ending once only they and parked
    /// inputs are left.
    pub until_waits_end: bool,
    /// Whether the run stops reading lines (and ends, its input position there) when it
    /// holds [`HELD_PER_KEY_SLOT`] × `parallelism` inputs at a wait and nothing else runs;
    /// otherwise (a stream) it waits for some to finish.
    pub end_when_held: bool,
    /// Where the pieces of streamed answers go as they come (`rewind run --follow`).
    pub deltas: Option<&'a Arc<dyn Deltas>>,
}

/// How often a run looks for operator commands.
pub const COMMAND_POLL: Duration = Duration::from_millis(250);

/// Who retries what a new run finds parked.
const RERUN: &str = "rewind run (a new run retries every parked input)";

/// Accepted inputs and each key's progress, for checkpoints.
#[derive(Debug, Default)]
struct Tracker {
    /// Line number of the last line consumed.
    position: u64,
    /// Per key: the next sequence and the last completed one.
    keys: HashMap<String, (u64, u64)>,
    /// Accepted and not complete, by (key, sequence).
    pending: BTreeMap<(String, u64), PendingInput>,
}

/// Checkpoints failing in a row that stop a run (see `Run::checkpoint`).
pub const FAILED_CHECKPOINTS_TO_STOP: u32 = 5;

/// Inputs queued or running at once, per unit of parallelism; intake waits beyond this.
/// Parked inputs, and those that wait behind one, do not count: a parked key must not stop
/// the others.
const IN_FLIGHT_PER_KEY_SLOT: usize = 64;

/// Inputs a run holds at a durable wait at once, per unit of parallelism (they do not count
/// against intake): past it, no line is read until some finish, so that a file of a million
/// waits is not read into memory.
pub const HELD_PER_KEY_SLOT: usize = 1024;

/// Processes `lines` through `agent`, writing outputs to `sink` as inputs complete.
///
/// `lines` may be a file read to its end or a stream that waits for more: outputs are
/// written as inputs complete and checkpoints taken on time also while it waits. A line's
/// number is its input position (for a stream, its sequence); lines at or before the
/// resumed checkpoint's position are skipped. When `lines` ends, every accepted input is
/// finished and a last checkpoint taken.
///
/// Inputs of one key run one at a time in file order, and the n-th input of a key gets
/// sequence n; up to the agent's `parallelism` keys run at once. An input whose run fails
/// is retried as the agent's `[retry]` says, then parked: the later inputs of its key are
/// not run (they are counted in [`Summary::waiting`]), so that no input runs on top of a
/// key whose earlier input did not complete; every other key goes on, and `lines` is read
/// to its end, and the run ends once only parked inputs and those behind them are left.
/// They stay pending: a run that resumes from a checkpoint runs them again, in order (an
/// operator's retry of every parked input). A host fault (the state log failed a write)
/// stops the input's key the same way, counted in [`Summary::stopped`].
///
/// With `options.resume`, the checkpoint's keys and memory are restored, its pending inputs
/// run first, and `lines` resume after its input position. With `options.checkpointing`,
/// checkpoints are taken as it says and once more at the end; a checkpoint that fails is
/// logged as an error, and after [`FAILED_CHECKPOINTS_TO_STOP`] in a row the run returns
/// the last one's error.
pub async fn run_inputs<S: OutputSink>(
    agent: Arc<Agent>,
    lines: impl Stream<Item = Result<InputLine, LineError>> + Unpin,
    sink: &mut S,
    progress: &dyn Progress,
    options: RunOptions<'_>,
) -> std::io::Result<Summary> {
    let started = Instant::now();
    let (done, done_rx) = mpsc::unbounded_channel();
    // Runs away between a call's attempts keep their instances: at most as many as run,
    // and never more than the instance pool has room for beside those.
    let away = (agent.parallelism()).min(agent.instances().saturating_sub(agent.parallelism()));
    let front = StreamFront {
        agent: Arc::clone(&agent),
        permits: Arc::new(Semaphore::new(agent.parallelism())),
        away: Arc::new(Semaphore::new(away)),
        done,
        deltas: options.deltas.cloned(),
    };
    let mut run = Run {
        agent: Arc::clone(&agent),
        keys: Keys::with_clock(Arc::new(front), agent.clock()),
        done_rx,
        memory: HashMap::new(),
        tracker: Tracker::default(),
        summary: Summary::default(),
        sink,
        progress,
        checkpointing: options.checkpointing,
        next_checkpoint: options.resume.map_or(1, |c| c.id + 1),
        since_checkpoint: (0, Instant::now()),
        changed: false,
        failed_checkpoints: 0,
        commands: options.commands,
        poll: options.commands.map(|_| {
            let mut poll = tokio::time::interval(COMMAND_POLL);
            poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            poll
        }),
        taken: HashSet::new(),
        applied: Vec::new(),
        ending: HashMap::new(),
        checkpoint_now: false,
        skipped: Vec::new(),
        until_waits_end: options.until_waits_end,
    };
    if let Some(checkpoint) = options.resume {
        run.restore(checkpoint);
    }
    run.carry_out_commands().await?;
    run.retry_parked().await;
    let skip_to = run.tracker.position;
    let max_in_flight = agent.parallelism() * IN_FLIGHT_PER_KEY_SLOT;
    let max_held = agent.parallelism() * HELD_PER_KEY_SLOT;
    let mut lines = lines;
    loop {
        let standing = run.standing();
        let held = standing.core.waits >= max_held;
        let intake = standing.in_flight < max_in_flight && !held;
        // Everything held waits for something outside the run (an operator, a signal, a
        // time): a run that ends when only such inputs are left stops reading here, and the
        // next one goes on from this line.
        if held
            && standing.in_flight == 0
            && options.end_when_held
            && standing.core.stalls_heard
            && !standing.core.waits_due
        {
            run.summary.held_at = Some(run.tracker.position);
            tracing::warn!(
                held = max_held,
                line = run.tracker.position,
                "stopped reading input: the run holds as many inputs at a wait as it may"
            );
            break;
        }
        let due = run.checkpoint_time();
        let next = tokio::select! {
            biased;
            Some(done) = run.done_rx.recv() => {
                run.record(done).await?;
                continue;
            }
            () = tokio::time::sleep_until(due.unwrap_or_else(far_future).into()), if due.is_some() => {
                run.checkpoint().await?;
                continue;
            }
            () = tick(&mut run.poll) => {
                run.carry_out_commands().await?;
                continue;
            }
            next = lines.next(), if intake => next,
        };
        let line = match next {
            None => break,
            Some(Ok(line)) if (line.line as u64) <= skip_to => continue,
            Some(Err(error)) if (error.line as u64) <= skip_to => continue,
            Some(Ok(line)) => line,
            Some(Err(error)) => {
                tracing::warn!("skipping input {error}");
                run.summary.malformed.push(error);
                continue;
            }
        };
        run.accept(line);
        if run.checkpoint_due() {
            run.checkpoint().await?;
        }
    }
    run.finish().await?;
    run.summary.elapsed = started.elapsed();
    Ok(run.summary)
}

fn far_future() -> Instant {
    Instant::now() + Duration::from_secs(86_400)
}

/// The next tick of `poll`; never without one.
async fn tick(poll: &mut Option<tokio::time::Interval>) {
    match poll {
        Some(poll) => {
            poll.tick().await;
        }
        None => std::future::pending().await,
    }
}

/// Why a checkpoint was not taken (the previous one stays valid).
#[derive(Debug, thiserror::Error)]
pub enum CheckpointFailed {
    #[error("the outputs are not durable: {0}")]
    Outputs(#[source] std::io::Error),
    #[error("the store gave no marker: {0}")]
    Marker(#[source] StoreError),
    #[error("{0}")]
    Save(#[source] CheckpointError),
}

/// The error a run stops with after [`FAILED_CHECKPOINTS_TO_STOP`] failed checkpoints in a
/// row (inside the `std::io::Error` it returns).
#[derive(Debug, thiserror::Error)]
#[error(
    "{FAILED_CHECKPOINTS_TO_STOP} checkpoints in a row failed, the last ({id}) with: {last}; \
     stopping, since without checkpoints nothing is pruned and the logs only grow (the \
     previous checkpoint stays valid)"
)]
pub struct CheckpointsFailing {
    pub id: CheckpointId,
    #[source]
    pub last: CheckpointFailed,
}

/// What the keys report to the run, in the order it happened per key.
enum Done {
    Completed(Input, InputReport),
    Failed(Input, InputReport, InputError, Next),
    Stopped(Input, String),
    /// It stopped at a durable wait (what its run did in the report), or (`None`) runs
    /// again past one.
    Waiting(Input, Option<Waiting>, InputReport),
    /// An operator skipped or cancelled it.
    Ended {
        input: Input,
        ended: Ended,
        by: String,
        why: String,
    },
}

/// The run's side of the core: a slot is one of `parallelism` permits; what the keys report
/// goes to the run's loop, which writes outputs and takes checkpoints.
struct StreamFront {
    agent: Arc<Agent>,
    permits: Arc<Semaphore>,
    done: mpsc::UnboundedSender<Done>,
    deltas: Option<Arc<dyn Deltas>>,
    /// Leaves for runs away between a call's attempts ([`Front::leave`]).
    away: Arc<Semaphore>,
}

#[async_trait]
impl Front for StreamFront {
    type Key = String;
    type Extra = ();
    type Slot = OwnedSemaphorePermit;

    async fn slot(&self, _: &String) -> Option<OwnedSemaphorePermit> {
        Arc::clone(&self.permits).acquire_owned().await.ok()
    }

    fn deltas(&self) -> Option<Arc<dyn Deltas>> {
        self.deltas.clone()
    }

    fn leave(&self) -> Option<Box<dyn Send>> {
        let leave = Arc::clone(&self.away).try_acquire_owned().ok()?;
        Some(Box::new(leave))
    }

    async fn agent(&self, _: &String, _: &Queued<()>) -> Result<Arc<Agent>, HostFault> {
        Ok(Arc::clone(&self.agent))
    }

    async fn completed(
        &self,
        _: &String,
        queued: &Queued<()>,
        report: InputReport,
    ) -> Result<(), Refusal> {
        // The run's loop is gone only when the run was dropped: nothing is recorded then.
        let _ = self
            .done
            .send(Done::Completed(queued.input.clone(), report));
        Ok(())
    }

    async fn failed(
        &self,
        _: &String,
        queued: &Queued<()>,
        report: InputReport,
        error: InputError,
        next: Next,
    ) {
        let _ = self
            .done
            .send(Done::Failed(queued.input.clone(), report, error, next));
    }

    async fn stopped(&self, _: &String, queued: &Queued<()>, fault: &HostFault) {
        let _ = self
            .done
            .send(Done::Stopped(queued.input.clone(), fault.to_string()));
    }

    /// The run's loop records it in a checkpoint taken at once, before it says the
    /// command that asked is done: a crash before that leaves the input pending (parked, if
    /// it was) and the command too, carried out again by the next run.
    async fn ended(
        &self,
        _: &String,
        queued: &Queued<()>,
        _: &Memory,
        ending: Ending<'_>,
    ) -> Result<(), HostFault> {
        let _ = self.done.send(Done::Ended {
            input: queued.input.clone(),
            ended: ending.ended,
            by: ending.by.to_owned(),
            why: ending.why.to_owned(),
        });
        Ok(())
    }

    /// The run's loop keeps it for the next checkpoint: a run from it arms the wait again.
    async fn waiting(
        &self,
        _: &String,
        queued: &Queued<()>,
        wait: Option<&Waiting>,
        report: InputReport,
    ) {
        let input = queued.input.clone();
        let _ = self.done.send(Done::Waiting(input, wait.cloned(), report));
    }

    /// Nothing to record: a run started on the state retries every parked input anyway.
    async fn retried(&self, _: &String, _: &Queued<()>, _: &str) -> Result<(), HostFault> {
        Ok(())
    }
}

/// Where a run's inputs stand at one moment: the core's reading, and the accepted inputs
/// that are queued, running or retrying (not stalled, nor queued behind a stalled one).
struct Standing {
    core: super::Standing,
    in_flight: usize,
}

struct Run<'a, S: OutputSink> {
    agent: Arc<Agent>,
    /// Every key's inputs: dropping them stops the keys' workers.
    keys: Keys<StreamFront>,
    done_rx: mpsc::UnboundedReceiver<Done>,
    /// Each key's memory as its last completed input left it: what a checkpoint records.
    memory: HashMap<String, Memory>,
    tracker: Tracker,
    summary: Summary,
    sink: &'a mut S,
    progress: &'a dyn Progress,
    checkpointing: Option<&'a Checkpointing>,
    next_checkpoint: CheckpointId,
    /// Inputs accepted and when, since the last checkpoint.
    since_checkpoint: (u64, Instant),
    /// Whether an input was accepted or finished since the last checkpoint: an idle run
    /// takes no checkpoints on time.
    changed: bool,
    /// Checkpoints that failed since the last one saved.
    failed_checkpoints: u32,
    commands: Option<&'a dyn CommandQueue>,
    /// When to look for commands again (with `commands`).
    poll: Option<tokio::time::Interval>,
    /// Ids of the commands taken by this run: each is carried out once.
    taken: HashSet<String>,
    /// Commands carried out whose effect the next checkpoint records; done once it is saved.
    applied: Vec<(Command, Outcome)>,
    /// Skips and cancels carried out, by the input they end, until it is ended.
    ending: HashMap<(String, u64), Vec<Command>>,
    /// An operator's command ended an input: checkpoint at once.
    checkpoint_now: bool,
    /// Every input an operator skipped or cancelled, as checkpoints keep them.
    skipped: Vec<SkippedInput>,
    /// Go on until inputs at a durable wait finish (`RunOptions::until_waits_end`).
    until_waits_end: bool,
}

impl<S: OutputSink> Run<'_, S> {
    /// Where the run's inputs stand, read at one moment.
    fn standing(&self) -> Standing {
        let standing = self.keys.standing(|key, head| self.heard(key, head));
        Standing {
            in_flight: (self.tracker.pending.len()).saturating_sub(standing.stalled),
            core: standing,
        }
    }

    /// Whether this loop has heard of `key`'s stalled `head`: its park, its stop, or this
    /// very wait (not one the input has passed since).
    fn heard(&self, key: &String, head: &Head) -> bool {
        let pending = |sequence: &u64| self.tracker.pending.get(&(key.clone(), *sequence));
        match head {
            Head::Parked { sequence, .. } => {
                pending(sequence).is_some_and(|pending| pending.parked.is_some())
            }
            Head::Waiting { sequence, waiting } => {
                pending(sequence).is_some_and(|pending| pending.waiting.as_ref() == Some(waiting))
            }
            Head::Stopped { sequence, .. } => {
                (self.summary.stopped.iter()).any(|(k, s, _)| k == key && s == sequence)
            }
            Head::Idle | Head::Running { .. } | Head::Retrying { .. } => true,
        }
    }

    /// Restores keys, memory and position from `checkpoint` and queues its pending inputs.
    fn restore(&mut self, checkpoint: &Checkpoint) {
        self.tracker.position = checkpoint.input_position;
        for (key, progress) in &checkpoint.keys {
            self.tracker.keys.insert(
                key.clone(),
                (progress.next_sequence, progress.last_completed),
            );
            let memory = Arc::new(progress.memory.clone());
            self.keys
                .restore(key.clone(), progress.next_sequence, Arc::clone(&memory));
            self.memory.insert(key.clone(), memory);
        }
        self.skipped.clone_from(&checkpoint.skipped);
        let mut pending = checkpoint.pending.clone();
        pending.sort_by(|a, b| (&a.key, a.sequence).cmp(&(&b.key, b.sequence)));
        for pending in pending {
            self.summary.inputs += 1;
            self.progress.accepted();
            let input = Input {
                key: pending.key.clone(),
                sequence: pending.sequence,
                payload: pending.payload.clone(),
            };
            let key = pending.key.clone();
            let (parked, waiting) = (pending.parked.clone(), pending.waiting.clone());
            self.tracker
                .pending
                .insert((key.clone(), pending.sequence), pending);
            let queued = Queued { input, extra: () };
            match (parked, waiting) {
                (Some(parked), _) => {
                    self.keys
                        .restore_parked(key, queued, parked.attempts, parked.error);
                }
                // A signal it waits for came after the cut: it runs now.
                (None, Some(waiting))
                    if !self
                        .agent
                        .signal_came(&key, queued.input.sequence, &waiting) =>
                {
                    self.keys.restore_waiting(key, queued, waiting);
                }
                (None, _) => {
                    self.keys.push(key, queued);
                }
            }
        }
    }

    /// Carries out the operator commands left since it last looked, in order. A skip or a
    /// cancel is in a checkpoint, taken as soon as its input is ended, before its command
    /// is done.
    async fn carry_out_commands(&mut self) -> std::io::Result<()> {
        let Some(queue) = self.commands else {
            return Ok(());
        };
        let commands = match queue.pending().await {
            Ok(commands) => commands,
            Err(error) => {
                tracing::warn!("operator commands not read; looking again soon: {error}");
                return Ok(());
            }
        };
        for command in commands {
            if !self.taken.insert(command.id.clone()) {
                continue;
            }
            let Some(outcome) = self.carry_out(&command).await else {
                continue;
            };
            if let Outcome::Refused { error } = &outcome {
                tracing::warn!(key = %command.key, command = %command.id, by = %command.by,
                    verb = command.verb.name(), "operator command refused: {error}");
            }
            self.summary
                .commands
                .push((command.clone(), outcome.clone()));
            finish(queue, &command, &outcome).await;
        }
        // The inputs skipped or cancelled while parked are ended already: recorded now.
        while let Ok(done) = self.done_rx.try_recv() {
            self.record(done).await?;
        }
        Ok(())
    }

    /// Carries out `command`, and says what came of it; `None` when that comes once its
    /// input is ended (a skip or a cancel).
    async fn carry_out(&mut self, command: &Command) -> Option<Outcome> {
        let key = &command.key;
        let done = match &command.verb {
            Verb::Retry => {
                let retried = self.keys.retry(key, command.sequence, &command.by, |_| {});
                retried.await.map(|sequence| {
                    self.unpark(key, sequence);
                    Some(sequence)
                })
            }
            Verb::Resolve {
                call,
                action,
                answer,
            } => {
                let store = Arc::clone(self.agent.store());
                let scope = self.agent.scope(key);
                let answer = match answer {
                    CallAnswer::Result(json) => Answer::Result(json.clone()),
                    CallAnswer::Error(error) => Answer::Error(error.clone()),
                    CallAnswer::NotMade => Answer::NotMade,
                };
                let (call, action) = (*call, action.clone());
                let by = command.by.clone();
                let resolve = |queued: Queued<()>| async move {
                    let sequence = queued.input.sequence;
                    let action = action.as_deref();
                    durable::resolve(&*store, &scope, sequence, action, call, &answer, &by)
                        .await
                        .map(drop)
                        .map_err(BoxError::from)
                };
                let retried = self
                    .keys
                    .retry_after(key, command.sequence, &command.by, resolve);
                retried.await.map(|sequence| {
                    self.unpark(key, sequence);
                    Some(sequence)
                })
            }
            Verb::Signal {
                name,
                payload,
                signal_id: id,
            } => {
                let signal = SignalIn {
                    name: name.clone(),
                    payload: payload.clone(),
                    id: if id.is_empty() {
                        command.id.clone()
                    } else {
                        id.clone()
                    },
                };
                let delivered = self.keys.signal(key, command.sequence, &signal).await;
                delivered
                    .map(|delivered| Some(delivered.sequence))
                    .map_err(|error| CommandError::Refused {
                        error: Box::new(error),
                    })
            }
            Verb::Skip { reason } | Verb::Cancel { reason } => {
                // Ended already, by this command, in a run that stopped before it said so.
                if let Some(done) = self.skipped.iter().find(|s| s.by_command(&command.id)) {
                    return Some(Outcome::Applied {
                        sequence: done.sequence,
                    });
                }
                let (by, sequence) = (&command.by, command.sequence);
                let ended = if let Verb::Cancel { .. } = command.verb {
                    let cancelled = self.keys.cancel(key, sequence, by, reason).await;
                    cancelled.map(|(Cancelling::Ended(s) | Cancelling::Requested(s))| s)
                } else {
                    self.keys.skip(key, sequence, by, reason).await
                };
                // Done once the input is ended, and that is in a checkpoint.
                ended.map(|sequence| {
                    let ending = self.ending.entry((key.clone(), sequence)).or_default();
                    ending.push(command.clone());
                    None
                })
            }
        };
        match done {
            Ok(Some(sequence)) => Some(Outcome::Applied { sequence }),
            Ok(None) => None,
            Err(error) => Some(Outcome::Refused {
                error: error.to_string(),
            }),
        }
    }

    /// Retries every input still parked: a run started on a state is an operator's retry
    /// of them all.
    async fn retry_parked(&mut self) {
        for head in self
            .keys
            .heads(|_, head| matches!(head, Head::Parked { .. }))
        {
            let sequence = head.first.input.sequence;
            let retried = self.keys.retry(&head.key, Some(sequence), RERUN, |_| {});
            if retried.await.is_ok() {
                self.unpark(&head.key, sequence);
            }
        }
    }

    /// `key`'s input `sequence` runs again, or was skipped: no longer parked.
    fn unpark(&mut self, key: &str, sequence: u64) {
        if let Some(pending) = self.tracker.pending.get_mut(&(key.to_owned(), sequence)) {
            pending.parked = None;
            self.changed = true;
        }
        self.summary
            .parked
            .retain(|error| error.input() != (key, sequence));
    }

    /// Whether the run has more to wait for before it ends: an input queued or running, a
    /// stall the core decided that this loop has not heard of yet (the last checkpoint would
    /// miss it), a wait whose time has come (about to run again), or with `--wait` any wait.
    fn goes_on(&self) -> bool {
        let standing = self.standing();
        standing.in_flight > 0
            || !standing.core.stalls_heard
            || standing.core.waits_due
            || (self.until_waits_end && standing.core.waits > 0)
    }

    /// Gives `line` its key's next sequence and queues it.
    fn accept(&mut self, line: InputLine) {
        self.summary.inputs += 1;
        self.progress.accepted();
        self.tracker.position = line.line as u64;
        self.changed = true;
        let sequence = self.keys.take_sequence(&line.key);
        let (next, _) = self.tracker.keys.entry(line.key.clone()).or_insert((1, 0));
        *next = sequence + 1;
        self.since_checkpoint.0 += 1;
        self.dispatch(Input {
            key: line.key,
            sequence,
            payload: line.payload,
        });
    }

    fn dispatch(&mut self, input: Input) {
        self.tracker.pending.insert(
            (input.key.clone(), input.sequence),
            PendingInput {
                key: input.key.clone(),
                sequence: input.sequence,
                payload: input.payload.clone(),
                parked: None,
                waiting: None,
            },
        );
        self.keys
            .push(input.key.clone(), Queued { input, extra: () });
    }

    /// Waits for every accepted input to complete or stall (parked, stopped, or waiting
    /// behind one), checkpointing on time meanwhile, then takes the final checkpoint.
    async fn finish(&mut self) -> std::io::Result<()> {
        while self.goes_on() {
            let due = self.checkpoint_time();
            let next = tokio::select! {
                next = self.done_rx.recv() => next,
                () = tokio::time::sleep_until(due.unwrap_or_else(far_future).into()), if due.is_some() => {
                    self.checkpoint().await?;
                    continue;
                }
                () = tick(&mut self.poll) => {
                    self.carry_out_commands().await?;
                    continue;
                }
            };
            // The front holds a sender as long as the keys live.
            let Some(done) = next else { break };
            self.record(done).await?;
        }
        // As the last checkpoint has them.
        self.summary.waits = (self.tracker.pending.values())
            .filter_map(|pending| {
                let waiting = pending.waiting.clone()?;
                Some((pending.key.clone(), pending.sequence, waiting))
            })
            .collect();
        self.summary
            .waits
            .sort_by(|a, b| (&a.0, a.1).cmp(&(&b.0, b.1)));
        for stalled in self.keys.heads(|_, head| head.stalled()) {
            let behind = stalled.first.input.sequence;
            let (Some(&first), Some(&last)) = (stalled.waiting.first(), stalled.waiting.last())
            else {
                continue;
            };
            self.summary.waiting.insert(
                stalled.key,
                WaitingInputs {
                    behind,
                    inputs: stalled.waiting.len() as u64,
                    first,
                    last,
                },
            );
        }
        self.sink.sync().await?;
        if self.checkpointing.is_some() {
            self.checkpoint().await?;
        }
        Ok(())
    }

    /// When a checkpoint is due by time, if checkpoints are taken on time and there is
    /// something new to record.
    fn checkpoint_time(&self) -> Option<Instant> {
        if !self.changed {
            return None;
        }
        let every = self.checkpointing?.every?;
        Some(self.since_checkpoint.1 + every)
    }

    fn checkpoint_due(&self) -> bool {
        let Some(checkpointing) = self.checkpointing else {
            return false;
        };
        let (inputs, since) = self.since_checkpoint;
        checkpointing.every_inputs.is_some_and(|n| inputs >= n)
            || checkpointing
                .every
                .is_some_and(|every| since.elapsed() >= every)
    }

    /// Takes a checkpoint: the cut, the marker, the atomic save; then prunes and retains.
    /// A failure is logged as an error and changes nothing: the previous checkpoint stays
    /// valid. After [`FAILED_CHECKPOINTS_TO_STOP`] failures in a row the run stops with
    /// the last one's error: without checkpoints nothing is pruned or let go, and the logs
    /// under the agent would only grow.
    async fn checkpoint(&mut self) -> std::io::Result<()> {
        let Some(checkpointing) = self.checkpointing else {
            return Ok(());
        };
        let id = self.next_checkpoint;
        match self.try_checkpoint(checkpointing).await {
            Ok(checkpoint) => {
                self.failed_checkpoints = 0;
                self.checkpointed(checkpointing, &checkpoint).await;
                Ok(())
            }
            Err(error) => {
                self.failed_checkpoints += 1;
                tracing::error!(
                    checkpoint = id,
                    failed_in_a_row = self.failed_checkpoints,
                    "checkpoint failed; the previous one stays valid: {error}"
                );
                if self.failed_checkpoints < FAILED_CHECKPOINTS_TO_STOP {
                    return Ok(());
                }
                Err(std::io::Error::other(CheckpointsFailing {
                    id,
                    last: error,
                }))
            }
        }
    }

    /// The cut and the save of checkpoint `self.next_checkpoint`.
    async fn try_checkpoint(
        &mut self,
        checkpointing: &Checkpointing,
    ) -> Result<Checkpoint, CheckpointFailed> {
        self.since_checkpoint = (0, Instant::now());
        self.changed = false;
        // The cut: taken while intake waits (this task is the intake). In-flight inputs go
        // on meanwhile; a key's memory here is what its last completed input left, as its
        // counters are (both change only as an input is recorded).
        let keys: BTreeMap<String, KeyProgress> = self
            .tracker
            .keys
            .iter()
            .map(|(key, &(next_sequence, last_completed))| {
                let memory = self
                    .memory
                    .get(key)
                    .map(|memory| BTreeMap::clone(memory))
                    .unwrap_or_default();
                (
                    key.clone(),
                    KeyProgress {
                        next_sequence,
                        last_completed,
                        memory,
                    },
                )
            })
            .collect();
        let pending: Vec<PendingInput> = self.tracker.pending.values().cloned().collect();
        let id = self.next_checkpoint;
        // The checkpoint counts inputs as complete: their outputs must be durable first.
        let output_position = match self.sink.sync().await {
            Ok(()) => self.sink.position().await,
            Err(e) => Err(e),
        };
        let output_position = output_position.map_err(CheckpointFailed::Outputs)?;
        let marker = self
            .agent
            .store()
            .marker()
            .await
            .map_err(CheckpointFailed::Marker)?;
        let checkpoint = Checkpoint {
            id,
            input_position: self.tracker.position,
            keys,
            pending,
            marker,
            output_position,
            skipped: self.skipped.clone(),
        };
        checkpointing
            .store
            .save(&checkpoint, checkpointing.keep)
            .await
            .map_err(CheckpointFailed::Save)?;
        Ok(checkpoint)
    }

    /// After `checkpoint` was saved: prunes the states it counts complete, and lets go of
    /// what the oldest kept checkpoint no longer needs.
    async fn checkpointed(&mut self, checkpointing: &Checkpointing, checkpoint: &Checkpoint) {
        let id = checkpoint.id;
        crash::reached(CrashPoint::CheckpointSaved);
        self.next_checkpoint += 1;
        self.sink.checkpointed(&checkpoint.keys);
        tracing::debug!(
            checkpoint = id,
            pending = checkpoint.pending.len(),
            "checkpoint taken"
        );
        for (key, progress) in &checkpoint.keys {
            let scope = self.agent.scope(key);
            if let Err(e) = self
                .agent
                .store()
                .prune(&scope, progress.last_completed)
                .await
            {
                tracing::warn!(key = %key, "pruning after checkpoint {id}: {e}");
            }
        }
        if !checkpointing.retention.is_empty() {
            retain(checkpointing).await;
        }
        if let Some(queue) = self.commands {
            for (command, outcome) in std::mem::take(&mut self.applied) {
                finish(queue, &command, &outcome).await;
            }
        }
    }
}

/// Says what came of `command`. When that fails, the command stays pending: the next run
/// finds it carried out (a skip is in the checkpoint) or refuses it again.
async fn finish(queue: &dyn CommandQueue, command: &Command, outcome: &Outcome) {
    if let Err(error) = queue.finish(command, outcome).await {
        tracing::warn!(command = %command.id, "an operator command's outcome not recorded: {error}");
    }
}

/// Deletes what the oldest kept checkpoint no longer needs.
async fn retain(checkpointing: &Checkpointing) {
    let oldest = match checkpointing.store.oldest().await {
        Ok(Some(oldest)) => oldest,
        Ok(None) => return,
        Err(e) => {
            tracing::warn!("retention skipped: {e}");
            return;
        }
    };
    for retention in &checkpointing.retention {
        retention.retain(&oldest).await;
    }
}

impl<S: OutputSink> Run<'_, S> {
    async fn record(&mut self, done: Done) -> std::io::Result<()> {
        self.changed = true;
        let report = match done {
            Done::Completed(input, report) => {
                // Only a completed input's outputs: a failed one stays pending, and when it
                // runs again its completed actions are re-applied and give the same outputs
                // then. (Written now, they would be past the next checkpoint's output
                // position, where a sink that resumes from it could not know them, and
                // written twice.)
                for output in &report.outputs {
                    if self.sink.write(output).await? {
                        self.summary.outputs += 1;
                    } else {
                        self.summary.duplicates += 1;
                    }
                }
                self.summary.completed += 1;
                // Inputs of a key complete in order, so this is the key's last completed.
                self.tracker
                    .pending
                    .remove(&(input.key.clone(), input.sequence));
                if let Some((_, last)) = self.tracker.keys.get_mut(&input.key) {
                    *last = (*last).max(input.sequence);
                }
                self.memory
                    .insert(input.key.clone(), Arc::clone(&report.memory));
                self.progress.finished(&input, true);
                report
            }
            Done::Failed(input, report, error, next) => {
                // It stays pending: retried now, or (parked) by the next run.
                match next {
                    Next::Retry { .. } => self.summary.retries += 1,
                    Next::Parked { attempts } => {
                        let key = (input.key.clone(), input.sequence);
                        if let Some(pending) = self.tracker.pending.get_mut(&key) {
                            // Kept beside its key and sequence: without them again.
                            let error = error.to_string();
                            let prefix = format!("{} #{}: ", key.0, key.1);
                            let error = error.strip_prefix(&prefix).unwrap_or(&error);
                            pending.parked = Some(ParkedInput {
                                attempts,
                                error: text::outside_error(error),
                            });
                        }
                        self.summary.parked.push(error);
                        self.progress.finished(&input, false);
                    }
                }
                report
            }
            Done::Waiting(input, waiting, report) => {
                let key = (input.key.clone(), input.sequence);
                if let Some(pending) = self.tracker.pending.get_mut(&key) {
                    pending.waiting = waiting;
                }
                report
            }
            Done::Stopped(input, fault) => {
                self.progress.finished(&input, false);
                self.summary
                    .stopped
                    .push((input.key.clone(), input.sequence, fault));
                InputReport::default()
            }
            Done::Ended {
                input,
                ended,
                by,
                why,
            } => {
                self.ended(input, ended, by, why).await;
                InputReport::default()
            }
        };
        let summary = &mut self.summary;
        summary.runs += report.runs;
        summary.reapplied += report.reapplied;
        summary.calls += report.calls;
        summary.calls_by_function += &report.calls_by_function;
        summary.unhandled += report.unhandled;
        if std::mem::take(&mut self.checkpoint_now) {
            self.checkpoint().await?;
        }
        Ok(())
    }

    /// An operator skipped or cancelled `input`: it is finished, in the history, and the
    /// commands that asked are done once a checkpoint holds that (taken at once).
    async fn ended(&mut self, input: Input, ended: Ended, by: String, why: String) {
        let (key, sequence) = (input.key.clone(), input.sequence);
        let parked = self
            .tracker
            .pending
            .get(&(key.clone(), sequence))
            .is_some_and(|pending| pending.parked.is_some());
        if !parked {
            // A parked input was counted as finished when it parked.
            self.progress.finished(&input, false);
        }
        self.unpark(&key, sequence);
        self.tracker.pending.remove(&(key.clone(), sequence));
        if let Some((_, last)) = self.tracker.keys.get_mut(&key) {
            *last = (*last).max(sequence);
        }
        let commands = self
            .ending
            .remove(&(key.clone(), sequence))
            .unwrap_or_default();
        self.skipped.push(SkippedInput {
            key: key.clone(),
            sequence,
            ended,
            by,
            reason: why,
            command: commands.first().map(|c| c.id.clone()).unwrap_or_default(),
            also: commands.iter().skip(1).map(|c| c.id.clone()).collect(),
        });
        self.summary.ended.push((key, sequence, ended));
        let outcome = Outcome::Applied { sequence };
        for command in commands {
            self.summary
                .commands
                .push((command.clone(), outcome.clone()));
            match self.commands {
                Some(_) if self.checkpointing.is_some() => {
                    self.applied.push((command, outcome.clone()));
                    self.checkpoint_now = true;
                }
                Some(queue) => finish(queue, &command, &outcome).await,
                None => {}
            }
        }
    }
}
