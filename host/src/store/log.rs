//! The action-state store over a [`Log`]: a cache in front, writes through to the log, and
//! both marker strategies (docs/SEMANTICS.md, "The store and its markers").

use std::collections::btree_map::Entry;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use async_trait::async_trait;
use bytes::Bytes;
use serde::{Deserialize, Serialize};

use super::encoding;
use super::{
    ActionState, ActionStateStore, Digest, Incarnation, KeyScope, Marker, StateKey, StoreError,
    Version,
};
use crate::crash::{self, CrashPoint};
use crate::log::{Log, LogError, Offset};

/// Records read from the log at a time during a rebuild.
const REBUILD_BATCH: usize = 1024;

/// States re-appended at a time by a `refresh` checkpoint, unless set otherwise.
pub const DEFAULT_REFRESH_BATCH: usize = 4096;

/// Records past a shelf partition's live states that a marker lets it hold before it
/// copies its live states to its end (so that the records below them can be deleted):
/// besides this slack, as many as it has live states. Each copy is paid for by at least as
/// many shelvings since the last, so a state is copied about once per shelving, however
/// long it waits.
const SHELF_SLACK: u64 = 4096;

/// How a checkpoint's marker keeps every cached state reachable (docs/SEMANTICS.md, "The
/// store and its markers").
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum MarkerStrategy {
    /// Capture every partition's end offset, then re-append every cached state; the
    /// marker is the captured offsets.
    Refresh,
    /// Per partition, the offset of the oldest latest-write among cached states (or the
    /// end, when it has none). Nothing is written at checkpoint time.
    #[default]
    Offsets,
}

impl MarkerStrategy {
    /// Its name in `[state] marker`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Refresh => "refresh",
            Self::Offsets => "offsets",
        }
    }
}

/// A cached state: its newest version, as the log holds it.
#[derive(Debug)]
struct Cached {
    version: Version,
    /// The version's encoding, as it was appended. A state is written at every durable
    /// call and read back only when a run starts over it, so the cache keeps what it
    /// writes and decodes on reading, rather than keeping a second copy of the state.
    bytes: Bytes,
    /// Where the version lies: what a marker must keep.
    at: At,
}

/// Where a cached state's newest version lies, in its partition.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum At {
    /// In the log: the offset of the version's first write.
    Log(Offset),
    /// On the shelf (its input waits): the offset of its newest copy there.
    Shelf(Offset),
}

impl At {
    /// Which of two records of one version a rebuild keeps: the shelf's over the log's
    /// (the version was shelved after it was written), the newest copy on the shelf (older
    /// ones are let go), the first write in the log (the offset markers count).
    fn preferred(self, other: Self) -> std::cmp::Ordering {
        use std::cmp::Ordering::{Greater, Less};
        match (self, other) {
            (Self::Shelf(a), Self::Shelf(b)) => b.cmp(&a),
            (Self::Shelf(_), Self::Log(_)) => Less,
            (Self::Log(_), Self::Shelf(_)) => Greater,
            (Self::Log(a), Self::Log(b)) => a.cmp(&b),
        }
    }
}

/// Where a state sits among its scope's: they order by sequence, then action, then trigger.
type Within = (u64, String, Digest);

fn within(key: &StateKey) -> Within {
    (key.sequence, key.action.clone(), key.trigger)
}

/// Offsets, each counted as many times as it was added.
#[derive(Debug, Default, Clone)]
struct OffsetCounts {
    counts: BTreeMap<Offset, u32>,
    /// How many are counted, all offsets together.
    len: u64,
}

impl OffsetCounts {
    fn add(&mut self, offset: Offset) {
        *self.counts.entry(offset).or_default() += 1;
        self.len += 1;
    }

    fn remove(&mut self, offset: Offset) {
        if let Some(n) = self.counts.get_mut(&offset) {
            *n -= 1;
            self.len -= 1;
            if *n == 0 {
                self.counts.remove(&offset);
            }
        }
    }

    fn min(&self) -> Option<Offset> {
        self.counts.keys().next().copied()
    }
}

/// One partition's part of the cache, behind its own lock: writes to different partitions
/// do not wait for each other, and a marker's offset for a partition depends on that
/// partition alone.
///
/// It holds the cached states of the scopes that live in the partition; the offsets of
/// their latest writes, so that an `offsets` marker costs one lookup however many states
/// are cached; the offsets of the shelved ones on the shelf; and a floor for each write
/// not yet acknowledged, which a marker must not pass.
#[derive(Debug, Default)]
struct Shard {
    scopes: HashMap<KeyScope, BTreeMap<Within, Cached>>,
    written: OffsetCounts,
    shelved: OffsetCounts,
    in_flight: OffsetCounts,
}

