//! Checkpoints and recovery through the scheduler, over the file log.

use std::path::Path;
use std::sync::Arc;

use rewind_host::agent::input::InputLine;
use rewind_host::agent::{Agent, JsonlSink};
use rewind_host::checkpoint::{CheckpointStore, FileCheckpoints};
use rewind_host::keys::{Checkpointing, RunOptions, Summary, run_inputs};
use rewind_host::log::{FileLog, FileLogOptions, Log};
use rewind_host::store::{ActionStateStore, KeyScope, LogStore, MarkerStrategy};
use serde_json::{Value, json};

use crate::support::{Counting, agent_file, agent_toml, sandbox};

/// How a process keeps its state.
#[derive(Clone, Copy)]
struct Shape {
    strategy: MarkerStrategy,
    /// A checkpoint after this many inputs (and one at the end).
    every_inputs: Option<u64>,
    segment_bytes: u64,
}

impl Shape {
    /// A checkpoint at the end only, default segments.
    fn at_end(strategy: MarkerStrategy) -> Self {
        Self {
            strategy,
            every_inputs: None,
            segment_bytes: FileLogOptions::default().segment_bytes,
        }
    }
}

/// One "process": opens the state directory, recovers from its newest checkpoint, runs the
/// inputs, checkpoints as `shape` says. Returns the summary and the outputs it wrote.
async fn process(
    state: &Path,
    shape: Shape,
    toml: &str,
    gate: &Arc<Counting>,
    lines: &[Value],
) -> (Summary, Vec<Value>) {
    let (summary, sink) = process_into_sink(state, shape, toml, gate, lines).await;
    let outputs = String::from_utf8(sink.into_inner())
        .expect("utf-8")
        .lines()
        .map(|l| serde_json::from_str(l).expect("JSON"))
        .collect();
    (summary, outputs)
}

/// [`process`], returning its output sink.
async fn process_into_sink(
    state: &Path,
    shape: Shape,
    toml: &str,
    gate: &Arc<Counting>,
    lines: &[Value],
) -> (Summary, JsonlSink<Vec<u8>>) {
    let strategy = shape.strategy;
    let (log, _) = FileLog::open(
        &state.join("log"),
        FileLogOptions {
            partitions: 4,
            segment_bytes: shape.segment_bytes,
            ..FileLogOptions::default()
        },
    )
    .expect("open log");
    let log: Arc<dyn Log> = Arc::new(log);
    let checkpoints = Arc::new(FileCheckpoints::new(state.join("checkpoints")));
    let latest = checkpoints.latest().await.expect("latest");
    let store = Arc::new(LogStore::new(
        Arc::clone(&log),
        strategy,
        rewind_host::store::Incarnation::random(),
    ));
    let marker = match &latest {
        Some(c) => c.marker.clone(),
        None => rewind_host::store::Marker::at(vec![0; 4]),
    };
    store.rebuild(&marker).await.expect("rebuild");
    if let Some(c) = &latest {
        for (key, progress) in &c.keys {
            store
                .prune(
                    &KeyScope::new("default", "test", key),
                    progress.last_completed,
                )
                .await
                .expect("prune");
        }
    }
    let agent = Arc::new(
        Agent::builder(agent_file(toml), sandbox())
            .store(Arc::clone(&store) as _)
            .function("gate", gate.clone())
            .build()
            .expect("agent"),
    );
    let checkpointing = Checkpointing {
        store: checkpoints,
        every_inputs: shape.every_inputs,
        every: None,
        keep: 3,
        retention: vec![store],
    };
    let lines: Vec<_> = lines
        .iter()
        .enumerate()
        .map(|(i, line)| {
            Ok(InputLine {
                id: None,
                line: i + 1,
                key: line["key"].as_str().expect("key").to_owned(),
                payload: line["payload"].to_string(),
            })
        })
        .collect();
    let mut sink = JsonlSink::new(Vec::new());
    let summary = run_inputs(
        agent,
        futures_util::stream::iter(lines),
        &mut sink,
        &(),
        RunOptions {
            checkpointing: Some(&checkpointing),
            resume: latest.as_ref(),
            commands: None,
            until_waits_end: false,
            end_when_held: false,
            deltas: None,
        },
    )
    .await
    .expect("run");
    (summary, sink)
}

