//! The clocks and random sources a guest sees through WASI, made durable.
//!
//! A run reads the wall clock, the monotonic clock and the random sources through an
//! [`AmbientSource`]. The first time, each clock reading is taken live and kept, in order, in
//! the run's action state ([`Ambient`]); when the run is replayed, the n-th reading of a clock
//! is the n-th value kept, and only once those are used up are new readings taken live (and
//! kept). The random sources are streams derived from a key drawn from the host's generator
//! the first time the run asks for randomness and kept in the state: a replay derives the
//! same bytes (Python's runtime alone draws 10 KB as it starts; the key is 32 bytes). So
//! `time.time()`, `Date.now()` or `Math.random()` in a guest is replay-safe with no SDK call.
//!
//! Values read live are written to the store with the state's next write: before the next
//! call that runs live (so an effect never depends on a value that a replay would not see
//! again), or with the completion. A process that dies before then loses only values nothing
//! outside the sandbox has seen.
//!
//! `wasi:random/insecure-seed` is not recorded: it is derived from the state's key, so every
//! run of a state gets the same seed (Rust's `HashMap` iterates in the same order).
//!
//! For the crash-injection kit, a process can be [`seed`]ed (`REWIND_AMBIENT_SEED`): its live
//! values are then a function of the seed, the state and the position read, so that runs of
//! the same inputs see the same values and their outputs can be compared.

use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant, SystemTime};

use chacha20::ChaCha20Rng;
use rand::RngCore as _;
use rand_core::{Rng as _, SeedableRng as _};

use crate::store::{Ambient, Digest, RandomKey, StateKey};

/// `REWIND_AMBIENT_SEED=SEED[@EPOCH_MS]`: live values deterministic (see [`Seeded`]).
pub const SEED_ENV: &str = "REWIND_AMBIENT_SEED";

/// Deterministic live values, for tests: the n-th wall-clock reading of a state is `epoch_ms`
/// plus n milliseconds, the n-th monotonic reading n + 1 milliseconds, and the random key is
/// derived from `seed` and the state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Seeded {
    pub seed: u64,
    pub epoch_ms: u64,
}

impl Seeded {
    /// The epoch when none is given: 2026-01-01T00:00:00Z.
    pub const DEFAULT_EPOCH_MS: u64 = 1_767_225_600_000;
}

impl Default for Seeded {
    fn default() -> Self {
        Self {
            seed: 0,
            epoch_ms: Self::DEFAULT_EPOCH_MS,
        }
    }
}

impl std::fmt::Display for Seeded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}@{}", self.seed, self.epoch_ms)
    }
}

impl std::str::FromStr for Seeded {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let (seed, epoch_ms) = match text.split_once('@') {
            Some((seed, epoch_ms)) => (seed, Some(epoch_ms)),
            None => (text, None),
        };
        let number = |part: &str, what: &str| {
            part.trim().parse::<u64>().map_err(|e| {
                format!("{SEED_ENV}={text:?}: the {what} is not a whole number ({e}); expected SEED[@EPOCH_MS]")
            })
        };
        Ok(Self {
            seed: number(seed, "seed")?,
            epoch_ms: match epoch_ms {
                Some(epoch_ms) => number(epoch_ms, "epoch")?,
                None => Self::DEFAULT_EPOCH_MS,
            },
        })
    }
}

static SEEDED: OnceLock<Seeded> = OnceLock::new();

/// Makes this process's live values deterministic. At most once; a second call returns
/// `false` and changes nothing.
pub fn seed(seeded: Seeded) -> bool {
    SEEDED.set(seeded).is_ok()
}

/// What this process was [`seed`]ed with, if it was.
pub fn seeded() -> Option<Seeded> {
    SEEDED.get().copied()
}

