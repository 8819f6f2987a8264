//! `rewind serve` end to end, and its restart: one tenant's events over 64 keys, submitted
//! over HTTP, each answered by an output on the tenant's stream; then the server stopped and
//! started again on its state, timed until the tenant answers (its journal recovered).
//!
//! `cargo bench -p rewind-host --bench serve [-- INPUTS]` (default 100,000 inputs); results
//! in BENCHMARKS.md. A bench binary (not criterion): each figure is one measured run.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rewind_host::sandbox::Sandbox;
use rewind_host::server::{ServerConfig, ServerState};
use serde_json::{Value, json};
use tokio::sync::oneshot;

// For the allocator the `rewind` binary runs with; no helper of it is used here.
#[allow(dead_code)]
mod common;

const ADMIN: &str = "admin-token-for-the-bench";
const KEYS: u64 = 64;
/// Submissions in flight at once (one per key).
const IN_FLIGHT: u64 = KEYS;
/// Events measured one at a time.
const SAMPLES: u64 = 500;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
}

/// A server on `dir`, serving until the sender is dropped or sent to.
async fn start(dir: &Path) -> (String, oneshot::Sender<()>, tokio::task::JoinHandle<()>) {
    let path = dir.join("rewind.toml");
    let config = ServerConfig::parse(
        &path,
        "state-dir = \".\"\n[tenants.acme.quotas]\nconcurrent-runs = 4\nqueued-inputs = 100000\n\
         calls-per-minute = 100000000\nstored-bytes = 100000000000\n\
         [admin-token]\nenv = \"UNUSED\"\n",
    )
    .expect("config");
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
    (base, stop, serving)
}

async fn send(request: reqwest::RequestBuilder, token: &str) -> (u16, Value) {
    let response = request.bearer_auth(token).send().await.expect("answers");
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
}

/// Reads the output stream until `n` outputs came; the time each came, by event id.
async fn read_outputs(mut stream: reqwest::Response, n: u64) -> Vec<(String, Instant)> {
    let mut buffer = String::new();
    let mut seen = Vec::new();
    while (seen.len() as u64) < n {
        if let Some(end) = buffer.find("\n\n") {
            let block: String = buffer.drain(..end + 2).collect();
            let data = block.lines().find_map(|l| l.strip_prefix("data:"));
            if let Some(output) = data.and_then(|d| serde_json::from_str::<Value>(d.trim()).ok()) {
                let id = output["event_id"].as_str().unwrap_or_default().to_owned();
                seen.push((id, Instant::now()));
            }
            continue;
        }
        let chunk = stream
            .chunk()
            .await
            .expect("the stream reads")
            .expect("the stream stays open");
        buffer.push_str(&String::from_utf8_lossy(&chunk));
    }
    seen
}

fn quantile(sorted: &[Duration], percent: usize) -> Duration {
    sorted[(sorted.len() - 1) * percent / 100]
}

