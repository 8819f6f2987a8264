//! Many keys at once, one input per key at a time.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use rewind_host::agent::input::InputLine;
use rewind_host::agent::{JsonlSink, RunOptions, run_inputs};
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
    assert_eq!(failures.len(), 2, "{failures:?}");
    assert!(
        failures
            .iter()
            .any(|f| f.contains("a #2") && f.contains("the model refused")),
        "{failures:?}"
    );
    assert!(
        failures
            .iter()
            .any(|f| f.contains("a #3") && f.contains("input #2 of this key failed")),
        "{failures:?}"
    );
}
