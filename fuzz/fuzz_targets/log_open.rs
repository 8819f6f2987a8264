//! The embedded log's record decoder, through the path a crash takes: arbitrary bytes as
//! the last segment of a partition (and, split at the first byte's position, as the commit
//! journal), opened with both recovery modes. Opening never panics; what opens reads back
//! whole records up to the end it reports.
#![no_main]

use libfuzzer_sys::fuzz_target;
use rewind_host::log::{FileLog, FileLogOptions, Log, Recovery};

fuzz_target!(|bytes: &[u8]| {
    let split = bytes.first().map_or(0, |&b| usize::from(b)).min(bytes.len());
    let (journal, segment) = bytes.split_at(split);
    let dir = tempfile::tempdir().expect("tempdir");
    // A log with one partition, then its files replaced by the input.
    drop(FileLog::open(dir.path(), FileLogOptions { partitions: 1, ..FileLogOptions::default() }));
    std::fs::write(dir.path().join("p0000/00000000000000000000.seg"), segment).expect("segment");
    std::fs::write(dir.path().join("journal.wal"), journal).expect("journal");
    let runtime = tokio::runtime::Builder::new_current_thread().build().expect("runtime");
    for recovery in [Recovery::Strict, Recovery::TruncateTornTail] {
        let options = FileLogOptions { partitions: 1, recovery, ..FileLogOptions::default() };
        let Ok((log, _)) = FileLog::open(dir.path(), options) else { continue };
        runtime.block_on(async {
            let (start, end) = log.bounds(0).await.expect("bounds");
            let records = log.read(0, start, usize::MAX).await.expect("whole records read back");
            assert_eq!(records.len() as u64, end - start);
        });
    }
});
