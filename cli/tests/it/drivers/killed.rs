//! Recovery after SIGKILL at the durable boundaries, one behaviour for every front end: each
//! runs as its own process, as in production, armed to kill itself at a crash point
//! (`REWIND_CRASH_AT` for `rewind run`, `--crash-at` for `rewind serve` and `rewind cluster
//! run`), then started again unarmed.
//!
//! `rewind run` is killed at every crash point; `serve` and `cluster` at a seeded sample of
//! the points each reaches ([`sample`]; `REWIND_SUITE_SEED` picks another sample, and a
//! failure names the seed).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use async_trait::async_trait;
use rand::{Rng as _, SeedableRng as _};
use rewind_host::crash::{Crash, CrashPoint};
use serde_json::{Value, json};

use super::{PATIENCE, Seen};
use crate::kill::rewind_run;
use crate::remote::{Remote, serve};
use crate::support::guest;

/// The inputs the behaviour gives, all of one key: each charges twice, sleeping between
/// (durably, [`SLEEP_MS`]; the clock read before and after), and carries the key's memory
/// on, so a crash point is reached up to 24 times per call boundary (12 of them charges),
/// and six per wait and wake.
const INPUTS: u64 = 6;

/// How long each input sleeps between its charges.
const SLEEP_MS: u64 = 50;

/// A front end run as its own process: killed at a crash point and started again.
#[async_trait]
pub trait Restarted: Send {
    /// Starts the front end's process armed to SIGKILL itself at `crash`, gives it `inputs`
    /// (key, payload) as its users do, and returns once it has killed itself there; a
    /// process that ends any other way fails the test.
    async fn killed_at(&mut self, crash: Crash, inputs: &[(String, Value)]);
    /// Starts it again, unarmed, gives it again what its users would after a crash (an
    /// HTTP client sends again the events it had no answer for), and returns every output
    /// once `n` are written.
    async fn recovered(&mut self, n: usize) -> Vec<Seen>;
}

/// How often a call may reach the remote again after a kill at `crash`, with one input in
/// flight: `(at least, at most)`.
fn repeats(crash: Crash) -> (u64, u64) {
    match crash.point {
        // No call is between its request and its record: none is made again.
        CrashPoint::BeforeCall
        | CrashPoint::AfterRecord
        | CrashPoint::AtWait
        | CrashPoint::AtWake => (0, 0),
        // The call reached the remote and its record was not written: it is made again,
        // once, under the same idempotency key. (Of each input's four calls, the first and
        // the last charge; the two between read the clock.)
        CrashPoint::AfterCall if matches!((crash.nth - 1) % 4, 0 | 3) => (1, 1),
        CrashPoint::AfterCall => (0, 0),
        // A streamed answer cut short: the call is asked again, once, under its key.
        CrashPoint::MidStream => (1, 1),
        // A checkpoint or a log write: the one input in flight may be inside a call.
        CrashPoint::CheckpointRefresh
        | CrashPoint::CheckpointSave
        | CrashPoint::CheckpointSaved
        | CrashPoint::TornWrite => (0, 1),
    }
}

