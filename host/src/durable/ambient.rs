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

use rand::RngCore as _;

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

impl std::fmt::Display for Seeded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}@{}", self.seed, self.epoch_ms)
    }
}

impl std::str::FromStr for Seeded {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let (seed, epoch_ms) = text.split_once('@').unwrap_or((text, "1767225600000"));
        let number = |part: &str, what: &str| {
            part.trim().parse::<u64>().map_err(|e| {
                format!("{SEED_ENV}={text:?}: the {what} is not a whole number ({e}); expected SEED[@EPOCH_MS]")
            })
        };
        Ok(Self {
            seed: number(seed, "seed")?,
            epoch_ms: number(epoch_ms, "epoch")?,
        })
    }
}

static SEEDED: OnceLock<Seeded> = OnceLock::new();

/// Makes this process's live values deterministic. At most once; a second call returns
/// `false` and changes nothing.
pub fn seed(seeded: Seeded) -> bool {
    SEEDED.set(seeded).is_ok()
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
    /// Digest of the state's key: the insecure seed, and what a seeded random key is
    /// derived from.
    state: Digest,
}

#[derive(Clone, Copy, Debug, Default)]
struct Read {
    wall: usize,
    monotonic: usize,
    /// Bytes handed out of each random stream.
    random: u64,
    insecure: u64,
}

impl AmbientSource {
    /// The sources of a run of the state at `key` whose records so far are `values`.
    pub fn new(key: &StateKey, values: Ambient) -> Self {
        let seed = super::digest::state_digest(key, b"wasi:random/insecure-seed");
        Self(Arc::new(Mutex::new(Sources {
            values,
            read: Read::default(),
            unwritten: false,
            monotonic_base: 0,
            since: Instant::now(),
            state: seed,
        })))
    }

