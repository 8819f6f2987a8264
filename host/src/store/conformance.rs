//! The conformance suite every [`ActionStateStore`] must pass.
//!
//! Each case takes a factory that makes a fresh, empty store with the given number of
//! partitions. A backend runs the whole suite with [`store_conformance_tests!`]:
//!
//! ```ignore
//! rewind_host::store_conformance_tests!(|partitions| std::sync::Arc::new(MyStore::new(partitions)));
//! ```
//!
//! [`store_conformance_tests!`]: crate::store_conformance_tests

use std::sync::Arc;

use super::{
    ActionState, ActionStateStore, CallOutcome, CallRecord, Completion, Digest, Incarnation,
    KeyScope, Marker, StateKey, StoreError,
};
use crate::event::Event;

/// Makes a fresh, empty store with this many partitions.
pub trait Factory: Fn(u32) -> Arc<dyn ActionStateStore> {}
impl<F: Fn(u32) -> Arc<dyn ActionStateStore>> Factory for F {}

/// Generates one `#[tokio::test]` per conformance case for the store `$factory` makes.
#[macro_export]
macro_rules! store_conformance_tests {
    ($factory:expr) => {
        $crate::store_conformance_tests!(@cases $factory;
            put_assigns_growing_versions_and_get_returns_the_newest,
            get_of_an_unknown_key_is_none,
            states_lists_one_scope_in_order,
            scopes_lists_every_scope_with_states,
            prune_drops_only_that_scope_up_to_the_sequence,
            rebuild_from_a_marker_restores_every_cached_state,
            rebuild_refuses_another_partition_count,
            rebuild_refuses_an_offset_the_log_does_not_hold,
            a_state_keeps_the_incarnation_it_was_written_in,
            shelved_states_outlive_retention_of_the_log_they_were_written_in,
            a_state_written_after_it_was_shelved_comes_back_at_its_new_version,
            retain_deletes_what_the_marker_no_longer_needs,
        );
    };
    (@cases $factory:expr; $($case:ident),* $(,)?) => {
        $(
            // Multi-threaded, so that a factory may block on setting up a remote log.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                $crate::store::conformance::$case(&$factory).await;
            }
        )*
    };
}

fn key(scope: &str, sequence: u64, action: &str) -> StateKey {
    StateKey {
        scope: KeyScope::new("t", "a", scope),
        sequence,
        action: action.to_owned(),
        trigger: Digest::of(&[b"input"]),
    }
}

fn state(key: StateKey, calls: usize) -> ActionState {
    let mut state = ActionState::new(key, Event::new("input", "{}"));
    for i in 0..calls {
        state.calls.push(CallRecord {
            function: "f".to_owned(),
            args_digest: Digest::of(&[&i.to_le_bytes()]),
            idempotency_key: format!("k{i}"),
            outcome: CallOutcome::Succeeded(format!("{{\"i\":{i}}}")),
        });
    }
    state
}

async fn put(store: &dyn ActionStateStore, state: ActionState) -> u64 {
    store.put(&state).await.expect("put")
}

/// Strips the store-assigned version, to compare contents.
fn content(mut state: ActionState) -> ActionState {
    state.version = 0;
    state
}

pub async fn put_assigns_growing_versions_and_get_returns_the_newest(factory: &dyn Factory) {
    let store = factory(4);
    let k = key("x", 1, "act");
    let v1 = put(&*store, state(k.clone(), 1)).await;
    let v2 = put(&*store, state(k.clone(), 2)).await;
    let other = put(&*store, state(key("y", 1, "act"), 0)).await;
    assert!(
        v1 < v2 && v2 < other,
        "versions must grow: {v1}, {v2}, {other}"
    );
    let got = store.get(&k).expect("the state is there");
    assert_eq!(got.version, v2);
    assert_eq!(got.calls.len(), 2, "the newest write wins");
}

pub async fn get_of_an_unknown_key_is_none(factory: &dyn Factory) {
    let store = factory(4);
    put(&*store, state(key("x", 1, "act"), 1)).await;
    assert!(store.get(&key("x", 2, "act")).is_none());
    assert!(store.get(&key("x", 1, "other")).is_none());
}

pub async fn states_lists_one_scope_in_order(factory: &dyn Factory) {
    let store = factory(4);
    // Neighbours in key order on both sides: "w" < "x" < "x0" < "y".
    for (scope, sequence, action) in [
        ("x", 2, "b"),
        ("y", 1, "a"),
        ("x0", 0, "a"),
        ("x", 1, "b"),
        ("w", 9, "z"),
        ("x", 1, "a"),
    ] {
        put(&*store, state(key(scope, sequence, action), 0)).await;
    }
    let listed: Vec<(u64, String)> = store
        .states(&KeyScope::new("t", "a", "x"))
        .into_iter()
        .map(|s| (s.key.sequence, s.key.action))
        .collect();
    assert_eq!(
        listed,
        [
            (1, "a".to_owned()),
            (1, "b".to_owned()),
            (2, "b".to_owned())
        ]
    );
}

