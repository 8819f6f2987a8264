//! The functions of an agent under test, simulated on loopback: scripted answers, or the
//! function's own endpoint asked once per idempotency key for the whole kit run, and every
//! request counted.
//!
//! Every `http` and `openai-chat` function of the agent is pointed here
//! (`/fn/NAME/...`). The simulator honours `Idempotency-Key` as a well-behaved remote does:
//! the first request of a key gets an answer (scripted, or from the upstream endpoint),
//! later requests of that key, in this case or any later one, get the same answer and
//! reach nothing. A call no script answers goes to the endpoint ([`Misses::Forward`]), its
//! answer kept as a script would have it ([`Simulator::live_answers`]: what `rewind dev`
//! records), or fails ([`Misses::Fail`]: `rewind dev --offline`). A retryable answer (5xx, 429, 408) is not kept: the next request of the
//! key is forwarded again. `GET
//! /fn/NAME/~status` answers a reconcile: 200 with the key's answer, 404 when the key was
//! never seen.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, Method, StatusCode};
use axum::routing::any;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::error::KitError;

/// One scripted answer: `{"function": NAME, "args": {...}, "result": {...}}`. Without
/// `args` it answers every call of the function that no entry with `args` matches.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Script {
    pub function: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub args: Option<Value>,
    pub result: Value,
}

/// Reads a JSONL file of [`Script`] lines; an error names the line.
pub fn read_scripts(path: &std::path::Path) -> Result<Vec<Script>, KitError> {
    let text = std::fs::read_to_string(path)
        .map_err(KitError::io(format!("reading {}", path.display())))?;
    let mut scripts = Vec::new();
    for (number, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let script = serde_json::from_str(line).map_err(KitError::json(format!(
            "{}:{}: not a scripted answer",
            path.display(),
            number + 1
        )))?;
        scripts.push(script);
    }
    Ok(scripts)
}

/// A function and an idempotency key.
type Slot = (String, String);

/// What one idempotency key of one function got, over the whole kit run.
#[derive(Debug, Default)]
struct Answered {
    /// The first final answer: what every later request of the key gets. A retryable
    /// answer (5xx, 429, 408) is not kept: the next request is forwarded again.
    answer: Option<(u16, String)>,
    /// The body of its first request.
    body: Option<Bytes>,
    /// Requests that reached the function's endpoint or its script.
    forwarded: u64,
}

/// What one idempotency key of one function saw in the current case.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct CaseCount {
    /// Requests that carried the key.
    requests: u64,
    /// A request carried another body than the key's first (in any case).
    changed: bool,
}

/// What becomes of a call no script answers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Misses {
    /// It goes to the function's endpoint (once per idempotency key).
    #[default]
    Forward,
    /// It fails: the simulator answers 422, naming the function, and counts it.
    Fail,
}

#[derive(Debug, Default)]
struct Shared {
    /// Function name to the URL its requests go to when no script answers.
    upstreams: BTreeMap<String, String>,
    scripts: Vec<Script>,
    misses: Misses,
    /// The final JSON answers endpoints gave, as scripts, in the order they came.
    live: Mutex<Vec<Script>>,
    /// Calls answered by a script, by an endpoint, and failed for want of a script.
    scripted: AtomicU64,
    forwarded_live: AtomicU64,
    missed: AtomicU64,
    client: reqwest::Client,
    /// Per key, for the whole kit run; each behind a lock of its own, held while its first
    /// request is forwarded, so that a request of the key meanwhile waits for that answer.
    answered: Mutex<BTreeMap<Slot, Arc<tokio::sync::Mutex<Answered>>>>,
    /// Per key, for the current case.
    case: Mutex<BTreeMap<Slot, CaseCount>>,
    asks: AtomicU64,
}

impl Shared {
    fn slot(&self, slot: &Slot) -> Arc<tokio::sync::Mutex<Answered>> {
        let mut answered = self.answered.lock().unwrap_or_else(|p| p.into_inner());
        Arc::clone(answered.entry(slot.clone()).or_default())
    }
}

/// An answer not to keep: the remote side may answer otherwise when asked again.
fn retryable(status: u16) -> bool {
    status >= 500 || status == 429 || status == 408
}

/// What the simulator saw of one function over the whole kit run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Forwarded {
    /// Idempotency keys seen.
    pub keys: u64,
    /// Requests that reached the function's endpoint (or its script).
    pub forwarded: u64,
}

/// A running simulator.
#[derive(Debug)]
pub struct Simulator {
    base: String,
    shared: Arc<Shared>,
    server: tokio::task::JoinHandle<()>,
}

