//! Fenced JetStream logs: once another host has taken a partition over, the host that held
//! it before cannot write to it, whatever it was doing at the time.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use rewind_host::log::{Authority, JetStreamLog, Log, LogError, StreamSpec, connect_nats};
use rewind_host::testing::nats::NatsServers;

/// Who holds the partition, as a lease bucket would say.
#[derive(Debug, Default)]
struct Holder(Mutex<&'static str>);

/// One host's view: it holds the partition while the holder is itself.
#[derive(Debug)]
struct Host {
    name: &'static str,
    holder: Arc<Holder>,
}

#[async_trait]
impl Authority for Host {
    async fn holds(&self) -> Result<bool, String> {
        Ok(*self.holder.0.lock().expect("holder") == self.name)
    }
}

fn streams() -> Vec<StreamSpec> {
    vec![StreamSpec {
        name: "fenced-0".to_owned(),
        subject: "fenced.0".to_owned(),
        replicas: 1,
    }]
}

async fn open(url: &str, name: &'static str, holder: &Arc<Holder>) -> JetStreamLog {
    *holder.0.lock().expect("holder") = name;
    let client = connect_nats(url).await.expect("connects");
    JetStreamLog::open(
        async_nats::jetstream::new(client),
        streams(),
        Some(Arc::new(Host {
            name,
            holder: Arc::clone(holder),
        })),
    )
    .await
    .expect("the holder opens its log")
}

async fn everything(log: &dyn Log) -> Vec<(u64, Vec<u8>)> {
    let (start, end) = log.bounds(0).await.expect("bounds");
    let mut records = Vec::new();
    let mut next = start;
    while next < end {
        let batch = log.read(0, next, 100).await.expect("read");
        let Some(last) = batch.last() else { break };
        next = last.offset + 1;
        records.extend(batch.into_iter().map(|r| (r.offset, r.payload)));
    }
    records
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_that_lost_its_partition_cannot_write_to_it() {
    let server = NatsServers::single().expect("nats-server starts");
    let holder = Arc::new(Holder::default());
    let zombie = open(&server.url(), "a", &holder).await;
    let before = zombie
        .append(0, b"a1".to_vec())
        .await
        .expect("the holder writes");

    // B takes over; A does not know and goes on writing.
    let successor = open(&server.url(), "b", &holder).await;
    let refused = zombie.append(0, b"a2".to_vec()).await;
    assert!(
        matches!(refused, Err(LogError::Fenced { .. })),
        "the zombie's write is refused: {refused:?}"
    );
    let error = refused.expect_err("refused").to_string();
    assert!(
        error.contains("fenced-0") && error.contains("another host"),
        "{error}"
    );
    // Fenced for good, also for appends that never reach the server.
    assert!(matches!(
        zombie.append(0, b"a3".to_vec()).await,
        Err(LogError::Fenced { .. })
    ));
    let after = successor
        .append(0, b"b1".to_vec())
        .await
        .expect("the new holder writes");

    let records = everything(&successor).await;
    assert_eq!(
        records,
        [(before, b"a1".to_vec()), (after, b"b1".to_vec())],
        "the zombie's writes are not in the log, and readers skip the fences"
    );
    assert!(
        after > before + 1,
        "the fences take offsets: {before} then {after}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_during_writes_leaves_exactly_the_acknowledged_ones() {
    let server = NatsServers::single().expect("nats-server starts");
    let holder = Arc::new(Holder::default());
    let zombie = Arc::new(open(&server.url(), "a", &holder).await);

    // A writes from 8 tasks without pause while B takes over.
    let mut writers = Vec::new();
    for task in 0..8u32 {
        let zombie = Arc::clone(&zombie);
        writers.push(tokio::spawn(async move {
            let mut acknowledged = Vec::new();
            for i in 0u32.. {
                let payload = format!("a-{task}-{i}").into_bytes();
                match zombie.append(0, payload.clone()).await {
                    Ok(offset) => acknowledged.push((offset, payload)),
                    Err(LogError::Fenced { .. }) => return acknowledged,
                    Err(other) => panic!("only fencing stops a writer: {other}"),
                }
            }
            unreachable!()
        }));
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let successor = open(&server.url(), "b", &holder).await;
    let mut acknowledged = BTreeSet::new();
    for writer in writers {
        acknowledged.extend(writer.await.expect("writer"));
    }
    let fenced_at = successor.append(0, b"b".to_vec()).await.expect("B writes");

    let records = everything(&successor).await;
    let from_a: BTreeSet<(u64, Vec<u8>)> = records
        .iter()
        .filter(|(_, p)| p.starts_with(b"a-"))
        .cloned()
        .collect();
    assert!(
        acknowledged.len() > 10,
        "A wrote before the takeover: {}",
        acknowledged.len()
    );
    assert_eq!(
        from_a, acknowledged,
        "every write A was told landed is in the log, and no other"
    );
    assert!(
        from_a.iter().all(|(offset, _)| *offset < fenced_at),
        "nothing of A's lands after B's fence"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn appends_carry_on_across_a_server_restart() {
    let mut server = NatsServers::single().expect("nats-server starts");
    let log = Arc::new(
        JetStreamLog::connect(&server.url(), "restart", 1, 1)
            .await
            .expect("connects"),
    );
    let writer = {
        let log = Arc::clone(&log);
        tokio::spawn(async move {
            let mut offsets = Vec::new();
            for i in 0..400u32 {
                let offset = log
                    .append(0, i.to_be_bytes().to_vec())
                    .await
                    .unwrap_or_else(|e| panic!("append {i} retried until it landed: {e}"));
                offsets.push(offset);
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            offsets
        })
    };
    tokio::time::sleep(Duration::from_millis(150)).await;
    tokio::task::block_in_place(|| server.restart(0)).expect("nats-server restarts");
    let offsets = writer.await.expect("writer");

    let records = everything(&*log).await;
    let payloads: Vec<u32> = records
        .iter()
        .map(|(_, p)| u32::from_be_bytes(p[..].try_into().expect("4 bytes")))
        .collect();
    assert_eq!(
        payloads,
        (0..400).collect::<Vec<_>>(),
        "each append once, in order"
    );
    assert_eq!(
        records.iter().map(|(o, _)| *o).collect::<Vec<_>>(),
        offsets,
        "each append's offset is where it is"
    );
}
