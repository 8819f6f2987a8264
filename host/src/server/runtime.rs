//! One tenant's runtime: its journal and state log (its own namespace on disk), its agents,
//! its keys' queues, and its quotas. Everything a request does for a tenant goes through here.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::value::RawValue;
use sha2::Digest as _;
use tokio::sync::{Notify, Semaphore, watch};

use super::agents::{Builder, DefineError, Version, Versions};
use super::config::TenantPolicy;
use super::journal::{
    self, Accepted, ActionSummary, CallSummary, Finished, INPUTS, InputRecord, InputStatus,
    JournalError, OUTPUTS, OutputPlace,
};
use super::quota::{PerMinute, QuotaExceeded};
use crate::agent::{Agent, WrittenIds};
use crate::checkpoint;
use crate::event::{Input, OutputId, OutputRecord};
use crate::log::{FileLog, FileLogOptions, Log, LogError, Offset, Recovery};
use crate::sandbox::Sandbox;
use crate::state_dir::{StateDirError, incarnation_of};
use crate::store::{ActionStateStore, CallOutcome, KeyScope, LogStore, MarkerStrategy, StoreError};
use crate::text;

/// Partitions of a tenant's state log.
const STATE_PARTITIONS: u32 = 4;
/// Segments of a tenant's state log: whole segments are what compaction deletes.
const STATE_SEGMENT_BYTES: u64 = 1 << 20;
/// How often, at most, the state log is compacted (checked as inputs finish).
const COMPACT_EVERY: Duration = Duration::from_secs(1);
/// How stale the stored-bytes figure may be before the tenant's directory is walked again.
const STORED_REFRESH: Duration = Duration::from_millis(500);

/// What the server's tenants share: whether it is stopping, and how many inputs run.
#[derive(Debug)]
pub struct Lifecycle {
    stopping: AtomicBool,
    running: AtomicUsize,
    idle: Notify,
    /// True once the server stops accepting requests: streams end.
    closing: watch::Sender<bool>,
}

impl Default for Lifecycle {
    fn default() -> Self {
        Self {
            stopping: AtomicBool::new(false),
            running: AtomicUsize::new(0),
            idle: Notify::new(),
            closing: watch::channel(false).0,
        }
    }
}

impl Lifecycle {
    /// Ends every output stream (so that the HTTP server can finish its connections).
    pub fn close_streams(&self) {
        self.closing.send_replace(true);
    }

    pub fn closing(&self) -> watch::Receiver<bool> {
        self.closing.subscribe()
    }

    pub fn stopping(&self) -> bool {
        self.stopping.load(Ordering::SeqCst)
    }

    /// No input starts from now on; waits up to `grace` for those running to finish.
    /// Returns how many were still running (they resume at the next start).
    pub async fn stop(&self, grace: Duration) -> usize {
        self.stopping.store(true, Ordering::SeqCst);
        let deadline = tokio::time::Instant::now() + grace;
        loop {
            let idle = self.idle.notified();
            let running = self.running.load(Ordering::SeqCst);
            if running == 0 {
                return 0;
            }
            if tokio::time::timeout_at(deadline, idle).await.is_err() {
                return self.running.load(Ordering::SeqCst);
            }
        }
    }

    fn started(&self) {
        self.running.fetch_add(1, Ordering::SeqCst);
    }

    fn finished(&self) {
        if self.running.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.idle.notify_waiters();
        }
    }
}

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

/// Journal records to append, each with its partition.
type Records = Vec<(u32, Vec<u8>)>;

/// One input in a key's history.
#[derive(Clone, Debug, Serialize, utoipa::ToSchema)]
pub struct HistoryEntry {
    pub sequence: u64,
    pub event_id: String,
    pub version: u32,
    #[schema(value_type = Object)]
    pub payload: Box<RawValue>,
    pub accepted_at: u64,
    pub status: InputStatus,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<u64>,
    pub outputs: u32,
    pub actions: Vec<ActionSummary>,
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

/// An accepted event, for retried submissions.
#[derive(Clone, Debug)]
enum EventEntry {
    /// Its `accepted` record is being written.
    Reserved,
    Accepted {
        key: String,
        sequence: u64,
        version: u32,
        digest: [u8; 32],
    },
}

/// What became of one input's run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Outcome {
    /// Its `finished` record is durable.
    Finished,
    /// The server is stopping: it runs again at the next start.
    Stopped,
    /// It cannot finish now (its version cannot be loaded, the journal failed, the host
    /// panicked): the key waits, in order, for the next start.
    Stuck,
}

/// An input waiting for its key's turn.
#[derive(Clone, Debug)]
struct Queued {
    sequence: u64,
    version: u32,
    event_id: String,
    payload: Box<RawValue>,
}

