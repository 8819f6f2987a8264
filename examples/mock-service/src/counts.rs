//! The call counters: the mock's record of which calls reached it, and how often.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use serde::{Deserialize, Serialize};

/// A snapshot of the calls the mock has received since it started or was last reset.
///
/// This is also the body of `GET /counts`, so a client can deserialize that response into it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counts {
    /// Counted calls (every `POST` except `/counts/reset`), including rejected ones.
    pub total: u64,
    /// Calls per request path, e.g. `"/tools/orders.lookup"`.
    pub by_route: BTreeMap<String, u64>,
    /// Calls per `Idempotency-Key` header value.
    pub by_idempotency_key: BTreeMap<String, u64>,
    /// Calls that carried no `Idempotency-Key` header.
    pub without_key: u64,
    /// Calls that carried an `Authorization` header (its value is neither checked nor kept).
    pub with_authorization: u64,
    /// The idempotency keys seen more than once, in sorted order: calls that were not
    /// exactly-once. Empty when every keyed call reached the mock once.
    pub repeated_keys: Vec<String>,
}

impl Counts {
    /// How many calls had this `Idempotency-Key` (0 if none).
    pub fn for_key(&self, key: &str) -> u64 {
        self.by_idempotency_key.get(key).copied().unwrap_or(0)
    }

    /// How many calls were made to this path (0 if none), e.g. `"/v1/chat/completions"`.
    pub fn for_route(&self, route: &str) -> u64 {
        self.by_route.get(route).copied().unwrap_or(0)
    }
}

/// The state shared by every request the mock serves: its call counters.
///
/// Cloning gives another handle to the same counters.
#[derive(Debug, Clone, Default)]
pub struct MockState {
    tally: Arc<Mutex<Tally>>,
    /// Per (tool route, idempotency key): the answer the call got, or `None` while it runs.
    answers: Arc<Mutex<Answers>>,
}

type Answers = BTreeMap<(String, String), Option<Answer>>;

/// What a tool call answered: its status and body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Answer {
    pub status: u16,
    pub body: axum::body::Bytes,
}

/// What a reconcile question learns of a call (`GET /tools/NAME/status`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Seen {
    Never,
    Running,
    Answered(Answer),
}

#[derive(Debug, Default)]
struct Tally {
    total: u64,
    by_route: BTreeMap<String, u64>,
    by_key: BTreeMap<String, u64>,
    without_key: u64,
    with_authorization: u64,
}

impl MockState {
    /// Fresh state with every counter at zero.
    pub fn new() -> Self {
        Self::default()
    }

    /// A snapshot of the counters.
    pub fn counts(&self) -> Counts {
        snapshot(&self.lock())
    }

    /// Sets every counter back to zero and returns the counts as they were just before, so
    /// that no call can fall between reading and resetting.
    pub fn reset(&self) -> Counts {
        let mut tally = self.lock();
        let before = snapshot(&tally);
        *tally = Tally::default();
        before
    }

    /// Records one call to `route`; how many calls its idempotency key has had, this one
    /// included (0 without a key).
    pub(crate) fn record(
        &self,
        route: &str,
        idempotency_key: Option<&str>,
        authorized: bool,
    ) -> u64 {
        let mut tally = self.lock();
        tally.total += 1;
        *tally.by_route.entry(route.to_owned()).or_default() += 1;
        if authorized {
            tally.with_authorization += 1;
        }
        match idempotency_key {
            Some(key) => {
                let calls = tally.by_key.entry(key.to_owned()).or_default();
                *calls += 1;
                *calls
            }
            None => {
                tally.without_key += 1;
                0
            }
        }
    }

    /// A call of `route` under `key` has started.
    pub(crate) fn started(&self, route: &str, key: &str) {
        let mut answers = self.answers.lock().unwrap_or_else(PoisonError::into_inner);
        answers
            .entry((route.to_owned(), key.to_owned()))
            .or_insert(None);
    }

    /// A call of `route` under `key` answered `answer` (the first answer of a key is kept).
    pub(crate) fn answered(&self, route: &str, key: &str, answer: Answer) {
        let mut answers = self.answers.lock().unwrap_or_else(PoisonError::into_inner);
        let slot = answers
            .entry((route.to_owned(), key.to_owned()))
            .or_insert(None);
        if slot.is_none() {
            *slot = Some(answer);
        }
    }

    /// What became of the call of `route` under `key`.
    pub(crate) fn seen(&self, route: &str, key: &str) -> Seen {
        let answers = self.answers.lock().unwrap_or_else(PoisonError::into_inner);
        match answers.get(&(route.to_owned(), key.to_owned())) {
            None => Seen::Never,
            Some(None) => Seen::Running,
            Some(Some(answer)) => Seen::Answered(answer.clone()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Tally> {
        // Every update is a few integer bumps that cannot leave the tally half-written, so a
        // panic elsewhere while the lock was held does not make the counts untrustworthy.
        self.tally.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

fn snapshot(tally: &Tally) -> Counts {
    Counts {
        total: tally.total,
        by_route: tally.by_route.clone(),
        by_idempotency_key: tally.by_key.clone(),
        without_key: tally.without_key,
        with_authorization: tally.with_authorization,
        repeated_keys: tally
            .by_key
            .iter()
            .filter(|(_, calls)| **calls > 1)
            .map(|(key, _)| key.clone())
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_per_key_and_lists_repeats() {
        let state = MockState::new();
        state.record("/a", Some("k1"), false);
        state.record("/a", Some("k1"), true);
        state.record("/b", Some("k2"), false);
        state.record("/b", None, false);

        let counts = state.counts();
        assert_eq!(counts.total, 4);
        assert_eq!(counts.for_key("k1"), 2);
        assert_eq!(counts.for_key("k2"), 1);
        assert_eq!(counts.for_key("absent"), 0);
        assert_eq!(counts.for_route("/a"), 2);
        assert_eq!(counts.without_key, 1);
        assert_eq!(counts.with_authorization, 1);
        assert_eq!(counts.repeated_keys, vec!["k1".to_owned()]);
    }

    #[test]
    fn reset_returns_the_old_counts_and_zeroes() {
        let state = MockState::new();
        state.record("/a", Some("k1"), false);
        assert_eq!(state.reset().total, 1);
        assert_eq!(state.counts(), Counts::default());
    }
}
