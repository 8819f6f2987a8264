//! The mock as its callers see it: a real server on an ephemeral port, real HTTP requests.

use reqwest::{Client, StatusCode};
use rewind_mock::{CHAT_CREATED, Counts, MockHandle, MockService};
use serde_json::{Value, json};

async fn start() -> (MockHandle, Client) {
    let mock = MockService::start("127.0.0.1:0".parse().expect("valid address"))
        .await
        .expect("mock starts");
    (mock, Client::new())
}

/// POSTs `body` to `path`, with an `Idempotency-Key` if given; returns status and JSON body.
async fn post(
    client: &Client,
    mock: &MockHandle,
    path: &str,
    key: Option<&str>,
    body: &Value,
) -> (StatusCode, Value) {
    let mut request = client.post(format!("{}{path}", mock.base_url())).json(body);
    if let Some(key) = key {
        request = request.header("Idempotency-Key", key);
    }
    let response = request.send().await.expect("request reaches the mock");
    let status = response.status();
    (status, response.json().await.expect("response is JSON"))
}

async fn post_raw(
    client: &Client,
    mock: &MockHandle,
    path: &str,
    body: &str,
) -> (StatusCode, Value) {
    let response = client
        .post(format!("{}{path}", mock.base_url()))
        .header("Content-Type", "application/json")
        .body(body.to_owned())
        .send()
        .await
        .expect("request reaches the mock");
    let status = response.status();
    (status, response.json().await.expect("response is JSON"))
}

async fn get_counts(client: &Client, mock: &MockHandle) -> Counts {
    client
        .get(format!("{}/counts", mock.base_url()))
        .send()
        .await
        .expect("request reaches the mock")
        .json()
        .await
        .expect("counts are JSON")
}

fn chat_request(user: &str) -> Value {
    json!({
        "model": "mock-1",
        "messages": [
            {"role": "system", "content": "You route customer messages."},
            {"role": "user", "content": user},
        ],
        "tools": [{"type": "function", "function": {"name": "orders.lookup", "parameters": {}}}],
    })
}

/// The assistant's content of a chat completion, after checking the OpenAI response shape.
fn reply_content(completion: &Value) -> &str {
    let id = completion["id"].as_str().expect("id is a string");
    assert!(id.starts_with("chatcmpl-"), "id {id}");
    assert_eq!(completion["object"], "chat.completion");
    assert_eq!(completion["created"], CHAT_CREATED);
    assert_eq!(completion["model"], "mock-1");
    let choices = completion["choices"]
        .as_array()
        .expect("choices is an array");
    assert_eq!(choices.len(), 1);
    assert_eq!(choices[0]["index"], 0);
    assert_eq!(choices[0]["finish_reason"], "stop");
    assert_eq!(choices[0]["message"]["role"], "assistant");
    let usage = &completion["usage"];
    assert_eq!(
        usage["total_tokens"].as_u64(),
        Some(
            usage["prompt_tokens"].as_u64().expect("prompt_tokens")
                + usage["completion_tokens"]
                    .as_u64()
                    .expect("completion_tokens")
        )
    );
    choices[0]["message"]["content"]
        .as_str()
        .expect("content is a string")
}

