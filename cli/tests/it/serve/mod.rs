//! `rewind serve` (issue #6): tenants, deploys, events, outputs, quotas, isolation.

mod auth;
mod deploy;
mod events;
mod functions;
mod fuzz;
mod hostile;
mod load;
mod openapi;
mod paths;
mod quotas;
mod restart;
mod tls;
mod uploads;
mod waits;
mod wedge;
mod writers;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::http::HeaderMap;
use reqwest::StatusCode;
use rewind_host::server::{ServerConfig, ServerState};
use serde_json::{Value, json};

use crate::support::{guest, sandbox};

pub const ADMIN: &str = "admin-token-for-the-tests";

/// A server in this process, on an ephemeral port.
pub struct Server {
    pub base: String,
    pub client: reqwest::Client,
    /// Stops it (see [`Server::stop`]).
    shutdown: tokio::sync::oneshot::Sender<()>,
    serving: tokio::task::JoinHandle<std::io::Result<()>>,
    /// The server's state, which holds its state directory's lock until the last of its
    /// holders lets it go.
    state: std::sync::Weak<ServerState>,
}

impl Server {
    /// A server over `state_dir` with `extra` lines at the top of its rewind.toml.
    pub async fn start(state_dir: &Path, extra: &str) -> Self {
        let path = state_dir.join("rewind.toml");
        let config = ServerConfig::parse(
            &path,
            &format!("state-dir = \".\"\n{extra}\n[admin-token]\nenv = \"UNUSED\"\n"),
        )
        .expect("config");
        let state = ServerState::start(config, &path, ADMIN, sandbox())
            .await
            .expect("the server starts");
        let scheme = state.scheme();
        let held = Arc::downgrade(&state);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (shutdown, stopped) = tokio::sync::oneshot::channel::<()>();
        // Only `stop` stops it: a `Server` dropped leaves it serving to the test's end.
        let serving = tokio::spawn(rewind_host::server::serve(listener, state, async {
            if stopped.await.is_err() {
                std::future::pending::<()>().await;
            }
        }));
        Self {
            base: format!("{scheme}://{addr}"),
            client: reqwest::Client::new(),
            shutdown,
            serving,
            state: held,
        }
    }

