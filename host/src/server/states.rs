//! Each agent's state under a tenant: its own state log and store, as the agent's `[state]`
//! says (partitions, marker, refresh batch, and how often its log is compacted).
//!
//! ```text
//! TENANT/states/AGENT/             an agent's state log (partitions fixed when it is created)
//! TENANT/state/                    the one state log of a tenant written by releases before
//!                                  states were per agent: the agents defined then keep it
//! TENANT/state/agents.json         those agents, written at the first open by this release
//!                                  {"format": 1, "agents": [...]}
//! ```
//!
//! A state's partitions and marker are fixed for the agent's life on the server: a version
//! that asks for others is refused when it is defined (and, loaded from disk, runs on the
//! state as it is, with a warning). A state's cache of recorded calls is rebuilt from its
//! log once per process, before any input runs on it ([`AgentState::ready`]).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::agent::StateConfig;
use crate::checkpoint;
use crate::log::{FileLog, FileLogOptions, Log, LogError, Recovery};
use crate::private;
use crate::store::{
    ActionStateStore as _, Incarnation, KeyScope, LogStore, MarkerStrategy, SHELF_DIR, StoreError,
};

/// Where the agents' state logs are, under the tenant's directory.
const DIR: &str = "states";
/// The tenant-wide state log of earlier releases.
const SHARED_DIR: &str = "state";
/// The agents that keep the tenant-wide state log, under it.
const SHARED_USERS: &str = "agents.json";
/// The format of [`SHARED_USERS`].
const SHARED_USERS_FORMAT: u32 = 1;
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
    #[error("[state] partitions = {given}: a server keeps 1 to {MAX_PARTITIONS}")]
    Partitions { given: u32 },
    #[error(
        "[state] checkpoint-every-ms = {every_ms}: a server compacts an agent's state log at \
         most every {MIN_COMPACT_MS} ms"
    )]
    CompactsTooOften { every_ms: u64 },
    /// A version asks for partitions or a marker other than its agent's state has.
    #[error(
        "[state] {}: an agent's state partitions and marker are fixed for its life on a \
         server{}",
        differs.join(", "),
        if *shared {
            "; it keeps its state in the tenant's state log of an earlier release, which is \
             offsets-marked with 4 partitions"
        } else {
            ""
        }
    )]
    Fixed { differs: Vec<String>, shared: bool },
    #[error("{}: {error}", path.display())]
    Io {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("{}: {message}", path.display())]
    Unreadable { path: PathBuf, message: String },
}

impl StateError {
    /// Whether it is the definition's fault (a `[state]` the server refuses), not the host's.
    pub fn is_refusal(&self) -> bool {
        matches!(
            self,
            Self::Partitions { .. } | Self::CompactsTooOften { .. } | Self::Fixed { .. }
        )
    }
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> StateError + '_ {
    move |error| StateError::Io {
        path: path.to_owned(),
        error,
    }
}