/// A front end killed at `crash` while six inputs of one key run, then started again: every
/// input's output appears once, in order, each seeing the memory the one before it left;
/// every call reached the remote under the idempotency key it had before the kill, and
/// none was made again but a call the kill left between its request and its record.
pub async fn a_kill_at_a_crash_point_loses_no_input_and_repeats_no_recorded_call(
    driver: &mut dyn Restarted,
    remote: &Remote,
    crash: Crash,
) {
    let inputs: Vec<(String, Value)> = (1..=INPUTS)
        .map(|i| {
            let payload = json!({
                "calls": [
                    { "function": "charge", "args": { "input": i, "part": 1 } },
                    { "function": "clock" },
                    { "sleep_ms": SLEEP_MS },
                    { "function": "clock" },
                    { "function": "charge", "args": { "input": i, "part": 2 } },
                ],
                "memory_get": ["n"],
                "memory_set": { "n": i },
            });
            ("k".to_owned(), payload)
        })
        .collect();
    driver.killed_at(crash, &inputs).await;
    let outputs = driver.recovered(inputs.len()).await;

    let seen: Vec<(u64, Value)> = outputs
        .iter()
        .map(|o| (o.sequence, o.payload["memory"]["n"].clone()))
        .collect();
    let expected: Vec<(u64, Value)> = (1..=INPUTS)
        .map(|i| (i, if i == 1 { Value::Null } else { json!(i - 1) }))
        .collect();
    assert_eq!(
        seen, expected,
        "killed at {crash}: each output once, in order"
    );
    for output in &outputs {
        let results = output.payload["results"].as_array().expect("results");
        assert!(
            results.len() == 5
                && [0, 1, 3, 4].iter().all(|&i| results[i]["ok"].is_object())
                && results[2] == json!({ "slept": true }),
            "killed at {crash}: every call answered, the sleep over: {output:?}"
        );
        // Read before the sleep (recorded, served after the kill) and after it.
        let (before, after) = (&results[1]["ok"]["unix_ms"], &results[3]["ok"]["unix_ms"]);
        let slept = after
            .as_u64()
            .unwrap_or(0)
            .saturating_sub(before.as_u64().unwrap_or(0));
        assert!(
            slept >= SLEEP_MS,
            "killed at {crash}: the sleep ended {slept} ms after it began, before its time"
        );
    }
    // One effect per charge: a charge made again after the kill under a new key would be a
    // thirteenth.
    assert_eq!(
        remote.keys().len() as u64,
        2 * INPUTS,
        "killed at {crash}: every call under one idempotency key"
    );
    let (least, most) = repeats(crash);
    let repeated = remote.repeats();
    assert!(
        (least..=most).contains(&repeated),
        "killed at {crash}: {repeated} calls made again, expected {least} to {most}"
    );
}

/// `count` crashes drawn from `points` (each with the highest `nth` its front end surely
/// reaches in the behaviour), by the seed `REWIND_SUITE_SEED` (default: `default`).
pub fn sample(points: &[(CrashPoint, u64)], count: usize, default: u64) -> (u64, Vec<Crash>) {
    let seed = std::env::var("REWIND_SUITE_SEED")
        .ok()
        .map(|seed| seed.parse().expect("REWIND_SUITE_SEED is a number"))
        .unwrap_or(default);
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut picked = Vec::new();
    while picked.len() < count.min(points.len()) {
        let (point, most) = points[rng.random_range(0..points.len())];
        if picked.iter().any(|c: &Crash| c.point == point) {
            continue;
        }
        picked.push(Crash {
            point,
            nth: rng.random_range(1..=most),
        });
    }
    (seed, picked)
}

/// The `charge` function's declaration, and the remote it charges.
async fn charge() -> (Remote, String) {
    let remote = Remote::default();
    // Long enough that a checkpoint taken on time lands while an input runs.
    *remote.slow.lock().expect("lock") = Duration::from_millis(15);
    let url = serve(remote.clone()).await;
    (remote, url)
}

fn function(url: &str) -> String {
    format!(
        "[functions.charge]\nkind = \"http\"\nurl = \"{url}\"\n[functions.clock]\nkind = \"time\"\n"
    )
}

/// Fails the test unless `status` is a SIGKILL's (the process killed itself at `crash`).
fn assert_killed(status: std::process::ExitStatus, crash: Crash, said: &str) {
    use std::os::unix::process::ExitStatusExt as _;
    assert_eq!(
        status.signal(),
        Some(9),
        "to be killed at {crash}, it ended with {status}; it said:\n{said}"
    );
}

/// Waits for `child` to end; it must have been killed at `crash`.
async fn killed(mut child: std::process::Child, crash: Crash, said: impl Fn() -> String) {
    let status = tokio::task::spawn_blocking(move || child.wait())
        .await
        .expect("join")
        .expect("waits");
    assert_killed(status, crash, &said());
}

/// Kills the front end `make` (an async fn of the remote's URL) at each of `crashes` in
/// turn, each time on a new state.
pub async fn killed_at_each<M, F>(make: M, crashes: &[Crash], seed: Option<u64>)
where
    M: Fn(String) -> F,
    F: Future<Output = Box<dyn Restarted>>,
{
    for &crash in crashes {
        let (remote, url) = charge().await;
        let mut driver = make(url).await;
        let case = a_kill_at_a_crash_point_loses_no_input_and_repeats_no_recorded_call(
            &mut *driver,
            &remote,
            crash,
        );
        if let Some(seed) = seed {
            eprintln!("to be killed at {crash}, drawn by REWIND_SUITE_SEED={seed}");
        }
        case.await;
    }
}

