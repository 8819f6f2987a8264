//! Checkpoints: a consistent cut of an agent's progress, and where they are kept.
//!
//! A checkpoint records the input position, each key's next and last completed sequence,
//! the inputs accepted but not complete, each key's short-term memory, and the store's
//! marker (DESIGN.md, "Checkpoints and recovery"). Recovery starts from the newest one.

mod file;

use std::collections::BTreeMap;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

pub use file::FileCheckpoints;

use crate::store::Marker;

/// Numbers checkpoints; a later checkpoint has a higher id.
pub type CheckpointId = u64;

/// One key's progress at the cut.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct KeyProgress {
    /// The sequence the key's next accepted input gets.
    pub next_sequence: u64,
    /// Every input of the key up to this sequence is complete (0: none yet).
    pub last_completed: u64,
    /// The key's short-term memory as of `last_completed`.
    pub memory: BTreeMap<String, String>,
}

/// An input accepted before the cut and not complete at it: run again on recovery.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct PendingInput {
    pub key: String,
    pub sequence: u64,
    /// JSON text.
    pub payload: String,
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
