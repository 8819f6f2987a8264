//! A tenant's journal folded, record by record, into what a restart rebuilds (its event ids,
//! each key's next sequence, memory and history, the inputs not finished), and the snapshot
//! of that fold: `DIR/snapshot.json`, at a journal position. A restart loads the snapshot and
//! folds only the records after it, so it does not read the whole journal again.
//!
//! The snapshot is made from the journal, not from the running tenant: folding the records
//! up to a position gives the state at that position by construction, whatever runs
//! meanwhile. Outputs are folded up to an end read before the inputs' end: an output is
//! appended after its input's `accepted` record, so the fold knows every input whose
//! outputs it meets (those of inputs finished by then are dropped, the others kept for the
//! restart not to write them again).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::front::{AgentKey, Entry, EventEntry, KeyLedger, Tenant};
use crate::event::Input;
use crate::keys::Queued;
use crate::log::{Log, Offset};
use crate::private;
use crate::server::journal::{self, INPUTS, InputRecord, JournalError, OUTPUTS, OutputPlace};
use crate::store::Waiting;
use crate::version::{self, FormatError, Versioned};

/// The format of `snapshot.json` this build writes, and the newest it reads.
const FORMAT: u32 = 1;
const FILE: &str = "snapshot.json";

/// Per key: where it stands after the records folded.
#[derive(Debug, Default)]
pub(super) struct FoldedKey {
    /// The sequence its next input gets.
    pub next: u64,
    /// Its memory after its last finished input.
    pub memory: BTreeMap<String, String>,
    pub last_finished: Option<u64>,
    pub ledger: KeyLedger,
}

/// The journal folded up to `inputs_next` (of its inputs partition) and `outputs_next` (of
/// its outputs).
#[derive(Debug, Default)]
pub(super) struct Folded {
    pub inputs_next: Offset,
    pub outputs_next: Offset,
    pub events: HashMap<(String, String), EventEntry>,
    pub keys: HashMap<AgentKey, FoldedKey>,
    pub pending: BTreeMap<(AgentKey, u64), Queued<Entry>>,
    pub parked: HashMap<(AgentKey, u64), (u32, String)>,
    /// Inputs at a durable wait, with it.
    pub waiting: HashMap<(AgentKey, u64), Waiting>,
    /// Of inputs accepted under a sequence already handed out: (agent, event id).
    pub damaged_events: HashSet<(String, String)>,
    /// The outputs written by inputs not finished, by input: their indexes.
    pub written: BTreeMap<(AgentKey, u64), Vec<u32>>,
}

impl Folded {
    /// Folds every record after where it stands: the inputs partition to its end, then the
    /// outputs partition to its end as read before that. Returns how many records it read.
    pub async fn advance(&mut self, log: &dyn Log, tenant: &str) -> Result<u64, JournalError> {
        let mut read = 0;
        // The outputs' end first: every output below it is of an input accepted below the
        // inputs' end read next, so the fold knows the input when it meets the output.
        let (_, outputs_end) = log.bounds(OUTPUTS).await?;
        let (_, end) = log.bounds(INPUTS).await?;
        journal::scan_from::<InputRecord>(log, INPUTS, self.inputs_next, end, |offset, record| {
            read += 1;
            self.input(offset, record, tenant);
        })
        .await?;
        self.inputs_next = self.inputs_next.max(end);
        let end = outputs_end;
        journal::scan_from::<OutputPlace>(log, OUTPUTS, self.outputs_next, end, |_, output| {
            read += 1;
            self.output(output);
        })
        .await?;
        self.outputs_next = self.outputs_next.max(end);
        Ok(read)
    }

