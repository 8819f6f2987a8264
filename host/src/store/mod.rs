//! The action-state store: where durable calls are recorded and found again.
//!
//! A store keeps every unpruned [`ActionState`] in a cache and writes through to a durable
//! log: a write is acknowledged by the log before the cache changes. Checkpoints ask it for
//! a [`Marker`]; recovery rebuilds the cache from one. See docs/SEMANTICS.md, "The store
//! and its markers".

#[cfg(any(test, feature = "testing"))]
pub mod conformance;
pub mod encoding;
mod log;
mod memory;
mod state;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

pub use log::{DEFAULT_REFRESH_BATCH, LogStore, MarkerStrategy};
pub use memory::InMemoryStore;
pub use state::{
    ActionState, Ambient, BadIncarnation, CallOutcome, CallRecord, Completion, Digest, Incarnation,
    KeyScope, MemoryWrite, RandomKey, SIGNAL_IDS_ACTION, SIGNALS_ACTION, StateKey, Version, Wait,
    Waiting,
};

/// The directory of a store's shelf inside its file log's directory (beside the
/// partitions' directories).
pub const SHELF_DIR: &str = "shelf";

/// Where recovery starts reading the log: one offset per partition; and, for a store with
/// a shelf, where it starts reading the shelf (empty: from the shelf's start, as a marker
/// of a build before shelves reads it).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Marker {
    pub offsets: Vec<u64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub shelf: Vec<u64>,
}

impl Marker {
    /// A marker of the log alone (the shelf, if any, read from its start).
    pub fn at(offsets: Vec<u64>) -> Self {
        Self {
            offsets,
            shelf: Vec::new(),
        }
    }
}

/// Why a store operation failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error(
        "the marker has {marker} partitions but the log has {log}: the partition count changed \
         since the checkpoint was taken; start with the partition count the checkpoint was taken \
         with, or with an empty state directory"
    )]
    PartitionCountChanged { marker: usize, log: usize },
    #[error(
        "partition {partition}: the marker needs offset {offset}, but the log holds only \
         [{start}, {end}); the data recovery needs is gone (retention deleted it, or the log was \
         replaced); restore the log or start from an older checkpoint"
    )]
    MarkerOutOfRange {
        partition: u32,
        offset: u64,
        start: u64,
        end: u64,
    },
    #[error(
        "the shelf (where waiting inputs' states are set aside) has {shelf} partitions where \
         {expected} are expected: it was made with another partition count, or the store was \
         opened without the shelf the checkpoint was taken with"
    )]
    ShelfChanged { expected: usize, shelf: usize },
    #[error("cannot encode the state {key}: {message}")]
    Encode { key: String, message: String },
    #[error(
        "partition {partition}, offset {offset}: not an action state this build can read: \
         {message}"
    )]
    Decode {
        partition: u32,
        offset: u64,
        message: String,
    },
    #[error(
        "partition {partition}, offset {offset}: the state {key} belongs in partition {home}; \
         the log's partitions were rearranged since it was written (states are placed by a \
         hash of their scope over the partition count)"
    )]
    Misplaced {
        partition: u32,
        offset: u64,
        key: String,
        home: u32,
    },
    /// The state is larger than the log takes in one record: writing it again fails the
    /// same way (the run that made it must write less).
    #[error("the state {state} is {size} bytes, more than the {max} the log takes in one record")]
    TooLarge {
        state: String,
        size: usize,
        max: usize,
    },
    /// The log did not acknowledge a write or a read (disk full, server gone, ...).
    #[error("the log is unavailable: {0}")]
    Unavailable(String),
}

