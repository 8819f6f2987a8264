//! The in-memory reference store: the cache in front of an in-memory partitioned log.
//!
//! Nothing survives the process; it is the model the durable stores are tested against and
//! the store of a one-off `rewind run` without a state directory.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;

use super::state::in_scope;
use super::{
    ActionState, ActionStateStore, Incarnation, KeyScope, Marker, StateKey, StoreError, Version,
};

/// Partitions an [`InMemoryStore`] has unless told otherwise.
pub const DEFAULT_PARTITIONS: u32 = 4;

#[derive(Debug)]
struct Cached {
    /// Shared with the log's copy of the same write.
    state: Arc<ActionState>,
    /// Where its newest version lies.
    at: At,
}

/// Where a cached state's newest version lies: the offset of its write in its partition
/// of the log, or of its copy on the shelf.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum At {
    Log(u64),
    Shelf(u64),
}

/// One partition of an in-memory log: its records from `start` on.
#[derive(Debug, Default)]
struct Partition {
    start: u64,
    records: VecDeque<Arc<ActionState>>,
}

impl Partition {
    fn end(&self) -> u64 {
        self.start + self.records.len() as u64
    }

    fn push(&mut self, state: Arc<ActionState>) -> u64 {
        self.records.push_back(state);
        self.end() - 1
    }

    fn delete_below(&mut self, offset: u64) {
        while self.start < offset && self.records.pop_front().is_some() {
            self.start += 1;
        }
    }

    /// Its records from `from` on, with their offsets; `None` when it does not hold `from`.
    fn read_from(&self, from: u64) -> Option<impl Iterator<Item = (u64, &Arc<ActionState>)>> {
        let skip = usize::try_from(from.checked_sub(self.start)?).ok()?;
        (from <= self.end()).then(|| (from..).zip(self.records.iter().skip(skip)))
    }
}

#[derive(Debug, Default)]
struct Inner {
    /// The "log": every write not deleted by retention, per partition.
    partitions: Vec<Partition>,
    /// The shelf: copies of the states of waiting inputs, per partition.
    shelf: Vec<Partition>,
    cache: BTreeMap<StateKey, Cached>,
}

/// An [`ActionStateStore`] whose log lives in memory. Markers use the `offsets` strategy:
/// per partition, the offset of the oldest newest-write among cached states.
#[derive(Debug)]
pub struct InMemoryStore {
    inner: Mutex<Inner>,
    next_version: AtomicU64,
    /// Drawn when the store is made: its state lives as long as it does.
    incarnation: Incarnation,
}

impl Default for InMemoryStore {
    fn default() -> Self {
        Self::new(DEFAULT_PARTITIONS)
    }
}

impl InMemoryStore {
    pub fn new(partitions: u32) -> Self {
        let partitions = partitions.max(1);
        Self {
            inner: Mutex::new(Inner {
                partitions: (0..partitions).map(|_| Partition::default()).collect(),
                shelf: (0..partitions).map(|_| Partition::default()).collect(),
                cache: BTreeMap::new(),
            }),
            next_version: AtomicU64::new(1),
            incarnation: Incarnation::random(),
        }
    }