    fn input(&mut self, offset: Offset, record: InputRecord, tenant: &str) {
        match record {
            InputRecord::Accepted(accepted) => {
                let key = AgentKey::new(&accepted.agent, &accepted.key);
                let state = self.keys.entry(key.clone()).or_insert_with(|| FoldedKey {
                    next: 1,
                    ..FoldedKey::default()
                });
                let entry = EventEntry::Accepted {
                    key: accepted.key.clone(),
                    sequence: accepted.sequence,
                    version: accepted.version,
                    digest: super::digest(&accepted.key, &accepted.payload),
                };
                state.ledger.history.push((accepted.sequence, offset, None));
                if accepted.sequence < state.next {
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
                    tracing::warn!(tenant, agent = %accepted.agent, key = %accepted.key,
                        sequence = accepted.sequence, event_id = %accepted.event_id,
                        "journal damaged: {why}");
                    state.ledger.damaged.insert(offset, why);
                    self.damaged_events
                        .insert((accepted.agent.clone(), accepted.event_id.clone()));
                    self.events
                        .entry((accepted.agent, accepted.event_id))
                        .or_insert(entry);
                    return;
                }
                state.next = accepted.sequence + 1;
                self.events
                    .insert((accepted.agent, accepted.event_id.clone()), entry);
                let input = Input {
                    key: accepted.key,
                    sequence: accepted.sequence,
                    payload: accepted.payload.get().to_owned(),
                };
                let extra = Entry {
                    version: accepted.version,
                    event_id: accepted.event_id,
                };
                self.pending
                    .insert((key, accepted.sequence), Queued { input, extra });
            }
            InputRecord::Finished(finished) => {
                // The other process's input, which it ran: nothing of this one's.
                if let Some(event_id) = &finished.event_id
                    && !self.damaged_events.is_empty()
                    && self
                        .damaged_events
                        .contains(&(finished.agent.clone(), event_id.clone()))
                {
                    return;
                }
                let key = AgentKey::new(&finished.agent, &finished.key);
                let state = self.keys.entry(key.clone()).or_insert_with(|| FoldedKey {
                    next: 1,
                    ..FoldedKey::default()
                });
                state.memory = finished.memory;
                // The first `finished` of a sequence is its input's; one more (written by a
                // second process, for an input it accepted under the same sequence) is not.
                // A record that names its event is told apart above; one of an earlier
                // build is taken for the first input's.
                state.ledger.finished(finished.sequence, offset);
                state.last_finished = Some(finished.sequence);
                let input = (key, finished.sequence);
                self.parked.remove(&input);
                self.waiting.remove(&input);
                self.written.remove(&input);
                self.pending.remove(&input);
            }
            InputRecord::Parked(record) => {
                let key = AgentKey::new(&record.agent, &record.key);
                self.parked
                    .insert((key, record.sequence), (record.attempts, record.error));
            }
            InputRecord::Waiting(record) => {
                let input = (AgentKey::new(&record.agent, &record.key), record.sequence);
                match record.wait {
                    Some(wait) if self.pending.contains_key(&input) => {
                        self.waiting.insert(input, wait);
                    }
                    _ => {
                        self.waiting.remove(&input);
                    }
                }
            }
            InputRecord::Resolved(record) => {
                let key = AgentKey::new(&record.agent, &record.key);
                if let Some(state) = self.keys.get_mut(&key) {
                    state.ledger.commands.push((record.sequence, offset));
                }
            }
            InputRecord::Retried(record) => {
                let key = AgentKey::new(&record.agent, &record.key);
                if let Some(state) = self.keys.get_mut(&key) {
                    state.ledger.commands.push((record.sequence, offset));
                }
                let input = (key, record.sequence);
                self.parked.remove(&input);
                self.waiting.remove(&input);
                if let Some(queued) = self.pending.get_mut(&input) {
                    queued.extra.version = record.version;
                }
            }
        }
    }

    fn output(&mut self, output: OutputPlace) {
        let input = (AgentKey::new(&output.agent, &output.key), output.sequence);
        if self.pending.contains_key(&input) {
            self.written.entry(input).or_default().push(output.index);
        }
    }
}

/// How often the snapshot is brought forward, when the journal has moved on by at least
/// [`SNAPSHOT_RECORDS`] input records since it.
const SNAPSHOT_EVERY: Duration = Duration::from_secs(30);
const SNAPSHOT_RECORDS: Offset = 10_000;

