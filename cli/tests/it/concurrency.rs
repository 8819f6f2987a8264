//! Many keys at once, one input per key at a time.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use futures_util::StreamExt as _;
use rewind_host::agent::input::{InputLine, LineError};
use rewind_host::agent::{Agent, JsonlSink};
use rewind_host::event::Input;
use rewind_host::keys::{Progress, RunOptions, Summary, WaitingInputs, run_inputs};
use serde_json::{Value, json};

use crate::support::{Counting, agent_toml, agent_with, memory_store};

/// An input line: the `n`-th of the file, for `key`.
fn line(n: usize, key: &str, payload: &Value) -> Result<InputLine, LineError> {
    Ok(InputLine {
        id: None,
        line: n,
        key: key.to_owned(),
        payload: payload.to_string(),
    })
}

/// Runs `lines` through `agent` to their end; the summary and the outputs written.
async fn run_lines(
    agent: Arc<Agent>,
    lines: Vec<Result<InputLine, LineError>>,
) -> (Summary, String) {
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
    (
        summary,
        String::from_utf8(sink.into_inner()).expect("utf-8"),
    )
}

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
            line(i + 1, &key, &payload)
        })
        .collect();
    let (summary, written) = run_lines(agent, lines).await;
    assert_eq!(
        (summary.inputs, summary.completed, summary.outputs),
        (1000, 1000, 1000),
        "{summary:?}"
    );
    assert_eq!(summary.duplicates, 0, "no input produced its output twice");

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

/// Retries that wait no more than a few milliseconds.
const QUICK_RETRIES: &str = "[retry]\nattempts = 3\ninitial-ms = 1\nmax-ms = 4\n";

#[tokio::test]
async fn a_failed_input_is_retried_then_parked_and_only_its_keys_later_inputs_wait() {
    let agent = Arc::new(agent_with(
        &agent_toml("caller", "", QUICK_RETRIES),
        memory_store(),
        &[],
    ));
    let lines = vec![
        line(1, "a", &json!({})),
        line(2, "a", &json!({ "fail": "the model refused" })),
        line(3, "a", &json!({})),
        line(4, "b", &json!({})),
    ];
    let (summary, _) = run_lines(agent, lines).await;
    assert_eq!(summary.completed, 2, "a #1 and b #1: {summary:?}");
    assert_eq!(summary.retries, 2, "three attempts: {summary:?}");
    assert_eq!(summary.runs, 2 + 3, "{summary:?}");
    let parked: Vec<String> = summary.parked.iter().map(ToString::to_string).collect();
    assert_eq!(parked.len(), 1, "{parked:?}");
    assert!(
        parked[0].contains("a #2") && parked[0].contains("the model refused"),
        "{parked:?}"
    );
    assert_eq!(
        summary.waiting.get("a"),
        Some(&WaitingInputs {
            behind: 2,
            inputs: 1,
            first: 3,
            last: 3
        }),
        "{summary:?}"
    );
}

/// A retry serves the calls recorded by the attempts before it: a function that answered
/// once is not called again, and the input completes once the one that was down answers.
#[tokio::test]
async fn a_retry_makes_no_call_again_that_an_earlier_attempt_recorded() {
    let pay = Counting::unavailable_first_of(2, "down");
    let agent = Arc::new(agent_with(
        &agent_toml("caller", "", QUICK_RETRIES),
        memory_store(),
        &[("pay", Arc::clone(&pay) as _)],
    ));
    let payload = json!({ "calls": [
        { "function": "pay", "args": { "step": "charge" } },
        { "function": "pay", "args": { "step": "down" } },
    ] });
    let (summary, _) = run_lines(agent, vec![line(1, "k", &payload)]).await;
    assert_eq!(
        (summary.completed, summary.retries, summary.outputs),
        (1, 2, 1),
        "{summary:?}"
    );
    let args = pay.args();
    let charged = args.iter().filter(|a| a.contains("charge")).count();
    assert_eq!(
        charged, 1,
        "the recorded call was served on each retry: {args:?}"
    );
    assert_eq!(
        args.len(),
        1 + 3,
        "the call that was down, once per attempt: {args:?}"
    );
    assert_eq!(summary.calls.replayed, 2, "{summary:?}");
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
/// go. Behind a parked input, its key's later inputs must neither hold intake (other keys
/// would never be read) nor keep the partition from stopping.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_stream_with_a_parked_key_runs_the_others_and_stops_when_told() {
    let agent = Arc::new(agent_with(
        &agent_toml("caller", "", QUICK_RETRIES),
        memory_store(),
        &[],
    ));
    let mut lines = vec![json!({ "fail": "the first input fails" })];
    lines.extend((0..700).map(|_| json!({})));
    let mut lines: Vec<_> = lines
        .into_iter()
        .enumerate()
        .map(|(i, payload)| line(i + 1, "k", &payload))
        .collect();
    lines.extend((0..50).map(|i| line(702 + i, &format!("other-{}", i % 10), &json!({}))));
    // The parked input and the other keys' 50: the 700 behind it never finish.
    let progress = Finished {
        count: AtomicUsize::new(0),
        until: 51,
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
        (summary.completed, summary.outputs, summary.waiting_inputs()),
        (50, 50, 700),
        "{summary:?}"
    );
}
