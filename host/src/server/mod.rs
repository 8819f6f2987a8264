//! `rewind serve`: an HTTP/JSON API that hosts many tenants' agents on one machine.
//!
//! Built up over issue #6. What is here: the server's configuration (`rewind.toml`), the
//! tenant registry with hashed tokens, and authentication: an admin token creates tenants and
//! issues their tokens; every request carries a token (401 without a valid one); a tenant's
//! token reaches only its own tenant (403 otherwise, whether or not the other exists).

mod api;
mod config;
mod tenants;

use std::future::Future;
use std::sync::Arc;

pub use api::router;
pub use config::{AdminToken, ConfigError, ServerConfig};
pub use tenants::{TenantError, Tenants};

/// What every request handler shares.
#[derive(Debug)]
pub struct ServerState {
    pub tenants: Tenants,
    /// SHA-256 of the admin token.
    admin: [u8; 32],
}

impl ServerState {
    pub fn new(tenants: Tenants, admin_token: &str) -> Self {
        Self {
            tenants,
            admin: tenants::hash(admin_token),
        }
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
