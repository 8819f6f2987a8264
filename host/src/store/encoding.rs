//! How an action state is written to the log: a version byte, then the state.
//!
//! Version 1 is the state as JSON. A fixture written by version 1 is kept in
//! `host/tests/fixtures/` and read back by a test, so later versions prove they still read
//! what this one wrote.

use super::ActionState;

/// The encoding this build writes.
pub const ENCODING: u8 = 1;

/// Why bytes from the log are not a state.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    #[error("empty record")]
    Empty,
    #[error("state encoding {0} is not one this build reads (it reads 1)")]
    UnknownEncoding(u8),
    #[error("encoding 1: {0}")]
    Json(#[from] serde_json::Error),
}

/// The bytes of `state` in the current encoding.
pub fn encode(state: &ActionState) -> Result<Vec<u8>, serde_json::Error> {
    let mut bytes = vec![ENCODING];
    serde_json::to_writer(&mut bytes, state)?;
    Ok(bytes)
}

/// A state from bytes of any encoding this build reads.
pub fn decode(bytes: &[u8]) -> Result<ActionState, DecodeError> {
    match bytes.split_first() {
        None => Err(DecodeError::Empty),
        Some((1, rest)) => Ok(serde_json::from_slice(rest)?),
        Some((&other, _)) => Err(DecodeError::UnknownEncoding(other)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::Event;
    use crate::store::{
        CallOutcome, CallRecord, Completion, Digest, KeyScope, MemoryWrite, StateKey,
    };

    const FIXTURE: &str = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/action-state-v1.bin"
    );

    /// A state that uses every field, as version 1 wrote it to the fixture.
    fn fixture_state() -> ActionState {
        let call = |function: &str, outcome| CallRecord {
            function: function.to_owned(),
            args_digest: Digest::of(&[function.as_bytes()]),
            idempotency_key: format!("rw-{function}"),
            outcome,
        };
        ActionState {
            key: StateKey {
                scope: KeyScope::new("acme", "support", "cust-ana"),
                sequence: 7,
                action: "triage".to_owned(),
                trigger: Digest::of(&[b"input"]),
            },
            trigger: Event::new("input", r#"{"ticket":"T-1"}"#),
            calls: vec![
                call(
                    "llm.chat",
                    CallOutcome::Succeeded(r#"{"role":"assistant"}"#.to_owned()),
                ),
                call("orders.lookup", CallOutcome::Failed("404".to_owned())),
                call("payments.charge", CallOutcome::Pending),
            ],
            completion: Some(Completion {
                sent: vec![Event::new("output", r#"{"reply":"ok"}"#)],
                memory: vec![MemoryWrite {
                    name: "seen".to_owned(),
                    value: "true".to_owned(),
                }],
            }),
            version: 42,
        }
    }

    #[test]
    fn the_version_1_fixture_is_still_read() {
        let bytes = std::fs::read(FIXTURE).expect("the fixture is in the repository");
        assert_eq!(bytes[0], 1, "the fixture is encoding 1");
        assert_eq!(decode(&bytes).expect("decodes"), fixture_state());
    }

    #[test]
    fn states_round_trip() {
        let state = fixture_state();
        let bytes = encode(&state).expect("encodes");
        assert_eq!(decode(&bytes).expect("decodes"), state);
    }

    #[test]
    fn unknown_encodings_and_garbage_are_named() {
        assert!(matches!(
            decode(&[9, b'{']),
            Err(DecodeError::UnknownEncoding(9))
        ));
        assert!(matches!(decode(&[]), Err(DecodeError::Empty)));
        assert!(matches!(decode(&[1, b'x']), Err(DecodeError::Json(_))));
    }

    /// Writes the fixture. Run by hand only when adding a new encoding's fixture:
    /// `cargo test -p rewind-host --lib write_fixture -- --ignored`.
    #[test]
    #[ignore = "writes the fixture file; run by hand"]
    fn write_fixture() {
        let bytes = encode(&fixture_state()).expect("encodes");
        std::fs::write(FIXTURE, bytes).expect("write");
    }
}