impl Shard {
    fn count(&mut self, at: At) {
        match at {
            At::Log(offset) => self.written.add(offset),
            At::Shelf(offset) => self.shelved.add(offset),
        }
    }

    fn uncount(&mut self, at: At) {
        match at {
            At::Log(offset) => self.written.remove(offset),
            At::Shelf(offset) => self.shelved.remove(offset),
        }
    }

    /// Caches `cached` as the state at `key`, unless a newer version is cached already
    /// (callers write a key from one place at a time, so only a broken caller could bring
    /// an older one: it does not replace the newer).
    fn insert(&mut self, key: &StateKey, cached: Cached) {
        let states = match self.scopes.get_mut(&key.scope) {
            Some(states) => states,
            None => self.scopes.entry(key.scope.clone()).or_default(),
        };
        let (old, new) = match states.entry(within(key)) {
            Entry::Vacant(entry) => (None, entry.insert(cached).at),
            Entry::Occupied(mut entry) => {
                if entry.get().version >= cached.version {
                    return;
                }
                let old = entry.get().at;
                entry.insert(cached);
                (Some(old), entry.get().at)
            }
        };
        if let Some(old) = old {
            self.uncount(old);
        }
        self.count(new);
    }

    /// The states of input `sequence` of `scope` that lie in the log, with their versions.
    fn on_log(&self, scope: &KeyScope, sequence: u64) -> Vec<(Within, Version, Bytes)> {
        let Some(states) = self.scopes.get(scope) else {
            return Vec::new();
        };
        let first = (sequence, String::new(), Digest([0; 32]));
        (states.range(first..))
            .take_while(|(within, _)| within.0 == sequence)
            .filter(|(_, cached)| matches!(cached.at, At::Log(_)))
            .map(|(within, cached)| (within.clone(), cached.version, cached.bytes.clone()))
            .collect()
    }

    /// Every shelved state, with its version.
    fn on_shelf(&self) -> Vec<(KeyScope, Within, Version, Bytes)> {
        (self.scopes.iter())
            .flat_map(|(scope, states)| states.iter().map(move |state| (scope, state)))
            .filter(|(_, (_, cached))| matches!(cached.at, At::Shelf(_)))
            .map(|(scope, (within, cached))| {
                let bytes = cached.bytes.clone();
                (scope.clone(), within.clone(), cached.version, bytes)
            })
            .collect()
    }

    /// Version `version` of the state at `within` of `scope` has a copy on the shelf at
    /// `offset`: it lies there from now on, unless a newer version was written meanwhile.
    fn shelved_at(&mut self, scope: &KeyScope, within: &Within, version: Version, offset: Offset) {
        let Some(cached) = (self.scopes.get_mut(scope)).and_then(|states| states.get_mut(within))
        else {
            return;
        };
        if cached.version != version {
            return;
        }
        let old = std::mem::replace(&mut cached.at, At::Shelf(offset));
        self.uncount(old);
        self.count(At::Shelf(offset));
    }

    /// Drops the states of `scope` up to sequence `up_to`.
    fn prune(&mut self, scope: &KeyScope, up_to: u64) {
        let Some(states) = self.scopes.get_mut(scope) else {
            return;
        };
        let kept = match up_to.checked_add(1) {
            Some(first_kept) => states.split_off(&(first_kept, String::new(), Digest([0; 32]))),
            None => BTreeMap::new(),
        };
        let pruned = std::mem::replace(states, kept);
        if states.is_empty() {
            self.scopes.remove(scope);
        }
        for cached in pruned.into_values() {
            self.uncount(cached.at);
        }
    }

    /// The lowest offset that a marker must keep: the oldest latest-write of a cached
    /// state, or the floor of a write still waiting for the log.
    fn oldest(&self) -> Option<Offset> {
        let written = self.written.min();
        let in_flight = self.in_flight.min();
        written.into_iter().chain(in_flight).min()
    }
}

/// A write on its way to the log, not yet in the cache. While it lives, markers stay at or
/// below `floor`, an offset the write cannot land below; dropped (the write failed or was
/// cancelled), it no longer holds them back.
struct InFlight<'a> {
    store: &'a LogStore,
    partition: u32,
    floor: Offset,
    settled: bool,
}

impl<'a> InFlight<'a> {
    fn start(store: &'a LogStore, partition: u32) -> Self {
        // Every write acknowledged before this one is submitted lies below `acknowledged`,
        // so this one lands at or above it.
        let floor = store.acknowledged[partition as usize].load(Ordering::Acquire);
        store.shard(partition).in_flight.add(floor);
        Self {
            store,
            partition,
            floor,
            settled: false,
        }
    }

