//! Durable waits under `rewind serve`: a waiting input holds nothing and blocks only its
//! key; signals come through the API; across a restart a wait is armed again.

use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::{Value, json};

use super::{Server, send, statuses};

const AGENT_EXTRA: &str =
    "signals = [\"approve\", \"reject\"]\n[functions.clock]\nkind = \"time\"\n";

/// A server over `dir` with tenant `acme` and its agent `bot` (the caller guest, which may
/// wait for `approve` or `reject`); the tenant's token.
async fn started(dir: &std::path::Path) -> (Server, String) {
    let server = Server::start(dir, "").await;
    let token = server.tenant("acme").await;
    server
        .deploy("acme", &token, "bot", "caller", AGENT_EXTRA)
        .await;
    (server, token)
}

/// POSTs a signal `name` to `path` (under the agent's keys), with `body` when given.
async fn signal(
    server: &Server,
    token: &str,
    path: &str,
    name: &str,
    body: Option<Value>,
) -> (StatusCode, Value) {
    let url = server.url(&format!(
        "/v1/tenants/acme/agents/bot/keys/{path}/signals/{name}"
    ));
    let request = server.client.post(url);
    let request = match body {
        Some(body) => request.json(&body),
        None => request,
    };
    send(request, Some(token)).await
}

/// The statuses of `key`'s inputs, once its first is `waiting` (60 s at most).
async fn until_waiting(server: &Server, token: &str, key: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (status, history) = server.history("acme", token, "bot", key).await;
        assert_eq!(status, StatusCode::OK, "{history}");
        if statuses(&history).first().map(String::as_str) == Some("waiting") {
            return history;
        }
        assert!(Instant::now() < deadline, "never waiting: {history}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn payload_of<'a>(outputs: &'a [Value], key: &str, sequence: u64) -> &'a Value {
    outputs
        .iter()
        .map(|output| &output["payload"])
        .find(|payload| payload["key"] == key && payload["sequence"] == sequence)
        .unwrap_or_else(|| panic!("no output of {key} #{sequence}: {outputs:#?}"))
}

#[tokio::test]
async fn signals_through_the_api_end_a_wait_once_and_are_refused_for_finished_inputs() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (server, token) = started(dir.path()).await;
    let waits = json!({ "calls": [
        { "await": ["approve", "reject"] },
        { "await": ["approve"], "timeout_ms": 200 },
    ]});
    // The signal comes while the input sleeps, before it reaches its wait.
    let early = json!({ "calls": [{ "sleep_ms": 300 }, { "await": ["approve"] }] });
    for (id, key, payload) in [
        ("e1", "k", waits),
        ("e2", "k", json!({})),
        ("e3", "early", early),
        ("e4", "other", json!({})),
    ] {
        let (status, body) = server.submit("acme", &token, "bot", id, key, payload).await;
        assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    }
    let (status, body) = signal(&server, &token, "early", "approve", None).await;
    assert_eq!(
        (status, &body["sequence"]),
        (StatusCode::OK, &json!(1)),
        "{body}"
    );

    let history = until_waiting(&server, &token, "k").await;
    assert_eq!(statuses(&history), ["waiting", "accepted"], "{history}");
    assert_eq!(
        history["inputs"][0]["wait"],
        json!({ "action": "work", "signals": ["approve", "reject"] })
    );
    // (`early` may still be listed too, sleeping, on a loaded machine.)
    let listed = server.inputs("acme", &token, "bot", "waiting").await;
    let k = listed["inputs"]
        .as_array()
        .and_then(|inputs| inputs.iter().find(|input| input["key"] == "k"));
    let k = k.unwrap_or_else(|| panic!("k is not listed waiting: {listed}"));
    assert_eq!(
        (&k["sequence"], &k["waiting"]),
        (&json!(1), &json!(1)),
        "{listed}"
    );

    let (status, body) = signal(&server, &token, "k", "nope", None).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{body}");
    assert_eq!(body["code"], "undeclared-signal", "{body}");
    assert!(
        body["error"]
            .as_str()
            .is_some_and(|e| e.contains("declares signal `nope`")),
        "{body}"
    );
    let (status, body) = signal(
        &server,
        &token,
        "k",
        "approve",
        Some(json!({ "payload": "{" })),
    )
    .await;
    assert_eq!(
        (status, &body["code"]),
        (StatusCode::OK, &json!(null)),
        "a JSON string is a payload: {body}"
    );
    // That one was delivered (the string "{"); the next two share an id: one signal.
    let approval = json!({ "payload": { "by": "ana" }, "id": "approval-1" });
    let (status, first) = signal(
        &server,
        &token,
        "k/inputs/1",
        "reject",
        Some(approval.clone()),
    )
    .await;
    assert_eq!(
        (status, &first["repeat"]),
        (StatusCode::OK, &json!(false)),
        "{first}"
    );
    let (status, again) = signal(&server, &token, "k/inputs/1", "reject", Some(approval)).await;
    assert_eq!(
        (status, &again["repeat"]),
        (StatusCode::OK, &json!(true)),
        "{again}"
    );

    let outputs = server.wait_outputs("acme", &token, 4).await;
    assert_eq!(outputs.len(), 4, "{outputs:#?}");
    assert_eq!(
        payload_of(&outputs, "k", 1)["results"],
        json!([
            { "signal": { "name": "approve", "payload": "{" } },
            { "timed_out": true },
        ]),
        "the first wait took the oldest signal, and the reject went to no other wait"
    );
    assert_eq!(
        payload_of(&outputs, "early", 1)["results"],
        json!([{ "slept": true }, { "signal": { "name": "approve", "payload": null } }])
    );

    let (status, body) = signal(&server, &token, "k/inputs/1", "approve", None).await;
    assert_eq!(
        (status, &body["code"]),
        (StatusCode::CONFLICT, &json!("input-finished")),
        "{body}"
    );
    let (status, body) = signal(&server, &token, "k", "approve", None).await;
    assert_eq!(
        (status, &body["code"]),
        (StatusCode::CONFLICT, &json!("no-unfinished-input")),
        "{body}"
    );
    // Sent again to the key after its input finished: known by its id, not a new signal.
    let approval = json!({ "payload": { "by": "ana" }, "id": "approval-1" });
    let (status, again) = signal(&server, &token, "k", "reject", Some(approval)).await;
    assert_eq!(
        (status, &again["repeat"], &again["sequence"]),
        (StatusCode::OK, &json!(true), &json!(1)),
        "{again}"
    );
    let (status, body) = signal(&server, &token, "k/inputs/9", "approve", None).await;
    assert_eq!(
        (status, &body["code"]),
        (StatusCode::NOT_FOUND, &json!("no-such-input")),
        "{body}"
    );
    let big = json!({ "payload": "x".repeat(70 * 1024) });
    let (status, body) = signal(&server, &token, "other", "approve", Some(big)).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{body}");
    server.stop().await;
}

