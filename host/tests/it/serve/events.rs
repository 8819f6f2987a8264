//! Events in (once per event id), outputs out (listed and streamed), and a key's history.

use std::time::Duration;

use reqwest::StatusCode;
use serde_json::json;

use super::{Server, send};

#[tokio::test]
async fn a_retried_submission_is_accepted_once_and_an_id_names_one_event() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = Server::start(dir.path(), "").await;
    let acme = server.tenant("acme").await;
    server.deploy("acme", &acme, "bot", "caller", "").await;

    let script = json!({ "memory_set": { "count": 1 } });
    let (status, first) = server
        .submit("acme", &acme, "bot", "e1", "k", script.clone())
        .await;
    assert_eq!(status, StatusCode::ACCEPTED, "{first}");
    assert_eq!(
        (first["sequence"].clone(), first["duplicate"].clone()),
        (json!(1), json!(false))
    );
    // The same event again (a client's retry): the first answer, nothing new.
    let (status, again) = server.submit("acme", &acme, "bot", "e1", "k", script).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        (again["sequence"].clone(), again["duplicate"].clone()),
        (json!(1), json!(true))
    );
    // The same id for another event is a client bug, said as such.
    let (status, reused) = server
        .submit("acme", &acme, "bot", "e1", "k", json!({ "output": false }))
        .await;
    assert_eq!(
        (status, reused["code"].as_str()),
        (StatusCode::CONFLICT, Some("event-id-reused")),
        "{reused}"
    );
    let (status, _) = server
        .submit(
            "acme",
            &acme,
            "bot",
            "e2",
            "k",
            json!({ "memory_get": ["count"] }),
        )
        .await;
    assert_eq!(status, StatusCode::ACCEPTED);

    let outputs = server.wait_outputs("acme", &acme, 2).await;
    assert_eq!(outputs.len(), 2, "e1 once, e2 once: {outputs:?}");
    assert_eq!(
        outputs
            .iter()
            .map(|o| o["position"].clone())
            .collect::<Vec<_>>(),
        [json!(1), json!(2)]
    );
    assert_eq!(outputs[1]["event_id"], "e2");
    assert_eq!(outputs[1]["sequence"], 2);
    assert_eq!(outputs[1]["payload"]["memory"], json!({ "count": 1 }));
    // Reading after a position.
    let after = server.outputs("acme", &acme, 1).await;
    assert_eq!(after.len(), 1);
    assert_eq!(after[0]["event_id"], "e2");
}