    /// The write is acknowledged at `offset`: stop holding markers back, under the same
    /// lock that puts the write in the cache.
    fn settle(mut self, offset: Offset, shard: &mut Shard) {
        self.store.acknowledged[self.partition as usize].fetch_max(offset + 1, Ordering::AcqRel);
        shard.in_flight.remove(self.floor);
        self.settled = true;
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        if !self.settled {
            self.store
                .shard(self.partition)
                .in_flight
                .remove(self.floor);
        }
    }
}

/// An [`ActionStateStore`] over any [`Log`].
#[derive(Debug)]
pub struct LogStore {
    log: Arc<dyn Log>,
    /// Where the states of inputs at a durable wait are set aside (`shelve`): a log of
    /// the same partitions, which markers keep apart from `log`.
    shelf: Option<Arc<dyn Log>>,
    strategy: MarkerStrategy,
    /// The cache, one shard per partition.
    shards: Vec<Mutex<Shard>>,
    next_version: AtomicU64,
    incarnation: Incarnation,
    /// States a refresh re-appends at a time.
    refresh_batch: usize,
    /// Per partition, an offset at or below which no later write can land: above every
    /// write this store has had acknowledged, and every end offset it has read.
    acknowledged: Vec<AtomicU64>,
}

fn log_error(context: &str) -> impl FnOnce(LogError) -> StoreError + '_ {
    move |e| StoreError::Unavailable(format!("{context}: {e}"))
}

impl LogStore {
    /// A store over `log` with an empty cache; call [`rebuild`](ActionStateStore::rebuild)
    /// to load what a marker points at. `incarnation` names the state `log` holds: it is
    /// kept beside the log (a state directory's `incarnation` file, a tenant's, a cluster's
    /// layout) and given again each time the log is opened.
    pub fn new(log: Arc<dyn Log>, strategy: MarkerStrategy, incarnation: Incarnation) -> Self {
        Self {
            incarnation,
            shards: (0..log.partitions()).map(|_| Mutex::default()).collect(),
            acknowledged: (0..log.partitions()).map(|_| AtomicU64::new(0)).collect(),
            log,
            shelf: None,
            strategy,
            next_version: AtomicU64::new(1),
            refresh_batch: DEFAULT_REFRESH_BATCH,
        }
    }

    /// The same store, setting the states of waiting inputs aside on `shelf`, a log of as
    /// many partitions as its own (refused otherwise).
    pub fn with_shelf(mut self, shelf: Arc<dyn Log>) -> Result<Self, StoreError> {
        if shelf.partitions() != self.log.partitions() {
            return Err(StoreError::ShelfChanged {
                expected: self.log.partitions() as usize,
                shelf: shelf.partitions() as usize,
            });
        }
        self.shelf = Some(shelf);
        Ok(self)
    }

    pub fn shelf(&self) -> Option<&Arc<dyn Log>> {
        self.shelf.as_ref()
    }

    /// Re-appends `states` at a time at a `refresh` checkpoint (at least one): each batch is
    /// made durable before the next is sent.
    pub fn with_refresh_batch(mut self, states: usize) -> Self {
        self.refresh_batch = states.max(1);
        self
    }

    pub fn strategy(&self) -> MarkerStrategy {
        self.strategy
    }

    pub fn log(&self) -> &Arc<dyn Log> {
        &self.log
    }

    fn shard(&self, partition: u32) -> MutexGuard<'_, Shard> {
        self.shards[partition as usize]
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn partition_of(&self, scope: &KeyScope) -> u32 {
        scope.partition(self.log.partitions())
    }

    /// Every partition's end offset. A write submitted after this lands at or past it, so
    /// it becomes the floor of later writes: a marker never falls below an earlier one's
    /// ends because of a floor that missed records this store was not told about (a
    /// refresh's appends, or a write whose caller stopped waiting).
    async fn end_offsets(&self) -> Result<Vec<Offset>, StoreError> {
        let mut ends = Vec::with_capacity(self.log.partitions() as usize);
        for (partition, acknowledged) in (0..self.log.partitions()).zip(&self.acknowledged) {
            let (_, end) = self
                .log
                .bounds(partition)
                .await
                .map_err(log_error("reading the log's end offsets"))?;
            acknowledged.fetch_max(end, Ordering::AcqRel);
            ends.push(end);
        }
        Ok(ends)
    }

