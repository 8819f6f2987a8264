//! The JSONL output sink: one line per output, replayed duplicates dropped by id (until a
//! checkpoint counts their input complete: then it cannot run again).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io::Write;

use crate::checkpoint::KeyProgress;
use crate::event::{Output, OutputId, OutputRecord};

/// The ids of the outputs a sink has written, by tenant, agent and key: what it drops a
/// repeat of. A sink serves one agent's run, and forgets the ids of inputs a saved
/// checkpoint counts complete, so that they do not pile up for as long as the run lasts.
#[derive(Debug, Default)]
pub struct WrittenIds(HashMap<String, HashMap<String, ByKey>>);

/// An agent's written outputs: per key, (sequence, index) of each.
type ByKey = HashMap<String, BTreeSet<(u64, u32)>>;

impl WrittenIds {
    pub fn contains(&self, id: &OutputId) -> bool {
        self.0
            .get(&id.tenant)
            .and_then(|agents| agents.get(&id.agent))
            .and_then(|keys| keys.get(&id.key))
            .is_some_and(|written| written.contains(&(id.sequence, id.index)))
    }

    /// Adds `id`; returns whether it was not there.
    pub fn insert(&mut self, id: &OutputId) -> bool {
        self.0
            .entry(id.tenant.clone())
            .or_default()
            .entry(id.agent.clone())
            .or_default()
            .entry(id.key.clone())
            .or_default()
            .insert((id.sequence, id.index))
    }

    /// Forgets the outputs of every input of `keys` (the keys of the one agent whose run
    /// the sink serves) up to its last completed one. Those inputs do not run again: not in
    /// this run, and not after a recovery from this checkpoint or a later one (which opens
    /// a new sink, reading the ids it needs). Ids of other agents, read from a file the
    /// sink resumed, are matched by key too: harmless, as this run writes none of them.
    pub fn forget_completed(&mut self, keys: &BTreeMap<String, KeyProgress>) {
        for agents in self.0.values_mut() {
            for written in agents.values_mut() {
                for (key, progress) in keys {
                    let Some(outputs) = written.get_mut(key) else {
                        continue;
                    };
                    *outputs = outputs.split_off(&(progress.last_completed.saturating_add(1), 0));
                    if outputs.is_empty() {
                        written.remove(key);
                    }
                }
            }
        }
    }

    /// Forgets the outputs of input `sequence` of `tenant`'s `agent` under `key` (it
    /// finished: it does not run again).
    pub fn forget_input(&mut self, tenant: &str, agent: &str, key: &str, sequence: u64) {
        let Some(keys) = self
            .0
            .get_mut(tenant)
            .and_then(|agents| agents.get_mut(agent))
        else {
            return;
        };
        if let Some(outputs) = keys.get_mut(key) {
            outputs.retain(|&(s, _)| s != sequence);
            if outputs.is_empty() {
                keys.remove(key);
            }
        }
    }

