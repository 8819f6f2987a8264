//! The WASI a guest sees: an empty context. No files, no environment, no arguments, no
//! sockets, stdin closed; stdout and stderr captured and sent to tracing.

use wasmtime::component::ResourceTable;
use wasmtime_wasi::p2::pipe::MemoryOutputPipe;
use wasmtime_wasi::{WasiCtx, WasiCtxBuilder};

/// Bytes of stdout (and of stderr) kept per run; a guest that prints more gets a write error.
const CAPTURE_BYTES: usize = 64 * 1024;

/// A run's WASI state and its captured output.
pub(super) struct GuestWasi {
    pub ctx: WasiCtx,
    pub table: ResourceTable,
    pub stdout: MemoryOutputPipe,
    pub stderr: MemoryOutputPipe,
}

impl std::fmt::Debug for GuestWasi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GuestWasi").finish_non_exhaustive()
    }
}

impl GuestWasi {
    pub fn new() -> Self {
        let stdout = MemoryOutputPipe::new(CAPTURE_BYTES);
        let stderr = MemoryOutputPipe::new(CAPTURE_BYTES);
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