impl Simulator {
    /// Starts on a free loopback port; calls no script answers go to their endpoints.
    pub async fn start(
        upstreams: BTreeMap<String, String>,
        scripts: Vec<Script>,
    ) -> Result<Self, KitError> {
        Self::start_with(upstreams, scripts, Misses::Forward).await
    }

    /// Starts on a free loopback port; `misses` says what becomes of a call no script
    /// answers.
    pub async fn start_with(
        upstreams: BTreeMap<String, String>,
        scripts: Vec<Script>,
        misses: Misses,
    ) -> Result<Self, KitError> {
        let shared = Arc::new(Shared {
            upstreams,
            scripts,
            misses,
            ..Shared::default()
        });
        let app = Router::new()
            .route("/fn/{name}", any(handle))
            .route("/fn/{name}/{*rest}", any(handle))
            .with_state(Arc::clone(&shared));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(KitError::io("the simulator: listening on loopback"))?;
        let addr = listener
            .local_addr()
            .map_err(KitError::io("the simulator: its address"))?;
        let server = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(Self {
            base: format!("http://{addr}"),
            shared,
            server,
        })
    }

    /// Where function `name`'s requests go.
    pub fn url(&self, name: &str) -> String {
        format!("{}/fn/{name}", self.base)
    }

    /// Forgets the current case's counts, for the next case. The answers stay: a key
    /// answered once is answered the same in every later case, without reaching the
    /// function's endpoint again.
    pub fn reset(&self) {
        self.shared
            .case
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
        self.shared.asks.store(0, Ordering::SeqCst);
    }

    /// Requests per (function, idempotency key) in the current case.
    pub fn keys(&self) -> BTreeMap<(String, String), u64> {
        self.shared
            .case
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|(key, count)| (key.clone(), count.requests))
            .collect()
    }

    /// The (function, idempotency key) pairs of the current case whose requests did not all
    /// carry the same arguments: a call made again that is not the same call.
    pub fn changed(&self) -> Vec<(String, String)> {
        self.shared
            .case
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter(|(_, count)| count.changed)
            .map(|(key, _)| key.clone())
            .collect()
    }

    /// Per function, over the whole kit run: keys seen, and requests that reached its
    /// endpoint (or script).
    pub async fn forwarded(&self) -> BTreeMap<String, Forwarded> {
        let slots: Vec<(Slot, Arc<tokio::sync::Mutex<Answered>>)> = self
            .shared
            .answered
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|(slot, answered)| (slot.clone(), Arc::clone(answered)))
            .collect();
        let mut by_function: BTreeMap<String, Forwarded> = BTreeMap::new();
        for ((function, _), answered) in slots {
            let entry = by_function.entry(function).or_default();
            entry.keys += 1;
            entry.forwarded += answered.lock().await.forwarded;
        }
        by_function
    }

    /// Reconcile questions answered.
    pub fn asks(&self) -> u64 {
        self.shared.asks.load(Ordering::SeqCst)
    }

    /// The final answers endpoints gave that a script can hold (a JSON request answered
    /// 2xx with JSON, or with a chat model's stream, kept as its whole completion), as
    /// scripts with their args, in the order they came.
    pub fn live_answers(&self) -> Vec<Script> {
        (self.shared.live.lock().unwrap_or_else(|p| p.into_inner())).clone()
    }

    /// Calls a script answered (once per idempotency key).
    pub fn scripted(&self) -> u64 {
        self.shared.scripted.load(Ordering::SeqCst)
    }

    /// Requests that went to an endpoint.
    pub fn forwarded_live(&self) -> u64 {
        self.shared.forwarded_live.load(Ordering::SeqCst)
    }

    /// Calls that failed for want of a script ([`Misses::Fail`]).
    pub fn misses(&self) -> u64 {
        self.shared.missed.load(Ordering::SeqCst)
    }
}

impl Drop for Simulator {
    fn drop(&mut self) {
        self.server.abort();
    }
}

/// A request to one function, as it came in.
struct Request {
    function: String,
    /// The path after the function's name (`~status` for a reconcile question).
    rest: String,
    method: Method,
    headers: HeaderMap,
    body: Bytes,
}

/// Both routes: `/fn/{name}` and `/fn/{name}/{*rest}`.
async fn handle(
    State(shared): State<Arc<Shared>>,
    Path(mut path): Path<BTreeMap<String, String>>,
    method: Method,
    headers: HeaderMap,
    body: Bytes,
) -> (StatusCode, String) {
    let request = Request {
        function: path.remove("name").unwrap_or_default(),
        rest: path.remove("rest").unwrap_or_default(),
        method,
        headers,
        body,
    };
    answer(shared, request).await
}

