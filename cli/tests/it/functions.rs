//! Functions against real servers on 127.0.0.1.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use rewind_host::store::{ActionStateStore, CallOutcome, KeyScope};
use serde_json::{Value, json};

use crate::support::{agent_toml, agent_with, first_output, input, memory_store};

/// What the test server saw: per route, each request's headers of interest.
type Headers = BTreeMap<String, String>;

#[derive(Clone, Default)]
struct Seen(Arc<Mutex<BTreeMap<&'static str, Vec<Headers>>>>);

impl Seen {
    fn push(&self, route: &'static str, headers: &HeaderMap) -> usize {
        let kept = ["idempotency-key", "x-team", "x-secret", "content-type"]
            .into_iter()
            .filter_map(|name| {
                headers
                    .get(name)
                    .and_then(|v| v.to_str().ok())
                    .map(|v| (name.to_owned(), v.to_owned()))
            })
            .collect();
        let mut seen = self.0.lock().expect("lock");
        let list = seen.entry(route).or_default();
        list.push(kept);
        list.len()
    }

    fn requests(&self, route: &'static str) -> Vec<Headers> {
        self.0
            .lock()
            .expect("lock")
            .get(route)
            .cloned()
            .unwrap_or_default()
    }
}

async fn serve() -> (SocketAddr, Seen) {
    let seen = Seen::default();
    let app = Router::new()
        .route(
            "/echo",
            post(
                |State(seen): State<Seen>, headers: HeaderMap, body: String| async move {
                    seen.push("echo", &headers);
                    let args: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
                    axum::Json(json!({ "echo": args }))
                },
            ),
        )
        .route(
            "/slow",
            post(|State(seen): State<Seen>, headers: HeaderMap| async move {
                seen.push("slow", &headers);
                tokio::time::sleep(Duration::from_secs(2)).await;
                axum::Json(json!({ "late": true }))
            }),
        )
        .route(
            "/flaky",
            post(|State(seen): State<Seen>, headers: HeaderMap| async move {
                let n = seen.push("flaky", &headers);
                if n <= 2 {
                    (
                        StatusCode::SERVICE_UNAVAILABLE,
                        axum::Json(json!({ "error": "busy" })),
                    )
                } else {
                    (StatusCode::OK, axum::Json(json!({ "attempt": n })))
                }
            }),
        )
        .route(
            "/missing",
            post(|State(seen): State<Seen>, headers: HeaderMap| async move {
                seen.push("missing", &headers);
                (
                    StatusCode::NOT_FOUND,
                    axum::Json(json!({ "error": "no such order" })),
                )
            }),
        )
        .route(
            "/huge",
            post(|State(seen): State<Seen>, headers: HeaderMap| async move {
                seen.push("huge", &headers);
                // Says how long it is: refused before a byte of it is read.
                axum::Json(json!({ "blob": "h".repeat(5 << 20) }))
            }),
        )
        .route(
            "/stream",
            post(|State(seen): State<Seen>, headers: HeaderMap| async move {
                seen.push("stream", &headers);
                // Chunked, no length: read until it passes the cap.
                let chunks = (0..64).map(|_| Ok::<_, std::io::Error>(vec![b' '; 1024]));
                axum::body::Body::from_stream(futures_util::stream::iter(chunks))
            }),
        )
        .route(
            "/v1/chat/completions",
            post(|State(seen): State<Seen>, headers: HeaderMap| async move {
                seen.push("chat", &headers);
                let content = "c".repeat(64 << 10);
                axum::Json(json!({ "choices": [
                    { "message": { "role": "assistant", "content": content } }
                ] }))
            }),
        )
        .with_state(seen.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(listener, app).await });
    (addr, seen)
}

fn http_function(addr: SocketAddr, route: &str, extra: &str) -> String {
    format!("[functions.tool]\nkind = \"http\"\nurl = \"http://{addr}/{route}\"\n{extra}\n")
}

fn call_tool(args: Value) -> Value {
    json!({ "calls": [{ "function": "tool", "args": args }] })
}

