//! One process writes a state directory: a second server on it is refused, and the damage
//! two writers left in a journal (before the lock) is reported, not run forever.

use std::path::Path;

use reqwest::StatusCode;
use rewind_host::log::{FileLog, FileLogOptions, Log};
use rewind_host::server::{ServerConfig, ServerState};
use serde_json::{Value, json};

use super::{ADMIN, Server};
use crate::support::sandbox;

fn config(state_dir: &Path) -> (ServerConfig, std::path::PathBuf) {
    let path = state_dir.join("rewind.toml");
    let config = ServerConfig::parse(
        &path,
        "state-dir = \".\"\n[admin-token]\nenv = \"UNUSED\"\n",
    )
    .expect("config");
    (config, path)
}

#[tokio::test]
async fn a_second_server_on_one_state_directory_is_refused_naming_the_first() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (config, path) = config(dir.path());
    let first = ServerState::start(config.clone(), &path, ADMIN, sandbox())
        .await
        .expect("the first server starts");
    let message = ServerState::start(config, &path, ADMIN, sandbox())
        .await
        .expect_err("a second server on the same directory")
        .to_string();
    assert!(
        message.contains("in use by another rewind process")
            && message.contains(&format!("pid {}", std::process::id()))
            && message.contains(&dir.path().display().to_string()),
        "{message}"
    );
    drop(first);
}

/// Two servers that each accepted events `a1`, `a2` and `b1`, `b2` for key `k` of agent
/// `bot`, both as #1 and #2, each in a directory of its own (as two processes on one
/// directory did before the lock), with each event's payload; and the admin's tokens.
struct TwoWriters {
    a: tempfile::TempDir,
    b: tempfile::TempDir,
    token: String,
}

async fn two_writers(a_payload: Value, b_payload: Value) -> TwoWriters {
    let (a, b) = (
        tempfile::tempdir().expect("tempdir"),
        tempfile::tempdir().expect("tempdir"),
    );
    let mut tokens = Vec::new();
    for (dir, events, payload) in [
        (&a, ["a1", "a2"], &a_payload),
        (&b, ["b1", "b2"], &b_payload),
    ] {
        let server = Server::start(dir.path(), "").await;
        let token = server.tenant("acme").await;
        server.deploy("acme", &token, "bot", "caller", "").await;
        for id in events {
            let (status, body) = server
                .submit("acme", &token, "bot", id, "k", payload.clone())
                .await;
            assert_eq!(status, StatusCode::ACCEPTED, "{body}");
        }
        server.settled_history("acme", &token, "bot", "k").await;
        server.stop().await;
        tokens.push(token);
    }
    TwoWriters {
        a,
        b,
        token: tokens.swap_remove(0),
    }
}

fn journal(dir: &Path) -> FileLog {
    FileLog::open(
        dir,
        FileLogOptions {
            partitions: 2,
            ..FileLogOptions::default()
        },
    )
    .expect("the journal opens")
    .0
}

/// Every record of `partition` of the journal in `dir`, as JSON.
async fn records(dir: &Path, partition: u32) -> Vec<Value> {
    let log = journal(&dir.join("tenants/acme/journal"));
    let (start, end) = log.bounds(partition).await.expect("bounds");
    let read = log
        .read(
            partition,
            start,
            usize::try_from(end - start).expect("fits"),
        )
        .await
        .expect("read");
    read.iter()
        .map(|r| serde_json::from_slice(&r.payload).expect("a JSON record"))
        .collect()
}

/// Makes A's journal again, holding `inputs` and `outputs`, in that order.
async fn rewrite(writers: &TwoWriters, inputs: &[Value], outputs: &[Value]) {
    let dir = writers.a.path().join("tenants/acme/journal");
    std::fs::remove_dir_all(&dir).expect("the old journal removed");
    let merged = journal(&dir);
    for (partition, records) in [(0, inputs), (1, outputs)] {
        for record in records {
            let bytes = serde_json::to_vec(record).expect("JSON");
            merged.append(partition, bytes).await.expect("append");
        }
    }
}

/// The inputs of A's history, by event id, once the server that opens A's directory has
/// settled.
async fn settled_inputs(server: &Server, writers: &TwoWriters) -> (Value, Vec<Value>) {
    let history = server
        .settled_history("acme", &writers.token, "bot", "k")
        .await;
    let inputs = history["inputs"].as_array().expect("inputs").clone();
    (history, inputs)
}