#[derive(Debug, Default)]
struct KeyState {
    next_sequence: u64,
    memory: BTreeMap<String, String>,
    queue: VecDeque<Queued>,
    /// A worker is draining the queue.
    working: bool,
    /// The sequence running now.
    running: Option<u64>,
    /// Every input: (sequence, offset of `accepted`, offset of `finished`).
    history: Vec<(u64, Offset, Option<Offset>)>,
    /// Inputs found at recovery under a sequence another input already had (two processes
    /// wrote the journal at once), by the offset of their `accepted` record, with why they
    /// were not run.
    damaged: BTreeMap<Offset, String>,
    /// Serialises this key's submissions, so that sequences are accepted in order.
    intake: Arc<tokio::sync::Mutex<()>>,
}

#[derive(Debug, Default)]
struct Inner {
    events: HashMap<(String, String), EventEntry>,
    keys: HashMap<(String, String), KeyState>,
    /// Accepted and not finished.
    in_flight: u64,
    /// Outputs found in the journal for inputs that had not finished when the server
    /// stopped. Their rerun does not write them again.
    written: WrittenIds,
}

/// A tenant's runtime.
#[derive(Debug)]
pub struct TenantRuntime {
    name: String,
    dir: PathBuf,
    policy: TenantPolicy,
    journal: Arc<dyn Log>,
    state_log: Arc<dyn Log>,
    store: Arc<LogStore>,
    compacted: Mutex<Instant>,
    /// The journal failed a write: nothing more is accepted or started until a restart.
    broken: AtomicBool,
    budget: Arc<PerMinute>,
    /// The tenant's `compiles-per-minute`.
    compiles: PerMinute,
    builder: Builder,
    /// The tenant's `concurrent-runs`.
    runs: Arc<Semaphore>,
    /// The host's sandbox instances, shared by every tenant.
    host_runs: Arc<Semaphore>,
    /// Where runs execute: threads of their own, so that guests busy with CPU do not delay
    /// the requests, journal writes and streams of the server's own runtime.
    compute: tokio::runtime::Handle,
    lifecycle: Arc<Lifecycle>,
    agents: RwLock<BTreeMap<String, Versions>>,
    defining: tokio::sync::Mutex<()>,
    inner: Mutex<Inner>,
    /// The position of the newest output.
    outputs: watch::Sender<u64>,
    stored: Mutex<(Option<Instant>, u64)>,
}

impl TenantRuntime {
    /// Opens the tenant's namespace under `dir` (creating it when new), recovers what it
    /// accepted, and starts the inputs that had not finished.
    pub async fn open(
        name: &str,
        dir: PathBuf,
        policy: TenantPolicy,
        sandbox: Arc<Sandbox>,
        host_runs: Arc<Semaphore>,
        compute: tokio::runtime::Handle,
        lifecycle: Arc<Lifecycle>,
    ) -> Result<Arc<Self>, OpenError> {
        let log_error = |what, error| OpenError::Log {
            tenant: name.to_owned(),
            what,
            error,
        };
        let open_log = |sub: &str, partitions, segment_bytes| {
            FileLog::open(
                &dir.join(sub),
                FileLogOptions {
                    partitions,
                    segment_bytes,
                    recovery: Recovery::TruncateTornTail,
                    ..FileLogOptions::default()
                },
            )
            .map(|(log, _)| Arc::new(log) as Arc<dyn Log>)
        };
        let journal = open_log(
            "journal",
            journal::PARTITIONS,
            FileLogOptions::default().segment_bytes,
        )
        .map_err(|e| log_error("its journal", e))?;
        let state_log = open_log("state", STATE_PARTITIONS, STATE_SEGMENT_BYTES)
            .map_err(|e| log_error("its state log", e))?;
        // Made with the tenant's directory: a tenant made again under the same name, in a
        // new directory, makes new idempotency keys.
        let incarnation = incarnation_of(&dir).map_err(|error| OpenError::Dir {
            tenant: name.to_owned(),
            error,
        })?;
        let store = Arc::new(LogStore::new(
            Arc::clone(&state_log),
            MarkerStrategy::Offsets,
            incarnation,
        ));
        // No checkpoints (yet): the cache is rebuilt from what the log holds, and the
        // journal's finished inputs are pruned again as it is read back.
        let rebuilt = match checkpoint::log_start(&*state_log).await {
            Ok(start) => store.rebuild(&start).await,
            Err(error) => Err(error),
        };
        rebuilt.map_err(|error| OpenError::Store {
            tenant: name.to_owned(),
            error,
        })?;
        let budget = Arc::new(PerMinute::calls(policy.quotas.calls_per_minute));
        // The tenant's compiled components are its own, and count toward its `stored-bytes`.
        let compiled = sandbox.cache().dir().map(|_| dir.join("compiled"));
        let builder = Builder {
            tenant: name.to_owned(),
            sandbox: Arc::new(sandbox.with_cache_dir(compiled)),
            store: Arc::clone(&store) as Arc<dyn ActionStateStore>,
            policy: policy.clone(),
            budget: Arc::clone(&budget) as Arc<dyn crate::durable::CallBudget>,
        };
        let agents = builder.load_all(&dir).map_err(|error| OpenError::Agents {
            tenant: name.to_owned(),
            error,
        })?;
        let (outputs, _) = watch::channel(0);
        let runtime = Arc::new(Self {
            name: name.to_owned(),
            runs: Arc::new(Semaphore::new(policy.quotas.concurrent_runs as usize)),
            dir,
            compiles: PerMinute::compiles(policy.quotas.compiles_per_minute),
            policy,
            journal,
            state_log,
            store,
            compacted: Mutex::new(Instant::now()),
            broken: AtomicBool::new(false),
            budget,
            builder,
            host_runs,
            compute,
            lifecycle,
            agents: RwLock::new(agents),
            defining: tokio::sync::Mutex::new(()),
            inner: Mutex::new(Inner::default()),
            outputs,
            stored: Mutex::new((None, 0)),
        });
        runtime.recover().await?;
        Ok(runtime)
    }

