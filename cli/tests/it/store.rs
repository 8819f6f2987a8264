//! The log-backed store at checkpoint and recovery time: the behaviours the upstream fix
//! (Flink Agents PR 1175) listed, plus the regression it said was missing.

use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use async_trait::async_trait;
use rewind_host::event::Event;
use rewind_host::log::{FileLog, FileLogOptions, Log, LogError, MemoryLog, Offset, Record};
use rewind_host::store::{
    ActionState, ActionStateStore, CallOutcome, CallRecord, Completion, Digest, KeyScope, LogStore,
    Marker, MarkerStrategy, StateKey, StoreError, encoding,
};
use tokio::sync::{Notify, oneshot};

/// A log that can be told to fail or to hold an append, around a real one.
#[derive(Debug)]
struct Controlled {
    inner: Arc<dyn Log>,
    appends: AtomicU64,
    /// Appends from this count on fail.
    fail_from: AtomicU64,
    /// The next append waits for this before it goes through.
    hold: Mutex<Option<oneshot::Receiver<()>>>,
    held: Notify,
    /// The next append goes through, then waits for this before it is acknowledged.
    hold_ack: Mutex<Option<oneshot::Receiver<()>>>,
}

impl Controlled {
    fn new(inner: Arc<dyn Log>) -> Arc<Self> {
        Arc::new(Self {
            inner,
            appends: AtomicU64::new(0),
            fail_from: AtomicU64::new(u64::MAX),
            hold: Mutex::new(None),
            held: Notify::new(),
            hold_ack: Mutex::new(None),
        })
    }

    /// Lets `n` more appends through, then fails every one after them.
    fn fail_after(&self, n: u64) {
        self.fail_from
            .store(self.appends.load(Ordering::SeqCst) + n, Ordering::SeqCst);
    }

    fn heal(&self) {
        self.fail_from.store(u64::MAX, Ordering::SeqCst);
    }

    /// Holds the next append until the returned sender fires (or is dropped).
    fn hold_next(&self) -> oneshot::Sender<()> {
        let (release, hold) = oneshot::channel();
        *self.hold.lock().expect("lock") = Some(hold);
        release
    }

    /// Lets the next append into the log, then holds its acknowledgement until the returned
    /// sender fires (or is dropped).
    fn hold_next_ack(&self) -> oneshot::Sender<()> {
        let (release, hold) = oneshot::channel();
        *self.hold_ack.lock().expect("lock") = Some(hold);
        release
    }

    fn appended(&self) -> u64 {
        self.appends.load(Ordering::SeqCst)
    }
}

#[async_trait]
impl Log for Controlled {
    fn partitions(&self) -> u32 {
        self.inner.partitions()
    }
    fn max_record(&self, partition: u32) -> usize {
        self.inner.max_record(partition)
    }
    async fn append(&self, partition: u32, payload: Vec<u8>) -> Result<Offset, LogError> {
        let held = self.hold.lock().expect("lock").take();
        if let Some(hold) = held {
            self.held.notify_one();
            let _ = hold.await;
        }
        let n = self.appends.fetch_add(1, Ordering::SeqCst);
        if n >= self.fail_from.load(Ordering::SeqCst) {
            return Err(LogError::Io {
                context: "test".to_owned(),
                source: std::io::Error::other("injected append failure"),
            });
        }
        let offset = self.inner.append(partition, payload).await;
        let held = self.hold_ack.lock().expect("lock").take();
        if let Some(hold) = held {
            self.held.notify_one();
            let _ = hold.await;
        }
        offset
    }
    async fn read(
        &self,
        partition: u32,
        from: Offset,
        max: usize,
    ) -> Result<Vec<Record>, LogError> {
        self.inner.read(partition, from, max).await
    }
    async fn bounds(&self, partition: u32) -> Result<(Offset, Offset), LogError> {
        self.inner.bounds(partition).await
    }
    async fn delete_below(&self, partition: u32, offset: Offset) -> Result<(), LogError> {
        self.inner.delete_below(partition, offset).await
    }
}

fn key(name: &str, sequence: u64) -> StateKey {
    StateKey {
        scope: KeyScope::new("t", "agent", name),
        sequence,
        action: "act".to_owned(),
        trigger: Digest::of(&[b"input"]),
    }
}

/// A state of `calls` succeeded calls, completed or not.
fn state(key: StateKey, calls: usize, completed: bool) -> ActionState {
    let mut state = ActionState::new(key, Event::new("input", "{}"));
    for i in 0..calls {
        state.calls.push(CallRecord {
            function: "f".to_owned(),
            args_digest: Digest::of(&[&i.to_le_bytes()]),
            idempotency_key: format!("rw-{i}"),
            outcome: CallOutcome::Succeeded(format!("{{\"i\":{i}}}")),
        });
    }
    if completed {
        state.completion = Some(Completion::default());
    }
    state
}