/// The task that keeps a tenant's snapshot near its journal's end, so that a restart reads
/// at most about [`SNAPSHOT_RECORDS`] input records more than the snapshot (or what came in
/// the last [`SNAPSHOT_EVERY`]). Stopped when dropped; a snapshot being written is
/// finished first (it is written whole, on a thread of its own).
#[derive(Debug)]
pub(super) struct Snapshots(tokio::task::JoinHandle<()>);

impl Snapshots {
    pub fn start(tenant: Arc<Tenant>) -> Self {
        Self(tokio::spawn(async move {
            loop {
                tokio::time::sleep(SNAPSHOT_EVERY).await;
                if let Err(error) = bring_forward(&tenant).await {
                    tracing::warn!(tenant = %tenant.name, "the journal's snapshot was not \
                        brought forward (a restart reads more of the journal): {error}");
                }
            }
        }))
    }
}

impl Drop for Snapshots {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Folds the journal into the tenant's snapshot, when it has moved on far enough.
async fn bring_forward(tenant: &Tenant) -> Result<(), SnapshotError> {
    let (_, end) = tenant
        .journal
        .bounds(INPUTS)
        .await
        .map_err(|e| SnapshotError::Journal(e.into()))?;
    // Known without reading the snapshot, which may be tens of MB.
    if end.saturating_sub(tenant.snapshot_at.load(Ordering::Acquire)) < SNAPSHOT_RECORDS {
        return Ok(());
    }
    let dir = tenant.dir.clone();
    let loaded = tokio::task::spawn_blocking(move || load(&dir))
        .await
        .map_err(|e| SnapshotError::Io {
            path: FILE.to_owned(),
            source: std::io::Error::other(e),
        })??;
    let mut folded = loaded.unwrap_or_default();
    folded.advance(&*tenant.journal, &tenant.name).await?;
    let (dir, at) = (tenant.dir.clone(), folded.inputs_next);
    tokio::task::spawn_blocking(move || save(&dir, &folded))
        .await
        .map_err(|e| SnapshotError::Io {
            path: FILE.to_owned(),
            source: std::io::Error::other(e),
        })??;
    tenant.snapshot_at.store(at, Ordering::Release);
    Ok(())
}

/// Where the snapshot of the tenant in `dir` is kept.
fn path(dir: &Path) -> PathBuf {
    dir.join(FILE)
}

/// Why a snapshot was not read or written.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Format(#[from] FormatError),
    #[error("reading the journal: {0}")]
    Journal(#[from] JournalError),
}

/// The tenant's snapshot, if it has one.
pub(super) fn load(dir: &Path) -> Result<Option<Folded>, SnapshotError> {
    let path = path(dir);
    let bytes = match std::fs::read(&path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(SnapshotError::Io {
                path: path.display().to_string(),
                source,
            });
        }
    };
    let stored: Stored = version::decode(&bytes, FORMAT, &path.display().to_string())?;
    Ok(Some(stored.into()))
}

/// Writes `folded` as the tenant's snapshot, whole (a crash leaves the previous one).
pub(super) fn save(dir: &Path, folded: &Folded) -> Result<(), SnapshotError> {
    let path = path(dir);
    let io = |source| SnapshotError::Io {
        path: path.display().to_string(),
        source,
    };
    let stored = Stored::from(folded);
    let bytes = serde_json::to_vec(&Versioned {
        format: FORMAT,
        value: &stored,
    })
    .map_err(|e| io(std::io::Error::other(e)))?;
    private::write(&path, &bytes).map_err(io)
}

/// The snapshot as it is written: lists, where the fold has maps keyed by tuples.
#[derive(Serialize, Deserialize)]
struct Stored {
    inputs_next: Offset,
    outputs_next: Offset,
    /// (agent, event id, key, sequence, version, digest in hex).
    events: Vec<(String, String, String, u64, u32, String)>,
    keys: Vec<StoredKey>,
    pending: Vec<StoredInput>,
    /// (agent, key, sequence, attempts, error).
    parked: Vec<(String, String, u64, u32, String)>,
    /// (agent, key, sequence, wait); absent in snapshots of builds before waits.
    #[serde(default)]
    waiting: Vec<(String, String, u64, Waiting)>,
    damaged_events: Vec<(String, String)>,
    /// (agent, key, sequence, output indexes).
    written: Vec<(String, String, u64, Vec<u32>)>,
}