#[tokio::test]
async fn chat_replies_with_the_intent_of_the_last_user_message() {
    let (mock, client) = start().await;
    let cases = [
        (
            "Where is my order A1234?",
            r#"{"intent":"order-status","order_id":"A1234"}"#,
        ),
        (
            "I'd like a Refund for B5678",
            r#"{"intent":"refund","order_id":"B5678"}"#,
        ),
        (
            "how do REFUNDS work",
            r#"{"intent":"refund","order_id":null}"#,
        ),
        ("hello there", r#"{"intent":"general","order_id":null}"#),
    ];
    for (user, expected) in cases {
        let (status, completion) = post(
            &client,
            &mock,
            "/v1/chat/completions",
            None,
            &chat_request(user),
        )
        .await;
        assert_eq!(status, StatusCode::OK, "{user}: {completion}");
        assert_eq!(reply_content(&completion), expected, "{user}");
    }
}

#[tokio::test]
async fn chat_reads_only_the_last_user_message() {
    let (mock, client) = start().await;
    let request = json!({
        "model": "mock-1",
        "messages": [
            {"role": "user", "content": "refund A1234"},
            {"role": "assistant", "content": null, "tool_calls": []},
            {"role": "user", "content": [{"type": "text", "text": "and where is C4242?"}]},
            {"role": "assistant", "content": "looking"},
        ],
    });
    let (status, completion) = post(&client, &mock, "/v1/chat/completions", None, &request).await;
    assert_eq!(status, StatusCode::OK, "{completion}");
    assert_eq!(
        reply_content(&completion),
        r#"{"intent":"order-status","order_id":"C4242"}"#
    );
}

#[tokio::test]
async fn chat_replies_are_identical_for_identical_requests() {
    let (mock, client) = start().await;
    let request = chat_request("Where is my order A1234?");
    let (_, first) = post(&client, &mock, "/v1/chat/completions", Some("k1"), &request).await;
    let (_, second) = post(&client, &mock, "/v1/chat/completions", Some("k2"), &request).await;
    assert_eq!(first, second);
}

#[tokio::test]
async fn chat_records_whether_authorization_was_sent() {
    let (mock, client) = start().await;
    let response = client
        .post(format!("{}/v1/chat/completions", mock.base_url()))
        .bearer_auth("sk-test")
        .json(&chat_request("hi"))
        .send()
        .await
        .expect("request reaches the mock");
    assert_eq!(response.status(), StatusCode::OK);
    post(
        &client,
        &mock,
        "/v1/chat/completions",
        None,
        &chat_request("hi"),
    )
    .await;

    let counts = mock.counts();
    assert_eq!(counts.for_route("/v1/chat/completions"), 2);
    assert_eq!(counts.with_authorization, 1);
}

#[tokio::test]
async fn order_lookup_is_deterministic_per_order_id() {
    let (mock, client) = start().await;
    let mut statuses = Vec::new();
    for id in ["A1234", "B2", "C333", "D4444", "E55555", "F666666"] {
        let body = json!({"order_id": id});
        let (status, first) = post(&client, &mock, "/tools/orders.lookup", None, &body).await;
        let (_, second) = post(&client, &mock, "/tools/orders.lookup", None, &body).await;
        assert_eq!(status, StatusCode::OK, "{first}");
        assert_eq!(first, second, "{id}");
        assert_eq!(first["order_id"], id);
        let state = first["status"]
            .as_str()
            .expect("status is a string")
            .to_owned();
        assert!(
            ["shipped", "processing", "delivered"].contains(&state.as_str()),
            "{first}"
        );
        let eta = first["eta_days"].as_u64().expect("eta_days is a number");
        assert_eq!(state == "delivered", eta == 0, "{first}");
        statuses.push(state);
    }
    statuses.sort();
    statuses.dedup();
    assert!(
        statuses.len() > 1,
        "every order has the same status: {statuses:?}"
    );
}

#[tokio::test]
async fn order_lookup_without_order_id_is_a_400_naming_the_field() {
    let (mock, client) = start().await;
    let (status, body) = post(
        &client,
        &mock,
        "/tools/orders.lookup",
        None,
        &json!({"id": "A1"}),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(body["code"], "wrong-shape");
    let error = body["error"].as_str().expect("error is a string");
    assert!(error.contains("order_id"), "{error}");
}

#[tokio::test]
async fn enrichment_is_derived_from_its_input() {
    let (mock, client) = start().await;
    let (status, company) = post(
        &client,
        &mock,
        "/tools/enrich.company",
        None,
        &json!({"domain": "acme.com"}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{company}");
    assert_eq!(company["domain"], "acme.com");
    assert_eq!(company["name"], "Acme");
    assert!(company["industry"].is_string(), "{company}");
    assert!(
        company["employees"].as_u64().is_some_and(|n| n > 0),
        "{company}"
    );

    let (status, person) = post(
        &client,
        &mock,
        "/tools/enrich.person",
        None,
        &json!({"email": "jo@acme.com"}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{person}");
    assert_eq!(person["email"], "jo@acme.com");
    assert_eq!(person["name"], "Jo");
    assert_eq!(person["company"], "Acme");
    assert!(person["title"].is_string(), "{person}");

    let (again_status, again) = post(
        &client,
        &mock,
        "/tools/enrich.person",
        None,
        &json!({"email": "jo@acme.com"}),
    )
    .await;
    assert_eq!(again_status, StatusCode::OK);
    assert_eq!(again, person);

    let (status, body) = post(
        &client,
        &mock,
        "/tools/enrich.person",
        None,
        &json!({"email": "not-an-address"}),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(body["code"], "invalid-field");
    assert!(
        body["error"].as_str().is_some_and(|e| e.contains("email")),
        "{body}"
    );
}

#[tokio::test]
async fn other_tools_echo_their_request() {
    let (mock, client) = start().await;
    let request = json!({"to": "jo@acme.com", "lines": [1, 2]});
    let (status, body) = post(&client, &mock, "/tools/email.send", None, &request).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body, json!({"tool": "email.send", "echo": request}));
}

#[tokio::test]
async fn calls_are_counted_per_idempotency_key() {
    let (mock, client) = start().await;
    let lookup = json!({"order_id": "A1234"});
    post(
        &client,
        &mock,
        "/tools/orders.lookup",
        Some("run-1/step-1"),
        &lookup,
    )
    .await;
    post(
        &client,
        &mock,
        "/tools/orders.lookup",
        Some("run-1/step-1"),
        &lookup,
    )
    .await;
    post(
        &client,
        &mock,
        "/v1/chat/completions",
        Some("run-1/step-0"),
        &chat_request("hi"),
    )
    .await;
    post(&client, &mock, "/tools/orders.lookup", None, &lookup).await;

    let counts = get_counts(&client, &mock).await;
    assert_eq!(counts.total, 4);
    assert_eq!(counts.for_key("run-1/step-1"), 2);
    assert_eq!(counts.for_key("run-1/step-0"), 1);
    assert_eq!(counts.without_key, 1);
    assert_eq!(counts.repeated_keys, vec!["run-1/step-1".to_owned()]);
    assert_eq!(counts.for_route("/tools/orders.lookup"), 3);
    assert_eq!(counts.for_route("/v1/chat/completions"), 1);
    // Reading the counts is not itself a call.
    assert_eq!(mock.counts(), counts);
}

#[tokio::test]
async fn malformed_json_is_a_400_that_says_so() {
    let (mock, client) = start().await;
    for path in [
        "/v1/chat/completions",
        "/tools/orders.lookup",
        "/tools/anything",
    ] {
        let (status, body) = post_raw(&client, &mock, path, r#"{"order_id": "A1234""#).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{path}");
        assert_eq!(body["code"], "malformed-json", "{path}");
        let error = body["error"].as_str().expect("error is a string");
        assert!(error.contains("not valid JSON"), "{path}: {error}");
        assert!(error.contains("line 1"), "{path}: {error}");
    }

    let (status, body) = post_raw(&client, &mock, "/tools/anything", "").await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(body["code"], "empty-body");

    let (status, body) = post(
        &client,
        &mock,
        "/v1/chat/completions",
        None,
        &json!({"model": "m"}),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(body["code"], "wrong-shape");
    assert!(
        body["error"]
            .as_str()
            .is_some_and(|e| e.contains("messages")),
        "{body}"
    );

    // A rejected call still reached the remote, so it is counted.
    assert_eq!(mock.counts().total, 5);
}

#[tokio::test]
async fn reset_zeroes_every_counter() {
    let (mock, client) = start().await;
    post(&client, &mock, "/tools/x", Some("k"), &json!({})).await;
    post(&client, &mock, "/tools/x", Some("k"), &json!({})).await;
    post(&client, &mock, "/tools/x", None, &json!({})).await;

    let (status, before) = post(&client, &mock, "/counts/reset", None, &json!({})).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(before["total"], 3);
    assert_eq!(get_counts(&client, &mock).await, Counts::default());

    post(&client, &mock, "/tools/x", Some("k"), &json!({})).await;
    let counts = mock.counts();
    assert_eq!(counts.for_key("k"), 1);
    assert!(counts.repeated_keys.is_empty());
}

#[tokio::test]
async fn unknown_routes_are_a_json_404() {
    let (mock, client) = start().await;
    let (status, body) = post(&client, &mock, "/v2/nothing", None, &json!({})).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(body["code"], "not-found");
    assert_eq!(mock.counts().total, 0);
}

#[tokio::test]
async fn shutdown_returns_the_final_counts_and_stops_serving() {
    let (mock, client) = start().await;
    post(&client, &mock, "/tools/x", Some("k"), &json!({})).await;
    let url = format!("{}/healthz", mock.base_url());

    let counts = mock.shutdown().await.expect("graceful shutdown");
    assert_eq!(counts.total, 1);
    assert!(
        client.get(url).send().await.is_err(),
        "still serving after shutdown"
    );
}

#[cfg(unix)]
#[test]
fn binary_prints_its_url_and_exits_cleanly_on_sigterm() {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};

    let mut child = Command::new(env!("CARGO_BIN_EXE_rewind-mock"))
        .args(["--addr", "127.0.0.1:0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("binary starts");
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("stdout is piped"))
        .read_line(&mut line)
        .expect("binary prints a line");
    let url = line
        .trim()
        .strip_prefix("rewind-mock listening on ")
        .unwrap_or_else(|| panic!("unexpected first line: {line:?}"))
        .to_owned();
    assert!(url.starts_with("http://127.0.0.1:"), "{url}");

    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let response = Client::new()
            .post(format!("{url}/tools/ping"))
            .header("Idempotency-Key", "once")
            .json(&json!({}))
            .send()
            .await
            .expect("binary serves");
        assert_eq!(response.status(), StatusCode::OK);
    });

    let killed = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .expect("kill runs");
    assert!(killed.success());
    let output = child.wait_with_output().expect("binary exits");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "exit {:?}: {stderr}",
        output.status
    );
    let summary = stderr
        .lines()
        .find_map(|line| line.strip_prefix("rewind-mock stopped on SIGTERM; final counts: "))
        .unwrap_or_else(|| panic!("no summary line in {stderr:?}"));
    let counts: Counts = serde_json::from_str(summary).expect("summary is the counts as JSON");
    assert_eq!(counts.for_key("once"), 1);
}

#[tokio::test]
async fn a_streamed_chat_reply_is_the_same_reply_in_chunks_then_done() {
    let (mock, client) = start().await;
    let mut request = chat_request("where is my order A-1?");
    let (_, whole) = post(&client, &mock, "/v1/chat/completions", None, &request).await;
    request["stream"] = json!(true);
    request["stream_options"] = json!({ "include_usage": true });
    let response = client
        .post(format!("{}/v1/chat/completions", mock.base_url()))
        .json(&request)
        .send()
        .await
        .expect("request reaches the mock");
    assert_eq!(response.status(), StatusCode::OK);
    let content_type = response.headers()["content-type"].to_str().expect("text");
    assert!(
        content_type.starts_with("text/event-stream"),
        "{content_type}"
    );
    let text = response.text().await.expect("the stream reads");
    let data: Vec<&str> = text
        .lines()
        .filter_map(|line| line.strip_prefix("data: "))
        .collect();
    assert_eq!(data.last(), Some(&"[DONE]"), "{text}");
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).expect("a chunk is JSON"))
        .collect();
    let content: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(content, reply_content(&whole), "the same reply, in pieces");
    assert!(chunks.len() >= 4, "role, pieces, finish, usage: {chunks:?}");
    let finish = chunks
        .iter()
        .find_map(|c| c["choices"][0]["finish_reason"].as_str());
    assert_eq!(finish, Some("stop"));
    assert_eq!(chunks.last().expect("a chunk")["usage"], whole["usage"]);
}

#[tokio::test]
async fn a_call_asking_for_a_delay_is_answered_that_late() {
    let (mock, client) = start().await;
    let started = std::time::Instant::now();
    let response = client
        .post(format!("{}/tools/echo", mock.base_url()))
        .header(rewind_mock::DELAY_HEADER, "300")
        .json(&json!({}))
        .send()
        .await
        .expect("request reaches the mock");
    assert_eq!(response.status(), StatusCode::OK);
    assert!(started.elapsed() >= std::time::Duration::from_millis(300));
}

/// A port another program holds: the binary says so, and what to do.
#[cfg(unix)]
#[test]
fn binary_says_when_its_port_is_taken() {
    use std::process::Command;

    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("a port");
    let addr = taken.local_addr().expect("its address").to_string();
    let output = Command::new(env!("CARGO_BIN_EXE_rewind-mock"))
        .args(["--addr", &addr])
        .output()
        .expect("binary runs");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains(&format!("cannot listen on {addr}: the port is taken"))
            && stderr.contains("--addr"),
        "{stderr}"
    );
}

/// The reconcile endpoint: 404 for a key the tool never saw, 503 "running" with
/// Retry-After while the call under the key runs, then 200 with the answer it got.
#[tokio::test]
async fn the_status_of_a_tool_call_is_never_seen_then_running_then_its_answer() {
    let (mock, client) = start().await;
    let status = |key: &'static str| {
        let request = client
            .get(format!("{}/tools/payments.charge/status", mock.base_url()))
            .header("Idempotency-Key", key);
        async move {
            let response = request.send().await.expect("request reaches the mock");
            let retry_after = response.headers().get("retry-after").cloned();
            let status = response.status();
            (
                status,
                retry_after,
                response.json::<Value>().await.expect("JSON"),
            )
        }
    };
    assert_eq!(status("pay-1").await.0, StatusCode::NOT_FOUND);

    let call = {
        let request = client
            .post(format!("{}/tools/payments.charge", mock.base_url()))
            .header("Idempotency-Key", "pay-1")
            .header(rewind_mock::DELAY_HEADER, "2000")
            .json(&json!({"amount": 5}));
        tokio::spawn(async move {
            request
                .send()
                .await
                .expect("the call")
                .json::<Value>()
                .await
        })
    };
    // Once the call has reached the mock, and until it answers: running.
    let running = loop {
        let (code, retry_after, body) = status("pay-1").await;
        if code != StatusCode::NOT_FOUND {
            break (code, retry_after, body);
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    };
    assert_eq!(running.0, StatusCode::SERVICE_UNAVAILABLE, "{running:?}");
    assert_eq!(running.1.expect("Retry-After"), "1");
    assert_eq!(running.2, json!({"status": "running"}));

    let answer = call.await.expect("joined").expect("JSON");
    let (code, _, body) = status("pay-1").await;
    assert_eq!(code, StatusCode::OK);
    assert_eq!(body, answer);
    assert_eq!(
        body,
        json!({"tool": "payments.charge", "echo": {"amount": 5}})
    );
    assert_eq!(status("pay-2").await.0, StatusCode::NOT_FOUND);
}
