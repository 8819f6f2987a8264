//! `rewind-mock`: runs the mock service until SIGINT or SIGTERM.

use std::io::Write;
use std::net::SocketAddr;

use anyhow::Context;
use clap::Parser;
use rewind_mock::MockService;
use tracing_subscriber::EnvFilter;

/// A local OpenAI-compatible chat endpoint and tool API that counts calls per
/// Idempotency-Key. Prints the URL it listens on; on SIGINT or SIGTERM it shuts down
/// gracefully and prints the final counts as one JSON line to stderr.
#[derive(Debug, Parser)]
#[command(name = "rewind-mock", version)]
struct Args {
    /// Address to listen on; port 0 picks a free port.
    #[arg(long, default_value = "127.0.0.1:7181")]
    addr: SocketAddr,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn")),
        )
        .init();
    let args = Args::parse();

    let mock = MockService::start(args.addr)
        .await
        .with_context(|| format!("cannot listen on {}", args.addr))?;
    {
        // Scripts wait for this line, so it must not sit in a buffer.
        let mut stdout = std::io::stdout().lock();
        writeln!(stdout, "rewind-mock listening on http://{}", mock.addr())
            .and_then(|()| stdout.flush())
            .context("cannot write to stdout")?;
    }

    let signal = shutdown_signal()
        .await
        .context("cannot listen for shutdown signals")?;
    let counts = mock.shutdown().await.context("server failed")?;
    let counts = serde_json::to_string(&counts).context("cannot print the final counts")?;
    eprintln!("rewind-mock stopped on {signal}; final counts: {counts}");
    Ok(())
}

/// Waits for SIGINT (Ctrl-C) or, on Unix, SIGTERM, and names the one that came.
async fn shutdown_signal() -> std::io::Result<&'static str> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let mut terminate = signal(SignalKind::terminate())?;
        tokio::select! {
            interrupted = tokio::signal::ctrl_c() => interrupted.map(|()| "SIGINT"),
            _ = terminate.recv() => Ok("SIGTERM"),
        }
    }
    #[cfg(not(unix))]
    {
        tokio::signal::ctrl_c().await.map(|()| "Ctrl-C")
    }
}
