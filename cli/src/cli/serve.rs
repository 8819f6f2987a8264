//! `rewind serve`: the multi-tenant server (`rewind_host::server`).

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context;
use clap::Args;
use rewind_host::sandbox::Sandbox;
use rewind_host::server::{ServerConfig, ServerState};

#[derive(Debug, Args)]
pub struct ServeArgs {
    /// The server's configuration.
    #[arg(long, default_value = "rewind.toml")]
    config: PathBuf,
    /// A test hook, honoured only by a build whose library has the `test-hooks` feature
    /// (the tests'): kill the server the Nth time it reaches POINT (see
    /// `rewind_host::crash`). Any other build refuses it.
    #[arg(long, hide = true, value_name = "POINT[:N]")]
    crash_at: Option<rewind_host::crash::Crash>,
}

pub async fn serve(args: ServeArgs, sandbox: Sandbox) -> anyhow::Result<ExitCode> {
    if let Some(crash) = args.crash_at {
        if !rewind_host::crash::HOOKS {
            anyhow::bail!(
                "--crash-at is a test hook, and this build has none (only a build of the \
                 library with the `test-hooks` feature, the tests', honours it)"
            );
        }
        rewind_host::crash::arm(crash);
        tracing::warn!("armed to crash at {crash}");
    }
    let config = ServerConfig::load(&args.config)?;
    let admin = config.admin_token(&args.config)?;
    let listen = config.listen;
    let state = ServerState::start(config, &args.config, &admin, Arc::new(sandbox)).await?;
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("listening on {listen}"))?;
    let address = listener.local_addr()?;
    eprintln!("rewind serve: listening on {}://{address}", state.scheme());
    rewind_host::server::serve(listener, state, super::shutdown_signal())
        .await
        .context("serving")?;
    eprintln!("rewind serve: stopped");
    Ok(ExitCode::SUCCESS)
}
