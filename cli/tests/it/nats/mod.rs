//! The log on NATS JetStream (issue #7): the conformance suite every log passes, against a
//! real nats-server (Debian's, installed by scripts/test.sh) on loopback.

use std::sync::Arc;
use std::time::Duration;

use rewind_host::log::{Guarded, JetStreamLog, Log, StreamSpec, connect_nats};
use rewind_host::testing::nats::{NatsServers, SoleHolder};

fn jetstream_log(partitions: u32) -> Arc<dyn Log> {
    let server = NatsServers::single().expect("nats-server starts");
    let log = tokio::task::block_in_place(|| {
        tokio::runtime::Handle::current().block_on(JetStreamLog::connect(
            &server.url(),
            "rewind-test",
            partitions,
            1,
        ))
    })
    .expect("the log connects");
    Arc::new(Guarded::new(log, server))
}

rewind_host::log_conformance_tests!(jetstream_log);

/// An appending task: it returns what it was told landed where.
type Writer = tokio::task::JoinHandle<Vec<(u64, Vec<u8>)>>;

/// `tasks` tasks appending `TASK-I` to `log`, `each` of them, `pause` apart; each returns
/// what it was told landed where. Any failed append fails the test.
fn appending_tasks(log: &Arc<JetStreamLog>, tasks: u32, each: u32, pause: Duration) -> Vec<Writer> {
    (0..tasks)
        .map(|task| {
            let log = Arc::clone(log);
            tokio::spawn(async move {
                let mut written = Vec::new();
                for i in 0..each {
                    let payload = format!("{task}-{i}").into_bytes();
                    let offset = log
                        .append(0, payload.clone())
                        .await
                        .unwrap_or_else(|e| panic!("append {task}-{i}: {e}"));
                    written.push((offset, payload));
                    if !pause.is_zero() {
                        tokio::time::sleep(pause).await;
                    }
                }
                written
            })
        })
        .collect()
}

/// Every record of partition 0, with its offset, in offset order.
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

/// A fenced log, as a cluster host writes its state to: every write expects the last
/// sequence, where its predecessor lands.
fn fenced_jetstream_log(partitions: u32) -> Arc<dyn Log> {
    fenced(partitions, false)
}

/// A fenced log with group commit: appends that wait for a publish share a message.
fn grouped_jetstream_log(partitions: u32) -> Arc<dyn Log> {
    fenced(partitions, true)
}

fn fenced(partitions: u32, group_commit: bool) -> Arc<dyn Log> {
    let server = NatsServers::single().expect("nats-server starts");
    let log = tokio::task::block_in_place(|| {
        tokio::runtime::Handle::current().block_on(async {
            let client = connect_nats(&server.url()).await?;
            let streams = (0..partitions)
                .map(|p| {
                    StreamSpec::new(format!("fenced-{p}"), format!("fenced.{p}"), 1)
                        .group_commit(group_commit)
                })
                .collect();
            JetStreamLog::open(
                async_nats::jetstream::new(client),
                streams,
                Some(Arc::new(SoleHolder)),
            )
            .await
        })
    })
    .expect("the fenced log opens");
    Arc::new(Guarded::new(log, server))
}

/// The store's conformance suite over the JetStream log, with either marker strategy (the
/// fenced and grouped logs with a shelf, as a cluster has).
mod store {
    use std::sync::Arc;

    use rewind_host::log::Log;
    use rewind_host::store::{LogStore, MarkerStrategy};

    /// A store over `log`, shelving on `shelf` (as a cluster's partitions do).
    fn shelved(log: Arc<dyn Log>, shelf: Arc<dyn Log>, strategy: MarkerStrategy) -> Arc<LogStore> {
        let store = LogStore::new(log, strategy, rewind_host::store::Incarnation::random());
        Arc::new(store.with_shelf(shelf).expect("as many partitions"))
    }

    mod offsets {
        use super::*;
        rewind_host::store_conformance_tests!(|partitions| Arc::new(LogStore::new(
            super::super::jetstream_log(partitions),
            MarkerStrategy::Offsets,
            rewind_host::store::Incarnation::random()
        )));
    }

    mod refresh {
        use super::*;
        rewind_host::store_conformance_tests!(|partitions| Arc::new(LogStore::new(
            super::super::jetstream_log(partitions),
            MarkerStrategy::Refresh,
            rewind_host::store::Incarnation::random()
        )));
    }

    mod fenced_offsets {
        use super::*;
        rewind_host::store_conformance_tests!(|partitions| shelved(
            super::super::fenced_jetstream_log(partitions),
            super::super::fenced_jetstream_log(partitions),
            MarkerStrategy::Offsets,
        ));
    }

    mod fenced_refresh {
        use super::*;
        rewind_host::store_conformance_tests!(|partitions| shelved(
            super::super::fenced_jetstream_log(partitions),
            super::super::fenced_jetstream_log(partitions),
            MarkerStrategy::Refresh,
        ));
    }

    mod grouped_offsets {
        use super::*;
        rewind_host::store_conformance_tests!(|partitions| shelved(
            super::super::grouped_jetstream_log(partitions),
            super::super::grouped_jetstream_log(partitions),
            MarkerStrategy::Offsets,
        ));
    }

    mod grouped_refresh {
        use super::*;
        rewind_host::store_conformance_tests!(|partitions| shelved(
            super::super::grouped_jetstream_log(partitions),
            super::super::grouped_jetstream_log(partitions),
            MarkerStrategy::Refresh,
        ));
    }
}

pub(crate) mod cluster;
mod group_commit;
mod leases;
mod many_keys;
mod operator;
mod publish;
mod secure;
mod startup;

/// The fencing tests on streams of one record per message, and on streams with group
/// commit (records that wait for a publish share the next message): the same file, which
/// tells by its module's name.
mod fencing;
#[path = "fencing.rs"]
#[expect(
    clippy::duplicate_mod,
    reason = "the same tests, on the other kind of stream"
)]
mod fencing_with_group_commit;

/// The checkpoint store's conformance suite over a JetStream stream.
mod checkpoints {
    use rewind_host::checkpoint::LogCheckpoints;
    use rewind_host::checkpoint::conformance::Fresh;

    rewind_host::checkpoint_conformance_tests!(|| Fresh {
        store: std::sync::Arc::new(LogCheckpoints::new(super::jetstream_log(1), 0)),
        guard: Box::new(()),
    });

    /// On a fenced stream with group commit, as a cluster host keeps its checkpoints.
    mod grouped {
        use rewind_host::checkpoint::LogCheckpoints;
        use rewind_host::checkpoint::conformance::Fresh;

        rewind_host::checkpoint_conformance_tests!(|| Fresh {
            store: std::sync::Arc::new(LogCheckpoints::new(
                super::super::grouped_jetstream_log(1),
                0
            )),
            guard: Box::new(()),
        });
    }
}
