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

/// Bytes of stdout (and of stderr) kept per run; what a guest writes past that is dropped
/// (and counted), never an error the guest sees.
pub(super) const CAPTURE_BYTES: usize = 64 * 1024;

/// A run's WASI state and its captured output.
pub(super) struct GuestWasi {
    pub ctx: WasiCtx,
    pub table: ResourceTable,
    pub stdout: Capture,
    pub stderr: Capture,
}

impl std::fmt::Debug for GuestWasi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GuestWasi").finish_non_exhaustive()
    }
}

impl GuestWasi {
    pub fn new(ambient: &AmbientSource) -> Self {
        let stdout = Capture::default();
        let stderr = Capture::default();
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
        }
    }
}

/// One output stream of a run: the first [`CAPTURE_BYTES`] bytes, and how many were dropped.
#[derive(Clone, Debug, Default)]
pub(super) struct Capture(Arc<Mutex<Captured>>);

#[derive(Debug, Default)]
pub(super) struct Captured {
    pub bytes: Vec<u8>,
    pub dropped: usize,
}

impl Capture {
    /// What the guest wrote, as far as it was kept.
    pub fn take(&self) -> Captured {
        std::mem::take(&mut *self.lock())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Captured> {
        self.0
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
        let mut captured = self.lock();
        let room = CAPTURE_BYTES.saturating_sub(captured.bytes.len());
        let kept = room.min(buf.len());
        captured.bytes.extend_from_slice(&buf[..kept]);
        captured.dropped += buf.len() - kept;
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
