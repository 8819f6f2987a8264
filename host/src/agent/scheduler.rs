//! Running many inputs: one input per key in flight, many keys at once.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use futures_util::{Stream, StreamExt as _};
use tokio::sync::{Semaphore, mpsc};

use super::input::{InputLine, LineError};
use super::output::OutputSink;
use super::task::AbortOnDrop;
use super::{Agent, InputError, InputReport, Memory, StateConfig};
use crate::checkpoint::{Checkpoint, CheckpointId, CheckpointStore, KeyProgress, PendingInput};
use crate::crash::{self, CrashPoint};
use crate::durable::{CallStats, CallsByFunction};
use crate::event::Input;
use crate::log::Log;

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
    /// Inputs that ran and did not complete, with why.
    pub failed: Vec<InputError>,
    /// Per key with a failed input: its later inputs, which were not run.
    pub blocked: BTreeMap<String, BlockedInputs>,
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
    pub elapsed: Duration,
}

/// The inputs of one key that wait behind its input that failed: not run, still pending,
/// so a run from the checkpoint runs the failed one and then them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockedInputs {
    /// The sequence of the input that failed.
    pub behind: u64,
    /// How many inputs wait, and the first and last of their sequences.
    pub inputs: u64,
    pub first: u64,
    pub last: u64,
}

impl Summary {
    /// Inputs not run because an earlier input of their key failed.
    pub fn blocked_inputs(&self) -> u64 {
        self.blocked.values().map(|b| b.inputs).sum()
    }

