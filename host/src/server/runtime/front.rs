//! The tenant as a front end of the per-key core ([`crate::keys`]): the run slots its
//! inputs take (its own `concurrent-runs` and the host's instances), the version each input
//! runs on, and how what becomes of an input is recorded in the tenant's journal.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, broadcast, watch};

use super::Lifecycle;
use crate::agent::{Agent, InputError, InputReport, Memory, Waiting, WrittenIds};
use crate::event::{Delta, Deltas, OutputRecord};
use crate::keys::{Ended, Ending, Front, HostFault, Next, Queued, Refusal};
use crate::log::{Log, LogError, Offset};
use crate::server::agents::{Builder, Version, Versions};
use crate::server::config::TenantPolicy;
use crate::server::journal::{
    self, ActionSummary, CallSummary, Finished, FinishedStatus, INPUTS, InputRecord, OUTPUTS,
    Parked, Retried, WaitRecord,
};
use crate::server::quota::{PerMinute, QuotaExceeded};
use crate::server::states::States;
use crate::store::{ActionStateStore, CallOutcome, KeyScope};
use crate::text;

/// How stale the stored-bytes figure may be before the tenant's directory is walked again.
const STORED_REFRESH: Duration = Duration::from_millis(500);

/// Why nothing of a tenant whose journal failed a write runs.
pub(super) const BROKEN: &str = "this tenant's journal failed a write; its inputs run again, \
    and it takes events again, once the server is restarted";

/// A key of one of the tenant's agents. Shown as the key alone: the agent is beside it in
/// every log line and route.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AgentKey {
    pub agent: String,
    pub key: String,
}

impl AgentKey {
    pub fn new(agent: &str, key: &str) -> Self {
        Self {
            agent: agent.to_owned(),
            key: key.to_owned(),
        }
    }
}

impl fmt::Display for AgentKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.key)
    }
}

/// What the core keeps beside an input of the tenant's.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    /// The version of the agent it runs on.
    pub version: u32,
    pub event_id: String,
}

/// An accepted event, for retried submissions.
#[derive(Clone, Debug)]
pub(super) enum EventEntry {
    /// Its `accepted` record is being written.
    Reserved,
    Accepted {
        key: String,
        sequence: u64,
        version: u32,
        digest: [u8; 32],
    },
}

/// What the tenant knows of one key beside the core: where its inputs' records are.
#[derive(Debug, Default)]
pub(super) struct KeyLedger {
    /// Every input: (sequence, offset of `accepted`, offset of `finished`).
    pub history: Vec<(u64, Offset, Option<Offset>)>,
    /// Inputs found at recovery under a sequence another input already had (two processes
    /// wrote the journal at once), by the offset of their `accepted` record, with why they
    /// were not run.
    pub damaged: BTreeMap<Offset, String>,
    /// Operators' retries and answers for calls in doubt: (sequence, offset of `retried`
    /// or `resolved`), in the order they were recorded.
    pub commands: Vec<(u64, Offset)>,
    /// Serialises this key's submissions, so that sequences are accepted in order.
    pub intake: Arc<tokio::sync::Mutex<()>>,
}

impl KeyLedger {
    /// Notes that the input `sequence` finished at `offset`.
    pub fn finished(&mut self, sequence: u64, offset: Offset) {
        let damaged = &self.damaged;
        if let Some(entry) = self
            .history
            .iter_mut()
            .rev()
            .find(|e| e.0 == sequence && !damaged.contains_key(&e.1) && e.2.is_none())
        {
            entry.2 = Some(offset);
        }
    }
}

/// What the tenant keeps in memory about its events and inputs.
#[derive(Debug, Default)]
pub(super) struct Ledger {
    pub events: HashMap<(String, String), EventEntry>,
    pub keys: HashMap<AgentKey, KeyLedger>,
    /// Accepted and not finished.
    pub in_flight: u64,
    /// Outputs found in the journal for inputs that had not finished when the server
    /// stopped. Their rerun does not write them again.
    pub written: WrittenIds,
}

