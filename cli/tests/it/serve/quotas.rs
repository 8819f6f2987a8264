//! Each quota, exhausted: refused naming it (429, or 422 for an agent that asks for more than one allows), or the run stopped at it.

use std::sync::atomic::Ordering;
use std::time::Duration;

use reqwest::StatusCode;
use serde_json::{Value, json};

use super::{Endpoint, Server, agent, one_call};

/// The error of the key's only input, once it finished.
async fn failure(server: &Server, tenant: &str, token: &str, key: &str) -> String {
    let history = server.settled_history(tenant, token, "bot", key).await;
    let input = &history["inputs"][0];
    assert_eq!(input["status"], "parked", "{history}");
    input["error"].as_str().unwrap_or_default().to_owned()
}

fn quota_of(body: &Value) -> (Option<&str>, Option<&str>) {
    (body["code"].as_str(), body["quota"].as_str())
}

#[tokio::test]
async fn per_run_quotas_refuse_an_agent_asking_for_more_and_stop_a_run_that_uses_more() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = Server::start(
        dir.path(),
        "[tenants.small.quotas]\nmemory-mib = 16\n\
         [tenants.frugal.quotas]\nfuel = 50_000_000\n\
         [tenants.quick.quotas]\ntimeout-ms = 300\nfuel = 1_000_000_000_000\n",
    )
    .await;
    let small = server.tenant("small").await;
    let frugal = server.tenant("frugal").await;
    let quick = server.tenant("quick").await;
    let tenants = [("small", &small), ("frugal", &frugal), ("quick", &quick)];
    for (tenant, token) in tenants {
        server.upload(tenant, token, "worker", "hostile").await;
    }
    for (tenant, token, limits, quota) in [
        ("small", &small, "memory-mib = 32", "memory-mib"),
        ("frugal", &frugal, "fuel = 100_000_000", "fuel"),
        ("quick", &quick, "timeout-ms = 1000", "timeout-ms"),
    ] {
        let toml = agent("bot", "worker", &format!("[limits]\n{limits}\n"));
        let (status, body) = server.define(tenant, token, &toml).await;
        // No retry fixes it: 422, not 429 (which clients retry).
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
        assert_eq!(
            quota_of(&body),
            (Some("quota-exceeded"), Some(quota)),
            "{body}"
        );
        assert!(
            body["error"].as_str().is_some_and(|e| e.contains(quota)),
            "{body}"
        );
    }
    // Defaults above the quotas are lowered to them; limits within them are kept (quick's
    // loop runs into its wall-clock quota, not its CPU).
    for (tenant, token) in tenants {
        let limits = if tenant == "quick" {
            "[limits]\nfuel = 1_000_000_000_000\n"
        } else {
            ""
        };
        let (status, body) = server
            .define(tenant, token, &agent("bot", "worker", limits))
            .await;
        assert_eq!(status, StatusCode::CREATED, "{body}");
    }
    for (tenant, token, key, mode, says) in [
        ("small", &small, "m", "alloc", "memory"),
        ("frugal", &frugal, "f", "loop", "fuel"),
        ("quick", &quick, "t", "loop", "timeout"),
    ] {
        let (status, _) = server
            .submit(tenant, token, "bot", key, key, json!({ "mode": mode }))
            .await;
        assert_eq!(status, StatusCode::ACCEPTED);
        let error = failure(&server, tenant, token, key).await;
        assert!(error.contains(says), "{tenant} {mode}: {error}");
    }
}

