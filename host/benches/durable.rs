//! Start + run of a trivial action in Rust, Python and JavaScript, loading a component from
//! the on-disk cache, and durable calls served from a record or made live.
//!
//! `cargo bench -p rewind-host --bench durable`; results and targets in BENCHMARKS.md.
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use rewind_host::event::Event;
use rewind_host::sandbox::{Limits, RunInput, RunLabels, Sandbox};
use rewind_host::store::{
    ActionState, ActionStateStore, Digest, InMemoryStore, KeyScope, StateKey,
};

use common::{calls, noop_functions};

// Not every bench uses every helper.
#[allow(dead_code)]
mod common;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
}

/// The component of guest `name`, building every guest first (once).
fn guest(name: &str) -> std::path::PathBuf {
    static BUILT: std::sync::Once = std::sync::Once::new();
    BUILT.call_once(|| {
        let status = std::process::Command::new("bash")
            .arg(root().join("scripts/guests.sh"))
            .status()
            .expect("scripts/guests.sh runs");
        assert!(status.success(), "building the guests failed");
    });
    root().join(format!(
        "target/guests/wasm32-wasip2/release/guest_{name}.wasm"
    ))
}

/// A trivial action per language: the Rust noop guest, and the caller's Python and
/// JavaScript twins with a script that does nothing.
const TRIVIAL: [(&str, &str, &str); 3] = [
    ("rust", "noop", "{}"),
    ("python", "caller_py", r#"{"output":false}"#),
    ("javascript", "caller_js", r#"{"output":false}"#),
];

fn new_sandbox() -> Sandbox {
    Sandbox::builder()
        .cache_dir(Some(root().join("target/rewind-bench-cache")))
        .build()
        .expect("sandbox")
}

fn key(sequence: u64) -> StateKey {
    StateKey {
        scope: KeyScope::new("bench", "bench", "key"),
        sequence,
        action: "act".to_owned(),
        trigger: Digest::of(&[b"input"]),
    }
}

fn benches(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let store: Arc<dyn ActionStateStore> = Arc::new(InMemoryStore::default());
    let functions = noop_functions();

    let sandbox = new_sandbox();
    for (language, name, payload) in TRIVIAL {
        let component = sandbox.load_file(&guest(name)).expect("the guest loads");
        c.bench_function(&format!("action/start_and_run_trivial/{language}"), |b| {
            b.to_async(&runtime).iter(|| async {
                let input = RunInput {
                    labels: RunLabels {
                        agent: "bench".to_owned(),
                        key: "key".to_owned(),
                        sequence: 1,
                        action: "act".to_owned(),
                    },
                    event: Event::new("input", payload),
                    memory: Arc::default(),
                    durable: calls(
                        &store,
                        &functions,
                        ActionState::new(key(1), Event::new("input", payload)),
                    ),
                    limits: Limits::default(),
                };
                let output = sandbox.run(&component, input).await;
                assert!(output.result.is_ok(), "{:?}", output.result);
            });
        });
    }

    // A load as a new `rewind` process makes it: a new sandbox, the component read, hashed,
    // taken from the disk cache (filled by the loads above), checked and pre-instantiated.
    let mut group = c.benchmark_group("sandbox/load_cached");
    group.sample_size(10);
    for (language, name, _) in TRIVIAL {
        let path = guest(name);
        group.bench_function(language, |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let fresh = new_sandbox();
                    let started = Instant::now();
                    let loaded = fresh.load_file(&path).expect("the guest loads");
                    total += started.elapsed();
                    drop(loaded);
                }
                total
            });
        });
    }
    group.finish();

    c.bench_function("durable/call_served_from_record", |b| {
        b.to_async(&runtime).iter_custom(|iters| {
            let store = Arc::clone(&store);
            let functions = Arc::clone(&functions);
            async move {
                // A state holding `iters` records of the same call, replayed one after another.
                let mut recording = calls(
                    &store,
                    &functions,
                    ActionState::new(key(2), Event::new("input", "{}")),
                );
                let mut state = {
                    let _ = recording
                        .call("noop", r#"{"q":"where is my order?"}"#)
                        .await;
                    recording.state().clone()
                };
                let record = state.calls[0].clone();
                state.calls = vec![record; usize::try_from(iters).expect("fits")];
                let mut replay = calls(&store, &functions, state);
                let started = Instant::now();
                for _ in 0..iters {
                    let result = replay.call("noop", r#"{"q":"where is my order?"}"#).await;
                    assert!(matches!(result, Ok(Ok(_))));
                }
                let elapsed = started.elapsed();
                assert_eq!(replay.stats().live, 0);
                elapsed
            }
        });
    });

    c.bench_function("durable/call_live_noop_in_memory_store", |b| {
        b.to_async(&runtime).iter_custom(|iters| {
            let functions = Arc::clone(&functions);
            async move {
                // A fresh store per batch, so that its size does not drift over the run.
                let store: Arc<dyn ActionStateStore> = Arc::new(InMemoryStore::default());
                let mut total = Duration::ZERO;
                for n in 0..iters {
                    let mut run = calls(
                        &store,
                        &functions,
                        ActionState::new(key(n), Event::new("input", "{}")),
                    );
                    let started = Instant::now();
                    let result = run.call("noop", r#"{"q":"where is my order?"}"#).await;
                    total += started.elapsed();
                    assert!(matches!(result, Ok(Ok(_))));
                }
                total
            }
        });
    });
}

criterion_group!(durable, benches);
criterion_main!(durable);
