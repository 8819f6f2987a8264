//! Events, the inputs that carry them into an agent, and the outputs that leave it.

use std::fmt;

use serde::{Deserialize, Serialize};

/// The kind of the event an input becomes inside its agent.
pub const INPUT_KIND: &str = "input";
/// Events an action sends with this kind leave the agent as outputs.
pub const OUTPUT_KIND: &str = "output";

/// An event moving through an agent: `kind` routes it, `payload` is JSON text.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Event {
    pub kind: String,
    pub payload: String,
}

impl Event {
    pub fn new(kind: impl Into<String>, payload: impl Into<String>) -> Self {
        Self {
            kind: kind.into(),
            payload: payload.into(),
        }
    }
}

/// One input accepted into an agent: the `sequence`-th event of `key`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Input {
    pub key: String,
    pub sequence: u64,
    /// JSON text.
    pub payload: String,
}

/// Identifies an output across replays: a sink that sees the same id twice drops the second.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct OutputId {
    pub tenant: String,
    pub agent: String,
    pub key: String,
    pub sequence: u64,
    /// Position among the outputs of this input, from 0.
    pub index: u32,
}

impl fmt::Display for OutputId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}/{}/{}/{}/{}",
            self.tenant, self.agent, self.key, self.sequence, self.index
        )
    }
}

/// An event of kind `output` that left the agent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Output {
    pub id: OutputId,
    /// JSON text.
    pub payload: String,
}

/// An output as every front end keeps it: a line of `rewind run --output`, a message of a
/// cluster's output stream, a record of a tenant's journal under `rewind serve`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct OutputRecord {
    /// [`OutputId`] as text: `TENANT/AGENT/KEY/SEQUENCE/INDEX`.
    pub id: String,
    pub tenant: String,
    pub agent: String,
    pub key: String,
    pub sequence: u64,
    /// Position among the outputs of its input, from 0.
    pub index: u32,
    /// The id of the event whose input gave the output, where the front end keeps it
    /// (`rewind serve` does).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub event_id: Option<String>,
    pub payload: Box<serde_json::value::RawValue>,
}

impl OutputRecord {
    pub fn new(output: &Output, event_id: Option<String>) -> Self {
        // A sent payload is checked to be JSON; text that is not would be kept as a string.
        let payload = serde_json::value::RawValue::from_string(output.payload.clone())
            .or_else(|_| serde_json::value::to_raw_value(&output.payload))
            .unwrap_or_else(|_| serde_json::value::RawValue::NULL.to_owned());
        Self {
            id: output.id.to_string(),
            tenant: output.id.tenant.clone(),
            agent: output.id.agent.clone(),
            key: output.id.key.clone(),
            sequence: output.id.sequence,
            index: output.id.index,
            event_id,
            payload,
        }
    }

    pub fn output_id(&self) -> OutputId {
        OutputId {
            tenant: self.tenant.clone(),
            agent: self.agent.clone(),
            key: self.key.clone(),
            sequence: self.sequence,
            index: self.index,
        }
    }

    /// The record as JSON, as every front end writes it.
    pub fn encode(&self) -> Vec<u8> {
        // Plain data with a payload that is JSON already: it always serialises.
        serde_json::to_vec(self).unwrap_or_default()
    }
}

/// A piece of a streamed answer as it comes (a token delta): forwarded live to whoever
/// follows the outputs, never recorded, and not resent (a replay serves the recorded
/// message, whose pieces are not streamed again).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Delta {
    pub tenant: String,
    pub agent: String,
    pub key: String,
    pub sequence: u64,
    pub action: String,
    /// The call's index in its action's records.
    pub call: u64,
    pub function: String,
    /// The chunk's `choices[0].delta`, as the endpoint sent it: `{"content": "..."}`, or a
    /// piece of a tool call.
    pub delta: serde_json::Value,
}

/// Where a front end forwards the deltas of its inputs' calls. Best effort: a follower too
/// slow to take them loses some (the recorded message is whole).
pub trait Deltas: Send + Sync + fmt::Debug {
    fn send(&self, delta: Delta);
}