async fn put(store: &LogStore, state: ActionState) -> u64 {
    store.put(&state).await.expect("put")
}

/// Every state a fresh store over `log` rebuilds from `marker`: (key, version, calls).
async fn recovered(
    log: Arc<dyn Log>,
    strategy: MarkerStrategy,
    marker: &Marker,
) -> Vec<(String, u64, usize)> {
    let store = LogStore::new(log, strategy, rewind_host::store::Incarnation::random());
    store.rebuild(marker).await.expect("rebuild");
    let mut states: Vec<_> = store
        .scopes()
        .iter()
        .flat_map(|scope| store.states(scope))
        .map(|s| {
            (
                format!("{}#{}", s.key.scope.key, s.key.sequence),
                s.version,
                s.calls.len(),
            )
        })
        .collect();
    states.sort();
    states
}

/// The states the log holds at or after `marker`, decoded: (key, version).
async fn appended_since(log: &dyn Log, marker: &Marker) -> Vec<(String, u64)> {
    let mut found = Vec::new();
    for (partition, &from) in (0..log.partitions()).zip(&marker.offsets) {
        for record in log.read(partition, from, usize::MAX).await.expect("read") {
            let state = encoding::decode(&record.payload).expect("a state");
            found.push((
                format!("{}#{}", state.key.scope.key, state.key.sequence),
                state.version,
            ));
        }
    }
    found.sort();
    found
}

const BOTH: [MarkerStrategy; 2] = [MarkerStrategy::Refresh, MarkerStrategy::Offsets];

#[tokio::test]
async fn checkpoint_refreshes_latest_states_after_capturing_offsets() {
    let log: Arc<dyn Log> = Arc::new(MemoryLog::new(4));
    let store = LogStore::new(
        Arc::clone(&log),
        MarkerStrategy::Refresh,
        rewind_host::store::Incarnation::random(),
    );
    put(&store, state(key("pending", 1), 1, false)).await;
    let latest = put(&store, state(key("pending", 1), 2, false)).await;
    let done = put(&store, state(key("done", 1), 1, true)).await;
    let mut ends = Vec::new();
    for partition in 0..log.partitions() {
        ends.push(log.bounds(partition).await.expect("bounds").1);
    }

    let marker = store.marker().await.expect("checkpoint");
    assert_eq!(
        marker.offsets, ends,
        "the marker is the end offsets captured first"
    );
    // Every cached state is in [marker, end), in its latest version, pending or completed.
    assert_eq!(
        appended_since(&*log, &marker).await,
        [
            ("done#1".to_owned(), done),
            ("pending#1".to_owned(), latest)
        ]
    );
    assert_eq!(
        recovered(log, MarkerStrategy::Refresh, &marker).await,
        [
            ("done#1".to_owned(), done, 1),
            ("pending#1".to_owned(), latest, 2)
        ]
    );
}

#[tokio::test]
async fn checkpoint_does_not_refresh_pruned_or_diverged_states() {
    let log: Arc<dyn Log> = Arc::new(MemoryLog::new(2));
    let store = LogStore::new(
        Arc::clone(&log),
        MarkerStrategy::Refresh,
        rewind_host::store::Incarnation::random(),
    );
    put(&store, state(key("old", 1), 1, true)).await;
    store
        .prune(&KeyScope::new("t", "agent", "old"), 1)
        .await
        .expect("prune");
    // A divergence rewrote this state with fewer records: only that version may come back.
    put(&store, state(key("diverged", 1), 3, false)).await;
    let truncated = put(&store, state(key("diverged", 1), 1, false)).await;

    let marker = store.marker().await.expect("checkpoint");
    assert_eq!(
        appended_since(&*log, &marker).await,
        [("diverged#1".to_owned(), truncated)],
        "the pruned state is not re-appended, the diverged one only in its latest version"
    );
}

#[tokio::test]
async fn empty_cache_checkpoint_appends_nothing() {
    for strategy in BOTH {
        let log = Controlled::new(Arc::new(MemoryLog::new(4)));
        let store = LogStore::new(
            log.clone(),
            strategy,
            rewind_host::store::Incarnation::random(),
        );
        let marker = store.marker().await.expect("checkpoint");
        assert_eq!(log.appended(), 0, "{strategy:?}");
        assert_eq!(marker.offsets, [0, 0, 0, 0]);
    }
}

