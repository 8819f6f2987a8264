//! A tenant's journal, on its own embedded log: the events it accepted, the inputs that
//! finished, and the outputs they produced.
//!
//! Partition [`INPUTS`] holds [`InputRecord`]s in the order they were written: an event is
//! accepted once its `accepted` record is durable; an input is finished (done, or skipped
//! or cancelled by an operator) once its `finished` record is. An input parked after its
//! last attempt has a `parked` record, and an operator's retry of it a `retried` one: a
//! restart keeps it parked, or runs it. An operator's answer for a call of it in doubt has
//! a `resolved` record, before the `retried` one that follows it. An input that stops at a
//! durable wait has a `waiting` record with its wait, and one without when it runs again
//! past it: a restart arms the wait rather than running the input. Partition [`OUTPUTS`] holds [`OutputRecord`]s; an output's position is its
//! offset + 1, so reading "after position 0" reads them all. An input's outputs are written
//! with (and before) its `finished` record; a crash between the two leaves outputs of an
//! unfinished input, which recovery finds so that the rerun does not write them twice.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

use crate::event::{OutputId, OutputRecord};
use crate::log::{Contents, Log, LogError, Offset, Record};
use crate::store::Waiting;

/// What a journal's `log.json` says its records are: their format is the one this build
/// writes, and the newest it reads (journals written before it was named are format 1).
pub const CONTENTS: Contents = Contents {
    kind: "journal",
    format: 1,
};

pub const INPUTS: u32 = 0;
pub const OUTPUTS: u32 = 1;
pub const PARTITIONS: u32 = 2;

/// Records read at a time when scanning.
const SCAN_BATCH: usize = 1024;

/// A record of the inputs partition. Externally tagged (`{"accepted": {..}}`): an
/// internally tagged enum cannot hold the raw JSON of a payload.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum InputRecord {
    Accepted(Accepted),
    Finished(Finished),
    Parked(Parked),
    Retried(Retried),
    Resolved(Resolved),
    Waiting(WaitRecord),
}

/// An input stopped at a durable wait (`wait`), or ran again past one (`wait` absent).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct WaitRecord {
    pub agent: String,
    pub key: String,
    pub sequence: u64,
    pub event_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wait: Option<Waiting>,
    pub at: u64,
}

/// An event accepted for a key: it becomes that key's `sequence`-th input.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Accepted {
    pub agent: String,
    /// The client's event id: a retried submission with the same id is not accepted twice.
    pub event_id: String,
    pub key: String,
    pub sequence: u64,
    /// The agent version the input runs on, whatever versions are defined after.
    pub version: u32,
    pub payload: Box<RawValue>,
    /// Milliseconds since the Unix epoch.
    pub accepted_at: u64,
}

/// An input that finished: done, or skipped or cancelled by an operator (or, written by
/// builds before retries, failed).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Finished {
    pub agent: String,
    pub key: String,
    pub sequence: u64,
    /// The event id of the input it finished: which of two inputs accepted under one
    /// sequence (two processes writing one journal) it is for. Builds before issue #21's
    /// did not write it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub event_id: Option<String>,
    pub status: FinishedStatus,
    /// The agent version it ran on, when an operator's retry moved it off the one it was
    /// accepted for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Who skipped or cancelled it, and why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub by: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    pub outputs: u32,
    /// What its actions did, for the key's history.
    pub actions: Vec<ActionSummary>,
    /// The key's short-term memory after it.
    pub memory: BTreeMap<String, String>,
    pub finished_at: u64,
}

/// An input parked after its last attempt failed: its key's later inputs wait until an
/// operator retries or skips it.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Parked {
    pub agent: String,
    pub key: String,
    pub sequence: u64,
    pub event_id: String,
    pub attempts: u32,
    pub error: String,
    pub parked_at: u64,
}

/// An operator's retry of a parked input, on `version`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Retried {
    pub agent: String,
    pub key: String,
    pub sequence: u64,
    pub event_id: String,
    pub version: u32,
    pub by: String,
    pub retried_at: u64,
}

/// An operator's answer for call `call` of `action` of a parked input, left in doubt: what
/// the remote did (`answer`: `result`, `error` or `not-made`; the answer itself is in the
/// call's record). For the key's history: a `retried` record follows.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Resolved {
    pub agent: String,
    pub key: String,
    pub sequence: u64,
    pub event_id: String,
    pub action: String,
    pub call: u64,
    pub answer: String,
    pub by: String,
    pub resolved_at: u64,
}

/// How an input finished, as its `finished` record says. (docs/SEMANTICS.md, "The states
/// of an input", lists every state, of which these are the ones the journal keeps.)
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum FinishedStatus {
    /// Its run completed, and its outputs and memory are recorded.
    #[serde(alias = "completed")]
    Done,
    /// An operator skipped it: its key went on without it; nothing it did was applied.
    Skipped,
    /// An operator cancelled it: it stopped at its next durable call (not made), or was
    /// not run again; its key went on without it; nothing it did was applied.
    Cancelled,
    /// Finished without completing, by builds before retries.
    Failed,
}

/// One action run of an input, as recorded.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ActionSummary {
    pub action: String,
    /// The kind of the event that triggered it.
    pub event: String,
    pub completed: bool,
    pub calls: Vec<CallSummary>,
}

/// One recorded durable call.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CallSummary {
    pub index: u32,
    pub function: String,
    /// `pending`, `succeeded` or `failed`.
    pub status: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// An output as journals written before outputs had one format hold it: without its id
/// and tenant (the journal's tenant), which are filled in when it is read.
#[derive(Deserialize)]
struct OutputBefore {
    agent: String,
    key: String,
    sequence: u64,
    index: u32,
    event_id: String,
    payload: Box<RawValue>,
}

