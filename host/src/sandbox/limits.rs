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
    /// Wall-clock time one run may take outside its durable calls, in milliseconds (each
    /// call is bounded by its function's own timeout and retries). Default 30,000.
    pub timeout_ms: u64,
    /// Durable calls one run may make, replayed ones included. Default 64.
    pub calls_per_run: u32,
    /// Wall-clock and monotonic-clock readings one run may take, replayed ones included;
    /// each is kept in the run's state. Default 10,000.
    pub clock_readings_per_run: u32,
    /// Bytes one run may write with `memory-set`, names and values together, every write
    /// counted (a name written twice counts twice). Default 4 MiB.
    pub memory_set_bytes: u64,
    /// Bytes of a key's short-term memory, names and values together, after a run's writes:
    /// a run that would leave more fails, and the memory stays as it was. Default 16 MiB.
    pub memory_bytes: u64,
    /// `memory-set` writes one run may make. Default 1,000.
    pub memory_set_entries: u32,
    /// Bytes of one memory name. Default 256.
    pub memory_name_bytes: u32,
    /// Bytes of one sent event, its kind and payload together. Default 1 MiB.
    pub send_payload_bytes: u64,
    /// Bytes one run may send, every event together. Default 4 MiB.
    pub send_bytes: u64,
    /// Events one run may send. Default 1,024.
    pub sends_per_run: u32,
    /// Bytes of log one run may write: its `log` calls, stdout and stderr together. What
    /// comes past it is dropped, and one warning says how much. Default 256 KiB.
    pub log_bytes: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            memory_mib: 64,
            fuel: 2_000_000_000,
            timeout_ms: 30_000,
            calls_per_run: 64,
            clock_readings_per_run: 10_000,
            memory_set_bytes: 4 << 20,
            memory_bytes: 16 << 20,
            memory_set_entries: 1_000,
            memory_name_bytes: 256,
            send_payload_bytes: 1 << 20,
            send_bytes: 4 << 20,
            sends_per_run: 1_024,
            log_bytes: 256 << 10,
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
    Memory {
        mib: u32,
    },
    Fuel {
        fuel: u64,
    },
    Timeout {
        ms: u64,
    },
    CallsPerRun {
        calls: u32,
    },
    ClockReadings {
        readings: u32,
    },
    MemorySetBytes {
        bytes: u64,
    },
    MemoryBytes {
        bytes: u64,
    },
    MemorySetEntries {
        entries: u32,
    },
    MemoryNameBytes {
        bytes: u32,
    },
    SendPayloadBytes {
        bytes: u64,
    },
    SendBytes {
        bytes: u64,
    },
    SendsPerRun {
        events: u32,
    },
    /// The run's action state is larger than the log takes in one record (not a limit of
    /// `[limits]`, but the log's: a run that writes less memory or sends less fits).
    StateBytes {
        bytes: usize,
        max: usize,
    },
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
            Self::MemorySetBytes { bytes } => write!(f, "memory-set-bytes ({bytes} bytes)"),
            Self::MemoryBytes { bytes } => write!(f, "memory-bytes ({bytes} bytes)"),
            Self::MemorySetEntries { entries } => write!(f, "memory-set-entries ({entries})"),
            Self::MemoryNameBytes { bytes } => write!(f, "memory-name-bytes ({bytes} bytes)"),
            Self::SendPayloadBytes { bytes } => write!(f, "send-payload-bytes ({bytes} bytes)"),
            Self::SendBytes { bytes } => write!(f, "send-bytes ({bytes} bytes)"),
            Self::SendsPerRun { events } => write!(f, "sends-per-run ({events})"),
            Self::StateBytes { bytes, max } => write!(
                f,
                "the run's state is {bytes} bytes, more than the {max} the log takes in one \
                 record (write less memory, send less, or call for smaller results)"
            ),
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