/// A cached action-state store over a durable log.
///
/// Callers never write the same [`StateKey`] from two places at once: one input per key is
/// in flight, and an action state belongs to one run. Different keys are written concurrently.
#[async_trait]
pub trait ActionStateStore: Send + Sync + std::fmt::Debug {
    /// Makes a copy of `state` the newest version of the state at `state.key`, and returns the version
    /// the store gave it (greater than every version it gave before; `state.version` is
    /// ignored).
    ///
    /// When this returns `Ok`, the write is durable in the log and [`get`](Self::get) returns
    /// it. A state larger than the log takes in one record is refused with
    /// [`StoreError::TooLarge`], and nothing is written. On any other `Err` the cache is unchanged; the write may still have reached the log (an
    /// acknowledgement can be lost), which is harmless because a later write of the same key
    /// carries a higher version.
    async fn put(&self, state: &ActionState) -> Result<Version, StoreError>;

    /// The incarnation of the state this store holds: the same for as long as the store's
    /// log lives (a state directory, a tenant, a cluster), another for a new one. An action
    /// state written for the first time belongs to it (`durable::DurableCalls` sets it);
    /// the store writes each state's incarnation as it is given, and never changes it.
    fn incarnation(&self) -> Incarnation;

    /// The newest version of the state at `key`, from the cache; `None` when there is none
    /// or it was pruned. Never reads the log.
    fn get(&self, key: &StateKey) -> Option<ActionState>;

    /// Every cached state of `scope`, ordered by sequence, then action, then trigger.
    fn states(&self, scope: &KeyScope) -> Vec<ActionState>;

    /// Every scope that has at least one cached state, in order.
    fn scopes(&self) -> Vec<KeyScope>;

    /// Drops from the cache every state of `scope` whose sequence is at most `up_to`.
    ///
    /// Called when a completed checkpoint covers those inputs. Log data is not deleted (that
    /// is retention's job), so a rebuild from an older marker can bring pruned states back;
    /// recovery prunes again with the checkpoint's sequences.
    async fn prune(&self, scope: &KeyScope, up_to: u64) -> Result<(), StoreError>;

    /// A marker from which [`rebuild`](Self::rebuild) restores every state cached when this
    /// call began, at its newest version.
    ///
    /// Writes that run concurrently with this call are restored too if they were
    /// acknowledged before it returned. On `Err`, the cache is unchanged and any previous
    /// marker stays valid.
    async fn marker(&self) -> Result<Marker, StoreError>;

    /// Replaces the cache with the states the log holds from `marker` to its end, and those
    /// its shelf holds from the marker's shelf offsets, keeping the highest version of each.
    ///
    /// Fails without changing the cache when the marker does not fit the log: another
    /// partition count ([`StoreError::PartitionCountChanged`], [`StoreError::ShelfChanged`])
    /// or an offset the log no longer holds ([`StoreError::MarkerOutOfRange`]).
    async fn rebuild(&self, marker: &Marker) -> Result<(), StoreError>;

    /// Sets aside the cached states of input `sequence` of `scope`, which waits (a durable
    /// wait) and will not write them until it runs again: the store copies them to its
    /// shelf, a log of their own, after which no [`marker`](Self::marker) keeps the log's
    /// records where they were written (so a long wait holds no retention back, and a
    /// `refresh` marker does not append them again). A later [`put`](Self::put) of one of
    /// them makes its new version a state of the log again, as any other.
    ///
    /// When this returns `Ok`, a rebuild from any marker taken after it restores those
    /// states, however far [`retain`](Self::retain) deleted the log. A store without a
    /// shelf keeps them where they are. On `Err`, the states stay where they were: nothing
    /// is lost, and their records hold retention back until the input runs again.
    async fn shelve(&self, scope: &KeyScope, sequence: u64) -> Result<(), StoreError>;

    /// Retention: deletes what no rebuild from `marker` or a later marker of this store
    /// reads (log and shelf records below the marker's offsets; whole segments, so some may
    /// stay). A rebuild from an earlier marker may fail after it with
    /// [`StoreError::MarkerOutOfRange`].
    async fn retain(&self, marker: &Marker) -> Result<(), StoreError>;
}