    async fn refresh(&self) -> Result<Marker, StoreError> {
        let mut offsets = self.end_offsets().await?;
        let mut states: Vec<(u32, Bytes)> = Vec::new();
        for (partition, offset) in (0..self.log.partitions()).zip(offsets.iter_mut()) {
            let shard = self.shard(partition);
            // A write that was in flight when the offsets were captured may land below them
            // and is not in the cache to be re-appended: the marker stays at its floor.
            if let Some(floor) = shard.in_flight.min() {
                *offset = (*offset).min(floor);
            }
            states.extend(
                (shard.scopes.values())
                    .flat_map(BTreeMap::values)
                    .filter(|cached| matches!(cached.at, At::Log(_)))
                    .map(|cached| (partition, cached.bytes.clone())),
            );
        }
        // Every cached state of the log (not the shelf's), in its latest version, at or
        // after the captured offsets. The cache does not change: its entries already hold
        // these versions (and where they were first written is no longer needed). Appended in
        // batches, so that a large cache is not held copied all at once; group commit makes
        // each batch durable together.
        for batch in states.chunks(self.refresh_batch) {
            let batch = batch
                .iter()
                .map(|(partition, bytes)| (*partition, bytes.to_vec()))
                .collect();
            self.log
                .append_many(batch)
                .await
                .map_err(log_error("re-appending the cached states"))?;
            crash::reached(CrashPoint::CheckpointRefresh);
        }
        Ok(Marker::at(offsets))
    }

    async fn oldest_writes(&self) -> Result<Marker, StoreError> {
        let mut offsets = self.end_offsets().await?;
        for (partition, offset) in (0..self.log.partitions()).zip(offsets.iter_mut()) {
            if let Some(oldest) = self.shard(partition).oldest() {
                *offset = (*offset).min(oldest);
            }
        }
        Ok(Marker::at(offsets))
    }

    /// Per shelf partition, the oldest copy of a state still shelved (or the end): taken
    /// after the log's offsets, so that a state shelved in between is kept by one or the
    /// other. A partition whose records run further past its oldest live copy than
    /// [`SHELF_SLACK`] and as many again as it has live states first copies its live states
    /// to its end.
    async fn shelf_offsets(&self) -> Result<Vec<Offset>, StoreError> {
        let Some(shelf) = &self.shelf else {
            return Ok(Vec::new());
        };
        let mut offsets = Vec::with_capacity(shelf.partitions() as usize);
        for partition in 0..shelf.partitions() {
            let (_, mut end) = (shelf.bounds(partition).await)
                .map_err(log_error("reading the shelf's end offsets"))?;
            let (live, oldest) = {
                let shard = self.shard(partition);
                (shard.shelved.len, shard.shelved.min())
            };
            // (A copy shelved since `end` was read may lie past it.)
            if oldest.is_some_and(|oldest| end.saturating_sub(oldest) > SHELF_SLACK + live) {
                self.move_shelf(shelf, partition).await?;
                end = (shelf.bounds(partition).await)
                    .map_err(log_error("reading the shelf's end offsets"))?
                    .1;
            }
            let oldest = self.shard(partition).shelved.min();
            offsets.push(oldest.map_or(end, |oldest| oldest.min(end)));
        }
        Ok(offsets)
    }

    /// Copies every state shelved in `partition` to the shelf's end, in batches, each
    /// durable before the states count as lying there.
    async fn move_shelf(&self, shelf: &Arc<dyn Log>, partition: u32) -> Result<(), StoreError> {
        let states = self.shard(partition).on_shelf();
        for batch in states.chunks(self.refresh_batch) {
            let records = (batch.iter())
                .map(|(_, _, _, bytes)| (partition, bytes.to_vec()))
                .collect();
            let offsets = (shelf.append_many(records).await)
                .map_err(log_error("moving shelved states to the shelf's end"))?;
            let mut shard = self.shard(partition);
            for ((scope, within, version, _), offset) in batch.iter().zip(offsets) {
                shard.shelved_at(scope, within, *version, offset);
            }
        }
        Ok(())
    }
}

/// The state in `bytes`, which the cache holds: this build's encoding of it, made by a
/// write or by a rebuild from what it decoded.
fn decoded(bytes: &Bytes) -> ActionState {
    encoding::decode(bytes).expect("the cache holds only this build's encoding of states")
}

#[async_trait]
impl ActionStateStore for LogStore {
    async fn put(&self, state: &ActionState) -> Result<Version, StoreError> {
        let version = self.next_version.fetch_add(1, Ordering::Relaxed);
        let encoded = encode(state, version)?;
        let bytes = Bytes::copy_from_slice(&encoded);
        let partition = self.partition_of(&state.key.scope);
        let in_flight = InFlight::start(self, partition);
        let size = encoded.len();
        let offset = match self.log.append(partition, encoded).await {
            Ok(offset) => offset,
            Err(LogError::TooLarge { max, .. }) => {
                return Err(StoreError::TooLarge {
                    state: state.key.to_string(),
                    size,
                    max,
                });
            }
            Err(e) => return Err(log_error("writing an action state")(e)),
        };
        // Cached only now that the log has it.
        let mut shard = self.shard(partition);
        in_flight.settle(offset, &mut shard);
        shard.insert(
            &state.key,
            Cached {
                version,
                bytes,
                at: At::Log(offset),
            },
        );
        Ok(version)
    }