    /// Reads the journal back: accepted events, finished inputs, each key's memory and next
    /// sequence; prunes the states of finished inputs; queues the rest.
    async fn recover(self: &Arc<Self>) -> Result<(), OpenError> {
        let journal_error = |error| OpenError::Journal {
            tenant: self.name.clone(),
            error,
        };
        let mut inner = Inner::default();
        let mut pending: BTreeMap<(String, String, u64), Queued> = BTreeMap::new();
        let mut last_finished: HashMap<(String, String), u64> = HashMap::new();
        // Of inputs accepted under a sequence already handed out: (agent, event id).
        let mut damaged_events: HashSet<(String, String)> = HashSet::new();
        journal::scan::<InputRecord>(&*self.journal, INPUTS, |offset, record| match record {
            InputRecord::Accepted(accepted) => {
                let key = (accepted.agent.clone(), accepted.key.clone());
                let state = inner.keys.entry(key).or_default();
                if accepted.sequence < state.next_sequence {
                    // Sequences of a key are handed out one at a time, in order: this one
                    // was handed out twice, by two processes writing this directory at
                    // once. Which of the two a `finished` record is for cannot be told, so
                    // this one is not run (it may have run in the other process).
                    let why = format!(
                        "accepted as #{} of key {} after another input already was: two \
                         processes wrote this tenant's journal at once; not run here, as it \
                         may have run in the other (submit it again with a new event id to \
                         run it)",
                        accepted.sequence, accepted.key
                    );
                    tracing::warn!(tenant = %self.name, agent = %accepted.agent,
                        key = %accepted.key, sequence = accepted.sequence,
                        event_id = %accepted.event_id, "journal damaged: {why}");
                    state.history.push((accepted.sequence, offset, None));
                    state.damaged.insert(offset, why);
                    damaged_events.insert((accepted.agent.clone(), accepted.event_id.clone()));
                    inner
                        .events
                        .entry((accepted.agent, accepted.event_id))
                        .or_insert(EventEntry::Accepted {
                            key: accepted.key.clone(),
                            sequence: accepted.sequence,
                            version: accepted.version,
                            digest: digest(&accepted.key, &accepted.payload),
                        });
                    return;
                }
                state.next_sequence = state.next_sequence.max(accepted.sequence + 1);
                state.history.push((accepted.sequence, offset, None));
                inner.events.insert(
                    (accepted.agent.clone(), accepted.event_id.clone()),
                    EventEntry::Accepted {
                        key: accepted.key.clone(),
                        sequence: accepted.sequence,
                        version: accepted.version,
                        digest: digest(&accepted.key, &accepted.payload),
                    },
                );
                pending.insert(
                    (accepted.agent, accepted.key, accepted.sequence),
                    Queued {
                        sequence: accepted.sequence,
                        version: accepted.version,
                        event_id: accepted.event_id,
                        payload: accepted.payload,
                    },
                );
            }
            InputRecord::Finished(finished) => {
                // The other process's input, which it ran: nothing of this one's.
                if let Some(event_id) = &finished.event_id
                    && !damaged_events.is_empty()
                    && damaged_events.contains(&(finished.agent.clone(), event_id.clone()))
                {
                    return;
                }
                let key = (finished.agent.clone(), finished.key.clone());
                let state = inner.keys.entry(key.clone()).or_default();
                state.memory = finished.memory;
                let damaged = &state.damaged;
                // The first `finished` of a sequence is its input's; one more (written by a
                // second process, for an input it accepted under the same sequence) is not.
                // A record that names its event is told apart above; one of an earlier
                // build is taken for the first input's.
                if let Some(entry) = state.history.iter_mut().rev().find(|(sequence, at, done)| {
                    *sequence == finished.sequence && !damaged.contains_key(at) && done.is_none()
                }) {
                    entry.2 = Some(offset);
                }
                last_finished.insert(key, finished.sequence);
                pending.remove(&(finished.agent, finished.key, finished.sequence));
            }
        })
        .await
        .map_err(journal_error)?;
        let (_, end) = self
            .journal
            .bounds(OUTPUTS)
            .await
            .map_err(|e| journal_error(e.into()))?;
        self.outputs.send_replace(end);
        if !pending.is_empty() {
            journal::scan::<OutputPlace>(&*self.journal, OUTPUTS, |_, output| {
                if pending.contains_key(&(
                    output.agent.clone(),
                    output.key.clone(),
                    output.sequence,
                )) {
                    inner.written.insert(&OutputId {
                        tenant: self.name.clone(),
                        agent: output.agent,
                        key: output.key,
                        sequence: output.sequence,
                        index: output.index,
                    });
                }
            })
            .await
            .map_err(journal_error)?;
        }
        for ((agent, key), sequence) in &last_finished {
            let scope = KeyScope::new(&self.name, agent, key);
            self.store
                .prune(&scope, *sequence)
                .await
                .map_err(|error| OpenError::Store {
                    tenant: self.name.clone(),
                    error,
                })?;
        }
        inner.in_flight = pending.len() as u64;
        let mut start = Vec::new();
        for ((agent, key, _), queued) in pending {
            let state = inner.keys.entry((agent.clone(), key.clone())).or_default();
            state.queue.push_back(queued);
            if !state.working {
                state.working = true;
                start.push((agent, key));
            }
        }
        if !start.is_empty() {
            tracing::info!(tenant = %self.name, inputs = inner.in_flight,
                "resuming inputs that had not finished");
        }
        *self.lock() = inner;
        for (agent, key) in start {
            tokio::spawn(Arc::clone(self).work(agent, key));
        }
        Ok(())
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn policy(&self) -> &TenantPolicy {
        &self.policy
    }

    /// Bytes under the tenant's directory, walked again when the figure is stale.
    pub fn stored_bytes(&self) -> u64 {
        let mut stored = self.stored.lock().unwrap_or_else(|p| p.into_inner());
        if stored.0.is_none_or(|at| at.elapsed() >= STORED_REFRESH) {
            *stored = (Some(Instant::now()), dir_size(&self.dir));
        }
        stored.1
    }

    /// Refuses to store `more` bytes when that would take the tenant past `stored-bytes`.
    pub fn check_storage(&self, more: u64) -> Result<(), QuotaExceeded> {
        let quota = self.policy.quotas.stored_bytes;
        let stored = self.stored_bytes();
        if stored.saturating_add(more) > quota {
            return Err(QuotaExceeded {
                quota: "stored-bytes",
                allowed: quota,
                detail: format!("the tenant stores {stored} bytes and this adds {more}"),
            });
        }
        Ok(())
    }

    /// Counts one upload against `compiles-per-minute`, or refuses it.
    pub fn take_compile(&self) -> Result<(), QuotaExceeded> {
        self.compiles.take_one()
    }

    /// The runtime the tenant's guests run on, below the server's own threads.
    pub fn compute(&self) -> &tokio::runtime::Handle {
        &self.compute
    }

    /// The tenant's sandbox: the host's engine and instances, the tenant's own cache.
    pub fn sandbox(&self) -> Arc<Sandbox> {
        Arc::clone(&self.builder.sandbox)
    }

    /// Counts `bytes` written now, before the next walk sees them.
    fn note_stored(&self, bytes: u64) {
        let mut stored = self.stored.lock().unwrap_or_else(|p| p.into_inner());
        stored.1 = stored.1.saturating_add(bytes);
    }

    /// Defines a new version of an agent from its agent.toml.
    pub async fn define(&self, text: String) -> Result<(String, u32), DefineError> {
        self.check_storage(text.len() as u64)?;
        let _one_at_a_time = self.defining.lock().await;
        let builder = self.builder.clone();
        let dir = self.dir.clone();
        let (name, version, agent) =
            tokio::task::spawn_blocking(move || builder.define(&dir, &text))
                .await
                .map_err(|e| DefineError::Build(format!("defining the agent failed: {e}")))??;
        {
            let mut agents = self.agents.write().unwrap_or_else(|p| p.into_inner());
            let versions = agents.entry(name.clone()).or_default();
            versions.versions.insert(version, Version::Loaded(agent));
            versions.keep_newest(self.policy.quotas.agent_versions_loaded);
        }
        self.stored.lock().unwrap_or_else(|p| p.into_inner()).0 = None;
        Ok((name, version))
    }

    /// Each agent and its versions (the last is current).
    pub fn agents(&self) -> BTreeMap<String, Vec<u32>> {
        self.agents
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|(name, versions)| (name.clone(), versions.versions.keys().copied().collect()))
            .collect()
    }

