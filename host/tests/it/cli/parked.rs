//! `rewind run` with an input that fails: it is retried, then parked; its key's later
//! inputs wait, every other key runs, and the run ends.

use std::fmt::Write as _;
use std::path::Path;
use std::process::{Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use super::{caller_agent, rewind, text, write};

/// Far longer than the run takes: only a run that waits for ever reaches it.
const HANG: Duration = Duration::from_secs(300);

/// `rewind run` over `input`, killed (and the test failed) if it has not ended by [`HANG`].
fn run_to_the_end(dir: &Path, agent: &Path, input: &Path) -> Output {
    let mut child = rewind(dir)
        .arg("run")
        .arg(agent)
        .arg("--input")
        .arg(input)
        .arg("--output")
        .arg(dir.join("out.jsonl"))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("rewind runs");
    let started = Instant::now();
    while child.try_wait().expect("wait").is_none() {
        if started.elapsed() > HANG {
            let _ = child.kill();
            let out = child.wait_with_output().expect("output");
            panic!(
                "rewind run still running after {HANG:?}; stderr:\n{}",
                text(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    child.wait_with_output().expect("output")
}

/// One failing input on key `k`, `blocked` more on `k`, then 50 on other keys.
fn blocked_behind_one_failure(blocked: usize) {
    let dir = tempfile::tempdir().expect("tempdir");
    let agent = caller_agent(dir.path(), "[retry]\nattempts = 2\ninitial-ms = 1\n");
    let mut lines =
        String::from("{\"key\":\"k\",\"payload\":{\"fail\":\"the first input fails\"}}\n");
    for _ in 0..blocked {
        lines.push_str("{\"key\":\"k\",\"payload\":{}}\n");
    }
    for i in 0..50 {
        writeln!(lines, "{{\"key\":\"other-{}\",\"payload\":{{}}}}", i % 10).expect("write");
    }
    let input = write(dir.path(), "in.jsonl", &lines);

    let out = run_to_the_end(dir.path(), &agent, &input);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    let outputs = std::fs::read_to_string(dir.path().join("out.jsonl")).expect("outputs");
    let keys: Vec<String> = outputs
        .lines()
        .map(|line| {
            let output: Value = serde_json::from_str(line).expect("an output line");
            output["key"].as_str().expect("a key").to_owned()
        })
        .collect();
    assert_eq!(keys.len(), 50, "every other key's input ran once: {stderr}");
    assert!(keys.iter().all(|key| key != "k"), "{keys:?}");
    assert!(
        stderr.contains(&format!(
            "{} accepted, 50 completed, 1 parked, {blocked} waiting behind a parked input, 0 \
             malformed lines; 1 failed attempts retried",
            blocked + 51
        )),
        "{stderr}"
    );
    assert!(
        stderr.contains(&format!(
            "waiting: k: {blocked} inputs (#2 to #{}) not run, because #1 of this key did not \
             complete first",
            blocked + 1
        )),
        "{stderr}"
    );
    assert!(
        stderr.contains(
            "parked: k #1: action `work`: the action returned an error: the first \
             input fails"
        ),
        "{stderr}"
    );
    assert!(
        stderr.contains("running the same command again (on the same --state) retries"),
        "{stderr}"
    );
    assert!(
        stderr.lines().count() < 30,
        "one line for the blocked key, not one per input: {stderr}"
    );
}

#[test]
fn a_parked_input_holds_back_only_its_own_key_and_the_run_ends() {
    blocked_behind_one_failure(700);
}

#[test]
fn ten_thousand_inputs_waiting_behind_a_parked_one_do_not_stop_the_run() {
    blocked_behind_one_failure(10_000);
}