#[derive(Serialize, Deserialize)]
struct StoredKey {
    agent: String,
    key: String,
    next: u64,
    memory: BTreeMap<String, String>,
    last_finished: Option<u64>,
    /// (sequence, offset of `accepted`, offset of `finished`).
    history: Vec<(u64, Offset, Option<Offset>)>,
    damaged: Vec<(Offset, String)>,
    commands: Vec<(u64, Offset)>,
}

#[derive(Serialize, Deserialize)]
struct StoredInput {
    agent: String,
    key: String,
    sequence: u64,
    payload: String,
    version: u32,
    event_id: String,
}

impl From<&Folded> for Stored {
    fn from(folded: &Folded) -> Self {
        let mut events: Vec<_> = folded
            .events
            .iter()
            .filter_map(|((agent, id), entry)| match entry {
                EventEntry::Accepted {
                    key,
                    sequence,
                    version,
                    digest,
                } => Some((
                    agent.clone(),
                    id.clone(),
                    key.clone(),
                    *sequence,
                    *version,
                    hex::encode(digest),
                )),
                EventEntry::Reserved => None,
            })
            .collect();
        events.sort();
        let mut keys: Vec<_> = folded
            .keys
            .iter()
            .map(|(id, state)| StoredKey {
                agent: id.agent.clone(),
                key: id.key.clone(),
                next: state.next,
                memory: state.memory.clone(),
                last_finished: state.last_finished,
                history: state.ledger.history.clone(),
                damaged: state
                    .ledger
                    .damaged
                    .iter()
                    .map(|(o, why)| (*o, why.clone()))
                    .collect(),
                commands: state.ledger.commands.clone(),
            })
            .collect();
        keys.sort_by(|a, b| (&a.agent, &a.key).cmp(&(&b.agent, &b.key)));
        let mut parked: Vec<_> = folded
            .parked
            .iter()
            .map(|((id, sequence), (attempts, error))| {
                (
                    id.agent.clone(),
                    id.key.clone(),
                    *sequence,
                    *attempts,
                    error.clone(),
                )
            })
            .collect();
        parked.sort();
        let mut waiting: Vec<_> = (folded.waiting.iter())
            .map(|((id, sequence), wait)| {
                (id.agent.clone(), id.key.clone(), *sequence, wait.clone())
            })
            .collect();
        waiting.sort_by(|a, b| (&a.0, &a.1, a.2).cmp(&(&b.0, &b.1, b.2)));
        let mut damaged_events: Vec<_> = folded.damaged_events.iter().cloned().collect();
        damaged_events.sort();
        Self {
            inputs_next: folded.inputs_next,
            outputs_next: folded.outputs_next,
            events,
            keys,
            pending: folded
                .pending
                .iter()
                .map(|((id, sequence), queued)| StoredInput {
                    agent: id.agent.clone(),
                    key: id.key.clone(),
                    sequence: *sequence,
                    payload: queued.input.payload.clone(),
                    version: queued.extra.version,
                    event_id: queued.extra.event_id.clone(),
                })
                .collect(),
            parked,
            waiting,
            damaged_events,
            written: folded
                .written
                .iter()
                .map(|((id, sequence), indexes)| {
                    (id.agent.clone(), id.key.clone(), *sequence, indexes.clone())
                })
                .collect(),
        }
    }
}