/// Why a state log was not compacted (it is again at the next time due).
#[derive(Debug, thiserror::Error)]
pub enum CompactError {
    #[error("asking the store for its marker: {0}")]
    Marker(#[source] StoreError),
    #[error("deleting the records below the marker: {0}")]
    Delete(#[source] StoreError),
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
            return Err(StateError::Partitions {
                given: config.partitions,
            });
        }
        if config.checkpoint_every_ms < MIN_COMPACT_MS {
            return Err(StateError::CompactsTooOften {
                every_ms: config.checkpoint_every_ms,
            });
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
    /// Set once the cache is rebuilt from the log (see [`ready`](Self::ready)).
    rebuilt: tokio::sync::OnceCell<()>,
    /// Keys' finished inputs whose states go once it is ready: those the journal's recovery
    /// found for an agent whose state was not open yet.
    prunes: Mutex<Vec<(KeyScope, u64)>>,
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
        let partitions = log.partitions();
        let shelf_options = FileLogOptions {
            partitions,
            ..options
        };
        let (shelf, _) = FileLog::open(&dir.join(SHELF_DIR), shelf_options)?;
        let store =
            (config.store(Arc::clone(&log), Arc::new(shelf), incarnation)).map_err(|error| {
                LogError::Io {
                    context: format!("opening the store in {}", dir.display()),
                    source: std::io::Error::other(error),
                }
            })?;
        Ok(Self {
            log,
            store: Arc::new(store),
            marker: config.marker,
            shared,
            rebuilt: tokio::sync::OnceCell::new(),
            prunes: Mutex::new(Vec::new()),
            compaction: Mutex::new(Compaction {
                every: Duration::from_millis(config.checkpoint_every_ms),
                every_inputs: config.checkpoint_every_inputs,
                last: Instant::now(),
                finished: 0,
            }),
        })
    }

    /// Rebuilds the cache of recorded calls from what the log holds, the first time it is
    /// asked in this process (callers at once wait for the one rebuild); a rebuild that
    /// fails is tried again at the next ask. Every input's run waits for this: a run on a
    /// cache not rebuilt would miss its recorded calls and make them again, and a rebuild
    /// under runs would drop what they record meanwhile. Then prunes the finished inputs
    /// recovery left for it ([`States::prune_when_open`]).
    pub async fn ready(&self) -> Result<(), StoreError> {
        self.rebuilt
            .get_or_try_init(|| async {
                let start = checkpoint::log_start(&*self.log).await?;
                self.store.rebuild(&start).await
            })
            .await?;
        let prunes = std::mem::take(&mut *self.prunes.lock().unwrap_or_else(|p| p.into_inner()));
        for (at, (scope, up_to)) in prunes.iter().enumerate() {
            if let Err(error) = self.store.prune(scope, *up_to).await {
                let mut left = self.prunes.lock().unwrap_or_else(|p| p.into_inner());
                left.extend(prunes[at..].iter().cloned());
                return Err(error);
            }
        }
        Ok(())
    }

    /// Takes the compaction cadence of `config`: the newest version's.
    pub fn set_cadence(&self, config: &StateConfig) {
        let mut compaction = self.compaction.lock().unwrap_or_else(|p| p.into_inner());
        compaction.every = Duration::from_millis(config.checkpoint_every_ms);
        compaction.every_inputs = config.checkpoint_every_inputs;
    }

    /// Counts an input of the agent finished; whether its log is due to be compacted:
    /// `checkpoint-every-ms` since the last time, or `checkpoint-every-inputs` inputs, and
    /// never within [`MIN_COMPACT_MS`] of the last (under `refresh` each compaction writes
    /// every cached state again).
    pub fn finished_one(&self) -> bool {
        let mut compaction = self.compaction.lock().unwrap_or_else(|p| p.into_inner());
        compaction.finished += 1;
        let since = compaction.last.elapsed();
        let due = since >= compaction.every
            || (compaction.finished >= compaction.every_inputs
                && since >= Duration::from_millis(MIN_COMPACT_MS));
        if due {
            compaction.last = Instant::now();
            compaction.finished = 0;
        }
        due
    }

    /// Deletes the log's segments below the store's marker: only states of finished inputs
    /// (pruned from the cache) are there.
    pub async fn compact(&self) -> Result<(), CompactError> {
        let marker = self.store.marker().await.map_err(CompactError::Marker)?;
        let retained = self.store.retain(&marker).await;
        retained.map_err(CompactError::Delete)
    }
}

/// A tenant's agents' states.
#[derive(Debug)]
pub struct States {
    dir: PathBuf,
    incarnation: Incarnation,
    /// The tenant-wide log of an earlier release, and the agents defined then, which use it.
    shared: Option<(Arc<AgentState>, BTreeSet<String>)>,
    /// Each agent's state, once a version of it asked ([`of`](Self::of)).
    agents: Mutex<BTreeMap<String, Arc<AgentState>>>,
    /// Held while a state is opened or taken back, so that an agent's is opened once.
    opening: Mutex<()>,
    /// Finished inputs of agents whose state is not open, to prune once it is.
    later: Mutex<BTreeMap<String, Vec<(KeyScope, u64)>>>,
}

/// An agent's state, as [`States::of`] found it for a version.
#[derive(Debug)]
pub struct Opened {
    pub state: Arc<AgentState>,
    /// What the version asks that the state does not have (its partitions or marker).
    pub differs: Option<StateError>,
    /// Whether this call made the state's directory: a definition that then fails takes
    /// it back ([`States::forget`]), so that it does not fix the agent's partitions.
    pub created: bool,
}

/// [`SHARED_USERS`]: the agents of a tenant that keep its state log of an earlier release.
#[derive(Debug, Serialize, Deserialize)]
struct SharedUsers {
    format: u32,
    agents: BTreeSet<String>,
}

impl States {
    /// The states under `tenant_dir`: each agent's is opened when a version of it is built
    /// ([`of`](Self::of)); the tenant-wide one of an earlier release now, with the agents
    /// that use it.
    pub fn open(tenant_dir: &Path, incarnation: Incarnation) -> Result<Self, StateError> {
        let dir = tenant_dir.join(DIR);
        // A state is made by a definition before its version is put in place; one whose
        // definition died before that never took an input, and fixes nothing.
        for agent in subdirs(&dir).map_err(io(&dir))? {
            if !has_version(&tenant_dir.join("agents").join(&agent))? {
                let orphan = dir.join(&agent);
                tracing::warn!(dir = %orphan.display(),
                    "removing the state of an agent with no version (its definition failed)");
                std::fs::remove_dir_all(&orphan).map_err(io(&orphan))?;
            }
        }
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
            let users = shared_users(tenant_dir, &dir, &shared_dir)?;
            Some((Arc::new(state), users))
        } else {
            None
        };
        Ok(Self {
            dir,
            incarnation,
            shared,
            agents: Mutex::new(BTreeMap::new()),
            opening: Mutex::new(()),
            later: Mutex::new(BTreeMap::new()),
        })
    }

