//! The WASI a guest sees: an empty context. No files, no environment, no arguments, no
//! sockets, stdin closed; stdout and stderr captured and sent to tracing; clocks and random
//! sources durable (served from the run's records on replay, `durable::AmbientSource`).

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::AsyncWrite;
use wasmtime::component::ResourceTable;
use wasmtime_wasi::cli::{IsTerminal, StdoutStream};
use wasmtime_wasi::clocks::{HostMonotonicClock, HostWallClock};
use wasmtime_wasi::{WasiCtx, WasiCtxBuilder};

use crate::durable::{AmbientSource, RandomStream};

/// A run's WASI state and its captured output.
pub(super) struct GuestWasi {
    pub ctx: WasiCtx,
    pub table: ResourceTable,
    pub stdout: Capture,
    pub stderr: Capture,
    /// What the run may still log, shared by its streams and its `log` calls.
    pub log: LogBudget,
}

impl std::fmt::Debug for GuestWasi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GuestWasi").finish_non_exhaustive()
    }
}

impl GuestWasi {
    pub fn new(ambient: &AmbientSource, log_bytes: u64) -> Self {
        let log = LogBudget::new(log_bytes);
        let stdout = Capture::new(&log);
        let stderr = Capture::new(&log);
        let ctx = WasiCtxBuilder::new()
            .stdout(stdout.clone())
            .stderr(stderr.clone())
            .allow_tcp(false)
            .allow_udp(false)
            .allow_ip_name_lookup(false)
            .wall_clock(Durable(ambient.clone()))
            .monotonic_clock(Durable(ambient.clone()))
            .secure_random(Random(ambient.random_stream(false)))
            .insecure_random(Random(ambient.random_stream(true)))
            .insecure_random_seed(ambient.insecure_seed())
            .build();
        Self {
            ctx,
            table: ResourceTable::new(),
            stdout,
            stderr,
            log,
        }
    }
}

/// The bytes of log a run may still write (`log-bytes`): its `log` calls, stdout and stderr
/// draw from the one budget; what comes past it is dropped and counted, never an error the
/// guest sees.
#[derive(Clone, Debug)]
pub(super) struct LogBudget(Arc<Mutex<Budget>>);

#[derive(Debug)]
struct Budget {
    limit: u64,
    left: u64,
    dropped: u64,
}

impl LogBudget {
    fn new(limit: u64) -> Self {
        Self(Arc::new(Mutex::new(Budget {
            limit,
            left: limit,
            dropped: 0,
        })))
    }

    /// How many of `wanted` bytes may be kept; the rest are counted as dropped.
    pub fn take(&self, wanted: usize) -> usize {
        let mut budget = self.lock();
        let kept = usize::try_from(budget.left)
            .unwrap_or(usize::MAX)
            .min(wanted);
        budget.left -= kept as u64;
        budget.dropped += (wanted - kept) as u64;
        kept
    }

    /// Whether `wanted` bytes may be kept whole; when not, they are counted as dropped.
    pub fn take_whole(&self, wanted: usize) -> bool {
        let mut budget = self.lock();
        let wanted = wanted as u64;
        if wanted <= budget.left {
            budget.left -= wanted;
            return true;
        }
        budget.dropped += wanted;
        false
    }

    /// Bytes dropped so far, and the limit they were dropped at.
    pub fn dropped(&self) -> (u64, u64) {
        let budget = self.lock();
        (budget.dropped, budget.limit)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Budget> {
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// One output stream of a run: what the guest wrote to it, as far as the log budget kept it.
#[derive(Clone, Debug)]
pub(super) struct Capture {
    bytes: Arc<Mutex<Vec<u8>>>,
    budget: LogBudget,
}

impl Capture {
    fn new(budget: &LogBudget) -> Self {
        Self {
            bytes: Arc::default(),
            budget: budget.clone(),
        }
    }

    /// What the guest wrote so far, as far as it was kept, leaving it.
    pub fn peek(&self) -> Vec<u8> {
        self.lock().clone()
    }

    /// What the guest wrote, as far as it was kept.
    pub fn take(&self) -> Vec<u8> {
        std::mem::take(&mut *self.lock())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<u8>> {
        self.bytes
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl IsTerminal for Capture {
    fn is_terminal(&self) -> bool {
        false
    }
}

impl StdoutStream for Capture {
    fn async_stream(&self) -> Box<dyn AsyncWrite + Send + Sync> {
        Box::new(self.clone())
    }
}

impl AsyncWrite for Capture {
    fn poll_write(
        self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let kept = self.budget.take(buf.len());
        self.lock().extend_from_slice(&buf[..kept]);
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

/// The run's durable clocks.
struct Durable(AmbientSource);

/// One of the run's durable random streams: `wasi:random/random`, or `wasi:random/insecure`.
struct Random(RandomStream);

impl HostWallClock for Durable {
    fn resolution(&self) -> Duration {
        Duration::from_nanos(1)
    }

    fn now(&self) -> Duration {
        self.0.wall_now()
    }
}

impl HostMonotonicClock for Durable {
    fn resolution(&self) -> u64 {
        1
    }

    fn now(&self) -> u64 {
        self.0.monotonic_now()
    }
}

impl rand_core::TryRng for Random {
    type Error = Infallible;

    fn try_next_u32(&mut self) -> Result<u32, Infallible> {
        let mut bytes = [0u8; 4];
        self.0.fill(&mut bytes);
        Ok(u32::from_le_bytes(bytes))
    }

    fn try_next_u64(&mut self) -> Result<u64, Infallible> {
        let mut bytes = [0u8; 8];
        self.0.fill(&mut bytes);
        Ok(u64::from_le_bytes(bytes))
    }

    fn try_fill_bytes(&mut self, dst: &mut [u8]) -> Result<(), Infallible> {
        self.0.fill(dst);
        Ok(())
    }
}
