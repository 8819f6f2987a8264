//! Component uploads a tenant cannot turn against the host: each is counted against
//! `compiles-per-minute`, one that does not fit the world leaves nothing behind, a replaced
//! component's compiled form goes when no version pins it, and versions past
//! `agent-versions-loaded` are let go and loaded again only for an input of theirs.

use std::path::Path;

use reqwest::StatusCode;
use serde_json::{Value, json};

use super::{Server, agent, send};
use crate::support::guest;

/// The compiled components in the tenant's cache (each has its MAC beside it).
fn compiled(state: &Path, tenant: &str) -> Vec<String> {
    let dir = state.join("tenants").join(tenant).join("compiled");
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|name| name.ends_with(".cwasm"))
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

async fn put(
    server: &Server,
    tenant: &str,
    token: &str,
    name: &str,
    body: Vec<u8>,
) -> (StatusCode, Value) {
    send(
        server
            .client
            .put(server.url(&format!("/v1/tenants/{tenant}/components/{name}")))
            .body(body),
        Some(token),
    )
    .await
}

#[tokio::test]
async fn uploads_that_fail_the_world_check_keep_nothing_and_run_out_of_their_quota() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = Server::start(
        dir.path(),
        "[tenants.evil.quotas]\ncompiles-per-minute = 12\n",
    )
    .await;
    let evil = server.tenant("evil").await;
    let good = server.tenant("good").await;
    server.deploy("good", &good, "bot", "hostile", "").await;

    let mut statuses = Vec::new();
    for i in 0..16 {
        // Distinct components (each compiled anew), none exporting `run`.
        let wat = format!("(component (core module (func (export \"f{i}\"))))");
        let (status, body) = put(&server, "evil", &evil, &format!("c{i}"), wat.into_bytes()).await;
        statuses.push((status, body["code"].as_str().unwrap_or_default().to_owned()));
        // The other tenant's events are taken meanwhile.
        let (status, body) = server
            .submit(
                "good",
                &good,
                "bot",
                &format!("e{i}"),
                "k",
                json!({ "mode": "print" }),
            )
            .await;
        assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    }
    let wrong_world = (StatusCode::UNPROCESSABLE_ENTITY, "wrong-world".to_owned());
    let over = (StatusCode::TOO_MANY_REQUESTS, "quota-exceeded".to_owned());
    assert_eq!(statuses[..12], vec![wrong_world; 12], "{statuses:?}");
    assert_eq!(statuses[12..], vec![over; 4], "{statuses:?}");
    let wat = "(component (core module (func (export \"late\"))))";
    let (_, body) = put(&server, "evil", &evil, "late", wat.into()).await;
    assert_eq!(body["quota"], "compiles-per-minute", "{body}");
    assert_eq!(
        compiled(dir.path(), "evil"),
        Vec::<String>::new(),
        "nothing kept"
    );
    assert!(
        !dir.path().join("tenants/evil/components").exists(),
        "no component stored"
    );
    let outputs = server.wait_outputs("good", &good, 16).await;
    assert_eq!(outputs.len(), 16, "the other tenant's inputs all ran");
}

#[tokio::test]
async fn a_replaced_components_compiled_form_goes_unless_a_version_pins_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = Server::start(dir.path(), "").await;
    let token = server.tenant("acme").await;
    let hostile = std::fs::read(guest("hostile")).expect("hostile");
    let caller = std::fs::read(guest("caller")).expect("caller");

    let (status, body) = put(&server, "acme", &token, "w", hostile.clone()).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    assert_eq!(compiled(dir.path(), "acme").len(), 1);
    // Replaced before any agent pinned it: its compiled form goes.
    let (status, body) = put(&server, "acme", &token, "w", caller).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    let only = compiled(dir.path(), "acme");
    assert_eq!(only.len(), 1, "{only:?}");
    assert!(
        only[0].starts_with(body["sha256"].as_str().expect("sha")),
        "{only:?}"
    );
    // Pinned by an agent version, it stays when replaced.
    let (status, body) = server.define("acme", &token, &agent("bot", "w", "")).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    let (status, body) = put(&server, "acme", &token, "w", hostile).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    assert_eq!(compiled(dir.path(), "acme").len(), 2);
}

#[tokio::test]
async fn a_version_let_go_is_loaded_again_for_an_input_of_its_own() {
    let dir = tempfile::tempdir().expect("tempdir");
    let quotas = "[tenants.acme.quotas]\nagent-versions-loaded = 1\n";
    // The spinning input runs until the server stops: it has CPU for minutes.
    let server = Server::start(
        dir.path(),
        &format!("shutdown-grace-ms = 0\n{quotas}fuel = 1_000_000_000_000\n"),
    )
    .await;
    let token = server.tenant("acme").await;
    let limits = "[limits]\nfuel = 1_000_000_000_000\n";
    server
        .deploy("acme", &token, "bot", "hostile", limits)
        .await;
    // Version 1 takes two inputs of one key: the first spins, so the second waits.
    for (id, mode) in [("spin", "loop"), ("after", "print")] {
        let (status, body) = server
            .submit("acme", &token, "bot", id, "k", json!({ "mode": mode }))
            .await;
        assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    }
    let (status, body) = server
        .define("acme", &token, &agent("bot", "worker", ""))
        .await;
    assert_eq!(
        (status, &body["version"]),
        (StatusCode::CREATED, &json!(2)),
        "{body}"
    );
    server.stop().await;

    // Started again with a small CPU budget, version 1 is not loaded (only the newest
    // is); its inputs load it: the spinning one fails at the budget and is parked; once it is
    // skipped, the next completes on version 1.
    // (Fuel, not a timeout: which of two limits a loop reaches first depends on the load.)
    let server = Server::start(dir.path(), &format!("{quotas}fuel = 50_000_000\n")).await;
    let history = server.settled_history("acme", &token, "bot", "k").await;
    let inputs = history["inputs"].as_array().expect("inputs");
    let seen: Vec<(u64, &str)> = inputs
        .iter()
        .map(|i| {
            (
                i["version"].as_u64().unwrap_or(0),
                i["status"].as_str().unwrap_or(""),
            )
        })
        .collect();
    assert_eq!(seen, [(1, "parked"), (1, "accepted")], "{history}");
    assert!(
        inputs[0]["error"]
            .as_str()
            .is_some_and(|e| e.contains("limit exceeded: fuel")),
        "{history}"
    );
    let (status, body) = server.skip("acme", &token, "bot", "k", 1, "it spins").await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let history = server.settled_history("acme", &token, "bot", "k").await;
    let done = &history["inputs"][1];
    assert_eq!(
        (&done["version"], &done["status"]),
        (&json!(1), &json!("done")),
        "{history}"
    );
}
