//! The crash-injection kit: runs an agent with its functions simulated, kills it at each
//! durable boundary in turn (`crate::crash`), recovers, finishes, and compares with an
//! uninterrupted run.
//!
//! Each run is a `rewind run` process, killed with SIGKILL by the crash point it is armed
//! with: nothing in the kit's own process stands in for a crash. What a case checks:
//! - the outputs equal the uninterrupted run's, each once;
//! - the calls that reached the simulated functions carry the same idempotency keys as the
//!   uninterrupted run's, and each reached its function once, except a call in flight at
//!   the crash under `in-doubt = "retry"`, which may be made again with the same key (the
//!   simulator, like a remote that honours the key, drops the repeat) and the same
//!   arguments;
//! - a call left in doubt is settled by its function's policy: `reconcile` asks and never
//!   calls again; `fail` stops the run with an error that names the call.
//!
//! Every run's clocks and random sources are seeded (`durable::Seeded`, seed 0 and the
//! default epoch), so that an agent that reads them produces the same outputs in every run
//! and in every kit run; what a run read is still recorded and served on replay as always.
//! Seeded values are the same when read again, so the comparison cannot tell a reading lost
//! in a crash from one served: Rewind's own tests (unseeded) check that.

mod agent;
mod error;
mod simulator;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};

use rand::seq::IndexedRandom;
use rand::{Rng, SeedableRng};

use crate::crash::{Crash, CrashPoint};
use crate::durable::{CallsByFunction, InDoubtPolicy, SEED_ENV, Seeded};
use crate::state_dir::{read_incarnation, set_incarnation};
use crate::store::Incarnation;
pub use agent::{Rewritten, rewrite};
pub use error::KitError;
pub use simulator::{Misses, Script, Simulator, read_scripts};

/// Which crashes to inject.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CrashAt {
    /// Every time every point is reached in the uninterrupted run.
    Every,
    /// `runs` crashes picked with `seed`: each a kind of point the uninterrupted run
    /// reaches, and a position among the times it reaches it. The same seed picks the same
    /// kinds and positions; where a run reaches a point a varying number of times (a
    /// `refresh` checkpoint re-appends what is cached at that moment), the position is
    /// scaled to this run's count.
    Random { seed: u64, runs: usize },
    /// This one.
    One(Crash),
}

/// An agent, its inputs, and how to run it.
#[derive(Clone, Debug)]
pub struct Kit {
    /// The `rewind` binary.
    pub rewind: PathBuf,
    pub agent: PathBuf,
    pub input: PathBuf,
    /// Where runs keep their state and outputs; emptied first.
    pub work: PathBuf,
    /// Compiled-component cache for the runs (`--cache-dir`), when set.
    pub cache_dir: Option<PathBuf>,
    /// URL prefixes of the agent's endpoints to replace, for the simulator to forward to.
    pub rewrites: Vec<(String, String)>,
    pub scripts: Vec<Script>,
    /// Signals to deliver as the runs reach calls and waits (`--signals`; see
    /// [`crate::agent::script`]).
    pub signals: Option<PathBuf>,
}

/// What one case came to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Recovered and finished like the uninterrupted run.
    Recovered {
        /// Calls made again with the same key (`retry`).
        repeated: u64,
        /// Calls in doubt answered by reconcile.
        reconciled: u64,
    },
    /// A call was left in doubt under `in-doubt = "fail"`, and the run stopped, naming it.
    Refused,
    /// The run finished without reaching the point that many times.
    NotReached,
    /// Something a user relies on did not hold.
    Failed(String),
}

/// One injected crash and what came of it.
#[derive(Clone, Debug)]
pub struct Case {
    pub crash: Crash,
    pub outcome: Outcome,
    /// The calls its runs made again under a key they had made before, with how many times
    /// more: (function, idempotency key) → requests beyond the first.
    pub repeats: BTreeMap<(String, String), u64>,
}

/// The environment variable that makes `rewind run` append, when it ends, one JSON line of
/// its durable calls per function (`durable::CallsByFunction`) to the file it names.
pub const CALLS_ENV: &str = "REWIND_CALLS_TO";

