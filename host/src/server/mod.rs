//! `rewind serve`: an HTTP/JSON API that hosts many tenants' agents on one machine.
//!
//! An admin token creates tenants and issues their tokens; every request carries a token
//! (401 without a valid one); a tenant's token reaches only its own tenant (403 otherwise,
//! whether or not the other exists). A tenant uploads components, defines agents (each
//! definition a new version), submits events for keys, reads its outputs and its keys'
//! histories. Each tenant has its own namespace on disk (`tenants/NAME/`: components,
//! agents, a journal and a state log, both embedded logs) and its own quotas.

mod agents;
mod api;
mod compile;
mod components;
mod config;
mod journal;
mod quota;
mod runtime;
mod states;
mod tenants;
mod tls;

use std::collections::HashMap;
use std::future::{Future, IntoFuture as _};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use crate::sandbox::Sandbox;
use crate::state_dir::{StateDir, StateDirError};

pub use api::{openapi, router};
pub use config::TlsConfig;
pub use config::{AdminToken, ConfigError, SecretSource, ServerConfig, TenantConfig, TenantPolicy};
pub use quota::{QuotaExceeded, Quotas};
pub use runtime::{HostRuns, Lifecycle, OpenError, TenantRuntime};
pub use tenants::{TenantError, Tenants};
pub use tls::TlsError;

