//! The JSONL output sink: one line per output, replayed duplicates dropped by id.

use std::collections::HashSet;
use std::io::Write;

use serde::Serialize;

use crate::event::{Output, OutputId};

#[derive(Serialize)]
struct Line<'a> {
    id: String,
    tenant: &'a str,
    agent: &'a str,
    key: &'a str,
    sequence: u64,
    index: u32,
    payload: &'a serde_json::value::RawValue,
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
    /// Writes `output` unless an output with its id was written before; returns whether
    /// it wrote. An output it wrote is durable once [`sync`](Self::sync) returns.
    async fn write(&mut self, output: &Output) -> std::io::Result<bool>;

    /// Makes every output written so far durable: a checkpoint that counts their inputs
    /// as complete is saved only after this.
    async fn sync(&mut self) -> std::io::Result<()>;

    /// Where the outputs stand now, for a checkpoint: `None` for a sink without positions.
    async fn position(&mut self) -> std::io::Result<Option<u64>> {
        Ok(None)
    }
}

#[async_trait::async_trait]
impl<W: OutputWriter + Send> OutputSink for JsonlSink<W> {
    async fn write(&mut self, output: &Output) -> std::io::Result<bool> {
        JsonlSink::write(self, output)
    }

    async fn sync(&mut self) -> std::io::Result<()> {
        JsonlSink::sync(self)
    }
}

/// Writes outputs as JSON Lines; an output whose id it has written before is dropped.
#[derive(Debug)]
pub struct JsonlSink<W: Write> {
    writer: W,
    seen: HashSet<OutputId>,
}

impl JsonlSink<std::io::BufWriter<std::fs::File>> {
    /// Appends to the JSONL file at `path`, first reading the ids it already holds so that
    /// replayed outputs are dropped. A last line cut short (the process died writing it) is
    /// removed.
    pub fn resume(path: &std::path::Path) -> std::io::Result<Self> {
        let mut seen = HashSet::new();
        if let Ok(text) = std::fs::read(path) {
            let whole = text.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
            if whole < text.len() {
                std::fs::File::options()
                    .write(true)
                    .open(path)?
                    .set_len(whole as u64)?;
            }
            for line in text[..whole].split(|&b| b == b'\n') {
                #[derive(serde::Deserialize)]
                struct Ids {
                    tenant: String,
                    agent: String,
                    key: String,
                    sequence: u64,
                    index: u32,
                }
                if let Ok(ids) = serde_json::from_slice::<Ids>(line) {
                    seen.insert(OutputId {
                        tenant: ids.tenant,
                        agent: ids.agent,
                        key: ids.key,
                        sequence: ids.sequence,
                        index: ids.index,
                    });
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
            seen: HashSet::new(),
        }
    }

    /// Writes `output` unless its id was written before; returns whether it wrote.
    pub fn write(&mut self, output: &Output) -> std::io::Result<bool> {
        if !self.seen.insert(output.id.clone()) {
            return Ok(false);
        }
        let null = serde_json::value::RawValue::NULL;
        let payload: Box<serde_json::value::RawValue>;
        let payload_ref =
            match serde_json::from_str::<Box<serde_json::value::RawValue>>(&output.payload) {
                Ok(raw) => {
                    payload = raw;
                    &*payload
                }
                Err(_) => null,
            };
        let line = Line {
            id: output.id.to_string(),
            tenant: &output.id.tenant,
            agent: &output.id.agent,
            key: &output.id.key,
            sequence: output.id.sequence,
            index: output.id.index,
            payload: payload_ref,
        };
        serde_json::to_writer(&mut self.writer, &line)?;
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
}
