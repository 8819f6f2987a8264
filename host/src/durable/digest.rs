//! Digests that identify calls and triggers across replays.

use crate::store::{Digest, StateKey};

/// The digest of a call's args: of their canonical JSON (object keys sorted, no
/// whitespace), so that `{"a":1,"b":2}` and `{ "b": 2, "a": 1 }` are the same call.
pub fn args_digest(args: &str) -> Result<Digest, serde_json::Error> {
    Ok(Digest::of(&[canonical_json(args)?.as_bytes()]))
}

/// `json` with object keys sorted and no whitespace.
fn canonical_json(json: &str) -> Result<String, serde_json::Error> {
    // serde_json's map is ordered by key (the `preserve_order` feature is off), so printing
    // the parsed value is canonical.
    serde_json::from_str::<serde_json::Value>(json).map(|value| value.to_string())
}

/// The idempotency key of the call at `index` of the state at `key`: the same on every
/// replay, different for every other call.
pub fn idempotency_key(key: &StateKey, index: usize) -> String {
    let digest = state_digest(key, &(index as u64).to_le_bytes());
    // Made at every durable call: written into one buffer, not through `hex::encode`'s
    // iterator of chars.
    let mut text = *b"rw-00000000000000000000000000000000";
    hex::encode_to_slice(&digest.0[..16], &mut text[3..]).expect("32 hex digits fit");
    String::from_utf8(text.to_vec()).expect("hex digits are UTF-8")
}

/// The digest of every field of `key`, then `tail`.
pub(crate) fn state_digest(key: &StateKey, tail: &[u8]) -> Digest {
    Digest::of(&[
        key.scope.tenant.as_bytes(),
        key.scope.agent.as_bytes(),
        key.scope.key.as_bytes(),
        &key.sequence.to_le_bytes(),
        key.action.as_bytes(),
        &key.trigger.0,
        tail,
    ])
}

/// The trigger digest of an input's own event, whose payload is `payload` (JSON text).
///
/// The payload is part of it, so that a different input under the same key and sequence
/// (an edited input file run again) does not find the first input's records.
pub fn input_trigger(payload: &str) -> Digest {
    let canonical = canonical_json(payload).unwrap_or_else(|_| payload.to_owned());
    Digest::of(&[b"input", canonical.as_bytes()])
}

/// The trigger digest of the `index`-th event sent by the action state at `parent`.
pub fn sent_trigger(parent: &StateKey, index: usize) -> Digest {
    Digest::of(&[
        b"sent",
        parent.action.as_bytes(),
        &parent.trigger.0,
        &(index as u64).to_le_bytes(),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn args_digest_ignores_key_order_and_whitespace() {
        let a = args_digest(r#"{"a":1,"b":[1,2]}"#).expect("valid");
        let b = args_digest(r#"{ "b": [1, 2], "a": 1 }"#).expect("valid");
        assert_eq!(a, b);
        let c = args_digest(r#"{"a":1,"b":[2,1]}"#).expect("valid");
        assert_ne!(a, c);
    }

    /// The remote side drops repeats by this key, so a host upgrade must not change it.
    #[test]
    fn idempotency_keys_are_the_same_in_every_version() {
        let key = StateKey {
            scope: crate::store::KeyScope::new("acme", "support", "order-7"),
            sequence: 3,
            action: "triage".to_owned(),
            trigger: Digest::of(&[b"input"]),
        };
        assert_eq!(
            idempotency_key(&key, 0),
            "rw-f580376cdb27b2609179f592ce96723a"
        );
        assert_eq!(
            idempotency_key(&key, 1),
            "rw-43d942273dce3fcbb7f4a289b71bea59"
        );
    }

    #[test]
    fn args_digest_rejects_invalid_json() {
        assert!(args_digest("{not json").is_err());
    }
}