fn by_id<'a>(inputs: &'a [Value], id: &str, history: &Value) -> &'a Value {
    inputs
        .iter()
        .find(|i| i["event_id"] == id)
        .unwrap_or_else(|| panic!("{id} in {history}"))
}

fn assert_reported_as_the_other_writers(input: &Value, history: &Value) {
    assert_eq!(input["status"], "failed", "{history}");
    assert!(
        input["error"]
            .as_str()
            .is_some_and(|e| e.contains("two processes wrote")),
        "{history}"
    );
}

/// The inputs partition's records of `kind` (`accepted` or `finished`).
fn of_kind<'a>(records: &'a [Value], kind: &str) -> Vec<&'a Value> {
    records.iter().filter(|r| r.get(kind).is_some()).collect()
}

/// Two servers' input records written to one journal, one from each in turn. The server
/// that opens it reports the second process's inputs as not run, shows none of them
/// running, and goes on with the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_journal_two_processes_wrote_is_reported_and_no_input_runs_for_ever() {
    let writers = two_writers(json!({}), json!({})).await;
    let (a_inputs, b_inputs) = (
        records(writers.a.path(), 0).await,
        records(writers.b.path(), 0).await,
    );
    let mut inputs = Vec::new();
    for turn in 0..a_inputs.len().max(b_inputs.len()) {
        inputs.extend(a_inputs.get(turn).cloned());
        inputs.extend(b_inputs.get(turn).cloned());
    }
    let outputs = records(writers.a.path(), 1).await;
    rewrite(&writers, &inputs, &outputs).await;

    let server = Server::start(writers.a.path(), "").await;
    let (history, inputs) = settled_inputs(&server, &writers).await;
    assert_eq!(inputs.len(), 4, "{history}");
    for id in ["a1", "a2"] {
        assert_eq!(by_id(&inputs, id, &history)["status"], "done", "{history}");
    }
    for id in ["b1", "b2"] {
        assert_reported_as_the_other_writers(by_id(&inputs, id, &history), &history);
    }
    // The key goes on after the damage.
    let (status, body) = server
        .submit("acme", &writers.token, "bot", "a3", "k", json!({}))
        .await;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    assert_eq!(body["sequence"], 3, "{body}");
    let (_, inputs) = settled_inputs(&server, &writers).await;
    assert_eq!(inputs.len(), 5);
}

/// The second process's inputs finished before the first's, and the first died before
/// finishing `a2`: a `finished` record of the second process is not taken for the first's
/// input (it names its event), so `a1` keeps its own, and `a2` runs again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_finished_record_of_the_other_writer_is_not_taken_for_this_ones() {
    // A's inputs each write an output; B's write none: whose `finished` an input got shows.
    let writers = two_writers(json!({}), json!({ "output": false })).await;
    let (a_inputs, b_inputs) = (
        records(writers.a.path(), 0).await,
        records(writers.b.path(), 0).await,
    );
    let (a_accepted, b_accepted) = (
        of_kind(&a_inputs, "accepted"),
        of_kind(&b_inputs, "accepted"),
    );
    let mut inputs: Vec<Value> = Vec::new();
    for (a, b) in a_accepted.iter().zip(&b_accepted) {
        inputs.extend([(*a).clone(), (*b).clone()]);
    }
    inputs.extend(of_kind(&b_inputs, "finished").into_iter().cloned());
    let a_first = of_kind(&a_inputs, "finished")
        .into_iter()
        .find(|r| r["finished"]["sequence"] == 1)
        .expect("a1 finished");
    inputs.push(a_first.clone());
    let outputs: Vec<Value> = records(writers.a.path(), 1)
        .await
        .into_iter()
        .filter(|o| o["sequence"] == 1)
        .collect();
    rewrite(&writers, &inputs, &outputs).await;

    let server = Server::start(writers.a.path(), "").await;
    let (history, inputs) = settled_inputs(&server, &writers).await;
    assert_eq!(inputs.len(), 4, "{history}");
    for id in ["a1", "a2"] {
        let input = by_id(&inputs, id, &history);
        assert_eq!(
            (&input["status"], &input["outputs"]),
            (&json!("done"), &json!(1)),
            "{id} finished by its own run: {history}"
        );
    }
    for id in ["b1", "b2"] {
        assert_reported_as_the_other_writers(by_id(&inputs, id, &history), &history);
    }
    let outputs = server.outputs("acme", &writers.token, 0).await;
    assert_eq!(
        outputs.len(),
        2,
        "one output of a1, one of a2's run: {outputs:?}"
    );
}
