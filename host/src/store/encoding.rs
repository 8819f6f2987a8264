//! How an action state is written to the log: a version byte, then the state.
//!
//! - Version 1: the state as JSON. Read, no longer written.
//! - Version 2: binary, read, no longer written. Integers little-endian; a string is its length (u32) and
//!   its UTF-8 bytes; a list is its length (u32) and its items; a digest is its 32 bytes.
//!
//!   ```text
//!   version u64 | tenant, agent, key | sequence u64 | action | trigger digest
//!   | event kind, payload | calls: [function | args digest | idempotency key
//!   | outcome u8 (0 pending, 1 succeeded, 2 failed) | value, unless pending]
//!   | completed u8 (0, 1) | if completed: sent [kind, payload] | memory [name, value]
//!   ```
//! - Version 3: read, no longer written. Version 2, then what the run read from its clocks
//!   and the key of its random streams (`Ambient`): `wall [u64] | monotonic [u64] | key u8
//!   (0, 1) | if 1: the key's 32 bytes`.
//! - Version 4: read, no longer written. Version 3, then the state's incarnation: `u8 (0,
//!   1) | if 1: its 16 bytes`. A state read from an earlier version has none.
//! - Version 5 (written): version 4, and a call's outcome may be 3, waiting (a durable wait
//!   not over yet), followed by its wait: `until u8 (0, 1) | if 1: u64 | signals [name]`.
//!
//! A fixture written by each version is kept in `host/tests/fixtures/` and read back by a
//! test, so later versions prove they still read what earlier ones wrote.

use super::MemoryWrite;
use super::{
    ActionState, Ambient, CallOutcome, CallRecord, Completion, Digest, Incarnation, KeyScope,
    RandomKey, StateKey, Version, Wait,
};
use crate::event::Event;

/// The encoding this build writes.
pub const ENCODING: u8 = 5;

/// Why bytes from the log are not a state.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    #[error("empty record")]
    Empty,
    #[error("state encoding {0} is not one this build reads (it reads 1 to 5)")]
    UnknownEncoding(u8),
    #[error("encoding 1: {0}")]
    Json(#[from] serde_json::Error),
    #[error("encoding {encoding}, at byte {at}: {problem}")]
    Binary {
        encoding: u8,
        at: usize,
        problem: String,
    },
}

/// Why a state cannot be written.
#[derive(Debug, thiserror::Error)]
#[error("{what} is {len} bytes, over the 4 GiB a length can say")]
pub struct EncodeError {
    what: &'static str,
    len: usize,
}

/// The bytes of `state` in the current encoding.
pub fn encode(state: &ActionState) -> Result<Vec<u8>, EncodeError> {
    encode_as(state, state.version)
}

/// The bytes of `state` in the current encoding, as its version `version` (a store gives
/// each write its version without copying the state to set it).
pub fn encode_as(state: &ActionState, version: Version) -> Result<Vec<u8>, EncodeError> {
    let mut out = Writer(Vec::with_capacity(256 + state.trigger.payload.len()));
    out.0.push(ENCODING);
    out.u64(version);
    let key = &state.key;
    out.str("tenant", &key.scope.tenant)?;
    out.str("agent", &key.scope.agent)?;
    out.str("key", &key.scope.key)?;
    out.u64(key.sequence);
    out.str("action", &key.action)?;
    out.digest(&key.trigger);
    out.event(&state.trigger)?;
    out.len("calls", state.calls.len())?;
    for call in &state.calls {
        out.str("function", &call.function)?;
        out.digest(&call.args_digest);
        out.str("idempotency key", &call.idempotency_key)?;
        match &call.outcome {
            CallOutcome::Pending => out.0.push(0),
            CallOutcome::Succeeded(value) => {
                out.0.push(1);
                out.str("call result", value)?;
            }
            CallOutcome::Failed(error) => {
                out.0.push(2);
                out.str("call error", error)?;
            }
            CallOutcome::Waiting(wait) => {
                out.0.push(3);
                match wait.until {
                    None => out.0.push(0),
                    Some(until) => {
                        out.0.push(1);
                        out.u64(until);
                    }
                }
                out.len("signal names", wait.signals.len())?;
                for name in &wait.signals {
                    out.str("signal name", name)?;
                }
            }
        }
    }
    match &state.completion {
        None => out.0.push(0),
        Some(completion) => {
            out.0.push(1);
            out.len("sent events", completion.sent.len())?;
            for event in &completion.sent {
                out.event(event)?;
            }
            out.len("memory writes", completion.memory.len())?;
            for write in &completion.memory {
                out.str("memory name", &write.name)?;
                out.str("memory value", &write.value)?;
            }
        }
    }
    let ambient = &state.ambient;
    out.len("wall-clock readings", ambient.wall.len())?;
    for &reading in &ambient.wall {
        out.u64(reading);
    }
    out.len("monotonic-clock readings", ambient.monotonic.len())?;
    for &reading in &ambient.monotonic {
        out.u64(reading);
    }
    match &ambient.random_key {
        None => out.0.push(0),
        Some(key) => {
            out.0.push(1);
            out.0.extend_from_slice(&key.0);
        }
    }
    match &state.incarnation {
        None => out.0.push(0),
        Some(incarnation) => {
            out.0.push(1);
            out.0.extend_from_slice(&incarnation.0);
        }
    }
    Ok(out.0)
}

