//! The state directory: the log, the checkpoints, and recovery from them.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context as _;
use rewind_host::agent::DEFAULT_TENANT;
use rewind_host::agent::StateConfig;
use rewind_host::checkpoint::{
    Checkpoint, CheckpointStore, FileCheckpoints, log_start, recover_store,
};
use rewind_host::log::{FileLog, FileLogOptions, Log, MemoryLog, Recovery};
use rewind_host::state_dir::{StateDir, read_incarnation};
use rewind_host::store::{ActionStateStore, Incarnation, LogStore, SHELF_DIR};

/// What recovery found in a state directory.
pub struct Recovered {
    /// Held while the directory is written; `None` for a reader.
    pub _held: Option<StateDir>,
    pub log: Arc<dyn Log>,
    pub store: Arc<LogStore>,
    pub checkpoints: Arc<FileCheckpoints>,
    pub latest: Option<Checkpoint>,
}

pub fn log_dir(state: &Path) -> PathBuf {
    state.join("log")
}

pub fn checkpoints_dir(state: &Path) -> PathBuf {
    state.join("checkpoints")
}

/// The shelf of the store over the log in `dir` (where the states of waiting inputs are set
/// aside): a reader of a directory made before shelves finds none, and reads an empty one.
fn open_shelf(dir: &Path, partitions: u32, recovery: Recovery) -> anyhow::Result<Arc<dyn Log>> {
    let dir = dir.join(SHELF_DIR);
    if recovery == Recovery::ReadOnly && FileLog::partitions_in(&dir)?.is_none() {
        return Ok(Arc::new(MemoryLog::new(partitions)));
    }
    let options = FileLogOptions {
        partitions,
        recovery,
        ..FileLogOptions::default()
    };
    let (shelf, _) = FileLog::open(&dir, options)
        .with_context(|| format!("opening the shelf in {}", dir.display()))?;
    Ok(Arc::new(shelf))
}

/// Which states to load into the store.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Load<'a> {
    /// What recovery needs: from the newest checkpoint's marker (everything, with no
    /// checkpoint yet), then the states of inputs the checkpoint counts as complete pruned
    /// again (the marker can reach back past them), for this agent.
    Recovery { agent: &'a str },
    /// Everything the log still holds, for inspection: read without taking the directory's
    /// lock, and without writing to it.
    WholeLog,
}

/// Opens the state directory (creating it when new) and loads the store as `load` says.
pub async fn recover(
    state: &Path,
    config: &StateConfig,
    recovery: Recovery,
    load: Load<'_>,
) -> anyhow::Result<Recovered> {
    let partitions = config.partitions;
    // A writer holds the directory for as long as it runs; a reader reads what is there.
    let (held, incarnation) = match load {
        Load::Recovery { .. } => {
            let held = StateDir::open(state)?;
            let incarnation = held.incarnation();
            (Some(held), incarnation)
        }
        Load::WholeLog => (
            None,
            read_incarnation(state)?.unwrap_or_else(Incarnation::random),
        ),
    };
    let dir = log_dir(state);
    let options = FileLogOptions {
        partitions,
        recovery,
        ..FileLogOptions::default()
    };
    let (log, report) = FileLog::open(&dir, options)
        .with_context(|| format!("opening the state log in {}", dir.display()))?;
    for cut in &report.truncated {
        eprintln!(
            "recovery: cut {} bytes from the end of {} ({}); they were never acknowledged",
            cut.bytes,
            cut.path.display(),
            cut.reason
        );
    }
    if report.journal.dropped_bytes > 0 {
        eprintln!(
            "recovery: dropped {} bytes from the end of the commit journal; they were never acknowledged",
            report.journal.dropped_bytes
        );
    }
    for (partition, records) in &report.journal.restored {
        eprintln!(
            "recovery: restored {records} records to partition {partition} from the commit journal"
        );
    }
    let log: Arc<dyn Log> = Arc::new(log);
    let shelf = open_shelf(&dir, log.partitions(), recovery)?;
    let checkpoints = Arc::new(FileCheckpoints::new(checkpoints_dir(state)));
    let latest = checkpoints.latest().await?;
    let store = config
        .store(Arc::clone(&log), shelf, incarnation)
        .with_context(|| format!("opening the store in {}", dir.display()))?;
    let store = Arc::new(store);
    let context = || match &latest {
        Some(c) => format!("recovering from checkpoint {} in {}", c.id, state.display()),
        None => format!("recovering {}", state.display()),
    };
    match load {
        Load::Recovery { agent } => {
            recover_store(&*store, &*log, latest.as_ref(), DEFAULT_TENANT, agent)
                .await
                .with_context(context)?;
        }
        Load::WholeLog => {
            let marker = log_start(&*log).await?;
            store.rebuild(&marker).await.with_context(context)?;
        }
    }
    Ok(Recovered {
        _held: held,
        log,
        store,
        checkpoints,
        latest,
    })
}
