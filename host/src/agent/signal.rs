//! Signals delivered to an input from outside, kept in its inbox until a wait takes them
//! (docs/SEMANTICS.md, "Durable waits").

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};

use super::{Agent, Waiting};
use crate::durable::MAX_SIGNAL_NAME_BYTES;
use crate::event::Event;
use crate::store::{
    ActionState, ActionStateStore, CallOutcome, CallRecord, Digest, KeyScope, StateKey, StoreError,
};

/// The bytes of a signal's payload.
pub const MAX_SIGNAL_PAYLOAD_BYTES: usize = 64 * 1024;
/// The bytes of a signal's client id.
pub const MAX_SIGNAL_ID_BYTES: usize = 128;
/// Signals one input may be sent.
pub const MAX_SIGNALS_PER_INPUT: usize = 1000;
/// Signal ids a key's index keeps (the newest; see [`StateKey::signal_ids`]).
pub const SIGNAL_IDS_KEPT: usize = 256;

/// The bytes of the payloads one input's signals may carry in all: each signal rewrites
/// the input's inbox whole, and a wait copies what it takes into its action's state.
pub const MAX_INBOX_BYTES: usize = 1 << 20;

/// A signal as a client sends it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SignalIn {
    /// One of the signals an action of the agent declares.
    pub name: String,
    /// JSON text.
    pub payload: String,
    /// The client's id for it: a signal sent again with the same id is delivered once.
    pub id: String,
}

/// A signal taken into an input's inbox.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Delivered {
    /// The input it was delivered to.
    pub sequence: u64,
    /// Whether its id was delivered to that input before (this one changed nothing).
    pub repeat: bool,
}

/// Why a signal was not delivered.
#[derive(Debug, thiserror::Error)]
pub enum SignalError {
    #[error("signal {what}")]
    Invalid { what: String },
    #[error(
        "no action of agent `{agent}` declares signal `{name}` (declared: {declared}); an \
         action lists the signals it waits for in agent.toml (`signals = [...]`)"
    )]
    Undeclared {
        agent: String,
        name: String,
        declared: String,
    },
    #[error("key {key} has no unfinished input to deliver signal `{name}` to")]
    NoInput { key: String, name: String },
    #[error("key {key} has no input #{sequence}")]
    NoSuchInput { key: String, sequence: u64 },
    #[error(
        "input #{sequence} of key {key} is finished; signal `{name}` was not delivered (nor \
         to a later input)"
    )]
    Finished {
        key: String,
        sequence: u64,
        name: String,
    },
    #[error(
        "input #{sequence} of key {key} holds as many signals as it can ({MAX_SIGNALS_PER_INPUT}, \
         {MAX_INBOX_BYTES} bytes of payloads, or what the state log takes in one record)"
    )]
    Full { key: String, sequence: u64 },
    /// The input's agent cannot be loaded, or the store did not take the signal.
    #[error("signal `{name}` for {key} #{sequence} not recorded: {message}")]
    Host {
        key: String,
        sequence: u64,
        name: String,
        message: String,
    },
}

impl SignalIn {
    /// Refuses a name, payload or id out of bounds, or a payload that is not JSON.
    pub fn check(&self) -> Result<(), SignalError> {
        let invalid = |what: String| Err(SignalError::Invalid { what });
        if self.name.is_empty() || self.name.len() > MAX_SIGNAL_NAME_BYTES {
            return invalid(format!(
                "name is empty or longer than {MAX_SIGNAL_NAME_BYTES} bytes"
            ));
        }
        if self.id.is_empty() || self.id.len() > MAX_SIGNAL_ID_BYTES {
            return invalid(format!(
                "`{}`: its id is empty or longer than {MAX_SIGNAL_ID_BYTES} bytes",
                self.name
            ));
        }
        if self.payload.len() > MAX_SIGNAL_PAYLOAD_BYTES {
            return invalid(format!(
                "`{}`: its payload is {} bytes, more than {MAX_SIGNAL_PAYLOAD_BYTES}",
                self.name,
                self.payload.len()
            ));
        }
        if let Err(e) = serde_json::from_str::<serde::de::IgnoredAny>(&self.payload) {
            return invalid(format!("`{}`: its payload is not JSON: {e}", self.name));
        }
        Ok(())
    }
}

impl Agent {
    /// The signals its actions declare.
    pub fn signals(&self) -> BTreeSet<&str> {
        self.policy
            .signals
            .values()
            .flatten()
            .map(String::as_str)
            .collect()
    }

    /// Puts `signal` in the inbox of `key`'s input `sequence`, durably, unless its id is
    /// there already. Deliveries to one input must not run at once (each reads the inbox
    /// and writes it whole): the caller takes them one at a time.
    pub async fn deliver(
        &self,
        key: &str,
        sequence: u64,
        signal: &SignalIn,
    ) -> Result<Delivered, SignalError> {
        signal.check()?;
        if !self.signals().contains(signal.name.as_str()) {
            return Err(SignalError::Undeclared {
                agent: self.name.clone(),
                name: signal.name.clone(),
                declared: format!("{:?}", self.signals()),
            });
        }
        let delivered = put_signal(&*self.store, &self.scope(key), sequence, signal).await?;
        if !delivered.repeat {
            self.remember_signal(key, &signal.id, sequence).await;
        }
        Ok(delivered)
    }

