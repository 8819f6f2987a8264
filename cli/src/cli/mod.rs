//! The command line.

mod build;
mod check;
#[cfg(feature = "jetstream")]
mod cluster;
mod dev;
mod inspect;
mod new;
mod operator;
mod run;
mod sdk;
#[cfg(feature = "server")]
mod serve;
mod state;
mod test;

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;
use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "rewind",
    version,
    about = "Run agent actions as sandboxed WebAssembly components whose external calls are durable"
)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
    /// More logging (-v: debug, -vv: trace; RUST_LOG overrides). `rewind test -v` also
    /// lists every call made again under the same key.
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    pub verbose: u8,
    /// Where compiled components are cached (default: $REWIND_CACHE_DIR, else
    /// $XDG_CACHE_HOME/rewind, else ~/.cache/rewind).
    #[arg(long, global = true)]
    cache_dir: Option<PathBuf>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Make a new agent, or add an action to one, in Rust, Python or JavaScript.
    New(new::NewArgs),
    /// Build an agent's actions into their components, whatever their language.
    Build(build::BuildArgs),
    /// Build and run an agent's inputs on every change, its calls answered from a
    /// recording of real answers.
    Dev(dev::DevArgs),
    /// Run an agent over a JSONL file of inputs.
    Run(run::RunArgs),
    /// Check whether a component fits the rewind:action world.
    Check(check::CheckArgs),
    /// Show what runs recorded: parked inputs, skips, operator commands, and per key the
    /// actions and their calls.
    Inspect(inspect::InspectArgs),
    /// Retry a parked input of a run's state (a run that holds the state carries it out;
    /// else the next run does, which retries every parked input anyway).
    Retry(operator::RetryArgs),
    /// Skip a parked input of a run's state, saying why: its key's next input runs.
    Skip(operator::SkipArgs),
    /// Answer a call of a parked input left in doubt (what the remote did, or that it was
    /// never made), then retry the input.
    Resolve(operator::ResolveArgs),
    /// Cancel a key's first unfinished input of a run's state (running, retrying or
    /// parked): it stops at its next durable call, which is not made, and its key goes on.
    Cancel(operator::CancelArgs),
    /// Send a signal to a key's input of a run's state (its first unfinished one, or
    /// --sequence): a wait for it (`await-signal`) takes it, now or when the input reaches
    /// it.
    Signal(operator::SignalArgs),
    /// Kill an agent's run at every durable boundary in turn, recover, and compare with an
    /// uninterrupted run.
    Test(test::TestArgs),
    /// Serve the multi-tenant HTTP API.
    #[cfg(feature = "server")]
    Serve(serve::ServeArgs),
    /// Share an agent's partitions among hosts over NATS JetStream; publish inputs to them
    /// and read their outputs.
    #[cfg(feature = "jetstream")]
    Cluster(Box<cluster::ClusterArgs>),
}