#[tokio::test]
async fn failed_checkpoint_refresh_retains_cache_for_retry() {
    let log = Controlled::new(Arc::new(MemoryLog::new(2)));
    let store = LogStore::new(
        log.clone(),
        MarkerStrategy::Refresh,
        rewind_host::store::Incarnation::random(),
    );
    for i in 0..6 {
        put(&store, state(key(&format!("k{i}"), 1), 1, i % 2 == 0)).await;
    }
    let cache_before: Vec<ActionState> = store
        .scopes()
        .iter()
        .flat_map(|s| store.states(s))
        .collect();

    log.fail_after(2);
    let error = store
        .marker()
        .await
        .expect_err("the refresh fails part way");
    assert!(
        error.to_string().contains("injected append failure"),
        "{error}"
    );
    let cache_after: Vec<ActionState> = store
        .scopes()
        .iter()
        .flat_map(|s| store.states(s))
        .collect();
    assert_eq!(
        cache_after, cache_before,
        "a failed checkpoint leaves the cache as it was"
    );

    log.heal();
    let appended = log.appended();
    let marker = store.marker().await.expect("the retry succeeds");
    assert_eq!(
        log.appended() - appended,
        6,
        "the retry re-appends everything"
    );
    assert_eq!(
        recovered(log, MarkerStrategy::Refresh, &marker).await.len(),
        6
    );
}

#[tokio::test]
async fn cancelled_checkpoint_leaves_store_consistent() {
    let log = Controlled::new(Arc::new(MemoryLog::new(2)));
    let store = Arc::new(LogStore::new(
        log.clone(),
        MarkerStrategy::Refresh,
        rewind_host::store::Incarnation::random(),
    ));
    for i in 0..4 {
        put(&store, state(key(&format!("k{i}"), 1), 2, false)).await;
    }
    let _release = log.hold_next();
    let checkpoint = tokio::spawn({
        let store = Arc::clone(&store);
        async move { store.marker().await }
    });
    log.held.notified().await;
    checkpoint.abort(); // dropped mid-refresh
    assert!(checkpoint.await.is_err_and(|e| e.is_cancelled()));

    let latest = put(&store, state(key("k0", 1), 3, false)).await;
    let marker = store.marker().await.expect("a retry succeeds");
    let states = recovered(log, MarkerStrategy::Refresh, &marker).await;
    assert_eq!(states.len(), 4);
    assert!(
        states.contains(&("k0#1".to_owned(), latest, 3)),
        "{states:?}"
    );
}

#[tokio::test]
async fn restore_previous_checkpoint_after_later_refresh_partially_fails() {
    let log = Controlled::new(Arc::new(MemoryLog::new(2)));
    let store = LogStore::new(
        log.clone(),
        MarkerStrategy::Refresh,
        rewind_host::store::Incarnation::random(),
    );
    put(&store, state(key("a", 1), 1, false)).await;
    put(&store, state(key("b", 1), 1, true)).await;
    let first = store.marker().await.expect("checkpoint 1");

    // Work goes on; checkpoint 2's refresh appends some states, then fails.
    put(&store, state(key("a", 1), 2, false)).await;
    put(&store, state(key("c", 1), 1, false)).await;
    log.fail_after(1);
    store
        .marker()
        .await
        .expect_err("checkpoint 2 fails part way");
    log.heal();

    // Recovery from checkpoint 1 finds every state, each with all its records.
    let states = recovered(log, MarkerStrategy::Refresh, &first).await;
    let calls: Vec<(String, usize)> = states.into_iter().map(|(k, _, n)| (k, n)).collect();
    assert_eq!(
        calls,
        [
            ("a#1".to_owned(), 2),
            ("b#1".to_owned(), 1),
            ("c#1".to_owned(), 1)
        ]
    );
}

#[tokio::test]
async fn refresh_racing_a_write_keeps_the_newer_version() {
    let log = Controlled::new(Arc::new(MemoryLog::new(1)));
    let store = Arc::new(LogStore::new(
        log.clone(),
        MarkerStrategy::Refresh,
        rewind_host::store::Incarnation::random(),
    ));
    put(&store, state(key("a", 1), 1, false)).await;

    // The refresh is about to re-append version 1 when a new version is written.
    let release = log.hold_next();
    let checkpoint = tokio::spawn({
        let store = Arc::clone(&store);
        async move { store.marker().await }
    });
    log.held.notified().await;
    let newer = put(&store, state(key("a", 1), 2, false)).await;
    release.send(()).expect("release");
    let marker = checkpoint.await.expect("join").expect("checkpoint");

    assert_eq!(store.get(&key("a", 1)).map(|s| s.version), Some(newer));
    let states = recovered(log, MarkerStrategy::Refresh, &marker).await;
    assert_eq!(
        states,
        [("a#1".to_owned(), newer, 2)],
        "the newer version wins"
    );
}