impl From<Stored> for Folded {
    fn from(stored: Stored) -> Self {
        let events = stored
            .events
            .into_iter()
            .map(|(agent, id, key, sequence, version, digest)| {
                let mut bytes = [0u8; 32];
                // A digest that does not decode matches no payload: a repeat of that event
                // is then refused as an id reused, never run twice.
                let _ = hex::decode_to_slice(&digest, &mut bytes);
                let entry = EventEntry::Accepted {
                    key,
                    sequence,
                    version,
                    digest: bytes,
                };
                ((agent, id), entry)
            })
            .collect();
        let keys = stored
            .keys
            .into_iter()
            .map(|stored| {
                let state = FoldedKey {
                    next: stored.next,
                    memory: stored.memory,
                    last_finished: stored.last_finished,
                    ledger: KeyLedger {
                        history: stored.history,
                        damaged: stored.damaged.into_iter().collect(),
                        commands: stored.commands,
                        ..KeyLedger::default()
                    },
                };
                (AgentKey::new(&stored.agent, &stored.key), state)
            })
            .collect();
        Self {
            inputs_next: stored.inputs_next,
            outputs_next: stored.outputs_next,
            events,
            keys,
            pending: stored
                .pending
                .into_iter()
                .map(|input| {
                    let id = AgentKey::new(&input.agent, &input.key);
                    let queued = Queued {
                        input: Input {
                            key: input.key,
                            sequence: input.sequence,
                            payload: input.payload,
                        },
                        extra: Entry {
                            version: input.version,
                            event_id: input.event_id,
                        },
                    };
                    ((id, input.sequence), queued)
                })
                .collect(),
            parked: stored
                .parked
                .into_iter()
                .map(|(agent, key, sequence, attempts, error)| {
                    ((AgentKey::new(&agent, &key), sequence), (attempts, error))
                })
                .collect(),
            waiting: (stored.waiting.into_iter())
                .map(|(agent, key, sequence, wait)| ((AgentKey::new(&agent, &key), sequence), wait))
                .collect(),
            damaged_events: stored.damaged_events.into_iter().collect(),
            written: stored
                .written
                .into_iter()
                .map(|(agent, key, sequence, indexes)| {
                    ((AgentKey::new(&agent, &key), sequence), indexes)
                })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(json: serde_json::Value) -> InputRecord {
        serde_json::from_value(json).expect("a journal record")
    }

    #[test]
    fn a_saved_snapshot_loads_as_the_fold_it_was_made_from() {
        let mut folded = Folded::default();
        let accepted = |sequence: u64, id: &str, key: &str| {
            record(serde_json::json!({ "accepted": {
                "agent": "bot", "event_id": id, "key": key, "sequence": sequence,
                "version": 1, "payload": { "n": sequence }, "accepted_at": 1,
            } }))
        };
        folded.input(0, accepted(1, "e1", "k"), "acme");
        folded.input(1, accepted(2, "e2", "k"), "acme");
        folded.input(2, accepted(1, "p1", "p"), "acme");
        folded.input(
            3,
            record(serde_json::json!({ "finished": {
                "agent": "bot", "key": "k", "sequence": 1, "event_id": "e1", "status": "done",
                "outputs": 1, "actions": [], "memory": { "count": "1" }, "finished_at": 2,
            } })),
            "acme",
        );
        folded.input(
            4,
            record(serde_json::json!({ "parked": {
                "agent": "bot", "key": "p", "sequence": 1, "event_id": "p1",
                "attempts": 3, "error": "never works", "parked_at": 3,
            } })),
            "acme",
        );
        folded.output(OutputPlace {
            agent: "bot".to_owned(),
            key: "k".to_owned(),
            sequence: 2,
            index: 0,
        });
        folded.inputs_next = 5;
        folded.outputs_next = 2;

        let dir = tempfile::tempdir().expect("tempdir");
        save(dir.path(), &folded).expect("saved");
        let loaded = load(dir.path()).expect("read").expect("a snapshot");
        let as_json = |f: &Folded| serde_json::to_value(Stored::from(f)).expect("json");
        assert_eq!(as_json(&loaded), as_json(&folded));
        assert_eq!(loaded.pending.len(), 2, "k #2 and the parked p #1");
        assert_eq!(loaded.keys[&AgentKey::new("bot", "k")].next, 3);
        assert_eq!(loaded.keys[&AgentKey::new("bot", "k")].memory["count"], "1");
        assert_eq!(loaded.written.len(), 1, "k #2's output, not yet finished");

        std::fs::write(dir.path().join(FILE), br#"{"format": 2}"#).expect("write");
        let error = load(dir.path()).expect_err("a newer format").to_string();
        assert!(error.contains("is format 2"), "{error}");
    }
}
