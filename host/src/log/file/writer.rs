//! Group commit: one thread writes every append, and makes each batch durable with as few
//! syncs as it can: the one partition it wrote to, or the commit journal when it wrote to
//! several (`journal.rs`), or, for a batch too large to write twice, each partition it wrote
//! to. An append is answered only after its bytes are synced.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::mpsc;
use std::thread::JoinHandle;

use tokio::sync::oneshot;

use super::Shared;
use super::entry;
use super::journal::{self, Journal};
use crate::log::{LogError, Offset};

/// Appends taken into one batch at most.
const MAX_BATCH: usize = 4096;

/// A batch over several partitions with more payload than this syncs each of them rather
/// than writing every record a second time to the journal.
const JOURNAL_BATCH_BYTES: usize = 1 << 20;

struct Append {
    partition: u32,
    payload: Vec<u8>,
    reply: oneshot::Sender<Result<Offset, LogError>>,
}

/// The handle on the writer thread; dropping it lets the thread finish what it has and stop.
#[derive(Debug)]
pub(super) struct Writer {
    sender: Option<mpsc::Sender<Append>>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Append {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Append")
            .field("partition", &self.partition)
            .field("bytes", &self.payload.len())
            .finish()
    }
}

impl Writer {
    pub fn start(shared: Arc<Shared>, journal: Journal) -> Result<Self, LogError> {
        let (sender, receiver) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("rewind-log-writer".to_owned())
            .spawn(move || run(&shared, journal, &receiver))
            .map_err(|source| LogError::Io {
                context: "starting the log writer thread".to_owned(),
                source,
            })?;
        Ok(Self {
            sender: Some(sender),
            thread: Some(thread),
        })
    }

    pub async fn append(&self, partition: u32, payload: Vec<u8>) -> Result<Offset, LogError> {
        let (reply, answer) = oneshot::channel();
        self.sender
            .as_ref()
            .ok_or(LogError::Closed)?
            .send(Append {
                partition,
                payload,
                reply,
            })
            .map_err(|_| LogError::Closed)?;
        answer.await.map_err(|_| LogError::Closed)?
    }
}

impl Writer {
    /// Queues every record before waiting for any, so that they share syncs.
    pub async fn append_many(&self, records: Vec<(u32, Vec<u8>)>) -> Result<Vec<Offset>, LogError> {
        let sender = self.sender.as_ref().ok_or(LogError::Closed)?;
        let mut answers = Vec::with_capacity(records.len());
        for (partition, payload) in records {
            let (reply, answer) = oneshot::channel();
            sender
                .send(Append {
                    partition,
                    payload,
                    reply,
                })
                .map_err(|_| LogError::Closed)?;
            answers.push(answer);
        }
        let mut offsets = Vec::with_capacity(answers.len());
        for answer in answers {
            offsets.push(answer.await.map_err(|_| LogError::Closed)??);
        }
        Ok(offsets)
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        self.sender = None;
        if let Some(thread) = self.thread.take() {
            // The thread ends when the channel is empty and closed; a panic there has
            // already failed the appends it held.
            let _ = thread.join();
        }
    }
}

/// The writer thread's own state.
struct Committer<'a> {
    shared: &'a Shared,
    journal: Journal,
    /// Partitions with records that only the journal holds durably.
    journaled: BTreeSet<u32>,
}

fn run(shared: &Shared, journal: Journal, receiver: &mpsc::Receiver<Append>) {
    let mut committer = Committer {
        shared,
        journal,
        journaled: BTreeSet::new(),
    };
    while let Ok(first) = receiver.recv() {
        let mut batch = vec![first];
        while batch.len() < MAX_BATCH {
            match receiver.try_recv() {
                Ok(next) => batch.push(next),
                Err(_) => break,
            }
        }
        committer.commit(batch);
        if committer.journal.size() >= shared.options.journal_bytes {
            committer.empty_journal();
        }
    }
    // Closed: leave nothing for the next open to replay.
    if committer.journal.size() > 0 {
        committer.empty_journal();
    }
}

