//! Durable-call semantics (docs/SEMANTICS.md, "The durable call").
//!
//! A run is interrupted the way a crash interrupts it: a function `gate` is unavailable the
//! first time (the run ends, nothing about that call is recorded), and the input is then
//! processed again, as recovery would. Every test runs against the caller guest in Rust,
//! Python and JavaScript.

use std::sync::Arc;

use async_trait::async_trait;
use rewind_host::durable::digest::input_trigger;
use rewind_host::store::{
    ActionState, ActionStateStore, CallOutcome, InMemoryStore, KeyScope, Marker, StateKey,
    StoreError, Version,
};
use serde_json::{Value, json};

use crate::support::{
    Counting, agent_file, agent_toml, agent_with, first_output, input, memory_store, sandbox,
};

in_every_language!(
    a_miss_runs_the_function_once_and_a_hit_serves_the_record,
    a_completed_action_is_not_run_again_and_its_outputs_are_reapplied,
    another_input_under_the_same_key_and_sequence_does_not_get_the_first_ones_records,
    divergence_truncates_the_records_and_runs_live_by_default,
    divergence_under_fail_fails_the_run_naming_both_calls,
    a_function_can_override_the_agents_divergence_policy,
    a_recorded_failure_is_replayed_as_the_same_failure,
    denied_and_unknown_function_calls_are_not_recorded_and_replay_cleanly,
    the_idempotency_key_is_the_same_when_a_lost_record_makes_the_call_run_again,
    the_guest_never_sees_a_result_the_store_did_not_acknowledge,
    time_is_recorded_like_any_call_and_replayed_unchanged,
);

fn call(function: &str, args: Value) -> Value {
    json!({ "function": function, "args": args })
}

/// A script whose last call is the gate.
fn gated(calls: &[Value]) -> Value {
    let mut calls = calls.to_vec();
    calls.push(call("gate", json!({})));
    json!({ "calls": calls })
}

fn recorded_calls(store: &InMemoryStore, key: &str) -> Vec<(String, CallOutcome)> {
    store
        .states(&KeyScope::new("default", "test", key))
        .into_iter()
        .flat_map(|s| s.calls)
        .map(|c| (c.function, c.outcome))
        .collect()
}

/// The key of the state of action `work` for input `payload` of key `k`.
fn state_key(sequence: u64, payload: &Value) -> StateKey {
    StateKey {
        scope: KeyScope::new("default", "test", "k"),
        sequence,
        action: "work".to_owned(),
        trigger: input_trigger(&payload.to_string()),
    }
}

/// Moves the state recorded for input `from` to input `to` of the same key and sequence:
/// as if `to`'s run had been recorded by another version of the action.
async fn rekey(store: &InMemoryStore, sequence: u64, from: &Value, to: &Value) {
    let mut state = store
        .get(&state_key(sequence, from))
        .expect("a recorded state");
    state.key = state_key(sequence, to);
    store.put(&state).await.expect("put");
}

/// What a replay did after the action's code changed between its first run and the replay.
struct CodeChange {
    store: Arc<InMemoryStore>,
    count: Arc<Counting>,
    other: Arc<Counting>,
    new: Value,
    report: rewind_host::agent::InputReport,
}

/// Runs `old` calls until an outage ends the run, then replays as if the action now made
/// `new` calls, under agent `toml` (functions `count`, `other` and `gate` are provided).
async fn replay_after_code_change(toml: &str, old: &[Value], new: &[Value]) -> CodeChange {
    let store = memory_store();
    let (count, other) = (Counting::new(), Counting::new());
    let agent = agent_with(
        toml,
        store.clone(),
        &[
            ("count", count.clone()),
            ("other", other.clone()),
            ("gate", Counting::unavailable_first(1)),
        ],
    );
    let (old, new) = (gated(old), gated(new));
    let first = agent
        .process(&input("k", 1, old.clone()), &Default::default())
        .await;
    assert!(first.error.is_some(), "the outage ends the first run");
    rekey(&store, 1, &old, &new).await;
    let report = agent
        .process(&input("k", 1, new.clone()), &Default::default())
        .await;
    CodeChange {
        store,
        count,
        other,
        new,
        report,
    }
}