/// The tenant: what its inputs run with, and where what they did is recorded.
#[derive(Debug)]
pub(super) struct Tenant {
    pub name: String,
    pub dir: PathBuf,
    pub policy: TenantPolicy,
    pub journal: Arc<dyn Log>,
    /// Each agent's state log and store.
    pub states: Arc<States>,
    /// The journal failed a write: nothing more is accepted or started until a restart.
    pub broken: AtomicBool,
    pub budget: Arc<PerMinute>,
    pub builder: Builder,
    /// The tenant's `concurrent-runs`.
    pub runs: Arc<Semaphore>,
    /// Per agent, its current version's `parallelism`: (that version, its slots).
    pub agent_runs: Mutex<HashMap<String, (u32, Arc<Semaphore>)>>,
    /// The host's sandbox instances, shared by every tenant.
    pub host_runs: Arc<Semaphore>,
    /// Leaves for runs away between a call's attempts: the rest of the host's pool.
    pub host_away: Arc<Semaphore>,
    pub lifecycle: Arc<Lifecycle>,
    pub agents: RwLock<BTreeMap<String, Versions>>,
    pub ledger: Mutex<Ledger>,
    /// The position of the newest output.
    pub outputs: watch::Sender<u64>,
    /// The pieces of streamed answers, to whoever follows the outputs.
    pub deltas: Arc<Broadcast>,
    pub stored: Mutex<(Option<Instant>, u64)>,
    /// Where the journal's snapshot stands (the inputs partition's offset it was folded to).
    pub snapshot_at: AtomicU64,
}

/// Deltas a follower of the outputs may fall behind by before it loses some.
pub(super) const DELTAS_BEHIND: usize = 1024;

/// The tenant's deltas, sent to every follower of its outputs (none kept: a follower that
/// falls [`DELTAS_BEHIND`] behind loses the oldest).
#[derive(Debug)]
pub(super) struct Broadcast(pub broadcast::Sender<Delta>);

impl Deltas for Broadcast {
    fn send(&self, delta: Delta) {
        let _ = self.0.send(delta);
    }
}

/// What an input holds while it runs: a slot of the tenant's and one of the host's, and
/// its place among the inputs a stopping server waits for.
pub struct RunSlot {
    _agent: Option<OwnedSemaphorePermit>,
    _tenant: OwnedSemaphorePermit,
    _host: OwnedSemaphorePermit,
    lifecycle: Arc<Lifecycle>,
}

impl Drop for RunSlot {
    fn drop(&mut self) {
        self.lifecycle.finished();
    }
}

/// A run away between a call's attempts, among those a stopping server waits for.
struct Running(Arc<Lifecycle>);

impl Drop for Running {
    fn drop(&mut self) {
        self.0.finished();
    }
}