#[tokio::test]
async fn http_posts_the_args_with_the_idempotency_key_and_configured_headers() {
    let (addr, seen) = serve().await;
    // CARGO_PKG_NAME is set for every test process: it stands in for a secret here.
    let toml = agent_toml(
        "caller",
        "",
        &http_function(
            addr,
            "echo",
            "headers = { \"X-Team\" = \"support\" }\nsecret-headers = { \"X-Secret\" = \"CARGO_PKG_NAME\" }",
        ),
    );
    let agent = agent_with(&toml, memory_store(), &[]);
    let report = agent
        .process(
            &input("k", 1, call_tool(json!({ "order": "A1" }))),
            &Default::default(),
        )
        .await;
    assert!(report.error.is_none(), "{report:?}");
    let output = first_output(&report);
    assert_eq!(
        output["results"][0]["ok"],
        json!({ "echo": { "order": "A1" } })
    );
    assert!(
        !output.to_string().contains(env!("CARGO_PKG_NAME")),
        "a secret reached the guest"
    );

    let requests = seen.requests("echo");
    assert_eq!(requests.len(), 1);
    let headers = &requests[0];
    assert!(headers["idempotency-key"].starts_with("rw-"), "{headers:?}");
    assert_eq!(headers["x-team"], "support");
    assert_eq!(headers["x-secret"], env!("CARGO_PKG_NAME"));
    assert_eq!(headers["content-type"], "application/json");
}

#[tokio::test]
async fn http_retries_5xx_with_the_same_idempotency_key() {
    let (addr, seen) = serve().await;
    let toml = agent_toml("caller", "", &http_function(addr, "flaky", "retries = 3"));
    let agent = agent_with(&toml, memory_store(), &[]);
    let report = agent
        .process(&input("k", 1, call_tool(json!({}))), &Default::default())
        .await;
    assert!(report.error.is_none(), "{report:?}");
    assert_eq!(
        first_output(&report)["results"][0]["ok"],
        json!({ "attempt": 3 })
    );
    let keys: Vec<String> = seen
        .requests("flaky")
        .into_iter()
        .map(|h| h["idempotency-key"].clone())
        .collect();
    assert_eq!(keys.len(), 3);
    assert!(keys.iter().all(|k| *k == keys[0]), "{keys:?}");
}

#[tokio::test]
async fn http_times_out_and_records_nothing() {
    let (addr, _seen) = serve().await;
    let toml = agent_toml(
        "caller",
        "",
        &http_function(addr, "slow", "timeout-ms = 200\nretries = 0"),
    );
    let store = memory_store();
    let agent = agent_with(&toml, store.clone(), &[]);
    let report = agent
        .process(&input("k", 1, call_tool(json!({}))), &Default::default())
        .await;
    let error = report.error.expect("the run fails").to_string();
    assert!(
        error.contains("timed out") && error.contains("tool"),
        "{error}"
    );
    assert!(
        store
            .states(&KeyScope::new("default", "test", "k"))
            .is_empty(),
        "nothing is recorded"
    );
}

/// A run's `timeout-ms` does not count its time inside durable calls: a call that takes 2 s
/// (bounded by its own timeout) completes a run whose limit is 500 ms.
#[tokio::test]
async fn a_call_longer_than_the_runs_timeout_is_not_the_runs_time() {
    let (addr, _seen) = serve().await;
    let tables = format!(
        "[limits]\ntimeout-ms = 500\n{}",
        http_function(addr, "slow", "timeout-ms = 10_000\nretries = 0")
    );
    let toml = agent_toml("caller", "", &tables);
    let store = memory_store();
    let agent = agent_with(&toml, store.clone(), &[]);
    let report = agent
        .process(&input("k", 1, call_tool(json!({}))), &Default::default())
        .await;
    assert!(report.error.is_none(), "{:?}", report.error);
    let recorded = store.states(&KeyScope::new("default", "test", "k"));
    assert_eq!(recorded.len(), 1);
    assert!(
        matches!(&recorded[0].calls[0].outcome, CallOutcome::Succeeded(result) if result.contains("late")),
        "{recorded:?}"
    );
}

#[tokio::test]
async fn http_non_2xx_is_a_recorded_failure_with_status_and_body() {
    let (addr, seen) = serve().await;
    let gate = crate::support::Counting::unavailable_first(1);
    let toml = agent_toml("caller", "", &http_function(addr, "missing", ""));
    let store = memory_store();
    let agent = agent_with(&toml, store.clone(), &[("gate", gate)]);
    let payload = json!({ "calls": [
        { "function": "tool", "args": { "order": "Z9" } },
        { "function": "gate", "args": {} },
    ] });
    agent
        .process(&input("k", 1, payload.clone()), &Default::default())
        .await;
    let report = agent
        .process(&input("k", 1, payload), &Default::default())
        .await;
    assert!(report.error.is_none(), "{report:?}");
    let failure = first_output(&report)["results"][0]["error"]["failed"]
        .as_str()
        .expect("a failure")
        .to_owned();
    let failure: Value = serde_json::from_str(&failure).expect("JSON");
    assert_eq!(
        failure,
        json!({ "status": 404, "body": { "error": "no such order" } })
    );
    assert_eq!(
        seen.requests("missing").len(),
        1,
        "the replay is served from the record"
    );
    let states = store.states(&KeyScope::new("default", "test", "k"));
    assert!(matches!(states[0].calls[0].outcome, CallOutcome::Failed(_)));
}

