//! Durable clocks and randomness: what a guest reads from the WASI wall clock, monotonic
//! clock and random sources is recorded with its state and served again on replay, in Rust,
//! Python and JavaScript, with no SDK call.

use std::path::Path;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::http::HeaderMap;
use serde_json::{Value, json};

use crate::support::{
    Counting, agent_toml, agent_with, first_output, guest, input, memory_store, workspace_root,
};

in_every_language!(
    a_process_killed_after_a_call_makes_it_again_with_the_time_and_randomness_it_saw,
    a_replay_makes_its_calls_with_the_time_and_randomness_the_first_run_saw,
    a_run_of_another_input_reads_other_values,
    a_completed_runs_clock_and_random_readings_are_in_its_state,
);

/// Calls `count`, then `gate`, each with the wall-clock time and a random number in its args.
fn stamped() -> Value {
    json!({
        "calls": [
            { "function": "count", "args": {} },
            { "function": "gate", "args": {} },
        ],
        "stamp_calls": true,
    })
}

fn parsed(args: &str) -> Value {
    serde_json::from_str(args).expect("args are JSON")
}

async fn a_replay_makes_its_calls_with_the_time_and_randomness_the_first_run_saw(caller: &str) {
    let store = memory_store();
    let (count, gate) = (Counting::new(), Counting::unavailable_first(1));
    let agent = agent_with(
        &agent_toml(caller, "", ""),
        store.clone(),
        &[("count", count.clone()), ("gate", gate.clone())],
    );
    let first = agent
        .process(&input("k", 1, stamped()), &Default::default())
        .await;
    assert!(first.error.is_some(), "the outage ends the first run");

    // Time moves on (JavaScript's clock counts milliseconds) before the input is replayed.
    tokio::time::sleep(Duration::from_millis(20)).await;
    let replay = agent
        .process(&input("k", 1, stamped()), &Default::default())
        .await;
    assert!(replay.error.is_none(), "{replay:?}");
    assert_eq!(count.calls(), 1, "the first call is served from its record");

    // `gate` died with the first run: it is made again, and its args, read from the clock
    // and the random source before the call, are what the first run sent.
    let sent = gate.args();
    assert_eq!(sent.len(), 2, "{sent:?}");
    let (before, again) = (parsed(&sent[0]), parsed(&sent[1]));
    assert!(
        before["stamped_at"].as_u64().is_some_and(|at| at > 0),
        "{before}"
    );
    assert_eq!(before, again, "the replay saw other values");
    let results = &first_output(&replay)["results"];
    assert_eq!(results[0]["ok"]["args"], parsed(&count.args()[0]));
}

