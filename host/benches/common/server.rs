//! What the benches of `rewind serve` share: a server in the process on loopback, a client of
//! its API, and its output stream read as server-sent events.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use eventsource_stream::{Event, EventStreamError, Eventsource};
use futures_util::StreamExt;
use futures_util::stream::BoxStream;
use rewind_host::sandbox::Sandbox;
use rewind_host::server::{ServerConfig, ServerState};
use serde_json::{Value, json};
use tokio::sync::oneshot;

pub const ADMIN: &str = "admin-token-for-the-bench";

pub fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
}

/// An empty directory for the bench `name`'s state: under `REWIND_BENCH_DIR` when it is set
/// (a tmpfs there takes the disk out of what is measured), else under `target/`.
pub fn state_dir(name: &str) -> PathBuf {
    let dir = match std::env::var_os("REWIND_BENCH_DIR") {
        Some(parent) => PathBuf::from(parent).join(name),
        None => root().join("target").join(name),
    };
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("the bench's state directory");
    dir
}

/// The release build of the test guest `name`, built by `scripts/guests.sh` if it is not.
pub fn guest(name: &str) -> Vec<u8> {
    let path = root().join(format!(
        "target/guests/wasm32-wasip2/release/guest_{name}.wasm"
    ));
    if !path.exists() {
        let status = std::process::Command::new("bash")
            .arg(root().join("scripts/guests.sh"))
            .status()
            .expect("scripts/guests.sh runs");
        assert!(status.success(), "building the guests failed");
    }
    std::fs::read(&path).expect("the guest is built")
}

/// A server on `dir`, configured by `config` (the TOML after `state-dir`), serving until
/// [`stop`](Self::stop).
pub struct Server {
    pub client: Client,
    stop: oneshot::Sender<()>,
    serving: tokio::task::JoinHandle<()>,
}

impl Server {
    pub async fn start(dir: &Path, config: &str) -> Self {
        let path = dir.join("rewind.toml");
        let text = format!("state-dir = \".\"\n{config}\n[admin-token]\nenv = \"UNUSED\"\n");
        let config = ServerConfig::parse(&path, &text).expect("config");
        let sandbox = Arc::new(
            Sandbox::builder()
                .cache_dir(Some(root().join("target/rewind-bench-cache")))
                .build()
                .expect("sandbox"),
        );
        let state = ServerState::start(config, &path, ADMIN, sandbox)
            .await
            .expect("the server starts");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let base = format!("http://{}", listener.local_addr().expect("addr"));
        let (stop, stopped) = oneshot::channel::<()>();
        let serving = tokio::spawn(async move {
            rewind_host::server::serve(listener, state, async {
                let _ = stopped.await;
            })
            .await
            .expect("the server stops cleanly");
        });
        let client = Client {
            http: reqwest::Client::new(),
            base,
        };
        Self {
            client,
            stop,
            serving,
        }
    }

    pub async fn stop(self) {
        let _ = self.stop.send(());
        self.serving.await.expect("the server's task");
    }
}

/// A client of a server's API.
#[derive(Clone)]
pub struct Client {
    pub http: reqwest::Client,
    pub base: String,
}

impl Client {
    pub async fn send(&self, request: reqwest::RequestBuilder, token: &str) -> (u16, Value) {
        let response = request.bearer_auth(token).send().await.expect("answers");
        let status = response.status().as_u16();
        (status, response.json().await.unwrap_or(Value::Null))
    }

    /// Creates the tenant `name`; its token.
    pub async fn tenant(&self, name: &str) -> String {
        let (status, body) = self
            .send(
                self.http
                    .post(format!("{}/v1/tenants", self.base))
                    .json(&json!({ "name": name })),
                ADMIN,
            )
            .await;
        assert_eq!(status, 201, "{body}");
        body["token"].as_str().expect("token").to_owned()
    }

    /// Uploads `component` as `worker` and defines the agent `bot`: one action on `input`
    /// events, with `extra` after it in agent.toml.
    pub async fn deploy(&self, tenant: &str, token: &str, component: Vec<u8>, extra: &str) {
        let (status, body) = self
            .send(
                self.http
                    .put(format!(
                        "{}/v1/tenants/{tenant}/components/worker",
                        self.base
                    ))
                    .body(component),
                token,
            )
            .await;
        assert_eq!(status, 201, "{body}");
        let toml = format!(
            "name = \"bot\"\n[[actions]]\nname = \"work\"\ncomponent = \"worker\"\n\
             on = [\"input\"]\n{extra}"
        );
        let (status, body) = self
            .send(
                self.http
                    .post(format!("{}/v1/tenants/{tenant}/agents", self.base))
                    .body(toml),
                token,
            )
            .await;
        assert_eq!(status, 201, "{body}");
    }

    /// Submits an event to `tenant`'s agent `bot`; the status and body of the answer.
    pub async fn submit(
        &self,
        tenant: &str,
        token: &str,
        id: &str,
        key: &str,
        payload: Value,
    ) -> (u16, Value) {
        self.send(
            self.http
                .post(format!(
                    "{}/v1/tenants/{tenant}/agents/bot/events",
                    self.base
                ))
                .json(&json!({ "id": id, "key": key, "payload": payload })),
            token,
        )
        .await
    }

    /// `tenant`'s output stream, from the output after `after`.
    pub async fn outputs(&self, tenant: &str, token: &str, after: u64) -> Outputs {
        let response = self
            .http
            .get(format!(
                "{}/v1/tenants/{tenant}/outputs/stream?after={after}",
                self.base
            ))
            .bearer_auth(token)
            .send()
            .await
            .expect("the stream opens");
        assert_eq!(response.status().as_u16(), 200);
        Outputs(response.bytes_stream().eventsource().boxed())
    }
}

/// A tenant's outputs as they arrive.
pub struct Outputs(BoxStream<'static, Result<Event, EventStreamError<reqwest::Error>>>);

impl Outputs {
    /// The next output (its JSON); keep-alive comments and other events are passed over.
    pub async fn next(&mut self) -> Value {
        loop {
            let event = tokio::time::timeout(Duration::from_secs(600), self.0.next())
                .await
                .expect("an output within 10 minutes")
                .expect("the stream stays open")
                .expect("the stream reads");
            if event.event == "output" {
                return serde_json::from_str(&event.data).expect("an output is JSON");
            }
        }
    }
}

/// The `percent`-th percentile of `sorted`.
pub fn quantile(sorted: &[Duration], percent: usize) -> Duration {
    sorted[(sorted.len() - 1) * percent / 100]
}
