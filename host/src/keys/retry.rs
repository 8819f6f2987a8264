//! How long a failed input waits before its next attempt: exponential backoff with full
//! jitter (a random wait between 0 and the exponential bound), so that many keys failing
//! together do not retry together.

use std::time::Duration;

use rand::Rng as _;

use crate::agent::RetryConfig;

/// The wait before attempt `attempt + 1`, after `attempt` attempts (from 1) have failed:
/// uniform in `[0, min(max, initial × 2^(attempt − 1))]`.
pub fn delay(config: &RetryConfig, attempt: u32) -> Duration {
    let bound = bound(config, attempt);
    if bound == 0 {
        return Duration::ZERO;
    }
    Duration::from_millis(rand::rng().random_range(0..=bound))
}

/// The exponential bound, in milliseconds, on the wait after `attempt` failed attempts.
fn bound(config: &RetryConfig, attempt: u32) -> u64 {
    let doublings = attempt.saturating_sub(1).min(63);
    config
        .initial_ms
        .saturating_mul(1u64 << doublings)
        .min(config.max_ms)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bound_doubles_from_initial_up_to_max() {
        let config = RetryConfig {
            attempts: 100,
            initial_ms: 100,
            max_ms: 1000,
        };
        let bounds: Vec<u64> = (1..=6).map(|attempt| bound(&config, attempt)).collect();
        assert_eq!(bounds, [100, 200, 400, 800, 1000, 1000]);
        assert_eq!(bound(&config, 80), 1000, "no overflow after many attempts");
    }

    #[test]
    fn waits_are_spread_over_the_whole_range_below_the_bound() {
        let config = RetryConfig {
            attempts: 3,
            initial_ms: 1000,
            max_ms: 60_000,
        };
        let waits: Vec<Duration> = (0..2000).map(|_| delay(&config, 2)).collect();
        assert!(
            waits
                .iter()
                .all(|wait| *wait <= Duration::from_millis(2000))
        );
        // Full jitter: waits fall in every quarter of [0, 2000] ms, the lowest included.
        for quarter in 0..4u64 {
            let low = Duration::from_millis(quarter * 500);
            let high = low + Duration::from_millis(500);
            assert!(
                waits.iter().any(|w| (low..high).contains(w)),
                "no wait in [{low:?}, {high:?})"
            );
        }
        let zero = RetryConfig {
            initial_ms: 0,
            max_ms: 0,
            ..config
        };
        assert_eq!(delay(&zero, 3), Duration::ZERO);
    }
}