pub async fn scopes_lists_every_scope_with_states(factory: &dyn Factory) {
    let store = factory(4);
    for scope in ["y", "x", "y"] {
        put(&*store, state(key(scope, 1, "a"), 0)).await;
    }
    let scopes: Vec<String> = store.scopes().into_iter().map(|s| s.key).collect();
    assert_eq!(scopes, ["x", "y"]);
}

pub async fn prune_drops_only_that_scope_up_to_the_sequence(factory: &dyn Factory) {
    let store = factory(4);
    for sequence in 1..=3 {
        put(&*store, state(key("x", sequence, "a"), 1)).await;
        put(&*store, state(key("x0", sequence, "a"), 1)).await;
        put(&*store, state(key("y", sequence, "a"), 1)).await;
    }
    store
        .prune(&KeyScope::new("t", "a", "x"), 2)
        .await
        .expect("prune");
    assert!(store.get(&key("x", 1, "a")).is_none());
    assert!(store.get(&key("x", 2, "a")).is_none());
    assert!(
        store.get(&key("x", 3, "a")).is_some(),
        "later sequences stay"
    );
    for other in ["x0", "y"] {
        assert_eq!(
            store.states(&KeyScope::new("t", "a", other)).len(),
            3,
            "other scopes stay"
        );
    }
}

pub async fn rebuild_from_a_marker_restores_every_cached_state(factory: &dyn Factory) {
    let store = factory(4);
    let pending = key("x", 1, "a");
    put(&*store, state(pending.clone(), 1)).await;
    put(&*store, state(pending.clone(), 2)).await;
    let mut done = state(key("y", 1, "a"), 1);
    done.completion = Some(Completion::default());
    put(&*store, done).await;
    let marker = store.marker().await.expect("marker");
    let late = key("z", 1, "a");
    put(&*store, state(late.clone(), 1)).await;

    let before: Vec<ActionState> = store
        .scopes()
        .iter()
        .flat_map(|s| store.states(s))
        .collect();
    // Empty the cache, so that only the log can bring the states back.
    for scope in store.scopes() {
        store.prune(&scope, u64::MAX).await.expect("prune");
    }
    assert!(store.scopes().is_empty());
    store.rebuild(&marker).await.expect("rebuild");
    let after: Vec<ActionState> = store
        .scopes()
        .iter()
        .flat_map(|s| store.states(s))
        .collect();
    assert_eq!(
        after.into_iter().map(content).collect::<Vec<_>>(),
        before.into_iter().map(content).collect::<Vec<_>>(),
        "every state, pending and completed, at its newest version"
    );
    assert_eq!(store.get(&pending).map(|s| s.calls.len()), Some(2));
    assert!(
        store.get(&late).is_some(),
        "writes after the marker are restored too"
    );
}

pub async fn rebuild_refuses_another_partition_count(factory: &dyn Factory) {
    let store = factory(4);
    put(&*store, state(key("x", 1, "a"), 1)).await;
    let marker = Marker::at(vec![0; 3]);
    let error = store.rebuild(&marker).await.expect_err("refused");
    assert!(
        matches!(
            error,
            StoreError::PartitionCountChanged { marker: 3, log: 4 }
        ),
        "{error}"
    );
    assert!(
        error.to_string().contains("partition count changed"),
        "{error}"
    );
    assert!(
        store.get(&key("x", 1, "a")).is_some(),
        "a refused rebuild changes nothing"
    );
}

pub async fn rebuild_refuses_an_offset_the_log_does_not_hold(factory: &dyn Factory) {
    let store = factory(2);
    put(&*store, state(key("x", 1, "a"), 1)).await;
    let marker = Marker::at(vec![u64::MAX / 2; 2]);
    let error = store.rebuild(&marker).await.expect_err("refused");
    assert!(
        matches!(error, StoreError::MarkerOutOfRange { .. }),
        "{error}"
    );
    assert!(
        store.get(&key("x", 1, "a")).is_some(),
        "a refused rebuild changes nothing"
    );
}

/// The store's incarnation does not change; a state comes back, from the cache and from
/// the log, with the incarnation it was written in (or none, as an earlier build wrote it).
pub async fn a_state_keeps_the_incarnation_it_was_written_in(factory: &dyn Factory) {
    let store = factory(2);
    assert_eq!(store.incarnation(), store.incarnation());
    let marker = store.marker().await.expect("marker");
    let mine = key("mine", 1, "a");
    let mut written = state(mine.clone(), 1);
    written.incarnation = Some(store.incarnation());
    put(&*store, written).await;
    let other = key("other", 1, "a");
    let mut elsewhere = state(other.clone(), 1);
    elsewhere.incarnation = Some(Incarnation([9; 16]));
    put(&*store, elsewhere).await;
    let earlier = key("earlier", 1, "a");
    put(&*store, state(earlier.clone(), 1)).await;
    let incarnations = |store: &dyn ActionStateStore| {
        [&mine, &other, &earlier].map(|k| store.get(k).map(|s| s.incarnation))
    };
    let expected = [
        Some(Some(store.incarnation())),
        Some(Some(Incarnation([9; 16]))),
        Some(None),
    ];
    assert_eq!(incarnations(&*store), expected, "from the cache");
    for scope in store.scopes() {
        store.prune(&scope, u64::MAX).await.expect("prune");
    }
    store.rebuild(&marker).await.expect("rebuild");
    assert_eq!(incarnations(&*store), expected, "from the log");
}

