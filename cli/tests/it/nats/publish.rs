//! Publishing into a cluster: each event runs once however often it is published, an
//! agent the cluster does not run is refused, and so are a host under a live host's name
//! and a NATS that cannot be reached, each with an error that says so.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

use rewind_host::log::connect_nats;
use rewind_host::testing::nats::NatsServers;
use serde_json::json;

use super::cluster::{Host, outputs, wait_for_log, wait_for_outputs, world};
use crate::support::workspace_root;

fn rewind(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_rewind"))
        .arg("--cache-dir")
        .arg(workspace_root().join("target").join("rewind-test-cache"))
        .args(args)
        .output()
        .expect("rewind runs")
}

fn publish_file(url: &str, agent: &str, file: &Path) -> Output {
    rewind(&[
        "cluster",
        "publish",
        agent,
        "--nats",
        url,
        "--prefix",
        "t",
        "--input",
        &file.display().to_string(),
    ])
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// A line that charges once for `input`, on key `customer-0`.
fn line(id: Option<&str>, input: u32) -> String {
    let payload = json!({ "calls": [{ "function": "charge", "args": { "input": input } }] });
    match id {
        Some(id) => json!({ "id": id, "key": "customer-0", "payload": payload }),
        None => json!({ "key": "customer-0", "payload": payload }),
    }
    .to_string()
}

/// Publishing a file again, an event again long after (beyond JetStream's duplicate window),
/// and an id again with another payload: each event runs once, across a host's restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_published_again_runs_once() {
    let world = world(NatsServers::single().expect("nats-server starts")).await;
    let (url, remote, dir) = (world.url.clone(), world.remote.clone(), world.dir.path());
    let mut host = Host::start(dir, &url, "a", 1, 1_000);
    host.joined().await;
    // Two lines with ids, and two equal lines without: four events.
    let file = dir.join("inputs.jsonl");
    let lines = [
        line(Some("order-1"), 1),
        line(Some("order-2"), 2),
        line(None, 3),
        line(None, 3),
    ];
    std::fs::write(&file, lines.join("\n")).expect("inputs");
    let first = publish_file(&url, "billing", &file);
    assert!(first.status.success(), "{}", stderr(&first));
    assert!(
        stderr(&first).contains("published 4 inputs"),
        "{}",
        stderr(&first)
    );
    wait_for_outputs(&url, 1, 4, Duration::from_secs(60), &[&host]).await;

    // The whole file again: the same events.
    let again = publish_file(&url, "billing", &file);
    assert!(again.status.success(), "{}", stderr(&again));
    assert!(
        stderr(&again).contains("published 0 inputs, 4 published before (dropped)"),
        "{}",
        stderr(&again)
    );

    // `order-1` again as a publisher that retried past JetStream's window sends it: no
    // message id, and its JSON written another way (keys in another order, spaces). Then
    // `order-2`'s id with another payload.
    let jetstream = async_nats::jetstream::new(connect_nats(&url).await.expect("connects"));
    let subject = "t.in.default.billing.".to_owned();
    let partition = rewind_host::store::KeyScope::new("default", "billing", "customer-0")
        .partition(super::cluster::PARTITIONS);
    for message in [
        r#"{"id": "order-1", "key": "customer-0", "payload": {"calls": [
            {"function": "charge", "args": {"input": 1}}]}}"#
            .to_owned(),
        json!({ "id": "order-2", "key": "customer-0", "payload": { "calls": [
            { "function": "charge", "args": { "input": 99 } }] } })
        .to_string(),
    ] {
        jetstream
            .publish(format!("{subject}{partition}"), message.into())
            .await
            .expect("publish")
            .await
            .expect("ack");
    }
    // The host restarts: it reads the partition again from its last checkpoint.
    host.kill();
    let host = Host::start(dir, &url, "a", 1, 1_000);
    host.joined().await;
    // A new event behind them on the same key: once it is out, they were read.
    std::fs::write(&file, line(Some("order-5"), 5)).expect("inputs");
    let last = publish_file(&url, "billing", &file);
    assert!(last.status.success(), "{}", stderr(&last));
    wait_for_outputs(&url, 1, 5, Duration::from_secs(60), &[&host]).await;
    wait_for_log(
        &host,
        "first published with another key or payload",
        &[&host],
    )
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let log = host.log();
    assert!(
        log.contains("an event published again; dropped")
            && !log.contains("event id \"order-1\" was first published with another"),
        "order-1 written another way is the same event: {log}"
    );

    assert_eq!(
        outputs(&url, 1).await.len(),
        5,
        "five events, each output once"
    );
    assert_eq!(
        (remote.keys().len(), remote.repeats()),
        (5, 0),
        "five charges, each made once"
    );
}

