//! The conformance suite every [`Log`] must pass.
//!
//! Each case takes a factory that makes a fresh, empty log with the given number of
//! partitions. A backend runs the whole suite with [`log_conformance_tests!`].
//!
//! [`log_conformance_tests!`]: crate::log_conformance_tests

use std::sync::Arc;

use super::{Log, LogError};

/// Makes a fresh, empty log with this many partitions.
pub trait Factory: Fn(u32) -> Arc<dyn Log> {}
impl<F: Fn(u32) -> Arc<dyn Log>> Factory for F {}

/// Generates one `#[tokio::test]` per conformance case for the log `$factory` makes.
#[macro_export]
macro_rules! log_conformance_tests {
    ($factory:expr) => {
        $crate::log_conformance_tests!(@cases $factory;
            appends_get_consecutive_offsets_per_partition,
            read_returns_records_in_order_from_an_offset,
            read_at_the_end_is_empty_and_past_it_is_out_of_range,
            concurrent_appends_get_distinct_increasing_offsets,
            delete_below_keeps_every_record_at_or_above_the_offset,
            payloads_of_any_size_round_trip,
            an_unknown_partition_is_an_error,
            append_many_returns_offsets_in_order,
            a_record_past_max_record_is_refused_and_nothing_is_written,
        );
    };
    (@cases $factory:expr; $($case:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                let factory = $factory;
                $crate::log::conformance::$case(&factory).await;
            }
        )*
    };
}

async fn append(log: &dyn Log, partition: u32, payload: &[u8]) -> u64 {
    log.append(partition, payload.to_vec())
        .await
        .expect("append")
}

pub async fn appends_get_consecutive_offsets_per_partition(factory: &dyn Factory) {
    let log = factory(3);
    assert_eq!(log.partitions(), 3);
    assert_eq!(append(&*log, 0, b"a").await, 0);
    assert_eq!(append(&*log, 0, b"b").await, 1);
    assert_eq!(
        append(&*log, 2, b"c").await,
        0,
        "partitions count offsets apart"
    );
    assert_eq!(append(&*log, 0, b"d").await, 2);
    assert_eq!(log.bounds(0).await.expect("bounds"), (0, 3));
    assert_eq!(log.bounds(1).await.expect("bounds"), (0, 0));
    assert_eq!(log.bounds(2).await.expect("bounds"), (0, 1));
}

pub async fn read_returns_records_in_order_from_an_offset(factory: &dyn Factory) {
    let log = factory(1);
    for i in 0..10u8 {
        append(&*log, 0, &[i]).await;
    }
    let records = log.read(0, 3, 4).await.expect("read");
    let got: Vec<(u64, Vec<u8>)> = records.into_iter().map(|r| (r.offset, r.payload)).collect();
    assert_eq!(
        got,
        [(3, vec![3]), (4, vec![4]), (5, vec![5]), (6, vec![6])]
    );
    let rest = log.read(0, 7, 100).await.expect("read");
    assert_eq!(rest.iter().map(|r| r.offset).collect::<Vec<_>>(), [7, 8, 9]);
}

pub async fn read_at_the_end_is_empty_and_past_it_is_out_of_range(factory: &dyn Factory) {
    let log = factory(1);
    append(&*log, 0, b"x").await;
    assert!(log.read(0, 1, 10).await.expect("read at end").is_empty());
    let error = log.read(0, 5, 10).await.expect_err("past the end");
    assert!(
        matches!(
            error,
            LogError::OutOfRange {
                offset: 5,
                end: 1,
                ..
            }
        ),
        "{error}"
    );
}

pub async fn concurrent_appends_get_distinct_increasing_offsets(factory: &dyn Factory) {
    let log = factory(2);
    let mut tasks = Vec::new();
    for i in 0..64u32 {
        let log = Arc::clone(&log);
        tasks.push(tokio::spawn(async move {
            let partition = i % 2;
            let offset = log
                .append(partition, i.to_le_bytes().to_vec())
                .await
                .expect("append");
            (partition, offset, i)
        }));
    }
    let mut written = Vec::new();
    for task in tasks {
        written.push(task.await.expect("task"));
    }
    for partition in 0..2 {
        let mut offsets: Vec<u64> = written
            .iter()
            .filter(|(p, _, _)| *p == partition)
            .map(|(_, o, _)| *o)
            .collect();
        offsets.sort_unstable();
        assert_eq!(
            offsets,
            (0..32).collect::<Vec<u64>>(),
            "partition {partition}"
        );
        let records = log.read(partition, 0, 100).await.expect("read");
        for (p, offset, i) in written.iter().filter(|(p, _, _)| *p == partition) {
            let record = &records[usize::try_from(*offset).expect("small")];
            assert_eq!(
                record.payload,
                i.to_le_bytes(),
                "partition {p} offset {offset}"
            );
        }
    }
}