async fn answer(shared: Arc<Shared>, request: Request) -> (StatusCode, String) {
    let key = request
        .headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let slot = (request.function.clone(), key);
    if request.rest == "~status" {
        shared.asks.fetch_add(1, Ordering::SeqCst);
        // Each case stands for a remote of its own: it knows a call only if the case made
        // it (the kit's answers are shared to spare the endpoint, not to answer for calls
        // this case never made).
        let made = shared
            .case
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains_key(&slot);
        return match &shared.slot(&slot).lock().await.answer {
            Some((status, body)) if made => (status_code(*status), body.clone()),
            _ => (StatusCode::NOT_FOUND, String::new()),
        };
    }
    // Seen to in a task of its own: when the client goes away mid-request (a killed run's
    // call), the server drops this handler, but a forward already sent may have acted, so
    // it runs on to its answer, and the answer is kept.
    match tokio::spawn(forward_once(shared, slot, request)).await {
        Ok(answer) => answer,
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("the simulator failed: {e}"),
        ),
    }
}

/// The key's kept answer, or the request forwarded and its final answer kept. The key's
/// lock is held until then: a request of the key meanwhile (a killed run's call still in
/// flight while its recovery makes it again) waits, and gets that answer.
async fn forward_once(shared: Arc<Shared>, slot: Slot, request: Request) -> (StatusCode, String) {
    let mut answered = shared.slot(&slot).lock_owned().await;
    {
        let mut case = shared.case.lock().unwrap_or_else(|p| p.into_inner());
        let count = case.entry(slot).or_default();
        count.requests += 1;
        match &answered.body {
            None => answered.body = Some(request.body.clone()),
            Some(first) => count.changed |= *first != request.body,
        }
    }
    if let Some((status, body)) = &answered.answer {
        return (status_code(*status), body.clone());
    }
    answered.forwarded += 1;
    let (status, text) = match scripted(&shared, &request.function, &request.body) {
        Some(result) => {
            shared.scripted.fetch_add(1, Ordering::SeqCst);
            (200, result.to_string())
        }
        None if shared.misses == Misses::Fail => {
            shared.missed.fetch_add(1, Ordering::SeqCst);
            return (
                StatusCode::UNPROCESSABLE_ENTITY,
                format!(
                    "no recorded answer for `{}` with these args, and calls may not go to \
                     their services (--offline)",
                    request.function
                ),
            );
        }
        None => {
            shared.forwarded_live.fetch_add(1, Ordering::SeqCst);
            let function = request.function.clone();
            let args = serde_json::from_slice::<Value>(&request.body).ok();
            let (status, text) = forward(&shared, request).await;
            if (200..300).contains(&status)
                && let Some(args) = args
                && let Some(result) = as_result(&function, &text).await
            {
                (shared.live.lock().unwrap_or_else(|p| p.into_inner())).push(Script {
                    function,
                    args: Some(args),
                    result,
                });
            }
            (status, text)
        }
    };
    if !retryable(status) {
        answered.answer = Some((status, text.clone()));
    }
    (status_code(status), text)
}

/// An endpoint's answer as a script's `result`: JSON as it is, a chat model's stream as its
/// whole completion; else none.
async fn as_result(function: &str, text: &str) -> Option<Value> {
    if let Ok(value) = serde_json::from_str(text) {
        return Some(value);
    }
    let streamed = ["data:", "event:", "id:", ":"]
        .iter()
        .any(|field| text.trim_start().starts_with(field));
    if !streamed {
        return None;
    }
    crate::functions::completion_of_stream(function, text)
        .await
        .ok()
}

fn status_code(status: u16) -> StatusCode {
    StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY)
}

fn scripted<'a>(shared: &'a Shared, function: &str, body: &[u8]) -> Option<&'a Value> {
    let args: Option<Value> = serde_json::from_slice(body).ok();
    let of_function = || shared.scripts.iter().filter(|s| s.function == function);
    of_function()
        .find(|s| s.args.is_some() && s.args == args)
        .or_else(|| of_function().find(|s| s.args.is_none()))
        .map(|s| &s.result)
}