    /// The input of `key` that the signal with client id `id` went to, when the key's index
    /// of signal ids holds it (its newest [`SIGNAL_IDS_KEPT`]).
    pub fn signal_sent(&self, key: &str, id: &str) -> Option<u64> {
        let index = self.store.get(&StateKey::signal_ids(&self.scope(key)))?;
        (index.calls.iter().rev())
            .find(|record| record.idempotency_key == id)
            .and_then(|record| match &record.outcome {
                CallOutcome::Succeeded(sequence) => sequence.parse().ok(),
                _ => None,
            })
    }

    /// Adds to `key`'s index of signal ids that `id` went to input `sequence`, then sets the
    /// index aside on the shelf (it would otherwise hold the log back for as long as the key
    /// lives). Best effort: a failure is logged, and a repeat of `id` after a restart may
    /// then be taken for a new signal.
    async fn remember_signal(&self, key: &str, id: &str, sequence: u64) {
        let scope = self.scope(key);
        let index_key = StateKey::signal_ids(&scope);
        let mut index = self.store.get(&index_key).unwrap_or_else(|| {
            let mut index = ActionState::new(index_key, Event::new("signal-ids", "{}"));
            index.incarnation = Some(self.store.incarnation());
            index
        });
        if index.calls.len() >= SIGNAL_IDS_KEPT {
            let over = index.calls.len() + 1 - SIGNAL_IDS_KEPT;
            index.calls.drain(..over);
        }
        index.calls.push(CallRecord {
            function: "signal".to_owned(),
            args_digest: Digest::of(&[id.as_bytes()]),
            idempotency_key: id.to_owned(),
            outcome: CallOutcome::Succeeded(sequence.to_string()),
        });
        if let Err(error) = self.store.put(&index).await {
            tracing::warn!(agent = %self.name, key, "a signal's id not kept in its key's \
                index: sent again after a restart, once its input finished, it may reach \
                the key's next input: {error}");
            return;
        }
        self.shelve(key, u64::MAX).await;
    }

    /// Whether a signal `waiting` waits for was delivered to `key`'s input `sequence`: its
    /// wait may be over though recorded as not (the signal came as the host stopped). A
    /// signal an earlier wait of the input took counts too: running the input again then
    /// only replays it to its wait.
    pub fn signal_came(&self, key: &str, sequence: u64, waiting: &Waiting) -> bool {
        signal_came(&*self.store, &self.scope(key), sequence, waiting)
    }
}

/// [`Agent::signal_came`], in `store`, for input `sequence` of `scope`.
pub fn signal_came(
    store: &dyn ActionStateStore,
    scope: &KeyScope,
    sequence: u64,
    waiting: &Waiting,
) -> bool {
    if waiting.wait.signals.is_empty() {
        return false;
    }
    let inbox = store.get(&StateKey::signals(scope, sequence));
    inbox.is_some_and(|inbox| {
        (inbox.calls.iter()).any(|call| waiting.wait.signals.contains(&call.function))
    })
}

/// Puts `signal` in the inbox of input `sequence` of `scope` in `store`, durably, unless its
/// id is there already (then a repeat). Deliveries to one input must not run at once (each
/// reads the inbox and writes it whole).
pub(super) async fn put_signal(
    store: &dyn ActionStateStore,
    scope: &KeyScope,
    sequence: u64,
    signal: &SignalIn,
) -> Result<Delivered, SignalError> {
    let key = &scope.key;
    let inbox_key = StateKey::signals(scope, sequence);
    let mut inbox = store.get(&inbox_key).unwrap_or_else(|| {
        let mut inbox = ActionState::new(inbox_key, Event::new("signals", "{}"));
        inbox.incarnation = Some(store.incarnation());
        inbox
    });
    let delivered = |repeat| Delivered { sequence, repeat };
    if inbox
        .calls
        .iter()
        .any(|call| call.idempotency_key == signal.id)
    {
        return Ok(delivered(true));
    }
    let carried: usize = (inbox.calls.iter())
        .map(|call| match &call.outcome {
            CallOutcome::Succeeded(payload) => payload.len(),
            _ => 0,
        })
        .sum();
    if inbox.calls.len() >= MAX_SIGNALS_PER_INPUT
        || carried + signal.payload.len() > MAX_INBOX_BYTES
    {
        return Err(SignalError::Full {
            key: key.clone(),
            sequence,
        });
    }
    inbox.calls.push(CallRecord {
        function: signal.name.clone(),
        args_digest: Digest::of(&[signal.id.as_bytes()]),
        idempotency_key: signal.id.clone(),
        outcome: CallOutcome::Succeeded(signal.payload.clone()),
    });
    match store.put(&inbox).await {
        Ok(_) => {}
        // Its signals take more than the log holds in one record: full.
        Err(StoreError::TooLarge { .. }) => {
            return Err(SignalError::Full {
                key: key.clone(),
                sequence,
            });
        }
        Err(error) => {
            return Err(SignalError::Host {
                key: key.clone(),
                sequence,
                name: signal.name.clone(),
                message: error.to_string(),
            });
        }
    }
    Ok(delivered(false))
}
