//! One behaviour suite for every front end of the per-key core: what a user of `rewind run`
//! and of `rewind serve` relies on alike, stated once and run against each.
//!
//! A [`Driver`] feeds inputs to a front end as its users do (lines of an input stream; the
//! HTTP API), reads the outputs it writes, and skips a parked input as an operator does
//! (a command left in the state directory; the API's skip). [`driver_conformance_tests!`]
//! makes one test per behaviour for a driver.
//!
//! Recovery after SIGKILL at the durable boundaries is the one behaviour that needs each
//! front end as a process of its own; it is in [`killed`].
//!
//! Every input runs the caller guest; its agent tries an input twice (`[retry] attempts =
//! 2`, a millisecond apart), so an input that fails is parked almost at once. Its function `flaky` posts to a port nothing listens
//! on until the test brings a service up there ([`Driver::bring_up`]).

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use futures_util::StreamExt as _;
use rewind_host::agent::input::{InputLine, LineError};
use rewind_host::agent::output::OutputSink;
use rewind_host::checkpoint::FileCheckpoints;
use rewind_host::commands::{Command, CommandDir, Done, Outcome, Verb};
use rewind_host::event::Output;
use rewind_host::keys::{Checkpointing, RunOptions, run_inputs};
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::serve::Endpoint;
use crate::support::{agent_toml, agent_with, memory_store};

mod killed;

/// Longer than anything here takes on a loaded machine: only a lost output reaches it.
const PATIENCE: Duration = Duration::from_secs(120);

/// An output as a test reads it: its key, its input's sequence and its payload.
#[derive(Clone, Debug)]
pub struct Seen {
    pub key: String,
    pub sequence: u64,
    pub payload: Value,
}

impl Seen {
    /// An output as JSON: a line `rewind run` wrote, or one of `rewind serve`'s outputs.
    pub fn of_json(output: &Value) -> Self {
        Self {
            key: output["key"].as_str().expect("key").to_owned(),
            sequence: output["sequence"].as_u64().expect("sequence"),
            payload: output["payload"].clone(),
        }
    }
}

/// A front end of the core, driven as its users drive it.
#[async_trait]
pub trait Driver: Send {
    /// Accepts `payload` as `key`'s next input.
    async fn submit(&mut self, key: &str, payload: Value);
    /// Every output written so far, once `n` have been.
    async fn outputs(&mut self, n: usize) -> Vec<Seen>;
    /// Skips `key`'s parked input `sequence`, as an operator does, once it is parked.
    async fn skip(&mut self, key: &str, sequence: u64);
    /// Retries `key`'s parked input `sequence`, as an operator does, once it is parked.
    async fn retry(&mut self, key: &str, sequence: u64);
    /// Cancels `key`'s input `sequence`, as an operator does.
    async fn cancel(&mut self, key: &str, sequence: u64);
    /// Returns once `key`'s input `sequence` is parked, as the front end shows it.
    async fn parked(&mut self, key: &str, sequence: u64);
    /// Sends signal `name` with `payload` to `key`'s input `sequence` (which waits for it,
    /// or will), as its users do, once the front end has the input.
    async fn signal(&mut self, key: &str, sequence: u64, name: &str, payload: Value);
    /// Starts a service where `flaky` posts: its calls answer from now on (a `gated` one
    /// only as the test opens its gate). It counts the requests that reach it.
    async fn bring_up(&mut self, gated: bool) -> Endpoint;
}

/// The `flaky` function's declaration in agent.toml, posting to `at`.
fn flaky(at: std::net::SocketAddr) -> String {
    format!("[functions.flaky]\nkind = \"http\"\nurl = \"http://{at}/\"\nretries = 0\n")
}

/// A service at `at` where `flaky` posts (see [`Driver::bring_up`]).
async fn up(at: std::net::SocketAddr, gated: bool) -> Endpoint {
    let at = at.to_string();
    let (_, endpoint) = if gated {
        Endpoint::gated_at(&at).await
    } else {
        Endpoint::start_at(&at).await
    };
    endpoint
}

/// Every driver's agent's `[retry]`: two attempts, a millisecond apart.
const RETRY: &str = "[retry]\nattempts = 2\ninitial-ms = 1\nmax-ms = 1\n";

