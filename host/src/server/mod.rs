//! `rewind serve`: an HTTP/JSON API that hosts many tenants' agents on one machine.
//!
//! Built up over issue #6. What is here: the server's configuration (`rewind.toml`), the
//! tenant registry with hashed tokens, and authentication: an admin token creates tenants and
//! issues their tokens; every request carries a token (401 without a valid one); a tenant's
//! token reaches only its own tenant (403 otherwise, whether or not the other exists).
//! Components are uploaded under a name, checked against the world and precompiled.

mod api;
mod config;
mod tenants;

use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;

use crate::sandbox::Sandbox;

pub use api::router;
pub use config::{AdminToken, ConfigError, ServerConfig};
pub use tenants::{TenantError, Tenants};

/// What every request handler shares.
#[derive(Debug)]
pub struct ServerState {
    pub tenants: Tenants,
    /// SHA-256 of the admin token.
    admin: [u8; 32],
    sandbox: Arc<Sandbox>,
    /// Each tenant's files are under `state_dir/tenants/NAME/`.
    state_dir: PathBuf,
    max_component_bytes: usize,
}

impl ServerState {
    pub fn new(
        config: &ServerConfig,
        tenants: Tenants,
        admin_token: &str,
        sandbox: Arc<Sandbox>,
    ) -> Self {
        Self {
            tenants,
            admin: tenants::hash(admin_token),
            sandbox,
            state_dir: config.state_dir.clone(),
            max_component_bytes: usize::try_from(u64::from(config.max_component_mib) << 20)
                .unwrap_or(usize::MAX),
        }
    }

    /// Where a tenant's files are kept.
    fn tenant_dir(&self, tenant: &str) -> PathBuf {
        self.state_dir.join("tenants").join(tenant)
    }
}

/// Serves the API on `listener` until `shutdown` completes, then stops accepting and lets
/// the requests in flight finish.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<ServerState>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router(state))
        .with_graceful_shutdown(shutdown)
        .await
}