/// The mock service, and the `caller` agent with `lookup` (the mock's order lookup, over
/// HTTP) and `gate` (a custom function) declared.
async fn lookup_and_gate() -> (rewind_mock::MockHandle, String) {
    let mock = rewind_mock::MockService::start("127.0.0.1:0".parse().expect("addr"))
        .await
        .expect("mock");
    let toml = agent_toml(
        "caller",
        "",
        &format!(
            // One attempt per process: a failed input stays pending for the next one.
            "[retry]\nattempts = 1\n\n[functions.lookup]\nkind = \"http\"\nurl = \"{}/tools/orders.lookup\"\n\n[functions.gate]\nkind = \"custom\"\n",
            mock.base_url()
        ),
    );
    (mock, toml)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pending_call_survives_repeated_checkpoint_restore_and_completes() {
    for strategy in [MarkerStrategy::Refresh, MarkerStrategy::Offsets] {
        let (mock, toml) = lookup_and_gate().await;
        let dir = tempfile::tempdir().expect("tempdir");
        // The gate is down for the first two processes: each ends with the action pending
        // after its real call, and takes a checkpoint that says so.
        let gate = Counting::unavailable_first(2);
        let line = json!({ "key": "ana", "payload": { "calls": [
            { "function": "lookup", "args": { "order_id": "A1234" } },
            { "function": "gate", "args": {} },
        ] } });
        let lines = [line];

        let (first, _) = process(dir.path(), Shape::at_end(strategy), &toml, &gate, &lines).await;
        assert_eq!(first.parked.len(), 1, "{strategy:?}: {first:?}");
        let checkpoints = FileCheckpoints::new(dir.path().join("checkpoints"));
        let taken = checkpoints
            .latest()
            .await
            .expect("latest")
            .expect("a checkpoint");
        assert_eq!(
            taken.pending.len(),
            1,
            "the checkpoint holds the pending input"
        );

        let (second, _) = process(dir.path(), Shape::at_end(strategy), &toml, &gate, &[]).await;
        assert_eq!(
            second.parked.len(),
            1,
            "{strategy:?}: restored once, still pending"
        );

        let (third, outputs) =
            process(dir.path(), Shape::at_end(strategy), &toml, &gate, &[]).await;
        assert_eq!(
            third.completed, 1,
            "{strategy:?}: restored twice, then complete: {third:?}"
        );
        assert_eq!(outputs.len(), 1);
        let result = &outputs[0]["payload"]["results"][0]["ok"];
        assert_eq!(result["order_id"], "A1234", "{strategy:?}: {result}");
        assert_eq!(
            mock.counts().for_route("/tools/orders.lookup"),
            1,
            "{strategy:?}: the recorded call never ran again"
        );
        let done = checkpoints
            .latest()
            .await
            .expect("latest")
            .expect("a checkpoint");
        assert!(done.pending.is_empty());
        assert_eq!(done.keys["ana"].last_completed, 1);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_finished_run_started_again_has_nothing_to_do() {
    let dir = tempfile::tempdir().expect("tempdir");
    let toml = agent_toml("caller", "", "[functions.gate]\nkind = \"custom\"\n");
    let gate = Counting::new();
    let lines: Vec<Value> = (0..20)
        .map(|i| json!({ "key": format!("k{}", i % 4), "payload": { "calls": [{ "function": "gate", "args": { "i": i } }] } }))
        .collect();
    let (first, outputs) = process(
        dir.path(),
        Shape::at_end(MarkerStrategy::Offsets),
        &toml,
        &gate,
        &lines,
    )
    .await;
    assert_eq!((first.completed, outputs.len()), (20, 20));
    let (again, outputs) = process(
        dir.path(),
        Shape::at_end(MarkerStrategy::Offsets),
        &toml,
        &gate,
        &lines,
    )
    .await;
    assert_eq!((again.inputs, outputs.len()), (0, 0), "{again:?}");
    assert_eq!(gate.calls(), 20);
}

/// A sink keeps the id of each output it wrote, to drop a repeat; once a checkpoint counts
/// an input complete, that input never runs again in the run, and its ids are let go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sink_lets_go_of_the_ids_of_inputs_a_checkpoint_counts_complete() {
    let dir = tempfile::tempdir().expect("tempdir");
    let toml = agent_toml("caller", "", "[functions.gate]\nkind = \"custom\"\n");
    let gate = Counting::new();
    let lines: Vec<Value> = (0..30)
        .map(|i| json!({ "key": format!("k{}", i % 3), "payload": { "calls": [{ "function": "gate", "args": { "i": i } }] } }))
        .collect();
    let shape = Shape {
        every_inputs: Some(10),
        ..Shape::at_end(MarkerStrategy::Offsets)
    };
    let (summary, sink) = process_into_sink(dir.path(), shape, &toml, &gate, &lines).await;
    assert_eq!((summary.completed, summary.outputs), (30, 30));
    assert_eq!(
        sink.remembered(),
        0,
        "the last checkpoint counts every input complete"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_keeps_what_the_oldest_checkpoint_needs() {
    for strategy in [MarkerStrategy::Refresh, MarkerStrategy::Offsets] {
        let (mock, toml) = lookup_and_gate().await;
        let dir = tempfile::tempdir().expect("tempdir");
        // The first input's call is recorded, then the gate is down: it stays pending
        // while 40 more inputs fill small segments and 20 checkpoints are taken.
        let gate = Counting::unavailable_first_of(1, "down");
        let mut lines = vec![json!({ "key": "stuck", "payload": { "calls": [
            { "function": "lookup", "args": { "order_id": "A1234" } },
            { "function": "gate", "args": { "down": true } },
        ] } })];
        lines.extend((0..40).map(|i| {
            json!({ "key": format!("k{}", i % 5), "payload": { "calls": [
                { "function": "gate", "args": { "i": i, "pad": "x".repeat(200) } },
            ] } })
        }));
        let shape = Shape {
            strategy,
            every_inputs: Some(2),
            segment_bytes: 1024,
        };
        let (first, _) = process(dir.path(), shape, &toml, &gate, &lines).await;
        assert_eq!(
            (first.completed, first.parked.len()),
            (40, 1),
            "{strategy:?}"
        );

        let (log, _) = FileLog::open(
            &dir.path().join("log"),
            FileLogOptions {
                partitions: 4,
                segment_bytes: 1024,
                ..FileLogOptions::default()
            },
        )
        .expect("open log");
        let checkpoints = FileCheckpoints::new(dir.path().join("checkpoints"));
        let oldest = checkpoints.oldest().await.expect("oldest").expect("kept");
        let mut deleted = 0;
        for (partition, &needed) in (0..4).zip(&oldest.marker.offsets) {
            let (start, _) = log.bounds(partition).await.expect("bounds");
            assert!(
                start <= needed,
                "{strategy:?}: partition {partition} starts at {start}, past the oldest checkpoint's marker {needed}"
            );
            deleted += start;
        }
        assert!(deleted > 0, "{strategy:?}: retention deleted segments");
        // The oldest kept checkpoint still recovers the pending input's record.
        let log: Arc<dyn Log> = Arc::new(log);
        let store = LogStore::new(
            Arc::clone(&log),
            strategy,
            rewind_host::store::Incarnation::random(),
        );
        store
            .rebuild(&oldest.marker)
            .await
            .expect("rebuild from the oldest");
        let stuck = store.states(&KeyScope::new("default", "test", "stuck"));
        assert_eq!(stuck.len(), 1, "{strategy:?}");
        assert_eq!(stuck[0].calls.len(), 1, "{strategy:?}: the lookup's record");
        drop((store, log));

        let (second, outputs) = process(dir.path(), shape, &toml, &gate, &[]).await;
        assert_eq!((second.completed, outputs.len()), (1, 1), "{strategy:?}");
        assert_eq!(
            mock.counts().for_route("/tools/orders.lookup"),
            1,
            "{strategy:?}: the recorded call never ran again"
        );
    }
}

/// A checkpoint that fails is an error in the log; five in a row stop the run, saying why,
/// instead of running on while nothing is pruned or let go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checkpoints_failing_in_a_row_stop_the_run_naming_the_cause() {
    use rewind_host::checkpoint::LogCheckpoints;
    use rewind_host::log::MemoryLog;

    let toml = agent_toml("caller", "", "");
    let agent = Arc::new(
        Agent::builder(agent_file(&toml), sandbox())
            .build()
            .expect("agent"),
    );
    // A log whose records are too small for even a checkpoint's parts.
    let log: Arc<dyn Log> = Arc::new(MemoryLog::new(1).with_max_record(64));
    let checkpointing = Checkpointing {
        store: Arc::new(LogCheckpoints::new(log, 0)),
        every_inputs: Some(2),
        every: None,
        keep: 3,
        retention: Vec::new(),
    };
    let lines: Vec<_> = (0..30)
        .map(|i| {
            Ok(InputLine {
                id: None,
                line: i + 1,
                key: format!("k{i}"),
                payload: "{}".to_owned(),
            })
        })
        .collect();
    let mut sink = JsonlSink::new(Vec::new());
    let error = run_inputs(
        agent,
        futures_util::stream::iter(lines),
        &mut sink,
        &(),
        RunOptions {
            checkpointing: Some(&checkpointing),
            resume: None,
            commands: None,
            until_waits_end: false,
            end_when_held: false,
            deltas: None,
        },
    )
    .await
    .expect_err("the run stops");
    let message = error.to_string();
    assert!(
        message.contains("5 checkpoints in a row failed") && message.contains("too small"),
        "{message}"
    );
    // Typed to its cause: the checkpoint store's error, kept as the source.
    let failing = error
        .get_ref()
        .and_then(|e| e.downcast_ref::<rewind_host::keys::CheckpointsFailing>())
        .expect("the run's error is the checkpoints failing");
    assert!(
        matches!(failing.last, rewind_host::keys::CheckpointFailed::Save(_)),
        "{failing:?}"
    );
}