/// A state from bytes of any encoding this build reads.
pub fn decode(bytes: &[u8]) -> Result<ActionState, DecodeError> {
    match bytes.split_first() {
        None => Err(DecodeError::Empty),
        Some((1, rest)) => Ok(serde_json::from_slice(rest)?),
        Some((&encoding @ 2..=ENCODING, _)) => decode_binary(&mut Reader {
            bytes,
            at: 1,
            encoding,
        }),
        Some((&other, _)) => Err(DecodeError::UnknownEncoding(other)),
    }
}

fn decode_binary(r: &mut Reader<'_>) -> Result<ActionState, DecodeError> {
    let version = r.u64()?;
    let scope = KeyScope {
        tenant: r.string()?,
        agent: r.string()?,
        key: r.string()?,
    };
    let key = StateKey {
        scope,
        sequence: r.u64()?,
        action: r.string()?,
        trigger: r.digest()?,
    };
    let trigger = r.event()?;
    let count = r.len()?;
    let mut calls = Vec::with_capacity(count.min(1024));
    for _ in 0..count {
        let function = r.string()?;
        let args_digest = r.digest()?;
        let idempotency_key = r.string()?;
        let outcome = match r.u8()? {
            0 => CallOutcome::Pending,
            1 => CallOutcome::Succeeded(r.string()?),
            2 => CallOutcome::Failed(r.string()?),
            3 if r.encoding >= 5 => {
                let until = match r.u8()? {
                    0 => None,
                    1 => Some(r.u64()?),
                    other => {
                        return Err(r.error(format!("wait's until flag {other} is not 0 or 1")));
                    }
                };
                let count = r.len()?;
                let mut signals = Vec::with_capacity(count.min(64));
                for _ in 0..count {
                    signals.push(r.string()?);
                }
                CallOutcome::Waiting(Wait { until, signals })
            }
            other => return Err(r.error(format!("call outcome {other} is not one of 0 to 3"))),
        };
        calls.push(CallRecord {
            function,
            args_digest,
            idempotency_key,
            outcome,
        });
    }
    let completion = match r.u8()? {
        0 => None,
        1 => {
            let count = r.len()?;
            let mut sent = Vec::with_capacity(count.min(1024));
            for _ in 0..count {
                sent.push(r.event()?);
            }
            let count = r.len()?;
            let mut memory = Vec::with_capacity(count.min(1024));
            for _ in 0..count {
                memory.push(MemoryWrite {
                    name: r.string()?,
                    value: r.string()?,
                });
            }
            Some(Completion { sent, memory })
        }
        other => return Err(r.error(format!("completion flag {other} is not 0 or 1"))),
    };
    let ambient = if r.encoding >= 3 {
        Ambient {
            wall: r.u64s()?,
            monotonic: r.u64s()?,
            random_key: match r.u8()? {
                0 => None,
                1 => Some(RandomKey(r.array()?)),
                other => return Err(r.error(format!("random key flag {other} is not 0 or 1"))),
            },
        }
    } else {
        Ambient::default()
    };
    let incarnation = if r.encoding >= 4 {
        match r.u8()? {
            0 => None,
            1 => Some(Incarnation(r.array()?)),
            other => return Err(r.error(format!("incarnation flag {other} is not 0 or 1"))),
        }
    } else {
        None
    };
    if r.at != r.bytes.len() {
        return Err(r.error(format!(
            "{} bytes after the end of the state",
            r.bytes.len() - r.at
        )));
    }
    Ok(ActionState {
        key,
        trigger,
        calls,
        completion,
        ambient,
        incarnation,
        version,
    })
}

