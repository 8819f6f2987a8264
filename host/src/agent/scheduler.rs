//! Running many inputs: one input per key in flight, many keys at once.

use std::collections::HashMap;
use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{Semaphore, mpsc};

use super::input::{InputLine, LineError};
use super::output::JsonlSink;
use super::{Agent, InputError, InputReport};
use crate::durable::CallStats;
use crate::event::Input;

/// Told as inputs are accepted and finished (a progress bar, for instance).
pub trait Progress {
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
    /// Inputs that did not complete, with why.
    pub failed: Vec<InputError>,
    /// Outputs written.
    pub outputs: u64,
    /// Outputs dropped because their id had been written already.
    pub duplicates: u64,
    /// Action runs.
    pub runs: u64,
    /// Completed actions re-applied from their records instead of run.
    pub reapplied: u64,
    pub calls: CallStats,
    pub elapsed: Duration,
}

/// Processes `lines` through `agent`, writing outputs to `sink` as inputs complete.
///
/// Inputs of one key run one at a time in file order, and the n-th input of a key gets
/// sequence n; up to the agent's `parallelism` keys run at once. When an input fails, the
/// later inputs of its key are not run (they are reported as [`InputError::Blocked`]), so
/// that no input runs on top of a key whose earlier input did not complete.
pub async fn run_inputs<W: Write>(
    agent: Arc<Agent>,
    lines: impl Iterator<Item = Result<InputLine, LineError>>,
    sink: &mut JsonlSink<W>,
    progress: &dyn Progress,
) -> std::io::Result<Summary> {
    let started = Instant::now();
    let mut summary = Summary::default();
    let permits = Arc::new(Semaphore::new(agent.parallelism()));
    let (done_tx, mut done_rx) = mpsc::unbounded_channel::<(Input, InputReport)>();
    let mut keys: HashMap<String, (u64, mpsc::UnboundedSender<Input>)> = HashMap::new();

    for line in lines {
        let line = match line {
            Ok(line) => line,
            Err(error) => {
                tracing::warn!("skipping input {error}");
                summary.malformed.push(error);
                continue;
            }
        };
        summary.inputs += 1;
        progress.accepted();
        let (last, queue) = keys.entry(line.key.clone()).or_insert_with(|| {
            let (tx, rx) = mpsc::unbounded_channel();
            tokio::spawn(key_worker(
                Arc::clone(&agent),
                rx,
                Arc::clone(&permits),
                done_tx.clone(),
            ));
            (0, tx)
        });
        *last += 1;
        let input = Input {
            key: line.key,
            sequence: *last,
            payload: line.payload,
        };
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
            record(&mut summary, sink, &input, report, progress)?;
        }
        while let Ok((input, report)) = done_rx.try_recv() {
            record(&mut summary, sink, &input, report, progress)?;
        }
    }
    drop(keys);
    drop(done_tx);
    while let Some((input, report)) = done_rx.recv().await {
        record(&mut summary, sink, &input, report, progress)?;
    }
    sink.flush()?;
    summary.elapsed = started.elapsed();
    Ok(summary)
}

async fn key_worker(
    agent: Arc<Agent>,
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
                let report = process_catching_panics(&agent, &input).await;
                drop(permit);
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

/// Processes `input` in its own task, so that a panic fails this input and not the run.
async fn process_catching_panics(agent: &Arc<Agent>, input: &Input) -> InputReport {
    let task = tokio::spawn({
        let agent = Arc::clone(agent);
        let input = input.clone();
        async move { agent.process(&input).await }
    });
    match task.await {
        Ok(report) => report,
        Err(error) => {
            let message = match error.try_into_panic() {
                Ok(panic) => panic
                    .downcast_ref::<&str>()
                    .map(|s| (*s).to_owned())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "a panic without a message".to_owned()),
                Err(error) => error.to_string(),
            };
            InputReport {
                error: Some(InputError::Panicked {
                    key: input.key.clone(),
                    sequence: input.sequence,
                    message,
                }),
                ..InputReport::default()
            }
        }
    }
}

fn record<W: Write>(
    summary: &mut Summary,
    sink: &mut JsonlSink<W>,
    input: &Input,
    report: InputReport,
    progress: &dyn Progress,
) -> std::io::Result<()> {
    for output in &report.outputs {
        if sink.write(output)? {
            summary.outputs += 1;
        } else {
            summary.duplicates += 1;
        }
    }
    summary.runs += report.runs;
    summary.reapplied += report.reapplied;
    summary.calls += report.calls;
    let completed = report.error.is_none();
    match report.error {
        None => summary.completed += 1,
        Some(error) => {
            tracing::error!(key = %input.key, sequence = input.sequence, "input failed: {error}");
            summary.failed.push(error);
        }
    }
    progress.finished(input, completed);
    Ok(())
}