    fn incarnation(&self) -> Incarnation {
        self.incarnation
    }

    fn get(&self, key: &StateKey) -> Option<ActionState> {
        // Decoded once the lock is let go: writes to the partition do not wait for it.
        let bytes = {
            let shard = self.shard(self.partition_of(&key.scope));
            shard
                .scopes
                .get(&key.scope)?
                .get(&within(key))?
                .bytes
                .clone()
        };
        Some(decoded(&bytes))
    }

    fn states(&self, scope: &KeyScope) -> Vec<ActionState> {
        let all: Vec<Bytes> = {
            let shard = self.shard(self.partition_of(scope));
            shard
                .scopes
                .get(scope)
                .map(|states| states.values().map(|cached| cached.bytes.clone()).collect())
                .unwrap_or_default()
        };
        all.iter().map(decoded).collect()
    }

    fn scopes(&self) -> Vec<KeyScope> {
        let mut scopes: Vec<KeyScope> = (0..self.log.partitions())
            .flat_map(|partition| {
                let shard = self.shard(partition);
                shard.scopes.keys().cloned().collect::<Vec<_>>()
            })
            .collect();
        scopes.sort_unstable();
        scopes
    }

    async fn prune(&self, scope: &KeyScope, up_to: u64) -> Result<(), StoreError> {
        self.shard(self.partition_of(scope)).prune(scope, up_to);
        Ok(())
    }

    async fn marker(&self) -> Result<Marker, StoreError> {
        let mut marker = match self.strategy {
            MarkerStrategy::Refresh => self.refresh().await?,
            MarkerStrategy::Offsets => self.oldest_writes().await?,
        };
        marker.shelf = self.shelf_offsets().await?;
        Ok(marker)
    }

    async fn shelve(&self, scope: &KeyScope, sequence: u64) -> Result<(), StoreError> {
        let Some(shelf) = &self.shelf else {
            return Ok(());
        };
        let partition = self.partition_of(scope);
        let states = self.shard(partition).on_log(scope, sequence);
        if states.is_empty() {
            return Ok(());
        }
        let records = (states.iter())
            .map(|(_, _, bytes)| (partition, bytes.to_vec()))
            .collect();
        let offsets = (shelf.append_many(records).await).map_err(log_error(
            "setting a waiting input's states aside on the shelf",
        ))?;
        let mut shard = self.shard(partition);
        for ((within, version, _), offset) in states.iter().zip(offsets) {
            shard.shelved_at(scope, within, *version, offset);
        }
        Ok(())
    }

    async fn retain(&self, marker: &Marker) -> Result<(), StoreError> {
        let logs = std::iter::once((&self.log, &marker.offsets))
            .chain(self.shelf.iter().map(|shelf| (shelf, &marker.shelf)));
        for (log, offsets) in logs {
            for (partition, &offset) in (0..log.partitions()).zip(offsets) {
                (log.delete_below(partition, offset).await)
                    .map_err(log_error("deleting records no checkpoint needs"))?;
            }
        }
        Ok(())
    }

    async fn rebuild(&self, marker: &Marker) -> Result<(), StoreError> {
        let partitions = self.log.partitions();
        if marker.offsets.len() != partitions as usize {
            return Err(StoreError::PartitionCountChanged {
                marker: marker.offsets.len(),
                log: partitions as usize,
            });
        }
        let shelf_from = match &self.shelf {
            None if marker.shelf.is_empty() => None,
            None => {
                return Err(StoreError::ShelfChanged {
                    expected: marker.shelf.len(),
                    shelf: 0,
                });
            }
            Some(shelf) if marker.shelf.is_empty() => Some((shelf, None)),
            Some(shelf) if marker.shelf.len() == partitions as usize => {
                Some((shelf, Some(&marker.shelf)))
            }
            Some(_) => {
                return Err(StoreError::ShelfChanged {
                    expected: marker.shelf.len(),
                    shelf: partitions as usize,
                });
            }
        };
        let mut windows = Vec::with_capacity(partitions as usize);
        for (partition, &from) in (0..partitions).zip(&marker.offsets) {
            let log = read_window(&*self.log, partition, from).await?;
            let shelf = match shelf_from {
                None => None,
                Some((shelf, from)) => {
                    let from = match from {
                        Some(from) => from[partition as usize],
                        None => {
                            (shelf.bounds(partition).await)
                                .map_err(log_error("reading the shelf's bounds"))?
                                .0
                        }
                    };
                    Some(read_window(&**shelf, partition, from).await?)
                }
            };
            windows.push(Windows { log, shelf });
        }
        let ends: Vec<Offset> = windows.iter().map(|window| window.log.end).collect();
        let (shards, highest) = newest_states(windows, partitions)?;
        self.next_version.fetch_max(highest + 1, Ordering::Relaxed);
        for (acknowledged, end) in self.acknowledged.iter().zip(ends) {
            acknowledged.fetch_max(end, Ordering::AcqRel);
        }
        // Every shard locked (in partition order, as nothing else holds two) and then
        // replaced: a marker sees the old cache or the new one, never some of each.
        let mut guards: Vec<MutexGuard<'_, Shard>> = (0..partitions)
            .map(|partition| self.shard(partition))
            .collect();
        for (partition, shard) in shards {
            *guards[partition as usize] = shard;
        }
        Ok(())
    }
}

