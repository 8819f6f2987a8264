//! What one run may write (memory, events, log, its error, its action state): at each
//! bound the run fails as the guest's failure, naming the limit and its value, and nothing
//! of it is applied.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use async_trait::async_trait;
use rewind_host::agent::InputReport;
use rewind_host::functions::{CallRequest, Function, FunctionError};
use rewind_host::log::MemoryLog;
use rewind_host::store::{
    ActionStateStore, CallOutcome, Incarnation, KeyScope, LogStore, MarkerStrategy,
};
use serde_json::{Value, json};

use crate::support::{agent_toml, agent_with, error_of, input, memory_store};

/// Runs the hostile guest's `script` under `limits`; the report, and the key's memory after.
async fn hostile(script: Value, limits: &str) -> (InputReport, usize) {
    let agent = agent_with(
        &agent_toml("hostile", "", &format!("[limits]\n{limits}")),
        memory_store(),
        &[],
    );
    let report = agent
        .process(&input("k", 1, script), &Default::default())
        .await;
    let memory = report.memory.len();
    (report, memory)
}

#[tokio::test]
async fn memory_writes_past_their_bytes_entries_or_name_length_fail_the_run() {
    // The measure: one 1 MiB value set 2,000 times (6.3 GB resident before).
    for (script, limits, named) in [
        (
            json!({ "mode": "memory", "count": 2000, "bytes": 1 << 20 }),
            "",
            "limit exceeded: memory-set-bytes (4194304 bytes)",
        ),
        (
            json!({ "mode": "memory", "count": 4, "bytes": 10 }),
            "memory-set-entries = 3",
            "limit exceeded: memory-set-entries (3)",
        ),
        (
            json!({ "mode": "memory", "count": 1, "bytes": 10, "name-bytes": 257 }),
            "",
            "limit exceeded: memory-name-bytes (256 bytes)",
        ),
    ] {
        let (report, memory) = hostile(script, limits).await;
        let error = error_of(&report);
        assert!(error.contains(named), "{error}");
        assert_eq!(memory, 0, "a failed run writes no memory");
        assert!(report.outputs.is_empty());
    }
    let (report, memory) = hostile(
        json!({ "mode": "memory", "count": 3, "bytes": 10, "name-bytes": 256 }),
        "memory-set-entries = 3",
    )
    .await;
    assert!(
        report.error.is_none(),
        "at the bounds is within: {report:?}"
    );
    assert_eq!(memory, 3);
}

#[tokio::test]
async fn a_keys_memory_past_memory_bytes_fails_the_run_that_would_grow_it() {
    // Each input writes within its run's bounds; the key's memory grows across them.
    let agent = agent_with(
        &agent_toml("hostile", "", "[limits]\nmemory-bytes = 2500"),
        memory_store(),
        &[],
    );
    let write = |count: u64| json!({ "mode": "memory", "count": count, "bytes": 1000 });
    let report = agent
        .process(&input("k", 1, write(2)), &Default::default())
        .await;
    assert!(report.error.is_none(), "{report:?}");
    // Writing the same names again replaces them: the memory does not grow.
    let report = agent
        .process(&input("k", 2, write(2)), &report.memory)
        .await;
    assert!(report.error.is_none(), "a rewrite is within: {report:?}");
    let report = agent
        .process(&input("k", 3, write(3)), &report.memory)
        .await;
    let error = error_of(&report);
    assert!(
        error.contains("limit exceeded: memory-bytes (2500 bytes)"),
        "{error}"
    );
    assert_eq!(report.memory.len(), 2, "the memory is as it was");
    let report = agent
        .process(&input("other", 1, write(2)), &Default::default())
        .await;
    assert!(
        report.error.is_none(),
        "another key has its own: {report:?}"
    );
}