/// The signals every driver's action may wait for, in its `[[actions]]` entry.
const SIGNALS: &str = "signals = [\"approve\", \"reject\"]\n";

/// A port on loopback that nothing listens on (until [`Driver::bring_up`]).
fn down_port() -> std::net::SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("a free port")
}

/// Retry: a parked input runs again from its first attempt when an operator retries it, and
/// its key goes on behind it, in order.
pub async fn a_retried_parked_input_runs_again_and_its_key_goes_on(driver: &mut dyn Driver) {
    driver
        .submit("k", json!({ "calls": [{ "function": "flaky" }] }))
        .await;
    driver.submit("k", json!({})).await;
    driver.parked("k", 1).await;
    driver.bring_up(false).await;
    driver.retry("k", 1).await;
    let outputs = driver.outputs(2).await;
    let of_k: Vec<u64> = outputs
        .iter()
        .filter(|o| o.key == "k")
        .map(|o| o.sequence)
        .collect();
    assert_eq!(of_k, [1, 2], "{outputs:?}");
    assert!(
        outputs[0].payload["results"][0]["ok"].is_object(),
        "the retried call answered: {outputs:?}"
    );
}

/// FIFO per key, and memory: each input of a key sees the memory the one before it left.
pub async fn a_keys_inputs_run_in_order_each_seeing_the_memory_before_it(driver: &mut dyn Driver) {
    for n in 1..=20 {
        driver
            .submit(
                "k",
                json!({ "memory_get": ["n"], "memory_set": { "n": n } }),
            )
            .await;
    }
    let outputs = driver.outputs(20).await;
    let seen: Vec<(u64, Value)> = outputs
        .iter()
        .map(|o| (o.sequence, o.payload["memory"]["n"].clone()))
        .collect();
    let expected: Vec<(u64, Value)> = (1..=20)
        .map(|n| (n, if n == 1 { Value::Null } else { json!(n - 1) }))
        .collect();
    assert_eq!(seen, expected);
}

