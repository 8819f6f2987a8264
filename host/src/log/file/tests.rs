use std::sync::Arc;

use super::{Contents, FileLog, FileLogOptions, Recovery};
use crate::log::{Guarded, Log, LogError, Offset};

/// Small segments, so that the suite crosses segment boundaries and retention deletes
/// files, and a small journal, so that it is emptied often.
fn options(partitions: u32) -> FileLogOptions {
    FileLogOptions {
        partitions,
        segment_bytes: 256,
        journal_bytes: 1024,
        recovery: Recovery::TruncateTornTail,
        contents: None,
    }
}

fn temp_log(partitions: u32) -> Arc<dyn Log> {
    let dir = tempfile::tempdir().expect("tempdir");
    let (log, report) = FileLog::open(dir.path(), options(partitions)).expect("open");
    assert!(report.truncated.is_empty());
    Arc::new(Guarded::new(log, dir))
}

crate::log_conformance_tests!(temp_log);

async fn fill(dir: &std::path::Path, records: &[&[u8]]) {
    let (log, _) = FileLog::open(dir, options(1)).expect("open");
    for record in records {
        log.append(0, record.to_vec()).await.expect("append");
    }
}

fn segments(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut files: Vec<_> = std::fs::read_dir(dir.join("p0000"))
        .expect("partition dir")
        .map(|e| e.expect("entry").path())
        .collect();
    files.sort();
    files
}

#[tokio::test]
async fn appended_records_survive_reopening() {
    let dir = tempfile::tempdir().expect("tempdir");
    fill(dir.path(), &[b"one", b"two", b"three"]).await;
    let (log, report) = FileLog::open(dir.path(), options(1)).expect("reopen");
    assert!(report.truncated.is_empty());
    let records = log.read(0, 0, 10).await.expect("read");
    let payloads: Vec<&[u8]> = records.iter().map(|r| r.payload.as_slice()).collect();
    assert_eq!(payloads, [&b"one"[..], b"two", b"three"]);
    assert_eq!(log.append(0, b"four".to_vec()).await.expect("append"), 3);
}

#[tokio::test]
async fn torn_tail_is_truncated_on_open() {
    let dir = tempfile::tempdir().expect("tempdir");
    fill(dir.path(), &[b"kept", b"the last record"]).await;
    let active = segments(dir.path()).pop().expect("a segment");
    let whole = std::fs::read(&active).expect("read");
    let last_record = super::entry::encode(b"the last record").len();
    let boundary = whole.len() - last_record;
    // Every point at which the process could have died while appending the last record.
    for cut in boundary + 1..whole.len() {
        std::fs::write(&active, &whole[..cut]).expect("cut");
        let (log, report) = FileLog::open(dir.path(), options(1)).expect("open");
        assert_eq!(report.truncated.len(), 1, "cut at {cut}");
        assert_eq!(
            report.dropped_bytes(),
            (cut - boundary) as u64,
            "cut at {cut}"
        );
        assert_eq!(log.bounds(0).await.expect("bounds"), (0, 1), "cut at {cut}");
        let records = log.read(0, 0, 10).await.expect("read");
        assert_eq!(records.len(), 1);
        assert_eq!(records[0].payload, b"kept");
        assert_eq!(log.append(0, b"again".to_vec()).await.expect("append"), 1);
        drop(log);
        std::fs::write(&active, &whole).expect("restore");
    }
}

#[tokio::test]
async fn strict_recovery_refuses_a_torn_tail_and_names_the_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    fill(dir.path(), &[b"kept", b"torn"]).await;
    let active = segments(dir.path()).pop().expect("a segment");
    let whole = std::fs::read(&active).expect("read");
    std::fs::write(&active, &whole[..whole.len() - 2]).expect("cut");
    let strict = FileLogOptions {
        recovery: Recovery::Strict,
        ..options(1)
    };
    let error = FileLog::open(dir.path(), strict).expect_err("refused");
    let message = error.to_string();
    assert!(message.contains(&active.display().to_string()), "{message}");
    assert!(message.contains("cut short"), "{message}");
    assert_eq!(
        std::fs::read(&active).expect("read").len(),
        whole.len() - 2,
        "nothing cut"
    );
}

#[tokio::test]
async fn corruption_before_the_last_segment_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let big = [7u8; 200];
    fill(dir.path(), &[&big, &big, &big]).await;
    let files = segments(dir.path());
    assert!(files.len() >= 2, "{files:?}");
    let mut first = std::fs::read(&files[0]).expect("read");
    first[20] ^= 0xff;
    std::fs::write(&files[0], &first).expect("corrupt");
    let error = FileLog::open(dir.path(), options(1)).expect_err("refused");
    assert!(error.to_string().contains("checksum"), "{error}");
}

#[tokio::test]
async fn reopening_with_another_partition_count_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    drop(FileLog::open(dir.path(), options(4)).expect("open"));
    let error = FileLog::open(dir.path(), options(2)).expect_err("refused");
    assert!(
        matches!(
            error,
            LogError::PartitionCount {
                on_disk: 4,
                asked: 2,
                ..
            }
        ),
        "{error}"
    );
    assert!(
        error
            .to_string()
            .contains("created with 4 partitions, not 2"),
        "{error}"
    );
}

#[tokio::test]
async fn retention_deletes_whole_segments_only() {
    let dir = tempfile::tempdir().expect("tempdir");
    let record = [1u8; 100];
    fill(dir.path(), &[&record[..]; 10]).await;
    let before = segments(dir.path()).len();
    assert!(before >= 4, "{before} segments");
    let (log, _) = FileLog::open(dir.path(), options(1)).expect("open");
    log.delete_below(0, 5).await.expect("delete");
    let (start, end) = log.bounds(0).await.expect("bounds");
    assert!(start <= 5 && start > 0, "start {start}");
    assert_eq!(end, 10);
    assert!(segments(dir.path()).len() < before);
    drop(log);
    let (log, _) = FileLog::open(dir.path(), options(1)).expect("reopen");
    assert_eq!(
        log.bounds(0).await.expect("bounds"),
        (start, 10),
        "retention survives reopening"
    );
}

