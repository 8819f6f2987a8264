//! Issue #24's streaming figures: `openai-chat` against the mock service's chat endpoint on
//! loopback (examples/mock-service).
//!
//! 1. Calls a second, 16 at a time: the answer streamed and read as it comes (its pieces
//!    forwarded to a follower, and with no follower), against the same answer asked as one
//!    JSON completion by an `http` function.
//! 2. Chunks paced 50 ms apart, as a model writing: when the first piece reaches the
//!    follower, against when the message is put together (what gets recorded), p50 and p99.
//!
//! `cargo bench -p rewind-host --bench streaming [-- CALLS]` (default 4,000 for the first,
//! a tenth of it for the second); results in BENCHMARKS.md.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use rewind_host::functions::{
    CallDeltas, CallRequest, DEFAULT_MAX_RESPONSE_BYTES, Function, HttpConfig, HttpFunction,
    OpenAiChatConfig, OpenAiChatFunction, RetryPolicy,
};
use serde_json::{Value, json};

const AT_ONCE: usize = 16;

fn http(url: String, headers: Vec<(String, String)>) -> HttpConfig {
    HttpConfig {
        url,
        timeout: Duration::from_secs(10),
        retry: RetryPolicy::default(),
        headers,
        reconcile_url: None,
        allowed_hosts: None,
        max_response_bytes: DEFAULT_MAX_RESPONSE_BYTES,
    }
}

fn chat(base: &str, pause_ms: Option<u64>) -> Arc<dyn Function> {
    let headers = pause_ms
        .map(|ms| (rewind_mock::CHUNK_DELAY_HEADER.to_owned(), ms.to_string()))
        .into_iter()
        .collect();
    Arc::new(OpenAiChatFunction::new(OpenAiChatConfig {
        base_url: format!("{base}/v1"),
        model: "mock-1".to_owned(),
        http: http(String::new(), headers),
    }))
}

/// A follower: counts the pieces, and notes when the first came.
#[derive(Default)]
struct Follower {
    pieces: AtomicU64,
    first: std::sync::Mutex<Option<Instant>>,
}

impl CallDeltas for Follower {
    fn delta(&self, _: &Value) {
        self.pieces.fetch_add(1, Ordering::Relaxed);
        let mut first = self.first.lock().expect("lock");
        first.get_or_insert_with(Instant::now);
    }
}

fn args(n: usize, stream: Option<bool>) -> String {
    let mut args = json!({ "messages": [
        { "role": "user", "content": format!("Where is my order A{n}? It has not come.") },
    ] });
    if let Some(stream) = stream {
        args["model"] = json!("mock-1");
        args["stream"] = json!(stream);
    }
    args.to_string()
}

/// Calls a second: `calls` calls of `function`, `AT_ONCE` at a time, each with its own
/// args (`stream` as `args` puts it) and key, a follower given when `follow`.
async fn throughput(
    function: &Arc<dyn Function>,
    calls: usize,
    stream: Option<bool>,
    follow: bool,
) -> (f64, u64) {
    let pieces = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for worker in 0..AT_ONCE {
        let function = Arc::clone(function);
        let pieces = Arc::clone(&pieces);
        tasks.push(tokio::spawn(async move {
            let mut n = worker;
            while n < calls {
                let (args, key) = (args(n, stream), format!("key-{n}"));
                let follower = Follower::default();
                let request = CallRequest {
                    function: "llm.chat",
                    args: &args,
                    idempotency_key: &key,
                    slot: None,
                    deltas: follow.then_some(&follower as &dyn CallDeltas),
                };
                function.call(request).await.expect("an answer");
                pieces.fetch_add(follower.pieces.load(Ordering::Relaxed), Ordering::Relaxed);
                n += AT_ONCE;
            }
        }));
    }
    for task in tasks {
        task.await.expect("task");
    }
    let per_second = calls as f64 / started.elapsed().as_secs_f64();
    (per_second, pieces.load(Ordering::Relaxed))
}

/// The `per_mille`th of `sorted`, by rank.
fn percentile(sorted: &[Duration], per_mille: usize) -> Duration {
    sorted[(sorted.len() - 1) * per_mille / 1000]
}

fn main() {
    let calls: usize = std::env::args()
        .skip(1)
        .find(|arg| !arg.starts_with('-'))
        .map_or(4_000, |n| n.parse().expect("a number of calls"));
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    runtime.block_on(async {
        let mock = rewind_mock::MockService::start("127.0.0.1:0".parse().expect("addr"))
            .await
            .expect("the mock starts");
        let base = mock.base_url();
        let streamed = chat(&base, None);
        let json: Arc<dyn Function> = Arc::new(HttpFunction::new(http(
            format!("{base}/v1/chat/completions"),
            Vec::new(),
        )));
        // Warm the connections and the mock.
        throughput(&streamed, 64, None, false).await;
        println!("{calls} calls, {AT_ONCE} at a time, on loopback:");
        let (per_second, pieces) = throughput(&streamed, calls, None, true).await;
        println!(
            "  streamed, pieces to a follower: {per_second:.0} calls/s ({:.1} pieces a call)",
            pieces as f64 / calls as f64
        );
        let (per_second, _) = throughput(&streamed, calls, None, false).await;
        println!("  streamed, no follower:          {per_second:.0} calls/s");
        let (per_second, _) = throughput(&json, calls, Some(false), false).await;
        println!("  one JSON completion (http):     {per_second:.0} calls/s");

        let paced = chat(&base, Some(50));
        let samples = (calls / 10).max(10);
        let mut first = Vec::with_capacity(samples);
        let mut whole = Vec::with_capacity(samples);
        for n in 0..samples {
            let (args, key) = (args(n, None), format!("paced-{n}"));
            let follower = Follower::default();
            let started = Instant::now();
            let request = CallRequest {
                function: "llm.chat",
                args: &args,
                idempotency_key: &key,
                slot: None,
                deltas: Some(&follower),
            };
            paced.call(request).await.expect("an answer");
            whole.push(started.elapsed());
            let came = follower.first.lock().expect("lock").expect("a piece came");
            first.push(came - started);
        }
        first.sort_unstable();
        whole.sort_unstable();
        println!("{samples} calls, chunks 50 ms apart, one at a time:");
        println!(
            "  first piece at the follower: p50 {:.1} ms, p99 {:.1} ms",
            percentile(&first, 500).as_secs_f64() * 1e3,
            percentile(&first, 990).as_secs_f64() * 1e3
        );
        println!(
            "  message put together:        p50 {:.1} ms, p99 {:.1} ms",
            percentile(&whole, 500).as_secs_f64() * 1e3,
            percentile(&whole, 990).as_secs_f64() * 1e3
        );
    });
}