/// Writes `inputs` finished inputs of scope `busy`, each pruned as a checkpoint would.
async fn traffic(store: &dyn ActionStateStore, busy: &str, inputs: u64) {
    for sequence in 1..=inputs {
        let mut done = state(key(busy, sequence, "a"), 1);
        done.completion = Some(Completion::default());
        put(store, done).await;
        let scope = KeyScope::new("t", "a", busy);
        store.prune(&scope, sequence).await.expect("prune");
    }
}

/// Every cached state, the store-assigned version stripped.
fn everything(store: &dyn ActionStateStore) -> Vec<ActionState> {
    let states = store
        .scopes()
        .iter()
        .flat_map(|s| store.states(s))
        .collect();
    let states: Vec<ActionState> = states;
    states.into_iter().map(content).collect()
}

/// Drops every cached state, so that only the log can bring them back.
async fn forget(store: &dyn ActionStateStore) {
    for scope in store.scopes() {
        store.prune(&scope, u64::MAX).await.expect("prune");
    }
}

/// An input at a durable wait has its states shelved; the log moves on and retention
/// deletes what later markers no longer keep: a rebuild still restores the waiting input's
/// states, and its key's other inputs'.
pub async fn shelved_states_outlive_retention_of_the_log_they_were_written_in(
    factory: &dyn Factory,
) {
    let store = factory(2);
    let scope = KeyScope::new("t", "a", "waits");
    put(&*store, state(key("waits", 1, "first"), 2)).await;
    put(&*store, state(key("waits", 1, "second"), 1)).await;
    put(&*store, state(key("waits", 2, "first"), 1)).await;
    store.shelve(&scope, 1).await.expect("shelve");
    store
        .shelve(&scope, 7)
        .await
        .expect("shelving an input without states");
    traffic(&*store, "busy", 50).await;
    let marker = store.marker().await.expect("marker");
    store.retain(&marker).await.expect("retain");
    let before = everything(&*store);
    assert_eq!(before.len(), 3, "{before:?}");
    forget(&*store).await;
    store.rebuild(&marker).await.expect("rebuild");
    assert_eq!(everything(&*store), before);
    assert_eq!(
        store.get(&key("waits", 1, "first")).map(|s| s.calls.len()),
        Some(2)
    );
}

/// The input woke and wrote its state again: that version is the one a rebuild restores,
/// before and after the next marker.
pub async fn a_state_written_after_it_was_shelved_comes_back_at_its_new_version(
    factory: &dyn Factory,
) {
    let store = factory(2);
    let waiting = key("waits", 1, "a");
    put(&*store, state(waiting.clone(), 1)).await;
    store.shelve(&waiting.scope, 1).await.expect("shelve");
    let shelved = store.marker().await.expect("marker");
    put(&*store, state(waiting.clone(), 3)).await;
    traffic(&*store, "busy", 20).await;
    let marker = store.marker().await.expect("marker");
    for marker in [&shelved, &marker] {
        forget(&*store).await;
        store.rebuild(marker).await.expect("rebuild");
        assert_eq!(store.get(&waiting).map(|s| s.calls.len()), Some(3));
    }
    store.retain(&marker).await.expect("retain");
    forget(&*store).await;
    store.rebuild(&marker).await.expect("rebuild");
    assert_eq!(store.get(&waiting).map(|s| s.calls.len()), Some(3));
}

/// After `retain`, a rebuild from the marker it was given still restores everything; one
/// from a marker before it fails naming what is gone, or restores what it held.
pub async fn retain_deletes_what_the_marker_no_longer_needs(factory: &dyn Factory) {
    let store = factory(1);
    let early = store.marker().await.expect("marker");
    traffic(&*store, "busy", 30).await;
    let pending = key("pending", 1, "a");
    put(&*store, state(pending.clone(), 1)).await;
    let marker = store.marker().await.expect("marker");
    store.retain(&marker).await.expect("retain");
    forget(&*store).await;
    store.rebuild(&marker).await.expect("rebuild");
    assert!(store.get(&pending).is_some());
    match store.rebuild(&early).await {
        Err(StoreError::MarkerOutOfRange { .. }) => {}
        Err(other) => panic!("a rebuild below retention fails as out of range: {other}"),
        // Retention deletes whole segments: a log may keep more than asked.
        Ok(()) => assert!(store.get(&pending).is_some()),
    }
}