#[tokio::test]
async fn a_failed_input_is_in_the_history_with_its_error_and_the_key_goes_on() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = Server::start(dir.path(), "").await;
    let acme = server.tenant("acme").await;
    server
        .deploy(
            "acme",
            &acme,
            "bot",
            "caller",
            "[functions.clock]\nkind = \"time\"\n",
        )
        .await;
    for (id, script) in [
        (
            "e1",
            json!({ "calls": [{ "function": "clock" }], "memory_set": { "count": 1 } }),
        ),
        (
            "e2",
            json!({ "memory_set": { "count": 99 }, "fail": "boom" }),
        ),
        (
            "e3",
            json!({ "calls": [{ "function": "undeclared" }], "memory_get": ["count"] }),
        ),
    ] {
        let (status, body) = server.submit("acme", &acme, "bot", id, "k", script).await;
        assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    }
    let history = server.settled_history("acme", &acme, "bot", "k").await;
    let inputs = history["inputs"].as_array().expect("inputs");
    assert_eq!(inputs.len(), 3, "{history}");
    assert_eq!(inputs[0]["status"], "completed");
    assert_eq!(inputs[0]["actions"][0]["action"], "work");
    assert_eq!(inputs[0]["actions"][0]["completed"], true);
    assert_eq!(
        inputs[0]["actions"][0]["calls"],
        json!([{ "index": 0, "function": "clock", "status": "succeeded" }])
    );
    assert_eq!(inputs[1]["status"], "failed");
    assert!(
        inputs[1]["error"]
            .as_str()
            .is_some_and(|e| e.contains("boom")),
        "{}",
        inputs[1]
    );
    assert_eq!(inputs[2]["status"], "completed");
    assert_eq!(inputs[2]["event_id"], "e3");

    let outputs = server.wait_outputs("acme", &acme, 2).await;
    assert_eq!(
        outputs.len(),
        2,
        "the failed input has no output: {outputs:?}"
    );
    let last = &outputs[1]["payload"];
    // The failed input left the key's memory as it was, and an undeclared function is
    // refused to the guest and not recorded.
    assert_eq!(last["memory"], json!({ "count": 1 }));
    assert!(
        last["results"][0]["error"]["unknown-function"].is_string(),
        "{last}"
    );
    assert_eq!(inputs[2]["actions"][0]["calls"], json!([]));

    for (path, what) in [
        ("/v1/tenants/acme/agents/bot/keys/nokey/history", "nokey"),
        ("/v1/tenants/acme/agents/nobot/keys/k/history", "nobot"),
    ] {
        let (status, body) = send(server.client.get(server.url(path)), Some(&acme)).await;
        assert_eq!(status, StatusCode::NOT_FOUND);
        assert!(
            body["error"].as_str().is_some_and(|e| e.contains(what)),
            "{body}"
        );
    }
    let (status, body) = server
        .submit("acme", &acme, "nobot", "e9", "k", json!(null))
        .await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{body}");
    for bad in [
        json!({ "id": "x", "key": "k" }),
        json!({ "id": "", "key": "k", "payload": 1 }),
        json!([]),
    ] {
        let (status, body) = send(
            server
                .client
                .post(server.url("/v1/tenants/acme/agents/bot/events"))
                .json(&bad),
            Some(&acme),
        )
        .await;
        assert_eq!(
            (status, body["code"].as_str()),
            (StatusCode::BAD_REQUEST, Some("bad-request")),
            "{bad}: {body}"
        );
    }
}

/// Reads server-sent events from `response` until `n` outputs came; their ids and data.
async fn read_events(response: &mut reqwest::Response, n: usize) -> Vec<(u64, serde_json::Value)> {
    let mut buffer = String::new();
    let mut events = Vec::new();
    while events.len() < n {
        let chunk = tokio::time::timeout(Duration::from_secs(30), response.chunk())
            .await
            .expect("an event within 30 s")
            .expect("the stream reads")
            .expect("the stream stays open");
        buffer.push_str(&String::from_utf8_lossy(&chunk));
        while let Some(end) = buffer.find("\n\n") {
            let block: String = buffer.drain(..end + 2).collect();
            let (mut id, mut data, mut kind) = (None, None, None);
            for line in block.lines() {
                if let Some(v) = line.strip_prefix("id:") {
                    id = v.trim().parse::<u64>().ok();
                } else if let Some(v) = line.strip_prefix("data:") {
                    data = serde_json::from_str(v.trim()).ok();
                } else if let Some(v) = line.strip_prefix("event:") {
                    kind = Some(v.trim().to_owned());
                }
            }
            if let (Some(id), Some(data), Some("output")) = (id, data, kind.as_deref()) {
                events.push((id, data));
            }
        }
    }
    events
}

