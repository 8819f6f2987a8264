//! Issue #24's figures for waits and the log: a million inputs at a durable wait, with and
//! without the shelf, under both markers. For each: the time to record the waits (and set
//! them aside), then two checkpoints' markers while other inputs come and finish (the time
//! each takes, and what it appends), what retention leaves on disk after them, and the
//! time a rebuild from the last marker takes. A bench binary (not criterion): each figure
//! is one measured run.
//!
//! `cargo bench -p rewind-host --bench shelf [-- WAITS]`; results in BENCHMARKS.md.
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rewind_host::event::Event;
use rewind_host::log::{FileLog, FileLogOptions, Log};
use rewind_host::store::{
    ActionState, ActionStateStore, CallOutcome, CallRecord, Completion, Digest, KeyScope, LogStore,
    Marker, MarkerStrategy, SHELF_DIR, StateKey, Wait,
};

const PARTITIONS: u32 = 8;
/// Inputs that come and finish between two checkpoints (each one state).
const TRAFFIC: u64 = 100_000;
/// Segments of 1 MiB (`rewind serve`'s size), so that what retention deletes shows at this
/// scale.
const SEGMENT_BYTES: u64 = 1 << 20;
/// Writers at once.
const WRITERS: u64 = 256;

fn key(name: &str, sequence: u64) -> StateKey {
    StateKey {
        scope: KeyScope::new("bench", "bench", name),
        sequence,
        action: "refund".to_owned(),
        trigger: Digest::of(&[b"input"]),
    }
}

fn open(dir: &Path) -> Arc<dyn Log> {
    let options = FileLogOptions {
        partitions: PARTITIONS,
        segment_bytes: SEGMENT_BYTES,
        ..FileLogOptions::default()
    };
    Arc::new(FileLog::open(dir, options).expect("open").0)
}

/// Input `n`'s state at its wait: an approval that waits a day for a person's signal.
fn waiting(n: u64) -> ActionState {
    let mut state = ActionState::new(
        key(&format!("waits-{n}"), 1),
        Event::new("input", format!("{{\"refund\":{n},\"amount\":\"12.50\"}}")),
    );
    state.calls.push(CallRecord {
        function: "llm.chat".to_owned(),
        args_digest: Digest::of(&[&n.to_le_bytes()]),
        idempotency_key: format!("draft-{n}"),
        outcome: CallOutcome::Succeeded(format!("{{\"note\":\"refund {n} drafted\"}}")),
    });
    state.calls.push(CallRecord {
        function: "@signal".to_owned(),
        args_digest: Digest::of(&[b"approve"]),
        idempotency_key: format!("wait-{n}"),
        outcome: CallOutcome::Waiting(Wait {
            until: Some(1_900_000_000_000),
            signals: vec!["approve".to_owned(), "reject".to_owned()],
        }),
    });
    state
}

/// Records `waits` inputs at their wait, `WRITERS` at a time, each shelved as the host
/// does when `shelve`.
async fn wait_all(store: &Arc<LogStore>, waits: u64, shelve: bool) {
    let mut tasks = Vec::new();
    for worker in 0..WRITERS {
        let store = Arc::clone(store);
        tasks.push(tokio::spawn(async move {
            let mut n = worker;
            while n < waits {
                let state = waiting(n);
                store.put(&state).await.expect("put");
                if shelve {
                    store.shelve(&state.key.scope, 1).await.expect("shelve");
                }
                n += WRITERS;
            }
        }));
    }
    for task in tasks {
        task.await.expect("task");
    }
}

/// `TRAFFIC` inputs of other keys that run and finish (pruned, as a checkpoint would),
/// numbered from `first`.
async fn traffic(store: &Arc<LogStore>, first: u64) {
    let mut tasks = Vec::new();
    for worker in 0..WRITERS {
        let store = Arc::clone(store);
        tasks.push(tokio::spawn(async move {
            let mut n = first + worker;
            while n < first + TRAFFIC {
                let mut state = ActionState::new(
                    key(&format!("busy-{}", n % 1000), n),
                    Event::new("input", "{\"x\":1}"),
                );
                state.completion = Some(Completion::default());
                store.put(&state).await.expect("put");
                store.prune(&state.key.scope, n).await.expect("prune");
                n += WRITERS;
            }
        }));
    }
    for task in tasks {
        task.await.expect("task");
    }
}

