//! Operator commands on a cluster's state: a parked input skipped and another cancelled
//! through `rewind cluster skip|cancel`, carried out by the host that holds the partition.

use std::process::Command;
use std::time::Duration;

use rewind_host::cluster::inputs;
use rewind_host::log::connect_nats;
use rewind_host::testing::nats::NatsServers;
use serde_json::json;

use super::cluster::{Host, layout, outputs, wait_for_log};
use crate::support::guest;

/// `rewind cluster VERB billing --nats URL --prefix t ARGS`, waiting up to 60 s for the
/// outcome: (success, stderr).
fn command(url: &str, verb: &str, args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_rewind"))
        .args(["cluster", verb, "billing", "--nats", url, "--prefix", "t"])
        .args(args)
        .args(["--wait", "60"])
        .output()
        .expect("rewind runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_input_skipped_and_another_cancelled_through_the_cluster_never_run_again() {
    let servers = NatsServers::single().expect("nats-server starts");
    let url = servers.url();
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(
        dir.path().join("agent.toml"),
        format!(
            "name = \"billing\"\n\n[state]\ncheckpoint-every-ms = 100\n\n[retry]\nattempts = 1\n\n\
             [[actions]]\nname = \"work\"\ncomponent = {:?}\non = [\"input\"]\n",
            guest("caller").display().to_string()
        ),
    )
    .expect("write agent.toml");
    let host = Host::start(dir.path(), &url, "a", 1, 2_000);
    host.joined().await;

    let context = async_nats::jetstream::new(connect_nats(&url).await.expect("connects"));
    let layout = layout(1);
    for (id, key, payload) in [
        ("k1", "k", json!({ "fail": "the payload is bad" })),
        ("k2", "k", json!({})),
        ("j1", "j", json!({ "fail": "never works" })),
    ] {
        inputs::publish(
            &context,
            &layout,
            "default",
            "billing",
            id,
            key,
            &payload.to_string(),
        )
        .await
        .expect("published");
    }
    // Logged once each park is recorded and takes commands.
    wait_for_log(&host, "input parked after its last attempt", &[&host]).await;
    let started = std::time::Instant::now();
    while host
        .log()
        .matches("input parked after its last attempt")
        .count()
        < 2
    {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "{}",
            host.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let (ok, said) = command(
        &url,
        "skip",
        &["--key", "k", "--by", "ops", "--reason", "bad"],
    );
    assert!(ok, "{said}\n{}", host.log());
    assert!(said.contains("skip of key k by ops: done (#1)"), "{said}");
    let (ok, said) = command(
        &url,
        "cancel",
        &["--key", "j", "--sequence", "1", "--by", "ops"],
    );
    assert!(ok, "{said}\n{}", host.log());
    assert!(
        said.contains("cancel of key j #1 by ops: done (#1)"),
        "{said}"
    );
    let (ok, said) = command(&url, "retry", &["--key", "nobody"]);
    assert!(!ok, "{said}");
    assert!(
        said.contains("refused: key nobody has no parked input"),
        "{said}"
    );

    let started = std::time::Instant::now();
    let written = loop {
        let written = outputs(&url, 1).await;
        if !written.is_empty() || started.elapsed() > Duration::from_secs(60) {
            break written;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let ran: Vec<(&str, u64)> = written
        .iter()
        .map(|o| (o.key.as_str(), o.sequence))
        .collect();
    assert_eq!(ran, [("k", 2)], "k #2 ran once; k #1 and j #1 never again");
}