/// What the calls of one function came to over a kit run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FunctionCalls {
    /// Made by the uninterrupted run: one per idempotency key.
    pub made: u64,
    /// Requests that reached the function's endpoint (or its scripted answer) over every
    /// run of the kit: one per key, unless an answer was retryable (5xx, 429, 408).
    pub forwarded: u64,
    /// Served from their records by the runs that recovered from a crash.
    pub served: u64,
    /// Made again under a key already used: in doubt at a crash (`in-doubt = "retry"`).
    pub repeated: u64,
}

/// Every case, and how to run one again.
#[derive(Clone, Debug)]
pub struct Report {
    pub seed: Option<u64>,
    pub cases: Vec<Case>,
    /// How the uninterrupted run reached each point.
    pub reached: BTreeMap<String, u64>,
    /// Per function called.
    pub functions: BTreeMap<String, FunctionCalls>,
}

impl Report {
    pub fn failures(&self) -> impl Iterator<Item = &Case> {
        self.cases
            .iter()
            .filter(|c| matches!(c.outcome, Outcome::Failed(_)))
    }

    /// What the calls came to, in words: per function, calls made, sent to the function,
    /// served from records, and made again under the same key, and why that is safe. With
    /// `verbose`, every call made again, by key.
    pub fn calls(&self, verbose: bool) -> String {
        let runs = self.cases.len() + 1;
        let mut text = format!(
            "calls, per function, over the uninterrupted run and {} crashed ones:\n",
            runs - 1
        );
        for (function, calls) in &self.functions {
            let _ = writeln!(
                text,
                "  {function}: {} made; {} sent to the function (each idempotency key once: \
                 every case after the first was answered what the key was answered first); \
                 {} served from records by recovering runs; {} made again under the same key",
                calls.made, calls.forwarded, calls.served, calls.repeated
            );
        }
        let repeated: u64 = self.functions.values().map(|c| c.repeated).sum();
        if repeated > 0 {
            text.push_str(
                "Made again under the same key: a call in flight when its run was killed \
                 (it reached the function, and its result was not yet recorded) is in doubt. \
                 With in-doubt = \"retry\" the recovering run makes it again with the same \
                 Idempotency-Key and arguments; the simulator answered with the key's first \
                 answer, as a remote that honours the key does, so each call's effect \
                 happened once. A remote that ignores Idempotency-Key would have seen these \
                 calls twice: give such a function in-doubt = \"reconcile\" or \"fail\".\n",
            );
        }
        if verbose {
            for case in &self.cases {
                for ((function, key), times) in &case.repeats {
                    let _ = writeln!(
                        text,
                        "  {}: {function} {key} made again {times} time{}",
                        case.crash,
                        if *times == 1 { "" } else { "s" }
                    );
                }
            }
        }
        text
    }

    /// The table printed at the end of `rewind test`: crash points by kind and outcomes.
    pub fn table(&self) -> String {
        #[derive(Default)]
        struct Row {
            cases: u64,
            recovered: u64,
            repeated: u64,
            reconciled: u64,
            refused: u64,
            not_reached: u64,
            failed: u64,
        }
        let mut rows: BTreeMap<CrashPoint, Row> = BTreeMap::new();
        for case in &self.cases {
            let row = rows.entry(case.crash.point).or_default();
            row.cases += 1;
            match &case.outcome {
                Outcome::Recovered {
                    repeated,
                    reconciled,
                } => {
                    row.recovered += 1;
                    row.repeated += repeated;
                    row.reconciled += reconciled;
                }
                Outcome::Refused => row.refused += 1,
                Outcome::NotReached => row.not_reached += 1,
                Outcome::Failed(_) => row.failed += 1,
            }
        }
        let mut table = format!(
            "{:<20} {:>7} {:>9} {:>8} {:>10} {:>7} {:>11} {:>6}\n",
            "crash point",
            "cases",
            "recovered",
            "repeated",
            "reconciled",
            "refused",
            "not reached",
            "failed"
        );
        for (point, row) in &rows {
            let _ = writeln!(
                table,
                "{:<20} {:>7} {:>9} {:>8} {:>10} {:>7} {:>11} {:>6}",
                point.name(),
                row.cases,
                row.recovered,
                row.repeated,
                row.reconciled,
                row.refused,
                row.not_reached,
                row.failed
            );
        }
        table
    }
}