/// Seeds this process from [`SEED_ENV`] when it is set; what was seeded.
pub fn seed_from_env() -> Result<Option<Seeded>, String> {
    let Ok(text) = std::env::var(SEED_ENV) else {
        return Ok(None);
    };
    let seeded: Seeded = text.parse()?;
    seed(seeded);
    Ok(Some(seeded))
}

/// One run's clocks and random sources: served from the state's records while they last,
/// then live and recorded. Clones share the same sources.
#[derive(Clone, Debug)]
pub struct AmbientSource(Arc<Mutex<Sources>>);

#[derive(Debug)]
struct Sources {
    /// Every value of the state: those found when the run started, then those read live.
    values: Ambient,
    /// How far this run has read into each source.
    read: Read,
    /// Values were read live since the state was last written.
    unwritten: bool,
    /// The live monotonic clock: a reading is `base` plus the time since `since`, so that
    /// it continues from the last recorded reading instead of this process's clock.
    monotonic_base: u64,
    since: Instant,
    /// This run has read the monotonic clock past its records.
    monotonic_live: bool,
    /// Clock readings a run may take, both clocks together.
    limit: usize,
    /// A reading past `limit` was asked for (and not recorded).
    exceeded: bool,
    /// Digest of the state's key: the insecure seed, and what a seeded random key is
    /// derived from.
    state: Digest,
}

#[derive(Clone, Copy, Debug, Default)]
struct Read {
    wall: usize,
    monotonic: usize,
    /// A random stream was read.
    random: bool,
}

impl AmbientSource {
    /// The sources of a run of the state at `key` whose records so far are `values`, that
    /// may take `limit` clock readings.
    pub fn new(key: &StateKey, values: Ambient, limit: u32) -> Self {
        let seed = super::digest::state_digest(key, b"wasi:random/insecure-seed");
        Self(Arc::new(Mutex::new(Sources {
            values,
            read: Read::default(),
            unwritten: false,
            monotonic_base: 0,
            since: Instant::now(),
            monotonic_live: false,
            limit: usize::try_from(limit).unwrap_or(usize::MAX),
            exceeded: false,
            state: seed,
        })))
    }

    /// `wasi:clocks/wall-clock.now`.
    pub fn wall_now(&self) -> Duration {
        let mut sources = self.lock();
        let at = sources.read.wall;
        sources.read.wall += 1;
        let recorded = sources.values.wall.get(at).copied();
        let nanos = match recorded {
            Some(nanos) => nanos,
            None if sources.over_limit() => sources.values.wall.last().copied().unwrap_or(0),
            None => {
                let nanos = match SEEDED.get() {
                    Some(seeded) => millis(seeded.epoch_ms.saturating_add(at as u64)),
                    None => {
                        let now = SystemTime::now()
                            .duration_since(SystemTime::UNIX_EPOCH)
                            .unwrap_or_default();
                        u64::try_from(now.as_nanos()).unwrap_or(u64::MAX)
                    }
                };
                sources.values.wall.push(nanos);
                sources.unwritten = true;
                nanos
            }
        };
        Duration::from_nanos(nanos)
    }

    /// `wasi:clocks/monotonic-clock.now`, in nanoseconds. Never goes back, across replays
    /// and processes too: live readings continue from the last recorded one.
    pub fn monotonic_now(&self) -> u64 {
        let mut sources = self.lock();
        let at = sources.read.monotonic;
        sources.read.monotonic += 1;
        if let Some(&nanos) = sources.values.monotonic.get(at) {
            return nanos;
        }
        if sources.over_limit() {
            return sources.values.monotonic.last().copied().unwrap_or(0);
        }
        if SEEDED.get().is_some() {
            let last = sources.values.monotonic.last().copied().unwrap_or(0);
            let nanos = millis(at as u64 + 1).max(last);
            sources.values.monotonic.push(nanos);
            sources.unwritten = true;
            return nanos;
        }
        if !sources.monotonic_live {
            // The first live reading: continue from the last recorded one, if any.
            sources.monotonic_live = true;
            if let Some(&last) = sources.values.monotonic.last() {
                sources.monotonic_base = last;
                sources.since = Instant::now();
            }
        }
        let elapsed = u64::try_from(sources.since.elapsed().as_nanos()).unwrap_or(u64::MAX);
        let last = sources.values.monotonic.last().copied().unwrap_or(0);
        let nanos = sources.monotonic_base.saturating_add(elapsed).max(last);
        sources.values.monotonic.push(nanos);
        sources.unwritten = true;
        nanos
    }

