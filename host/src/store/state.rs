//! What the store holds: action states, addressed by structured keys.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};

use crate::event::Event;

/// A SHA-256 digest, shown as hex.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Digest(#[serde(with = "hex::serde")] pub [u8; 32]);

impl Digest {
    /// The digest of `parts`, each length-prefixed so that ("ab", "c") and ("a", "bc") differ.
    pub fn of(parts: &[&[u8]]) -> Self {
        let mut hasher = Sha256::new();
        for part in parts {
            hasher.update((part.len() as u64).to_le_bytes());
            hasher.update(part);
        }
        Self(hasher.finalize().into())
    }

    /// The first 12 hex digits: enough to tell digests apart in messages.
    pub fn short(&self) -> String {
        hex::encode(&self.0[..6])
    }
}

impl fmt::Debug for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Digest({})", self.short())
    }
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hex::encode(self.0))
    }
}

/// The inputs of one key of one agent of one tenant: the unit of ordering and of partitioning.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct KeyScope {
    pub tenant: String,
    pub agent: String,
    pub key: String,
}

impl KeyScope {
    pub fn new(
        tenant: impl Into<String>,
        agent: impl Into<String>,
        key: impl Into<String>,
    ) -> Self {
        Self {
            tenant: tenant.into(),
            agent: agent.into(),
            key: key.into(),
        }
    }

    /// The log partition this scope's states live in, out of `partitions` (at least 1).
    /// Stable across processes and versions: it is a hash of the scope, not of memory layout.
    pub fn partition(&self, partitions: u32) -> u32 {
        let digest = Digest::of(&[
            self.tenant.as_bytes(),
            self.agent.as_bytes(),
            self.key.as_bytes(),
        ]);
        let mut head = [0u8; 8];
        head.copy_from_slice(&digest.0[..8]);
        let bucket = u64::from_le_bytes(head) % u64::from(partitions.max(1));
        u32::try_from(bucket).unwrap_or(0)
    }
}

impl fmt::Display for KeyScope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}/{}", self.tenant, self.agent, self.key)
    }
}

/// Addresses one action state: one action's run for one trigger of one input.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct StateKey {
    pub scope: KeyScope,
    pub sequence: u64,
    pub action: String,
    /// Where the triggering event came from (the input itself, or the n-th event a given
    /// action state sent). Two triggers of the same action within one input differ here.
    pub trigger: Digest,
}

impl StateKey {
    /// The smallest key of `scope` at `sequence`: keys order by scope, then sequence.
    fn first(scope: &KeyScope, sequence: u64) -> Self {
        Self {
            scope: scope.clone(),
            sequence,
            action: String::new(),
            trigger: Digest([0; 32]),
        }
    }
}

/// The entries of `map` in `scope` with a sequence at most `up_to`, in key order, found by a
/// range of the map rather than a walk over all of it.
pub(crate) fn in_scope<'a, V>(
    map: &'a BTreeMap<StateKey, V>,
    scope: &'a KeyScope,
    up_to: u64,
) -> impl Iterator<Item = (&'a StateKey, &'a V)> {
    map.range(StateKey::first(scope, 0)..)
        .take_while(move |(key, _)| &key.scope == scope && key.sequence <= up_to)
}

impl fmt::Display for StateKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}#{} {} (trigger {})",
            self.scope,
            self.sequence,
            self.action,
            self.trigger.short()
        )
    }
}

/// Names one state: a state directory, a server's tenant, a cluster. Drawn at random when
/// the state is created and kept in it, so that the idempotency keys of its calls are its
/// own: the same state makes the same keys on every replay, and a new state (a wiped
/// directory, a tenant made again under the same name) makes new ones.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Incarnation(#[serde(with = "hex::serde")] pub [u8; 16]);

/// Why text is not an incarnation.
#[derive(Debug, thiserror::Error)]
#[error("{text:?} is not an incarnation: it is 32 hex digits")]
pub struct BadIncarnation {
    text: String,
}