/// What every run of one kit shares: the agent.toml under test and the seed of its clocks
/// and random sources.
struct Setup {
    agent: PathBuf,
    ambient: Seeded,
    /// The state of every run is of this incarnation, so that a call has the same
    /// idempotency key in every case as in the uninterrupted run.
    incarnation: Incarnation,
    /// The script of signals every run delivers, when one is given.
    signals: Option<PathBuf>,
}

/// What a finished run left: outputs (sorted lines) and calls per (function, key).
struct Finished {
    outputs: Vec<String>,
    calls: BTreeMap<(String, String), u64>,
}

impl Kit {
    /// Runs the agent uninterrupted, then once per crash `at` picks.
    pub async fn run(&self, at: &CrashAt) -> Result<Report, KitError> {
        if self.work.exists() {
            std::fs::remove_dir_all(&self.work)
                .map_err(KitError::io(format!("emptying {}", self.work.display())))?;
        }
        std::fs::create_dir_all(&self.work)
            .map_err(KitError::io(format!("creating {}", self.work.display())))?;
        // The simulator needs the upstreams the rewrite finds; the rewrite needs the
        // simulator's address: read the endpoints first, against a placeholder.
        let probe = rewrite(&self.agent, |_| String::new(), &self.rewrites)?;
        // A script that names a signal no action declares is refused now, naming its line.
        let signals = match &self.signals {
            Some(path) => {
                let config = crate::agent::AgentFile::load(&self.agent)?.config;
                crate::agent::script::Script::read(path, &config.signals())?;
                Some(
                    std::path::absolute(path)
                        .map_err(KitError::io(format!("finding {}", path.display())))?,
                )
            }
            None => None,
        };
        let simulator = Simulator::start(probe.upstreams, self.scripts.clone()).await?;
        let rewritten = rewrite(&self.agent, |name| simulator.url(name), &self.rewrites)?;
        let agent = self.work.join("agent.toml");
        std::fs::write(&agent, &rewritten.toml)
            .map_err(KitError::io(format!("writing {}", agent.display())))?;

        // The same for every kit run, so that a case run again alone (`--crash-at POINT:N`)
        // sees the same values as it did among the others.
        let ambient = Seeded::default();
        let setup = Setup {
            agent,
            ambient,
            incarnation: Incarnation::random(),
            signals,
        };
        let reference_dir = self.work.join("reference");
        let counts = self.work.join("reached.json");
        let status = self
            .spawn(&setup, &reference_dir, None, Some(&counts))
            .await?;
        if !status.success() {
            return Err(KitError::Cannot(format!(
                "the uninterrupted run failed ({status}); it said:\n{}",
                said(&reference_dir)
            )));
        }
        let reference = finished(&reference_dir, &simulator);
        let reached: BTreeMap<String, u64> = serde_json::from_slice(
            &std::fs::read(&counts)
                .map_err(KitError::io(format!("reading {}", counts.display())))?,
        )
        .map_err(KitError::json(format!("reading {}", counts.display())))?;

        let mut all = Vec::new();
        for point in CrashPoint::ALL {
            for nth in 1..=reached.get(point.name()).copied().unwrap_or(0) {
                all.push(Crash { point, nth });
            }
        }
        let (seed, crashes) = match at {
            CrashAt::Every => (None, all),
            CrashAt::Random { seed, runs } => {
                let mut rng = rand::rngs::StdRng::seed_from_u64(*seed);
                let kinds: Vec<(CrashPoint, u64)> = CrashPoint::ALL
                    .into_iter()
                    .map(|point| (point, reached.get(point.name()).copied().unwrap_or(0)))
                    .filter(|(_, count)| *count > 0)
                    .collect();
                let mut picked = Vec::new();
                let distinct = all.len().min(*runs);
                // Draws until `runs` distinct crashes (or every one there is) are picked.
                while picked.len() < distinct {
                    let Some(&(point, count)) = kinds.choose(&mut rng) else {
                        break;
                    };
                    // A position in millionths of the count.
                    let position: u64 = rng.random_range(0..1_000_000);
                    let nth = 1 + position.saturating_mul(count) / 1_000_000;
                    let crash = Crash { point, nth };
                    if !picked.contains(&crash) {
                        picked.push(crash);
                    }
                }
                (Some(*seed), picked)
            }
            CrashAt::One(crash) => (None, vec![*crash]),
        };
        let mut functions: BTreeMap<String, FunctionCalls> = BTreeMap::new();
        for (function, stats) in read_calls(&reference_dir)?.0 {
            functions.entry(function).or_default().made += stats.live;
        }
        let mut cases = Vec::new();
        for (i, crash) in crashes.into_iter().enumerate() {
            simulator.reset();
            let dir = self
                .work
                .join(format!("{i:04}-{}-{}", crash.point, crash.nth));
            let outcome = self
                .case(
                    &setup,
                    &dir,
                    crash,
                    &simulator,
                    &reference,
                    &rewritten.in_doubt,
                )
                .await?;
            let repeats: BTreeMap<(String, String), u64> = simulator
                .keys()
                .into_iter()
                .filter(|(_, requests)| *requests > 1)
                .map(|(slot, requests)| (slot, requests - 1))
                .collect();
            for ((function, _), times) in &repeats {
                functions.entry(function.clone()).or_default().repeated += times;
            }
            for (function, stats) in read_calls(&dir)?.0 {
                functions.entry(function).or_default().served += stats.replayed;
            }
            cases.push(Case {
                crash,
                outcome,
                repeats,
            });
        }
        for (function, forwarded) in simulator.forwarded().await {
            functions.entry(function).or_default().forwarded = forwarded.forwarded;
        }
        Ok(Report {
            seed,
            cases,
            reached,
            functions,
        })
    }