    /// How many ids are kept.
    pub fn len(&self) -> usize {
        self.0
            .values()
            .flat_map(HashMap::values)
            .flat_map(HashMap::values)
            .map(BTreeSet::len)
            .sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Where outputs go: a writer that can also make what was written durable.
pub trait OutputWriter: Write {
    /// Makes everything written so far durable (for a file: flushed and synced).
    fn sync(&mut self) -> std::io::Result<()> {
        self.flush()
    }
}

impl OutputWriter for std::io::BufWriter<std::fs::File> {
    fn sync(&mut self) -> std::io::Result<()> {
        self.flush()?;
        self.get_ref().sync_data()
    }
}

impl OutputWriter for Vec<u8> {}
impl OutputWriter for std::io::Stdout {}

/// Where a run's outputs go: each output once, by id, however often its input runs.
#[async_trait::async_trait]
pub trait OutputSink: Send {
    /// Writes `output` unless an output with its id was written before (and not let go by
    /// [`checkpointed`](Self::checkpointed)); returns whether it wrote. An output it wrote
    /// is durable once [`sync`](Self::sync) returns.
    async fn write(&mut self, output: &Output) -> std::io::Result<bool>;

    /// Makes every output written so far durable: a checkpoint that counts their inputs
    /// as complete is saved only after this.
    async fn sync(&mut self) -> std::io::Result<()>;

    /// Where the outputs stand now, for a checkpoint: `None` for a sink without positions.
    async fn position(&mut self) -> std::io::Result<Option<u64>> {
        Ok(None)
    }

    /// A checkpoint with these keys' progress was saved: the ids of outputs of inputs it
    /// counts complete need not be kept ([`WrittenIds::forget_completed`]).
    fn checkpointed(&mut self, _keys: &BTreeMap<String, KeyProgress>) {}
}

#[async_trait::async_trait]
impl<W: OutputWriter + Send> OutputSink for JsonlSink<W> {
    async fn write(&mut self, output: &Output) -> std::io::Result<bool> {
        JsonlSink::write(self, output)
    }

    async fn sync(&mut self) -> std::io::Result<()> {
        JsonlSink::sync(self)
    }

    fn checkpointed(&mut self, keys: &BTreeMap<String, KeyProgress>) {
        self.seen.forget_completed(keys);
    }
}

/// Writes outputs as JSON Lines; an output whose id it has written before is dropped, until
/// a checkpoint counts its input complete.
#[derive(Debug)]
pub struct JsonlSink<W: Write> {
    writer: W,
    seen: WrittenIds,
}

impl JsonlSink<std::io::BufWriter<std::fs::File>> {
    /// Appends to the JSONL file at `path`, first reading the ids it already holds so that
    /// replayed outputs are dropped. A last line cut short (the process died writing it) is
    /// removed.
    pub fn resume(path: &std::path::Path) -> std::io::Result<Self> {
        let mut seen = WrittenIds::default();
        if let Ok(text) = std::fs::read(path) {
            let whole = text.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
            if whole < text.len() {
                std::fs::File::options()
                    .write(true)
                    .open(path)?
                    .set_len(whole as u64)?;
            }
            for line in text[..whole].split(|&b| b == b'\n') {
                if let Ok(record) = serde_json::from_slice::<OutputRecord>(line) {
                    seen.insert(&record.output_id());
                }
            }
        }
        let file = std::fs::File::options()
            .create(true)
            .append(true)
            .open(path)?;
        Ok(Self {
            writer: std::io::BufWriter::new(file),
            seen,
        })
    }
}

impl<W: Write> JsonlSink<W> {
    pub fn new(writer: W) -> Self {
        Self {
            writer,
            seen: WrittenIds::default(),
        }
    }

    /// Writes `output` unless its id was written before; returns whether it wrote.
    pub fn write(&mut self, output: &Output) -> std::io::Result<bool> {
        if !self.seen.insert(&output.id) {
            return Ok(false);
        }
        self.writer
            .write_all(&OutputRecord::new(output, None).encode())?;
        self.writer.write_all(b"\n")?;
        Ok(true)
    }

    pub fn flush(&mut self) -> std::io::Result<()> {
        self.writer.flush()
    }

    /// Makes every output written so far durable: a checkpoint that counts their inputs as
    /// complete must not be saved before.
    pub fn sync(&mut self) -> std::io::Result<()>
    where
        W: OutputWriter,
    {
        self.writer.sync()
    }

    pub fn into_inner(self) -> W {
        self.writer
    }

    /// How many output ids the sink keeps, to drop repeats.
    pub fn remembered(&self) -> usize {
        self.seen.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(key: &str, sequence: u64, index: u32) -> OutputId {
        OutputId {
            tenant: "t".to_owned(),
            agent: "a".to_owned(),
            key: key.to_owned(),
            sequence,
            index,
        }
    }

    #[test]
    fn written_ids_forget_only_the_outputs_of_completed_inputs() {
        let mut written = WrittenIds::default();
        for sequence in 1..=6 {
            assert!(written.insert(&id("k", sequence, 0)));
            assert!(written.insert(&id("k", sequence, 1)));
        }
        assert!(written.insert(&id("other", 1, 0)));
        assert!(!written.insert(&id("k", 3, 1)), "a repeat is known");
        let progress = |last_completed| KeyProgress {
            last_completed,
            ..KeyProgress::default()
        };
        let keys = BTreeMap::from([
            ("k".to_owned(), progress(4)),
            ("absent".to_owned(), progress(9)),
        ]);
        written.forget_completed(&keys);
        assert_eq!(written.len(), 5, "k's inputs 5 and 6, and the other key's");
        assert!(!written.contains(&id("k", 4, 1)));
        assert!(written.contains(&id("k", 5, 0)) && written.contains(&id("k", 6, 1)));
        assert!(
            written.contains(&id("other", 1, 0)),
            "keys the checkpoint does not name stay"
        );
        written.forget_completed(&BTreeMap::from([("k".to_owned(), progress(6))]));
        assert_eq!(written.len(), 1);
    }

    #[test]
    fn written_ids_forget_one_finished_input() {
        let mut written = WrittenIds::default();
        for sequence in 1..=3 {
            assert!(written.insert(&id("k", sequence, 0)));
            assert!(written.insert(&id("k", sequence, 1)));
        }
        written.forget_input("t", "a", "k", 2);
        assert_eq!(written.len(), 4);
        assert!(!written.contains(&id("k", 2, 0)) && !written.contains(&id("k", 2, 1)));
        assert!(written.contains(&id("k", 1, 1)) && written.contains(&id("k", 3, 0)));
        written.forget_input("t", "a", "absent", 1);
        written.forget_input("other", "a", "k", 1);
        assert_eq!(written.len(), 4, "another key or tenant keeps its own");
    }
}
