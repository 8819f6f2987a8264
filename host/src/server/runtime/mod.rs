//! One tenant's runtime: its journal and state log (its own namespace on disk), its agents,
//! its keys (on the per-key core, [`crate::keys`]), and its quotas. Everything a request
//! does for a tenant goes through here.

mod front;
mod lifecycle;
mod replay;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use serde::Serialize;
use serde_json::value::RawValue;
use sha2::Digest as _;
use tokio::sync::{Semaphore, broadcast, watch};

pub use front::{AgentKey, Entry};
pub use lifecycle::Lifecycle;

use self::front::{BROKEN, EventEntry, Ledger, Tenant, summarize};
use super::agents::{DefineError, Version};
use super::config::TenantPolicy;
use super::journal::{
    self, Accepted, ActionSummary, CallSummary, FinishedStatus, INPUTS, InputRecord, JournalError,
    OUTPUTS,
};
use super::quota::{PerMinute, QuotaExceeded};
use super::states::{StateError, States};
use crate::agent::{Delivered, SignalError, SignalIn, signal_came};
use crate::durable::{self, Answer};
use crate::event::{Delta, Input, OutputId, OutputRecord};
use crate::keys::{Cancelling, CommandError, Head, HostFault, Keys, Queued};
use crate::log::{FileLog, FileLogOptions, Log, LogError, Recovery};
use crate::sandbox::Sandbox;
use crate::state_dir::{StateDirError, incarnation_of};
use crate::store::{ActionStateStore, KeyScope, StoreError, Waiting};

/// Why a tenant's runtime could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error("tenant {tenant}: opening {what}: {error}")]
    Log {
        tenant: String,
        what: &'static str,
        error: LogError,
    },
    #[error("tenant {tenant}: reading its journal: {error}")]
    Journal { tenant: String, error: JournalError },
    #[error("tenant {tenant}: recovering its recorded calls: {error}")]
    Store { tenant: String, error: StoreError },
    #[error("tenant {tenant}: {error}")]
    State { tenant: String, error: StateError },
    #[error("tenant {tenant}: loading its agents: {error}")]
    Agents {
        tenant: String,
        error: std::io::Error,
    },
    #[error("tenant {tenant}: {error}")]
    Dir {
        tenant: String,
        error: StateDirError,
    },
}

/// The host's instance pool, shared by every tenant's runs: `running` permits for runs,
/// `away` ones for runs whose call waits between attempts with their slot let go (their
/// instances stay alive, so the two together never pass the pool). A run takes leave with
/// `try_acquire` only, and never waits for one: holding it while it waits for a slot again
/// cannot close a cycle.
#[derive(Clone, Debug)]
pub struct HostRuns {
    pub running: Arc<Semaphore>,
    pub away: Arc<Semaphore>,
}

impl HostRuns {
    /// A pool of `instances`: an eighth of it for runs away (none below eight instances).
    pub fn of(instances: usize) -> Self {
        let away = instances / 8;
        Self {
            running: Arc::new(Semaphore::new(instances - away)),
            away: Arc::new(Semaphore::new(away)),
        }
    }
}

/// Why a submission was refused.
#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    #[error("no agent {0}")]
    UnknownAgent(String),
    #[error(
        "event id {id} was accepted before with another key or payload; an event id names one \
         event"
    )]
    Reused { id: String },
    #[error("event id {id} is being accepted by another request; retry")]
    InProgress { id: String },
    #[error(transparent)]
    Quota(#[from] QuotaExceeded),
    #[error("the server is stopping")]
    Stopping,
    #[error("{0}")]
    Unavailable(String),
    #[error("the journal did not accept the event: {0}")]
    Log(#[from] LogError),
}

/// An event submitted for a key.
#[derive(Debug)]
pub struct Submission {
    pub agent: String,
    pub event_id: String,
    pub key: String,
    pub payload: Box<RawValue>,
}

/// What became of a submission.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct Submitted {
    pub event_id: String,
    pub key: String,
    pub sequence: u64,
    pub version: u32,
    /// The event had been accepted before (a retried submission); nothing new was done.
    pub duplicate: bool,
}

/// An output and its position in the tenant's output stream, as the API shows it.
#[derive(Clone, Debug, Serialize, utoipa::ToSchema)]
pub struct PositionedOutput {
    pub position: u64,
    /// `TENANT/AGENT/KEY/SEQUENCE/INDEX`: names the output among every output.
    pub id: String,
    pub tenant: String,
    pub agent: String,
    pub key: String,
    pub sequence: u64,
    /// Position among the outputs of its input, from 0.
    pub index: u32,
    /// The id of the event whose input gave the output.
    pub event_id: String,
    #[schema(value_type = Object)]
    pub payload: Box<RawValue>,
}

impl PositionedOutput {
    fn new(position: u64, output: OutputRecord) -> Self {
        Self {
            position,
            id: output.id,
            tenant: output.tenant,
            agent: output.agent,
            key: output.key,
            sequence: output.sequence,
            index: output.index,
            event_id: output.event_id.unwrap_or_default(),
            payload: output.payload,
        }
    }
}