#[tokio::test]
async fn outputs_stream_as_server_sent_events_and_a_reconnect_resumes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = Server::start(dir.path(), "").await;
    let acme = server.tenant("acme").await;
    server.deploy("acme", &acme, "bot", "caller", "").await;

    let mut stream = server
        .client
        .get(server.url("/v1/tenants/acme/outputs/stream"))
        .bearer_auth(&acme)
        .send()
        .await
        .expect("the stream opens");
    assert_eq!(stream.status(), StatusCode::OK);
    assert!(
        stream.headers()["content-type"]
            .to_str()
            .is_ok_and(|t| t.starts_with("text/event-stream"))
    );
    for (id, key) in [("e1", "a"), ("e2", "b")] {
        let (status, _) = server
            .submit("acme", &acme, "bot", id, key, json!(null))
            .await;
        assert_eq!(status, StatusCode::ACCEPTED);
    }
    let mut seen = read_events(&mut stream, 2).await;
    seen.sort_by_key(|(id, _)| *id);
    assert_eq!(seen.iter().map(|(id, _)| *id).collect::<Vec<_>>(), [1, 2]);
    assert_eq!(seen[0].1["position"], 1);
    drop(stream);

    // A client that reconnects says what it saw last, and gets only what came after.
    let (status, _) = server
        .submit("acme", &acme, "bot", "e3", "c", json!(null))
        .await;
    assert_eq!(status, StatusCode::ACCEPTED);
    let mut resumed = server
        .client
        .get(server.url("/v1/tenants/acme/outputs/stream"))
        .header("last-event-id", "2")
        .bearer_auth(&acme)
        .send()
        .await
        .expect("the stream opens");
    let next = read_events(&mut resumed, 1).await;
    assert_eq!(next[0].0, 3);
    assert_eq!(next[0].1["event_id"], "e3");
}

#[tokio::test]
async fn a_keys_history_comes_a_page_at_a_time() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = Server::start(dir.path(), "").await;
    let acme = server.tenant("acme").await;
    server.deploy("acme", &acme, "bot", "caller", "").await;
    for i in 1..=5 {
        let (status, body) = server
            .submit("acme", &acme, "bot", &format!("e{i}"), "k", json!({}))
            .await;
        assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    }
    server.settled_history("acme", &acme, "bot", "k").await;
    let page = |query: &'static str| {
        let url = server.url(&format!(
            "/v1/tenants/acme/agents/bot/keys/k/history?{query}"
        ));
        let request = server.client.get(url);
        let token = acme.clone();
        async move {
            let (status, body) = send(request, Some(&token)).await;
            assert_eq!(status, StatusCode::OK, "{body}");
            let sequences: Vec<u64> = body["inputs"]
                .as_array()
                .expect("inputs")
                .iter()
                .filter_map(|i| i["sequence"].as_u64())
                .collect();
            (sequences, body["next"].as_u64())
        }
    };
    assert_eq!(page("limit=2").await, (vec![1, 2], Some(2)));
    assert_eq!(page("after=2&limit=2").await, (vec![3, 4], Some(4)));
    assert_eq!(page("after=4&limit=2").await, (vec![5], None));
    assert_eq!(page("").await, (vec![1, 2, 3, 4, 5], None));
}

#[tokio::test]
async fn a_body_past_its_routes_limit_is_refused_naming_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = Server::start(dir.path(), "").await;
    let acme = server.tenant("acme").await;
    server.deploy("acme", &acme, "bot", "caller", "").await;
    let big = |bytes: usize| "x".repeat(bytes);
    for (request, token, named) in [
        (
            server
                .client
                .post(server.url("/v1/tenants"))
                .json(&json!({ "name": big(5 << 10) })),
            super::ADMIN,
            "a new tenant may be at most 4096 bytes",
        ),
        (
            server
                .client
                .post(server.url("/v1/tenants/acme/agents"))
                .body(format!("# {}", big(300 << 10))),
            acme.as_str(),
            "an agent.toml may be at most 262144 bytes",
        ),
        (
            server
                .client
                .post(server.url("/v1/tenants/acme/agents/bot/events"))
                .json(&json!({ "id": "e", "key": "k", "payload": big(3 << 20) })),
            acme.as_str(),
            "an event may be at most 2097152 bytes",
        ),
    ] {
        let (status, body) = send(request, Some(token)).await;
        assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{body}");
        assert_eq!(body["code"], "too-large", "{body}");
        assert!(
            body["error"].as_str().is_some_and(|e| e.contains(named)),
            "{body}"
        );
    }
}
