//! examples/approval end to end, against the mock service: a refund drafted by the chat
//! model waits for a person's `approve` or `reject`, sent with `rewind signal` (under
//! `rewind run`) or the API (under `rewind serve`); each function is called once.

use std::path::Path;
use std::process::Output;
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::{Value, json};

use super::{rewind, text, write};
use crate::serve::{Server, send, statuses};
use crate::support::{guests_dir, workspace_root};

fn example() -> std::path::PathBuf {
    workspace_root().join("examples").join("approval")
}

/// The example's agent.toml, pointed at `mock` and at the built component.
fn agent_toml(mock: &rewind_mock::MockHandle) -> String {
    std::fs::read_to_string(example().join("agent.toml"))
        .expect("the example's agent.toml")
        .replace("http://127.0.0.1:7181", &mock.base_url())
        .replace(
            "../../target/guests/wasm32-wasip2/release",
            &guests_dir().display().to_string(),
        )
}

/// The example's inputs, and R-3, whose approver has 100 ms.
fn inputs() -> String {
    let mut lines = std::fs::read_to_string(example().join("inputs.jsonl")).expect("inputs");
    let hurried = json!({ "key": "R-3", "payload": {
        "request_id": "R-3", "order_id": "C9", "amount_cents": 100,
        "reason": "Wrong colour.", "approval_timeout_ms": 100,
    }});
    lines.push_str(&format!("{hurried}\n"));
    lines
}

async fn rewind_in(dir: &Path, args: &[&str]) -> Output {
    let mut command = rewind(dir);
    command.args(args);
    tokio::task::spawn_blocking(move || command.output().expect("rewind runs"))
        .await
        .expect("join")
}

/// The outputs' payloads, by request id.
fn by_request(payloads: impl Iterator<Item = Value>) -> std::collections::BTreeMap<String, Value> {
    payloads
        .map(|p| (p["request_id"].as_str().expect("request_id").to_owned(), p))
        .collect()
}

/// What each request came to, and that each function was called once per request.
fn assert_decided(
    outputs: &std::collections::BTreeMap<String, Value>,
    mock: &rewind_mock::MockHandle,
) {
    assert_eq!(outputs.len(), 3, "{outputs:#?}");
    let refunded = &outputs["R-1"];
    assert_eq!(
        (&refunded["status"], &refunded["by"]),
        (&json!("refunded"), &json!("ana"))
    );
    assert_eq!(
        refunded["payment"]["echo"]["amount_cents"], 2500,
        "{refunded}"
    );
    assert!(
        refunded["draft"].as_str().is_some_and(|d| !d.is_empty()),
        "{refunded}"
    );
    assert_eq!(outputs["R-2"]["status"], "rejected");
    assert_eq!(outputs["R-3"]["status"], "expired");
    let counts = mock.counts();
    assert_eq!(
        (
            counts.for_route("/v1/chat/completions"),
            counts.for_route("/tools/payments.refund"),
            counts.for_route("/tools/notify.customer"),
        ),
        (3, 1, 2),
        "one draft per request, one payment, two notices: {counts:?}"
    );
    assert!(counts.repeated_keys.is_empty(), "{counts:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_approval_example_waits_for_a_person_under_rewind_run() {
    let mock = rewind_mock::MockService::start("127.0.0.1:0".parse().expect("addr"))
        .await
        .expect("mock");
    let dir = tempfile::tempdir().expect("tempdir");
    write(dir.path(), "agent.toml", &agent_toml(&mock));
    write(dir.path(), "inputs.jsonl", &inputs());
    let run = [
        "run",
        "agent.toml",
        "--input",
        "inputs.jsonl",
        "--output",
        "out.jsonl",
    ];

    let first = rewind_in(dir.path(), &run).await;
    let said = text(&first.stderr);
    assert_eq!(first.status.code(), Some(3), "{said}");
    assert!(
        said.contains(
            "at a wait: R-1 #1: action `refund` waits for signal approve or reject until"
        ),
        "{said}"
    );
    for (key, name, payload) in [
        ("R-1", "approve", r#"{"by":"ana"}"#),
        (
            "R-2",
            "reject",
            r#"{"by":"ana","why":"Sofas come back within 30 days."}"#,
        ),
    ] {
        let sent = rewind_in(
            dir.path(),
            &["signal", "--key", key, "--name", name, "--payload", payload],
        )
        .await;
        assert!(sent.status.success(), "{}", text(&sent.stderr));
    }
    // R-3's 100 ms are over by now, or soon: --wait sees it expire.
    let second = rewind_in(dir.path(), &[&run[..], &["--wait"]].concat()).await;
    assert!(second.status.success(), "{}", text(&second.stderr));
    let written = std::fs::read_to_string(dir.path().join("out.jsonl")).expect("outputs");
    let outputs = by_request(written.lines().map(|line| {
        let output: Value = serde_json::from_str(line).expect("an output line");
        output["payload"].clone()
    }));
    assert_decided(&outputs, &mock);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_approval_example_waits_for_a_person_under_rewind_serve() {
    let mock = rewind_mock::MockService::start("127.0.0.1:0".parse().expect("addr"))
        .await
        .expect("mock");
    let at = mock.base_url().trim_start_matches("http://").to_owned();
    let dir = tempfile::tempdir().expect("tempdir");
    let server = Server::start(
        dir.path(),
        &format!("[tenants.acme]\nallow-hosts = [\"{at}\"]\n"),
    )
    .await;
    let token = server.tenant("acme").await;
    let wasm = std::fs::read(guests_dir().join("approval_refund.wasm")).expect("built");
    let upload = server
        .client
        .put(server.url("/v1/tenants/acme/components/refund"))
        .body(wasm);
    let (status, body) = send(upload, Some(&token)).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    let toml = agent_toml(&mock).replace(
        &format!("{}/approval_refund.wasm", guests_dir().display()),
        "refund",
    );
    let (status, body) = server.define("acme", &token, &toml).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    for (i, line) in inputs().lines().enumerate() {
        let line: Value = serde_json::from_str(line).expect("an input line");
        let key = line["key"].as_str().expect("key");
        let (status, body) = server
            .submit(
                "acme",
                &token,
                "approval",
                &format!("e{i}"),
                key,
                line["payload"].clone(),
            )
            .await;
        assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    }
    // The approver looks at what waits, then answers.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (_, history) = server.history("acme", &token, "approval", "R-1").await;
        if statuses(&history) == ["waiting"] {
            assert_eq!(
                history["inputs"][0]["wait"]["signals"],
                json!(["approve", "reject"])
            );
            break;
        }
        assert!(Instant::now() < deadline, "R-1 never waited: {history}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for (key, name, payload) in [
        ("R-1", "approve", json!({ "by": "ana" })),
        (
            "R-2",
            "reject",
            json!({ "by": "ana", "why": "Sofas come back within 30 days." }),
        ),
    ] {
        let url = server.url(&format!(
            "/v1/tenants/acme/agents/approval/keys/{key}/signals/{name}"
        ));
        let body = json!({ "payload": payload, "id": format!("{key}-decision") });
        let (status, body) = send(server.client.post(url).json(&body), Some(&token)).await;
        assert_eq!(status, StatusCode::OK, "{body}");
    }
    let outputs = server.wait_outputs("acme", &token, 3).await;
    assert_decided(
        &by_request(outputs.iter().map(|o| o["payload"].clone())),
        &mock,
    );
    server.stop().await;
}