/// Where an input stands: the one list of states that docs/SEMANTICS.md ("The states of an
/// input") gives, as the API shows them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "kebab-case")]
pub enum InputStatus {
    /// Accepted, waiting for its turn (behind its key's earlier inputs).
    Accepted,
    /// Its actions are running (or it was running when the server stopped).
    Running,
    /// An attempt failed; the next starts after a backoff.
    Retrying,
    /// Every attempt failed: its key's later inputs wait until an operator retries or skips
    /// it.
    Parked,
    /// A host fault (its version cannot be loaded, the journal failed a write) stopped its
    /// key until the server is restarted; it is not finished.
    Stopped,
    /// It stopped at a durable wait (a sleep, a wait for signals): it runs again, from its
    /// records, when its time comes or a signal it waits for is delivered.
    Waiting,
    /// Its run completed, and its outputs and memory are recorded.
    Done,
    /// An operator skipped it: its key went on without it; nothing it did was applied.
    Skipped,
    /// An operator cancelled it: it stopped at its next durable call (not made), or was not
    /// run again; its key went on without it; nothing it did was applied.
    Cancelled,
    /// Finished without completing: by builds before retries, or (damaged journals) not
    /// run because two processes accepted it under one sequence.
    Failed,
}

impl From<FinishedStatus> for InputStatus {
    fn from(status: FinishedStatus) -> Self {
        match status {
            FinishedStatus::Done => Self::Done,
            FinishedStatus::Skipped => Self::Skipped,
            FinishedStatus::Cancelled => Self::Cancelled,
            FinishedStatus::Failed => Self::Failed,
        }
    }
}

/// One action run of an input, as a key's history shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct ActionRun {
    pub action: String,
    /// The kind of the event that triggered it.
    pub event: String,
    pub completed: bool,
    pub calls: Vec<CallRun>,
}

/// One recorded durable call of an action run.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct CallRun {
    pub index: u32,
    pub function: String,
    /// `pending`, `succeeded` or `failed`.
    pub status: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl From<ActionSummary> for ActionRun {
    fn from(action: ActionSummary) -> Self {
        Self {
            action: action.action,
            event: action.event,
            completed: action.completed,
            calls: action.calls.into_iter().map(CallRun::from).collect(),
        }
    }
}

impl From<CallSummary> for CallRun {
    fn from(call: CallSummary) -> Self {
        Self {
            index: call.index,
            function: call.function,
            status: call.status,
            error: call.error,
        }
    }
}

fn action_runs(actions: Vec<ActionSummary>) -> Vec<ActionRun> {
    actions.into_iter().map(ActionRun::from).collect()
}

/// One input in a key's history.
#[derive(Clone, Debug, Serialize, utoipa::ToSchema)]
pub struct HistoryEntry {
    pub sequence: u64,
    pub event_id: String,
    /// The agent version it ran on (or runs on): the one it was accepted for, unless an
    /// operator retried it on a newer one.
    pub version: u32,
    #[schema(value_type = Object)]
    pub payload: Box<RawValue>,
    pub accepted_at: u64,
    pub status: InputStatus,
    /// Why it is retrying, parked or stopped (its last attempt's error), or (`failed`)
    /// why it did not complete.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// While it runs or retries: which attempt; parked: how many were made.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub attempts: Option<u32>,
    /// Waiting: its wait.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub wait: Option<WaitView>,
    /// Skipped or cancelled: who did, and why.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub by: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<u64>,
    pub outputs: u32,
    /// Its action runs, in the order they ran.
    pub actions: Vec<ActionRun>,
    /// Operators' retries of it, and answers for its calls in doubt, in order (a skip or a
    /// cancel is its `status`, with `by` and `reason`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub commands: Vec<OperatorCommand>,
}

/// An operator's retry of an input, or answer for a call of it in doubt, as its history
/// shows it.
#[derive(Clone, Debug, Serialize, utoipa::ToSchema)]
pub struct OperatorCommand {
    /// `retried` or `resolved`.
    pub done: &'static str,
    /// Who: `admin`, or `tenant token tok_…`.
    pub by: String,
    /// When, in milliseconds since the Unix epoch.
    pub at: u64,
    /// Retried: the agent version it runs on.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub version: Option<u32>,
    /// Resolved: the action and the call (its index in the action's run), and what the
    /// operator said the remote did: `result`, `error` or `not-made`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub action: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub call: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub answer: Option<String>,
}

/// An unfinished input at the head of its key, as a list across keys shows it.
#[derive(Clone, Debug, Serialize, utoipa::ToSchema)]
pub struct HeadInput {
    pub key: String,
    pub sequence: u64,
    pub event_id: String,
    pub version: u32,
    pub status: InputStatus,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub attempts: Option<u32>,
    /// Waiting: its wait.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub wait: Option<WaitView>,
    /// The key's later inputs, waiting behind it.
    pub waiting: u64,
}

/// A durable wait an input stopped at, as the API shows it.
#[derive(Clone, Debug, Serialize, utoipa::ToSchema)]
pub struct WaitView {
    /// The action that waits.
    pub action: String,
    /// When it ends without a signal, in milliseconds since the Unix epoch (absent: only a
    /// signal ends it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub until: Option<u64>,
    /// The signals that end it (none: a sleep).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub signals: Vec<String>,
}

