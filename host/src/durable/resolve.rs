//! An operator's answer for a call left in doubt (docs/SEMANTICS.md, "In-doubt calls"):
//! what the remote said, or that the call was never made.

use crate::store::{ActionState, ActionStateStore, CallOutcome, KeyScope, StoreError};

/// What an operator found out about a call in doubt.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Answer {
    /// The function ran and answered this JSON.
    Result(String),
    /// The function ran and failed with this error.
    Error(String),
    /// It never reached the function: the next attempt makes it, under the same key.
    NotMade,
}

impl Answer {
    /// `result`, `error` or `not-made`: what a log line says of it (not its text).
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Result(_) => "result",
            Self::Error(_) => "error",
            Self::NotMade => "not-made",
        }
    }
}

/// The call an answer was recorded for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Resolved {
    pub action: String,
    pub function: String,
    pub idempotency_key: String,
}

/// Why an answer was not recorded.
#[derive(Debug, thiserror::Error)]
pub enum ResolveError {
    #[error("{scope} #{sequence} has no call {call} in doubt{}", in_doubt(found))]
    NotInDoubt {
        scope: String,
        sequence: u64,
        call: usize,
        /// The calls in doubt it has, as `action` call `n`.
        found: Vec<String>,
    },
    #[error("{scope} #{sequence}: call {call} is in doubt in actions {actions:?}: name one")]
    Ambiguous {
        scope: String,
        sequence: u64,
        call: usize,
        actions: Vec<String>,
    },
    #[error("the result is not JSON: {0}")]
    NotJson(String),
    #[error("recording the answer: {0}")]
    Store(#[from] StoreError),
}

fn in_doubt(found: &[String]) -> String {
    if found.is_empty() {
        " (none of its calls is)".to_owned()
    } else {
        format!(" (in doubt: {})", found.join(", "))
    }
}

/// Records `answer` for call `call` of input `sequence` of `scope` (of `action`, which may
/// be left out when one action has that call in doubt), which must be in doubt: a
/// `pending` record. Its input must not be running (its key's input is parked). An answer
/// recorded already is not recorded again. Logged at WARN with who answered (`by`).
pub async fn resolve(
    store: &dyn ActionStateStore,
    scope: &KeyScope,
    sequence: u64,
    action: Option<&str>,
    call: usize,
    answer: &Answer,
    by: &str,
) -> Result<Resolved, ResolveError> {
    if let Answer::Result(json) = answer {
        serde_json::from_str::<serde_json::Value>(json)
            .map_err(|e| ResolveError::NotJson(e.to_string()))?;
    }
    let states: Vec<ActionState> = store
        .states(scope)
        .into_iter()
        .filter(|s| s.key.sequence == sequence && action.is_none_or(|a| a == s.key.action))
        .collect();
    let outcome = match answer {
        Answer::Result(json) => Some(CallOutcome::Succeeded(json.clone())),
        Answer::Error(error) => Some(CallOutcome::Failed(error.clone())),
        Answer::NotMade => None,
    };
    let resolved = |state: &ActionState, record: &crate::store::CallRecord| Resolved {
        action: state.key.action.clone(),
        function: record.function.clone(),
        idempotency_key: record.idempotency_key.clone(),
    };
    // Recorded by an earlier resolution that was not said to be done (a crash between).
    if let Some(outcome) = &outcome
        && let Some((state, record)) = states.iter().find_map(|s| {
            let record = s.calls.get(call).filter(|r| r.outcome == *outcome)?;
            Some((s, record))
        })
    {
        return Ok(resolved(state, record));
    }
    let mut doubted: Vec<ActionState> = states
        .iter()
        .filter(|s| {
            s.calls
                .get(call)
                .is_some_and(|r| r.outcome == CallOutcome::Pending)
        })
        .cloned()
        .collect();
    let mut state = match doubted.len() {
        1 => doubted.remove(0),
        0 => {
            let found = states
                .iter()
                .flat_map(|s| {
                    s.calls
                        .iter()
                        .enumerate()
                        .filter(|(_, r)| r.outcome == CallOutcome::Pending)
                        .map(|(n, _)| format!("`{}` call {n}", s.key.action))
                })
                .collect();
            return Err(ResolveError::NotInDoubt {
                scope: scope.to_string(),
                sequence,
                call,
                found,
            });
        }
        _ => {
            return Err(ResolveError::Ambiguous {
                scope: scope.to_string(),
                sequence,
                call,
                actions: doubted.into_iter().map(|s| s.key.action).collect(),
            });
        }
    };
    let done = resolved(&state, &state.calls[call]);
    match outcome {
        Some(outcome) => state.calls[call].outcome = outcome,
        // The pending record is the run's last: without it the call is a miss, made under
        // the key its state, index, function and args give, which is the one it had.
        None => state.calls.truncate(call),
    }
    store.put(&state).await?;
    tracing::warn!(tenant = %scope.tenant, agent = %scope.agent, key = %scope.key, sequence,
        call, action = done.action, function = done.function,
        idempotency_key = done.idempotency_key, by, answer = answer.kind(),
        "an operator answered a call in doubt");
    Ok(done)
}
