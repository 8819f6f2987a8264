//! The functions of an agent under test, simulated on loopback: scripted answers, or the
//! function's own endpoint asked once per idempotency key, and every request counted.
//!
//! Every `http` and `openai-chat` function of the agent is pointed here
//! (`/fn/NAME/...`). The simulator honours `Idempotency-Key` as a well-behaved remote does:
//! the first request of a key gets an answer (scripted, or from the upstream endpoint),
//! later requests of that key get the same answer and reach nothing. `GET
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
use serde::Deserialize;
use serde_json::Value;

/// One scripted answer: `{"function": NAME, "args": {...}, "result": {...}}`. Without
/// `args` it answers every call of the function that no entry with `args` matches.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Script {
    pub function: String,
    #[serde(default)]
    pub args: Option<Value>,
    pub result: Value,
}

/// Reads a JSONL file of [`Script`] lines; an error names the line.
pub fn read_scripts(path: &std::path::Path) -> anyhow::Result<Vec<Script>> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| anyhow::anyhow!("reading {}: {e}", path.display()))?;
    let mut scripts = Vec::new();
    for (number, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let script = serde_json::from_str(line).map_err(|e| {
            anyhow::anyhow!(
                "{}:{}: not a scripted answer: {e}",
                path.display(),
                number + 1
            )
        })?;
        scripts.push(script);
    }
    Ok(scripts)
}

/// What one idempotency key of one function saw.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct KeyCount {
    /// Requests that carried the key.
    requests: u64,
    /// The answer its first request got, when it took effect (not 5xx).
    answer: Option<(u16, String)>,
    /// The body of its first request.
    body: Option<Bytes>,
    /// A later request carried another body.
    changed: bool,
}

#[derive(Debug, Default)]
struct Shared {
    /// Function name to the URL its requests go to when no script answers.
    upstreams: BTreeMap<String, String>,
    scripts: Vec<Script>,
    client: reqwest::Client,
    keys: Mutex<BTreeMap<(String, String), KeyCount>>,
    asks: AtomicU64,
}

/// A running simulator.
#[derive(Debug)]
pub struct Simulator {
    base: String,
    shared: Arc<Shared>,
    server: tokio::task::JoinHandle<()>,
}

impl Simulator {
    /// Starts on a free loopback port.
    pub async fn start(
        upstreams: BTreeMap<String, String>,
        scripts: Vec<Script>,
    ) -> anyhow::Result<Self> {
        let shared = Arc::new(Shared {
            upstreams,
            scripts,
            ..Shared::default()
        });
        let app = Router::new()
            .route("/fn/{name}", any(handle_root))
            .route("/fn/{name}/{*rest}", any(handle))
            .with_state(Arc::clone(&shared));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
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

    /// Forgets every key and count: the next run starts afresh.
    pub fn reset(&self) {
        self.shared
            .keys
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
        self.shared.asks.store(0, Ordering::SeqCst);
    }

    /// Requests per (function, idempotency key).
    pub fn keys(&self) -> BTreeMap<(String, String), u64> {
        self.shared
            .keys
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|(key, count)| (key.clone(), count.requests))
            .collect()
    }

    /// The (function, idempotency key) pairs whose requests did not all carry the same
    /// arguments: a call made again that is not the same call.
    pub fn changed(&self) -> Vec<(String, String)> {
        self.shared
            .keys
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter(|(_, count)| count.changed)
            .map(|(key, _)| key.clone())
            .collect()
    }

    /// Reconcile questions answered.
    pub fn asks(&self) -> u64 {
        self.shared.asks.load(Ordering::SeqCst)
    }
}

impl Drop for Simulator {
    fn drop(&mut self) {
        self.server.abort();
    }
}

async fn handle_root(
    state: State<Arc<Shared>>,
    Path(name): Path<String>,
    method: Method,
    headers: HeaderMap,
    body: Bytes,
) -> (StatusCode, String) {
    answer(&state, name, String::new(), method, &headers, body).await
}

async fn handle(
    state: State<Arc<Shared>>,
    Path((name, rest)): Path<(String, String)>,
    method: Method,
    headers: HeaderMap,
    body: Bytes,
) -> (StatusCode, String) {
    answer(&state, name, rest, method, &headers, body).await
}

async fn answer(
    shared: &Shared,
    name: String,
    rest: String,
    method: Method,
    headers: &HeaderMap,
    body: Bytes,
) -> (StatusCode, String) {
    let key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let slot = (name.clone(), key);
    if rest == "~status" {
        shared.asks.fetch_add(1, Ordering::SeqCst);
        let keys = shared.keys.lock().unwrap_or_else(|p| p.into_inner());
        return match keys.get(&slot).and_then(|count| count.answer.clone()) {
            Some((status, body)) => (status_code(status), body),
            None => (StatusCode::NOT_FOUND, String::new()),
        };
    }
    {
        let mut keys = shared.keys.lock().unwrap_or_else(|p| p.into_inner());
        let count = keys.entry(slot.clone()).or_default();
        count.requests += 1;
        match &count.body {
            None => count.body = Some(body.clone()),
            Some(first) => count.changed |= *first != body,
        }
        if let Some((status, body)) = &count.answer {
            return (status_code(*status), body.clone());
        }
    }
    let (status, text) = match scripted(shared, &name, &body) {
        Some(result) => (200, result.to_string()),
        None => forward(shared, &name, &rest, method, headers, body).await,
    };
    if status < 500 {
        let mut keys = shared.keys.lock().unwrap_or_else(|p| p.into_inner());
        keys.entry(slot).or_default().answer = Some((status, text.clone()));
    }
    (status_code(status), text)
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

async fn forward(
    shared: &Shared,
    name: &str,
    rest: &str,
    method: Method,
    headers: &HeaderMap,
    body: Bytes,
) -> (u16, String) {
    let Some(upstream) = shared.upstreams.get(name) else {
        return (
            502,
            format!("no scripted answer and no endpoint for function `{name}`"),
        );
    };
    let url = if rest.is_empty() {
        upstream.clone()
    } else {
        format!("{}/{rest}", upstream.trim_end_matches('/'))
    };
    let mut request = shared.client.request(method, &url).body(body);
    for (header, value) in headers {
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