impl Tenant {
    pub fn ledger(&self) -> MutexGuard<'_, Ledger> {
        self.ledger.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn is_broken(&self) -> bool {
        self.broken.load(Ordering::SeqCst)
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

    /// Counts `bytes` written now, before the next walk sees them.
    pub fn note_stored(&self, bytes: u64) {
        let mut stored = self.stored.lock().unwrap_or_else(|p| p.into_inner());
        stored.1 = stored.1.saturating_add(bytes);
    }

    /// The agent's newest version.
    pub fn current_version(&self, agent: &str) -> Option<u32> {
        self.agents
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(agent)
            .and_then(Versions::current)
    }

    /// The slots of `agent`'s runs, as many as its current version's `parallelism` (made
    /// again when a newer version is current; runs holding the older slots finish on
    /// them). `None` when it has no version that loads: its inputs stop at `agent()`.
    async fn agent_runs(&self, agent: &str) -> Option<Arc<Semaphore>> {
        let current = self.current_version(agent)?;
        if let Some((version, runs)) = self
            .agent_runs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(agent)
            && *version == current
        {
            return Some(Arc::clone(runs));
        }
        let parallelism = self.agent_version(agent, current).await.ok()?.parallelism();
        let runs = Arc::new(Semaphore::new(parallelism.max(1)));
        let mut all = self.agent_runs.lock().unwrap_or_else(|p| p.into_inner());
        let (_, runs) = all
            .entry(agent.to_owned())
            .and_modify(|entry| {
                if entry.0 < current {
                    *entry = (current, Arc::clone(&runs));
                }
            })
            .or_insert((current, runs));
        Some(Arc::clone(runs))
    }

    /// The agent of `version`: loaded, or built from disk when it was let go.
    pub async fn agent_version(&self, agent: &str, version: u32) -> Result<Arc<Agent>, String> {
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
                let built =
                    tokio::task::spawn_blocking(move || builder.load(&dir, &agent, version))
                        .await
                        .map_err(|e| format!("loading version {version} failed: {e}"))??;
                built.state.ready().await.map_err(|error| {
                    format!("recovering the recorded calls of version {version}: {error}")
                })?;
                Ok(built.agent)
            }
            None => Err(format!("agent {agent} has no version {version}")),
        }
    }

    /// Appends `records` to the journal, all or (as far as this process can tell) none. A
    /// failed write is not retried: it may have reached the log, and writing again could
    /// double it. The tenant stops until a restart reads what the journal holds.
    async fn append(
        &self,
        key: &AgentKey,
        sequence: u64,
        what: &str,
        records: Vec<(u32, Vec<u8>)>,
    ) -> Result<Vec<Offset>, HostFault> {
        let bytes = records.iter().map(|(_, r)| r.len() as u64).sum();
        match self.journal.append_many(records).await {
            Ok(offsets) => {
                self.note_stored(bytes);
                Ok(offsets)
            }
            Err(error) => Err(self.journal_failed(key, sequence, what, error)),
        }
    }

    /// Appends one record of the inputs partition; its offset.
    pub(super) async fn append_input(
        &self,
        key: &AgentKey,
        sequence: u64,
        what: &str,
        record: Vec<u8>,
    ) -> Result<Offset, HostFault> {
        let offsets = self
            .append(key, sequence, what, vec![(INPUTS, record)])
            .await?;
        Ok(offsets.last().copied().unwrap_or_default())
    }

    /// The journal did not take a record: no input of the tenant starts and no event is
    /// accepted until a restart, which reads back what the journal holds.
    fn journal_failed(
        &self,
        key: &AgentKey,
        sequence: u64,
        what: &str,
        error: LogError,
    ) -> HostFault {
        self.broken.store(true, Ordering::SeqCst);
        let fault = HostFault::new(format!("the journal did not take {what}"), error);
        if !self.lifecycle.stopping() {
            tracing::error!(tenant = %self.name, agent = %key.agent, key = %key.key, sequence,
                "{fault}; the tenant stops until a restart");
        }
        fault
    }

    /// The input `sequence` of `key` finished at `offset`: its recorded states go, and the
    /// tenant's counts follow. When its agent's `[state]` cadence says so, the agent's state
    /// log is compacted: its segments below the store's marker go (only states of finished
    /// inputs, pruned from the cache, are there; recovery rebuilds from what is left and
    /// prunes those again by the journal).
    async fn finished(&self, key: &AgentKey, sequence: u64, offset: Offset) {
        if let Some(state) = self.states.get(&key.agent) {
            let scope = KeyScope::new(&self.name, &key.agent, &key.key);
            if let Err(error) = state.store.prune(&scope, sequence).await {
                tracing::warn!(tenant = %self.name, agent = %key.agent, key = %key.key, sequence,
                    "pruning the input's states: {error}");
            }
            if state.finished_one() {
                if let Err(error) = state.compact().await {
                    tracing::warn!(tenant = %self.name, agent = %key.agent,
                        "compacting the state log: {error}");
                }
                self.stored.lock().unwrap_or_else(|p| p.into_inner()).0 = None;
            }
        }
        let mut ledger = self.ledger();
        ledger.in_flight = ledger.in_flight.saturating_sub(1);
        ledger
            .written
            .forget_input(&self.name, &key.agent, &key.key, sequence);
        if let Some(state) = ledger.keys.get_mut(key) {
            state.finished(sequence, offset);
        }
    }

    /// An operator's command on the input `sequence` of `key` is recorded at `offset`.
    pub(super) fn commanded(&self, key: &AgentKey, sequence: u64, offset: Offset) {
        if let Some(state) = self.ledger().keys.get_mut(key) {
            state.commands.push((sequence, offset));
        }
    }

    /// The `finished` record of `queued` with `status`, what its actions did, and the key's
    /// `memory` after it; no outputs.
    fn finished_record(
        &self,
        key: &AgentKey,
        queued: &Queued<Entry>,
        status: FinishedStatus,
        memory: &Memory,
    ) -> Finished {
        let sequence = queued.input.sequence;
        let scope = KeyScope::new(&self.name, &key.agent, &key.key);
        Finished {
            agent: key.agent.clone(),
            key: key.key.clone(),
            sequence,
            event_id: Some(queued.extra.event_id.clone()),
            status,
            version: Some(queued.extra.version),
            error: None,
            by: None,
            reason: None,
            outputs: 0,
            actions: summarize(&self.states, &scope, sequence),
            memory: (**memory).clone(),
            finished_at: journal::now_ms(),
        }
    }

    /// A `finished` record that fits in one journal record: call errors go, then the call
    /// summaries, before it is refused (what is left, the memory, is the key's own).
    fn fit(&self, finished: &mut Finished) -> Result<Vec<u8>, String> {
        let max = self.journal.max_record(INPUTS);
        let mut encoded = finished.encode();
        if encoded.len() > max {
            for call in finished.actions.iter_mut().flat_map(|a| a.calls.iter_mut()) {
                call.error = None;
            }
            encoded = finished.encode();
        }
        if encoded.len() > max {
            finished.actions.clear();
            encoded = finished.encode();
        }
        if encoded.len() > max {
            return Err(format!(
                "its memory makes a finished record of {} bytes, more than the {max} the \
                 tenant's journal takes in one record",
                encoded.len()
            ));
        }
        Ok(encoded)
    }
}

