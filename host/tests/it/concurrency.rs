//! Many keys at once, one input per key at a time.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use futures_util::StreamExt as _;
use rewind_host::agent::input::InputLine;
use rewind_host::agent::{BlockedInputs, JsonlSink, Progress, RunOptions, run_inputs};
use rewind_host::event::Input;
use serde_json::{Value, json};

use crate::support::{agent_toml, agent_with, memory_store};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_inputs_over_fifty_keys_keep_per_key_order_and_each_output_appears_once() {
    let agent = Arc::new(agent_with(
        &agent_toml("caller", "parallelism = 16", ""),
        memory_store(),
        &[],
    ));
    // Each input reads the value its key's previous input wrote, then writes its own index:
    // if inputs of a key ran out of order or at once, some input would read the wrong value.
    let mut per_key = BTreeMap::<String, u64>::new();
    let lines: Vec<_> = (0..1000)
        .map(|i| {
            let key = format!("key-{}", i % 50);
            let n = per_key.entry(key.clone()).or_default();
            *n += 1;
            let payload = json!({ "memory_get": ["last"], "memory_set": { "last": *n } });
            Ok(InputLine {
                id: None,
                line: i + 1,
                key,
                payload: payload.to_string(),
            })
        })
        .collect();
    let mut sink = JsonlSink::new(Vec::new());
    let summary = run_inputs(
        agent,
        futures_util::stream::iter(lines),
        &mut sink,
        &(),
        RunOptions::default(),
    )
    .await
    .expect("run");
    assert_eq!(
        (summary.inputs, summary.completed, summary.outputs),
        (1000, 1000, 1000),
        "{summary:?}"
    );
    assert_eq!(summary.duplicates, 0, "no input produced its output twice");

    let written = String::from_utf8(sink.into_inner()).expect("utf-8");
    let mut ids = BTreeSet::new();
    for line in written.lines() {
        let line: Value = serde_json::from_str(line).expect("JSON line");
        assert!(
            ids.insert(line["id"].as_str().expect("id").to_owned()),
            "duplicate output {line}"
        );
        let sequence = line["sequence"].as_u64().expect("sequence");
        let previous = &line["payload"]["memory"]["last"];
        if sequence == 1 {
            assert!(previous.is_null(), "{line}");
        } else {
            assert_eq!(
                previous.as_u64(),
                Some(sequence - 1),
                "out of order: {line}"
            );
        }
    }
    assert_eq!(ids.len(), 1000);
}

#[tokio::test]
async fn a_failed_input_blocks_the_later_inputs_of_its_key_only() {
    let agent = Arc::new(agent_with(
        &agent_toml("caller", "", ""),
        memory_store(),
        &[],
    ));
    let line = |n: usize, key: &str, payload: Value| {
        Ok(InputLine {
            id: None,
            line: n,
            key: key.to_owned(),
            payload: payload.to_string(),
        })
    };
    let lines = vec![
        line(1, "a", json!({})),
        line(2, "a", json!({ "fail": "the model refused" })),
        line(3, "a", json!({})),
        line(4, "b", json!({})),
    ];
    let mut sink = JsonlSink::new(Vec::new());
    let summary = run_inputs(
        agent,
        futures_util::stream::iter(lines),
        &mut sink,
        &(),
        RunOptions::default(),
    )
    .await
    .expect("run");
    assert_eq!(summary.completed, 2, "a #1 and b #1: {summary:?}");
    let failures: Vec<String> = summary.failed.iter().map(ToString::to_string).collect();
    assert_eq!(failures.len(), 1, "{failures:?}");
    assert!(
        failures[0].contains("a #2") && failures[0].contains("the model refused"),
        "{failures:?}"
    );
    assert_eq!(
        summary.blocked.get("a"),
        Some(&BlockedInputs {
            behind: 2,
            inputs: 1,
            first: 3,
            last: 3
        }),
        "{summary:?}"
    );
}

/// Counts finished inputs and says when `until` of them have.
struct Finished {
    count: AtomicUsize,
    until: usize,
    reached: tokio::sync::Notify,
}

impl Progress for Finished {
    fn finished(&self, _input: &Input, _completed: bool) {
        if self.count.fetch_add(1, Ordering::SeqCst) + 1 == self.until {
            self.reached.notify_one();
        }
    }
}

/// A cluster partition reads a stream that waits for more, and stops when its host lets it
/// go. Behind a failed input, its key's later inputs must neither hold intake (other keys
/// would never be read) nor keep the partition from stopping.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_stream_with_a_failed_key_runs_the_others_and_stops_when_told() {
    let agent = Arc::new(agent_with(
        &agent_toml("caller", "", ""),
        memory_store(),
        &[],
    ));
    let mut lines = vec![json!({ "fail": "the first input fails" })];
    lines.extend((0..700).map(|_| json!({})));
    let mut lines: Vec<_> = lines
        .into_iter()
        .enumerate()
        .map(|(i, payload)| {
            Ok(InputLine {
                id: None,
                line: i + 1,
                key: "k".to_owned(),
                payload: payload.to_string(),
            })
        })
        .collect();
    lines.extend((0..50).map(|i| {
        Ok(InputLine {
            id: None,
            line: 702 + i,
            key: format!("other-{}", i % 10),
            payload: "{}".to_owned(),
        })
    }));
    let progress = Finished {
        count: AtomicUsize::new(0),
        until: lines.len(),
        reached: tokio::sync::Notify::new(),
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let waiting = futures_util::stream::iter(lines)
        .chain(futures_util::stream::pending())
        .take_until(stopped);
    let mut sink = JsonlSink::new(Vec::new());
    let run = run_inputs(
        agent,
        Box::pin(waiting),
        &mut sink,
        &progress,
        RunOptions::default(),
    );
    let tell = async {
        progress.reached.notified().await;
        let _ = stop.send(());
    };
    // Only a run that never stops reaches this bound.
    let (summary, ()) =
        tokio::time::timeout(Duration::from_secs(300), async { tokio::join!(run, tell) })
            .await
            .expect("the run stopped when told");
    let summary = summary.expect("run");
    assert_eq!(
        (summary.completed, summary.outputs, summary.blocked_inputs()),
        (50, 50, 700),
        "{summary:?}"
    );
}
