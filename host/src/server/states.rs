//! Each agent's state under a tenant: its own state log and store, as the agent's `[state]`
//! says (partitions, marker, refresh batch, and how often its log is compacted).
//!
//! ```text
//! TENANT/states/AGENT/   an agent's state log (partitions fixed when it is created)
//! TENANT/state/          the one state log of a tenant written by releases before states
//!                        were per agent: the agents defined then keep using it
//! ```
//!
//! A state's partitions and marker are fixed for the agent's life on the server: a version
//! that asks for others is refused when it is defined (and, loaded from disk, runs on the
//! state as it is, with a warning).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::agent::StateConfig;
use crate::checkpoint;
use crate::log::{FileLog, FileLogOptions, Log, LogError, Recovery};
use crate::store::{ActionStateStore as _, Incarnation, LogStore, MarkerStrategy, StoreError};

/// Where the agents' state logs are, under the tenant's directory.
const DIR: &str = "states";
/// The tenant-wide state log of earlier releases.
const SHARED_DIR: &str = "state";
/// Partitions of the tenant-wide state log of earlier releases.
const SHARED_PARTITIONS: u32 = 4;
/// Segments of a state log: whole segments are what compaction deletes.
const SEGMENT_BYTES: u64 = 1 << 20;
/// The most partitions an agent's state log may have on a server: each is a directory of
/// segment files.
pub const MAX_PARTITIONS: u32 = 64;
/// The shortest `checkpoint-every-ms` a server honours: each compaction asks the store for
/// a marker, which under `refresh` writes every cached state again.
pub const MIN_COMPACT_MS: u64 = 100;

/// Why an agent's state could not be opened, or a `[state]` is refused.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("opening the state log of agent {agent}: {error}")]
    Log { agent: String, error: LogError },
    #[error("recovering the recorded calls of agent {agent}: {error}")]
    Store { agent: String, error: StoreError },
    #[error("{0}")]
    Refused(String),
    #[error("listing the agents and their states in {}: {error}", dir.display())]
    List { dir: PathBuf, error: std::io::Error },
}

/// Why a state log was not compacted (it is again at the next time due).
#[derive(Debug, thiserror::Error)]
pub enum CompactError {
    #[error("asking the store for its marker: {0}")]
    Marker(#[from] StoreError),
    #[error("deleting the segments below the marker: {0}")]
    Delete(#[from] LogError),
}

/// What an agent's version asks of its state: its `[state]`, and whether it set
/// `partitions` (one it does not set takes the state's as it is).
#[derive(Clone, Debug)]
pub struct Wanted<'a> {
    pub config: &'a StateConfig,
    pub partitions_given: bool,
}

impl Wanted<'_> {
    /// Refuses what no server honours: too many partitions, compaction too often.
    pub fn check(&self) -> Result<(), StateError> {
        let config = self.config;
        if config.partitions == 0 || config.partitions > MAX_PARTITIONS {
            return Err(StateError::Refused(format!(
                "[state] partitions = {}: a server keeps 1 to {MAX_PARTITIONS}",
                config.partitions
            )));
        }
        if config.checkpoint_every_ms < MIN_COMPACT_MS {
            return Err(StateError::Refused(format!(
                "[state] checkpoint-every-ms = {}: a server compacts an agent's state log at \
                 most every {MIN_COMPACT_MS} ms",
                config.checkpoint_every_ms
            )));
        }
        Ok(())
    }
}

/// One agent's state: its log, the store over it, and when its log is next compacted.
#[derive(Debug)]
pub struct AgentState {
    pub log: Arc<dyn Log>,
    pub store: Arc<LogStore>,
    marker: MarkerStrategy,
    /// Whether it is the tenant-wide log of an earlier release, shared with other agents.
    shared: bool,
    compaction: Mutex<Compaction>,
}

#[derive(Debug)]
struct Compaction {
    every: Duration,
    every_inputs: u64,
    last: Instant,
    finished: u64,
}