/// Why an operator's retry or skip was refused.
#[derive(Debug, thiserror::Error)]
pub enum CommandRefused {
    #[error("no agent {0}")]
    UnknownAgent(String),
    #[error("agent {agent} has no version {version}")]
    UnknownVersion { agent: String, version: u32 },
    #[error(
        "input #{sequence} of key {key} ran on version {ran}; it can be retried on that \
         version or a newer one, not on {asked}"
    )]
    OlderVersion {
        key: String,
        sequence: u64,
        ran: u32,
        asked: u32,
    },
    #[error("{0}")]
    NotParked(CommandError),
    /// A cancel of an input that is not its key's first unfinished one, or of one a host
    /// fault stopped, or that completed first.
    #[error("{0}")]
    NotCancellable(CommandError),
    /// The answer for a call was refused: the call is not in doubt, or not only in one
    /// action, or the result is not JSON.
    #[error("{0}")]
    NotInDoubt(CommandError),
    #[error("{0}")]
    Record(CommandError),
    /// The agent's recorded calls could not be read back from its state log.
    #[error(transparent)]
    State(#[from] StateError),
}

impl From<CommandError> for CommandRefused {
    fn from(error: CommandError) -> Self {
        match error {
            CommandError::NotParked { .. } => Self::NotParked(error),
            CommandError::NotCancellable { .. } => Self::NotCancellable(error),
            CommandError::Record { .. } => Self::Record(error),
            // The journal did not take the answer's record.
            CommandError::Refused { error: ref refused } if refused.is::<HostFault>() => {
                Self::Record(error)
            }
            CommandError::Refused { .. } => Self::NotInDoubt(error),
        }
    }
}

/// A tenant's runtime.
#[derive(Debug)]
pub struct TenantRuntime {
    tenant: Arc<Tenant>,
    keys: Keys<Tenant>,
    /// The tenant's `compiles-per-minute`.
    compiles: PerMinute,
    /// The tenant's `signals-per-minute`.
    signals: PerMinute,
    /// Where runs execute: threads of their own, so that guests busy with CPU do not delay
    /// the requests, journal writes and streams of the server's own runtime.
    compute: tokio::runtime::Handle,
    defining: tokio::sync::Mutex<()>,
    /// Keeps the journal's snapshot near its end; stopped when the runtime goes.
    _snapshots: replay::Snapshots,
}

impl TenantRuntime {
    /// Opens the tenant's namespace under `dir` (creating it when new), recovers what it
    /// accepted, and starts the inputs that had not finished.
    pub async fn open(
        name: &str,
        dir: PathBuf,
        policy: TenantPolicy,
        sandbox: Arc<Sandbox>,
        host_runs: HostRuns,
        compute: tokio::runtime::Handle,
        lifecycle: Arc<Lifecycle>,
    ) -> Result<Arc<Self>, OpenError> {
        let options = FileLogOptions {
            partitions: journal::PARTITIONS,
            recovery: Recovery::TruncateTornTail,
            contents: Some(journal::CONTENTS),
            ..FileLogOptions::default()
        };
        let (journal, _) =
            FileLog::open(&dir.join("journal"), options).map_err(|error| OpenError::Log {
                tenant: name.to_owned(),
                what: "its journal",
                error,
            })?;
        let journal: Arc<dyn Log> = Arc::new(journal);
        // Made with the tenant's directory: a tenant made again under the same name, in a
        // new directory, makes new idempotency keys.
        let incarnation = incarnation_of(&dir).map_err(|error| OpenError::Dir {
            tenant: name.to_owned(),
            error,
        })?;
        let states = States::open(&dir, incarnation).map_err(|error| OpenError::State {
            tenant: name.to_owned(),
            error,
        })?;
        let states = Arc::new(states);
        let budget = Arc::new(PerMinute::calls(policy.quotas.calls_per_minute));
        // The tenant's compiled components are its own, and count toward its `stored-bytes`.
        let compiled = sandbox.cache().dir().map(|_| dir.join("compiled"));
        let builder = super::agents::Builder {
            tenant: name.to_owned(),
            sandbox: Arc::new(sandbox.with_cache_dir(compiled)),
            states: Arc::clone(&states),
            policy: policy.clone(),
            budget: Arc::clone(&budget) as Arc<dyn durable::CallBudget>,
        };
        let agents = builder.load_all(&dir).map_err(|error| OpenError::Agents {
            tenant: name.to_owned(),
            error,
        })?;
        // The cache of recorded calls, from what each state log holds; the journal's
        // finished inputs are pruned again as it is read back.
        states.ready_all().await.map_err(|error| OpenError::State {
            tenant: name.to_owned(),
            error,
        })?;
        let tenant = Arc::new(Tenant {
            name: name.to_owned(),
            runs: Arc::new(Semaphore::new(policy.quotas.concurrent_runs as usize)),
            agent_runs: Mutex::new(HashMap::new()),
            dir,
            policy,
            journal,
            states,
            broken: AtomicBool::new(false),
            budget,
            builder,
            host_runs: host_runs.running,
            host_away: host_runs.away,
            lifecycle,
            agents: RwLock::new(agents),
            ledger: Mutex::new(Ledger::default()),
            outputs: watch::channel(0).0,
            deltas: Arc::new(front::Broadcast(broadcast::channel(front::DELTAS_BEHIND).0)),
            stored: Mutex::new((None, 0)),
            snapshot_at: AtomicU64::new(0),
        });
        let runtime = Arc::new(Self {
            compiles: PerMinute::compiles(tenant.policy.quotas.compiles_per_minute),
            signals: PerMinute::signals(tenant.policy.quotas.signals_per_minute),
            keys: Keys::on(Arc::clone(&tenant), compute.clone()),
            _snapshots: replay::Snapshots::start(Arc::clone(&tenant)),
            tenant,
            compute,
            defining: tokio::sync::Mutex::new(()),
        });
        runtime.recover().await?;
        Ok(runtime)
    }

