//! Checkpoints: a consistent cut of an agent's progress, and where they are kept.
//!
//! A checkpoint records the input position, each key's next and last completed sequence,
//! the inputs accepted but not complete, each key's short-term memory, and the store's
//! marker (docs/SEMANTICS.md, "Checkpoints and recovery"). Recovery starts from the
//! newest one.

#[cfg(any(test, feature = "testing"))]
pub mod conformance;
mod file;
mod log;

use std::collections::BTreeMap;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

pub use file::FileCheckpoints;
pub use log::LogCheckpoints;

use crate::log::Log;
use crate::store::{ActionStateStore, KeyScope, Marker, StoreError, Waiting};
use crate::version::{self, FormatError, Versioned};

/// Numbers checkpoints; a later checkpoint has a higher id.
pub type CheckpointId = u64;

/// One key's progress at the cut.
///
/// Written compactly, since a checkpoint holds every key ever seen: `[next, last]`, or
/// `[next, last, {memory}]` when the memory is not empty. The counters stay for every key:
/// they keep a key's sequences, and so its output ids, from repeating. (Read in the earlier
/// form too, an object with the fields' names.)
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(from = "ProgressForm")]
pub struct KeyProgress {
    /// The sequence the key's next accepted input gets.
    pub next_sequence: u64,
    /// Every input of the key up to this sequence is complete (0: none yet).
    pub last_completed: u64,
    /// The key's short-term memory as of `last_completed`.
    pub memory: BTreeMap<String, String>,
}

impl Serialize for KeyProgress {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeTuple as _;
        let empty = self.memory.is_empty();
        let mut tuple = serializer.serialize_tuple(if empty { 2 } else { 3 })?;
        tuple.serialize_element(&self.next_sequence)?;
        tuple.serialize_element(&self.last_completed)?;
        if !empty {
            tuple.serialize_element(&self.memory)?;
        }
        tuple.end()
    }
}

/// The forms a [`KeyProgress`] is read in.
#[derive(Deserialize)]
#[serde(untagged)]
enum ProgressForm {
    Compact(u64, u64, #[serde(default)] BTreeMap<String, String>),
    #[serde(rename_all = "kebab-case")]
    Named {
        next_sequence: u64,
        last_completed: u64,
        #[serde(default)]
        memory: BTreeMap<String, String>,
    },
}

impl From<ProgressForm> for KeyProgress {
    fn from(form: ProgressForm) -> Self {
        let (next_sequence, last_completed, memory) = match form {
            ProgressForm::Compact(next, last, memory) => (next, last, memory),
            ProgressForm::Named {
                next_sequence,
                last_completed,
                memory,
            } => (next_sequence, last_completed, memory),
        };
        Self {
            next_sequence,
            last_completed,
            memory,
        }
    }
}

/// An input accepted before the cut and not complete at it: run again on recovery.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct PendingInput {
    pub key: String,
    pub sequence: u64,
    /// JSON text.
    pub payload: String,
    /// Parked at the cut: every attempt failed, and it waits for an operator.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parked: Option<ParkedInput>,
    /// Stopped at a durable wait at the cut (recorded in its action state): a run from the
    /// checkpoint arms it again without running the input.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waiting: Option<Waiting>,
}

/// How a pending input came to be parked.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct ParkedInput {
    pub attempts: u32,
    /// The last attempt's error (escaped and bounded).
    pub error: String,
}

/// An input an operator finished without completing it (skipped or cancelled): kept in
/// every later checkpoint, the history of a state's skips and cancels.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct SkippedInput {
    pub key: String,
    pub sequence: u64,
    /// Skipped (absent in checkpoints written before cancels) or cancelled.
    #[serde(default, skip_serializing_if = "Ended::is_skipped")]
    pub ended: Ended,
    pub by: String,
    pub reason: String,
    /// The command that asked (`commands::Command::id`).
    pub command: String,
    /// Other commands that asked the same of it at once (a second cancel of a running
    /// input): done too once this is in a checkpoint.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub also: Vec<String>,
}

impl SkippedInput {
    /// Whether the command `id` ended this input.
    pub fn by_command(&self, id: &str) -> bool {
        self.command == id || self.also.iter().any(|also| also == id)
    }
}

/// How an operator finished an input without completing it. Either way nothing it did is
/// applied (no outputs, no memory writes) and its key's next input runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Ended {
    /// Parked, and skipped: it was not run again.
    #[default]
    Skipped,
    /// Cancelled: stopped at its next durable call (not made), or not run again.
    Cancelled,
}

impl Ended {
    pub fn is_skipped(&self) -> bool {
        *self == Self::Skipped
    }

    /// As the states of an input name it: `skipped` or `cancelled`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Skipped => "skipped",
            Self::Cancelled => "cancelled",
        }
    }
}

