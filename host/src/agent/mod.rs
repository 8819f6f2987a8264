//! An agent: its actions loaded into the sandbox, its functions, and the path of one input
//! through them (docs/SEMANTICS.md, "One input's path").

mod build;
mod config;
pub mod input;
pub mod output;
pub mod script;
mod signal;
mod task;

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

use tokio_util::sync::CancellationToken;

pub use crate::store::Waiting;
pub use build::{AgentBuilder, BuildError, Secrets};
pub use config::{
    ActionConfig, AgentConfig, AgentFile, ConfigError, DEFAULT_PARALLELISM, FunctionConfig,
    FunctionKind, FunctionRetryConfig, RetryConfig, StateConfig, UnhandledEvents,
};
pub use output::{JsonlSink, OutputSink, OutputWriter, WrittenIds};
pub use signal::{
    Delivered, MAX_INBOX_BYTES, MAX_SIGNAL_ID_BYTES, MAX_SIGNAL_PAYLOAD_BYTES,
    MAX_SIGNALS_PER_INPUT, SIGNAL_IDS_KEPT, SignalError, SignalIn, signal_came,
};

use crate::durable::digest::{input_trigger, sent_trigger};
use crate::durable::taken_signals;
use crate::durable::{CallPolicy, CallStats, CallsByFunction, DurableCalls};
use crate::event::{Deltas, Event, INPUT_KIND, Input, OUTPUT_KIND, Output, OutputId};
use crate::functions::{Functions, RunSlot};
use crate::sandbox::{ActionComponent, Limits, RunError, RunInput, RunLabels, Sandbox};
use crate::store::{ActionState, ActionStateStore, Completion, Digest, KeyScope, StateKey};

/// Events one input may route through its agent's actions before it is stopped (a guard
/// against actions that trigger each other without end).
pub const MAX_EVENTS_PER_INPUT: usize = 1000;

/// The tenant of agents run outside a server.
pub const DEFAULT_TENANT: &str = "default";

/// An action of a loaded agent.
#[derive(Debug)]
struct Action {
    name: String,
    on: Vec<String>,
    component: ActionComponent,
}

/// A key's short-term memory: names and values, shared until a write copies it.
pub type Memory = Arc<BTreeMap<String, String>>;

/// A loaded agent, ready to process inputs: one version of it, the same for every key.
/// What a key has (its memory, its place in its inputs) is its caller's to keep.
#[derive(Debug)]
pub struct Agent {
    tenant: String,
    name: String,
    actions: Vec<Action>,
    functions: Arc<Functions>,
    policy: Arc<CallPolicy>,
    limits: Limits,
    unhandled_events: UnhandledEvents,
    parallelism: usize,
    retry: RetryConfig,
    sandbox: Arc<Sandbox>,
    store: Arc<dyn ActionStateStore>,
}

/// How the host holds one input's run: the token an operator's cancel trips, the run slot
/// the run holds, which its calls let go of while they wait between attempts, and where the
/// pieces of its calls' streamed answers go as they come.
#[derive(Clone, Debug, Default)]
pub struct Control {
    pub cancel: CancellationToken,
    pub slot: Option<Arc<dyn RunSlot>>,
    pub deltas: Option<Arc<dyn Deltas>>,
}

/// What processing one input did.
#[derive(Debug, Default)]
pub struct InputReport {
    /// The key's memory after the input: with its actions' writes when it completed, the
    /// memory it was given when it did not (a failed input changes no memory; run again,
    /// its completed actions' writes are applied again).
    pub memory: Memory,
    pub outputs: Vec<Output>,
    /// Action runs (sandboxes started).
    pub runs: u64,
    /// Completed actions whose recorded events and memory writes were re-applied instead.
    pub reapplied: u64,
    pub calls: CallStats,
    pub calls_by_function: CallsByFunction,
    /// Events of a kind no action handles, dropped.
    pub unhandled: u64,
    /// Where the input stopped to wait (it did not complete, and did not fail): it runs
    /// again once the wait can be over.
    pub waiting: Option<Waiting>,
    /// Why the input did not complete.
    pub error: Option<InputError>,
}

/// Why an input did not complete. Its action states stay in the store, so processing the
/// input again replays the calls that were recorded.
#[derive(Debug, thiserror::Error)]
pub enum InputError {
    #[error("{key} #{sequence}: action `{action}`: {error}")]
    Run {
        key: String,
        sequence: u64,
        action: String,
        error: RunError,
    },
    #[error(
        "{key} #{sequence}: more than {MAX_EVENTS_PER_INPUT} events; do the actions trigger each other without end?"
    )]
    TooManyEvents { key: String, sequence: u64 },
    #[error(
        "{key} #{sequence}: an event of kind `{kind}` was sent, and no action handles it \
         (unhandled-events = \"fail\"): add the kind to an action's `on`, or send another"
    )]
    Unhandled {
        key: String,
        sequence: u64,
        kind: String,
    },
    /// The front end could not take what the input produced (more than a quota allows).
    #[error("{key} #{sequence}: {message}")]
    Refused {
        key: String,
        sequence: u64,
        message: String,
    },
    #[error("{key} #{sequence}: the host panicked while processing it: {message}")]
    Panicked {
        key: String,
        sequence: u64,
        message: String,
    },
}

