//! Durable-call semantics (DESIGN.md, "The durable call").

use std::sync::Arc;

use rewind_host::store::{ActionStateStore, CallOutcome, InMemoryStore, KeyScope};
use serde_json::json;

use crate::support::{Counting, agent_toml, agent_with, first_output, input, memory_store};

fn call(function: &str, args: serde_json::Value) -> serde_json::Value {
    json!({ "function": function, "args": args })
}

fn recorded_calls(store: &InMemoryStore, key: &str) -> Vec<(String, CallOutcome)> {
    store
        .states(&KeyScope::new("default", "test", key))
        .into_iter()
        .flat_map(|s| s.calls)
        .map(|c| (c.function, c.outcome))
        .collect()
}

#[tokio::test]
async fn a_miss_runs_the_function_once_and_a_hit_serves_the_record() {
    let store = memory_store();
    let count = Counting::new();
    let agent = agent_with(
        &agent_toml("caller", "", ""),
        store.clone(),
        &[("count", count.clone())],
    );

    // The action makes its call, then fails: the call is recorded, the action is not complete.
    let first = agent
        .process(&input(
            "k",
            1,
            json!({ "calls": [call("count", json!({"x": 1}))], "fail": "crash after the call" }),
        ))
        .await;
    assert!(
        first
            .error
            .as_ref()
            .is_some_and(|e| e.to_string().contains("crash after the call")),
        "{first:?}"
    );
    assert_eq!(count.calls(), 1);
    assert_eq!(first.calls.live, 1);

    // Running the input again serves the call from its record.
    let second = agent
        .process(&input(
            "k",
            1,
            json!({ "calls": [call("count", json!({"x": 1}))] }),
        ))
        .await;
    assert!(second.error.is_none(), "{second:?}");
    assert_eq!(count.calls(), 1, "a hit must not run the function");
    assert_eq!(second.calls.replayed, 1);
    assert_eq!(second.calls.live, 0);
    assert_eq!(
        first_output(&second)["results"][0]["ok"]["n"],
        1,
        "the recorded result is served"
    );
}

#[tokio::test]
async fn a_completed_action_is_not_run_again_and_its_outputs_are_reapplied() {
    let store = memory_store();
    let count = Counting::new();
    let agent = agent_with(
        &agent_toml("caller", "", ""),
        store.clone(),
        &[("count", count.clone())],
    );
    let payload = json!({ "calls": [call("count", json!({}))], "memory_set": {"seen": true} });

    let first = agent.process(&input("k", 1, payload.clone())).await;
    assert!(first.error.is_none(), "{first:?}");
    let second = agent.process(&input("k", 1, payload)).await;
    assert!(second.error.is_none(), "{second:?}");

    assert_eq!(count.calls(), 1);
    assert_eq!(
        (second.runs, second.reapplied),
        (0, 1),
        "the completed action must not run"
    );
    assert_eq!(
        first.outputs, second.outputs,
        "the same outputs, with the same ids"
    );
    assert_eq!(
        agent.memory("k").get("seen").map(String::as_str),
        Some("true")
    );
}

#[tokio::test]
async fn divergence_truncates_the_records_and_runs_live_by_default() {
    let store = memory_store();
    let count = Counting::new();
    let other = Counting::new();
    let agent = agent_with(
        &agent_toml("caller", "", ""),
        store.clone(),
        &[("count", count.clone()), ("other", other.clone())],
    );
    let first = agent
        .process(&input(
            "k",
            1,
            json!({
                "calls": [call("count", json!({"i": 0})), call("count", json!({"i": 1}))],
                "fail": "stop"
            }),
        ))
        .await;
    assert!(first.error.is_some());
    assert_eq!(count.calls(), 2);

    // The replay agrees on call 0 and differs at call 1.
    let second = agent
        .process(&input(
            "k",
            1,
            json!({
                "calls": [call("count", json!({"i": 0})), call("other", json!({"y": true}))]
            }),
        ))
        .await;
    assert!(second.error.is_none(), "{second:?}");
    assert_eq!(count.calls(), 2, "call 0 is served from its record");
    assert_eq!(other.calls(), 1, "the diverging call runs live");
    assert_eq!(second.calls.truncated, 1);
    let functions: Vec<String> = recorded_calls(&store, "k")
        .into_iter()
        .map(|(f, _)| f)
        .collect();
    assert_eq!(functions, ["count", "other"]);
}

#[tokio::test]
async fn divergence_under_fail_fails_the_run_naming_both_calls() {
    let store = memory_store();
    let count = Counting::new();
    let other = Counting::new();
    let agent = agent_with(
        &agent_toml("caller", "divergence = \"fail\"", ""),
        store.clone(),
        &[("count", count.clone()), ("other", other.clone())],
    );
    agent
        .process(&input(
            "k",
            1,
            json!({ "calls": [call("count", json!({}))], "fail": "stop" }),
        ))
        .await;
    let second = agent
        .process(&input(
            "k",
            1,
            json!({ "calls": [call("other", json!({}))] }),
        ))
        .await;
    let error = second.error.expect("the run fails").to_string();
    assert!(error.contains("divergence at call 0"), "{error}");
    assert!(
        error.contains("`count`") && error.contains("`other`"),
        "{error}"
    );
    assert_eq!(
        other.calls(),
        0,
        "nothing runs after a divergence under `fail`"
    );
    assert_eq!(recorded_calls(&store, "k").len(), 1, "the record is kept");
}