pub async fn delete_below_keeps_every_record_at_or_above_the_offset(factory: &dyn Factory) {
    let log = factory(1);
    for i in 0..100u32 {
        append(&*log, 0, &i.to_le_bytes()).await;
    }
    for below_every_record in [0, 1] {
        log.delete_below(0, below_every_record)
            .await
            .expect("delete");
        let kept = log.read(0, 1, 1000).await.expect("read");
        assert_eq!(
            kept.len(),
            99,
            "deleting below {below_every_record} keeps 1..100"
        );
    }
    log.delete_below(0, 60).await.expect("delete");
    let (start, end) = log.bounds(0).await.expect("bounds");
    assert!(
        start <= 60,
        "records at or above the offset stay: start {start}"
    );
    assert_eq!(end, 100);
    let kept = log.read(0, 60, 1000).await.expect("read");
    assert_eq!(kept.len(), 40);
    assert_eq!(append(&*log, 0, b"next").await, 100, "offsets go on");
    if start > 0 {
        let error = log.read(0, 0, 1).await.expect_err("deleted");
        assert!(matches!(error, LogError::OutOfRange { .. }), "{error}");
    }
}

pub async fn payloads_of_any_size_round_trip(factory: &dyn Factory) {
    let log = factory(1);
    let big: Vec<u8> = (0..(1u32 << 20))
        .map(|i| u8::try_from(i % 251).expect("below 256"))
        .collect();
    append(&*log, 0, b"").await;
    append(&*log, 0, &big).await;
    let records = log.read(0, 0, 10).await.expect("read");
    assert_eq!(records.len(), 2);
    assert!(records[0].payload.is_empty());
    assert_eq!(records[1].payload, big);
}

pub async fn an_unknown_partition_is_an_error(factory: &dyn Factory) {
    let log = factory(2);
    let error = log
        .append(2, b"x".to_vec())
        .await
        .expect_err("no partition 2");
    assert!(
        matches!(
            error,
            LogError::NoSuchPartition {
                partition: 2,
                partitions: 2
            }
        ),
        "{error}"
    );
}

pub async fn append_many_returns_offsets_in_order(factory: &dyn Factory) {
    let log = factory(2);
    append(&*log, 1, b"first").await;
    let offsets = log
        .append_many(vec![
            (0, b"a".to_vec()),
            (1, b"b".to_vec()),
            (0, b"c".to_vec()),
        ])
        .await
        .expect("append many");
    assert_eq!(offsets, [0, 1, 1]);
    let zero: Vec<Vec<u8>> = log
        .read(0, 0, 10)
        .await
        .expect("read")
        .into_iter()
        .map(|r| r.payload)
        .collect();
    assert_eq!(zero, [b"a".to_vec(), b"c".to_vec()]);
}

/// Checked when the log's bound is small enough to make a record past it (every log but
/// an unbounded [`MemoryLog`](super::MemoryLog)).
pub async fn a_record_past_max_record_is_refused_and_nothing_is_written(factory: &dyn Factory) {
    let log = factory(2);
    let max = log.max_record(1);
    assert!(
        max >= 1 << 20,
        "a log takes records of 1 MiB at least, not {max}"
    );
    if max > 256 << 20 {
        return;
    }
    let error = log
        .append(1, vec![0; max + 1])
        .await
        .expect_err("past the bound");
    assert!(
        matches!(error, LogError::TooLarge { size, max: m } if size == max + 1 && m == max),
        "{error}"
    );
    let error = log
        .append_many(vec![(0, b"small".to_vec()), (1, vec![0; max + 1])])
        .await
        .expect_err("one record past the bound");
    assert!(matches!(error, LogError::TooLarge { .. }), "{error}");
    for partition in 0..2 {
        assert_eq!(
            log.bounds(partition).await.expect("bounds"),
            (0, 0),
            "nothing was written to partition {partition}"
        );
    }
    assert_eq!(
        append(&*log, 1, &vec![7; max]).await,
        0,
        "at the bound is within"
    );
}