#[tokio::test]
async fn concurrent_runs_are_capped_and_queued_inputs_refused_beyond_the_quota() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (addr, endpoint) = Endpoint::start(Duration::from_millis(150), "").await;
    let server = Server::start(
        dir.path(),
        &format!(
            "[tenants.acme]\nallow-hosts = [\"{addr}\"]\n\
             [tenants.acme.quotas]\nconcurrent-runs = 1\nqueued-inputs = 3\n"
        ),
    )
    .await;
    let acme = server.tenant("acme").await;
    server.upload("acme", &acme, "worker", "caller").await;
    let slow = format!("[functions.slow]\nkind = \"http\"\nurl = \"http://{addr}/\"\n");
    let (status, body) = server
        .define(
            "acme",
            &acme,
            &format!("parallelism = 2\n{}", agent("bot", "worker", &slow)),
        )
        .await;
    assert_eq!(
        quota_of(&body),
        (Some("quota-exceeded"), Some("concurrent-runs")),
        "{status} {body}"
    );
    let (status, body) = server
        .define("acme", &acme, &agent("bot", "worker", &slow))
        .await;
    assert_eq!(status, StatusCode::CREATED, "{body}");

    // Three keys at once: one runs, two wait; a fourth input is one too many.
    for key in ["a", "b", "c"] {
        let (status, body) = server
            .submit("acme", &acme, "bot", key, key, one_call("slow"))
            .await;
        assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    }
    let (status, body) = server
        .submit("acme", &acme, "bot", "d", "d", one_call("slow"))
        .await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        quota_of(&body),
        (Some("quota-exceeded"), Some("queued-inputs")),
        "{body}"
    );

    server.wait_outputs("acme", &acme, 3).await;
    assert_eq!(endpoint.count(), 3);
    assert_eq!(
        endpoint.most_at_once.load(Ordering::SeqCst),
        1,
        "one run at a time"
    );
    // Room again once they finished.
    let (status, _) = server
        .submit("acme", &acme, "bot", "d", "d", one_call("slow"))
        .await;
    assert_eq!(status, StatusCode::ACCEPTED);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agents_parallelism_caps_its_runs_within_the_tenants() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (addr, endpoint) = Endpoint::start(Duration::from_millis(150), "").await;
    // The tenant would run four at once; the agent asks for one.
    let server = Server::start(
        dir.path(),
        &format!(
            "[tenants.acme]\nallow-hosts = [\"{addr}\"]\n\
             [tenants.acme.quotas]\nconcurrent-runs = 4\n"
        ),
    )
    .await;
    let acme = server.tenant("acme").await;
    server.upload("acme", &acme, "worker", "caller").await;
    let slow = format!("[functions.slow]\nkind = \"http\"\nurl = \"http://{addr}/\"\n");
    let (status, body) = server
        .define(
            "acme",
            &acme,
            &format!("parallelism = 1\n{}", agent("bot", "worker", &slow)),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    for key in ["a", "b", "c", "d"] {
        let (status, body) = server
            .submit("acme", &acme, "bot", key, key, one_call("slow"))
            .await;
        assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    }
    server.wait_outputs("acme", &acme, 4).await;
    assert_eq!(endpoint.count(), 4);
    assert_eq!(
        endpoint.most_at_once.load(Ordering::SeqCst),
        1,
        "one run of the agent at a time"
    );
}

#[tokio::test]
async fn calls_per_minute_deny_the_call_past_it_and_refuse_new_events() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (addr, endpoint) = Endpoint::start(Duration::ZERO, "").await;
    let server = Server::start(
        dir.path(),
        &format!(
            "[tenants.acme]\nallow-hosts = [\"{addr}\"]\n[tenants.acme.quotas]\ncalls-per-minute = 2\n"
        ),
    )
    .await;
    let acme = server.tenant("acme").await;
    let f = format!("[functions.f]\nkind = \"http\"\nurl = \"http://{addr}/\"\n");
    server.deploy("acme", &acme, "bot", "caller", &f).await;
    let three = json!({ "calls": [{ "function": "f", "args": { "i": 1 } },
        { "function": "f", "args": { "i": 2 } }, { "function": "f", "args": { "i": 3 } }] });
    let (status, _) = server.submit("acme", &acme, "bot", "e1", "k", three).await;
    assert_eq!(status, StatusCode::ACCEPTED);
    let outputs = server.wait_outputs("acme", &acme, 1).await;
    let results = &outputs[0]["payload"]["results"];
    assert!(results[1]["ok"].is_object(), "{results}");
    let denied = results[2]["error"]["denied"].as_str().unwrap_or_default();
    assert!(denied.contains("calls-per-minute"), "{results}");
    assert_eq!(endpoint.count(), 2, "the denied call did not go out");

    let (status, body) = server
        .submit("acme", &acme, "bot", "e2", "k", json!(null))
        .await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        quota_of(&body),
        (Some("quota-exceeded"), Some("calls-per-minute")),
        "{body}"
    );
}

