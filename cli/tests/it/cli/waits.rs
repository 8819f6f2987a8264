//! `rewind run` with durable waits: a run ends once only waiting inputs are left, and a
//! later run (or `--wait`) goes on with them when their time comes or a signal they wait
//! for is delivered with `rewind signal`.

use std::path::{Path, PathBuf};
use std::process::{Child, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::{rewind, text, write};
use crate::support::guest;

/// The exit code of a run that ended with inputs at a wait.
const WAITS_PENDING: i32 = 3;

/// An agent whose action (`caller`, a test guest: "caller", "caller_py" or "caller_js")
/// may wait for `approve` or `reject`, with a clock function.
fn agent(dir: &Path, caller: &str) -> PathBuf {
    write(
        dir,
        "agent.toml",
        &format!(
            "name = \"cli\"\n[[actions]]\nname = \"work\"\ncomponent = {:?}\non = \
             [\"input\"]\nsignals = [\"approve\", \"reject\"]\n[functions.clock]\nkind = \
             \"time\"\n",
            guest(caller).display().to_string()
        ),
    )
}

/// The tests each SDK is held to: its waits, through the caller guest in its language.
macro_rules! in_every_sdk {
    ($($test:ident),* $(,)?) => {
        mod rust {
            $(#[test]
            fn $test() {
                super::$test("caller")
            })*
        }
        mod python {
            $(#[test]
            fn $test() {
                super::$test("caller_py")
            })*
        }
        mod javascript {
            $(#[test]
            fn $test() {
                super::$test("caller_js")
            })*
        }
    };
}

in_every_sdk!(
    a_sleep_ends_the_run_blocks_only_its_key_and_fires_once_its_time_has_come,
    a_signal_delivered_between_runs_is_taken_by_the_next_once_per_id,
);

fn lines(inputs: &[(&str, Value)]) -> String {
    inputs
        .iter()
        .map(|(key, payload)| format!("{}\n", json!({ "key": key, "payload": payload })))
        .collect()
}

fn run(dir: &Path, agent: &Path, input: &Path, more: &[&str]) -> Output {
    start(dir, agent, input, more)
        .wait_with_output()
        .expect("rewind run ends")
}

fn start(dir: &Path, agent: &Path, input: &Path, more: &[&str]) -> Child {
    rewind(dir)
        .arg("run")
        .arg(agent)
        .arg("--input")
        .arg(input)
        .arg("--output")
        .arg(dir.join("out.jsonl"))
        .args(more)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("rewind runs")
}

/// `rewind signal` for `key`, waiting up to a minute for its outcome when `wait`.
fn signal(dir: &Path, key: &str, args: &[&str], wait: bool) -> Output {
    let mut command = rewind(dir);
    command.args(["signal", "--key", key]).args(args);
    if wait {
        command.args(["--wait", "60"]);
    }
    command.output().expect("rewind signal runs")
}

/// The payloads of the outputs written so far.
fn outputs(dir: &Path) -> Vec<Value> {
    std::fs::read_to_string(dir.join("out.jsonl"))
        .unwrap_or_default()
        .lines()
        .map(|line| {
            let output: Value = serde_json::from_str(line).expect("an output line");
            output["payload"].clone()
        })
        .collect()
}

fn output_of<'a>(outputs: &'a [Value], key: &str, sequence: u64) -> &'a Value {
    outputs
        .iter()
        .find(|o| o["key"] == key && o["sequence"] == sequence)
        .unwrap_or_else(|| panic!("no output for {key} #{sequence} in {outputs:#?}"))
}

