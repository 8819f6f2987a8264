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
pub(super) fn run_to_the_end(dir: &Path, agent: &Path, input: &Path) -> Output {
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
            "{} accepted, 50 completed, 1 parked, 0 at a durable wait, {blocked} waiting behind an \
             earlier input of their key, 0 malformed lines; 1 failed attempts retried",
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

/// What the run says of a parked input and the inputs behind it (that ten thousand of them
/// stall no other key is the drivers suite's, for every front end).
#[test]
fn a_parked_input_holds_back_only_its_own_key_and_the_run_ends() {
    blocked_behind_one_failure(700);
}

/// `rewind inspect --state .rewind` in `dir`, its standard output.
pub(super) fn inspect(dir: &Path) -> String {
    let out = rewind(dir).arg("inspect").output().expect("inspect runs");
    assert!(out.status.success(), "{}", text(&out.stderr));
    text(&out.stdout)
}

#[test]
fn a_skip_or_cancel_left_with_no_run_going_is_carried_out_by_the_next_run_and_inspect_shows_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let agent = caller_agent(dir.path(), "[retry]\nattempts = 2\ninitial-ms = 1\n");
    let lines = "{\"key\":\"k\",\"payload\":{\"fail\":\"the payload is bad\"}}\n\
                 {\"key\":\"k\",\"payload\":{}}\n{\"key\":\"k\",\"payload\":{}}\n\
                 {\"key\":\"j\",\"payload\":{\"fail\":\"never works\"}}\n";
    let input = write(dir.path(), "in.jsonl", lines);
    let first = run_to_the_end(dir.path(), &agent, &input);
    assert_eq!(first.status.code(), Some(1), "{}", text(&first.stderr));
    let shown = inspect(dir.path());
    assert!(
        shown.contains(
            "input k #1: parked after 2 attempts: action `work`: the action returned an \
             error: the payload is bad; 2 inputs (#2 to #3) wait behind it"
        ),
        "{shown}"
    );

    let skip = rewind(dir.path())
        .args([
            "skip",
            "--key",
            "k",
            "--by",
            "alice",
            "--reason",
            "bad payload",
        ])
        .output()
        .expect("skip runs");
    let said = text(&skip.stderr);
    assert!(
        skip.status.success() && said.contains("left command"),
        "{said}"
    );
    let cancel = rewind(dir.path())
        .args([
            "cancel",
            "--key",
            "j",
            "--by",
            "carol",
            "--reason",
            "withdrawn",
        ])
        .output()
        .expect("cancel runs");
    assert!(cancel.status.success(), "{}", text(&cancel.stderr));
    let stray = rewind(dir.path())
        .args(["retry", "--key", "nobody", "--by", "bob"])
        .output()
        .expect("retry runs");
    assert!(stray.status.success(), "{}", text(&stray.stderr));
    assert!(
        inspect(dir.path()).contains("pending: skip of key k by alice"),
        "the commands wait for a run"
    );

    let second = run_to_the_end(dir.path(), &agent, &input);
    let said = text(&second.stderr);
    assert!(second.status.success(), "{said}");
    assert!(
        said.contains("operator: skip of key k by alice: done (#1)"),
        "{said}"
    );
    assert!(
        said.contains("operator: cancel of key j by carol: done (#1)"),
        "{said}"
    );
    assert!(
        said.contains(
            "operator: retry of key nobody by bob: refused: key nobody has no parked input"
        ),
        "{said}"
    );
    let outputs = std::fs::read_to_string(dir.path().join("out.jsonl")).expect("outputs");
    let sequences: Vec<u64> = outputs
        .lines()
        .map(|line| {
            let output: Value = serde_json::from_str(line).expect("an output line");
            output["sequence"].as_u64().expect("a sequence")
        })
        .collect();
    assert_eq!(
        sequences,
        [2, 3],
        "the skipped input never ran; the others once"
    );

    let shown = inspect(dir.path());
    assert!(
        shown.contains("skipped: k #1 by alice: bad payload"),
        "{shown}"
    );
    assert!(
        shown.contains("cancelled: j #1 by carol: withdrawn"),
        "{shown}"
    );
    assert!(
        shown.contains("skip of key k by alice: done (#1)"),
        "{shown}"
    );
    assert!(
        !shown.contains("input k #") && !shown.contains("input j #"),
        "nothing of k or j is unfinished: {shown}"
    );
}

#[test]
fn a_command_on_a_directory_with_no_state_is_refused_naming_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = rewind(dir.path())
        .args(["skip", "--key", "k", "--reason", "r"])
        .output()
        .expect("skip runs");
    let said = text(&out.stderr);
    assert!(!out.status.success(), "{said}");
    assert!(said.contains(".rewind holds no state"), "{said}");
}
