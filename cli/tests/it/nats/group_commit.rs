//! Group commit on JetStream: appends that come while a publish is in flight share the next
//! message, and each is still a record of its own, at an offset of its own.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::message::PublishMessage;
use rewind_host::log::{
    IN_FLIGHT, JetStreamLog, Log, LogError, PER_MESSAGE, StreamSpec, connect_nats,
};
use rewind_host::testing::nats::{NatsServers, SoleHolder};

use super::{appending_tasks, everything};

fn spec(group_commit: bool) -> StreamSpec {
    StreamSpec::new("grouped-0", "grouped.0", 1).group_commit(group_commit)
}

/// A fenced log of one partition, as a cluster host writes.
async fn open(url: &str, group_commit: bool) -> Result<JetStreamLog, LogError> {
    let context = async_nats::jetstream::new(connect_nats(url).await.expect("connects"));
    JetStreamLog::open(
        context,
        vec![spec(group_commit)],
        Some(Arc::new(SoleHolder)),
    )
    .await
}

/// How many messages the stream holds on its record subject (not its fences).
async fn messages(url: &str) -> u64 {
    let context = async_nats::jetstream::new(connect_nats(url).await.expect("connects"));
    let mut stream = context.get_stream("grouped-0").await.expect("stream");
    let info = stream.info().await.expect("info");
    info.state.messages - IN_FLIGHT as u64
}

/// 64 tasks appending 20 records each, without pause, to one partition: what each was
/// told landed where.
async fn append_from_64_tasks(log: &Arc<JetStreamLog>) -> Vec<Vec<(u64, Vec<u8>)>> {
    let mut written = Vec::new();
    for task in appending_tasks(log, 64, 20, Duration::ZERO) {
        written.push(task.await.expect("task"));
    }
    written
}

/// The tests that count messages run on one thread. On several, an idle worker steals the
/// appenders a settled publish answered, and whether they append again within the
/// gathering's turn depends on how the operating system schedules that worker: on a busy
/// machine, often not. The count would measure the machine's load (the benches measure
/// gathering on a multi-threaded runtime); on one thread it measures the writer.
#[tokio::test]
async fn appends_that_wait_share_a_message_and_each_lands_once_where_it_was_told() {
    let server = NatsServers::single().expect("nats-server starts");
    let log = Arc::new(open(&server.url(), true).await.expect("opens"));
    let written = append_from_64_tasks(&log).await;

    for task in &written {
        assert!(
            task.windows(2).all(|pair| pair[0].0 < pair[1].0),
            "one task's appends land in the order it made them: {task:?}"
        );
    }
    let written: BTreeSet<(u64, Vec<u8>)> = written.into_iter().flatten().collect();
    assert_eq!(
        written.len(),
        64 * 20,
        "every append has an offset of its own"
    );
    let records: BTreeSet<(u64, Vec<u8>)> = everything(&*log).await.into_iter().collect();
    assert_eq!(
        records, written,
        "each append is in the log once, at the offset it was told, and nothing else is"
    );
    let messages = messages(&server.url()).await;
    assert!(
        messages < 64 * 20 / 2,
        "appends that waited went out together: {messages} messages for {} records",
        64 * 20
    );
}

/// Appenders that append again as soon as they are answered (as a host's keys do, a call
/// after a call) go out together: a message waits for the appenders its predecessor
/// answered, instead of two groups taking turns in half-full messages.
/// On one thread: see above.
#[tokio::test]
async fn appenders_answered_together_append_again_together() {
    let server = NatsServers::single().expect("nats-server starts");
    let log = Arc::new(open(&server.url(), true).await.expect("opens"));
    let (tasks, each) = (8, 50);
    for task in appending_tasks(&log, tasks, each, Duration::ZERO) {
        assert_eq!(task.await.expect("task").len(), each as usize);
    }
    let messages = messages(&server.url()).await;
    // Full messages are `each` and a few; messages taking turns are twice as many.
    assert!(
        messages < u64::from(each) * 3 / 2,
        "{messages} messages for {tasks} appenders' {each} rounds"
    );
}