#[tokio::test]
async fn a_wait_outlives_a_restart_and_ends_once_after_its_time() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (server, token) = started(dir.path()).await;
    let sleeper = json!({ "calls": [
        { "function": "clock" }, { "sleep_ms": 1500 }, { "function": "clock" },
    ]});
    let (status, body) = server
        .submit("acme", &token, "bot", "e1", "k", sleeper)
        .await;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    let history = until_waiting(&server, &token, "k").await;
    let until = history["inputs"][0]["wait"]["until"]
        .as_u64()
        .expect("its time");
    server.stop().await;

    let server = Server::start(dir.path(), "").await;
    let outputs = server.wait_outputs("acme", &token, 1).await;
    assert_eq!(outputs.len(), 1, "it ended once: {outputs:#?}");
    let results = &payload_of(&outputs, "k", 1)["results"];
    let before = results[0]["ok"]["unix_ms"]
        .as_u64()
        .expect("a clock reading");
    let after = results[2]["ok"]["unix_ms"]
        .as_u64()
        .expect("a clock reading");
    assert!(
        after >= until,
        "it went on at {after}, before its time {until}"
    );
    assert!(until >= before + 1500, "{before} + 1500 > {until}");
    let (_, history) = server.history("acme", &token, "bot", "k").await;
    assert_eq!(statuses(&history), ["done"], "{history}");
    server.stop().await;
}

/// Signals count against the tenant's `signals-per-minute`: past it a signal is refused
/// (429, naming the quota) and not delivered.
#[tokio::test]
async fn signals_past_the_tenants_quota_are_refused_naming_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = "[tenants.acme.quotas]\nsignals-per-minute = 2\n";
    let server = Server::start(dir.path(), config).await;
    let token = server.tenant("acme").await;
    server
        .deploy("acme", &token, "bot", "caller", AGENT_EXTRA)
        .await;
    let waits = json!({ "calls": [{ "await": ["reject"] }, { "await": ["reject"] }] });
    let (status, body) = server.submit("acme", &token, "bot", "e1", "k", waits).await;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    until_waiting(&server, &token, "k").await;
    for id in ["s1", "s2"] {
        let (status, body) =
            signal(&server, &token, "k", "approve", Some(json!({ "id": id }))).await;
        assert_eq!(status, StatusCode::OK, "{body}");
    }
    let (status, body) = signal(&server, &token, "k", "reject", Some(json!({ "id": "s3" }))).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{body}");
    assert!(
        body.to_string().contains("signals-per-minute"),
        "names the quota: {body}"
    );
    let (_, history) = server.history("acme", &token, "bot", "k").await;
    assert_eq!(
        statuses(&history).first().map(String::as_str),
        Some("waiting"),
        "the refused reject was not delivered: {history}"
    );
}