    /// `wasi:clocks/wall-clock.now`.
    pub fn wall_now(&self) -> Duration {
        let mut sources = self.lock();
        let at = sources.read.wall;
        sources.read.wall += 1;
        let nanos = match sources.values.wall.get(at) {
            Some(&nanos) => nanos,
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
        if let Some(_seeded) = SEEDED.get() {
            let nanos = millis(at as u64 + 1);
            sources.values.monotonic.push(nanos);
            sources.unwritten = true;
            return nanos;
        }
        if at > 0 && at == sources.values.monotonic.len() {
            // The first live reading after recorded ones: continue from the last of them.
            sources.monotonic_base = sources.values.monotonic[at - 1];
            sources.since = Instant::now();
        }
        let elapsed = u64::try_from(sources.since.elapsed().as_nanos()).unwrap_or(u64::MAX);
        let last = sources.values.monotonic.last().copied().unwrap_or(0);
        let nanos = sources.monotonic_base.saturating_add(elapsed).max(last);
        sources.values.monotonic.push(nanos);
        sources.unwritten = true;
        nanos
    }

    /// `wasi:random/random`: the next `buf.len()` bytes of the run's random stream.
    pub fn fill_random(&self, buf: &mut [u8]) {
        let mut sources = self.lock();
        let key = sources.random_key();
        stream(&key, b"wasi:random/random", sources.read.random, buf);
        sources.read.random += buf.len() as u64;
    }

    /// `wasi:random/insecure`: the next `buf.len()` bytes of the run's insecure stream.
    pub fn fill_insecure(&self, buf: &mut [u8]) {
        let mut sources = self.lock();
        let key = sources.random_key();
        stream(&key, b"wasi:random/insecure", sources.read.insecure, buf);
        sources.read.insecure += buf.len() as u64;
    }

    /// `wasi:random/insecure-seed`: derived from the state's key, the same on every run.
    pub fn insecure_seed(&self) -> u128 {
        let mut head = [0u8; 16];
        head.copy_from_slice(&self.lock().state.0[..16]);
        u128::from_le_bytes(head)
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

    /// Drops recorded readings this run did not take: they belong to an older version of it.
    pub(super) fn keep_read(&self) {
        let mut sources = self.lock();
        let read = sources.read;
        let values = &mut sources.values;
        values.wall.truncate(read.wall);
        values.monotonic.truncate(read.monotonic);
        if read.random == 0 && read.insecure == 0 {
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
    /// The key of the random streams: recorded, else drawn now (and to be written).
    fn random_key(&mut self) -> RandomKey {
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

/// Bytes `at..at + out.len()` of the stream `name` of `key`: SHA-256 of the key, the name
/// and a block number, block after block. However the reads are cut, the stream is the same.
fn stream(key: &RandomKey, name: &[u8], at: u64, out: &mut [u8]) {
    let mut done = 0;
    while done < out.len() {
        let position = at + done as u64;
        let block = Digest::of(&[&key.0, name, &(position / 32).to_le_bytes()]);
        let offset = (position % 32) as usize;
        let n = (32 - offset).min(out.len() - done);
        out[done..done + n].copy_from_slice(&block.0[offset..offset + n]);
        done += n;
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
        let mut random = [0u8; 12];
        let mut insecure = [0u8; 5];
        let wall = vec![source.wall_now(), source.wall_now()];
        let mut monotonic = vec![source.monotonic_now()];
        source.fill_random(&mut random[..7]);
        monotonic.push(source.monotonic_now());
        source.fill_random(&mut random[7..]);
        source.fill_insecure(&mut insecure);
        (wall, monotonic, random.to_vec(), insecure.to_vec())
    }

    #[test]
    fn a_replay_reads_what_the_first_run_read() {
        let first = AmbientSource::new(&key("a"), Ambient::default());
        let seen = readings(&first);
        assert!(first.unwritten(), "live values wait for the next write");
        let recorded = first.values();
        first.written();
        assert!(!first.unwritten());

        std::thread::sleep(Duration::from_millis(2));
        let replay = AmbientSource::new(&key("a"), recorded.clone());
        assert_eq!(readings(&replay), seen);
        assert!(!replay.unwritten(), "nothing was read live");
        assert_eq!(replay.values(), recorded);
    }

    #[test]
    fn random_is_one_stream_however_a_replay_splits_its_reads() {
        let first = AmbientSource::new(&key("a"), Ambient::default());
        let mut once = [0u8; 16];
        first.fill_random(&mut once);
        let replay = AmbientSource::new(&key("a"), first.values());
        let mut halves = [0u8; 16];
        replay.fill_random(&mut halves[..3]);
        replay.fill_random(&mut halves[3..]);
        assert_eq!(halves, once);
    }

    #[test]
    fn reading_past_the_records_goes_live_and_is_kept() {
        let first = AmbientSource::new(&key("a"), Ambient::default());
        let wall = first.wall_now();
        let replay = AmbientSource::new(&key("a"), first.values());
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
        let replay = AmbientSource::new(&key("a"), recorded);
        assert_eq!(replay.monotonic_now(), 5_000_000_000);
        assert_eq!(replay.monotonic_now(), 9_000_000_000);
        let live = replay.monotonic_now();
        let next = replay.monotonic_now();
        assert!(live >= 9_000_000_000, "went back to {live}");
        assert!(next >= live);
    }

    #[test]
    fn the_insecure_seed_is_the_states_own() {
        let seed = AmbientSource::new(&key("a"), Ambient::default()).insecure_seed();
        assert_eq!(
            AmbientSource::new(&key("a"), Ambient::default()).insecure_seed(),
            seed
        );
        assert_ne!(
            AmbientSource::new(&key("b"), Ambient::default()).insecure_seed(),
            seed
        );
    }

    #[test]
    fn a_stream_is_the_same_however_it_is_cut() {
        let key = RandomKey([7; 32]);
        let mut whole = [0u8; 100];
        stream(&key, b"random", 0, &mut whole);
        let mut pieces = [0u8; 100];
        stream(&key, b"random", 0, &mut pieces[..33]);
        stream(&key, b"random", 33, &mut pieces[33..]);
        assert_eq!(pieces, whole);
        let mut other = [0u8; 100];
        stream(&RandomKey([8; 32]), b"random", 0, &mut other);
        assert_ne!(other, whole, "another key, another stream");
        stream(&key, b"insecure", 0, &mut other);
        assert_ne!(other, whole, "another name, another stream");
    }

    #[test]
    fn a_seed_is_parsed_with_or_without_its_epoch() {
        let seeded: Seeded = "42@1000".parse().expect("parses");
        assert_eq!((seeded.seed, seeded.epoch_ms), (42, 1000));
        assert_eq!(seeded.to_string().parse::<Seeded>(), Ok(seeded));
        assert_eq!("42".parse::<Seeded>().map(|s| s.seed), Ok(42));
        let error = "x@1".parse::<Seeded>().expect_err("not a number");
        assert!(
            error.contains("REWIND_AMBIENT_SEED") && error.contains("seed"),
            "{error}"
        );
    }

    #[test]
    fn values_a_run_did_not_read_are_dropped_at_completion() {
        let first = AmbientSource::new(&key("a"), Ambient::default());
        readings(&first);
        let replay = AmbientSource::new(&key("a"), first.values());
        replay.wall_now();
        replay.keep_read();
        let kept = replay.values();
        assert_eq!(kept.wall.len(), 1);
        assert!(kept.monotonic.is_empty() && kept.random_key.is_none());
    }
}
