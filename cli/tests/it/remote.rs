//! A remote for tests that kill hosts: it honours `Idempotency-Key` and answers reconcile
//! requests, and counts what reached it.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::{get, post};
use serde_json::{Value, json};

/// A remote that honours `Idempotency-Key`: the first request of a key has its effect (and
/// is counted), a repeat gets the stored answer and has none.
#[derive(Clone, Default)]
pub struct Remote {
    pub effects: Arc<Mutex<BTreeMap<String, Value>>>,
    pub requests: Arc<Mutex<BTreeMap<String, u64>>>,
    /// `(n, pid)`: SIGKILL process `pid` while serving the `n`th request (counted from 1),
    /// after the effect and before the answer.
    pub kill_during: Arc<Mutex<Option<(u64, u32)>>>,
    /// `(n, pid)`: SIGSTOP process `pid` while serving the `n`th request, after the effect;
    /// the answer follows as usual (it waits in the socket until the process goes on).
    pub pause_during: Arc<Mutex<Option<(u64, u32)>>>,
    /// Reconcile requests: what became of a key's charge.
    pub asks: Arc<Mutex<u64>>,
    /// How long a charge takes to answer, beyond the usual 3 ms.
    pub slow: Arc<Mutex<Duration>>,
}

impl Remote {
    pub fn keys(&self) -> BTreeSet<String> {
        self.effects.lock().expect("lock").keys().cloned().collect()
    }

    /// Requests beyond the first, over all idempotency keys.
    pub fn repeats(&self) -> u64 {
        self.requests
            .lock()
            .expect("lock")
            .values()
            .map(|n| n - 1)
            .sum()
    }

    pub fn total(&self) -> u64 {
        self.requests.lock().expect("lock").values().sum()
    }
}

/// Serves `remote` on loopback; returns the URL of its `/charge` endpoint (reconcile at
/// `/charge/status`).
pub async fn serve(remote: Remote) -> String {
    let app = Router::new()
        .route(
            "/charge",
            post(|State(remote): State<Remote>, headers: HeaderMap, body: String| async move {
                let key = headers
                    .get("idempotency-key")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or_default()
                    .to_owned();
                *remote.requests.lock().expect("lock").entry(key.clone()).or_default() += 1;
                let answer = remote
                    .effects
                    .lock()
                    .expect("lock")
                    .entry(key)
                    .or_insert_with(|| json!({ "charged": serde_json::from_str::<Value>(&body).unwrap_or_default() }))
                    .clone();
                let total = remote.total();
                let kill = remote.kill_during.lock().expect("lock").take_if(|(n, _)| *n == total);
                if let Some((_, pid)) = kill {
                    let pid = rustix::process::Pid::from_raw(pid.cast_signed()).expect("a pid");
                    rustix::process::kill_process(pid, rustix::process::Signal::KILL).expect("SIGKILL");
                    std::future::pending::<()>().await;
                }
                let pause = remote.pause_during.lock().expect("lock").take_if(|(n, _)| *n == total);
                if let Some((_, pid)) = pause {
                    let pid = rustix::process::Pid::from_raw(pid.cast_signed()).expect("a pid");
                    rustix::process::kill_process(pid, rustix::process::Signal::STOP).expect("SIGSTOP");
                }
                // Slow enough that kills often land while a call is in flight.
                let slow = *remote.slow.lock().expect("lock");
                tokio::time::sleep(Duration::from_millis(3) + slow).await;
                axum::Json(answer)
            }),
        )
        .route(
            "/charge/status",
            get(|State(remote): State<Remote>, headers: HeaderMap| async move {
                *remote.asks.lock().expect("lock") += 1;
                let key = headers
                    .get("idempotency-key")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or_default();
                match remote.effects.lock().expect("lock").get(key) {
                    Some(answer) => (StatusCode::OK, answer.to_string()),
                    None => (StatusCode::NOT_FOUND, String::new()),
                }
            }),
        )
        .with_state(remote);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}/charge")
}