/// `rewind run` over an input file, killed at every crash point.
mod run {
    use super::*;

    pub struct RunProcess {
        dir: tempfile::TempDir,
    }

    impl RunProcess {
        fn command(&self) -> Command {
            let dir = self.dir.path();
            let mut command = rewind_run(dir, &dir.join("agent.toml"), &dir.join("inputs.jsonl"));
            // Until the inputs' sleeps are over too.
            command.arg("--wait").env_remove(rewind_host::crash::ENV);
            command
        }

        fn said(path: &Path) -> String {
            std::fs::read_to_string(path.join("stderr.log")).unwrap_or_default()
        }
    }

    /// `refresh` markers, so that every crash point is reached: a checkpoint re-appends the
    /// states of the input in flight.
    pub async fn make(url: &str) -> Box<dyn Restarted> {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(
            dir.path().join("agent.toml"),
            format!(
                "name = \"killed\"\n\n[state]\nmarker = \"refresh\"\ncheckpoint-every-ms = 10\n\
                 checkpoint-every-inputs = 2\n\n[[actions]]\nname = \"work\"\n\
                 component = {:?}\non = [\"input\"]\n\n{}",
                guest("caller").display().to_string(),
                function(url)
            ),
        )
        .expect("write agent.toml");
        Box::new(RunProcess { dir })
    }

    #[async_trait]
    impl Restarted for RunProcess {
        async fn killed_at(&mut self, crash: Crash, inputs: &[(String, Value)]) {
            let lines: String = inputs
                .iter()
                .map(|(key, payload)| format!("{}\n", json!({ "key": key, "payload": payload })))
                .collect();
            std::fs::write(self.dir.path().join("inputs.jsonl"), lines).expect("inputs");
            let child = (self.command())
                .env(rewind_host::crash::ENV, crash.to_string())
                .spawn()
                .expect("rewind run starts");
            let dir = self.dir.path().to_owned();
            killed(child, crash, move || Self::said(&dir)).await;
        }

        async fn recovered(&mut self, _n: usize) -> Vec<Seen> {
            let mut command = self.command();
            let status = tokio::task::spawn_blocking(move || command.status())
                .await
                .expect("join")
                .expect("runs");
            let dir = self.dir.path();
            assert!(status.success(), "{status}; it said:\n{}", Self::said(dir));
            let outputs = std::fs::read_to_string(dir.join("out.jsonl")).expect("outputs");
            outputs
                .lines()
                .map(|line| Seen::of_json(&serde_json::from_str(line).expect("an output line")))
                .collect()
        }
    }