#[async_trait]
impl Front for Tenant {
    type Key = AgentKey;
    type Extra = Entry;
    type Slot = RunSlot;

    /// From the host's pool of runs away, while the server is not stopping; the leave
    /// counts as running, so that a stopping server waits for the run as it would have.
    fn leave(&self) -> Option<Box<dyn Send>> {
        if self.lifecycle.stopping() {
            return None;
        }
        let permit = Arc::clone(&self.host_away).try_acquire_owned().ok()?;
        self.lifecycle.started();
        let running = Running(Arc::clone(&self.lifecycle));
        Some(Box::new((permit, running)))
    }

    /// Only while someone follows the outputs: otherwise a delta would go nowhere.
    fn deltas(&self) -> Option<Arc<dyn Deltas>> {
        (self.deltas.0.receiver_count() > 0).then(|| Arc::clone(&self.deltas) as Arc<dyn Deltas>)
    }

    async fn slot(&self, key: &AgentKey) -> Option<RunSlot> {
        if self.lifecycle.stopping() {
            return None;
        }
        // The agent's `parallelism` first, then the tenant's `concurrent-runs` (which the
        // agent's may not pass), then the host's instances.
        let agent = match self.agent_runs(&key.agent).await {
            Some(runs) => Some(runs.acquire_owned().await.ok()?),
            None => None,
        };
        let tenant = Arc::clone(&self.runs).acquire_owned().await.ok()?;
        let host = Arc::clone(&self.host_runs).acquire_owned().await.ok()?;
        if self.lifecycle.stopping() {
            return None;
        }
        self.lifecycle.started();
        Some(RunSlot {
            _agent: agent,
            _tenant: tenant,
            _host: host,
            lifecycle: Arc::clone(&self.lifecycle),
        })
    }

    async fn agent(&self, key: &AgentKey, queued: &Queued<Entry>) -> Result<Arc<Agent>, HostFault> {
        if self.is_broken() {
            return Err(HostFault::new("the tenant stopped", BROKEN));
        }
        // Not failed: the operator can fix what the version needs (a secret, a host) and
        // restart; its recorded calls wait for it.
        let version = queued.extra.version;
        self.agent_version(&key.agent, version)
            .await
            .map_err(|error| {
                HostFault::new(format!("loading version {version} of {}", key.agent), error)
            })
    }

    /// Writes the input's outputs (those an earlier run did not), then its `finished`
    /// record: outputs are durable before the record that says the input finished, so that
    /// one never stands without its outputs.
    async fn completed(
        &self,
        key: &AgentKey,
        queued: &Queued<Entry>,
        report: InputReport,
    ) -> Result<(), Refusal> {
        let sequence = queued.input.sequence;
        let refused = |message: String| {
            Refusal::Failed(InputError::Refused {
                key: key.key.clone(),
                sequence,
                message,
            })
        };
        // What the run produced counts toward `stored-bytes`: over it, the input fails
        // naming the quota.
        let produced: usize = report
            .outputs
            .iter()
            .map(|o| o.payload.len())
            .sum::<usize>()
            + report
                .memory
                .iter()
                .map(|(k, v)| k.len() + v.len())
                .sum::<usize>();
        self.check_storage(produced as u64)
            .map_err(|quota| refused(quota.to_string()))?;
        let max_output = self.journal.max_record(OUTPUTS);
        let mut records = Vec::with_capacity(report.outputs.len() + 1);
        {
            let ledger = self.ledger();
            for output in &report.outputs {
                if ledger.written.contains(&output.id) {
                    continue;
                }
                let record = OutputRecord::new(output, Some(queued.extra.event_id.clone()));
                let record = record.encode();
                if record.len() > max_output {
                    return Err(refused(format!(
                        "one of its outputs makes a record of {} bytes, more than the \
                         {max_output} the tenant's journal takes in one record",
                        record.len()
                    )));
                }
                records.push((OUTPUTS, record));
            }
        }
        let mut finished = self.finished_record(key, queued, FinishedStatus::Done, &report.memory);
        finished.outputs = u32::try_from(report.outputs.len()).unwrap_or(u32::MAX);
        let encoded = self.fit(&mut finished).map_err(refused)?;
        // Two writes: outputs durable before the record that says the input finished.
        let outputs = if records.is_empty() {
            Vec::new()
        } else {
            self.append(key, sequence, "the input's outputs", records)
                .await
                .map_err(Refusal::Fault)?
        };
        let finished_at = self
            .append_input(key, sequence, "the input's end", encoded)
            .await
            .map_err(Refusal::Fault)?;
        self.finished(key, sequence, finished_at).await;
        if let Some(last) = outputs.last() {
            self.outputs.send_modify(|end| *end = (*end).max(last + 1));
        }
        Ok(())
    }