impl Incarnation {
    /// A new one, from the operating system's random source.
    pub fn random() -> Self {
        Self(rand::random())
    }
}

impl fmt::Debug for Incarnation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Incarnation({self})")
    }
}

impl fmt::Display for Incarnation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hex::encode(self.0))
    }
}

impl std::str::FromStr for Incarnation {
    type Err = BadIncarnation;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let mut bytes = [0u8; 16];
        hex::decode_to_slice(text, &mut bytes).map_err(|_| BadIncarnation {
            text: text.to_owned(),
        })?;
        Ok(Self(bytes))
    }
}

/// Grows with every write to a store; on rebuild the highest version of a state wins.
pub type Version = u64;

/// The record of one action's run for one trigger.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ActionState {
    pub key: StateKey,
    pub trigger: Event,
    /// The run's durable calls; the call at index i is `calls[i]`.
    pub calls: Vec<CallRecord>,
    /// Present once the run completed.
    pub completion: Option<Completion>,
    /// What the run read from its WASI clocks and random sources.
    #[serde(default)]
    pub ambient: Ambient,
    /// The state this action state was first written in, which its calls' idempotency keys
    /// name; set when it is first written. `None` in a state an earlier build wrote, whose
    /// calls keep the keys that build made (`durable::digest`).
    #[serde(default)]
    pub incarnation: Option<Incarnation>,
    /// Assigned by the store on every write.
    pub version: Version,
}

impl ActionState {
    pub fn new(key: StateKey, trigger: Event) -> Self {
        Self {
            key,
            trigger,
            calls: Vec::new(),
            completion: None,
            ambient: Ambient::default(),
            incarnation: None,
            version: 0,
        }
    }

    pub fn is_completed(&self) -> bool {
        self.completion.is_some()
    }
}

/// One durable call.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CallRecord {
    pub function: String,
    /// Digest of the canonical JSON of the call's args.
    pub args_digest: Digest,
    /// Sent to the function's remote side so that it can drop a repeat.
    pub idempotency_key: String,
    pub outcome: CallOutcome,
}

/// What became of a durable call.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", tag = "status", content = "value")]
pub enum CallOutcome {
    /// Persisted before the call ran; no result yet (an in-doubt call if found on replay).
    Pending,
    /// The function's JSON result.
    Succeeded(String),
    /// The function ran and failed; replayed as the same failure.
    Failed(String),
    /// A durable wait the run stopped at (a sleep, a wait for signals), not over yet: when
    /// the input runs again, the wait is over once its time has come or a signal it waits
    /// for was delivered, and its record then holds what it returned.
    Waiting(Wait),
}

impl CallOutcome {
    pub fn status(&self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Succeeded(_) => "succeeded",
            Self::Failed(_) => "failed",
            Self::Waiting(_) => "waiting",
        }
    }
}

/// A durable wait, as recorded when a run first reaches it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Wait {
    /// When it ends without a signal, in milliseconds since the Unix epoch (a sleep's end,
    /// a signal wait's timeout); `None`: only a signal ends it.
    pub until: Option<u64>,
    /// The names of the signals that end it; empty for a sleep.
    pub signals: Vec<String>,
}

impl Wait {
    /// When it ends without a signal, as RFC 3339 (UTC, milliseconds).
    pub fn until_text(&self) -> Option<String> {
        /// 9999-12-31T23:59:59.999Z: RFC 3339 has four digits for the year.
        const LAST: u64 = 253_402_300_799_999;
        let until = self.until?;
        if until > LAST {
            return Some(format!(
                "{until} ms after the Unix epoch (past the year 9999)"
            ));
        }
        let time = std::time::UNIX_EPOCH + std::time::Duration::from_millis(until);
        Some(humantime::format_rfc3339_millis(time).to_string())
    }
}