async fn a_miss_runs_the_function_once_and_a_hit_serves_the_record(caller: &str) {
    let store = memory_store();
    let (count, gate) = (Counting::new(), Counting::unavailable_first(1));
    let agent = agent_with(
        &agent_toml(caller, "", ""),
        store.clone(),
        &[("count", count.clone()), ("gate", gate.clone())],
    );
    let payload = gated(&[call("count", json!({"x": 1}))]);

    let first = agent
        .process(&input("k", 1, payload.clone()), &Default::default())
        .await;
    let error = first.error.expect("the outage ends the run").to_string();
    assert!(
        error.contains("`gate`") && error.contains("the service is down"),
        "{error}"
    );
    assert_eq!((count.calls(), first.calls.live), (1, 1));

    let second = agent
        .process(&input("k", 1, payload), &Default::default())
        .await;
    assert!(second.error.is_none(), "{second:?}");
    assert_eq!(count.calls(), 1, "a hit must not run the function");
    assert_eq!((second.calls.replayed, second.calls.live), (1, 1));
    assert_eq!(
        first_output(&second)["results"][0]["ok"]["n"],
        1,
        "the recorded result is served"
    );
}

async fn a_completed_action_is_not_run_again_and_its_outputs_are_reapplied(caller: &str) {
    let store = memory_store();
    let count = Counting::new();
    let agent = agent_with(
        &agent_toml(caller, "", ""),
        store.clone(),
        &[("count", count.clone())],
    );
    let payload = json!({ "calls": [call("count", json!({}))], "memory_set": {"seen": true} });

    let first = agent
        .process(&input("k", 1, payload.clone()), &Default::default())
        .await;
    assert!(first.error.is_none(), "{first:?}");
    let second = agent
        .process(&input("k", 1, payload), &Default::default())
        .await;
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
    assert_eq!(second.memory.get("seen").map(String::as_str), Some("true"));
}

async fn another_input_under_the_same_key_and_sequence_does_not_get_the_first_ones_records(
    caller: &str,
) {
    let store = memory_store();
    let count = Counting::new();
    let agent = agent_with(
        &agent_toml(caller, "", ""),
        store.clone(),
        &[("count", count.clone())],
    );
    agent
        .process(
            &input(
                "k",
                1,
                json!({ "calls": [call("count", json!({"order": "A1"}))] }),
            ),
            &Default::default(),
        )
        .await;
    let edited = agent
        .process(
            &input(
                "k",
                1,
                json!({ "calls": [call("count", json!({"order": "B2"}))] }),
            ),
            &Default::default(),
        )
        .await;
    assert_eq!((edited.runs, edited.reapplied), (1, 0), "{edited:?}");
    assert_eq!(count.calls(), 2);
    assert_eq!(
        first_output(&edited)["results"][0]["ok"]["args"]["order"],
        "B2"
    );
}

async fn divergence_truncates_the_records_and_runs_live_by_default(caller: &str) {
    // The new version of the action agrees on call 0 and makes another call 1.
    let change = replay_after_code_change(
        &agent_toml(caller, "", ""),
        &[
            call("count", json!({"i": 0})),
            call("count", json!({"i": 1})),
        ],
        &[
            call("count", json!({"i": 0})),
            call("other", json!({"y": true})),
        ],
    )
    .await;
    let report = &change.report;
    assert!(report.error.is_none(), "{report:?}");
    assert_eq!(change.count.calls(), 2, "call 0 is served from its record");
    assert_eq!(change.other.calls(), 1, "the diverging call runs live");
    assert_eq!(report.calls.truncated, 1);
    let state = change.store.get(&state_key(1, &change.new)).expect("state");
    let functions: Vec<String> = state.calls.into_iter().map(|c| c.function).collect();
    assert_eq!(functions, ["count", "other", "gate"]);
}

async fn divergence_under_fail_fails_the_run_naming_both_calls(caller: &str) {
    let change = replay_after_code_change(
        &agent_toml(caller, "divergence = \"fail\"", ""),
        &[call("count", json!({}))],
        &[call("other", json!({}))],
    )
    .await;
    let error = change.report.error.expect("the run fails").to_string();
    assert!(error.contains("divergence at call 0"), "{error}");
    assert!(
        error.contains("`count`") && error.contains("`other`"),
        "{error}"
    );
    assert_eq!(
        change.other.calls(),
        0,
        "nothing runs after a divergence under `fail`"
    );
}