#[tokio::test]
async fn stored_bytes_refuse_what_would_not_fit() {
    let dir = tempfile::tempdir().expect("tempdir");
    let caller = std::fs::metadata(crate::support::guest("caller"))
        .expect("caller")
        .len();
    // The deployed agent's component, its pin and its compiled form count; measured, then
    // the quota set to leave room for half a component more.
    let server = Server::start(dir.path(), "").await;
    let acme = server.tenant("acme").await;
    server.deploy("acme", &acme, "bot", "caller", "").await;
    let (_, shown) = super::send(
        server.client.get(server.url("/v1/tenants/acme")),
        Some(&acme),
    )
    .await;
    let deployed = shown["stored_bytes"].as_u64().expect("stored bytes");
    assert!(
        deployed > 2 * caller,
        "the compiled form counts: {deployed} bytes stored for a {caller}-byte component"
    );
    server.stop().await;
    let quota = deployed + caller / 2;
    let server = Server::start(
        dir.path(),
        &format!("[tenants.acme.quotas]\nstored-bytes = {quota}\n"),
    )
    .await;
    let wasm = std::fs::read(crate::support::guest("caller")).expect("caller");
    let (status, body) = super::send(
        server
            .client
            .put(server.url("/v1/tenants/acme/components/another"))
            .body(wasm),
        Some(&acme),
    )
    .await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{body}");
    assert_eq!(
        quota_of(&body),
        (Some("quota-exceeded"), Some("stored-bytes")),
        "{body}"
    );
    let big = "x".repeat(usize::try_from(caller).expect("fits"));
    let (status, body) = server
        .submit("acme", &acme, "bot", "e1", "k", json!(big))
        .await;
    assert_eq!(
        quota_of(&body),
        (Some("quota-exceeded"), Some("stored-bytes")),
        "{status} {body}"
    );
    // Small events still fit.
    let (status, _) = server
        .submit("acme", &acme, "bot", "e2", "k", json!(null))
        .await;
    assert_eq!(status, StatusCode::ACCEPTED);
    server.settled_history("acme", &acme, "bot", "k").await;

    // What a run writes counts too: an event that fits, whose run writes as much again.
    tokio::time::sleep(Duration::from_millis(600)).await;
    let (_, shown) = super::send(
        server.client.get(server.url("/v1/tenants/acme")),
        Some(&acme),
    )
    .await;
    let stored = shown["stored_bytes"].as_u64().expect("stored bytes");
    let size = usize::try_from((quota - stored) * 2 / 3).expect("fits");
    let script = json!({ "memory_set": { "big": "y".repeat(size) } });
    let (status, body) = server
        .submit("acme", &acme, "bot", "e3", "grows", script)
        .await;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    let error = failure(&server, "acme", &acme, "grows").await;
    assert!(error.contains("stored-bytes"), "{error}");
}

/// Bytes of the files under `dir`.
fn size(dir: &std::path::Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .flatten()
                .map(|entry| match entry.metadata() {
                    Ok(m) if m.is_dir() => size(&entry.path()),
                    Ok(m) => m.len(),
                    Err(_) => 0,
                })
                .sum()
        })
        .unwrap_or_default()
}

/// What finished inputs recorded leaves the state log, so that it does not count against
/// `stored-bytes` for ever; what the key needs (its memory) is still there after.
#[tokio::test]
async fn the_state_log_sheds_what_finished_inputs_recorded() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = Server::start(dir.path(), "").await;
    let acme = server.tenant("acme").await;
    server.deploy("acme", &acme, "bot", "caller", "").await;
    let big = "x".repeat(100_000);
    let events = 40;
    for i in 0..events {
        let script = json!({ "memory_set": { "note": format!("{i}{big}") }, "output": false });
        let (status, _) = server
            .submit("acme", &acme, "bot", &format!("e{i}"), "k", script)
            .await;
        assert_eq!(status, StatusCode::ACCEPTED);
    }
    server.settled_history("acme", &acme, "bot", "k").await;
    // The next input to finish a second later compacts.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let (status, _) = server
        .submit(
            "acme",
            &acme,
            "bot",
            "last",
            "k",
            json!({ "memory_get": ["note"] }),
        )
        .await;
    assert_eq!(status, StatusCode::ACCEPTED);
    let outputs = server.wait_outputs("acme", &acme, 1).await;
    let note = outputs[0]["payload"]["memory"]["note"]
        .as_str()
        .unwrap_or_default();
    assert!(
        note.starts_with(&format!("{}x", events - 1)),
        "the last write is kept"
    );

    let written = events * big.len() as u64;
    let state = size(&dir.path().join("tenants/acme/state"));
    assert!(
        state < written / 2,
        "{state} bytes in the state log after {written} bytes of states"
    );
}
