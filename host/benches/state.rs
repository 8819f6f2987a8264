//! Issue #3's figures: a live durable call on the embedded log beside the machine's
//! fdatasync, throughput with 64 keys, checkpoint cost under both marker strategies, and
//! recovery time. A bench binary (not criterion): each figure is one measured run.
//!
//! `cargo bench -p rewind-host --bench state`; results in BENCHMARKS.md.
use std::io::Write;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rewind_host::event::Event;
use rewind_host::functions::Functions;
use rewind_host::log::{FileLog, FileLogOptions, Log};
use rewind_host::store::{ActionState, ActionStateStore, LogStore, MarkerStrategy};

use common::{calls as calls_of, calls_per_second_64_keys, key, noop_functions};

mod common;

fn median(mut samples: Vec<Duration>) -> Duration {
    samples.sort_unstable();
    samples[samples.len() / 2]
}

fn open(dir: &Path, partitions: u32) -> Arc<dyn Log> {
    let options = FileLogOptions {
        partitions,
        ..FileLogOptions::default()
    };
    Arc::new(FileLog::open(dir, options).expect("open").0)
}

/// Medians of a live durable call on the embedded log (one key, no-op handler) and of an
/// fdatasync of a 1 KiB append to a file on the same disk, sampled alternately so that both
/// see the same disk.
async fn live_call_and_fdatasync(
    dir: &Path,
    functions: &Arc<Functions>,
    samples: usize,
) -> (Duration, Duration) {
    let store: Arc<dyn ActionStateStore> = Arc::new(LogStore::new(
        open(dir, 8),
        MarkerStrategy::Offsets,
        rewind_host::store::Incarnation::random(),
    ));
    let mut file = std::fs::File::create(dir.join("fdatasync")).expect("create");
    let block = [7u8; 1024];
    let (mut calls, mut syncs) = (Vec::with_capacity(samples), Vec::with_capacity(samples));
    for n in 0..samples as u64 {
        let started = Instant::now();
        file.write_all(&block).expect("write");
        file.sync_data().expect("sync");
        syncs.push(started.elapsed());

        let mut run = calls_of(
            &store,
            functions,
            ActionState::new(key("one", n), Event::new("input", "{}")),
        );
        let started = Instant::now();
        let result = run.call("noop", r#"{"q":"where is my order?"}"#).await;
        calls.push(started.elapsed());
        assert!(matches!(result, Ok(Ok(_))));
    }
    (median(calls), median(syncs))
}

async fn throughput_64_keys(dir: &Path, functions: &Arc<Functions>, per_key: u64) -> f64 {
    let store: Arc<dyn ActionStateStore> = Arc::new(LogStore::new(
        open(dir, 8),
        MarkerStrategy::Offsets,
        rewind_host::store::Incarnation::random(),
    ));
    calls_per_second_64_keys(&store, functions, per_key).await
}

/// A state of about 1 KiB.
fn one_kib_state(n: u64) -> ActionState {
    let payload = format!("{{\"text\":\"{}\"}}", "x".repeat(800));
    ActionState::new(
        key(&format!("key-{}", n % 1000), n),
        Event::new("input", payload),
    )
}

async fn fill(store: &Arc<LogStore>, states: u64) {
    let mut tasks = Vec::new();
    for worker in 0..256 {
        let store = Arc::clone(store);
        tasks.push(tokio::spawn(async move {
            let mut n = worker;
            while n < states {
                store.put(&one_kib_state(n)).await.expect("put");
                n += 256;
            }
        }));
    }
    for task in tasks {
        task.await.expect("task");
    }
}

/// Bytes in the log's segment files (not its commit journal, which is emptied as it goes).
fn dir_bytes(dir: &Path) -> u64 {
    walk(dir)
        .iter()
        .filter(|p| p.extension().is_some_and(|e| e == "seg"))
        .map(|p| std::fs::metadata(p).map_or(0, |m| m.len()))
        .sum()
}

fn walk(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).expect("dir") {
        let path = entry.expect("entry").path();
        if path.is_dir() {
            files.extend(walk(&path));
        } else {
            files.push(path);
        }
    }
    files
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/rewind-bench-state");
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&root).expect("bench dir");
    let functions = noop_functions();
    // `cargo bench -p rewind-host --bench state -- recovery` runs the figures whose line
    // contains `recovery`, and what they need.
    let filter = std::env::args().skip(1).find(|a| !a.starts_with('-'));
    let wanted = |figure: &str| filter.as_deref().is_none_or(|f| figure.contains(f));

    runtime.block_on(async {
        if wanted("live call, fdatasync, 64 keys") {
        let (call, sync) = live_call_and_fdatasync(&root.join("one-key"), &functions, 500).await;
        println!("fdatasync of a 1 KiB append (median of 500):        {sync:>10.1?}");
        println!(
            "live durable call, embedded log, one key (median):  {call:>10.1?}  ({:.2}x fdatasync)",
            call.as_secs_f64() / sync.as_secs_f64()
        );
        let rate = throughput_64_keys(&root.join("64-keys"), &functions, 2000).await;
        println!("64 keys at once, no-op handler:                      {rate:>10.0} calls/s");
        }

        for states in [1_000u64, 10_000, 100_000] {
            for strategy in [MarkerStrategy::Offsets, MarkerStrategy::Refresh] {
                let recovery = states == 100_000 && strategy == MarkerStrategy::Offsets;
                if !(wanted("checkpoint") || recovery && wanted("recovery")) {
                    continue;
                }
                let dir = root.join(format!("checkpoint-{states}-{strategy:?}"));
                let log = open(&dir, 8);
                let store = Arc::new(LogStore::new(Arc::clone(&log), strategy, rewind_host::store::Incarnation::random()));
                fill(&store, states).await;
                let before = dir_bytes(&dir);
                let started = Instant::now();
                let marker = store.marker().await.expect("marker");
                let took = started.elapsed();
                let appended = dir_bytes(&dir) - before;
                println!(
                    "checkpoint, {states:>6} cached states of ~1 KiB, {strategy:<7?}: {took:>10.2?}, {appended:>10} bytes appended{}",
                    if appended > 0 {
                        format!(", {:.0} MB/s", appended as f64 / took.as_secs_f64() / 1e6)
                    } else {
                        String::new()
                    }
                );
                if recovery && wanted("recovery") {
                    drop(store);
                    drop(log);
                    let started = Instant::now();
                    let log = open(&dir, 8);
                    let opened = started.elapsed();
                    let recovered = LogStore::new(Arc::clone(&log), strategy, rewind_host::store::Incarnation::random());
                    recovered.rebuild(&marker).await.expect("rebuild");
                    let took = started.elapsed();
                    let count: usize = recovered.scopes().iter().map(|s| recovered.states(s).len()).sum();
                    assert_eq!(count, 100_000);
                    println!("recovery of {count} states (open + rebuild):          {took:>10.2?}  (open {opened:.2?})");
                }
            }
        }
    });
    let _ = std::fs::remove_dir_all(&root);
}
