//! A property: random sequences of put, checkpoint (with its pruning), crash and recover
//! keep the log-backed store equal to a plain in-memory model, under both marker
//! strategies.
//!
//! The model is what a user relies on: every state written and not pruned is there, in its
//! newest version, however often the process died. A crash drops the store (its cache);
//! recovery builds a new one over the same log from the newest checkpoint's marker and
//! prunes what that checkpoint says was complete, as `rewind run` does.

use std::collections::BTreeMap;
use std::sync::Arc;

use proptest::prelude::*;
use rewind_host::event::Event;
use rewind_host::log::{Log, MemoryLog};
use rewind_host::store::{
    ActionState, ActionStateStore, CallOutcome, CallRecord, Completion, Digest, KeyScope, LogStore,
    Marker, MarkerStrategy, StateKey,
};

#[derive(Clone, Debug)]
enum Op {
    Put {
        scope: u8,
        sequence: u64,
        action: u8,
        calls: u8,
        completed: bool,
    },
    /// A checkpoint, then pruning each scope up to a sequence, as after a checkpoint whose
    /// keys had completed that far.
    Checkpoint {
        prune: Vec<(u8, u64)>,
    },
    Crash,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0..3u8, 1..6u64, 0..2u8, 0..4u8, any::<bool>()).prop_map(
            |(scope, sequence, action, calls, completed)| Op::Put {
                scope,
                sequence,
                action,
                calls,
                completed,
            }
        ),
        2 => proptest::collection::vec((0..3u8, 0..6u64), 0..3)
            .prop_map(|prune| Op::Checkpoint { prune }),
        1 => Just(Op::Crash),
    ]
}

fn scope(n: u8) -> KeyScope {
    KeyScope::new("t", "agent", format!("key-{n}"))
}

fn state(key: StateKey, calls: u8, completed: bool) -> ActionState {
    let mut state = ActionState::new(key, Event::new("input", "{}"));
    for i in 0..calls {
        state.calls.push(CallRecord {
            function: "f".to_owned(),
            args_digest: Digest::of(&[&[i]]),
            idempotency_key: format!("rw-{i}"),
            outcome: CallOutcome::Succeeded(format!("{{\"i\":{i}}}")),
        });
    }
    if completed {
        state.completion = Some(Completion::default());
    }
    state
}

/// What a user sees of a store: every state of every scope.
fn contents(store: &LogStore) -> BTreeMap<StateKey, ActionState> {
    (0..3)
        .flat_map(|n| store.states(&scope(n)))
        .map(|s| (s.key.clone(), s))
        .collect()
}

async fn check(strategy: MarkerStrategy, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let log: Arc<dyn Log> = Arc::new(MemoryLog::new(4));
    let mut store = LogStore::new(
        Arc::clone(&log),
        strategy,
        rewind_host::store::Incarnation::random(),
    );
    let mut model: BTreeMap<StateKey, ActionState> = BTreeMap::new();
    // Per scope, the sequence pruned up to; and the newest checkpoint's marker and those.
    let mut pruned: BTreeMap<u8, u64> = BTreeMap::new();
    let mut checkpoint: Option<(Marker, BTreeMap<u8, u64>)> = None;
    for op in ops {
        match op {
            Op::Put {
                scope: n,
                sequence,
                action,
                calls,
                completed,
            } => {
                // A key's sequences only grow: nothing is written at or below a pruned one.
                if sequence <= pruned.get(&n).copied().unwrap_or(0) {
                    continue;
                }
                let key = StateKey {
                    scope: scope(n),
                    sequence,
                    action: format!("a{action}"),
                    trigger: Digest::of(&[b"input"]),
                };
                let mut written = state(key.clone(), calls, completed);
                written.version = store.put(&written).await.expect("put");
                model.insert(key, written);
            }
            Op::Checkpoint { prune } => {
                let marker = store.marker().await.expect("marker");
                for (n, up_to) in prune {
                    let point = pruned.entry(n).or_default();
                    *point = (*point).max(up_to);
                }
                checkpoint = Some((marker, pruned.clone()));
                for (&n, &up_to) in &pruned {
                    store.prune(&scope(n), up_to).await.expect("prune");
                    model.retain(|key, _| !(key.scope == scope(n) && key.sequence <= up_to));
                }
            }
            Op::Crash => {
                store = LogStore::new(
                    Arc::clone(&log),
                    strategy,
                    rewind_host::store::Incarnation::random(),
                );
                let marker = match &checkpoint {
                    Some((marker, _)) => marker.clone(),
                    None => Marker::at(vec![0; 4]),
                };
                store.rebuild(&marker).await.expect("rebuild");
                if let Some((_, points)) = &checkpoint {
                    for (&n, &up_to) in points {
                        store.prune(&scope(n), up_to).await.expect("prune");
                    }
                }
            }
        }
        prop_assert_eq!(&contents(&store), &model);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn the_store_equals_the_model_across_crashes_under_offsets(
        ops in proptest::collection::vec(op(), 1..40)
    ) {
        let runtime = tokio::runtime::Builder::new_current_thread().build().expect("runtime");
        runtime.block_on(check(MarkerStrategy::Offsets, ops))?;
    }

    #[test]
    fn the_store_equals_the_model_across_crashes_under_refresh(
        ops in proptest::collection::vec(op(), 1..40)
    ) {
        let runtime = tokio::runtime::Builder::new_current_thread().build().expect("runtime");
        runtime.block_on(check(MarkerStrategy::Refresh, ops))?;
    }
}
