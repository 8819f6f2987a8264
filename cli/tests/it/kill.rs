//! The `rewind` binary killed with SIGKILL and started again until done: at seeded random
//! moments, and at each durable boundary (`REWIND_CRASH_AT`, and a kill from the remote
//! while it is serving a call).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use rewind_host::state_dir::set_incarnation;
use rewind_host::store::Incarnation;
use serde_json::json;

use crate::remote::{Remote, serve};
use crate::support::{guest, workspace_root};

fn write_agent(dir: &Path, url: &str, parallelism: u32, marker: &str, in_doubt: &str) -> PathBuf {
    let path = dir.join("agent.toml");
    std::fs::write(
        &path,
        format!(
            "name = \"kill\"\nparallelism = {parallelism}\n\n[state]\npartitions = 4\nmarker = \"{marker}\"\ncheckpoint-every-ms = 15\ncheckpoint-every-inputs = 7\n\n[[actions]]\nname = \"work\"\ncomponent = {:?}\non = [\"input\"]\n\n[functions.charge]\nkind = \"http\"\nurl = \"{url}\"\nin-doubt = \"{in_doubt}\"\nreconcile-url = \"{url}/status\"\n",
            guest("caller").display().to_string()
        ),
    )
    .expect("write agent.toml");
    path
}

/// `count` inputs over six keys, each making two calls and writing memory.
fn write_inputs(dir: &Path, count: u32) -> PathBuf {
    let path = dir.join("inputs.jsonl");
    let mut text = String::new();
    for i in 0..count {
        let line = json!({ "key": format!("customer-{}", i % 6), "payload": { "calls": [
            { "function": "charge", "args": { "input": i, "part": 1 } },
            { "function": "charge", "args": { "input": i, "part": 2 } },
        ], "memory_set": { "last": i } } });
        text.push_str(&format!("{line}\n"));
    }
    std::fs::write(&path, text).expect("write inputs");
    path
}

/// `rewind run` of `agent` over `inputs`, in `dir`: outputs to `out.jsonl`, state in `state`,
/// what it says appended to `stderr.log`.
pub(crate) fn rewind_run(dir: &Path, agent: &Path, inputs: &Path) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_rewind"));
    command
        .current_dir(dir)
        .arg("--cache-dir")
        .arg(workspace_root().join("target").join("rewind-test-cache"))
        .arg("run")
        .arg(agent)
        .arg("--input")
        .arg(inputs)
        .arg("--output")
        .arg(dir.join("out.jsonl"))
        .arg("--state")
        .arg(dir.join("state"))
        .stdout(Stdio::null())
        .stderr(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(dir.join("stderr.log"))
                .expect("stderr log"),
        );
    command
}

fn sorted_lines(path: &Path) -> Vec<String> {
    let mut lines: Vec<String> = std::fs::read_to_string(path)
        .expect("outputs")
        .lines()
        .map(str::to_owned)
        .collect();
    lines.sort();
    lines
}

/// How to start `rewind run` on one directory's agent and inputs.
#[derive(Clone)]
struct Runner {
    dir: PathBuf,
    agent: PathBuf,
    inputs: PathBuf,
}

impl Runner {
    fn command(&self) -> Command {
        rewind_run(&self.dir, &self.agent, &self.inputs)
    }
}

/// A remote, and a directory with an agent calling it and its inputs.
struct Case {
    remote: Remote,
    dir: tempfile::TempDir,
    runner: Runner,
}

impl Case {
    async fn new(parallelism: u32, marker: &str, in_doubt: &str, inputs: u32) -> Self {
        let remote = Remote::default();
        let url = serve(remote.clone()).await;
        let dir = tempfile::tempdir().expect("tempdir");
        // Every case's state is of one incarnation, as the crash kit's runs of one agent
        // are: a call's idempotency key is then the same in a case and in the uninterrupted
        // run, and the two can be compared.
        set_incarnation(&dir.path().join("state"), Incarnation([0x4b; 16]))
            .expect("the state's incarnation");
        let runner = Runner {
            dir: dir.path().to_owned(),
            agent: write_agent(dir.path(), &url, parallelism, marker, in_doubt),
            inputs: write_inputs(dir.path(), inputs),
        };
        Self {
            remote,
            dir,
            runner,
        }
    }

