//! The action-state store over a [`Log`]: a cache in front, writes through to the log, and
//! both marker strategies of DESIGN.md.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use super::encoding;
use super::{ActionState, ActionStateStore, KeyScope, Marker, StateKey, StoreError, Version};
use crate::log::{Log, LogError, Offset};

/// Records read from the log at a time during a rebuild.
const REBUILD_BATCH: usize = 1024;

/// How a checkpoint's marker keeps every cached state reachable (DESIGN.md).
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

#[derive(Debug)]
struct Cached {
    state: Arc<ActionState>,
    /// The state as written, kept so that a refresh does not encode it again.
    encoded: Arc<Vec<u8>>,
    /// Offset of this version's first write in its partition.
    offset: Offset,
}

/// An [`ActionStateStore`] over any [`Log`].
#[derive(Debug)]
pub struct LogStore {
    log: Arc<dyn Log>,
    strategy: MarkerStrategy,
    cache: Mutex<BTreeMap<StateKey, Cached>>,
    next_version: AtomicU64,
}

fn log_error(context: &str) -> impl FnOnce(LogError) -> StoreError + '_ {
    move |e| StoreError::Unavailable(format!("{context}: {e}"))
}

impl LogStore {
    /// A store over `log` with an empty cache; call [`rebuild`](ActionStateStore::rebuild)
    /// to load what a marker points at.
    pub fn new(log: Arc<dyn Log>, strategy: MarkerStrategy) -> Self {
        Self {
            log,
            strategy,
            cache: Mutex::new(BTreeMap::new()),
            next_version: AtomicU64::new(1),
        }
    }

    pub fn strategy(&self) -> MarkerStrategy {
        self.strategy
    }

    pub fn log(&self) -> &Arc<dyn Log> {
        &self.log
    }

    fn cache(&self) -> MutexGuard<'_, BTreeMap<StateKey, Cached>> {
        self.cache
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn partition_of(&self, key: &StateKey) -> u32 {
        key.scope.partition(self.log.partitions())
    }

    /// Caches `state` written at `offset`, unless the cache already holds a newer version
    /// (a refresh racing a write must not bring an older version back).
    fn remember(&self, state: Arc<ActionState>, encoded: Arc<Vec<u8>>, offset: Offset) {
        let mut cache = self.cache();
        let newer_cached = cache
            .get(&state.key)
            .is_some_and(|cached| cached.state.version >= state.version);
        if !newer_cached {
            cache.insert(
                state.key.clone(),
                Cached {
                    state,
                    encoded,
                    offset,
                },
            );
        }
    }

    async fn end_offsets(&self) -> Result<Vec<Offset>, StoreError> {
        let mut ends = Vec::with_capacity(self.log.partitions() as usize);
        for partition in 0..self.log.partitions() {
            let (_, end) = self
                .log
                .bounds(partition)
                .await
                .map_err(log_error("reading the log's end offsets"))?;
            ends.push(end);
        }
        Ok(ends)
    }

    async fn refresh(&self) -> Result<Marker, StoreError> {
        let offsets = self.end_offsets().await?;
        let states: Vec<(u32, Arc<Vec<u8>>)> = self
            .cache()
            .iter()
            .map(|(key, cached)| (self.partition_of(key), Arc::clone(&cached.encoded)))
            .collect();
        // Every cached state, in its latest version, at or after the captured offsets. The
        // cache does not change: its entries already hold these versions.
        for (partition, encoded) in states {
            self.log
                .append(partition, encoded.as_ref().clone())
                .await
                .map_err(log_error("re-appending a cached state"))?;
        }
        Ok(Marker { offsets })
    }

    async fn oldest_writes(&self) -> Result<Marker, StoreError> {
        let mut offsets = self.end_offsets().await?;
        for (key, cached) in self.cache().iter() {
            let partition = self.partition_of(key) as usize;
            offsets[partition] = offsets[partition].min(cached.offset);
        }
        Ok(Marker { offsets })
    }
}