impl AgentState {
    fn open(
        dir: &Path,
        partitions: u32,
        config: &StateConfig,
        incarnation: Incarnation,
        shared: bool,
    ) -> Result<Self, LogError> {
        let options = FileLogOptions {
            partitions,
            segment_bytes: SEGMENT_BYTES,
            recovery: Recovery::TruncateTornTail,
            ..FileLogOptions::default()
        };
        let (log, _) = FileLog::open(dir, options)?;
        let log: Arc<dyn Log> = Arc::new(log);
        let store = config.store(Arc::clone(&log), incarnation);
        Ok(Self {
            log,
            store: Arc::new(store),
            marker: config.marker,
            shared,
            compaction: Mutex::new(Compaction {
                every: Duration::from_millis(config.checkpoint_every_ms),
                every_inputs: config.checkpoint_every_inputs,
                last: Instant::now(),
                finished: 0,
            }),
        })
    }

    /// Takes the compaction cadence of `config` (the newest version's).
    fn set_cadence(&self, config: &StateConfig) {
        let mut compaction = self.compaction.lock().unwrap_or_else(|p| p.into_inner());
        compaction.every = Duration::from_millis(config.checkpoint_every_ms);
        compaction.every_inputs = config.checkpoint_every_inputs;
    }

    /// Counts an input of the agent finished; whether its log is due to be compacted
    /// (`checkpoint-every-ms` since the last time, or `checkpoint-every-inputs` inputs).
    pub fn finished_one(&self) -> bool {
        let mut compaction = self.compaction.lock().unwrap_or_else(|p| p.into_inner());
        compaction.finished += 1;
        let due = compaction.last.elapsed() >= compaction.every
            || compaction.finished >= compaction.every_inputs;
        if due {
            compaction.last = Instant::now();
            compaction.finished = 0;
        }
        due
    }

    /// Deletes the log's segments below the store's marker: only states of finished inputs
    /// (pruned from the cache) are there.
    pub async fn compact(&self) -> Result<(), CompactError> {
        let marker = self.store.marker().await?;
        for (partition, &offset) in (0..).zip(&marker.offsets) {
            self.log.delete_below(partition, offset).await?;
        }
        Ok(())
    }

    /// Rebuilds the store's cache from what the log holds.
    async fn rebuild(&self) -> Result<(), StoreError> {
        let start = checkpoint::log_start(&*self.log).await?;
        self.store.rebuild(&start).await
    }
}

/// A tenant's agents' states.
#[derive(Debug)]
pub struct States {
    dir: PathBuf,
    incarnation: Incarnation,
    /// The tenant-wide log of an earlier release, and the agents defined then, which use it.
    shared: Option<(Arc<AgentState>, BTreeSet<String>)>,
    /// Each agent's state, once a version of it asked (`of`); whether its cache is rebuilt.
    agents: Mutex<BTreeMap<String, (Arc<AgentState>, bool)>>,
}

impl States {
    /// The states under `tenant_dir`: each agent's is opened when a version of it is built
    /// ([`of`](Self::of)); the tenant-wide one of an earlier release now, with the agents
    /// that use it (those with a version on disk and no state log of their own).
    pub fn open(tenant_dir: &Path, incarnation: Incarnation) -> Result<Self, StateError> {
        let dir = tenant_dir.join(DIR);
        let shared_dir = tenant_dir.join(SHARED_DIR);
        let shared = if shared_dir.is_dir() {
            let config = StateConfig {
                partitions: SHARED_PARTITIONS,
                ..StateConfig::default()
            };
            let state =
                AgentState::open(&shared_dir, SHARED_PARTITIONS, &config, incarnation, true)
                    .map_err(|error| StateError::Log {
                        agent: "(the tenant's state log of an earlier release)".to_owned(),
                        error,
                    })?;
            let io = |error| StateError::List {
                dir: tenant_dir.to_owned(),
                error,
            };
            let own = subdirs(&dir).map_err(io)?;
            let users = (subdirs(&tenant_dir.join("agents")).map_err(io)?.into_iter())
                .filter(|name| !own.contains(name))
                .collect();
            Some((Arc::new(state), users))
        } else {
            None
        };
        Ok(Self {
            dir,
            incarnation,
            shared,
            agents: Mutex::new(BTreeMap::new()),
        })
    }