impl Committer<'_> {
    /// Writes every append of the batch, makes them durable, then answers.
    fn commit(&mut self, batch: Vec<Append>) {
        let shared = self.shared;
        let segment_bytes = shared.options.segment_bytes;
        let partitions: BTreeSet<u32> = batch.iter().map(|a| a.partition).collect();
        let bytes: usize = batch.iter().map(|a| a.payload.len()).sum();
        let journal = partitions.len() > 1 && bytes <= JOURNAL_BATCH_BYTES && !self.journal.broken;
        let mut frames = Vec::new();
        let mut written = Vec::with_capacity(batch.len());
        let mut synced: BTreeMap<u32, Result<(), String>> = BTreeMap::new();
        for append in batch {
            let frame = entry::encode(&append.payload);
            let result = shared
                .partition(append.partition)
                .and_then(|mut p| p.write(&frame, segment_bytes));
            if let Ok(offset) = result {
                synced.insert(append.partition, Ok(()));
                if journal {
                    journal::frame_into(&mut frames, append.partition, offset, &append.payload);
                }
            }
            written.push((append, result));
        }
        if journal {
            self.commit_journal(&frames, &mut synced);
        } else {
            sync(shared, &mut synced);
        }
        for (append, result) in written {
            let result = match (result, synced.get(&append.partition)) {
                (Ok(_), Some(Err(why))) => Err(LogError::Io {
                    context: format!("partition {}", append.partition),
                    source: std::io::Error::other(why.clone()),
                }),
                (result, _) => result,
            };
            // The caller may have stopped waiting; the record is in the log all the same.
            let _ = append.reply.send(result);
        }
    }

    /// Syncs the journal holding the batch's records; the partitions count them durable.
    fn commit_journal(&mut self, frames: &[u8], synced: &mut BTreeMap<u32, Result<(), String>>) {
        match self.journal.commit(frames) {
            Ok(()) => {
                for &partition in synced.keys() {
                    if let Ok(mut p) = self.shared.partition(partition) {
                        p.journaled();
                    }
                    self.journaled.insert(partition);
                }
            }
            Err(e) => {
                // The batch's records sit unsynced in their segments; as after a failed
                // fsync there, nothing in those partitions is trusted until reopened.
                for (&partition, outcome) in synced.iter_mut() {
                    if let Ok(mut p) = self.shared.partition(partition) {
                        p.broken = Some(format!("the commit journal failed: {e}"));
                    }
                    *outcome = Err(e.to_string());
                }
            }
        }
    }

    /// Syncs every partition the journal covers, then empties it. On failure the journal
    /// is kept (it still holds what the partitions may lack).
    fn empty_journal(&mut self) {
        let mut synced: BTreeMap<u32, Result<(), String>> =
            self.journaled.iter().map(|&p| (p, Ok(()))).collect();
        sync(self.shared, &mut synced);
        if let Some((partition, Err(e))) = synced.iter().find(|(_, outcome)| outcome.is_err()) {
            tracing::error!(
                partition,
                "the commit journal is kept: syncing a partition failed: {e}"
            );
            return;
        }
        match self.journal.reset() {
            Ok(()) => self.journaled.clear(),
            Err(e) => tracing::error!("the commit journal could not be emptied: {e}"),
        }
    }
}

/// One fdatasync per partition written to. Several partitions are different files, synced
/// at once on threads of their own; a single one is synced here.
fn sync(shared: &Shared, synced: &mut BTreeMap<u32, Result<(), String>>) {
    let sync_one = |partition: u32, outcome: &mut Result<(), String>| {
        if let Err(e) = shared.partition(partition).and_then(|mut p| p.sync()) {
            *outcome = Err(e.to_string());
        }
    };
    if synced.len() <= 1 {
        for (&partition, outcome) in synced.iter_mut() {
            sync_one(partition, outcome);
        }
        return;
    }
    std::thread::scope(|scope| {
        let threads: Vec<_> = synced
            .iter_mut()
            .map(|(&partition, outcome)| scope.spawn(move || sync_one(partition, outcome)))
            .collect();
        for thread in threads {
            if thread.join().is_err() {
                tracing::error!("a log sync thread panicked");
            }
        }
    });
}