/// A consistent cut of everything an agent needs to resume.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct Checkpoint {
    pub id: CheckpointId,
    /// Where the input source resumes: for a file, the lines consumed so far.
    pub input_position: u64,
    pub keys: BTreeMap<String, KeyProgress>,
    pub pending: Vec<PendingInput>,
    /// Where recovery starts reading the store's log.
    pub marker: Marker,
    /// For a sink with positions (a stream): where the outputs stood at the cut. Every
    /// output of an input the checkpoint counts complete is before it; outputs after it may
    /// have been written already for the pending inputs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_position: Option<u64>,
    /// Every input an operator skipped or cancelled, oldest first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub skipped: Vec<SkippedInput>,
}

/// The format of the checkpoints this build writes, and the newest it reads (see
/// [`crate::version`]); checkpoints written before formats were named are format 1.
pub const FORMAT: u32 = 1;

impl Checkpoint {
    /// The checkpoint as JSON, naming its format.
    pub fn encode(&self, pretty: bool) -> serde_json::Result<Vec<u8>> {
        let versioned = Versioned {
            format: FORMAT,
            value: self,
        };
        if pretty {
            serde_json::to_vec_pretty(&versioned)
        } else {
            serde_json::to_vec(&versioned)
        }
    }

    /// The checkpoint `json` holds, when it is of a format this build reads; `what` names
    /// where it was read.
    pub fn decode(json: &[u8], what: &str) -> Result<Self, CheckpointError> {
        Ok(version::decode(json, FORMAT, what)?)
    }
}

/// Why a checkpoint could not be written or read.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("{context}: {source}")]
    Io {
        context: String,
        source: std::io::Error,
    },
    #[error("{path}: not a checkpoint this build reads: {message}")]
    Unreadable { path: String, message: String },
    /// Not JSON of a checkpoint, or of a newer format than this build reads.
    #[error(transparent)]
    Format(#[from] FormatError),
}

/// Where checkpoints are kept.
#[async_trait]
pub trait CheckpointStore: Send + Sync + std::fmt::Debug {
    /// Makes `checkpoint` durable and the newest, atomically: after a crash at any point,
    /// [`latest`](Self::latest) returns either it or the checkpoint that was newest before.
    /// Then keeps only the newest `keep` checkpoints. On `Err` the previous checkpoint is
    /// still the newest.
    async fn save(&self, checkpoint: &Checkpoint, keep: usize) -> Result<(), CheckpointError>;

    /// The newest complete checkpoint, or `None` when there is none.
    async fn latest(&self) -> Result<Option<Checkpoint>, CheckpointError>;

    /// The ids of the kept checkpoints, oldest first.
    async fn list(&self) -> Result<Vec<CheckpointId>, CheckpointError>;

    /// The oldest kept checkpoint: retention may delete log data only below its marker.
    async fn oldest(&self) -> Result<Option<Checkpoint>, CheckpointError>;
}

/// Loads `store`, whose log is `log`, to resume from `latest` (`None`: there is no
/// checkpoint yet): rebuilt from the checkpoint's marker (from the log's start without
/// one), then the states of `tenant`'s `agent`'s inputs the checkpoint counts complete
/// pruned again, since the marker can reach back past them.
pub async fn recover_store(
    store: &dyn ActionStateStore,
    log: &dyn Log,
    latest: Option<&Checkpoint>,
    tenant: &str,
    agent: &str,
) -> Result<(), StoreError> {
    let marker = match latest {
        Some(checkpoint) => checkpoint.marker.clone(),
        None => log_start(log).await?,
    };
    store.rebuild(&marker).await?;
    if let Some(checkpoint) = latest {
        for (key, progress) in &checkpoint.keys {
            let scope = KeyScope::new(tenant, agent, key);
            store.prune(&scope, progress.last_completed).await?;
        }
    }
    Ok(())
}

/// A marker at the first offset each partition of `log` still holds.
pub async fn log_start(log: &dyn Log) -> Result<Marker, StoreError> {
    let mut offsets = Vec::with_capacity(log.partitions() as usize);
    for partition in 0..log.partitions() {
        let (start, _) = log
            .bounds(partition)
            .await
            .map_err(|e| StoreError::Unavailable(format!("reading the log's bounds: {e}")))?;
        offsets.push(start);
    }
    Ok(Marker::at(offsets))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_keys_progress_is_written_compactly_and_read_in_either_form() {
        let counters = KeyProgress {
            next_sequence: 4,
            last_completed: 3,
            memory: BTreeMap::new(),
        };
        let with_memory = KeyProgress {
            memory: [("seen".to_owned(), "2".to_owned())].into(),
            ..counters.clone()
        };
        let json = serde_json::to_string(&[&counters, &with_memory]).expect("JSON");
        assert_eq!(json, r#"[[4,3],[4,3,{"seen":"2"}]]"#);
        let back: Vec<KeyProgress> = serde_json::from_str(&json).expect("read");
        assert_eq!(back, [counters.clone(), with_memory.clone()]);
        let named: KeyProgress = serde_json::from_str(
            r#"{"next-sequence": 4, "last-completed": 3, "memory": {"seen": "2"}}"#,
        )
        .expect("the earlier form");
        assert_eq!(named, with_memory);
        let error = serde_json::from_str::<KeyProgress>(r#"[4]"#).expect_err("too short");
        assert!(!error.to_string().is_empty());
    }
}