/// Keys in parallel: while one key's input waits on its call, another key's inputs run.
pub async fn keys_run_in_parallel(driver: &mut dyn Driver) {
    let gate = driver.bring_up(true).await;
    driver
        .submit("slow", json!({ "calls": [{ "function": "flaky" }] }))
        .await;
    let started = Instant::now();
    while gate.count() == 0 {
        assert!(
            started.elapsed() < PATIENCE,
            "the slow key's call was not made"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    for _ in 0..3 {
        driver.submit("quick", json!({})).await;
    }
    let outputs = driver.outputs(3).await;
    assert!(
        outputs.iter().all(|o| o.key == "quick"),
        "the quick key's inputs ran while the slow one's call waited: {outputs:?}"
    );
    gate.open(1);
    // (Across keys, a front end may list its outputs in any order: a cluster's by partition.)
    let outputs = driver.outputs(4).await;
    let slow: Vec<u64> = (outputs.iter().filter(|o| o.key == "slow"))
        .map(|o| o.sequence)
        .collect();
    assert_eq!(slow, [1], "{outputs:?}");
}

/// Outputs once: every input's output is written once, whatever the keys.
pub async fn every_input_gives_its_output_once(driver: &mut dyn Driver) {
    for i in 0..40 {
        driver.submit(&format!("k{}", i % 8), json!({})).await;
    }
    let outputs = driver.outputs(40).await;
    let ids: HashSet<(String, u64)> = outputs
        .iter()
        .map(|o| (o.key.clone(), o.sequence))
        .collect();
    assert_eq!(outputs.len(), 40, "{outputs:?}");
    assert_eq!(ids.len(), 40, "each once: {outputs:?}");
}

/// A failed input changes no memory and is parked; its key's later inputs wait while other
/// keys go on; skipped, it is never run, and the key goes on from the memory before it.
pub async fn a_parked_input_holds_its_key_only_and_once_skipped_left_no_memory(
    driver: &mut dyn Driver,
) {
    driver
        .submit("k", json!({ "memory_set": { "n": 1 } }))
        .await;
    driver
        .submit(
            "k",
            json!({ "memory_set": { "n": 2 }, "fail": "on purpose" }),
        )
        .await;
    driver.submit("k", json!({ "memory_get": ["n"] })).await;
    for _ in 0..5 {
        driver.submit("other", json!({})).await;
    }
    // k #1 and the other key's five; k #3 waits behind the parked #2.
    let outputs = driver.outputs(6).await;
    assert!(
        outputs.iter().all(|o| !(o.key == "k" && o.sequence == 3)),
        "{outputs:?}"
    );
    driver.skip("k", 2).await;
    let outputs = driver.outputs(7).await;
    let third = outputs
        .iter()
        .find(|o| o.key == "k" && o.sequence == 3)
        .expect("k #3 ran after the skip");
    assert_eq!(
        third.payload["memory"]["n"],
        json!(1),
        "#2's write was not applied"
    );
    assert!(
        outputs.iter().all(|o| !(o.key == "k" && o.sequence == 2)),
        "the skipped input never ran to completion: {outputs:?}"
    );
}

/// Cancel: a parked input cancelled is finished without running again, and its key goes on.
pub async fn a_cancelled_parked_input_never_runs_again_and_its_key_goes_on(
    driver: &mut dyn Driver,
) {
    driver
        .submit("k", json!({ "calls": [{ "function": "flaky" }] }))
        .await;
    driver.submit("k", json!({ "memory_get": ["n"] })).await;
    driver.parked("k", 1).await;
    driver.cancel("k", 1).await;
    driver.bring_up(false).await;
    let outputs = driver.outputs(1).await;
    let ran: Vec<(String, u64)> = outputs
        .iter()
        .map(|o| (o.key.clone(), o.sequence))
        .collect();
    assert_eq!(ran, [("k".to_owned(), 2)], "#1 was cancelled, #2 ran");
}

/// Retries: a failed input is tried again with the calls it made served from their records,
/// so no retry repeats an external call; after its last attempt it is parked, and once
/// skipped its key goes on.
pub async fn a_failed_input_is_retried_with_its_calls_served_from_records_then_parked(
    driver: &mut dyn Driver,
) {
    let endpoint = driver.bring_up(false).await;
    let fails = json!({ "calls": [{ "function": "flaky" }], "fail": "after its call" });
    driver.submit("k", fails).await;
    driver.submit("k", json!({})).await;
    driver.parked("k", 1).await;
    assert_eq!(
        endpoint.count(),
        1,
        "two attempts, one request: the second was served its record"
    );
    driver.skip("k", 1).await;
    let outputs = driver.outputs(1).await;
    assert_eq!((outputs[0].key.as_str(), outputs[0].sequence), ("k", 2));
}

/// Inputs queued behind a parked one in [`ten_thousand_inputs_behind_a_parked_one_stall_no_other_key`].
pub const BEHIND: u64 = 10_000;

/// Ten thousand inputs wait behind a parked one, holding nothing: the other keys' inputs
/// run meanwhile; once it is skipped, they all run, in order.
pub async fn ten_thousand_inputs_behind_a_parked_one_stall_no_other_key(driver: &mut dyn Driver) {
    driver.submit("k", json!({ "fail": "on purpose" })).await;
    for _ in 0..BEHIND {
        driver.submit("k", json!({})).await;
    }
    for i in 0..20 {
        driver.submit(&format!("o{i}"), json!({})).await;
    }
    let outputs = driver.outputs(20).await;
    assert!(
        outputs.iter().all(|o| o.key != "k"),
        "k waits behind its parked #1"
    );
    driver.skip("k", 1).await;
    let outputs = driver
        .outputs(usize::try_from(BEHIND).expect("fits") + 20)
        .await;
    let of_k: Vec<u64> = outputs
        .iter()
        .filter(|o| o.key == "k")
        .map(|o| o.sequence)
        .collect();
    assert_eq!(
        of_k,
        (2..=BEHIND + 1).collect::<Vec<_>>(),
        "all of them, in order, once"
    );
}

/// Waits: an input at a durable wait holds only its key (its later inputs wait behind it,
/// other keys go on, a sleep of another key ends on its own), and a signal it waits for
/// ends its wait; the key then goes on, in order.
pub async fn a_waiting_input_holds_only_its_key_until_its_signal_or_its_time(
    driver: &mut dyn Driver,
) {
    driver
        .submit(
            "k",
            json!({ "calls": [{ "await": ["approve", "reject"] }] }),
        )
        .await;
    driver.submit("k", json!({})).await;
    driver
        .submit("t", json!({ "calls": [{ "sleep_ms": 200 }] }))
        .await;
    driver.submit("other", json!({})).await;
    let outputs = driver.outputs(2).await;
    assert!(
        outputs.iter().all(|o| o.key != "k"),
        "key k waits for its signal: {outputs:?}"
    );
    driver
        .signal("k", 1, "approve", json!({ "by": "the suite" }))
        .await;
    let outputs = driver.outputs(4).await;
    let of_k: Vec<&Seen> = outputs.iter().filter(|o| o.key == "k").collect();
    assert_eq!(
        of_k.iter().map(|o| o.sequence).collect::<Vec<_>>(),
        [1, 2],
        "{outputs:?}"
    );
    assert_eq!(
        of_k[0].payload["results"],
        json!([{ "signal": { "name": "approve", "payload": { "by": "the suite" } } }])
    );
    let slept = outputs.iter().find(|o| o.key == "t").expect("t's output");
    assert_eq!(slept.payload["results"], json!([{ "slept": true }]));
}

/// Whether a command (a skip, a retry, a signal) was carried out; `false` when the input
/// was not parked yet (its last attempt still being recorded) or, for a signal, not yet
/// accepted, to be asked again; one refused for any other reason, or never carried out
/// within [`PATIENCE`] of `started`, fails the test.
fn carried_out(outcome: Outcome, started: Instant) -> bool {
    match outcome {
        Outcome::Applied { .. } => true,
        Outcome::Refused { error }
            if error.contains("has no parked input")
                || error.contains("has no unfinished input")
                || error.contains("has no input #") =>
        {
            assert!(started.elapsed() < PATIENCE, "never parked: {error}");
            false
        }
        Outcome::Refused { error } => panic!("command refused: {error}"),
    }
}

/// Leaves a command (`leave`) until its `outcome` says it was carried out, looking every
/// `pause`: an input not parked yet is asked again (see [`carried_out`]).
async fn until_carried_out<L, LF, O, OF>(leave: L, outcome: O, pause: Duration)
where
    L: Fn() -> LF,
    LF: Future<Output = Command>,
    O: Fn(String) -> OF,
    OF: Future<Output = Option<Done>>,
{
    let started = Instant::now();
    loop {
        let command = leave().await;
        let done = loop {
            if let Some(done) = outcome(command.id.clone()).await {
                break done;
            }
            assert!(
                started.elapsed() < PATIENCE,
                "the command was not carried out"
            );
            tokio::time::sleep(pause).await;
        };
        if carried_out(done.outcome, started) {
            return;
        }
        tokio::time::sleep(pause).await;
    }
}

/// A signal as an operator's command leaves it (for `rewind run` and a cluster).
fn signal_verb(name: &str, payload: &Value) -> Verb {
    Verb::Signal {
        name: name.to_owned(),
        payload: payload.to_string(),
        signal_id: String::new(),
    }
}

/// One test per behaviour, for the driver `make` (an async fn giving a `Box<dyn Driver>`).
macro_rules! driver_conformance_tests {
    ($make:path) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_keys_inputs_run_in_order_each_seeing_the_memory_before_it() {
            let (mut driver, _guard) = $make().await;
            $crate::drivers::a_keys_inputs_run_in_order_each_seeing_the_memory_before_it(
                &mut *driver,
            )
            .await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_retried_parked_input_runs_again_and_its_key_goes_on() {
            let (mut driver, _guard) = $make().await;
            $crate::drivers::a_retried_parked_input_runs_again_and_its_key_goes_on(&mut *driver)
                .await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_cancelled_parked_input_never_runs_again_and_its_key_goes_on() {
            let (mut driver, _guard) = $make().await;
            $crate::drivers::a_cancelled_parked_input_never_runs_again_and_its_key_goes_on(
                &mut *driver,
            )
            .await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_failed_input_is_retried_with_its_calls_served_from_records_then_parked() {
            let (mut driver, _guard) = $make().await;
            $crate::drivers::a_failed_input_is_retried_with_its_calls_served_from_records_then_parked(
                &mut *driver,
            )
            .await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_waiting_input_holds_only_its_key_until_its_signal_or_its_time() {
            let (mut driver, _guard) = $make().await;
            $crate::drivers::a_waiting_input_holds_only_its_key_until_its_signal_or_its_time(
                &mut *driver,
            )
            .await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn keys_run_in_parallel() {
            let (mut driver, _guard) = $make().await;
            $crate::drivers::keys_run_in_parallel(&mut *driver).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn every_input_gives_its_output_once() {
            let (mut driver, _guard) = $make().await;
            $crate::drivers::every_input_gives_its_output_once(&mut *driver).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn ten_thousand_inputs_behind_a_parked_one_stall_no_other_key() {
            let (mut driver, _guard) = $make().await;
            $crate::drivers::ten_thousand_inputs_behind_a_parked_one_stall_no_other_key(
                &mut *driver,
            )
            .await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_parked_input_holds_its_key_only_and_once_skipped_left_no_memory() {
            let (mut driver, _guard) = $make().await;
            $crate::drivers::a_parked_input_holds_its_key_only_and_once_skipped_left_no_memory(
                &mut *driver,
            )
            .await;
        }
    };
}

/// `rewind run`'s front end: lines fed to `run_inputs` as they come, its outputs read as it
/// writes them, a skip left in its state directory's commands.
mod run {
    use super::*;

    struct ChannelSink {
        written: HashSet<String>,
        to: mpsc::UnboundedSender<Output>,
    }

    #[async_trait]
    impl OutputSink for ChannelSink {
        async fn write(&mut self, output: &Output) -> std::io::Result<bool> {
            if !self.written.insert(output.id.to_string()) {
                return Ok(false);
            }
            let _ = self.to.send(output.clone());
            Ok(true)
        }

        async fn sync(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    pub struct RunDriver {
        lines: mpsc::UnboundedSender<Result<InputLine, LineError>>,
        fed: usize,
        outputs: mpsc::UnboundedReceiver<Output>,
        seen: Vec<Seen>,
        commands: CommandDir,
        checkpoints: Arc<FileCheckpoints>,
        down: std::net::SocketAddr,
    }

    impl RunDriver {
        /// Leaves `verb` for `key`'s input `sequence` until it is carried out.
        async fn command(&mut self, key: &str, sequence: u64, verb: Verb) {
            let commands = &self.commands;
            let leave = || {
                let left = commands.submit(key, Some(sequence), "suite", verb.clone());
                async move { left.expect("left") }
            };
            let outcome = |id: String| async move { commands.outcome(&id).expect("read") };
            until_carried_out(leave, outcome, Duration::from_millis(20)).await;
        }
    }

    pub async fn make() -> (Box<dyn Driver>, tempfile::TempDir) {
        let state = tempfile::tempdir().expect("tempdir");
        let down = down_port();
        let toml = agent_toml("caller", "", &format!("{SIGNALS}{RETRY}{}", flaky(down)));
        let agent = Arc::new(agent_with(&toml, memory_store(), &[]));
        let checkpoints = Arc::new(FileCheckpoints::new(state.path().join("checkpoints")));
        let commands = CommandDir::of(state.path());
        let (lines, rx) = mpsc::unbounded_channel();
        let (to, outputs) = mpsc::unbounded_channel();
        let queue = commands.clone();
        let kept = Arc::clone(&checkpoints);
        tokio::spawn(async move {
            let stream = futures_util::stream::unfold(rx, |mut rx| async move {
                rx.recv().await.map(|line| (line, rx))
            })
            .boxed();
            let checkpointing = Checkpointing {
                store: kept,
                every_inputs: None,
                every: Some(Duration::from_millis(20)),
                keep: 3,
                retention: Vec::new(),
            };
            let mut sink = ChannelSink {
                written: HashSet::new(),
                to,
            };
            let options = RunOptions {
                checkpointing: Some(&checkpointing),
                resume: None,
                commands: Some(&queue),
                until_waits_end: false,
                end_when_held: false,
                deltas: None,
            };
            run_inputs(agent, stream, &mut sink, &(), options)
                .await
                .expect("the run");
        });
        let driver = RunDriver {
            lines,
            fed: 0,
            outputs,
            seen: Vec::new(),
            commands,
            checkpoints,
            down,
        };
        (Box::new(driver), state)
    }

    #[async_trait]
    impl Driver for RunDriver {
        async fn submit(&mut self, key: &str, payload: Value) {
            self.fed += 1;
            let line = InputLine {
                id: None,
                line: self.fed,
                key: key.to_owned(),
                payload: payload.to_string(),
            };
            self.lines.send(Ok(line)).expect("the run takes lines");
        }

        async fn outputs(&mut self, n: usize) -> Vec<Seen> {
            while self.seen.len() < n {
                let output = tokio::time::timeout(PATIENCE, self.outputs.recv())
                    .await
                    .expect("the outputs came")
                    .expect("the run writes");
                self.seen.push(Seen {
                    key: output.id.key.clone(),
                    sequence: output.id.sequence,
                    payload: serde_json::from_str(&output.payload).expect("JSON"),
                });
            }
            self.seen.clone()
        }

        async fn skip(&mut self, key: &str, sequence: u64) {
            let reason = "the suite skips it".to_owned();
            self.command(key, sequence, Verb::Skip { reason }).await;
        }

        async fn retry(&mut self, key: &str, sequence: u64) {
            self.command(key, sequence, Verb::Retry).await;
        }

        async fn cancel(&mut self, key: &str, sequence: u64) {
            let reason = "the suite cancels it".to_owned();
            self.command(key, sequence, Verb::Cancel { reason }).await;
        }

        async fn signal(&mut self, key: &str, sequence: u64, name: &str, payload: Value) {
            let verb = signal_verb(name, &payload);
            self.command(key, sequence, verb).await;
        }

        /// Once a checkpoint (every 20 ms) holds it parked.
        async fn parked(&mut self, key: &str, sequence: u64) {
            use rewind_host::checkpoint::CheckpointStore as _;
            let started = Instant::now();
            loop {
                let latest = self.checkpoints.latest().await.expect("read checkpoints");
                let parked = latest.is_some_and(|c| {
                    c.pending
                        .iter()
                        .any(|p| p.key == key && p.sequence == sequence && p.parked.is_some())
                });
                if parked {
                    return;
                }
                assert!(
                    started.elapsed() < PATIENCE,
                    "{key} #{sequence} never parked"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }

        async fn bring_up(&mut self, gated: bool) -> Endpoint {
            up(self.down, gated).await
        }
    }

    driver_conformance_tests!(make);
}

/// `rewind serve`'s front end: events over HTTP, outputs from the tenant's outputs, the
/// API's skip.
mod serve {
    use super::*;
    use crate::serve::Server;

    pub struct ServeDriver {
        server: Server,
        token: String,
        submitted: usize,
        down: std::net::SocketAddr,
    }

    impl ServeDriver {
        /// Sends `command` (`skip`, `retry`, `cancel`) for `key`'s input `sequence` until it is
        /// carried out.
        async fn command(&mut self, key: &str, sequence: u64, command: &str) {
            let started = Instant::now();
            loop {
                let (status, body) = match command {
                    "skip" => {
                        let why = "the suite skips it";
                        let skip = self
                            .server
                            .skip("acme", &self.token, "bot", key, sequence, why);
                        skip.await
                    }
                    "cancel" => {
                        let why = "the suite cancels it";
                        let cancel =
                            self.server
                                .cancel("acme", &self.token, "bot", key, sequence, why);
                        cancel.await
                    }
                    _ => {
                        let retry =
                            self.server
                                .retry("acme", &self.token, "bot", key, sequence, None);
                        retry.await
                    }
                };
                // A cancel of an input that still runs is 202: it stops at its next call.
                if status == reqwest::StatusCode::OK || status == reqwest::StatusCode::ACCEPTED {
                    return;
                }
                // Not parked yet: its last attempt is still being recorded.
                assert_eq!(body["code"], "not-parked", "{status} {body}");
                assert!(started.elapsed() < PATIENCE, "never parked: {body}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }

    pub async fn make() -> (Box<dyn Driver>, tempfile::TempDir) {
        let dir = tempfile::tempdir().expect("tempdir");
        let down = down_port();
        // Room for the inputs queued behind a parked one, and the others.
        let config = format!(
            "[tenants.acme]\nallow-hosts = [\"{down}\"]\n[tenants.acme.quotas]\n\
             queued-inputs = {}\n",
            2 * BEHIND
        );
        let server = Server::start(dir.path(), &config).await;
        let token = server.tenant("acme").await;
        server
            .deploy(
                "acme",
                &token,
                "bot",
                "caller",
                &format!("{SIGNALS}{RETRY}{}", flaky(down)),
            )
            .await;
        let driver = ServeDriver {
            server,
            token,
            submitted: 0,
            down,
        };
        (Box::new(driver), dir)
    }

    #[async_trait]
    impl Driver for ServeDriver {
        async fn submit(&mut self, key: &str, payload: Value) {
            self.submitted += 1;
            let id = format!("e{}", self.submitted);
            let (status, body) = self
                .server
                .submit("acme", &self.token, "bot", &id, key, payload)
                .await;
            assert_eq!(status, reqwest::StatusCode::ACCEPTED, "{body}");
        }

        async fn outputs(&mut self, n: usize) -> Vec<Seen> {
            self.server
                .wait_outputs("acme", &self.token, n)
                .await
                .iter()
                .map(Seen::of_json)
                .collect()
        }

        async fn skip(&mut self, key: &str, sequence: u64) {
            self.command(key, sequence, "skip").await;
        }

        async fn retry(&mut self, key: &str, sequence: u64) {
            self.command(key, sequence, "retry").await;
        }

        async fn cancel(&mut self, key: &str, sequence: u64) {
            self.command(key, sequence, "cancel").await;
        }

        async fn signal(&mut self, key: &str, sequence: u64, name: &str, payload: Value) {
            let path =
                format!("/v1/tenants/acme/agents/bot/keys/{key}/inputs/{sequence}/signals/{name}");
            let request = self.server.client.post(self.server.url(&path));
            let body = json!({ "payload": payload, "id": format!("suite-{key}-{sequence}") });
            let (status, body) = crate::serve::send(request.json(&body), Some(&self.token)).await;
            assert_eq!(status, reqwest::StatusCode::OK, "{body}");
        }

        /// Once the key's history shows it parked.
        async fn parked(&mut self, key: &str, sequence: u64) {
            let started = Instant::now();
            loop {
                let (_, history) = self.server.history("acme", &self.token, "bot", key).await;
                let parked = history["inputs"].as_array().is_some_and(|inputs| {
                    inputs
                        .iter()
                        .any(|i| i["sequence"] == sequence && i["status"] == "parked")
                });
                if parked {
                    return;
                }
                assert!(
                    started.elapsed() < PATIENCE,
                    "{key} #{sequence} never parked"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }

        async fn bring_up(&mut self, gated: bool) -> Endpoint {
            up(self.down, gated).await
        }
    }

    driver_conformance_tests!(make);
}

/// `rewind cluster`'s front end: a host process over a real nats-server, inputs published
/// to its partitions, outputs read from its output streams, the skip left in its commands
/// stream.
mod cluster {
    use rewind_host::cluster::commands::ClusterCommands;
    use rewind_host::cluster::{Layout, inputs};
    use rewind_host::log::connect_nats;
    use rewind_host::testing::nats::NatsServers;

    use super::*;
    use crate::nats::cluster::{Host, layout, outputs};
    use crate::support::guest;

    pub struct ClusterDriver {
        // Dropped in this order: the host before the server it talks to.
        host: Host,
        _servers: NatsServers,
        url: String,
        context: async_nats::jetstream::Context,
        layout: Layout,
        commands: ClusterCommands,
        submitted: usize,
        down: std::net::SocketAddr,
    }

    /// Every output of the cluster at `url`, once `n` are written.
    pub async fn written(url: &str, n: usize) -> Vec<Seen> {
        let started = Instant::now();
        loop {
            let written = outputs(url, 1).await;
            if written.len() >= n {
                return written
                    .into_iter()
                    .map(|o| Seen {
                        key: o.key.clone(),
                        sequence: o.sequence,
                        payload: serde_json::from_str(o.payload.get()).expect("JSON"),
                    })
                    .collect();
            }
            assert!(
                started.elapsed() < PATIENCE,
                "{} of {n} outputs",
                written.len()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    impl ClusterDriver {
        /// Leaves `verb` for `key`'s input `sequence` until it is carried out.
        async fn command(&mut self, key: &str, sequence: u64, verb: Verb) {
            let commands = &self.commands;
            let leave = || async {
                let left = commands.submit(key, Some(sequence), "suite", verb.clone());
                left.await.expect("left")
            };
            let outcome = |id: String| async move { commands.outcome(&id).await.expect("read") };
            until_carried_out(leave, outcome, Duration::from_millis(50)).await;
        }
    }

    pub async fn make() -> (Box<dyn Driver>, tempfile::TempDir) {
        let servers = NatsServers::single().expect("nats-server starts");
        let url = servers.url();
        let dir = tempfile::tempdir().expect("tempdir");
        let down = down_port();
        std::fs::write(
            dir.path().join("agent.toml"),
            format!(
                "name = \"billing\"\n\n[state]\ncheckpoint-every-ms = 100\n\n{RETRY}\n\
                 [[actions]]\nname = \"work\"\ncomponent = {:?}\non = [\"input\"]\n{SIGNALS}{}",
                guest("caller").display().to_string(),
                flaky(down)
            ),
        )
        .expect("write agent.toml");
        let host = Host::start(dir.path(), &url, "a", 1, 2_000);
        host.joined().await;
        let context = async_nats::jetstream::new(connect_nats(&url).await.expect("connects"));
        let layout = layout(1);
        let commands = ClusterCommands::open(&context, &layout, "default", "billing")
            .await
            .expect("the commands stream");
        let driver = ClusterDriver {
            host,
            _servers: servers,
            url,
            context,
            layout,
            commands,
            submitted: 0,
            down,
        };
        (Box::new(driver), dir)
    }

    #[async_trait]
    impl Driver for ClusterDriver {
        async fn submit(&mut self, key: &str, payload: Value) {
            self.submitted += 1;
            let id = format!("e{}", self.submitted);
            inputs::publish(
                &self.context,
                &self.layout,
                "default",
                "billing",
                &id,
                key,
                &payload.to_string(),
            )
            .await
            .expect("published");
        }

        async fn outputs(&mut self, n: usize) -> Vec<Seen> {
            written(&self.url, n).await
        }

        async fn skip(&mut self, key: &str, sequence: u64) {
            let reason = "the suite skips it".to_owned();
            self.command(key, sequence, Verb::Skip { reason }).await;
        }

        async fn retry(&mut self, key: &str, sequence: u64) {
            self.command(key, sequence, Verb::Retry).await;
        }

        async fn cancel(&mut self, key: &str, sequence: u64) {
            let reason = "the suite cancels it".to_owned();
            self.command(key, sequence, Verb::Cancel { reason }).await;
        }

        async fn signal(&mut self, key: &str, sequence: u64, name: &str, payload: Value) {
            let verb = signal_verb(name, &payload);
            self.command(key, sequence, verb).await;
        }

        /// Once the host's log says so: it logs a park once the park is recorded.
        async fn parked(&mut self, key: &str, sequence: u64) {
            let started = Instant::now();
            let fields = format!("key={key} sequence={sequence} ");
            while !self.host.log().lines().any(|line| {
                line.contains("input parked after its last attempt") && line.contains(&fields)
            }) {
                assert!(
                    started.elapsed() < PATIENCE,
                    "{key} #{sequence} never parked"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }

        async fn bring_up(&mut self, gated: bool) -> Endpoint {
            up(self.down, gated).await
        }
    }

    driver_conformance_tests!(make);
}
