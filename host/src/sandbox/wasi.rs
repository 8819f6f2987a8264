//! The WASI a guest sees: an empty context. No files, no environment, no arguments, no
//! sockets, stdin closed; stdout and stderr captured and sent to tracing.

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use tokio::io::AsyncWrite;
use wasmtime::component::ResourceTable;
use wasmtime_wasi::cli::{IsTerminal, StdoutStream};
use wasmtime_wasi::{WasiCtx, WasiCtxBuilder};

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
    pub fn new() -> Self {
        let stdout = Capture::default();
        let stderr = Capture::default();
        let ctx = WasiCtxBuilder::new()
            .stdout(stdout.clone())
            .stderr(stderr.clone())
            .allow_tcp(false)
            .allow_udp(false)
            .allow_ip_name_lookup(false)
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