    /// Reads the journal back: accepted events, finished inputs, each key's memory and next
    /// sequence, parked inputs; prunes the states of finished inputs; queues the rest on
    /// their keys.
    async fn recover(&self) -> Result<(), OpenError> {
        let tenant = &self.tenant;
        let journal_error = |error| OpenError::Journal {
            tenant: tenant.name.clone(),
            error,
        };
        // From the snapshot when there is one that reads: then only the records after it.
        let mut folded = match replay::load(&tenant.dir) {
            Ok(folded) => folded.unwrap_or_default(),
            Err(error) => {
                tracing::warn!(tenant = %tenant.name, "reading the whole journal, not the \
                    snapshot: {error}");
                replay::Folded::default()
            }
        };
        let read = folded
            .advance(&*tenant.journal, &tenant.name)
            .await
            .map_err(journal_error)?;
        // With nothing read past it, the snapshot on disk is where the journal ends.
        let saved = read == 0
            || replay::save(&tenant.dir, &folded)
                .inspect_err(|error| {
                    tracing::warn!(tenant = %tenant.name, "saving the journal's snapshot: {error}");
                })
                .is_ok();
        if saved {
            tenant
                .snapshot_at
                .store(folded.inputs_next, Ordering::Release);
        }
        let (_, end) = tenant
            .journal
            .bounds(OUTPUTS)
            .await
            .map_err(|e| journal_error(e.into()))?;
        tenant.outputs.send_replace(end);
        let mut ledger = Ledger {
            events: folded.events,
            ..Ledger::default()
        };
        for ((key, sequence), indexes) in &folded.written {
            for &index in indexes {
                ledger.written.insert(&OutputId {
                    tenant: tenant.name.clone(),
                    agent: key.agent.clone(),
                    key: key.key.clone(),
                    sequence: *sequence,
                    index,
                });
            }
        }
        let mut keys = Vec::with_capacity(folded.keys.len());
        for (key, state) in folded.keys {
            if let Some(sequence) = state.last_finished {
                let scope = KeyScope::new(&tenant.name, &key.agent, &key.key);
                match tenant.states.get(&key.agent) {
                    Some(agent_state) => {
                        (agent_state.store.prune(&scope, sequence).await).map_err(|error| {
                            OpenError::Store {
                                tenant: tenant.name.clone(),
                                error,
                            }
                        })?;
                    }
                    None => tenant.states.prune_when_open(&key.agent, scope, sequence),
                }
            }
            ledger.keys.insert(key.clone(), state.ledger);
            keys.push((key, state.next, state.memory));
        }
        let pending = folded.pending;
        let mut parked = folded.parked;
        let mut waiting = folded.waiting;
        ledger.in_flight = pending.len() as u64;
        *tenant.ledger() = ledger;
        for (key, next, memory) in keys {
            self.keys.restore(key, next, Arc::new(memory));
        }
        if !pending.is_empty() {
            tracing::info!(tenant = %tenant.name, inputs = pending.len(),
                "resuming inputs that had not finished");
        }
        for ((key, sequence), queued) in pending {
            let input = (key.clone(), sequence);
            match (parked.remove(&input), waiting.remove(&input)) {
                (Some((attempts, error)), _) => {
                    self.keys.restore_parked(key, queued, attempts, error);
                }
                // Unless a signal it waits for came as the server stopped: it runs now.
                (None, Some(wait)) if !self.signal_came(&key, sequence, &wait) => {
                    self.keys.restore_waiting(key, queued, wait);
                }
                (None, _) => {
                    self.keys.push(key, queued);
                }
            }
        }
        Ok(())
    }

    /// Whether a signal `wait` waits for is in the inbox of input `sequence` of `key`; when
    /// its agent's state is not open, it is taken as come (the input runs, to its wait).
    fn signal_came(&self, key: &AgentKey, sequence: u64, wait: &Waiting) -> bool {
        let scope = KeyScope::new(&self.tenant.name, &key.agent, &key.key);
        match self.tenant.states.get(&key.agent) {
            Some(state) => signal_came(&*state.store, &scope, sequence, wait),
            None => true,
        }
    }

    pub fn name(&self) -> &str {
        &self.tenant.name
    }

    pub fn dir(&self) -> &Path {
        &self.tenant.dir
    }

    pub fn policy(&self) -> &TenantPolicy {
        &self.tenant.policy
    }