    /// Whether every input accepted completed and every line was an input.
    pub fn all_completed(&self) -> bool {
        self.failed.is_empty() && self.blocked.is_empty() && self.malformed.is_empty()
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

/// The log under the agent's store: its records below the oldest checkpoint's marker.
#[async_trait]
impl Retention for Arc<dyn Log> {
    async fn retain(&self, oldest: &Checkpoint) {
        for (partition, &offset) in (0..self.partitions()).zip(&oldest.marker.offsets) {
            if let Err(e) = self.delete_below(partition, offset).await {
                tracing::warn!(partition, "retention: {e}");
            }
        }
    }
}

/// How [`run_inputs`] runs.
#[derive(Clone, Copy, Debug, Default)]
pub struct RunOptions<'a> {
    pub checkpointing: Option<&'a Checkpointing>,
    /// Where to resume: the checkpoint recovery started from.
    pub resume: Option<&'a Checkpoint>,
}

/// Accepted inputs and each key's progress, for checkpoints.
#[derive(Debug, Default)]
struct Tracker {
    /// Line number of the last line consumed.
    position: u64,
    /// Per key: the next sequence and the last completed one.
    keys: HashMap<String, (u64, u64)>,
    /// Accepted and not complete, by (key, sequence).
    pending: BTreeMap<(String, u64), PendingInput>,
    /// Of `pending`, those that failed or wait behind one that failed: they hold no worker
    /// and are not run again in this run, so they do not count against intake.
    stalled: usize,
}

impl Tracker {
    /// Accepted inputs that are queued or running.
    fn in_flight(&self) -> usize {
        self.pending.len() - self.stalled
    }
}

/// Checkpoints failing in a row that stop a run (see `Run::checkpoint`).
pub const FAILED_CHECKPOINTS_TO_STOP: u32 = 5;

/// Inputs queued or running at once, per unit of parallelism; intake waits beyond this.
/// Inputs that failed, or wait behind one that did, do not count: a failed key must not
/// stop the others.
const IN_FLIGHT_PER_KEY_SLOT: usize = 64;

/// Processes `lines` through `agent`, writing outputs to `sink` as inputs complete.
///
/// `lines` may be a file read to its end or a stream that waits for more: outputs are
/// written as inputs complete and checkpoints taken on time also while it waits. A line's
/// number is its input position (for a stream, its sequence); lines at or before the
/// resumed checkpoint's position are skipped. When `lines` ends, every accepted input is
/// finished and a last checkpoint taken.
///
/// Inputs of one key run one at a time in file order, and the n-th input of a key gets
/// sequence n; up to the agent's `parallelism` keys run at once. When an input fails, the
/// later inputs of its key are not run (they are counted in [`Summary::blocked`]), so that
/// no input runs on top of a key whose earlier input did not complete; every other key goes
/// on, and `lines` is read to its end. Failed and blocked inputs stay pending: a run that
/// resumes from a checkpoint runs them again, in order.
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
    let (done_tx, done_rx) = mpsc::unbounded_channel::<(Input, InputReport)>();
    let mut run = Run {
        agent: Arc::clone(&agent),
        permits: Arc::new(Semaphore::new(agent.parallelism())),
        done_tx: Some(done_tx),
        done_rx,
        workers: HashMap::new(),
        memory: HashMap::new(),
        worker_tasks: Vec::new(),
        tracker: Tracker::default(),
        summary: Summary::default(),
        sink,
        progress,
        checkpointing: options.checkpointing,
        next_checkpoint: options.resume.map_or(1, |c| c.id + 1),
        since_checkpoint: (0, Instant::now()),
        changed: false,
        failed_checkpoints: 0,
    };
    if let Some(checkpoint) = options.resume {
        run.restore(checkpoint);
    }
    let skip_to = run.tracker.position;
    let max_in_flight = agent.parallelism() * IN_FLIGHT_PER_KEY_SLOT;
    let mut lines = lines;
    loop {
        let intake = run.tracker.in_flight() < max_in_flight;
        let due = run.checkpoint_time();
        let next = tokio::select! {
            biased;
            Some((input, report)) = run.done_rx.recv() => {
                run.record(&input, report).await?;
                continue;
            }
            () = tokio::time::sleep_until(due.unwrap_or_else(far_future).into()), if due.is_some() => {
                run.checkpoint().await?;
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

struct Run<'a, S: OutputSink> {
    agent: Arc<Agent>,
    permits: Arc<Semaphore>,
    done_tx: Option<mpsc::UnboundedSender<(Input, InputReport)>>,
    done_rx: mpsc::UnboundedReceiver<(Input, InputReport)>,
    workers: HashMap<String, mpsc::UnboundedSender<Input>>,
    /// Each key's memory as its last completed input left it: what a checkpoint records,
    /// and what a key's worker starts from.
    memory: HashMap<String, Memory>,
    /// The key workers' tasks: aborted if the run is dropped before it finishes.
    worker_tasks: Vec<AbortOnDrop<()>>,
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
}

impl<S: OutputSink> Run<'_, S> {
    /// Restores keys, memory and position from `checkpoint` and queues its pending inputs.
    fn restore(&mut self, checkpoint: &Checkpoint) {
        self.tracker.position = checkpoint.input_position;
        for (key, progress) in &checkpoint.keys {
            self.tracker.keys.insert(
                key.clone(),
                (progress.next_sequence, progress.last_completed),
            );
            self.memory
                .insert(key.clone(), Arc::new(progress.memory.clone()));
        }
        let mut pending = checkpoint.pending.clone();
        pending.sort_by(|a, b| (&a.key, a.sequence).cmp(&(&b.key, b.sequence)));
        for input in pending {
            self.summary.inputs += 1;
            self.progress.accepted();
            self.dispatch(Input {
                key: input.key,
                sequence: input.sequence,
                payload: input.payload,
            });
        }
    }

    /// Gives `line` its key's next sequence and queues it.
    fn accept(&mut self, line: InputLine) {
        self.summary.inputs += 1;
        self.progress.accepted();
        self.tracker.position = line.line as u64;
        self.changed = true;
        let (next, _) = self.tracker.keys.entry(line.key.clone()).or_insert((1, 0));
        let sequence = *next;
        *next += 1;
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
            },
        );
        let Some(done) = self.done_tx.clone() else {
            return;
        };
        let queue = self.workers.entry(input.key.clone()).or_insert_with(|| {
            let (tx, rx) = mpsc::unbounded_channel();
            let memory = self.memory.get(&input.key).cloned().unwrap_or_default();
            self.worker_tasks.push(AbortOnDrop(tokio::spawn(key_worker(
                Arc::clone(&self.agent),
                memory,
                rx,
                Arc::clone(&self.permits),
                done,
            ))));
            tx
        });
        if let Err(mpsc::error::SendError(input)) = queue.send(input) {
            // The worker is gone; only a bug gets here, and the input is still counted.
            let report = InputReport {
                error: Some(InputError::Panicked {
                    key: input.key.clone(),
                    sequence: input.sequence,
                    message: "the key's worker stopped".to_owned(),
                }),
                ..InputReport::default()
            };
            if let Some(done) = &self.done_tx {
                let _ = done.send((input, report));
            }
        }
    }