    async fn case(
        &self,
        setup: &Setup,
        dir: &Path,
        crash: Crash,
        simulator: &Simulator,
        reference: &Finished,
        in_doubt: &BTreeMap<String, InDoubtPolicy>,
    ) -> Result<Outcome, KitError> {
        use std::os::unix::process::ExitStatusExt;
        let status = self.spawn(setup, dir, Some(crash), None).await?;
        if status.success() {
            return Ok(Outcome::NotReached);
        }
        if status.signal() != Some(9) {
            return Ok(Outcome::Failed(format!(
                "the run armed to crash ended with {status} before the crash; it said:\n{}",
                said(dir)
            )));
        }
        // Recovery, and as many more runs as it takes: each is a restart with the same
        // command, as an operator would do.
        let mut last = status;
        for _ in 0..3 {
            last = self.spawn(setup, dir, None, None).await?;
            if last.success() {
                break;
            }
        }
        if !last.success() {
            let said = said(dir);
            let refused = in_doubt
                .iter()
                .any(|(f, p)| *p == InDoubtPolicy::Fail && said.contains(&format!("to `{f}`")))
                && said.contains("is in doubt");
            return Ok(if refused {
                Outcome::Refused
            } else {
                Outcome::Failed(format!(
                    "recovery did not finish ({last}); it said:\n{said}"
                ))
            });
        }
        let finished = finished(dir, simulator);
        if finished.outputs != reference.outputs {
            return Ok(Outcome::Failed(format!(
                "the outputs differ from the uninterrupted run's:\n{}",
                difference(&reference.outputs, &finished.outputs)
            )));
        }
        let keys: BTreeSet<_> = finished.calls.keys().collect();
        let expected: BTreeSet<_> = reference.calls.keys().collect();
        if keys != expected {
            return Ok(Outcome::Failed(format!(
                "calls reached their functions with other idempotency keys: {:?} not in the \
                 uninterrupted run, {:?} missing",
                keys.difference(&expected).collect::<Vec<_>>(),
                expected.difference(&keys).collect::<Vec<_>>()
            )));
        }
        let changed = simulator.changed();
        if !changed.is_empty() {
            return Ok(Outcome::Failed(format!(
                "calls were made again with the same idempotency key and other arguments \
                 (function, key): {changed:?}"
            )));
        }
        let mut repeated = 0;
        for ((function, key), &requests) in &finished.calls {
            if requests > 1 {
                if in_doubt.contains_key(function) {
                    return Ok(Outcome::Failed(format!(
                        "`{function}` (in-doubt = {:?}) was called {requests} times with key {key}",
                        in_doubt[function]
                    )));
                }
                repeated += requests - 1;
            }
        }
        Ok(Outcome::Recovered {
            repeated,
            reconciled: simulator.asks(),
        })
    }

