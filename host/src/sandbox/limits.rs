//! What one action run may use, and how the sandbox enforces it.

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Per-run limits of an agent's actions. Every field has a documented default.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub struct Limits {
    /// Linear memory one run may grow to, in MiB. Default 64.
    pub memory_mib: u32,
    /// CPU budget of one run, in wasmtime fuel units (about one per wasm instruction).
    /// Default 2,000,000,000.
    pub fuel: u64,
    /// Wall-clock time one run may take, durable calls included, in milliseconds.
    /// Default 30,000.
    pub timeout_ms: u64,
    /// Durable calls one run may make, replayed ones included. Default 64.
    pub calls_per_run: u32,
    /// Wall-clock and monotonic-clock readings one run may take, replayed ones included;
    /// each is kept in the run's state. Default 10,000.
    pub clock_readings_per_run: u32,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            memory_mib: 64,
            fuel: 2_000_000_000,
            timeout_ms: 30_000,
            calls_per_run: 64,
            clock_readings_per_run: 10_000,
        }
    }
}

impl Limits {
    pub fn memory_bytes(&self) -> usize {
        usize::try_from(u64::from(self.memory_mib) << 20).unwrap_or(usize::MAX)
    }

    pub fn timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms)
    }
}

/// The limit a run ran into.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Limit {
    Memory { mib: u32 },
    Fuel { fuel: u64 },
    Timeout { ms: u64 },
    CallsPerRun { calls: u32 },
    ClockReadings { readings: u32 },
}

impl fmt::Display for Limit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Memory { mib } => write!(f, "memory-mib ({mib} MiB)"),
            Self::Fuel { fuel } => write!(f, "fuel ({fuel} units of CPU)"),
            Self::Timeout { ms } => write!(f, "timeout-ms ({ms} ms)"),
            Self::CallsPerRun { calls } => write!(f, "calls-per-run ({calls})"),
            Self::ClockReadings { readings } => {
                write!(f, "clock-readings-per-run ({readings})")
            }
        }
    }
}

/// Refuses memory growth past the ceiling, and remembers that it did, so that the trap that
/// follows (a guest's allocator aborts) can be reported as the limit it is.
#[derive(Debug)]
pub(super) struct MemoryCeiling {
    max_bytes: usize,
    pub hit: bool,
}

impl MemoryCeiling {
    pub fn new(max_bytes: usize) -> Self {
        Self {
            max_bytes,
            hit: false,
        }
    }
}

/// Tables are small; this only stops a guest from growing one without end.
const MAX_TABLE_ELEMENTS: usize = 1 << 20;

impl wasmtime::ResourceLimiter for MemoryCeiling {
    fn memory_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        if desired > self.max_bytes {
            self.hit = true;
            return Ok(false);
        }
        Ok(true)
    }

    fn table_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        Ok(desired <= MAX_TABLE_ELEMENTS)
    }
}
