//! A test's script of signals (`rewind test --signals FILE`): each delivered into an input's
//! inbox as its run reaches a call or a wait, so that a test of a person's approval needs
//! no person, and runs the same way at every crash point.
//!
//! The file holds one signal per line (JSON; blank lines and lines starting with `#` are
//! skipped):
//!
//! ```text
//! {"name": "approve", "payload": {"by": "ana"}, "key": "refund-1", "at_wait": 1}
//! {"name": "reject", "after_call": 2}
//! ```
//!
//! `name` is a signal an action declares; `payload` any JSON (default `null`); `key` and
//! `sequence` pick the inputs (default: every one); `after_call: N` delivers it once the
//! action's `N`th durable call has its record, `at_wait: N` as the action reaches its `N`th
//! wait, before the wait is decided (the default: `at_wait: 1`). Calls and waits are
//! counted from 1 in the action that makes them. Each line is delivered once per input.

use std::path::Path;
use std::sync::Arc;

use async_trait::async_trait;
use serde::Deserialize;

use super::signal::{SignalIn, put_signal};
use crate::durable::{Reached, SignalScript};
use crate::store::{ActionStateStore, StateKey};

/// Set to a script's path for `rewind run`: its agent delivers the script's signals. A test
/// hook (the kit sets it for `rewind test --signals`), honoured by `rewind run` and `rewind
/// test` only.
pub const SIGNALS_ENV: &str = "REWIND_SIGNALS";

/// Lines a script may hold.
pub const MAX_SCRIPT_LINES: usize = 10_000;

/// One signal of a script.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Scripted {
    /// Its line in the file, from 1: its id names it, so it is delivered once per input.
    pub line: usize,
    pub key: Option<String>,
    pub sequence: Option<u64>,
    pub at: Reached,
    pub signal: SignalIn,
}

/// A script's signals, read from its file.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Script {
    pub signals: Vec<Scripted>,
}

/// Why a script was not taken.
#[derive(Debug, thiserror::Error)]
pub enum ScriptError {
    #[error("cannot read the signals script {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("signals script {path}, line {line}: {what}")]
    Line {
        path: String,
        line: usize,
        what: String,
    },
    #[error("signals script {path}: more than {MAX_SCRIPT_LINES} signals")]
    TooLong { path: String },
}

/// A line as written.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Line {
    name: String,
    #[serde(default)]
    payload: serde_json::Value,
    key: Option<String>,
    sequence: Option<u64>,
    after_call: Option<u32>,
    at_wait: Option<u32>,
}

impl Script {
    /// Reads the script at `path`, refusing a line that is not a signal or names one
    /// `declared` does not hold, saying which and why.
    pub fn read(path: &Path, declared: &[&str]) -> Result<Self, ScriptError> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| ScriptError::Read {
            path: shown.clone(),
            source,
        })?;
        let mut signals = Vec::new();
        for (at, text) in text.lines().enumerate() {
            let text = text.trim();
            if text.is_empty() || text.starts_with('#') {
                continue;
            }
            if signals.len() == MAX_SCRIPT_LINES {
                return Err(ScriptError::TooLong { path: shown });
            }
            let line = at + 1;
            let error = |what: String| ScriptError::Line {
                path: shown.clone(),
                line,
                what,
            };
            let parsed: Line = serde_json::from_str(text).map_err(|e| error(e.to_string()))?;
            let at = match (parsed.after_call, parsed.at_wait) {
                (Some(_), Some(_)) => {
                    return Err(error("give `after_call` or `at_wait`, not both".to_owned()));
                }
                (Some(0), None) | (None, Some(0)) => {
                    return Err(error("calls and waits are counted from 1".to_owned()));
                }
                (Some(n), None) => Reached::Call(n),
                (None, Some(n)) => Reached::Wait(n),
                (None, None) => Reached::Wait(1),
            };
            if !declared.contains(&parsed.name.as_str()) {
                return Err(error(format!(
                    "no action declares signal `{}` (declared: {declared:?})",
                    parsed.name
                )));
            }
            let signal = SignalIn {
                name: parsed.name,
                payload: parsed.payload.to_string(),
                id: format!("script-line-{line}"),
            };
            signal.check().map_err(|e| error(e.to_string()))?;
            signals.push(Scripted {
                line,
                key: parsed.key,
                sequence: parsed.sequence,
                at,
                signal,
            });
        }
        Ok(Self { signals })
    }
}

/// A script delivering into the inboxes of `store`.
#[derive(Debug)]
pub(super) struct Delivering {
    pub(super) script: Script,
    pub(super) store: Arc<dyn ActionStateStore>,
}

#[async_trait]
impl SignalScript for Delivering {
    async fn reached(&self, state: &StateKey, point: Reached) -> Result<(), String> {
        let due = (self.script.signals.iter()).filter(|scripted| {
            scripted.at == point
                && (scripted.key.as_ref()).is_none_or(|key| *key == state.scope.key)
                && scripted.sequence.is_none_or(|n| n == state.sequence)
        });
        for scripted in due {
            let delivered =
                put_signal(&*self.store, &state.scope, state.sequence, &scripted.signal);
            delivered
                .await
                .map_err(|e| format!("line {}: {e}", scripted.line))?;
            tracing::debug!(key = %state.scope.key, sequence = state.sequence,
                signal = %scripted.signal.name, line = scripted.line, ?point,
                "the script's signal delivered");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(lines: &[&str]) -> Result<Script, ScriptError> {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("signals.jsonl");
        std::fs::write(&path, lines.join("\n")).expect("write");
        Script::read(&path, &["approve", "reject"])
    }

    #[test]
    fn a_script_reads_each_signal_with_where_it_is_delivered() {
        let script = read(&[
            "# comments and blank lines are skipped",
            "",
            r#"{"name": "approve", "payload": {"by": "ana"}, "key": "k", "sequence": 2}"#,
            r#"{"name": "reject", "after_call": 3}"#,
        ])
        .expect("a script");
        let first = &script.signals[0];
        assert_eq!(
            (first.line, first.key.as_deref(), first.sequence, first.at),
            (3, Some("k"), Some(2), Reached::Wait(1))
        );
        assert_eq!(first.signal.payload, r#"{"by":"ana"}"#);
        assert_eq!(first.signal.id, "script-line-3");
        let second = &script.signals[1];
        assert_eq!((second.key.as_deref(), second.at), (None, Reached::Call(3)));
        assert_eq!(second.signal.payload, "null");
    }

    #[test]
    fn a_line_that_is_not_a_signal_is_refused_naming_its_line_and_why() {
        for (line, why) in [
            (
                r#"{"name": "approve", "at_wait": 1, "after_call": 1}"#,
                "not both",
            ),
            (r#"{"name": "approve", "at_wait": 0}"#, "counted from 1"),
            (
                r#"{"name": "refund"}"#,
                "no action declares signal `refund`",
            ),
            (r#"{"name": "approve", "when": 1}"#, "unknown field `when`"),
            (r#"{"name": "approve""#, "EOF"),
            (r#"{"payload": 1}"#, "missing field `name`"),
        ] {
            let error = read(&[r#"{"name": "reject"}"#, line])
                .expect_err(line)
                .to_string();
            assert!(
                error.contains("line 2") && error.contains(why),
                "{line}: {error}"
            );
        }
    }
}
