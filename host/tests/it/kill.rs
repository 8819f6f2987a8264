//! The `rewind` binary killed with SIGKILL at arbitrary points and started again until done.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::routing::post;
use serde_json::{Value, json};

use crate::support::{guest, workspace_root};

/// A remote that honours `Idempotency-Key`: the first request of a key has its effect (and
/// is counted), a repeat gets the stored answer and has none.
#[derive(Clone, Default)]
struct Remote {
    effects: Arc<Mutex<BTreeMap<String, Value>>>,
    requests: Arc<Mutex<BTreeMap<String, u64>>>,
}

async fn serve(remote: Remote) -> String {
    let app = Router::new()
        .route(
            "/charge",
            post(|State(remote): State<Remote>, headers: HeaderMap, body: String| async move {
                let key = headers
                    .get("idempotency-key")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or_default()
                    .to_owned();
                *remote.requests.lock().expect("lock").entry(key.clone()).or_default() += 1;
                let answer = remote
                    .effects
                    .lock()
                    .expect("lock")
                    .entry(key)
                    .or_insert_with(|| json!({ "charged": serde_json::from_str::<Value>(&body).unwrap_or_default() }))
                    .clone();
                // Slow enough that kills often land while a call is in flight.
                tokio::time::sleep(Duration::from_millis(3)).await;
                axum::Json(answer)
            }),
        )
        .with_state(remote);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}/charge")
}

fn write_agent(dir: &Path, url: &str) -> std::path::PathBuf {
    let path = dir.join("agent.toml");
    std::fs::write(
        &path,
        format!(
            "name = \"kill\"\nparallelism = 4\n\n[state]\npartitions = 4\ncheckpoint-every-ms = 15\ncheckpoint-every-inputs = 7\n\n[[actions]]\nname = \"work\"\ncomponent = {:?}\non = [\"input\"]\n\n[functions.charge]\nkind = \"http\"\nurl = \"{url}\"\n",
            guest("caller").display().to_string()
        ),
    )
    .expect("write agent.toml");
    path
}

fn write_inputs(dir: &Path) -> std::path::PathBuf {
    let path = dir.join("inputs.jsonl");
    let mut text = String::new();
    for i in 0..150 {
        let line = json!({ "key": format!("customer-{}", i % 6), "payload": { "calls": [
            { "function": "charge", "args": { "input": i, "part": 1 } },
            { "function": "charge", "args": { "input": i, "part": 2 } },
        ], "memory_set": { "last": i } } });
        text.push_str(&format!("{line}\n"));
    }
    std::fs::write(&path, text).expect("write inputs");
    path
}

fn rewind_run(dir: &Path, agent: &Path, inputs: &Path) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_rewind"));
    command
        .current_dir(dir)
        .arg("--cache-dir")
        .arg(workspace_root().join("target").join("rewind-test-cache"))
        .arg("run")
        .arg(agent)
        .arg("--input")
        .arg(inputs)
        .arg("--output")
        .arg(dir.join("out.jsonl"))
        .arg("--state")
        .arg(dir.join("state"))
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    command
}

fn sorted_lines(path: &Path) -> Vec<String> {
    let mut lines: Vec<String> = std::fs::read_to_string(path)
        .expect("outputs")
        .lines()
        .map(str::to_owned)
        .collect();
    lines.sort();
    lines
}

/// A small deterministic generator for the kill delays (the same seed, the same delays).
fn delays(seed: u64) -> impl Iterator<Item = Duration> {
    let mut state = seed;
    std::iter::repeat_with(move || {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        Duration::from_millis(20 + (state >> 33) % 120)
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_and_restarted_runs_call_each_key_once_and_write_the_uninterrupted_output() {
    let reference_remote = Remote::default();
    let reference_url = serve(reference_remote.clone()).await;
    let reference = tempfile::tempdir().expect("tempdir");
    let agent = write_agent(reference.path(), &reference_url);
    let inputs = write_inputs(reference.path());
    let status = tokio::task::spawn_blocking({
        let (dir, agent, inputs) = (reference.path().to_owned(), agent.clone(), inputs.clone());
        move || rewind_run(&dir, &agent, &inputs).status().expect("runs")
    })
    .await
    .expect("join");
    assert!(status.success());

    let remote = Remote::default();
    let url = serve(remote.clone()).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let agent = write_agent(dir.path(), &url);
    let inputs = write_inputs(dir.path());
    let mut kills = 0;
    let finished = tokio::task::spawn_blocking({
        let (dir, agent, inputs) = (dir.path().to_owned(), agent.clone(), inputs.clone());
        move || {
            let seed = 7;
            for delay in delays(seed).take(40) {
                let mut child = rewind_run(&dir, &agent, &inputs).spawn().expect("spawns");
                std::thread::sleep(delay);
                match child.try_wait().expect("wait") {
                    Some(status) => return (status.success(), kills),
                    None => {
                        child.kill().expect("SIGKILL");
                        child.wait().expect("reaped");
                        kills += 1;
                    }
                }
            }
            let status = rewind_run(&dir, &agent, &inputs).status().expect("runs");
            (status.success(), kills)
        }
    })
    .await
    .expect("join");
    let (succeeded, kills) = finished;
    assert!(succeeded, "the last run finished cleanly");
    assert!(kills >= 2, "the run was killed more than once: {kills}");

    assert_eq!(
        sorted_lines(&dir.path().join("out.jsonl")),
        sorted_lines(&reference.path().join("out.jsonl")),
        "after {kills} kills, the same outputs as the uninterrupted run, each once"
    );
    let effects: BTreeSet<String> = remote
        .effects
        .lock()
        .expect("lock")
        .keys()
        .cloned()
        .collect();
    let expected: BTreeSet<String> = reference_remote
        .effects
        .lock()
        .expect("lock")
        .keys()
        .cloned()
        .collect();
    assert_eq!(
        effects, expected,
        "the same calls, with the same idempotency keys"
    );
    assert_eq!(effects.len(), 300);
    // A call in flight at a kill (sent, its record not yet durable) is made again with the
    // same key after the restart; the remote drops the repeat. At most `parallelism` (4)
    // calls are in flight at once.
    let requests = remote.requests.lock().expect("lock").clone();
    let repeated: u64 = requests.values().map(|n| n - 1).sum();
    assert!(
        repeated <= kills * 4,
        "only calls in flight at a kill reach the remote again: {repeated} repeats, {kills} kills"
    );
}