/// Why the server could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Tenants(#[from] TenantError),
    #[error(transparent)]
    Open(#[from] OpenError),
    #[error("starting the threads that run guests: {0}")]
    Threads(#[from] std::io::Error),
    #[error("the state directory: {0}")]
    StateDir(#[from] StateDirError),
    #[error(transparent)]
    Tls(#[from] TlsError),
}

/// The niceness of the threads guests run on and components compile on (the server's own
/// keep 0).
const RUN_NICENESS: i32 = 10;

/// Lowers the calling thread to [`RUN_NICENESS`]: a request, a journal write or a stream is
/// never queued behind a guest's time slice or a compile. Unprivileged: it only lowers.
fn lower_this_thread(what: &str) {
    let thread = rustix::thread::gettid();
    if let Err(e) = rustix::process::setpriority_process(Some(thread), RUN_NICENESS) {
        tracing::debug!("lowering a {what} thread's priority: {e}");
    }
}

/// Wasmtime compiles a component's functions on rayon's global pool: its threads are
/// lowered like the runs', so that one tenant's uploads (each compiled whole before its
/// world is checked) do not slow the others' requests. Once per process: a pool built
/// before (by an earlier server in the same process) is left as it is.
fn lower_compile_threads() {
    let built = rayon::ThreadPoolBuilder::new()
        .thread_name(|i| format!("rewind-compile-{i}"))
        .start_handler(|_| lower_this_thread("compile"))
        .build_global();
    if let Err(e) = built {
        tracing::debug!("rayon's pool is built already: {e}");
    }
}

/// The runtime guests run on: one worker per core, apart from the server's own.
#[derive(Debug)]
struct Compute(Option<tokio::runtime::Runtime>);

impl Compute {
    fn new() -> std::io::Result<Self> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(std::thread::available_parallelism().map_or(2, |n| n.get()))
            .thread_name("rewind-run")
            // Below the server's own threads, its blocking pool (uploads' compiles) too.
            .on_thread_start(|| lower_this_thread("run"))
            .enable_all()
            .build()?;
        Ok(Self(Some(runtime)))
    }

    fn handle(&self) -> tokio::runtime::Handle {
        match &self.0 {
            Some(runtime) => runtime.handle().clone(),
            None => unreachable!("the runtime is taken only when dropped"),
        }
    }
}

impl Drop for Compute {
    fn drop(&mut self) {
        // Dropped from async code too: do not wait for the runs still there.
        if let Some(runtime) = self.0.take() {
            runtime.shutdown_background();
        }
    }
}

/// What every request handler shares.
#[derive(Debug)]
pub struct ServerState {
    pub tenants: Tenants,
    /// SHA-256 of the admin token.
    admin: [u8; 32],
    sandbox: Arc<Sandbox>,
    config: ServerConfig,
    config_path: PathBuf,
    max_component_bytes: usize,
    compiles: compile::CompileSlots,
    runtimes: tokio::sync::Mutex<HashMap<String, Arc<TenantRuntime>>>,
    /// One permit per sandbox instance: runs of every tenant take one.
    /// The host's instance pool, shared by every tenant: runs, and runs away between a
    /// call's attempts (their instances alive, their run slots let go).
    host_runs: HostRuns,
    compute: Compute,
    lifecycle: Arc<Lifecycle>,
    /// Completes TLS handshakes, when `[tls]` is set.
    tls: Option<Arc<rustls::ServerConfig>>,
    /// Held for as long as the server runs: one process writes a state directory.
    _state_dir: StateDir,
}

impl ServerState {
    /// Opens the state directory: the tenant registry, and every tenant's runtime (which
    /// resumes the inputs it had not finished). A tenant section of the configuration that
    /// cannot be used (a secret that cannot be read) is an error naming it.
    pub async fn start(
        config: ServerConfig,
        config_path: &Path,
        admin_token: &str,
        sandbox: Arc<Sandbox>,
    ) -> Result<Arc<Self>, StartError> {
        for tenant in config.tenants.keys() {
            config.tenant_policy(config_path, tenant)?;
        }
        let tls = config
            .tls
            .as_ref()
            .map(|tls| tls::server_config(&tls.cert, &tls.key))
            .transpose()?;
        // First: a second server on this directory is refused before it reads anything.
        let state_dir = StateDir::open(&config.state_dir)?;
        lower_compile_threads();
        let tenants = Tenants::open(&config.state_dir)?;
        let state = Arc::new(Self {
            _state_dir: state_dir,
            admin: tenants::hash(admin_token),
            max_component_bytes: usize::try_from(u64::from(config.max_component_mib) << 20)
                .unwrap_or(usize::MAX),
            compiles: compile::CompileSlots::new(config.compile_slots, config.compile_queue),
            host_runs: HostRuns::of(sandbox.instances() as usize),
            compute: Compute::new()?,
            tenants,
            sandbox,
            config,
            config_path: config_path.to_owned(),
            runtimes: tokio::sync::Mutex::new(HashMap::new()),
            lifecycle: Arc::new(Lifecycle::default()),
            tls,
        });
        for tenant in state.tenants.names() {
            state.runtime(&tenant).await?;
        }
        Ok(state)
    }

    /// The runtime of `tenant` (which exists), opened on first use.
    pub async fn runtime(&self, tenant: &str) -> Result<Arc<TenantRuntime>, StartError> {
        let mut runtimes = self.runtimes.lock().await;
        if let Some(runtime) = runtimes.get(tenant) {
            return Ok(Arc::clone(runtime));
        }
        let policy = self.config.tenant_policy(&self.config_path, tenant)?;
        let runtime = TenantRuntime::open(
            tenant,
            self.tenant_dir(tenant),
            policy,
            Arc::clone(&self.sandbox),
            self.host_runs.clone(),
            self.compute.handle(),
            Arc::clone(&self.lifecycle),
        )
        .await?;
        runtimes.insert(tenant.to_owned(), Arc::clone(&runtime));
        Ok(runtime)
    }

    /// `https` with `[tls]`, else `http`.
    pub fn scheme(&self) -> &'static str {
        if self.tls.is_some() { "https" } else { "http" }
    }

    /// Where a tenant's files are kept.
    fn tenant_dir(&self, tenant: &str) -> PathBuf {
        self.config.state_dir.join("tenants").join(tenant)
    }

    /// Starts no more inputs and waits, up to `shutdown-grace-ms`, for those running.
    /// Returns how many had not finished (they run again at the next start).
    pub async fn stop(&self) -> usize {
        self.lifecycle
            .stop(Duration::from_millis(self.config.shutdown_grace_ms))
            .await
    }
}

/// Serves the API on `listener` (over TLS with `[tls]`) until `shutdown` completes; then
/// stops accepting, lets the requests in flight finish, and waits for the inputs running
/// (see [`ServerState::stop`]).
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<ServerState>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    match state.tls.clone() {
        Some(config) => serve_on(tls::TlsListener::new(listener, config)?, state, shutdown).await,
        None => serve_on(listener, state, shutdown).await,
    }
}

async fn serve_on<L>(
    listener: L,
    state: Arc<ServerState>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()>
where
    L: axum::serve::Listener,
    L::Addr: std::fmt::Debug,
{
    let lifecycle = Arc::clone(&state.lifecycle);
    let (stopping, stopped) = tokio::sync::oneshot::channel::<()>();
    let shutdown = async move {
        shutdown.await;
        lifecycle.close_streams();
        let _ = stopping.send(());
    };
    let serving = axum::serve(listener, router(Arc::clone(&state)))
        .with_graceful_shutdown(shutdown)
        .into_future();
    // Requests still open a grace period after the signal (a slow upload, say) are cut.
    let grace = Duration::from_millis(state.config.shutdown_grace_ms);
    tokio::select! {
        served = serving => served?,
        () = async {
            if stopped.await.is_ok() {
                tokio::time::sleep(grace).await;
            } else {
                std::future::pending::<()>().await;
            }
        } => tracing::warn!("requests still open {grace:?} after the signal; stopping anyway"),
    }
    let unfinished = state.stop().await;
    if unfinished > 0 {
        tracing::warn!(
            inputs = unfinished,
            "stopped with inputs running; they resume at the next start"
        );
    }
    Ok(())
}
