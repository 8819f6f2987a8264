//! Built-in functions: time and randomness, recorded like any call so that replays see the
//! values the first run saw.

use std::fmt;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use rand::RngCore;

use super::{CallRequest, Function, FunctionError};

/// Where the `time` function and durable waits read the time. Injected, so tests can fix
/// it.
pub trait Clock: Send + Sync + fmt::Debug {
    fn now(&self) -> SystemTime;

    /// Moves the time on to `time` at once, if this clock skips time (`rewind test`): a
    /// timer due then fires now. `false` (the default): time passes as it does.
    fn skip_to(&self, time: SystemTime) -> bool {
        let _ = time;
        false
    }

    /// Whether it skips time: every timer is as good as due.
    fn skips(&self) -> bool {
        false
    }
}

/// The system's clock, moved on at once to each time a timer waits for: durable waits end
/// at once, in the order of their times, and what reads the clock after one sees it past
/// the wait. What `rewind test` runs agents on (`SKIP_TIME_ENV`).
#[derive(Debug, Default)]
pub struct SkippingClock {
    /// How far it is ahead of the system's clock, in microseconds.
    ahead_us: std::sync::atomic::AtomicU64,
}

/// Set (to anything) for `rewind run`: its agent runs on a [`SkippingClock`]. A test hook,
/// honoured by `rewind run` and `rewind test` only.
pub const SKIP_TIME_ENV: &str = "REWIND_SKIP_TIME";

impl Clock for SkippingClock {
    fn now(&self) -> SystemTime {
        let ahead = self.ahead_us.load(std::sync::atomic::Ordering::Acquire);
        SystemTime::now() + std::time::Duration::from_micros(ahead)
    }

    fn skip_to(&self, time: SystemTime) -> bool {
        let ahead = time.duration_since(SystemTime::now()).unwrap_or_default();
        let ahead = u64::try_from(ahead.as_micros()).unwrap_or(u64::MAX);
        // Never back: of two skips at once, the later time wins.
        self.ahead_us
            .fetch_max(ahead, std::sync::atomic::Ordering::AcqRel);
        true
    }

    fn skips(&self) -> bool {
        true
    }
}

/// The system's wall clock.
#[derive(Clone, Copy, Debug, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> SystemTime {
        SystemTime::now()
    }
}

/// `kind = "time"`: returns `{"unix_ms": <milliseconds since the Unix epoch>}`; takes no args.
#[derive(Clone, Debug)]
pub struct TimeFunction {
    clock: Arc<dyn Clock>,
}

impl TimeFunction {
    pub fn new(clock: Arc<dyn Clock>) -> Self {
        Self { clock }
    }
}

#[async_trait]
impl Function for TimeFunction {
    async fn call(&self, _request: CallRequest<'_>) -> Result<String, FunctionError> {
        let since_epoch = self
            .clock
            .now()
            .duration_since(UNIX_EPOCH)
            .map_err(|e| FunctionError::Failed(format!("the clock is before 1970: {e}")))?;
        Ok(serde_json::json!({ "unix_ms": since_epoch.as_millis() }).to_string())
    }
}

/// `kind = "random"`: returns `{"u64": <a random integer>, "hex": <16 random bytes as hex>}`.
///
/// Seeded (the crash-injection kit's runs), the answer is a function of the seed and the
/// call's idempotency key, so that every run of the same inputs draws the same values and
/// their outputs can be compared.
#[derive(Clone, Copy, Debug, Default)]
pub struct RandomFunction {
    seed: Option<u64>,
}

impl RandomFunction {
    /// Draws from the host's generator, or, with `seed`, from one keyed by the seed and
    /// the call's idempotency key.
    pub fn new(seed: Option<u64>) -> Self {
        Self { seed }
    }
}

#[async_trait]
impl Function for RandomFunction {
    async fn call(&self, request: CallRequest<'_>) -> Result<String, FunctionError> {
        Ok(match self.seed {
            None => draw(&mut rand::rng()),
            Some(seed) => {
                use rand::SeedableRng as _;
                use sha2::Digest as _;
                let digest = sha2::Sha256::new()
                    .chain_update(seed.to_le_bytes())
                    .chain_update(request.idempotency_key.as_bytes())
                    .finalize();
                draw(&mut rand::rngs::StdRng::from_seed(digest.into()))
            }
        })
    }
}

/// The random function's answer, drawn from `rng`.
fn draw(rng: &mut impl RngCore) -> String {
    let mut bytes = [0u8; 16];
    rng.fill_bytes(&mut bytes);
    serde_json::json!({ "u64": rng.next_u64(), "hex": hex::encode(bytes) }).to_string()
}