/// Many appenders, stopping at different times, while the server restarts: every append
/// is answered and lands once (what gathered at the break goes out with the mender's
/// retries, and the waits after it end whether or not its appenders append again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn appenders_that_stop_at_different_times_are_all_answered_across_a_restart() {
    let mut server = NatsServers::single().expect("nats-server starts");
    let log = Arc::new(open(&server.url(), true).await.expect("opens"));
    let tasks: Vec<_> = (0..16u32)
        .map(|task| {
            let log = Arc::clone(&log);
            tokio::spawn(async move {
                for i in 0..100 + 20 * task {
                    let payload = format!("{task}-{i}").into_bytes();
                    log.append(0, payload)
                        .await
                        .unwrap_or_else(|e| panic!("append {task}-{i}: {e}"));
                    if i % 10 == 9 {
                        tokio::time::sleep(Duration::from_millis(1)).await;
                    }
                }
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(100)).await;
    tokio::task::block_in_place(|| server.restart(0)).expect("nats-server restarts");
    tokio::time::timeout(Duration::from_secs(60), async {
        for task in tasks {
            task.await.expect("task");
        }
    })
    .await
    .expect("every append is answered");
    let records = everything(&*log).await;
    let expected: usize = (0..16).map(|task| 100 + 20 * task).sum();
    assert_eq!(records.len(), expected, "as many records as appends");
    let distinct: BTreeSet<Vec<u8>> = records.into_iter().map(|(_, payload)| payload).collect();
    assert_eq!(distinct.len(), expected, "each append lands once");
}

/// The same appends on a stream without group commit: a message each, offsets one apart
/// (after the fence).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_group_commit_each_append_is_a_message() {
    let server = NatsServers::single().expect("nats-server starts");
    let log = Arc::new(open(&server.url(), false).await.expect("opens"));
    let written = append_from_64_tasks(&log).await;
    let mut offsets: Vec<u64> = written.into_iter().flatten().map(|(o, _)| o).collect();
    offsets.sort_unstable();
    let first = IN_FLIGHT as u64;
    assert_eq!(offsets, (first..first + 64 * 20).collect::<Vec<_>>());
    assert_eq!(messages(&server.url()).await, 64 * 20);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_and_retention_may_start_inside_a_message() {
    let server = NatsServers::single().expect("nats-server starts");
    let log = Arc::new(open(&server.url(), true).await.expect("opens"));
    append_from_64_tasks(&log).await;
    let records = everything(&*log).await;
    // A record in the middle of a message of several: offsets count places in a message.
    let (at, (inside, _)) = records
        .iter()
        .enumerate()
        .find(|(i, (offset, _))| offset % PER_MESSAGE as u64 == 2 && *i + 1 < records.len())
        .expect("a message of three records or more");

    let two = log.read(0, *inside, 2).await.expect("read");
    let two: Vec<(u64, Vec<u8>)> = two.into_iter().map(|r| (r.offset, r.payload)).collect();
    assert_eq!(
        two,
        records[at..at + 2],
        "a read starts at the record asked for"
    );

    log.delete_below(0, *inside).await.expect("delete");
    let kept = everything(&*log).await;
    assert!(
        kept.first().is_some_and(|(first, _)| first <= inside),
        "the message that holds the offset stays"
    );
    assert_eq!(
        kept.iter().filter(|(offset, _)| offset >= inside).count(),
        records.len() - at,
        "every record at or above the offset stays"
    );
}

/// A stream's offsets are made one way for life: opened the other way, the log is refused,
/// and the error says how the stream was made. A stream made by hand (whatever its
/// description) is one without.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_is_opened_only_the_way_it_was_made() {
    let server = NatsServers::single().expect("nats-server starts");
    let log = open(&server.url(), true).await.expect("opens");
    log.append(0, b"x".to_vec()).await.expect("append");
    let error = open(&server.url(), false).await.expect_err("the other way");
    let message = error.to_string();
    assert!(
        matches!(
            error,
            LogError::StreamMade {
                group_commit: true,
                ..
            }
        ) && message.contains("grouped-0")
            && message.contains("made with group commit, and is opened without"),
        "{message}"
    );

    let server = NatsServers::single().expect("nats-server starts");
    let context = async_nats::jetstream::new(connect_nats(&server.url()).await.expect("connects"));
    context
        .create_stream(async_nats::jetstream::stream::Config {
            name: "grouped-0".to_owned(),
            subjects: vec!["grouped.0".to_owned(), "grouped.0.fence".to_owned()],
            description: Some("orders, partition 0".to_owned()),
            ..Default::default()
        })
        .await
        .expect("a stream made by hand");
    open(&server.url(), false)
        .await
        .expect("opens as it was made");
    let message = open(&server.url(), true)
        .await
        .expect_err("the other way")
        .to_string();
    assert!(
        message.contains("made without group commit, and is opened with"),
        "{message}"
    );
}

/// A message whose records do not add up is an error that names the stream and the
/// message, not records made up from its bytes; the records before it stay readable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_that_misstates_its_records_is_an_error_naming_it() {
    let server = NatsServers::single().expect("nats-server starts");
    let log = open(&server.url(), true).await.expect("opens");
    let before = log.append(0, b"before".to_vec()).await.expect("append");
    let context = async_nats::jetstream::new(connect_nats(&server.url()).await.expect("connects"));
    let ack = context
        .send_publish(
            "grouped.0",
            PublishMessage::build()
                .payload(b"\x05\x00\x00\x00abc".to_vec().into())
                .header("Rewind-Records", "2"),
        )
        .await
        .expect("sent")
        .await
        .expect("landed");

    let error = log.read(0, before + 1, 10).await.expect_err("misstated");
    let message = error.to_string();
    assert!(
        matches!(error, LogError::Corrupt { .. })
            && message.contains("grouped-0")
            && message.contains(&format!("message {}", ack.sequence))
            && message.contains("record 0 of 2"),
        "{message}"
    );
    let first = log.read(0, before, 1).await.expect("read before it");
    assert_eq!(first[0].payload, b"before");
}
