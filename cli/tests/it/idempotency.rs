//! The idempotency key a call reaches its remote with names the call and the state it
//! belongs to: a remote that honours keys answers each call with its own effect.

use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use rewind_host::durable::digest::key_of_state_and_index;
use rewind_host::durable::{CallPolicy, DivergencePolicy, DurableCalls};
use rewind_host::event::Event;
use rewind_host::functions::{Functions, HttpConfig, HttpFunction, RetryPolicy};
use rewind_host::store::{
    ActionState, ActionStateStore, Digest, InMemoryStore, KeyScope, StateKey,
};
use serde_json::{Value, json};

use crate::remote::{Remote, serve};
use crate::support::{guest, workspace_root};

/// `charge`, POSTing to `url`.
fn charge_at(url: &str) -> Arc<Functions> {
    charge_with(url, Vec::new())
}

/// `charge`, POSTing to `url` with `headers`.
fn charge_with(url: &str, headers: Vec<(String, String)>) -> Arc<Functions> {
    let mut functions = Functions::new();
    functions.register(
        "charge",
        Arc::new(HttpFunction::new(HttpConfig {
            url: url.to_owned(),
            timeout: Duration::from_secs(10),
            retry: RetryPolicy::default(),
            headers,
            reconcile_url: None,
            allowed_hosts: None,
            max_response_bytes: rewind_host::functions::DEFAULT_MAX_RESPONSE_BYTES,
        })),
        None,
    );
    Arc::new(functions)
}

/// A remote that answers 429 twice before it serves: three requests under the call's one
/// key, and one recorded result, which a replay serves without a request.
#[tokio::test]
async fn a_call_refused_twice_with_429_is_three_requests_and_one_recorded_result() {
    use rewind_host::store::CallOutcome;
    use rewind_mock::{MockService, THROTTLE_HEADER, THROTTLE_RETRY_AFTER_HEADER};

    let mock = MockService::start("127.0.0.1:0".parse().expect("addr"))
        .await
        .expect("the mock starts");
    let throttle = vec![
        (THROTTLE_HEADER.to_owned(), "2".to_owned()),
        (THROTTLE_RETRY_AFTER_HEADER.to_owned(), "0".to_owned()),
    ];
    let functions = charge_with(&format!("{}/tools/charge", mock.base_url()), throttle);
    let store: Arc<dyn ActionStateStore> = Arc::new(InMemoryStore::default());

    let answers = charge(&store, &functions, new_state(), &[5]).await;
    assert_eq!(answers[0]["echo"], json!({ "amount": 5 }), "{answers:?}");
    let counts = mock.counts();
    assert_eq!(counts.total, 3, "two refused, then served: {counts:?}");
    assert_eq!(
        counts.by_idempotency_key.len(),
        1,
        "under one key: {counts:?}"
    );
    let recorded = store.get(&state_key()).expect("recorded").calls;
    assert_eq!(recorded.len(), 1);
    assert!(
        matches!(recorded[0].outcome, CallOutcome::Succeeded(_)),
        "{recorded:?}"
    );

    let replayed = charge(&store, &functions, new_state(), &[5]).await;
    assert_eq!(replayed, answers);
    assert_eq!(
        mock.counts().total,
        3,
        "the replay is served from the record"
    );
}

fn state_key() -> StateKey {
    StateKey {
        scope: KeyScope::new("acme", "billing", "order-7"),
        sequence: 1,
        action: "bill".to_owned(),
        trigger: Digest::of(&[b"input"]),
    }
}

/// One run over the stored state at [`state_key`] (or `fresh`): each of `amounts` charged
/// in turn; what the remote answered each.
async fn charge(
    store: &Arc<dyn ActionStateStore>,
    functions: &Arc<Functions>,
    fresh: ActionState,
    amounts: &[u64],
) -> Vec<Value> {
    let policy = Arc::new(CallPolicy {
        divergence: DivergencePolicy::Truncate,
        calls_per_run: 64,
        clock_readings_per_run: 64,
        ..CallPolicy::default()
    });
    let state = store.get(&state_key()).unwrap_or(fresh);
    let mut calls = DurableCalls::new(Arc::clone(store), Arc::clone(functions), policy, state);
    let mut answers = Vec::new();
    for amount in amounts {
        let answer = calls
            .call("charge", &json!({ "amount": amount }).to_string())
            .await
            .expect("no fault")
            .expect("charged");
        answers.push(serde_json::from_str(&answer).expect("JSON"));
    }
    answers
}

fn new_state() -> ActionState {
    ActionState::new(state_key(), Event::new("input", "{}"))
}

/// An edited action that now charges 7 where it charged 5 (divergence = "truncate"): the
/// new call is made under a key of its own, so the remote charges 7 and says so, instead of
/// answering with the first call's charge.
#[tokio::test]
async fn a_call_that_diverged_from_its_record_gets_its_own_answer() {
    let remote = Remote::default();
    let functions = charge_at(&serve(remote.clone()).await);
    let store: Arc<dyn ActionStateStore> = Arc::new(InMemoryStore::default());

    let first = charge(&store, &functions, new_state(), &[5]).await;
    assert_eq!(first, [json!({ "charged": { "amount": 5 } })]);
    let replayed = charge(&store, &functions, new_state(), &[7]).await;
    assert_eq!(
        replayed,
        [json!({ "charged": { "amount": 7 } })],
        "the diverged call's own answer, not the recorded call's"
    );
    assert_eq!(remote.keys().len(), 2, "two calls, two keys");
    assert_eq!(remote.repeats(), 0);
}

