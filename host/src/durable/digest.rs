//! Digests that identify calls and triggers across replays.

use sha2::{Digest as _, Sha256};

use crate::store::{ActionState, Digest, StateKey};

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

/// The idempotency key of a call made live: the call at `index` of `state`, to `function`
/// with args of digest `args`.
///
/// The same call of the same state gets the same key on every replay, so the remote side
/// can drop a repeat; any other call gets another: another state, another index, another
/// function or other args (a replay that diverged from its records), or the same work in
/// another incarnation of the state (a wiped state directory, a tenant or a cluster made
/// again). A state written by a build before incarnations has none, and its calls keep the
/// key that build made ([`key_of_state_and_index`]), so a call it left in doubt is made
/// again under the key the remote side already saw.
pub fn idempotency_key(state: &ActionState, index: usize, function: &str, args: &Digest) -> String {
    let Some(incarnation) = &state.incarnation else {
        return key_of_state_and_index(&state.key, index);
    };
    // SHA-256 over a tag, then each part of variable length after its length, then the
    // parts of fixed length as they are: unambiguous, and in three blocks for names of
    // ordinary length (a key is made at every live call).
    let key = &state.key;
    let mut hasher = Sha256::new();
    hasher.update(b"rewind call");
    for part in [
        key.scope.tenant.as_str(),
        &key.scope.agent,
        &key.scope.key,
        &key.action,
        function,
    ] {
        hasher.update((part.len() as u64).to_le_bytes());
        hasher.update(part.as_bytes());
    }
    hasher.update(key.sequence.to_le_bytes());
    hasher.update(key.trigger.0);
    hasher.update(incarnation.0);
    hasher.update((index as u64).to_le_bytes());
    hasher.update(args.0);
    key_text(&Digest(hasher.finalize().into()))
}

/// The key that builds before incarnations gave the call at `index` of the state at
/// `key`, whatever the call: kept for the states they wrote.
pub fn key_of_state_and_index(key: &StateKey, index: usize) -> String {
    key_text(&state_digest(key, &(index as u64).to_le_bytes()))
}

/// `rw-` and the first 16 bytes of `digest` in hex.
fn key_text(digest: &Digest) -> String {
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
    use crate::store::Incarnation;

    #[test]
    fn args_digest_ignores_key_order_and_whitespace() {
        let a = args_digest(r#"{"a":1,"b":[1,2]}"#).expect("valid");
        let b = args_digest(r#"{ "b": [1, 2], "a": 1 }"#).expect("valid");
        assert_eq!(a, b);
        let c = args_digest(r#"{"a":1,"b":[2,1]}"#).expect("valid");
        assert_ne!(a, c);
    }

    fn state_key() -> StateKey {
        StateKey {
            scope: crate::store::KeyScope::new("acme", "support", "order-7"),
            sequence: 3,
            action: "triage".to_owned(),
            trigger: Digest::of(&[b"input"]),
        }
    }

    /// The remote side drops repeats by this key, so a host upgrade must not change it: a
    /// state an earlier build wrote (no incarnation) keeps that build's keys.
    #[test]
    fn idempotency_keys_are_the_same_in_every_version() {
        let state = ActionState::new(state_key(), crate::event::Event::new("input", "{}"));
        assert_eq!(state.incarnation, None);
        let args = args_digest("{}").expect("valid");
        assert_eq!(
            idempotency_key(&state, 0, "llm.chat", &args),
            "rw-f580376cdb27b2609179f592ce96723a"
        );
        assert_eq!(
            idempotency_key(&state, 1, "payments.charge", &args),
            "rw-43d942273dce3fcbb7f4a289b71bea59"
        );
    }

    /// The keys of states with an incarnation, pinned: same state and call, same key, in
    /// this build and every later one.
    #[test]
    fn idempotency_keys_of_an_incarnation_are_the_same_in_every_version() {
        let mut state = ActionState::new(state_key(), crate::event::Event::new("input", "{}"));
        state.incarnation = Some(Incarnation([0x5e; 16]));
        let five = args_digest(r#"{"amount":5}"#).expect("valid");
        assert_eq!(
            idempotency_key(&state, 0, "payments.charge", &five),
            "rw-0ed9c9e06b32d5ab4308ec8cb2d4468a"
        );
    }

    #[test]
    fn a_key_names_the_call_and_the_incarnation() {
        let mut state = ActionState::new(state_key(), crate::event::Event::new("input", "{}"));
        state.incarnation = Some(Incarnation([1; 16]));
        let five = args_digest(r#"{"amount":5}"#).expect("valid");
        let seven = args_digest(r#"{"amount":7}"#).expect("valid");
        let key = idempotency_key(&state, 0, "payments.charge", &five);
        assert_eq!(key, idempotency_key(&state, 0, "payments.charge", &five));
        assert_ne!(key, idempotency_key(&state, 0, "payments.charge", &seven));
        assert_ne!(key, idempotency_key(&state, 0, "payments.refund", &five));
        assert_ne!(key, idempotency_key(&state, 1, "payments.charge", &five));
        let mut other = state.clone();
        other.incarnation = Some(Incarnation([2; 16]));
        assert_ne!(key, idempotency_key(&other, 0, "payments.charge", &five));
    }

    #[test]
    fn args_digest_rejects_invalid_json() {
        assert!(args_digest("{not json").is_err());
    }
}