async fn a_function_can_override_the_agents_divergence_policy(caller: &str) {
    let change = replay_after_code_change(
        &agent_toml(
            caller,
            "",
            "[functions.other]\nkind = \"custom\"\ndivergence = \"fail\"\n",
        ),
        &[call("count", json!({}))],
        &[call("other", json!({}))],
    )
    .await;
    let error = change
        .report
        .error
        .expect("`other` fails on divergence")
        .to_string();
    assert!(error.contains("divergence at call 0"), "{error}");
    assert_eq!(change.other.calls(), 0);
}

async fn a_recorded_failure_is_replayed_as_the_same_failure(caller: &str) {
    let store = memory_store();
    let (pay, gate) = (
        Counting::failing("the payment was declined"),
        Counting::unavailable_first(1),
    );
    let agent = agent_with(
        &agent_toml(caller, "", ""),
        store.clone(),
        &[("pay", pay.clone()), ("gate", gate.clone())],
    );
    let payload = gated(&[call("pay", json!({"amount": 5}))]);
    agent
        .process(&input("k", 1, payload.clone()), &Default::default())
        .await;
    let second = agent
        .process(&input("k", 1, payload), &Default::default())
        .await;
    assert!(second.error.is_none(), "{second:?}");
    assert_eq!(pay.calls(), 1, "a recorded failure is not retried");
    assert_eq!(
        first_output(&second)["results"][0],
        json!({ "error": { "failed": "the payment was declined" } })
    );
    assert_eq!(
        recorded_calls(&store, "k")[0],
        (
            "pay".to_owned(),
            CallOutcome::Failed("the payment was declined".to_owned())
        )
    );
}

async fn denied_and_unknown_function_calls_are_not_recorded_and_replay_cleanly(caller: &str) {
    let store = memory_store();
    let (count, gate) = (Counting::new(), Counting::unavailable_first(1));
    let toml = agent_toml(
        caller,
        "",
        &format!(
            "[[actions]]\nname = \"billing\"\ncomponent = {:?}\non = [\"bill\"]\n\n[functions.charge]\nkind = \"random\"\nactions = [\"billing\"]\n",
            crate::support::guest(caller).display().to_string()
        ),
    );
    let agent = agent_with(
        &toml,
        store.clone(),
        &[("count", count.clone()), ("gate", gate.clone())],
    );
    let payload = gated(&[
        call("nope", json!({})),
        call("charge", json!({})),
        call("count", json!({})),
    ]);
    let first = agent
        .process(&input("k", 1, payload.clone()), &Default::default())
        .await;
    assert!(first.error.is_some(), "the outage ends the first run");
    let functions = |store: &InMemoryStore| -> Vec<String> {
        recorded_calls(store, "k")
            .into_iter()
            .map(|(f, _)| f)
            .collect()
    };
    assert_eq!(
        functions(&store),
        ["count"],
        "only the call that ran is recorded, at index 0"
    );

    // The replay makes the same refused calls first: they must not disturb the record.
    let report = agent
        .process(&input("k", 1, payload), &Default::default())
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
    assert_eq!(
        count.calls(),
        1,
        "the recorded call is served, not run again"
    );
    assert_eq!(functions(&store), ["count", "gate"]);
}

async fn the_idempotency_key_is_the_same_when_a_lost_record_makes_the_call_run_again(caller: &str) {
    let count = Counting::new();
    let toml = agent_toml(caller, "", "");
    let payload =
        json!({ "calls": [call("count", json!({"a": 1})), call("count", json!({"a": 1}))] });
    // Two stores of one state: as if the first run's records had been lost with its
    // process.
    let incarnation = rewind_host::store::Incarnation::random();
    for _ in 0..2 {
        let agent = agent_with(
            &toml,
            Arc::new(InMemoryStore::default().with_incarnation(incarnation)),
            &[("count", count.clone())],
        );
        let report = agent
            .process(&input("k", 7, payload.clone()), &Default::default())
            .await;
        assert!(report.error.is_none(), "{report:?}");
    }
    let keys = count.keys();
    assert_eq!(keys.len(), 4);
    assert_eq!(keys[0], keys[2], "call 0 has the same key on every run");
    assert_eq!(keys[1], keys[3], "call 1 has the same key on every run");
    assert_ne!(keys[0], keys[1], "two calls never share a key");

    let other_key = agent_with(&toml, memory_store(), &[("count", count.clone())]);
    other_key
        .process(&input("j", 7, payload), &Default::default())
        .await;
    assert_ne!(
        count.keys()[4],
        keys[0],
        "another key's call has another idempotency key"
    );
}

