//! Issue #24's timer figures: a million inputs at a durable sleep, each of its own key, in
//! the per-key core (`keys::Keys`): the memory each costs, the time to arm them all (what a
//! restart does with the waits its checkpoint holds), how late their timers fire (from
//! each wait's `until` to the moment its input asks for a run slot again), and a `rewind
//! run` recovery with them pending (the checkpoint read back, then every wait armed).
//!
//! `cargo bench -p rewind-host --bench timers [-- INPUTS]` (default 1,000,000); results in
//! BENCHMARKS.md.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use rewind_host::agent::{Agent, InputError, InputReport, Memory, Waiting};
use rewind_host::checkpoint::{Checkpoint, CheckpointStore, FileCheckpoints, PendingInput};
use rewind_host::durable::unix_ms;
use rewind_host::event::Input;
use rewind_host::keys::{Ending, Front, HostFault, Keys, Next, Queued, Refusal};
use rewind_host::store::{Marker, Wait};

#[allow(dead_code)]
mod common;

/// Records when each woken input asks for a run slot, and gives it none: the input stays
/// first in its key, and nothing runs.
#[derive(Debug, Default)]
struct Stopwatch {
    woke: Mutex<Vec<(u64, SystemTime)>>,
}

#[async_trait]
impl Front for Stopwatch {
    type Key = u64;
    type Extra = ();
    type Slot = ();

    async fn slot(&self, key: &u64) -> Option<()> {
        let now = SystemTime::now();
        self.woke.lock().expect("lock").push((*key, now));
        None
    }

    async fn agent(&self, _: &u64, _: &Queued<()>) -> Result<Arc<Agent>, HostFault> {
        Err(HostFault::new("the bench runs nothing", "no agent"))
    }

    async fn completed(&self, _: &u64, _: &Queued<()>, _: InputReport) -> Result<(), Refusal> {
        Ok(())
    }

    async fn failed(&self, _: &u64, _: &Queued<()>, _: InputReport, _: InputError, _: Next) {}

    async fn stopped(&self, _: &u64, _: &Queued<()>, _: &HostFault) {}

    async fn waiting(&self, _: &u64, _: &Queued<()>, _: Option<&Waiting>, _: InputReport) {}

    async fn ended(
        &self,
        _: &u64,
        _: &Queued<()>,
        _: &Memory,
        _: Ending<'_>,
    ) -> Result<(), HostFault> {
        Ok(())
    }

    async fn retried(&self, _: &u64, _: &Queued<()>, _: &str) -> Result<(), HostFault> {
        Ok(())
    }
}

/// The process's resident memory, in bytes.
fn rss() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

/// Input `n` waiting until `until`: one action's sleep.
fn waiting(n: u64, until: u64) -> (Queued<()>, Waiting) {
    let queued = Queued {
        input: Input {
            key: format!("k{n}"),
            sequence: 1,
            payload: "{}".to_owned(),
        },
        extra: (),
    };
    let waiting = Waiting {
        action: "remind".to_owned(),
        wait: Wait {
            until: Some(until),
            signals: Vec::new(),
        },
    };
    (queued, waiting)
}

fn quantile(sorted: &[u64], percent: usize) -> u64 {
    sorted[(sorted.len() * percent / 100).min(sorted.len() - 1)]
}

fn main() {
    let inputs: u64 = std::env::args()
        .skip(1)
        .find(|a| !a.starts_with('-'))
        .and_then(|a| a.parse().ok())
        .unwrap_or(1_000_000);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async move {
        let front = Arc::new(Stopwatch::default());
        let keys = Keys::new(Arc::clone(&front));
        // Due from 10 s after arming began (after it ended: arming a million takes about
        // 4 s here) to 20 s after, spread evenly.
        let start = unix_ms(SystemTime::now()) + 10_000;
        let until = |n: u64| start + n * 10_000 / inputs.max(1);
        let before = rss();
        let armed = Instant::now();
        for n in 0..inputs {
            let (queued, wait) = waiting(n, until(n));
            keys.restore_waiting(n, queued, wait);
        }
        let arm = armed.elapsed();
        let per_timer = rss().saturating_sub(before) / inputs.max(1);
        println!(
            "armed {inputs} waiting inputs in {arm:.2?} ({:.0} per second); {per_timer} bytes \
             each (resident, the core's key, queue entry and timer)",
            inputs as f64 / arm.as_secs_f64()
        );

        let deadline = Instant::now() + Duration::from_secs(60);
        let all = usize::try_from(inputs).expect("a count that fits");
        while front.woke.lock().expect("lock").len() < all {
            assert!(
                Instant::now() < deadline,
                "not every timer fired within a minute"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let woke = std::mem::take(&mut *front.woke.lock().expect("lock"));
        let mut late: Vec<u64> = woke
            .iter()
            .map(|(n, at)| {
                let due = until(*n);
                let at = at
                    .duration_since(UNIX_EPOCH)
                    .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX));
                at.saturating_sub(due * 1000)
            })
            .collect();
        late.sort_unstable();
        let early = woke
            .iter()
            .filter(|(n, at)| unix_ms(*at) < until(*n))
            .count();
        println!(
            "fired: lateness p50 {} µs, p99 {} µs, max {} µs; {early} before their time",
            quantile(&late, 50),
            quantile(&late, 99),
            late.last().copied().unwrap_or(0),
        );
        drop(keys);

        // `rewind run`'s recovery: a checkpoint holding them, read back, then armed.
        let dir = tempfile::tempdir().expect("tempdir");
        let checkpoints = FileCheckpoints::new(dir.path().join("checkpoints"));
        let far = unix_ms(SystemTime::now()) + 3_600_000;
        let pending: Vec<PendingInput> = (0..inputs)
            .map(|n| {
                let (queued, wait) = waiting(n, far);
                PendingInput {
                    key: queued.input.key,
                    sequence: 1,
                    payload: queued.input.payload,
                    parked: None,
                    waiting: Some(wait),
                }
            })
            .collect();
        let checkpoint = Checkpoint {
            id: 1,
            input_position: inputs,
            keys: BTreeMap::new(),
            pending,
            marker: Marker::default(),
            output_position: None,
            skipped: Vec::new(),
        };
        let saved = Instant::now();
        checkpoints.save(&checkpoint, 3).await.expect("saved");
        let save = saved.elapsed();
        let size: u64 = std::fs::read_dir(dir.path().join("checkpoints"))
            .expect("dir")
            .filter_map(|e| e.ok()?.metadata().ok())
            .map(|m| m.len())
            .sum();
        drop(checkpoint);
        let recovered = Instant::now();
        let latest = checkpoints.latest().await.expect("read").expect("one");
        let read = recovered.elapsed();
        let keys = Keys::new(Arc::new(Stopwatch::default()));
        for (n, pending) in latest.pending.into_iter().enumerate() {
            let queued = Queued {
                input: Input {
                    key: pending.key,
                    sequence: pending.sequence,
                    payload: pending.payload,
                },
                extra: (),
            };
            let wait = pending.waiting.expect("a wait");
            keys.restore_waiting(n as u64, queued, wait);
        }
        let recovery = recovered.elapsed();
        println!(
            "checkpoint with {inputs} waits: {:.1} MB, saved in {save:.2?}; recovery (read, \
             then armed) {recovery:.2?}, of which reading {read:.2?}",
            size as f64 / 1e6
        );
        drop(keys);
    });
}
