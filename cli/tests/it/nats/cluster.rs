//! `rewind cluster`: hosts sharing an agent's partitions over a real nats-server, each host a
//! `rewind` process. Hosts are killed (SIGKILL), paused past their lease (SIGSTOP), and NATS
//! nodes killed or restarted, while inputs flow; every output must appear once, and every
//! call's idempotency key reach the remote once.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rewind_host::cluster::outputs::read_outputs;
use rewind_host::cluster::{Layout, inputs};
use rewind_host::event::OutputRecord;
use rewind_host::log::{JetStreamLog, connect_nats};
use rewind_host::testing::nats::NatsServers;
use serde_json::{Value, json};

use crate::remote::{Remote, serve};
use crate::support::{guest, workspace_root};

pub(super) const PARTITIONS: u32 = 4;
const KEYS: u32 = 6;

/// A `rewind cluster run` process; SIGKILLed when dropped.
pub(crate) struct Host {
    child: Option<Child>,
    log: PathBuf,
}

impl Host {
    pub(crate) fn start(dir: &Path, url: &str, name: &str, replicas: usize, ttl_ms: u64) -> Self {
        Self::start_with(dir, url, name, replicas, ttl_ms, &[])
    }

    /// [`start`](Self::start), with more arguments for `rewind cluster run`.
    pub(crate) fn start_with(
        dir: &Path,
        url: &str,
        name: &str,
        replicas: usize,
        ttl_ms: u64,
        more: &[&str],
    ) -> Self {
        let (replicas, ttl_ms) = (replicas.to_string(), ttl_ms.to_string());
        let more: Vec<&str> = ["--replicas", &replicas, "--lease-ttl-ms", &ttl_ms]
            .into_iter()
            .chain(more.iter().copied())
            .collect();
        Self::start_in(dir, url, name, PARTITIONS, &more)
    }

    /// A host of an agent of `partitions` partitions, started with `more` arguments.
    pub(super) fn start_in(
        dir: &Path,
        url: &str,
        name: &str,
        partitions: u32,
        more: &[&str],
    ) -> Self {
        Self::start_in_env(dir, url, name, partitions, more, &[])
    }

