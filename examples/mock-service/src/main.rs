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

    let mock = match MockService::start(args.addr).await {
        Ok(mock) => mock,
        Err(error) if error.kind() == std::io::ErrorKind::AddrInUse => {
            anyhow::bail!(
                "cannot listen on {}: the port is taken (another rewind-mock, or another \
                 program, listens there); stop it, or pass --addr with another port \
                 (127.0.0.1:0 picks a free one, and the URL is printed)",
                args.addr
            );
        }
        Err(error) => {
            return Err(error).with_context(|| format!("cannot listen on {}", args.addr));
        }
    };
    // Listen for signals before saying we are up: a script that sends SIGTERM right after
    // the line must get a clean shutdown, not the default action of the signal.
    let signal = shutdown_signal().context("cannot listen for shutdown signals")?;
    {
        // Scripts wait for this line, so it must not sit in a buffer.
        let mut stdout = std::io::stdout().lock();
        writeln!(stdout, "rewind-mock listening on http://{}", mock.addr())
            .and_then(|()| stdout.flush())
            .context("cannot write to stdout")?;
    }

    let signal = signal.await;
    let counts = mock.shutdown().await.context("server failed")?;
    let counts = serde_json::to_string(&counts).context("cannot print the final counts")?;
    eprintln!("rewind-mock stopped on {signal}; final counts: {counts}");
    Ok(())
}

/// Starts listening for SIGINT and SIGTERM now; the future names the one that came.
fn shutdown_signal() -> std::io::Result<impl Future<Output = &'static str>> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut interrupt = signal(SignalKind::interrupt())?;
    let mut terminate = signal(SignalKind::terminate())?;
    Ok(async move {
        tokio::select! {
            _ = interrupt.recv() => "SIGINT",
            _ = terminate.recv() => "SIGTERM",
        }
    })
}
