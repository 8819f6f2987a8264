//! Durable waits: a run that sleeps or waits for a signal stops, its wait recorded at its
//! call's index; run again once the wait is over, it is served its records up to the wait
//! and goes on from there (docs/SEMANTICS.md, "Durable waits").

use std::collections::BTreeSet;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::store::{ActionState, CallOutcome, StateKey, Wait};

/// The function name a `sleep` is recorded under. Names starting with `@` are the host's:
/// no declared function has one.
pub const SLEEP: &str = "@sleep";
/// The function name a `sleep-until` is recorded under.
pub const SLEEP_UNTIL: &str = "@sleep-until";
/// The function name an `await-signal` is recorded under.
pub const AWAIT_SIGNAL: &str = "@signal";

/// Whether a record under `function` is a wait's.
pub(super) fn is_wait(function: &str) -> bool {
    matches!(function, SLEEP | SLEEP_UNTIL | AWAIT_SIGNAL)
}

/// Signal names one wait may list, and the bytes of one name.
pub const MAX_SIGNAL_NAMES: usize = 32;
pub const MAX_SIGNAL_NAME_BYTES: usize = 128;

/// A point a run reaches where a test's script may deliver signals (`rewind test
/// --signals`): counted in the action whose run reaches it, from 1.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reached {
    /// The action's `n`th durable call (its waits not counted) has its record.
    Call(u32),
    /// The action reached its `n`th wait; what ends it is not decided yet.
    Wait(u32),
}

/// Signals a test delivers as runs reach points ([`Reached`]): `rewind test --signals`.
#[async_trait::async_trait]
pub trait SignalScript: Send + Sync + std::fmt::Debug {
    /// The run of the action state at `state` reached `point`: delivers into its input's
    /// inbox the signals the script holds for there, each once per input (a run that
    /// reaches the point again, after a crash, delivers nothing new). `Err` says why one
    /// was not delivered.
    async fn reached(&self, state: &StateKey, point: Reached) -> Result<(), String>;
}

/// What a run asks to wait for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WaitFor {
    /// `sleep(ms)`.
    Sleep { ms: u64 },
    /// `sleep-until(unix-ms)`.
    SleepUntil { unix_ms: u64 },
    /// `await-signal(names, timeout-ms)`.
    Signal {
        names: Vec<String>,
        timeout_ms: Option<u64>,
    },
}

impl WaitFor {
    /// The name its record is kept under.
    pub(super) fn function(&self) -> &'static str {
        match self {
            Self::Sleep { .. } => SLEEP,
            Self::SleepUntil { .. } => SLEEP_UNTIL,
            Self::Signal { .. } => AWAIT_SIGNAL,
        }
    }

    /// Its args as JSON: what a replay compares (a sleep's length, not its end, which
    /// depends on when it was first reached).
    pub(super) fn args(&self) -> String {
        match self {
            Self::Sleep { ms } => serde_json::json!({ "ms": ms }),
            Self::SleepUntil { unix_ms } => serde_json::json!({ "unix_ms": unix_ms }),
            Self::Signal { names, timeout_ms } => {
                serde_json::json!({ "names": names, "timeout_ms": timeout_ms })
            }
        }
        .to_string()
    }

    /// The wait as recorded when first reached at `now` (milliseconds since the epoch).
    pub(super) fn wait(&self, now: u64) -> Wait {
        match self {
            Self::Sleep { ms } => Wait {
                until: Some(now.saturating_add(*ms)),
                signals: Vec::new(),
            },
            Self::SleepUntil { unix_ms } => Wait {
                until: Some(*unix_ms),
                signals: Vec::new(),
            },
            Self::Signal { names, timeout_ms } => Wait {
                until: timeout_ms.map(|ms| now.saturating_add(ms)),
                signals: names.clone(),
            },
        }
    }
}

/// A signal delivered to an input, as a wait returns it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Signal {
    pub name: String,
    /// JSON text.
    pub payload: String,
}

/// What ended a wait: its record's result, as JSON.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", tag = "woke")]
pub(super) enum Woke {
    /// Its time came (a sleep's end, a signal wait's timeout).
    Time,
    /// The signal at `id` in the input's inbox.
    Signal {
        id: u64,
        name: String,
        payload: String,
    },
}

impl Woke {
    pub(super) fn json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    /// What the guest gets: the signal, or none when the time came first.
    pub(super) fn signal(self) -> Option<Signal> {
        match self {
            Self::Time => None,
            Self::Signal { name, payload, .. } => Some(Signal { name, payload }),
        }
    }
}

/// The inbox ids of the signals `state`'s waits took, each one taken once per input.
pub fn taken_signals(state: &ActionState) -> impl Iterator<Item = u64> + '_ {
    state.calls.iter().filter_map(|call| match &call.outcome {
        CallOutcome::Succeeded(json) if call.function == AWAIT_SIGNAL => {
            match serde_json::from_str(json) {
                Ok(Woke::Signal { id, .. }) => Some(id),
                _ => None,
            }
        }
        _ => None,
    })
}

/// The inbox ids already taken by an input's waits, the run's own included.
pub(super) type Taken = BTreeSet<u64>;

/// Milliseconds since the Unix epoch (0 before it).
pub fn unix_ms(time: SystemTime) -> u64 {
    time.duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}