    /// The same store, of the state `incarnation` names: for tests that stand for one state
    /// over several stores (as if records had been lost with a process).
    pub fn with_incarnation(mut self, incarnation: Incarnation) -> Self {
        self.incarnation = incarnation;
        self
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic while holding the lock leaves only whole writes behind: keep going.
        self.inner
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

fn partition_count(inner: &Inner) -> u32 {
    u32::try_from(inner.partitions.len()).unwrap_or(u32::MAX)
}

#[async_trait]
impl ActionStateStore for InMemoryStore {
    async fn put(&self, state: &ActionState) -> Result<Version, StoreError> {
        let version = self.next_version.fetch_add(1, Ordering::Relaxed);
        let state = Arc::new(ActionState {
            version,
            ..state.clone()
        });
        let mut inner = self.lock();
        let partition = state.key.scope.partition(partition_count(&inner)) as usize;
        let offset = inner.partitions[partition].push(Arc::clone(&state));
        let at = At::Log(offset);
        inner.cache.insert(state.key.clone(), Cached { state, at });
        Ok(version)
    }

    fn incarnation(&self) -> Incarnation {
        self.incarnation
    }

    fn get(&self, key: &StateKey) -> Option<ActionState> {
        self.lock()
            .cache
            .get(key)
            .map(|c| ActionState::clone(&c.state))
    }

    fn states(&self, scope: &KeyScope) -> Vec<ActionState> {
        in_scope(&self.lock().cache, scope, u64::MAX)
            .map(|(_, c)| ActionState::clone(&c.state))
            .collect()
    }

    fn scopes(&self) -> Vec<KeyScope> {
        let inner = self.lock();
        let mut scopes: Vec<KeyScope> = inner.cache.keys().map(|k| k.scope.clone()).collect();
        scopes.dedup();
        scopes
    }

    async fn prune(&self, scope: &KeyScope, up_to: u64) -> Result<(), StoreError> {
        let mut inner = self.lock();
        let keys: Vec<StateKey> = in_scope(&inner.cache, scope, up_to)
            .map(|(key, _)| key.clone())
            .collect();
        for key in keys {
            inner.cache.remove(&key);
        }
        Ok(())
    }

    async fn marker(&self) -> Result<Marker, StoreError> {
        let inner = self.lock();
        let count = partition_count(&inner);
        let mut offsets: Vec<u64> = inner.partitions.iter().map(Partition::end).collect();
        let mut shelf: Vec<u64> = inner.shelf.iter().map(Partition::end).collect();
        for cached in inner.cache.values() {
            let partition = cached.state.key.scope.partition(count) as usize;
            let (offsets, offset) = match cached.at {
                At::Log(offset) => (&mut offsets, offset),
                At::Shelf(offset) => (&mut shelf, offset),
            };
            offsets[partition] = offsets[partition].min(offset);
        }
        Ok(Marker { offsets, shelf })
    }

    async fn rebuild(&self, marker: &Marker) -> Result<(), StoreError> {
        let mut inner = self.lock();
        let partitions = inner.partitions.len();
        if marker.offsets.len() != partitions {
            return Err(StoreError::PartitionCountChanged {
                marker: marker.offsets.len(),
                log: partitions,
            });
        }
        if !marker.shelf.is_empty() && marker.shelf.len() != partitions {
            return Err(StoreError::ShelfChanged {
                expected: marker.shelf.len(),
                shelf: partitions,
            });
        }
        let mut newest: HashMap<StateKey, Cached> = HashMap::new();
        let logs = (inner.partitions.iter().zip(&marker.offsets))
            .map(|(log, &from)| (log, from, false))
            .chain(inner.shelf.iter().enumerate().map(|(partition, shelf)| {
                let from = marker.shelf.get(partition).copied().unwrap_or(shelf.start);
                (shelf, from, true)
            }));
        for (partition, (log, from, on_shelf)) in logs.enumerate() {
            let records = log.read_from(from).ok_or(StoreError::MarkerOutOfRange {
                partition: u32::try_from(partition % partitions).unwrap_or(u32::MAX),
                offset: from,
                start: log.start,
                end: log.end(),
            })?;
            for (offset, state) in records {
                let at = if on_shelf {
                    At::Shelf(offset)
                } else {
                    At::Log(offset)
                };
                // The newest version; of one version, its newest copy on the shelf.
                let keep = newest.get(&state.key).is_none_or(|seen| {
                    seen.state.version < state.version
                        || (seen.state.version == state.version && on_shelf)
                });
                if keep {
                    let state = Arc::clone(state);
                    newest.insert(state.key.clone(), Cached { state, at });
                }
            }
        }
        inner.cache = newest.into_iter().collect();
        Ok(())
    }

    async fn shelve(&self, scope: &KeyScope, sequence: u64) -> Result<(), StoreError> {
        let mut inner = self.lock();
        let count = partition_count(&inner);
        let keys: Vec<StateKey> = in_scope(&inner.cache, scope, sequence)
            .filter(|(key, cached)| key.sequence == sequence && matches!(cached.at, At::Log(_)))
            .map(|(key, _)| key.clone())
            .collect();
        for key in keys {
            let Inner { shelf, cache, .. } = &mut *inner;
            let Some(cached) = cache.get_mut(&key) else {
                continue;
            };
            let offset = shelf[key.scope.partition(count) as usize].push(Arc::clone(&cached.state));
            cached.at = At::Shelf(offset);
        }
        Ok(())
    }

    async fn retain(&self, marker: &Marker) -> Result<(), StoreError> {
        let mut inner = self.lock();
        for (log, &offset) in inner.partitions.iter_mut().zip(&marker.offsets) {
            log.delete_below(offset);
        }
        for (shelf, &offset) in inner.shelf.iter_mut().zip(&marker.shelf) {
            shelf.delete_below(offset);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::InMemoryStore;

    crate::store_conformance_tests!(|partitions| Arc::new(InMemoryStore::new(partitions)));
}
