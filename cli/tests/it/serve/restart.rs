//! `rewind serve` killed with SIGKILL and started again: no accepted event lost, no
//! recorded call repeated, no output written twice.

use std::collections::BTreeSet;
use std::path::Path;
use std::time::Duration;

use reqwest::StatusCode;
use serde_json::json;

use super::{Endpoint, Process, create, one_call, send, wait_outputs, write_config};
use crate::support::guest;

/// Starts `rewind serve --config CONFIG`, with `crash` armed; the process and its base URL.
fn start(config: &Path, crash: Option<&str>) -> (Process, String) {
    let process = Process::start(config, crash);
    let base = process.base.clone();
    (process, base)
}

#[tokio::test]
async fn a_server_killed_mid_run_loses_no_event_and_repeats_no_recorded_call() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (addr, endpoint) = Endpoint::start(Duration::from_millis(20), "").await;
    // One run at a time: when the process dies, no other call is in flight.
    let config = write_config(
        dir.path(),
        &format!(
            "[tenants.acme]\nallow-hosts = [\"{addr}\"]\n[tenants.acme.quotas]\nconcurrent-runs = 1\n"
        ),
    );
    let (mut server, base) = start(&config, Some("after-record:3"));
    let client = reqwest::Client::new();
    let acme = create(&client, &base, "acme").await;
    let wasm = std::fs::read(guest("caller")).expect("caller");
    let (status, body) = send(
        client
            .put(format!("{base}/v1/tenants/acme/components/worker"))
            .body(wasm),
        Some(&acme),
    )
    .await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    let toml = super::agent(
        "bot",
        "worker",
        &format!("[functions.f]\nkind = \"http\"\nurl = \"http://{addr}/\"\n"),
    );
    let (status, body) = send(
        client
            .post(format!("{base}/v1/tenants/acme/agents"))
            .body(toml),
        Some(&acme),
    )
    .await;
    assert_eq!(status, StatusCode::CREATED, "{body}");

    // Six events; the third recorded call kills the process. Those it did not answer are
    // sent again after the restart, with the same ids, as a client would.
    let events: Vec<(String, String)> = (0..6)
        .map(|i| (format!("e{i}"), format!("k{}", i % 2)))
        .collect();
    let mut unanswered = Vec::new();
    for (id, key) in &events {
        let request = client
            .post(format!("{base}/v1/tenants/acme/agents/bot/events"))
            .bearer_auth(&acme)
            .json(&json!({ "id": id, "key": key, "payload": one_call("f") }));
        match request.send().await {
            Ok(response) if response.status() == StatusCode::ACCEPTED => {}
            _ => unanswered.push((id.clone(), key.clone())),
        }
    }
    let status = tokio::task::spawn_blocking(move || server.child.wait())
        .await
        .expect("joined")
        .expect("waits");
    assert!(!status.success(), "killed at the crash point: {status}");
    let before = endpoint.keys();
    assert_eq!(
        before.len(),
        3,
        "three calls made before the kill: {before:?}"
    );

    let (mut server, base) = start(&config, None);
    for (id, key) in events.iter() {
        let (status, body) = send(
            client
                .post(format!("{base}/v1/tenants/acme/agents/bot/events"))
                .json(&json!({ "id": id, "key": key, "payload": one_call("f") })),
            Some(&acme),
        )
        .await;
        let expected = if unanswered.contains(&(id.clone(), key.clone())) {
            [StatusCode::ACCEPTED, StatusCode::OK]
        } else {
            // Accepted before the kill: a retry finds it.
            [StatusCode::OK, StatusCode::OK]
        };
        assert!(expected.contains(&status), "{id}: {status} {body}");
    }
    let outputs = wait_outputs(&client, &base, "acme", &acme, events.len()).await;
    let ids: BTreeSet<&str> = outputs
        .iter()
        .filter_map(|o| o["event_id"].as_str())
        .collect();
    assert_eq!(outputs.len(), events.len(), "no output twice: {outputs:?}");
    assert_eq!(ids.len(), events.len(), "no event lost");

    // Every call happened once: the one recorded just before the kill was served from its
    // record, not made again.
    let keys = endpoint.keys();
    let distinct: BTreeSet<&String> = keys.iter().collect();
    assert_eq!(keys.len(), events.len(), "{keys:?}");
    assert_eq!(distinct.len(), events.len());

    let pid = rustix::process::Pid::from_raw(server.child.id().cast_signed()).expect("pid");
    rustix::process::kill_process(pid, rustix::process::Signal::TERM).expect("SIGTERM");
    let status = tokio::task::spawn_blocking(move || server.child.wait())
        .await
        .expect("joined")
        .expect("waits");
    assert!(status.success(), "a clean stop on SIGTERM: {status}");
}

/// A server that stopped between an input's outputs and its `finished` record (two appends
/// to the journal), in a build that wrote outputs without id or tenant: at the next start
/// the input runs again, and its output is in the stream once, as it was first written.
#[tokio::test]
async fn an_output_written_before_its_input_finished_is_not_written_again() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = super::Server::start(dir.path(), "").await;
    let token = server.tenant("acme").await;
    server.deploy("acme", &token, "bot", "caller", "").await;
    server.stop().await;
    {
        // What such a stop leaves: the event accepted, its output, no `finished`.
        let (journal, _) = rewind_host::log::FileLog::open(
            &dir.path().join("tenants/acme/journal"),
            rewind_host::log::FileLogOptions {
                partitions: 2,
                ..rewind_host::log::FileLogOptions::default()
            },
        )
        .expect("the journal opens");
        let accepted = json!({ "accepted": { "agent": "bot", "event_id": "e-1", "key": "k",
            "sequence": 1, "version": 1, "payload": {}, "accepted_at": 0 } });
        let output = json!({ "agent": "bot", "key": "k", "sequence": 1, "index": 0,
            "event_id": "e-1", "payload": { "written": "before the stop" } });
        use rewind_host::log::Log as _;
        journal
            .append(0, accepted.to_string().into_bytes())
            .await
            .expect("accepted");
        journal
            .append(1, output.to_string().into_bytes())
            .await
            .expect("output");
    }
    let server = super::Server::start(dir.path(), "").await;
    // An event behind it on the key: its output comes after the rerun's.
    let (status, body) = server
        .submit("acme", &token, "bot", "e-2", "k", json!({}))
        .await;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    let outputs = server.wait_outputs("acme", &token, 2).await;
    let events: Vec<&str> = outputs
        .iter()
        .map(|o| o["event_id"].as_str().unwrap_or_default())
        .collect();
    assert_eq!(
        events,
        ["e-1", "e-2"],
        "each input's output once: {outputs:?}"
    );
    assert_eq!(
        outputs[0]["payload"],
        json!({ "written": "before the stop" })
    );
    assert_eq!(outputs[0]["id"], "acme/bot/k/1/0", "{outputs:?}");
    let history = server.settled_history("acme", &token, "bot", "k").await;
    assert_eq!(
        history["inputs"].as_array().map(Vec::len),
        Some(2),
        "{history}"
    );
}