/// Inputs waiting when a host starts are read and judged many at once: of an id published
/// twice among them, the first message runs, and the second is dropped (the same event) or
/// refused (another payload), as when they arrive one by one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn of_an_id_published_twice_in_a_backlog_the_first_message_runs() {
    const EVENTS: usize = 48;
    let world = world(NatsServers::single().expect("nats-server starts")).await;
    let (url, remote, dir) = (world.url.clone(), world.remote.clone(), world.dir.path());
    // A host makes the streams; the backlog is published while none runs.
    let mut host = Host::start(dir, &url, "a", 1, 1_000);
    host.joined().await;
    host.kill();
    let jetstream = async_nats::jetstream::new(connect_nats(&url).await.expect("connects"));
    let partition = rewind_host::store::KeyScope::new("default", "billing", "customer-0")
        .partition(super::cluster::PARTITIONS);
    let subject = format!("t.in.default.billing.{partition}");
    let message = |k: usize, input: usize| {
        json!({ "id": format!("twice-{k}"), "key": "customer-0", "payload": { "calls": [
            { "function": "charge", "args": { "input": input } }] } })
        .to_string()
    };
    for k in 0..EVENTS {
        // Each id twice in a row: again as it was, or (odd ids) with another payload.
        let again = if k % 2 == 0 { k } else { 1_000 + k };
        for line in [message(k, k), message(k, again)] {
            jetstream
                .publish(subject.clone(), line.into())
                .await
                .expect("publish")
                .await
                .expect("ack");
        }
    }
    let host = Host::start(dir, &url, "a", 1, 1_000);
    host.joined().await;
    wait_for_outputs(&url, 1, EVENTS, Duration::from_secs(60), &[&host]).await;
    let log = host.log();
    assert_eq!(
        (
            log.matches("an event published again; dropped").count(),
            log.matches("was first published with another key or payload")
                .count()
        ),
        (EVENTS / 2, EVENTS / 2),
        "each second message dropped or refused: {log}"
    );
    let charged: BTreeSet<usize> = remote
        .effects
        .lock()
        .expect("lock")
        .values()
        .map(|effect| effect.to_string())
        .filter_map(|effect| {
            let at = effect.find("input")? + "input".len();
            let digits: String = effect[at..]
                .chars()
                .skip_while(|c| !c.is_ascii_digit())
                .take_while(char::is_ascii_digit)
                .collect();
            digits.parse().ok()
        })
        .collect();
    assert_eq!(
        charged,
        (0..EVENTS).collect(),
        "each id's first payload charged, once: {:?}",
        remote.effects.lock().expect("lock")
    );
    assert_eq!(remote.repeats(), 0);
    assert_eq!(outputs(&url, 1).await.len(), EVENTS);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publishing_to_an_agent_the_cluster_does_not_run_is_an_error() {
    let world = world(NatsServers::single().expect("nats-server starts")).await;
    let (url, dir) = (world.url.clone(), world.dir.path());
    let host = Host::start(dir, &url, "a", 1, 1_000);
    host.joined().await;
    let file = dir.join("inputs.jsonl");
    std::fs::write(&file, line(None, 1)).expect("inputs");
    let refused = publish_file(&url, "biling", &file);
    let said = stderr(&refused);
    assert_eq!(refused.status.code(), Some(1), "{said}");
    assert!(
        said.contains("runs no agent `biling`") && said.contains("default/billing"),
        "{said}"
    );
}

/// A host paused past its TTL is taken for dead, and a host started under its name takes the
/// name over: when the first wakes, it stops and says why, and the name stays the second's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_whose_name_was_taken_while_it_was_paused_stops_when_it_wakes() {
    let world = world(NatsServers::single().expect("nats-server starts")).await;
    let (url, dir) = (world.url.clone(), world.dir.path());
    let mut first = Host::start(dir, &url, "a", 1, 1_000);
    first.joined().await;
    first.signal(rustix::process::Signal::STOP);
    // The same agent from another directory, where the second host writes its log.
    let other = dir.join("second");
    std::fs::create_dir(&other).expect("mkdir");
    std::fs::copy(dir.join("agent.toml"), other.join("agent.toml")).expect("copy");
    let mut second = Host::start(&other, &url, "a", 1, 1_000);
    second.joined().await;
    first.signal(rustix::process::Signal::CONT);
    let status = first.exited(Duration::from_secs(60)).await;
    let said = first.log();
    assert_eq!(status.code(), Some(1), "{said}");
    assert!(
        said.contains("another process goes by this host's name `a` now"),
        "{said}"
    );
    second.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_under_the_name_of_a_live_host_is_refused() {
    let world = world(NatsServers::single().expect("nats-server starts")).await;
    let (url, dir) = (world.url.clone(), world.dir.path());
    let first = Host::start(dir, &url, "a", 1, 1_000);
    first.joined().await;
    let second = rewind(&[
        "cluster",
        "run",
        &dir.join("agent.toml").display().to_string(),
        "--nats",
        &url,
        "--prefix",
        "t",
        "--host",
        "a",
        "--partitions",
        "4",
        "--lease-ttl-ms",
        "1000",
    ]);
    let said = stderr(&second);
    assert_eq!(second.status.code(), Some(1), "{said}");
    assert!(
        said.contains("a host named `a` is alive in cluster `t`"),
        "{said}"
    );
}

#[test]
fn every_cluster_command_says_at_once_when_nats_cannot_be_reached() {
    // Bind and drop a listener: nothing listens on that port now.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port();
    let url = format!("nats://127.0.0.1:{port}");
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("inputs.jsonl");
    std::fs::write(&file, line(None, 1)).expect("inputs");
    super::cluster::write_agent(dir.path(), "http://127.0.0.1:9/charge");
    let agent = dir.path().join("agent.toml").display().to_string();
    let file = file.display().to_string();
    for args in [
        vec!["cluster", "publish", "billing", "--input", &file],
        vec!["cluster", "outputs"],
        vec!["cluster", "run", &agent],
    ] {
        let mut args = args.clone();
        args.extend(["--nats", &url]);
        let output = rewind(&args);
        let said = stderr(&output);
        assert_eq!(output.status.code(), Some(1), "{args:?}: {said}");
        assert!(
            said.contains(&format!("cannot connect to NATS at {url}"))
                && said.to_lowercase().contains("refused"),
            "{args:?}: {said}"
        );
    }
}