    /// The state of `agent` for a version that wants `wanted`: opened (or created) as it
    /// asks the first time, the same state after. Its cache is not rebuilt yet: see
    /// [`AgentState::ready`].
    pub fn of(&self, agent: &str, wanted: &Wanted<'_>) -> Result<Opened, StateError> {
        let config = wanted.config;
        // Opens one at a time; the map's lock is held only to look up and insert, so that
        // inputs that look up their agent's state do not wait for a log to open.
        let _opening = self.opening.lock().unwrap_or_else(|p| p.into_inner());
        let mut created = false;
        let open = self.opened(agent);
        let state = match open {
            Some(state) => state,
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
                        created = on_disk.is_none();
                        let partitions = on_disk.unwrap_or(config.partitions);
                        let state =
                            AgentState::open(&dir, partitions, config, self.incarnation, false)
                                .map_err(log_error)?;
                        Arc::new(state)
                    }
                };
                let later = self
                    .later
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .remove(agent);
                if let Some(later) = later {
                    let mut prunes = state.prunes.lock().unwrap_or_else(|p| p.into_inner());
                    prunes.extend(later);
                }
                let mut agents = self.agents.lock().unwrap_or_else(|p| p.into_inner());
                agents.insert(agent.to_owned(), Arc::clone(&state));
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
        let differs = (!differs.is_empty()).then_some(StateError::Fixed {
            differs,
            shared: state.shared,
        });
        Ok(Opened {
            state,
            differs,
            created,
        })
    }

    /// Takes back `state`, which [`of`](Self::of) created for a definition of `agent` that
    /// then failed: its directory goes, and the agent's next definition creates it again as
    /// it asks. Only while the map and the caller are all that hold it: a state another
    /// version took meanwhile (an input runs on it) stays. Whether it was taken back.
    pub fn forget(&self, agent: &str, state: &Arc<AgentState>) -> Result<bool, StateError> {
        let _opening = self.opening.lock().unwrap_or_else(|p| p.into_inner());
        {
            let mut agents = self.agents.lock().unwrap_or_else(|p| p.into_inner());
            let ours = agents
                .get(agent)
                .is_some_and(|held| Arc::ptr_eq(held, state));
            if !ours || state.shared || Arc::strong_count(state) > 2 {
                return Ok(false);
            }
            agents.remove(agent);
        }
        let dir = self.dir.join(agent);
        match std::fs::remove_dir_all(&dir) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(true),
            Err(e) => Err(io(&dir)(e)),
        }
    }

    /// Has the states of `scope`'s inputs up to `up_to` (finished) pruned when `agent`'s
    /// state is open and ready: no version of it opened it at the start.
    pub fn prune_when_open(&self, agent: &str, scope: KeyScope, up_to: u64) {
        let mut later = self.later.lock().unwrap_or_else(|p| p.into_inner());
        later
            .entry(agent.to_owned())
            .or_default()
            .push((scope, up_to));
    }

    /// The state of `agent`, when a version of it was built and the state is
    /// [ready](AgentState::ready): what the cache holds is what its log holds.
    pub fn get(&self, agent: &str) -> Option<Arc<AgentState>> {
        self.opened(agent)
            .filter(|state| state.rebuilt.initialized())
    }

    /// The state of `agent`, when a version of it was built, ready or not.
    pub fn opened(&self, agent: &str) -> Option<Arc<AgentState>> {
        let agents = self.agents.lock().unwrap_or_else(|p| p.into_inner());
        agents.get(agent).map(Arc::clone)
    }

    /// [`AgentState::ready`] for every state opened: the tenant-wide one once, whichever
    /// agents use it.
    pub async fn ready_all(&self) -> Result<(), StateError> {
        let opened: Vec<(String, Arc<AgentState>)> = {
            let agents = self.agents.lock().unwrap_or_else(|p| p.into_inner());
            agents
                .iter()
                .map(|(name, state)| (name.clone(), Arc::clone(state)))
                .collect()
        };
        for (agent, state) in opened {
            state
                .ready()
                .await
                .map_err(|error| StateError::Store { agent, error })?;
        }
        Ok(())
    }
}