#[tokio::test]
async fn sends_past_their_payload_total_or_count_fail_the_run() {
    // The measure: 200 sends of 8 MiB (7.4 GB resident before).
    for (script, limits, named) in [
        (
            json!({ "mode": "sends", "count": 200, "bytes": 8 << 20 }),
            "",
            "limit exceeded: send-payload-bytes (1048576 bytes)",
        ),
        (
            json!({ "mode": "sends", "count": 8, "bytes": 1000 }),
            "send-bytes = 4096",
            "limit exceeded: send-bytes (4096 bytes)",
        ),
        (
            json!({ "mode": "sends", "count": 3, "bytes": 10 }),
            "sends-per-run = 2",
            "limit exceeded: sends-per-run (2)",
        ),
    ] {
        let (report, _) = hostile(script, limits).await;
        let error = error_of(&report);
        assert!(error.contains(named), "{error}");
        assert!(report.outputs.is_empty());
    }
}

#[tokio::test]
async fn a_guest_error_is_kept_bounded_and_escaped() {
    let (report, _) = hostile(json!({ "mode": "fail", "bytes": 1 << 20 }), "").await;
    let error = error_of(&report);
    assert!(
        error.contains("the action returned an error: \\u{1}"),
        "{error:.200}"
    );
    assert!(error.len() < 5 << 10, "{} bytes kept", error.len());
    assert!(!error.chars().any(char::is_control), "no control character");
    assert!(error.ends_with("more bytes)"), "says it was cut");
}

/// A function answering a JSON string of `bytes` bytes; counts its calls.
#[derive(Debug)]
struct Large {
    bytes: usize,
    calls: AtomicU64,
}

#[async_trait]
impl Function for Large {
    async fn call(&self, _request: CallRequest<'_>) -> Result<String, FunctionError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        Ok(format!("\"{}\"", "b".repeat(self.bytes - 2)))
    }
}

/// A store whose log takes records of at most 64 KiB (a JetStream server's `max_payload`
/// is such a bound).
fn small_record_store() -> Arc<dyn ActionStateStore> {
    let log = MemoryLog::new(4).with_max_record(64 << 10);
    Arc::new(LogStore::new(
        Arc::new(log),
        MarkerStrategy::Offsets,
        Incarnation::random(),
    ))
}

#[tokio::test]
async fn an_answer_that_would_make_the_state_larger_than_a_record_is_recorded_as_a_failure() {
    let large = Arc::new(Large {
        bytes: 40 << 10,
        calls: AtomicU64::new(0),
    });
    let store = small_record_store();
    let agent = agent_with(
        &agent_toml("caller", "", ""),
        Arc::clone(&store),
        &[("large", large.clone())],
    );
    // No output: the run's output would hold the first answer again.
    let script = json!({
        "calls": [{ "function": "large" }, { "function": "large" }],
        "output": false,
    });
    let report = agent
        .process(&input("k", 1, script), &Default::default())
        .await;
    assert!(report.error.is_none(), "{report:?}");
    let states = store.states(&KeyScope::new("default", "test", "k"));
    let calls = &states[0].calls;
    assert!(
        matches!(calls[0].outcome, CallOutcome::Succeeded(_)),
        "the first fits"
    );
    let CallOutcome::Failed(failure) = &calls[1].outcome else {
        panic!(
            "the second is recorded as a failure: {:?}",
            calls[1].outcome.status()
        );
    };
    assert!(
        failure.contains("the answer of `large` (40960 bytes) would make the run's state")
            && failure.contains("more than the 65536 the log takes in one record"),
        "{failure}"
    );
    assert_eq!(large.calls.load(Ordering::SeqCst), 2, "each call made once");
}

#[tokio::test]
async fn a_run_whose_state_is_larger_than_a_record_fails_naming_the_log_s_bound() {
    let agent = agent_with(&agent_toml("caller", "", ""), small_record_store(), &[]);
    let script = json!({ "memory_set": { "big": "m".repeat(70 << 10) } });
    let report = agent
        .process(&input("k", 1, script), &Default::default())
        .await;
    let error = error_of(&report);
    assert!(
        error.contains("limit exceeded: the run's state is")
            && error.contains("more than the 65536 the log takes in one record"),
        "{error}"
    );
    assert!(report.memory.is_empty(), "nothing applied");
}