    /// Bytes under the tenant's directory, walked again when the figure is stale.
    pub fn stored_bytes(&self) -> u64 {
        self.tenant.stored_bytes()
    }

    /// Refuses to store `more` bytes when that would take the tenant past `stored-bytes`.
    pub fn check_storage(&self, more: u64) -> Result<(), QuotaExceeded> {
        self.tenant.check_storage(more)
    }

    /// Counts one upload against `compiles-per-minute`, or refuses it.
    pub fn take_compile(&self) -> Result<(), QuotaExceeded> {
        self.compiles.take_one()
    }

    /// Counts a signal sent against `signals-per-minute`; refused past it.
    pub fn take_signal(&self) -> Result<(), QuotaExceeded> {
        self.signals.take_one()
    }

    /// The runtime the tenant's guests run on, below the server's own threads.
    pub fn compute(&self) -> &tokio::runtime::Handle {
        &self.compute
    }

    /// The tenant's sandbox: the host's engine and instances, the tenant's own cache.
    pub fn sandbox(&self) -> Arc<Sandbox> {
        Arc::clone(&self.tenant.builder.sandbox)
    }

    /// Defines a new version of an agent from its agent.toml.
    pub async fn define(&self, text: String) -> Result<(String, u32), DefineError> {
        let tenant = &self.tenant;
        tenant.check_storage(text.len() as u64)?;
        let _one_at_a_time = self.defining.lock().await;
        let builder = tenant.builder.clone();
        let dir = tenant.dir.clone();
        let joined = |e: tokio::task::JoinError| {
            DefineError::Build(format!("defining the agent failed: {e}"))
        };
        let prepared = tokio::task::spawn_blocking(move || builder.prepare(&dir, &text))
            .await
            .map_err(joined)??;
        // Before the version is in place: no input runs on a state whose cache is not yet
        // what its log holds.
        if let Err(error) = prepared.built.state.ready().await {
            let agent = prepared.name.clone();
            tokio::task::spawn_blocking(move || prepared.abandon())
                .await
                .map_err(joined)?;
            return Err(StateError::Store { agent, error }.into());
        }
        let (name, version, built) = tokio::task::spawn_blocking(move || prepared.commit())
            .await
            .map_err(joined)??;
        let agent = built.agent;
        {
            let mut agents = tenant.agents.write().unwrap_or_else(|p| p.into_inner());
            let versions = agents.entry(name.clone()).or_default();
            versions.versions.insert(version, Version::Loaded(agent));
            versions.keep_newest(tenant.policy.quotas.agent_versions_loaded);
        }
        tenant.stored.lock().unwrap_or_else(|p| p.into_inner()).0 = None;
        Ok((name, version))
    }