/// Writes a journal by hand: `(partition, offset, payload)` entries, then `tail` bytes.
fn write_journal(dir: &std::path::Path, entries: &[(u32, Offset, &[u8])], tail: &[u8]) {
    let mut bytes = Vec::new();
    for &(partition, offset, payload) in entries {
        super::journal::frame_into(&mut bytes, partition, offset, payload);
    }
    bytes.extend_from_slice(tail);
    std::fs::write(dir.join(super::journal::FILE), bytes).expect("write journal");
}

async fn payloads(log: &FileLog, partition: u32) -> Vec<Vec<u8>> {
    let records = log.read(partition, 0, 100).await.expect("read");
    records.into_iter().map(|r| r.payload).collect()
}

/// What a power loss leaves after a batch over several partitions was acknowledged: the
/// journal synced, the segments not.
#[tokio::test]
async fn records_only_the_journal_holds_are_restored_on_open() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (log, _) = FileLog::open(dir.path(), options(2)).expect("open");
    log.append(0, b"a0".to_vec()).await.expect("append");
    log.append(1, b"b0".to_vec()).await.expect("append");
    drop(log);
    let entries: [(u32, Offset, &[u8]); 4] =
        [(0, 0, b"a0"), (0, 1, b"a1"), (1, 1, b"b1"), (0, 2, b"a2")];
    // The last entry's sync did not finish: half of it reached the file.
    let mut unfinished = Vec::new();
    super::journal::frame_into(&mut unfinished, 1, 2, b"b2");
    write_journal(dir.path(), &entries, &unfinished[..unfinished.len() / 2]);

    let (log, report) = FileLog::open(dir.path(), options(2)).expect("reopen");
    assert_eq!(
        report.journal.restored.into_iter().collect::<Vec<_>>(),
        [(0, 2), (1, 1)],
        "a0 was in its segment already"
    );
    assert_eq!(report.journal.dropped_bytes, (unfinished.len() / 2) as u64);
    assert_eq!(payloads(&log, 0).await, [b"a0", b"a1", b"a2"]);
    assert_eq!(payloads(&log, 1).await, [b"b0", b"b1"]);
    assert_eq!(log.append(1, b"b2".to_vec()).await.expect("append"), 2);
    let journal = std::fs::metadata(dir.path().join(super::journal::FILE)).expect("journal");
    assert_eq!(journal.len(), 0, "emptied once the partitions are synced");

    drop(log);
    let (log, report) = FileLog::open(dir.path(), options(2)).expect("reopen again");
    assert!(report.journal.restored.is_empty());
    assert_eq!(payloads(&log, 1).await, [b"b0", b"b1", b"b2"]);
}

#[tokio::test]
async fn a_journal_entry_past_its_partitions_end_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    drop(FileLog::open(dir.path(), options(2)).expect("open"));
    write_journal(dir.path(), &[(1, 3, b"b3")], b"");
    let error = FileLog::open(dir.path(), options(2)).expect_err("refused");
    let message = error.to_string();
    assert!(message.contains("journal.wal"), "{message}");
    assert!(
        message.contains("offset 3 of partition 1, but the partition ends at 0"),
        "{message}"
    );
}

#[tokio::test]
async fn batches_over_several_partitions_survive_reopening_and_the_journal_stays_small() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (log, _) = FileLog::open(dir.path(), options(4)).expect("open");
    for round in 0..20u8 {
        let batch = (0..16u8)
            .map(|i| (u32::from(i % 4), vec![round, i]))
            .collect();
        log.append_many(batch).await.expect("append");
        let journal = std::fs::metadata(dir.path().join(super::journal::FILE)).expect("journal");
        assert!(journal.len() < 1024 + 16 * 64, "{} bytes", journal.len());
    }
    drop(log);
    let (log, report) = FileLog::open(dir.path(), options(4)).expect("reopen");
    assert!(report.truncated.is_empty() && report.journal.restored.is_empty());
    for partition in 0..4u8 {
        let expected: Vec<Vec<u8>> = (0..20u8)
            .flat_map(|round| {
                (0..16u8)
                    .filter(move |i| i % 4 == partition)
                    .map(move |i| vec![round, i])
            })
            .collect();
        assert_eq!(payloads(&log, u32::from(partition)).await, expected);
    }
}

#[test]
fn a_log_of_newer_records_or_of_another_kind_is_refused_and_one_without_contents_opens() {
    let dir = tempfile::tempdir().expect("tempdir");
    let with = |kind, format| FileLogOptions {
        contents: Some(Contents { kind, format }),
        ..options(1)
    };
    // Written before contents were named: its records are format 1, of any kind.
    drop(FileLog::open(dir.path(), options(1)).expect("open"));
    drop(FileLog::open(dir.path(), with("journal", 1)).expect("opens as format 1"));

    let newer = tempfile::tempdir().expect("tempdir");
    drop(FileLog::open(newer.path(), with("journal", 2)).expect("open"));
    let error = FileLog::open(newer.path(), with("journal", 1)).expect_err("too new");
    let message = error.to_string();
    assert!(
        message.contains("this journal log is format 2, and this build reads format 1 and older"),
        "{message}"
    );
    let error = FileLog::open(newer.path(), with("states", 2)).expect_err("another kind");
    assert!(
        error
            .to_string()
            .contains("a log of journal, not of states"),
        "{error}"
    );
}
