//! Noisy neighbour: tenant B's event latency (submit → its output arrives on B's stream) on
//! an idle server; beside threads that are not guests keeping every core busy (the control:
//! what the machine gives B under load, Rewind aside); while tenant A floods the server with
//! CPU-bound guests; and while A floods it with uploads of distinct components that fail
//! the world check.
//!
//! `cargo bench -p rewind-host --bench tenants`; `REWIND_BENCH_DIR=/dev/shm` puts the state
//! on a tmpfs, taking the disk out. Results and target in BENCHMARKS.md.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde_json::json;
use server::{Client, Outputs, Server, quantile};

// For the allocator the `rewind` binary runs with; no helper of it is used here.
#[allow(dead_code)]
mod common;
// Its `stop` is not used: A's queued runs would be waited for.
#[allow(dead_code)]
#[path = "common/server.rs"]
mod server;

/// B's events measured in each phase.
const SAMPLES: usize = 500;
/// A's runs at once (its `concurrent-runs` quota), and the busy threads of the control.
const A_RUNS: usize = 4;

/// B's latencies over `SAMPLES` events, one at a time, sorted.
async fn measure_b(
    client: &Client,
    token: &str,
    phase: &str,
    outputs: &mut Outputs,
) -> Vec<Duration> {
    let mut latencies = Vec::with_capacity(SAMPLES);
    for i in 0..SAMPLES {
        let id = format!("{phase}-{i}");
        let started = Instant::now();
        let (status, body) = client
            .submit("b", token, &id, &format!("k{}", i % 8), json!(null))
            .await;
        assert_eq!(status, 202, "{body}");
        while outputs.next().await["event_id"] != id.as_str() {}
        latencies.push(started.elapsed());
    }
    latencies.sort();
    latencies
}

/// The control: B's latencies while `A_RUNS` threads of this process that are not guests
/// (plain arithmetic, at the niceness guests run at) keep every core busy. What the machine
/// gives B under that load, Rewind aside.
async fn measure_b_beside_busy_threads(
    client: &Client,
    token: &str,
    outputs: &mut Outputs,
) -> Vec<Duration> {
    let busy = Arc::new(AtomicBool::new(true));
    let threads: Vec<_> = (0..A_RUNS)
        .map(|_| {
            let busy = Arc::clone(&busy);
            std::thread::spawn(move || {
                let thread = rustix::thread::gettid();
                let _ = rustix::process::setpriority_process(Some(thread), 10);
                let mut x = 0u64;
                while busy.load(Ordering::Relaxed) {
                    for _ in 0..100_000 {
                        x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
                    }
                }
                x
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let latencies = measure_b(client, token, "busy", outputs).await;
    busy.store(false, Ordering::SeqCst);
    for thread in threads {
        thread.join().expect("a busy thread");
    }
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

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let dir = server::state_dir("rewind-bench-tenants");
    runtime.block_on(async {
        let server = Server::start(
            &dir,
            &format!(
                "[tenants.a.quotas]\nconcurrent-runs = {A_RUNS}\nqueued-inputs = 64\n\
                 calls-per-minute = 1000000\ncompiles-per-minute = 1000000"
            ),
        )
        .await;
        let client = Arc::new(server.client.clone());
        let a = client.tenant("a").await;
        let b = client.tenant("b").await;
        // A's runs each burn 200M fuel (a CPU-bound loop until its budget is spent).
        client
            .deploy(
                "a",
                &a,
                server::guest("hostile"),
                "[limits]\nfuel = 200_000_000\n",
            )
            .await;
        client.deploy("b", &b, server::guest("caller"), "").await;

        let mut outputs = client.outputs("b", &b, 0).await;
        // Warm up: the first runs compile nothing, but fill caches.
        measure_b(&client, &b, "warm", &mut outputs).await;
        let idle = measure_b(&client, &b, "idle", &mut outputs).await;
        let busy = measure_b_beside_busy_threads(&client, &b, &mut outputs).await;

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
                    let (status, _) = client
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
        let flooded = measure_b(&client, &b, "flood", &mut outputs).await;
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
        let uploading_b = measure_b(&client, &b, "upload", &mut outputs).await;
        uploading.store(false, Ordering::SeqCst);
        uploads.await.expect("the upload task");

        for (name, sorted) in [
            ("idle", &idle),
            ("busy threads", &busy),
            ("A flooding", &flooded),
            ("A uploading", &uploading_b),
        ] {
            println!(
                "B's event latency, {name:<12} p50 {:>9.2?}  p90 {:>9.2?}  p99 {:>9.2?}",
                quantile(sorted, 50),
                quantile(sorted, 90),
                quantile(sorted, 99)
            );
        }
        let ratio = |during: &[Duration], p| {
            quantile(during, p).as_secs_f64() / quantile(&idle, p).as_secs_f64()
        };
        println!(
            "busy threads / idle: p50 {:.2}x  p90 {:.2}x  p99 {:.2}x  ({A_RUNS} threads that are \
             not guests: the machine's own share)",
            ratio(&busy, 50),
            ratio(&busy, 90),
            ratio(&busy, 99),
        );
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
        drop(server);
    });
}