#[async_trait]
impl ActionStateStore for LogStore {
    async fn put(&self, state: &ActionState) -> Result<Version, StoreError> {
        let version = self.next_version.fetch_add(1, Ordering::Relaxed);
        let state = Arc::new(ActionState {
            version,
            ..state.clone()
        });
        let encoded = Arc::new(encoding::encode(&state).map_err(|e| StoreError::Encode {
            key: state.key.to_string(),
            message: e.to_string(),
        })?);
        let partition = self.partition_of(&state.key);
        let offset = self
            .log
            .append(partition, encoded.as_ref().clone())
            .await
            .map_err(log_error("writing an action state"))?;
        self.remember(state, encoded, offset);
        Ok(version)
    }

    fn get(&self, key: &StateKey) -> Option<ActionState> {
        self.cache()
            .get(key)
            .map(|cached| ActionState::clone(&cached.state))
    }

    fn states(&self, scope: &KeyScope) -> Vec<ActionState> {
        self.cache()
            .iter()
            .filter(|(key, _)| &key.scope == scope)
            .map(|(_, cached)| ActionState::clone(&cached.state))
            .collect()
    }

    fn scopes(&self) -> Vec<KeyScope> {
        let mut scopes: Vec<KeyScope> = self.cache().keys().map(|k| k.scope.clone()).collect();
        scopes.dedup();
        scopes
    }

    async fn prune(&self, scope: &KeyScope, up_to: u64) -> Result<(), StoreError> {
        self.cache()
            .retain(|key, _| !(&key.scope == scope && key.sequence <= up_to));
        Ok(())
    }

    async fn marker(&self) -> Result<Marker, StoreError> {
        match self.strategy {
            MarkerStrategy::Refresh => self.refresh().await,
            MarkerStrategy::Offsets => self.oldest_writes().await,
        }
    }

    async fn rebuild(&self, marker: &Marker) -> Result<(), StoreError> {
        let partitions = self.log.partitions();
        if marker.offsets.len() != partitions as usize {
            return Err(StoreError::PartitionCountChanged {
                marker: marker.offsets.len(),
                log: partitions as usize,
            });
        }
        let mut newest: HashMap<StateKey, Cached> = HashMap::new();
        let mut highest = 0;
        for (partition, &from) in (0..partitions).zip(&marker.offsets) {
            let (start, end) = self
                .log
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
            let mut next = from;
            while next < end {
                let records = self
                    .log
                    .read(partition, next, REBUILD_BATCH)
                    .await
                    .map_err(log_error("reading the log"))?;
                let Some(last) = records.last() else { break };
                next = last.offset + 1;
                for record in records {
                    let state =
                        encoding::decode(&record.payload).map_err(|e| StoreError::Decode {
                            partition,
                            offset: record.offset,
                            message: e.to_string(),
                        })?;
                    highest = highest.max(state.version);
                    let keep = newest
                        .get(&state.key)
                        .is_none_or(|seen| seen.state.version < state.version);
                    if keep {
                        newest.insert(
                            state.key.clone(),
                            Cached {
                                state: Arc::new(state),
                                encoded: Arc::new(record.payload),
                                offset: record.offset,
                            },
                        );
                    }
                }
            }
        }
        self.next_version.fetch_max(highest + 1, Ordering::Relaxed);
        *self.cache() = newest.into_iter().collect();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::{LogStore, MarkerStrategy};
    use crate::log::MemoryLog;

    mod offsets {
        use super::*;
        crate::store_conformance_tests!(|partitions| Arc::new(LogStore::new(
            Arc::new(MemoryLog::new(partitions)),
            MarkerStrategy::Offsets
        )));
    }

    mod refresh {
        use super::*;
        crate::store_conformance_tests!(|partitions| Arc::new(LogStore::new(
            Arc::new(MemoryLog::new(partitions)),
            MarkerStrategy::Refresh
        )));
    }
}
