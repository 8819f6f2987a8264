//! Noisy neighbour: tenant B's event latency (submit → its output arrives on B's stream) on
//! an idle server, then while tenant A floods it with CPU-bound guests, then while A floods
//! it with uploads of distinct components that fail the world check.
//!
//! `cargo bench -p rewind-host --bench tenants`; results and target in BENCHMARKS.md.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use rewind_host::sandbox::Sandbox;
use rewind_host::server::{ServerConfig, ServerState};
use serde_json::{Value, json};

// For the allocator the `rewind` binary runs with; no helper of it is used here.
#[allow(dead_code)]
mod common;

const ADMIN: &str = "admin-token-for-the-bench";
/// B's events measured in each phase.
const SAMPLES: usize = 500;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
}

fn guest(name: &str) -> Vec<u8> {
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

struct Client {
    http: reqwest::Client,
    base: String,
}

impl Client {
    async fn send(&self, request: reqwest::RequestBuilder, token: &str) -> (u16, Value) {
        let response = request.bearer_auth(token).send().await.expect("answers");
        let status = response.status().as_u16();
        (status, response.json().await.unwrap_or(Value::Null))
    }

    async fn tenant(&self, name: &str) -> String {
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

    async fn deploy(&self, tenant: &str, token: &str, guest_name: &str, extra: &str) {
        let (status, body) = self
            .send(
                self.http
                    .put(format!(
                        "{}/v1/tenants/{tenant}/components/worker",
                        self.base
                    ))
                    .body(guest(guest_name)),
                token,
            )
            .await;
        assert_eq!(status, 201, "{body}");
        let toml = format!(
            "name = \"bot\"\n[[actions]]\nname = \"work\"\ncomponent = \"worker\"\non = [\"input\"]\n{extra}"
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

    async fn submit(&self, tenant: &str, token: &str, id: &str, key: &str, payload: Value) -> u16 {
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
        .0
    }
}

/// Reads B's output stream: the event id of each output, as it arrives.
async fn next_output(stream: &mut reqwest::Response, buffer: &mut String) -> String {
    loop {
        if let Some(end) = buffer.find("\n\n") {
            let block: String = buffer.drain(..end + 2).collect();
            let data = block.lines().find_map(|l| l.strip_prefix("data:"));
            if let Some(output) = data.and_then(|d| serde_json::from_str::<Value>(d.trim()).ok()) {
                return output["event_id"].as_str().unwrap_or_default().to_owned();
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
}

/// B's latencies over `SAMPLES` events, one at a time, sorted.
async fn measure_b(
    client: &Client,
    token: &str,
    phase: &str,
    stream: &mut reqwest::Response,
) -> Vec<Duration> {
    let mut buffer = String::new();
    let mut latencies = Vec::with_capacity(SAMPLES);
    for i in 0..SAMPLES {
        let id = format!("{phase}-{i}");
        let started = Instant::now();
        let status = client
            .submit("b", token, &id, &format!("k{}", i % 8), json!(null))
            .await;
        assert_eq!(status, 202);
        loop {
            if next_output(stream, &mut buffer).await == id {
                break;
            }
        }
        latencies.push(started.elapsed());
    }
    latencies.sort();
    latencies
}

/// A component of `functions` functions of some arithmetic each, exporting no `run`: it is
/// compiled whole before the world check refuses it. `tag` makes it distinct (no cache).
fn wrong_world(tag: u64, functions: usize) -> Vec<u8> {
    let mut wat = String::from("(component (core module\n");
    for f in 0..functions {
        wat.push_str(&format!(
            "(func (export \"f{tag}_{f}\") (param i32) (result i32) (local i32)\n\
             (local.set 1 (local.get 0))\n\
             (block (loop\n\
               (local.set 1 (i32.add (i32.mul (local.get 1) (i32.const {f})) (i32.const 7)))\n\
               (local.set 1 (i32.xor (local.get 1) (i32.shr_u (local.get 1) (i32.const 3))))\n\
               (br_if 1 (i32.eqz (local.get 1)))\n\
               (br_if 0 (i32.lt_u (local.get 1) (i32.const 1000)))))\n\
             (local.get 1))\n"
        ));
    }
    wat.push_str("))\n");
    wat.into_bytes()
}

/// The `percent`-th percentile of `sorted`.
fn quantile(sorted: &[Duration], percent: usize) -> Duration {
    sorted[(sorted.len() - 1) * percent / 100]
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let dir = root().join("target/rewind-bench-tenants");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("bench dir");
    runtime.block_on(async {
        let path = dir.join("rewind.toml");
        let config = ServerConfig::parse(
            &path,
            "state-dir = \".\"\n[tenants.a.quotas]\nconcurrent-runs = 4\nqueued-inputs = 64\n\
             calls-per-minute = 1000000\ncompiles-per-minute = 1000000\n\
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
        tokio::spawn(rewind_host::server::serve(
            listener,
            state,
            std::future::pending(),
        ));
        let client = Arc::new(Client {
            http: reqwest::Client::new(),
            base,
        });
        let a = client.tenant("a").await;
        let b = client.tenant("b").await;
        // A's runs each burn 200M fuel (a CPU-bound loop until its budget is spent).
        client
            .deploy("a", &a, "hostile", "[limits]\nfuel = 200_000_000\n")
            .await;
        client.deploy("b", &b, "caller", "").await;

        let mut stream = client
            .http
            .get(format!("{}/v1/tenants/b/outputs/stream", client.base))
            .bearer_auth(&b)
            .send()
            .await
            .expect("the stream opens");
        // Warm up: the first runs compile nothing, but fill caches.
        measure_b(&client, &b, "warm", &mut stream).await;
        let idle = measure_b(&client, &b, "idle", &mut stream).await;

        let flooding = Arc::new(AtomicBool::new(true));
        let submitted = Arc::new(AtomicU64::new(0));
        let flood = tokio::spawn({
            let (client, flooding, submitted, a) = (
                Arc::clone(&client),
                Arc::clone(&flooding),
                Arc::clone(&submitted),
                a.clone(),
            );
            async move {
                let mut i = 0u64;
                while flooding.load(Ordering::SeqCst) {
                    let status = client
                        .submit(
                            "a",
                            &a,
                            &format!("a-{i}"),
                            &format!("k{}", i % 64),
                            json!({ "mode": "loop" }),
                        )
                        .await;
                    if status == 202 {
                        i += 1;
                        submitted.store(i, Ordering::SeqCst);
                    } else {
                        // 429: A's queue is full; it keeps it full.
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                }
            }
        });
        // Let the flood fill A's queue and its run slots.
        tokio::time::sleep(Duration::from_secs(1)).await;
        let flooded = measure_b(&client, &b, "flood", &mut stream).await;
        flooding.store(false, Ordering::SeqCst);
        flood.await.expect("the flood task");

        // A uploads distinct components that fail the world check, as fast as the
        // server's compile slots take them (503 when they and the queue are full).
        let uploading = Arc::new(AtomicBool::new(true));
        let uploaded = Arc::new(AtomicU64::new(0));
        let uploads = tokio::spawn({
            let (client, uploading, uploaded, a) = (
                Arc::clone(&client),
                Arc::clone(&uploading),
                Arc::clone(&uploaded),
                a.clone(),
            );
            async move {
                let mut i = 0u64;
                while uploading.load(Ordering::SeqCst) {
                    let (status, body) = client
                        .send(
                            client
                                .http
                                .put(format!("{}/v1/tenants/a/components/c{i}", client.base))
                                .body(wrong_world(i, 400)),
                            &a,
                        )
                        .await;
                    match status {
                        422 => {
                            i += 1;
                            uploaded.store(i, Ordering::SeqCst);
                        }
                        503 => tokio::time::sleep(Duration::from_millis(5)).await,
                        _ => panic!("an upload answered {status}: {body}"),
                    }
                }
            }
        });
        tokio::time::sleep(Duration::from_secs(1)).await;
        let uploading_b = measure_b(&client, &b, "upload", &mut stream).await;
        uploading.store(false, Ordering::SeqCst);
        uploads.await.expect("the upload task");

        for (name, sorted) in [
            ("idle", &idle),
            ("A flooding", &flooded),
            ("A uploading", &uploading_b),
        ] {
            println!(
                "B's event latency, {name:<11} p50 {:>9.2?}  p90 {:>9.2?}  p99 {:>9.2?}",
                quantile(sorted, 50),
                quantile(sorted, 90),
                quantile(sorted, 99)
            );
        }
        let ratio = |during: &[Duration], p| {
            quantile(during, p).as_secs_f64() / quantile(&idle, p).as_secs_f64()
        };
        println!(
            "flooded / idle: p50 {:.2}x  p90 {:.2}x  p99 {:.2}x  (A submitted {} CPU-bound inputs)",
            ratio(&flooded, 50),
            ratio(&flooded, 90),
            ratio(&flooded, 99),
            submitted.load(Ordering::SeqCst)
        );
        println!(
            "uploading / idle: p50 {:.2}x  p90 {:.2}x  p99 {:.2}x  (A uploaded {} components \
             that fail the world check)",
            ratio(&uploading_b, 50),
            ratio(&uploading_b, 90),
            ratio(&uploading_b, 99),
            uploaded.load(Ordering::SeqCst)
        );
    });
}