    async fn failed(
        &self,
        key: &AgentKey,
        queued: &Queued<Entry>,
        _report: InputReport,
        error: InputError,
        next: Next,
    ) {
        let Next::Parked { attempts } = next else {
            return;
        };
        // Durable, so that a restart keeps it parked rather than running it again.
        let sequence = queued.input.sequence;
        let parked = InputRecord::Parked(Parked {
            agent: key.agent.clone(),
            key: key.key.clone(),
            sequence,
            event_id: queued.extra.event_id.clone(),
            attempts,
            error: text::outside_error(&error.to_string()),
            parked_at: journal::now_ms(),
        });
        // On failure the tenant stops (logged); the input is parked until the restart,
        // which runs it again.
        let _ = self
            .append_input(key, sequence, "the input's parking", parked.encode())
            .await;
    }

    async fn stopped(&self, _: &AgentKey, _: &Queued<Entry>, _: &HostFault) {}

    /// In the journal, so that a restart arms the wait again rather than running the input
    /// (a record lost to a crash only costs a replay to the same wait).
    async fn waiting(
        &self,
        key: &AgentKey,
        queued: &Queued<Entry>,
        wait: Option<&Waiting>,
        _: InputReport,
    ) {
        let sequence = queued.input.sequence;
        let record = InputRecord::Waiting(WaitRecord {
            agent: key.agent.clone(),
            key: key.key.clone(),
            sequence,
            event_id: queued.extra.event_id.clone(),
            wait: wait.cloned(),
            at: journal::now_ms(),
        });
        let what = if wait.is_some() {
            "the input's wait"
        } else {
            "the end of the input's wait"
        };
        // On failure the tenant stops (logged), as for a park.
        let _ = self
            .append_input(key, sequence, what, record.encode())
            .await;
    }

    async fn ended(
        &self,
        key: &AgentKey,
        queued: &Queued<Entry>,
        memory: &Memory,
        ending: Ending<'_>,
    ) -> Result<(), HostFault> {
        let sequence = queued.input.sequence;
        let (status, what) = match ending.ended {
            Ended::Skipped => (FinishedStatus::Skipped, "the input's skip"),
            Ended::Cancelled => (FinishedStatus::Cancelled, "the input's cancel"),
        };
        let mut finished = self.finished_record(key, queued, status, memory);
        finished.by = Some(ending.by.to_owned());
        finished.reason = Some(ending.why.to_owned()).filter(|why| !why.is_empty());
        let encoded = self
            .fit(&mut finished)
            .map_err(|error| HostFault::new(format!("writing {what}"), error))?;
        let offset = self.append_input(key, sequence, what, encoded).await?;
        self.finished(key, sequence, offset).await;
        Ok(())
    }

    async fn retried(
        &self,
        key: &AgentKey,
        queued: &Queued<Entry>,
        by: &str,
    ) -> Result<(), HostFault> {
        let sequence = queued.input.sequence;
        let retried = InputRecord::Retried(Retried {
            agent: key.agent.clone(),
            key: key.key.clone(),
            sequence,
            event_id: queued.extra.event_id.clone(),
            version: queued.extra.version,
            by: by.to_owned(),
            retried_at: journal::now_ms(),
        });
        let offset = self
            .append_input(key, sequence, "the input's retry", retried.encode())
            .await?;
        self.commanded(key, sequence, offset);
        Ok(())
    }
}

/// The recorded action states of one input, as the history shows them.
pub(super) fn summarize(states: &States, scope: &KeyScope, sequence: u64) -> Vec<ActionSummary> {
    let Some(state) = states.get(&scope.agent) else {
        return Vec::new();
    };
    state
        .store
        .states(scope)
        .into_iter()
        // An input's signal inbox is not an action's run.
        .filter(|state| state.key.sequence == sequence && !state.key.is_signals())
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
                        CallOutcome::Waiting(_) => ("waiting", None),
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
