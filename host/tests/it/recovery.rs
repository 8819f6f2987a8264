//! Checkpoints and recovery through the scheduler, over the file log.

use std::path::Path;
use std::sync::Arc;

use rewind_host::agent::input::InputLine;
use rewind_host::agent::{Agent, Checkpointing, JsonlSink, RunOptions, Summary, run_inputs};
use rewind_host::checkpoint::{CheckpointStore, FileCheckpoints};
use rewind_host::log::{FileLog, FileLogOptions, Log};
use rewind_host::store::{ActionStateStore, KeyScope, LogStore, MarkerStrategy};
use serde_json::{Value, json};

use crate::support::{Counting, agent_file, agent_toml, sandbox};

/// One "process": opens the state directory, recovers from its newest checkpoint, runs the
/// inputs, checkpoints at the end. Returns the summary and the outputs it wrote.
async fn process(
    state: &Path,
    strategy: MarkerStrategy,
    toml: &str,
    gate: &Arc<Counting>,
    lines: &[Value],
) -> (Summary, Vec<Value>) {
    let (log, _) = FileLog::open(
        &state.join("log"),
        FileLogOptions {
            partitions: 4,
            ..FileLogOptions::default()
        },
    )
    .expect("open log");
    let log: Arc<dyn Log> = Arc::new(log);
    let checkpoints = Arc::new(FileCheckpoints::new(state.join("checkpoints")));
    let latest = checkpoints.latest().await.expect("latest");
    let store = Arc::new(LogStore::new(Arc::clone(&log), strategy));
    let marker = match &latest {
        Some(c) => c.marker.clone(),
        None => rewind_host::store::Marker {
            offsets: vec![0; 4],
        },
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
            .store(store)
            .function("gate", gate.clone())
            .build()
            .expect("agent"),
    );
    let checkpointing = Checkpointing {
        store: checkpoints,
        every_inputs: None,
        every: None,
        keep: 3,
        retention: Some(log),
    };
    let lines: Vec<_> = lines
        .iter()
        .enumerate()
        .map(|(i, line)| {
            Ok(InputLine {
                line: i + 1,
                key: line["key"].as_str().expect("key").to_owned(),
                payload: line["payload"].to_string(),
            })
        })
        .collect();
    let mut sink = JsonlSink::new(Vec::new());
    let summary = run_inputs(
        agent,
        lines.into_iter(),
        &mut sink,
        &(),
        RunOptions {
            checkpointing: Some(&checkpointing),
            resume: latest.as_ref(),
        },
    )
    .await
    .expect("run");
    let outputs = String::from_utf8(sink.into_inner())
        .expect("utf-8")
        .lines()
        .map(|l| serde_json::from_str(l).expect("JSON"))
        .collect();
    (summary, outputs)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pending_call_survives_repeated_checkpoint_restore_and_completes() {
    for strategy in [MarkerStrategy::Refresh, MarkerStrategy::Offsets] {
        let mock = rewind_mock::MockService::start("127.0.0.1:0".parse().expect("addr"))
            .await
            .expect("mock");
        let dir = tempfile::tempdir().expect("tempdir");
        let toml = agent_toml(
            "caller",
            "",
            &format!(
                "[functions.lookup]\nkind = \"http\"\nurl = \"{}/tools/orders.lookup\"\n\n[functions.gate]\nkind = \"custom\"\n",
                mock.base_url()
            ),
        );
        // The gate is down for the first two processes: each ends with the action pending
        // after its real call, and takes a checkpoint that says so.
        let gate = Counting::unavailable_first(2);
        let line = json!({ "key": "ana", "payload": { "calls": [
            { "function": "lookup", "args": { "order_id": "A1234" } },
            { "function": "gate", "args": {} },
        ] } });
        let lines = [line];

        let (first, _) = process(dir.path(), strategy, &toml, &gate, &lines).await;
        assert_eq!(first.failed.len(), 1, "{strategy:?}: {first:?}");
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

        let (second, _) = process(dir.path(), strategy, &toml, &gate, &[]).await;
        assert_eq!(
            second.failed.len(),
            1,
            "{strategy:?}: restored once, still pending"
        );

        let (third, outputs) = process(dir.path(), strategy, &toml, &gate, &[]).await;
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
    let (first, outputs) = process(dir.path(), MarkerStrategy::Offsets, &toml, &gate, &lines).await;
    assert_eq!((first.completed, outputs.len()), (20, 20));
    let (again, outputs) = process(dir.path(), MarkerStrategy::Offsets, &toml, &gate, &lines).await;
    assert_eq!((again.inputs, outputs.len()), (0, 0), "{again:?}");
    assert_eq!(gate.calls(), 20);
}