/// The keys with an unfinished input in the state's newest checkpoint.
fn pending_keys(dir: &Path) -> Vec<String> {
    let out = rewind(dir)
        .args(["inspect", "--json"])
        .output()
        .expect("inspect");
    let shown: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    shown["inputs"]
        .as_array()
        .map(|inputs| {
            (inputs.iter())
                .filter_map(|input| input["key"].as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

fn clock_ms(result: &Value) -> u64 {
    result["ok"]["unix_ms"].as_u64().expect("a clock reading")
}

fn a_sleep_ends_the_run_blocks_only_its_key_and_fires_once_its_time_has_come(caller: &str) {
    let dir = tempfile::tempdir().expect("tempdir");
    let agent = agent(dir.path(), caller);
    let sleeper = json!({ "calls": [
        { "function": "clock" }, { "sleep_ms": 1500 }, { "function": "clock" },
    ]});
    let input = write(
        dir.path(),
        "in.jsonl",
        &lines(&[("k", sleeper), ("k", json!({})), ("other", json!({}))]),
    );

    let first = run(dir.path(), &agent, &input, &[]);
    let stderr = text(&first.stderr);
    assert_eq!(first.status.code(), Some(WAITS_PENDING), "{stderr}");
    assert!(
        stderr.contains(
            "3 accepted, 1 completed, 0 parked, 1 at a durable wait, 1 waiting behind an earlier \
             input of their key"
        ),
        "{stderr}"
    );
    assert!(
        stderr.contains("at a wait: k #1: action `work` waits until 20"),
        "{stderr}"
    );
    assert!(
        stderr.contains("the next wait's time comes at 20"),
        "{stderr}"
    );
    let written = outputs(dir.path());
    assert_eq!(
        written.len(),
        1,
        "only the other key's input completed: {written:#?}"
    );
    assert_eq!(written[0]["key"], "other");

    let inspect = rewind(dir.path()).arg("inspect").output().expect("inspect");
    assert!(
        text(&inspect.stdout).contains("input k #1: at a durable wait: action `work` waits until"),
        "{}",
        text(&inspect.stdout)
    );

    // Until its time, a run arms the wait again and does not run the input.
    let again = run(dir.path(), &agent, &input, &["--wait"]);
    let stderr = text(&again.stderr);
    assert_eq!(again.status.code(), Some(0), "{stderr}");
    let written = outputs(dir.path());
    assert_eq!(written.len(), 3, "{written:#?}");
    let results = output_of(&written, "k", 1)["results"]
        .as_array()
        .expect("results")
        .clone();
    assert_eq!(results[1], json!({ "slept": true }));
    let (before, after) = (clock_ms(&results[0]), clock_ms(&results[2]));
    assert!(
        after >= before + 1500,
        "the sleep ended {} ms after it began, before its 1500",
        after - before
    );
    output_of(&written, "k", 2);
    assert!(
        stderr.contains("calls: 1 made, 1 served from records"),
        "the clock before the sleep was served, the one after it made: {stderr}"
    );
}

fn a_signal_delivered_between_runs_is_taken_by_the_next_once_per_id(caller: &str) {
    let dir = tempfile::tempdir().expect("tempdir");
    let agent = agent(dir.path(), caller);
    let waiter = json!({ "calls": [
        { "await": ["approve", "reject"] },
        { "await": ["approve"], "timeout_ms": 300 },
    ]});
    let input = write(dir.path(), "in.jsonl", &lines(&[("k", waiter)]));

    let first = run(dir.path(), &agent, &input, &[]);
    let stderr = text(&first.stderr);
    assert_eq!(first.status.code(), Some(WAITS_PENDING), "{stderr}");
    assert!(
        stderr.contains("at a wait: k #1: action `work` waits for signal approve or reject"),
        "{stderr}"
    );

    // Sent twice under one id, between runs: left for the next run, delivered once.
    for _ in 0..2 {
        let sent = signal(
            dir.path(),
            "k",
            &[
                "--name",
                "approve",
                "--payload",
                r#"{"by":"ana"}"#,
                "--id",
                "approval-1",
            ],
            false,
        );
        assert!(sent.status.success(), "{}", text(&sent.stderr));
    }
    let second = run(dir.path(), &agent, &input, &["--wait"]);
    let stderr = text(&second.stderr);
    assert_eq!(second.status.code(), Some(0), "{stderr}");
    let written = outputs(dir.path());
    let results = &output_of(&written, "k", 1)["results"];
    assert_eq!(
        results,
        &json!([
            { "signal": { "name": "approve", "payload": { "by": "ana" } } },
            { "timed_out": true },
        ]),
        "the signal is taken by the first wait only: {stderr}"
    );

    // The input is finished: a signal for it is refused, and goes to no later input.
    let late = signal(
        dir.path(),
        "k",
        &["--sequence", "1", "--name", "approve"],
        false,
    );
    assert!(late.status.success(), "{}", text(&late.stderr));
    let input = write(
        dir.path(),
        "in.jsonl",
        &lines(&[
            (
                "k",
                json!({ "calls": [{ "await": ["approve", "reject"] }] }),
            ),
            (
                "k",
                json!({ "calls": [{ "await": ["approve", "reject"] }] }),
            ),
        ]),
    );
    let third = run(dir.path(), &agent, &input, &[]);
    let stderr = text(&third.stderr);
    assert_eq!(third.status.code(), Some(WAITS_PENDING), "{stderr}");
    assert!(
        stderr.contains("operator: signal of key k #1 `approve` by")
            && stderr.contains("refused: input #1 of key k is finished"),
        "{stderr}"
    );
    assert!(
        stderr.contains("at a wait: k #2: action `work` waits for signal approve or reject"),
        "the new input did not take the late signal: {stderr}"
    );

    // The first signal sent once more, to the key, by a client that lost the answer: a
    // process that never saw it knows it from the key's index of signal ids (it went to
    // #1), and #2 does not take it.
    let again = signal(
        dir.path(),
        "k",
        &["--name", "approve", "--id", "approval-1"],
        false,
    );
    assert!(again.status.success(), "{}", text(&again.stderr));
    let fourth = run(dir.path(), &agent, &input, &[]);
    let stderr = text(&fourth.stderr);
    assert_eq!(fourth.status.code(), Some(WAITS_PENDING), "{stderr}");
    assert!(
        stderr.contains("at a wait: k #2: action `work` waits for signal approve or reject"),
        "the repeat went to #1, not to #2: {stderr}"
    );
}

#[test]
fn a_signal_to_a_running_state_wakes_its_wait_and_one_sent_early_is_kept_for_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let agent = agent(dir.path(), "caller");
    let input = write(
        dir.path(),
        "in.jsonl",
        &lines(&[
            ("waits", json!({ "calls": [{ "await": ["reject"] }] })),
            (
                "early",
                json!({ "calls": [{ "sleep_ms": 1000 }, { "await": ["approve"] }] }),
            ),
        ]),
    );
    let mut child = start(dir.path(), &agent, &input, &["--wait"]);
    // A signal for a key is refused until the run has its input: wait for a checkpoint
    // that holds both.
    let started = Instant::now();
    while pending_keys(dir.path()).len() < 2 {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the run took no checkpoint holding its two inputs"
        );
        std::thread::sleep(Duration::from_millis(50));
    }

    let early = signal(dir.path(), "early", &["--name", "approve"], true);
    assert!(early.status.success(), "{}", text(&early.stderr));
    assert!(
        text(&early.stderr).contains("signal of key early `approve`"),
        "{}",
        text(&early.stderr)
    );
    let refused = signal(dir.path(), "waits", &["--name", "nope"], true);
    assert_eq!(refused.status.code(), Some(1), "{}", text(&refused.stderr));
    assert!(
        text(&refused.stderr).contains("no action of agent `cli` declares signal `nope`"),
        "{}",
        text(&refused.stderr)
    );
    let reject = signal(
        dir.path(),
        "waits",
        &["--name", "reject", "--payload", "\"too costly\""],
        true,
    );
    assert!(reject.status.success(), "{}", text(&reject.stderr));

    let started = Instant::now();
    while child.try_wait().expect("wait").is_none() {
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "rewind run --wait did not end after both waits were over"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().expect("output");
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let written = outputs(dir.path());
    assert_eq!(
        output_of(&written, "waits", 1)["results"],
        json!([{ "signal": { "name": "reject", "payload": "too costly" } }])
    );
    assert_eq!(
        output_of(&written, "early", 1)["results"],
        json!([{ "slept": true }, { "signal": { "name": "approve", "payload": null } }])
    );
}

/// A run holds at most `parallelism` × 1,024 inputs at a wait: with that many it stops
/// reading (a file of a million approvals is not read into memory), ends, and the next run
/// goes on from the next line as waits end. (It reads on while inputs run toward their
/// waits: up to 64 per unit of parallelism more.)
#[test]
fn a_run_full_of_waits_stops_reading_and_the_next_goes_on_from_there() {
    let dir = tempfile::tempdir().expect("tempdir");
    let agent = agent(dir.path(), "caller");
    let toml = std::fs::read_to_string(&agent).expect("agent.toml");
    std::fs::write(&agent, format!("parallelism = 1\n{toml}")).expect("agent.toml");
    let waits: Vec<(String, Value)> = (0..1300)
        .map(|i| {
            (
                format!("k{i}"),
                json!({ "calls": [{ "await": ["approve"] }] }),
            )
        })
        .collect();
    let waits: Vec<(&str, Value)> = waits.iter().map(|(k, p)| (k.as_str(), p.clone())).collect();
    let input = write(dir.path(), "in.jsonl", &lines(&waits));

    let stopped_at = |said: &str| -> u64 {
        let at = said.split("stopped reading after line ").nth(1);
        let at = at.and_then(|rest| rest.split(':').next()?.parse().ok());
        at.unwrap_or_else(|| panic!("it did not stop reading: {said}"))
    };
    let first = run(dir.path(), &agent, &input, &[]);
    let said = text(&first.stderr);
    assert_eq!(first.status.code(), Some(WAITS_PENDING), "{said}");
    let line = stopped_at(&said);
    assert!((1024..=1024 + 64).contains(&line), "{said}");
    assert!(
        said.contains(&format!("{line} accepted, 0 completed")),
        "{said}"
    );

    // Below the bound again: the next run reads on, up to it.
    let ended = line - 1023;
    for k in 0..ended {
        let sent = signal(dir.path(), &format!("k{k}"), &["--name", "approve"], false);
        assert!(sent.status.success(), "{}", text(&sent.stderr));
    }
    let second = run(dir.path(), &agent, &input, &[]);
    let said = text(&second.stderr);
    assert_eq!(second.status.code(), Some(WAITS_PENDING), "{said}");
    assert!(said.contains(&format!("{ended} completed")), "{said}");
    let next = stopped_at(&said);
    assert!(
        next > line && next <= line + 65,
        "{line} then {next}: {said}"
    );
    assert_eq!(outputs(dir.path()).len() as u64, ended);
}

/// An input's inbox takes each signal once per id, up to its byte budget; another input's
/// inbox is its own; a name no action declares is refused.
#[tokio::test]
async fn an_inbox_takes_signals_once_per_id_up_to_its_byte_budget() {
    use rewind_host::agent::{MAX_INBOX_BYTES, SignalError, SignalIn};

    let toml = crate::support::agent_toml("caller", "", "signals = [\"approve\"]\n");
    let agent = crate::support::agent_with(&toml, crate::support::memory_store(), &[]);
    let signal = |id: usize, payload: &str| SignalIn {
        name: "approve".to_owned(),
        payload: payload.to_owned(),
        id: format!("s{id}"),
    };
    let big = format!("\"{}\"", "x".repeat(60 * 1024));
    let first = agent
        .deliver("k", 1, &signal(0, &big))
        .await
        .expect("taken");
    assert!(!first.repeat);
    let again = agent
        .deliver("k", 1, &signal(0, &big))
        .await
        .expect("taken");
    assert!(again.repeat, "one id, one signal");
    let mut n = 1;
    let refused = loop {
        match agent.deliver("k", 1, &signal(n, &big)).await {
            Ok(_) => n += 1,
            Err(error) => break error,
        }
    };
    assert!(matches!(refused, SignalError::Full { .. }), "{refused}");
    assert_eq!(n, MAX_INBOX_BYTES / big.len(), "as many as fit");
    let other = agent.deliver("k", 2, &signal(n, &big)).await;
    assert!(other.is_ok(), "another input's inbox is its own: {other:?}");
    let undeclared = SignalIn {
        name: "reject".to_owned(),
        ..signal(99, "{}")
    };
    let error = agent
        .deliver("k", 1, &undeclared)
        .await
        .expect_err("refused");
    assert!(
        error.to_string().contains("declares signal `reject`"),
        "{error}"
    );
}

/// An operator cancels an input at a wait: it is finished as cancelled at once (nothing it
/// did applied), and its key's next input runs.
#[test]
fn a_waiting_input_is_cancelled_and_its_key_goes_on() {
    let dir = tempfile::tempdir().expect("tempdir");
    let agent = agent(dir.path(), "caller");
    let input = write(
        dir.path(),
        "in.jsonl",
        &lines(&[
            (
                "k",
                json!({ "calls": [{ "await": ["approve"] }], "memory_set": { "n": 1 } }),
            ),
            ("k", json!({ "memory_get": ["n"] })),
        ]),
    );
    let first = run(dir.path(), &agent, &input, &[]);
    assert_eq!(
        first.status.code(),
        Some(WAITS_PENDING),
        "{}",
        text(&first.stderr)
    );
    let cancel = rewind(dir.path())
        .args(["cancel", "--key", "k", "--reason", "nobody will approve it"])
        .output()
        .expect("rewind cancel runs");
    assert!(cancel.status.success(), "{}", text(&cancel.stderr));
    let second = run(dir.path(), &agent, &input, &[]);
    let said = text(&second.stderr);
    assert_eq!(second.status.code(), Some(0), "{said}");
    assert!(said.contains("operator: cancel of key k by"), "{said}");
    let written = outputs(dir.path());
    assert_eq!(written.len(), 1, "only #2 gave an output: {written:#?}");
    assert_eq!(
        output_of(&written, "k", 2)["memory"],
        json!({ "n": null }),
        "the cancelled input's memory write was not applied"
    );
}
