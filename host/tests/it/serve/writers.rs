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

/// Two servers each accepted two events for one key, both as #1 and #2, and wrote them to
/// one journal (as two processes on one directory did before the lock). The server that
/// opens it reports the second process's inputs as not run, shows none of them running,
/// and goes on with the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_journal_two_processes_wrote_is_reported_and_no_input_runs_for_ever() {
    let (a, b) = (
        tempfile::tempdir().expect("tempdir"),
        tempfile::tempdir().expect("tempdir"),
    );
    let mut tokens = Vec::new();
    for (dir, events) in [(&a, ["a1", "a2"]), (&b, ["b1", "b2"])] {
        let server = Server::start(dir.path(), "").await;
        let token = server.tenant("acme").await;
        server.deploy("acme", &token, "bot", "caller", "").await;
        for id in events {
            let (status, body) = server
                .submit("acme", &token, "bot", id, "k", json!({}))
                .await;
            assert_eq!(status, StatusCode::ACCEPTED, "{body}");
        }
        server.settled_history("acme", &token, "bot", "k").await;
        server.stop().await;
        tokens.push(token);
    }
    // A's journal made again with B's input records among A's, one from each in turn, as
    // two processes appending at once wrote them.
    let journal_dir = a.path().join("tenants/acme/journal");
    let journal = |dir: &Path| {
        FileLog::open(
            dir,
            FileLogOptions {
                partitions: 2,
                ..FileLogOptions::default()
            },
        )
        .expect("the journal opens")
        .0
    };
    let everything = |log: FileLog, partition: u32| async move {
        let (start, end) = log.bounds(partition).await.expect("bounds");
        let records = log
            .read(
                partition,
                start,
                usize::try_from(end - start).expect("fits"),
            )
            .await
            .expect("read");
        records.into_iter().map(|r| r.payload).collect::<Vec<_>>()
    };
    let a_inputs = everything(journal(&journal_dir), 0).await;
    let a_outputs = everything(journal(&journal_dir), 1).await;
    let b_inputs = everything(journal(&b.path().join("tenants/acme/journal")), 0).await;
    std::fs::remove_dir_all(&journal_dir).expect("the old journal removed");
    let merged = journal(&journal_dir);
    let (mut a_inputs, mut b_inputs) = (a_inputs.into_iter(), b_inputs.into_iter());
    loop {
        let (from_a, from_b) = (a_inputs.next(), b_inputs.next());
        if from_a.is_none() && from_b.is_none() {
            break;
        }
        for record in from_a.into_iter().chain(from_b) {
            merged.append(0, record).await.expect("append");
        }
    }
    for record in a_outputs {
        merged.append(1, record).await.expect("append");
    }
    drop(merged);

    let server = Server::start(a.path(), "").await;
    let history = server.settled_history("acme", &tokens[0], "bot", "k").await;
    let inputs = history["inputs"].as_array().expect("inputs");
    let by_id = |id: &str| -> &Value {
        inputs
            .iter()
            .find(|i| i["event_id"] == id)
            .unwrap_or_else(|| panic!("{id} in {history}"))
    };
    assert_eq!(inputs.len(), 4, "{history}");
    for id in ["a1", "a2"] {
        assert_eq!(by_id(id)["status"], "completed", "{history}");
    }
    for id in ["b1", "b2"] {
        let input = by_id(id);
        assert_eq!(input["status"], "failed", "{history}");
        assert!(
            input["error"]
                .as_str()
                .is_some_and(|e| e.contains("two processes wrote")),
            "{history}"
        );
    }
    // The key goes on after the damage.
    let (status, body) = server
        .submit("acme", &tokens[0], "bot", "a3", "k", json!({}))
        .await;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    assert_eq!(body["sequence"], 3, "{body}");
    let history = server.settled_history("acme", &tokens[0], "bot", "k").await;
    assert_eq!(history["inputs"].as_array().map(Vec::len), Some(5));
}
