//! Built-in functions: time and randomness, recorded like any call so that replays see the
//! values the first run saw.

use std::fmt;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use rand::RngCore;

use super::{CallRequest, Function, FunctionError};

/// Where the `time` function reads the time. Injected, so tests can fix it.
pub trait Clock: Send + Sync + fmt::Debug {
    fn now(&self) -> SystemTime;
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
#[derive(Clone, Copy, Debug, Default)]
pub struct RandomFunction;

#[async_trait]
impl Function for RandomFunction {
    async fn call(&self, _request: CallRequest<'_>) -> Result<String, FunctionError> {
        let mut rng = rand::rng();
        let mut bytes = [0u8; 16];
        rng.fill_bytes(&mut bytes);
        Ok(serde_json::json!({ "u64": rng.next_u64(), "hex": hex::encode(bytes) }).to_string())
    }
}