/// Found by killing `rewind` after a call, before its record (tests/it/kill.rs): a state
/// in the log whose write was not yet acknowledged when a checkpoint was taken was in
/// neither the cache nor the window the marker opened, and the call ran again.
#[tokio::test]
async fn checkpoint_while_a_write_awaits_its_acknowledgement_keeps_it_reachable() {
    for strategy in BOTH {
        let log = Controlled::new(Arc::new(MemoryLog::new(1)));
        let store = Arc::new(LogStore::new(
            log.clone(),
            strategy,
            rewind_host::store::Incarnation::random(),
        ));
        put(&store, state(key("done", 1), 1, true)).await;
        store.prune(&key("done", 1).scope, 1).await.expect("prune");

        // The write is in the log; its acknowledgement has not reached the store.
        let release = log.hold_next_ack();
        let write = tokio::spawn({
            let store = Arc::clone(&store);
            async move { put(&store, state(key("a", 1), 1, false)).await }
        });
        log.held.notified().await;
        let marker = store.marker().await.expect("checkpoint");
        release.send(()).expect("release");
        let version = write.await.expect("join");

        let states = recovered(log, strategy, &marker).await;
        assert_eq!(
            states,
            [("a#1".to_owned(), version, 1)],
            "{strategy:?}: the state written during the checkpoint is recovered"
        );
    }
}

/// Found by `retention_keeps_what_the_oldest_checkpoint_needs`: a write's floor was the
/// store's last acknowledged offset, which a refresh's appends do not move, so a marker
/// taken during a write fell below earlier markers, and below what retention had deleted.
#[tokio::test]
async fn a_marker_taken_during_a_write_never_falls_below_an_earlier_one() {
    for strategy in BOTH {
        let log = Controlled::new(Arc::new(MemoryLog::new(1)));
        let store = Arc::new(LogStore::new(
            log.clone(),
            strategy,
            rewind_host::store::Incarnation::random(),
        ));
        put(&store, state(key("a", 1), 1, false)).await;
        store.marker().await.expect("first checkpoint");
        let earlier = store.marker().await.expect("second checkpoint");

        let release = log.hold_next_ack();
        let write = tokio::spawn({
            let store = Arc::clone(&store);
            async move { put(&store, state(key("b", 1), 1, false)).await }
        });
        log.held.notified().await;
        let during = store.marker().await.expect("checkpoint during the write");
        release.send(()).expect("release");
        write.await.expect("join");
        assert!(
            during.offsets[0] >= earlier.offsets[0],
            "{strategy:?}: {during:?} after {earlier:?}"
        );
    }
}

#[tokio::test]
async fn offsets_strategy_marker_points_at_oldest_unpruned_write() {
    let log: Arc<dyn Log> = Arc::new(MemoryLog::new(1));
    let store = LogStore::new(
        Arc::clone(&log),
        MarkerStrategy::Offsets,
        rewind_host::store::Incarnation::random(),
    );
    put(&store, state(key("k", 1), 1, true)).await; // offset 0
    put(&store, state(key("k", 2), 1, false)).await; // offset 1
    put(&store, state(key("k", 3), 1, false)).await; // offset 2
    put(&store, state(key("k", 2), 2, false)).await; // offset 3: #2's latest write
    assert_eq!(store.marker().await.expect("marker").offsets, [0]);
    store
        .prune(&KeyScope::new("t", "agent", "k"), 1)
        .await
        .expect("prune");
    assert_eq!(
        store.marker().await.expect("marker").offsets,
        [2],
        "#3's write is now the oldest"
    );
    store
        .prune(&KeyScope::new("t", "agent", "k"), 3)
        .await
        .expect("prune");
    assert_eq!(
        store.marker().await.expect("marker").offsets,
        [4],
        "nothing cached: the end"
    );
}