    /// Where `rewind run` is killed at `point`: a time it surely reaches it (each of the
    /// six inputs makes two calls and writes to the log; a checkpoint is due every two).
    fn nth(point: CrashPoint) -> u64 {
        match point {
            CrashPoint::BeforeCall => 5,
            // Input 2's second charge.
            CrashPoint::AfterCall => 8,
            CrashPoint::AfterRecord => 9,
            CrashPoint::AtWait => 4,
            CrashPoint::AtWake => 4,
            CrashPoint::CheckpointRefresh => 1,
            CrashPoint::CheckpointSave => 2,
            CrashPoint::CheckpointSaved => 2,
            CrashPoint::TornWrite => 9,
            // Not reached: the suite's agent streams no answer (see below).
            CrashPoint::MidStream => 1,
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn recovers_from_a_kill_at_every_crash_point() {
        // Every point the suite's agent reaches: it streams no model answer (a kill
        // mid-stream is `kill::a_stream_cut_by_a_crash_is_asked_again_then_served_from_its_record`).
        let crashes: Vec<Crash> = (CrashPoint::ALL.into_iter())
            .filter(|&point| point != CrashPoint::MidStream)
            .map(|point| Crash {
                point,
                nth: nth(point),
            })
            .collect();
        killed_at_each(|url| async move { make(&url).await }, &crashes, None).await;
    }
}

/// `rewind serve` as a process, over HTTP; killed at a seeded sample of the points it
/// reaches (it takes no checkpoint of the `run` kind: its journal is its record).
mod serve {
    use reqwest::StatusCode;

    use super::*;
    use crate::serve::{Process, agent, create, send, wait_outputs, write_config};

    pub struct ServeProcess {
        _dir: tempfile::TempDir,
        config: PathBuf,
        url: String,
        process: Option<Process>,
        client: reqwest::Client,
        token: String,
        /// Every event sent: (id, key, payload).
        events: Vec<(String, String, Value)>,
    }

    pub async fn make(url: &str) -> Box<dyn Restarted> {
        let dir = tempfile::tempdir().expect("tempdir");
        let at = url
            .strip_prefix("http://")
            .and_then(|rest| rest.split('/').next())
            .expect("a loopback URL");
        let config = write_config(
            dir.path(),
            &format!("state-dir = \"state\"\n[tenants.acme]\nallow-hosts = [\"{at}\"]\n"),
        );
        let driver = ServeProcess {
            _dir: dir,
            config,
            url: url.to_owned(),
            process: None,
            client: reqwest::Client::new(),
            token: String::new(),
            events: Vec::new(),
        };
        Box::new(driver)
    }

    impl ServeProcess {
        fn base(&self) -> &str {
            &self.process.as_ref().expect("started").base
        }

        /// Sends event `i`; its status, or `None` when the server gave no answer.
        async fn send(&self, i: usize) -> Option<StatusCode> {
            let (id, key, payload) = &self.events[i];
            let request = self
                .client
                .post(format!("{}/v1/tenants/acme/agents/bot/events", self.base()))
                .bearer_auth(&self.token)
                .json(&json!({ "id": id, "key": key, "payload": payload }));
            request.send().await.ok().map(|r| r.status())
        }
    }

    #[async_trait]
    impl Restarted for ServeProcess {
        async fn killed_at(&mut self, crash: Crash, inputs: &[(String, Value)]) {
            let process = Process::start(&self.config, Some(&crash.to_string()));
            let base = process.base.clone();
            self.process = Some(process);
            self.token = create(&self.client, &base, "acme").await;
            let wasm = std::fs::read(guest("caller")).expect("the guest is built");
            let upload = (self.client)
                .put(format!("{base}/v1/tenants/acme/components/worker"))
                .body(wasm);
            let (status, body) = send(upload, Some(&self.token)).await;
            assert_eq!(status, StatusCode::CREATED, "{body}");
            // Compacted after every input, each time writing the states of the input in
            // flight again (`refresh`): recovery finds them past the segments deleted.
            let state = "[state]\nmarker = \"refresh\"\ncheckpoint-every-inputs = 1\n";
            let toml = agent("bot", "worker", &format!("{state}{}", function(&self.url)));
            let define = (self.client)
                .post(format!("{base}/v1/tenants/acme/agents"))
                .body(toml);
            let (status, body) = send(define, Some(&self.token)).await;
            assert_eq!(status, StatusCode::CREATED, "{body}");
            for (i, (key, payload)) in inputs.iter().enumerate() {
                self.events
                    .push((format!("e{i}"), key.clone(), payload.clone()));
                // No answer: the kill came first; sent again after the restart.
                if let Some(status) = self.send(i).await {
                    assert_eq!(status, StatusCode::ACCEPTED);
                }
            }
            let mut process = self.process.take().expect("started");
            let (status, said) = tokio::task::spawn_blocking(move || {
                let status = process.child.wait().expect("waits");
                (status, process.log().join("\n"))
            })
            .await
            .expect("join");
            assert_killed(status, crash, &said);
        }

        async fn recovered(&mut self, n: usize) -> Vec<Seen> {
            self.process = Some(Process::start(&self.config, None));
            for i in 0..self.events.len() {
                let status = self.send(i).await;
                // Accepted now, or found accepted before the kill.
                assert!(
                    matches!(status, Some(StatusCode::ACCEPTED | StatusCode::OK)),
                    "{status:?}"
                );
            }
            wait_outputs(&self.client, self.base(), "acme", &self.token, n)
                .await
                .iter()
                .map(Seen::of_json)
                .collect()
        }
    }

    /// The points `serve` reaches in the behaviour, each with a time it surely reaches it:
    /// the calls, and its logs' writes (the journal's and the state log's).
    const POINTS: [(CrashPoint, u64); 6] = [
        (CrashPoint::BeforeCall, 24),
        (CrashPoint::AfterCall, 24),
        (CrashPoint::AfterRecord, 24),
        (CrashPoint::AtWait, 6),
        (CrashPoint::AtWake, 6),
        (CrashPoint::TornWrite, 12),
    ];

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn recovers_from_a_kill_at_a_sample_of_crash_points() {
        let (seed, crashes) = sample(&POINTS, 2, 23);
        killed_at_each(|url| async move { make(&url).await }, &crashes, Some(seed)).await;
    }
}

/// `rewind cluster run` as a process over a real nats-server; killed at a seeded sample of
/// the points it reaches (its checkpoints are JetStream messages: no checkpoint file).
mod cluster {
    use rewind_host::cluster::inputs;
    use rewind_host::log::connect_nats;
    use rewind_host::testing::nats::NatsServers;

    use super::*;
    use crate::nats::cluster::{Host, layout};

    pub struct ClusterProcess {
        // Dropped in this order: the host before the server it talks to.
        host: Option<Host>,
        servers: NatsServers,
        dir: tempfile::TempDir,
    }

    pub async fn make(url: &str) -> Box<dyn Restarted> {
        let servers = NatsServers::single().expect("nats-server starts");
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(
            dir.path().join("agent.toml"),
            format!(
                "name = \"billing\"\n\n[state]\nmarker = \"refresh\"\n\
                 checkpoint-every-ms = 10\ncheckpoint-every-inputs = 2\n\n[[actions]]\n\
                 name = \"work\"\ncomponent = {:?}\non = [\"input\"]\n\n{}",
                guest("caller").display().to_string(),
                function(url)
            ),
        )
        .expect("write agent.toml");
        let driver = ClusterProcess {
            host: None,
            servers,
            dir,
        };
        Box::new(driver)
    }

    impl ClusterProcess {
        fn start(&self, more: &[&str]) -> Host {
            Host::start_with(self.dir.path(), &self.servers.url(), "a", 1, 1_000, more)
        }
    }

    #[async_trait]
    impl Restarted for ClusterProcess {
        async fn killed_at(&mut self, crash: Crash, inputs: &[(String, Value)]) {
            let host = self.start(&["--crash-at", &crash.to_string()]);
            host.joined().await;
            let client = connect_nats(&self.servers.url()).await.expect("connects");
            let context = async_nats::jetstream::new(client);
            let layout = layout(1);
            for (i, (key, payload)) in inputs.iter().enumerate() {
                let (id, payload) = (format!("e{i}"), payload.to_string());
                let published =
                    inputs::publish(&context, &layout, "default", "billing", &id, key, &payload);
                published.await.expect("published");
            }
            let host = self.host.insert(host);
            let status = host.exited(PATIENCE).await;
            assert_killed(status, crash, &host.log());
        }

        /// The inputs are in their stream: the host started again takes them from there.
        async fn recovered(&mut self, n: usize) -> Vec<Seen> {
            self.host = Some(self.start(&[]));
            super::super::cluster::written(&self.servers.url(), n).await
        }
    }

    /// The points `cluster` reaches in the behaviour, each with a time it surely reaches it.
    const POINTS: [(CrashPoint, u64); 7] = [
        (CrashPoint::BeforeCall, 24),
        (CrashPoint::AfterCall, 24),
        (CrashPoint::AfterRecord, 24),
        (CrashPoint::AtWait, 6),
        (CrashPoint::AtWake, 6),
        (CrashPoint::CheckpointRefresh, 1),
        (CrashPoint::CheckpointSaved, 2),
    ];

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn recovers_from_a_kill_at_a_sample_of_crash_points() {
        let (seed, crashes) = sample(&POINTS, 2, 23);
        killed_at_each(|url| async move { make(&url).await }, &crashes, Some(seed)).await;
    }
}