/// Bytes in the segment files under `dir`.
fn bytes(dir: &Path) -> u64 {
    let mut total = 0;
    for entry in std::fs::read_dir(dir).expect("dir") {
        let path = entry.expect("entry").path();
        if path.is_dir() {
            total += bytes(&path);
        } else if path.extension().is_some_and(|e| e == "seg") {
            total += std::fs::metadata(&path).map_or(0, |m| m.len());
        }
    }
    total
}

fn mb(bytes: u64) -> f64 {
    bytes as f64 / 1e6
}

struct Figures {
    wait: Duration,
    markers: Vec<(Duration, u64)>,
    log_after: u64,
    shelf_after: u64,
    rebuild: Duration,
}

async fn measure(dir: &Path, strategy: MarkerStrategy, shelve: bool, waits: u64) -> Figures {
    let log_dir = dir.join("log");
    let log = open(&log_dir);
    let mut store = LogStore::new(
        Arc::clone(&log),
        strategy,
        rewind_host::store::Incarnation::random(),
    );
    if shelve {
        store = store
            .with_shelf(open(&log_dir.join(SHELF_DIR)))
            .expect("as many partitions");
    }
    let store = Arc::new(store);
    let started = Instant::now();
    wait_all(&store, waits, shelve).await;
    let wait = started.elapsed();
    let mut markers = Vec::new();
    let mut marker = Marker::default();
    for round in 0..2 {
        traffic(&store, round * TRAFFIC + 10).await;
        let before = bytes(&log_dir);
        let started = Instant::now();
        marker = store.marker().await.expect("marker");
        markers.push((started.elapsed(), bytes(&log_dir) - before));
        store.retain(&marker).await.expect("retain");
    }
    let shelf_after = if shelve {
        bytes(&log_dir.join(SHELF_DIR))
    } else {
        0
    };
    let log_after = bytes(&log_dir) - shelf_after;
    for scope in store.scopes() {
        store.prune(&scope, u64::MAX).await.expect("prune");
    }
    let started = Instant::now();
    store.rebuild(&marker).await.expect("rebuild");
    let rebuild = started.elapsed();
    // (Finished inputs after the marker come back too, as they do for recovery, which
    // prunes them again.)
    let restored: usize = (store.scopes().iter())
        .filter(|scope| scope.key.starts_with("waits-"))
        .map(|scope| store.states(scope).len())
        .sum();
    assert_eq!(
        restored as u64, waits,
        "every waiting input's state is restored"
    );
    Figures {
        wait,
        markers,
        log_after,
        shelf_after,
        rebuild,
    }
}

fn main() {
    let waits: u64 = std::env::args()
        .skip(1)
        .find(|arg| !arg.starts_with('-'))
        .map_or(1_000_000, |n| {
            n.parse().expect("a number of waiting inputs")
        });
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    println!(
        "{waits} inputs at a wait, then twice {TRAFFIC} inputs that finish, each time a \
         checkpoint's marker and retention"
    );
    println!(
        "{:<8} {:<6} {:>10} {:>12} {:>12} {:>12} {:>12} {:>10} {:>10} {:>9}",
        "marker",
        "shelf",
        "waits s",
        "marker 1 s",
        "appended MB",
        "marker 2 s",
        "appended MB",
        "log MB",
        "shelf MB",
        "rebuild s"
    );
    for strategy in [MarkerStrategy::Offsets, MarkerStrategy::Refresh] {
        for shelve in [false, true] {
            let dir = tempfile::tempdir().expect("temp dir");
            let figures = runtime.block_on(measure(dir.path(), strategy, shelve, waits));
            let [(first, first_bytes), (second, second_bytes)] = figures.markers[..] else {
                unreachable!("two markers");
            };
            println!(
                "{:<8} {:<6} {:>10.2} {:>12.3} {:>12.1} {:>12.3} {:>12.1} {:>10.1} {:>10.1} {:>9.2}",
                strategy.name(),
                if shelve { "yes" } else { "no" },
                figures.wait.as_secs_f64(),
                first.as_secs_f64(),
                mb(first_bytes),
                second.as_secs_f64(),
                mb(second_bytes),
                mb(figures.log_after),
                mb(figures.shelf_after),
                figures.rebuild.as_secs_f64(),
            );
        }
    }
}
