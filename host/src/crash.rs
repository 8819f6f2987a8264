//! Crash points: named places on the durable path where a test can kill the process.
//!
//! A process is armed with one point and a count, from `REWIND_CRASH_AT=POINT[:N]` (which
//! `rewind run` and `rewind test` read at start; `serve` and `cluster` refuse to start with
//! it set) or with [`arm`] (`--crash-at` of `rewind serve` and `rewind cluster run`,
//! honoured only by a build with the `test-hooks` feature: [`HOOKS`]). The `N`th time that
//! point is reached, the process sends itself SIGKILL: no destructor runs, no buffer is
//! flushed, no file is closed, exactly as if the machine's operator had killed it there.
//! Unarmed, a point costs one atomic load.
//!
//! The points mark the durable boundaries (docs/SEMANTICS.md, "The durable call" and
//! "Checkpoints and recovery"), so a test can kill a run at each of them rather than at a
//! random moment and hope to land on one.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// The environment variable that arms the `rewind` binary: `POINT[:N]`.
pub const ENV: &str = "REWIND_CRASH_AT";

/// The environment variable that makes the `rewind` binary count the points it reaches and
/// write the counts, as JSON, to the file it names when it exits.
pub const COUNT_ENV: &str = "REWIND_CRASH_COUNT";

/// A durable boundary where a process can be killed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum CrashPoint {
    /// A durable call missed its record and is about to reach its function.
    BeforeCall,
    /// A streamed answer's first chunk is read; the rest is not (the call is cut mid-way).
    MidStream,
    /// The function answered; its record is not yet written.
    AfterCall,
    /// The call's record is durable; the guest has not seen the result.
    AfterRecord,
    /// A durable wait is recorded as waiting; the run has not stopped at it.
    AtWait,
    /// What ended a durable wait is recorded; the guest has not seen it.
    AtWake,
    /// A `refresh` checkpoint re-appended one batch of cached states, durably, and has
    /// more to go or has not yet returned its marker.
    CheckpointRefresh,
    /// A checkpoint's file is written and synced under its temporary name, not yet renamed.
    CheckpointSave,
    /// A checkpoint is saved; pruning and retention have not run.
    CheckpointSaved,
    /// The log writer is about to write a batch: half of its first record reaches the
    /// segment file (synced), and the process dies, leaving a torn tail.
    TornWrite,
}

impl CrashPoint {
    pub const ALL: [CrashPoint; 10] = [
        CrashPoint::BeforeCall,
        CrashPoint::MidStream,
        CrashPoint::AfterCall,
        CrashPoint::AfterRecord,
        CrashPoint::AtWait,
        CrashPoint::AtWake,
        CrashPoint::CheckpointRefresh,
        CrashPoint::CheckpointSave,
        CrashPoint::CheckpointSaved,
        CrashPoint::TornWrite,
    ];

    pub fn name(self) -> &'static str {
        match self {
            CrashPoint::BeforeCall => "before-call",
            CrashPoint::MidStream => "mid-stream",
            CrashPoint::AfterCall => "after-call",
            CrashPoint::AfterRecord => "after-record",
            CrashPoint::AtWait => "at-wait",
            CrashPoint::AtWake => "at-wake",
            CrashPoint::CheckpointRefresh => "checkpoint-refresh",
            CrashPoint::CheckpointSave => "checkpoint-save",
            CrashPoint::CheckpointSaved => "checkpoint-saved",
            CrashPoint::TornWrite => "torn-write",
        }
    }
}

impl fmt::Display for CrashPoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A crash point and how many times it is reached before the process is killed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Crash {
    pub point: CrashPoint,
    /// Killed when the point is reached for the `nth` time (from 1).
    pub nth: u64,
}

impl fmt::Display for Crash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.point, self.nth)
    }
}

#[derive(Debug, thiserror::Error)]
#[error(
    "{given:?}: {problem}; expected POINT or POINT:N with N ≥ 1, POINT one of {}",
    CrashPoint::ALL.map(CrashPoint::name).join(", ")
)]
pub struct ParseCrashError {
    given: String,
    problem: String,
}