    /// Runs `rewind run` on `dir` (state and outputs), armed with `crash`, counting points
    /// into `counts`.
    async fn spawn(
        &self,
        setup: &Setup,
        dir: &Path,
        crash: Option<Crash>,
        counts: Option<&Path>,
    ) -> Result<ExitStatus, KitError> {
        std::fs::create_dir_all(dir)
            .map_err(KitError::io(format!("creating {}", dir.display())))?;
        let state = dir.join("state");
        if read_incarnation(&state)?.is_none() {
            set_incarnation(&state, setup.incarnation)?;
        }
        let stderr = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join("stderr.log"))
            .map_err(KitError::io(format!(
                "opening {}",
                dir.join("stderr.log").display()
            )))?;
        let mut command = Command::new(&self.rewind);
        if let Some(cache) = &self.cache_dir {
            command.arg("--cache-dir").arg(cache);
        }
        command
            .arg("run")
            .arg(&setup.agent)
            .arg("--input")
            .arg(&self.input)
            .arg("--output")
            .arg(dir.join("out.jsonl"))
            .arg("--state")
            .arg(&state)
            .env_remove(crate::crash::ENV)
            .env(SEED_ENV, setup.ambient.to_string())
            // A day's wait for a person or a timer is over at once, in order.
            .env(crate::functions::SKIP_TIME_ENV, "1")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr);
        if let Some(crash) = crash {
            command.env(crate::crash::ENV, crash.to_string());
        }
        if let Some(counts) = counts {
            command.env(crate::crash::COUNT_ENV, counts);
        }
        command.env(CALLS_ENV, dir.join(CALLS_FILE));
        if let Some(signals) = &setup.signals {
            command.env(crate::agent::script::SIGNALS_ENV, signals);
        }
        let rewind = self.rewind.display().to_string();
        tokio::task::spawn_blocking(move || command.status())
            .await
            .map_err(|e| KitError::io(format!("starting {rewind}"))(std::io::Error::other(e)))?
            .map_err(KitError::io(format!("starting {rewind}")))
    }
}

/// Where the runs on a directory write their calls per function ([`CALLS_ENV`]).
const CALLS_FILE: &str = "calls.jsonl";

/// The calls per function of every run on `dir` that ended (a killed one writes none).
fn read_calls(dir: &Path) -> Result<CallsByFunction, KitError> {
    let path = dir.join(CALLS_FILE);
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(KitError::io(format!("reading {}", path.display()))(e)),
    };
    let mut calls = CallsByFunction::default();
    for (number, line) in text.lines().enumerate() {
        let run: CallsByFunction = serde_json::from_str(line).map_err(KitError::json(format!(
            "{}: line {}",
            path.display(),
            number + 1
        )))?;
        calls += &run;
    }
    Ok(calls)
}

fn said(dir: &Path) -> String {
    std::fs::read_to_string(dir.join("stderr.log")).unwrap_or_default()
}

fn finished(dir: &Path, simulator: &Simulator) -> Finished {
    let path = dir.join("out.jsonl");
    let text = std::fs::read_to_string(&path).unwrap_or_default();
    let mut outputs: Vec<String> = text.lines().map(str::to_owned).collect();
    outputs.sort();
    Finished {
        outputs,
        calls: simulator.keys(),
    }
}

fn difference(expected: &[String], found: &[String]) -> String {
    let expected_set: BTreeSet<&String> = expected.iter().collect();
    let found_set: BTreeSet<&String> = found.iter().collect();
    let mut text = String::new();
    for line in expected_set.difference(&found_set) {
        let _ = writeln!(text, "  missing: {line}");
    }
    for line in found_set.difference(&expected_set) {
        let _ = writeln!(text, "  extra:   {line}");
    }
    if text.is_empty() {
        let _ = writeln!(text, "  the same lines, a different number of times");
    }
    text
}