    /// The case run once, uninterrupted.
    async fn reference(parallelism: u32, marker: &str, inputs: u32) -> Self {
        let case = Self::new(parallelism, marker, "retry", inputs).await;
        let runner = case.runner.clone();
        let status = tokio::task::spawn_blocking(move || runner.command().status())
            .await
            .expect("join")
            .expect("runs");
        assert!(status.success(), "the reference run finished: {status}");
        case
    }

    fn outputs(&self) -> Vec<String> {
        sorted_lines(&self.dir.path().join("out.jsonl"))
    }

    /// What the runs wrote to stderr.
    fn said(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("stderr.log")).unwrap_or_default()
    }
}

/// A small deterministic generator for the kill delays (the same seed, the same delays).
fn delays(seed: u64) -> impl Iterator<Item = Duration> {
    let mut state = seed;
    std::iter::repeat_with(move || {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        Duration::from_millis(20 + (state >> 33) % 120)
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_and_restarted_runs_call_each_key_once_and_write_the_uninterrupted_output() {
    let reference = Case::reference(4, "offsets", 150).await;
    let case = Case::new(4, "offsets", "retry", 150).await;
    let runner = case.runner.clone();
    let (succeeded, kills) = tokio::task::spawn_blocking(move || {
        let seed = 7;
        let mut kills = 0;
        for delay in delays(seed).take(40) {
            let mut child = runner.command().spawn().expect("spawns");
            std::thread::sleep(delay);
            match child.try_wait().expect("wait") {
                Some(status) => return (status.success(), kills),
                None => {
                    child.kill().expect("SIGKILL");
                    child.wait().expect("reaped");
                    kills += 1;
                }
            }
        }
        let status = runner.command().status().expect("runs");
        (status.success(), kills)
    })
    .await
    .expect("join");
    assert!(succeeded, "the last run finished cleanly");
    assert!(kills >= 2, "the run was killed more than once: {kills}");

    assert_eq!(
        case.outputs(),
        reference.outputs(),
        "after {kills} kills, the same outputs as the uninterrupted run, each once"
    );
    assert_eq!(
        case.remote.keys(),
        reference.remote.keys(),
        "the same calls, with the same idempotency keys"
    );
    assert_eq!(case.remote.keys().len(), 300);
    // A call in flight at a kill (sent, its record not yet durable) is made again with the
    // same key after the restart; the remote drops the repeat. At most `parallelism` (4)
    // calls are in flight at once.
    let repeated = case.remote.repeats();
    assert!(
        repeated <= kills * 4,
        "only calls in flight at a kill reach the remote again: {repeated} repeats, {kills} kills"
    );
}

/// Where a scenario kills the run.
#[derive(Clone, Copy, Debug)]
enum KillAt {
    /// `REWIND_CRASH_AT=POINT:N`: the run kills itself the `N`th time it reaches `POINT`.
    Point(&'static str),
    /// The remote kills the run while serving its `N`th request, after the effect.
    DuringCall,
}

/// How many requests may reach the remote again, for a run with one input in flight.
#[derive(Clone, Copy, Debug)]
enum Repeats {
    /// The kill lands where no call is in flight: none.
    None,
    /// The kill lands after a call reached the remote and before its record: exactly one
    /// per kill, with the same idempotency key.
    OnePerKill,
    /// A checkpoint: the one input in flight may or may not be inside a call.
    AtMostOnePerKill,
}

/// Runs 60 inputs (120 calls) with one input in flight, killed once for each of `nths`,
/// then to the end; compares with an uninterrupted run.
async fn killed_at(kill: KillAt, marker: &'static str, nths: &'static [u64], repeats: Repeats) {
    killed_at_with(kill, marker, "retry", nths, repeats).await;
}

/// `killed_at`, with `charge` declared `in-doubt = in_doubt`. Returns the reconcile
/// requests the remote answered.
async fn killed_at_with(
    kill: KillAt,
    marker: &'static str,
    in_doubt: &'static str,
    nths: &'static [u64],
    repeats: Repeats,
) -> u64 {
    let reference = Case::reference(1, marker, 60).await;
    let case = Case::new(1, marker, in_doubt, 60).await;
    let (runner, remote) = (case.runner.clone(), case.remote.clone());
    tokio::task::spawn_blocking(move || {
        use std::os::unix::process::ExitStatusExt;
        for (run, &nth) in nths.iter().enumerate() {
            let mut command = runner.command();
            if let KillAt::Point(point) = kill {
                command.env("REWIND_CRASH_AT", format!("{point}:{nth}"));
            }
            let mut child = command.spawn().expect("spawns");
            if let KillAt::DuringCall = kill {
                *remote.kill_during.lock().expect("lock") =
                    Some((remote.total() + nth, child.id()));
            }
            let status = child.wait().expect("waits");
            assert_eq!(
                status.signal(),
                Some(9),
                "run {run} was to be killed at {kill:?} #{nth} but ended with {status}"
            );
        }
        let status = runner.command().status().expect("runs");
        assert!(status.success(), "the last run finished cleanly: {status}");
    })
    .await
    .expect("join");

    let kills = nths.len() as u64;
    assert_eq!(
        case.outputs(),
        reference.outputs(),
        "after {kills} kills at {kill:?}, the same outputs as the uninterrupted run, each once"
    );
    let remote = &case.remote;
    assert_eq!(
        remote.keys(),
        reference.remote.keys(),
        "the same idempotency keys"
    );
    assert_eq!(remote.keys().len(), 120);
    let repeated = remote.repeats();
    let explain = || {
        let effects = remote.effects.lock().expect("lock");
        let again: Vec<_> = (remote.requests.lock().expect("lock").iter())
            .filter(|(_, n)| **n > 1)
            .filter_map(|(key, _)| effects.get(key))
            .collect();
        format!("made again: {again:?}; the runs said:\n{}", case.said())
    };
    match repeats {
        Repeats::None => assert_eq!(repeated, 0, "no call made twice; {}", explain()),
        Repeats::OnePerKill => assert_eq!(repeated, kills, "one per kill; {}", explain()),
        Repeats::AtMostOnePerKill => assert!(repeated <= kills, "{repeated}; {}", explain()),
    }
    *remote.asks.lock().expect("lock")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_before_a_call_runs_no_call_twice() {
    killed_at(
        KillAt::Point("before-call"),
        "offsets",
        &[1, 25, 40],
        Repeats::None,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_during_a_call_makes_it_again_with_the_same_key() {
    killed_at(KillAt::DuringCall, "offsets", &[3, 30], Repeats::OnePerKill).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_after_a_call_before_its_record_makes_it_again_with_the_same_key() {
    killed_at(
        KillAt::Point("after-call"),
        "offsets",
        &[2, 25, 40],
        Repeats::OnePerKill,
    )
    .await;
    killed_at(
        KillAt::Point("after-call"),
        "refresh",
        &[2, 30],
        Repeats::OnePerKill,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_after_a_record_serves_it_from_the_record() {
    killed_at(
        KillAt::Point("after-record"),
        "offsets",
        &[2, 25, 40],
        Repeats::None,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_during_a_checkpoint_recovers_from_the_one_before() {
    let repeats = Repeats::AtMostOnePerKill;
    killed_at(
        KillAt::Point("checkpoint-refresh"),
        "refresh",
        &[1, 3],
        repeats,
    )
    .await;
    killed_at(
        KillAt::Point("checkpoint-save"),
        "refresh",
        &[2, 4],
        repeats,
    )
    .await;
    killed_at(
        KillAt::Point("checkpoint-save"),
        "offsets",
        &[1, 3],
        repeats,
    )
    .await;
    killed_at(
        KillAt::Point("checkpoint-saved"),
        "offsets",
        &[1, 4],
        repeats,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_around_a_call_with_reconcile_asks_instead_of_calling_again() {
    let after = KillAt::Point("after-call");
    let asks = killed_at_with(after, "offsets", "reconcile", &[2, 25, 40], Repeats::None).await;
    assert_eq!(asks, 3, "one question per call left in doubt");
    // Killed before the call: the pending record is there, the remote never saw the call
    // (404), so it is made then, once.
    let before = KillAt::Point("before-call");
    let asks = killed_at_with(before, "refresh", "reconcile", &[1, 30], Repeats::None).await;
    assert_eq!(asks, 2);
}

/// A streamed model answer cut by SIGKILL mid-way (`mid-stream`) leaves nothing recorded:
/// the next run asks again under the same idempotency key, forwards the pieces live to
/// `--follow` as they come, and records the message once (killed right after, at
/// `after-record`); the run after that is served the record: no third request, no pieces,
/// and the output once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_cut_by_a_crash_is_asked_again_then_served_from_its_record() {
    use std::os::unix::process::ExitStatusExt as _;

    let mock = rewind_mock::MockService::start("127.0.0.1:0".parse().expect("addr"))
        .await
        .expect("the mock starts");
    let dir = tempfile::tempdir().expect("temp dir");
    let agent = dir.path().join("agent.toml");
    std::fs::write(
        &agent,
        format!(
            "name = \"stream\"\n[[actions]]\nname = \"work\"\ncomponent = {:?}\non = \
             [\"input\"]\n[functions.chat]\nkind = \"openai-chat\"\nbase-url = \"{}/v1\"\nmodel \
             = \"mock-1\"\nheaders = {{ \"{}\" = \"20\" }}\n",
            guest("caller").display().to_string(),
            mock.base_url(),
            rewind_mock::CHUNK_DELAY_HEADER,
        ),
    )
    .expect("agent.toml");
    let messages = json!([{ "role": "user", "content": "Where is my order A1234?" }]);
    let line = json!({ "key": "k", "payload": { "calls": [
        { "function": "chat", "args": { "messages": messages } },
    ] } });
    let inputs = dir.path().join("inputs.jsonl");
    std::fs::write(&inputs, format!("{line}\n")).expect("inputs");
    let run = |crash: Option<&str>| {
        let mut command = rewind_run(dir.path(), &agent, &inputs);
        command.arg("--follow").stderr(Stdio::piped());
        command.env_remove("REWIND_CRASH_AT");
        if let Some(crash) = crash {
            command.env("REWIND_CRASH_AT", crash);
        }
        command.output().expect("rewind runs")
    };
    let pieces = |stderr: &[u8]| -> Vec<String> {
        (String::from_utf8_lossy(stderr).lines())
            .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
            .filter_map(|line| {
                line["delta"]["delta"]["content"]
                    .as_str()
                    .map(str::to_owned)
            })
            .collect()
    };
    let cut = run(Some("mid-stream:1"));
    assert_eq!(cut.status.signal(), Some(9), "killed mid-stream");
    assert_eq!(mock.counts().for_route("/v1/chat/completions"), 1);

    let recorded = run(Some("after-record:1"));
    assert_eq!(recorded.status.signal(), Some(9), "killed once recorded");
    let streamed = pieces(&recorded.stderr);
    assert!(
        streamed.len() >= 2,
        "the pieces, live: {}",
        String::from_utf8_lossy(&recorded.stderr)
    );

    let served = run(None);
    assert!(
        served.status.success(),
        "{}",
        String::from_utf8_lossy(&served.stderr)
    );
    assert!(
        pieces(&served.stderr).is_empty(),
        "a replay streams nothing: {}",
        String::from_utf8_lossy(&served.stderr)
    );
    let counts = mock.counts();
    assert_eq!(counts.for_route("/v1/chat/completions"), 2, "{counts:?}");
    assert_eq!(
        counts.by_idempotency_key.values().collect::<Vec<_>>(),
        [&2],
        "asked again under its key, then served from the record: {counts:?}"
    );
    let outputs = sorted_lines(&dir.path().join("out.jsonl"));
    assert_eq!(outputs.len(), 1, "{outputs:?}");
    let output: serde_json::Value = serde_json::from_str(&outputs[0]).expect("an output");
    let content = &output["payload"]["results"][0]["ok"]["content"];
    assert_eq!(
        content.as_str(),
        Some(streamed.concat().as_str()),
        "the record is the pieces joined: {output}"
    );
}