#[tokio::test]
async fn openai_chat_returns_the_assistant_message() {
    let mock = rewind_mock::MockService::start("127.0.0.1:0".parse().expect("addr"))
        .await
        .expect("mock starts");
    let toml = agent_toml(
        "caller",
        "",
        &format!(
            "[functions.chat]\nkind = \"openai-chat\"\nbase-url = \"{}/v1\"\nmodel = \"mock-1\"\n",
            mock.base_url()
        ),
    );
    let agent = agent_with(&toml, memory_store(), &[]);
    let messages =
        json!({ "messages": [{ "role": "user", "content": "Where is my order A1234?" }] });
    let report = agent
        .process(
            &input(
                "k",
                1,
                json!({ "calls": [{ "function": "chat", "args": messages }] }),
            ),
            &Default::default(),
        )
        .await;
    assert!(report.error.is_none(), "{report:?}");
    let message = first_output(&report)["results"][0]["ok"].clone();
    assert_eq!(message["role"], "assistant");
    let content: Value =
        serde_json::from_str(message["content"].as_str().expect("content")).expect("JSON");
    assert_eq!(
        content,
        json!({ "intent": "order-status", "order_id": "A1234" })
    );
    let counts = mock.counts();
    assert_eq!(counts.by_idempotency_key.len(), 1);
    assert!(counts.by_idempotency_key.values().all(|&n| n == 1));
}

/// Runs `toml`'s `tool` once, then the same input again (the first run fails after the call
/// at a gate, so the second replays it): the call's recorded failure, and how often the
/// endpoint was asked.
async fn recorded_failure(toml: &str, seen: &Seen, route: &'static str) -> String {
    let gate = crate::support::Counting::unavailable_first(1);
    let agent = agent_with(toml, memory_store(), &[("gate", gate)]);
    let payload = json!({ "calls": [
        { "function": "tool", "args": { "messages": [] } },
        { "function": "gate", "args": {} },
    ] });
    agent
        .process(&input("k", 1, payload.clone()), &Default::default())
        .await;
    let report = agent
        .process(&input("k", 1, payload), &Default::default())
        .await;
    assert!(report.error.is_none(), "{report:?}");
    assert_eq!(
        seen.requests(route).len(),
        1,
        "the replay is served the recorded failure"
    );
    first_output(&report)["results"][0]["error"]["failed"]
        .as_str()
        .expect("a recorded failure")
        .to_owned()
}

#[tokio::test]
async fn an_answer_longer_than_max_response_bytes_is_a_recorded_failure() {
    let (addr, seen) = serve().await;
    let toml = agent_toml(
        "caller",
        "",
        &http_function(addr, "stream", "max-response-bytes = 10000"),
    );
    let failure = recorded_failure(&toml, &seen, "stream").await;
    assert!(
        failure.ends_with("response larger than 10000 bytes"),
        "{failure}"
    );
}

#[tokio::test]
async fn an_answer_that_says_it_is_longer_than_the_default_cap_is_refused_unread() {
    let (addr, seen) = serve().await;
    let toml = agent_toml("caller", "", &http_function(addr, "huge", ""));
    let failure = recorded_failure(&toml, &seen, "huge").await;
    assert!(
        failure.ends_with("response larger than 4194304 bytes"),
        "{failure}"
    );
}

#[tokio::test]
async fn a_chat_answer_longer_than_max_response_bytes_is_a_recorded_failure() {
    let (addr, seen) = serve().await;
    let toml = agent_toml(
        "caller",
        "",
        &format!(
            "[functions.tool]\nkind = \"openai-chat\"\nbase-url = \"http://{addr}/v1\"\n\
             model = \"m\"\nmax-response-bytes = 32768\n"
        ),
    );
    let failure = recorded_failure(&toml, &seen, "chat").await;
    assert!(
        failure.ends_with("message is larger than 32768 bytes"),
        "{failure}"
    );
}