struct Writer(Vec<u8>);

impl Writer {
    fn u64(&mut self, value: u64) {
        self.0.extend_from_slice(&value.to_le_bytes());
    }

    fn len(&mut self, what: &'static str, len: usize) -> Result<(), EncodeError> {
        let len32 = u32::try_from(len).map_err(|_| EncodeError { what, len })?;
        self.0.extend_from_slice(&len32.to_le_bytes());
        Ok(())
    }

    fn str(&mut self, what: &'static str, text: &str) -> Result<(), EncodeError> {
        self.len(what, text.len())?;
        self.0.extend_from_slice(text.as_bytes());
        Ok(())
    }

    fn digest(&mut self, digest: &Digest) {
        self.0.extend_from_slice(&digest.0);
    }

    fn event(&mut self, event: &Event) -> Result<(), EncodeError> {
        self.str("event kind", &event.kind)?;
        self.str("event payload", &event.payload)
    }
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
    encoding: u8,
}

impl Reader<'_> {
    fn error(&self, problem: String) -> DecodeError {
        DecodeError::Binary {
            encoding: self.encoding,
            at: self.at,
            problem,
        }
    }

    fn take(&mut self, n: usize) -> Result<&[u8], DecodeError> {
        let Some(taken) = self.bytes.get(self.at..self.at.saturating_add(n)) else {
            return Err(self.error(format!(
                "{n} bytes needed, {} left",
                self.bytes.len() - self.at.min(self.bytes.len())
            )));
        };
        self.at += n;
        Ok(taken)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        let mut array = [0u8; N];
        array.copy_from_slice(self.take(N)?);
        Ok(array)
    }

    fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.array::<1>()?[0])
    }

    fn u64(&mut self) -> Result<u64, DecodeError> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    fn len(&mut self) -> Result<usize, DecodeError> {
        let len = u32::from_le_bytes(self.array()?);
        usize::try_from(len).map_err(|_| self.error(format!("length {len} does not fit")))
    }

    fn string(&mut self) -> Result<String, DecodeError> {
        let len = self.len()?;
        let at = self.at;
        let bytes = self.take(len)?.to_vec();
        String::from_utf8(bytes).map_err(|e| DecodeError::Binary {
            encoding: self.encoding,
            at,
            problem: format!("a string that is not UTF-8: {e}"),
        })
    }

    fn u64s(&mut self) -> Result<Vec<u64>, DecodeError> {
        let count = self.len()?;
        // Bounded by what is left, so a corrupt length cannot ask for a huge allocation.
        let mut values = Vec::with_capacity(count.min((self.bytes.len() - self.at) / 8));
        for _ in 0..count {
            values.push(self.u64()?);
        }
        Ok(values)
    }

    fn digest(&mut self) -> Result<Digest, DecodeError> {
        Ok(Digest(self.array()?))
    }

    fn event(&mut self) -> Result<Event, DecodeError> {
        Ok(Event {
            kind: self.string()?,
            payload: self.string()?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::Event;
    use crate::store::{
        Ambient, CallOutcome, CallRecord, Completion, Digest, Incarnation, KeyScope, MemoryWrite,
        RandomKey, StateKey, Wait,
    };

    fn fixture(encoding: u8) -> std::path::PathBuf {
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join(format!("tests/fixtures/action-state-v{encoding}.bin"))
    }

    /// A state that uses every field, as each version wrote it to its fixture (without what
    /// versions before 3 had no place for).
    fn fixture_state_of(encoding: u8) -> ActionState {
        let mut state = fixture_state();
        if encoding < 3 {
            state.ambient = Ambient::default();
        }
        if encoding < 4 {
            state.incarnation = None;
        }
        if encoding < 5 {
            state
                .calls
                .retain(|call| !matches!(call.outcome, CallOutcome::Waiting(_)));
        }
        state
    }

    /// A state that uses every field of the current encoding.
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
                call(
                    "@signal",
                    CallOutcome::Waiting(Wait {
                        until: Some(1_796_086_400_000),
                        signals: vec!["approve".to_owned(), "reject".to_owned()],
                    }),
                ),
            ],
            completion: Some(Completion {
                sent: vec![Event::new("output", r#"{"reply":"ok"}"#)],
                memory: vec![MemoryWrite {
                    name: "seen".to_owned(),
                    value: "true".to_owned(),
                }],
            }),
            ambient: Ambient {
                wall: vec![1_796_000_000_000_000_000, 1_796_000_000_250_000_000],
                monotonic: vec![5_000, 7_500],
                random_key: Some(RandomKey([0xab; 32])),
            },
            incarnation: Some(Incarnation([0x5e; 16])),
            version: 42,
        }
    }

    #[test]
    fn every_fixture_is_still_read() {
        for encoding in 1..=ENCODING {
            let bytes = std::fs::read(fixture(encoding)).expect("the fixture is in the repository");
            assert_eq!(bytes[0], encoding, "the fixture's encoding byte");
            assert_eq!(
                decode(&bytes).expect("decodes"),
                fixture_state_of(encoding),
                "encoding {encoding}"
            );
        }
    }

    #[test]
    fn states_round_trip() {
        let state = fixture_state();
        let bytes = encode(&state).expect("encodes");
        assert_eq!(bytes[0], ENCODING);
        assert_eq!(decode(&bytes).expect("decodes"), state);
        let bare = ActionState::new(state.key.clone(), Event::new("", ""));
        assert_eq!(
            decode(&encode(&bare).expect("encodes")).expect("decodes"),
            bare
        );
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

    #[test]
    fn every_cut_of_a_binary_state_is_an_error_that_says_where() {
        let bytes = encode(&fixture_state()).expect("encodes");
        for cut in 1..bytes.len() {
            let error = decode(&bytes[..cut]).expect_err("cut short");
            assert!(
                matches!(error, DecodeError::Binary { .. }),
                "cut at {cut}: {error}"
            );
        }
        let mut longer = bytes.clone();
        longer.push(0);
        let message = decode(&longer).expect_err("trailing byte").to_string();
        assert!(message.contains("1 bytes after the end"), "{message}");
    }

    #[test]
    fn a_bad_tag_or_string_is_named() {
        let mut state = fixture_state();
        state.calls.truncate(1);
        state.completion = None;
        state.ambient = Ambient::default();
        state.incarnation = None;
        let bytes = encode(&state).expect("encodes");
        // The completion flag comes before two empty clock lists, the random key flag and
        // the incarnation flag.
        let mut bad = bytes.clone();
        let flag = bad.len() - 1 - (4 + 4 + 1 + 1);
        bad[flag] = 7;
        let message = decode(&bad).expect_err("bad flag").to_string();
        assert!(message.contains("completion flag 7"), "{message}");
        // The tenant's first byte, after the encoding, the version and the length.
        let mut bad = bytes;
        bad[1 + 8 + 4] = 0xff;
        let message = decode(&bad).expect_err("bad UTF-8").to_string();
        assert!(
            message.contains("encoding 5, at byte 13: a string that is not UTF-8"),
            "{message}"
        );
    }

    /// Writes the fixture of the current encoding. Run by hand only when adding an
    /// encoding: `cargo test -p rewind-host --lib write_fixture -- --ignored`.
    #[test]
    #[ignore = "writes the fixture file; run by hand"]
    fn write_fixture() {
        let bytes = encode(&fixture_state()).expect("encodes");
        std::fs::write(fixture(ENCODING), bytes).expect("write");
    }
}