impl FromStr for Crash {
    type Err = ParseCrashError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let error = |problem: String| ParseCrashError {
            given: text.to_owned(),
            problem,
        };
        let (name, nth) = match text.split_once(':') {
            Some((name, nth)) => {
                let nth: u64 = nth
                    .parse()
                    .map_err(|_| error(format!("`{nth}` is not a count")))?;
                (name, nth)
            }
            None => (text, 1),
        };
        if nth == 0 {
            return Err(error("the count starts at 1".to_owned()));
        }
        let point = CrashPoint::ALL
            .into_iter()
            .find(|p| p.name() == name)
            .ok_or_else(|| error(format!("no crash point is named `{name}`")))?;
        Ok(Crash { point, nth })
    }
}

struct Armed {
    crash: Crash,
    reached: AtomicU64,
}

static ARMED: OnceLock<Armed> = OnceLock::new();

/// Whether this build honours `--crash-at` of `rewind serve` and `rewind cluster run`: only
/// one with the `test-hooks` feature (the tests' build, through their dev-dependency), never
/// a release.
pub const HOOKS: bool = cfg!(feature = "test-hooks");

/// Arms this process: it is killed the `crash.nth` time `crash.point` is reached. A process
/// is armed at most once; a second call returns `false` and changes nothing.
pub fn arm(crash: Crash) -> bool {
    ARMED
        .set(Armed {
            crash,
            reached: AtomicU64::new(0),
        })
        .is_ok()
}

/// Arms this process from [`ENV`], when it is set. Returns what was armed.
pub fn arm_from_env() -> Result<Option<Crash>, ParseCrashError> {
    let Ok(text) = std::env::var(ENV) else {
        return Ok(None);
    };
    let crash: Crash = text.parse()?;
    arm(crash);
    Ok(Some(crash))
}

static COUNTING: AtomicBool = AtomicBool::new(false);
static COUNTS: [AtomicU64; CrashPoint::ALL.len()] =
    [const { AtomicU64::new(0) }; CrashPoint::ALL.len()];

/// Starts counting the points this process reaches (see [`counts`]).
pub fn count() {
    COUNTING.store(true, Ordering::SeqCst);
}

/// How many times each point was reached since [`count`].
pub fn counts() -> BTreeMap<String, u64> {
    CrashPoint::ALL
        .iter()
        .zip(&COUNTS)
        .map(|(point, n)| (point.name().to_owned(), n.load(Ordering::SeqCst)))
        .collect()
}

/// Marks that `point` is reached; kills the process if it is armed there and this is the
/// time.
pub fn reached(point: CrashPoint) {
    reached_then(point, || {});
}

/// [`reached`], running `last` just before the process is killed.
pub fn reached_then(point: CrashPoint, last: impl FnOnce()) {
    if COUNTING.load(Ordering::Relaxed) {
        COUNTS[point as usize].fetch_add(1, Ordering::SeqCst);
    }
    let Some(armed) = ARMED.get() else {
        return;
    };
    if armed.crash.point != point {
        return;
    }
    if armed.reached.fetch_add(1, Ordering::SeqCst) + 1 == armed.crash.nth {
        last();
        eprintln!("rewind: crash injected at {}", armed.crash);
        let _ =
            rustix::process::kill_process(rustix::process::getpid(), rustix::process::Signal::KILL);
        // SIGKILL cannot be caught; this is not reached.
        std::process::abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_a_point_with_and_without_a_count() {
        let crash: Crash = "after-call:3".parse().expect("parses");
        assert_eq!(
            crash,
            Crash {
                point: CrashPoint::AfterCall,
                nth: 3
            }
        );
        let crash: Crash = "checkpoint-save".parse().expect("parses");
        assert_eq!(crash.nth, 1);
        for point in CrashPoint::ALL {
            assert_eq!(point.name().parse::<Crash>().expect("parses").point, point);
        }
    }

    #[test]
    fn a_bad_value_names_the_problem_and_the_points() {
        let error = "after-cal:2".parse::<Crash>().expect_err("unknown point");
        let message = error.to_string();
        assert!(
            message.contains("no crash point is named `after-cal`"),
            "{message}"
        );
        assert!(message.contains("after-call, after-record"), "{message}");
        assert!(message.contains("torn-write"), "{message}");
        let message = "after-call:x"
            .parse::<Crash>()
            .expect_err("count")
            .to_string();
        assert!(message.contains("`x` is not a count"), "{message}");
        let message = "after-call:0"
            .parse::<Crash>()
            .expect_err("zero")
            .to_string();
        assert!(message.contains("starts at 1"), "{message}");
    }
}