/// Where an output of the journal stands among its input's: what recovery needs of it,
/// in either format.
#[derive(Deserialize)]
pub struct OutputPlace {
    pub agent: String,
    pub key: String,
    pub sequence: u64,
    pub index: u32,
}

/// Decodes an output of `tenant`'s journal, in the format every front end writes or the
/// one journals were written in before.
pub fn decode_output(tenant: &str, record: &Record) -> Result<OutputRecord, JournalError> {
    let current = decode::<OutputRecord>(OUTPUTS, record);
    if current.is_ok() {
        return current;
    }
    let Ok(before) = serde_json::from_slice::<OutputBefore>(&record.payload) else {
        return current;
    };
    let id = OutputId {
        tenant: tenant.to_owned(),
        agent: before.agent,
        key: before.key,
        sequence: before.sequence,
        index: before.index,
    };
    Ok(OutputRecord {
        id: id.to_string(),
        tenant: id.tenant,
        agent: id.agent,
        key: id.key,
        sequence: id.sequence,
        index: id.index,
        event_id: Some(before.event_id),
        payload: before.payload,
    })
}

impl InputRecord {
    pub fn encode(&self) -> Vec<u8> {
        // A record of plain data always serialises.
        serde_json::to_vec(self).unwrap_or_default()
    }
}

impl Finished {
    /// The record as the journal holds it, `{"finished": {..}}`, as [`InputRecord::encode`]
    /// writes it, without moving it into one.
    pub fn encode(&self) -> Vec<u8> {
        #[derive(Serialize)]
        #[serde(rename_all = "kebab-case")]
        enum Tagged<'a> {
            Finished(&'a Finished),
        }
        serde_json::to_vec(&Tagged::Finished(self)).unwrap_or_default()
    }
}

/// Why the journal could not be read back.
#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    #[error(transparent)]
    Log(#[from] LogError),
    #[error("partition {partition}, offset {offset}: {message}")]
    Decode {
        partition: u32,
        offset: Offset,
        message: String,
    },
}

/// Calls `each` with the records of `partition` from `from` to before `end`, decoded, in
/// offset order.
pub async fn scan_from<T: for<'de> Deserialize<'de>>(
    log: &dyn Log,
    partition: u32,
    from: Offset,
    end: Offset,
    mut each: impl FnMut(Offset, T),
) -> Result<(), JournalError> {
    let (start, _) = log.bounds(partition).await?;
    let mut next = from.max(start);
    while next < end {
        let records = log.read(partition, next, SCAN_BATCH).await?;
        let Some(last) = records.last() else { break };
        next = last.offset + 1;
        // Records appended since `end` was read are the next scan's.
        for record in records.into_iter().take_while(|r| r.offset < end) {
            each(record.offset, decode(partition, &record)?);
        }
    }
    Ok(())
}

/// Reads the one record at `offset` of `partition`.
pub async fn read_one<T: for<'de> Deserialize<'de>>(
    log: &dyn Log,
    partition: u32,
    offset: Offset,
) -> Result<Option<T>, JournalError> {
    let records = log.read(partition, offset, 1).await?;
    records
        .first()
        .filter(|r| r.offset == offset)
        .map(|record| decode(partition, record))
        .transpose()
}

pub fn decode<T: for<'de> Deserialize<'de>>(
    partition: u32,
    record: &Record,
) -> Result<T, JournalError> {
    serde_json::from_slice(&record.payload).map_err(|e| JournalError::Decode {
        partition,
        offset: record.offset,
        message: e.to_string(),
    })
}

/// Milliseconds since the Unix epoch, now.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(payload: &str) -> Record {
        Record {
            offset: 7,
            payload: payload.as_bytes().to_vec(),
        }
    }

    #[test]
    fn an_output_reads_in_the_one_format_and_in_the_one_journals_had_before() {
        let output = crate::event::Output {
            id: OutputId {
                tenant: "acme".to_owned(),
                agent: "bot".to_owned(),
                key: "k".to_owned(),
                sequence: 3,
                index: 1,
            },
            payload: r#"{"ok":true}"#.to_owned(),
        };
        let written = OutputRecord::new(&output, Some("e-1".to_owned())).encode();
        let text = std::str::from_utf8(&written).expect("JSON");
        let read = decode_output("acme", &record(text)).expect("the one format");
        assert_eq!(read.encode(), written);

        // As journals wrote outputs before: no id, no tenant.
        let before = r#"{"agent":"bot","key":"k","sequence":3,"index":1,"event_id":"e-1","payload":{"ok":true}}"#;
        let read = decode_output("acme", &record(before)).expect("the format before");
        assert_eq!(
            read.encode(),
            written,
            "{}",
            String::from_utf8_lossy(&read.encode())
        );

        let error = decode_output("acme", &record(r#"{"agent":"bot"}"#)).expect_err("neither");
        assert!(
            error.to_string().contains("partition 1, offset 7"),
            "{error}"
        );
    }

    #[test]
    fn a_finished_record_of_a_build_before_retries_reads_with_its_status() {
        for (written, read) in [
            ("completed", FinishedStatus::Done),
            ("failed", FinishedStatus::Failed),
            ("done", FinishedStatus::Done),
            ("skipped", FinishedStatus::Skipped),
            ("cancelled", FinishedStatus::Cancelled),
        ] {
            let text = format!(
                r#"{{"finished":{{"agent":"bot","key":"k","sequence":1,"status":"{written}","outputs":0,"actions":[],"memory":{{}},"finished_at":1}}}}"#
            );
            let record: InputRecord = serde_json::from_str(&text).expect(written);
            let InputRecord::Finished(finished) = record else {
                panic!("{written}: not a finished record");
            };
            assert_eq!(finished.status, read, "{written}");
            assert_eq!(finished.version, None);
        }
    }
}
