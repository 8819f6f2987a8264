//! How long to wait before trying again: exponential backoff with full jitter (a random wait
//! between 0 and the exponential bound, so that many callers failing together do not come
//! back together), and a server's `Retry-After`. One mechanism for an input's retries (the
//! per-key core) and a function's (its requests to a remote).

use std::time::{Duration, SystemTime};

use rand::Rng as _;

/// The bounds of an exponential backoff.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Backoff {
    /// The bound on the first wait.
    pub initial: Duration,
    /// The bound on any wait.
    pub max: Duration,
}

impl Backoff {
    /// The bounds `initial_ms` and `max_ms`, in milliseconds, as configuration gives them.
    pub fn from_millis(initial_ms: u64, max_ms: u64) -> Self {
        Self {
            initial: Duration::from_millis(initial_ms),
            max: Duration::from_millis(max_ms),
        }
    }

    /// The exponential bound on the wait after `attempt` failed attempts (from 1):
    /// `min(max, initial × 2^(attempt − 1))`.
    pub fn bound(&self, attempt: u32) -> Duration {
        let doublings = attempt.saturating_sub(1).min(31);
        self.initial.saturating_mul(1u32 << doublings).min(self.max)
    }

    /// The wait after `attempt` failed attempts: uniform in `[0, bound(attempt)]`.
    pub fn delay(&self, attempt: u32) -> Duration {
        let bound = self.bound(attempt);
        if bound.is_zero() {
            return Duration::ZERO;
        }
        let nanos = u64::try_from(bound.as_nanos()).unwrap_or(u64::MAX);
        Duration::from_nanos(rand::rng().random_range(0..=nanos))
    }
}

/// The longest wait a `Retry-After` is taken to ask for: a day. A remote's value is
/// outside input; a longer one is read as this (and ends retries at any deadline below it).
pub const MAX_RETRY_AFTER: Duration = Duration::from_secs(24 * 60 * 60);

/// A `Retry-After` header's value as a wait from `now`: delay-seconds (`120`) or an
/// HTTP-date (`Wed, 21 Oct 2026 07:28:00 GMT`; a date already past is no wait), at most
/// [`MAX_RETRY_AFTER`]. `None` when it is neither.
pub fn retry_after(value: &str, now: SystemTime) -> Option<Duration> {
    let value = value.trim();
    let wait = match value.parse::<u64>() {
        Ok(seconds) => Duration::from_secs(seconds),
        Err(_) => {
            let at = httpdate::parse_http_date(value).ok()?;
            at.duration_since(now).unwrap_or(Duration::ZERO)
        }
    };
    Some(wait.min(MAX_RETRY_AFTER))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bound_doubles_from_initial_up_to_max() {
        let backoff = Backoff {
            initial: Duration::from_millis(100),
            max: Duration::from_secs(1),
        };
        let bounds: Vec<u128> = (1..=6).map(|a| backoff.bound(a).as_millis()).collect();
        assert_eq!(bounds, [100, 200, 400, 800, 1000, 1000]);
        assert_eq!(backoff.bound(80), Duration::from_secs(1), "no overflow");
    }

    #[test]
    fn waits_are_spread_over_the_whole_range_below_the_bound() {
        let backoff = Backoff {
            initial: Duration::from_secs(1),
            max: Duration::from_secs(60),
        };
        let waits: Vec<Duration> = (0..2000).map(|_| backoff.delay(2)).collect();
        assert!(waits.iter().all(|wait| *wait <= Duration::from_secs(2)));
        // Full jitter: waits fall in every quarter of [0, 2] s, the lowest included.
        for quarter in 0..4u64 {
            let low = Duration::from_millis(quarter * 500);
            let high = low + Duration::from_millis(500);
            assert!(
                waits.iter().any(|w| (low..high).contains(w)),
                "no wait in [{low:?}, {high:?})"
            );
        }
        let zero = Backoff {
            initial: Duration::ZERO,
            max: Duration::ZERO,
        };
        assert_eq!(zero.delay(3), Duration::ZERO);
    }

    #[test]
    fn retry_after_is_seconds_or_an_http_date() {
        let now = httpdate::parse_http_date("Wed, 21 Oct 2026 07:28:00 GMT").expect("a date");
        let after = |value| retry_after(value, now);
        assert_eq!(after("120"), Some(Duration::from_secs(120)));
        assert_eq!(after(" 0 "), Some(Duration::ZERO));
        assert_eq!(
            after("Wed, 21 Oct 2026 07:28:30 GMT"),
            Some(Duration::from_secs(30))
        );
        assert_eq!(after("Wed, 21 Oct 2026 07:00:00 GMT"), Some(Duration::ZERO));
        assert_eq!(after("18446744073709551615"), Some(MAX_RETRY_AFTER));
        assert_eq!(after("soon"), None);
        assert_eq!(after("-5"), None);
    }
}
