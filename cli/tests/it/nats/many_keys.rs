//! A partition of 50,000 keys on a nats-server whose largest message is 1 MiB: its
//! checkpoints hold every key's counters, so they outgrow a message and are saved in parts;
//! they must be saved all the same, and a host that takes the partition over recovers from
//! them.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::ErrorCode;
use async_nats::jetstream::context::GetStreamErrorKind;
use futures_util::StreamExt as _;
use rewind_host::checkpoint::{Checkpoint, CheckpointStore, LogCheckpoints};
use rewind_host::cluster::{Layout, inputs};
use rewind_host::log::{JetStreamLog, Log, connect_nats};
use rewind_host::testing::nats::NatsServers;
use tokio::sync::Semaphore;

use super::cluster::Host;
use crate::support::guest;

const KEYS: u32 = 50_000;
/// Keys that get a second input after the takeover.
const AGAIN: u32 = 100;

fn layout() -> Layout {
    Layout {
        prefix: "t".to_owned(),
        partitions: 1,
        replicas: 1,
        group_commit: false,
    }
}

/// Publishes one input for each key of `keys`, numbered by the key, many at once.
async fn publish(url: &str, keys: std::ops::Range<u32>, round: u32) {
    let context = async_nats::jetstream::new(connect_nats(url).await.expect("connects"));
    let layout = Arc::new(layout());
    let permits = Arc::new(Semaphore::new(256));
    let mut tasks = tokio::task::JoinSet::new();
    for k in keys {
        let permit = Arc::clone(&permits).acquire_owned().await.expect("open");
        let (context, layout) = (context.clone(), Arc::clone(&layout));
        tasks.spawn(async move {
            let _permit = permit;
            inputs::publish(
                &context,
                &layout,
                "default",
                "crowd",
                &format!("input-{k}-{round}"),
                &format!("key-{k}"),
                &format!("{{\"memory_set\": {{\"last\": {k}}}}}"),
            )
            .await
            .unwrap_or_else(|e| panic!("publishing to key-{k}: {e}"));
        });
    }
    while let Some(done) = tasks.join_next().await {
        done.expect("publisher");
    }
}

/// A log over one of the partition's streams, read from outside the hosts.
async fn stream(url: &str, spec: rewind_host::log::StreamSpec) -> JetStreamLog {
    let context = async_nats::jetstream::new(connect_nats(url).await.expect("connects"));
    JetStreamLog::open(context, vec![spec], None)
        .await
        .expect("the stream")
}

/// The partition's newest checkpoint, read while no host runs (a host's retention deletes
/// what a reader beside it may be reading).
async fn latest_checkpoint(url: &str) -> Checkpoint {
    let log: Arc<dyn Log> = Arc::new(stream(url, layout().checkpoint_stream(0)).await);
    LogCheckpoints::new(log, 0)
        .latest()
        .await
        .expect("the checkpoints read")
        .expect("a checkpoint")
}

/// Waits until the partition has `count` outputs; fails after `within` showing the host's
/// log. Outputs are counted by their subject: the stream also holds the fences each host
/// writes when it takes the partition (on a subject of their own).
async fn wait_for_outputs(url: &str, count: u64, within: Duration, host: &Host) {
    let context = async_nats::jetstream::new(connect_nats(url).await.expect("connects"));
    let spec = layout().output_stream(0);
    let deadline = Instant::now() + within;
    loop {
        let mut held = 0;
        // The host makes the stream when it takes the partition, which may be after the
        // inputs are published.
        match context.get_stream(&spec.name).await {
            Ok(stream) => {
                let mut subjects = stream
                    .info_with_subjects(&spec.subject)
                    .await
                    .expect("its info");
                while let Some(subject) = subjects.next().await {
                    let (subject, messages) = subject.expect("a subject's count");
                    if subject == spec.subject {
                        held += messages as u64;
                    }
                }
            }
            Err(e)
                if matches!(e.kind(), GetStreamErrorKind::JetStream(e)
                    if e.error_code() == ErrorCode::STREAM_NOT_FOUND) => {}
            Err(e) => panic!("the output stream: {e}"),
        }
        if held >= count {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{held} of {count} outputs after {within:?}; the host's log:\n{}",
            host.log()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_thousand_keys_checkpoint_past_a_1_mib_message_and_recover() {
    let servers = NatsServers::single_with_max_payload(1 << 20).expect("nats-server starts");
    let url = servers.url();
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(
        dir.path().join("agent.toml"),
        format!(
            "name = \"crowd\"\nparallelism = 64\n\n[state]\ncheckpoint-every-ms = 2000\n\
             checkpoint-every-inputs = 100000\n\n[[actions]]\nname = \"work\"\n\
             component = {:?}\non = [\"input\"]\n",
            guest("caller").display().to_string()
        ),
    )
    .expect("agent.toml");

    let mut first = Host::start_in(dir.path(), &url, "h1", 1, &[]);
    first.joined().await;
    publish(&url, 0..KEYS, 1).await;
    wait_for_outputs(&url, KEYS.into(), Duration::from_secs(240), &first).await;
    first.kill();
    assert!(
        !first.log().contains("checkpoint failed"),
        "no checkpoint failed:\n{}",
        first.log()
    );
    // Checkpoints were taken every 2 s as the keys grew: the newest is past 1 MiB.
    let checkpoints = stream(&url, layout().checkpoint_stream(0)).await;
    let (_, end) = checkpoints.bounds(0).await.expect("bounds");
    let head = checkpoints
        .read(0, end - 1, 1)
        .await
        .expect("read")
        .remove(0);
    assert!(
        head.payload.starts_with(b"{\"split\":"),
        "the newest checkpoint is saved in parts: {}",
        String::from_utf8_lossy(&head.payload)
    );

    // Another host takes the partition over from that checkpoint, after a SIGKILL: the
    // inputs it counts pending run again without a second output, and the keys' counters
    // carry on, so a key's next input is its sequence 2, with an output id of its own.
    let mut second = Host::start_in(dir.path(), &url, "h2", 1, &[]);
    second.joined().await;
    publish(&url, 0..AGAIN, 2).await;
    wait_for_outputs(
        &url,
        u64::from(KEYS + AGAIN),
        Duration::from_secs(120),
        &second,
    )
    .await;
    second.stop();
    assert!(
        !second.log().contains("checkpoint failed"),
        "{}",
        second.log()
    );
    let last = latest_checkpoint(&url).await;
    assert_eq!(last.keys.len(), KEYS as usize, "every key's counters");
    assert_eq!(last.input_position, u64::from(KEYS + AGAIN));
    assert!(last.pending.is_empty());
    for (key, progress) in &last.keys {
        let k: u32 = key["key-".len()..].parse().expect("a key's number");
        let inputs = if k < AGAIN { 2 } else { 1 };
        assert_eq!(
            (progress.next_sequence, progress.last_completed),
            (inputs + 1, inputs),
            "{key}'s counters"
        );
    }
    let outputs = rewind_host::cluster::outputs::read_outputs(
        &stream(&url, layout().output_stream(0)).await,
        0,
        0,
    )
    .await
    .expect("outputs");
    let ids: std::collections::BTreeSet<&str> =
        outputs.iter().map(|(_, o)| o.id.as_str()).collect();
    assert_eq!(
        (outputs.len(), ids.len()),
        ((KEYS + AGAIN) as usize, (KEYS + AGAIN) as usize),
        "each input's output once"
    );
    let seconds = outputs.iter().filter(|(_, o)| o.sequence == 2).count();
    assert_eq!(
        seconds, AGAIN as usize,
        "the second inputs are each key's sequence 2"
    );
}