/// The agents that keep the tenant-wide state log of an earlier release: read from
/// [`SHARED_USERS`], or, at the first open by this release, those with a version on disk
/// and no state log of their own, then written there.
fn shared_users(
    tenant_dir: &Path,
    own_dir: &Path,
    shared_dir: &Path,
) -> Result<BTreeSet<String>, StateError> {
    let path = shared_dir.join(SHARED_USERS);
    match std::fs::read(&path) {
        Ok(bytes) => {
            let unreadable = |message: String| StateError::Unreadable {
                path: path.clone(),
                message,
            };
            let users: SharedUsers =
                serde_json::from_slice(&bytes).map_err(|e| unreadable(e.to_string()))?;
            if users.format != SHARED_USERS_FORMAT {
                return Err(unreadable(format!(
                    "format {} is not one this build reads ({SHARED_USERS_FORMAT}); run the \
                     release that wrote it",
                    users.format
                )));
            }
            return Ok(users.agents);
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io(&path)(e)),
    }
    let own = subdirs(own_dir).map_err(io(own_dir))?;
    let agents_dir = tenant_dir.join("agents");
    let mut agents = BTreeSet::new();
    for name in subdirs(&agents_dir).map_err(io(&agents_dir))? {
        // A definition that failed leaves its agent's directory without a version.
        if has_version(&agents_dir.join(&name))? && !own.contains(&name) {
            agents.insert(name);
        }
    }
    let users = SharedUsers {
        format: SHARED_USERS_FORMAT,
        agents,
    };
    let bytes = serde_json::to_vec_pretty(&users).map_err(|e| StateError::Io {
        path: path.clone(),
        error: std::io::Error::other(e),
    })?;
    private::write(&path, &bytes).map_err(io(&path))?;
    Ok(users.agents)
}

