//! What the benchmarks share: a function that does nothing, and durable calls over a store.

use std::sync::Arc;

use async_trait::async_trait;
use rewind_host::durable::{CallPolicy, DurableCalls};
use rewind_host::functions::{CallRequest, Function, FunctionError, Functions};
use rewind_host::store::{ActionState, ActionStateStore};

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
