//! `rewind serve` end to end, and its restart: one tenant's events over 64 keys, submitted
//! over HTTP, each answered by an output on the tenant's stream; then the server stopped and
//! started again on its state, timed until the tenant answers (its journal recovered).
//!
//! `cargo bench -p rewind-host --bench serve [-- INPUTS]` (default 100,000 inputs); results
//! in BENCHMARKS.md. A bench binary (not criterion): each figure is one measured run.

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::json;
use server::{Server, quantile};

// For the allocator the `rewind` binary runs with; no helper of it is used here.
#[allow(dead_code)]
mod common;
#[path = "common/server.rs"]
mod server;

const KEYS: u64 = 64;
/// Submissions in flight at once (one per key).
const IN_FLIGHT: u64 = KEYS;
/// Events measured one at a time.
const SAMPLES: u64 = 500;
const CONFIG: &str = "[tenants.acme.quotas]\nconcurrent-runs = 4\nqueued-inputs = 100000\n\
    calls-per-minute = 100000000\nstored-bytes = 100000000000";

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
    let dir = server::state_dir("rewind-bench-serve");
    runtime.block_on(async {
        let server = Server::start(&dir, CONFIG).await;
        let client = server.client.clone();
        let token = client.tenant("acme").await;
        client
            .deploy("acme", &token, server::guest("caller"), "")
            .await;

        let mut outputs = client.outputs("acme", &token, 0).await;
        let reader = tokio::spawn(async move {
            let mut seen = Vec::new();
            while (seen.len() as u64) < inputs {
                let output = outputs.next().await;
                let id = output["event_id"].as_str().unwrap_or_default().to_owned();
                seen.push((id, Instant::now()));
            }
            seen
        });
        let started = Instant::now();
        let mut submitters = tokio::task::JoinSet::new();
        for lane in 0..IN_FLIGHT {
            let client = client.clone();
            let token = token.clone();
            submitters.spawn(async move {
                let mut submitted = Vec::new();
                let mut i = lane;
                while i < inputs {
                    let id = format!("e{i}");
                    let at = Instant::now();
                    let payload = json!({ "memory_set": { "n": i } });
                    let (status, body) = client
                        .submit("acme", &token, &id, &format!("k{}", i % KEYS), payload)
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
        let mut outputs = client.outputs("acme", &token, inputs).await;
        let mut one_at_a_time = Vec::new();
        for i in 0..SAMPLES {
            let at = Instant::now();
            let (status, body) = client
                .submit(
                    "acme",
                    &token,
                    &format!("l{i}"),
                    &format!("k{}", i % KEYS),
                    json!({}),
                )
                .await;
            assert_eq!(status, 202, "{body}");
            outputs.next().await;
            one_at_a_time.push(at.elapsed());
        }
        one_at_a_time.sort();
        println!(
            "one at a time, {SAMPLES} events: submit -> output p50 {:.2?}, p99 {:.2?}",
            quantile(&one_at_a_time, 50),
            quantile(&one_at_a_time, 99)
        );

        server.stop().await;
        // The first restart after the run: from the snapshot the server keeps in the
        // background (every 30 s), then the records after it. The second: from the
        // snapshot the first left at its end.
        for restart in ["first", "second"] {
            let journal: u64 = walk(&dir.join("tenants"))
                .iter()
                .map(|p| p.metadata().map_or(0, |m| m.len()))
                .sum();
            let restarted = Instant::now();
            let server = Server::start(&dir, CONFIG).await;
            let client = &server.client;
            let (status, body) = client
                .send(
                    client.http.get(format!(
                        "{}/v1/tenants/acme/agents/bot/keys/k0/history?limit=1",
                        client.base
                    )),
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
            server.stop().await;
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