/// A state an earlier build wrote has no incarnation: a call it left in doubt is made again
/// under the key that build made (index alone), which the remote has seen; a call that
/// diverges from its records gets a key of this build's.
#[tokio::test]
async fn a_state_written_by_an_earlier_build_keeps_its_keys_and_a_diverged_call_gets_a_new_one() {
    let remote = Remote::default();
    let url = serve(remote.clone()).await;
    let functions = charge_at(&url);
    // The earlier build charged 5 at index 0 and recorded it, then charged 6 at index 1
    // under the key of (state, 1) and died before recording it.
    let store: Arc<dyn ActionStateStore> = Arc::new(InMemoryStore::default());
    let mut earlier = new_state();
    earlier.incarnation = None;
    earlier.version = 1;
    let legacy_1 = key_of_state_and_index(&state_key(), 1);
    let client = reqwest::Client::new();
    let sent = client
        .post(&url)
        .header("Idempotency-Key", &legacy_1)
        .json(&json!({ "amount": 6 }))
        .send()
        .await
        .expect("the earlier build's call");
    assert!(sent.status().is_success());
    let mut calls = DurableCalls::new(
        Arc::clone(&store),
        Arc::clone(&functions),
        Arc::new(CallPolicy {
            calls_per_run: 64,
            clock_readings_per_run: 64,
            ..CallPolicy::default()
        }),
        earlier,
    );
    // Its first call, recorded by this build as the earlier one would have.
    calls
        .call("charge", &json!({ "amount": 5 }).to_string())
        .await
        .expect("no fault")
        .expect("charged");
    assert_eq!(
        calls.state().incarnation,
        None,
        "a state of an earlier build keeps its keys"
    );
    assert!(
        remote
            .keys()
            .contains(&key_of_state_and_index(&state_key(), 0)),
        "call 0 under the earlier build's key"
    );
    let again = calls
        .call("charge", &json!({ "amount": 6 }).to_string())
        .await
        .expect("no fault")
        .expect("charged");
    assert_eq!(
        remote.requests.lock().expect("lock").get(&legacy_1),
        Some(&2),
        "the call in doubt reached the remote under the key it was first made with"
    );
    assert_eq!(
        serde_json::from_str::<Value>(&again).expect("JSON"),
        json!({ "charged": { "amount": 6 } })
    );

    // An edited action now charges 9 where 5 was recorded.
    let replayed = charge(&store, &functions, new_state(), &[9]).await;
    assert_eq!(replayed, [json!({ "charged": { "amount": 9 } })]);
    assert!(
        store
            .get(&state_key())
            .expect("stored")
            .incarnation
            .is_some(),
        "from the divergence on, the state's calls are this build's"
    );
}

fn rewind_run(dir: &Path, state: &Path, url: &str) -> std::process::Output {
    let agent = dir.join("agent.toml");
    std::fs::write(
        &agent,
        format!(
            "name = \"billing\"\n[[actions]]\nname = \"bill\"\ncomponent = {:?}\non = [\"input\"]\n\n[functions.charge]\nkind = \"http\"\nurl = \"{url}\"\n",
            guest("caller").display().to_string()
        ),
    )
    .expect("agent.toml");
    let inputs = dir.join("in.jsonl");
    let mut lines = String::new();
    for key in ["ana", "ben", "cy"] {
        let payload = json!({ "calls": [{ "function": "charge", "args": { "amount": 5 } }] });
        lines.push_str(&format!("{}\n", json!({ "key": key, "payload": payload })));
    }
    std::fs::write(&inputs, lines).expect("inputs");
    Command::new(env!("CARGO_BIN_EXE_rewind"))
        .current_dir(dir)
        .arg("--cache-dir")
        .arg(workspace_root().join("target").join("rewind-test-cache"))
        .arg("run")
        .arg(&agent)
        .arg("--input")
        .arg(&inputs)
        .arg("--state")
        .arg(state)
        .output()
        .expect("rewind runs")
}

/// The same inputs run into a new state directory (or one wiped) are new work: they reach
/// the remote under new keys, and are not dropped as repeats of the first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_inputs_in_a_new_state_directory_are_new_calls() {
    let remote = Remote::default();
    let url = serve(remote.clone()).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let state = dir.path().join("state");
    let run = {
        let (dir, state, url) = (dir.path().to_owned(), state.clone(), url.clone());
        move || rewind_run(&dir, &state, &url)
    };
    let first = tokio::task::spawn_blocking(run.clone())
        .await
        .expect("join");
    assert!(first.status.success(), "{first:?}");
    assert_eq!(remote.keys().len(), 3);

    std::fs::remove_dir_all(&state).expect("wiped");
    let second = tokio::task::spawn_blocking(run).await.expect("join");
    assert!(second.status.success(), "{second:?}");
    assert_eq!(
        (remote.keys().len(), remote.repeats()),
        (6, 0),
        "three new calls under three new keys"
    );
}