/// A store whose log acknowledges no state holding a call's record (a state written before
/// any call, with the clock readings a run took, is accepted).
#[derive(Debug, Default)]
struct Refusing(InMemoryStore);

#[async_trait]
impl ActionStateStore for Refusing {
    async fn put(&self, state: &ActionState) -> Result<Version, StoreError> {
        if state.calls.is_empty() {
            return self.0.put(state).await;
        }
        Err(StoreError::Unavailable("disk full".to_owned()))
    }
    fn incarnation(&self) -> rewind_host::store::Incarnation {
        self.0.incarnation()
    }
    fn get(&self, key: &StateKey) -> Option<ActionState> {
        self.0.get(key)
    }
    fn states(&self, scope: &KeyScope) -> Vec<ActionState> {
        self.0.states(scope)
    }
    fn scopes(&self) -> Vec<KeyScope> {
        self.0.scopes()
    }
    async fn prune(&self, scope: &KeyScope, up_to: u64) -> Result<(), StoreError> {
        self.0.prune(scope, up_to).await
    }
    async fn marker(&self) -> Result<Marker, StoreError> {
        self.0.marker().await
    }
    async fn rebuild(&self, marker: &Marker) -> Result<(), StoreError> {
        self.0.rebuild(marker).await
    }
    async fn shelve(&self, scope: &KeyScope, sequence: u64) -> Result<(), StoreError> {
        self.0.shelve(scope, sequence).await
    }
    async fn retain(&self, marker: &Marker) -> Result<(), StoreError> {
        self.0.retain(marker).await
    }
}

async fn the_guest_never_sees_a_result_the_store_did_not_acknowledge(caller: &str) {
    let count = Counting::new();
    let agent = agent_with(
        &agent_toml(caller, "", ""),
        Arc::new(Refusing::default()),
        &[("count", count.clone())],
    );
    let report = agent
        .process(
            &input("k", 1, json!({ "calls": [call("count", json!({}))] })),
            &Default::default(),
        )
        .await;
    let error = report.error.expect("the run fails").to_string();
    assert!(
        error.contains("did not record") && error.contains("disk full"),
        "{error}"
    );
    assert_eq!(count.calls(), 1, "the call was made, its record refused");
    assert!(
        report.outputs.is_empty(),
        "the action must not go on with an unrecorded result"
    );
}

/// A clock stuck at one instant.
#[derive(Debug)]
struct Fixed(std::time::SystemTime);

impl rewind_host::functions::Clock for Fixed {
    fn now(&self) -> std::time::SystemTime {
        self.0
    }
}

async fn time_is_recorded_like_any_call_and_replayed_unchanged(caller: &str) {
    use std::time::{Duration, UNIX_EPOCH};

    let store = memory_store();
    let gate = Counting::unavailable_first(1);
    let toml = format!(
        "{}\n[functions.gate]\nkind = \"custom\"\n",
        agent_toml(caller, "", "[functions.now]\nkind = \"time\"\n")
    );
    let at = |ms: u64| {
        rewind_host::agent::Agent::builder(agent_file(&toml), sandbox())
            .store(store.clone())
            .function("gate", gate.clone())
            .clock(Arc::new(Fixed(UNIX_EPOCH + Duration::from_millis(ms))))
            .build()
            .expect("agent")
    };
    let payload = gated(&[call("now", json!({}))]);
    at(1_000)
        .process(&input("k", 1, payload.clone()), &Default::default())
        .await;
    // Later, with the clock moved on, the replay still sees the time the first run saw.
    let replay = at(9_999_000)
        .process(&input("k", 1, payload), &Default::default())
        .await;
    assert!(replay.error.is_none(), "{replay:?}");
    assert_eq!(
        first_output(&replay)["results"][0]["ok"],
        json!({ "unix_ms": 1000 })
    );
}
