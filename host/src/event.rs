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
