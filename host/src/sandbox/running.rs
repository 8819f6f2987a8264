//! A run's running time, which its `timeout-ms` bounds: the wall-clock time since it
//! started, less the time it spent inside durable calls. A call is bounded on its own, by
//! its function's request timeout and retries (`timeout-ms` and `retry` of the function), so
//! a model that takes a minute to answer does not time out the run that asked it, and the
//! run's own time stays bounded (its CPU by fuel, too).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

#[derive(Debug)]
pub(super) struct RunningTime {
    started: Instant,
    calls: Mutex<Calls>,
    left_call: Notify,
}

#[derive(Debug, Default)]
struct Calls {
    /// Time spent in calls that returned.
    spent: Duration,
    /// When the call in progress began.
    since: Option<Instant>,
}

impl RunningTime {
    pub(super) fn start() -> Arc<Self> {
        Arc::new(Self {
            started: Instant::now(),
            calls: Mutex::new(Calls::default()),
            left_call: Notify::new(),
        })
    }

    fn calls(&self) -> std::sync::MutexGuard<'_, Calls> {
        self.calls.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Marks a durable call in progress until the guard is dropped: its time is not the
    /// run's.
    pub(super) fn in_call(self: &Arc<Self>) -> InCall {
        self.calls().since = Some(Instant::now());
        InCall(Arc::clone(self))
    }

    /// Resolves once the run has run for `limit`, not counting its calls; never while a
    /// call is in progress.
    pub(super) async fn reached(&self, limit: Duration) {
        loop {
            // Made before the look, so that a call that ends after it still wakes this.
            let left = self.left_call.notified();
            let (spent, in_call) = {
                let calls = self.calls();
                (calls.spent, calls.since.is_some())
            };
            if in_call {
                left.await;
                continue;
            }
            let deadline = self.started + limit + spent;
            if Instant::now() >= deadline {
                return;
            }
            tokio::select! {
                () = tokio::time::sleep_until(deadline) => {}
                () = left => {}
            }
        }
    }
}

/// A durable call in progress ([`RunningTime::in_call`]).
#[derive(Debug)]
pub(super) struct InCall(Arc<RunningTime>);

impl Drop for InCall {
    fn drop(&mut self) {
        {
            let mut calls = self.0.calls();
            if let Some(since) = calls.since.take() {
                calls.spent += since.elapsed();
            }
        }
        self.0.left_call.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn time_in_calls_is_not_the_runs() {
        let running = RunningTime::start();
        let limit = Duration::from_secs(1);
        tokio::time::sleep(Duration::from_millis(600)).await;
        {
            let _call = running.in_call();
            // A call far longer than the limit: the limit is not reached meanwhile.
            let reached = tokio::time::timeout(Duration::from_secs(60), running.reached(limit));
            assert!(reached.await.is_err(), "reached during a call");
        }
        let before = Instant::now();
        running.reached(limit).await;
        // 600 ms ran before the call, so 400 ms are left after it.
        assert_eq!(before.elapsed(), Duration::from_millis(400));
    }
}