fn main() {
    let inputs: u64 = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(100_000);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let dir = root().join("target/rewind-bench-serve");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("bench dir");
    runtime.block_on(async {
        let http = reqwest::Client::new();
        let (base, stop, serving) = start(&dir).await;
        let (status, body) = send(
            http.post(format!("{base}/v1/tenants"))
                .json(&json!({ "name": "acme" })),
            ADMIN,
        )
        .await;
        assert_eq!(status, 201, "{body}");
        let token = body["token"].as_str().expect("token").to_owned();
        let guest = root().join("target/guests/wasm32-wasip2/release/guest_caller.wasm");
        let wasm = std::fs::read(&guest).expect("the guests are built (scripts/guests.sh)");
        let (status, body) = send(
            http.put(format!("{base}/v1/tenants/acme/components/worker"))
                .body(wasm),
            &token,
        )
        .await;
        assert_eq!(status, 201, "{body}");
        let toml = "name = \"bot\"\n[[actions]]\nname = \"work\"\ncomponent = \"worker\"\non = [\"input\"]\n";
        let (status, body) = send(
            http.post(format!("{base}/v1/tenants/acme/agents"))
                .body(toml),
            &token,
        )
        .await;
        assert_eq!(status, 201, "{body}");

        let stream = http
            .get(format!("{base}/v1/tenants/acme/outputs/stream"))
            .bearer_auth(&token)
            .send()
            .await
            .expect("the stream opens");
        let reader = tokio::spawn(read_outputs(stream, inputs));
        let started = Instant::now();
        let mut submitters = tokio::task::JoinSet::new();
        for lane in 0..IN_FLIGHT {
            let (http, base, token) = (http.clone(), base.clone(), token.clone());
            submitters.spawn(async move {
                let mut submitted = Vec::new();
                let mut i = lane;
                while i < inputs {
                    let id = format!("e{i}");
                    let at = Instant::now();
                    let (status, body) = send(
                        http.post(format!("{base}/v1/tenants/acme/agents/bot/events"))
                            .json(&json!({ "id": id, "key": format!("k{}", i % KEYS), "payload": { "memory_set": { "n": i } } })),
                        &token,
                    )
                    .await;
                    assert_eq!(status, 202, "{body}");
                    submitted.push((id, at));
                    i += IN_FLIGHT;
                }
                submitted
            });
        }
        let mut submitted = std::collections::HashMap::new();
        while let Some(lane) = submitters.join_next().await {
            submitted.extend(lane.expect("a lane"));
        }
        let outputs = reader.await.expect("the reader");
        let elapsed = started.elapsed();
        let mut latencies: Vec<Duration> = outputs
            .iter()
            .filter_map(|(id, at)| submitted.get(id).map(|s| at.duration_since(*s)))
            .collect();
        latencies.sort();
        println!(
            "end to end, {inputs} inputs over {KEYS} keys ({IN_FLIGHT} submissions in flight): \
             {:.0} inputs/s; submit -> output p50 {:.2?}, p99 {:.2?} (saturated: the queue \
             grows)",
            inputs as f64 / elapsed.as_secs_f64(),
            quantile(&latencies, 50),
            quantile(&latencies, 99)
        );

        // One at a time: the latency of an event on a server that is not queueing.
        let stream = http
            .get(format!("{base}/v1/tenants/acme/outputs/stream?after={inputs}"))
            .bearer_auth(&token)
            .send()
            .await
            .expect("the stream opens");
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let reader = tokio::spawn(async move {
            let mut stream = stream;
            let mut buffer = String::new();
            loop {
                if let Some(end) = buffer.find("\n\n") {
                    let block: String = buffer.drain(..end + 2).collect();
                    if block.lines().any(|l| l.starts_with("data:")) && tx.send(Instant::now()).is_err() {
                        return;
                    }
                    continue;
                }
                match stream.chunk().await {
                    Ok(Some(chunk)) => buffer.push_str(&String::from_utf8_lossy(&chunk)),
                    _ => return,
                }
            }
        });
        let mut one_at_a_time = Vec::new();
        for i in 0..SAMPLES {
            let at = Instant::now();
            let (status, body) = send(
                http.post(format!("{base}/v1/tenants/acme/agents/bot/events"))
                    .json(&json!({ "id": format!("l{i}"), "key": format!("k{}", i % KEYS), "payload": {} })),
                &token,
            )
            .await;
            assert_eq!(status, 202, "{body}");
            let came = rx.recv().await.expect("an output");
            one_at_a_time.push(came.duration_since(at));
        }
        reader.abort();
        one_at_a_time.sort();
        println!(
            "one at a time, {SAMPLES} events: submit -> output p50 {:.2?}, p99 {:.2?}",
            quantile(&one_at_a_time, 50),
            quantile(&one_at_a_time, 99)
        );

        let _ = stop.send(());
        serving.await.expect("the server's task");
        // The first restart after the run: from the snapshot the server keeps in the
        // background (every 30 s), then the records after it. The second: from the
        // snapshot the first left at its end.
        for restart in ["first", "second"] {
            let journal: u64 = walk(&dir.join("tenants"))
                .iter()
                .map(|p| p.metadata().map_or(0, |m| m.len()))
                .sum();
            let restarted = Instant::now();
            let (base, stop, serving) = start(&dir).await;
            let (status, body) = send(
                http.get(format!("{base}/v1/tenants/acme/agents/bot/keys/k0/history?limit=1")),
                &token,
            )
            .await;
            assert_eq!(status, 200, "{body}");
            println!(
                "{restart} restart with {} finished inputs ({:.1} MB under the tenant): {:.2?} \
                 until the tenant answers",
                inputs + SAMPLES,
                journal as f64 / 1e6,
                restarted.elapsed()
            );
            let _ = stop.send(());
            serving.await.expect("the server's task");
        }
    });
}

fn walk(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.is_dir() {
            files.extend(walk(&path));
        } else {
            files.push(path);
        }
    }
    files
}
