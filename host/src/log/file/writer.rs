//! Group commit: one thread writes every append, and syncs each partition it wrote to once
//! per batch; an append is answered only after its bytes are synced.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::mpsc;
use std::thread::JoinHandle;

use tokio::sync::oneshot;

use super::Shared;
use super::entry;
use crate::log::{LogError, Offset};

/// Appends taken into one batch at most.
const MAX_BATCH: usize = 4096;

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
    pub fn start(shared: Arc<Shared>) -> Result<Self, LogError> {
        let (sender, receiver) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("rewind-log-writer".to_owned())
            .spawn(move || run(&shared, &receiver))
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

fn run(shared: &Shared, receiver: &mpsc::Receiver<Append>) {
    while let Ok(first) = receiver.recv() {
        let mut batch = vec![first];
        while batch.len() < MAX_BATCH {
            match receiver.try_recv() {
                Ok(next) => batch.push(next),
                Err(_) => break,
            }
        }
        commit(shared, batch);
    }
}

/// Writes every append of the batch, syncs each partition written to once, then answers.
fn commit(shared: &Shared, batch: Vec<Append>) {
    let segment_bytes = shared.options.segment_bytes;
    let mut written = Vec::with_capacity(batch.len());
    let mut synced: BTreeMap<u32, Result<(), String>> = BTreeMap::new();
    for append in batch {
        let frame = entry::encode(&append.payload);
        let result = shared
            .partition(append.partition)
            .and_then(|mut p| p.write(&frame, segment_bytes));
        if result.is_ok() {
            synced.insert(append.partition, Ok(()));
        }
        written.push((append, result));
    }
    sync(shared, &mut synced);
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