    /// Waits for every accepted input, checkpointing on time meanwhile, then takes the
    /// final checkpoint.
    async fn finish(&mut self) -> std::io::Result<()> {
        self.workers.clear();
        self.done_tx = None;
        loop {
            let due = self.checkpoint_time();
            let next = tokio::select! {
                next = self.done_rx.recv() => next,
                () = tokio::time::sleep_until(due.unwrap_or_else(far_future).into()), if due.is_some() => {
                    self.checkpoint().await?;
                    continue;
                }
            };
            let Some((input, report)) = next else { break };
            self.record(&input, report).await?;
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
                Err(std::io::Error::other(format!(
                    "{FAILED_CHECKPOINTS_TO_STOP} checkpoints in a row failed, the last \
                     ({id}) with: {error}; stopping, since without checkpoints nothing is \
                     pruned and the logs only grow (the previous checkpoint stays valid)"
                )))
            }
        }
    }

    /// The cut and the save of checkpoint `self.next_checkpoint`.
    async fn try_checkpoint(
        &mut self,
        checkpointing: &Checkpointing,
    ) -> Result<Checkpoint, String> {
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
        let output_position =
            output_position.map_err(|e| format!("the outputs are not durable: {e}"))?;
        let marker = self
            .agent
            .store()
            .marker()
            .await
            .map_err(|e| e.to_string())?;
        let checkpoint = Checkpoint {
            id,
            input_position: self.tracker.position,
            keys,
            pending,
            marker,
            output_position,
        };
        checkpointing
            .store
            .save(&checkpoint, checkpointing.keep)
            .await
            .map_err(|e| e.to_string())?;
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

async fn key_worker(
    agent: Arc<Agent>,
    mut memory: Memory,
    mut queue: mpsc::UnboundedReceiver<Input>,
    permits: Arc<Semaphore>,
    done: mpsc::UnboundedSender<(Input, InputReport)>,
) {
    let mut failed = None;
    while let Some(input) = queue.recv().await {
        let report = match failed {
            Some(failed) => InputReport {
                error: Some(InputError::Blocked {
                    key: input.key.clone(),
                    sequence: input.sequence,
                    failed,
                }),
                ..InputReport::default()
            },
            None => {
                let Ok(permit) = permits.acquire().await else {
                    return;
                };
                let report = agent.process_isolated(&input, &memory).await;
                drop(permit);
                memory = Arc::clone(&report.memory);
                report
            }
        };
        if report.error.is_some() && failed.is_none() {
            failed = Some(input.sequence);
        }
        if done.send((input, report)).is_err() {
            return;
        }
    }
}

impl<S: OutputSink> Run<'_, S> {
    async fn record(&mut self, input: &Input, report: InputReport) -> std::io::Result<()> {
        self.changed = true;
        let summary = &mut self.summary;
        // Only a completed input's outputs: a failed one stays pending, and when it runs
        // again its completed actions are re-applied and give the same outputs then. (Written
        // now, they would be past the next checkpoint's output position, where a sink that
        // resumes from it could not know them, and written twice.)
        let outputs = if report.error.is_none() {
            &report.outputs[..]
        } else {
            &[]
        };
        for output in outputs {
            if self.sink.write(output).await? {
                summary.outputs += 1;
            } else {
                summary.duplicates += 1;
            }
        }
        summary.runs += report.runs;
        summary.reapplied += report.reapplied;
        summary.calls += report.calls;
        summary.calls_by_function += &report.calls_by_function;
        summary.unhandled += report.unhandled;
        let completed = report.error.is_none();
        match report.error {
            Some(InputError::Blocked {
                key,
                sequence,
                failed,
            }) => {
                // Stays pending, behind the input that failed: one line for the key in the
                // summary, not one per input.
                self.tracker.stalled += 1;
                summary
                    .blocked
                    .entry(key)
                    .and_modify(|b| {
                        b.inputs += 1;
                        b.first = b.first.min(sequence);
                        b.last = b.last.max(sequence);
                    })
                    .or_insert(BlockedInputs {
                        behind: failed,
                        inputs: 1,
                        first: sequence,
                        last: sequence,
                    });
            }
            None => {
                summary.completed += 1;
                self.memory.insert(input.key.clone(), report.memory);
                // Inputs of a key complete in order, so this is the key's last completed.
                self.tracker
                    .pending
                    .remove(&(input.key.clone(), input.sequence));
                if let Some((_, last)) = self.tracker.keys.get_mut(&input.key) {
                    *last = (*last).max(input.sequence);
                }
            }
            Some(error) => {
                // It stays pending: a recovery runs it again.
                self.tracker.stalled += 1;
                tracing::error!(key = %input.key, sequence = input.sequence, "input failed: {error}");
                summary.failed.push(error);
            }
        }
        self.progress.finished(input, completed);
        Ok(())
    }
}