impl InputError {
    /// The key and sequence of the input that failed.
    pub fn input(&self) -> (&str, u64) {
        match self {
            Self::Run { key, sequence, .. }
            | Self::TooManyEvents { key, sequence }
            | Self::Unhandled { key, sequence, .. }
            | Self::Refused { key, sequence, .. }
            | Self::Panicked { key, sequence, .. } => (key, *sequence),
        }
    }

    /// Whether the host, not the input, failed: the state log did not take a write, the
    /// host could not set up the run, or it panicked. Such an input is not failed, retried
    /// or parked: its key stops until the host recovers.
    pub fn is_host_fault(&self) -> bool {
        match self {
            Self::Run { error, .. } => matches!(
                error,
                RunError::Host(_) | RunError::Fault(crate::durable::Fault::Store { .. })
            ),
            Self::Panicked { .. } => true,
            Self::TooManyEvents { .. } | Self::Unhandled { .. } | Self::Refused { .. } => false,
        }
    }
}

impl Agent {
    pub fn builder(file: AgentFile, sandbox: Arc<Sandbox>) -> AgentBuilder {
        AgentBuilder::new(file, sandbox)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn tenant(&self) -> &str {
        &self.tenant
    }

    /// Runs its sandbox's instance pool holds at once.
    pub fn instances(&self) -> usize {
        self.sandbox.instances() as usize
    }

    pub fn parallelism(&self) -> usize {
        self.parallelism
    }

    /// How a failed input of this agent is run again before it is parked.
    pub fn retry(&self) -> RetryConfig {
        self.retry
    }

    /// The clock its waits (and `time` functions) read.
    pub fn clock(&self) -> Arc<dyn crate::functions::Clock> {
        self.policy
            .clock
            .clone()
            .unwrap_or_else(|| Arc::new(crate::functions::SystemClock))
    }

    pub fn store(&self) -> &Arc<dyn ActionStateStore> {
        &self.store
    }

    pub fn functions(&self) -> &Functions {
        &self.functions
    }

    pub fn scope(&self, key: &str) -> KeyScope {
        KeyScope::new(&self.tenant, &self.name, key)
    }

    /// Sets the states of `key`'s input `sequence`, which waits, aside on the store's shelf
    /// ([`ActionStateStore::shelve`]), so that the wait holds no retention back. Best
    /// effort: when that fails they stay in the log, which keeps them until the input runs
    /// again.
    pub async fn shelve(&self, key: &str, sequence: u64) {
        if let Err(error) = self.store.shelve(&self.scope(key), sequence).await {
            tracing::warn!(agent = %self.name, key, sequence, "a waiting input's states stay \
                where they were written, holding the log's retention back until it runs \
                again: {error}");
        }
    }

    /// Processes one input of a key whose memory is `memory`: runs the actions its event
    /// triggers, then the actions their events trigger, and collects the outputs and the
    /// key's memory after them. An action sees the writes of the actions before it in the
    /// same input.
    ///
    /// Callers keep inputs of one key in order and one at a time, each given the memory
    /// the one before left.
    pub async fn process(&self, input: &Input, memory: &Memory) -> InputReport {
        self.process_until(input, memory, &Control::default()).await
    }

    /// [`process`](Self::process) under the host's `control`: stopped at the next durable
    /// call once its token is cancelled (the input then fails with
    /// [`Fault::Cancelled`](crate::durable::Fault)), its run slot lent to its calls.
    pub async fn process_until(
        &self,
        input: &Input,
        memory: &Memory,
        control: &Control,
    ) -> InputReport {
        let cancel = &control.cancel;
        let mut report = InputReport {
            memory: Arc::clone(memory),
            ..InputReport::default()
        };
        let failed = |mut report: InputReport, error| {
            report.memory = Arc::clone(memory);
            report.error = Some(error);
            report
        };
        let scope = self.scope(&input.key);
        let mut queue: VecDeque<(Event, Digest)> = VecDeque::new();
        queue.push_back((
            Event::new(INPUT_KIND, &input.payload),
            input_trigger(&input.payload),
        ));
        let mut events = 0;
        // The inbox ids of the signals the input's waits took so far.
        let mut taken = Vec::new();
        while let Some((event, trigger)) = queue.pop_front() {
            events += 1;
            if events > MAX_EVENTS_PER_INPUT {
                let error = InputError::TooManyEvents {
                    key: input.key.clone(),
                    sequence: input.sequence,
                };
                return failed(report, error);
            }
            let mut routed = false;
            for action in self.actions.iter().filter(|a| a.on.contains(&event.kind)) {
                routed = true;
                let key = StateKey {
                    scope: scope.clone(),
                    sequence: input.sequence,
                    action: action.name.clone(),
                    trigger,
                };
                let completed = match self.store.get(&key) {
                    Some(state) if state.is_completed() => {
                        report.reapplied += 1;
                        state
                    }
                    found => {
                        let state =
                            found.unwrap_or_else(|| ActionState::new(key.clone(), event.clone()));
                        report.runs += 1;
                        let durable = DurableCalls::new(
                            Arc::clone(&self.store),
                            Arc::clone(&self.functions),
                            Arc::clone(&self.policy),
                            state,
                        )
                        .cancelled_by(cancel.clone())
                        .holding(control.slot.clone())
                        .following(control.deltas.clone())
                        .with_signals_taken(taken.iter().copied());
                        match self
                            .run_action(action, input, &event, durable, &mut report)
                            .await
                        {
                            Ok(state) => state,
                            Err(RunError::Waiting(wait)) => {
                                self.shelve(&input.key, input.sequence).await;
                                report.memory = Arc::clone(memory);
                                report.waiting = Some(Waiting {
                                    action: action.name.clone(),
                                    wait,
                                });
                                return report;
                            }
                            Err(error) => {
                                let error = InputError::Run {
                                    key: input.key.clone(),
                                    sequence: input.sequence,
                                    action: action.name.clone(),
                                    error,
                                };
                                return failed(report, error);
                            }
                        }
                    }
                };
                taken.extend(taken_signals(&completed));
                self.apply(
                    input,
                    &completed,
                    &mut queue,
                    &mut report.memory,
                    &mut report.outputs,
                );
            }
            if !routed {
                if self.unhandled_events == UnhandledEvents::Fail {
                    let error = InputError::Unhandled {
                        key: input.key.clone(),
                        sequence: input.sequence,
                        kind: event.kind,
                    };
                    return failed(report, error);
                }
                report.unhandled += 1;
                tracing::warn!(agent = %self.name, key = %input.key, sequence = input.sequence,
                    kind = %event.kind, "no action is triggered by events of this kind; dropped");
            }
        }
        report
    }

    /// [`process_until`](Self::process_until) in a task of its own, so that a panic fails
    /// this input (as [`InputError::Panicked`]) and not its caller.
    pub async fn process_isolated(
        self: &Arc<Self>,
        input: &Input,
        memory: &Memory,
        control: &Control,
    ) -> InputReport {
        let task = task::AbortOnDrop(tokio::spawn({
            let agent = Arc::clone(self);
            let (input, memory, control) = (input.clone(), Arc::clone(memory), control.clone());
            async move { agent.process_until(&input, &memory, &control).await }
        }));
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
                    memory: Arc::clone(memory),
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

    async fn run_action(
        &self,
        action: &Action,
        input: &Input,
        event: &Event,
        durable: DurableCalls,
        report: &mut InputReport,
    ) -> Result<ActionState, RunError> {
        let run = RunInput {
            labels: RunLabels {
                agent: self.name.clone(),
                key: input.key.clone(),
                sequence: input.sequence,
                action: action.name.clone(),
            },
            event: event.clone(),
            memory: Arc::clone(&report.memory),
            durable,
            limits: self.limits,
        };
        let output = self.sandbox.run(&action.component, run).await;
        report.calls += output.durable.stats();
        report.calls_by_function += output.durable.by_function();
        output.result?;
        output
            .durable
            .complete(Completion {
                sent: output.sent,
                memory: output.memory,
            })
            .await
            .map_err(RunError::from)
    }

    /// Applies a completed action: its memory writes, its outputs, and the events it sent.
    fn apply(
        &self,
        input: &Input,
        state: &ActionState,
        queue: &mut VecDeque<(Event, Digest)>,
        memory: &mut Memory,
        outputs: &mut Vec<Output>,
    ) {
        let Some(completion) = &state.completion else {
            return;
        };
        if !completion.memory.is_empty() {
            let map = Arc::make_mut(memory);
            for write in &completion.memory {
                map.insert(write.name.clone(), write.value.clone());
            }
        }
        for (index, event) in completion.sent.iter().enumerate() {
            if event.kind == OUTPUT_KIND {
                outputs.push(Output {
                    id: OutputId {
                        tenant: self.tenant.clone(),
                        agent: self.name.clone(),
                        key: input.key.clone(),
                        sequence: input.sequence,
                        index: u32::try_from(outputs.len()).unwrap_or(u32::MAX),
                    },
                    payload: event.payload.clone(),
                });
            } else {
                queue.push_back((event.clone(), sent_trigger(&state.key, index)));
            }
        }
    }
}