    /// Each agent and its versions (the last is current).
    pub fn agents(&self) -> BTreeMap<String, Vec<u32>> {
        self.tenant
            .agents
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|(name, versions)| (name.clone(), versions.versions.keys().copied().collect()))
            .collect()
    }

    /// Accepts an event for a key, once per event id: a retry of an accepted submission
    /// returns what the first one got.
    ///
    /// Not cancellation safe: dropped part way, it can leave the id reserved. Callers that
    /// may be cancelled (a request whose client went away) run it in a task of its own.
    pub async fn submit(&self, event: Submission) -> Result<Submitted, SubmitError> {
        let tenant = &self.tenant;
        if tenant.lifecycle.stopping() {
            return Err(SubmitError::Stopping);
        }
        if tenant.is_broken() {
            return Err(SubmitError::Unavailable(BROKEN.to_owned()));
        }
        let version = tenant
            .current_version(&event.agent)
            .ok_or_else(|| SubmitError::UnknownAgent(event.agent.clone()))?;
        if let Err(error) = tenant.agent_version(&event.agent, version).await {
            return Err(SubmitError::Unavailable(error));
        }
        // Before the tenant's lock: it may walk the tenant's directory.
        tenant.check_storage(event.payload.get().len() as u64)?;
        let digest = digest(&event.key, &event.payload);
        let id = (event.agent.clone(), event.event_id.clone());
        let key = AgentKey::new(&event.agent, &event.key);
        let intake = {
            let mut ledger = tenant.ledger();
            match ledger.events.get(&id) {
                Some(EventEntry::Reserved) => {
                    return Err(SubmitError::InProgress {
                        id: event.event_id.clone(),
                    });
                }
                Some(EventEntry::Accepted {
                    key,
                    sequence,
                    version,
                    digest: accepted,
                }) => {
                    return if *accepted == digest {
                        Ok(Submitted {
                            event_id: event.event_id.clone(),
                            key: key.clone(),
                            sequence: *sequence,
                            version: *version,
                            duplicate: true,
                        })
                    } else {
                        Err(SubmitError::Reused {
                            id: event.event_id.clone(),
                        })
                    };
                }
                None => {}
            }
            let quotas = &tenant.policy.quotas;
            if ledger.in_flight >= quotas.queued_inputs {
                return Err(QuotaExceeded {
                    quota: "queued-inputs",
                    allowed: quotas.queued_inputs,
                    detail: format!("{} inputs are accepted and not finished", ledger.in_flight),
                }
                .into());
            }
            tenant.budget.check()?;
            ledger.events.insert(id.clone(), EventEntry::Reserved);
            // Counted from the reservation, so that submissions at once cannot all pass.
            ledger.in_flight += 1;
            Arc::clone(&ledger.keys.entry(key.clone()).or_default().intake)
        };
        let _in_order = intake.lock().await;
        // Taken for good: when the write fails, the record may be in the journal all the
        // same (an acknowledgement can be lost), so the sequence is not given again.
        let sequence = self.keys.take_sequence(&key);
        let accepted = Accepted {
            agent: event.agent.clone(),
            event_id: event.event_id.clone(),
            key: event.key.clone(),
            sequence,
            version,
            payload: event.payload,
            accepted_at: journal::now_ms(),
        };
        let record = InputRecord::Accepted(accepted.clone()).encode();
        let bytes = record.len() as u64;
        let offset = match tenant.journal.append(INPUTS, record).await {
            Ok(offset) => offset,
            Err(error) => {
                // The id stays reserved: a retry is told to try again until a restart reads
                // what the journal holds.
                let mut ledger = tenant.ledger();
                ledger.in_flight = ledger.in_flight.saturating_sub(1);
                tenant.broken.store(true, Ordering::SeqCst);
                return Err(error.into());
            }
        };
        tenant.note_stored(bytes);
        {
            let mut ledger = tenant.ledger();
            ledger.events.insert(
                id,
                EventEntry::Accepted {
                    key: event.key.clone(),
                    sequence,
                    version,
                    digest,
                },
            );
            let state = ledger.keys.entry(key.clone()).or_default();
            state.history.push((sequence, offset, None));
        }
        let input = Input {
            key: event.key.clone(),
            sequence,
            payload: accepted.payload.get().to_owned(),
        };
        let extra = Entry {
            version,
            event_id: accepted.event_id,
        };
        self.keys.push(key, Queued { input, extra });
        Ok(Submitted {
            event_id: event.event_id,
            key: event.key,
            sequence,
            version,
            duplicate: false,
        })
    }

    /// Up to `limit` outputs after `position`, in order.
    pub async fn outputs_after(
        &self,
        position: u64,
        limit: usize,
    ) -> Result<Vec<PositionedOutput>, JournalError> {
        let journal = &self.tenant.journal;
        let (start, end) = journal.bounds(OUTPUTS).await?;
        let from = position.max(start);
        if from >= end {
            return Ok(Vec::new());
        }
        let records = journal.read(OUTPUTS, from, limit).await?;
        records
            .iter()
            .map(|record| {
                Ok(PositionedOutput::new(
                    record.offset + 1,
                    journal::decode_output(&self.tenant.name, record)?,
                ))
            })
            .collect()
    }

    /// Changes whenever outputs are written; holds the position of the newest.
    pub fn watch_outputs(&self) -> watch::Receiver<u64> {
        self.tenant.outputs.subscribe()
    }

    /// The pieces of streamed answers from now on, as the tenant's inputs' calls read them.
    pub fn follow_deltas(&self) -> broadcast::Receiver<Delta> {
        self.tenant.deltas.0.subscribe()
    }

    /// Up to `limit` inputs of an agent's key with sequences after `after`, oldest first,
    /// and whether more follow; `None` when the key has no inputs.
    pub async fn history(
        &self,
        agent: &str,
        key: &str,
        after: u64,
        limit: usize,
    ) -> Result<Option<(Vec<HistoryEntry>, bool)>, JournalError> {
        let tenant = &self.tenant;
        let id = AgentKey::new(agent, key);
        let (entries, damaged, commands) = {
            let ledger = tenant.ledger();
            let Some(state) = ledger.keys.get(&id) else {
                return Ok(None);
            };
            let page: Vec<_> = state
                .history
                .iter()
                .filter(|entry| entry.0 > after)
                .take(limit.saturating_add(1))
                .cloned()
                .collect();
            let commands: Vec<(u64, crate::log::Offset)> = match (page.first(), page.last()) {
                (Some(first), Some(last)) => state
                    .commands
                    .iter()
                    .filter(|(sequence, _)| (first.0..=last.0).contains(sequence))
                    .copied()
                    .collect(),
                _ => Vec::new(),
            };
            (page, state.damaged.clone(), commands)
        };
        let head = self.keys.head(&id);
        let more = entries.len() > limit;
        let scope = KeyScope::new(&tenant.name, agent, key);
        let mut history = Vec::with_capacity(entries.len());
        for (sequence, accepted_at, finished_at) in entries.into_iter().take(limit) {
            let Some(InputRecord::Accepted(accepted)) =
                journal::read_one(&*tenant.journal, INPUTS, accepted_at).await?
            else {
                continue;
            };
            let mut entry = HistoryEntry {
                sequence,
                event_id: accepted.event_id,
                version: accepted.version,
                payload: accepted.payload,
                accepted_at: accepted.accepted_at,
                status: InputStatus::Running,
                error: None,
                attempts: None,
                wait: None,
                by: None,
                reason: None,
                finished_at: None,
                outputs: 0,
                actions: Vec::new(),
                commands: Vec::new(),
            };
            for &(_, offset) in commands.iter().filter(|(s, _)| *s == sequence) {
                match journal::read_one(&*tenant.journal, INPUTS, offset).await? {
                    Some(InputRecord::Retried(retried)) => entry.commands.push(OperatorCommand {
                        done: "retried",
                        by: retried.by,
                        at: retried.retried_at,
                        version: Some(retried.version),
                        action: None,
                        call: None,
                        answer: None,
                    }),
                    Some(InputRecord::Resolved(resolved)) => {
                        entry.commands.push(OperatorCommand {
                            done: "resolved",
                            by: resolved.by,
                            at: resolved.resolved_at,
                            version: None,
                            action: Some(resolved.action),
                            call: Some(resolved.call),
                            answer: Some(resolved.answer),
                        });
                    }
                    _ => {}
                }
            }
            let finished = match finished_at {
                Some(offset) => match journal::read_one(&*tenant.journal, INPUTS, offset).await? {
                    Some(InputRecord::Finished(finished)) => Some(finished),
                    _ => None,
                },
                None => None,
            };
            if let Some(finished) = finished {
                entry.version = finished.version.unwrap_or(entry.version);
                entry.status = finished.status.into();
                entry.error = finished.error;
                entry.by = finished.by;
                entry.reason = finished.reason;
                entry.finished_at = Some(finished.finished_at);
                entry.outputs = finished.outputs;
                entry.actions = action_runs(finished.actions);
            } else if let Some(why) = damaged.get(&accepted_at) {
                entry.status = InputStatus::Failed;
                entry.error = Some(why.clone());
            } else {
                let accepted = (InputStatus::Accepted, None, None);
                (entry.status, entry.error, entry.attempts) = match &head {
                    // It runs on the version its last retry named.
                    Some(head) if head.first.input.sequence == sequence => {
                        entry.version = head.first.extra.version;
                        entry.wait = head_wait(&head.head);
                        head_status(&head.head, sequence).unwrap_or(accepted)
                    }
                    Some(head) if head.waiting.contains(&sequence) => accepted,
                    // Between its run and its record.
                    _ => (InputStatus::Running, None, None),
                };
                entry.actions = action_runs(summarize(&tenant.states, &scope, sequence));
            }
            history.push(entry);
        }
        Ok(Some((history, more)))
    }

    /// The agent's keys whose first unfinished input has `status` (`parked`, `retrying`,
    /// `running` or `stopped`), ordered by key.
    pub fn inputs(&self, agent: &str, status: InputStatus) -> Vec<HeadInput> {
        let mut inputs: Vec<HeadInput> = self
            .keys
            .heads(|key, _| key.agent == agent)
            .into_iter()
            .filter_map(|head| {
                let sequence = head.first.input.sequence;
                let (found, error, attempts) = head_status(&head.head, sequence)?;
                (found == status).then_some(HeadInput {
                    key: head.key.key,
                    sequence,
                    event_id: head.first.extra.event_id,
                    version: head.first.extra.version,
                    status,
                    error,
                    attempts,
                    wait: head_wait(&head.head),
                    waiting: head.waiting.len() as u64,
                })
            })
            .collect();
        inputs.sort_by(|a, b| a.key.cmp(&b.key));
        inputs
    }

    /// Runs `key`'s parked input again (`sequence`, when given, must be it), on `version`
    /// when given (the one it ran on, or newer); `by` is recorded with the retry.
    pub async fn retry(
        &self,
        agent: &str,
        key: &str,
        sequence: Option<u64>,
        version: Option<u32>,
        by: &str,
    ) -> Result<u64, CommandRefused> {
        let id = self.command_key(agent, key)?;
        if let Some(asked) = version {
            let defined = (self.tenant.agents.read())
                .unwrap_or_else(|p| p.into_inner())
                .get(agent)
                .is_some_and(|versions| versions.versions.contains_key(&asked));
            if !defined {
                return Err(CommandRefused::UnknownVersion {
                    agent: agent.to_owned(),
                    version: asked,
                });
            }
            let ran = (self.keys.head(&id))
                .map(|head| (head.first.input.sequence, head.first.extra.version));
            if let Some((sequence, ran)) = ran
                && asked < ran
            {
                return Err(CommandRefused::OlderVersion {
                    key: key.to_owned(),
                    sequence,
                    ran,
                    asked,
                });
            }
        }
        let retried = self
            .keys
            .retry(&id, sequence, by, |queued| {
                if let Some(version) = version {
                    queued.extra.version = version;
                }
            })
            .await?;
        Ok(retried)
    }

    /// Records `answer` for call `call` of `key`'s parked input `sequence` (of `action`,
    /// when more than one of its actions has that call in doubt), then runs the input
    /// again; `by` is recorded with the retry and logged with the answer.
    #[allow(clippy::too_many_arguments)]
    pub async fn resolve(
        &self,
        agent: &str,
        key: &str,
        sequence: u64,
        action: Option<String>,
        call: usize,
        answer: Answer,
        by: &str,
    ) -> Result<u64, CommandRefused> {
        let id = self.command_key(agent, key)?;
        let tenant = Arc::clone(&self.tenant);
        let scope = KeyScope::new(&self.tenant.name, agent, key);
        let (who, of) = (by.to_owned(), id.clone());
        let state = (tenant.states.opened(agent)).ok_or_else(|| {
            CommandRefused::UnknownAgent(format!("{agent} (none of its versions could be loaded)"))
        })?;
        // Not on a cache that its log has not filled yet (a version of it being loaded).
        (state.ready().await).map_err(|error| StateError::Store {
            agent: agent.to_owned(),
            error,
        })?;
        let resolve = |queued: Queued<Entry>| async move {
            let resolved = durable::resolve(
                &*state.store,
                &scope,
                sequence,
                action.as_deref(),
                call,
                &answer,
                &who,
            )
            .await?;
            // For the history; the answer itself is in the call's record, which the retry
            // recorded next serves. (Lost in a crash before it, the answer stays.)
            let record = InputRecord::Resolved(journal::Resolved {
                agent: of.agent.clone(),
                key: of.key.clone(),
                sequence,
                event_id: queued.extra.event_id,
                action: resolved.action,
                call: call as u64,
                answer: answer.kind().to_owned(),
                by: who,
                resolved_at: journal::now_ms(),
            });
            let what = "the answer for a call in doubt";
            let offset = tenant
                .append_input(&of, sequence, what, record.encode())
                .await?;
            tenant.commanded(&of, sequence, offset);
            Ok(())
        };
        Ok(self
            .keys
            .retry_after(&id, Some(sequence), by, resolve)
            .await?)
    }

    /// Skips `key`'s parked input (`sequence`, when given, must be it): its key's next
    /// input runs; `by` and `why` are recorded with it.
    pub async fn skip(
        &self,
        agent: &str,
        key: &str,
        sequence: Option<u64>,
        by: &str,
        why: &str,
    ) -> Result<u64, CommandRefused> {
        let id = self.command_key(agent, key)?;
        Ok(self.keys.skip(&id, sequence, by, why).await?)
    }

    /// Delivers `signal` to `key`'s input `sequence`, or to its first unfinished one
    /// (`Keys::signal`).
    pub async fn signal(
        &self,
        agent: &str,
        key: &str,
        sequence: Option<u64>,
        signal: &SignalIn,
    ) -> Result<Delivered, SignalError> {
        let key = AgentKey::new(agent, key);
        self.keys.signal(&key, sequence, signal).await
    }

    /// Cancels `key`'s first unfinished input (`sequence`, when given, must be it): ended at
    /// once when parked, else at its next durable call (which is not made); `by` and `why`
    /// are recorded with it.
    pub async fn cancel(
        &self,
        agent: &str,
        key: &str,
        sequence: Option<u64>,
        by: &str,
        why: &str,
    ) -> Result<Cancelling, CommandRefused> {
        let id = self.command_key(agent, key)?;
        Ok(self.keys.cancel(&id, sequence, by, why).await?)
    }

    fn command_key(&self, agent: &str, key: &str) -> Result<AgentKey, CommandRefused> {
        if self.tenant.current_version(agent).is_none() {
            return Err(CommandRefused::UnknownAgent(agent.to_owned()));
        }
        Ok(AgentKey::new(agent, key))
    }

    /// Inputs accepted and not finished.
    pub fn in_flight(&self) -> u64 {
        self.tenant.ledger().in_flight
    }
}

