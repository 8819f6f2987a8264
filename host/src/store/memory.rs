//! The in-memory reference store: the cache in front of an in-memory partitioned log.
//!
//! Nothing survives the process; it is the model the durable stores are tested against and
//! the store of a one-off `rewind run` without a state directory.

use std::collections::{BTreeMap, HashMap};
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
    /// Offset of this state's newest write in its partition.
    offset: u64,
}

#[derive(Debug, Default)]
struct Inner {
    /// The "log": every write ever made, per partition; offset = index.
    partitions: Vec<Vec<Arc<ActionState>>>,
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
        let partitions = (0..partitions.max(1)).map(|_| Vec::new()).collect();
        Self {
            inner: Mutex::new(Inner {
                partitions,
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

fn offset_of(len: usize) -> u64 {
    len as u64
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
        let log = &mut inner.partitions[partition];
        let offset = offset_of(log.len());
        log.push(Arc::clone(&state));
        inner
            .cache
            .insert(state.key.clone(), Cached { state, offset });
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
        let mut offsets: Vec<u64> = inner
            .partitions
            .iter()
            .map(|log| offset_of(log.len()))
            .collect();
        for cached in inner.cache.values() {
            let partition = cached.state.key.scope.partition(count) as usize;
            offsets[partition] = offsets[partition].min(cached.offset);
        }
        Ok(Marker { offsets })
    }

    async fn rebuild(&self, marker: &Marker) -> Result<(), StoreError> {
        let mut inner = self.lock();
        if marker.offsets.len() != inner.partitions.len() {
            return Err(StoreError::PartitionCountChanged {
                marker: marker.offsets.len(),
                log: inner.partitions.len(),
            });
        }
        let mut newest: HashMap<StateKey, Cached> = HashMap::new();
        for (partition, (log, &from)) in inner.partitions.iter().zip(&marker.offsets).enumerate() {
            let end = offset_of(log.len());
            if from > end {
                return Err(StoreError::MarkerOutOfRange {
                    partition: u32::try_from(partition).unwrap_or(u32::MAX),
                    offset: from,
                    start: 0,
                    end,
                });
            }
            let start = usize::try_from(from).unwrap_or(usize::MAX);
            for (offset, state) in log.iter().enumerate().skip(start) {
                let keep = newest
                    .get(&state.key)
                    .is_none_or(|seen| seen.state.version < state.version);
                if keep {
                    newest.insert(
                        state.key.clone(),
                        Cached {
                            state: Arc::clone(state),
                            offset: offset_of(offset),
                        },
                    );
                }
            }
        }
        inner.cache = newest.into_iter().collect();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::InMemoryStore;

    crate::store_conformance_tests!(|partitions| Arc::new(InMemoryStore::new(partitions)));
}