async fn a_run_of_another_input_reads_other_values(caller: &str) {
    // The same script under two keys: without records, the values are the sources' own.
    let gate = Counting::new();
    let agent = agent_with(
        &agent_toml(caller, "", ""),
        memory_store(),
        &[("count", Counting::new()), ("gate", gate.clone())],
    );
    for key in ["a", "b"] {
        let report = agent
            .process(&input(key, 1, stamped()), &Default::default())
            .await;
        assert!(report.error.is_none(), "{report:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let sent = gate.args();
    let (a, b) = (parsed(&sent[0]), parsed(&sent[1]));
    assert_ne!(a["nonce"], b["nonce"], "random numbers repeat across runs");
    assert_ne!(a["stamped_at"], b["stamped_at"], "the clock stood still");
}

async fn a_completed_runs_clock_and_random_readings_are_in_its_state(caller: &str) {
    let store = memory_store();
    let agent = agent_with(
        &agent_toml(caller, "", ""),
        store.clone(),
        &[("count", Counting::new()), ("gate", Counting::new())],
    );
    let report = agent
        .process(
            &input("k", 1, json!({ "ambient": true })),
            &Default::default(),
        )
        .await;
    assert!(report.error.is_none(), "{report:?}");
    let ambient = &first_output(&report)["ambient"];
    assert!(ambient.is_object(), "{ambient}");

    let scope = rewind_host::store::KeyScope::new("default", "test", "k");
    let states = rewind_host::store::ActionStateStore::states(&*store, &scope);
    let recorded = &states[0].ambient;
    assert!(states[0].is_completed());
    assert!(
        !recorded.wall.is_empty() && recorded.random_key.is_some(),
        "{recorded:?}"
    );
}

/// Rust's `HashMap` seeds itself from `wasi:random/insecure-seed`, which is derived from the
/// state's key: a run of the same state iterates in the same order, without a record.
#[tokio::test]
async fn a_rust_hash_map_iterates_in_the_same_order_when_a_state_runs_again() {
    let mut orders = Vec::new();
    for _ in 0..2 {
        // A fresh store each time: as if the first run's records had been lost.
        let agent = agent_with(&agent_toml("caller", "", ""), memory_store(), &[]);
        let report = agent
            .process(
                &input("k", 1, json!({ "ambient": true })),
                &Default::default(),
            )
            .await;
        assert!(report.error.is_none(), "{report:?}");
        orders.push(first_output(&report)["ambient"]["hash_order"].clone());
    }
    assert_eq!(orders[0], orders[1]);
    assert_eq!(orders[0].as_array().map(Vec::len), Some(8));
}

/// Every request a remote received: its idempotency key and body.
type Seen = Arc<Mutex<Vec<(String, Value)>>>;

/// A remote at `/charge` that answers `{"ok": true}` and keeps every request.
async fn recording_remote() -> (String, Seen) {
    let seen = Seen::default();
    let kept = Arc::clone(&seen);
    let app = axum::Router::new().route(
        "/charge",
        axum::routing::post(move |headers: HeaderMap, body: String| {
            let kept = Arc::clone(&kept);
            async move {
                let key = headers
                    .get("idempotency-key")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or_default()
                    .to_owned();
                let body = serde_json::from_str(&body).unwrap_or(Value::Null);
                kept.lock().expect("lock").push((key, body));
                axum::Json(json!({ "ok": true }))
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(listener, app).await });
    (format!("http://{addr}/charge"), seen)
}

/// Runs `rewind run` in `dir`, armed to crash at `crash` when set.
async fn rewind_run(dir: &Path, crash: Option<&str>) -> std::process::ExitStatus {
    let mut command = Command::new(env!("CARGO_BIN_EXE_rewind"));
    command
        .current_dir(dir)
        .arg("--cache-dir")
        .arg(workspace_root().join("target").join("rewind-test-cache"))
        .args([
            "run",
            "agent.toml",
            "--input",
            "inputs.jsonl",
            "--output",
            "out.jsonl",
        ])
        .env_remove(rewind_host::crash::ENV)
        .env_remove(rewind_host::durable::SEED_ENV)
        .stderr(std::process::Stdio::null());
    if let Some(crash) = crash {
        command.env(rewind_host::crash::ENV, crash);
    }
    tokio::task::spawn_blocking(move || command.status().expect("rewind runs"))
        .await
        .expect("joined")
}

async fn a_process_killed_after_a_call_makes_it_again_with_the_time_and_randomness_it_saw(
    caller: &str,
) {
    use std::os::unix::process::ExitStatusExt;

    let (url, seen) = recording_remote().await;
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(
        dir.path().join("agent.toml"),
        format!(
            "name = \"ambient\"\n\n[[actions]]\nname = \"work\"\ncomponent = {:?}\non = [\"input\"]\n\n[functions.charge]\nkind = \"http\"\nurl = \"{url}\"\n",
            guest(caller).display().to_string()
        ),
    )
    .expect("agent.toml");
    let script = json!({ "calls": [{ "function": "charge" }], "stamp_calls": true });
    std::fs::write(
        dir.path().join("inputs.jsonl"),
        format!("{}\n", json!({ "key": "k", "payload": script })),
    )
    .expect("inputs.jsonl");

    // Killed after the charge was answered, before its answer was recorded.
    let killed = rewind_run(dir.path(), Some("after-call:1")).await;
    assert_eq!(killed.signal(), Some(9), "{killed}");
    tokio::time::sleep(Duration::from_millis(20)).await;
    let finished = rewind_run(dir.path(), None).await;
    assert!(finished.success(), "{finished}");

    let seen = seen.lock().expect("lock").clone();
    assert_eq!(seen.len(), 2, "the call in doubt is made again: {seen:?}");
    assert_eq!(seen[0].0, seen[1].0, "with the same idempotency key");
    assert!(
        seen[0].1["stamped_at"].as_u64().is_some_and(|at| at > 0),
        "{:?}",
        seen[0].1
    );
    assert_eq!(
        seen[0].1, seen[1].1,
        "the restarted process read other values from the clock or the random source"
    );
}