    /// [`start_in`](Self::start_in), with `env` set for the process.
    pub(super) fn start_in_env(
        dir: &Path,
        url: &str,
        name: &str,
        partitions: u32,
        more: &[&str],
        env: &[(&str, &str)],
    ) -> Self {
        let log = dir.join(format!("{name}.log"));
        let child = Command::new(env!("CARGO_BIN_EXE_rewind"))
            .arg("--cache-dir")
            .arg(workspace_root().join("target").join("rewind-test-cache"))
            .args(["cluster", "run"])
            .arg(dir.join("agent.toml"))
            .args(["--nats", url, "--prefix", "t", "--host", name])
            .args(["--partitions", &partitions.to_string()])
            .args(more)
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("host log"))
            .spawn()
            .expect("rewind cluster run starts");
        Self {
            child: Some(child),
            log,
        }
    }

    fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    pub(super) fn signal(&self, signal: rustix::process::Signal) {
        let pid = rustix::process::Pid::from_raw(self.pid().cast_signed()).expect("a pid");
        rustix::process::kill_process(pid, signal).expect("signal");
    }

    pub(super) fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// SIGTERM, and waits for a clean exit.
    pub(super) fn stop(&mut self) {
        self.signal(rustix::process::Signal::TERM);
        let status = self.child.take().expect("running").wait().expect("wait");
        assert!(
            status.success(),
            "host exited with {status}:\n{}",
            self.log()
        );
    }

    /// Waits for the host to exit by itself; a host still running after `within` fails the
    /// test (a guard against a hang, not a measure).
    pub(crate) async fn exited(&mut self, within: Duration) -> std::process::ExitStatus {
        let until = Instant::now() + within;
        loop {
            let child = self.child.as_mut().expect("running");
            if let Some(status) = child.try_wait().expect("wait") {
                self.child = None;
                return status;
            }
            assert!(
                Instant::now() < until,
                "the host did not exit:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub(crate) fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits until the host has joined (its streams exist).
    pub(crate) async fn joined(&self) {
        wait_for_log(self, "joined", &[self]).await;
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The agent: the caller guest, charging the remote twice per input (in doubt: reconcile).
pub(super) fn write_agent(dir: &Path, url: &str) {
    std::fs::write(
        dir.join("agent.toml"),
        format!(
            "name = \"billing\"\nparallelism = 4\n\n[state]\ncheckpoint-every-ms = 100\n\
             checkpoint-every-inputs = 5\n\n[[actions]]\nname = \"work\"\ncomponent = {:?}\n\
             on = [\"input\"]\n\n[functions.charge]\nkind = \"http\"\nurl = \"{url}\"\n\
             in-doubt = \"reconcile\"\nreconcile-url = \"{url}/status\"\n",
            guest("caller").display().to_string()
        ),
    )
    .expect("write agent.toml");
}

/// A NATS server (or cluster), the remote the agent charges, and the agent written to a
/// temporary directory: what every test here starts from.
pub(super) struct World {
    pub(super) servers: NatsServers,
    pub(super) url: String,
    pub(super) remote: Remote,
    pub(super) dir: tempfile::TempDir,
}

pub(super) async fn world(servers: NatsServers) -> World {
    let url = servers.url();
    let remote = Remote::default();
    let dir = tempfile::tempdir().expect("tempdir");
    write_agent(dir.path(), &serve(remote.clone()).await);
    World {
        servers,
        url,
        remote,
        dir,
    }
}

/// Waits until `host`'s log says `text`, or fails after 30 s showing every host's log.
pub(super) async fn wait_for_log(host: &Host, text: &str, hosts: &[&Host]) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !host.log().contains(text) {
        if Instant::now() > deadline {
            let logs: Vec<String> = hosts.iter().map(|h| h.log()).collect();
            panic!(
                "no {text:?} after 30 s; hosts' logs:\n{}",
                logs.join("\n----\n")
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The layout the hosts are started with, for the inputs (which are the same with group
/// commit or without).
pub(crate) fn layout(replicas: usize) -> Layout {
    Layout {
        prefix: "t".to_owned(),
        partitions: PARTITIONS,
        replicas,
        group_commit: false,
    }
}

/// Publishes inputs `range`, one every `every`: each charges twice and carries the key's
/// memory on.
async fn publish(url: String, replicas: usize, range: std::ops::Range<u32>, every: Duration) {
    let context = async_nats::jetstream::new(connect_nats(&url).await.expect("connects"));
    let layout = layout(replicas);
    for i in range {
        let payload = json!({ "calls": [
            { "function": "charge", "args": { "input": i, "part": 1 } },
            { "function": "charge", "args": { "input": i, "part": 2 } },
        ], "memory_set": { "last": i }, "memory_get": ["last"] });
        publish_one(&context, &layout, i, &payload).await;
        tokio::time::sleep(every).await;
    }
}

/// Publishes input `i` (key `customer-{i % KEYS}`) with `payload`: retried, with the same
/// id, across a restart or an election.
async fn publish_one(
    context: &async_nats::jetstream::Context,
    layout: &Layout,
    i: u32,
    payload: &Value,
) {
    let mut attempt = 0;
    while let Err(e) = inputs::publish(
        context,
        layout,
        "default",
        "billing",
        &format!("input-{i}"),
        &format!("customer-{}", i % KEYS),
        &payload.to_string(),
    )
    .await
    {
        attempt += 1;
        assert!(attempt < 100, "publishing input {i}: {e}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Every output of the cluster, read as its hosts laid it out.
pub(crate) async fn outputs(url: &str, replicas: usize) -> Vec<OutputRecord> {
    let context = async_nats::jetstream::new(connect_nats(url).await.expect("connects"));
    // Read again while a NATS node is down or restarting, as the log retries.
    let started = Instant::now();
    let layout = loop {
        match Layout::load(&context, "t").await {
            Ok(layout) => break layout,
            Err(_) if started.elapsed() < Duration::from_secs(30) => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(error) => panic!("the recorded layout: {error}"),
        }
    };
    assert_eq!(layout.replicas, replicas);
    let streams = (0..PARTITIONS).map(|p| layout.output_stream(p)).collect();
    let log = JetStreamLog::open(context, streams, None)
        .await
        .expect("output streams");
    let mut all = Vec::new();
    for partition in 0..PARTITIONS {
        all.extend(
            read_outputs(&log, partition, 0)
                .await
                .expect("outputs")
                .into_iter()
                .map(|(_, output)| output),
        );
    }
    all
}

/// How many messages the input streams still hold.
async fn inputs_held(url: &str, replicas: usize) -> u64 {
    let context = async_nats::jetstream::new(connect_nats(url).await.expect("connects"));
    let layout = layout(replicas);
    let mut held = 0;
    for partition in 0..PARTITIONS {
        let mut stream = context
            .get_stream(layout.input_stream(partition))
            .await
            .expect("input stream");
        held += stream.info().await.expect("info").state.messages;
    }
    held
}

/// Waits until there are `count` outputs (or more), or fails after `within`.
pub(super) async fn wait_for_outputs(
    url: &str,
    replicas: usize,
    count: usize,
    within: Duration,
    hosts: &[&Host],
) {
    let deadline = Instant::now() + within;
    loop {
        let n = outputs(url, replicas).await.len();
        if n >= count {
            return;
        }
        if Instant::now() > deadline {
            let logs: Vec<String> = hosts.iter().map(|h| h.log()).collect();
            panic!(
                "{n} of {count} outputs after {within:?}; hosts' logs:\n{}",
                logs.join("\n----\n")
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// What users rely on: each input's output once, its memory carried on from the key's input
/// before it, and each call's effect once.
fn check(outputs: &[OutputRecord], remote: &Remote, inputs: u32) {
    let ids: BTreeSet<&str> = outputs.iter().map(|o| o.id.as_str()).collect();
    assert_eq!(ids.len(), outputs.len(), "an output appeared twice");
    assert_eq!(outputs.len(), inputs as usize, "every input's output");
    let mut by_key: BTreeMap<&str, Vec<(u64, Value)>> = BTreeMap::new();
    for output in outputs {
        let payload: Value = serde_json::from_str(output.payload.get()).expect("JSON");
        by_key
            .entry(output.key.as_str())
            .or_default()
            .push((output.sequence, payload));
    }
    for (key, mut outputs) in by_key {
        outputs.sort_by_key(|(sequence, _)| *sequence);
        let mut last = Value::Null;
        for (expected, (sequence, payload)) in (1..).zip(&outputs) {
            assert_eq!(*sequence, expected, "{key}: sequences without a gap");
            assert_eq!(
                payload["memory"]["last"], last,
                "{key} #{sequence}: memory as the input before left it"
            );
            last = payload["results"][0]["ok"]["charged"]["input"].clone();
        }
    }
    assert_eq!(
        remote.keys().len(),
        2 * inputs as usize,
        "each call's effect"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hosts_one_killed_every_output_once_and_every_call_once() {
    two_hosts_one_killed(&[]).await;
}

/// The same with group commit: the state, output and checkpoint records that wait for a
/// publish share a message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_group_commit_two_hosts_one_killed_every_output_once_and_every_call_once() {
    two_hosts_one_killed(&["--group-commit"]).await;
}

async fn two_hosts_one_killed(more: &[&str]) {
    let world = world(NatsServers::single().expect("nats-server starts")).await;
    let (url, remote, dir) = (world.url.clone(), world.remote.clone(), world.dir.path());
    let mut a = Host::start_with(dir, &url, "a", 1, 1_500, more);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let b = Host::start_with(dir, &url, "b", 1, 1_500, more);

    a.joined().await;
    // A message on an input subject that is not an input is skipped; the partition goes on.
    let client = connect_nats(&url).await.expect("connects");
    async_nats::jetstream::new(client)
        .publish("t.in.default.billing.0", "not an input".into())
        .await
        .expect("publish")
        .await
        .expect("ack");
    let inputs = 90;
    let publisher = tokio::spawn(publish(
        url.clone(),
        1,
        0..inputs,
        Duration::from_millis(40),
    ));
    // Both hosts at work (the partitions shared out), then A dies mid-run.
    wait_for_outputs(&url, 1, 30, Duration::from_secs(60), &[&a, &b]).await;
    wait_for_log(&b, "partition taken", &[&a, &b]).await;
    a.kill();
    publisher.await.expect("publisher");
    wait_for_outputs(&url, 1, inputs as usize, Duration::from_secs(60), &[&b]).await;
    tokio::time::sleep(Duration::from_millis(300)).await;

    check(&outputs(&url, 1).await, &remote, inputs);
    assert_eq!(remote.repeats(), 0, "no call reached the remote twice");
    let context = async_nats::jetstream::new(connect_nats(&url).await.expect("connects"));
    let layout = Layout::load(&context, "t")
        .await
        .expect("the recorded layout");
    assert_eq!(
        layout.group_commit,
        more.contains(&"--group-commit"),
        "the hosts ran the streams as asked"
    );
    let (a_log, b_log) = (a.log(), b.log());
    assert!(
        a_log.contains("partition taken"),
        "A ran partitions:\n{a_log}"
    );
    assert!(
        b_log.matches("partition taken").count() > b_log.matches("letting it go").count() + 1,
        "B took A's partitions over:\n{b_log}"
    );
    // Inputs that no kept checkpoint needs are purged.
    let held = inputs_held(&url, 1).await;
    assert!(
        held < u64::from(inputs) / 2,
        "the inputs read are purged: {held} of {} still held",
        inputs + 1
    );
    assert!(
        format!("{a_log}{b_log}")
            .contains("skipping input message 1 of stream t-in-0: not an input"),
        "the malformed message is named by its stream and place:\n{a_log}\n----\n{b_log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_host_past_its_lease_cannot_write_when_it_wakes() {
    let world = world(NatsServers::single().expect("nats-server starts")).await;
    let (url, remote, dir) = (world.url.clone(), world.remote.clone(), world.dir.path());
    let a = Host::start(dir, &url, "a", 1, 1_000);
    publish(url.clone(), 1, 0..12, Duration::ZERO).await;
    wait_for_outputs(&url, 1, 12, Duration::from_secs(60), &[&a]).await;

    // A is paused while serving a call of the next inputs, after the remote had its effect.
    *remote.pause_during.lock().expect("lock") = Some((remote.total() + 3, a.pid()));
    publish(url.clone(), 1, 12..24, Duration::ZERO).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    while remote.pause_during.lock().expect("lock").is_some() {
        assert!(
            Instant::now() < deadline,
            "A was never paused ({} requests):\n{}",
            remote.total(),
            a.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // B takes every partition over once A's leases expire, and finishes the inputs.
    let mut b = Host::start(dir, &url, "b", 1, 1_000);
    wait_for_outputs(&url, 1, 24, Duration::from_secs(60), &[&a, &b]).await;
    // A wakes up holding nothing but what it was doing: its writes are refused.
    a.signal(rustix::process::Signal::CONT);
    publish(url.clone(), 1, 24..30, Duration::ZERO).await;
    wait_for_outputs(&url, 1, 30, Duration::from_secs(60), &[&a, &b]).await;
    tokio::time::sleep(Duration::from_secs(2)).await;

    check(&outputs(&url, 1).await, &remote, 30);
    // A call whose pending record A wrote before it was paused is in doubt for B, which
    // asks the remote, hears it never ran, and makes it. When A wakes it may still send
    // that call, with the same idempotency key: the remote drops the repeat (its effect
    // counted once above). At most one such call per run A had in flight (parallelism 4).
    assert!(
        remote.repeats() <= 4,
        "only calls A had already begun reach the remote again: {}",
        remote.repeats()
    );
    let a_log = a.log();
    assert!(a_log.contains("fenced"), "A's write was refused:\n{a_log}");
    assert!(
        a_log.contains("lease lost"),
        "A learned it lost its lease:\n{a_log}"
    );
    b.stop();
}

/// A host lets partitions go to a host that joined while their calls are slow: they finish
/// what they accepted, for longer than a lease lasts, while the host keeps renewing every
/// lease it holds; none is lost, nothing is fenced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitions_let_go_finish_while_the_host_keeps_its_other_leases() {
    let world = world(NatsServers::single().expect("nats-server starts")).await;
    let (url, remote, dir) = (world.url.clone(), world.remote.clone(), world.dir.path());
    let a = Host::start(dir, &url, "a", 1, 1_000);
    publish(url.clone(), 1, 0..8, Duration::ZERO).await;
    wait_for_outputs(&url, 1, 8, Duration::from_secs(60), &[&a]).await;

    // Every partition busy with calls that take 2 s each (two per input, a key's inputs
    // one after the other), then B joins: A lets two partitions go, and they take seconds
    // to finish.
    *remote.slow.lock().expect("lock") = Duration::from_secs(2);
    let before = remote.total();
    publish(url.clone(), 1, 8..20, Duration::ZERO).await;
    while remote.total() < before + 4 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut b = Host::start(dir, &url, "b", 1, 1_000);
    wait_for_log(&a, "letting it go", &[&a, &b]).await;
    wait_for_outputs(&url, 1, 20, Duration::from_secs(60), &[&a, &b]).await;
    *remote.slow.lock().expect("lock") = Duration::ZERO;
    publish(url.clone(), 1, 20..24, Duration::ZERO).await;
    wait_for_outputs(&url, 1, 24, Duration::from_secs(60), &[&a, &b]).await;

    check(&outputs(&url, 1).await, &remote, 24);
    assert_eq!(remote.repeats(), 0, "no call reached the remote twice");
    let (a_log, b_log) = (a.log(), b.log());
    assert!(
        a_log.contains("letting it go"),
        "A let partitions go:\n{a_log}"
    );
    assert!(
        !a_log.contains("lease lost") && !a_log.contains("fenced"),
        "A kept its other leases while partitions finished:\n{a_log}"
    );
    assert!(
        b_log.contains("partition taken"),
        "B took partitions:\n{b_log}"
    );
    b.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nats_node_killed_mid_run_loses_nothing() {
    let mut world = world(NatsServers::cluster(3).expect("a 3-node cluster starts")).await;
    let (url, remote, dir) = (world.url.clone(), world.remote.clone(), world.dir.path());
    let mut host = Host::start(dir, &url, "a", 3, 5_000);

    let inputs = 60;
    let publisher = tokio::spawn(publish(
        url.clone(),
        3,
        0..inputs,
        Duration::from_millis(50),
    ));
    wait_for_outputs(&url, 3, 15, Duration::from_secs(60), &[&host]).await;
    tokio::task::block_in_place(|| world.servers.kill(0)).expect("node 1 killed");
    publisher.await.expect("publisher");
    wait_for_outputs(&url, 3, inputs as usize, Duration::from_secs(90), &[&host]).await;

    check(&outputs(&url, 3).await, &remote, inputs);
    assert_eq!(remote.repeats(), 0, "no call reached the remote twice");
    host.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_host_carries_on_across_a_nats_server_restart() {
    let mut world = world(NatsServers::single().expect("nats-server starts")).await;
    let (url, remote, dir) = (world.url.clone(), world.remote.clone(), world.dir.path());
    let mut host = Host::start(dir, &url, "a", 1, 5_000);

    let inputs = 60;
    let publisher = {
        let url = url.clone();
        tokio::spawn(async move {
            // The publisher retries across the restart too, with the same ids.
            publish(url, 1, 0..inputs, Duration::from_millis(50)).await;
        })
    };
    wait_for_outputs(&url, 1, 15, Duration::from_secs(60), &[&host]).await;
    tokio::task::block_in_place(|| world.servers.restart(0)).expect("nats-server restarts");
    publisher.await.expect("publisher");
    wait_for_outputs(&url, 1, inputs as usize, Duration::from_secs(60), &[&host]).await;

    check(&outputs(&url, 1).await, &remote, inputs);
    assert_eq!(remote.repeats(), 0, "no call reached the remote twice");
    let log = host.log();
    assert!(
        !log.contains("lease lost"),
        "the host kept its partitions:\n{log}"
    );
    host.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_that_disagrees_on_the_partitions_is_refused() {
    let servers = NatsServers::single().expect("nats-server starts");
    let url = servers.url();
    let dir = tempfile::tempdir().expect("tempdir");
    write_agent(dir.path(), "http://127.0.0.1:9/charge");
    let first = Host::start(dir.path(), &url, "a", 1, 1_000);
    first.joined().await;
    let second = Command::new(env!("CARGO_BIN_EXE_rewind"))
        .arg("--cache-dir")
        .arg(workspace_root().join("target").join("rewind-test-cache"))
        .args(["cluster", "run"])
        .arg(dir.path().join("agent.toml"))
        .args([
            "--nats",
            &url,
            "--prefix",
            "t",
            "--host",
            "b",
            "--partitions",
            "8",
        ])
        .output()
        .expect("rewind runs");
    let stderr = String::from_utf8_lossy(&second.stderr);
    assert!(!second.status.success(), "refused");
    assert!(
        stderr.contains("has 4 partitions of 1 replica")
            && stderr.contains("started with 8")
            && stderr.contains("start it with the cluster's layout (--partitions 4 --replicas 1)"),
        "the error names both counts and what to start with: {stderr}"
    );
}

/// A durable wait outlives the host it began on: inputs that charge, sleep 3 s and charge
/// again are waiting on host A when it is killed; host B takes A's partitions over and
/// each sleep ends there, once, after its time (the clock read before it and after it, both
/// recorded), each charge made once and each output written once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_moves_to_the_host_that_takes_its_partition_over() {
    let world = world(NatsServers::single().expect("nats-server starts")).await;
    let (url, remote, dir) = (world.url.clone(), world.remote.clone(), world.dir.path());
    let toml = std::fs::read_to_string(dir.join("agent.toml")).expect("agent.toml");
    std::fs::write(
        dir.join("agent.toml"),
        format!("{toml}\n[functions.clock]\nkind = \"time\"\n"),
    )
    .expect("agent.toml");
    let mut a = Host::start(dir, &url, "a", 1, 1_500);
    a.joined().await;
    let context = async_nats::jetstream::new(connect_nats(&url).await.expect("connects"));
    // One per key: each the first of its key, so that all of them wait at once.
    let inputs = KEYS;
    for i in 0..inputs {
        let payload = json!({ "calls": [
            { "function": "charge", "args": { "input": i, "part": 1 } },
            { "function": "clock", "args": {} },
            { "sleep_ms": 3_000 },
            { "function": "clock", "args": {} },
            { "function": "charge", "args": { "input": i, "part": 2 } },
        ] });
        publish_one(&context, &layout(1), i, &payload).await;
    }
    // Every input made its first charge: each is at its sleep, or about to be.
    let deadline = Instant::now() + Duration::from_secs(30);
    while remote.total() < u64::from(inputs) {
        assert!(Instant::now() < deadline, "the first charges:\n{}", a.log());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    a.kill();
    let early = outputs(&url, 1).await;
    assert!(
        early.is_empty(),
        "none finished on A: {early:?}\n{}",
        a.log()
    );
    let b = Host::start(dir, &url, "b", 1, 1_500);
    wait_for_outputs(&url, 1, inputs as usize, Duration::from_secs(60), &[&a, &b]).await;

    let outputs = outputs(&url, 1).await;
    let ids: BTreeSet<&str> = outputs.iter().map(|o| o.id.as_str()).collect();
    assert_eq!(ids.len(), inputs as usize, "each output once: {outputs:?}");
    for output in &outputs {
        let payload: Value = serde_json::from_str(output.payload.get()).expect("JSON");
        let results = &payload["results"];
        let before = results[1]["ok"]["unix_ms"].as_u64().expect("a reading");
        let after = results[3]["ok"]["unix_ms"].as_u64().expect("a reading");
        assert!(after >= before + 3_000, "slept its time: {results}");
        assert_eq!(results[2], json!({ "slept": true }), "{results}");
    }
    assert_eq!(remote.keys().len(), inputs as usize * 2, "each charge made");
    assert_eq!(remote.repeats(), 0, "none twice");
    assert!(
        b.log().contains("partition taken"),
        "B took the partitions over:\n{}",
        b.log()
    );
}