    /// A random stream of this run, `wasi:random/random` or (`insecure`)
    /// `wasi:random/insecure`, from its start. Its key is drawn when it is first read.
    pub fn random_stream(&self, insecure: bool) -> RandomStream {
        RandomStream {
            source: self.clone(),
            id: u64::from(insecure),
            rng: None,
            block: [0; 64],
            used: 64,
        }
    }

    /// `wasi:random/insecure-seed`: derived from the state's key, the same on every run.
    pub fn insecure_seed(&self) -> u128 {
        let mut head = [0u8; 16];
        head.copy_from_slice(&self.lock().state.0[..16]);
        u128::from_le_bytes(head)
    }

    /// Whether the run asked for a clock reading past its limit.
    pub fn exceeded(&self) -> bool {
        self.lock().exceeded
    }

    /// Whether values were read live since the state was last written.
    pub fn unwritten(&self) -> bool {
        self.lock().unwritten
    }

    /// Every value of the state, to write with it.
    pub(super) fn values(&self) -> Ambient {
        self.lock().values.clone()
    }

    /// The values [`Self::values`] returned are durable.
    pub(super) fn written(&self) {
        self.lock().unwritten = false;
    }

    /// Drops recorded readings this run did not take: they belong to an older version of it
    /// (at completion, or when the run diverged from its records).
    pub(super) fn keep_read(&self) {
        let mut sources = self.lock();
        let read = sources.read;
        let values = &mut sources.values;
        values.wall.truncate(read.wall);
        values.monotonic.truncate(read.monotonic);
        if !read.random {
            values.random_key = None;
        }
    }

