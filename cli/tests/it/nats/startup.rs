//! Hosts of a cluster started together: each makes the lease bucket and the streams it
//! needs, whichever host gets there first.

use std::time::Duration;

use rewind_host::cluster::Layout;
use rewind_host::log::{JetStreamLog, LogError, StreamSpec, connect_nats};
use rewind_host::testing::nats::NatsServers;

const HOSTS: usize = 16;
const ROUNDS: usize = 20;
const PARTITIONS: u32 = 2;

/// Everything a host opens as it starts and as it takes partitions: the lease bucket, the
/// recorded layout, the input streams, and each partition's state, output and checkpoint
/// streams.
async fn start_host(url: String, layout: Layout, host: usize) -> Result<(), String> {
    let client = connect_nats(&url).await.map_err(|e| e.to_string())?;
    let context = async_nats::jetstream::new(client);
    layout
        .join(&context, &format!("h{host}"), Duration::from_secs(5))
        .await
        .map_err(|e| format!("{e:#}"))?;
    let streams: Vec<StreamSpec> = (0..PARTITIONS)
        .flat_map(|p| {
            [
                layout.state_stream(p),
                layout.shelf_stream(p),
                layout.output_stream(p),
                layout.checkpoint_stream(p),
            ]
        })
        .collect();
    JetStreamLog::open(context, streams, None)
        .await
        .map_err(|e| e.to_string())?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hosts_started_together_all_open_the_same_buckets_and_streams() {
    let server = NatsServers::single().expect("nats-server starts");
    for round in 0..ROUNDS {
        let layout = Layout {
            prefix: format!("together{round}"),
            partitions: PARTITIONS,
            replicas: 1,
            group_commit: round % 2 == 1,
        };
        let hosts: Vec<_> = (0..HOSTS)
            .map(|host| tokio::spawn(start_host(server.url(), layout.clone(), host)))
            .collect();
        for (host, started) in hosts.into_iter().enumerate() {
            if let Err(error) = started.await.expect("the host's task") {
                panic!("round {round}: host h{host} did not start: {error}");
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_made_otherwise_is_refused_naming_what_differs() {
    let server = NatsServers::single().expect("nats-server starts");
    let context = async_nats::jetstream::new(connect_nats(&server.url()).await.expect("connects"));
    JetStreamLog::open(
        context.clone(),
        vec![StreamSpec::new("made-once", "made.once", 1)],
        None,
    )
    .await
    .expect("made");
    // The same name with another subject.
    let error = JetStreamLog::open(
        context.clone(),
        vec![StreamSpec::new("made-once", "made.elsewhere", 1)],
        None,
    )
    .await
    .expect_err("the stream has other subjects");
    assert!(
        matches!(&error, LogError::StreamConflict { stream, field: "subjects", .. } if stream == "made-once"),
        "{error}"
    );
    let message = error.to_string();
    assert!(
        message.contains("made.once") && message.contains("made.elsewhere"),
        "{message}"
    );
    // Another name whose subject the first stream holds.
    let error = JetStreamLog::open(
        context,
        vec![StreamSpec::new("made-twice", "made.once", 1)],
        None,
    )
    .await
    .expect_err("the subject is taken");
    assert!(
        matches!(&error, LogError::SubjectsTaken { holder, .. } if holder == "made-once"),
        "{error}"
    );
}