async fn forward(shared: &Shared, request: Request) -> (u16, String) {
    let Request {
        function,
        rest,
        method,
        headers,
        body,
    } = request;
    let Some(upstream) = shared.upstreams.get(&function) else {
        return (
            502,
            format!("no scripted answer and no endpoint for function `{function}`"),
        );
    };
    let url = if rest.is_empty() {
        upstream.clone()
    } else {
        format!("{}/{rest}", upstream.trim_end_matches('/'))
    };
    let mut request = shared.client.request(method, &url).body(body);
    for (header, value) in &headers {
        if header != "host" && header != "content-length" {
            request = request.header(header, value);
        }
    }
    match request.send().await {
        Ok(response) => {
            let status = response.status().as_u16();
            (status, response.text().await.unwrap_or_default())
        }
        Err(e) => (502, format!("{url}: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicU64;

    use super::*;

    /// An endpoint that answers 503, then 429, then 200 with how often it was asked.
    async fn flaky() -> (String, Arc<AtomicU64>) {
        let asked = Arc::new(AtomicU64::new(0));
        let app = Router::new().route(
            "/charge",
            any({
                let asked = Arc::clone(&asked);
                move || async move {
                    match asked.fetch_add(1, Ordering::SeqCst) {
                        0 => (StatusCode::SERVICE_UNAVAILABLE, "later".to_owned()),
                        1 => (StatusCode::TOO_MANY_REQUESTS, "slow down".to_owned()),
                        n => (StatusCode::OK, format!("{{\"asked\":{}}}", n + 1)),
                    }
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        tokio::spawn(async move { axum::serve(listener, app).await });
        (format!("http://{addr}/charge"), asked)
    }

    /// A run killed mid-call drops its connection, and the server drops the request's
    /// handler: the forward already sent goes on, its answer is kept, and the recovery's
    /// request of the key gets it without reaching the endpoint again.
    #[tokio::test]
    async fn a_forward_outlives_the_request_that_went_away() {
        let asked = Arc::new(AtomicU64::new(0));
        let reached = Arc::new(tokio::sync::Notify::new());
        // Closed until the test opens it; then every request passes.
        let release = Arc::new(tokio::sync::Semaphore::new(0));
        let app = Router::new().route(
            "/charge",
            any({
                let (asked, reached, release) = (
                    Arc::clone(&asked),
                    Arc::clone(&reached),
                    Arc::clone(&release),
                );
                move || async move {
                    let n = asked.fetch_add(1, Ordering::SeqCst) + 1;
                    reached.notify_one();
                    let _open = release.acquire().await;
                    format!("{{\"charged\":{n}}}")
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        tokio::spawn(async move { axum::serve(listener, app).await });
        let shared = Arc::new(Shared {
            upstreams: BTreeMap::from([("charge".to_owned(), format!("http://{addr}/charge"))]),
            ..Shared::default()
        });
        let request = || {
            let mut headers = HeaderMap::new();
            headers.insert("idempotency-key", "rw-1".parse().expect("header"));
            Request {
                function: "charge".to_owned(),
                rest: String::new(),
                method: Method::POST,
                headers,
                body: Bytes::from_static(b"{}"),
            }
        };
        // The killed run: its handler is dropped once the endpoint has the request.
        tokio::select! {
            _ = answer(Arc::clone(&shared), request()) => panic!("answered before release"),
            () = reached.notified() => {}
        }
        release.add_permits(1);
        let (status, body) = answer(Arc::clone(&shared), request()).await;
        assert_eq!(
            (status, body.as_str()),
            (StatusCode::OK, r#"{"charged":1}"#)
        );
        assert_eq!(
            asked.load(Ordering::SeqCst),
            1,
            "the endpoint was asked once"
        );
    }

    #[tokio::test]
    async fn a_key_reaches_the_endpoint_until_it_has_a_final_answer_and_never_after() {
        let (url, asked) = flaky().await;
        let simulator = Simulator::start(BTreeMap::from([("charge".to_owned(), url)]), Vec::new())
            .await
            .expect("starts");
        let client = reqwest::Client::new();
        let send = || async {
            let response = client
                .post(simulator.url("charge"))
                .header("Idempotency-Key", "rw-1")
                .body("{}")
                .send()
                .await
                .expect("answered");
            (
                response.status().as_u16(),
                response.text().await.expect("text"),
            )
        };
        assert_eq!(send().await.0, 503, "a retryable answer is passed on");
        assert_eq!(send().await.0, 429, "and not kept");
        assert_eq!(send().await, (200, "{\"asked\":3}".to_owned()));
        assert_eq!(send().await, (200, "{\"asked\":3}".to_owned()), "kept");
        // The next case: the key's answer is served, the endpoint is not asked again.
        simulator.reset();
        assert_eq!(send().await, (200, "{\"asked\":3}".to_owned()));
        assert_eq!(asked.load(Ordering::SeqCst), 3);
        assert_eq!(
            simulator.keys(),
            BTreeMap::from([(("charge".to_owned(), "rw-1".to_owned()), 1)]),
            "the case's own requests"
        );
        assert_eq!(
            simulator.forwarded().await["charge"],
            Forwarded {
                keys: 1,
                forwarded: 3
            }
        );
    }
}