    fn current_version(&self, agent: &str) -> Option<u32> {
        self.agents
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(agent)
            .and_then(Versions::current)
    }

    /// The agent of `version`: loaded, or built from disk when it was let go.
    async fn agent_version(&self, agent: &str, version: u32) -> Result<Arc<Agent>, String> {
        let held = self
            .agents
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(agent)
            .and_then(|versions| versions.versions.get(&version).cloned());
        match held {
            Some(Version::Loaded(agent)) => Ok(agent),
            Some(Version::Unloadable(error)) => Err(error),
            Some(Version::LetGo) => {
                let (builder, dir, agent) =
                    (self.builder.clone(), self.dir.clone(), agent.to_owned());
                tokio::task::spawn_blocking(move || builder.load(&dir, &agent, version))
                    .await
                    .map_err(|e| format!("loading version {version} failed: {e}"))?
            }
            None => Err(format!("agent {agent} has no version {version}")),
        }
    }

    /// Accepts an event for a key, once per event id: a retry of an accepted submission
    /// returns what the first one got.
    ///
    /// Not cancellation safe: dropped part way, it can leave the id reserved. Callers that
    /// may be cancelled (a request whose client went away) run it in a task of its own.
    pub async fn submit(self: &Arc<Self>, event: Submission) -> Result<Submitted, SubmitError> {
        if self.lifecycle.stopping() {
            return Err(SubmitError::Stopping);
        }
        if self.broken.load(Ordering::SeqCst) {
            return Err(SubmitError::Unavailable(
                "this tenant's journal failed a write; it takes events again once the server \
                 is restarted"
                    .to_owned(),
            ));
        }
        let version = self
            .current_version(&event.agent)
            .ok_or_else(|| SubmitError::UnknownAgent(event.agent.clone()))?;
        if let Err(error) = self.agent_version(&event.agent, version).await {
            return Err(SubmitError::Unavailable(error));
        }
        // Before the tenant's lock: it may walk the tenant's directory.
        self.check_storage(event.payload.get().len() as u64)?;
        let digest = digest(&event.key, &event.payload);
        let id = (event.agent.clone(), event.event_id.clone());
        let intake = {
            let mut inner = self.lock();
            match inner.events.get(&id) {
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
            let quotas = &self.policy.quotas;
            if inner.in_flight >= quotas.queued_inputs {
                return Err(QuotaExceeded {
                    quota: "queued-inputs",
                    allowed: quotas.queued_inputs,
                    detail: format!("{} inputs are accepted and not finished", inner.in_flight),
                }
                .into());
            }
            self.budget.check()?;
            inner.events.insert(id.clone(), EventEntry::Reserved);
            // Counted from the reservation, so that submissions at once cannot all pass.
            inner.in_flight += 1;
            Arc::clone(
                &inner
                    .keys
                    .entry((event.agent.clone(), event.key.clone()))
                    .or_default()
                    .intake,
            )
        };
        let _in_order = intake.lock().await;
        let sequence = {
            let mut inner = self.lock();
            let state = inner
                .keys
                .entry((event.agent.clone(), event.key.clone()))
                .or_default();
            state.next_sequence.max(1)
        };
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
        let offset = match self.journal.append(INPUTS, record).await {
            Ok(offset) => offset,
            Err(error) => {
                // The record may be in the journal all the same (an acknowledgement can be
                // lost). So the sequence is not given again, and the id stays reserved: a
                // retry is told to try again until a restart reads what the journal holds.
                let mut inner = self.lock();
                inner.in_flight = inner.in_flight.saturating_sub(1);
                if let Some(state) = inner
                    .keys
                    .get_mut(&(event.agent.clone(), event.key.clone()))
                {
                    state.next_sequence = sequence + 1;
                }
                self.broken.store(true, Ordering::SeqCst);
                return Err(error.into());
            }
        };
        self.note_stored(bytes);
        let start = {
            let mut inner = self.lock();
            inner.events.insert(
                id,
                EventEntry::Accepted {
                    key: event.key.clone(),
                    sequence,
                    version,
                    digest,
                },
            );
            let state = inner
                .keys
                .entry((event.agent.clone(), event.key.clone()))
                .or_default();
            state.next_sequence = sequence + 1;
            state.history.push((sequence, offset, None));
            state.queue.push_back(Queued {
                sequence,
                version,
                event_id: accepted.event_id,
                payload: accepted.payload,
            });
            !std::mem::replace(&mut state.working, true)
        };
        if start {
            tokio::spawn(Arc::clone(self).work(event.agent.clone(), event.key.clone()));
        }
        Ok(Submitted {
            event_id: event.event_id,
            key: event.key,
            sequence,
            version,
            duplicate: false,
        })
    }

    /// Runs a key's queued inputs, one at a time, in order.
    async fn work(self: Arc<Self>, agent: String, key: String) {
        let id = (agent.clone(), key.clone());
        loop {
            let next = {
                let mut inner = self.lock();
                let Some(state) = inner.keys.get_mut(&id) else {
                    return;
                };
                let next = if self.lifecycle.stopping() {
                    None
                } else {
                    state.queue.pop_front()
                };
                match next {
                    Some(next) => {
                        state.running = Some(next.sequence);
                        next
                    }
                    None => {
                        state.working = false;
                        return;
                    }
                }
            };
            let Ok(_tenant) = self.runs.acquire().await else {
                return;
            };
            let Ok(_host) = self.host_runs.acquire().await else {
                return;
            };
            let outcome = if self.lifecycle.stopping() {
                Outcome::Stopped
            } else if self.broken.load(Ordering::SeqCst) {
                Outcome::Stuck
            } else {
                self.lifecycle.started();
                let run = {
                    let (this, agent, key) = (Arc::clone(&self), agent.clone(), key.clone());
                    let next = next.clone();
                    self.compute
                        .spawn(async move { this.run_input(&agent, &key, next).await })
                };
                let outcome = run.await.unwrap_or_else(|error| {
                    tracing::error!(tenant = %self.name, agent, key, sequence = next.sequence,
                        "an input's run stopped: {error}; the key waits for the next start");
                    Outcome::Stuck
                });
                self.lifecycle.finished();
                outcome
            };
            if outcome != Outcome::Finished {
                // It stays first in its key's queue (and in the journal, unfinished). A
                // stuck key keeps `working`, so that no later input of it runs first.
                let mut inner = self.lock();
                if let Some(state) = inner.keys.get_mut(&id) {
                    state.queue.push_front(next);
                    state.running = None;
                    state.working = outcome == Outcome::Stuck;
                }
                return;
            }
        }
    }

    /// Runs one input and writes its outputs, then its `finished` record.
    async fn run_input(&self, agent_name: &str, key: &str, queued: Queued) -> Outcome {
        let sequence = queued.sequence;
        let memory_before = self
            .lock()
            .keys
            .get(&(agent_name.to_owned(), key.to_owned()))
            .map(|state| state.memory.clone())
            .unwrap_or_default();
        let input = Input {
            key: key.to_owned(),
            sequence,
            payload: queued.payload.get().to_owned(),
        };
        let scope = KeyScope::new(&self.name, agent_name, key);
        let (error, outputs, memory) = match self.agent_version(agent_name, queued.version).await {
            Err(error) => {
                // Not failed for good: the operator can fix what the version needs (a
                // secret, a host) and restart; its recorded calls wait for it.
                tracing::error!(tenant = %self.name, agent = agent_name, key, sequence,
                    "{error}; the key waits for the next start");
                return Outcome::Stuck;
            }
            Ok(agent) => {
                let report = agent
                    .process_isolated(&input, &Arc::new(memory_before.clone()))
                    .await;
                let memory = Arc::unwrap_or_clone(report.memory);
                match report.error {
                    // A failed input leaves the key's memory as it was.
                    Some(error) => (
                        Some(error.to_string()),
                        report.outputs,
                        memory_before.clone(),
                    ),
                    None => (None, report.outputs, memory),
                }
            }
        };
        // What the run produced counts toward `stored-bytes` too: over it, the input fails
        // naming the quota, and its outputs and memory writes are dropped.
        let produced: usize = outputs.iter().map(|o| o.payload.len()).sum::<usize>()
            + memory.iter().map(|(k, v)| k.len() + v.len()).sum::<usize>();
        let (error, memory) = match (error, self.check_storage(produced as u64)) {
            (None, Err(quota)) => (Some(quota.to_string()), memory_before.clone()),
            (error, _) => (error, memory),
        };
        let actions = summarize(&*self.store, &scope, sequence);
        let status = if let Some(error) = &error {
            tracing::warn!(tenant = %self.name, agent = agent_name, key, sequence,
                event_id = %queued.event_id, "input failed: {}", text::outside_error(error));
            InputStatus::Failed
        } else {
            InputStatus::Completed
        };
        // A failed input's outputs are not delivered: it did not complete.
        let outputs = if error.is_some() { Vec::new() } else { outputs };
        let mut records = Vec::with_capacity(outputs.len());
        {
            let inner = self.lock();
            for output in &outputs {
                if inner.written.contains(&output.id) {
                    continue;
                }
                let record = OutputRecord::new(output, Some(queued.event_id.clone()));
                records.push((OUTPUTS, record.encode()));
            }
        }
        let finished = Finished {
            agent: agent_name.to_owned(),
            key: key.to_owned(),
            sequence,
            event_id: Some(queued.event_id.clone()),
            status,
            error: error.as_deref().map(text::outside_error),
            outputs: u32::try_from(outputs.len()).unwrap_or(u32::MAX),
            actions,
            memory,
            finished_at: journal::now_ms(),
        };
        let (finished, encoded, records) = self.fit_journal(finished, records, &memory_before);
        let memory = finished.memory;
        let finished = encoded;
        let bytes =
            records.iter().map(|(_, r)| r.len() as u64).sum::<u64>() + finished.len() as u64;
        // The outputs are durable before the record that says the input finished, so that
        // a `finished` record never stands without its outputs. A failed write is not
        // retried: it may have reached the log, and writing again could double it. The
        // tenant stops until a restart reads what the journal holds.
        let output_offsets = if records.is_empty() {
            Vec::new()
        } else {
            match self.journal.append_many(records).await {
                Ok(offsets) => offsets,
                Err(error) => return self.journal_failed(agent_name, key, sequence, &error),
            }
        };
        let finished_at = match self.journal.append(INPUTS, finished).await {
            Ok(offset) => offset,
            Err(error) => return self.journal_failed(agent_name, key, sequence, &error),
        };
        self.note_stored(bytes);
        if let Err(error) = self.store.prune(&scope, sequence).await {
            tracing::warn!(tenant = %self.name, agent = agent_name, key, sequence,
                "pruning the input's states: {error}");
        }
        self.compact_if_due().await;
        let last_output = output_offsets.last().map(|offset| offset + 1);
        {
            let mut inner = self.lock();
            inner.in_flight = inner.in_flight.saturating_sub(1);
            inner
                .written
                .forget_input(&self.name, agent_name, key, sequence);
            if let Some(state) = inner.keys.get_mut(&(agent_name.to_owned(), key.to_owned())) {
                state.memory = memory;
                state.running = None;
                let damaged = &state.damaged;
                if let Some(entry) = state
                    .history
                    .iter_mut()
                    .rev()
                    .find(|e| e.0 == sequence && !damaged.contains_key(&e.1))
                {
                    entry.2 = Some(finished_at);
                }
            }
        }
        if let Some(position) = last_output {
            self.outputs.send_modify(|end| *end = (*end).max(position));
        }
        Outcome::Finished
    }

    /// An input's end as the journal can take it. When its outputs or its `finished` record
    /// are larger than a journal record, the input fails instead, saying so, with its
    /// memory as before and no outputs; its call summaries lose their errors, then
    /// themselves, until the record fits. (A record the journal cannot take would stop the
    /// tenant, and the input would fail the same way at every start.)
    fn fit_journal(
        &self,
        mut finished: Finished,
        records: Records,
        memory_before: &BTreeMap<String, String>,
    ) -> (Finished, Vec<u8>, Records) {
        let max_input = self.journal.max_record(INPUTS);
        let max_output = self.journal.max_record(OUTPUTS);
        let mut encoded = finished.encode();
        let record_size = encoded.len();
        let too_large = records
            .iter()
            .map(|(_, record)| (record.len(), max_output))
            .chain([(record_size, max_input)])
            .find(|&(size, max)| size > max);
        let Some((bytes, max)) = too_large else {
            return (finished, encoded, records);
        };
        let what = if bytes == record_size {
            "its calls and memory make its finished record"
        } else {
            "one of its outputs makes a record of"
        };
        let before = finished
            .error
            .take()
            .map_or_else(String::new, |e| format!(" ({e})"));
        finished.error = Some(text::outside_error(&format!(
            "{what} {bytes} bytes, more than the {max} the tenant's journal takes in one \
             record{before}"
        )));
        finished.status = InputStatus::Failed;
        finished.outputs = 0;
        finished.memory = memory_before.clone();
        encoded = finished.encode();
        if encoded.len() > max_input {
            for call in finished.actions.iter_mut().flat_map(|a| a.calls.iter_mut()) {
                call.error = None;
            }
            encoded = finished.encode();
        }
        if encoded.len() > max_input {
            finished.actions.clear();
            encoded = finished.encode();
        }
        tracing::warn!(tenant = %self.name, agent = finished.agent, key = finished.key,
            sequence = finished.sequence, "the input failed: {}",
            finished.error.as_deref().unwrap_or_default());
        (finished, encoded, Vec::new())
    }

    /// The journal did not take an input's end: no input of the tenant starts and no event
    /// is accepted until a restart, which reads back what the journal holds.
    fn journal_failed(&self, agent: &str, key: &str, sequence: u64, error: &LogError) -> Outcome {
        if self.lifecycle.stopping() {
            return Outcome::Stopped;
        }
        tracing::error!(tenant = %self.name, agent, key, sequence,
            "the journal did not take the input's end: {error}; the tenant stops until a restart");
        self.broken.store(true, Ordering::SeqCst);
        Outcome::Stuck
    }

    /// At most every [`COMPACT_EVERY`]: deletes the state log's segments below the store's
    /// marker. Only states of finished inputs (pruned from the cache) are there; recovery
    /// rebuilds from what is left and prunes those again by the journal.
    async fn compact_if_due(&self) {
        {
            let mut last = self.compacted.lock().unwrap_or_else(|p| p.into_inner());
            if last.elapsed() < COMPACT_EVERY {
                return;
            }
            *last = Instant::now();
        }
        let marker = match self.store.marker().await {
            Ok(marker) => marker,
            Err(error) => {
                tracing::warn!(tenant = %self.name, "compacting the state log: {error}");
                return;
            }
        };
        for (partition, &offset) in (0..).zip(&marker.offsets) {
            if let Err(error) = self.state_log.delete_below(partition, offset).await {
                tracing::warn!(tenant = %self.name, partition, "compacting the state log: {error}");
            }
        }
        self.stored.lock().unwrap_or_else(|p| p.into_inner()).0 = None;
    }

    /// Up to `limit` outputs after `position`, in order.
    pub async fn outputs_after(
        &self,
        position: u64,
        limit: usize,
    ) -> Result<Vec<PositionedOutput>, JournalError> {
        let (start, end) = self.journal.bounds(OUTPUTS).await?;
        let from = position.max(start);
        if from >= end {
            return Ok(Vec::new());
        }
        let records = self.journal.read(OUTPUTS, from, limit).await?;
        records
            .iter()
            .map(|record| {
                Ok(PositionedOutput::new(
                    record.offset + 1,
                    journal::decode_output(&self.name, record)?,
                ))
            })
            .collect()
    }

    /// Changes whenever outputs are written; holds the position of the newest.
    pub fn watch_outputs(&self) -> watch::Receiver<u64> {
        self.outputs.subscribe()
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
        let (entries, queued, running, damaged) = {
            let inner = self.lock();
            let Some(state) = inner.keys.get(&(agent.to_owned(), key.to_owned())) else {
                return Ok(None);
            };
            let queued: HashSet<u64> = state.queue.iter().map(|q| q.sequence).collect();
            let page: Vec<_> = state
                .history
                .iter()
                .filter(|entry| entry.0 > after)
                .take(limit.saturating_add(1))
                .cloned()
                .collect();
            (page, queued, state.running, state.damaged.clone())
        };
        let more = entries.len() > limit;
        let scope = KeyScope::new(&self.name, agent, key);
        let mut history = Vec::with_capacity(entries.len());
        for (sequence, accepted_at, finished_at) in entries.into_iter().take(limit) {
            let Some(InputRecord::Accepted(accepted)) =
                journal::read_one(&*self.journal, INPUTS, accepted_at).await?
            else {
                continue;
            };
            let finished = match finished_at {
                Some(offset) => match journal::read_one(&*self.journal, INPUTS, offset).await? {
                    Some(InputRecord::Finished(finished)) => Some(finished),
                    _ => None,
                },
                None => None,
            };
            let entry = match finished {
                Some(finished) => HistoryEntry {
                    sequence,
                    event_id: accepted.event_id,
                    version: accepted.version,
                    payload: accepted.payload,
                    accepted_at: accepted.accepted_at,
                    status: finished.status,
                    error: finished.error,
                    finished_at: Some(finished.finished_at),
                    outputs: finished.outputs,
                    actions: finished.actions,
                },
                None if damaged.contains_key(&accepted_at) => HistoryEntry {
                    sequence,
                    event_id: accepted.event_id,
                    version: accepted.version,
                    payload: accepted.payload,
                    accepted_at: accepted.accepted_at,
                    status: InputStatus::Failed,
                    error: damaged.get(&accepted_at).cloned(),
                    finished_at: None,
                    outputs: 0,
                    actions: Vec::new(),
                },
                None => HistoryEntry {
                    sequence,
                    event_id: accepted.event_id,
                    version: accepted.version,
                    payload: accepted.payload,
                    accepted_at: accepted.accepted_at,
                    status: if running == Some(sequence) || !queued.contains(&sequence) {
                        InputStatus::Running
                    } else {
                        InputStatus::Queued
                    },
                    error: None,
                    finished_at: None,
                    outputs: 0,
                    actions: summarize(&*self.store, &scope, sequence),
                },
            };
            history.push(entry);
        }
        Ok(Some((history, more)))
    }

    /// Inputs accepted and not finished.
    pub fn in_flight(&self) -> u64 {
        self.lock().in_flight
    }
}

/// The recorded action states of one input, as the history shows them.
fn summarize(store: &dyn ActionStateStore, scope: &KeyScope, sequence: u64) -> Vec<ActionSummary> {
    store
        .states(scope)
        .into_iter()
        .filter(|state| state.key.sequence == sequence)
        .map(|state| ActionSummary {
            action: state.key.action.clone(),
            event: state.trigger.kind.clone(),
            completed: state.is_completed(),
            calls: state
                .calls
                .iter()
                .enumerate()
                .map(|(index, call)| {
                    let (status, error) = match &call.outcome {
                        CallOutcome::Pending => ("pending", None),
                        CallOutcome::Succeeded(_) => ("succeeded", None),
                        CallOutcome::Failed(error) => ("failed", Some(text::outside_error(error))),
                    };
                    CallSummary {
                        index: u32::try_from(index).unwrap_or(u32::MAX),
                        function: call.function.clone(),
                        status: status.to_owned(),
                        error,
                    }
                })
                .collect(),
        })
        .collect()
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

/// Bytes of the files under `dir`, each file counted once however many links it has.
fn dir_size(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt as _;
    let mut seen = HashSet::new();
    let mut total = 0;
    let mut stack = vec![dir.to_owned()];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let Ok(metadata) = entry.metadata() else {
                continue;
            };
            if metadata.is_dir() {
                stack.push(entry.path());
            } else if seen.insert((metadata.dev(), metadata.ino())) {
                total += metadata.len();
            }
        }
    }
    total
}