/// What `head` says of the input `sequence`: its status, error and attempts, when it is
/// the key's first unfinished input.
fn head_status(head: &Head, sequence: u64) -> Option<(InputStatus, Option<String>, Option<u32>)> {
    match head {
        Head::Running {
            sequence: s,
            attempt,
        } if *s == sequence => Some((InputStatus::Running, None, Some(*attempt))),
        Head::Retrying {
            sequence: s,
            attempt,
            error,
        } if *s == sequence => Some((InputStatus::Retrying, Some(error.clone()), Some(*attempt))),
        Head::Parked {
            sequence: s,
            attempts,
            error,
        } if *s == sequence => Some((InputStatus::Parked, Some(error.clone()), Some(*attempts))),
        Head::Stopped { sequence: s, fault } if *s == sequence => {
            Some((InputStatus::Stopped, Some(fault.clone()), None))
        }
        Head::Waiting { sequence: s, .. } if *s == sequence => {
            Some((InputStatus::Waiting, None, None))
        }
        _ => None,
    }
}

/// The wait of a key's first input, when it is at one.
fn head_wait(head: &Head) -> Option<WaitView> {
    match head {
        Head::Waiting { waiting, .. } => Some(WaitView {
            action: waiting.action.clone(),
            until: waiting.wait.until,
            signals: waiting.wait.signals.clone(),
        }),
        _ => None,
    }
}

/// What makes two submissions of one event id the same event: its key and payload.
fn digest(key: &str, payload: &RawValue) -> [u8; 32] {
    let canonical = serde_json::from_str::<serde_json::Value>(payload.get())
        .map(|value| value.to_string())
        .unwrap_or_else(|_| payload.get().to_owned());
    let mut hasher = sha2::Sha256::new();
    hasher.update(key.len().to_le_bytes());
    hasher.update(key.as_bytes());
    hasher.update(canonical.as_bytes());
    hasher.finalize().into()
}