#[tokio::test]
async fn a_recorded_failure_is_replayed_as_the_same_failure() {
    let store = memory_store();
    let flaky = Counting::failing("the payment was declined");
    let agent = agent_with(
        &agent_toml("caller", "", ""),
        store.clone(),
        &[("pay", flaky.clone())],
    );
    let script = |fail: bool| {
        let mut payload = json!({ "calls": [call("pay", json!({"amount": 5}))] });
        if fail {
            payload["fail"] = json!("stop");
        }
        payload
    };
    agent.process(&input("k", 1, script(true))).await;
    let second = agent.process(&input("k", 1, script(false))).await;
    assert!(second.error.is_none(), "{second:?}");
    assert_eq!(flaky.calls(), 1, "a recorded failure is not retried");
    assert_eq!(
        first_output(&second)["results"][0],
        json!({ "error": { "failed": "the payment was declined" } })
    );
    assert_eq!(
        recorded_calls(&store, "k"),
        [(
            "pay".to_owned(),
            CallOutcome::Failed("the payment was declined".to_owned())
        )]
    );
}

#[tokio::test]
async fn denied_and_unknown_function_calls_are_not_recorded() {
    let store = memory_store();
    let count = Counting::new();
    let toml = agent_toml(
        "caller",
        "",
        &format!(
            "[[actions]]\nname = \"billing\"\ncomponent = {:?}\non = [\"bill\"]\n\n[functions.charge]\nkind = \"random\"\nactions = [\"billing\"]\n",
            crate::support::guest("caller").display().to_string()
        ),
    );
    let agent = agent_with(&toml, store.clone(), &[("count", count.clone())]);
    let report = agent
        .process(&input("k", 1, json!({
            "calls": [call("nope", json!({})), call("charge", json!({})), call("count", json!({}))]
        })))
        .await;
    assert!(report.error.is_none(), "{report:?}");
    let results = first_output(&report)["results"].clone();
    assert!(
        results[0]["error"]["unknown-function"]
            .as_str()
            .is_some_and(|m| m.contains("nope")),
        "{results}"
    );
    assert!(
        results[1]["error"]["denied"]
            .as_str()
            .is_some_and(|m| m.contains("charge")),
        "{results}"
    );
    assert_eq!(results[2]["ok"]["n"], 1);
    let recorded: Vec<String> = recorded_calls(&store, "k")
        .into_iter()
        .map(|(f, _)| f)
        .collect();
    assert_eq!(
        recorded,
        ["count"],
        "only the call that ran is recorded, at index 0"
    );
}

#[tokio::test]
async fn the_idempotency_key_is_the_same_when_a_lost_record_makes_the_call_run_again() {
    let count = Counting::new();
    let toml = agent_toml("caller", "", "");
    let payload =
        json!({ "calls": [call("count", json!({"a": 1})), call("count", json!({"a": 1}))] });
    // Two stores: as if the first run's records had been lost with its process.
    for _ in 0..2 {
        let agent = agent_with(
            &toml,
            Arc::new(InMemoryStore::default()),
            &[("count", count.clone())],
        );
        let report = agent.process(&input("k", 7, payload.clone())).await;
        assert!(report.error.is_none(), "{report:?}");
    }
    let keys = count.keys();
    assert_eq!(keys.len(), 4);
    assert_eq!(keys[0], keys[2], "call 0 has the same key on every run");
    assert_eq!(keys[1], keys[3], "call 1 has the same key on every run");
    assert_ne!(keys[0], keys[1], "two calls never share a key");

    let other_key = agent_with(&toml, memory_store(), &[("count", count.clone())]);
    other_key.process(&input("j", 7, payload)).await;
    assert_ne!(
        count.keys()[4],
        keys[0],
        "another key's call has another idempotency key"
    );
}

#[tokio::test]
async fn the_store_acknowledges_a_record_before_the_guest_sees_the_result() {
    // The action fails right after its call returns: the record must already be there.
    let store = memory_store();
    let count = Counting::new();
    let agent = agent_with(
        &agent_toml("caller", "", ""),
        store.clone(),
        &[("count", count.clone())],
    );
    agent
        .process(&input(
            "k",
            1,
            json!({ "calls": [call("count", json!({}))], "fail": "right after" }),
        ))
        .await;
    let recorded = recorded_calls(&store, "k");
    assert_eq!(recorded.len(), 1);
    assert!(matches!(recorded[0].1, CallOutcome::Succeeded(_)));
}

/// A clock stuck at one instant.
#[derive(Debug)]
struct Fixed(std::time::SystemTime);

impl rewind_host::functions::Clock for Fixed {
    fn now(&self) -> std::time::SystemTime {
        self.0
    }
}

#[tokio::test]
async fn time_is_recorded_like_any_call_and_replayed_unchanged() {
    use std::time::{Duration, UNIX_EPOCH};

    let store = memory_store();
    let toml = agent_toml("caller", "", "[functions.now]\nkind = \"time\"\n");
    let at = |ms: u64| {
        rewind_host::agent::Agent::builder(
            crate::support::agent_file(&toml),
            crate::support::sandbox(),
        )
        .store(store.clone())
        .clock(Arc::new(Fixed(UNIX_EPOCH + Duration::from_millis(ms))))
        .build()
        .expect("agent")
    };
    let script = |fail: bool| {
        let mut payload = json!({ "calls": [call("now", json!({}))] });
        if fail {
            payload["fail"] = json!("stop");
        }
        payload
    };
    at(1_000).process(&input("k", 1, script(true))).await;
    // Later, with the clock moved on, the replay still sees the time the first run saw.
    let replay = at(9_999_000).process(&input("k", 1, script(false))).await;
    assert!(replay.error.is_none(), "{replay:?}");
    assert_eq!(
        first_output(&replay)["results"][0]["ok"],
        json!({ "unix_ms": 1000 })
    );
}
