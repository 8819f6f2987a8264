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
    #[command(flatten)]
    crash: super::CrashHook,
}

pub async fn serve(args: ServeArgs, sandbox: Sandbox) -> anyhow::Result<ExitCode> {
    args.crash.arm()?;
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