#[tokio::test]
async fn rebuild_state_with_recovery_markers() {
    for strategy in BOTH {
        let dir = tempfile::tempdir().expect("tempdir");
        let options = FileLogOptions {
            partitions: 1,
            ..FileLogOptions::default()
        };
        let marker = {
            let (log, _) = FileLog::open(dir.path(), options).expect("open");
            let store = LogStore::new(
                Arc::new(log),
                strategy,
                rewind_host::store::Incarnation::random(),
            );
            put(&store, state(key("k", 1), 2, true)).await;
            put(&store, state(key("k", 2), 1, false)).await;
            let marker = store.marker().await.expect("checkpoint");
            put(&store, state(key("k", 2), 3, false)).await; // after the checkpoint
            marker
        }; // the process stops here
        let (log, _) = FileLog::open(dir.path(), options).expect("reopen");
        let states = recovered(Arc::new(log), strategy, &marker).await;
        let calls: Vec<(String, usize)> = states.into_iter().map(|(k, _, n)| (k, n)).collect();
        assert_eq!(
            calls,
            [("k#1".to_owned(), 2), ("k#2".to_owned(), 3)],
            "{strategy:?}"
        );
    }
}

#[tokio::test]
async fn multi_partition_recovery() {
    for strategy in BOTH {
        let dir = tempfile::tempdir().expect("tempdir");
        let options = FileLogOptions {
            partitions: 8,
            ..FileLogOptions::default()
        };
        let (marker, expected) = {
            let (log, _) = FileLog::open(dir.path(), options).expect("open");
            let store = LogStore::new(
                Arc::new(log),
                strategy,
                rewind_host::store::Incarnation::random(),
            );
            for i in 0..64 {
                put(
                    &store,
                    state(key(&format!("key-{i:02}"), 1), 1 + i % 3, i % 4 == 0),
                )
                .await;
            }
            let marker = store.marker().await.expect("checkpoint");
            let partitions_used = store
                .scopes()
                .iter()
                .map(|s| s.partition(8))
                .collect::<std::collections::BTreeSet<_>>()
                .len();
            assert!(partitions_used > 4, "the keys spread over partitions");
            let mut expected: Vec<(String, usize)> = store
                .scopes()
                .iter()
                .flat_map(|s| store.states(s))
                .map(|s| {
                    (
                        format!("{}#{}", s.key.scope.key, s.key.sequence),
                        s.calls.len(),
                    )
                })
                .collect();
            expected.sort();
            (marker, expected)
        };
        let (log, _) = FileLog::open(dir.path(), options).expect("reopen");
        let states = recovered(Arc::new(log), strategy, &marker).await;
        let calls: Vec<(String, usize)> = states.into_iter().map(|(k, _, n)| (k, n)).collect();
        assert_eq!(calls, expected, "{strategy:?}");
    }
}

#[tokio::test]
async fn data_loss_below_marker_fails_with_clear_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    let options = FileLogOptions {
        partitions: 1,
        segment_bytes: 512,
        ..FileLogOptions::default()
    };
    let (log, _) = FileLog::open(dir.path(), options).expect("open");
    let log: Arc<dyn Log> = Arc::new(log);
    let store = LogStore::new(
        Arc::clone(&log),
        MarkerStrategy::Offsets,
        rewind_host::store::Incarnation::random(),
    );
    for i in 0..20 {
        put(&store, state(key(&format!("k{i}"), 1), 1, false)).await;
    }
    let marker = store.marker().await.expect("checkpoint");
    assert_eq!(marker.offsets, [0]);
    log.delete_below(0, 15)
        .await
        .expect("retention past the marker");
    let error = LogStore::new(
        log,
        MarkerStrategy::Offsets,
        rewind_host::store::Incarnation::random(),
    )
    .rebuild(&marker)
    .await
    .expect_err("the marker's data is gone");
    assert!(
        matches!(
            error,
            StoreError::MarkerOutOfRange {
                partition: 0,
                offset: 0,
                ..
            }
        ),
        "{error}"
    );
    let message = error.to_string();
    assert!(
        message.contains("retention deleted it") && message.contains("older checkpoint"),
        "{message}"
    );
}

#[tokio::test]
async fn partition_count_change_fails_with_clear_error() {
    let log: Arc<dyn Log> = Arc::new(MemoryLog::new(4));
    let store = LogStore::new(
        Arc::clone(&log),
        MarkerStrategy::Refresh,
        rewind_host::store::Incarnation::random(),
    );
    put(&store, state(key("k", 1), 1, false)).await;
    let marker = store.marker().await.expect("checkpoint");
    let error = LogStore::new(
        Arc::new(MemoryLog::new(8)),
        MarkerStrategy::Refresh,
        rewind_host::store::Incarnation::random(),
    )
    .rebuild(&marker)
    .await
    .expect_err("another partition count");
    assert!(
        matches!(
            error,
            StoreError::PartitionCountChanged { marker: 4, log: 8 }
        ),
        "{error}"
    );
    assert!(
        error
            .to_string()
            .contains("start with the partition count the checkpoint was taken with"),
        "{error}"
    );
}