    fn lock(&self) -> MutexGuard<'_, Sources> {
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl Sources {
    /// Whether a new reading would pass the limit; notes that one was asked for.
    fn over_limit(&mut self) -> bool {
        if self.values.wall.len() + self.values.monotonic.len() >= self.limit {
            self.exceeded = true;
        }
        self.exceeded
    }

    /// The key of the random streams: recorded, else drawn now (and to be written).
    fn random_key(&mut self) -> RandomKey {
        self.read.random = true;
        if let Some(key) = self.values.random_key {
            return key;
        }
        let key = match SEEDED.get() {
            Some(seeded) => RandomKey(Digest::of(&[&seeded.seed.to_le_bytes(), &self.state.0]).0),
            None => {
                let mut key = [0u8; 32];
                rand::rng().fill_bytes(&mut key);
                RandomKey(key)
            }
        };
        self.values.random_key = Some(key);
        self.unwritten = true;
        key
    }
}

fn millis(ms: u64) -> u64 {
    ms.saturating_mul(1_000_000)
}

/// One of a run's random streams: ChaCha20 keyed by the run's random key, stream 0 for
/// `wasi:random/random` and 1 for `wasi:random/insecure`, handed out byte by byte in order,
/// so that however a replay cuts its reads it reads the same bytes.
#[derive(Debug)]
pub struct RandomStream {
    source: AmbientSource,
    id: u64,
    /// Made when the stream is first read.
    rng: Option<ChaCha20Rng>,
    block: [u8; 64],
    /// Bytes of `block` already handed out.
    used: usize,
}

impl RandomStream {
    /// The stream's next `out.len()` bytes.
    pub fn fill(&mut self, out: &mut [u8]) {
        let rng = self.rng.get_or_insert_with(|| {
            let key = self.source.lock().random_key();
            let mut rng = ChaCha20Rng::from_seed(key.0);
            rng.set_stream(self.id);
            rng
        });
        let mut done = 0;
        while done < out.len() {
            if self.used == self.block.len() {
                // Whole words: the generator never drops a partial one.
                rng.fill_bytes(&mut self.block);
                self.used = 0;
            }
            let n = (self.block.len() - self.used).min(out.len() - done);
            out[done..done + n].copy_from_slice(&self.block[self.used..self.used + n]);
            self.used += n;
            done += n;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::KeyScope;

    fn key(action: &str) -> StateKey {
        StateKey {
            scope: KeyScope::new("t", "a", "k"),
            sequence: 1,
            action: action.to_owned(),
            trigger: Digest::of(&[b"input"]),
        }
    }

    /// What a run reads from each source, in an order a guest might.
    fn readings(source: &AmbientSource) -> (Vec<Duration>, Vec<u64>, Vec<u8>, Vec<u8>) {
        let mut random = [0u8; 100];
        let mut insecure = [0u8; 5];
        let (mut secure, mut weak) = (source.random_stream(false), source.random_stream(true));
        let wall = vec![source.wall_now(), source.wall_now()];
        let mut monotonic = vec![source.monotonic_now()];
        secure.fill(&mut random[..7]);
        monotonic.push(source.monotonic_now());
        secure.fill(&mut random[7..]);
        weak.fill(&mut insecure);
        (wall, monotonic, random.to_vec(), insecure.to_vec())
    }

    #[test]
    fn a_replay_reads_what_the_first_run_read() {
        let first = AmbientSource::new(&key("a"), Ambient::default(), u32::MAX);
        let seen = readings(&first);
        assert!(first.unwritten(), "live values wait for the next write");
        let recorded = first.values();
        first.written();
        assert!(!first.unwritten());

        std::thread::sleep(Duration::from_millis(2));
        let replay = AmbientSource::new(&key("a"), recorded.clone(), u32::MAX);
        assert_eq!(readings(&replay), seen);
        assert!(!replay.unwritten(), "nothing was read live");
        assert_eq!(replay.values(), recorded);
    }

    #[test]
    fn random_is_one_stream_however_a_replay_splits_its_reads() {
        let first = AmbientSource::new(&key("a"), Ambient::default(), u32::MAX);
        let mut once = [0u8; 150];
        first.random_stream(false).fill(&mut once);
        let replay = AmbientSource::new(&key("a"), first.values(), u32::MAX);
        let mut pieces = [0u8; 150];
        let mut stream = replay.random_stream(false);
        for piece in pieces.chunks_mut(7) {
            stream.fill(piece);
        }
        assert_eq!(pieces, once);
        let mut insecure = [0u8; 150];
        replay.random_stream(true).fill(&mut insecure);
        assert_ne!(insecure, once, "the insecure stream is another stream");
        assert_ne!(once, [0u8; 150]);
    }

    #[test]
    fn reading_past_the_records_goes_live_and_is_kept() {
        let first = AmbientSource::new(&key("a"), Ambient::default(), u32::MAX);
        let wall = first.wall_now();
        let replay = AmbientSource::new(&key("a"), first.values(), u32::MAX);
        assert_eq!(replay.wall_now(), wall);
        assert!(!replay.unwritten());
        let later = replay.wall_now();
        assert!(later >= wall);
        assert!(replay.unwritten());
        assert_eq!(replay.values().wall.len(), 2);
    }

    #[test]
    fn the_monotonic_clock_continues_from_its_records() {
        let recorded = Ambient {
            monotonic: vec![5_000_000_000, 9_000_000_000],
            ..Ambient::default()
        };
        let replay = AmbientSource::new(&key("a"), recorded, u32::MAX);
        assert_eq!(replay.monotonic_now(), 5_000_000_000);
        assert_eq!(replay.monotonic_now(), 9_000_000_000);
        let live = replay.monotonic_now();
        let next = replay.monotonic_now();
        assert!(live >= 9_000_000_000, "went back to {live}");
        assert!(next >= live);
    }

    #[test]
    fn live_monotonic_readings_advance_with_time_before_and_after_records() {
        let first = AmbientSource::new(&key("a"), Ambient::default(), u32::MAX);
        let start = first.monotonic_now();
        std::thread::sleep(Duration::from_millis(5));
        let later = first.monotonic_now();
        assert!(later - start >= 5_000_000, "{start} then {later}");

        let replay = AmbientSource::new(&key("a"), first.values(), u32::MAX);
        assert_eq!(
            (replay.monotonic_now(), replay.monotonic_now()),
            (start, later)
        );
        let live = replay.monotonic_now();
        std::thread::sleep(Duration::from_millis(5));
        let after = replay.monotonic_now();
        assert!(
            live >= later && after - live >= 5_000_000,
            "{live} then {after}"
        );
    }

    #[test]
    fn readings_past_the_limit_are_not_recorded_and_say_so() {
        let source = AmbientSource::new(&key("a"), Ambient::default(), 3);
        let (wall, monotonic) = (source.wall_now(), source.monotonic_now());
        source.wall_now();
        assert!(!source.exceeded());
        assert_eq!(
            source.wall_now(),
            Duration::from_nanos(source.values().wall[1]),
            "the clock stops"
        );
        assert_eq!(source.monotonic_now(), monotonic);
        assert!(source.exceeded());
        assert_eq!(
            source.values().wall.len() + source.values().monotonic.len(),
            3
        );
        assert!(wall.as_nanos() > 0);
    }

    #[test]
    fn the_insecure_seed_is_the_states_own() {
        let seed = AmbientSource::new(&key("a"), Ambient::default(), u32::MAX).insecure_seed();
        assert_eq!(
            AmbientSource::new(&key("a"), Ambient::default(), u32::MAX).insecure_seed(),
            seed
        );
        assert_ne!(
            AmbientSource::new(&key("b"), Ambient::default(), u32::MAX).insecure_seed(),
            seed
        );
    }

    #[test]
    fn each_state_draws_its_own_random_key() {
        let mut a = [0u8; 32];
        let mut b = [0u8; 32];
        AmbientSource::new(&key("a"), Ambient::default(), u32::MAX)
            .random_stream(false)
            .fill(&mut a);
        AmbientSource::new(&key("a"), Ambient::default(), u32::MAX)
            .random_stream(false)
            .fill(&mut b);
        assert_ne!(a, b, "a run without records draws a new key");
    }

    #[test]
    fn a_seed_is_parsed_with_or_without_its_epoch() {
        let seeded: Seeded = "42@1000".parse().expect("parses");
        assert_eq!((seeded.seed, seeded.epoch_ms), (42, 1000));
        assert_eq!(seeded.to_string().parse::<Seeded>(), Ok(seeded));
        assert_eq!(
            "42".parse::<Seeded>().map(|s| s.epoch_ms),
            Ok(Seeded::DEFAULT_EPOCH_MS)
        );
        let error = "x@1".parse::<Seeded>().expect_err("not a number");
        assert!(
            error.contains("REWIND_AMBIENT_SEED") && error.contains("seed"),
            "{error}"
        );
    }

    #[test]
    fn values_a_run_did_not_read_are_dropped_at_completion() {
        let first = AmbientSource::new(&key("a"), Ambient::default(), u32::MAX);
        readings(&first);
        let replay = AmbientSource::new(&key("a"), first.values(), u32::MAX);
        replay.wall_now();
        replay.keep_read();
        let kept = replay.values();
        assert_eq!(kept.wall.len(), 1);
        assert!(kept.monotonic.is_empty() && kept.random_key.is_none());
    }
}
