//! One behaviour suite for every front end of the per-key core: what a user of `rewind run`
//! and of `rewind serve` relies on alike, stated once and run against each.
//!
//! A [`Driver`] feeds inputs to a front end as its users do (lines of an input stream; the
//! HTTP API), reads the outputs it writes, and skips a parked input as an operator does
//! (a command left in the state directory; the API's skip). [`driver_conformance_tests!`]
//! makes one test per behaviour for a driver.
//!
//! Every input runs the caller guest; its agent retries nothing (`attempts = 1`), so an
//! input that fails is parked at once.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use futures_util::StreamExt as _;
use rewind_host::agent::input::{InputLine, LineError};
use rewind_host::agent::output::OutputSink;
use rewind_host::checkpoint::FileCheckpoints;
use rewind_host::commands::{CommandDir, Outcome, Verb};
use rewind_host::event::Output;
use rewind_host::keys::{Checkpointing, RunOptions, run_inputs};
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::support::{agent_toml, agent_with, memory_store};

/// Longer than anything here takes on a loaded machine: only a lost output reaches it.
const PATIENCE: Duration = Duration::from_secs(120);

/// An output as a test reads it: its key, its input's sequence and its payload.
#[derive(Clone, Debug)]
pub struct Seen {
    pub key: String,
    pub sequence: u64,
    pub payload: Value,
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

/// Whether a skip left as a command was carried out; `false` when the input was not parked
/// yet (its last attempt still being recorded), to be asked again; a skip refused for any
/// other reason, or never carried out within [`PATIENCE`] of `started`, fails the test.
fn skipped(outcome: Outcome, started: Instant) -> bool {
    match outcome {
        Outcome::Applied { .. } => true,
        Outcome::Refused { error } if error.contains("has no parked input") => {
            assert!(started.elapsed() < PATIENCE, "never parked: {error}");
            false
        }
        Outcome::Refused { error } => panic!("skip refused: {error}"),
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
    }

    pub async fn make() -> (Box<dyn Driver>, tempfile::TempDir) {
        let state = tempfile::tempdir().expect("tempdir");
        let toml = agent_toml("caller", "", "[retry]\nattempts = 1\n");
        let agent = Arc::new(agent_with(&toml, memory_store(), &[]));
        let checkpoints = Arc::new(FileCheckpoints::new(state.path().join("checkpoints")));
        let commands = CommandDir::of(state.path());
        let (lines, rx) = mpsc::unbounded_channel();
        let (to, outputs) = mpsc::unbounded_channel();
        let queue = commands.clone();
        tokio::spawn(async move {
            let stream = futures_util::stream::unfold(rx, |mut rx| async move {
                rx.recv().await.map(|line| (line, rx))
            })
            .boxed();
            let checkpointing = Checkpointing {
                store: checkpoints,
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
            let started = Instant::now();
            loop {
                let skip = Verb::Skip {
                    reason: "the suite skips it".to_owned(),
                };
                let command = self
                    .commands
                    .submit(key, Some(sequence), "suite", skip)
                    .expect("left");
                let done = loop {
                    if let Some(done) = self.commands.outcome(&command.id).expect("read") {
                        break done;
                    }
                    assert!(started.elapsed() < PATIENCE, "the skip was not carried out");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                };
                if skipped(done.outcome, started) {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
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
    }

    pub async fn make() -> (Box<dyn Driver>, tempfile::TempDir) {
        let dir = tempfile::tempdir().expect("tempdir");
        // Room for the inputs queued behind a parked one, and the others.
        let quotas = format!("[tenants.acme.quotas]\nqueued-inputs = {}\n", 2 * BEHIND);
        let server = Server::start(dir.path(), &quotas).await;
        let token = server.tenant("acme").await;
        server.deploy("acme", &token, "bot", "caller", "").await;
        let driver = ServeDriver {
            server,
            token,
            submitted: 0,
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
                .into_iter()
                .map(|o| Seen {
                    key: o["key"].as_str().expect("key").to_owned(),
                    sequence: o["sequence"].as_u64().expect("sequence"),
                    payload: o["payload"].clone(),
                })
                .collect()
        }

        async fn skip(&mut self, key: &str, sequence: u64) {
            let started = Instant::now();
            loop {
                let (status, body) = self
                    .server
                    .skip(
                        "acme",
                        &self.token,
                        "bot",
                        key,
                        sequence,
                        "the suite skips it",
                    )
                    .await;
                if status == reqwest::StatusCode::OK {
                    return;
                }
                // Not parked yet: its last attempt is still being recorded.
                assert_eq!(body["code"], "not-parked", "{status} {body}");
                assert!(started.elapsed() < PATIENCE, "never parked: {body}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
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
        _host: Host,
        _servers: NatsServers,
        url: String,
        context: async_nats::jetstream::Context,
        layout: Layout,
        commands: ClusterCommands,
        submitted: usize,
    }

    pub async fn make() -> (Box<dyn Driver>, tempfile::TempDir) {
        let servers = NatsServers::single().expect("nats-server starts");
        let url = servers.url();
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(
            dir.path().join("agent.toml"),
            format!(
                "name = \"billing\"\n\n[state]\ncheckpoint-every-ms = 100\n\n[retry]\n\
                 attempts = 1\n\n[[actions]]\nname = \"work\"\ncomponent = {:?}\n\
                 on = [\"input\"]\n",
                guest("caller").display().to_string()
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
            _host: host,
            _servers: servers,
            url,
            context,
            layout,
            commands,
            submitted: 0,
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
            let started = Instant::now();
            loop {
                let written = outputs(&self.url, 1).await;
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

        async fn skip(&mut self, key: &str, sequence: u64) {
            let started = Instant::now();
            loop {
                let skip = Verb::Skip {
                    reason: "the suite skips it".to_owned(),
                };
                let command = self
                    .commands
                    .submit(key, Some(sequence), "suite", skip)
                    .await
                    .expect("left");
                let done = loop {
                    if let Some(done) = self.commands.outcome(&command.id).await.expect("read") {
                        break done;
                    }
                    assert!(started.elapsed() < PATIENCE, "the skip was not carried out");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                };
                if skipped(done.outcome, started) {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }

    driver_conformance_tests!(make);
}