/// Shards decoded from some partitions, each state at its newest version, and the highest
/// version seen among all they held.
type Decoded = (Vec<(u32, Shard)>, Version);

/// `state`'s bytes as version `version` of it.
fn encode(state: &ActionState, version: Version) -> Result<Vec<u8>, StoreError> {
    encoding::encode_as(state, version).map_err(|e| StoreError::Encode {
        key: state.key.to_string(),
        message: e.to_string(),
    })
}

/// What a rebuild reads of one partition: its log's window, and its shelf's.
struct Windows {
    log: Window,
    shelf: Option<Window>,
}

/// The records of one partition from a marker's offset to the end.
struct Window {
    partition: u32,
    records: Vec<crate::log::Record>,
    end: Offset,
}

async fn read_window(log: &dyn Log, partition: u32, from: Offset) -> Result<Window, StoreError> {
    let (start, end) = log
        .bounds(partition)
        .await
        .map_err(log_error("reading the log's bounds"))?;
    if from < start || from > end {
        return Err(StoreError::MarkerOutOfRange {
            partition,
            offset: from,
            start,
            end,
        });
    }
    let mut records = Vec::new();
    let mut next = from;
    while next < end {
        let batch = log
            .read(partition, next, REBUILD_BATCH)
            .await
            .map_err(log_error("reading the log"))?;
        let Some(last) = batch.last() else { break };
        next = last.offset + 1;
        records.extend(batch);
    }
    Ok(Window {
        partition,
        records,
        end,
    })
}

/// Decodes the windows on every core (a state's versions are all in its own partition, so
/// partitions are independent) into a shard each, holding each state's newest version.
/// Returns the shards and the highest version seen.
fn newest_states(windows: Vec<Windows>, partitions: u32) -> Result<Decoded, StoreError> {
    let threads = std::thread::available_parallelism().map_or(1, usize::from);
    let mut shares: Vec<Vec<Windows>> = (0..threads).map(|_| Vec::new()).collect();
    for (i, window) in windows.into_iter().enumerate() {
        shares[i % threads].push(window);
    }
    let results: Vec<Result<Decoded, StoreError>> = std::thread::scope(|scope| {
        let handles: Vec<_> = shares
            .into_iter()
            .map(|share| scope.spawn(move || decode_share(share, partitions)))
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(StoreError::Unavailable(
                        "a decoding thread panicked".to_owned(),
                    ))
                })
            })
            .collect()
    });
    let mut all = Vec::new();
    let mut highest = 0;
    for result in results {
        let (shards, share_highest) = result?;
        all.extend(shards);
        highest = highest.max(share_highest);
    }
    Ok((all, highest))
}