/// Whether the agent directory `dir` holds a version (`dir/N/`).
fn has_version(dir: &Path) -> Result<bool, StateError> {
    let versions = subdirs(dir).map_err(io(dir))?;
    Ok(versions.iter().any(|v| v.parse::<u32>().is_ok()))
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

#[cfg(test)]
mod tests {
    use super::*;

    fn wanted(config: &StateConfig) -> Wanted<'_> {
        Wanted {
            config,
            partitions_given: true,
        }
    }

    #[test]
    fn compaction_is_due_by_time_or_inputs_but_never_within_the_minimum() {
        let tenant = tempfile::tempdir().expect("tempdir");
        let states = States::open(tenant.path(), Incarnation::random()).expect("open");
        let config = StateConfig {
            checkpoint_every_ms: 3_600_000,
            checkpoint_every_inputs: 1,
            ..StateConfig::default()
        };
        let state = states.of("bot", &wanted(&config)).expect("opened").state;
        let set_last = |ago_ms: u64| {
            let mut compaction = state.compaction.lock().expect("lock");
            compaction.last = Instant::now() - Duration::from_millis(ago_ms);
        };
        // One input is enough, but not within 100 ms of the last compaction.
        set_last(0);
        assert!(!state.finished_one());
        set_last(MIN_COMPACT_MS + 50);
        assert!(state.finished_one());
        // By time alone.
        state.set_cadence(&StateConfig {
            checkpoint_every_ms: 1_000,
            checkpoint_every_inputs: 1_000_000,
            ..config
        });
        set_last(500);
        assert!(!state.finished_one());
        set_last(1_500);
        assert!(state.finished_one());
    }

    #[test]
    fn a_state_taken_back_is_made_again_as_the_next_definition_asks() {
        let tenant = tempfile::tempdir().expect("tempdir");
        let states = States::open(tenant.path(), Incarnation::random()).expect("open");
        let four = StateConfig {
            partitions: 4,
            ..StateConfig::default()
        };
        let opened = states.of("bot", &wanted(&four)).expect("opened");
        assert!(opened.created);
        let held = states.opened("bot").expect("in the map");
        assert!(
            !states.forget("bot", &opened.state).expect("forget"),
            "a state another holds stays"
        );
        drop(held);
        assert!(states.forget("bot", &opened.state).expect("forgotten"));
        drop(opened);
        assert!(!tenant.path().join("states/bot").exists());
        let six = StateConfig {
            partitions: 6,
            ..StateConfig::default()
        };
        let opened = states.of("bot", &wanted(&six)).expect("opened");
        assert_eq!(opened.state.log.partitions(), 6);
        assert!(opened.differs.is_none());
        // Opened again, it was not created: a failure now takes nothing back.
        assert!(!states.of("bot", &wanted(&six)).expect("opened").created);
    }

    #[test]
    fn the_agents_of_the_shared_state_log_are_those_defined_then_and_are_kept() {
        let tenant = tempfile::tempdir().expect("tempdir");
        let dir = tenant.path();
        for made in [
            "state",
            "agents/old/1",
            "agents/failed",
            "agents/own/1",
            "states/own",
        ] {
            std::fs::create_dir_all(dir.join(made)).expect("mkdir");
        }
        let shared_of = |states: &States| states.shared.as_ref().expect("shared").1.clone();
        // And a state whose definition died before its version was in place.
        std::fs::create_dir_all(dir.join("states/orphan")).expect("mkdir");
        let states = States::open(dir, Incarnation::random()).expect("open");
        assert_eq!(shared_of(&states), BTreeSet::from(["old".to_owned()]));
        assert!(!dir.join("states/orphan").exists(), "an orphan state goes");
        assert!(
            dir.join("states/own").exists(),
            "a state with a version stays"
        );
        drop(states);
        // Agents defined later, by this release, never join it, whatever they hold.
        std::fs::create_dir_all(dir.join("agents/later/1")).expect("mkdir");
        let states = States::open(dir, Incarnation::random()).expect("open");
        assert_eq!(shared_of(&states), BTreeSet::from(["old".to_owned()]));
        let later = StateConfig::default();
        let opened = states.of("later", &wanted(&later)).expect("opened");
        assert!(!opened.state.shared);
    }

    #[tokio::test]
    async fn finished_inputs_found_before_the_state_opened_are_pruned_once_it_is_ready() {
        use crate::event::Event;
        use crate::store::{ActionState, Digest, StateKey};

        let tenant = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir_all(tenant.path().join("agents/bot/1")).expect("a version");
        let config = StateConfig::default();
        let scope = KeyScope::new("acme", "bot", "k");
        {
            // A first process records the states of inputs 1 and 2.
            let states = States::open(tenant.path(), Incarnation::random()).expect("open");
            let state = states.of("bot", &wanted(&config)).expect("opened").state;
            state.ready().await.expect("ready");
            for sequence in [1, 2] {
                let key = StateKey {
                    scope: scope.clone(),
                    sequence,
                    action: "act".to_owned(),
                    trigger: Digest::of(&[b"input"]),
                };
                let recorded = ActionState::new(key, Event::new("input", "{}"));
                state.store.put(&recorded).await.expect("put");
            }
        }
        // The next finds #1 finished in its journal before any version opened the state.
        let states = States::open(tenant.path(), Incarnation::random()).expect("open");
        states.prune_when_open("bot", scope.clone(), 1);
        let state = states.of("bot", &wanted(&config)).expect("opened").state;
        state.ready().await.expect("ready");
        let left: Vec<u64> = (state.store.states(&scope).iter())
            .map(|s| s.key.sequence)
            .collect();
        assert_eq!(left, [2], "#1's states pruned, #2's kept");
    }
}