pub fn init_tracing(verbose: u8) {
    let default = match verbose {
        0 => "warn,rewind=info",
        1 => "debug",
        _ => "trace",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .init();
}

/// `--crash-at POINT[:N]` of the long-running commands (`serve`, `cluster run`): a test
/// hook, honoured only by a build whose library has the `test-hooks` feature (the tests').
/// It kills the process the Nth time it reaches POINT (`rewind_host::crash`); any other
/// build refuses it. (`run` and `test` take the environment's `REWIND_CRASH_AT` instead.)
#[cfg(any(feature = "server", feature = "jetstream"))]
#[derive(Debug, Clone, clap::Args)]
pub struct CrashHook {
    #[arg(long, hide = true, value_name = "POINT[:N]")]
    crash_at: Option<rewind_host::crash::Crash>,
}

#[cfg(any(feature = "server", feature = "jetstream"))]
impl CrashHook {
    /// Arms the process when a crash point was given.
    pub fn arm(&self) -> anyhow::Result<()> {
        let Some(crash) = self.crash_at else {
            return Ok(());
        };
        if !rewind_host::crash::HOOKS {
            anyhow::bail!(
                "--crash-at is a test hook, and this build has none (only a build of the \
                 library with the `test-hooks` feature, the tests', honours it)"
            );
        }
        rewind_host::crash::arm(crash);
        tracing::warn!("armed to crash at {crash}");
        Ok(())
    }
}

/// The environment variables that are test hooks: they kill the process at a durable
/// boundary, count the boundaries it reaches, or make its clocks and random sources
/// predictable.
const TEST_HOOKS: [&str; 5] = [
    rewind_host::crash::ENV,
    rewind_host::crash::COUNT_ENV,
    rewind_host::durable::SEED_ENV,
    rewind_host::functions::SKIP_TIME_ENV,
    rewind_host::agent::script::SIGNALS_ENV,
];

/// Arms the test hooks that `rewind run` and `rewind test` honour (a crash point, seeded
/// clocks, counting crash points: the crash kit's runs); the file to write the counts to,
/// when counting. A long-running server (`serve`, `cluster`) refuses to start with any of
/// them set, naming it: a stray variable must not kill or de-randomise it. `check` and
/// `inspect` reach no durable boundary and ignore them.
pub fn test_hooks(cli: &Cli) -> anyhow::Result<Option<OsString>> {
    let server: Option<&str> = match &cli.command {
        Command::Run(_) | Command::Test(_) => None,
        #[cfg(feature = "server")]
        Command::Serve(_) => Some("rewind serve"),
        #[cfg(feature = "jetstream")]
        Command::Cluster(_) => Some("rewind cluster"),
        Command::New(_)
        | Command::Build(_)
        | Command::Dev(_)
        | Command::Check(_)
        | Command::Inspect(_)
        | Command::Retry(_)
        | Command::Skip(_)
        | Command::Resolve(_)
        | Command::Cancel(_)
        | Command::Signal(_) => {
            return Ok(None);
        }
    };
    if let Some(server) = server {
        if let Some(name) = TEST_HOOKS
            .iter()
            .find(|name| std::env::var_os(name).is_some())
        {
            anyhow::bail!(
                "{name} is set: it is a test hook, honoured only by `rewind run` and `rewind \
                 test`; `{server}` does not start with it (unset it)"
            );
        }
        return Ok(None);
    }
    if let Some(crash) = rewind_host::crash::arm_from_env().context(rewind_host::crash::ENV)? {
        tracing::warn!("armed to crash at {crash}");
    }
    if let Some(seeded) = rewind_host::durable::seed_from_env().map_err(anyhow::Error::msg)? {
        tracing::warn!("clocks and random sources seeded: {seeded}");
    }
    let counts = std::env::var_os(rewind_host::crash::COUNT_ENV);
    if counts.is_some() {
        rewind_host::crash::count();
    }
    Ok(counts)
}

pub async fn main(cli: Cli) -> anyhow::Result<ExitCode> {
    let sandbox = || {
        let mut builder = rewind_host::sandbox::Sandbox::builder();
        if let Some(dir) = &cli.cache_dir {
            builder = builder.cache_dir(Some(dir.clone()));
        }
        builder.build()
    };
    match cli.command {
        Command::New(args) => new::new(args),
        Command::Build(args) => build::build(args, cli.cache_dir.clone()),
        Command::Dev(args) => dev::dev(args, cli.cache_dir.clone()).await,
        Command::Run(args) => run::run(args, sandbox()?).await,
        Command::Check(args) => check::check(args, sandbox()?),
        Command::Inspect(args) => inspect::inspect(args).await,
        Command::Retry(args) => operator::retry(args).await,
        Command::Skip(args) => operator::skip(args).await,
        Command::Resolve(args) => operator::resolve(args).await,
        Command::Cancel(args) => operator::cancel(args).await,
        Command::Signal(args) => operator::signal(args).await,
        Command::Test(args) => test::test(args, cli.cache_dir.clone(), cli.verbose > 0).await,
        #[cfg(feature = "server")]
        Command::Serve(args) => serve::serve(args, sandbox()?).await,
        #[cfg(feature = "jetstream")]
        Command::Cluster(args) => cluster::cluster(*args, || Ok(sandbox()?)).await,
    }
}

/// SIGINT or SIGTERM.
#[cfg(any(feature = "server", feature = "jetstream"))]
async fn shutdown_signal() {
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(e) => {
                tracing::warn!("cannot listen for SIGTERM: {e}");
                std::future::pending::<()>().await;
            }
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        () = terminate => {}
    }
}