    /// Stops the server as a signal would, and waits until it has let go of its state
    /// directory, for another to start on it: `serve` returns once its connections are
    /// closed, but a connection's task may still be dropping its clone of the router (and
    /// so of the state, which holds the directory's lock) on another thread.
    pub async fn stop(self) {
        let _ = self.shutdown.send(());
        self.serving
            .await
            .expect("the server's task")
            .expect("the server stopped cleanly");
        let started = Instant::now();
        while self.state.strong_count() > 0 {
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "the server's state is still held a minute after it stopped"
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// Creates `tenant`; its token.
    pub async fn tenant(&self, tenant: &str) -> String {
        create(&self.client, &self.base, tenant).await
    }

    /// Uploads test guest `guest_name` as component `name`.
    pub async fn upload(&self, tenant: &str, token: &str, name: &str, guest_name: &str) {
        let wasm = std::fs::read(guest(guest_name)).expect("the guest is built");
        let (status, body) = send(
            self.client
                .put(self.url(&format!("/v1/tenants/{tenant}/components/{name}")))
                .body(wasm),
            Some(token),
        )
        .await;
        assert_eq!(status, StatusCode::CREATED, "{body}");
    }

    pub async fn define(&self, tenant: &str, token: &str, toml: &str) -> (StatusCode, Value) {
        send(
            self.client
                .post(self.url(&format!("/v1/tenants/{tenant}/agents")))
                .body(toml.to_owned()),
            Some(token),
        )
        .await
    }

    /// Uploads `guest_name` as `worker` and defines agent `name` with one action running
    /// it; `extra` goes after the action (functions, limits).
    pub async fn deploy(
        &self,
        tenant: &str,
        token: &str,
        name: &str,
        guest_name: &str,
        extra: &str,
    ) {
        self.upload(tenant, token, "worker", guest_name).await;
        let (status, body) = self
            .define(tenant, token, &agent(name, "worker", extra))
            .await;
        assert_eq!(status, StatusCode::CREATED, "{body}");
    }

    pub async fn submit(
        &self,
        tenant: &str,
        token: &str,
        agent: &str,
        id: &str,
        key: &str,
        payload: Value,
    ) -> (StatusCode, Value) {
        send(
            self.client
                .post(self.url(&format!("/v1/tenants/{tenant}/agents/{agent}/events")))
                .json(&json!({ "id": id, "key": key, "payload": payload })),
            Some(token),
        )
        .await
    }

    pub async fn outputs(&self, tenant: &str, token: &str, after: u64) -> Vec<Value> {
        outputs(&self.client, &self.base, tenant, token, after).await
    }

    /// Waits for `n` outputs of `tenant` (60 s at most), then a moment more for any extra.
    pub async fn wait_outputs(&self, tenant: &str, token: &str, n: usize) -> Vec<Value> {
        wait_outputs(&self.client, &self.base, tenant, token, n).await
    }

    pub async fn history(
        &self,
        tenant: &str,
        token: &str,
        agent: &str,
        key: &str,
    ) -> (StatusCode, Value) {
        send(
            self.client.get(self.url(&format!(
                "/v1/tenants/{tenant}/agents/{agent}/keys/{key}/history"
            ))),
            Some(token),
        )
        .await
    }

    /// Skips the key's parked input `sequence`, saying `reason`.
    pub async fn skip(
        &self,
        tenant: &str,
        token: &str,
        agent: &str,
        key: &str,
        sequence: u64,
        reason: &str,
    ) -> (StatusCode, Value) {
        let body = json!({ "reason": reason });
        let path = format!("{tenant}/agents/{agent}/keys/{key}/inputs/{sequence}/skip");
        self.command(token, &path, Some(body)).await
    }

    /// Retries the key's parked input `sequence`, with `body` (a version) when given.
    pub async fn retry(
        &self,
        tenant: &str,
        token: &str,
        agent: &str,
        key: &str,
        sequence: u64,
        body: Option<Value>,
    ) -> (StatusCode, Value) {
        let path = format!("{tenant}/agents/{agent}/keys/{key}/inputs/{sequence}/retry");
        self.command(token, &path, body).await
    }

    /// Cancels the key's input `sequence`, saying why.
    pub async fn cancel(
        &self,
        tenant: &str,
        token: &str,
        agent: &str,
        key: &str,
        sequence: u64,
        reason: &str,
    ) -> (StatusCode, Value) {
        let path = format!("{tenant}/agents/{agent}/keys/{key}/inputs/{sequence}/cancel");
        self.command(token, &path, Some(json!({ "reason": reason })))
            .await
    }

    /// Answers call `call` of the key's parked input `sequence` with `body`.
    #[allow(clippy::too_many_arguments)]
    pub async fn resolve(
        &self,
        tenant: &str,
        token: &str,
        agent: &str,
        key: &str,
        sequence: u64,
        call: usize,
        body: Value,
    ) -> (StatusCode, Value) {
        let path =
            format!("{tenant}/agents/{agent}/keys/{key}/inputs/{sequence}/calls/{call}/resolve");
        self.command(token, &path, Some(body)).await
    }

    /// POSTs an operator's command to `/v1/tenants/{path}`.
    async fn command(&self, token: &str, path: &str, body: Option<Value>) -> (StatusCode, Value) {
        let request = self.client.post(self.url(&format!("/v1/tenants/{path}")));
        let request = match body {
            Some(body) => request.json(&body),
            None => request,
        };
        send(request, Some(token)).await
    }

    /// The agent's inputs at the head of their keys with `status`.
    pub async fn inputs(&self, tenant: &str, token: &str, agent: &str, status: &str) -> Value {
        let (code, body) = send(
            self.client.get(self.url(&format!(
                "/v1/tenants/{tenant}/agents/{agent}/inputs?status={status}"
            ))),
            Some(token),
        )
        .await;
        assert_eq!(code, StatusCode::OK, "{body}");
        body
    }

    /// Waits until no input of the key runs or waits to retry, and every input still
    /// accepted waits behind a parked one; its history.
    pub async fn settled_history(
        &self,
        tenant: &str,
        token: &str,
        agent: &str,
        key: &str,
    ) -> Value {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let (status, body) = self.history(tenant, token, agent, key).await;
            assert_eq!(status, StatusCode::OK, "{body}");
            let settled = body["inputs"]
                .as_array()
                .is_some_and(|inputs| settled(inputs));
            if settled {
                return body;
            }
            assert!(Instant::now() < deadline, "not settled: {body}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// The statuses of a key's inputs in its history, in order.
pub fn statuses(history: &Value) -> Vec<String> {
    history["inputs"]
        .as_array()
        .expect("inputs")
        .iter()
        .filter_map(|i| i["status"].as_str().map(str::to_owned))
        .collect()
}

/// Whether a key's inputs are settled: none runs or waits to retry, and those accepted wait
/// behind a parked one.
fn settled(inputs: &[Value]) -> bool {
    let mut parked = false;
    inputs.iter().all(|input| match input["status"].as_str() {
        Some("done" | "skipped" | "cancelled" | "failed") => true,
        Some("parked") => {
            parked = true;
            true
        }
        Some("accepted") => parked,
        _ => false,
    })
}

/// An agent.toml with one action `work` on inputs, running component `component`; `extra`
/// goes after the action. Unless `extra` sets `[retry]`, an input that fails is parked at
/// once (one attempt), so that tests of failures need not wait out backoffs.
pub fn agent(name: &str, component: &str, extra: &str) -> String {
    let retry = if extra.contains("[retry]") {
        ""
    } else {
        "\n[retry]\nattempts = 1\n"
    };
    format!(
        "name = \"{name}\"\n\n[[actions]]\nname = \"work\"\ncomponent = \"{component}\"\non = [\"input\"]\n{extra}{retry}"
    )
}

pub async fn send(request: reqwest::RequestBuilder, token: Option<&str>) -> (StatusCode, Value) {
    let request = match token {
        Some(token) => request.bearer_auth(token),
        None => request,
    };
    let response = request.send().await.expect("the server answers");
    let status = response.status();
    let body = response.json().await.unwrap_or(Value::Null);
    (status, body)
}

pub async fn create(client: &reqwest::Client, base: &str, name: &str) -> String {
    let (status, body) = send(
        client
            .post(format!("{base}/v1/tenants"))
            .json(&json!({ "name": name })),
        Some(ADMIN),
    )
    .await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    body["token"].as_str().expect("a token").to_owned()
}

pub async fn outputs(
    client: &reqwest::Client,
    base: &str,
    tenant: &str,
    token: &str,
    after: u64,
) -> Vec<Value> {
    let (status, body) = send(
        client.get(format!("{base}/v1/tenants/{tenant}/outputs?after={after}")),
        Some(token),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    body["outputs"].as_array().cloned().unwrap_or_default()
}

pub async fn wait_outputs(
    client: &reqwest::Client,
    base: &str,
    tenant: &str,
    token: &str,
    n: usize,
) -> Vec<Value> {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut all = Vec::new();
    loop {
        let after = all
            .last()
            .and_then(|o: &Value| o["position"].as_u64())
            .unwrap_or(0);
        let more = outputs(client, base, tenant, token, after).await;
        let got = more.is_empty();
        all.extend(more);
        if all.len() >= n {
            // Anything written twice would show up now.
            tokio::time::sleep(Duration::from_millis(100)).await;
            let after = all.last().and_then(|o| o["position"].as_u64()).unwrap_or(0);
            all.extend(outputs(client, base, tenant, token, after).await);
            return all;
        }
        assert!(
            Instant::now() < deadline,
            "{tenant}: {} of {n} outputs after 60 s",
            all.len()
        );
        if got {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// A function endpoint on loopback: answers every POST with `{"n": <count>}` after `delay`
/// (a gated one: once [`open`](Self::open)ed for it), and keeps each request's headers;
/// `/hop` redirects to `hop_to`.
#[derive(Clone, Default)]
pub struct Endpoint {
    pub requests: Arc<Mutex<Vec<BTreeMap<String, String>>>>,
    running: Arc<AtomicUsize>,
    pub most_at_once: Arc<AtomicUsize>,
    gate: Option<Arc<tokio::sync::Semaphore>>,
}

impl Endpoint {
    pub async fn start(delay: Duration, hop_to: &str) -> (SocketAddr, Self) {
        Self::serve(Self::default(), delay, hop_to, "127.0.0.1:0").await
    }

    /// [`start`](Self::start) without delay, listening on `at`.
    pub async fn start_at(at: &str) -> (SocketAddr, Self) {
        Self::serve(Self::default(), Duration::ZERO, "", at).await
    }

    /// An endpoint that answers a request only once the test opens the gate for it.
    pub async fn gated() -> (SocketAddr, Self) {
        Self::gated_at("127.0.0.1:0").await
    }

    /// [`gated`](Self::gated), listening on `at`.
    pub async fn gated_at(at: &str) -> (SocketAddr, Self) {
        let endpoint = Self {
            gate: Some(Arc::new(tokio::sync::Semaphore::new(0))),
            ..Self::default()
        };
        Self::serve(endpoint, Duration::ZERO, "", at).await
    }

    /// Lets `n` more requests of a gated endpoint be answered.
    pub fn open(&self, n: usize) {
        self.gate.as_ref().expect("a gated endpoint").add_permits(n);
    }

    async fn serve(endpoint: Self, delay: Duration, hop_to: &str, at: &str) -> (SocketAddr, Self) {
        let seen = endpoint.clone();
        let hop_to = hop_to.to_owned();
        let app = axum::Router::new()
            .route(
                "/hop",
                axum::routing::post(move || {
                    let hop_to = hop_to.clone();
                    async move { axum::response::Redirect::temporary(&hop_to) }
                }),
            )
            .fallback(move |headers: HeaderMap| {
                let seen = seen.clone();
                async move {
                    let now = seen.running.fetch_add(1, Ordering::SeqCst) + 1;
                    seen.most_at_once.fetch_max(now, Ordering::SeqCst);
                    let n = {
                        let mut requests = seen.requests.lock().expect("lock");
                        requests.push(
                            headers
                                .iter()
                                .map(|(k, v)| {
                                    (k.to_string(), v.to_str().unwrap_or_default().to_owned())
                                })
                                .collect(),
                        );
                        requests.len()
                    };
                    tokio::time::sleep(delay).await;
                    if let Some(gate) = &seen.gate {
                        gate.acquire().await.expect("the gate stays").forget();
                    }
                    seen.running.fetch_sub(1, Ordering::SeqCst);
                    axum::Json(json!({ "n": n }))
                }
            });
        let listener = tokio::net::TcpListener::bind(at).await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        tokio::spawn(async move { axum::serve(listener, app).await });
        (addr, endpoint)
    }

    pub fn count(&self) -> usize {
        self.requests.lock().expect("lock").len()
    }

    /// The idempotency keys of the requests, in order.
    pub fn keys(&self) -> Vec<String> {
        self.requests
            .lock()
            .expect("lock")
            .iter()
            .filter_map(|h| h.get("idempotency-key").cloned())
            .collect()
    }
}

/// A caller script that makes one call of `function`.
pub fn one_call(function: &str) -> Value {
    json!({ "calls": [{ "function": function }] })
}

/// `rewind serve` run as a process of its own; SIGKILLed when dropped, so that a test that
/// fails leaves no server behind.
pub struct Process {
    pub child: std::process::Child,
    pub base: String,
    /// What it wrote to stderr, line by line.
    log: Arc<Mutex<Vec<String>>>,
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Process {
    /// Starts `rewind serve --config CONFIG`, with `crash` armed (`--crash-at`, a test
    /// hook of the tests' build), and waits until it listens.
    pub fn start(config: &Path, crash: Option<&str>) -> Self {
        use std::io::BufRead as _;
        let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_rewind"));
        command
            .args(["serve", "--config"])
            .arg(config)
            .env_remove(rewind_host::crash::ENV)
            .stderr(std::process::Stdio::piped());
        if let Some(crash) = crash {
            command.args(["--crash-at", crash]);
        }
        let mut child = command.spawn().expect("rewind serve starts");
        let mut stderr = std::io::BufReader::new(child.stderr.take().expect("stderr"));
        let mut said = Vec::new();
        let mut base = None;
        for line in (&mut stderr).lines() {
            let line = line.expect("a line");
            if let Some(url) = line.strip_prefix("rewind serve: listening on ") {
                base = Some(url.to_owned());
                break;
            }
            said.push(line);
        }
        let base = base.unwrap_or_else(|| panic!("the server did not start: {said:#?}"));
        // Keep reading, so that the server never blocks on a full pipe.
        let log = Arc::new(Mutex::new(said));
        let kept = Arc::clone(&log);
        std::thread::spawn(move || {
            for line in stderr.lines().map_while(Result::ok) {
                kept.lock().expect("lock").push(line);
            }
        });
        Self { child, base, log }
    }

    /// The lines it wrote to stderr so far.
    pub fn log(&self) -> Vec<String> {
        self.log.lock().expect("lock").clone()
    }

    /// A field of its /proc/PID/status, in KiB (`VmRSS`: resident now, `VmHWM`: at most).
    pub fn memory_kib(&self, field: &str) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .expect("the server's /proc entry");
        status
            .lines()
            .find_map(|line| line.strip_prefix(field)?.strip_prefix(':'))
            .and_then(|value| value.trim().strip_suffix("kB"))
            .and_then(|kib| kib.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {field} in {status}"))
    }
}

/// The rewind.toml of a server run as a process.
pub fn write_config(dir: &Path, extra: &str) -> PathBuf {
    std::fs::write(dir.join("admin.token"), format!("{ADMIN}\n")).expect("token");
    let path = dir.join("rewind.toml");
    std::fs::write(
        &path,
        format!("listen = \"127.0.0.1:0\"\n{extra}\n[admin-token]\nfile = \"admin.token\"\n"),
    )
    .expect("config");
    path
}