/// Decodes `share` (windows of a log of `partitions` partitions, and of its shelf) into a
/// shard each.
fn decode_share(share: Vec<Windows>, partitions: u32) -> Result<Decoded, StoreError> {
    let mut shards = Vec::with_capacity(share.len());
    let mut highest = 0;
    for Windows { log, shelf } in share {
        let partition = log.partition;
        let shelved = shelf.into_iter().flat_map(|window| window.records);
        let records = (log.records.into_iter().map(|record| (false, record)))
            .chain(shelved.map(|record| (true, record)));
        let mut states = Vec::new();
        for (on_shelf, record) in records {
            let offset = record.offset;
            let decode_error = |message: String| StoreError::Decode {
                partition,
                offset,
                message,
            };
            let state =
                encoding::decode(&record.payload).map_err(|e| decode_error(e.to_string()))?;
            // The cache looks a state up in its scope's partition, and its marker counts the
            // offsets of each partition's own states.
            let home = state.key.scope.partition(partitions);
            if home != partition {
                return Err(StoreError::Misplaced {
                    partition,
                    offset,
                    key: state.key.to_string(),
                    home,
                });
            }
            highest = highest.max(state.version);
            // A state of an older encoding is kept in this build's, which a refresh writes.
            let bytes = if record.payload.first() == Some(&encoding::ENCODING) {
                Bytes::from(record.payload)
            } else {
                Bytes::from(encoding::encode(&state).map_err(|e| decode_error(e.to_string()))?)
            };
            let at = if on_shelf {
                At::Shelf(offset)
            } else {
                At::Log(offset)
            };
            let cached = Cached {
                version: state.version,
                bytes,
                at,
            };
            states.push((state.key, cached));
        }
        // Newest version first within a key, the record of it to keep first (a refresh
        // writes the same version again, a shelving copies it), then keep the first of each
        // key.
        states.sort_unstable_by(|(a, x), (b, y)| {
            a.cmp(b)
                .then(y.version.cmp(&x.version))
                .then(x.at.preferred(y.at))
        });
        states.dedup_by(|later, first| later.0 == first.0);
        let mut shard = Shard::default();
        // Sorted by key, so each scope's states come together, in order.
        for (key, cached) in states {
            shard.count(cached.at);
            let StateKey {
                scope,
                sequence,
                action,
                trigger,
            } = key;
            shard
                .scopes
                .entry(scope)
                .or_default()
                .insert((sequence, action, trigger), cached);
        }
        shards.push((partition, shard));
    }
    Ok((shards, highest))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::{LogStore, MarkerStrategy};
    use crate::log::MemoryLog;

    /// A store over in-memory logs, with a shelf when `shelf`.
    fn store(partitions: u32, strategy: MarkerStrategy, shelf: bool) -> Arc<LogStore> {
        let log = Arc::new(MemoryLog::new(partitions));
        let store = LogStore::new(log, strategy, crate::store::Incarnation::random());
        if !shelf {
            return Arc::new(store);
        }
        let shelf = Arc::new(MemoryLog::new(partitions));
        Arc::new(store.with_shelf(shelf).expect("as many partitions"))
    }

    mod offsets {
        use super::*;
        crate::store_conformance_tests!(|p| store(p, MarkerStrategy::Offsets, true));
    }

    mod refresh {
        use super::*;
        crate::store_conformance_tests!(|p| store(p, MarkerStrategy::Refresh, true));
    }

    mod without_a_shelf {
        use super::*;
        crate::store_conformance_tests!(|p| store(p, MarkerStrategy::Offsets, false));
    }

    use crate::event::Event;
    use crate::log::Log;
    use crate::store::{
        ActionState, ActionStateStore, Digest, KeyScope, Marker, StateKey, StoreError, encoding,
    };

    fn state(key: &str) -> ActionState {
        let key = StateKey {
            scope: KeyScope::new("t", "a", key),
            sequence: 1,
            action: "act".to_owned(),
            trigger: Digest::of(&[b"input"]),
        };
        ActionState {
            version: 7,
            ..ActionState::new(key, Event::new("input", "{}"))
        }
    }

    /// A state an older build wrote (encoding 1, JSON) is re-appended by a refresh in this
    /// build's encoding: the log moves on from old encodings as states are refreshed.
    #[tokio::test]
    async fn a_refresh_writes_states_of_older_encodings_in_this_builds() {
        let log = Arc::new(MemoryLog::new(2));
        let old = state("k");
        let partition = old.key.scope.partition(2);
        let mut json = vec![1];
        json.extend(serde_json::to_vec(&old).expect("JSON"));
        log.append(partition, json).await.expect("append");
        let store = LogStore::new(
            Arc::clone(&log) as Arc<dyn Log>,
            MarkerStrategy::Refresh,
            crate::store::Incarnation::random(),
        );
        store
            .rebuild(&Marker::at(vec![0, 0]))
            .await
            .expect("rebuild");
        assert_eq!(store.get(&old.key), Some(old.clone()));

        store.marker().await.expect("refresh");
        let records = log.read(partition, 1, 10).await.expect("read");
        assert_eq!(records.len(), 1, "the state was re-appended");
        assert_eq!(records[0].payload[0], encoding::ENCODING);
        assert_eq!(encoding::decode(&records[0].payload).expect("decodes"), old);
    }

    /// A state found in another partition than its scope's cannot be cached where it would
    /// be looked for (or counted by markers): the rebuild says so.
    #[tokio::test]
    async fn a_state_in_the_wrong_partition_fails_the_rebuild_naming_it() {
        let log = Arc::new(MemoryLog::new(2));
        let misplaced = state("k");
        let home = misplaced.key.scope.partition(2);
        let elsewhere = 1 - home;
        log.append(elsewhere, encoding::encode(&misplaced).expect("encodes"))
            .await
            .expect("append");
        let store = LogStore::new(
            Arc::clone(&log) as Arc<dyn Log>,
            MarkerStrategy::Offsets,
            crate::store::Incarnation::random(),
        );
        let error = store
            .rebuild(&Marker::at(vec![0, 0]))
            .await
            .expect_err("a misplaced state");
        assert!(matches!(error, StoreError::Misplaced { .. }), "{error:?}");
        let message = error.to_string();
        assert!(
            message.contains(&format!("partition {elsewhere}, offset 0"))
                && message.contains(&format!("belongs in partition {home}"))
                && message.contains("t/a/k"),
            "{message}"
        );
    }

    /// A store over in-memory logs of one partition with a shelf, and both logs.
    fn shelved(strategy: MarkerStrategy) -> (LogStore, Arc<MemoryLog>, Arc<MemoryLog>) {
        let (log, shelf) = (Arc::new(MemoryLog::new(1)), Arc::new(MemoryLog::new(1)));
        let store = LogStore::new(
            Arc::clone(&log) as Arc<dyn Log>,
            strategy,
            crate::store::Incarnation::random(),
        )
        .with_shelf(Arc::clone(&shelf) as Arc<dyn Log>)
        .expect("as many partitions");
        (store, log, shelf)
    }

    fn input(key: &str, sequence: u64) -> ActionState {
        let mut state = state(key);
        state.key.sequence = sequence;
        state
    }

    async fn end(log: &MemoryLog) -> u64 {
        log.bounds(0).await.expect("bounds").1
    }

    /// Finished inputs of key "busy", pruned as a checkpoint would.
    async fn traffic(store: &LogStore, inputs: std::ops::RangeInclusive<u64>, shelve: bool) {
        for sequence in inputs {
            let done = input("busy", sequence);
            store.put(&done).await.expect("put");
            if shelve {
                store
                    .shelve(&done.key.scope, sequence)
                    .await
                    .expect("shelve");
            }
            store.prune(&done.key.scope, sequence).await.expect("prune");
        }
    }

    /// A shelved input's records no longer hold the log's marker back (`offsets`), nor are
    /// they appended again (`refresh`).
    #[tokio::test]
    async fn a_shelved_input_holds_no_marker_back() {
        for strategy in [MarkerStrategy::Offsets, MarkerStrategy::Refresh] {
            let (store, log, shelf) = shelved(strategy);
            let waiting = input("waits", 1);
            store.put(&waiting).await.expect("put");
            store.shelve(&waiting.key.scope, 1).await.expect("shelve");
            assert_eq!(end(&shelf).await, 1, "{strategy:?}: one copy on the shelf");
            traffic(&store, 1..=10, false).await;
            let before = end(&log).await;
            let marker = store.marker().await.expect("marker");
            assert_eq!(marker.offsets, vec![before], "{strategy:?}: the log's end");
            assert_eq!(marker.shelf, vec![0], "{strategy:?}: the shelved copy");
            assert_eq!(
                end(&log).await,
                before,
                "{strategy:?}: nothing appended again"
            );
            assert_eq!(end(&shelf).await, 1, "{strategy:?}: nor shelved again");
        }
    }

    /// Shelved inputs that woke and finished leave dead copies on the shelf: once they
    /// outnumber the live ones past the slack, a marker moves the live copies to the end,
    /// so that retention deletes the rest.
    #[tokio::test]
    async fn the_shelf_moves_its_live_states_on_so_that_the_rest_can_be_deleted() {
        let (store, _, shelf) = shelved(MarkerStrategy::Offsets);
        let waiting = input("waits", 1);
        store.put(&waiting).await.expect("put");
        store.shelve(&waiting.key.scope, 1).await.expect("shelve");
        traffic(&store, 1..=super::SHELF_SLACK, true).await;
        let marker = store.marker().await.expect("marker");
        assert_eq!(marker.shelf, vec![0], "within the slack: nothing moves");
        traffic(
            &store,
            super::SHELF_SLACK + 1..=super::SHELF_SLACK + 2,
            true,
        )
        .await;
        let shelved = end(&shelf).await;
        let marker = store.marker().await.expect("marker");
        assert_eq!(end(&shelf).await, shelved + 1, "the one live state moved");
        assert_eq!(marker.shelf, vec![shelved]);
        store.retain(&marker).await.expect("retain");
        assert_eq!(shelf.bounds(0).await.expect("bounds").0, shelved);
        store
            .prune(&waiting.key.scope, u64::MAX)
            .await
            .expect("prune");
        store.rebuild(&marker).await.expect("rebuild");
        let restored = store.get(&waiting.key).map(|state| state.key);
        assert_eq!(restored, Some(waiting.key), "restored from its new copy");
    }
}