    /// The state of `agent` for a version that wants `wanted`: opened (or created) as it
    /// asks the first time, the same state after. When the state's partitions or marker are
    /// not what it asks, the state as it is, and what differs.
    pub fn of(
        &self,
        agent: &str,
        wanted: &Wanted<'_>,
    ) -> Result<(Arc<AgentState>, Option<String>), StateError> {
        let config = wanted.config;
        let mut agents = self.agents.lock().unwrap_or_else(|p| p.into_inner());
        let state = match agents.get(agent) {
            Some((state, _)) => Arc::clone(state),
            None => {
                let state = match &self.shared {
                    Some((shared, users)) if users.contains(agent) => Arc::clone(shared),
                    _ => {
                        let dir = self.dir.join(agent);
                        let log_error = |error| StateError::Log {
                            agent: agent.to_owned(),
                            error,
                        };
                        let on_disk = FileLog::partitions_in(&dir).map_err(log_error)?;
                        let partitions = on_disk.unwrap_or(config.partitions);
                        let state =
                            AgentState::open(&dir, partitions, config, self.incarnation, false)
                                .map_err(log_error)?;
                        Arc::new(state)
                    }
                };
                agents.insert(agent.to_owned(), (Arc::clone(&state), false));
                state
            }
        };
        let mut differs = Vec::new();
        let partitions = state.log.partitions();
        if wanted.partitions_given && config.partitions != partitions {
            differs.push(format!(
                "partitions = {} (its state log has {partitions})",
                config.partitions
            ));
        }
        if config.marker != state.marker {
            differs.push(format!(
                "marker = {:?} (its state keeps {:?})",
                config.marker.name(),
                state.marker.name()
            ));
        }
        let differs = (!differs.is_empty()).then(|| {
            let shared = if state.shared {
                "; it keeps its state in the tenant's state log of an earlier release, which \
                 is offsets-marked with 4 partitions"
            } else {
                ""
            };
            format!(
                "[state] {}: an agent's state partitions and marker are fixed for its life on \
                 a server{shared}",
                differs.join(", ")
            )
        });
        if differs.is_none() {
            state.set_cadence(config);
        }
        Ok((state, differs))
    }

    /// The state of `agent`, when a version of it was built.
    pub fn get(&self, agent: &str) -> Option<Arc<AgentState>> {
        let agents = self.agents.lock().unwrap_or_else(|p| p.into_inner());
        agents.get(agent).map(|(state, _)| Arc::clone(state))
    }

    /// Rebuilds the cache of every state opened since the last call from what its log
    /// holds. The tenant-wide state is rebuilt once, whichever agent asked for it.
    pub async fn rebuild_opened(&self) -> Result<(), StateError> {
        let opened: Vec<(String, Arc<AgentState>)> = {
            let mut agents = self.agents.lock().unwrap_or_else(|p| p.into_inner());
            agents
                .iter_mut()
                .filter(|(_, (_, rebuilt))| !*rebuilt)
                .map(|(name, (state, rebuilt))| {
                    *rebuilt = true;
                    (name.clone(), Arc::clone(state))
                })
                .collect()
        };
        let mut shared_done = false;
        for (agent, state) in opened {
            if state.shared {
                if shared_done {
                    continue;
                }
                shared_done = true;
            }
            state
                .rebuild()
                .await
                .map_err(|error| StateError::Store { agent, error })?;
        }
        Ok(())
    }
}

/// The names of the directories in `dir` (none when it does not exist), hidden ones left out.
fn subdirs(dir: &Path) -> std::io::Result<BTreeSet<String>> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(BTreeSet::new()),
        Err(e) => return Err(e),
    };
    let mut names = BTreeSet::new();
    for entry in entries {
        let entry = entry?;
        if !entry.file_type()?.is_dir() {
            continue;
        }
        if let Some(name) = entry.file_name().to_str()
            && !name.starts_with('.')
        {
            names.insert(name.to_owned());
        }
    }
    Ok(names)
}
