//! What the benchmarks share: a function that does nothing, and durable calls over a store.

use std::sync::Arc;

use async_trait::async_trait;
use rewind_host::durable::{CallPolicy, DurableCalls};
use rewind_host::event::Event;
use rewind_host::functions::{CallRequest, Function, FunctionError, Functions};
use rewind_host::store::{ActionState, ActionStateStore, Digest, KeyScope, StateKey};

/// The allocator the `rewind` binary runs with (`cli/src/main.rs`), so that the benches
/// measure what it does.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// A function that answers `{}` at once: what a durable call costs without the remote.
#[derive(Debug)]
pub struct Noop;

#[async_trait]
impl Function for Noop {
    async fn call(&self, _request: CallRequest<'_>) -> Result<String, FunctionError> {
        Ok("{}".to_owned())
    }
}

/// `noop` as the only function.
pub fn noop_functions() -> Arc<Functions> {
    let mut functions = Functions::new();
    functions.register("noop", Arc::new(Noop), None);
    Arc::new(functions)
}

/// A run's durable calls over `state`, with no limit on their number.
pub fn calls(
    store: &Arc<dyn ActionStateStore>,
    functions: &Arc<Functions>,
    state: ActionState,
) -> DurableCalls {
    let policy = Arc::new(CallPolicy {
        calls_per_run: u32::MAX,
        clock_readings_per_run: u32::MAX,
        budget: None,
        ..CallPolicy::default()
    });
    DurableCalls::new(Arc::clone(store), Arc::clone(functions), policy, state)
}

/// The state key of `name`'s input `sequence`, in the benchmarks' scope.
pub fn key(name: &str, sequence: u64) -> StateKey {
    StateKey {
        scope: KeyScope::new("bench", "bench", name),
        sequence,
        action: "act".to_owned(),
        trigger: Digest::of(&[b"input"]),
    }
}

/// Live durable calls per second on `store`: 64 keys at once, each making `per_key` calls
/// of the no-op function, four per action run, as a short action would.
pub async fn calls_per_second_64_keys(
    store: &Arc<dyn ActionStateStore>,
    functions: &Arc<Functions>,
    per_key: u64,
) -> f64 {
    let started = std::time::Instant::now();
    let mut tasks = Vec::new();
    for k in 0..64 {
        let (store, functions) = (Arc::clone(store), Arc::clone(functions));
        tasks.push(tokio::spawn(async move {
            for n in 0..per_key / 4 {
                let state =
                    ActionState::new(key(&format!("key-{k}"), n), Event::new("input", "{}"));
                let mut run = calls(&store, &functions, state);
                for i in 0..4 {
                    let result = run.call("noop", &format!("{{\"i\":{i}}}")).await;
                    assert!(matches!(result, Ok(Ok(_))));
                }
            }
        }));
    }
    for task in tasks {
        task.await.expect("task");
    }
    (64 * per_key) as f64 / started.elapsed().as_secs_f64()
}