impl fmt::Display for Wait {
    /// "for signal approve or reject until 2026-12-08T14:00:00.000Z", "until …".
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if !self.signals.is_empty() {
            write!(f, "for signal {}", self.signals.join(" or "))?;
        }
        match self.until_text() {
            Some(until) if self.signals.is_empty() => write!(f, "until {until}"),
            Some(until) => write!(f, " until {until}"),
            None => Ok(()),
        }
    }
}

/// The durable wait an input stopped at: the action that waits, and its wait.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Waiting {
    pub action: String,
    #[serde(flatten)]
    pub wait: Wait,
}

/// The action name of an input's signal inbox: a state beside the input's action states
/// (kept, marked and pruned as they are) whose records are the signals delivered to the
/// input, in the order they came. Each record's `function` is the signal's name, its
/// `idempotency_key` the client's id for it (a repeat of an id is dropped), its outcome
/// `Succeeded(payload)`. No action can be named so: action names do not start with `@`.
pub const SIGNALS_ACTION: &str = "@signals";

/// The action name of a key's index of signal ids: a state of the key at sequence
/// `u64::MAX` (which no prune reaches), whose records are the key's newest signals, each
/// with the client's id (`idempotency_key`) and the input it went to (`Succeeded` of its
/// sequence), so that a signal sent again once that input finished is known after a
/// restart too, and not delivered to a later input.
pub const SIGNAL_IDS_ACTION: &str = "@signal-ids";

impl StateKey {
    /// The key of `scope`'s index of signal ids.
    pub fn signal_ids(scope: &KeyScope) -> Self {
        Self {
            scope: scope.clone(),
            sequence: u64::MAX,
            action: SIGNAL_IDS_ACTION.to_owned(),
            trigger: Digest::of(&[SIGNAL_IDS_ACTION.as_bytes()]),
        }
    }

    /// Whether this is the key of a key's index of signal ids.
    pub fn is_signal_ids(&self) -> bool {
        self.action == SIGNAL_IDS_ACTION
    }

    /// The key of the signal inbox of input `sequence` of `scope`.
    pub fn signals(scope: &KeyScope, sequence: u64) -> Self {
        Self {
            scope: scope.clone(),
            sequence,
            action: SIGNALS_ACTION.to_owned(),
            trigger: Digest::of(&[SIGNALS_ACTION.as_bytes()]),
        }
    }

    /// Whether this is the key of an input's signal inbox, not of an action's run.
    pub fn is_signals(&self) -> bool {
        self.action == SIGNALS_ACTION
    }
}

/// What a run read from the WASI clocks, and the key of its random streams, so that running
/// it again reads the same (`durable::AmbientSource`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ambient {
    /// `wasi:clocks/wall-clock.now`: nanoseconds since the Unix epoch, one per reading.
    pub wall: Vec<u64>,
    /// `wasi:clocks/monotonic-clock.now`: nanoseconds, one per reading.
    pub monotonic: Vec<u64>,
    /// What `wasi:random/random` and `wasi:random/insecure` hand out is derived from this
    /// key, drawn the first time the run asks for randomness.
    pub random_key: Option<RandomKey>,
}

impl Ambient {
    pub fn is_empty(&self) -> bool {
        self.wall.is_empty() && self.monotonic.is_empty() && self.random_key.is_none()
    }
}

/// 32 secret bytes (`Debug` does not show them).
#[derive(Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RandomKey(#[serde(with = "hex::serde")] pub [u8; 32]);

impl fmt::Debug for RandomKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("RandomKey(..)")
    }
}

/// What a completed run left behind, re-applied instead of running it again.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Completion {
    /// Events the run sent, in order.
    pub sent: Vec<Event>,
    /// Memory writes the run made, in order.
    pub memory: Vec<MemoryWrite>,
}

/// One write to a key's short-term memory.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryWrite {
    pub name: String,
    pub value: String,
}
