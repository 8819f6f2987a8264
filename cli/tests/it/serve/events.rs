//! Events in (once per event id), outputs out (listed and streamed), and a key's history.

use std::time::{Duration, Instant};

use eventsource_stream::Eventsource;
use futures_util::StreamExt;
use reqwest::StatusCode;
use serde_json::{Value, json};

use super::{Server, send, statuses};

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
async fn a_failed_input_is_retried_then_parked_listed_and_once_skipped_the_key_goes_on() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = Server::start(dir.path(), "").await;
    let acme = server.tenant("acme").await;
    let retry = "[retry]\nattempts = 2\ninitial-ms = 1\nmax-ms = 2\n";
    server
        .deploy(
            "acme",
            &acme,
            "bot",
            "caller",
            &format!("[functions.clock]\nkind = \"time\"\n{retry}"),
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
    assert_eq!(
        statuses(&history),
        ["done", "parked", "accepted"],
        "{history}"
    );
    assert_eq!(inputs[0]["actions"][0]["action"], "work");
    assert_eq!(inputs[0]["actions"][0]["completed"], true);
    assert_eq!(
        inputs[0]["actions"][0]["calls"],
        json!([{ "index": 0, "function": "clock", "status": "succeeded" }])
    );
    assert_eq!(inputs[1]["attempts"], 2, "{history}");
    assert!(
        inputs[1]["error"]
            .as_str()
            .is_some_and(|e| e.contains("boom")),
        "{}",
        inputs[1]
    );

    // Listed across keys, with the inputs waiting behind it.
    let parked = server.inputs("acme", &acme, "bot", "parked").await;
    let listed = &parked["inputs"];
    assert_eq!(listed.as_array().map(Vec::len), Some(1), "{parked}");
    assert_eq!(
        (
            &listed[0]["key"],
            &listed[0]["sequence"],
            &listed[0]["event_id"],
            &listed[0]["waiting"]
        ),
        (&json!("k"), &json!(2), &json!("e2"), &json!(1)),
        "{parked}"
    );

    // Only the parked input can be skipped or retried, and a skip says why.
    let (status, body) = server.skip("acme", &acme, "bot", "k", 3, "why not").await;
    assert_eq!(
        (status, body["code"].as_str()),
        (StatusCode::CONFLICT, Some("not-parked")),
        "{body}"
    );
    let (status, body) = server.retry("acme", &acme, "bot", "k", 3, None).await;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    let (status, body) = server.skip("acme", &acme, "bot", "k", 2, " ").await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    let (status, body) = server
        .skip(
            "acme",
            &acme,
            "bot",
            "k",
            2,
            "the model will not answer this",
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    // The skip names the token that asked for it, by its id.
    let (_, tokens) = send(
        server.client.get(server.url("/v1/tenants/acme/tokens")),
        Some(&acme),
    )
    .await;
    let by = format!("tenant token {}", tokens[0]["id"].as_str().expect("an id"));
    assert_eq!(
        (&body["sequence"], &body["by"]),
        (&json!(2), &json!(by)),
        "{body}"
    );
    let (status, body) = server.skip("acme", &acme, "bot", "k", 2, "again").await;
    assert_eq!(status, StatusCode::CONFLICT, "skipped once: {body}");

    let history = server.settled_history("acme", &acme, "bot", "k").await;
    let inputs = history["inputs"].as_array().expect("inputs");
    assert_eq!(statuses(&history), ["done", "skipped", "done"], "{history}");
    assert_eq!(
        (&inputs[1]["by"], &inputs[1]["reason"]),
        (&json!(by), &json!("the model will not answer this")),
        "{history}"
    );
    assert_eq!(inputs[2]["event_id"], "e3");

    let outputs = server.wait_outputs("acme", &acme, 2).await;
    assert_eq!(
        outputs.len(),
        2,
        "the skipped input has no output: {outputs:?}"
    );
    let last = &outputs[1]["payload"];
    // The skipped input left the key's memory as it was, and an undeclared function is
    // refused to the guest and not recorded.
    assert_eq!(last["memory"], json!({ "count": 1 }));
    assert!(
        last["results"][0]["error"]["unknown-function"].is_string(),
        "{last}"
    );
    assert_eq!(inputs[2]["actions"][0]["calls"], json!([]));
    let parked = server.inputs("acme", &acme, "bot", "parked").await;
    assert_eq!(parked["inputs"], json!([]), "{parked}");

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
/// Opens the tenant acme's output stream.
async fn follow(server: &Server, token: &str) -> reqwest::Response {
    let url = server.url("/v1/tenants/acme/outputs/stream");
    let stream = server.client.get(url).bearer_auth(token).send().await;
    stream.expect("the stream opens")
}

async fn read_events(response: reqwest::Response, n: usize) -> Vec<(u64, Value)> {
    let mut stream = response.bytes_stream().eventsource();
    let mut events = Vec::new();
    while events.len() < n {
        let event = tokio::time::timeout(Duration::from_secs(30), stream.next())
            .await
            .expect("an event within 30 s")
            .expect("the stream stays open")
            .expect("the stream reads");
        if event.event == "output" {
            let id = event.id.parse().expect("an output's id is its position");
            events.push((id, serde_json::from_str(&event.data).expect("JSON")));
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

    let stream = follow(&server, &acme).await;
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
    let mut seen = read_events(stream, 2).await;
    seen.sort_by_key(|(id, _)| *id);
    assert_eq!(seen.iter().map(|(id, _)| *id).collect::<Vec<_>>(), [1, 2]);
    assert_eq!(seen[0].1["position"], 1);

    // A client that reconnects says what it saw last, and gets only what came after.
    let (status, _) = server
        .submit("acme", &acme, "bot", "e3", "c", json!(null))
        .await;
    assert_eq!(status, StatusCode::ACCEPTED);
    let resumed = server
        .client
        .get(server.url("/v1/tenants/acme/outputs/stream"))
        .header("last-event-id", "2")
        .bearer_auth(&acme)
        .send()
        .await
        .expect("the stream opens");
    let next = read_events(resumed, 1).await;
    assert_eq!(next[0].0, 3);
    assert_eq!(next[0].1["event_id"], "e3");
}

/// The pieces of a streamed model answer reach the output stream as `delta` events while
/// the call reads them, before the input's output, and joined they are what was recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_answers_pieces_reach_the_output_stream_before_the_output() {
    let mock = rewind_mock::MockService::start("127.0.0.1:0".parse().expect("addr"))
        .await
        .expect("the mock starts");
    let at = mock.base_url().trim_start_matches("http://").to_owned();
    let dir = tempfile::tempdir().expect("tempdir");
    let config = format!("[tenants.acme]\nallow-hosts = [\"{at}\"]\n");
    let server = Server::start(dir.path(), &config).await;
    let acme = server.tenant("acme").await;
    let chat = format!(
        "[functions.chat]\nkind = \"openai-chat\"\nbase-url = \"{}/v1\"\nmodel = \"m\"\n\
         headers = {{ \"{}\" = \"20\" }}\n",
        mock.base_url(),
        rewind_mock::CHUNK_DELAY_HEADER
    );
    server.deploy("acme", &acme, "bot", "caller", &chat).await;
    let stream = follow(&server, &acme).await;
    let messages = json!([{ "role": "user", "content": "Where is my order A1234?" }]);
    let payload = json!({ "calls": [{ "function": "chat", "args": { "messages": messages } }] });
    let (status, body) = server
        .submit("acme", &acme, "bot", "e1", "k", payload)
        .await;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    let mut events = stream.bytes_stream().eventsource();
    let mut pieces = String::new();
    let output = loop {
        let event = tokio::time::timeout(Duration::from_secs(30), events.next())
            .await
            .expect("an event within 30 s")
            .expect("the stream stays open")
            .expect("the stream reads");
        let data: Value = serde_json::from_str(&event.data).expect("JSON");
        match event.event.as_str() {
            "delta" => {
                assert_eq!(
                    (&data["agent"], &data["key"], &data["function"]),
                    (&json!("bot"), &json!("k"), &json!("chat")),
                    "{data}"
                );
                pieces.push_str(data["delta"]["content"].as_str().unwrap_or_default());
            }
            "output" => break data,
            other => panic!("an event of another kind: {other}"),
        }
    };
    assert!(!pieces.is_empty(), "pieces came before the output");
    assert_eq!(
        output["payload"]["results"][0]["ok"]["content"].as_str(),
        Some(pieces.as_str()),
        "{output}"
    );
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

/// The agent `bot` on component `worker`, one attempt per input, with `unhandled-events`.
fn strict_bot(unhandled: &str) -> String {
    format!(
        "name = \"bot\"\nunhandled-events = \"{unhandled}\"\n\n[[actions]]\nname = \"work\"\n\
         component = \"worker\"\non = [\"input\"]\n\n[retry]\nattempts = 1\n"
    )
}

#[tokio::test]
async fn a_parked_input_stays_parked_across_a_restart_and_retried_on_a_newer_version_runs_there() {
    let dir = tempfile::tempdir().expect("tempdir");
    let small = "[tenants.acme.quotas]\nmemory-set-bytes = 64\n";
    let server = Server::start(dir.path(), small).await;
    let acme = server.tenant("acme").await;
    server.upload("acme", &acme, "worker", "caller").await;
    let (status, body) = server.define("acme", &acme, &strict_bot("fail")).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    // Key m writes more memory than the tenant's quota allows; on key k, version 1 fails
    // an input that sends an event no action handles.
    let large = json!({ "memory_set": { "note": "x".repeat(200) } });
    let note = json!({ "send": [{ "kind": "note", "payload": {} }] });
    for (id, key, payload) in [
        ("m1", "m", large),
        ("k1", "k", note),
        ("k2", "k", json!({})),
    ] {
        let (status, body) = server.submit("acme", &acme, "bot", id, key, payload).await;
        assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    }
    let history = server.settled_history("acme", &acme, "bot", "m").await;
    assert_eq!(statuses(&history), ["parked"], "{history}");
    let history = server.settled_history("acme", &acme, "bot", "k").await;
    assert_eq!(statuses(&history), ["parked", "accepted"], "{history}");
    assert!(
        history["inputs"][0]["error"]
            .as_str()
            .is_some_and(|e| e.contains("`note`")),
        "{history}"
    );

    // A restart keeps both parked: neither runs again until an operator says so, though
    // m's would now fit the quota.
    server.stop().await;
    let server = Server::start(dir.path(), "").await;
    let history = server.settled_history("acme", &acme, "bot", "m").await;
    assert_eq!(statuses(&history), ["parked"], "not run again: {history}");
    assert_eq!(history["inputs"][0]["attempts"], 1, "{history}");
    let history = server.settled_history("acme", &acme, "bot", "k").await;
    assert_eq!(statuses(&history), ["parked", "accepted"], "{history}");
    let (status, body) = server.retry("acme", &acme, "bot", "m", 1, None).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let history = server.settled_history("acme", &acme, "bot", "m").await;
    assert_eq!(statuses(&history), ["done"], "{history}");

    // Retried on its own version, k's fails the same way; on a version that drops such
    // events it completes, and the key goes on.
    let (status, body) = server.retry("acme", &acme, "bot", "k", 1, None).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let history = server.settled_history("acme", &acme, "bot", "k").await;
    assert_eq!(statuses(&history), ["parked", "accepted"], "{history}");
    let (status, body) = server.define("acme", &acme, &strict_bot("drop")).await;
    assert_eq!(
        (status, &body["version"]),
        (StatusCode::CREATED, &json!(2)),
        "{body}"
    );
    let (status, body) = server
        .retry("acme", &acme, "bot", "k", 1, Some(json!({ "version": 9 })))
        .await;
    assert_eq!(status, StatusCode::NOT_FOUND, "no version 9: {body}");
    let (status, body) = server
        .retry("acme", &acme, "bot", "k", 1, Some(json!({ "version": 2 })))
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let history = server.settled_history("acme", &acme, "bot", "k").await;
    assert_eq!(statuses(&history), ["done", "done"], "{history}");
    let versions: Vec<&Value> = history["inputs"]
        .as_array()
        .expect("inputs")
        .iter()
        .map(|i| &i["version"])
        .collect();
    assert_eq!(
        versions,
        [&json!(2), &json!(1)],
        "each as it ran: {history}"
    );
    let outputs = server.wait_outputs("acme", &acme, 3).await;
    assert_eq!(outputs.len(), 3, "{outputs:?}");

    // Each retry is in the history, with its version, after a restart too.
    server.stop().await;
    let server = Server::start(dir.path(), "").await;
    let history = server.settled_history("acme", &acme, "bot", "k").await;
    let retries: Vec<(&Value, &Value)> = history["inputs"][0]["commands"]
        .as_array()
        .expect("commands")
        .iter()
        .map(|c| (&c["done"], &c["version"]))
        .collect();
    assert_eq!(
        retries,
        [
            (&json!("retried"), &json!(1)),
            (&json!("retried"), &json!(2))
        ],
        "{history}"
    );
}

#[tokio::test]
async fn a_call_in_doubt_is_answered_by_an_operator_and_served_without_calling_again() {
    let dir = tempfile::tempdir().expect("tempdir");
    // Slower than the function waits: the call times out, in doubt, and the input parks.
    let (addr, endpoint) = super::Endpoint::start(Duration::from_secs(30), "").await;
    let server = Server::start(
        dir.path(),
        &format!("[tenants.acme]\nallow-hosts = [\"{addr}\"]\n"),
    )
    .await;
    let acme = server.tenant("acme").await;
    let slow = format!(
        "[functions.slow]\nkind = \"http\"\nurl = \"http://{addr}/\"\ntimeout-ms = 200\n\
         retries = 0\nin-doubt = \"fail\"\n"
    );
    server.deploy("acme", &acme, "bot", "caller", &slow).await;
    let (status, body) = server
        .submit("acme", &acme, "bot", "e1", "k", super::one_call("slow"))
        .await;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    let history = server.settled_history("acme", &acme, "bot", "k").await;
    assert_eq!(statuses(&history), ["parked"], "{history}");

    let answer = json!({ "result": { "n": 42 } });
    let (status, body) = server
        .resolve("acme", &acme, "bot", "k", 1, 1, answer.clone())
        .await;
    assert_eq!(
        (status, body["code"].as_str()),
        (StatusCode::CONFLICT, Some("not-in-doubt")),
        "{body}"
    );
    assert!(
        body["error"]
            .as_str()
            .is_some_and(|e| e.contains("no call 1 in doubt (in doubt: `work` call 0)")),
        "{body}"
    );
    let two = json!({ "result": 1, "error": "and failed" });
    let (status, body) = server.resolve("acme", &acme, "bot", "k", 1, 0, two).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");

    let (status, body) = server
        .resolve("acme", &acme, "bot", "k", 1, 0, answer)
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let outputs = server.wait_outputs("acme", &acme, 1).await;
    let results = &outputs[0]["payload"]["results"];
    assert_eq!(results[0]["ok"]["n"], 42, "the answer is served: {results}");
    assert_eq!(
        endpoint.count(),
        1,
        "the call was made once, before it was in doubt"
    );
    let history = server.settled_history("acme", &acme, "bot", "k").await;
    assert_eq!(statuses(&history), ["done"], "{history}");
    // Who answered, for which call, and the retry that followed.
    let commands: Vec<_> = history["inputs"][0]["commands"]
        .as_array()
        .expect("commands")
        .iter()
        .map(|c| {
            assert!(
                c["by"]
                    .as_str()
                    .is_some_and(|by| by.starts_with("tenant token ")),
                "{c}"
            );
            (
                c["done"].as_str().unwrap_or_default().to_owned(),
                c["action"].clone(),
                c["call"].clone(),
                c["answer"].clone(),
            )
        })
        .collect();
    assert_eq!(
        commands,
        [
            (
                "resolved".to_owned(),
                json!("work"),
                json!(0),
                json!("result")
            ),
            ("retried".to_owned(), Value::Null, Value::Null, Value::Null),
        ],
        "{history}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn of_commands_sent_at_once_to_one_parked_input_one_is_carried_out() {
    let dir = tempfile::tempdir().expect("tempdir");
    // A port nothing listens on yet: the input's call is refused, and it parks. Once a gated
    // endpoint listens there, a retry's call waits at the gate for the rest of the test:
    // the input stays running, never parked again, so a later command cannot find it
    // parked a second time.
    let at = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port");
    let server = Server::start(
        dir.path(),
        &format!("[tenants.acme]\nallow-hosts = [\"{at}\"]\n"),
    )
    .await;
    let acme = server.tenant("acme").await;
    let gate = format!(
        "[functions.gate]\nkind = \"http\"\nurl = \"http://{at}/\"\ntimeout-ms = 120000\n\
         retries = 0\n"
    );
    server.deploy("acme", &acme, "bot", "caller", &gate).await;
    let (status, body) = server
        .submit("acme", &acme, "bot", "e1", "k", super::one_call("gate"))
        .await;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    let history = server.settled_history("acme", &acme, "bot", "k").await;
    assert_eq!(statuses(&history), ["parked"], "{history}");
    let (_, _endpoint) = super::Endpoint::gated_at(&at.to_string()).await;

    // Skips and retries at once: each records itself in the journal, so two carried out
    // would leave a skip and a retry of one input there.
    let commands = (0..8).map(|n| {
        let server = &server;
        let acme = &acme;
        async move {
            if n % 2 == 0 {
                server.skip("acme", acme, "bot", "k", 1, "at once").await
            } else {
                server.retry("acme", acme, "bot", "k", 1, None).await
            }
        }
    });
    let answers = futures_util::future::join_all(commands).await;
    let codes: Vec<StatusCode> = answers.iter().map(|(code, _)| *code).collect();
    let done = codes.iter().filter(|c| **c == StatusCode::OK).count();
    assert_eq!(done, 1, "{answers:?}");
    assert!(
        answers
            .iter()
            .all(|(code, body)| *code == StatusCode::OK || body["code"] == "not-parked"),
        "{answers:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_input_stops_at_its_next_call_and_its_history_says_who_cancelled_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (addr, endpoint) = super::Endpoint::gated().await;
    let server = Server::start(
        dir.path(),
        &format!("[tenants.acme]\nallow-hosts = [\"{addr}\"]\n"),
    )
    .await;
    let acme = server.tenant("acme").await;
    let gate = format!(
        "[functions.gate]\nkind = \"http\"\nurl = \"http://{addr}/\"\ntimeout-ms = 120000\n\
         retries = 0\n"
    );
    server.deploy("acme", &acme, "bot", "caller", &gate).await;
    let two_calls = json!({ "calls": [
        { "function": "gate", "args": { "step": 1 } },
        { "function": "gate", "args": { "step": 2 } },
    ] });
    let (status, body) = server
        .submit("acme", &acme, "bot", "e1", "k", two_calls)
        .await;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    let (status, body) = server
        .submit("acme", &acme, "bot", "e2", "k", json!({}))
        .await;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    let started = Instant::now();
    while endpoint.count() < 1 {
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "call 0 never came"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (status, body) = server
        .cancel("acme", &acme, "bot", "k", 2, "not the first")
        .await;
    assert_eq!(
        (status, body["code"].as_str()),
        (StatusCode::CONFLICT, Some("not-cancellable")),
        "{body}"
    );
    assert!(
        body["error"]
            .as_str()
            .is_some_and(|e| e.contains("#2 waits behind #1")),
        "{body}"
    );

    let (status, body) = server
        .cancel("acme", &acme, "bot", "k", 1, "the customer withdrew")
        .await;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    assert_eq!(body["done"], "cancelling", "{body}");
    // Call 0 answers; the run's next call is where it stops.
    endpoint.open(1);
    let outputs = server.wait_outputs("acme", &acme, 1).await;
    assert_eq!(outputs[0]["payload"]["sequence"], 2, "{outputs:?}");
    let history = server.settled_history("acme", &acme, "bot", "k").await;
    assert_eq!(statuses(&history), ["cancelled", "done"], "{history}");
    let first = &history["inputs"][0];
    assert_eq!(first["reason"], "the customer withdrew", "{first}");
    assert!(
        first["by"]
            .as_str()
            .is_some_and(|by| by.starts_with("tenant token ")),
        "{first}"
    );
    assert_eq!(first["outputs"], 0, "{first}");
    assert_eq!(
        endpoint.count(),
        1,
        "call 1 came after the cancel: not made"
    );

    let (status, body) = server.cancel("acme", &acme, "bot", "k", 1, "again").await;
    assert_eq!(
        (status, body["code"].as_str()),
        (StatusCode::CONFLICT, Some("not-cancellable")),
        "{body}"
    );
}

/// The files named `name` under `dir`, at any depth.
fn found(dir: &std::path::Path, name: &str) -> Vec<std::path::PathBuf> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.is_dir() {
            files.extend(found(&path, name));
        } else if path.file_name().is_some_and(|n| n == name) {
            files.push(path);
        }
    }
    files
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_from_the_journals_snapshot_keeps_ids_memory_parked_inputs_and_outputs_once() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = Server::start(dir.path(), "").await;
    let acme = server.tenant("acme").await;
    server.deploy("acme", &acme, "bot", "caller", "").await;
    let count = |n: u64| json!({ "memory_set": { "count": n } });
    for (id, key, payload) in [
        ("e1", "k", count(1)),
        ("e2", "k", count(2)),
        ("p1", "p", json!({ "fail": "never works" })),
    ] {
        let (status, body) = server.submit("acme", &acme, "bot", id, key, payload).await;
        assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    }
    server.wait_outputs("acme", &acme, 2).await;
    server.settled_history("acme", &acme, "bot", "p").await;

    // The first restart reads the whole journal and leaves its snapshot.
    server.stop().await;
    let server = Server::start(dir.path(), "").await;
    let snapshots = found(dir.path(), "snapshot.json");
    assert_eq!(snapshots.len(), 1, "{snapshots:?}");
    let (status, body) = server
        .submit(
            "acme",
            &acme,
            "bot",
            "e3",
            "k",
            json!({ "memory_get": ["count"] }),
        )
        .await;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    server.wait_outputs("acme", &acme, 3).await;
    server.stop().await;

    // The second reads the snapshot, then the records after it; and once more with a
    // snapshot that does not read, the whole journal again.
    for damage in [false, true] {
        server_restarted_keeps_everything(&dir, &acme, damage, &snapshots[0]).await;
    }
}

async fn server_restarted_keeps_everything(
    dir: &tempfile::TempDir,
    acme: &str,
    damage: bool,
    snapshot: &std::path::Path,
) {
    if damage {
        std::fs::write(snapshot, b"{\"format\": 1, \"not\": \"a snapshot\"}").expect("damage");
    }
    let server = Server::start(dir.path(), "").await;
    // An event id from before the snapshot is still known: a repeat is not run again.
    let (status, again) = server
        .submit(
            "acme",
            acme,
            "bot",
            "e1",
            "k",
            json!({ "memory_set": { "count": 1 } }),
        )
        .await;
    assert_eq!(
        (status, &again["duplicate"]),
        (StatusCode::OK, &json!(true)),
        "{again}"
    );
    let history = server.settled_history("acme", acme, "bot", "k").await;
    let done = 3 + usize::from(damage);
    assert_eq!(statuses(&history), vec!["done"; done], "{history}");
    let history = server.settled_history("acme", acme, "bot", "p").await;
    assert_eq!(statuses(&history), ["parked"], "not run again: {history}");
    let outputs = server.wait_outputs("acme", acme, done).await;
    assert_eq!(outputs.len(), done, "each output once: {outputs:?}");
    assert_eq!(outputs[2]["payload"]["memory"], json!({ "count": 2 }));
    // The key's memory and sequence go on from where they were.
    let id = if damage { "e5" } else { "e4" };
    let (status, body) = server
        .submit(
            "acme",
            acme,
            "bot",
            id,
            "k",
            json!({ "memory_get": ["count"] }),
        )
        .await;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    assert_eq!(body["sequence"], if damage { 5 } else { 4 }, "{body}");
    let outputs = server
        .wait_outputs("acme", acme, 4 + usize::from(damage))
        .await;
    let last = outputs.last().expect("an output");
    assert_eq!(last["payload"]["memory"], json!({ "count": 2 }), "{last}");
    server.stop().await;
}
